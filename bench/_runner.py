"""The benchmark run: plan, drive the rollouts against each server, aggregate to records.

Long because one run drives every mode against every server through phases (sweeps, concurrency
waves, durability, deflate), samples the servers' CPU and memory as it goes, and folds it all
into records.

Every server under test is up for the whole run (local ones are started first), and the
phases take them in turn, interleaved, so that what else the machine does affects them alike:

1. **Probe**: /metrics (work counters), the rollout extension (ws-rollout is skipped on a
   server without it) and whether the server accepts permessage-deflate.
2. **Counting pass**: each scenario once per mode on an unpaced model, reading /metrics after
   every turn: the deterministic work each turn costs the server. It also warms the server.
3. **Sweep**: every point (scenario x model speed) `repetitions` times per mode, the modes in
   a rotating order and, for each mode, every server (also in a rotating order). `tps = None`
   is unpaced (no TTFT, no token pacing): the per-turn overhead phase, where nothing but
   overhead takes time.
4. **Concurrency**: K rollouts at once, each on its own connection, per mode and K, and for
   each, every server.

A server whose benchmark crashes is noted (`CRASH_NOTE`) and left out of the later phases;
the others go on.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import math
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import AsyncExitStack
from importlib import metadata
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from rollout.engine._heap import freeze_startup_heap

from ._client import (
    MODES,
    RolloutRecord,
    RolloutSpec,
    probe_rollout_extension,
    probe_websocket,
    run_rollout,
)
from ._errors import BenchError, StreamError
from ._load import CpuSample, judge_load, sample_cpu
from ._records import TurnRecord
from ._scenario import TOOL_NAME, Scenario, default_ttft_ms, sim_model
from ._server import (
    Endpoint,
    check_reachable,
    open_local_server,
    parse_counters,
    preflight,
    scrape_metrics,
)
from ._stats import median, stats
from ._streams import achieved_tps
from ._tokens import SIM, TokenCounter

__all__ = [
    "PACE_EXCESS",
    "PACE_FRACTION",
    "BenchConfig",
    "Progress",
    "ServerSpec",
    "SweepPoint",
    "run_benchmark",
]

SCHEMA_ID = "rollout-bench/8"
# The start of a note saying the benchmark of a server stopped on an unexpected error.
CRASH_NOTE = "benchmark crashed on server"
INTERRUPTED_NOTE = (
    "interrupted (SIGINT): the results hold the rollouts that finished; those in flight and "
    "the phases after them did not run"
)
# A server keeps pace with the model when the tokens a rollout receives stream at no less than
# this fraction of the model's own tokens per second.
PACE_FRACTION = 0.95
# ... and when its median turn takes at most this much longer than the model's own time (the
# same allowance as the goal for a whole rollout at 4,000 tps).
PACE_EXCESS = 0.10
# A model that is not `sim` may write this many times the scenario's output per turn (at least
# 128 tokens): room for a call's arguments in any tokenizer, a bound on an answer.
MODEL_OUTPUT_FACTOR = 8
# How far apart (seconds) a wave's rollouts start when the model's turn time is unknown.
DEFAULT_STAGGER = 0.2

Progress = Callable[[str, int], None]  # (description, rollouts just finished)


@attrs.frozen(kw_only=True)
class SweepPoint:
    scenario: Scenario
    tps: float | None  # None: unpaced (per-turn overhead phase)
    repetitions: int
    modes: tuple[str, ...] = MODES


@attrs.frozen(kw_only=True)
class ServerSpec:
    label: str
    url: str | None = None  # None: start a local `rollout serve`
    serve_args: tuple[str, ...] = ()  # the local server's extra `rollout serve` arguments


@attrs.frozen(kw_only=True)
class BenchConfig:
    points: tuple[SweepPoint, ...]
    concurrency: tuple[int, ...] = ()
    concurrency_modes: tuple[str, ...] = ("ws-rollout",)
    concurrency_scenario: Scenario | None = None
    concurrency_tps: float = 4000.0
    servers: tuple[ServerSpec, ...] = (ServerSpec(label="rollout"),)
    ttft_ms: float | None = None  # None: by model speed (the engine's sim presets)
    model: str | None = None  # a model id for servers that do not run `sim`
    # `--tokenizer` (`_tokens.py`): how received tokens are counted, and the tokens the
    # scenario's prompt and tool outputs are made in. Unless given: the sim's exact count for
    # the sim models, none (the server's usage) for another model.
    tokenizer: TokenCounter | None = None
    tokenizer_given: bool = False
    api_key: str | None = None
    counting: bool = True
    timeout: float = 900.0
    out_dir: Path = Path("bench-results")
    preset: str = "custom"
    argv: tuple[str, ...] = ()

    @property
    def counter(self) -> TokenCounter | None:
        if self.tokenizer_given:
            return self.tokenizer
        return SIM if self.model is None else None

    @property
    def tokenizer_name(self) -> str:
        counter = self.counter
        return "usage" if counter is None else counter.name

    def sized(self) -> BenchConfig:
        """The plan with its scenarios made in the named tokenizer's tokens (unchanged for the
        sim's count, which is o200k's on input, and without a tokenizer)."""
        counter = self.counter
        if counter is None or counter.exact:
            return self

        def size(scenario: Scenario) -> Scenario:
            return scenario.with_(tokenizer=counter)

        return attrs.evolve(
            self,
            points=tuple(attrs.evolve(p, scenario=size(p.scenario)) for p in self.points),
            concurrency_scenario=None
            if self.concurrency_scenario is None
            else size(self.concurrency_scenario),
        )

    def model_body(self, scenario: Scenario) -> tuple[tuple[str, Any], ...]:
        """Fields every create carries for a model that is not `sim`: greedy sampling (every
        mode then asks for the same work, and a server that changes the conversation shows in
        the transcripts), and its output bounded (a model left to answer may write to the end
        of its context; the sim's output is set by its model id), a turn cut there ending like
        a completed one."""
        if self.model is None:
            return ()
        bound = max(MODEL_OUTPUT_FACTOR * scenario.output_tokens, 128)
        return (("temperature", 0), ("max_output_tokens", bound))

    def ttft_for(self, tps: float | None) -> float:
        if tps is None:
            return 0.0
        return self.ttft_ms if self.ttft_ms is not None else default_ttft_ms(tps)

    def model_for(self, scenario: Scenario, tps: float | None) -> str:
        if self.model is not None:
            return self.model
        return sim_model(
            steps=scenario.steps,
            output_tokens=scenario.output_tokens,
            tps=tps,
            ttft_ms=self.ttft_for(tps),
        )

    def scenarios(self) -> list[Scenario]:
        seen: dict[str, Scenario] = {}
        for point in self.points:
            seen.setdefault(point.scenario.name, point.scenario)
        if self.concurrency and self.concurrency_scenario is not None:
            seen.setdefault(self.concurrency_scenario.name, self.concurrency_scenario)
        return list(seen.values())

    def modes(self) -> list[str]:
        """The modes some phase runs, in `MODES` order (the counting pass runs just these)."""
        wanted = {m for p in self.points for m in p.modes}
        if self.concurrency:
            wanted.update(self.concurrency_modes)
        return [m for m in MODES if m in wanted]

    def planned_rollouts(self, n_servers: int) -> int:
        per_server = sum(p.repetitions * len(p.modes) for p in self.points)
        if self.counting:
            per_server += len(self.scenarios()) * len(self.modes())
        per_server += sum(self.concurrency) * len(self.concurrency_modes)
        return per_server * n_servers


@attrs.define
class _Run:
    """One timed rollout of the sweep."""

    server: str
    mode: str
    scenario: Scenario
    tps: float | None
    repetition: int
    record: RolloutRecord
    cpu_s: float | None
    peak_rss: int | None
    counters: dict[str, int] | None


@attrs.define
class _Wave:
    """K concurrent rollouts."""

    server: str
    mode: str
    scenario: Scenario
    tps: float
    k: int
    records: list[RolloutRecord]
    errors: list[str]
    turns_failed: int  # turns whose streams lost output (their rollouts are errors, not data)
    wall_s: float
    cpu_s: float | None
    peak_rss: int | None
    client_cpu_s: float


@attrs.define
class _ServerInfo:
    label: str
    url: str
    spawned: bool
    modes: list[str]
    rollout_extension: bool
    metrics: bool
    proc_stats: bool
    websocket: bool = False  # the WebSocket handshake succeeded (WebSocket mode)
    websocket_deflate: bool | None = None  # accepts the client's permessage-deflate offer
    # The modes the run wanted that this server could not run, each with the evidence.
    not_measured: dict[str, str] = attrs.field(factory=dict)
    serve_args: list[str] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)
    # Rollouts whose streams lost output (`_streams.check_streams`): reported, never data.
    stream_failures: int = 0


@attrs.define
class _Collected:
    runs: list[_Run] = attrs.field(factory=list)
    waves: list[_Wave] = attrs.field(factory=list)
    counting: dict[tuple[str, str, str], RolloutRecord] = attrs.field(factory=dict)
    servers: list[_ServerInfo] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)
    load_start: list[float] | None = None
    # The machine's and the benchmark's CPU time as the run began (`_load.judge_load`).
    cpu_start: CpuSample | None = None
    interrupted: bool = False  # stopped by SIGINT: the results hold what finished


async def run_benchmark(
    config: BenchConfig, progress: Progress | None = None, *, stop_on_sigint: bool = False
) -> dict[str, Any]:
    """Run the whole benchmark; return the results document (see `bench/SCHEMA.md`).

    A server given by URL that does not answer raises `ServerUnreachable` before anything
    runs. With `stop_on_sigint` (the command line; the main thread only), SIGINT stops the
    run: the rollouts in flight are abandoned, the local servers stopped, and the document
    holds what finished (`meta.interrupted`)."""
    started = time.time()
    config = config.sized()
    collected = _Collected(load_start=_loadavg(), cpu_start=sample_cpu())
    report: Progress = progress or (lambda _d, _n: None)
    run_scope = trio.CancelScope()
    with contextlib.ExitStack() as signals, _one_error():
        async with trio.open_nursery() as watcher:
            if stop_on_sigint:
                receiver = signals.enter_context(trio.open_signal_receiver(signal.SIGINT))
                watcher.start_soon(_stop_on_signal, receiver, run_scope, collected)
            async with AsyncExitStack() as stack:
                http = await stack.enter_async_context(httpx.AsyncClient(timeout=30.0))
                for server in config.servers:
                    if server.url is not None:
                        await check_reachable(http, _endpoint(config, server))
                with run_scope:
                    await _run_phases(config, collected, report, http, stack)
            watcher.cancel_scope.cancel()
    return _build_results(config, collected, started, time.time())


@contextlib.contextmanager
def _one_error() -> Iterator[None]:
    """The error of the run as itself (a `ServerUnreachable`, a `ServerStartError`), not in
    the exception group of the nursery that watches for SIGINT."""
    try:
        yield
    except BaseExceptionGroup as group:
        errors = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
        if len(errors) != 1:
            raise
        error = errors[0]
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        raise error from None


async def _stop_on_signal(
    receiver: AsyncIterator[int], scope: trio.CancelScope, collected: _Collected
) -> None:
    """The first signal cancels the run; later ones are absorbed while the servers stop."""
    async for _ in receiver:
        if not collected.interrupted:
            collected.interrupted = True
            scope.cancel()


def _endpoint(config: BenchConfig, server: ServerSpec) -> Endpoint:
    assert server.url is not None
    return Endpoint(label=server.label, base_url=server.url, api_key=config.api_key)


async def _run_phases(
    config: BenchConfig,
    collected: _Collected,
    report: Progress,
    http: httpx.AsyncClient,
    stack: AsyncExitStack,
) -> None:
    benches: list[_ServerBench] = []
    for server in config.servers:
        if server.url is None:
            endpoint = await stack.enter_async_context(
                open_local_server(
                    log_path=config.out_dir / f"server-{server.label}.log",
                    label=server.label,
                    extra_args=server.serve_args,
                )
            )
        else:
            endpoint = _endpoint(config, server)
        await preflight(
            http, endpoint, _preflight_body(config), limit=config.timeout, tool=TOOL_NAME
        )
        benches.append(_ServerBench(config, endpoint, collected, report, http))
        benches[-1].info.serve_args = list(server.serve_args)
    try:
        for bench in benches:
            await bench.guarded(bench.probe)
        for bench in benches:
            await bench.guarded(bench.counting_pass)
        await _sweep(config, benches)
        await _concurrency(config, benches)
    finally:
        gc.unfreeze()  # what the phases froze goes back to the collector
        for bench in benches:
            bench.finish()


def _preflight_body(config: BenchConfig) -> dict[str, Any]:
    """The scenario's first create, cut short: its model and tools, a call forced (the `sim`
    model calls first anyway; another model is told to)."""
    scenario = config.scenarios()[0]
    body: dict[str, Any] = {
        "model": config.model or sim_model(steps=1, output_tokens=8, tps=None, ttft_ms=0),
        "input": "Run `ls` in the project.",
        "tools": scenario.tools(),
    }
    if config.model is not None:
        body["tool_choice"] = {"type": "function", "name": TOOL_NAME}
    return body


def _rotated(items: Sequence[Any], shift: int) -> list[Any]:
    shift %= max(len(items), 1)
    return [*items[shift:], *items[:shift]]


async def _sweep(config: BenchConfig, benches: Sequence[_ServerBench]) -> None:
    """Every point's repetitions, the modes in a rotating order, each mode on every server in
    a rotating order: the servers' runs of one mode are next to each other in time."""
    for point in config.points:
        spec = RolloutSpec(
            scenario=point.scenario,
            model=config.model_for(point.scenario, point.tps),
            force_tool_choice=config.model is not None,
            counter=config.counter,
            body=config.model_body(point.scenario),
            incomplete_ends=config.model is not None,
            timeout=config.timeout,
        )
        for rep in range(point.repetitions):
            for mode in _rotated(point.modes, rep):
                for bench in _rotated(benches, rep):
                    await bench.guarded(bench.timed, point, spec, mode, rep)


