"""The request pipeline: validate (`_validate.py`), render, classify, as explicit pluggable
stages, on a route the route stage resolved (`_models.Router`).

Long because each stage has a path for each way a request arrives (new, continued, rendered
ahead off the loop, found in the render cache) and each keeps the work counters exact.

`Pipeline.prepare_input` takes a request, its route and the parent state (None for a new
chain) and does the pre-inference work for the *new* input only: the parent's items are
already validated, rendered and classified. Work is staged and committed to the lineage only
when every stage has passed, so a failed request leaves its parent untouched (and still the
tip of its chain).

Rendering is the route's: each stage renders with the renderer the route carries
(`Route.bound_renderer`: the model's own tokenizer and chat template, else the engine's
default `renderer`, bound when the route was resolved), and what it renders records that
renderer's version (`Route.bound_version`). A continuation whose model renders with another
renderer than its parent's is the one exception to "new input only": the parent's items are
rendered and classified again with the new renderer onto a new lineage (`rerender`:
O(history), counted in `tokens_rendered`, only on such a switch); a prefix is reused only when
its instructions, tools and renderer are all the same (pre-inference decides which prefix is
known: `_preinfer.py`).
"""

from __future__ import annotations

import typing
from array import array
from collections.abc import Sequence
from typing import Any

import attrs
from rollout.protocol import (
    Item,
    RemoteProtocolError,
    ResponseCreate,
    Tool,
)

from ._counters import Counters, StageTimer
from ._ids import new_id
from ._interfaces import Classifier, Flag, Renderer
from ._state import (
    CallRecord,
    Lineage,
    Prefix,
    ResponseState,
    Route,
    Staged,
    digest_tokens,
    render_version,
)
from ._tools import offered_tools
from ._validate import Validator, invalid

__all__ = ["Pipeline", "Prepared", "Prerendered", "Staged", "text_chars"]


@attrs.frozen
class _LineageView:
    lineage: Lineage
    n_items: int

    def call(self, call_id: str) -> CallRecord | None:
        return self.lineage.call(call_id, self.n_items)


def text_chars(value: Any, cap: int) -> int:
    """Characters of the strings in `value` (attrs instances, sequences and mappings, walked),
    counted until `cap` is reached: how much text a request brings, without rendering it."""
    total = 0
    stack = [value]
    while stack and total < cap:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif attrs.has(type(node)):
            # any attrs class of the wire types, field by field (a walk over every type)
            stack.extend(getattr(node, name) for name in _field_names(type(node)))
    return total


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # per attrs class (the protocol's: bounded)


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(field.name for field in attrs.fields(cls))
    return names


# Id prefixes of the input items that get an id when they come without one.
_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "local_shell_call": "lsh",
    "shell_call": "sh",
    "shell_call_output": "sho",
    "apply_patch_call": "apc",
    "apply_patch_call_output": "apco",
    "computer_call": "cu",
    "computer_call_output": "cuo",
}


def _with_id(item: Item) -> Item:
    prefix = _ID_PREFIX.get(item.type)
    if prefix is None or item.id is not None:
        return item
    return typing.cast(Item, attrs.evolve(typing.cast(Any, item), id=new_id(prefix)))


@attrs.frozen(kw_only=True, eq=False)
class Prerendered:
    """Rendering and classification done ahead of `prepare`, in a worker thread
    (`Pipeline.prerender`), for one request's prefix and new items. `prefix` and `stage` take
    them when they are for the same objects (the same instructions and tools, the same items
    classified from the same state, by the same renderer), else render as usual; what they
    take is counted then, as if done there."""

    render_version: str
    instructions: str | None
    tools: Sequence[Tool]
    prefix: Prefix | None  # None: the prefix was not rendered ahead
    prefix_scanned: int
    items: Sequence[Item] | None  # None: the items were not rendered ahead
    start_state: Any  # the classifier state the items were classified from
    tokens: list[array[int]]
    classifier_state: Any
    flags: tuple[Flag, ...]
    scanned: int

    def prefix_for(
        self, instructions: str | None, tools: Sequence[Tool], version: str
    ) -> Prefix | None:
        if version != self.render_version or self.prefix is None:
            return None
        same = instructions is self.instructions and tools is self.tools
        return self.prefix if same else None

    def items_for(self, items: Sequence[Item], state: Any, version: str) -> bool:
        return (
            version == self.render_version
            and self.items is not None
            and items is self.items
            and state is self.start_state
        )


@attrs.frozen(kw_only=True, eq=False)
class Prepared:
    """The outcome of pre-inference work for one request."""

    state: ResponseState  # the conversation with the new input committed (response: parent's)
    flags: tuple[Flag, ...]
    cached_tokens: int  # context tokens not rendered for this request (see `prepare`)


