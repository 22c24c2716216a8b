"""The wire types' cattrs converter: how each wire type is read from and written to plain
JSON data, declared as one table of hooks (`_RULES`), and how its refusals become OpenAI errors.

The module is long because the table is the whole wire grammar below the message level: the
strict scalars, `Literal`s, lists and objects every field is made of, the tagged unions (items,
content parts, tools, tool choices) with the SDK's short forms, the opaque items and built-in
tools checked against their shapes, and the rules for which absent fields are written as `null`.
Each row names a type (or a predicate on types) and the factories of its structure and
unstructure hooks; `make_converter` registers the rows in order with cattrs' own
`register_*_hook` and `register_*_hook_factory`, so cattrs does all the dispatch.

Reading is strict where a peer feeds us: unknown keys (with `strict`), wrong JSON types, bad
enum values and out-of-range numbers are refused with the exact OpenAI error `code` and a
`param` path such as `input[2].content[0].type` (`structure`). `None` means absent: explicit
JSON `null`s are dropped before an object is structured. Writing drops absent optional fields of
items, tools and client events, and keeps `null`s in responses, errors and server events, where
clients expect every field to be present.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args, get_origin

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
    StructureHandlerNotFoundError,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from ._errors import ErrorBody, LocalProtocolError, RemoteProtocolError
from ._events import SERVER_EVENT_TYPES, SseErrorEvent
from ._items import (
    CONTENT_PART_TYPES,
    ITEM_TYPES,
    KEEP_NULL,
    WIRE_NAME,
    ContentPart,
    Item,
    OpaqueItem,
)
from ._response import (
    OMIT_IF_NONE,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ReasoningConfig,
    Response,
    ResponseError,
    ResponseRef,
    TextConfig,
    Usage,
)
from ._shapes import BUILTIN_TOOL_SHAPES, NESTED_TOOL_SHAPES, OPAQUE_ITEM_SHAPES, check_shape
from ._tools import (
    TOOL_CHOICE_TYPES,
    TOOL_TYPES,
    BuiltinTool,
    CustomTool,
    FunctionTool,
    Tool,
    ToolChoice,
)
from ._validate import MAX_QUOTED_CHARS, InvalidField, clip

__all__ = ["make_converter", "structure"]

StructureHook = Callable[[Any, Any], Any]
UnstructureHook = Callable[[Any], Any]
# A hook factory, given the type to handle and the converter (cattrs' "extended" factories).
StructureFactory = Callable[[Any, cattrs.Converter], StructureHook]
UnstructureFactory = Callable[[Any, cattrs.Converter], UnstructureHook]

# Objects whose absent fields are encoded as explicit `null` (the Response object and its
# parts, error bodies, and every server event): clients and the SDK types expect them present.
_KEEP_NULLS: frozenset[type[Any]] = frozenset(
    {
        Response,
        ResponseError,
        IncompleteDetails,
        ReasoningConfig,
        TextConfig,
        Usage,
        InputTokensDetails,
        OutputTokensDetails,
        ErrorBody,
        SseErrorEvent,
        *SERVER_EVENT_TYPES.values(),
    }
)

# Integers on the wire are 64-bit (what msgpack and most JSON peers carry); a float is taken
# as an integer only while it is exact.
_MAX_EXACT_FLOAT = 2**53


# --- scalars ---------------------------------------------------------------------------------


def _structure_str(value: Any, _: Any) -> str:
    """A string, exactly (no number or boolean taken as its text)."""
    if not isinstance(value, str):
        raise InvalidField.wrong_type("a string", value)
    return value


def _structure_bool(value: Any, _: Any) -> bool:
    """A boolean, exactly (no 0 or 1)."""
    if not isinstance(value, bool):
        raise InvalidField.wrong_type("a boolean", value)
    return value


def _structure_int(value: Any, _: Any) -> int:
    """An integer, or a float that is exactly one (up to 2**53); never a boolean."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and abs(value) <= _MAX_EXACT_FLOAT:
            return int(value)
        raise InvalidField.wrong_type("an integer", value)
    return value


