"""The benchmark's WebSocket client connection: wsproto driven from the task that reads it,
offering permessage-deflate as the openai SDK and Codex do, and counting the bytes on the wire.

**Why its own connection.** The client shares the machine with the server it measures, so
what it spends per received event is taken from the server: a client that costs half a core
at 32 concurrent rollouts makes the concurrency sweep under-report the server. trio-websocket
reads in a task of its own and hands each message to the consumer over a memory channel: two
task switches per message, when one read from the socket under load holds several. Here the
consumer's own read (`WsSocket.read`) feeds one `receive_some` to wsproto and queues every
complete message it produced (`WsSocket.messages`): one checkpoint per read, not per message,
and no task besides the consumer's. wsproto does all the framing (and the compression); this
module only moves bytes between it and the stream.

**permessage-deflate.** The openai SDK's WebSocket client (`websockets`) and Codex offer
permessage-deflate (RFC 7692) on every connection, so what a server does with the offer is
part of what a client sees: the benchmark offers it too, and the server decides (`rollout serve
--websocket-deflate` or `--no-websocket-deflate`). `WsSocket.deflate` says whether it was
negotiated; `tests/test_websocket_deflate.py` checks the offer is made and, where the server
accepts it, negotiated.

**Errors.** `HandshakeError` when the connection cannot be opened (its cause the `OSError` of
a refused connection), with `ConnectionTimeout` (the upgrade took longer than allowed) and
`ConnectionRejected` (the server answered the upgrade with an HTTP status); `ConnectionClosed`
once the connection is closed, by the server, by a transport failure (code 1006), or by this
client on a server message it cannot take (code 1002 for a frame wsproto refuses, 1009 for a
message over the size limit). Messages that arrived before a close are delivered first.

One task at a time reads; sends (the consumer's, and the pongs and close replies of a read)
must not overlap either: the benchmark's turns send, then read until the turn is over.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import attrs
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason as Code
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

__all__ = [
    "REJECT_BODY_LIMIT",
    "CloseReason",
    "ConnectionClosed",
    "ConnectionRejected",
    "ConnectionTimeout",
    "HandshakeError",
    "WireCounts",
    "WsSocket",
    "open_bench_ws",
]

# The most bytes of a refused upgrade's HTTP body kept for the error (the rest is not read).
REJECT_BODY_LIMIT = 64 * 1024


class HandshakeError(Exception):
    """The WebSocket could not be opened (the cause, when there is one, says why)."""


class ConnectionTimeout(HandshakeError):
    """The connection and its upgrade did not complete in time."""


class ConnectionRejected(HandshakeError):
    """The server answered the upgrade with an HTTP status instead of 101."""

    def __init__(self, status_code: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        super().__init__(f"the upgrade was refused with HTTP {status_code}")
        self.status_code = status_code
        self.headers = headers
        self.body = body


@attrs.frozen
class CloseReason:
    """Why the connection closed: the close code and reason (as received, or as sent)."""

    code: int
    reason: str | None = None

    def __str__(self) -> str:
        text = f"close code {self.code}"
        return f"{text}, reason {self.reason!r}" if self.reason else text


class ConnectionClosed(Exception):
    """The connection is closed; `reason` says how."""

    def __init__(self, reason: CloseReason) -> None:
        super().__init__(str(reason))
        self.reason = reason


@attrs.define
class WireCounts:
    """Bytes so far: on the wire (after compression, with frame headers) and of the messages'
    payloads (UTF-8, as the application sent or received them)."""

    wire_in: int = 0
    wire_out: int = 0
    payload_in: int = 0
    payload_out: int = 0

    def snapshot(self) -> WireCounts:
        return attrs.evolve(self)

    def since(self, before: WireCounts) -> WireCounts:
        return WireCounts(
            wire_in=self.wire_in - before.wire_in,
            wire_out=self.wire_out - before.wire_out,
            payload_in=self.payload_in - before.payload_in,
            payload_out=self.payload_out - before.payload_out,
        )


def _utf8_size(text: str) -> int:
    # An ASCII str (what JSON events mostly are) is as long in UTF-8: no encoding needed.
    return len(text) if text.isascii() else len(text.encode())


class WsSocket:
    """An open connection: `read` and `messages`, `get_message` and `send_message`, the byte
    counts, and what was negotiated."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        protocol: WSConnection,
        counts: WireCounts,
        *,
        deflate: bool,
        max_message_size: int,
        receive_buffer_size: int,
    ) -> None:
        self.stream = stream
        self.protocol = protocol
        self.counts = counts
        self.deflate = deflate  # whether permessage-deflate was negotiated
        self.max_message_size = max_message_size
        self.receive_buffer_size = receive_buffer_size
        # Complete messages received and not yet taken, oldest first (text -> str, binary ->
        # bytes). At most what one read delivered (a read is made when it is empty).
        self.messages: deque[str | bytes] = deque()
        self.closed: CloseReason | None = None
        self._parts: list[str | bytes] = []  # a fragmented message so far
        self._size = 0  # its payload bytes so far

    async def send_message(self, message: str | bytes) -> None:
        """Send one text (str) or binary (bytes) message."""
        await self.send_frame(self.frame(message))

    def frame(self, message: str | bytes) -> bytes:
        """The wire bytes of one text (str) or binary (bytes) message, framed and masked,
        for `send_frame` (a caller timing the send leaves the framing out)."""
        if self.closed is not None:
            raise ConnectionClosed(self.closed)
        if isinstance(message, str):
            self.counts.payload_out += _utf8_size(message)
            return self.protocol.send(TextMessage(data=message))
        self.counts.payload_out += len(message)
        return self.protocol.send(BytesMessage(data=message))

    async def send_frame(self, data: bytes) -> None:
        """Send what `frame` made."""
        if self.closed is not None:
            raise ConnectionClosed(self.closed)
        await self._send(data)

    async def get_message(self) -> str | bytes:
        """The next message, reading when none is queued."""
        while not self.messages:
            await self.read()
        return self.messages.popleft()

    async def read(self) -> None:
        """One read from the stream, fed to wsproto: the messages it completed join
        `messages` (maybe none: a frame can span reads), pings are answered, a close is
        answered and raised as `ConnectionClosed` once no message is queued (and on a read
        after it)."""
        if self.closed is not None:
            raise ConnectionClosed(self.closed)
        try:
            data = await self.stream.receive_some(self.receive_buffer_size)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            data = b""
        self.counts.wire_in += len(data)
        self.protocol.receive_data(bytes(data) if data else None)  # None: the stream ended
        await self._handle(self.protocol.events())
        if not self.messages:
            self._raise_if_closed()

    def _raise_if_closed(self) -> None:
        if self.closed is not None:
            raise ConnectionClosed(self.closed)

    async def _handle(self, events: Iterator[Event]) -> None:
        for event in events:
            if isinstance(event, (TextMessage, BytesMessage)):
                if not self._received(event.data, event.message_finished):
                    size = f"{self._size:,}"
                    self._parts, self._size = [], 0
                    await self._close(Code.MESSAGE_TOO_BIG, f"a message of {size} bytes or more")
                    return
            elif isinstance(event, Ping):
                await self._send(self.protocol.send(event.response()))
            elif isinstance(event, CloseConnection):
                await self._close(event.code, event.reason)

    def _received(self, data: str | bytes | bytearray, finished: bool) -> bool:
        """Count and queue a message (or its part); False when it grows over the limit."""
        size = _utf8_size(data) if isinstance(data, str) else len(data)
        self.counts.payload_in += size
        if finished and not self._parts and size <= self.max_message_size:
            self.messages.append(data if isinstance(data, str) else bytes(data))  # in one piece
            return True
        self._size += size
        if self._size > self.max_message_size:
            return False
        self._parts.append(data if isinstance(data, str) else bytes(data))
        if finished:
            parts, self._parts, self._size = self._parts, [], 0
            if isinstance(parts[0], str):
                self.messages.append("".join(p for p in parts if isinstance(p, str)))
            else:
                self.messages.append(b"".join(p for p in parts if isinstance(p, bytes)))
        return True

    async def _close(self, code: int, reason: str | None) -> None:
        """A close received (or a frame wsproto refused, as the close it answers with): reply
        if the connection still owes one, and note it closed."""
        if self.protocol.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            try:
                await self._send(self.protocol.send(CloseConnection(code=code, reason=reason)))
            except ConnectionClosed:
                pass
        if self.closed is None:
            self.closed = CloseReason(code, reason)

    async def _send(self, data: bytes) -> None:
        self.counts.wire_out += len(data)
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.closed = self.closed or CloseReason(Code.ABNORMAL_CLOSURE)
            raise ConnectionClosed(self.closed) from None

    async def aclose(self) -> None:
        """Close: send a close frame unless one was exchanged, wait for the server's (the
        caller bounds the wait), then close the stream."""
        try:
            if self.protocol.state is ConnectionState.OPEN:
                await self._send(self.protocol.send(CloseConnection(code=Code.NORMAL_CLOSURE)))
                self.closed = self.closed or CloseReason(Code.NORMAL_CLOSURE)
            while self.protocol.state is ConnectionState.LOCAL_CLOSING:
                data = await self.stream.receive_some(self.receive_buffer_size)
                self.counts.wire_in += len(data)
                self.protocol.receive_data(bytes(data) if data else None)
                for _ in self.protocol.events():
                    pass  # what the server sent before it read our close is dropped
        except (ConnectionClosed, LocalProtocolError, trio.BrokenResourceError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(self.stream)


@asynccontextmanager
async def open_bench_ws(
    url: str,
    *,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
    offer_deflate: bool = True,
    max_message_size: int,
    receive_buffer_size: int,
    connect_timeout: float = 60.0,
    disconnect_timeout: float = 5.0,
) -> AsyncIterator[WsSocket]:
    """Connect to a `ws://` or `wss://` URL (the connection and upgrade must complete within
    `connect_timeout`), yield the socket, close it (waiting at most `disconnect_timeout` for
    the server's close frame). A message over `max_message_size` payload bytes closes the
    connection (code 1009)."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a WebSocket URL: {url!r}")
    secure = parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    host = parts.hostname if port in (80, 443) else f"{parts.hostname}:{port}"
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    counts = WireCounts()
    try:
        with trio.fail_after(connect_timeout):
            stream: trio.abc.Stream
            if secure:
                stream = await trio.open_ssl_over_tcp_stream(
                    parts.hostname,
                    port,
                    ssl_context=ssl.create_default_context(),
                    https_compatible=True,
                )
            else:
                stream = await trio.open_tcp_stream(parts.hostname, port)
            try:
                ws = await _handshake(
                    stream,
                    counts,
                    Request(
                        host=host,
                        target=resource,
                        extensions=[PerMessageDeflate()] if offer_deflate else [],
                        extra_headers=list(extra_headers),
                    ),
                    max_message_size=max_message_size,
                    receive_buffer_size=receive_buffer_size,
                )
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
    except trio.TooSlowError:
        raise ConnectionTimeout from None
    except (OSError, trio.BrokenResourceError) as exc:
        raise HandshakeError from exc
    try:
        yield ws
    finally:
        with trio.move_on_after(disconnect_timeout):
            await ws.aclose()


async def _handshake(
    stream: trio.abc.Stream,
    counts: WireCounts,
    request: Request,
    *,
    max_message_size: int,
    receive_buffer_size: int,
) -> WsSocket:
    """Send the upgrade request, read the answer: the socket, or `ConnectionRejected`."""
    protocol = WSConnection(ConnectionType.CLIENT)
    data = protocol.send(request)
    counts.wire_out += len(data)
    await stream.send_all(data)
    rejected: RejectConnection | None = None
    body = bytearray()
    while True:
        received = await stream.receive_some(receive_buffer_size)
        counts.wire_in += len(received)
        if not received:
            if rejected is not None:  # a body delimited by the end of the connection
                raise ConnectionRejected(rejected.status_code, list(rejected.headers), bytes(body))
            raise HandshakeError("the server closed the connection during the upgrade")
        try:
            protocol.receive_data(bytes(received))
        except RemoteProtocolError as exc:  # not an HTTP response
            raise HandshakeError(f"the upgrade's answer is not HTTP: {exc}") from None
        events = protocol.events()
        for event in events:
            if isinstance(event, AcceptConnection):
                deflate = any(e.name == PerMessageDeflate.name for e in event.extensions)
                ws = WsSocket(
                    stream,
                    protocol,
                    counts,
                    deflate=deflate,
                    max_message_size=max_message_size,
                    receive_buffer_size=receive_buffer_size,
                )
                await ws._handle(events)  # what arrived with the 101 response
                return ws
            if isinstance(event, RejectConnection):
                rejected = event
                if not event.has_body:
                    raise ConnectionRejected(event.status_code, list(event.headers), b"")
            elif isinstance(event, RejectData) and rejected is not None:
                body += event.data[: REJECT_BODY_LIMIT - len(body)]
                if event.body_finished or len(body) >= REJECT_BODY_LIMIT:
                    raise ConnectionRejected(
                        rejected.status_code, list(rejected.headers), bytes(body)
                    )
