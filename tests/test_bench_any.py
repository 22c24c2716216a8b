"""`rollout bench` against servers that are not rollout's `sim`, as a user meets them: what a
server cannot run is decided before any rollout and reported as not measured, with the
evidence, never as a failure; a model with its own tokenizer completes every mode, its token
counts taken from its usage (or counted with the tokenizer the user names, and set beside the
usage as a figure); two servers come out side by side.

The stand-ins: rollout's own server behind the ASGI wrappers of the conformance tests (one that
ignores `rollout: true`, one that answers `unsupported_parameter` to it), the server with
WebSocket mode off, and rollout as a gateway in front of a scripted chat-completions model whose
usage is in its own tokens (a byte count, as no o200k count would give). A wrong key and a model
the server lacks are tests/test_bench_preflight.py's. Every run is in-process with a deadline,
or the command line in a thread with one."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from rollout import bench
from rollout.bench._tokens import load_tokenizer

from tests.test_bench import _bench_cli
from tests.test_conform import API_KEY, serving
from tests.test_conform_cli import Scope
from tests.test_conform_mutations import Mutant, _json_rewrite
from tests.test_conform_profiles import IgnoresRollout, RefusesExtensionFields
from tests.upstream_harness import (
    Exchange,
    chunk,
    gateway_registry,
    open_fake_upstream,
    open_rollout,
)

DEADLINE = 120.0
SCENARIO = bench.PRESETS["alpha-demo"].with_(
    steps=1, tool_tokens=(20,), prompt_tokens=20, output_tokens=8
)
ALL_MODES = bench.MODES


def _config(servers: tuple[Any, ...], tmp_path: Path, **changes: Any) -> Any:
    changes.setdefault("api_key", API_KEY)
    return bench.BenchConfig(
        points=(bench.SweepPoint(scenario=SCENARIO, tps=None, repetitions=1, modes=ALL_MODES),),
        servers=servers,
        out_dir=tmp_path,
        timeout=60.0,
        **changes,
    )


async def _run(config: Any) -> dict[str, Any]:
    with trio.fail_after(DEADLINE):
        results: dict[str, Any] = await bench.run_benchmark(config)
    bench.validate_results(results)
    return results


def _measured(results: dict[str, Any], server: str) -> list[str]:
    return [r["mode"] for r in results["rollouts"] if r["server"] == server]


# --- what a server cannot run: not measured, with the evidence ------------------------------


@pytest.mark.parametrize(
    ("wrapper", "evidence"),
    [
        (
            IgnoresRollout,
            "no rollout extension: ignored `rollout: true` and completed at the tool call",
        ),
        (RefusesExtensionFields, "no rollout extension: answered error unsupported_parameter"),
    ],
)
async def test_a_server_without_the_rollout_extension_is_not_measured_there(
    wrapper: Any, evidence: str, tmp_path: Path
) -> None:
    async with serving(app_wrapper=wrapper) as url:
        results = await _run(_config((bench.ServerSpec(label="gw", url=url),), tmp_path))
    (server,) = results["servers"]
    assert list(server["not_measured"]) == ["ws-rollout"], server
    assert server["not_measured"]["ws-rollout"].startswith(evidence), server["not_measured"]
    assert server["stream_failures"] == 0 and server["rollout_extension"] is False
    assert _measured(results, "gw") == [m for m in ALL_MODES if m != "ws-rollout"]
    assert not any("failed" in note for note in server["notes"]), server["notes"]


async def test_a_server_without_websocket_mode_runs_its_http_modes(tmp_path: Path) -> None:
    async with serving(websocket=False) as url:
        results = await _run(_config((bench.ServerSpec(label="http-only", url=url),), tmp_path))
    (server,) = results["servers"]
    ws_modes = [m for m in ALL_MODES if m.startswith("ws-")]
    assert sorted(server["not_measured"]) == sorted(ws_modes), server
    for why in server["not_measured"].values():
        assert why.startswith("no WebSocket mode: the upgrade was answered HTTP 426"), why
    assert server["websocket"] is False and server["websocket_deflate"] is None
    assert _measured(results, "http-only") == ["http-stateless", "http-chain"]
    assert server["stream_failures"] == 0
    assert not any("failed" in note for note in server["notes"]), server["notes"]


# --- a model with its own tokenizer ---------------------------------------------------------

CALL_ARGUMENTS = '{"command": "ls -la src"}'
ANSWER = ("The ", "project ", "builds, ", "and ", "its ", "tests ", "pass.")


def own_tokens(text: str) -> int:
    """The model's tokens: two bytes each (no o200k count of these texts is this)."""
    return (len(text.encode()) + 1) // 2


