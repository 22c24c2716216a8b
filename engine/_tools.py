"""Tools as the model sees them: which are offered, what a call names, what `tool_choice` asks.

A request may declare any tool the Responses API knows. The model is offered:
- function and custom tools (also inside namespaces), called by name (`ns.name` inside a
  namespace);
- the built-in tools the client runs (`local_shell`, `shell` outside a hosted container,
  `apply_patch`, `computer`, `computer_use_preview`), called by their type;
- hosted tools (`web_search`, `file_search`, `mcp`, `code_interpreter`, `image_generation`,
  `tool_search`, ...) only when an executor for their type is configured; otherwise they are
  echoed in the response but left out of the model's context, since nothing could run them.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

import attrs
from rollout.protocol import (
    BuiltinTool,
    CustomTool,
    FunctionTool,
    NamespaceTool,
    RemoteProtocolError,
    Tool,
    ToolChoice,
    ToolChoiceAllowed,
    ToolChoiceBuiltin,
    ToolChoiceCustom,
    ToolChoiceFunction,
    ToolChoiceMcp,
    builtin_call_kind,
)

from ._schemas import check_untrusted_schema

__all__ = [
    "MAX_GRAMMAR_CHARS",
    "CallTarget",
    "Choice",
    "callable_tools",
    "check_text_format",
    "check_tools",
    "offered_tools",
    "resolve_choice",
]

# The longest grammar (lark or regex) a custom tool may declare. Real grammars are a few
# kilobytes (Codex's apply_patch grammar is under 1 KB); the bound keeps a hostile one cheap.
MAX_GRAMMAR_CHARS = 64 * 1024

# `tool_choice` types that name a built-in tool, and the tool types each may force.
_FORCED_TYPES: dict[str, frozenset[str]] = {
    "computer": frozenset({"computer", "computer_use_preview"}),
    "computer_use": frozenset({"computer", "computer_use_preview"}),
    "computer_use_preview": frozenset({"computer", "computer_use_preview"}),
    "web_search_preview": frozenset({"web_search_preview", "web_search_preview_2025_03_11"}),
    "web_search_preview_2025_03_11": frozenset(
        {"web_search_preview", "web_search_preview_2025_03_11"}
    ),
}


def _invalid(message: str, param: str, code: str = "invalid_value") -> RemoteProtocolError:
    return RemoteProtocolError.invalid(message, code=code, param=param)


@attrs.frozen
class CallTarget:
    """One tool the model may call: the call's kind, the name it uses, and the tool."""

    kind: str  # a client call kind (`CallKind`), or a hosted tool's type
    name: str  # function/custom: its name; built-in: its type
    namespace: str | None
    tool: FunctionTool | CustomTool | BuiltinTool

    @property
    def qualified(self) -> str:
        return f"{self.namespace}.{self.name}" if self.namespace else self.name


def _is_offered(tool: Tool, hosted: Collection[str]) -> bool:
    if isinstance(tool, BuiltinTool):
        return builtin_call_kind(tool) is not None or tool.type in hosted
    return True


def offered_tools(tools: Sequence[Tool], hosted: Collection[str] = ()) -> tuple[Tool, ...]:
    """The declared tools the model is offered (see the module docstring)."""
    return tuple(t for t in tools if _is_offered(t, hosted))


def callable_tools(tools: Sequence[Tool]) -> list[CallTarget]:
    """Every tool of `tools` (already the offered ones) as the model would call it."""
    out: list[CallTarget] = []
    for tool in tools:
        if isinstance(tool, NamespaceTool):
            for member in tool.tools:
                kind = "custom" if isinstance(member, CustomTool) else "function"
                out.append(CallTarget(kind, member.name, tool.name, member))
        elif isinstance(tool, FunctionTool):
            out.append(CallTarget("function", tool.name, None, tool))
        elif isinstance(tool, CustomTool):
            out.append(CallTarget("custom", tool.name, None, tool))
        else:
            out.append(CallTarget(builtin_call_kind(tool) or tool.type, tool.type, None, tool))
    return out


@attrs.frozen
class Choice:
    """What `tool_choice` leaves the model: `mode` none (answer in text), auto (may call one
    of `tools`), or required (must call one of `tools`)."""

    mode: str
    tools: tuple[CallTarget, ...]


