"""WebSocket-mode connections, sans-IO (after h11's and wsproto's `Connection`): frame text in,
events out; events in, frame text out. No sockets, no tasks, no clock: the I/O layer owns
those and drives these objects.

Long because both ends live here: the server's admission rules, lane scheduling and sends,
and the client's receive checks, over the same lanes and trackers, so neither end's rules can
drift from the other's.

**Lanes.** A connection has a default lane (creates without `stream_id`) and up to `max_lanes`
named ones (`stream_id`, `_lanes.py`), each opened by the first create that names it and kept
for the connection's life. A lane is FIFO: its responses run one at a time, in the order their
creates arrived, each followed by its own `ResponseTracker` (`_state.py`: the response grammar,
sequence numbers from 0 per response). Lanes run concurrently, their events interleaving, up to
`max_in_flight` responses across them. Every event of a laned response, and every error about
a laned request or response, carries the lane's `stream_id`; the default lane's carry none.

`ServerConnection` is the server's side. `receive_text` decodes a client message and applies
the connection's rules; a create passes the admission rules (`_ADMISSION`, in order) or is
refused with the ready-made `ErrorEvent` to send:

    rule              refused when                               status, code
    _stream_id_rule   `stream_id` is not 1-256 of [A-Za-z0-9_.-]  400 invalid_stream_id
    _lane_limit_rule  it would open lane max_lanes + 1            400 websocket_stream_limit_reached
    _queue_rule       more than max_queued_creates would wait     429 too_many_queued_requests

(`param` is `stream_id` for the first two; only `invalid_stream_id` does not echo the lane.)
An admitted create waits on its lane. `start_next` says which create to answer now: the
oldest waiting create whose lane is free, while fewer than `max_in_flight` responses run (so
the 17th concurrent create waits instead of being refused). `max_queued_creates` bounds the
creates waiting across all lanes, and so the memory a connection holds with every lane busy:
at most `max_in_flight` responses running and `max_queued_creates` creates waiting. An append
is let through only to a suspended rollout of this connection (else `rollout_not_found`,
`response_already_completed` or `rollout_not_suspended`), a steer only to the running response
it names (else `response.steer.failed`, out of any stream and on the target's lane when it is
known: `invalid_input` for a malformed one, `response_not_found`, `response_already_completed`,
or `response_not_active` for a response that failed). The multi-agent beta: a create asking
for `multi_agent` without the beta in the handshake (`betas`) is refused (`beta_required`); an
inject is let through only to a running multi-agent response of this connection (else
`response.inject.failed`: `response_already_completed` or `response_not_found`, with its
input, on the response's lane). `send` encodes each event of a
response (on its lane, `stream_id=`) after checking it against the response grammar: a server
that breaks it raises `LocalProtocolError`, and the connection refuses further use. An event
is checked once: a response built by a `ResponseStream` given its lane's tracker
(`ResponseStream(response, tracker=connection.lane(stream_id).tracker)`, after
`start_next`) was checked as it was built, and `send` checks only that its events go out in
the order built (and the steering answers numbered in its stream, in full). Such a tracker's
phase is what was built: the lane stays busy (`Lane.free`) until every event built for it
went out, so the next create starts only after the previous response's terminal event.

The client's side is `ClientConnection` (`_client_connection.py`), following the same rules.

Steering answers (`_steer.py`) are followed by both sides: in the stream of the response they
name (its next sequence number, also after its terminal event, where a successor may start
without a create of its own; the lane stays busy until the ended response has answered all
the input it accepted), or out of any stream (sequence number 0, like an `error`). Every
steer gets one first answer (accepted, or failed without a steer id); `awaiting` counts steers
still unanswered and accepted input an ended response has not answered yet.

Request errors (`error` events) answer one message and carry no sequence number. An inject
acknowledgement (`response.inject.created`) is an event of the response it names, numbered in
its sequence on its lane; a `response.inject.failed` answers an inject for a response that is
not running (ended, or unknown): it belongs to no response's stream (`sequence_number` 0) and
goes out like an error, on the lane of the response it names. Which
message a client cannot always tell (an accepted append is silent), so the client
attributes an error, on the lane it names, first to a message the server could only refuse
(sent raw: not JSON, an unknown type, an invalid lane, an append with nothing suspended),
then to its latest append while a rollout is suspended, else to a queued create: exact for a
client with one request unanswered per lane at a time, as the SDKs are.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ._codec import DEFAULT_MAX_MESSAGE_SIZE, decode_client_event, encode_json
from ._errors import ErrorBody, LocalProtocolError, RemoteProtocolError
from ._events import (
    ClientEvent,
    ErrorEvent,
    InjectError,
    ResponseAppend,
    ResponseCreate,
    ResponseInject,
    ResponseInjectFailed,
    ServerEvent,
    named_response_of,
    pending_calls_of,
    previous_id_of,
    steer_of,
)
from ._lanes import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_LANES, MAX_STREAM_ID_CHARS, valid_stream_id
from ._multi_agent import MULTI_AGENT_BETA, multi_agent_enabled
from ._state import Move, Phase, ResponseTracker, advance_item, move_of
from ._steer import (
    OUT_OF_STREAM,
    STEER_EVENT_TYPES,
    InvalidSteer,
    ResponseSteer,
    ResponseSteerFailed,
    steer_failed,
)

__all__ = [
    "DEFAULT_MAX_QUEUED_CREATES",
    "DEFAULT_MAX_REMEMBERED_RESPONSES",
    "Lane",
    "ServerConnection",
    "inject_failed",
]

# Creates that may wait, across a connection's lanes, for their lane or for a place among the
# responses in flight: one per named lane (a client keeping all 32 lanes busy with one more
# turn queued on each), past which a create is refused (429) rather than held. With
# `max_in_flight` running, a connection holds at most 16 + 32 requests.
DEFAULT_MAX_QUEUED_CREATES = 32
# Ids of ended responses a connection remembers, to tell an append to one of them
# (`response_already_completed`, on its lane) from one naming nothing (`rollout_not_found`):
# ~50 bytes an id, far more responses than a connection's cache keeps, bounded for a
# connection that lives an hour and runs many short responses.
DEFAULT_MAX_REMEMBERED_RESPONSES = 1024
# Server event types that answer a client message rather than extend a response's stream: they
# may go out at any time, on the lane of what they answer, and move no lane's grammar: a
# request error, and an inject's failure (for a response that is not running). (So do
# steering answers out of any stream, sequence number 0; those in a response's stream are
# events of that response: `_state.Move.STEER`. An inject's `response.inject.created` is an
# event of the running response, numbered in its sequence.)
ANSWER_EVENT_TYPES = frozenset({"error", "response.inject.failed"})
# What the server answers a client message with, instead of acting on it.
Answer = ErrorEvent | ResponseInjectFailed
_INJECT_ACKS = frozenset({"response.inject.created", "response.inject.failed"})
_INJECT_FAILURES = {
    "response_already_completed": "Response '{}' has already completed; send the input in a "
    "new response that continues it (previous_response_id).",
    "response_not_found": "No response with id '{}' is running on this connection.",
}


def _refusal(
    message: str,
    *,
    code: str,
    param: str | None = None,
    status: int = 400,
    stream_id: str | None = None,
) -> ErrorEvent:
    return ErrorEvent(
        status=status, error=ErrorBody(code=code, message=message, param=param), stream_id=stream_id
    )


def inject_failed(
    event: ResponseInject,
    code: Literal["response_already_completed", "response_not_found"],
    *,
    stream_id: str | None = None,
) -> ResponseInjectFailed:
    """`response.inject.failed` for a response that is not running (outside any response's
    sequence: `sequence_number` 0), returning the inject's input uncommitted; `stream_id`:
    the lane of the response it names."""
    return ResponseInjectFailed(
        sequence_number=0,
        response_id=event.response_id,
        error=InjectError(code=code, message=_INJECT_FAILURES[code].format(event.response_id)),
        input=list(event.input),
        stream_id=stream_id,
    )


def _beta_required(what: str, param: str, stream_id: str | None = None) -> ErrorEvent:
    return _refusal(
        f"{what} is part of the multi-agent beta: open the WebSocket with the header "
        f"'OpenAI-Beta: {MULTI_AGENT_BETA}'.",
        code="beta_required",
        param=param,
        stream_id=stream_id,
    )


class Lane:
    """One lane of a connection: its response slot (phase, response, sequence numbers, pending
    calls, all in its `tracker`) and how many creates wait on it."""

    def __init__(self, stream_id: str | None) -> None:
        self.stream_id = stream_id  # None: the default lane
        self.tracker = ResponseTracker()

    @property
    def phase(self) -> Phase:
        return self.tracker.phase

    @property
    def response_id(self) -> str | None:
        return self.tracker.response_id

    @property
    def pending_call_ids(self) -> tuple[str, ...]:
        return self.tracker.pending_call_ids

    @property
    def suspended(self) -> bool:
        return self.tracker.phase is Phase.SUSPENDED

    @property
    def open_item(self) -> int | None:
        """The `output_index` of the item the running response has open (None: between
        items)."""
        index = self.tracker.item_index
        return index if isinstance(index, int) else None

    @property
    def free(self) -> bool:
        """No response runs, the last one owes no answer to steering input it accepted (its
        `response.steer.pending`, a failure, or its successor), and every event its builder
        built went out (a builder driving the tracker moves it when it builds an event: the
        slot is not free until the terminal event it built was sent)."""
        tracker = self.tracker
        return (
            tracker.phase is Phase.IDLE
            and not (tracker.ended and tracker.steers_owed)
            and not tracker.unsent
        )

    @property
    def queued(self) -> int:
        """Creates on this lane whose response has not started."""
        raise NotImplementedError


class _Remembered:
    """Ended responses (id -> lane, terminal status), the oldest forgotten past a bound."""

    def __init__(self, bound: int) -> None:
        self._ids: collections.OrderedDict[str, tuple[str | None, str]] = collections.OrderedDict()
        self._bound = bound

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._ids

    def lane_of(self, response_id: str) -> str | None:
        found = self._ids.get(response_id)
        return found[0] if found is not None else None

    def status_of(self, response_id: str) -> str | None:
        found = self._ids.get(response_id)
        return found[1] if found is not None else None

    def add(self, response_id: str, stream_id: str | None, status: str = "completed") -> None:
        self._ids[response_id] = (stream_id, status)
        while len(self._ids) > self._bound:
            self._ids.popitem(last=False)


class _Connection:
    """What both sides show: the default lane's slot (as before lanes), and each lane."""

    _lanes: Mapping[str | None, Lane]
    _broken: bool

    @property
    def phase(self) -> Phase:
        """The phase of the default lane's response (IDLE between responses); ERROR once the
        protocol was broken (on any lane)."""
        return Phase.ERROR if self._broken else self._lanes[None].phase

    @property
    def response_id(self) -> str | None:
        """The id of the default lane's response (once its `response.created` went over)."""
        return self._lanes[None].response_id

    def lane(self, stream_id: str | None = None) -> Lane | None:
        """The lane `stream_id` (None: the default lane), if a create opened it."""
        return self._lanes.get(stream_id)

    @property
    def named_lanes(self) -> int:
        """Named lanes opened on this connection (the default lane is not counted)."""
        return len(self._lanes) - 1


