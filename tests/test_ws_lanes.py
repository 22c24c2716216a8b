"""Lanes (`stream_id`) through the engine's WebSocket connection, on trio's mock clock.

`WebSocketConnection` runs over in-memory ASGI `send`/`receive` with a real engine and the
paced `sim` model, so time is virtual and exact: two lanes' slow responses are both in
progress at once (sequential lanes would take twice as long), a lane is FIFO, the 17th
response in flight starts when one ends, every lane's latest response survives a busy cache,
forks cross lanes, a failed fork keeps its parent, the rollout extension runs on a lane while
another streams, and with every lane busy the connection holds a bounded number of creates.
Every frame is followed by the protocol's `ClientConnection` (strict: a frame out of its
lane's order fails the test) and every event's `stream_id` is checked against its request.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from rollout import protocol as p
from rollout.engine import Engine, open_engine
from rollout.engine._ws import WebSocketConnection, WebSocketLimits

DEADLINE = 120  # virtual seconds
SLOW = "sim:tokens=200,tps=100"  # two seconds of streaming on the mock clock
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


@attrs.define
class Frame:
    at: float  # trio time it was sent
    event: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.event["type"])

    @property
    def lane(self) -> str | None:
        return self.event.get("stream_id")


@attrs.define
class Peer:
    """The client end: sends JSON messages, reads frames (each followed by the protocol's
    client connection, strictly), and closes."""

    conn: WebSocketConnection
    inbox: trio.MemorySendChannel[dict[str, Any]]
    outbox: trio.MemoryReceiveChannel[dict[str, Any]]
    client: p.ClientConnection = attrs.field(factory=p.ClientConnection)
    frames: list[Frame] = attrs.field(factory=list)
    closed: int | None = None

    async def send(self, message: dict[str, Any]) -> None:
        self.client.sent_raw(message)
        await self.inbox.send({"type": "websocket.receive", "text": json.dumps(message)})

    async def create(self, **body: Any) -> None:
        await self.send({"type": "response.create", **body})

    async def next(self) -> Frame:
        message = await self.outbox.receive()
        if message["type"] == "websocket.close":
            self.closed = message.get("code", 1000)
            raise trio.EndOfChannel("closed")
        frame = Frame(trio.current_time(), json.loads(message["text"]))
        self.client.receive_json(frame.event)
        self.frames.append(frame)
        return frame

    async def until(self, done: Callable[[list[Frame]], bool]) -> list[Frame]:
        """Frames until `done(frames read so far)`."""
        read: list[Frame] = []
        while not done(read):
            read.append(await self.next())
        return read

    async def terminals(self, lanes: dict[str | None, int]) -> dict[str | None, list[Frame]]:
        """Frames until each lane has had its count of terminal events; frames by lane."""
        left = dict(lanes)
        by_lane: dict[str | None, list[Frame]] = {lane: [] for lane in lanes}
        while any(left.values()):
            frame = await self.next()
            if frame.type == "rollout.timing":
                continue
            assert frame.lane in by_lane, frame.event
            by_lane[frame.lane].append(frame)
            if frame.type in TERMINAL:
                left[frame.lane] -= 1
                assert left[frame.lane] >= 0, frame.event
        return by_lane


@asynccontextmanager
async def connected(
    engine: Engine, limits: WebSocketLimits | None = None, *, timing: bool = False
) -> AsyncIterator[Peer]:
    inbox_send, inbox_recv = trio.open_memory_channel[dict[str, Any]](math.inf)
    outbox_send, outbox_recv = trio.open_memory_channel[dict[str, Any]](math.inf)

    async def receive() -> dict[str, Any]:
        return await inbox_recv.receive()

    async def send(message: dict[str, Any]) -> None:
        await outbox_send.send(message)

    conn = WebSocketConnection(
        engine.session(owner="k"), send, receive, limits=limits or WebSocketLimits(), timing=timing
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        try:
            yield Peer(conn, inbox_send, outbox_recv)
        finally:
            inbox_send.send_nowait({"type": "websocket.disconnect"})


def lanes_of(frames: list[Frame]) -> set[str | None]:
    return {f.lane for f in frames}


def terminal(frames: list[Frame]) -> Frame:
    assert frames[-1].type in TERMINAL, frames[-1].event
    return frames[-1]


def first(frames: list[Frame], kind: str) -> Frame:
    return next(f for f in frames if f.type == kind)


def response_id(frames: list[Frame]) -> str:
    return str(terminal(frames).event["response"]["id"])


# --- concurrency ----------------------------------------------------------------------------------


async def check_two_lanes_run_at_once(limits: WebSocketLimits) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine, limits) as peer:
            start = trio.current_time()
            await peer.create(model=SLOW, input="one", store=False, stream_id="a")
            await peer.create(model=SLOW, input="two", store=False, stream_id="b")
            by_lane = await peer.terminals({"a": 1, "b": 1})
    a, b = by_lane["a"], by_lane["b"]
    assert lanes_of(a) == {"a"} and lanes_of(b) == {"b"}  # every event echoes its lane
    assert terminal(a).type == terminal(b).type == "response.completed"
    # Both in progress at once: b started before a ended, and both took the 2 s of one.
    assert first(b, "response.created").at < terminal(a).at, "lane b waited for lane a"
    assert max(terminal(a).at, terminal(b).at) - start < 2.5
    # Their deltas interleave on the socket.
    order = [f.lane for f in peer.frames if f.type == "response.output_text.delta"]
    switches = sum(1 for x, y in itertools.pairwise(order) if x != y)
    assert switches > 10


async def test_two_lanes_run_at_once(autojump_clock: trio.testing.MockClock) -> None:
    await check_two_lanes_run_at_once(WebSocketLimits())


async def test_lanes_run_one_at_a_time_with_one_place_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The broken variant of the test above: a connection that runs one response at a time
    (lanes, but `max_in_flight=1`) fails it, at the overlap."""
    with pytest.raises(AssertionError, match="lane b waited for lane a"):
        await check_two_lanes_run_at_once(WebSocketLimits(max_in_flight=1))


