"""The official `openai` SDK against a real rollout server on loopback.

The SDK is the oracle: the clients run with `_strict_response_validation=True`, so every HTTP
response and every server-sent event is validated against the SDK's pydantic types, and every
WebSocket frame is validated with a `TypeAdapter` of the SDK's `ResponsesServerEvent` union
(the SDK itself only constructs WebSocket events, unchecked). Blocking clients run in a worker
thread; the async client runs in asyncio inside a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
import trio
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.responses_server_event import ResponsesServerEvent, ResponseWsError
from pydantic import TypeAdapter

from tests.server_harness import WEATHER_TOOLS, open_test_server, run_in_thread

DEADLINE = 30
WS_EVENT: TypeAdapter[ResponsesServerEvent] = TypeAdapter(ResponsesServerEvent)
STREAM_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url, api_key="sk-test", max_retries=0, timeout=10, _strict_response_validation=True
    )


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta type collapsed to one."""
    out: list[str] = []
    for t in types:
        if not (out and out[-1] == t and t.endswith(".delta")):
            out.append(t)
    return out


# --- HTTP -------------------------------------------------------------------------------------


def http_text_round(url: str) -> dict[str, Any]:
    client = sync_client(url)
    plain = client.responses.create(model="sim:tokens=40", input="Tell me something.")
    events = list(
        client.responses.create(model="sim:tokens=40", input="Tell me something.", stream=True)
    )
    return {"plain": plain, "events": events}


