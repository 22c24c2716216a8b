"""The app's routing table and error answers, driven in-process over ASGI (no sockets):
which path and method reach which route, 405 and 404, auth before routing, trailing slashes,
and which refusals count as request errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from rollout.engine import MemoryResponseStore
from rollout.engine._app import AppConfig, RolloutApp
from rollout.engine._engine import open_engine

DEADLINE = 10
KEY = "key-a"
AUTH = [(b"authorization", f"Bearer {KEY}".encode())]


async def call(
    app: RolloutApp,
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
    query: bytes = b"",
) -> tuple[int, dict[str, str], Any]:
    """One request: (status, headers, parsed JSON body or text)."""
    inbox = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []
    done = trio.Event()

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query,
        "headers": AUTH if headers is None else headers,
    }
    with trio.fail_after(DEADLINE):
        await app(scope, receive, send)
    start = sent[0]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    response_headers = {k.decode(): v.decode() for k, v in start["headers"]}
    if response_headers["content-type"] == "application/json":
        return start["status"], response_headers, json.loads(payload)
    return start["status"], response_headers, payload.decode()


@pytest.fixture
async def app() -> AsyncIterator[RolloutApp]:
    async with open_engine(store=MemoryResponseStore()) as engine:
        yield RolloutApp(engine, AppConfig(api_keys=(KEY,), max_message_size=1000))


def code_of(body: Any) -> str | None:
    return body["error"]["code"] if isinstance(body, dict) and "error" in body else None


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/healthz", 200, None),
        ("POST", "/healthz", 200, None),  # any method
        ("GET", "/healthz/", 404, "not_found"),
        ("GET", "/metrics", 200, None),
        ("GET", "/metrics/", 404, "not_found"),
        ("PUT", "/v1/responses", 405, "method_not_allowed"),
        ("GET", "/v1/responses", 405, "method_not_allowed"),  # no upgrade header
        ("GET", "/responses//", 404, "not_found"),  # the API is under /v1 only
        ("GET", "/v1/responses/compact", 405, "method_not_allowed"),
        ("GET", "/v1/responses/compact//", 405, "method_not_allowed"),
        ("GET", "/v1/responses/input_tokens/", 405, "method_not_allowed"),
        ("POST", "/v1/responses/resp_x", 405, "method_not_allowed"),
        ("GET", "/v1/responses/resp_x", 404, "response_not_found"),
        ("GET", "/v1/responses/resp_x/", 404, "response_not_found"),
        ("DELETE", "/v1/responses/resp_x", 404, "response_not_found"),
        ("GET", "/v1/responses/resp_x/input_items", 404, "response_not_found"),
        ("POST", "/v1/responses/resp_x/input_items", 405, "method_not_allowed"),
        ("GET", "/v1/responses/a/b", 404, "not_found"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("GET", "/chat/completions/", 404, "not_found"),
        ("GET", "/v1/models", 200, None),
        ("GET", "/v1/models//", 200, None),
        ("POST", "/v1/models", 405, "method_not_allowed"),
        ("GET", "/v1/models/sim", 200, None),
        ("GET", "/v1/models/nope", 404, "model_not_found"),
        ("DELETE", "/v1/models/sim", 405, "method_not_allowed"),
        ("GET", "/v2/anything", 404, "not_found"),
    ],
)
async def test_routes(app: RolloutApp, method: str, path: str, status: int, code: str) -> None:
    got_status, _, body = await call(app, method, path)
    assert (got_status, code_of(body)) == (status, code)


@pytest.mark.parametrize(
    ("path", "status"), [("/healthz", 200), ("/metrics", 401), ("/nope", 401), ("/v1/models", 401)]
)
async def test_only_health_is_served_without_a_key(app: RolloutApp, path: str, status: int) -> None:
    got_status, _, body = await call(app, "GET", path, headers=[])
    assert got_status == status
    if status == 401:
        assert code_of(body) == "invalid_api_key"


# One request per route of the API (method, path under /v1), each reaching its route.
API_ROUTES = [
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses"),
    ("POST", "/v1/responses/compact"),
    ("POST", "/v1/responses/input_tokens"),
    ("GET", "/v1/responses/resp_x/input_items"),
    ("GET", "/v1/responses/resp_x"),
    ("DELETE", "/v1/responses/resp_x"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/sim"),
]


async def test_every_api_route_is_in_the_list(app: RolloutApp) -> None:
    """So that a new route is tested both ways below."""
    api = [r for r in app._routes if r.pattern.pattern.startswith("/v1/")]
    for route in api:
        assert any(route.pattern.match(path) for _, path in API_ROUTES), route.pattern.pattern


@pytest.mark.parametrize(("method", "path"), API_ROUTES)
async def test_every_route_is_under_v1_and_the_404_without_it_says_so(
    app: RolloutApp, method: str, path: str
) -> None:
    status, _, body = await call(app, method, path, b"{")
    assert code_of(body) != "not_found", (status, body)  # the route answered
    bare = path.removeprefix("/v1")
    for without in (bare, bare + "/"):
        status, _, body = await call(app, method, without, b"{")
        assert (status, code_of(body)) == (404, "not_found")
        assert body["error"]["message"] == (
            f"No route for {method} {without}. Did you mean /v1{without}? "
            "(The base URL ends in /v1.)"
        )


async def test_other_404s_have_no_hint(app: RolloutApp) -> None:
    for path in ("/v2/responses", "/nope", "/v1/nope", "/healthz/x"):
        status, _, body = await call(app, "GET", path)
        assert (status, body["error"]["message"]) == (404, f"No route for GET {path}.")


@pytest.mark.parametrize("path", ["/", "/v1", "/v1/"])
async def test_the_root_says_where_the_api_is(app: RolloutApp, path: str) -> None:
    status, _, body = await call(app, "GET", path)
    assert (status, body["error"]["message"]) == (
        404,
        f"No route for GET {path}. The API is under /v1: GET /v1/models lists the models, "
        "POST /v1/responses creates a response.",
    )


async def upgrade(app: RolloutApp, path: str) -> tuple[int, Any]:
    """A WebSocket handshake to `path` in-process: (status, body) of the refusal, or (101,
    None) when accepted (then the client leaves)."""
    inbox = [{"type": "websocket.connect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "websocket.disconnect", "code": 1000}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": path, "headers": AUTH, "query_string": b""}
    with trio.fail_after(DEADLINE):
        await app(scope, receive, send)
    if sent[0]["type"] == "websocket.accept":
        return 101, None
    return sent[0]["status"], json.loads(sent[1]["body"])


async def test_the_websocket_endpoint_is_under_v1_and_the_404_without_it_says_so(
    app: RolloutApp,
) -> None:
    assert await upgrade(app, "/v1/responses") == (101, None)
    assert await upgrade(app, "/v1/responses/") == (101, None)
    status, body = await upgrade(app, "/responses")
    assert (status, code_of(body)) == (404, "not_found")
    assert body["error"]["message"] == (
        "No WebSocket endpoint at /responses. Did you mean /v1/responses? "
        "(The base URL ends in /v1.)"
    )
    status, body = await upgrade(app, "/v1/other")
    assert (status, body["error"]["message"]) == (404, "No WebSocket endpoint at /v1/other.")


async def test_a_get_with_an_upgrade_header_is_a_malformed_handshake(app: RolloutApp) -> None:
    status, _, body = await call(
        app, "GET", "/v1/responses", headers=[*AUTH, (b"upgrade", b"WebSocket")]
    )
    assert (status, code_of(body)) == (400, "invalid_request")


async def test_which_refusals_count_as_request_errors(app: RolloutApp) -> None:
    counters = app.engine.counters
    cases = [
        # (path, body, query, status, code, counted)
        ("/v1/responses", b"{", b"", 400, "invalid_json", True),
        ("/v1/responses/compact", b"[]", b"", 400, "invalid_type", True),
        (
            "/v1/responses/input_tokens",
            b"[" * 2000 + b"]" * 2000,
            b"",
            413,
            "message_too_large",
            False,
        ),
        ("/v1/chat/completions", b"{", b"", 400, "invalid_json", True),
        ("/v1/chat/completions", b"x" * 1001, b"", 413, "message_too_large", False),
        ("/v1/responses", b"x" * 1001, b"", 413, "message_too_large", False),
    ]
    for path, body, query, status, code, counted in cases:
        before = counters.request_errors
        got_status, _, answer = await call(app, "POST", path, body, query=query)
        assert got_status == status, (path, answer)
        if code is not None:
            assert code_of(answer) == code
        assert counters.request_errors == before + counted, path
    before = counters.request_errors
    status, _, answer = await call(app, "GET", "/v1/responses/r/input_items", query=b"limit=0")
    assert (status, code_of(answer), answer["error"]["param"]) == (400, "invalid_value", "limit")
    assert counters.request_errors == before


async def test_input_items_pages(app: RolloutApp) -> None:
    create = {
        "model": "sim",
        "store": True,
        "input": [{"role": "user", "content": text} for text in "abcde"],
    }
    status, _, response = await call(app, "POST", "/v1/responses", json.dumps(create).encode())
    assert status == 200
    path = f"/v1/responses/{response['id']}/input_items"
    pages: list[list[str]] = []
    after = b""
    while True:
        status, _, page = await call(app, "GET", path, query=b"limit=2&order=asc" + after)
        assert status == 200
        texts = [item["content"][0]["text"] for item in page["data"]]
        pages.append(texts)
        if not page["has_more"]:
            break
        after = b"&after=" + page["last_id"].encode()
    assert pages == [["a", "b"], ["c", "d"], ["e"]]
    status, _, page = await call(app, "GET", path)
    assert [item["content"][0]["text"] for item in page["data"]] == list("edcba")