async def test_a_lane_is_fifo(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine) as peer:
            for n in range(2):
                await peer.create(model=SLOW, input=f"{n}", store=False, stream_id="a")
            frames = (await peer.terminals({"a": 2}))["a"]
    created = [f for f in frames if f.type == "response.created"]
    ends = [f for f in frames if f.type in TERMINAL]
    assert len(created) == len(ends) == 2
    assert frames.index(created[1]) > frames.index(ends[0])  # the second waited for the first
    assert created[1].at >= ends[0].at and ends[1].at - created[0].at >= 4


async def test_the_17th_response_in_flight_waits_for_a_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lanes = [f"lane-{n}" for n in range(17)]
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine) as peer:
            start = trio.current_time()
            for lane in lanes:
                await peer.create(model=SLOW, input=lane, store=False, stream_id=lane)
            by_lane = await peer.terminals(dict.fromkeys(lanes, 1))
    started = {
        lane: first(frames, "response.created").at - start for lane, frames in by_lane.items()
    }
    ended = {lane: terminal(frames).at - start for lane, frames in by_lane.items()}
    assert all(terminal(by_lane[lane]).type == "response.completed" for lane in lanes)
    assert max(started[lane] for lane in lanes[:16]) < 0.5  # 16 at once
    assert started["lane-16"] >= min(ended.values())  # the 17th: queued, not refused
    assert 3.5 < ended["lane-16"] < 5


# --- admission errors -----------------------------------------------------------------------------


