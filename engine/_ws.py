"""WebSocket mode: one connection's ASGI loop and its life (open, closing, closed, gone, cut),
its reader, its writer and its clock; its lanes, deliveries and outbox are rooms of their own.

Long because the connection's life has many ends, each with its own rule: a clean close, the
peer gone, a slow consumer or an unanswered ping cut off, the idle and age limits, shutdown.

The rules of the connection live in `rollout.protocol.ServerConnection` (sans-IO): it decodes
client messages, decides what a create or an append may do (admission, lanes, the queue, the
suspended rollout), says which create to answer next (`start_next`: the oldest waiting create
whose lane is free, while fewer than `max_in_flight` responses run), and encodes every event
after checking it against its lane's response grammar. This wrapper is thin and mechanical
(after trio-websocket): a reader task feeds frames to it and either queues a
`response.create` or hands a `response.append`, `response.steer` or `response.inject` to the
response it names (`_deliveries.py`); each create the connection starts runs in a task of its
own (one per busy lane; a steered response's successor runs in the same task) through the
lanes (`_lanes.py`), which hand the session that lane's `EventSink`: each event goes down
from the sampling loop through the protocol into the bounded outbox (`_outbox.py`), and a
writer task sends the frames in order from there, so the lanes' events interleave.
Request-scoped errors are answered with the nested `error` event (on the request's lane) and
never close the socket. A connection older than its age limit answers every create it starts
with `websocket_connection_limit_reached`, and closes cleanly (1000) once no response runs.

On a connection opened with the multi-agent beta (`OpenAI-Beta: responses_multi_agent=v1`), a
create with `multi_agent: {enabled: true}` runs as a rollout through the beta's door (the
`Rollout` handle with `multi_agent=True`), and the reader queues each `response.inject` the
connection lets through on that handle; the coroutine commits and acknowledges them on the
response's lane. An inject the response never took (it ended first) is answered
`response.inject.failed` (`response_already_completed`, its input returned) once the response
has ended.

Backpressure: the outbox holds at most `max_buffered_bytes` of encoded frames (a frame larger
than that is queued alone). A client that reads slower than the server writes pauses the
responses (their sampling waits on the outbox). One that stops reading is a slow consumer once
the outbox has had no room for `send_stall_limit` seconds, or a single write (a frame, a ping,
the close frame) has waited that long on the peer: its responses are cancelled (the usage of
what was sampled is recorded, once, as interrupted) and the connection is aborted, not closed:
hypercorn writes each frame shielded from cancellation and a close frame would wait behind the
stuck one, so the transport (`WebSocketTransport`, hypercorn's `rollout.transport` extension:
`_transport.py`) resets the TCP connection, which ends the blocked write and releases every
buffer of the connection. While it lasts, a stalled connection holds the outbox, the frame each
running response is waiting to queue (one per response in flight, `max_in_flight`), and the
frame being written (its text and its encoded bytes).

Liveness (one watchdog task per connection, `_watch`, on trio's clock):
- the server pings every `ping_interval` seconds; a ping unanswered (no pong) `ping_timeout`
  seconds after it was written aborts the connection (`ws_ping_timeouts`), and one that cannot
  be written for `send_stall_limit` is a stalled write as above: so a client that floods pings
  and never reads the pongs (hypercorn's reader waits on the pong it cannot write, and reads
  nothing more) is cut off within `ping_interval + send_stall_limit`;
- an idle connection (no response running or waiting, no client message) is closed (1000)
  after `idle_limit` seconds (`ws_idle_closes`);
- the age limit is enforced on the clock too: past it, the connection closes as soon as no
  response runs (`ws_age_closes`), after an unsolicited `websocket_connection_limit_reached`
  error (unless a create was just refused with it), without waiting for a create.
Without a transport (an ASGI server other than rollout's hypercorn) there are no pings and a
cut-off cannot abort: the responses are still cancelled and the frames dropped.

Events about a response from outside its stream (an ack of input sent to it) go out on that
response's lane, through that lane's sink (`Lanes.sink`).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs
import trio
from rollout.protocol import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_LANES,
    DEFAULT_MAX_MESSAGE_SIZE,
    DEFAULT_MAX_QUEUED_CREATES,
    ErrorBody,
    ErrorEvent,
    LocalProtocolError,
    RemoteProtocolError,
    ResponseCreate,
    ResponseInject,
    ResponseInjectFailed,
    ResponseSteer,
    ResponseSteerFailed,
    ServerConnection,
    ServerEvent,
)

from ._deliveries import Deliveries
from ._engine import Session, server_error
from ._lanes import Lanes
from ._outbox import DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_SEND_STALL_LIMIT, Outbox, SlowConsumer

__all__ = [
    "DEFAULT_CONNECTION_AGE_LIMIT",
    "DEFAULT_IDLE_LIMIT",
    "DEFAULT_MAX_BUFFERED_BYTES",
    "DEFAULT_MAX_QUEUED_CREATES",
    "DEFAULT_PING_INTERVAL",
    "DEFAULT_PING_TIMEOUT",
    "DEFAULT_SEND_STALL_LIMIT",
    "SlowConsumer",
    "WebSocketConnection",
    "WebSocketLimits",
    "WebSocketTransport",
]

log = logging.getLogger("rollout.ws")

# The OpenAI API closes WebSocket-mode connections after 60 minutes.
DEFAULT_CONNECTION_AGE_LIMIT = 3600.0
# How long a connection may stay idle (no response running or waiting, no client message)
# before it is closed: as long as a suspended rollout waits for its tool outputs
# (`DEFAULT_ROLLOUT_SUSPEND_LIMIT`), so a conversation quiet longer than a tool call may take
# is over; a client that comes back reconnects (the OpenAI API closes every connection after
# an hour anyway).
DEFAULT_IDLE_LIMIT = 600.0
# How often the server pings a WebSocket, and how long it waits for the pong (the `websockets`
# library's defaults, which the openai SDK's client uses the other way): a peer gone without a
# FIN (a dead network path, a suspended laptop) is found within 40 s, at one ~6-byte frame per
# connection every 20 s.
DEFAULT_PING_INTERVAL = 20.0
DEFAULT_PING_TIMEOUT = 20.0

_PING = "rollout.ping"  # an outbox entry: the writer pings through the transport

ASGISend = Callable[[dict[str, Any]], Awaitable[None]]
ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]


@attrs.frozen(kw_only=True)
class WebSocketLimits:
    """The limits of one WebSocket connection, declared once (`ServerConfig.websocket_limits`,
    `rollout serve`'s flags); each default's reason is beside its constant. The largest
    message is the server's (`max_message_size`), for HTTP bodies too."""

    connection_age_limit: float = DEFAULT_CONNECTION_AGE_LIMIT
    max_queued_creates: int = DEFAULT_MAX_QUEUED_CREATES
    max_lanes: int = DEFAULT_MAX_LANES
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    send_stall_limit: float = DEFAULT_SEND_STALL_LIMIT
    idle_limit: float = DEFAULT_IDLE_LIMIT
    ping_interval: float = DEFAULT_PING_INTERVAL  # inf: no pings
    ping_timeout: float = DEFAULT_PING_TIMEOUT


class WebSocketTransport(Protocol):
    """What the server under the app offers a WebSocket beyond ASGI messages (rollout's
    hypercorn: `_transport.HypercornTransport`)."""

    def abort(self) -> bool:
        """Reset the TCP connection now, ending any write blocked on it (the app then gets
        `websocket.disconnect`); False if it could not."""
        ...

    async def ping(self, payload: bytes) -> bool:
        """Write a ping frame; False if the WebSocket is closing (nothing was sent)."""
        ...

    def watch_pongs(self, on_pong: Callable[[bytes], None]) -> bool:
        """Call `on_pong(payload)` at each pong from the peer; False if it cannot."""
        ...


class _Life(enum.IntEnum):
    """Where a connection is in its life; it only moves forward (`_become`)."""

    OPEN = 0  # answering
    CLOSING = 1  # a close frame is queued behind the frames ahead of it
    CLOSED = 2  # answering is over: the writer ends once it has written what is queued
    GONE = 3  # the peer closed or went away: nothing more is written
    CUT = 4  # cut off (stalled, or a ping unanswered): responses cancelled, TCP aborted


def _error(message: str, *, code: str, param: str | None = None, status: int = 400) -> ErrorEvent:
    return ErrorEvent(status=status, error=ErrorBody(code=code, message=message, param=param))


class WebSocketConnection:
    def __init__(
        self,
        session: Session,
        send: ASGISend,
        receive: ASGIReceive,
        *,
        limits: WebSocketLimits,
        timing: bool = False,
        shutting_down: trio.Event | None = None,
        betas: frozenset[str] = frozenset(),
        transport: WebSocketTransport | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        self.session = session
        self._send = send
        self._receive = receive
        self.limits = limits
        self.timing = timing
        self._outbox = Outbox(
            max_buffered_bytes=limits.max_buffered_bytes,
            send_stall_limit=limits.send_stall_limit,
            on_stall=self._slow_consumer,
        )
        self._life = _Life.OPEN
        self._tasks = trio.CancelScope()  # the reader, the responses and the shutdown watcher
        self._responses: trio.Nursery | None = None  # where each started create runs
        self._opened_at = trio.current_time()
        self._expired = False  # past the age limit: creates are refused, then it closes
        self._age_told = False  # a create was refused for the age (no farewell error then)
        self._transport = transport
        # The watchdog (`_watch`): when it wakes next, and how to wake it earlier.
        self._wake_at = math.inf
        self._poke = trio.Event()
        self._watching = trio.CancelScope()
        self._write_started: float | None = None  # when the write in progress began
        self._heard_at = self._opened_at  # the last client message
        self._idle_since = self._opened_at
        self._ping_due = self._opened_at + limits.ping_interval
        self._pinging = False  # a ping is queued or waits for its pong
        self._ping_payload: bytes | None = None  # the ping written, awaiting its pong
        self._ping_written_at = math.inf
        self._pings = 0
        self._serving = False  # the responses' nursery is open
        self.protocol = ServerConnection(
            max_message_size=max_message_size,
            max_queued_creates=limits.max_queued_creates,
            max_lanes=limits.max_lanes,
            max_in_flight=limits.max_in_flight,
            betas=betas,
        )
        self.lanes = Lanes(session, self.protocol, self._outbox, timing=timing)
        self._deliveries = Deliveries(self.lanes)
        self._shutting_down = shutting_down if shutting_down is not None else trio.Event()
        self._idle = trio.Event()  # set while no response runs and none is queued
        self._idle.set()
        self.frames_in = 0
        self.frames_out = 0

    @property
    def cut_off(self) -> bool:
        """Whether the peer was cut off (stalled, or a ping unanswered)."""
        return self._life is _Life.CUT

    def _become(self, life: _Life) -> bool:
        """Move the connection on to `life` (never back); False if it was there already or
        past it. The outbox follows: closed, it ends the writer after what is queued; gone or
        cut, at once."""
        if life <= self._life:
            return False
        self._life = life
        if life is _Life.CLOSED:
            self._outbox.stop()
        elif life > _Life.CLOSED:
            self._outbox.stop(drop=True)
        return True

    # --- output ---
    async def send_event(self, event: ServerEvent, *, stream_id: str | None = None) -> None:
        """Queue a frame (in order), on lane `stream_id` (None: the lane the event names).
        Waits while the outbox is full; raises `SlowConsumer` when it stays full for the
        stall limit, `ClosedResourceError` once closed."""
        await self.lanes.sink(stream_id).send(event)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        """Close after the frames already queued (not for a slow consumer: see `_cut_off`)."""
        self._queue_close(code, reason)

    def _queue_close(self, code: int, reason: str | None = None) -> None:
        """Queue the close frame after the frames already queued (it takes no room: if those
        cannot be written, the stalled write cuts the connection off)."""
        if self._life is _Life.OPEN:
            self._life = _Life.CLOSING
            message: dict[str, Any] = {"type": "websocket.close", "code": code}
            if reason is not None:
                message["reason"] = reason
            self._outbox.put_control(message, last=True)

    def _slow_consumer(self) -> None:
        if self._life is not _Life.CUT:
            self.session.engine.counters.slow_consumers += 1
            log.warning(
                "a WebSocket client stopped reading (%d bytes waiting for %g s): cutting it off",
                self._outbox.buffered,
                self.limits.send_stall_limit,
            )
        self._cut_off()

    def _cut_off(self) -> None:
        """Stop serving a peer that cannot be written to or does not answer: cancel the
        responses (their usage is recorded as interrupted), drop the queued frames, and abort
        the TCP connection (ending the write blocked on it, releasing its buffers)."""
        if not self._become(_Life.CUT):
            return
        self._tasks.cancel()
        if self._transport is not None and self._transport.abort():
            self.session.engine.counters.ws_aborts += 1

    async def _writer(self) -> None:
        """Send queued frames in order; a close frame ends the writing. Each write is timed
        (`_write_started`): the watchdog cuts off a peer that holds one past the stall limit."""
        stall = self.limits.send_stall_limit
        while True:
            taken = await self._outbox.get()
            if taken is None:  # closed and written, or the peer is gone
                return
            message, size = taken
            self._write_started = started = trio.current_time()
            if started + stall < self._wake_at:
                self._poke.set()
            try:
                if message["type"] == _PING:
                    await self._write_ping()
                else:
                    await self._send(message)
            except Exception:  # the transport failed under us: the connection is over
                log.info("sending a WebSocket frame failed; closing", exc_info=True)
                self._become(_Life.CLOSED)
                self._tasks.cancel()
                return
            finally:
                self._write_started = None
                self._outbox.written(size)
            if message["type"] == "websocket.close":
                self._become(_Life.CLOSED)
                self._tasks.cancel()
                return
            if message["type"] != _PING:
                self.frames_out += 1

    async def _write_ping(self) -> None:
        assert self._transport is not None  # (only queued with one)
        self._pings += 1
        self._ping_payload = payload = b"%d" % self._pings  # (its pong may come at once)
        if not await self._transport.ping(payload):  # closing: no ping went out
            self._ping_payload = None
            self._pinging = False
        elif self._ping_payload is not None:  # written; the pong is awaited from now
            self._ping_written_at = now = trio.current_time()
            if now + self.limits.ping_timeout < self._wake_at:
                self._poke.set()

    def _pong(self, payload: bytes) -> None:
        """The peer answered a ping (only the last one's pong counts)."""
        if self._ping_payload is not None and payload == self._ping_payload:
            self._ping_payload = None
            self._ping_written_at = math.inf
            self._pinging = False
            self._ping_due = trio.current_time() + self.limits.ping_interval

    # --- the clock ---
    async def _watch(self) -> None:
        """The connection's clock, until the writer is done: a write held past the stall
        limit or a ping unanswered past the ping timeout cuts the peer off; a ping is queued
        every ping interval; an idle connection is closed past the idle limit, an old one once
        idle past the age limit. Sleeps until the next of those deadlines (the writer and the
        dispatcher wake it when they bring one closer)."""
        limits = self.limits
        with self._watching:
            while True:
                now = trio.current_time()
                wake = math.inf
                started = self._write_started
                if started is not None:
                    if now >= started + limits.send_stall_limit:
                        self._slow_consumer()
                        return
                    wake = started + limits.send_stall_limit
                if self._ping_payload is not None:
                    if now >= self._ping_written_at + limits.ping_timeout:
                        self.session.engine.counters.ws_ping_timeouts += 1
                        log.info(
                            "a WebSocket client did not answer a ping in %g s: cutting it off",
                            limits.ping_timeout,
                        )
                        self._cut_off()
                        return
                    wake = min(wake, self._ping_written_at + limits.ping_timeout)
                if self._life is _Life.OPEN:
                    wake = min(wake, self._tick(now))
                self._wake_at = wake
                with trio.move_on_at(wake):
                    await self._poke.wait()
                self._poke = trio.Event()

    def _tick(self, now: float) -> float:
        """The open connection's deadlines at `now`: queue the ping that is due, close when
        idle past the idle limit, expire past the age limit; the next deadline."""
        limits = self.limits
        wake = math.inf
        if self._idle.is_set():
            idle_until = max(self._heard_at, self._idle_since) + limits.idle_limit
            if now >= idle_until:
                self.session.engine.counters.ws_idle_closes += 1
                self._queue_close(1000, f"idle for {limits.idle_limit:g} s")
                return wake
            wake = idle_until
        if not self._expired:
            expires = self._opened_at + limits.connection_age_limit
            if now >= expires:
                self._past_age_limit()
            else:
                wake = min(wake, expires)
        if self._transport is not None and not self._pinging:
            if now >= self._ping_due:
                self._pinging = True
                self._outbox.put_control({"type": _PING})
            else:
                wake = min(wake, self._ping_due)
        return wake

    # --- the tasks ---
    async def run(self) -> None:
        if self._transport is not None and not self._transport.watch_pongs(self._pong):
            self._transport = None  # (no pongs to hear: no pings)
        if not math.isfinite(self.limits.ping_interval):
            self._pinging = True  # (never due)
        async with trio.open_nursery() as outer:
            outer.start_soon(self._watch)
            outer.start_soon(self._write_then_stop_watching)
            try:
                with self._tasks:
                    async with trio.open_nursery() as nursery:
                        self._responses = nursery
                        self._serving = True
                        nursery.start_soon(self._watch_shutdown)
                        try:
                            await self._reader()
                        finally:
                            self._serving = False
                            nursery.cancel_scope.cancel()
            finally:
                # The reader is done (disconnect, close, slow consumer): stop the writer once
                # it has sent what is queued (a frame it is sending finishes or fails alone).
                self._become(_Life.CLOSED)

    async def _write_then_stop_watching(self) -> None:
        try:
            await self._writer()
        finally:
            self._watching.cancel()

    async def _watch_shutdown(self) -> None:
        """On server shutdown: close once the running responses (if any) have finished."""
        await self._shutting_down.wait()
        await self._close_when_idle(1001)

    async def _close_when_idle(self, code: int, farewell: ErrorEvent | None = None) -> None:
        """Close once no response runs, after `farewell` (an error saying why) if given."""
        while not self._idle.is_set():
            await self._idle.wait()
        if farewell is not None and not self._age_told:
            try:
                await self.send_event(farewell)
            except trio.ClosedResourceError:
                return
        await self.close(code)

    def _age_error(self) -> ErrorEvent:
        return _error(
            f"This connection is older than its limit of "
            f"{self.limits.connection_age_limit:g} seconds; open a new WebSocket "
            "connection to continue.",
            code="websocket_connection_limit_reached",
        )

    async def _reader(self) -> None:
        while True:
            message = await self._receive()
            kind = message["type"]
            if kind == "websocket.disconnect":
                self._become(_Life.GONE)
                return
            if kind != "websocket.receive":
                continue
            self.frames_in += 1
            self._heard_at = trio.current_time()
            try:
                await self._receive_frame(message)
            except trio.ClosedResourceError:
                return  # closing: nothing more can be answered

    async def _receive_frame(self, message: dict[str, Any]) -> None:
        """Act on one client frame: queue a create (and start what may start), deliver an
        append, or answer with an error."""
        data = message.get("text")
        if data is None:
            data = message.get("bytes") or b""
        timings: dict[str, float] = {}
        try:
            decoded = await self.session.engine.decode_create(
                self.protocol.decode,
                data,
                owner=self.session.owner,
                kind="event",
                max_size=self.protocol.max_message_size,
                timings=timings,
            )
        except RemoteProtocolError as exc:
            await self._answer_error(exc)
            return
        except Exception:  # a bug in the decoder: this frame fails, the socket lives
            log.exception("decoding a WebSocket frame failed unexpectedly")
            await self._answer_error(server_error())
            return
        for event in self.protocol.receive_event(decoded):
            if isinstance(event, ErrorEvent):
                if event.error.code != "too_many_queued_requests":  # (a 429 is not one)
                    self.session.engine.counters.request_errors += 1
                await self.send_event(event)
            elif isinstance(event, ResponseSteerFailed):  # refused by the connection
                await self.send_event(event)
            elif isinstance(event, ResponseInjectFailed):
                await self.send_event(event)  # on the lane the failure names
            elif isinstance(event, ResponseInject):
                await self._deliveries.inject(event)
            elif isinstance(event, ResponseCreate):
                self.lanes.hold(event, timings)
                self._dispatch()
            elif isinstance(event, ResponseSteer):
                await self._deliveries.steer(event)
            else:
                await self._deliveries.append(event, timings)

    async def _answer_error(self, exc: RemoteProtocolError) -> None:
        await self.lanes.sink(None).answer(exc)

    # --- the lanes ---
    def _dispatch(self) -> None:
        """Start every create the connection lets run now, each in a task of its own."""
        assert self._responses is not None
        try:
            while (request := self.protocol.start_next()) is not None:
                timings = self.lanes.timings_of(request)
                self._responses.start_soon(self._respond, request, timings)
        except LocalProtocolError:  # a bug of ours broke the protocol: the connection is over
            log.exception("a WebSocket connection broke the protocol; closing it")
            self._become(_Life.CLOSED)
            self._tasks.cancel()
            return
        if self.protocol.queued or self.protocol.in_flight:
            if self._idle.is_set():
                self._idle = trio.Event()
        elif not self._idle.is_set():
            self._idle.set()
            self._idle_since = now = trio.current_time()
            if now + self.limits.idle_limit < self._wake_at:
                self._poke.set()

    async def _respond(self, request: ResponseCreate, timings: dict[str, float]) -> None:
        """Answer one started create, on its lane; then let the next creates start."""
        lane = request.stream_id
        try:
            if self._past_age_limit():
                self._age_told = True
                await self.lanes.sink(lane).refuse(self._age_error())
                return
            await self.lanes.run(request, timings)
        except trio.ClosedResourceError:
            # The client closed the socket while this request was answered: `send_event` can
            # see it closed after taking its lock (a shielded checkpoint, so before the
            # reader's cancellation reaches us). The connection is over; not an error.
            return
        finally:
            if self._life < _Life.CLOSED:
                self._dispatch()

    def _past_age_limit(self) -> bool:
        """Whether the connection is past its age limit (from then on it refuses every create
        and closes once no response runs)."""
        limit = self.limits.connection_age_limit
        if not self._expired and math.isfinite(limit):
            if trio.current_time() - self._opened_at >= limit:
                self._expired = True
                self.session.engine.counters.ws_age_closes += 1
                if self._serving:  # (else the connection is ending anyway)
                    assert self._responses is not None
                    # (the error first, unsolicited: the client learns why, as a create would)
                    self._responses.start_soon(self._close_when_idle, 1000, self._age_error())
        return self._expired
