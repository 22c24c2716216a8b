"""Socket reads into warm memory (`engine/_read.py`), on real socket pairs: what arrived, up to
1 MiB in one read, whole or cut in two; every connection's own bytes although they share one
buffer; trio's errors and checkpoints; and the server's reader reading through it, handing a
request's head on by itself (`engine/_http_limits.py`)."""

from __future__ import annotations

import errno
import json
import os
import socket
from types import SimpleNamespace
from typing import Any

import h11
import hypercorn.protocol as protocol_module
import pytest
import trio
import trio.testing
from hypercorn.events import RawData
from hypercorn.trio import run as run_module
from rollout.engine import _http_limits, _read
from rollout.engine._http_limits import (
    HEAD_READ,
    INFLATE_READ,
    _head_end,
    _waits_for_head,
    bound_transport,
)
from rollout.engine._read import READ_ON, READ_SIZE, read_cut, read_some

from tests.server_harness import open_test_server

DEADLINE = 10


def pair(buffers: int = 4 << 20) -> tuple[trio.SocketStream, trio.SocketStream]:
    """A connected pair whose kernel buffers hold `buffers` bytes (a send of less completes
    before the other end reads)."""
    a, b = trio.socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffers)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_what_has_arrived_is_one_read_up_to_the_read_size() -> None:
    """0.55 MB sent before the read is one read (hypercorn's own reads take 64 KiB); 1.5 MiB
    is two, the first of `READ_SIZE`."""
    with trio.fail_after(DEADLINE):
        a, b = pair()
        async with a, b:
            body = bytes(range(256)) * 2150  # 0.55 MB
            await a.send_all(body)
            got = await read_some(b)
            assert got == body and type(got) is bytes

            more = b"x" * (READ_SIZE + READ_SIZE // 2)
            await a.send_all(more)
            first = await read_some(b)
            assert len(first) == READ_SIZE
            rest = await read_some(b)
            assert first + rest == more


def _segments(
    monkeypatch: pytest.MonkeyPatch, size: int, fail_after: int | None = None
) -> list[int]:
    """`os.readv` as the kernel delivers a transfer in progress: at most `size` bytes a call
    (and a reset on the call after `fail_after` calls); returns the sizes each call took
    (0: nothing was there, -1: the reset)."""
    calls: list[int] = []
    readv = os.readv

    def segment(fd: int, buffers: list[memoryview]) -> int:
        if fail_after is not None and len(calls) == fail_after:
            calls.append(-1)
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        try:
            got = readv(fd, [buffers[0][:size]])
        except BlockingIOError:
            calls.append(0)  # nothing there
            raise
        calls.append(got)
        return got

    monkeypatch.setattr(_read.os, "readv", segment)
    return calls


async def test_a_large_read_reads_on_what_came_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of `READ_ON` or more goes on, without waiting, with what arrived while it copied
    (here the kernel hands 64 KiB a call): 200 KB that has arrived is one read; a small read
    (a WebSocket event) is one system call."""
    with trio.fail_after(DEADLINE):
        a, b = pair()
        async with a, b:
            calls = _segments(monkeypatch, READ_ON)
            body = bytes(range(256)) * 800  # 200 KB
            await a.send_all(body)
            assert await read_some(b) == body
            assert calls == [READ_ON] * 3 + [len(body) - 3 * READ_ON, 0]
            calls.clear()
            await a.send_all(b"e" * 1400)
            assert await read_some(b) == b"e" * 1400
            assert calls == [1400]  # not read on: one system call


async def test_an_error_met_reading_on_is_the_next_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reset met while reading on: the read returns what came before it, and the next read
    raises it as a read meeting it would (`trio.BrokenResourceError`), once."""
    with trio.fail_after(DEADLINE):
        a, b = pair()
        async with a, b:
            _segments(monkeypatch, READ_ON, fail_after=1)
            await a.send_all(b"r" * (2 * READ_ON))
            assert await read_some(b) == b"r" * READ_ON
            with pytest.raises(trio.BrokenResourceError):
                await read_some(b)
            monkeypatch.undo()
            assert await read_some(b) == b"r" * READ_ON  # the error was the next read's only


async def test_connections_sharing_the_buffer_each_get_their_own_bytes() -> None:
    """Many connections read at once in one thread, through one buffer: each reads exactly
    what its peer sent, in order (the copy is taken before the task can be suspended)."""
    n, rounds = 8, 40

    async def one(i: int, results: dict[int, bytes]) -> None:
        a, b = pair(1 << 16)
        async with a, b:

            async def send() -> None:
                for r in range(rounds):
                    await a.send_all(bytes([i]) * (1000 + 997 * r))
                await a.send_eof()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                got = bytearray()
                while data := await read_some(b):
                    got += data
                results[i] = bytes(got)

    with trio.fail_after(DEADLINE):
        results: dict[int, bytes] = {}
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i, results)
    for i in range(n):
        assert results[i] == b"".join(bytes([i]) * (1000 + 997 * r) for r in range(rounds))


