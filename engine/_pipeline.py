"""The request pipeline: validate (`_validate.py`), render, classify, route, as explicit
pluggable stages.

`Pipeline.prepare` takes a request and the parent state (None for a new chain) and does the
pre-inference work for the *new* input only: the parent's items are already validated,
rendered and classified, and its route is reused when the model string is unchanged. Work is
staged and committed to the lineage only when every stage has passed, so a failed request
leaves its parent untouched (and still the tip of its chain).

Rendering is the route's: each stage renders with `renderer_for(route)` (the model's own
tokenizer and chat template, else the engine's default `renderer`), and what it renders
records that renderer's version (`render_version_for`). A continuation whose model renders
with another renderer than its parent's is the one exception to "new input only": the
parent's items are rendered and classified again with the new renderer onto a new lineage
(`rerender`: O(history), counted in `tokens_rendered`, only on such a switch); a prefix is
reused only when its instructions, tools and renderer are all the same.
"""

from __future__ import annotations

import typing
from array import array
from collections.abc import Sequence
from typing import Any

import attrs
from rollout.protocol import (
    Item,
    ResponseCreate,
    Tool,
)

from ._counters import Counters, StageTimer
from ._ids import new_id
from ._interfaces import Classifier, Flag, ParamCheckingBackend, Renderer
from ._models import ModelRegistry
from ._state import (
    CallRecord,
    Lineage,
    Prefix,
    ResponseState,
    Route,
    digest_tokens,
    render_version,
)
from ._tools import offered_tools
from ._validate import Validator, invalid

__all__ = ["Pipeline", "Prepared", "Staged"]


@attrs.frozen
class _LineageView:
    lineage: Lineage
    n_items: int

    def call(self, call_id: str) -> CallRecord | None:
        return self.lineage.call(call_id, self.n_items)


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
    if prefix is None or getattr(item, "id", None) is not None:
        return item
    return typing.cast(Item, attrs.evolve(typing.cast(Any, item), id=new_id(prefix)))


@attrs.frozen(kw_only=True, eq=False)
class Staged:
    """Items validated, rendered and classified, not yet committed to a lineage."""

    items: list[Item]
    tokens: list[array[int]]
    render_version: str  # the renderer of `tokens`
    classifier_state: Any
    open_calls: dict[str, str]
    flags: tuple[Flag, ...]

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


@attrs.frozen(kw_only=True, eq=False)
class Prepared:
    """The outcome of pre-inference work for one request."""

    state: ResponseState  # the conversation with the new input committed (response: parent's)
    flags: tuple[Flag, ...]
    cached_tokens: int  # context tokens reused from the parent without rendering


