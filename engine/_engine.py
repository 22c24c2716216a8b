"""The engine: what every connection shares.

Long because the engine wires every shared part (pipeline, caches, store, ledger, post-
inference, backends) and owns their lifetimes and the shutdown.

`Engine` owns the pipeline stages, the model registry, the store, the usage ledger, the
post-inference writer, the work counters and the stage timers; `engine.session()` opens a
connection scope (`_session.py`), whose responses run through the rollout coroutine
(`_rollout.py`), one sampling turn at a time (`_sampling.py`). `open_engine()` builds one with
the built-in defaults and runs its post-inference writer.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import typing
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager

import trio
from rollout.protocol import Item, Response, ResponseCreate

from ._cache import DEFAULT_CACHE_RESPONSES, DEFAULT_CACHE_TOKENS, ResponseCache
from ._compact import SnapshotSeal
from ._counters import Counters, StageTimer
from ._errors import previous_response_not_found, server_error, shutting_down
from ._input_memo import DEFAULT_INPUT_MEMO_BYTES, FAST_DECODE_MIN_BYTES, InputMemo
from ._interfaces import (
    Classifier,
    HostedTool,
    ItemLookupStore,
    Renderer,
    ResponseStore,
    SampleEvent,
    SampleRequest,
    StoredResponse,
    UsageLedger,
)
from ._models import ModelRegistry, Router
from ._pipeline import Pipeline, Prerendered, text_chars
from ._postinfer import PostInference
from ._render_cache import RenderCache
from ._rollout import MAX_HOSTED_ROUNDS, Emit, Rollout
from ._session import Session
from ._state import Lineage, Prefix, ResponseState, Route, digest_tokens
from ._validate import ConversationValidator, Validator, schema_nodes

__all__ = [
    "DEFAULT_CACHE_RESPONSES",
    "DEFAULT_CACHE_TOKENS",
    "DEFAULT_ROLLOUT_SUSPEND_LIMIT",
    "MAX_HOSTED_ROUNDS",
    "Emit",
    "Engine",
    "ResponseCache",
    "Rollout",
    "Session",
    "open_engine",
    "previous_response_not_found",
    "server_error",
    "shutting_down",
]

_Raw = typing.TypeVar("_Raw", str, bytes)
_Decoded = typing.TypeVar("_Decoded")
_In = typing.TypeVar("_In")

# How long a suspended rollout waits for its tool outputs before it ends `incomplete`.
DEFAULT_ROLLOUT_SUSPEND_LIMIT = 600.0
# Client messages at least this large are decoded in a worker thread: parsing one takes long
# enough to stall every other connection (a 5 MB body of 1.7 million empty arrays parses in
# ~0.8 s; the decoder itself stops at the first bad element).
OFFLOAD_DECODE_BYTES = 256 * 1024
# A create at most this large is split on the event loop (`InputMemo.split`: ~0.25 ms per MB);
# only what is new in it is parsed there, or in a worker thread when that is large too.
INLINE_SPLIT_BYTES = 4 * 2**20
# Large decodes at once: each holds its parsed JSON (several times its size) in memory.
MAX_CONCURRENT_LARGE_DECODES = 2
# A request whose JSON schemas (tools' parameters, `text.format`) have at least this many values
# is validated in a worker thread (sharing the large decodes' limiter): checking a schema costs
# up to ~110 us per value (`_schemas.py`), so this keeps validation on the event loop under
# ~30 ms, and larger ones (up to `MAX_REQUEST_SCHEMA_NODES`, ~6 s) off it.
OFFLOAD_SCHEMA_NODES = 256
# A request bringing at least this many characters of new text (its new items, and its
# instructions and tools when their prefix is not rendered already) is rendered and classified
# in a worker thread (`Pipeline.prerender`, sharing the large decodes' limiter): both run
# ~40-60 ms per MiB, so a 64 MiB message held the event loop 2.5-3.5 s; under this, ~15 ms.
OFFLOAD_RENDER_CHARS = 256 * 1024


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
        render_cache: RenderCache | None = None,
    ) -> None:
        self.counters = Counters()
        # Conversations rendered once, for every connection (`_render_cache.py`).
        self.render_cache = render_cache if render_cache is not None else RenderCache()
        # Stateless clients' inputs decoded in the time of what is new (`_input_memo.py`):
        # off with the render cache, which its keys feed.
        self.input_memo = InputMemo(
            max_bytes=DEFAULT_INPUT_MEMO_BYTES if self.render_cache.enabled else 0,
            ttl=self.render_cache.ttl,
        )
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
            counters=self.counters,
            timer=self.timer,
            hosted=frozenset(self.hosted),
        )
        self.router = Router(
            registry,
            renderer=renderer,
            render_version=self.pipeline.render_version,
            counters=self.counters,
            timer=self.timer,
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

    @property
    def in_flight(self) -> int:
        """Responses running now (sampling, or a rollout suspended at its tool calls): what a
        shutdown waits for, and what `interrupt_all` would end."""
        return len(self._interruptible)

    def interrupt_all(self) -> None:
        """Shutdown past the grace period: every response still running ends now (with a
        terminal event), and new ones are refused."""
        self.draining = True
        for scope in list(self._interruptible):
            scope.cancel()

    async def decode(
        self,
        decode: Callable[[_Raw], _Decoded],
        data: _Raw,
        timings: dict[str, float] | None = None,
    ) -> _Decoded:
        """Decode a client message: inline when small, else in a worker thread (at most
        `MAX_CONCURRENT_LARGE_DECODES` at once), so the event loop keeps serving others. The
        time it took goes to the `decode` stage (and to `timings`, the request's)."""
        self.counters.bytes_decoded += len(data)
        return await self._decode(decode, data, timings)

    async def decode_create(
        self,
        decode: Callable[[_Raw], _Decoded],
        data: _Raw,
        *,
        owner: str | None,
        kind: typing.Literal["body", "event"],
        max_size: int,
        timings: dict[str, float] | None = None,
    ) -> _Decoded | ResponseCreate:
        """Decode a client message that may be a create with a long input (an HTTP body,
        `kind` "body", or a WebSocket message, "event") through the input memo
        (`_input_memo.py`): only what is new in its input is parsed, and its items come keyed.
        Anything else, and anything the memo does not decode, goes to `decode` (the
        protocol's decoder, whose answer or error it is), as `Engine.decode` runs it."""
        self.counters.bytes_decoded += len(data)
        memo = self.input_memo
        size = len(data)
        if not memo.enabled or not FAST_DECODE_MIN_BYTES <= size <= min(
            max_size, INLINE_SPLIT_BYTES
        ):
            return await self._decode(decode, data, timings)
        started = time.perf_counter()
        try:  # one `decode` observation: the memo's work, and the decoder's after it if any
            split = memo.split(data, owner, kind=kind, max_size=max_size)
            if split is not None:
                found = await self._off_loop_if(split.new_bytes, memo.finish, split)
                if found is not None:
                    return found
            return await self._off_loop_if(size, decode, data)
        finally:
            self.timer.observe("decode", time.perf_counter() - started, timings)

    async def _off_loop_if(self, size: int, work: Callable[[_In], _Decoded], data: _In) -> _Decoded:
        """`work(data)` inline when `size` is under `OFFLOAD_DECODE_BYTES`, else in a worker
        thread (at most `MAX_CONCURRENT_LARGE_DECODES` at once)."""
        if size < OFFLOAD_DECODE_BYTES:
            return work(data)
        async with self.decode_limiter:
            self.counters.offloaded_decodes += 1
            return await trio.to_thread.run_sync(work, data)

    async def _decode(
        self,
        decode: Callable[[_Raw], _Decoded],
        data: _Raw,
        timings: dict[str, float] | None = None,
    ) -> _Decoded:
        if len(data) < OFFLOAD_DECODE_BYTES:
            with self.timer.measure("decode", timings):
                return decode(data)
        async with self.decode_limiter:
            self.counters.offloaded_decodes += 1
            with self.timer.measure("decode", timings):  # wall time, the thread's included
                return await trio.to_thread.run_sync(decode, data)

    async def validate_off_loop(
        self,
        request: ResponseCreate,
        *,
        tools_known: bool,
        timings: dict[str, float] | None = None,
    ) -> bool:
        """Validate a request whose schemas are large (`OFFLOAD_SCHEMA_NODES`) in a worker
        thread, as `Pipeline.prepare_input` would (the same errors, in the same order); True
        when it did. A caller cancelled meanwhile leaves at once; the thread finishes its
        bounded work (`MAX_REQUEST_SCHEMA_NODES`) and only then gives its place in the limiter
        back."""
        if schema_nodes(request, tools_known=tools_known, cap=OFFLOAD_SCHEMA_NODES) < (
            OFFLOAD_SCHEMA_NODES
        ):
            return False
        self.counters.offloaded_validations += 1
        check = functools.partial(
            self.pipeline.validator.validate_request, request, tools_known=tools_known
        )
        with self.timer.measure("validate", timings):  # wall time, the thread's included
            await trio.to_thread.run_sync(
                check, limiter=self.decode_limiter, abandon_on_cancel=True
            )
        return True

    async def prerender_off_loop(
        self,
        request: ResponseCreate,
        route: Route,
        *,
        known_prefix: Prefix | None,
        root: ResponseState,
        items: Sequence[Item],
        timings: dict[str, float] | None = None,
    ) -> Prerendered | None:
        """Render and classify a request's new text in a worker thread when it is large
        (`OFFLOAD_RENDER_CHARS`), for `Pipeline.prepare_input` to take (`Prerendered`; the
        prefix too, unless `known_prefix` is of the route's renderer); None when it is small,
        when `root` must be rendered again first (another model's renderer), or when rendering
        the not yet validated input failed (`prepare_input` validates it first and reports).
        A caller cancelled meanwhile leaves at once; the thread finishes its bounded work and
        only then gives its place in the limiter back."""
        pipeline = self.pipeline
        version = route.bound_version
        if root.n_items and root.lineage.render_version != version:
            return None
        tools = request.tools or ()
        # The prefix known (the parent's, or the render cache's: `_preinfer.py`) is not rendered.
        with_prefix = not (known_prefix is not None and known_prefix.render_version == version)
        size = text_chars(items, OFFLOAD_RENDER_CHARS)
        if with_prefix and size < OFFLOAD_RENDER_CHARS:
            size += text_chars((request.instructions, tools), OFFLOAD_RENDER_CHARS - size)
        if size < OFFLOAD_RENDER_CHARS:
            return None
        self.counters.offloaded_renders += 1
        work = functools.partial(
            pipeline.prerender,
            route,
            instructions=request.instructions,
            tools=tools,
            with_prefix=with_prefix,
            items=items,
            classifier_state=root.classifier_state,
        )
        # Wall time, the thread's (rendering and classifying both).
        with self.timer.measure("render", timings):
            try:
                return await trio.to_thread.run_sync(
                    work, limiter=self.decode_limiter, abandon_on_cancel=True
                )
            except Exception:  # input not validated yet: `prepare_input` finds and reports it
                return None

    def session(
        self,
        *,
        owner: str | None = None,
        max_cached_responses: int = DEFAULT_CACHE_RESPONSES,
        max_cached_tokens: int = DEFAULT_CACHE_TOKENS,
        keeps_state: bool = False,
    ) -> Session:
        """A connection scope. `keeps_state`: it outlives its responses (a WebSocket
        connection): backends may keep state for each lane's next turn until
        `Session.close()`."""
        return Session(
            self,
            owner=owner,
            cache=ResponseCache(max_cached_responses, max_cached_tokens),
            keeps_state=keeps_state,
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
                    if item.id == item_id:
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
    render_cache: RenderCache | None = None,
) -> AsyncIterator[Engine]:
    """Open an engine. Defaults: the built-in `sim` models, the o200k chat-template
    renderer (for the models without their own, `ModelSpec.renderer`), the default
    classifiers, no store and no ledger (pass SQLite ones, see
    `open_sqlite_store` / `open_sqlite_ledger`, for durability), a render cache of
    `DEFAULT_RENDER_CACHE_BYTES` (`RenderCache(max_bytes=0)` turns it off)."""
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
        render_cache=render_cache,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.post.run)
        try:
            yield engine
        finally:
            with trio.CancelScope(shield=True):
                await engine.post.aclose()
