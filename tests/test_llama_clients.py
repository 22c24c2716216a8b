"""The official clients drive the packaged SmolLM2 (`smollm2`: llama.cpp in the server's
process) through a tool loop, unchanged: the model calls a function, the client runs it and
sends its output back, the model continues to an answer.

- the `openai` SDK over HTTP, plain and streamed (`client.responses.create`), with plain
  `smollm2`: the first turn forced to call (`tool_choice="required"`, a grammar makes the
  call valid), the next one free (the SDK's default, `auto`); the output goes back with
  `previous_response_id` (a stored chain) or as the whole history (`store=False`);
- the `openai` SDK's WebSocket mode (`client.responses.connect()`, sync), the output going
  back on the connection with `previous_response_id`;
- the Agents SDK (`Runner.run` over HTTP, and `responses_websocket_session`): an `Agent`
  whose model is `smollm2:calls=1` (one call, then an answer, whatever the model would
  choose) and one `@function_tool`, which runs here, in the agent's process;
- against a `rollout serve` process: the async client's WebSocket mode with
  `smollm2:calls=1`, every frame validated with the SDK's `ResponsesServerEvent` union (the
  conftest hook sees only in-process servers, whose events it checks against the SDK's types
  by itself).

Every loop proves: the model called `get_weather` with arguments that are valid JSON and
satisfy its schema (jsonschema), the function ran with them, and the model's last turn is a
message that reports the weather the function returned ("foggy" is in no prompt but the
function's output: the output reached the model).

Greedy (`temperature: 0`) and each test on a server of its own, so each test's tokens are
the same every run. Why `calls=1` for the Agents SDK: after a call the Agents SDK resets
`tool_choice` to the default (`reset_tool_choice`), and under `auto` whether SmolLM2 answers or
calls again depends on the tool output's wording and on what its KV cache already held (a
`ModelSettings(tool_choice="required")` agent ran into `MaxTurnsExceeded` on a server that had
served other conversations). Each test needs the llama extra: without it they skip, and fail
under `ROLLOUT_REQUIRE_ALL`.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import trio
from openai.types.responses import Response
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter

from tests.client_harness import open_rollout_process
from tests.llama_harness import require_llama
from tests.server_harness import open_test_server, run_in_thread

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

# A real model on 2 shared cores: a forced call takes seconds (its grammar), a test tens.
DEADLINE = 300
QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "Answer in one short sentence."
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": PARAMETERS,
    }
]
# Enough for a call (~35 tokens under the grammar, which spaces its JSON) or a sentence.
SETTINGS: dict[str, Any] = {"temperature": 0, "max_output_tokens": 64}
WS_EVENT: TypeAdapter[ResponsesServerEvent] = TypeAdapter(ResponsesServerEvent)


def get_weather(city: str) -> str:
    """What the client's function returns: a word no prompt holds ("foggy")."""
    return json.dumps({"city": city, "weather": "foggy", "temperature_c": 9})


def run_call(call: Any, ran: list[dict[str, Any]]) -> dict[str, Any]:
    """Run a `function_call` item the way a client does: check its arguments against the
    schema, call the function, answer with a `function_call_output`."""
    assert call.type == "function_call" and call.name == "get_weather", call
    arguments = json.loads(call.arguments)  # valid JSON
    jsonschema.validate(arguments, PARAMETERS)  # and the schema's
    ran.append(arguments)
    return {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": get_weather(**arguments),
    }