async def test_http_create_plain_and_streamed(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            got = await run_in_thread(http_text_round, url)
    plain: Response = got["plain"]
    events: list[Any] = got["events"]
    assert isinstance(plain, Response)
    assert plain.status == "completed" and plain.object == "response"
    assert plain.output_text and [o.type for o in plain.output] == ["message"]
    assert plain.usage is not None and plain.usage.output_tokens == 40
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens

    # Every event is an SDK type (strict validation parsed it) and re-validates as one.
    for event in events:
        STREAM_EVENT.validate_python(event.model_dump(mode="json"))
    types = [e.type for e in events]
    assert collapse(types) == [
        "response.created",
        "response.in_progress",
        *TEXT_EVENTS,
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    text_done = next(e for e in events if e.type == "response.output_text.done")
    part_done = next(e for e in events if e.type == "response.content_part.done")
    item_done = next(e for e in events if e.type == "response.output_item.done")
    assert deltas == text_done.text == part_done.part.text == item_done.item.content[0].text
    assert deltas == final.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {item_done.item.id}
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert events[0].response.id == final.id
    # The simulated model is deterministic: the same request gives the same text.
    assert final.output_text == plain.output_text


def http_tool_stream(url: str) -> list[Any]:
    client = sync_client(url)
    return list(
        client.responses.create(
            model="sim:steps=2,parallel=2",
            input="weather and time in Paris?",
            tools=WEATHER_TOOLS,  # type: ignore[arg-type]
            stream=True,
        )
    )


async def test_http_streamed_function_calls(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            events = await run_in_thread(http_tool_stream, url)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    calls = [o for o in events[-1].response.output if o.type == "function_call"]
    assert len(calls) == 2
    for index, call in enumerate(calls):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert collapse([e.type for e in mine]) == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        added = mine[0].item
        assert (added.type, added.call_id, added.name, added.arguments) == (
            "function_call",
            call.call_id,
            call.name,
            "",
        )
        deltas = "".join(e.delta for e in mine if e.type.endswith(".delta"))
        assert deltas == mine[-2].arguments == call.arguments
        assert all(e.item_id == call.id != call.call_id for e in mine[1:-1])
        assert "city" in json.loads(call.arguments)


def http_retrieve_delete(url: str) -> dict[str, Any]:
    client = sync_client(url)
    created = client.responses.create(model="sim", input="remember this")
    got = client.responses.retrieve(created.id)
    client.responses.delete(created.id)
    try:
        client.responses.retrieve(created.id)
    except openai.NotFoundError as exc:
        gone: Any = exc
    else:  # pragma: no cover
        gone = None
    try:
        client.responses.delete(created.id)
    except openai.NotFoundError as exc:
        gone_again: Any = exc
    else:  # pragma: no cover
        gone_again = None
    return {"created": created, "got": got, "gone": gone, "gone_again": gone_again}


async def test_http_retrieve_and_delete(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            got = await run_in_thread(http_retrieve_delete, url)
    assert got["got"].id == got["created"].id
    assert got["got"].output_text == got["created"].output_text
    for error in (got["gone"], got["gone_again"]):
        assert isinstance(error, openai.NotFoundError)
        assert error.status_code == 404
        assert error.code == "response_not_found"


# --- WebSocket mode (client.responses.connect()) ---------------------------------------------

MODEL = "sim:steps=2"


def next_turn(response: Any) -> list[dict[str, Any]]:
    return [
        {"type": "function_call_output", "call_id": o.call_id, "output": f"{o.name}: sunny, 21C"}
        for o in response.output
        if o.type == "function_call"
    ]


def check_turn(events: list[Any], turn: int) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    output = events[-1].response.output
    if turn < 2:
        assert [o.type for o in output] == ["function_call"]
    else:
        assert [o.type for o in output] == ["message"]
        assert events[-1].response.output_text


def ws_conversation_sync(url: str) -> list[list[Any]]:
    client = sync_client(url)
    turns: list[list[Any]] = []
    with client.responses.connect() as conn:
        # A request error first: the nested error event is an SDK type too, and the socket
        # stays usable.
        conn.response.create(model="gpt-nope", input="hi")
        error = WS_EVENT.validate_json(conn.recv_bytes())
        assert isinstance(error, ResponseWsError)
        assert (error.status, error.error.code, error.error.param) == (
            404,
            "model_not_found",
            "model",
        )
        kwargs: dict[str, Any] = {"input": "What's the weather in Paris?"}
        for _turn in range(3):
            conn.response.create(model=MODEL, tools=WEATHER_TOOLS, store=False, **kwargs)  # type: ignore[arg-type]
            events: list[Any] = []
            while not events or events[-1].type not in TERMINAL:
                events.append(WS_EVENT.validate_json(conn.recv_bytes()))
            turns.append(events)
            final = events[-1].response
            kwargs = {"input": next_turn(final), "previous_response_id": final.id}
    return turns


def ws_conversation_async(url: str) -> list[list[Any]]:
    async def main() -> list[list[Any]]:
        client = openai.AsyncOpenAI(
            base_url=url,
            api_key="sk-test",
            max_retries=0,
            timeout=10,
            _strict_response_validation=True,
        )
        turns: list[list[Any]] = []
        async with client.responses.connect() as conn:
            kwargs: dict[str, Any] = {"input": "What's the weather in Paris?"}
            for _turn in range(3):
                await conn.response.create(model=MODEL, tools=WEATHER_TOOLS, store=False, **kwargs)  # type: ignore[arg-type]
                events: list[Any] = []
                while not events or events[-1].type not in TERMINAL:
                    events.append(WS_EVENT.validate_json(await conn.recv_bytes()))
                turns.append(events)
                final = events[-1].response
                kwargs = {"input": next_turn(final), "previous_response_id": final.id}
        await client.close()
        return turns

    return asyncio.run(main())


@pytest.mark.parametrize(
    "driver", [ws_conversation_sync, ws_conversation_async], ids=["sync", "async"]
)
async def test_websocket_three_turn_tool_conversation(tmp_path: Path, driver: Any) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            turns = await run_in_thread(driver, url)
    assert len(turns) == 3
    ids = []
    for n, events in enumerate(turns):
        check_turn(events, n)
        final = events[-1].response
        ids.append(final.id)
        assert final.store is False
        assert final.previous_response_id == (ids[-2] if n else None)
    assert len(set(ids)) == 3


async def test_sync_and_async_clients_see_the_same_conversation(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            a = await run_in_thread(ws_conversation_sync, url)
            b = await run_in_thread(ws_conversation_async, url)

    def shape(turns: list[list[Any]]) -> list[Any]:
        out = []
        for events in turns:
            for o in events[-1].response.output:
                dumped = o.model_dump(mode="json", exclude={"id", "call_id"})
                out.append(dumped)
        return out

    assert shape(a) == shape(b)
