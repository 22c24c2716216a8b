"""The checks of the rollout extension (RX): suspend at tool calls with `response.done`
(naming the response, not carrying it), resume on appended outputs, suspensions that do not
grow with the rollout, partial appends, the suspend limit, an early append refused, and
a rollout equal to the `previous_response_id` chain. The single-request append errors
(RX-1.1, RX-4.1, RX-4.2, RX-4.4, RX-4.5) are rows of the error table (`_checks_errors`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import trio

from ._analysis import (
    as_dict,
    call_items,
    call_problems,
    completed_response,
    expect_error,
    order_problems,
    sequence_problems,
    shape,
    text_problems,
)
from ._client import TERMINAL, CheckFailed, CheckSkipped, describe_value
from ._context import DEFAULT_SLOW_MODEL, CheckSet, Context
from ._probes import compare_outputs, sum_tokens
from ._requests import append_event, auto_body, outputs_for, tool_body, tool_output, unknown_id
from ._steps import (
    MAX_ROUNDS,
    SUSPEND_OR_END,
    completed,
    expect_resume,
    fail_on,
    first_event,
    named_only,
    pending_calls,
    response_of,
    run_rollout,
    suspended,
)

__all__ = ["checks"]

checks = CheckSet()


@checks("rollout.suspend")
async def rollout_suspend(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, _done = await suspended(ctx, ws)
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


@checks("rollout.done_shape")
async def rollout_done_shape(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, done = await suspended(ctx, ws)
    fail_on(sequence_problems(events), "up to response.done: ")
    fail_on(named_only(done, response_of(events[0]).get("id")), "response.done: ")
    streamed = [
        e
        for e in events
        if e["type"] == "response.output_item.done" and isinstance(e.get("item"), dict)
    ]
    expected = sorted(
        str(c.get("call_id"))
        for c in call_items([e["item"] for e in streamed])
        if c.get("status") == "completed"
    )
    if sorted(pending_calls(done)) != expected:
        raise CheckFailed(
            f"pending_call_ids is {pending_calls(done)}, expected the turn's call ids {expected}"
        )
    indices = [e.get("output_index") for e in streamed]
    if done.get("output_indices") != indices:
        raise CheckFailed(
            f"output_indices is {describe_value(done.get('output_indices'))}, expected the "
            f"output_index of each item streamed in the step {indices}"
        )


@checks("rollout.resume")
async def rollout_resume(ctx: Context) -> None:
    async with ctx.ws() as ws:
        all_events, rounds = await run_rollout(ctx, ws, auto_body(ctx, rollout=True))
    streamed = [
        e["item"]
        for e in all_events
        if e["type"] == "response.output_item.done" and isinstance(e.get("item"), dict)
    ]
    if rounds == 0:
        final = as_dict(all_events[-1].get("response")).get("output") or []
        if call_items(streamed) or call_items(final):
            raise CheckFailed("the rollout made a tool call but ended without response.done")
        raise CheckSkipped("the model answered without calling the tool (tool_choice auto)")
    response = completed_response(all_events, "the rollout")
    fail_on(sequence_problems(all_events), "across the rollout: ")
    fail_on(order_problems(all_events, suspensions=True), "across the rollout: ")
    for n, event in enumerate(all_events[:-1]):
        if event["type"] != "response.done":
            continue
        after = all_events[n + 1]
        if after["type"] != "response.in_progress":
            raise CheckFailed(
                f"after response.done came {after['type']}, expected response.in_progress"
            )
        fail_on(named_only(after, response["id"]), "the resumed response.in_progress: ")
    if response["output"] != streamed:
        raise CheckFailed(
            f"the final output is {shape(response['output'])}, expected every streamed item in "
            f"the order streamed {shape(streamed)}"
        )
    # Each step, the resumed ones too, streams its items as WS-3.3 and WS-3.5 require: the
    # deltas a client concatenates are the text and arguments reported done.
    consistency = call_problems(all_events) if call_items(streamed) else []
    if any(item.get("type") == "message" for item in streamed):
        consistency += text_problems(all_events)
    fail_on(consistency, "across the rollout (RX-2.3: every step streams as WS-3.3, WS-3.5): ")


# Suspensions `rollout.suspension_size` compares, and how many bytes the suspension events may
# grow per step: sequence numbers and output indices gain digits (1 byte each, now and then),
# while resending the items of a step takes at least the size of one call item (~100 bytes).
SIZE_SUSPENSIONS = 4
SIZE_SLACK_PER_STEP = 16


def _json_bytes(event: Mapping[str, Any]) -> int:
    """An event's size as compact JSON (UTF-8): what it carries, whatever the spacing."""
    return len(json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode())


