"""Direct socket writes in hypercorn's trio server (`engine/_write.py`).

The patched `TCPServer.protocol_send` writes a chunk with one system call when no other write
is in progress, and hands what the kernel did not take to hypercorn's own shielded `send_all`.
These tests drive the patched method on real socket pairs (no hypercorn server around it, so
each case is exact): the kernel's buffer full, the send lock held, the peer gone, a server
configured without it, a sender cancelled mid-chunk. The first pins the hypercorn internals the
patch relies on; the last runs a real `rollout serve` stream through it.
"""

from __future__ import annotations

import inspect
import json
import socket
from types import SimpleNamespace
from typing import Any

import h11
import pytest
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.protocol.ws_stream import WSStream
from hypercorn.trio.tcp_server import TCPServer
from rollout.bench._ws import open_bench_ws
from rollout.engine._deflate import HypercornConfig
from rollout.engine._write import write_directly

from tests.server_harness import open_test_server, ws_url

DEADLINE = 20
DRAIN_DEADLINE = 5  # a shielded reader's own (only a failing test waits for it)


class FakeProtocol:
    """What hypercorn's connection protocol is told (`Closed` when the peer went away), on a
    connection whose stream is a WebSocket's (`websocket=False`: an HTTP request's, its h11
    connection having read the request `read` to its end or not)."""

    def __init__(self, *, websocket: bool = True, read: bool = False) -> None:
        self.events: list[Any] = []
        stream = WSStream.__new__(WSStream) if websocket else HTTPStream.__new__(HTTPStream)
        connection = h11.Connection(h11.SERVER)
        if read:
            connection.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            while (
                connection.next_event() is not h11.NEED_DATA
                and connection.their_state is not h11.DONE
            ):
                pass
        # as `ProtocolWrapper.protocol`
        self.protocol = SimpleNamespace(stream=stream, connection=connection)

    async def handle(self, event: Any) -> None:
        self.events.append(event)


def server_on(
    sock: trio.socket.SocketType,
    config: Config | None = None,
    *,
    websocket: bool = True,
    read: bool = False,
) -> TCPServer:
    """A hypercorn TCPServer over one end of a socket pair, as its constructor builds it."""
    write_directly()
    stream = trio.SocketStream(sock)
    server = TCPServer(None, config or HypercornConfig(), None, None, stream)  # type: ignore[arg-type]
    server.protocol = FakeProtocol(websocket=websocket, read=read)  # type: ignore[assignment]
    return server


def small_buffers(*socks: trio.socket.SocketType) -> None:
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)


async def others_ran_during(server: TCPServer, data: bytes) -> bool:
    """Send `data` while another task is runnable: did it run before the send returned (did
    the send pass through trio's scheduler)?"""
    ran = False

    async def other() -> None:
        nonlocal ran
        ran = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await server.protocol_send(RawData(data=data))
        return ran


async def drain(sock: trio.socket.SocketType, n: int, into: list[bytes], go: trio.Event) -> None:
    """Read `n` bytes once `go` is set; shielded with its own deadline, so that a test failing
    around it cannot leave a shielded writer waiting for a reader that was cancelled."""
    with trio.CancelScope(shield=True), trio.move_on_after(DRAIN_DEADLINE):
        await go.wait()
        into.append(await read_exactly(sock, n))


