"""The ASGI application: the HTTP Responses API and WebSocket mode on one port.

Long because it is the whole HTTP surface: routing, authentication, the browser and host checks,
every route's handler, and the WebSocket upgrade's refusals.

Served by hypercorn's trio worker (see `_serve.py`). Routes (the table is `RolloutApp._routes`):

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

The routes live in their own modules: `_responses_api`, `_chat_api`, `_metrics`; auth in
`_auth`; streaming in `_http_stream`; the ASGI plumbing in `_asgi`. This module is the entry
point: lifespan, the WebSocket upgrade, routing, and answering the errors handlers raise.

Errors use the OpenAI body `{"error": {"message", "type", "param", "code"}}` and the matching
status. With API keys configured, a request without a valid `Authorization: Bearer` key gets
401 (a WebSocket upgrade is refused before 101) and stored responses are visible only to the
key that created them.

Browser rules (`_browser.py`) come first: a foreign `Host` (DNS rebinding) gets 421, an
`Origin` not allowed 403 (an upgrade too, before it is accepted), and a POST with a type an
HTML form can send (`text/plain`, form types) 415; requests without `Origin` pass.

WebSocket connections are capped (`max_connections`, 503 `too_many_connections` past it), and
one key may hold at most its share of them (`key_connection_share` of the cap, 429
`too_many_connections_for_key` past it), so a single client cannot take every place. Without
auth a "key" is a client address (its host), which behind a proxy is the proxy's: set the
share to 1 there.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio
from rollout.protocol import DEFAULT_MAX_MESSAGE_SIZE, RemoteProtocolError, betas_of, to_wire

from ._asgi import (
    HttpError,
    HttpRequest,
    Message,
    Receive,
    Scope,
    Send,
    error_body,
    headers_of,
    method_not_allowed,
    send_json,
    send_raw,
)
from ._auth import ApiKeys, owner_of
from ._browser import BrowserRules
from ._chat_api import ChatApi
from ._engine import Engine, server_error
from ._http_limits import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_TCP_CONNECTIONS,
    BodyClock,
    TransportStats,
    content_length,
)
from ._metrics import MetricsExporter
from ._responses_api import ResponsesApi
from ._transport import TRANSPORT_EXTENSION, WriteWatch, WriteWatchdog
from ._trim import release_freed_memory
from ._ws import WebSocketConnection, WebSocketLimits

__all__ = [
    "DEFAULT_KEY_CONNECTION_SHARE",
    "DEFAULT_MAX_CONNECTIONS",
    "AppConfig",
    "RolloutApp",
    "owner_of",
]

access_log = logging.getLogger("rollout.access")
# Outside the logger tree and above every level: where an app without access lines logs them.
_NO_ACCESS_LOG = logging.Logger("rollout.access.off", level=logging.CRITICAL + 1)
log = logging.getLogger("rollout.server")

# Open WebSocket connections at most. An idle one costs ~35 KB; one whose client stopped
# reading can pin its outbox (`max_buffered_bytes`, 4 MiB), the frames its responses wait to
# queue and a kernel socket buffer until it is cut off (`send_stall_limit`, then aborted), so
# 1,024 of those stay within a few GB, for 30 s.
DEFAULT_MAX_CONNECTIONS = 1024
# The fraction of `max_connections` one API key may hold (without auth: one client address),
# so that a single client cannot take every place: with the default, two keys at their share
# fill the server. 1 turns the share off (behind a proxy without auth, every client has the
# proxy's address).
DEFAULT_KEY_CONNECTION_SHARE = 0.5

# WebSocket mode's one endpoint. Every route of the API is under /v1, as a client's base URL
# is; a path that would match with the prefix gets a 404 that says so (`_did_you_mean`).
_WEBSOCKET_PATH = "/v1/responses"
ANY_METHOD = "ANY"  # a route's handler for every method

Handler = Callable[[HttpRequest], Awaitable[int]]


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
    key_connection_share: float = DEFAULT_KEY_CONNECTION_SHARE
    # The server's TCP connections at most (`_http_limits.py`): one key's HTTP requests in
    # progress (each holding one) are at most its `key_connection_share` of it.
    max_tcp_connections: int = DEFAULT_MAX_TCP_CONNECTIONS
    access_log: bool = True  # a `rollout.access` line per request (off for the warm-up's)
    # An HTTP request's body must arrive within `body_timeout` seconds of its headers, plus a
    # second per `body_min_rate` bytes (`_http_limits.BodyClock`), else 408 and close.
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    body_min_rate: float = DEFAULT_BODY_MIN_RATE
    # One worker of several (`rollout serve --workers N`): /metrics merges the counts every
    # worker writes into this directory (see `_metrics.py`).
    metrics_dir: Path | None = None
    # Browser rules (`_browser.py`): the address the server is bound to (loopback: only the
    # loopback names in `Host`) and the `--allow-host` / `--allow-origin` values.
    bound_host: str = "127.0.0.1"
    allow_hosts: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()


def _near_miss(path: str) -> str | None:
    """The path a client probably meant: `path` under /v1, `response` made `responses`
    (`/response/x` -> `/v1/responses/x`); None when that changes nothing."""
    near = path if path.startswith("/v1/") else "/v1" + path
    near = re.sub(r"\A/v1/response(?=/|\Z)", "/v1/responses", near)
    return None if near == path else near


def _base_url_note(path: str) -> str:
    """Said of a path without the /v1 prefix: where a client's base URL went wrong."""
    return "" if path.startswith("/v1/") else " (The base URL ends in /v1.)"


