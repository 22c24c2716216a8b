"""The outbox of one connection: encoded frames waiting for its writer, bounded in bytes, with
a stall limit on the wait for room.

Backpressure lives here. `put` queues a frame (in order) and returns at once while the frames
held (those queued and the one being written) stay within `max_buffered_bytes`; past it, the
putter (a response's sampling) waits for the writer to make room. A frame larger than the
limit is queued alone. A putter that has waited `send_stall_limit` seconds for room means the
client stopped reading: the outbox calls `on_stall` (the connection cuts the client off, which
stops the outbox) and raises `SlowConsumer`. Control frames (a ping, the close frame) take no
room: they never wait.

The writer takes frames with `get` and reports each written with `written`; `stop` takes no
more frames and lets the writer finish (after what is queued, or at once with `drop=True`).
Nothing here touches a socket.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["DEFAULT_MAX_BUFFERED_BYTES", "DEFAULT_SEND_STALL_LIMIT", "Outbox", "SlowConsumer"]

# Encoded frames a connection may hold for a client that reads slower than the server writes:
# enough for thousands of deltas or a large response.completed, small enough that a thousand
# such clients cost a few GB at most.
DEFAULT_MAX_BUFFERED_BYTES = 4 * 1024 * 1024
# How long a response may stay paused on a full outbox, or one write wait on the peer, before
# the client is taken for one that has stopped reading.
DEFAULT_SEND_STALL_LIMIT = 30.0


class SlowConsumer(trio.ClosedResourceError):
    """The client stopped reading: the connection is being torn down."""


class Outbox:
    """Frames for one writer, in order; see the module."""

    def __init__(
        self,
        *,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        send_stall_limit: float = DEFAULT_SEND_STALL_LIMIT,
        on_stall: Callable[[], None],
    ) -> None:
        self.max_buffered_bytes = max_buffered_bytes
        self.send_stall_limit = send_stall_limit
        self._on_stall = on_stall
        self._frames: collections.deque[tuple[dict[str, Any], int]] = collections.deque()
        self.buffered = 0  # bytes of the frames queued and of the one being written
        self._queued = trio.Event()  # the writer has something to do
        self._drained = trio.Event()  # the writer wrote a frame (room in the outbox)
        self._sealed = False  # no more frames are taken
        self._stopped = False  # the writer ends once the queue is empty

    async def put(self, message: dict[str, Any], size: int) -> None:
        """Queue a frame of `size` bytes; waits while the outbox is full. Raises
        `SlowConsumer` when it stays full for the stall limit, `ClosedResourceError` once
        sealed."""
        if self._sealed:
            raise trio.ClosedResourceError("the WebSocket is closed")
        limit = self.max_buffered_bytes
        if self.buffered and self.buffered + size > limit:
            with trio.move_on_after(self.send_stall_limit) as waited:
                while self.buffered and self.buffered + size > limit:
                    await self._drained.wait()
                    if self._stopped:
                        raise trio.ClosedResourceError("the WebSocket is closed")
            if waited.cancelled_caught:
                self._on_stall()
                raise SlowConsumer("the client stopped reading")
        self._frames.append((message, size))
        self.buffered += size
        self._queued.set()

    def put_control(self, message: dict[str, Any], *, last: bool = False) -> None:
        """Queue a control frame (a ping; with `last`, the close frame, after which nothing
        more is taken). It takes no room: if what is ahead of it cannot be written, the
        stalled write cuts the connection off."""
        if last:
            self._sealed = True
        self._frames.append((message, 0))
        self._queued.set()

    def stop(self, *, drop: bool = False) -> None:
        """Take no more frames and let the writer end once the queue is empty (at once with
        `drop`: the frames queued are discarded); a putter waiting for room fails when the
        writer next makes room (the connection cancels the putters it stops for good)."""
        self._sealed = self._stopped = True
        if drop:
            self._frames.clear()
        self._queued.set()

    async def get(self) -> tuple[dict[str, Any], int] | None:
        """The next frame to write and its size; None once stopped and empty."""
        while not self._frames:
            if self._stopped:
                return None
            self._queued = trio.Event()
            await self._queued.wait()
        return self._frames.popleft()

    def get_nowait(self) -> tuple[dict[str, Any], int] | None:
        """The next frame if one is queued (a writer gathering frames into one write)."""
        return self._frames.popleft() if self._frames else None

    def written(self, size: int) -> None:
        """The frame taken last is written (or failed): its room is free."""
        self.buffered -= size
        self._drained.set()
        self._drained = trio.Event()
