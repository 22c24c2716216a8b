"""The tool-call convention of a ChatML model whose chat template knows no tools (SmolLM2):
how tools are described to it, how it writes a call, how its output is parsed back into
sample events, and the llama.cpp grammars that keep its calls well-formed.

Long because the convention has two halves that must agree: the text the model is shown and
taught, and a streaming parser (`CallParser`) with the llama.cpp grammars that hold the model to
it.

The convention (Hermes/Qwen style), versioned by `CONVENTION_VERSION` (it is part of the
renderer's `template_id`, so stored renderings of another version are not reused):

- Tools are described in the system turn, after the instructions (a blank line between)::

      # Tools

      You can call the functions below. Each is described by a JSON schema, one per line
      inside <tools></tools>:
      <tools>
      {"function":{"description":...,"name":"get_weather","parameters":{...}},"type":"function"}
      </tools>

      To call one, answer with the call alone, written exactly like this:
      <tool_call>
      {"name": "<the function's name>", "arguments": <its arguments, a JSON object>}
      </tool_call>
      Its result comes back in a message from the tool.

  Every tool kind is presented as a function by `ChatToolset` (custom tools take
  `{"input": ...}`, client-run built-ins their action, hosted tools `{"query": ...}`); each line
  is canonical JSON (sorted keys, no whitespace), so the same tools always render the same.
- A call is exactly ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``
  (`call_text`). ARGS is the arguments object as the model wrote it (its spacing and escapes,
  plus any whitespace it left before the closing brace), kept verbatim as the call's
  `arguments`, so rendering the call item reproduces the text the model generated.
- A tool's output is a turn of role ``tool`` whose content is the output's text.
- One call per turn, whatever `parallel_tool_calls` says: each call item renders as its own
  assistant turn, so a turn holding two calls would not re-render as it was generated (and the
  KV cache of a continuation would no longer match its rendering). The grammars end the turn
  after one call; a backend without grammar should stop at the end of a call (`CallParser.
  calls_closed`).

Under `tool_choice` "none" (or when no tool is offered) the model, which the system turn taught
the envelope, must not open one: its text would be a call nobody can run, which a client would
show as the answer (SmolLM2 does this after a tool output it does not know how to read). So
while its output is still blank, the tokens that would start writing ``<tool_call>``
(`opens_call`) are banned (`SamplerSpec.no_call`, applied by the model's thread), and it
answers in words. A grammar could say the same, but llama.cpp applies a grammar to the whole
vocabulary at every token when sampling at a temperature (~10 ms a token for SmolLM2: the cost
of a second model), where the ban masks a few logits at the first tokens only.

`CallParser` turns the model's output, fed piece by piece as the detokenizer yields it, into
`TextStart`/`TextDelta`/`TextEnd` and `CallStart`/`ArgsDelta`/`CallEnd` events. Arguments
stream as they arrive: the parser follows JSON nesting, strings and escapes to find where the
arguments object ends. Text that may be the start of ``<tool_call>`` is held back until
decided, and so is whitespace before any text (whitespace alone before a call is dropped: no
empty message item). A block that is not the envelope (possible only without a grammar) is
passed on as text from its ``<tool_call>`` on; once a call has started (its arguments' ``{``
arrived) it stays a call: a wrong envelope tail closes it at the end of its arguments and the
rest is text. A call cut off by `max_output_tokens` stays open for the engine to close
incomplete.

Under a grammar the model may spell the envelope or a literal with tokens BPE would not
choose (measured with SmolLM2: 2 of 7 greedy calls, e.g. ``get_weather`` as ``g|et|_``):
the call's rendering then has the same text as what was generated but other tokens, and a
continuation's KV cache matches only up to there.

`grammar_for` builds llama.cpp GBNF grammars from the tools' JSON schemas with llama-cpp-python's
maintained converter (`llama_cpp.llama_grammar.SchemaConverter`, each tool's schema visited
under its own rule name): a required (or named) call is the whole output; under `auto` a lazy
grammar starts at ``<tool_call>`` so the model may answer in text, but a call, once begun, is
always valid; structured outputs (`text.format`) constrain the text when no call is forced.
One rule of the converter's output is tightened: its JSON string characters admit raw control
characters, which JSON forbids (llama.cpp's own C++ converter excludes them).

Why one module: the description, the envelope, the parser and the grammar are one convention;
a change to any of them is a change to all four, read together.
"""

