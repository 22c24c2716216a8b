"""The official openai SDK's pydantic types as the oracle for everything we put on the wire:
every event and every Response the builder produces, and every error event."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from openai.types.responses.responses_server_event import ResponsesServerEvent
from rollout import protocol as p

from tests.strategies import (
    SERVER_EVENT_STRATEGIES,
    Call,
    Script,
    Suspend,
    Text,
    error_bodies,
    ids,
    run_script,
    sdk_responses,
    sse_error_events,
    stream_scripts,
)

STREAM_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
WS_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponsesServerEvent)
SETTINGS = settings(max_examples=60, deadline=None)


def normalized(value: Any) -> Any:
    """JSON data with ints and integral floats compared alike (the SDK types `created_at`
    as a float)."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def sdk_response(response: p.Response) -> SdkResponse:
    """Validate a Response with the SDK and check that it read back every field unchanged."""
    wire = p.encode_json(response)
    model = SdkResponse.model_validate_json(wire)
    dumped = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert normalized(dumped) == normalized(json.loads(wire))
    return model


def sdk_event(event: Any, adapter: pydantic.TypeAdapter[Any]) -> Any:
    """Validate one server event with an SDK union; the SDK must pick the member of the same
    `type` and read back every field unchanged."""
    wire = p.encode_json(event)
    model = adapter.validate_json(wire)
    assert model.type == event.type
    dumped = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert normalized(dumped) == normalized(json.loads(wire))
    return model


def check_with_sdk(event: Any) -> None:
    """Every builder event against both SDK unions (SSE and WebSocket), and its response
    against `Response`. The rollout extension's suspension events (`response.done`, and the
    resumed `response.in_progress` naming its response) are ours: the schema covers them."""
    if isinstance(getattr(event, "response", None), p.ResponseRef):
        return
    sdk_event(event, STREAM_EVENT)
    sdk_event(event, WS_EVENT)
    if hasattr(event, "response"):
        sdk_response(event.response)


# --- the builder's output --------------------------------------------------------------------


@SETTINGS
@given(base=sdk_responses(output=st.just([])), script=stream_scripts())
def test_builder_events_validate_against_sdk(base: p.Response, script: Script) -> None:
    events = run_script(p.ResponseStream(base), script)
    for event in events:
        check_with_sdk(event)
    terminal = events[-1]
    assert terminal.type in p.TERMINAL_EVENT_TYPES
    model = sdk_response(terminal.response)
    assert (
        model.status
        == {
            "complete": "completed",
            "incomplete": "incomplete",
            "failed": "failed",
        }[script.ending]
    )
    if script.ending == "incomplete":
        assert model.incomplete_details is not None
        assert model.incomplete_details.reason == script.reason
    if script.ending == "failed":
        assert model.error is not None and model.error.code == script.error_code
    # the SDK's own convenience accessor agrees with our text
    texts = [
        part.text
        for item in terminal.response.output
        if isinstance(item, p.Message)
        for part in item.content
        if isinstance(part, p.OutputText)
    ]
    assert model.output_text == "".join(texts)


def _call(i: int, *deltas: str) -> Call:
    return Call(item_id=f"fc_{i}", call_id=f"call_{i}", name="lookup", deltas=list(deltas))


def _text(i: int, *deltas: str) -> Text:
    return Text(item_id=f"msg_{i}", deltas=list(deltas))


