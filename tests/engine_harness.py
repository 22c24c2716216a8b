"""Drivers that run one scripted agent rollout through the engine in each of its three modes,
and hypothesis strategies for such scripts. Shared by the engine's property tests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs
import jsonschema
from hypothesis import strategies as st

import protocol as p
from engine import Engine, ResponseState


@attrs.frozen
class Script:
    """An agent rollout: a model string, tools, instructions, the user turns, and how the
    client answers tool calls (output text = f(call, counter))."""

    model: str
    tools: tuple[p.FunctionTool, ...]
    instructions: str | None
    user_turns: tuple[str, ...]
    tool_outputs: tuple[str, ...]  # used in order, cycling
    max_output_tokens: int | None = None

    def output_for(self, call: p.FunctionCall, n: int) -> str:
        base = self.tool_outputs[n % len(self.tool_outputs)] if self.tool_outputs else ""
        return f"{call.name}:{base}"

    def create(self, **kw: Any) -> p.ResponseCreate:
        return p.ResponseCreate(
            model=self.model,
            tools=list(self.tools),
            instructions=self.instructions,
            max_output_tokens=self.max_output_tokens,
            **kw,
        )


@attrs.define
class Run:
    """What a mode produced."""

    outputs: list[p.Item] = attrs.field(factory=list)
    responses: list[p.Response] = attrs.field(factory=list)
    states: list[ResponseState] = attrs.field(factory=list)
    events: list[p.ServerEvent] = attrs.field(factory=list)

    @property
    def final(self) -> ResponseState:
        return self.states[-1]

    def usage(self) -> tuple[int, int, int]:
        totals = [0, 0, 0]
        for r in self.responses:
            assert r.usage is not None
            totals[0] += r.usage.input_tokens
            totals[1] += r.usage.output_tokens
            totals[2] += r.usage.total_tokens
        return (totals[0], totals[1], totals[2])


def strip_ids(item: p.Item) -> dict[str, Any]:
    wire = p.to_wire(item)
    for key in ("id", "call_id"):
        wire.pop(key, None)
    return dict(wire)


def same_items(a: Sequence[p.Item], b: Sequence[p.Item]) -> bool:
    return [strip_ids(i) for i in a] == [strip_ids(i) for i in b]


def _calls(items: Sequence[p.Item]) -> list[p.FunctionCall]:
    return [i for i in items if isinstance(i, p.FunctionCall) and i.status == "completed"]


def check_arguments(script: Script, items: Sequence[p.Item]) -> None:
    tools = {t.name: t for t in script.tools}
    for call in _calls(items):
        schema = tools[call.name].parameters or {"type": "object"}
        jsonschema.validate(json.loads(call.arguments), schema)


MAX_TURNS = 40  # a safety net: no script should need more responses than this


async def run_chain(engine: Engine, script: Script, *, store: bool = False) -> Run:
    """previous_response_id chain on one session (the launched WebSocket-mode design)."""
    session = engine.session()
    run = Run()
    prev: str | None = None
    n = 0

    async def emit(event: p.ServerEvent) -> None:
        run.events.append(event)

    for text in script.user_turns:
        new: list[p.Item] = [p.Message(role="user", content=text)]
        for _ in range(MAX_TURNS):
            state = await session.create(
                script.create(input=new, previous_response_id=prev, store=store), emit
            )
            assert state is not None
            run.states.append(state)
            run.responses.append(state.response)
            run.outputs.extend(state.response.output)
            prev = state.id
            calls = _calls(state.response.output)
            if not calls or state.response.status != "completed":
                break
            new = []
            for call in calls:
                output = script.output_for(call, n)
                new.append(p.FunctionCallOutput(call_id=call.call_id, output=output))
                n += 1
    return run


async def run_stateless(engine: Engine, script: Script) -> Run:
    """Every request carries the whole history (the HTTP baseline)."""
    session = engine.session()
    run = Run()
    history: list[p.Item] = []
    n = 0
    for text in script.user_turns:
        history.append(p.Message(role="user", content=text))
        for _ in range(MAX_TURNS):
            state = await session.create(script.create(input=list(history), store=False))
            assert state is not None
            run.states.append(state)
            run.responses.append(state.response)
            run.outputs.extend(state.response.output)
            history.extend(state.response.output)
            calls = _calls(state.response.output)
            if not calls or state.response.status != "completed":
                break
            for call in calls:
                history.append(
                    p.FunctionCallOutput(call_id=call.call_id, output=script.output_for(call, n))
                )
                n += 1
    return run


async def run_rollout(engine: Engine, script: Script) -> Run:
    """The rollout extension: one long-lived response per user turn."""
    session = engine.session()
    run = Run()
    prev: str | None = None
    n = 0
    for text in script.user_turns:
        request = script.create(
            input=[p.Message(role="user", content=text)],
            previous_response_id=prev,
            rollout=True,
            store=False,
        )
        async with session.open_rollout(request) as rollout:
            for _ in range(MAX_TURNS):
                async for event in rollout:
                    run.events.append(event)
                assert rollout.response is not None
                if rollout.response.status != "in_progress":
                    break
                outputs: list[p.Item] = []
                by_id = {c.call_id: c for c in _calls(rollout.response.output)}
                for call_id, _name in rollout.pending_calls:
                    outputs.append(
                        p.FunctionCallOutput(
                            call_id=call_id, output=script.output_for(by_id[call_id], n)
                        )
                    )
                    n += 1
                rollout.append(outputs)
        response = rollout.response
        assert response is not None and rollout.response_id is not None
        state = session.cache.get(rollout.response_id)
        assert state is not None
        run.states.append(state)
        run.responses.append(response)
        run.outputs.extend(i for i in response.output if not isinstance(i, p.FunctionCallOutput))
        prev = response.id
    return run


def rollout_model_items(run: Run) -> list[p.Item]:
    """The model's items (rollout responses contain only model output)."""
    return run.outputs


