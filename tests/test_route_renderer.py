"""Each model renders with its own renderer: a model's `ModelSpec.renderer` becomes its route's
(`Route.bound_renderer`), and every rendering (render cache entries, stored renderings,
compaction snapshots) is of one renderer, named by its render version (template and tokenizer).

A second renderer for these tests: the engine's chat template over a tokenizer of one token per
character (`chars`), for the model `chars`, next to the built-in `sim` (the engine's default
renderer). Checked:

- each model's context and usage are its own renderer's tokens, in every mode, and a turn
  renders only its new items;
- the render cache never crosses renderers: a stateless resend to one model of the other's
  conversation renders all of it with its own renderer (and finds its own rendering after);
- switching models mid-chain renders the conversation again, once, equal to a fresh stateless
  rendering with the new renderer; the turn after renders only its new items;
- stored renderings hydrate without rendering for their own model, and are foreign (rendered
  again) when the model's renderer changed;
- a compaction item is refused by a model of another renderer, restored by one of the same;
- with an unknown model, errors come in the same order as always (the route, resolved early,
  raises where the route stage always did).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import pytest
import trio
from rollout import protocol as p
from rollout.engine import (
    ChatTemplateRenderer,
    Engine,
    MemoryResponseStore,
    ModelRegistry,
    ModelSpec,
    O200kTokenizer,
    Renderer,
    ResponseState,
    Session,
    SimBackend,
    default_registry,
    open_engine,
)

from tests.engine_harness import (
    LOOKUP_INSTRUCTIONS,
    LOOKUP_TOOL,
    Script,
    lookup_request,
    run_chain,
    run_rollout,
    run_stateless,
)

DEADLINE = 20
KEY = bytes(range(32))


class CharTokenizer:
    """One token per character: its code point, plus `offset` (a different tokenizer)."""

    def __init__(self, name: str = "chars", offset: int = 0) -> None:
        self.name = name
        self.offset = offset

    def encode(self, text: str) -> list[int]:
        return [ord(c) + self.offset for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t - self.offset) for t in token_ids)


DEFAULT = ChatTemplateRenderer(O200kTokenizer())
CHARS = ChatTemplateRenderer(CharTokenizer())
A = "sim:steps=3,parallel=2,tokens=8"  # the engine's default renderer
B = "chars:steps=3,parallel=2,tokens=8"  # its own renderer
RENDERERS: dict[str, Renderer] = {"sim": DEFAULT, "chars": CHARS}


def registry(renderer: Renderer = CHARS) -> ModelRegistry:
    """The built-in models, and `chars` (the sim backend) rendering with `renderer`."""
    models = default_registry()
    models.add(
        ModelSpec(name="chars", backend=SimBackend(), accepts_params=True, renderer=renderer)
    )
    return models


def fresh(state: ResponseState, renderer: Renderer | None = None) -> array[int]:
    """`state`'s context rendered from scratch by its model's renderer (or `renderer`)."""
    renderer = renderer or RENDERERS[state.route.name]
    return renderer.render(state.prefix.instructions, state.prefix.offered, list(state.items))


def own_tokens(state: ResponseState) -> int:
    """The tokens of the items `state` added, rendered by its model's renderer."""
    renderer = RENDERERS[state.route.name]
    return sum(len(renderer.render_item(item)) for item in state.own_items)


def answers(state: ResponseState, n: int) -> list[p.Item]:
    """Outputs for `state`'s open calls, with ids (so that two engines see equal items)."""
    return [
        p.FunctionCallOutput(id=f"fco_{n}_{i}", call_id=call_id, output=f"value {n}.{i} for {name}")
        for i, (call_id, name) in enumerate(state.open_calls)
    ]


def script(model: str) -> Script:
    return Script(
        model=model,
        tools=(LOOKUP_TOOL,),
        instructions=LOOKUP_INSTRUCTIONS,
        user_turns=("look up a, b and c", "and then d"),
        tool_outputs=("found it",),
    )


