"""Every conformance check can fail: the harness runs against deliberately broken variants of
rollout's server (ASGI wrappers around `RolloutApp`, served by hypercorn through
`ServerConfig.app_wrapper`), and each check fails against at least one variant that breaks
its rule, for the reason that rule names: `MUTANTS` maps each variant to the checks it must fail
and each failure to the words its reason must contain (never a timeout or an unexpected
exception); a test asserts that the mapping covers every check. The error variants derive
their reasons from the error table (`rollout.spec._checks_errors.ERROR_ROWS`).

A variant intercepts the ASGI messages: WebSocket frames the app sends (dropped, rewritten,
renumbered, reordered, sent as binary, followed by a close), client events before the app sees
them (rewritten, or answered by the wrapper itself), the upgrade (refused), and HTTP bodies.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

import pytest
import trio
from rollout import protocol as p
from rollout import spec
from rollout.engine._app import RolloutApp
from rollout.spec._checks_errors import ERROR_ROWS, ErrorRow

from tests.test_conform import (
    API_KEY,
    harness_options,
    not_passed,
    schema_failures_tolerated,
    serving,
)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


def text(event: dict[str, Any]) -> Message:
    return {"type": "websocket.send", "text": json.dumps(event)}


def ws_error(code: str, param: str | None = None, status: int = 400) -> Message:
    return text(
        {
            "type": "error",
            "status": status,
            "error": {
                "type": "invalid_request_error",
                "code": code,
                "message": "mutant",
                "param": param,
            },
        }
    )


class Conn:
    """One WebSocket connection through a mutant: per-connection state and a send lock (the
    wrapper may answer a client event itself while the app is sending)."""

    def __init__(self, mutant: Mutant, scope: Scope, receive: Receive, send: Send) -> None:
        self.mutant = mutant
        self.scope = scope
        self._receive = receive
        self._send = send
        self.lock = trio.Lock()
        self.closed = False
        self.state: dict[str, Any] = {}
        self.last_client = trio.current_time()

    async def emit(self, messages: list[Message]) -> None:
        async with self.lock:
            for message in messages:
                if self.closed:
                    return
                if message["type"] == "websocket.close":
                    self.closed = True
                await self._send(message)

    async def receive(self) -> Message:
        while True:
            message = await self._receive()
            self.last_client = trio.current_time()
            if message["type"] != "websocket.receive" or message.get("text") is None:
                return message
            try:
                event = json.loads(message["text"])
            except ValueError:
                return message
            if not isinstance(event, dict):
                return message
            new = await self.mutant.client_event(self, event)
            if new is not None:
                return {**message, "text": json.dumps(new)}

    async def send(self, message: Message) -> None:
        if message["type"] == "websocket.send" and message.get("text") is not None:
            await self.emit(self.mutant.server_event(self, json.loads(message["text"])))
        elif message["type"] == "websocket.close":
            await self.emit([message])
        elif message["type"] == "websocket.http.response.start":  # the upgrade is refused
            await self._send({**message, "status": self.mutant.http_status(message["status"])})
        elif not self.closed:
            await self._send(message)


class Mutant:
    """The identity wrapper; each variant overrides the hooks that break its rule."""

    breaks: ClassVar[tuple[str, ...]] = ()  # the check ids this variant must fail
    # Why each of those checks must fail: words its reason contains, the same for every check
    # or one entry per check id.
    reason: ClassVar[str | Mapping[str, str] | None] = None

    def __init__(self, app: RolloutApp) -> None:
        self.app = app

    @classmethod
    def expected_reason(cls, check_id: str) -> str | None:
        """The words the failure of `check_id` must contain (None: not stated)."""
        if isinstance(cls.reason, Mapping):
            return cls.reason.get(check_id)
        return cls.reason

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self.websocket(scope, receive, send)
        elif scope["type"] == "http":
            await self.http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    # --- WebSocket hooks ---
    def refuse_upgrade(self, scope: Scope) -> int | None:
        return None

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        """The event the app gets, or None when the mutant swallowed (and maybe answered) it."""
        return event

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        return [text(event)]

    async def websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = self.refuse_upgrade(scope)
        if status is not None:
            await receive()  # websocket.connect
            body = json.dumps(
                {
                    "error": {
                        "message": "mutant",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "refused",
                    }
                }
            )
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "websocket.http.response.body", "body": body.encode()})
            return
        conn = Conn(self, self.ws_scope(scope), receive, send)
        await self.run_ws(conn)

    async def run_ws(self, conn: Conn) -> None:
        await self.app(conn.scope, conn.receive, conn.send)

    def ws_scope(self, scope: Scope) -> Scope:
        return scope

    # --- HTTP hooks ---
    def http_scope(self, scope: Scope) -> Scope:
        return scope

    def http_status(self, status: int) -> int:
        """The status of an HTTP answer (also of a refused upgrade)."""
        return status

    def request_body(self, scope: Scope, body: bytes) -> bytes:
        return body

    def response_body(self, scope: Scope, status: int, body: bytes) -> bytes:
        return body

    def sse_chunk(self, chunk: bytes) -> bytes:
        return chunk

    async def http_answer(self, scope: Scope) -> tuple[int, dict[str, Any]] | None:
        """Answer the request without the app (status, JSON body), or None."""
        return None

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope = self.http_scope(scope)
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        answer = await self.http_answer(scope)
        if answer is not None:
            payload = json.dumps(answer[1]).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": answer[0],
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        body = self.request_body(scope, b"".join(chunks))
        delivered = False

        async def new_receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        start: Message | None = None
        held: list[bytes] = []

        async def new_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            headers = dict(start["headers"])
            if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                if held == []:
                    held.append(b"started")
                    await send(start)
                await send({**message, "body": self.sse_chunk(message.get("body", b""))})
                return
            held.append(message.get("body", b""))
            if message.get("more_body"):
                return
            payload = self.response_body(scope, start["status"], b"".join(held))
            fixed = [(k, v) for k, v in start["headers"] if k != b"content-length"]
            fixed.append((b"content-length", str(len(payload)).encode()))
            await send({**start, "status": self.http_status(start["status"]), "headers": fixed})
            await send({"type": "http.response.body", "body": payload})

        await self.app(scope, new_receive, new_send)


def _create(event: dict[str, Any]) -> bool:
    return event.get("type") == "response.create"


def _json_rewrite(body: bytes, edit: Callable[[Any], None]) -> bytes:
    try:
        value = json.loads(body)
    except ValueError:
        return body
    edit(value)
    return json.dumps(value).encode()


ROWS: dict[str, ErrorRow] = {row.id: row for row in ERROR_ROWS}


def row_reasons(
    breaks: tuple[str, ...], of_row: Callable[[ErrorRow], str], **others: str
) -> dict[str, str]:
    """The reasons of an error variant: `of_row(row)` for each check of the error table, and
    `others` (check id with `.` as `__`) for the checks written out."""
    reasons = {check: of_row(ROWS[check]) for check in breaks if check in ROWS}
    reasons.update({name.replace("__", "."): words for name, words in others.items()})
    return reasons


# --- the variants ------------------------------------------------------------------------------


def _steer(event: dict[str, Any]) -> bool:
    return event.get("type") == "response.steer"


class SteerAcceptedWithoutId(Mutant):
    """Acceptances name no steering submission."""

    breaks = ("steer.accepted",)
    reason = "response.steer.accepted carries steer.id"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event.get("type") == "response.steer.accepted":
            event["steer"].pop("id", None)
        return [text(event)]


class SteerAcceptsAnything(Mutant):
    """A gateway that drops the fields and roles it does not like before the server sees the
    steer: malformed steers are accepted."""

    breaks = ("steer.invalid_input",)
    reason = "answered with response.steer.accepted, expected response.steer.failed"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _steer(event):
            event.pop("stream_id", None)
        return event


class SteerTargetsConfused(Mutant):
    """Unknown and completed targets are reported as invalid input."""

    breaks = ("steer.unknown_or_completed",)
    reason = "response.steer.failed has code 'invalid_input'"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event.get("type") == "response.steer.failed":
            event["error"]["code"] = "invalid_input"
        return [text(event)]


class SteerPendingNamesNothing(Mutant):
    """`response.steer.pending` comes, but without the stubs of the owed outputs."""

    breaks = ("steer.pending",)
    reason = "required_input is [], expected"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event.get("type") == "response.steer.pending":
            event["required_input"] = []
        return [text(event)]


class RequireBetaHeader(Mutant):
    breaks = ("ws.upgrade_minimal",)
    reason = "upgrade was refused with HTTP 400"

    def refuse_upgrade(self, scope: Scope) -> int | None:
        names = {k.lower() for k, _ in scope["headers"]}
        return None if b"openai-beta" in names else 400


class RejectSdkHeaders(Mutant):
    breaks = ("ws.upgrade_extra_headers",)
    reason = "upgrade was refused with HTTP 400"

    def refuse_upgrade(self, scope: Scope) -> int | None:
        names = {k.lower() for k, _ in scope["headers"]}
        return 400 if any(n.startswith(b"x-stainless") for n in names) else None


class RejectQuery(Mutant):
    breaks = ("ws.upgrade_query_params",)
    reason = "upgrade was refused with HTTP 400"

    def refuse_upgrade(self, scope: Scope) -> int | None:
        return 400 if scope.get("query_string") else None


class BinaryFrames(Mutant):
    breaks = ("ws.frames",)
    reason = "came in binary frames, expected text frames"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        return [{"type": "websocket.send", "bytes": json.dumps(event).encode()}]


# IdleClose closes a connection this long after the client's last message, in seconds.
IDLE_LIMIT = 0.3


class IdleClose(Mutant):
    """Closes a connection IDLE_LIMIT seconds after the client last sent something."""

    breaks = ("ws.idle_ping",)
    # The close fails the check whether it comes while the check idles ("... on an idle
    # connection") or during its first ping, when the handshake and that ping took longer than
    # IDLE_LIMIT (a loaded machine: seen once in CI, at the end of the whole suite).
    reason = "(close code 1000)"

    async def run_ws(self, conn: Conn) -> None:
        async with trio.open_nursery() as nursery:

            async def watchdog() -> None:
                # Polls the time of the client's last message (it moves as messages come).
                while trio.current_time() - conn.last_client < IDLE_LIMIT:  # noqa: ASYNC110
                    await trio.sleep(IDLE_LIMIT / 6)
                await conn.emit([{"type": "websocket.close", "code": 1000}])
                nursery.cancel_scope.cancel()

            nursery.start_soon(watchdog)
            await self.app(conn.scope, conn.receive, conn.send)
            nursery.cancel_scope.cancel()


class CloseAfterTerminal(Mutant):
    breaks = (
        "ws.create_text",
        "ws.open_after_terminal",
        "ws.sequential_creates",
        "ws.error_keeps_socket",
        "ws.message_too_large",
    )
    reason = "code 1000)"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] in TERMINAL:
            return [text(event), {"type": "websocket.close", "code": 1000}]
        return [text(event)]


class RejectStream(Mutant):
    breaks = ("ws.stream_true",)
    reason = "observed error 'unknown_parameter'"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event) and "stream" in event:
            await conn.emit([ws_error("unknown_parameter", "stream")])
            return None
        return event


class RejectNulls(Mutant):
    breaks = ("ws.explicit_nulls",)
    reason = "observed error 'invalid_type'"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        nulls = [k for k, v in event.items() if v is None]
        if _create(event) and nulls:
            await conn.emit([ws_error("invalid_type", nulls[0])])
            return None
        return event


class RequireItemType(Mutant):
    breaks = ("ws.short_form_message",)
    reason = "observed error 'missing_required_parameter'"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        items = event.get("input")
        if _create(event) and isinstance(items, list) and any("type" not in i for i in items):
            await conn.emit([ws_error("missing_required_parameter", "input[0].type")])
            return None
        return event


class WarmupGenerates(Mutant):
    breaks = ("ws.warmup",)
    reason = "generate: false produced output"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        event.pop("generate", None)
        return event


class ForgetParent(Mutant):
    """Continuations never find their parent (as if every create started a fresh session)."""

    breaks = (
        "ws.continuation_new_items",
        "ws.warmup_chain",
        "ws.store_hydration",
        "rollout.equals_chain",
    )
    # (rollout.equals_chain fails on its reference: the chain cannot continue.)
    reason = "observed error 'previous_response_not_found'"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event) and event.get("previous_response_id"):
            event["previous_response_id"] = "resp_forgotten"
        return event


class UnlabelledTerminal(Mutant):
    """Runs lanes (the probe sees its events echo the lane) but drops the `stream_id` of the
    terminal event. (A server that drops `stream_id` altogether has no lanes: its lanes checks
    are skipped, tests/test_conform_profiles.py.)"""

    breaks = ("ws.stream_id",)
    reason = "was accepted but response.completed does not echo it"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event.get("type") == "response.completed":
            event.pop("stream_id", None)
        return [text(event)]


def lane_error(code: str, stream_id: str, param: str | None = None, status: int = 400) -> Message:
    """A WebSocket `error` on a lane (its `stream_id` echoed)."""
    message = ws_error(code, param, status)
    return text({**json.loads(message["text"]), "stream_id": stream_id})


def _terminal_of_lane(event: dict[str, Any]) -> bool:
    return event["type"] in TERMINAL and isinstance(event.get("stream_id"), str)


class DropDeltaLane(Mutant):
    """Text deltas of a laned response lose their `stream_id`."""

    breaks = ("lanes.echo",)
    reason = "response.output_text.delta of the response on lane"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.output_text.delta":
            event.pop("stream_id", None)
        return [text(event)]


class AcceptBadLanes(Mutant):
    """Runs a create with an invalid `stream_id` on a lane of its own choosing."""

    breaks = ("lanes.invalid_stream_id",)
    reason = "expected an error event with code 'invalid_stream_id', observed response.created"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        lane = event.get("stream_id")
        if _create(event) and isinstance(lane, str) and not p.valid_stream_id(lane):
            event["stream_id"] = "lenient"
        return event


# FewLanes refuses a connection's lanes past this many.
FEW_LANES = 16


class FewLanes(Mutant):
    """Refuses lanes past the 16th of a connection as if the limit were reached."""

    breaks = ("lanes.limit",)
    reason = f"lane {FEW_LANES + 1} of 32 was refused with error 'websocket_stream_limit_reached'"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        lane = event.get("stream_id")
        if _create(event) and isinstance(lane, str):
            lanes = conn.state.setdefault("lanes", set())
            if lane not in lanes and len(lanes) >= FEW_LANES:
                await conn.emit([lane_error("websocket_stream_limit_reached", lane, "stream_id")])
                return None
            lanes.add(lane)
        return event


class OverlapOnALane(Mutant):
    """A create on a busy lane runs at once on a hidden lane, its events put back on the lane
    it named: two responses of one lane overlap."""

    breaks = ("lanes.fifo",)
    reason = "2 response.created events before its terminal event, expected one"
    HIDDEN = ".hidden-twin"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        lane = event.get("stream_id")
        if (
            _create(event)
            and isinstance(lane, str)
            and lane in conn.state.setdefault("busy", set())
        ):
            event["stream_id"] = lane + self.HIDDEN
        elif _create(event) and isinstance(lane, str):
            conn.state["busy"].add(lane)
        return event

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        lane = event.get("stream_id")
        if isinstance(lane, str) and lane.endswith(self.HIDDEN):
            event["stream_id"] = lane.removesuffix(self.HIDDEN)
        return [text(event)]


class SerialLanes(Mutant):
    """Runs every create on the default lane, one at a time, and labels each response's
    events with the lane its create named: lanes that never overlap."""

    breaks = ("lanes.concurrent",)
    reason = "only after the one on lane"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event):
            conn.state.setdefault("order", []).append(event.pop("stream_id", None))
        return event

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] in ("response.created", "error") and conn.state.get("current") is None:
            order = conn.state.get("order") or [None]
            conn.state["current"] = order.pop(0)
        lane = conn.state.get("current")
        if lane is not None:
            event["stream_id"] = lane
        if event["type"] in TERMINAL:
            conn.state["current"] = None
        return [text(event)]


class RefuseBeyondSixteen(Mutant):
    """Refuses a create while 16 responses of the connection are in flight."""

    breaks = ("lanes.in_flight",)
    reason = "was refused with error 'too_many_requests': more than 16 responses in flight"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event):
            if conn.state.get("running", 0) >= 16:
                lane = str(event.get("stream_id"))
                await conn.emit([lane_error("too_many_requests", lane, None, 429)])
                return None
            conn.state["running"] = conn.state.get("running", 0) + 1
        return event

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] in TERMINAL:
            conn.state["running"] = conn.state.get("running", 0) - 1
        return [text(event)]


class LaneScopedParents(Mutant):
    """A continuation finds only parents made on its own lane."""

    breaks = ("lanes.fork",)
    reason = "observed error 'previous_response_not_found'"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.completed":
            made = conn.state.setdefault("made", {})
            made[event["response"]["id"]] = event.get("stream_id")
        return [text(event)]

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        parent = event.get("previous_response_id")
        made = conn.state.get("made", {})
        if _create(event) and parent in made and made[parent] != event.get("stream_id"):
            event["previous_response_id"] = "resp_forgotten"
        return event


class EvictOnAnyFailure(Mutant):
    """A failed continuation on any lane evicts its parent."""

    breaks = ("lanes.fork_failure",)
    reason = "a failed fork must keep the parent"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        parent = event.get("previous_response_id")
        if _create(event) and parent:
            if parent in conn.state.setdefault("evicted", set()):
                event["previous_response_id"] = "resp_evicted"
            conn.state.setdefault("asked", {})[event.get("stream_id")] = parent
        return event

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        asked = conn.state.get("asked", {})
        if event["type"] == "error" and event.get("stream_id") in asked:
            conn.state["evicted"].add(asked.pop(event.get("stream_id")))
        elif event["type"] == "response.created":
            asked.pop(event.get("stream_id"), None)
        return [text(event)]


class SwapItemEvents(Mutant):
    """Sends a message's content_part.added before its output_item.added."""

    breaks = ("ws.event_order",)
    reason = "a content part outside a message item"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        held = conn.state.pop("held", None)
        if event["type"] == "response.output_item.added" and event["item"].get("type") == "message":
            conn.state["held"] = event
            return []
        if held is not None:
            held["sequence_number"], event["sequence_number"] = (
                event["sequence_number"],
                held["sequence_number"],
            )
            return [text(event), text(held)]
        return [text(event)]


