"""`rollout conform`: command-line wiring (arguments, then `run`).

Long because `rollout conform` has many options (profiles, cases, slow models, output files) and
a progress display that must stop cleanly on Ctrl-C.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import trio
    from rich.console import Console

    from ._context import Case, Options
    from ._preflight import Problem
    from ._report import CheckResult, Report

__all__ = ["add_parser", "run"]

_EPILOG = """\
The defaults suit rollout's own server (`rollout serve`), whose simulated model
is `sim`. Against any other server pass --model (a model that can call
functions): the checks force tool calls with a named tool_choice and compare
structure, not text. Options describing the server's configuration enable the
checks that need them; without them those checks are skipped. The URL, the API
key and the models are probed first: a wrong one is a single message.

profiles: core (the Responses API over HTTP, SSE and WebSocket mode), then
inflight (stream_id lanes, response.steer), inject (the multi-agent beta),
rollout (rollout: true), auth, limits. Each optional profile is probed once;
one the server does not implement is reported once as not supported (with
the probe's evidence) and its checks are skipped; one it answers is checked
in full. The output: a line per profile, then only the failures (checks
failed by the same answer as one line); --verbose adds every check.

exit status:
  0    every check of core and of each profile the server supports passed
  1    core failed: the server breaks the Responses API
  5    core passed, but a supported profile failed or a --require'd one is
       not supported
  2    usage error
  3    nothing, or no API, at BASE_URL
  4    the server refuses the API key or a model
  70   an unexpected error (--debug shows its traceback)
  130  interrupted (the checks finished so far are reported)

examples:
  rollout conform --list
  rollout conform http://127.0.0.1:8000/v1
  rollout conform http://127.0.0.1:8000/v1 --age-limit-seconds 3 \\
      --max-message-size 65536 --json report.json
  rollout conform https://api.example.com/v1 --api-key "$KEY" --model gpt-x \\
      --filter 'ws.*'
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ._context import (
        DEFAULT_CONCURRENCY,
        DEFAULT_MODEL,
        DEFAULT_QUIET_SECONDS,
        DEFAULT_SLOW_MODEL,
        DEFAULT_TIMEOUT,
    )

    p = sub.add_parser(
        "conform",
        usage="%(prog)s BASE_URL [options]  (or: %(prog)s --list)",
        help="check a server against rollout's WebSocket-mode and rollout-extension spec",
        description="Run the conformance checks of spec/PROTOCOL.md against a server: HTTP\n"
        "and server-sent events, WebSocket mode, and (when the server accepts them)\n"
        "the rollout extension, lanes, steering and the multi-agent beta.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "base_url",
        metavar="BASE_URL",
        nargs="?",
        help="the API base URL, e.g. http://127.0.0.1:8000/v1 (not needed with --list)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        type=_nonempty,
        help="sent as Authorization: Bearer; enables the 401 checks",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        type=_nonempty,
        help=f"model id for every check (default {DEFAULT_MODEL!r}, rollout's simulated model; "
        "other servers need their own)",
    )
    p.add_argument(
        "--slow-model",
        metavar="MODEL",
        type=_nonempty,
        help="a model whose first output takes >= 0.2 s and that streams at a bounded rate, for "
        "checks that act while a response is sampling (queueing, early appends, steering); "
        f"default {DEFAULT_SLOW_MODEL!r} with the default --model, else --model",
    )
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="ID,...",
        help="run only these checks: ids, rule ids, features or globs (e.g. 'rollout', "
        "'ws.error_*', 'WS-3.*'); repeatable",
    )
    p.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="PROFILE,...",
        help="run only the checks of these profiles (core, inflight, inject, rollout, auth, "
        "limits); repeatable",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="write the JSON report here ('-' for stdout: the table then goes to stderr)",
    )
    p.add_argument(
        "--timeout",
        metavar="S",
        type=_positive(float),
        default=DEFAULT_TIMEOUT,
        help=f"deadline of each check in seconds (default {DEFAULT_TIMEOUT:g})",
    )
    p.add_argument(
        "--concurrency",
        metavar="N",
        type=_positive(int),
        default=DEFAULT_CONCURRENCY,
        help=f"checks run at once (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--age-limit-seconds",
        metavar="S",
        type=_positive(float),
        help="the server's WebSocket connection age limit, if short enough to wait for "
        "(enables ws.connection_age_limit)",
    )
    p.add_argument(
        "--max-message-size",
        metavar="BYTES",
        type=_positive(int),
        help="the server's largest accepted message / body in bytes (enables the oversize checks)",
    )
    p.add_argument(
        "--max-queued-creates",
        metavar="N",
        type=_positive(int),
        help="the server's bound on creates queued per connection (enables ws.queue_limit)",
    )
    p.add_argument(
        "--rollout-suspend-limit",
        metavar="S",
        type=_positive(float),
        help="seconds the server lets a rollout stay suspended (enables rollout.suspend_timeout)",
    )
    p.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="PROFILE",
        help="fail (exit 5) when the server does not support this profile (or feature), "
        "e.g. 'rollout'; repeatable",
    )
    p.add_argument(
        "--quiet-seconds",
        metavar="S",
        type=_positive(float),
        default=DEFAULT_QUIET_SECONDS,
        help="how long 'nothing arrives' is observed (default %(default)s)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show every check's result, not only the failures",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="list the checks and exit (a table in a terminal, Markdown when piped; with "
        "--json, as JSON)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no live progress bar (shown on stderr when it is a terminal)",
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")


def _positive(kind: type[float] | type[int]) -> Callable[[str], float]:
    """An argparse type: a finite number above 0, else a one-line usage error."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a {'whole ' if kind is int else ''}number, got {text!r}"
            ) from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return value

    return parse


def _nonempty(text: str) -> str:
    """An argparse type: a value that is not empty (as `--api-key "$KEY"` is when KEY is
    unset)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a value, got '' (is the variable unset?)")
    return text


def _split(values: list[str]) -> tuple[str, ...]:
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())


