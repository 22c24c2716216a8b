"""rollout's WebSocket-mode client over trio-websocket (the one the conformance checks, the
benchmark and the test suite drive), and HTTP and server-sent events over httpx.

Long because the one client serves three users (conformance checks, the benchmark, the tests)
over both transports, and reports every failure in words a check can print.

`WsClient` is a thin wrapper around `rollout.protocol.ClientConnection`: every event received
is followed by the connection (which response runs, whether a rollout is suspended and on
which calls, whether the server still owes events), and the server's order violations are
recorded in `violations`, or raised (`strict=True`) as `RemoteProtocolError`. The
conformance checks read the violations through their own rules and stay lenient; the
benchmark and the tests are strict. Server-sent events are read with the protocol's
`SseDecoder`.

It is deliberately lenient about what it receives (a check decides what is wrong) and strict
about time: every network operation takes a deadline, and a failure to connect, a refused
upgrade, a closed socket or a frame that is not JSON becomes a `CheckFailed` whose message says
what was observed. Frames are decoded as plain JSON dicts, not as rollout's wire types, so a
server that adds fields or event types can still be checked.
"""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio
import trio_websocket
from rollout.protocol import (
    TERMINAL_EVENT_TYPES,
    ClientConnection,
    ClientEvent,
    Phase,
    RemoteProtocolError,
    SseDecoder,
)

__all__ = [
    "RECEIVE_LIMIT",
    "TERMINAL",
    "CheckFailed",
    "CheckSkipped",
    "HttpResult",
    "SseEvent",
    "UpgradeRefused",
    "WsClient",
    "describe_value",
    "http_request",
    "http_sse",
    "open_ws",
    "ws_url_of",
]

# Events that end a request on the wire: the three terminal response events and `error`.
TERMINAL = TERMINAL_EVENT_TYPES
# The largest server message the client accepts, in bytes. Official clients accept any size
# (`max_size=None`); a bound still keeps a runaway server from exhausting the harness.
RECEIVE_LIMIT = 256 * 1024 * 1024
# Frames buffered by trio-websocket before the reader takes them.
_MESSAGE_QUEUE = 1024
# The data of the chat-completions stream's last event, which the official SDK reads as the
# end of any stream.
SSE_DONE = "[DONE]"
# The longest excerpt of a peer's bytes quoted in a failure message.
_QUOTE = 160
# How often a waiting ping looks whether the connection closed meanwhile, in seconds.
_CLOSE_POLL = 0.02


class CheckFailed(Exception):
    """A check observed something its rule forbids; the message says observed vs expected."""


