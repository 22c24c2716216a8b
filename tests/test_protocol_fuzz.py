"""Receive-path fuzzing (h11 `tests/test_io.py` style): whatever a peer sends, the decoders
give a decoded event or a `RemoteProtocolError` carrying an OpenAI-shaped error event, never
another exception; and whatever they decode can be encoded again."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rollout import protocol as p

from tests.strategies import (
    check_error_event,
    client_events,
    json_values,
    msgpack_values,
    mutations,
    response_creates,
    server_events,
    sse_error_events,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Decoder = Callable[[Any], Any]
CLIENT_CLASSES = tuple(p.CLIENT_EVENT_TYPES.values())
SERVER_CLASSES = (*p.SERVER_EVENT_TYPES.values(), p.SseErrorEvent)


def _msgpack(data: Any) -> bytes:
    return data if isinstance(data, bytes) else data.encode()


JSON_DECODERS: dict[str, Decoder] = {
    "client": p.decode_client_event,
    "create-body": p.decode_create_body,
    "server": p.decode_server_event,
    "server-sse": lambda d: p.decode_server_event(d, sse=True),
}
MSGPACK_DECODERS: dict[str, Decoder] = {
    "client": lambda d: p.decode_client_event(_msgpack(d), fmt="msgpack"),
    "server": lambda d: p.decode_server_event(_msgpack(d), fmt="msgpack"),
    "server-sse": lambda d: p.decode_server_event(_msgpack(d), fmt="msgpack", sse=True),
}


def check_reencodes(event: Any) -> None:
    """A decoded event encodes again, as UTF-8 JSON and as msgpack, to itself."""
    text = p.encode_json(event)
    text.encode("utf-8")
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in encoded JSON"))
    if isinstance(event, CLIENT_CLASSES):
        assert p.decode_client_event(text) == event
        assert p.decode_client_event(p.encode_msgpack(event), fmt="msgpack") == event
    else:
        sse = isinstance(event, p.SseErrorEvent)
        assert p.decode_server_event(text, sse=sse) == event
        assert p.decode_server_event(p.encode_msgpack(event), fmt="msgpack", sse=sse) == event


def outcome(decoder: Decoder, data: Any) -> Any:
    """Run one decoder: a decoded event (checked) or None after a remote error (checked).
    Any other exception fails the test."""
    try:
        event = decoder(data)
    except p.RemoteProtocolError as exc:
        check_error_event(exc)
        return None
    if isinstance(event, p.InvalidSteer):  # a malformed steer: answered, not an error
        failed = p.steer_failed(event, "invalid_input", event.message)
        assert p.decode_server_event(p.encode_json(failed)) == failed
        return None
    assert isinstance(event, CLIENT_CLASSES + SERVER_CLASSES)
    check_reencodes(event)
    return event


def feed_json(text: str | bytes) -> None:
    for decoder in JSON_DECODERS.values():
        outcome(decoder, text)


def feed_msgpack(data: bytes) -> None:
    for decoder in MSGPACK_DECODERS.values():
        outcome(decoder, data)


# --- garbage ---------------------------------------------------------------------------------


@SETTINGS
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes(data: bytes) -> None:
    feed_json(data)
    feed_msgpack(data)


@SETTINGS
@given(text=st.text(max_size=300))
def test_arbitrary_text(text: str) -> None:
    feed_json(text)
    feed_msgpack(text.encode())


@SETTINGS
@given(value=json_values)
def test_arbitrary_json_values(value: Any) -> None:
    feed_json(json.dumps(value, ensure_ascii=False))
    feed_json(json.dumps(value).encode())
    feed_msgpack(msgpack.packb(value))
    if isinstance(value, dict):
        outcome(p.decode_create_body, value)


#: Field names of every wire event, so that fuzzed objects hit real fields (opaque ones too).
FIELD_NAMES = sorted(
    {a.name for cls in CLIENT_CLASSES + SERVER_CLASSES for a in attrs.fields(cls)} - {"type"}
)
field_keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=6) | st.binary(max_size=4)


@SETTINGS
@given(
    value=msgpack_values,
    fields=st.dictionaries(field_keys, msgpack_values, max_size=4),
    tag=st.sampled_from([*p.CLIENT_EVENT_TYPES, *p.SERVER_EVENT_TYPES]),
)
def test_arbitrary_msgpack_values(value: Any, fields: dict[Any, Any], tag: str) -> None:
    """msgpack carries more than JSON: bytes (as values and keys), extension types, NaN."""
    feed_msgpack(msgpack.packb(value, use_bin_type=True))
    feed_msgpack(msgpack.packb({**fields, "type": tag}, use_bin_type=True))


@SETTINGS
@given(
    fields=st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=4),
    tag=st.sampled_from([*p.CLIENT_EVENT_TYPES, *p.SERVER_EVENT_TYPES]),
)
def test_arbitrary_fields(fields: dict[str, Any], tag: str) -> None:
    """Real field names with arbitrary JSON values."""
    feed_json(json.dumps({**fields, "type": tag}))
    feed_msgpack(msgpack.packb({**fields, "type": tag}))


@SETTINGS
@given(
    key=st.text(st.characters(codec=None, categories=["Cs", "Lu", "So"]), max_size=4),
    value=st.text(st.characters(codec=None, categories=["Cs", "Ll", "So"]), max_size=4),
)
def test_escaped_surrogates(key: str, value: str) -> None:
    """JSON can spell lone surrogates as escapes; nothing decoded or sent back may hold one."""
    for fields in ({key: value}, {"model": value}, {"metadata": {key: value}}):
        message = {"type": "response.create", **fields}
        feed_json(json.dumps(message))  # ensure_ascii: every surrogate as an escape
        body = {k: v for k, v in message.items() if k != "type"}
        outcome(p.decode_create_body, body)


# --- almost-valid input ----------------------------------------------------------------------


@SETTINGS
@given(value=mutations(client_events))
# Found by this test: a steering content part whose type is not a string raised TypeError.
@example(
    value={
        "type": "response.steer",
        "previous_response_id": "0",
        "input": [{"role": "user", "content": [{"type": [], "text": ""}]}],
    }
)
def test_mutated_client_events(value: Any) -> None:
    feed_json(json.dumps(value, ensure_ascii=False))
    feed_msgpack(msgpack.packb(value))


@SETTINGS
@given(value=mutations(response_creates))
def test_mutated_create_bodies(value: Any) -> None:
    if isinstance(value, dict):
        value.pop("type", None)
        outcome(p.decode_create_body, value)
    outcome(p.decode_create_body, json.dumps(value, ensure_ascii=False))


@SETTINGS
@given(value=mutations(server_events | sse_error_events))
def test_mutated_server_events(value: Any) -> None:
    feed_json(json.dumps(value, ensure_ascii=False))
    feed_msgpack(msgpack.packb(value))


@pytest.mark.parametrize(
    "value",
    [
        {"type": "response.create", "input": [{"type": "message"}]},
        {"type": "response.create", "input": [{"role": None, "content": "x"}]},
        {"type": "response.create", "input": [{"role": "user", "content": [None]}]},
        {"type": "response.create", "tools": [{"type": "function"}]},
        {"type": "response.create", "tools": [{"type": "function", "name": "f", "parameters": 1}]},
        {"type": "response.create", "tools": [{"name": "f", "parameters": {"type": [1]}}]},
        {"type": "response.create", "tool_choice": {"type": "function", "name": 1}},
        {"type": "response.create", "metadata": {"k": None}},
        {"type": "response.create", "text": {"format": None, "verbosity": "loud"}},
        {"type": "response.create", "reasoning": []},
        {"type": "response.append", "response_id": "r", "input": [{}]},
        {"type": "response.completed", "sequence_number": 0, "response": {}},
        {"type": "response.output_item.added", "sequence_number": 0, "item": {"type": "x"}},
        {"type": "error", "error": {"message": 1}},
        {"type": "error", "sequence_number": "0", "message": "x"},
    ],
)
def test_hand_picked_near_misses(value: dict[str, Any]) -> None:
    feed_json(json.dumps(value))
    feed_msgpack(msgpack.packb(value))


# --- deep nesting and size -------------------------------------------------------------------

DEPTH = 100_000


def _deep_msgpack(prefix: bytes) -> bytes:
    return prefix + b"\x91" * DEPTH + b"\xc0"


@pytest.mark.parametrize(
    "text",
    [
        "[" * DEPTH,
        "[" * DEPTH + "]" * DEPTH,
        '{"a":' * DEPTH,
        '{"type":"response.create","prompt":' + "[" * DEPTH + "]" * DEPTH + "}",
        '{"type":"response.create","input":[{"role":"user","content":' + "[" * DEPTH,
    ],
    ids=["open-arrays", "arrays", "objects", "inside-create", "inside-item"],
)
def test_deep_nesting_json(text: str) -> None:
    for decoder in JSON_DECODERS.values():
        for data in (text, text.encode()):
            assert outcome(decoder, data) is None


@pytest.mark.parametrize(
    "data",
    [
        _deep_msgpack(b""),
        # {"type": "response.create", "prompt": [[[...]]]}
        _deep_msgpack(
            b"\x82"
            + msgpack.packb("type")
            + msgpack.packb("response.create")
            + msgpack.packb("prompt")
        ),
    ],
    ids=["arrays", "inside-create"],
)
def test_deep_nesting_msgpack(data: bytes) -> None:
    for decoder in MSGPACK_DECODERS.values():
        assert outcome(decoder, data) is None


def test_deep_nesting_parsed_body() -> None:
    """An already-parsed body nested deeper than any parser allows: no crash either way."""
    deep: Any = []
    for _ in range(DEPTH):
        deep = [deep]
    outcome_value = None
    try:
        outcome_value = p.decode_create_body({"model": "m", "prompt": deep})
    except p.RemoteProtocolError as exc:
        check_error_event(exc)
    assert outcome_value is None or isinstance(outcome_value, p.ResponseCreate)


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@settings(max_examples=50, deadline=None)
@given(event=client_events, slack=st.integers(-3, 3))
def test_max_size(fmt: str, event: p.ClientEvent, slack: int) -> None:
    data = p.encode_json(event).encode() if fmt == "json" else p.encode_msgpack(event)
    limit = max(len(data) + slack, 0)
    try:
        decoded = p.decode_client_event(data, fmt=fmt, max_size=limit)  # type: ignore[arg-type]
    except p.RemoteProtocolError as exc:
        assert slack < 0
        assert exc.code == "message_too_large"
        check_error_event(exc)
    else:
        assert slack >= 0
        assert decoded == event


def test_max_size_is_checked_before_parsing() -> None:
    huge = "[" * 10_000_000
    with pytest.raises(p.RemoteProtocolError) as info:
        p.decode_client_event(huge, max_size=1024)
    assert info.value.code == "message_too_large"
    check_error_event(info.value)