class SequenceFromOne(Mutant):
    breaks = ("ws.sequence_numbers", "ws.sequential_creates", "ws.fifo_queue", "rollout.done_shape")
    reason = "has sequence_number 1, expected 0"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if isinstance(event.get("sequence_number"), int):
            event["sequence_number"] += 1
        return [text(event)]


class CorruptDeltas(Mutant):
    breaks = ("ws.text_consistency", "ws.function_call_consistency")
    reason = "the deltas concatenate to"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] in (
            "response.output_text.delta",
            "response.function_call_arguments.delta",
        ):
            key = f"{event['type']} {event['item_id']}"
            if key not in conn.state:
                conn.state[key] = True
                event["delta"] = " " + event["delta"]
        return [text(event)]


class DropArgumentsDone(Mutant):
    breaks = ("ws.function_call_events",)
    reason = "no function_call_arguments.done"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.function_call_arguments.done":
            conn.state["dropped"] = conn.state.get("dropped", 0) + 1
            return []
        if isinstance(event.get("sequence_number"), int):
            if event["type"] == "response.created":
                conn.state["dropped"] = 0
            event["sequence_number"] -= conn.state.get("dropped", 0)
        return [text(event)]


class ItemIdIsCallId(Mutant):
    breaks = ("ws.item_id_call_id",)
    reason = "the call_id; expected the item id"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        item = event.get("item") or {}
        if event["type"] == "response.output_item.added" and item.get("type") == "function_call":
            conn.state[item["id"]] = item["call_id"]
        if event["type"].startswith("response.function_call_arguments"):
            event["item_id"] = conn.state.get(event["item_id"], event["item_id"])
        return [text(event)]