class UpgradeRefused(CheckFailed):
    """The server answered the WebSocket upgrade with an HTTP status instead of 101."""

    def __init__(self, message: str, status: int, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class CheckSkipped(Exception):
    """A check could not be run meaningfully (an option is missing, a feature is absent)."""


def describe_value(value: Any) -> str:
    """A short quotation of a value for failure messages."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        text = repr(value)
    return text if len(text) <= _QUOTE else text[:_QUOTE] + "..."


def ws_url_of(base_url: str, query: Mapping[str, str] | None = None) -> str:
    """The WebSocket endpoint for an HTTP base URL, as the official SDK builds it: scheme
    http->ws (anything else->wss), trailing `/` stripped, `/responses` appended, the base URL's
    query kept (plus `query`)."""
    parts = urllib.parse.urlsplit(base_url)
    scheme = "ws" if parts.scheme in ("http", "ws") else "wss"
    path = parts.path.rstrip("/") + "/responses"
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    pairs.extend((query or {}).items())
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, urllib.parse.urlencode(pairs), ""))


@attrs.define
class WsClient:
    """One WebSocket connection. `text_frames` / `binary_frames` count what was received;
    `connection` follows the protocol (see the module docstring)."""

    conn: Any  # trio_websocket.WebSocketConnection
    timeout: float
    text_frames: int = 0
    binary_frames: int = 0
    log: list[dict[str, Any]] = attrs.field(factory=list)
    strict: bool = False
    connection: ClientConnection = attrs.field(factory=ClientConnection)
    violations: list[str] = attrs.field(factory=list)
    # Called with every `error` event received (the conformance checks note the answers).
    on_error: Callable[[dict[str, Any]], None] | None = None

    # --- the protocol ---
    def encode(self, event: ClientEvent | Mapping[str, Any] | str | bytes) -> str | bytes:
        """A typed event is checked by the connection (`LocalProtocolError` on misuse); a
        JSON object, text or bytes are sent as they are (a check may send something invalid
        on purpose) and only noted."""
        if not isinstance(event, (str, bytes, Mapping)):
            return self.connection.send(event)
        if self.connection.phase is not Phase.ERROR:
            self.connection.sent_raw(event)
        if isinstance(event, (str, bytes)):
            return event
        return json.dumps(event, separators=(",", ":"))

    def follow(self, event: Mapping[str, Any]) -> None:
        """Follow a received event (parsed JSON). A violation of the order rules is recorded
        (and raised when strict); the connection is not followed further after one."""
        if self.connection.phase is Phase.ERROR:
            return
        try:
            self.connection.receive_json(event)
        except RemoteProtocolError as exc:
            self.violations.append(str(exc))
            if self.strict:
                raise

    async def next_event(self) -> dict[str, Any]:
        """The next message parsed as JSON and followed, with no deadline of its own and the
        transport's exceptions as they are: the cheap path (one `json.loads`)."""
        message = await self.conn.get_message()
        event: dict[str, Any] = json.loads(message)
        self.follow(event)
        return event

    @property
    def awaiting(self) -> bool:
        """Whether the server still owes events (see `ClientConnection.awaiting`)."""
        return self.connection.awaiting

    # --- sending ---
    async def send(self, event: ClientEvent | Mapping[str, Any] | str) -> None:
        text = self.encode(event)
        try:
            with trio.fail_after(self.timeout):
                await self.conn.send_message(text)
        except trio_websocket.ConnectionClosed as exc:
            raise CheckFailed(f"the server closed the WebSocket ({_close_reason(exc)})") from None
        except trio.TooSlowError:
            raise CheckFailed(f"sending a message took longer than {self.timeout:g}s") from None

    # --- receiving ---
    async def recv_raw(self, limit: float | None = None) -> str | bytes:
        """The next message as sent (text -> str, binary -> bytes)."""
        limit = self.timeout if limit is None else limit
        try:
            with trio.fail_after(limit):
                message: str | bytes = await self.conn.get_message()
        except trio_websocket.ConnectionClosed as exc:
            raise CheckFailed(
                f"the server closed the WebSocket ({_close_reason(exc)}) while an event was "
                "expected"
            ) from None
        except trio.TooSlowError:
            raise CheckFailed(f"no event arrived within {limit:g}s") from None
        if isinstance(message, bytes):
            self.binary_frames += 1
        else:
            self.text_frames += 1
        return message

    async def recv(self, limit: float | None = None) -> dict[str, Any]:
        """The next event, decoded: one JSON object with a string `type`."""
        raw = await self.recv_raw(limit)
        event = decode_event(raw)
        self.log.append(event)
        self.follow(event)
        if event["type"] == "error" and self.on_error is not None:
            self.on_error(event)
        return event

    async def poll(self, seconds: float) -> dict[str, Any] | None:
        """The next event if one arrives within `seconds`, else None."""
        with trio.move_on_after(seconds):
            return await self.recv(seconds + 1)
        return None

    async def collect(
        self, *, until: Iterable[str] = TERMINAL, limit: float | None = None
    ) -> list[dict[str, Any]]:
        """Events up to and including the first whose type is in `until`."""
        stop = frozenset(until)
        events: list[dict[str, Any]] = []
        while True:
            event = await self.recv(limit)
            events.append(event)
            if event["type"] in stop:
                return events

    async def create(
        self, body: Mapping[str, Any], *, until: Iterable[str] = TERMINAL
    ) -> list[dict[str, Any]]:
        """Send a `response.create` and collect its events up to a terminal one."""
        await self.send({"type": "response.create", **body})
        return await self.collect(until=until)

    async def expect_quiet(self, seconds: float, what: str) -> None:
        """Nothing arrives for `seconds` (a frame or a close fails the check)."""
        with trio.move_on_after(seconds):
            try:
                message = await self.conn.get_message()
            except trio_websocket.ConnectionClosed as exc:
                raise CheckFailed(
                    f"the server closed the WebSocket ({_close_reason(exc)}) {what}"
                ) from None
            raise CheckFailed(f"expected no event {what}, observed {describe_value(message)}")

    async def ping(self) -> None:
        """A ping answered by a pong within the timeout. (trio-websocket leaves a ping in
        flight waiting when the connection closes, so the close is watched for as well.)"""
        answered = False
        async with trio.open_nursery() as nursery:

            async def send_ping() -> None:
                nonlocal answered
                with contextlib.suppress(trio_websocket.ConnectionClosed):
                    await self.conn.ping()
                    answered = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(send_ping)
            with trio.move_on_after(self.timeout):
                # trio-websocket has no close event to wait on: poll its close reason.
                while self.conn.closed is None:  # noqa: ASYNC110
                    await trio.sleep(_CLOSE_POLL)
            nursery.cancel_scope.cancel()
        if answered:
            return
        reason = self.conn.closed
        if reason is not None:
            raise CheckFailed(
                f"the WebSocket is closed ({_reason_text(reason)}); expected it to stay open"
            )
        raise CheckFailed(f"no pong within {self.timeout:g}s of a ping")

    async def wait_closed(self, seconds: float) -> int | None:
        """The close code if the server closes within `seconds`, else None."""
        with trio.move_on_after(seconds):
            try:
                while True:
                    await self.conn.get_message()
            except trio_websocket.ConnectionClosed as exc:
                reason = exc.reason
                return int(reason.code) if reason is not None else None
        return None


def decode_event(raw: str | bytes) -> dict[str, Any]:
    """One server message as a JSON object with a string `type`, or `CheckFailed`."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckFailed(
            f"a server message is not one JSON value ({exc}): {describe_value(raw)}"
        ) from None
    if not isinstance(value, dict):
        raise CheckFailed(f"a server message is not a JSON object: {describe_value(value)}")
    if not isinstance(value.get("type"), str):
        raise CheckFailed(f"a server message has no string `type`: {describe_value(value)}")
    return value


def _close_reason(exc: trio_websocket.ConnectionClosed) -> str:
    return _reason_text(exc.reason)


def _reason_text(reason: Any) -> str:
    if reason is None:
        return "no close frame"
    text = f"close code {reason.code}"
    if reason.reason:
        text += f", reason {reason.reason!r}"
    return text


@asynccontextmanager
async def open_ws(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    limit: float,
    on_error: Callable[[dict[str, Any]], None] | None = None,
) -> AsyncIterator[WsClient]:
    """Connect (the upgrade must succeed within `limit`) and yield a client; the socket is
    closed on exit without waiting long for the server's close frame."""
    extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    connected = False
    try:
        async with trio_websocket.open_websocket_url(
            url,
            extra_headers=extra,
            message_queue_size=_MESSAGE_QUEUE,
            max_message_size=RECEIVE_LIMIT,
            connect_timeout=limit,
            disconnect_timeout=min(1.0, limit),
        ) as conn:
            connected = True
            yield WsClient(conn=conn, timeout=limit, on_error=on_error)
    except trio_websocket.ConnectionRejected as exc:
        body = (exc.body or b"").decode("utf-8", "replace")
        raise UpgradeRefused(
            f"the WebSocket upgrade was refused with HTTP {exc.status_code} "
            f"(expected 101 Switching Protocols): {describe_value(body)}",
            exc.status_code,
            body,
        ) from None
    except trio_websocket.DisconnectionTimeout:
        if not connected:
            raise
        # The server did not answer our close frame in time: not the check's concern.
    except trio_websocket.HandshakeError as exc:
        if connected:
            raise
        if isinstance(exc, trio_websocket.ConnectionTimeout):
            raise CheckFailed(f"the WebSocket upgrade did not complete within {limit:g}s") from None
        cause = exc.__cause__ or exc.__context__ or exc
        raise CheckFailed(f"cannot open a WebSocket to {url}: {_describe_exc(cause)}") from None
    except OSError as exc:
        if connected:
            raise
        raise CheckFailed(f"cannot connect to {url}: {_describe_exc(exc)}") from None


def _describe_exc(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if str(exc) else text


# --- HTTP ------------------------------------------------------------------------------------


@attrs.frozen
class HttpResult:
    status: int
    headers: Mapping[str, str]
    body: Any  # parsed JSON, or the text when it is not JSON
    text: str

    def error(self) -> dict[str, Any]:
        """The `error` object of an error body, or `CheckFailed`."""
        if not isinstance(self.body, dict) or not isinstance(self.body.get("error"), dict):
            raise CheckFailed(
                f'HTTP {self.status}: expected an error body {{"error": {{...}}}}, observed '
                f"{describe_value(self.text)}"
            )
        error: dict[str, Any] = self.body["error"]
        return error


@attrs.frozen
class SseEvent:
    name: str | None  # the `event:` field
    data: dict[str, Any]


async def http_request(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    limit: float,
    json_body: Any = None,
    content: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> HttpResult:
    try:
        with trio.fail_after(limit):
            response = await client.request(
                method, url, json=json_body, content=content, headers=dict(headers or {})
            )
    except trio.TooSlowError:
        raise CheckFailed(f"{method} {url} got no answer within {limit:g}s") from None
    except httpx.HTTPError as exc:
        raise CheckFailed(f"{method} {url} failed: {_describe_exc(exc)}") from None
    text = response.text
    try:
        body: Any = response.json()
    except ValueError:
        body = text
    return HttpResult(status=response.status_code, headers=response.headers, body=body, text=text)


async def http_sse(
    client: httpx.AsyncClient,
    url: str,
    body: Mapping[str, Any],
    *,
    limit: float,
    headers: Mapping[str, str] | None = None,
) -> tuple[HttpResult, list[SseEvent]]:
    """POST with `stream: true`; the status and headers, and the parsed events (for a
    non-2xx answer the events are empty and the body is parsed as JSON)."""
    events: list[SseEvent] = []
    try:
        with trio.fail_after(limit):
            async with client.stream(
                "POST", url, json=dict(body), headers=dict(headers or {})
            ) as r:
                if r.status_code // 100 != 2:
                    raw = (await r.aread()).decode("utf-8", "replace")
                    try:
                        parsed: Any = json.loads(raw)
                    except ValueError:
                        parsed = raw
                    return HttpResult(r.status_code, r.headers, parsed, raw), events
                decoder = SseDecoder(max_event_size=RECEIVE_LIMIT)
                async for chunk in r.aiter_bytes():
                    for sse in decoder.feed(chunk):
                        if sse.data.startswith(SSE_DONE) and events:
                            # The chat-completions end marker: the official SDK stops reading
                            # here (HTTP-1.2 allows it after the terminal event, which the
                            # checks look for).
                            return HttpResult(r.status_code, r.headers, None, ""), events
                        events.append(SseEvent(sse.event, _sse_data(sse.data)))
                return HttpResult(r.status_code, r.headers, None, ""), events
    except trio.TooSlowError:
        raise CheckFailed(f"the event stream of POST {url} did not end within {limit:g}s") from None
    except httpx.HTTPError as exc:
        raise CheckFailed(f"POST {url} (stream) failed: {_describe_exc(exc)}") from None
    except RemoteProtocolError as exc:
        raise CheckFailed(f"the event stream of POST {url}: {exc}") from None


def _sse_data(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise CheckFailed(f"an SSE `data:` field is not JSON: {describe_value(text)}") from None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise CheckFailed(f"an SSE event is not an object with a `type`: {describe_value(value)}")
    return value