def _matches(entry: CallTarget, ref: dict[str, object]) -> bool:
    """Does an `allowed_tools` entry (`{"type": "function", "name": ...}`, `{"type":
    "shell"}`, `{"type": "mcp", "server_label": ...}`) name this tool?"""
    kind = ref.get("type")
    if kind in ("function", "custom"):
        return entry.kind == kind and ref.get("name") in (entry.name, entry.qualified)
    if kind == "mcp":
        tool = entry.tool
        label = tool.settings.get("server_label") if isinstance(tool, BuiltinTool) else None
        return (
            isinstance(tool, BuiltinTool)
            and tool.type == "mcp"
            and label == ref.get("server_label")
        )
    return isinstance(entry.tool, BuiltinTool) and entry.tool.type == kind


def _target_keys(entry: CallTarget) -> list[tuple[str, object]]:
    """The `allowed_tools` keys that name this tool (see `_matches`)."""
    keys: list[tuple[str, object]] = []
    if entry.kind in ("function", "custom"):
        keys.append((entry.kind, entry.name))
        if entry.qualified != entry.name:
            keys.append((entry.kind, entry.qualified))
    tool = entry.tool
    if isinstance(tool, BuiltinTool):
        keys.append(("type", tool.type))
        if tool.type == "mcp":
            label = tool.settings.get("server_label")
            if _hashable(label):
                keys.append(("mcp", label))
    return keys


def _ref_key(ref: dict[str, object]) -> tuple[str, object] | None:
    """The key of an `allowed_tools` entry, None when it can name no tool."""
    kind = ref.get("type")
    if kind in ("function", "custom"):
        value, tag = ref.get("name"), str(kind)
    elif kind == "mcp":
        value, tag = ref.get("server_label"), "mcp"
    else:
        value, tag = kind, "type"
    return (tag, value) if _hashable(value) else None


