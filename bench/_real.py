"""`rollout bench --scenario real-model`: the design's claim, measured with a real model.

Long because a real model's run needs its own plan, memory phase, goals and summary: the model's
time dominates, so what is measured and how it is judged differ from the simulated scenarios.

A real model pays for every token it reads. A stateless client resends its whole history each
turn; a server without a prefix cache reads it all again (prefill), so a tool loop's turns grow
with the conversation. The rollout coroutine keeps the model's KV cache across its suspensions
and reads only the new tool output. This runner shows that with the packaged SmolLM2-135M
(`smollm2`, the `llama` extra), in one run, on two local servers:

- `kv`: `rollout serve` as it ships (the KV index on: `--kv-cache-mb 256`), where every way a
  client runs the loop should read only what is new;
- `nokv`: `--kv-cache-mb 0`, a server that keeps the KV only for rollouts and WebSocket lanes
  (what a stateless server without prefix caching pays, for the HTTP modes).

The loop is forced and greedy (`smollm2:calls=N`, temperature 0): N calls of a `run` tool, then
an answer, each turn at most `max_output_tokens`; the client answers each call at once with a
tool output of `tool_tokens` filler words. Four modes (http-stateless, http-chain, ws-chain,
ws-rollout), each under an API key of its own (the KV index is per owner: no mode finds another
mode's KV), interleaved mode by mode and server by server so that a load on the machine falls on
all alike; an untimed warm-up per server first (the model's first load). Each turn records its
time (request sent to terminal event, on the client's clock), its context (the model's tokens:
usage.input_tokens, the same at a turn index for every mode since sampling is greedy) and the
`tokens_prefilled` work counter's delta around it (/metrics, read between turns: the servers
run one turn at a time, so each delta is the turn's own).

Then a memory phase on a third, fresh server: `memory_rollouts` rollouts whose prompts are about
`memory_context_tokens` tokens, each suspended at its tool call (`response.done`) at the same
time; the server's resident memory before and after, against the documented budget (23,040
bytes of KV per SmolLM2 token, docs/serving.md: A real model inside).

Goals (docs/benchmarking.md): ws-rollout at least 40% faster end to end than
http-stateless on `nokv`; on `kv` every mode's time per turn within 1.3x of ws-rollout's at the
same turn; the suspended rollouts' memory within the documented bytes per token.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import attrs
import httpx
import trio
import trio_websocket
from rollout.engine._llama import DEFAULT_KV_MEMORY_MB

from ._client import RolloutSpec, run_rollout
from ._errors import BenchError, ServerError
from ._records import RolloutRecord
from ._scenario import TOOL_NAME, Scenario, filler_text
from ._server import Endpoint, open_local_server, parse_counters, scrape_metrics

__all__ = [
    "REAL_MODEL",
    "REAL_SCHEMA_ID",
    "RealPlan",
    "evaluate_goals",
    "render_summary",
    "run_real_model",
]

REAL_MODEL = "real-model"
REAL_SCHEMA_ID = "rollout-bench-real-model/1"
MODES = ("http-stateless", "http-chain", "ws-chain", "ws-rollout")
# The two server configurations of a run (label, extra `rollout serve` arguments).
DEFAULT_SERVERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kv", ()),
    ("nokv", ("--kv-cache-mb", "0")),
)
# Bytes of KV per token of SmolLM2-135M-Instruct (f16 keys and values, 30 layers x 3 KV heads x
# 64), as docs/serving.md's "A real model inside" documents it.
SMOLLM2_KV_BYTES_PER_TOKEN = 23_040
# Goals of the scenario (docs/benchmarking.md; issue 28).
GOAL_E2E_SPEEDUP = 0.40  # ws-rollout vs http-stateless, KV index off
GOAL_TURN_RATIO = 1.3  # each mode's time per turn vs ws-rollout's, KV index on
# The memory budget of a real-model server over its memory before the model loads: the KV
# pool (`kv_memory_mb`, allocated whole when the model first runs: docs/serving.md, A real
# model inside), the weights (the GGUF file), and this allowance for llama.cpp's compute
# buffers (a 512-token batch), the sampler and what the suspended rollouts hold besides their
# KV.
COMPUTE_ALLOWANCE_MB = 256
# How long a real-model server gets to start (it loads its vocabulary, not the model).
WARMUP_TIMEOUT = 300.0
# A filler word is one o200k token and about 1.075 of SmolLM2's (3,200 words made 3,441
# tokens of context): the memory phase's prompt size in words, per model token wanted.
WORDS_PER_MODEL_TOKEN = 0.93

RUN_TOOL = {
    "type": "function",
    "name": TOOL_NAME,
    "description": "Run a shell command in the project and return its output.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
        "additionalProperties": False,
    },
}
INSTRUCTIONS = "You are a coding agent. Use the run tool to inspect the project."


class LoopSize(Protocol):
    """The sizes of a real model's tool loop (`RealPlan`, `BatchPlan`: frozen)."""

    @property
    def calls(self) -> int: ...
    @property
    def tool_tokens(self) -> int: ...
    @property
    def max_output_tokens(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...


def tool_loop(name: str, what: str, size: LoopSize) -> Scenario:
    """A real model's tool loop as a scenario: `what` and its sizes."""
    return Scenario(
        name=name,
        description=f"{what}: {size.calls} calls, {size.tool_tokens}-word tool outputs, at "
        f"most {size.max_output_tokens} output tokens a turn",
        steps=size.calls,
        tool_tokens=(size.tool_tokens,),
        tool_latency_ms=0.0,
        output_tokens=size.max_output_tokens,
        prompt_tokens=size.prompt_tokens,
    )


@attrs.frozen(kw_only=True)
class RealPlan:
    """What a real-model run measures (the defaults fit ~10 minutes on 2 idle cores)."""

    model: str = "smollm2"
    calls: int = 12  # tool calls before the answer: 13 turns
    tool_tokens: int = 400  # filler words per tool output (about 480 SmolLM2 tokens)
    prompt_tokens: int = 120
    max_output_tokens: int = 64
    repetitions: int = 1
    memory_rollouts: int = 8
    memory_context_tokens: int = 4000
    servers: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_SERVERS
    timeout: float = 1800.0

    def scenario(self) -> Scenario:
        return tool_loop(REAL_MODEL, f"a forced, greedy tool loop on {self.model}", self)

    def spec(self, *, calls: int | None = None) -> RolloutSpec:
        """Each mode's rollout. `max_output_tokens` caps every turn (a rollout's too: the engine
        applies it to each turn of the one response), so the answer is cut where every mode
        cuts it (the turn ends `incomplete`, which here is a turn like any other)."""
        n = self.calls if calls is None else calls
        return RolloutSpec(
            scenario=self.scenario().with_(steps=n),
            model=f"{self.model}:calls={n}",
            run_tools=False,
            timing=False,
            counter=None,
            timeout=self.timeout,
            tools=(RUN_TOOL,),
            incomplete_ends=True,
            body=(("temperature", 0), ("max_output_tokens", self.max_output_tokens)),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "calls": self.calls,
            "turns": self.calls + 1,
            "tool_words": self.tool_tokens,
            "prompt_words": self.prompt_tokens,
            "max_output_tokens": self.max_output_tokens,
            "repetitions": self.repetitions,
            "memory_rollouts": self.memory_rollouts,
            "memory_context_tokens": self.memory_context_tokens,
            "servers": {label: list(args) for label, args in self.servers},
        }


def mode_key(mode: str) -> str:
    """Each mode's API key: the KV index is per owner, so no mode reuses another's KV."""
    return f"sk-bench-{mode}"


Progress = Callable[[str], None]


async def run_real_model(plan: RealPlan, out_dir: Path, progress: Progress) -> dict[str, Any]:
    """Run the plan against local servers; return the results (not yet written)."""
    started = time.time()
    load_start = _loadavg()
    keys = [arg for mode in (*MODES, "memory", "warmup") for arg in ("--api-key", mode_key(mode))]
    runs: list[dict[str, Any]] = []
    async with _servers(plan, out_dir, keys) as endpoints:
        for label, endpoint in endpoints.items():
            progress(f"{label}: warm-up (the model's first load; not timed)")
            await run_rollout("http-stateless", _keyed(endpoint, "warmup"), plan.spec(calls=1))
        for rep in range(plan.repetitions):
            # Each repetition starts with the next mode: a stretch of load on the machine
            # falls on a different mode each time.
            for i, mode in enumerate((*MODES[rep % 4 :], *MODES[: rep % 4])):
                labels = list(endpoints)
                if (rep + i) % 2:
                    labels.reverse()
                for label in labels:
                    progress(f"{label}: {mode} (repetition {rep + 1} of {plan.repetitions})")
                    runs.append(await _timed(plan, label, endpoints[label], mode, rep))
    progress("memory: suspended rollouts")
    memory = await _memory_phase(plan, out_dir, keys)
    results: dict[str, Any] = {
        "schema": REAL_SCHEMA_ID,
        "meta": run_meta(started, load_start),
        "plan": plan.as_dict(),
        "runs": runs,
        "memory": memory,
    }
    results["goals"] = evaluate_goals(results)
    return results


@asynccontextmanager
async def _servers(
    plan: RealPlan, out_dir: Path, keys: list[str]
) -> AsyncIterator[dict[str, Endpoint]]:
    """The plan's servers, started together and stopped together."""
    async with AsyncExitStack() as stack:
        opened: dict[str, Endpoint] = {}
        for label, args in plan.servers:
            opened[label] = await stack.enter_async_context(
                open_local_server(
                    log_path=out_dir / f"serve-{label}.log", label=label, extra_args=(*keys, *args)
                )
            )
        yield opened


def _keyed(endpoint: Endpoint, mode: str) -> Endpoint:
    return attrs.evolve(endpoint, api_key=mode_key(mode))


async def _timed(
    plan: RealPlan, label: str, endpoint: Endpoint, mode: str, rep: int
) -> dict[str, Any]:
    keyed = _keyed(endpoint, mode)
    async with httpx.AsyncClient(timeout=30.0) as client:

        async def scrape() -> dict[str, int] | None:
            text = await scrape_metrics(client, keyed)
            return None if text is None else parse_counters(text)

        try:
            record = await run_rollout(mode, keyed, plan.spec(), scrape=scrape)
        except ServerError as exc:
            return {"server": label, "mode": mode, "repetition": rep, "error": str(exc)}
    return _run_record(label, mode, rep, record)


def _run_record(label: str, mode: str, rep: int, record: RolloutRecord) -> dict[str, Any]:
    turns = []
    for turn in record.turns:
        counters = turn.counters or {}
        turns.append(
            {
                "index": turn.index,
                "kind": turn.kind,
                "seconds": round(turn.duration, 4),
                "context_tokens": turn.context_tokens,
                "tokens_prefilled": counters.get("tokens_prefilled"),
                "output_tokens": turn.output_tokens,
                "failure": turn.failure,
            }
        )
    return {
        "server": label,
        "mode": mode,
        "repetition": rep,
        "seconds": round(record.duration, 3),
        "transcript": record.transcript_digest(),
        "tokens_prefilled": sum(t["tokens_prefilled"] or 0 for t in turns),
        "output_tokens": sum(t["output_tokens"] or 0 for t in turns),
        "turns": turns,
    }


async def _memory_phase(plan: RealPlan, out_dir: Path, keys: list[str]) -> dict[str, Any]:
    """`memory_rollouts` rollouts of ~`memory_context_tokens` tokens, suspended together, on a
    fresh server: its resident memory cold (no model yet: it loads on first use), warm (after
    one short turn: the weights and the KV pool, allocated whole when the model first runs),
    and while the rollouts are held."""
    words = int(plan.memory_context_tokens * WORDS_PER_MODEL_TOKEN)
    async with (
        open_local_server(
            log_path=out_dir / "serve-memory.log", label="memory", extra_args=tuple(keys)
        ) as endpoint,
        httpx.AsyncClient(timeout=30.0) as client,
    ):
        cold = _rss(endpoint.pid)
        await run_rollout("http-stateless", _keyed(endpoint, "warmup"), plan.spec(calls=1))
        warm = _rss(endpoint.pid)
        keyed = _keyed(endpoint, "memory")
        before = parse_counters(await scrape_metrics(client, keyed) or "")
        held = 0
        all_held = trio.Event()
        release = trio.Event()

        async def hold(i: int) -> None:
            nonlocal held
            async with _suspended(keyed, plan, words, i):
                held += 1
                if held == plan.memory_rollouts:
                    all_held.set()
                await release.wait()

        async with trio.open_nursery() as nursery:
            for i in range(plan.memory_rollouts):
                nursery.start_soon(hold, i)
            with trio.fail_after(plan.timeout):
                await all_held.wait()
            after = _rss(endpoint.pid)
            counters = parse_counters(await scrape_metrics(client, keyed) or "")
            release.set()
    tokens = counters.get("tokens_prefilled", 0) - before.get("tokens_prefilled", 0)
    model = packaged_model_bytes()
    budget = (DEFAULT_KV_MEMORY_MB + COMPUTE_ALLOWANCE_MB) * 2**20 + model
    peak = None if after is None or cold is None else after["peak"] - cold["rss"]
    return {
        "rollouts": plan.memory_rollouts,
        "held_tokens": tokens,
        "rss_cold": cold,
        "rss_warm": warm,
        "rss_held": after,
        "kv_pool_bytes": int(DEFAULT_KV_MEMORY_MB * 2**20),
        "model_file_bytes": model,
        "budget_bytes": int(budget),
        "peak_over_cold": peak,
        "held_kv_bytes_documented": tokens * SMOLLM2_KV_BYTES_PER_TOKEN,
        "growth_while_held": None if after is None or warm is None else after["rss"] - warm["rss"],
    }


def packaged_model_bytes() -> int:
    from rollout.engine._llama_vocab import packaged_smollm2

    path = packaged_smollm2()
    return path.stat().st_size if path is not None else 0


@asynccontextmanager
async def _suspended(endpoint: Endpoint, plan: RealPlan, words: int, i: int) -> AsyncIterator[None]:
    """One rollout, held suspended at its tool call while in the block."""
    prompt = filler_text(words, f"{REAL_MODEL}:memory:{i}")
    headers = [(b"authorization", f"Bearer {endpoint.api_key}".encode())]
    async with trio_websocket.open_websocket_url(
        endpoint.ws_url, extra_headers=headers, max_message_size=64 * 1024 * 1024
    ) as ws:
        create = {
            "type": "response.create",
            "model": f"{plan.model}:calls=1",
            "instructions": INSTRUCTIONS,
            "tools": [RUN_TOOL],
            "temperature": 0,
            "max_output_tokens": plan.max_output_tokens,
            "rollout": True,
            "store": False,
            "input": [{"type": "message", "role": "user", "content": prompt}],
        }
        await ws.send_message(json.dumps(create))
        while True:
            event = json.loads(await ws.get_message())
            kind = event.get("type")
            if kind == "response.done":
                break
            if kind in ("error", "response.failed", "response.completed", "response.incomplete"):
                raise BenchError(f"memory phase, rollout {i}: {kind}: {json.dumps(event)[:300]}")
        yield None


def _rss(pid: int | None) -> dict[str, int] | None:
    """VmRSS and VmHWM of the server process, in bytes."""
    if pid is None:
        return None
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out["rss" if line.startswith("VmRSS") else "peak"] = int(line.split()[1]) * 1024
    except OSError:
        return None
    return out if len(out) == 2 else None


# --- goals and the report -------------------------------------------------------------------


def _ok_runs(results: dict[str, Any], server: str, mode: str) -> list[dict[str, Any]]:
    return [
        r
        for r in results["runs"]
        if r["server"] == server and r["mode"] == mode and "error" not in r
    ]


def _median_seconds(runs: Sequence[dict[str, Any]]) -> float | None:
    return statistics.median(r["seconds"] for r in runs) if runs else None


def per_turn_seconds(results: dict[str, Any], server: str, mode: str) -> list[float]:
    """Each turn's least time over the repetitions (turns every repetition has): the turn's
    own cost, less what other load on the machine added to some of its runs (as `timeit`
    takes the least of its repeats); with one repetition, its times."""
    runs = _ok_runs(results, server, mode)
    if not runs:
        return []
    n = min(len(r["turns"]) for r in runs)
    return [min(r["turns"][i]["seconds"] for r in runs) for i in range(n)]


def evaluate_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with its figure and verdict (MET, MISSED, or not measured)."""
    goals: list[dict[str, Any]] = []
    servers = list(results["plan"]["servers"])
    nokv = "nokv" if "nokv" in servers else None
    kv = "kv" if "kv" in servers else None
    if nokv is not None:
        rollout = _median_seconds(_ok_runs(results, nokv, "ws-rollout"))
        stateless = _median_seconds(_ok_runs(results, nokv, "http-stateless"))
        figure = None if rollout is None or not stateless else 1 - rollout / stateless
        goals.append(
            {
                "goal": "ws-rollout end to end vs http-stateless, KV index off",
                "target": f">= {GOAL_E2E_SPEEDUP:.0%} faster",
                "figure": None if figure is None else round(figure, 4),
                "detail": f"ws-rollout {_s(rollout)}, http-stateless {_s(stateless)}",
                "met": None if figure is None else figure >= GOAL_E2E_SPEEDUP,
            }
        )
    if kv is not None:
        base = per_turn_seconds(results, kv, "ws-rollout")
        for mode in MODES:
            if mode == "ws-rollout":
                continue
            mine = per_turn_seconds(results, kv, mode)
            n = min(len(base), len(mine))
            ratios = [mine[i] / base[i] for i in range(n) if base[i] > 0]
            worst = max(ratios) if ratios else None
            at = ratios.index(worst) if worst is not None else None
            goals.append(
                {
                    "goal": f"{mode} time per turn vs ws-rollout's, KV index on",
                    "target": f"<= {GOAL_TURN_RATIO:g}x at every turn",
                    "figure": None if worst is None else round(worst, 3),
                    "detail": (
                        "no data"
                        if worst is None
                        else f"worst at turn {at}; median {statistics.median(ratios):.2f}x "
                        f"over {len(ratios)} turns"
                    ),
                    "met": None if worst is None else worst <= GOAL_TURN_RATIO,
                }
            )
    memory = results.get("memory") or {}
    peak = memory.get("peak_over_cold")
    budget = memory.get("budget_bytes")
    goals.append(
        {
            "goal": f"peak memory with {memory.get('rollouts')} suspended rollouts "
            f"(~{results['plan']['memory_context_tokens']} tokens each), over the server's "
            "memory before the model loaded",
            "target": f"<= the KV pool + the weights + {COMPUTE_ALLOWANCE_MB} MiB ({_mib(budget)})",
            "figure": None if peak is None else round(peak / 2**20),
            "unit": "MiB",
            "detail": _memory_detail(memory),
            "met": None if peak is None or budget is None else peak <= budget,
        }
    )
    return goals


def _memory_detail(memory: dict[str, Any]) -> str:
    cold, warm, held = memory.get("rss_cold"), memory.get("rss_warm"), memory.get("rss_held")
    if not (cold and warm and held):
        return "no /proc figures"
    return (
        f"RSS cold {_mib(cold['rss'])}, warm {_mib(warm['rss'])}, with the rollouts held "
        f"{_mib(held['rss'])} (peak {_mib(held['peak'])}); {memory['held_tokens']:,} tokens "
        f"held, documented KV {_mib(memory['held_kv_bytes_documented'])} inside the "
        f"{_mib(memory['kv_pool_bytes'])} pool"
    )


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f} MiB"


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f} s"


def render_summary(results: dict[str, Any]) -> str:
    """The run as Markdown: goals first, then end to end, then per turn."""
    plan = results["plan"]
    lines = summary_head(results, f"{REAL_MODEL} ({plan['model']}, {plan['turns']} turns)")
    lines += [
        "",
        "## End to end (median over repetitions)",
        "",
        "| server | mode | seconds | tokens prefilled | vs http-stateless |",
        "|---|---|---|---|---|",
    ]
    for label in plan["servers"]:
        stateless = _median_seconds(_ok_runs(results, label, "http-stateless"))
        for mode in MODES:
            runs = _ok_runs(results, label, mode)
            if not runs:
                errors = [
                    r["error"]
                    for r in results["runs"]
                    if r["server"] == label and r["mode"] == mode
                ]
                lines.append(
                    f"| {label} | {mode} | failed: {errors[0][:120] if errors else 'not run'} | | |"
                )
                continue
            seconds = _median_seconds(runs)
            prefilled = statistics.median(r["tokens_prefilled"] for r in runs)
            vs = f"{seconds / stateless:.2f}x" if seconds and stateless else "n/a"
            lines.append(f"| {label} | {mode} | {seconds:.1f} | {prefilled:,.0f} | {vs} |")
    lines += ["", "## Per turn (seconds, the least over repetitions / tokens prefilled)", ""]
    for label in plan["servers"]:
        contexts = _contexts(results, label)
        lines += [
            f"### {label}",
            "",
            "| turn | context | " + " | ".join(MODES) + " |",
            "|---" * (2 + len(MODES)) + "|",
        ]
        table = {mode: _turns(results, label, mode) for mode in MODES}
        n = max((len(t) for t in table.values()), default=0)
        for i in range(n):
            cells = []
            for mode in MODES:
                turns = table[mode]
                if i < len(turns):
                    seconds, prefilled = turns[i]
                    cells.append(f"{seconds:.2f} / {prefilled if prefilled is not None else '?'}")
                else:
                    cells.append("")
            context = contexts[i] if i < len(contexts) else None
            lines.append(
                f"| {i} | {context if context is not None else ''} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    memory = results["memory"]
    lines += [
        "## Memory",
        "",
        f"{memory['rollouts']} rollouts suspended at once: {_memory_detail(memory)}.",
        "",
    ]
    return "\n".join(lines)


def _turns(results: dict[str, Any], server: str, mode: str) -> list[tuple[float, int | None]]:
    runs = _ok_runs(results, server, mode)
    if not runs:
        return []
    seconds = per_turn_seconds(results, server, mode)
    first = runs[0]["turns"]
    return [(seconds[i], first[i]["tokens_prefilled"]) for i in range(len(seconds))]


def _contexts(results: dict[str, Any], server: str) -> list[int | None]:
    """Each turn's context in the model's tokens (from the modes whose usage has it)."""
    out: list[int | None] = []
    for run in results["runs"]:
        # (ws-rollout's one usage is the whole response's, summed over its turns)
        if run["server"] != server or "error" in run or run["mode"] == "ws-rollout":
            continue
        for turn in run["turns"]:
            while len(out) <= turn["index"]:
                out.append(None)
            if turn["context_tokens"] is not None:
                out[turn["index"]] = turn["context_tokens"]
    return out


def summary_head(results: dict[str, Any], title: str) -> list[str]:
    """A real-model summary's opening: its title, the run's machine and load, the goals."""
    meta = results["meta"]
    lines = [
        f"# rollout bench: {title}",
        "",
        f"Started {meta['started']}, took {meta['seconds']:.0f} s on {meta['cpus']} CPUs; "
        f"load average {_load(meta['loadavg_start'])} at the start, "
        f"{_load(meta['loadavg_end'])} at the end.",
        "",
        "## Goals",
        "",
        "| goal | target | figure | verdict | detail |",
        "|---|---|---|---|---|",
    ]
    for goal in results["goals"]:
        verdict = {True: "MET", False: "MISSED", None: "not measured"}[goal["met"]]
        figure = goal["figure"]
        shown = "n/a" if figure is None else f"{figure:g}"
        if figure is not None and goal.get("unit"):
            shown = f"{figure:,} {goal['unit']}"
        lines.append(
            f"| {goal['goal']} | {goal['target']} | {shown} | {verdict} | {goal['detail']} |"
        )
    return lines


def run_meta(started: float, load_start: list[float] | None) -> dict[str, Any]:
    """A real-model run's `meta`: when, how long, how invoked, on what, under what load."""
    return {
        "started": _iso(started),
        "seconds": round(time.time() - started, 1),
        "argv": ["rollout", *sys.argv[1:]],
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": _loadavg(),
    }


def _load(values: list[float] | None) -> str:
    return "n/a" if not values else " / ".join(f"{v:.2f}" for v in values)


def _loadavg() -> list[float] | None:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


# --- the results' schema and plot ------------------------------------------------------------

_TURN = {
    "type": "object",
    "required": ["index", "kind", "seconds", "context_tokens", "tokens_prefilled", "failure"],
    "properties": {
        "index": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["tool_call", "text"]},
        "seconds": {"type": "number", "minimum": 0},
        "context_tokens": {"type": ["integer", "null"]},
        "tokens_prefilled": {"type": ["integer", "null"]},
        "output_tokens": {"type": ["integer", "null"]},
        "failure": {"type": ["string", "null"]},
    },
}
_RUN = {
    "type": "object",
    "required": ["server", "mode", "repetition"],
    "properties": {
        "server": {"type": "string"},
        "mode": {"enum": list(MODES)},
        "repetition": {"type": "integer", "minimum": 0},
        "error": {"type": "string"},
        "seconds": {"type": "number"},
        "transcript": {"type": "string"},
        "tokens_prefilled": {"type": "integer"},
        "output_tokens": {"type": "integer"},
        "turns": {"type": "array", "items": _TURN},
    },
}
# A results document's goals (this scenario's and `_batch.py`'s): each with its verdict.
GOALS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["goal", "target", "figure", "detail", "met"],
        "properties": {"met": {"type": ["boolean", "null"]}},
    },
}
_RSS = {
    "type": ["object", "null"],
    "required": ["rss", "peak"],
    "properties": {"rss": {"type": "integer"}, "peak": {"type": "integer"}},
}
REAL_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "rollout bench --scenario real-model results",
    "type": "object",
    "required": ["schema", "meta", "plan", "runs", "memory", "goals"],
    "properties": {
        "schema": {"const": REAL_SCHEMA_ID},
        "meta": {
            "type": "object",
            "required": ["started", "seconds", "argv", "cpus", "loadavg_start", "loadavg_end"],
        },
        "plan": {"type": "object", "required": ["model", "calls", "turns", "servers"]},
        "runs": {"type": "array", "items": _RUN},
        "memory": {
            "type": "object",
            "required": [
                "rollouts",
                "held_tokens",
                "rss_cold",
                "rss_warm",
                "rss_held",
                "kv_pool_bytes",
                "model_file_bytes",
                "budget_bytes",
                "peak_over_cold",
                "held_kv_bytes_documented",
                "growth_while_held",
            ],
            "properties": {"rss_cold": _RSS, "rss_warm": _RSS, "rss_held": _RSS},
        },
        "goals": GOALS_SCHEMA,
    },
}


