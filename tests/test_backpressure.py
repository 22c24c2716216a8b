"""Bounds on what a peer can pin (buffered output per connection, connections), and a peer's
protocol errors answered by the protocol (1007 for text that is not UTF-8).

- A client that sends a create for a huge output and never reads: its frames fill the
  connection's outbox (`max_buffered_bytes`), the response pauses, and after
  `send_stall_limit` it is cancelled (the usage of what was sampled is recorded, as an
  interrupted step) and the connection torn down; the `slow_consumers` counter says so.
  Another client is served throughout.
- Past `max_connections` open WebSockets, an upgrade is refused with 503
  (`too_many_connections`) before 101, and counted; closing one frees a place.
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import struct
from pathlib import Path

import httpx
import pytest
import trio
import trio_websocket
from rollout.engine._ws import WebSocketLimits

from tests.server_harness import fetch_counters, open_test_server, open_ws, parse_metrics

DEADLINE = 20
STALL = 0.5  # seconds: the server's stall limit in this test


async def test_a_client_that_stops_reading_is_cut_off_and_its_usage_recorded(
    tmp_path: Path,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(
            tmp_path,
            websocket_limits=WebSocketLimits(max_buffered_bytes=64 * 1024, send_stall_limit=STALL),
        ) as url:
            # The stalled client: a create for ~1M tokens, then it never reads again (its
            # library stops reading the socket once one message waits unread). The server
            # resets its connection; its library's reader, waiting to hand over a message,
            # would wait forever on the way out, so the block is cancelled at the end.
            with trio.CancelScope() as leave:
                async with trio_websocket.open_websocket_url(
                    url.replace("http", "ws") + "/responses", message_queue_size=0
                ) as stalled:
                    await stalled.send_message(
                        json.dumps(
                            {
                                "type": "response.create",
                                "model": "sim:tokens=1000000,interval_ms=0",
                                "input": "Write forever.",
                                "store": False,
                            }
                        )
                    )
                    # Meanwhile, another client is served, again and again, until the server has
                    # given up on the stalled one.
                    async with open_ws(url) as ws:
                        while (await fetch_counters(url)).get("slow_consumers", 0) == 0:
                            events = await ws.create(model="sim:tokens=4", input="Hi", store=False)
                            assert events[-1].type == "response.completed"
                    counters = await fetch_counters(url)
                    leave.cancel()
    assert counters["slow_consumers"] == 1
    assert counters["responses_completed"] >= 1  # the other client's, all of them
    # Its usage: one interrupted step, with the tokens sampled before the cut.
    conn = sqlite3.connect(tmp_path / "usage.sqlite3")
    try:
        rows = list(conn.execute("SELECT output_tokens FROM usage WHERE complete = 0"))
    finally:
        conn.close()
    assert len(rows) == 1 and rows[0][0] > 0


async def test_connections_past_the_limit_are_refused() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(max_connections=2, key_connection_share=1.0) as url:
            async with open_ws(url), open_ws(url):
                with pytest.raises(trio_websocket.ConnectionRejected) as refused:
                    async with open_ws(url):
                        pass  # pragma: no cover
            # Both closed: there is room again.
            async with open_ws(url) as ws:
                events = await ws.create(model="sim:tokens=4", input="Hi", store=False)
            root = url.removesuffix("/v1")
            async with httpx.AsyncClient() as client:
                metrics = parse_metrics((await client.get(f"{root}/metrics")).text)
    assert refused.value.status_code == 503
    assert refused.value.body is not None
    assert json.loads(refused.value.body)["error"]["code"] == "too_many_connections"
    assert events[-1].type == "response.completed"
    assert metrics[("rollout_refused_connections_total", frozenset())] == 1


def _masked_frame(opcode: int, payload: bytes) -> bytes:
    """One client frame (FIN set, masked), built by hand: no client library sends bad text."""
    mask = os.urandom(4)
    head = bytes([0x80 | opcode])
    size = len(payload)
    head += bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + struct.pack(">H", size)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_text_that_is_not_utf8_is_answered_with_close_1007() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            key = base64.b64encode(os.urandom(16)).decode()
            await stream.send_all(
                (
                    "GET /v1/responses HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
                    f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                    "Sec-WebSocket-Version: 13\r\n\r\n"
                ).encode()
            )
            received = b""
            while b"\r\n\r\n" not in received:
                received += await stream.receive_some(4096)
            assert received.startswith(b"HTTP/1.1 101")
            frames = received.split(b"\r\n\r\n", 1)[1]
            await stream.send_all(_masked_frame(0x1, b'{"type": "\xff\xfe"}'))
            while True:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                frames += chunk
            await stream.aclose()
    # A close frame (opcode 8) whose status code is 1007 (invalid frame payload data).
    assert frames[0] == 0x88, frames[:16]
    assert struct.unpack(">H", frames[2:4])[0] == 1007
