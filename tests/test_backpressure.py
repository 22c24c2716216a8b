"""Bounds on what a peer can pin: buffered output per connection, and connections.

- A client that sends a create for a huge output and never reads: its frames fill the
  connection's outbox (`max_buffered_bytes`), the response pauses, and after
  `send_stall_limit` it is cancelled (the usage of what was sampled is recorded, as an
  interrupted step) and the connection torn down; the `slow_consumers` counter says so.
  Another client is served throughout.
- Past `max_connections` open WebSockets, an upgrade is refused with 503
  (`too_many_connections`) before 101, and counted; closing one frees a place.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest
import trio
import trio_websocket

from tests.server_harness import fetch_counters, open_test_server, open_ws, parse_metrics

DEADLINE = 20
STALL = 0.5  # seconds: the server's stall limit in this test


async def test_a_client_that_stops_reading_is_cut_off_and_its_usage_recorded(
    tmp_path: Path,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(
            tmp_path, max_buffered_bytes=64 * 1024, send_stall_limit=STALL
        ) as url:
            # The stalled client: a create for ~1M tokens, then it never reads again (its
            # library stops reading the socket once one message waits unread).
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
        async with open_test_server(max_connections=2) as url:
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
