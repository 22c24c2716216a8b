"""`spec/responses.schema.json` and `spec._schema`: the schema is a valid draft 2020-12 document
shipped in the package; it accepts what the official openai SDK's own models produce (every
output item kind, every event kind rollout may emit, on both transports) and rejects
hand-made invalid objects, one per rule, naming the JSON path of the offending value."""

from __future__ import annotations

import copy
import json
import typing
from collections.abc import Callable
from typing import Any

import pydantic
import pytest
from jsonschema import Draft202012Validator
from openai.types.responses import (
    CompactedResponse,
    FunctionTool,
    Response,
    ResponseApplyPatchToolCall,
    ResponseApplyPatchToolCallOutput,
    ResponseCodeInterpreterToolCall,
    ResponseCompactionItem,
    ResponseCompletedEvent,
    ResponseComputerToolCall,
    ResponseComputerToolCallOutputItem,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseCustomToolCall,
    ResponseCustomToolCallInputDeltaEvent,
    ResponseCustomToolCallInputDoneEvent,
    ResponseCustomToolCallOutputItem,
    ResponseErrorEvent,
    ResponseFailedEvent,
    ResponseFileSearchToolCall,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionShellToolCall,
    ResponseFunctionShellToolCallOutput,
    ResponseFunctionToolCall,
    ResponseFunctionToolCallOutputItem,
    ResponseFunctionWebSearch,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningSummaryPartAddedEvent,
    ResponseReasoningSummaryTextDeltaEvent,
    ResponseReasoningTextDeltaEvent,
    ResponseRefusalDoneEvent,
    ResponseShellCallCommandAddedEvent,
    ResponseShellCallCommandDeltaEvent,
    ResponseShellCallCommandDoneEvent,
    ResponseShellCallOutputContentDeltaEvent,
    ResponseShellCallOutputContentDoneEvent,
    ResponseStreamEvent,
    ResponseTextConfig,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseToolSearchCall,
    ResponseToolSearchOutputItem,
    ResponseUsage,
    ResponseWebSearchCallCompletedEvent,
)
from openai.types.responses.response_output_item import (
    ImageGenerationCall,
    LocalShellCall,
    LocalShellCallOutput,
    McpApprovalRequest,
    McpApprovalResponse,
    McpCall,
    McpListTools,
    ResponseOutputItem,
)
from openai.types.responses.responses_server_event import ResponsesServerEvent, ResponseWsError
from openai.types.shared import Reasoning, ResponseFormatText
from rollout.spec._schema import (
    compaction_problems,
    event_problems,
    load_schema,
    response_problems,
)

Json = dict[str, Any]


def dump(model: pydantic.BaseModel) -> Json:
    """An SDK model as the JSON a server sends: the fields that were set, by their wire names."""
    data: Json = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return data


# --- valid objects, built with the SDK's models -----------------------------------------------

MESSAGE = ResponseOutputMessage(
    type="message",
    id="msg_1",
    role="assistant",
    status="completed",
    content=[ResponseOutputText(type="output_text", text="It is sunny.", annotations=[])],
)
CALL = ResponseFunctionToolCall(
    type="function_call",
    id="fc_1",
    call_id="call_1",
    name="get_weather",
    arguments='{"city": "Paris"}',
    status="completed",
)
WEATHER = FunctionTool(
    type="function",
    name="get_weather",
    description="The weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    strict=True,
)
USAGE = ResponseUsage.model_validate(
    {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 27,
    }
)


def response(**changes: Any) -> Json:
    """A completed Response carrying every field Open Responses requires, built with the SDK."""
    fields: dict[str, Any] = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1_700_000_000,
        "completed_at": 1_700_000_001,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "model": "sim",
        "output": [MESSAGE, CALL],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": Reasoning(effort=None, summary=None),
        "store": True,
        "temperature": 1.0,
        "text": ResponseTextConfig(format=ResponseFormatText(type="text"), verbosity="medium"),
        "tool_choice": "auto",
        "tools": [WEATHER],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": USAGE,
        "metadata": {},
        "max_output_tokens": None,
        "max_tool_calls": None,
        "background": False,
        "service_tier": "default",
        "safety_identifier": None,
        "prompt_cache_key": None,
        "top_logprobs": 0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    fields.update(changes)
    wire = dump(Response(**fields))
    for key in ("created_at", "completed_at"):  # the SDK types timestamps as floats
        if isinstance(wire[key], float):
            wire[key] = int(wire[key])
    return wire


def running(**changes: Any) -> Json:
    fields: dict[str, Any] = {"status": "in_progress", "completed_at": None, "usage": None}
    return response(**{**fields, "output": [], **changes})