async def test_bad_ids_and_the_33rd_lane_get_the_exact_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine) as peer:
            errors = []
            for bad in ("", "x" * 257, "no spaces"):
                await peer.create(model="sim", input="hi", stream_id=bad)
                errors.append((await peer.next()).event)
            for n in range(p.DEFAULT_MAX_LANES):
                await peer.create(model="sim", input="hi", generate=False, stream_id=f"l{n}")
                assert terminal(await peer.until(_ended)).lane == f"l{n}"
            await peer.create(model="sim", input="hi", stream_id="one-too-many")
            limit = (await peer.next()).event
            await peer.create(model="sim", input="hi", stream_id="l0")
            again = await peer.until(_ended)
            await peer.create(model="sim", input="hi")
            default = await peer.until(_ended)
    for error in errors:
        assert error == {
            "type": "error",
            "status": 400,
            "sequence_number": None,
            "error": {
                "type": "invalid_request_error",
                "code": "invalid_stream_id",
                "message": error["error"]["message"],
                "param": "stream_id",
            },
        }
        assert "256" in error["error"]["message"]
    assert limit == {
        "type": "error",
        "status": 400,
        "sequence_number": None,
        "error": {
            "type": "invalid_request_error",
            "code": "websocket_stream_limit_reached",
            "message": limit["error"]["message"],
            "param": "stream_id",
        },
        "stream_id": "one-too-many",
    }
    assert terminal(again).type == "response.completed" and lanes_of(again) == {"l0"}
    assert terminal(default).type == "response.completed" and lanes_of(default) == {None}


def _ended(frames: list[Frame]) -> bool:
    return bool(frames) and frames[-1].type in TERMINAL


# --- the cache across lanes -----------------------------------------------------------------------


async def _tool_call(peer: Peer, lane: str) -> tuple[str, list[dict[str, Any]]]:
    """A store: false response on `lane` ending in a function call: its id and outputs."""
    await peer.create(
        model="sim:steps=1", input="weather?", tools=TOOLS, store=False, stream_id=lane
    )
    frames = await peer.until(_ended)
    done = terminal(frames)
    assert done.type == "response.completed" and lanes_of(frames) == {lane}
    calls = [i for i in done.event["response"]["output"] if i["type"] == "function_call"]
    assert calls
    outputs = [
        {"type": "function_call_output", "call_id": c["call_id"], "output": "sunny"} for c in calls
    ]
    return done.event["response"]["id"], outputs


