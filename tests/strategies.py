"""Hypothesis strategies for rollout's wire types (the `protocol` package).

Two families:

- *wire* strategies (`items()`, `client_events()`, `server_events()`, ...) cover everything
  the codec must round-trip, including values the official SDK would not accept (a `user`
  message inside a response's `output`, a free-form `service_tier`). `None` always means
  "absent", as in the codec.
- *SDK-valid* strategies (`sdk_responses()`, `stream_scripts()`) stay inside what the
  official `openai` SDK's pydantic types accept, for oracle tests.

Also: arbitrary JSON values (`json_values`), msgpack-only values (`msgpack_values`) and
`mutations()` of a valid wire value, for receive-path fuzzing; `run_script()` to play a
`Script` on a `ResponseStream`; and `check_error_event()`, the oracle for the error a
`RemoteProtocolError` sends back.
"""

from __future__ import annotations

import json
import string
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import msgpack
import pydantic
from hypothesis import strategies as st
from openai.types.responses.responses_server_event import ResponsesServerEvent
from rollout import protocol as p
from rollout.protocol._shapes import BUILTIN_TOOL_SHAPES, NESTED_TOOL_SHAPES, OPAQUE_ITEM_SHAPES

T = TypeVar("T")
Strategy = st.SearchStrategy

# --- scalars ---------------------------------------------------------------------------------

#: Unicode text, empty included (hypothesis' default alphabet: no lone surrogates).
texts = st.text(max_size=24)
#: Identifiers: what ids, call ids and names look like.
ids = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=16)
#: Function names as the API accepts them (`^[a-zA-Z0-9_-]{1,64}$`).
tool_names = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=64)
#: Counters that fit in msgpack's 64-bit integers.
counts = st.integers(min_value=0, max_value=2**31)
statuses = st.sampled_from(["in_progress", "completed", "incomplete"])


def opt(strategy: Strategy[T]) -> Strategy[T | None]:
    """An optional field: absent (`None`) or a value."""
    return st.none() | strategy


def floats(lo: float, hi: float) -> Strategy[float]:
    """Finite floats in [lo, hi]."""
    return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False)


# --- JSON values -----------------------------------------------------------------------------

json_scalars: Strategy[Any] = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
#: Any JSON value that both JSON and msgpack carry exactly.
json_values: Strategy[Any] = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=12,
)
json_objects: Strategy[dict[str, Any]] = st.dictionaries(texts, json_values, max_size=4)

