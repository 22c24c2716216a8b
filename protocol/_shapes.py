"""Shapes of the item and tool kinds rollout carries without acting on them.

The Responses API has many kinds of items (hosted tools' calls and results, MCP traffic,
programmatic tool calling, ...) and built-in tool declarations that rollout accepts, stores,
echoes and renders, but never interprets. Rather than one class each, they are one generic
value (`OpaqueItem`, `BuiltinTool`) checked against this table: the kind is known, every
required key is present, and each known key's value has the JSON kind the OpenAI SDK's types
give it. Keys the table does not know are carried as given, not refused: the live API takes
fields before the SDK's types list them (Codex sends `web_search` with
`search_content_types`), and rollout does not act on these kinds. Nested values are kept as
they came (plain JSON, already bounded by the message size and checked to be plain data by
the codec).

The tables follow the `openai` SDK's TypedDicts (`ResponseInputItemParam`, `ToolParam`); the
surface tests build an instance of every SDK type and decode it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._validate import InvalidField

__all__ = [
    "BUILTIN_TOOL_SHAPES",
    "NESTED_TOOL_SHAPES",
    "OPAQUE_ITEM_SHAPES",
    "Shape",
    "check_shape",
]

# A shape maps each key (a trailing "?" marks it optional) to the JSON kinds its value may
# have, "|"-separated: string, integer, number, boolean, object, array, null, or any. A string
# the SDK types as a `Literal` lists its values: "string=low,medium,high" (any other string is
# an `invalid_value`, as the live API answers; a test keeps these sets equal to the SDK's), and
# "array=a,b" is an array of such strings.
Shape = Mapping[str, str]

_STATUS = "string=completed,in_progress,incomplete"
_EXECUTION = "string=client,server"
_CONTEXT_SIZE = "string=high,low,medium"
_IMAGE_ACTION = "string=auto,edit,generate"
_IMAGE_BACKGROUND = "string=auto,opaque,transparent"
_IMAGE_FORMAT = "string=gif,jpeg,png,svg,webp"
_IMAGE_QUALITY = "string=auto,high,low,max,medium,xhigh"
_CALLERS = "array=direct,programmatic|null"
_CALLER = "object|null"  # caller: {"type": "direct"} | {"type": "program", "caller_id"}

OPAQUE_ITEM_SHAPES: dict[str, Shape] = {
    "file_search_call": {
        "id": "string",
        "queries": "array",
        "status": "string=completed,failed,in_progress,incomplete,searching",
        "results?": "array|null",
    },
    "web_search_call": {
        "id": "string",
        "action": "object",
        "status": "string=completed,failed,in_progress,incomplete,searching",
    },
    "tool_search_call": {
        "arguments": "any",
        "call_id?": "string|null",
        "execution?": _EXECUTION,
        "id?": "string|null",
        "status?": f"{_STATUS}|null",
    },
    "tool_search_output": {
        "tools": "array",
        "call_id?": "string|null",
        "execution?": _EXECUTION,
        "id?": "string|null",
        "status?": f"{_STATUS}|null",
    },
    "additional_tools": {"role": "string=developer", "tools": "array", "id?": "string|null"},
    "configuration_update": {"id?": "string|null", "reasoning?": "object", "text?": "object"},
    "image_generation_call": {
        "id": "string",
        "result": "string|null",
        "status": "string=completed,failed,generating,in_progress",
        "action?": f"{_IMAGE_ACTION}|null",
        "background?": f"{_IMAGE_BACKGROUND}|null",
        "error?": "object",
        "output_format?": f"{_IMAGE_FORMAT}|null",
        "quality?": f"{_IMAGE_QUALITY}|null",
        "revised_prompt?": "string|null",
        "size?": "string|null",
        "svg_usage?": "object",
    },
    "code_interpreter_call": {
        "code": "string|null",
        "container_id": "string",
        "id": "string",
        "outputs": "array|null",
        "status": "string=completed,failed,in_progress,incomplete,interpreting",
    },
    "mcp_list_tools": {
        "id": "string",
        "server_label": "string",
        "tools": "array",
        "error?": "string|null",
    },
    "mcp_approval_request": {
        "arguments": "string",
        "id": "string",
        "name": "string",
        "server_label": "string",
    },
    "mcp_approval_response": {
        "approval_request_id": "string",
        "approve": "boolean",
        "id?": "string|null",
        "reason?": "string|null",
    },
    "mcp_call": {
        "arguments": "string",
        "id": "string",
        "name": "string",
        "server_label": "string",
        "approval_request_id?": "string|null",
        "error?": "object|null",
        "output?": "string|null",
        "status?": "string=calling,completed,failed,in_progress,incomplete",
    },
    "compaction_trigger": {"id?": "string|null"},
    "program": {"call_id": "string", "code": "string", "fingerprint": "string", "id": "string"},
    "program_output": {
        "call_id": "string",
        "id": "string",
        "result": "string",
        "status": "string=completed,incomplete",
    },
}

_WEB_SEARCH: Shape = {
    "external_web_access?": "boolean",
    "search_content_types?": "array",
    "filters?": "object|null",
    "search_context_size?": _CONTEXT_SIZE,
    "user_location?": "object|null",
}
_WEB_SEARCH_PREVIEW: Shape = {
    "search_content_types?": "array=text,image",
    "search_context_size?": _CONTEXT_SIZE,
    "user_location?": "object|null",
}

BUILTIN_TOOL_SHAPES: dict[str, Shape] = {
    # Client-owned: the model calls them, the client runs them.
    "local_shell": {},
    "shell": {"allowed_callers?": _CALLERS, "environment?": "object|null"},
    "apply_patch": {"allowed_callers?": _CALLERS},
    "computer": {},
    "computer_use_preview": {
        "display_height": "integer",
        "display_width": "integer",
        "environment": "string=browser,linux,mac,ubuntu,windows",
    },
    # Hosted: the server runs them (rollout only with a configured executor).
    "file_search": {
        "vector_store_ids": "array",
        "filters?": "object|null",
        "max_num_results?": "integer",
        "ranking_options?": "object",
    },
    "web_search": _WEB_SEARCH,
    "web_search_2025_08_26": _WEB_SEARCH,
    "web_search_preview": _WEB_SEARCH_PREVIEW,
    "web_search_preview_2025_03_11": _WEB_SEARCH_PREVIEW,
    "mcp": {
        "server_label": "string",
        "allowed_callers?": _CALLERS,
        "allowed_tools?": "array|object|null",
        "authorization?": "string",
        "connector_id?": "string=connector_dropbox,connector_gmail,connector_googlecalendar,"
        "connector_googledrive,connector_microsoftteams,connector_outlookcalendar,"
        "connector_outlookemail,connector_sharepoint",
        "defer_loading?": "boolean",
        "headers?": "object|null",
        "require_approval?": "object|string|null",
        "server_description?": "string",
        "server_url?": "string",
        "tunnel_id?": "string",
    },
    "code_interpreter": {"container": "string|object", "allowed_callers?": _CALLERS},
    "programmatic_tool_calling": {},
    "image_generation": {
        "action?": _IMAGE_ACTION,
        "background?": _IMAGE_BACKGROUND,
        "complexity?": "string=high,low,medium",
        "frame_count?": "integer",
        "frame_duration_ms?": "integer",
        "input_fidelity?": "string=high,low|null",
        "input_image_mask?": "object",
        "model?": "string",
        "moderation?": "string=auto,low",
        "output_compression?": "integer",
        "output_format?": _IMAGE_FORMAT,
        "partial_images?": "integer",
        "quality?": _IMAGE_QUALITY,
        "size?": "string",
        "svg?": "object",
    },
    "tool_search": {"description?": "string|null", "execution?": _EXECUTION, "parameters?": "any"},
}

_MEMORY_LIMIT = "string=1g,4g,16g,64g|null"
_COMPARISON: Shape = {"key": "string", "value": "string|number|boolean|array"}
_USER_LOCATION: dict[str, Shape] = {
    "approximate": {
        "city?": "string|null",
        "country?": "string|null",
        "region?": "string|null",
        "timezone?": "string|null",
    }
}

# Objects inside a built-in tool that the SDK types as a union tagged by `type`: tool kind ->
# field -> the `type` values it takes -> the shape of the rest. An object there needs a known
# `type` and that variant's keys (a string is not an object and passes to the outer shape).
NESTED_TOOL_SHAPES: dict[str, dict[str, dict[str, Shape]]] = {
    "file_search": {
        "filters": {
            **{op: _COMPARISON for op in ("eq", "ne", "gt", "gte", "lt", "lte", "in", "nin")},
            "and": {"filters": "array"},
            "or": {"filters": "array"},
        }
    },
    "code_interpreter": {
        "container": {
            "auto": {
                "file_ids?": "array",
                "memory_limit?": _MEMORY_LIMIT,
                "network_policy?": "object",
            }
        }
    },
    "shell": {
        "environment": {
            "container_auto": {
                "file_ids?": "array",
                "memory_limit?": _MEMORY_LIMIT,
                "network_policy?": "object",
                "skills?": "array",
            },
            "local": {"skills?": "array"},
            "container_reference": {"container_id": "string"},
        }
    },
    "web_search_preview": {"user_location": _USER_LOCATION},
    "web_search_preview_2025_03_11": {"user_location": _USER_LOCATION},
}

_KIND_OF = {
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    dict: "object",
    list: "array",
    type(None): "null",
}


def _kinds(value: Any) -> tuple[str, ...]:
    kind = _KIND_OF.get(type(value), "any")
    return ("integer", "number") if kind == "integer" else (kind,)


def check_shape(
    shape: Shape,
    data: Mapping[str, Any],
    nested: Mapping[str, Mapping[str, Shape]] | None = None,
) -> None:
    """Check `data` (an object without its `type`) against `shape`, and its objects tagged by
    `type` against `nested` (field -> type -> shape). Raises `InvalidField` naming the key:
    missing, of the wrong JSON kind, or a value out of its Literal (unknown keys pass)."""
    known: dict[str, tuple[str, bool]] = {}
    for key, kinds in shape.items():
        name = key.rstrip("?")
        known[name] = (kinds, key.endswith("?"))
    for name, (_, optional) in known.items():
        if not optional and name not in data:
            raise InvalidField.missing(name)
    for name, value in data.items():
        spec = known.get(name)
        if spec is None:
            continue
        allowed = spec[0].split("|")
        bare = [k.partition("=")[0] for k in allowed]
        if "any" in bare or any(k in bare for k in _kinds(value)):
            if isinstance(value, str | list):
                _check_literal(allowed, value, name)
            continue
        wanted = " or ".join(_ARTICLE.get(k, k) for k in bare)
        raise InvalidField.wrong_type(wanted, value, name)
    for name, variants in (nested or {}).items():
        value = data.get(name)
        if isinstance(value, dict):
            _check_variant(variants, value, name)


def _check_variant(variants: Mapping[str, Shape], value: Mapping[str, Any], name: str) -> None:
    tag = value.get("type")
    if tag is None:
        raise InvalidField.missing(f"{name}.type")
    if not isinstance(tag, str) or tag not in variants:
        raise InvalidField.bad_value(tag, list(variants), f"{name}.type")
    try:
        check_shape(variants[tag], {k: v for k, v in value.items() if k != "type"})
    except InvalidField as exc:
        raise InvalidField(exc.code, exc.template, f"{name}.{exc.subpath}") from None


def _check_literal(allowed: list[str], value: str | list[Any], name: str) -> None:
    """A string in its Literal's values; an array of such strings."""
    for kind in allowed:
        head, literal, values = kind.partition("=")
        if not literal:
            continue
        supported = values.split(",")
        if head == "string" and isinstance(value, str) and value not in supported:
            raise InvalidField.bad_value(value, supported, name)
        if head == "array" and isinstance(value, list):
            for i, element in enumerate(value):
                if not isinstance(element, str):
                    raise InvalidField.wrong_type("a string", element, f"{name}[{i}]")
                if element not in supported:
                    raise InvalidField.bad_value(element, supported, f"{name}[{i}]")


_ARTICLE = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "object": "an object",
    "array": "an array",
    "null": "null",
}
