"""The checks of steering (ST): `response.steer` accepted, the steered response's end and its
successor; malformed steers, unknown and ended targets; `response.steer.pending` when the
response ends owing a tool call. A server without steering answers the probe steer with an
`error` (an unknown client event): these checks are then skipped (`_probes.probe_steer`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.protocol import STEER_EVENT_TYPES

from ._analysis import as_dict, call_items, completed_response, sequence_problems
from ._client import TERMINAL, CheckFailed, CheckSkipped, WsClient, describe_value
from ._context import DEFAULT_SLOW_MODEL, CheckSet, Context
from ._requests import FORCE_WEATHER, text_body, unknown_id
from ._steps import Event, fail_on, first_event, response_of

__all__ = ["LONG_CALL_TOOL", "checks", "steer_event"]

checks = CheckSet()

STEER_TEXT = "Stop there. Answer in one word instead."
# A tool whose arguments take a while to write (a long string), so that a steer sent when
# they start streaming arrives while the call is still being made.
LONG_CALL_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "write_note",
    "description": "Write a long note.",
    "parameters": {
        "type": "object",
        "properties": {"note": {"type": "string", "minLength": 400}},
        "required": ["note"],
        "additionalProperties": False,
    },
    "strict": False,
}
_ACKS = STEER_EVENT_TYPES


def steer_event(target: str, value: Any = STEER_TEXT, **extra: Any) -> dict[str, Any]:
    return {"type": "response.steer", "previous_response_id": target, "input": value, **extra}


async def _running(ctx: Context, ws: WsClient, body: Mapping[str, Any]) -> Event:
    created = await first_event(ctx, ws, {"type": "response.create", **body})
    if created["type"] != "response.created":
        raise CheckFailed(
            f"a create was answered with {created['type']}, expected response.created"
        )
    return created


def _acks(events: list[Event]) -> list[Event]:
    return [e for e in events if e.get("type") in _ACKS]


def _stream(events: list[Event]) -> list[Event]:
    """A response's own events and the steering answers in its stream (out-of-stream answers,
    sequence number 0, left out)."""
    return [e for e in events if not (e.get("type") in _ACKS and e.get("sequence_number") == 0)]


def _expect_failed(event: Event, codes: tuple[str, ...], sent: Mapping[str, Any]) -> None:
    """`response.steer.failed` with one of `codes`, returning the input as sent, no steer id."""
    if event.get("type") != "response.steer.failed":
        raise CheckFailed(
            f"a steer was answered with {event.get('type')}, expected response.steer.failed "
            f"({' or '.join(codes)})"
        )
    error = as_dict(event.get("error"))
    if error.get("code") not in codes or error.get("type") != "invalid_request_error":
        raise CheckFailed(
            f"response.steer.failed has code {describe_value(error.get('code'))}, type "
            f"{describe_value(error.get('type'))}; expected {' or '.join(codes)}, "
            "invalid_request_error"
        )
    steer = as_dict(event.get("steer"))
    if steer.get("input") != sent.get("input"):
        raise CheckFailed(
            f"response.steer.failed returns input {describe_value(steer.get('input'))}, "
            f"expected the original {describe_value(sent.get('input'))}"
        )
    if steer.get("previous_response_id") != sent.get("previous_response_id"):
        raise CheckFailed("response.steer.failed names another response than the steer did")
    if steer.get("id") is not None:
        raise CheckFailed(
            f"a steer refused before acceptance carries steer.id {describe_value(steer['id'])}"
        )


def _skip_if_too_late(ack: Event) -> None:
    """A steer the server refused because the response was already ending: the model under
    test answered faster than the steer arrived, so the rule could not be observed."""
    if ack.get("type") == "response.steer.failed" and as_dict(ack.get("error")).get("code") in (
        "response_already_completed",
        "response_not_active",
    ):
        raise CheckSkipped(
            "the response ended before the steer arrived (use a --slow-model that streams at a "
            f"bounded rate, e.g. {DEFAULT_SLOW_MODEL})"
        )


def _expect_accepted(ack: Event, target: str) -> str:
    if ack.get("type") != "response.steer.accepted":
        error = as_dict(ack.get("error"))
        raise CheckFailed(
            f"a valid steer of a running response was answered with {ack.get('type')} "
            f"{describe_value(error.get('code'))}, expected response.steer.accepted"
        )
    steer = as_dict(ack.get("steer"))
    steer_id = steer.get("id")
    if not isinstance(steer_id, str) or not steer_id:
        raise CheckFailed(f"response.steer.accepted carries steer.id {describe_value(steer_id)}")
    if steer.get("previous_response_id") != target:
        raise CheckFailed("response.steer.accepted names another response than the steer did")
    return steer_id


@checks("steer.accepted")
async def steer_accepted(ctx: Context) -> None:
    async with ctx.ws() as ws:
        created = await _running(ctx, ws, text_body(ctx, model=ctx.slow_model))
        target = response_of(created)["id"]
        await ws.send(steer_event(target))
        ctx.step = "waiting for the steered response to end"
        events = [created, *await ws.collect()]
        if not _acks(events):  # the answer may follow the end (a steer that came too late)
            ctx.step = "waiting for the steer's answer"
            events += await ws.collect(until=_ACKS)
        acks = _acks(events)
        if len(acks) != 1:
            raise CheckFailed(f"a steer was answered {len(acks)} times before the response ended")
        _skip_if_too_late(acks[0])
        _expect_accepted(acks[0], target)
        ctx.step = "waiting for the successor response"
        successor = await ws.collect()
    fail_on(sequence_problems(_stream(events)), "the steered response: ")
    end = response_of(events[-1])
    reason = as_dict(end.get("incomplete_details")).get("reason")
    if events[-1]["type"] == "response.incomplete" and reason != "steered":
        raise CheckFailed(
            f"the steered response ended incomplete with reason {describe_value(reason)}, "
            "expected 'steered'"
        )
    if events[-1]["type"] not in ("response.incomplete", "response.completed"):
        raise CheckFailed(f"the steered response ended with {events[-1]['type']}")
    first = successor[0]
    if first["type"] != "response.created":
        raise CheckFailed(
            f"after the steered response came {first['type']}, expected the successor's "
            "response.created"
        )
    if response_of(first).get("previous_response_id") != target:
        raise CheckFailed(
            "the successor's previous_response_id is "
            f"{describe_value(response_of(first).get('previous_response_id'))}, expected the "
            "steered response"
        )
    fail_on(sequence_problems(successor), "the successor: ")
    completed_response(successor, "the successor")


@checks("steer.invalid_input")
async def steer_invalid_input(ctx: Context) -> None:
    async with ctx.ws() as ws:
        created = await _running(ctx, ws, text_body(ctx, model=ctx.slow_model))
        target = response_of(created)["id"]
        invalid = [
            steer_event(target, "x", stream_id="lane"),
            steer_event(target, [{"role": "system", "content": "x"}]),
        ]
        for message in invalid:
            await ws.send(message)
        ctx.step = "waiting for the steers' answers and the response's end"
        events = [created]
        while len(_acks(events)) < len(invalid) or not any(e["type"] in TERMINAL for e in events):
            events.append(await ws.recv())
        acks = _acks(events)
        for ack, sent in zip(acks, invalid, strict=False):
            _expect_failed(ack, ("invalid_input",), sent)
        end = next(e["type"] for e in events if e["type"] in TERMINAL)
        if end != "response.completed":
            raise CheckFailed(
                f"the response ended with {end} after invalid steers, expected "
                "response.completed (nothing was accepted)"
            )
        await ws.expect_quiet(ctx.quiet, "after a response whose steers were all refused")


@checks("steer.unknown_or_completed")
async def steer_unknown_or_completed(ctx: Context) -> None:
    async with ctx.ws() as ws:
        unknown = steer_event(unknown_id())
        ctx.step = "waiting for the answer to a steer of an unknown response"
        answer = await first_event(ctx, ws, unknown)
        _expect_failed(answer, ("response_not_found",), unknown)
        ctx.step = "waiting for a response to complete"
        events = await ws.create(text_body(ctx))
        done = completed_response(events, "the response")
        ended = steer_event(done["id"])
        ctx.step = "waiting for the answer to a steer of a completed response"
        answer = await first_event(ctx, ws, ended)
        _expect_failed(answer, ("response_already_completed", "response_not_active"), ended)


@checks("steer.pending")
async def steer_pending(ctx: Context) -> None:
    body = {
        "model": ctx.slow_model,
        "input": "Write a long note about the weather in Paris.",
        "tools": [LONG_CALL_TOOL],
        "tool_choice": {**FORCE_WEATHER, "name": LONG_CALL_TOOL["name"]},
        "store": False,
    }
    async with ctx.ws() as ws:
        await ws.send({"type": "response.create", **body})
        ctx.step = "waiting for the call's arguments to stream"
        events = await ws.collect(until={"response.function_call_arguments.delta", *TERMINAL})
        if events[-1]["type"] in TERMINAL:
            raise CheckFailed(
                f"a forced function call ended with {events[-1]['type']} before streaming arguments"
            )
        target = response_of(events[0])["id"]
        await ws.send(steer_event(target))
        ctx.step = "waiting for the response to end"
        events += await ws.collect(until={"response.steer.accepted", "response.steer.failed"})
        ack = events[-1]
        if ack["type"] == "response.steer.failed":
            code = as_dict(ack.get("error")).get("code")
            if code in ("response_already_completed", "response_not_active"):
                raise CheckSkipped(
                    "the call was made before the steer arrived (use a --slow-model that "
                    f"streams tool-call arguments at a bounded rate, e.g. {DEFAULT_SLOW_MODEL})"
                )
        steer_id = _expect_accepted(ack, target)
        events += await ws.collect()
        if events[-1]["type"] != "response.completed":
            raise CheckFailed(
                f"a response steered while it made a tool call ended with {events[-1]['type']}, "
                "expected response.completed owing the call"
            )
        ctx.step = "waiting for response.steer.pending"
        pending = await ws.recv()
        await ws.expect_quiet(ctx.quiet, "after response.steer.pending (sent once per steer)")
    fail_on(sequence_problems(_stream([*events, pending])), "the steered response: ")
    calls = [c for c in call_items(response_of(events[-1]).get("output") or [])]
    if not calls:
        raise CheckFailed("the steered response completed without its function call")
    if pending["type"] != "response.steer.pending":
        raise CheckFailed(
            f"after the response completed owing a call came {pending['type']}, expected "
            "response.steer.pending"
        )
    steer = as_dict(pending.get("steer"))
    if steer.get("id") != steer_id or steer.get("previous_response_id") != target:
        raise CheckFailed(
            f"response.steer.pending names steer {describe_value(steer.get('id'))} of "
            f"{describe_value(steer.get('previous_response_id'))}, expected the accepted steer"
        )
    if pending.get("reason") != "waiting_for_required_input":
        raise CheckFailed(
            f"response.steer.pending reason is {describe_value(pending.get('reason'))}, expected "
            "'waiting_for_required_input'"
        )
    expected = [
        {"type": "function_call_output", "call_id": c.get("call_id"), "name": c.get("name")}
        for c in calls
    ]
    stubs = pending.get("required_input")
    if (
        not isinstance(stubs, list)
        or [{k: as_dict(s).get(k) for k in ("type", "call_id", "name")} for s in stubs] != expected
    ):
        raise CheckFailed(
            f"response.steer.pending required_input is {describe_value(stubs)}, expected "
            f"{describe_value(expected)}"
        )
