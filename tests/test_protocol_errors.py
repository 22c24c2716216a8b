"""Bad client messages and the exact OpenAI-style error each one gets: `code` and `param`,
pinned, plus the shape of the error event that goes back on the wire."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from rollout import protocol as p

from tests.strategies import check_error_event

CREATE = {"type": "response.create", "model": "m"}


def create(**fields: Any) -> str:
    return json.dumps({**CREATE, **fields})


def with_input(*items: Any) -> str:
    return create(input=list(items))


def function_tool(**fields: Any) -> dict[str, Any]:
    return {"type": "function", "name": "lookup", **fields}


# (id, message, decode keyword arguments, expected code, expected param)
BAD_CLIENT_MESSAGES: list[tuple[str, str | bytes, dict[str, Any], str, str | None]] = [
    # --- not a message at all ---
    ("not-json", "{nope", {}, "invalid_json", None),
    ("empty", "", {}, "invalid_json", None),
    ("invalid-utf8", b'{"type":"response.create","model":"\xff"}', {}, "invalid_json", None),
    ("nan-constant", '{"type":"response.create","temperature":NaN}', {}, "invalid_json", None),
    ("infinity-constant", '{"type":"response.create","top_p":-Infinity}', {}, "invalid_json", None),
    ("number-overflow", '{"type":"response.create","prompt":1e400}', {}, "invalid_json", None),
    (
        "integer-overflow",
        '{"type":"response.create","prompt":' + "9" * 30 + "}",
        {},
        "invalid_json",
        None,
    ),
    ("lone-surrogate", '{"type":"response.create","model":"\\udc00"}', {}, "invalid_json", None),
    ("too-deep", "[" * 100_000, {}, "invalid_json", None),
    ("oversized", create(input="x" * 100), {"max_size": 64}, "message_too_large", None),
    ("msgpack-garbage", b"\xc1", {"fmt": "msgpack"}, "invalid_msgpack", None),
    (
        "msgpack-bytes-value",
        msgpack.packb({**CREATE, "prompt": b"\x00"}, use_bin_type=True),
        {"fmt": "msgpack"},
        "invalid_msgpack",
        None,
    ),
    ("json-array", "[1, 2]", {}, "invalid_type", None),
    ("json-string", '"response.create"', {}, "invalid_type", None),
    # --- the envelope ---
    ("missing-type", json.dumps({"model": "m"}), {}, "missing_required_parameter", "type"),
    ("null-type", json.dumps({"type": None}), {}, "missing_required_parameter", "type"),
    ("unknown-type", json.dumps({"type": "response.cancel"}), {}, "invalid_value", "type"),
    ("type-not-string", json.dumps({"type": 7}), {}, "invalid_type", "type"),
    ("unknown-top-level-key", create(foo=1), {}, "unknown_parameter", "foo"),
    # --- wrong JSON types ---
    ("model-int", create(model=5), {}, "invalid_type", "model"),
    ("store-string", create(store="yes"), {}, "invalid_type", "store"),
    ("temperature-string", create(temperature="1"), {}, "invalid_type", "temperature"),
    (
        "max-output-tokens-float",
        create(max_output_tokens=1.5),
        {},
        "invalid_type",
        "max_output_tokens",
    ),
    (
        "max-output-tokens-1e300",
        create(max_output_tokens=1e300),
        {},
        "invalid_type",
        "max_output_tokens",
    ),
    (
        "max-output-tokens-bool",
        create(max_output_tokens=True),
        {},
        "invalid_type",
        "max_output_tokens",
    ),
    ("input-number", create(input=5), {}, "invalid_type", "input"),
    ("metadata-value-int", create(metadata={"k": 1}), {}, "invalid_type", "metadata.k"),
    ("tool-choice-int", create(tool_choice=1), {}, "invalid_type", "tool_choice"),
    # --- ranges and limits ---
    (
        "negative-max-output-tokens",
        create(max_output_tokens=-1),
        {},
        "integer_below_min_value",
        "max_output_tokens",
    ),
    ("temperature-3", create(temperature=3), {}, "decimal_above_max_value", "temperature"),
    ("top-p-negative", create(top_p=-1), {}, "decimal_below_min_value", "top_p"),
    ("top-logprobs-21", create(top_logprobs=21), {}, "integer_above_max_value", "top_logprobs"),
    (
        "metadata-17-keys",
        create(metadata={f"k{i}": "v" for i in range(17)}),
        {},
        "object_above_max_properties",
        "metadata",
    ),
    (
        "metadata-long-value",
        create(metadata={"k": "v" * 513}),
        {},
        "string_above_max_length",
        "metadata.k",
    ),
    # --- enums ---
    ("tool-choice-maybe", create(tool_choice="maybe"), {}, "invalid_value", "tool_choice"),
    ("truncation-sometimes", create(truncation="sometimes"), {}, "invalid_value", "truncation"),
    (
        "tool-choice-function-without-name",
        create(tool_choice={"type": "function"}),
        {},
        "missing_required_parameter",
        "tool_choice.name",
    ),
    # --- items ---
    ("unknown-item-type", with_input({"type": "bogus"}), {}, "invalid_value", "input[0].type"),
    ("item-not-object", with_input("hi"), {}, "invalid_type", "input[0]"),
    (
        "item-without-type-or-role",
        with_input({"content": "x"}),
        {},
        "missing_required_parameter",
        "input[0].type",
    ),
    (
        "custom-tool-call-without-call-id",
        with_input({"type": "custom_tool_call", "name": "f", "input": "x"}),
        {},
        "missing_required_parameter",
        "input[0].call_id",
    ),
    (
        "shell-call-without-commands",
        with_input({"type": "shell_call", "call_id": "c", "action": {}}),
        {},
        "missing_required_parameter",
        "input[0].action.commands",
    ),
    (
        "hosted-item-with-wrong-kind",
        with_input({"type": "web_search_call", "id": "w", "status": "completed", "action": []}),
        {},
        "invalid_type",
        "input[0].action",
    ),
    (
        "hosted-item-missing-key",
        with_input({"type": "mcp_call", "id": "m", "name": "n", "server_label": "s"}),
        {},
        "missing_required_parameter",
        "input[0].arguments",
    ),
    (
        "apply-patch-create-without-diff",
        with_input(
            {
                "type": "apply_patch_call",
                "call_id": "c",
                "status": "completed",
                "operation": {"type": "create_file", "path": "a"},
            }
        ),
        {},
        "missing_required_parameter",
        "input[0].operation.diff",
    ),
    (
        "function-call-arguments-object",
        with_input({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}),
        {},
        "invalid_type",
        "input[0].arguments",
    ),
    (
        "message-bad-role",
        with_input({"role": "robot", "content": "x"}),
        {},
        "invalid_value",
        "input[0].role",
    ),
    (
        "message-content-int",
        with_input({"role": "user", "content": 5}),
        {},
        "invalid_type",
        "input[0].content",
    ),
    (
        "user-message-output-text",
        with_input({"role": "user", "content": [{"type": "output_text", "text": "x"}]}),
        {},
        "invalid_value",
        "input[0].content[0].type",
    ),
    (
        "assistant-message-input-text",
        with_input({"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}),
        {},
        "invalid_value",
        "input[0].content[0].type",
    ),
    (
        "unknown-key-in-item",
        with_input({"role": "user", "content": "x", "foo": 1}),
        {},
        "unknown_parameter",
        "input[0].foo",
    ),
    (
        "unknown-key-nested-in-item",
        with_input({"role": "user", "content": [{"type": "input_text", "text": "x", "foo": 1}]}),
        {},
        "unknown_parameter",
        "input[0].content[0].foo",
    ),
    (
        "unknown-key-in-second-item",
        with_input({"role": "user", "content": "x"}, {"role": "user", "content": "y", "foo": 1}),
        {},
        "unknown_parameter",
        "input[1].foo",
    ),
    (
        "bad-image-detail",
        with_input({"role": "user", "content": [{"type": "input_image", "detail": "max"}]}),
        {},
        "invalid_value",
        "input[0].content[0].detail",
    ),
    # --- tools ---
    (
        "tool-parameters-string-schema",
        create(tools=[function_tool(parameters={"type": "string"})]),
        {},
        "invalid_function_parameters",
        "tools[0].parameters",
    ),
    (
        "tool-parameters-list",
        create(tools=[function_tool(parameters=[])]),
        {},
        "invalid_type",
        "tools[0].parameters",
    ),
    (
        "tool-name-with-spaces",
        create(tools=[function_tool(name="my tool")]),
        {},
        "invalid_value",
        "tools[0].name",
    ),
    (
        "namespace-member-bad-name",
        create(
            tools=[
                {
                    "type": "namespace",
                    "name": "ns",
                    "description": "d",
                    "tools": [function_tool(name="a b")],
                }
            ]
        ),
        {},
        "invalid_value",
        "tools[0].tools[0].name",
    ),
    (
        "unknown-tool-type",
        create(tools=[{"type": "web_searcher"}]),
        {},
        "invalid_value",
        "tools[0].type",
    ),
    # --- response.append (rollout extension) ---
    (
        "builtin-tool-wrong-setting-type",
        create(tools=[{"type": "web_search", "search_context_size": 3}]),
        {},
        "invalid_type",
        "tools[0].search_context_size",
    ),
    (
        "custom-tool-grammar-without-definition",
        create(
            tools=[{"type": "custom", "name": "c", "format": {"type": "grammar", "syntax": "lark"}}]
        ),
        {},
        "missing_required_parameter",
        "tools[0].format.definition",
    ),
    (
        "client-metadata-not-strings",
        create(client_metadata={"a": 1}),
        {},
        "invalid_type",
        "client_metadata.a",
    ),
    (
        "append-without-response-id",
        json.dumps({"type": "response.append", "input": []}),
        {},
        "missing_required_parameter",
        "response_id",
    ),
    (
        "append-input-not-list",
        json.dumps({"type": "response.append", "response_id": "resp_1", "input": "hi"}),
        {},
        "invalid_type",
        "input",
    ),
    (
        "append-unknown-key",
        json.dumps({"type": "response.append", "response_id": "resp_1", "input": [], "x": 1}),
        {},
        "unknown_parameter",
        "x",
    ),
]


@pytest.mark.parametrize(
    ("message", "kwargs", "code", "param"),
    [pytest.param(*row[1:], id=row[0]) for row in BAD_CLIENT_MESSAGES],
)
def test_bad_client_message(
    message: str | bytes, kwargs: dict[str, Any], code: str, param: str | None
) -> None:
    with pytest.raises(p.RemoteProtocolError) as info:
        p.decode_client_event(message, **kwargs)
    exc = info.value
    assert (exc.code, exc.param) == (code, param)
    assert exc.status == 400
    wire = check_error_event(exc)
    if code not in ("invalid_value", "invalid_function_parameters") and param is not None:
        # the message names the parameter, as OpenAI's do (except for enum and schema errors,
        # which quote the offending value instead)
        assert f"'{param}'" in wire["error"]["message"]


def test_the_table_is_big_enough() -> None:
    assert len(BAD_CLIENT_MESSAGES) >= 20
    assert len({row[0] for row in BAD_CLIENT_MESSAGES}) == len(BAD_CLIENT_MESSAGES)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        pytest.param(
            {"type": "response.create", "model": "m"},
            "unknown_parameter",
            "type",
            id="type-in-http-body",
        ),
        pytest.param([], "invalid_type", None, id="body-not-object"),
        pytest.param(
            {"model": "m", "temperature": 3},
            "decimal_above_max_value",
            "temperature",
            id="temperature-3",
        ),
        pytest.param(
            {"model": "m", "input": [{"role": "user"}]},
            "missing_required_parameter",
            "input[0].content",
            id="message-without-content",
        ),
    ],
)
def test_bad_create_body(body: Any, code: str, param: str | None) -> None:
    for data in (json.dumps(body), json.dumps(body).encode()):
        with pytest.raises(p.RemoteProtocolError) as info:
            p.decode_create_body(data)
        assert (info.value.code, info.value.param) == (code, param)
        check_error_event(info.value)


def test_size_limit_is_inclusive() -> None:
    message = json.dumps(CREATE)
    assert p.decode_client_event(message, max_size=len(message)) == p.ResponseCreate(model="m")
    with pytest.raises(p.RemoteProtocolError) as info:
        p.decode_client_event(message, max_size=len(message) - 1)
    assert info.value.code == "message_too_large"
    with pytest.raises(p.RemoteProtocolError):
        p.decode_server_event(message, max_size=len(message) - 1)
    with pytest.raises(p.RemoteProtocolError):
        p.decode_create_body(message, max_size=len(message) - 1)


def test_paired_surrogate_escapes_are_fine() -> None:
    """Clients that escape non-ASCII (Python's default `ensure_ascii`) send emoji as escaped
    surrogate pairs; only an unpaired surrogate is refused."""
    message = json.dumps({**CREATE, "instructions": "🌍 ok"})
    assert "\\ud83c" in message
    event = p.decode_client_event(message)
    assert isinstance(event, p.ResponseCreate) and event.instructions == "🌍 ok"


def test_remote_error_constructors() -> None:
    exc = p.RemoteProtocolError.invalid("Nope.", code="x", param="y", status=404)
    assert (exc.code, exc.param, exc.status, str(exc)) == ("x", "y", 404, "Nope.")
    assert exc.error_event() == p.ErrorEvent(
        status=404, error=p.ErrorBody(code="x", message="Nope.", param="y")
    )
    assert "404" in repr(exc)
    assert isinstance(exc, p.ProtocolError) and not isinstance(exc, p.LocalProtocolError)