from __future__ import annotations

import collections
import copy
import ctypes
import enum
import json
import threading
from collections.abc import Sequence
from typing import Any

import attrs
from rollout.protocol import Tool, ToolChoice, ToolChoiceAllowed

from ._chat import ChatTool, ChatToolset, OpenCall
from ._interfaces import (
    Finish,
    SampleEvent,
    TextDelta,
    TextEnd,
    TextStart,
)
from ._render import canonical_json

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "CALL_TRIGGER",
    "CONVENTION_VERSION",
    "MAX_CACHED_GRAMMARS",
    "MAX_HELD_WHITESPACE",
    "MAX_NAME_CHARS",
    "CallParser",
    "Grammar",
    "GrammarError",
    "call_text",
    "describe_tools",
    "grammar_for",
    "opens_call",
    "system_content",
]

# Bump when the text the model sees changes (tools description, envelope, output turns).
CONVENTION_VERSION = "toolconv-1"

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# After CALL_OPEN: the envelope up to the name, then from the name to the arguments' brace,
# then what closes it after the arguments.
_HEAD = '\n{"name": "'
_MID = ', "arguments": {'
_TAIL = "}\n" + CALL_CLOSE
_JSON_WHITESPACE = " \t\r\n"

# Names are at most 64 characters (function names), a namespace and its separator add as
# many: anything longer is not a call's name, and the block is passed on as text.
MAX_NAME_CHARS = 256
# Whitespace held back before any text (it may precede a call, and is then dropped) or after
# a call's arguments (before the envelope's end); past this many characters it is text.
MAX_HELD_WHITESPACE = 64
# Grammars built, by tools and choice: a client offers the same tools every turn, so the
# converter runs once per tool set; the cache is bounded for clients inventing new tools.
MAX_CACHED_GRAMMARS = 256

_TOOLS_HEADER = (
    "# Tools\n\n"
    "You can call the functions below. Each is described by a JSON schema, one per line "
    "inside <tools></tools>:\n<tools>\n"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\n"
    "To call one, answer with the call alone, written exactly like this:\n"
    f"{CALL_OPEN}\n"
    '{"name": "<the function\'s name>", "arguments": <its arguments, a JSON object>}\n'
    f"{CALL_CLOSE}\n"
    "Its result comes back in a message from the tool."
)


# --- what the model reads ------------------------------------------------------------------


def describe_tools(tools: Sequence[Tool]) -> str:
    """The tools section of the system turn ("" when no tool is callable)."""
    definitions = ChatToolset(tools, "auto").definitions
    if not definitions:
        return ""
    lines = "\n".join(canonical_json(d) for d in definitions)
    return f"{_TOOLS_HEADER}{lines}{_TOOLS_FOOTER}"


def system_content(instructions: str | None, tools: Sequence[Tool]) -> str:
    """The system turn's content: the instructions, then the tools ("" when neither)."""
    described = describe_tools(tools) if tools else ""
    if instructions and described:
        return f"{instructions}\n\n{described}"
    return instructions or described


def call_text(chat_name: str, arguments: str) -> str:
    """A call exactly as the model writes it (see the module docstring)."""
    name = json.dumps(chat_name, ensure_ascii=False)
    return f'{CALL_OPEN}\n{{"name": {name}, "arguments": {arguments}}}\n{CALL_CLOSE}'


def opens_call(piece: bytes) -> bool:
    """Whether a token whose text is `piece`, sampled while the output is still blank, starts
    writing the call envelope: its text after whitespace is a prefix of ``<tool_call>`` (``<``,
    ``<tool``) or begins with it."""
    text = piece.lstrip(_JSON_WHITESPACE.encode())
    opener = CALL_OPEN.encode()
    return bool(text) and (opener.startswith(text) or text.startswith(opener))


# --- parsing the model's output ------------------------------------------------------------


