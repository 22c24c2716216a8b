"""The WebSocket-mode state machine of one connection, shared by both ends (after h11's
`_state.py`): the server checks what it sends against it, the client what it receives.

A lane of a connection runs one response at a time (PROTOCOL.md WS-5.1, WS-7), so a lane's
state is the state of that one slot; a connection keeps one tracker per lane
(`_connection.py`). Every server event of a response is one `Move`; the table says, for each
`Phase`, which moves are legal and where they lead. A plain response and a rollout (the
extension, RX-2) have a table each: only a rollout may suspend (`response.done`) and be
resumed (`response.in_progress` again). Creates wait in their lane's FIFO queue until
the slot is free; request errors (`error` events) answer a message and are outside the
response grammar.

    IDLE --start--> STARTING --created--> CREATED --in_progress--> RUNNING --terminal--> IDLE
                       |                  ^                        |  ^ item
                     queued               |                 done   |  | in_progress
                       v                  |            (rollout)   v  |
                      QUEUED --created----+                    SUSPENDED --terminal--> IDLE

(A suspended rollout that times out may end without resuming, RX-3.2.)

Steering (`response.steer`, ST-2) adds one move, STEER: an acknowledgement in the stream of
the response it names. `response.steer.accepted` (and a failure without a steer id) may come
while the response runs (CREATED, RUNNING, SUSPENDED); after its terminal event the slot is
IDLE but keeps the ended response until another starts, and that response's accepted input
is answered there, in its stream: `response.steer.pending` or a failure with the steer id
for each, or a successor's `response.created` (numbered from 0, `previous_response_id` the
ended response) that commits all of it. A successor starts without a create of its own.

`ResponseTracker` applies the table and the rules a table cannot say: sequence numbers
start at 0 and grow by one, every lifecycle event names the same response, `response.done`
names the calls that resume the rollout. A violation raises `LocalProtocolError`; the
client's connection re-raises it as the peer's (`RemoteProtocolError`), as h11 does.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from ._errors import LocalProtocolError
from ._events import RESPONSE_END_TYPES

__all__ = [
    "PLAIN_TRANSITIONS",
    "ROLLOUT_TRANSITIONS",
    "Move",
    "Phase",
    "ResponseTracker",
    "move_of",
    "sequence_problem",
]


class Phase(enum.Enum):
    IDLE = "idle"  # no response: the next queued create may start
    STARTING = "starting"  # a create is being answered; no event of it was sent yet
    QUEUED = "queued"  # `response.queued` was sent (rollout never sends it)
    CREATED = "created"  # `response.created` was sent
    RUNNING = "running"  # `response.in_progress` was sent: output items follow
    SUSPENDED = "suspended"  # a rollout sent `response.done` and waits for appends
    ERROR = "error"  # a violation happened: the connection refuses further use


class Move(enum.Enum):
    QUEUED = "response.queued"
    CREATED = "response.created"
    IN_PROGRESS = "response.in_progress"
    ITEM = "item"  # any other event of a response (items, parts, deltas, unknown kinds)
    DONE = "response.done"
    TERMINAL = "terminal"  # response.completed | response.incomplete | response.failed
    STEER = "steer"  # response.steer.accepted | response.steer.pending | response.steer.failed


_LIFECYCLE = {
    "response.queued": Move.QUEUED,
    "response.created": Move.CREATED,
    "response.in_progress": Move.IN_PROGRESS,
    "response.done": Move.DONE,
    **dict.fromkeys(RESPONSE_END_TYPES, Move.TERMINAL),
}

_STEERS = frozenset({"response.steer.accepted", "response.steer.pending", "response.steer.failed"})

Table = Mapping[Phase, Mapping[Move, Phase]]

PLAIN_TRANSITIONS: Table = {
    # After a terminal event only (the ended response's steering answers, its successor).
    Phase.IDLE: {Move.STEER: Phase.IDLE, Move.CREATED: Phase.CREATED},
    Phase.STARTING: {Move.QUEUED: Phase.QUEUED, Move.CREATED: Phase.CREATED},
    Phase.QUEUED: {Move.CREATED: Phase.CREATED},
    Phase.CREATED: {Move.IN_PROGRESS: Phase.RUNNING, Move.STEER: Phase.CREATED},
    Phase.RUNNING: {Move.ITEM: Phase.RUNNING, Move.STEER: Phase.RUNNING, Move.TERMINAL: Phase.IDLE},
    Phase.ERROR: {},
}
ROLLOUT_TRANSITIONS: Table = {
    **PLAIN_TRANSITIONS,
    Phase.RUNNING: {**PLAIN_TRANSITIONS[Phase.RUNNING], Move.DONE: Phase.SUSPENDED},
    Phase.SUSPENDED: {
        Move.IN_PROGRESS: Phase.RUNNING,
        Move.STEER: Phase.SUSPENDED,
        Move.TERMINAL: Phase.IDLE,
    },
}


def move_of(event_type: str) -> Move:
    """The move a server event of a response makes (`error` is not one: see the module)."""
    if event_type in _STEERS:
        return Move.STEER
    return _LIFECYCLE.get(event_type, Move.ITEM)


def sequence_problem(event_type: object, sequence_number: object, expected: int) -> str | None:
    """The numbering rule (WS-3.2): an event's `sequence_number` is an integer, the one
    after its predecessor's in the same response (0 for the first)."""
    if (
        isinstance(sequence_number, int)
        and not isinstance(sequence_number, bool)
        and sequence_number == expected
    ):
        return None
    return f"{event_type} has sequence_number {sequence_number!r}, expected {expected}"


