"""The benchmark's WebSocket client connection: trio-websocket, offering permessage-deflate as
the openai SDK and Codex do, and counting the bytes on the wire.

The openai SDK's WebSocket client (`websockets`) and Codex offer permessage-deflate (RFC 7692)
on every connection, so what a server does with the offer is part of what a client sees: the
benchmark offers it too, and the server decides (`rollout serve --websocket-deflate` or
`--no-websocket-deflate`). trio-websocket 0.12 has no parameter for extensions, so the
connection is built here as `trio_websocket.wrap_client_stream` builds it, with a wsproto
connection whose opening request offers `PerMessageDeflate()` (wsproto compresses and inflates
the frames; nothing here touches framing) and whose stream counts the bytes it carries.
`tests/test_websocket_deflate.py` checks the offer is made and, where the server accepts it,
negotiated.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import AsyncIterator, Generator, Sequence
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import attrs
import trio
from trio_websocket import ConnectionTimeout, HandshakeError, WebSocketConnection
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Event, Message, Request
from wsproto.extensions import PerMessageDeflate

__all__ = ["WireCounts", "WsSocket", "open_bench_ws"]


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


class _CountingStream(trio.abc.Stream):
    """A stream that counts the bytes it sends and receives."""

    def __init__(self, stream: trio.abc.Stream, counts: WireCounts) -> None:
        self.stream = stream
        self.counts = counts

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.counts.wire_out += len(data)
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.stream.receive_some(max_bytes)
        self.counts.wire_in += len(data)
        return data

    async def aclose(self) -> None:
        await self.stream.aclose()


class _ClientProtocol(WSConnection):
    """wsproto's client connection, offering permessage-deflate in its opening request (when
    asked), noting the extensions the server accepted and counting message payloads."""

    def __init__(self, *, offer_deflate: bool, counts: WireCounts) -> None:
        super().__init__(ConnectionType.CLIENT)
        self.offer_deflate = offer_deflate
        self.counts = counts
        self.accepted: list[str] | None = None  # extension names, once the server accepted

    def send(self, event: Event) -> bytes:
        if isinstance(event, Request) and self.offer_deflate:
            event = dataclasses.replace(event, extensions=[PerMessageDeflate()])
        elif isinstance(event, Message):
            self.counts.payload_out += _size(event.data)
        return super().send(event)

    def events(self) -> Generator[Event, None, None]:
        for event in super().events():
            if isinstance(event, AcceptConnection):
                self.accepted = [e.name for e in event.extensions]
            elif isinstance(event, Message):
                self.counts.payload_in += _size(event.data)
            yield event


def _size(data: str | bytes) -> int:
    return len(data.encode()) if isinstance(data, str) else len(data)


@attrs.frozen
class WsSocket:
    """An open connection: trio-websocket's, the byte counts, and what was negotiated."""

    conn: WebSocketConnection
    counts: WireCounts
    _protocol: _ClientProtocol

    @property
    def deflate(self) -> bool:
        """Whether permessage-deflate was negotiated."""
        return PerMessageDeflate.name in (self._protocol.accepted or [])


@asynccontextmanager
async def open_bench_ws(
    url: str,
    *,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
    offer_deflate: bool = True,
    max_message_size: int,
    message_queue_size: int,
    receive_buffer_size: int | None,
    connect_timeout: float = 60.0,
    disconnect_timeout: float = 5.0,
) -> AsyncIterator[WsSocket]:
    """Connect to a `ws://` or `wss://` URL (the upgrade must complete within
    `connect_timeout`), yield the socket, close it (waiting at most `disconnect_timeout` for
    the server's close frame). Errors are trio-websocket's: `HandshakeError` (and its
    `ConnectionRejected`, `ConnectionTimeout`), `ConnectionClosed`."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a WebSocket URL: {url!r}")
    secure = parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    host = parts.hostname if port in (80, 443) else f"{parts.hostname}:{port}"
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    counts = WireCounts()
    protocol = _ClientProtocol(offer_deflate=offer_deflate, counts=counts)
    try:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(connect_timeout):
                    tcp: trio.abc.Stream
                    if secure:
                        tcp = await trio.open_ssl_over_tcp_stream(
                            parts.hostname,
                            port,
                            ssl_context=ssl.create_default_context(),
                            https_compatible=True,
                        )
                    else:
                        tcp = await trio.open_tcp_stream(parts.hostname, port)
                    conn = WebSocketConnection(
                        _CountingStream(tcp, counts),
                        protocol,
                        host=host,
                        path=resource,
                        client_extra_headers=list(extra_headers),
                        message_queue_size=message_queue_size,
                        max_message_size=max_message_size,
                        receive_buffer_size=receive_buffer_size,
                    )
                    # As trio_websocket.wrap_client_stream: the reader sends the request.
                    nursery.start_soon(conn._reader_task)
                    await conn._open_handshake.wait()
            except trio.TooSlowError:
                raise ConnectionTimeout from None
            except OSError as exc:
                raise HandshakeError from exc
            try:
                yield WsSocket(conn, counts, protocol)
            finally:
                with trio.move_on_after(disconnect_timeout):
                    await conn.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The reader's error (a refused upgrade) or the caller's, as itself (with its own
        # context, as trio-websocket's open_websocket does).
        errors = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
        if len(errors) != 1:
            raise
        error, context = errors[0], errors[0].__context__
        try:
            raise error
        finally:
            error.__context__ = context
            del error, context
