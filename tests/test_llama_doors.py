"""Every door of the embedded engine onto a real model (SmolLM2-135M, greedy), over two user
turns: the rollout extension (`response.append`), the multi-agent beta (`response.inject`, each
output injected as its call is done), a `previous_response_id` chain, and the stateless resend
(the output echoed back bare: without ids, an assistant text as a plain string).

Each runs on an engine of its own (a model and KV of its own), and each must sample the same
items, report the same usage, and evaluate every token of the final context once: the second
user turn continues the first (a new response: the KV index finds the first's sequence), and
each tool output resumes a sequence that kept everything before it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio
from rollout import protocol as p
from rollout.engine import Engine, open_engine
from rollout.engine._defaults import default_registry

from tests.engine_harness import (
    Run,
    Script,
    echo_bare,
    run_chain,
    run_inject,
    run_rollout,
    run_stateless,
    unattributed,
)
from tests.llama_harness import require_llama, smollm2_renderer

DEADLINE = 600


@attrs.frozen
class Greedy(Script):
    """A script sampled greedily (temperature 0)."""

    def create(self, **kw: Any) -> p.ResponseCreate:
        return attrs.evolve(super().create(**kw), temperature=0.0)


SCRIPT = Greedy(
    model="smollm2:calls=2",
    tools=(
        p.FunctionTool(
            name="read_file",
            description="Read a file of the project.",
            parameters={
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        ),
    ),
    instructions="You are a coding agent. Be brief.",
    user_turns=("Why does test_parser fail?", "Now fix it."),
    tool_outputs=(
        "def parse(text):\n    return text.split(',')\n",
        "FAILED test_parser.py::test_empty - assert [''] == []",
    ),
    max_output_tokens=64,
)

Door = Callable[[Engine, Script], Awaitable[Run]]
DOORS: dict[str, Door] = {
    "chain": run_chain,
    "rollout": run_rollout,
    "inject": run_inject,
    "stateless": lambda engine, script: run_stateless(engine, script, echo_bare),
}


async def run_door(door: Door) -> tuple[Run, int]:
    registry = default_registry()  # a model of its own: nothing kept from another door
    try:
        async with open_engine(registry=registry) as engine:
            run = await door(engine, SCRIPT)
            return run, engine.counters.tokens_prefilled
    finally:
        with trio.CancelScope(shield=True):
            await registry.aclose()


def read_once(chain: Run) -> int:
    """Every token of the final context once: the context the last answer was sampled from,
    the generation prompt, and the answer's tokens but its last (sampled, never fed back)."""
    last = chain.responses[-1].usage
    assert last is not None
    return last.input_tokens + len(smollm2_renderer().generation_prompt) + last.output_tokens - 1


async def test_every_door_samples_the_same_and_evaluates_each_token_once() -> None:
    require_llama()
    results: dict[str, tuple[Run, int]] = {}
    with trio.fail_after(DEADLINE):
        for name, door in DOORS.items():
            results[name] = await run_door(door)
    chain, _ = results["chain"]
    assert len([i for i in chain.outputs if isinstance(i, p.FunctionCall)]) == 4
    expected = read_once(chain)
    items = [p.to_wire(unattributed(i)) for i in chain.outputs]
    for name, (run, prefilled) in results.items():
        seen = [p.to_wire(unattributed(i)) for i in run.outputs]
        for item in (*seen, *items):
            item.pop("id", None)
            item.pop("call_id", None)
        assert seen == items, name
        assert run.usage() == chain.usage(), name  # summed: a rollout's response sums its turns
        assert prefilled == expected, (name, prefilled, expected)