class Pipeline:
    def __init__(
        self,
        *,
        validator: Validator,
        renderer: Renderer,
        classifier: Classifier,
        counters: Counters,
        timer: StageTimer,
        hosted: frozenset[str] = frozenset(),
    ) -> None:
        self.hosted = hosted  # hosted tool types with an executor (offered to the model)
        self.validator = validator
        self.renderer = renderer  # the default: routes to a model without its own renderer
        self.render_version = render_version(renderer)
        self.classifier = classifier
        self.counters = counters
        self.timer = timer

    # --- stages ---
    def prefix(
        self,
        instructions: str | None,
        tools: Sequence[Tool],
        timings: dict[str, float],
        known: Prefix | None = None,
        *,
        route: Route,
        prerendered: Prerendered | None = None,
    ) -> Prefix:
        """`known` when it is of `route`'s renderer (a prefix rendered from the same
        instructions and tools: the parent's, or the render cache's), else `prerendered`'s
        (rendered ahead in a worker thread), else rendered with `route`'s renderer and
        classified now."""
        version = route.bound_version
        if known is not None and known.render_version == version:
            return known
        if prerendered is not None:
            ahead = prerendered.prefix_for(instructions, tools, version)
            if ahead is not None:  # rendered in a worker thread: counted now
                self.counters.tokens_rendered += len(ahead.tokens)
                self.counters.chars_classified += prerendered.prefix_scanned
                return ahead
        prefix, scanned = self._render_prefix(
            route.bound_renderer, instructions, tools, version, timings
        )
        self.counters.tokens_rendered += len(prefix.tokens)
        self.counters.chars_classified += scanned
        return prefix

    def _render_prefix(
        self,
        renderer: Renderer,
        instructions: str | None,
        tools: Sequence[Tool],
        version: str,
        timings: dict[str, float] | None,
    ) -> tuple[Prefix, int]:
        """The prefix rendered and classified, and the characters classified; timed into
        `timings` (None: not timed, as in a worker thread)."""
        offered = offered_tools(tools, self.hosted)
        with self.timer.measure_if("render", timings):
            tokens = renderer.render_prefix(instructions, offered)
        with self.timer.measure_if("classify", timings):
            verdict = self.classifier.feed(
                self.classifier.initial(),
                renderer.prefix_text(instructions, offered),
                len(tokens),
            )
        prefix = Prefix(
            instructions=instructions,
            tools=tuple(tools),
            offered=offered,
            tokens=tokens,
            digest=digest_tokens(tokens),
            classifier_state=verdict.state,
            flags=verdict.flags,
            render_version=version,
        )
        return prefix, verdict.scanned

    def _render_items(
        self,
        renderer: Renderer,
        items: Sequence[Item],
        classifier_state: Any,
        timings: dict[str, float] | None,
    ) -> tuple[list[array[int]], Any, tuple[Flag, ...], int]:
        """`items` rendered and classified from `classifier_state`: their tokens, the state
        after them, the flags raised and the characters classified (`timings` as above)."""
        with self.timer.measure_if("render", timings):
            rendered = [renderer.render_item(item) for item in items]
        flags: list[Flag] = []
        scanned = 0
        with self.timer.measure_if("classify", timings):
            for item, toks in zip(items, rendered, strict=True):
                verdict = self.classifier.feed(
                    classifier_state, renderer.item_text(item), len(toks)
                )
                classifier_state = verdict.state
                flags.extend(verdict.flags)
                scanned += verdict.scanned
        return rendered, classifier_state, tuple(flags), scanned

    def prerender(
        self,
        route: Route,
        *,
        instructions: str | None,
        tools: Sequence[Tool],
        with_prefix: bool,
        items: Sequence[Item],
        classifier_state: Any,
    ) -> Prerendered:
        """Render and classify ahead (`Prerendered`): the prefix when `with_prefix`, and
        `items` from `classifier_state`. Touches nothing shared (no counters, no timers, no
        cache): what a worker thread runs. The items are not validated yet; a caller that
        gets an exception here leaves the work to `prepare_input`, whose validation comes first."""
        renderer, version = route.bound_renderer, route.bound_version
        prefix, prefix_scanned = (
            self._render_prefix(renderer, instructions, tools, version, None)
            if with_prefix
            else (None, 0)
        )
        tokens, state, flags, scanned = self._render_items(renderer, items, classifier_state, None)
        return Prerendered(
            render_version=version,
            instructions=instructions,
            tools=tools,
            prefix=prefix,
            prefix_scanned=prefix_scanned,
            items=items if items else None,
            start_state=classifier_state,
            tokens=tokens,
            classifier_state=state,
            flags=flags,
            scanned=scanned,
        )

    def stage(
        self,
        items: Sequence[Item],
        *,
        route: Route,
        lineage: Lineage,
        n_items: int,
        classifier_state: Any,
        open_calls: dict[str, str],
        param: str,
        timings: dict[str, float],
        validate: bool = True,
        offset: int = 0,
        prerendered: Prerendered | None = None,
    ) -> Staged:
        """Validate, render (with `route`'s renderer) and classify `items` after the first
        `n_items` of `lineage` (rendered and classified ahead when `prerendered` is for them:
        only validated here)."""
        renderer, version = route.bound_renderer, route.bound_version
        open_calls = dict(open_calls)
        given = items
        if validate:
            with self.timer.measure("validate", timings):
                self.validator.validate_items(
                    items, _LineageView(lineage, n_items), open_calls, param=param, offset=offset
                )
                self.counters.items_validated += len(items)
                # Input items get ids (for item_reference and input_items); ids never render.
                items = [_with_id(item) for item in items]
        if prerendered is not None and prerendered.items_for(given, classifier_state, version):
            rendered, classifier_state = prerendered.tokens, prerendered.classifier_state
            flags, scanned = prerendered.flags, prerendered.scanned
        else:
            rendered, classifier_state, flags, scanned = self._render_items(
                renderer, items, classifier_state, timings
            )
        self.counters.tokens_rendered += sum(len(t) for t in rendered)
        self.counters.chars_classified += scanned
        return Staged(
            items=list(items),
            tokens=rendered,
            render_version=version,
            classifier_state=classifier_state,
            open_calls=open_calls,
            flags=flags,
        )

    def rerender(
        self, state: ResponseState, route: Route, timings: dict[str, float]
    ) -> tuple[ResponseState, tuple[Flag, ...]]:
        """`state`'s conversation rendered and classified again with `route`'s renderer, onto
        a new lineage (`state` is untouched), and the flags that raised: what a continuation
        on a model of another renderer than its parent's starts from. O(history): the only
        time the items of a chain are rendered twice. Nothing is validated again (the items
        were) and the calls waiting for output stay the same."""
        staged = self.stage(
            state.items,
            route=route,
            lineage=state.lineage,
            n_items=state.n_items,
            classifier_state=self.classifier.initial(),
            open_calls=dict(state.open_calls),
            param="input",
            timings=timings,
            validate=False,
        )
        empty = attrs.evolve(state, lineage=Lineage(), n_items=0)
        return empty.commit(staged), staged.flags

    # --- the whole pre-inference pass ---
    def prepare_input(
        self,
        request: ResponseCreate,
        parent: ResponseState | None,
        *,
        root: ResponseState,
        new_items: Sequence[Item],
        timings: dict[str, float],
        require_outputs: bool,
        offset: int = 0,
        known_prefix: Prefix | None = None,
        own_root: bool = False,
        route: Route | RemoteProtocolError | None,
        tools_known: bool = False,
        validated: bool = False,
        prerendered: Prerendered | None = None,
    ) -> Prepared:
        """`root` is `parent`, or for a new chain the state to build from: an empty state, a
        restored compaction window, or (`own_root`) the render cache's rendering of the first
        items of this request's own input. `known_prefix`: a prefix rendered from the
        request's instructions and tools (the parent's, or the render cache's). `route`: the
        request's, which the caller resolved (`Router.route`; the render cache is looked up
        for its renderer); else the route stage's error, raised here after the request's own
        validation (whose errors come first), or None for a request without a model (which
        validation refuses). With `require_outputs`,
        every function call must have its output by the end of the input (a model can't be
        sampled while tool results are missing). A `root` rendered by another renderer than the
        route's (a parent of another model) is rendered again first (`rerender`).
        `tools_known`: the request's tools were validated before (resent unchanged on a
        follow-up, with the parent; a prefix the render cache holds, with the request that
        rendered it). `validated`: the caller validated the request already (off the event
        loop); `prerendered`: the caller rendered and classified ahead, off the event loop
        (`prerender`)."""
        with self.timer.measure("validate", timings):
            if not validated:
                self.validator.validate_request(request, tools_known=tools_known)
        assert request.model is not None and route is not None
        if isinstance(route, RemoteProtocolError):
            raise route
        prefix = self.prefix(
            request.instructions,
            request.tools or (),
            timings,
            known_prefix,
            route=route,
            prerendered=prerendered,
        )
        switched: tuple[Flag, ...] = ()
        reused_items = root.item_tokens
        if root.n_items and root.lineage.render_version != route.bound_version:
            root, switched = self.rerender(root, route, timings)
            reused_items = 0
        staged = self.stage(
            new_items,
            route=route,
            lineage=root.lineage,
            n_items=root.n_items,
            classifier_state=root.classifier_state,
            open_calls=dict(root.open_calls),
            param="input",
            timings=timings,
            offset=offset,
            prerendered=prerendered,
        )
        if require_outputs and staged.open_calls:
            call_id = next(iter(staged.open_calls))
            raise invalid(f"No tool output found for function call {call_id}.", param="input")
        context = len(prefix.tokens) + root.item_tokens + staged.n_tokens
        if context > route.context_window:
            raise invalid(
                f"Your input exceeds the context window of this model: {context} tokens, "
                f"the limit is {route.context_window}.",
                code="context_length_exceeded",
                param="input",
            )
        prefix_reused = parent is not None and prefix is parent.prefix
        # Context not rendered for this request, whoever kept it (the parent, the render
        # cache, a compaction window); a conversation rendered again for another model is not.
        kept = prefix_reused or (known_prefix is not None and prefix is known_prefix)
        reused = reused_items + (len(prefix.tokens) if kept else 0)
        state = root.commit(
            staged,
            prefix=prefix,
            route=route,
            first_new_item=0 if own_root else root.n_items,
        )
        flags = (() if prefix_reused else prefix.flags) + switched + staged.flags
        return Prepared(state=state, flags=flags, cached_tokens=reused)