@attrs.frozen
class Route:
    """Paths matching `pattern` (from the start; its groups become `HttpRequest.params`),
    served by method (`ANY_METHOD` for all; another method gets 405)."""

    pattern: re.Pattern[str]
    methods: Mapping[str, Handler]
    public: bool = False  # served without an API key


def _route(pattern: str, public: bool = False, **methods: Handler) -> Route:
    return Route(re.compile(pattern), methods, public)


class RolloutApp:
    def __init__(
        self, engine: Engine, config: AppConfig, transport: TransportStats | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.shutting_down = trio.Event()
        self.open_connections = 0
        self.refused_connections = 0  # upgrades refused at the connection limit
        # Open WebSocket connections by holder: the API key's owner, or the client address.
        self._held: collections.Counter[str] = collections.Counter()
        # HTTP requests in progress by holder (the same holders).
        self._requests_held: collections.Counter[str] = collections.Counter()
        self.http_requests = 0
        # The TCP connections under the app (`_http_limits.py`; `serve` hands it to them).
        self.transport = transport if transport is not None else TransportStats()
        self._started = time.time()
        self._keys = ApiKeys(config.api_keys)
        self._browser = BrowserRules.make(
            bound_host=config.bound_host,
            keys_configured=bool(config.api_keys),
            allow_hosts=config.allow_hosts,
            allow_origins=config.allow_origins,
        )
        self._access_log = access_log if config.access_log else _NO_ACCESS_LOG
        self.metrics = MetricsExporter(engine, self, shared_dir=config.metrics_dir)
        self._routes = self._route_table()
        # Every HTTP request's writes, watched by one task (started with the lifespan).
        self._watchdog = WriteWatchdog(config.ws_limits.send_stall_limit)

    def _route_table(self) -> tuple[Route, ...]:
        """Tried in order, each pattern from the start of the path. Fixed paths end in `\\Z`
        (with `/*`, trailing slashes are ignored); the id patterns end in `$`, which also
        takes one trailing newline (a `%0A`), as these routes always have."""
        size = self.config.max_message_size
        buffered = self.config.ws_limits.max_buffered_bytes  # (an SSE response's outbox too)
        responses = ResponsesApi(self.engine, max_message_size=size, max_buffered_bytes=buffered)
        chat = ChatApi(self.engine, max_message_size=size, max_buffered_bytes=buffered)
        return (
            _route(r"/healthz\Z", public=True, ANY=self._health),
            _route(r"/metrics\Z", ANY=self._metrics_text),
            _route(r"/v1/responses/*\Z", POST=responses.create, GET=self._upgrade_over_http),
            _route(r"/v1/responses/compact/*\Z", POST=responses.compact),
            _route(r"/v1/responses/input_tokens/*\Z", POST=responses.input_tokens),
            _route(r"/v1/responses/([A-Za-z0-9_.\-]+)/input_items/?$", GET=responses.input_items),
            _route(
                r"/v1/responses/([A-Za-z0-9_.\-]+)/?$",
                GET=responses.retrieve,
                DELETE=responses.delete,
            ),
            _route(r"/v1/chat/completions/*\Z", POST=chat.completions),
            _route(r"/v1/models/*\Z", GET=self._models),
            _route(r"/v1/models/(.+)$", GET=self._model),
        )

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
        """Startup starts the HTTP write watchdog, which runs until shutdown."""
        async with trio.open_nursery() as nursery:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    if math.isfinite(self._watchdog.limit) and not self._watchdog.running:
                        nursery.start_soon(self._watchdog.run)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.shutting_down.set()
                    await send({"type": "lifespan.shutdown.complete"})
                    nursery.cancel_scope.cancel()
                    return

    # --- WebSocket ---
    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        path = scope["path"].rstrip("/")
        headers = headers_of(scope)
        allowed, owner = self._keys.authenticate(headers)
        holder = _holder(scope, owner)
        refusal = self._browser.refuse(headers)
        if refusal is not None:
            self.engine.counters.browser_refusals += 1
        refusal = (
            refusal
            or _duplicate_authorization(scope)
            or self._refuse_upgrade(path, allowed, holder, headers)
        )
        if refusal is not None:
            status, body = refusal
            await _deny_upgrade(send, status, body)
            self._access_log.info(
                "WebSocket %s refused: %d",
                path,
                status,
                extra={"event": "ws_refused", "path": path, "status": status},
            )
            return
        await send({"type": "websocket.accept"})
        self.open_connections += 1
        self._held[holder] += 1
        started = time.perf_counter()
        session = self.engine.session(
            owner=owner,
            max_cached_responses=self.config.max_cached_responses,
            max_cached_tokens=self.config.max_cached_tokens,
            keeps_state=True,
        )
        connection = WebSocketConnection(
            session,
            send,
            receive,
            limits=self.config.ws_limits,
            max_message_size=self.config.max_message_size,
            timing=headers.get("x-rollout-timing", "").lower() in ("1", "true", "yes"),
            shutting_down=self.shutting_down,
            betas=betas_of(
                value.decode("latin-1")
                for name, value in scope.get("headers", [])
                if name.lower() == b"openai-beta"
            ),
            transport=scope.get("extensions", {}).get(TRANSPORT_EXTENSION),
        )
        try:
            await connection.run()
        finally:
            session.close()
            self.open_connections -= 1
            self._held[holder] -= 1
            if not self._held[holder]:
                del self._held[holder]
            seconds = round(time.perf_counter() - started, 6)
            self._access_log.info(
                "WebSocket %s closed after %.3f s: %d frames in, %d out",
                path,
                seconds,
                connection.frames_in,
                connection.frames_out,
                extra={
                    "event": "ws_closed",
                    "path": path,
                    "frames_in": connection.frames_in,
                    "frames_out": connection.frames_out,
                    "seconds": seconds,
                },
            )
            if connection.cut_off:  # what it held is free: give it back to the OS
                await release_freed_memory()

    def key_connection_limit(self) -> int:
        """The WebSocket connections one key (or client address) may hold."""
        share = int(self.config.max_connections * self.config.key_connection_share)
        return max(1, min(self.config.max_connections, share))

    def _refuse_upgrade(
        self, path: str, allowed: bool, holder: str, headers: Mapping[str, str]
    ) -> tuple[int, dict[str, Any]] | None:
        """The status and body refusing an upgrade, in order: no such endpoint, WebSocket mode
        off, the connection limit (counted), the key's share of it (counted), no valid key;
        None to accept it."""
        if path != _WEBSOCKET_PATH:
            near = _near_miss(path)
            hint = ""
            if near is not None and near.rstrip("/") == _WEBSOCKET_PATH:
                hint = f" Did you mean {_WEBSOCKET_PATH}?{_base_url_note(path)}"
            return 404, error_body(f"No WebSocket endpoint at {path}.{hint}", code="not_found")
        if not self.config.websocket:
            return 426, error_body(
                "WebSocket mode is disabled on this server; use HTTP POST /v1/responses.",
                code="websocket_disabled",
            )
        if allowed and self.open_connections >= self.config.max_connections:
            self.refused_connections += 1
            return 503, error_body(
                f"This server has {self.open_connections} open WebSocket connections, its "
                "limit; retry later or use HTTP.",
                code="too_many_connections",
                type_="server_error",
            )
        share = self.key_connection_limit()
        if allowed and self._held[holder] >= share:
            self.engine.counters.ws_key_share_refusals += 1
            who = "API key" if self.config.api_keys else "client address"
            return 429, error_body(
                f"This {who} holds {self._held[holder]} open WebSocket connections, its share "
                f"of this server's {self.config.max_connections}; close one, or use HTTP.",
                code="too_many_connections_for_key",
            )
        if not allowed:
            return 401, _invalid_api_key(headers)
        return None

    # --- HTTP ---
    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request, its writes watched: one held past `send_stall_limit` (a client
        that stopped reading) resets the connection, which cancels the request's work."""
        limit = self.config.ws_limits.send_stall_limit
        transport = scope.get("extensions", {}).get(TRANSPORT_EXTENSION)
        if transport is None or limit == math.inf:
            await self._http_request(scope, receive, send)
            return
        watch = WriteWatch(send, transport, limit, functools.partial(self._http_stalled, scope))
        watchdog = self._watchdog
        if watchdog.running:
            watchdog.add(watch)
            try:
                await self._http_request(scope, receive, watch.send)
            finally:
                watchdog.discard(watch)
            return
        async with trio.open_nursery() as nursery:  # (served without lifespan: no watchdog)
            nursery.start_soon(watch.watch)
            try:
                await self._http_request(scope, receive, watch.send)
            finally:
                nursery.cancel_scope.cancel()

    def _http_stalled(self, scope: Scope) -> None:
        self.engine.counters.slow_consumers += 1
        log.warning(
            "an HTTP client stopped reading (%s %s: a write waited %g s): resetting its connection",
            scope["method"],
            scope["path"],
            self.config.ws_limits.send_stall_limit,
        )

    async def _http_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.http_requests += 1
        began = time.perf_counter()
        method = scope["method"]
        path = scope["path"]
        status = 500
        started = False  # the response has started: an error can only cut it

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        config = self.config
        receive = BodyClock(
            receive,
            timeout=config.body_timeout,
            min_rate=config.body_min_rate,
            on_timeout=self._body_timed_out,
            length=content_length(scope.get("headers", ())),
        )
        try:
            duplicate = _duplicate_authorization(scope)
            if duplicate is not None:
                status = await send_json(tracked, *duplicate)
                return
            status = await self._dispatch(scope, method, path, receive, tracked)
        except Exception as exc:
            if isinstance(exc, RemoteProtocolError | HttpError) and not started:
                status = await self._answer(send, exc)
                return
            # A bug: never an empty 500. The traceback goes to the log, the client gets an
            # OpenAI-shaped error (if nothing was sent yet; a started body is cut as it is).
            log.exception("%s %s failed with an unexpected error", method, path)
            if not started:
                error = server_error()
                status = await send_json(send, error.status, {"error": to_wire(error.body)})
        finally:
            seconds = round(time.perf_counter() - began, 6)
            self._access_log.info(
                "%s %s %d %.1f ms",
                method,
                path,
                status,
                seconds * 1000,
                extra={
                    "event": "http",
                    "method": method,
                    "path": path,
                    "status": status,
                    "seconds": seconds,
                },
            )

    def _body_timed_out(self) -> HttpError:
        """The body did not arrive in time: counted; 408 (the connection then closes, its
        request unread)."""
        self.transport.timeouts["body"] += 1
        return HttpError(
            408,
            error_body(
                f"The request body did not arrive in time (within "
                f"{self.config.body_timeout:g} s of the headers, at "
                f"{self.config.body_min_rate:g} bytes/s or more).",
                code="request_timeout",
            ),
        )

    async def _answer(self, send: Send, exc: RemoteProtocolError | HttpError) -> int:
        """A refused request: a request error of the protocol (counted), or of HTTP."""
        if isinstance(exc, HttpError):
            return await send_json(send, exc.status, exc.body)
        self.engine.counters.request_errors += 1
        return await send_json(send, exc.status, {"error": to_wire(exc.body)})

    async def _dispatch(
        self, scope: Scope, method: str, path: str, receive: Receive, send: Send
    ) -> int:
        headers = headers_of(scope)
        refusal = self._browser.refuse(headers) or self._browser.refuse_body(method, headers)
        if refusal is not None:
            self.engine.counters.browser_refusals += 1
            status, body = refusal
            return await send_json(send, status, body)
        query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        allowed, owner = self._keys.authenticate(headers)
        if not allowed:
            return await self._route(method, path, query, headers, receive, send, False, None)
        holder = _holder(scope, owner)
        held = self._requests_held
        if held[holder] >= self.key_request_limit():
            self.engine.counters.http_key_share_refusals += 1
            who = "API key" if self.config.api_keys else "client address"
            return await send_json(
                send,
                429,
                error_body(
                    f"This {who} has {held[holder]} HTTP requests in progress, its share of "
                    f"this server's {self.config.max_tcp_connections} connections; wait for "
                    "one to end.",
                    code="too_many_requests_for_key",
                ),
            )
        held[holder] += 1
        try:
            return await self._route(method, path, query, headers, receive, send, True, owner)
        finally:
            held[holder] -= 1
            if not held[holder]:
                del held[holder]

    def key_request_limit(self) -> int:
        """The HTTP requests in progress one key (or client address) may have."""
        share = int(self.config.max_tcp_connections * self.config.key_connection_share)
        return max(1, min(self.config.max_tcp_connections, share))

    async def _route(
        self,
        method: str,
        path: str,
        query: dict[str, str],
        headers: dict[str, str],
        receive: Receive,
        send: Send,
        allowed: bool,
        owner: str | None,
    ) -> int:
        """The request to its route's handler (not `allowed`: no valid key, only the public
        routes answer; `owner`: the key's owner, None without auth)."""
        for route in self._routes:
            match = route.pattern.match(path)
            if match is None:
                continue
            if not (allowed or route.public):
                break
            handler = route.methods.get(method) or route.methods.get(ANY_METHOD)
            if handler is None:
                return await method_not_allowed(send)
            request = HttpRequest(
                method=method,
                path=path,
                headers=headers,
                query=query,
                receive=receive,
                send=send,
                owner=owner,
                params=match.groups(),
            )
            return await handler(request)
        if not allowed:
            return await send_json(send, 401, _invalid_api_key(headers))
        return await send_json(
            send,
            404,
            error_body(
                f"No route for {method} {path}.{self._did_you_mean(path)}", code="not_found"
            ),
        )

    def _did_you_mean(self, path: str) -> str:
        """For a path of the API without its /v1 prefix, or with `response` for `responses`
        (`/v1/response`, `/response/ID`), a hint naming the route's path; for the root (a
        browser's first try), where the API is."""
        if path.rstrip("/") in ("", "/v1"):
            return (
                " The API is under /v1: GET /v1/models lists the models, POST /v1/responses "
                "creates a response."
            )
        near = _near_miss(path)
        if near is None or not any(r.pattern.match(near) for r in self._routes):
            return ""
        return f" Did you mean {near}?{_base_url_note(path)}"

    # --- small routes ---
    async def _health(self, req: HttpRequest) -> int:
        return await send_json(req.send, 200, {"status": "ok"})

    async def _metrics_text(self, req: HttpRequest) -> int:
        """Behind the API key when keys are configured (a scraper sends one)."""
        content_type = self.metrics.content_type.encode()
        return await send_raw(req.send, 200, await self.metrics.scrape(), content_type)

    async def _upgrade_over_http(self, req: HttpRequest) -> int:
        """`GET /v1/responses` that is no WebSocket handshake (hypercorn routes a valid one to
        `_websocket`): an upgrade refused as malformed when WebSocket mode is on (RFC 6455
        4.2.1), as disabled when it is off; 405 without an upgrade header."""
        if req.headers.get("upgrade", "").lower() != "websocket":
            return await method_not_allowed(req.send)
        if self.config.websocket:
            return await send_json(
                req.send,
                400,
                error_body(
                    "Invalid WebSocket upgrade request (RFC 6455 handshake headers "
                    "missing or wrong).",
                    code="invalid_request",
                ),
            )
        return await send_json(
            req.send,
            426,
            error_body("WebSocket mode is disabled on this server.", code="websocket_disabled"),
        )

    def _model_list(self) -> list[dict[str, Any]]:
        created = int(self._started)
        return [
            {"id": name, "object": "model", "created": created, "owned_by": "rollout"}
            for name in self.engine.registry.names()
        ]

    async def _models(self, req: HttpRequest) -> int:
        return await send_json(req.send, 200, {"object": "list", "data": self._model_list()})

    async def _model(self, req: HttpRequest) -> int:
        (name,) = req.params
        found = [m for m in self._model_list() if m["id"] == name]
        if found:
            return await send_json(req.send, 200, found[0])
        return await send_json(
            req.send,
            404,
            error_body(
                f"The model `{name}` does not exist; GET /v1/models lists the models of this "
                "server.",
                code="model_not_found",
                param="model",
            ),
        )


def _holder(scope: Scope, owner: str | None) -> str:
    """Whose share a WebSocket counts against: the API key's owner, or without auth the
    client's address (its host: every port of one machine is one client)."""
    if owner is not None:
        return f"key:{owner}"
    client = scope.get("client")
    return f"peer:{client[0]}" if client else "peer:"


def _duplicate_authorization(scope: Scope) -> tuple[int, dict[str, Any]] | None:
    """400 for a request with more than one `Authorization` header (which one would count is
    a guess a proxy and this server could make differently); None for one or none."""
    count = sum(1 for name, _ in scope.get("headers", []) if name.lower() == b"authorization")
    if count <= 1:
        return None
    return 400, error_body(
        f"The request has {count} Authorization headers; send one.",
        code="duplicate_authorization_header",
    )


# A request without a key, and one with a key the server was not given: both 401
# `invalid_api_key`, each saying what to send.
MISSING_API_KEY = (
    "You didn't provide an API key. This server requires one: send it in the Authorization "
    "header, as `Authorization: Bearer KEY`, with a key the server was started with "
    "(--api-key or ROLLOUT_API_KEYS)."
)
INCORRECT_API_KEY = (
    "Incorrect API key provided. Send a key this server was started with (--api-key or "
    "ROLLOUT_API_KEYS) in the Authorization header, as `Authorization: Bearer KEY`."
)


def _invalid_api_key(headers: Mapping[str, str]) -> dict[str, Any]:
    presented = headers.get("authorization", "").strip()
    message = INCORRECT_API_KEY if presented else MISSING_API_KEY
    return error_body(message, code="invalid_api_key")


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
