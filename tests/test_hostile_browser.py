"""A web page cannot reach into the server (issue 29, items 7 and 8; `engine/_browser.py`).

Against a real `rollout serve` process (the rules are about what arrives on the wire: raw
sockets send the `Host` and `Origin` a browser would):

1. a cross-site WebSocket upgrade (`Origin: https://evil.example`) gets 403 and an OpenAI
   error body before any upgrade (cross-site WebSocket hijacking);
2. a request for a stored response with `Host: rebind.evil.example` gets 421 (DNS
   rebinding), while the same request for `localhost` reads it;
3. a `text/plain` or form POST gets 415 (a cross-site form), and curl's `-d` without a
   JSON content type is told to send one, while the README's curl line works;
4. the clients are unaffected: httpx and the openai SDK (no `Origin`), a loopback page's
   WebSocket by default; with API keys, no page unless listed (`--allow-origin`).

The rule matrix itself runs in-process over ASGI. Item ids are scoped to their owner (item
8): through a server over SQLite and PostgreSQL here, each store and its migration in
`tests/test_store.py`.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h11
import httpx
import openai
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from rollout.engine import MemoryResponseStore
from rollout.engine._app import AppConfig, RolloutApp
from rollout.engine._browser import BrowserRules, is_loopback
from rollout.engine._engine import open_engine

from tests.client_harness import RolloutProcess, open_rollout_process
from tests.server_harness import fetch_counters, open_ws, run_in_thread
from tests.test_server_routes import call

DEADLINE = 60
KEY = "key-browser"
JSON = (b"content-type", b"application/json")
CREATE = json.dumps({"model": "sim", "input": "Hello!"}).encode()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


async def raw_request(port: int, head: str, body: bytes = b"") -> tuple[int, bytes, bytes]:
    """One HTTP/1.1 exchange on a fresh socket, the request written as given (the headers a
    browser would send) and the answer read with h11: (status, header block, body). A 101
    ends the exchange at its headers."""
    client = h11.Connection(h11.CLIENT)
    # h11 reads the answer to a request it has seen sent: let it see a GET that may be
    # upgraded (so a 101 or any other answer is expected), and send ours.
    proposal = [("host", "x"), ("connection", "upgrade"), ("upgrade", "websocket")]
    client.send(h11.Request(method="GET", target="/", headers=proposal))
    client.send(h11.EndOfMessage())
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    status, header, payload = 0, b"", b""
    async with stream:
        await stream.send_all(head.encode() + b"\r\n" + body)
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.InformationalResponse | h11.Response):
                status = event.status_code
                header = b"\r\n".join(k + b": " + v for k, v in event.headers)
                if status == 101:
                    return status, header, b""
            elif isinstance(event, h11.Data):
                payload += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, header, payload


def upgrade_head(host: str, origin: str | None, key: str | None = None) -> str:
    nonce = base64.b64encode(os.urandom(16)).decode()
    lines = [
        "GET /v1/responses HTTP/1.1",
        f"Host: {host}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {nonce}",
        "Sec-WebSocket-Version: 13",
    ]
    if origin is not None:
        lines.append(f"Origin: {origin}")
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    return "\r\n".join(lines) + "\r\n"


def error_of(body: bytes) -> dict[str, Any]:
    parsed = json.loads(body)
    assert set(parsed) == {"error"}, parsed
    assert set(parsed["error"]) == {"message", "type", "param", "code"}, parsed
    error: dict[str, Any] = parsed["error"]
    return error


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RolloutProcess]:
    """`rollout serve` on 127.0.0.1 without keys: the defaults a user starts with."""
    with trio.fail_after(DEADLINE):
        async with open_rollout_process(data_dir=tmp_path / "data") as process:
            yield process


async def test_a_cross_site_websocket_upgrade_is_refused_before_it_is_accepted(
    server: RolloutProcess,
) -> None:
    port = port_of(server.url)
    with trio.fail_after(DEADLINE):
        status, header, body = await raw_request(
            port, upgrade_head(f"127.0.0.1:{port}", "https://evil.example")
        )
        assert status == 403, header
        assert b"upgrade: websocket" not in header.lower()
        error = error_of(body)
        assert error["code"] == "origin_not_allowed"
        assert error["type"] == "invalid_request_error"
        assert "--allow-origin" in error["message"]
        # A page of the user's own machine (any port) may, as may a client without Origin.
        for origin in (f"http://localhost:{port}", "http://127.0.0.1:3000", "https://[::1]"):
            status, header, _ = await raw_request(port, upgrade_head("localhost", origin))
            assert status == 101, (origin, header)
        async with open_ws(server.url) as ws:  # trio-websocket: no Origin
            events = await ws.create(model="sim", input="Hello!")
            assert events[-1].type == "response.completed"
        assert (await fetch_counters(server.url))["browser_refusals"] == 1
    assert any(r.get("event") == "ws_refused" and r["status"] == 403 for r in server.access())


async def test_a_rebound_host_cannot_read_a_stored_response(server: RolloutProcess) -> None:
    port = port_of(server.url)
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(base_url=server.url) as client:
            created = (await client.post("/responses", json={"model": "sim", "input": "hi"})).json()
        path = f"/v1/responses/{created['id']}"
        status, _, body = await raw_request(port, f"GET {path} HTTP/1.1\r\nHost: localhost\r\n")
        assert status == 200 and json.loads(body)["id"] == created["id"]
        for host in ("rebind.evil.example", "rebind.evil.example:8000", "127.0.0.1.nip.io"):
            status, _, body = await raw_request(port, f"GET {path} HTTP/1.1\r\nHost: {host}\r\n")
            assert status == 421, host
            error = error_of(body)
            assert error["code"] == "host_not_allowed" and "--allow-host" in error["message"]
            assert created["id"] not in body.decode()
        status, _, body = await raw_request(
            port, upgrade_head("rebind.evil.example", f"http://rebind.evil.example:{port}")
        )
        assert status == 421 and error_of(body)["code"] == "host_not_allowed"


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "TEXT/PLAIN",
    ],
)
async def test_a_form_post_is_refused(server: RolloutProcess, content_type: str) -> None:
    port = port_of(server.url)
    with trio.fail_after(DEADLINE):
        head = (
            f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(CREATE)}\r\n"
        )
        status, _, body = await raw_request(port, head, CREATE)
    assert status == 415
    error = error_of(body)
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"]


async def test_curl_without_a_json_content_type_is_told_to_send_one(
    server: RolloutProcess,
) -> None:
    """curl's `-d` sends `application/x-www-form-urlencoded`: refused with a message saying
    what to send; the README's line (with `-H 'Content-Type: application/json'`) works."""
    url = server.url + "/responses"
    body = CREATE.decode()

    def curl(*extra: str) -> tuple[int, dict[str, Any]]:
        done = subprocess.run(
            ["curl", "-s", "-w", "\n%{http_code}", url, *extra, "-d", body],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        payload, _, code = done.stdout.rpartition("\n")
        return int(code), json.loads(payload)

    with trio.fail_after(DEADLINE):
        status, answer = await run_in_thread(curl)
        assert status == 415
        assert "-H 'Content-Type: application/json'" in answer["error"]["message"]
        status, answer = await run_in_thread(curl, "-H", "Content-Type: application/json")
        assert status == 200 and answer["status"] == "completed"


async def test_sdk_clients_are_unaffected(server: RolloutProcess) -> None:
    def with_sdk() -> str:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        return client.responses.create(model="sim", input="Hello!").status or ""

    with trio.fail_after(DEADLINE):
        assert await run_in_thread(with_sdk) == "completed"
        async with httpx.AsyncClient(base_url=server.url) as client:
            resp = await client.post("/responses", json={"model": "sim", "input": "hi"})
            assert resp.status_code == 200
            # A loopback page's request (same-site for the browser) is served too.
            resp = await client.post(
                "/responses",
                json={"model": "sim", "input": "hi"},
                headers={"Origin": "http://localhost:5173"},
            )
            assert resp.status_code == 200


async def test_with_keys_only_listed_origins_reach_the_server(tmp_path: Path) -> None:
    listed = "https://app.example.com"
    args = ["--api-key", KEY, "--allow-origin", listed, "--allow-host", "api.example.com"]
    with trio.fail_after(DEADLINE):
        async with open_rollout_process(data_dir=tmp_path / "d", extra_args=args) as server:
            port = port_of(server.url)
            for origin, status in (
                ("http://localhost:5173", 403),  # loopback pages too: keys are configured
                ("https://evil.example", 403),
                (listed, 101),
                ("https://APP.example.com:443", 101),  # the same origin, spelled otherwise
            ):
                got, header, _ = await raw_request(
                    port, upgrade_head(f"127.0.0.1:{port}", origin, KEY)
                )
                assert got == status, (origin, header)
            # A listed host (a deployment reached by name) is answered, and loopback still.
            for host, status in (("api.example.com", 200), ("other.example", 421)):
                got, _, _ = await raw_request(
                    port,
                    f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n",
                )
                assert got == status, host


async def test_a_bad_option_value_stops_the_command(tmp_path: Path) -> None:
    import sys

    done = await trio.run_process(
        [sys.executable, "-m", "rollout", "serve", "--allow-origin", "evil.example/x"],
        capture_stderr=True,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert b"--allow-origin 'evil.example/x'" in done.stderr


# --- the rule matrix, in-process -------------------------------------------------------------


def rules(bound: str = "127.0.0.1", keys: bool = False, **lists: Any) -> BrowserRules:
    return BrowserRules.make(bound_host=bound, keys_configured=keys, **lists)


@pytest.mark.parametrize(
    ("bound", "keys", "lists", "host", "origin", "status"),
    [
        # Bound to loopback, no keys: loopback names, any port; loopback pages.
        ("127.0.0.1", False, {}, "localhost:8000", None, None),
        ("127.0.0.1", False, {}, "127.0.0.1", "http://127.0.0.1:9999", None),
        ("127.0.0.1", False, {}, "[::1]:8000", "https://[::1]:8443", None),
        ("127.0.0.1", False, {}, "LOCALHOST.", None, None),
        ("127.0.0.1", False, {}, "rebind.evil.example", None, 421),
        ("127.0.0.1", False, {}, "localhost.evil.example", None, 421),
        ("127.0.0.1", False, {}, "127.0.0.2", None, 421),
        ("127.0.0.1", False, {}, "localhost", "https://evil.example", 403),
        ("127.0.0.1", False, {}, "localhost", "null", 403),  # a sandboxed page, a file
        ("127.0.0.1", False, {}, "localhost", "http://localhost.evil.example", 403),
        ("::1", False, {}, "[::1]:8000", None, None),
        ("127.0.0.2", False, {}, "127.0.0.2:8000", None, None),  # the bound address itself
        ("127.0.0.2", False, {}, "127.0.0.3:8000", None, 421),
        ("localhost", False, {}, "rebind.evil.example", None, 421),
        # With keys: no page unless listed.
        ("127.0.0.1", True, {}, "localhost", "http://localhost:3000", 403),
        ("127.0.0.1", True, {"allow_origins": ["http://localhost:3000"]}, None, None, None),
        (
            "127.0.0.1",
            True,
            {"allow_origins": ["http://localhost:3000"]},
            "localhost",
            "http://localhost:3000",
            None,
        ),
        ("127.0.0.1", True, {"allow_origins": ["*"]}, "localhost", "https://any.example", None),
        # Bound elsewhere: every Host unless names are listed.
        ("0.0.0.0", False, {}, "rollout.internal:8000", None, None),
        ("0.0.0.0", True, {"allow_hosts": ["rollout.internal"]}, "rollout.internal", None, None),
        ("0.0.0.0", True, {"allow_hosts": ["rollout.internal"]}, "evil.example", None, 421),
        ("127.0.0.1", False, {"allow_hosts": ["*"]}, "anything.example", None, None),
    ],
)
def test_rules(
    bound: str,
    keys: bool,
    lists: dict[str, Any],
    host: str | None,
    origin: str | None,
    status: int | None,
) -> None:
    headers = {k: v for k, v in (("host", host), ("origin", origin)) if v is not None}
    refusal = rules(bound, keys, **lists).refuse(headers)
    assert (refusal[0] if refusal else None) == status


_LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
_NAMES = st.lists(_LABEL, min_size=1, max_size=4).map(".".join)
_PORTS = st.none() | st.integers(1, 65535)


@given(name=_NAMES, port=_PORTS, scheme=st.sampled_from(["http", "https"]))
def test_generated_foreign_hosts_and_origins_are_refused(
    name: str, port: int | None, scheme: str
) -> None:
    """Any name but the loopback ones, with or without a port, is a foreign Host (421) and a
    foreign Origin (403) for a server bound to loopback; the loopback names with that port
    are neither."""
    suffix = "" if port is None else f":{port}"
    loopback = name in ("localhost", "127.0.0.1")
    for keys in (False, True):
        refusal = rules(keys=keys).refuse({"host": name + suffix})
        assert (refusal[0] if refusal else None) == (None if loopback else 421)
        refusal = rules(keys=keys).refuse({"origin": f"{scheme}://{name}{suffix}"})
        allowed = loopback and not keys
        assert (refusal[0] if refusal else None) == (None if allowed else 403)
    assert rules().refuse({"host": "localhost" + suffix}) is None
    assert rules().refuse({"origin": f"{scheme}://[::1]{suffix}"}) is None


@pytest.mark.parametrize("value", ["evil.example", "https://a.example/path", "ftp://a.example"])
def test_an_origin_option_must_be_an_origin(value: str) -> None:
    with pytest.raises(ValueError, match="--allow-origin"):
        rules(allow_origins=[value])


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "::", "example.com"))