async def test_forks_cross_lanes_and_a_failed_fork_keeps_its_parent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine) as peer:
            parent, outputs = await _tool_call(peer, "source")
            common = {
                "model": "sim",
                "tools": TOOLS,
                "store": False,
                "previous_response_id": parent,
            }
            # A fork on a new lane continues the other lane's response.
            await peer.create(**common, input=outputs, stream_id="fork")
            fork = await peer.until(_ended)
            # A failing fork (an output for no call) is refused on its lane...
            wrong = [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
            await peer.create(**common, input=wrong, stream_id="bad-fork")
            refused = (await peer.next()).event
            # ...and the parent stays: its own lane continues it.
            await peer.create(**common, input=outputs, stream_id="source")
            same = await peer.until(_ended)
            # A failure on the parent's own lane evicts it (store: false: gone).
            parent2, outputs2 = await _tool_call(peer, "source")
            common2 = {**common, "previous_response_id": parent2}
            await peer.create(**common2, input=wrong, stream_id="source")
            (await peer.until(_ended))
            await peer.create(**common2, input=outputs2, stream_id="source")
            evicted = (await peer.next()).event
    assert terminal(fork).type == "response.completed" and lanes_of(fork) == {"fork"}
    assert terminal(fork).event["response"]["previous_response_id"] == parent
    assert refused["type"] == "error" and refused["stream_id"] == "bad-fork"
    assert (refused["error"]["code"], refused["error"]["param"]) == (
        "invalid_value",
        "input[0].call_id",
    )
    assert terminal(same).type == "response.completed"
    forked_text = terminal(fork).event["response"]["output"]
    same_text = terminal(same).event["response"]["output"]
    assert [i["content"] for i in forked_text] == [i["content"] for i in same_text]
    assert evicted["stream_id"] == "source"
    assert (evicted["error"]["code"], evicted["error"]["param"]) == (
        "previous_response_not_found",
        "previous_response_id",
    )


async def test_each_lanes_latest_response_survives_a_busy_cache(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """12 lanes each make a store: false response; the cache's LRU bound is 8, yet every
    lane's next turn finds its parent."""
    lanes = [f"lane-{n}" for n in range(12)]
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine) as peer:
            latest = {}
            for lane in lanes:
                latest[lane] = await _tool_call(peer, lane)
            cache = peer.conn.session.cache
            assert len(cache) == len(lanes) > cache.max_responses
            for lane, (rid, outputs) in latest.items():
                await peer.create(
                    model="sim",
                    tools=TOOLS,
                    store=False,
                    previous_response_id=rid,
                    input=outputs,
                    tool_choice="none",
                    stream_id=lane,
                )
                frames = await peer.until(_ended)
                assert terminal(frames).type == "response.completed", terminal(frames).event
            # Each lane's newest response is now the continuation; the old ones may go.
            assert len(cache) <= len(lanes) + cache.max_responses


# --- the rollout extension on a lane --------------------------------------------------------------


async def test_a_rollout_runs_on_a_lane_while_another_lane_streams(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine) as peer:
            await peer.create(model=SLOW, input="stream", store=False, stream_id="plain")
            await peer.create(
                model="sim:steps=1",
                input="weather?",
                tools=TOOLS,
                store=False,
                rollout=True,
                stream_id="agent",
            )
            done = await peer.until(lambda fs: bool(fs) and fs[-1].type == "response.done")
            rid = done[-1].event["response"]["id"]
            assert done[-1].lane == "agent"
            view = peer.client.lane("agent")
            assert view is not None and view.suspended
            # A bad append is refused on the rollout's lane; the rollout stays suspended.
            await peer.send(
                {
                    "type": "response.append",
                    "response_id": rid,
                    "input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}],
                }
            )
            while (bad := await peer.next()).type != "error":
                assert bad.lane == "plain"
            outputs = [
                {"type": "function_call_output", "call_id": c, "output": "sunny"}
                for c in done[-1].event["pending_call_ids"]
            ]
            await peer.send({"type": "response.append", "response_id": rid, "input": outputs})
            by_lane = await peer.terminals({"plain": 1, "agent": 1})
    assert bad.lane == "agent" and bad.event["error"]["param"] == "input[0].call_id"
    agent = [f for f in peer.frames if f.lane == "agent"]
    assert terminal(by_lane["agent"]).type == "response.completed"
    assert terminal(by_lane["plain"]).type == "response.completed"
    # One response on the agent lane: created once, resumed after the append, then done.
    assert [f.type for f in agent].count("response.created") == 1
    assert terminal(agent).event["response"]["id"] == rid
    plain = [f for f in peer.frames if f.lane == "plain"]
    assert first(plain, "response.created").at <= done[-1].at < terminal(plain).at
    assert terminal(agent).at < terminal(plain).at  # the rollout ran while plain streamed


# --- bounded with every lane busy -----------------------------------------------------------------


async def test_every_lane_busy_holds_a_bounded_number_of_creates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """32 lanes start rollouts that suspend at a tool call and two more turns are sent on each:
    16 rollouts are in flight (suspended), 32 creates wait, and the rest are refused with 429
    on their lanes. Answering the rollouts drains everything; nothing is left behind."""
    lanes = [f"lane-{n}" for n in range(p.DEFAULT_MAX_LANES)]
    body = {
        "model": "sim:steps=1",
        "input": "weather?",
        "tools": TOOLS,
        "store": False,
        "rollout": True,
    }
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine) as peer:
            conn = peer.conn
            for _turn in range(3):
                for lane in lanes:
                    await peer.create(**body, stream_id=lane)
            suspended: dict[str, dict[str, Any]] = {}
            refused = []
            admitted = p.DEFAULT_MAX_IN_FLIGHT + p.DEFAULT_MAX_QUEUED_CREATES
            while len(suspended) < p.DEFAULT_MAX_IN_FLIGHT or len(refused) < 3 * 32 - admitted:
                frame = await peer.next()
                if frame.type == "response.done":
                    suspended[frame.event["response"]["id"]] = frame.event
                elif frame.type == "error":
                    refused.append(frame)
            await trio.testing.wait_all_tasks_blocked()
            assert conn.protocol.in_flight == p.DEFAULT_MAX_IN_FLIGHT
            assert conn.protocol.queued == p.DEFAULT_MAX_QUEUED_CREATES
            assert len(conn.lanes._decode_timings) == p.DEFAULT_MAX_QUEUED_CREATES
            assert len(conn.lanes._rollouts) == p.DEFAULT_MAX_IN_FLIGHT
            assert {(f.event["status"], f.event["error"]["code"]) for f in refused} == {
                (429, "too_many_queued_requests")
            }
            assert all(f.lane in lanes for f in refused)
            # Answer every suspended rollout as it comes, until all 48 admitted have ended.
            completed = 0
            pending = list(suspended.values())
            while completed < admitted:
                for done in pending:
                    outputs = [
                        {"type": "function_call_output", "call_id": c, "output": "sunny"}
                        for c in done["pending_call_ids"]
                    ]
                    rid = done["response"]["id"]
                    await peer.send(
                        {"type": "response.append", "response_id": rid, "input": outputs}
                    )
                pending = []
                frame = await peer.next()
                if frame.type == "response.done":
                    pending.append(frame.event)
                elif frame.type == "response.completed":
                    completed += 1
                else:
                    assert frame.type != "error", frame.event
            await trio.testing.wait_all_tasks_blocked()
            assert conn.protocol.in_flight == conn.protocol.queued == 0
            assert not conn.lanes._decode_timings and not conn.lanes._rollouts
            assert not peer.client.awaiting


