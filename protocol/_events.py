"""Client and server events: one immutable class per wire `type`.

Long because it is a catalogue: one small class per event type, each field bounded where the API
bounds it, and the unions and tables built from them.

Client events are what a peer sends us over WebSocket (`response.create`, `response.steer`,
the rollout extension's `response.append`, and the multi-agent beta's `response.inject`); the
HTTP create body is a `ResponseCreate` without `type`. Server events are the Responses
streaming events, the steering acknowledgements (`_steer.py`), the nested WebSocket `error`,
the flat SSE `error`, the rollout extension's `response.done`, and the beta's inject
acknowledgements (`response.inject.created` / `.failed`). Every WebSocket server event has an
optional `stream_id`: the lane of the response it belongs to (`_lanes.py`), absent on the
default lane; the server connection writes it (`ServerConnection.send`).
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar, Literal, TypeAlias

import attrs

from ._errors import ErrorEvent  # defined beside the error it carries (no import cycle)
from ._items import ContentPart, Item
from ._lanes import stream_id_field
from ._response import ReasoningConfig, Response, ResponseRef, TextConfig
from ._steer import (
    ResponseSteer,
    ResponseSteerAccepted,
    ResponseSteerFailed,
    ResponseSteerPending,
    SteerRef,
    SteerSubmission,
)
from ._tools import NamespaceTool, Tool, ToolChoice, ToolChoiceAllowed, check_tool
from ._validate import InvalidField

__all__ = [
    "CLIENT_EVENT_TYPES",
    "MAX_CLIENT_METADATA_KEY_CHARS",
    "MAX_CLIENT_METADATA_PAIRS",
    "MAX_CLIENT_METADATA_VALUE_CHARS",
    "MAX_INPUT_ITEMS",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_PAIRS",
    "MAX_METADATA_VALUE_CHARS",
    "MAX_PROMPT_CACHE_KEY_CHARS",
    "MAX_SAFETY_IDENTIFIER_CHARS",
    "MAX_TOOLS",
    "MAX_USER_CHARS",
    "SERVER_EVENT_TYPES",
    "TERMINAL_EVENT_TYPES",
    "ClientEvent",
    "ContentPartAdded",
    "ContentPartDone",
    "CustomToolCallInputDelta",
    "CustomToolCallInputDone",
    "ErrorEvent",
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "InjectError",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputTextDelta",
    "OutputTextDone",
    "ResponseAppend",
    "ResponseCompleted",
    "ResponseCreate",
    "ResponseCreated",
    "ResponseDone",
    "ResponseEvent",
    "ResponseFailed",
    "ResponseInProgress",
    "ResponseIncomplete",
    "ResponseInject",
    "ResponseInjectCreated",
    "ResponseInjectFailed",
    "ResponseQueued",
    "ServerEvent",
    "SseErrorEvent",
    "response_of",
]

# OpenAI's documented limits on `metadata`: 16 pairs, 64-char keys, 512-char values.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Bounds on `client_metadata` (not in the SDK; Codex sends installation, window, session,
# thread and turn ids, and a JSON turn-metadata value of ~1 KB that grows with paths): a few
# string pairs, stored with the response. Generous per value, bounded in all (~130 KB).
MAX_CLIENT_METADATA_PAIRS = 32
MAX_CLIENT_METADATA_KEY_CHARS = 128
MAX_CLIENT_METADATA_VALUE_CHARS = 4096
# Identifiers a client sends and rollout stores with the response, bounded like `metadata`:
# `prompt_cache_key` 64 characters (the OpenAI API's own limit: `string_above_max_length`);
# `safety_identifier` 128 (the openai SDK's documented maximum); `user` has no published
# limit: 512, a `metadata` value's.
MAX_PROMPT_CACHE_KEY_CHARS = 64
MAX_SAFETY_IDENTIFIER_CHARS = 128
MAX_USER_CHARS = 512
# Tools one request declares, namespace members included, and entries of
# `tool_choice.allowed_tools`. The OpenAI API refuses more than 128 tools in a chat completion
# (`array_above_max_length`) and publishes no limit for responses; 1,024 leaves room for
# clients with many MCP servers and keeps each tool's per-request work (checking, rendering,
# echoing it: ~35 us for a plain function tool) within ~40 ms of the event loop.
MAX_TOOLS = 1024
# Input items of one request (a create's `input`, an append's or inject's). OpenAI publishes no
# limit. A long agent session resent whole by a stateless client is a few thousand items (a
# 400-turn one with a call and an output per turn: ~1,000-2,000); each new item costs ~20 us
# of validation, rendering and classification on the event loop, so 10,000 bound that to
# ~0.2 s. Conversations continued with `previous_response_id` send only their new items.
MAX_INPUT_ITEMS = 10_000


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


def _pairs_check(pairs: int, key_chars: int, value_chars: int) -> Any:
    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if len(value) > pairs:
            raise InvalidField(
                "object_above_max_properties",
                f"Invalid '{{param}}': too many properties. Expected at most {pairs}, "
                f"but got {len(value)} instead.",
                attribute.name,
            )
        for key, val in value.items():
            if len(key) > key_chars or len(val) > value_chars:
                raise InvalidField(
                    "string_above_max_length",
                    f"Invalid '{{param}}': {attribute.name} keys are limited to {key_chars} "
                    f"characters and values to {value_chars}.",
                    f"{attribute.name}.{key}",
                )

    return check


_check_metadata = _pairs_check(MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS)
_check_client_metadata = _pairs_check(
    MAX_CLIENT_METADATA_PAIRS, MAX_CLIENT_METADATA_KEY_CHARS, MAX_CLIENT_METADATA_VALUE_CHARS
)


def _too_long(param: str, limit: int, got: int, what: str = "array") -> InvalidField:
    """OpenAI's error for an array or string over its maximum length."""
    return InvalidField(
        f"{what}_above_max_length",
        f"Invalid '{{param}}': {what} too long. Expected {'an' if what == 'array' else 'a'} "
        f"{what} with maximum length {limit}, but got {'an' if what == 'array' else 'a'} "
        f"{what} with length {got} instead.",
        param,
    )


