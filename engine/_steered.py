"""A response and its steered successors: the loop that runs one prepared response through the
rollout coroutine with its `Steering` (made here, read here when the response ended) and, while
it ends with steering input queued, its successor; and the door a `response.steer` enters by.

After a response ends with steering input queued (`_steer.Steering`), the input is committed
to a successor (a create continuing it with that input and its settings, run through the same
coroutine, in the same task, into the same sink), or parked for the client's continuation
(`response.steer.pending`) when the response owes client tool results, or failed in the ended
response's stream (it failed, or the successor could not be created). The session (a
`SteeredScope`) prepares each successor and holds the running responses and the parked input.
"""

from __future__ import annotations

from typing import Protocol

import attrs
from rollout.protocol import RemoteProtocolError, ResponseCreate, ResponseSteer, ResponseSteerFailed

from ._preinfer import Prepared
from ._rollout import Rollout, run_response
from ._services import ConnectionScope
from ._sink import DISCARD, EventSink
from ._state import ResponseState
from ._steer import ParkedSteers, QueuedSteer, Steering

__all__ = ["SteeredScope", "run_steered", "steer"]


class SteeredScope(ConnectionScope, Protocol):
    """The connection a steered response runs on (a `Session`): it prepares successors."""

    @property
    def steerable(self) -> dict[str, Steering]:
        """The running responses that take steering input, by id."""
        ...

    @property
    def parked(self) -> ParkedSteers: ...

    async def prepare(
        self,
        request: ResponseCreate,
        timings: dict[str, float] | None = None,
        *,
        steers: tuple[QueuedSteer, ...] | None = None,
    ) -> Prepared: ...


async def run_steered(
    scope: SteeredScope,
    prepared: Prepared,
    request: ResponseCreate,
    sink: EventSink,
    rollout: Rollout | None,
) -> ResponseState | None:
    """Run a prepared response into `sink`; then, while it ended with steering input queued,
    its successor. Returns the last final state (None when the last response failed)."""
    while True:
        steering = Steering.of(
            request, sink, registry=scope.steerable, counters=scope.engine.counters
        )
        state = await run_response(scope, prepared, request, sink, steering, rollout)
        if not steering.queued:
            return state
        successor = await _successor(scope, request, state, steering)
        if successor is None:
            return state
        request, prepared = successor


async def _successor(
    scope: SteeredScope, request: ResponseCreate, state: ResponseState | None, steering: Steering
) -> tuple[ResponseCreate, Prepared] | None:
    """A response ended with steering input queued: its successor, prepared (the commit point
    is its `response.created`); or None when the input was answered otherwise:
    `response.steer.pending` (parked) when the response owes client tool results, a failure
    when it failed or the successor can't be created."""
    if state is None:
        await steering.fail_queued(
            "response_not_active", "The response failed; its steering input was not applied."
        )
        return None
    if state.open_calls:
        scope.parked.park(state.id, await steering.report_pending(state))
        return None
    successor = attrs.evolve(
        request,
        previous_response_id=state.id,
        input=[item for q in steering.queued for item in q.items],
        generate=None,
    )
    try:
        prepared = await scope.prepare(successor, None, steers=())
    except RemoteProtocolError as exc:
        scope.cache.put(state)  # a failed successor does not evict the steered response
        await steering.fail_queued(
            "successor_creation_failed",
            f"The successor response could not be created: {exc.body.message}",
        )
        return None
    scope.engine.counters.steer_successors += 1
    return successor, prepared


async def steer(scope: SteeredScope, event: ResponseSteer) -> ResponseSteerFailed | None:
    """Hand a steer to the running response it names; returns the failure to send (out of any
    stream) when that response takes no more steering input."""
    steering = scope.steerable.get(event.previous_response_id)
    if steering is None:
        steering = Steering(DISCARD)  # not accepting: answers response_not_active
    return await steering.submit(event)
