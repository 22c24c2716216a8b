"""The client's side of a WebSocket-mode connection, sans-IO; the rules both sides follow,
and the server's side, are in `_connection.py`.

`ClientConnection` is the client's side. `send` encodes client events and refuses misuse
with `LocalProtocolError` (an invalid lane id, a lane past the limit, an append to nothing
suspended, or answering a call that is not pending); `receive_text` (typed events) or
`receive_json` (an already parsed JSON object: the cheap path of a benchmark client, and of a
harness that must read what it does not know) follows the server's events on their lanes
(routed by `stream_id`) and raises `RemoteProtocolError` when the server breaks the rules (an
event for no response or for a lane nothing was sent on, a gap in sequence numbers, events
after a terminal one, two responses of one lane interleaved). `awaiting` tells whether the
server still owes events; `lane(stream_id)` shows one lane.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from typing import Any

from ._codec import DEFAULT_MAX_MESSAGE_SIZE, decode_server_event, encode_json
from ._connection import (
    _INJECT_ACKS,
    ANSWER_EVENT_TYPES,
    DEFAULT_MAX_REMEMBERED_RESPONSES,
    Lane,
    _Connection,
    _Remembered,
)
from ._errors import LocalProtocolError, RemoteProtocolError
from ._events import (
    ClientEvent,
    ResponseAppend,
    ResponseInject,
    ServerEvent,
    SseErrorEvent,
    lane_of,
    named_response_of,
    pending_calls_of,
    previous_id_of,
    steer_of,
)
from ._items import output_of
from ._lanes import DEFAULT_MAX_LANES, MAX_STREAM_ID_CHARS, valid_stream_id
from ._state import Move, Phase, ResponseTracker, item_fields
from ._steer import (
    OUT_OF_STREAM,
    STEER_EVENT_TYPES,
    ResponseSteer,
)

__all__ = ["ClientConnection"]


def _output_call_ids(items: Any) -> list[str]:
    """The call ids a raw append's tool outputs name (leniently: anything else is skipped)."""
    ids = []
    for item in items if isinstance(items, list) else ():
        if isinstance(item, Mapping) and str(item.get("type", "")).endswith("_output"):
            call_id = item.get("call_id")
            if isinstance(call_id, str):
                ids.append(call_id)
    return ids


class _ClientLane(Lane):
    def __init__(self, stream_id: str | None) -> None:
        super().__init__(stream_id)
        self.creates: collections.deque[bool] = collections.deque()  # queued: is a rollout
        self.appends: list[frozenset[str]] = []  # unanswered appends: the calls they answer
        self.answered: set[str] = set()  # pending calls the client has sent outputs for

    @property
    def queued(self) -> int:
        return len(self.creates)

    @property
    def pending_call_ids(self) -> tuple[str, ...]:
        """The suspended rollout's calls that still need an output from this client."""
        if not self.suspended:
            return ()
        return tuple(c for c in self.tracker.pending_call_ids if c not in self.answered)

    @property
    def awaiting(self) -> bool:
        if self.creates or self.phase in (Phase.QUEUED, Phase.CREATED, Phase.RUNNING):
            return True
        if self.phase is Phase.IDLE and not self.free:  # steering input answered after the end
            return True
        return self.suspended and not self.pending_call_ids

    def take_error(self) -> bool:
        """Attribute a request error on this lane to what it answers; False if nothing."""
        if self.appends and self.suspended:
            self.answered -= self.appends.pop()  # that append's outputs were not committed
            return True
        if self.creates:
            # While a response runs the error answers the latest create (refused on arrival);
            # between responses, the oldest (refused when its turn came).
            if self.tracker.in_response:
                self.creates.pop()
            else:
                self.creates.popleft()
            return True
        return False


