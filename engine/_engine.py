"""The engine, sessions, and the one sampling loop every mode shares.

- `Engine` owns what is shared across connections: the pipeline stages, the model registry,
  the store, the usage ledger, the post-inference worker, the work counters.
- `Session` is the connection scope: a bounded cache of `ResponseState`s (the WebSocket handler
  owns one per socket; an HTTP request uses a throwaway one) and the rollouts in flight.
- `Session.create` runs a response: stateless (no `previous_response_id`) or continuing a
  parent from the cache or the store. `Session.open_rollout` runs the rollout extension: one
  long-lived response whose sampling coroutine suspends at tool calls (`response.done`) and
  resumes when `Rollout.append` has delivered every pending output.

The three modes differ only in where the parent state comes from and whether the loop in
`Session._run` suspends at tool calls; every stage is shared. That is what makes them equal.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import typing
from array import array
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

import attrs
import trio
from rollout.protocol import (
    BuiltinTool,
    CallKind,
    Compaction,
    ErrorBody,
    InvalidToolPayload,
    Item,
    ItemReference,
    ReasoningConfig,
    RemoteProtocolError,
    Response,
    ResponseAppend,
    ResponseCreate,
    ResponseError,
    ResponseStream,
    ServerEvent,
    TextConfig,
    Usage,
    as_listed,
    call_of,
    echo_tools,
    to_wire,
)

from ._compact import (
    DEFAULT_COMPACT_BUDGET,
    CompactionPolicy,
    SnapshotSeal,
    compact_state,
    restore_state,
)
from ._counters import Counters, StageTimer
from ._errors import BackendError
from ._ids import new_id
from ._interfaces import (
    ArgsDelta,
    CallEnd,
    CallStart,
    Classifier,
    Finish,
    HostedCall,
    HostedTool,
    ItemLookupStore,
    Renderer,
    ResponseStore,
    SampleEvent,
    SampleRequest,
    StoredResponse,
    TextDelta,
    TextEnd,
    TextStart,
    UsageLedger,
    UsageRecord,
)
from ._models import ModelRegistry
from ._pipeline import ConversationValidator, Pipeline, Validator, invalid, normalize_input
from ._postinfer import PostInference, PostJob
from ._state import Lineage, Prefix, ResponseState, Route, digest_tokens

__all__ = [
    "DEFAULT_CACHE_RESPONSES",
    "DEFAULT_CACHE_TOKENS",
    "DEFAULT_ROLLOUT_SUSPEND_LIMIT",
    "Emit",
    "Engine",
    "ResponseCache",
    "Rollout",
    "Session",
    "open_engine",
    "previous_response_not_found",
]

Emit = Callable[[ServerEvent], Awaitable[None]]
_Raw = typing.TypeVar("_Raw", str, bytes)
_Decoded = typing.TypeVar("_Decoded")

# Responses a connection keeps for previous_response_id continuation. OpenAI keeps the most
# recent one; a few more let a client retry or fork from an earlier turn without the store.
DEFAULT_CACHE_RESPONSES = 8
# Total rendered tokens a connection's cache may hold (about 4 bytes each, plus items): bounds
# memory per connection at roughly 100 MB for the largest contexts.
DEFAULT_CACHE_TOKENS = 8_000_000
# How long a suspended rollout waits for its tool outputs before it ends `incomplete`.
DEFAULT_ROLLOUT_SUSPEND_LIMIT = 600.0
# Events a rollout may buffer for a reader that is slower than sampling (embedded API).
ROLLOUT_EVENT_BUFFER = 256
# Client messages at least this large are decoded in a worker thread: parsing one takes long
# enough to stall every other connection (a 5 MB body of 1.7 million empty arrays parses in
# ~0.8 s; the decoder itself stops at the first bad element).
OFFLOAD_DECODE_BYTES = 256 * 1024
# Large decodes at once: each holds its parsed JSON (several times its size) in memory.
MAX_CONCURRENT_LARGE_DECODES = 2
# Sampling steps one response may spend on hosted tools before its model must answer the
# client (a model that keeps searching cannot hold a response forever).
MAX_HOSTED_ROUNDS = 16


log = logging.getLogger("rollout.engine")

# What a response that failed on an unexpected error says (the traceback goes to the log).
_SERVER_ERROR = ResponseError(
    code="server_error",
    message="The server had an error while processing your request. Sorry about that!",
)


# What a response interrupted by a shutdown past the grace period says.
_SHUTDOWN_ERROR = ResponseError(
    code="server_error",
    message="The server is shutting down; this response was interrupted. Retry it.",
)


def server_error() -> RemoteProtocolError:
    """The request error for an unexpected failure before a response started (HTTP 500)."""
    return RemoteProtocolError(
        ErrorBody(type="server_error", code="server_error", message=_SERVER_ERROR.message),
        status=500,
    )


def shutting_down() -> RemoteProtocolError:
    """The request error for a create that arrives after the grace period of a shutdown."""
    return RemoteProtocolError(
        ErrorBody(
            type="server_error",
            code="server_error",
            message="The server is shutting down; retry the request on another connection.",
        ),
        status=503,
    )


def previous_response_not_found(response_id: str) -> RemoteProtocolError:
    return RemoteProtocolError.invalid(
        f"Previous response with id '{response_id}' not found.",
        code="previous_response_not_found",
        param="previous_response_id",
    )


class _NoBackend:
    """The backend of the empty state's route: nothing samples before a model is routed."""

    def sample(self, request: SampleRequest) -> AsyncGenerator[SampleEvent, None]:
        raise AssertionError("sampling before the route stage")


