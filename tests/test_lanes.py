"""A WebSocket lane's events go down in one chain of calls: from the sampling turn through the
response's steering gate into its lane's `EventSink` and the connection's outbox, with nothing
calling back up through the server in between (`engine/_lanes.py`, `engine/_sink.py`)."""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from rollout.engine import Engine, open_engine
from rollout.engine._outbox import Outbox
from rollout.engine._ws import WebSocketConnection, WebSocketLimits
from rollout.protocol import ResponseTracker

DEADLINE = 30


class Client:
    """The ASGI side of an in-process WebSocket connection: messages in, frames out."""

    def __init__(self) -> None:
        self._inbox_send, self.inbox = trio.open_memory_channel[dict[str, Any]](math.inf)
        self.outbox, self._outbox_recv = trio.open_memory_channel[dict[str, Any]](math.inf)

    async def send(self, message: dict[str, Any]) -> None:
        await self._inbox_send.send({"type": "websocket.receive", "text": json.dumps(message)})

    async def disconnect(self) -> None:
        await self._inbox_send.send({"type": "websocket.disconnect"})

    async def receive_text(self) -> str:
        text: str = (await self._outbox_recv.receive())["text"]
        return text

    async def receive(self) -> dict[str, Any]:
        event: dict[str, Any] = json.loads(await self.receive_text())
        return event


@asynccontextmanager
async def connected(engine: Engine) -> AsyncIterator[Client]:
    """A `WebSocketConnection` on `engine`, running until the client disconnects (at exit)."""
    client = Client()
    async with trio.open_nursery() as nursery:
        conn = WebSocketConnection(
            engine.session(owner="k"),
            client.outbox.send,
            client.inbox.receive,
            limits=WebSocketLimits(ping_interval=math.inf),
        )
        nursery.start_soon(conn.run)
        yield client
        await client.disconnect()


async def test_a_delta_goes_down_from_the_sampling_turn_to_the_outbox_in_one_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stacks: list[traceback.StackSummary] = []
    put = Outbox.put

    async def put_watched(self: Outbox, message: dict[str, Any], size: int) -> None:
        if not stacks and '"response.output_text.delta"' in message.get("text", ""):
            stacks.append(traceback.extract_stack())
        await put(self, message, size)

    monkeypatch.setattr(Outbox, "put", put_watched)
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine) as client:
            await client.send({"type": "response.create", "model": "sim:tokens=4", "input": "Hi"})
            while '"response.completed"' not in await client.receive_text():
                pass
    frames = [(Path(f.filename).name, f.name) for f in stacks[0]]
    turn = frames.index(("_sampling.py", "sample_turn"))
    assert frames[turn + 1 :] == [
        ("_steer.py", "emit"),
        ("_steer.py", "_send"),
        ("_lanes.py", "send"),
        ("test_lanes.py", "put_watched"),
    ]
    # Above the turn: the lane's runner, the session's door, the successor loop, the coroutine.
    assert [name for name, _ in frames[:turn]][-8:] == [
        "_ws.py",
        "_lanes.py",
        "_session.py",
        "_steered.py",
        "_rollout.py",
        "_rollout.py",
        "_rollout.py",
        "_rollout.py",
    ]


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("rollout", [False, True])
async def test_each_event_of_a_lane_is_checked_once(
    monkeypatch: pytest.MonkeyPatch, rollout: bool
) -> None:
    """The response's builder drives its lane's tracker (`TrackedSink`): the connection's
    `send` does not check the same event again. The tracker advances once per event sent,
    a rollout's suspension (`response.done`) and resume (`response.in_progress`) included
    (twice per event without the wiring: the builder's own tracker, then the lane's)."""
    checked: list[str] = []
    advance = ResponseTracker.advance

    def advance_counted(self: ResponseTracker, event_type: str, *a: Any, **kw: Any) -> Any:
        checked.append(event_type)
        return advance(self, event_type, *a, **kw)

    monkeypatch.setattr(ResponseTracker, "advance", advance_counted)
    sent: list[str] = []
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine) as client:
            create: dict[str, Any] = {"type": "response.create", "input": "Hi"}
            if rollout:
                create.update(model="sim:steps=2,tokens=4", tools=[TOOL], rollout=True)
            else:
                create.update(model="sim:tokens=4")
            await client.send(create)
            while True:
                event = await client.receive()
                sent.append(event["type"])
                if event["type"] == "response.completed":
                    break
                if event["type"] == "response.done":
                    outputs = [
                        {"type": "function_call_output", "call_id": call_id, "output": "ok"}
                        for call_id in event["pending_call_ids"]
                    ]
                    append = {
                        "type": "response.append",
                        "response_id": event["response"]["id"],
                        "input": outputs,
                    }
                    await client.send(append)
    assert len(sent) > 8  # created, in_progress, the message's events, completed
    if rollout:
        assert sent.count("response.done") == 2 and sent.count("response.in_progress") == 3
    assert len(checked) == len(sent), f"{len(checked)} checks for {len(sent)} events sent"
    assert checked == sent


async def test_the_next_create_on_a_lane_waits_for_the_terminal_event_its_builder_built() -> None:
    """A response's terminal event is built, then its usage commits, then it goes out; the
    builder moved the lane's tracker at the build. A create arriving on the same lane during
    the commit waits for the terminal event: the frames of the two responses do not
    interleave (with the lane handed on at the build, the second response's events overtook
    the first's `response.completed` and the connection broke: found by the fuzzer)."""
    committing, release = trio.Event(), trio.Event()
    frames: list[tuple[str, str]] = []  # (metadata tag, event type)
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            commit = engine.post.commit

            async def held_commit(job: Any) -> None:
                if not committing.is_set():  # the first response's commit waits
                    committing.set()
                    await release.wait()
                await commit(job)

            engine.post.commit = held_commit  # type: ignore[method-assign]
            async with connected(engine) as client:
                for tag in ("a", "b"):
                    create = {
                        "type": "response.create",
                        "model": "sim:tokens=2",
                        "input": "Hi",
                        "metadata": {"tag": tag},
                    }
                    await client.send(create)
                    if tag == "a":
                        await committing.wait()  # a's response.completed is built, not sent
                await trio.testing.wait_all_tasks_blocked()  # b's create was received
                release.set()
                while len([f for f in frames if f[1] == "response.completed"]) < 2:
                    event = await client.receive()
                    assert event["type"] != "error", event
                    response = event.get("response") or {}
                    tag_of = (response.get("metadata") or {}).get("tag", "?")
                    frames.append((tag_of, event["type"]))
    lifecycle = [f for f in frames if f[0] != "?"]
    assert lifecycle == [
        ("a", "response.created"),
        ("a", "response.in_progress"),
        ("a", "response.completed"),
        ("b", "response.created"),
        ("b", "response.in_progress"),
        ("b", "response.completed"),
    ]
