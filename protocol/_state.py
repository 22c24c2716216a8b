"""The WebSocket-mode state machine of one connection, shared by both ends (after h11's
`_state.py`): the server checks what it sends against it, the client what it receives.

Long because it is the one grammar: the response's lifecycle table, the item-level table
(output item -> content part -> deltas -> done) and the tracker that walks both, which the
builder drives as it builds and both connection ends read; split, each would need the others'
states.

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

Inside a running response, its output items follow the item grammar (`ITEM_TRANSITIONS`,
one `ItemMove` per item, part or delta event, from `ItemPhase` to `ItemPhase`):

    NONE --output_item.added--> MESSAGE | ARGUMENTS | INPUT | OTHER   (by the item's type)
    MESSAGE --content_part.added--> PART --(text|refusal).delta*--> PART
    PART --(text|refusal).done--> TEXT_DONE --content_part.done--> MESSAGE
    ARGUMENTS --function_call_arguments.delta*, .done--> CALL_DONE
    INPUT --custom_tool_call_input.delta*, .done--> CALL_DONE
    MESSAGE | CALL_DONE | OTHER --output_item.done--> NONE

Items come one at a time, `output_index` from 0 (from the first index of the created
response, for a builder that starts with output) up by one, across a rollout's suspensions;
a part, text or call event names the open item (`output_index`, `item_id`) and a message's
parts are numbered from 0 (`content_index`). Events of other types are allowed between
items, or inside the item their `output_index` names (reasoning, hosted tools). A suspension
(`response.done`), an inject's acknowledgement, `response.completed` and
`response.incomplete` come between items; `response.failed` may cut an item off.

`ResponseTracker` applies the tables and the rules a table cannot say: sequence numbers
start at 0 and grow by one, every lifecycle event names the same response, `response.done`
names the calls that resume the rollout. A violation raises `LocalProtocolError`; the
client's connection re-raises it as the peer's (`RemoteProtocolError`), as h11 does.

One tracker, three drivers: the builder (`_builder.py`'s `ResponseStream` checks each event
as it builds it), the server's connection (each event it sends; once only, when the lane's
builder drives the lane's tracker: `driven`, `send_built`; the slot passes to another
response only once nothing built is `unsent`), and the client's connection
(each event it receives, which is also how `spec/`'s order analysis replays a stream). The
per-event path (an item, part or delta event of a running response) reads string-keyed rows
compiled from `ITEM_TRANSITIONS` and hashes no enum.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from ._errors import LocalProtocolError
from ._events import (
    RESPONSE_END_TYPES,
    ContentPartAdded,
    ContentPartDone,
    CustomToolCallInputDelta,
    CustomToolCallInputDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    ServerEvent,
    SseErrorEvent,
)
from ._items import CustomToolCall, FunctionCall, Message

__all__ = [
    "ITEM_TRANSITIONS",
    "PLAIN_TRANSITIONS",
    "ROLLOUT_TRANSITIONS",
    "ItemMove",
    "ItemPhase",
    "Move",
    "Phase",
    "ResponseTracker",
    "advance_item",
    "item_fields",
    "item_move_of",
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


class ItemPhase(enum.Enum):
    NONE = "none"  # between items
    MESSAGE = "message"  # a message is open, between its content parts
    PART = "part"  # a content part is open: its text (or refusal) streams
    TEXT_DONE = "text_done"  # the part's text is done: its content_part.done is next
    ARGUMENTS = "arguments"  # a function call is open: its argument deltas stream
    INPUT = "input"  # a custom tool call is open: its input deltas stream
    CALL_DONE = "call_done"  # the call's arguments (input) are done: output_item.done is next
    OTHER = "other"  # another kind of item (reasoning, a built-in tool's call, compaction)


class ItemMove(enum.Enum):
    ADDED = "response.output_item.added"
    DONE = "response.output_item.done"
    PART_ADDED = "response.content_part.added"
    PART_DONE = "response.content_part.done"
    TEXT_DELTA = "text delta"  # response.output_text.delta | response.refusal.delta
    TEXT_DONE = "text done"  # response.output_text.done | response.refusal.done
    ARGUMENTS_DELTA = "response.function_call_arguments.delta"
    ARGUMENTS_DONE = "response.function_call_arguments.done"
    INPUT_DELTA = "response.custom_tool_call_input.delta"
    INPUT_DONE = "response.custom_tool_call_input.done"
    BETWEEN = "between"  # only between items: response.inject.created
    OTHER = "other"  # any other event of a running response


_ITEM_MOVES = {
    **{move.value: move for move in ItemMove},
    "response.output_text.delta": ItemMove.TEXT_DELTA,
    "response.refusal.delta": ItemMove.TEXT_DELTA,
    "response.output_text.done": ItemMove.TEXT_DONE,
    "response.refusal.done": ItemMove.TEXT_DONE,
    "response.inject.created": ItemMove.BETWEEN,
}
# The phase an item opens in, by its `type` (any other type: OTHER).
_OPENS = {
    "message": ItemPhase.MESSAGE,
    "function_call": ItemPhase.ARGUMENTS,
    "custom_tool_call": ItemPhase.INPUT,
}

ItemTable = Mapping[ItemPhase, Mapping[ItemMove, ItemPhase]]

ITEM_TRANSITIONS: ItemTable = {
    # ADDED leads to the phase its item's type opens (`_OPENS`); OTHER here is an event
    # outside any item (one that names an `output_index` must be inside that item).
    ItemPhase.NONE: {
        ItemMove.ADDED: ItemPhase.OTHER,
        ItemMove.BETWEEN: ItemPhase.NONE,
        ItemMove.OTHER: ItemPhase.NONE,
    },
    ItemPhase.MESSAGE: {
        ItemMove.PART_ADDED: ItemPhase.PART,
        ItemMove.DONE: ItemPhase.NONE,
        ItemMove.OTHER: ItemPhase.MESSAGE,
    },
    ItemPhase.PART: {
        ItemMove.TEXT_DELTA: ItemPhase.PART,
        ItemMove.TEXT_DONE: ItemPhase.TEXT_DONE,
        ItemMove.OTHER: ItemPhase.PART,
    },
    ItemPhase.TEXT_DONE: {
        ItemMove.PART_DONE: ItemPhase.MESSAGE,
        ItemMove.OTHER: ItemPhase.TEXT_DONE,
    },
    ItemPhase.ARGUMENTS: {
        ItemMove.ARGUMENTS_DELTA: ItemPhase.ARGUMENTS,
        ItemMove.ARGUMENTS_DONE: ItemPhase.CALL_DONE,
        ItemMove.OTHER: ItemPhase.ARGUMENTS,
    },
    ItemPhase.INPUT: {
        ItemMove.INPUT_DELTA: ItemPhase.INPUT,
        ItemMove.INPUT_DONE: ItemPhase.CALL_DONE,
        ItemMove.OTHER: ItemPhase.INPUT,
    },
    ItemPhase.CALL_DONE: {ItemMove.DONE: ItemPhase.NONE, ItemMove.OTHER: ItemPhase.CALL_DONE},
    ItemPhase.OTHER: {ItemMove.DONE: ItemPhase.NONE, ItemMove.OTHER: ItemPhase.OTHER},
}
# Item moves that name the open item (`output_index` and `item_id`) and, for a part's
# events, its part (`content_index`).
_OF_ITEM = frozenset(
    {
        ItemMove.PART_ADDED,
        ItemMove.PART_DONE,
        ItemMove.TEXT_DELTA,
        ItemMove.TEXT_DONE,
        ItemMove.ARGUMENTS_DELTA,
        ItemMove.ARGUMENTS_DONE,
        ItemMove.INPUT_DELTA,
        ItemMove.INPUT_DONE,
    }
)
_OF_PART = frozenset(
    {ItemMove.PART_ADDED, ItemMove.PART_DONE, ItemMove.TEXT_DELTA, ItemMove.TEXT_DONE}
)
_IN_PART = frozenset({ItemPhase.PART, ItemPhase.TEXT_DONE})
# Why a move is refused in a phase (the first entry that matches; `{i}`: the open item).
_REFUSALS: tuple[tuple[frozenset[ItemMove], frozenset[ItemPhase] | None, str], ...] = (
    (frozenset({ItemMove.ADDED}), None, "an item was added while item {i} is open"),
    (frozenset({ItemMove.BETWEEN}), None, "while item {i} is open"),
    (frozenset({ItemMove.PART_ADDED}), _IN_PART, "a part was added while a part is open"),
    (frozenset({ItemMove.PART_ADDED}), None, "a content part outside a message item"),
    (
        frozenset({ItemMove.TEXT_DELTA, ItemMove.TEXT_DONE}),
        frozenset({ItemPhase.TEXT_DONE}),
        "text after the part's text was done",
    ),
    (
        frozenset({ItemMove.TEXT_DELTA, ItemMove.TEXT_DONE}),
        None,
        "text outside an open content part",
    ),
    (
        frozenset({ItemMove.PART_DONE}),
        frozenset({ItemPhase.PART}),
        "content_part.done before the text's done event",
    ),
    (frozenset({ItemMove.PART_DONE}), None, "content_part.done without an open part"),
    (
        frozenset({ItemMove.ARGUMENTS_DELTA, ItemMove.ARGUMENTS_DONE}),
        frozenset({ItemPhase.CALL_DONE}),
        "arguments after function_call_arguments.done",
    ),
    (
        frozenset({ItemMove.ARGUMENTS_DELTA, ItemMove.ARGUMENTS_DONE}),
        None,
        "arguments outside a function_call item",
    ),
    (
        frozenset({ItemMove.INPUT_DELTA, ItemMove.INPUT_DONE}),
        frozenset({ItemPhase.CALL_DONE}),
        "input after custom_tool_call_input.done",
    ),
    (
        frozenset({ItemMove.INPUT_DELTA, ItemMove.INPUT_DONE}),
        None,
        "input outside a custom_tool_call item",
    ),
    (frozenset({ItemMove.DONE}), frozenset({ItemPhase.NONE}), "no open item"),
    (frozenset({ItemMove.DONE}), _IN_PART, "output_item.done before content_part.done"),
    (
        frozenset({ItemMove.DONE}),
        frozenset({ItemPhase.ARGUMENTS}),
        "output_item.done before function_call_arguments.done",
    ),
    (
        frozenset({ItemMove.DONE}),
        frozenset({ItemPhase.INPUT}),
        "output_item.done before custom_tool_call_input.done",
    ),
)


def item_move_of(event_type: str) -> ItemMove:
    """The item move an event of a running response makes (lifecycle events make none)."""
    return _ITEM_MOVES.get(event_type, ItemMove.OTHER)


def _refusal(move: ItemMove, phase: ItemPhase, index: object) -> str:
    for moves, phases, text in _REFUSALS:
        if move in moves and (phases is None or phase in phases):
            return text.format(i=index)
    return f"not allowed in item phase {phase.name}"


# What an item move checks of its event: nothing (OTHER, BETWEEN: only that an
# `output_index` names the open item), the open item, also its part, the next item (ADDED),
# the open item's end (DONE).
_ANY, _OF_OPEN, _OF_OPEN_PART, _NEXT, _END = range(5)
_CHECKS = {
    ItemMove.ADDED: _NEXT,
    ItemMove.DONE: _END,
    ItemMove.OTHER: _ANY,
    ItemMove.BETWEEN: _ANY,
    **dict.fromkeys(_OF_PART, _OF_OPEN_PART),
    **dict.fromkeys(_OF_ITEM - _OF_PART, _OF_OPEN),
}
_Step = tuple[ItemMove, ItemPhase, int]
# ITEM_TRANSITIONS compiled for the per-event path: for each phase, event type -> step (the
# key "" is any event type the grammar does not name). String keys, no enum hashing.
_ROWS: dict[ItemPhase, dict[str, _Step]] = {
    phase: {
        **{
            event_type: (move, row[move], _CHECKS[move])
            for event_type, move in _ITEM_MOVES.items()
            if move in row
        },
        "": (ItemMove.OTHER, row[ItemMove.OTHER], _ANY),
    }
    for phase, row in ITEM_TRANSITIONS.items()
}
# Event types of a response that are not item events (their moves are the response's own).
_RESPONSE_EVENT_TYPES = frozenset(_LIFECYCLE) | _STEERS


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
        # Driven by a builder (`ResponseStream(tracker=...)`): each event was checked where it
        # was built; the connection checks only that it goes out in order (`sent`), numbers
        # reserved for steering answers (checked when sent) aside.
        self.driven = False
        self.sent = 0
        self._reserved: list[int] = []
        self._reset_items()

    def _reset_items(self, first_output_index: int = 0) -> None:
        self.item_phase = ItemPhase.NONE
        self._row = _ROWS[ItemPhase.NONE]
        self.item_index: object = None  # the open item's output_index
        self.item_id: object = None  # the open item's id
        self.parts = 0  # the open message's content parts done (the next content_index)
        self.next_output_index = first_output_index

    @property
    def unsent(self) -> int:
        """Events a driving builder built that have not gone out yet (0 when no builder
        drives this tracker: then nothing is ahead of what was sent)."""
        return self.next_sequence_number - self.sent if self.driven else 0

    def _check_all_sent(self, what: str) -> None:
        """The slot passes to another response only once every event the last one built
        went out: the tracker is shared (a builder drives it), its phase is what was built."""
        if self.driven and self.sent < self.next_sequence_number:
            raise LocalProtocolError(
                f"{what} while {self.next_sequence_number - self.sent} event(s) built for "
                f"{self.response_id} have not gone out"
            )

    def start(
        self, *, rollout: bool, first_sequence_number: int = 0, first_output_index: int = 0
    ) -> None:
        """A create leaves the queue and is answered next (a builder may number its events,
        and its items, from elsewhere than 0)."""
        if self.phase is not Phase.IDLE:
            raise LocalProtocolError(f"a create can't start in phase {self.phase.name}")
        self._check_all_sent("a create can't start")
        self.phase, self.rollout = Phase.STARTING, rollout
        self.response_id, self.pending_call_ids = None, ()
        self.next_sequence_number = self.sent = first_sequence_number
        self.ended, self.steers_owed = False, 0
        self.driven, self._reserved = False, []
        self._reset_items(first_output_index)

    def reserve(self) -> int:
        """The next sequence number, for an event checked where it is sent instead (a
        builder's steering answer)."""
        n = self.next_sequence_number
        self.next_sequence_number = n + 1
        self._reserved.append(n)
        return n

    def send_built(self, event_type: str, sequence_number: object) -> None:
        """A driven tracker's event goes out: it must be the next one its builder built
        (checked then), in order."""
        n = self.sent
        if sequence_number != n or n >= self.next_sequence_number or n in self._reserved:
            raise LocalProtocolError(
                f"{event_type} (sequence_number {sequence_number}) is not the next event the "
                f"lane's builder built (sequence_number {n})"
            )
        self.sent = n + 1

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
        output_index: object = None,
        content_index: object = None,
        item_id: object = None,
        item_type: object = None,
    ) -> Move:
        """Apply one event of the running response; returns its move. `response_id` is the
        id of a lifecycle event's `response` (with its `previous_response_id`), the target
        of a steering answer (with its `steer_id`), None for other events. An item, part or
        delta event gives its `output_index`, `content_index` and `item_id` (None when it has
        none), `output_item.added` its item's `id` (as `item_id`) and `type`."""
        if self.phase is Phase.RUNNING and event_type not in _RESPONSE_EVENT_TYPES:
            # The per-event path (an item, part or delta event): no enum is hashed here.
            expected = self.next_sequence_number
            if sequence_number.__class__ is not int or sequence_number != expected:
                raise LocalProtocolError(
                    sequence_problem(event_type, sequence_number, expected) or "unreachable"
                )
            self._item(event_type, output_index, content_index, item_id, item_type)
            self.next_sequence_number = expected + 1
            return Move.ITEM
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
            self._check_all_sent("a successor can't start")
            self.response_id, self.next_sequence_number, self.pending_call_ids = None, 0, ()
            self.ended, self.steers_owed, self.sent, self._reserved = False, 0, 0, []
            self._reset_items()
        expected = self.next_sequence_number
        problem = sequence_problem(event_type, sequence_number, expected)
        if problem is not None:
            raise LocalProtocolError(problem)
        if self.item_phase is not ItemPhase.NONE and (
            move is Move.DONE or (move is Move.TERMINAL and event_type != "response.failed")
        ):
            raise LocalProtocolError(f"{event_type} while item {self.item_index} is open")
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

    def _item(
        self,
        event_type: str,
        output_index: object,
        content_index: object,
        item_id: object,
        item_type: object,
    ) -> None:
        """Apply one event to the item grammar (checked in full before anything changes)."""
        step = self._row.get(event_type)
        if step is None:
            move = _ITEM_MOVES.get(event_type)
            if move is not None:  # an event the grammar names, refused in this phase
                refusal = _refusal(move, self.item_phase, self.item_index)
                raise LocalProtocolError(f"{event_type}: {refusal}")
            step = self._row[""]
        move, after, check = step
        if check == _OF_OPEN_PART or check == _OF_OPEN:
            if output_index != self.item_index:
                raise LocalProtocolError(
                    f"{event_type}: output_index {output_index!r}, expected {self.item_index!r}"
                )
            if item_id != self.item_id:
                raise LocalProtocolError(
                    f"{event_type}: item_id {item_id!r}, expected the item id {self.item_id!r}"
                )
            if check == _OF_OPEN_PART and content_index != self.parts:
                raise LocalProtocolError(
                    f"{event_type}: content_index {content_index!r}, expected {self.parts}"
                )
            if move is ItemMove.PART_DONE:
                self.parts += 1
        elif check == _ANY:
            if output_index is not None and (
                self.item_phase is ItemPhase.NONE or output_index != self.item_index
            ):
                raise LocalProtocolError(
                    f"{event_type}: names output_index {output_index!r} outside its item"
                )
            return
        elif check == _NEXT:
            if output_index != self.next_output_index:
                raise LocalProtocolError(
                    f"{event_type}: output_index {output_index!r}, expected "
                    f"{self.next_output_index}"
                )
            after = _OPENS.get(item_type, ItemPhase.OTHER)  # type: ignore[call-overload]
            self.item_index, self.item_id, self.parts = output_index, item_id, 0
        else:  # _END
            if output_index != self.item_index:
                raise LocalProtocolError(
                    f"{event_type}: no open item with output_index {output_index!r}"
                )
            self.item_index = self.item_id = None
            self.next_output_index += 1
        if after is not self.item_phase:
            self.item_phase, self._row = after, _ROWS[after]

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
        reserved = self.driven and sequence_number in self._reserved
        if reserved:  # numbered by the builder: it goes out in order
            expected = self.sent
        else:
            expected = self.next_sequence_number
        problem = sequence_problem(event_type, sequence_number, expected)
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
        if reserved:
            self._reserved.remove(expected)
            self.sent = expected + 1
        else:
            self.next_sequence_number += 1
            self.sent = self.next_sequence_number
        self.phase = after
        return Move.STEER

    @property
    def in_response(self) -> bool:
        return self.phase in (Phase.QUEUED, Phase.CREATED, Phase.RUNNING, Phase.SUSPENDED)