#: Values msgpack can carry and JSON cannot: bytes (as values and keys), extension types,
#: non-finite floats. (Lone surrogates cannot occur: msgpack strings are UTF-8.)
msgpack_scalars: Strategy[Any] = (
    json_scalars
    | st.binary(max_size=8)
    | st.floats()
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4))
)
msgpack_values: Strategy[Any] = st.recursive(
    msgpack_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(texts | st.binary(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)


# --- content parts ---------------------------------------------------------------------------

cache_breakpoints = opt(
    st.fixed_dictionaries({"mode": st.just("explicit")}, optional={"ttl": st.just("30m")})
)
input_texts = st.builds(p.InputText, text=texts, prompt_cache_breakpoint=cache_breakpoints)
input_images = st.builds(
    p.InputImage,
    detail=st.sampled_from(["auto", "low", "high", "original"]),
    image_url=opt(texts),
    file_id=opt(ids),
    prompt_cache_breakpoint=cache_breakpoints,
)
input_files = st.builds(
    p.InputFile,
    file_data=opt(texts),
    file_id=opt(ids),
    file_url=opt(texts),
    filename=opt(texts),
    detail=opt(st.sampled_from(["auto", "low", "high"])),
    prompt_cache_breakpoint=cache_breakpoints,
)
output_texts = st.builds(
    p.OutputText,
    text=texts,
    annotations=st.lists(json_objects, max_size=2),
    logprobs=opt(st.lists(json_objects, max_size=2)),
)
refusals = st.builds(p.Refusal, refusal=texts)
summary_texts = st.builds(p.SummaryText, text=texts)
reasoning_texts = st.builds(p.ReasoningText, text=texts)

input_parts = st.one_of(input_texts, input_images, input_files)
output_parts = st.one_of(output_texts, refusals)
CONTENT_PART_STRATEGIES: dict[str, Strategy[Any]] = {
    "input_text": input_texts,
    "input_image": input_images,
    "input_file": input_files,
    "output_text": output_texts,
    "refusal": refusals,
}
content_parts = st.one_of(*CONTENT_PART_STRATEGIES.values())


# --- items -----------------------------------------------------------------------------------


def _messages(roles: list[str], parts: Strategy[Any]) -> Strategy[p.Message]:
    return st.builds(
        p.Message,
        role=st.sampled_from(roles),
        content=texts | st.lists(parts, max_size=3),
        id=opt(ids),
        status=opt(statuses),
        phase=opt(st.sampled_from(["commentary", "final_answer"])),
    )


input_messages = _messages(["user", "system", "developer"], input_parts)
assistant_messages = _messages(["assistant"], output_parts)
messages = input_messages | assistant_messages
callers = opt(
    st.just({"type": "direct"})
    | st.fixed_dictionaries({"type": st.just("program"), "caller_id": ids})
)
function_calls = st.builds(
    p.FunctionCall,
    call_id=ids,
    name=tool_names,
    arguments=texts,
    id=opt(ids),
    status=opt(statuses),
    namespace=opt(tool_names),
    caller=callers,
    async_=opt(st.booleans()),
)
function_call_outputs = st.builds(
    p.FunctionCallOutput,
    call_id=ids,
    output=texts | st.lists(content_parts, max_size=3),
    id=opt(ids),
    status=opt(statuses),
    name=opt(tool_names),
    namespace=opt(tool_names),
    caller=callers,
)
tool_outputs = texts | st.lists(input_parts, max_size=3)
custom_tool_calls = st.builds(
    p.CustomToolCall,
    call_id=ids,
    name=tool_names,
    input=texts,
    id=opt(ids),
    status=opt(statuses),
    namespace=opt(tool_names),
    caller=callers,
    async_=opt(st.booleans()),
)
custom_tool_call_outputs = st.builds(
    p.CustomToolCallOutput,
    call_id=ids,
    output=tool_outputs,
    id=opt(ids),
    status=opt(statuses),
    caller=callers,
)
local_shell_calls = st.builds(
    p.LocalShellCall,
    call_id=ids,
    action=st.builds(
        p.LocalShellAction,
        command=st.lists(texts, min_size=1, max_size=3),
        env=st.dictionaries(texts, texts, max_size=2),
        timeout_ms=opt(counts),
        user=opt(texts),
        working_directory=opt(texts),
    ),
    id=opt(ids),
    status=opt(statuses),
)
local_shell_call_outputs = st.builds(
    p.LocalShellCallOutput, id=ids, output=texts, status=opt(statuses)
)
shell_calls = st.builds(
    p.ShellCall,
    call_id=ids,
    action=st.builds(
        p.ShellAction,
        commands=st.lists(texts, min_size=1, max_size=3),
        max_output_length=opt(counts),
        timeout_ms=opt(counts),
    ),
    id=opt(ids),
    status=opt(statuses),
    environment=opt(st.just({"type": "local"})),
    caller=callers,
)
shell_outcomes = st.just({"type": "timeout"}) | st.fixed_dictionaries(
    {"type": st.just("exit"), "exit_code": st.integers(-128, 255)}
)
shell_call_outputs = st.builds(
    p.ShellCallOutput,
    call_id=ids,
    output=st.lists(
        st.builds(p.ShellOutput, stdout=texts, stderr=texts, outcome=shell_outcomes),
        max_size=2,
    ),
    id=opt(ids),
    status=opt(statuses),
    max_output_length=opt(counts),
    caller=callers,
)
patch_operations = st.builds(
    p.ApplyPatchOperation,
    type=st.sampled_from(["create_file", "update_file"]),
    path=texts,
    diff=texts,
) | st.builds(p.ApplyPatchOperation, type=st.just("delete_file"), path=texts)
apply_patch_calls = st.builds(
    p.ApplyPatchCall,
    call_id=ids,
    operation=patch_operations,
    status=st.sampled_from(["in_progress", "completed"]),
    id=opt(ids),
    caller=callers,
)
apply_patch_call_outputs = st.builds(
    p.ApplyPatchCallOutput,
    call_id=ids,
    status=st.sampled_from(["completed", "failed"]),
    output=opt(texts),
    id=opt(ids),
    caller=callers,
)
computer_actions = st.sampled_from(
    [{"type": "screenshot"}, {"type": "wait"}, {"type": "click", "button": "left", "x": 1, "y": 2}]
)
computer_calls = st.builds(
    p.ComputerCall,
    call_id=ids,
    pending_safety_checks=st.lists(st.fixed_dictionaries({"id": ids}), max_size=1),
    action=opt(computer_actions),
    actions=opt(st.lists(computer_actions, max_size=2)),
    id=opt(ids),
    status=opt(statuses),
)
computer_call_outputs = st.builds(
    p.ComputerCallOutput,
    call_id=ids,
    output=st.builds(p.ComputerScreenshot, image_url=opt(texts), file_id=opt(ids)),
    acknowledged_safety_checks=opt(st.lists(st.fixed_dictionaries({"id": ids}), max_size=1)),
    id=opt(ids),
    status=opt(statuses),
)

_KIND_STRATEGIES: dict[str, Strategy[Any]] = {
    "string": texts,
    "integer": counts,
    "number": floats(-1e6, 1e6),
    "boolean": st.booleans(),
    "object": json_objects,
    "array": st.lists(json_values, max_size=3),
    "null": st.none(),
    "any": json_values,
}


def _kind_strategy(kind: str) -> Strategy[Any]:
    head, _, literals = kind.partition("=")
    if not literals:
        return _KIND_STRATEGIES[head]
    values = st.sampled_from(literals.split(","))
    return st.lists(values, max_size=2) if head == "array" else values


def shaped(shape: Any, nested: Any = None) -> Strategy[dict[str, Any]]:
    """Objects of a `protocol._shapes` shape: every required key, any optional ones; a field
    with tagged variants (`nested`) gets an object of one of them."""
    required: dict[str, Strategy[Any]] = {}
    optional: dict[str, Strategy[Any]] = {}
    for key, kinds in shape.items():
        name = key.rstrip("?")
        variants = (nested or {}).get(name)
        choices = [
            _tagged(variants) if variants and k == "object" else _kind_strategy(k)
            for k in kinds.split("|")
        ]
        (optional if key.endswith("?") else required)[name] = st.one_of(*choices)
    return st.fixed_dictionaries(required, optional=optional)


def _tagged(variants: Any) -> Strategy[dict[str, Any]]:
    return st.one_of(
        *(
            shaped(shape).map(lambda data, tag=tag: {"type": tag, **data})
            for tag, shape in variants.items()
        )
    )


OPAQUE_ITEM_STRATEGIES: dict[str, Strategy[Any]] = {
    kind: shaped(shape).map(lambda data, kind=kind: p.OpaqueItem(type=kind, data=data))
    for kind, shape in OPAQUE_ITEM_SHAPES.items()
}
reasonings = st.builds(
    p.Reasoning,
    id=opt(ids),
    summary=st.lists(summary_texts, max_size=3),
    content=opt(st.lists(reasoning_texts, max_size=3)),
    encrypted_content=opt(texts),
    status=opt(statuses),
)
item_references = st.builds(p.ItemReference, id=ids)
compactions = st.builds(p.Compaction, encrypted_content=texts, id=opt(ids), created_by=opt(texts))

ITEM_STRATEGIES: dict[str, Strategy[Any]] = {
    "message": messages,
    "function_call": function_calls,
    "function_call_output": function_call_outputs,
    "custom_tool_call": custom_tool_calls,
    "custom_tool_call_output": custom_tool_call_outputs,
    "local_shell_call": local_shell_calls,
    "local_shell_call_output": local_shell_call_outputs,
    "shell_call": shell_calls,
    "shell_call_output": shell_call_outputs,
    "apply_patch_call": apply_patch_calls,
    "apply_patch_call_output": apply_patch_call_outputs,
    "computer_call": computer_calls,
    "computer_call_output": computer_call_outputs,
    "reasoning": reasonings,
    "item_reference": item_references,
    "compaction": compactions,
    **OPAQUE_ITEM_STRATEGIES,
}
items: Strategy[p.Item] = st.one_of(*ITEM_STRATEGIES.values())


# --- tools and request configuration ---------------------------------------------------------

#: Parameter schemas the codec accepts: `type: "object"` or no `type` at all.
parameter_schemas: Strategy[dict[str, Any]] = st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(ids, json_objects, max_size=3)}
) | json_objects.filter(lambda d: "type" not in d)
allowed_callers = opt(st.lists(st.sampled_from(["direct", "programmatic"]), max_size=2))
function_tools = st.builds(
    p.FunctionTool,
    name=tool_names,
    description=opt(texts),
    parameters=opt(parameter_schemas),
    strict=opt(st.booleans()),
    defer_loading=opt(st.booleans()),
    allowed_callers=allowed_callers,
    output_schema=opt(json_objects),
    async_=opt(st.booleans()),
)
custom_formats = st.builds(p.CustomToolFormat, type=st.just("text")) | st.builds(
    p.CustomToolFormat,
    type=st.just("grammar"),
    syntax=st.sampled_from(["lark", "regex"]),
    definition=texts,
)
custom_tools = st.builds(
    p.CustomTool,
    name=tool_names,
    description=opt(texts),
    format=opt(custom_formats),
    defer_loading=opt(st.booleans()),
    allowed_callers=allowed_callers,
    async_=opt(st.booleans()),
)
namespace_tools = st.builds(
    p.NamespaceTool,
    name=tool_names,
    description=texts,
    tools=st.lists(function_tools | custom_tools, max_size=3),
)
BUILTIN_TOOL_STRATEGIES: dict[str, Strategy[Any]] = {
    kind: shaped(shape, NESTED_TOOL_SHAPES.get(kind)).map(
        lambda data, kind=kind: p.BuiltinTool(type=kind, settings=data)
    )
    for kind, shape in BUILTIN_TOOL_SHAPES.items()
}
TOOL_STRATEGIES: dict[str, Strategy[Any]] = {
    "function": function_tools,
    "custom": custom_tools,
    "namespace": namespace_tools,
    **BUILTIN_TOOL_STRATEGIES,
}
tools: Strategy[p.Tool] = st.one_of(*TOOL_STRATEGIES.values())
tool_choices: Strategy[p.ToolChoice] = (
    st.sampled_from(["none", "auto", "required"])
    | st.builds(p.ToolChoiceFunction, name=tool_names)
    | st.builds(p.ToolChoiceCustom, name=tool_names)
    | st.builds(
        p.ToolChoiceAllowed,
        mode=st.sampled_from(["auto", "required"]),
        tools=st.lists(json_objects, max_size=2),
    )
    | st.builds(p.ToolChoiceMcp, server_label=ids, name=opt(ids))
    | st.builds(p.ToolChoiceBuiltin, type=st.sampled_from(["shell", "apply_patch", "computer"]))
)
metadatas = st.dictionaries(st.text(max_size=64), st.text(max_size=40), max_size=16)
text_configs = st.builds(
    p.TextConfig,
    format=st.just({"type": "text"}) | json_objects,
    verbosity=st.sampled_from(["low", "medium", "high"]),
)
reasoning_configs = st.builds(
    p.ReasoningConfig,
    effort=opt(st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max"])),
    summary=opt(st.sampled_from(["auto", "concise", "detailed"])),
    generate_summary=opt(st.sampled_from(["auto", "concise", "detailed"])),
    context=opt(st.sampled_from(["auto", "current_turn", "all_turns"])),
    mode=opt(texts),
)


# --- client events ---------------------------------------------------------------------------

response_creates = st.builds(
    p.ResponseCreate,
    model=opt(texts),
    input=opt(texts | st.lists(items, max_size=4)),
    instructions=opt(texts),
    tools=opt(st.lists(tools, max_size=3)),
    tool_choice=opt(tool_choices),
    parallel_tool_calls=opt(st.booleans()),
    previous_response_id=opt(ids),
    store=opt(st.booleans()),
    metadata=opt(metadatas),
    temperature=opt(floats(0, 2)),
    top_p=opt(floats(0, 1)),
    presence_penalty=opt(floats(-2, 2)),
    frequency_penalty=opt(floats(-2, 2)),
    max_output_tokens=opt(st.integers(1, 2**31)),
    max_tool_calls=opt(st.integers(1, 2**31)),
    top_logprobs=opt(st.integers(0, 20)),
    text=opt(text_configs),
    reasoning=opt(reasoning_configs),
    truncation=opt(st.sampled_from(["auto", "disabled"])),
    include=opt(st.lists(texts, max_size=3)),
    generate=opt(st.booleans()),
    stream=opt(st.booleans()),
    stream_options=opt(json_objects),
    background=opt(st.booleans()),
    service_tier=opt(texts),
    safety_identifier=opt(texts),
    prompt_cache_key=opt(texts),
    prompt_cache_retention=opt(st.sampled_from(["in_memory", "24h"])),
    prompt_cache_options=opt(json_objects),
    user=opt(texts),
    stream_id=opt(ids),
    context_management=opt(st.lists(json_objects, max_size=2)),
    conversation=opt(ids | st.fixed_dictionaries({"id": ids})),
    prompt=opt(json_objects),
    moderation=opt(json_objects),
    access_programs=opt(json_objects),
    image=opt(json_objects),
    background_options=opt(json_objects),
    multi_agent=opt(json_objects),
    client_metadata=opt(st.dictionaries(st.text(max_size=64), st.text(max_size=64), max_size=8)),
    rollout=opt(st.booleans()),
)
response_appends = st.builds(p.ResponseAppend, response_id=ids, input=st.lists(items, max_size=4))
# Steering input as JSON (`ResponseSteer.input` is carried as sent): a string, or user messages.
steer_parts = st.one_of(
    st.builds(lambda t: {"type": "input_text", "text": t}, texts),
    st.builds(lambda u: {"type": "input_image", "image_url": f"https://example.com/{u}.png"}, ids),
)
steer_messages = st.builds(
    lambda content, typed: {"role": "user", "content": content, **typed},
    texts | st.lists(steer_parts, min_size=1, max_size=2),
    st.sampled_from([{}, {"type": "message"}]),
)
steer_inputs = texts | st.lists(steer_messages, min_size=1, max_size=3)
response_steers = st.builds(p.ResponseSteer, previous_response_id=ids, input=steer_inputs)
response_injects = st.builds(p.ResponseInject, response_id=ids, input=st.lists(items, max_size=4))
CLIENT_EVENT_STRATEGIES: dict[str, Strategy[Any]] = {
    "response.create": response_creates,
    "response.append": response_appends,
    "response.steer": response_steers,
    "response.inject": response_injects,
}
client_events: Strategy[p.ClientEvent] = (
    response_creates | response_appends | response_steers | response_injects
)


# --- responses -------------------------------------------------------------------------------

usages = st.builds(
    p.Usage,
    input_tokens=counts,
    input_tokens_details=st.builds(
        p.InputTokensDetails, cached_tokens=counts, cache_write_tokens=counts
    ),
    output_tokens=counts,
    output_tokens_details=st.builds(p.OutputTokensDetails, reasoning_tokens=counts),
    total_tokens=counts,
)
response_errors = st.builds(p.ResponseError, code=texts, message=texts)


def literal_values(tp: Any) -> list[Any]:
    """The values of a `Literal` type, or of a union of `Literal`s (and `None`)."""
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    return [v for arg in typing.get_args(tp) for v in literal_values(arg)]


INCOMPLETE_REASONS = literal_values(typing.get_type_hints(p.IncompleteDetails)["reason"])
incomplete_details = st.builds(p.IncompleteDetails, reason=opt(st.sampled_from(INCOMPLETE_REASONS)))
RESPONSE_STATUSES = ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]

