"""Fuzzing a live server: WebSocket frames and HTTP bodies, generated.

Each example opens a real server (in-process, on loopback) and sends a generated sequence of
client messages: valid `response.create` / `response.append` events and items of every kind
(random fields, random models), the same with one to three mutations (keys deleted, values of
the wrong type, unknown keys, nulls), arbitrary JSON, and text that is not JSON; over
WebSocket as frames and over HTTP as `POST /v1/responses` bodies. After each WebSocket message a
probe create must complete on the same socket (the socket is alive and its FIFO moved on).

What must never happen: an `error` with a 5xx status or a `response.failed` with `server_error`
(an unexpected exception inside the server), the socket closing, an HTTP 500, or a hang (every
example runs under a deadline). Every event is also checked by the schema hook (conftest).

`ROLLOUT_FUZZ_EXAMPLES` sets the number of examples: CI runs the short default; a longer run
(README: `ROLLOUT_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_server.py`) searches deeper.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocol as p
from tests.server_harness import open_test_server, open_ws
from tests.strategies import client_events, json_values, mutations

EXAMPLES = int(os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "25"))
DEADLINE = 60
MODELS = ["sim:tokens=3", "sim:steps=2,tokens=3", "sim", "nope", "sim:tps=1e308"]


def _tame(event: Any) -> Any:
    """A generated create made runnable more often: a sim model half the time, never the
    rollout extension (a suspended rollout waits for appends the fuzzer does not send)."""
    if isinstance(event, dict):
        event = {k: v for k, v in event.items() if k != "rollout"}
    return event


@st.composite
def messages(draw: st.DrawFn) -> tuple[str, str]:
    """(kind, text): a WebSocket message or an HTTP body."""
    kind = draw(st.sampled_from(["valid", "mutated", "json", "text"]))
    if kind == "valid":
        event = p.to_wire(draw(client_events))
        if event.get("type") == "response.create":
            event["model"] = draw(st.sampled_from(MODELS))
        value: Any = _tame(event)
    elif kind == "mutated":
        value = _tame(draw(mutations(client_events)))
    elif kind == "json":
        value = draw(json_values)
    else:
        return kind, draw(st.text(max_size=200))
    return kind, json.dumps(value)


def check(event: Any) -> None:
    if event.type == "error":
        assert event.status is None or event.status < 500, event
    if event.type == "response.failed":
        error = event.response.error
        assert error is None or error.code != "server_error", event


async def probe(ws: Any, n: int) -> None:
    """A create that must complete after whatever came before it on this socket."""
    await ws.send(
        {
            "type": "response.create",
            "model": "sim:tokens=2",
            "input": "probe",
            "store": False,
            "metadata": {"probe": str(n)},
        }
    )
    while True:
        event = await ws.recv()
        check(event)
        if event.type == "response.completed" and event.response.metadata.get("probe") == str(n):
            return


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(frames=st.lists(messages(), min_size=1, max_size=8), bodies=st.lists(messages(), max_size=4))
async def test_fuzzed_frames_and_bodies_never_break_the_server(
    frames: list[tuple[str, str]], bodies: list[tuple[str, str]]
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            async with open_ws(url) as ws:
                for n, (_kind, text) in enumerate(frames):
                    await ws.send_raw(text)
                    await probe(ws, n)
            async with httpx.AsyncClient(timeout=DEADLINE) as client:
                for _kind, text in bodies:
                    body = text
                    try:
                        parsed = json.loads(text)
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):  # the HTTP body has no `type`
                        parsed.pop("type", None)
                        body = json.dumps(parsed)
                    resp = await client.post(
                        f"{url}/responses",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                    assert resp.status_code < 500, (resp.status_code, resp.text, body[:500])
                    assert resp.headers["content-type"].startswith("application/json")
                    resp.json()  # never an empty or non-JSON body
