"""The conformance harness (`rollout conform`, `spec.run_conformance`) against rollout's own
server: every check passes, the report lists them all, the CLI's exit status and JSON report
are right, and a server that is down, refuses the upgrade or never answers fails clearly and
quickly. Also: spec/PROTOCOL.md and spec/checks.json agree (every rule has a check, every check
a rule), and the public names of `spec`.

Every test has a deadline; the servers run on loopback port 0 with the simulated model.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from rich.console import Console
from rollout import spec
from rollout.engine import ModelRegistry, ModelSpec, SampleEvent, SampleRequest, SimBackend
from rollout.engine._serve import ServerConfig, open_server
from rollout.engine._ws import WebSocketLimits
from rollout.spec._catalog import CHECKS
from rollout.spec._checks_errors import ERROR_ROWS
from rollout.spec._report import print_table

SPEC_DIR = Path(spec.__file__).parent
API_KEY = "sk-conform-test"
# The test server's configuration, and the harness options that describe it.
AGE_LIMIT = 3.0
MAX_MESSAGE_SIZE = 64 * 1024
SUSPEND_LIMIT = 1.0
MAX_QUEUED = 2
SLOW_MODEL = "sim:ttft_ms=400,tps=200"


def server_config(**overrides: Any) -> ServerConfig:
    settings: dict[str, Any] = {
        "port": 0,
        "data_dir": None,
        "api_keys": (API_KEY,),
        "websocket_limits": WebSocketLimits(
            connection_age_limit=AGE_LIMIT, max_queued_creates=MAX_QUEUED
        ),
        "max_message_size": MAX_MESSAGE_SIZE,
        "rollout_suspend_limit": SUSPEND_LIMIT,
        "graceful_timeout": 1.0,
    }
    settings.update(overrides)
    return ServerConfig(**settings)


def harness_options(**overrides: Any) -> spec.Options:
    settings: dict[str, Any] = {
        "api_key": API_KEY,
        "slow_model": SLOW_MODEL,
        "timeout": 10.0,
        "concurrency": 4,
        "age_limit_seconds": AGE_LIMIT,
        "max_message_size": MAX_MESSAGE_SIZE,
        "rollout_suspend_limit": SUSPEND_LIMIT,
        "max_queued_creates": MAX_QUEUED,
        "quiet_seconds": 0.2,
    }
    settings.update(overrides)
    return spec.Options(**settings)


CLI_OPTIONS = [
    "--api-key", API_KEY,
    "--slow-model", SLOW_MODEL,
    "--timeout", "10",
    "--age-limit-seconds", str(AGE_LIMIT),
    "--max-message-size", str(MAX_MESSAGE_SIZE),
    "--rollout-suspend-limit", str(SUSPEND_LIMIT),
    "--max-queued-creates", str(MAX_QUEUED),
    "--quiet-seconds", "0.2",
]  # fmt: skip


@asynccontextmanager
async def serving(**overrides: Any) -> AsyncIterator[str]:
    async with open_server(server_config(**overrides)) as url:
        yield url


async def run_cli(*args: str, deadline: float) -> tuple[int, str, str]:
    """`rollout conform ...` in a subprocess; (exit status, stdout, stderr)."""
    with trio.fail_after(deadline):
        done = await trio.run_process(
            [sys.executable, "-m", "rollout", "conform", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(SPEC_DIR.parent)},
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


# --- the spec and the case list agree ------------------------------------------------------

_RULE = re.compile(
    r"^\*\*(?P<rule>[A-Z]+-\d+\.\d+)\*\*(?P<text>.*?)(?=^\*\*[A-Z]+-\d+\.\d+\*\*|^#|\Z)",
    re.M | re.S,
)
_CHECK_REF = re.compile(r"`([a-z_]+\.[a-z0-9_]+)`")


def spec_rules() -> dict[str, tuple[str, list[str]]]:
    """Rule id -> (its text, the check ids its `Checks:` line names), from PROTOCOL.md."""
    text = (SPEC_DIR / "PROTOCOL.md").read_text(encoding="utf-8")
    rules: dict[str, tuple[str, list[str]]] = {}
    for match in _RULE.finditer(text):
        body = match.group("text")
        assert match.group("rule") not in rules, f"rule {match.group('rule')} defined twice"
        checks_line = re.search(r"\*Checks?:\*(.*)", body, re.S)
        assert checks_line, f"rule {match.group('rule')} names no check"
        rules[match.group("rule")] = (body, _CHECK_REF.findall(checks_line.group(1)))
    return rules


def test_every_rule_has_a_check_and_every_check_a_rule() -> None:
    rules = spec_rules()
    cases = spec.load_cases()
    assert len(cases) >= 40
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "duplicate check ids in checks.json"
    # Every check is implemented, and every implementation is listed.
    assert set(ids) == set(CHECKS)
    by_rule: dict[str, set[str]] = {}
    for case in cases:
        assert case.rule in rules, f"{case.id} names rule {case.rule}, not in PROTOCOL.md"
        by_rule.setdefault(case.rule, set()).add(case.id)
    for rule, (text, named) in rules.items():
        assert named, f"{rule} names no check"
        assert set(named) == by_rule.get(rule, set()), (
            f"{rule} names checks {sorted(named)}, checks.json maps {sorted(by_rule.get(rule, ()))}"
        )
        keyword = re.search(r"\b(MUST|SHOULD|MAY)\b", text)
        assert keyword, f"{rule} has no MUST/SHOULD/MAY"


def test_error_table_agrees_with_the_case_list_and_the_spec() -> None:
    """Each row of the error table names its check's rule as checks.json does, its transport
    as the check id implies, and the error code its rule's text names."""
    rules = spec_rules()
    cases = {c.id: c for c in spec.load_cases()}
    assert len(ERROR_ROWS) >= 15
    for row in ERROR_ROWS:
        assert row.id in cases, row.id
        assert row.rule == cases[row.id].rule, (row.id, row.rule, cases[row.id].rule)
        http = row.id.startswith("http.") or row.id == "rollout.http_rejected"
        assert row.transport == ("http" if http else "ws"), row.id
        assert f"`{row.code}`" in rules[row.rule][0], (row.id, row.code)


