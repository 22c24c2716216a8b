"""The checks of the multi-agent beta's injection (MA): on a connection opened with
`OpenAI-Beta: responses_multi_agent=v1`, a `multi_agent` response waits at its tool calls
(no terminal event, no `response.done`) until `response.inject` delivers their outputs, acks
each inject in the response's own sequence and goes on in the same response; injects into a
completed or unknown response fail with the SDK's codes and their input returned; without
the header the beta is refused. The feature is probed (`probe_multi_agent`): a server that
does not answer `response.inject` with an inject event has its checks skipped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout.protocol import MULTI_AGENT_BETA

from ._analysis import (
    as_dict,
    call_items,
    completed_response,
    order_problems,
    sequence_problems,
    shape,
)
from ._client import TERMINAL, CheckFailed, CheckSkipped, WsClient, describe_value
from ._context import CheckSet, Context
from ._probes import PROBE_ANSWER_SECONDS, error_text
from ._requests import auto_body, text_body, tool_output, unknown_id
from ._steps import MAX_ROUNDS, Event, completed, fail_on, first_event, response_of

__all__ = [
    "BETA_HEADERS",
    "checks",
    "inject_event",
    "multi_agent_body",
    "probe_multi_agent",
]

checks = CheckSet()

# The handshake header of the beta (what the Agents SDK's hosted multi-agent model sends).
BETA_HEADERS = {"OpenAI-Beta": MULTI_AGENT_BETA}


def multi_agent_body(body: Mapping[str, Any]) -> dict[str, Any]:
    return {**body, "multi_agent": {"enabled": True}}


def inject_event(response_id: str, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"type": "response.inject", "response_id": response_id, "input": list(items)}


async def probe_multi_agent(ctx: Context) -> str | None:
    """None when a beta connection answers a `response.inject` of an unknown response with an
    inject event (`response.inject.failed`), else why the injection checks cannot run: an
    `error` (the event type is unknown to the server), or no answer at all. (A server that
    merely ignores `multi_agent` in a create would complete at the tool call; asking about
    the inject itself tells the two apart without a model.)"""
    wait = min(PROBE_ANSWER_SECONDS, ctx.timeout)
    async with ctx.ws(headers=BETA_HEADERS) as ws:
        ctx.step = "probing the multi-agent beta (a response.inject of an unknown response)"
        await ws.send(inject_event(unknown_id(), [tool_output(unknown_id("call"))]))
        event = await ws.poll(wait)
    if event is None:
        return (
            f"no answer to response.inject within {wait:g}s: the multi-agent beta "
            "(response.inject) is not supported"
        )
    if str(event["type"]).startswith("response.inject."):
        return None
    if event["type"] == "error":
        return (
            f"the server answers response.inject with error {error_text(event)}: the "
            "multi-agent beta (response.inject) is not supported"
        )
    raise CheckFailed(f"a response.inject was answered with {event['type']}")


async def _run_injecting(ctx: Context, ws: WsClient) -> tuple[list[Event], int, int, str]:
    """A multi-agent response to its end, injecting each function call's output as soon as
    its `output_item.done` arrives (as the Agents SDK does). Returns the response's events,
    the injects sent, the acks received, and how an inject was refused ('' if none was)."""
    ctx.step = "running a multi-agent response"
    await ws.send({"type": "response.create", **multi_agent_body(auto_body(ctx))})
    events: list[Event] = []
    injects = acks = 0
    refused = ""
    response_id: str | None = None
    while True:
        event = await ws.recv()
        kind = event["type"]
        if kind == "error" or kind == "response.inject.failed":
            error = as_dict(event.get("error"))
            code, message = describe_value(error.get("code")), describe_value(error.get("message"))
            what = f"{kind} {code}: {message}"
            if not injects:
                raise CheckFailed(f"the create was answered with {what}")
            refused = refused or f"an inject was answered with {what}"
            continue
        events.append(event)
        if kind == "response.created":
            response_id = response_of(event).get("id")
        elif kind == "response.done":
            raise CheckFailed(
                "a multi-agent response sent response.done: it must wait for response.inject "
                "without any event"
            )
        elif kind == "response.inject.created":
            acks += 1
            if event.get("response_id") != response_id:
                named = describe_value(event.get("response_id"))
                raise CheckFailed(
                    f"response.inject.created names response {named}, expected the injected "
                    f"response {describe_value(response_id)}"
                )
            if acks > injects:
                raise CheckFailed("response.inject.created arrived for no inject")
        elif kind == "response.output_item.done":
            item = as_dict(event.get("item"))
            if item.get("type") == "function_call" and item.get("status") == "completed":
                if injects == MAX_ROUNDS:
                    raise CheckFailed(
                        f"the model called the tool {injects} times; expected it to finish"
                    )
                if response_id is None:
                    raise CheckFailed("a function call arrived before response.created")
                await ws.send(inject_event(response_id, [tool_output(str(item.get("call_id")))]))
                injects += 1
        if kind in TERMINAL:
            return events, injects, acks, refused


@checks("inject.resume")
async def inject_resume(ctx: Context) -> None:
    async with ctx.ws(headers=BETA_HEADERS) as ws:
        events, injects, acks, refused = await _run_injecting(ctx, ws)
    if injects == 0:
        raise CheckSkipped("the model answered without calling the tool (tool_choice auto)")
    if acks != injects:
        raise CheckFailed(
            f"{injects} inject(s) were sent but {acks} acknowledged with "
            f"response.inject.created before the response ended with {events[-1]['type']}"
            + (f" ({refused})" if refused else "")
        )
    response = completed_response(events, "the multi-agent response")
    fail_on(sequence_problems(events), "across the response, its acks included: ")
    fail_on(order_problems(events), "across the response: ")
    streamed = [
        e["item"]
        for e in events
        if e["type"] == "response.output_item.done" and isinstance(e.get("item"), dict)
    ]
    if response["output"] != streamed:
        raise CheckFailed(
            f"the final output is {shape(response['output'])}, expected every streamed item "
            f"{shape(streamed)}"
        )
    if not call_items(streamed) or streamed[-1].get("type") != "message":
        raise CheckFailed(
            f"the response's output is {shape(streamed)}: expected its tool call(s), then the "
            "model's answer after the injected output, in the same response"
        )


async def _failed_ack(ctx: Context, ws: WsClient, sent: Event, code: str) -> None:
    ctx.step = "waiting for the answer to an inject"
    await ws.send(sent)
    event = await ws.recv()
    if event["type"] != "response.inject.failed":
        detail = event["type"]
        if detail == "error":
            detail += f" {describe_value(as_dict(event.get('error')).get('code'))}"
        raise CheckFailed(f"the inject was answered with {detail}, expected response.inject.failed")
    error = as_dict(event.get("error"))
    if error.get("code") != code:
        raise CheckFailed(
            f"response.inject.failed has error.code {describe_value(error.get('code'))}, "
            f"expected {code!r}"
        )
    if event.get("response_id") != sent["response_id"]:
        raise CheckFailed(
            f"response.inject.failed names {describe_value(event.get('response_id'))}, expected "
            f"the inject's response {describe_value(sent['response_id'])}"
        )
    if event.get("input") != sent["input"]:
        raise CheckFailed(
            f"response.inject.failed returns input {describe_value(event.get('input'))}, "
            f"expected the uncommitted input unchanged {describe_value(sent['input'])}"
        )
    await ws.expect_quiet(ctx.quiet, "after response.inject.failed")


@checks("inject.completed")
async def inject_completed(ctx: Context) -> None:
    async with ctx.ws(headers=BETA_HEADERS) as ws:
        _, response = await completed(
            ctx, ws, multi_agent_body(text_body(ctx)), "a multi-agent text response"
        )
        sent = inject_event(str(response["id"]), [tool_output(unknown_id("call"))])
        await _failed_ack(ctx, ws, sent, "response_already_completed")


@checks("inject.unknown_response")
async def inject_unknown_response(ctx: Context) -> None:
    async with ctx.ws(headers=BETA_HEADERS) as ws:
        sent = inject_event(unknown_id(), [tool_output(unknown_id("call"))])
        await _failed_ack(ctx, ws, sent, "response_not_found")


@checks("inject.beta_required")
async def inject_beta_required(ctx: Context) -> None:
    async with ctx.ws() as ws:
        ctx.step = "creating a multi_agent response without the beta header"
        event = await first_event(
            ctx, ws, {"type": "response.create", **multi_agent_body(text_body(ctx))}
        )
        if event["type"] != "error":
            raise CheckFailed(
                f"a multi_agent create without 'OpenAI-Beta: {MULTI_AGENT_BETA}' was answered "
                f"with {event['type']}: it was not refused"
            )
        param = as_dict(event.get("error")).get("param")
        if param != "multi_agent":
            raise CheckFailed(
                f"the refusal of multi_agent without the beta names param {describe_value(param)}, "
                "expected 'multi_agent'"
            )
        ctx.step = "injecting without the beta header"
        event = await first_event(ctx, ws, inject_event(unknown_id(), [tool_output("call_x")]))
        if event["type"] != "error":
            raise CheckFailed(
                f"response.inject without 'OpenAI-Beta: {MULTI_AGENT_BETA}' was answered with "
                f"{event['type']}: it was not refused"
            )
        if event.get("status") != 400:
            raise CheckFailed(
                f"the refusal of response.inject without the beta has status "
                f"{describe_value(event.get('status'))}, expected 400"
            )
