"""The WebSocket-mode connections without sockets: a `ServerConnection` and a
`ClientConnection` wired back to back.

* Every legal exchange (generated: creates, plain responses and rollouts with suspensions and
  appends, refusals) is accepted by both ends, and the client's view (awaiting, suspended,
  pending calls) follows it.
* A mutated server stream (an event dropped, repeated, renumbered, or sent after the end) is
  refused by both ends at the same event: the server with `LocalProtocolError`, the client
  with `RemoteProtocolError`; neither accepts a stream the other refuses.
* Client misuse is a `LocalProtocolError`; the server's append routing and queue bound answer
  with the documented error codes.
* `test_a_broken_table_is_caught` runs the mutation property against a deliberately broken
  state table (a suspended rollout may stream items) and shows that it fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.protocol import _state

# --- building a server's events ---------------------------------------------------------------


def _response(rid: str, status: str = "in_progress") -> p.Response:
    return p.Response(id=rid, created_at=0, model="m", status=status)  # type: ignore[arg-type]


@attrs.frozen
class Turn:
    """One turn of a response: `deltas` text deltas, then `calls` (a rollout suspends there
    unless it is the last turn)."""

    deltas: int
    calls: int


@attrs.frozen
class Exchange:
    rollout: bool
    refused: bool
    turns: tuple[Turn, ...]


def server_events(rid: str, exchange: Exchange) -> list[tuple[Any, list[str]]]:
    """(event, call ids to append after it) for one response."""
    out: list[tuple[Any, list[str]]] = []
    seq = iter(range(10_000))
    out.append((p.ResponseCreated(sequence_number=next(seq), response=_response(rid)), []))
    out.append((p.ResponseInProgress(sequence_number=next(seq), response=_response(rid)), []))
    index = 0
    for t, turn in enumerate(exchange.turns):
        if turn.deltas:
            out += [(event, []) for event in message_events(seq, index, turn.deltas)]
            index += 1
        last = t == len(exchange.turns) - 1
        if exchange.rollout and not last and turn.calls:
            calls = [f"call_{t}_{c}" for c in range(turn.calls)]
            done = p.ResponseDone(
                sequence_number=next(seq),
                response=p.ResponseRef(id=rid),
                pending_call_ids=calls,
                output_indices=[0],
            )
            out.append((done, calls))
            out.append(
                (
                    p.ResponseInProgress(sequence_number=next(seq), response=p.ResponseRef(id=rid)),
                    [],
                )
            )
    end = p.ResponseCompleted(sequence_number=next(seq), response=_response(rid, "completed"))
    out.append((end, []))
    return out


def message_events(seq: Iterator[int], index: int, deltas: int) -> list[Any]:
    """An assistant message streamed whole, at `output_index` `index`: the item grammar."""
    item_id, text = f"msg_{index}", "x" * deltas
    at = {"item_id": item_id, "output_index": index, "content_index": 0}
    item = p.Message(id=item_id, role="assistant", status="in_progress", content=[])
    part = p.OutputText(text=text)
    done = p.Message(id=item_id, role="assistant", status="completed", content=[part])
    return [
        p.OutputItemAdded(sequence_number=next(seq), output_index=index, item=item),
        p.ContentPartAdded(sequence_number=next(seq), part=p.OutputText(text=""), **at),
        *(p.OutputTextDelta(sequence_number=next(seq), delta="x", **at) for _ in range(deltas)),
        p.OutputTextDone(sequence_number=next(seq), text=text, **at),
        p.ContentPartDone(sequence_number=next(seq), part=part, **at),
        p.OutputItemDone(sequence_number=next(seq), output_index=index, item=done),
    ]


exchanges = st.builds(
    Exchange,
    rollout=st.booleans(),
    refused=st.booleans(),
    turns=st.lists(
        st.builds(Turn, deltas=st.integers(0, 3), calls=st.integers(0, 3)), min_size=1, max_size=4
    ).map(tuple),
)


def _outputs(calls: list[str]) -> list[p.Item]:
    return [p.FunctionCallOutput(call_id=c, output="ok") for c in calls]


# --- legal exchanges ---------------------------------------------------------------------------


@given(st.lists(exchanges, min_size=1, max_size=4), st.booleans())
def test_every_legal_exchange_is_accepted_by_both_ends(
    script: list[Exchange], partial_appends: bool
) -> None:
    server, client = p.ServerConnection(), p.ClientConnection()
    for n, exchange in enumerate(script):
        create = p.ResponseCreate(model="m", input="hi", rollout=exchange.rollout or None)
        (received,) = server.receive_text(client.send(create))
        assert received == create
        assert client.awaiting and client.queued == 1 and server.queued == 1
        assert server.start_next() == create and server.queued == 0
        if exchange.refused:
            error = p.RemoteProtocolError.invalid("no", code="model_not_found", param="model")
            assert client.receive_text(server.refuse(error)).type == "error"
            assert not client.awaiting and client.phase is p.Phase.IDLE
            continue
        rid = f"resp_{n}"
        for event, calls in server_events(rid, exchange):
            assert client.receive_text(server.send(event)) == event
            assert client.response_id == rid
            if not calls:
                continue
            assert client.suspended and server.phase is p.Phase.SUSPENDED
            assert client.pending_call_ids == tuple(calls) and not client.awaiting
            chunks = [calls[:1], calls[1:]] if partial_appends and len(calls) > 1 else [calls]
            for chunk in chunks:
                append = p.ResponseAppend(response_id=rid, input=_outputs(chunk))
                assert server.receive_text(client.send(append)) == [append]
            assert client.pending_call_ids == () and client.awaiting
        assert client.phase is p.Phase.IDLE and server.phase is p.Phase.IDLE
        assert not client.awaiting
        # The ended response is remembered: an append to it is `response_already_completed`.
        (answer,) = server.receive_text(json.dumps(_append_json(rid)))
        assert isinstance(answer, p.ErrorEvent)
        assert answer.error.code == "response_already_completed"


def _append_json(rid: str, call_ids: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "response.append",
        "response_id": rid,
        "input": [{"type": "function_call_output", "call_id": c, "output": "ok"} for c in call_ids],
    }


# --- illegal server streams ---------------------------------------------------------------------

MUTATIONS = ("drop", "repeat", "renumber", "after_end", "swap", "skip")
_STRUCTURAL = ("response.created", "response.in_progress", "response.done")


def mutate(events: list[Any], how: str, at: int) -> list[Any]:
    """`events` broken at index `at` (chosen so that the result is never legal)."""
    events = list(events)
    if how == "drop":  # a gap in the sequence numbers
        del events[at]
    elif how == "repeat":
        events.insert(at, events[at])
    elif how == "renumber":
        events[at] = attrs.evolve(events[at], sequence_number=events[at].sequence_number + 1)
    elif how == "after_end":
        last = events[-1]
        events.append(attrs.evolve(last, sequence_number=last.sequence_number + 1))
    elif how == "swap":
        events[at], events[at + 1] = events[at + 1], events[at]
    elif how == "skip":  # a lifecycle event left out, the numbering kept consecutive
        del events[at]
        events[at:] = [attrs.evolve(e, sequence_number=e.sequence_number - 1) for e in events[at:]]
    return events


def first_refusal(events: list[Any], rollout: bool) -> tuple[int | None, int | None]:
    """The index of the first event the server refuses to send, and of the first the client
    refuses to receive (None: all accepted)."""
    server, client = p.ServerConnection(), p.ClientConnection()
    create = p.ResponseCreate(model="m", input="hi", rollout=rollout or None)
    server.receive_text(client.send(create))
    server.start_next()
    server_at = client_at = None
    for i, event in enumerate(events):
        if server_at is None:
            try:
                server.send(event)
            except p.LocalProtocolError:
                server_at = i
        if client_at is None:
            try:
                client.receive_json(json.loads(p.encode_json(event)))
            except p.RemoteProtocolError:
                client_at = i
        if event.type == "response.done" and client_at is None:
            client.send(
                p.ResponseAppend(
                    response_id=event.response.id, input=_outputs(event.pending_call_ids)
                )
            )
    return server_at, client_at


def check_mutation(exchange: Exchange, how: str, where: float) -> None:
    events = [event for event, _calls in server_events("resp_x", exchange)]
    # Never the terminal event for a drop (dropping it leaves a legal prefix).
    at = min(int(where * (len(events) - 1)), len(events) - 2)
    if how == "skip":
        # A lifecycle event whose absence no later event makes up for (a suspended rollout
        # may end without resuming: the in_progress before a terminal may be missing).
        candidates = [
            i
            for i, e in enumerate(events[:-1])
            if e.type in _STRUCTURAL and events[i + 1].type not in _TERMINALS
        ]
        at = candidates[int(where * (len(candidates) - 1))]
    broken = mutate(events, how, at)
    server_at, client_at = first_refusal(broken, exchange.rollout)
    assert server_at is not None, f"the server sent a broken stream ({how} at {at})"
    assert server_at == client_at, (how, at, server_at, client_at)


_TERMINALS = ("response.completed", "response.incomplete", "response.failed")


@given(exchanges, st.sampled_from(MUTATIONS), st.floats(0, 1))
def test_every_broken_stream_is_refused_by_both_ends(
    exchange: Exchange, how: str, where: float
) -> None:
    check_mutation(exchange, how, where)


def test_a_broken_table_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken variant: the rollout table lets a suspended rollout stream items. A stream
    that sends a delta right after `response.done` is then accepted by both ends, and the
    property above fails on it."""
    broken = {
        **_state.ROLLOUT_TRANSITIONS,
        p.Phase.SUSPENDED: {
            **_state.ROLLOUT_TRANSITIONS[p.Phase.SUSPENDED],
            p.Move.ITEM: p.Phase.SUSPENDED,
        },
    }
    exchange = Exchange(rollout=True, refused=False, turns=(Turn(0, 1), Turn(1, 0)))
    events = [event for event, _calls in server_events("resp_x", exchange)]
    resume = [e.type for e in events].index("response.done") + 1  # its response.in_progress
    skips = [i for i, e in enumerate(events[:-1]) if e.type in _STRUCTURAL]
    where = skips.index(resume) / (len(skips) - 1)
    check_mutation(exchange, "skip", where)  # the real table refuses the stream
    monkeypatch.setattr(_state, "ROLLOUT_TRANSITIONS", broken)
    with pytest.raises(AssertionError, match="the server sent a broken stream"):
        check_mutation(exchange, "skip", where)


