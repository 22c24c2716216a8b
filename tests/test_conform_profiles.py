"""`rollout conform` against servers that are not rollout, as a user meets it: the verdict is
per profile. `core` (the Responses API) is what every server must pass; each optional profile
(`inflight`, `inject`, `rollout`, `auth`, `limits`) is probed once, and one the server does not
implement is reported once as not supported, with the probe's evidence, its checks skipped and
never failed. Failures that share one cause (the same status and body on every request) are one
line naming it and how many checks it broke.

The stand-ins are rollout's own server behind small ASGI wrappers (the machinery of
tests/test_conform_mutations.py), each behaving as a real gateway does: one that ignores
`rollout: true`, one that answers `unsupported_parameter` (naming no param) to the extensions'
fields, one that lists its models to anyone but refuses the key on every other request, and one
with WebSocket mode off. The CLI runs in a subprocess with its output piped, every run with a
deadline (`conform`).
"""

from __future__ import annotations

import io
import json
from typing import Any

import trio
from rich.console import Console
from rollout import spec
from rollout.engine._app import RolloutApp

from tests.test_conform import API_KEY, harness_options, serving
from tests.test_conform_cli import DEADLINE, Receive, Scope, Send, conform, sample_report
from tests.test_conform_mutations import Conn, Mutant, ws_error

# The profiles, as the summary names them. (The tests name only what a user sees, so they can
# also run against the harness before profiles: they fail there, each for its own reason.)
PROFILES = ("core", "inflight", "inject", "rollout", "auth", "limits")
# A few core checks, quick against the simulated model, so the runs below stay short: the
# profiles' own checks are what they are about.
SOME_CORE = "http.create,ws.create_text,ws.function_call_events"


def summary(stdout: str) -> dict[str, list[str]]:
    """The summary's line of each profile, split into words, by profile name."""
    names = PROFILES
    return {
        line.split()[0]: line.split()
        for line in stdout.splitlines()
        if line.split() and line.split()[0] in names
    }


def failure_lines(stdout: str) -> list[str]:
    """The head line of each failure (after the summary, before the verdict)."""
    return [line for line in stdout.splitlines() if line.startswith(("failed", "FAILED"))]


class IgnoresRollout(Mutant):
    """A gateway that drops fields it does not know: `rollout: true` never reaches the model
    loop, so the response completes at its tool call like any other."""

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if event.get("type") == "response.create":
            event.pop("rollout", None)
        return event


async def test_a_server_that_ignores_rollout_true() -> None:
    async with serving(app_wrapper=IgnoresRollout) as url:
        code, stdout, stderr = await conform(
            url, "--api-key", API_KEY, "--filter", f"{SOME_CORE},rollout", "--json", "-"
        )
        required = await conform(
            url, "--api-key", API_KEY, "--filter", f"{SOME_CORE},rollout", "--require", "rollout"
        )
    # Exit 0: the core passes; rollout is reported once, as not supported, with the evidence.
    assert code == 0, stderr
    assert "rollout     not supported" in stderr
    assert "    ignored `rollout: true` and completed at the tool call" in stderr
    assert failure_lines(stderr) == []
    assert stderr.splitlines()[-1].startswith("conformant: 3 passed, 0 failed, 14 skipped in ")
    assert stderr.splitlines()[-1].endswith(" (not supported: rollout)")
    report = json.loads(stdout)
    rollout = {c["id"]: c for c in report["checks"] if c["profile"] == "rollout"}
    assert len(rollout) == 14
    # Skipped as unsupported, but the one that needs an option not given (it is skipped first).
    needs = rollout.pop("rollout.suspend_timeout")
    assert (needs["outcome"], needs["unsupported"]) == ("skipped", False)
    assert {(c["outcome"], c["unsupported"]) for c in rollout.values()} == {("skipped", True)}
    assert report["features"]["rollout"] is False
    profiles = {p["name"]: p for p in report["profiles"]}
    assert profiles["rollout"]["support"] == "not supported"
    assert profiles["rollout"]["evidence"] == [
        "ignored `rollout: true` and completed at the tool call"
    ]
    # Required, the absent extension fails the run with exit 5 (the core still passes), said
    # once, not once per check.
    code, out, _ = required
    assert code == 5, out
    assert failure_lines(out) == ["FAILED  --require rollout: not supported"]
    assert out.splitlines()[-1].endswith("(core passes; fails: rollout)")


class IgnoresStreamId(Mutant):
    """A gateway that drops `stream_id`: every laned create runs on the default lane."""

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        event.pop("stream_id", None)
        return event


async def test_a_server_that_ignores_stream_id_has_no_lanes() -> None:
    """Not one failure per lanes check: the inflight profile is partly supported (steering
    answers its probe), lanes are not, with the evidence, and the lanes checks are skipped."""
    async with serving(app_wrapper=IgnoresStreamId) as url:
        code, stdout, stderr = await conform(
            url, "--api-key", API_KEY, "--filter", f"{SOME_CORE},lanes,steer.unknown_or_completed"
        )
    assert code == 0, stdout + stderr
    assert summary(stdout)["inflight"][:4] == ["inflight", "partly:", "passes", "1"]
    assert (
        "    lanes: ignored `stream_id`: the response ran on the default lane (none of its "
        in stdout
    )
    assert failure_lines(stdout) == []


