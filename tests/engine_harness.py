"""Drivers that run one scripted agent rollout through the engine in each of its three modes,
and hypothesis strategies for such scripts. Shared by the engine's property tests."""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import jsonschema
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.engine import Engine, ResponseState, ResponseStore, StoredResponse
from rollout.engine._state import Prefix


@attrs.frozen
class Script:
    """An agent rollout: a model string, tools (of every kind a client runs), instructions,
    the user turns, and how the client answers tool calls (output = f(call, counter))."""

    model: str
    tools: tuple[p.Tool, ...]
    instructions: str | None
    user_turns: tuple[str, ...]
    tool_outputs: tuple[str, ...]  # used in order, cycling
    max_output_tokens: int | None = None

    def output_for(self, call: p.ToolCall, n: int) -> str:
        base = self.tool_outputs[n % len(self.tool_outputs)] if self.tool_outputs else ""
        found = p.call_of(call)
        assert found is not None
        return f"{found[2]}:{base}"

    def answer(self, call: p.ToolCall, n: int) -> p.Item:
        """The output item a client sends back for `call` (of the call's own kind)."""
        return answer_item(call, self.output_for(call, n), n)

    def create(self, **kw: Any) -> p.ResponseCreate:
        return p.ResponseCreate(
            model=self.model,
            tools=list(self.tools),
            instructions=self.instructions,
            max_output_tokens=self.max_output_tokens,
            **kw,
        )


# The one-tool agent of the cache tests (tests/test_engine_cache.py, tests/test_render_cache.py).
LOOKUP_TOOL = p.FunctionTool(
    name="lookup",
    description="Look a key up.",
    parameters={
        "type": "object",
        "properties": {"key": {"type": "string"}},
        "required": ["key"],
        "additionalProperties": False,
    },
)
LOOKUP_INSTRUCTIONS = "You look things up."
# A client tool the coroutine's tests offer.
READ_FILE = p.FunctionTool(
    name="read_file",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
)


def lookup_request(default_model: str, **kw: Any) -> p.ResponseCreate:
    """A create for the lookup agent (on `default_model` unless given; `store: false` unless
    given)."""
    kw.setdefault("model", default_model)
    kw.setdefault("tools", [LOOKUP_TOOL])
    kw.setdefault("instructions", LOOKUP_INSTRUCTIONS)
    kw.setdefault("store", False)
    return p.ResponseCreate(**kw)


def answer_item(call: p.ToolCall, text: str, n: int = 0) -> p.Item:
    """An output of `call`'s own kind carrying `text`."""
    if isinstance(call, p.FunctionCall):
        return p.FunctionCallOutput(call_id=call.call_id, output=text)
    if isinstance(call, p.CustomToolCall):
        return p.CustomToolCallOutput(call_id=call.call_id, output=text)
    if isinstance(call, p.ShellCall):
        outcome = {"type": "exit", "exit_code": n % 3}
        result = p.ShellOutput(stdout=text, stderr="", outcome=outcome)
        return p.ShellCallOutput(call_id=call.call_id, output=[result])
    if isinstance(call, p.LocalShellCall):
        return p.LocalShellCallOutput(id=call.call_id, output=text)
    if isinstance(call, p.ApplyPatchCall):
        return p.ApplyPatchCallOutput(call_id=call.call_id, status="completed", output=text)
    assert isinstance(call, p.ComputerCall)
    shot = p.ComputerScreenshot(image_url=f"https://example.com/shot-{n}.png")
    return p.ComputerCallOutput(call_id=call.call_id, output=shot)


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

    def cached(self) -> int:
        """Cached input tokens over the run's responses: context not rendered for them."""
        total = 0
        for r in self.responses:
            assert r.usage is not None
            total += r.usage.input_tokens_details.cached_tokens
        return total


def strip_ids(item: p.Item) -> dict[str, Any]:
    wire = p.to_wire(item)
    for key in ("id", "call_id"):
        wire.pop(key, None)
    return dict(wire)


def same_items(a: Sequence[p.Item], b: Sequence[p.Item]) -> bool:
    return [strip_ids(i) for i in a] == [strip_ids(i) for i in b]


def pending_calls(items: Sequence[p.Item]) -> list[p.ToolCall]:
    """The tool calls (of every kind) that wait for an output."""
    return [
        typing.cast(p.ToolCall, i)
        for i in items
        if p.call_of(i) is not None and getattr(i, "status", None) == "completed"
    ]


