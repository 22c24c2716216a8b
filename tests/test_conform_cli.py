"""`rollout conform` as a user meets it: the URL, the API key and the models are probed first,
and a wrong one is one short message with its own exit status (not the same failure in every
row); usage errors are one or two lines, never a traceback; `--list` needs no URL and pipes as
Markdown, one line per check; the results table fits 80 columns without splitting a value;
Ctrl-C reports the checks finished so far.

The CLI runs in a subprocess (every one with a deadline) against rollout's server in-process on
loopback port 0; the tables are rendered with rich consoles of a fixed width.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from rich.console import Console
from rollout import spec
from rollout._cli import build_parser
from rollout.engine import ModelRegistry, ModelSpec, SimBackend
from rollout.engine._app import RolloutApp
from rollout.spec import _cli as spec_cli
from rollout.spec import _context as spec_context
from rollout.spec import _preflight as spec_preflight
from rollout.spec._report import print_cases, print_table

from tests.test_conform import (
    API_KEY,
    SPEC_DIR,
    NoisyBackend,
    closed_port,
    serving,
)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

DEADLINE = 60


async def conform(*args: str, columns: int = 80) -> tuple[int, str, str]:
    """`rollout conform ...` in a subprocess, its output piped; (exit status, stdout, stderr)."""
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(SPEC_DIR.parent)}
    env.pop("FORCE_COLOR", None)
    with trio.fail_after(DEADLINE):
        done = await trio.run_process(
            [sys.executable, "-m", "rollout", "conform", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def sim_only() -> ModelRegistry:
    return ModelRegistry([ModelSpec(name="sim", backend=SimBackend(), accepts_params=True)])


# --- the preflight: one message, its own exit status ----------------------------------------


async def test_nothing_listening_is_one_message_exit_3() -> None:
    port = closed_port()
    code, stdout, stderr = await conform(f"http://127.0.0.1:{port}/v1")
    assert (code, stdout) == (3, "")
    assert stderr == (
        f"rollout conform: nothing is listening at 127.0.0.1:{port} (connection refused).\n"
        "Start the server (e.g. `rollout serve`) or correct BASE_URL.\n"
    )


async def test_the_json_report_of_a_run_that_could_not_start_says_why() -> None:
    port = closed_port()
    code, stdout, stderr = await conform(f"http://127.0.0.1:{port}/v1", "--json", "-")
    assert code == 3 and len(stderr.splitlines()) == 2
    assert json.loads(stdout) == {
        "base_url": f"http://127.0.0.1:{port}/v1",
        "model": "sim",
        "ok": False,
        "error": {
            "message": f"nothing is listening at 127.0.0.1:{port} (connection refused).",
            "hint": "Start the server (e.g. `rollout serve`) or correct BASE_URL.",
            "exit_code": 3,
        },
        "checks": [],
    }


async def test_unknown_host_is_one_message_exit_3() -> None:
    code, stdout, stderr = await conform("http://no-such-host.invalid/v1")
    assert (code, stdout) == (3, "")
    lines = stderr.splitlines()
    assert lines[0].startswith("rollout conform: cannot resolve the host 'no-such-host.invalid' (")
    assert lines[1:] == ["Correct the host in BASE_URL."]


async def test_unknown_model_is_one_message_pointing_at_the_model_list() -> None:
    async with serving(registry=sim_only()) as url:
        code, stdout, stderr = await conform(url, "--api-key", API_KEY, "--model", "gpt-4o")
        slow = await conform(url, "--api-key", API_KEY, "--slow-model", "sim:nonsense=1")
    assert (code, stdout) == (4, "")
    assert stderr == (
        "rollout conform: the server does not run the model 'gpt-4o' (model_not_found).\n"
        f"Pass one the server has with --model (GET {url}/models lists: sim).\n"
    )
    # A model the server refuses for another reason: its own words, and the flag to change.
    assert slow[0] == 4 and len(slow[2].splitlines()) == 2
    assert slow[2].startswith("rollout conform: the server refuses the model 'sim:nonsense=1' (")
    assert "Pass one the server has with --slow-model" in slow[2]


class V1Only:
    """An OpenAI-compatible server that serves everything under /v1 only (as most do): any
    other path is 404."""

    def __init__(self, app: RolloutApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {"error": {"message": "no route", "type": "invalid_request_error", "param": None,
                       "code": "not_found"}}
        ).encode()  # fmt: skip
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 404, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def test_base_url_without_v1_says_did_you_mean() -> None:
    async with serving(app_wrapper=V1Only) as url:
        base = url.removesuffix("/v1")
        code, stdout, stderr = await conform(base, "--api-key", API_KEY)
        # The endpoint given for the base URL: the same hint.
        endpoint = await conform(f"{url}/responses", "--api-key", API_KEY)
    assert (code, stdout) == (3, "")
    assert stderr == (
        f"rollout conform: no API at {base} (GET /models: HTTP 404 not_found), but {url} has "
        f"one.\nDid you mean {url}?\n"
    )
    assert endpoint[0] == 3 and endpoint[2].endswith(f"\nDid you mean {url}?\n")


async def test_missing_or_wrong_api_key_is_one_message_exit_4() -> None:
    async with serving() as url:
        missing = await conform(url)
        wrong = await conform(url, "--api-key", "sk-wrong")
    assert missing == (
        4,
        "",
        "rollout conform: the server requires an API key (HTTP 401 invalid_api_key).\n"
        "Pass it with --api-key KEY.\n",
    )
    assert wrong == (
        4,
        "",
        "rollout conform: the server refused the API key (HTTP 401 invalid_api_key).\n"
        "Check the key given with --api-key.\n",
    )


def test_spec_readme_lists_every_option() -> None:
    """spec/README's option table names every option of `rollout conform` (and no other)."""
    sub = next(
        a
        for a in build_parser()._subparsers._group_actions  # type: ignore[union-attr]
        if isinstance(a, argparse._SubParsersAction)
    )
    flags = {
        action.option_strings[-1]
        for action in sub.choices["conform"]._actions
        if action.option_strings and action.option_strings[-1] != "--help"
    }
    readme = (SPEC_DIR / "README.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(--[a-z-]+)[^`]*` \|", readme, flags=re.M))
    assert documented == flags, (sorted(flags - documented), sorted(documented - flags))
    assert "`--json -`" in readme or "(`-` for stdout: the table then goes to stderr)" in readme