# --- the server's side ---------------------------------------------------------------------------


class _ServerLane(Lane):
    def __init__(self, stream_id: str | None) -> None:
        super().__init__(stream_id)
        self.waiting: collections.deque[ResponseCreate] = collections.deque()
        self.multi_agent = False  # the running response takes `response.inject`

    @property
    def queued(self) -> int:
        return len(self.waiting)


Admission = Callable[["ServerConnection", ResponseCreate], ErrorEvent | None]


def _stream_id_rule(conn: ServerConnection, create: ResponseCreate) -> ErrorEvent | None:
    if create.stream_id is None or valid_stream_id(create.stream_id):
        return None
    return _refusal(
        f"Invalid 'stream_id': expected 1 to {MAX_STREAM_ID_CHARS} characters of "
        "A-Z, a-z, 0-9, '_', '.' and '-' (omit stream_id for the default lane).",
        code="invalid_stream_id",
        param="stream_id",
    )


def _lane_limit_rule(conn: ServerConnection, create: ResponseCreate) -> ErrorEvent | None:
    lane = create.stream_id
    if lane is None or lane in conn._lanes or conn.named_lanes < conn.max_lanes:
        return None
    return _refusal(
        f"This connection has opened {conn.max_lanes} stream_id lanes, its limit; reuse one "
        "of them, use the default lane, or open a new WebSocket connection.",
        code="websocket_stream_limit_reached",
        param="stream_id",
        stream_id=lane,
    )


