"""The render cache: a conversation rendered once is never rendered again, whichever way its
client sends it, and never for another owner.

Per turn, every way a client can continue a conversation validates, renders and classifies
only what is new (the new input, then the model's output): stateless requests resending the
whole history (HTTP, or a WebSocket `response.create` without `previous_response_id`), an HTTP
`previous_response_id` chain (a new session per request), a reconnect continuing a stored
response, a fork from an earlier response, a retry. Outputs are those of an engine without the
cache (tests/test_engine_equivalence.py proves it over generated scripts, with and without ids
on echoed items). The cache never resolves an id, never crosses owners, never keeps what
failed classification, stays within its budget, and forgets after its TTL.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from rollout import protocol as p
from rollout.engine import (
    ChatTemplateRenderer,
    ClassifierSet,
    Counters,
    Engine,
    MemoryResponseStore,
    O200kTokenizer,
    RenderCache,
    ResponseState,
    ResponseStore,
    SecretDetector,
    open_engine,
    open_sqlite_store,
)
from rollout.engine import _render_cache as render_cache_module

from tests.engine_harness import (
    LOOKUP_INSTRUCTIONS,
    LOOKUP_TOOL,
    WithoutRenderings,
    classified_chars,
    lookup_request,
    same_items,
)
from tests.server_harness import open_test_server, open_ws

DEADLINE = 20

TOOL = LOOKUP_TOOL
MODEL = "sim:steps=3,parallel=2,tokens=8"
INSTRUCTIONS = LOOKUP_INSTRUCTIONS


def request(**kw: Any) -> p.ResponseCreate:
    return lookup_request(MODEL, **kw)


def answers(state: ResponseState, n: int) -> list[p.Item]:
    return [
        p.FunctionCallOutput(call_id=call_id, output=f"value {n}.{i} for {name} " * 20)
        for i, (call_id, name) in enumerate(state.open_calls)
    ]


async def stored_chain_of_two(engine: Engine) -> tuple[ResponseState, ResponseState]:
    """Two stored responses, the second continuing the first; written when this returns."""
    session = engine.session()
    a = await session.create(request(input="look up a, b and c", store=True))
    assert a is not None
    b = await session.create(request(input=answers(a, 0), previous_response_id=a.id, store=True))
    assert b is not None
    await engine.post.flushed()
    return a, b


def rendered(engine: Engine, items: Sequence[p.Item]) -> int:
    return sum(len(engine.pipeline.renderer.render_item(i)) for i in items)


def bare(item: p.Item) -> p.Item:
    """As a client may echo an output: no id, no status."""
    changes = {k: None for k in ("id", "status") if getattr(item, k, None) is not None}
    return attrs.evolve(item, **changes)  # type: ignore[misc]


async def run_stateless(
    engine: Engine, *, owner: str | None = None, fresh_sessions: bool = True, echo: Any = bare
) -> tuple[list[ResponseState], list[Counters]]:
    """A conversation of several turns, the whole history sent every time; the work each
    turn did."""
    session = engine.session(owner=owner)
    history: list[p.Item] = [p.Message(role="user", content="look up a, b and c")]
    states: list[ResponseState] = []
    work: list[Counters] = []
    for n in range(4):
        if fresh_sessions:
            session = engine.session(owner=owner)  # HTTP: a session per request
        before = engine.counters.snapshot()
        state = await session.create(request(input=list(history)))
        assert state is not None
        work.append(engine.counters - before)
        states.append(state)
        history.extend(echo(item) for item in state.response.output)
        if not state.open_calls:
            break
        history.extend(answers(state, n))
    return states, work


def new_work(engine: Engine, states: list[ResponseState]) -> list[tuple[int, int]]:
    """(tokens, chars) each turn had to render and classify: its new input and its output
    (and the first turn's instructions and tools)."""
    out = []
    for i, state in enumerate(states):
        start = 0 if i == 0 else states[i - 1].n_items
        items = list(state.items)[start:]
        tokens = rendered(engine, items) + (len(state.prefix.tokens) if i == 0 else 0)
        chars = classified_chars(engine, items, state.prefix if i == 0 else None)
        out.append((tokens, chars))
    return out


def did(work: list[Counters]) -> list[tuple[int, int]]:
    return [(w.tokens_rendered, w.chars_classified) for w in work]


# --- every path does work for its new items only --------------------------------------------


@pytest.mark.parametrize("fresh_sessions", [True, False], ids=["http", "websocket-resend"])
async def test_stateless_turns_render_only_their_new_items(fresh_sessions: bool) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            states, work = await run_stateless(engine, fresh_sessions=fresh_sessions)
        async with open_engine(render_cache=RenderCache(max_bytes=0)) as baseline:
            plain, plain_work = await run_stateless(baseline, fresh_sessions=fresh_sessions)
    assert len(states) == 3  # two turns of calls, then the answer
    assert did(work) == new_work(engine, states)
    assert [w.items_validated for w in work[1:]] == [
        len(answers(s, 0)) for s in states[:-1]
    ]  # the new tool outputs only
    # The same responses as without the cache, which renders the whole history every turn;
    # the same usage but cached tokens: with the cache, what it did not render (the turn's
    # input less the part of its new work that was input), without, none.
    for state, twin, (new_tokens, _) in zip(states, plain, did(work), strict=True):
        assert same_items(state.response.output, twin.response.output)
        assert state.context() == twin.context()
        usage, plain_usage = state.response.usage, twin.response.usage
        assert usage is not None and plain_usage is not None
        assert attrs.evolve(usage, input_tokens_details=plain_usage.input_tokens_details) == (
            plain_usage
        )
        assert plain_usage.input_tokens_details.cached_tokens == 0
        output_tokens = rendered(engine, list(state.response.output))
        assert usage.input_tokens_details.cached_tokens == usage.input_tokens - (
            new_tokens - output_tokens
        )
    assert [w.tokens_rendered for w in plain_work[1:]] > [w.tokens_rendered for w in work[1:]]
    assert plain_work[-1].tokens_rendered >= states[-1].context_tokens - rendered(
        engine, list(states[-1].response.output)
    )


async def test_http_chain_and_reconnect_render_only_their_new_items() -> None:
    """previous_response_id with store: true on a new session per request (HTTP, or a
    WebSocket reconnect): the store confirms the id, the render cache has the state."""
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore()) as engine:
            first = await engine.session().create(request(input="look up a, b and c", store=True))
            assert first is not None
            states, work = [first], []
            for n in range(3):
                parent = states[-1]
                before = engine.counters.snapshot()
                state = await engine.session().create(
                    request(input=answers(parent, n), previous_response_id=parent.id, store=True)
                )
                assert state is not None
                work.append(engine.counters - before)
                states.append(state)
    for state, w in zip(states[1:], work, strict=True):
        new = list(state.items)[state.first_new_item :]
        assert (w.tokens_rendered, w.chars_classified) == (
            rendered(engine, new),
            classified_chars(engine, new),
        )
        assert (w.hydrations, w.store_reads) == (0, 1)  # the one read confirming the id


