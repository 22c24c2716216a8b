"""The checks of WebSocket lanes (`stream_id`, WS-7): every event and error of a laned request
echoes its lane, bad lane ids and the 33rd lane are refused with their codes, a lane is FIFO,
lanes run concurrently, more than 16 responses in flight are queued, and a continuation may
fork from another lane's response, whose failure keeps that parent cached.

They are the `lanes` feature: a server that refuses `stream_id` (WS-2.8 allows it) has them
skipped, never passed (`_probes.probe_lanes`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ._analysis import as_dict, completed_response, expect_error, sequence_problems
from ._client import TERMINAL, CheckFailed, CheckSkipped, WsClient, describe_value
from ._context import CheckSet, Context
from ._probes import compare_outputs
from ._requests import outputs_for, text_body, tool_body, tool_output, unknown_id
from ._steps import Event, completed, fail_on, first_event, forced_calls, response_of

__all__ = ["LANE_LIMIT", "MAX_IN_FLIGHT", "checks", "lane"]

checks = CheckSet()

# Named lanes a connection must accept (OpenAI's limit; the default lane is not one).
LANE_LIMIT = 32
# Responses in flight across lanes past which creates must be queued (OpenAI's limit).
MAX_IN_FLIGHT = 16
# Lane ids a server must refuse (WS-7.2): empty, one character too long, a character outside
# [A-Za-z0-9_.-].
BAD_LANE_IDS = ("", "x" * 257, "conformance lane")
# The longest valid lane id, using every kind of character allowed.
LONGEST_LANE_ID = ("Az09_.-" * 37)[:256]


def lane(n: int | str) -> str:
    return f"conformance.lane-{n}"


def lane_of(event: Mapping[str, Any]) -> Any:
    return event.get("stream_id")


def _echo_problems(events: Sequence[Event], expected: str | None, what: str) -> list[str]:
    for event in events:
        if lane_of(event) != expected:
            wanted = f"stream_id {expected!r}" if expected is not None else "no stream_id"
            return [
                f"{event['type']} of {what} carries stream_id "
                f"{describe_value(lane_of(event))}, expected {wanted}"
            ]
    return []


async def read_lanes(
    ctx: Context, ws: WsClient, lanes: Collection[str | None], what: str
) -> tuple[dict[str | None, list[Event]], list[Event]]:
    """Events up to a terminal one on each of `lanes` (one request each): the events by lane,
    and all of them in arrival order. An event on a lane not asked for fails the check."""
    ctx.step = f"waiting for {what}"
    by_lane: dict[str | None, list[Event]] = {name: [] for name in lanes}
    order: list[Event] = []
    open_lanes = set(lanes)
    while open_lanes:
        event = await ws.recv()
        name = lane_of(event)
        if name not in by_lane:
            raise CheckFailed(
                f"{event['type']} arrived with stream_id {describe_value(name)}, a lane no "
                f"request of {what} named"
            )
        if name not in open_lanes:
            raise CheckFailed(f"{event['type']} arrived on lane {name!r} after its terminal event")
        by_lane[name].append(event)
        order.append(event)
        if event["type"] in TERMINAL:
            open_lanes.discard(name)
    return by_lane, order


async def send_create(ws: WsClient, body: Mapping[str, Any]) -> None:
    await ws.send({"type": "response.create", **body})


# === WS-7: lanes ============================================================================


@checks("lanes.echo")
async def lanes_echo(ctx: Context) -> None:
    name = lane("echo")
    async with ctx.ws() as ws:
        events, _ = await completed(
            ctx, ws, text_body(ctx, stream_id=name), "a text response on a lane"
        )
        fail_on(_echo_problems(events, name, f"the response on lane {name!r}"))
        events, _ = await completed(
            ctx, ws, tool_body(ctx, stream_id=name), "a tool-call response on a lane"
        )
        fail_on(_echo_problems(events, name, f"the tool-call response on lane {name!r}"))
        events, _ = await completed(ctx, ws, text_body(ctx), "a response on the default lane")
        fail_on(_echo_problems(events, None, "the response on the default lane"))
        body = text_body(ctx, stream_id=name, previous_response_id=unknown_id())
        error = await first_event(ctx, ws, {"type": "response.create", **body})
        expect_error(error, code="previous_response_not_found", param="previous_response_id")
        fail_on(_echo_problems([error], name, f"the request error on lane {name!r}"))


@checks("lanes.invalid_stream_id")
async def lanes_invalid_stream_id(ctx: Context) -> None:
    async with ctx.ws() as ws:
        for bad in BAD_LANE_IDS:
            ctx.step = f"a create with stream_id {describe_value(bad)}"
            event = await first_event(
                ctx, ws, {"type": "response.create", **text_body(ctx, stream_id=bad)}
            )
            try:
                expect_error(event, code="invalid_stream_id", param="stream_id")
            except CheckFailed as exc:
                raise CheckFailed(f"stream_id {describe_value(bad)}: {exc}") from None
            if lane_of(event) is not None:
                raise CheckFailed(
                    f"the invalid_stream_id error echoes stream_id {describe_value(lane_of(event))}"
                    ", expected none (the id names no lane)"
                )
        events, _ = await completed(
            ctx,
            ws,
            text_body(ctx, stream_id=LONGEST_LANE_ID),
            "a create with a 256-character stream_id",
        )
        fail_on(_echo_problems(events, LONGEST_LANE_ID, "the response on the 256-character lane"))


@checks("lanes.limit")
async def lanes_limit(ctx: Context) -> None:
    async with ctx.ws() as ws:
        for n in range(1, LANE_LIMIT + 1):
            events = await ws.create(text_body(ctx, stream_id=lane(n), generate=False))
            if events[-1]["type"] == "error":
                code = as_dict(events[-1].get("error")).get("code")
                raise CheckFailed(
                    f"lane {n} of {LANE_LIMIT} was refused with error {describe_value(code)}; "
                    f"a connection must accept {LANE_LIMIT} named lanes"
                )
            completed_response(events, f"the warm-up on lane {n}")
        extra = lane(LANE_LIMIT + 1)
        event = await first_event(
            ctx, ws, {"type": "response.create", **text_body(ctx, stream_id=extra)}
        )
        try:
            expect_error(event, code="websocket_stream_limit_reached", param="stream_id")
        except CheckFailed as exc:
            raise CheckFailed(f"lane {LANE_LIMIT + 1}: {exc}") from None
        fail_on(_echo_problems([event], extra, f"the refusal of lane {LANE_LIMIT + 1}"))
        await completed(ctx, ws, text_body(ctx, stream_id=lane(1)), "a create on lane 1 again")
        await completed(ctx, ws, text_body(ctx), "a create on the default lane")


@checks("lanes.fifo")
async def lanes_fifo(ctx: Context) -> None:
    name = lane("fifo")
    body = text_body(ctx, model=ctx.slow_model, stream_id=name)
    async with ctx.ws() as ws:
        await send_create(ws, body)
        await send_create(ws, body)
        ctx.step = "waiting for two creates on one lane"
        first = await ws.collect()
        second = await ws.collect()
    for n, events in enumerate((first, second), start=1):
        if events[-1]["type"] == "error":
            error = as_dict(events[-1].get("error"))
            raise CheckFailed(
                f"create {n} of 2 on lane {name!r} was refused with "
                f"{describe_value(error.get('code'))}: {describe_value(error.get('message'))}"
            )
        created = [e for e in events if e["type"] == "response.created"]
        if len(created) != 1:
            raise CheckFailed(
                f"create {n} of 2 on lane {name!r}: {len(created)} response.created events "
                "before its terminal event, expected one (a lane's responses must not overlap)"
            )
        completed_response(events, f"create {n} of 2 on lane {name!r}")
        fail_on(sequence_problems(events), f"create {n} of 2: ")
        fail_on(_echo_problems(events, name, f"create {n} of 2"))
    if response_of(first[-1]).get("id") == response_of(second[-1]).get("id"):
        raise CheckFailed("both creates were answered by the same response")


@checks("lanes.concurrent")
async def lanes_concurrent(ctx: Context) -> None:
    a, b = lane("a"), lane("b")
    async with ctx.ws() as ws:
        await send_create(ws, text_body(ctx, model=ctx.slow_model, stream_id=a))
        await send_create(ws, text_body(ctx, model=ctx.slow_model, stream_id=b))
        by_lane, order = await read_lanes(ctx, ws, (a, b), "responses on two lanes")
    for name in (a, b):
        completed_response(by_lane[name], f"the response on lane {name!r}")
        fail_on(sequence_problems(by_lane[name]), f"lane {name!r}: ")
    started = {name: next(i for i, e in enumerate(order) if lane_of(e) == name) for name in (a, b)}
    ended = {name: max(i for i, e in enumerate(order) if lane_of(e) == name) for name in (a, b)}
    if started[b] > ended[a]:
        raise CheckFailed(
            f"the response on lane {b!r} started (event {started[b]}) only after the one on lane "
            f"{a!r} ended (event {ended[a]}): lanes must run concurrently"
        )


@checks("lanes.in_flight")
async def lanes_in_flight(ctx: Context) -> None:
    bound = ctx.options.max_queued_creates
    if bound is not None and bound < 1:
        raise CheckSkipped(f"the server queues no create (--max-queued-creates {bound})")
    names = [lane(f"flight-{n}") for n in range(1, MAX_IN_FLIGHT + 2)]
    async with ctx.ws() as ws:
        for name in names:
            await send_create(ws, text_body(ctx, model=ctx.slow_model, stream_id=name))
        by_lane, _ = await read_lanes(
            ctx, ws, names, f"{len(names)} responses on {len(names)} lanes"
        )
    for n, name in enumerate(names, start=1):
        events = by_lane[name]
        if events[-1]["type"] == "error":
            error = as_dict(events[-1].get("error"))
            raise CheckFailed(
                f"create {n} of {len(names)} (lane {name!r}) was refused with error "
                f"{describe_value(error.get('code'))}: more than {MAX_IN_FLIGHT} responses in "
                "flight must be queued, not refused"
            )
        completed_response(events, f"create {n} of {len(names)}")
    ids = {response_of(by_lane[name][-1]).get("id") for name in names}
    if len(ids) != len(names):
        raise CheckFailed(f"{len(names)} creates were answered by {len(ids)} distinct responses")


async def _forced_call(ctx: Context, ws: WsClient, name: str) -> tuple[dict[str, Any], Any]:
    """A completed store: false response on lane `name` ending in a function call: it and its
    calls' outputs."""
    _, response = await completed(
        ctx, ws, tool_body(ctx, stream_id=name), f"a tool-call response on lane {name!r}"
    )
    return response, outputs_for(forced_calls(response))


