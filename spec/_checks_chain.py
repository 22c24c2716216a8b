"""The WebSocket checks of continuation, the connection cache and the store (WS-4): a
`previous_response_id` chain equals the stateless request, a failed continuation evicts its
parent, stored responses hydrate on a new connection. The not-found errors (WS-4.3, WS-4.4)
are rows of the error table (`_checks_errors`)."""

from __future__ import annotations

from ._analysis import error_problems
from ._client import CheckFailed, describe_value
from ._context import CheckSet, Context
from ._probes import compare_outputs
from ._requests import (
    TEXT_PROMPT,
    TOOL_PROMPT,
    WEATHER_TOOL,
    outputs_for,
    replay,
    text_body,
    tool_body,
    tool_output,
    unknown_id,
)
from ._steps import completed, first_event, forced_calls

__all__ = ["checks"]

checks = CheckSet()

# === WS-4: continuation, cache, store ========================================================


@checks("ws.continuation_new_items")
async def ws_continuation_new_items(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, first = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
        calls = forced_calls(first)
        body = {
            "model": ctx.model,
            "previous_response_id": first["id"],
            "input": outputs_for(calls),
            "tools": [WEATHER_TOOL],
            "tool_choice": "none",
            "store": False,
        }
        _, second = await completed(ctx, ws, body, "the continuation with only the tool outputs")
    if second.get("previous_response_id") != first["id"]:
        raise CheckFailed(
            f"previous_response_id is {describe_value(second.get('previous_response_id'))}, "
            f"expected {first['id']!r}"
        )
    if not second["output"]:
        raise CheckFailed("the continuation produced no output")


@checks("ws.continuation_equals_stateless")
async def ws_continuation_equals_stateless(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, first = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
        calls = forced_calls(first)
        tail = {"tools": [WEATHER_TOOL], "tool_choice": "none", "store": False, "model": ctx.model}
        _, chained = await completed(
            ctx,
            ws,
            {**tail, "previous_response_id": first["id"], "input": outputs_for(calls)},
            "the continuation",
        )
        history = [
            {"role": "user", "content": TOOL_PROMPT},
            *replay(first["output"]),
            *outputs_for(calls),
        ]
        _, whole = await completed(
            ctx, ws, {**tail, "input": history}, "the same history sent statelessly"
        )
    await compare_outputs(
        ctx, chained, whole, names=("the continuation", "the stateless request"), usage=True
    )


@checks("ws.evicted_after_failure")
async def ws_evicted_after_failure(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, first = await completed(ctx, ws, tool_body(ctx), "a forced tool call (store: false)")
        calls = forced_calls(first)
        tail = {
            "model": ctx.model,
            "tools": [WEATHER_TOOL],
            "tool_choice": "none",
            "store": False,
            "previous_response_id": first["id"],
        }
        bad = await first_event(
            ctx, ws, {"type": "response.create", **tail, "input": [tool_output(unknown_id("call"))]}
        )
        if bad["type"] != "error":
            raise CheckFailed(
                f"a continuation answering an unknown call id was answered with {bad['type']}, "
                "expected error"
            )
        again = await first_event(
            ctx, ws, {"type": "response.create", **tail, "input": outputs_for(calls)}
        )
    problems = error_problems(
        again, status=400, code="previous_response_not_found", param="previous_response_id"
    )
    if problems:
        raise CheckFailed(
            "after a failed continuation its previous response must be evicted: "
            + "; ".join(problems)
        )


@checks("ws.store_hydration")
async def ws_store_hydration(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, first = await completed(
            ctx, ws, tool_body(ctx, store=True), "a forced tool call (store: true)"
        )
    calls = forced_calls(first)
    body = {
        "model": ctx.model,
        "previous_response_id": first["id"],
        "input": outputs_for(calls),
        "tools": [WEATHER_TOOL],
        "tool_choice": "none",
        "store": True,
    }
    async with ctx.ws() as ws:
        _, second = await completed(ctx, ws, body, "the continuation on a new connection")
    if second.get("previous_response_id") != first["id"]:
        raise CheckFailed(
            f"previous_response_id is {describe_value(second.get('previous_response_id'))}, "
            f"expected {first['id']!r}"
        )


@checks("ws.store_default_retrievable")
async def ws_store_default_retrievable(ctx: Context) -> None:
    body = {"model": ctx.model, "input": TEXT_PROMPT}
    async with ctx.ws() as ws:
        _, response = await completed(ctx, ws, body, "a response without `store`")
    if response.get("store") is not True:
        raise CheckFailed(
            f"response.store is {describe_value(response.get('store'))}, expected true (the "
            "default)"
        )
    got = await ctx.http("GET", f"/responses/{response['id']}")
    if got.status != 200 or not isinstance(got.body, dict):
        raise CheckFailed(
            f"GET /responses/{response['id']} answered HTTP {got.status}, expected 200"
        )
    if got.body.get("id") != response["id"] or got.body.get("output") != response["output"]:
        raise CheckFailed("the retrieved response differs from the one streamed (id or output)")


@checks("ws.store_false_not_retrievable")
async def ws_store_false_not_retrievable(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, response = await completed(
            ctx, ws, text_body(ctx, store=False), "a store: false response"
        )
    if response.get("store") is not False:
        raise CheckFailed(
            f"response.store is {describe_value(response.get('store'))}, expected false"
        )
    got = await ctx.http("GET", f"/responses/{response['id']}")
    if got.status != 404:
        raise CheckFailed(
            f"GET of a store: false response answered HTTP {got.status}, expected 404"
        )
