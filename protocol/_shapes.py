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
    "OPAQUE_ITEM_SHAPES",
    "Shape",
    "check_shape",
]

# A shape maps each key (a trailing "?" marks it optional) to the JSON kinds its value may
# have, "|"-separated: string, integer, number, boolean, object, array, null, or any.
Shape = Mapping[str, str]

_CALLERS = "array|null"  # allowed_callers: ["direct" | "programmatic"]
_CALLER = "object|null"  # caller: {"type": "direct"} | {"type": "program", "caller_id"}

OPAQUE_ITEM_SHAPES: dict[str, Shape] = {
    "file_search_call": {
        "id": "string",
        "queries": "array",
        "status": "string",
        "results?": "array|null",
    },
    "web_search_call": {"id": "string", "action": "object", "status": "string"},
    "tool_search_call": {
        "arguments": "any",
        "call_id?": "string|null",
        "execution?": "string",
        "id?": "string|null",
        "status?": "string|null",
    },
    "tool_search_output": {
        "tools": "array",
        "call_id?": "string|null",
        "execution?": "string",
        "id?": "string|null",
        "status?": "string|null",
    },
    "additional_tools": {"role": "string", "tools": "array", "id?": "string|null"},
    "configuration_update": {"id?": "string|null", "reasoning?": "object", "text?": "object"},
    "image_generation_call": {
        "id": "string",
        "result": "string|null",
        "status": "string",
        "action?": "string|null",
        "background?": "string|null",
        "error?": "object",
        "output_format?": "string|null",
        "quality?": "string|null",
        "revised_prompt?": "string|null",
        "size?": "string|null",
        "svg_usage?": "object",
    },
    "code_interpreter_call": {
        "code": "string|null",
        "container_id": "string",
        "id": "string",
        "outputs": "array|null",
        "status": "string",
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
        "status?": "string",
    },
    "compaction_trigger": {"id?": "string|null"},
    "program": {"call_id": "string", "code": "string", "fingerprint": "string", "id": "string"},
    "program_output": {"call_id": "string", "id": "string", "result": "string", "status": "string"},
}

_WEB_SEARCH: Shape = {
    "external_web_access?": "boolean",
    "search_content_types?": "array",
    "filters?": "object|null",
    "search_context_size?": "string",
    "user_location?": "object|null",
}
_WEB_SEARCH_PREVIEW: Shape = {
    "search_content_types?": "array",
    "search_context_size?": "string",
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
        "environment": "string",
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
        "connector_id?": "string",
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
        "action?": "string",
        "background?": "string",
        "complexity?": "string",
        "frame_count?": "integer",
        "frame_duration_ms?": "integer",
        "input_fidelity?": "string|null",
        "input_image_mask?": "object",
        "model?": "string",
        "moderation?": "string",
        "output_compression?": "integer",
        "output_format?": "string",
        "partial_images?": "integer",
        "quality?": "string",
        "size?": "string",
        "svg?": "object",
    },
    "tool_search": {"description?": "string|null", "execution?": "string", "parameters?": "any"},
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


def check_shape(shape: Shape, data: Mapping[str, Any]) -> None:
    """Check `data` (an object without its `type`) against `shape`. Raises `InvalidField`
    naming the key: missing, or of the wrong JSON kind (unknown keys pass)."""
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
        if "any" in allowed or any(k in allowed for k in _kinds(value)):
            continue
        wanted = " or ".join(_ARTICLE.get(k, k) for k in allowed)
        raise InvalidField.wrong_type(wanted, value, name)


_ARTICLE = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "object": "an object",
    "array": "an array",
    "null": "null",
}
