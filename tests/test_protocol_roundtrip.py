"""Round-trip properties for every wire type, through JSON and msgpack:
`decode(encode(x)) == x` (cattrs `tests/test_preconf.py` style)."""

from __future__ import annotations

import json
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.protocol._codec import _DELTA_FIELDS, _encode_delta, _encode_generic, encode_json
from rollout.protocol._items import CONTENT_PART_TYPES, ITEM_TYPES
from rollout.protocol._response import OMIT_IF_NONE
from rollout.protocol._shapes import BUILTIN_TOOL_SHAPES, OPAQUE_ITEM_SHAPES
from rollout.protocol._tools import TOOL_TYPES

from tests.strategies import (
    CLIENT_EVENT_STRATEGIES,
    CONTENT_PART_STRATEGIES,
    ITEM_STRATEGIES,
    SERVER_EVENT_STRATEGIES,
    TOOL_STRATEGIES,
    function_call_outputs,
    ids,
    input_parts,
    opt,
    output_parts,
    responses,
    sse_error_events,
    statuses,
    summary_texts,
    tool_choices,
    usages,
)

FORMATS = ["json", "msgpack"]
SETTINGS = settings(max_examples=40, deadline=None)


def encode(obj: Any, fmt: str) -> str | bytes:
    return p.encode_json(obj) if fmt == "json" else p.encode_msgpack(obj)


def load(data: str | bytes, fmt: str) -> Any:
    return json.loads(data) if fmt == "json" else msgpack.unpackb(data)


def test_strategies_cover_every_wire_type() -> None:
    assert set(CLIENT_EVENT_STRATEGIES) == set(p.CLIENT_EVENT_TYPES)
    assert set(SERVER_EVENT_STRATEGIES) == set(p.SERVER_EVENT_TYPES)
    assert set(ITEM_STRATEGIES) == set(ITEM_TYPES)
    assert set(CONTENT_PART_STRATEGIES) == set(CONTENT_PART_TYPES)
    assert set(TOOL_STRATEGIES) == set(TOOL_TYPES)


# --- events ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tag", sorted(CLIENT_EVENT_STRATEGIES))
@SETTINGS
@given(data=st.data())
def test_client_event_roundtrip(tag: str, fmt: str, data: st.DataObject) -> None:
    event = data.draw(CLIENT_EVENT_STRATEGIES[tag])
    assert event.type == tag
    wire = encode(event, fmt)
    assert p.decode_client_event(wire, fmt=fmt) == event  # type: ignore[arg-type]
    assert p.from_wire(p.to_wire(event), p.ClientEvent) == event  # type: ignore[arg-type]


@SETTINGS
@given(event=CLIENT_EVENT_STRATEGIES["response.create"])
def test_create_body_roundtrip(event: p.ResponseCreate) -> None:
    """The HTTP body is `response.create` without `type`."""
    body = p.to_wire(event)
    del body["type"]
    assert p.decode_create_body(json.dumps(body, ensure_ascii=False)) == event
    assert p.decode_create_body(body) == event


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tag", sorted(SERVER_EVENT_STRATEGIES))
@SETTINGS
@given(data=st.data())
def test_server_event_roundtrip(tag: str, fmt: str, data: st.DataObject) -> None:
    event = data.draw(SERVER_EVENT_STRATEGIES[tag])
    assert event.type == tag
    wire = encode(event, fmt)
    assert p.decode_server_event(wire, fmt=fmt) == event  # type: ignore[arg-type]
    if tag != "error":
        assert p.decode_server_event(wire, fmt=fmt, sse=True) == event  # type: ignore[arg-type]
    # Server events keep explicit nulls: every field is on the wire, but `stream_id`, which
    # is there only on a named lane (absent on the default lane, never null).
    fields = {a.name for a in attrs.fields(type(event))}
    assert set(load(wire, fmt)) == fields - ({"stream_id"} if event.stream_id is None else set())


@pytest.mark.parametrize(
    "tag",
    [
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
    ],
)
@SETTINGS
@given(data=st.data())
def test_delta_events_encode_as_the_generic_path_does(tag: str, data: st.DataObject) -> None:
    """The delta events are written straight from their fields (`_codec._encode_delta`): the
    same text as the generic encoder's, for any delta text (every code point, lone surrogates
    included), on the default lane or with the lane added by the connection."""
    event = data.draw(SERVER_EVENT_STRATEGIES[tag])
    delta = data.draw(st.text(alphabet=st.characters(blacklist_categories=()), max_size=40))
    event = attrs.evolve(event, delta=delta)
    lane = data.draw(st.none() | st.text(max_size=12))
    extra = None if lane is None else {"stream_id": lane}
    assert encode_json(event, extra=extra) == _encode_generic(event, extra)
    if event.stream_id is None and not getattr(event, "logprobs", None):
        assert _encode_delta(event, _DELTA_FIELDS[type(event)], extra) is not None  # fast


@pytest.mark.parametrize("fmt", FORMATS)
@SETTINGS
@given(event=sse_error_events)
def test_sse_error_roundtrip(fmt: str, event: p.SseErrorEvent) -> None:
    wire = encode(event, fmt)
    assert p.decode_server_event(wire, fmt=fmt, sse=True) == event  # type: ignore[arg-type]
    assert set(load(wire, fmt)) == {"type", "sequence_number", "code", "message", "param"}


def test_sse_and_ws_errors_decode_by_transport() -> None:
    """The nested WebSocket error and the flat SSE error share the tag `error`."""
    ws = p.ErrorEvent(status=400, error=p.ErrorBody(code="c", message="m", param="x"))
    sse = p.SseErrorEvent(sequence_number=3, code="c", message="m", param="x")
    assert p.decode_server_event(p.encode_json(ws)) == ws
    assert p.decode_server_event(p.encode_json(sse), sse=True) == sse
    with pytest.raises(p.RemoteProtocolError):
        p.decode_server_event(p.encode_json(sse))
    with pytest.raises(p.RemoteProtocolError):
        p.decode_server_event(p.encode_json(ws), sse=True)


