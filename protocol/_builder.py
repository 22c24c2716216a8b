"""Builders: a response being sampled in, its exact event sequence out.

`ResponseStream` is a small table-driven state machine (after h11's `_state.py`). Each method
is one action; the table says in which states it is legal and what state follows. A misuse
raises `LocalProtocolError` and moves the machine to ERROR, which refuses further use.

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
from collections.abc import Iterator
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

__all__ = ["BuilderState", "InvalidToolPayload", "ResponseStream", "iter_chunks"]


class InvalidToolPayload(LocalProtocolError):
    """A built-in tool call's payload is not the JSON its item needs (a model's mistake). The
    stream is left as it was: the caller can still end the response (`fail`)."""


class BuilderState(enum.Enum):
    NEW = "new"  # nothing sent yet
    ACTIVE = "active"  # created/in_progress sent, between items
    IN_MESSAGE = "in_message"  # an assistant message's text is streaming
    IN_CALL = "in_call"  # a function call's arguments are streaming
    SUSPENDED = "suspended"  # rollout extension: response.done sent, waiting for outputs
    DONE = "done"  # a terminal event was sent
    ERROR = "error"  # misused; refuses everything but `abort`


# action -> {state it is legal in: state after it}
_TRANSITIONS: dict[str, dict[BuilderState, BuilderState]] = {
    "start": {BuilderState.NEW: BuilderState.ACTIVE},
    "begin_message": {BuilderState.ACTIVE: BuilderState.IN_MESSAGE},
    "text_delta": {BuilderState.IN_MESSAGE: BuilderState.IN_MESSAGE},
    "end_message": {BuilderState.IN_MESSAGE: BuilderState.ACTIVE},
    "begin_call": {BuilderState.ACTIVE: BuilderState.IN_CALL},
    "arguments_delta": {BuilderState.IN_CALL: BuilderState.IN_CALL},
    "end_call": {BuilderState.IN_CALL: BuilderState.ACTIVE},
    "add_item": {BuilderState.ACTIVE: BuilderState.ACTIVE},
    "suspend": {BuilderState.ACTIVE: BuilderState.SUSPENDED},
    "resume": {BuilderState.SUSPENDED: BuilderState.ACTIVE},
    # Multi-agent beta: a response waiting for injected outputs stays ACTIVE (no
    # response.done); each inject it commits is acknowledged in its sequence.
    "inject_created": {BuilderState.ACTIVE: BuilderState.ACTIVE},
    "complete": {BuilderState.ACTIVE: BuilderState.DONE},
    "incomplete": {
        s: BuilderState.DONE
        for s in (
            BuilderState.ACTIVE,
            BuilderState.IN_MESSAGE,
            BuilderState.IN_CALL,
            BuilderState.SUSPENDED,
        )
    },
    # Not from NEW: a response that never started has no `response.failed` (send an error).
    "fail": {
        s: BuilderState.DONE
        for s in (
            BuilderState.ACTIVE,
            BuilderState.IN_MESSAGE,
            BuilderState.IN_CALL,
            BuilderState.SUSPENDED,
        )
    },
    # The last resort after a bug (ours, or a backend's): also from ERROR, so a response that
    # started always ends with a terminal event.
    "abort": {
        s: BuilderState.DONE
        for s in (
            BuilderState.ACTIVE,
            BuilderState.IN_MESSAGE,
            BuilderState.IN_CALL,
            BuilderState.SUSPENDED,
            BuilderState.ERROR,
        )
    },
}


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


class ResponseStream:
    """The event sequence of one response. `response` is the snapshot sent in
    `response.created`; every later snapshot is derived from it."""

    def __init__(self, response: Response, *, first_sequence_number: int = 0) -> None:
        self._base = attrs.evolve(response, status="in_progress", output=[], usage=None)
        self._output: list[Item] = list(response.output)
        self._seq = first_sequence_number
        self._state = BuilderState.NEW
        self._open: _Open | None = None
        self._step_start = len(self._output)  # the first output index of the current step

    # --- introspection ---
    @property
    def state(self) -> BuilderState:
        return self._state

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
    def _transition(self, action: str) -> None:
        nxt = _TRANSITIONS[action].get(self._state)
        if nxt is None:
            was = self._state
            self._state = BuilderState.ERROR
            raise LocalProtocolError(f"can't {action} in state {was.value}")
        self._state = nxt

    def _next_sequence(self) -> int:
        n = self._seq
        self._seq += 1
        return n

    def steer_sequence_number(self) -> int:
        """The sequence number of a steering answer in this stream (ST-2): after
        `response.created`, also after the terminal event."""
        if self._state in (BuilderState.NEW, BuilderState.ERROR):
            raise LocalProtocolError(f"no steering answer in state {self._state.value}")
        return self._next_sequence()

    # --- actions ---
    def start(self) -> list[ServerEvent]:
        """`response.created` then `response.in_progress`."""
        self._transition("start")
        snap = self.snapshot()
        return [
            ResponseCreated(sequence_number=self._next_sequence(), response=snap),
            ResponseInProgress(sequence_number=self._next_sequence(), response=snap),
        ]

    def begin_message(self, item_id: str) -> list[ServerEvent]:
        self._transition("begin_message")
        index = len(self._output)
        self._open = _Open(item_id=item_id, output_index=index, parts=[])
        item = Message(id=item_id, role="assistant", status="in_progress", content=[])
        return [
            OutputItemAdded(sequence_number=self._next_sequence(), output_index=index, item=item),
            ContentPartAdded(
                sequence_number=self._next_sequence(),
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=OutputText(text=""),
            ),
        ]

    def text_delta(self, delta: str) -> ServerEvent:
        self._transition("text_delta")
        assert self._open is not None
        self._open.parts.append(delta)
        return OutputTextDelta(
            sequence_number=self._next_sequence(),
            item_id=self._open.item_id,
            output_index=self._open.output_index,
            content_index=0,
            delta=delta,
        )

    def end_message(self, *, status: ItemStatus = "completed") -> list[ServerEvent]:
        self._transition("end_message")
        return self._close_message(status)

    def _close_message(self, status: ItemStatus) -> list[ServerEvent]:
        assert self._open is not None
        o, self._open = self._open, None
        text = "".join(o.parts)
        part = OutputText(text=text)
        item = Message(
            id=o.item_id,
            role="assistant",
            status=status,
            content=[part],
        )
        self._output.append(item)
        common = {"item_id": o.item_id, "output_index": o.output_index, "content_index": 0}
        return [
            OutputTextDone(sequence_number=self._next_sequence(), text=text, **common),  # type: ignore[arg-type]
            ContentPartDone(sequence_number=self._next_sequence(), part=part, **common),  # type: ignore[arg-type]
            OutputItemDone(
                sequence_number=self._next_sequence(), output_index=o.output_index, item=item
            ),
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
        self._transition("begin_call")
        index = len(self._output)
        self._open = _Open(
            item_id=item_id,
            output_index=index,
            parts=[],
            kind=kind,
            call_id=call_id,
            name=name,
            namespace=namespace,
        )
        if kind not in ("function", "custom"):
            return []
        item = self._call_item(self._open, "", "in_progress")
        return [
            OutputItemAdded(sequence_number=self._next_sequence(), output_index=index, item=item)
        ]

    def arguments_delta(self, delta: str) -> ServerEvent | None:
        """More of the open call: function arguments or custom input (an event), or a built-in
        call's payload (kept until the call ends: None)."""
        self._transition("arguments_delta")
        o = self._open
        assert o is not None
        o.parts.append(delta)
        if o.kind == "function":
            return FunctionCallArgumentsDelta(
                sequence_number=self._next_sequence(),
                item_id=o.item_id,
                output_index=o.output_index,
                delta=delta,
            )
        if o.kind == "custom":
            return CustomToolCallInputDelta(
                sequence_number=self._next_sequence(),
                item_id=o.item_id,
                output_index=o.output_index,
                delta=delta,
            )
        return None

    def end_call(self, *, status: ItemStatus = "completed") -> list[ServerEvent]:
        """Close the open call. A built-in call whose payload is not valid raises
        `InvalidToolPayload` and leaves the stream as it was."""
        o = self._open
        if (
            self._state is BuilderState.IN_CALL
            and o is not None
            and o.kind
            not in (
                "function",
                "custom",
            )
        ):
            self._call_item(o, "".join(o.parts), status)  # check before changing state
        self._transition("end_call")
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
        assert self._open is not None and self._open.kind is not None
        o, self._open = self._open, None
        text = "".join(o.parts)
        item = self._call_item(o, text, status)
        self._output.append(item)
        done = OutputItemDone(sequence_number=0, output_index=o.output_index, item=item)
        if o.kind == "function":
            return [
                FunctionCallArgumentsDone(
                    sequence_number=self._next_sequence(),
                    item_id=o.item_id,
                    output_index=o.output_index,
                    arguments=text,
                ),
                attrs.evolve(done, sequence_number=self._next_sequence()),
            ]
        if o.kind == "custom":
            return [
                CustomToolCallInputDone(
                    sequence_number=self._next_sequence(),
                    item_id=o.item_id,
                    output_index=o.output_index,
                    input=text,
                ),
                attrs.evolve(done, sequence_number=self._next_sequence()),
            ]
        added = OutputItemAdded(
            sequence_number=self._next_sequence(), output_index=o.output_index, item=item
        )
        return [added, attrs.evolve(done, sequence_number=self._next_sequence())]

    def add_item(self, item: Item) -> list[ServerEvent]:
        """A finished item that is not streamed (e.g. a `compaction` item): added, then done."""
        self._transition("add_item")
        index = len(self._output)
        self._output.append(item)
        return [
            OutputItemAdded(sequence_number=self._next_sequence(), output_index=index, item=item),
            OutputItemDone(sequence_number=self._next_sequence(), output_index=index, item=item),
        ]

    def suspend(self, pending_call_ids: list[str]) -> ResponseDone:
        """Rollout extension: the rollout waits for the outputs of `pending_call_ids`. The
        event names the response and the output indices of this step (the items since the
        start or the last resume), never the items themselves."""
        self._transition("suspend")
        return ResponseDone(
            sequence_number=self._next_sequence(),
            response=self._ref(),
            pending_call_ids=list(pending_call_ids),
            output_indices=list(range(self._step_start, len(self._output))),
        )

    def resume(self) -> ResponseInProgress:
        """Rollout extension: outputs were appended; sampling continues in this response (a
        new step, whose items start at the next output index)."""
        self._transition("resume")
        self._step_start = len(self._output)
        return ResponseInProgress(sequence_number=self._next_sequence(), response=self._ref())

    def _ref(self) -> ResponseRef:
        return ResponseRef(id=self._base.id, status="in_progress")

    def inject_created(self, *, stream_id: str | None = None) -> ResponseInjectCreated:
        """Multi-agent beta: an inject was committed to this response (between items)."""
        self._transition("inject_created")
        return ResponseInjectCreated(
            sequence_number=self._next_sequence(), response_id=self._base.id, stream_id=stream_id
        )

    def complete(self, *, usage: Usage, completed_at: int) -> ResponseCompleted:
        self._transition("complete")
        return ResponseCompleted(
            sequence_number=self._next_sequence(),
            response=self.final("completed", usage, completed_at),
        )

    def incomplete(self, *, reason: str, usage: Usage, completed_at: int) -> list[ServerEvent]:
        """End early (e.g. `max_output_tokens`): an open message, function or custom call is
        closed as `incomplete`; an open built-in call (never announced: its payload is cut
        off) is dropped."""
        was = self._state
        self._transition("incomplete")
        events: list[ServerEvent] = []
        if was is BuilderState.IN_MESSAGE:
            events += self._close_message("incomplete")
        elif was is BuilderState.IN_CALL:
            assert self._open is not None
            if self._open.kind in ("function", "custom"):
                events += self._close_call("incomplete")
            self._open = None
        response = attrs.evolve(
            self.final("incomplete", usage, completed_at),
            incomplete_details=IncompleteDetails(reason=reason),  # type: ignore[arg-type]
        )
        events.append(ResponseIncomplete(sequence_number=self._next_sequence(), response=response))
        return events

    def fail(self, *, error: ResponseError, usage: Usage | None) -> ResponseFailed:
        """End with `response.failed`; an item still open is dropped from the output."""
        if self._state is BuilderState.NEW:
            self._state = BuilderState.ERROR
            raise LocalProtocolError("can't fail before start(): send an error event instead")
        self._transition("fail")
        self._open = None
        response = attrs.evolve(self.final("failed", usage, None), error=error)
        return ResponseFailed(sequence_number=self._next_sequence(), response=response)

    def abort(self, *, error: ResponseError, usage: Usage | None) -> ResponseFailed | None:
        """`response.failed` whatever went wrong before, even in ERROR (an item still open is
        dropped); None when there is nothing to end (never started, or already ended)."""
        if self._state not in _TRANSITIONS["abort"]:
            return None
        self._state = BuilderState.DONE
        self._open = None
        response = attrs.evolve(self.final("failed", usage, None), error=error)
        return ResponseFailed(sequence_number=self._next_sequence(), response=response)

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