def _max_chars(limit: int) -> Any:
    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and len(value) > limit:
            raise _too_long(attribute.name, limit, len(value), "string")

    return check


def _max_items(limit: int) -> Any:
    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, list) and len(value) > limit:
            raise _too_long(attribute.name, limit, len(value))

    return check


def _check_tools(_inst: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    declared = len(value) + sum(len(t.tools) for t in value if isinstance(t, NamespaceTool))
    if declared > MAX_TOOLS:
        raise _too_long("tools", MAX_TOOLS, declared)
    for i, tool in enumerate(value):
        check_tool(tool, f"tools[{i}].")


def _check_tool_choice(_inst: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, ToolChoiceAllowed) and len(value.tools) > MAX_TOOLS:
        raise _too_long("tool_choice.tools", MAX_TOOLS, len(value.tools))


# --- client events ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ResponseCreate:
    """`response.create`: the whole body of `POST /v1/responses` plus WebSocket-only fields.

    Every field of the `openai` SDK's `ResponseCreateParams` and WebSocket `response.create`
    event is accepted (docs/protocol.md's request-field table says what rollout does with each).
    Fields rollout does not act on are kept as opaque JSON so a request round-trips.
    Extensions: `client_metadata` (string pairs Codex sends, stored with the response),
    `presence_penalty` / `frequency_penalty` (passed to chat-completions upstreams), and
    `rollout: true`, which opts in to the rollout extension (one long-lived response across
    tool calls).
    """

    type: Literal["response.create"] = "response.create"
    model: str | None = None
    input: str | list[Item] | None = attrs.field(
        default=None, validator=_max_items(MAX_INPUT_ITEMS)
    )
    instructions: str | None = None
    tools: list[Tool] | None = attrs.field(default=None, validator=_check_tools)
    tool_choice: ToolChoice | None = attrs.field(default=None, validator=_check_tool_choice)
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
    safety_identifier: str | None = attrs.field(
        default=None, validator=_max_chars(MAX_SAFETY_IDENTIFIER_CHARS)
    )
    prompt_cache_key: str | None = attrs.field(
        default=None, validator=_max_chars(MAX_PROMPT_CACHE_KEY_CHARS)
    )
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    user: str | None = attrs.field(default=None, validator=_max_chars(MAX_USER_CHARS))
    stream_id: str | None = None
    context_management: list[dict[str, Any]] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    multi_agent: dict[str, Any] | None = None
    client_metadata: dict[str, str] | None = attrs.field(
        default=None, validator=_check_client_metadata
    )
    rollout: bool | None = None


@attrs.frozen(kw_only=True)
class ResponseAppend:
    """`response.append` (rollout extension): outputs for a suspended rollout's pending calls."""

    type: Literal["response.append"] = "response.append"
    response_id: str
    input: list[Item] = attrs.field(validator=_max_items(MAX_INPUT_ITEMS))


@attrs.frozen(kw_only=True)
class ResponseInject:
    """`response.inject` (multi-agent beta): input items, committed atomically, for a running
    multi-agent response that waits for its client-owned calls' outputs."""

    type: Literal["response.inject"] = "response.inject"
    response_id: str
    input: list[Item] = attrs.field(validator=_max_items(MAX_INPUT_ITEMS))


ClientEvent: TypeAlias = ResponseCreate | ResponseAppend | ResponseSteer | ResponseInject
CLIENT_EVENT_TYPES: dict[str, type[Any]] = {
    "response.create": ResponseCreate,
    "response.append": ResponseAppend,
    "response.steer": ResponseSteer,
    "response.inject": ResponseInject,
}


# --- server events ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ResponseCreated:
    type: Literal["response.created"] = "response.created"
    sequence_number: int
    response: Response
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ResponseInProgress:
    """`response.in_progress`: the response after `response.created`. A rollout resumed after
    a suspension sends it again with a `ResponseRef` (the id and status only: RX-2.3)."""

    type: Literal["response.in_progress"] = "response.in_progress"
    sequence_number: int
    response: Response | ResponseRef
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ResponseQueued:
    type: Literal["response.queued"] = "response.queued"
    sequence_number: int
    response: Response
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ResponseCompleted:
    type: Literal["response.completed"] = "response.completed"
    sequence_number: int
    response: Response
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ResponseIncomplete:
    type: Literal["response.incomplete"] = "response.incomplete"
    sequence_number: int
    response: Response
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ResponseFailed:
    type: Literal["response.failed"] = "response.failed"
    sequence_number: int
    response: Response
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ResponseDone:
    """Rollout extension: the rollout suspended at tool calls (RX-2.2). Only what the client
    does not have yet: `response` names it (`ResponseRef`: id, status `in_progress`),
    `pending_call_ids` the calls whose outputs resume it, and `output_indices` the
    `output_index` of every item of this step (since the rollout started or last resumed),
    which already went out as `response.output_item.done`. Its size depends on the step, not
    on the rollout so far."""

    type: Literal["response.done"] = "response.done"
    sequence_number: int
    response: ResponseRef
    pending_call_ids: list[str]
    output_indices: list[int]
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ResponseInjectCreated:
    """Multi-agent beta: an inject's items were validated and committed to the response
    (numbered in that response's sequence)."""

    type: Literal["response.inject.created"] = "response.inject.created"
    sequence_number: int
    response_id: str
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class InjectError:
    code: Literal["response_already_completed", "response_not_found"]
    message: str


@attrs.frozen(kw_only=True)
class ResponseInjectFailed:
    """Multi-agent beta: an inject's items were not committed; `input` returns them as they
    came, for the client to send in another response."""

    type: Literal["response.inject.failed"] = "response.inject.failed"
    sequence_number: int
    response_id: str
    error: InjectError
    input: list[Item]
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class OutputItemAdded:
    type: Literal["response.output_item.added"] = "response.output_item.added"
    sequence_number: int
    output_index: int
    item: Item
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class OutputItemDone:
    type: Literal["response.output_item.done"] = "response.output_item.done"
    sequence_number: int
    output_index: int
    item: Item
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ContentPartAdded:
    type: Literal["response.content_part.added"] = "response.content_part.added"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class ContentPartDone:
    type: Literal["response.content_part.done"] = "response.content_part.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class OutputTextDelta:
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = attrs.field(factory=list)
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class OutputTextDone:
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = attrs.field(factory=list)
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDelta:
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    sequence_number: int
    item_id: str
    output_index: int
    delta: str
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDone:
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class CustomToolCallInputDelta:
    type: Literal["response.custom_tool_call_input.delta"] = "response.custom_tool_call_input.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class CustomToolCallInputDone:
    type: Literal["response.custom_tool_call_input.done"] = "response.custom_tool_call_input.done"
    sequence_number: int
    item_id: str
    output_index: int
    input: str
    stream_id: str | None = stream_id_field()


@attrs.frozen(kw_only=True)
class SseErrorEvent:
    """The HTTP server-sent-events `error` event, flat: `code`, `message`, `param` on top."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None = None
    message: str
    param: str | None = None

    TRANSPORT: ClassVar[str] = "sse"


# The events that carry the response object (its lifecycle), and the response they carry.
ResponseEvent: TypeAlias = (
    ResponseCreated
    | ResponseInProgress
    | ResponseQueued
    | ResponseCompleted
    | ResponseIncomplete
    | ResponseFailed
    | ResponseDone
)
ServerEvent: TypeAlias = (
    ResponseEvent
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | CustomToolCallInputDelta
    | CustomToolCallInputDone
    | ResponseSteerAccepted
    | ResponseSteerPending
    | ResponseSteerFailed
    | ResponseInjectCreated
    | ResponseInjectFailed
    | ErrorEvent
)


_RESPONSE_EVENTS = typing.get_args(ResponseEvent)


def response_of(event: ServerEvent) -> Response | None:
    """The response a lifecycle event carries; None for item, part, delta and error events,
    and for a rollout's suspension events (they name the response: `ResponseRef`)."""
    if isinstance(event, _RESPONSE_EVENTS) and isinstance(event.response, Response):
        return event.response
    return None


# Typed accessors: what the connection objects' trackers read off any server event.
def named_response_of(event: ServerEvent | SseErrorEvent) -> Response | ResponseRef | None:
    """The response a lifecycle event carries or, for a rollout's suspension, names."""
    return event.response if isinstance(event, _RESPONSE_EVENTS) else None


def previous_id_of(event: ServerEvent | SseErrorEvent) -> str | None:
    """The `previous_response_id` of the response a lifecycle event carries."""
    response = named_response_of(event)
    return response.previous_response_id if isinstance(response, Response) else None


def pending_calls_of(event: ServerEvent | SseErrorEvent) -> list[str] | None:
    """The calls a suspension (`response.done`) waits for; None for any other event."""
    return event.pending_call_ids if isinstance(event, ResponseDone) else None


def steer_of(event: ServerEvent | SseErrorEvent) -> SteerRef | SteerSubmission | None:
    """The steer a steering answer names (its id, the response it steers)."""
    if isinstance(event, ResponseSteerAccepted | ResponseSteerPending | ResponseSteerFailed):
        return event.steer
    return None


def lane_of(event: ServerEvent | SseErrorEvent) -> str | None:
    """The lane (`stream_id`) an event names; None on the default lane and over SSE."""
    return None if isinstance(event, SseErrorEvent) else event.stream_id


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
        CustomToolCallInputDelta,
        CustomToolCallInputDone,
        ResponseSteerAccepted,
        ResponseSteerPending,
        ResponseSteerFailed,
        ResponseInjectCreated,
        ResponseInjectFailed,
        ErrorEvent,
    )
}
# The events that end a response, carrying its final object (the one set: the tracker, the
# engine and the harness use it) ...
RESPONSE_END_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed"})
# ... and what ends a client's wait for a response: one of them, or an `error`.
TERMINAL_EVENT_TYPES = RESPONSE_END_TYPES | {"error"}
