"""Streaming HTTP responses: server-sent events, and work that ends when the client leaves.

`sse_event` / `sse_data` are the only places the server frames SSE, with the protocol's
sans-IO encoder. `EventStream` starts the response (200, headers)
with its first frame, so a request error found before any event still gets a JSON answer.
`run_until_disconnect` runs a response and cancels it when the client disconnects.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from rollout.protocol import RemoteProtocolError, ServerEvent, encode_sse, encode_sse_event

from ._asgi import Receive, Send
from ._counters import Counters

__all__ = ["EventStream", "run_until_disconnect", "sse_data", "sse_event"]


def sse_event(event: ServerEvent) -> bytes:
    """One Responses API event as an SSE frame (`event:` its type, `data:` its JSON)."""
    return encode_sse_event(event)


def sse_data(data: bytes) -> bytes:
    """A data-only SSE frame (chat completions' chunks, errors and `[DONE]`)."""
    return encode_sse(data.decode())


class EventStream:
    """A server-sent-events response, started (status 200, headers) with its first frame."""

    def __init__(
        self,
        send: Send,
        extra_headers: Callable[[], list[tuple[bytes, bytes]]] | None = None,
        *,
        counters: Counters | None = None,
    ) -> None:
        self._send = send
        self._extra = extra_headers
        self._counters = counters  # counts the bytes of the frames sent (`sse_bytes_encoded`)
        self.started = False

    async def frame(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                *(self._extra() if self._extra else ()),
            ]
            await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        if self._counters is not None:
            self._counters.sse_bytes_encoded += len(data)
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> int:
        """Finish the body; 499 (nothing sent: the client went away) when never started."""
        if not self.started:
            return 499
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        return 200


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