class RefusesExtensionFields(Mutant):
    """A server that answers `unsupported_parameter`, with no param and a message naming no
    field, to every extension field (`rollout`, `stream_id`), and an error to the event types
    it does not know (`response.steer`, `response.inject`)."""

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        kind = event.get("type")
        if kind == "response.create" and ("rollout" in event or "stream_id" in event):
            await conn.emit([ws_error("unsupported_parameter")])
            return None
        if kind in ("response.steer", "response.inject"):
            await conn.emit([ws_error("invalid_value", "type")])
            return None
        return event


async def test_a_server_that_answers_unsupported_parameter_to_the_extensions() -> None:
    async with serving(app_wrapper=RefusesExtensionFields) as url:
        code, stdout, stderr = await conform(
            url, "--api-key", API_KEY, "--filter", f"{SOME_CORE},rollout,lanes,steer,multi_agent"
        )
    assert code == 0, stdout + stderr
    lines = stdout.splitlines()
    profiles = summary(stdout)
    assert profiles["core"] == ["core", "passes", "3", "0", "0", "0"]
    for name in ("inflight", "inject", "rollout"):
        assert profiles[name][1:3] == ["not", "supported"], profiles[name]
    assert "    rejected `rollout: true` (unsupported_parameter)" in lines
    assert (
        "    lanes: the server refuses `stream_id` (unsupported_parameter): lanes are not "
        "supported" in lines
    )
    assert failure_lines(stdout) == []
    assert lines[-1].endswith(" (not supported: inflight, inject, rollout)")


class PublicModelList:
    """A gateway that lists its models to anyone (as many do) and checks the key on every
    other request: GET /v1/models is served as if the right key came with it."""

    def __init__(self, app: RolloutApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/models":
            headers = [(k, v) for k, v in scope["headers"] if k != b"authorization"]
            headers.append((b"authorization", f"Bearer {API_KEY}".encode()))
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


async def test_a_wrong_key_is_one_cause_not_one_failure_per_check() -> None:
    async with serving(app_wrapper=PublicModelList) as url:
        # The slow model is the model: the preflight's create of a slow model would meet the
        # 401 first (exit 4, one message); here the checks meet it.
        code, stdout, stderr = await conform(
            url, "--api-key", "sk-wrong", "--filter", "http,websocket", "--slow-model", "sim"
        )
    assert code == 1, stderr
    lines = stdout.splitlines()
    heads = failure_lines(stdout)
    # Every core check failed, all of them by the same 401: one line names it and the count.
    total = sum(1 for c in spec.load_cases() if c.profile == "core")
    assert len(heads) == 1, heads
    assert heads[0] in (f"failed  {total} checks, one cause", f"FAILED  {total} checks, one cause")
    cause = lines[lines.index(heads[0]) + 1]
    assert cause.startswith("    HTTP 401 ") and "invalid_api_key" in cause
    assert lines[-1].startswith(f"NOT CONFORMANT: 0 passed, {total} failed, 0 skipped in ")
    assert len(lines) < 20


async def test_a_server_without_websocket_mode_is_one_cause() -> None:
    async with serving(websocket=False) as url:
        code, stdout, stderr = await conform(url, "--api-key", API_KEY, "--timeout", "10")
    assert code == 1, stderr
    lines = stdout.splitlines()
    heads = failure_lines(stdout)
    # The WebSocket checks all failed by the same refused upgrade: one line, with the count;
    # the HTTP checks passed; whether the optional profiles exist is unknown (their probes
    # could not connect), said once each, not a failure per check.
    shared = [h for h in heads if "checks, one cause" in h]
    assert len(shared) == 1, heads
    count = int(shared[0].split()[1])
    assert count >= 35
    assert lines[lines.index(shared[0]) + 1].startswith("    HTTP 426 ")
    assert len(heads) <= 3, heads
    profiles = summary(stdout)
    assert profiles["core"][1] == "FAILS"
    for name in ("inflight", "inject", "rollout"):
        assert profiles[name][1] == "unknown", profiles
    assert "could not be probed: HTTP 426 " in stdout
    assert lines[-1].endswith("; unknown: inflight, inject, rollout)"), lines[-1]
    assert len(lines) < 40


def test_the_report_fits_80_columns_and_names_each_failure_once() -> None:
    """The verdict of a report with results of every kind, in a terminal 80 columns wide:
    the summary line of each profile, each failure's id and rule once (a group once)."""
    from rollout.spec._report import print_report

    report = sample_report()
    out = io.StringIO()
    print_report(report, Console(file=out, width=80, force_terminal=True, color_system=None))
    text = out.getvalue()
    assert all(len(line) <= 80 for line in text.splitlines())
    grouped = {r.id for _, results in report.causes() for r in results}
    for r in report.results:
        if r.outcome is spec.Outcome.FAILED and r.id not in grouped:
            assert text.count(f"  {r.id}  {r.rule}  ") == 1, r.id


class DoneMarker(Mutant):
    """A gateway that ends every event stream as chat completions do: `data: [DONE]` after the
    terminal event (the official SDK stops reading there)."""

    def sse_chunk(self, chunk: bytes) -> bytes:
        if b"event: response.completed" in chunk:
            return chunk + b"data: [DONE]\n\n"
        return chunk


async def test_a_done_marker_after_the_terminal_event_breaks_nothing() -> None:
    with trio.fail_after(DEADLINE):
        async with serving(app_wrapper=DoneMarker) as url:
            options = harness_options(filter=("http.sse", "schema.sse_events"))
            report = await spec.run_conformance(url, options)
    assert [r.outcome for r in report.results] == [spec.Outcome.PASSED] * 2, report.failures
