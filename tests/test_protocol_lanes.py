"""Lanes (`stream_id`) in the sans-IO connections: a `ServerConnection` and a
`ClientConnection` wired back to back, no sockets, no clock.

* Admission: a bad lane id is `invalid_stream_id` (not echoed), the 33rd lane
  `websocket_stream_limit_reached` (echoed), creates past the waiting bound 429 (echoed); the
  default lane is not counted, and a refused create opens no lane.
* Scheduling (`start_next`): FIFO within a lane, lanes at once, at most 16 in flight (the 17th
  waits, then starts when a response ends), oldest first across lanes; with every lane busy
  the connection holds at most 16 running and `max_queued_creates` waiting.
* Generated interleavings of several lanes' responses (plain and rollouts with appends) are
  accepted by both ends, every event carrying its lane; an event put on another lane is
  refused by both. `test_a_broken_scheduler_is_caught` shows the FIFO property failing
  against a scheduler that ignores whether a lane is busy.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.protocol import _connection

from tests.test_protocol_connection import (
    Exchange,
    Turn,
    _outputs,
    exchanges,
    message_events,
    server_events,
)


def create(lane: str | None = None, **fields: Any) -> p.ResponseCreate:
    return p.ResponseCreate(model="m", input="hi", stream_id=lane, **fields)


def raw_create(lane: Any) -> str:
    return json.dumps({"type": "response.create", "model": "m", "input": "hi", "stream_id": lane})


def _response(rid: str, status: str = "in_progress") -> p.Response:
    return p.Response(id=rid, created_at=0, model="m", status=status)  # type: ignore[arg-type]


def run_to_end(server: p.ServerConnection, lane: str | None, rid: str) -> list[str]:
    """Send a whole plain response of `lane` (started); its frames."""
    frames = [
        server.send(p.ResponseCreated(sequence_number=0, response=_response(rid)), stream_id=lane),
        server.send(
            p.ResponseInProgress(sequence_number=1, response=_response(rid)), stream_id=lane
        ),
        server.send(
            p.ResponseCompleted(sequence_number=2, response=_response(rid, "completed")),
            stream_id=lane,
        ),
    ]
    return frames


# --- admission ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "x" * 257, "a b", "lane/1", "é", "a\n"])
def test_a_bad_lane_id_is_invalid_stream_id_and_not_echoed(bad: str) -> None:
    server = p.ServerConnection()
    (error,) = server.receive_text(raw_create(bad))
    assert isinstance(error, p.ErrorEvent)
    assert (error.status, error.error.code, error.error.param) == (
        400,
        "invalid_stream_id",
        "stream_id",
    )
    assert error.stream_id is None and "stream_id" not in json.loads(server.send(error))
    assert server.named_lanes == 0 and server.queued == 0


def test_lane_ids_of_1_to_256_allowed_characters_are_lanes() -> None:
    server = p.ServerConnection()
    for lane in ("a", "A-z_0.9", "Az09_.-" * 36 + "abcd"):
        assert len(lane) <= 256
        assert server.receive_text(raw_create(lane)) == [create(lane)]
    assert p.valid_stream_id("x" * 256) and not p.valid_stream_id("x" * 257)
    assert not p.valid_stream_id(None) and not p.valid_stream_id(5)


def test_the_33rd_lane_is_refused_with_its_stream_id_echoed() -> None:
    server = p.ServerConnection(max_queued_creates=100)
    for n in range(p.DEFAULT_MAX_LANES):
        assert server.receive_event(create(f"lane-{n}")) == [create(f"lane-{n}")]
    (error,) = server.receive_event(create("lane-32"))
    assert isinstance(error, p.ErrorEvent)
    assert (error.status, error.error.code, error.error.param, error.stream_id) == (
        400,
        "websocket_stream_limit_reached",
        "stream_id",
        "lane-32",
    )
    assert json.loads(server.send(error))["stream_id"] == "lane-32"
    # Lanes already open, and the default lane (not counted), still take creates.
    assert server.receive_event(create("lane-0")) == [create("lane-0")]
    assert server.receive_event(create()) == [create()]
    assert server.named_lanes == p.DEFAULT_MAX_LANES


def test_a_refused_create_opens_no_lane() -> None:
    server = p.ServerConnection(max_queued_creates=0, max_in_flight=1, max_lanes=2)
    assert server.receive_event(create("a")) == [create("a")]  # starts at once: not waiting
    (refused,) = server.receive_event(create("b"))  # would wait: the bound is 0
    assert isinstance(refused, p.ErrorEvent)
    assert (refused.status, refused.error.code, refused.stream_id) == (
        429,
        "too_many_queued_requests",
        "b",
    )
    assert server.named_lanes == 1 and server.lane("b") is None


# --- scheduling --------------------------------------------------------------------------------


def test_lanes_are_fifo_and_concurrent_and_the_17th_in_flight_waits() -> None:
    server = p.ServerConnection()
    lanes = [f"lane-{n}" for n in range(17)]
    for lane in lanes:
        server.receive_event(create(lane, metadata={"n": "first"}))
    server.receive_event(create("lane-0", metadata={"n": "second"}))
    started = []
    while (request := server.start_next()) is not None:
        started.append(request.stream_id)
    # 16 lanes at once, in arrival order; the 17th lane and lane-0's second create wait.
    assert started == lanes[:16] and server.in_flight == 16 and server.queued == 2
    run_to_end(server, "lane-5", "resp_5")
    assert server.in_flight == 15
    nxt = server.start_next()  # a place freed: the oldest waiting create whose lane is free
    assert nxt is not None and nxt.stream_id == "lane-16"
    assert server.start_next() is None
    run_to_end(server, "lane-0", "resp_0")
    second = server.start_next()  # lane-0's second create, after its first ended
    assert second is not None and second.metadata == {"n": "second"}


def test_with_every_lane_busy_the_connection_holds_a_bounded_number_of_creates() -> None:
    server = p.ServerConnection()
    refused = []
    sent = 0
    for turn in range(3):
        for n in range(p.DEFAULT_MAX_LANES):
            sent += 1
            (answer,) = server.receive_event(create(f"lane-{n}", metadata={"t": str(turn)}))
            if isinstance(answer, p.ErrorEvent):
                refused.append(answer)
        while server.start_next() is not None:
            pass
    assert server.in_flight == p.DEFAULT_MAX_IN_FLIGHT
    assert server.queued == p.DEFAULT_MAX_QUEUED_CREATES
    assert len(refused) == sent - p.DEFAULT_MAX_IN_FLIGHT - p.DEFAULT_MAX_QUEUED_CREATES
    assert {(e.status, e.error.code) for e in refused} == {(429, "too_many_queued_requests")}
    assert all(e.stream_id is not None and e.stream_id.startswith("lane-") for e in refused)


def test_a_create_that_starts_at_once_is_never_refused_by_the_waiting_bound() -> None:
    server = p.ServerConnection(max_queued_creates=1)
    server.receive_event(create("a"))
    server.start_next()
    server.receive_event(create("a"))  # waits behind lane a's running response: 1 waiting
    (extra,) = server.receive_event(create("a"))
    assert isinstance(extra, p.ErrorEvent) and extra.stream_id == "a"
    # Lane b is free and a place in flight is left: it starts at once, so it is admitted.
    assert server.receive_event(create("b")) == [create("b")]


# --- events on lanes ---------------------------------------------------------------------------


def test_the_server_writes_each_events_lane_and_refuses_a_mismatch() -> None:
    server = p.ServerConnection()
    server.receive_event(create("a"))
    server.receive_event(create())
    server.start_next()
    server.start_next()
    laned = json.loads(
        server.send(p.ResponseCreated(sequence_number=0, response=_response("r1")), stream_id="a")
    )
    plain = json.loads(server.send(p.ResponseCreated(sequence_number=0, response=_response("r2"))))
    assert laned["stream_id"] == "a" and "stream_id" not in plain
    assert server.lane_of("r1") == "a" and server.lane_of("r2") is None
    with pytest.raises(p.LocalProtocolError, match="names lane 'a', sent on 'b'"):
        server.send(
            p.ResponseInProgress(sequence_number=1, response=_response("r1"), stream_id="a"),
            stream_id="b",
        )
    with pytest.raises(p.LocalProtocolError, match="earlier"):
        server.send(p.ResponseInProgress(sequence_number=1, response=_response("r2")))


def test_an_event_on_a_lane_nothing_was_sent_on_breaks_the_connection() -> None:
    server = p.ServerConnection()
    with pytest.raises(p.LocalProtocolError, match="no create was received on lane 'x'"):
        server.send(p.ResponseCreated(sequence_number=0, response=_response("r")), stream_id="x")
    client = p.ClientConnection()
    client.send(create("a"))
    event = p.ResponseCreated(sequence_number=0, response=_response("r"), stream_id="b")
    with pytest.raises(p.RemoteProtocolError, match="on lane 'b', on which no create was sent"):
        client.receive_text(p.encode_json(event))
    assert client.phase is p.Phase.ERROR and not client.awaiting


def test_appends_errors_and_acks_follow_the_lane_of_their_response() -> None:
    server = p.ServerConnection()
    server.receive_event(create("r", rollout=True))
    server.start_next()
    server.send(p.ResponseCreated(sequence_number=0, response=_response("resp_r")), stream_id="r")

    def answer(response_id: str) -> p.ErrorEvent | p.ClientEvent:
        append = {"type": "response.append", "response_id": response_id, "input": []}
        (event,) = server.receive_text(json.dumps(append))
        return event

    early = answer("resp_r")
    assert isinstance(early, p.ErrorEvent)
    assert (early.error.code, early.stream_id) == ("rollout_not_suspended", "r")
    server.send(
        p.ResponseInProgress(sequence_number=1, response=_response("resp_r")), stream_id="r"
    )
    server.send(
        p.ResponseDone(
            sequence_number=2,
            response=p.ResponseRef(id="resp_r"),
            pending_call_ids=["c"],
            output_indices=[],
        ),
        stream_id="r",
    )
    assert isinstance(answer("resp_r"), p.ResponseAppend)
    unknown = answer("resp_x")
    assert isinstance(unknown, p.ErrorEvent)
    assert (unknown.error.code, unknown.stream_id) == ("rollout_not_found", None)
    server.send(
        p.ResponseCompleted(sequence_number=3, response=_response("resp_r", "completed")),
        stream_id="r",
    )
    late = answer("resp_r")
    assert isinstance(late, p.ErrorEvent)
    assert (late.error.code, late.stream_id) == ("response_already_completed", "r")
    assert server.lane_of("resp_r") == "r"  # what an ack about it carries


def test_a_decode_error_of_a_laned_create_is_on_its_lane() -> None:
    server = p.ServerConnection()
    body = {"type": "response.create", "model": "m", "temperature": "hot", "stream_id": "a"}
    (error,) = server.receive_text(json.dumps(body))
    assert isinstance(error, p.ErrorEvent)
    assert (error.error.code, error.error.param, error.stream_id) == (
        "invalid_type",
        "temperature",
        "a",
    )
    (bad,) = server.receive_text(json.dumps({**body, "stream_id": ""}))
    assert isinstance(bad, p.ErrorEvent) and bad.stream_id is None


# --- the client's side --------------------------------------------------------------------------


def test_the_client_refuses_bad_lanes_and_expects_their_refusals() -> None:
    client = p.ClientConnection(max_lanes=1)
    with pytest.raises(p.LocalProtocolError, match="not a lane id"):
        client.send(create(""))
    client.send(create("a"))
    with pytest.raises(p.LocalProtocolError, match="would open lane 2"):
        client.send(create("b"))
    client.sent_raw(raw_create(""))  # the server can only refuse these
    client.sent_raw(raw_create("b"))
    assert client.awaiting and client.queued == 1
    limit = p.ErrorEvent(
        status=400,
        error=p.ErrorBody(code="websocket_stream_limit_reached", message="no"),
        stream_id="b",
    )
    client.receive_text(p.encode_json(limit))
    invalid = p.ErrorEvent(status=400, error=p.ErrorBody(code="invalid_stream_id", message="no"))
    client.receive_text(p.encode_json(invalid))
    lane = client.lane("a")
    assert lane is not None and lane.queued == 1  # lane a's create is still owed its response
    refusal = p.ErrorEvent(status=404, error=p.ErrorBody(code="x", message="no"), stream_id="a")
    client.receive_text(p.encode_json(refusal))
    assert not client.awaiting and client.queued == 0


def test_a_client_attributes_an_unechoed_refusal_of_a_laned_create() -> None:
    """A server without lanes refuses a laned create without naming the lane."""
    client = p.ClientConnection()
    client.send(create("a"))
    error = p.ErrorEvent(status=400, error=p.ErrorBody(code="unsupported_parameter", message="x"))
    client.receive_text(p.encode_json(error))
    assert not client.awaiting


# --- generated interleavings -----------------------------------------------------------------


@attrs.frozen
class LaneScript:
    lane: str | None
    exchanges: tuple[Exchange, ...]


def _lane_streams(scripts: list[LaneScript]) -> list[list[tuple[str | None, Any, list[str]]]]:
    streams = []
    for s, script in enumerate(scripts):
        steps: list[tuple[str | None, Any, list[str]]] = []
        for n, exchange in enumerate(script.exchanges):
            if exchange.refused:
                steps.append((script.lane, "refuse", []))
                continue
            for event, calls in server_events(f"resp_{s}_{n}", exchange):
                steps.append((script.lane, event, calls))
        streams.append(steps)
    return streams


lane_scripts = st.lists(
    st.builds(
        LaneScript,
        lane=st.none() | st.sampled_from(["a", "b.1", "c-2"]),
        exchanges=st.lists(exchanges, min_size=1, max_size=3).map(tuple),
    ),
    min_size=1,
    max_size=3,
    unique_by=lambda s: s.lane,
)


def play(scripts: list[LaneScript], order: list[int]) -> None:
    """Every create sent up front; then the lanes' streams interleaved as `order` picks (an
    index into the lanes still sending); every append answered at once."""
    server, client = p.ServerConnection(), p.ClientConnection()
    for script in scripts:
        for exchange in script.exchanges:
            sent = create(script.lane, rollout=exchange.rollout or None)
            assert server.receive_text(client.send(sent)) == [sent]
    streams = _lane_streams(scripts)
    while server.start_next() is not None:
        pass
    picks = iter(order)
    while any(streams):
        live = [s for s in streams if s]
        stream = live[next(picks, 0) % len(live)]
        lane, event, calls = stream.pop(0)
        if event == "refuse":
            error = p.RemoteProtocolError.invalid("no", code="model_not_found", param="model")
            received = client.receive_text(server.refuse(error, stream_id=lane))
            assert isinstance(received, p.ErrorEvent) and received.stream_id == lane
        else:
            received = client.receive_text(server.send(event, stream_id=lane))
            assert received == attrs.evolve(event, stream_id=lane)
        if calls:
            view = client.lane(lane)
            assert view is not None and view.pending_call_ids == tuple(calls)
            rid = event.response.id
            append = p.ResponseAppend(response_id=rid, input=_outputs(calls))
            assert server.receive_text(client.send(append)) == [append]
        while server.start_next() is not None:
            pass
    assert server.in_flight == 0 and server.queued == 0
    assert not client.awaiting and client.queued == 0


@given(lane_scripts, st.lists(st.integers(0, 5), max_size=200))
def test_interleaved_lanes_are_accepted_by_both_ends(
    scripts: list[LaneScript], order: list[int]
) -> None:
    play(scripts, order)


def test_two_lanes_interleave_event_by_event() -> None:
    one = Exchange(rollout=True, refused=False, turns=(_turn(2, 1), _turn(1, 0)))
    scripts = [LaneScript("a", (one,)), LaneScript("b", (one, one))]
    play(scripts, [0, 1] * 100)


def _turn(deltas: int, calls: int) -> Turn:
    return Turn(deltas=deltas, calls=calls)


@given(exchanges, st.integers(0, 30))
def test_an_event_moved_to_another_lane_is_refused_by_both_ends(
    exchange: Exchange, at: int
) -> None:
    """Lane b runs a response far ahead in its numbering; an event of lane a's response sent
    on lane b is refused there by the server and by the client."""
    events = [event for event, _calls in server_events("resp_a", exchange)]
    at %= len(events)
    server, client = p.ServerConnection(), p.ClientConnection()
    for lane in ("a", "b"):
        sent = create(lane, rollout=exchange.rollout or None)
        server.receive_text(client.send(sent))
    while server.start_next() is not None:
        pass
    ahead: list[Any] = [
        p.ResponseCreated(sequence_number=0, response=_response("resp_b")),
        p.ResponseInProgress(sequence_number=1, response=_response("resp_b")),
    ]
    ahead += message_events(iter(range(2, 100)), 0, 90)[:-3]  # its text is streaming
    for event in ahead:
        client.receive_text(server.send(event, stream_id="b"))
    for i, event in enumerate(events):
        if i == at:
            with pytest.raises(p.LocalProtocolError):
                server.send(event, stream_id="b")
            with pytest.raises(p.RemoteProtocolError):
                client.receive_text(p.encode_json(attrs.evolve(event, stream_id="b")))
            return
        client.receive_text(server.send(event, stream_id="a"))
        if event.type == "response.done":
            append = p.ResponseAppend(response_id="resp_a", input=_outputs(event.pending_call_ids))
            server.receive_text(client.send(append))


def test_a_broken_scheduler_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken variant: `start_next` starts the oldest waiting create whether or not its lane
    is busy. Two responses of one lane then overlap, and the interleaving property fails."""

    def broken_start_next(self: p.ServerConnection) -> p.ResponseCreate | None:
        if not self._arrivals or self.in_flight >= self.max_in_flight:
            return None
        lane = self._arrivals.popleft()
        request = lane.waiting.popleft()
        lane.tracker.phase = p.Phase.IDLE  # as if free
        lane.tracker.start(rollout=bool(request.rollout))
        return request

    plain = Exchange(rollout=False, refused=False, turns=(_turn(1, 0),))
    scripts = [LaneScript("a", (plain, plain))]
    play(scripts, [0] * 10)  # the real scheduler
    monkeypatch.setattr(_connection.ServerConnection, "start_next", broken_start_next)
    with pytest.raises((p.LocalProtocolError, p.RemoteProtocolError, AssertionError)):
        play(scripts, [0] * 10)
