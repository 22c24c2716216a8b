"""`rollout serve` with one deliberate bug: `python -m tests.faulty_serve FAULT serve ...`.

Patches the engine in this process only, then runs the normal CLI entry point with the
remaining arguments. The faults (each a bug the over-the-wire equivalence test must catch,
tests/test_wire_equivalence.py):

- `chain_drops_output`: a `previous_response_id` create (not a rollout) renders its first
  tool output as nothing: the output is accepted, but the model never sees it.
- `rollout_renders_append_twice`: a tool output appended to a suspended rollout (through
  `response.append` or `response.inject`) is rendered twice into the context.
- `hydration_drops_reasoning`: a conversation rebuilt from the store (hydration) loses its
  first reasoning item (the render cache's copy is ignored, so every store read hydrates).
- `usage_off_by_one`: a response's usage, aggregated over its sampling steps, gains one input
  token at each step after the first.

This module is test code: nothing in the shipped package imports it.
"""

from __future__ import annotations

import contextvars
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from rollout import protocol as p
from rollout.engine._pipeline import Pipeline, Staged
from rollout.engine._render_cache import RenderCache
from rollout.engine._rollout import _Run
from rollout.engine._session import Session
from rollout.engine._suspend import Rollout

_CHAIN = contextvars.ContextVar("chain_create", default=False)
_APPEND = contextvars.ContextVar("rollout_append", default=False)


def _patch_stage(change: Callable[[list[p.Item], list[Any]], None]) -> None:
    """Pipeline.stage, then `change(items, tokens)` on what it staged."""
    original = Pipeline.stage

    def stage(self: Pipeline, items: Sequence[p.Item], **kw: Any) -> Staged:
        staged = original(self, items, **kw)
        change(staged.items, staged.tokens)
        return staged

    Pipeline.stage = stage  # type: ignore[method-assign]


def chain_drops_output() -> None:
    original = Session.prepare

    async def prepare(self: Session, request: p.ResponseCreate, *a: Any, **kw: Any) -> Any:
        chain = request.previous_response_id is not None and not request.rollout
        chain = chain and not (request.multi_agent or {}).get("enabled")
        token = _CHAIN.set(chain)
        try:
            return await original(self, request, *a, **kw)
        finally:
            _CHAIN.reset(token)

    def drop(items: list[p.Item], tokens: list[Any]) -> None:
        if not _CHAIN.get():
            return
        for i, item in enumerate(items):
            if p.output_of(item) is not None:
                tokens[i] = array("I")
                return

    Session.prepare = prepare  # type: ignore[method-assign]
    _patch_stage(drop)


def rollout_renders_append_twice() -> None:
    original = Rollout.append

    def append(self: Rollout, items: Any) -> None:
        token = _APPEND.set(True)
        try:
            original(self, items)
        finally:
            _APPEND.reset(token)

    def twice(items: list[p.Item], tokens: list[Any]) -> None:
        if not _APPEND.get():
            return
        for i, item in enumerate(items):
            if p.output_of(item) is not None:
                tokens[i] = tokens[i] + tokens[i]

    Rollout.append = append  # type: ignore[method-assign]
    _patch_stage(twice)


def hydration_drops_reasoning() -> None:
    original = Session._hydrate

    def hydrate(self: Session, chain: list[Any], timings: dict[str, float]) -> Any:
        dropped = False
        lossy = []
        for stored in reversed(chain):  # oldest first
            items = list(stored.items)
            if not dropped:
                for i, item in enumerate(items):
                    if isinstance(item, p.Reasoning):
                        del items[i]
                        dropped = True
                        break
            lossy.append(attrs.evolve(stored, items=items, rendered=None))
        return original(self, list(reversed(lossy)), timings)

    RenderCache.by_response = lambda self, owner, response_id: None  # type: ignore[method-assign]
    Session._hydrate = hydrate  # type: ignore[method-assign]


def usage_off_by_one() -> None:
    original = _Run.sample

    async def sample(self: _Run, *a: Any, **kw: Any) -> Any:
        later = self.total.total_tokens > 0
        step = await original(self, *a, **kw)
        if later:
            total = self.total
            self.total = attrs.evolve(
                total, input_tokens=total.input_tokens + 1, total_tokens=total.total_tokens + 1
            )
        return step

    _Run.sample = sample  # type: ignore[method-assign]


FAULTS: dict[str, Callable[[], None]] = {
    f.__name__: f
    for f in (
        chain_drops_output,
        rollout_renders_append_twice,
        hydration_drops_reasoning,
        usage_off_by_one,
    )
}


def main(argv: Sequence[str]) -> int:
    fault, *rest = argv
    FAULTS[fault]()
    from rollout._cli import main as serve_main

    return serve_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