# Exit status of an unexpected error in the harness itself (EX_SOFTWARE).
INTERNAL_ERROR = 70
# Exit status after Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


def run(args: argparse.Namespace) -> int:
    """`rollout conform`: its exit status. An unexpected error is one line (its traceback
    with --debug)."""
    from rich.console import Console

    err = Console(stderr=True)
    try:
        return _run(args, Console(), err)
    except Exception as exc:
        if args.debug:
            raise
        err.print(
            f"rollout conform: unexpected {type(exc).__name__}: {exc}\n"
            "Run again with --debug for the traceback.",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return INTERNAL_ERROR


def _run(args: argparse.Namespace, console: Console, err: Console) -> int:
    import trio

    from ._context import Options, load_cases, load_profiles
    from ._preflight import Problem
    from ._report import print_cases, print_report, print_table
    from ._runner import select_cases

    def fail(message: str, code: int = 2) -> int:
        err.print(f"rollout conform: {message}", markup=False, highlight=False, soft_wrap=True)
        return code

    try:
        options = Options(
            api_key=args.api_key,
            model=args.model,
            slow_model=args.slow_model,
            timeout=args.timeout,
            concurrency=args.concurrency,
            filter=_split(args.filter),
            profiles=_split(args.profile),
            age_limit_seconds=args.age_limit_seconds,
            max_message_size=args.max_message_size,
            max_queued_creates=args.max_queued_creates,
            rollout_suspend_limit=args.rollout_suspend_limit,
            require=_split(args.require),
            quiet_seconds=args.quiet_seconds,
        )
        every = load_cases()
        cases = select_cases(every, options.filter, options.profiles)
    except ValueError as exc:
        return fail(f"{exc}\nSee `rollout conform --list` for the check ids.")
    profiles = [p.name for p in load_profiles()]
    features = sorted({c.feature for c in every} - set(profiles))
    unknown = [f for f in options.require if f not in profiles and f not in features]
    if unknown:
        return fail(
            f"--require {unknown[0]!r} is not a profile or a feature.\nThe profiles: "
            f"{', '.join(profiles)}; the features: {', '.join(features)}."
        )
    if args.list:
        if args.json:
            text = json.dumps({"checks": [attrs.asdict(c) for c in cases]}, indent=2) + "\n"
            try:
                _write_text(args.json, text)
            except OSError as exc:
                return fail(f"cannot write {args.json}: {exc}")
        if args.json != "-":
            print_cases(cases, console)
        return 0
    if args.base_url is None:
        return fail(
            "BASE_URL is missing (e.g. http://127.0.0.1:8000/v1).\n"
            "Usage: rollout conform BASE_URL [options], or rollout conform --list."
        )
    parts = urllib.parse.urlsplit(args.base_url)
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        return fail(f"{args.base_url!r} has an invalid port.\nCorrect BASE_URL.")
    if parts.scheme in ("ws", "wss") and parts.hostname:
        http = parts._replace(scheme="http" if parts.scheme == "ws" else "https")
        base = urllib.parse.urlunsplit(http).removesuffix("/").removesuffix("/responses")
        return fail(
            f"{args.base_url!r} is a WebSocket URL; BASE_URL is the API's http(s) base URL.\n"
            f"Did you mean {base}?"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return fail(
            f"{args.base_url!r} is not an http(s) base URL.\n"
            "Give the API's base URL, e.g. http://127.0.0.1:8000/v1."
        )
    unwritable = _unwritable(args.json)
    if unwritable:
        return fail(
            f"cannot write the report to {args.json}: {unwritable}.\nChoose another --json PATH."
        )

    finished: list[CheckResult] = []
    started = time.monotonic()
    show = not args.no_progress
    try:
        outcome = trio.run(
            functools.partial(
                _preflight_and_run, args.base_url, options, err, cases, show, finished
            )
        )
    except KeyboardInterrupt:
        outcome = None
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is None:
            raise
        outcome = None
    if outcome is None:  # interrupted: report what finished
        from ._report import Report

        report = Report(
            base_url=args.base_url,
            model=options.model,
            results=tuple(finished),
            seconds=time.monotonic() - started,
            interrupted=True,
        )
        print_table(report, err if args.json == "-" else console)
        err.print(
            f"rollout conform: interrupted after {len(finished)} of {len(cases)} checks.",
            markup=False,
            highlight=False,
        )
        _write_json(report, args.json, err)
        return INTERRUPTED
    if isinstance(outcome, Problem):
        if args.json:  # a report a script can read: no checks ran, and why
            failed = {"base_url": args.base_url, "model": options.model, "ok": False}
            failed["error"] = attrs.asdict(outcome)
            failed["checks"] = []
            try:
                _write_text(args.json, json.dumps(failed, indent=2) + "\n")
            except OSError as exc:
                return fail(f"cannot write {args.json}: {exc}")
        return fail(outcome.lines(), outcome.exit_code)
    # With the JSON report on stdout, the verdict goes to stderr.
    print_report(outcome, err if args.json == "-" else console, verbose=args.verbose)
    if not _write_json(outcome, args.json, err):
        return 2
    return outcome.exit_code


def _write_text(path: str, text: str) -> None:
    if path == "-":
        print(text, end="")
    else:
        Path(path).write_text(text, encoding="utf-8")


def _unwritable(path: str | None) -> str | None:
    """Why the report could not be written at `path` (checked before the run), or None."""
    if not path or path == "-":
        return None
    target = Path(path)
    if target.is_dir():
        return "it is a folder"
    if not target.parent.is_dir():
        return f"the folder {str(target.parent)!r} does not exist"
    if not os.access(target.parent, os.W_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        return "permission denied"
    return None


def _write_json(report: Report, path: str | None, err: Console) -> bool:
    if not path:
        return True
    try:
        report.write_json(path)
    except OSError as exc:
        err.print(
            f"rollout conform: cannot write {path}: {exc}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return False
    return True


async def _preflight_and_run(
    base_url: str,
    options: Options,
    console: Console,
    cases: list[Case],
    progress: bool,
    finished: list[CheckResult],
) -> Report | Problem | None:
    """The preflight's problem, or the run's report (each result also appended to
    `finished`, which outlives an interrupted run); None when Ctrl-C stopped it.

    Ctrl-C is received as a signal and cancels the run as a whole (rather than trio's default
    KeyboardInterrupt, raised in whichever task runs at the time, which could leave a check
    neither finished nor failed)."""
    import trio

    from ._preflight import preflight

    outcome: list[Report | Problem] = []

    async def run(cancel: trio.CancelScope) -> None:
        problem = await preflight(base_url, options)
        if problem is not None:
            outcome.append(problem)
        else:
            outcome.append(
                await _run_with_progress(base_url, options, console, len(cases), progress, finished)
            )
        cancel.cancel()

    async with trio.open_nursery() as nursery:
        if threading.current_thread() is threading.main_thread():
            nursery.start_soon(_cancel_on_sigint, nursery.cancel_scope)
        nursery.start_soon(run, nursery.cancel_scope)
    return outcome[0] if outcome else None


async def _cancel_on_sigint(scope: trio.CancelScope) -> None:
    import trio

    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def _run_with_progress(
    base_url: str,
    options: Options,
    console: Console,
    total: int,
    progress: bool,
    finished: list[CheckResult],
) -> Report:
    """The run, with a live progress bar when `console` (stderr) is a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ._report import Outcome
    from ._runner import run_conformance

    if not (progress and console.is_terminal):
        return await run_conformance(base_url, options, on_result=finished.append)
    running: list[str] = []
    failed = 0
    with Progress(
        TextColumn("[bold]conform"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("checks", total=total, status="")

        def status() -> str:
            shown = ", ".join(running[:3]) + (" ..." if len(running) > 3 else "")
            fails = f"[red]{failed} failed[/red] " if failed else ""
            return fails + shown

        def on_start(case: Case) -> None:
            running.append(case.id)
            bar.update(task, status=status())

        def on_result(result: CheckResult) -> None:
            nonlocal failed
            finished.append(result)
            if result.id in running:
                running.remove(result.id)
            if result.outcome is Outcome.FAILED:
                failed += 1
            bar.update(task, advance=1, status=status())

        return await run_conformance(base_url, options, on_start=on_start, on_result=on_result)