# Every output item kind the SDK defines (minus programmatic tool calling's), built from its
# model with the required fields and some optional ones (explicit nulls where the SDK allows).
ITEMS: dict[str, tuple[type[pydantic.BaseModel], Json]] = {
    "message": (ResponseOutputMessage, dump(MESSAGE)),
    "function_call": (ResponseFunctionToolCall, dump(CALL)),
    "function_call_output": (
        ResponseFunctionToolCallOutputItem,
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "18C",
         "status": "completed"},
    ),
    "reasoning": (
        ResponseReasoningItem,
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Hm."}],
         "content": [{"type": "reasoning_text", "text": "Think."}], "encrypted_content": "e"},
    ),
    "compaction": (
        ResponseCompactionItem,
        {"type": "compaction", "id": "cmp_1", "encrypted_content": "sealed",
         "created_by": "rollout"},
    ),
    "custom_tool_call": (
        ResponseCustomToolCall,
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_2", "name": "apply",
         "input": "*** Begin Patch", "namespace": None},
    ),
    "custom_tool_call_output": (
        ResponseCustomToolCallOutputItem,
        {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "done"}], "status": "completed"},
    ),
    "shell_call": (
        ResponseFunctionShellToolCall,
        {"type": "shell_call", "id": "sh_1", "call_id": "call_3", "status": "completed",
         "action": {"commands": ["ls -la"], "timeout_ms": None, "max_output_length": None},
         "environment": None},
    ),
    "shell_call_output": (
        ResponseFunctionShellToolCallOutput,
        {"type": "shell_call_output", "id": "sho_1", "call_id": "call_3", "status": "completed",
         "max_output_length": None,
         "output": [{"stdout": "a\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}]},
    ),
    "local_shell_call": (
        LocalShellCall,
        {"type": "local_shell_call", "id": "lsh_1", "call_id": "call_4", "status": "completed",
         "action": {"type": "exec", "command": ["ls"], "env": {}, "user": None}},
    ),
    "local_shell_call_output": (
        LocalShellCallOutput,
        {"type": "local_shell_call_output", "id": "lsho_1", "output": "a\n", "status": None},
    ),
    "apply_patch_call": (
        ResponseApplyPatchToolCall,
        {"type": "apply_patch_call", "id": "ap_1", "call_id": "call_5", "status": "completed",
         "operation": {"type": "update_file", "path": "a.py", "diff": "@@ -1 +1 @@"}},
    ),
    "apply_patch_call_output": (
        ResponseApplyPatchToolCallOutput,
        {"type": "apply_patch_call_output", "id": "apo_1", "call_id": "call_5",
         "status": "failed", "output": None},
    ),
    "computer_call": (
        ResponseComputerToolCall,
        {"type": "computer_call", "id": "cu_1", "call_id": "call_6", "status": "completed",
         "pending_safety_checks": [], "action": {"type": "click", "button": "left", "x": 1,
                                                 "y": 2}},
    ),
    "computer_call_output": (
        ResponseComputerToolCallOutputItem,
        {"type": "computer_call_output", "id": "cuo_1", "call_id": "call_6",
         "status": "completed",
         "output": {"type": "computer_screenshot", "image_url": "https://example.com/s.png"}},
    ),
    "web_search_call": (
        ResponseFunctionWebSearch,
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "weather"}},
    ),
    "file_search_call": (
        ResponseFileSearchToolCall,
        {"type": "file_search_call", "id": "fs_1", "queries": ["q"], "status": "completed",
         "results": None},
    ),
    "image_generation_call": (
        ImageGenerationCall,
        {"type": "image_generation_call", "id": "ig_1", "status": "generating", "result": None},
    ),
    "code_interpreter_call": (
        ResponseCodeInterpreterToolCall,
        {"type": "code_interpreter_call", "id": "ci_1", "container_id": "cntr_1",
         "code": "print(1)", "status": "completed", "outputs": [{"type": "logs", "logs": "1"}]},
    ),
    "tool_search_call": (
        ResponseToolSearchCall,
        {"type": "tool_search_call", "id": "ts_1", "call_id": None, "execution": "server",
         "status": "completed", "arguments": {"query": "weather"}},
    ),
    "tool_search_output": (
        ResponseToolSearchOutputItem,
        {"type": "tool_search_output", "id": "tso_1", "call_id": None, "execution": "server",
         "status": "completed", "tools": [dump(WEATHER)]},
    ),
    "mcp_call": (
        McpCall,
        {"type": "mcp_call", "id": "mcp_1", "name": "read", "server_label": "fs",
         "arguments": "{}", "output": "x", "error": None, "status": "completed"},
    ),
    "mcp_list_tools": (
        McpListTools,
        {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "fs",
         "tools": [{"name": "read", "input_schema": {"type": "object"}}]},
    ),
    "mcp_approval_request": (
        McpApprovalRequest,
        {"type": "mcp_approval_request", "id": "mcpr_1", "name": "read", "server_label": "fs",
         "arguments": "{}"},
    ),
    "mcp_approval_response": (
        McpApprovalResponse,
        {"type": "mcp_approval_response", "id": "mcpa_1", "approval_request_id": "mcpr_1",
         "approve": True, "reason": None},
    ),
}  # fmt: skip


