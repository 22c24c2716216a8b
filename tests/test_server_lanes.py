"""Lanes (`stream_id`) driven by the official `openai` SDK against a real server on loopback:
`client.responses.connect()` sends `stream_id` on `response.create`, every frame validates as
the SDK's `ResponsesServerEvent` union (the SDK is the oracle: its `*Ws*` event types carry
`stream_id`), two lanes interleave on one socket, a fork crosses lanes, and the lane errors are
the SDK's `ResponseWsError` with their codes. The docs' lanes example (docs/protocol.md) runs
as written."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import trio
from openai.types.responses.responses_server_event import ResponseWsError

from tests.doc_blocks import blocks
from tests.server_harness import WEATHER_TOOLS, open_test_server, run_in_thread
from tests.test_server_sdk import TERMINAL, WS_EVENT, sync_client

DEADLINE = 30


def sdk_lanes(url: str) -> dict[str, Any]:
    client = sync_client(url)
    out: dict[str, Any] = {"events": []}
    with client.responses.connect() as conn:

        def until_terminals(lanes: dict[str | None, int]) -> None:
            left = dict(lanes)
            while any(left.values()):
                event = WS_EVENT.validate_json(conn.recv_bytes())
                out["events"].append(event)
                if event.type in TERMINAL:
                    left[event.stream_id] -= 1

        # Two slow responses on two lanes at once.
        slow = "sim:tokens=60,tps=300"
        conn.response.create(model=slow, input="one", store=False, stream_id="a")
        conn.response.create(model=slow, input="two", store=False, stream_id="b")
        until_terminals({"a": 1, "b": 1})
        # A tool call on lane a, forked on lane c.
        conn.response.create(
            model="sim:steps=1",
            input="weather?",
            tools=WEATHER_TOOLS,
            store=False,
            stream_id="a",  # type: ignore[arg-type]
        )
        until_terminals({"a": 1})
        parent = out["events"][-1].response
        outputs = [
            {"type": "function_call_output", "call_id": o.call_id, "output": "sunny"}
            for o in parent.output
            if o.type == "function_call"
        ]
        conn.response.create(
            model="sim",
            input=outputs,  # type: ignore[arg-type]
            tools=WEATHER_TOOLS,  # type: ignore[arg-type]
            store=False,
            previous_response_id=parent.id,
            stream_id="c",
        )
        until_terminals({"c": 1})
        out["parent"] = parent.id
        # The lane errors.
        conn.response.create(model="sim", input="hi", stream_id="not a lane")
        out["invalid"] = WS_EVENT.validate_json(conn.recv_bytes())
        for n in range(30):  # lanes a, b and c are open: 29 more, then one too many
            conn.response.create(model="sim", input="hi", generate=False, stream_id=f"w{n}")
            event = WS_EVENT.validate_json(conn.recv_bytes())
            while event.type not in TERMINAL:
                event = WS_EVENT.validate_json(conn.recv_bytes())
            if n == 29:
                out["limit"] = event
    return out


async def test_the_sdk_drives_lanes(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            got = await run_in_thread(sdk_lanes, url)
    events = got["events"]
    by_lane: dict[Any, list[Any]] = {}
    for event in events:
        by_lane.setdefault(event.stream_id, []).append(event)
    assert set(by_lane) == {"a", "b", "c"}  # every event carries its lane
    order = [e.stream_id for e in events[: len(by_lane["b"]) * 2]]
    assert order.index("b") < max(i for i, lane in enumerate(order) if lane == "a")  # interleaved
    fork = by_lane["c"][-1]
    assert fork.type == "response.completed" and fork.response.previous_response_id == got["parent"]
    invalid, limit = got["invalid"], got["limit"]
    assert isinstance(invalid, ResponseWsError) and invalid.stream_id is None
    assert (invalid.status, invalid.error.code, invalid.error.param) == (
        400,
        "invalid_stream_id",
        "stream_id",
    )
    assert isinstance(limit, ResponseWsError) and limit.stream_id == "w29"
    assert (limit.error.code, limit.error.param) == ("websocket_stream_limit_reached", "stream_id")


def run_readme_lanes_example(url: str) -> str:
    (block,) = [b for b in blocks("python") if "stream_id=" in b.code]
    code = block.code.replace("http://127.0.0.1:8000/v1", url)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, block.id, "exec"), {})
    return printed.getvalue()


async def test_the_readme_lanes_example_runs() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            printed = await run_in_thread(run_readme_lanes_example, url)
    assert "'poem':" in printed and "'greeting':" in printed
