"""Steering a response in flight (`response.steer`, spec/PROTOCOL.md ST): the queue of one
response, its acknowledgements, the safe boundary, and input parked for a continuation.

- `Steering` is the coroutine's side (`_rollout._Run` holds one per response). `submit` queues
  a steer and answers it in the response's stream (`response.steer.accepted`, or a failure:
  `steering_not_supported`, `too_many_pending_steers`); from then on `requested` is true, and
  the coroutine stops at its next safe boundary (`wait_here`, `_sampling.sample_turn`; between
  sampling steps, `_Run.loop`) with `response.incomplete`, reason `steered`. The successor loop then
  commits the queued input to a successor (`_steered.run_steered`), or, when the response ended
  owing client tool results, answers each steer with `response.steer.pending` and parks it.
- `ParkedSteers` is the connection's side: input accepted for a response that ended owing tool
  results, prepended (in submission order) to the client's next create continuing it.

- The successor loop that runs a response and, after a steered end, its successor lives
  beside this module (`_steered.py`).

The acknowledgements are events of the response's stream, numbered after the events already
built: `emit` is the response's one way out into its `EventSink`, a gate that lets an
acknowledgement (sent from the connection's reader task) through only when no event the
coroutine built is waiting to be sent, so sequence numbers go out in order. An event cut off
by a cancellation while the sink held it back (a shutdown cancelling a response on a full
outbox) was built and numbered: it goes out first when the next one does (the events that end
the response), so the stream keeps no gap.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import trio
from rollout.protocol import (
    Item,
    RemoteProtocolError,
    RequiredInput,
    ResponseCreate,
    ResponseSteer,
    ResponseSteerAccepted,
    ResponseSteerFailed,
    ResponseSteerPending,
    ResponseStream,
    ServerEvent,
    SteerRef,
    parts_of,
    steer_failed,
    steer_items,
)

from ._ids import new_id
from ._sink import EventSink
from ._validate import check_part

if TYPE_CHECKING:
    from ._counters import Counters
    from ._state import ResponseState

__all__ = [
    "MAX_PARKED_RESPONSES",
    "MAX_PENDING_STEERS",
    "ParkedSteers",
    "QueuedSteer",
    "Steering",
    "required_input",
    "steering_unsupported",
]

log = logging.getLogger("rollout.engine")

# Steering submissions one response may hold queued (accepted, not yet committed to a
# successor). A person or a supervising agent sends a few corrections per response; the bound
# keeps a client from queueing input (up to a message each) without limit.
MAX_PENDING_STEERS = 16
# Ended responses per connection whose accepted steering input waits for the client's
# continuation (`response.steer.pending`): as many as the connection caches responses, which
# is where a continuation is fast. Beyond it the oldest response's input is dropped (logged).
MAX_PARKED_RESPONSES = 8


@attrs.frozen(kw_only=True, eq=False)
class QueuedSteer:
    """An accepted submission: its id, the event as received (to echo), its items."""

    id: str
    steer: ResponseSteer
    items: list[Item]


def steering_unsupported(request: ResponseCreate) -> str | None:
    """Why a response takes no steering input (`steering_not_supported`), or None: OpenAI
    steers neither responses bound to a conversation (rollout refuses `conversation`) nor
    those using automatic compaction, nor multi-agent ones; a warm-up samples nothing."""
    if request.context_management:
        return "responses using automatic compaction (context_management)"
    if (request.multi_agent or {}).get("enabled") is True:
        return "multi-agent responses"
    if request.conversation is not None:
        return "responses bound to a conversation"
    if request.generate is False:
        return "a warm-up (generate: false), which samples nothing"
    return None


class Steering:
    """The steering side of one response in flight (see the module)."""

    @classmethod
    def of(
        cls,
        request: ResponseCreate,
        sink: EventSink,
        *,
        registry: dict[str, Steering] | None,
        counters: Counters | None,
    ) -> Steering:
        """The steering of a response to `request` whose events go into `sink`, registered in
        `registry` (the connection's running responses) while it takes steering input."""
        return cls(
            sink,
            unsupported=steering_unsupported(request),
            stream_id=request.stream_id,
            registry=registry,
            counters=counters,
        )

    def __init__(
        self,
        sink: EventSink,
        *,
        unsupported: str | None = None,
        stream_id: str | None = None,
        max_pending: int = MAX_PENDING_STEERS,
        registry: dict[str, Steering] | None = None,
        counters: Counters | None = None,
    ) -> None:
        self._counters = counters
        self._send_out = sink.send  # (bound once: it is called for every event)
        self._registry = registry  # the connection's running responses, by id
        self.unsupported = unsupported  # why this response takes no steering, if it doesn't
        self.stream_id = stream_id  # the lane of the response (its answers carry it)
        self.max_pending = max_pending
        self.stream: ResponseStream | None = None  # set by the coroutine before it starts
        self.response_id: str | None = None
        self.queued: list[QueuedSteer] = []
        self.accepting = False  # from response.created until the end is decided
        self._scope: trio.CancelScope | None = None  # a safe point's, while waiting there
        self._unsent = 0  # events built and not yet handed to `emit`
        # An event cut off by a cancellation while its send waited (a shutdown, as the sink
        # held it back: a full outbox): built and numbered, so it goes out first, before the
        # events that end the response (`emit`); counted in `_unsent` until then.
        self._cut_off: ServerEvent | None = None
        self._sending = False
        self._sent = trio.Event()  # set when an event went out and someone waits for that
        self._waiting = 0

    @property
    def requested(self) -> bool:
        """Steering input is queued: stop at the next safe boundary."""
        return bool(self.queued)

    # --- the response's way out -----------------------------------------------------------

    async def emit(self, event: ServerEvent) -> None:
        """Send one event the coroutine built (its way out: see the module); one cut off
        before it goes first."""
        self._unsent += 1
        try:
            while self._sending:
                await self._wait_sent()
            await self._send(event)
        finally:
            self._unsent -= 1

    async def _send(self, event: ServerEvent) -> None:
        self._sending = True
        try:
            if self._cut_off is not None:
                await self._send_cut_off()
            try:
                await self._send_out(event)
            except trio.Cancelled:
                self._hold(event)
                raise
        finally:
            self._sending = False
            if self._waiting:  # (an Event per event only when someone waits: ~1 us saved)
                self._sent.set()
                self._sent = trio.Event()

    def _hold(self, event: ServerEvent) -> None:
        """`event` was cut off as it was being sent: it goes out before the next one."""
        self._cut_off = event
        self._unsent += 1  # (the caller's count ends as it raises; this one stays)

    async def _send_cut_off(self) -> None:
        event, self._cut_off = self._cut_off, None
        assert event is not None
        try:
            await self._send_out(event)
        except trio.Cancelled:
            self._cut_off = event  # (still counted)
            raise
        self._unsent -= 1

    async def _wait_sent(self) -> None:
        self._waiting += 1
        try:
            await self._sent.wait()
        finally:
            self._waiting -= 1

    async def _answer(self, build: Callable[[int], ServerEvent]) -> None:
        """Build an answer with the stream's next sequence number once nothing built is
        waiting, and send it."""
        assert self.stream is not None
        event = build(self.stream.steer_sequence_number())
        self._unsent += 1
        try:
            await self._send(event)
        finally:
            self._unsent -= 1

    # --- the connection's side --------------------------------------------------------------

    async def submit(self, steer: ResponseSteer) -> ResponseSteerFailed | None:
        """Queue `steer` and answer it in the response's stream; returns the out-of-stream
        failure to send instead when the response no longer takes steering input."""
        while self._sending or self._unsent:
            await self._wait_sent()
        if not self.accepting or self.stream is None:
            return steer_failed(
                steer,
                "response_not_active",
                f"Response '{steer.previous_response_id}' is ending; it takes no more steering "
                "input.",
                stream_id=self.stream_id,
            )
        lane = self.stream_id
        if self.unsupported is not None:
            why = f"Steering is not supported for {self.unsupported}."
            await self._answer(
                lambda n: steer_failed(
                    steer, "steering_not_supported", why, sequence_number=n, stream_id=lane
                )
            )
            return None
        if len(self.queued) >= self.max_pending:
            why = (
                f"Response '{steer.previous_response_id}' already holds {self.max_pending} "
                "steering submissions (the limit); wait for its successor."
            )
            await self._answer(
                lambda n: steer_failed(
                    steer, "too_many_pending_steers", why, sequence_number=n, stream_id=lane
                )
            )
            return None
        try:
            items = _checked(steer)
        except RemoteProtocolError as exc:  # malformed: answered out of stream, as on decode
            return steer_failed(steer, "invalid_input", exc.body.message, stream_id=lane)
        queued = QueuedSteer(id=new_id("steer"), steer=steer, items=items)
        self.queued.append(queued)
        if self._counters is not None:
            self._counters.steers_accepted += 1
        ref = SteerRef(id=queued.id, previous_response_id=steer.previous_response_id)
        await self._answer(
            lambda n: ResponseSteerAccepted(sequence_number=n, steer=ref, stream_id=lane)
        )
        if self._scope is not None:  # the coroutine waits at a safe point: stop it there
            self._scope.cancel()
        return None

    # --- the coroutine's side ---------------------------------------------------------------

    def open(self, stream: ResponseStream, response_id: str) -> None:
        """Steering input is taken from now on (`response.created` is being sent)."""
        self.stream, self.response_id = stream, response_id
        self.accepting = True
        if self._registry is not None:
            self._registry[response_id] = self

    def stop_accepting(self) -> None:
        """The end is decided: no more input is taken (a late steer is `response_not_active`)."""
        self.accepting = False
        self._scope = None
        if self._registry is not None and self.response_id is not None:
            self._registry.pop(self.response_id, None)

    def wait_here(self, scope: trio.CancelScope) -> None:
        """The coroutine waits at a safe point, in `scope`: steering input accepted meanwhile
        cancels it (the caller then stops with `steered`). One scope serves a whole turn's
        waits (`_sampling.sample_turn`): a cancel scope per wait cost more than the wait."""
        self._scope = scope

    def done_waiting(self) -> None:
        """The wait at the safe point is over: input accepted from now on only queues."""
        self._scope = None

    # --- after the end (the session) --------------------------------------------------------

    async def fail_queued(self, code: str, message: str) -> list[QueuedSteer]:
        """Each queued submission fails in the ended response's stream, with its id."""
        failed, self.queued = self.queued, []
        for q in failed:
            await self._answer(functools.partial(self._failure, q, code, message))
        return failed

    def _failure(self, q: QueuedSteer, code: str, message: str, n: int) -> ResponseSteerFailed:
        return steer_failed(
            q.steer, code, message, steer_id=q.id, sequence_number=n, stream_id=self.stream_id
        )

    async def report_pending(self, state: ResponseState) -> list[QueuedSteer]:
        """The response ended owing client tool results: each queued submission is answered
        once with `response.steer.pending` naming them, and handed back to be parked."""
        parked, self.queued = self.queued, []
        stubs = required_input(state)
        for q in parked:
            await self._answer(functools.partial(self._pending, q, stubs))
        return parked

    def _pending(self, q: QueuedSteer, stubs: list[RequiredInput], n: int) -> ResponseSteerPending:
        ref = SteerRef(id=q.id, previous_response_id=q.steer.previous_response_id)
        return ResponseSteerPending(
            sequence_number=n, required_input=stubs, steer=ref, stream_id=self.stream_id
        )


def _checked(steer: ResponseSteer) -> list[Item]:
    """The items of a steer, their content parts checked as a create's are (URL schemes,
    data URLs, sizes: what the codec does not check)."""
    items = steer_items(steer.input)
    for i, item in enumerate(items):
        found = parts_of(item)
        if found is not None:
            field, parts = found
            for j, part in enumerate(parts):
                check_part(part, f"input[{i}].{field}[{j}]")
    return items


# The stub of the output that answers a call, by call kind (the SDK's
# `ResponseSteerRequiredInput`; `local_shell_call_output`, which it lacks, by analogy).
_STUB_TYPES = {
    "function": "function_call_output",
    "custom": "custom_tool_call_output",
    "computer": "computer_call_output",
    "shell": "shell_call_output",
    "apply_patch": "apply_patch_call_output",
    "local_shell": "local_shell_call_output",
}


def required_input(state: ResponseState) -> list[RequiredInput]:
    """Stubs of the outputs `state` waits for, in call order."""
    stubs = []
    for call_id, name in state.open_calls:
        record = state.lineage.call(call_id, state.n_items)
        kind = record.kind if record is not None else "function"
        stubs.append(
            RequiredInput(
                type=_STUB_TYPES[kind],
                call_id=call_id,
                name=name if kind == "function" else None,
            )
        )
    return stubs


class ParkedSteers:
    """Per connection: accepted steering input of ended responses that wait for the client's
    continuation (bounded by `MAX_PARKED_RESPONSES`, oldest dropped first)."""

    def __init__(self, limit: int = MAX_PARKED_RESPONSES) -> None:
        self.limit = limit
        self._by_parent: collections.OrderedDict[str, list[QueuedSteer]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._by_parent)

    def park(self, parent_id: str, steers: list[QueuedSteer]) -> None:
        if not steers:
            return
        self._by_parent.setdefault(parent_id, []).extend(steers)
        self._by_parent.move_to_end(parent_id)
        while len(self._by_parent) > self.limit:
            dropped, lost = self._by_parent.popitem(last=False)
            log.warning(
                "steering input of response %s dropped unused (%d submissions): more than %d "
                "responses wait for a continuation on this connection",
                dropped,
                len(lost),
                self.limit,
            )

    def take(self, parent_id: str) -> list[QueuedSteer]:
        """The input parked for `parent_id`, in submission order (removed)."""
        return self._by_parent.pop(parent_id, [])

    def restore(self, parent_id: str, steers: list[QueuedSteer]) -> None:
        """Put back input taken for a continuation that was refused (not committed)."""
        if steers:
            self._by_parent[parent_id] = steers + self._by_parent.get(parent_id, [])
