"""Builders: a response being sampled in, its exact event sequence out.

`ResponseStream` checks each event where it builds it, against the one grammar both ends of
a connection follow (`_state.py`'s `ResponseTracker`: the response's lifecycle and its items,
parts and deltas, with their indices and ids); it keeps no table of its own. A misuse (an
event the grammar refuses, e.g. a text delta with no message open) raises
`LocalProtocolError` and moves the builder to ERROR, which refuses everything but `abort`.
The one thing the grammar cannot see is a built-in tool's call, which sends nothing until it
ends: while one is open the builder refuses to start another item, suspend or complete.

What it guarantees, whatever the caller does legally:
- `sequence_number` starts at `first_sequence_number` (0) and grows by one per event, across
  suspensions of a rollout (the extension's `response.done` and resume);
- a suspension costs the same whatever came before it: `response.done` names the response
  (`ResponseRef`), the pending calls and the output indices of the step, and the resumed
  `response.in_progress` names the response; neither repeats an item (each went out as
  `response.output_item.done`); only the terminal event carries the whole response;
- `output_index` is the item's index in the final `response.output`; `item_id` is the item
  `id` (never a `call_id`); `content_index` is the part's index in the message;
- concatenated text deltas equal `output_text.done.text`, the `content_part.done` part, the
  item in `output_item.done` and the item in the terminal response's `output`; likewise for
  function-call argument deltas and custom-tool input deltas.

Tool calls of every kind stream through one state (IN_CALL): a function call's arguments and a
custom tool's input go out as deltas; a built-in tool's call (`shell`, `local_shell`,
`apply_patch`, `computer`) is built from its JSON payload (the action or operation) and goes out
whole, `output_item.added` then `output_item.done`, when it ends.

It holds no clock and no randomness: timestamps and ids are arguments.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterator
from typing import Any, Literal

import attrs

from ._codec import from_wire
from ._errors import LocalProtocolError, RemoteProtocolError
from ._events import (
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
    ResponseCompleted,
    ResponseCreated,
    ResponseDone,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInjectCreated,
    ResponseInProgress,
    ServerEvent,
)
from ._items import (
    ApplyPatchCall,
    ApplyPatchOperation,
    CallKind,
    ComputerCall,
    CustomToolCall,
    FunctionCall,
    Item,
    ItemStatus,
    LocalShellAction,
    LocalShellCall,
    Message,
    OutputText,
    ShellAction,
    ShellCall,
)
from ._response import (
    IncompleteDetails,
    Response,
    ResponseError,
    ResponseRef,
    ResponseStatus,
    Usage,
)
from ._state import Phase, ResponseTracker

__all__ = ["BuilderState", "InvalidToolPayload", "ResponseStream", "iter_chunks"]


class InvalidToolPayload(LocalProtocolError):
    """A built-in tool call's payload is not the JSON its item needs (a model's mistake). The
    stream is left as it was: the caller can still end the response (`fail`)."""


class BuilderState(enum.Enum):
    """Where the builder is, as its tracker's phases show it (and the item it holds open)."""

    NEW = "new"  # nothing sent yet
    ACTIVE = "active"  # created/in_progress sent, between items
    IN_MESSAGE = "in_message"  # an assistant message's text is streaming
    IN_CALL = "in_call"  # a tool call's arguments (input, payload) are streaming
    SUSPENDED = "suspended"  # rollout extension: response.done sent, waiting for outputs
    DONE = "done"  # a terminal event was sent
    ERROR = "error"  # misused; refuses everything but `abort`


def iter_chunks(text: str, size: int) -> Iterator[str]:
    """Split `text` into pieces of at most `size` characters (one piece for empty text)."""
    if size < 1:
        raise LocalProtocolError(f"chunk size must be >= 1, got {size}")
    if not text:
        yield ""
        return
    for i in range(0, len(text), size):
        yield text[i : i + size]


@attrs.define
class _Open:
    """The item being streamed."""

    item_id: str
    output_index: int
    parts: list[str]
    kind: CallKind | None = None  # None: a message
    call_id: str = ""
    name: str = ""
    namespace: str | None = None


