"""Chat Completions <-> Responses: the two conversions rollout needs to sit in front of, or
behind, an OpenAI-compatible `POST /v1/chat/completions` endpoint.

Long because both directions of the conversion are here, with the tool-call bookkeeping chat
servers need (names, arguments, call ids).

- `ChatEncoder` turns a conversation's items into chat messages, incrementally: it is kept in
  the conversation's lineage (`SampleRequest.derived`), so a follow-up turn encodes only its new
  items; earlier messages stay encoded as JSON bytes and are only joined into the body.
- `ChatToolset` presents the offered tools as chat-completions function tools (chat servers
  know only functions): a custom tool as a function taking `{"input": "..."}` (its grammar, if
  any, quoted in the description: chat servers do not constrain to it), a client-run built-in
  tool (`shell`, `local_shell`, `apply_patch`, `computer`) as a function named by its kind
  whose arguments are the call's action or operation, a hosted tool the engine runs as a
  function taking `{"query": ...}`; and maps the calls back. Items with no chat form
  (reasoning, hosted tools' calls and results) are left out of the messages.
- Serving chat completions from the engine (the other direction) is `_chat_serve.py`.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Sequence
from typing import Any

import attrs
from rollout.protocol import (
    CallKind,
    ComputerCallOutput,
    ContentPart,
    CustomTool,
    CustomToolCall,
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    InputFile,
    InputImage,
    InputText,
    Item,
    Message,
    OutputText,
    Refusal,
    Tool,
    ToolChoice,
    ToolChoiceAllowed,
    call_of,
    output_of,
)

from ._interfaces import ArgsDelta, CallEnd, CallStart, SampleEvent
from ._render import builtin_output_text, builtin_payload
from ._tools import CallTarget, callable_tools, resolve_choice

__all__ = [
    "NAMESPACE_SEPARATOR",
    "ChatEncoder",
    "ChatTool",
    "ChatToolset",
    "OpenCall",
    "chat_arguments",
    "chat_name",
    "dumps_json",
    "tool_name",
]

# Namespaced tools are flattened for chat servers, which know no namespaces.
NAMESPACE_SEPARATOR = "__"


def dumps_json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def tool_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def chat_name(call: Any) -> str:
    """The function name a tool call item has in chat form."""
    if isinstance(call, FunctionCall | CustomToolCall):
        return tool_name(call.name, call.namespace)
    found = call_of(call)
    assert found is not None
    return found[2]


def chat_arguments(call: Any) -> str:
    """The arguments a tool call item has in chat form (a custom tool's input wrapped as
    `{"input": ...}`, a built-in call's action or operation)."""
    if isinstance(call, FunctionCall):
        return call.arguments
    if isinstance(call, CustomToolCall):
        return json.dumps({"input": call.input}, ensure_ascii=False)
    payload = builtin_payload(call)
    assert payload is not None
    return payload


def _output_text(item: Any) -> Any:
    """A tool output's content in chat form (a string, or parts for function outputs)."""
    if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
        return item.output if isinstance(item.output, str) else _chat_content(item.output)
    if isinstance(item, ComputerCallOutput):
        return "[screenshot]"
    return builtin_output_text(item) or ""


def _text_of(parts: Sequence[ContentPart]) -> str:
    out = []
    for part in parts:
        if isinstance(part, InputText | OutputText):
            out.append(part.text)
        elif isinstance(part, Refusal):
            out.append(part.refusal)
    return "".join(out)


def _chat_content(content: str | Sequence[ContentPart]) -> Any:
    """A string when all parts are text (the widest compatibility), else an array of parts."""
    if isinstance(content, str):
        return content
    if all(isinstance(p, InputText | OutputText | Refusal) for p in content):
        return _text_of(content)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, InputText | OutputText):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, InputImage):
            url = part.image_url or f"file:{part.file_id}"
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": part.detail}})
        elif isinstance(part, InputFile):
            file: dict[str, Any] = {}
            if part.file_data is not None:
                file["file_data"] = part.file_data
            if part.file_id is not None:
                file["file_id"] = part.file_id
            if part.filename is not None:
                file["filename"] = part.filename
            parts.append({"type": "file", "file": file})
    return parts