responses = st.builds(
    p.Response,
    id=ids,
    created_at=counts,
    completed_at=opt(counts),
    status=st.sampled_from(RESPONSE_STATUSES),
    error=opt(response_errors),
    incomplete_details=opt(incomplete_details),
    instructions=opt(texts),
    model=texts,
    output=st.lists(items, max_size=3),
    parallel_tool_calls=st.booleans(),
    previous_response_id=opt(ids),
    reasoning=reasoning_configs,
    store=st.booleans(),
    temperature=st.floats(allow_nan=False, allow_infinity=False),
    text=text_configs,
    tool_choice=tool_choices,
    tools=st.lists(tools, max_size=2),
    top_p=st.floats(allow_nan=False, allow_infinity=False),
    truncation=st.sampled_from(["auto", "disabled"]),
    usage=opt(usages),
    metadata=metadatas,
    max_output_tokens=opt(counts),
    max_tool_calls=opt(counts),
    background=st.booleans(),
    service_tier=texts,
    safety_identifier=opt(texts),
    prompt_cache_key=opt(texts),
    top_logprobs=counts,
    presence_penalty=floats(-2, 2),
    frequency_penalty=floats(-2, 2),
    user=opt(texts),
    prompt_cache_retention=opt(st.sampled_from(["in_memory", "24h"])),
    client_metadata=opt(st.dictionaries(texts, texts, max_size=3)),
)

