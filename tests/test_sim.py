"""The simulated model, driven through the engine as a client drives it (by the model string).

- Its output is a deterministic function of the rendered context: the same context gives the
  same output whatever ids the conversation carries, and one changed character anywhere in the
  context (here: a tool output) gives another output.
- It honours `tool_choice` (none, auto with the `steps` rule, required, a named function),
  `parallel_tool_calls: false`, `parallel=N`, `tokens=N` and `max_output_tokens` (the response
  ends `incomplete` with the cut-off item marked `incomplete`).
- `reasoning=N` starts each turn with a `reasoning` item (an N-word summary and
  `encrypted_content`) counted as output tokens and within `max_output_tokens`; echoed back,
  it is part of the context (dropping it changes the next output).
- It is paced on trio's clock: `ttft_ms` before the first token, then `tps`.
- Its model-string grammar refuses what it does not know, with the error OpenAI would send.
- Function-call arguments validate against the tool's JSON schema.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import jsonschema
import pytest
import trio
import trio.testing
from rollout import protocol as p
from rollout.engine import Engine, O200kTokenizer, open_engine
from rollout.engine._sim import _StepTimers, schema_instance

from tests.engine_harness import strip_ids

DEADLINE = 10

SEARCH = p.FunctionTool(
    name="search",
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
        "additionalProperties": False,
    },
)
FETCH = p.FunctionTool(
    name="fetch",
    parameters={
        "type": "object",
        "properties": {"url": {"type": "string"}, "max_bytes": {"type": "integer"}},
        "required": ["url"],
    },
)
TOOLS: list[p.Tool] = [SEARCH, FETCH]


def calls_of(response: p.Response) -> list[p.FunctionCall]:
    return [i for i in response.output if isinstance(i, p.FunctionCall)]


def text_of(response: p.Response) -> str:
    (message,) = response.output
    assert isinstance(message, p.Message) and not isinstance(message.content, str)
    return "".join(part.text for part in message.content if isinstance(part, p.OutputText))


async def respond(engine: Engine, **kw: Any) -> p.Response:
    kw.setdefault("store", False)
    state = await engine.session().create(p.ResponseCreate(**kw))
    assert state is not None
    return state.response


# --- determinism ---------------------------------------------------------------------------


def conversation(tool_output: str, call_id: str = "call_a") -> list[p.Item]:
    return [
        p.Message(role="user", content="find the weather in Paris"),
        p.FunctionCall(call_id=call_id, name="search", arguments='{"query": "paris weather"}'),
        p.FunctionCallOutput(call_id=call_id, output=tool_output),
    ]


async def test_output_is_a_function_of_the_rendered_context() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            model = "sim:steps=2,parallel=2,tokens=12"
            first = await respond(engine, model=model, tools=TOOLS, input=conversation("sunny"))
            again = await respond(engine, model=model, tools=TOOLS, input=conversation("sunny"))
            # Ids are not rendered: another call_id is the same context.
            other_ids = await respond(
                engine, model=model, tools=TOOLS, input=conversation("sunny", call_id="call_zz")
            )
            changed = await respond(engine, model=model, tools=TOOLS, input=conversation("sunnY"))

    assert [strip_ids(i) for i in first.output] == [strip_ids(i) for i in again.output]
    assert [strip_ids(i) for i in first.output] == [strip_ids(i) for i in other_ids.output]
    assert [strip_ids(i) for i in first.output] != [strip_ids(i) for i in changed.output]
    # The same token counts; what the render cache held is cached for the later ones.
    usages = [r.usage for r in (first, again, other_ids)]
    assert all(u is not None for u in usages)
    counts = {(u.input_tokens, u.output_tokens, u.total_tokens) for u in usages if u is not None}
    assert len(counts) == 1
    assert first.usage is not None and again.usage is not None
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert 0 < again.usage.input_tokens_details.cached_tokens <= again.usage.input_tokens


async def test_changed_instructions_change_the_output() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            a = await respond(engine, model="sim", instructions="Be brief.", input="hello")
            b = await respond(engine, model="sim", instructions="Be brief!", input="hello")
    assert text_of(a) != text_of(b)


# --- tool_choice, parallelism, length ------------------------------------------------------


async def test_tool_choice_none_answers_text() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            r = await respond(
                engine, model="sim:steps=5", tools=TOOLS, tool_choice="none", input="go"
            )
    assert not calls_of(r)
    assert text_of(r)


async def test_tool_choice_auto_follows_the_steps_rule() -> None:
    """`steps=3,parallel=2`: 2 calls, then 1 (the third and last), then text."""
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            model = "sim:steps=3,parallel=2"
            per_turn: list[int] = []
            state = await session.create(
                p.ResponseCreate(model=model, tools=TOOLS, input="go", store=False)
            )
            for _ in range(5):
                assert state is not None
                calls = calls_of(state.response)
                per_turn.append(len(calls))
                if not calls:
                    break
                outputs: list[p.Item] = [
                    p.FunctionCallOutput(call_id=c.call_id, output="ok") for c in calls
                ]
                state = await session.create(
                    p.ResponseCreate(
                        model=model,
                        tools=TOOLS,
                        input=outputs,
                        previous_response_id=state.id,
                        store=False,
                    )
                )
            # A new user message starts the count again.
            assert state is not None
            after_user = await session.create(
                p.ResponseCreate(
                    model=model,
                    tools=TOOLS,
                    input="and now?",
                    previous_response_id=state.id,
                    store=False,
                )
            )
    assert per_turn == [2, 1, 0]
    assert after_user is not None and len(calls_of(after_user.response)) == 2
    # steps=0 (or no tools) never calls.
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            assert not calls_of(await respond(engine, model="sim:steps=0", tools=TOOLS, input="x"))
            assert not calls_of(await respond(engine, model="sim:steps=3", input="x"))


async def test_tool_choice_required_calls_even_when_steps_are_spent() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            r = await respond(
                engine, model="sim:steps=0", tools=TOOLS, tool_choice="required", input="go"
            )
            # With the steps spent (one call since the user message), still a call.
            spent = await respond(
                engine,
                model="sim:steps=1",
                tools=TOOLS,
                tool_choice="required",
                input=conversation("done"),
            )
    assert len(calls_of(r)) == 1
    assert len(calls_of(spent)) == 1


async def test_tool_choice_named_function_calls_that_function() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            names: set[str] = set()
            for i in range(8):
                r = await respond(
                    engine,
                    model="sim:parallel=3,steps=9",
                    tools=TOOLS,
                    tool_choice=p.ToolChoiceFunction(name="fetch"),
                    input=f"request {i}",
                )
                assert len(calls_of(r)) == 3
                names.update(c.name for c in calls_of(r))
            # auto picks among the tools (both appear over a few turns).
            auto_names: set[str] = set()
            for i in range(8):
                r = await respond(engine, model="sim:parallel=3", tools=TOOLS, input=f"q {i}")
                auto_names.update(c.name for c in calls_of(r))
    assert names == {"fetch"}
    assert auto_names == {"search", "fetch"}


async def test_parallel_calls_and_parallel_tool_calls_false() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            for n in (1, 2, 5):
                r = await respond(
                    engine, model=f"sim:parallel={n},steps=10", tools=TOOLS, input="x"
                )
                assert len(calls_of(r)) == n
                assert len({c.call_id for c in calls_of(r)}) == n
                assert all(c.status == "completed" for c in calls_of(r))
            single = await respond(
                engine,
                model="sim:parallel=5,steps=10",
                tools=TOOLS,
                parallel_tool_calls=False,
                input="x",
            )
    assert len(calls_of(single)) == 1
    assert single.parallel_tool_calls is False


@pytest.mark.parametrize("n", [0, 1, 7, 64])
async def test_tokens_sets_the_text_length_in_output_tokens(n: int) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            r = await respond(engine, model=f"sim:tokens={n}", input="talk to me")
    assert r.status == "completed"
    assert r.usage is not None and r.usage.output_tokens == n
    assert len(O200kTokenizer().encode(text_of(r))) == n


async def test_reasoning_item_leads_each_turn_and_is_context() -> None:
    model = "sim:reasoning=6,tokens=4,steps=1"
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            r = await respond(engine, model=model, tools=TOOLS, input="find it")
            reasoning, call = r.output
            assert isinstance(reasoning, p.Reasoning) and isinstance(call, p.FunctionCall)
            (summary,) = reasoning.summary
            assert len(O200kTokenizer().encode(" " + summary.text)) == 6
            assert reasoning.encrypted_content is not None
            output = p.FunctionCallOutput(call_id=call.call_id, output="found")
            user = p.Message(role="user", content="find it")
            kept = await respond(
                engine, model=model, tools=TOOLS, input=[user, reasoning, call, output]
            )
            dropped = await respond(engine, model=model, tools=TOOLS, input=[user, call, output])
            # Too little room for the reasoning: none, and the answer alone.
            short = await respond(engine, model=model, input="hi", max_output_tokens=6)
    assert [i.type for i in kept.output] == ["reasoning", "message"]
    assert [strip_ids(i) for i in kept.output] != [strip_ids(i) for i in dropped.output]
    assert r.usage is not None and r.usage.output_tokens > 6  # the reasoning's, the call's
    assert [i.type for i in short.output] == ["message"] and short.status == "completed"


# --- max_output_tokens ---------------------------------------------------------------------


async def test_max_output_tokens_cuts_a_message_and_marks_it_incomplete() -> None:
    events: list[p.ServerEvent] = []

    async def emit(event: p.ServerEvent) -> None:
        events.append(event)

    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            state = await engine.session().create(
                p.ResponseCreate(model="sim:tokens=40", input="hi", max_output_tokens=9), emit
            )
            full = await respond(engine, model="sim:tokens=40", input="hi")
    assert state is not None
    r = state.response
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 9
    (message,) = r.output
    assert isinstance(message, p.Message) and message.status == "incomplete"
    # The cut-off text is the start of the full answer.
    assert text_of(full).startswith(text_of(r))
    assert events[-1].type == "response.incomplete"
    done = [e for e in events if isinstance(e, p.OutputItemDone)]
    assert [getattr(e.item, "status", None) for e in done] == ["incomplete"]
    # The state the engine keeps is the conversation as the client sees it.
    assert list(state.items)[-1] == message


async def test_max_output_tokens_cuts_a_function_call_and_marks_it_incomplete() -> None:
    long_args = p.FunctionTool(
        name="write",
        parameters={
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 200}},
            "required": ["text"],
        },
    )
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            r = await respond(
                engine, model="sim:steps=1", tools=[long_args], input="go", max_output_tokens=5
            )
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    (call,) = calls_of(r)
    assert call.status == "incomplete"
    assert r.usage is not None and r.usage.output_tokens == 5


# --- pacing --------------------------------------------------------------------------------


async def test_pacing_follows_ttft_and_tps(autojump_clock: trio.testing.MockClock) -> None:
    stamps: list[tuple[str, float]] = []

    async def emit(event: p.ServerEvent) -> None:
        stamps.append((event.type, trio.current_time()))

    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            start = trio.current_time()
            state = await engine.session().create(
                p.ResponseCreate(model="sim:tps=100,ttft_ms=200,tokens=50", input="hi"), emit
            )
    assert state is not None and state.response.status == "completed"
    first_delta = next(t for kind, t in stamps if kind == "response.output_text.delta")
    done = next(t for kind, t in stamps if kind == "response.completed")
    created = next(t for kind, t in stamps if kind == "response.created")
    assert created == pytest.approx(start)
    assert 0.2 <= first_delta - start <= 0.2 + 0.02  # ttft (then the first token at 1/tps)
    assert done - start == pytest.approx(0.2 + 50 / 100, abs=0.01)
    # Deltas arrive spread over the whole sampling time, not in one burst.
    delta_times = [t for kind, t in stamps if kind == "response.output_text.delta"]
    assert len(delta_times) > 10
    assert delta_times == sorted(delta_times)


async def test_concurrent_responses_step_together(autojump_clock: trio.testing.MockClock) -> None:
    """Like a batched inference engine, the model emits at steps one `interval_ms` apart on one
    clock: two responses started 1.3 ms apart send their deltas at the same instants (so a
    server wakes once per step for both, not once per response)."""
    times: dict[str, list[float]] = {"a": [], "b": []}

    def emitter(name: str) -> Any:
        async def emit(event: p.ServerEvent) -> None:
            if event.type == "response.output_text.delta":
                times[name].append(trio.current_time())

        return emit

    async def one(engine: Engine, name: str, delay: float) -> None:
        await trio.sleep(delay)
        model = "sim:tps=1000,ttft_ms=20,tokens=100,interval_ms=5"
        await engine.session().create(p.ResponseCreate(model=model, input="hi"), emitter(name))

    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, trio.open_nursery() as nursery:
            nursery.start_soon(one, engine, "a", 0.0011)
            nursery.start_soon(one, engine, "b", 0.0024)
    assert len(times["a"]) > 10 and len(times["b"]) > 10
    for t in times["a"] + times["b"]:
        assert t / 0.005 == pytest.approx(round(t / 0.005), abs=1e-6)  # on a step
    both = set(times["a"]) | set(times["b"])  # the same instants, not interleaved ones
    assert len(both) <= max(len(times["a"]), len(times["b"])) + 2


async def test_responses_waiting_for_a_step_share_one_timer(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty responses streaming together set one trio deadline per engine step between
    them (the first to wait for a step sleeps, the others wait for it), not one per response
    per step: a trio sleep is a cancel scope and a delivered cancellation, the simulated
    model's largest cost with many responses streaming."""
    sleeps = 0
    real_sleep_until = trio.sleep_until

    async def counting(deadline: float) -> None:
        nonlocal sleeps
        sleeps += 1
        await real_sleep_until(deadline)

    monkeypatch.setattr(trio, "sleep_until", counting)
    deltas = 0

    async def emit(event: p.ServerEvent) -> None:
        nonlocal deltas
        deltas += event.type == "response.output_text.delta"

    async def one(engine: Engine, i: int) -> None:
        await trio.sleep(i * 0.0001)
        model = "sim:tps=1000,ttft_ms=20,tokens=100,interval_ms=5"
        await engine.session().create(p.ResponseCreate(model=model, input=f"hi {i}"), emit)

    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, engine, i)
    assert deltas >= 20 * 20
    assert 20 <= sleeps <= 30  # ~22 steps (TTFT, then 100 tokens 5 a step), not ~440