@pytest.fixture
async def app() -> AsyncIterator[RolloutApp]:
    async with open_engine(store=MemoryResponseStore()) as engine:
        yield RolloutApp(engine, AppConfig())


@pytest.mark.parametrize(
    "path", ["/v1/responses", "/v1/responses/compact", "/v1/responses/input_tokens"]
)
async def test_every_post_route_refuses_form_bodies(app: RolloutApp, path: str) -> None:
    status, _, body = await call(
        app, "POST", path, CREATE, headers=[(b"content-type", b"text/plain")]
    )
    assert status == 415 and body["error"]["code"] == "unsupported_media_type"
    status, _, body = await call(app, "POST", "/v1/chat/completions", b"{}", headers=[])
    assert status != 415  # no Content-Type at all: not a form (a fetch body's Origin is checked)


async def test_refusals_come_before_auth_and_work(tmp_path: Path) -> None:
    """A page's request is refused for what it is, not read: no body is parsed, nothing
    stored, whatever the key says."""
    store = MemoryResponseStore()
    async with open_engine(store=store) as engine:
        app = RolloutApp(engine, AppConfig(api_keys=(KEY,)))
        auth = (b"authorization", f"Bearer {KEY}".encode())
        for headers, status in (
            ([auth, JSON, (b"origin", b"https://evil.example")], 403),
            ([auth, JSON, (b"host", b"rebind.evil.example")], 421),
            ([auth, (b"content-type", b"application/x-www-form-urlencoded")], 415),
            ([JSON, (b"origin", b"https://evil.example")], 403),  # no key either
            ([auth, JSON], 200),
        ):
            got, _, _ = await call(app, "POST", "/v1/responses", CREATE, headers=headers)
            assert got == status, headers
        assert await store.count() == 1
        assert engine.counters.browser_refusals == 4


