"""The schema checks (SCHEMA-1): every Response object and event the server emits, over HTTP,
server-sent events and WebSocket, and through a rollout, is valid against the Responses schema
(`_schema`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ._analysis import call_items, shape
from ._client import CheckFailed, describe_value
from ._context import CheckSet, Context
from ._requests import append_event, text_body, tool_body, tool_output
from ._schema import event_problems, response_problems
from ._steps import SUSPEND_OR_END, completed, first_event, pending_calls, response_of, suspended

__all__ = ["checks"]

checks = CheckSet()

# === SCHEMA: what the server emits is valid ==================================================

# Problems quoted in one failure (the rest are counted).
SCHEMA_SHOWN = 4


def _schema_fail(what: str, problems: Sequence[str]) -> None:
    if problems:
        shown = "; ".join(problems[:SCHEMA_SHOWN])
        more = f" (and {len(problems) - SCHEMA_SHOWN} more)" if len(problems) > SCHEMA_SHOWN else ""
        raise CheckFailed(f"{what} is not valid: {shown}{more}")


def _events_valid(
    events: Sequence[Mapping[str, Any]], transport: Literal["ws", "sse"], what: str
) -> None:
    suspended = False  # after a rollout's response.done, until the next event
    for n, event in enumerate(events):
        problems = event_problems(event, transport=transport)
        if event.get("type") == "response.in_progress" and not suspended:
            response = event.get("response")
            if isinstance(response, Mapping) and "created_at" not in response:
                # The resumed form (RX-2.3) is only for a rollout resuming after response.done.
                problems.append(
                    "$.response: names its response without carrying it, but follows no "
                    "response.done (only a resumed rollout's response.in_progress may)"
                )
        suspended = event.get("type") == "response.done"
        _schema_fail(f"{what}, event {n} ({describe_value(event.get('type'))})", problems)


def _json_response(result: Any, what: str) -> dict[str, Any]:
    if result.status != 200 or not isinstance(result.body, dict):
        raise CheckFailed(
            f"{what} answered HTTP {result.status}, expected 200 and a JSON object: "
            f"{describe_value(result.text)}"
        )
    body: dict[str, Any] = result.body
    return body


@checks("schema.http_response")
async def schema_http_response(ctx: Context) -> None:
    result = await ctx.http("POST", "/responses", json_body=tool_body(ctx, stream=False))
    body = _json_response(result, "POST /responses (a forced tool call)")
    _schema_fail("the Response object", response_problems(body))
    if not call_items(body.get("output") or []):
        raise CheckFailed(
            f"the forced tool call produced no function_call item: {shape(body['output'])}"
        )


@checks("schema.sse_events")
async def schema_sse_events(ctx: Context) -> None:
    for body, what in ((text_body(ctx), "a text response"), (tool_body(ctx), "a tool call")):
        result, events = await ctx.sse({**body, "stream": True})
        if result.status != 200 or not events:
            raise CheckFailed(f"stream: true ({what}) answered HTTP {result.status}, no events")
        _events_valid([e.data for e in events], "sse", f"the event stream of {what}")


@checks("schema.ws_events")
async def schema_ws_events(ctx: Context) -> None:
    async with ctx.ws() as ws:
        text, _ = await completed(ctx, ws, text_body(ctx), "a text response")
        calls, _ = await completed(ctx, ws, tool_body(ctx), "a tool-call response")
        error = await first_event(
            ctx, ws, {"type": "response.create", **text_body(ctx, frobnicate=1)}
        )
    _events_valid(text, "ws", "a text response")
    _events_valid(calls, "ws", "a tool-call response")
    if error["type"] != "error":
        raise CheckFailed(f"an invalid create was answered with {error['type']}, expected error")
    _events_valid([error], "ws", "the answer to an invalid create")


@checks("schema.retrieve")
async def schema_retrieve(ctx: Context) -> None:
    created = await ctx.http("POST", "/responses", json_body=tool_body(ctx, store=True))
    response_id = _json_response(created, "POST /responses (store: true)").get("id")
    got = await ctx.http("GET", f"/responses/{response_id}")
    body = _json_response(got, f"GET /responses/{response_id}")
    _schema_fail("the retrieved Response object", response_problems(body))


@checks("schema.rollout_events")
async def schema_rollout_events(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, done = await suspended(ctx, ws)
        await ws.send(
            append_event(response_of(done)["id"], [tool_output(c) for c in pending_calls(done)])
        )
        ctx.step = "waiting for the resumed rollout to suspend or end"
        events += await ws.collect(until=SUSPEND_OR_END)
    _events_valid(events, "ws", "a rollout")