class ResponseTracker:
    """The slot of one lane: its phase, and the running response's id, next sequence
    number and (while suspended) pending call ids."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self.rollout = False
        self.response_id: str | None = None
        self.next_sequence_number = 0
        self.pending_call_ids: tuple[str, ...] = ()
        self.ended = False  # IDLE after this response's terminal event (nothing started since)
        self.steers_owed = 0  # its accepted steering input not yet pending, failed or committed

    def start(self, *, rollout: bool) -> None:
        """A create leaves the queue and is answered next."""
        if self.phase is not Phase.IDLE:
            raise LocalProtocolError(f"a create can't start in phase {self.phase.name}")
        self.phase, self.rollout = Phase.STARTING, rollout
        self.response_id, self.next_sequence_number, self.pending_call_ids = None, 0, ()
        self.ended, self.steers_owed = False, 0

    def refuse(self) -> None:
        """The starting create is answered by a request error instead of a response."""
        if self.phase is not Phase.STARTING:
            raise LocalProtocolError(
                f"a request error can only answer a create before its response started; the "
                f"slot is {self.phase.name}"
            )
        self.phase = Phase.IDLE

    def advance(
        self,
        event_type: str,
        sequence_number: object,
        response_id: str | None,
        pending_call_ids: Sequence[str] | None = None,
        *,
        previous_response_id: str | None = None,
        steer_id: str | None = None,
    ) -> Move:
        """Apply one event of the running response; returns its move. `response_id` is the
        id of a lifecycle event's `response` (with its `previous_response_id`), the target
        of a steering answer (with its `steer_id`), None for other events."""
        move = move_of(event_type)
        table = ROLLOUT_TRANSITIONS if self.rollout else PLAIN_TRANSITIONS
        after = table.get(self.phase, {}).get(move)
        if after is not None and self.phase is Phase.IDLE:
            after = self._after_end(event_type, move, previous_response_id, steer_id)
        if after is None:
            kind = "rollout" if self.rollout else "response"
            raise LocalProtocolError(
                f"{event_type} is not allowed in phase {self.phase.name} of a {kind}"
                + (f" ({self.response_id})" if self.response_id else "")
            )
        if move is Move.STEER:
            return self._steer(event_type, sequence_number, response_id, steer_id, after)
        if move is Move.CREATED and self.phase is Phase.IDLE:  # a successor: a stream of its own
            self.response_id, self.next_sequence_number, self.pending_call_ids = None, 0, ()
            self.ended, self.steers_owed = False, 0
        expected = self.next_sequence_number
        problem = sequence_problem(event_type, sequence_number, expected)
        if problem is not None:
            raise LocalProtocolError(problem)
        if move in (Move.QUEUED, Move.CREATED) and self.response_id is None:
            self.response_id = response_id
        elif move in _LIFECYCLE.values() and response_id != self.response_id:
            raise LocalProtocolError(
                f"{event_type} names response {response_id!r}, expected {self.response_id!r}"
            )
        if move is Move.DONE:
            if not pending_call_ids:
                raise LocalProtocolError("response.done names no pending call")
            self.pending_call_ids = tuple(pending_call_ids)
        elif move is Move.IN_PROGRESS:
            self.pending_call_ids = ()
        self.next_sequence_number = expected + 1
        self.phase = after
        if move is Move.TERMINAL:
            self.ended = True
        return move

    def _after_end(
        self, event_type: str, move: Move, previous_response_id: str | None, steer_id: str | None
    ) -> Phase | None:
        """What an IDLE slot allows: only after a terminal event, the answers owed for the
        ended response's accepted steering input, and its successor."""
        if not self.ended:
            return None
        if move is Move.CREATED:
            if self.steers_owed and previous_response_id == self.response_id:
                return Phase.CREATED
            return None
        if event_type == "response.steer.accepted" or steer_id is None or not self.steers_owed:
            return None  # after the end only accepted input is answered, each once
        return Phase.IDLE

    def _steer(
        self,
        event_type: str,
        sequence_number: object,
        target: str | None,
        steer_id: str | None,
        after: Phase,
    ) -> Move:
        problem = sequence_problem(event_type, sequence_number, self.next_sequence_number)
        if problem is not None:
            raise LocalProtocolError(problem)
        if target != self.response_id:
            raise LocalProtocolError(
                f"{event_type} answers steering of {target!r} in the stream of {self.response_id!r}"
            )
        if event_type == "response.steer.accepted":
            self.steers_owed += 1
        elif steer_id is not None:  # pending, or a failure of accepted input
            if not self.steers_owed:
                raise LocalProtocolError(f"{event_type} answers no accepted steering input")
            self.steers_owed -= 1
        self.next_sequence_number += 1
        self.phase = after
        return Move.STEER

    @property
    def in_response(self) -> bool:
        return self.phase in (Phase.QUEUED, Phase.CREATED, Phase.RUNNING, Phase.SUSPENDED)