class ChatEncoder:
    """Chat messages of a conversation, encoded once per item.

    Consecutive function calls form one assistant message with `tool_calls`; that message stays
    open (its calls kept as dicts) until the next item that is not a function call closes it.

    The closed messages are also kept joined by commas, as a few segments of decreasing size
    (each more than twice the next; a new turn's messages become a segment and merge down):
    a request body is those segments as they are (`body_chunks`), so a turn copies what is new
    and, now and then, a merge, not the conversation (each byte is copied O(log n) times over
    a conversation's life). `bytes_encoded` counts the JSON this encoder produced: each
    message once, the open group each time it is asked for.
    """

    __slots__ = ("_joined", "_open_calls", "_rope", "bytes_encoded", "consumed", "messages")

    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.consumed = 0  # items encoded
        self.bytes_encoded = 0
        self._open_calls: list[dict[str, Any]] = []
        self._rope: list[bytes] = []  # the closed messages, joined by commas, in segments
        self._joined = 0  # messages in the rope

    def extend(self, items: Sequence[Item], stop: int) -> int:
        """Encode items[self.consumed:stop]; returns how many messages were encoded."""
        before = len(self.messages) + len(self._open_calls)
        for index in range(self.consumed, stop):
            self._add(items[index])
        self.consumed = stop
        return len(self.messages) + len(self._open_calls) - before

    def _close_calls(self) -> None:
        if self._open_calls:
            self._append(_calls_message(self._open_calls))
            self._open_calls = []

    def _append(self, message: bytes) -> None:
        self.messages.append(message)
        self.bytes_encoded += len(message)

    def _add(self, item: Item) -> None:
        if call_of(item) is not None:
            self._open_calls.append(
                {
                    "id": call_of(item)[0],  # type: ignore[index]
                    "type": "function",
                    "function": {"name": chat_name(item), "arguments": chat_arguments(item)},
                }
            )
            return
        self._close_calls()
        answer = output_of(item)
        if isinstance(item, Message):
            role = "system" if item.role == "developer" else item.role
            if role == "assistant":
                text = item.content if isinstance(item.content, str) else _text_of(item.content)
                self._append(dumps_json({"role": "assistant", "content": text}))
            else:
                self._append(dumps_json({"role": role, "content": _chat_content(item.content)}))
        elif answer is not None:
            self._append(
                dumps_json(
                    {"role": "tool", "tool_call_id": answer[0], "content": _output_text(item)}
                )
            )
        # Reasoning items and hosted tools' items have no chat form and are left out.

    def body_messages(self) -> list[bytes]:
        """The encoded messages so far, the open tool-call group included (not mutated)."""
        if not self._open_calls:
            return self.messages
        group = _calls_message(self._open_calls)
        self.bytes_encoded += len(group)
        return [*self.messages, group]

    def body_chunks(self) -> list[bytes]:
        """The messages so far, the open tool-call group included, joined by commas (no
        brackets), as a few chunks whose concatenation is `b",".join(body_messages())`."""
        fresh = self.messages[self._joined :]
        if fresh:
            segment = b",".join(fresh)
            self._rope.append(b"," + segment if self._rope else segment)
            self._joined = len(self.messages)
            rope = self._rope
            while len(rope) > 1 and len(rope[-2]) <= 2 * len(rope[-1]):
                last = rope.pop()
                rope[-1] += last
        chunks = list(self._rope)
        if self._open_calls:
            group = _calls_message(self._open_calls)
            self.bytes_encoded += len(group)
            chunks.append(b"," + group if chunks else group)
        return chunks


def _calls_message(calls: list[dict[str, Any]]) -> bytes:
    """An assistant message of tool calls, with empty text: the form every server takes.
    llama-cpp-python's server refuses `"content": null` (HTTP 500, validation errors), and a
    message without `content` breaks chat templates that concatenate it (SmolLM2's, through
    that server: the stream ends mid-answer); OpenAI, vLLM and llama.cpp's `llama-server`
    accept the empty string."""
    return dumps_json({"role": "assistant", "content": "", "tool_calls": calls})


# The arguments a client-run built-in tool takes in function form: its action or operation.
_STRINGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
BUILTIN_FUNCTION_SCHEMAS: dict[str, dict[str, Any]] = {
    "shell": {
        "type": "object",
        "properties": {
            "commands": _STRINGS,
            "timeout_ms": {"type": "integer"},
            "max_output_length": {"type": "integer"},
        },
        "required": ["commands"],
    },
    "local_shell": {
        "type": "object",
        "properties": {
            "command": _STRINGS,
            "env": {"type": "object", "additionalProperties": {"type": "string"}},
            "timeout_ms": {"type": "integer"},
            "working_directory": {"type": "string"},
            "user": {"type": "string"},
        },
        "required": ["command"],
    },
    "apply_patch": {
        "type": "object",
        "properties": {
            "type": {"enum": ["create_file", "update_file", "delete_file"]},
            "path": {"type": "string"},
            "diff": {"type": "string", "description": "A V4A diff (not for delete_file)."},
        },
        "required": ["type", "path"],
    },
    "computer": {
        "type": "object",
        "properties": {
            "type": {
                "enum": [
                    "click",
                    "double_click",
                    "drag",
                    "keypress",
                    "move",
                    "screenshot",
                    "scroll",
                    "type",
                    "wait",
                ]
            },
            "x": {"type": "integer"},
            "y": {"type": "integer"},
            "button": {"type": "string"},
            "keys": _STRINGS,
            "text": {"type": "string"},
            "scroll_x": {"type": "integer"},
            "scroll_y": {"type": "integer"},
            "path": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["type"],
    },
}
_BUILTIN_DESCRIPTIONS = {
    "shell": "Run shell commands on the user's machine.",
    "local_shell": "Run a command on the user's machine.",
    "apply_patch": "Create, update or delete a file with a patch.",
    "computer": "Act on the user's screen (or take a screenshot).",
}
_HOSTED_QUERY = {
    "type": "object",
    "properties": {"query": {"type": "string"}},
    "required": ["query"],
}
_CUSTOM_INPUT = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}


