"""Wire types for conversation items, content parts and tools.

Every class is one wire `type`, immutable, keyword-only. `None` always means "absent": the
codec drops explicit JSON `null`s before structuring, so a field is either required, optional
with a `None` default, or has a concrete default. Field order follows the OpenAI SDK's types.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import attrs

from ._validate import InvalidField

__all__ = [
    "CONTENT_PART_TYPES",
    "INPUT_PART_TYPES",
    "ITEM_TYPES",
    "OUTPUT_PART_TYPES",
    "TOOL_TYPES",
    "Compaction",
    "ContentPart",
    "FunctionCall",
    "FunctionCallOutput",
    "FunctionTool",
    "InputFile",
    "InputImage",
    "InputText",
    "Item",
    "ItemReference",
    "ItemStatus",
    "Message",
    "NamespaceTool",
    "OutputText",
    "Reasoning",
    "ReasoningText",
    "Refusal",
    "Role",
    "SummaryText",
    "Tool",
    "ToolChoice",
    "ToolChoiceFunction",
    "ToolChoiceMode",
]

JSONObject: TypeAlias = dict[str, Any]
Role: TypeAlias = Literal["user", "system", "developer", "assistant"]
ItemStatus: TypeAlias = Literal["in_progress", "completed", "incomplete"]
Phase: TypeAlias = Literal["commentary", "final_answer"]


# --- content parts ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class InputText:
    type: Literal["input_text"] = "input_text"
    text: str


@attrs.frozen(kw_only=True)
class InputImage:
    """An image given by URL (https or a `data:` URL) or by file id."""

    type: Literal["input_image"] = "input_image"
    detail: Literal["auto", "low", "high"] = "auto"
    image_url: str | None = None
    file_id: str | None = None


@attrs.frozen(kw_only=True)
class InputFile:
    """A file given inline (`file_data`, a `data:` URL), by URL, or by file id."""

    type: Literal["input_file"] = "input_file"
    file_data: str | None = None
    file_id: str | None = None
    file_url: str | None = None
    filename: str | None = None


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


# --- items -----------------------------------------------------------------------------------


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

    @content.validator
    def _check_parts(self, _attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, str):
            return
        allowed = OUTPUT_PART_TYPES if self.role == "assistant" else INPUT_PART_TYPES
        for i, part in enumerate(value):
            if part.type not in allowed:
                raise InvalidField.bad_value(part.type, list(allowed), f"content[{i}].type")


@attrs.frozen(kw_only=True)
class FunctionCall:
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCallOutput:
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None


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
    """A reference to an item of a stored response, resolved by the engine."""

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


Item: TypeAlias = (
    Message | FunctionCall | FunctionCallOutput | Reasoning | ItemReference | Compaction
)
ITEM_TYPES: dict[str, type[Any]] = {
    "message": Message,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "reasoning": Reasoning,
    "item_reference": ItemReference,
    "compaction": Compaction,
}


# --- tools -----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FunctionTool:
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class NamespaceTool:
    """A named group of function tools; calls to its members carry `namespace`."""

    type: Literal["namespace"] = "namespace"
    name: str
    description: str
    tools: list[FunctionTool]


Tool: TypeAlias = FunctionTool | NamespaceTool
TOOL_TYPES: dict[str, type[Any]] = {"function": FunctionTool, "namespace": NamespaceTool}

ToolChoiceMode: TypeAlias = Literal["none", "auto", "required"]


@attrs.frozen(kw_only=True)
class ToolChoiceFunction:
    type: Literal["function"] = "function"
    name: str


ToolChoice: TypeAlias = ToolChoiceMode | ToolChoiceFunction
