"""The multi-agent beta's door to the rollout coroutine, against a real rollout server.

The acceptance test: the OpenAI Agents SDK's `OpenAIHostedMultiAgentModel` (openai-agents
0.24, unchanged) runs an agent with two function tools over several tool turns to a final
answer, and the server's work counters show that the whole run was one response: one
pre-inference, one post-inference, one completed response, every tool output committed by an
inject. The same agent through the SDK's WebSocket transport (a `previous_response_id`
chain) reaches the same answer: the two doors are the same conversation to the model.

Then the wire, with rollout's strict WebSocket client and the `openai` SDK's beta event types
as the oracle: acks in order and in the response's sequence, no `response.done`, the root
agent's attribution, the failures with their input, the refusals without the beta header,
over HTTP and for bad `multi_agent` values, and an inject whose input is refused (the suspend
limit is tested on trio's clock, in test_engine_multi_agent.py).

The Agents SDK needs asyncio: each run is `asyncio.run` in a worker thread.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from openai.types.beta.beta_responses_server_event import BetaResponsesServerEvent
from pydantic import TypeAdapter
from rollout import protocol as p

from tests.server_harness import (
    WEATHER_TOOLS,
    WsClient,
    fetch_counters,
    open_test_server,
    open_ws,
    run_in_thread,
)

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

DEADLINE = 60
QUESTION = "Paris: weather and local time, please."
INSTRUCTIONS = "Answer using the tools."
BETA = [(b"openai-beta", b"responses_multi_agent=v1")]
SERVER_EVENT = TypeAdapter(BetaResponsesServerEvent)


@attrs.frozen
class HostedRun:
    final: str
    calls: list[tuple[str, str]]
    response_ids: list[str]
    usage: tuple[int, int]


def run_agent(url: str, model_id: str, *, hosted: bool, streamed: bool = False) -> HostedRun:
    """One agent run: through the hosted multi-agent model (inject; `streamed`: with
    `Runner.run_streamed`), or through the SDK's WebSocket transport continuing with
    previous_response_id (the chain)."""
    from agents import (
        Agent,
        Runner,
        function_tool,
        responses_websocket_session,
        set_tracing_disabled,
    )
    from agents.extensions.experimental.hosted_multi_agent import OpenAIHostedMultiAgentModel
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(("get_weather", city))
        return f"sunny in {city}"

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return f"noon in {city}"

    async def main() -> Any:
        if not hosted:
            agent = Agent(
                name="assistant",
                instructions=INSTRUCTIONS,
                model=model_id,
                tools=[get_weather, get_time],
            )
            async with responses_websocket_session(api_key="sk-test", base_url=url) as ws:
                return await ws.run(agent, QUESTION, auto_previous_response_id=True)
        model = OpenAIHostedMultiAgentModel(
            model_id,
            openai_client=AsyncOpenAI(api_key="sk-test", base_url=url),
            config={"max_concurrent_subagents": 2},
        )
        agent = Agent(
            name="assistant",
            instructions=INSTRUCTIONS,
            model=model,
            tools=[get_weather, get_time],
        )
        try:
            if not streamed:
                return await Runner.run(agent, QUESTION)
            result = Runner.run_streamed(agent, QUESTION)
            async for _event in result.stream_events():
                pass
            return result
        finally:
            await model.close()

    result = asyncio.run(main())
    usage = result.context_wrapper.usage
    return HostedRun(
        final=str(result.final_output),
        calls=calls,
        response_ids=[r.response_id for r in result.raw_responses],
        usage=(usage.input_tokens, usage.output_tokens),
    )


def delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in b}


# Tool turns of two parallel calls each, then the answer; and one call per turn, streamed.
@pytest.mark.parametrize(
    ("model_id", "tool_turns", "n_calls", "streamed"),
    [("sim:steps=4,parallel=2", 2, 4, False), ("sim:steps=3,parallel=1", 3, 3, True)],
    ids=["parallel", "sequential-streamed"],
)
async def test_hosted_multi_agent_model_runs_one_coroutine(
    tmp_path: Path, model_id: str, tool_turns: int, n_calls: int, streamed: bool
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            before = await fetch_counters(url)
            hosted = await run_in_thread(
                lambda: run_agent(url, model_id, hosted=True, streamed=streamed)
            )
            work = delta(before, await fetch_counters(url))
            chain = await run_in_thread(lambda: run_agent(url, model_id, hosted=False))

    # The tools ran here, both of them, and the agent reached a final answer (the SDK keeps
    # only a root agent's `final_answer` message: without the attribution it would be empty).
    assert len(hosted.calls) == n_calls
    assert {name for name, _ in hosted.calls} <= {"get_weather", "get_time"}
    if n_calls > tool_turns:  # parallel calls: the model used both tools
        assert {name for name, _ in hosted.calls} == {"get_weather", "get_time"}
    assert hosted.final
    # One response for the whole run: every logical model call the SDK saw is the same id.
    assert len(set(hosted.response_ids)) == 1, hosted.response_ids
    assert len(hosted.response_ids) == n_calls + 1  # a pause per call, then the answer
    # The server ran one coroutine: pre-inference once, post-inference once, one response,
    # every sampling step in it, every output committed by an inject, nothing refused.
    assert work["pre_inference_runs"] == 1
    assert work["route_resolutions"] == 1
    assert work["post_inference_runs"] == 1
    assert work["responses_completed"] == 1
    assert work["samplings"] == tool_turns + 1
    assert work["injects_committed"] == n_calls
    assert work["items_validated"] == 1 + n_calls  # the question, then each output once
    assert work["request_errors"] == 0
    # The other door (a previous_response_id chain) is the same conversation to the model.
    assert chain.calls == hosted.calls
    assert chain.final == hosted.final
    assert len(set(chain.response_ids)) == tool_turns + 1
    assert hosted.usage == chain.usage


# --- the wire ------------------------------------------------------------------------------


def body(model: str = "sim:steps=2,parallel=2", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "input": QUESTION,
        "tools": WEATHER_TOOLS,
        "store": False,
        "multi_agent": {"enabled": True},
        **extra,
    }


def output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "sunny"}


async def run_injecting(ws: WsClient, request: dict[str, Any]) -> list[Any]:
    """A multi-agent response to its end, each call's output injected when its
    output_item.done arrives (as the Agents SDK does)."""
    await ws.send({"type": "response.create", **request})
    events: list[Any] = []
    response_id = ""
    while True:
        event = await ws.recv()
        events.append(event)
        if isinstance(event, p.ResponseCreated):
            response_id = event.response.id
        if isinstance(event, p.OutputItemDone) and isinstance(event.item, p.FunctionCall):
            call_id = event.item.call_id
            await ws.send(
                {"type": "response.inject", "response_id": response_id, "input": [output(call_id)]}
            )
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            return events


async def test_injects_are_acknowledged_in_order_and_the_response_goes_on() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url, headers=BETA) as ws:
            events = await run_injecting(ws, body())
            await ws.assert_quiet()
    for raw in ws.raw:
        SERVER_EVENT.validate_python(raw)  # the SDK's beta types: the oracle
    types = [e.type for e in events]
    assert "response.done" not in types and types.count("response.in_progress") == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert isinstance(final, p.ResponseCompleted)
    rid = final.response.id
    acks = [e for e in events if isinstance(e, p.ResponseInjectCreated)]
    calls = [i for i in final.response.output if isinstance(i, p.FunctionCall)]
    assert len(acks) == len(calls) == 2 and all(a.response_id == rid for a in acks)
    # Both outputs acknowledged before the second turn's first item.
    second_turn = types.index("response.output_item.added", types.index("response.inject.created"))
    assert types[second_turn - 2 : second_turn] == ["response.inject.created"] * 2
    # Every item belongs to the root agent; the answer is the final answer.
    assert all(i.agent == p.ROOT_AGENT for i in final.response.output)
    answer = final.response.output[-1]
    assert isinstance(answer, p.Message) and answer.phase == "final_answer"
    done = [e.item for e in events if isinstance(e, p.OutputItemDone)]
    assert done == final.response.output  # the streamed items are the final ones
    assert final.response.usage is not None and final.response.usage.output_tokens > 0


async def test_a_beta_header_listing_several_betas_opens_the_door() -> None:
    headers = [(b"OpenAI-Beta", b"responses_websockets=2026-02-06, responses_multi_agent=v1")]
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url, headers=headers) as ws:
            events = await run_injecting(ws, body(max_output_tokens=None))
    assert events[-1].type == "response.completed"


async def test_inject_failures_return_the_input() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url, headers=BETA) as ws:
            done = await ws.create(**body(tools=[], input="Hello"))
            rid = done[-1].response.id
            sent = [output("call_nothing")]
            await ws.send({"type": "response.inject", "response_id": rid, "input": sent})
            completed = await ws.recv()
            await ws.send({"type": "response.inject", "response_id": "resp_nope", "input": sent})
            unknown = await ws.recv()
            await ws.assert_quiet()
    for event, code in ((completed, "response_already_completed"), (unknown, "response_not_found")):
        assert isinstance(event, p.ResponseInjectFailed), event
        assert event.error.code == code
        assert event.sequence_number == 0
    assert completed.response_id == rid and unknown.response_id == "resp_nope"
    assert ws.raw[-2]["input"] == ws.raw[-1]["input"] == sent
    for raw in ws.raw:
        SERVER_EVENT.validate_python(raw)


async def test_without_the_beta_header_multi_agent_and_inject_are_refused() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            async with open_ws(url) as ws:
                await ws.send({"type": "response.create", **body()})
                create_error = await ws.error()
                await ws.send({"type": "response.inject", "response_id": "resp_x", "input": []})
                inject_error = await ws.error()
                # The socket serves the next (plain) create.
                plain = await ws.create(**{**body(), "multi_agent": {"enabled": False}})
            async with httpx.AsyncClient(base_url=url) as http:
                resp = await http.post("/responses", json=body())
    assert (create_error.error.code, create_error.error.param) == ("beta_required", "multi_agent")
    assert (inject_error.error.code, inject_error.error.param) == ("beta_required", "type")
    assert plain[-1].type == "response.completed"  # a tool-call turn ends a plain response
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "unsupported_parameter"
    assert resp.json()["error"]["param"] == "multi_agent"


@pytest.mark.parametrize(
    ("config", "code", "param"),
    [
        ({"enabled": True, "max_concurrent_subagents": 0}, "integer_below_min_value",
         "multi_agent.max_concurrent_subagents"),
        ({"enabled": True, "max_concurrent_subagents": "2"}, "invalid_type",
         "multi_agent.max_concurrent_subagents"),
        ({"max_concurrent_subagents": 2}, "missing_required_parameter", "multi_agent.enabled"),
        ({"enabled": True, "subagents": 2}, "unknown_parameter", "multi_agent.subagents"),
    ],
)  # fmt: skip
async def test_bad_multi_agent_values_are_refused(
    config: dict[str, Any], code: str, param: str
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url, headers=BETA) as ws:
            await ws.send({"type": "response.create", **body(multi_agent=config)})
            error = await ws.error()
            ok = await ws.create(
                **body(tools=[], multi_agent={"enabled": True, "max_concurrent_subagents": 6})
            )
    assert (error.error.code, error.error.param) == (code, param)
    assert ok[-1].type == "response.completed"


async def test_a_refused_inject_commits_nothing_and_the_response_waits() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url, headers=BETA) as ws:
            await ws.send({"type": "response.create", **body("sim:steps=1,parallel=1")})
            events = []
            while not (events and isinstance(events[-1], p.OutputItemDone)):
                events.append(await ws.recv())
            rid = events[0].response.id
            call = events[-1].item
            assert isinstance(call, p.FunctionCall)
            wrong = [output(call.call_id), output("call_unknown")]
            await ws.send({"type": "response.inject", "response_id": rid, "input": wrong})
            error = await ws.error()
            await ws.assert_quiet()  # nothing committed: the response still waits
            await ws.send({"type": "response.inject", "response_id": rid, "input": wrong[:1]})
            rest = await ws.until_terminal()
    assert (error.error.code, error.error.param) == ("invalid_value", "input[1].call_id")
    assert isinstance(rest[0], p.ResponseInjectCreated)
    assert rest[-1].type == "response.completed"


async def test_inject_into_a_plain_response_is_refused() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url, headers=BETA) as ws:
            await ws.send(
                {"type": "response.create", **body("sim:ttft_ms=300", tools=[], multi_agent=None)}
            )
            created = await ws.recv()
            rid = created.response.id
            await ws.send({"type": "response.inject", "response_id": rid, "input": []})
            events = [created]
            while events[-1].type != "response.completed":
                events.append(await ws.recv())
    errors = [e for e in events if isinstance(e, p.ErrorEvent)]
    assert [(e.error.code, e.error.param) for e in errors] == [
        ("multi_agent_not_enabled", "response_id")
    ]
    assert events[-1].type == "response.completed"


async def test_on_a_lane_acks_and_failures_carry_its_stream_id() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url, headers=BETA) as ws:
            events = await run_injecting(ws, body(stream_id="agent-1"))
            rid = events[-1].response.id
            sent = [output("call_late")]
            await ws.send({"type": "response.inject", "response_id": rid, "input": sent})
            late = await ws.recv()
            await ws.assert_quiet()
    acks = [e for e in events if isinstance(e, p.ResponseInjectCreated)]
    assert len(acks) == 2
    assert {e.stream_id for e in events} == {"agent-1"}  # every event of the response
    assert isinstance(late, p.ResponseInjectFailed)
    assert (late.error.code, late.stream_id) == ("response_already_completed", "agent-1")
    for raw in ws.raw:
        SERVER_EVENT.validate_python(raw)
