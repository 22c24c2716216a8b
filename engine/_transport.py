"""What hypercorn's streams offer the app beyond ASGI messages: aborting the TCP connection
(WebSocket and HTTP), sending a ping and hearing the pongs (WebSocket), as the ASGI scope
extension `rollout.transport`; and `WriteWatch`, which aborts an HTTP response's connection
when one of its writes is held past a limit.

ASGI gives a WebSocket app `websocket.send` and `websocket.close` and nothing else, and
hypercorn (0.17, 0.18) writes every chunk shielded from cancellation
(`TCPServer.protocol_send`): a client that stops reading leaves the write of the frame in
flight, and of anything after it (the close frame, the pongs hypercorn answers the client's
pings with, from its reader task), waiting for the peer forever, with the connection's buffers
pinned and its place counted. A polite close cannot help: it is one more write. What ends such
a connection is closing its socket under the blocked write: trio wakes the write (and the
reader) with `ClosedResourceError`, which hypercorn handles as the peer gone, the app gets
`websocket.disconnect`, and every buffer of the connection is released. `SO_LINGER` 0 first
makes the close a reset, so the kernel drops its send buffer at once instead of keeping it for
the peer (an orphaned socket's data).

ASGI has no ping either, and hypercorn's own (`websocket_ping_interval`) never looks at the
pongs, so it cannot tell a peer that stopped answering.

An HTTP response's writes are shielded the same way: a client that stops reading a
server-sent-event stream (or a large JSON body) holds the write, the response and the
connection's buffers for as long as it likes. `WriteWatch` times each write of one request,
and the server's one `WriteWatchdog` task resets the connection of any request whose write has
waited `limit`: hypercorn then tells the app `http.disconnect`, which cancels the response (its
usage recorded as for any client that leaves).

`offer_transport()` patches hypercorn's `WSStream.handle` and `HTTPStream.handle`
(idempotent) so that each WebSocket's and HTTP request's ASGI scope carries
`scope["extensions"]["rollout.transport"]`, a `HypercornTransport` over that stream:

- `abort()`: reset the TCP connection now (the one under the stream: on HTTP/2, every stream
  of that connection, all of them the same peer's);
- `ping(payload)` (WebSocket): one ping frame, written like any frame (returns once written;
  False when the WebSocket is closing and no ping can go out);
- `watch_pongs(on_pong)` (WebSocket): `on_pong(payload)` at each pong the peer sends.

An app that does not look at the extension sees hypercorn's behaviour unchanged. The path to
the TCP stream (`WSStream.send` is its protocol's bound `stream_send`, whose `send` is the
`TCPServer`'s bound `protocol_send`) and the rest this relies on are pinned by
`tests/test_ws_liveness.py::test_hypercorn_internals_the_transport_relies_on`.
"""

from __future__ import annotations

import functools
import socket
import struct
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio

__all__ = [
    "TRANSPORT_EXTENSION",
    "HypercornTransport",
    "WriteWatch",
    "WriteWatchdog",
    "offer_transport",
]

# The ASGI scope extension holding a WebSocket's `HypercornTransport`.
TRANSPORT_EXTENSION = "rollout.transport"

_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


class HypercornTransport:
    """One hypercorn WebSocket stream (`WSStream`), seen from the app."""

    def __init__(self, stream: Any) -> None:
        # Weakly: the stream holds this transport (through its app wrapper and its scope), and
        # a strong reference back made every ended WebSocket a reference cycle, its buffers
        # (a partial message of up to the message limit) kept until the cyclic garbage
        # collector's next full pass instead of freed when the connection ended.
        self._stream_ref = weakref.ref(stream)
        self.aborted = False

    @property
    def _stream(self) -> Any:
        """The stream, or None once it is gone."""
        return self._stream_ref()

    def _socket(self) -> trio.socket.SocketType | None:
        """The trio socket under the stream (through its protocol and its TCP server)."""
        # hypercorn's private internals, typed by neither it nor us
        protocol = getattr(getattr(self._stream, "send", None), "__self__", None)
        server = getattr(getattr(protocol, "send", None), "__self__", None)
        tcp: Any = getattr(server, "stream", None)
        tcp = getattr(tcp, "transport_stream", tcp)  # under TLS, the socket stream
        sock = getattr(tcp, "socket", None)
        return sock if isinstance(sock, trio.socket.SocketType) else None

    def abort(self) -> bool:
        """Reset the TCP connection now: a write blocked on it ends (hypercorn takes the peer
        for gone), the app is told `websocket.disconnect`, the kernel drops its buffers.
        False when there is no socket to reset (already closed, or not found)."""
        sock = self._socket()
        if sock is None or sock.fileno() == -1:
            return False
        self.aborted = True
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:  # the peer already reset it: a plain close is as good
            pass
        sock.close()  # trio wakes every task waiting on it with ClosedResourceError
        return True

    async def ping(self, payload: bytes) -> bool:
        """Write a ping frame (like any frame: after the one being written). False when the
        WebSocket is not open (closing, or not yet accepted): no ping went out."""
        from hypercorn.protocol.events import Data
        from wsproto.events import Ping
        from wsproto.utilities import LocalProtocolError

        # hypercorn's private internals, typed by neither it nor us
        connection = getattr(self._stream, "connection", None)
        if connection is None or getattr(self._stream, "closed", True):
            return False
        try:
            data = connection.send(Ping(payload=payload))
        except LocalProtocolError:  # closing: wsproto sends no more frames
            return False
        stream = self._stream
        if stream is None:
            return False
        await stream.send(Data(stream_id=stream.stream_id, data=data))
        return True

    def watch_pongs(self, on_pong: Callable[[bytes], None]) -> bool:
        """Call `on_pong(payload)` at each pong the peer sends from now on (once the
        WebSocket is accepted; False before)."""
        from wsproto.events import Pong

        # hypercorn's private internals, typed by neither it nor us
        connection = getattr(self._stream, "connection", None)
        if connection is None:
            return False
        events = connection.events  # bound now: the class's (and any patch of it)

        def observed() -> Iterator[Any]:
            for event in events():
                if isinstance(event, Pong):
                    on_pong(bytes(event.payload))
                yield event

        connection.events = observed  # this connection's only
        return True