async def chain(session: Session, model: str, turns: int = 2) -> list[ResponseState]:
    """`turns` stored responses of the lookup agent on `session`, each continuing the last;
    written when this returns."""
    states: list[ResponseState] = []
    new: str | list[p.Item] = "look up a, b and c"
    for n in range(turns):
        previous = states[-1].id if states else None
        state = await session.create(
            lookup_request(model, input=new, previous_response_id=previous, store=True)
        )
        assert state is not None and state.response.status == "completed"
        states.append(state)
        new = answers(state, n) or f"and then {n}"
    await session.engine.post.flushed()
    return states


# --- (a) each model speaks its own renderer's tokens ------------------------------------------


async def test_the_route_stage_binds_each_route_its_renderer() -> None:
    """The registry leaves a model without its own renderer unbound; the route stage
    (`Router.route`) binds the engine's default to it, keeps a model's own, counts each
    resolution once and reuses the parent's route for the same model string."""
    async with open_engine(registry=registry()) as engine:
        assert engine.registry.resolve(A).renderer is None
        before = engine.counters.route_resolutions
        timings: dict[str, float] = {}
        default = engine.router.route(A, None, timings)
        assert default.bound_renderer is engine.pipeline.renderer
        assert default.bound_version == engine.pipeline.render_version
        own = engine.router.route(B, None, timings)
        assert own.bound_renderer is CHARS and own.bound_version != default.bound_version
        assert engine.counters.route_resolutions == before + 2 and "route" in timings
        state = await engine.session().create(lookup_request(A, input="look up a"))
        assert state is not None and state.route.bound_version == default.bound_version
        assert engine.router.route(A, state, timings) is state.route
        assert engine.counters.route_resolutions == before + 3  # (the create's)


@pytest.mark.parametrize("model", [A, B])
async def test_each_model_renders_with_its_own_renderer(model: str) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry()) as engine:
            # One turn at a time: each renders its own items only (and the prefix, first).
            session = engine.session()
            states: list[ResponseState] = []
            for n in range(3):
                before = engine.counters.snapshot()
                state = await session.create(
                    lookup_request(
                        model,
                        input=answers(states[-1], n) if states else "look up a, b and c",
                        previous_response_id=states[-1].id if states else None,
                    )
                )
                assert state is not None
                prefix = 0 if states else len(state.prefix.tokens)
                assert (engine.counters - before).tokens_rendered == prefix + own_tokens(state)
                states.append(state)
            runs = [
                await run_chain(engine, script(model)),
                await run_stateless(engine, script(model)),
                await run_rollout(engine, script(model)),
            ]
    for run in runs:
        for state in run.states:
            assert state.context() == fresh(state)
    other = DEFAULT if model == B else CHARS
    assert states[-1].context() != fresh(states[-1], other)
    # Usage counts the model's own tokens: a create samples once, from its input.
    for state in states:
        assert state.response.usage is not None
        inputs = list(state.items)[: state.n_items - len(state.response.output)]
        prompt = RENDERERS[state.route.name].render(
            state.prefix.instructions, state.prefix.offered, inputs
        )
        assert state.response.usage.input_tokens == len(prompt)


# --- (b) the render cache never crosses renderers ----------------------------------------------


@pytest.mark.parametrize(("first", "second"), [(A, B), (B, A)])
async def test_a_resend_to_another_model_renders_everything_with_its_own(
    first: str, second: str
) -> None:
    """Both models' renderings of one conversation are cached side by side: each model finds
    its own, never the other's."""
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry()) as engine:
            run = await run_stateless(engine, script(first))
            history = list(run.final.items)

            async def resend(model: str, **kw: Any) -> tuple[ResponseState, int]:
                before = engine.counters.snapshot()
                state = await engine.session().create(
                    lookup_request(model, input=history, generate=False, **kw)
                )
                assert state is not None
                return state, (engine.counters - before).tokens_rendered

            # The other model found nothing of the first's rendering: all of it rendered,
            # its own way (a warm-up: the render cache keeps it).
            other, other_work = await resend(second)
            # Each model's own rendering is there: nothing rendered, for either.
            same, same_work = await resend(first)
            again, again_work = await resend(second)
    assert other.context() == fresh(other)
    assert other_work == other.context_tokens
    assert same.context() == fresh(same) == run.final.context()
    assert again.context() == fresh(again) == other.context()
    assert (same_work, again_work) == (0, 0)


