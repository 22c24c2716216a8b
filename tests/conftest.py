"""The schema hook: every Response and every server event rollout's in-process servers emit,
anywhere in the test suite, is checked against `spec/responses.schema.json` (via
`spec._schema`) and against the official openai SDK's pydantic types.

A session-wide autouse fixture wraps `RolloutApp.__call__` at the class level (restored at the
end) and copies what the app hands to the ASGI `send`:

* WebSocket text frames (`websocket.send` with `text`): WebSocket events;
* the body of `POST /v1/responses` answered `text/event-stream`: server-sent events (frames
  parsed across body chunks);
* a `200` JSON body of `POST /v1/responses` or `GET /v1/responses/{id}`: a Response object;
* a `200` JSON body of `POST /v1/responses/compact`: a compaction resource.

Copies are checked after each test, off the server's path (the servers' timing is unchanged);
a test whose servers emitted anything invalid fails at teardown, quoting the first few
violations with the offending JSON. `@pytest.mark.no_schema_hook` opts a test out (for tests
that serve deliberately broken variants); `ROLLOUT_SCHEMA_HOOK=warn` turns failures into
warnings; `ROLLOUT_SCHEMA_REPORT=PATH` appends every violation to PATH as JSON lines.

Servers in another process (`rollout serve` subprocesses) are not seen.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import threading
import typing
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import attrs
import pydantic
import pytest
from hypothesis import settings
from openai.types.beta.beta_responses_server_event import BetaResponsesServerEvent
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from openai.types.responses.responses_server_event import ResponsesServerEvent
from rollout.engine._app import RolloutApp
from rollout.spec._schema import compaction_problems, event_problems, response_problems

HOOK_ENV = "ROLLOUT_SCHEMA_HOOK"  # "warn": report violations as warnings, do not fail
REPORT_ENV = "ROLLOUT_SCHEMA_REPORT"  # a path: every violation appended as a JSON line
MARKER = "no_schema_hook"
# Violations quoted in a failure, and the length of each quoted JSON.
SHOWN = 5
CLIP = 600
# Events only rollout sends (the SDK has no type for them; the schema covers them).
ROLLOUT_ONLY_EVENTS = frozenset({"response.done", "rollout.timing"})


def tagged(union: Any) -> pydantic.TypeAdapter[Any]:
    """A TypeAdapter of an SDK event union, discriminated on `type`. (The SDK marks the
    discriminator in its own metadata, which pydantic does not read: the plain union would try
    every member and report them all.)"""

    def members(u: Any) -> list[Any]:
        out = []
        for arg in typing.get_args(u):
            if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel):
                out.append(arg)
            else:
                out.extend(members(arg))
        return out

    found = tuple(dict.fromkeys(members(union)))
    return pydantic.TypeAdapter(
        typing.Annotated[typing.Union[found], pydantic.Field(discriminator="type")]  # noqa: UP007
    )


SSE_EVENT = tagged(ResponseStreamEvent)
WS_EVENT = tagged(ResponsesServerEvent)
# The multi-agent beta's events (inject acknowledgements), in the SDK's beta union.
BETA_WS_EVENT = tagged(BetaResponsesServerEvent)
BETA_ONLY_EVENTS = frozenset({"response.inject.created", "response.inject.failed"})

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
_RESPONSES = ("/v1/responses", "/responses")
_RESPONSE_ID_PATH = re.compile(r"^/v1/responses/(?!compact/?$|input_tokens/?$)[A-Za-z0-9_.\-]+/?$")


@attrs.frozen
class Emitted:
    """One thing a server sent: `kind` is ws, sse, response or compaction."""

    kind: str
    where: str
    text: str
    sse_name: str | None = None  # the `event:` field of a server-sent event


@attrs.frozen
class Violation:
    where: str
    checker: str  # "schema" or "sdk"
    problems: tuple[str, ...]
    text: str

    def render(self) -> str:
        lines = "\n".join(f"    - {p}" for p in self.problems[:8])
        more = f"\n    - ... {len(self.problems) - 8} more" if len(self.problems) > 8 else ""
        return f"  {self.where} ({self.checker}):\n{lines}{more}\n    JSON: {clip(self.text)}"


def clip(text: str, limit: int = CLIP) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class Recorder:
    """What the servers sent since the last check; appended from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Emitted] = []

    def add(self, kind: str, where: str, text: str, sse_name: str | None = None) -> None:
        with self._lock:
            self._pending.append(Emitted(kind, where, text, sse_name))

    def snapshot(self) -> list[Emitted]:
        with self._lock:
            return list(self._pending)

    def drain(self) -> list[Emitted]:
        with self._lock:
            pending, self._pending = self._pending, []
        return pending


# --- checking ------------------------------------------------------------------------------------


# `incomplete_details.reason` values of rollout's own (the SDK's type knows neither).
ROLLOUT_INCOMPLETE_REASONS = frozenset({"rollout_timeout", "server_shutdown"})