# Values from the SDK's own Literal types, so `openai.types.responses.Response` accepts them.
SDK_SERVICE_TIERS = ["auto", "default", "flex", "scale", "priority"]
SDK_EFFORTS = ["none", "minimal", "low", "medium", "high"]
SDK_SUMMARIES = ["auto", "concise", "detailed"]
SDK_ERROR_CODES = ["server_error", "rate_limit_exceeded", "invalid_prompt", "invalid_image"]
SDK_INCOMPLETE_REASONS = ["max_output_tokens", "content_filter"]

sdk_function_tools = st.builds(
    p.FunctionTool,
    name=tool_names,
    description=opt(texts),
    parameters=opt(parameter_schemas),
    strict=opt(st.booleans()),
)
sdk_namespace_tools = st.builds(
    p.NamespaceTool,
    name=tool_names,
    description=texts,
    tools=st.lists(sdk_function_tools, min_size=1, max_size=2),
)
sdk_reasonings = st.builds(
    p.Reasoning,
    id=ids,
    summary=st.lists(summary_texts, max_size=2),
    content=opt(st.lists(reasoning_texts, max_size=2)),
    encrypted_content=opt(texts),
    status=opt(statuses),
)
sdk_url_citations = st.fixed_dictionaries(
    {
        "type": st.just("url_citation"),
        "url": texts,
        "title": texts,
        "start_index": counts,
        "end_index": counts,
    }
)
sdk_output_texts = st.builds(
    p.OutputText, text=texts, annotations=st.lists(sdk_url_citations, max_size=2)
)
sdk_assistant_messages = st.builds(
    p.Message,
    role=st.just("assistant"),
    content=st.lists(sdk_output_texts | refusals, max_size=3),
    id=ids,
    status=statuses,
    phase=opt(st.sampled_from(["commentary", "final_answer"])),
)
#: Items the SDK's `ResponseOutputItem` union accepts.
sdk_output_items = st.one_of(sdk_assistant_messages, function_calls, sdk_reasonings)