async def read_exactly(sock: trio.socket.SocketType, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = await sock.recv(65536)
        assert data, f"the stream ended after {len(out)} of {n} bytes"
        out += data
    return bytes(out)


def test_hypercorn_internals_the_patch_relies_on() -> None:
    """`protocol_send(self, event)`, `send_lock` and `stream` set by the constructor, and an
    upgraded HTTP/1.1 connection's stream at `ProtocolWrapper.protocol.stream`: if this fails,
    hypercorn changed and `engine/_write.py` needs a look."""
    assert "self.protocol = " in inspect.getsource(ProtocolWrapper.__init__)
    assert "self.stream = WSStream(" in inspect.getsource(H11Protocol._create_stream)
    write_directly()
    assert getattr(TCPServer.protocol_send, "_rollout_patched", False)
    a, b = trio.socket.socketpair()
    with a, b:
        server = TCPServer(None, HypercornConfig(), None, None, trio.SocketStream(a))  # type: ignore[arg-type]
        assert isinstance(server.send_lock, trio.Lock)
        assert server.stream.socket is a
    assert list(inspect.signature(TCPServer.protocol_send).parameters) == ["self", "event"]
    assert HypercornConfig().direct_writes and not getattr(Config(), "direct_writes", False)


async def test_a_chunk_the_kernel_takes_is_written_without_a_checkpoint() -> None:
    """The point of the patch: no scheduler round trip. Another task that became runnable
    before the write has not run when it returns; the bytes are already on the socket."""
    a, b = trio.socket.socketpair()
    with a, b:
        server = server_on(a)
        with trio.fail_after(DEADLINE):
            assert not await others_ran_during(server, b"frame-1")  # no checkpoint
            assert await read_exactly(b, 7) == b"frame-1"
        assert not server.send_lock.locked()
        assert server.protocol.events == []  # type: ignore[attr-defined]


async def test_what_the_kernel_does_not_take_follows_in_order() -> None:
    """A chunk larger than the socket's buffers: the first part goes directly, the rest waits
    for the reader through hypercorn's `send_all`, and a chunk sent meanwhile by another task
    waits for the lock, so nothing interleaves."""
    a, b = trio.socket.socketpair()
    small_buffers(a, b)
    with a, b:
        server = server_on(a)
        big = bytes(range(256)) * 4096  # 1 MiB, far more than the buffers hold
        small = b"after-the-big-one"
        go, received = trio.Event(), list[bytes]()
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain, b, len(big) + len(small), received, go)
                try:
                    nursery.start_soon(server.protocol_send, RawData(data=big))
                    await trio.testing.wait_all_tasks_blocked()
                    assert server.send_lock.locked()  # the rest of the big chunk is waiting
                    nursery.start_soon(server.protocol_send, RawData(data=small))
                    await trio.testing.wait_all_tasks_blocked()
                finally:
                    go.set()
        assert received == [big + small]


async def test_a_held_lock_sends_through_hypercorn_after_it() -> None:
    """While another task holds the send lock (a write in progress) nothing is written
    directly: the chunk waits for the lock, as hypercorn's own path does."""
    a, b = trio.socket.socketpair()
    with a, b:
        server = server_on(a)
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                await server.send_lock.acquire()
                nursery.start_soon(server.protocol_send, RawData(data=b"second"))
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(BlockingIOError):
                    b._sock.recv(100)  # nothing was written past the held lock
                await a.send(b"first-")  # the lock holder's write
                server.send_lock.release()
            assert await read_exactly(b, 12) == b"first-second"


@pytest.mark.parametrize("how", ["reset", "closed"])
async def test_a_peer_gone_is_a_closed_connection(how: str) -> None:
    """A write to a peer that reset, or on a socket already closed, tells the protocol the
    connection `Closed` (as hypercorn does for a broken stream) and raises nothing."""
    a, b = trio.socket.socketpair()
    with a:
        server = server_on(a)
        if how == "reset":
            b.close()
        else:
            await server.stream.aclose()
        with trio.fail_after(DEADLINE):
            await server.protocol_send(RawData(data=b"x" * 100))
        assert [type(e) for e in server.protocol.events] == [Closed]  # type: ignore[attr-defined]
        assert not server.send_lock.locked()


