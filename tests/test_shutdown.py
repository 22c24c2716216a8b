"""SIGTERM with responses longer than the grace period: every stream ends cleanly, and every
transport tells the client the same thing about what it got.

A real `rollout serve --graceful-timeout 1` gets SIGTERM while three responses are sampling far
beyond the grace period: one over WebSocket, one streamed over HTTP (server-sent events), one
an HTTP request without `stream`. Past the grace period each ends `incomplete` with reason
`server_shutdown` (the WebSocket and the SSE stream with `response.incomplete` as their last
event, the plain request with that response, status 200), carrying the text that streamed (a
message closed `incomplete`) and the usage the ledger recorded for it. The WebSocket then
closes with 1001 (going away), the SSE body completes, and the process exits 0. Afterwards the
stored responses, fetched with `GET /v1/responses/{id}` from a server on the same data folder,
are the responses the clients got.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket
from rollout.engine import open_sqlite_ledger
from rollout.spec._schema import event_problems, response_problems

from tests.client_harness import open_rollout_process
from tests.server_harness import fetch_counters, open_test_server, open_ws, sse_data

DEADLINE = 60
# ~100 s of output at 20 tokens/s: far longer than the 1 s grace period.
LONG = {"model": "sim:tps=20,tokens=2000", "input": "Tell me everything."}
SHUTDOWN = {"reason": "server_shutdown"}


def _text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def _usage(response: dict[str, Any]) -> tuple[int, int, int]:
    usage = response["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    return (
        usage["input_tokens"],
        usage["input_tokens_details"]["cached_tokens"],
        usage["output_tokens"],
    )


def _check_interrupted(response: dict[str, Any], text: str | None) -> None:
    """What every interrupted response says, on every transport: incomplete, why, and the
    message so far (with `text`, the text its deltas carried)."""
    assert response["status"] == "incomplete", response["status"]
    assert response["incomplete_details"] == SHUTDOWN
    assert response["error"] is None
    (message,) = response["output"]
    assert (message["type"], message["status"]) == ("message", "incomplete")
    (part,) = message["content"]
    assert part["text"], "nothing streamed"
    if text is not None:
        assert part["text"] == text
    assert _usage(response)[2] > 0
    assert response_problems(response) == []


async def test_sigterm_ends_every_transport_incomplete_with_its_output_and_usage(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    ws_events: list[dict[str, Any]] = []
    sse_events: list[dict[str, Any]] = []
    plain: list[httpx.Response] = []
    close_code: int | None = None
    sse_started = trio.Event()

    with trio.fail_after(DEADLINE):
        async with open_rollout_process(
            data_dir=data, extra_args=["--graceful-timeout", "1"]
        ) as server:
            url = server.url

            async def sse_client() -> None:
                async with (
                    httpx.AsyncClient(timeout=DEADLINE) as client,
                    client.stream(
                        "POST", f"{url}/responses", json={**LONG, "stream": True}
                    ) as resp,
                ):
                    async for event in sse_data(resp):
                        sse_events.append(event)
                        if event["type"] == "response.output_text.delta":
                            sse_started.set()

            async def plain_client() -> None:
                async with httpx.AsyncClient(timeout=DEADLINE) as client:
                    plain.append(await client.post(f"{url}/responses", json=LONG))

            async with open_ws(url) as ws, trio.open_nursery() as nursery:
                nursery.start_soon(plain_client)
                nursery.start_soon(sse_client)
                await ws.send({"type": "response.create", **LONG})
                await sse_started.wait()
                # All three sampling (paced by the WebSocket's own deltas), then SIGTERM.
                while (await fetch_counters(url)).get("samplings", 0) < 3:
                    await ws.recv()
                server.terminate()
                try:
                    while True:
                        await ws.recv()
                except trio_websocket.ConnectionClosed as closed:
                    close_code = closed.reason.code
                ws_events = ws.raw
        # (Leaving the block waited for the process and asserted exit status 0.)
        stopping = "received SIGTERM: waiting up to 1 s (--graceful-timeout) for 3 responses"
        assert any(stopping in line for line in server.lines), server.tail()

    assert close_code == 1001
    # The streams: numbered to the end, the last event `response.incomplete`, valid.
    for transport, events in (("ws", ws_events), ("sse", sse_events)):
        assert [e["sequence_number"] for e in events] == list(range(len(events))), transport
        assert events[-1]["type"] == "response.incomplete", (transport, events[-1]["type"])
        assert event_problems(events[-1], transport=transport) == [], transport  # type: ignore[arg-type]
        _check_interrupted(events[-1]["response"], _text(events))
    assert plain[0].status_code == 200
    _check_interrupted(plain[0].json(), None)

    responses = [ws_events[-1]["response"], sse_events[-1]["response"], plain[0].json()]
    # The ledger holds, for each, the usage the client was told (one interrupted step).
    ledger = await open_sqlite_ledger(data / "usage.sqlite3")
    try:
        for response in responses:
            rows = await ledger.rows(response["id"])
            assert [(r.step, r.complete) for r in rows] == [(0, False)]
            assert _usage(response) == (
                rows[0].input_tokens,
                rows[0].cached_tokens,
                rows[0].output_tokens,
            )
    finally:
        await ledger.aclose()
    # The stored response is the one the client got.
    with trio.fail_after(DEADLINE):
        async with (
            open_test_server(data, warm_up=False) as url,
            httpx.AsyncClient(timeout=DEADLINE) as client,
        ):
            for response in responses:
                fetched = await client.get(f"{url}/responses/{response['id']}")
                assert fetched.status_code == 200
                assert fetched.json() == json.loads(json.dumps(response))
