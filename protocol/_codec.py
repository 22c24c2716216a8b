"""The codec: wire messages as bytes in and typed values out, typed values in and bytes out,
for JSON and msgpack, with the exact OpenAI error for anything a peer gets wrong.

It is long because it holds every check a message meets outside its fields: the bytes (size,
UTF-8, JSON or msgpack syntax, numbers and strings we could not send on), the message (an
object with a known `type`), a create's lane, and `response.steer`, whose input is checked by
its own rules and answered with an event rather than an error; and the fast path that writes
the delta events, most of what a stream sends. How each wire type's fields are read and written
is `_converter.py`'s table of hooks.

Decoding is strict where a peer feeds us (client events, request bodies): unknown keys,
wrong JSON types, bad enum values and out-of-range numbers are refused with the exact OpenAI
error `code` and a `param` path such as `input[2].content[0].type`. Everything a peer can send
ends as a decoded value or a `RemoteProtocolError`, never another exception, and whatever is
decoded can be encoded again as UTF-8 JSON and as msgpack (no lone surrogates, non-finite
numbers, integers beyond 64 bits, bytes or extension types, even in opaque fields).

Decoding server events (what a client of some other server receives) is lenient about unknown
keys, so the conformance harness and the benchmark can talk to servers that add fields.
"""

from __future__ import annotations

import json
import math
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import attrs
import cattrs
import msgpack

from ._converter import make_converter, structure
from ._errors import RemoteProtocolError
from ._events import (
    CLIENT_EVENT_TYPES,
    MAX_INPUT_ITEMS,
    SERVER_EVENT_TYPES,
    ClientEvent,
    CustomToolCallInputDelta,
    FunctionCallArgumentsDelta,
    OutputTextDelta,
    ResponseCreate,
    ServerEvent,
    SseErrorEvent,
)
from ._items import Item, Message
from ._lanes import valid_stream_id
from ._steer import InvalidSteer, ResponseSteer
from ._validate import MAX_QUOTED_CHARS, clip, describe

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "decode_client_event",
    "decode_create_body",
    "decode_server_event",
    "encode_json",
    "encode_msgpack",
    "from_wire",
    "make_converter",
    "to_wire",
]

T = TypeVar("T")

# The largest client message the decoder accepts, in bytes. Agents send whole histories in
# stateless mode (a 200k-token context is ~1 MB of text, more with tool outputs and JSON
# escaping), so the default is generous; servers can lower it per deployment.
DEFAULT_MAX_MESSAGE_SIZE = 64 * 1024 * 1024

# Integers on the wire are 64-bit (what msgpack and most JSON peers carry).
_MIN_INT, _MAX_INT = -(2**63), 2**64 - 1

_STRICT = make_converter(strict=True)
_LENIENT = make_converter(strict=False)


# --- bytes <-> values ------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _int64(text: str) -> int:
    """`parse_int` for peer JSON: integers we could not send on as msgpack are refused."""
    value = int(text)
    if not _MIN_INT <= value <= _MAX_INT:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ValueError(f"the integer {shown} is out of range")
    return value


