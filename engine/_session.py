"""The connection scope: a `Session` holds a connection's cache of response states, resolves a
`previous_response_id` (the cache, else the store, hydrated) and hands each response to
pre-inference (`_preinfer.py`) once.

- `prepare`: the parent (`resolve_parent`), then one hand-off, `_preinfer.pre_infer` (route,
  the input's references and compaction items, the render cache, the pipeline's validate /
  render / classify on the new items). Steering input parked for the parent (`parked`) goes
  before the new items; a request error leaves it parked, and a failed continuation evicts
  its parent from the cache.
- Hydration rebuilds a state from stored responses when the parent is not cached: from their
  stored renderings, else rendered again onto what the render cache holds.

The transports enter through thin doors: `run` (the WebSocket lanes hand their `EventSink`;
`prepare`, then `_steered.run_steered`, the rollout coroutine and any steered successors),
`create` and `respond` (HTTP, embedded: a function as the sink), `open_rollout` (embedded: a
memory channel as the sink, read by the `Rollout` handle), `steer` (`_steered.steer`), and
`prepare_only` and `compact` for the HTTP API's other routes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio
from rollout.protocol import (
    Item,
    RemoteProtocolError,
    Response,
    ResponseCreate,
    ResponseSteer,
    ResponseSteerFailed,
    ServerEvent,
    multi_agent_enabled,
    response_of,
)

from ._cache import ResponseCache
from ._compact import DEFAULT_COMPACT_BUDGET
from ._compaction import compaction
from ._errors import previous_response_not_found, server_error, shutting_down
from ._interfaces import Holder, StoredResponse
from ._preinfer import Prepared, cached_prefix, pre_infer, prepare_state
from ._rollout import Rollout
from ._segments import restore_segments
from ._sink import DISCARD, CallbackSink, Emit, EventSink
from ._state import ResponseState
from ._steer import ParkedSteers, QueuedSteer, Steering
from ._steered import run_steered, steer
from ._validate import invalid

if TYPE_CHECKING:
    from ._services import EngineServices

__all__ = ["ROLLOUT_EVENT_BUFFER", "Session"]

log = logging.getLogger("rollout.engine")

# Events a rollout may buffer for a reader that is slower than sampling (embedded API).
ROLLOUT_EVENT_BUFFER = 256


class Session:
    """The connection scope. Its responses may run concurrently (the WebSocket handler runs
    one per busy lane): each keeps its own timings, and the cache follows the lanes
    (`_cache.py`); a request's lane is its `stream_id`."""

    def __init__(
        self,
        engine: EngineServices,
        *,
        owner: str | None,
        cache: ResponseCache,
        keeps_state: bool = False,
    ) -> None:
        self.engine = engine
        self.owner = owner
        self.cache = cache
        # A connection that outlives its responses (WebSocket mode) lets backends keep state
        # for each lane's next turn (a model's KV sequence), until `close`.
        self.keeps_state = keeps_state
        self._holders: dict[str | None, Holder] = {}
        self.last_timings: dict[str, float] = {}
        self.steerable: dict[str, Steering] = {}  # the running responses, by id
        self.parked = ParkedSteers()  # steering input waiting for a continuation

    def lane_holder(self, lane: str | None) -> Holder | None:
        """The holder of backend state kept for `lane`'s next turn (one per lane: lanes are
        bounded by the connection), None for a session that does not keep state."""
        if not self.keeps_state:
            return None
        holder = self._holders.get(lane)
        if holder is None:
            holder = self._holders[lane] = Holder(f"lane {lane or 'default'}")
        return holder

    def close(self) -> None:
        """The connection ended: backend state kept for its lanes is released."""
        holders, self._holders = self._holders, {}
        self.keeps_state = False
        for holder in holders.values():
            holder.release()

    # --- parents ---
    async def resolve_parent(
        self, response_id: str, timings: dict[str, float], *, lane: str | None = None
    ) -> tuple[ResponseState, int]:
        """The state a `previous_response_id` names: this connection's cache, else the store
        (for this owner), whose answer the render cache may then spare re-rendering; a state
        found that way joins the cache on `lane`, the lane that asked for it. With it, the
        context tokens rendered to rebuild it (none when a cache or the stored renderings
        had it)."""
        engine = self.engine
        counters = engine.counters
        with engine.timer.measure("resolve", timings):
            state = self.cache.get(response_id)
            if state is not None:
                counters.cache_hits += 1
                return state, 0
            counters.cache_misses += 1
        with engine.timer.measure("store", timings):
            # The response itself confirms the id for this owner; its ancestors are read
            # only when the render cache does not have the conversation.
            stored = await engine.get_stored(response_id, owner=self.owner)
            if stored is None:
                raise previous_response_not_found(response_id)
        state = engine.render_cache.by_response(self.owner, response_id)
        rendered = 0
        if state is None:
            chain = [stored]
            if not stored.is_root and stored.parent_id is not None:
                with engine.timer.measure("store", timings):
                    try:
                        chain += await engine.stored_chain(stored.parent_id, owner=self.owner)
                    except LookupError:
                        raise previous_response_not_found(response_id) from None
            state, rendered = self._hydrate(chain, timings)
        self.cache.put(state, lane=lane)
        return state, rendered

    def _hydrate(
        self, chain: list[StoredResponse], timings: dict[str, float]
    ) -> tuple[ResponseState, int]:
        """Rebuild a state from stored responses (newest first): from their stored renderings
        when they all have one of this renderer (nothing rendered), else what the render cache
        holds of the conversation is reused and the rest rendered and classified. Returns the
        state and the context tokens rendered for it."""
        engine = self.engine
        engine.counters.hydrations += 1
        target = chain[0]
        pipeline = engine.pipeline
        route = engine.router.route(target.response.model, None, timings)
        with engine.timer.measure("resolve", timings):
            state = restore_segments(pipeline, engine.empty_state(), chain, route)
        if state is not None:
            engine.render_cache.put(self.owner, state)
            return state, 0
        items: list[Item] = []
        for stored in reversed(chain):
            items.extend(stored.items)
        version = route.bound_version
        known = engine.render_cache.prefix(self.owner, target.instructions, target.tools, version)
        prefix = pipeline.prefix(target.instructions, target.tools, timings, known, route=route)
        root, rest = cached_prefix(engine, self.owner, items, version, timings=timings)
        staged = pipeline.stage(
            rest,
            route=route,
            lineage=root.lineage,
            n_items=root.n_items,
            classifier_state=root.classifier_state,
            open_calls=dict(root.open_calls),
            param="input",
            timings=timings,
        )
        own = 0 if target.is_root else len(items) - len(target.items)
        state = root.commit(
            staged, prefix=prefix, route=route, first_new_item=own, response=target.response
        )
        engine.render_cache.put(self.owner, state)
        return state, staged.n_tokens + (0 if prefix is known else len(prefix.tokens))

    # --- the transports' doors: thin adapters onto `run` ---
    async def run(
        self,
        request: ResponseCreate,
        sink: EventSink,
        rollout: Rollout | None = None,
        *,
        timings: dict[str, float] | None = None,
    ) -> ResponseState | None:
        """Run one response into `sink` (a rollout's with `rollout`): pre-inference here, then
        the rollout coroutine and any steered successors (`_steered.run_steered`), which push
        their events down into the sink. Returns the final state (None when the response
        failed). Request errors raise `RemoteProtocolError` before any event is sent.
        `timings`: stages already timed for this request (its decode); pre-inference adds its
        stages to it (and `last_timings` is it)."""
        prepared = await self.prepare(request, timings)
        return await run_steered(self, prepared, request, sink, rollout)

    async def create(
        self,
        request: ResponseCreate,
        emit: Emit | None = None,
        *,
        timings: dict[str, float] | None = None,
    ) -> ResponseState | None:
        """HTTP's and the embedded API's door: `run` a response that is no rollout, sending
        its events to `emit` (a function)."""
        if request.rollout:
            raise invalid(
                "Use open_rollout() (or the WebSocket transport) for rollout mode.",
                param="rollout",
            )
        if multi_agent_enabled(request):
            raise invalid(
                "A multi-agent response waits for response.inject: run it over the WebSocket "
                "transport, on a connection opened with the multi-agent beta.",
                code="unsupported_parameter",
                param="multi_agent",
            )
        return await self.run(
            request, DISCARD if emit is None else CallbackSink(emit), None, timings=timings
        )

    async def respond(self, request: ResponseCreate) -> Response:
        """Run one response and return the final Response object."""
        final: list[Response] = []

        async def keep(event: ServerEvent) -> None:
            response = response_of(event)
            if response is not None:
                final[:] = [response]

        await self.run(request, CallbackSink(keep))
        return final[-1]

    @asynccontextmanager
    async def open_rollout(self, request: ResponseCreate) -> AsyncIterator[Rollout]:
        """The embedded API's door to a rollout: iterate the Rollout for events up to each
        suspension, `append` the tool outputs, iterate again, until `rollout.response` is
        final. A multi-agent request (`multi_agent: {enabled: true}`) is the beta's door
        instead: iterate to the end, and `inject` each call's output (at any time: it is taken
        when the response waits, and acknowledged in the events). The sink is a memory
        channel the handle reads."""
        send, recv = trio.open_memory_channel[ServerEvent](ROLLOUT_EVENT_BUFFER)
        rollout = Rollout(self, recv, multi_agent=multi_agent_enabled(request))
        async with trio.open_nursery() as nursery:

            async def body() -> None:
                # Closed with the synchronous close(), not `async with send`: aclose()'s
                # checkpoint would let the reader leave the block and cancel this task while
                # an exception is on its way out, and Cancelled would replace (lose) it.
                try:
                    await self.run(request, send, rollout)
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

    async def steer(self, event: ResponseSteer) -> ResponseSteerFailed | None:
        """Hand a steer to the running response it names (`_steered.steer`)."""
        return await steer(self, event)

    async def prepare_only(self, request: ResponseCreate) -> ResponseState:
        """The state a request would sample from (validated, rendered, classified), without
        sampling: for counting input tokens and for compaction."""
        timings: dict[str, float] = {}
        parent = None
        if request.previous_response_id is not None:
            parent, _ = await self.resolve_parent(request.previous_response_id, timings)
        return await prepare_state(self.engine, self.owner, request, parent, timings)

    async def compact(
        self, request: ResponseCreate, *, budget_tokens: int = DEFAULT_COMPACT_BUDGET
    ) -> dict[str, Any]:
        """`POST /v1/responses/compact`: the compacted window of a conversation (given as
        input items or previous_response_id), ending with its compaction item."""
        source = await self.prepare_only(request)
        return await compaction(self.engine, source, budget_tokens=budget_tokens, owner=self.owner)

    # --- pre-inference: one hand-off ---
    async def prepare(
        self,
        request: ResponseCreate,
        timings: dict[str, float] | None = None,
        *,
        steers: tuple[QueuedSteer, ...] | None = None,
    ) -> Prepared:
        """Pre-inference, once per response: the parent (`resolve_parent`), then one hand-off
        to `_preinfer.pre_infer` (route, the input's references and compaction items, the
        render cache, then the pipeline's validate / render / classify on the new items).
        Steering input parked for the parent (`steers`: by default what `parked` holds) goes
        before the new items, in submission order. Request errors raise
        `RemoteProtocolError` (the parked input stays parked); a failed continuation evicts
        its parent from the cache."""
        engine = self.engine
        if engine.draining:
            raise shutting_down()
        # The caller's dict gets this request's stages (concurrent requests each have theirs).
        timings = timings if timings is not None else {}
        self.last_timings = timings
        parent: ResponseState | None = None
        rebuilt = 0  # context tokens rendered to rebuild the parent
        parent_id = request.previous_response_id
        if steers is None:
            steers = tuple(self.parked.take(parent_id)) if parent_id is not None else ()
        try:
            if parent_id is not None:
                parent, rebuilt = await self.resolve_parent(
                    parent_id, timings, lane=request.stream_id
                )
            prepared = await pre_infer(
                engine,
                self.owner,
                request,
                parent,
                steered=[item for q in steers for item in q.items],
                rebuilt=rebuilt,
                timings=timings,
            )
        except RemoteProtocolError:
            engine.counters.request_errors += 1
            if parent is not None:
                self.cache.discard_failed_parent(parent.id, request.stream_id)
            if steers and parent_id is not None:
                self.parked.restore(parent_id, list(steers))
            raise
        except Exception:
            log.exception("a request failed before its response started")
            engine.counters.request_errors += 1
            if steers and parent_id is not None:
                self.parked.restore(parent_id, list(steers))
            raise server_error() from None
        engine.counters.pre_inference_runs += 1
        return prepared
