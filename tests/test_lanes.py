"""A WebSocket lane's events go down in one chain of calls: from the sampling turn through the
response's steering gate into its lane's `EventSink` and the connection's outbox, with nothing
calling back up through the server in between (`engine/_lanes.py`, `engine/_sink.py`)."""

from __future__ import annotations

import json
import math
import traceback
from pathlib import Path
from typing import Any

import pytest
import trio
from rollout.engine import open_engine
from rollout.engine._outbox import Outbox
from rollout.engine._ws import WebSocketConnection, WebSocketLimits

DEADLINE = 30


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
    inbox_send, inbox_recv = trio.open_memory_channel[dict[str, Any]](math.inf)
    outbox_send, outbox_recv = trio.open_memory_channel[dict[str, Any]](math.inf)
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, trio.open_nursery() as nursery:
            conn = WebSocketConnection(
                engine.session(owner="k"),
                outbox_send.send,
                inbox_recv.receive,
                limits=WebSocketLimits(ping_interval=math.inf),
            )
            nursery.start_soon(conn.run)
            create = {"type": "response.create", "model": "sim:tokens=4", "input": "Hi"}
            await inbox_send.send({"type": "websocket.receive", "text": json.dumps(create)})
            while '"response.completed"' not in (await outbox_recv.receive())["text"]:
                pass
            await inbox_send.send({"type": "websocket.disconnect"})
    frames = [(Path(f.filename).name, f.name) for f in stacks[0]]
    turn = frames.index(("_sampling.py", "sample_turn"))
    assert frames[turn + 1 :] == [
        ("_steer.py", "emit"),
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
