"""`rollout bench`: a tiny scenario through all five modes against a real `rollout serve`
subprocess, the results checked against their JSON Schema, and the design's point (per-turn
work that does not grow with the conversation) shown by the work counters alone (no timing
is asserted anywhere here); what arrived counted, and a server that loses tokens failing;
the command line's messages, Ctrl-C, and the tables at 80 columns."""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import io
import itertools
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from rollout import bench
from rollout._cli import main as rollout_main
from rollout.bench import _runner as bench_runner
from rollout.bench._cli import add_parser, build_config
from rollout.bench._client import Stream, parse_server_timing
from rollout.bench._goals import PACE_CONCURRENCY
from rollout.bench._report import print_tables, summary_tables, to_markdown
from rollout.bench._runner import PACE_EXCESS, PACE_FRACTION, _cpu_model, _versions
from rollout.bench._server import free_port, parse_counters, parse_stage_sums, stop_process
from rollout.bench._stats import percentile, stats
from rollout.bench._streams import check_streams
from rollout.bench._tokens import SIM, load_tokenizer
from rollout.engine._deflate import DEFAULT_WEBSOCKET_DEFLATE
from rollout.engine._heap import freeze_startup_heap
from rollout.engine._serve import ServerConfig, open_server

TINY = [
    "--scenario", "alpha-demo", "--steps", "4", "--tool-tokens", "300", "--prompt-tokens",
    "200", "--output-tokens", "20", "--tool-latency-ms", "1", "--tps", "4000", "--ttft-ms", "5",
    "--repetitions", "1", "--concurrency", "1,2", "--no-progress",
]  # fmt: skip


# The objects frozen as each phase of the tiny run began, and after the run.
FROZEN_IN_PHASES: list[int] = []
FROZEN_AFTER: list[int] = []
# What the tiny run (--no-progress) printed on stderr.
TINY_STDERR: list[str] = []


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("bench")
    capture = _Capture()

    def freeze() -> int:
        FROZEN_IN_PHASES.append(freeze_startup_heap())
        return FROZEN_IN_PHASES[-1]

    gc.unfreeze()
    with capture, pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_runner, "freeze_startup_heap", freeze)
        status = rollout_main(["bench", *TINY, "--out", str(out)])
    FROZEN_AFTER.append(gc.get_freeze_count())
    TINY_STDERR.append(capture.err)
    assert status == 0, capture.text + capture.err
    results = json.loads((out / "results.json").read_text())
    return results, out, capture.text


class _Capture:
    """stdout (`text`) and stderr (`err`) of the CLI (a module-scoped fixture can't use
    capsys)."""

    def __enter__(self) -> None:
        import io

        self._old = sys.stdout, sys.stderr
        self._buffer, self._err = io.StringIO(), io.StringIO()
        sys.stdout, sys.stderr = self._buffer, self._err

    def __exit__(self, *exc: object) -> None:
        sys.stdout, sys.stderr = self._old
        self.text = self._buffer.getvalue()
        self.err = self._err.getvalue()