# --- items, parts, tools, responses ----------------------------------------------------------


def roundtrip(value: Any, cls: Any) -> None:
    wire = p.to_wire(value)
    assert p.from_wire(wire, cls) == value
    assert p.from_wire(json.loads(p.encode_json(value)), cls) == value
    assert p.from_wire(msgpack.unpackb(p.encode_msgpack(value)), cls) == value


# Fields holding opaque JSON, carried as given (nulls included).
OPAQUE_FIELDS = frozenset(
    {
        "parameters",
        "output_schema",
        "annotations",
        "logprobs",
        "caller",
        "environment",
        "outcome",
        "action",
        "actions",
        "pending_safety_checks",
        "acknowledged_safety_checks",
        "tools",
    }
)


def assert_no_nulls(wire: Any) -> None:
    """Typed items, parts and tools leave absent optionals off the wire (opaque items and
    built-in tools carry their keys exactly as given: not checked)."""
    if isinstance(wire, dict):
        if wire.get("type") in OPAQUE_ITEM_SHAPES or wire.get("type") in BUILTIN_TOOL_SHAPES:
            return
        for key, value in wire.items():
            # A function tool's description, parameters and strict are always present.
            present = wire.get("type") == "function" and key in (
                "description",
                "parameters",
                "strict",
            )
            assert value is not None or present, key
            if key not in OPAQUE_FIELDS:
                assert_no_nulls(value)
    elif isinstance(wire, list):
        for value in wire:
            assert_no_nulls(value)


@pytest.mark.parametrize("tag", sorted(ITEM_STRATEGIES))
@SETTINGS
@given(data=st.data())
def test_item_roundtrip(tag: str, data: st.DataObject) -> None:
    item = data.draw(ITEM_STRATEGIES[tag])
    assert item.type == tag
    roundtrip(item, p.Item)
    roundtrip(item, type(item))
    assert_no_nulls(p.to_wire(item))


@pytest.mark.parametrize("role", ["user", "system", "developer", "assistant"])
@pytest.mark.parametrize("form", ["string", "list"])
@SETTINGS
@given(data=st.data())
def test_message_roundtrip_each_role(role: str, form: str, data: st.DataObject) -> None:
    parts = output_parts if role == "assistant" else input_parts
    content = st.text(max_size=10) if form == "string" else st.lists(parts, max_size=3)
    message = p.Message(
        role=role,  # type: ignore[arg-type]
        content=data.draw(content),
        id=data.draw(opt(ids)),
        status=data.draw(opt(statuses)),
    )
    roundtrip(message, p.Item)
    roundtrip(message, p.Message)


@pytest.mark.parametrize("form", ["string", "list"])
@SETTINGS
@given(data=st.data())
def test_function_call_output_roundtrip(form: str, data: st.DataObject) -> None:
    kind = str if form == "string" else list
    item = data.draw(function_call_outputs.filter(lambda i: isinstance(i.output, kind)))
    roundtrip(item, p.Item)


def test_message_short_form() -> None:
    """`{"role", "content"}` without `type` is a message on input."""
    item = p.from_wire({"role": "user", "content": "hi"}, p.Item)
    assert item == p.Message(role="user", content="hi")
    assert p.to_wire(item) == {"type": "message", "role": "user", "content": "hi"}


@pytest.mark.parametrize("tag", sorted(CONTENT_PART_STRATEGIES))
@SETTINGS
@given(data=st.data())
def test_content_part_roundtrip(tag: str, data: st.DataObject) -> None:
    part = data.draw(CONTENT_PART_STRATEGIES[tag])
    roundtrip(part, p.ContentPart)
    assert_no_nulls(p.to_wire(part))


@SETTINGS
@given(part=summary_texts)
def test_summary_text_roundtrip(part: p.SummaryText) -> None:
    roundtrip(part, p.SummaryText)


@pytest.mark.parametrize("tag", sorted(TOOL_STRATEGIES))
@SETTINGS
@given(data=st.data())
def test_tool_roundtrip(tag: str, data: st.DataObject) -> None:
    tool = data.draw(TOOL_STRATEGIES[tag])
    roundtrip(tool, p.Tool)
    assert_no_nulls(p.to_wire(tool))


@SETTINGS
@given(choice=tool_choices)
def test_tool_choice_roundtrip(choice: p.ToolChoice) -> None:
    roundtrip(choice, p.ToolChoice)


@SETTINGS
@given(response=responses)
def test_response_roundtrip(response: p.Response) -> None:
    roundtrip(response, p.Response)
    # The Response object keeps explicit nulls: every field is present, except rollout's
    # additions, which appear only when set.
    omitted = {
        a.name
        for a in attrs.fields(p.Response)
        if a.metadata.get(OMIT_IF_NONE) and getattr(response, a.name) is None
    }
    assert set(p.to_wire(response)) == {a.name for a in attrs.fields(p.Response)} - omitted


@SETTINGS
@given(usage=usages, other=usages)
def test_usage_roundtrip_and_sum(usage: p.Usage, other: p.Usage) -> None:
    roundtrip(usage, p.Usage)
    total = usage + other
    assert total.input_tokens == usage.input_tokens + other.input_tokens
    assert total.total_tokens == usage.total_tokens + other.total_tokens
    assert (
        total.input_tokens_details.cached_tokens
        == usage.input_tokens_details.cached_tokens + other.input_tokens_details.cached_tokens
    )