async def test_help_fits_80_columns() -> None:
    code, stdout, stderr = await conform("--help", columns=80)
    assert (code, stderr) == (0, "")
    assert max(len(line) for line in stdout.splitlines()) <= 80
    for status in ("3    nothing, or no API, at BASE_URL", "4    the server refuses"):
        assert status in stdout


async def test_silent_server_is_one_problem_within_the_preflight_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that accepts connections and never answers: one problem once the listing's
    timeout has passed (shortened here), not every check timing out."""
    monkeypatch.setattr(spec_preflight, "PREFLIGHT_TIMEOUT", 0.5)
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    accepted: list[trio.socket.SocketType] = []

    async def accept_forever() -> None:
        while True:
            conn, _ = await listener.accept()
            accepted.append(conn)

    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(accept_forever)
                problem = await spec_preflight.preflight(
                    f"http://127.0.0.1:{port}/v1", spec.Options()
                )
                nursery.cancel_scope.cancel()
    finally:
        for conn in accepted:
            conn.close()
        listener.close()
    assert problem is not None and problem.exit_code == spec_preflight.UNREACHABLE == 3
    assert problem.lines() == (
        f"127.0.0.1:{port} accepts connections but did not answer GET "
        f"http://127.0.0.1:{port}/v1/models within 0.5s.\n"
        "Check that BASE_URL is the server's API (and that the server is not stuck)."
    )


# --- usage errors: short, no traceback -------------------------------------------------------

USAGE = "usage: rollout conform BASE_URL [options]  (or: rollout conform --list)"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["ftp://127.0.0.1/v1"],
            "rollout conform: 'ftp://127.0.0.1/v1' is not an http(s) base URL.\n"
            "Give the API's base URL, e.g. http://127.0.0.1:8000/v1.\n",
        ),
        (
            ["127.0.0.1:8000/v1"],
            "rollout conform: '127.0.0.1:8000/v1' is not an http(s) base URL.\n"
            "Give the API's base URL, e.g. http://127.0.0.1:8000/v1.\n",
        ),
        (
            ["ws://127.0.0.1:8000/v1/responses"],
            "rollout conform: 'ws://127.0.0.1:8000/v1/responses' is a WebSocket URL; BASE_URL "
            "is the API's http(s) base URL.\nDid you mean http://127.0.0.1:8000/v1?\n",
        ),
        (
            ["http://127.0.0.1:1/v1", "--require", "rollouts"],
            "rollout conform: --require 'rollouts' is not a profile or a feature.\nThe "
            "profiles: core, inflight, inject, rollout, auth, limits; the features: http, "
            "lanes, multi_agent, steer, websocket.\n",
        ),
        (
            ["http://127.0.0.1:1/v1", "--api-key", ""],
            f"{USAGE}\nrollout conform: error: argument --api-key: expected a value, got '' "
            "(is the variable unset?)\n",
        ),
        (
            ["http://127.0.0.1:80x/v1"],
            "rollout conform: 'http://127.0.0.1:80x/v1' has an invalid port.\nCorrect BASE_URL.\n",
        ),
        (
            ["http://127.0.0.1:1/v1", "--filter", "ws.nope"],
            "rollout conform: --filter 'ws.nope' matches no check id, rule or feature\n"
            "See `rollout conform --list` for the check ids.\n",
        ),
        (
            [],
            "rollout conform: BASE_URL is missing (e.g. http://127.0.0.1:8000/v1).\n"
            "Usage: rollout conform BASE_URL [options], or rollout conform --list.\n",
        ),
        (
            ["http://127.0.0.1:1/v1", "--timeout", "soon"],
            f"{USAGE}\nrollout conform: error: argument --timeout: expected a number, got 'soon'\n",
        ),
        (
            ["http://127.0.0.1:1/v1", "--timeout", "-1"],
            f"{USAGE}\n"
            "rollout conform: error: argument --timeout: expected a number above 0, got '-1'\n",
        ),
        (
            ["http://127.0.0.1:1/v1", "--quiet-seconds", "nan"],
            f"{USAGE}\nrollout conform: error: argument --quiet-seconds: expected a number "
            "above 0, got 'nan'\n",
        ),
        (
            ["http://127.0.0.1:1/v1", "--concurrency", "1.5"],
            f"{USAGE}\nrollout conform: error: argument --concurrency: expected a whole "
            "number, got '1.5'\n",
        ),
    ],
)
async def test_usage_errors_are_two_lines_exit_2(args: list[str], expected: str) -> None:
    assert await conform(*args) == (2, "", expected)


async def test_unwritable_report_is_refused_before_the_run(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"  # never reached
    assert await conform(url, "--json", str(tmp_path)) == (
        2,
        "",
        f"rollout conform: cannot write the report to {tmp_path}: it is a folder.\n"
        "Choose another --json PATH.\n",
    )
    missing = tmp_path / "no-such-folder" / "report.json"
    assert await conform(url, "--json", str(missing)) == (
        2,
        "",
        f"rollout conform: cannot write the report to {missing}: the folder "
        f"'{missing.parent}' does not exist.\nChoose another --json PATH.\n",
    )


def test_unexpected_error_is_two_lines_and_debug_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error in the harness itself (injected: loading the case list fails): one line
    saying what, one saying how to see more, exit 70; with --debug it propagates."""

    def broken() -> list[spec.Case]:
        raise RuntimeError("checks.json is unreadable")

    monkeypatch.setattr(spec_context, "load_cases", broken)
    parser = build_parser()
    args = parser.parse_args(["conform", "--list"])
    assert spec_cli.run(args) == spec_cli.INTERNAL_ERROR == 70
    assert capsys.readouterr().err == (
        "rollout conform: unexpected RuntimeError: checks.json is unreadable\n"
        "Run again with --debug for the traceback.\n"
    )
    args = parser.parse_args(["conform", "--list", "--debug"])
    with pytest.raises(RuntimeError, match="unreadable"):
        spec_cli.run(args)