# --- (c) switching models mid-chain ------------------------------------------------------------


@pytest.mark.parametrize(("first", "second"), [(A, B), (B, A)])
async def test_switching_models_mid_chain_renders_the_conversation_again_once(
    first: str, second: str
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry()) as engine:
            session = engine.session()
            a, b = await chain(session, first)
            switch = lookup_request(second, input=answers(b, 2), previous_response_id=b.id)
            before = engine.counters.snapshot()
            prepared = await session.prepare_only(switch)
            switch_work = engine.counters - before
            c = await session.create(switch)
            assert c is not None
            before = engine.counters.snapshot()
            d = await session.create(
                lookup_request(second, input=answers(c, 3) or "more", previous_response_id=c.id)
            )
            follow_work = engine.counters - before
        async with open_engine(registry=registry()) as other:
            stateless = await other.session().prepare_only(
                lookup_request(second, input=[*b.items, *answers(b, 2)])
            )
    assert d is not None
    # The parent's rendering was of the first model: everything rendered again, once, equal
    # to a fresh stateless rendering with the second model's renderer.
    assert prepared.equivalent(stateless)
    assert prepared.context() == fresh(prepared)
    assert switch_work.tokens_rendered == prepared.context_tokens
    assert switch_work.items_validated == len(answers(b, 2))  # the history is not validated
    # Nothing of the first model's rendering counts as cached for the second.
    assert c.response.usage is not None
    assert c.response.usage.input_tokens_details.cached_tokens == 0
    # The parent is untouched (still the first model's).
    assert b.context() == fresh(b) and a.context() == fresh(a)
    # The next turn continues on the second model's rendering: its new items only.
    assert d.context() == fresh(d)
    assert follow_work.tokens_rendered == own_tokens(d)
    assert d.response.usage is not None
    assert d.response.usage.input_tokens_details.cached_tokens == c.context_tokens


# --- (d) stored renderings -----------------------------------------------------------------------


@pytest.mark.parametrize(("first", "second"), [(B, B), (A, B), (B, A)])
async def test_stored_renderings_hydrate_for_their_own_model(first: str, second: str) -> None:
    store = MemoryResponseStore()
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry(), store=store) as engine:
            _, b = await chain(engine.session(), first)
        # A new process, the same store: the stored renderings are the first model's.
        async with open_engine(registry=registry(), store=store) as restarted:
            before = restarted.counters.snapshot()
            c = await restarted.session().create(
                lookup_request(second, input=answers(b, 2), previous_response_id=b.id)
            )
            work = restarted.counters - before
    assert c is not None and work.hydrations == 1
    assert c.context() == fresh(c)
    if first == second:  # hydrated from the stored renderings: only the new items rendered
        assert work.tokens_rendered == own_tokens(c)
    else:  # hydrated for the first model without rendering, then rendered again, once
        assert work.tokens_rendered == c.context_tokens


async def test_stored_renderings_of_a_changed_renderer_are_rendered_again() -> None:
    store = MemoryResponseStore()
    changed = ChatTemplateRenderer(CharTokenizer("chars-v2", offset=7))
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry(), store=store) as engine:
            _, b = await chain(engine.session(), B)
        # The model's tokenizer changed since: its stored renderings are foreign.
        async with open_engine(registry=registry(changed), store=store) as restarted:
            before = restarted.counters.snapshot()
            c = await restarted.session().create(
                lookup_request(B, input=answers(b, 2), previous_response_id=b.id)
            )
            work = restarted.counters - before
    assert c is not None and work.hydrations == 1
    assert work.tokens_rendered == c.context_tokens
    assert c.context() == fresh(c, changed) != fresh(c, CHARS)


