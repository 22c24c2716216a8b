"""Socket writes without scheduler round trips: hypercorn's trio `TCPServer.protocol_send`.

hypercorn (0.17, 0.18) writes every chunk a connection sends (each WebSocket frame, each SSE
event) through `TCPServer.protocol_send`: take the connection's `send_lock`, open a shielded
cancel scope, `SocketStream.send_all`. Each of those is a trip through trio's scheduler (the
lock and the socket send each end in a checkpoint) or a cancel scope; measured on a 2-core VM
(trio 0.35) a small write costs about 40 µs of CPU that way against 3 µs for the system call
itself. A server streaming deltas to many clients spends much of its time there: py-spy on a
worker serving 48 concurrent rollouts at 4,000 tokens/s put 22% of its samples under
hypercorn's send path (9% with this patch, most of it the system call).

The patch writes directly when it can do so without changing what hypercorn guarantees:
- on a WebSocket (an HTTP/1.1 connection upgraded: its protocol's stream is a `WSStream`),
  and on an HTTP/1.1 response whose request hypercorn has read to its end (h11's
  `their_state` is DONE: an SSE stream, typically). Other HTTP responses keep hypercorn's
  path, whose checkpoints matter there: a response the app sends before it read the request
  body (a 401, say) ends the exchange, and hypercorn keeps the connection alive only if its
  reader has taken in the rest of the request by then. Written without a checkpoint, the
  response won that race, hypercorn closed the connection, and a client reusing it saw
  "server disconnected" (httpx, in `tests/test_server_http.py::test_auth`, about one run
  in six). Once the request is read there is no race left;
- only for a plain `trio.SocketStream` (TLS streams take the original path: their bytes are
  not the chunk's);
- only while no other task holds the connection's `send_lock` (then no write of another task
  is in progress, and none can start: the lock is taken synchronously, and released after);
- the chunk goes to the socket with one non-blocking `write`; whatever the kernel did not take
  (a full socket buffer, a large chunk) follows with the original shielded `send_all` while
  the lock is still held, so chunks never interleave and a cancelled sender never leaves half
  a chunk on the wire;
- a peer that has gone away (`EPIPE`, `ECONNRESET`, a closed socket) is handled as the
  original handles a broken stream: the protocol is told the connection `Closed`.

What changes is only the cost: no lock wait, cancel scope or checkpoint when the kernel takes
the chunk at once, which it does unless the client reads slower than the server writes (and
then the original path waits for it, as before). The write is a trio non-checkpoint there,
like `trio.Lock.acquire_nowait`: the callers (`WebSocketConnection._writer`, the SSE stream)
wait elsewhere between chunks.

One idempotent patch, inert unless the server's hypercorn config asks for it
(`HypercornConfig.direct_writes`, on for `rollout serve`): other hypercorn servers in the
process keep hypercorn's behaviour. `tests/test_direct_write.py` pins what this relies on
(the method's name and signature, `send_lock`, `stream`, `protocol.protocol.stream`) and its
behaviour: no checkpoint, order under a full buffer, a held lock, a peer gone, a cancelled
sender, another server's config, an HTTP stream.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import trio

__all__ = ["write_directly"]


def write_directly() -> None:
    """Make hypercorn's trio servers whose config has `direct_writes = True` write each chunk
    with one system call when the socket takes it at once. Idempotent."""
    import h11
    from hypercorn.events import Closed, RawData
    from hypercorn.protocol.ws_stream import WSStream
    from hypercorn.trio.tcp_server import TCPServer

    original = TCPServer.protocol_send
    # our mark on the function we patched
    if getattr(original, "_rollout_patched", False):
        return
    if list(inspect.signature(original).parameters) != ["self", "event"]:
        raise RuntimeError(
            "hypercorn's TCPServer.protocol_send changed its signature: rollout's direct "
            "writes need updating for this hypercorn version"
        )

    async def protocol_send(self: TCPServer, event: Any) -> None:
        stream: object = self.stream  # (typed as a TLS stream by hypercorn: it may be either)
        lock = self.send_lock
        if (
            type(event) is not RawData
            or not isinstance(stream, trio.SocketStream)  # (final: exactly a plain socket)
            or lock.locked()
            # our setting on hypercorn's Config (a plain Config lacks it)
            or not getattr(self.config, "direct_writes", False)
            or not _settled(self.protocol.protocol)
        ):
            await original(self, event)
            return
        data = event.data
        broken = False
        lock.acquire_nowait()  # no other write is in progress, and none starts until release
        try:
            try:
                sent = os.write(stream.socket.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:  # the peer reset, a write after EOF, a closed socket (fd -1)
                broken = True
            else:
                if sent < len(data):  # the rest waits for the peer, as the original does
                    with trio.CancelScope(shield=True):
                        await stream.send_all(memoryview(data)[sent:])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            broken = True
        finally:
            lock.release()
        if broken:
            await self.protocol.handle(Closed())

    def _settled(protocol: Any) -> bool:
        """A WebSocket, or an HTTP/1.1 response whose request has been read to its end (h11's
        `their_state` is DONE: no race with hypercorn's reader is left)."""
        stream = getattr(protocol, "stream", None)  # (hypercorn's, typed by neither)
        if isinstance(stream, WSStream):
            return True
        # hypercorn's private internals, typed by neither it nor us
        connection = getattr(protocol, "connection", None)
        return isinstance(connection, h11.Connection) and connection.their_state is h11.DONE

    protocol_send._rollout_patched = True  # type: ignore[attr-defined]
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