async def test_the_end_a_closed_socket_and_a_reset_are_trios_own() -> None:
    with trio.fail_after(DEADLINE):
        a, b = pair()
        await a.send_all(b"last")
        await a.aclose()
        assert await read_some(b) == b"last"
        assert await read_some(b) == b""  # the end of the stream
        await b.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await read_some(b)

        a, b = pair()
        # A reset: the peer closes with unread data in its receive buffer.
        await b.send_all(b"unread")
        await trio.testing.wait_all_tasks_blocked()
        a.socket.close()
        with pytest.raises(trio.BrokenResourceError):
            while await read_some(b):
                pass
        await b.aclose()


async def test_a_read_checkpoints_as_trios_do_and_a_waiting_read_can_be_cancelled() -> None:
    with trio.fail_after(DEADLINE):
        a, b = pair()
        async with a, b:
            await a.send_all(b"ready")
            with trio.testing.assert_checkpoints():
                assert await read_some(b) == b"ready"
            with trio.move_on_after(0.05) as waited:
                await read_some(b)  # nothing comes
            assert waited.cancelled_caught
            await a.send_all(b"after")
            assert await read_some(b) == b"after"


async def test_a_stream_that_is_not_a_socket_reads_through_its_own_receive() -> None:
    """A TLS stream (here a memory stream) is not read by system call."""
    with trio.fail_after(DEADLINE):
        left, right = trio.testing.memory_stream_pair()
        await left.send_all(b"through receive_some")
        assert await read_some(right) == b"through receive_some"


async def test_a_cut_read_is_two_pieces_each_read_once() -> None:
    """`read_cut` takes what arrived, up to `READ_SIZE`, in two pieces at the offset its cut
    gives (a piece may be empty); `(b"", b"")` at the end; a non-socket stream is cut too."""
    with trio.fail_after(DEADLINE):
        a, b = pair()
        async with a:
            head, body = b"POST / HTTP/1.1\r\ncontent-length: 9\r\n\r\n", b"x" * 600_000
            await a.send_all(head + body)
            first, rest = await read_cut(b, _head_end)
            assert (first, rest) == (head, body)
            assert type(first) is bytes and type(rest) is bytes
            await a.send_all(b"no blank line yet")
            assert await read_cut(b, _head_end) == (b"no blank line yet", b"")
            await a.send_all(b"0123456789")
            assert await read_cut(b, lambda data, size: 0) == (b"", b"0123456789")
        assert await read_cut(b, _head_end) == (b"", b"")  # the end of the stream
        await b.aclose()

        left, right = trio.testing.memory_stream_pair()
        await left.send_all(head + b"frames")
        assert await read_cut(right, _head_end) == (head, b"frames")


def test_a_heads_end_is_its_blank_line_looked_for_in_at_most_64_kib() -> None:
    head = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    data = head + b"frames" + head
    assert _head_end(data, len(data)) == len(head)
    assert _head_end(data, len(data), len(head) + 6) == len(data)  # the next head
    assert _head_end(data, len(head) - 1) == len(head) - 1  # not all read: what there is
    long = b"GET / HTTP/1.1\r\nx: " + b"y" * HEAD_READ + b"\r\n\r\n"
    assert _head_end(long, len(long)) == HEAD_READ  # not found within HEAD_READ
    bare = b"GET / HTTP/1.1\nhost: x\n\n" + b"z" * HEAD_READ
    assert _head_end(bare, len(bare)) == HEAD_READ  # h11 takes bare LFs: handed in pieces