@checks("lanes.fork")
async def lanes_fork(ctx: Context) -> None:
    source, fork = lane("source"), lane("fork")
    async with ctx.ws() as ws:
        parent, outputs = await _forced_call(ctx, ws, source)
        body = tool_body(ctx, previous_response_id=parent["id"], input=outputs, tool_choice="none")
        events, forked = await completed(
            ctx, ws, {**body, "stream_id": fork}, f"a continuation on lane {fork!r}"
        )
        fail_on(_echo_problems(events, fork, f"the continuation on lane {fork!r}"))
        if forked.get("previous_response_id") != parent["id"]:
            raise CheckFailed(
                "the fork's previous_response_id is "
                f"{describe_value(forked.get('previous_response_id'))}, expected {parent['id']!r}"
            )
        _, same = await completed(
            ctx, ws, {**body, "stream_id": source}, f"the same continuation on lane {source!r}"
        )
    await compare_outputs(ctx, forked, same, names=("forked on another lane", "on its own lane"))


@checks("lanes.fork_failure")
async def lanes_fork_failure(ctx: Context) -> None:
    source, fork = lane("source"), lane("failing-fork")
    async with ctx.ws() as ws:
        parent, outputs = await _forced_call(ctx, ws, source)
        wrong = [tool_output("call_conformance_unknown")]
        bad = tool_body(ctx, previous_response_id=parent["id"], input=wrong, tool_choice="none")
        ctx.step = "a failing continuation on another lane"
        error = await first_event(ctx, ws, {"type": "response.create", **bad, "stream_id": fork})
        if error["type"] != "error":
            raise CheckFailed(
                f"a continuation answering an unknown call was answered with {error['type']}, "
                "expected error"
            )
        fail_on(_echo_problems([error], fork, f"the failed continuation on lane {fork!r}"))
        good = tool_body(ctx, previous_response_id=parent["id"], input=outputs, tool_choice="none")
        events = await ws.create({**good, "stream_id": source})
        if events[-1]["type"] == "error":
            code = as_dict(events[-1].get("error")).get("code")
            raise CheckFailed(
                f"after a failed fork on lane {fork!r}, continuing the parent on its own lane "
                f"{source!r} was refused with {describe_value(code)}: a failed fork must keep "
                "the parent"
            )
        completed_response(events, f"the continuation on lane {source!r} after a failed fork")
        # A failure on the parent's own lane evicts it (WS-4.5, per lane).
        parent, outputs = await _forced_call(ctx, ws, source)
        bad = {**bad, "previous_response_id": parent["id"], "stream_id": source}
        await first_event(ctx, ws, {"type": "response.create", **bad})
        good = {**good, "previous_response_id": parent["id"], "input": outputs}
        event = await first_event(ctx, ws, {"type": "response.create", **good, "stream_id": source})
        try:
            expect_error(event, code="previous_response_not_found", param="previous_response_id")
        except CheckFailed as exc:
            raise CheckFailed(
                f"after a failed continuation on its own lane, its store: false parent must be "
                f"evicted: {exc}"
            ) from None
