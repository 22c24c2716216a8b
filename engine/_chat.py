"""Chat Completions <-> Responses: the two conversions rollout needs to sit in front of, or
behind, an OpenAI-compatible `POST /v1/chat/completions` endpoint.

- `ChatEncoder` turns a conversation's items into chat messages, incrementally: it is kept in
  the conversation's lineage (`ItemsView.derived`), so a follow-up turn encodes only its new
  items; earlier messages stay encoded as JSON bytes and are only joined into the body.
- `ChatToolset` presents the offered tools as chat-completions function tools (chat servers
  know only functions): a custom tool as a function taking `{"input": "..."}` (its grammar, if
  any, quoted in the description: chat servers do not constrain to it), a client-run built-in
  tool (`shell`, `local_shell`, `apply_patch`, `computer`) as a function named by its kind
  whose arguments are the call's action or operation, a hosted tool the engine runs as a
  function taking `{"query": ...}`; and maps the calls back. Items with no chat form
  (reasoning, hosted tools' calls and results) are left out of the messages.
- `request_from_chat` / `ChatCompletionEmitter` serve chat completions from the engine: a chat
  request becomes a `ResponseCreate` (a leading system message becomes `instructions`, exactly
  the inverse of what the encoder does), and the response's events become a chat completion or
  its stream of chunks. The same conversation therefore renders the same context, and gives the
  same output, through both endpoints.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
from rollout.protocol import (
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
    RemoteProtocolError,
    ResponseCreate,
    ServerEvent,
    Tool,
    ToolChoice,
    ToolChoiceAllowed,
    call_of,
    encode_sse,
    from_wire,
    output_of,
)

from ._render import builtin_output_text, builtin_payload
from ._tools import CallTarget, callable_tools, resolve_choice

__all__ = [
    "ChatCompletionEmitter",
    "ChatEncoder",
    "ChatTool",
    "ChatToolset",
    "request_from_chat",
]

# Namespaced tools are flattened for chat servers, which know no namespaces.
NAMESPACE_SEPARATOR = "__"


def _json_text(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _dumps(obj: Any) -> bytes:
    return _json_text(obj).encode()


def tool_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def _chat_name(call: Any) -> str:
    """The function name a tool call item has in chat form."""
    if isinstance(call, FunctionCall | CustomToolCall):
        return tool_name(call.name, call.namespace)
    found = call_of(call)
    assert found is not None
    return found[2]


def _chat_arguments(call: Any) -> str:
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
    """

    __slots__ = ("_open_calls", "consumed", "messages")

    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.consumed = 0  # items encoded
        self._open_calls: list[dict[str, Any]] = []

    def extend(self, items: Sequence[Item], stop: int) -> int:
        """Encode items[self.consumed:stop]; returns how many messages were encoded."""
        before = len(self.messages) + len(self._open_calls)
        for index in range(self.consumed, stop):
            self._add(items[index])
        self.consumed = stop
        return len(self.messages) + len(self._open_calls) - before

    def _close_calls(self) -> None:
        if self._open_calls:
            self.messages.append(
                _dumps({"role": "assistant", "content": None, "tool_calls": self._open_calls})
            )
            self._open_calls = []

    def _add(self, item: Item) -> None:
        if call_of(item) is not None:
            self._open_calls.append(
                {
                    "id": call_of(item)[0],  # type: ignore[index]
                    "type": "function",
                    "function": {"name": _chat_name(item), "arguments": _chat_arguments(item)},
                }
            )
            return
        self._close_calls()
        answer = output_of(item)
        if isinstance(item, Message):
            role = "system" if item.role == "developer" else item.role
            if role == "assistant":
                text = item.content if isinstance(item.content, str) else _text_of(item.content)
                self.messages.append(_dumps({"role": "assistant", "content": text}))
            else:
                self.messages.append(_dumps({"role": role, "content": _chat_content(item.content)}))
        elif answer is not None:
            self.messages.append(
                _dumps({"role": "tool", "tool_call_id": answer[0], "content": _output_text(item)})
            )
        # Reasoning items and hosted tools' items have no chat form and are left out.

    def body_messages(self) -> list[bytes]:
        """The encoded messages so far, the open tool-call group included (not mutated)."""
        if not self._open_calls:
            return self.messages
        return [
            *self.messages,
            _dumps({"role": "assistant", "content": None, "tool_calls": self._open_calls}),
        ]


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


