"""Wire types for tool declarations and `tool_choice`.

- `FunctionTool` and `CustomTool` (free-form input, optionally constrained by a lark or regex
  grammar) are the client's own tools; `NamespaceTool` groups them under a name.
- `BuiltinTool` is every tool OpenAI defines by `type` (`shell`, `apply_patch`, `computer`,
  `web_search`, `file_search`, `mcp`, ...): its settings are checked against
  `_shapes.BUILTIN_TOOL_SHAPES` and carried as given. `CLIENT_BUILTIN_TOOLS` are the ones the
  client runs (the model calls them, like functions); the others are hosted: the server runs
  them, which rollout does only with a configured executor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias, get_args

import attrs

from ._items import KEEP_NULL, WIRE_NAME, CallKind, JSONObject
from ._shapes import BUILTIN_TOOL_SHAPES
from ._validate import InvalidField

__all__ = [
    "CLIENT_BUILTIN_TOOLS",
    "TOOL_CHOICE_TYPES",
    "TOOL_TYPES",
    "BuiltinTool",
    "CustomTool",
    "CustomToolFormat",
    "FunctionTool",
    "NamespaceTool",
    "Tool",
    "ToolChoice",
    "ToolChoiceAllowed",
    "ToolChoiceBuiltin",
    "ToolChoiceCustom",
    "ToolChoiceFunction",
    "ToolChoiceMcp",
    "ToolChoiceMode",
    "builtin_call_kind",
    "check_tool",
    "echo_tools",
]

# Function and custom tool names as the OpenAI API accepts them.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# Fields encoded even when absent (as null): the Open Responses schema requires a function
# tool's `description`, `parameters` and `strict` to be present (each may be null).
_PRESENT = {KEEP_NULL: True}


@attrs.frozen(kw_only=True)
class FunctionTool:
    type: Literal["function"] = "function"
    name: str
    description: str | None = attrs.field(default=None, metadata=_PRESENT)
    parameters: JSONObject | None = attrs.field(default=None, metadata=_PRESENT)
    strict: bool | None = attrs.field(default=None, metadata=_PRESENT)
    defer_loading: bool | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    output_schema: JSONObject | None = None
    async_: bool | None = attrs.field(default=None, metadata={WIRE_NAME: "async"})


@attrs.frozen(kw_only=True)
class CustomToolFormat:
    """`{"type": "text"}` (unconstrained) or `{"type": "grammar", "syntax": "lark" | "regex",
    "definition": ...}`."""

    type: Literal["text", "grammar"] = "text"
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.type == "grammar":
            if self.syntax is None:
                raise InvalidField.missing("syntax")
            if self.definition is None:
                raise InvalidField.missing("definition")


@attrs.frozen(kw_only=True)
class CustomTool:
    """A tool whose input is free text, not JSON arguments."""

    type: Literal["custom"] = "custom"
    name: str
    description: str | None = None
    format: CustomToolFormat | None = None
    defer_loading: bool | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    async_: bool | None = attrs.field(default=None, metadata={WIRE_NAME: "async"})


@attrs.frozen(kw_only=True)
class NamespaceTool:
    """A named group of function and custom tools; calls to its members carry `namespace`."""

    type: Literal["namespace"] = "namespace"
    name: str
    description: str
    tools: list[FunctionTool | CustomTool]


@attrs.frozen(kw_only=True)
class BuiltinTool:
    """A tool of a type OpenAI defines (see the module docstring): its `type` and its settings
    exactly as given."""

    type: str
    settings: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.type not in BUILTIN_TOOL_SHAPES:
            raise InvalidField.bad_value(self.type, list(TOOL_TYPES), "type")

    @property
    def name(self) -> str:
        """The name a model calls it by: its type (an MCP server: its label)."""
        label = self.settings.get("server_label")
        return label if self.type == "mcp" and isinstance(label, str) else self.type


Tool: TypeAlias = FunctionTool | CustomTool | NamespaceTool | BuiltinTool
TOOL_TYPES: dict[str, type[Any]] = {
    "function": FunctionTool,
    "custom": CustomTool,
    "namespace": NamespaceTool,
    **dict.fromkeys(BUILTIN_TOOL_SHAPES, BuiltinTool),
}

# Built-in tools the client runs, and the kind of call the model makes to each.
CLIENT_BUILTIN_TOOLS: dict[str, CallKind] = {
    "local_shell": "local_shell",
    "shell": "shell",
    "apply_patch": "apply_patch",
    "computer": "computer",
    "computer_use_preview": "computer",
}
# A `shell` tool in one of these environments runs in a hosted container, not on the client.
_HOSTED_SHELL_ENVIRONMENTS = frozenset({"container_auto", "container_reference"})


def builtin_call_kind(tool: BuiltinTool) -> CallKind | None:
    """The kind of call the model makes to a client-run built-in tool; None when the tool is
    hosted (run by the server)."""
    kind = CLIENT_BUILTIN_TOOLS.get(tool.type)
    if kind == "shell":
        environment = tool.settings.get("environment")
        if isinstance(environment, dict) and environment.get("type") in _HOSTED_SHELL_ENVIRONMENTS:
            return None
    return kind


def echo_tools(tools: Sequence[Tool]) -> list[Tool]:
    """The tools as a response echoes them: function tools with `strict` made explicit (the
    API's default is true)."""
    out: list[Tool] = []
    for tool in tools:
        if isinstance(tool, FunctionTool) and tool.strict is None:
            tool = attrs.evolve(tool, strict=True)
        elif isinstance(tool, NamespaceTool):
            members = [
                attrs.evolve(m, strict=True)
                if isinstance(m, FunctionTool) and m.strict is None
                else m
                for m in tool.tools
            ]
            tool = attrs.evolve(tool, tools=members)
        out.append(tool)
    return out


# --- structural checks (run by the request's validator; the codec adds the `tools[i].` path) --


def check_tool(tool: Tool, where: str = "") -> None:
    """Structural checks of one tool definition (names, parameter schema shape)."""
    if isinstance(tool, NamespaceTool):
        _check_name(tool.name, f"{where}name")
        for j, member in enumerate(tool.tools):
            check_tool(member, f"{where}tools[{j}].")
        return
    if isinstance(tool, BuiltinTool):
        return
    _check_name(tool.name, f"{where}name")
    if isinstance(tool, FunctionTool):
        params = tool.parameters
        if params is not None and params.get("type", "object") != "object":
            raise InvalidField(
                "invalid_function_parameters",
                f"Invalid schema for function '{tool.name}': schema must be a JSON Schema of "
                f"'type: \"object\"', got 'type: {json.dumps(params.get('type'))}'.",
                f"{where}parameters",
            )


def _check_name(name: str, where: str) -> None:
    if not _TOOL_NAME.match(name):
        raise InvalidField(
            "invalid_value",
            "Invalid '{param}': string does not match pattern. Expected a string that "
            "matches the pattern '^[a-zA-Z0-9_-]{1,64}$'.",
            where,
        )


# --- tool_choice -----------------------------------------------------------------------------

ToolChoiceMode: TypeAlias = Literal["none", "auto", "required"]


@attrs.frozen(kw_only=True)
class ToolChoiceFunction:
    type: Literal["function"] = "function"
    name: str


@attrs.frozen(kw_only=True)
class ToolChoiceCustom:
    type: Literal["custom"] = "custom"
    name: str


@attrs.frozen(kw_only=True)
class ToolChoiceAllowed:
    """Restrict the model to a subset of the tools: each entry names one
    (`{"type": "function", "name": ...}`, `{"type": "shell"}`, ...)."""

    type: Literal["allowed_tools"] = "allowed_tools"
    mode: Literal["auto", "required"]
    tools: list[JSONObject]


@attrs.frozen(kw_only=True)
class ToolChoiceMcp:
    type: Literal["mcp"] = "mcp"
    server_label: str
    name: str | None = None


BuiltinChoiceType: TypeAlias = Literal[
    "apply_patch",
    "shell",
    "programmatic_tool_calling",
    "file_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "computer",
    "computer_use_preview",
    "computer_use",
    "image_generation",
    "code_interpreter",
]


@attrs.frozen(kw_only=True)
class ToolChoiceBuiltin:
    """Force a call of a built-in tool, named by its type."""

    type: BuiltinChoiceType


ToolChoice: TypeAlias = (
    ToolChoiceMode
    | ToolChoiceFunction
    | ToolChoiceCustom
    | ToolChoiceAllowed
    | ToolChoiceMcp
    | ToolChoiceBuiltin
)
TOOL_CHOICE_TYPES: dict[str, type[Any]] = {
    "function": ToolChoiceFunction,
    "custom": ToolChoiceCustom,
    "allowed_tools": ToolChoiceAllowed,
    "mcp": ToolChoiceMcp,
    **dict.fromkeys(get_args(BuiltinChoiceType), ToolChoiceBuiltin),
}