# --- item-id squatting (issue 29, item 8), through the server and each store -----------------


@pytest.fixture(params=["sqlite", "postgresql"])
def durable(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Where a test server keeps its store: a data dir, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        return {"data_dir": tmp_path / "data"}
    return {"data_dir": None, "store_url": request.getfixturevalue("postgres_urls")()}


async def test_an_item_id_taken_by_another_key_is_still_ours(durable: dict[str, Any]) -> None:
    """Key B stores an item with a client-chosen id first; key A stores its own with that id,
    and after a restart (so the lookup reaches the store, not the write queue) A's
    `item_reference` finds A's item and B's finds B's."""
    from tests.server_harness import open_test_server

    keys = ("key-a", "key-b")

    def message(text: str) -> dict[str, Any]:
        return {"type": "message", "role": "user", "id": "msg_squat", "content": text}

    with trio.fail_after(DEADLINE):
        async with open_test_server(api_keys=keys, **durable) as url:
            for key in reversed(keys):  # B first
                async with httpx.AsyncClient(
                    base_url=url, headers={"Authorization": f"Bearer {key}"}
                ) as client:
                    resp = await client.post(
                        "/responses", json={"model": "sim", "input": [message(f"{key}'s")]}
                    )
                    assert resp.status_code == 200
        async with open_test_server(api_keys=keys, **durable) as url:
            for key in keys:
                async with httpx.AsyncClient(
                    base_url=url, headers={"Authorization": f"Bearer {key}"}
                ) as client:
                    ref = {"type": "item_reference", "id": "msg_squat"}
                    resp = await client.post("/responses", json={"model": "sim", "input": [ref]})
                    assert resp.status_code == 200, resp.text
                    listed = await client.get(f"/responses/{resp.json()['id']}/input_items")
                    (item,) = listed.json()["data"]
                    assert item["content"] == [{"type": "input_text", "text": f"{key}'s"}]
