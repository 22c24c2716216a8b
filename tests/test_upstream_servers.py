"""The chat-completions upstream as real model servers are: rollout in front of a server that
takes messages as llama-cpp-python's `python -m llama_cpp.server` does (an assistant message's
`content` must be a string: null is HTTP 500 with its pydantic errors, and a missing one breaks
SmolLM2's chat template, which concatenates it: here, a 500 too), driven through a tool loop
over HTTP and WebSocket.

Before, rollout sent the tool-call message with `"content": null`, and every tool loop failed
at its second turn (`response.failed` after the retries)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from tests.server_harness import open_ws
from tests.upstream_harness import (
    Exchange,
    chunk,
    gateway_registry,
    open_fake_upstream,
    open_rollout,
    text_chunks,
)

DEADLINE = 30.0
TOOL = {
    "type": "function",
    "name": "run",
    "description": "Run a shell command.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
CALLS = 2  # tool calls before the answer


def _refusal(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama-cpp-python's validation errors for what it refuses (a null `content` of an
    assistant message), one per message type the union tried, as its server reports them."""
    return [
        {
            "type": "string_type",
            "loc": ["body", "messages", i, kind, "content"],
            "msg": "Input should be a valid string",
            "input": None,
        }
        for i, m in enumerate(messages)
        if m.get("role") == "assistant" and not isinstance(m.get("content"), str)
        for kind in ("ChatCompletionRequestAssistantMessage", "ChatCompletionRequestUserMessage")
    ]


async def strict_model(exchange: Exchange) -> None:
    """Calls `run` until it has CALLS tool results, then answers; refuses null content."""
    messages = exchange.body["messages"]
    errors = _refusal(messages)
    if errors:
        await exchange.json(500, {"detail": errors})
        return
    done = sum(1 for m in messages if m["role"] == "tool")
    if done >= CALLS:
        await exchange.stream(text_chunks(["All ", "done."]))
        return
    call = {"index": 0, "id": f"call_{done}", "type": "function"}
    arguments = json.dumps({"command": f"step {done}"})
    await exchange.stream(
        [
            chunk(tool_calls=[{**call, "function": {"name": "run", "arguments": arguments}}]),
            chunk(finish="tool_calls"),
            chunk(usage={"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}),
        ]
    )


async def test_a_tool_loop_over_http_against_a_server_refusing_null_content() -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(strict_model) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url, name="strict", retries=0)
            async with open_rollout(registry=registry) as url, httpx.AsyncClient() as client:
                body: dict[str, Any] = {"model": "strict", "tools": [TOOL], "input": "Go."}
                for turn in range(CALLS + 1):
                    response = (await client.post(f"{url}/responses", json=body)).json()
                    assert response["status"] == "completed", response
                    calls = [o for o in response["output"] if o["type"] == "function_call"]
                    if turn == CALLS:
                        assert calls == [] and response["output"][0]["type"] == "message"
                        break
                    assert len(calls) == 1, response
                    body = {
                        "model": "strict",
                        "tools": [TOOL],
                        "previous_response_id": response["id"],
                        "input": [
                            {
                                "type": "function_call_output",
                                "call_id": calls[0]["call_id"],
                                "output": "ok",
                            }
                        ],
                    }
    assert upstream.hits == CALLS + 1
    last = upstream.bodies[-1]["messages"]
    assert [m["role"] for m in last] == ["user", "assistant", "tool", "assistant", "tool"]
    assert all(m["content"] == "" for m in last if m["role"] == "assistant")


async def test_a_rollout_over_websocket_against_a_server_refusing_null_content() -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(strict_model) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url, name="strict", retries=0)
            async with open_rollout(registry=registry) as url, open_ws(url) as ws:
                events = await ws.create(model="strict", tools=[TOOL], input="Go.", rollout=True)
                for _ in range(CALLS):
                    done = events[-1]
                    assert done.type == "response.done", done
                    (call_id,) = done.pending_call_ids
                    output = {"type": "function_call_output", "call_id": call_id, "output": "ok"}
                    events = await ws.append(done.response.id, [output])
                assert events[-1].type == "response.completed", events[-1]
    assert upstream.hits == CALLS + 1
    last = upstream.bodies[-1]["messages"]
    assert all(m["content"] == "" for m in last if m["role"] == "assistant")


# --- a call cut short, or malformed: never a completed response -----------------------------

CUT = '{"command": "ls -la sr'  # the arguments as a length limit leaves them