# --- --list and the results table ------------------------------------------------------------


async def test_list_needs_no_url_and_pipes_one_markdown_line_per_check() -> None:
    code, stdout, stderr = await conform("--list", columns=80)
    cases = spec.load_cases()
    lines = stdout.splitlines()
    assert (code, stderr) == (0, "")
    assert len(lines) == len(cases) + 2
    assert lines[:2] == ["| check | rule | required | title |", "|---|---|---|---|"]
    for case, line in zip(cases, lines[2:], strict=True):
        kind = "required" if case.required else "optional"
        assert line == f"| {case.id} | {case.rule} | {kind} | {case.title} |"
    # As JSON (the fields of checks.json), alone on stdout with --json -.
    code, stdout, _ = await conform("--list", "--json", "-")
    assert code == 0
    assert [
        spec.Case(**{**c, "needs": tuple(c["needs"])}) for c in json.loads(stdout)["checks"]
    ] == cases
    # A filter applies to the list too.
    code, stdout, _ = await conform("--list", "--filter", "rollout.*")
    assert code == 0 and len(stdout.splitlines()) == 2 + sum(
        c.id.startswith("rollout.") for c in cases
    )


def sample_report() -> spec.Report:
    """Results of every kind, with the longest ids and rules of the case list and reasons as
    long as real ones."""
    reasons = {
        spec.Outcome.PASSED: "",
        spec.Outcome.FAILED: (
            "across the rollout (RX-2.3: every step streams as WS-3.3, WS-3.5): item 1 part 0: "
            "the deltas concatenate to 'has at them' but output_text.done.text is 'has at "
            "them looked knew public reason'; sequence_number 12345678901234567890"
        ),
        spec.Outcome.SKIPPED: "needs --max-message-size",
        spec.Outcome.WEAK: (
            "the model is not deterministic: only the kind of the last output item was compared "
            "(the rollout and the chain)"
        ),
    }
    cases = sorted(spec.load_cases(), key=lambda c: -len(c.id))
    results = []
    for n, case in enumerate(cases):
        outcome = list(spec.Outcome)[n % len(spec.Outcome)]
        results.append(
            spec.CheckResult(
                id=case.id,
                rule=case.rule,
                title=case.title,
                feature=case.feature,
                required=n % 3 != 0,
                outcome=outcome,
                reason=reasons[outcome],
            )
        )
    return spec.Report(
        base_url="http://127.0.0.1:8000/v1", model="sim", results=tuple(results), seconds=1.5
    )


