"""WebSocket mode, the error path, against a real server on loopback.

A table of bad inputs: each is answered with exactly one nested `error` event
(`{"type": "error", "status", "error": {"type", "code", "message", "param"}}`) with a pinned
code, param and status and no `response.created`, and the SAME socket then serves a valid
create. Then the cases whose answer is about the connection rather than one frame: the queue
limit (429 for the surplus, FIFO for the rest), the age limit (error, no response, close 1000),
eviction of a parent after a failed continuation, silence after a terminal event, and pings.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio_websocket
from rollout import protocol as p
from rollout.engine._ws import WebSocketLimits

from tests.server_harness import (
    WEATHER_TOOLS,
    WsClient,
    function_outputs,
    open_test_server,
    open_ws,
)

Frame = str | bytes | dict[str, Any]
# Every test here finishes in well under a second; the deadline catches hangs.
DEADLINE = 15


@attrs.define
class Ctx:
    url: str
    client: WsClient
    notes: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Case:
    id: str
    frame: Frame | Callable[[Ctx], Awaitable[Frame]]
    code: str
    param: str | None
    status: int = 400
    server: dict[str, Any] = attrs.field(factory=dict)
    message: str | None = None  # a part of the error message, where its wording matters
    # Runs after the error is checked, before the final valid create.
    after: Callable[[Ctx], Awaitable[None]] | None = None


def create(**fields: Any) -> dict[str, Any]:
    return {"type": "response.create", "model": "sim", "input": "hello", **fields}


async def _pending(ctx: Ctx) -> p.Response:
    """A completed store=false response that ends in an unanswered function call."""
    events = await ctx.client.create(
        model="sim:steps=1", input="weather?", tools=WEATHER_TOOLS, store=False
    )
    assert events[-1].type == "response.completed", events[-1]
    response: p.Response = events[-1].response
    assert [i.type for i in response.output] == ["function_call"]
    return response


async def _suspended_rollout(ctx: Ctx, model: str = "sim:steps=1") -> p.ResponseDone:
    events = await ctx.client.create(
        model=model, input="weather?", tools=WEATHER_TOOLS, store=False, rollout=True
    )
    done = events[-1]
    assert isinstance(done, p.ResponseDone), done
    return done


async def _resume(ctx: Ctx) -> None:
    """Answer the suspended rollout in ctx.notes correctly: it completes."""
    done: p.ResponseDone = ctx.notes["done"]
    outputs = [
        {"type": "function_call_output", "call_id": cid, "output": "sunny"}
        for cid in done.pending_call_ids
    ]
    events = await ctx.client.append(done.response.id, outputs)
    assert events[0].type == "response.in_progress"
    assert events[0].sequence_number == done.sequence_number + 1
    assert events[-1].type == "response.completed", events[-1]


# --- frames that need a conversation first ----------------------------------------------------


async def store_false_id_from_closed_connection(ctx: Ctx) -> Frame:
    async with open_ws(ctx.url) as other:
        events = await other.create(model="sim", input="hi", store=False)
    assert events[-1].type == "response.completed"
    return create(previous_response_id=events[-1].response.id, store=False)


async def orphan_function_call_output(ctx: Ctx) -> Frame:
    response = await _pending(ctx)
    output = {"type": "function_call_output", "call_id": "call_nope", "output": "x"}
    return create(previous_response_id=response.id, input=[output], store=False)


async def duplicate_function_call_output(ctx: Ctx) -> Frame:
    response = await _pending(ctx)
    outputs = function_outputs(response.output)
    events = await ctx.client.create(
        model="sim:steps=1",
        previous_response_id=response.id,
        input=outputs,
        tools=WEATHER_TOOLS,
        store=False,
    )
    assert events[-1].type == "response.completed"
    return create(
        model="sim:steps=1",
        previous_response_id=events[-1].response.id,
        input=outputs,
        tools=WEATHER_TOOLS,
        store=False,
    )


async def missing_tool_output(ctx: Ctx) -> Frame:
    response = await _pending(ctx)
    return create(
        model="sim:steps=1",
        previous_response_id=response.id,
        input="and tomorrow?",
        tools=WEATHER_TOOLS,
        store=False,
    )


async def append_to_completed_rollout(ctx: Ctx) -> Frame:
    ctx.notes["done"] = await _suspended_rollout(ctx)
    await _resume(ctx)
    return {
        "type": "response.append",
        "response_id": ctx.notes["done"].response.id,
        "input": [{"type": "function_call_output", "call_id": "call_x", "output": "late"}],
    }


async def append_unknown_call_id(ctx: Ctx) -> Frame:
    ctx.notes["done"] = await _suspended_rollout(ctx)
    return {
        "type": "response.append",
        "response_id": ctx.notes["done"].response.id,
        "input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
    }


async def append_while_running(ctx: Ctx) -> Frame:
    # The model waits 300 ms before its first token: an append answered within that window
    # reaches a running, not yet suspended, rollout.
    await ctx.client.send(
        create(
            model="sim:steps=1,ttft_ms=300",
            input="weather?",
            tools=WEATHER_TOOLS,
            store=False,
            rollout=True,
        )
    )
    created = await ctx.client.recv()
    assert created.type == "response.created"
    assert (await ctx.client.recv()).type == "response.in_progress"
    ctx.notes["response_id"] = created.response.id
    return {"type": "response.append", "response_id": created.response.id, "input": []}


async def finish_running_rollout(ctx: Ctx) -> None:
    events = await ctx.client.until_terminal()
    done = events[-1]
    assert isinstance(done, p.ResponseDone) and done.response.id == ctx.notes["response_id"]
    ctx.notes["done"] = done
    await _resume(ctx)


BAD_SCHEMA_TOOL = {
    "type": "function",
    "name": "f",
    "parameters": {"type": "object", "properties": {"a": {"type": "blah"}}},
}

CASES = [
    Case("malformed_json", '{"type": "response.create", ', "invalid_json", None),
    Case("binary_garbage", b"\xff\xfe\x00\x9cgarbage", "invalid_json", None),
    Case("json_array", '[{"type": "response.create"}]', "invalid_type", None),
    Case("json_string", '"response.create"', "invalid_type", None),
    Case("missing_type", {"model": "sim", "input": "hi"}, "missing_required_parameter", "type"),
    Case("unknown_event_type", {"type": "response.cancel"}, "invalid_value", "type"),
    Case("unknown_top_level_key", create(bogus=1), "unknown_parameter", "bogus"),
    Case("input_wrong_type", create(input=5), "invalid_type", "input"),
    Case(
        "bad_item_type",
        create(input=[{"type": "nope", "content": "x"}]),
        "invalid_value",
        "input[0].type",
    ),
    Case(
        "bad_role",
        create(input=[{"type": "message", "role": "wizard", "content": "x"}]),
        "invalid_value",
        "input[0].role",
    ),
    Case(
        "temperature_above_max",
        create(temperature=3),
        "decimal_above_max_value",
        "temperature",
    ),
    Case(
        "model_missing",
        {"type": "response.create", "input": "hi"},
        "missing_required_parameter",
        "model",
    ),
    Case("unknown_model", create(model="gpt-nope"), "model_not_found", "model", status=404),
    Case("bad_sim_param_value", create(model="sim:steps=many"), "invalid_value", "model"),
    Case("unknown_sim_param", create(model="sim:speed=1"), "invalid_value", "model"),
    Case(
        "unknown_previous_response_id",
        create(previous_response_id="resp_doesnotexist", store=False),
        "previous_response_not_found",
        "previous_response_id",
    ),
    Case(
        "store_false_id_from_closed_connection",
        store_false_id_from_closed_connection,
        "previous_response_not_found",
        "previous_response_id",
    ),
    Case(
        "orphan_function_call_output",
        orphan_function_call_output,
        "invalid_value",
        "input[0].call_id",
        message="No tool call found for function call output with call_id 'call_nope'",
    ),
    Case(
        "orphan_function_call_output_new_chain",
        create(input=[{"type": "function_call_output", "call_id": "call_x", "output": "x"}]),
        "invalid_value",
        "input[0].call_id",
    ),
    Case(
        "duplicate_function_call_output",
        duplicate_function_call_output,
        "invalid_value",
        "input[0].call_id",
        message="already has an output",
    ),
    Case(
        "missing_tool_output",
        missing_tool_output,
        "invalid_value",
        "input",
        message="No tool output found for function call",
    ),
    Case(
        "tool_choice_names_missing_tool",
        create(tools=WEATHER_TOOLS, tool_choice={"type": "function", "name": "get_stock"}),
        "invalid_value",
        "tool_choice",
        message="Tool choice 'get_stock' not found in 'tools' parameter",
    ),
    Case(
        "tool_invalid_json_schema",
        create(tools=[BAD_SCHEMA_TOOL]),
        "invalid_function_parameters",
        "tools[0].parameters",
    ),
    Case(
        "tool_parameters_not_object",
        create(tools=[{"type": "function", "name": "f", "parameters": {"type": "string"}}]),
        "invalid_function_parameters",
        "tools[0].parameters",
    ),
    Case(
        "tool_bad_name",
        create(tools=[{"type": "function", "name": "bad name!", "parameters": {}}]),
        "invalid_value",
        "tools[0].name",
    ),
    Case(
        "duplicate_tool_names",
        create(tools=[WEATHER_TOOLS[0], WEATHER_TOOLS[0]]),
        "invalid_value",
        "tools[1].name",
    ),
    Case(
        "oversized_message",
        json.dumps(create(input="x" * 5000)),
        "message_too_large",
        None,
        server={"max_message_size": 4096},
        message="limit of 4096 bytes",
    ),
    Case(
        "append_unknown_response",
        {"type": "response.append", "response_id": "resp_nope", "input": []},
        "rollout_not_found",
        "response_id",
    ),
    Case(
        "append_to_completed_rollout",
        append_to_completed_rollout,
        "response_already_completed",
        "response_id",
    ),
    Case(
        "append_while_running",
        append_while_running,
        "rollout_not_suspended",
        "response_id",
        after=finish_running_rollout,
    ),
    Case(
        "append_unknown_call_id",
        append_unknown_call_id,
        "invalid_value",
        "input[0].call_id",
        after=_resume,  # the rollout stays suspended and resumable
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_bad_input_answers_error_and_socket_stays_usable(case: Case) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(**case.server) as url, open_ws(url) as client:
            ctx = Ctx(url=url, client=client)
            frame = case.frame if not callable(case.frame) else await case.frame(ctx)
            if isinstance(frame, dict):
                await client.send(frame)
            else:
                await client.send_raw(frame)
            error = await client.recv()
            assert error.type == "error", error
            raw = client.raw[-1]
            assert set(raw) >= {"type", "status", "error"}
            assert set(raw["error"]) == {"type", "code", "message", "param"}
            assert raw["error"]["type"] == "invalid_request_error"
            assert raw["error"]["message"]
            assert (raw["status"], raw["error"]["code"], raw["error"]["param"]) == (
                case.status,
                case.code,
                case.param,
            ), raw
            if case.message is not None:
                assert case.message in raw["error"]["message"], raw
            if case.after is not None:
                await case.after(ctx)
            # Nothing else was answered for the bad frame, and the socket still works.
            await client.assert_quiet(0.02)
            events = await client.create(model="sim", input="still there?")
            assert events[0].type == "response.created"
            assert events[-1].type == "response.completed"


async def test_error_table_is_large_enough() -> None:
    assert len(CASES) >= 22
    assert len({c.id for c in CASES}) == len(CASES)


async def test_failed_continuation_evicts_its_parent() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url) as client:
            ctx = Ctx(url=url, client=client)
            parent = await _pending(ctx)
            # Continuing without the tool output fails ...
            await client.send(
                create(
                    model="sim:steps=1",
                    previous_response_id=parent.id,
                    input="and tomorrow?",
                    tools=WEATHER_TOOLS,
                    store=False,
                )
            )
            assert (await client.error()).error.code == "invalid_value"
            # ... and the parent is gone from the connection's cache (store=false: for good),
            # even for what would have been a valid continuation.
            await client.send(
                create(
                    model="sim:steps=1",
                    previous_response_id=parent.id,
                    input=function_outputs(parent.output),
                    tools=WEATHER_TOOLS,
                    store=False,
                )
            )
            error = await client.error()
            assert (error.status, error.error.code, error.error.param) == (
                400,
                "previous_response_not_found",
                "previous_response_id",
            )


async def test_too_many_queued_creates() -> None:
    """With one create allowed in the queue, the third of three sent at once is refused
    (429); the first two run to completion in the order sent."""
    with trio.fail_after(DEADLINE):
        async with (
            open_test_server(websocket_limits=WebSocketLimits(max_queued_creates=1)) as url,
            open_ws(url) as client,
        ):
            for n in range(3):
                await client.send(
                    create(
                        model="sim:tps=100,tokens=30", input=f"request {n}", metadata={"n": str(n)}
                    )
                )
            frames: list[Any] = []
            while sum(e.type in ("response.completed", "error") for e in frames) < 3:
                frames.append(await client.recv())
            errors = [e for e in frames if e.type == "error"]
            assert len(errors) == 1
            assert (errors[0].status, errors[0].error.code, errors[0].error.param) == (
                429,
                "too_many_queued_requests",
                None,
            )
            created = [e.response.metadata["n"] for e in frames if e.type == "response.created"]
            completed = [e.response.metadata["n"] for e in frames if e.type == "response.completed"]
            assert created == completed == ["0", "1"]
            # The error was about the surplus request: it arrived while the first still ran.
            first_done = next(i for i, e in enumerate(frames) if e.type == "response.completed")
            assert frames.index(errors[0]) < first_done
            await client.assert_quiet()


async def test_connection_age_limit() -> None:
    """A create started past the age limit is refused; the connection closes (1000) once no
    response runs. (An idle connection past its age closes at once, without a create, after
    an unsolicited `websocket_connection_limit_reached` error.)"""
    with trio.fail_after(DEADLINE):
        async with (
            open_test_server(websocket_limits=WebSocketLimits(connection_age_limit=0.5)) as url,
            open_ws(url) as client,
        ):
            # One second of streaming, then a create queued behind it on its lane: it starts
            # past the age limit.
            await client.send(create(model="sim:tokens=40,tps=40", store=False))
            await client.send(create(store=False))
            events = await client.until_terminal()
            assert events[-1].type == "response.completed"
            # The create's refusal, and the farewell the clock sends when the connection
            # goes idle past its age unless a refusal said it already (the two can cross).
            errors = []
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                while True:
                    errors.append(await client.error())
            reason = closed.value.reason
            assert reason is not None and reason.code == 1000
            assert 1 <= len(errors) <= 2
            for error in errors:
                assert (error.status, error.error.code, error.error.param) == (
                    400,
                    "websocket_connection_limit_reached",
                    None,
                )
            # No response was started for the second request.
            assert [f["type"] for f in client.raw].count("response.created") == 1
        async with (
            open_test_server(websocket_limits=WebSocketLimits(connection_age_limit=0.5)) as url,
            open_ws(url) as client,
        ):
            # Idle past its age: the error says why, unsolicited, then the close.
            error = await client.error()
            assert error.error.code == "websocket_connection_limit_reached"
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await client.recv()
            reason = closed.value.reason
            assert reason is not None and reason.code == 1000
            assert [f["type"] for f in client.raw] == ["error"]


async def test_no_frame_after_terminal_event_and_pings(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url, open_ws(url) as client:
            await client.ws.ping()
            events = await client.create(model="sim:steps=1", input="hi", tools=WEATHER_TOOLS)
            assert events[-1].type == "response.completed"
            await client.assert_quiet()
            # Also after a suspension and after an error.
            ctx = Ctx(url=url, client=client)
            ctx.notes["done"] = await _suspended_rollout(ctx)
            await client.assert_quiet()
            await _resume(ctx)
            await client.assert_quiet()
            await client.send_raw("nope")
            assert (await client.error()).error.code == "invalid_json"
            await client.assert_quiet()
            await client.ws.ping(b"still alive")


async def test_append_to_an_ended_response_is_known_past_the_cache() -> None:
    """The connection remembers the responses it ended (not only the 8 its cache keeps): an
    append naming the first of ten is `response_already_completed` (RX-4.2), and one naming
    a response of no connection is still `rollout_not_found` (RX-4.1)."""
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url) as client:
            ids = []
            for n in range(10):
                events = await client.create(model="sim:tokens=1", input=f"turn {n}", store=False)
                assert events[-1].type == "response.completed"
                ids.append(events[-1].response.id)
            for response_id, code in ((ids[0], "response_already_completed"),
                                      ("resp_elsewhere", "rollout_not_found")):  # fmt: skip
                await client.send(
                    {"type": "response.append", "response_id": response_id, "input": []}
                )
                error = await client.error()
                assert (error.error.code, error.error.param) == (code, "response_id")