class StripResponseFields(Mutant):
    breaks = ("ws.response_fields", "ws.usage")
    reason: ClassVar[Mapping[str, str]] = {
        "ws.response_fields": "response.object is null, expected 'response'",
        "ws.usage": "usage.input_tokens_details.cached_tokens is null",
    }

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        response = event.get("response")
        if isinstance(response, dict):
            response.pop("object", None)
            response.pop("created_at", None)
            if isinstance(response.get("usage"), dict):
                response["usage"].pop("input_tokens_details", None)
        return [text(event)]


class EchoTerminal(Mutant):
    breaks = ("ws.no_events_after_terminal",)
    reason = "expected no event after response.completed"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] in TERMINAL:
            return [text(event), text(event)]
        return [text(event)]


class DropCallsFromOutput(Mutant):
    breaks = ("ws.tool_call_completes",)
    reason = "output has calls [], expected the streamed calls"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.completed":
            output = event["response"]["output"]
            event["response"]["output"] = [i for i in output if i.get("type") != "function_call"]
        return [text(event)]


class ExtraContextOnContinuation(Mutant):
    """A continuation sees something its parent did not contain."""

    breaks = ("ws.continuation_equals_stateless", "ws.warmup_chain", "rollout.equals_chain")
    reason: ClassVar[Mapping[str, str]] = {
        "ws.continuation_equals_stateless": "the model is deterministic but the outputs differ",
        "ws.warmup_chain": "the model is deterministic but the outputs differ",
        # The chain, the check's reference, is what goes astray (AlterAppendedOutputs breaks
        # the rollout side).
        "rollout.equals_chain": "the chain kept calling tools",
    }

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event) and event.get("previous_response_id"):
            items = event.get("input")
            items = (
                [{"role": "user", "content": items}]
                if isinstance(items, str)
                else list(items or [])
            )
            event["input"] = [{"role": "user", "content": "(an extra message)"}, *items]
        return event


