"""The OpenAI Agents SDK against a real rollout server, over its WebSocket transport.

An agent with two local function tools runs to a final answer through
`agents.responses_websocket_session`, in the SDK's default full-history mode and with
`auto_previous_response_id=True`. What is proved:

- the tools ran locally in the agent's process (their calls are recorded);
- their results shape the answer: other tool values give another answer, the same values the
  same answer (in both modes: the two modes are the same conversation to the model);
- on the server side, read from `/metrics` and the stored responses: in auto mode the follow-up
  request continued the first response from the connection's cache (one cache hit) and carried
  only the new items (items validated == the function_call_output items); in full-history mode
  there is no cache hit and the follow-up re-sends (and the server re-validates) everything.

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

from tests.server_harness import (
    counters,
    fetch_counters,
    open_test_server,
    parse_metrics,
    run_in_thread,
)

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

DEADLINE = 60
# Two parallel calls in the first model turn, then a text answer: two model calls per run.
MODEL = "sim:steps=2,parallel=2"
# The simulated model draws each call's tool from the context (deterministically); for this
# question and these tools its two parallel calls are one of each.
QUESTION = "Paris: weather and local time, please."


@attrs.frozen
class AgentRun:
    final: str
    calls: list[tuple[str, str]]
    mid_counters: dict[str, int]  # read by the first tool call: after request 1, before 2
    response_ids: list[str]
    last_response_id: str | None


def run_agent(url: str, *, auto: bool, weather: str, clock: str) -> AgentRun:
    from agents import Agent, function_tool, responses_websocket_session, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []
    mid: list[dict[str, int]] = []
    metrics_url = url.removesuffix("/v1") + "/metrics"

    def observe() -> None:
        if not mid:
            mid.append(counters(parse_metrics(httpx.get(metrics_url, timeout=10).text)))

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        observe()
        calls.append(("get_weather", city))
        return f"{weather} in {city}"

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        observe()
        calls.append(("get_time", city))
        return f"{clock} in {city}"

    async def main() -> Any:
        agent = Agent(
            name="assistant",
            instructions="Answer using the tools.",
            model=MODEL,
            tools=[get_weather, get_time],
        )
        async with responses_websocket_session(api_key="sk-test", base_url=url) as ws:
            kwargs = {"auto_previous_response_id": True} if auto else {}
            return await ws.run(agent, QUESTION, **kwargs)

    result = asyncio.run(main())
    return AgentRun(
        final=str(result.final_output),
        calls=sorted(calls),
        mid_counters=mid[0] if mid else {},
        response_ids=[r.response_id for r in result.raw_responses],
        last_response_id=result.last_response_id,
    )


async def agent_run(url: str, *, auto: bool, weather: str = "sunny", clock: str = "noon") -> Any:
    """One run, with the server's work counters before, between the two requests, after."""
    before = await fetch_counters(url)
    run = await run_in_thread(lambda: run_agent(url, auto=auto, weather=weather, clock=clock))
    after = await fetch_counters(url)
    return before, run, after


def delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a}


async def stored(url: str, response_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        resp = await http.get(f"/responses/{response_id}")
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


@pytest.mark.parametrize("auto", [False, True], ids=["full_history", "auto_previous_response_id"])
async def test_agent_with_two_tools_over_websocket(tmp_path: Path, auto: bool) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            before, run, after = await agent_run(url, auto=auto)
            first_id, last_id = run.response_ids
            first = await stored(url, first_id)
            last = await stored(url, last_id)

    # (a) Both tools ran here, once each, with arguments the model chose.
    assert [name for name, _ in run.calls] == ["get_time", "get_weather"], run.calls
    assert all(city for _, city in run.calls)
    assert run.final
    assert run.last_response_id == last_id

    # The model saw the tools' outputs: the stored final response continues the first.
    assert first["previous_response_id"] is None
    assert [o["type"] for o in first["output"]] == ["function_call", "function_call"]
    assert [o["type"] for o in last["output"]] == ["message"]
    assert last["output"][0]["content"][0]["text"] == run.final

    n_outputs = len(run.calls)
    first_request = delta(before, run.mid_counters)
    follow_up = delta(run.mid_counters, after)
    assert first_request["items_validated"] == 1  # the user message
    assert first_request["cache_hits"] == 0
    assert first_request["samplings"] == follow_up["samplings"] == 1
    assert follow_up["responses_completed"] == 1
    assert follow_up["request_errors"] == 0
    if auto:
        # previous_response_id + only the new items, continued from the connection's cache.
        assert last["previous_response_id"] == first_id
        assert follow_up["cache_hits"] == 1
        assert follow_up["cache_misses"] == 0
        assert follow_up["items_validated"] == n_outputs
    else:
        # The whole history again (the user message, the two calls, the two outputs): the
        # render cache has the first three, so only the outputs are validated (and rendered).
        assert last["previous_response_id"] is None
        assert follow_up["cache_hits"] == 0
        assert follow_up["items_validated"] == n_outputs


async def test_tool_results_shape_the_final_answer(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            full_sunny = (await agent_run(url, auto=False))[1]
            auto_sunny = (await agent_run(url, auto=True))[1]
            auto_sunny_again = (await agent_run(url, auto=True))[1]
            full_rainy = (await agent_run(url, auto=False, weather="rainy"))[1]
            auto_rainy = (await agent_run(url, auto=True, weather="rainy"))[1]
            auto_late = (await agent_run(url, auto=True, clock="midnight"))[1]
            counts = await fetch_counters(url)

    # Same tool values: the same answer, in either mode and on a repeat.
    assert full_sunny.final == auto_sunny.final == auto_sunny_again.final
    assert full_rainy.final == auto_rainy.final
    # Other tool values (either tool): another answer.
    assert len({auto_sunny.final, auto_rainy.final, auto_late.final}) == 3
    # The model's calls did not depend on the tool values (they come before them).
    assert full_sunny.calls == auto_rainy.calls == auto_late.calls
    assert counts["request_errors"] == 0