class ClientConnection(_Connection):
    """The client's side of one WebSocket-mode connection."""

    def __init__(
        self,
        *,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_lanes: int = DEFAULT_MAX_LANES,
        max_remembered_responses: int = DEFAULT_MAX_REMEMBERED_RESPONSES,
    ) -> None:
        self.max_message_size = max_message_size
        self.max_lanes = max_lanes
        self._lanes: dict[str | None, _ClientLane] = {None: _ClientLane(None)}
        # Raw messages sent that the server can only refuse, by the lane its error will name.
        self._refusable: dict[str | None, int] = {}
        # Injects sent and not yet acknowledged (or refused), by the lane of their response.
        self._injects: dict[str | None, int] = {}
        self._ended = _Remembered(max_remembered_responses)
        self._broken = False
        self._steers = 0  # steers sent and not yet accepted or refused

    # --- state (of the default lane, as before lanes; `lane()` shows any) ---
    @property
    def queued(self) -> int:
        """Creates sent whose response has not started (nor been refused), on every lane."""
        return sum(lane.queued for lane in self._lanes.values())

    @property
    def suspended(self) -> bool:
        return not self._broken and self._lanes[None].suspended

    @property
    def pending_call_ids(self) -> tuple[str, ...]:
        """The default lane's suspended rollout's calls that still need an output."""
        return self._lanes[None].pending_call_ids

    @property
    def awaiting(self) -> bool:
        """Whether the server owes events: on some lane a response runs or is queued, or a
        suspended rollout has every output and is due to resume; or a message it can only
        refuse awaits its error."""
        if self._broken:
            return False
        if self._refusable or self._steers or self._injects:
            return True
        return any(lane.awaiting for lane in self._lanes.values())

    # --- sending ---
    def send(self, event: ClientEvent) -> str:
        """Encode a client event; `LocalProtocolError` when the rules forbid sending it."""
        self._usable()
        if isinstance(event, ResponseAppend):
            lane, answered = self._check_append(event)
            lane.answered |= answered
            lane.appends.append(answered)
        elif isinstance(event, ResponseSteer):
            self._steers += 1
        elif isinstance(event, ResponseInject):
            self._sent_inject(event.response_id)  # (a response that ended answers it failed)
        else:
            self._check_lane(event.stream_id)
            self._open(event.stream_id).creates.append(bool(event.rollout))
        return encode_json(event)

    def sent_raw(self, message: Mapping[str, Any] | str | bytes) -> None:
        """Record a message sent without the checks of `send` (a harness sending something
        invalid on purpose): only its `type`, `stream_id` and `response_id` are looked at, to
        expect the right answer."""
        self._usable()
        value: Any = message
        if not isinstance(message, Mapping):
            try:
                value = json.loads(message)
            except ValueError:
                value = None
        kind = value.get("type") if isinstance(value, Mapping) else None
        if kind == "response.create":
            stream_id = value.get("stream_id")
            if stream_id is not None and not valid_stream_id(stream_id):
                self._expect_refusal(None)  # invalid_stream_id: not echoed
            elif stream_id is not None and stream_id not in self._lanes and self._full():
                self._expect_refusal(stream_id)  # websocket_stream_limit_reached: echoed
            else:
                self._open(stream_id).creates.append(bool(value.get("rollout")))
        elif kind == "response.steer":  # answered by a steering event, whatever it holds
            self._steers += 1
        elif kind == "response.inject":
            self._sent_inject(value.get("response_id"))
        elif kind == "response.append":
            response_id = value.get("response_id")
            lane = self._running(response_id)
            if lane is not None and lane.suspended:
                answered = frozenset(_output_call_ids(value.get("input")))
                lane.answered |= answered
                lane.appends.append(answered)
            elif lane is not None:
                self._expect_refusal(lane.stream_id)
            elif isinstance(response_id, str) and response_id in self._ended:
                self._expect_refusal(self._ended.lane_of(response_id))
            else:
                self._expect_refusal(None)
        else:  # not a message the server can accept: it owes an error for it
            self._expect_refusal(None)

    def _sent_inject(self, response_id: object) -> None:
        """An inject is answered on the lane of the response it names."""
        lane = self._running(response_id)
        if lane is not None:
            stream_id = lane.stream_id
        elif isinstance(response_id, str) and response_id in self._ended:
            stream_id = self._ended.lane_of(response_id)
        else:
            stream_id = None
        self._injects[stream_id] = self._injects.get(stream_id, 0) + 1

    def _take_inject(self, stream_id: str | None) -> bool:
        """An inject's answer arrived on lane `stream_id` (else, any lane's inject)."""
        if stream_id not in self._injects:
            if not self._injects:
                return False
            stream_id = next(iter(self._injects))
        left = self._injects[stream_id] - 1
        if left:
            self._injects[stream_id] = left
        else:
            del self._injects[stream_id]
        return True

    def _expect_refusal(self, stream_id: str | None) -> None:
        self._refusable[stream_id] = self._refusable.get(stream_id, 0) + 1

    def _full(self) -> bool:
        return self.named_lanes >= self.max_lanes

    def _check_lane(self, stream_id: str | None) -> None:
        if stream_id is None or (stream_id in self._lanes):
            return
        if not valid_stream_id(stream_id):
            raise LocalProtocolError(
                f"stream_id {stream_id!r} is not a lane id (1 to {MAX_STREAM_ID_CHARS} "
                "characters of [A-Za-z0-9_.-])"
            )
        if self._full():
            raise LocalProtocolError(
                f"stream_id {stream_id!r} would open lane {self.max_lanes + 1} of this "
                f"connection (the limit is {self.max_lanes})"
            )

    def _open(self, stream_id: str | None) -> _ClientLane:
        lane = self._lanes.get(stream_id)
        if lane is None:
            lane = self._lanes[stream_id] = _ClientLane(stream_id)
        return lane

    def _running(self, response_id: object) -> _ClientLane | None:
        """The lane whose current response is `response_id`."""
        if not isinstance(response_id, str):
            return None
        for lane in self._lanes.values():
            if lane.tracker.in_response and lane.response_id == response_id:
                return lane
        return None

    def _check_append(self, event: ResponseAppend) -> tuple[_ClientLane, frozenset[str]]:
        lane = self._running(event.response_id)
        if lane is None or not lane.suspended:
            default = self._lanes[None]
            raise LocalProtocolError(
                f"response.append to {event.response_id!r}: no rollout with that id is "
                f"suspended on this connection (phase {(lane or default).phase.name}, response "
                f"{(lane or default).response_id!r})"
            )
        pending = set(lane.pending_call_ids)
        answered: set[str] = set()
        for i, item in enumerate(event.input):
            output = output_of(item)
            if output is None:
                continue
            call_id = output[0]
            if call_id not in pending or call_id in answered:
                raise LocalProtocolError(
                    f"response.append input[{i}] answers call {call_id!r}, which is not pending"
                )
            answered.add(call_id)
        return lane, frozenset(answered)

    def _usable(self) -> None:
        if self._broken:
            raise LocalProtocolError("the server broke the protocol; the connection is unusable")

    # --- receiving ---
    def receive_text(self, data: str | bytes) -> ServerEvent | SseErrorEvent:
        """Decode one server message to its typed event and follow it."""
        self._usable()
        try:
            event = decode_server_event(data, max_size=self.max_message_size)
        except RemoteProtocolError:
            self._broken = True
            raise
        response = named_response_of(event)
        steer = steer_of(event)
        self._follow(
            event.type,
            event.sequence_number,
            response.id if response is not None else steer.previous_response_id if steer else None,
            pending_calls_of(event),
            lane_of(event),
            has_sequence_number=True,
            previous_response_id=previous_id_of(event),
            steer_id=steer.id if steer is not None else None,
            item=item_fields(event),
        )
        return event

    def receive_json(self, event: Mapping[str, Any]) -> Mapping[str, Any]:
        """Follow one server event given as parsed JSON (the caller did `json.loads`): only
        `type`, `sequence_number`, `stream_id`, `response.id`, `pending_call_ids`, and the
        item grammar's `output_index`, `content_index`, `item_id`, `item.id` and
        `item.type` are read."""
        self._usable()
        kind = event.get("type") if isinstance(event, Mapping) else None
        if not isinstance(kind, str):
            self._broken = True
            raise RemoteProtocolError.invalid(
                "A server event is not a JSON object with a string `type`.",
                code="invalid_server_event",
            )
        response = event.get("response")
        response = response if isinstance(response, Mapping) else {}
        steer = event.get("steer")
        steer = steer if isinstance(steer, Mapping) else {}
        response_id = response.get("id") if response else steer.get("previous_response_id")
        previous = response.get("previous_response_id")
        steer_id = steer.get("id")
        pending = event.get("pending_call_ids")
        stream_id = event.get("stream_id")
        item = event.get("item")
        item_id = event.get("item_id")
        item_type = None
        if isinstance(item, Mapping):  # output_item.added names its item by the item's id
            item_id, item_type = item.get("id"), item.get("type")
        self._follow(
            kind,
            event.get("sequence_number"),
            response_id if isinstance(response_id, str) else None,
            pending if isinstance(pending, list) else None,
            stream_id if isinstance(stream_id, str) else None,
            has_sequence_number="sequence_number" in event,
            previous_response_id=previous if isinstance(previous, str) else None,
            steer_id=steer_id if isinstance(steer_id, str) else None,
            item=(event.get("output_index"), event.get("content_index"), item_id, item_type),
        )
        return event

    def _follow(
        self,
        kind: str,
        sequence_number: object,
        response_id: str | None,
        pending: list[str] | None,
        stream_id: str | None,
        *,
        has_sequence_number: bool,
        previous_response_id: str | None = None,
        steer_id: str | None = None,
        item: tuple[object, object, object, object] = (None, None, None, None),
    ) -> None:
        """`item`: what the item grammar reads (`_state.item_fields`)."""
        if kind in _INJECT_ACKS:
            self._take_inject(stream_id)
        if kind in ANSWER_EVENT_TYPES:
            if kind == "error":
                self._request_error(stream_id)
            return
        if not has_sequence_number and kind.split(".")[0] != "response":
            return  # an extension frame outside any response (e.g. `rollout.timing`)
        try:
            lane = self._lanes.get(stream_id)
            if lane is None:
                raise LocalProtocolError(
                    f"{kind} arrived on lane {stream_id!r}, on which no create was sent"
                )
            tracker = lane.tracker
            if kind in STEER_EVENT_TYPES:
                self._follow_steer(lane, kind, sequence_number, response_id, steer_id)
                return
            if tracker.phase is Phase.IDLE and not _successor(tracker, kind, previous_response_id):
                if kind not in ("response.created", "response.queued"):
                    raise LocalProtocolError(f"{kind} arrived while no response is running")
                if not lane.creates:
                    raise LocalProtocolError(f"{kind} arrived but no create is waiting")
                tracker.start(rollout=lane.creates.popleft())
            suspended = tracker.phase is Phase.SUSPENDED
            move = tracker.advance(
                kind,
                sequence_number,
                response_id,
                pending,
                previous_response_id=previous_response_id,
                output_index=item[0],
                content_index=item[1],
                item_id=item[2],
                item_type=item[3],
            )
        except LocalProtocolError as exc:
            self._broken = True
            raise RemoteProtocolError.invalid(
                f"The server broke the WebSocket-mode protocol: {exc}", code="invalid_server_event"
            ) from exc
        if move is Move.DONE or (suspended and move in (Move.IN_PROGRESS, Move.TERMINAL)):
            lane.appends.clear()  # a resume or an end answers the appends before it
            lane.answered.clear()
        if move is Move.TERMINAL and response_id is not None:
            self._ended.add(response_id, stream_id)

    def _follow_steer(
        self,
        lane: _ClientLane,
        kind: str,
        sequence_number: object,
        target: str | None,
        steer_id: str | None,
    ) -> None:
        """A steering answer: in the stream of the response it names, or out of any stream
        (sequence number 0); an acceptance or a failure without a steer id answers a steer."""
        if sequence_number != OUT_OF_STREAM:
            lane.tracker.advance(kind, sequence_number, target, steer_id=steer_id)
        first_answer = kind == "response.steer.accepted" or (
            kind == "response.steer.failed" and steer_id is None
        )
        if first_answer:
            if not self._steers:
                raise LocalProtocolError(f"{kind} arrived but no steer is waiting for an answer")
            self._steers -= 1
        elif sequence_number == OUT_OF_STREAM:
            raise LocalProtocolError(f"{kind} for accepted input came out of its response's stream")

    def _request_error(self, stream_id: str | None) -> None:
        """Attribute a request error to the message it answers (see the module docstring):
        on the lane it names, else, from a server that names no lane, to any."""
        if self._refusable.get(stream_id):
            self._take_refusable(stream_id)
            return
        if self._injects.get(stream_id):
            self._take_inject(stream_id)  # an inject refused (its input is not committed)
            return
        lane = self._lanes.get(stream_id)
        if lane is not None and lane.take_error():
            return
        if self._refusable:
            self._take_refusable(next(iter(self._refusable)))
            return
        if stream_id is None:  # e.g. a server without lanes refusing a laned create
            for other in self._lanes.values():
                if other.take_error():
                    return

    def _take_refusable(self, stream_id: str | None) -> None:
        left = self._refusable[stream_id] - 1
        if left:
            self._refusable[stream_id] = left
        else:
            del self._refusable[stream_id]


def _successor(tracker: ResponseTracker, kind: str, previous_response_id: str | None) -> bool:
    """A `response.created` that starts the ended response's successor (ST-2)."""
    return (
        kind == "response.created"
        and tracker.ended
        and tracker.steers_owed > 0
        and previous_response_id == tracker.response_id
    )