async def test_hydration_renders_only_what_the_render_cache_lacks() -> None:
    """A stored chain whose newest response the render cache lost (evicted; another process
    wrote it) and whose stored renderings are missing (an older rollout wrote them):
    hydration finds the older part of the conversation in the render cache."""
    store = typing.cast(ResponseStore, WithoutRenderings(MemoryResponseStore()))
    with trio.fail_after(DEADLINE):
        async with open_engine(store=store) as engine:
            a, b = await stored_chain_of_two(engine)
            cache = engine.render_cache
            key = (None, b.lineage.render_version, b.lineage.key(b.n_items))
            cache._drop(key)  # as if b had been evicted
            before = engine.counters.snapshot()
            c = await engine.session().create(
                request(input=answers(b, 1), previous_response_id=b.id, store=True)
            )
            delta = engine.counters - before
    assert c is not None
    assert delta.hydrations == 1
    # b's own items (its tool outputs and its output) were rendered again; a's were found.
    b_own = list(b.items)[a.n_items :]
    c_own = list(c.items)[b.n_items :]
    assert delta.tokens_rendered == rendered(engine, b_own) + rendered(engine, c_own)


async def test_forks_and_retries_render_only_their_new_items() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            states, _ = await run_stateless(engine)
            history = [*states[1].items]
            # A retry of turn 2 (the same history, on another connection) and a fork of it
            # (another answer to the same calls).
            for outputs in (answers(states[1], 1), answers(states[1], 99)):
                before = engine.counters.snapshot()
                state = await engine.session().create(request(input=[*history, *outputs]))
                delta = engine.counters - before
                assert state is not None
                assert delta.tokens_rendered == rendered(engine, outputs) + rendered(
                    engine, list(state.response.output)
                )


