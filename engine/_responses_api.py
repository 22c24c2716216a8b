"""The HTTP Responses API: create (JSON or server-sent events), compact, input token counts,
and the stored responses (retrieve, delete, their input items).

Each handler takes an `HttpRequest` and returns the status it answered; request errors are
raised (see `_asgi`), never answered here.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
from rollout.protocol import (
    MULTI_AGENT_BETA,
    Item,
    RemoteProtocolError,
    Response,
    ResponseCreate,
    ServerEvent,
    as_listed,
    decode_create_body,
    multi_agent_enabled,
    response_of,
    to_wire,
)

from ._asgi import HttpRequest, error_body, read_body, read_json, send_json
from ._compact import DEFAULT_COMPACT_BUDGET
from ._engine import Engine, Session
from ._http_stream import EventStream, run_until_disconnect, sse_event
from ._pagination import PageQuery

__all__ = ["ResponsesApi"]


class ResponsesApi:
    """The `/v1/responses` routes over one engine. HTTP requests are stateless: each gets a
    throwaway session (previous_response_id resolves through the store)."""

    def __init__(self, engine: Engine, *, max_message_size: int, max_buffered_bytes: int) -> None:
        self.engine = engine
        self.max_message_size = max_message_size
        self.max_buffered_bytes = max_buffered_bytes  # an SSE response's queued events

    def _session(self, owner: str | None) -> Session:
        return self.engine.session(owner=owner, max_cached_responses=1)

    # --- create ---
    async def create(self, req: HttpRequest) -> int:
        """`POST /v1/responses`."""
        limit = self.max_message_size
        timings: dict[str, float] = {}
        with self.engine.timer.measure("receive", timings):
            body = await read_body(
                req.receive, limit, f"The request body is larger than the limit of {limit} bytes."
            )
        request = await self.engine.decode_create(
            functools.partial(decode_create_body, max_size=limit),
            body,
            owner=req.owner,
            kind="body",
            max_size=limit,
            timings=timings,
        )
        _refuse_websocket_only(request)
        session = self._session(req.owner)
        if request.stream:
            return await self._create_sse(session, request, req, timings)
        return await self._create_json(session, request, req, timings)

    async def _create_json(
        self, session: Session, request: ResponseCreate, req: HttpRequest, timings: dict[str, float]
    ) -> int:
        final: list[Response] = []

        async def keep(event: ServerEvent) -> None:
            response = response_of(event)
            if response is not None:
                final[:] = [response]

        error = await run_until_disconnect(
            req.receive, session.create(request, keep, timings=timings)
        )
        if error is not None:
            raise error
        if not final:  # the client went away
            return 499
        extra = [(b"server-timing", _server_timing(session.last_timings).encode())]
        return await send_json(req.send, 200, to_wire(final[-1]), extra)

    async def _create_sse(
        self, session: Session, request: ResponseCreate, req: HttpRequest, timings: dict[str, float]
    ) -> int:
        # Headers go out with the first event, once pre-inference work (timed) is done.
        stream = EventStream(
            req.send,
            lambda: [(b"server-timing", _server_timing(session.last_timings).encode())],
            counters=self.engine.counters,
            max_buffered_bytes=self.max_buffered_bytes,
        )

        async def emit(event: ServerEvent) -> None:
            await stream.frame(sse_event(event))

        error = await stream.serve(req.receive, session.create(request, emit, timings=timings))
        if error is not None:
            raise error
        return await stream.end()

    # --- compact, input tokens ---
    async def compact(self, req: HttpRequest) -> int:
        """`POST /v1/responses/compact`: a create body, plus `budget_tokens`."""
        request, extras = await read_json(
            req.receive, self.max_message_size, self._decoder(drop="budget_tokens")
        )
        budget = extras.get("budget_tokens", DEFAULT_COMPACT_BUDGET)
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise RemoteProtocolError.invalid(
                "budget_tokens must be a non-negative integer.",
                code="invalid_type",
                param="budget_tokens",
            )
        result = await self._session(req.owner).compact(request, budget_tokens=budget)
        return await send_json(req.send, 200, result)

    async def input_tokens(self, req: HttpRequest) -> int:
        """`POST /v1/responses/input_tokens`: the tokens a create would render."""
        # `personality` and `conversation` are sent by SDK helpers; neither changes the count
        # of tokens rollout renders (conversations are refused by create).
        request, _extras = await read_json(
            req.receive, self.max_message_size, self._decoder(drop="personality")
        )
        if request.model is None:
            request = attrs.evolve(request, model="sim")
        state = await self._session(req.owner).prepare_only(request)
        return await send_json(
            req.send, 200, {"object": "response.input_tokens", "input_tokens": state.context_tokens}
        )

    def _decoder(self, *, drop: str) -> functools.partial[tuple[ResponseCreate, dict[str, Any]]]:
        return functools.partial(_decode_create, max_size=self.max_message_size, drop=drop)

    # --- stored responses ---
    async def retrieve(self, req: HttpRequest) -> int:
        """`GET /v1/responses/{id}`."""
        (response_id,) = req.params
        stored = await self.engine.get_stored(response_id, owner=req.owner)
        if stored is None:
            return await send_json(req.send, 404, _not_found(response_id))
        return await send_json(req.send, 200, to_wire(stored.response))

    async def delete(self, req: HttpRequest) -> int:
        """`DELETE /v1/responses/{id}`."""
        (response_id,) = req.params
        if not await self.engine.delete_stored(response_id, owner=req.owner):
            return await send_json(req.send, 404, _not_found(response_id))
        return await send_json(
            req.send, 200, {"id": response_id, "object": "response", "deleted": True}
        )

    async def input_items(self, req: HttpRequest) -> int:
        """`GET /v1/responses/{id}/input_items`: the items the model saw as input for a stored
        response (its conversation up to its own output), paginated."""
        (response_id,) = req.params
        page = PageQuery.parse(req.query)
        try:
            chain = await self.engine.stored_chain(response_id, owner=req.owner)
        except LookupError:
            return await send_json(req.send, 404, _not_found(response_id))
        outputs = {item.id for item in chain[0].response.output}
        items = [
            item
            for stored in reversed(chain)
            for item in stored.items
            if not (stored is chain[0] and item.id in outputs)
        ]
        return await send_json(req.send, 200, page.page(items, _listed))


def _decode_create(body: Any, *, max_size: int, drop: str) -> tuple[ResponseCreate, dict[str, Any]]:
    """A create body already parsed from JSON, less the extra key `drop` (returned aside)."""
    if not isinstance(body, dict):
        raise RemoteProtocolError.invalid(
            "Invalid type for body: expected a JSON object.", code="invalid_type"
        )
    extras = {drop: body.pop(drop)} if drop in body else {}
    return decode_create_body(body, max_size=max_size), extras


def _refuse_websocket_only(request: ResponseCreate) -> None:
    """Parameters of WebSocket mode are refused over HTTP."""
    if request.rollout:
        raise RemoteProtocolError.invalid(
            "The rollout extension needs a WebSocket connection.",
            code="unsupported_parameter",
            param="rollout",
        )
    if multi_agent_enabled(request):
        raise RemoteProtocolError.invalid(
            "A multi-agent response waits for response.inject, which needs a WebSocket "
            f"connection opened with the header 'OpenAI-Beta: {MULTI_AGENT_BETA}'.",
            code="unsupported_parameter",
            param="multi_agent",
        )
    if request.generate is not None or request.stream_id is not None:
        param = "generate" if request.generate is not None else "stream_id"
        raise RemoteProtocolError.invalid(
            f"'{param}' is only valid in WebSocket mode.",
            code="unsupported_parameter",
            param=param,
        )


def _server_timing(timings: dict[str, float]) -> str:
    return ", ".join(f"{stage};dur={seconds * 1000:.3f}" for stage, seconds in timings.items())


def _listed(item: Item) -> dict[str, Any]:
    """An input item in the shape the API lists it (see `protocol.as_listed`)."""
    wire: dict[str, Any] = to_wire(as_listed(item))
    return wire


def _not_found(response_id: str) -> dict[str, Any]:
    return error_body(
        f"Response with id '{response_id}' not found.",
        code="response_not_found",
        param="response_id",
    )