async def _concurrency(config: BenchConfig, benches: Sequence[_ServerBench]) -> None:
    scenario = config.concurrency_scenario
    if scenario is None:
        return
    spec = RolloutSpec(
        scenario=scenario,
        model=config.model_for(scenario, config.concurrency_tps),
        force_tool_choice=config.model is not None,
        counter=config.counter,
        body=config.model_body(scenario),
        incomplete_ends=config.model is not None,
        timeout=config.timeout,
    )
    stagger = _model_seconds(config, scenario, config.concurrency_tps) or DEFAULT_STAGGER
    for mode in config.concurrency_modes:
        for i, k in enumerate(config.concurrency):
            for bench in _rotated(benches, i):
                await bench.guarded(bench.wave, spec, mode, k, stagger)


class _ServerBench:
    """The phases against one server."""

    def __init__(
        self,
        config: BenchConfig,
        endpoint: Endpoint,
        out: _Collected,
        report: Progress,
        http: httpx.AsyncClient,
    ) -> None:
        self.config = config
        self.endpoint = endpoint
        self.out = out
        self.report = report
        self.http = http
        self.proc = endpoint.proc()
        self.failed: dict[str, str] = {}
        self.crashed = False
        self.info = _ServerInfo(
            label=endpoint.label,
            url=endpoint.base_url,
            spawned=endpoint.spawned,
            modes=config.modes(),
            rollout_extension=False,
            metrics=False,
            proc_stats=self.proc is not None and self.proc.cpu_seconds() is not None,
        )
        out.servers.append(self.info)

    async def scrape(self) -> dict[str, int] | None:
        text = await scrape_metrics(self.http, self.endpoint)
        return parse_counters(text) if text is not None else None

    def usable(self, mode: str) -> bool:
        return mode in self.info.modes and mode not in self.failed

    def fail(self, mode: str, exc: BenchError) -> None:
        self.failed[mode] = str(exc)
        self.info.notes.append(f"{mode} failed and was skipped from then on: {exc}")

    def lost_output(self, mode: str, record: RolloutRecord) -> bool:
        """A rollout whose streams lost output (text, or the sim's exact tokens) is a failure
        of the server, not a data point: counted, noted, and the mode is skipped from then on."""
        if not record.failures:
            return False
        self.info.stream_failures += 1
        self.fail(mode, StreamError(f"{mode}: the stream lost output: {record.failures[0]}"))
        return True

    def ended_early(self, mode: str, record: RolloutRecord, spec: RolloutSpec) -> bool:
        """A rollout of fewer turns than the scenario's is another workload, not a data point:
        in ws-rollout a model that is not `sim` chooses its calls (one response has one
        `tool_choice`: auto), and may answer at once. The mode is not measured, with what the
        model did; the other modes force each call."""
        scenario = spec.scenario
        if len(record.turns) >= scenario.turns or not spec.force_tool_choice:
            return False
        calls = sum(1 for t in record.turns if t.kind == "tool_call")
        last = record.turns[-1].status if record.turns else None
        ended = "" if last in (None, "completed", "in_progress") else f" ({last})"
        self.skip(
            [mode],
            f"the rollout ended{ended} after {calls} of the scenario's {scenario.steps} tool "
            "calls (in one rollout the model chooses its calls, tool_choice auto; a `sim` "
            "model with steps, or one that keeps calling, runs the scenario)",
        )
        return True

    def skip(self, modes: Iterable[str], why: str) -> None:
        """Modes this server cannot run: not measured (with the evidence), never failed."""
        skipped = [m for m in modes if m in self.info.modes]
        for mode in skipped:
            self.info.modes.remove(mode)
            self.info.not_measured[mode] = why
        if skipped:
            self.info.notes.append(f"not measured: {', '.join(skipped)} ({why})")

    async def guarded(self, phase: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run a phase (or a step of one) unless this server's benchmark crashed before. A long
        run keeps what it measured: a crash is reported in the results (and makes `rollout
        bench` exit non-zero), and the other servers still run."""
        if self.crashed:
            return
        # Everything alive now (imports, servers, earlier phases' results) is set aside from
        # the collector, so that a full collection in this process does not stall the phase's
        # rollouts for tens of milliseconds (`engine/_heap.py`); `_run_phases` undoes it.
        freeze_startup_heap()
        try:
            await phase(*args)
        except Exception as exc:
            self.crashed = True
            self.out.notes.append(
                f"{CRASH_NOTE} {self.endpoint.label}: "
                + "".join(traceback.format_exception(exc)).strip()
            )

    async def probe(self) -> None:
        info, config = self.info, self.config
        info.metrics = await self.scrape() is not None
        if not info.metrics:
            info.notes.append("no rollout /metrics: work counters not measured")
        if not info.proc_stats:
            info.notes.append(
                "not a local subprocess of the benchmark: server CPU and memory not measured"
            )
        deflate, why = await probe_websocket(self.endpoint)
        info.websocket, info.websocket_deflate = deflate is not None, deflate
        if not info.websocket:
            self.skip([m for m in MODES if m.startswith("ws-")], why)
            return
        probe_model = config.model or sim_model(steps=1, output_tokens=8, tps=None, ttft_ms=0)
        supported, why = await probe_rollout_extension(
            self.endpoint, probe_model, config.scenarios()[0]
        )
        info.rollout_extension = supported
        if not supported:
            self.skip(["ws-rollout"], f"no rollout extension: {why}")

    async def counting_pass(self) -> None:
        config, label = self.config, self.endpoint.label
        if not (config.counting and self.info.metrics and config.model is None):
            return
        for scenario in config.scenarios():
            for mode in config.modes():
                what = f"{label}: counting {scenario.name} {mode}"
                self.report(what, 0)
                if self.usable(mode):
                    spec = RolloutSpec(
                        scenario=scenario,
                        model=config.model_for(scenario, None),
                        run_tools=False,
                        counter=config.counter,
                        timeout=config.timeout,
                        keep_frames=True,
                    )
                    try:
                        record = await run_rollout(mode, self.endpoint, spec, scrape=self.scrape)
                    except BenchError as exc:
                        self.fail(mode, exc)
                    else:
                        if not self.lost_output(mode, record):
                            self.out.counting[(label, mode, scenario.name)] = record
                self.report(what, 1)

    async def timed(self, point: SweepPoint, spec: RolloutSpec, mode: str, rep: int) -> None:
        label, proc = self.endpoint.label, self.proc
        tps_name = "unpaced" if point.tps is None else f"{point.tps:g} tps"
        what = f"{label}: {point.scenario.name} @ {tps_name} {mode} #{rep + 1}"
        self.report(what, 0)
        if self.usable(mode):
            before = await self.scrape() if self.info.metrics else None
            cpu0 = proc.cpu_seconds() if proc else None
            if proc:
                proc.reset_peak()
            try:
                record = await run_rollout(mode, self.endpoint, spec)
            except BenchError as exc:
                self.fail(mode, exc)
            else:
                if self.lost_output(mode, record) or self.ended_early(mode, record, spec):
                    self.report(what, 1)
                    return
                cpu1 = proc.cpu_seconds() if proc else None
                after = await self.scrape() if self.info.metrics else None
                self.out.runs.append(
                    _Run(
                        server=label,
                        mode=mode,
                        scenario=point.scenario,
                        tps=point.tps,
                        repetition=rep,
                        record=record,
                        cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
                        peak_rss=proc.peak_rss_bytes() if proc else None,
                        counters=_delta(before, after),
                    )
                )
        self.report(what, 1)

    async def wave(self, spec: RolloutSpec, mode: str, k: int, stagger: float) -> None:
        what = f"{self.endpoint.label}: {k} concurrent {mode}"
        self.report(what, 0)
        if self.usable(mode):
            tps = self.config.concurrency_tps
            self.out.waves.append(await _wave(self.endpoint, mode, spec, k, tps, stagger))
        self.report(what, k)

    def finish(self) -> None:
        for mode in self.failed:
            if mode in self.info.modes:
                self.info.modes.remove(mode)


def _delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0) for k, v in after.items()}


async def _wave(
    endpoint: Endpoint, mode: str, spec: RolloutSpec, k: int, tps: float, stagger: float
) -> _Wave:
    """K rollouts, the i-th started `stagger * i / K` seconds after the first: spread over one
    turn, as independent agents would be, rather than all sending every turn at once."""
    proc = endpoint.proc()
    records: list[RolloutRecord] = []
    errors: list[str] = []
    turns_failed = 0

    async def one(i: int) -> None:
        nonlocal turns_failed
        await trio.sleep(stagger * i / k)
        try:
            record = await run_rollout(mode, endpoint, spec)
        except BenchError as exc:
            errors.append(str(exc))
            return
        if record.failures:  # what arrived is not what the server produced: no data point
            turns_failed += len(record.failures)
            errors.append(f"{mode}: the stream lost output: {record.failures[0]}")
        else:
            records.append(record)

    cpu0 = proc.cpu_seconds() if proc else None
    if proc:
        proc.reset_peak()
    client0 = time.process_time()
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(k):
            nursery.start_soon(one, i)
    wall = time.perf_counter() - t0
    cpu1 = proc.cpu_seconds() if proc else None
    return _Wave(
        server=endpoint.label,
        mode=mode,
        scenario=spec.scenario,
        tps=tps,
        k=k,
        records=records,
        errors=errors,
        turns_failed=turns_failed,
        wall_s=wall,
        cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
        peak_rss=proc.peak_rss_bytes() if proc else None,
        client_cpu_s=time.process_time() - client0,
    )


# --- aggregation -----------------------------------------------------------------------------


def _model_seconds(config: BenchConfig, scenario: Scenario, tps: float | None) -> float | None:
    """The model's own time for one turn, or None when the model is not a paced sim."""
    if config.model is not None:
        return None
    if tps is None:
        return 0.0
    return scenario.model_seconds(tps, config.ttft_for(tps), scenario.output_tokens)


def _group(runs: Iterable[_Run]) -> dict[tuple[str, str, str, float | None], list[_Run]]:
    groups: dict[tuple[str, str, str, float | None], list[_Run]] = {}
    for run in runs:
        groups.setdefault((run.server, run.mode, run.scenario.name, run.tps), []).append(run)
    return groups


def _median_or_none(values: Sequence[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return median(data) if data else None


def _turn_records(config: BenchConfig, out: _Collected) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for (server, mode, scenario_name, tps), runs in _group(out.runs).items():
        scenario = runs[0].scenario
        model_s = _model_seconds(config, scenario, tps)
        counting = out.counting.get((server, mode, scenario_name))
        n_turns = max(len(r.record.turns) for r in runs)
        for index in range(n_turns):
            turns = [r.record.turns[index] for r in runs if index < len(r.record.turns)]
            stage_names = sorted({s for t in turns for s in (t.stages or {})})
            counters = None
            encode_s = None
            if counting is not None and index < len(counting.turns):
                counters = counting.turns[index].counters
                encode_s = counting.turns[index].encode_s
            records.append(
                {
                    "server": server,
                    "mode": mode,
                    "scenario": scenario_name,
                    "tps": tps,
                    "ttft_ms": config.ttft_for(tps) if config.model is None else None,
                    "turn": index,
                    "kind": turns[0].kind,
                    "history_tokens": scenario.history_before(index),
                    "new_input_tokens": scenario.new_input_tokens(index),
                    "context_tokens": _median_int([t.context_tokens for t in turns]),
                    "output_tokens": _median_int([t.output_tokens for t in turns]),
                    "repetitions": len(turns),
                    "model_s": model_s,
                    "ttft_s": stats(t.ttft for t in turns),
                    "turn_s": stats(t.duration for t in turns),
                    "excess_s": None
                    if model_s is None
                    else stats(t.duration - model_s for t in turns),
                    "ack_s": stats(t.ack_latency for t in turns),
                    "tail_s": stats(t.tail for t in turns),
                    "server_overhead_s": stats(t.server_overhead for t in turns),
                    "decode_s": stats(t.decode for t in turns),
                    "stages_s": {
                        name: median([(t.stages or {}).get(name, 0.0) for t in turns])
                        for name in stage_names
                    }
                    or None,
                    "counters": counters,
                    "wire_in_bytes": _median_int(
                        [t.wire.wire_in if t.wire else None for t in turns]
                    ),
                    "wire_out_bytes": _median_int(
                        [t.wire.wire_out if t.wire else None for t in turns]
                    ),
                    "payload_in_bytes": _median_int(
                        [t.wire.payload_in if t.wire else None for t in turns]
                    ),
                    "payload_out_bytes": _median_int(
                        [t.wire.payload_out if t.wire else None for t in turns]
                    ),
                    "done_bytes": _median_int([t.done_bytes for t in turns]),
                    "resume_bytes": _median_int([t.resume_bytes for t in turns]),
                    "received_tokens": _median_int([t.received_tokens for t in turns]),
                    "events_in": _median_int([t.events for t in turns]),
                    "bytes_per_event_in": _median_or_none([t.bytes_per_event for t in turns]),
                    "encode_s_per_event": encode_s,
                }
            )
    return records


def _median_int(values: Sequence[int | None]) -> int | None:
    m = _median_or_none([float(v) if v is not None else None for v in values])
    return None if m is None else round(m)


def _rollout_records(config: BenchConfig, out: _Collected) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for (server, mode, scenario_name, tps), runs in _group(out.runs).items():
        scenario = runs[0].scenario
        per_turn = _model_seconds(config, scenario, tps)
        # The tools' time as the client measured it (a sleep overshoots its nominal latency
        # by up to a millisecond; that is the client's, not the server's).
        tool_s = median([r.record.tool_s for r in runs])
        paced = per_turn is not None and tps is not None
        limit = per_turn * scenario.turns + tool_s if per_turn is not None else None
        e2e = [r.record.duration for r in runs]
        digests = sorted({r.record.transcript_digest() for r in runs})
        counting = out.counting.get((server, mode, scenario_name))
        med = median(e2e)
        received = (
            None
            if config.counter is None
            else _median_int([sum(t.received_tokens or 0 for t in r.record.turns) for r in runs])
        )
        reported = _median_int([_reported(r.record) for r in runs])
        records.append(
            {
                "server": server,
                "mode": mode,
                "scenario": scenario_name,
                "tps": tps,
                "ttft_ms": config.ttft_for(tps) if config.model is None else None,
                "repetitions": len(runs),
                "turns": len(runs[0].record.turns),
                "e2e_s": stats(e2e),
                "model_s": None if per_turn is None else per_turn * scenario.turns,
                "tool_s": tool_s,
                "tool_nominal_s": scenario.steps * scenario.tool_latency_ms / 1000,
                "physical_limit_s": limit,
                "distance_s": None
                if limit is None
                else stats(
                    r.record.duration - per_turn * scenario.turns - r.record.tool_s
                    for r in runs
                    if per_turn is not None
                ),
                "distance_pct": (med - limit) / limit * 100 if paced and limit else None,
                "server_overhead_s": stats(
                    _sum_or_none([t.server_overhead for t in r.record.turns]) for r in runs
                ),
                "ack_s": stats(_sum_or_none([t.ack_latency for t in r.record.turns]) for r in runs),
                "server_cpu_s": stats(r.cpu_s for r in runs),
                "server_peak_rss_bytes": max(
                    (r.peak_rss for r in runs if r.peak_rss is not None), default=None
                ),
                "counters": runs[0].counters,
                "counters_by_turn": None
                if counting is None
                else [t.counters for t in counting.turns],
                "transcript_digest": digests[0] if len(digests) == 1 else None,
                "output_tokens_received": received,
                "output_tokens_reported": reported,
                "token_ratio": None if received is None or not reported else received / reported,
                "reduction_vs_http_stateless_pct": None,
                "reduction_vs_http_chain_pct": None,
            }
        )
    by_key = {(r["server"], r["mode"], r["scenario"], r["tps"]): r for r in records}
    for record in records:
        for base, key in (
            ("http-stateless", "reduction_vs_http_stateless_pct"),
            ("http-chain", "reduction_vs_http_chain_pct"),
        ):
            ref = by_key.get((record["server"], base, record["scenario"], record["tps"]))
            if ref is not None and ref["e2e_s"]["median"] > 0:
                record[key] = (1 - record["e2e_s"]["median"] / ref["e2e_s"]["median"]) * 100
    return records


def _reported(record: RolloutRecord) -> int | None:
    """The output tokens the server reported over a rollout (ws-rollout's one response reports
    once, at its end: its last turn carries the whole usage)."""
    usage = [t.output_tokens for t in record.turns if t.output_tokens is not None]
    return sum(usage) if usage else None


def _tokens_of(config: BenchConfig, turn: TurnRecord) -> int:
    if config.counter is None:
        return turn.output_tokens or 0
    return turn.received_tokens or 0


def _sum_or_none(values: Sequence[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return sum(data) if data else None


def _concurrency_records(config: BenchConfig, out: _Collected) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for wave in out.waves:
        scenario = wave.scenario
        model_s = _model_seconds(config, scenario, wave.tps)
        sim = config.model is None
        achieved = [achieved_tps(r, config.counter) for r in wave.records]
        rates = [a for a in achieved if a is not None]
        pace = median(rates) / wave.tps if rates and sim else None
        turns = [t for r in wave.records for t in r.turns]
        excess = stats(t.duration - model_s for t in turns) if model_s is not None else None
        excess_ratio = excess["median"] / model_s if excess is not None and model_s else None
        keeps = (
            None
            if pace is None or excess_ratio is None
            else pace >= PACE_FRACTION and excess_ratio <= PACE_EXCESS
        )
        if wave.errors and sim:
            keeps = False  # a rollout that failed, or lost output, did not keep pace
        # The tokens that arrived in the rollouts that lost nothing: counted in their deltas,
        # or (without a tokenizer) as the server reported them.
        tokens = sum(_tokens_of(config, t) for r in wave.records for t in r.turns)
        records.append(
            {
                "server": wave.server,
                "mode": wave.mode,
                "scenario": scenario.name,
                "tps": wave.tps,
                "ttft_ms": config.ttft_for(wave.tps) if config.model is None else None,
                "concurrency": wave.k,
                "rollouts_ok": len(wave.records),
                "rollouts_failed": len(wave.errors),
                "turns_failed": wave.turns_failed,
                "errors": wave.errors[:5],
                "output_tokens_received": tokens,
                "wall_s": wave.wall_s,
                "throughput_rollouts_per_s": len(wave.records) / wave.wall_s
                if wave.wall_s
                else None,
                "throughput_output_tokens_per_s": tokens / wave.wall_s if wave.wall_s else None,
                "e2e_s": stats(r.duration for r in wave.records),
                "ttft_s": stats(t.ttft for t in turns),
                "turn_s": stats(t.duration for t in turns),
                "excess_s": excess,
                "achieved_tps_per_rollout": stats(rates),
                "pace_ratio": pace,
                "excess_ratio": excess_ratio,
                "keeps_pace": keeps,
                "server_cpu_s": wave.cpu_s,
                "server_cpu_utilization": None
                if wave.cpu_s is None or not wave.wall_s
                else wave.cpu_s / wave.wall_s,
                "server_peak_rss_bytes": wave.peak_rss,
                "client_cpu_s": wave.client_cpu_s,
            }
        )
    return records


def _machine() -> dict[str, Any]:
    cpu_model = None
    memory = None
    try:
        cpu_model = _cpu_model(Path("/proc/cpuinfo").read_text())
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "memory_bytes": memory,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "hostname": platform.node(),
    }


def _cpu_model(cpuinfo: str) -> str | None:
    """The first CPU's model name, with its family, model and stepping where the kernel gives
    them: two VMs that both say "AMD EPYC" can differ twofold in speed (two processor
    generations were seen here under that one name), and these numbers tell them apart."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block ends at its blank line
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if name is None:
        return None
    signature = [
        f"{label} {fields[key]}"
        for label, key in (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
        if key in fields
    ]
    return f"{name} ({', '.join(signature)})" if signature else name


def _loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: other work on the machine shows here."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in (
        "rollout-engine",
        "trio",
        "httpx",
        "hypercorn",
        "wsproto",
        "h11",
        "bpe-openai",
        "cattrs",
        "matplotlib",
        "rich",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.UTC).isoformat(timespec="seconds")


def _parameters(config: BenchConfig) -> dict[str, Any]:
    return {
        "preset": config.preset,
        "points": [
            {
                "scenario": p.scenario.name,
                "tps": p.tps,
                "ttft_ms": config.ttft_for(p.tps) if config.model is None else None,
                "repetitions": p.repetitions,
                "modes": list(p.modes),
            }
            for p in config.points
        ],
        "concurrency": list(config.concurrency),
        "concurrency_modes": list(config.concurrency_modes),
        "concurrency_scenario": None
        if config.concurrency_scenario is None
        else config.concurrency_scenario.name,
        "concurrency_tps": config.concurrency_tps,
        "model_override": config.model,
        "tokenizer": config.tokenizer_name,
        "counting_pass": config.counting,
        "pace_fraction": PACE_FRACTION,
        "pace_excess": PACE_EXCESS,
        "timeout_s": config.timeout,
    }


def _build_results(
    config: BenchConfig, out: _Collected, started: float, finished: float
) -> dict[str, Any]:
    from ._goals import evaluate_goals

    cpu_end = sample_cpu()  # the local servers have stopped (and been waited for)
    machine = _machine()
    results: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "meta": {
            "started_at": _iso(started),
            "finished_at": _iso(finished),
            "duration_s": finished - started,
            "command": list(config.argv) or [sys.argv[0]],
            "machine": machine,
            "load_average": {"start": out.load_start, "end": _loadavg()},
            "machine_load": judge_load(
                out.cpu_start,
                cpu_end,
                machine["cpu_count"],
                out.load_start,
                url_servers=any(s.url is not None for s in config.servers),
            ),
            "interrupted": out.interrupted,
            "versions": _versions(),
            "parameters": _parameters(config),
        },
        "servers": [],
        "scenarios": [s.as_dict() for s in config.scenarios()],
        "turns": _turn_records(config, out),
        "rollouts": _rollout_records(config, out),
        "concurrency": _concurrency_records(config, out),
        "goals": [],
        "notes": list(out.notes),
    }
    for server in out.servers:
        for note in (
            _token_note(config, server.label, results["rollouts"]),
            _history_note(config, server.label, results["rollouts"]),
        ):
            if note:
                server.notes.append(note)
    results["servers"] = [attrs.asdict(s) for s in out.servers]
    if out.interrupted:
        results["notes"].append(INTERRUPTED_NOTE)
    results["goals"] = evaluate_goals(results)
    finite: dict[str, Any] = _finite(results)
    return finite


def _history_note(config: BenchConfig, server: str, rollouts: list[dict[str, Any]]) -> str | None:
    """Modes whose model saw another conversation than the stateless client's: every mode
    sends the same turns, so a deterministic model (the sim behind any server) answers them
    alike unless the server lost or changed history it was asked to keep (an unknown
    `previous_response_id` silently ignored, for one). A note, not a failure: a sampling
    model's transcripts differ by chance."""
    mine = [r for r in rollouts if r["server"] == server]
    digests = {(r["scenario"], r["tps"], r["mode"]): r["transcript_digest"] for r in mine}
    differ = []
    for r in mine:
        base = digests.get((r["scenario"], r["tps"], "http-stateless"))
        if base is None or r["transcript_digest"] in (None, base):
            continue
        if r["mode"] == "ws-rollout" and config.model is not None:
            continue  # there the model chooses its calls (tool_choice auto): not comparable
        if r["mode"] not in differ:
            differ.append(r["mode"])
    if not differ:
        return None
    why = (
        "the server did not pass on the same conversation (history it was to keep lost or changed)"
    )
    if config.model is not None:  # greedy, but a model's numerics may differ with its cache
        why = f"unless the model is not deterministic, {why}"
    return (
        f"{', '.join(differ)}: the model answered differently than in http-stateless (the "
        f"transcripts differ): {why}"
    )


# Counted and reported tokens this far apart (as a ratio) are worth a note.
TOKEN_RATIO_NOTE = 0.02


def _token_note(config: BenchConfig, server: str, rollouts: list[dict[str, Any]]) -> str | None:
    """What the server's usage says against the tokens counted in what arrived: a figure,
    never a failure (the server's tokenizer is its own)."""
    mine = [r for r in rollouts if r["server"] == server]
    reported = sum(r["output_tokens_reported"] or 0 for r in mine)
    if config.counter is None:
        if not mine:
            return None
        if not reported:
            return "no usage reported and no --tokenizer: output tokens not measured"
        return "output tokens are the server's usage (no --tokenizer to count them with)"
    received = sum(r["output_tokens_received"] or 0 for r in mine)
    if config.counter.exact or not reported or not received:
        return None
    ratio = received / reported
    if abs(ratio - 1) <= TOKEN_RATIO_NOTE:
        return None
    return (
        f"{config.counter.name} counted {received:,} output tokens where the server reported "
        f"{reported:,} ({ratio:.2f}x): its model's tokenizer, or its usage, is not "
        f"{config.counter.name}'s; rates are in {config.counter.name} tokens"
    )


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
