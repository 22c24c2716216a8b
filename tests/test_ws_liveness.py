"""A WebSocket's liveness on trio's mock clock: idle connections closed, pings and their pongs,
the age limit enforced without a create, and a peer that stops reading (frames, or the pongs of
its own pings) aborted, its responses' usage recorded once.

`WebSocketConnection` runs over in-memory ASGI `send`/`receive` with a real engine and the
paced `sim` model and a `Wire` standing for hypercorn's transport (`WebSocketTransport`): it
answers pings (or not), and can stop taking writes, as a peer that does not read makes
hypercorn's shielded write wait; `abort()` ends the blocked write and tells the app the peer is
gone, as resetting the TCP connection does. Time is virtual, so each bound is checked exactly.
The last tests pin the hypercorn internals `engine/_transport.py` relies on and run its
transport on a real server.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.ws_stream import WSStream
from hypercorn.trio.tcp_server import TCPServer
from rollout import protocol as p
from rollout.engine import Engine, MemoryUsageLedger, open_engine
from rollout.engine._transport import TRANSPORT_EXTENSION, HypercornTransport
from rollout.engine._ws import WebSocketConnection, WebSocketLimits

DEADLINE = 600  # virtual seconds
LIMITS = WebSocketLimits(
    idle_limit=30, ping_interval=10, ping_timeout=5, send_stall_limit=7, max_buffered_bytes=4096
)


@attrs.define(eq=False)
class Wire:
    """The transport and the client end: frames the client received (time, message), pings
    written (time, payload), pongs it sends back (`answers`), and whether it reads (`reading`:
    False, and every write waits, as hypercorn's does on a peer that does not read)."""

    answers: bool = True
    reading: bool = True
    frames: list[tuple[float, dict[str, Any]]] = attrs.field(factory=list)
    pings: list[float] = attrs.field(factory=list)
    aborted_at: float | None = None
    _on_pong: Any = None
    _unblocked: trio.Event = attrs.field(factory=trio.Event)
    _inbox: trio.MemorySendChannel[dict[str, Any]] | None = None

    async def _write(self) -> bool:
        """Wait while the peer does not read; False once aborted."""
        if not self.reading:
            await self._unblocked.wait()
        return self.aborted_at is None

    async def send(self, message: dict[str, Any]) -> None:
        if await self._write():
            self.frames.append((trio.current_time(), message))

    # --- WebSocketTransport ---
    def abort(self) -> bool:
        if self.aborted_at is None:
            self.aborted_at = trio.current_time()
            self._unblocked.set()
            assert self._inbox is not None
            self._inbox.send_nowait({"type": "websocket.disconnect", "code": 1006})
        return True

    async def ping(self, payload: bytes) -> bool:
        if not await self._write():
            return False
        self.pings.append(trio.current_time())
        if self.answers:
            self._on_pong(payload)
        return True

    def watch_pongs(self, on_pong: Any) -> bool:
        self._on_pong = on_pong
        return True

    def closes(self) -> list[tuple[float, dict[str, Any]]]:
        return [(t, m) for t, m in self.frames if m["type"] == "websocket.close"]


@attrs.define(eq=False)
class Peer:
    conn: WebSocketConnection
    wire: Wire
    inbox: trio.MemorySendChannel[dict[str, Any]]
    ended: trio.Event
    ended_at: float = math.inf

    async def create(self, **body: Any) -> None:
        message = p.encode_json(p.ResponseCreate(**body))
        await self.inbox.send({"type": "websocket.receive", "text": message})


@asynccontextmanager
async def connected(
    engine: Engine, wire: Wire, limits: WebSocketLimits = LIMITS, *, transport: Any = ...
) -> AsyncIterator[Peer]:
    inbox_send, inbox_recv = trio.open_memory_channel[dict[str, Any]](math.inf)
    wire._inbox = inbox_send
    conn = WebSocketConnection(
        engine.session(owner="k"),
        wire.send,
        inbox_recv.receive,
        limits=limits,
        transport=wire if transport is ... else transport,
    )
    peer = Peer(conn, wire, inbox_send, trio.Event())

    async def run() -> None:
        await conn.run()
        peer.ended_at = trio.current_time()
        peer.ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        yield peer
        if not peer.ended.is_set():
            inbox_send.send_nowait({"type": "websocket.disconnect"})


async def test_an_idle_connection_is_pinged_then_closed_at_the_idle_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    wire = Wire()
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine, wire) as peer:
            await peer.ended.wait()
            counters = engine.counters
    assert wire.pings == [10, 20]  # every ping_interval, each answered at once
    ((at, close),) = wire.closes()
    assert at == 30 and close["code"] == 1000 and "idle" in close["reason"]
    assert peer.ended_at == 30 and wire.aborted_at is None
    assert counters.ws_idle_closes == 1 and counters.ws_aborts == 0