# --- the client's rules -----------------------------------------------------------------------


def test_client_misuse_is_a_local_error() -> None:
    client = p.ClientConnection()
    with pytest.raises(p.LocalProtocolError, match="no rollout with that id is suspended"):
        client.send(p.ResponseAppend(response_id="resp_1", input=[]))
    client.send(p.ResponseCreate(model="m", rollout=True))
    rid = "resp_1"
    client.receive_text(
        p.encode_json(p.ResponseCreated(sequence_number=0, response=_response(rid)))
    )
    client.receive_text(
        p.encode_json(p.ResponseInProgress(sequence_number=1, response=_response(rid)))
    )
    with pytest.raises(p.LocalProtocolError, match="phase RUNNING"):
        client.send(p.ResponseAppend(response_id=rid, input=[]))
    client.receive_text(
        p.encode_json(
            p.ResponseDone(
                sequence_number=2,
                response=p.ResponseRef(id=rid),
                pending_call_ids=["c1"],
                output_indices=[0],
            )
        )
    )
    with pytest.raises(p.LocalProtocolError, match="not pending"):
        client.send(p.ResponseAppend(response_id=rid, input=_outputs(["c2"])))
    with pytest.raises(p.LocalProtocolError, match="no rollout with that id"):
        client.send(p.ResponseAppend(response_id="resp_other", input=_outputs(["c1"])))
    client.send(p.ResponseAppend(response_id=rid, input=_outputs(["c1"])))
    with pytest.raises(p.LocalProtocolError, match="not pending"):
        client.send(p.ResponseAppend(response_id=rid, input=_outputs(["c1"])))
    # The server refuses the append: its call is pending again.
    error = p.ErrorEvent(status=400, error=p.ErrorBody(code="invalid_value", message="no"))
    client.receive_text(p.encode_json(error))
    assert client.pending_call_ids == ("c1",)