def sdk_problems(exc: pydantic.ValidationError, tag: Any = None) -> list[str]:
    out = []
    for error in exc.errors()[:10]:
        loc = error["loc"]
        if loc and loc[0] == tag:  # a discriminated union names the member first
            loc = loc[1:]
        path = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        out.append(f"{path}: {clip(error['msg'], 200)}")
    return out


def sdk_response(obj: Any) -> list[str]:
    if not isinstance(obj, dict):
        return []
    details = obj.get("incomplete_details")
    if isinstance(details, dict) and details.get("reason") in ROLLOUT_INCOMPLETE_REASONS:
        # rollout's extension reasons, unknown to the SDK: checked as a reason-less response.
        obj = {**obj, "incomplete_details": {**details, "reason": None}}
    try:
        SdkResponse.model_validate(obj)
    except pydantic.ValidationError as exc:
        return sdk_problems(exc)
    return []


def sdk_event(obj: Any, adapter: pydantic.TypeAdapter[Any]) -> list[str]:
    if not isinstance(obj, dict):
        return []
    kind = obj.get("type")
    if kind in ROLLOUT_ONLY_EVENTS:
        return []
    if kind in BETA_ONLY_EVENTS:
        adapter = BETA_WS_EVENT
    response = obj.get("response")
    if (
        kind == "response.in_progress"
        and isinstance(response, dict)
        and "created_at" not in response
    ):
        return []  # a resumed rollout's: it names its response (the schema covers it, RX-2.3)
    steer = obj.get("steer")
    if kind == "response.steer.failed" and isinstance(steer, dict):
        error = obj.get("error")
        if isinstance(error, dict) and error.get("code") == "invalid_input":
            # A failure returns the input as the client sent it: for invalid_input, whatever it
            # was, which the SDK's input type need not admit (the schema checks the rest).
            obj = {**obj, "steer": {**steer, "input": ""}}
    details = (obj.get("response") or {}).get("incomplete_details") if kind else None
    if isinstance(details, dict) and details.get("reason") in ROLLOUT_INCOMPLETE_REASONS:
        obj = {**obj, "response": {**obj["response"], "incomplete_details": {"reason": None}}}
    try:
        adapter.validate_python(obj)
    except pydantic.ValidationError as exc:
        return sdk_problems(exc, tag=kind)
    return []


def check(emitted: Emitted) -> list[Violation]:
    try:
        obj = json.loads(emitted.text)
    except ValueError:
        return [Violation(emitted.where, "schema", ("$: not JSON",), emitted.text)]
    if emitted.kind == "response":
        schema, sdk = response_problems(obj), sdk_response(obj)
    elif emitted.kind == "compaction":
        # The SDK's CompactedResponse types its output as response output items (assistant
        # messages only), although a compacted window holds user messages: schema only.
        schema, sdk = compaction_problems(obj), []
    elif emitted.kind == "sse":
        schema, sdk = event_problems(obj, transport="sse"), sdk_event(obj, SSE_EVENT)
        kind = obj.get("type") if isinstance(obj, dict) else None
        if emitted.sse_name is not None and emitted.sse_name != kind:
            schema.append(f"$.type: {kind!r}, but the SSE `event:` field is {emitted.sse_name!r}")
    else:
        schema, sdk = event_problems(obj, transport="ws"), sdk_event(obj, WS_EVENT)
    out = []
    if schema:
        out.append(Violation(emitted.where, "schema", tuple(schema), emitted.text))
    if sdk:
        out.append(Violation(emitted.where, "sdk", tuple(sdk), emitted.text))
    return out


# --- capturing what the app sends ----------------------------------------------------------------


class SseFrames:
    """Server-sent-event frames from body chunks split anywhere (`event:` and `data:` lines,
    a blank line ends an event)."""

    def __init__(self, recorder: Recorder, where: str) -> None:
        self._recorder = recorder
        self._where = where
        self._buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, chunk: bytes, *, final: bool = False) -> None:
        text = self._buffer + self._decoder.decode(chunk, final=final)
        held = ""
        if text.endswith("\r") and not final:  # maybe the first half of a CRLF
            text, held = text[:-1], "\r"
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        *frames, rest = text.split("\n\n")
        self._buffer = rest + held
        if final and self._buffer.strip():
            frames.append(self._buffer)
            self._buffer = ""
        for frame in frames:
            self._frame(frame)

    def _frame(self, frame: str) -> None:
        name: str | None = None
        data: list[str] = []
        for line in frame.split("\n"):
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if not data:
            return
        text = "\n".join(data)
        where = f"SSE event{f' {name!r}' if name else ''} of {self._where}"
        self._recorder.add("sse", where, text, name)