_ERROR_CHECKS = (
    "http.error_unknown_parameter",
    "http.error_model_not_found",
    "http.error_previous_response_not_found",
    "http.error_body_too_large",
    "auth.http_401",
    "ws.previous_response_not_found",
    "ws.store_false_after_reconnect",
    "ws.evicted_after_failure",
    "ws.queue_limit",
    "ws.message_too_large",
    "ws.connection_age_limit",
    "ws.error_unknown_parameter",
    "ws.error_missing_parameter",
    "ws.error_invalid_type",
    "ws.error_invalid_value",
    "ws.error_model_not_found",
    "ws.error_unknown_event",
    "ws.error_invalid_json",
    "rollout.http_rejected",
    "rollout.append_unknown_response",
    "rollout.append_completed",
    "rollout.append_not_suspended",
    "rollout.append_unknown_call_id",
    "rollout.append_answered_call_id",
)


class RenameErrorCodes(Mutant):
    """Every error code, over WebSocket and HTTP, is one the spec does not name."""

    breaks = _ERROR_CHECKS
    reason: ClassVar[Mapping[str, str]] = row_reasons(
        _ERROR_CHECKS,
        lambda row: f"error.code: expected {row.code!r}, observed '{row.code}_renamed'",
        auth__http_401="error.code 'invalid_api_key_renamed', expected 'invalid_api_key'",
        ws__evicted_after_failure="evicted: error.code: expected 'previous_response_not_found'",
        ws__queue_limit="error.code: expected 'too_many_queued_requests', observed",
        ws__connection_age_limit="error.code: expected 'websocket_connection_limit_reached'",
        rollout__append_not_suspended="error.code: expected 'rollout_not_suspended', observed",
    )

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "error" and isinstance(event.get("error"), dict):
            event["error"]["code"] = f"{event['error'].get('code')}_renamed"
        return [text(event)]

    def response_body(self, scope: Scope, status: int, body: bytes) -> bytes:
        def edit(value: Any) -> None:
            if isinstance(value, dict) and isinstance(value.get("error"), dict):
                value["error"]["code"] = f"{value['error'].get('code')}_renamed"

        return _json_rewrite(body, edit)


class FlatErrors(Mutant):
    """WebSocket errors in the flat SSE shape, without `status`."""

    breaks = (
        "ws.error_keeps_socket",
        "ws.previous_response_not_found",
        "ws.error_unknown_parameter",
    )
    # The flat error's `type` (invalid_request_error) replaces the event's `error`.
    reason: ClassVar[Mapping[str, str]] = row_reasons(
        breaks,
        lambda row: f"expected an error event with code {row.code!r}, observed invalid_request",
        ws__error_keeps_socket="answered with invalid_request_error, expected error",
    )

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "error" and isinstance(event.get("error"), dict):
            return [text({"type": "error", **event["error"]})]
        return [text(event)]


def _rewrite_store(value: Any, old: set[Any], new: bool) -> None:
    if isinstance(value, dict) and value.get("store") in old:
        value["store"] = new


class StoreEverything(Mutant):
    breaks = (
        "ws.store_false_after_reconnect",
        "ws.store_false_not_retrievable",
        "http.store_false",
    )
    reason: ClassVar[Mapping[str, str]] = {
        "http.store_false": "the response says store true, expected false",
        "ws.store_false_after_reconnect": "code 'previous_response_not_found', observed response",
        "ws.store_false_not_retrievable": "response.store is true, expected false",
    }

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        _rewrite_store(event, {False}, True)
        return event

    def request_body(self, scope: Scope, body: bytes) -> bytes:
        return _json_rewrite(body, lambda v: _rewrite_store(v, {False}, True))


class StoreNothing(Mutant):
    breaks = ("ws.store_hydration", "ws.store_default_retrievable", "http.retrieve", "http.delete")
    reason: ClassVar[Mapping[str, str]] = {
        "ws.store_hydration": "observed error 'previous_response_not_found'",
        "ws.store_default_retrievable": "response.store is false, expected true",
        "http.retrieve": "answered HTTP 404, expected 200",
        "http.delete": "DELETE answered HTTP 404, expected 200",
    }

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event):
            event["store"] = False
        return event

    def request_body(self, scope: Scope, body: bytes) -> bytes:
        def edit(value: Any) -> None:
            if isinstance(value, dict):
                value["store"] = False

        return _json_rewrite(body, edit) if scope["method"] == "POST" else body


class GatewayValidatesOutputs(Mutant):
    """Refuses tool outputs for unknown calls itself, so the engine never sees the failed
    continuation (and never evicts its parent)."""

    breaks = ("ws.evicted_after_failure",)
    reason = "its previous response must be evicted"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        item = event.get("item") or {}
        if event["type"] == "response.output_item.done" and item.get("type") == "function_call":
            conn.state.setdefault("calls", set()).add(item["call_id"])
        return [text(event)]

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        items = event.get("input") if _create(event) else None
        if isinstance(items, list):
            known = conn.state.get("calls", set())
            for i, item in enumerate(items):
                if item.get("type") == "function_call_output" and item.get("call_id") not in known:
                    await conn.emit([ws_error("invalid_value", f"input[{i}].call_id")])
                    return None
        return event


class RejectOverlap(Mutant):
    """Refuses a create while another response of the connection runs."""

    breaks = ("ws.fifo_queue", "ws.queue_limit")
    reason = "response_already_in_flight"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] in TERMINAL:
            conn.state["running"] = max(0, conn.state.get("running", 0) - 1)
        return [text(event)]

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event):
            if conn.state.get("running", 0):
                await conn.emit([ws_error("response_already_in_flight", None, 409)])
                return None
            conn.state["running"] = conn.state.get("running", 0) + 1
        return event


class NoAuth(Mutant):
    """Lets every request in, as if it had carried the key. Not a broken variant: a server
    that checks no key has no auth profile, and its auth checks are skipped."""

    def _with_key(self, scope: Scope) -> Scope:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"authorization"]
        headers.append((b"authorization", f"Bearer {API_KEY}".encode()))
        return {**scope, "headers": headers}

    def ws_scope(self, scope: Scope) -> Scope:
        return self._with_key(scope)

    def http_scope(self, scope: Scope) -> Scope:
        return self._with_key(scope)