def test_client_refuses_events_for_no_response_and_then_is_unusable() -> None:
    client = p.ClientConnection()
    delta = p.OutputTextDelta(
        sequence_number=0, item_id="m", output_index=0, content_index=0, delta=""
    )
    with pytest.raises(p.RemoteProtocolError, match="no response is running"):
        client.receive_text(p.encode_json(delta))
    with pytest.raises(p.LocalProtocolError, match="unusable"):
        client.send(p.ResponseCreate(model="m"))
    client = p.ClientConnection()
    created = p.ResponseCreated(sequence_number=0, response=_response("r"))
    with pytest.raises(p.RemoteProtocolError, match="no create is waiting"):
        client.receive_text(p.encode_json(created))


def test_client_passes_extension_frames_and_errors_through() -> None:
    client = p.ClientConnection()
    timing = {"type": "rollout.timing", "response_id": "r", "stages": {}}
    assert client.receive_json(timing) == timing
    client.sent_raw("{not json")
    client.sent_raw({"type": "response.create", "model": "m"})
    assert client.awaiting
    error = {"type": "error", "status": 400, "error": {"code": "invalid_json"}}
    client.receive_json(error)  # answers the message that was not JSON
    assert client.awaiting and client.queued == 1
    client.receive_json(error)  # refuses the create
    assert not client.awaiting and client.queued == 0