async def test_a_step_sleeper_cancelled_hands_the_step_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first to wait for a step sleeps for everyone; cancelled before the step, it wakes
    the others, one of which sleeps on: they still wake at the step, not before, not never."""
    timers = _StepTimers()
    woke: dict[str, float] = {}

    async def wait(name: str) -> None:
        await timers.until(1.0)
        woke[name] = trio.current_time()

    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            first = trio.CancelScope()
            nursery.start_soon(_cancellable, wait, "first", first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(wait, "second")
            nursery.start_soon(wait, "third")
            await trio.sleep(0.5)
            first.cancel()
    assert woke == {"second": 1.0, "third": 1.0}
    assert not timers._due
    with trio.fail_after(DEADLINE):
        before = trio.current_time()
        await timers.until(0.2)  # already past: a checkpoint, no wait
        assert trio.current_time() == before


async def _cancellable(
    fn: Callable[[str], Awaitable[None]], name: str, scope: trio.CancelScope
) -> None:
    with scope:
        await fn(name)


async def test_a_late_delta_carries_every_token_due(autojump_clock: trio.testing.MockClock) -> None:
    """A consumer that falls behind (here: one delta's emit takes 50 ms) gets the tokens
    sampled meanwhile in the next delta, not as a backlog of one delta per step."""
    sizes: list[int] = []
    stalled = False

    async def emit(event: p.ServerEvent) -> None:
        nonlocal stalled
        if isinstance(event, p.OutputTextDelta):
            sizes.append(len(event.delta.split()))
            if len(sizes) == 3 and not stalled:
                stalled = True
                await trio.sleep(0.05)

    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            model = "sim:tps=1000,ttft_ms=0,tokens=200,interval_ms=5"
            state = await engine.session().create(p.ResponseCreate(model=model, input="hi"), emit)
    assert state is not None and state.response.status == "completed"
    assert sum(sizes) == 200
    assert sizes[3] >= 45  # the 50 ms stall's tokens (give or take a step), at once
    assert max(sizes[4:]) <= 6  # then one step's worth again


@pytest.mark.parametrize("interval", ["0", "1e-310", "5e-324", "1e-9"])
async def test_a_vanishing_step_streams_without_steps(
    autojump_clock: trio.testing.MockClock, interval: str
) -> None:
    """An `interval_ms` too small to be a step (down to a denormal, whose division would
    overflow) streams unstepped instead of failing the response."""
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            model = f"sim:tps=1000,ttft_ms=3,tokens=20,interval_ms={interval}"
            r = await respond(engine, model=model, input="hi")
    assert r.status == "completed"
    assert r.usage is not None and r.usage.output_tokens == 20


async def test_pacing_of_function_calls(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            start = trio.current_time()
            r = await respond(
                engine, model="sim:tps=50,ttft_ms=300,steps=1", tools=TOOLS, input="x"
            )
            elapsed = trio.current_time() - start
    assert r.usage is not None
    assert elapsed == pytest.approx(0.3 + r.usage.output_tokens / 50, abs=0.01)


async def test_aliases_are_paced_presets(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            start = trio.current_time()
            r = await respond(engine, model="sim-1000", input="x")
            elapsed = trio.current_time() - start
    assert r.model == "sim-1000"
    assert elapsed == pytest.approx(0.2 + 32 / 1000, abs=0.01)


# --- the model-string grammar --------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [
        "sim:bogus=1",
        "sim:tokens=abc",
        "sim:tokens=-1",
        "sim:parallel=0",
        "sim:parallel=1000",
        "sim:tps=nan",
        "sim:ttft_ms=-5",
        "sim:steps=1.5",
    ],
)
async def test_bad_sim_parameters_are_invalid_value_on_model(model: str) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            with pytest.raises(p.RemoteProtocolError) as info:
                await respond(engine, model=model, input="x")
            assert engine.counters.samplings == 0
    assert info.value.code == "invalid_value"
    assert info.value.param == "model"
    assert info.value.status == 400


@pytest.mark.parametrize("model", ["gpt-nothing", "nosuch:tokens=3", "sim-65:x", "sim:tokens"])
async def test_unknown_or_malformed_models_are_model_not_found(model: str) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            with pytest.raises(p.RemoteProtocolError) as info:
                await respond(engine, model=model, input="x")
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"
    assert info.value.status == 404


# --- arguments against the tool's JSON schema ----------------------------------------------

SCHEMAS: dict[str, dict[str, Any]] = {
    "empty object": {"type": "object"},
    "flat, additionalProperties false": {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "nested objects": {
        "type": "object",
        "properties": {
            "outer": {
                "type": "object",
                "properties": {
                    "inner": {
                        "type": "object",
                        "properties": {"leaf": {"type": "number"}},
                        "required": ["leaf"],
                        "additionalProperties": False,
                    }
                },
                "required": ["inner"],
                "additionalProperties": False,
            }
        },
        "required": ["outer"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "level": {"enum": [1, 2, 3]},
            "mixed": {"enum": ["a", 1, None, True]},
            "fixed": {"const": "exactly"},
        },
        "required": ["unit", "level", "mixed", "fixed"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}},
            "bounded": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            },
            "many": {"type": "array", "items": {"type": "boolean"}, "minItems": 6},
            "objects": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}},
                    "required": ["id"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["tags", "bounded", "many", "objects"],
    },
    "integer ranges": {
        "type": "object",
        "properties": {
            "small": {"type": "integer", "minimum": 1, "maximum": 3},
            "exact": {"type": "integer", "minimum": 7, "maximum": 7},
            "exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3},
            "negative": {"type": "integer", "minimum": -50, "maximum": -40},
            "below_zero_only": {"type": "integer", "maximum": -5},
            "not_positive": {"type": "integer", "exclusiveMaximum": 1},
            "large": {"type": "integer", "minimum": 1_000_000},
        },
        "required": [
            "small",
            "exact",
            "exclusive",
            "negative",
            "below_zero_only",
            "not_positive",
            "large",
        ],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "open": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "tiny": {"type": "number", "minimum": 0.0005, "maximum": 0.0009},
            "negative": {"type": "number", "maximum": -1.5},
        },
        "required": ["ratio", "open", "tiny", "negative"],
    },
    "strings": {
        "type": "object",
        "properties": {
            "exact": {"type": "string", "minLength": 30, "maxLength": 30},
            "short": {"type": "string", "maxLength": 2},
            "empty": {"type": "string", "maxLength": 0},
            "nullable": {"type": ["string", "null"], "minLength": 3},
        },
        "required": ["exact", "short", "empty", "nullable"],
    },
    "anyOf": {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "required": ["v"],
    },
    "no type, properties only": {
        "properties": {"x": {"type": "string"}},
        "required": ["x"],
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_instances_validate(name: str) -> None:
    schema = SCHEMAS[name]
    jsonschema.validators.validator_for(schema).check_schema(schema)
    for seed in range(150):
        jsonschema.validate(schema_instance(schema, random.Random(seed)), schema)


async def test_function_call_arguments_validate_against_the_tool_schema() -> None:
    tools = [
        p.FunctionTool(name=name.replace(" ", "_").replace(",", ""), parameters=schema)
        for name, schema in SCHEMAS.items()
    ]
    by_name = {t.name: t for t in tools}
    seen: set[str] = set()
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            for tool in tools:
                for i in range(3):
                    r = await respond(
                        engine,
                        model="sim:parallel=2",
                        tools=tools,
                        tool_choice=p.ToolChoiceFunction(name=tool.name),
                        input=f"call {tool.name} #{i}",
                    )
                    for call in calls_of(r):
                        seen.add(call.name)
                        schema = by_name[call.name].parameters
                        assert schema is not None
                        jsonschema.validate(json.loads(call.arguments), schema)
    assert seen == set(by_name)