class HttpCreateStripped(Mutant):
    breaks = ("http.create",)
    reason = "response.object is null, expected 'response'"

    def response_body(self, scope: Scope, status: int, body: bytes) -> bytes:
        def edit(value: Any) -> None:
            if isinstance(value, dict) and value.get("object") == "response":
                value.pop("object")
                value["status"] = "in_progress"

        return _json_rewrite(body, edit) if scope["method"] == "POST" else body


class SseEventNames(Mutant):
    breaks = ("http.sse",)
    reason = "the SSE `event:` field is 'message.created'"

    def sse_chunk(self, chunk: bytes) -> bytes:
        return chunk.replace(b"event: response.", b"event: message.", 1)


class DeleteKeeps(Mutant):
    """DELETE answers `deleted: true` without deleting."""

    breaks = ("http.delete",)
    reason = "GET after DELETE answered HTTP 200, expected 404"

    async def http_answer(self, scope: Scope) -> tuple[int, dict[str, Any]] | None:
        if scope["method"] == "DELETE":
            response_id = scope["path"].rstrip("/").rsplit("/", 1)[-1]
            return 200, {"id": response_id, "object": "response", "deleted": True}
        return None


class DoneAsCompleted(Mutant):
    """A suspended rollout says response.completed instead of response.done, on every
    connection but the first to open a rollout (so the rollout probe, which runs first, sees
    the extension: a server that does this from the start has no rollout profile,
    tests/test_conform_profiles.py)."""

    breaks = (
        "rollout.suspend",
        "rollout.done_shape",
        "rollout.resume",
        "rollout.partial_append",
        "rollout.suspend_timeout",
        "rollout.append_unknown_call_id",
        "rollout.append_answered_call_id",
    )
    reason: ClassVar[Mapping[str, str]] = {
        **dict.fromkeys(breaks, "ended with response.completed at its tool call"),
        "rollout.resume": "made a tool call but ended without response.done",
    }

    def __init__(self, app: RolloutApp) -> None:
        super().__init__(app)
        self.rollouts = 0

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event) and event.get("rollout") and "broken" not in conn.state:
            self.rollouts += 1
            conn.state["broken"] = self.rollouts > 1
        return event

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.done" and conn.state.get("broken"):
            event = {**event, "type": "response.completed"}
            event.pop("pending_call_ids", None)
            event["response"]["status"] = "completed"
        return [text(event)]


class EmptyPendingIds(Mutant):
    breaks = ("rollout.done_shape",)
    reason = "pending_call_ids [], expected a non-empty list"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.done":
            event["pending_call_ids"] = []
        return [text(event)]


class FullDone(Mutant):
    """`response.done` carries the response so far, every item streamed included (as before
    RX-2.2 changed): a suspension costs more bytes at each step."""

    breaks = ("rollout.done_shape", "rollout.suspension_size")
    reason: ClassVar[Mapping[str, str]] = {
        "rollout.done_shape": "response.done: the response carries its output (1 item)",
        "rollout.suspension_size": "grew with the rollout",
    }

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        _follow_response(conn, event)
        if event["type"] == "response.done":
            event["response"] = _response_so_far(conn)
            event.pop("output_indices", None)
        return [text(event)]


class FullResume(Mutant):
    """The resumed `response.in_progress` carries the response so far (as before RX-2.3
    changed)."""

    breaks = ("rollout.resume", "rollout.suspension_size")
    reason: ClassVar[Mapping[str, str]] = {
        "rollout.resume": "the resumed response.in_progress: the response carries its output",
        "rollout.suspension_size": "grew with the rollout",
    }

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        _follow_response(conn, event)
        if event["type"] == "response.in_progress" and "created_at" not in event["response"]:
            event["response"] = _response_so_far(conn)
        return [text(event)]


def _follow_response(conn: Conn, event: dict[str, Any]) -> None:
    """Keep the connection's response as `response.created` had it, and its items since."""
    if event["type"] == "response.created":
        conn.state["response"], conn.state["items"] = event["response"], []
    elif event["type"] == "response.output_item.done":
        conn.state["items"].append(event["item"])


def _response_so_far(conn: Conn) -> dict[str, Any]:
    return {**conn.state["response"], "output": list(conn.state["items"])}


class ShiftedOutputIndices(Mutant):
    """`response.done` names the output indices of the step one too high."""

    breaks = ("rollout.done_shape",)
    reason = "output_indices is [1], expected the output_index of each item streamed in the step"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.done":
            event["output_indices"] = [i + 1 for i in event["output_indices"]]
        return [text(event)]


class ResumeRestartsSequence(Mutant):
    """After response.done, the rollout numbers its events from 0 again."""

    breaks = ("rollout.resume", "rollout.suspend_timeout")
    reason = "has sequence_number 0, expected"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        seq = event.get("sequence_number")
        if event["type"] == "response.created":
            conn.state["offset"] = 0
        if isinstance(seq, int):
            event["sequence_number"] = seq - conn.state.get("offset", 0)
        if event["type"] == "response.done" and isinstance(seq, int):
            conn.state["offset"] = seq + 1
        return [text(event)]


class ResumeOnPartial(Mutant):
    """Announces a resume as soon as anything is appended."""

    breaks = ("rollout.partial_append",)
    reason = "expected no event after an append that leaves calls pending"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.done":
            conn.state["done"] = event
        return [text(event)]

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        done = conn.state.get("done")
        if event.get("type") == "response.append" and done is not None:
            outputs = [i for i in event.get("input", []) if i.get("type") == "function_call_output"]
            if not outputs:
                fake = {
                    "type": "response.in_progress",
                    "sequence_number": done["sequence_number"] + 1,
                    "response": done["response"],
                }
                await conn.emit([text(fake)])
        return event


class TimeoutReason(Mutant):
    breaks = ("rollout.suspend_timeout",)
    reason = "reason 'max_output_tokens'; expected 'incomplete', 'rollout_timeout'"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        details = (event.get("response") or {}).get("incomplete_details")
        if event["type"] == "response.incomplete" and isinstance(details, dict):
            details["reason"] = "max_output_tokens"
        return [text(event)]


