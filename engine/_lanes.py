"""The lanes of one WebSocket connection: each create the connection starts runs on its lane,
and its events go down into that lane's `EventSink`.

`Lanes.run` answers one started create (`ServerConnection.start_next` chose it): a rollout (the
extension, or the multi-agent beta's door) gets its `Rollout` handle, registered on its lane
for the in-flight deliveries (`_deliveries.py`) while it runs; the session runs it into a
`LaneSink`; a request error refuses it on its lane (`ServerConnection.refuse`); injects the
response never took are answered `response_already_completed` once it has ended.

A `LaneSink` is the per-event path to the socket, one downward chain: the connection's
protocol encodes the event, the counters count the frame, the outbox queues it (and holds the
response there while the client reads slower than it samples: backpressure). Each event is
checked once, where it is built: the sink is a `TrackedSink` (`_sink.py`) whose `tracker`, its
lane's, the response's builder drives, so the protocol only checks that the events go out in
the order they were built. The lane stays busy until the last event built for it went out (a
terminal event built while its response commits holds the lane: `Lane.free`), so a response's
tracker passes to the next create, or to a steered successor, only with nothing unsent.

With timing frames on (`x-rollout-timing`), a `TimedLaneSink` follows each
`response.in_progress` (a create's, and each resumed rollout turn's) with a `rollout.timing`
frame: that turn's pre-inference stages.
"""

from __future__ import annotations

import json
from typing import Any

from rollout.protocol import (
    ErrorEvent,
    RemoteProtocolError,
    ResponseCreate,
    ResponseInProgress,
    ResponseRef,
    ResponseTracker,
    ServerConnection,
    ServerEvent,
    inject_failed,
    multi_agent_enabled,
)

from ._counters import Counters
from ._outbox import Outbox
from ._session import Session
from ._suspend import Rollout

__all__ = ["LaneSink", "Lanes", "TimedLaneSink"]


class LaneSink:
    """The `EventSink` of one lane of a connection (see the module)."""

    __slots__ = ("_counters", "_outbox", "_protocol", "lane")

    def __init__(
        self, protocol: ServerConnection, counters: Counters, outbox: Outbox, lane: str | None
    ) -> None:
        self._protocol = protocol
        self._counters = counters
        self._outbox = outbox
        self.lane = lane  # None: the default lane, or the lane the event itself names

    @property
    def tracker(self) -> ResponseTracker | None:
        """The tracker of this sink's lane, which the response's builder drives (`TrackedSink`):
        `send` then checks only that the events go out as they were built."""
        lane = self._protocol.lane(self.lane)
        return lane.tracker if lane is not None else None

    async def send(self, event: ServerEvent) -> None:
        """Check, encode, count and queue one event (waits while the outbox is full; raises
        `SlowConsumer` when it stays full for the stall limit, `ClosedResourceError` once the
        connection closed)."""
        # A rollout's suspension events: its response.done and the response.in_progress that
        # resumes it (counted apart: they must not grow with the rollout, RX-2.5). A resume
        # names its response (`ResponseRef`), a start carries it: told apart by the event
        # itself, not by the lane's phase (which the builder moved when it built the event).
        suspension = event.type == "response.done" or (
            isinstance(event, ResponseInProgress) and isinstance(event.response, ResponseRef)
        )
        text = self._protocol.send(event, stream_id=self.lane)
        self._counters.ws_frame_encoded(text, suspension=suspension)
        await self._outbox.put({"type": "websocket.send", "text": text}, len(text))

    async def send_frame(self, frame: dict[str, Any]) -> None:
        """Queue an extension frame outside the grammar (`rollout.timing`), on this lane."""
        lane = self.lane
        text = json.dumps(
            {**frame, "stream_id": lane} if lane is not None else frame, separators=(",", ":")
        )
        self._counters.ws_frame_encoded(text, suspension=False)
        await self._outbox.put({"type": "websocket.send", "text": text}, len(text))

    async def answer(self, error: RemoteProtocolError) -> None:
        """Answer a request error (counted) with the nested `error` event, on this lane."""
        self._counters.request_errors += 1
        await self.send(error.error_event())

    async def refuse(self, error: RemoteProtocolError | ErrorEvent) -> None:
        """Answer this lane's started create with a request error (the connection checks that
        no event of its response went out)."""
        text = self._protocol.refuse(error, stream_id=self.lane)
        self._counters.ws_frame_encoded(text)
        await self._outbox.put({"type": "websocket.send", "text": text}, len(text))

    def close(self) -> None:
        """The lane outlives its responses: nothing to release."""
        return None


