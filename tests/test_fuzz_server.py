"""Fuzzing a live server: WebSocket frames and HTTP bodies, generated.

Each example opens a real server (in-process, on loopback) and sends a generated sequence of
client messages: valid `response.create` / `response.append` events and items of every kind
(random fields, random models), the same with one to three mutations (keys deleted, values of
the wrong type, unknown keys, nulls), arbitrary JSON, and text that is not JSON; over
WebSocket as frames and over HTTP as `POST /v1/responses` bodies. After each WebSocket message a
probe create must complete on the same socket (the socket is alive and its FIFO moved on).

A second, model-based test drives one socket through its states (idle, a rollout suspended
with pending calls) with messages drawn from what the state allows: chains on responses that
ended on the socket, rollouts, partial, refused and resuming appends, fuzzed frames while idle;
each answer must be the one the model predicts (exact error code and param, no event for a
partial append, the same response resumed on a full one).

What must never happen: an `error` with a 5xx status or a `response.failed` with `server_error`
(an unexpected exception inside the server), the socket closing, an HTTP 500, or a hang (every
example runs under a deadline). Every event is also checked by the schema hook (conftest).

`ROLLOUT_FUZZ_EXAMPLES` sets the number of examples: CI runs the short default; a longer run
(docs/testing.md: `ROLLOUT_FUZZ_EXAMPLES=2000 HYPOTHESIS_PROFILE=thorough pytest
tests/test_fuzz_server.py`) searches deeper.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rollout import protocol as p

from tests.server_harness import open_test_server, open_ws
from tests.strategies import client_events, json_values, mutations

EXAMPLES = int(os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "25"))
DEADLINE = 60
TERMINAL_TYPES = {"response.completed", "response.incomplete", "response.failed", "error"}
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
    """A create that must complete after whatever came before it on this socket; then every
    lane a fuzzed create named is drained too (its response may still run beside the probe)."""
    await ws.send(
        {
            "type": "response.create",
            "model": "sim:tokens=2",
            "input": "probe",
            "store": False,
            "metadata": {"probe": str(n)},
        }
    )
    done = False
    while not done or ws.awaiting:
        event = await ws.recv()
        check(event)
        if event.type == "response.completed" and event.response.metadata.get("probe") == str(n):
            done = True


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
                    if resp.headers["content-type"].startswith("text/event-stream"):
                        # a fuzzed `stream: true`: the stream ends with a terminal event
                        last = [ln for ln in resp.text.splitlines() if ln.startswith("event:")]
                        assert last and last[-1].split(":", 1)[1].strip() in TERMINAL_TYPES, body
                        continue
                    assert resp.headers["content-type"].startswith("application/json")
                    resp.json()  # never an empty or non-JSON body


# --- model-based: one socket driven through its states, every answer predicted -------------

TOOLS = [
    {
        "type": "function",
        "name": "run",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    }
]
BARRIER_ID = "resp_barrier_never_issued"


class _Socket:
    """What the client knows of its socket: the responses that ended on it, and the rollout
    suspended on it (its id, its pending calls) if any."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.ended: list[str] = []
        self.rollout: str | None = None
        self.pending: list[str] = []

    async def events(self) -> list[Any]:
        events = await self.ws.until_terminal()
        for each in events:
            check(each)
        return events

    async def expect_error(self, code: str, param: str | None) -> None:
        event = await self.ws.recv()
        check(event)
        assert event.type == "error", event
        assert (event.error.code, event.error.param) == (code, param), event

    async def barrier(self) -> None:
        """Nothing was sent since the last message: the next frame is this append's error."""
        await self.ws.send({"type": "response.append", "response_id": BARRIER_ID, "input": []})
        await self.expect_error("rollout_not_found", "response_id")

    def settle(self, events: list[Any]) -> None:
        last = events[-1]
        assert last.type in ("response.completed", "response.done"), last
        if last.type == "response.done":
            self.rollout, self.pending = last.response.id, list(last.pending_call_ids)
            assert self.pending
        else:
            self.rollout, self.pending = None, []
            self.ended.append(last.response.id)

    async def append(self, items: list[dict[str, Any]], response_id: str | None = None) -> None:
        await self.ws.send(
            {
                "type": "response.append",
                "response_id": response_id or self.rollout,
                "input": items,
            }
        )


