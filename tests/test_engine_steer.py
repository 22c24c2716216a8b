"""Steering (`response.steer`) in the engine, on trio's mock clock, every event checked by
both sides of the sans-IO protocol (`ServerConnection.send` checks what the engine emits,
`ClientConnection` follows it) and validated by the `openai` SDK's own types:

- a steer accepted while a message streams stops the response at that point (the message
  closes `incomplete`, `response.incomplete` with reason `steered`); a successor response
  continues from it with the steering input and its settings, pre-inference of only the
  new input;
- never inside a tool-call item: a steer accepted while a call's arguments stream lets the
  turn end; the response completes owing the call and each submission is answered once with
  `response.steer.pending` naming the owed output; the client's continuation gets the input
  prepended, in submission order;
- a steered rollout that is suspended stays suspended until its outputs arrive, then stops at
  the boundary before its next turn; its successor is a rollout;
- every failure code: `invalid_input` (with the original input, no steer id),
  `response_not_found`, `response_already_completed`, `response_not_active` (a failed
  response: also for input it had accepted), `too_many_pending_steers`,
  `steering_not_supported` (automatic compaction), `successor_creation_failed`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter
from rollout import protocol as p
from rollout.engine import (
    ModelRegistry,
    ModelSpec,
    Rollout,
    Session,
    open_engine,
)
from rollout.engine._errors import BackendError
from rollout.engine._interfaces import (
    ArgsDelta,
    CallStart,
    Finish,
    SampleEvent,
    SampleRequest,
    TextDelta,
    TextEnd,
    TextStart,
)
from rollout.engine._sim import SimBackend
from rollout.engine._sink import CallbackSink
from rollout.engine._steer import MAX_PENDING_STEERS, QueuedSteer, Steering

DEADLINE = 60
SDK_EVENT: TypeAdapter[ResponsesServerEvent] = TypeAdapter(ResponsesServerEvent)

TOOLS: list[p.Tool] = [
    p.FunctionTool(
        name="read_file",
        parameters={
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
    )
]
# A long answer at 100 tokens/s: 4 s of mock time to steer it in.
SLOW_TEXT = "sim:tokens=400,tps=100"
# One tool call whose arguments stream at 5 tokens/s, then a text answer.
SLOW_CALL = "sim:steps=1,tps=5"


class Wire:
    """One WebSocket-mode connection without the socket: events pass `ServerConnection.send`
    and `ClientConnection.receive_text`, as they would over the wire."""

    def __init__(self) -> None:
        self.server = p.ServerConnection()
        self.client = p.ClientConnection()
        self.events: list[p.ServerEvent] = []
        self.times: list[float] = []  # when each event went out
        self._changed = trio.Event()

    async def emit(self, event: p.ServerEvent) -> None:
        text = self.server.send(event)
        self.client.receive_text(text)
        rollout_only = isinstance(event, p.ResponseDone) or (
            isinstance(event, p.ResponseInProgress) and isinstance(event.response, p.ResponseRef)
        )
        if not rollout_only and not (
            isinstance(event, p.ResponseSteerFailed) and event.error.code == "invalid_input"
        ):
            # The SDK's own types (it has none for the rollout extension's suspension events,
            # response.done and the resumed response.in_progress; an invalid input is returned
            # as sent).
            SDK_EVENT.validate_json(text)
        self.events.append(event)
        self.times.append(trio.current_time())
        self._changed.set()
        self._changed = trio.Event()

    def accept(self, request: p.ResponseCreate) -> p.ResponseCreate:
        [queued] = self.server.receive_text(self.client.send(request))
        assert isinstance(queued, p.ResponseCreate)
        started = self.server.start_next()
        assert started is queued
        return queued

    async def create(self, session: Session, request: p.ResponseCreate) -> None:
        await session.create(self.accept(request), self.emit)

    async def rollout(self, session: Session, request: p.ResponseCreate, handle: Rollout) -> None:
        await session.run(self.accept(request), CallbackSink(self.emit), handle)

    async def steer(self, session: Session, target: str, value: Any) -> None:
        """Send a steer as a client would; the answer is among `events`."""
        text = self.client.send(p.ResponseSteer(previous_response_id=target, input=value))
        await self.steer_raw(session, text)

    async def steer_during_call(
        self, session: Session, request: p.ResponseCreate, *inputs: Any
    ) -> str:
        """Run `request` until its first call's arguments stream, steer it with each of
        `inputs` then, and let it end; returns the steered response's id."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.create, session, request)
            await self.until(lambda e: isinstance(e, p.FunctionCallArgumentsDelta))
            first = response_id(self.events[0])
            for value in inputs:
                await self.steer(session, first, value)
        return first

    async def steer_raw(self, session: Session, text: str) -> None:
        [routed] = self.server.receive_text(text)
        if isinstance(routed, p.ResponseSteer):
            failed = await session.steer(routed)
            if failed is not None:
                await self.emit(failed)
        else:
            assert isinstance(routed, p.ResponseSteerFailed)
            await self.emit(routed)

    async def until(self, predicate: Callable[[p.ServerEvent], bool], count: int = 1) -> None:
        while sum(map(predicate, self.events)) < count:
            await self._changed.wait()

    def of_type(self, cls: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]