def item(kind: str) -> Json:
    model, data = ITEMS[kind]
    return dump(model.model_validate(data))


def sdk_tags(union: Any) -> set[str]:
    tags: set[str] = set()
    for arg in typing.get_args(union):
        if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel):
            tags.update(typing.get_args(arg.model_fields["type"].annotation))
        else:
            tags |= sdk_tags(arg)
    return tags


# --- the document ------------------------------------------------------------------------------


def test_the_schema_is_a_valid_draft_2020_12_document() -> None:
    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)
    defs = schema["$defs"]
    entries = ("Response", "Usage", "OutputItem", "ContentPart", "SseEvent", "WsEvent",
               "CompactResource", "ResponseDoneEvent", "ResponseResumedEvent", "ResponseRef",
               "WsErrorEvent", "SseErrorEvent")  # fmt: skip
    assert set(entries) <= set(defs)


def test_the_schema_covers_every_sdk_output_item_and_event() -> None:
    defs = load_schema()["$defs"]
    items = set(defs["OutputItem"]["properties"]["type"]["enum"])
    assert sdk_tags(ResponseOutputItem) <= items
    assert set(ITEMS) | {"program", "program_output", "additional_tools"} == items
    events = set(defs["StreamEvent"]["properties"]["type"]["enum"])
    # Audio is not a Responses-over-text concern; `error` has its own definitions.
    expected = {t for t in sdk_tags(ResponseStreamEvent) if not t.startswith("response.audio")}
    assert expected - {"error"} <= events
    # WebSocket-only SDK events rollout does not implement (steering, WS-6.7).
    ws_only = sdk_tags(ResponsesServerEvent) - sdk_tags(ResponseStreamEvent)
    assert ws_only == {"response.steer.accepted", "response.steer.pending", "response.steer.failed"}


# --- valid objects are accepted ----------------------------------------------------------------


