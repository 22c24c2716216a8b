"""What the checks send: the tool, prompts and headers they use, and the request bodies and
client events built from them. The checks are model-agnostic: tool calls are forced with a named
`tool_choice`, and what a model says is never compared with a fixed text."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ._context import Context

__all__ = [
    "FORCE_WEATHER",
    "SDK_HEADERS",
    "TEXT_PROMPT",
    "TOOL_PROMPT",
    "WARMUP_INPUT",
    "WARMUP_INSTRUCTIONS",
    "WEATHER_TOOL",
    "append_event",
    "auto_body",
    "create",
    "outputs_for",
    "replay",
    "text_body",
    "tool_body",
    "tool_output",
    "unknown_id",
]

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name."}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORCE_WEATHER: dict[str, Any] = {"type": "function", "name": "get_weather"}
TEXT_PROMPT = "In one short sentence: what colour is the sky on a clear day?"
TOOL_PROMPT = "What is the weather in Paris right now?"
ROLLOUT_INSTRUCTIONS = (
    "Call get_weather exactly once for the city the user names, then answer in one short "
    "sentence using its result."
)
WARMUP_INSTRUCTIONS = "You are a concise assistant. Answer in one short sentence."
TOOL_RESULT = json.dumps({"city": "Paris", "temperature_c": 18, "sky": "clear"})
# Headers the official SDKs and Codex send on the upgrade besides Authorization.
SDK_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "application/json",
    "User-Agent": "OpenAI/Python 3.51.0",
    "X-Stainless-Lang": "python",
    "X-Stainless-Package-Version": "3.51.0",
    "X-Stainless-OS": "Linux",
    "X-Stainless-Arch": "x64",
    "X-Stainless-Runtime": "CPython",
    "X-Stainless-Runtime-Version": "3.12.0",
    "X-Stainless-Async": "async:asyncio",
    "OpenAI-Organization": "org-conformance",
    "OpenAI-Project": "proj_conformance",
    "OpenAI-Beta": "responses_websockets=2026-02-06",
}
# A connection left idle (with pings) this long must stay open (WS-1.5).
WARMUP_INPUT = [{"role": "user", "content": "I am planning a trip to Paris."}]


# --- requests --------------------------------------------------------------------------------


def unknown_id(prefix: str = "resp") -> str:
    return f"{prefix}_conformance_{secrets.token_hex(8)}"


def text_body(ctx: Context, **extra: Any) -> dict[str, Any]:
    return {"model": ctx.model, "input": TEXT_PROMPT, "store": False, **extra}


def tool_body(ctx: Context, **extra: Any) -> dict[str, Any]:
    return {
        "model": ctx.model,
        "input": TOOL_PROMPT,
        "tools": [WEATHER_TOOL],
        "tool_choice": FORCE_WEATHER,
        "store": False,
        **extra,
    }


def auto_body(ctx: Context, **extra: Any) -> dict[str, Any]:
    """A tool conversation the model finishes by itself: one call, then an answer."""
    return {
        "model": ctx.model,
        "instructions": ROLLOUT_INSTRUCTIONS,
        "input": TOOL_PROMPT,
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "store": False,
        **extra,
    }


def tool_output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": TOOL_RESULT}


def outputs_for(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [tool_output(str(c.get("call_id"))) for c in calls]


def replay(items: Sequence[Any]) -> list[dict[str, Any]]:
    """Output items as input for a stateless request: messages and calls, without the ids a
    server generated (reasoning items are dropped: they may need encrypted content)."""
    out = []
    for item in items:
        if isinstance(item, dict) and item.get("type") in ("message", "function_call"):
            out.append({k: v for k, v in item.items() if k not in ("id", "status")})
    return out


def append_event(response_id: str, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"type": "response.append", "response_id": response_id, "input": list(items)}


def create(ctx: Context, **extra: Any) -> dict[str, Any]:
    """A `response.create` client event with the text body (and `extra`)."""
    return {"type": "response.create", **text_body(ctx, **extra)}
