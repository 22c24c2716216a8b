"""Pre-inference: from a request and its parent (which the session resolved) to what the rollout
coroutine samples from (`Prepared`), once per response, over the new input only.

One downward sequence of steps (`pre_infer`):

    route       the request's model, resolved first (`Router.route`): the steps below
                depend on its renderer. A model that does not resolve is left to the pipeline,
                which raises that error after the request's own validation, in its usual place
    input       the input's compaction item (a restored window, which must be of the route's
                renderer) and item references (the parent's items, else the store's) resolved;
                steering input parked for the parent goes first
    reuse       what the render cache holds: a new conversation starts from its longest
                rendering of the input's first items by the route's renderer; the prefix
                known, decided here once: the parent's when its instructions, tools and
                renderer are the request's, else the render cache's rendering of them
    off loop    a request whose schemas are large is validated in a worker thread
                (`validate_off_loop`); one whose new text is large is rendered and classified
                in one (`prerender_off_loop`)
    pipeline    validate, render, classify (`Pipeline.prepare_input`), committed to the
                lineage only when every stage has passed
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
from rollout.protocol import (
    Compaction,
    Item,
    ItemReference,
    Message,
    RemoteProtocolError,
    ResponseCreate,
)

from ._compact import restore_state
from ._input_memo import KeyedInput
from ._interfaces import Flag
from ._pipeline import Prepared as PipelinePrepared
from ._state import ResponseState, Route
from ._validate import invalid

if TYPE_CHECKING:
    from ._services import EngineServices

__all__ = ["Prepared", "cached_prefix", "pre_infer", "prepare_state"]


@attrs.frozen(kw_only=True, eq=False)
class Prepared:
    """What pre-inference hands to the coroutine: the state to sample from and its origin."""

    state: ResponseState
    flags: tuple[Flag, ...]
    # Context tokens not rendered for this request: kept by this connection's cache, the
    # render cache or the stored renderings (`Pipeline.prepare_input`, `Session.resolve_parent`).
    cached_tokens: int
    parent: ResponseState | None
    parent_stored: bool  # the conversation so far is in the store (a stored child links to it)
    generate: bool  # False: a warm-up (generate: false), pre-inference only
    compact_threshold: int | None


async def pre_infer(
    engine: EngineServices,
    owner: str | None,
    request: ResponseCreate,
    parent: ResponseState | None,
    *,
    steered: Sequence[Item] = (),
    rebuilt: int = 0,
    timings: dict[str, float],
) -> Prepared:
    """Pre-inference of one response continuing `parent` (None for a new chain): `steered`, the
    steering input parked for the parent, goes before the request's new items; `rebuilt`, the
    context tokens rendered to rebuild the parent (not cached for this request). Request
    errors raise `RemoteProtocolError`."""
    threshold = _compact_threshold(request)
    generate = _generates(request)
    staged, parent_stored = await _prepare(
        engine, owner, request, parent, steered, timings, require_outputs=generate
    )
    return Prepared(
        state=staged.state,
        flags=staged.flags,
        cached_tokens=max(0, staged.cached_tokens - rebuilt),
        parent=parent,
        parent_stored=parent_stored,
        generate=generate,
        compact_threshold=threshold,
    )


async def prepare_state(
    engine: EngineServices,
    owner: str | None,
    request: ResponseCreate,
    parent: ResponseState | None,
    timings: dict[str, float],
) -> ResponseState:
    """The state a request would sample from (validated, rendered, classified), without
    sampling: tool calls may wait for their outputs."""
    staged, _ = await _prepare(engine, owner, request, parent, (), timings, require_outputs=False)
    return staged.state


async def _prepare(
    engine: EngineServices,
    owner: str | None,
    request: ResponseCreate,
    parent: ResponseState | None,
    steered: Sequence[Item],
    timings: dict[str, float],
    *,
    require_outputs: bool,
) -> tuple[PipelinePrepared, bool]:
    """The steps, in order (the module's docstring); with the pipeline's result, whether the
    conversation so far is in the store."""
    pipeline = engine.pipeline
    resolved = await _route_and_input(engine, owner, request, parent, timings)
    route, base, items, offset = resolved.route, resolved.base, resolved.items, resolved.offset
    keys = resolved.keys
    if steered:
        items = [*steered, *items]
        offset -= len(steered)  # errors name the request's input
        keys = None
    parent_stored = base.stored
    # reuse: what the render cache holds, and the prefix known (the parent's, else the cache's)
    own_root = False
    known_prefix = None
    tools = request.tools or ()
    # The parent's instructions and tools are the request's: validated with the parent.
    same = (
        parent is not None
        and parent.prefix.instructions == request.instructions
        and parent.prefix.tools == tuple(tools)
    )
    if isinstance(route, Route):
        version = route.bound_version
        if parent is None and base.n_items == 0 and items:
            base, rest = cached_prefix(engine, owner, items, version, keys, timings)
            offset += len(items) - len(rest)
            items, own_root = rest, base.n_items > 0
        if parent is not None and same and parent.prefix.render_version == version:
            known_prefix = parent.prefix
        else:
            known_prefix = engine.render_cache.prefix(owner, request.instructions, tools, version)
    tools_known = same or known_prefix is not None
    # off the loop: large requests' work in a worker thread
    validated = await engine.validate_off_loop(request, tools_known=tools_known, timings=timings)
    prerendered = None
    if isinstance(route, Route):
        prerendered = await engine.prerender_off_loop(
            request,
            route,
            known_prefix=known_prefix,
            root=base,
            items=items,
            timings=timings,
        )
    staged = pipeline.prepare_input(
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
        tools_known=tools_known,
        validated=validated,
        prerendered=prerendered,
    )
    return staged, parent_stored


def _route(
    engine: EngineServices,
    request: ResponseCreate,
    parent: ResponseState | None,
    timings: dict[str, float],
) -> Route | RemoteProtocolError | None:
    """The request's route, resolved first (the render cache and compaction items depend on
    its renderer); the route stage's error when it does not resolve, which
    `Pipeline.prepare_input` raises after the request's own validation, so errors keep their
    order; None for a request without a model (validation refuses it)."""
    if request.model is None:
        return None
    try:
        return engine.router.route(request.model, parent, timings)
    except RemoteProtocolError as exc:
        return exc


@attrs.frozen
class _Input:
    """A request's route and its input with the compaction item and item references
    resolved."""

    # The route stage's error when the model did not resolve (the pipeline raises it later);
    # None: no model.
    route: Route | RemoteProtocolError | None
    base: ResponseState  # the state to stage `items` onto
    items: list[Item]
    offset: int  # the index in the request's input of `items[0]`
    keys: list[bytes] | None  # the decoder's content keys, when `items` are the input as it came


async def _route_and_input(
    engine: EngineServices,
    owner: str | None,
    request: ResponseCreate,
    parent: ResponseState | None,
    timings: dict[str, float],
) -> _Input:
    """The request's route, then its input resolved: a compaction item (which must be of the
    route's renderer; with no route, of the engine's default) starts from a restored compacted
    state, an item reference becomes the parent's item, else the store's; the state to stage
    the items onto is the parent, that restored state, or an empty state."""
    given = request.input
    items = _normalize_input(given)
    route = _route(engine, request, parent, timings)
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
            compaction.encrypted_content, param=f"{where}.encrypted_content", owner=owner
        )
        restored_for = route if isinstance(route, Route) else None
        base = restore_state(engine.pipeline, base, payload, param=where, route=restored_for)
        items = items[last + 1 :]
        start = last + 1
    if references:
        resolved: list[Item] = []
        for index, item in enumerate(items, start):
            if isinstance(item, ItemReference):
                found = parent.lineage.find(item.id, parent.n_items) if parent is not None else None
                if found is None:
                    found = await engine.find_stored_item(item.id, owner=owner)
                if found is None or isinstance(found, ItemReference | Compaction):
                    raise invalid(
                        f"Item with id '{item.id}' not found.",
                        code="item_not_found",
                        param=f"input[{index}].id",
                    )
                item = found
            resolved.append(item)
        items = resolved
    whole = last is None and not references
    keys = given.keys if whole and isinstance(given, KeyedInput) else None
    return _Input(route=route, base=base, items=items, offset=start, keys=keys)


def _normalize_input(value: str | list[Item] | None) -> list[Item]:
    """A request's `input` as items: a string is one user message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [Message(role="user", content=value)]
    return list(value)


def cached_prefix(
    engine: EngineServices,
    owner: str | None,
    items: list[Item],
    render_version: str,
    keys: list[bytes] | None = None,
    timings: dict[str, float] | None = None,
) -> tuple[ResponseState, list[Item]]:
    """The state to build `items` onto: the render cache's longest rendering of their first
    items by the renderer `render_version` names (as a state of no response), else an empty
    state; and the items left. `keys`: the items' content keys, when the decoder computed
    them (`KeyedInput`)."""
    empty = engine.empty_state()
    with engine.timer.measure("lookup", timings):
        hit = engine.render_cache.longest(owner, items, render_version, keys)
    if hit is None:
        return empty, items
    root = attrs.evolve(hit.state, response=empty.response, stored=True)
    return root, items[hit.n_items :]


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