async def test_tools_changed_mid_conversation_still_find_the_items() -> None:
    """Items render independently of instructions and tools: new tools render the new prefix
    and the new items only."""
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            states, _ = await run_stateless(engine)
            other_tool = attrs.evolve(TOOL, name="search")
            history = list(states[-1].items)
            before = engine.counters.snapshot()
            state = await engine.session().create(
                request(
                    input=[*history, p.Message(role="user", content="and d")],
                    tools=[TOOL, other_tool],
                )
            )
            delta = engine.counters - before
    assert state is not None
    new = list(state.items)[len(history) :]
    assert delta.tokens_rendered == len(state.prefix.tokens) + rendered(engine, new)


# --- what it never does ----------------------------------------------------------------------


async def test_no_hit_crosses_owners() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            a_states, a_work = await run_stateless(engine, owner="key-a")
            b_states, b_work = await run_stateless(engine, owner="key-b")
    assert did(a_work) == new_work(engine, a_states)
    # The same conversation (the sim's calls are a function of the context, their ids are
    # not): key-b's first turn rendered everything again, instructions and tools included.
    assert did(b_work)[0] == did(a_work)[0]
    assert did(b_work) == new_work(engine, b_states)


async def test_the_same_history_from_another_owner_renders_everything() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            states, _ = await run_stateless(engine, owner="key-a")
            history = list(states[-1].items)
            before = engine.counters.snapshot()
            state = await engine.session(owner="key-b").create(
                request(input=[*history, p.Message(role="user", content="thanks")])
            )
            delta = engine.counters - before
            same = await engine.session(owner="key-a").create(
                request(input=[*history, p.Message(role="user", content="thanks")])
            )
    assert state is not None and same is not None
    assert delta.tokens_rendered == state.context_tokens - rendered(
        engine, list(state.response.output)
    ) + rendered(engine, list(state.response.output))
    assert same_items(state.response.output, same.response.output)


async def test_an_id_is_never_resolved_by_the_render_cache() -> None:
    """store: false ids stay unknown off their connection; a deleted response is gone."""
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore()) as engine:
            unstored = await engine.session().create(request(input="hello", store=False))
            stored = await engine.session().create(request(input="hello there", store=True))
            assert unstored is not None and stored is not None
            await engine.post.flushed()
            assert await engine.delete_stored(stored.id, owner=None)
            for state in (unstored, stored):
                with pytest.raises(p.RemoteProtocolError) as info:
                    await engine.session().create(
                        request(input="more", previous_response_id=state.id)
                    )
                assert info.value.code == "previous_response_not_found"
            # Nor across owners.
            kept = await engine.session(owner="a").create(request(input="mine", store=True))
            assert kept is not None
            await engine.post.flushed()
            with pytest.raises(p.RemoteProtocolError) as info:
                await engine.session(owner="b").create(
                    request(input="more", previous_response_id=kept.id)
                )
            assert info.value.code == "previous_response_not_found"