class Pipeline:
    def __init__(
        self,
        *,
        validator: Validator,
        renderer: Renderer,
        classifier: Classifier,
        registry: ModelRegistry,
        counters: Counters,
        timer: StageTimer,
        hosted: frozenset[str] = frozenset(),
    ) -> None:
        self.hosted = hosted  # hosted tool types with an executor (offered to the model)
        self.validator = validator
        self.renderer = renderer  # the default: routes to a model without its own renderer
        self.render_version = render_version(renderer)
        self.classifier = classifier
        self.registry = registry
        self.counters = counters
        self.timer = timer

    # --- renderers ---
    def renderer_for(self, route: Route) -> Renderer:
        """The renderer of `route`: the model's own, else the engine's default."""
        return route.renderer if route.renderer is not None else self.renderer

    def render_version_for(self, route: Route) -> str:
        """The version of `renderer_for(route)` (computed once per renderer, never here)."""
        if route.renderer is not None and route.render_version is not None:
            return route.render_version
        return self.render_version

    # --- stages ---
    def route(self, model: str, parent: ResponseState | None, timings: dict[str, float]) -> Route:
        if parent is not None and parent.route.model == model:
            return parent.route
        with self.timer.measure("route", timings):
            route = self.registry.resolve(model)
            if isinstance(route.backend, ParamCheckingBackend):
                route.backend.check_params(route.params)
            self.counters.route_resolutions += 1
            return route

    def prefix(
        self,
        instructions: str | None,
        tools: Sequence[Tool],
        parent: ResponseState | None,
        timings: dict[str, float],
        known: Prefix | None = None,
        *,
        route: Route,
    ) -> Prefix:
        """The parent's prefix when unchanged (its instructions, tools and renderer), else
        `known` (the render cache's, rendered from the same instructions and tools by the same
        renderer), else rendered with `route`'s renderer and classified now."""
        version = self.render_version_for(route)
        if (
            parent is not None
            and parent.prefix.render_version == version
            and parent.prefix.same_as(instructions, tools)
        ):
            return parent.prefix
        if known is not None and known.render_version == version:
            return known
        renderer = self.renderer_for(route)
        offered = offered_tools(tools, self.hosted)
        with self.timer.measure("render", timings):
            tokens = renderer.render_prefix(instructions, offered)
            self.counters.tokens_rendered += len(tokens)
        with self.timer.measure("classify", timings):
            verdict = self.classifier.feed(
                self.classifier.initial(),
                renderer.prefix_text(instructions, offered),
                len(tokens),
            )
            self.counters.chars_classified += verdict.scanned
        return Prefix(
            instructions=instructions,
            tools=tuple(tools),
            offered=offered,
            tokens=tokens,
            digest=digest_tokens(tokens),
            classifier_state=verdict.state,
            flags=verdict.flags,
            render_version=version,
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
    ) -> Staged:
        """Validate, render (with `route`'s renderer) and classify `items` after the first
        `n_items` of `lineage`."""
        renderer = self.renderer_for(route)
        open_calls = dict(open_calls)
        if validate:
            with self.timer.measure("validate", timings):
                self.validator.validate_items(
                    items, _LineageView(lineage, n_items), open_calls, param=param, offset=offset
                )
                self.counters.items_validated += len(items)
                # Input items get ids (for item_reference and input_items); ids never render.
                items = [_with_id(item) for item in items]
        with self.timer.measure("render", timings):
            rendered = [renderer.render_item(item) for item in items]
            self.counters.tokens_rendered += sum(len(t) for t in rendered)
        flags: list[Flag] = []
        with self.timer.measure("classify", timings):
            for item, toks in zip(items, rendered, strict=True):
                verdict = self.classifier.feed(
                    classifier_state, renderer.item_text(item), len(toks)
                )
                classifier_state = verdict.state
                flags.extend(verdict.flags)
                self.counters.chars_classified += verdict.scanned
        return Staged(
            items=list(items),
            tokens=rendered,
            render_version=self.render_version_for(route),
            classifier_state=classifier_state,
            open_calls=open_calls,
            flags=tuple(flags),
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
        return self.commit(empty, staged), staged.flags

    @staticmethod
    def commit(base: ResponseState, staged: Staged, **changes: Any) -> ResponseState:
        """Append staged items to `base`'s conversation (in place on the tip of a chain).
        They must be of the renderer of what they join (`rerender` otherwise)."""
        lineage = base.writable_lineage()
        if staged.items:
            if not lineage.items:
                lineage.render_version = staged.render_version
            elif lineage.render_version != staged.render_version:
                raise ValueError(
                    f"items rendered by {staged.render_version} can't join a conversation "
                    f"rendered by {lineage.render_version}"
                )
        for item, toks in zip(staged.items, staged.tokens, strict=True):
            lineage.append(item, toks)
        return attrs.evolve(
            base,
            lineage=lineage,
            n_items=base.n_items + len(staged.items),
            classifier_state=staged.classifier_state,
            open_calls=tuple(staged.open_calls.items()),
            **changes,
        )

    # --- the whole pre-inference pass ---
    def prepare(
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
        route: Route | None = None,
        validated: bool = False,
    ) -> Prepared:
        """`root` is `parent`, or for a new chain the state to build from: an empty state, a
        restored compaction window, or (`own_root`) the render cache's rendering of the first
        items of this request's own input. `known_prefix` is the render cache's rendering of
        the request's instructions and tools. `route`: the request's, when the caller resolved
        it already (to look the render cache up for its renderer); else it is resolved here,
        after the request's own validation (whose errors come first). With `require_outputs`,
        every function call must have its output by the end of the input (a model can't be
        sampled while tool results are missing). A `root` rendered by another renderer than the
        route's (a parent of another model) is rendered again first (`rerender`). `validated`:
        the caller validated the request already (off the event loop)."""
        with self.timer.measure("validate", timings):
            # Tools resent unchanged on a follow-up were validated with the parent; a prefix
            # the render cache holds, with the request that rendered it.
            known = known_prefix is not None or (
                parent is not None
                and parent.prefix.same_as(request.instructions, request.tools or ())
            )
            if not validated:
                self.validator.validate_request(request, tools_known=known)
        assert request.model is not None
        if route is None:
            route = self.route(request.model, parent, timings)
        prefix = self.prefix(
            request.instructions, request.tools or (), parent, timings, known_prefix, route=route
        )
        switched: tuple[Flag, ...] = ()
        reused_items = 0 if own_root else root.item_tokens
        if root.n_items and root.lineage.render_version != self.render_version_for(route):
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
        # Context reused from the conversation this request continues: a render cache hit
        # saves the rendering but is no continuation (usage reports what it would without it),
        # nor is a conversation rendered again for another model.
        reused = reused_items + (len(prefix.tokens) if prefix_reused else 0)
        state = self.commit(
            root,
            staged,
            prefix=prefix,
            route=route,
            first_new_item=0 if own_root else root.n_items,
        )
        flags = (() if prefix_reused else prefix.flags) + switched + staged.flags
        return Prepared(state=state, flags=flags, cached_tokens=reused)
