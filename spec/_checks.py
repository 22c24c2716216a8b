"""The conformance checks. Each is registered under the id of its case in checks.json, whose
rule in PROTOCOL.md it verifies.

The checks are model-agnostic: tool calls are forced with a named `tool_choice`, structure is
compared rather than text, and where content matters the model's own answers are the
reference. Whether the model is deterministic is probed once (the same requests twice); with
a deterministic model, outputs that must be equal are compared modulo ids, otherwise their
structure is compared.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import trio

from ._analysis import (
    as_dict,
    call_items,
    call_problems,
    completed_response,
    error_problems,
    expect_error,
    first_difference,
    order_problems,
    sequence_problems,
    shape,
    text_problems,
)
from ._client import TERMINAL, CheckFailed, CheckSkipped, UpgradeRefused, WsClient, describe_value
from ._context import Context, check
from ._schema import event_problems, response_problems

__all__ = ["FEATURE_PROBES", "probe_deterministic", "probe_rollout"]

Event = dict[str, Any]

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name."}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORCE_WEATHER: dict[str, Any] = {"type": "function", "name": "get_weather"}
TEXT_PROMPT = "In one short sentence: what colour is the sky on a clear day?"
TOOL_PROMPT = "What is the weather in Paris right now?"
ROLLOUT_INSTRUCTIONS = (
    "Call get_weather exactly once for the city the user names, then answer in one short "
    "sentence using its result."
)
WARMUP_INSTRUCTIONS = "You are a concise assistant. Answer in one short sentence."
TOOL_RESULT = json.dumps({"city": "Paris", "temperature_c": 18, "sky": "clear"})
# Headers the official SDKs and Codex send on the upgrade besides Authorization.
SDK_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "application/json",
    "User-Agent": "OpenAI/Python 3.51.0",
    "X-Stainless-Lang": "python",
    "X-Stainless-Package-Version": "3.51.0",
    "X-Stainless-OS": "Linux",
    "X-Stainless-Arch": "x64",
    "X-Stainless-Runtime": "CPython",
    "X-Stainless-Runtime-Version": "3.12.0",
    "X-Stainless-Async": "async:asyncio",
    "OpenAI-Organization": "org-conformance",
    "OpenAI-Project": "proj_conformance",
    "OpenAI-Beta": "responses_websockets=2026-02-06",
}
# A connection left idle (with pings) this long must stay open (WS-1.5).
IDLE_SECONDS = 1.0
# Tool rounds a rollout or chain may take before the check gives up on the model.
MAX_ROUNDS = 4
SUSPEND_OR_END = TERMINAL | {"response.done"}


# --- requests --------------------------------------------------------------------------------


def unknown_id(prefix: str = "resp") -> str:
    return f"{prefix}_conformance_{secrets.token_hex(8)}"


def text_body(ctx: Context, **extra: Any) -> dict[str, Any]:
    return {"model": ctx.model, "input": TEXT_PROMPT, "store": False, **extra}


def tool_body(ctx: Context, **extra: Any) -> dict[str, Any]:
    return {
        "model": ctx.model,
        "input": TOOL_PROMPT,
        "tools": [WEATHER_TOOL],
        "tool_choice": FORCE_WEATHER,
        "store": False,
        **extra,
    }


def auto_body(ctx: Context, **extra: Any) -> dict[str, Any]:
    """A tool conversation the model finishes by itself: one call, then an answer."""
    return {
        "model": ctx.model,
        "instructions": ROLLOUT_INSTRUCTIONS,
        "input": TOOL_PROMPT,
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "store": False,
        **extra,
    }


def tool_output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": TOOL_RESULT}


def outputs_for(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [tool_output(str(c.get("call_id"))) for c in calls]


def replay(items: Sequence[Any]) -> list[dict[str, Any]]:
    """Output items as input for a stateless request: messages and calls, without the ids a
    server generated (reasoning items are dropped: they may need encrypted content)."""
    out = []
    for item in items:
        if isinstance(item, dict) and item.get("type") in ("message", "function_call"):
            out.append({k: v for k, v in item.items() if k not in ("id", "status")})
    return out


def append_event(response_id: str, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"type": "response.append", "response_id": response_id, "input": list(items)}


# --- small helpers ---------------------------------------------------------------------------


def fail_on(problems: Sequence[str], prefix: str = "") -> None:
    if problems:
        raise CheckFailed(prefix + "; ".join(problems))


def response_of(event: Mapping[str, Any]) -> dict[str, Any]:
    response = event.get("response")
    if not isinstance(response, dict):
        raise CheckFailed(f"{event.get('type')} has no `response` object")
    return response


async def completed(
    ctx: Context, ws: WsClient, body: Mapping[str, Any], what: str
) -> tuple[list[Event], dict[str, Any]]:
    ctx.step = f"waiting for {what}"
    events = await ws.create(body)
    return events, completed_response(events, what)


async def first_event(ctx: Context, ws: WsClient, message: Mapping[str, Any] | str) -> Event:
    ctx.step = "waiting for the answer to a request"
    await ws.send(message)
    return await ws.recv()


async def deterministic(ctx: Context) -> bool:
    value = await ctx.probes.get("deterministic", lambda: probe_deterministic(ctx))
    return bool(value)


async def compare_outputs(
    ctx: Context,
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    *,
    names: tuple[str, str],
    usage: bool = False,
) -> None:
    """With a deterministic model, equal outputs modulo ids (and, with `usage`, equal input and
    output token counts); otherwise the same item kinds."""
    if await deterministic(ctx):
        diff = first_difference(a.get("output") or [], b.get("output") or [], names=names)
        if diff:
            raise CheckFailed(f"the model is deterministic but the outputs differ: {diff}")
        if usage:
            for key in ("input_tokens", "output_tokens"):
                x, y = _tokens(a, key), _tokens(b, key)
                if x != y:
                    raise CheckFailed(
                        f"usage.{key}: {names[0]} has {x}, {names[1]} has {y} (the same context "
                        "must count the same)"
                    )
        return
    sa, sb = shape(a.get("output") or []), shape(b.get("output") or [])
    if [k.split(":")[0] for k in sa][-1:] != [k.split(":")[0] for k in sb][-1:]:
        raise CheckFailed(f"{names[0]} ends with {sa[-1:]} but {names[1]} with {sb[-1:]}")


def _tokens(response: Mapping[str, Any], key: str) -> Any:
    usage = response.get("usage")
    return usage.get(key) if isinstance(usage, dict) else None


def _sum_tokens(responses: Sequence[Mapping[str, Any]], key: str) -> int | None:
    total = 0
    for r in responses:
        value = _tokens(r, key)
        if not isinstance(value, int):
            return None
        total += value
    return total


# --- probes ----------------------------------------------------------------------------------


async def probe_deterministic(ctx: Context) -> bool:
    """The same text request and the same forced tool call, twice each: equal outputs modulo
    ids mean a deterministic model."""
    async with ctx.ws() as ws:
        outputs: list[list[Any]] = []
        for body in (text_body(ctx), text_body(ctx), tool_body(ctx), tool_body(ctx)):
            _, response = await completed(ctx, ws, body, "a determinism probe response")
            outputs.append(response["output"])
    return (
        first_difference(outputs[0], outputs[1], names=("a", "b")) is None
        and first_difference(outputs[2], outputs[3], names=("a", "b")) is None
    )


async def probe_rollout(ctx: Context) -> str | None:
    """None when the server accepts `rollout: true`, else why the extension is absent. A
    server that rejects the parameter does not support the extension (its checks are
    skipped); one that accepts it claims it (its checks run)."""
    async with ctx.ws() as ws:
        event = await first_event(
            ctx, ws, {"type": "response.create", **tool_body(ctx, rollout=True)}
        )
    if event["type"] in ("response.created", "response.queued"):
        return None
    if event["type"] == "error":
        error = as_dict(event.get("error"))
        if error.get("param") == "rollout" or "rollout" in str(error.get("message", "")):
            return (
                "the server rejects the `rollout` parameter "
                f"({error.get('code')}): the rollout extension is not supported"
            )
        raise CheckFailed(
            "a create with rollout: true was answered with error "
            f"{describe_value(error.get('code'))}: "
            f"{describe_value(error.get('message'))}"
        )
    raise CheckFailed(f"a create with rollout: true was answered with {event['type']}")


FEATURE_PROBES = {"rollout": probe_rollout}


# === HTTP ====================================================================================


@check("http.create")
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
    fail_on(_response_field_problems(body, status="completed"))
    if not any(isinstance(i, dict) and i.get("type") == "message" for i in body["output"]):
        raise CheckFailed(f"the output has no message: {shape(body['output'])}")


@check("http.sse")
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


@check("http.retrieve")
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


@check("http.delete")
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


@check("http.store_false")
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


def _http_error(result: Any, *, status: int, code: str, param: str | None) -> None:
    if result.status != status:
        raise CheckFailed(f"HTTP {result.status}, expected {status}: {describe_value(result.text)}")
    error = result.error()
    problems = []
    if error.get("code") != code:
        problems.append(
            f"error.code: expected {code!r}, observed {describe_value(error.get('code'))}"
        )
    if error.get("type") != "invalid_request_error":
        problems.append(
            "error.type: expected 'invalid_request_error', observed "
            f"{describe_value(error.get('type'))}"
        )
    if error.get("param") != param:
        problems.append(
            f"error.param: expected {param!r}, observed {describe_value(error.get('param'))}"
        )
    if not isinstance(error.get("message"), str) or not error.get("message"):
        problems.append("error.message: expected a non-empty string")
    fail_on(problems)


@check("http.error_unknown_parameter")
async def http_error_unknown_parameter(ctx: Context) -> None:
    result = await ctx.http("POST", "/responses", json_body=text_body(ctx, frobnicate=1))
    _http_error(result, status=400, code="unknown_parameter", param="frobnicate")


@check("http.error_model_not_found")
async def http_error_model_not_found(ctx: Context) -> None:
    body = {**text_body(ctx), "model": "conformance-no-such-model"}
    result = await ctx.http("POST", "/responses", json_body=body)
    _http_error(result, status=404, code="model_not_found", param="model")


@check("http.error_previous_response_not_found")
async def http_error_previous(ctx: Context) -> None:
    body = text_body(ctx, previous_response_id=unknown_id())
    result = await ctx.http("POST", "/responses", json_body=body)
    _http_error(
        result, status=400, code="previous_response_not_found", param="previous_response_id"
    )


@check("http.error_body_too_large")
async def http_error_body_too_large(ctx: Context) -> None:
    limit = int(ctx.need("max_message_size"))
    payload = json.dumps(text_body(ctx, input="x" * (limit + 1024))).encode()
    result = await ctx.http("POST", "/responses", content=payload)
    if result.status != 413:
        raise CheckFailed(f"a {len(payload)}-byte body answered HTTP {result.status}, expected 413")
    code = result.error().get("code")
    if code != "message_too_large":
        raise CheckFailed(
            f"error.code: expected 'message_too_large', observed {describe_value(code)}"
        )


# === authentication ==========================================================================


@check("auth.http_401")
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


@check("auth.ws_401")
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


# === WS-1: connection ========================================================================


async def _smoke(ctx: Context, ws: WsClient) -> None:
    await completed(ctx, ws, text_body(ctx), "a response on the new connection")


@check("ws.upgrade_minimal")
async def ws_upgrade_minimal(ctx: Context) -> None:
    async with ctx.ws() as ws:
        if ws.conn.subprotocol:
            raise CheckFailed(
                f"the server chose subprotocol {ws.conn.subprotocol!r}; none was offered"
            )
        await _smoke(ctx, ws)


@check("ws.upgrade_extra_headers")
async def ws_upgrade_extra_headers(ctx: Context) -> None:
    async with ctx.ws(headers=SDK_HEADERS) as ws:
        await _smoke(ctx, ws)


@check("ws.upgrade_query_params")
async def ws_upgrade_query_params(ctx: Context) -> None:
    async with ctx.ws(query={"api-version": "2025-04-01-preview", "conformance": "1"}) as ws:
        await _smoke(ctx, ws)


@check("ws.frames")
async def ws_frames(ctx: Context) -> None:
    async with ctx.ws() as ws:
        await completed(ctx, ws, text_body(ctx), "a text response")
        await completed(ctx, ws, tool_body(ctx), "a tool-call response")
        await ws.send({"type": "response.create", "model": ctx.model, "frobnicate": 1})
        await ws.recv()
        if ws.binary_frames:
            total = ws.binary_frames + ws.text_frames
            raise CheckFailed(
                f"{ws.binary_frames} of {total} messages came in binary frames, expected text "
                "frames"
            )


@check("ws.idle_ping")
async def ws_idle_ping(ctx: Context) -> None:
    age = ctx.options.age_limit_seconds
    if age is not None and age < IDLE_SECONDS + 1:
        raise CheckSkipped(
            f"the connection age limit ({age:g}s) is too short to idle {IDLE_SECONDS:g}s"
        )
    ctx.allow(IDLE_SECONDS)
    async with ctx.ws() as ws:
        await ws.ping()
        ctx.step = "idling"
        await ws.expect_quiet(IDLE_SECONDS / 2, "on an idle connection")
        await ws.ping()
        await ws.expect_quiet(IDLE_SECONDS / 2, "on an idle connection")
        await ws.ping()
        await _smoke(ctx, ws)


@check("ws.open_after_terminal")
async def ws_open_after_terminal(ctx: Context) -> None:
    async with ctx.ws() as ws:
        await completed(ctx, ws, text_body(ctx), "a text response")
        code = await ws.wait_closed(ctx.quiet)
        if code is not None:
            raise CheckFailed(
                f"the server closed the socket (code {code}) after response.completed"
            )
        await ws.ping()
        event = await first_event(
            ctx, ws, {"type": "response.create", **text_body(ctx, frobnicate=1)}
        )
        if event["type"] != "error":
            raise CheckFailed(
                f"an invalid create was answered with {event['type']}, expected error"
            )
        code = await ws.wait_closed(ctx.quiet)
        if code is not None:
            raise CheckFailed(f"the server closed the socket (code {code}) after a request error")
        await ws.ping()


# === WS-2: response.create ===================================================================


@check("ws.create_text")
async def ws_create_text(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, _ = await completed(ctx, ws, text_body(ctx), "a text response")
        if events[0]["type"] not in ("response.created", "response.queued"):
            raise CheckFailed(f"the first event is {events[0]['type']}, expected response.created")
        if not any(e["type"] == "response.output_text.delta" for e in events):
            raise CheckFailed("the response streamed no output_text.delta")
        await ws.ping()


@check("ws.stream_true")
async def ws_stream_true(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, with_stream = await completed(
            ctx, ws, text_body(ctx, stream=True), "a create with stream: true"
        )
        _, without = await completed(ctx, ws, text_body(ctx), "a create without stream")
    await compare_outputs(ctx, with_stream, without, names=("with stream: true", "without"))


@check("ws.explicit_nulls")
async def ws_explicit_nulls(ctx: Context) -> None:
    nulls = {
        "previous_response_id": None,
        "instructions": None,
        "max_output_tokens": None,
        "metadata": None,
        "temperature": None,
        "top_p": None,
    }
    async with ctx.ws() as ws:
        _, response = await completed(
            ctx, ws, text_body(ctx, **nulls), "a create with explicit nulls"
        )
    if response.get("previous_response_id") is not None:
        raise CheckFailed(
            f"previous_response_id is {describe_value(response.get('previous_response_id'))}, "
            "expected null (a new chain)"
        )


@check("ws.short_form_message")
async def ws_short_form_message(ctx: Context) -> None:
    body = text_body(ctx, input=[{"role": "user", "content": TEXT_PROMPT}])
    async with ctx.ws() as ws:
        await completed(ctx, ws, body, "a create with a short-form user message")


@check("ws.sequential_creates")
async def ws_sequential_creates(ctx: Context) -> None:
    ids = []
    async with ctx.ws() as ws:
        for n in range(3):
            events, response = await completed(ctx, ws, text_body(ctx), f"response {n + 1} of 3")
            fail_on(sequence_problems(events), f"response {n + 1}: ")
            ids.append(response.get("id"))
    if len(set(ids)) != 3:
        raise CheckFailed(
            f"three responses on one socket have ids {ids}, expected three distinct ids"
        )


WARMUP_INPUT = [{"role": "user", "content": "I am planning a trip to Paris."}]


@check("ws.warmup")
async def ws_warmup(ctx: Context) -> None:
    body = {
        "model": ctx.model,
        "generate": False,
        "instructions": WARMUP_INSTRUCTIONS,
        "tools": [WEATHER_TOOL],
        "input": WARMUP_INPUT,
        "store": False,
    }
    async with ctx.ws() as ws:
        events, response = await completed(ctx, ws, body, "a generate: false response")
    if not isinstance(response.get("id"), str) or not response["id"]:
        raise CheckFailed("the warm-up response has no id")
    if response["output"]:
        raise CheckFailed(
            f"generate: false produced output {shape(response['output'])}, expected none"
        )
    streamed = [e["type"] for e in events if e["type"].startswith("response.output_")]
    if streamed:
        raise CheckFailed(f"generate: false streamed {streamed[:3]}, expected no output events")


@check("ws.warmup_chain")
async def ws_warmup_chain(ctx: Context) -> None:
    common = {
        "model": ctx.model,
        "instructions": WARMUP_INSTRUCTIONS,
        "tools": [WEATHER_TOOL],
        "store": False,
    }
    question = [{"role": "user", "content": TEXT_PROMPT}]
    async with ctx.ws() as ws:
        _, warm = await completed(
            ctx, ws, {**common, "generate": False, "input": WARMUP_INPUT}, "the warm-up"
        )
        _, chained = await completed(
            ctx,
            ws,
            {
                **common,
                "tool_choice": "none",
                "previous_response_id": warm["id"],
                "input": question,
            },
            "the create chained from the warm-up",
        )
        if chained.get("previous_response_id") != warm["id"]:
            raise CheckFailed(
                f"previous_response_id is {describe_value(chained.get('previous_response_id'))}, "
                f"expected the warm-up id {warm['id']!r}"
            )
        _, whole = await completed(
            ctx,
            ws,
            {**common, "tool_choice": "none", "input": WARMUP_INPUT + question},
            "the same input sent whole",
        )
    await compare_outputs(
        ctx, chained, whole, names=("chained from the warm-up", "sent whole"), usage=True
    )


@check("ws.stream_id")
async def ws_stream_id(ctx: Context) -> None:
    lane = "conformance-lane.1"
    async with ctx.ws() as ws:
        events = await ws.create(text_body(ctx, stream_id=lane))
        if events[0]["type"] == "error":
            expect_error(events[0], status=400, code="unsupported_parameter", param="stream_id")
            await completed(ctx, ws, text_body(ctx), "a create without stream_id after the refusal")
            return
        completed_response(events, "a create with stream_id")
    unlabelled = [e["type"] for e in events if e.get("stream_id") != lane]
    if unlabelled:
        raise CheckFailed(
            f"stream_id {lane!r} was accepted but {unlabelled[0]} does not echo it (neither a lane "
            "nor a refusal with unsupported_parameter)"
        )


# === WS-3: event stream ======================================================================


@check("ws.event_order")
async def ws_event_order(ctx: Context) -> None:
    async with ctx.ws() as ws:
        text, _ = await completed(ctx, ws, text_body(ctx), "a text response")
        calls, _ = await completed(ctx, ws, tool_body(ctx), "a tool-call response")
    fail_on(order_problems(text), "text response: ")
    fail_on(order_problems(calls), "tool-call response: ")


@check("ws.sequence_numbers")
async def ws_sequence_numbers(ctx: Context) -> None:
    async with ctx.ws() as ws:
        text, _ = await completed(ctx, ws, text_body(ctx), "a text response")
        calls, _ = await completed(ctx, ws, tool_body(ctx), "a tool-call response")
    fail_on(sequence_problems(text), "text response: ")
    fail_on(sequence_problems(calls), "tool-call response: ")


@check("ws.text_consistency")
async def ws_text_consistency(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, _ = await completed(ctx, ws, text_body(ctx), "a text response")
    fail_on(text_problems(events))


@check("ws.function_call_events")
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


@check("ws.function_call_consistency")
async def ws_function_call_consistency(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, _ = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
    fail_on(call_problems(events, name="get_weather"))


@check("ws.item_id_call_id")
async def ws_item_id_call_id(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, response = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
    calls = call_items(response["output"])
    if not calls:
        raise CheckFailed("the forced tool call produced no function_call item")
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


def _response_field_problems(response: Mapping[str, Any], *, status: str) -> list[str]:
    problems = []
    checks: list[tuple[str, Any]] = [
        ("id", str),
        ("created_at", int),
        ("model", str),
        ("output", list),
        ("parallel_tool_calls", bool),
        ("tools", list),
    ]
    for key, kind in checks:
        value = response.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            problems.append(f"response.{key} is {describe_value(value)}, expected {kind.__name__}")
    if response.get("object") != "response":
        problems.append(
            f"response.object is {describe_value(response.get('object'))}, expected 'response'"
        )
    if response.get("status") != status:
        problems.append(
            f"response.status is {describe_value(response.get('status'))}, expected {status!r}"
        )
    if "tool_choice" not in response:
        problems.append("response.tool_choice is missing")
    if status == "completed" and not isinstance(response.get("usage"), dict):
        problems.append(
            f"response.usage is {describe_value(response.get('usage'))}, expected an object"
        )
    return problems


@check("ws.response_fields")
async def ws_response_fields(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, response = await completed(ctx, ws, text_body(ctx), "a text response")
    created = response_of(events[0])
    fail_on(_response_field_problems(created, status="in_progress"), "response.created: ")
    fail_on(_response_field_problems(response, status="completed"), "response.completed: ")
    if created.get("id") != response.get("id"):
        raise CheckFailed(
            f"response.created names {created.get('id')!r}, response.completed "
            f"{response.get('id')!r}"
        )
    if created.get("output"):
        raise CheckFailed("response.created carries output items, expected an empty output")


@check("ws.usage")
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


@check("ws.no_events_after_terminal")
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


@check("ws.tool_call_completes")
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


# === WS-4: continuation, cache, store ========================================================


@check("ws.continuation_new_items")
async def ws_continuation_new_items(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, first = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
        calls = call_items(first["output"])
        if not calls:
            raise CheckFailed("the forced tool call produced no function_call item")
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


@check("ws.continuation_equals_stateless")
async def ws_continuation_equals_stateless(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, first = await completed(ctx, ws, tool_body(ctx), "a forced tool call")
        calls = call_items(first["output"])
        if not calls:
            raise CheckFailed("the forced tool call produced no function_call item")
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


@check("ws.previous_response_not_found")
async def ws_previous_response_not_found(ctx: Context) -> None:
    async with ctx.ws() as ws:
        event = await first_event(
            ctx,
            ws,
            {"type": "response.create", **text_body(ctx, previous_response_id=unknown_id())},
        )
    expect_error(
        event, status=400, code="previous_response_not_found", param="previous_response_id"
    )


@check("ws.store_false_after_reconnect")
async def ws_store_false_after_reconnect(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, first = await completed(ctx, ws, text_body(ctx, store=False), "a store: false response")
    async with ctx.ws() as ws:
        event = await first_event(
            ctx, ws, {"type": "response.create", **text_body(ctx, previous_response_id=first["id"])}
        )
    expect_error(
        event, status=400, code="previous_response_not_found", param="previous_response_id"
    )


@check("ws.evicted_after_failure")
async def ws_evicted_after_failure(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, first = await completed(ctx, ws, tool_body(ctx), "a forced tool call (store: false)")
        calls = call_items(first["output"])
        if not calls:
            raise CheckFailed("the forced tool call produced no function_call item")
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


@check("ws.store_hydration")
async def ws_store_hydration(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, first = await completed(
            ctx, ws, tool_body(ctx, store=True), "a forced tool call (store: true)"
        )
    calls = call_items(first["output"])
    if not calls:
        raise CheckFailed("the forced tool call produced no function_call item")
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


@check("ws.store_default_retrievable")
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


@check("ws.store_false_not_retrievable")
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


# === WS-5: queueing and limits ===============================================================


@check("ws.fifo_queue")
async def ws_fifo_queue(ctx: Context) -> None:
    body = text_body(ctx, model=ctx.slow_model)
    async with ctx.ws() as ws:
        await ws.send({"type": "response.create", **body})
        await ws.send({"type": "response.create", **body})
        ctx.step = "waiting for two queued responses"
        first = await ws.collect()
        second = await ws.collect()
    for n, events in enumerate((first, second), start=1):
        if events[-1]["type"] == "error":
            error = events[-1].get("error") or {}
            raise CheckFailed(
                "one of two creates sent back to back was refused with "
                f"{describe_value(error.get('code'))}: {describe_value(error.get('message'))}"
            )
        created = [e for e in events if e["type"] == "response.created"]
        if len(created) != 1:
            raise CheckFailed(
                f"create {n} of 2: {len(created)} response.created events before its terminal "
                "event, expected one (the responses must not overlap)"
            )
        completed_response(events, f"create {n} of 2")
        fail_on(sequence_problems(events), f"create {n} of 2: ")
    if response_of(first[-1]).get("id") == response_of(second[-1]).get("id"):
        raise CheckFailed("both creates were answered by the same response")


@check("ws.queue_limit")
async def ws_queue_limit(ctx: Context) -> None:
    bound = int(ctx.need("max_queued_creates"))
    sent = bound + 2
    body = text_body(ctx, model=ctx.slow_model)
    completed_n = refused = 0
    async with ctx.ws() as ws:
        for _ in range(sent):
            await ws.send({"type": "response.create", **body})
        ctx.step = f"waiting for {sent} creates to be answered"
        while completed_n + refused < sent:
            event = await ws.recv()
            if event["type"] == "error":
                expect_error(event, status=429, code="too_many_queued_requests", error_type=None)
                refused += 1
            elif event["type"] in TERMINAL:
                completed_response([event], "a queued create")
                completed_n += 1
    if refused < 1 or completed_n < bound:
        raise CheckFailed(
            f"{sent} creates sent at once against a queue bound of {bound}: {completed_n} "
            f"completed and {refused} refused; expected >= {bound} completed and >= 1 refused "
            "with 429 too_many_queued_requests"
        )


@check("ws.message_too_large")
async def ws_message_too_large(ctx: Context) -> None:
    limit = int(ctx.need("max_message_size"))
    big = json.dumps({"type": "response.create", **text_body(ctx, input="x" * (limit + 1024))})
    async with ctx.ws() as ws:
        event = await first_event(ctx, ws, big)
        expect_error(event, status=400, code="message_too_large", param=None)
        await completed(ctx, ws, text_body(ctx), "a create after the oversized message")


@check("ws.connection_age_limit")
async def ws_connection_age_limit(ctx: Context) -> None:
    age = float(ctx.need("age_limit_seconds"))
    wait = age + 0.5
    ctx.allow(wait)
    async with ctx.ws() as ws:
        await completed(ctx, ws, text_body(ctx), "a response on a young connection")
        ctx.step = f"waiting {wait:g}s for the connection to age"
        await trio.sleep(wait)
        # The error MAY have come unsolicited when the limit passed; else a create gets it.
        event = await ws.poll(ctx.quiet)
        if event is None:
            event = await first_event(ctx, ws, {"type": "response.create", **text_body(ctx)})
        expect_error(event, status=400, code="websocket_connection_limit_reached")
    async with ctx.ws() as ws:
        await completed(ctx, ws, text_body(ctx), "a response on a new connection")


# === WS-6: errors ============================================================================


@check("ws.error_keeps_socket")
async def ws_error_keeps_socket(ctx: Context) -> None:
    async with ctx.ws() as ws:
        for bad in (
            {"type": "response.create", **text_body(ctx, frobnicate=1)},
            {"type": "response.create", **text_body(ctx, previous_response_id=unknown_id())},
        ):
            event = await first_event(ctx, ws, bad)
            if event["type"] != "error":
                raise CheckFailed(
                    f"an invalid create was answered with {event['type']}, expected error"
                )
            problems = error_problems(event, code=str((event.get("error") or {}).get("code")))
            fail_on(problems, "the error event: ")
            await ws.expect_quiet(ctx.quiet, "after a request error")
            await completed(ctx, ws, text_body(ctx), "a valid create after a request error")


async def _request_error(ctx: Context, message: Mapping[str, Any] | str, **expected: Any) -> None:
    async with ctx.ws() as ws:
        event = await first_event(ctx, ws, message)
    expect_error(event, **expected)


@check("ws.error_unknown_parameter")
async def ws_error_unknown_parameter(ctx: Context) -> None:
    await _request_error(
        ctx,
        {"type": "response.create", **text_body(ctx, frobnicate=1)},
        status=400,
        code="unknown_parameter",
        param="frobnicate",
    )


@check("ws.error_missing_parameter")
async def ws_error_missing_parameter(ctx: Context) -> None:
    await _request_error(
        ctx,
        {"type": "response.create", "input": TEXT_PROMPT},
        status=400,
        code="missing_required_parameter",
        param="model",
    )


@check("ws.error_invalid_type")
async def ws_error_invalid_type(ctx: Context) -> None:
    await _request_error(
        ctx,
        {"type": "response.create", **text_body(ctx, temperature="hot")},
        status=400,
        code="invalid_type",
        param="temperature",
    )


@check("ws.error_invalid_value")
async def ws_error_invalid_value(ctx: Context) -> None:
    await _request_error(
        ctx,
        {"type": "response.create", **text_body(ctx, tool_choice="sometimes")},
        status=400,
        code="invalid_value",
        param="tool_choice",
    )


@check("ws.error_model_not_found")
async def ws_error_model_not_found(ctx: Context) -> None:
    await _request_error(
        ctx,
        {"type": "response.create", **text_body(ctx, model="conformance-no-such-model")},
        status=404,
        code="model_not_found",
        param="model",
    )


@check("ws.error_unknown_event")
async def ws_error_unknown_event(ctx: Context) -> None:
    await _request_error(
        ctx, {"type": "response.frobnicate"}, status=400, code="invalid_value", param="type"
    )


@check("ws.error_invalid_json")
async def ws_error_invalid_json(ctx: Context) -> None:
    await _request_error(
        ctx, '{"type": "response.create", ', status=400, code="invalid_json", param=None
    )


# === RX: the rollout extension ===============================================================


async def _suspended(
    ctx: Context, ws: WsClient, body: Mapping[str, Any] | None = None
) -> tuple[list[Event], Event]:
    """Start a forced-call rollout and read to its `response.done`."""
    ctx.step = "waiting for the rollout to suspend"
    events = await ws.create(body or tool_body(ctx, rollout=True), until=SUSPEND_OR_END)
    last = events[-1]
    if last["type"] != "response.done":
        detail = last["type"]
        if last["type"] == "error":
            detail += f" {describe_value((last.get('error') or {}).get('code'))}"
        raise CheckFailed(
            f"the rollout ended with {detail} at its tool call, expected response.done"
        )
    return events, last


def _pending(done: Mapping[str, Any]) -> list[str]:
    pending = done.get("pending_call_ids")
    if not isinstance(pending, list) or not pending or not all(isinstance(p, str) for p in pending):
        raise CheckFailed(
            f"response.done has pending_call_ids {describe_value(pending)}, expected a non-empty "
            "list of call ids"
        )
    return pending


async def _expect_resume(ctx: Context, ws: WsClient, done: Mapping[str, Any]) -> Event:
    ctx.step = "waiting for the rollout to resume"
    event = await ws.recv()
    if event["type"] != "response.in_progress":
        raise CheckFailed(
            f"after the append the rollout sent {event['type']}, expected response.in_progress"
        )
    if response_of(event).get("id") != response_of(done).get("id"):
        raise CheckFailed("the resumed response.in_progress names another response")
    return event


async def _run_rollout(
    ctx: Context, ws: WsClient, body: Mapping[str, Any]
) -> tuple[list[Event], int]:
    """A rollout to its end, appending the outputs at each suspension. Returns every event and
    the number of suspensions."""
    ctx.step = "running a rollout"
    events = await ws.create(body, until=SUSPEND_OR_END)
    rounds = 0
    while events[-1]["type"] == "response.done":
        if rounds == MAX_ROUNDS:
            raise CheckFailed(f"the rollout suspended {rounds} times; expected the model to finish")
        done = events[-1]
        await ws.send(
            append_event(response_of(done)["id"], [tool_output(c) for c in _pending(done)])
        )
        events += await ws.collect(until=SUSPEND_OR_END)
        rounds += 1
    return events, rounds


@check("rollout.http_rejected")
async def rollout_http_rejected(ctx: Context) -> None:
    result = await ctx.http("POST", "/responses", json_body=tool_body(ctx, rollout=True))
    _http_error(result, status=400, code="unsupported_parameter", param="rollout")


@check("rollout.suspend")
async def rollout_suspend(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, _done = await _suspended(ctx, ws)
        streamed = [
            e
            for e in events
            if e["type"] == "response.output_item.done"
            and isinstance(e.get("item"), dict)
            and e["item"].get("type") == "function_call"
        ]
        if not streamed:
            raise CheckFailed("the rollout suspended without streaming a function_call item")
        if any(e["type"] in TERMINAL for e in events):
            raise CheckFailed("the rollout sent a terminal event before suspending")
        await ws.expect_quiet(ctx.quiet, "while the rollout is suspended")


@check("rollout.done_shape")
async def rollout_done_shape(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, done = await _suspended(ctx, ws)
    fail_on(sequence_problems(events), "up to response.done: ")
    response = response_of(done)
    if response.get("id") != response_of(events[0]).get("id"):
        raise CheckFailed("response.done names another response than response.created")
    if response.get("status") != "in_progress":
        raise CheckFailed(
            f"response.done carries status {describe_value(response.get('status'))}, expected "
            "'in_progress'"
        )
    if response.get("usage") is not None:
        raise CheckFailed(
            f"response.done carries usage {describe_value(response.get('usage'))}, expected null"
        )
    streamed = [
        e["item"]
        for e in events
        if e["type"] == "response.output_item.done" and isinstance(e.get("item"), dict)
    ]
    if response.get("output") != streamed:
        raise CheckFailed(
            f"response.done output is {shape(response.get('output') or [])}, expected the "
            f"streamed items {shape(streamed)}"
        )
    expected = sorted(
        str(c.get("call_id")) for c in call_items(streamed) if c.get("status") == "completed"
    )
    if sorted(_pending(done)) != expected:
        raise CheckFailed(
            f"pending_call_ids is {_pending(done)}, expected the turn's call ids {expected}"
        )


@check("rollout.resume")
async def rollout_resume(ctx: Context) -> None:
    async with ctx.ws() as ws:
        all_events, rounds = await _run_rollout(ctx, ws, auto_body(ctx, rollout=True))
    if rounds == 0:
        if call_items(as_dict(all_events[-1].get("response")).get("output") or []):
            raise CheckFailed("the rollout made a tool call but ended without response.done")
        raise CheckSkipped("the model answered without calling the tool (tool_choice auto)")
    response = completed_response(all_events, "the rollout")
    fail_on(sequence_problems(all_events), "across the rollout: ")
    fail_on(order_problems(all_events, suspensions=True), "across the rollout: ")
    for n, event in enumerate(all_events[:-1]):
        if event["type"] == "response.done" and all_events[n + 1]["type"] != "response.in_progress":
            raise CheckFailed(
                f"after response.done came {all_events[n + 1]['type']}, expected "
                "response.in_progress"
            )
    streamed = [
        e["item"]
        for e in all_events
        if e["type"] == "response.output_item.done" and isinstance(e.get("item"), dict)
    ]
    if response["output"] != streamed:
        raise CheckFailed(
            f"the final output is {shape(response['output'])}, expected every streamed item "
            f"{shape(streamed)}"
        )


@check("rollout.equals_chain")
async def rollout_equals_chain(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, rounds = await _run_rollout(ctx, ws, auto_body(ctx, rollout=True))
        rollout = completed_response(events, "the rollout")
        ctx.step = "running the same conversation as a previous_response_id chain"
        chain: list[dict[str, Any]] = []
        _, response = await completed(ctx, ws, auto_body(ctx), "chain response 1")
        chain.append(response)
        while call_items(response["output"]):
            if len(chain) > MAX_ROUNDS:
                raise CheckFailed("the chain kept calling tools; expected the model to finish")
            body = auto_body(
                ctx,
                previous_response_id=response["id"],
                input=outputs_for(call_items(response["output"])),
            )
            _, response = await completed(ctx, ws, body, f"chain response {len(chain) + 1}")
            chain.append(response)
    if rounds == 0 and len(chain) == 1:
        raise CheckSkipped("the model answered without calling the tool (tool_choice auto)")
    whole = {
        "output": [item for r in chain for item in r["output"]],
        "usage": {
            "input_tokens": _sum_tokens(chain, "input_tokens"),
            "output_tokens": _sum_tokens(chain, "output_tokens"),
        },
    }
    await compare_outputs(ctx, rollout, whole, names=("the rollout", "the chain"), usage=True)


@check("rollout.partial_append")
async def rollout_partial_append(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, done = await _suspended(ctx, ws)
        pending = _pending(done)
        response_id = response_of(done)["id"]
        if len(pending) > 1:
            first, rest = [tool_output(pending[0])], [tool_output(c) for c in pending[1:]]
        else:
            first = [{"role": "user", "content": "The tool result follows."}]
            rest = [tool_output(pending[0])]
        await ws.send(append_event(response_id, first))
        await ws.expect_quiet(ctx.quiet, "after an append that leaves calls pending")
        await ws.send(append_event(response_id, rest))
        await _expect_resume(ctx, ws, done)


@check("rollout.suspend_timeout")
async def rollout_suspend_timeout(ctx: Context) -> None:
    limit = float(ctx.need("rollout_suspend_limit"))
    ctx.allow(limit + 1)
    async with ctx.ws() as ws:
        events, done = await _suspended(ctx, ws)
        ctx.step = f"waiting {limit:g}s for the suspended rollout to time out"
        rest = await ws.collect(limit=limit + ctx.timeout)
    fail_on(sequence_problems(events + rest), "across the rollout: ")
    kinds = [e["type"] for e in rest]
    if kinds not in (["response.incomplete"], ["response.in_progress", "response.incomplete"]):
        raise CheckFailed(
            f"after the suspend limit the rollout sent {kinds}, expected [response.incomplete]"
        )
    response = response_of(rest[-1])
    reason = (response.get("incomplete_details") or {}).get("reason")
    if response.get("status") != "incomplete" or reason != "rollout_timeout":
        raise CheckFailed(
            f"the timed-out rollout has status {describe_value(response.get('status'))}, reason "
            f"{describe_value(reason)}; expected 'incomplete', 'rollout_timeout'"
        )
    if response.get("id") != response_of(done).get("id"):
        raise CheckFailed("the incomplete response names another response than response.done")


@check("rollout.append_unknown_response")
async def rollout_append_unknown_response(ctx: Context) -> None:
    await _request_error(
        ctx,
        append_event(unknown_id(), [tool_output(unknown_id("call"))]),
        status=400,
        code="rollout_not_found",
        param="response_id",
    )


@check("rollout.append_completed")
async def rollout_append_completed(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, response = await completed(ctx, ws, text_body(ctx), "a text response")
        event = await first_event(
            ctx, ws, append_event(response["id"], [tool_output(unknown_id("call"))])
        )
    expect_error(event, status=400, code="response_already_completed", param="response_id")


@check("rollout.append_not_suspended")
async def rollout_append_not_suspended(ctx: Context) -> None:
    async with ctx.ws() as ws:
        created = await first_event(
            ctx,
            ws,
            {"type": "response.create", **tool_body(ctx, rollout=True, model=ctx.slow_model)},
        )
        if created["type"] != "response.created":
            raise CheckFailed(
                f"the rollout began with {created['type']}, expected response.created"
            )
        await ws.send(append_event(response_of(created)["id"], [tool_output(unknown_id("call"))]))
        sent = trio.current_time()
        ctx.step = "waiting for the answer to an early append"
        suspended_after: float | None = None  # seconds from the append to response.done
        while True:
            event = await ws.recv()
            if event["type"] == "error":
                code = (event.get("error") or {}).get("code")
                if suspended_after is not None and code == "invalid_value":
                    if suspended_after >= ctx.quiet:
                        # The append was on the server well before the rollout suspended.
                        raise CheckFailed(
                            "an append sent while the rollout sampled was not refused: it was "
                            f"answered only after response.done ({suspended_after:.2f}s later), "
                            "expected rollout_not_suspended"
                        )
                    raise CheckSkipped(
                        "the rollout suspended before the append arrived (use a slower "
                        "--slow-model to observe rollout_not_suspended)"
                    )
                expect_error(event, status=400, code="rollout_not_suspended", param="response_id")
                return
            if event["type"] == "response.done":
                suspended_after = trio.current_time() - sent
            elif event["type"] in TERMINAL:
                raise CheckFailed(
                    f"the rollout ended with {event['type']} and the early append was never "
                    "answered"
                )


@check("rollout.append_unknown_call_id")
async def rollout_append_unknown_call_id(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, done = await _suspended(ctx, ws)
        pending = _pending(done)
        response_id = response_of(done)["id"]
        event = await first_event(
            ctx, ws, append_event(response_id, [tool_output(unknown_id("call"))])
        )
        expect_error(event, status=400, code="invalid_value", param="input[0].call_id")
        await ws.expect_quiet(ctx.quiet, "after a refused append (the rollout stays suspended)")
        await ws.send(append_event(response_id, [tool_output(c) for c in pending]))
        await _expect_resume(ctx, ws, done)


@check("rollout.append_answered_call_id")
async def rollout_append_answered_call_id(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, done = await _suspended(ctx, ws)
        pending = _pending(done)
        response_id = response_of(done)["id"]
        twice = [tool_output(pending[0]), tool_output(pending[0])]
        event = await first_event(ctx, ws, append_event(response_id, twice))
        expect_error(event, status=400, code="invalid_value", param="input[1].call_id")
        await ws.expect_quiet(ctx.quiet, "after a refused append (nothing may be committed)")
        await ws.send(append_event(response_id, [tool_output(c) for c in pending]))
        await _expect_resume(ctx, ws, done)
        # The forced tool_choice makes the model call again: the earlier call id is answered.
        rest = await ws.collect(until=SUSPEND_OR_END)
        if rest[-1]["type"] != "response.done":
            return
        event = await first_event(ctx, ws, append_event(response_id, [tool_output(pending[0])]))
        expect_error(event, status=400, code="invalid_value", param="input[0].call_id")


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
    for n, event in enumerate(events):
        problems = event_problems(event, transport=transport)
        _schema_fail(f"{what}, event {n} ({describe_value(event.get('type'))})", problems)


def _json_response(result: Any, what: str) -> dict[str, Any]:
    if result.status != 200 or not isinstance(result.body, dict):
        raise CheckFailed(
            f"{what} answered HTTP {result.status}, expected 200 and a JSON object: "
            f"{describe_value(result.text)}"
        )
    body: dict[str, Any] = result.body
    return body


@check("schema.http_response")
async def schema_http_response(ctx: Context) -> None:
    result = await ctx.http("POST", "/responses", json_body=tool_body(ctx, stream=False))
    body = _json_response(result, "POST /responses (a forced tool call)")
    _schema_fail("the Response object", response_problems(body))
    if not call_items(body.get("output") or []):
        raise CheckFailed(
            f"the forced tool call produced no function_call item: {shape(body['output'])}"
        )


@check("schema.sse_events")
async def schema_sse_events(ctx: Context) -> None:
    for body, what in ((text_body(ctx), "a text response"), (tool_body(ctx), "a tool call")):
        result, events = await ctx.sse({**body, "stream": True})
        if result.status != 200 or not events:
            raise CheckFailed(f"stream: true ({what}) answered HTTP {result.status}, no events")
        _events_valid([e.data for e in events], "sse", f"the event stream of {what}")


@check("schema.ws_events")
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


@check("schema.retrieve")
async def schema_retrieve(ctx: Context) -> None:
    created = await ctx.http("POST", "/responses", json_body=tool_body(ctx, store=True))
    response_id = _json_response(created, "POST /responses (store: true)").get("id")
    got = await ctx.http("GET", f"/responses/{response_id}")
    body = _json_response(got, f"GET /responses/{response_id}")
    _schema_fail("the retrieved Response object", response_problems(body))


@check("schema.rollout_events")
async def schema_rollout_events(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, done = await _suspended(ctx, ws)
        await ws.send(
            append_event(response_of(done)["id"], [tool_output(c) for c in _pending(done)])
        )
        ctx.step = "waiting for the resumed rollout to suspend or end"
        events += await ws.collect(until=SUSPEND_OR_END)
    _events_valid(events, "ws", "a rollout")