# --- timing frames and the age limit --------------------------------------------------------------


async def test_timing_frames_carry_their_lane(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine, timing=True) as peer:
            await peer.create(model=SLOW, input="one", store=False, stream_id="a")
            await peer.create(model=SLOW, input="two", store=False)
            await peer.terminals({"a": 1, None: 1})
    timing = [f for f in peer.frames if f.type == "rollout.timing"]
    assert len(timing) == 2
    for frame in timing:
        in_progress = next(
            f
            for f in peer.frames
            if f.type == "response.in_progress"
            and f.event["response"]["id"] == frame.event["response_id"]
        )
        assert frame.lane == in_progress.lane
        assert frame.event["stages"]["decode"] >= 0
    assert {f.lane for f in timing} == {"a", None}


async def test_past_its_age_limit_a_connection_refuses_creates_on_their_lanes_then_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limits = WebSocketLimits(connection_age_limit=1.0)
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine, connected(engine, limits) as peer:
            await peer.create(model=SLOW, input="one", store=False, stream_id="a")
            await peer.until(lambda fs: bool(fs) and fs[-1].type == "response.output_text.delta")
            await trio.sleep(1.0)
            await peer.create(model=SLOW, input="two", store=False, stream_id="b")
            try:
                await peer.until(lambda fs: False)
            except trio.EndOfChannel:
                pass
    error = next(f for f in peer.frames if f.type == "error")
    assert (
        error.lane == "b" and error.event["error"]["code"] == "websocket_connection_limit_reached"
    )
    a = [f for f in peer.frames if f.lane == "a"]
    assert terminal(a).type == "response.completed"  # the running response finished first
    assert peer.closed == 1000 and peer.frames[-1].lane == "a"