_NO_ROUTE = Route(model="", name="", params={}, context_window=0, backend=_NoBackend())
_EMPTY_PREFIX = Prefix(
    instructions=None,
    tools=(),
    offered=(),
    tokens=array("I"),
    digest=digest_tokens(array("I")),
    classifier_state=None,
)


class ResponseCache:
    """A connection's ResponseStates, least recently used evicted first, bounded by count and
    by the rendered tokens held (lineages shared by several states are counted once)."""

    def __init__(
        self,
        max_responses: int = DEFAULT_CACHE_RESPONSES,
        max_tokens: int = DEFAULT_CACHE_TOKENS,
    ) -> None:
        if max_responses < 1:
            raise ValueError("max_responses must be >= 1")
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self._states: OrderedDict[str, ResponseState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._states

    def get(self, response_id: str) -> ResponseState | None:
        state = self._states.get(response_id)
        if state is not None:
            self._states.move_to_end(response_id)
        return state

    def put(self, state: ResponseState) -> None:
        self._states[state.id] = state
        self._states.move_to_end(state.id)
        while len(self._states) > self.max_responses or (
            len(self._states) > 1 and self.tokens_held() > self.max_tokens
        ):
            self._states.popitem(last=False)

    def evict(self, response_id: str) -> None:
        self._states.pop(response_id, None)

    def tokens_held(self) -> int:
        lineages = {id(s.lineage): s.lineage for s in self._states.values()}
        return sum(len(lin.tokens) for lin in lineages.values())


@attrs.define
class _Progress:
    """What the step being sampled has produced so far (for usage on interruption)."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    started: bool = False


@attrs.frozen(kw_only=True, eq=False)
class _Step:
    state: ResponseState
    finish: str
    usage: Usage
    pending_outputs: list[Item] = attrs.field(factory=list)
    hosted: bool = False  # hosted tools ran: the model samples again in this response


class Engine:
    """Shared machinery. Open one with `open_engine()`."""

    def __init__(
        self,
        *,
        registry: ModelRegistry,
        renderer: Renderer,
        classifier: Classifier,
        validator: Validator,
        store: ResponseStore | None,
        ledger: UsageLedger | None,
        wall_clock: Callable[[], float] = time.time,
        rollout_suspend_limit: float = DEFAULT_ROLLOUT_SUSPEND_LIMIT,
        compaction_key: bytes | None = None,
        hosted_tools: Sequence[HostedTool] = (),
    ) -> None:
        self.counters = Counters()
        # Executors of hosted tools by type: those types are offered to the model.
        self.hosted: dict[str, HostedTool] = {tool.type: tool for tool in hosted_tools}
        # Seals compaction snapshots. Without a configured key it is per process: compaction
        # items then work only with this process (`rollout serve` keeps one in its data dir).
        self.seal = SnapshotSeal(compaction_key or os.urandom(32))
        self.timer = StageTimer()
        self.registry = registry
        self.store = store
        self.ledger = ledger
        self.wall_clock = wall_clock
        self.rollout_suspend_limit = rollout_suspend_limit
        self.pipeline = Pipeline(
            validator=validator,
            renderer=renderer,
            classifier=classifier,
            registry=registry,
            counters=self.counters,
            timer=self.timer,
            hosted=frozenset(self.hosted),
        )
        self.post = PostInference(store=store, ledger=ledger, counters=self.counters)
        self.decode_limiter = trio.CapacityLimiter(MAX_CONCURRENT_LARGE_DECODES)
        self.draining = False  # interrupt_all() was called: the server is going away
        self._interruptible: set[trio.CancelScope] = set()
        self.responses_by_status: dict[str, int] = {}

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[trio.CancelScope]:
        """A scope `interrupt_all` cancels (a response's sampling and suspensions)."""
        with trio.CancelScope() as scope:
            if self.draining:
                scope.cancel()
            self._interruptible.add(scope)
            try:
                yield scope
            finally:
                self._interruptible.discard(scope)

    def interrupt_all(self) -> None:
        """Shutdown past the grace period: every response still running ends now (with a
        terminal event), and new ones are refused."""
        self.draining = True
        for scope in list(self._interruptible):
            scope.cancel()

    async def decode(self, decode: Callable[[_Raw], _Decoded], data: _Raw) -> _Decoded:
        """Decode a client message: inline when small, else in a worker thread (at most
        `MAX_CONCURRENT_LARGE_DECODES` at once), so the event loop keeps serving others."""
        self.counters.bytes_decoded += len(data)
        if len(data) < OFFLOAD_DECODE_BYTES:
            with self.timer.measure("decode"):
                return decode(data)
        async with self.decode_limiter:
            self.counters.offloaded_decodes += 1
            with self.timer.measure("decode"):  # wall time, the thread's wait included
                return await trio.to_thread.run_sync(decode, data)

    def session(
        self,
        *,
        owner: str | None = None,
        max_cached_responses: int = DEFAULT_CACHE_RESPONSES,
        max_cached_tokens: int = DEFAULT_CACHE_TOKENS,
    ) -> Session:
        return Session(
            self, owner=owner, cache=ResponseCache(max_cached_responses, max_cached_tokens)
        )

    def now(self) -> int:
        return int(self.wall_clock())

    def empty_state(self) -> ResponseState:
        return ResponseState(
            response=Response(id="", created_at=0, model=""),
            lineage=Lineage(),
            n_items=0,
            prefix=_EMPTY_PREFIX,
            classifier_state=self.pipeline.classifier.initial(),
            route=_NO_ROUTE,
            open_calls=(),
            stored=True,
            first_new_item=0,
        )

    async def get_stored(self, response_id: str, *, owner: str | None) -> StoredResponse | None:
        """A stored response (including one whose write is still queued)."""
        pending = self.post.pending_get(response_id)
        if pending is not None:
            return pending if pending.owner == owner else None
        if self.store is None:
            return None
        self.counters.store_reads += 1
        return await self.store.get(response_id, owner=owner)

    async def find_stored_item(self, item_id: str, *, owner: str | None) -> Item | None:
        """An item of a stored response, by item id (queued writes first, then the store)."""
        for stored in self.post.pending_items():
            if stored.owner == owner:
                for item in stored.items:
                    if getattr(item, "id", None) == item_id:
                        return item
        if not isinstance(self.store, ItemLookupStore):
            return None
        self.counters.store_reads += 1
        return await self.store.get_item(item_id, owner=owner)

    async def delete_stored(self, response_id: str, *, owner: str | None) -> bool:
        pending = self.post.pending_get(response_id)
        if pending is not None and pending.owner == owner:
            self.post.forget(response_id)
            if self.store is not None:
                await self.store.delete(response_id, owner=owner)
            return True
        if self.store is None:
            return False
        return await self.store.delete(response_id, owner=owner)

    async def stored_chain(self, response_id: str, *, owner: str | None) -> list[StoredResponse]:
        """The stored response and its ancestors up to a root, newest first. Writes still
        queued are read first; the rest comes from the store in one call. Raises LookupError."""
        chain: list[StoredResponse] = []
        current = response_id
        while (pending := self.post.pending_get(current)) is not None:
            if pending.owner != owner:
                raise LookupError(current)
            chain.append(pending)
            if pending.is_root or pending.parent_id is None:
                return chain
            current = pending.parent_id
        if self.store is None:
            raise LookupError(current)
        rest = await self.store.get_chain(current, owner=owner)
        self.counters.store_reads += len(rest)
        return chain + list(rest)

    def record_status(self, status: str) -> None:
        self.responses_by_status[status] = self.responses_by_status.get(status, 0) + 1
        if status == "completed":
            self.counters.responses_completed += 1
        elif status == "incomplete":
            self.counters.responses_incomplete += 1
        elif status == "failed":
            self.counters.responses_failed += 1


class Session:
    """The connection scope. Not safe for concurrent `create`s: callers serialize them
    (the WebSocket handler runs its FIFO queue one request at a time)."""

    def __init__(self, engine: Engine, *, owner: str | None, cache: ResponseCache) -> None:
        self.engine = engine
        self.owner = owner
        self.cache = cache
        self.rollouts: dict[str, Rollout] = {}
        self.last_timings: dict[str, float] = {}

    # --- parents ---
    async def resolve(self, response_id: str, timings: dict[str, float]) -> ResponseState:
        counters = self.engine.counters
        with self.engine.timer.measure("resolve", timings):
            state = self.cache.get(response_id)
            if state is not None:
                counters.cache_hits += 1
                return state
            counters.cache_misses += 1
        with self.engine.timer.measure("store", timings):
            try:
                chain = await self.engine.stored_chain(response_id, owner=self.owner)
            except LookupError:
                raise previous_response_not_found(response_id) from None
        return self._hydrate(chain, timings)

    def _hydrate(self, chain: list[StoredResponse], timings: dict[str, float]) -> ResponseState:
        """Rebuild a state from stored responses (newest first): re-render and re-classify."""
        engine = self.engine
        engine.counters.hydrations += 1
        target = chain[0]
        items: list[Item] = []
        for stored in reversed(chain):
            items.extend(stored.items)
        root = engine.empty_state()
        pipeline = engine.pipeline
        route = pipeline.route(target.response.model, None, timings)
        prefix = pipeline.prefix(target.instructions, target.tools, None, timings)
        staged = pipeline.stage(
            items,
            lineage=root.lineage,
            n_items=0,
            classifier_state=root.classifier_state,
            open_calls={},
            param="input",
            timings=timings,
        )
        own = 0 if target.is_root else len(items) - len(target.items)
        state = pipeline.commit(
            root, staged, prefix=prefix, route=route, first_new_item=own, response=target.response
        )
        self.cache.put(state)
        return state

    # --- responses ---
    async def create(
        self, request: ResponseCreate, emit: Emit | None = None
    ) -> ResponseState | None:
        """Run one response (stateless or continuing), sending its events to `emit`.
        Returns the final state (None when the response failed). Request errors raise
        `RemoteProtocolError` before any event is sent."""
        if request.rollout:
            raise invalid(
                "Use open_rollout() (or the WebSocket transport) for rollout mode.",
                param="rollout",
            )
        return await self._run(request, emit or _discard, rollout=None)

    async def respond(self, request: ResponseCreate) -> Response:
        """Run one response and return the final Response object."""
        final: list[Response] = []

        async def keep(event: ServerEvent) -> None:
            response = getattr(event, "response", None)
            if response is not None:
                final[:] = [response]

        await self._run(request, keep, rollout=None)
        return final[-1]

    @asynccontextmanager
    async def open_rollout(self, request: ResponseCreate) -> AsyncIterator[Rollout]:
        """Run `request` as a rollout: iterate the Rollout for events up to each suspension,
        `append` the tool outputs, iterate again, until `rollout.response` is final."""
        send, recv = trio.open_memory_channel[ServerEvent](ROLLOUT_EVENT_BUFFER)
        rollout = Rollout(self, recv)
        async with trio.open_nursery() as nursery:

            async def body() -> None:
                # Closed with the synchronous close(), not `async with send`: aclose()'s
                # checkpoint would let the reader leave the block and cancel this task while
                # an exception is on its way out, and Cancelled would replace (lose) it.
                try:
                    await self._run(request, send.send, rollout=rollout)
                except RemoteProtocolError as exc:
                    # Kept without its traceback: the traceback's frames hold `rollout`,
                    # which would hold the error back (a reference cycle per failed rollout).
                    rollout.error = exc.with_traceback(None)
                    await send.send(exc.error_event())
                finally:
                    send.close()

            nursery.start_soon(body)
            try:
                yield rollout
            finally:
                # A rollout left before its end is cancelled (its usage is still recorded);
                # one that ended is left to finish its post-inference hand-off.
                if not rollout.ended:
                    nursery.cancel_scope.cancel()

    async def prepare_only(self, request: ResponseCreate) -> ResponseState:
        """The state a request would sample from (validated, rendered, classified), without
        sampling: for counting input tokens and for compaction."""
        timings: dict[str, float] = {}
        parent = None
        if request.previous_response_id is not None:
            parent = await self.resolve(request.previous_response_id, timings)
        new_items, root = await self._resolve_inputs(normalize_input(request.input), parent)
        prepared = self.engine.pipeline.prepare(
            request,
            parent,
            root=root,
            new_items=new_items,
            timings=timings,
            require_outputs=False,
            offset=_input_offset(request),
        )
        return prepared.state

    async def compact(
        self, request: ResponseCreate, *, budget_tokens: int = DEFAULT_COMPACT_BUDGET
    ) -> dict[str, Any]:
        """`POST /v1/responses/compact`: the compacted window of a conversation (given as
        input items or previous_response_id), ending with its compaction item."""
        engine = self.engine
        source = await self.prepare_only(request)
        window, item = compact_state(
            engine.pipeline,
            source,
            CompactionPolicy(budget_tokens=budget_tokens),
            engine.seal,
            owner=self.owner,
        )
        usage = Usage.of(input_tokens=source.context_tokens, output_tokens=window.item_tokens)
        return {
            "id": new_id("resp"),
            "object": "response.compaction",
            "created_at": engine.now(),
            "output": [to_wire(as_listed(i)) for i in [*window.items, item]],
            "usage": to_wire(usage),
        }

    async def run_rollout(self, request: ResponseCreate, emit: Emit, rollout: Rollout) -> None:
        """Server-side form: run the rollout in the caller's task, emitting to `emit`."""
        await self._run(request, emit, rollout=rollout)

    # --- the loop every mode shares ---
    async def _run(
        self, request: ResponseCreate, emit: Emit, *, rollout: Rollout | None
    ) -> ResponseState | None:
        engine = self.engine
        pipeline = engine.pipeline
        if engine.draining:
            raise shutting_down()
        timings: dict[str, float] = {}
        self.last_timings = timings
        new_items = normalize_input(request.input)
        parent: ResponseState | None = None
        generate = _generates(request)
        hydrated = False
        try:
            if request.previous_response_id is not None:
                hydrated = request.previous_response_id not in self.cache
                parent = await self.resolve(request.previous_response_id, timings)
            threshold = _compact_threshold(request)
            new_items, root = await self._resolve_inputs(new_items, parent)
            prepared = pipeline.prepare(
                request,
                parent,
                root=root,
                new_items=new_items,
                timings=timings,
                require_outputs=generate,
                offset=_input_offset(request),
            )
        except RemoteProtocolError:
            engine.counters.request_errors += 1
            if parent is not None:
                self.cache.evict(parent.id)
            raise
        except Exception:
            log.exception("a request failed before its response started")
            engine.counters.request_errors += 1
            raise server_error() from None

        assert request.model is not None
        response = Response(
            id=new_id("resp"),
            created_at=engine.now(),
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
        stream = ResponseStream(response)
        if rollout is not None:
            # Named before `response.created` goes out: a client may answer that event at once
            # (an early append must get `rollout_not_suspended`, not `rollout_not_found`).
            rollout.response_id = response.id
        for event in stream.start():
            await emit(event)
        if rollout is not None:
            self.rollouts[response.id] = rollout

        records: list[UsageRecord] = []
        progress = _Progress()
        submitted = False
        state = prepared.state
        total = Usage()
        parent_stored = root.stored
        try:
            if prepared.flags:
                flag = prepared.flags[0]
                await self._fail(
                    stream,
                    emit,
                    parent,
                    ResponseError(
                        code="invalid_prompt",
                        message=f"The input was flagged by the {flag.classifier} classifier: "
                        f"{flag.message}",
                    ),
                    None,
                )
                return None
            if not generate:
                final = stream.complete(usage=Usage(), completed_at=engine.now())
                warmed = await self._finish(state, final.response, parent_stored, [])
                submitted = True
                engine.record_status("completed")
                await emit(final)  # after the commit: acknowledged means durable
                return warmed

            if threshold is not None and state.context_tokens > threshold:
                # Automatic compaction: the conversation continues from the compacted window,
                # whose compaction item goes out as the response's first output item.
                state, item = compact_state(
                    pipeline,
                    state,
                    CompactionPolicy(budget_tokens=threshold // 2),
                    engine.seal,
                    owner=self.owner,
                )
                for event in stream.add_item(item):
                    await emit(event)
                prepared = attrs.evolve(prepared, cached_tokens=0)
            # Cached tokens are context tokens reused without rendering them for this request:
            # none when the parent was just hydrated (re-rendered from the store).
            cached = 0 if hydrated else prepared.cached_tokens
            step = 0
            hosted_rounds = 0
            with engine.interruptible() as interrupted:
                while True:
                    progress = _Progress()
                    try:
                        result = await self._sample(state, request, stream, emit, cached, progress)
                    except BackendError as exc:
                        records.append(self._record(response, step, progress, complete=False))
                        usage = total + _usage_of(progress)
                        progress = _Progress()  # recorded (a cancellation rewrites the same rows)
                        await engine.post.commit(PostJob(records=records))
                        submitted = True
                        await self._fail(
                            stream,
                            emit,
                            parent,
                            ResponseError(code=exc.code, message=exc.message),
                            usage,
                        )
                        return None
                    records.append(self._record(response, step, progress, complete=True))
                    progress = _Progress()
                    total = total + result.usage
                    before = state.context_tokens
                    state = result.state
                    step += 1
                    if result.finish == "max_output_tokens":
                        first = stream.output_count
                        events = stream.incomplete(
                            reason="max_output_tokens", usage=total, completed_at=engine.now()
                        )
                        for event in events[:-1]:  # the open item closed; the terminal one waits
                            await emit(event)
                        terminal = events[-1]
                        state = self._extend(
                            state, result.pending_outputs + stream.output_since(first)
                        )
                        break
                    if result.hosted and not state.open_calls and hosted_rounds < MAX_HOSTED_ROUNDS:
                        hosted_rounds += 1  # the hosted tools' results are in: sample again
                        cached = before
                        continue
                    if rollout is not None and state.open_calls:
                        before = state.context_tokens
                        rollout._suspend(state)  # appends are accepted from response.done on
                        await emit(stream.suspend([cid for cid, _ in state.open_calls]))
                        resumed = await rollout._wait_resume(engine.rollout_suspend_limit)
                        self.last_timings = rollout.timings
                        if resumed is None:
                            events = stream.incomplete(
                                reason="rollout_timeout", usage=total, completed_at=engine.now()
                            )
                            for event in events[:-1]:
                                await emit(event)
                            terminal = events[-1]
                            break
                        state, flags = resumed
                        if flags:
                            await engine.post.commit(PostJob(records=records))
                            submitted = True
                            await self._fail(
                                stream,
                                emit,
                                None,
                                ResponseError(
                                    code="invalid_prompt",
                                    message=f"The appended input was flagged by the "
                                    f"{flags[0].classifier} classifier: {flags[0].message}",
                                ),
                                total,
                            )
                            return None
                        await emit(stream.resume())
                        cached = before
                        continue
                    terminal = stream.complete(usage=total, completed_at=engine.now())
                    break
            if interrupted.cancelled_caught:
                # The server is shutting down past its grace period: the response ends with
                # a terminal event (its usage committed first), not a cut stream.
                if progress.started:
                    records.append(self._record(response, step, progress, complete=False))
                    progress = _Progress()
                await engine.post.commit(PostJob(records=records))
                submitted = True
                failed = stream.abort(error=_SHUTDOWN_ERROR, usage=total + _usage_of(progress))
                engine.record_status("failed")
                if failed is not None:
                    await emit(failed)
                return None
            final_response = terminal.response  # type: ignore[union-attr]
            # Commit before the terminal event: once a client sees it, the stored response
            # and its usage are durable.
            final_state = await self._finish(state, final_response, parent_stored, records)
            submitted = True
            engine.record_status(final_response.status)
            await emit(terminal)
            return final_state
        except Exception as exc:
            # A bug, ours or a backend's: the response fails (with a logged traceback); the
            # connection, its queue and other responses carry on. A transport that closed
            # under the response (the client left, or stopped reading) is not a bug.
            if isinstance(exc, trio.ClosedResourceError | trio.BrokenResourceError):
                log.info("response %s ended: its connection closed (%s)", response.id, exc)
            else:
                log.exception("response %s failed with an unexpected error", response.id)
            failed = stream.abort(error=_SERVER_ERROR, usage=total + _usage_of(progress))
            if not submitted:
                if progress.started:
                    records.append(self._record(response, len(records), progress, complete=False))
                    progress = _Progress()  # recorded: a cancellation below writes the same rows
                with contextlib.suppress(Exception):  # the writer may be what broke
                    await engine.post.commit(PostJob(records=records))
                submitted = True
            if failed is not None:
                engine.record_status("failed")
                if parent is not None:
                    self.cache.evict(parent.id)
                with contextlib.suppress(Exception):  # the emitter itself may be what broke
                    await emit(failed)
            return None
        finally:
            if rollout is not None:
                rollout._finished()
                self.rollouts.pop(response.id, None)
            if not submitted:
                # Interrupted (disconnect, cancellation): the work done still counts.
                if progress.started:
                    records.append(self._record(response, len(records), progress, complete=False))
                engine.post.submit_nowait(PostJob(records=records))  # never blocks the loop

    async def _resolve_inputs(
        self, items: list[Item], parent: ResponseState | None
    ) -> tuple[list[Item], ResponseState]:
        """Resolve item references and compaction items of the new input. Returns the items
        to stage and the state to stage them onto (the parent, a restored compacted state, or
        an empty state)."""
        engine = self.engine
        root = parent or engine.empty_state()
        last = max(
            (i for i, item in enumerate(items) if isinstance(item, Compaction)), default=None
        )
        start = 0  # the index in the request's input of the first item returned
        if last is not None:
            where = f"input[{last}]"
            if parent is not None:
                raise invalid(
                    "A compaction item starts a new chain: omit previous_response_id.",
                    param=where,
                )
            compaction = items[last]
            assert isinstance(compaction, Compaction)
            payload = engine.seal.open(
                compaction.encrypted_content, param=f"{where}.encrypted_content", owner=self.owner
            )
            root = restore_state(engine.pipeline, root, payload, param=where)
            items = items[last + 1 :]
            start = last + 1
        if any(isinstance(item, ItemReference) for item in items):
            items = [
                await self._dereference(item, parent, start + i) for i, item in enumerate(items)
            ]
        return items, root

    async def _dereference(self, item: Item, parent: ResponseState | None, index: int) -> Item:
        if not isinstance(item, ItemReference):
            return item
        found = parent.lineage.find(item.id, parent.n_items) if parent is not None else None
        if found is None:
            found = await self.engine.find_stored_item(item.id, owner=self.owner)
        if found is None or isinstance(found, ItemReference | Compaction):
            raise invalid(
                f"Item with id '{item.id}' not found.",
                code="item_not_found",
                param=f"input[{index}].id",
            )
        return found

    async def _finish(
        self,
        state: ResponseState,
        final: Response,
        parent_stored: bool,
        records: list[UsageRecord],
    ) -> ResponseState:
        engine = self.engine
        stored = final.store and parent_stored
        state = attrs.evolve(state, response=final, stored=stored)
        self.cache.put(state)
        job_store = None
        if final.store:
            job_store = StoredResponse(
                response=final,
                items=state.own_items
                if parent_stored and state.first_new_item
                else list(state.items),
                instructions=state.prefix.instructions,
                tools=list(state.prefix.tools),
                parent_id=final.previous_response_id,
                is_root=not (parent_stored and state.first_new_item),
                owner=self.owner,
            )
        await engine.post.commit(PostJob(records=records, stored=job_store))
        return state

    async def _fail(
        self,
        stream: ResponseStream,
        emit: Emit,
        parent: ResponseState | None,
        error: ResponseError,
        usage: Usage | None,
    ) -> None:
        await emit(stream.fail(error=error, usage=usage))
        self.engine.record_status("failed")
        if parent is not None:
            self.cache.evict(parent.id)

    def _record(
        self, response: Response, step: int, progress: _Progress, *, complete: bool
    ) -> UsageRecord:
        return UsageRecord(
            response_id=response.id,
            step=step,
            owner=self.owner,
            model=response.model,
            input_tokens=progress.input_tokens,
            cached_tokens=progress.cached_tokens,
            output_tokens=progress.output_tokens,
            complete=complete,
            created_at=self.engine.wall_clock(),
        )

    async def _sample(
        self,
        state: ResponseState,
        request: ResponseCreate,
        stream: ResponseStream,
        emit: Emit,
        cached: int,
        progress: _Progress,
    ) -> _Step:
        """Sample one turn from `state`, stream its events, and extend the state with the
        output items (rendered and classified once, here)."""
        engine = self.engine
        engine.counters.samplings += 1
        progress.started = True
        progress.input_tokens = state.context_tokens
        progress.cached_tokens = cached
        sample_request = SampleRequest(
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
        )
        first_output = stream.output_count
        hosted: tuple[CallStart, list[str]] | None = None  # a hosted tool's call being made
        ran_hosted = False
        finish = "stop"
        measured: tuple[int | None, int | None, int | None] = (None, None, None)
        async with aclosing(state.route.backend.sample(sample_request)) as events:
            async for ev in events:
                if isinstance(ev, TextDelta):
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
                elif isinstance(ev, TextStart):
                    for e in stream.begin_message(new_id("msg")):
                        await emit(e)
                elif isinstance(ev, TextEnd):
                    for e in stream.end_message():
                        await emit(e)
                elif isinstance(ev, CallStart) and ev.kind in engine.hosted:
                    hosted = (ev, [])
                elif isinstance(ev, CallEnd) and hosted is not None:
                    for item in await self._run_hosted(state, hosted[0], "".join(hosted[1])):
                        for e in stream.add_item(item):
                            await emit(e)
                    hosted, ran_hosted = None, True
                elif isinstance(ev, CallStart):
                    kind = typing.cast(CallKind, ev.kind)
                    for e in stream.begin_call(
                        new_id(_CALL_ITEM_PREFIX[kind]),
                        new_id("call", 12),
                        ev.name,
                        kind=kind,
                        namespace=ev.namespace,
                    ):
                        await emit(e)
                elif isinstance(ev, CallEnd):
                    try:
                        ended = stream.end_call()
                    except InvalidToolPayload as exc:
                        raise BackendError(f"The model made an invalid tool call: {exc}.") from None
                    for e in ended:
                        await emit(e)
                elif isinstance(ev, Finish):
                    finish = ev.reason
                    measured = (ev.input_tokens, ev.output_tokens, ev.cached_tokens)
        engine.counters.tokens_sampled += progress.output_tokens
        if measured[1] is not None:
            progress.output_tokens = measured[1]
        if measured[0] is not None:
            progress.cached_tokens = _upstream_cached(
                measured[0], measured[2], cached, state.context_tokens
            )
            progress.input_tokens = measured[0]
        outputs = stream.output_since(first_output)
        usage = _usage_of(progress)
        if finish == "max_output_tokens":
            # The caller closes the open item as incomplete, then extends the state.
            return _Step(state=state, finish=finish, usage=usage, pending_outputs=outputs)
        extended = self._extend(state, outputs)
        return _Step(state=extended, finish=finish, usage=usage, hosted=ran_hosted)

    async def _run_hosted(
        self, state: ResponseState, call: CallStart, arguments: str
    ) -> Sequence[Item]:
        """Run a hosted tool's call with its configured executor; its items join the output."""
        executor = self.engine.hosted[call.kind]
        tool = next(
            (t for t in state.prefix.offered if isinstance(t, BuiltinTool) and t.type == call.kind),
            BuiltinTool(type=call.kind),
        )
        self.engine.counters.hosted_calls += 1
        try:
            return await executor.run(
                HostedCall(tool=tool, arguments=arguments, call_id=new_id("call", 12))
            )
        except Exception as exc:  # an executor's failure fails the response, never the server
            raise BackendError(
                f"The hosted tool {call.kind!r} failed: {type(exc).__name__}: {exc}"
            ) from None

    def _extend(self, state: ResponseState, outputs: Sequence[Item]) -> ResponseState:
        """The state with the model's output items rendered and classified into it. Completed
        function calls become the calls waiting for output."""
        pipeline = self.engine.pipeline
        outputs = [o for o in outputs if not isinstance(o, Compaction)]
        staged = pipeline.stage(
            outputs,
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
            if call is not None and getattr(item, "status", None) == "completed":
                staged.open_calls[call[0]] = call[2]
        return pipeline.commit(state, staged)


# Id prefixes of the tool-call items the model makes, by call kind.
_CALL_ITEM_PREFIX: dict[CallKind, str] = {
    "function": "fc",
    "custom": "ctc",
    "local_shell": "lsh",
    "shell": "sh",
    "apply_patch": "apc",
    "computer": "cu",
}


def _generates(request: ResponseCreate) -> bool:
    """Whether a request samples: not with `generate: false` (a warm-up), nor with
    `prompt_cache_options.prewarm: true`, which overrides `generate` to false."""
    options = request.prompt_cache_options or {}
    return request.generate is not False and options.get("prewarm") is not True


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


def _input_offset(request: ResponseCreate) -> int:
    """The index in the request's input of the first item staged (after a compaction item)."""
    items = normalize_input(request.input)
    return max((i + 1 for i, item in enumerate(items) if isinstance(item, Compaction)), default=0)


def _compact_threshold(request: ResponseCreate) -> int | None:
    """`context_management: [{"type": "compaction", "compact_threshold": N}]` -> N."""
    for entry in request.context_management or ():
        if entry.get("type") == "compaction":
            value = entry.get("compact_threshold")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
            raise invalid(
                "context_management compaction needs a positive integer compact_threshold.",
                param="context_management",
            )
    return None


def _usage_of(progress: _Progress) -> Usage:
    return Usage.of(
        input_tokens=progress.input_tokens,
        output_tokens=progress.output_tokens,
        cached_tokens=progress.cached_tokens,
    )


async def _discard(_event: ServerEvent) -> None:
    return None


_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})


class Rollout:
    """A rollout in flight (the extension). Iterate it for events up to the next suspension
    or the end; `pending_calls` names the calls whose outputs resume it; `append` delivers
    outputs. Missing outputs are waited for: a partial append is accepted, and the rollout
    resumes when every pending call has its output."""

    def __init__(
        self, session: Session, events: trio.MemoryReceiveChannel[ServerEvent] | None = None
    ) -> None:
        self.session = session
        self.response_id: str | None = None
        self.error: RemoteProtocolError | None = None
        self.response: Response | None = None
        self._events = events
        self._state: ResponseState | None = None  # set while suspended
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
            response = getattr(event, "response", None)
            if response is not None:
                self.response = response
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

    def _suspend(self, state: ResponseState) -> None:
        self._state = state
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


@asynccontextmanager
async def open_engine(
    *,
    registry: ModelRegistry | None = None,
    renderer: Renderer | None = None,
    classifier: Classifier | None = None,
    validator: Validator | None = None,
    store: ResponseStore | None = None,
    ledger: UsageLedger | None = None,
    wall_clock: Callable[[], float] = time.time,
    rollout_suspend_limit: float = DEFAULT_ROLLOUT_SUSPEND_LIMIT,
    compaction_key: bytes | None = None,
    hosted_tools: Sequence[HostedTool] = (),
) -> AsyncIterator[Engine]:
    """Open an engine. Defaults: the built-in `sim` models, the o200k chat-template
    renderer, the default classifiers, no store and no ledger (pass SQLite ones, see
    `open_sqlite_store` / `open_sqlite_ledger`, for durability)."""
    from ._classify import default_classifiers
    from ._defaults import default_registry
    from ._render import ChatTemplateRenderer
    from ._tokenizer import O200kTokenizer

    engine = Engine(
        registry=registry or default_registry(),
        renderer=renderer or ChatTemplateRenderer(O200kTokenizer()),
        classifier=classifier or default_classifiers(),
        validator=validator
        or ConversationValidator(hosted=frozenset(tool.type for tool in hosted_tools)),
        store=store,
        ledger=ledger,
        wall_clock=wall_clock,
        rollout_suspend_limit=rollout_suspend_limit,
        compaction_key=compaction_key,
        hosted_tools=hosted_tools,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.post.run)
        try:
            yield engine
        finally:
            with trio.CancelScope(shield=True):
                await engine.post.aclose()
