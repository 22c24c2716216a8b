"""rollout in front of a model server: two real rollout servers on loopback.

A serves the simulated model (its own `POST /v1/chat/completions` included); B routes the
model `up` to A as its upstream (`sim:steps=2,parallel=2` there). The simulated model's output
is a function of the whole rendered context, so equal outputs through B and from A directly
prove that the conversation survives Responses -> chat messages (B) -> Responses (A) exactly:
instructions, user turns, parallel function calls and their outputs.

The official clients drive both: the openai SDK (WebSocket mode, and HTTP with and without
streaming) and the Agents SDK (WebSocket session, and HTTP with `OpenAIResponsesModel`), each
run the same tool-calling scenario against A and against B; outputs must be equal modulo ids.

The work counters show what B does per turn: a follow-up on the same connection encodes only
its new chat messages, a stateless follow-up everything again; the body sent upstream always
carries the whole conversation (the chat protocol forces it).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import trio

from tests.server_harness import open_ws
from tests.upstream_harness import (
    SIM_MODEL,
    TOOLS,
    Exchange,
    backend_of,
    call_chunks,
    gateway_registry,
    healthz,
    open_fake_upstream,
    open_rollout,
    run_in_thread,
    strip_ids,
    text_chunks,
)

DEADLINE = 30
ROOT = Path(__file__).resolve().parent.parent
INSTRUCTIONS = "You are a terse assistant. Use the tools."
USER_TURNS = ["What is the weather and time in Paris?", "And in Oslo?"]


@asynccontextmanager
async def open_pair() -> AsyncIterator[tuple[str, str, Any]]:
    """A (the simulated model) and B (model `up` -> A); yields (A url, B url, B's backend)."""
    async with open_rollout() as a:
        registry = gateway_registry(a)
        async with open_rollout(registry=registry) as b:
            yield a, b, backend_of(registry)


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url, api_key="sk-test", max_retries=0, timeout=10, _strict_response_validation=True
    )


def tool_outputs(output: list[Any]) -> list[dict[str, Any]]:
    """A deterministic output for every function call of a response."""
    return [
        {
            "type": "function_call_output",
            "call_id": item.call_id,
            "output": f"{item.name}({item.arguments}) = 21C, 14:00",
        }
        for item in output
        if item.type == "function_call"
    ]


# --- the openai SDK ------------------------------------------------------------------------------


def sdk_websocket(url: str, model: str) -> tuple[list[list[dict[str, Any]]], list[tuple[int, int]]]:
    """Two user turns over one WebSocket, each continued with previous_response_id until the
    model answers with text. Returns every response's output (ids stripped) and its
    (input_tokens, output_tokens)."""
    client = sync_client(url)
    outputs: list[list[dict[str, Any]]] = []
    usage: list[tuple[int, int]] = []
    previous: str | None = None
    with client.responses.connect() as conn:
        for user in USER_TURNS:
            new_input: list[dict[str, Any]] = [{"role": "user", "content": user}]
            while True:
                fields: dict[str, Any] = {
                    "model": model,
                    "instructions": INSTRUCTIONS,
                    "tools": TOOLS,
                    "input": new_input,
                    "store": False,
                }
                if previous is not None:
                    fields["previous_response_id"] = previous
                conn.response.create(**fields)
                for event in conn:
                    if event.type in ("response.completed", "response.failed", "error"):
                        break
                assert event.type == "response.completed", event
                response = event.response
                previous = response.id
                outputs.append([strip_ids(o) for o in response.output])
                assert response.usage is not None
                usage.append((response.usage.input_tokens, response.usage.output_tokens))
                new_input = tool_outputs(response.output)
                if not new_input:
                    break
    return outputs, usage


def sdk_http(url: str, model: str, stream: bool) -> list[list[dict[str, Any]]]:
    """The same two user turns over HTTP: not streamed, continued with previous_response_id
    (the stored parent); streamed, stateless (the whole history sent each time)."""
    client = sync_client(url)
    outputs: list[list[dict[str, Any]]] = []
    previous: str | None = None
    history: list[Any] = []
    for user in USER_TURNS:
        new_input: list[Any] = [{"role": "user", "content": user}]
        while True:
            fields: dict[str, Any] = {"model": model, "instructions": INSTRUCTIONS, "tools": TOOLS}
            if stream:
                history.extend(new_input)
                with client.responses.stream(input=history, **fields) as events:
                    response = events.get_final_response()
                history.extend(
                    o.model_dump(mode="json", exclude_none=True) for o in response.output
                )
            else:
                if previous is not None:
                    fields["previous_response_id"] = previous
                response = client.responses.create(input=new_input, **fields)
                previous = response.id
            assert response.status == "completed", response
            outputs.append([strip_ids(o) for o in response.output])
            new_input = tool_outputs(response.output)
            if not new_input:
                break
    return outputs


