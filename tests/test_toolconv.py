"""The ChatML tool-call convention (`engine/_toolconv.py`): the envelope, the streaming parser
(any split of the output gives the same events), and the llama.cpp grammars (compiled by
llama.cpp; a greedy run of SmolLM2 under a required-call grammar makes a valid call)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout.engine._chat import ChatToolset
from rollout.engine._interfaces import (
    ArgsDelta,
    CallEnd,
    CallStart,
    Finish,
    SampleEvent,
    TextDelta,
    TextEnd,
    TextStart,
)
from rollout.engine._toolconv import (
    CALL_TRIGGER,
    MAX_HELD_WHITESPACE,
    CallParser,
    Grammar,
    call_text,
    describe_tools,
    grammar_for,
    opens_call,
    system_content,
)
from rollout.protocol import (
    BuiltinTool,
    CustomTool,
    FunctionTool,
    NamespaceTool,
    ToolChoiceAllowed,
    ToolChoiceCustom,
    ToolChoiceFunction,
)

from tests.llama_harness import greedy, require_llama, smollm2_renderer, smollm2_vocab

WEATHER = FunctionTool(
    name="get_weather",
    description="Get the current weather in a city.",
    parameters={
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
SEARCH = FunctionTool(
    name="search",
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"],
    },
)
PATCH = CustomTool(name="patch", description="Apply a patch.")
FILES = NamespaceTool(
    name="files",
    description="File tools.",
    tools=[FunctionTool(name="read", parameters={"type": "object", "properties": {}})],
)
SHELL = BuiltinTool(type="local_shell")
TOOLS = [WEATHER, SEARCH, PATCH, FILES, SHELL]


def events_of(pieces: list[str], toolset: ChatToolset | None, reason: str = "stop") -> list[Any]:
    parser = CallParser(toolset)
    out: list[Any] = []
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish(reason)


def merged(events: list[Any]) -> list[Any]:
    """Events with consecutive deltas joined and token counts dropped (how a split changes
    the stream without changing what it says)."""
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, TextDelta | ArgsDelta) and out and type(out[-1]) is type(ev):
            out[-1] = type(ev)(out[-1].text + ev.text, 1)
        elif isinstance(ev, TextDelta | ArgsDelta):
            out.append(type(ev)(ev.text, 1))
        elif isinstance(ev, Finish):
            out.append(Finish(ev.reason))
        else:
            out.append(ev)
    return out


def text_of(events: list[Any], kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


# --- the text the model reads ------------------------------------------------------------


def test_call_text_is_the_envelope() -> None:
    assert call_text("get_weather", '{"city": "Paris"}') == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )


def test_tools_are_described_deterministically() -> None:
    reordered = FunctionTool(
        name="get_weather",
        description="Get the current weather in a city.",
        parameters={
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "city": {"type": "string"},
            },
            "type": "object",
        },
    )
    assert describe_tools([WEATHER]) == describe_tools([reordered])
    text = describe_tools(TOOLS)
    lines = text.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    names = [json.loads(line)["function"]["name"] for line in lines]
    assert names == ["get_weather", "search", "patch", "files__read", "local_shell"]
    assert "<tool_call>" in text and text.startswith("# Tools\n")
    assert system_content("Be brief.", TOOLS) == "Be brief.\n\n" + text
    assert system_content(None, []) == ""
    assert system_content("Be brief.", []) == "Be brief."


# --- parsing -------------------------------------------------------------------------------


def test_text_then_call() -> None:
    toolset = ChatToolset(TOOLS, "auto")
    args = '{"city": "Pa}ris {x} \\"q\\" é😀", "unit": "celsius"}'
    output = "Let me check. " + call_text("get_weather", args)
    events = events_of([output], toolset)
    assert merged(events) == [
        TextStart(),
        TextDelta("Let me check. ", 1),
        TextEnd(),
        CallStart("get_weather"),
        ArgsDelta(args, 1),
        CallEnd(),
        Finish("tool_calls"),
    ]


def test_nested_arguments_stream_verbatim() -> None:
    toolset = ChatToolset(TOOLS, "required")
    args = '{ "a": {"b": [1, {"c": "]}\\\\"}], "d": {}}, "e": "\\u00e9{" } '
    events = events_of(list(call_text("search", args)), toolset)
    assert text_of(events, ArgsDelta) == args
    assert json.loads(text_of(events, ArgsDelta)) == json.loads(args)
    deltas = [e for e in events if isinstance(e, ArgsDelta)]
    assert len(deltas) > 10  # streamed as it came, not at the end


@pytest.mark.parametrize(
    "args",
    [
        '{"a": "x\\" }", "b": 1}',  # an escaped quote, then a brace inside the string
        '{"a": "\\\\", "b": {"c": "}"}}',  # an escaped backslash ends before the quote
        '{"a": "\\\\\\"}{"}',
        '{"k\\"}": [{"x": "]"}, "\\u007d"]}',
    ],
)
def test_strings_and_escapes_do_not_end_the_arguments(args: str) -> None:
    json.loads(args)
    toolset = ChatToolset(TOOLS, "auto")
    for pieces in ([call_text("search", args)], list(call_text("search", args))):
        events = events_of(pieces, toolset)
        assert merged(events) == [
            CallStart("search"),
            ArgsDelta(args, 1),
            CallEnd(),
            Finish("tool_calls"),
        ]


def test_names_map_back_to_tools() -> None:
    toolset = ChatToolset(TOOLS, "auto")
    ns = events_of([call_text("files__read", "{}")], toolset)
    assert ns[0] == CallStart("read", "files", "function")
    shell = events_of([call_text("local_shell", '{"command": ["ls"]}')], toolset)
    assert shell[0] == CallStart("local_shell", None, "local_shell")
    custom = events_of([call_text("patch", '{"input": "*** Begin Patch\\n"}')], toolset)
    assert custom[0] == CallStart("patch", None, "custom")
    assert text_of(custom, ArgsDelta) == "*** Begin Patch\n"  # unwrapped
    unknown = events_of([call_text("mystery__tool", "{}")], toolset)
    assert unknown[0] == CallStart("tool", "mystery", "function")


@pytest.mark.parametrize(
    "output",
    [
        "<tool_ is not a call",
        "Use <tool_call> tags to call.",
        "<tool_call>\n{'name': 'x'}",
        '<tool_call>\n{"name": "x", "args": {}}\n</tool_call>',
        '<tool_call>\n{"name": "x\nhalf',
        "a < b and <tool_calls> differ",
        "ends with <tool_c",
    ],
)
def test_what_is_not_a_call_is_text(output: str) -> None:
    toolset = ChatToolset(TOOLS, "auto")
    for pieces in ([output], list(output)):
        events = events_of(pieces, toolset)
        assert merged(events) == [TextStart(), TextDelta(output, 1), TextEnd(), Finish("stop")]


def test_a_wrong_envelope_tail_ends_the_call_at_its_arguments() -> None:
    toolset = ChatToolset(TOOLS, "auto")
    output = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}} and more'
    assert merged(events_of([output], toolset)) == [
        CallStart("search"),
        ArgsDelta('{"query": "x"}', 1),
        CallEnd(),
        TextStart(),
        TextDelta("} and more", 1),
        TextEnd(),
        Finish("stop"),
    ]


def test_whitespace_before_a_call_is_dropped_and_other_whitespace_kept() -> None:
    toolset = ChatToolset(TOOLS, "auto")
    call = call_text("search", '{"query": "x"}')
    assert merged(events_of(["\n \n", call], toolset))[0] == CallStart("search")
    assert merged(events_of(["  Hi"], toolset))[:2] == [TextStart(), TextDelta("  Hi", 1)]
    assert merged(events_of([" \n"], toolset))[:2] == [TextStart(), TextDelta(" \n", 1)]
    after = merged(events_of([call, "\n"], toolset))  # a call, then only whitespace
    assert after[-2:] == [CallEnd(), Finish("tool_calls")]
    long = " " * (MAX_HELD_WHITESPACE + 1)
    assert events_of([long], toolset)[:2] == [TextStart(), TextDelta(long, 1)]


def test_cut_off_items_stay_open() -> None:
    toolset = ChatToolset(TOOLS, "auto")
    cut_call = events_of(
        ['<tool_call>\n{"name": "search", "arguments": {"qu'], toolset, "max_output_tokens"
    )
    assert merged(cut_call) == [
        CallStart("search"),
        ArgsDelta('{"qu', 1),
        Finish("max_output_tokens"),
    ]
    cut_text = events_of(["Hello <tool"], toolset, "max_output_tokens")
    assert merged(cut_text) == [
        TextStart(),
        TextDelta("Hello <tool", 1),
        Finish("max_output_tokens"),
    ]
    # Cut inside the envelope's head: nothing was called, the head is text.
    head = events_of(['<tool_call>\n{"name": "sea'], toolset, "max_output_tokens")
    assert merged(head) == [
        TextStart(),
        TextDelta('<tool_call>\n{"name": "sea', 1),
        Finish("max_output_tokens"),
    ]
    # Arguments complete, the envelope's end missing: the call is whole.
    tail = events_of(['<tool_call>\n{"name": "search", "arguments": {} }\n</tool'], toolset)
    assert merged(tail) == [
        CallStart("search"),
        ArgsDelta("{} ", 1),
        CallEnd(),
        Finish("tool_calls"),
    ]


def test_no_calls_without_tools_or_with_choice_none() -> None:
    output = call_text("search", '{"query": "x"}')
    for toolset in (None, ChatToolset(TOOLS, "none"), ChatToolset([], "auto")):
        assert merged(events_of([output], toolset)) == [
            TextStart(),
            TextDelta(output, 1),
            TextEnd(),
            Finish("stop"),
        ]


def test_parsers_say_whether_they_parse_calls() -> None:
    assert CallParser(ChatToolset(TOOLS, "auto")).parses_calls
    assert CallParser(ChatToolset(TOOLS, "required")).parses_calls
    for toolset in (None, ChatToolset(TOOLS, "none"), ChatToolset([], "auto")):
        assert not CallParser(toolset).parses_calls


@pytest.mark.parametrize(
    ("piece", "opens"),
    [
        (b"<", True),
        (b" <", True),
        (b"\n<tool", True),
        (b"<tool_call>", True),
        (b"<tool_call>\n{", True),
        (b"</", False),  # another tag
        (b"<b>", False),
        (b"<tools", False),  # not the envelope
        (b"The", False),
        (b"  ", False),  # blank: the ban stays on
        (b"", False),
        (b"a<", False),  # not at the start of the output's text
    ],
)
def test_the_tokens_that_open_a_call(piece: bytes, opens: bool) -> None:
    """Under "none" the model's thread bans these while the output is blank."""
    assert opens_call(piece) is opens


