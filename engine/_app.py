"""The ASGI application: the HTTP Responses API and WebSocket mode on one port.

Served by hypercorn's trio worker (see `_serve.py`). Routes:

    POST   /v1/responses                 create (JSON, or server-sent events with stream=true)
    GET    /v1/responses/{id}            a stored response
    DELETE /v1/responses/{id}            delete a stored response
    GET    /v1/responses   (upgrade)     WebSocket mode
    POST   /v1/responses/compact         a compacted window ending with a compaction item
    POST   /v1/responses/input_tokens    count the tokens a request would render
    GET    /v1/responses/{id}/input_items  a stored response's input items, paginated
    POST   /v1/chat/completions          the registry as a chat-completions model server
    GET    /v1/models, /v1/models/{id}   the models of the registry
    GET    /healthz                      liveness
    GET    /metrics                      Prometheus text: work counters, connections, statuses,
                                         per-stage latency histograms, post-inference backlog

Errors use the OpenAI body `{"error": {"message", "type", "param", "code"}}` and the matching
status. With API keys configured, a request without a valid `Authorization: Bearer` key gets
401 (a WebSocket upgrade is refused before 101) and stored responses are visible only to the
key that created them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import attrs
import trio
from rollout.protocol import (
    DEFAULT_MAX_MESSAGE_SIZE,
    ErrorBody,
    RemoteProtocolError,
    Response,
    ServerEvent,
    as_listed,
    decode_create_body,
    encode_sse,
    encode_sse_event,
    to_wire,
)

from ._chat import ChatCompletionEmitter, request_from_chat
from ._compact import DEFAULT_COMPACT_BUDGET
from ._counters import LATENCY_BUCKETS
from ._engine import Engine, server_error
from ._ws import WebSocketConnection, WebSocketLimits

__all__ = ["AppConfig", "RolloutApp", "owner_of"]

access_log = logging.getLogger("rollout.access")
log = logging.getLogger("rollout.server")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_RESPONSE_PATH = re.compile(r"^/v1/responses/([A-Za-z0-9_.\-]+)/?$")
_INPUT_ITEMS_PATH = re.compile(r"^/v1/responses/([A-Za-z0-9_.\-]+)/input_items/?$")
# Pagination of input_items, as the OpenAI API: 1..100 items a page, 20 by default.
MAX_PAGE_LIMIT = 100
DEFAULT_PAGE_LIMIT = 20
_MODEL_PATH = re.compile(r"^/v1/models/(.+)$")


# Open WebSocket connections at most. An idle one costs ~35 KB; one whose client stopped
# reading can pin its outbox (`max_buffered_bytes`, 4 MiB) and a kernel socket buffer until
# torn down, so 1,024 of those stay within a few GB.
DEFAULT_MAX_CONNECTIONS = 1024


@attrs.frozen(kw_only=True)
class AppConfig:
    api_keys: tuple[str, ...] = ()
    websocket: bool = True
    # The largest HTTP request body and WebSocket message accepted, in bytes.
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    ws_limits: WebSocketLimits = attrs.field(factory=WebSocketLimits)
    max_cached_responses: int = 8
    max_cached_tokens: int = 8_000_000
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def owner_of(key: str | None) -> str | None:
    """Stored responses belong to a hash of the API key that created them."""
    if key is None:
        return None
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _error_body(
    message: str,
    *,
    code: str | None,
    param: str | None = None,
    type_: str = "invalid_request_error",
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class RolloutApp:
    def __init__(self, engine: Engine, config: AppConfig) -> None:
        self.engine = engine
        self.config = config
        self.shutting_down = trio.Event()
        self.open_connections = 0
        self.refused_connections = 0  # upgrades refused at the connection limit
        self.http_requests = 0
        self._started = time.time()

    # --- ASGI entry point ---
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.shutting_down.set()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- auth ---
    def _authenticate(self, headers: dict[str, str]) -> tuple[bool, str | None]:
        """(allowed, owner). Without configured keys auth is off and the owner is None."""
        if not self.config.api_keys:
            return True, None
        auth = headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or key not in self.config.api_keys:
            return False, None
        return True, owner_of(key)

    # --- WebSocket ---
    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        path = scope["path"].rstrip("/")
        headers = _headers(scope)
        status, body = 0, None
        if path not in ("/v1/responses", "/responses"):
            status, body = 404, _error_body(f"No WebSocket endpoint at {path}.", code="not_found")
        elif not self.config.websocket:
            status, body = (
                426,
                _error_body(
                    "WebSocket mode is disabled on this server; use HTTP POST /v1/responses.",
                    code="websocket_disabled",
                ),
            )
        allowed, owner = self._authenticate(headers)
        if not status and allowed and self.open_connections >= self.config.max_connections:
            self.refused_connections += 1
            status, body = (
                503,
                _error_body(
                    f"This server has {self.open_connections} open WebSocket connections, its "
                    "limit; retry later or use HTTP.",
                    code="too_many_connections",
                    type_="server_error",
                ),
            )
        if not status and not allowed:
            status, body = (
                401,
                _error_body(
                    "Incorrect API key provided. You can find your API key in your settings.",
                    code="invalid_api_key",
                ),
            )
        if status:
            await self._deny_upgrade(send, status, body or {})
            access_log.info(json.dumps({"event": "ws_refused", "path": path, "status": status}))
            return
        await send({"type": "websocket.accept"})
        self.open_connections += 1
        started = time.perf_counter()
        session = self.engine.session(
            owner=owner,
            max_cached_responses=self.config.max_cached_responses,
            max_cached_tokens=self.config.max_cached_tokens,
        )
        timing = headers.get("x-rollout-timing", "").lower() in ("1", "true", "yes")
        connection = WebSocketConnection(
            session,
            send,
            receive,
            limits=self.config.ws_limits,
            timing=timing,
            shutting_down=self.shutting_down,
        )
        try:
            await connection.run()
        finally:
            self.open_connections -= 1
            access_log.info(
                json.dumps(
                    {
                        "event": "ws_closed",
                        "frames_in": connection.frames_in,
                        "frames_out": connection.frames_out,
                        "seconds": round(time.perf_counter() - started, 6),
                    }
                )
            )

    @staticmethod
    async def _deny_upgrade(send: Send, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "websocket.http.response.body", "body": payload})

    # --- HTTP ---
    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.http_requests += 1
        started = time.perf_counter()
        method = scope["method"]
        path = scope["path"]
        headers = _headers(scope)
        status = 500
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            status = await self._route(method, path, headers, query, receive, tracked)
        except Exception:
            # A bug: never an empty 500. The traceback goes to the log, the client gets an
            # OpenAI-shaped error (if nothing was sent yet; a started body is cut as it is).
            log.exception("%s %s failed with an unexpected error", method, path)
            if not started:
                error = server_error()
                status = await _json(send, error.status, {"error": to_wire(error.body)})
        finally:
            access_log.info(
                json.dumps(
                    {
                        "event": "http",
                        "method": method,
                        "path": path,
                        "status": status,
                        "seconds": round(time.perf_counter() - started, 6),
                    }
                )
            )

    async def _route(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        query: dict[str, str],
        receive: Receive,
        send: Send,
    ) -> int:
        if path == "/healthz":
            return await _json(send, 200, {"status": "ok"})
        allowed, owner = self._authenticate(headers)
        if path == "/metrics" and allowed:  # behind the API key when keys are configured
            return await _text(send, 200, self.metrics(), "text/plain; version=0.0.4")
        if not allowed:
            return await _json(
                send,
                401,
                _error_body(
                    "Incorrect API key provided. You can find your API key in your settings.",
                    code="invalid_api_key",
                ),
            )
        if path.rstrip("/") in ("/v1/responses", "/responses"):
            if method == "POST":
                return await self._create(headers, receive, send, owner)
            if method == "GET" and headers.get("upgrade", "").lower() == "websocket":
                # A handshake the server did not take as one (hypercorn routes a valid one to
                # `_websocket`): refused as malformed when WebSocket mode is on (RFC 6455 4.2.1).
                if self.config.websocket:
                    return await _json(
                        send,
                        400,
                        _error_body(
                            "Invalid WebSocket upgrade request (RFC 6455 handshake headers "
                            "missing or wrong).",
                            code="invalid_request",
                        ),
                    )
                return await _json(
                    send,
                    426,
                    _error_body(
                        "WebSocket mode is disabled on this server.", code="websocket_disabled"
                    ),
                )
            return await _method_not_allowed(send)
        if path.rstrip("/") in ("/v1/responses/compact", "/v1/responses/input_tokens"):
            if method != "POST":
                return await _method_not_allowed(send)
            if path.rstrip("/").endswith("compact"):
                return await self._compact(receive, send, owner)
            return await self._input_tokens(receive, send, owner)
        match = _INPUT_ITEMS_PATH.match(path)
        if match:
            if method != "GET":
                return await _method_not_allowed(send)
            return await self._input_items(send, match.group(1), query, owner)
        match = _RESPONSE_PATH.match(path)
        if match:
            response_id = match.group(1)
            if method == "GET":
                return await self._retrieve(send, response_id, owner)
            if method == "DELETE":
                return await self._delete(send, response_id, owner)
            return await _method_not_allowed(send)
        if path.rstrip("/") in ("/v1/chat/completions", "/chat/completions"):
            if method != "POST":
                return await _method_not_allowed(send)
            return await self._chat_completions(receive, send, owner)
        if path.rstrip("/") == "/v1/models":
            if method != "GET":
                return await _method_not_allowed(send)
            return await _json(send, 200, {"object": "list", "data": self._models()})
        match = _MODEL_PATH.match(path)
        if match and method != "GET":
            return await _method_not_allowed(send)
        if match:
            found = [m for m in self._models() if m["id"] == match.group(1)]
            if found:
                return await _json(send, 200, found[0])
            return await _json(
                send,
                404,
                _error_body(
                    f"The model `{match.group(1)}` does not exist.",
                    code="model_not_found",
                    param="model",
                ),
            )
        return await _json(
            send, 404, _error_body(f"No route for {method} {path}.", code="not_found")
        )

    def _models(self) -> list[dict[str, Any]]:
        created = int(self._started)
        return [
            {"id": name, "object": "model", "created": created, "owned_by": "rollout"}
            for name in self.engine.registry.names()
        ]

    async def _create(
        self, headers: dict[str, str], receive: Receive, send: Send, owner: str | None
    ) -> int:
        body = await _read_body(receive, self.config.max_message_size)
        if body is None:
            return await _json(
                send,
                413,
                _error_body(
                    f"The request body is larger than the limit of "
                    f"{self.config.max_message_size} bytes.",
                    code="message_too_large",
                ),
            )
        try:
            request = await self.engine.decode(
                functools.partial(decode_create_body, max_size=self.config.max_message_size),
                body,
            )
            if request.rollout:
                raise RemoteProtocolError.invalid(
                    "The rollout extension needs a WebSocket connection.",
                    code="unsupported_parameter",
                    param="rollout",
                )
            if request.generate is not None or request.stream_id is not None:
                param = "generate" if request.generate is not None else "stream_id"
                raise RemoteProtocolError.invalid(
                    f"'{param}' is only valid in WebSocket mode.",
                    code="unsupported_parameter",
                    param=param,
                )
        except RemoteProtocolError as exc:
            self.engine.counters.request_errors += 1
            return await _json(send, exc.status, {"error": to_wire(exc.body)})
        session = self.engine.session(owner=owner, max_cached_responses=1)
        if request.stream:
            return await self._create_sse(session, request, receive, send)
        return await self._create_json(session, request, receive, send)

    async def _create_json(self, session: Any, request: Any, receive: Receive, send: Send) -> int:
        final: list[Response] = []

        async def keep(event: ServerEvent) -> None:
            response = getattr(event, "response", None)
            if response is not None:
                final[:] = [response]

        error = await _until_disconnect(receive, session.create(request, keep))
        if error is not None:
            self.engine.counters.request_errors += 1
            return await _json(send, error.status, {"error": to_wire(error.body)})
        if not final:  # the client went away
            return 499
        extra = [(b"server-timing", _server_timing(session.last_timings).encode())]
        return await _json(send, 200, to_wire(final[-1]), extra)

    async def _create_sse(self, session: Any, request: Any, receive: Receive, send: Send) -> int:
        # Headers go out with the first event, once pre-inference work (timed) is done.
        stream = _EventStream(
            send, lambda: [(b"server-timing", _server_timing(session.last_timings).encode())]
        )

        async def emit(event: ServerEvent) -> None:
            await stream.frame(encode_sse_event(event))

        error = await _until_disconnect(receive, session.create(request, emit))
        if error is not None:
            self.engine.counters.request_errors += 1
            return await _json(send, error.status, {"error": to_wire(error.body)})
        return await stream.end()

    async def _decode_body(
        self, receive: Receive, send: Send, *, drop: tuple[str, ...] = ()
    ) -> tuple[Any, int | None]:
        """(request, None) or (None, the status of the error already sent)."""
        raw = await _read_body(receive, self.config.max_message_size)
        if raw is None:
            return None, await _json(
                send, 413, _error_body("The request body is too large.", code="message_too_large")
            )
        try:
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise RemoteProtocolError.invalid(
                        "Invalid type for body: expected a JSON object.", code="invalid_type"
                    )
                extras = {k: body.pop(k) for k in drop if k in body}
                request = decode_create_body(body, max_size=self.config.max_message_size)
            except RecursionError:  # json.loads and the decoder recurse per nesting level
                raise RemoteProtocolError.invalid(
                    "The message is nested too deeply.", code="invalid_json"
                ) from None
            except ValueError:
                raise RemoteProtocolError.invalid(
                    "We could not parse the JSON body of your request.", code="invalid_json"
                ) from None
        except RemoteProtocolError as exc:
            self.engine.counters.request_errors += 1
            return None, await _json(send, exc.status, {"error": to_wire(exc.body)})
        return (request, extras), None

    async def _compact(self, receive: Receive, send: Send, owner: str | None) -> int:
        decoded, status = await self._decode_body(receive, send, drop=("budget_tokens",))
        if decoded is None:
            assert status is not None
            return status
        request, extras = decoded
        budget = extras.get("budget_tokens", DEFAULT_COMPACT_BUDGET)
        try:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise RemoteProtocolError.invalid(
                    "budget_tokens must be a non-negative integer.",
                    code="invalid_type",
                    param="budget_tokens",
                )
            session = self.engine.session(owner=owner, max_cached_responses=1)
            result = await session.compact(request, budget_tokens=budget)
        except RemoteProtocolError as exc:
            self.engine.counters.request_errors += 1
            return await _json(send, exc.status, {"error": to_wire(exc.body)})
        return await _json(send, 200, result)

    async def _input_tokens(self, receive: Receive, send: Send, owner: str | None) -> int:
        # `personality` and `conversation` are sent by SDK helpers; neither changes the count
        # of tokens rollout renders (conversations are refused by create).
        decoded, status = await self._decode_body(receive, send, drop=("personality",))
        if decoded is None:
            assert status is not None
            return status
        request, _extras = decoded
        if request.model is None:
            request = attrs.evolve(request, model="sim")
        try:
            session = self.engine.session(owner=owner, max_cached_responses=1)
            state = await session.prepare_only(request)
        except RemoteProtocolError as exc:
            self.engine.counters.request_errors += 1
            return await _json(send, exc.status, {"error": to_wire(exc.body)})
        return await _json(
            send, 200, {"object": "response.input_tokens", "input_tokens": state.context_tokens}
        )

    async def _input_items(
        self, send: Send, response_id: str, query: dict[str, str], owner: str | None
    ) -> int:
        """The items the model saw as input for a stored response (its conversation up to
        its own output), paginated like the OpenAI API (`after`, `limit`, `order`)."""
        try:
            limit = int(query.get("limit", DEFAULT_PAGE_LIMIT))
        except ValueError:
            limit = -1
        order = query.get("order", "desc")
        if not 1 <= limit <= MAX_PAGE_LIMIT or order not in ("asc", "desc"):
            param = "order" if order not in ("asc", "desc") else "limit"
            return await _json(
                send,
                400,
                _error_body(
                    f"Invalid '{param}': limit is 1..{MAX_PAGE_LIMIT}, order is asc or desc.",
                    code="invalid_value",
                    param=param,
                ),
            )
        try:
            chain = await self.engine.stored_chain(response_id, owner=owner)
        except LookupError:
            return await _json(send, 404, _not_found(response_id))
        outputs = {getattr(o, "id", None) for o in chain[0].response.output}
        items = [
            item
            for stored in reversed(chain)
            for item in stored.items
            if not (stored is chain[0] and getattr(item, "id", None) in outputs)
        ]
        if order == "desc":
            items.reverse()
        after = query.get("after")
        if after is not None:
            ids = [getattr(i, "id", None) for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        data = [_listed(i) for i in page]
        return await _json(
            send,
            200,
            {
                "object": "list",
                "data": data,
                "first_id": data[0].get("id") if data else None,
                "last_id": data[-1].get("id") if data else None,
                "has_more": len(items) > limit,
            },
        )

    async def _chat_completions(self, receive: Receive, send: Send, owner: str | None) -> int:
        """Serve the model registry as a chat-completions model server (stateless)."""
        raw = await _read_body(receive, self.config.max_message_size)
        if raw is None:
            return await _json(
                send, 413, _error_body("The request body is too large.", code="message_too_large")
            )
        try:
            try:
                body = json.loads(raw)
                request = request_from_chat(body)
            except RecursionError:
                raise RemoteProtocolError.invalid(
                    "The message is nested too deeply.", code="invalid_json"
                ) from None
            except ValueError:
                raise RemoteProtocolError.invalid(
                    "We could not parse the JSON body of your request.", code="invalid_json"
                ) from None
            for name, kind, kind_name in (
                ("stream", bool, "a boolean"),
                ("stream_options", dict, "an object"),
            ):
                if body.get(name) is not None and not isinstance(body[name], kind):
                    raise RemoteProtocolError.invalid(
                        f"Invalid type for '{name}': expected {kind_name}.",
                        code="invalid_type",
                        param=name,
                    )
        except RemoteProtocolError as exc:
            self.engine.counters.request_errors += 1
            return await _json(send, exc.status, {"error": to_wire(exc.body)})
        streaming = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = _EventStream(send)
        emitter = ChatCompletionEmitter(
            request.model or "",
            stream=streaming,
            include_usage=include_usage,
            send_chunk=stream.frame,
        )
        session = self.engine.session(owner=owner, max_cached_responses=1)
        error = await _until_disconnect(receive, session.create(request, emitter))
        if error is not None and not stream.started:
            self.engine.counters.request_errors += 1
            return await _json(send, error.status, {"error": to_wire(error.body)})
        if emitter.error is not None:
            if not stream.started:
                return await _json(send, 500, {"error": emitter.error})
            await stream.frame(encode_sse(json.dumps({"error": emitter.error})))
        if not streaming:
            if emitter.finish_reason is None:
                return 499
            return await _json(send, 200, emitter.completion())
        if stream.started:
            await stream.frame(encode_sse("[DONE]"))
        return await stream.end()

    async def _retrieve(self, send: Send, response_id: str, owner: str | None) -> int:
        stored = await self.engine.get_stored(response_id, owner=owner)
        if stored is None:
            return await _json(send, 404, _not_found(response_id))
        return await _json(send, 200, to_wire(stored.response))

    async def _delete(self, send: Send, response_id: str, owner: str | None) -> int:
        if not await self.engine.delete_stored(response_id, owner=owner):
            return await _json(send, 404, _not_found(response_id))
        return await _json(send, 200, {"id": response_id, "object": "response", "deleted": True})

    # --- metrics ---
    def metrics(self) -> str:
        engine = self.engine
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: Iterable[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(
                    f"{name}{labels} {value:g}"
                    if isinstance(value, float)
                    else f"{name}{labels} {value}"
                )

        metric(
            "rollout_work_total",
            "counter",
            "Deterministic work counters of the engine.",
            ((f'{{counter="{k}"}}', v) for k, v in engine.counters.as_dict().items()),
        )
        metric(
            "rollout_open_connections",
            "gauge",
            "Open WebSocket connections.",
            [('{transport="websocket"}', self.open_connections)],
        )
        metric(
            "rollout_refused_connections_total",
            "counter",
            "WebSocket upgrades refused at the connection limit.",
            [("", self.refused_connections)],
        )
        metric(
            "rollout_http_requests_total",
            "counter",
            "HTTP requests served.",
            [("", self.http_requests)],
        )
        metric(
            "rollout_responses_total",
            "counter",
            "Responses by final status.",
            ((f'{{status="{k}"}}', v) for k, v in sorted(engine.responses_by_status.items())),
        )
        metric(
            "rollout_post_inference_backlog",
            "gauge",
            "Post-inference jobs (usage records, store writes) not yet written.",
            [("", engine.post.backlog)],
        )
        lines.append("# HELP rollout_stage_seconds Pre-inference latency by pipeline stage.")
        lines.append("# TYPE rollout_stage_seconds histogram")
        for stage, hist in engine.timer.histograms.items():
            cumulative = 0
            for bound, count in zip(LATENCY_BUCKETS, hist.buckets, strict=True):
                cumulative += count
                lines.append(
                    f'rollout_stage_seconds_bucket{{stage="{stage}",le="{bound:g}"}} {cumulative}'
                )
            lines.append(f'rollout_stage_seconds_bucket{{stage="{stage}",le="+Inf"}} {hist.count}')
            lines.append(f'rollout_stage_seconds_sum{{stage="{stage}"}} {hist.total:.9f}')
            lines.append(f'rollout_stage_seconds_count{{stage="{stage}"}} {hist.count}')
        return "\n".join(lines) + "\n"


def _server_timing(timings: dict[str, float]) -> str:
    return ", ".join(f"{stage};dur={seconds * 1000:.3f}" for stage, seconds in timings.items())


def _listed(item: Any) -> dict[str, Any]:
    """An input item in the shape the API lists it (see `protocol.as_listed`)."""
    wire: dict[str, Any] = to_wire(as_listed(item))
    return wire


def _not_found(response_id: str) -> dict[str, Any]:
    return _error_body(
        f"Response with id '{response_id}' not found.",
        code="response_not_found",
        param="response_id",
    )


class _EventStream:
    """A server-sent-events response, started (status 200, headers) with its first frame."""

    def __init__(
        self, send: Send, extra_headers: Callable[[], list[tuple[bytes, bytes]]] | None = None
    ) -> None:
        self._send = send
        self._extra = extra_headers
        self.started = False

    async def frame(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                *(self._extra() if self._extra else ()),
            ]
            await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> int:
        """Finish the body; 499 (nothing sent: the client went away) when never started."""
        if not self.started:
            return 499
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        return 200


async def _until_disconnect(receive: Receive, work: Awaitable[Any]) -> RemoteProtocolError | None:
    """Run `work` until it ends or the client disconnects (which cancels it). Returns the
    request error it raised, if any."""
    error: RemoteProtocolError | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
        try:
            await work
        except RemoteProtocolError as exc:
            error = exc
        nursery.cancel_scope.cancel()
    return error


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None when it is larger than `limit` (not read further)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _json(
    send: Send, status: int, body: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> int:
    payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    return await _raw(send, status, payload, b"application/json", extra)


async def _text(send: Send, status: int, text: str, content_type: str) -> int:
    return await _raw(send, status, text.encode(), content_type.encode())


async def _raw(
    send: Send,
    status: int,
    payload: bytes,
    content_type: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> int:
    headers = [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": payload})
    return status


async def _method_not_allowed(send: Send) -> int:
    return await _json(send, 405, _error_body("Method not allowed.", code="method_not_allowed"))


_ = ErrorBody  # re-exported type used in annotations of error bodies