# --- strategies ------------------------------------------------------------------------------

names = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)
unicode_text = st.text(min_size=0, max_size=40)


def leaf_schemas() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda: {"type": "string"}),
        st.builds(
            lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
            st.integers(0, 5),
            st.integers(0, 20),
        ),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-100, 100),
            st.integers(0, 100),
        ),
        st.builds(lambda: {"type": "number"}),
        st.builds(lambda: {"type": "boolean"}),
        st.builds(
            lambda vals: {"type": "string", "enum": vals},
            st.lists(unicode_text, min_size=1, max_size=4, unique=True),
        ),
        st.builds(lambda: {"type": "array", "items": {"type": "string"}}),
    )


def object_schemas(depth: int = 1) -> st.SearchStrategy[dict[str, Any]]:
    inner = leaf_schemas() if depth == 0 else st.one_of(leaf_schemas(), object_schemas(depth - 1))

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        props = draw(st.dictionaries(names, inner, max_size=4))
        required = draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
        schema: dict[str, Any] = {"type": "object", "properties": props}
        if required:
            schema["required"] = required
        if draw(st.booleans()):
            schema["additionalProperties"] = False
        return schema

    return build()


@st.composite
def scripts(draw: st.DrawFn, *, max_user_turns: int = 2) -> Script:
    # sampled_from rather than ranges: hypothesis favours small values, and a rollout
    # without tool calls is the least interesting case.
    n_tools = draw(st.sampled_from([1, 2, 3, 0]))
    tool_names = draw(st.lists(names, min_size=n_tools, max_size=n_tools, unique=True))
    tools = tuple(
        p.FunctionTool(name=name, description=draw(unicode_text), parameters=draw(object_schemas()))
        for name in tool_names
    )
    steps = draw(st.sampled_from([2, 1, 3, 4, 0]))
    parallel = draw(st.integers(1, 3))
    tokens = draw(st.integers(0, 24))
    model = f"sim:steps={steps},parallel={parallel},tokens={tokens}"
    return Script(
        model=model,
        tools=tools,
        instructions=draw(st.none() | unicode_text.filter(bool)),
        user_turns=tuple(draw(st.lists(unicode_text, min_size=1, max_size=max_user_turns))),
        tool_outputs=tuple(draw(st.lists(unicode_text, min_size=1, max_size=4))),
    )