def test_a_full_response_is_valid() -> None:
    assert response_problems(response()) == []
    assert response_problems(running()) == []
    incomplete = response(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    assert response_problems(incomplete) == []
    failed = response(
        status="failed",
        completed_at=None,
        usage=None,
        error={"code": "server_error", "message": "boom"},
    )
    assert response_problems(failed) == []
    forced = response(tool_choice={"type": "function", "name": "get_weather"})
    assert response_problems(forced) == []


@pytest.mark.parametrize("reason", ["rollout_timeout", "server_shutdown"])
def test_rollouts_own_incomplete_reasons_are_valid(reason: str) -> None:
    body = response(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    body["incomplete_details"]["reason"] = reason  # not a reason the SDK knows
    assert response_problems(body) == []


@pytest.mark.parametrize("kind", sorted(ITEMS))
def test_every_sdk_output_item_is_valid(kind: str) -> None:
    wire = item(kind)
    for transport in ("sse", "ws"):
        for event_type in ("response.output_item.added", "response.output_item.done"):
            event = {"type": event_type, "sequence_number": 2, "output_index": 0, "item": wire}
            assert event_problems(event, transport=transport) == [], (transport, event_type)
    if kind != "message":  # a message in response.output is the assistant's; this one is
        assert response_problems(response(output=[MESSAGE, wire])) == []


def sdk_events() -> list[pydantic.BaseModel]:
    """One of each event kind a Responses server emits for text, calls and custom tools,
    shells and reasoning, built with the SDK's models."""
    text_part = ResponseOutputText(type="output_text", text="Hi", annotations=[])
    at = {"item_id": "msg_1", "output_index": 0}
    return [
        ResponseCreatedEvent(type="response.created", sequence_number=0, response=running()),
        ResponseInProgressEvent(
            type="response.in_progress", sequence_number=1, response=running()
        ),
        ResponseOutputItemAddedEvent(
            type="response.output_item.added", sequence_number=2, output_index=0,
            item=ResponseOutputMessage(type="message", id="msg_1", role="assistant",
                                       status="in_progress", content=[]),
        ),
        ResponseContentPartAddedEvent(
            type="response.content_part.added", sequence_number=3, content_index=0, **at,
            part=ResponseOutputText(type="output_text", text="", annotations=[]),
        ),
        ResponseTextDeltaEvent(
            type="response.output_text.delta", sequence_number=4, content_index=0, delta="Hi",
            logprobs=[], **at,
        ),
        ResponseTextDoneEvent(
            type="response.output_text.done", sequence_number=5, content_index=0, text="Hi",
            logprobs=[], **at,
        ),
        ResponseContentPartDoneEvent(
            type="response.content_part.done", sequence_number=6, content_index=0,
            part=text_part, **at,
        ),
        ResponseRefusalDoneEvent(
            type="response.refusal.done", sequence_number=7, content_index=1, refusal="No.", **at
        ),
        ResponseOutputItemDoneEvent(
            type="response.output_item.done", sequence_number=8, output_index=0, item=MESSAGE
        ),
        ResponseFunctionCallArgumentsDeltaEvent(
            type="response.function_call_arguments.delta", sequence_number=9, item_id="fc_1",
            output_index=1, delta='{"city"',
        ),
        ResponseFunctionCallArgumentsDoneEvent(
            type="response.function_call_arguments.done", sequence_number=10, item_id="fc_1",
            output_index=1, arguments='{"city": "Paris"}', name="get_weather",
        ),
        ResponseCustomToolCallInputDeltaEvent(
            type="response.custom_tool_call_input.delta", sequence_number=11, item_id="ctc_1",
            output_index=2, delta="*** Begin",
        ),
        ResponseCustomToolCallInputDoneEvent(
            type="response.custom_tool_call_input.done", sequence_number=12, item_id="ctc_1",
            output_index=2, input="*** Begin Patch",
        ),
        ResponseShellCallCommandAddedEvent(
            type="response.shell_call_command.added", sequence_number=13, output_index=3,
            command_index=0, command="",
        ),
        ResponseShellCallCommandDeltaEvent(
            type="response.shell_call_command.delta", sequence_number=14, output_index=3,
            command_index=0, delta="ls",
        ),
        ResponseShellCallCommandDoneEvent(
            type="response.shell_call_command.done", sequence_number=15, output_index=3,
            command_index=0, command="ls",
        ),
        ResponseShellCallOutputContentDeltaEvent.model_validate(
            {"type": "response.shell_call_output_content.delta", "sequence_number": 16,
             "item_id": "sho_1", "output_index": 4, "command_index": 0,
             "delta": {"stdout": "a", "stderr": None}}
        ),
        ResponseShellCallOutputContentDoneEvent.model_validate(
            {"type": "response.shell_call_output_content.done", "sequence_number": 17,
             "item_id": "sho_1", "output_index": 4, "command_index": 0,
             "output": [{"stdout": "a\n", "stderr": "", "outcome": {"type": "timeout"}}]}
        ),
        ResponseReasoningSummaryPartAddedEvent.model_validate(
            {"type": "response.reasoning_summary_part.added", "sequence_number": 18,
             "item_id": "rs_1", "output_index": 5, "summary_index": 0,
             "part": {"type": "summary_text", "text": ""}}
        ),
        ResponseReasoningSummaryTextDeltaEvent(
            type="response.reasoning_summary_text.delta", sequence_number=19, item_id="rs_1",
            output_index=5, summary_index=0, delta="Hm",
        ),
        ResponseReasoningTextDeltaEvent(
            type="response.reasoning_text.delta", sequence_number=20, item_id="rs_1",
            output_index=5, content_index=0, delta="Think",
        ),
        ResponseWebSearchCallCompletedEvent(
            type="response.web_search_call.completed", sequence_number=21, item_id="ws_1",
            output_index=6,
        ),
        ResponseCompletedEvent(
            type="response.completed", sequence_number=22, response=response()
        ),
        ResponseIncompleteEvent(
            type="response.incomplete", sequence_number=22,
            response=response(status="incomplete",
                              incomplete_details={"reason": "max_output_tokens"}),
        ),
        ResponseFailedEvent(
            type="response.failed", sequence_number=22,
            response=response(status="failed", completed_at=None,
                              error={"code": "server_error", "message": "boom"}),
        ),
    ]  # fmt: skip


@pytest.mark.parametrize("transport", ["sse", "ws"])
def test_every_sdk_event_is_valid(transport: Any) -> None:
    for event in sdk_events():
        assert event_problems(dump(event), transport=transport) == [], event.type


def test_the_error_events_of_each_transport_are_valid() -> None:
    flat = ResponseErrorEvent(
        type="error", sequence_number=3, code="server_error", message="boom", param=None
    )
    assert event_problems(dump(flat), transport="sse") == []
    nested = ResponseWsError.model_validate(
        {"type": "error", "status": 400, "sequence_number": None,
         "error": {"type": "invalid_request_error", "code": "unknown_parameter",
                   "message": "Unknown parameter: 'x'.", "param": "x"}}
    )  # fmt: skip
    assert event_problems(dump(nested), transport="ws") == []


def test_the_rollout_extension_events_are_valid_over_websocket() -> None:
    named = {"id": "resp_1", "object": "response", "status": "in_progress"}
    done = {
        "type": "response.done",
        "sequence_number": 7,
        "response": named,
        "pending_call_ids": ["call_1"],
        "output_indices": [3, 4],
    }
    assert event_problems(done, transport="ws") == []
    resumed = {"type": "response.in_progress", "sequence_number": 8, "response": named}
    assert event_problems(resumed, transport="ws") == []
    # Named, not carried, only over WebSocket (the extension) and never when running.
    assert any(p.startswith("$.response") for p in event_problems(resumed, transport="sse"))
    stopped = {**resumed, "response": {**named, "status": "completed"}}
    assert any(p.startswith("$.response.status") for p in event_problems(stopped, transport="ws"))
    timing = {"type": "rollout.timing", "response_id": "resp_1", "stages": {"render": 0.0001}}
    assert event_problems(timing, transport="ws") == []


def test_a_compacted_window_is_valid() -> None:
    compacted = dump(
        CompactedResponse.model_validate(
            {"id": "resp_2", "object": "response.compaction", "created_at": 1_700_000_000,
             "output": [dump(MESSAGE), item("compaction")], "usage": dump(USAGE)}
        )
    )  # fmt: skip
    assert compaction_problems(compacted) == []
    # Open Responses' own example: the user's messages, then the compaction item.
    user = {"id": "msg_0", "type": "message", "status": "completed", "role": "user",
            "content": [{"type": "input_text", "text": "Create a landing page."}]}  # fmt: skip
    compacted["output"] = [user, item("compaction")]
    assert compaction_problems(compacted) == []


# --- invalid objects are rejected, each for its rule --------------------------------------------

Edit = Callable[[Json], None]


def set_path(path: str, value: Any) -> Edit:
    def edit(obj: Json) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def delete(path: str) -> Edit:
    def edit(obj: Json) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[last]

    return edit


RESPONSE_RULES: list[tuple[str, Edit, str]] = [
    ("verbosity is never null", set_path("text.verbosity", None), "$.text.verbosity: null"),
    ("verbosity is an enum", set_path("text.verbosity", "loud"), "$.text.verbosity: \"loud\""),
    ("text.format is required", delete("text.format"), "$.text.format: required"),
    ("a function tool carries strict", delete("tools.0.strict"), "$.tools[0].strict: required"),
    ("... and description", delete("tools.0.description"), "$.tools[0].description: required"),
    ("... and parameters", delete("tools.0.parameters"), "$.tools[0].parameters: required"),
    ("an output message has a status", delete("output.0.status"), "$.output[0].status: required"),
    ("message content is a list", set_path("output.0.content", "Hi"),
     "$.output[0].content: \"Hi\" is not of type array"),
    ("output_text has annotations", delete("output.0.content.0.annotations"),
     "$.output[0].content[0].annotations: required"),
    ("an assistant message holds output parts",
     set_path("output.0.content.0", {"type": "input_text", "text": "x"}),
     "$.output[0].content[0].type: \"input_text\" is not one of"),
    ("a message in response.output is the assistant's", set_path("output.0.role", "user"),
     "$.output[0].role: \"user\" is not \"assistant\""),
    ("a function call has a status", delete("output.1.status"), "$.output[1].status: required"),
    ("usage counts are integers", set_path("usage.input_tokens", "20"),
     "$.usage.input_tokens: \"20\" is not of type integer"),
    ("... not fractions", set_path("usage.output_tokens", 7.5),
     "$.usage.output_tokens: 7.5 is not of type integer"),
    ("usage details are required", delete("usage.input_tokens_details"),
     "$.usage.input_tokens_details: required"),
    ("total is input + output", set_path("usage.total_tokens", 30),
     "$.usage.total_tokens: 30 is not input_tokens + output_tokens = 27"),
    ("cached tokens are input tokens", set_path("usage.input_tokens_details.cached_tokens", 21),
     "$.usage.input_tokens_details.cached_tokens: 21 is more than input_tokens (20)"),
    ("reasoning tokens are output tokens",
     set_path("usage.output_tokens_details.reasoning_tokens", 8),
     "$.usage.output_tokens_details.reasoning_tokens: 8 is more than output_tokens (7)"),
    ("every field is required", delete("temperature"), "$.temperature: required"),
    ("... nullable ones too", delete("previous_response_id"),
     "$.previous_response_id: required"),
    ("temperature is never null", set_path("temperature", None),
     "$.temperature: null is not of type number"),
    ("service_tier is a string", set_path("service_tier", None), "$.service_tier: null"),
    ("reasoning has effort and summary", set_path("reasoning", {}),
     "$.reasoning.effort: required"),
    ("status is an enum", set_path("status", "done"), "$.status: \"done\" is not one of"),
    ("a completed response has completed_at", set_path("completed_at", None),
     "$.completed_at: null is not of type integer"),
    ("... not before created_at", set_path("completed_at", 1_600_000_000),
     "$.completed_at: 1600000000 is before created_at"),
    ("a completed response has no error",
     set_path("error", {"code": "server_error", "message": "x"}), "$.error: {"),
    ("an incomplete response says why", set_path("status", "incomplete"),
     "$.incomplete_details: null is not of type object"),
    ("incomplete reasons are an enum",
     lambda r: r.update(status="incomplete", incomplete_details={"reason": "tired"}),
     "$.incomplete_details.reason: \"tired\" is not one of"),
    ("a failed response carries its error", set_path("status", "failed"),
     "$.error: null is not of type object"),
    ("a running response has no completed_at", set_path("status", "in_progress"),
     "$.completed_at: 1700000001 is not of type null"),
    ("item ids are unique", set_path("output.1.id", "msg_1"),
     "$.output[1].id: 'msg_1' is also the id of item 0"),
    ("call ids are unique", lambda r: r["output"].append({**r["output"][1], "id": "fc_2"}),
     "$.output[2].call_id: 'call_1' is also the call_id of item 1"),
    ("a completed call's arguments are JSON", set_path("output.1.arguments", "{city"),
     "$.output[1].arguments: \"{city\" is not JSON"),
    ("tool_choice names a tool", set_path("tool_choice", {"type": "function", "name": "nope"}),
     "$.tool_choice.name: \"nope\" names no function"),
    ("an unknown item type", set_path("output.1", {"type": "telepathy", "id": "x"}),
     "$.output[1].type: \"telepathy\" is not one of"),
    ("a custom tool call carries its input",
     set_path("output.1", {k: v for k, v in item("custom_tool_call").items() if k != "input"}),
     "$.output[1].input: required"),
    ("a shell call carries its action",
     set_path("output.1", {k: v for k, v in item("shell_call").items() if k != "action"}),
     "$.output[1].action: required"),
    ("apply_patch operations are an enum",
     set_path("output.1", {**item("apply_patch_call"), "operation": {"type": "rename_file",
                                                                       "path": "a"}}),
     "$.output[1].operation.type: \"rename_file\" is not one of"),
    ("object is response", set_path("object", "chat.completion"),
     "$.object: \"chat.completion\" is not \"response\""),
]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "expected"),
    [pytest.param(edit, expected, id=rule) for rule, edit, expected in RESPONSE_RULES],
)
def test_an_invalid_response_is_rejected_naming_its_path(edit: Edit, expected: str) -> None:
    body = copy.deepcopy(response())
    edit(body)
    problems = response_problems(body)
    assert any(p.startswith(expected) for p in problems), problems
    assert all(p.startswith("$") for p in problems), problems
    # The same response inside a lifecycle event is reported under `$.response`.
    if body.get("status") in ("completed", "incomplete", "failed"):
        event = {"type": f"response.{body['status']}", "sequence_number": 9, "response": body}
        event_problems_ = event_problems(event, transport="ws")
        nested = "$.response" + expected[1:]
        assert any(p.startswith(nested) for p in event_problems_), event_problems_