class _State(enum.Enum):
    TEXT = "text"  # text, or nothing yet
    HEAD = "head"  # after <tool_call>: the envelope up to the name
    NAME = "name"  # the function's name (a JSON string's characters)
    MID = "mid"  # after the name: up to the arguments' opening brace
    ARGS = "args"  # inside the arguments object
    TAIL = "tail"  # after the arguments: whitespace, then the envelope's end


class CallParser:
    """The model's output text -> sample events (see the module docstring).

    `feed(text, n_tokens)` takes the next piece of output and the number of tokens it came
    from (0 or more: a piece may be empty while the detokenizer waits for a character's last
    byte). Each delta carries the tokens fed since the previous delta (an envelope's opening
    tokens go to its first arguments delta); tokens after the last delta (an envelope's end,
    dropped whitespace) are counted only by `Finish.output_tokens`, which is every token fed.
    `finish(reason)` closes what is open and returns the last events, ending with `Finish`.

    Calls are parsed only when the toolset offers tools and `tool_choice` is not "none"
    (otherwise the output is all text). A name the request did not declare is passed on as a
    function call (as `OpenCall` does for a chat server's calls).
    """

    def __init__(self, toolset: ChatToolset | None, *, calls: bool | None = None) -> None:
        self.toolset = toolset
        if calls is None:
            calls = toolset is not None and bool(toolset.definitions) and toolset.choice != "none"
        self._parse_calls = calls
        self._state = _State.TEXT
        self._held = ""  # output not yet passed on (see `_State`)
        self._pos = 0  # characters of the current envelope literal matched
        self._name: list[str] = []
        self._name_escaped = False
        self._call: OpenCall | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._text_open = False
        self._pending = 0  # tokens fed that no event carries yet
        self._out: list[SampleEvent] = []
        self._finished = False
        self.tokens_fed = 0
        self.calls_closed = 0  # calls completed so far

    @property
    def parses_calls(self) -> bool:
        """Calls are parsed (else the output is all text)."""
        return self._parse_calls

    @property
    def in_call(self) -> bool:
        """A call has started (CallStart sent) and is not closed yet."""
        return self._call is not None

    def feed(self, text: str, n_tokens: int = 1) -> list[SampleEvent]:
        if self._finished:
            raise RuntimeError("CallParser.feed after finish()")
        self._pending += n_tokens
        self.tokens_fed += n_tokens
        if text:
            if self._parse_calls:
                self._consume(text)
            else:
                self._text(text)
        out, self._out = self._out, []
        return out

    def finish(
        self,
        reason: str = "stop",
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> list[SampleEvent]:
        """Close what is open and return the last events, the `Finish` included. `reason`
        is "stop" (the model ended its turn; "tool_calls" when its last item is a call) or
        "max_output_tokens" (cut off: an open text or call stays open, for the engine to
        close as incomplete). `output_tokens` defaults to the tokens fed."""
        if self._finished:
            raise RuntimeError("CallParser.finish called twice")
        self._finished = True
        cut = reason == "max_output_tokens"
        state = self._state
        if state in (_State.HEAD, _State.NAME, _State.MID):
            held, self._held = self._held, ""
            self._state = _State.TEXT
            self._text(held)
        elif state is _State.ARGS and not cut:
            # Ended inside the arguments (only without a grammar): closed as written.
            self._end_call()
        elif state is _State.TAIL:
            # The arguments are whole; only the envelope's end is missing or partial.
            held, self._held = self._held, ""
            brace = held.lstrip(_JSON_WHITESPACE)
            if brace and brace[0] == "}":
                self._args(held[: len(held) - len(brace)])
            self._end_call()
        if self._state is _State.TEXT and self._held:
            held, self._held = self._held, ""
            if self._text_open or held.strip() or not self.calls_closed:
                self._text(held)
        last_was_call = False
        if self._text_open and not cut:
            self._out.append(TextEnd())
            self._text_open = False
        elif self.calls_closed and not self._text_open and self._call is None:
            last_was_call = True
        final = "tool_calls" if reason == "stop" and last_was_call else reason
        self._out.append(
            Finish(
                final,  # type: ignore[arg-type]
                input_tokens=input_tokens,
                output_tokens=self.tokens_fed if output_tokens is None else output_tokens,
                cached_tokens=cached_tokens,
            )
        )
        out, self._out = self._out, []
        return out

    # --- states --------------------------------------------------------------------------

    def _consume(self, text: str) -> None:
        rest = text
        while rest:
            state = self._state
            if state is _State.TEXT:
                rest = self._in_text(rest)
            elif state is _State.HEAD:
                rest = self._literal(rest, _HEAD, _State.NAME)
            elif state is _State.NAME:
                rest = self._in_name(rest)
            elif state is _State.MID:
                rest = self._literal(rest, _MID, _State.ARGS)
            elif state is _State.ARGS:
                rest = self._in_args(rest)
            else:
                rest = self._in_tail(rest)

    def _in_text(self, text: str) -> str:
        buf = self._held + text
        self._held = ""
        at = buf.find(CALL_OPEN)
        if at >= 0:
            before = buf[:at]
            if self._text_open or before.strip():
                self._text(before)
                before = ""
            # The text item stays open until the call starts (a block that turns out not to
            # be a call continues it); whitespace alone before the block is held with it.
            self._state, self._pos = _State.HEAD, 0
            self._held = before + CALL_OPEN
            return buf[at + len(CALL_OPEN) :]
        # Hold back an ending that may still become CALL_OPEN.
        keep = len(buf)
        lt = buf.rfind("<", max(0, len(buf) - len(CALL_OPEN) + 1))
        if lt >= 0 and CALL_OPEN.startswith(buf[lt:]):
            keep = lt
        ready, hold = buf[:keep], buf[keep:]
        if not self._text_open and not ready.strip() and len(ready) <= MAX_HELD_WHITESPACE:
            hold = ready + hold  # whitespace alone so far: it may precede a call
            ready = ""
        self._held = hold
        if ready:
            self._text(ready)
        return ""

    def _literal(self, text: str, literal: str, then: _State) -> str:
        need = literal[self._pos :]
        take = text[: len(need)]
        if not need.startswith(take):
            return self._malformed(text)
        self._held += take
        self._pos += len(take)
        if self._pos < len(literal):
            return ""
        self._pos = 0
        if then is _State.ARGS:
            self._start_call()
        else:
            self._state = then
            self._name, self._name_escaped = [], False
        return text[len(take) :]

    def _in_name(self, text: str) -> str:
        for i, ch in enumerate(text):
            if self._name_escaped:
                self._name_escaped = False
            elif ch == "\\":
                self._name_escaped = True
            elif ch == '"':
                self._held += text[: i + 1]
                self._state, self._pos = _State.MID, 0
                return text[i + 1 :]
            elif ch == "\n" or len(self._name) >= MAX_NAME_CHARS:
                self._held += text[:i]
                return self._malformed(text[i:])
            self._name.append(ch)
        self._held += text
        return ""

    def _start_call(self) -> None:
        raw = "".join(self._name)
        try:
            name = json.loads(f'"{raw}"')
        except ValueError:
            name = None
        if not isinstance(name, str) or not name:
            self._malformed("")
            return
        self._held = ""  # the envelope, and whitespace before it: not text
        if self._text_open:
            self._out.append(TextEnd())
            self._text_open = False
        toolset = self.toolset
        self._call = OpenCall(toolset.find(name) if toolset is not None else None)
        self._out.append(self._call.start(name))
        self._state = _State.ARGS
        self._depth, self._in_string, self._escape = 1, False, False
        self._args("{")

    def _in_args(self, text: str) -> str:
        depth, in_string, escape = self._depth, self._in_string, self._escape
        end = -1
        for i, ch in enumerate(text):
            if in_string:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    end = i
                    break
        self._depth, self._in_string, self._escape = depth, in_string, escape
        if end < 0:
            self._args(text)
            return ""
        self._args(text[: end + 1])
        self._state, self._held = _State.TAIL, ""
        return text[end + 1 :]

    def _in_tail(self, text: str) -> str:
        for i, ch in enumerate(text):
            held = self._held
            brace = held.lstrip(_JSON_WHITESPACE)
            if not brace and ch in _JSON_WHITESPACE and len(held) < MAX_HELD_WHITESPACE:
                self._held += ch
                continue
            matched = len(brace)
            if ch != _TAIL[matched]:
                # Not the envelope's end: the call ends with its arguments, the rest is text.
                self._end_call()
                self._state = _State.TEXT
                return held + text[i:]
            self._held += ch
            if matched + 1 == len(_TAIL):
                self._args(held[: len(held) - len(brace)])  # whitespace the model left
                self._end_call()
                self._state = _State.TEXT
                return text[i + 1 :]
        return ""

    def _malformed(self, rest: str) -> str:
        """Not the envelope: what was held since CALL_OPEN is text, and so is what follows
        (scanned again for a call)."""
        held, self._held = self._held, ""
        self._state, self._pos = _State.TEXT, 0
        self._text(held)
        return rest

    # --- events --------------------------------------------------------------------------

    def _take_tokens(self) -> int:
        n, self._pending = self._pending, 0
        return n

    def _text(self, text: str) -> None:
        if not text:
            return
        if not self._text_open:
            self._out.append(TextStart())
            self._text_open = True
        self._out.append(TextDelta(text, self._take_tokens()))

    def _args(self, text: str) -> None:
        if not text or self._call is None:
            return
        delta = self._call.delta(text, self._take_tokens())
        if delta is not None:
            self._out.append(delta)

    def _end_call(self) -> None:
        if self._call is None:
            return
        self._out += self._call.end()
        self._call = None
        self.calls_closed += 1
        self._held = ""


# --- grammars --------------------------------------------------------------------------------


class GrammarError(ValueError):
    """llama.cpp refused a grammar."""


@attrs.frozen
class Grammar:
    """A llama.cpp GBNF grammar: its text, its root rule, and, for a lazy grammar, the
    patterns (regular expressions over the whole output so far, their first group marking
    where the grammar starts) that trigger it (`llama_sampler_init_grammar_lazy_patterns`)."""

    gbnf: str
    root: str = "root"
    triggers: tuple[str, ...] = ()

    @property
    def lazy(self) -> bool:
        return bool(self.triggers)

    def sampler(self, vocab: Any) -> Any:
        """A llama.cpp grammar sampler over `vocab` (a `LlamaVocab`, or a `llama_vocab_p`),
        owned by the caller (`llama_sampler_free`, or a sampler chain that takes it). Raises
        `GrammarError` when llama.cpp cannot parse the grammar."""
        import llama_cpp

        raw = getattr(vocab, "vocab", vocab)  # llama_cpp's LlamaVocab wraps the C pointer
        if self.triggers:
            patterns = (ctypes.c_char_p * len(self.triggers))(*(p.encode() for p in self.triggers))
            no_tokens = (llama_cpp.llama_token * 1)()
            sampler = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
                raw,
                self.gbnf.encode(),
                self.root.encode(),
                patterns,
                len(self.triggers),
                no_tokens,
                0,
            )
        else:
            sampler = llama_cpp.llama_sampler_init_grammar(
                raw, self.gbnf.encode(), self.root.encode()
            )
        if not sampler:
            raise GrammarError(f"llama.cpp rejected the grammar (root {self.root!r})")
        return sampler