def _hashable(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _allowed_index(every: Sequence[CallTarget]) -> dict[tuple[str, object], list[int]]:
    """Each `allowed_tools` key -> the positions of the tools it names: one pass over the
    tools, then one lookup per entry (linear in what the client sent; `_matches` is the
    same rule, entry by entry)."""
    index: dict[tuple[str, object], list[int]] = {}
    for position, entry in enumerate(every):
        for key in _target_keys(entry):
            index.setdefault(key, []).append(position)
    return index


def resolve_choice(choice: ToolChoice, tools: Sequence[Tool]) -> Choice:
    """The tools `choice` leaves callable among `tools` (the offered ones)."""
    every = callable_tools(tools)
    if isinstance(choice, str):
        return Choice(choice, tuple(every) if choice != "none" else ())
    if isinstance(choice, ToolChoiceFunction | ToolChoiceCustom):
        kind = "function" if isinstance(choice, ToolChoiceFunction) else "custom"
        named = [c for c in every if c.kind == kind and choice.name in (c.name, c.qualified)]
        return Choice("required", tuple(named[:1]))
    if isinstance(choice, ToolChoiceAllowed):
        index = _allowed_index(every)
        positions: set[int] = set()
        for entry in choice.tools:
            found = _ref_key(entry)
            if found is not None:
                positions.update(index.get(found, ()))
        return Choice(choice.mode, tuple(every[i] for i in sorted(positions)))
    if isinstance(choice, ToolChoiceMcp):
        ref: dict[str, object] = {"type": "mcp", "server_label": choice.server_label}
        return Choice("required", tuple(c for c in every if _matches(c, ref)))
    types = _FORCED_TYPES.get(choice.type, frozenset({choice.type}))
    forced = [c for c in every if isinstance(c.tool, BuiltinTool) and c.tool.type in types]
    return Choice("required", tuple(forced[:1]))


# --- request validation ----------------------------------------------------------------------


def check_tools(
    tools: Sequence[Tool],
    choice: ToolChoice | None,
    *,
    hosted: Collection[str],
    schemas_known: bool,
) -> None:
    """Names unique per kind, function schemas valid (skipped when `schemas_known`: the same
    tools were checked with the parent), grammars bounded, and a `tool_choice` that names a
    declared tool (one nothing here can run is refused as unsupported)."""
    seen: set[tuple[str, str]] = set()
    for i, tool in enumerate(tools):
        members: Sequence[Tool] = tool.tools if isinstance(tool, NamespaceTool) else [tool]
        for j, member in enumerate(members):
            where = f"tools[{i}]" + (f".tools[{j}]" if isinstance(tool, NamespaceTool) else "")
            prefix = f"{tool.name}." if isinstance(tool, NamespaceTool) else ""
            shown = member.name if isinstance(member, BuiltinTool) else prefix + member.name
            key = ("builtin" if isinstance(member, BuiltinTool) else "named", shown)
            if key in seen:
                raise _invalid(f"Duplicate tool name: '{shown}'.", f"{where}.name")
            seen.add(key)
            if isinstance(member, FunctionTool) and member.parameters is not None:
                if not schemas_known:
                    _check_schema(member, where)
            elif isinstance(member, CustomTool) and member.format is not None:
                definition = member.format.definition
                if definition is not None and len(definition) > MAX_GRAMMAR_CHARS:
                    raise _invalid(
                        f"Invalid 'format.definition': the grammar is {len(definition)} "
                        f"characters, more than the limit of {MAX_GRAMMAR_CHARS}.",
                        f"{where}.format.definition",
                        "string_above_max_length",
                    )
    if choice is None or isinstance(choice, str):
        return
    if isinstance(choice, ToolChoiceAllowed):
        index = _allowed_index(callable_tools(tools))
        for k, ref in enumerate(choice.tools):
            found = _ref_key(ref)
            if found is None or found not in index:
                label = ref.get("name") or ref.get("server_label") or ref.get("type")
                raise _invalid(
                    f"Tool choice entry '{str(label)[:64]}' not found in 'tools' parameter.",
                    f"tool_choice.tools[{k}]",
                )
        return
    declared = resolve_choice(choice, tools)
    if not declared.tools:
        named = (
            choice.name
            if isinstance(choice, ToolChoiceFunction | ToolChoiceCustom)
            else (choice.name or choice.server_label)
            if isinstance(choice, ToolChoiceMcp)
            else None
        )
        raise _invalid(
            f"Tool choice '{named or choice.type}' not found in 'tools' parameter.",
            "tool_choice",
        )
    forced = declared.tools[0]
    if isinstance(choice, ToolChoiceBuiltin | ToolChoiceMcp) and not _is_offered(
        forced.tool, hosted
    ):
        raise RemoteProtocolError.invalid(
            f"Tool choice '{choice.type}' forces a hosted tool, and this server has no "
            f"executor for '{forced.tool.type}'.",
            code="unsupported_parameter",
            param="tool_choice",
        )


def _check_schema(tool: FunctionTool, where: str) -> None:
    check_untrusted_schema(tool.parameters, f"{where}.parameters", what=f"function '{tool.name}'")


# A structured-outputs format's name, as the OpenAI API accepts it.
_FORMAT_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TEXT_FORMAT_TYPES = ("text", "json_schema", "json_object")


def check_text_format(fmt: dict[str, object]) -> None:
    """`text.format`: one of the known types; a `json_schema` format has a valid name and a
    schema checked like a function's parameters (bounded first)."""
    kind = fmt.get("type")
    if kind not in TEXT_FORMAT_TYPES:
        shown = ", ".join(repr(t) for t in TEXT_FORMAT_TYPES)
        raise _invalid(
            f"Invalid value: {str(kind)[:64]!r}. Supported values are: {shown}.",
            "text.format.type",
        )
    if kind != "json_schema":
        return
    name = fmt.get("name")
    if not isinstance(name, str) or not _FORMAT_NAME.match(name):
        raise _invalid(
            "Invalid 'text.format.name': expected a string matching '^[a-zA-Z0-9_-]{1,64}$'.",
            "text.format.name",
            "invalid_value" if name is not None else "missing_required_parameter",
        )
    if "schema" not in fmt:
        raise _invalid(
            "Missing required parameter: 'text.format.schema'.",
            "text.format.schema",
            "missing_required_parameter",
        )
    check_untrusted_schema(fmt["schema"], "text.format.schema", what=f"text format '{name}'")
