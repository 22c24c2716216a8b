"""The WebSocket checks of the event stream (WS-3): order, sequence numbers, deltas that add
up, function-call events and ids, the Response fields, usage, nothing after a terminal event."""

from __future__ import annotations

from ._analysis import (
    call_items,
    call_problems,
    order_problems,
    sequence_problems,
    shape,
    text_problems,
)
from ._client import CheckFailed, describe_value
from ._context import CheckSet, Context
from ._requests import text_body, tool_body
from ._steps import (
    completed,
    fail_on,
    first_event,
    forced_calls,
    response_field_problems,
    response_of,
)

__all__ = ["checks"]

checks = CheckSet()

# === WS-3: event stream ======================================================================


@checks("ws.event_order")
async def ws_event_order(ctx: Context) -> None:
    async with ctx.ws() as ws:
        text, _ = await completed(ctx, ws, text_body(ctx), "a text response")
        calls, _ = await completed(ctx, ws, tool_body(ctx), "a tool-call response")
    fail_on(order_problems(text), "text response: ")
    fail_on(order_problems(calls), "tool-call response: ")


@checks("ws.sequence_numbers")
async def ws_sequence_numbers(ctx: Context) -> None:
    async with ctx.ws() as ws:
        text, _ = await completed(ctx, ws, text_body(ctx), "a text response")
        calls, _ = await completed(ctx, ws, tool_body(ctx), "a tool-call response")
    fail_on(sequence_problems(text), "text response: ")
    fail_on(sequence_problems(calls), "tool-call response: ")


