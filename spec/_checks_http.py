"""The checks of plain HTTP (HTTP-1: create, stream, retrieve, delete, store) and of API keys
(AUTH-1). The HTTP error checks (HTTP-2) are rows of the error table (`_checks_errors`)."""

from __future__ import annotations

from ._analysis import completed_response, order_problems, sequence_problems, shape, text_problems
from ._client import CheckFailed, UpgradeRefused, describe_value
from ._context import CheckSet, Context
from ._requests import text_body
from ._steps import fail_on, response_field_problems

__all__ = ["checks"]

checks = CheckSet()

# === HTTP ====================================================================================


@checks("http.create")
async def http_create(ctx: Context) -> None:
    result = await ctx.http("POST", "/responses", json_body=text_body(ctx, stream=False))
    if result.status != 200:
        raise CheckFailed(
            f"POST /responses answered HTTP {result.status}, expected 200: "
            f"{describe_value(result.text)}"
        )
    if "application/json" not in result.headers.get("content-type", ""):
        raise CheckFailed(
            f"content-type {result.headers.get('content-type')!r}, expected application/json"
        )
    body = result.body
    if not isinstance(body, dict):
        raise CheckFailed(f"the body is not a JSON object: {describe_value(result.text)}")
    fail_on(response_field_problems(body, status="completed"))
    if not any(isinstance(i, dict) and i.get("type") == "message" for i in body["output"]):
        raise CheckFailed(f"the output has no message: {shape(body['output'])}")


@checks("http.sse")
async def http_sse_check(ctx: Context) -> None:
    result, events = await ctx.sse(text_body(ctx, stream=True))
    if result.status != 200:
        raise CheckFailed(f"stream: true answered HTTP {result.status}, expected 200")
    ctype = result.headers.get("content-type", "")
    if not ctype.startswith("text/event-stream"):
        raise CheckFailed(f"content-type {ctype!r}, expected text/event-stream")
    if not events:
        raise CheckFailed("the event stream carried no events")
    for n, ev in enumerate(events):
        if ev.name != ev.data["type"]:
            raise CheckFailed(
                f"event {n}: the SSE `event:` field is {ev.name!r} but data.type is "
                f"{ev.data['type']!r}"
            )
    data = [e.data for e in events]
    fail_on(sequence_problems(data))
    fail_on(order_problems(data))
    completed_response(data, "the streamed response")
    fail_on(text_problems(data))


@checks("http.retrieve")
async def http_retrieve(ctx: Context) -> None:
    created = await ctx.http("POST", "/responses", json_body=text_body(ctx, store=True))
    if created.status != 200 or not isinstance(created.body, dict):
        raise CheckFailed(f"POST /responses answered HTTP {created.status}, expected 200")
    response_id = created.body.get("id")
    got = await ctx.http("GET", f"/responses/{response_id}")
    if got.status != 200 or not isinstance(got.body, dict):
        raise CheckFailed(
            f"GET /responses/{response_id} answered HTTP {got.status}, expected 200: "
            f"{describe_value(got.text)}"
        )
    for key in ("id", "status", "output"):
        if got.body.get(key) != created.body.get(key):
            raise CheckFailed(
                f"retrieved {key} is {describe_value(got.body.get(key))}, expected "
                f"{describe_value(created.body.get(key))} (as created)"
            )


@checks("http.delete")
async def http_delete(ctx: Context) -> None:
    created = await ctx.http("POST", "/responses", json_body=text_body(ctx, store=True))
    if created.status != 200 or not isinstance(created.body, dict):
        raise CheckFailed(f"POST /responses answered HTTP {created.status}, expected 200")
    response_id = created.body.get("id")
    deleted = await ctx.http("DELETE", f"/responses/{response_id}")
    expected = {"id": response_id, "object": "response", "deleted": True}
    if deleted.status != 200:
        raise CheckFailed(f"DELETE answered HTTP {deleted.status}, expected 200")
    if not isinstance(deleted.body, dict) or any(
        deleted.body.get(k) != v for k, v in expected.items()
    ):
        raise CheckFailed(f"DELETE answered {describe_value(deleted.body)}, expected {expected}")
    got = await ctx.http("GET", f"/responses/{response_id}")
    if got.status != 404:
        raise CheckFailed(f"GET after DELETE answered HTTP {got.status}, expected 404")
    got.error()


@checks("http.store_false")
async def http_store_false(ctx: Context) -> None:
    created = await ctx.http("POST", "/responses", json_body=text_body(ctx, store=False))
    if created.status != 200 or not isinstance(created.body, dict):
        raise CheckFailed(f"POST /responses answered HTTP {created.status}, expected 200")
    if created.body.get("store") is not False:
        raise CheckFailed(
            f"the response says store {describe_value(created.body.get('store'))}, expected false"
        )
    got = await ctx.http("GET", f"/responses/{created.body.get('id')}")
    if got.status != 404:
        raise CheckFailed(
            f"GET of a store: false response answered HTTP {got.status}, expected 404"
        )
    got.error()


# === authentication ==========================================================================


@checks("auth.http_401")
async def auth_http_401(ctx: Context) -> None:
    ctx.need("api_key")
    for headers, what in (
        ({}, "without a key"),
        ({"Authorization": "Bearer sk-conformance-wrong"}, "with a wrong key"),
    ):
        result = await ctx.http(
            "POST", "/responses", json_body=text_body(ctx), auth=False, headers=headers
        )
        if result.status != 401:
            raise CheckFailed(f"POST /responses {what} answered HTTP {result.status}, expected 401")
        code = result.error().get("code")
        if code != "invalid_api_key":
            raise CheckFailed(
                f"{what}: error.code {describe_value(code)}, expected 'invalid_api_key'"
            )


@checks("auth.ws_401")
async def auth_ws_401(ctx: Context) -> None:
    ctx.need("api_key")
    for headers, what in (
        ({}, "without a key"),
        ({"Authorization": "Bearer sk-conformance-wrong"}, "with a wrong key"),
    ):
        try:
            async with ctx.ws(auth=False, headers=headers):
                pass
        except UpgradeRefused as exc:
            if exc.status != 401:
                raise CheckFailed(
                    f"the upgrade {what} was refused with HTTP {exc.status}, expected 401"
                ) from None
        else:
            raise CheckFailed(f"the upgrade {what} succeeded (101), expected HTTP 401")
