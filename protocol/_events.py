"""Client and server events: one immutable class per wire `type`.

Client events are what a peer sends us over WebSocket (`response.create`, and the rollout
extension's `response.append`); the HTTP create body is a `ResponseCreate` without `type`.
Server events are the Responses streaming events, the nested WebSocket `error`, the flat SSE
`error`, and the rollout extension's `response.done`.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Literal, TypeAlias

import attrs

from ._errors import ErrorBody
from ._items import ContentPart, Item, NamespaceTool, Tool, ToolChoice
from ._response import ReasoningConfig, Response, TextConfig
from ._validate import InvalidField

__all__ = [
    "CLIENT_EVENT_TYPES",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_PAIRS",
    "MAX_METADATA_VALUE_CHARS",
    "SERVER_EVENT_TYPES",
    "TERMINAL_EVENT_TYPES",
    "ClientEvent",
    "ContentPartAdded",
    "ContentPartDone",
    "ErrorEvent",
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputTextDelta",
    "OutputTextDone",
    "ResponseAppend",
    "ResponseCompleted",
    "ResponseCreate",
    "ResponseCreated",
    "ResponseDone",
    "ResponseFailed",
    "ResponseInProgress",
    "ResponseIncomplete",
    "ResponseQueued",
    "ServerEvent",
    "SseErrorEvent",
    "check_tool",
]

# OpenAI's documented limits on `metadata`: 16 pairs, 64-char keys, 512-char values.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Function names as the OpenAI API accepts them.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# --- validators (run at construction; the codec turns their errors into `param` paths) ----------


def _range(lo: float | None = None, hi: float | None = None, *, integer: bool) -> Any:
    kind = "integer" if integer else "decimal"

    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if lo is not None and value < lo:
            raise InvalidField(
                f"{kind}_below_min_value",
                f"Invalid '{{param}}': {kind} below minimum value. "
                f"Expected a value >= {lo:g}, but got {value!r} instead.",
                attribute.name,
            )
        if hi is not None and value > hi:
            raise InvalidField(
                f"{kind}_above_max_value",
                f"Invalid '{{param}}': {kind} above maximum value. "
                f"Expected a value <= {hi:g}, but got {value!r} instead.",
                attribute.name,
            )

    return check


def _check_metadata(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if len(value) > MAX_METADATA_PAIRS:
        raise InvalidField(
            "object_above_max_properties",
            f"Invalid '{{param}}': too many properties. Expected at most {MAX_METADATA_PAIRS}, "
            f"but got {len(value)} instead.",
            attribute.name,
        )
    for key, val in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(val) > MAX_METADATA_VALUE_CHARS:
            raise InvalidField(
                "string_above_max_length",
                f"Invalid '{{param}}': metadata keys are limited to {MAX_METADATA_KEY_CHARS} "
                f"characters and values to {MAX_METADATA_VALUE_CHARS}.",
                f"{attribute.name}.{key}",
            )


def check_tool(tool: Tool, where: str = "") -> None:
    """Structural checks of one tool definition (names, parameter schema shape)."""
    if isinstance(tool, NamespaceTool):
        _check_name(tool.name, f"{where}name")
        for j, member in enumerate(tool.tools):
            check_tool(member, f"{where}tools[{j}].")
        return
    _check_name(tool.name, f"{where}name")
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


def _check_tools(_inst: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    for i, tool in enumerate(value):
        check_tool(tool, f"tools[{i}].")


# --- client events ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ResponseCreate:
    """`response.create`: the whole body of `POST /v1/responses` plus WebSocket-only fields.

    Fields rollout does not act on are kept as opaque JSON so a request round-trips. `stream`,
    `stream_options` and `background` are accepted and ignored over WebSocket. `rollout: true`
    opts in to the rollout extension (one long-lived response across tool calls).
    """

    type: Literal["response.create"] = "response.create"
    model: str | None = None
    input: str | list[Item] | None = None
    instructions: str | None = None
    tools: list[Tool] | None = attrs.field(default=None, validator=_check_tools)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = attrs.field(default=None, validator=_check_metadata)
    temperature: float | None = attrs.field(default=None, validator=_range(0, 2, integer=False))
    top_p: float | None = attrs.field(default=None, validator=_range(0, 1, integer=False))
    presence_penalty: float | None = attrs.field(
        default=None, validator=_range(-2, 2, integer=False)
    )
    frequency_penalty: float | None = attrs.field(
        default=None, validator=_range(-2, 2, integer=False)
    )
    max_output_tokens: int | None = attrs.field(default=None, validator=_range(1, integer=True))
    max_tool_calls: int | None = attrs.field(default=None, validator=_range(1, integer=True))
    top_logprobs: int | None = attrs.field(default=None, validator=_range(0, 20, integer=True))
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    generate: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    user: str | None = None
    stream_id: str | None = None
    context_management: list[dict[str, Any]] | None = None
    conversation: Any = None
    prompt: Any = None
    moderation: Any = None
    access_programs: Any = None
    image: Any = None
    background_options: Any = None
    rollout: bool | None = None


@attrs.frozen(kw_only=True)
class ResponseAppend:
    """`response.append` (rollout extension): outputs for a suspended rollout's pending calls."""

    type: Literal["response.append"] = "response.append"
    response_id: str
    input: list[Item]


