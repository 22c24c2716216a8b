"""The transport's bounds in-process: bounded inflation (`_ws_deflate.py`) driven through
wsproto's own connections (sans-IO), the body clock (`_http_limits.BodyClock`) on trio's
mock clock, the accept-error log filter, and the hypercorn names the patches rely on.
`tests/test_hostile_transport.py` meets the same bounds through a real server process."""

from __future__ import annotations

import gc
import inspect
import json
import logging
import os
import subprocess
import sys
import zlib
from typing import Any

import pytest
import trio
import trio.testing
from rollout.engine import MemoryResponseStore, _http_limits
from rollout.engine._app import AppConfig, RolloutApp
from rollout.engine._engine import open_engine
from rollout.engine._http_limits import BodyClock, content_length
from rollout.engine._ws_deflate import (
    INFLATE_STEP,
    BoundedPerMessageDeflate,
    InflateBudget,
    InflateLimits,
    InflatePace,
)
from wsproto import Connection, ConnectionType
from wsproto.events import CloseConnection, Message, TextMessage
from wsproto.extensions import PerMessageDeflate

LIMIT = 4 * 2**20  # a message's inflated bytes at most, in these tests


def server(limits: InflateLimits) -> tuple[Connection, BoundedPerMessageDeflate]:
    extension = BoundedPerMessageDeflate(limits)
    assert extension.accept("permessage-deflate") is not None
    return Connection(ConnectionType.SERVER, [extension]), extension


def client() -> Connection:
    extension = PerMessageDeflate()
    extension.finalize("permessage-deflate")
    return Connection(ConnectionType.CLIENT, [extension])


def feed(conn: Connection, data: bytes) -> list[Any]:
    conn.receive_data(data)
    return list(conn.events())


def bomb_frames(inflated: int, frame: int) -> list[bytes]:
    """An unfinished text message of `inflated` spaces, compressed, `frame` bytes of text per
    frame (each flushed, as a bomb sends them: wsproto's own client would hold them back in
    its compressor until the message ends)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    frames = []
    for i in range(inflated // frame):
        data = deflate.compress(b" " * frame) + deflate.flush(zlib.Z_SYNC_FLUSH)
        first = 0x40 | 0x1 if i == 0 else 0x0  # RSV1 and text, then continuations
        mask = os.urandom(4)
        size = len(data)
        head = bytes([first, 0x80 | 126]) + size.to_bytes(2, "big")
        if size < 126:
            head = bytes([first, 0x80 | size])
        elif size >= 65536:
            head = bytes([first, 0x80 | 127]) + size.to_bytes(8, "big")
        frames.append(head + mask + bytes(b ^ mask[j % 4] for j, b in enumerate(data)))
    return frames


def test_a_compressed_message_within_the_limit_is_delivered_and_leaves_the_budget() -> None:
    limits = InflateLimits(LIMIT, InflateBudget(2 * LIMIT))
    conn, _ = server(limits)
    sender = client()
    text = "x" * (LIMIT - 10) + "é"
    events = feed(conn, sender.send(TextMessage(data=text)))
    received = "".join(e.data for e in events if isinstance(e, Message))
    assert received == text and events[-1].message_finished
    assert limits.budget.used == 0
    # A second message on the same connection (context takeover) as well.
    events = feed(conn, sender.send(TextMessage(data="hello")))
    assert [e.data for e in events] == ["hello"] and limits.budget.used == 0


def test_a_message_inflating_past_the_limit_fails_1009_at_the_limit() -> None:
    limits = InflateLimits(LIMIT, InflateBudget(100 * LIMIT))
    conn, extension = server(limits)
    delivered = 0
    closes: list[int] = []
    for data in bomb_frames(4 * LIMIT, frame=LIMIT // 2):
        for event in feed(conn, data):
            if isinstance(event, Message):
                delivered += len(event.data)
            elif isinstance(event, CloseConnection):
                closes.append(event.code)
        if closes:
            break
    assert closes == [1009]
    assert delivered <= LIMIT  # never more than the limit handed on
    assert extension.held == 0 and limits.budget.used <= LIMIT // 2  # (the last frame's)


def test_one_huge_frame_is_stopped_within_a_step_of_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole bomb in one frame: inflation stops at the limit, not after the frame."""
    inflated: list[int] = []
    original = zlib.decompressobj

    class Counting:
        def __init__(self, *args: Any) -> None:
            self._inner = original(*args)

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            out = self._inner.decompress(data, max_length)
            inflated.append(len(out))
            return out

        @property
        def unconsumed_tail(self) -> bytes:
            return self._inner.unconsumed_tail

    limits = InflateLimits(LIMIT, InflateBudget(100 * LIMIT))
    conn, _ = server(limits)
    payload = client().send(TextMessage(data=" " * (64 * LIMIT), message_finished=False))
    monkeypatch.setattr(zlib, "decompressobj", Counting)
    events = feed(conn, payload)
    assert [e.code for e in events if isinstance(e, CloseConnection)] == [1009]
    assert sum(inflated) <= LIMIT + INFLATE_STEP, sum(inflated)


