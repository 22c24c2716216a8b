"""The handle on a rollout in flight: the client side of the coroutine's suspensions.

The handle has two faces. The client's: iterate it (embedded API), `append` tool outputs,
`inject` (multi-agent beta), and `unanswered` once it ended. The coroutine's (`_rollout.py`):
`begin` a response on it, `suspend` with its state, `wait_resume` (or `wait_injected`), and
`finish`. The coroutine suspends by handing its state to `suspend` and waiting in
`wait_resume`; `Rollout.append` stages the client's tool outputs onto that state
(validated, rendered and classified once, as they arrive) and wakes the coroutine when every
pending call has its output. The embedded API iterates the handle for events; the WebSocket
handler routes `response.append` to it.

The multi-agent beta is the other door to the same suspension: the WebSocket handler queues
each `response.inject` on the handle (`inject`, at any time while the response runs), and
the suspended coroutine takes them in order (`wait_injected`), commits each through the same
`append` and acknowledges it in the response's stream. Injects the response never took
(it ended first) are answered `response_already_completed` by the handler (`unanswered`).

An append for a rollout that is not suspended is refused with `not_suspended()`, here or by
the handler when the rollout it names has ended.
"""

from __future__ import annotations

import collections
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio
from rollout.protocol import (
    TERMINAL_EVENT_TYPES,
    Item,
    RemoteProtocolError,
    Response,
    ResponseAppend,
    ResponseInject,
    ServerEvent,
    call_of,
    response_of,
)

from ._state import ResponseState
from ._validate import invalid

if TYPE_CHECKING:
    from ._services import ConnectionScope

__all__ = ["DEFAULT_MAX_QUEUED_INJECTS", "Rollout", "not_suspended"]

# Injects a multi-agent response holds until its coroutine takes them (they may arrive while
# it samples; it takes them when it waits): the Agents SDK sends one per pending call, and a
# turn's parallel calls are a handful. Each is bounded by the message size.
DEFAULT_MAX_QUEUED_INJECTS = 32


def not_suspended() -> RemoteProtocolError:
    """The refusal of an append for a rollout that is not suspended (or no longer runs)."""
    return invalid(
        "The rollout is not suspended: append tool outputs after response.done.",
        code="rollout_not_suspended",
        param="response_id",
    )