# --- serving chat completions from the engine --------------------------------------------------


def _bad(message: str, param: str, code: str = "invalid_value") -> RemoteProtocolError:
    return RemoteProtocolError.invalid(message, code=code, param=param)


def _from_wire(value: Any, cls: Any, where: str) -> Any:
    """`from_wire`, its error's param (and the name in its message) placed under `where`."""
    try:
        return from_wire(value, cls)
    except RemoteProtocolError as exc:
        param = exc.param
        if param is None:
            raise
        full = f"{where}.{param}"
        raise _bad(
            exc.body.message.replace(f"'{param}'", f"'{full}'"), full, exc.code or "invalid_value"
        ) from None


def _list(value: Any, where: str) -> list[Any]:
    """An optional array field (None -> empty)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(f"Invalid type for '{where}': expected an array.", where, "invalid_type")
    return value


def _text_content(content: Any, where: str) -> str:
    """The text of an assistant or tool message's content: a string or an array of parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(
            f"Invalid type for '{where}': expected a string or an array of content parts.",
            where,
            "invalid_type",
        )
    out: list[str] = []
    for j, part in enumerate(content):
        text = part.get("text", "") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise _bad(
                f"Invalid type for '{where}[{j}]': expected a text part.",
                f"{where}[{j}]",
                "invalid_type",
            )
        out.append(text)
    return "".join(out)


def _message_to_items(index: int, message: Any) -> list[Item]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(f"Invalid type for '{where}': expected an object.", where, "invalid_type")
    role = message.get("role")
    content = message.get("content")
    if role in ("user", "system", "developer"):
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "input_text", "text": part.get("text")})
                elif kind == "image_url":
                    image = part.get("image_url") or {}
                    if not isinstance(image, dict):
                        at = f"{where}.content[{j}].image_url"
                        raise _bad(
                            f"Invalid type for '{at}': expected an object.", at, "invalid_type"
                        )
                    parts.append(
                        {
                            "type": "input_image",
                            "image_url": image.get("url"),
                            "detail": image.get("detail") or "auto",
                        }
                    )
                elif kind == "file":
                    file = part.get("file") or {}
                    if not isinstance(file, dict):
                        at = f"{where}.content[{j}].file"
                        raise _bad(
                            f"Invalid type for '{at}': expected an object.", at, "invalid_type"
                        )
                    parts.append({"type": "input_file", **file})
                else:
                    raise _bad(f"Unsupported content part type {kind!r}.", f"{where}.content[{j}]")
            content = parts
        return [_from_wire({"type": "message", "role": role, "content": content}, Item, where)]
    if role == "assistant":
        items: list[Item] = []
        calls = _list(message.get("tool_calls"), f"{where}.tool_calls")
        if content is not None and (content != "" or not calls):
            text = _text_content(content, f"{where}.content")
            items.append(Message(role="assistant", content=[OutputText(text=text)]))
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(call.get("id"), str):
                raise _bad("A tool call needs an id and a function.", f"{where}.tool_calls[{j}]")
            items.append(
                FunctionCall(
                    call_id=call["id"],
                    name=str(function.get("name", "")),
                    arguments=str(function.get("arguments", "")),
                )
            )
        return items
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _bad(
                "Missing required parameter: 'tool_call_id'.",
                f"{where}.tool_call_id",
                "missing_required_parameter",
            )
        output = _text_content(content, f"{where}.content")
        return [FunctionCallOutput(call_id=call_id, output=output)]
    raise _bad(
        f"Invalid value: {role!r}. Supported values are: 'system', 'developer', 'user', "
        "'assistant' and 'tool'.",
        f"{where}.role",
    )