def test_the_budget_refuses_new_inflation_with_1013_and_is_returned() -> None:
    budget = InflateBudget(3 * LIMIT)
    limits = InflateLimits(LIMIT, budget)
    pairs = [server(limits) for _ in range(6)]
    codes: list[int | None] = []
    for conn, _ in pairs:
        code = None
        for data in bomb_frames(LIMIT // 2, frame=LIMIT // 2):
            for event in feed(conn, data):
                if isinstance(event, CloseConnection):
                    code = event.code
        codes.append(code)
        assert budget.used <= budget.max_bytes
    # Each holds its half-limit message twice (the message, and wsproto's last frame): three
    # fit in a budget of three limits, the rest are refused.
    assert codes == [None, None, None, 1013, 1013, 1013], codes
    assert budget.refusals["inflate_budget"] == 3
    # The refused ones hold nothing once freed; the three others hold their messages.
    del pairs, conn
    gc.collect()
    assert budget.used == 3 * LIMIT


def test_a_closed_socket_returns_its_reservation_when_the_budget_runs_short() -> None:
    class Socket:
        def __init__(self) -> None:
            self.fd = 3

        def fileno(self) -> int:
            return self.fd

    budget = InflateBudget(LIMIT)
    limits = InflateLimits(LIMIT, budget)
    sock = Socket()
    extension = BoundedPerMessageDeflate(limits, socket=sock)
    assert budget.take(extension, LIMIT)
    other = BoundedPerMessageDeflate(limits)
    assert not budget.take(other, 1)
    sock.fd = -1  # closed
    assert budget.take(other, 1) and budget.used == 1


async def test_inflation_is_paced_server_wide_and_readers_take_turns(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Two connections each inflating a 4 MiB message 1 MiB per read at a 2 MiB/s pace:
    together they take 4 s of the (mock) clock, not 0, and alternate; a message within the
    burst allowance is not held back at all."""
    rate = 2 * 2**20
    pace = InflatePace(rate)
    limits = InflateLimits(LIMIT, InflateBudget(100 * LIMIT), pace)
    order: list[int] = []

    async def connection(number: int) -> None:
        conn, extension = server(limits)
        peer = client()
        frames = bomb_frames(LIMIT, 2**20)
        for frame in frames:
            await extension.pace()
            events = feed(conn, frame)
            assert not any(isinstance(e, CloseConnection) for e in events)
            order.append(number)
        del peer

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(connection, 0)
        nursery.start_soon(connection, 1)
    took = trio.current_time() - start
    # 8 MiB at 2 MiB/s, less the burst allowance and the last read (spent, not waited for).
    assert 2.5 <= took <= 4.0, took
    assert order[2:] in ([0, 1] * 3, [1, 0] * 3), order  # in turn, once the burst is spent
    assert pace.waited > 0

    small = InflatePace(rate)
    small.spent(rate // 16)  # within INFLATE_BURST (0.125 s) of the pace
    before = trio.current_time()
    await small.wait()
    assert trio.current_time() == before


async def test_the_body_clock_times_out_a_silent_body(autojump_clock: trio.abc.Clock) -> None:
    send, receive = trio.open_memory_channel[dict[str, Any]](10)
    timeouts: list[float] = []

    def timed_out() -> Exception:
        timeouts.append(trio.current_time())
        return TimeoutError("body")

    clock = BodyClock(receive.receive, timeout=30.0, min_rate=1000.0, on_timeout=timed_out)
    start = trio.current_time()
    with trio.fail_after(100):
        await send.send({"type": "http.request", "body": b"x" * 5000, "more_body": True})
        assert (await clock())["body"] == b"x" * 5000
        with pytest.raises(TimeoutError):
            await clock()
    # 30 s after the headers, plus 5 s for the 5,000 bytes received at 1,000 B/s.
    assert timeouts == [pytest.approx(start + 35.0)]


async def test_the_body_clock_lets_a_body_at_the_minimum_rate_through(
    autojump_clock: trio.abc.Clock,
) -> None:
    send, receive = trio.open_memory_channel[dict[str, Any]](0)
    clock = BodyClock(
        receive.receive, timeout=2.0, min_rate=1000.0, on_timeout=lambda: TimeoutError()
    )

    async def trickle() -> None:
        for _ in range(100):  # 1,000 bytes a second for 100 s
            await trio.sleep(1.0)
            await send.send({"type": "http.request", "body": b"x" * 1000, "more_body": True})
        await send.send({"type": "http.request", "body": b"", "more_body": False})
        await trio.sleep(3600)  # a streamed response waits on http.disconnect this long
        await send.send({"type": "http.disconnect"})

    with trio.fail_after(5000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            received = 0
            while (message := await clock())["type"] == "http.request":
                received += len(message["body"])
                if not message["more_body"]:
                    break
            assert (await clock())["type"] == "http.disconnect"  # (no deadline past the body)
    assert received == 100_000


async def test_the_body_clock_ends_a_body_at_its_content_length(
    autojump_clock: trio.abc.Clock,
) -> None:
    """With the request's Content-Length, the message bringing its last byte ends the body
    (`more_body` false) and hypercorn's empty end message is passed over: the app reads a
    body that has arrived with one wait, and its next read is the disconnect, unbounded by
    the body's deadline. A body still short of its length, or without one, is as it came."""
    body = {"type": "http.request", "body": b"x" * 600, "more_body": True}
    end = {"type": "http.request", "body": b"", "more_body": False}
    disconnect = {"type": "http.disconnect"}

    async def read(length: int | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        send, receive = trio.open_memory_channel[dict[str, Any]](len(messages))
        for message in messages:
            send.send_nowait(message)
        clock = BodyClock(
            receive.receive,
            timeout=2.0,
            min_rate=1000.0,
            on_timeout=lambda: TimeoutError("body"),
            length=length,
        )
        got = []
        with trio.fail_after(5000):
            while not got or got[-1]["type"] == "http.request":
                got.append(await clock())
        return got

    whole = await read(1200, [body, body, end, disconnect])
    assert whole == [body, {**body, "more_body": False}, disconnect]
    assert await read(None, [body, body, end, disconnect]) == [body, body, end, disconnect]
    assert await read(1201, [body, body, end, disconnect]) == [body, body, end, disconnect]

    # Past the body, no deadline: the disconnect an hour later is still the next message.
    send, receive = trio.open_memory_channel[dict[str, Any]](4)
    clock = BodyClock(
        receive.receive,
        timeout=2.0,
        min_rate=1000.0,
        on_timeout=lambda: TimeoutError("body"),
        length=600,
    )
    send.send_nowait(body)
    send.send_nowait(end)
    with trio.fail_after(5000):
        assert (await clock())["more_body"] is False
        async with trio.open_nursery() as nursery:

            async def later() -> None:
                await trio.sleep(3600)
                await send.send(disconnect)

            nursery.start_soon(later)
            assert await clock() == disconnect


def test_a_requests_content_length_is_one_number_or_none() -> None:
    def scope(*values: bytes) -> list[tuple[bytes, bytes]]:
        return [(b"host", b"x"), *((b"Content-Length", v) for v in values)]

    assert content_length(scope(b"1200")) == 1200
    assert content_length(scope()) is None  # chunked
    assert content_length(scope(b"12", b"12")) is None
    assert content_length(scope(b"-1")) is None
    assert content_length(scope(b"1e3")) is None


def test_accept_errors_are_logged_once_per_interval_without_tracebacks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr(_http_limits.time, "monotonic", lambda: now[0])
    stats = _http_limits.TransportStats()
    log_filter = _http_limits._AcceptErrorFilter()
    log_filter.stats = stats
    logger = logging.getLogger("test.serve_listeners")
    logger.addFilter(log_filter)
    try:
        with caplog.at_level(logging.ERROR, logger="test.serve_listeners"):
            for _ in range(600):  # a minute of trio's 0.1 s retries
                try:
                    raise OSError(24, "Too many open files")
                except OSError:
                    logger.error("accept returned %s", "EMFILE", exc_info=True)
                now[0] += 0.1
    finally:
        logger.removeFilter(log_filter)
    lines = [r for r in caplog.records if r.name == "test.serve_listeners"]
    assert len(lines) == 6  # one per 10 s
    assert all(r.exc_info is None for r in lines)
    assert "EMFILE" in lines[0].getMessage() and "99 failed tries" in lines[1].getMessage()
    assert stats.refusals["descriptors"] == 600


def test_the_hypercorn_internals_the_patches_rely_on() -> None:
    """What `_http_limits` and `_ws_deflate` patch or call, by name and by what the code
    does there: an upgrade of hypercorn that moves it fails here, not silently."""
    import hypercorn.protocol as protocol_module
    import hypercorn.trio.run as run_module
    from hypercorn.protocol import h2, h11, ws_stream
    from hypercorn.trio import tcp_server

    assert "TCPServer" in inspect.getsource(run_module.worker_serve)
    assert "H11Protocol(" in inspect.getsource(protocol_module.ProtocolWrapper.__init__)
    assert "H2Protocol(" in inspect.getsource(protocol_module.ProtocolWrapper.__init__)
    assert "_check_protocol" in inspect.getsource(h11.H11Protocol._handle_events)
    assert "_send_error_response" in inspect.getsource(h11.H11Protocol._handle_events)
    assert "max_incomplete_event_size" in inspect.getsource(h11.H11Protocol.__init__)
    assert "send_eof" in inspect.getsource(tcp_server.TCPServer._close)
    assert "keep_alive_timeout" in inspect.getsource(tcp_server.TCPServer._idle_timeout)
    assert "stream_buffers" in inspect.getsource(h2.H2Protocol.__init__)
    assert "self.handshake.accept(" in inspect.getsource(ws_stream.WSStream._accept)
    assert "PerMessageDeflate()" in inspect.getsource(ws_stream.Handshake.accept)


def test_the_connection_cap_is_fitted_under_the_descriptor_limit() -> None:
    """In a process whose hard descriptor limit is 200, a cap of 2,048 becomes 200 - 64
    (the reserve), with a warning; under a roomy limit it stays, the soft limit raised."""
    code = (
        "import logging, resource, sys\n"
        "logging.basicConfig(stream=sys.stdout, format='%(message)s')\n"
        "from rollout.engine._http_limits import fit_connection_cap\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 200))\n"
        "print(fit_connection_cap(2048))\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "print(fit_connection_cap(50))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    lines = result.stdout.splitlines()
    assert "does not fit the descriptor limit" in lines[0], lines
    assert lines[1:] == ["136", "200", "50"], lines  # soft raised to the hard limit first


async def test_one_key_holds_its_share_of_http_requests_in_progress() -> None:
    """Of `max_tcp_connections` (8 here), one key's HTTP requests in progress (each holding a
    connection: a body that has not arrived, a response streaming) are at most its
    `key_connection_share` (half): the next gets 429 `too_many_requests_for_key` at once, while
    another key is still served; a request that ends gives its place back."""
    keys = ("key-one", "key-two")
    async with open_engine(store=MemoryResponseStore()) as engine:
        app = RolloutApp(
            engine,
            AppConfig(api_keys=keys, max_tcp_connections=8, key_connection_share=0.5),
        )
        release = trio.Event()
        body = {"type": "http.request", "body": b'{"model":"sim","input":"hi"}'}

        async def request(key: str, held: bool = False) -> tuple[int, Any]:
            sent: list[dict[str, Any]] = []
            done = trio.Event()
            inbox = [body]

            async def receive() -> dict[str, Any]:
                if inbox:
                    if held:
                        await release.wait()  # the body arrives when the test says
                    return inbox.pop()
                await done.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/responses",
                "query_string": b"",
                "client": ("127.0.0.1", 5000),
                "headers": [
                    (b"host", b"localhost"),
                    (b"content-type", b"application/json"),
                    (b"authorization", f"Bearer {key}".encode()),
                ],
            }
            await app(scope, receive, send)
            done.set()
            answer = b"".join(m.get("body", b"") for m in sent[1:])
            return sent[0]["status"], json.loads(answer)

        results: list[int] = []
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:

                async def hold() -> None:
                    results.append((await request(keys[0], held=True))[0])

                for _ in range(4):
                    nursery.start_soon(hold)
                await trio.testing.wait_all_tasks_blocked()
                status, answer = await request(keys[0])
                assert status == 429, answer
                assert answer["error"]["code"] == "too_many_requests_for_key"
                assert "4 HTTP requests in progress" in answer["error"]["message"]
                assert (await request(keys[1]))[0] == 200  # another key
                release.set()
            assert results == [200] * 4
            assert (await request(keys[0]))[0] == 200  # its places are back
        assert engine.counters.http_key_share_refusals == 1