def assert_scenario_shape(outputs: list[list[dict[str, Any]]]) -> None:
    """Per user turn: one response with two parallel calls, then a text answer."""
    kinds = [[o["type"] for o in output] for output in outputs]
    assert kinds == [["function_call"] * 2, ["message"]] * len(USER_TURNS), kinds


async def test_openai_sdk_websocket_through_gateway_equals_direct() -> None:
    with trio.fail_after(DEADLINE):
        async with open_pair() as (a, b, backend):
            direct, direct_usage = await run_in_thread(sdk_websocket, a, SIM_MODEL)
            via, via_usage = await run_in_thread(sdk_websocket, b, "up")
    assert_scenario_shape(direct)
    assert via == direct
    # B reports the upstream's usage, which is A's count of the same context: equal too.
    assert via_usage == direct_usage
    assert backend.counters.requests == len(direct)
    assert (backend.counters.retries, backend.counters.failures) == (0, 0)


async def test_openai_sdk_http_through_gateway_equals_direct() -> None:
    with trio.fail_after(DEADLINE):
        async with open_pair() as (a, b, _backend):
            for stream in (False, True):
                direct = await run_in_thread(sdk_http, a, SIM_MODEL, stream)
                via = await run_in_thread(sdk_http, b, "up", stream)
                assert_scenario_shape(direct)
                assert via == direct, stream
                # WebSocket mode, HTTP and its streaming see the same conversation.
                if not stream:
                    first = direct
                else:
                    assert direct == first


# --- the Agents SDK ------------------------------------------------------------------------------


def agents_run(url: str, model: str, transport: str) -> dict[str, Any]:
    """An agent with two function tools, two user turns (the second continues the first's
    history), over a WebSocket session or over HTTP with OpenAIResponsesModel. Returns each
    turn's model outputs (ids stripped), the tool calls made and the final outputs."""
    import agents

    agents.set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(("get_weather", city))
        return f"sunny in {city}"

    @agents.function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return f"noon in {city}"

    async def main() -> dict[str, Any]:
        turns: list[list[dict[str, Any]]] = []
        finals: list[str] = []
        history: list[Any] = []

        async def two_turns(run: Any, agent: Any) -> None:
            nonlocal history
            for user in USER_TURNS:
                result = await run(agent, [*history, {"role": "user", "content": user}])
                turns.append(
                    [strip_ids(o) for response in result.raw_responses for o in response.output]
                )
                finals.append(result.final_output)
                history = result.to_input_list()

        if transport == "websocket":
            agent = agents.Agent(
                name="weather",
                instructions=INSTRUCTIONS,
                model=model,
                tools=[get_weather, get_time],
            )
            async with agents.responses_websocket_session(api_key="sk-test", base_url=url) as ws:
                await two_turns(ws.run, agent)
        else:
            client = openai.AsyncOpenAI(base_url=url, api_key="sk-test", max_retries=0)
            agent = agents.Agent(
                name="weather",
                instructions=INSTRUCTIONS,
                model=agents.OpenAIResponsesModel(model=model, openai_client=client),
                tools=[get_weather, get_time],
            )
            await two_turns(agents.Runner.run, agent)
            await client.close()
        return {"turns": turns, "calls": calls, "finals": finals}

    return asyncio.run(main())


async def test_agents_sdk_through_gateway_equals_direct() -> None:
    with trio.fail_after(DEADLINE):
        async with open_pair() as (a, b, _backend):
            results = {}
            for transport in ("websocket", "http"):
                direct = await run_in_thread(agents_run, a, SIM_MODEL, transport)
                via = await run_in_thread(agents_run, b, "up", transport)
                assert via == direct, transport
                results[transport] = direct
    direct = results["websocket"]
    # Each user turn: two parallel calls run by the agent, then the final text.
    assert len(direct["calls"]) == 2 * len(USER_TURNS)
    assert [[o["type"] for o in turn] for turn in direct["turns"]] == [
        ["function_call", "function_call", "message"]
    ] * len(USER_TURNS)
    assert all(isinstance(f, str) and f for f in direct["finals"])
    assert results["http"] == direct


# --- the work counters: what B encodes and what it sends -----------------------------------------