def test_token_counts_add_up() -> None:
    toolset = ChatToolset(TOOLS, "auto")
    output = "Sure." + call_text("search", '{"query": "x"}')
    parser = CallParser(toolset)
    events: list[SampleEvent] = []
    for i in range(0, len(output), 3):
        events += parser.feed(output[i : i + 3], 2)
    events += parser.feed("", 1)  # a token whose character is not complete yet
    events += parser.finish("stop")
    fed = 2 * len(range(0, len(output), 3)) + 1
    deltas = sum(e.n_tokens for e in events if isinstance(e, TextDelta | ArgsDelta))
    # Finish counts every token fed; the deltas carry all but those after the last one (the
    # envelope's end, here 14 characters in 5 pieces of 2 tokens, and the empty piece).
    assert events[-1] == Finish("tool_calls", output_tokens=fed)
    assert deltas == fed - 2 * 5 - 1


# Outputs as a model writes them: text (with `<` and near-misses), then maybe a call whose
# arguments are any JSON object, written compactly or spaced.
_words = st.sampled_from(
    ["Hello", " world", "<", "<tool", "<tool_", " <b>", "\n", "{", "}", '"', "é", "😀", "  "]
)
_texts = st.lists(_words, max_size=8).map("".join)
# Strings full of what a JSON scanner must not take for structure.
_json_texts = st.text(max_size=8) | st.text(alphabet='ab"{}[]\\ é\n', max_size=8)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | _json_texts,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(_json_texts, children, max_size=3)
    ),
    max_leaves=8,
)
_args = st.tuples(
    st.dictionaries(_json_texts, _json, max_size=4),
    st.sampled_from([(",", ":"), (", ", ": ")]),
    st.booleans(),
    st.sampled_from(["", " "]),
).map(lambda t: json.dumps(t[0], separators=t[1], ensure_ascii=t[2]) + t[3])
_outputs = st.tuples(
    _texts, st.none() | st.tuples(st.sampled_from(["search", "patch", "files__read"]), _args)
).map(lambda t: t[0] + (call_text(*t[1]) if t[1] else ""))