def call_model(arguments: str, finish: str, completion_tokens: int) -> Any:
    async def handler(exchange: Exchange) -> None:
        call = {"index": 0, "id": "call_cut", "type": "function"}
        usage = {"prompt_tokens": 9, "completion_tokens": completion_tokens}
        usage["total_tokens"] = 9 + completion_tokens
        await exchange.stream(
            [
                chunk(tool_calls=[{**call, "function": {"name": "run", "arguments": arguments}}]),
                chunk(finish=finish),
                chunk(usage=usage),
            ]
        )

    return handler


@pytest.mark.parametrize(
    ("arguments", "finish", "produced", "status", "reason"),
    [
        # llama-cpp-python names the finish "tool_calls" even when max_tokens cut the call
        (CUT, "tool_calls", 16, "incomplete", "max_output_tokens"),
        (CUT, "length", 16, "incomplete", "max_output_tokens"),
        # malformed, and not by the limit: the documented failure, not a call to run
        (CUT, "tool_calls", 9, "failed", None),
        ('{"command": "ls"}', "tool_calls", 16, "completed", None),
    ],
)
async def test_a_call_whose_arguments_are_not_json_does_not_complete(
    arguments: str, finish: str, produced: int, status: str, reason: str | None
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(call_model(arguments, finish, produced)) as (up, _):
            registry = gateway_registry(up, name="cut", retries=0)
            async with open_rollout(registry=registry) as url, httpx.AsyncClient() as client:
                body = {"model": "cut", "tools": [TOOL], "input": "Go.", "max_output_tokens": 16}
                response = (await client.post(f"{url}/responses", json=body)).json()
    assert response["status"] == status, response
    if status == "incomplete":
        assert response["incomplete_details"] == {"reason": reason}
    if status == "failed":
        assert response["error"]["message"] == (
            "The upstream model's tool call arguments are not valid JSON."
        ), response["error"]


async def test_a_raw_newline_in_a_calls_string_arrives_escaped() -> None:
    """llama-cpp-python's grammar lets SmolLM2 end a string with a raw line break (invalid
    JSON, which failed the turn): rollout escapes it as it streams; the deltas and the final
    arguments agree and parse."""
    pieces = ['{ "', "command", '" :"', "ls", " -la", "\n", '"', "}"]

    async def handler(exchange: Exchange) -> None:
        call = {"index": 0, "id": "call_nl", "type": "function"}
        first = {**call, "function": {"name": "run", "arguments": pieces[0]}}
        rest = [{"index": 0, "function": {"arguments": piece}} for piece in pieces[1:]]
        chunks = [chunk(tool_calls=[first]), *(chunk(tool_calls=[r]) for r in rest)]
        await exchange.stream([*chunks, chunk(finish="tool_calls")])

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(handler) as (up, _):
            registry = gateway_registry(up, name="nl", retries=0)
            async with open_rollout(registry=registry) as url, open_ws(url) as ws:
                events = await ws.create(model="nl", tools=[TOOL], input="Go.")
    assert events[-1].type == "response.completed", ws.raw[-1]
    (call,) = [i for i in ws.raw[-1]["response"]["output"] if i["type"] == "function_call"]
    assert json.loads(call["arguments"]) == {"command": "ls -la\n"}
    deltas = [e["delta"] for e in ws.raw if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call["arguments"] == '{ "command" :"ls -la\\n"}'


# --- usage the upstream does not report ---------------------------------------------------------


@pytest.mark.parametrize("reports_usage", [True, False])
async def test_usage_the_upstream_does_not_report_is_counted_as_estimated(
    reports_usage: bool,
) -> None:
    """llama-cpp-python's server reports no usage in a stream: the output tokens are then
    rollout's count of the deltas (a chunk each), and each such sampling is counted in
    `usage_estimated`."""

    async def model(exchange: Exchange) -> None:
        chunks = text_chunks(["One ", "two ", "three."], prompt_tokens=12)
        await exchange.stream(chunks if reports_usage else chunks[:-1])

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(model) as (up, _):
            registry = gateway_registry(up, name="quiet", retries=0)
            async with open_rollout(registry=registry) as url, httpx.AsyncClient() as client:
                body = {"model": "quiet", "input": "Count."}
                response = (await client.post(f"{url}/responses", json=body)).json()
                metrics = (await client.get(url.removesuffix("/v1") + "/metrics")).text
    assert response["status"] == "completed", response
    assert response["usage"]["output_tokens"] == 3
    line = 'rollout_work_total{counter="usage_estimated"} '
    (value,) = [row.removeprefix(line) for row in metrics.splitlines() if row.startswith(line)]
    assert float(value) == (0 if reports_usage else 1), value