# Where a lazy tool-call grammar starts: at the first CALL_OPEN (the group), wherever it is.
CALL_TRIGGER = r"[\s\S]*?(" + CALL_OPEN + r")[\s\S]*"
# The root rule's name (the converter names its rules after schemas and their properties).
_ROOT = "rollout-root"
# llama-cpp-python's port of the converter lets a JSON string hold raw control characters (its
# `char` rule is `[^"\\]`), which JSON forbids and `json.loads` rejects; llama.cpp's own C++
# converter excludes them. That one rule is tightened after conversion.
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'

_grammar_cache: collections.OrderedDict[str, Grammar | None] = collections.OrderedDict()
_grammar_lock = threading.Lock()


def _mode(tool_choice: ToolChoice) -> str:
    if isinstance(tool_choice, str):
        return tool_choice
    if isinstance(tool_choice, ToolChoiceAllowed):
        return tool_choice.mode
    return "required"  # a named function, custom, built-in or MCP tool


def grammar_for(
    toolset: ChatToolset,
    tool_choice: ToolChoice,
    *,
    parallel: bool,
    text_format: dict[str, Any] | None = None,
) -> Grammar | None:
    """The grammar for one turn (None: unconstrained). `toolset` is the request's tools
    under `tool_choice` (its offered subset, its forced tool).

    - required, a named tool, or `allowed_tools` in required mode: the whole output is one
      call of an allowed tool (the envelope, the name as a literal, the arguments per its
      schema).
    - auto: a lazy grammar from ``<tool_call>`` on (text before it is free); with a
      `text_format` of json_schema / json_object, an eager one: a call or the JSON text.
    - none (or nothing callable): the `text_format`'s grammar, else None.

    `parallel` does not change it: one call per turn (see the module docstring). A tool
    schema the converter cannot read falls back to any JSON object for that tool (the engine
    still validates the call).
    """
    del parallel  # one call per turn, always
    mode = _mode(tool_choice)
    offered: list[ChatTool] = []
    if mode != "none":
        forced = toolset.choice if isinstance(toolset.choice, dict) else None
        names = [d["function"]["name"] for d in toolset.definitions]
        if forced is not None:
            names = [n for n in names if n == forced["function"]["name"]]
        offered = [toolset.by_name[n] for n in names if n in toolset.by_name]
    fmt = text_format or {}
    text_schema: dict[str, Any] | None = None
    if fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        text_schema = schema if isinstance(schema, dict) else {"type": "object"}
    elif fmt.get("type") == "json_object":
        text_schema = {"type": "object"}
    if not offered:
        mode = "none"
    if mode == "none" and text_schema is None:
        return None
    key = canonical_json(
        {
            "mode": mode,
            "tools": [[t.chat_name, _parameters(t)] for t in offered],
            "text": text_schema,
        }
    )
    with _grammar_lock:
        if key in _grammar_cache:
            _grammar_cache.move_to_end(key)
            return _grammar_cache[key]
    grammar = _build(mode, offered, text_schema)
    with _grammar_lock:
        _grammar_cache[key] = grammar
        while len(_grammar_cache) > MAX_CACHED_GRAMMARS:
            _grammar_cache.popitem(last=False)
    return grammar


