"""The in-flight deliveries of one WebSocket connection: a client message the connection let
through to a response that runs (or ran) on it, handed to that response.

- `append` (the rollout extension): the tool outputs go to the suspended rollout's handle
  (`Rollout.append`, which checks them against the pending calls); its decode timings join
  the resumed turn's stages. A rollout that ended as the append arrived refuses it as the
  handle would (`not_suspended`).
- `steer`: the steer goes to the running response it names (`_steered.steer`), which answers
  it in its stream; a response that is ending answers out of any stream, on its lane.
- `inject` (the multi-agent beta): the inject is queued on the running response's handle
  (`Rollout.inject`); the coroutine commits and acknowledges it. A response that ended as it
  arrived answers `response.inject.failed` (`response_already_completed`).

A request error is answered on the lane of the response the message named; a bug fails the
message alone, never the response or the socket.
"""

from __future__ import annotations

import logging

import trio
from rollout.protocol import (
    RemoteProtocolError,
    ResponseAppend,
    ResponseInject,
    ResponseSteer,
    inject_failed,
)

from ._errors import server_error
from ._lanes import Lanes
from ._steered import steer
from ._suspend import not_suspended

__all__ = ["Deliveries"]

log = logging.getLogger("rollout.ws")


class Deliveries:
    """Where a connection's appends, steers and injects go (see the module)."""

    def __init__(self, lanes: Lanes) -> None:
        self.lanes = lanes

    async def append(self, event: ResponseAppend, timings: dict[str, float]) -> None:
        """Deliver an append to the suspended rollout it names. `timings`: its decode's,
        reported with the resumed turn's stages."""
        lane, rollout = self.lanes.rollout_of(event.response_id)
        try:
            if rollout is None:  # the rollout ended as the append arrived
                raise not_suspended()
            rollout.append(event.input)
            for stage, seconds in timings.items():
                rollout.timings[stage] = rollout.timings.get(stage, 0.0) + seconds
        except RemoteProtocolError as exc:
            await self.lanes.sink(lane).answer(exc)
        except Exception:  # a bug: this append fails, the rollout and the socket live on
            log.exception("response.append failed unexpectedly")
            await self.lanes.sink(lane).answer(server_error())

    async def steer(self, event: ResponseSteer) -> None:
        """Deliver a steer to the running response it names, which answers it in its stream;
        a response that is ending answers out of any stream, on its lane."""
        lanes = self.lanes
        try:
            failed = await steer(lanes.session, event)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise  # the connection is going away
        except Exception:  # a bug: this steer fails, the response and the socket live on
            log.exception("response.steer failed unexpectedly")
            lane = lanes.protocol.lane_of(event.previous_response_id)
            await lanes.sink(lane).answer(server_error())
            return
        if failed is not None:
            await lanes.sink(lanes.protocol.lane_of(event.previous_response_id)).send(failed)

    async def inject(self, event: ResponseInject) -> None:
        """Queue an inject on the running multi-agent response it names."""
        lane, rollout = self.lanes.rollout_of(event.response_id)
        if rollout is None or rollout.done:  # the response ended as the inject arrived
            failed = inject_failed(event, "response_already_completed", stream_id=lane)
            await self.lanes.sink(lane).send(failed)
            return
        try:
            rollout.inject(event)
        except RemoteProtocolError as exc:
            await self.lanes.sink(lane).answer(exc)
