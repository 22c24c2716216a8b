"""The event builder (`protocol.ResponseStream`): the invariants of the event sequence it
produces, and its state machine (misuse raises `LocalProtocolError`, then ERROR refuses
everything)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout import protocol as p

from tests.strategies import (
    SCRIPT_COMPLETED_AT,
    SCRIPT_USAGE,
    Call,
    Script,
    Suspend,
    Text,
    run_script,
    stream_scripts,
    texts,
)

SETTINGS = settings(max_examples=80, deadline=None)


def new_stream(first_sequence_number: int = 0) -> p.ResponseStream:
    base = p.Response(id="resp_1", created_at=1, model="m", instructions="be brief")
    return p.ResponseStream(base, first_sequence_number=first_sequence_number)


def expected_item(step: Text | Call, status: str) -> p.Item:
    if isinstance(step, Text):
        return p.Message(
            id=step.item_id,
            role="assistant",
            status=status,  # type: ignore[arg-type]
            content=[p.OutputText(text="".join(step.deltas))],
        )
    return p.FunctionCall(
        id=step.item_id,
        call_id=step.call_id,
        name=step.name,
        arguments="".join(step.deltas),
        status=status,  # type: ignore[arg-type]
        namespace=step.namespace,
    )


def item_text(item: p.Item) -> str:
    if isinstance(item, p.FunctionCall):
        return item.arguments
    assert isinstance(item, p.Message) and not isinstance(item.content, str)
    (part,) = item.content
    assert isinstance(part, p.OutputText)
    return part.text


def check_invariants(events: list[Any], script: Script, first: int = 0) -> None:
    # sequence numbers: from `first`, by exactly one, across suspensions
    assert [e.sequence_number for e in events] == list(range(first, first + len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.type in p.TERMINAL_EVENT_TYPES for e in events] == [False] * (len(events) - 1) + [
        True
    ]
    terminal = events[-1]

    added: dict[int, p.Item] = {}
    done: dict[int, p.Item] = {}
    deltas: dict[int, list[str]] = defaultdict(list)
    open_index: int | None = None
    pending: list[str] = []
    step_start = 0  # the first output index of the step (since the start or the last resume)
    for event in events[2:-1]:
        if isinstance(event, p.OutputItemAdded):
            assert open_index is None
            assert event.output_index == len(added)  # the index in the final output
            assert event.item.status == "in_progress"  # type: ignore[union-attr]
            added[event.output_index] = event.item
            open_index = event.output_index
            continue
        if isinstance(event, p.ResponseDone):
            # It names the response, the pending calls and the step's items: nothing else.
            assert open_index is None
            assert event.pending_call_ids == pending
            assert event.response == p.ResponseRef(id="resp_1", status="in_progress")
            assert event.output_indices == list(range(step_start, len(done)))
            pending = []
            continue
        if isinstance(event, p.ResponseInProgress):  # resume: names the response
            assert open_index is None
            assert event.response == p.ResponseRef(id="resp_1", status="in_progress")
            step_start = len(done)
            continue
        assert open_index is not None and event.output_index == open_index
        item = added[open_index]
        if not isinstance(event, p.OutputItemDone):
            assert event.item_id == item.id  # the item id ...
            if isinstance(item, p.FunctionCall):
                assert event.item_id != item.call_id  # ... never the call id
        if hasattr(event, "content_index"):
            assert event.content_index == 0
        so_far = "".join(deltas[open_index])
        if isinstance(event, p.ContentPartAdded):
            assert event.part == p.OutputText(text="")
        elif isinstance(event, p.OutputTextDelta | p.FunctionCallArgumentsDelta):
            deltas[open_index].append(event.delta)
        elif isinstance(event, p.OutputTextDone):
            assert event.text == so_far
        elif isinstance(event, p.ContentPartDone):
            assert event.part == p.OutputText(text=so_far)
        elif isinstance(event, p.FunctionCallArgumentsDone):
            assert event.arguments == so_far
        elif isinstance(event, p.OutputItemDone):
            assert event.item.id == item.id  # type: ignore[union-attr]
            assert item_text(event.item) == so_far
            done[open_index] = event.item
            if isinstance(event.item, p.FunctionCall):
                pending.append(event.item.call_id)
            open_index = None
        else:  # pragma: no cover
            pytest.fail(f"unexpected event {event!r}")

    # the terminal response's output is exactly the items done, in order ...
    assert terminal.response.output == [done[i] for i in sorted(done)]
    assert sorted(done) == list(range(len(done)))
    # ... and is what the script streamed
    steps = [s for s in script.steps if not isinstance(s, Suspend)]
    expected = [expected_item(s, "completed") for s in steps]
    if script.ending == "incomplete" and script.open is not None:
        expected.append(expected_item(script.open, "incomplete"))
    assert terminal.response.output == expected

    response = terminal.response
    if script.ending == "complete":
        assert terminal.type == "response.completed" and response.status == "completed"
        assert response.completed_at == SCRIPT_COMPLETED_AT
    elif script.ending == "incomplete":
        assert terminal.type == "response.incomplete" and response.status == "incomplete"
        assert response.incomplete_details == p.IncompleteDetails(reason=script.reason)  # type: ignore[arg-type]
    else:
        assert terminal.type == "response.failed" and response.status == "failed"
        assert response.error is not None and response.error.code == script.error_code
        assert response.completed_at is None
    assert response.usage == SCRIPT_USAGE
    # snapshots all share the request's settings
    for event in events:
        if hasattr(event, "response"):
            assert event.response.id == "resp_1"
            if isinstance(event.response, p.Response):
                assert event.response.instructions == "be brief"


@SETTINGS
@given(script=stream_scripts(max_steps=6), first=st.sampled_from([0, 0, 1, 41]))
def test_stream_invariants(script: Script, first: int) -> None:
    stream = new_stream(first)
    events = run_script(stream, script)
    check_invariants(events, script, first)
    assert stream.state is p.BuilderState.DONE
    assert stream.next_sequence_number == first + len(events)
    # every event the builder makes round-trips
    for event in events:
        assert p.decode_server_event(p.encode_json(event)) == event
        assert p.decode_server_event(p.encode_msgpack(event), fmt="msgpack") == event


def test_default_sequence_starts_at_zero() -> None:
    events = new_stream().start()
    assert [e.sequence_number for e in events] == [0, 1]


def test_sequence_continues_across_suspend_and_resume() -> None:
    stream = new_stream()
    events = [*stream.start(), *stream.begin_call("fc_1", "call_1", "lookup")]
    events.append(stream.arguments_delta('{"q": 1}'))
    events += stream.end_call()
    done = stream.suspend(["call_1"])
    assert stream.state is p.BuilderState.SUSPENDED
    resumed = stream.resume()
    events += [done, resumed]
    events += stream.begin_message("msg_2")
    events.append(stream.text_delta("ok"))
    events += stream.end_message()
    events.append(stream.complete(usage=p.Usage(), completed_at=2))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert done.pending_call_ids == ["call_1"]
    assert done.output_indices == [0]
    assert done.response == resumed.response == p.ResponseRef(id="resp_1")
    assert resumed.type == "response.in_progress"
    assert resumed.sequence_number == done.sequence_number + 1
    assert [i.type for i in events[-1].response.output] == ["function_call", "message"]


def test_a_suspension_costs_the_same_at_every_step() -> None:
    """`response.done` and the resumed `response.in_progress` encode to the same bytes at the
    hundredth tool step as at the first, however much output came before (RX-2.2, RX-2.5):
    only their sequence numbers and output indices gain digits."""
    stream = new_stream()
    stream.start()
    arguments = json.dumps({"content": "x" * 2000})
    sizes = []
    for step in range(100):
        stream.begin_call(f"fc_{step:03}", f"call_{step:03}", "write")
        stream.arguments_delta(arguments)
        stream.end_call()
        done = stream.suspend([f"call_{step:03}"])
        resumed = stream.resume()
        assert done.output_indices == [step]
        sizes.append(len(p.encode_json(done)) + len(p.encode_json(resumed)))
    assert max(sizes) - min(sizes) <= 6, sizes  # digits: sequence numbers 1 -> 3, index 1 -> 2
    final = stream.complete(usage=p.Usage(), completed_at=2)
    assert len(p.encode_json(final)) > 100 * 2000  # the terminal event carries everything


def test_failed_drops_the_open_item_and_incomplete_closes_it() -> None:
    stream = new_stream()
    stream.start()
    stream.begin_message("msg_1")
    stream.text_delta("partial")
    failed = stream.fail(error=p.ResponseError(code="server_error", message="boom"), usage=None)
    assert failed.response.output == []
    assert failed.response.usage is None

    stream = new_stream()
    stream.start()
    stream.begin_call("fc_1", "call_1", "f")
    stream.arguments_delta('{"a":')
    events = stream.incomplete(reason="max_output_tokens", usage=p.Usage(), completed_at=3)
    assert [e.type for e in events] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    (call,) = events[-1].response.output
    assert call.status == "incomplete" and call.arguments == '{"a":'


def test_iter_chunks() -> None:
    assert list(p.iter_chunks("", 3)) == [""]
    assert list(p.iter_chunks("abcdefg", 3)) == ["abc", "def", "g"]
    with pytest.raises(p.LocalProtocolError):
        list(p.iter_chunks("abc", 0))


@settings(max_examples=100, deadline=None)
@given(text=texts, size=st.integers(1, 30))
def test_iter_chunks_property(text: str, size: int) -> None:
    chunks = list(p.iter_chunks(text, size))
    assert "".join(chunks) == text
    assert all(len(c) <= size for c in chunks)
    assert all(chunks) or chunks == [""]


# --- misuse ----------------------------------------------------------------------------------

ACTIONS: dict[str, Callable[[p.ResponseStream], Any]] = {
    "start": lambda s: s.start(),
    "begin_message": lambda s: s.begin_message("msg_x"),
    "text_delta": lambda s: s.text_delta("t"),
    "end_message": lambda s: s.end_message(),
    "begin_call": lambda s: s.begin_call("fc_x", "call_x", "f"),
    "arguments_delta": lambda s: s.arguments_delta("{}"),
    "end_call": lambda s: s.end_call(),
    "suspend": lambda s: s.suspend(["call_x"]),
    "resume": lambda s: s.resume(),
    "complete": lambda s: s.complete(usage=p.Usage(), completed_at=1),
    "incomplete": lambda s: s.incomplete(
        reason="max_output_tokens", usage=p.Usage(), completed_at=1
    ),
    "fail": lambda s: s.fail(error=p.ResponseError(code="server_error", message="x"), usage=None),
}

# The legal protocol, written down independently of the builder's own table:
# state -> {action: next state}.
LEGAL: dict[str, dict[str, str]] = {
    "new": {"start": "active"},
    "active": {
        "begin_message": "in_message",
        "begin_call": "in_call",
        "suspend": "suspended",
        "complete": "done",
        "incomplete": "done",
        "fail": "done",
    },
    "in_message": {
        "text_delta": "in_message",
        "end_message": "active",
        "incomplete": "done",
        "fail": "done",
    },
    "in_call": {
        "arguments_delta": "in_call",
        "end_call": "active",
        "incomplete": "done",
        "fail": "done",
    },
    "suspended": {"resume": "active", "incomplete": "done", "fail": "done"},
    "done": {},
}


def assert_refuses_everything(stream: p.ResponseStream) -> None:
    assert stream.state is p.BuilderState.ERROR
    seq = stream.next_sequence_number
    for name, action in ACTIONS.items():
        with pytest.raises(p.LocalProtocolError):
            action(stream)
        assert stream.state is p.BuilderState.ERROR, name
    assert stream.next_sequence_number == seq


MISUSES = [
    ["text_delta"],
    ["begin_message"],
    ["fail"],
    ["complete"],
    ["start", "start"],
    ["start", "text_delta"],
    ["start", "arguments_delta"],
    ["start", "end_message"],
    ["start", "end_call"],
    ["start", "resume"],
    ["start", "begin_message", "arguments_delta"],
    ["start", "begin_message", "begin_call"],
    ["start", "begin_message", "complete"],
    ["start", "begin_message", "suspend"],
    ["start", "begin_call", "text_delta"],
    ["start", "begin_call", "end_message"],
    ["start", "begin_call", "suspend"],
    ["start", "suspend", "begin_message"],
    ["start", "suspend", "complete"],
    ["start", "suspend", "suspend"],
    ["start", "complete", "begin_message"],
    ["start", "complete", "complete"],
    ["start", "complete", "fail"],
    ["start", "complete", "start"],
    ["start", "fail", "incomplete"],
    ["start", "incomplete", "resume"],
]


@pytest.mark.parametrize("actions", MISUSES, ids=" ".join)
def test_misuse_raises_then_refuses_everything(actions: list[str]) -> None:
    stream = new_stream()
    *legal, illegal = actions
    for name in legal:
        ACTIONS[name](stream)
    seq = stream.next_sequence_number
    with pytest.raises(p.LocalProtocolError):
        ACTIONS[illegal](stream)
    assert stream.next_sequence_number == seq  # a refused action emits nothing
    assert_refuses_everything(stream)


@settings(max_examples=300, deadline=None)
@given(actions=st.lists(st.sampled_from(sorted(ACTIONS)), max_size=14))
def test_state_machine_matches_the_protocol(actions: list[str]) -> None:
    """Random action sequences against the reference table: legal actions succeed and emit
    consecutively numbered events; the first illegal one raises and the builder is dead."""
    stream = new_stream()
    state = "new"
    seq = 0
    for name in actions:
        nxt = LEGAL[state].get(name)
        if nxt is None:
            with pytest.raises(p.LocalProtocolError):
                ACTIONS[name](stream)
            assert_refuses_everything(stream)
            return
        out = ACTIONS[name](stream)
        events = out if isinstance(out, list) else [out]
        assert [e.sequence_number for e in events] == list(range(seq, seq + len(events)))
        seq += len(events)
        state = nxt
        assert stream.state.value == state


def test_abort_ends_a_started_response_from_any_state_even_error() -> None:
    """The last resort after a bug: a response that started always gets a terminal event."""
    error = p.ResponseError(code="server_error", message="boom")
    for misuse in (["start", "begin_message", "begin_call"], ["start", "resume"]):
        stream = new_stream()
        with pytest.raises(p.LocalProtocolError):
            for name in misuse:
                ACTIONS[name](stream)
        assert stream.state is p.BuilderState.ERROR
        seq = stream.next_sequence_number
        failed = stream.abort(error=error, usage=None)
        assert failed is not None and failed.sequence_number == seq
        assert failed.response.status == "failed" and failed.response.error == error
        assert stream.state is p.BuilderState.DONE
        assert stream.abort(error=error, usage=None) is None  # ended once
    assert new_stream().abort(error=error, usage=None) is None  # never started: nothing to end


def test_builder_does_not_share_state_with_its_input() -> None:
    base = p.Response(id="resp_1", created_at=1, model="m")
    stream = p.ResponseStream(base)
    stream.start()
    stream.begin_message("msg_1")
    stream.text_delta("x")
    stream.end_message()
    assert base.output == []
    snapshot = stream.snapshot()
    assert len(snapshot.output) == 1 and snapshot.status == "in_progress"
    stream.output.clear()  # a copy
    assert len(stream.output) == 1
    assert attrs.evolve(snapshot, output=[]) == attrs.evolve(base, output=[])


def test_the_builder_refuses_a_delta_after_its_part_is_done_by_the_grammar() -> None:
    """The builder checks each event it builds against `_state.py`'s grammar (the one both
    connection ends follow): a text delta after the message's part is done is refused with
    the grammar's reason, and the builder is dead."""
    stream = new_stream()
    stream.start()
    stream.begin_message("msg_1")
    stream.text_delta("a")
    stream.end_message()
    seq = stream.next_sequence_number
    with pytest.raises(
        p.LocalProtocolError,
        match=r"response\.output_text\.delta: text outside an open content part",
    ):
        stream.text_delta("late")
    assert stream.next_sequence_number == seq
    assert_refuses_everything(stream)


@SETTINGS
@given(script=stream_scripts(max_steps=6))
def test_every_stream_the_builder_builds_is_accepted_by_a_client(script: Script) -> None:
    """What the builder builds follows the grammar the client checks (item order, indices,
    ids), for every script; a suspension is answered as a client would."""
    client = p.ClientConnection()
    client.send(p.ResponseCreate(model="m", input="hi", rollout=True))
    for event in run_script(new_stream(), script):
        client.receive_text(p.encode_json(event))
        if isinstance(event, p.ResponseDone):
            outputs = [p.FunctionCallOutput(call_id=c, output="ok") for c in event.pending_call_ids]
            client.send(p.ResponseAppend(response_id="resp_1", input=outputs))  # type: ignore[arg-type]
    assert client.phase is p.Phase.IDLE and not client.awaiting