def request_from_chat(body: Any) -> ResponseCreate:
    """A chat-completions request as the equivalent Responses request."""
    if not isinstance(body, dict):
        raise _bad("The body must be a JSON object.", "body", "invalid_type")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("Missing required parameter: 'model'.", "model", "missing_required_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array.", "messages", "invalid_type")
    instructions = None
    start = 0
    first = messages[0]
    if isinstance(first, dict) and first.get("role") in ("system", "developer"):
        if isinstance(first.get("content"), str):
            instructions = first["content"]
            start = 1
    items: list[Item] = []
    for index in range(start, len(messages)):
        items.extend(_message_to_items(index, messages[index]))
    tools: list[Tool] = []
    for j, tool in enumerate(_list(body.get("tools"), "tools")):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise _bad("A tool needs a function.", f"tools[{j}]")
        tools.append(
            _from_wire(
                {
                    "type": "function",
                    **{
                        k: v
                        for k, v in function.items()
                        if k in ("name", "description", "parameters", "strict")
                    },
                },
                FunctionTool,
                f"tools[{j}].function",
            )
        )
    choice = body.get("tool_choice")
    tool_choice: Any = None
    if isinstance(choice, str):
        tool_choice = choice
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        tool_choice = {"type": "function", "name": choice["function"].get("name")}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    fields = {
        "model": model,
        "instructions": instructions,
        "input": [],
        "tools": tools or None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": max_tokens,
        "store": False,
    }
    wire = {k: v for k, v in fields.items() if v is not None and k not in ("input", "tools")}
    request: ResponseCreate = from_wire({"type": "response.create", **wire}, ResponseCreate)
    return attrs.evolve(request, input=items, tools=tools or None)


class ChatCompletionEmitter:
    """Turns a response's events into a chat completion (or its chunks, when streaming)."""

    def __init__(
        self,
        model: str,
        *,
        stream: bool,
        include_usage: bool,
        send_chunk: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> None:
        self.model = model
        self.stream = stream
        self.include_usage = include_usage
        self._send = send_chunk
        self.id = "chatcmpl-" + str(time.time_ns())
        self.created = int(time.time())
        self.text: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None
        self.error: dict[str, Any] | None = None
        self._sent_role = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return encode_sse(_json_text(body))

    async def _out(self, delta: dict[str, Any], finish: str | None = None) -> None:
        if self.stream and self._send is not None:
            if not self._sent_role:
                self._sent_role = True
                await self._send(self._chunk({"role": "assistant", "content": ""}))
            await self._send(self._chunk(delta, finish))

    async def __call__(self, event: ServerEvent) -> None:
        kind = event.type
        if kind == "response.output_text.delta":
            self.text.append(event.delta)  # type: ignore[union-attr]
            await self._out({"content": event.delta})  # type: ignore[union-attr]
        elif kind == "response.output_item.added":
            item = event.item  # type: ignore[union-attr]
            if isinstance(item, FunctionCall):
                call: dict[str, Any] = {
                    "index": len(self.calls),
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": tool_name(item.name, item.namespace), "arguments": ""},
                }
                self.calls.append(call)
                await self._out({"tool_calls": [call]})
        elif kind == "response.function_call_arguments.delta":
            delta: str = event.delta  # type: ignore[union-attr]
            last = self.calls[-1]
            function: dict[str, Any] = last["function"]
            function["arguments"] += delta
            await self._out(
                {"tool_calls": [{"index": last["index"], "function": {"arguments": delta}}]}
            )
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            response = event.response  # type: ignore[union-attr]
            if response.usage is not None:
                self.usage = {
                    "prompt_tokens": response.usage.input_tokens,
                    "completion_tokens": response.usage.output_tokens,
                    "total_tokens": response.usage.total_tokens,
                }
            if kind == "response.failed":
                error = response.error
                self.error = {
                    "message": error.message if error else "The response failed.",
                    "type": "server_error",
                    "param": None,
                    "code": error.code if error else "server_error",
                }
                return
            if kind == "response.incomplete":
                self.finish_reason = "length"
            else:
                self.finish_reason = "tool_calls" if self.calls else "stop"
            await self._out({}, self.finish_reason)
            if self.stream and self._send is not None and self.include_usage:
                body = {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": self.usage,
                }
                await self._send(encode_sse(_json_text(body)))

    def completion(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) or None}
        if self.calls:
            message["tool_calls"] = [
                {k: v for k, v in call.items() if k != "index"} for call in self.calls
            ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "message": message, "finish_reason": self.finish_reason or "stop"}
            ],
            "usage": self.usage,
        }