@settings(max_examples=150, deadline=None)
@given(output=_outputs, cuts=st.lists(st.integers(min_value=0), max_size=12))
def test_any_split_gives_the_same_events(output: str, cuts: list[int]) -> None:
    toolset = ChatToolset(TOOLS, "auto")
    whole = merged(events_of([output], toolset))
    points = sorted({c % (len(output) + 1) for c in cuts})
    pieces = [output[a:b] for a, b in zip([0, *points], [*points, len(output)], strict=True)]
    assert merged(events_of(pieces, toolset)) == whole
    assert merged(events_of(list(output), toolset)) == whole
    # Nothing is lost: text and arguments (wrapped input aside) add up to the output.
    if any(isinstance(e, CallStart) for e in whole):
        args = text_of(whole, ArgsDelta)
        start = next(e for e in whole if isinstance(e, CallStart))
        if start.kind != "custom":
            assert args in output
            json.loads(args)


# --- grammars ------------------------------------------------------------------------------

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {}},
    {"type": "object"},
    {
        "type": "object",
        "properties": {
            "who": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name"],
            },
            "stops": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "mode": {"enum": ["fast", "slow", 3, None]},
            "ratio": {"type": "number"},
            "ok": {"type": "boolean"},
            "note": {"type": ["string", "null"]},
            "tag": {"const": "x"},
            "when": {"type": "string", "format": "date"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "short": {"type": "string", "minLength": 1, "maxLength": 4},
        },
        "required": ["who", "stops"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "properties": {
            "a": {"$ref": "#/$defs/point"},
            "b": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        },
    },
    {"type": "object", "properties": {"weird": {"type": "no-such-type"}}},  # converter fails
    {"type": "object", "additionalProperties": {"type": "integer"}},
]