async def test_a_large_request_reaches_the_server_in_reads_of_up_to_a_mebibyte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `rollout serve` in this process, its reader's reads and what it hands to hypercorn
    recorded: a 0.6 MB request sent in one write comes in reads larger than hypercorn's
    64 KiB, none over `READ_SIZE`; its head is handed on by itself and what followed it in
    the read in one piece; it gets its answer (here a 404 for its unknown model: the body was
    read and parsed)."""
    reads: list[int] = []
    handed: list[int] = []

    async def recorded(stream: trio.abc.ReceiveStream, max_bytes: int = READ_SIZE) -> bytes:
        data = await read_some(stream, max_bytes)
        reads.append(len(data))
        return data

    async def recorded_cut(stream: trio.abc.ReceiveStream, cut: Any) -> tuple[bytes, bytes]:
        first, rest = await read_cut(stream, cut)
        reads.append(len(first) + len(rest))
        return first, rest

    bound_transport()
    handle = protocol_module.ProtocolWrapper.handle

    async def recorded_handle(self: Any, event: Any) -> None:
        if isinstance(event, RawData) and event.data:
            handed.append(len(event.data))
        await handle(self, event)

    monkeypatch.setattr(_http_limits, "read_some", recorded)
    monkeypatch.setattr(_http_limits, "read_cut", recorded_cut)
    monkeypatch.setattr(protocol_module.ProtocolWrapper, "handle", recorded_handle)
    body = json.dumps({"model": "no-such-model", "input": "x" * 600_000}).encode()
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            head = (
                b"POST /v1/responses HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % (port, len(body))
            )
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            await sock.connect(("127.0.0.1", port))
            async with trio.SocketStream(sock) as stream:
                await stream.send_all(head + body)
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some(65536)
    assert answer.startswith(b"HTTP/1.1 404"), answer[:200]
    assert sum(reads) >= len(head) + len(body), reads
    assert max(reads) > 1 << 16 and max(reads) <= READ_SIZE, reads
    # The head by itself, then the rest of its read whole (the loopback's first segment
    # holds the head and ~64 KB of the body, so the first read is more than the head).
    assert reads[0] > len(head), reads
    assert handed[:2] == [len(head), reads[0] - len(head)], (handed, reads)


class _Protocol:
    """hypercorn's protocol wrapper as the reader sees it: an h11 connection fed each
    `RawData`, upgraded (no longer an h11 connection) by a WebSocket handshake."""

    def __init__(self) -> None:
        self.connection: Any = h11.Connection(h11.SERVER)
        self.calls: list[bytes] = []
        self.protocol = self  # hypercorn's wrapper holds its protocol, which holds h11's

    async def handle(self, event: RawData) -> None:
        self.calls.append(bytes(event.data))
        if not isinstance(self.connection, h11.Connection):
            return  # a WebSocket's bytes
        self.connection.receive_data(event.data)
        while True:
            ev = self.connection.next_event()
            if ev is h11.NEED_DATA:
                return
            if ev is h11.PAUSED:
                if self.connection.their_state is h11.MIGHT_SWITCH_PROTOCOL:
                    self.connection = object()  # as hypercorn's H11WSConnection
                    return
                # (the app answers at once)
                self.connection.send(h11.Response(status_code=204, headers=[]))
                self.connection.send(h11.EndOfMessage())
                self.connection.start_next_cycle()
                continue


class _Inflater:
    def __init__(self) -> None:
        self.paced = 0

    def enabled(self) -> bool:
        return True

    async def pace(self) -> None:
        self.paced += 1


async def test_the_reader_hands_a_head_on_by_itself_and_what_follows_as_the_state_asks() -> None:
    """Frames sent behind a WebSocket handshake reach the protocol in a later call than the
    handshake (so they meet the deflate pace, which the app's accept sets up); a body comes
    whole after its head; pipelined heads one at a time; a connection that negotiated
    deflate is handed `INFLATE_READ` at a time, each after its pace."""
    bound_transport()
    hand_over = run_module.TCPServer._hand_over
    handshake = (
        b"GET /v1/responses HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\n"
        b"upgrade: websocket\r\nsec-websocket-version: 13\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    frames = b"\x81\x85" + b"m" * 4 + b"hello" + b"\x82\x7e\x10\x00" + b"f" * 4096
    server = SimpleNamespace(protocol=_Protocol())
    await hand_over(server, handshake + frames)
    assert server.protocol.calls == [handshake, frames]

    post = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 300000\r\n\r\n"
    body = b"b" * 300_000
    server = SimpleNamespace(protocol=_Protocol())
    await hand_over(server, post + body)
    assert server.protocol.calls == [post, body]

    get = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
    server = SimpleNamespace(protocol=_Protocol())
    await hand_over(server, get * 3)
    assert server.protocol.calls == [get] * 3

    inflater = _Inflater()
    server = SimpleNamespace(protocol=_Protocol(), rollout_inflater=inflater)
    server.protocol.connection = object()  # an accepted WebSocket
    await hand_over(server, frames)
    pieces = [frames[i : i + INFLATE_READ] for i in range(0, len(frames), INFLATE_READ)]
    assert server.protocol.calls == pieces and inflater.paced == len(pieces)


def test_the_reader_knows_when_a_connection_waits_for_a_head() -> None:
    """While an HTTP/1.1 connection waits for a request's head, the reader cuts a head from
    what follows it; not while h11 reads a body, nor once the connection is a WebSocket."""
    conn = h11.Connection(h11.SERVER)
    wrapper = SimpleNamespace(protocol=SimpleNamespace(connection=conn))  # as hypercorn's
    assert _waits_for_head(wrapper)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 9\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request) and conn.their_state is h11.SEND_BODY
    assert not _waits_for_head(wrapper)
    conn.receive_data(b"012345678")
    assert isinstance(conn.next_event(), h11.Data)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    assert _waits_for_head(wrapper)  # the next request's head
    upgraded = SimpleNamespace(protocol=SimpleNamespace(connection=object()))  # WebSocket
    assert not _waits_for_head(upgraded)