@checks("rollout.suspension_size")
async def rollout_suspension_size(ctx: Context) -> None:
    sizes: list[int] = []  # per suspension: response.done + the resumed response.in_progress
    streamed = 0  # bytes of the items streamed after the first suspension's
    async with ctx.ws() as ws:
        events, done = await suspended(ctx, ws)
        for n in range(SIZE_SUSPENSIONS):
            pending = pending_calls(done)
            await ws.send(append_event(response_of(done)["id"], [tool_output(c) for c in pending]))
            resumed = await expect_resume(ctx, ws, done)
            # the step's own content (its calls and items: how many a model makes varies) aside
            step_free = {**done, "pending_call_ids": [], "output_indices": []}
            sizes.append(_json_bytes(step_free) + _json_bytes(resumed))
            if n == SIZE_SUSPENSIONS - 1:
                break
            ctx.step = f"waiting for suspension {n + 2} of the forced-call rollout"
            events = await ws.collect(until=SUSPEND_OR_END)
            if events[-1]["type"] != "response.done":
                raise CheckFailed(
                    f"the forced-call rollout ended with {events[-1]['type']} after "
                    f"{n + 1} suspensions, expected {SIZE_SUSPENSIONS}"
                )
            done = events[-1]
            streamed += sum(
                _json_bytes(e["item"])
                for e in events
                if e["type"] == "response.output_item.done" and isinstance(e.get("item"), dict)
            )
    steps = SIZE_SUSPENSIONS - 1
    if sizes[-1] - sizes[0] > SIZE_SLACK_PER_STEP * steps:
        raise CheckFailed(
            f"response.done and the resumed response.in_progress grew with the rollout: "
            f"{sizes[0]} bytes at the first suspension, {sizes[-1]} at suspension "
            f"{SIZE_SUSPENSIONS} ({'/'.join(map(str, sizes))}), while the rollout streamed "
            f"{streamed} bytes of items in between; expected at most "
            f"{SIZE_SLACK_PER_STEP} bytes more per step"
        )


@checks("rollout.equals_chain")
async def rollout_equals_chain(ctx: Context) -> None:
    async with ctx.ws() as ws:
        events, rounds = await run_rollout(ctx, ws, auto_body(ctx, rollout=True))
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
            "input_tokens": sum_tokens(chain, "input_tokens"),
            "output_tokens": sum_tokens(chain, "output_tokens"),
        },
    }
    await compare_outputs(ctx, rollout, whole, names=("the rollout", "the chain"), usage=True)


@checks("rollout.partial_append")
async def rollout_partial_append(ctx: Context) -> None:
    async with ctx.ws() as ws:
        _, done = await suspended(ctx, ws)
        pending = pending_calls(done)
        response_id = response_of(done)["id"]
        if len(pending) > 1:
            first, rest = [tool_output(pending[0])], [tool_output(c) for c in pending[1:]]
        else:
            first = [{"role": "user", "content": "The tool result follows."}]
            rest = [tool_output(pending[0])]
        await ws.send(append_event(response_id, first))
        await ws.expect_quiet(ctx.quiet, "after an append that leaves calls pending")
        await ws.send(append_event(response_id, rest))
        await expect_resume(ctx, ws, done)


@checks("rollout.suspend_timeout")
async def rollout_suspend_timeout(ctx: Context) -> None:
    limit = float(ctx.need("rollout_suspend_limit"))
    ctx.allow(limit + 1)
    async with ctx.ws() as ws:
        events, done = await suspended(ctx, ws)
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


@checks("rollout.append_not_suspended")
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
                        "the rollout suspended before the append arrived (use a --slow-model "
                        f"that streams at a bounded rate, e.g. {DEFAULT_SLOW_MODEL}, to observe "
                        "rollout_not_suspended)"
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