async def test_follow_up_encodes_only_new_messages_but_sends_the_whole_conversation() -> None:
    """A fake upstream answers the first turn with two parallel calls and any later turn with
    text; it records every body. B's `messages_encoded` counter shows the encoding work."""

    async def scripted(exchange: Exchange) -> None:
        last = exchange.body["messages"][-1]
        if last["role"] == "user":
            await exchange.stream(
                call_chunks([("get_weather", '{"city":"Paris"}'), ("get_time", '{"city":"Paris"}')])
            )
        else:
            await exchange.stream(text_chunks(["Sunny", " at", " noon."]))

    user = {"type": "message", "role": "user", "content": "Weather and time in Paris?"}
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(scripted) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url)
            backend = backend_of(registry)
            async with open_rollout(registry=registry) as b:
                async with open_ws(b) as ws:

                    async def create(**fields: Any) -> dict[str, Any]:
                        await ws.send(
                            {
                                "type": "response.create",
                                "model": "up",
                                "instructions": INSTRUCTIONS,
                                "tools": TOOLS,
                                "store": False,
                                **fields,
                            }
                        )
                        while True:
                            event = await ws.next_event()
                            if event["type"] in ("response.completed", "response.failed", "error"):
                                assert event["type"] == "response.completed", event
                                response: dict[str, Any] = event["response"]
                                return response

                    first = await create(input=[user])
                    assert backend.counters.messages_encoded == 1  # the user message
                    calls = first["output"]
                    outputs = [
                        {"type": "function_call_output", "call_id": c["call_id"], "output": "ok"}
                        for c in calls
                    ]
                    before = backend.counters.messages_encoded
                    second = await create(previous_response_id=first["id"], input=outputs)
                    assert second["output"][0]["content"][0]["text"] == "Sunny at noon."
                    # Only the new messages: the assistant tool_calls group and two tool results.
                    assert backend.counters.messages_encoded - before == 3

                # Stateless (a new HTTP session, the whole history): everything encoded again.
                before = backend.counters.messages_encoded
                async with httpx.AsyncClient(timeout=10) as client:
                    resp = await client.post(
                        f"{b}/responses",
                        json={
                            "model": "up",
                            "instructions": INSTRUCTIONS,
                            "tools": TOOLS,
                            "store": False,
                            "input": [user, *calls, *outputs],
                        },
                    )
                assert resp.json()["status"] == "completed"
                assert backend.counters.messages_encoded - before == 4
                assert await healthz(b) == 200

    # What the upstream received: the whole conversation every time.
    assert upstream.hits == 3
    first_body, follow_up, stateless = upstream.bodies
    system = {"role": "system", "content": INSTRUCTIONS}
    assert first_body["messages"] == [system, {"role": "user", "content": user["content"]}]
    assert follow_up["messages"][:2] == first_body["messages"]
    group, *tools = follow_up["messages"][2:]
    assert group == {  # empty text: null is refused by some servers, a missing one breaks others
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": c["call_id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls
        ],
    }
    assert tools == [{"role": "tool", "tool_call_id": c["call_id"], "content": "ok"} for c in calls]
    # The stateless follow-up sends exactly the same body as the cached one.
    assert stateless == follow_up
    assert follow_up["model"] == SIM_MODEL and follow_up["parallel_tool_calls"] is True
    assert [t["function"]["name"] for t in follow_up["tools"]] == ["get_weather", "get_time"]


# --- the benchmark can target a gateway -----------------------------------------------------------

BENCH_MODES = ("http-stateless", "http-chain", "ws-chain")


async def test_bench_runs_against_the_gateway(tmp_path: Path) -> None:
    """`rollout bench --url B --model up` with its smallest plan: one scenario of two steps,
    one repetition, no overhead phase, no concurrency sweep. B forwards every turn to A. The
    ws-rollout mode is left out: with `--model` the bench forces calls with tool_choice per
    turn, which one long-lived rollout response cannot do (the bench says so itself)."""
    out = tmp_path / "bench"
    with trio.fail_after(DEADLINE):
        async with open_rollout() as a:
            registry = gateway_registry(a, model="sim")
            async with open_rollout(registry=registry) as b:
                done = await trio.run_process(
                    [
                        sys.executable, "-m", "rollout", "bench",
                        "--url", f"gateway={b}", "--model", "up",
                        "--modes", ",".join(BENCH_MODES),
                        "--scenario", "alpha-demo", "--steps", "2", "--repetitions", "1",
                        "--tool-tokens", "20", "--tool-latency-ms", "0",
                        "--output-tokens", "8", "--prompt-tokens", "20",
                        "--no-overhead-phase", "--tps", "4000", "--concurrency", "0",
                        "--no-plots", "--no-progress", "--timeout", "20", "--out", str(out),
                    ],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    cwd=ROOT,
                )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    results = json.loads((out / "results.json").read_text())
    (server,) = results["servers"]
    assert server["label"] == "gateway" and server["url"] == b
    assert not [n for n in server["notes"] if "failed" in n], server["notes"]
    rollouts = results["rollouts"]
    assert {r["mode"] for r in rollouts} == set(BENCH_MODES)
    assert all(r["turns"] == 3 for r in rollouts)  # two tool calls, then the answer
    assert all(r["counters"]["responses_failed"] == 0 for r in rollouts)
    # Every mode showed the upstream the same conversation, so got the same outputs.
    assert len({r["transcript_digest"] for r in rollouts}) == 1
    counters = backend_of(registry).counters
    assert counters.requests >= 3 * len(BENCH_MODES)
    assert (counters.retries, counters.failures) == (0, 0)
