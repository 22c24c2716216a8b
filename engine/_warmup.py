"""Warming a server up before it says it is serving: the first request costs what every
later one does.

Much of a request's path is built on its first use in a process: cattrs generates and compiles
the (un)structure function of each wire type the first time it meets it, jsonschema builds a
tool schema's validator class, the classifiers and the chat template compile their patterns.
Left lazy, that lands on the first client: ~20 ms on its first response against ~4 ms for the
next. `warm_up()` sends a few requests through the whole app in memory (no socket): an HTTP
create with a function tool and its continuation streamed as server-sent events, a chat
completion, and a WebSocket connection running a rollout-extension response (suspended at its
call, resumed by an append) and a `previous_response_id` continuation.

The requests go to a throwaway engine of their own (the built-in `sim` model, an in-memory
store and ledger, its own render cache and counters): nothing reaches the server's store,
usage ledger, render cache or metrics, and no upstream model is called. What they warm is
process-wide, so a process warms up once (`warm_up_needed`): its later servers start at once.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import trio
from rollout.protocol import TERMINAL_EVENT_TYPES

from ._app import AppConfig, RolloutApp
from ._asgi import Message
from ._engine import open_engine
from ._ledger import MemoryUsageLedger
from ._memory import MemoryResponseStore
from ._render_cache import RenderCache

__all__ = ["WARM_UP_LIMIT", "WarmUpError", "warm_up", "warm_up_needed"]

# The warm-up's deadline: it takes ~50 ms on a quiet machine; past this, something is wrong.
WARM_UP_LIMIT = 30.0

_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]
# Where a warm-up step's wait ends: the response's end, an error, or a suspension.
_TERMINAL = TERMINAL_EVENT_TYPES | {"response.done"}


class WarmUpError(Exception):
    """A warm-up request did not end as it should: a bug, reported (the server still starts)."""


_warmed = False  # a warm-up completed in this process


def warm_up_needed() -> bool:
    """Whether no warm-up has completed in this process yet."""
    return not _warmed


async def warm_up() -> None:
    """Run the warm-up requests (see the module docstring); `WarmUpError` if one fails."""
    with trio.fail_after(WARM_UP_LIMIT):
        async with open_engine(
            store=MemoryResponseStore(),
            ledger=MemoryUsageLedger(),
            render_cache=RenderCache(max_bytes=1 << 20),
        ) as engine:
            app = RolloutApp(engine, AppConfig(access_log=False))
            first = await _http(app, "/v1/responses", {"input": "Weather in Oslo?"})
            (call,) = first["output"]
            follow_up = {
                "previous_response_id": first["id"],
                "input": [_output(call["call_id"])],
                "stream": True,
            }
            await _http(app, "/v1/responses", follow_up)
            chat = {"model": "sim", "messages": [{"role": "user", "content": "Hi"}]}
            await _http(app, "/v1/chat/completions", chat)
            await _websocket(app)
    global _warmed
    _warmed = True


def _output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "sunny"}


async def _http(app: RolloutApp, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST `body` (a create with the warm-up's model and tools, unless it is a chat
    completion); the response's JSON, or `{}` for a stream. Anything but a 200 is an error."""
    if "messages" not in body:
        body = {"model": "sim:steps=1", "tools": _TOOLS, "store": True, **body}
    inbox = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[Message] = []
    done = trio.Event()

    async def receive() -> Message:
        if inbox:
            return inbox.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": []}
    await app(scope, receive, send)
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    if not sent or sent[0]["status"] != 200:
        raise WarmUpError(f"POST {path}: {sent[0]['status'] if sent else 'nothing'} {payload!r}")
    if body.get("stream"):
        if b"response.completed" not in payload:
            raise WarmUpError(f"POST {path}: the stream did not complete: {payload[-300:]!r}")
        return {}
    answer: dict[str, Any] = json.loads(payload)
    return answer


async def _websocket(app: RolloutApp) -> None:
    """One connection: a rollout that suspends at its call and is resumed with an append,
    then a continuation of it; each next frame is sent once the last one's terminal event
    arrived."""
    create = {"type": "response.create", "model": "sim:steps=1", "tools": _TOOLS}
    steps: list[Callable[[dict[str, Any]], dict[str, Any]]] = [
        lambda _: {**create, "input": "Weather in Rome?", "rollout": True},
        lambda done: {
            "type": "response.append",
            "response_id": done["response"]["id"],
            "input": [_output(call_id) for call_id in done["pending_call_ids"]],
        },
        lambda completed: {
            **create,
            "input": "And tomorrow?",
            "previous_response_id": completed["response"]["id"],
            "store": False,
        },
    ]
    expected = ["response.done", "response.completed", "response.completed"]
    seen: list[str] = []
    inbox_send, inbox = trio.open_memory_channel[Message](math.inf)
    inbox_send.send_nowait({"type": "websocket.connect"})
    inbox_send.send_nowait({"type": "websocket.receive", "text": json.dumps(steps[0]({}))})

    async def send(message: Message) -> None:
        if message["type"] != "websocket.send":
            return
        event = json.loads(message["text"])
        if event["type"] not in _TERMINAL:
            return
        seen.append(event["type"])
        if len(seen) < len(steps) and event["type"] == expected[len(seen) - 1]:
            frame = json.dumps(steps[len(seen)](event))
            inbox_send.send_nowait({"type": "websocket.receive", "text": frame})
        else:
            inbox_send.send_nowait({"type": "websocket.disconnect", "code": 1000})

    scope = {"type": "websocket", "path": "/v1/responses", "headers": [], "query_string": b""}
    await app(scope, inbox.receive, send)
    if seen != expected:
        raise WarmUpError(f"WebSocket: terminal events {seen}, expected {expected}")
