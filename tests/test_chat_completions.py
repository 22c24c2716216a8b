"""rollout as a model server: `POST /v1/chat/completions` in front of the registry.

Driven by httpx (the raw wire) and by the official SDK's `client.chat.completions.create`
(strict response validation, so every completion and chunk is checked against the SDK's
pydantic types). A tool-calling conversation (system, user, assistant `tool_calls`, `tool`
results) gives the same output streamed and not, and the same output as the equivalent
Responses request (the simulated model is a function of the rendered context). Bad requests
get 400 with the OpenAI error shape; any JSON body maps to a request or to such an error.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout.engine._chat_serve import request_from_chat
from rollout.protocol import RemoteProtocolError, ResponseCreate

from tests.upstream_harness import (
    TOOLS,
    Exchange,
    chunk,
    gateway_registry,
    healthz,
    open_fake_upstream,
    open_rollout,
    run_in_thread,
)

DEADLINE = 20
MODEL = "sim:steps=2,parallel=2"
SYSTEM = "You are a terse assistant. Use the tools."
USER = "What is the weather and time in Paris?"
CHAT_TOOLS: list[Any] = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]


async def post(url: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await client.post(
            f"{url}/chat/completions", content=raw, headers={"content-type": "application/json"}
        )


async def complete(url: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    resp = await post(url, {"model": MODEL, "messages": messages, "tools": CHAT_TOOLS, **extra})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/json"
    body: dict[str, Any] = resp.json()
    return body


async def complete_streamed(url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The streamed answer reassembled into a completion (as a client library would)."""
    body = {
        "model": MODEL,
        "messages": messages,
        "tools": CHAT_TOOLS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines: list[str] = []
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", f"{url}/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in resp.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    *deltas, last = chunks
    assert last["choices"] == [] and last["usage"] is not None  # include_usage
    assert deltas[0]["choices"][0]["delta"]["role"] == "assistant"
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for c in deltas:
        (choice,) = c["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            slot = calls.setdefault(
                call["index"], {"id": None, "type": "function", "function": {"arguments": ""}}
            )
            if "id" in call:
                slot["id"] = call["id"]
                slot["function"]["name"] = call["function"]["name"]
            slot["function"]["arguments"] += call["function"].get("arguments", "")
        finish = choice["finish_reason"] or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "finish_reason": finish, "usage": last["usage"]}


def without_call_ids(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if "tool_calls" in out:
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in out["tool_calls"]]
    return out


def tool_results(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": f"{call['function']['name']}: 21C at noon",
        }
        for call in message.get("tool_calls") or []
    ]


def assert_usage(usage: dict[str, int]) -> None:
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_tool_conversation_streamed_and_not_over_httpx() -> None:
    with trio.fail_after(DEADLINE):
        async with open_rollout() as a:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": USER},
            ]
            first = await complete(a, messages)
            assert first["object"] == "chat.completion" and first["model"] == MODEL
            (choice,) = first["choices"]
            assert choice["finish_reason"] == "tool_calls"
            calls = choice["message"]["tool_calls"]
            assert len(calls) == 2  # parallel calls
            assert all(c["type"] == "function" and c["id"] for c in calls)
            assert {c["function"]["name"] for c in calls} <= {"get_weather", "get_time"}
            for call in calls:
                assert set(json.loads(call["function"]["arguments"])) == {"city"}
            assert_usage(first["usage"])
            streamed = await complete_streamed(a, messages)
            assert without_call_ids(streamed["message"]) == without_call_ids(choice["message"])
            assert streamed["finish_reason"] == "tool_calls"
            assert streamed["usage"] == first["usage"]

            # The follow-up: the assistant's tool_calls and the tool results.
            messages += [choice["message"], *tool_results(choice["message"])]
            second = await complete(a, messages)
            (choice,) = second["choices"]
            assert choice["finish_reason"] == "stop"
            assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
            assert "tool_calls" not in choice["message"]
            assert_usage(second["usage"])
            assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
            streamed = await complete_streamed(a, messages)
            assert streamed["message"] == choice["message"]
            assert streamed["finish_reason"] == "stop"
            assert streamed["usage"] == second["usage"]
            # Stateless and deterministic: the same request again, the same answer.
            assert (await complete(a, messages))["choices"][0] == choice


def sdk_conversation(url: str) -> dict[str, Any]:
    client = openai.OpenAI(
        base_url=url, api_key="sk-test", max_retries=0, timeout=10, _strict_response_validation=True
    )
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
    ]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    messages += tool_results(message.model_dump())
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=CHAT_TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])  # type: ignore[misc, list-item]
    except openai.BadRequestError as exc:
        error = exc
    return {"first": first, "second": second, "chunks": chunks, "error": error}


