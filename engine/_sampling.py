"""One sampling turn: a backend's events become the response's stream events, and the output
items are rendered and classified into the state once, here.

A turn is one call to `Backend.sample`. Text and tool-call deltas stream as they come; calls to
hosted tools (with a configured executor) are run here and their items join the output. The
turn's usage is counted as it streams (`Progress`), so a turn cut off midway still records
what it sampled.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING

import attrs
import trio
from rollout.protocol import (
    BuilderState,
    BuiltinTool,
    CallKind,
    Compaction,
    InvalidToolPayload,
    Item,
    Reasoning,
    ResponseCreate,
    ResponseStream,
    ServerEvent,
    SummaryText,
    Usage,
    call_of,
    status_of,
)

from ._errors import BackendError
from ._ids import new_id
from ._interfaces import (
    ArgsDelta,
    CallEnd,
    CallStart,
    Finish,
    Holder,
    HostedCall,
    Prefilled,
    ReasoningDone,
    SampleRequest,
    TextDelta,
    TextEnd,
    TextStart,
)
from ._pipeline import Pipeline
from ._state import ResponseState

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._services import EngineServices
    from ._steer import Steering

    Emit = Callable[[ServerEvent], Awaitable[None]]

__all__ = ["Progress", "Step", "extend_state", "sample_turn", "usage_of"]


@attrs.define
class Progress:
    """What the step being sampled has produced so far (for usage on interruption)."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    started: bool = False


@attrs.frozen(kw_only=True, eq=False)
class Step:
    """A sampled turn: the state extended with its output, why it stopped, its usage."""

    state: ResponseState
    finish: str
    usage: Usage
    pending_outputs: list[Item] = attrs.field(factory=list)
    hosted: bool = False  # hosted tools ran: the model samples again in this response


async def sample_turn(
    engine: EngineServices,
    state: ResponseState,
    request: ResponseCreate,
    stream: ResponseStream,
    emit: Emit,
    cached: int,
    progress: Progress,
    steering: Steering | None = None,
    *,
    owner: str | None = None,
    holders: tuple[Holder, ...] = (),
) -> Step:
    """Sample one turn from `state`, stream its events, and extend the state with the
    output items (rendered and classified once, here). With `steering`, each wait for the
    backend's next event is a safe point while no tool-call item is open and no client tool
    call was made in the turn: steering input stops the turn there (finish `steered`).
    `owner` and `holders` go to the backend (a model's KV cache: whose, kept by whom)."""
    engine.counters.samplings += 1
    progress.started = True
    progress.input_tokens = state.context_tokens
    progress.cached_tokens = cached
    sample_request = _sample_request(state, request, owner, holders, engine.timer.observe)
    first_output = stream.output_count
    hosted: tuple[CallStart, list[str]] | None = None  # a hosted tool's call being made
    ran_hosted = False
    finish = "stop"
    measured: Finish | None = None  # its token counts, when the backend measured them
    called = False  # a client tool call was made in this turn: it runs to its end
    async with aclosing(state.route.backend.sample(sample_request)) as events:
        # Steering's way in: armed only while the turn waits for the backend at a safe point.
        with trio.CancelScope() as stop:
            while True:
                safe = (
                    steering is not None
                    and hosted is None
                    and not called
                    and stream.state in _SAFE_STATES
                )
                if safe and steering is not None:
                    if steering.requested:
                        finish = "steered"
                        break
                    steering.wait_here(stop)
                    try:
                        ev = await anext(events, None)
                    finally:
                        steering.done_waiting()
                    if stop.cancel_called:  # steered as the event came: stop before it
                        finish = "steered"
                        break
                else:
                    ev = await anext(events, None)
                if ev is None:
                    break
                if isinstance(ev, Prefilled):
                    engine.counters.tokens_prefilled += ev.n_tokens
                elif isinstance(ev, TextDelta):
                    progress.output_tokens += ev.n_tokens
                    await emit(stream.text_delta(ev.text))
                elif isinstance(ev, ArgsDelta) and hosted is not None:
                    progress.output_tokens += ev.n_tokens
                    hosted[1].append(ev.text)
                elif isinstance(ev, ArgsDelta):
                    progress.output_tokens += ev.n_tokens
                    delta = stream.arguments_delta(ev.text)
                    if delta is not None:
                        await emit(delta)
                elif isinstance(ev, ReasoningDone):
                    progress.output_tokens += ev.n_tokens
                    for e in stream.add_item(_reasoning_item(ev)):
                        await emit(e)
                elif isinstance(ev, CallStart) and ev.kind in engine.hosted:
                    hosted = (ev, [])
                elif isinstance(ev, CallEnd) and hosted is not None:
                    for item in await _run_hosted(engine, state, hosted[0], "".join(hosted[1])):
                        for e in stream.add_item(item):
                            await emit(e)
                    hosted, ran_hosted = None, True
                elif isinstance(ev, Finish):
                    finish = ev.reason
                    measured = ev
                else:
                    called = called or isinstance(ev, CallEnd)
                    for e in _item_boundary(stream, ev):
                        await emit(e)
        if stop.cancelled_caught:  # steered while it waited
            finish = "steered"
    engine.counters.tokens_sampled += progress.output_tokens
    if measured is not None:
        _take_measured(progress, measured, cached, state.context_tokens)
        if measured.estimated:
            engine.counters.usage_estimated += 1
    outputs = stream.output_since(first_output)
    usage = usage_of(progress)
    if finish in ("max_output_tokens", "steered"):
        # The caller closes the open item as incomplete, then extends the state.
        return Step(state=state, finish=finish, usage=usage, pending_outputs=outputs)
    extended = extend_state(engine.pipeline, state, outputs)
    return Step(state=extended, finish=finish, usage=usage, hosted=ran_hosted)


