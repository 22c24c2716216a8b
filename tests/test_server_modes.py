"""One scripted agent conversation, three ways, against a real server: the same rollout.

The script: a user message, two tools, the model `sim:steps=3,parallel=2` (two parallel calls,
then one more, then a text answer), and tool outputs that are a function of the call and its
position. It runs

- as a rollout-mode response over a raw WebSocket (`"rollout": true`: one response that
  suspends with `response.done` at each tool turn and resumes on `response.append`),
- as a `previous_response_id` chain over a raw WebSocket (only new items per request),
- as stateless HTTP requests (`POST /v1/responses` with the whole history each time),

and the model's output items are identical modulo `id`/`call_id`, the usage totals are equal,
and the server's work counters show that only the stateless mode re-renders the history.

Cached tokens are the context a request did not render: for one conversation, the same in every
mode that keeps what it rendered, whatever the transport (a `previous_response_id` chain over
WebSocket or over HTTP, stateless HTTP through the render cache), each on a fresh server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio
from rollout import protocol as p

from tests.server_harness import (
    WEATHER_TOOLS,
    WsClient,
    fetch_counters,
    open_test_server,
    open_ws,
    strip_ids,
)

DEADLINE = 20
MODEL = "sim:steps=3,parallel=2"
USER = "Plan a day in Paris: check the weather and the local time."
INSTRUCTIONS = "You are a travel assistant."
MAX_TURNS = 10


def tool_output(call: dict[str, Any], n: int) -> dict[str, Any]:
    """The client's answer to a call: a function of the call and its position in the run."""
    return {
        "type": "function_call_output",
        "call_id": call["call_id"],
        "output": f"#{n} {call['name']}{call['arguments']} -> ok",
    }


def calls_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in output if o["type"] == "function_call"]


def common(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "tools": WEATHER_TOOLS,
        "store": False,
        **fields,
    }


def cached_of(response: dict[str, Any]) -> int:
    return int(response["usage"]["input_tokens_details"]["cached_tokens"])


def usage_totals(responses: list[dict[str, Any]]) -> tuple[int, int, int]:
    return (
        sum(r["usage"]["input_tokens"] for r in responses),
        sum(r["usage"]["output_tokens"] for r in responses),
        sum(r["usage"]["total_tokens"] for r in responses),
    )


async def run_rollout(client: WsClient) -> tuple[list[Any], list[dict[str, Any]], dict[str, Any]]:
    """(all events, all raw frames, the final response as wire JSON)."""
    start = len(client.raw)
    await client.send({"type": "response.create", "rollout": True, "input": USER, **common()})
    events: list[Any] = []
    n = 0
    for _ in range(MAX_TURNS):
        segment = await client.until_terminal()
        events.extend(segment)
        last = segment[-1]
        if last.type != "response.done":
            break
        assert isinstance(last, p.ResponseDone)
        assert last.response.status == "in_progress"
        # response.done names the step's items; they went out as output_item.done.
        output = [f["item"] for f in client.raw if f["type"] == "response.output_item.done"]
        by_id = {c["call_id"]: c for c in calls_of(output)}
        answers = []
        for call_id in last.pending_call_ids:
            answers.append(tool_output(by_id[call_id], n))
            n += 1
        await client.send(
            {"type": "response.append", "response_id": last.response.id, "input": answers}
        )
    frames = client.raw[start:]
    return events, frames, frames[-1]["response"]


Create = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def run_chain(create: Create) -> list[dict[str, Any]]:
    """A `previous_response_id` chain: each request sends only the new items (`create` sends
    one request's fields and returns its response, as wire JSON)."""
    responses: list[dict[str, Any]] = []
    new: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": USER}]
    previous: str | None = None
    n = 0
    for _ in range(MAX_TURNS):
        fields = common(input=new)
        if previous is not None:
            fields["previous_response_id"] = previous
        response = await create(fields)
        responses.append(response)
        previous = response["id"]
        new = []
        for call in calls_of(response["output"]):
            new.append(tool_output(call, n))
            n += 1
        if not new:
            return responses
    raise AssertionError("the chain did not end")


def over_ws(client: WsClient) -> Create:
    async def create(fields: dict[str, Any]) -> dict[str, Any]:
        events = await client.create(**fields)
        assert events[-1].type == "response.completed", client.raw[-1]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        response: dict[str, Any] = client.raw[-1]["response"]
        return response

    return create


def over_http(http: httpx.AsyncClient) -> Create:
    """Over HTTP each request names its parent in the store."""

    async def create(fields: dict[str, Any]) -> dict[str, Any]:
        resp = await http.post("/responses", json={**fields, "store": True})
        assert resp.status_code == 200, resp.text
        response: dict[str, Any] = resp.json()
        return response

    return create


