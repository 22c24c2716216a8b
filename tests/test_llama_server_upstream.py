"""rollout in front of a real model server as users run it: llama-cpp-python's own
OpenAI-compatible server (`python -m llama_cpp.server`, its `[server]` extra) with the packaged
SmolLM2-135M-Instruct, unchanged, as a chat-completions upstream; an 8-turn tool loop (seven
forced calls, then the answer) over HTTP and over WebSocket, greedy.

Before, the loop failed at its second turn: rollout sent the tool-call message with
`"content": null`, which this server refuses (HTTP 500, pydantic errors).

One thing is changed around the server, not in it: the model's weights are kept out of AMX
buffers (`rollout.bench._llama_server`, which the benchmark's `real-model-batch` scenario runs
too)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio
from rollout.bench._llama_server import llama_server_missing, open_llama_server

from tests.client_harness import unavailable
from tests.llama_harness import require_llama
from tests.server_harness import open_ws
from tests.upstream_harness import gateway_registry, open_rollout

LOOP_LIMIT = 300.0
TURNS = 8  # seven forced calls, then the answer
TOOL = {
    "type": "function",
    "name": "run",
    "description": "Run a shell command in the project and return its output.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string", "maxLength": 24}},
        "required": ["command"],
    },
}


@asynccontextmanager
async def llama_server() -> AsyncIterator[str]:
    """The server with the packaged model as `smol` (`rollout.bench._llama_server`: the weights
    kept in plain CPU buffers, see the module's docstring)."""
    require_llama()
    missing = llama_server_missing()
    if missing is not None:
        unavailable(missing)
    from rollout.engine._llama_vocab import packaged_smollm2

    model = packaged_smollm2()
    assert model is not None
    async with open_llama_server(model, alias="smol", threads=2, n_ctx=4096) as url:
        yield url


def _body(turn: int) -> dict[str, Any]:
    choice: Any = {"type": "function", "name": "run"} if turn < TURNS - 1 else "none"
    return {
        "model": "smol",
        "instructions": "You are a coding agent. Use the run tool to inspect the project.",
        "tools": [TOOL],
        "tool_choice": choice,
        "temperature": 0,
        "max_output_tokens": 64,
    }


def _next_input(response: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """Checks the turn's output; the input of the next turn (the call's output)."""
    assert response["status"] == "completed", (turn, response.get("error"), response["status"])
    kinds = [item["type"] for item in response["output"]]
    if turn == TURNS - 1:  # told not to call: no call (SmolLM2 answers with nothing here)
        assert "function_call" not in kinds, kinds
        return []
    (call,) = [item for item in response["output"] if item["type"] == "function_call"]
    assert call["name"] == "run" and isinstance(json.loads(call["arguments"]), dict), call
    listing = f"src/ tests/ README.md (step {turn})"
    return [{"type": "function_call_output", "call_id": call["call_id"], "output": listing}]


async def test_a_tool_loop_over_http_through_llama_cpp_server() -> None:
    async with llama_server() as upstream:
        with trio.fail_after(LOOP_LIMIT):
            registry = gateway_registry(upstream, name="smol", model="smol", retries=0)
            async with open_rollout(registry=registry) as url:
                async with httpx.AsyncClient(timeout=120) as client:
                    new: list[dict[str, Any]] = [
                        {"type": "message", "role": "user", "content": "List the project."}
                    ]
                    previous = None
                    for turn in range(TURNS):
                        body = {**_body(turn), "input": new, "previous_response_id": previous}
                        response = (await client.post(f"{url}/responses", json=body)).json()
                        new, previous = _next_input(response, turn), response["id"]


async def test_a_tool_loop_over_websocket_through_llama_cpp_server() -> None:
    async with llama_server() as upstream:
        with trio.fail_after(LOOP_LIMIT):
            registry = gateway_registry(upstream, name="smol", model="smol", retries=0)
            async with open_rollout(registry=registry) as url, open_ws(url) as ws:
                new: list[dict[str, Any]] = [
                    {"type": "message", "role": "user", "content": "List the project."}
                ]
                previous = None
                for turn in range(TURNS):
                    fields = {**_body(turn), "input": new, "previous_response_id": previous}
                    events = await ws.create(**fields)
                    response = ws.raw[-1]["response"]
                    assert events[-1].type == "response.completed", ws.raw[-1]
                    new, previous = _next_input(response, turn), response["id"]