def check_arguments(script: Script, items: Sequence[p.Item]) -> None:
    """Function arguments are valid for their schema; custom input for its grammar."""
    tools = {t.name: t for t in script.tools if isinstance(t, p.FunctionTool | p.CustomTool)}
    for call in pending_calls(items):
        if isinstance(call, p.FunctionCall):
            tool = tools[call.name]
            assert isinstance(tool, p.FunctionTool)
            jsonschema.validate(json.loads(call.arguments), tool.parameters or {"type": "object"})
        elif isinstance(call, p.CustomToolCall):
            tool = tools[call.name]
            assert isinstance(tool, p.CustomTool)
            fmt = tool.format
            if fmt is not None and fmt.syntax == "regex":
                assert re.fullmatch(fmt.definition or "", call.input), call.input


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
            calls = pending_calls(state.response.output)
            if not calls or state.response.status != "completed":
                break
            new = []
            for call in calls:
                new.append(script.answer(call, n))
                n += 1
    return run


def echo_as_sent(item: p.Item) -> p.Item:
    return item


def echo_bare(item: p.Item) -> p.Item:
    """An output item as a client may send it back: without its id and status, and an
    assistant message of text only as a plain string."""
    if isinstance(item, p.Message) and not isinstance(item.content, str):
        texts = [part.text for part in item.content if isinstance(part, p.OutputText)]
        if len(texts) == len(item.content) == 1:
            return p.Message(role=item.role, content=texts[0], phase=item.phase)
    changes = {k: None for k in ("id", "status") if getattr(item, k, None) is not None}
    if isinstance(item, p.LocalShellCallOutput):
        changes = {}  # its id names its call
    return typing.cast(p.Item, attrs.evolve(typing.cast(Any, item), **changes))


async def run_stateless(
    engine: Engine, script: Script, echo: Callable[[p.Item], p.Item] = echo_as_sent
) -> Run:
    """Every request carries the whole history (the HTTP baseline), the model's output items
    echoed back through `echo`."""
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
            history.extend(echo(item) for item in state.response.output)
            calls = pending_calls(state.response.output)
            if not calls or state.response.status != "completed":
                break
            for call in calls:
                history.append(script.answer(call, n))
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
                by_id = {c.call_id: c for c in pending_calls(rollout.response.output)}
                for call_id, _name in rollout.pending_calls:
                    outputs.append(script.answer(by_id[call_id], n))
                    n += 1
                rollout.append(outputs)
        response = rollout.response
        assert response is not None and rollout.response_id is not None
        state = session.cache.get(rollout.response_id)
        assert state is not None
        run.states.append(state)
        run.responses.append(response)
        run.outputs.extend(i for i in response.output if p.output_of(i) is None)
        prev = response.id
    return run


async def run_inject(engine: Engine, script: Script) -> Run:
    """The multi-agent beta's door: one long-lived response per user turn, each call's output
    injected as soon as its item is done (as the Agents SDK does), taken when it waits."""
    session = engine.session()
    run = Run()
    prev: str | None = None
    n = 0
    for text in script.user_turns:
        request = script.create(
            input=[p.Message(role="user", content=text)],
            previous_response_id=prev,
            multi_agent={"enabled": True},
            store=False,
        )
        async with session.open_rollout(request) as rollout:
            async for event in rollout:
                run.events.append(event)
                done = event.item if isinstance(event, p.OutputItemDone) else None
                if p.call_of(done) is not None and getattr(done, "status", None) == "completed":
                    assert rollout.response_id is not None
                    call = typing.cast(p.ToolCall, done)
                    answer = script.answer(call, n)
                    n += 1
                    rollout.inject(
                        p.ResponseInject(response_id=rollout.response_id, input=[answer])
                    )
        response = rollout.response
        assert response is not None and rollout.response_id is not None
        state = session.cache.get(rollout.response_id)
        assert state is not None
        run.states.append(state)
        run.responses.append(response)
        run.outputs.extend(unattributed(i) for i in response.output if p.output_of(i) is None)
        prev = response.id
    return run