def sdk_responses(*, output: Strategy[list[p.Item]] | None = None) -> Strategy[p.Response]:
    """Responses the SDK's `Response` model accepts (what a server may put on the wire)."""
    return st.builds(
        p.Response,
        id=ids.map(lambda s: "resp_" + s),
        created_at=counts,
        completed_at=opt(counts),
        status=st.sampled_from(RESPONSE_STATUSES),
        instructions=opt(texts),
        model=texts,
        output=output if output is not None else st.lists(sdk_output_items, max_size=3),
        parallel_tool_calls=st.booleans(),
        previous_response_id=opt(ids),
        reasoning=st.builds(
            p.ReasoningConfig,
            effort=opt(st.sampled_from(SDK_EFFORTS)),
            summary=opt(st.sampled_from(SDK_SUMMARIES)),
        ),
        store=st.booleans(),
        temperature=floats(0, 2),
        text=st.builds(p.TextConfig, verbosity=st.sampled_from(["low", "medium", "high"])),
        tool_choice=tool_choices,
        tools=st.lists(sdk_function_tools | sdk_namespace_tools, max_size=2),
        top_p=floats(0, 1),
        truncation=st.sampled_from(["auto", "disabled"]),
        metadata=metadatas,
        max_output_tokens=opt(st.integers(1, 2**31)),
        max_tool_calls=opt(st.integers(1, 100)),
        background=st.booleans(),
        service_tier=st.sampled_from(SDK_SERVICE_TIERS),
        safety_identifier=opt(texts),
        prompt_cache_key=opt(texts),
        top_logprobs=st.integers(0, 20),
        presence_penalty=floats(-2, 2),
        frequency_penalty=floats(-2, 2),
        user=opt(texts),
    )