_PART_EVENTS = (OutputTextDelta, OutputTextDone, ContentPartAdded, ContentPartDone)
_CALL_EVENTS = (
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    CustomToolCallInputDelta,
    CustomToolCallInputDone,
)
_STREAMED_ITEMS = (Message, FunctionCall, CustomToolCall)


def advance_item(tracker: ResponseTracker, event: ServerEvent) -> Move:
    """`tracker.advance` for a typed event that names no response (an item, part or delta
    event, an inject's acknowledgement), with the fields the item grammar reads."""
    if isinstance(event, _PART_EVENTS):
        return tracker.advance(
            event.type,
            event.sequence_number,
            None,
            output_index=event.output_index,
            content_index=event.content_index,
            item_id=event.item_id,
        )
    if isinstance(event, _CALL_EVENTS):
        return tracker.advance(
            event.type,
            event.sequence_number,
            None,
            output_index=event.output_index,
            item_id=event.item_id,
        )
    if isinstance(event, OutputItemAdded):
        item = event.item
        streamed = isinstance(item, _STREAMED_ITEMS)
        return tracker.advance(
            event.type,
            event.sequence_number,
            None,
            output_index=event.output_index,
            item_id=item.id if streamed else None,
            item_type=item.type if streamed else None,
        )
    if isinstance(event, OutputItemDone):
        return tracker.advance(
            event.type, event.sequence_number, None, output_index=event.output_index
        )
    return tracker.advance(event.type, event.sequence_number, None)


def item_fields(event: ServerEvent | SseErrorEvent) -> tuple[object, object, object, object]:
    """What the item grammar reads off a typed event: its `output_index`, `content_index`,
    `item_id` (for `output_item.added`, its item's `id`) and the added item's `type`."""
    if isinstance(event, _PART_EVENTS):
        return event.output_index, event.content_index, event.item_id, None
    if isinstance(event, _CALL_EVENTS):
        return event.output_index, None, event.item_id, None
    if isinstance(event, OutputItemAdded):
        item = event.item
        if isinstance(item, _STREAMED_ITEMS):
            return event.output_index, None, item.id, item.type
        return event.output_index, None, None, None
    if isinstance(event, OutputItemDone):
        return event.output_index, None, None, None
    return None, None, None, None