def test_writes_table_json_and_plots(tiny_run: tuple[dict[str, Any], Path, str]) -> None:
    results, out, stdout = tiny_run
    bench.validate_results(results)
    assert json.loads((out / "results.schema.json").read_text()) == bench.RESULTS_SCHEMA
    for name in ("overhead.png", "e2e.png", "concurrency.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob("server-*.log"))  # the server logged nothing: no empty log
    summary = (out / "summary.md").read_text()
    assert "| ws-rollout |" in summary and "Machine:" in summary
    assert "End-to-end rollout time" in summary and "Goals" in summary
    # stdout: the verdict first and last, the goals between; the tables only in summary.md
    lines = stdout.splitlines()
    assert len(lines) <= 30, stdout
    assert lines[0].startswith("rollout bench: ") and " goals met" in lines[0]
    assert lines[-1].startswith("Verdict: ") and " goals met" in lines[-1]
    assert "Goals (measured, not asserted" in stdout
    assert "End-to-end rollout time" not in stdout
    load = results["meta"]["machine_load"]
    assert load["cpu_count"] and load["loaded"] in (True, False) and load["rule"]
    meta = results["meta"]
    assert meta["machine"]["cpu_count"] and meta["machine"]["python"]
    assert meta["versions"]["trio"]
    assert meta["versions"]["rollout-engine"]  # the benchmark's own distribution, by its name


def test_no_progress_prints_no_progress_lines(
    tiny_run: tuple[dict[str, Any], Path, str],
) -> None:
    """`--no-progress`: nothing on stderr at all (a run with nothing to complain of)."""
    assert TINY_STDERR == [""]


def test_phases_run_with_the_heap_set_aside_and_the_run_gives_it_back(
    tiny_run: tuple[dict[str, Any], Path, str],
) -> None:
    """Each phase starts with the process's heap frozen (a full collection of this process
    would stall the rollouts it measures), and the run thaws it at the end."""
    assert len(FROZEN_IN_PHASES) >= 5 and min(FROZEN_IN_PHASES) > 10_000
    assert FROZEN_AFTER == [0]


_CPUINFO_TWO_AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: Other
stepping\t: 0
"""


def test_machine_record_tells_processor_generations_apart() -> None:
    # Two VMs of this project both said "AMD EPYC", and one was twice as fast as the other.
    assert _cpu_model(_CPUINFO_TWO_AMD) == "AMD EPYC (family 26, model 2, stepping 1)"
    assert _cpu_model("model name\t: Some CPU\n") == "Some CPU"  # no signature: the name
    assert _cpu_model("processor\t: 0\n") is None
    versions = _versions()
    assert versions["rollout-engine"] and "rollout" not in versions


def test_report_of_earlier_results(
    tiny_run: tuple[dict[str, Any], Path, str], tmp_path: Path
) -> None:
    _, out, _ = tiny_run
    capture = _Capture()
    with capture:
        status = rollout_main(
            ["bench", "--report", str(out / "results.json"), "--out", str(tmp_path)]
        )
    assert status == 0
    assert "End-to-end time saved vs http-stateless" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "e2e.png").exists()
    assert "End-to-end time saved" not in capture.text
    assert capture.text.splitlines()[-1].startswith("Verdict: ")
    verbose = _Capture()
    with verbose:
        status = rollout_main(
            ["bench", "--report", str(out / "results.json"), "--out", str(tmp_path), "--verbose"]
        )
    assert status == 0
    assert "End-to-end time saved vs http-stateless" in verbose.text
    assert verbose.text.splitlines()[-1].startswith("Verdict: ")


def test_all_modes_ran_the_same_conversation(
    tiny_run: tuple[dict[str, Any], Path, str],
) -> None:
    results, _, _ = tiny_run
    (server,) = results["servers"]
    assert server["spawned"] and server["metrics"] and server["rollout_extension"]
    assert server["proc_stats"]
    # The client offered permessage-deflate; `rollout serve`'s default decided.
    assert server["websocket_deflate"] is DEFAULT_WEBSOCKET_DEFLATE
    assert server["modes"] == list(bench.MODES)
    for tps in (None, 4000.0):
        rollouts = [r for r in results["rollouts"] if r["tps"] == tps]
        assert sorted(r["mode"] for r in rollouts) == sorted(bench.MODES)
        # The server saw the same conversation in every mode: the sim's output is a function
        # of the rendered context.
        assert len({r["transcript_digest"] for r in rollouts}) == 1
        for r in rollouts:
            assert r["turns"] == 5
            assert r["server_cpu_s"] is not None and r["server_peak_rss_bytes"]
    turns = [t for t in results["turns"] if t["tps"] == 4000.0]
    assert {t["kind"] for t in turns if t["turn"] < 4} == {"tool_call"}
    assert {t["kind"] for t in turns if t["turn"] == 4} == {"text"}
    # Every mode got the server's stage timings, WebSocket ones on every turn.
    for t in turns:
        assert t["server_overhead_s"] is not None, (t["mode"], t["turn"])
        # The request's JSON decode is reported apart from the server's own work.
        assert t["decode_s"] is not None and t["decode_s"]["median"] > 0, (t["mode"], t["turn"])
    (wave_1, wave_2) = sorted(results["concurrency"], key=lambda c: c["concurrency"])
    assert (wave_1["rollouts_ok"], wave_2["rollouts_ok"]) == (1, 2)


def test_counts_what_arrives(tiny_run: tuple[dict[str, Any], Path, str]) -> None:
    """Every turn's tokens are counted in the deltas that arrived, and equal its usage (the
    sim's count: 20 tokens a turn); the events' bytes and their encoding time are recorded."""
    results, _, _ = tiny_run
    assert [s["stream_failures"] for s in results["servers"]] == [0]
    for t in results["turns"]:
        assert t["received_tokens"] == 20, (t["mode"], t["turn"], t["received_tokens"])
        if t["mode"] != "ws-rollout":
            assert t["output_tokens"] == 20
        assert t["events_in"] >= 5 and t["bytes_per_event_in"] > 50, t
        # The counting pass timed the codec on each turn's events.
        assert t["encode_s_per_event"] is not None and 0 < t["encode_s_per_event"] < 0.01, t
    for r in results["rollouts"]:
        assert r["output_tokens_received"] == 5 * 20
    for wave in results["concurrency"]:
        assert wave["output_tokens_received"] == wave["concurrency"] * 5 * 20
        assert wave["turns_failed"] == 0


def _rendered(results: dict[str, Any], mode: str) -> list[int]:
    turns = sorted(
        (t for t in results["turns"] if t["mode"] == mode and t["tps"] == 4000.0),
        key=lambda t: t["turn"],
    )
    return [t["counters"]["tokens_rendered"] for t in turns]


def test_work_counters_stay_flat(tiny_run: tuple[dict[str, Any], Path, str]) -> None:
    """Tokens rendered per turn stay flat for every kind of client: on a WebSocket connection
    (only the new tool output is rendered) and, through the process-wide render cache, for a
    stateless client resending the whole history and an HTTP chain hydrating from the store.
    (The same run without the render cache is test_bench_without_render_cache's.)"""
    results, _, _ = tiny_run
    flat = _rendered(results, "ws-chain")
    for mode in bench.MODES:
        follow_ups = _rendered(results, mode)[1:]
        assert follow_ups == flat[1:], (mode, follow_ups, flat)
    hydrations = {
        r["mode"]: r["counters"]["hydrations"] for r in results["rollouts"] if r["tps"] == 4000.0
    }
    # The HTTP chain's parents are found by id in the render cache once the store confirms
    # them: nothing is hydrated.
    assert hydrations == dict.fromkeys(bench.MODES, 0)


def test_stored_chain_writes_every_turn_and_reads_nothing_back(
    tiny_run: tuple[dict[str, Any], Path, str],
) -> None:
    """ws-chain-stored writes each turn's response and usage and continues from the
    connection's cache (no store reads); ws-chain (store: false) writes usage only. The
    durability table reports the tail per mode. (That the write lands before the terminal
    event is tests/test_crash_durability.py's claim: a scrape after the event cannot tell.)"""
    results, out, _ = tiny_run
    by_mode = {r["mode"]: r for r in results["rollouts"] if r["tps"] == 4000.0}
    stored = by_mode["ws-chain-stored"]["counters_by_turn"]
    plain = by_mode["ws-chain"]["counters_by_turn"]
    assert [(c["store_writes"], c["ledger_records"]) for c in stored] == [(1, 1)] * 5
    assert [(c["store_writes"], c["ledger_records"]) for c in plain] == [(0, 1)] * 5
    assert sum(c["store_reads"] for c in stored) == 0
    assert all(t["tail_s"] is not None for t in results["turns"] if t["tps"] is None)
    assert "Durable acknowledgement: per-turn tail" in (out / "summary.md").read_text()
    assert "(ws-chain-stored minus ws-chain): alpha-demo: " in (out / "summary.md").read_text()


async def test_url_target_in_process(tmp_path: Path) -> None:
    """--url mode against a server the benchmark did not start: no /proc statistics (noted),
    the rollout extension probed and used."""
    async with open_server(ServerConfig(port=0, data_dir=None)) as url:
        config = bench.BenchConfig(
            points=(
                bench.SweepPoint(
                    scenario=bench.PRESETS["alpha-demo"].with_(steps=2, tool_tokens=(50,)),
                    tps=None,
                    repetitions=1,
                    modes=("ws-chain", "ws-rollout"),
                ),
            ),
            servers=(bench.ServerSpec(label="inproc", url=url),),
            out_dir=tmp_path,
        )
        results = await bench.run_benchmark(config)
    bench.validate_results(results)
    (server,) = results["servers"]
    assert server["label"] == "inproc" and not server["spawned"]
    assert server["rollout_extension"] and not server["proc_stats"]
    assert any("CPU and memory not measured" in note for note in server["notes"])
    assert {r["mode"] for r in results["rollouts"]} == {"ws-chain", "ws-rollout"}
    # The counting pass ran the two modes asked for, not all five.
    assert server["modes"] == ["ws-chain", "ws-rollout"]
    assert {r["mode"] for r in results["rollouts"] if r["counters_by_turn"]} == {
        "ws-chain",
        "ws-rollout",
    }
    assert all(r["server_cpu_s"] is None for r in results["rollouts"])


async def test_long_output_suspensions_stay_flat(tmp_path: Path) -> None:
    """The long-output scenario (2,000-character call arguments) through ws-rollout: every
    suspension's bytes (its response.done and the resumed response.in_progress) are recorded,
    equal from the first step to the last up to the digits of growing numbers, although each
    step streams 2 KB more; the suspension table puts the first ones beside the last."""
    scenario = bench.PRESETS["long-output"].with_(steps=12, tool_tokens=(20,))
    async with open_server(ServerConfig(port=0, data_dir=None)) as url:
        config = bench.BenchConfig(
            points=(
                bench.SweepPoint(scenario=scenario, tps=None, repetitions=1, modes=("ws-rollout",)),
            ),
            servers=(bench.ServerSpec(label="inproc", url=url),),
            out_dir=tmp_path,
            counting=False,
        )
        results = await bench.run_benchmark(config)
    bench.validate_results(results)
    turns = sorted(results["turns"], key=lambda t: t["turn"])
    assert len(turns) == scenario.turns
    assert [t["done_bytes"] is None for t in turns] == [False] * scenario.steps + [True]
    assert [t["resume_bytes"] is None for t in turns] == [True] + [False] * scenario.steps
    suspensions = [a["done_bytes"] + b["resume_bytes"] for a, b in itertools.pairwise(turns)]
    assert max(suspensions) - min(suspensions) <= 8, suspensions
    assert max(suspensions) < 1000
    # ... while each turn received more than its 2,000 characters of arguments.
    assert all(t["payload_in_bytes"] > 2000 for t in turns[:-1])
    (table,) = [t for t in summary_tables(results) if "ws-rollout suspensions" in t.title]
    ((name, tps, count, _history, first, last, growth, *_),) = table.rows
    assert (name, tps, count) == ("long-output", "unpaced", "12")
    assert abs(int(growth)) <= 8 and int(last) - int(first) == int(growth)


async def test_servers_compared_interleaved(tmp_path: Path) -> None:
    """Two servers, permessage-deflate on and off: the sweep alternates between them (each
    mode's runs next to each other), every WebSocket turn has its bytes, the deflate one's
    wire bytes are fewer than its payload bytes, and the transport table puts them side by
    side with the cost of deflate."""
    scenario = bench.PRESETS["alpha-demo"].with_(steps=2, tool_tokens=(200,))
    steps: list[str] = []

    def progress(description: str, finished: int) -> None:
        if finished == 0 and "#" in description:
            steps.append(description)

    async with (
        open_server(ServerConfig(port=0, data_dir=None, websocket_deflate=True)) as on,
        open_server(ServerConfig(port=0, data_dir=None, websocket_deflate=False)) as off,
    ):
        config = bench.BenchConfig(
            points=(
                bench.SweepPoint(
                    scenario=scenario, tps=None, repetitions=2, modes=("ws-chain", "http-chain")
                ),
            ),
            servers=(bench.ServerSpec(label="on", url=on), bench.ServerSpec(label="off", url=off)),
            out_dir=tmp_path,
        )
        results = await bench.run_benchmark(config, progress)
    bench.validate_results(results)
    assert [(s["label"], s["websocket_deflate"]) for s in results["servers"]] == [
        ("on", True),
        ("off", False),
    ]
    # Repetition 1 takes the modes and the servers in order, repetition 2 both rotated.
    assert [(step.split(":")[0], step.split(" ")[-2], step[-1]) for step in steps] == [
        ("on", "ws-chain", "1"),
        ("off", "ws-chain", "1"),
        ("on", "http-chain", "1"),
        ("off", "http-chain", "1"),
        ("off", "http-chain", "2"),
        ("on", "http-chain", "2"),
        ("off", "ws-chain", "2"),
        ("on", "ws-chain", "2"),
    ]
    for t in results["turns"]:
        sizes = (t["wire_in_bytes"], t["wire_out_bytes"], t["payload_in_bytes"])
        if t["mode"] == "http-chain":
            assert sizes == (None, None, None)
        elif t["server"] == "on":
            assert sizes[0] < sizes[2] and sizes[1] < t["payload_out_bytes"], t
        else:  # uncompressed: the frames are the payloads plus their headers
            assert sizes[0] > sizes[2] and sizes[1] > t["payload_out_bytes"], t
    (table,) = [t for t in summary_tables(results) if t.title.startswith("WebSocket transport")]
    assert [(row[3], row[4], row[5]) for row in table.rows[:2]] == [
        ("ws-chain", "on", "on"),
        ("ws-chain", "off", "off"),
    ]
    (costs,) = [t for t in summary_tables(results) if t.title.startswith("permessage-deflate")]
    ((scenario, tps, mode, turns, _, sent_ratio, *_),) = costs.rows
    assert (scenario, tps, mode, turns) == ("alpha-demo", "unpaced", "ws-chain", "2")
    assert float(sent_ratio.removesuffix("x")) > 1
    assert "on) vs off (off)" in to_markdown(results, [costs])


def test_schema_file_is_the_schema() -> None:
    path = Path(bench.__file__).parent / "results.schema.json"
    assert json.loads(path.read_text()) == bench.RESULTS_SCHEMA


def test_filler_text_is_exactly_n_tokens() -> None:
    from rollout.engine._tokenizer import O200kTokenizer

    tokenizer = O200kTokenizer()
    for n, seed in ((1, "a"), (37, "b"), (4000, "c")):
        assert len(tokenizer.encode(bench.filler_text(n, seed))) == n
    assert bench.filler_text(50, "x") == bench.filler_text(50, "x")
    for scenario in bench.PRESETS.values():
        assert len(tokenizer.encode(scenario.tool_output(3))) == scenario.tool_tokens_at(3)


def test_public_names() -> None:
    public = {name for name in dir(bench) if not name.startswith("_")}
    assert public == set(bench.__all__)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_plans() -> None:
    quick = build_config(_args())
    assert quick.preset == "quick"
    assert {p.scenario.name for p in quick.points} == set(bench.PRESETS)
    assert {p.tps for p in quick.points} == {None, *bench.SPEED_SWEEP}
    assert quick.concurrency == (1, 4, 16)
    full = build_config(_args("--full"))
    assert full.concurrency == (1, 8, 16, 32, 64, 256)
    # long-output runs unpaced and at 4,000 tps only (30,000 output tokens a rollout)
    assert len(full.points) == (len(bench.PRESETS) - 1) * (1 + len(bench.SPEED_SWEEP)) + 2
    assert {p.tps for p in full.points if p.scenario.name == "long-output"} == {None, 4000.0}
    assert all(set(p.modes) == set(bench.MODES) for p in full.points)
    urls = build_config(_args("--url", "a=http://127.0.0.1:1/v1", "--url", "http://h:2/v1"))
    assert [(s.label, s.url) for s in urls.servers] == [
        ("a", "http://127.0.0.1:1/v1"),
        ("url2", "http://h:2/v1"),
    ]
    both = build_config(_args("--url", "x=http://h/v1", "--with-local"))
    assert [s.label for s in both.servers] == ["rollout", "x"]
    local = build_config(
        _args("--local", "on=--websocket-deflate", "--local", "off=--no-websocket-deflate --port 1")
    )
    assert [(s.label, s.url, s.serve_args) for s in local.servers] == [
        ("on", None, ("--websocket-deflate",)),
        ("off", None, ("--no-websocket-deflate", "--port", "1")),
    ]
    with pytest.raises(SystemExit):
        build_config(_args("--local", "no-label"))


def test_parsers() -> None:
    assert parse_server_timing("validate;dur=0.5, render;dur=1.25,classify;desc=x;dur=2") == {
        "validate": 0.0005,
        "render": 0.00125,
        "classify": 0.002,
    }
    assert parse_server_timing(None) is None
    text = (
        '# HELP x\nrollout_work_total{counter="tokens_rendered"} 120\n'
        'rollout_work_total{counter="hydrations"} 3\n'
        'rollout_stage_seconds_sum{stage="render"} 0.25\n'
    )
    assert parse_counters(text) == {"tokens_rendered": 120, "hydrations": 3}
    assert parse_stage_sums(text) == {"render": 0.25}
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    summary = stats([1.0, None, 3.0])
    assert summary is not None and summary["n"] == 2 and summary["median"] == 2.0
    assert stats([None]) is None


def test_missing_matplotlib_is_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(bench.BenchError, match=r"pip install 'rollout-engine\[bench\]'"):
        bench.write_plots({"servers": [], "turns": [], "rollouts": [], "concurrency": []}, Path())


async def test_server_start_failure_is_reported(tmp_path: Path) -> None:
    with pytest.raises(bench.ServerStartError, match="exited"):
        async with bench.open_local_server(
            log_path=tmp_path / "log", extra_args=("--port", "not-a-port")
        ):
            pass  # pragma: no cover


REPO = Path(__file__).resolve().parents[1]


@asynccontextmanager
async def _fault_server(drop_every: int) -> AsyncIterator[str]:
    """`python -m tests.bench_faults` (a server process apart from the benchmark's, as
    `rollout serve` is): its base URL; always stopped, killed if it does not stop."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.bench_faults", "--drop-every", str(drop_every)],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(60):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1)
                assert chunk, f"the server exited ({process.poll()}) before printing its URL"
                line += chunk
        yield line.decode().strip()
    finally:
        await stop_process(process)


# The keep-pace test's wave: K rollouts of 4 turns of 200 tokens at 4,000 tps (about 11 deltas
# a turn), K being the goal's concurrency.
PACE_SCENARIO = bench.CONCURRENCY_SCENARIO.with_(
    steps=3, tool_tokens=(50,), output_tokens=200, prompt_tokens=100, tool_latency_ms=1.0
)


@pytest.mark.parametrize("drop_every", [10, 0], ids=["drops-every-tenth-delta", "intact"])
async def test_keep_pace_counts_what_arrives(drop_every: int, tmp_path: Path) -> None:
    """The keep-pace goal is judged on what arrives: against a server that drops every tenth
    delta (renumbering the events after it, so the stream stays well-formed), every rollout
    loses tokens, is counted as failed, and the goal fails, whatever the timing; the same
    server without the fault passes the counting (each turn's counted tokens are its usage),
    so its verdict is the stream rate's and the turn time's alone. (Those depend on the
    machine: on a quiet one it keeps pace at K=16; the benchmark of the faulty server as it
    was, trusting nominal sizes, reported it keeping pace too, at 100%/+2%.)"""
    async with _fault_server(drop_every) as url:
        config = bench.BenchConfig(
            points=(),
            concurrency=(PACE_CONCURRENCY,),
            concurrency_modes=("ws-rollout",),
            concurrency_scenario=PACE_SCENARIO,
            concurrency_tps=4000.0,
            servers=(bench.ServerSpec(label="server", url=url),),
            counting=False,
            out_dir=tmp_path,
            timeout=120.0,
        )
        with trio.fail_after(300):
            results = await bench.run_benchmark(config)
    bench.validate_results(results)
    (wave,) = results["concurrency"]
    (goal,) = [g for g in results["goals"] if g["id"] == "keeps-pace"]
    k = PACE_CONCURRENCY
    if drop_every:
        assert (wave["rollouts_ok"], wave["rollouts_failed"]) == (0, k), wave["errors"]
        assert wave["turns_failed"] >= k
        assert all("the stream lost output: turn " in e for e in wave["errors"]), wave["errors"]
        assert wave["keeps_pace"] is False and wave["output_tokens_received"] == 0
        assert goal["met"] is False and "turns lost output" in goal["detail"], goal
    else:
        assert (wave["rollouts_ok"], wave["rollouts_failed"], wave["turns_failed"]) == (k, 0, 0)
        expected = k * PACE_SCENARIO.turns * PACE_SCENARIO.output_tokens
        assert wave["output_tokens_received"] == expected
        pace, excess = wave["pace_ratio"], wave["excess_ratio"]
        assert pace is not None and excess is not None
        on_time = pace >= PACE_FRACTION and excess <= PACE_EXCESS
        assert wave["keeps_pace"] is on_time and goal["met"] is on_time, goal


def _turn(index: int, streams: list[tuple[str, str, str | None]], usage: int | None) -> Any:
    turn = bench.TurnRecord(index=index, sent=0.0, output_tokens=usage)
    turn.streams = [
        Stream(kind=kind, item_id=f"item_{index}_{i}", received=received, final=final)
        for i, (kind, received, final) in enumerate(streams)
    ]
    return turn


def test_check_streams_counts_as_the_sim_does() -> None:
    """The sim's tokens: a word of text, 4 characters of arguments. A turn whose deltas do not
    add up to its item, or whose count is not its usage, fails; ws-rollout's turns must add
    up to its one usage."""
    args = '{"command": "' + "x" * 25 + '"}'  # 40 characters: 10 tokens
    ok = bench.RolloutRecord(mode="ws-chain")
    ok.turns = [
        _turn(0, [("arguments", args, args)], 10),
        _turn(1, [("text", "a b c", "a b c")], 3),
    ]
    check_streams(ok, SIM)
    assert [t.received_tokens for t in ok.turns] == [10, 3] and ok.failures == []
    lost = bench.RolloutRecord(mode="ws-chain")
    lost.turns = [
        _turn(0, [("arguments", args[:-8], args)], 10),
        _turn(1, [("text", "a c", "a b c")], 3),
    ]
    check_streams(lost, SIM)
    assert lost.failures == [
        "turn 0: the arguments deltas of item_0_0 add up to 32 characters, the item has 40; "
        "received 8 tokens, usage.output_tokens is 10",
        "turn 1: the text deltas of item_1_0 add up to 3 characters, the item has 5; "
        "received 2 tokens, usage.output_tokens is 3",
    ]
    rollout = bench.RolloutRecord(mode="ws-rollout")
    rollout.turns = [
        _turn(0, [("arguments", args, args)], None),
        _turn(1, [("text", "a b", "a b")], 13),
    ]
    check_streams(rollout, SIM)
    assert rollout.failures == [
        "turn 1: the rollout received 12 tokens over its turns, usage.output_tokens is 13"
    ]
    # A named tokenizer: its count, and the usage (the model's own count) is not compared.
    other = bench.RolloutRecord(mode="ws-chain")
    other.turns = [_turn(0, [("text", "Hello, world", "Hello, world")], 99)]
    check_streams(other, load_tokenizer("o200k"))
    assert other.turns[0].received_tokens == 3 and other.failures == []
    # No tokenizer: nothing counted, the text still checked.
    unknown = bench.RolloutRecord(mode="ws-chain")
    unknown.turns = [_turn(0, [("text", "Hello", "Hello, world")], 99)]
    check_streams(unknown, None)
    assert unknown.turns[0].received_tokens is None
    assert unknown.failures == [
        "turn 0: the text deltas of item_0_0 add up to 5 characters, the item has 12"
    ]


# --- the command line as a user meets it: one clear line and a status, never a traceback ---

CLI_TIMEOUT = 120.0


def _bench_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollout", "bench", *argv],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        cwd=cwd,
    )


def test_cli_dead_url_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}/v1"
    done = _bench_cli("--url", url, "--no-progress", "--out", "out", cwd=tmp_path)
    assert done.returncode == 1, done
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"rollout bench: url: nothing answers at {url}: cannot connect ("), (
        lines
    )
    assert lines[0].endswith(
        "; is the server running? --url takes its base URL, e.g. http://127.0.0.1:8000/v1"
    ), lines
    assert done.stdout == "" and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--scenario", "alpha"],
            "rollout bench: unknown scenario 'alpha'; the scenarios are alpha-demo, "
            "long-context, codex-like, long-output",
        ),
        (
            ["--url", "localhost:8000"],
            "rollout bench: --url takes a server's base URL, such as http://127.0.0.1:8000/v1, "
            "not 'localhost:8000'",
        ),
        (
            ["--modes", "ws-chain,rollout"],
            "rollout bench: unknown mode 'rollout' in --modes; the modes are http-stateless, "
            "http-chain, ws-chain, ws-chain-stored, ws-rollout",
        ),
        (
            ["--concurrency", "1,four"],
            "rollout bench: --concurrency takes comma-separated counts such as 1,4,16 (0 to "
            "skip), not '1,four'",
        ),
        (["--tps", "0"], "rollout bench: --tps must be a positive number, not 0"),
        (["--repetitions", "0"], "rollout bench: --repetitions must be at least 1, not 0"),
        (["--ttft-ms", "-1"], "rollout bench: --ttft-ms must be at least 0, not -1"),
    ],
)
def test_cli_bad_arguments_are_one_line(argv: list[str], message: str, tmp_path: Path) -> None:
    """A usage error: one line, exit status 2 (as argparse's own)."""
    done = _bench_cli(*argv, "--no-progress", "--out", "out", cwd=tmp_path)
    assert (done.returncode, done.stderr, done.stdout) == (2, message + "\n", "")
    assert not (tmp_path / "out").exists()


def test_cli_report_of_a_missing_file_is_one_line(tmp_path: Path) -> None:
    done = _bench_cli("--report", "missing.json", "--out", "out", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "rollout bench: cannot read missing.json: No such file or directory\n"


def test_cli_unwritable_out_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    done = _bench_cli("--out", "file/out", "--no-progress", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "rollout bench: cannot write the results into file/out: Not a directory\n"


def test_cli_report_of_another_schema_says_so(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema": "rollout-bench/5"}))
    done = _bench_cli("--report", str(old), "--out", "out", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"rollout bench: {old} is rollout-bench/5; this version reads rollout-bench/8 (run the "
        "benchmark again to get one)\n"
    )


def test_cli_ctrl_c_writes_what_finished_and_exits_130(tmp_path: Path) -> None:
    """SIGINT while the sweep runs (at 65 tokens/s, seconds a rollout): no traceback, the
    results of what finished (the counting pass, the overhead phase) with a note, exit 130;
    the local server is stopped."""
    stdout_file = (tmp_path / "stdout").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout", "bench", "--scenario", "alpha-demo", "--steps", "3",
         "--tool-tokens", "50", "--prompt-tokens", "50", "--output-tokens", "20", "--tps", "65",
         "--repetitions", "2", "--concurrency", "0", "--no-plots", "--out", "out"],
        cwd=tmp_path,
        stdout=stdout_file,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + CLI_TIMEOUT
        while not any("@ 65 tps" in line for line in seen):
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        process.send_signal(signal.SIGINT)
        process.wait(timeout=CLI_TIMEOUT)
        reader.join(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stdout_file.close()
    while not lines.empty():
        seen.append(lines.get())
    stdout = (tmp_path / "stdout").read_text()
    assert process.returncode == 130, (seen, stdout)
    stderr = "".join(seen)
    assert "Traceback" not in stderr + stdout
    path = Path("out") / "results.json"
    assert seen[-1] == f"rollout bench: interrupted; {path} holds the rollouts that finished\n"
    results = json.loads((tmp_path / path).read_text())
    bench.validate_results(results)
    assert results["meta"]["interrupted"] is True
    assert any(n.startswith("interrupted (SIGINT)") for n in results["notes"])
    # What finished is there (the unpaced overhead phase ran before the 65 tps point).
    assert {r["tps"] for r in results["rollouts"]} == {None}
    assert not list((tmp_path / "out").glob("server-*.log"))  # it logged nothing


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _split_cells(results: dict[str, Any], width: int) -> tuple[list[str], list[str]]:
    """Render every table on a terminal `width` columns wide: the lines longer than that, and
    the cells' words that do not come out whole as often as the cells hold them (a word split
    across lines, or cut)."""
    tables = summary_tables(results)
    assert tables
    out = _Terminal()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", str(width))
        patch.setenv("NO_COLOR", "1")
        print_tables(results, tables, file=out)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # styles (bold, italic, colours)
    rendered = collections.Counter(re.split(r"[\s│┃]+", text))
    wanted = collections.Counter(
        w for t in tables for row in t.rows for c in row for w in c.split()
    )
    split = [w for w, n in wanted.items() if rendered[w] < n]
    return [line for line in text.splitlines() if len(line) > width], split


def test_tables_fit_80_columns_without_splitting_a_cell(
    tiny_run: tuple[dict[str, Any], Path, str],
) -> None:
    """Every table, of a tiny run and of the committed full run, at 80 columns: no line is
    longer, no number is split (a table too wide becomes one block per row)."""
    committed = json.loads((Path(bench.__file__).parent / "results" / "results.json").read_text())
    for results in (tiny_run[0], committed):
        assert _split_cells(results, 80) == ([], [])
    # The check can fail: rich's own layout, squeezed to 80 columns, folds numbers.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("rollout.bench._report.table_width", lambda _table: 0)
        patch.setattr(
            "rollout.bench._report._column_widths",
            lambda table, width: [None] * len(table.headers),
        )
        _, split = _split_cells(committed, 80)
    assert split


def test_piped_tables_are_the_markdown(tiny_run: tuple[dict[str, Any], Path, str]) -> None:
    results, _, _ = tiny_run
    tables = summary_tables(results)
    piped = io.StringIO()
    print_tables(results, tables, file=piped)
    assert piped.getvalue() == to_markdown(results, tables)
    assert not [line for line in piped.getvalue().splitlines() if line.endswith(" ")]


def test_help_and_readme_state_the_plans() -> None:
    """`rollout bench --help` and bench/README.md say what the code runs, and how long."""
    from rollout.bench import _cli

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    help_text = " ".join(
        parser._subparsers._group_actions[0].choices["bench"].format_help().split()
    )  # type: ignore[union-attr]
    readme = " ".join((Path(bench.__file__).parent / "README.md").read_text().split())
    full = ",".join(map(str, _cli.FULL_CONCURRENCY))
    quick = ",".join(map(str, _cli.QUICK_CONCURRENCY))
    modes = ",".join(_cli.FULL_CONCURRENCY_MODES)
    for text in (help_text, readme):
        assert "1,8,16,32,64,256" == full and full in text and quick in text and modes in text
        assert f"about {_cli.FULL_MINUTES} minutes on 2 cores" in text
        assert f"about {_cli.QUICK_MINUTES} minutes on 2 cores" in text
    root = Path(__file__).parents[1]
    for page in (root / "README.md", root / "docs" / "benchmarking.md"):
        text = " ".join(page.read_text().split())
        assert f"the quick run (~{_cli.QUICK_MINUTES} minutes)" in text, page
        assert f"`--full` everything (~{_cli.FULL_MINUTES} minutes)" in text, page


def test_overhead_table_has_no_empty_columns(tiny_run: tuple[dict[str, Any], Path, str]) -> None:
    """A run whose history stays under 2k has no 8k-95k+ columns full of "-"."""
    results, _, _ = tiny_run
    (table,) = [t for t in summary_tables(results) if "overhead by history window" in t.title]
    assert table.headers == (
        "mode", "server ms 0.5k-2k", "decode ms 0.5k-2k", "ack ms 0.5k-2k",
        "tokens rendered 0.5k-2k",
    )  # fmt: skip
    assert all("-" not in row for row in table.rows)


def test_plots_explain_what_is_missing(tmp_path: Path) -> None:
    """e2e.png marks a mode that did not run at a speed "n/a"; concurrency.png's middle panel
    has a legend naming its series and both thresholds; a narrow latency range is linear."""
    import matplotlib

    matplotlib.use("Agg")
    from rollout.bench import _plots

    committed = json.loads((Path(bench.__file__).parent / "results" / "results.json").read_text())
    quick = {
        **committed,
        "rollouts": [
            r
            for r in committed["rollouts"]
            if r["tps"] != 65.0 or r["mode"] in ("http-stateless", "ws-rollout")
        ],
    }
    import matplotlib.pyplot as plt

    fig = _plots._e2e(plt, quick)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    # three modes did not run at 65 tps, in each of the three scenarios
    assert texts.count("n/a") == 9 and "n/a: the mode did not run" in fig._suptitle.get_text()
    plt.close(fig)
    fig = _plots._concurrency(plt, committed)
    left, middle, _ = fig.axes
    labels = middle.get_legend_handles_labels()[1]
    assert "stream rate threshold (95%)" in labels and "model time / turn threshold (91%)" in labels
    assert "ws-rollout stream rate" in labels and "ws-rollout model time / turn" in labels
    assert middle.get_legend() is not None
    one_mode = {**committed, "concurrency": [
        w for w in committed["concurrency"] if w["mode"] == "ws-rollout" and w["concurrency"] <= 16
    ]}  # fmt: skip
    plt.close(fig)
    fig = _plots._concurrency(plt, one_mode)
    assert fig.axes[0].get_yscale() == "linear"  # 200-230 ms
    plt.close(fig)
    assert left.get_yscale() == "log"  # 200 ms to 10 s


async def test_cli_exits_1_when_the_server_loses_tokens(tmp_path: Path) -> None:
    """`rollout bench --url` against the delta-dropping server: the sweep's mode fails on
    its first rollout (noted, no data point), and the run says so and exits 1."""
    async with _fault_server(10) as url:
        argv = [
            "--url", f"faulty={url}", "--scenario", "alpha-demo", "--steps", "2",
            "--tool-tokens", "50", "--output-tokens", "200", "--tps", "4000",
            "--no-overhead-phase", "--modes", "ws-chain", "--repetitions", "2",
            "--concurrency", "0", "--no-progress", "--no-plots", "--out", "out",
        ]  # fmt: skip
        done = await trio.to_thread.run_sync(functools.partial(_bench_cli, *argv, cwd=tmp_path))
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "rollout bench: faulty lost output: what arrived is not what it produced (1 rollouts "
        "of the sweep, 0 turns of the concurrency sweep; see its notes and errors in "
        "results.json)"
    )
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    (server,) = results["servers"]
    assert server["stream_failures"] == 1 and results["rollouts"] == []
    assert any("ws-chain: the stream lost output: turn " in n for n in server["notes"])


def test_missing_matplotlib_is_said_where_the_outputs_are_listed(
    tiny_run: tuple[dict[str, Any], Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out, _ = tiny_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    capture = _Capture()
    with capture:
        status = rollout_main(
            ["bench", "--report", str(out / "results.json"), "--out", str(tmp_path)]
        )
    assert status == 0
    assert capture.text.splitlines()[-3:-1] == [
        f"summary: {tmp_path / 'summary.md'} (every table)",
        "plots:   none: matplotlib is not installed, so this run writes no plots; `pip install "
        "'rollout-engine[bench]'` adds it, and `rollout bench --report RESULTS_JSON` plots a "
        "finished run",
    ]
    assert not list(tmp_path.glob("*.png"))
