"""permessage-deflate on or off per server (`rollout serve --[no-]websocket-deflate`).

hypercorn accepts every permessage-deflate offer and has no setting against it; rollout
filters the offer out of the upgrade request when the server's option is off
(`engine/_deflate.py`). The first test pins what that relies on in hypercorn, so an upgrade
that changes it fails here. The others run real servers on loopback with clients that offer
the extension: the openai SDK's own transport (`websockets`, which offers it by default, as
the SDK and Codex do) and the benchmark's trio client (`bench/_ws.py`).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest
import trio
from hypercorn.protocol.ws_stream import Handshake
from rollout._cli import build_parser
from rollout.bench._client import probe_websocket
from rollout.bench._server import Endpoint
from rollout.bench._ws import ConnectionRejected, open_bench_ws
from rollout.engine._deflate import DEFAULT_WEBSOCKET_DEFLATE, without_deflate_offers
from rollout.engine._serve import ServerConfig
from websockets.sync.client import connect

from tests.server_harness import open_test_server, run_in_thread, ws_url

DEADLINE = 20
OFFER = b"permessage-deflate; client_max_window_bits"  # the openai SDK's (websockets') offer


def upgrade_request(extensions: bytes | None) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"host", b"127.0.0.1"),
        (b"connection", b"Upgrade"),
        (b"upgrade", b"websocket"),
        (b"sec-websocket-key", base64.b64encode(os.urandom(16))),
        (b"sec-websocket-version", b"13"),
    ]
    if extensions is not None:
        headers.append((b"sec-websocket-extensions", extensions))
    return headers


def test_hypercorn_accepts_every_deflate_offer_and_reads_the_request_headers() -> None:
    """What `decline_deflate_offers` relies on: hypercorn's handshake accepts a deflate offer
    unconditionally (if this fails, hypercorn changed: see whether it now has a setting), and
    it decides from the request's headers, so a request without the offer gets none."""
    offered = Handshake(upgrade_request(OFFER), "1.1")
    assert offered.is_valid()
    status, headers, _ = offered.accept(None, [])
    assert status == 101
    assert dict(headers)[b"sec-websocket-extensions"].startswith(b"permessage-deflate")
    declined = Handshake(without_deflate_offers(upgrade_request(OFFER)), "1.1")
    assert declined.is_valid()
    status, headers, _ = declined.accept(None, [])
    assert status == 101
    assert b"sec-websocket-extensions" not in dict(headers)


def test_without_deflate_offers() -> None:
    keep = [(b"host", b"h"), (b"sec-websocket-key", b"k")]
    assert without_deflate_offers([*keep, (b"Sec-WebSocket-Extensions", OFFER)]) == keep
    two = b"permessage-deflate; client_max_window_bits=10, PerMessage-Deflate"
    assert without_deflate_offers([(b"sec-websocket-extensions", two)]) == []
    mixed = b"x-webkit-deflate-frame, permessage-deflate; server_no_context_takeover, foo; a=1"
    assert without_deflate_offers([(b"sec-websocket-extensions", mixed)]) == [
        (b"sec-websocket-extensions", b"x-webkit-deflate-frame, foo; a=1")
    ]
    assert without_deflate_offers(keep) == keep


def test_serve_option() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).websocket_deflate is DEFAULT_WEBSOCKET_DEFLATE
    assert ServerConfig().websocket_deflate is DEFAULT_WEBSOCKET_DEFLATE
    assert parser.parse_args(["serve", "--websocket-deflate"]).websocket_deflate is True
    assert parser.parse_args(["serve", "--no-websocket-deflate"]).websocket_deflate is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--websocket-deflate", "--no-websocket-deflate"])


def sdk_transport_create(url: str) -> tuple[str | None, list[str], list[str]]:
    """A create over the openai SDK's WebSocket transport with its defaults (it offers
    permessage-deflate): (the handshake's Sec-WebSocket-Extensions, the extensions in use,
    the event types)."""
    with connect(ws_url(url), proxy=None, open_timeout=10, close_timeout=5) as ws:
        assert ws.response is not None
        negotiated = ws.response.headers.get("Sec-WebSocket-Extensions")
        extensions = [e.name for e in ws.protocol.extensions]
        ws.send(json.dumps({"type": "response.create", "model": "sim:tokens=300", "input": "Hi"}))
        types: list[str] = []
        while not types or types[-1] not in ("response.completed", "response.failed", "error"):
            types.append(json.loads(ws.recv(timeout=10))["type"])
    return negotiated, extensions, types


@pytest.mark.parametrize("deflate", [False, True], ids=["off", "on"])
async def test_sdk_transport(deflate: bool) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(websocket_deflate=deflate) as url:
            negotiated, extensions, types = await run_in_thread(sdk_transport_create, url)
    if deflate:
        assert negotiated is not None and negotiated.startswith("permessage-deflate")
        assert extensions == ["permessage-deflate"]
    else:
        assert negotiated is None
        assert extensions == []
    assert types[0] == "response.created" and types[-1] == "response.completed"


async def trio_client_create(url: str) -> tuple[bool, int, int]:
    """A create over the benchmark's trio client (offering the extension): (negotiated, bytes
    received on the wire, bytes of message payloads received)."""
    async with open_bench_ws(
        ws_url(url), max_message_size=1 << 24, receive_buffer_size=65536
    ) as ws:
        body: dict[str, Any] = {"type": "response.create", "model": "sim:tokens=300", "input": "Hi"}
        await ws.send_message(json.dumps(body))
        while json.loads(await ws.get_message())["type"] != "response.completed":
            pass
        return ws.deflate, ws.counts.wire_in, ws.counts.payload_in


async def test_two_servers_each_with_its_own_setting() -> None:
    """The switch is per server, not per process: both run here side by side."""
    with trio.fail_after(DEADLINE):
        async with (
            open_test_server(websocket_deflate=True) as on,
            open_test_server(websocket_deflate=False) as off,
        ):
            on_deflate, on_wire, on_payload = await trio_client_create(on)
            off_deflate, off_wire, off_payload = await trio_client_create(off)
    assert on_deflate and not off_deflate
    # The same deterministic answer either way; compressed, it takes fewer bytes on the wire
    # than its payload (the upgrade response's bytes count too, on both).
    assert on_payload == off_payload
    assert on_wire < on_payload < off_wire


async def test_trio_client_reports_a_refused_upgrade_as_itself() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(websocket=False) as url:
            with pytest.raises(ConnectionRejected) as refused:
                async with open_bench_ws(
                    ws_url(url), max_message_size=1024, receive_buffer_size=1024
                ):
                    pass  # pragma: no cover
            assert refused.value.status_code == 426
            deflate, why = await probe_websocket(Endpoint(label="x", base_url=url))
            assert deflate is None and why.startswith(
                "no WebSocket mode: the upgrade was answered HTTP 426: WebSocket mode is disabled"
            ), why
