"""Socket reads into warm memory (`engine/_read.py`), on real socket pairs: what arrived, up to
1 MiB in one read; every connection's own bytes although they share one buffer; trio's
errors and checkpoints; and the server's reader reading through it."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import h11
import pytest
import trio
import trio.testing
from rollout.engine import _http_limits
from rollout.engine._http_limits import HEAD_READ, _read_size
from rollout.engine._read import READ_SIZE, read_some

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


async def test_a_large_request_reaches_the_server_in_reads_of_up_to_a_mebibyte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `rollout serve` in this process, its reader's reads recorded: a 0.6 MB request body
    whose bytes were all in the server's socket when it read them comes, after a first read of
    hypercorn's 64 KiB (`HEAD_READ`), in reads larger than that, none over `READ_SIZE`, and
    gets its answer (here a 404 for its unknown model: the body was read and parsed)."""
    reads: list[int] = []

    async def recorded(stream: trio.abc.ReceiveStream, max_bytes: int = READ_SIZE) -> bytes:
        data = await read_some(stream, max_bytes)
        reads.append(len(data))
        return data

    monkeypatch.setattr(_http_limits, "read_some", recorded)
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
    assert reads[0] <= HEAD_READ  # the head (a WebSocket's handshake) in hypercorn's size
    assert max(reads) > 1 << 16 and max(reads) <= READ_SIZE, reads


def test_a_requests_head_is_read_in_hypercorns_size_its_body_and_frames_in_large_reads() -> None:
    """A WebSocket handshake, and whatever the client sent behind it, is handed on before its
    deflate pacing starts: the read that starts a request stays at 64 KiB."""
    conn = h11.Connection(h11.SERVER)
    wrapper = SimpleNamespace(protocol=SimpleNamespace(connection=conn))  # as hypercorn's
    assert _read_size(wrapper) == HEAD_READ == 1 << 16
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 9\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request) and conn.their_state is h11.SEND_BODY
    assert _read_size(wrapper) == READ_SIZE
    conn.receive_data(b"012345678")
    assert isinstance(conn.next_event(), h11.Data)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    assert _read_size(wrapper) == HEAD_READ  # the next request's head
    upgraded = SimpleNamespace(protocol=SimpleNamespace(connection=object()))  # WebSocket
    assert _read_size(upgraded) == READ_SIZE