EVENT_RULES: list[tuple[str, str, Json, str]] = [
    ("the flat error is SSE's", "ws",
     {"type": "error", "sequence_number": 3, "code": "x", "message": "m", "param": None},
     "$.status: required"),
    ("the nested error is WebSocket's", "sse",
     {"type": "error", "status": 400, "error": {"type": "t", "code": "x", "message": "m"}},
     "$.sequence_number: required"),
    ("a WebSocket error has a string code", "ws",
     {"type": "error", "status": 400,
      "error": {"type": "invalid_request_error", "code": None, "message": "m", "param": None}},
     "$.error.code: null is not of type string"),
    ("a WebSocket error has an HTTP status", "ws",
     {"type": "error", "status": 42,
      "error": {"type": "invalid_request_error", "code": "x", "message": "m", "param": None}},
     "$.status: 42 fails minimum"),
    ("an SSE error carries code and param", "sse",
     {"type": "error", "sequence_number": 3, "message": "m"}, "$.code: required"),
    ("response.done is WebSocket-only", "sse",
     {"type": "response.done", "sequence_number": 1, "response": {}, "pending_call_ids": []},
     "$.type: \"response.done\" is not one of"),
    ("an unknown event type", "ws", {"type": "response.telepathy", "sequence_number": 0},
     "$.type: \"response.telepathy\" is not one of"),
    ("sequence numbers are integers >= 0", "sse",
     {"type": "response.output_text.delta", "sequence_number": -1, "item_id": "m",
      "output_index": 0, "content_index": 0, "delta": "x"},
     "$.sequence_number: -1 fails minimum"),
    ("deltas name their part", "ws",
     {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "m",
      "output_index": 0, "delta": "x"},
     "$.content_index: required"),
    ("argument deltas are strings", "ws",
     {"type": "response.function_call_arguments.delta", "sequence_number": 1,
      "item_id": "fc_1", "output_index": 0, "delta": {"city": "Paris"}},
     "$.delta: {\"city\": \"Paris\"} is not of type string"),
    ("custom tool input done carries the input", "ws",
     {"type": "response.custom_tool_call_input.done", "sequence_number": 1, "item_id": "c",
      "output_index": 0},
     "$.input: required"),
    ("shell command events carry the command index", "sse",
     {"type": "response.shell_call_command.delta", "sequence_number": 1, "output_index": 0,
      "delta": "ls"},
     "$.command_index: required"),
    ("a done item is no longer in progress", "ws",
     {"type": "response.output_item.done", "sequence_number": 5, "output_index": 0,
      "item": {**dump(CALL), "status": "in_progress"}},
     "$.item.status: \"in_progress\" is not allowed"),
    ("a completed call's arguments are JSON (item done)", "ws",
     {"type": "response.output_item.done", "sequence_number": 5, "output_index": 0,
      "item": {**dump(CALL), "arguments": "{"}},
     "$.item.arguments: \"{\" is not JSON"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("transport", "event", "expected"),
    [pytest.param(t, e, x, id=rule) for rule, t, e, x in EVENT_RULES],
)
def test_an_invalid_event_is_rejected_naming_its_path(
    transport: Any, event: Json, expected: str
) -> None:
    problems = event_problems(event, transport=transport)
    assert any(p.startswith(expected) for p in problems), problems


LIFECYCLE_RULES: list[tuple[str, str, Json, str]] = [
    ("response.completed carries a completed response", "response.completed", running(),
     "$.response.status: \"in_progress\" is not \"completed\""),
    ("response.created carries a running response", "response.created", response(),
     "$.response.status: \"completed\" is not one of"),
    ("response.in_progress is in progress", "response.in_progress",
     running(), ""),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "body", "expected"),
    [pytest.param(k, b, x, id=rule) for rule, k, b, x in LIFECYCLE_RULES],
)
def test_a_lifecycle_event_carries_a_response_of_its_status(
    kind: str, body: Json, expected: str
) -> None:
    problems = event_problems(
        {"type": kind, "sequence_number": 0, "response": body}, transport="sse"
    )
    if not expected:
        assert problems == []
    else:
        assert any(p.startswith(expected) for p in problems), problems