# --- server events ---------------------------------------------------------------------------

error_bodies = st.builds(p.ErrorBody, type=texts, code=opt(texts), message=texts, param=opt(texts))


response_refs = st.builds(p.ResponseRef, id=ids)


def _lifecycle(cls: type[Any]) -> Strategy[Any]:
    return st.builds(cls, sequence_number=counts, response=responses)


def _item_event(cls: type[Any]) -> Strategy[Any]:
    return st.builds(cls, sequence_number=counts, output_index=counts, item=items)


def _part_event(cls: type[Any]) -> Strategy[Any]:
    return st.builds(
        cls,
        sequence_number=counts,
        item_id=ids,
        output_index=counts,
        content_index=counts,
        part=content_parts,
    )


steer_refs = st.builds(p.SteerRef, id=ids, previous_response_id=ids)
required_inputs = st.one_of(
    st.builds(
        p.RequiredInput,
        type=st.just("function_call_output"),
        call_id=ids,
        name=ids,
    ),
    st.builds(
        p.RequiredInput,
        type=st.sampled_from(["custom_tool_call_output", "shell_call_output"]),
        call_id=ids,
    ),
    st.builds(
        p.RequiredInput,
        type=st.just("tool_search_output"),
        call_id=ids,
        execution=st.just("client"),
    ),
    st.builds(p.RequiredInput, type=st.just("mcp_approval_response"), approval_request_id=ids),
)
SERVER_EVENT_STRATEGIES: dict[str, Strategy[Any]] = {
    "response.created": _lifecycle(p.ResponseCreated),
    "response.in_progress": st.builds(
        p.ResponseInProgress,
        sequence_number=counts,
        response=st.one_of(responses, response_refs),  # a rollout's resume names its response
    ),
    "response.queued": _lifecycle(p.ResponseQueued),
    "response.completed": _lifecycle(p.ResponseCompleted),
    "response.incomplete": _lifecycle(p.ResponseIncomplete),
    "response.failed": _lifecycle(p.ResponseFailed),
    "response.done": st.builds(
        p.ResponseDone,
        sequence_number=counts,
        response=response_refs,
        pending_call_ids=st.lists(ids, max_size=3),
        output_indices=st.lists(counts, max_size=3),
    ),
    "response.output_item.added": _item_event(p.OutputItemAdded),
    "response.output_item.done": _item_event(p.OutputItemDone),
    "response.content_part.added": _part_event(p.ContentPartAdded),
    "response.content_part.done": _part_event(p.ContentPartDone),
    "response.custom_tool_call_input.delta": st.builds(
        p.CustomToolCallInputDelta,
        sequence_number=counts,
        item_id=ids,
        output_index=counts,
        delta=texts,
    ),
    "response.custom_tool_call_input.done": st.builds(
        p.CustomToolCallInputDone,
        sequence_number=counts,
        item_id=ids,
        output_index=counts,
        input=texts,
    ),
    "response.output_text.delta": st.builds(
        p.OutputTextDelta,
        sequence_number=counts,
        item_id=ids,
        output_index=counts,
        content_index=counts,
        delta=texts,
        logprobs=st.lists(json_objects, max_size=2),
    ),
    "response.output_text.done": st.builds(
        p.OutputTextDone,
        sequence_number=counts,
        item_id=ids,
        output_index=counts,
        content_index=counts,
        text=texts,
        logprobs=st.lists(json_objects, max_size=2),
    ),
    "response.function_call_arguments.delta": st.builds(
        p.FunctionCallArgumentsDelta,
        sequence_number=counts,
        item_id=ids,
        output_index=counts,
        delta=texts,
    ),
    "response.function_call_arguments.done": st.builds(
        p.FunctionCallArgumentsDone,
        sequence_number=counts,
        item_id=ids,
        output_index=counts,
        arguments=texts,
    ),
    "response.inject.created": st.builds(
        p.ResponseInjectCreated, sequence_number=counts, response_id=ids, stream_id=opt(ids)
    ),
    "response.inject.failed": st.builds(
        p.ResponseInjectFailed,
        sequence_number=counts,
        response_id=ids,
        error=st.builds(
            p.InjectError,
            code=st.sampled_from(["response_already_completed", "response_not_found"]),
            message=texts,
        ),
        input=st.lists(items, max_size=3),
        stream_id=opt(ids),
    ),
    "error": st.builds(
        p.ErrorEvent,
        status=opt(st.integers(100, 599)),
        sequence_number=opt(counts),
        error=error_bodies,
    ),
    "response.steer.accepted": st.builds(
        p.ResponseSteerAccepted, sequence_number=counts, steer=steer_refs, stream_id=opt(ids)
    ),
    "response.steer.pending": st.builds(
        p.ResponseSteerPending,
        sequence_number=counts,
        reason=st.sampled_from(["waiting_for_required_input"]) | texts,
        required_input=st.lists(required_inputs, max_size=3),
        steer=steer_refs,
        stream_id=opt(ids),
    ),
    "response.steer.failed": st.builds(
        p.ResponseSteerFailed,
        sequence_number=counts,
        error=st.builds(p.SteerError, code=texts, message=texts),
        steer=st.builds(
            p.SteerSubmission, input=steer_inputs, previous_response_id=ids, id=opt(ids)
        ),
        stream_id=opt(ids),
    ),
}
# Any WebSocket server event may be on a named lane (`stream_id`).
lane_ids = st.text(alphabet=string.ascii_letters + string.digits + "_.-", min_size=1, max_size=256)


