"""The request surface of the installed `openai` SDK, read from its types: every request field,
tool type, tool choice and input item type, and instances of each built from the annotations.

`members(union)` lists a union's TypedDicts; `instance(td, full=...)` builds a value of a
TypedDict from its annotations (every field, or only the required ones), recursively, with a
plausible value per field name where the type alone says little (`name`, URLs, `call_id`).
Nothing here is written by hand per type: a new SDK field or type shows up in these lists.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any

import typing_extensions as te
from openai.types.responses import response_create_params, response_input_item_param, tool_param
from openai.types.responses.responses_client_event_param import ResponseCreate as WsCreate

__all__ = [
    "CREATE_FIELDS",
    "INPUT_ITEM_TYPES",
    "TOOL_CHOICE_TYPES",
    "TOOL_TYPES",
    "WS_CREATE_FIELDS",
    "instance",
    "members",
    "type_tags",
]

_UNION_ORIGINS = (typing.Union, types.UnionType)


def _strip(tp: Any) -> Any:
    """The type inside Required/NotRequired/Annotated."""
    while te.get_origin(tp) in (te.Required, te.NotRequired, te.Annotated, typing.Annotated):
        tp = te.get_args(tp)[0]
    return tp


def _is_typeddict(tp: Any) -> bool:
    return te.is_typeddict(tp)


def members(union: Any) -> list[Any]:
    """The TypedDicts (and literal strings) of a union, flattened."""
    tp = _strip(union)
    if te.get_origin(tp) in _UNION_ORIGINS:
        return [m for arg in te.get_args(tp) for m in members(arg)]
    return [tp]


def fields(td: Any) -> dict[str, tuple[bool, Any]]:
    """field -> (required, type) of a TypedDict, with Required/NotRequired resolved."""
    hints = te.get_type_hints(td, include_extras=True)
    total = getattr(td, "__total__", True)
    out: dict[str, tuple[bool, Any]] = {}
    for key, hint in hints.items():
        origin = te.get_origin(hint)
        if origin is te.Required:
            out[key] = (True, _strip(hint))
        elif origin is te.NotRequired:
            out[key] = (False, _strip(hint))
        else:
            out[key] = (total, _strip(hint))
    return out


def type_tags(td: Any) -> list[str]:
    """The `type` values a TypedDict allows (its literal)."""
    found = fields(td).get("type")
    if found is None:
        return []
    tp = found[1]
    while te.get_origin(tp) in _UNION_ORIGINS:
        tp = next(a for a in te.get_args(tp) if a is not type(None))
    return [str(v) for v in te.get_args(tp)]


# Plausible values for fields whose type alone says little (the engine checks them).
_BY_NAME: dict[str, Any] = {
    "name": "tool_a",
    "image_url": "https://example.com/a.png",
    "file_url": "https://example.com/a.txt",
    "file_data": "data:text/plain;base64,aGVsbG8=",
    "server_url": "https://example.com/mcp",
    "model": "sim",
    "definition": 'start: "x"',
    "arguments": "{}",
    "role": None,  # from the literal
    "schema": {"type": "object", "properties": {}},
    "parameters": {"type": "object", "properties": {}},
}


def instance(tp: Any, *, full: bool = True, key: str = "", depth: int = 0) -> Any:
    """A value of `tp` built from its annotations: every field of a TypedDict (`full`) or only
    the required ones; the first member of a union (not None), the first literal value."""
    tp = _strip(tp)
    if depth > 12:
        raise RecursionError(f"type too deep at {key!r}")
    if key in _BY_NAME and _BY_NAME[key] is not None and tp in (str, typing.Any, object):
        return _BY_NAME[key]
    if key in ("schema", "parameters") and te.get_origin(tp) in (dict, typing.Dict):  # noqa: UP006
        return _BY_NAME[key]
    if _is_typeddict(tp):
        return {
            name: instance(ftype, full=full, key=name, depth=depth + 1)
            for name, (required, ftype) in fields(tp).items()
            if required or full
        }
    origin = te.get_origin(tp)
    if origin is te.Literal or origin is typing.Literal:
        return te.get_args(tp)[0]
    if origin in _UNION_ORIGINS:
        options = [a for a in te.get_args(tp) if a is not type(None)]
        return instance(options[0], full=full, key=key, depth=depth + 1)
    if origin in (
        list,
        collections.abc.Iterable,
        collections.abc.Sequence,
        typing.List,  # noqa: UP006
        typing.Iterable,
        typing.Sequence,
    ):
        (item,) = te.get_args(tp) or (str,)
        return [instance(item, full=full, key=key, depth=depth + 1)]
    if origin in (dict, collections.abc.Mapping, typing.Dict):  # noqa: UP006
        _, value = te.get_args(tp) or (str, str)
        return {} if value in (object, typing.Any) else {"k": instance(value, depth=depth + 1)}
    if tp is str:
        return f"{key or 'value'}_1"
    if tp is bool:
        return True
    if tp is int:
        return 1
    if tp is float:
        return 0.5
    if tp in (object, typing.Any):
        return {}
    raise TypeError(f"no instance for {tp!r} at {key!r}")


CREATE_FIELDS: dict[str, tuple[bool, Any]] = fields(response_create_params.ResponseCreateParamsBase)
WS_CREATE_FIELDS: dict[str, tuple[bool, Any]] = fields(WsCreate)
INPUT_ITEM_TYPES: list[Any] = members(response_input_item_param.ResponseInputItemParam)
TOOL_TYPES: list[Any] = members(tool_param.ToolParam)
TOOL_CHOICE_TYPES: list[Any] = [
    m for m in members(response_create_params.ToolChoice) if _is_typeddict(m)
]
