"""The connection scope: a `Session` holds a connection's cache of response states, resolves a
`previous_response_id` (the cache, else the store, hydrated) and runs pre-inference
(`prepare`) once per response.

Long because pre-inference has many sources to reconcile: the parent (this connection's cache,
else the store, hydrated from stored renderings or re-rendered), item references, compaction
items, parked steering input, the render cache's renderings, and large requests' work moved
off the event loop.

- `prepare` is pre-inference, once per response: the parent, the input's references and
  compaction items, then the pipeline's validate / render / classify / route on the new items.
  Steering input parked for the parent (`parked`) is prepended to the new items.
- Hydration rebuilds a state from stored responses when the parent is not cached.
- Each model renders with its route's renderer (`Pipeline.renderer_for`): a request's route is
  resolved before the render cache is looked up (for that renderer's renderings) and before a
  compaction item is restored (whose snapshot must be of that renderer); a routing error is
  raised by the pipeline's route stage, in its usual place among the request's errors.

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

import attrs
import trio
from rollout.protocol import (
    Compaction,
    Item,
    ItemReference,
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
from ._compact import DEFAULT_COMPACT_BUDGET, restore_state
from ._compaction import compaction
from ._errors import previous_response_not_found, server_error, shutting_down
from ._input_memo import KeyedInput
from ._interfaces import Holder, StoredResponse
from ._pipeline import Prepared as PipelinePrepared
from ._rollout import Prepared, Rollout
from ._segments import restore_segments
from ._sink import DISCARD, CallbackSink, Emit, EventSink
from ._state import ResponseState, Route
from ._steer import ParkedSteers, QueuedSteer, Steering
from ._steered import run_steered, steer
from ._validate import invalid, normalize_input

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
            holder.close()

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
        route = pipeline.route(target.response.model, None, timings)
        with engine.timer.measure("resolve", timings):
            state = restore_segments(pipeline, engine.empty_state(), chain, route)
        if state is not None:
            engine.render_cache.put(self.owner, state)
            return state, 0
        items: list[Item] = []
        for stored in reversed(chain):
            items.extend(stored.items)
        version = pipeline.render_version_for(route)
        known = engine.render_cache.prefix(self.owner, target.instructions, target.tools, version)
        prefix = pipeline.prefix(
            target.instructions, target.tools, None, timings, known, route=route
        )
        root, rest = self._cached_prefix(items, version, timings=timings)
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
        state = pipeline.commit(
            root, staged, prefix=prefix, route=route, first_new_item=own, response=target.response
        )
        engine.render_cache.put(self.owner, state)
        return state, staged.n_tokens + (0 if prefix is known else len(prefix.tokens))

    def _cached_prefix(
        self,
        items: list[Item],
        render_version: str,
        keys: list[bytes] | None = None,
        timings: dict[str, float] | None = None,
    ) -> tuple[ResponseState, list[Item]]:
        """The state to build `items` onto: the render cache's longest rendering of their
        first items by the renderer `render_version` names (as a state of no response), else
        an empty state; and the items left. `keys`: the items' content keys, when the decoder
        computed them (`KeyedInput`)."""
        empty = self.engine.empty_state()
        with self.engine.timer.measure("lookup", timings):
            hit = self.engine.render_cache.longest(self.owner, items, render_version, keys)
        if hit is None:
            return empty, items
        root = attrs.evolve(hit.state, response=empty.response, stored=True)
        return root, items[hit.n_items :]

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
        route = self._route(request, parent, timings)
        resolved = await self._resolve_inputs(request, parent, route)
        prepared = await self._prepare_input(request, parent, resolved, timings, False, route)
        return prepared.state

    async def compact(
        self, request: ResponseCreate, *, budget_tokens: int = DEFAULT_COMPACT_BUDGET
    ) -> dict[str, Any]:
        """`POST /v1/responses/compact`: the compacted window of a conversation (given as
        input items or previous_response_id), ending with its compaction item."""
        source = await self.prepare_only(request)
        return await compaction(self.engine, source, budget_tokens=budget_tokens, owner=self.owner)

    # --- pre-inference ---
    async def prepare(
        self,
        request: ResponseCreate,
        timings: dict[str, float] | None = None,
        *,
        steers: tuple[QueuedSteer, ...] | None = None,
    ) -> Prepared:
        """Pre-inference, once per response: resolve the parent (the cache, else the store),
        resolve the input (item references, compaction items), then validate, render, classify
        the new items and route. Steering input parked for the parent (`steers`: by default
        what `parked` holds) is prepended to the new items, in submission order. Request
        errors raise `RemoteProtocolError` (the parked input stays parked); a failed
        continuation evicts its parent from the cache."""
        engine = self.engine
        if engine.draining:
            raise shutting_down()
        # The caller's dict gets this request's stages (concurrent requests each have theirs).
        timings = timings if timings is not None else {}
        self.last_timings = timings
        parent: ResponseState | None = None
        generate = _generates(request)
        rebuilt = 0  # context tokens rendered to rebuild the parent
        parent_id = request.previous_response_id
        if steers is None:
            steers = tuple(self.parked.take(parent_id)) if parent_id is not None else ()
        try:
            if parent_id is not None:
                parent, rebuilt = await self.resolve_parent(
                    parent_id, timings, lane=request.stream_id
                )
            threshold = _compact_threshold(request)
            route = self._route(request, parent, timings)
            resolved = await self._resolve_inputs(request, parent, route)
            if steers:
                steered = [item for q in steers for item in q.items]
                resolved = _Input(
                    base=resolved.base,
                    items=steered + resolved.items,
                    offset=resolved.offset - len(steered),  # errors name the request's input
                )
            prepared = await self._prepare_input(
                request, parent, resolved, timings, generate, route
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
        return Prepared(
            state=prepared.state,
            flags=prepared.flags,
            cached_tokens=max(0, prepared.cached_tokens - rebuilt),
            parent=parent,
            parent_stored=resolved.base.stored,
            generate=generate,
            compact_threshold=threshold,
        )

    async def _prepare_input(
        self,
        request: ResponseCreate,
        parent: ResponseState | None,
        resolved: _Input,
        timings: dict[str, float],
        require_outputs: bool,
        route: Route | None,
    ) -> PipelinePrepared:
        """The pipeline's pass over the input. A new conversation (no parent, no compaction
        item) starts from the render cache's longest rendering of its first items by the
        route's renderer, if any: only the rest is validated, rendered and classified. With no
        `route` (the model did not resolve), nothing is looked up: the pipeline raises the
        routing error after the request's own validation, as it always did. A request whose
        schemas are large is validated in a worker thread first (`Engine.validate_off_loop`);
        one whose new text is large is rendered and classified in one
        (`Engine.prerender_off_loop`)."""
        engine = self.engine
        base, items, offset = resolved.base, resolved.items, resolved.offset
        own_root = False
        known_prefix = None
        if route is not None:
            version = engine.pipeline.render_version_for(route)
            if parent is None and base.n_items == 0 and items:
                keys = _input_keys(request, resolved)
                base, rest = self._cached_prefix(items, version, keys, timings)
                offset += len(items) - len(rest)
                items, own_root = rest, base.n_items > 0
            if (
                parent is None
                or parent.prefix.render_version != version
                or not parent.prefix.same_as(request.instructions, request.tools or ())
            ):
                known_prefix = engine.render_cache.prefix(
                    self.owner, request.instructions, request.tools or (), version
                )
        tools_known = known_prefix is not None or (
            parent is not None and parent.prefix.same_as(request.instructions, request.tools or ())
        )
        validated = await engine.validate_off_loop(
            request, tools_known=tools_known, timings=timings
        )
        prerendered = None
        if route is not None:
            prerendered = await engine.prerender_off_loop(
                request,
                route,
                parent=parent,
                known_prefix=known_prefix,
                root=base,
                items=items,
                timings=timings,
            )
        return engine.pipeline.prepare(
            request,
            parent,
            root=base,
            new_items=items,
            timings=timings,
            require_outputs=require_outputs,
            offset=offset,
            known_prefix=known_prefix,
            own_root=own_root,
            route=route,
            validated=validated,
            prerendered=prerendered,
        )

    def _route(
        self, request: ResponseCreate, parent: ResponseState | None, timings: dict[str, float]
    ) -> Route | None:
        """The request's route, resolved early (the render cache and compaction items depend
        on its renderer); None when it does not resolve: `Pipeline.prepare` raises that error
        after the request's own validation, so errors keep their order."""
        if request.model is None:
            return None
        try:
            return self.engine.pipeline.route(request.model, parent, timings)
        except RemoteProtocolError:
            return None

    async def _resolve_inputs(
        self, request: ResponseCreate, parent: ResponseState | None, route: Route | None
    ) -> _Input:
        """Resolve item references and compaction items of the new input: the items to stage,
        the state to stage them onto (the parent, a restored compacted state, or an empty
        state) and the index in the request's input of the first item staged. A compaction
        item must be of `route`'s renderer (with no route, the engine's default)."""
        engine = self.engine
        given = request.input
        items = normalize_input(given)
        base = parent or engine.empty_state()
        if isinstance(given, KeyedInput):  # the decoder looked already (`_input_memo.py`)
            last = None if given.last_compaction < 0 else given.last_compaction
            references = given.references > 0
        else:
            last = max(
                (i for i, item in enumerate(items) if isinstance(item, Compaction)), default=None
            )
            references = any(isinstance(item, ItemReference) for item in items)
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
            base = restore_state(engine.pipeline, base, payload, param=where, route=route)
            items = items[last + 1 :]
            start = last + 1
        if references:
            items = [
                await self._dereference(item, parent, start + i) for i, item in enumerate(items)
            ]
        return _Input(base=base, items=items, offset=start, whole=last is None and not references)

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


@attrs.frozen
class _Input:
    """A request's input with its references and compaction item resolved."""

    base: ResponseState  # the state to stage `items` onto
    items: list[Item]
    offset: int  # the index in the request's input of `items[0]`
    whole: bool = False  # `items` are the request's input as it came (nothing resolved)


def _input_keys(request: ResponseCreate, resolved: _Input) -> list[bytes] | None:
    """The content keys the decoder computed for the request's input (`KeyedInput`), when the
    items to stage are exactly those items (no compaction item, reference or steer changed
    them)."""
    given = request.input
    if not isinstance(given, KeyedInput) or not resolved.whole:
        return None
    return given.keys


def _generates(request: ResponseCreate) -> bool:
    """Whether a request samples: not with `generate: false` (a warm-up), nor with
    `prompt_cache_options.prewarm: true`, which overrides `generate` to false."""
    options = request.prompt_cache_options or {}
    return request.generate is not False and options.get("prewarm") is not True


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
