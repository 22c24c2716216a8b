"""WebSocket mode: one connection, one Session, requests run one at a time in FIFO order.

The wrapper is thin and mechanical (after trio-websocket): a reader task decodes frames and
either queues a `response.create` or delivers a `response.append` to the rollout it names; a
runner task takes creates off the queue and runs them through the session; every frame goes
out under one lock. Request-scoped errors are answered with the nested `error` event and never
close the socket. A connection older than its age limit answers its next create with
`websocket_connection_limit_reached` and then closes cleanly (1000).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from protocol import (
    DEFAULT_MAX_MESSAGE_SIZE,
    ErrorBody,
    ErrorEvent,
    RemoteProtocolError,
    ResponseAppend,
    ResponseCreate,
    ServerEvent,
    decode_client_event,
    encode_json,
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
# Creates a client may queue behind the running one. Agents send one at a time; a few more
# allow pipelining, and the bound keeps a misbehaving client from queueing without limit.
DEFAULT_MAX_QUEUED_CREATES = 16

ASGISend = Callable[[dict[str, Any]], Awaitable[None]]
ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]


@attrs.frozen(kw_only=True)
class WebSocketLimits:
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    connection_age_limit: float = DEFAULT_CONNECTION_AGE_LIMIT
    max_queued_creates: int = DEFAULT_MAX_QUEUED_CREATES


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
        self._lock = trio.Lock()
        self._opened_at = trio.current_time()
        self._queue_send, self._queue_recv = trio.open_memory_channel[ResponseCreate](
            limits.max_queued_creates
        )
        self._rollout: Rollout | None = None
        self._closed = False
        self._shutting_down = shutting_down if shutting_down is not None else trio.Event()
        self._idle = trio.Event()  # set while no request runs and none is queued
        self._idle.set()
        self.frames_in = 0
        self.frames_out = 0

    # --- output ---
    async def send_event(self, event: ServerEvent | dict[str, Any]) -> None:
        text = encode_json(event) if not isinstance(event, dict) else _dumps(event)
        async with self._lock:
            if self._closed:
                raise trio.ClosedResourceError("the WebSocket is closed")
            await self._send({"type": "websocket.send", "text": text})
            self.frames_out += 1

    async def close(self, code: int = 1000) -> None:
        async with self._lock:
            if not self._closed:
                self._closed = True
                await self._send({"type": "websocket.close", "code": code})

    # --- the two tasks ---
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._runner, nursery.cancel_scope)
            nursery.start_soon(self._watch_shutdown)
            try:
                await self._reader()
            finally:
                nursery.cancel_scope.cancel()

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
                self._closed = True
                return
            if kind != "websocket.receive":
                continue
            self.frames_in += 1
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            try:
                event = await self.session.engine.decode(
                    functools.partial(decode_client_event, max_size=self.limits.max_message_size),
                    data,
                )
            except RemoteProtocolError as exc:
                await self._answer_error(exc)
                continue
            except Exception:  # a bug in the decoder: this frame fails, the socket lives
                log.exception("decoding a WebSocket frame failed unexpectedly")
                await self._answer_error(server_error())
                continue
            if isinstance(event, ResponseCreate) and event.stream_id is not None:
                await self._answer_error(
                    RemoteProtocolError.invalid(
                        "Lanes (stream_id) are not supported by this server: omit stream_id to "
                        "use the connection's single FIFO lane.",
                        code="unsupported_parameter",
                        param="stream_id",
                    )
                )
                continue
            if isinstance(event, ResponseCreate):
                try:
                    self._queue_send.send_nowait(event)
                    if self._idle.is_set():
                        self._idle = trio.Event()
                except trio.WouldBlock:
                    await self.send_event(
                        _error(
                            f"Too many queued requests on this connection (the limit is "
                            f"{self.limits.max_queued_creates}); wait for a response to finish.",
                            code="too_many_queued_requests",
                            status=429,
                        )
                    )
                except trio.ClosedResourceError:
                    return
            else:
                await self._append(event)

    async def _answer_error(self, exc: RemoteProtocolError) -> None:
        self.session.engine.counters.request_errors += 1
        await self.send_event(exc.error_event())

    async def _append(self, event: ResponseAppend) -> None:
        rollout = self._rollout
        try:
            if rollout is None or rollout.response_id != event.response_id:
                if event.response_id in self.session.cache:
                    raise RemoteProtocolError.invalid(
                        f"Response '{event.response_id}' has already completed.",
                        code="response_already_completed",
                        param="response_id",
                    )
                raise RemoteProtocolError.invalid(
                    f"No rollout with id '{event.response_id}' is running on this connection.",
                    code="rollout_not_found",
                    param="response_id",
                )
            rollout.append(event.input)
        except RemoteProtocolError as exc:
            await self._answer_error(exc)
        except Exception:  # a bug: this append fails, the rollout and the socket live on
            log.exception("response.append failed unexpectedly")
            await self._answer_error(server_error())

    async def _runner(self, cancel_scope: trio.CancelScope) -> None:
        limit = self.limits.connection_age_limit
        async for request in self._queue_recv:
            age = trio.current_time() - self._opened_at
            if math.isfinite(limit) and age > limit:
                await self.send_event(
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
                await self._run_one(request)
            except trio.ClosedResourceError:
                # The client closed the socket while this request was answered: `send_event`
                # can see it closed after taking its lock (a shielded checkpoint, so before
                # the reader's cancellation reaches us). The connection is over; not an error.
                return
            finally:
                if not self._queue_recv.statistics().current_buffer_used:
                    self._idle.set()

    async def _run_one(self, request: ResponseCreate) -> None:
        emit = self._emitter()
        try:
            if request.rollout:
                self._rollout = Rollout(self.session)
                await self.session.run_rollout(request, emit, self._rollout)
            else:
                await self.session.create(request, emit)
        except RemoteProtocolError as exc:
            await self._answer_error(exc)
        finally:
            self._rollout = None

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