def _edit_errors(body: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    def apply(value: Any) -> None:
        if isinstance(value, dict) and isinstance(value.get("error"), dict):
            edit(value["error"])

    return _json_rewrite(body, apply)


class AppendErrorsConfused(Mutant):
    """Mixes up the append errors: unknown and completed responses swap codes, an early
    append is called an invalid value."""

    breaks = (
        "rollout.append_unknown_response",
        "rollout.append_completed",
        "rollout.append_not_suspended",
    )
    SWAP: ClassVar[dict[str, str]] = {
        "rollout_not_found": "response_already_completed",
        "response_already_completed": "rollout_not_found",
        "rollout_not_suspended": "invalid_value",
    }
    reason: ClassVar[Mapping[str, str]] = row_reasons(
        breaks,
        lambda row: f"error.code: expected {row.code!r}",
        rollout__append_not_suspended="error.code: expected 'rollout_not_suspended'",
    )

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        error = event.get("error")
        if event["type"] == "error" and isinstance(error, dict):
            error["code"] = self.SWAP.get(str(error.get("code")), error.get("code"))
        return [text(event)]


class ErrorParamDropped(Mutant):
    """Errors never name the offending parameter."""

    breaks = (
        "http.error_unknown_parameter",
        "http.error_model_not_found",
        "http.error_previous_response_not_found",
        "rollout.http_rejected",
        "ws.previous_response_not_found",
        "ws.store_false_after_reconnect",
        "ws.evicted_after_failure",
        "ws.error_unknown_parameter",
        "ws.error_missing_parameter",
        "ws.error_invalid_type",
        "ws.error_invalid_value",
        "ws.error_model_not_found",
        "ws.error_unknown_event",
        "rollout.append_unknown_response",
        "rollout.append_completed",
        "rollout.append_unknown_call_id",
        "rollout.append_answered_call_id",
    )
    reason: ClassVar[Mapping[str, str]] = row_reasons(
        breaks,
        lambda row: f"error.param: expected {row.param!r}, observed null",
        ws__evicted_after_failure="evicted: error.param: expected 'previous_response_id'",
    )

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "error" and isinstance(event.get("error"), dict):
            event["error"]["param"] = None
        return [text(event)]

    def response_body(self, scope: Scope, status: int, body: bytes) -> bytes:
        return _edit_errors(body, lambda error: error.update(param=None))


class StatusFlattened(Mutant):
    """Every error says 400: no 404, 413, 429 or 401."""

    breaks = (
        "http.error_model_not_found",
        "http.error_body_too_large",
        "auth.http_401",
        "auth.ws_401",
        "ws.error_model_not_found",
        "ws.queue_limit",
    )
    reason: ClassVar[Mapping[str, str]] = row_reasons(
        breaks,
        lambda row: (
            f"answered HTTP 400, expected {row.status}"
            if row.transport == "http"
            else f"status: expected {row.status}, observed 400"
        ),
        auth__http_401="without a key answered HTTP 400, expected 401",
        auth__ws_401="the upgrade without a key was refused with HTTP 400, expected 401",
        ws__queue_limit="status: expected 429, observed 400",
    )

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "error" and isinstance(event.get("status"), int):
            event["status"] = 400
        return [text(event)]

    def http_status(self, status: int) -> int:
        return 400 if 400 <= status < 500 else status


class AlterAppendedOutputs(Mutant):
    """The tool outputs a rollout's appends carry reach the model altered (those a chain's
    continuations carry do not): the rollout is another conversation than the chain."""

    breaks = ("rollout.equals_chain",)
    reason = "the model is deterministic but the outputs differ"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if event.get("type") == "response.append":
            for item in event.get("input") or []:
                if isinstance(item, dict) and item.get("type") == "function_call_output":
                    item["output"] = f"{item.get('output')} (altered)"
        return event


class RolloutUsageOffByOne(Mutant):
    """A rollout's usage aggregated wrong: its terminal event counts one input token more than
    its sampling steps used (the chain's responses are left alone)."""

    breaks = ("rollout.equals_chain",)
    reason = "usage.input_tokens"

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event):
            conn.state["rollout"] = bool(event.get("rollout"))
        return event

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] in TERMINAL and conn.state.get("rollout"):
            usage = (event.get("response") or {}).get("usage")
            if isinstance(usage, dict):
                usage["input_tokens"] += 1
                usage["total_tokens"] += 1
        return [text(event)]


class DropResumedDeltas(Mutant):
    """After a rollout resumes, every second `response.output_text.delta` is dropped and the
    events after it renumbered (the numbering stays valid): the text a client assembles from a
    resumed step is not the text the server reports done."""

    breaks = ("rollout.resume",)
    reason = "the deltas concatenate to"
    EVERY = 2

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        state = conn.state
        if event["type"] == "response.created":
            state.update(resumed=False, deltas=0, dropped=0)
        elif event["type"] == "response.in_progress" and "created_at" not in event["response"]:
            state["resumed"] = True
        elif event["type"] == "response.output_text.delta" and state.get("resumed"):
            state["deltas"] += 1
            if state["deltas"] % self.EVERY == 0:
                state["dropped"] += 1
                return []
        if isinstance(event.get("sequence_number"), int):
            event["sequence_number"] -= state.get("dropped", 0)
        return [text(event)]


class ReorderResumedOutput(Mutant):
    """A rollout's terminal response lists the items of its last resumed step before those of
    the steps before it: the stream was in order, the output a client keeps is not."""

    breaks = ("rollout.resume", "rollout.equals_chain")
    reason: ClassVar[Mapping[str, str]] = {
        "rollout.resume": "expected every streamed item in the order streamed",
        "rollout.equals_chain": "the model is deterministic but the outputs differ: item 0",
    }

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        state = conn.state
        if event["type"] == "response.created":
            state.update(items=0, step_start=0)
        elif event["type"] == "response.output_item.done":
            state["items"] += 1
        elif event["type"] == "response.in_progress" and "created_at" not in event["response"]:
            state["step_start"] = state["items"]
        elif event["type"] in TERMINAL and state.get("step_start"):
            output = (event.get("response") or {}).get("output")
            if isinstance(output, list):
                start = state["step_start"]
                event["response"]["output"] = output[start:] + output[:start]
        return [text(event)]


class BufferEarlyAppends(Mutant):
    """Holds an append that arrives while the rollout samples and delivers it once the rollout
    has suspended, instead of refusing it."""

    breaks = ("rollout.append_not_suspended",)
    reason = "answered only after response.done"

    async def run_ws(self, conn: Conn) -> None:
        inject, app_receive = trio.open_memory_channel[Message](64)
        conn.state["inject"] = inject
        async with trio.open_nursery() as nursery:

            async def pump() -> None:
                while True:
                    message = await conn.receive()
                    await inject.send(message)
                    if message["type"] == "websocket.disconnect":
                        return

            nursery.start_soon(pump)
            await self.app(conn.scope, app_receive.receive, conn.send)
            nursery.cancel_scope.cancel()

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if event.get("type") == "response.append" and conn.state.get("sampling"):
            conn.state.setdefault("held", []).append(event)
            return None
        return event

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] in ("response.created", "response.in_progress"):
            conn.state["sampling"] = True
        elif event["type"] in TERMINAL or event["type"] == "response.done":
            conn.state["sampling"] = False
            for held in conn.state.pop("held", []) if event["type"] == "response.done" else []:
                message = {"type": "websocket.receive", "text": json.dumps(held)}
                conn.state["inject"].send_nowait(message)
        return [text(event)]


# --- schema variants: valid-looking streams whose objects break the Responses schema -----------