def render(width: int, terminal: bool, what: Callable[[Console], None]) -> str:
    out = io.StringIO()
    what(Console(file=out, width=width, force_terminal=terminal, color_system=None))
    return out.getvalue()


def label(result: spec.CheckResult) -> str:
    optional = result.outcome is spec.Outcome.FAILED and not result.required
    return result.outcome.value + (" (optional)" if optional else "")


def assert_whole(text: str, values: list[str], width: int) -> None:
    """Every line fits `width`, and every value (each word of a longer text) is on one line."""
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    words = {w for line in lines for w in line.replace("│", " ").split()}
    for value in values:
        if " " in value:  # a text wraps between its words, never inside one
            missing = [w for w in value.split() if w not in words]
            assert not missing, (value, missing)
        else:
            assert value in words, value


@pytest.mark.parametrize("width", [80, 100, 200])
def test_results_table_fits_the_terminal_and_splits_no_value(width: int) -> None:
    report = sample_report()
    text = render(width, True, lambda c: print_table(report, c))
    values = [v for r in report.results for v in (r.id, r.rule, label(r), r.reason) if v]
    assert_whole(text, values, width)
    counts = report.counts()
    assert " ".join(text.split()).endswith(
        f"NOT CONFORMANT: {counts['passed']} passed, {counts['weak']} weak (structure only), "
        f"{counts['failed']} failed, {counts['skipped']} skipped in 1.5s (core fails)"
    )