def test_response_done_rules() -> None:
    named = {"id": "resp_1", "object": "response", "status": "in_progress"}
    base = {"type": "response.done", "sequence_number": 7, "response": named}
    full = {**base, "pending_call_ids": ["call_1"], "output_indices": [0]}
    empty = event_problems({**full, "pending_call_ids": []}, transport="ws")
    assert any(p.startswith("$.pending_call_ids: [] fails minItems") for p in empty), empty
    missing = event_problems({**base, "pending_call_ids": ["call_1"]}, transport="ws")
    assert any(p.startswith("$.output_indices: required") for p in missing), missing
    descending = event_problems({**full, "output_indices": [4, 3]}, transport="ws")
    assert descending == ["$.output_indices[1]: 3 does not follow 4 (they ascend)"]
    negative = event_problems({**full, "output_indices": [-1]}, transport="ws")
    assert any(p.startswith("$.output_indices[0]: -1 fails minimum") for p in negative), negative
    ended = event_problems({**full, "response": {**named, "status": "completed"}}, transport="ws")
    assert any(p.startswith('$.response.status: "completed" is not') for p in ended), ended


def test_compaction_rules() -> None:
    passed_through = {
        "id": "resp_2",
        "object": "response.compaction",
        "created_at": 1_700_000_000,
        # an input message passed through as sent: string content, no status
        "output": [{"type": "message", "id": "msg_0", "role": "user", "content": "Hi"},
                   item("compaction")],
        "usage": dump(USAGE),
    }  # fmt: skip
    problems = compaction_problems(passed_through)
    assert "$.output[0].status: required property is missing" in problems
    assert '$.output[0].content: "Hi" is not of type array' in problems
    no_usage = {**passed_through, "output": [item("compaction")]}
    del no_usage["usage"]
    assert compaction_problems(no_usage) == ["$.usage: required property is missing"]
    wrong = {**passed_through, "output": [item("compaction")], "object": "response"}
    assert compaction_problems(wrong) == ['$.object: "response" is not "response.compaction"']


