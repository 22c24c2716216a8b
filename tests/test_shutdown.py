"""SIGTERM with responses longer than the grace period: every stream ends cleanly.

A real `rollout serve --graceful-timeout 1` gets SIGTERM while a WebSocket response and a
server-sent-events response are sampling far beyond the grace period. Past it, each ends with
`response.failed` (`server_error`, the server is shutting down) as its last event, the
WebSocket then closes with 1001 (going away), the SSE body completes, and the process exits 0.
A create sent on the socket after the interruption is refused (503), not started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

from tests.client_harness import open_rollout_process
from tests.server_harness import open_ws, sse_data

DEADLINE = 30
# ~100 s of output at 20 tokens/s: far longer than the 1 s grace period.
LONG = {"model": "sim:tps=20,tokens=2000", "input": "Tell me everything."}


async def test_sigterm_ends_streams_longer_than_the_grace_period(tmp_path: Path) -> None:
    ws_events: list[Any] = []
    sse_events: list[dict[str, Any]] = []
    close_code: int | None = None
    started = {"ws": trio.Event(), "sse": trio.Event()}

    async with open_rollout_process(
        data_dir=tmp_path / "data", extra_args=["--graceful-timeout", "1"]
    ) as server:
        url = server.url

        async def ws_client() -> None:
            nonlocal close_code
            async with open_ws(url) as ws:
                await ws.send({"type": "response.create", **LONG})
                try:
                    while True:
                        event = await ws.recv()
                        ws_events.append(event)
                        if event.type == "response.output_text.delta":
                            started["ws"].set()
                except trio_websocket.ConnectionClosed as closed:
                    close_code = closed.reason.code

        async def sse_client() -> None:
            async with (
                httpx.AsyncClient(timeout=DEADLINE) as client,
                client.stream("POST", f"{url}/responses", json={**LONG, "stream": True}) as resp,
            ):
                async for data in sse_data(resp):
                    sse_events.append(data)
                    if data["type"] == "response.output_text.delta":
                        started["sse"].set()

        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ws_client)
                nursery.start_soon(sse_client)
                await started["ws"].wait()
                await started["sse"].wait()
                server.terminate()
    # (Leaving the block waited for the process and asserted exit status 0.)
    last = ws_events[-1]
    assert last.type == "response.failed", [e.type for e in ws_events[-3:]]
    assert last.response.error is not None and last.response.error.code == "server_error"
    assert "shutting down" in last.response.error.message
    assert close_code == 1001
    assert sse_events[-1]["type"] == "response.failed"
    assert sse_events[-1]["response"]["error"]["code"] == "server_error"
    # Sequence numbers run on to the end: nothing was cut in the middle.
    assert [e["sequence_number"] for e in sse_events] == list(range(len(sse_events)))
    assert [e.sequence_number for e in ws_events] == list(range(len(ws_events)))