def response_id(event: p.ServerEvent) -> str:
    response = p.response_of(event)
    assert response is not None
    return response.id


def text_of(item: p.Item) -> str:
    assert isinstance(item, p.Message) and isinstance(item.content, list)
    return "".join(getattr(part, "text", "") for part in item.content)


def new_items(session: Session, rid: str) -> list[p.Item]:
    """The items a response added to its conversation (input, then output)."""
    state = session.cache.get(rid)
    assert state is not None
    return list(state.lineage.items[state.first_new_item : state.n_items])


# --- the boundary ---------------------------------------------------------------------------


async def test_steer_stops_a_message_and_a_successor_continues(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            wire = Wire()
            request = p.ResponseCreate(
                model=SLOW_TEXT, input="write an essay", store=False, metadata={"k": "v"}
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wire.create, session, request)
                await wire.until(lambda e: isinstance(e, p.OutputTextDelta), 5)
                first = response_id(wire.events[0])
                validated = engine.counters.items_validated
                hits = engine.counters.cache_hits
                steered_at = trio.current_time()
                await wire.steer(session, first, "Stop. Answer in one word.")
            work = (
                engine.counters.items_validated - validated,
                engine.counters.cache_hits - hits,
                engine.counters.steers_accepted,
                engine.counters.steer_successors,
            )
            # The same continuation sent by a client: the successor is exactly that.
            again = await session.respond(
                attrs.evolve(request, input="Stop. Answer in one word.", previous_response_id=first)
            )
        [accepted] = wire.of_type(p.ResponseSteerAccepted)
        assert accepted.steer.previous_response_id == first
        assert accepted.steer.id.startswith("steer_")
        [incomplete] = wire.of_type(p.ResponseIncomplete)
        assert incomplete.response.id == first
        assert incomplete.response.incomplete_details is not None
        assert incomplete.response.incomplete_details.reason == "steered"
        [message] = incomplete.response.output
        assert isinstance(message, p.Message) and message.status == "incomplete"
        deltas = [
            e.delta
            for e in wire.events[: wire.events.index(incomplete)]
            if isinstance(e, p.OutputTextDelta)
        ]
        assert text_of(message) == "".join(deltas)
        assert 5 <= len(deltas) < 400  # stopped mid-message, not at its end
        # The successor: created right after, continuing the steered response, inheriting
        # its settings, and completing.
        created = wire.of_type(p.ResponseCreated)
        assert [c.response.previous_response_id for c in created] == [None, first]
        successor = created[1].response
        assert wire.events[wire.events.index(incomplete) + 1] is created[1]
        assert (successor.model, successor.store, successor.metadata) == (
            SLOW_TEXT,
            False,
            {"k": "v"},
        )
        [completed] = wire.of_type(p.ResponseCompleted)
        assert completed.response.id == successor.id
        # Pre-inference of only the new input: one item validated, the parent from the cache.
        assert work == (1, 1, 1, 1)
        items = new_items(session, successor.id)
        assert isinstance(items[0], p.Message) and items[0].role == "user"
        assert items[0].content == "Stop. Answer in one word."
        assert completed.response.output == items[1:]
        assert [_no_ids(i) for i in again.output] == [_no_ids(i) for i in completed.response.output]
        assert again.usage == completed.response.usage
        # The steer applied at once, not at the end of the message (4 s of tokens).
        assert wire.times[wire.events.index(incomplete)] == steered_at  # no token waited for
        assert not wire.client.awaiting


async def test_a_steer_never_cuts_a_tool_call_and_pending_names_the_owed_output(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            wire = Wire()
            request = p.ResponseCreate(model=SLOW_CALL, input="read it", tools=TOOLS, store=False)
            first = await wire.steer_during_call(
                session,
                request,
                "Use the other file.",
                [{"role": "user", "content": "And be brief."}],
            )
            kinds = [e.type for e in wire.events]
            assert kinds.count("response.steer.accepted") == 2
            # The call completed, then the response: the calls are owed.
            [call] = [
                e.item for e in wire.of_type(p.OutputItemDone) if isinstance(e.item, p.FunctionCall)
            ]
            assert call.status == "completed"
            [completed] = wire.of_type(p.ResponseCompleted)
            assert completed.response.status == "completed"
            end = wire.events.index(completed)
            pending = wire.events[end + 1 :]
            assert [e.type for e in pending] == ["response.steer.pending"] * 2  # once each
            accepted = wire.of_type(p.ResponseSteerAccepted)
            assert [e.steer.id for e in pending] == [a.steer.id for a in accepted]
            for event in pending:
                assert isinstance(event, p.ResponseSteerPending)
                assert event.reason == "waiting_for_required_input"
                assert event.required_input == [
                    p.RequiredInput(
                        type="function_call_output", call_id=call.call_id, name="read_file"
                    )
                ]
            assert not wire.client.awaiting
            # The client's continuation gets the steering input prepended, in order.
            output = p.FunctionCallOutput(call_id=call.call_id, output="contents")
            follow = p.ResponseCreate(
                model=SLOW_CALL, input=[output], previous_response_id=first, store=False
            )
            wire.events.clear()
            await wire.create(session, follow)
            [done] = wire.of_type(p.ResponseCompleted)
            items = new_items(session, done.response.id)
            assert [type(i).__name__ for i in items[:3]] == [
                "Message",
                "Message",
                "FunctionCallOutput",
            ]
            assert [getattr(i, "content", None) for i in items[:2]] == [
                "Use the other file.",
                "And be brief.",
            ]
            assert len(session.parked) == 0


async def test_a_refused_continuation_keeps_the_parked_input(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            wire = Wire()
            request = p.ResponseCreate(model=SLOW_CALL, input="read it", tools=TOOLS, store=False)
            first = await wire.steer_during_call(session, request, "Use the other file.")
            call_id = wire.of_type(p.ResponseSteerPending)[0].required_input[0].call_id
            assert call_id is not None
            parent = session.cache.get(first)
            assert parent is not None
            # Without the owed output the create is refused; nothing was committed.
            bad = p.ResponseCreate(
                model=SLOW_CALL, input="hi", previous_response_id=first, store=False
            )
            with pytest.raises(p.RemoteProtocolError):
                await session.create(bad)
            assert len(session.parked) == 1
            session.cache.put(parent)  # (the refusal evicted it: OpenAI's rule)
            output = p.FunctionCallOutput(call_id=call_id, output="x")
            state = await session.create(attrs.evolve(bad, input=[output]))
            assert state is not None
            assert [getattr(i, "content", None) for i in new_items(session, state.id)[:1]] == [
                "Use the other file."
            ]
            assert len(session.parked) == 0


async def test_a_suspended_rollout_waits_for_its_outputs_then_stops_steered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            wire = Wire()
            handle = Rollout(session)
            request = p.ResponseCreate(
                model="sim:steps=2,tps=200", input="go", tools=TOOLS, rollout=True, store=False
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wire.rollout, session, request, handle)
                await wire.until(lambda e: isinstance(e, p.ResponseDone))
                first = response_id(wire.events[0])
                await wire.steer(session, first, "Now summarise.")
                await trio.sleep(5)
                assert handle.suspended  # still waiting for its outputs
                assert wire.events[-1].type == "response.steer.accepted"
                handle.append(
                    [p.FunctionCallOutput(call_id=c, output="ok") for c, _ in handle.pending_calls]
                )
                await wire.until(lambda e: isinstance(e, p.ResponseIncomplete))
                while not wire.of_type(p.ResponseCompleted):  # the successor runs to its end
                    if handle.suspended:
                        calls = handle.pending_calls
                        handle.append(
                            [p.FunctionCallOutput(call_id=c, output="ok") for c, _ in calls]
                        )
                    await trio.sleep(0.5)
        [incomplete] = wire.of_type(p.ResponseIncomplete)
        assert incomplete.response.incomplete_details is not None
        assert incomplete.response.incomplete_details.reason == "steered"
        # The outputs joined the steered response; its successor is a rollout continuing it.
        kinds = [e.type for e in wire.events]
        resumed = kinds.index("response.in_progress", 2)
        assert kinds[resumed + 1 : resumed + 3] == ["response.incomplete", "response.created"]
        successor = wire.of_type(p.ResponseCreated)[1].response
        assert successor.previous_response_id == first
        items = new_items(session, successor.id)
        assert isinstance(items[0], p.Message) and items[0].content == "Now summarise."
        [completed] = wire.of_type(p.ResponseCompleted)
        assert completed.response.id == successor.id
        assert not wire.client.awaiting


# --- any moment ---------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    tools=st.booleans(),
    rollout=st.booleans(),
    steer_at=st.integers(0, 2000),  # ms after response.created
    n_steers=st.integers(1, 3),
)
def test_steering_at_any_moment_keeps_every_rule(
    tools: bool, rollout: bool, steer_at: int, n_steers: int
) -> None:
    """Whenever steers arrive (while text or a call streams, while suspended, after the end):
    both ends of the protocol accept every event, no tool call is cut, and every accepted
    submission is answered once: committed by a successor, pending, or failed."""
    wire = trio.run(
        _steer_at,
        tools,
        rollout,
        steer_at / 1000,
        n_steers,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert not wire.client.awaiting
    for event in wire.of_type(p.OutputItemDone):
        if isinstance(event.item, p.FunctionCall):
            assert event.item.status == "completed"  # never cut by steering
    accepted = {
        e.steer.id: e.steer.previous_response_id for e in wire.of_type(p.ResponseSteerAccepted)
    }
    answered: dict[str, str] = {}
    for event in wire.events:
        if isinstance(event, p.ResponseSteerPending | p.ResponseSteerFailed) and event.steer.id:
            assert event.steer.id not in answered
            answered[event.steer.id] = event.type
        if isinstance(event, p.ResponseCreated) and event.response.previous_response_id:
            for sid, target in accepted.items():
                if target == event.response.previous_response_id and sid not in answered:
                    answered[sid] = "committed"
    assert set(answered) == set(accepted)


async def _steer_at(tools: bool, rollout: bool, delay: float, n_steers: int) -> Wire:
    model = "sim:steps=2,tokens=60,tps=50"
    request = p.ResponseCreate(
        model=model, input="go", tools=TOOLS if tools else None, rollout=rollout, store=False
    )
    wire = Wire()
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            handle = Rollout(session)
            finished = trio.Event()

            async def run() -> None:
                if rollout:
                    await wire.rollout(session, request, handle)
                else:
                    await wire.create(session, request)
                finished.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await wire.until(lambda e: isinstance(e, p.ResponseCreated))
                await trio.sleep(delay)
                target = response_id(wire.of_type(p.ResponseCreated)[-1])
                for n in range(n_steers):
                    await wire.steer(session, target, f"steer {n}")
                while not finished.is_set():
                    if handle.suspended:
                        outputs = [
                            p.FunctionCallOutput(call_id=c, output="ok")
                            for c, _ in handle.pending_calls
                        ]
                        handle.append(outputs)
                    await trio.sleep(0.05)
    return wire


# --- ordering ---------------------------------------------------------------------------------


async def test_an_answer_waits_for_the_events_already_built(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An acknowledgement is numbered after every event the coroutine built, and sent after
    them, even while one of them is held up (a full outbox)."""
    sent: list[p.ServerEvent] = []
    release = trio.Event()

    async def emit(event: p.ServerEvent) -> None:
        if isinstance(event, p.OutputTextDelta):
            await release.wait()  # the client is slow to read
        sent.append(event)

    steering = Steering(CallbackSink(emit))
    stream = p.ResponseStream(p.Response(id="resp_1", created_at=0, model="m"))
    steering.open(stream, "resp_1")
    with trio.fail_after(DEADLINE):
        for event in stream.start():
            await steering.emit(event)
        async with trio.open_nursery() as nursery:
            for event in stream.begin_message("msg_1"):
                await steering.emit(event)

            async def stream_text() -> None:
                await steering.emit(stream.text_delta("a"))  # built now, then held up
                await steering.emit(stream.text_delta("b"))

            nursery.start_soon(stream_text)
            await trio.sleep(1)
            steer = p.ResponseSteer(previous_response_id="resp_1", input="x")
            nursery.start_soon(steering.submit, steer)
            await trio.sleep(1)
            assert not any(e.type == "response.steer.accepted" for e in sent)
            release.set()
    numbers = [e.sequence_number for e in sent]
    assert numbers == list(range(len(numbers)))  # in order, no gap
    # The coroutine's events go first (the second delta was built as the first went out).
    assert [e.type for e in sent][-3:] == [
        "response.output_text.delta",
        "response.output_text.delta",
        "response.steer.accepted",
    ]


async def test_a_response_that_is_ending_takes_no_more_input() -> None:
    steering = Steering(CallbackSink(_ignore))
    steering.open(p.ResponseStream(p.Response(id="resp_1", created_at=0, model="m")), "resp_1")
    steering.stop_accepting()  # the end is decided
    failed = await steering.submit(p.ResponseSteer(previous_response_id="resp_1", input="x"))
    assert failed is not None
    assert (failed.error.code, failed.sequence_number, failed.steer.id) == (
        "response_not_active",
        0,
        None,
    )
    assert not steering.queued


# --- failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steer", "why"),
    [
        (
            {"previous_response_id": "resp_1", "input": "x", "stream_id": "a"},
            "Unknown parameter: 'stream_id'",
        ),
        ({"previous_response_id": "resp_1", "input": []}, "non-empty array"),
        ({"previous_response_id": "resp_1"}, "non-empty array"),
        ({"previous_response_id": 7, "input": "x"}, "previous_response_id"),
        (
            {"previous_response_id": "resp_1", "input": [{"role": "system", "content": "x"}]},
            "user role",
        ),
        (
            {
                "previous_response_id": "resp_1",
                "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}],
            },
            "only user messages",
        ),
        (
            {
                "previous_response_id": "resp_1",
                "input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}],
            },
            "input_text, input_image or input_file",
        ),
        (
            {"previous_response_id": "resp_1", "input": [{"role": "user", "content": 3}]},
            "input[0]",
        ),
        (
            {"previous_response_id": "resp_1", "input": [{"role": "user", "content": "x", "n": 1}]},
            "Unknown parameter: 'input[0].n'",
        ),
    ],
)
def test_invalid_steers_fail_with_their_original_input(steer: dict[str, Any], why: str) -> None:
    server = p.ServerConnection()
    [answer] = server.receive_text(json.dumps({"type": "response.steer", **steer}))
    assert isinstance(answer, p.ResponseSteerFailed)
    assert (answer.error.code, answer.error.type) == ("invalid_input", "invalid_request_error")
    assert why in answer.error.message
    assert answer.steer.id is None and answer.sequence_number == p.OUT_OF_STREAM
    assert answer.steer.input == steer.get("input", "")
    wire = json.loads(server.send(answer))
    assert "id" not in wire["steer"] and "stream_id" not in wire


@pytest.mark.parametrize(
    "value",
    [
        "plain text",
        [{"role": "user", "content": "x"}],
        [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}],
        [
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}],
                "id": "msg_1",
                "status": "completed",
            }
        ],
    ],
)
def test_valid_steers_reach_the_running_response(value: Any) -> None:
    server = p.ServerConnection()
    steer = {"type": "response.steer", "previous_response_id": "resp_1", "input": value}
    [answer] = server.receive_text(json.dumps(steer))
    assert isinstance(answer, p.ResponseSteerFailed)
    assert answer.error.code == "response_not_found"  # valid, but nothing runs
    typed = [{"type": "message", **m} for m in value] if isinstance(value, list) else value
    assert answer.steer.input == typed  # as sent, each message typed (as the SDK requires)
    SDK_EVENT.validate_json(p.encode_json(answer))
    assert p.steer_items(value)


async def test_unknown_ended_and_failed_targets(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=_registry()) as engine:
            session = engine.session()
            wire = Wire()
            await wire.steer(session, "resp_unknown", "x")
            await wire.create(session, p.ResponseCreate(model="sim", input="hi", store=False))
            done = response_id(wire.of_type(p.ResponseCompleted)[0])
            await wire.steer(session, done, "x")
            await wire.create(session, p.ResponseCreate(model="broken", input="hi", store=False))
            failed = response_id(wire.of_type(p.ResponseFailed)[0])
            await wire.steer(session, failed, "x")
        codes = [
            (e.error.code, e.steer.previous_response_id, e.sequence_number)
            for e in wire.of_type(p.ResponseSteerFailed)
        ]
        assert codes == [
            ("response_not_found", "resp_unknown", 0),
            ("response_already_completed", done, 0),
            ("response_not_active", failed, 0),
        ]
        assert not wire.client.awaiting


async def test_accepted_input_of_a_response_that_fails_is_returned(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=_registry()) as engine:
            session = engine.session()
            wire = Wire()
            request = p.ResponseCreate(model="broken", input="go", tools=TOOLS, store=False)
            invalid = ["not", "a", "message"]
            await wire.steer_during_call(session, request, invalid, "keep this")
        [accepted] = wire.of_type(p.ResponseSteerAccepted)
        failed = wire.of_type(p.ResponseSteerFailed)
        assert [(f.error.code, f.steer.id) for f in failed] == [
            ("invalid_input", None),
            ("response_not_active", accepted.steer.id),
        ]
        assert failed[1].steer.input == "keep this"
        assert wire.events[-2].type == "response.failed"
        assert failed[1].sequence_number == wire.events[-2].sequence_number + 1
        assert not wire.client.awaiting


async def test_too_many_pending_steers(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            wire = Wire()
            request = p.ResponseCreate(model=SLOW_CALL, input="read", tools=TOOLS, store=False)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wire.create, session, request)
                await wire.until(lambda e: isinstance(e, p.FunctionCallArgumentsDelta))
                first = response_id(wire.events[0])
                for n in range(MAX_PENDING_STEERS + 1):
                    await wire.steer(session, first, f"steer {n}")
        answers = [e for e in wire.events if e.type.startswith("response.steer.")]
        assert [e.type for e in answers[: MAX_PENDING_STEERS + 1]] == [
            "response.steer.accepted"
        ] * MAX_PENDING_STEERS + ["response.steer.failed"]
        refused = answers[MAX_PENDING_STEERS]
        assert isinstance(refused, p.ResponseSteerFailed)
        assert refused.error.code == "too_many_pending_steers" and refused.steer.id is None
        assert refused.steer.input == f"steer {MAX_PENDING_STEERS}"
        assert len(wire.of_type(p.ResponseSteerPending)) == MAX_PENDING_STEERS


async def test_compaction_bound_responses_take_no_steering(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            wire = Wire()
            request = p.ResponseCreate(
                model=SLOW_TEXT,
                input="write",
                store=False,
                context_management=[{"type": "compaction", "compact_threshold": 100_000}],
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wire.create, session, request)
                await wire.until(lambda e: isinstance(e, p.OutputTextDelta))
                await wire.steer(session, response_id(wire.events[0]), "x")
        [failed] = wire.of_type(p.ResponseSteerFailed)
        assert failed.error.code == "steering_not_supported"
        assert "automatic compaction" in failed.error.message
        assert failed.steer.id is None and failed.sequence_number > 0  # in the stream
        assert wire.of_type(p.ResponseCompleted)  # the response went on
        assert len(wire.of_type(p.ResponseCreated)) == 1


async def test_a_successor_that_cannot_be_created_returns_the_input(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=_registry()) as engine:
            session = engine.session()
            wire = Wire()
            request = p.ResponseCreate(model="small", input="write", store=False)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wire.create, session, request)
                await wire.until(lambda e: isinstance(e, p.OutputTextDelta))
                first = response_id(wire.events[0])
                await wire.steer(session, first, "word " * 2000)  # past the context window
        [accepted] = wire.of_type(p.ResponseSteerAccepted)
        [failed] = wire.of_type(p.ResponseSteerFailed)
        assert failed.error.code == "successor_creation_failed"
        assert "context window" in failed.error.message
        assert failed.steer.id == accepted.steer.id
        assert len(wire.of_type(p.ResponseCreated)) == 1
        assert session.cache.get(first) is not None  # the steered response stays continuable
        assert not wire.client.awaiting


async def test_steering_that_lands_as_the_backend_delivers_stops_before_that_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The race at a safe point: steering input is accepted (queued, the waiting turn's scope
    cancelled) after the backend produced its next event but before the turn resumed. The
    turn stops there, without that event: nothing is emitted in a cancelled scope, and the
    message ends `incomplete` with exactly the text its deltas carried."""
    backend = RacingBackend()
    registry = ModelRegistry([ModelSpec(name="racing", backend=backend)])
    events: list[p.ServerEvent] = []

    async def emit(event: p.ServerEvent) -> None:
        events.append(event)
        await trio.lowlevel.checkpoint()  # a transport's send checkpoints

    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry) as engine:
            backend.session = session = engine.session()
            await session.create(p.ResponseCreate(model="racing", input="go", store=False), emit)
    first = next(e for e in events if isinstance(e, p.ResponseIncomplete))
    assert first.response.incomplete_details is not None
    assert first.response.incomplete_details.reason == "steered"
    [message] = first.response.output
    assert isinstance(message, p.Message) and message.status == "incomplete"
    upto = events.index(first)
    deltas = [e.delta for e in events[:upto] if isinstance(e, p.OutputTextDelta)]
    assert deltas == ["one"]
    assert [part.text for part in message.content] == ["one"]  # type: ignore[union-attr]
    assert isinstance(events[-1], p.ResponseCompleted)  # the successor, with the input


# --- helpers ----------------------------------------------------------------------------------


class BrokenBackend:
    """Starts a function call, streams a little of it, then fails (after 1 s)."""

    async def sample(self, request: SampleRequest) -> AsyncGenerator[SampleEvent, None]:
        yield CallStart("read_file", None, "function")
        yield ArgsDelta('{"pa', 1)
        await trio.sleep(1)
        raise BackendError("the model fell over")


def _registry() -> ModelRegistry:
    return ModelRegistry(
        [
            ModelSpec(name="sim", backend=SimBackend(), accepts_params=True),
            ModelSpec(name="broken", backend=BrokenBackend()),
            ModelSpec(
                name="small",
                backend=SimBackend(),
                context_window=1000,
                params={"tokens": "400", "tps": "100"},
            ),
        ]
    )


async def _ignore(event: p.ServerEvent) -> None:
    return None


def _no_ids(item: p.Item) -> dict[str, Any]:
    wire = p.to_wire(item)
    wire.pop("id", None)
    return dict(wire)


class RacingBackend:
    """Streams a message; as its second delta is delivered, steering input lands on the
    response (queued, and the safe point's scope cancelled, as `Steering.submit` ends) before
    the turn has resumed."""

    session: Session | None = None
    raced = False

    async def sample(self, request: SampleRequest) -> AsyncGenerator[SampleEvent, None]:
        yield TextStart()
        yield TextDelta("one", 1)
        if self.raced:  # the successor that continues with the steering input: no race
            yield TextEnd()
            yield Finish("stop")
            return
        self.raced = True
        assert self.session is not None
        [steering] = self.session.steerable.values()
        steer = p.ResponseSteer(previous_response_id=steering.response_id or "", input="stop")
        steering.queued.append(QueuedSteer(id="steer_race", steer=steer, items=[]))
        assert steering._scope is not None  # the turn waits at a safe point
        steering._scope.cancel()
        yield TextDelta(" two", 1)  # delivered with no checkpoint: the turn resumes with it
        yield TextDelta(" three", 1)
        yield TextEnd()
        yield Finish("stop")