def test_a_transport_must_be_named() -> None:
    with pytest.raises(ValueError, match="transport"):
        event_problems({"type": "response.created"}, transport="http")  # type: ignore[arg-type]


def test_problems_are_bounded_and_quote_values_briefly() -> None:
    problems = response_problems({"id": "x" * 500})
    assert problems[-1].startswith("... and ")
    assert len(problems) == 21
    long = response(instructions=None)
    long["instructions"] = ["x" * 1000]
    (problem,) = response_problems(long)
    assert problem.startswith('$.instructions: ["xxx') and len(problem) < 200
    assert json.loads(json.dumps(problems))  # plain strings


# --- the hook (tests/conftest.py) ---------------------------------------------------------------


@pytest.mark.parametrize("crlf", [False, True])
def test_the_hook_parses_event_streams_split_anywhere(crlf: bool) -> None:
    from tests.conftest import Recorder, SseFrames

    events = [
        {"type": "response.created", "sequence_number": 0},
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": "é\n"},
    ]
    stream = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
    if crlf:
        stream = stream.replace("\n", "\r\n")
    raw = stream.encode()
    for cut in range(len(raw) + 1):
        recorder = Recorder()
        frames = SseFrames(recorder, "POST /v1/responses")
        frames.feed(raw[:cut])
        frames.feed(raw[cut:], final=True)
        got = [(e.sse_name, json.loads(e.text)) for e in recorder.drain()]
        assert got == [(e["type"], e) for e in events], cut