def _structure_float(value: Any, _: Any) -> float:
    """A finite number (an integer is taken as a float); never a boolean."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidField.wrong_type("a number", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidField.wrong_type("a finite number", value)
    return float(value)


def _always(hook: StructureHook) -> StructureFactory:
    """The factory of a hook that needs neither its type nor the converter."""
    return lambda _t, _conv: hook


# --- literals, lists, objects ----------------------------------------------------------------


def _literal_values(t: Any) -> list[Any] | None:
    """The values of a `Literal`, or of a union of `Literal`s (e.g. a standard set plus an
    extension's `Literal["x"]`, optionally `| None`), flattened; `None` for any other type."""
    if get_origin(t) is Literal:
        return list(get_args(t))
    if get_origin(t) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in get_args(t) if a is not type(None)]
    if not args or any(get_origin(a) is not Literal for a in args):
        return None
    return [v for a in args for v in get_args(a)]


def _is_literal(t: Any) -> bool:
    """A `Literal`, or a union of `Literal`s."""
    return _literal_values(t) is not None


def _is_list(t: Any) -> bool:
    """`list[X]`."""
    return get_origin(t) is list


def _is_dict(t: Any) -> bool:
    """`dict[K, V]`."""
    return get_origin(t) is dict


def _literal_hook(t: Any, _conv: cattrs.Converter) -> StructureHook:
    """One of a `Literal`'s values, of the same JSON type (`1` is not `True`)."""
    allowed = _literal_values(t) or []

    def hook(value: Any, _: Any) -> Any:
        if any(value == a and type(value) is type(a) for a in allowed):
            return value
        if not isinstance(value, str):
            raise InvalidField.wrong_type("a string", value)
        raise InvalidField.bad_value(value, allowed)

    return hook


def _list_hook(t: Any, conv: cattrs.Converter) -> StructureHook:
    """An array, element by element, stopping at the first bad one: the cost of a bad body is
    independent of how many elements follow (cattrs' own list hook would try them all and
    build an exception for each)."""
    (elem_t,) = get_args(t) or (Any,)
    if elem_t is Any:
        inner = list_structure_factory(t, conv)
        return lambda value, _: _as_list(value) and inner(value, t)
    elem = conv.get_structure_hook(elem_t)

    def hook(value: Any, _: Any) -> Any:
        out = []
        for i, item in enumerate(_as_list(value)):
            try:
                out.append(elem(item, elem_t))
            except Exception as exc:
                exc.add_note(IterableValidationNote(f"Structuring {t} @ index {i}", i, elem_t))
                raise IterableValidationError("While structuring a list", [exc], t) from None
        return out

    return hook


def _dict_hook(t: Any, conv: cattrs.Converter) -> StructureHook:
    """An object with string keys; a bad value is named by its key (`metadata.key`)."""
    _key_t, val_t = get_args(t) or (str, Any)
    plain = val_t is Any

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise InvalidField.wrong_type("an object", value)
        out = {}
        for key, val in value.items():
            if not isinstance(key, str):
                raise InvalidField.wrong_type("string keys", key)
            if plain:
                out[key] = val
                continue
            try:
                out[key] = conv.structure(val, val_t)
            except InvalidField as exc:
                raise InvalidField(exc.code, exc.template, _join(key, exc.subpath)) from None
        return out

    return hook


def _attrs_hook(cls: type[Any], conv: cattrs.Converter) -> StructureHook:
    """An attrs class from an object, its `null`s dropped first (absent), unknown keys
    refused when the converter forbids extra keys; fields under their wire names."""
    inner = make_dict_structure_fn(
        cls,
        conv,
        _cattrs_forbid_extra_keys=conv.forbid_extra_keys,
        _cattrs_detailed_validation=True,
        **_renames(cls),
    )

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise InvalidField.wrong_type("an object", value)
        return inner({k: v for k, v in value.items() if v is not None}, cls)

    return hook


