"""Where a response's events go: the `EventSink` a transport hands the engine once, at the top
of each response.

The engine pushes each event it builds into the sink (`send`) and never calls back up through
closures: the WebSocket lane's sink checks and encodes the event and queues the frame
(`_lanes.LaneSink`); the embedded API's is a trio memory channel (its `send` and `close` are
the Protocol's); a plain function becomes one through `CallbackSink` (the HTTP routes hand
their writer's). `close` is the owner's: it says that no response will send into the sink
again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from rollout.protocol import ResponseTracker, ServerEvent

__all__ = ["DISCARD", "CallbackSink", "Emit", "EventSink", "TrackedSink"]

Emit = Callable[[ServerEvent], Awaitable[None]]


class EventSink(Protocol):
    """What a response's events go into (see the module)."""

    def send(self, event: ServerEvent) -> Awaitable[None]:
        """Take one event, in order; may wait (backpressure)."""
        ...

    def close(self) -> None:
        """No response sends into this sink again."""
        ...


@runtime_checkable
class TrackedSink(EventSink, Protocol):
    """A sink that checks each event against the protocol's tracker on its way out (a
    WebSocket lane's): the response's builder drives that same tracker (`ResponseStream`'s
    `tracker`), so each event is checked once, where it is built."""

    @property
    def tracker(self) -> ResponseTracker | None:
        """The tracker of the sink's lane (None: none yet)."""
        ...


class CallbackSink:
    """A function as an `EventSink`: `send` is the function itself (no call in between)."""

    __slots__ = ("send",)

    def __init__(self, send: Emit) -> None:
        self.send = send

    def close(self) -> None:
        return None


async def _discard(_event: ServerEvent) -> None:
    return None


# A sink that drops every event (a create run for its final state alone).
DISCARD = CallbackSink(_discard)