def check_answer(response: Any) -> str:
    """The model's last turn: a completed message reporting the function's weather."""
    assert response.status == "completed", response
    assert [o.type for o in response.output] == ["message"], response.output
    text: str = response.output_text
    assert "<tool_call>" not in text and "foggy" in text.lower(), text
    return text


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url,
        api_key="sk-test",
        max_retries=0,
        timeout=DEADLINE,
        _strict_response_validation=True,
    )


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of one delta type collapsed to one."""
    out: list[str] = []
    for t in types:
        if not (out and out[-1] == t and t.endswith(".delta")):
            out.append(t)
    return out


# --- the openai SDK over HTTP ------------------------------------------------------------------


def http_loop(url: str) -> dict[str, Any]:
    """Plain creates: the call forced, then the output back on the stored chain."""
    client = sync_client(url)
    ran: list[dict[str, Any]] = []
    first = client.responses.create(
        model="smollm2",
        instructions=INSTRUCTIONS,
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        **SETTINGS,
    )
    (call,) = first.output
    answer = client.responses.create(
        model="smollm2",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[run_call(call, ran)],  # type: ignore[list-item]
        tools=TOOLS,
        **SETTINGS,
    )
    return {"first": first, "answer": answer, "ran": ran}


def http_streamed_loop(url: str) -> dict[str, Any]:
    """Streamed creates, stateless: the whole history each time (`store=False`)."""
    client = sync_client(url)
    ran: list[dict[str, Any]] = []
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    common: dict[str, Any] = {
        "model": "smollm2",
        "instructions": INSTRUCTIONS,
        "tools": TOOLS,
        "store": False,
        "stream": True,
        **SETTINGS,
    }
    first = list(client.responses.create(input=history, tool_choice="required", **common))
    response = first[-1].response
    (call,) = response.output
    history += [call.model_dump(exclude_none=True), run_call(call, ran)]
    answer = list(client.responses.create(input=history, **common))
    return {"first": first, "answer": answer, "ran": ran}


async def test_openai_sdk_over_http_plain(tmp_path: Path) -> None:
    require_llama()
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            got = await run_in_thread(http_loop, url)
    first: Response = got["first"]
    assert first.status == "completed" and first.tool_choice == "required"
    assert got["ran"] == [{"city": "Paris"}]
    answer: Response = got["answer"]
    check_answer(answer)
    assert answer.previous_response_id == first.id
    # The answer read the call's context from the KV cache: only what is new was evaluated.
    assert answer.usage is not None and answer.usage.input_tokens_details.cached_tokens > 0


async def test_openai_sdk_over_http_streamed(tmp_path: Path) -> None:
    require_llama()
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            got = await run_in_thread(http_streamed_loop, url)
    assert got["ran"] == [{"city": "Paris"}]
    first, answer = got["first"], got["answer"]
    for events in (first, answer):
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
    call = first[-1].response.output[0]
    assert collapse([e.type for e in first]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in first if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    text = check_answer(answer[-1].response)
    streamed = "".join(e.delta for e in answer if e.type == "response.output_text.delta")
    assert streamed == text


# --- the openai SDK's WebSocket mode -----------------------------------------------------------


def ws_loop(url: str) -> dict[str, Any]:
    client = sync_client(url)
    ran: list[dict[str, Any]] = []
    responses: list[Any] = []
    with client.responses.connect() as conn:
        body: dict[str, Any] = {"input": QUESTION, "tool_choice": "required"}
        while True:
            conn.response.create(
                model="smollm2",
                instructions=INSTRUCTIONS,
                tools=TOOLS,
                store=False,
                **SETTINGS,
                **body,
            )
            for event in conn:
                if event.type in ("error", "response.failed", "response.incomplete"):
                    raise AssertionError(event)
                if event.type == "response.completed":
                    break
            response = event.response
            responses.append(response)
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls or len(responses) > 2:
                return {"responses": responses, "ran": ran}
            body = {
                "previous_response_id": response.id,
                "input": [run_call(c, ran) for c in calls],
            }


async def test_openai_sdk_websocket_mode(tmp_path: Path) -> None:
    require_llama()
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            got = await run_in_thread(ws_loop, url)
    first, answer = got["responses"]
    assert [o.type for o in first.output] == ["function_call"]
    assert got["ran"] == [{"city": "Paris"}]
    check_answer(answer)
    assert answer.previous_response_id == first.id and answer.store is False


# --- the Agents SDK ----------------------------------------------------------------------------


def agent_run(url: str, transport: str) -> dict[str, Any]:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        responses_websocket_session,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool(name_override="get_weather")
    def weather(city: str) -> str:
        """The current weather in a city."""
        ran.append(city)
        return get_weather(city)

    settings = ModelSettings(temperature=0, max_tokens=64)

    async def main() -> Any:
        if transport == "http":
            client = openai.AsyncOpenAI(base_url=url, api_key="sk-test", max_retries=0)
            model = OpenAIResponsesModel(model="smollm2:calls=1", openai_client=client)
            agent = Agent(
                name="weather",
                instructions=INSTRUCTIONS,
                model=model,
                tools=[weather],
                model_settings=settings,
            )
            return await Runner.run(agent, QUESTION, max_turns=4)
        agent = Agent(
            name="weather",
            instructions=INSTRUCTIONS,
            model="smollm2:calls=1",
            tools=[weather],
            model_settings=settings,
        )
        async with responses_websocket_session(api_key="sk-test", base_url=url) as ws:
            return await ws.run(agent, QUESTION, max_turns=4)

    result = asyncio.run(main())
    return {
        "final": result.final_output,
        "ran": ran,
        "outputs": [[o.type for o in r.output] for r in result.raw_responses],
        "calls": [o for r in result.raw_responses for o in r.output if o.type == "function_call"],
    }


@pytest.mark.parametrize("transport", ["http", "websocket"])
async def test_agents_sdk_runs_a_function_tool(tmp_path: Path, transport: str) -> None:
    require_llama()
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            got = await run_in_thread(agent_run, url, transport)
    # The model called once, the tool ran here with its arguments, then the model answered.
    assert got["outputs"] == [["function_call"], ["message"]], got["outputs"]
    (call,) = got["calls"]
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    assert got["ran"] == [json.loads(call.arguments)["city"]] == ["Paris"]
    final = got["final"]
    assert isinstance(final, str) and "foggy" in final.lower() and "<tool_call>" not in final


# --- a `rollout serve` process -----------------------------------------------------------------


def async_ws_loop(url: str) -> dict[str, Any]:
    """`AsyncOpenAI(...).responses.connect()`, `smollm2:calls=1`: run calls until an answer;
    every frame validated as the SDK's `ResponsesServerEvent`."""

    async def main() -> dict[str, Any]:
        client = openai.AsyncOpenAI(base_url=url, api_key="sk-test", max_retries=0)
        ran: list[dict[str, Any]] = []
        responses: list[Any] = []
        async with client.responses.connect() as conn:
            body: dict[str, Any] = {"input": QUESTION}
            while len(responses) < 3:
                await conn.response.create(
                    model="smollm2:calls=1",
                    instructions=INSTRUCTIONS,
                    tools=TOOLS,
                    store=False,
                    **SETTINGS,
                    **body,
                )
                while True:
                    event = WS_EVENT.validate_json(await conn.recv_bytes())
                    if event.type in ("error", "response.failed", "response.incomplete"):
                        raise AssertionError(event)
                    if event.type == "response.completed":
                        break
                response = event.response
                responses.append(response)
                calls = [o for o in response.output if o.type == "function_call"]
                if not calls:
                    break
                body = {
                    "previous_response_id": response.id,
                    "input": [run_call(c, ran) for c in calls],
                }
        await client.close()
        return {"responses": responses, "ran": ran}

    return asyncio.run(main())


async def test_openai_sdk_against_rollout_serve(tmp_path: Path) -> None:
    require_llama()
    with trio.fail_after(DEADLINE):
        async with open_rollout_process(data_dir=tmp_path / "data") as server:
            got = await run_in_thread(async_ws_loop, server.url)
    responses = got["responses"]
    assert [[o.type for o in r.output] for r in responses] == [["function_call"], ["message"]]
    assert got["ran"] == [{"city": "Paris"}]
    check_answer(responses[-1])