async def own_tokenizer_model(exchange: Exchange) -> None:
    """A chat-completions model that calls `run` until it has a tool result and the user asks
    for the answer (or `tool_choice` is "none"), and reports usage in its own tokens."""
    body = exchange.body
    messages = body["messages"]
    asked = messages[-1]["role"] == "user" and any(m["role"] == "tool" for m in messages)
    prompt = own_tokens(json.dumps(messages))
    if body.get("tool_choice") == "none" or asked or not body.get("tools"):
        chunks = [chunk(content=piece) for piece in ANSWER]
        output, finish = own_tokens("".join(ANSWER)), "stop"
    else:
        call = {"index": 0, "id": "call_own", "type": "function"}
        chunks = [
            chunk(tool_calls=[{**call, "function": {"name": "run", "arguments": ""}}]),
            chunk(tool_calls=[{"index": 0, "function": {"arguments": CALL_ARGUMENTS}}]),
        ]
        output, finish = own_tokens(CALL_ARGUMENTS), "tool_calls"
    usage = {"prompt_tokens": prompt, "completion_tokens": output}
    usage["total_tokens"] = prompt + output
    await exchange.stream([*chunks, chunk(finish=finish), chunk(usage=usage)])


async def answers_unless_told_to_call(exchange: Exchange) -> None:
    """A model that calls a tool only when `tool_choice` names it: left to choose (a rollout's
    `auto`), it answers at once."""
    if not isinstance(exchange.body.get("tool_choice"), dict):
        exchange.body["tool_choice"] = "none"
    await own_tokenizer_model(exchange)


async def _own_tokenizer_run(
    tmp_path: Path, model: Any = own_tokenizer_model, **changes: Any
) -> dict[str, Any]:
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(model) as (upstream_url, _):
            registry = gateway_registry(upstream_url, name="own-model", model="own-model")
            async with open_rollout(registry=registry) as url:
                server = bench.ServerSpec(label="gw", url=url)
                return await _run(
                    _config((server,), tmp_path, model="own-model", api_key=None, **changes)
                )


async def test_a_model_with_its_own_tokenizer_completes_every_mode(tmp_path: Path) -> None:
    """Before: every mode failed at turn 0, "the stream lost tokens: received 6 tokens,
    usage.output_tokens is 13" (the count of what arrived in o200k tokens had to equal the
    server's usage, true only of an o200k model reporting honest counts)."""
    results = await _own_tokenizer_run(
        tmp_path, concurrency=(2,), concurrency_modes=("ws-chain",), concurrency_scenario=SCENARIO
    )
    (server,) = results["servers"]
    (wave,) = results["concurrency"]
    assert (wave["rollouts_ok"], wave["errors"]) == (2, []), wave
    assert wave["output_tokens_received"] == 2 * (
        own_tokens(CALL_ARGUMENTS) + own_tokens("".join(ANSWER))
    )
    assert server["stream_failures"] == 0 and server["not_measured"] == {}, server
    assert _measured(results, "gw") == list(ALL_MODES)
    assert results["meta"]["parameters"]["tokenizer"] == "usage"
    per_rollout = own_tokens(CALL_ARGUMENTS) + own_tokens("".join(ANSWER))
    for rollout in results["rollouts"]:
        # Not counted (no tokenizer named): the server's usage is the count.
        assert rollout["output_tokens_received"] is None, rollout
        assert rollout["output_tokens_reported"] == per_rollout, rollout
        assert rollout["token_ratio"] is None
    assert (
        "output tokens are the server's usage (no --tokenizer to count them with)"
        in (server["notes"])
    )


async def test_a_rollout_the_model_ends_early_is_not_measured(tmp_path: Path) -> None:
    """In ws-rollout a model that is not `sim` chooses its calls; one that answers at once ran
    another workload (one turn where the other modes ran two): not a data point, and said so.
    Before, its 1-turn rollouts stood beside the others' 2-turn ones as a 20-fold speed-up."""
    results = await _own_tokenizer_run(tmp_path, model=answers_unless_told_to_call)
    (server,) = results["servers"]
    assert _measured(results, "gw") == [m for m in ALL_MODES if m != "ws-rollout"]
    assert server["not_measured"] == {
        "ws-rollout": "the rollout ended after 0 of the scenario's 1 tool calls (in one "
        "rollout the model chooses its calls, tool_choice auto; a `sim` model with steps, or "
        "one that keeps calling, runs the scenario)"
    }


async def test_a_named_tokenizer_counts_beside_the_usage(tmp_path: Path) -> None:
    o200k = load_tokenizer("o200k")
    assert o200k is not None
    results = await _own_tokenizer_run(tmp_path, tokenizer=o200k, tokenizer_given=True)
    (server,) = results["servers"]
    assert server["stream_failures"] == 0 and _measured(results, "gw") == list(ALL_MODES)
    counted = o200k.count("arguments", CALL_ARGUMENTS) + o200k.count_text("".join(ANSWER))
    reported = own_tokens(CALL_ARGUMENTS) + own_tokens("".join(ANSWER))
    assert counted != reported
    for rollout in results["rollouts"]:
        assert (rollout["output_tokens_received"], rollout["output_tokens_reported"]) == (
            counted,
            reported,
        )
        assert rollout["token_ratio"] == pytest.approx(counted / reported)
    ratio = f"({counted * 5 / (reported * 5):.2f}x)"
    assert any(n.startswith("o200k counted ") and ratio in n for n in server["notes"]), server


