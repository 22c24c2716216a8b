"""A session's cache of ResponseStates, and the work a follow-up does (or does not do).

Cache semantics:
- a miss on a response created with store=false is `previous_response_not_found`;
- a miss on a stored response hydrates it (and the continuation is the same);
- a failed continuation evicts its parent (the client must not build on a turn whose follow-up
  failed without noticing; with store=true it is hydrated again);
- the bounds hold: `max_cached_responses` keeps the most recent, `max_cached_tokens` evicts the
  least recently used;
- forks (two children of one parent) both work, each with the context a stateless request of
  the same items gets (the lineage is copied on fork, never shared by two tips).

Work counters: a previous_response_id follow-up validates, renders and classifies only its new
items, reuses the parent's route while the model string is unchanged, and reuses the rendered
prefix while instructions and tools are unchanged.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import pytest
import trio
from rollout import protocol as p
from rollout.engine import (
    ClassifierSet,
    Engine,
    MemoryResponseStore,
    PatternPolicy,
    PolicyRule,
    RenderCache,
    ResponseState,
    SecretDetector,
    Session,
)
from rollout.engine import (
    open_engine as _open_engine,
)

from tests.engine_harness import (
    LOOKUP_INSTRUCTIONS,
    LOOKUP_TOOL,
    classified_chars,
    lookup_request,
    same_items,
)


def open_engine(**kw: Any) -> AbstractAsyncContextManager[Engine]:
    """An engine without the render cache: these tests specify what a connection's cache and
    hydration do by themselves (tests/test_render_cache.py adds the render cache)."""
    return _open_engine(render_cache=RenderCache(max_bytes=0), **kw)


DEADLINE = 10

TOOL = LOOKUP_TOOL
MODEL = "sim:steps=2,parallel=2,tokens=8"
INSTRUCTIONS = LOOKUP_INSTRUCTIONS


def request(**kw: Any) -> p.ResponseCreate:
    return lookup_request(MODEL, **kw)


def answers(state: ResponseState) -> list[p.Item]:
    return [
        p.FunctionCallOutput(call_id=call_id, output=f"value for {call_id[-4:]}")
        for call_id, _name in state.open_calls
    ]


def next_input(state: ResponseState, text: str = "go on") -> list[p.Item]:
    return [*answers(state), p.Message(role="user", content=text)]


async def create(session: Session, **kw: Any) -> ResponseState:
    state = await session.create(request(**kw))
    assert state is not None
    return state


async def follow(session: Session, parent: ResponseState, **kw: Any) -> ResponseState:
    kw.setdefault("input", next_input(parent))
    return await create(session, previous_response_id=parent.id, **kw)


async def chain(session: Session, n: int, **kw: Any) -> list[ResponseState]:
    states = [await create(session, input="start", **kw)]
    for _ in range(n - 1):
        states.append(await follow(session, states[-1], **kw))
    return states


def not_found(info: pytest.ExceptionInfo[p.RemoteProtocolError], response_id: str) -> bool:
    error = info.value
    return (
        error.code == "previous_response_not_found"
        and error.param == "previous_response_id"
        and error.status == 400
        and response_id in str(error)
    )


def rendered(engine: Engine, items: list[p.Item]) -> int:
    return sum(len(engine.pipeline.renderer.render_item(i)) for i in items)


# --- misses --------------------------------------------------------------------------------


async def test_miss_on_an_unstored_response_is_previous_response_not_found() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore()) as engine:
            a = await create(engine.session(), input="hello", store=False)
            await engine.post.flushed()
            other = engine.session()
            before = engine.counters.snapshot()
            with pytest.raises(p.RemoteProtocolError) as info:
                await follow(other, a)
            delta = engine.counters.snapshot() - before
    assert not_found(info, a.id)
    assert (delta.cache_misses, delta.hydrations, delta.samplings) == (1, 0, 0)
    assert delta.request_errors == 1


async def test_miss_without_a_store_is_previous_response_not_found() -> None:
    """With no store configured, store=true (the default) keeps nothing beyond the session."""
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            a = await create(engine.session(), input="hello", store=True)
            await engine.post.flushed()
            assert engine.post.pending_get(a.id) is None
            with pytest.raises(p.RemoteProtocolError) as info:
                await follow(engine.session(), a)
    assert not_found(info, a.id)


async def test_miss_on_a_stored_response_hydrates_it() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore()) as engine:
            owner = engine.session()
            states = await chain(owner, 3, store=True)
            await engine.post.flushed()
            other = engine.session()
            before = engine.counters.snapshot()
            cold = await follow(other, states[-1])
            delta = engine.counters.snapshot() - before
            warm = await follow(owner, states[-1])
    assert (delta.cache_misses, delta.hydrations, delta.store_reads) == (1, 1, 3)
    assert same_items(cold.response.output, warm.response.output)
    assert cold.context() == warm.context()


# --- failed continuations evict their parent -----------------------------------------------


async def test_a_request_error_evicts_the_parent() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            parent = await create(session, input="hello")
            assert parent.id in session.cache
            with pytest.raises(p.RemoteProtocolError) as info:
                await follow(
                    session,
                    parent,
                    input=[p.FunctionCallOutput(call_id="call_unknown", output="x")],
                )
            assert parent.id not in session.cache
            with pytest.raises(p.RemoteProtocolError) as again:
                await follow(session, parent)
    assert info.value.code == "invalid_value"
    assert info.value.param == "input[0].call_id"
    assert not_found(again, parent.id)


async def test_a_failed_response_evicts_the_parent_and_a_stored_one_hydrates_again() -> None:
    blocking = ClassifierSet(
        [SecretDetector(), PatternPolicy([PolicyRule(name="no_zebras", pattern="zebra")])]
    )
    events: list[p.ServerEvent] = []

    async def emit(event: p.ServerEvent) -> None:
        events.append(event)

    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore(), classifier=blocking) as engine:
            session = engine.session()
            parent = await create(session, input="hello", store=True)
            failed = await session.create(
                request(
                    input=[*answers(parent), p.Message(role="user", content="a zebra!")],
                    previous_response_id=parent.id,
                ),
                emit,
            )
            assert failed is None
            assert events[-1].type == "response.failed"
            assert parent.id not in session.cache
            await engine.post.flushed()
            before = engine.counters.snapshot()
            retried = await follow(session, parent)
            delta = engine.counters.snapshot() - before
            assert retried.response.status == "completed"
            assert delta.hydrations == 1


async def test_a_failed_request_leaves_the_parent_untouched() -> None:
    """Staged work is committed only when every stage passed: the parent is still the tip of
    its lineage, and a store=true parent continues (hydrated) as if nothing happened."""
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore()) as engine:
            session = engine.session()
            parent = await create(session, input="hello", store=True)
            n_items, tokens = parent.n_items, len(parent.lineage.tokens)
            bad = [*next_input(parent), p.FunctionCallOutput(call_id="call_nope", output="x")]
            with pytest.raises(p.RemoteProtocolError):
                await follow(session, parent, input=bad)
            assert len(parent.lineage) == n_items
            assert len(parent.lineage.tokens) == tokens
            after = await follow(session, parent)
            reference = await follow(engine.session(), parent)
    assert same_items(after.response.output, reference.response.output)


# --- bounds --------------------------------------------------------------------------------


async def test_max_cached_responses_keeps_the_most_recent() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session(max_cached_responses=2)
            states = await chain(session, 4)
            assert len(session.cache) == 2
            assert [s.id in session.cache for s in states] == [False, False, True, True]
            for evicted in states[:2]:
                with pytest.raises(p.RemoteProtocolError) as info:
                    await follow(session, evicted)
                assert not_found(info, evicted.id)
            # A kept one continues (the older one, as a fork); its child then takes the place
            # of the least recently used, the former tip.
            fork = await follow(session, states[2])
            assert [s.id in session.cache for s in (states[2], states[3], fork)] == [
                True,
                False,
                True,
            ]


async def test_max_cached_tokens_evicts_the_least_recently_used() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            probe = engine.session()
            sizes = [
                len((await create(probe, input=f"conversation {i}")).lineage.tokens)
                for i in range(3)
            ]
            # Room for two independent conversations (lineages), not three.
            limit = sum(sorted(sizes)[1:]) + 1
            session = engine.session(max_cached_tokens=limit)
            a = await create(session, input="conversation 0")
            b = await create(session, input="conversation 1")
            assert a.id in session.cache and b.id in session.cache
            assert session.cache.get(a.id) is a  # a is now the most recently used
            c = await create(session, input="conversation 2")
            assert [s.id in session.cache for s in (a, b, c)] == [True, False, True]
            assert session.cache.tokens_held() <= limit
            # A single state larger than the limit is still kept (the newest always is).
            tiny = engine.session(max_cached_tokens=1)
            d = await create(tiny, input="big enough")
            e = await follow(tiny, d)
            assert len(tiny.cache) == 1 and e.id in tiny.cache


async def test_the_cache_follows_the_lanes() -> None:
    """Each lane's latest response stays past the count bound (a lane's next turn finds its
    parent however busy the other lanes are); a newer one on its lane releases it; a failed
    continuation evicts its parent only on the parent's own lane; the token bound stays hard.
    (A request's lane is its `stream_id`; the default lane is None.)"""
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session(max_cached_responses=2)
            made = {lane: await create(session, input="hi", stream_id=lane) for lane in "abc"}
            made["-"] = await create(session, input="hi")
            assert all(s.id in session.cache for s in made.values())
            newer = await follow(session, made["a"], stream_id="a")
            # a's first response is no lane's latest now: the count bound (2) evicts it.
            assert made["a"].id not in session.cache and newer.id in session.cache
            # A failed fork on lane b keeps lane c's response...
            with pytest.raises(p.RemoteProtocolError):
                await follow(session, made["c"], stream_id="b", input=[answers(made["c"])[0]])
            assert made["c"].id in session.cache
            # ...and a failure on lane c itself evicts it (store: false: gone).
            with pytest.raises(p.RemoteProtocolError):
                await follow(session, made["c"], stream_id="c", input=[answers(made["c"])[0]])
            assert made["c"].id not in session.cache
            with pytest.raises(p.RemoteProtocolError) as gone:
                await follow(session, made["c"], stream_id="c")
            assert not_found(gone, made["c"].id)
            # The token bound evicts even a lane's latest (least recently used first).
            tight = engine.session(max_cached_tokens=1)
            first = await create(tight, input="hi", stream_id="x")
            second = await create(tight, input="hi", stream_id="y")
            assert first.id not in tight.cache and second.id in tight.cache


def test_cache_bounds_are_validated() -> None:
    from rollout.engine import ResponseCache

    with pytest.raises(ValueError):
        ResponseCache(max_responses=0)


# --- forks ---------------------------------------------------------------------------------


async def stateless_twin(engine: Engine, state: ResponseState) -> ResponseState:
    """The same conversation sent whole: the input is every item before the state's output."""
    n_output = len(state.response.output)
    items = list(state.items)[: state.n_items - n_output]
    twin = await create(engine.session(), input=items)
    return twin


async def test_forks_both_work_with_their_own_contexts() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            root = await create(session, input="start here")
            parent = await follow(session, root, input=next_input(root, "first question"))
            parent_context = parent.context()
            left = await follow(session, parent, input=next_input(parent, "go left"))
            right = await follow(session, parent, input=next_input(parent, "go right"))
            # Extending each tip again, and forking from the root too.
            left2 = await follow(session, left, input=next_input(left, "further left"))
            right2 = await follow(session, right, input=next_input(right, "further right"))
            third = await follow(session, root, input=next_input(root, "another way"))
            twins = [await stateless_twin(engine, s) for s in (left, right, left2, right2, third)]

    # The parent's view did not change; the first child extended its lineage in place, the
    # second got a copy.
    assert parent.context() == parent_context
    assert left.lineage is parent.lineage
    assert right.lineage is not parent.lineage
    for forked, twin in zip((left, right, left2, right2, third), twins, strict=True):
        assert forked.context() == twin.context()
        assert forked.context_digest == twin.context_digest
        assert forked.classifier_state == twin.classifier_state
        assert same_items(forked.response.output, twin.response.output)
    assert left.context() != right.context()
    assert list(left.items)[: parent.n_items] == list(right.items)[: parent.n_items]


# --- work counters -------------------------------------------------------------------------


async def test_a_follow_up_does_work_for_its_new_items_only() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            states = await chain(session, 6)
            parent = states[-1]
            new = next_input(parent, "one more thing")
            before = engine.counters.snapshot()
            # generate=false: pre-inference only (validate, render, classify, route).
            warmed = await create(
                session, input=new, previous_response_id=parent.id, generate=False
            )
            delta = engine.counters.snapshot() - before
            sampled = await follow(session, parent, input=new)
            delta_sampled = engine.counters.snapshot() - before - delta

    assert warmed.response.status == "completed"
    assert delta.items_validated == len(new)
    assert delta.tokens_rendered == rendered(engine, new)
    assert delta.chars_classified == classified_chars(engine, new)
    assert (delta.route_resolutions, delta.cache_hits, delta.samplings) == (0, 1, 0)
    assert warmed.context_tokens == parent.context_tokens + rendered(engine, new)

    # With sampling, the output items are rendered once more, and nothing else.
    assert delta_sampled.items_validated == len(new)
    assert delta_sampled.tokens_rendered == sampled.context_tokens - parent.context_tokens
    usage = sampled.response.usage
    assert usage is not None
    assert usage.input_tokens == parent.context_tokens + rendered(engine, new)
    assert usage.input_tokens_details.cached_tokens == parent.context_tokens


async def test_route_is_reused_while_the_model_string_is_unchanged() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            resolutions: list[int] = []
            state = await create(session, input="hi")
            for model in (MODEL, MODEL, "sim:steps=2,parallel=2,tokens=9", MODEL, MODEL):
                before = engine.counters.route_resolutions
                state = await follow(session, state, model=model)
                resolutions.append(engine.counters.route_resolutions - before)
                assert state.route.model == model
    assert resolutions == [0, 0, 1, 1, 0]


async def test_prefix_is_rendered_again_only_when_instructions_or_tools_change() -> None:
    other_tool = attrs.evolve(TOOL, description="Look a key up, carefully.")
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            renderer = engine.pipeline.renderer
            parent = await create(session, input="hi")
            cases: list[tuple[dict[str, Any], bool]] = [
                ({}, False),
                ({"instructions": "Be terse."}, True),
                ({"instructions": "Be terse."}, False),
                ({"instructions": "Be terse.", "tools": [other_tool]}, True),
                ({"instructions": "Be terse.", "tools": [other_tool]}, False),
            ]
            for changes, re_rendered in cases:
                new = next_input(parent)
                before = engine.counters.snapshot()
                child = await create(
                    session, input=new, previous_response_id=parent.id, generate=False, **changes
                )
                delta = engine.counters.snapshot() - before
                prefix = renderer.render_prefix(
                    changes.get("instructions", INSTRUCTIONS), changes.get("tools", [TOOL])
                )
                expected = rendered(engine, new) + (len(prefix) if re_rendered else 0)
                assert delta.tokens_rendered == expected, changes
                assert (child.prefix is parent.prefix) is not re_rendered
                assert child.context()[: len(prefix)] == prefix
                parent = child


async def test_stateless_requests_redo_everything() -> None:
    """The baseline the counters are compared with: a whole-history request renders it all."""
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            states = await chain(session, 3)
            history = list(states[-1].items)
            before = engine.counters.snapshot()
            whole = await create(engine.session(), input=history, generate=False)
            delta = engine.counters.snapshot() - before
    assert delta.items_validated == len(history)
    assert delta.tokens_rendered == whole.context_tokens
    assert delta.route_resolutions == 1