async def test_what_failed_classification_is_never_a_hit() -> None:
    secret = "api_key = 'Zx9Qw3Rt7Yu1Io5Pa8Sd2Fg6'"
    with trio.fail_after(DEADLINE):
        async with open_engine(classifier=ClassifierSet([SecretDetector()])) as engine:
            states, _ = await run_stateless(engine)
            history = [*states[-1].items, p.Message(role="user", content=secret)]
            for _ in range(2):  # the second time, nothing of the first may be reused
                before = engine.counters.snapshot()
                state = await engine.session().create(request(input=history))
                delta = engine.counters - before
                assert state is None  # failed: invalid_prompt
                assert (delta.responses_failed, delta.samplings) == (1, 0)
                assert delta.chars_classified == len(secret)


# --- bounds ----------------------------------------------------------------------------------


async def test_a_small_budget_keeps_results_identical_and_memory_bounded() -> None:
    budget = 6_000
    with trio.fail_after(DEADLINE):
        small = RenderCache(max_bytes=budget)
        async with open_engine(render_cache=small) as engine:
            held: list[int] = []
            runs = []
            for owner in ("a", "b", "c", "a"):
                states, _ = await run_stateless(engine, owner=owner)
                runs.append(states)
                held.append(small.bytes_held)
        async with open_engine(render_cache=RenderCache(max_bytes=0)) as baseline:
            plain = [(await run_stateless(baseline, owner=o))[0] for o in ("a", "b", "c", "a")]
    assert max(held) <= budget
    assert small.stats.evictions > 0
    assert small.stats.hits > 0
    for states, twins in zip(runs, plain, strict=True):
        for state, twin in zip(states, twins, strict=True):
            assert same_items(state.response.output, twin.response.output)
            assert state.context() == twin.context()


async def test_entries_expire_after_the_ttl() -> None:
    now = [0.0]
    cache = RenderCache(ttl=60.0, clock=lambda: now[0])
    with trio.fail_after(DEADLINE):
        async with open_engine(render_cache=cache) as engine:
            states, _ = await run_stateless(engine)
            assert len(cache) > 0 and cache.bytes_held > 0
            history = list(states[-1].items)
            now[0] += 59.0  # used within the TTL: kept, and its TTL starts again
            version = engine.pipeline.render_version
            assert cache.longest(None, history, version) is not None
            now[0] += 61.0
            assert cache.longest(None, history, version) is None
            assert cache.stats.expirations > 0
            cache.put(None, states[0])  # a put sweeps what expired
    assert len(cache) == 2 and cache.stats.evictions == 0