async def test_an_http_response_keeps_hypercorns_path_until_the_request_is_read() -> None:
    """An HTTP response sent while its request is still arriving is written as hypercorn
    writes it (with its checkpoints, which let its reader finish taking in a request before a
    response that did not read it ends the exchange); once h11 has read the request to its end
    (an SSE stream's events), chunks are written directly."""
    a, b = trio.socket.socketpair()
    with a, b:
        server = server_on(a, websocket=False)
        with trio.fail_after(DEADLINE):
            assert await others_ran_during(server, b"HTTP/1.1 401")
            assert await read_exactly(b, 12) == b"HTTP/1.1 401"
    a, b = trio.socket.socketpair()
    with a, b:
        server = server_on(a, websocket=False, read=True)
        with trio.fail_after(DEADLINE):
            assert not await others_ran_during(server, b"data: {}\n\n")
            assert await read_exactly(b, 10) == b"data: {}\n\n"


async def test_a_server_without_the_setting_keeps_hypercorns_path() -> None:
    """hypercorn's plain `Config` (another server in the process) is not affected: its send
    goes through the lock and a checkpoint, so another runnable task runs first."""
    a, b = trio.socket.socketpair()
    with a, b:
        server = server_on(a, Config())
        with trio.fail_after(DEADLINE):
            assert await others_ran_during(server, b"plain")
            assert await read_exactly(b, 5) == b"plain"


async def test_a_cancelled_sender_still_finishes_its_chunk() -> None:
    """The rest of a chunk is written shielded, as hypercorn does: cancelling the sender while
    it waits for the reader never leaves half a chunk on the wire for the next one to follow."""
    a, b = trio.socket.socketpair()
    small_buffers(a, b)
    with a, b:
        server = server_on(a)
        big = b"A" * 300_000
        go, received = trio.Event(), list[bytes]()
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as outer:
                outer.start_soon(drain, b, len(big) + 4, received, go)
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(server.protocol_send, RawData(data=big))
                        await trio.testing.wait_all_tasks_blocked()
                        assert server.send_lock.locked()  # mid-chunk, waiting for the reader
                        nursery.cancel_scope.cancel()
                        go.set()
                    await server.protocol_send(RawData(data=b"next"))
                finally:
                    go.set()
        assert received == [big + b"next"]


async def test_a_served_stream_goes_through_it() -> None:
    """A real `rollout serve` WebSocket turn, written through the patch: every frame arrives
    whole and in order (the server's own grammar and the client's parser check both), and the
    frames went out directly, not through trio's `send_all` (hypercorn's path)."""
    calls = send_alls = 0
    original = TCPServer.protocol_send
    original_send_all = trio.SocketStream.send_all

    async def counting(self: TCPServer, event: Any) -> None:
        nonlocal calls
        calls += 1
        await original(self, event)

    async def counting_send_all(self: trio.SocketStream, data: Any) -> None:
        nonlocal send_alls
        send_alls += 1
        await original_send_all(self, data)

    with trio.fail_after(DEADLINE):
        async with open_test_server() as base:
            TCPServer.protocol_send = counting  # type: ignore[method-assign]
            try:
                async with open_bench_ws(
                    ws_url(base), max_message_size=1 << 24, receive_buffer_size=65536
                ) as ws:
                    trio.SocketStream.send_all = counting_send_all  # type: ignore[method-assign]
                    await ws.send_message(
                        json.dumps(
                            {
                                "type": "response.create",
                                "model": "sim:tokens=2000,tps=1000000,interval_ms=0",
                                "input": "hello",
                                "store": False,
                            }
                        )
                    )
                    events: list[dict[str, Any]] = []
                    while not events or events[-1]["type"] != "response.completed":
                        events.append(json.loads(await ws.get_message()))
            finally:
                TCPServer.protocol_send = original  # type: ignore[method-assign]
                trio.SocketStream.send_all = original_send_all  # type: ignore[method-assign]
    types = [e["type"] for e in events]
    assert types[0] == "response.created"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == next(e["text"] for e in events if e["type"] == "response.output_text.done")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert calls >= len(events)
    assert send_alls <= 2  # the client's message (and a close), not the server's frames