class TimedLaneSink(LaneSink):
    """A lane's sink with timing frames: each `response.in_progress` is followed by a
    `rollout.timing` frame with the turn's pre-inference stages, the create's (`timings`,
    which pre-inference fills), then those of the appends that resumed it."""

    __slots__ = ("_rollout", "_timings", "_turns")

    def __init__(
        self,
        protocol: ServerConnection,
        counters: Counters,
        outbox: Outbox,
        lane: str | None,
        *,
        timings: dict[str, float],
        rollout: Rollout | None,
    ) -> None:
        super().__init__(protocol, counters, outbox, lane)
        self._timings = timings
        self._rollout = rollout
        self._turns = 0

    async def send(self, event: ServerEvent) -> None:
        await LaneSink.send(self, event)
        if event.type == "response.in_progress":
            rollout = self._rollout
            stages = rollout.timings if self._turns and rollout is not None else self._timings
            self._turns += 1
            await self.send_frame(
                {
                    "type": "rollout.timing",
                    "response_id": event.response.id,
                    "stages": {k: round(v, 9) for k, v in stages.items()},
                }
            )


class Lanes:
    """The responses running on a connection's lanes (see the module)."""

    def __init__(
        self, session: Session, protocol: ServerConnection, outbox: Outbox, *, timing: bool
    ) -> None:
        self.session = session
        self.protocol = protocol
        self.outbox = outbox
        self.timing = timing
        self.counters = session.engine.counters
        # The decode timings of each waiting create (by its id(); as many as the connection
        # lets wait), handed to its response when it starts.
        self._decode_timings: dict[int, dict[str, float]] = {}
        self._rollouts: dict[str | None, Rollout] = {}  # the rollout running on each lane

    def sink(self, lane: str | None) -> LaneSink:
        """A sink for events about this connection's lane `lane` from outside a response."""
        return LaneSink(self.protocol, self.counters, self.outbox, lane)

    def hold(self, create: ResponseCreate, timings: dict[str, float]) -> None:
        """A create is queued: keep its decode timings until it starts."""
        self._decode_timings[id(create)] = timings

    def timings_of(self, request: ResponseCreate) -> dict[str, float]:
        """The decode timings of a create that starts now."""
        return self._decode_timings.pop(id(request), {})

    def rollout_of(self, response_id: str) -> tuple[str | None, Rollout | None]:
        """The lane of a response of this connection, and its rollout handle while that
        response runs (None once it has ended, or if it is no rollout)."""
        lane = self.protocol.lane_of(response_id)
        rollout = self._rollouts.get(lane)
        if rollout is None or rollout.response_id != response_id:
            return lane, None
        return lane, rollout

    async def run(self, request: ResponseCreate, timings: dict[str, float]) -> None:
        """Run one started create (`timings`: its decode's) on its lane."""
        lane = request.stream_id
        multi_agent = multi_agent_enabled(request)  # (the connection checked the beta)
        rollout = (
            Rollout(self.session, multi_agent=multi_agent)
            if request.rollout or multi_agent
            else None
        )
        sink = (
            TimedLaneSink(
                self.protocol, self.counters, self.outbox, lane, timings=timings, rollout=rollout
            )
            if self.timing
            else LaneSink(self.protocol, self.counters, self.outbox, lane)
        )
        try:
            if rollout is not None:
                self._rollouts[lane] = rollout
            await self.session.run(request, sink, rollout, timings=timings)
        except RemoteProtocolError as exc:
            self.counters.request_errors += 1
            await sink.refuse(exc)
        finally:
            self._rollouts.pop(lane, None)
        if rollout is not None:
            for event in rollout.unanswered():  # the response ended before taking them
                await sink.send(inject_failed(event, "response_already_completed", stream_id=lane))