def test_the_key_of_instructions_and_tools_is_worked_out_once_per_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stateless client's requests decoded around the input memo carry the same instructions
    and tools objects every turn: their key (canonical tools JSON, hashed) is worked out once
    for them; equal objects get the same key, worked out again; what is remembered is bounded
    in pairs and bytes."""
    worked: list[int] = []
    real = render_cache_module._prefix_key

    def counting(instructions: str | None, tools: Sequence[p.Tool]) -> tuple[bytes, int]:
        worked.append(len(tools))
        return real(instructions, tools)

    monkeypatch.setattr(render_cache_module, "_prefix_key", counting)
    cache = RenderCache()
    tools: tuple[p.Tool, ...] = (TOOL,)
    first = cache._prefix_digest(INSTRUCTIONS, tools)
    for _ in range(3):
        assert cache.prefix(None, INSTRUCTIONS, tools, "v") is None  # (a miss: nothing put)
    assert worked == [1]
    equal = (attrs.evolve(TOOL),)
    assert cache._prefix_digest(INSTRUCTIONS, equal) == first and worked == [1, 1]
    # Bounded: the least recently used pair goes first; a pair too large is never kept.
    limit = render_cache_module.MAX_KEYED_PREFIXES
    others = [(attrs.evolve(TOOL, name=f"tool_{i}"),) for i in range(limit)]
    for other in others:
        cache._prefix_digest(None, other)
    worked.clear()
    cache._prefix_digest(INSTRUCTIONS, tools)  # pushed out by the others
    cache._prefix_digest(None, others[-1])  # still remembered
    assert worked == [1]
    huge = "x" * (render_cache_module.MAX_KEYED_PREFIX_BYTES + 1)
    cache._prefix_digest(huge, tools)
    cache._prefix_digest(huge, tools)
    assert worked == [1, 1, 1]
    assert cache._keyed_bytes <= render_cache_module.MAX_KEYED_PREFIX_BYTES


def test_render_cache_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        RenderCache(max_bytes=-1)
    with pytest.raises(ValueError):
        RenderCache(ttl=0)


# --- the server: store: false content is never written ---------------------------------------


async def test_store_false_content_never_reaches_the_data_dir(tmp_path: Path) -> None:
    """Over HTTP and WebSocket, a store: false conversation lives only in memory: no file of
    the data dir (store, ledger, their WAL and journal files) holds any of it."""
    marker = "zebra-quartz-unstored-7f3a"
    data_dir = tmp_path / "data"
    with trio.fail_after(DEADLINE):
        async with (
            open_test_server(data_dir) as url,
            httpx.AsyncClient(base_url=url, timeout=DEADLINE) as http,
        ):
            body = {
                "model": MODEL,
                "tools": [p.to_wire(TOOL)],
                "instructions": f"{marker} instructions",
                "input": [{"role": "user", "content": f"{marker} question"}],
                "store": False,
            }
            for _ in range(2):
                first = (await http.post("/responses", json=body)).json()
                assert first["status"] == "completed"
                body["input"] += first["output"] + [
                    {"type": "function_call_output", "call_id": c["call_id"], "output": marker}
                    for c in first["output"]
                    if c["type"] == "function_call"
                ]
            async with open_ws(url) as ws:
                events = await ws.create(**body)
                assert events[-1].type == "response.completed"
            # Something stored, so the check looks at live files.
            stored = await http.post("/responses", json={"model": MODEL, "input": "kept"})
            assert stored.json()["status"] == "completed"
    files = [f for f in data_dir.rglob("*") if f.is_file()]
    assert files
    for f in files:
        assert marker.encode() not in f.read_bytes(), f


# --- stored renderings: hydration after a restart renders nothing ---------------------------


class OtherTemplate(ChatTemplateRenderer):
    """The same rendering under another template id: what a restart with a changed chat
    template (or tokenizer) looks like to the stored renderings."""

    template_id = "OtherTemplate"


@pytest.mark.parametrize("renderer", ["same", "other"])
async def test_a_restarted_process_hydrates_from_the_stored_renderings(
    tmp_path: Path, renderer: str
) -> None:
    path = tmp_path / "store.db"
    with trio.fail_after(DEADLINE):
        async with await open_sqlite_store(path) as store, open_engine(store=store) as engine:
            _, b = await stored_chain_of_two(engine)
        # A new process: an empty render cache, the same file.
        other = ChatTemplateRenderer(O200kTokenizer()) if renderer == "same" else None
        async with (
            await open_sqlite_store(path) as store,
            open_engine(
                store=store, renderer=other or OtherTemplate(O200kTokenizer())
            ) as restarted,
        ):
            before = restarted.counters.snapshot()
            new = answers(b, 1)
            c = await restarted.session().create(
                request(input=new, previous_response_id=b.id, store=True)
            )
            delta = restarted.counters - before
    assert c is not None and delta.hydrations == 1
    own = rendered(restarted, [*new, *c.response.output])
    if renderer == "same":
        assert delta.tokens_rendered == own
    else:  # rendered by another template: rendered again, never used
        assert delta.tokens_rendered == c.context_tokens
    assert c.context() == ChatTemplateRenderer(O200kTokenizer()).render(
        INSTRUCTIONS, [TOOL], list(c.items)
    )