def _attrs_unstructure_hook(cls: type[Any], conv: cattrs.Converter) -> UnstructureHook:
    """An attrs class as an object under its wire names, absent optional fields dropped
    except where clients expect `null` (`_KEEP_NULLS`, which drop only `OMIT_IF_NONE` ones)."""
    inner = make_dict_unstructure_fn(cls, conv, **_renames(cls))
    fields = attrs.fields(cls)
    if cls in _KEEP_NULLS:
        optional = frozenset(a.name for a in fields if a.metadata.get(OMIT_IF_NONE))
    else:
        optional = frozenset(
            a.metadata.get(WIRE_NAME, a.name)
            for a in fields
            if a.default is None and not a.metadata.get(KEEP_NULL)
        )
    if not optional:
        return inner

    def hook(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = inner(obj)
        for name in optional:
            if out.get(name, 0) is None:
                del out[name]
        return out

    return hook


def _renames(cls: type[Any]) -> dict[str, Any]:
    """cattrs overrides for fields whose wire key differs from their name (`async_`)."""
    return {
        a.name: override(rename=a.metadata[WIRE_NAME])
        for a in attrs.fields(cls)
        if WIRE_NAME in a.metadata
    }


# --- tagged unions and opaque objects --------------------------------------------------------


def _no_default(_: dict[str, Any]) -> None:
    """A union whose members always name their `type`."""
    return None


def _untyped_item(value: dict[str, Any]) -> str | None:
    """The SDK's short forms of an item: a message without `type`, `{"id": ...}` for a
    reference."""
    if "role" in value:
        return "message"
    return "item_reference" if "id" in value else None


def _tagged(
    table: dict[str, type[Any]], *, default: Callable[[dict[str, Any]], str | None]
) -> StructureFactory:
    """A union tagged by `type`: the member `table` names (or `default` picks when `type` is
    absent)."""
    supported = list(table)

    def factory(_t: Any, conv: cattrs.Converter) -> StructureHook:
        def hook(value: Any, _: Any) -> Any:
            if not isinstance(value, dict):
                raise InvalidField.wrong_type("an object", value)
            tag = value.get("type")
            if tag is None:
                tag = default(value)
                if tag is None:
                    raise InvalidField.missing("type")
                value = {**value, "type": tag}
            if not isinstance(tag, str):
                raise InvalidField.wrong_type("a string", tag, "type")
            cls = table.get(tag)
            if cls is None:
                raise InvalidField.bad_value(tag, supported, "type")
            return conv.structure(value, cls)

        return hook

    return factory


def _opaque(
    shapes: dict[str, Any], field: str, nested: Mapping[str, Mapping[str, Mapping[str, Any]]]
) -> StructureFactory:
    """OpaqueItem / BuiltinTool: `type` plus the other keys (kept in `field`), checked
    against their shape when the converter is strict (nulls kept: carried exactly as given)."""

    def factory(cls: type[Any], conv: cattrs.Converter) -> StructureHook:
        strict = conv.forbid_extra_keys

        def hook(value: Any, _: Any) -> Any:
            if not isinstance(value, dict):
                raise InvalidField.wrong_type("an object", value)
            kind = value.get("type")
            shape = shapes.get(kind) if isinstance(kind, str) else None
            if shape is None:
                raise InvalidField.bad_value(kind, list(shapes), "type")
            rest = {k: v for k, v in value.items() if k != "type"}
            if strict:
                check_shape(shape, rest, nested.get(str(kind)))
            return cls(**{"type": kind, field: rest})

        return hook

    return factory


def _unstructure_opaque_item(_t: Any, _conv: cattrs.Converter) -> UnstructureHook:
    """An OpaqueItem as its `type` and its data, as it came."""
    return lambda obj: {"type": obj.type, **obj.data}


def _unstructure_builtin_tool(_t: Any, _conv: cattrs.Converter) -> UnstructureHook:
    """A BuiltinTool as its `type` and its settings, as they came."""
    return lambda obj: {"type": obj.type, **obj.settings}


# --- fields of more than one shape -----------------------------------------------------------


def _response_or_ref(_t: Any, conv: cattrs.Converter) -> StructureHook:
    """A rollout's resumed `response.in_progress` names its response (`ResponseRef`); any
    other carries the whole response, which always has `created_at`."""

    def hook(value: Any, _: Any) -> Response | ResponseRef:
        if isinstance(value, dict) and "created_at" not in value:
            return conv.structure(value, ResponseRef)
        return conv.structure(value, Response)

    return hook


def _text_or(expected: str, items_t: Any) -> StructureFactory:
    """A string, or an array of `items_t` (message content, request input)."""

    def factory(_t: Any, conv: cattrs.Converter) -> StructureHook:
        def hook(value: Any, _: Any) -> Any:
            if isinstance(value, str):
                return value
            if isinstance(value, list):
                return conv.structure(value, items_t)
            raise InvalidField.wrong_type(expected, value)

        return hook

    return factory


_TOOL_CHOICE_MODES = ["none", "auto", "required"]


def _tool_choice(t: Any, conv: cattrs.Converter) -> StructureHook:
    """A tool choice: a mode's name, or an object tagged by `type`."""
    choices = _tagged(TOOL_CHOICE_TYPES, default=_no_default)(t, conv)

    def hook(value: Any, _: Any) -> ToolChoice:
        if isinstance(value, str):
            if value in _TOOL_CHOICE_MODES:
                return typing.cast(ToolChoice, value)
            raise InvalidField.bad_value(value, _TOOL_CHOICE_MODES)
        if isinstance(value, dict):
            return typing.cast(ToolChoice, choices(value, None))
        raise InvalidField.wrong_type("a string or an object", value)

    return hook


def _id_or_object(value: Any, _: Any) -> Any:
    """`conversation`: an id or `{"id": ...}`, carried as given."""
    if isinstance(value, str | dict):
        return value
    raise InvalidField.wrong_type("a string or an object", value)


# --- the table -------------------------------------------------------------------------------


@attrs.frozen
class _Rule:
    """How the wire types `type` names (exactly that type) or `when` accepts (a predicate on
    types) are structured and unstructured: each a factory given the type and the converter."""

    type: Any = None
    when: Callable[[Any], bool] | None = None
    structure: StructureFactory | None = None
    unstructure: UnstructureFactory | None = None


# In registration order: cattrs tries predicates last registered first, so the general rules
# (literals, lists, objects, attrs classes) come before the types they would also match.
_RULES: tuple[_Rule, ...] = (
    _Rule(str, structure=_always(_structure_str)),
    _Rule(bool, structure=_always(_structure_bool)),
    _Rule(int, structure=_always(_structure_int)),
    _Rule(float, structure=_always(_structure_float)),
    _Rule(when=_is_literal, structure=_literal_hook),
    _Rule(when=_is_list, structure=_list_hook),
    _Rule(when=_is_dict, structure=_dict_hook),
    _Rule(when=attrs.has, structure=_attrs_hook, unstructure=_attrs_unstructure_hook),
    _Rule(
        OpaqueItem,
        structure=_opaque(OPAQUE_ITEM_SHAPES, "data", {}),
        unstructure=_unstructure_opaque_item,
    ),
    _Rule(
        BuiltinTool,
        structure=_opaque(BUILTIN_TOOL_SHAPES, "settings", NESTED_TOOL_SHAPES),
        unstructure=_unstructure_builtin_tool,
    ),
    _Rule(Item, structure=_tagged(ITEM_TYPES, default=_untyped_item)),
    _Rule(ContentPart, structure=_tagged(CONTENT_PART_TYPES, default=_no_default)),
    _Rule(Tool, structure=_tagged(TOOL_TYPES, default=_no_default)),
    _Rule(
        FunctionTool | CustomTool,
        structure=_tagged({"function": FunctionTool, "custom": CustomTool}, default=_no_default),
    ),
    _Rule(Response | ResponseRef, structure=_response_or_ref),
    _Rule(
        str | list[ContentPart],
        structure=_text_or("a string or an array of content parts", list[ContentPart]),
    ),
    _Rule(
        str | list[Item] | None,
        structure=_text_or("a string or an array of input items", list[Item]),
    ),
    _Rule(ToolChoice, structure=_tool_choice),
    _Rule(ToolChoice | None, structure=_tool_choice),
    _Rule(str | dict[str, Any] | None, structure=_always(_id_or_object)),
)


def make_converter(*, strict: bool = True) -> cattrs.Converter:
    """A converter for rollout's wire types, the rows of `_RULES` registered in order.
    `strict` forbids unknown keys (and checks opaque objects against their shapes)."""
    conv = cattrs.Converter(detailed_validation=True, forbid_extra_keys=strict)
    for rule in _RULES:
        if rule.when is not None:
            if rule.structure is not None:
                conv.register_structure_hook_factory(rule.when, rule.structure)
            if rule.unstructure is not None:
                conv.register_unstructure_hook_factory(rule.when, rule.unstructure)
        else:
            if rule.structure is not None:
                conv.register_structure_hook(rule.type, rule.structure(rule.type, conv))
            if rule.unstructure is not None:
                conv.register_unstructure_hook(rule.type, rule.unstructure(rule.type, conv))
    return conv


# --- refusals as OpenAI errors ---------------------------------------------------------------


def _as_list(value: Any) -> list[Any]:
    """`value` if it is an array, else the refusal."""
    if not isinstance(value, list):
        raise InvalidField.wrong_type("an array", value)
    return value


def _join(path: str, sub: str) -> str:
    """Two parts of a param path joined: `input` and `[2]`, `input[2]` and `content`."""
    if not path:
        return sub
    if not sub:
        return path
    return path + sub if sub.startswith("[") else f"{path}.{sub}"


def _leaf(exc: BaseException, path: str) -> tuple[BaseException, str]:
    """The first leaf error of a cattrs validation error group, and the path to it."""
    while isinstance(exc, BaseExceptionGroup):
        sub = exc.exceptions[0]
        for note in getattr(sub, "__notes__", ()):  # set only once a note was added
            if isinstance(note, AttributeValidationNote):
                path = _join(path, note.name)
            elif isinstance(note, IterableValidationNote):
                path = _join(path, f"[{note.index}]")
        exc = sub
    return exc, path


def _to_remote(exc: BaseException) -> RemoteProtocolError:
    """The OpenAI error for a structuring failure: its first leaf error, at its path."""
    leaf, path = _leaf(exc, "")
    if isinstance(leaf, InvalidField):
        param = _join(path, leaf.subpath)
        return RemoteProtocolError.invalid(
            leaf.template.replace("{param}", param), code=leaf.code, param=param or None
        )
    if isinstance(leaf, ForbiddenExtraKeysError):
        param = _join(path, min(map(str, leaf.extra_fields)))[:MAX_QUOTED_CHARS]
        return RemoteProtocolError.invalid(
            f"Unknown parameter: '{param}'.", code="unknown_parameter", param=param
        )
    if isinstance(leaf, KeyError):
        return RemoteProtocolError.invalid(
            f"Missing required parameter: '{path}'.",
            code="missing_required_parameter",
            param=path or None,
        )
    if isinstance(leaf, StructureHandlerNotFoundError):
        raise LocalProtocolError(f"no codec rule for the field at {path!r}: {leaf}") from exc
    return RemoteProtocolError.invalid(
        f"Invalid value for '{path}': {clip(str(leaf))}.", code="invalid_value", param=path or None
    )


def structure(conv: cattrs.Converter, data: Any, cls: Any) -> Any:
    """`data` structured as `cls`, or the `RemoteProtocolError` that refuses it (the first
    bad field's code, message and param path)."""
    try:
        return conv.structure(data, cls)
    except RecursionError:
        raise RemoteProtocolError.invalid(
            "The message is nested too deeply.", code="invalid_value"
        ) from None
    except Exception as exc:
        raise _to_remote(exc) from None