def _laned(events: Strategy[Any]) -> Strategy[Any]:
    return st.tuples(events, opt(lane_ids)).map(lambda t: attrs.evolve(t[0], stream_id=t[1]))


SERVER_EVENT_STRATEGIES = {kind: _laned(events) for kind, events in SERVER_EVENT_STRATEGIES.items()}
server_events: Strategy[p.ServerEvent] = st.one_of(*SERVER_EVENT_STRATEGIES.values())
sse_error_events = st.builds(
    p.SseErrorEvent, sequence_number=counts, code=opt(texts), message=texts, param=opt(texts)
)


# --- builder scripts (SDK-valid streams) -----------------------------------------------------


@attrs.frozen
class Text:
    """An assistant message streamed as `deltas`."""

    item_id: str
    deltas: list[str]


@attrs.frozen
class Call:
    """A function call whose arguments are streamed as `deltas`."""

    item_id: str
    call_id: str
    name: str
    deltas: list[str]
    namespace: str | None = None


@attrs.frozen
class Suspend:
    """Rollout extension: `response.done` for the calls since the last suspension, then
    resume."""


@attrs.frozen
class Script:
    """What a sampler does to a `ResponseStream`: `steps`, then `ending`.

    `ending` is `"complete"`, `"incomplete"` or `"failed"`; `open` is an item left streaming
    when the ending comes (only for incomplete and failed), `reason`/`error_code` say why.
    """

    steps: list[Text | Call | Suspend]
    ending: str
    open: Text | Call | None = None
    reason: str = "max_output_tokens"
    error_code: str = "server_error"


deltas = st.lists(texts, min_size=1, max_size=5)
#: Argument deltas that join to valid JSON split at arbitrary points.
json_argument_deltas = st.builds(
    lambda value, cuts: _split(json.dumps(value, ensure_ascii=False), cuts),
    json_objects,
    st.lists(st.integers(0, 200), max_size=4),
)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces, last = [], 0
    for point in points:
        pieces.append(text[last:point])
        last = point
    pieces.append(text[last:])
    return pieces


