"""Steering on the sans-IO connections (`ServerConnection`, `ClientConnection` back to back):

- answers in a response's stream take its next sequence number (also after its terminal
  event); out-of-stream answers carry 0; a successor starts without a create, numbered from 0,
  only after a terminal event and only while accepted input is owed;
- both ends refuse the same broken streams: an answer numbered out of order, a successor
  nobody asked for, a pending answer for nothing accepted, an acceptance after the end;
- the client's `awaiting` counts unanswered steers and input an ended response still owes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from rollout import protocol as p


def _response(rid: str, status: str = "in_progress", previous: str | None = None) -> p.Response:
    return p.Response(
        id=rid,
        created_at=0,
        model="m",
        status=status,  # type: ignore[arg-type]
        previous_response_id=previous,
    )


def _ref(rid: str, sid: str = "steer_1") -> p.SteerRef:
    return p.SteerRef(id=sid, previous_response_id=rid)


class Pair:
    """A server connection and a client connection, back to back."""

    def __init__(self) -> None:
        self.server = p.ServerConnection()
        self.client = p.ClientConnection()

    def create(self) -> None:
        [event] = self.server.receive_text(self.client.send(p.ResponseCreate(model="m")))
        assert isinstance(event, p.ResponseCreate)
        assert self.server.start_next() is event

    def steer(self, rid: str) -> Any:
        [routed] = self.server.receive_text(
            self.client.send(p.ResponseSteer(previous_response_id=rid, input="x"))
        )
        return routed

    def send(self, event: Any) -> None:
        self.client.receive_text(self.server.send(event))

    def both_refuse(self, event: Any) -> None:
        text = p.encode_json(event)
        with pytest.raises(p.LocalProtocolError):
            self.server.send(event)
        with pytest.raises(p.RemoteProtocolError):
            self.client.receive_text(text)


def started(pair: Pair, rid: str = "resp_1") -> None:
    pair.create()
    pair.send(p.ResponseCreated(sequence_number=0, response=_response(rid)))
    pair.send(p.ResponseInProgress(sequence_number=1, response=_response(rid)))


def test_a_steered_response_and_its_successor() -> None:
    pair = Pair()
    started(pair)
    routed = pair.steer("resp_1")
    assert isinstance(routed, p.ResponseSteer)  # the running response takes it
    assert pair.client.awaiting
    pair.send(p.ResponseSteerAccepted(sequence_number=2, steer=_ref("resp_1")))
    end = _response("resp_1", "incomplete")
    pair.send(p.ResponseIncomplete(sequence_number=3, response=end))
    assert pair.client.awaiting  # the successor is owed
    successor = _response("resp_2", previous="resp_1")
    pair.send(p.ResponseCreated(sequence_number=0, response=successor))
    pair.send(p.ResponseInProgress(sequence_number=1, response=successor))
    pair.send(p.ResponseCompleted(sequence_number=2, response=_response("resp_2", "completed")))
    assert not pair.client.awaiting
    # The steered response has ended: a later steer of it is answered by the connection.
    late = pair.steer("resp_1")
    assert isinstance(late, p.ResponseSteerFailed)
    assert (late.error.code, late.sequence_number) == ("response_already_completed", 0)
    pair.send(late)
    assert not pair.client.awaiting


def test_pending_after_the_end_then_the_clients_continuation() -> None:
    pair = Pair()
    started(pair)
    pair.steer("resp_1")
    pair.send(p.ResponseSteerAccepted(sequence_number=2, steer=_ref("resp_1")))
    pair.send(p.ResponseCompleted(sequence_number=3, response=_response("resp_1", "completed")))
    stub = p.RequiredInput(type="function_call_output", call_id="call_1", name="f")
    pending = p.ResponseSteerPending(sequence_number=4, required_input=[stub], steer=_ref("resp_1"))
    pair.send(pending)
    assert not pair.client.awaiting
    # Once answered, nothing more of it: a second pending, and a successor, are refused.
    pair.both_refuse(attrs_evolve(pending, sequence_number=5))
    pair2 = Pair()
    started(pair2)
    pair2.steer("resp_1")
    pair2.send(p.ResponseSteerAccepted(sequence_number=2, steer=_ref("resp_1")))
    pair2.send(p.ResponseCompleted(sequence_number=3, response=_response("resp_1", "completed")))
    pair2.send(pending)
    pair2.both_refuse(
        p.ResponseCreated(sequence_number=0, response=_response("resp_2", previous="resp_1"))
    )


@pytest.mark.parametrize(
    "event",
    [
        # numbered as if it were not in the stream
        p.ResponseSteerAccepted(sequence_number=3, steer=_ref("resp_1")),
        # in the stream of another response
        p.ResponseSteerAccepted(sequence_number=2, steer=_ref("resp_other")),
        # pending for nothing accepted
        p.ResponseSteerPending(sequence_number=2, required_input=[], steer=_ref("resp_1")),
    ],
)
def test_broken_answers_are_refused_by_both_ends(event: Any) -> None:
    pair = Pair()
    started(pair)
    pair.steer("resp_1")
    pair.both_refuse(event)


def test_no_successor_without_accepted_input_and_no_acceptance_after_the_end() -> None:
    pair = Pair()
    started(pair)
    pair.send(p.ResponseCompleted(sequence_number=2, response=_response("resp_1", "completed")))
    pair.both_refuse(
        p.ResponseCreated(sequence_number=0, response=_response("resp_2", previous="resp_1"))
    )
    pair = Pair()
    started(pair)
    pair.steer("resp_1")
    pair.send(p.ResponseCompleted(sequence_number=2, response=_response("resp_1", "completed")))
    pair.both_refuse(p.ResponseSteerAccepted(sequence_number=3, steer=_ref("resp_1")))


def test_out_of_stream_answers() -> None:
    pair = Pair()
    unknown = pair.steer("resp_nope")
    assert isinstance(unknown, p.ResponseSteerFailed)
    assert (unknown.error.code, unknown.sequence_number, unknown.steer.id) == (
        "response_not_found",
        0,
        None,
    )
    assert pair.client.awaiting
    pair.send(unknown)
    assert not pair.client.awaiting
    # An out-of-stream answer for accepted input (it has a steer id) is refused by the client.
    bad = p.steer_failed(
        p.ResponseSteer(previous_response_id="resp_nope", input="x"), "x", "y", steer_id="s"
    )
    with pytest.raises(p.RemoteProtocolError):
        pair.client.receive_text(p.encode_json(bad))


def attrs_evolve(event: Any, **changes: Any) -> Any:
    import attrs

    return attrs.evolve(event, **changes)


def test_a_lane_stays_busy_until_its_ended_response_answers_its_steering() -> None:
    """On a lane, the next create waits while the ended response still owes answers to the
    input it accepted (its pending, or its successor, comes first); the answers carry the
    lane."""
    server, client = p.ServerConnection(), p.ClientConnection()

    def create() -> None:
        [event] = server.receive_text(client.send(p.ResponseCreate(model="m", stream_id="a")))
        assert isinstance(event, p.ResponseCreate)

    def send(event: Any) -> None:
        client.receive_text(server.send(event, stream_id="a"))

    create()
    assert server.start_next() is not None
    send(p.ResponseCreated(sequence_number=0, response=_response("resp_1")))
    send(p.ResponseInProgress(sequence_number=1, response=_response("resp_1")))
    [steer] = server.receive_text(
        client.send(p.ResponseSteer(previous_response_id="resp_1", input="x"))
    )
    assert isinstance(steer, p.ResponseSteer)
    send(p.ResponseSteerAccepted(sequence_number=2, steer=_ref("resp_1")))
    send(p.ResponseCompleted(sequence_number=3, response=_response("resp_1", "completed")))
    create()  # the next turn on the lane
    assert server.start_next() is None  # the lane owes the pending answer first
    stub = p.RequiredInput(type="function_call_output", call_id="c", name="f")
    pending = p.ResponseSteerPending(sequence_number=4, required_input=[stub], steer=_ref("resp_1"))
    text = server.send(pending, stream_id="a")
    assert json.loads(text)["stream_id"] == "a"
    client.receive_text(text)
    assert server.start_next() is not None  # now it may start
    # A steer of the ended response is refused on its lane.
    [late] = server.receive_text(
        client.send(p.ResponseSteer(previous_response_id="resp_1", input="x"))
    )
    assert isinstance(late, p.ResponseSteerFailed) and late.stream_id == "a"