# --- the server's rules -----------------------------------------------------------------------


def test_server_routes_appends_and_bounds_the_queue() -> None:
    server = p.ServerConnection(max_queued_creates=1)
    create = p.encode_json(p.ResponseCreate(model="m", rollout=True))
    # Between responses: one starts at once, one waits behind it, the next is refused,
    # whether or not the first has started yet.
    assert isinstance(server.receive_text(create)[0], p.ResponseCreate)
    assert isinstance(server.receive_text(create)[0], p.ResponseCreate)
    (refused,) = server.receive_text(create)
    assert isinstance(refused, p.ErrorEvent)
    assert (refused.status, refused.error.code) == (429, "too_many_queued_requests")
    (garbage,) = server.receive_text("{")
    assert isinstance(garbage, p.ErrorEvent) and garbage.error.code == "invalid_json"

    def code(append: dict[str, Any]) -> str | None:
        (answer,) = server.receive_text(json.dumps(append))
        return answer.error.code if isinstance(answer, p.ErrorEvent) else None

    assert server.start_next() == p.ResponseCreate(model="m", rollout=True)
    assert server.start_next() is None  # its lane is busy
    assert server.queued == 1 and isinstance(server.receive_text(create)[0], p.ErrorEvent)
    assert code(_append_json("resp_1")) == "rollout_not_found"
    server.send(p.ResponseCreated(sequence_number=0, response=_response("resp_1")))
    server.send(p.ResponseInProgress(sequence_number=1, response=_response("resp_1")))
    assert code(_append_json("resp_1")) == "rollout_not_suspended"
    server.send(
        p.ResponseDone(
            sequence_number=2,
            response=p.ResponseRef(id="resp_1"),
            pending_call_ids=["c"],
            output_indices=[0],
        )
    )
    assert code(_append_json("resp_1", ("c",))) is None
    assert code(_append_json("resp_2")) == "rollout_not_found"
    with pytest.raises(p.LocalProtocolError, match="before its response started"):
        server.refuse(p.RemoteProtocolError.invalid("late", code="x"))
    with pytest.raises(p.LocalProtocolError, match="earlier"):
        server.send(p.ResponseInProgress(sequence_number=3, response=p.ResponseRef(id="resp_1")))


# --- receive-path fuzzing -----------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_frames = (
    st.text(max_size=60)
    | _json.map(json.dumps)
    | st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                [
                    "response.create",
                    "response.append",
                    "response.created",
                    "response.done",
                    "response.output_text.delta",
                    "error",
                ]
            )
        },
        optional={
            "sequence_number": _json,
            "response": _json,
            "response_id": _json,
            "input": _json,
            "pending_call_ids": _json,
            "rollout": _json,
        },
    ).map(json.dumps)
)


@given(st.lists(_frames, max_size=6))
def test_garbage_in_only_protocol_errors_out(frames: list[str]) -> None:
    """The server answers anything with an event to act on or an `error` to send (never a
    crash, never a 5xx); the client refuses anything it cannot follow with a protocol error."""
    server, client = p.ServerConnection(), p.ClientConnection()
    for frame in frames:
        (answer,) = server.receive_text(frame)
        if isinstance(answer, p.ErrorEvent):
            assert answer.status is not None and 400 <= answer.status < 500
        try:
            client.receive_json(json.loads(frame))
        except ValueError:
            continue  # not JSON: the wrapper's json.loads refuses it first
        except p.ProtocolError:
            continue