def test_the_hook_checks_with_the_schema_and_the_sdk() -> None:
    from tests.conftest import Emitted, check

    null_verbosity = response()
    null_verbosity["text"]["verbosity"] = None  # the SDK allows it; Open Responses does not
    (violation,) = check(Emitted("response", "JSON body", json.dumps(null_verbosity)))
    assert violation.checker == "schema"
    assert violation.problems == ('$.text.verbosity: null is not one of ["low", "medium", "high"]',)
    delta = {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1",
             "output_index": 0, "content_index": 0, "delta": "x"}  # fmt: skip
    named = "response.output_text.delta"
    (violation,) = check(Emitted("sse", "SSE event", json.dumps(delta), named))
    assert (violation.checker, violation.problems) == ("sdk", ("$.logprobs: Field required",))
    (violation,) = check(Emitted("sse", "SSE event", json.dumps({**delta, "logprobs": []}), "x"))
    assert violation.problems == (
        "$.type: 'response.output_text.delta', but the SSE `event:` field is 'x'",
    )
    timed_out = response(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    timed_out["incomplete_details"]["reason"] = "rollout_timeout"
    named = {"id": "resp_1", "object": "response", "status": "in_progress"}
    done = {"type": "response.done", "sequence_number": 4, "pending_call_ids": ["call_1"],
            "output_indices": [0], "response": named}  # fmt: skip
    resumed = {"type": "response.in_progress", "sequence_number": 5, "response": named}
    for kind, obj in (
        ("response", timed_out),
        ("ws", {"type": "response.incomplete", "sequence_number": 9, "response": timed_out}),
        ("ws", done),
        ("ws", resumed),
        ("ws", {"type": "rollout.timing", "response_id": "resp_1", "stages": {}}),
    ):
        assert check(Emitted(kind, "rollout extension", json.dumps(obj))) == [], obj


async def test_the_hook_sees_what_a_server_sends(schema_hook: Any) -> None:
    import httpx
    import trio

    from tests.server_harness import WEATHER_TOOLS, open_test_server, open_ws

    with trio.fail_after(30):
        # Without the start-up warm-up, whose requests (through the app, in memory) the hook
        # would see too: here it counts what clients are sent.
        async with (
            open_test_server(warm_up=False) as url,
            httpx.AsyncClient(base_url=url) as client,
        ):
            await client.post("/responses", json={"model": "sim", "input": "Hi", "stream": True})
            body = {"model": "sim", "input": "Hi", "tools": WEATHER_TOOLS}
            created = (await client.post("/responses", json=body)).json()
            await client.get(f"/responses/{created['id']}")
            await client.post("/responses/compact", json={"model": "sim", "input": "Hi"})
            await client.post("/responses", json={"model": "sim", "frobnicate": 1})  # 400
            async with open_ws(url) as ws:
                await ws.create(model="sim", input="Hi", store=False)
                await ws.send({"type": "response.create", "model": "sim", "frobnicate": 1})
                await ws.error()
    seen = {(e.kind, e.where.split(" of ")[0]) for e in schema_hook.snapshot()}
    assert {
        ("sse", "SSE event 'response.created'"),
        ("sse", "SSE event 'response.completed'"),
        ("response", "JSON body"),
        ("compaction", "JSON body"),
        ("ws", "WebSocket event on /v1/responses"),
    } <= seen
    where = [e.where for e in schema_hook.snapshot()]
    assert where.count("JSON body of POST /v1/responses") == 1  # not the 400
    assert any(w.startswith("JSON body of GET /v1/responses/resp_") for w in where)
    assert any('"type":"error"' in e.text for e in schema_hook.snapshot() if e.kind == "ws")
