"""The benchmark's WebSocket client connection (`bench/_ws.py`), against a wsproto server over
an in-memory stream: every message one read completes is queued at once, fragments are joined,
pings answered, payloads counted in UTF-8, the size limit and a close become
`ConnectionClosed` after what arrived before them, a refused upgrade is `ConnectionRejected`."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from rollout.bench._client import _reason
from rollout.bench._ws import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WireCounts,
    WsSocket,
    _handshake,
    open_bench_ws,
)
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate

DEADLINE = 10
LIMIT = 1000


class Server:
    """wsproto's server side of the in-memory stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.SERVER)

    async def send(self, *events: Event) -> None:
        await self.stream.send_all(b"".join(self.ws.send(e) for e in events))

    async def receive(self) -> list[Event]:
        self.ws.receive_data(await self.stream.receive_some())
        return list(self.ws.events())

    async def accept(self, *, deflate: bool) -> None:
        (request,) = await self.receive()
        assert isinstance(request, Request)
        assert [str(e).split(";")[0] for e in request.extensions] == ["permessage-deflate"]
        await self.send(AcceptConnection(extensions=[PerMessageDeflate()] if deflate else []))


@asynccontextmanager
async def connected(*, deflate: bool = False) -> AsyncIterator[tuple[WsSocket, Server]]:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    server = Server(server_stream)
    request = Request(host="x", target="/", extensions=[PerMessageDeflate()])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: server.accept(deflate=deflate))
        ws = await _handshake(
            client_stream,
            WireCounts(),
            request,
            max_message_size=LIMIT,
            receive_buffer_size=1 << 16,
        )
    yield ws, server


async def test_one_read_queues_every_message_it_completed() -> None:
    with trio.fail_after(DEADLINE):
        async with connected() as (ws, server):
            await server.send(
                TextMessage("a"),
                TextMessage("é", message_finished=False),  # a fragmented message
                TextMessage("b"),
                BytesMessage(b"\x00\x01"),
            )
            before = ws.counts.wire_in
            await ws.read()
            assert list(ws.messages) == ["a", "éb", b"\x00\x01"]
            assert ws.counts.payload_in == 1 + 2 + 1 + 2  # UTF-8 bytes
            assert ws.counts.wire_in - before == 3 + 4 + 3 + 4  # 2-byte headers each
            assert await ws.get_message() == "a"
            await ws.send_message("ça")
            assert ws.counts.payload_out == 3
            (received,) = await server.receive()
            assert isinstance(received, TextMessage) and received.data == "ça"


async def test_pings_are_answered_by_the_read() -> None:
    with trio.fail_after(DEADLINE):
        async with connected() as (ws, server):
            await server.send(Ping(b"p"), TextMessage("x"))
            assert await ws.get_message() == "x"
            (pong,) = await server.receive()
            assert isinstance(pong, Pong) and pong.payload == b"p"


async def test_a_close_comes_after_the_messages_before_it_and_is_answered() -> None:
    with trio.fail_after(DEADLINE):
        async with connected() as (ws, server):
            await server.send(TextMessage("last"), CloseConnection(1011, "bye"))
            assert await ws.get_message() == "last"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert (closed.value.reason.code, closed.value.reason.reason) == (1011, "bye")
            assert str(closed.value.reason) == "close code 1011, reason 'bye'"
            (answer,) = await server.receive()
            assert isinstance(answer, CloseConnection) and answer.code == 1011
            with pytest.raises(ConnectionClosed):
                await ws.send_message("late")


async def test_end_of_stream_is_an_abnormal_closure() -> None:
    with trio.fail_after(DEADLINE):
        async with connected() as (ws, server):
            await server.stream.aclose()
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason.code == 1006


@pytest.mark.parametrize("fragments", [1, 3])
async def test_a_message_over_the_limit_closes_with_1009(fragments: int) -> None:
    with trio.fail_after(DEADLINE):
        async with connected() as (ws, server):
            piece = "x" * (LIMIT // fragments + 1)
            await server.send(
                *(TextMessage(piece, message_finished=i == fragments - 1) for i in range(fragments))
            )
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason.code == 1009
            (answer,) = await server.receive()
            assert isinstance(answer, CloseConnection) and answer.code == 1009


async def test_deflate_is_negotiated_when_the_server_accepts() -> None:
    with trio.fail_after(DEADLINE):
        async with connected(deflate=True) as (ws, server):
            assert ws.deflate
            before = ws.counts.wire_in
            await server.send(TextMessage("abc" * 200))
            assert await ws.get_message() == "abc" * 200
            assert ws.counts.wire_in - before < 100 < ws.counts.payload_in
        async with connected(deflate=False) as (ws, _):
            assert not ws.deflate


async def test_a_refused_upgrade_is_rejected_with_its_status_and_body() -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    server = Server(server_stream)

    async def refuse() -> None:
        await server.receive()
        await server.send(
            RejectConnection(status_code=426, headers=[(b"content-length", b"4")], has_body=True),
            RejectData(b"nope"),
        )

    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refuse)
            with pytest.raises(ConnectionRejected) as refused:
                await _handshake(
                    client_stream,
                    WireCounts(),
                    Request(host="x", target="/"),
                    max_message_size=LIMIT,
                    receive_buffer_size=1024,
                )
    assert (refused.value.status_code, refused.value.body) == (426, b"nope")
    assert isinstance(refused.value, HandshakeError)


async def test_nothing_listening_is_a_handshake_error_caused_by_the_refusal() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with trio.fail_after(DEADLINE), pytest.raises(HandshakeError) as failed:
            async with open_bench_ws(
                f"ws://127.0.0.1:{port}/v1/responses",
                max_message_size=LIMIT,
                receive_buffer_size=1024,
            ):
                pass  # pragma: no cover
    assert isinstance(failed.value.__cause__, OSError)
    assert _reason(failed.value).startswith("OSError: ")
