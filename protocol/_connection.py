"""WebSocket-mode connections, sans-IO (after h11's and wsproto's `Connection`): frame text in,
events out; events in, frame text out. No sockets, no tasks, no clock: the I/O layer owns
those and drives these objects.

`ServerConnection` is the server's side. `receive_text` decodes a client message and applies
the connection rules: a create joins the FIFO queue (or is refused when the queue is full, or
names a lane, which rollout does not run), an append is let through only to this connection's
suspended rollout (else `rollout_not_found`, `response_already_completed` or
`rollout_not_suspended`); a refusal comes back as the ready-made `ErrorEvent` to send. The
server then says when it takes the next create off its queue (`start`), and `send` encodes
each event of that response after checking it against the response grammar (`_state.py`):
a server that breaks it raises `LocalProtocolError`.

`ClientConnection` is the client's side. `send` encodes client events and refuses misuse
with `LocalProtocolError` (an append to nothing suspended, or answering a call that is not
pending); `receive_text` (typed events) or `receive_json` (an already parsed JSON object: the
cheap path of a benchmark client, and of a harness that must read what it does not know)
follows the server's events and raises `RemoteProtocolError` when the server breaks the rules
(an event for no response, a gap in sequence numbers, events after a terminal one, a second
response interleaved with the first). `awaiting` tells whether the server still owes events.

Request errors (`error` events) answer one message and carry no sequence number. Which
message a client cannot always tell (an accepted append is silent), so the client
attributes an error first to a message the server could only refuse (sent raw: not JSON, an
unknown type, an append with nothing suspended), then to its latest append while a rollout
is suspended, else to a queued create: exact for a client with one request unanswered at a
time, as the SDKs are.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from typing import Any

from ._codec import DEFAULT_MAX_MESSAGE_SIZE, decode_client_event, decode_server_event, encode_json
from ._errors import ErrorBody, LocalProtocolError, RemoteProtocolError
from ._events import (
    ClientEvent,
    ErrorEvent,
    ResponseAppend,
    ResponseCreate,
    ServerEvent,
    SseErrorEvent,
)
from ._items import output_of
from ._state import Move, Phase, ResponseTracker

__all__ = [
    "DEFAULT_MAX_QUEUED_CREATES",
    "DEFAULT_MAX_REMEMBERED_RESPONSES",
    "ClientConnection",
    "ServerConnection",
]

# Creates a client may queue behind the running one. Agents send one at a time; a few more
# allow pipelining, and the bound keeps a misbehaving client from queueing without limit.
DEFAULT_MAX_QUEUED_CREATES = 16
# Ids of ended responses a server connection remembers, to tell an append to one of them
# (`response_already_completed`) from one naming nothing (`rollout_not_found`): ~50 bytes an
# id, far more responses than a connection's cache keeps, bounded for a connection that lives
# an hour and runs many short responses.
DEFAULT_MAX_REMEMBERED_RESPONSES = 1024


def _refusal(message: str, *, code: str, param: str | None = None, status: int = 400) -> ErrorEvent:
    return ErrorEvent(status=status, error=ErrorBody(code=code, message=message, param=param))


class _Connection:
    """What both sides show of the connection's one response slot."""

    _tracker: ResponseTracker

    @property
    def phase(self) -> Phase:
        """The phase of the response being answered (IDLE between responses)."""
        return self._tracker.phase

    @property
    def response_id(self) -> str | None:
        """The id of that response (once its `response.created` went over the wire)."""
        return self._tracker.response_id