class Rollout:
    """A rollout in flight. Through the extension's door: iterate it for events up to the
    next suspension or the end; `pending_calls` names the calls whose outputs resume it;
    `append` delivers outputs. Missing outputs are waited for: a partial append is accepted,
    and the rollout resumes when every pending call has its output. Through the multi-agent
    beta's door (`multi_agent=True`): iterate it to the end, and `inject` outputs at any time;
    each is committed (by `append`) and acknowledged among the events when the response
    waits.

    `response` is the response as of the last event iterated: at a suspension, the response
    so far (`response.done` itself only names it: RX-2.2), then the terminal response."""

    def __init__(
        self,
        session: ConnectionScope,
        events: trio.MemoryReceiveChannel[ServerEvent] | None = None,
        *,
        multi_agent: bool = False,
        max_queued_injects: int = DEFAULT_MAX_QUEUED_INJECTS,
    ) -> None:
        self.session = session
        # The door: False, the extension (response.done, response.append, resume); True,
        # the multi-agent beta (no response.done; response.inject, acknowledged).
        self.multi_agent = multi_agent
        self.max_queued_injects = max_queued_injects
        self._injects: collections.deque[ResponseInject] = collections.deque()
        self._inject_ready = trio.Event()
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
            raise RuntimeError("this rollout streams into its sink; it can't be iterated")
        async for event in self._events:
            response = response_of(event)
            if response is not None:
                self.response = response
            elif event.type == "response.done" and self._snapshot is not None:
                self.response = self._snapshot()
            # (A multi-agent response answers a refused inject with an error and goes on.)
            ends = event.type in TERMINAL_EVENT_TYPES and not (
                self.multi_agent and event.type == "error" and self.response is not None
            )
            if ends:
                self.ended = True
            yield event
            if ends or event.type == "response.done":
                return

    def append(self, items: Sequence[Item] | ResponseAppend) -> None:
        """Deliver tool outputs (and any other input items) to the suspended rollout.
        Raises `RemoteProtocolError` for a rollout that is not suspended or an output that
        answers no pending call; the rollout stays suspended and resumable after an error."""
        if isinstance(items, ResponseAppend):
            items = items.input
        state = self._state
        if state is None:
            raise not_suspended()
        engine = self.session.engine
        staged = engine.pipeline.stage(
            items,
            route=state.route,
            lineage=state.lineage,
            n_items=state.n_items,
            classifier_state=state.classifier_state,
            open_calls=dict(state.open_calls),
            param="input",
            timings=self.timings,
        )
        if any(call_of(i) is not None for i in items):
            raise invalid(
                "Input for a suspended response carries tool outputs and messages, not tool calls.",
                param="input",
            )
        self._state = state.commit(staged)
        self._flags += staged.flags
        if not self._state.open_calls or self._flags:
            self._wake.set()

    def inject(self, event: ResponseInject) -> None:
        """Queue an inject (multi-agent beta) for the coroutine, which commits it at its next
        wait, in order (the caller answers an inject for a rollout that is `done`). Raises
        `RemoteProtocolError` when the queue is full."""
        if len(self._injects) >= self.max_queued_injects:
            raise RemoteProtocolError.invalid(
                f"Too many injects waiting for this response (the limit is "
                f"{self.max_queued_injects}); wait for their acknowledgements.",
                code="too_many_queued_requests",
                status=429,
            )
        self._injects.append(event)
        self._inject_ready.set()

    async def _next_inject(self) -> ResponseInject:
        """The oldest queued inject, waiting for one."""
        while not self._injects:
            self._inject_ready = trio.Event()
            await self._inject_ready.wait()
        return self._injects.popleft()

    # --- the client's side, once the response ended ---

    def unanswered(self) -> list[ResponseInject]:
        """Injects queued and never taken (the response ended first), oldest first."""
        taken, self._injects = list(self._injects), collections.deque()
        return taken

    # --- the coroutine's side ---

    def suspend(self, state: ResponseState, snapshot: Callable[[], Response]) -> None:
        """The coroutine suspends at `state` (its pending calls); appends are taken from now.
        `snapshot` builds the response so far (called only when the handle is iterated)."""
        self._state = state
        self._snapshot = snapshot
        self._flags = ()
        self.timings = {}
        self._wake = trio.Event()

    async def wait_resume(self, limit: float) -> tuple[ResponseState, tuple[Any, ...]] | None:
        """The state with every pending call answered and the classifier flags of the input
        appended; None when `limit` seconds passed first."""
        try:
            with trio.move_on_after(limit if math.isfinite(limit) else math.inf):
                await self._wake.wait()
                assert self._state is not None
                return self._state, self._flags
            return None
        finally:
            self._state = None

    async def wait_injected(
        self, limit: float, answer: Callable[[RemoteProtocolError | None], Awaitable[None]]
    ) -> tuple[ResponseState, tuple[Any, ...]] | None:
        """Multi-agent: take queued injects in order, each committed by `append` (atomically:
        all its items or none) and answered (`answer(None)`, or the error that refused it),
        until no call is owed; like `wait_resume` otherwise."""
        try:
            with trio.move_on_after(limit if math.isfinite(limit) else math.inf):
                while not self._wake.is_set():
                    event = await self._next_inject()
                    try:
                        self.append(event.input)
                    except RemoteProtocolError as exc:
                        await answer(exc)
                        continue
                    await answer(None)
                assert self._state is not None
                return self._state, self._flags
            return None
        finally:
            self._state = None

    def begin(self, response_id: str) -> None:
        """The coroutine starts a response on this handle (a steered rollout's successor
        reuses its parent's handle: it is running again, under the successor's id)."""
        self.response_id = response_id
        self._done = False

    def finish(self) -> None:
        """The response on this handle ended (a successor may `begin` again)."""
        self._done = True
        self._state = None
        self._snapshot = None
