"""The rollout coroutine: one response, from its request to its terminal event.

Long because the coroutine's every end lives here: completed, incomplete (length, steering,
timeout, shutdown), failed, and the suspension in between, each committing usage before its
terminal event.

    pre-inference, once     route; validate, render, classify the new input (`_preinfer.py`)
    start                   response.created, response.in_progress
    loop:
      steered               steering input is queued (`_steer.Steering`): stop here,
                            response.incomplete with reason `steered` (a safe boundary)
      sample                one turn from the backend, streamed; its output rendered and
                            classified into the state. Steering input accepted while it
                            waits for the backend outside a tool-call item (no client call
                            made yet in the turn) stops it there: the open message closes
                            `incomplete`, then response.incomplete `steered`
      hosted tools ran      their results are in the output: sample again
      tool calls, rollout   suspend until `Rollout.append` has delivered every output, then
                            sample again, in the same response; two doors to one suspension:
        the extension         response.done with the pending call ids; response.append;
                              resumed with response.in_progress
        multi-agent beta      no event; each queued response.inject goes through the same
                              `append` and is acknowledged (response.inject.created) in order
      otherwise             the response is complete (or incomplete: max_output_tokens)
    post-inference, once    usage (and, with store: true, the response) committed; only then
                            the terminal event goes out
    after the end           queued steering input (`_steered.run_steered`): a
                            successor response continues from this one with it, through
                            this same coroutine (pre-inference of the new input only); or,
                            when the response owes client tool results, each submission is
                            answered `response.steer.pending` and parked for the client's
                            continuation, which gets it prepended

A suspension costs O(step) on the wire, not O(rollout): `response.done` names the response,
its pending call ids and the output indices of the step, and the resumed `response.in_progress`
names the response; the items already went out as `response.output_item.done`, and only the
terminal event carries the whole response (PROTOCOL.md RX-2.2, RX-2.3). The embedded handle
(`Rollout.response`) still shows the response so far at each suspension, built only when it is
iterated. Through the multi-agent door a suspension sends nothing; each inject costs one
constant-size acknowledgement.

Every mode runs this coroutine. A create (stateless or with `previous_response_id`) never
suspends: its tool calls end the response, and the client continues with a new create. A
rollout (the extension, `rollout: true`, or a multi-agent response, `multi_agent: {enabled:
true}` on a beta connection) suspends at them, so pre- and post-inference happen once for the
whole agent loop. That is the only difference, which is what makes the modes equal: the
items, the rendered context and the usage are the same whichever door a client uses (a
property test proves it). A multi-agent response's events go out through `RootAgentView`,
which attributes its items to the root agent on the wire only.

A response runs on its request's lane (`request.stream_id`, the default lane without one): the
WebSocket server runs one response per busy lane at once, each in this coroutine, and the
`EventSink` it hands over (`_sink.py`) puts the events on that lane. The final state joins
the connection's cache as its lane's latest; a failure evicts the parent only when the
parent is of the same lane (a failed fork from another lane keeps it: `_cache.py`).

Steering never cuts a tool-call item: once the model has made a client tool call in a turn,
the turn ends normally and the calls are owed. A suspended rollout that is steered stays
suspended (its calls are owed, and started tools are not cancelled); the client's outputs
resume it, and it stops `steered` at the boundary before the next turn.

Every event leaves through `Steering.emit` into the response's sink, one downward chain of
calls; the gate keeps steering acknowledgements (sent from the connection's reader) in
sequence with the events the coroutine builds.

`_Run._end` is the one way out: whatever ended the response (completion, a flag, a backend
failure, a shutdown, a bug), its usage is committed first (`finish`, `fail`, `abort`,
`crashed`), and then `_end` sends its one terminal event.
A response cut off by a disconnect or a cancellation sends nothing; its usage goes to the
post-inference writer without blocking (`_Run.release`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import attrs
import trio
from rollout.protocol import (
    BuilderState,
    ReasoningConfig,
    RemoteProtocolError,
    Response,
    ResponseCompleted,
    ResponseCreate,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ResponseStream,
    RootAgentView,
    ServerEvent,
    TextConfig,
    Usage,
    echo_tools,
)

from ._compact import CompactionPolicy, compact_state
from ._errors import BackendError
from ._ids import new_id
from ._interfaces import Flag, Holder, StoredResponse, UsageRecord
from ._postinfer import PostJob, WriteFailed
from ._preinfer import Prepared
from ._sampling import Progress, Step, extend_state, sample_turn, usage_of
from ._segments import encode_segment
from ._sink import Emit, EventSink, TrackedSink
from ._state import ResponseState
from ._steer import Steering
from ._suspend import Rollout

if TYPE_CHECKING:
    from ._services import ConnectionScope

__all__ = [
    "MAX_HOSTED_ROUNDS",
    "SERVER_ERROR",
    "SHUTDOWN_REASON",
    "Emit",
    "Rollout",
    "run_response",
]

_Terminal = ResponseCompleted | ResponseIncomplete

log = logging.getLogger("rollout.engine")

# Sampling steps one response may spend on hosted tools before its model must answer the
# client (a model that keeps searching cannot hold a response forever).
MAX_HOSTED_ROUNDS = 16

# What a response that failed on an unexpected error says (the traceback goes to the log).
SERVER_ERROR = ResponseError(
    code="server_error",
    message="The server had an error while processing your request. Sorry about that!",
)
# What a response interrupted by a shutdown (past the grace period, or a second signal) says:
# it ends `incomplete` with this reason, its output so far and its usage as recorded.
SHUTDOWN_REASON = "server_shutdown"
# ... unless it was cut off while its own end was going out (its stream already ended).
_SHUTDOWN_ERROR = ResponseError(
    code="server_error",
    message="The server is shutting down; this response was interrupted. Retry it.",
)


async def run_response(
    session: ConnectionScope,
    prepared: Prepared,
    request: ResponseCreate,
    sink: EventSink,
    steering: Steering,
    rollout: Rollout | None,
) -> ResponseState | None:
    """Run one response whose pre-inference is done (`_preinfer.pre_infer`); its events go down
    through `steering` (the caller's, which holds the input queued when it ended) into `sink`.
    Returns the final state (None when it failed)."""
    run = _Run(session, request, sink, steering, rollout, prepared)
    await run.start()
    try:
        return await run.drive()
    except Exception as exc:
        await run.crashed(exc)
        return None
    finally:
        run.release()


class _Fail(Exception):
    """The response fails with `error` (raised inside the loop, handled by `_Run.drive`)."""

    def __init__(self, error: ResponseError, usage: Usage | None, *, evict: bool) -> None:
        self.error = error
        self.usage = usage
        self.evict = evict


class _Run:
    """One response in flight: its event stream, the usage of its sampling steps, and the
    one way out (`_end`)."""

    def __init__(
        self,
        session: ConnectionScope,
        request: ResponseCreate,
        sink: EventSink,
        steering: Steering,
        rollout: Rollout | None,
        prepared: Prepared,
    ) -> None:
        self.session = session
        self.engine = session.engine
        self.request = request
        self.steering = steering
        self.emit: Emit = steering.emit
        if rollout is not None and rollout.multi_agent:  # (a multi-agent response is not steered)
            self.emit = _root_agent(self.emit)
        self.rollout = rollout
        self.prepared = prepared
        self.response = _new_response(request, self.engine.now())
        # On a WebSocket lane the builder drives the lane's tracker: each event checked once.
        tracker = sink.tracker if isinstance(sink, TrackedSink) else None
        self.stream = ResponseStream(self.response, tracker=tracker)
        self.records: list[UsageRecord] = []  # one per sampling step
        self.total = Usage()
        self.progress = Progress()  # of the step being sampled
        # The state the step being sampled (or the suspension) started from, and the output
        # count then: what a shutdown extends with the step's items so far (`interrupted`).
        self.state = prepared.state
        self.step_first = 0
        self.committed = False
        # What the backend keeps for this response between its turns (a model's KV sequence,
        # through suspensions), released when it ends; and the lane's, kept past its end.
        self.holder = Holder("response")
        lane = session.lane_holder(request.stream_id)
        self.holders = (self.holder,) if lane is None else (self.holder, lane)

    @property
    def response_id(self) -> str:
        return self.response.id

    async def start(self) -> None:
        if self.rollout is not None:
            # Named before `response.created` goes out: a client may answer that event at once
            # (an early append must get `rollout_not_suspended`, not `rollout_not_found`).
            self.rollout.begin(self.response_id)
        self.steering.open(self.stream, self.response_id)
        for event in self.stream.start():
            await self.emit(event)

    async def drive(self) -> ResponseState | None:
        prepared = self.prepared
        if prepared.flags:
            return await self.fail(_flagged(prepared.flags[0], appended=False), None, evict=True)
        state = prepared.state
        if not prepared.generate:  # a warm-up: pre-inference only
            self.steering.stop_accepting()
            completed = self.stream.complete(usage=Usage(), completed_at=self.engine.now())
            return await self.finish(state, completed)
        state, cached = await self._compact_if_over(state)
        try:
            with self.engine.interruptible() as interrupted:
                state, terminal = await self.loop(state, cached)
        except _Fail as failure:
            return await self.fail(failure.error, failure.usage, evict=failure.evict)
        if interrupted.cancelled_caught:  # a shutdown past its grace period
            return await self.interrupted()
        return await self.finish(state, terminal)

    async def loop(self, state: ResponseState, cached: int) -> tuple[ResponseState, _Terminal]:
        """Sample, suspend and resume until the response ends; returns the final state and
        the terminal event (not yet sent)."""
        hosted_rounds = 0
        while True:
            if self.steering.requested:  # the boundary between sampling steps
                return state, await self._incomplete("steered")
            before = state.context_tokens
            self._at(state)
            step = await self.sample(state, cached)
            state = step.state
            if step.finish in ("max_output_tokens", "steered"):
                return await self._cut_short(state, step)
            if step.hosted and not state.open_calls and hosted_rounds < MAX_HOSTED_ROUNDS:
                hosted_rounds += 1  # the hosted tools' results are in: sample again
                cached = before
                continue
            if self.rollout is not None and state.open_calls:
                cached = state.context_tokens
                self._at(state)
                resumed = await self.suspend(state)
                if resumed is None:
                    return state, await self._incomplete("rollout_timeout")
                state = resumed
                continue
            self.steering.stop_accepting()
            completed = self.stream.complete(usage=self.total, completed_at=self.engine.now())
            return state, completed

    async def sample(self, state: ResponseState, cached: int) -> Step:
        self.progress = Progress()
        try:
            step = await sample_turn(
                self.engine,
                state,
                self.request,
                self.stream,
                self.emit,
                cached,
                self.progress,
                self.steering,
                owner=self.session.owner,
                holders=self.holders,
            )
        except BackendError as exc:
            usage = self.total + usage_of(self.progress)
            self._close_step()
            error = ResponseError(code=exc.code, message=exc.message)
            raise _Fail(error, usage, evict=True) from None
        self._close_step(complete=True)
        self.total = self.total + step.usage
        return step

    async def suspend(self, state: ResponseState) -> ResponseState | None:
        """Suspend at the pending tool calls; the state with the appended (or injected) input
        once every call has its output, or None when the suspend limit passed."""
        assert self.rollout is not None
        rollout = self.rollout
        limit = self.engine.rollout_suspend_limit
        rollout.suspend(state, self.stream.snapshot)  # appends are accepted from here on
        if rollout.multi_agent:
            resumed = await rollout.wait_injected(limit, self._answer_inject)
        else:
            await self.emit(self.stream.suspend([cid for cid, _ in state.open_calls]))
            self.engine.counters.rollout_suspensions += 1
            resumed = await rollout.wait_resume(limit)
        self.session.last_timings = rollout.timings
        if resumed is None:
            return None
        state, flags = resumed
        if flags:
            raise _Fail(_flagged(flags[0], appended=True), self.total, evict=False)
        if not rollout.multi_agent:
            await self.emit(self.stream.resume())
        return state

    async def _answer_inject(self, error: RemoteProtocolError | None) -> None:
        """An inject was committed (acknowledged in the response's sequence, on its lane) or
        refused (a request error: its input answers no pending call, ...)."""
        if error is not None:
            self.engine.counters.request_errors += 1
            await self.emit(error.error_event())
        else:
            self.engine.counters.injects_committed += 1
            await self.emit(self.stream.inject_created(stream_id=self.request.stream_id))

    # --- the one exit: post-inference once, then the terminal event ---------------------------

    async def finish(self, state: ResponseState, terminal: _Terminal) -> ResponseState | None:
        """Completed or incomplete: the response (if stored) and its usage are committed,
        then the terminal event goes out. If the commit fails (the store or the ledger is
        down), the response fails with `server_error` instead: it cannot be acknowledged."""
        final = terminal.response
        try:
            final_state = await self._commit_final(state, final)
        except WriteFailed:
            log.warning("response %s failed: its commit did not go through", self.response_id)
            self.session.cache.evict(final.id)  # (its usage waits with the writer for a retry)
            self.committed = True
            self._evict_parent()
            failed = ResponseFailed(
                sequence_number=terminal.sequence_number,  # in place of the unsent terminal
                response=attrs.evolve(
                    final, status="failed", error=SERVER_ERROR, completed_at=None
                ),
            )
            return await self._end(failed, "failed", None)
        await self._end(terminal, final.status, final_state)
        return final_state

    async def fail(
        self, error: ResponseError, usage: Usage | None, *, evict: bool
    ) -> ResponseState | None:
        self.steering.stop_accepting()
        if self.records:
            await self.engine.post.commit(PostJob(records=self.records))
        self.committed = True
        if evict:
            self._evict_parent()
        return await self._end(self.stream.fail(error=error, usage=usage), "failed", None)

    async def interrupted(self) -> ResponseState | None:
        """Ended by a shutdown (`Engine.interrupt_all`) while sampling or suspended: the open
        item closes `incomplete`, and the response ends `incomplete` (`server_shutdown`) with
        the output that streamed and the usage the ledger records for it (the step cut off
        counts what it sampled), committed (and stored) like any other end."""
        if self.stream.state not in _RUNNING:  # cut off while its own end went out
            self._close_step()
            await self.abort(_SHUTDOWN_ERROR)
            return None
        self.total = self.total + usage_of(self.progress)
        self._close_step()
        terminal = await self._incomplete(SHUTDOWN_REASON)
        outputs = self.stream.output_since(self.step_first)
        state = extend_state(self.engine.pipeline, self.state, outputs) if outputs else self.state
        return await self.finish(state, terminal)

    async def abort(self, error: ResponseError) -> None:
        """Ended from outside the loop (a shutdown): the stream may be in any state."""
        self.steering.stop_accepting()
        await self.engine.post.commit(PostJob(records=self.records))
        self.committed = True
        failed = self.stream.abort(error=error, usage=self.total)
        await self._end(failed, "failed", None)

    async def crashed(self, exc: Exception) -> None:
        """A bug, ours or a backend's: the response fails (with a logged traceback); the
        connection, its queue and other responses carry on. A transport that closed under
        the response (the client left, or stopped reading) is not a bug."""
        if isinstance(exc, trio.ClosedResourceError | trio.BrokenResourceError):
            log.info("response %s ended: its connection closed (%s)", self.response_id, exc)
        else:
            log.exception("response %s failed with an unexpected error", self.response_id)
        self.steering.stop_accepting()
        failed = self.stream.abort(error=SERVER_ERROR, usage=self.total + usage_of(self.progress))
        if not self.committed:
            self._close_step()
            with contextlib.suppress(Exception):  # the writer may be what broke
                await self.engine.post.commit(PostJob(records=self.records))
            self.committed = True
        if failed is not None:
            self._evict_parent()
            with contextlib.suppress(Exception):  # the sink itself may be what broke
                await self._end(failed, "failed", None)

    async def _end(
        self, terminal: ServerEvent | None, status: str, state: ResponseState | None
    ) -> ResponseState | None:
        self.committed = True
        if terminal is not None:
            self.engine.record_status(status)
            await self.emit(terminal)
        return state

    async def _commit_final(self, state: ResponseState, final: Response) -> ResponseState:
        """Post-inference, once: the final state joins the connection's cache; its usage and,
        with store: true, the stored response are committed."""
        engine = self.engine
        parent_stored = self.prepared.parent_stored
        records = self.records
        stored = final.store and parent_stored
        state = attrs.evolve(state, response=final, stored=stored)
        self.session.cache.put(state, lane=self.request.stream_id, latest=True)
        engine.render_cache.put(self.session.owner, state)
        job_store = None
        if final.store:
            start = state.first_new_item if parent_stored else 0
            parent = self.prepared.parent
            job_store = StoredResponse(
                response=final,
                items=state.lineage.items[start : state.n_items],
                instructions=state.prefix.instructions,
                tools=list(state.prefix.tools),
                parent_id=final.previous_response_id,
                is_root=start == 0,
                owner=self.session.owner,
                rendered=encode_segment(
                    engine.pipeline,
                    state,
                    start=start,
                    with_prefix=start == 0 or parent is None or parent.prefix is not state.prefix,
                ),
            )
        await engine.post.commit(PostJob(records=records, stored=job_store))
        return state

    def release(self) -> None:
        """Always, last: the rollout handle is done; usage never committed (a disconnect, a
        cancellation) goes to the post-inference writer without blocking."""
        self.steering.stop_accepting()
        self.holder.release()
        if self.rollout is not None:
            self.rollout.finish()
        if not self.committed:
            self._close_step()
            self.engine.post.submit_nowait(PostJob(records=self.records))

    # --- helpers -----------------------------------------------------------------------------

    def _at(self, state: ResponseState) -> None:
        """A step (or a suspension) starts from `state`."""
        self.state = state
        self.step_first = self.stream.output_count

    def _close_step(self, *, complete: bool = False) -> None:
        """Record the usage of the step being sampled, if it started (once)."""
        if not self.progress.started:
            return
        response = self.response
        self.records.append(
            UsageRecord(
                response_id=response.id,
                step=len(self.records),
                owner=self.session.owner,
                model=response.model,
                input_tokens=self.progress.input_tokens,
                cached_tokens=self.progress.cached_tokens,
                output_tokens=self.progress.output_tokens,
                complete=complete,
                created_at=self.engine.wall_clock(),
            )
        )
        self.progress = Progress()

    async def _incomplete(self, reason: str) -> ResponseIncomplete:
        """Close what is open as incomplete and send that; the terminal event waits."""
        self.steering.stop_accepting()
        events = self.stream.incomplete(
            reason=reason, usage=self.total, completed_at=self.engine.now()
        )
        for event in events[:-1]:
            await self.emit(event)
        terminal = events[-1]
        assert isinstance(terminal, ResponseIncomplete)
        return terminal

    async def _cut_short(self, state: ResponseState, step: Step) -> tuple[ResponseState, _Terminal]:
        """max_output_tokens, or steered inside a turn: the open item (a message; steering
        never stops inside a tool call) closes incomplete and joins the state."""
        first = self.stream.output_count
        terminal = await self._incomplete(step.finish)
        outputs = step.pending_outputs + self.stream.output_since(first)
        return extend_state(self.engine.pipeline, state, outputs), terminal

    async def _compact_if_over(self, state: ResponseState) -> tuple[ResponseState, int]:
        """Automatic compaction (`context_management`): past the threshold the conversation
        continues from the compacted window, whose item is the response's first output."""
        prepared = self.prepared
        cached = prepared.cached_tokens
        threshold = prepared.compact_threshold
        if threshold is None or state.context_tokens <= threshold:
            return state, cached
        state, item = compact_state(
            self.engine.pipeline,
            state,
            CompactionPolicy(budget_tokens=threshold // 2),
            self.engine.seal,
            owner=self.session.owner,
        )
        for event in self.stream.add_item(item):
            await self.emit(event)
        return state, 0

    def _evict_parent(self) -> None:
        # A failed continuation evicts its parent from the connection's cache (OpenAI's rule),
        # unless the parent belongs to another lane than this response's (a failed fork).
        if self.prepared.parent is not None:
            self.session.cache.discard_failed_parent(
                self.prepared.parent.id, self.request.stream_id
            )


# The stream states of a response that has not ended (a shutdown can end it as incomplete).
_RUNNING = frozenset(
    {BuilderState.ACTIVE, BuilderState.IN_MESSAGE, BuilderState.IN_CALL, BuilderState.SUSPENDED}
)


def _root_agent(emit: Emit) -> Emit:
    """The emitter of a multi-agent response: its events as the beta shows them."""
    view = RootAgentView()

    async def emit_viewed(event: ServerEvent) -> None:
        for viewed in view.events(event):
            await emit(viewed)

    return emit_viewed


def _flagged(flag: Flag, *, appended: bool) -> ResponseError:
    what = "appended input" if appended else "input"
    return ResponseError(
        code="invalid_prompt",
        message=f"The {what} was flagged by the {flag.classifier} classifier: {flag.message}",
    )


def _new_response(request: ResponseCreate, now: int) -> Response:
    assert request.model is not None
    return Response(
        id=new_id("resp"),
        created_at=now,
        model=request.model,
        instructions=request.instructions,
        tools=echo_tools(request.tools or ()),
        tool_choice=request.tool_choice or "auto",
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id,
        store=request.store is not False,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        metadata=dict(request.metadata or {}),
        max_output_tokens=request.max_output_tokens,
        max_tool_calls=request.max_tool_calls,
        truncation=request.truncation or "disabled",
        safety_identifier=request.safety_identifier,
        prompt_cache_key=request.prompt_cache_key,
        user=request.user,
        text=request.text or TextConfig(),
        reasoning=request.reasoning or ReasoningConfig(),
        top_logprobs=request.top_logprobs or 0,
        prompt_cache_retention=request.prompt_cache_retention,
        client_metadata=request.client_metadata,
    )
