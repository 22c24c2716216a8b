"""Hydration: a state rebuilt from the store is the state the original session cached.

A session that never saw a response (another connection, another process) continues it by
walking the stored chain to a root and re-rendering and re-classifying it. Over generated agent
scripts, for every response of a store=true chain, on both stores:

- the hydrated `ResponseState` is `.equivalent()` to the cached one (items, rendered context,
  digest, classifier state, calls waiting for output, route), and is itself marked stored;
- continuing from it produces the same output (modulo ids) and the same token counts as
  continuing on the original session;
- the counters show one hydration, one cache miss and one store read per stored response of
  the chain.

Cached tokens are context tokens not rendered for this request (see `Prepared.cached_tokens`):
a continuation of a parent hydrated from stored renderings, like the same continuation on the
original session, reports the parent's whole context as cached; one whose hydration rendered the
stored items again reports what it rendered as not cached. In every case
`cached + rendered-for-this-input == input`.
"""

from __future__ import annotations

import tempfile
import typing
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from rollout import protocol as p
from rollout.engine import (
    ClassifierSet,
    Engine,
    MemoryResponseStore,
    PatternPolicy,
    PolicyRule,
    RenderCache,
    ResponseState,
    ResponseStore,
    SecretDetector,
    Session,
    open_sqlite_store,
)
from rollout.engine import (
    open_engine as _open_engine,
)

from tests.engine_harness import (
    Script,
    WithoutRenderings,
    answer_item,
    classified_chars,
    conversation_chars,
    pending_calls,
    run_chain,
    same_items,
    scripts,
)


def open_engine(**kw: Any) -> AbstractAsyncContextManager[Engine]:
    """An engine without the render cache: these tests specify what a connection's cache and
    hydration do by themselves (tests/test_render_cache.py adds the render cache)."""
    return _open_engine(render_cache=RenderCache(max_bytes=0), **kw)


DEADLINE = 30
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
STORES = ["memory", "sqlite", "memory-unrendered", "sqlite-unrendered"]


def classifiers() -> ClassifierSet:
    """The default detector plus a counting rule, so the classifier state carries counts that
    grow with the conversation (a hydration that lost or doubled a text would show)."""
    return ClassifierSet(
        [
            SecretDetector(),
            PatternPolicy([PolicyRule(name="the", pattern=r"\bthe\b", action=1_000_000)]),
        ]
    )


@asynccontextmanager
async def open_store(kind: str) -> AsyncIterator[ResponseStore]:
    """`memory` or `sqlite`, and `-unrendered` for one that keeps no renderings."""
    base, _, unrendered = kind.partition("-")
    if base == "memory":
        memory = MemoryResponseStore()
        yield typing.cast(ResponseStore, WithoutRenderings(memory)) if unrendered else memory
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = await open_sqlite_store(Path(tmp) / "store.db")
        try:
            yield typing.cast(ResponseStore, WithoutRenderings(store)) if unrendered else store
        finally:
            await store.aclose()


def continuation(state: ResponseState, text: str = "and then?") -> list[p.Item]:
    """Outputs for every call the state waits for, then a user message."""
    calls = {c.call_id: c for c in pending_calls(list(state.items))}
    items: list[p.Item] = [
        answer_item(calls[call_id], f"result of {name}") for call_id, name in state.open_calls
    ]
    items.append(p.Message(role="user", content=text))
    return items


async def continue_from(
    session: Session, script: Script, state: ResponseState, **kw: Any
) -> ResponseState:
    kw.setdefault("store", False)
    result = await session.create(
        script.create(input=continuation(state), previous_response_id=state.id, **kw)
    )
    assert result is not None
    return result


def cached(state: ResponseState) -> int:
    usage = state.response.usage
    assert usage is not None
    return usage.input_tokens_details.cached_tokens


async def check_chain_hydrates(engine: Engine, script: Script) -> None:
    chain = await run_chain(engine, script, store=True)
    await engine.post.flushed()
    for depth, original in enumerate(chain.states, start=1):
        assert original.stored
        # A session that never saw the chain: the parent is hydrated from the store.
        fresh = engine.session()
        before = engine.counters.snapshot()
        hydrated_cont = await continue_from(fresh, script, original)
        delta = engine.counters.snapshot() - before
        assert delta.hydrations == 1
        assert delta.cache_misses == 1 and delta.cache_hits == 0
        assert delta.store_reads == depth  # the response and its ancestors up to the root

        hydrated = fresh.cache.get(original.id)
        assert hydrated is not None
        assert hydrated.equivalent(original)
        assert hydrated.response == original.response
        assert hydrated.stored
        assert hydrated.first_new_item == original.first_new_item
        assert hydrated.own_items == original.own_items
        assert hydrated.context_tokens == original.context_tokens

        # The same continuation on a session that has the parent cached.
        warm = engine.session()
        warm.cache.put(original)
        before = engine.counters.snapshot()
        warm_cont = await continue_from(warm, script, original)
        assert (engine.counters.snapshot() - before).hydrations == 0

        assert same_items(hydrated_cont.response.output, warm_cont.response.output)
        assert hydrated_cont.context() == warm_cont.context()
        assert hydrated_cont.classifier_state == warm_cont.classifier_state
        h_usage, w_usage = hydrated_cont.response.usage, warm_cont.response.usage
        assert h_usage is not None and w_usage is not None
        assert (h_usage.input_tokens, h_usage.output_tokens) == (
            w_usage.input_tokens,
            w_usage.output_tokens,
        )
        # Cached: what was not rendered for the request (the hydration's own rendering too).
        output_tokens = hydrated_cont.context_tokens - h_usage.input_tokens
        rendered_for_input = delta.tokens_rendered - output_tokens
        assert cached(hydrated_cont) == h_usage.input_tokens - rendered_for_input
        assert cached(warm_cont) == original.context_tokens


