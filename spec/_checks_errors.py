"""The error checks as a table: one `ErrorRow` per check (its id, its rule in PROTOCOL.md, the
transport, the bad request, the error expected), and one function, `run_row`, that runs a row.

A row may first put the server in a state (`Setup`: a completed response, a suspended
rollout, a response on a connection already closed) whose ids the request names, and may
then verify what must still hold after the error (`After`: the socket serves the next create,
the rollout stays suspended and resumes). Each failure says which field of the error differed,
as `error_problems` words it, e.g. `error.code: expected 'model_not_found', observed ...`.

The error checks that do more than one request and one answer (an age limit, a queue bound, an
early append, a failed continuation that must evict its parent, API keys) are written out in
the module of their subject.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable, Mapping
from types import EllipsisType
from typing import Any, Literal

import attrs

from ._analysis import expect_error
from ._client import CheckFailed, WsClient, describe_value
from ._context import CheckSet, Context
from ._requests import (
    TEXT_PROMPT,
    append_event,
    create,
    text_body,
    tool_body,
    tool_output,
    unknown_id,
)
from ._steps import (
    SUSPEND_OR_END,
    Event,
    completed,
    expect_resume,
    first_event,
    pending_calls,
    response_of,
    suspended,
)

__all__ = ["ERROR_ROWS", "After", "ErrorRow", "Prior", "Setup", "checks", "run_row"]

# How far beyond the server's message size limit the oversized requests go, in bytes.
OVERSIZE = 1024


@attrs.frozen(kw_only=True)
class Prior:
    """What a row's setup left behind for its request to name: a response id and, for a
    suspended rollout, its `response.done` event and pending call ids."""

    response_id: str = ""
    done: Event = attrs.field(factory=dict)
    pending: tuple[str, ...] = ()


# A request: a JSON body (HTTP) or client event (WebSocket), or text/bytes sent as they are.
Request = Callable[[Context, Prior], Mapping[str, Any] | str | bytes]


@attrs.frozen
class Setup:
    """What runs before the bad request. `separate`: on a connection of its own, closed before
    the request's connection opens (else on the request's own connection)."""

    run: Callable[[Context, WsClient], Awaitable[Prior]]
    separate: bool = False


@attrs.frozen
class After:
    """What must still hold on the connection after the error."""

    run: Callable[[Context, WsClient, Prior], Awaitable[None]]


async def _nothing_before(ctx: Context, ws: WsClient) -> Prior:
    return Prior()


async def _completed_response(ctx: Context, ws: WsClient) -> Prior:
    _, response = await completed(ctx, ws, text_body(ctx), "a text response")
    return Prior(response_id=response["id"])


async def _store_false_response(ctx: Context, ws: WsClient) -> Prior:
    _, response = await completed(ctx, ws, text_body(ctx, store=False), "a store: false response")
    return Prior(response_id=response["id"])


async def _suspended_rollout(ctx: Context, ws: WsClient) -> Prior:
    _, done = await suspended(ctx, ws)
    pending = tuple(pending_calls(done))
    return Prior(response_id=response_of(done)["id"], done=done, pending=pending)


NOTHING = Setup(_nothing_before)
COMPLETED = Setup(_completed_response)
STORE_FALSE_ELSEWHERE = Setup(_store_false_response, separate=True)
SUSPENDED = Setup(_suspended_rollout)


async def _nothing_after(ctx: Context, ws: WsClient, prior: Prior) -> None:
    pass


async def _serves_next_create(ctx: Context, ws: WsClient, prior: Prior) -> None:
    await completed(ctx, ws, text_body(ctx), "a create after the refused message")


async def _stays_suspended(ctx: Context, ws: WsClient, prior: Prior) -> None:
    """The refused append committed nothing and ended nothing: silence, then a correct
    append resumes the rollout."""
    await ws.expect_quiet(
        ctx.quiet, "after a refused append (the rollout stays suspended, nothing is committed)"
    )
    await ws.send(append_event(prior.response_id, [tool_output(c) for c in prior.pending]))
    await expect_resume(ctx, ws, prior.done)


async def _then_refuses_answered(ctx: Context, ws: WsClient, prior: Prior) -> None:
    """As `_stays_suspended`; then, at the next suspension (the forced tool_choice makes the
    model call again), an output for the call answered before is refused too."""
    await _stays_suspended(ctx, ws, prior)
    rest = await ws.collect(until=SUSPEND_OR_END)
    if rest[-1]["type"] != "response.done":
        return
    answered = [tool_output(prior.pending[0])]
    event = await first_event(ctx, ws, append_event(prior.response_id, answered))
    expect_error(event, status=400, code="invalid_value", param="input[0].call_id")


NOTHING_AFTER = After(_nothing_after)
SERVES_NEXT_CREATE = After(_serves_next_create)
STAYS_SUSPENDED = After(_stays_suspended)
STAYS_SUSPENDED_AND_REMEMBERS = After(_then_refuses_answered)


@attrs.frozen(kw_only=True)
class ErrorRow:
    """One error check: send `request` over `transport` (after `setup`), expect one error
    with `status`, `code`, `param` (`...`: not checked) and `error_type` (None: any string), then
    verify `after`."""

    id: str
    rule: str
    transport: Literal["http", "ws"]
    request: Request
    status: int
    code: str
    param: str | EllipsisType | None
    error_type: str | None = "invalid_request_error"
    setup: Setup = NOTHING
    after: After = NOTHING_AFTER


def _oversized_body(ctx: Context, prior: Prior) -> bytes:
    limit = int(ctx.need("max_message_size"))
    return json.dumps(text_body(ctx, input="x" * (limit + OVERSIZE))).encode()


def _oversized_event(ctx: Context, prior: Prior) -> str:
    limit = int(ctx.need("max_message_size"))
    return json.dumps(create(ctx, input="x" * (limit + OVERSIZE)))


NO_SUCH_MODEL = "conformance-no-such-model"

ERROR_ROWS: tuple[ErrorRow, ...] = (
    # --- HTTP-2: errors over HTTP, and RX-1.1 ---
    ErrorRow(
        id="http.error_unknown_parameter", rule="HTTP-2.1", transport="http",
        request=lambda ctx, p: text_body(ctx, frobnicate=1),
        status=400, code="unknown_parameter", param="frobnicate",
    ),
    ErrorRow(
        id="http.error_model_not_found", rule="HTTP-2.2", transport="http",
        request=lambda ctx, p: text_body(ctx, model=NO_SUCH_MODEL),
        status=404, code="model_not_found", param="model",
    ),
    ErrorRow(
        id="http.error_previous_response_not_found", rule="HTTP-2.3", transport="http",
        request=lambda ctx, p: text_body(ctx, previous_response_id=unknown_id()),
        status=400, code="previous_response_not_found", param="previous_response_id",
    ),
    ErrorRow(
        id="http.error_body_too_large", rule="HTTP-2.4", transport="http",
        request=_oversized_body,
        status=413, code="message_too_large", param=..., error_type=None,
    ),
    ErrorRow(
        id="rollout.http_rejected", rule="RX-1.1", transport="http",
        request=lambda ctx, p: tool_body(ctx, rollout=True),
        status=400, code="unsupported_parameter", param="rollout",
    ),
    # --- WS-4: continuation errors ---
    ErrorRow(
        id="ws.previous_response_not_found", rule="WS-4.3", transport="ws",
        request=lambda ctx, p: create(ctx, previous_response_id=unknown_id()),
        status=400, code="previous_response_not_found", param="previous_response_id",
    ),
    ErrorRow(
        id="ws.store_false_after_reconnect", rule="WS-4.4", transport="ws",
        setup=STORE_FALSE_ELSEWHERE,
        request=lambda ctx, p: create(ctx, previous_response_id=p.response_id),
        status=400, code="previous_response_not_found", param="previous_response_id",
    ),
    # --- WS-5.3: the message size limit ---
    ErrorRow(
        id="ws.message_too_large", rule="WS-5.3", transport="ws",
        request=_oversized_event,
        status=400, code="message_too_large", param=None,
        after=SERVES_NEXT_CREATE,
    ),
    # --- WS-6: request errors ---
    ErrorRow(
        id="ws.error_unknown_parameter", rule="WS-6.2", transport="ws",
        request=lambda ctx, p: create(ctx, frobnicate=1),
        status=400, code="unknown_parameter", param="frobnicate",
    ),
    ErrorRow(
        id="ws.error_missing_parameter", rule="WS-6.3", transport="ws",
        request=lambda ctx, p: {"type": "response.create", "input": TEXT_PROMPT},
        status=400, code="missing_required_parameter", param="model",
    ),
    ErrorRow(
        id="ws.error_invalid_type", rule="WS-6.4", transport="ws",
        request=lambda ctx, p: create(ctx, temperature="hot"),
        status=400, code="invalid_type", param="temperature",
    ),
    ErrorRow(
        id="ws.error_invalid_value", rule="WS-6.5", transport="ws",
        request=lambda ctx, p: create(ctx, tool_choice="sometimes"),
        status=400, code="invalid_value", param="tool_choice",
    ),
    ErrorRow(
        id="ws.error_model_not_found", rule="WS-6.6", transport="ws",
        request=lambda ctx, p: create(ctx, model=NO_SUCH_MODEL),
        status=404, code="model_not_found", param="model",
    ),
    ErrorRow(
        id="ws.error_unknown_event", rule="WS-6.7", transport="ws",
        request=lambda ctx, p: {"type": "response.frobnicate"},
        status=400, code="invalid_value", param="type",
    ),
    ErrorRow(
        id="ws.error_invalid_json", rule="WS-6.8", transport="ws",
        request=lambda ctx, p: '{"type": "response.create", ',
        status=400, code="invalid_json", param=None,
    ),
    # --- RX-4: append errors ---
    ErrorRow(
        id="rollout.append_unknown_response", rule="RX-4.1", transport="ws",
        request=lambda ctx, p: append_event(unknown_id(), [tool_output(unknown_id("call"))]),
        status=400, code="rollout_not_found", param="response_id",
    ),
    ErrorRow(
        id="rollout.append_completed", rule="RX-4.2", transport="ws",
        setup=COMPLETED,
        request=lambda ctx, p: append_event(p.response_id, [tool_output(unknown_id("call"))]),
        status=400, code="response_already_completed", param="response_id",
    ),
    ErrorRow(
        id="rollout.append_unknown_call_id", rule="RX-4.4", transport="ws",
        setup=SUSPENDED,
        request=lambda ctx, p: append_event(p.response_id, [tool_output(unknown_id("call"))]),
        status=400, code="invalid_value", param="input[0].call_id",
        after=STAYS_SUSPENDED,
    ),
    ErrorRow(
        id="rollout.append_answered_call_id", rule="RX-4.5", transport="ws",
        setup=SUSPENDED,
        request=lambda ctx, p: append_event(p.response_id, [tool_output(p.pending[0])] * 2),
        status=400, code="invalid_value", param="input[1].call_id",
        after=STAYS_SUSPENDED_AND_REMEMBERS,
    ),
)  # fmt: skip


def _expect(row: ErrorRow, event: Mapping[str, Any]) -> None:
    expect_error(
        event, status=row.status, code=row.code, param=row.param, error_type=row.error_type
    )


async def _run_http(ctx: Context, row: ErrorRow) -> None:
    request = row.request(ctx, Prior())
    if isinstance(request, str):
        request = request.encode()
    if isinstance(request, bytes):
        what = f"a {len(request)}-byte body"
        result = await ctx.http("POST", "/responses", content=request)
    else:
        what = "POST /responses"
        result = await ctx.http("POST", "/responses", json_body=request)
    if result.status != row.status:
        raise CheckFailed(
            f"{what} answered HTTP {result.status}, expected {row.status}: "
            f"{describe_value(result.text)}"
        )
    # The body is checked as the nested error of a WebSocket error event (its status is the
    # HTTP status, checked above).
    _expect(row, {"type": "error", "status": row.status, "error": result.error()})


async def _run_ws(ctx: Context, row: ErrorRow) -> None:
    prior = Prior()
    if row.setup.separate:
        async with ctx.ws() as ws:
            prior = await row.setup.run(ctx, ws)
    async with ctx.ws() as ws:
        if not row.setup.separate:
            prior = await row.setup.run(ctx, ws)
        request = row.request(ctx, prior)
        if isinstance(request, bytes):
            request = request.decode()
        event = await first_event(ctx, ws, request)
        _expect(row, event)
        await row.after.run(ctx, ws, prior)


async def run_row(row: ErrorRow, ctx: Context) -> None:
    """Run one row of the table as the check `row.id`."""
    if row.transport == "http":
        await _run_http(ctx, row)
    else:
        await _run_ws(ctx, row)


def _register(rows: tuple[ErrorRow, ...]) -> CheckSet:
    registered = CheckSet()
    for row in rows:
        registered.add(row.id, functools.partial(run_row, row))
    return registered


checks = _register(ERROR_ROWS)