ClientEvent: TypeAlias = ResponseCreate | ResponseAppend
CLIENT_EVENT_TYPES: dict[str, type[Any]] = {
    "response.create": ResponseCreate,
    "response.append": ResponseAppend,
}


# --- server events ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ResponseCreated:
    type: Literal["response.created"] = "response.created"
    sequence_number: int
    response: Response


@attrs.frozen(kw_only=True)
class ResponseInProgress:
    type: Literal["response.in_progress"] = "response.in_progress"
    sequence_number: int
    response: Response


@attrs.frozen(kw_only=True)
class ResponseQueued:
    type: Literal["response.queued"] = "response.queued"
    sequence_number: int
    response: Response


@attrs.frozen(kw_only=True)
class ResponseCompleted:
    type: Literal["response.completed"] = "response.completed"
    sequence_number: int
    response: Response


@attrs.frozen(kw_only=True)
class ResponseIncomplete:
    type: Literal["response.incomplete"] = "response.incomplete"
    sequence_number: int
    response: Response


@attrs.frozen(kw_only=True)
class ResponseFailed:
    type: Literal["response.failed"] = "response.failed"
    sequence_number: int
    response: Response


@attrs.frozen(kw_only=True)
class ResponseDone:
    """Rollout extension: the rollout suspended at tool calls. `response` is the response so
    far (status `in_progress`); `pending_call_ids` names the calls whose outputs resume it."""

    type: Literal["response.done"] = "response.done"
    sequence_number: int
    response: Response
    pending_call_ids: list[str]


@attrs.frozen(kw_only=True)
class OutputItemAdded:
    type: Literal["response.output_item.added"] = "response.output_item.added"
    sequence_number: int
    output_index: int
    item: Item


@attrs.frozen(kw_only=True)
class OutputItemDone:
    type: Literal["response.output_item.done"] = "response.output_item.done"
    sequence_number: int
    output_index: int
    item: Item


@attrs.frozen(kw_only=True)
class ContentPartAdded:
    type: Literal["response.content_part.added"] = "response.content_part.added"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


@attrs.frozen(kw_only=True)
class ContentPartDone:
    type: Literal["response.content_part.done"] = "response.content_part.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


@attrs.frozen(kw_only=True)
class OutputTextDelta:
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class OutputTextDone:
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDelta:
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDone:
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


@attrs.frozen(kw_only=True)
class ErrorEvent:
    """The WebSocket `error` event, nested: `{"type": "error", "status", "error": {...}}`."""

    type: Literal["error"] = "error"
    status: int | None = None
    sequence_number: int | None = None
    error: ErrorBody


@attrs.frozen(kw_only=True)
class SseErrorEvent:
    """The HTTP server-sent-events `error` event, flat: `code`, `message`, `param` on top."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None = None
    message: str
    param: str | None = None

    TRANSPORT: ClassVar[str] = "sse"


ServerEvent: TypeAlias = (
    ResponseCreated
    | ResponseInProgress
    | ResponseQueued
    | ResponseCompleted
    | ResponseIncomplete
    | ResponseFailed
    | ResponseDone
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | ErrorEvent
)


# The WebSocket union; the SSE `error` shape shares the tag and is decoded separately.
def wire_type(cls: type[Any]) -> str:
    """The wire `type` tag of an event or item class."""
    return str(attrs.fields(cls).type.default)


SERVER_EVENT_TYPES: dict[str, type[Any]] = {
    wire_type(cls): cls
    for cls in (
        ResponseCreated,
        ResponseInProgress,
        ResponseQueued,
        ResponseCompleted,
        ResponseIncomplete,
        ResponseFailed,
        ResponseDone,
        OutputItemAdded,
        OutputItemDone,
        ContentPartAdded,
        ContentPartDone,
        OutputTextDelta,
        OutputTextDone,
        FunctionCallArgumentsDelta,
        FunctionCallArgumentsDone,
        ErrorEvent,
    )
}
TERMINAL_EVENT_TYPES = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "error"}
)