class ServerConnection(_Connection):
    """The server's side of one WebSocket-mode connection."""

    def __init__(
        self,
        *,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_queued_creates: int = DEFAULT_MAX_QUEUED_CREATES,
        max_remembered_responses: int = DEFAULT_MAX_REMEMBERED_RESPONSES,
    ) -> None:
        self.max_message_size = max_message_size
        self.max_queued_creates = max_queued_creates
        self.queued = 0  # creates received and not started (at most max_queued_creates + 1)
        self._tracker = ResponseTracker()
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._max_ended = max_remembered_responses

    @property
    def pending_call_ids(self) -> tuple[str, ...]:
        return self._tracker.pending_call_ids

    # --- receiving ---
    def decode(self, data: str | bytes) -> ClientEvent:
        """Decode one client message (pure, so the caller may run it in a worker thread);
        raises `RemoteProtocolError` with the error to answer."""
        return decode_client_event(data, max_size=self.max_message_size)

    def receive_text(self, data: str | bytes) -> list[ClientEvent | ErrorEvent]:
        """A client message -> what to act on: a create to queue, an append to deliver to
        the suspended rollout, or the `error` event to answer with."""
        try:
            event = self.decode(data)
        except RemoteProtocolError as exc:
            return [exc.error_event()]
        return self.receive_event(event)

    def receive_event(self, event: ClientEvent) -> list[ClientEvent | ErrorEvent]:
        """The connection rules for an already decoded client event (see `receive_text`)."""
        if isinstance(event, ResponseCreate):
            return [self._queue(event)]
        return [self._route_append(event)]

    def _queue(self, event: ResponseCreate) -> ResponseCreate | ErrorEvent:
        if event.stream_id is not None:
            return _refusal(
                "Lanes (stream_id) are not supported by this server: omit stream_id to use the "
                "connection's single FIFO lane.",
                code="unsupported_parameter",
                param="stream_id",
            )
        # Between responses the first queued create starts at once: it waits behind nothing.
        waiting = self.queued - (self._tracker.phase is Phase.IDLE)
        if waiting >= self.max_queued_creates:
            return _refusal(
                f"Too many queued requests on this connection (the limit is "
                f"{self.max_queued_creates}); wait for a response to finish.",
                code="too_many_queued_requests",
                status=429,
            )
        self.queued += 1
        return event

    def _route_append(self, event: ResponseAppend) -> ResponseAppend | ErrorEvent:
        tracker = self._tracker
        if tracker.rollout and tracker.in_response and tracker.response_id == event.response_id:
            if tracker.phase is Phase.SUSPENDED:
                return event
            return _refusal(
                "The rollout is not suspended: append tool outputs after response.done.",
                code="rollout_not_suspended",
                param="response_id",
            )
        if event.response_id in self._ended:
            return _refusal(
                f"Response '{event.response_id}' has already completed.",
                code="response_already_completed",
                param="response_id",
            )
        return _refusal(
            f"No rollout with id '{event.response_id}' is running on this connection.",
            code="rollout_not_found",
            param="response_id",
        )

    # --- sending ---
    def start(self, request: ResponseCreate) -> None:
        """The next queued create (in FIFO order) is answered now."""
        if self.queued <= 0:
            raise LocalProtocolError("no create is queued on this connection")
        self._guard(lambda: self._tracker.start(rollout=bool(request.rollout)))
        self.queued -= 1

    def refuse(self, error: RemoteProtocolError | ErrorEvent) -> str:
        """Answer the started create with a request error instead of a response."""
        self._guard(self._tracker.refuse)
        return self.send(error.error_event() if isinstance(error, RemoteProtocolError) else error)

    def send(self, event: ServerEvent) -> str:
        """Encode one server event. A request error (an `ErrorEvent`) may go out at any time;
        an event of the response being answered must follow the response grammar."""
        if self._tracker.phase is Phase.ERROR:
            raise LocalProtocolError("the connection broke the protocol earlier; it can't send")
        if not isinstance(event, ErrorEvent):
            response = getattr(event, "response", None)
            move = self._guard(
                lambda: self._tracker.advance(
                    event.type,
                    event.sequence_number,
                    response.id if response is not None else None,
                    getattr(event, "pending_call_ids", None),
                )
            )
            if move is Move.TERMINAL and response is not None:
                self._remember(response.id)
        return encode_json(event)

    def _remember(self, response_id: str) -> None:
        self._ended[response_id] = None
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)

    def _guard(self, step: Any) -> Any:
        try:
            return step()
        except LocalProtocolError:
            self._tracker.phase = Phase.ERROR
            raise


def _output_call_ids(items: Any) -> list[str]:
    """The call ids a raw append's tool outputs name (leniently: anything else is skipped)."""
    ids = []
    for item in items if isinstance(items, list) else ():
        if isinstance(item, Mapping) and str(item.get("type", "")).endswith("_output"):
            call_id = item.get("call_id")
            if isinstance(call_id, str):
                ids.append(call_id)
    return ids