class ResponseEdit(Mutant):
    """Rewrites every Response object the server sends: WebSocket events, server-sent events
    and JSON bodies (`edit_response`), and every other event (`edit_event`)."""

    def edit_response(self, response: dict[str, Any]) -> None:
        pass

    def edit_event(self, event: dict[str, Any]) -> None:
        pass

    def _edit(self, value: Any) -> None:
        if not isinstance(value, dict):
            return
        if value.get("object") == "response":
            self.edit_response(value)
        elif isinstance(value.get("type"), str):
            if isinstance(value.get("response"), dict):
                self.edit_response(value["response"])
            self.edit_event(value)

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        self._edit(event)
        return [text(event)]

    def response_body(self, scope: Scope, status: int, body: bytes) -> bytes:
        return _json_rewrite(body, self._edit)

    def sse_chunk(self, chunk: bytes) -> bytes:
        # The app sends one whole `event:`/`data:` frame per body chunk.
        head, sep, data = chunk.partition(b"data: ")
        if not sep:
            return chunk
        return head + sep + _json_rewrite(data.strip(), self._edit) + b"\n\n"


ALL_SCHEMA_CHECKS = (
    "schema.http_response",
    "schema.sse_events",
    "schema.ws_events",
    "schema.retrieve",
    "schema.rollout_events",
)


class NullVerbosity(ResponseEdit):
    """`text.verbosity: null` (Open Responses: optional, never null)."""

    breaks = ALL_SCHEMA_CHECKS
    reason = "text.verbosity: null"

    def edit_response(self, response: dict[str, Any]) -> None:
        if isinstance(response.get("text"), dict):
            response["text"]["verbosity"] = None


class UnstrictTools(ResponseEdit):
    """Function tools echoed without `strict`."""

    breaks = ALL_SCHEMA_CHECKS
    reason = ".strict: required property is missing"

    def edit_response(self, response: dict[str, Any]) -> None:
        for tool in response.get("tools") or []:
            if isinstance(tool, dict) and tool.get("type") == "function":
                tool.pop("strict", None)


class CachedOverInput(ResponseEdit):
    """More cached input tokens than input tokens. (A rollout's responses carry no usage until
    it ends: `schema.rollout_events` is not broken.)"""

    breaks = ("schema.http_response", "schema.sse_events", "schema.ws_events", "schema.retrieve")
    reason = "cached_tokens"

    def edit_response(self, response: dict[str, Any]) -> None:
        usage = response.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("input_tokens_details"), dict):
            usage["input_tokens_details"]["cached_tokens"] = usage["input_tokens"] + 1


class NullWsErrorCode(ResponseEdit):
    """The nested WebSocket `error` without a code (Open Responses: a string)."""

    breaks = ("schema.ws_events",)
    reason = "error.code: null"

    def edit_event(self, event: dict[str, Any]) -> None:
        if event["type"] == "error" and isinstance(event.get("error"), dict):
            event["error"]["code"] = None


class PendingCallUnknown(ResponseEdit):
    """`response.done` names a call the step did not make."""

    breaks = ("rollout.done_shape",)
    reason = "pending_call_ids is ['call_mutant_unknown'], expected the turn's call ids"

    def edit_event(self, event: dict[str, Any]) -> None:
        if event["type"] == "response.done":
            event["pending_call_ids"] = ["call_mutant_unknown"]


class NegativeOutputIndex(ResponseEdit):
    """`response.done` names an output index below 0."""

    breaks = ("schema.rollout_events",)
    reason = "$.output_indices[0]"

    def edit_event(self, event: dict[str, Any]) -> None:
        if event["type"] == "response.done":
            event["output_indices"] = [-1]


class IgnoreMultiAgent(Mutant):
    """Drops `multi_agent` from every create: a multi-agent response completes at its tool
    call like a plain one (its inject is then too late), and the beta needs no header."""

    breaks = ("inject.resume", "inject.beta_required")
    reason: ClassVar[Mapping[str, str]] = {
        "inject.resume": "acknowledged with response.inject.created",
        "inject.beta_required": "it was not refused",
    }

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event):
            event.pop("multi_agent", None)
        return event


class InjectAcksUnnumbered(Mutant):
    """Acknowledges injects outside the response's sequence (sequence_number 0)."""

    breaks = ("inject.resume",)
    reason = "response.inject.created has sequence_number 0, expected"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.inject.created":
            event["sequence_number"] = 0
        return [text(event)]


class InjectFailuresConfused(Mutant):
    """Swaps the two inject failure codes."""

    breaks = ("inject.completed", "inject.unknown_response")
    reason = "response.inject.failed has error.code"
    SWAP: ClassVar[dict[str, str]] = {
        "response_already_completed": "response_not_found",
        "response_not_found": "response_already_completed",
    }

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.inject.failed":
            event["error"]["code"] = self.SWAP.get(event["error"]["code"], "mutant")
        return [text(event)]


class InjectInputLost(Mutant):
    """A failed inject does not return its input."""

    breaks = ("inject.completed", "inject.unknown_response")
    reason = "expected the uncommitted input unchanged"

    def server_event(self, conn: Conn, event: dict[str, Any]) -> list[Message]:
        if event["type"] == "response.inject.failed":
            event["input"] = []
        return [text(event)]


MUTANTS: tuple[type[Mutant], ...] = (
    RequireBetaHeader,
    RejectSdkHeaders,
    RejectQuery,
    BinaryFrames,
    IdleClose,
    CloseAfterTerminal,
    RejectStream,
    RejectNulls,
    RequireItemType,
    WarmupGenerates,
    ForgetParent,
    UnlabelledTerminal,
    DropDeltaLane,
    AcceptBadLanes,
    FewLanes,
    OverlapOnALane,
    SerialLanes,
    RefuseBeyondSixteen,
    LaneScopedParents,
    EvictOnAnyFailure,
    SwapItemEvents,
    SequenceFromOne,
    CorruptDeltas,
    DropArgumentsDone,
    ItemIdIsCallId,
    StripResponseFields,
    EchoTerminal,
    DropCallsFromOutput,
    ExtraContextOnContinuation,
    RenameErrorCodes,
    FlatErrors,
    StoreEverything,
    StoreNothing,
    GatewayValidatesOutputs,
    RejectOverlap,
    HttpCreateStripped,
    SseEventNames,
    DeleteKeeps,
    DoneAsCompleted,
    EmptyPendingIds,
    FullDone,
    FullResume,
    ShiftedOutputIndices,
    ResumeRestartsSequence,
    ResumeOnPartial,
    TimeoutReason,
    AppendErrorsConfused,
    ErrorParamDropped,
    StatusFlattened,
    AlterAppendedOutputs,
    RolloutUsageOffByOne,
    DropResumedDeltas,
    ReorderResumedOutput,
    BufferEarlyAppends,
    NullVerbosity,
    UnstrictTools,
    CachedOverInput,
    NullWsErrorCode,
    PendingCallUnknown,
    NegativeOutputIndex,
    SteerAcceptedWithoutId,
    SteerAcceptsAnything,
    SteerTargetsConfused,
    SteerPendingNamesNothing,
    IgnoreMultiAgent,
    InjectAcksUnnumbered,
    InjectFailuresConfused,
    InjectInputLost,
)
# Variants run at once (each with its own server and a harness run of its checks).
PARALLEL_VARIANTS = 4