def _queue_rule(conn: ServerConnection, create: ResponseCreate) -> ErrorEvent | None:
    if conn.waiting_with(create.stream_id) <= conn.max_queued_creates:
        return None
    return _refusal(
        f"Too many queued requests on this connection (the limit is "
        f"{conn.max_queued_creates}); wait for a response to finish.",
        code="too_many_queued_requests",
        status=429,
        stream_id=create.stream_id,
    )


def _multi_agent_rule(conn: ServerConnection, create: ResponseCreate) -> ErrorEvent | None:
    if not multi_agent_enabled(create):
        return None
    if not conn.multi_agent:
        return _beta_required("'multi_agent'", "multi_agent", create.stream_id)
    if create.rollout:
        return _refusal(
            "'rollout' and 'multi_agent' are two ways to wait for tool outputs in one response "
            "(response.append and response.inject): send one of them.",
            code="unsupported_parameter",
            param="rollout",
            stream_id=create.stream_id,
        )
    return None


# The rules a create must pass to be queued, in order: the first that objects refuses it.
_ADMISSION: tuple[Admission, ...] = (
    _stream_id_rule,
    _lane_limit_rule,
    _multi_agent_rule,
    _queue_rule,
)


class ServerConnection(_Connection):
    """The server's side of one WebSocket-mode connection."""

    def __init__(
        self,
        *,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_queued_creates: int = DEFAULT_MAX_QUEUED_CREATES,
        max_remembered_responses: int = DEFAULT_MAX_REMEMBERED_RESPONSES,
        max_lanes: int = DEFAULT_MAX_LANES,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        betas: frozenset[str] = frozenset(),
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.betas = betas  # of the handshake's `OpenAI-Beta` header (`betas_of`)
        self.max_message_size = max_message_size
        self.max_queued_creates = max_queued_creates
        self.max_lanes = max_lanes
        self.max_in_flight = max_in_flight
        self._lanes: dict[str | None, _ServerLane] = {None: _ServerLane(None)}
        self._arrivals: collections.deque[_ServerLane] = collections.deque()  # per waiting create
        self._in_flight: dict[str, _ServerLane] = {}  # running response id -> its lane
        self._ended = _Remembered(max_remembered_responses)
        self._broken = False

    # --- state ---
    @property
    def multi_agent(self) -> bool:
        """Whether the handshake opted in to the multi-agent beta."""
        return MULTI_AGENT_BETA in self.betas

    @property
    def queued(self) -> int:
        """Creates received and not started, on every lane."""
        return len(self._arrivals)

    @property
    def in_flight(self) -> int:
        """Responses started and not ended (a create being answered counts), on every lane."""
        return sum(1 for lane in self._lanes.values() if not lane.free)

    @property
    def pending_call_ids(self) -> tuple[str, ...]:
        """The default lane's suspended rollout's pending calls."""
        return self._lanes[None].pending_call_ids

    def lane_of(self, response_id: str) -> str | None:
        """The `stream_id` of the lane a response of this connection runs (or ran) on: None for
        the default lane and for an unknown id. What an event about that response carries (an
        ack of input sent to it)."""
        lane = self._in_flight.get(response_id)
        return lane.stream_id if lane is not None else self._ended.lane_of(response_id)

    def waiting_with(self, stream_id: str | None) -> int:
        """How many creates would wait (not start at once) with one more on lane `stream_id`:
        a create starts at once when its lane is free and a place in flight is left."""
        free_lanes = {lane.stream_id for lane in self._arrivals if lane.free}
        lane = self._lanes.get(stream_id)
        if lane is None or lane.free:
            free_lanes.add(stream_id)
        startable = min(len(free_lanes), max(0, self.max_in_flight - self.in_flight))
        return self.queued + 1 - startable

    # --- receiving ---
    def decode(self, data: str | bytes) -> ClientEvent | InvalidSteer:
        """Decode one client message (pure, so the caller may run it in a worker thread);
        raises `RemoteProtocolError` with the error to answer."""
        return decode_client_event(data, max_size=self.max_message_size)

    def receive_text(
        self, data: str | bytes
    ) -> list[ClientEvent | ErrorEvent | ResponseSteerFailed | ResponseInjectFailed]:
        """A client message -> what to act on: a create (queued on its lane: `start_next`
        says when to answer it), an append to deliver to the suspended rollout, a steer to
        deliver to the running response, an inject to deliver to the running multi-agent
        response, or the `error` event (for a steer, `response.steer.failed`; for an inject,
        `response.inject.failed`) to answer with."""
        try:
            event = self.decode(data)
        except RemoteProtocolError as exc:
            return [exc.error_event()]
        return self.receive_event(event)

    def receive_event(
        self, event: ClientEvent | InvalidSteer
    ) -> list[ClientEvent | ErrorEvent | ResponseSteerFailed | ResponseInjectFailed]:
        """The connection rules for an already decoded client event (see `receive_text`)."""
        if isinstance(event, ResponseCreate):
            return [self._queue(event)]
        if isinstance(event, ResponseAppend):
            return [self._route_append(event)]
        if isinstance(event, ResponseInject):
            return [self._route_inject(event)]
        return [self._route_steer(event)]

    def _route_steer(
        self, event: ResponseSteer | InvalidSteer
    ) -> ResponseSteer | ResponseSteerFailed:
        """A steer goes to the running response it names; else it fails out of any stream
        (on the target's lane when it is known)."""
        target = event.previous_response_id
        if isinstance(event, InvalidSteer):
            return steer_failed(
                event, "invalid_input", event.message, stream_id=self.lane_of(target)
            )
        if target in self._in_flight:
            return event
        status = self._ended.status_of(target)
        lane = self._ended.lane_of(target)
        if status == "failed":
            message = f"Response '{target}' failed; it takes no steering input."
            return steer_failed(event, "response_not_active", message, stream_id=lane)
        if status is not None:
            message = (
                f"Response '{target}' has already completed; continue it with response.create."
            )
            return steer_failed(event, "response_already_completed", message, stream_id=lane)
        message = f"No response with id '{target}' is running on this connection."
        return steer_failed(event, "response_not_found", message)

    def _queue(self, event: ResponseCreate) -> ResponseCreate | ErrorEvent:
        for rule in _ADMISSION:
            refusal = rule(self, event)
            if refusal is not None:
                return refusal
        lane = self._lanes.get(event.stream_id)
        if lane is None:
            lane = self._lanes[event.stream_id] = _ServerLane(event.stream_id)
        lane.waiting.append(event)
        self._arrivals.append(lane)
        return event

    def _route_append(self, event: ResponseAppend) -> ResponseAppend | ErrorEvent:
        lane = self._in_flight.get(event.response_id)
        if lane is not None:
            if not lane.tracker.rollout:
                return _refusal(
                    f"Response '{event.response_id}' is not a rollout: continue it with a new "
                    "response.create and previous_response_id.",
                    code="rollout_not_found",
                    param="response_id",
                    stream_id=lane.stream_id,
                )
            if lane.phase is Phase.SUSPENDED:
                return event
            return _refusal(
                "The rollout is not suspended: append tool outputs after response.done.",
                code="rollout_not_suspended",
                param="response_id",
                stream_id=lane.stream_id,
            )
        if event.response_id in self._ended:
            return _refusal(
                f"Response '{event.response_id}' has already completed.",
                code="response_already_completed",
                param="response_id",
                stream_id=self._ended.lane_of(event.response_id),
            )
        return _refusal(
            f"No rollout with id '{event.response_id}' is running on this connection.",
            code="rollout_not_found",
            param="response_id",
        )

    def _route_inject(self, event: ResponseInject) -> ResponseInject | Answer:
        if not self.multi_agent:
            return _beta_required("response.inject", "type")
        lane = self._in_flight.get(event.response_id)
        if lane is not None:
            if lane.multi_agent:
                return event
            return _refusal(
                f"Response '{event.response_id}' was not created with multi_agent enabled: it "
                "takes no injected input.",
                code="multi_agent_not_enabled",
                param="response_id",
                stream_id=lane.stream_id,
            )
        if event.response_id in self._ended:
            return inject_failed(
                event,
                "response_already_completed",
                stream_id=self._ended.lane_of(event.response_id),
            )
        return inject_failed(event, "response_not_found")

    # --- sending ---
    def start_next(self) -> ResponseCreate | None:
        """The create to answer now, taken off its lane's queue (its lane is then busy until
        its terminal event or refusal): the oldest waiting create whose lane is free, while
        fewer than `max_in_flight` responses run. None when none may start."""
        self._usable()
        if not self._arrivals or self.in_flight >= self.max_in_flight:
            return None
        lane = next((lane for lane in self._arrivals if lane.free), None)
        if lane is None:
            return None
        self._arrivals.remove(lane)  # its first entry: lanes are FIFO
        request = lane.waiting.popleft()
        self._guard(lambda: lane.tracker.start(rollout=bool(request.rollout)))
        lane.multi_agent = self.multi_agent and multi_agent_enabled(request)
        return request

    def refuse(
        self, error: RemoteProtocolError | ErrorEvent, *, stream_id: str | None = None
    ) -> str:
        """Answer the started create of lane `stream_id` with a request error instead of a
        response."""
        lane = self._lane_for(stream_id)
        self._guard(lane.tracker.refuse)
        return self.send(
            error.error_event() if isinstance(error, RemoteProtocolError) else error,
            stream_id=stream_id,
        )

    def send(self, event: ServerEvent, *, stream_id: str | None = None) -> str:
        """Encode one server event, on lane `stream_id` (written into the frame; the default
        lane: the event's own `stream_id`). An answer to a message (`ANSWER_EVENT_TYPES`: a
        request error) may go out at any time; an event of a response must follow the
        response grammar of its lane's response."""
        if self._broken:
            self._usable()
        own = event.stream_id
        if stream_id is None:
            stream_id = own
        elif own is not None and own != stream_id:
            self._broken = True
            raise LocalProtocolError(f"{event.type} names lane {own!r}, sent on {stream_id!r}")
        out_of_stream = event.type in STEER_EVENT_TYPES and event.sequence_number == OUT_OF_STREAM
        if event.type not in ANSWER_EVENT_TYPES and not out_of_stream:
            self._advance(event, self._lanes.get(stream_id) or self._lane_for(stream_id))
        # The lane goes into the frame (cheaper than a copy of the event with it).
        return encode_json(event, extra={"stream_id": stream_id} if own != stream_id else None)

    def _advance(self, event: ServerEvent, lane: _ServerLane) -> None:
        steer = steer_of(event)
        if steer is not None:  # a steering answer in the stream of the response it names
            self._guard(
                lambda: lane.tracker.advance(
                    event.type, event.sequence_number, steer.previous_response_id, steer_id=steer.id
                )
            )
            return
        tracker = lane.tracker
        response = named_response_of(event)
        if tracker.driven:  # checked where it was built (`ResponseStream(tracker=...)`)
            self._guard(lambda: tracker.send_built(event.type, event.sequence_number))
            if response is None:
                return
            move = move_of(event.type)
            response_id = response.id
        elif response is None:  # an item, part or delta event (or another of a running response)
            self._guard(lambda: advance_item(tracker, event))
            return
        else:
            response_id = response.id
            move = self._guard(
                lambda: tracker.advance(
                    event.type,
                    event.sequence_number,
                    response_id,
                    pending_calls_of(event),
                    previous_response_id=previous_id_of(event),
                )
            )
        if move is Move.QUEUED or move is Move.CREATED:
            self._in_flight[response_id] = lane
        elif move is Move.TERMINAL:
            self._in_flight.pop(response_id, None)
            status = response.status if response is not None else "completed"
            self._ended.add(response_id, lane.stream_id, status)

    def _lane_for(self, stream_id: str | None) -> _ServerLane:
        lane = self._lanes.get(stream_id)
        if lane is None:
            self._broken = True
            raise LocalProtocolError(f"no create was received on lane {stream_id!r}")
        return lane

    def _usable(self) -> None:
        if self._broken:
            raise LocalProtocolError("the connection broke the protocol earlier; it can't send")

    def _guard(self, step: Any) -> Any:
        try:
            return step()
        except LocalProtocolError:
            self._broken = True
            raise


# --- the client's side ---------------------------------------------------------------------------