# What an event names when no item is open (the grammar refuses it, saying why).
_NO_ITEM = _Open(item_id="", output_index=-1, parts=[])
_BUILT_IN = frozenset({"local_shell", "shell", "apply_patch", "computer"})
# A streamed call's last event, by kind: its type and how it is made (number, call, text).
_CALL_DONES: dict[str, tuple[str, Callable[[int, _Open, str], ServerEvent]]] = {
    "function": (
        "response.function_call_arguments.done",
        lambda n, o, text: FunctionCallArgumentsDone(
            sequence_number=n, item_id=o.item_id, output_index=o.output_index, arguments=text
        ),
    ),
    "custom": (
        "response.custom_tool_call_input.done",
        lambda n, o, text: CustomToolCallInputDone(
            sequence_number=n, item_id=o.item_id, output_index=o.output_index, input=text
        ),
    ),
}
_CALL_DELTAS: dict[str, tuple[str, type[FunctionCallArgumentsDelta | CustomToolCallInputDelta]]] = {
    "function": ("response.function_call_arguments.delta", FunctionCallArgumentsDelta),
    "custom": ("response.custom_tool_call_input.delta", CustomToolCallInputDelta),
}


class ResponseStream:
    """The event sequence of one response. `response` is the snapshot sent in
    `response.created`; every later snapshot is derived from it."""

    def __init__(
        self,
        response: Response,
        *,
        first_sequence_number: int = 0,
        tracker: ResponseTracker | None = None,
    ) -> None:
        """`tracker`: the tracker of the lane the response goes out on (a `ServerConnection`
        lane's, after `start_next`), so each event is checked once, here; else its own."""
        self._base = attrs.evolve(response, status="in_progress", output=[], usage=None)
        self._output: list[Item] = list(response.output)
        self._seq = first_sequence_number
        self._shared = tracker is not None
        # The grammar every built event is checked against.
        self._tracker = tracker if tracker is not None else ResponseTracker()
        self._started = self._ended = self._error = False
        self._open: _Open | None = None
        self._step_start = len(self._output)  # the first output index of the current step

    # --- introspection ---
    @property
    def state(self) -> BuilderState:
        if self._error:
            return BuilderState.ERROR
        if not self._started:
            return BuilderState.NEW
        if self._ended:
            return BuilderState.DONE
        if self._tracker.phase is Phase.SUSPENDED:
            return BuilderState.SUSPENDED
        if self._open is None:
            return BuilderState.ACTIVE
        return BuilderState.IN_MESSAGE if self._open.kind is None else BuilderState.IN_CALL

    @property
    def next_sequence_number(self) -> int:
        return self._seq

    @property
    def output(self) -> list[Item]:
        """Items finished so far, in output order."""
        return list(self._output)

    @property
    def output_count(self) -> int:
        return len(self._output)

    def output_since(self, index: int) -> list[Item]:
        """Items finished since `output_count` was `index` (without copying older ones)."""
        return self._output[index:]

    def snapshot(self) -> Response:
        """The response as it stands (status in_progress, finished items only)."""
        return attrs.evolve(self._base, output=list(self._output))

    # --- machinery ---
    def _advance(
        self,
        event_type: str,
        response_id: str | None = None,
        pending: list[str] | None = None,
        *,
        output_index: int | None = None,
        content_index: int | None = None,
        item_id: str | None = None,
        item_type: str | None = None,
        previous: str | None = None,
    ) -> int:
        """Check the next event against the grammar; its sequence number. A refusal moves the
        builder to ERROR (nothing else changes)."""
        if self._error:
            raise LocalProtocolError(f"can't build {event_type}: the builder was misused earlier")
        try:
            self._tracker.advance(
                event_type,
                self._seq,
                response_id,
                pending,
                output_index=output_index,
                content_index=content_index,
                item_id=item_id,
                item_type=item_type,
                previous_response_id=previous,
            )
        except LocalProtocolError:
            self._error = True
            raise
        n = self._seq
        self._seq = n + 1
        return n

    def _refuse(self, action: str) -> LocalProtocolError:
        was, self._error = self.state, True
        return LocalProtocolError(f"can't {action} in state {was.value}")

    def _between_items(self, action: str) -> None:
        """A built-in tool's call is open (it sent nothing yet: only the builder knows)."""
        if self._error or (self._open is not None and self._open.kind in _BUILT_IN):
            raise self._refuse(action)

    def steer_sequence_number(self) -> int:
        """The sequence number of a steering answer in this stream (ST-2): after
        `response.created`, also after the terminal event."""
        if self.state in (BuilderState.NEW, BuilderState.ERROR):
            raise LocalProtocolError(f"no steering answer in state {self.state.value}")
        self._seq = self._tracker.reserve() + 1
        return self._seq - 1

    # --- actions ---
    def start(self) -> list[ServerEvent]:
        """`response.created` then `response.in_progress`."""
        if self.state is not BuilderState.NEW:
            raise self._refuse("start")
        tracker = self._tracker
        if not self._shared:
            tracker.start(
                rollout=True, first_sequence_number=self._seq, first_output_index=len(self._output)
            )
        elif tracker.phase is Phase.STARTING:  # the lane's create, started by the connection
            tracker.next_output_index = len(self._output)
        # (Else a successor on a lane whose response ended: the grammar says whether it may.)
        snap = self.snapshot()
        rid = self._base.id
        created = self._advance("response.created", rid, previous=self._base.previous_response_id)
        if self._shared:
            tracker.driven = True
        self._started = True
        return [
            ResponseCreated(sequence_number=created, response=snap),
            ResponseInProgress(
                sequence_number=self._advance("response.in_progress", rid), response=snap
            ),
        ]

    def begin_message(self, item_id: str) -> list[ServerEvent]:
        self._between_items("begin_message")
        index = len(self._output)
        item = Message(id=item_id, role="assistant", status="in_progress", content=[])
        added = OutputItemAdded(
            sequence_number=self._advance(
                "response.output_item.added",
                output_index=index,
                item_id=item_id,
                item_type="message",
            ),
            output_index=index,
            item=item,
        )
        part = ContentPartAdded(
            sequence_number=self._advance(
                "response.content_part.added", output_index=index, content_index=0, item_id=item_id
            ),
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=OutputText(text=""),
        )
        self._open = _Open(item_id=item_id, output_index=index, parts=[])
        return [added, part]

    def text_delta(self, delta: str) -> ServerEvent:
        o = self._open or _NO_ITEM
        n = self._advance(
            "response.output_text.delta",
            output_index=o.output_index,
            content_index=0,
            item_id=o.item_id,
        )
        o.parts.append(delta)
        return OutputTextDelta(
            sequence_number=n,
            item_id=o.item_id,
            output_index=o.output_index,
            content_index=0,
            delta=delta,
        )

    def end_message(self, *, status: ItemStatus = "completed") -> list[ServerEvent]:
        return self._close_message(status)

    def _close_message(self, status: ItemStatus) -> list[ServerEvent]:
        o = self._open or _NO_ITEM
        common = {"item_id": o.item_id, "output_index": o.output_index, "content_index": 0}
        text_n = self._advance("response.output_text.done", **common)  # type: ignore[arg-type]
        part_n = self._advance("response.content_part.done", **common)  # type: ignore[arg-type]
        item_n = self._advance("response.output_item.done", output_index=o.output_index)
        self._open = None
        text = "".join(o.parts)
        part = OutputText(text=text)
        item = Message(id=o.item_id, role="assistant", status=status, content=[part])
        self._output.append(item)
        return [
            OutputTextDone(sequence_number=text_n, text=text, **common),  # type: ignore[arg-type]
            ContentPartDone(sequence_number=part_n, part=part, **common),  # type: ignore[arg-type]
            OutputItemDone(sequence_number=item_n, output_index=o.output_index, item=item),
        ]

    def begin_call(
        self,
        item_id: str,
        call_id: str,
        name: str,
        *,
        kind: CallKind = "function",
        namespace: str | None = None,
    ) -> list[ServerEvent]:
        """Open a tool call. Function and custom calls are announced now; a built-in tool's
        call when it ends (its item needs the whole payload)."""
        self._between_items("begin_call")
        index = len(self._output)
        o = _Open(
            item_id=item_id,
            output_index=index,
            parts=[],
            kind=kind,
            call_id=call_id,
            name=name,
            namespace=namespace,
        )
        if kind in _BUILT_IN:
            if self.state is not BuilderState.ACTIVE:
                raise self._refuse("begin_call")
            self._open = o
            return []
        item = self._call_item(o, "", "in_progress")
        n = self._advance(
            "response.output_item.added", output_index=index, item_id=item_id, item_type=item.type
        )
        self._open = o
        return [OutputItemAdded(sequence_number=n, output_index=index, item=item)]

    def arguments_delta(self, delta: str) -> ServerEvent | None:
        """More of the open call: function arguments or custom input (an event), or a built-in
        call's payload (kept until the call ends: None)."""
        o = self._open or _NO_ITEM
        if o.kind in _BUILT_IN and not self._error:
            o.parts.append(delta)
            return None
        # (With no call open, or a message, the grammar refuses a function call's delta.)
        event_type, event = _CALL_DELTAS["custom" if o.kind == "custom" else "function"]
        n = self._advance(event_type, output_index=o.output_index, item_id=o.item_id)
        o.parts.append(delta)
        return event(sequence_number=n, item_id=o.item_id, output_index=o.output_index, delta=delta)

    def end_call(self, *, status: ItemStatus = "completed") -> list[ServerEvent]:
        """Close the open call. A built-in call whose payload is not valid raises
        `InvalidToolPayload` and leaves the stream as it was."""
        o = self._open
        if o is not None and o.kind in _BUILT_IN and not self._error:
            self._call_item(o, "".join(o.parts), status)  # check before changing state
        return self._close_call(status)

    def _call_item(self, o: _Open, text: str, status: ItemStatus) -> Item:
        """The item of the open call with `text` as its arguments, input or payload."""
        common: dict[str, Any] = {"id": o.item_id, "call_id": o.call_id}
        if o.kind == "function":
            return FunctionCall(
                **common, name=o.name, arguments=text, status=status, namespace=o.namespace
            )
        if o.kind == "custom":
            return CustomToolCall(
                **common, name=o.name, input=text, status=status, namespace=o.namespace
            )
        try:
            payload = json.loads(text)
            if o.kind == "shell":
                return ShellCall(**common, action=from_wire(payload, ShellAction), status=status)
            if o.kind == "local_shell":
                action: LocalShellAction = from_wire(payload, LocalShellAction)
                return LocalShellCall(**common, action=action, status=status)
            if o.kind == "apply_patch":
                operation: ApplyPatchOperation = from_wire(payload, ApplyPatchOperation)
                done: Literal["in_progress", "completed"] = (
                    "completed" if status == "completed" else "in_progress"
                )
                return ApplyPatchCall(**common, operation=operation, status=done)
            if not isinstance(payload, dict):
                raise ValueError("a computer action must be an object")
            return ComputerCall(**common, action=payload, status=status)
        except (ValueError, RemoteProtocolError) as exc:
            raise InvalidToolPayload(
                f"the payload of a {o.kind} call is not valid: {exc}"
            ) from None

    def _close_call(self, status: ItemStatus) -> list[ServerEvent]:
        o = self._open or _NO_ITEM
        text = "".join(o.parts)
        first: ServerEvent
        if o.kind in _BUILT_IN and not self._error:
            item = self._call_item(o, text, status)
            added_n = self._advance(
                "response.output_item.added", output_index=o.output_index, item_type=item.type
            )
            first = OutputItemAdded(sequence_number=added_n, output_index=o.output_index, item=item)
        else:  # a function or custom call (nothing open: the grammar says what is wrong)
            event_type, done = _CALL_DONES["custom" if o.kind == "custom" else "function"]
            first = done(
                self._advance(event_type, output_index=o.output_index, item_id=o.item_id), o, text
            )
            item = self._call_item(o, text, status)
        done_n = self._advance("response.output_item.done", output_index=o.output_index)
        self._open = None
        self._output.append(item)
        return [
            first,
            OutputItemDone(sequence_number=done_n, output_index=o.output_index, item=item),
        ]

    def add_item(self, item: Item) -> list[ServerEvent]:
        """A finished item that is not streamed (e.g. a `compaction` item): added, then done."""
        self._between_items("add_item")
        index = len(self._output)
        added_n = self._advance(
            "response.output_item.added", output_index=index, item_type=item.type
        )
        done_n = self._advance("response.output_item.done", output_index=index)
        self._output.append(item)
        return [
            OutputItemAdded(sequence_number=added_n, output_index=index, item=item),
            OutputItemDone(sequence_number=done_n, output_index=index, item=item),
        ]

    def suspend(self, pending_call_ids: list[str]) -> ResponseDone:
        """Rollout extension: the rollout waits for the outputs of `pending_call_ids`. The
        event names the response and the output indices of this step (the items since the
        start or the last resume), never the items themselves."""
        self._between_items("suspend")
        n = self._advance("response.done", self._base.id, list(pending_call_ids))
        return ResponseDone(
            sequence_number=n,
            response=self._ref(),
            pending_call_ids=list(pending_call_ids),
            output_indices=list(range(self._step_start, len(self._output))),
        )

    def resume(self) -> ResponseInProgress:
        """Rollout extension: outputs were appended; sampling continues in this response (a
        new step, whose items start at the next output index)."""
        if self.state is not BuilderState.SUSPENDED:
            raise self._refuse("resume")
        n = self._advance("response.in_progress", self._base.id)
        self._step_start = len(self._output)
        return ResponseInProgress(sequence_number=n, response=self._ref())

    def _ref(self) -> ResponseRef:
        return ResponseRef(id=self._base.id, status="in_progress")

    def inject_created(self, *, stream_id: str | None = None) -> ResponseInjectCreated:
        """Multi-agent beta: an inject was committed to this response (between items)."""
        self._between_items("inject_created")
        return ResponseInjectCreated(
            sequence_number=self._advance("response.inject.created"),
            response_id=self._base.id,
            stream_id=stream_id,
        )

    def complete(self, *, usage: Usage, completed_at: int) -> ResponseCompleted:
        if self.state is not BuilderState.ACTIVE:
            raise self._refuse("complete")
        n = self._advance("response.completed", self._base.id)
        self._ended = True
        return ResponseCompleted(
            sequence_number=n, response=self.final("completed", usage, completed_at)
        )

    def incomplete(self, *, reason: str, usage: Usage, completed_at: int) -> list[ServerEvent]:
        """End early (e.g. `max_output_tokens`): an open message, function or custom call is
        closed as `incomplete`; an open built-in call (never announced: its payload is cut
        off) is dropped."""
        if self.state in (BuilderState.NEW, BuilderState.DONE, BuilderState.ERROR):
            raise self._refuse("incomplete")
        events: list[ServerEvent] = []
        o = self._open
        if o is not None and o.kind is None:
            events += self._close_message("incomplete")
        elif o is not None and o.kind not in _BUILT_IN:
            events += self._close_call("incomplete")
        self._open = None
        response = attrs.evolve(
            self.final("incomplete", usage, completed_at),
            incomplete_details=IncompleteDetails(reason=reason),  # type: ignore[arg-type]
        )
        n = self._advance("response.incomplete", self._base.id)
        self._ended = True
        events.append(ResponseIncomplete(sequence_number=n, response=response))
        return events

    def fail(self, *, error: ResponseError, usage: Usage | None) -> ResponseFailed:
        """End with `response.failed`; an item still open is dropped from the output."""
        if self.state is BuilderState.NEW:
            self._error = True
            raise LocalProtocolError("can't fail before start(): send an error event instead")
        if self.state in (BuilderState.DONE, BuilderState.ERROR):
            raise self._refuse("fail")
        n = self._advance("response.failed", self._base.id)
        self._open, self._ended = None, True
        response = attrs.evolve(self.final("failed", usage, None), error=error)
        return ResponseFailed(sequence_number=n, response=response)

    def abort(self, *, error: ResponseError, usage: Usage | None) -> ResponseFailed | None:
        """`response.failed` whatever went wrong before, even in ERROR (an item still open is
        dropped); None when there is nothing to end (never started, or already ended)."""
        if self.state in (BuilderState.NEW, BuilderState.DONE):
            return None
        self._error, self._open = False, None
        self._started = self._ended = True
        tracker, n = self._tracker, self._seq
        try:
            tracker.advance("response.failed", n, self._base.id)
        except LocalProtocolError:  # the last resort ends the response whatever came before
            tracker.phase, tracker.ended, tracker.next_sequence_number = Phase.IDLE, True, n + 1
        self._seq = n + 1
        response = attrs.evolve(self.final("failed", usage, None), error=error)
        return ResponseFailed(sequence_number=n, response=response)

    def final(
        self, status: ResponseStatus, usage: Usage | None, completed_at: int | None
    ) -> Response:
        return attrs.evolve(
            self._base,
            status=status,
            output=list(self._output),
            usage=usage,
            completed_at=completed_at,
        )