async def test_idle_counts_from_the_end_of_the_last_response(
    autojump_clock: trio.testing.MockClock,
) -> None:
    wire = Wire()
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine, wire) as peer:
            await trio.sleep(20)
            # 50 s of streaming: longer than the idle limit, not idle while it runs.
            await peer.create(model="sim:tokens=500,tps=10", input="Hi", store=False)
            await peer.ended.wait()
    texts = [m for _, m in wire.frames if m["type"] == "websocket.send"]
    assert '"response.completed"' in texts[-1]["text"]
    last = max(t for t, m in wire.frames if m["type"] == "websocket.send")
    ((at, _),) = wire.closes()
    assert 69 < last < 71 and at == pytest.approx(last + 30)


async def test_a_peer_that_does_not_answer_pings_is_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    wire = Wire(answers=False)
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine, wire) as peer:
            await peer.ended.wait()
            counters = engine.counters
    assert wire.pings == [10] and wire.aborted_at == 15 and peer.ended_at == 15
    assert not wire.closes()
    assert counters.ws_ping_timeouts == 1 and counters.ws_aborts == 1


async def test_a_peer_that_stops_reading_is_aborted_its_usage_recorded_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A long response for a client that never reads: the outbox fills (4 KiB here), the
    response pauses, and `send_stall_limit` after the first write began the connection is
    aborted, the response cancelled, its usage recorded once (interrupted)."""
    ledger = MemoryUsageLedger()
    wire = Wire(reading=False)
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine, connected(engine, wire) as peer:
            await peer.create(model="sim:tokens=100000,tps=1000", input="Hi", store=False)
            await peer.ended.wait()
            await engine.post.flushed()
            counters = engine.counters
            totals = await ledger.totals(owner="k")
    assert wire.aborted_at is not None and wire.aborted_at <= LIMITS.send_stall_limit + 0.1
    assert peer.ended_at == wire.aborted_at
    assert counters.slow_consumers == 1 and counters.ws_aborts == 1
    assert totals["records"] == 1 and totals["incomplete"] == 1
    assert counters.responses_incomplete + counters.responses_failed <= 1


async def test_a_finished_response_stuck_in_the_writer_is_cut_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A short response whose frames fit in the outbox, for a peer that does not read: no
    response waits on the outbox, the writer's first write does; the watchdog cuts the peer
    off `send_stall_limit` after it began. The response completed: one complete record."""
    ledger = MemoryUsageLedger()
    wire = Wire(reading=False)
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine, connected(engine, wire) as peer:
            await peer.create(model="sim:tokens=4", input="Hi", store=False)
            await peer.ended.wait()
            await engine.post.flushed()
            counters = engine.counters
            totals = await ledger.totals(owner="k")
    assert wire.aborted_at == pytest.approx(LIMITS.send_stall_limit, abs=0.01)
    assert counters.slow_consumers == 1 and counters.ws_aborts == 1
    assert totals["records"] == 1 and totals["incomplete"] == 0


