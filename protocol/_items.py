"""Wire types for conversation items and content parts.

Long because it is a catalogue: one small class per item and content-part type the API defines,
and the tables that relate calls to their outputs.

Every class is one wire `type`, immutable, keyword-only. `None` always means "absent": the
codec drops explicit JSON `null`s before structuring, so a field is either required, optional
with a `None` default, or has a concrete default. Field order follows the OpenAI SDK's types.

Items fall in three groups:
- conversation items rollout reads: messages, reasoning, item references, compaction;
- tool calls and their outputs, one class each, for every tool a client runs (function and
  custom tools; the built-in `local_shell`, `shell`, `apply_patch` and `computer` tools): the
  engine pairs each call with its output through `CALL_KINDS`;
- every other kind the API knows (hosted tools' calls and results, MCP traffic, programmatic
  tool calling, ...): one `OpaqueItem`, checked against `_shapes.OPAQUE_ITEM_SHAPES`, carried,
  stored and rendered as it came.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import attrs

from ._shapes import OPAQUE_ITEM_SHAPES
from ._validate import InvalidField

__all__ = [
    "CALL_KINDS",
    "CONTENT_PART_TYPES",
    "INPUT_PART_TYPES",
    "ITEM_TYPES",
    "OUTPUT_PART_TYPES",
    "WIRE_NAME",
    "AgentRef",
    "ApplyPatchCall",
    "ApplyPatchCallOutput",
    "ApplyPatchOperation",
    "CallKind",
    "Compaction",
    "ComputerCall",
    "ComputerCallOutput",
    "ComputerScreenshot",
    "ContentPart",
    "CustomToolCall",
    "CustomToolCallOutput",
    "FunctionCall",
    "FunctionCallOutput",
    "InputFile",
    "InputImage",
    "InputText",
    "Item",
    "ItemReference",
    "ItemStatus",
    "LocalShellAction",
    "LocalShellCall",
    "LocalShellCallOutput",
    "Message",
    "OpaqueItem",
    "OutputText",
    "Reasoning",
    "ReasoningText",
    "Refusal",
    "Role",
    "ShellAction",
    "ShellCall",
    "ShellCallOutput",
    "ShellOutput",
    "SummaryText",
    "ToolCall",
    "ToolOutput",
    "as_listed",
    "call_of",
    "output_of",
]

JSONObject: TypeAlias = dict[str, Any]
Role: TypeAlias = Literal["user", "system", "developer", "assistant"]
ItemStatus: TypeAlias = Literal["in_progress", "completed", "incomplete"]
Phase: TypeAlias = Literal["commentary", "final_answer"]

# attrs field metadata naming the wire key of a field whose name is a Python keyword
# (`async`): the codec renames it in both directions.
WIRE_NAME = "wire_name"
# attrs field metadata: encode the field even when absent (as null), in objects whose absent
# fields are otherwise left out.
KEEP_NULL = "keep_null"


def _wire(name: str) -> dict[str, str]:
    return {WIRE_NAME: name}


# --- content parts ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class InputText:
    type: Literal["input_text"] = "input_text"
    text: str
    prompt_cache_breakpoint: JSONObject | None = None


@attrs.frozen(kw_only=True)
class InputImage:
    """An image given by URL (https or a `data:` URL) or by file id."""

    type: Literal["input_image"] = "input_image"
    detail: Literal["auto", "low", "high", "original"] = "auto"
    image_url: str | None = None
    file_id: str | None = None
    prompt_cache_breakpoint: JSONObject | None = None


@attrs.frozen(kw_only=True)
class InputFile:
    """A file given inline (`file_data`, a `data:` URL), by URL, or by file id."""

    type: Literal["input_file"] = "input_file"
    file_data: str | None = None
    file_id: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: Literal["auto", "low", "high"] | None = None
    prompt_cache_breakpoint: JSONObject | None = None


@attrs.frozen(kw_only=True)
class OutputText:
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[JSONObject] = attrs.field(factory=list)
    logprobs: list[JSONObject] | None = None


@attrs.frozen(kw_only=True)
class Refusal:
    type: Literal["refusal"] = "refusal"
    refusal: str


@attrs.frozen(kw_only=True)
class SummaryText:
    type: Literal["summary_text"] = "summary_text"
    text: str


@attrs.frozen(kw_only=True)
class ReasoningText:
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ContentPart: TypeAlias = InputText | InputImage | InputFile | OutputText | Refusal
INPUT_PART_TYPES: dict[str, type[Any]] = {
    "input_text": InputText,
    "input_image": InputImage,
    "input_file": InputFile,
}
OUTPUT_PART_TYPES: dict[str, type[Any]] = {"output_text": OutputText, "refusal": Refusal}
CONTENT_PART_TYPES: dict[str, type[Any]] = {**INPUT_PART_TYPES, **OUTPUT_PART_TYPES}


# --- conversation items ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class AgentRef:
    """The multi-agent beta's attribution of an item to the agent that produced it (`agent`
    on items and events; the root agent is `/root`). Kept as given on input; rollout's own
    items carry it only on a multi-agent stream (`_multi_agent.py`)."""

    agent_name: str


@attrs.frozen(kw_only=True)
class Message:
    """A message. On input the short form `{"role": ..., "content": "..."}` (no `type`) is
    accepted; user/system/developer content takes input parts, assistant content output parts."""

    type: Literal["message"] = "message"
    role: Role
    content: str | list[ContentPart] = attrs.field()
    id: str | None = None
    status: ItemStatus | None = None
    phase: Phase | None = None
    agent: AgentRef | None = None

    @content.validator
    def _check_parts(self, _attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, str):
            return
        allowed = OUTPUT_PART_TYPES if self.role == "assistant" else INPUT_PART_TYPES
        for i, part in enumerate(value):
            if part.type not in allowed:
                raise InvalidField.bad_value(part.type, list(allowed), f"content[{i}].type")


@attrs.frozen(kw_only=True)
class Reasoning:
    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[SummaryText] = attrs.field(factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


@attrs.frozen(kw_only=True)
class ItemReference:
    """A reference to an item of a stored response, resolved by the engine. On input `type`
    may be left out (`{"id": ...}`)."""

    type: Literal["item_reference"] = "item_reference"
    id: str


@attrs.frozen(kw_only=True)
class Compaction:
    """A compacted context: `encrypted_content` is an opaque, integrity-protected snapshot made
    by the server (`/v1/responses/compact` or automatic compaction). In input it replaces every
    item before it."""

    type: Literal["compaction"] = "compaction"
    encrypted_content: str
    id: str | None = None
    created_by: str | None = None


# --- tool calls and outputs ------------------------------------------------------------------
# `caller` ({"type": "direct"} or {"type": "program", "caller_id"}) is programmatic tool
# calling's bookkeeping: carried as given.


@attrs.frozen(kw_only=True)
class FunctionCall:
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None
    caller: JSONObject | None = None
    async_: bool | None = attrs.field(default=None, metadata=_wire("async"))
    agent: AgentRef | None = None


@attrs.frozen(kw_only=True)
class FunctionCallOutput:
    """The output of a function call. `call_id` is optional in the SDK's type; the engine
    requires it (it names the call answered) and says so with its own error."""

    type: Literal["function_call_output"] = "function_call_output"
    call_id: str | None = None
    output: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    name: str | None = None
    namespace: str | None = None
    caller: JSONObject | None = None
    created_by: str | None = None
    agent: AgentRef | None = None


@attrs.frozen(kw_only=True)
class CustomToolCall:
    """A call of a custom tool: free-form `input` (constrained by the tool's grammar, if any).
    `status` is rollout's addition (the SDK's type has none), present on what it emits."""

    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    name: str
    input: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None
    caller: JSONObject | None = None
    async_: bool | None = attrs.field(default=None, metadata=_wire("async"))
    agent: AgentRef | None = None


@attrs.frozen(kw_only=True)
class CustomToolCallOutput:
    type: Literal["custom_tool_call_output"] = "custom_tool_call_output"
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    caller: JSONObject | None = None
    created_by: str | None = None
    agent: AgentRef | None = None


@attrs.frozen(kw_only=True)
class LocalShellAction:
    type: Literal["exec"] = "exec"
    command: list[str]
    env: dict[str, str] = attrs.field(factory=dict)
    timeout_ms: int | None = None
    user: str | None = None
    working_directory: str | None = None


@attrs.frozen(kw_only=True)
class LocalShellCall:
    type: Literal["local_shell_call"] = "local_shell_call"
    call_id: str
    action: LocalShellAction
    id: str | None = None
    status: ItemStatus | None = None


@attrs.frozen(kw_only=True)
class LocalShellCallOutput:
    """The output of a local shell call: `id` is the call's `call_id` (the SDK's naming)."""

    type: Literal["local_shell_call_output"] = "local_shell_call_output"
    id: str
    output: str
    status: ItemStatus | None = None


@attrs.frozen(kw_only=True)
class ShellAction:
    commands: list[str]
    max_output_length: int | None = None
    timeout_ms: int | None = None


@attrs.frozen(kw_only=True)
class ShellCall:
    type: Literal["shell_call"] = "shell_call"
    call_id: str
    action: ShellAction
    id: str | None = None
    status: ItemStatus | None = None
    environment: JSONObject | None = None
    caller: JSONObject | None = None
    created_by: str | None = None


@attrs.frozen(kw_only=True)
class ShellOutput:
    """One command's result: `outcome` is `{"type": "exit", "exit_code"}` or
    `{"type": "timeout"}`."""

    stdout: str
    stderr: str
    outcome: JSONObject
    created_by: str | None = None


@attrs.frozen(kw_only=True)
class ShellCallOutput:
    type: Literal["shell_call_output"] = "shell_call_output"
    call_id: str
    output: list[ShellOutput]
    id: str | None = None
    status: ItemStatus | None = None
    max_output_length: int | None = None
    caller: JSONObject | None = None
    created_by: str | None = None


@attrs.frozen(kw_only=True)
class ApplyPatchOperation:
    """`create_file` and `update_file` carry a `diff`; `delete_file` does not."""

    type: Literal["create_file", "update_file", "delete_file"]
    path: str
    diff: str | None = attrs.field(default=None)

    @diff.validator
    def _check_diff(self, _attribute: attrs.Attribute[Any], value: str | None) -> None:
        if value is None and self.type != "delete_file":
            raise InvalidField.missing("diff")


@attrs.frozen(kw_only=True)
class ApplyPatchCall:
    type: Literal["apply_patch_call"] = "apply_patch_call"
    call_id: str
    operation: ApplyPatchOperation
    status: Literal["in_progress", "completed"] = "completed"
    id: str | None = None
    caller: JSONObject | None = None
    created_by: str | None = None


@attrs.frozen(kw_only=True)
class ApplyPatchCallOutput:
    type: Literal["apply_patch_call_output"] = "apply_patch_call_output"
    call_id: str
    status: Literal["completed", "failed"]
    output: str | None = None
    id: str | None = None
    caller: JSONObject | None = None
    created_by: str | None = None


@attrs.frozen(kw_only=True)
class ComputerCall:
    """A computer-use call: one `action` or a batch of `actions` (each `{"type": "click",
    ...}`, `"screenshot"`, `"type"`, ...: carried as given)."""

    type: Literal["computer_call"] = "computer_call"
    call_id: str
    pending_safety_checks: list[JSONObject] = attrs.field(factory=list)
    action: JSONObject | None = None
    actions: list[JSONObject] | None = None
    id: str | None = None
    status: ItemStatus | None = None


@attrs.frozen(kw_only=True)
class ComputerScreenshot:
    type: Literal["computer_screenshot"] = "computer_screenshot"
    image_url: str | None = None
    file_id: str | None = None


@attrs.frozen(kw_only=True)
class ComputerCallOutput:
    type: Literal["computer_call_output"] = "computer_call_output"
    call_id: str
    output: ComputerScreenshot
    acknowledged_safety_checks: list[JSONObject] | None = None
    id: str | None = None
    status: ItemStatus | None = None
    created_by: str | None = None


# --- everything else -------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class OpaqueItem:
    """An item of a kind rollout carries without acting on it (see `_shapes`): its `type` and
    its other keys exactly as given (nulls included)."""

    type: str
    data: Mapping[str, Any]

    def __attrs_post_init__(self) -> None:
        if self.type not in OPAQUE_ITEM_SHAPES:
            raise InvalidField.bad_value(self.type, list(OPAQUE_ITEM_SHAPES), "type")

    @property
    def id(self) -> str | None:
        value = self.data.get("id")
        return value if isinstance(value, str) else None

    @property
    def status(self) -> str | None:
        value = self.data.get("status")
        return value if isinstance(value, str) else None


ToolCall: TypeAlias = (
    FunctionCall | CustomToolCall | LocalShellCall | ShellCall | ApplyPatchCall | ComputerCall
)
ToolOutput: TypeAlias = (
    FunctionCallOutput
    | CustomToolCallOutput
    | LocalShellCallOutput
    | ShellCallOutput
    | ApplyPatchCallOutput
    | ComputerCallOutput
)
Item: TypeAlias = (
    Message | Reasoning | ItemReference | Compaction | ToolCall | ToolOutput | OpaqueItem
)
ITEM_TYPES: dict[str, type[Any]] = {
    "message": Message,
    "reasoning": Reasoning,
    "item_reference": ItemReference,
    "compaction": Compaction,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "custom_tool_call": CustomToolCall,
    "custom_tool_call_output": CustomToolCallOutput,
    "local_shell_call": LocalShellCall,
    "local_shell_call_output": LocalShellCallOutput,
    "shell_call": ShellCall,
    "shell_call_output": ShellCallOutput,
    "apply_patch_call": ApplyPatchCall,
    "apply_patch_call_output": ApplyPatchCallOutput,
    "computer_call": ComputerCall,
    "computer_call_output": ComputerCallOutput,
    **dict.fromkeys(OPAQUE_ITEM_SHAPES, OpaqueItem),
}

CallKind: TypeAlias = Literal[
    "function", "custom", "local_shell", "shell", "apply_patch", "computer"
]


@attrs.frozen
class _CallKind:
    kind: CallKind
    call: type[Any]
    output: type[Any]


# Every tool a client runs: its call item and the output item that answers it (by call id).
CALL_KINDS: dict[CallKind, _CallKind] = {
    k.kind: k
    for k in (
        _CallKind("function", FunctionCall, FunctionCallOutput),
        _CallKind("custom", CustomToolCall, CustomToolCallOutput),
        _CallKind("local_shell", LocalShellCall, LocalShellCallOutput),
        _CallKind("shell", ShellCall, ShellCallOutput),
        _CallKind("apply_patch", ApplyPatchCall, ApplyPatchCallOutput),
        _CallKind("computer", ComputerCall, ComputerCallOutput),
    )
}
CALL_TYPES: dict[type[Any], CallKind] = {k.call: k.kind for k in CALL_KINDS.values()}
OUTPUT_TYPES: dict[type[Any], CallKind] = {k.output: k.kind for k in CALL_KINDS.values()}


def as_listed(item: Item) -> Item:
    """An item in the shape the API lists and returns items (the SDK's `ResponseItem`): a
    message's string content as one text part (which renders the same), and `status`
    `completed` where the item has a status and none was given."""
    if isinstance(item, Message) and isinstance(item.content, str):
        part: ContentPart = (
            OutputText(text=item.content)
            if item.role == "assistant"
            else InputText(text=item.content)
        )
        item = attrs.evolve(item, content=[part])
    if isinstance(item, ItemReference | Compaction | OpaqueItem) or item.status is not None:
        return item
    return typing.cast(Item, attrs.evolve(typing.cast(Any, item), status="completed"))


def status_of(item: Item) -> str | None:
    """An item's `status`: None when none was given, or its type has none (an item reference,
    a compaction)."""
    return None if isinstance(item, ItemReference | Compaction) else item.status


def parts_of(item: Item) -> tuple[str, list[ContentPart]] | None:
    """The content parts an item carries and the field that holds them: a message's
    `content`, a function or custom tool output's `output`; None when that is a string, or the
    item carries none."""
    if isinstance(item, Message):
        return ("content", item.content) if isinstance(item.content, list) else None
    if isinstance(item, FunctionCallOutput | CustomToolCallOutput):
        return ("output", item.output) if isinstance(item.output, list) else None
    return None


def call_of(item: Any) -> tuple[str, CallKind, str] | None:
    """(call_id, kind, name) of a tool call item (a built-in tool's call is named by its kind);
    None for any other item."""
    kind = CALL_TYPES.get(type(item))
    if kind is None:
        return None
    name = item.name if kind in ("function", "custom") else kind
    return item.call_id, kind, name


def output_of(item: Any) -> tuple[str | None, CallKind] | None:
    """(call_id, kind) of the call a tool output answers (`local_shell_call_output` names the
    call in `id`; a function output may lack it); None for any other item."""
    kind = OUTPUT_TYPES.get(type(item))
    if kind is None:
        return None
    return (item.id if kind == "local_shell" else item.call_id), kind
