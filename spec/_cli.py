"""`rollout conform`: command-line wiring (arguments, then `run`)."""

from __future__ import annotations

import argparse
import functools
import urllib.parse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from ._context import Case, Options
    from ._report import CheckResult, Report

__all__ = ["add_parser", "run"]

_EPILOG = """\
The defaults suit rollout's own server (`rollout serve`), whose simulated model is `sim`.
Against any other server pass --model (a model that can call functions); the checks force
tool calls with a named tool_choice and compare structure, not text. Options describing the
server's configuration enable the checks that need them; without them those checks are
skipped. Exit status: 0 when every required check passed, 1 otherwise, 2 for usage errors.

examples:
  rollout conform http://127.0.0.1:8000/v1
  rollout conform http://127.0.0.1:8000/v1 --slow-model 'sim:ttft_ms=300,tps=200' \\
      --age-limit-seconds 3 --max-message-size 65536 --json report.json
  rollout conform https://api.example.com/v1 --api-key "$KEY" --model gpt-x --filter 'ws.*'
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ._context import DEFAULT_CONCURRENCY, DEFAULT_MODEL, DEFAULT_QUIET_SECONDS, DEFAULT_TIMEOUT

    p = sub.add_parser(
        "conform",
        help="check a server against rollout's WebSocket-mode and rollout-extension spec",
        description="Run the conformance checks of spec/PROTOCOL.md against a server: HTTP and "
        "server-sent events, WebSocket mode, and (when the server accepts it) the rollout "
        "extension.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "base_url", metavar="BASE_URL", help="the API base URL, e.g. http://127.0.0.1:8000/v1"
    )
    p.add_argument("--api-key", help="sent as Authorization: Bearer; enables the 401 checks")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model id for every check (default {DEFAULT_MODEL!r}, rollout's simulated model; "
        "other servers need their own)",
    )
    p.add_argument(
        "--slow-model",
        metavar="MODEL",
        help="a model whose first output takes >= 0.2 s and that streams at a bounded rate, for "
        "checks that act while a response is sampling (queueing, early appends, steering); "
        "default --model. For rollout: 'sim:ttft_ms=300,tps=200'",
    )
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="ID,...",
        help="run only these checks: ids, rule ids, features or globs (e.g. 'rollout', "
        "'ws.error_*', 'WS-3.*'); repeatable",
    )
    p.add_argument("--json", metavar="PATH", help="write the JSON report here ('-' for stdout)")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"deadline of each check in seconds (default {DEFAULT_TIMEOUT:g})",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"checks run at once (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--age-limit-seconds",
        type=float,
        help="the server's WebSocket connection age limit, if short enough to wait for "
        "(enables ws.connection_age_limit)",
    )
    p.add_argument(
        "--max-message-size",
        type=int,
        help="the server's largest accepted message / body in bytes (enables the oversize checks)",
    )
    p.add_argument(
        "--max-queued-creates",
        type=int,
        help="the server's bound on creates queued per connection (enables ws.queue_limit)",
    )
    p.add_argument(
        "--rollout-suspend-limit",
        type=float,
        help="seconds the server lets a rollout stay suspended (enables rollout.suspend_timeout)",
    )
    p.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="FEATURE",
        help="fail when this feature's checks are skipped (e.g. 'rollout'); repeatable",
    )
    p.add_argument(
        "--quiet-seconds",
        type=float,
        default=DEFAULT_QUIET_SECONDS,
        help="how long 'nothing arrives' is observed (default %(default)s)",
    )
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--no-progress", action="store_true", help="no live progress view")


def _split(values: list[str]) -> tuple[str, ...]:
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())


def run(args: argparse.Namespace) -> int:
    import trio
    from rich.console import Console

    from ._context import Options, load_cases
    from ._report import print_table
    from ._runner import select_cases

    console = Console()
    err = Console(stderr=True)
    try:
        options = Options(
            api_key=args.api_key,
            model=args.model,
            slow_model=args.slow_model,
            timeout=args.timeout,
            concurrency=args.concurrency,
            filter=_split(args.filter),
            age_limit_seconds=args.age_limit_seconds,
            max_message_size=args.max_message_size,
            max_queued_creates=args.max_queued_creates,
            rollout_suspend_limit=args.rollout_suspend_limit,
            require=_split(args.require),
            quiet_seconds=args.quiet_seconds,
        )
        cases = select_cases(load_cases(), options.filter)
    except ValueError as exc:
        err.print(f"rollout conform: {exc}", markup=False)
        return 2
    parts = urllib.parse.urlsplit(args.base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        err.print(f"rollout conform: {args.base_url!r} is not an http(s) base URL", markup=False)
        return 2
    if args.list:
        for case in cases:
            kind = "required" if case.required else "optional"
            line = f"{case.id:40} {case.rule:9} {kind:8} {case.title}"
            console.print(line, markup=False, highlight=False)
        return 0

    show = not args.no_progress
    report = trio.run(
        functools.partial(_run_with_progress, args.base_url, options, console, len(cases), show)
    )
    # With the JSON report on stdout, the table goes to stderr.
    print_table(report, err if args.json == "-" else console)
    if args.json:
        try:
            report.write_json(args.json)
        except OSError as exc:
            err.print(f"rollout conform: cannot write {args.json}: {exc}", markup=False)
            return 2
    return report.exit_code


async def _run_with_progress(
    base_url: str, options: Options, console: Console, total: int, progress: bool
) -> Report:
    """The run, with a live progress bar when the console is a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ._report import Outcome
    from ._runner import run_conformance

    if not (progress and console.is_terminal):
        return await run_conformance(base_url, options)
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
            if result.id in running:
                running.remove(result.id)
            if result.outcome is Outcome.FAILED:
                failed += 1
            bar.update(task, advance=1, status=status())

        return await run_conformance(base_url, options, on_start=on_start, on_result=on_result)
