"""The model registry: the route stage resolves a request's `model` string to a backend.

A model string is a registered name or alias, optionally followed by `:key=value,...`
parameters for families that take them (the simulated `sim` model does):
`sim`, `sim:steps=3,parallel=2`, `sim-4000` (an alias of `sim:tps=4000`).

A model with its own tokenizer and chat template (`ModelSpec.renderer`) renders with them:
its route carries the renderer, and everything above the backend speaks its tokens. Models
without one (the `sim` family, chat-completions upstreams without a `tokenizer` in the models
file) use the engine's default renderer.

The route stage itself is a `Router`: the parent's route when the model string is unchanged,
else the registry's, with the engine's default renderer bound to a model without its own (so
every route of a request or a state carries the renderer it renders with); counted
(`route_resolutions`) and timed (`route`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
from rollout.protocol import RemoteProtocolError

from ._counters import Counters, StageTimer
from ._interfaces import Backend, ClosableBackend, ParamCheckingBackend, Renderer
from ._state import ResponseState, Route
from ._state import render_version as version_of

__all__ = [
    "DEFAULT_CONTEXT_WINDOW",
    "ModelRegistry",
    "ModelSpec",
    "Router",
    "model_not_found",
    "parse_model_string",
]

# The context window of the built-in simulated models, in tokens (like current frontier models).
DEFAULT_CONTEXT_WINDOW = 400_000
# A model string longer than this is refused without parsing (it is fed by the peer).
MAX_MODEL_STRING = 512


@attrs.frozen(kw_only=True)
class ModelSpec:
    name: str
    backend: Backend
    context_window: int = DEFAULT_CONTEXT_WINDOW
    params: Mapping[str, str] = attrs.field(factory=dict)  # defaults, overridden by the string
    accepts_params: bool = False  # whether `name:key=value,...` is allowed
    description: str = ""
    owned_by: str = "rollout"
    # The model's own tokenizer and chat template; None: the engine's default renderer.
    renderer: Renderer | None = None


def model_not_found(model: str) -> RemoteProtocolError:
    return RemoteProtocolError.invalid(
        f"The model `{model}` does not exist or you do not have access to it; "
        "GET /v1/models lists the models of this server.",
        code="model_not_found",
        param="model",
        status=404,
    )


def parse_model_string(model: str) -> tuple[str, dict[str, str]]:
    """`name:k=v,k2=v2` -> (`name`, {k: v, k2: v2}). Raises ValueError when malformed."""
    name, sep, rest = model.partition(":")
    params: dict[str, str] = {}
    if sep:
        for pair in rest.split(","):
            key, eq, value = pair.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"expected key=value, got {pair!r}")
            params[key.strip()] = value.strip()
    return name, params


class ModelRegistry:
    """Names and aliases -> model specs. Resolution is what the route stage counts."""

    def __init__(self, specs: Iterable[ModelSpec] = (), aliases: Mapping[str, str] = {}) -> None:
        self._specs: dict[str, ModelSpec] = {}
        self._aliases: dict[str, str] = {}
        self._versions: dict[str, str] = {}  # model name -> its own renderer's version
        for spec in specs:
            self.add(spec)
        for alias, target in aliases.items():
            self.alias(alias, target)

    def add(self, spec: ModelSpec) -> None:
        self._specs[spec.name] = spec
        self._versions.pop(spec.name, None)

    def alias(self, alias: str, target: str) -> None:
        """`alias` stands for the model string `target` (which may carry parameters)."""
        self._aliases[alias] = target

    def names(self) -> list[str]:
        return sorted({*self._specs, *self._aliases})

    def specs(self) -> list[ModelSpec]:
        return list(self._specs.values())

    async def aclose(self) -> None:
        """Close the backends that hold resources (connection pools)."""
        for spec in self._specs.values():
            if isinstance(spec.backend, ClosableBackend):
                await spec.backend.aclose()

    def resolve(self, model: str) -> Route:
        if len(model) > MAX_MODEL_STRING:
            raise model_not_found(model[:64] + "...")
        target = model
        name, params = self._split(target)
        seen = set()
        while name in self._aliases and name not in seen:  # aliases may chain, never loop
            seen.add(name)
            alias_name, alias_params = self._split(self._aliases[name])
            name, params = alias_name, {**alias_params, **params}
        spec = self._specs.get(name)
        if spec is None or (params and not spec.accepts_params):
            raise model_not_found(model)
        return Route(
            model=model,
            name=spec.name,
            params={**spec.params, **params},
            context_window=spec.context_window,
            backend=spec.backend,
            renderer=spec.renderer,
            render_version=self._render_version(spec),
        )

    def _render_version(self, spec: ModelSpec) -> str | None:
        """The version of a model's own renderer, computed once, on the model's first use (a
        real model's renderer loads the model to know its tokenizer: listing it does not)."""
        if spec.renderer is None:
            return None
        version = self._versions.get(spec.name)
        if version is None:
            version = self._versions[spec.name] = version_of(spec.renderer)
        return version

    @staticmethod
    def _split(model: str) -> tuple[str, dict[str, str]]:
        try:
            return parse_model_string(model)
        except ValueError as exc:
            raise RemoteProtocolError.invalid(
                f"Invalid model string {model!r}: {exc}.",
                code="model_not_found",
                param="model",
                status=404,
            ) from None


class Router:
    """The route stage (see the module docstring)."""

    def __init__(
        self,
        registry: ModelRegistry,
        *,
        renderer: Renderer,
        render_version: str,
        counters: Counters,
        timer: StageTimer,
    ) -> None:
        self.registry = registry
        self.renderer = renderer  # the default: bound to the routes of models without their own
        self.render_version = render_version  # its version
        self.counters = counters
        self.timer = timer

    def route(self, model: str, parent: ResponseState | None, timings: dict[str, float]) -> Route:
        """The route of `model` (a request's, continuing `parent`): the parent's when the model
        string is unchanged, else resolved. Raises `RemoteProtocolError` for a model that does
        not resolve, or whose backend refuses its parameters."""
        if parent is not None and parent.route.model == model:
            return parent.route
        with self.timer.measure("route", timings):
            route = self.registry.resolve(model)
            if isinstance(route.backend, ParamCheckingBackend):
                route.backend.check_params(route.params)
            self.counters.route_resolutions += 1
            if route.renderer is None:
                route = attrs.evolve(
                    route, renderer=self.renderer, render_version=self.render_version
                )
            return route