def test_required_checks_verify_must_rules() -> None:
    rules = spec_rules()
    for case in spec.load_cases():
        text = rules[case.rule][0]
        if case.required:
            assert "MUST" in text, f"{case.id} is required but {case.rule} has no MUST"
        else:
            assert "SHOULD" in text, f"{case.id} is optional but {case.rule} has no SHOULD"


def test_case_list_fields() -> None:
    known_needs = {"api_key", "age_limit_seconds", "max_message_size", "max_queued_creates",
                   "rollout_suspend_limit"}  # fmt: skip
    profiles = spec.load_profiles()
    assert [p.name for p in profiles] == [
        "core", "inflight", "inject", "rollout", "auth", "limits"
    ]  # fmt: skip
    # Each feature belongs to one profile; every optional feature with a probe has it named.
    owners = [f for p in profiles for f in p.features]
    assert len(owners) == len(set(owners))
    for profile in profiles:
        assert profile.title
        assert (profile.probe is None) == (profile.name in ("core", "limits")), profile.name
    for case in spec.load_cases():
        assert case.feature in owners and case.profile in {p.name for p in profiles}
        assert case.feature in {
            "http",
            "websocket",
            "auth",
            "limits",
            "rollout",
            "lanes",
            "steer",
            "multi_agent",
        }
        assert set(case.needs) <= known_needs
        assert case.title


def test_public_names() -> None:
    assert sorted(spec.__all__) == [
        "Case",
        "CheckFailed",
        "CheckResult",
        "CheckSkipped",
        "Options",
        "Outcome",
        "Profile",
        "ProfileVerdict",
        "Report",
        "Support",
        "WsClient",
        "load_cases",
        "load_profiles",
        "open_ws",
        "run_conformance",
        "run_conformance_sync",
        "select_cases",
    ]
    for name in spec.__all__:
        assert getattr(spec, name).__module__.startswith("rollout.spec")