def test_grammar_modes() -> None:
    require_llama()  # the schema converter is llama-cpp-python's
    tools = [WEATHER, SEARCH, PATCH]
    assert grammar_for(ChatToolset(tools, "none"), "none", parallel=True) is None
    required = grammar_for(ChatToolset(tools, "required"), "required", parallel=True)
    assert required is not None and not required.lazy
    assert required.gbnf.count("<tool_call>") == 3
    auto = grammar_for(ChatToolset(tools, "auto"), "auto", parallel=True)
    assert auto is not None and auto.triggers == (CALL_TRIGGER,)
    named = ToolChoiceFunction(name="search")
    forced = grammar_for(ChatToolset(tools, named), named, parallel=False)
    assert forced is not None and forced.gbnf.count("<tool_call>") == 1
    assert '\\"name\\": \\"search\\"' in forced.gbnf
    allowed = ToolChoiceAllowed(mode="required", tools=[{"type": "custom", "name": "patch"}])
    only = grammar_for(ChatToolset(tools, allowed), allowed, parallel=False)
    assert only is not None and only.gbnf.count("<tool_call>") == 1 and "patch" in only.gbnf
    fmt = {"type": "json_schema", "name": "x", "schema": SCHEMAS[2]}
    text = grammar_for(ChatToolset(tools, "none"), "none", parallel=True, text_format=fmt)
    assert text is not None and "<tool_call>" not in text.gbnf and not text.lazy
    both = grammar_for(ChatToolset(tools, "auto"), "auto", parallel=True, text_format=fmt)
    assert both is not None and not both.lazy and both.gbnf.count("<tool_call>") == 3
    # JSON strings never hold raw control characters (JSON forbids them).
    assert 'char ::= [^"\\\\\\x7F\\x00-\\x1F]' in required.gbnf


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_grammars_compile_in_llama_cpp(schema: dict[str, Any]) -> None:
    vocab = smollm2_vocab()
    import llama_cpp

    tool = FunctionTool(name="f", parameters=schema)
    fmt = {"type": "json_schema", "name": "out", "schema": schema}
    grammars: list[Grammar | None] = [
        grammar_for(ChatToolset([tool, PATCH], "required"), "required", parallel=False),
        grammar_for(ChatToolset([tool, PATCH], "auto"), "auto", parallel=False),
        grammar_for(ChatToolset([], "none"), "none", parallel=False, text_format=fmt),
        grammar_for(
            ChatToolset([], "none"), "none", parallel=False, text_format={"type": "json_object"}
        ),
    ]
    for grammar in grammars:
        assert grammar is not None
        sampler = grammar.sampler(vocab)
        assert sampler
        llama_cpp.llama_sampler_free(sampler)