# --- the item grammar ----------------------------------------------------------------------------


def _late_delta_stream() -> list[Any]:
    """A message whose text goes on after its part is done (before the item is)."""
    seq = iter(range(10_000))
    events: list[Any] = [
        p.ResponseCreated(sequence_number=next(seq), response=_response("resp_x")),
        p.ResponseInProgress(sequence_number=next(seq), response=_response("resp_x")),
        *message_events(seq, 0, 2)[:-1],  # ... content_part.done
    ]
    at = {"item_id": "msg_0", "output_index": 0, "content_index": 0}
    number = events[-1].sequence_number + 1
    events.append(p.OutputTextDelta(sequence_number=number, delta="late", **at))
    return events


def test_a_delta_after_its_part_is_done_is_refused_by_both_ends() -> None:
    """The item grammar (`_state.py`) is followed by both ends: the server refuses to send a
    text delta after its `content_part.done`, the client to receive it (from typed events
    and from parsed JSON alike)."""
    *legal, late = _late_delta_stream()
    server = p.ServerConnection()
    server.receive_text(p.ClientConnection().send(p.ResponseCreate(model="m", input="hi")))
    server.start_next()
    for event in legal:
        server.send(event)
    with pytest.raises(p.LocalProtocolError, match="text outside an open content part"):
        server.send(late)
    for receive in ("receive_text", "receive_json"):
        client = p.ClientConnection()
        client.send(p.ResponseCreate(model="m", input="hi"))
        for event in legal:
            frame = p.encode_json(event)
            client.receive_text(frame) if receive == "receive_text" else client.receive_json(
                json.loads(frame)
            )
        frame = p.encode_json(late)
        with pytest.raises(p.RemoteProtocolError, match="text outside an open content part"):
            client.receive_text(frame) if receive == "receive_text" else client.receive_json(
                json.loads(frame)
            )
        assert client.phase is p.Phase.ERROR


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("output_index", 1, "output_index 1, expected 0"),
        ("item_id", "msg_9", "item_id 'msg_9', expected the item id 'msg_0'"),
        ("content_index", 1, "content_index 1, expected 0"),
    ],
)
def test_a_delta_naming_another_item_or_part_is_refused_by_the_client(
    field: str, value: Any, reason: str
) -> None:
    client = p.ClientConnection()
    client.send(p.ResponseCreate(model="m", input="hi"))
    *legal, _ = _late_delta_stream()
    for event in legal[:4]:  # created, in_progress, output_item.added, content_part.added
        client.receive_json(json.loads(p.encode_json(event)))
    delta = json.loads(p.encode_json(legal[4]))
    delta[field] = value
    with pytest.raises(p.RemoteProtocolError, match=re.escape(reason)):
        client.receive_json(delta)


# --- checked once: a builder driving its lane's tracker ------------------------------------------


def _driven(rollout: bool = False) -> tuple[p.ServerConnection, p.ResponseStream]:
    server = p.ServerConnection()
    server.receive_text(p.ClientConnection().send(p.ResponseCreate(model="m", rollout=rollout)))
    server.start_next()
    lane = server.lane(None)
    assert lane is not None
    return server, p.ResponseStream(_response("resp_1"), tracker=lane.tracker)


