"""The WebSocket checks of the connection (WS-1), of `response.create` (WS-2), of queueing and
limits (WS-5) and of a request error keeping the socket (WS-6.1). The single-request error
checks (WS-6.2 to WS-6.8, WS-5.3) are rows of the error table (`_checks_errors`)."""

from __future__ import annotations

import trio

from ._analysis import (
    completed_response,
    error_problems,
    expect_error,
    sequence_problems,
    shape,
)
from ._client import TERMINAL, CheckFailed, CheckSkipped, WsClient, describe_value
from ._context import CheckSet, Context
from ._probes import compare_outputs
from ._requests import (
    SDK_HEADERS,
    TEXT_PROMPT,
    WARMUP_INPUT,
    WARMUP_INSTRUCTIONS,
    WEATHER_TOOL,
    text_body,
    tool_body,
    unknown_id,
)
from ._steps import completed, fail_on, first_event, response_of

__all__ = ["checks"]

checks = CheckSet()

# A connection left idle (with pings) this long must stay open (WS-1.5).
IDLE_SECONDS = 1.0

# === WS-1: connection ========================================================================


async def _smoke(ctx: Context, ws: WsClient) -> None:
    await completed(ctx, ws, text_body(ctx), "a response on the new connection")


@checks("ws.upgrade_minimal")
async def ws_upgrade_minimal(ctx: Context) -> None:
    async with ctx.ws() as ws:
        if ws.conn.subprotocol:
            raise CheckFailed(
                f"the server chose subprotocol {ws.conn.subprotocol!r}; none was offered"
            )
        await _smoke(ctx, ws)


@checks("ws.upgrade_extra_headers")
async def ws_upgrade_extra_headers(ctx: Context) -> None:
    async with ctx.ws(headers=SDK_HEADERS) as ws:
        await _smoke(ctx, ws)


@checks("ws.upgrade_query_params")
async def ws_upgrade_query_params(ctx: Context) -> None:
    async with ctx.ws(query={"api-version": "2025-04-01-preview", "conformance": "1"}) as ws:
        await _smoke(ctx, ws)


@checks("ws.frames")
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


@checks("ws.idle_ping")
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


@checks("ws.open_after_terminal")
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


@checks("ws.create_text")
async def ws_create_text(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, _ = await completed(ctx, ws, text_body(ctx), "a text response")
        if events[0]["type"] not in ("response.created", "response.queued"):
            raise CheckFailed(f"the first event is {events[0]['type']}, expected response.created")
        if not any(e["type"] == "response.output_text.delta" for e in events):
            raise CheckFailed("the response streamed no output_text.delta")
        await ws.ping()


@checks("ws.stream_true")
async def ws_stream_true(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, with_stream = await completed(
            ctx, ws, text_body(ctx, stream=True), "a create with stream: true"
        )
        _, without = await completed(ctx, ws, text_body(ctx), "a create without stream")
    await compare_outputs(ctx, with_stream, without, names=("with stream: true", "without"))


@checks("ws.explicit_nulls")
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


@checks("ws.short_form_message")
async def ws_short_form_message(ctx: Context) -> None:
    body = text_body(ctx, input=[{"role": "user", "content": TEXT_PROMPT}])
    async with ctx.ws() as ws:
        await completed(ctx, ws, body, "a create with a short-form user message")


@checks("ws.sequential_creates")
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


@checks("ws.warmup")
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


@checks("ws.warmup_chain")
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


@checks("ws.stream_id")
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


# === WS-5: queueing and limits ===============================================================


@checks("ws.fifo_queue")
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


@checks("ws.queue_limit")
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


@checks("ws.connection_age_limit")
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


@checks("ws.error_keeps_socket")
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