def _output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "done"}


async def _step_idle(sock: _Socket, data: st.DataObject, n: int) -> None:
    action = data.draw(
        st.sampled_from(["fuzz", "chain", "rollout", "append_ended", "append_unknown"]),
        label="idle action",
    )
    if action == "append_ended" and not sock.ended:
        action = "append_unknown"
    event(f"idle: {action}")
    if action == "fuzz":
        _kind, text = data.draw(messages(), label="frame")
        await sock.ws.send_raw(text)
        await probe(sock.ws, n)
    elif action in ("chain", "rollout"):
        create: dict[str, Any] = {
            "type": "response.create",
            "input": data.draw(st.sampled_from(["go", "again"]), label="input"),
            "store": data.draw(st.booleans(), label="store"),
        }
        if sock.ended and data.draw(st.booleans(), label="continue"):
            create["previous_response_id"] = data.draw(st.sampled_from(sock.ended), label="prev")
        if action == "rollout":
            steps = data.draw(st.integers(1, 3), label="steps")
            parallel = data.draw(st.integers(1, 3), label="parallel")
            create |= {
                "model": f"sim:steps={steps},parallel={parallel},tokens=3",
                "tools": TOOLS,
                "rollout": True,
            }
        else:
            create["model"] = "sim:tokens=3"
        await sock.ws.send(create)
        events = await sock.events()
        assert events[0].type == "response.created", events[0]
        sock.settle(events)
        if action == "chain":
            assert events[-1].type == "response.completed"
    elif action == "append_ended":
        await sock.append([], data.draw(st.sampled_from(sock.ended), label="ended id"))
        await sock.expect_error("response_already_completed", "response_id")
    else:
        await sock.append([], "resp_" + data.draw(st.text("abcdef0123456789", max_size=12)))
        await sock.expect_error("rollout_not_found", "response_id")


async def _step_suspended(sock: _Socket, data: st.DataObject) -> None:
    action = data.draw(
        st.sampled_from(["resume", "partial", "message_only", "unknown_call", "duplicate"]),
        label="suspended action",
    )
    pending = sock.pending
    if action == "partial" and len(pending) < 2:
        action = "message_only"
    event(f"suspended: {action}")
    if action == "resume":
        await sock.append([_output(c) for c in pending])
        events = await sock.events()
        assert events[0].type == "response.in_progress", events[0]
        assert events[0].response.id == sock.rollout
        sock.settle(events)
    elif action == "partial":
        answered = data.draw(
            st.lists(st.sampled_from(pending), min_size=1, max_size=len(pending) - 1, unique=True)
        )
        await sock.append([_output(c) for c in answered])
        await sock.barrier()  # accepted without any event
        sock.pending = [c for c in pending if c not in answered]
    elif action == "message_only":
        await sock.append([{"type": "message", "role": "user", "content": "note"}])
        await sock.barrier()
    elif action == "unknown_call":
        await sock.append([_output("call_not_pending")])
        await sock.expect_error("invalid_value", "input[0].call_id")
    else:
        await sock.append([_output(pending[0]), _output(pending[0])])
        await sock.expect_error("invalid_value", "input[1].call_id")


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data(), steps=st.integers(1, 14))
async def test_one_socket_through_its_states_answers_as_predicted(
    data: st.DataObject, steps: int
) -> None:
    """Stateful: each step's message is drawn from what the socket's state allows (a chain on
    a response that ended on it, a rollout, appends to the suspended rollout, partial,
    refused or resuming, fuzzed frames while idle), and every answer is the predicted one:
    the exact error code and param, no event for a partial append, a resume on the full one.
    At the end the rollout, if any, is resumed to completion and a probe completes."""
    with trio.fail_after(DEADLINE):
        # A connection caches its 8 most recently used responses by default; every probe and
        # fuzzed create adds one. A cache that holds them all keeps the model exact.
        async with open_test_server(max_cached_responses=1000) as url, open_ws(url) as ws:
            sock = _Socket(ws)
            for n in range(steps):
                if sock.rollout is None:
                    await _step_idle(sock, data, n)
                else:
                    await _step_suspended(sock, data)
            while sock.rollout is not None:
                await sock.append([_output(c) for c in sock.pending])
                sock.settle(await sock.events())
            await probe(ws, steps)