def _parameters(tool: ChatTool) -> Any:
    parameters = tool.definition()["function"].get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object"}


def _gbnf_literal(text: str) -> str:
    """A GBNF string literal of `text`."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _build(mode: str, offered: Sequence[ChatTool], text_schema: dict[str, Any] | None) -> Grammar:
    from llama_cpp.llama_grammar import SchemaConverter

    def converter() -> Any:
        return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)

    shared = converter()

    def visit(schema: Any, name: str) -> str:
        """The rule of `schema`, added to `shared` (and only when the converter reads all of
        it: it asserts on what it cannot read, leaving half-added rules behind)."""
        try:
            trial = converter()
            trial.visit(trial.resolve_refs(copy.deepcopy(schema), name), name)
        except Exception:  # a foreign converter's failure: fall back to any JSON object
            schema = {"type": "object"}
        return str(shared.visit(shared.resolve_refs(copy.deepcopy(schema), name), name))

    rules: list[str] = []
    alternatives: list[str] = []
    for i, tool in enumerate(offered):
        args = visit(_parameters(tool), f"tool-{i}-args")
        name = json.dumps(tool.chat_name, ensure_ascii=False)
        head = f'{CALL_OPEN}\n{{"name": {name}, "arguments": '
        rule = f"tool-{i}-call"  # the converter's own names are `tool-{i}-args...`
        rules.append(f"{rule} ::= {_gbnf_literal(head)} {args} {_gbnf_literal(_TAIL)}")
        alternatives.append(rule)
    if text_schema is not None:
        alternatives.append(visit(text_schema, "text"))
    rules.append(f"{_ROOT} ::= {' | '.join(alternatives)}")
    triggers = (CALL_TRIGGER,) if mode == "auto" and text_schema is None else ()
    converted = [
        _STRICT_CHAR + line[len(_LOOSE_CHAR) :] if line.startswith(_LOOSE_CHAR) else line
        for line in str(shared.format_grammar()).split("\n")
    ]
    return Grammar("\n".join([*converted, *rules]), _ROOT, triggers)