@pytest.mark.parametrize("store_kind", STORES)
@SETTINGS
@given(script=scripts())
async def test_hydrated_state_equals_the_cached_state(store_kind: str, script: Script) -> None:
    with trio.fail_after(DEADLINE):
        async with open_store(store_kind) as store:
            async with open_engine(store=store, classifier=classifiers()) as engine:
                await check_chain_hydrates(engine, script)


# --- targeted cases ------------------------------------------------------------------------

TOOL = p.FunctionTool(
    name="lookup",
    parameters={
        "type": "object",
        "properties": {"key": {"type": "string"}},
        "required": ["key"],
        "additionalProperties": False,
    },
)
SCRIPT = Script(
    model="sim:steps=2,parallel=2,tokens=9",
    tools=(TOOL,),
    instructions="You look things up.",
    user_turns=("find the answer", "and the question"),
    tool_outputs=("42", "unknown"),
)


@pytest.mark.parametrize("store_kind", STORES)
async def test_hydration_counts_and_cached_tokens(store_kind: str) -> None:
    with trio.fail_after(DEADLINE):
        async with open_store(store_kind) as store, open_engine(store=store) as engine:
            chain = await run_chain(engine, SCRIPT, store=True)
            await engine.post.flushed()
            assert engine.counters.store_writes == len(chain.states)
            tip = chain.final
            fresh = engine.session()
            new_items = continuation(tip)
            before = engine.counters.snapshot()
            first = await fresh.create(
                SCRIPT.create(input=new_items, previous_response_id=tip.id, store=False)
            )
            after_first = engine.counters.snapshot()
            # The next turn on the same session is a cache hit: nothing is re-rendered.
            assert first is not None
            second = await fresh.create(
                SCRIPT.create(input=continuation(first), previous_response_id=first.id)
            )
            after_second = engine.counters.snapshot()

    renderer_tokens = sum(len(fresh.engine.pipeline.renderer.render_item(i)) for i in new_items)
    delta = after_first - before
    assert (delta.hydrations, delta.cache_misses, delta.cache_hits) == (1, 1, 0)
    assert delta.store_reads == len(chain.states)
    assert delta.route_resolutions == 1
    output_tokens = first.context_tokens - tip.context_tokens - renderer_tokens
    if store_kind.endswith("-unrendered"):
        # Hydration rendered the whole stored context, then the new input and the output.
        assert delta.tokens_rendered == tip.context_tokens + renderer_tokens + output_tokens
        assert delta.chars_classified == conversation_chars(fresh.engine, first)
    else:
        # The stored renderings: only the new input and the output are rendered.
        assert delta.tokens_rendered == renderer_tokens + output_tokens
        assert delta.chars_classified == classified_chars(
            fresh.engine, list(first.items)[tip.n_items :]
        )
    usage = first.response.usage
    assert usage is not None
    assert usage.input_tokens == tip.context_tokens + renderer_tokens
    cached = usage.input_tokens_details.cached_tokens
    assert cached == (0 if store_kind.endswith("-unrendered") else tip.context_tokens)
    assert cached + delta.tokens_rendered - output_tokens == usage.input_tokens

    assert second is not None
    delta2 = after_second - after_first
    assert (delta2.hydrations, delta2.cache_hits, delta2.store_reads) == (0, 1, 0)
    usage2 = second.response.usage
    assert usage2 is not None
    assert usage2.input_tokens_details.cached_tokens == first.context_tokens


async def test_a_chain_through_an_unstored_response_hydrates_from_its_root() -> None:
    """A store=true response whose history is not all stored is stored whole (a root)."""
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore()) as engine:
            session = engine.session()
            a = await session.create(SCRIPT.create(input="first", store=False))
            assert a is not None
            b = await continue_from(session, SCRIPT, a, store=True)
            c = await continue_from(session, SCRIPT, b, store=True)
            await engine.post.flushed()
            assert not b.stored and not c.stored  # their history is not all in the store
            fresh = engine.session()
            before = engine.counters.snapshot()
            hydrated, _ = await fresh.resolve_parent(c.id, {})
            delta = engine.counters.snapshot() - before
            with pytest.raises(p.RemoteProtocolError) as info:
                await engine.session().resolve_parent(a.id, {})
    assert hydrated.equivalent(c)
    # b's parent is not stored, so b and c are each stored whole: c alone is read.
    assert delta.store_reads == 1
    assert info.value.code == "previous_response_not_found"


