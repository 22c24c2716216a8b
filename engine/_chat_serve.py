"""Serving chat completions from the engine (`POST /v1/chat/completions`): a chat request
becomes a `ResponseCreate` (a leading system message becomes `instructions`, exactly the inverse
of what `ChatEncoder` does), and the response's events become a chat completion or its stream
of chunks. The same conversation therefore renders the same context, and gives the same
output, through both endpoints.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
from rollout.protocol import (
    RESPONSE_END_TYPES,
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Item,
    Message,
    OutputText,
    RemoteProtocolError,
    ResponseCreate,
    ServerEvent,
    Tool,
    from_wire,
    response_of,
)

from ._chat import dumps_json, tool_name

__all__ = ["ChatCompletionEmitter", "request_from_chat"]


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
    """Turns a response's events into a chat completion (or its chunks, when streaming: each
    chunk's JSON goes to `send_chunk`, which frames it for its transport)."""

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
        return dumps_json(body)

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
        elif kind in RESPONSE_END_TYPES and (response := response_of(event)) is not None:
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
                await self._send(dumps_json(body))

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