def test_results_table_piped_is_markdown_one_line_per_check() -> None:
    report = sample_report()
    lines = render(80, False, lambda c: print_table(report, c)).splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| check")]
    assert len(rows) == len(report.results)
    for result, row in zip(report.results, rows, strict=True):
        assert row == f"| {result.id} | {result.rule} | {label(result)} | {result.reason} |"


def test_list_fits_80_columns_in_a_terminal() -> None:
    cases = spec.load_cases()
    text = render(80, True, lambda c: print_cases(cases, c))
    assert_whole(text, [v for c in cases for v in (c.id, c.rule, c.title)], 80)


# --- against a model that is not deterministic -----------------------------------------------

EQUALITY_CHECKS = (
    "ws.continuation_equals_stateless",
    "ws.stream_true",
    "ws.warmup_chain",
    "lanes.fork",
    "rollout.equals_chain",
)


async def test_cli_reports_structure_only_comparisons_as_weak_with_their_count() -> None:
    registry = ModelRegistry(
        [
            ModelSpec(name="sim", backend=SimBackend(), accepts_params=True),
            ModelSpec(name="noisy", backend=NoisyBackend(), accepts_params=True),
        ]
    )
    async with serving(registry=registry) as url:
        code, stdout, stderr = await conform(
            url, "--api-key", API_KEY, "--model", "noisy", "--timeout", "20",
            "--filter", ",".join(EQUALITY_CHECKS), "--json", "-",
        )  # fmt: skip
    report = json.loads(stdout)
    assert code == 0, stderr
    assert {c["id"]: c["outcome"] for c in report["checks"]} == dict.fromkeys(
        EQUALITY_CHECKS, "weak"
    )
    assert report["summary"]["weak"] == 5 and report["ok"] is True
    # The table (on stderr with --json -) ends with the count.
    assert stderr.splitlines()[-1].startswith(
        "conformant: 0 passed, 5 weak (structure only), 0 failed, 0 skipped in "
    )


# --- Ctrl-C ----------------------------------------------------------------------------------


class NoticeSuspension:
    """Rollout's server, noting when a rollout suspends (a check is then under way)."""

    suspended: trio.Event

    def __init__(self, app: RolloutApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def noticing(message: dict[str, Any]) -> None:
            if message["type"] == "websocket.send" and '"response.done"' in (
                message.get("text") or ""
            ):
                NoticeSuspension.suspended.set()
            await send(message)

        await self.app(scope, receive, noticing if scope["type"] == "websocket" else send)


async def test_ctrl_c_reports_the_checks_finished_so_far() -> None:
    """SIGINT while the second of two checks waits (checks start in the case list's order;
    with --concurrency 1 the first has ended before the second's rollout suspends): exit 130,
    the first check's row, and one line saying how far the run got."""
    NoticeSuspension.suspended = trio.Event()
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(SPEC_DIR.parent)}
    async with serving(app_wrapper=NoticeSuspension) as url:
        args = [
            url, "--api-key", API_KEY, "--concurrency", "1", "--rollout-suspend-limit", "50",
            "--filter", "http.create,rollout.suspend_timeout",
        ]  # fmt: skip
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "rollout", "conform", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            with trio.fail_after(DEADLINE):
                await NoticeSuspension.suspended.wait()
                process.send_signal(signal.SIGINT)
                assert process.stdout is not None and process.stderr is not None
                stdout, stderr = b"", b""
                async with trio.open_nursery() as nursery:

                    async def read(stream: trio.abc.ReceiveStream, err: bool) -> None:
                        nonlocal stdout, stderr
                        async for chunk in stream:
                            if err:
                                stderr += chunk
                            else:
                                stdout += chunk

                    nursery.start_soon(read, process.stdout, False)
                    nursery.start_soon(read, process.stderr, True)
                code = await process.wait()
        finally:
            process.kill()
    assert code == 130, stderr
    assert stderr.decode() == "rollout conform: interrupted after 1 of 2 checks.\n"
    rows = [line for line in stdout.decode().splitlines() if line.startswith("| http.")]
    assert rows == ["| http.create | HTTP-1.1 | passed |  |"]
    assert (
        stdout.decode()
        .splitlines()[-1]
        .startswith("INTERRUPTED (no verdict): 1 passed, 0 failed, 0 skipped in ")
    )