def http_capture(recorder: Recorder, scope: dict[str, Any], send: Send) -> Send:
    method, path = scope.get("method", ""), scope.get("path", "")
    stripped = path.rstrip("/")
    if method == "POST" and stripped in _RESPONSES:
        target = "create"
    elif method == "POST" and stripped in tuple(p + "/compact" for p in _RESPONSES):
        target = "compaction"
    elif method == "GET" and _RESPONSE_ID_PATH.match(path):
        target = "retrieve"
    else:
        return send
    where = f"{method} {path}"
    state: dict[str, Any] = {"status": 0, "sse": None, "body": []}

    async def capture(message: Message) -> None:
        try:
            if message.get("type") == "http.response.start":
                state["status"] = message.get("status", 0)
                headers = {bytes(k).lower(): bytes(v) for k, v in message.get("headers", [])}
                ctype = headers.get(b"content-type", b"")
                if target == "create" and ctype.startswith(b"text/event-stream"):
                    state["sse"] = SseFrames(recorder, where)
            elif message.get("type") == "http.response.body" and state["status"] == 200:
                body = message.get("body", b"")
                final = not message.get("more_body", False)
                if state["sse"] is not None:
                    state["sse"].feed(body, final=final)
                else:
                    state["body"].append(body)
                    if final:
                        kind = "compaction" if target == "compaction" else "response"
                        text = b"".join(state["body"]).decode("utf-8", "replace")
                        recorder.add(kind, f"JSON body of {where}", text)
        except Exception as exc:  # the hook must never break a server
            recorder.add("hook-error", where, json.dumps({"error": repr(exc)}))
        await send(message)

    return capture


def ws_capture(recorder: Recorder, scope: dict[str, Any], send: Send) -> Send:
    where = f"WebSocket event on {scope.get('path', '')}"

    async def capture(message: Message) -> None:
        if message.get("type") == "websocket.send" and message.get("text") is not None:
            recorder.add("ws", where, message["text"])
        await send(message)

    return capture


def check_all(emitted: list[Emitted]) -> list[Violation]:
    violations: list[Violation] = []
    for item in emitted:
        if item.kind == "hook-error":
            violations.append(Violation(item.where, "hook", ("the hook failed",), item.text))
        else:
            violations.extend(check(item))
    return violations


# --- pytest wiring -------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: do not check what this test's servers emit against the Responses schema "
        "(for tests that serve deliberately broken variants)",
    )


@pytest.fixture(scope="session", autouse=True)
def schema_hook() -> Iterator[Recorder]:
    """Wrap the ASGI `send` of every `RolloutApp` for the whole session."""
    recorder = Recorder()
    original = RolloutApp.__call__

    async def wrapped(self: RolloutApp, scope: Any, receive: Any, send: Send) -> None:
        if scope.get("type") == "http":
            send = http_capture(recorder, scope, send)
        elif scope.get("type") == "websocket":
            send = ws_capture(recorder, scope, send)
        await original(self, scope, receive, send)

    RolloutApp.__call__ = wrapped  # type: ignore[method-assign]
    try:
        yield recorder
    finally:
        RolloutApp.__call__ = original  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def schema_checked(request: pytest.FixtureRequest, schema_hook: Recorder) -> Iterator[None]:
    """After the test (and its own fixtures): what its servers emitted is valid."""
    yield
    emitted = schema_hook.drain()
    if request.node.get_closest_marker(MARKER) is not None or not emitted:
        return
    violations = check_all(emitted)
    if not violations:
        return
    report_path = os.environ.get(REPORT_ENV)
    if report_path:
        with open(report_path, "a", encoding="utf-8") as f:
            for v in violations:
                f.write(json.dumps({"test": request.node.nodeid, **attrs.asdict(v)}) + "\n")
    shown = "\n".join(v.render() for v in violations[:SHOWN])
    more = len(violations) - SHOWN
    message = (
        f"{len(violations)} emitted object(s) violate the Responses schema or the SDK types "
        f"(of {len(emitted)} checked):\n{shown}" + (f"\n  ... and {more} more" if more > 0 else "")
    )
    if os.environ.get(HOOK_ENV, "fail").lower() == "warn":
        warnings.warn(message, SchemaViolationWarning, stacklevel=1)
        return
    pytest.fail(message, pytrace=False)


class SchemaViolationWarning(UserWarning):
    """What the schema hook reports with ROLLOUT_SCHEMA_HOOK=warn."""


# Hypothesis profiles (docs/testing.md). `default` (a plain `pytest`) and `ci` (`.ci/run`) are
# derandomized: every run draws the same examples, so the suite and CI are deterministic; `ci`
# draws more where it matters (the equivalence tests read the profile's name:
# `tests.wire_scripts.examples`). `deep` draws fresh random examples each run, and many more,
# for searching locally (`thorough` is its older name).
settings.register_profile("default", derandomize=True)
settings.register_profile("ci", derandomize=True)
settings.register_profile("deep", derandomize=False, max_examples=500)
settings.register_profile("thorough", derandomize=False, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# PostgreSQL: a fresh database per session, a fresh schema per store or ledger (pg_harness.py).
from tests.pg_harness import postgres_database, postgres_urls  # noqa: E402, F401

# The store several rollout processes share, PostgreSQL and SQLite (store_harness.py).
from tests.store_harness import shared_store  # noqa: E402, F401