# Where a turn may be stopped by steering: between items, or inside a message (never inside
# a tool call, whose item would be cut).
_SAFE_STATES = frozenset({BuilderState.ACTIVE, BuilderState.IN_MESSAGE})


def _reasoning_item(ev: ReasoningDone) -> Reasoning:
    return Reasoning(
        id=new_id("rs"),
        summary=[SummaryText(text=ev.summary)],
        encrypted_content=ev.encrypted_content,
    )


def _item_boundary(
    stream: ResponseStream, ev: TextStart | TextEnd | CallStart | CallEnd
) -> list[ServerEvent]:
    """The stream events of a backend event that opens or closes an output item."""
    if isinstance(ev, TextStart):
        return stream.begin_message(new_id("msg"))
    if isinstance(ev, TextEnd):
        return stream.end_message()
    if isinstance(ev, CallStart):
        kind = typing.cast(CallKind, ev.kind)
        return stream.begin_call(
            new_id(_CALL_ITEM_PREFIX[kind]),
            new_id("call", 12),
            ev.name,
            kind=kind,
            namespace=ev.namespace,
        )
    try:
        return stream.end_call()
    except InvalidToolPayload as exc:
        raise BackendError(f"The model made an invalid tool call: {exc}.") from None


def _take_measured(progress: Progress, finish: Finish, cached: int, rendered: int) -> None:
    """Token counts a backend measured itself (an upstream's usage) replace rollout's."""
    if finish.output_tokens is not None:
        progress.output_tokens = finish.output_tokens
    if finish.input_tokens is not None:
        progress.cached_tokens = _upstream_cached(
            finish.input_tokens, finish.cached_tokens, cached, rendered
        )
        progress.input_tokens = finish.input_tokens


async def _run_hosted(
    engine: EngineServices, state: ResponseState, call: CallStart, arguments: str
) -> Sequence[Item]:
    """Run a hosted tool's call with its configured executor; its items join the output."""
    executor = engine.hosted[call.kind]
    tool = next(
        (t for t in state.prefix.offered if isinstance(t, BuiltinTool) and t.type == call.kind),
        BuiltinTool(type=call.kind),
    )
    engine.counters.hosted_calls += 1
    try:
        return await executor.run(
            HostedCall(tool=tool, arguments=arguments, call_id=new_id("call", 12))
        )
    except Exception as exc:  # an executor's failure fails the response, never the server
        raise BackendError(
            f"The hosted tool {call.kind!r} failed: {type(exc).__name__}: {exc}"
        ) from None


def extend_state(
    pipeline: Pipeline, state: ResponseState, outputs: Sequence[Item]
) -> ResponseState:
    """The state with the model's output items rendered and classified into it. Completed
    function calls become the calls waiting for output."""
    outputs = [o for o in outputs if not isinstance(o, Compaction)]
    staged = pipeline.stage(
        outputs,
        route=state.route,
        lineage=state.lineage,
        n_items=state.n_items,
        classifier_state=state.classifier_state,
        open_calls=dict(state.open_calls),
        param="output",
        timings={},
        validate=False,
    )
    for item in outputs:
        call = call_of(item)
        if call is not None and status_of(item) == "completed":
            staged.open_calls[call[0]] = call[2]
    return state.commit(staged)


# Id prefixes of the tool-call items the model makes, by call kind.
_CALL_ITEM_PREFIX: dict[CallKind, str] = {
    "function": "fc",
    "custom": "ctc",
    "local_shell": "lsh",
    "shell": "sh",
    "apply_patch": "apc",
    "computer": "cu",
}


def _upstream_cached(input_tokens: int, reported: int | None, reused: int, rendered: int) -> int:
    """Cached tokens when a backend counted the input itself (an upstream server, whose
    tokenizer and template differ from rollout's): its own cached figure when it reports one,
    else the share of its prompt that rollout reused without rendering for this request
    (`reused` of `rendered` context tokens, scaled). Never more than the input."""
    if reported is not None:
        return max(0, min(reported, input_tokens))
    if rendered <= 0:
        return 0
    return min(input_tokens, input_tokens * reused // rendered)


def usage_of(progress: Progress) -> Usage:
    return Usage.of(
        input_tokens=progress.input_tokens,
        output_tokens=progress.output_tokens,
        cached_tokens=progress.cached_tokens,
    )


def _sample_request(
    state: ResponseState,
    request: ResponseCreate,
    owner: str | None = None,
    holders: tuple[Holder, ...] = (),
    observe: Callable[[str, float], None] | None = None,
) -> SampleRequest:
    """What the backend sees: the state's context (a view, never a copy) and the request's
    sampling parameters."""
    return SampleRequest(
        model=state.route.model,
        params=state.route.params,
        context_digest=state.context_digest,
        context_tokens=state.context_tokens,
        items=state.items,
        instructions=state.prefix.instructions,
        tools=state.prefix.offered,
        tool_choice=request.tool_choice or "auto",
        parallel_tool_calls=request.parallel_tool_calls is not False,
        max_output_tokens=request.max_output_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        calls_since_user=state.calls_since_user,
        media_since_user=state.media_since_user,
        text_format=request.text.format if request.text is not None else None,
        prefix_tokens=state.prefix.tokens,
        item_tokens=state.lineage.tokens,
        n_item_tokens=state.item_tokens,
        owner=owner,
        holders=holders,
        observe=observe,
        derived=state.lineage.derived,
    )
