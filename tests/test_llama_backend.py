"""The llama backend's resources under pressure, through the embedded engine: a client that
goes away frees its sequence, a full KV pool evicts the least recently used kept sequence
(whose next turn evaluates its context again), a turn that could never fit is refused, and
the model's thread never holds the event loop.

Pools here are made small on purpose (a few hundred tokens), so the pressure comes in a few
short turns of the real model (SmolLM2-135M; greedy). Without the llama extra these skip (and
fail under `ROLLOUT_REQUIRE_ALL`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.lowlevel
from rollout import protocol as p
from rollout.engine import Engine, open_engine
from rollout.engine._defaults import default_registry
from rollout.engine._llama import LlamaBackend, LlamaConfig
from rollout.engine._models import ModelRegistry, ModelSpec

from tests.llama_harness import require_llama, smollm2_renderer

DEADLINE = 300
TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {
        "type": "object",
        "properties": {"word": {"type": "string"}},
        "required": ["word"],
    },
}
BYTES_PER_TOKEN = 23_040


def registry(*, context: int, sequences: int, index_tokens: int = 0) -> ModelRegistry:
    """The built-ins, and `small`: the packaged SmolLM2 with `sequences` of `context` tokens."""
    require_llama()
    from rollout.engine._llama_vocab import packaged_smollm2

    path = packaged_smollm2()
    assert path is not None
    backend = LlamaBackend(
        LlamaConfig(
            path=path,
            context_size=context,
            kv_memory_mb=sequences * context * BYTES_PER_TOKEN / 2**20,
            index_mb=index_tokens * BYTES_PER_TOKEN / 2**20,
            slots=sequences,
            threads=2,
        )
    )
    reg = default_registry()
    reg.add(
        ModelSpec(
            name="small",
            backend=backend,
            renderer=backend.renderer,
            context_window=8192,  # more than a sequence: the backend must refuse, not crash
            accepts_params=True,
        )
    )
    return reg


@asynccontextmanager
async def engine_with(reg: ModelRegistry) -> AsyncIterator[Engine]:
    try:
        async with open_engine(registry=reg) as engine:
            yield engine
    finally:
        with trio.CancelScope(shield=True):
            await reg.aclose()


def create(text: str, **fields: Any) -> p.ResponseCreate:
    body = {
        "type": "response.create",
        "model": "small:calls=1",
        "input": text,
        "tools": [TOOL],
        "temperature": 0,
        "max_output_tokens": 48,
        **fields,
    }
    return p.from_wire(body, p.ResponseCreate)


def kv(reg: ModelRegistry) -> Any:
    backend = reg.resolve("small").backend
    assert isinstance(backend, LlamaBackend) and backend.kv is not None
    return backend.kv


async def suspend(engine: Engine, request: p.ResponseCreate, stack: Any) -> Any:
    """Open a rollout and run it to its first suspension; the rollout stays open (in
    `stack`) until the test ends it."""
    rollout = await stack.enter_async_context(engine.session().open_rollout(request))
    async for _event in rollout:
        pass
    assert rollout.suspended, rollout.response
    return rollout


async def test_a_rollout_left_suspended_frees_its_sequence() -> None:
    from contextlib import AsyncExitStack

    reg = registry(context=1024, sequences=2)
    with trio.fail_after(DEADLINE):
        async with engine_with(reg) as engine:
            async with AsyncExitStack() as stack:
                await suspend(engine, create("Look up the word apple."), stack)
                index = kv(reg)
                assert index.kept_tokens > 0  # held for the rollout's next turn
            # The client left: the rollout is cancelled and its holder lets the sequence go
            # (no index here: it is dropped).
            assert index.kept_tokens == 0 and index.indexed_tokens == 0
            assert index.running == 0


async def test_a_turn_cut_off_mid_generation_ends_its_job() -> None:
    """A client that goes away while the model writes: the job stops at the next step and
    its sequence is free again (with one sequence in all, the next turn could not run
    otherwise)."""
    reg = registry(context=1024, sequences=1)
    with trio.fail_after(DEADLINE):
        async with engine_with(reg) as engine:
            session = engine.session()
            request = create("Write a long story about a cat.", tools=[], max_output_tokens=400)
            with trio.move_on_after(DEADLINE) as scope:

                async def cut(event: p.ServerEvent) -> None:
                    if event.type == "response.output_text.delta":
                        scope.cancel()

                await session.create(request, cut)
            assert scope.cancelled_caught
            second = await session.respond(create("Say yes.", tools=[], max_output_tokens=8))
            assert second.status in ("completed", "incomplete"), second.error
            assert kv(reg).running == 0


async def test_a_full_pool_evicts_the_least_recently_used_kept_sequence() -> None:
    """Three suspended rollouts, two sequences: the least recently used loses its
    KV (counted), and its next turn evaluates its context again but for the instructions and
    tools it shares with the others (copied from their sequences); the others, resumed
    newest first (each ending makes room), read only their new tokens."""
    from contextlib import AsyncExitStack

    reg = registry(context=512, sequences=2)
    with trio.fail_after(DEADLINE):
        async with engine_with(reg) as engine:
            async with AsyncExitStack() as stack:
                rollouts = [
                    await suspend(engine, create(f"Look up the word {w}."), stack)
                    for w in ("apple", "pear", "plum")
                ]
                index = kv(reg)
                assert index.stats.kept_evictions == 1
                results: list[tuple[int, int]] = []
                for rollout in reversed(rollouts):  # the newest first: each ends, making room
                    before = engine.counters.tokens_prefilled
                    kept_before = index.stats.tokens_reused
                    (call_id, _name), *_ = rollout.pending_calls
                    rollout.append(
                        [
                            p.from_wire(
                                {
                                    "type": "function_call_output",
                                    "call_id": call_id,
                                    "output": "a fruit",
                                },
                                p.FunctionCallOutput,
                            )
                        ]
                    )
                    async for _event in rollout:
                        pass
                    assert rollout.response is not None
                    assert rollout.response.status in ("completed", "incomplete")
                    reused = index.stats.tokens_reused - kept_before
                    prefilled = engine.counters.tokens_prefilled - before
                    results.append((reused, prefilled))
                # The evicted one kept only what it shares with the others' sequences (the
                # instructions and tools: copied from one of them); the others kept all they
                # had evaluated, their question and call included, and read only the output.
                *others, (evicted_reused, evicted_read) = results
                for reused, prefilled in others:
                    assert reused > evicted_reused and prefilled < evicted_read, results
                assert index.stats.kept_evictions == 1


async def test_a_turn_larger_than_the_pool_fails_clearly() -> None:
    reg = registry(context=256, sequences=2)
    with trio.fail_after(DEADLINE):
        async with engine_with(reg) as engine:
            long = "Look up every word here: " + "apple pear plum " * 120
            response = await engine.session().respond(create(long))
    assert response.status == "failed"
    assert response.error is not None
    assert response.error.code == "context_length_exceeded"
    assert "context of 256 tokens" in response.error.message, response.error.message


async def test_the_event_loop_serves_others_while_the_model_reads() -> None:
    """A long prompt (over a thousand tokens: seconds on these cores) is evaluated off the
    event loop: a simulated model's response started after it completes before it."""
    reg = registry(context=2048, sequences=2)
    finished: list[str] = []
    with trio.fail_after(DEADLINE):
        async with engine_with(reg) as engine:
            long = "Summarize this: " + "the quick brown fox jumps over the lazy dog. " * 120
            started = trio.Event()

            async def real() -> None:
                async def seen(event: p.ServerEvent) -> None:
                    if event.type == "response.in_progress":
                        started.set()

                await engine.session().create(create(long, tools=[], max_output_tokens=4), seen)
                finished.append("smollm2")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(real)
                await started.wait()
                await trio.lowlevel.checkpoint()  # the real turn is now the model thread's
                await engine.session().respond(
                    p.from_wire({"model": "sim", "input": "hi"}, p.ResponseCreate)
                )
                finished.append("sim")
    assert finished == ["sim", "smollm2"]
    assert len(smollm2_renderer().vocab.encode(long)) > 1000