def unattributed(item: p.Item) -> p.Item:
    """An item of a multi-agent response without the root agent's attribution (`agent`, and
    an assistant message's `phase`), which the beta adds on the wire only."""
    changes: dict[str, Any] = {}
    if getattr(item, "agent", None) is not None:
        changes["agent"] = None
    if isinstance(item, p.Message) and item.role == "assistant":
        changes["phase"] = None
    return typing.cast(p.Item, attrs.evolve(typing.cast(Any, item), **changes))


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


# Grammars of custom tools (the sim writes input each accepts).
GRAMMARS: list[p.CustomToolFormat] = [
    p.CustomToolFormat(type="text"),
    p.CustomToolFormat(type="grammar", syntax="regex", definition=r"[a-z]{3,8}( [0-9]{1,3})?"),
    p.CustomToolFormat(
        type="grammar",
        syntax="lark",
        definition='start: "run " WORD ("," WORD)*\nWORD: /[a-z]+/\n',
    ),
]
# One tool of each kind a client runs besides functions (named `t0` where a name is needed).
EVERY_KIND: dict[str, p.Tool] = {}
BUILTIN_TOOLS = [
    p.BuiltinTool(type="shell", settings={"environment": {"type": "local"}}),
    p.BuiltinTool(type="local_shell"),
    p.BuiltinTool(type="apply_patch"),
    p.BuiltinTool(type="computer"),
]
EVERY_KIND.update(
    {f"custom-{g.syntax or g.type}": p.CustomTool(name="t0", format=g) for g in GRAMMARS}
)
EVERY_KIND.update({t.type: t for t in BUILTIN_TOOLS})


@st.composite
def script_tools(draw: st.DrawFn, n_tools: int) -> tuple[p.Tool, ...]:
    """Tools of every kind a client runs: function tools (most), custom tools (text, regex or
    lark), and the built-in shell, local shell, apply_patch and computer tools."""
    tool_names = draw(st.lists(names, min_size=n_tools, max_size=n_tools, unique=True))
    tools: list[p.Tool] = []
    for name in tool_names:
        kind = draw(st.sampled_from(["function", "custom", "builtin", "function"]))
        if kind == "custom":
            tools.append(
                p.CustomTool(
                    name=name,
                    description=draw(unicode_text),
                    format=draw(st.sampled_from(GRAMMARS)),
                )
            )
        elif kind == "builtin" and (builtin := draw(st.sampled_from(BUILTIN_TOOLS))) not in tools:
            tools.append(builtin)
        else:
            tools.append(
                p.FunctionTool(
                    name=name, description=draw(unicode_text), parameters=draw(object_schemas())
                )
            )
    return tuple(tools)


@st.composite
def scripts(
    draw: st.DrawFn,
    *,
    max_user_turns: int = 2,
    with_tool: p.Tool | None = None,
) -> Script:
    """Agent scripts. `with_tool`: that tool always among the tools, and at least one step."""
    # sampled_from rather than ranges: hypothesis favours small values, and a rollout
    # without tool calls is the least interesting case.
    n_tools = draw(st.sampled_from([1, 2, 3, 0]))
    if with_tool is not None:
        tools: tuple[p.Tool, ...] = (with_tool,)
    else:
        tools = draw(script_tools(n_tools))
    steps = draw(st.sampled_from([2, 1, 3, 4] if with_tool is not None else [2, 1, 3, 4, 0]))
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


def classified_chars(engine: Engine, items: Sequence[p.Item], prefix: Prefix | None = None) -> int:
    """The characters the default classifiers examine for `items` (and `prefix`): the text the
    renderer gives them, once (the secret detector scans it; the empty policy scans nothing)."""
    renderer = engine.pipeline.renderer
    chars = sum(len(renderer.item_text(item)) for item in items)
    if prefix is not None:
        chars += len(renderer.prefix_text(prefix.instructions, prefix.offered))
    return chars


def conversation_chars(engine: Engine, state: ResponseState) -> int:
    """`classified_chars` of a state's whole conversation, its prefix included."""
    return classified_chars(engine, state.items, state.prefix)


class WithoutRenderings:
    """A store that keeps no renderings (`StoredResponse.rendered`), as one written by an older
    rollout or with another chat template: hydration renders the stored items."""

    def __init__(self, inner: ResponseStore) -> None:
        self.inner = inner

    async def put(self, stored: StoredResponse) -> None:
        await self.inner.put(attrs.evolve(stored, rendered=None))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