def test_a_tokenizer_file_sizes_the_scenario_in_its_tokens(tmp_path: Path) -> None:
    """A Hugging Face tokenizer.json (each word cut into pieces of two letters: about twice
    o200k's count of the filler) makes the prompt and tool outputs in its own tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"[UNK]": 0, **{a: 0 for a in letters}, **{a + b: 0 for a in letters for b in letters}}
    tokenizer = Tokenizer(
        models.WordLevel(vocab={k: i for i, k in enumerate(vocab)}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("..?"), "isolated")]
    )
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    counter = load_tokenizer(str(path))
    assert counter is not None and counter.name == "file:tokenizer.json"
    assert counter.count_text("the house") == 5  # th e, ho us e
    sized = SCENARIO.with_(prompt_tokens=300, tokenizer=counter)
    assert abs(counter.count_text(sized.prompt()) - 300) <= 3
    assert len(sized.prompt().split()) < 200  # about two tokens a word
    plain = SCENARIO.with_(prompt_tokens=300)  # o200k's: a word each
    assert len(plain.prompt().split()) == 300


def test_an_unknown_tokenizer_is_one_line(tmp_path: Path) -> None:
    done = _bench_cli("--tokenizer", "llama", "--no-progress", "--out", "out", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "rollout bench: --tokenizer takes o200k, cl100k, none or the path of a Hugging Face "
        "tokenizer.json file, not 'llama'\n"
    )


# --- side by side ---------------------------------------------------------------------------


async def test_two_servers_side_by_side_with_what_one_could_not_run(tmp_path: Path) -> None:
    """`--url a=... --url b=...`: one table with both, a mode the second cannot run marked
    not measured, and the evidence under it; the run exits 0 (nothing failed)."""
    async with serving() as full, serving(websocket=False) as http_only:
        argv = [
            "--url", f"full={full}", "--url", f"http-only={http_only}", "--api-key", API_KEY,
            "--scenario", "alpha-demo", "--steps", "1", "--tool-tokens", "20",
            "--prompt-tokens", "20", "--output-tokens", "8", "--tps", "4000",
            "--no-overhead-phase", "--repetitions", "1", "--concurrency", "2",
            "--concurrency-modes", "ws-chain,http-chain", "--no-progress", "--no-plots",
            "--out", "out",
        ]  # fmt: skip
        with trio.fail_after(DEADLINE):
            done = await trio.to_thread.run_sync(functools.partial(_bench_cli, *argv, cwd=tmp_path))
    assert done.returncode == 0, done.stderr
    # stdout is the verdict; every table is in summary.md
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "Side by side" not in done.stdout and "summary.md" in done.stdout, done.stdout
    assert "**Side by side: median turn ms / median rollout s, by server**" in text
    table = text.split("**Side by side: median turn ms")[1].split("\n\n")[1]
    rows = {
        cells[3]: cells
        for line in table.splitlines()
        if line.startswith("| alpha-demo | 4000 |")
        for cells in [[c.strip() for c in line.split("|")]]
    }
    assert rows["ws-chain"][5] == rows["ws-rollout"][5] == "not measured", rows
    assert rows["http-chain"][5] != "not measured" and " / " in rows["http-chain"][5], rows
    assert " / " in rows["ws-rollout"][4], rows  # the full server: measured
    assert (
        "http-only: ws-chain, ws-chain-stored, ws-rollout not measured (no WebSocket mode: "
        "the upgrade was answered HTTP 426" in text
    )
    assert "**Side by side: concurrent rollouts, throughput and rollouts completed**" in text
    assert any(
        line.startswith("| ws-chain | 2 | ") and line.endswith("| not measured |")
        for line in text.splitlines()
    ), text


# --- history a server was to keep -----------------------------------------------------------


class ChangesChainedHistory(Mutant):
    """A gateway that loses part of what a chained HTTP request brings (here, the tool output's
    text), as one that drops history it cannot find does: the model sees another conversation."""

    def request_body(self, scope: Scope, body: bytes) -> bytes:
        def edit(request: Any) -> None:
            if isinstance(request, dict) and request.get("previous_response_id"):
                for item in request.get("input") or []:
                    if isinstance(item, dict) and item.get("type") == "function_call_output":
                        item["output"] = "ok"

        return _json_rewrite(body, edit)


@pytest.mark.parametrize("changed", [False, True])
async def test_a_server_that_changes_the_history_it_keeps_is_noted(
    changed: bool, tmp_path: Path
) -> None:
    wrapper = ChangesChainedHistory if changed else Mutant
    async with serving(app_wrapper=wrapper) as url:
        config = _config((bench.ServerSpec(label="gw", url=url),), tmp_path)
        results = await _run(attrs.evolve(config, counting=False))
    (server,) = results["servers"]
    digests = {r["mode"]: r["transcript_digest"] for r in results["rollouts"]}
    notes = [n for n in server["notes"] if "the transcripts differ" in n]
    if not changed:
        assert len(set(digests.values())) == 1 and notes == [], (digests, notes)
        return
    assert digests["http-chain"] != digests["http-stateless"] == digests["ws-chain"]
    assert notes == [
        "http-chain: the model answered differently than in http-stateless (the transcripts "
        "differ): the server did not pass on the same conversation "
        "(history it was to keep lost or changed)"
    ]