class _WithTransport:
    """hypercorn's app wrapper for one WebSocket stream, adding the transport to its scope."""

    def __init__(self, app: Any, transport: HypercornTransport) -> None:
        self._app = app
        self._transport = transport

    async def __call__(self, scope: dict[str, Any], *args: Any) -> None:
        extensions = scope.setdefault("extensions", {})
        extensions[TRANSPORT_EXTENSION] = self._transport
        await self._app(scope, *args)


class WriteWatch:
    """One HTTP request's writes, timed (`send` wraps the ASGI send). A write held `limit`
    seconds resets the request's TCP connection through `transport` and calls `on_stall`:
    found by the server's `WriteWatchdog`, or where the server runs none (an app served
    without lifespan) by `watch()`, run beside the request. Either looks every `limit / 2`,
    so a held write is cut off no later than 1.5 x `limit` after it began."""

    def __init__(
        self,
        send: Callable[[dict[str, Any]], Awaitable[None]],
        transport: HypercornTransport | None,
        limit: float,
        on_stall: Callable[[], None],
    ) -> None:
        self._send = send
        self._transport = transport
        self.limit = limit
        self._on_stall = on_stall
        self._started: float | None = None  # when the write in progress began

    async def send(self, message: dict[str, Any]) -> None:
        self._started = trio.current_time()
        try:
            await self._send(message)
        finally:
            self._started = None

    def overdue(self, now: float) -> bool:
        """A write has been held `limit` seconds by `now`: the connection is reset (once)."""
        started = self._started
        if started is None or now < started + self.limit:
            return False
        if self._transport is not None and self._transport.abort():
            self._on_stall()
        return True

    async def watch(self) -> None:
        while not self.overdue(now := trio.current_time()):
            started = self._started
            await trio.sleep_until(
                started + self.limit if started is not None else now + self.limit / 2
            )


class WriteWatchdog:
    """The write watches of every HTTP request in flight, looked over by one task (`run`,
    beside the server: the app starts it with its lifespan) instead of a task beside each
    request. A request `add`s its watch and `discard`s it when done; every `limit / 2` the
    task asks each watch whether a write is `overdue`. The set holds one entry per request in
    flight (bounded by the server's connections)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.running = False  # `run` is looking: requests need no watch task of their own
        self._watches: set[WriteWatch] = set()

    def add(self, watch: WriteWatch) -> None:
        self._watches.add(watch)

    def discard(self, watch: WriteWatch) -> None:
        self._watches.discard(watch)

    def __len__(self) -> int:
        return len(self._watches)

    async def run(self) -> None:
        self.running = True
        try:
            while True:
                await trio.sleep(self.limit / 2)
                now = trio.current_time()
                for watch in [w for w in self._watches if w.overdue(now)]:
                    self._watches.discard(watch)
        finally:
            self.running = False


def offer_transport() -> None:
    """Give every hypercorn WebSocket's and HTTP request's ASGI scope its
    `HypercornTransport` (see the module docstring). Idempotent."""
    from hypercorn.protocol.events import Request
    from hypercorn.protocol.http_stream import HTTPStream
    from hypercorn.protocol.ws_stream import WSStream

    for cls in (WSStream, HTTPStream):
        original = cls.handle
        # our mark on the function we patched
        if getattr(original, "_rollout_transport", False):
            continue
        cls.handle = _with_transport(original, Request)  # type: ignore[method-assign]


def _with_transport(original: Any, request: type) -> Any:
    @functools.wraps(original)  # (keeps other patches' markers: they are not applied twice)
    async def handle(self: Any, event: Any) -> None:  # (self: a WSStream or an HTTPStream)
        if isinstance(event, request) and not isinstance(self.app, _WithTransport):
            self.app = _WithTransport(self.app, HypercornTransport(self))
        await original(self, event)

    handle._rollout_transport = True  # type: ignore[attr-defined]
    return handle