@attrs.frozen
class ChatTool:
    """A tool as a chat server sees it, and the call it stands for."""

    chat_name: str
    call: CallTarget

    def definition(self) -> dict[str, Any]:
        tool = self.call.tool
        function: dict[str, Any] = {"name": self.chat_name}
        if isinstance(tool, FunctionTool):
            if tool.description is not None:
                function["description"] = tool.description
            if tool.parameters is not None:
                function["parameters"] = tool.parameters
            if tool.strict is not None:
                function["strict"] = tool.strict
        elif isinstance(tool, CustomTool):
            description = tool.description or ""
            fmt = tool.format
            if fmt is not None and fmt.type == "grammar":
                description += (
                    f"\nThe input must match this {fmt.syntax} grammar:\n{fmt.definition}"
                )
            if description:
                function["description"] = description.strip()
            function["parameters"] = _CUSTOM_INPUT
        elif self.call.kind in BUILTIN_FUNCTION_SCHEMAS:
            function["description"] = _BUILTIN_DESCRIPTIONS[self.call.kind]
            function["parameters"] = BUILTIN_FUNCTION_SCHEMAS[self.call.kind]
        else:  # a hosted tool the engine runs (an executor is configured)
            function["description"] = f"The hosted {self.call.kind} tool."
            function["parameters"] = _HOSTED_QUERY
        return {"type": "function", "function": function}


class ChatToolset:
    """The offered tools in function form, under `tool_choice`; and the way back from a chat
    tool call to the call it stands for."""

    def __init__(self, tools: Sequence[Tool], choice: ToolChoice) -> None:
        every = callable_tools(tools)
        self.tools = [ChatTool(self._name(c), c) for c in every]
        self.by_name = {t.chat_name: t for t in self.tools}
        offered = self.tools
        self.choice: Any = choice
        if isinstance(choice, ToolChoiceAllowed):  # only the allowed ones, in their mode
            allowed = {id(c.tool) for c in resolve_choice(choice, tools).tools}
            offered = [t for t in self.tools if id(t.call.tool) in allowed]
            self.choice = choice.mode
        elif not isinstance(choice, str):  # one forced tool
            forced = resolve_choice(choice, tools).tools
            chosen = [t for t in self.tools if forced and t.call.tool is forced[0].tool]
            self.choice = (
                {"type": "function", "function": {"name": chosen[0].chat_name}}
                if chosen
                else "required"
            )
        self.definitions = [t.definition() for t in offered]

    @staticmethod
    def _name(call: CallTarget) -> str:
        if call.kind in ("function", "custom"):
            return tool_name(call.name, call.namespace)
        return call.kind

    def find(self, chat_name: str) -> ChatTool | None:
        return self.by_name.get(chat_name)


class OpenCall:
    """A tool call being received in chat form (a chat stream's `tool_calls` deltas, or a
    model's own call convention, `_toolconv`): custom tools' input arrives wrapped in JSON
    (`{"input": ...}`) and is unwrapped when the call ends."""

    def __init__(self, tool: ChatTool | None) -> None:
        self.tool = tool
        self.buffered: list[str] | None = (
            [] if tool is not None and tool.call.kind == "custom" else None
        )
        self.buffered_tokens = 0

    def start(self, chat_name: str) -> CallStart:
        if self.tool is None:  # a name the request did not declare: passed on as a function
            head, sep, tail = chat_name.partition(NAMESPACE_SEPARATOR)
            return CallStart(tail, head) if sep else CallStart(chat_name)
        call = self.tool.call
        return CallStart(call.name, call.namespace, typing.cast(CallKind, call.kind))

    def delta(self, text: str, n_tokens: int = 1) -> ArgsDelta | None:
        if self.buffered is None:
            return ArgsDelta(text, n_tokens)
        self.buffered.append(text)
        self.buffered_tokens += n_tokens
        return None

    def end(self) -> list[SampleEvent]:
        if self.buffered is None:
            return [CallEnd()]
        raw = "".join(self.buffered)
        try:
            wrapped = json.loads(raw)
            text = wrapped["input"] if isinstance(wrapped, dict) else raw
        except (ValueError, KeyError):
            text = raw
        return [ArgsDelta(str(text), self.buffered_tokens), CallEnd()]
