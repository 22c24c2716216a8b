"""What the server supports, probed once per run: the rollout extension, lanes, steering and
API keys (features: their checks are skipped without them, and the profile they belong to is
reported once as not supported, with the probe's evidence), and whether the model is
deterministic (the same requests twice give equal outputs modulo ids). With a deterministic
model, outputs that must be equal are compared modulo ids, otherwise their structure is
compared (`compare_outputs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._analysis import as_dict, call_items, first_difference, shape
from ._client import CheckFailed, describe_value
from ._context import Context
from ._requests import text_body, tool_body, unknown_id
from ._steps import SUSPEND_OR_END, completed

__all__ = [
    "FEATURE_PROBES",
    "PROBE_ANSWER_SECONDS",
    "compare_outputs",
    "deterministic",
    "error_text",
    "probe_auth",
    "probe_deterministic",
    "probe_lanes",
    "probe_rollout",
    "probe_steer",
    "sum_tokens",
]


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
    ctx.weaken(
        "the model is not deterministic: only the kind of the last output item was compared "
        f"({names[0]} and {names[1]})"
    )


def _tokens(response: Mapping[str, Any], key: str) -> Any:
    usage = response.get("usage")
    return usage.get(key) if isinstance(usage, dict) else None


def sum_tokens(responses: Sequence[Mapping[str, Any]], key: str) -> int | None:
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


# How long a probe waits for the answer to a client event that needs no model (a steer or an
# inject of an unknown response), in seconds: a server that knows the event answers at once;
# one that drops unknown events (WS-6.7 says it must not) stays silent, and its silence is the
# probe's answer.
PROBE_ANSWER_SECONDS = 5.0
# Error codes meaning "I do not know / do not support this parameter".
_UNSUPPORTED_CODES = ("unknown_parameter", "unsupported_parameter")


def _refusal(event: Mapping[str, Any], param: str) -> str | None:
    """How an `error` event refuses the parameter `param` (its code, its param), or None
    when it refuses something else: an error naming `param`, or an unknown/unsupported
    parameter error naming no param, or one whose message names `param`."""
    error = as_dict(event.get("error"))
    code, named = error.get("code"), error.get("param")
    message = str(error.get("message") or "")
    if named == param or (not named and code in _UNSUPPORTED_CODES) or param in message:
        where = f", param {named!r}" if named else ""
        return f"{code}{where}" if code else f"an error without a code{where}"
    return None


# The longest excerpt of an error's message quoted in a probe's evidence.
_MESSAGE_QUOTE = 80


def error_text(event: Mapping[str, Any]) -> str:
    """An `error` event's code and the start of its message's first line, quoted."""
    error = as_dict(event.get("error"))
    message = error.get("message")
    if isinstance(message, str):
        first = message.strip().split("\n")[0]
        message = first if len(first) <= _MESSAGE_QUOTE else first[:_MESSAGE_QUOTE] + "..."
    return f"{describe_value(error.get('code'))}: {describe_value(message)}"


async def probe_rollout(ctx: Context) -> str | None:
    """None when a create with `rollout: true` and a forced tool call suspends with
    `response.done` at the call, else what the server did instead: it rejected the parameter
    (`unknown_parameter`, `unsupported_parameter`, or an error naming `rollout`), or ignored it
    and ended the response at the tool call. Either way the extension is absent and its checks
    are skipped; a server that suspends claims it, and its checks run."""
    async with ctx.ws() as ws:
        await ws.send({"type": "response.create", **tool_body(ctx, rollout=True)})
        ctx.step = "probing the rollout extension (a create with rollout: true)"
        events = await ws.collect(until=SUSPEND_OR_END)
    last = events[-1]
    if last["type"] == "response.done":
        return None
    if last["type"] == "error":
        refusal = _refusal(last, "rollout")
        if refusal is not None:
            return f"rejected `rollout: true` ({refusal})"
        raise CheckFailed(f"a create with rollout: true was answered with error {error_text(last)}")
    output = as_dict(last.get("response")).get("output") or []
    if last["type"] == "response.completed":
        if call_items(output):
            return "ignored `rollout: true` and completed at the tool call"
        return "ignored `rollout: true` and completed without suspending"
    raise CheckFailed(
        f"a create with rollout: true and a forced tool call ended with {last['type']}"
    )


async def probe_lanes(ctx: Context) -> str | None:
    """None when a create with `stream_id` runs on that lane (its events echo it, WS-7), else
    why lanes are absent: the server refuses the parameter (as WS-2.8 allows), or ignores it
    and runs the response on the default lane."""
    lane = "conformance.lane-probe"
    async with ctx.ws() as ws:
        ctx.step = "probing lanes (a create with stream_id)"
        events = await ws.create(text_body(ctx, stream_id=lane))
    last = events[-1]
    if last["type"] == "error" and len(events) == 1:
        refusal = _refusal(last, "stream_id")
        if refusal is not None:
            return f"the server refuses `stream_id` ({refusal}): lanes are not supported"
        raise CheckFailed(f"a create with stream_id was answered with error {error_text(last)}")
    if not any(e.get("stream_id") == lane for e in events):
        return (
            "ignored `stream_id`: the response ran on the default lane (none of its "
            f"{len(events)} events carries the stream_id)"
        )
    return None


async def probe_steer(ctx: Context) -> str | None:
    """None when the server answers a `response.steer` (of an unknown response) with a
    steering event, else why steering is absent: an `error` (the event type is unknown to
    it), or no answer at all, skips the steering checks."""
    async with ctx.ws() as ws:
        probe = {"type": "response.steer", "previous_response_id": unknown_id(), "input": "?"}
        ctx.step = "probing steering (a response.steer of an unknown response)"
        await ws.send(probe)
        event = await ws.poll(min(PROBE_ANSWER_SECONDS, ctx.timeout))
    if event is None:
        return (
            f"no answer to response.steer within {min(PROBE_ANSWER_SECONDS, ctx.timeout):g}s: "
            "steering is not supported"
        )
    if str(event["type"]).startswith("response.steer."):
        return None
    if event["type"] == "error":
        return (
            f"the server answers response.steer with error {error_text(event)}: steering is "
            "not supported"
        )
    raise CheckFailed(f"a response.steer was answered with {event['type']}")


async def probe_auth(ctx: Context) -> str | None:
    """None when the server refuses a create sent without the API key (whatever the status:
    the checks say whether it is the right one), else why the auth checks cannot apply: the
    server served it without a key."""
    body = {"model": ctx.model, "input": "Say OK.", "max_output_tokens": 16, "store": False}
    result = await ctx.http("POST", "/responses", json_body=body, auth=False)
    if result.status < 400:
        return (
            f"POST /responses without an API key was answered HTTP {result.status}: the "
            "server does not check API keys"
        )
    return None


FEATURE_PROBES = {
    "rollout": probe_rollout,
    "lanes": probe_lanes,
    "steer": probe_steer,
    "auth": probe_auth,
}