def validate_real(results: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError if the results do not match REAL_SCHEMA."""
    import jsonschema

    jsonschema.validate(results, REAL_SCHEMA)


def write_real_plot(results: dict[str, Any], out_dir: Path) -> Path:
    """real_model.png: time per turn against context, and tokens prefilled per turn, per mode
    and server (matplotlib, imported here: the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ._plots import MODE_COLORS, SERVER_STYLES

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s, label in enumerate(results["plan"]["servers"]):
        contexts = _contexts(results, label)
        style = SERVER_STYLES[s % len(SERVER_STYLES)]
        for mode in MODES:
            turns = _turns(results, label, mode)
            if not turns:
                continue
            xs = [
                contexts[i] if i < len(contexts) and contexts[i] else i for i in range(len(turns))
            ]
            color = MODE_COLORS.get(mode)
            left.plot(xs, [t[0] for t in turns], style, color=color, label=f"{label} {mode}")
            right.plot(
                range(len(turns)),
                [t[1] or 0 for t in turns],
                style,
                color=color,
                label=f"{label} {mode}",
            )
    left.set_xlabel("context at the turn (model tokens)")
    left.set_ylabel("seconds per turn")
    left.set_title("time per turn against history")
    right.set_xlabel("turn")
    right.set_ylabel("tokens prefilled")
    right.set_title("tokens the model read per turn")
    left.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "real_model.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