def test_a_builder_driving_its_lanes_tracker_is_checked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the lane's tracker, every event is checked where it is built; `send` does not
    apply the grammar again (it checks only that events go out in the order built), and what
    goes out is what a client accepts."""
    server, stream = _driven(rollout=True)
    client = p.ClientConnection()
    client.send(p.ResponseCreate(model="m", rollout=True))
    built: list[Any] = [*stream.start(), *stream.begin_message("msg_1")]
    built += [stream.text_delta("a"), stream.text_delta("b"), *stream.end_message()]
    built += stream.begin_call("fc_1", "call_1", "f")
    built += [stream.arguments_delta("{}"), *stream.end_call(), stream.suspend(["call_1"])]
    calls = 0
    advance = _state.ResponseTracker.advance
    lane = server.lane(None)
    assert lane is not None

    def counted(self: _state.ResponseTracker, *args: Any, **kwargs: Any) -> p.Move:
        nonlocal calls
        calls += self is lane.tracker  # (not the client's)
        return advance(self, *args, **kwargs)

    monkeypatch.setattr(_state.ResponseTracker, "advance", counted)
    for event in built:
        client.receive_text(server.send(event))
    assert calls == 0  # sent without a second check
    appended = p.ResponseAppend(
        response_id="resp_1", input=[p.FunctionCallOutput(call_id="call_1", output="ok")]
    )
    server.receive_text(client.send(appended))
    rest = [stream.resume(), stream.complete(usage=p.Usage(), completed_at=1)]
    assert calls == 2  # each checked once, as built
    for event in rest:
        client.receive_text(server.send(event))
    assert calls == 2
    assert server.phase is p.Phase.IDLE and client.phase is p.Phase.IDLE
    assert "resp_1" not in server._in_flight and server.lane_of("resp_1") is None


def test_a_driven_lane_sends_only_what_its_builder_built_in_order() -> None:
    server, stream = _driven()
    created, _in_progress = stream.start()
    server.send(created)
    with pytest.raises(p.LocalProtocolError, match="not the next event the lane's builder built"):
        server.send(  # hand-built, past what the builder built
            p.OutputItemAdded(
                sequence_number=2,
                output_index=0,
                item=p.Message(id="m", role="assistant", status="in_progress", content=[]),
            )
        )
    assert server.phase is p.Phase.ERROR


def test_a_driven_builder_refuses_a_late_delta_and_can_still_end_the_response() -> None:
    """The builder's refusal (the grammar's, on the lane's tracker) leaves the lane as it
    was: the connection is not broken and `abort` ends the response."""
    server, stream = _driven()
    for event in [*stream.start(), *stream.begin_message("msg_1"), *stream.end_message()]:
        server.send(event)
    with pytest.raises(p.LocalProtocolError, match="text outside an open content part"):
        stream.text_delta("late")
    failed = stream.abort(error=p.ResponseError(code="server_error", message="x"), usage=None)
    assert failed is not None
    server.send(failed)
    assert server.phase is p.Phase.IDLE


def test_steering_answers_numbered_by_a_driven_builder_are_checked_when_sent() -> None:
    server, stream = _driven()
    for event in stream.start():
        server.send(event)
    steer = p.SteerRef(id="steer_1", previous_response_id="resp_1")
    accepted = p.ResponseSteerAccepted(sequence_number=stream.steer_sequence_number(), steer=steer)
    delta_events = stream.begin_message("msg_1")  # built after the number was taken
    server.send(accepted)
    for event in delta_events:
        server.send(event)
    lane = server.lane(None)
    assert lane is not None and lane.tracker.steers_owed == 1
    elsewhere = p.SteerRef(id="steer_2", previous_response_id="resp_0")
    wrong = p.ResponseSteerAccepted(sequence_number=stream.steer_sequence_number(), steer=elsewhere)
    with pytest.raises(p.LocalProtocolError, match="answers steering of 'resp_0'"):
        server.send(wrong)


def test_a_driven_lane_is_busy_until_the_terminal_event_its_builder_built_went_out() -> None:
    """The builder moves the lane's tracker when it builds an event, the connection's
    scheduling reads what was sent: a response whose terminal event is built (say, while its
    usage commits) still holds its lane, so the next create on it waits, and its tracker
    passes to that create only once nothing built is unsent (found by the fuzzer: the lane
    was handed on at the build, and the next response's events overtook the terminal)."""
    server, stream = _driven()
    server.receive_text(p.ClientConnection().send(p.ResponseCreate(model="m", input="next")))
    for event in [*stream.start(), *stream.begin_message("msg_1"), *stream.end_message()]:
        server.send(event)
    completed = stream.complete(usage=p.Usage(), completed_at=1)
    lane = server.lane(None)
    assert lane is not None
    assert lane.phase is p.Phase.IDLE and lane.tracker.unsent == 1  # built, not sent
    assert not lane.free and server.in_flight == 1
    assert server.start_next() is None  # the next create waits for the terminal event
    with pytest.raises(p.LocalProtocolError, match=r"1 event\(s\) built for resp_1"):
        lane.tracker.start(rollout=False)  # (the tracker itself refuses to be handed on)
    server.send(completed)
    assert lane.free and server.in_flight == 0
    nxt = server.start_next()
    assert nxt is not None and nxt.input == "next"
