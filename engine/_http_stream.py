"""Streaming HTTP responses: server-sent events, and work that ends when the client leaves.

`sse_event` / `sse_data` are the only places the server frames SSE, with the protocol's
sans-IO encoder. `EventStream` starts the response (200, headers)
with its first frame, so a request error found before any event still gets a JSON answer;
its `serve` runs a response with a writer beside it (the frames pass through a bounded
`Outbox`) and cancels both when the client disconnects. `run_until_disconnect` does the
latter for a response answered in one piece.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from rollout.protocol import RemoteProtocolError, ServerEvent, encode_sse, encode_sse_event

from ._asgi import Receive, Send
from ._counters import Counters
from ._outbox import DEFAULT_MAX_BUFFERED_BYTES, Outbox

__all__ = ["EventStream", "run_until_disconnect", "sse_data", "sse_event"]


def sse_event(event: ServerEvent) -> bytes:
    """One Responses API event as an SSE frame (`event:` its type, `data:` its JSON)."""
    return encode_sse_event(event)


def sse_data(data: bytes) -> bytes:
    """A data-only SSE frame (chat completions' chunks, errors and `[DONE]`)."""
    return encode_sse(data.decode())


class EventStream:
    """A server-sent-events response, started (status 200, headers) with its first frame.

    While `serve` runs a response's work, frames go through an `Outbox` to a writer task: the
    work queues a frame and goes on (to the model, typically) while the writer sends every
    frame queued since its last write as one body message, the headers with the first. So the
    events sent before sampling (`response.created`, `response.in_progress`) cost the work no
    socket write, and arrive in one. The outbox holds at most `max_buffered_bytes` of frames;
    past it the work waits for the writer (backpressure, as on a WebSocket). A client that
    stops reading is cut off by the HTTP write watch (`_transport.WriteWatch`): its writer's
    write is held, the connection is reset, and the disconnect cancels the work. Before and
    after `serve`, frames are written as they come."""

    def __init__(
        self,
        send: Send,
        extra_headers: Callable[[], list[tuple[bytes, bytes]]] | None = None,
        *,
        counters: Counters | None = None,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    ) -> None:
        self._send = send
        self._extra = extra_headers
        self._counters = counters  # counts the bytes of the frames sent (`sse_bytes_encoded`)
        self.max_buffered_bytes = max_buffered_bytes
        self.started = False  # a frame was given: an error can only cut the response now
        self._start: dict[str, Any] | None = None  # the response start, until it is sent
        self._outbox: Outbox | None = None  # while `serve` runs

    async def frame(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                *(self._extra() if self._extra else ()),
            ]
            self._start = {"type": "http.response.start", "status": 200, "headers": headers}
        if self._counters is not None:
            self._counters.sse_bytes_encoded += len(data)
        if self._outbox is not None:
            await self._outbox.put({"body": data}, len(data))
        else:
            await self._write(data)

    async def serve(self, receive: Receive, work: Awaitable[object]) -> RemoteProtocolError | None:
        """Run `work` with the writer beside it, until it ends (and what it queued is sent)
        or the client disconnects (which cancels both). Returns the request error it raised,
        if any."""
        error: RemoteProtocolError | None = None
        outbox = Outbox(
            max_buffered_bytes=self.max_buffered_bytes,
            send_stall_limit=math.inf,  # (the write watch cuts off a client that stops reading)
            on_stall=_never,
        )
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            nursery.start_soon(self._writer, outbox, done)
            self._outbox = outbox
            try:
                try:
                    await work
                except RemoteProtocolError as exc:
                    error = exc
                outbox.stop()
                await done.wait()
            finally:
                self._outbox = None
                nursery.cancel_scope.cancel()
        return error

    async def _writer(self, outbox: Outbox, done: trio.Event) -> None:
        """Send what is queued, all of it in one body message, until the outbox is stopped
        and empty."""
        while (taken := await outbox.get()) is not None:
            parts, size = [taken[0]["body"]], taken[1]
            while (more := outbox.get_nowait()) is not None:
                parts.append(more[0]["body"])
                size += more[1]
            try:
                await self._write(parts[0] if len(parts) == 1 else b"".join(parts))
            finally:
                outbox.written(size)
        done.set()

    async def _write(self, body: bytes) -> None:
        if self._start is not None:
            start, self._start = self._start, None
            await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def end(self) -> int:
        """Finish the body; 499 (nothing sent: the client went away) when never started."""
        if not self.started:
            return 499
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        return 200


def _never() -> None:
    """An outbox without a stall limit never calls it."""


async def run_until_disconnect(
    receive: Receive, work: Awaitable[object]
) -> RemoteProtocolError | None:
    """Run `work` until it ends or the client disconnects (which cancels it). Returns the
    request error it raised, if any."""
    error: RemoteProtocolError | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
        try:
            await work
        except RemoteProtocolError as exc:
            error = exc
        nursery.cancel_scope.cancel()
    return error


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
