"""What the server supports, probed once per run: the rollout extension, lanes and steering
(features: their checks are skipped without them), and whether the model is deterministic (the
same requests twice give equal outputs modulo ids). With a deterministic model, outputs that
must be equal are compared modulo ids, otherwise their structure is compared
(`compare_outputs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._analysis import as_dict, first_difference, shape
from ._client import CheckFailed, describe_value
from ._context import Context
from ._requests import text_body, tool_body, unknown_id
from ._steps import completed, first_event

__all__ = [
    "FEATURE_PROBES",
    "compare_outputs",
    "deterministic",
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


async def probe_lanes(ctx: Context) -> str | None:
    """None when the server runs a create with `stream_id` (a lane, WS-7), else why lanes are
    absent: the server refuses the parameter, as WS-2.8 allows."""
    async with ctx.ws() as ws:
        event = await first_event(
            ctx,
            ws,
            {"type": "response.create", **text_body(ctx, stream_id="conformance.lane-probe")},
        )
    if event["type"] in ("response.created", "response.queued"):
        return None
    error = as_dict(event.get("error"))
    if event["type"] == "error" and error.get("param") == "stream_id":
        return f"the server refuses `stream_id` ({error.get('code')}): lanes are not supported"
    raise CheckFailed(
        f"a create with stream_id was answered with {event['type']} "
        f"{describe_value(error.get('code'))}: {describe_value(error.get('message'))}"
    )


async def probe_steer(ctx: Context) -> str | None:
    """None when the server answers a `response.steer` (of an unknown response) with a
    steering event, else why steering is absent: an `error` (the event type is unknown to
    it) skips the steering checks."""
    async with ctx.ws() as ws:
        probe = {"type": "response.steer", "previous_response_id": unknown_id(), "input": "?"}
        event = await first_event(ctx, ws, probe)
    if str(event["type"]).startswith("response.steer."):
        return None
    if event["type"] == "error":
        error = as_dict(event.get("error"))
        return (
            f"the server answers response.steer with error {describe_value(error.get('code'))}: "
            "steering is not supported"
        )
    raise CheckFailed(f"a response.steer was answered with {event['type']}")


FEATURE_PROBES = {"rollout": probe_rollout, "lanes": probe_lanes, "steer": probe_steer}