# --- (e) compaction ------------------------------------------------------------------------------


async def compaction_of(engine: Engine, model: str) -> p.Compaction:
    session = engine.session()
    states = await chain(session, model, turns=3)
    compacted = await session.compact(
        lookup_request(model, previous_response_id=states[-1].id), budget_tokens=300
    )
    item = p.from_wire(compacted["output"][-1], p.Item)
    assert isinstance(item, p.Compaction)
    return item


async def test_a_compaction_item_is_restored_only_by_a_model_of_its_renderer() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry(), compaction_key=KEY) as engine:
            items = {model: await compaction_of(engine, model) for model in (A, B)}
            for made, item in items.items():
                for model in (A, B):
                    request = lookup_request(
                        model, input=[item, p.Message(role="user", content="and then?")]
                    )
                    if model != made:
                        with pytest.raises(p.RemoteProtocolError) as info:
                            await engine.session().create(request)
                        error = info.value.body
                        assert (error.code, error.param) == ("invalid_compaction", "input[0]")
                        assert "another tokenizer" in error.message
                        continue
                    before = engine.counters.snapshot()
                    state = await engine.session().prepare_only(request)
                    work = engine.counters - before
                    assert state.context() == fresh(state)
                    # The window is restored, not rendered (nor the prefix: the render cache
                    # has it, of this renderer): the question only.
                    renderer = RENDERERS[state.route.name]
                    assert work.tokens_rendered == len(renderer.render_item(state.items[-1]))


# --- error order ---------------------------------------------------------------------------------


def _create(**kw: Any) -> p.ResponseCreate:
    return p.ResponseCreate(**kw)


@pytest.mark.parametrize(
    ("request_", "code", "param"),
    [
        # The request's own validation, then the model, then the items.
        (
            _create(model="nope", input="hi", tools=[LOOKUP_TOOL, LOOKUP_TOOL]),
            "invalid_value",
            "tools[1].name",
        ),
        (
            _create(model="nope", input="hi", background=True),
            "unsupported_parameter",
            "background",
        ),
        (
            _create(model="nope", input=[p.FunctionCallOutput(call_id="c1", output="x")]),
            "model_not_found",
            "model",
        ),
        (
            _create(model="sim:bogus=1", input=[p.FunctionCallOutput(call_id="c1", output="x")]),
            "invalid_value",
            "model",
        ),
        # The parent and the input's references and compaction items come first.
        (
            _create(model="nope", input="hi", previous_response_id="resp_nope"),
            "previous_response_not_found",
            "previous_response_id",
        ),
        (
            _create(model="nope", input=[p.ItemReference(id="msg_nope")]),
            "item_not_found",
            "input[0].id",
        ),
        (
            _create(
                model="nope",
                input=[
                    p.Compaction(id="cmp_1", encrypted_content="AAAA"),
                    p.Message(role="user", content="hi"),
                ],
            ),
            "invalid_compaction",
            "input[0].encrypted_content",
        ),
    ],
)
async def test_errors_keep_their_order_with_an_unknown_model(
    request_: p.ResponseCreate, code: str, param: str
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry()) as engine:
            with pytest.raises(p.RemoteProtocolError) as info:
                await engine.session().create(request_)
    assert (info.value.body.code, info.value.body.param) == (code, param)


async def test_a_compaction_item_with_an_unknown_model() -> None:
    """The model is unknown: the item is checked as for the engine's default renderer (as it
    always was), then the route stage refuses the model."""
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry(), compaction_key=KEY) as engine:
            errors = {}
            for model in (A, B):
                item = await compaction_of(engine, model)
                request = lookup_request(
                    "nope", input=[item, p.Message(role="user", content="and then?")]
                )
                with pytest.raises(p.RemoteProtocolError) as info:
                    await engine.session().create(request)
                errors[model] = info.value.body.code
    assert errors == {A: "model_not_found", B: "invalid_compaction"}