# Named scripts, so that each shape is checked whatever hypothesis draws.
SCRIPTS = {
    "empty": Script(steps=[], ending="complete"),
    "text": Script(steps=[_text(0, "Hello", ", ", "world")], ending="complete"),
    "empty-text": Script(steps=[_text(0, "")], ending="complete"),
    "one-call": Script(steps=[_call(0, '{"q":', ' "x"}')], ending="complete"),
    "several-calls": Script(
        steps=[_call(0, "{}"), _call(1, '{"a": 1}'), _call(2, '{"b": [1, 2]}')], ending="complete"
    ),
    "mix-with-suspensions": Script(
        steps=[_text(0, "Let me look."), _call(1, "{}"), Suspend(), _text(2, "Found: ", "✓")],
        ending="complete",
    ),
    "incomplete-mid-text": Script(
        steps=[_text(0, "a")], ending="incomplete", open=_text(1, "cut sh")
    ),
    "incomplete-mid-call": Script(steps=[], ending="incomplete", open=_call(0, '{"a":')),
    "incomplete-between-items": Script(
        steps=[_call(0, "{}")], ending="incomplete", reason="content_filter"
    ),
    "failed-mid-call": Script(steps=[_text(0, "x")], ending="failed", open=_call(1, "{")),
    "failed-after-suspension": Script(
        steps=[_call(0, "{}"), Suspend()], ending="failed", error_code="rate_limit_exceeded"
    ),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_named_scripts_validate_against_sdk(name: str) -> None:
    script = SCRIPTS[name]
    base = p.Response(
        id="resp_1",
        created_at=1,
        model="m",
        tools=[p.FunctionTool(name="lookup", parameters={"type": "object", "properties": {}})],
        max_output_tokens=100,
        metadata={"run": name},
    )
    events = run_script(p.ResponseStream(base), script)
    for event in events:
        check_with_sdk(event)
    assert (
        events[-1].response.status
        == {
            "complete": "completed",
            "incomplete": "incomplete",
            "failed": "failed",
        }[script.ending]
    )


@pytest.mark.parametrize(
    "deltas",
    [[""], ["héllo", " wörld 🌍"], ["日本", "語", ""], ["\u0000\u2028", "\U0010ffff"]],
)
def test_unicode_and_empty_text_validate(deltas: list[str]) -> None:
    stream = p.ResponseStream(p.Response(id="resp_1", created_at=0, model="m"))
    events = [*stream.start(), *stream.begin_message("msg_1")]
    events += [stream.text_delta(d) for d in deltas]
    events += stream.end_message()
    events.append(stream.complete(usage=p.Usage(), completed_at=1))
    for event in events:
        check_with_sdk(event)
    assert SdkResponse.model_validate(p.to_wire(events[-1].response)).output_text == "".join(deltas)


@SETTINGS
@given(response=sdk_responses())
def test_sdk_valid_responses_validate(response: p.Response) -> None:
    """Responses with every kind of output item we emit (messages with text and refusals,
    function calls, reasoning), namespace tools, metadata, sampling settings."""
    sdk_response(response)


def test_response_done_is_not_in_the_sdk_union() -> None:
    """`response.done` is the rollout extension; if the SDK ever grows a `response.done`, the
    skip in `check_with_sdk` must be revisited."""
    event = p.ResponseDone(
        sequence_number=0,
        response=p.ResponseRef(id="resp_1"),
        pending_call_ids=["call_1"],
        output_indices=[0],
    )
    for adapter in (STREAM_EVENT, WS_EVENT):
        with pytest.raises(pydantic.ValidationError):
            adapter.validate_json(p.encode_json(event))


def test_a_resumed_rollout_is_read_by_the_sdk_connection() -> None:
    """A rollout's resumed `response.in_progress` names its response instead of carrying it
    (RX-2.3): the SDK's strict type refuses it (the schema checks it instead, `check_with_sdk`
    skips it), while the SDK's WebSocket connection, which parses every event leniently
    (`ResponsesConnection.parse_event`: `construct_type_unchecked`), reads its type, sequence
    number and response id."""
    from openai._models import construct_type_unchecked

    stream = p.ResponseStream(p.Response(id="resp_1", created_at=0, model="m"))
    stream.start()
    stream.begin_call("fc_1", "call_1", "lookup")
    stream.end_call()
    stream.suspend(["call_1"])
    wire = p.encode_json(stream.resume())
    with pytest.raises(pydantic.ValidationError):
        WS_EVENT.validate_json(wire)
    event: Any = construct_type_unchecked(value=json.loads(wire), type_=ResponsesServerEvent)
    assert (event.type, event.sequence_number) == ("response.in_progress", 6)
    assert (event.response.id, event.response.status) == ("resp_1", "in_progress")


# --- errors ----------------------------------------------------------------------------------


@SETTINGS
@given(
    message=st.text(min_size=1),
    code=st.none() | ids,
    param=st.none() | st.text(),
    status=st.sampled_from([400, 404, 413, 429, 500]),
)
def test_remote_error_event_validates_against_ws_union(
    message: str, code: str | None, param: str | None, status: int
) -> None:
    exc = p.RemoteProtocolError.invalid(message, code=code, param=param, status=status)
    event = exc.error_event()
    model = sdk_event(event, WS_EVENT)
    assert type(model).__name__ == "ResponseWsError"
    assert (model.status, model.error.message, model.error.code, model.error.param) == (
        status,
        message,
        code,
        param,
    )
    assert model.error.type == "invalid_request_error"


@SETTINGS
@given(event=SERVER_EVENT_STRATEGIES["error"], body=error_bodies)
def test_ws_error_events_validate(event: p.ErrorEvent, body: p.ErrorBody) -> None:
    sdk_event(event, WS_EVENT)
    sdk_event(p.ErrorEvent(status=400, error=body), WS_EVENT)


@SETTINGS
@given(event=sse_error_events)
def test_sse_error_event_validates_against_stream_union(event: p.SseErrorEvent) -> None:
    model = sdk_event(event, STREAM_EVENT)
    assert type(model).__name__ == "ResponseErrorEvent"