async def test_changed_model_and_instructions_midway_hydrate_equivalently() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore(), classifier=classifiers()) as engine:
            session = engine.session()
            a = await session.create(SCRIPT.create(input="start", store=True))
            assert a is not None
            b = await session.create(
                attrs.evolve(
                    SCRIPT.create(input=continuation(a), previous_response_id=a.id),
                    model="sim:steps=3,tokens=4",
                    instructions="Now be terse.",
                )
            )
            assert b is not None
            await engine.post.flushed()
            hydrated, _ = await engine.session().resolve_parent(b.id, {})
    assert hydrated.equivalent(b)
    assert hydrated.route.model == "sim:steps=3,tokens=4"
    assert hydrated.prefix.instructions == "Now be terse."


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_response_cut_off_in_a_function_call_hydrates_equivalently(
    store_kind: str,
) -> None:
    """max_output_tokens cuts a function call: the call is `incomplete` and waits for no
    output, in the cached state, in the hydrated state and in a stateless replay alike."""
    long_args = p.FunctionTool(
        name="write",
        parameters={
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 200}},
            "required": ["text"],
        },
    )
    script = Script(
        model="sim:steps=1,parallel=2",
        tools=(long_args,),
        instructions=None,
        user_turns=("write",),
        tool_outputs=("ok",),
        max_output_tokens=6,
    )
    with trio.fail_after(DEADLINE):
        async with open_store(store_kind) as store, open_engine(store=store) as engine:
            session = engine.session()
            cut = await session.create(script.create(input="write it", store=True))
            assert cut is not None
            assert cut.response.status == "incomplete"
            assert [getattr(i, "status", None) for i in cut.response.output] == ["incomplete"]
            assert cut.open_calls == ()
            await engine.post.flushed()
            fresh = engine.session()
            hydrated, _ = await fresh.resolve_parent(cut.id, {})
            assert hydrated.equivalent(cut)
            # Continuing needs no output for the cut-off call, however the parent is found.
            warm = await session.create(
                script.create(input="go on", previous_response_id=cut.id, store=False)
            )
            cold = await fresh.create(
                script.create(input="go on", previous_response_id=cut.id, store=False)
            )
            stateless = await engine.session().create(
                script.create(
                    input=[*cut.items, p.Message(role="user", content="go on")], store=False
                )
            )
    assert warm is not None and cold is not None and stateless is not None
    assert same_items(warm.response.output, cold.response.output)
    assert same_items(warm.response.output, stateless.response.output)
    assert warm.context() == cold.context() == stateless.context()


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_stored_rollout_hydrates_equivalently(store_kind: str) -> None:
    """A rollout's stored response holds its tool outputs too (they are in its state)."""
    with trio.fail_after(DEADLINE):
        async with open_store(store_kind) as store, open_engine(store=store) as engine:
            session = engine.session()
            request = SCRIPT.create(input="find it", rollout=True, store=True)
            async with session.open_rollout(request) as rollout:
                while True:
                    async for _event in rollout:
                        pass
                    if not rollout.suspended:
                        break
                    rollout.append(
                        [
                            p.FunctionCallOutput(call_id=call_id, output="found")
                            for call_id, _name in rollout.pending_calls
                        ]
                    )
            assert rollout.response is not None and rollout.response.status == "completed"
            await engine.post.flushed()
            original = session.cache.get(rollout.response.id)
            assert original is not None
            fresh = engine.session()
            hydrated, _ = await fresh.resolve_parent(original.id, {})
            warm = await continue_from(session, SCRIPT, original)
            cold = await continue_from(fresh, SCRIPT, hydrated)
    assert any(isinstance(i, p.FunctionCallOutput) for i in original.items)
    assert hydrated.equivalent(original)
    assert same_items(warm.response.output, cold.response.output)


async def test_hydration_is_owner_scoped() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore()) as engine:
            alice = engine.session(owner="alice")
            a = await alice.create(SCRIPT.create(input="mine", store=True))
            assert a is not None
            await engine.post.flushed()
            hydrated, _ = await engine.session(owner="alice").resolve_parent(a.id, {})
            with pytest.raises(p.RemoteProtocolError) as bob:
                await engine.session(owner="bob").resolve_parent(a.id, {})
            with pytest.raises(p.RemoteProtocolError) as anonymous:
                await engine.session().resolve_parent(a.id, {})
    assert hydrated.equivalent(a)
    assert bob.value.code == anonymous.value.code == "previous_response_not_found"


async def test_a_store_write_still_queued_is_read_back() -> None:
    """Read-your-writes: a follow-up on another session right after the response finished
    (its store write possibly still queued) hydrates it."""
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore()) as engine:
            a = await engine.session().create(SCRIPT.create(input="now", store=True))
            assert a is not None
            hydrated, _ = await engine.session().resolve_parent(a.id, {})
    assert hydrated.equivalent(a)