async def test_official_sdk_chat_completions() -> None:
    with trio.fail_after(DEADLINE):
        async with open_rollout() as a:
            got = await run_in_thread(sdk_conversation, a)
    first, second, chunks = got["first"], got["second"], got["chunks"]
    assert first.choices[0].finish_reason == "tool_calls"
    assert len(first.choices[0].message.tool_calls) == 2
    assert first.usage is not None and first.usage.prompt_tokens > 0
    assert second.choices[0].finish_reason == "stop"
    text = second.choices[0].message.content
    assert text
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage == second.usage
    error: openai.BadRequestError = got["error"]
    assert error.status_code == 400
    assert error.body["param"] == "messages[0].role"  # type: ignore[index]
    assert error.body["code"] == "invalid_value"  # type: ignore[index]


async def test_chat_completions_and_responses_give_the_same_output() -> None:
    """The same conversation (instructions, a user turn, two calls and their results) as a
    chat request and as a Responses request: the same calls, then the same answer."""
    with trio.fail_after(DEADLINE):
        async with open_rollout() as a:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": USER},
            ]
            chat_first = (await complete(a, messages))["choices"][0]["message"]
            async with httpx.AsyncClient(timeout=10) as client:

                async def respond(input_items: list[Any]) -> dict[str, Any]:
                    resp = await client.post(
                        f"{a}/responses",
                        json={
                            "model": MODEL,
                            "instructions": SYSTEM,
                            "tools": TOOLS,
                            "input": input_items,
                            "store": False,
                        },
                    )
                    assert resp.status_code == 200, resp.text
                    body: dict[str, Any] = resp.json()
                    return body

                user = {"type": "message", "role": "user", "content": USER}
                resp_first = await respond([user])
                resp_calls = resp_first["output"]
                assert [(c["name"], c["arguments"]) for c in resp_calls] == [
                    (c["function"]["name"], c["function"]["arguments"])
                    for c in chat_first["tool_calls"]
                ]
                assert resp_first["usage"]["input_tokens"] > 0

                # The follow-up: the chat conversation with its call ids, both ways.
                results = tool_results(chat_first)
                messages += [chat_first, *results]
                chat_second = await complete(a, messages)
                resp_second = await respond(
                    [
                        user,
                        *[
                            {
                                "type": "function_call",
                                "call_id": c["id"],
                                "name": c["function"]["name"],
                                "arguments": c["function"]["arguments"],
                            }
                            for c in chat_first["tool_calls"]
                        ],
                        *[
                            {
                                "type": "function_call_output",
                                "call_id": r["tool_call_id"],
                                "output": r["content"],
                            }
                            for r in results
                        ],
                    ]
                )
    (message,) = resp_second["output"]
    assert message["content"][0]["text"] == chat_second["choices"][0]["message"]["content"]
    # The same context, counted the same way.
    assert resp_second["usage"]["input_tokens"] == chat_second["usage"]["prompt_tokens"]
    assert resp_second["usage"]["output_tokens"] == chat_second["usage"]["completion_tokens"]


# --- errors ---------------------------------------------------------------------------------------

U = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS: list[tuple[Any, int, str | None, str | None]] = [
    # body, status, code, param
    (b"{not json", 400, "invalid_json", None),
    ({"messages": U}, 400, "missing_required_parameter", "model"),
    (
        {"model": "sim", "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "invalid_value",
        "messages[0].role",
    ),
    ({"model": "sim", "messages": []}, 400, "invalid_type", "messages"),
    ([1, 2], 400, "invalid_type", "body"),
    (
        {"model": "sim", "messages": [{"role": "tool", "content": "x"}]},
        400,
        "missing_required_parameter",
        "messages[0].tool_call_id",
    ),
    (
        {"model": "sim", "messages": [{"role": "user", "content": 5}]},
        400,
        "invalid_type",
        "messages[0].content",
    ),
    (
        {"model": "sim", "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
        400,
        "invalid_value",
        "messages[0].content[0]",
    ),
    (
        {
            "model": "sim",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        },
        400,
        "invalid_type",
        "messages[0].content[0].image_url",
    ),
    (
        {"model": "sim", "messages": [{"role": "assistant", "tool_calls": 5}]},
        400,
        "invalid_type",
        "messages[0].tool_calls",
    ),
    (
        {
            "model": "sim",
            "messages": [{"role": "tool", "tool_call_id": "c", "content": [{"text": 5}]}],
        },
        400,
        "invalid_type",
        "messages[0].content[0]",
    ),
    ({"model": "sim", "messages": U, "tools": 5}, 400, "invalid_type", "tools"),
    (
        {"model": "sim", "messages": U, "tools": [{"type": "function", "function": {"name": 5}}]},
        400,
        "invalid_type",
        "tools[0].function.name",
    ),
    (
        {"model": "sim", "messages": U, "stream": True, "stream_options": "yes"},
        400,
        "invalid_type",
        "stream_options",
    ),
    ({"model": "sim", "messages": U, "stream": "yes"}, 400, "invalid_type", "stream"),
    (
        {
            "model": "sim",
            "messages": [*U, {"role": "tool", "tool_call_id": "nope", "content": "x"}],
        },
        400,
        "invalid_value",
        "input[1].call_id",
    ),
    ({"model": "no-such-model", "messages": U}, 404, "model_not_found", "model"),
]


async def test_bad_chat_requests_get_openai_errors() -> None:
    with trio.fail_after(DEADLINE):
        async with open_rollout() as a:
            for body, status, code, param in BAD_REQUESTS:
                resp = await post(a, body)
                assert resp.status_code == status, (body, resp.text)
                assert resp.headers["content-type"] == "application/json"
                error = resp.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "invalid_request_error"
                assert (error["code"], error["param"]) == (code, param), body
                assert isinstance(error["message"], str) and error["message"]
            # A GET is not a chat completion.
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.get(f"{a}/chat/completions")
            assert resp.status_code == 405
            assert await healthz(a) == 200


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["", "x", "user", "tool"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "file", "audio"])},
    optional={"text": _json, "image_url": _json, "file": _json},
)
_call = st.fixed_dictionaries(
    {},
    optional={
        "id": st.sampled_from(["c1", "c2"]) | _json,
        "function": _json | st.fixed_dictionaries({}, optional={"name": _json, "arguments": _json}),
    },
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "other"])
        | _json
    },
    optional={
        "content": _json | st.lists(_part | _json, max_size=3),
        "tool_calls": _json | st.lists(_call | _json, max_size=3),
        "tool_call_id": st.sampled_from(["c1", "c2"]) | _json,
    },
)
_body = (
    st.fixed_dictionaries(
        {},
        optional={
            "model": st.just("sim") | _json,
            "messages": st.lists(_message | _json, max_size=4) | _json,
            "tools": st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "type": _json,
                        "function": _json
                        | st.fixed_dictionaries(
                            {"name": st.just("f") | _json}, optional={"parameters": _json}
                        ),
                    },
                )
                | _json,
                max_size=2,
            )
            | _json,
            "tool_choice": _json | st.just({"type": "function", "function": {"name": "f"}}),
            "max_tokens": _json,
            "temperature": _json,
            "parallel_tool_calls": _json,
        },
    )
    | _json
)


@settings(max_examples=300, deadline=None)
@given(_body)
def test_request_from_chat_maps_any_json_to_a_request_or_an_openai_error(body: Any) -> None:
    """Receive-path fuzzing: whatever JSON arrives, the result is a request or a 4xx error
    naming a param; never another exception (which would be a 500)."""
    try:
        request = request_from_chat(body)
    except RemoteProtocolError as exc:
        assert 400 <= exc.status < 500
        assert exc.body.message
        return
    assert isinstance(request, ResponseCreate)
    assert isinstance(request.model, str)


# --- behind the chat endpoint: the upstream fails -------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_completion_through_gateway_reports_upstream_failure(stream: bool) -> None:
    """B's chat endpoint in front of an upstream that breaks mid-answer: the client gets an
    OpenAI error (a 500 body, or an `error` chunk before `[DONE]` once streaming started)."""

    async def cut(exchange: Exchange) -> None:
        await exchange.start()
        await exchange.event(chunk(content="Par"))
        await exchange.end()

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(cut) as (upstream_url, _upstream):
            async with open_rollout(registry=gateway_registry(upstream_url)) as b:
                resp = await post(b, {"model": "up", "messages": U, "stream": stream})
                assert await healthz(b) == 200
    expected = "The upstream stream ended before the answer finished (connection closed)."
    if not stream:
        assert resp.status_code == 500
        error = resp.json()["error"]
    else:
        assert resp.status_code == 200
        lines = [line for line in resp.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert json.loads(lines[1].removeprefix("data: "))["choices"][0]["delta"] == {
            "content": "Par"
        }
    assert error == {
        "message": expected,
        "type": "server_error",
        "param": None,
        "code": "server_error",
    }