def test_a_broken_grammar_is_refused() -> None:
    from rollout.engine._toolconv import GrammarError

    vocab = smollm2_vocab()
    with pytest.raises(GrammarError):
        Grammar("root ::= undefined-rule").sampler(vocab)


def _run(
    tools: list[Any], choice: Any, question: str, max_tokens: int = 48
) -> tuple[list[Any], str]:
    renderer = smollm2_renderer()
    vocab = smollm2_vocab()
    toolset = ChatToolset(tools, choice)
    grammar = grammar_for(toolset, choice, parallel=False)
    from rollout.protocol import Message

    prompt = [
        *renderer.render_prefix(None, tools),
        *renderer.render_item(Message(role="user", content=question)),
        *renderer.generation_prompt,
    ]
    out = greedy(prompt, grammar, max_tokens)
    decoder = vocab.text_decoder()
    parser = CallParser(toolset)
    events: list[Any] = []
    for token in out:
        if vocab.is_eog(token):
            break
        events += parser.feed(decoder.feed(token), 1)
    events += parser.feed(decoder.flush(), 0)
    stopped = bool(out) and vocab.is_eog(out[-1])
    events += parser.finish("stop" if stopped else "max_output_tokens")
    return events, vocab.decode(out)


def test_real_model_makes_a_valid_required_call() -> None:
    require_llama()
    events, text = _run([WEATHER], "required", "What is the weather in Paris?")
    starts = [e for e in events if isinstance(e, CallStart)]
    assert starts == [CallStart("get_weather")], text
    assert events[-2:] == [CallEnd(), Finish("tool_calls", output_tokens=events[-1].output_tokens)]
    arguments = json.loads(text_of(events, ArgsDelta))
    jsonschema.validate(arguments, WEATHER.parameters)


def test_real_model_calls_the_named_custom_tool() -> None:
    require_llama()
    choice = ToolChoiceCustom(name="patch")
    events, text = _run([SEARCH, PATCH], choice, "Fix the typo in the README.", max_tokens=40)
    assert [e for e in events if isinstance(e, CallStart)] == [CallStart("patch", None, "custom")]
    assert isinstance(text_of(events, ArgsDelta), str)
    assert CallEnd() in events, text
