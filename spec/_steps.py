"""Steps a check takes on a connection, and the verdicts they share: a response read to its
end, the first answer to a request, a rollout read to its suspension and resumed, the fields
every Response object carries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._analysis import call_items, completed_response
from ._client import TERMINAL, CheckFailed, WsClient, describe_value
from ._context import Context
from ._requests import append_event, tool_body, tool_output

__all__ = [
    "MAX_ROUNDS",
    "SUSPEND_OR_END",
    "Event",
    "completed",
    "expect_resume",
    "fail_on",
    "first_event",
    "forced_calls",
    "named_only",
    "pending_calls",
    "response_field_problems",
    "response_of",
    "run_rollout",
    "suspended",
]

Event = dict[str, Any]

# Tool rounds a rollout or chain may take before the check gives up on the model.
MAX_ROUNDS = 4
SUSPEND_OR_END = TERMINAL | {"response.done"}


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


def forced_calls(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The function calls of the response to a forced tool call: at least one."""
    calls = call_items(response.get("output") or [])
    if not calls:
        raise CheckFailed("the forced tool call produced no function_call item")
    return calls


async def first_event(ctx: Context, ws: WsClient, message: Mapping[str, Any] | str) -> Event:
    ctx.step = "waiting for the answer to a request"
    await ws.send(message)
    return await ws.recv()


def response_field_problems(response: Mapping[str, Any], *, status: str) -> list[str]:
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


# --- the rollout extension ---------------------------------------------------------------------


async def suspended(
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


def pending_calls(done: Mapping[str, Any]) -> list[str]:
    pending = done.get("pending_call_ids")
    if not isinstance(pending, list) or not pending or not all(isinstance(p, str) for p in pending):
        raise CheckFailed(
            f"response.done has pending_call_ids {describe_value(pending)}, expected a non-empty "
            "list of call ids"
        )
    return pending


def named_only(event: Mapping[str, Any], response_id: object) -> list[str]:
    """A rollout's suspension events (`response.done`, the resumed `response.in_progress`)
    name their response and carry none of it (RX-2.2, RX-2.3): its id, `status:
    "in_progress"`, no `output`, no `usage`."""
    response = event.get("response")
    if not isinstance(response, Mapping):
        return [f"response is {describe_value(response)}, expected an object naming the response"]
    problems = []
    if response.get("id") != response_id:
        problems.append(
            f"response.id is {describe_value(response.get('id'))}, expected the rollout's "
            f"{describe_value(response_id)}"
        )
    if response.get("status") != "in_progress":
        problems.append(
            f"response.status is {describe_value(response.get('status'))}, expected 'in_progress'"
        )
    if "output" in response:
        output = response["output"]
        n = len(output) if isinstance(output, list) else None
        size = describe_value(output) if n is None else f"{n} item{'' if n == 1 else 's'}"
        problems.append(
            f"the response carries its output ({size}), expected only its id and status: the "
            "items already went out as response.output_item.done"
        )
    if response.get("usage") is not None:
        problems.append(f"the response carries usage {describe_value(response['usage'])}")
    return problems


async def expect_resume(ctx: Context, ws: WsClient, done: Mapping[str, Any]) -> Event:
    ctx.step = "waiting for the rollout to resume"
    event = await ws.recv()
    if event["type"] != "response.in_progress":
        raise CheckFailed(
            f"after the append the rollout sent {event['type']}, expected response.in_progress"
        )
    if response_of(event).get("id") != response_of(done).get("id"):
        raise CheckFailed("the resumed response.in_progress names another response")
    return event


async def run_rollout(
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
            append_event(response_of(done)["id"], [tool_output(c) for c in pending_calls(done)])
        )
        events += await ws.collect(until=SUSPEND_OR_END)
        rounds += 1
    return events, rounds