def test_every_check_fails_against_some_variant() -> None:
    covered = {check for mutant in MUTANTS for check in mutant.breaks}
    all_checks = {case.id for case in spec.load_cases()}
    assert covered == all_checks, f"no variant breaks {sorted(all_checks - covered)}"
    for mutant in MUTANTS:
        assert mutant.breaks, f"{mutant.__name__} names no check"
        for check in mutant.breaks:
            assert mutant.expected_reason(check), f"{mutant.__name__}: no reason for {check}"
        if isinstance(mutant.reason, Mapping):
            assert set(mutant.reason) == set(mutant.breaks), mutant.__name__


async def test_identity_wrapper_passes() -> None:
    """The wrapping machinery alone breaks nothing (so a failure below is the mutation's)."""
    with trio.fail_after(60):
        async with serving(app_wrapper=Mutant) as url:
            report = await spec.run_conformance(url, harness_options())
    failed = not_passed(report.results)
    assert not failed, failed


@pytest.mark.no_schema_hook  # the variants are broken on purpose
async def test_each_variant_fails_the_checks_of_its_rule() -> None:
    wrong: dict[str, dict[str, str]] = {}
    limiter = trio.CapacityLimiter(PARALLEL_VARIANTS)

    async def run(mutant: type[Mutant]) -> None:
        async with limiter, serving(app_wrapper=mutant) as url:
            options = harness_options(filter=mutant.breaks, timeout=6.0, concurrency=3)
            report = await spec.run_conformance(url, options)
        for result in report.results:
            # Each check fails for the reason its mutant names, never by timing out or raising.
            # (While rollout's own output breaks the schema, ROLLOUT_SCHEMA_HOOK=warn, a schema
            # check may fail for that first: then only its failing is asserted.)
            expected = mutant.expected_reason(result.id) or ""
            if (
                result.outcome is not spec.Outcome.FAILED
                or result.reason.startswith(("timed out", "unexpected "))
                or (
                    expected not in result.reason
                    and not (result.id.startswith("schema.") and schema_failures_tolerated())
                )
            ):
                wrong.setdefault(mutant.__name__, {})[result.id] = (
                    f"{result.outcome.value}: {result.reason}"
                )

    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            for mutant in MUTANTS:
                nursery.start_soon(run, mutant)
    assert not wrong, json.dumps(wrong, indent=1)


class WithoutRolloutExtension(Mutant):
    """A server without the extension: it rejects the `rollout` parameter like any unknown one.
    Not a broken variant: its rollout checks must be skipped, never passed or failed."""

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event) and "rollout" in event:
            await conn.emit([ws_error("unknown_parameter", "rollout")])
            return None
        return event


async def test_rollout_checks_are_skipped_when_the_server_rejects_the_parameter() -> None:
    with trio.fail_after(60):
        async with serving(app_wrapper=WithoutRolloutExtension) as url:
            report = await spec.run_conformance(url, harness_options(filter=("rollout",)))
            required = await spec.run_conformance(
                url, harness_options(filter=("rollout.resume",), require=("rollout",))
            )
    assert report.features["rollout"] is False
    assert len(report.results) >= 10
    for result in report.results:
        assert result.outcome is spec.Outcome.SKIPPED, (result.id, result.reason)
        assert "rejected `rollout: true` (unknown_parameter" in result.reason
    assert report.ok
    # With --require rollout, the skipped extension fails the run (exit 5: the core passes).
    assert not required.ok and required.exit_code == 5


class WithoutLanes(Mutant):
    """A server without lanes: it refuses `stream_id` with `unsupported_parameter`, as WS-2.8
    allows. Not a broken variant: its lanes checks must be skipped, never passed or failed."""

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event) and event.get("stream_id") is not None:
            await conn.emit([ws_error("unsupported_parameter", "stream_id")])
            return None
        return event


async def test_lanes_checks_are_skipped_when_the_server_refuses_stream_id() -> None:
    with trio.fail_after(60):
        async with serving(app_wrapper=WithoutLanes) as url:
            report = await spec.run_conformance(
                url, harness_options(filter=("lanes", "ws.stream_id"))
            )
            required = await spec.run_conformance(
                url, harness_options(filter=("lanes.echo",), require=("lanes",))
            )
    assert report.features["lanes"] is False
    # ws.stream_id is a lanes check: a refusal is allowed (WS-2.8), and skips it too.
    lanes = [r for r in report.results if r.feature == "lanes"]
    assert len(lanes) >= 9 and "ws.stream_id" in {r.id for r in lanes}
    for result in lanes:
        assert result.outcome is spec.Outcome.SKIPPED, (result.id, result.reason)
        assert "refuses `stream_id` (unsupported_parameter" in result.reason
    assert report.ok
    assert not required.ok and required.exit_code == 5


async def test_auth_checks_are_skipped_when_the_server_checks_no_key() -> None:
    with trio.fail_after(60):
        async with serving(app_wrapper=NoAuth) as url:
            report = await spec.run_conformance(url, harness_options(filter=("auth",)))
            required = await spec.run_conformance(
                url, harness_options(filter=("auth",), require=("auth",))
            )
    assert report.features["auth"] is False
    assert len(report.results) == 2
    for result in report.results:
        assert result.outcome is spec.Outcome.SKIPPED, (result.id, result.reason)
        assert "answered HTTP 200: the server does not check API keys" in result.reason
    assert report.ok
    assert not required.ok and required.exit_code == 5


class WithoutSteering(Mutant):
    """A server without steering: `response.steer` is an unknown client event to it. Not a
    broken variant: its steering checks must be skipped, never passed or failed."""

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _steer(event):
            await conn.emit([ws_error("invalid_value", "type")])
            return None
        return event


async def test_steer_checks_are_skipped_when_the_server_lacks_steering() -> None:
    with trio.fail_after(60):
        async with serving(app_wrapper=WithoutSteering) as url:
            report = await spec.run_conformance(url, harness_options(filter=("steer",)))
    assert report.features["steer"] is False
    assert len(report.results) == 4
    for result in report.results:
        assert result.outcome is spec.Outcome.SKIPPED, (result.id, result.reason)
        assert "steering is not supported" in result.reason
    assert report.ok


class WithoutMultiAgent(Mutant):
    """A server without the multi-agent beta: it rejects `multi_agent` like an unknown
    parameter, and `response.inject` like an unknown event type. Not a broken variant: its
    injection checks must be skipped, never passed."""

    async def client_event(self, conn: Conn, event: dict[str, Any]) -> dict[str, Any] | None:
        if _create(event) and "multi_agent" in event:
            await conn.emit([ws_error("unknown_parameter", "multi_agent")])
            return None
        if event.get("type") == "response.inject":
            await conn.emit([ws_error("invalid_value", "type")])
            return None
        return event


async def test_inject_checks_are_skipped_when_the_server_lacks_the_beta() -> None:
    with trio.fail_after(60):
        async with serving(app_wrapper=WithoutMultiAgent) as url:
            report = await spec.run_conformance(url, harness_options(filter=("multi_agent",)))
    assert report.features["multi_agent"] is False
    assert len(report.results) == 4
    for result in report.results:
        assert result.outcome is spec.Outcome.SKIPPED, (result.id, result.reason)
        assert "the multi-agent beta (response.inject) is not supported" in result.reason
    assert report.ok