@st.composite
def stream_scripts(draw: Callable[[Strategy[Any]], Any], *, max_steps: int = 5) -> Script:
    """A legal sequence of builder actions: text, one or several calls, mixes, suspensions,
    and each kind of ending."""
    n = draw(st.integers(0, max_steps))
    suffix = draw(ids)
    steps: list[Text | Call | Suspend] = []

    def step(i: int) -> Text | Call:
        if draw(st.booleans()):
            return Text(item_id=f"msg_{i}_{suffix}", deltas=draw(deltas))
        return Call(
            item_id=f"fc_{i}_{suffix}",
            call_id=f"call_{i}_{suffix}",
            name=draw(tool_names),
            deltas=draw(json_argument_deltas | deltas),
            namespace=draw(opt(tool_names)),
        )

    for i in range(n):
        item = step(i)
        steps.append(item)
        if isinstance(item, Call) and draw(st.booleans()):
            steps.append(Suspend())
    ending = draw(st.sampled_from(["complete", "incomplete", "failed"]))
    open_item = None
    if ending != "complete" and draw(st.booleans()):
        open_item = step(n)
    return Script(
        steps=steps,
        ending=ending,
        open=open_item,
        reason=draw(st.sampled_from(SDK_INCOMPLETE_REASONS)),
        error_code=draw(st.sampled_from(SDK_ERROR_CODES)),
    )


# --- mutations (almost-valid peer input) -----------------------------------------------------


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replace(value: Any, path: tuple[Any, ...], fn: Callable[[Any], Any]) -> Any:
    if not path:
        return fn(value)
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, fn)}
    copy = list(value)
    copy[head] = _replace(copy[head], rest, fn)
    return copy


@st.composite
def mutations(draw: Callable[[Strategy[Any]], Any], base: Strategy[Any]) -> Any:
    """A wire value (`to_wire` of a draw from `base`) with one to three mutations: a key
    deleted, a value replaced by an arbitrary JSON value (often of the wrong type), an
    unknown key inserted, or a list element dropped."""
    value = p.to_wire(draw(base))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(value)))
        kind = draw(st.sampled_from(["delete", "retype", "insert", "null"]))

        def mutate(node: Any, kind: str = kind) -> Any:
            if kind == "insert" and isinstance(node, dict):
                return {**node, draw(texts): draw(json_values)}
            if kind == "delete" and isinstance(node, dict) and node:
                key = draw(st.sampled_from(sorted(node)))
                return {k: v for k, v in node.items() if k != key}
            if kind == "delete" and isinstance(node, list) and node:
                i = draw(st.integers(0, len(node) - 1))
                return node[:i] + node[i + 1 :]
            if kind == "null":
                return None
            return draw(json_values)

        value = _replace(value, path, mutate)
    return value


# --- driving a builder -----------------------------------------------------------------------

SCRIPT_USAGE = p.Usage.of(input_tokens=11, output_tokens=7, cached_tokens=3)
SCRIPT_COMPLETED_AT = 1_700_000_000


def run_script(stream: p.ResponseStream, script: Script) -> list[Any]:
    """Play `script` on `stream` from `start()` to its ending; all the events, in order."""
    events: list[Any] = list(stream.start())
    pending: list[str] = []

    def play(step: Text | Call, *, close: bool) -> None:
        if isinstance(step, Text):
            events.extend(stream.begin_message(step.item_id))
            events.extend(stream.text_delta(d) for d in step.deltas)
            if close:
                events.extend(stream.end_message())
            return
        events.extend(
            stream.begin_call(step.item_id, step.call_id, step.name, namespace=step.namespace)
        )
        events.extend(stream.arguments_delta(d) for d in step.deltas)
        if close:
            events.extend(stream.end_call())
            pending.append(step.call_id)

    for step in script.steps:
        if isinstance(step, Suspend):
            events.append(stream.suspend(pending))
            pending.clear()
            events.append(stream.resume())
        else:
            play(step, close=True)
    if script.open is not None:
        play(script.open, close=False)
    if script.ending == "complete":
        events.append(stream.complete(usage=SCRIPT_USAGE, completed_at=SCRIPT_COMPLETED_AT))
    elif script.ending == "incomplete":
        events.extend(
            stream.incomplete(
                reason=script.reason, usage=SCRIPT_USAGE, completed_at=SCRIPT_COMPLETED_AT
            )
        )
    else:
        error = p.ResponseError(code=script.error_code, message="the sampler failed")
        events.append(stream.fail(error=error, usage=SCRIPT_USAGE))
    return events


# --- the error oracle ------------------------------------------------------------------------

WS_SERVER_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponsesServerEvent)


def check_error_event(exc: p.RemoteProtocolError) -> dict[str, Any]:
    """The error goes back as an OpenAI-shaped nested `error` event the SDK accepts; returns
    its wire form."""
    event = exc.error_event()
    wire = json.loads(p.encode_json(event).encode("utf-8"))  # sendable as UTF-8 text
    assert wire["type"] == "error"
    assert isinstance(wire["status"], int) and 400 <= wire["status"] < 500
    error = wire["error"]
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] is None or isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert (error["code"], error["param"]) == (exc.code, exc.param)
    model = WS_SERVER_EVENT.validate_python(wire)
    assert type(model).__name__ == "ResponseWsError"
    assert p.decode_server_event(p.encode_json(event)) == event
    return wire