class ClientConnection(_Connection):
    """The client's side of one WebSocket-mode connection."""

    def __init__(self, *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        self.max_message_size = max_message_size
        self._tracker = ResponseTracker()
        self._creates: collections.deque[bool] = collections.deque()  # queued: is a rollout
        self._appends: list[frozenset[str]] = []  # unanswered appends: the calls they answer
        self._answered: set[str] = set()  # pending calls the client has sent outputs for
        self._refusable = 0  # raw messages sent that the server can only refuse

    # --- state ---
    @property
    def queued(self) -> int:
        """Creates sent whose response has not started (nor been refused)."""
        return len(self._creates)

    @property
    def suspended(self) -> bool:
        return self._tracker.phase is Phase.SUSPENDED

    @property
    def pending_call_ids(self) -> tuple[str, ...]:
        """The suspended rollout's calls that still need an output from this client."""
        if not self.suspended:
            return ()
        return tuple(c for c in self._tracker.pending_call_ids if c not in self._answered)

    @property
    def awaiting(self) -> bool:
        """Whether the server owes events: a response runs or is queued, a message it can only
        refuse awaits its error, or a suspended rollout has every output and is due to
        resume."""
        phase = self._tracker.phase
        if phase is Phase.ERROR:
            return False
        if (
            self._creates
            or self._refusable
            or phase in (Phase.QUEUED, Phase.CREATED, Phase.RUNNING)
        ):
            return True
        return phase is Phase.SUSPENDED and not self.pending_call_ids

    # --- sending ---
    def send(self, event: ClientEvent) -> str:
        """Encode a client event; `LocalProtocolError` when the rules forbid sending it."""
        self._usable()
        if isinstance(event, ResponseAppend):
            answered = self._check_append(event)
            self._answered |= answered
            self._appends.append(answered)
        else:
            self._creates.append(bool(event.rollout))
        return encode_json(event)

    def sent_raw(self, message: Mapping[str, Any] | str | bytes) -> None:
        """Record a message sent without the checks of `send` (a harness sending something
        invalid on purpose): only its `type` is looked at, to expect the right answer."""
        self._usable()
        value: Any = message
        if not isinstance(message, Mapping):
            try:
                value = json.loads(message)
            except ValueError:
                value = None
        kind = value.get("type") if isinstance(value, Mapping) else None
        if kind == "response.create":
            self._creates.append(bool(value.get("rollout")))
        elif kind == "response.append" and self.suspended:
            answered = frozenset(_output_call_ids(value.get("input")))
            self._answered |= answered
            self._appends.append(answered)
        else:  # not a message the server can accept: it owes an error for it
            self._refusable += 1

    def _check_append(self, event: ResponseAppend) -> frozenset[str]:
        tracker = self._tracker
        if not self.suspended or event.response_id != tracker.response_id:
            raise LocalProtocolError(
                f"response.append to {event.response_id!r}: no rollout with that id is "
                f"suspended on this connection (phase {tracker.phase.name}, response "
                f"{tracker.response_id!r})"
            )
        pending = set(self.pending_call_ids)
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
        return frozenset(answered)

    def _usable(self) -> None:
        if self._tracker.phase is Phase.ERROR:
            raise LocalProtocolError("the server broke the protocol; the connection is unusable")

    # --- receiving ---
    def receive_text(self, data: str | bytes) -> ServerEvent | SseErrorEvent:
        """Decode one server message to its typed event and follow it."""
        self._usable()
        try:
            event = decode_server_event(data, max_size=self.max_message_size)
        except RemoteProtocolError:
            self._tracker.phase = Phase.ERROR
            raise
        response = getattr(event, "response", None)
        self._follow(
            event.type,
            event.sequence_number,
            response.id if response is not None else None,
            getattr(event, "pending_call_ids", None),
            has_sequence_number=True,
        )
        return event

    def receive_json(self, event: Mapping[str, Any]) -> Mapping[str, Any]:
        """Follow one server event given as parsed JSON (the caller did `json.loads`): only
        `type`, `sequence_number`, `response.id` and `pending_call_ids` are read."""
        self._usable()
        kind = event.get("type") if isinstance(event, Mapping) else None
        if not isinstance(kind, str):
            self._tracker.phase = Phase.ERROR
            raise RemoteProtocolError.invalid(
                "A server event is not a JSON object with a string `type`.",
                code="invalid_server_event",
            )
        response = event.get("response")
        response_id = response.get("id") if isinstance(response, Mapping) else None
        pending = event.get("pending_call_ids")
        self._follow(
            kind,
            event.get("sequence_number"),
            response_id if isinstance(response_id, str) else None,
            pending if isinstance(pending, list) else None,
            has_sequence_number="sequence_number" in event,
        )
        return event

    def _follow(
        self,
        kind: str,
        sequence_number: object,
        response_id: str | None,
        pending: list[str] | None,
        *,
        has_sequence_number: bool,
    ) -> None:
        tracker = self._tracker
        if kind == "error":
            self._request_error()
            return
        if not has_sequence_number and kind.split(".")[0] != "response":
            return  # an extension frame outside any response (e.g. `rollout.timing`)
        try:
            if tracker.phase is Phase.IDLE:
                if kind not in ("response.created", "response.queued"):
                    raise LocalProtocolError(f"{kind} arrived while no response is running")
                if not self._creates:
                    raise LocalProtocolError(f"{kind} arrived but no create is waiting")
                tracker.start(rollout=self._creates.popleft())
            suspended = tracker.phase is Phase.SUSPENDED
            move = tracker.advance(kind, sequence_number, response_id, pending)
        except LocalProtocolError as exc:
            tracker.phase = Phase.ERROR
            raise RemoteProtocolError.invalid(
                f"The server broke the WebSocket-mode protocol: {exc}", code="invalid_server_event"
            ) from exc
        if move is Move.DONE or (suspended and move in (Move.IN_PROGRESS, Move.TERMINAL)):
            self._appends.clear()  # a resume or an end answers the appends before it
            self._answered.clear()

    def _request_error(self) -> None:
        if self._refusable:
            self._refusable -= 1  # answered at once, as it arrived
        elif self._appends and self.suspended:
            self._answered -= self._appends.pop()  # that append's outputs were not committed
        elif self._creates:
            # While a response runs the error answers the latest create (refused on arrival);
            # between responses, the oldest (refused when its turn came).
            if self._tracker.in_response:
                self._creates.pop()
            else:
                self._creates.popleft()