def test_spec_files_ship_in_the_package(tmp_path: Path) -> None:
    """setuptools' build_py (what goes into the wheel) carries PROTOCOL.md, README.md and
    checks.json beside the code; built from a copy so the checkout is left alone."""
    root = SPEC_DIR.parent
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, tmp_path / name)
    for package in ("cli", "protocol", "engine", "spec", "bench"):
        shutil.copytree(
            root / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    build = tmp_path / "build-lib"
    script = (
        "import sys; from setuptools import setup; "
        f"sys.argv = ['setup.py', '-q', 'build_py', '--build-lib', {str(build)!r}]; setup()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    shipped = {p.name for p in (build / "rollout" / "spec").iterdir()}
    assert {
        "PROTOCOL.md",
        "README.md",
        "checks.json",
        "responses.schema.json",
        "py.typed",
        "__init__.py",
    } <= shipped
    assert json.loads((build / "rollout" / "spec" / "checks.json").read_text())["checks"]


def test_filter_selection() -> None:
    cases = spec.load_cases()
    assert [c.id for c in spec.select_cases(cases, ["WS-3.2"])] == ["ws.sequence_numbers"]
    chosen = {c.id for c in spec.select_cases(cases, ["rollout.*", "http.create"])}
    assert "http.create" in chosen and "rollout.resume" in chosen and "ws.frames" not in chosen
    with pytest.raises(ValueError, match="matches no check"):
        spec.select_cases(cases, ["no.such_check"])


# --- against rollout's own server ----------------------------------------------------------

# `ROLLOUT_SCHEMA_HOOK=warn` (see tests/conftest.py) also turns failures of the `schema.*`
# checks against rollout's own server into warnings, while fixes of what it emits land.
SCHEMA_HOOK_ENV = "ROLLOUT_SCHEMA_HOOK"


def schema_failures_tolerated() -> bool:
    return os.environ.get(SCHEMA_HOOK_ENV, "fail").lower() == "warn"


def not_passed(results: Any) -> dict[str, str]:
    """Check id -> reason of every check that did not pass (report results or JSON entries);
    `schema.*` failures only warn with ROLLOUT_SCHEMA_HOOK=warn."""
    out = {}
    for r in results:
        check_id, outcome, reason = (
            (r["id"], r["outcome"], r["reason"])
            if isinstance(r, dict)
            else (r.id, r.outcome.value, r.reason)
        )
        if outcome == spec.Outcome.PASSED.value:
            continue
        if check_id.startswith("schema.") and schema_failures_tolerated():
            warnings.warn(f"{check_id}: {reason}", UserWarning, stacklevel=2)
            continue
        out[check_id] = reason
    return out


# The profiles CI requires of rollout's own server: every optional one it implements.
ROLLOUT_PROFILES = ("rollout", "inflight", "inject", "auth", "limits")


async def test_rollout_server_passes_every_check() -> None:
    with trio.fail_after(60):
        async with serving() as url:
            options = harness_options(require=ROLLOUT_PROFILES)
            report = await spec.run_conformance(url, options)
    failed = not_passed(report.results)
    assert not failed, failed
    assert len(report.results) >= 40
    assert (report.ok and report.exit_code == 0) or schema_failures_tolerated()
    assert report.features == {
        "rollout": True,
        "lanes": True,
        "steer": True,
        "multi_agent": True,
        "auth": True,
        "deterministic": True,
    }
    verdicts = {p.name: (p.support, p.verdict, p.required) for p in report.profiles()}
    assert verdicts == {
        "core": (spec.Support.SUPPORTED, "passes", False),
        **{
            name: (spec.Support.SUPPORTED, "passes", True)
            for name in ("inflight", "inject", "rollout", "auth", "limits")
        },
    }
    lanes_checks = [r for r in report.results if r.feature == "lanes"]
    assert len(lanes_checks) >= 8 and not not_passed(lanes_checks)
    rollout_checks = [r for r in report.results if r.feature == "rollout"]
    assert len(rollout_checks) >= 10
    assert not not_passed(rollout_checks)
    steer_checks = [r for r in report.results if r.feature == "steer"]
    assert len(steer_checks) == 4 and not not_passed(steer_checks)


# What a check that needs a slow model says when the model was too fast: each names the
# default slow model, as the help does.
FAST_MODEL_SKIPS = {
    "the response ended before the steer arrived (use a --slow-model that streams at a "
    "bounded rate, e.g. sim:ttft_ms=400,tps=200)",
    "the call was made before the steer arrived (use a --slow-model that streams tool-call "
    "arguments at a bounded rate, e.g. sim:ttft_ms=400,tps=200)",
    "the rollout suspended before the append arrived (use a --slow-model that streams at a "
    "bounded rate, e.g. sim:ttft_ms=400,tps=200, to observe rollout_not_suspended)",
}


async def test_steering_checks_against_a_fast_model_skip_not_fail() -> None:
    """With a fast --slow-model (`sim`) the steer usually reaches a response that is already
    ending: the server refuses it (`response_not_active`, or `response_already_completed`
    after the end), and the checks that need a running response say so (SKIPPED, naming the
    default slow model), never fail or hang."""
    with trio.fail_after(60):
        async with serving() as url:
            options = harness_options(slow_model="sim", filter=("steer.*", "rollout.*"))
            report = await spec.run_conformance(url, options)
    outcomes = {r.id: r.outcome.value for r in report.results}
    assert {
        "steer.accepted",
        "steer.invalid_input",
        "steer.unknown_or_completed",
        "steer.pending",
    } <= set(outcomes)
    assert "failed" not in outcomes.values(), [(r.id, r.reason) for r in report.results]
    skips = {r.reason for r in report.results if r.outcome is spec.Outcome.SKIPPED}
    assert skips and skips <= FAST_MODEL_SKIPS, skips


def test_the_default_slow_model_is_the_one_the_help_and_messages_name() -> None:
    import argparse

    from rollout.spec._cli import add_parser
    from rollout.spec._context import DEFAULT_SLOW_MODEL

    assert DEFAULT_SLOW_MODEL == "sim:ttft_ms=400,tps=200"
    assert spec.Options().slow == DEFAULT_SLOW_MODEL
    assert spec.Options(model="gpt-x").slow == "gpt-x"
    assert spec.Options(model="gpt-x", slow_model="gpt-y").slow == "gpt-y"
    parser = argparse.ArgumentParser(prog="rollout")
    add_parser(parser.add_subparsers())
    conform = parser._subparsers._group_actions[0].choices["conform"]  # type: ignore[union-attr]
    (action,) = [a for a in conform._actions if "--slow-model" in a.option_strings]
    assert action.help is not None and action.help.endswith(
        "default 'sim:ttft_ms=400,tps=200' with the default --model, else --model"
    )
    assert "ttft_ms=" not in conform.epilog.replace(DEFAULT_SLOW_MODEL, "")


async def test_defaults_against_a_default_server_skip_only_what_needs_its_settings() -> None:
    """`rollout conform URL`, no options, against `rollout serve` with its defaults: the
    checks that need a slow model run on the default one and pass; the only checks skipped
    are those that need the server's settings told (--api-key, --max-message-size, ...)."""
    async with open_server(ServerConfig(port=0, data_dir=None, graceful_timeout=1.0)) as url:
        code, stdout, stderr = await run_cli(url, "--no-progress", "--json", "-", deadline=60)
    report = json.loads(stdout)
    skipped = {c["id"]: c["reason"] for c in report["checks"] if c["outcome"] == "skipped"}
    assert skipped == {
        "auth.http_401": "needs --api-key",
        "auth.ws_401": "needs --api-key",
        "http.error_body_too_large": "needs --max-message-size",
        "ws.message_too_large": "needs --max-message-size",
        "ws.queue_limit": "needs --max-queued-creates",
        "ws.connection_age_limit": "needs --age-limit-seconds",
        "rollout.suspend_timeout": "needs --rollout-suspend-limit",
    }, stderr
    ran = [c for c in report["checks"] if c["id"] not in skipped]
    assert not not_passed(ran), stderr
    assert code == 0 or schema_failures_tolerated(), stderr


async def test_cli_report_and_exit_status(tmp_path: Path) -> None:
    """What CI runs against rollout's own server: every profile required, every row shown."""
    out = tmp_path / "report.json"
    required = [arg for name in ROLLOUT_PROFILES for arg in ("--require", name)]
    async with serving() as url:
        code, stdout, stderr = await run_cli(
            url, *CLI_OPTIONS, *required, "--verbose", "--json", str(out), deadline=60
        )
    report = json.loads(out.read_text())
    assert not not_passed(report["checks"]), stdout + stderr
    assert len(report["checks"]) == len(spec.load_cases()) >= 40
    if not schema_failures_tolerated():
        assert code == 0, stdout + stderr
        assert report["ok"] is True
        assert report["summary"]["failed"] == 0
        assert {c["outcome"] for c in report["checks"]} == {"passed"}
    for entry in report["checks"]:
        assert set(entry) >= {"id", "rule", "title", "required", "feature", "outcome", "reason",
                              "profile", "cause", "unsupported"}  # fmt: skip
    assert [(p["name"], p["verdict"]) for p in report["profiles"]] == [
        ("core", "passes"), ("inflight", "passes"), ("inject", "passes"),
        ("rollout", "passes"), ("auth", "passes"), ("limits", "passes"),
    ]  # fmt: skip
    assert "ws.sequence_numbers" in stdout  # --verbose: every row
    assert "conformant" in stdout or schema_failures_tolerated()


async def test_cli_without_server_options_skips_what_needs_them() -> None:
    async with serving() as url:
        code, stdout, _ = await run_cli(
            url, "--api-key", API_KEY, "--timeout", "10", "--filter", "limits,auth.*",
            "--filter", "ws.message_too_large,ws.connection_age_limit,http.error_body_too_large",
            "--json", "-", deadline=30,
        )  # fmt: skip
    assert code == 0, stdout
    # `--json -`: the report alone on stdout (the table went to stderr).
    results = {c["id"]: c for c in json.loads(stdout)["checks"]}
    assert results["ws.connection_age_limit"]["outcome"] == "skipped"
    assert "--age-limit-seconds" in results["ws.connection_age_limit"]["reason"]
    assert results["ws.message_too_large"]["outcome"] == "skipped"
    assert results["auth.http_401"]["outcome"] == "passed"


def test_sync_wrapper() -> None:
    """`run_conformance_sync` from plain synchronous code (the server in its own thread)."""
    started = threading.Event()
    stop = threading.Event()
    holder: dict[str, str] = {}

    async def serve_in_thread() -> None:
        async with serving() as url:
            holder["url"] = url
            started.set()
            await trio.to_thread.run_sync(stop.wait)

    thread = threading.Thread(target=trio.run, args=(serve_in_thread,), daemon=True)
    thread.start()
    try:
        assert started.wait(30)
        report = spec.run_conformance_sync(
            holder["url"],
            harness_options(filter=("http.create", "ws.create_text", "rollout.resume")),
        )
    finally:
        stop.set()
        thread.join(30)
    assert [r.outcome for r in report.results] == [spec.Outcome.PASSED] * 3


class NoisyBackend:
    """The simulated model with a fresh random seed per turn: the same structure (one forced or
    requested call, then an answer), other words and arguments every time."""

    def __init__(self) -> None:
        self.sim = SimBackend()

    def check_params(self, params: Mapping[str, str]) -> None:
        self.sim.check_params(params)

    def sample(self, request: SampleRequest) -> AsyncIterator[SampleEvent]:
        return self.sim.sample(attrs.evolve(request, context_digest=secrets.token_bytes(16)))


async def test_nondeterministic_model_is_compared_by_structure() -> None:
    registry = ModelRegistry(
        [
            ModelSpec(name="sim", backend=SimBackend(), accepts_params=True),
            ModelSpec(name="noisy", backend=NoisyBackend(), accepts_params=True),
        ]
    )
    with trio.fail_after(60):
        async with serving(registry=registry) as url:
            options = harness_options(model="noisy", slow_model="noisy:ttft_ms=300,tps=200")
            report = await spec.run_conformance(url, options)
    # The equality checks could compare only the kind of the last item: WEAK, never PASSED.
    weak = {r.id for r in report.results if r.outcome is spec.Outcome.WEAK}
    assert weak == {
        "ws.continuation_equals_stateless",
        "ws.stream_true",
        "ws.warmup_chain",
        "lanes.fork",
        "rollout.equals_chain",
    }, weak
    for r in report.results:
        if r.id in weak:
            assert "not deterministic" in r.reason, (r.id, r.reason)
    failed = {k: v for k, v in not_passed(report.results).items() if k not in weak}
    assert not failed, failed
    assert report.counts()["weak"] == len(weak) and report.ok
    out = io.StringIO()
    print_table(report, Console(file=out, width=200))
    assert f"{len(weak)} weak (structure only)" in out.getvalue()
    assert report.features == {
        "rollout": True,
        "lanes": True,
        "steer": True,
        "multi_agent": True,
        "auth": True,
        "deterministic": False,
    }


# --- servers that are down, refuse the upgrade, or never answer ----------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_server_down_fails_every_check_quickly() -> None:
    """From code: every check fails at once, saying why. (`rollout conform` stops before with
    one message: tests/test_conform_cli.py.)"""
    port = closed_port()
    with trio.fail_after(30):
        report = await spec.run_conformance(f"http://127.0.0.1:{port}/v1", harness_options())
    assert report.ok is False and report.exit_code == 1
    assert {r.outcome for r in report.results} == {spec.Outcome.FAILED}
    assert {r.reason for r in report.results} == {
        f"nothing is listening at 127.0.0.1:{port} (connection refused)."
    }
    assert report.seconds < 10


async def test_http_only_server_fails_websocket_checks() -> None:
    with trio.fail_after(60):
        async with serving(websocket=False) as url:
            report = await spec.run_conformance(url, harness_options(timeout=5.0))
    results = report.by_id()
    assert report.exit_code == 1
    assert results["http.create"].outcome is spec.Outcome.PASSED
    for check_id in ("ws.upgrade_minimal", "ws.frames", "ws.create_text"):
        assert results[check_id].outcome is spec.Outcome.FAILED
        assert "refused with HTTP 426" in results[check_id].reason
    # The rollout probe cannot even connect: whether the server has the extension is unknown,
    # its checks are skipped (the 426 already fails core), and it says why.
    assert results["rollout.resume"].outcome is spec.Outcome.SKIPPED
    assert results["rollout.resume"].reason.startswith("not probed: the rollout probe failed: ")
    verdicts = {p.name: p.support for p in report.profiles()}
    assert verdicts["rollout"] is spec.Support.UNKNOWN


async def test_silent_server_times_out_within_the_deadline() -> None:
    """A server that accepts connections and never answers: every check ends by its timeout."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    accepted: list[trio.socket.SocketType] = []

    async def accept_forever() -> None:
        while True:
            conn, _ = await listener.accept()
            accepted.append(conn)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_forever)
            options = harness_options(
                timeout=1.0,
                filter=("http.create", "ws.create_text", "rollout.suspend", "ws.fifo_queue"),
            )
            report = await spec.run_conformance(f"http://127.0.0.1:{port}/v1", options)
            nursery.cancel_scope.cancel()
    for conn in accepted:
        conn.close()
    listener.close()
    assert [r.outcome for r in report.results] == [spec.Outcome.FAILED] * 4
    assert report.seconds < 10


# --- the order analysis: a replay through the protocol's grammar -------------------------------


def _built_stream(*, fail: bool = False) -> list[dict[str, Any]]:
    from rollout import protocol as p

    stream = p.ResponseStream(p.Response(id="resp_1", created_at=0, model="m"))
    events = [*stream.start(), *stream.begin_message("msg_1"), stream.text_delta("hi")]
    if fail:
        events.append(
            stream.fail(error=p.ResponseError(code="server_error", message="x"), usage=None)
        )
    else:
        events += [*stream.end_message(), stream.complete(usage=p.Usage(), completed_at=1)]
    return [json.loads(p.encode_json(event)) for event in events]


def test_order_problems_replays_the_protocol_grammar() -> None:
    """`order_problems` is the protocol's item grammar replayed (no rules of its own): a
    built stream passes; a delta after its part is done, a part outside a message and a
    part numbered wrong are reported at the event, as the client connection refuses them."""
    from rollout.spec._analysis import order_problems

    events = _built_stream()
    assert order_problems(events) == []
    late = {**events[4], "sequence_number": 7}  # the text delta, again after content_part.done
    renumbered = [{**e, "sequence_number": e["sequence_number"] + 1} for e in events[7:]]
    assert order_problems([*events[:7], late, *renumbered]) == [
        "event 7 (response.output_text.delta): text outside an open content part"
    ]
    swapped = [
        *events[:2],
        {**events[3], "sequence_number": 2},
        {**events[2], "sequence_number": 3},
    ]
    assert order_problems([*swapped, *events[4:]]) == [
        "event 2 (response.content_part.added): a content part outside a message item"
    ]
    wrong_part = [*events[:3], {**events[3], "content_index": 1}, *events[4:]]
    assert order_problems(wrong_part) == [
        "event 3 (response.content_part.added): content_index 1, expected 0"
    ]


def test_order_problems_reports_an_item_a_failed_response_left_open() -> None:
    from rollout.spec._analysis import order_problems

    assert order_problems(_built_stream(fail=True)) == ["item 0 was never done"]