async def run_stateless(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    responses: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": USER}]
    n = 0
    for _ in range(MAX_TURNS):
        resp = await http.post("/responses", json=common(input=history))
        assert resp.status_code == 200, resp.text
        response = resp.json()
        assert response["status"] == "completed"
        responses.append(response)
        history.extend(response["output"])
        calls = calls_of(response["output"])
        for call in calls:
            history.append(tool_output(call, n))
            n += 1
        if not calls:
            return responses
    raise AssertionError("the conversation did not end")


async def test_three_modes_produce_the_same_rollout() -> None:
    with trio.fail_after(DEADLINE):
        async with (
            open_test_server() as url,
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            c0 = await fetch_counters(url)
            async with open_ws(url) as client:
                events, frames, final = await run_rollout(client)
                await client.assert_quiet()
            c1 = await fetch_counters(url)
            async with open_ws(url) as client:
                chain = await run_chain(over_ws(client))
            c2 = await fetch_counters(url)
            stateless = await run_stateless(http)
            c3 = await fetch_counters(url)

    # --- the rollout as a stream ---
    suspensions = [e for e in events if e.type == "response.done"]
    assert len(suspensions) == len(chain) - 1 == 2
    # One response: one id, sequence numbers from 0 by 1 across every suspension.
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {f["response"]["id"] for f in frames if "response" in f} == {final["id"]}
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    for done in suspensions:
        resumed = events[events.index(done) + 1]
        assert resumed.type == "response.in_progress"
    assert events[-1].type == "response.completed" and final["status"] == "completed"
    # The final response holds every output item streamed over the whole rollout.
    streamed = [f["item"] for f in frames if f["type"] == "response.output_item.done"]
    assert final["output"] == streamed
    # Suspensions name exactly the calls and the items of their turn (not the items before).
    step: list[tuple[int, dict[str, Any]]] = []
    for frame in frames:
        if frame["type"] == "response.output_item.done":
            step.append((frame["output_index"], frame["item"]))
        elif frame["type"] == "response.done":
            assert frame["response"] == {
                "id": final["id"],
                "object": "response",
                "status": "in_progress",
            }
            assert frame["output_indices"] == [i for i, _ in step]
            assert [c["call_id"] for c in calls_of([item for _, item in step])] == frame[
                "pending_call_ids"
            ]
            step = []
        elif frame["type"] == "response.in_progress" and "created_at" not in frame["response"]:
            assert frame["response"] == {
                "id": final["id"],
                "object": "response",
                "status": "in_progress",
            }

    # --- the three modes agree ---
    chain_items = [strip_ids(o) for r in chain for o in r["output"]]
    stateless_items = [strip_ids(o) for r in stateless for o in r["output"]]
    rollout_items = [strip_ids(o) for o in final["output"]]
    assert [o["type"] for o in chain_items] == [
        "function_call",
        "function_call",
        "function_call",
        "message",
    ]
    assert rollout_items == chain_items == stateless_items
    # Aggregate usage: the rollout's one usage is the sum over the chain's responses.
    rollout_usage = (
        final["usage"]["input_tokens"],
        final["usage"]["output_tokens"],
        final["usage"]["total_tokens"],
    )
    assert rollout_usage == usage_totals(chain) == usage_totals(stateless)

    # --- the work behind it ---
    rollout_work = {k: c1[k] - c0[k] for k in c0}
    chain_work = {k: c2[k] - c1[k] for k in c0}
    stateless_work = {k: c3[k] - c2[k] for k in c0}
    # Cached tokens are the input not rendered for the request: over the same inputs and
    # outputs, what one mode reports cached more, it rendered less.
    cached = {
        "rollout": final["usage"]["input_tokens_details"]["cached_tokens"],
        "chain": sum(cached_of(r) for r in chain),
        "stateless": sum(cached_of(r) for r in stateless),
    }
    rendered = {
        "rollout": rollout_work["tokens_rendered"],
        "chain": chain_work["tokens_rendered"],
        "stateless": stateless_work["tokens_rendered"],
    }
    assert len({cached[m] + rendered[m] for m in cached}) == 1, (cached, rendered)
    assert cached["chain"] > 0
    assert rollout_work["samplings"] == chain_work["samplings"] == stateless_work["samplings"] == 3
    # Every mode renders each context token once: the rollout, first, renders instructions
    # and tools too; the chain and stateless find them in the render cache, and stateless
    # finds its resent history there (the call ids differ per run, so only its own).
    assert chain_work["tokens_rendered"] == stateless_work["tokens_rendered"]
    assert rollout_work["tokens_rendered"] > chain_work["tokens_rendered"]
    assert chain_work["cache_hits"] == len(chain) - 1
    assert rollout_work["cache_hits"] == stateless_work["cache_hits"] == 0
    # New items validated: the user message and the three outputs, once each, in every mode
    # (the whole history per request for stateless, all but the new outputs found rendered).
    assert rollout_work["items_validated"] == chain_work["items_validated"] == 4
    assert stateless_work["items_validated"] == 4
    assert rollout_work["responses_completed"] == 1
    assert chain_work["responses_completed"] == stateless_work["responses_completed"] == 3


async def test_cached_tokens_are_the_same_over_every_transport() -> None:
    """One conversation, each way on a fresh server: per response, the same input and cached
    tokens. The first renders everything; each continuation renders only its new items, its
    parent kept by the connection (WebSocket), the render cache (HTTP: the parent stored), or
    the render cache again (stateless: the history resent)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            async with open_ws(url) as client:
                runs["ws chain"] = await run_chain(over_ws(client))
        async with open_test_server() as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
            runs["http chain"] = await run_chain(over_http(http))
        async with open_test_server() as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
            runs["http stateless"] = await run_stateless(http)

    counts = {
        mode: [(r["usage"]["input_tokens"], cached_of(r)) for r in responses]
        for mode, responses in runs.items()
    }
    assert counts["ws chain"] == counts["http chain"] == counts["http stateless"], counts
    first, *later = counts["ws chain"]
    assert first[1] == 0 and later
    # A continuation's cached tokens are its parent's whole context: more than the parent's
    # input (its output too), less than its own (its new items).
    for before, after in zip(counts["ws chain"], later, strict=False):
        assert before[0] < after[1] < after[0]