def _finite_float(text: str) -> float:
    """`parse_float` for peer JSON: a literal too large for a double (`1e400`) would become
    `inf`, which we could not encode as JSON again."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


# A JSON escape of a UTF-16 surrogate (`"\ud800"`). Python decodes a lone one to a `str` that
# cannot be encoded as UTF-8, which would crash whoever sends or tokenizes it later, so a
# message containing such an escape is walked and refused if one is unpaired.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _check_plain(value: Any, *, surrogates: bool) -> None:
    """Refuse anything but plain JSON data: msgpack can also carry bytes, extension types,
    non-string map keys and non-finite floats, which would pass opaque (`Any`) fields and then
    fail to encode. With `surrogates`, also refuse strings holding a lone surrogate."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if surrogates and _SURROGATE.search(node):
                raise ValueError("a string contains an unpaired UTF-16 surrogate")
        elif isinstance(node, dict):
            for key in node:
                if not isinstance(key, str):
                    raise ValueError(f"map keys must be strings, not {describe(key)}")
            stack.extend(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise ValueError(f"{node} is not a valid JSON number")
        elif node is not None and not isinstance(node, int):
            raise ValueError(f"{describe(node)} value has no JSON equivalent")


def _size(data: str | bytes, max_size: int) -> int:
    """The size of a message in bytes (UTF-8 for text), computed only when it could matter."""
    if isinstance(data, str) and len(data) * 4 > max_size:
        return len(data.encode("utf-8", "surrogatepass"))
    return len(data)


def _load(data: str | bytes, *, max_size: int, fmt: Literal["json", "msgpack"]) -> Any:
    size = _size(data, max_size)
    if size > max_size:
        raise RemoteProtocolError.invalid(
            f"The message is {size} bytes, larger than the limit of {max_size} bytes.",
            code="message_too_large",
        )
    try:
        if fmt == "json":
            # UTF-8 only (RFC 8259), strictly: `json.loads(bytes)` would let encoded
            # surrogates through ("surrogatepass").
            text = data.decode("utf-8") if isinstance(data, bytes) else data
            value = json.loads(
                text,
                parse_constant=_reject_constant,
                parse_float=_finite_float,
                parse_int=_int64,
            )
            if _SURROGATE_ESCAPE.search(text):
                _check_plain(value, surrogates=True)
            return value
        if isinstance(data, str):
            data = data.encode()
        value = msgpack.unpackb(data, raw=False, strict_map_key=True)
        _check_plain(value, surrogates=False)
        return value
    except RecursionError:
        raise RemoteProtocolError.invalid(
            "The message is nested too deeply.", code=f"invalid_{fmt}"
        ) from None
    except Exception as exc:
        what = "JSON" if fmt == "json" else "msgpack"
        reason = str(exc) or type(exc).__name__
        raise RemoteProtocolError.invalid(
            f"We could not parse the {what} body of your message: {reason}",
            code=f"invalid_{fmt}",
        ) from None


def _as_event(value: Any, table: dict[str, type[Any]], conv: cattrs.Converter) -> Any:
    if not isinstance(value, dict):
        raise RemoteProtocolError.invalid(
            f"Invalid type for message: expected a JSON object, but got {describe(value)}.",
            code="invalid_type",
        )
    tag = value.get("type")
    if tag is None:
        raise RemoteProtocolError.invalid(
            "Missing required parameter: 'type'.", code="missing_required_parameter", param="type"
        )
    if not isinstance(tag, str):
        raise RemoteProtocolError.invalid(
            f"Invalid type for 'type': expected a string, but got {describe(tag)} instead.",
            code="invalid_type",
            param="type",
        )
    cls = table.get(tag)
    if cls is None:
        supported = ", ".join(repr(t) for t in table)
        raise RemoteProtocolError.invalid(
            f"Invalid value: {clip(tag)}. Supported values are: {supported}.",
            code="invalid_value",
            param="type",
        )
    return structure(conv, value, cls)


def decode_client_event(
    data: str | bytes,
    *,
    max_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    fmt: Literal["json", "msgpack"] = "json",
) -> ClientEvent | InvalidSteer:
    """Decode one client message. Raises `RemoteProtocolError` (with the error to send back)
    for anything malformed, oversized or unknown; a create that names a valid lane gets the
    error on its lane (its `stream_id` echoed). A `response.steer` that fails its checks is
    not an error but an `InvalidSteer` (answered with `response.steer.failed`)."""
    value = _load(data, max_size=max_size, fmt=fmt)
    if isinstance(value, dict) and value.get("type") == "response.steer":
        return _steer_event(value)
    try:
        return typing.cast(ClientEvent, _as_event(value, CLIENT_EVENT_TYPES, _STRICT))
    except RemoteProtocolError as exc:
        if isinstance(value, dict) and value.get("type") == "response.create":
            lane = value.get("stream_id")
            exc.stream_id = lane if valid_stream_id(lane) else None
        raise


# What `response.steer` may carry (the SDK's `ResponseSteerEvent`): these three fields; in its
# input, user messages with these keys (`id` and `status` as the SDK's message type allows)
# and content parts of these types. The SDK's input type also admits `function_call_output`,
# which its documentation says steering does not support: refused (spec/PROTOCOL.md ST-1.2).
_STEER_KEYS = frozenset({"type", "previous_response_id", "input"})
_STEER_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
_STEER_PART_TYPES = frozenset({"input_text", "input_image", "input_file"})


def _steer_event(value: dict[str, Any]) -> ResponseSteer | InvalidSteer:
    target = value.get("previous_response_id")
    raw = value.get("input")
    problem = _steer_problem(value, target, raw)
    if problem is not None:
        return InvalidSteer(
            previous_response_id=target if isinstance(target, str) else "",
            input=raw if raw is not None else "",
            message=problem,
        )
    assert isinstance(target, str)
    return ResponseSteer(previous_response_id=target, input=raw)


def _steer_problem(value: dict[str, Any], target: Any, raw: Any) -> str | None:
    """Why a `response.steer` message is invalid, or None."""
    extra = sorted(set(value) - _STEER_KEYS)
    if extra:
        return (
            f"Unknown parameter: '{extra[0][:MAX_QUOTED_CHARS]}'. response.steer takes only type, "
            "previous_response_id and input (the target response fixes the lane)."
        )
    if not isinstance(target, str) or not target:
        return (
            "Invalid 'previous_response_id': expected the id of the response to steer, got "
            f"{describe(target)}."
        )
    if isinstance(raw, str):
        return None
    if not isinstance(raw, list) or not raw:
        return (
            "Invalid 'input': expected a string or a non-empty array of user messages, got "
            f"{describe(raw) if raw != [] else 'an empty array'}."
        )
    if len(raw) > MAX_INPUT_ITEMS:
        return (
            f"Invalid 'input': array too long. Expected an array with maximum length "
            f"{MAX_INPUT_ITEMS}, but got an array with length {len(raw)} instead."
        )
    for i, item in enumerate(raw):
        problem = _steer_message_problem(item, f"input[{i}]")
        if problem is not None:
            return problem
    return None


def _steer_message_problem(item: Any, where: str) -> str | None:
    if not isinstance(item, dict):
        return f"Invalid '{where}': expected a user message object, got {describe(item)}."
    kind = item.get("type", "message")
    if kind != "message":
        return (
            f"Invalid '{where}.type': {clip(kind)}. Steering accepts only user messages "
            "(no tool outputs or other items)."
        )
    if item.get("role") != "user":
        return (
            f"Invalid '{where}.role': {clip(item.get('role'))}. Steering accepts only "
            "messages with the user role."
        )
    extra = sorted(set(item) - _STEER_MESSAGE_KEYS)
    if extra:
        return (
            f"Unknown parameter: '{where}.{extra[0][:MAX_QUOTED_CHARS]}'. A steering message "
            "takes type, role and content."
        )
    content = item.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            ptype = part.get("type") if isinstance(part, dict) else None
            if not isinstance(ptype, str) or ptype not in _STEER_PART_TYPES:
                return (
                    f"Invalid '{where}.content[{j}]': a steering message's content parts are "
                    "input_text, input_image or input_file."
                )
    try:
        structure(_STRICT, item, Item)
    except RemoteProtocolError as exc:
        return f"Invalid '{where}': {exc.body.message}"
    return None


def steer_items(raw: Any) -> list[Item]:
    """The items of a checked steering input (`ResponseSteer.input`): a string is one user
    message. Raises `RemoteProtocolError` for input that fails the checks."""
    if isinstance(raw, str):
        return [Message(role="user", content=raw)]
    if not isinstance(raw, list):
        raise RemoteProtocolError.invalid(
            "Invalid 'input': expected a string or a non-empty array of user messages.",
            code="invalid_input",
            param="input",
        )
    return [typing.cast(Item, structure(_STRICT, item, Item)) for item in raw]


def decode_create_body(
    data: str | bytes | dict[str, Any],
    *,
    max_size: int = DEFAULT_MAX_MESSAGE_SIZE,
) -> ResponseCreate:
    """Decode the JSON body of `POST /v1/responses` (a `response.create` without `type`).
    An already-parsed body gets the same checks as text, except the size limit."""
    if isinstance(data, dict):
        try:
            _check_plain(data, surrogates=True)
        except ValueError as exc:
            raise RemoteProtocolError.invalid(
                f"We could not parse the JSON body of your message: {exc}", code="invalid_json"
            ) from None
        value: Any = data
    else:
        value = _load(data, max_size=max_size, fmt="json")
    if not isinstance(value, dict):
        raise RemoteProtocolError.invalid(
            f"Invalid type for body: expected a JSON object, but got {describe(value)}.",
            code="invalid_type",
        )
    if "type" in value:
        raise RemoteProtocolError.invalid(
            "Unknown parameter: 'type'.", code="unknown_parameter", param="type"
        )
    return typing.cast(ResponseCreate, structure(_STRICT, value, ResponseCreate))


def decode_server_event(
    data: str | bytes,
    *,
    max_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    fmt: Literal["json", "msgpack"] = "json",
    sse: bool = False,
) -> ServerEvent | SseErrorEvent:
    """Decode one server event, leniently (unknown keys ignored). With `sse=True` the `error`
    type is the flat SSE shape instead of the nested WebSocket one."""
    table: dict[str, type[Any]] = SERVER_EVENT_TYPES
    if sse:
        table = {**SERVER_EVENT_TYPES, "error": SseErrorEvent}
    return typing.cast(
        ServerEvent | SseErrorEvent,
        _as_event(_load(data, max_size=max_size, fmt=fmt), table, _LENIENT),
    )


def from_wire(value: Any, cls: type[T] | Any, *, strict: bool = True) -> T:
    """Structure an already-parsed JSON value as `cls`, raising `RemoteProtocolError`."""
    return typing.cast(T, structure(_STRICT if strict else _LENIENT, value, cls))


def to_wire(obj: Any) -> Any:
    """Unstructure a wire value to plain JSON-able data."""
    return _STRICT.unstructure(obj)


def encode_json(obj: Any, *, extra: Mapping[str, Any] | None = None) -> str:
    """`obj` as compact JSON; `extra`: keys added to the object (a server event's lane)."""
    fields = _DELTA_FIELDS.get(type(obj))
    if fields is not None:
        text = _encode_delta(obj, fields, extra)
        if text is not None:
            return text
    return _encode_generic(obj, extra)


def _encode_generic(obj: Any, extra: Mapping[str, Any] | None) -> str:
    wire = _STRICT.unstructure(obj)
    if extra:
        wire.update(extra)
    return json.dumps(wire, ensure_ascii=False, separators=(",", ":"))


def _delta_fields(cls: type[Any]) -> tuple[tuple[str, bool], ...]:
    """A delta event's fields between its `type` and its `logprobs` and `stream_id`, in
    order, each with whether it is an int (else a str)."""
    skip = ("type", "logprobs", "stream_id")
    return tuple((f.name, f.type in (int, "int")) for f in attrs.fields(cls) if f.name not in skip)


# The delta events, most of what a stream sends: written straight from their fields, in the
# order and spelling the generic path writes them (`tests/test_protocol_roundtrip.py` checks
# the two agree on arbitrary events), in under half its time.
_DELTA_FIELDS: dict[type[Any], tuple[tuple[str, bool], ...]] = {
    cls: _delta_fields(cls)
    for cls in (OutputTextDelta, FunctionCallArgumentsDelta, CustomToolCallInputDelta)
}


def _encode_delta(
    event: Any, fields: tuple[tuple[str, bool], ...], extra: Mapping[str, Any] | None
) -> str | None:
    """A delta event as the generic path writes it, or None where that path must decide
    (an event with its own lane or with logprobs, an unexpected value or extra key)."""
    # `event` is any of the delta event classes: their fields are read by the table's names
    if event.stream_id is not None or getattr(event, "logprobs", None):
        return None
    parts = ['{"type":', _json_str(event.type)]
    for name, integer in fields:
        value = getattr(event, name)  # (see above: the table names the fields)
        if integer and type(value) is int:
            parts += (',"', name, '":', str(value))
        elif not integer and type(value) is str:
            parts += (',"', name, '":', _json_str(value))
        else:
            return None
    if isinstance(event, OutputTextDelta):
        parts.append(',"logprobs":[]')
    if extra:
        for key, value in extra.items():
            if key != "stream_id" or type(value) is not str:
                return None
            parts += (',"stream_id":', _json_str(value))
    parts.append("}")
    return "".join(parts)


# A str as JSON, as `json.dumps(..., ensure_ascii=False)` writes one (its C encoder).
_json_str: Callable[[str], str] = json.encoder.encode_basestring


def encode_msgpack(obj: Any) -> bytes:
    return typing.cast(bytes, msgpack.packb(_STRICT.unstructure(obj), use_bin_type=True))
