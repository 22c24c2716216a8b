"""WebSocket mode: one connection, one Session, requests run one at a time in FIFO order.

The rules of the connection live in `rollout.protocol.ServerConnection` (sans-IO): it decodes
client messages, decides what a create or an append may do (queue, lanes, the suspended
rollout), and encodes every event after checking it against the response grammar. This
wrapper is thin and mechanical (after trio-websocket): a reader task feeds frames to it and
either queues a `response.create` or delivers a `response.append` to the rollout; a runner
task takes creates off the queue and runs them through the session; a writer task sends the
frames in order from a bounded outbox. Request-scoped errors are answered with the nested
`error` event and never close the socket. A connection older than its age limit answers its
next create with `websocket_connection_limit_reached` and then closes cleanly (1000).

Backpressure: the outbox holds at most `max_buffered_bytes` of encoded frames. A client that
reads slower than the server writes pauses the response (its sampling waits on the outbox);
one that stops reading for `send_stall_limit` seconds is a slow consumer: its response is
cancelled (the usage of what was sampled is recorded) and the connection is torn down. What
then stays pinned is one frame and the kernel's socket buffer: hypercorn writes each frame
shielded from cancellation, so a frame already handed to it waits for the peer or for TCP.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio
from rollout.protocol import (
    DEFAULT_MAX_MESSAGE_SIZE,
    DEFAULT_MAX_QUEUED_CREATES,
    ErrorBody,
    ErrorEvent,
    Phase,
    RemoteProtocolError,
    ResponseAppend,
    ResponseCreate,
    ServerConnection,
    ServerEvent,
)

from ._engine import Rollout, Session, server_error

__all__ = [
    "DEFAULT_CONNECTION_AGE_LIMIT",
    "DEFAULT_MAX_QUEUED_CREATES",
    "WebSocketConnection",
    "WebSocketLimits",
]

log = logging.getLogger("rollout.ws")

# The OpenAI API closes WebSocket-mode connections after 60 minutes.
DEFAULT_CONNECTION_AGE_LIMIT = 3600.0
# Encoded frames a connection may hold for a client that reads slower than the server writes:
# enough for thousands of deltas or a large response.completed, small enough that a thousand
# such clients cost a few GB at most.
DEFAULT_MAX_BUFFERED_BYTES = 4 * 1024 * 1024
# How long a response may stay paused on a full outbox before the client is taken for one that
# has stopped reading.
DEFAULT_SEND_STALL_LIMIT = 30.0

ASGISend = Callable[[dict[str, Any]], Awaitable[None]]
ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]


@attrs.frozen(kw_only=True)
class WebSocketLimits:
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    connection_age_limit: float = DEFAULT_CONNECTION_AGE_LIMIT
    max_queued_creates: int = DEFAULT_MAX_QUEUED_CREATES
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    send_stall_limit: float = DEFAULT_SEND_STALL_LIMIT


class SlowConsumer(trio.ClosedResourceError):
    """The client stopped reading: the connection is being torn down."""


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
    ) -> None:
        self.session = session
        self._send = send
        self._receive = receive
        self.limits = limits
        self.timing = timing
        self._outbox: collections.deque[tuple[dict[str, Any], int]] = collections.deque()
        self._buffered = 0  # bytes of text in the outbox (and the frame being sent)
        self._queued = trio.Event()  # the writer has something to send
        self._drained = trio.Event()  # the writer sent a frame (room in the outbox)
        self._tasks = trio.CancelScope()  # the reader, the runner and the shutdown watcher
        self._closing = False  # a close frame is queued
        self._disconnected = False  # the peer closed or went away
        self._opened_at = trio.current_time()
        # The connection bounds the queue (the creates waiting behind the running one, and
        # between responses one more that starts at once): the channel never fills.
        self._queue_send, self._queue_recv = trio.open_memory_channel[
            tuple[ResponseCreate, dict[str, float]]
        ](limits.max_queued_creates + 1)
        self._rollout: Rollout | None = None
        self.protocol = ServerConnection(
            max_message_size=limits.max_message_size, max_queued_creates=limits.max_queued_creates
        )
        self._closed = False
        self._shutting_down = shutting_down if shutting_down is not None else trio.Event()
        self._idle = trio.Event()  # set while no request runs and none is queued
        self._idle.set()
        self.frames_in = 0
        self.frames_out = 0

    # --- output ---
    async def send_event(self, event: ServerEvent | dict[str, Any]) -> None:
        """Queue a frame (in order). Waits while the outbox is full; raises `SlowConsumer`
        when it stays full for the stall limit, `ClosedResourceError` once closed."""
        if isinstance(event, dict):  # an extension frame outside the grammar (`rollout.timing`)
            text, suspension = _dumps(event), False
        else:
            # A rollout's suspension events: its response.done and the response.in_progress
            # that resumes it (counted apart: they must not grow with the rollout, RX-2.5).
            suspension = event.type == "response.done" or (
                event.type == "response.in_progress" and self.protocol.phase is Phase.SUSPENDED
            )
            text = self.protocol.send(event)
        self.session.engine.counters.ws_frame_encoded(text, suspension=suspension)
        await self._enqueue({"type": "websocket.send", "text": text}, len(text))

    async def close(self, code: int = 1000) -> None:
        """Close after the frames already queued (not for a slow consumer: see `_stalled`)."""
        if not self._closing and not self._closed:
            self._closing = True
            await self._enqueue({"type": "websocket.close", "code": code}, 0, closing=True)

    async def _enqueue(self, message: dict[str, Any], size: int, *, closing: bool = False) -> None:
        if self._closed or (self._closing and not closing):
            raise trio.ClosedResourceError("the WebSocket is closed")
        limit = self.limits.max_buffered_bytes
        if self._buffered and self._buffered + size > limit:
            with trio.move_on_after(self.limits.send_stall_limit) as waited:
                while self._buffered and self._buffered + size > limit:
                    await self._drained.wait()
                    if self._closed:
                        raise trio.ClosedResourceError("the WebSocket is closed")
            if waited.cancelled_caught:
                self._stalled()
        self._outbox.append((message, size))
        self._buffered += size
        self._queued.set()

    def _stalled(self) -> None:
        """The client has not read for the stall limit: tear the connection down."""
        self.session.engine.counters.slow_consumers += 1
        log.warning(
            "a WebSocket client stopped reading (%d bytes waiting for %g s): closing it",
            self._buffered,
            self.limits.send_stall_limit,
        )
        self._closed = True
        self._outbox.clear()
        self._queued.set()
        self._tasks.cancel()
        raise SlowConsumer("the client stopped reading")

    async def _writer(self) -> None:
        """Send queued frames in order; a close frame ends the writing."""
        while True:
            while not self._outbox:
                if self._closed or self._disconnected:
                    return
                self._queued = trio.Event()
                await self._queued.wait()
            if self._disconnected:  # the peer is gone: nothing more can be delivered
                return
            message, size = self._outbox.popleft()
            try:
                await self._send(message)
            except Exception:  # the transport failed under us: the connection is over
                log.info("sending a WebSocket frame failed; closing", exc_info=True)
                self._closed = True
                self._tasks.cancel()
                return
            finally:
                self._buffered -= size
                self._drained.set()
                self._drained = trio.Event()
            if message["type"] == "websocket.close":
                self._closed = True
                self._tasks.cancel()
                return
            self.frames_out += 1

    # --- the tasks ---
    async def run(self) -> None:
        async with trio.open_nursery() as outer:
            outer.start_soon(self._writer)
            try:
                with self._tasks:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._runner, nursery.cancel_scope)
                        nursery.start_soon(self._watch_shutdown)
                        try:
                            await self._reader()
                        finally:
                            nursery.cancel_scope.cancel()
            finally:
                # The reader is done (disconnect, close, slow consumer): stop the writer once
                # it has sent what is queued (a frame it is sending finishes or fails alone).
                self._closed = True
                self._queued.set()

    async def _watch_shutdown(self) -> None:
        """On server shutdown: close once the running request (if any) has finished."""
        await self._shutting_down.wait()
        await self._idle.wait()
        await self.close(1001)

    async def _reader(self) -> None:
        while True:
            message = await self._receive()
            kind = message["type"]
            if kind == "websocket.disconnect":
                self._closed = self._disconnected = True
                self._queued.set()
                return
            if kind != "websocket.receive":
                continue
            self.frames_in += 1
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            timings: dict[str, float] = {}
            try:
                decoded = await self.session.engine.decode(self.protocol.decode, data, timings)
            except RemoteProtocolError as exc:
                await self._answer_error(exc)
                continue
            except Exception:  # a bug in the decoder: this frame fails, the socket lives
                log.exception("decoding a WebSocket frame failed unexpectedly")
                await self._answer_error(server_error())
                continue
            for event in self.protocol.receive_event(decoded):
                if isinstance(event, ErrorEvent):
                    if event.error.code != "too_many_queued_requests":  # (a 429 is not one)
                        self.session.engine.counters.request_errors += 1
                    await self.send_event(event)
                elif isinstance(event, ResponseCreate):
                    try:
                        self._queue_send.send_nowait((event, timings))
                        if self._idle.is_set():
                            self._idle = trio.Event()
                    except trio.ClosedResourceError:
                        return
                else:
                    await self._append(event, timings)

    async def _answer_error(self, exc: RemoteProtocolError) -> None:
        self.session.engine.counters.request_errors += 1
        await self.send_event(exc.error_event())

    async def _append(self, event: ResponseAppend, timings: dict[str, float]) -> None:
        """Deliver an append the connection let through (to its suspended rollout); the
        rollout checks the items (pending call ids, item kinds). `timings`: its decode's,
        reported with the resumed turn's stages."""
        try:
            if self._rollout is None:  # the rollout ended as the append arrived
                raise RemoteProtocolError.invalid(
                    "The rollout is not suspended: append tool outputs after response.done.",
                    code="rollout_not_suspended",
                    param="response_id",
                )
            self._rollout.append(event.input)
            for stage, seconds in timings.items():
                self._rollout.timings[stage] = self._rollout.timings.get(stage, 0.0) + seconds
        except RemoteProtocolError as exc:
            await self._answer_error(exc)
        except Exception:  # a bug: this append fails, the rollout and the socket live on
            log.exception("response.append failed unexpectedly")
            await self._answer_error(server_error())

    async def _runner(self, cancel_scope: trio.CancelScope) -> None:
        limit = self.limits.connection_age_limit
        async for request, timings in self._queue_recv:
            age = trio.current_time() - self._opened_at
            self.protocol.start(request)
            if math.isfinite(limit) and age > limit:
                await self._refuse(
                    _error(
                        f"This connection is older than its limit of {limit:g} seconds; "
                        "open a new WebSocket connection to continue.",
                        code="websocket_connection_limit_reached",
                    )
                )
                await self.close(1000)
                self._queue_send.close()
                cancel_scope.cancel()
                return
            try:
                await self._run_one(request, timings)
            except trio.ClosedResourceError:
                # The client closed the socket while this request was answered: `send_event`
                # can see it closed after taking its lock (a shielded checkpoint, so before
                # the reader's cancellation reaches us). The connection is over; not an error.
                return
            finally:
                if not self._queue_recv.statistics().current_buffer_used:
                    self._idle.set()

    async def _run_one(self, request: ResponseCreate, timings: dict[str, float]) -> None:
        """Run one create (`timings`: its decode's)."""
        emit = self._emitter()
        try:
            if request.rollout:
                self._rollout = Rollout(self.session)
                await self.session.run_rollout(request, emit, self._rollout, timings=timings)
            else:
                await self.session.create(request, emit, timings=timings)
        except RemoteProtocolError as exc:
            self.session.engine.counters.request_errors += 1
            await self._refuse(exc)
        finally:
            self._rollout = None

    async def _refuse(self, error: RemoteProtocolError | ErrorEvent) -> None:
        """Answer the started create with a request error (the connection checks that no
        event of its response went out)."""
        text = self.protocol.refuse(error)
        self.session.engine.counters.ws_frame_encoded(text)
        await self._enqueue({"type": "websocket.send", "text": text}, len(text))

    def _emitter(self) -> Callable[[ServerEvent], Awaitable[None]]:
        if not self.timing:
            return self.send_event
        session = self.session

        async def emit(event: ServerEvent) -> None:
            await self.send_event(event)
            # After each response.in_progress: a create's, and each resumed rollout turn's.
            if event.type == "response.in_progress":
                await self.send_event(
                    {
                        "type": "rollout.timing",
                        "response_id": event.response.id,
                        "stages": {k: round(v, 9) for k, v in session.last_timings.items()},
                    }
                )

        return emit


def _dumps(obj: dict[str, Any]) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))
