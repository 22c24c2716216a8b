"""Steering with the official `openai` SDK (`client.responses.connect()`, its
`conn.response.steer(...)`) against a real rollout server on loopback. Every frame is
validated strictly with the SDK's own `ResponsesServerEvent` union (the acknowledgements
included); sequence numbers are checked per response, steering answers in the stream of the
response they name.

- a steer sent while a slow `sim` response streams text gets `response.steer.accepted`; the
  response ends `incomplete` (reason `steered`) and a successor, `previous_response_id` the
  steered response, streams to `response.completed` with the steering input in its context;
- a steer sent while a function call's arguments stream gets `.accepted`, then the response
  completes owing the call and `response.steer.pending` names the owed output; the client's
  continuation with the output completes (the steering input prepended).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import trio
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter

from tests.server_harness import WEATHER_TOOLS, open_test_server, run_in_thread

DEADLINE = 60
WS_EVENT: TypeAdapter[ResponsesServerEvent] = TypeAdapter(ResponsesServerEvent)
# 1,000 tokens at 500 tokens/s: about 2 s to steer it in, on a loaded machine too.
SLOW_TEXT = "sim:tokens=1000,tps=500"
# One call whose arguments stream at 10 tokens/s (about a second), then text.
SLOW_CALL = "sim:steps=1,tps=10"


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url, api_key="sk-test", max_retries=0, timeout=10, _strict_response_validation=True
    )


def read_until(conn: Any, events: list[Any], done: Any) -> None:
    while not events or not done(events):
        events.append(WS_EVENT.validate_json(conn.recv_bytes()))


def steer_text(url: str) -> list[Any]:
    events: list[Any] = []
    with sync_client(url).responses.connect() as conn:
        conn.response.create(model=SLOW_TEXT, input="Write a long essay.", store=False)
        read_until(conn, events, lambda es: sum(e.type.endswith("text.delta") for e in es) >= 3)
        conn.response.steer(
            previous_response_id=events[0].response.id, input="Stop. Answer in one word."
        )
        read_until(conn, events, lambda es: es[-1].type == "response.completed")
    return events


def steer_call(url: str) -> tuple[list[Any], list[Any]]:
    events: list[Any] = []
    follow: list[Any] = []
    with sync_client(url).responses.connect() as conn:
        conn.response.create(
            model=SLOW_CALL,
            input="Weather in Paris?",
            tools=WEATHER_TOOLS,
            store=False,  # type: ignore[arg-type]
        )
        read_until(conn, events, lambda es: es[-1].type == "response.function_call_arguments.delta")
        first = events[0].response.id
        conn.response.steer(
            previous_response_id=first,
            input=[{"type": "message", "role": "user", "content": "Use Celsius."}],
        )
        read_until(conn, events, lambda es: es[-1].type == "response.steer.pending")
        pending = events[-1]
        outputs = [
            {"type": "function_call_output", "call_id": stub.call_id, "output": "sunny, 21C"}
            for stub in pending.required_input
        ]
        conn.response.create(
            model=SLOW_CALL,
            input=outputs,  # type: ignore[arg-type]
            previous_response_id=first,
            tools=WEATHER_TOOLS,  # type: ignore[arg-type]
            store=False,
        )
        read_until(conn, follow, lambda es: es[-1].type == "response.completed")
    return events, follow


def numbered_per_response(events: list[Any]) -> None:
    """Each response's events (its steering answers included) are numbered 0, 1, 2, ..."""
    expected = 0
    for event in events:
        if event.type == "response.created":
            expected = 0
        assert event.sequence_number == expected, (event.type, event.sequence_number, expected)
        expected += 1


async def test_sdk_steer_stops_a_text_response_and_its_successor_continues(
    tmp_path: Path,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            events = await run_in_thread(steer_text, url)
    numbered_per_response(events)
    types = [e.type for e in events]
    first = events[0].response.id
    [accepted] = [e for e in events if e.type == "response.steer.accepted"]
    assert accepted.steer.previous_response_id == first
    assert accepted.steer.id.startswith("steer_")
    [incomplete] = [e for e in events if e.type == "response.incomplete"]
    assert incomplete.response.id == first
    assert incomplete.response.incomplete_details.reason == "steered"
    assert incomplete.response.output[0].status == "incomplete"
    successor = events[types.index("response.incomplete") + 1]
    assert successor.type == "response.created"
    assert successor.response.previous_response_id == first
    assert successor.response.model == SLOW_TEXT and successor.response.store is False
    assert events[-1].response.id == successor.response.id
    assert events[-1].response.output_text


async def test_sdk_steer_while_a_call_streams_is_pending_then_prepended(
    tmp_path: Path,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            events, follow = await run_in_thread(steer_call, url)
    numbered_per_response(events)
    numbered_per_response(follow)
    types = [e.type for e in events]
    first = events[0].response.id
    assert types[-2:] == ["response.completed", "response.steer.pending"]
    [accepted] = [e for e in events if e.type == "response.steer.accepted"]
    completed, pending = events[-2:]
    calls = [o for o in completed.response.output if o.type == "function_call"]
    assert [c.status for c in calls] == ["completed"]  # the call was not cut
    assert pending.reason == "waiting_for_required_input"
    assert pending.steer.id == accepted.steer.id and pending.steer.previous_response_id == first
    assert [(s.type, s.call_id, s.name) for s in pending.required_input] == [
        ("function_call_output", calls[0].call_id, calls[0].name)
    ]
    assert follow[0].response.previous_response_id == first
    assert follow[-1].type == "response.completed"