@checks("ws.text_consistency")
async def ws_text_consistency(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, _ = await completed(ctx, ws, text_body(ctx), "a text response")
    fail_on(text_problems(events))


@checks("ws.function_call_events")
async def ws_function_call_events(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, response = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
    added = [
        e
        for e in events
        if e["type"] == "response.output_item.added"
        and isinstance(e.get("item"), dict)
        and e["item"].get("type") == "function_call"
    ]
    if not added:
        raise CheckFailed(
            "no output_item.added of a function_call (tool_choice named get_weather); output "
            f"{shape(response['output'])}"
        )
    for event in added:
        item = event["item"]
        for key in ("id", "call_id", "name"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise CheckFailed(
                    f"the added function_call has {key} {describe_value(item.get(key))}"
                )
        if item["name"] != "get_weather":
            raise CheckFailed(f"the forced call names {item['name']!r}, expected 'get_weather'")
        if item.get("arguments") not in ("", None):
            raise CheckFailed(
                f"the added function_call has arguments {describe_value(item.get('arguments'))}, "
                "expected ''"
            )
        mine = [e for e in events if e.get("item_id") == item["id"]]
        kinds = [e["type"] for e in mine]
        if "response.function_call_arguments.done" not in kinds:
            raise CheckFailed(
                f"call {item['id']}: no function_call_arguments.done (saw {sorted(set(kinds))})"
            )
        if any(k.startswith("response.content_part") for k in kinds):
            raise CheckFailed(f"call {item['id']}: a function call streamed content-part events")
        done = [
            e
            for e in events
            if e["type"] == "response.output_item.done"
            and e.get("output_index") == event.get("output_index")
        ]
        if not done or done[0]["item"].get("status") != "completed":
            status = done[0]["item"].get("status") if done else None
            raise CheckFailed(
                f"call {item['id']}: output_item.done status {describe_value(status)}, expected "
                "'completed'"
            )
    fail_on(order_problems(events))


@checks("ws.function_call_consistency")
async def ws_function_call_consistency(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, _ = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
    fail_on(call_problems(events, name="get_weather"))


@checks("ws.item_id_call_id")
async def ws_item_id_call_id(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, response = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
    calls = forced_calls(response)
    for call in calls:
        if call.get("id") == call.get("call_id"):
            raise CheckFailed(f"a function_call's id equals its call_id {call.get('id')!r}")
    ids = {c.get("id") for c in calls}
    call_ids = {c.get("call_id") for c in calls}
    for event in events:
        if "item_id" in event and event["type"].startswith("response.function_call_arguments"):
            if event["item_id"] in call_ids:
                raise CheckFailed(
                    f"{event['type']} has item_id {event['item_id']!r}, the call_id; expected the "
                    "item id"
                )
            if event["item_id"] not in ids:
                raise CheckFailed(
                    f"{event['type']} has item_id {event['item_id']!r}, expected one of "
                    f"{sorted(map(str, ids))}"
                )


@checks("ws.response_fields")
async def ws_response_fields(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, response = await completed(ctx, ws, text_body(ctx), "a text response")
    created = response_of(events[0])
    fail_on(response_field_problems(created, status="in_progress"), "response.created: ")
    fail_on(response_field_problems(response, status="completed"), "response.completed: ")
    if created.get("id") != response.get("id"):
        raise CheckFailed(
            f"response.created names {created.get('id')!r}, response.completed "
            f"{response.get('id')!r}"
        )
    if created.get("output"):
        raise CheckFailed("response.created carries output items, expected an empty output")


@checks("ws.usage")
async def ws_usage(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, response = await completed(ctx, ws, text_body(ctx), "a text response")
    usage = response.get("usage")
    if not isinstance(usage, dict):
        raise CheckFailed(f"usage is {describe_value(usage)}, expected an object")
    problems = []
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        if not isinstance(usage.get(key), int) or usage[key] < 0:
            problems.append(
                f"usage.{key} is {describe_value(usage.get(key))}, expected an integer >= 0"
            )
    for path in (
        ("input_tokens_details", "cached_tokens"),
        ("output_tokens_details", "reasoning_tokens"),
    ):
        details = usage.get(path[0])
        value = details.get(path[1]) if isinstance(details, dict) else None
        if not isinstance(value, int) or value < 0:
            problems.append(
                f"usage.{path[0]}.{path[1]} is {describe_value(value)}, expected an integer >= 0"
            )
    fail_on(problems)
    if usage["input_tokens"] < 1 or usage["output_tokens"] < 1:
        raise CheckFailed(
            f"usage counts {usage['input_tokens']} input and {usage['output_tokens']} output "
            "tokens for a non-empty prompt and answer"
        )
    if usage["total_tokens"] != usage["input_tokens"] + usage["output_tokens"]:
        raise CheckFailed(
            f"usage.total_tokens is {usage['total_tokens']}, expected input + output = "
            f"{usage['input_tokens'] + usage['output_tokens']}"
        )


@checks("ws.no_events_after_terminal")
async def ws_no_events_after_terminal(ctx: Context) -> None:
    async with ctx.ws() as ws:
        await completed(ctx, ws, text_body(ctx), "a text response")
        await ws.expect_quiet(ctx.quiet, "after response.completed")
        await completed(ctx, ws, tool_body(ctx), "a tool-call response")
        await ws.expect_quiet(ctx.quiet, "after response.completed of a tool-call turn")
        event = await first_event(
            ctx, ws, {"type": "response.create", **text_body(ctx, frobnicate=1)}
        )
        if event["type"] != "error":
            raise CheckFailed(
                f"an invalid create was answered with {event['type']}, expected error"
            )
        await ws.expect_quiet(ctx.quiet, "after a request error")


@checks("ws.tool_call_completes")
async def ws_tool_call_completes(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, response = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
    streamed = [
        e["item"].get("id")
        for e in events
        if e["type"] == "response.output_item.done"
        and isinstance(e.get("item"), dict)
        and e["item"].get("type") == "function_call"
    ]
    if not streamed:
        raise CheckFailed("no function_call item was streamed for a forced tool call")
    final = [c.get("id") for c in call_items(response["output"])]
    if final != streamed:
        raise CheckFailed(
            f"response.completed output has calls {final}, expected the streamed calls {streamed}"
        )
