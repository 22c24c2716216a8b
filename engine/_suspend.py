"""The handle on a rollout in flight: the client side of the coroutine's suspensions.

The coroutine (`_rollout.py`) suspends by handing its state to `Rollout._suspend` and waiting
in `_wait_resume`; `Rollout.append` stages the client's tool outputs onto that state
(validated, rendered and classified once, as they arrive) and wakes the coroutine when every
pending call has its output. The embedded API iterates the handle for events; the WebSocket
handler routes `response.append` to it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio
from rollout.protocol import (
    Item,
    RemoteProtocolError,
    Response,
    ResponseAppend,
    ServerEvent,
    call_of,
    response_of,
)

from ._state import ResponseState
from ._validate import invalid

if TYPE_CHECKING:
    from ._services import ConnectionScope

__all__ = ["Rollout"]

_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})


class Rollout:
    """A rollout in flight (the extension). Iterate it for events up to the next suspension
    or the end; `pending_calls` names the calls whose outputs resume it; `append` delivers
    outputs. Missing outputs are waited for: a partial append is accepted, and the rollout
    resumes when every pending call has its output.

    `response` is the response as of the last event iterated: at a suspension, the response
    so far (`response.done` itself only names it: RX-2.2), then the terminal response."""

    def __init__(
        self, session: ConnectionScope, events: trio.MemoryReceiveChannel[ServerEvent] | None = None
    ) -> None:
        self.session = session
        self.response_id: str | None = None
        self.error: RemoteProtocolError | None = None
        self.response: Response | None = None
        self._events = events
        self._state: ResponseState | None = None  # set while suspended
        # The coroutine's view of the response so far (set at each suspension; called only
        # when this handle is iterated, so the WebSocket path never copies the output).
        self._snapshot: Callable[[], Response] | None = None
        self._flags: tuple[Any, ...] = ()
        # Pre-inference stage timings of the appends since the last suspension (the resumed
        # turn's `Session.last_timings`, reported like a create's).
        self.timings: dict[str, float] = {}
        self._wake = trio.Event()
        self._done = False
        self.ended = False  # a terminal event was emitted

    @property
    def suspended(self) -> bool:
        return self._state is not None

    @property
    def done(self) -> bool:
        return self._done

    @property
    def pending_calls(self) -> list[tuple[str, str]]:
        """(call_id, name) of the calls the suspended rollout waits for."""
        return list(self._state.open_calls) if self._state is not None else []

    def __aiter__(self) -> AsyncIterator[ServerEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ServerEvent]:
        if self._events is None:
            raise RuntimeError("this rollout streams to its emitter; it can't be iterated")
        async for event in self._events:
            response = response_of(event)
            if response is not None:
                self.response = response
            elif event.type == "response.done" and self._snapshot is not None:
                self.response = self._snapshot()
            if event.type in _ENDS:
                self.ended = True
            yield event
            if event.type in _ENDS or event.type == "response.done":
                return

    def append(self, items: Sequence[Item] | ResponseAppend) -> None:
        """Deliver tool outputs (and any other input items) to the suspended rollout.
        Raises `RemoteProtocolError` for a rollout that is not suspended or an output that
        answers no pending call; the rollout stays suspended and resumable after an error."""
        if isinstance(items, ResponseAppend):
            items = items.input
        state = self._state
        if state is None:
            raise invalid(
                "The rollout is not suspended: append tool outputs after response.done.",
                code="rollout_not_suspended",
                param="response_id",
            )
        engine = self.session.engine
        staged = engine.pipeline.stage(
            items,
            lineage=state.lineage,
            n_items=state.n_items,
            classifier_state=state.classifier_state,
            open_calls=dict(state.open_calls),
            param="input",
            timings=self.timings,
        )
        if any(call_of(i) is not None for i in items):
            raise invalid(
                "response.append carries tool outputs and messages, not tool calls.",
                param="input",
            )
        self._state = engine.pipeline.commit(state, staged)
        self._flags += staged.flags
        if not self._state.open_calls or self._flags:
            self._wake.set()

    def _suspend(self, state: ResponseState, snapshot: Callable[[], Response]) -> None:
        self._state = state
        self._snapshot = snapshot
        self._flags = ()
        self.timings = {}
        self._wake = trio.Event()

    async def _wait_resume(self, limit: float) -> tuple[ResponseState, tuple[Any, ...]] | None:
        try:
            with trio.move_on_after(limit if math.isfinite(limit) else math.inf):
                await self._wake.wait()
                assert self._state is not None
                return self._state, self._flags
            return None
        finally:
            self._state = None

    def _finished(self) -> None:
        self._done = True
        self._state = None
        self._snapshot = None