async def test_a_ping_that_cannot_be_written_is_a_stalled_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer flooding pings and never reading the pongs leaves hypercorn's reader waiting on
    a pong it cannot write (and every write after it): the server's next ping cannot be
    written either, and `send_stall_limit` later the connection is aborted."""
    wire = Wire(reading=False)
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine, wire) as peer:
            await peer.ended.wait()
            counters = engine.counters
    assert wire.aborted_at == LIMITS.ping_interval + LIMITS.send_stall_limit
    assert counters.slow_consumers == 1 and counters.ws_aborts == 1


async def test_a_connection_past_its_age_is_closed_once_idle_without_a_create(
    autojump_clock: trio.testing.MockClock,
) -> None:
    wire = Wire()
    limits = attrs.evolve(LIMITS, connection_age_limit=50, idle_limit=1000)
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine, wire, limits) as peer:
            await trio.sleep(40)
            await peer.create(model="sim:tokens=200,tps=10", input="Hi", store=False)  # to 60
            await peer.ended.wait()
            counters = engine.counters
    ((at, close),) = wire.closes()
    assert close["code"] == 1000 and 59 < at < 61  # after the running response ended
    assert counters.ws_age_closes == 1 and counters.ws_idle_closes == 0


async def test_without_an_abort_a_stalled_peer_keeps_its_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The broken variant of the stalled-peer tests: a transport whose abort does nothing (as
    before: the close is one more write behind the stuck one). The response is cancelled, but
    the connection never ends, its place and its frame held: the bound the tests above check
    fails."""

    class NoAbort(Wire):
        def abort(self) -> bool:
            return False

    wire = NoAbort(reading=False)
    with trio.move_on_after(DEADLINE) as waited:
        async with open_engine() as engine, connected(engine, wire) as peer:
            await peer.create(model="sim:tokens=4", input="Hi", store=False)
            with trio.move_on_after(DEADLINE / 2):
                await peer.ended.wait()
            assert not peer.ended.is_set()
            assert engine.counters.slow_consumers == 1
            waited.cancel()  # (the stuck writer would hold the nursery forever)
    assert waited.cancelled_caught


# --- hypercorn ------------------------------------------------------------------------------


def test_hypercorn_internals_the_transport_relies_on() -> None:
    """The path from a WebSocket stream to its socket (`WSStream.send` is the protocol's
    bound `stream_send`, whose `send` is the TCP server's bound `protocol_send`), the stream's
    wsproto `connection`, `closed` and `stream_id`, and the app spawned with `self.app`: if
    this fails, hypercorn changed and `engine/_transport.py` needs a look."""
    create = inspect.getsource(H11Protocol._create_stream)
    assert "self.stream_send" in create and "WSStream(" in create
    assert "self.protocol_send" in inspect.getsource(TCPServer.run)
    handle = inspect.getsource(WSStream)  # (its own text: other tests may have patched handle)
    assert "spawn_app(\n                    self.app," in handle
    accept = inspect.getsource(WSStream._accept)
    assert "self.connection = self.handshake.accept(" in accept
    assert "self.connection.events()" in inspect.getsource(WSStream._handle_events)
    init = inspect.getsource(WSStream.__init__)
    assert "self.closed = False" in init and "self.stream_id = stream_id" in init


async def test_the_transport_finds_the_socket_and_resets_it() -> None:
    """`HypercornTransport.abort` on a stream wired as hypercorn wires it: the socket closes
    with SO_LINGER 0 (the peer sees a reset, not an orderly end)."""
    a, b = trio.socket.socketpair()
    with a, b:
        server = TCPServer.__new__(TCPServer)
        server.stream = trio.SocketStream(a)  # type: ignore[assignment]
        protocol = H11Protocol.__new__(H11Protocol)
        protocol.send = server.protocol_send
        stream = WSStream.__new__(WSStream)
        stream.send = protocol.stream_send
        transport = HypercornTransport(stream)
        assert transport.abort() and a.fileno() == -1
        assert not transport.abort()  # once
        with trio.fail_after(5):
            assert await b.recv(10) == b""


async def test_the_transport_reaches_the_app_on_a_real_server() -> None:
    from tests.server_harness import open_test_server, open_ws

    seen: list[Any] = []
    with trio.fail_after(20):

        def wrap(app: Any) -> Any:
            async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
                if scope["type"] == "websocket":
                    seen.append(scope.get("extensions", {}).get(TRANSPORT_EXTENSION))
                await app(scope, receive, send)

            return wrapped

        async with open_test_server(app_wrapper=wrap) as url, open_ws(url) as ws:
            events = await ws.create(model="sim:tokens=4", input="Hi", store=False)
    assert events[-1].type == "response.completed"
    assert len(seen) == 1 and isinstance(seen[0], HypercornTransport)
