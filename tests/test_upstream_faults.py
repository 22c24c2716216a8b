"""Upstream faults: rollout (B) in front of a fake chat-completions server whose behaviour each
test scripts. Every fault ends the response with a clear error to the client
(`response.failed` with the upstream's code and message, or ours), never a hang, and B stays
healthy afterwards: /healthz answers and a new request through it completes.

Retries happen only before the first token (connect errors, 5xx); the test registries use a
1 ms backoff so retried faults end at once. Nothing sleeps: a "slow" upstream waits for the
client to go away, which the test causes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from rollout.engine._ledger import open_sqlite_ledger

from tests.server_harness import open_ws, sse_data
from tests.upstream_harness import (
    Exchange,
    backend_of,
    call_chunks,
    chunk,
    closed_port_url,
    gateway_registry,
    healthz,
    open_fake_upstream,
    open_raw_upstream,
    open_rollout,
    raw_sse_answer,
    read_request,
    text_chunks,
)

DEADLINE = 15
GOOD = ["Hello", " from", " upstream."]


async def create(url: str, **fields: Any) -> dict[str, Any]:
    """POST /v1/responses (not streamed); the final Response as JSON."""
    fields.setdefault("model", "up")
    fields.setdefault("input", "Hi!")
    async with httpx.AsyncClient(timeout=None) as client:
        resp = await client.post(f"{url}/responses", json=fields)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


async def create_sse(url: str, **fields: Any) -> list[dict[str, Any]]:
    """POST /v1/responses with stream=true; every server-sent event's data."""
    fields.setdefault("model", "up")
    fields.setdefault("input", "Hi!")
    events: list[dict[str, Any]] = []
    async with (
        httpx.AsyncClient(timeout=None) as client,
        client.stream("POST", f"{url}/responses", json={**fields, "stream": True}) as resp,
    ):
        assert resp.status_code == 200
        async for data in sse_data(resp):
            events.append(data)
    return events


async def assert_healthy(url: str) -> None:
    """/healthz answers, and a request through the gateway completes."""
    assert await healthz(url) == 200
    response = await create(url)
    assert response["status"] == "completed", response
    assert response["output"][0]["content"][0]["text"] == "".join(GOOD)


async def good(exchange: Exchange) -> None:
    await exchange.stream(text_chunks(GOOD))


def failed_error(response: dict[str, Any]) -> dict[str, Any]:
    assert response["status"] == "failed", response
    error: dict[str, Any] = response["error"]
    return error


# --- before the first token: retried -----------------------------------------------------------


async def test_connection_refused_is_retried_then_fails_quickly() -> None:
    registry = gateway_registry(closed_port_url(), retries=2)
    with trio.fail_after(DEADLINE):
        async with open_rollout(registry=registry) as b:
            start = trio.current_time()
            response = await create(b)
            elapsed = trio.current_time() - start
            error = failed_error(response)
            assert error["code"] == "server_error"
            assert error["message"].startswith("Could not connect to the upstream model server")
            assert "ConnectError" in error["message"]
            counters = backend_of(registry).counters
            assert (counters.requests, counters.retries, counters.failures) == (3, 2, 1)
            assert elapsed < 2.0  # three refused connects and two 1-2 ms backoffs
            # The server itself is fine: its own models still answer.
            assert await healthz(b) == 200
            sim = await create(b, model="sim")
            assert sim["status"] == "completed"


async def test_5xx_before_first_token_is_retried_then_fails() -> None:
    async def overloaded(exchange: Exchange) -> None:
        if exchange.upstream.hits <= 3:
            await exchange.json(
                503, {"error": {"message": "The engine is overloaded.", "code": "overloaded"}}
            )
        else:
            await good(exchange)

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(overloaded) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url, retries=2)
            async with open_rollout(registry=registry) as b:
                error = failed_error(await create(b))
                assert upstream.hits == 3  # the first try and two retries
                assert error["message"] == (
                    "The upstream model server answered 503 (overloaded): The engine is overloaded."
                )
                assert error["code"] == "server_error"  # the Responses API's code for it
                counters = backend_of(registry).counters
                assert (counters.requests, counters.retries, counters.failures) == (3, 2, 1)
                await assert_healthy(b)
                assert upstream.hits == 4


async def test_5xx_once_then_success_completes() -> None:
    async def flaky(exchange: Exchange) -> None:
        if exchange.upstream.hits == 1:
            await exchange.json(500, {"error": {"message": "boom", "code": None}})
        else:
            await good(exchange)

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(flaky) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url, retries=2)
            async with open_rollout(registry=registry) as b:
                events = await create_sse(b)
                assert [e["type"] for e in events][-1] == "response.completed"
                response = events[-1]["response"]
                assert response["output"][0]["content"][0]["text"] == "".join(GOOD)
                # The upstream's usage is reported (prompt_tokens of the fake, 1 per delta).
                assert response["usage"]["input_tokens"] == 11
                assert response["usage"]["output_tokens"] == len(GOOD)
                assert upstream.hits == 2
                # The retry re-sent the very same body.
                assert upstream.bodies[0] == upstream.bodies[1]
                assert backend_of(registry).counters.retries == 1


@pytest.mark.parametrize("drops", [1, 3])
async def test_connection_dropped_before_any_answer_is_retried(drops: int) -> None:
    """The upstream accepts, reads the request and closes without a byte of answer (what a
    keep-alive connection closed by the server as it is reused looks like): retried like a
    connect error; after the retries, a clear failure."""

    async def handler(stream: trio.SocketStream, hit: int) -> None:
        await read_request(stream)
        if hit > drops:
            await stream.send_all(raw_sse_answer(text_chunks(GOOD)))

    with trio.fail_after(DEADLINE):
        async with open_raw_upstream(handler) as upstream_url:
            registry = gateway_registry(upstream_url, retries=2)
            async with open_rollout(registry=registry) as b:
                response = await create(b)
                counters = backend_of(registry).counters
                if drops == 1:
                    assert response["status"] == "completed", response
                    assert response["output"][0]["content"][0]["text"] == "".join(GOOD)
                    assert (counters.requests, counters.retries) == (2, 1)
                else:
                    error = failed_error(response)
                    assert error["code"] == "server_error"
                    assert error["message"] == (
                        "The upstream closed the connection without answering: "
                        "RemoteProtocolError: Server disconnected without sending a response."
                    )
                    assert (counters.requests, counters.retries) == (3, 2)
                assert await healthz(b) == 200


# --- errors that are not retried -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "code", "message"),  # message: what follows "answered {status}"
    [
        (
            400,
            {
                "error": {
                    "message": "This model's maximum context length is 8 tokens.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            },
            "invalid_prompt",
            " (context_length_exceeded): This model's maximum context length is 8 tokens.",
        ),
        (
            429,
            {"error": {"message": "Slow down.", "type": "requests", "code": "rate_limit_exceeded"}},
            "rate_limit_exceeded",
            " (rate_limit_exceeded): Slow down.",
        ),
        # vLLM's shape: the error at the top level, an integer code.
        (
            400,
            {"object": "error", "message": "bad tools", "type": "BadRequestError", "code": 400},
            "invalid_prompt",
            ": bad tools",
        ),
        # Ollama's shape: the error is a string.
        (404, {"error": "model 'x' not found"}, "invalid_prompt", ": model 'x' not found"),
    ],
)
async def test_upstream_4xx_fails_with_its_code_and_message(
    status: int, body: dict[str, Any], code: str, message: str
) -> None:
    async def refuse(exchange: Exchange) -> None:
        if exchange.upstream.hits == 1:
            await exchange.json(status, body)
        else:
            await good(exchange)

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(refuse) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url, retries=2)
            async with open_rollout(registry=registry) as b:
                events = await create_sse(b)
                assert events[-1]["type"] == "response.failed"
                error = failed_error(events[-1]["response"])
                assert error == {
                    "code": code,
                    "message": f"The upstream model server answered {status}{message}",
                }
                assert upstream.hits == 1  # 4xx is not retried
                await assert_healthy(b)


# --- after the first token: not retried --------------------------------------------------------


@pytest.mark.parametrize("how", ["clean_end", "connection_reset"])
async def test_stream_cut_mid_answer_fails_and_records_usage(tmp_path: Path, how: str) -> None:
    async def cut(exchange: Exchange) -> None:
        if exchange.upstream.hits > 1:
            await good(exchange)
            return
        await exchange.start()
        for piece in ["The", " answer", " is"]:
            await exchange.event(chunk(content=piece))
        if how == "clean_end":
            await exchange.end()  # the body ends: no finish_reason, no [DONE]
        else:
            raise RuntimeError("the upstream died")  # hypercorn drops the connection

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(cut) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url, retries=2)
            async with open_rollout(registry=registry, data_dir=tmp_path) as b:
                events = await create_sse(b)
                types = [e["type"] for e in events]
                assert types.count("response.output_text.delta") == 3
                assert types[-1] == "response.failed"
                response = events[-1]["response"]
                error = failed_error(response)
                assert error["code"] == "server_error"
                if how == "clean_end":
                    assert error["message"] == (
                        "The upstream stream ended before the answer finished (connection closed)."
                    )
                else:
                    assert error["message"].startswith("The upstream stream broke:")
                assert upstream.hits == 1  # never retried after the first token
                # The failed response reports the usage of what arrived.
                assert response["usage"]["output_tokens"] == 3
                assert response["usage"]["input_tokens"] > 0
                failed_id = response["id"]
                await assert_healthy(b)
        # B is shut down: its ledger is flushed. The cut step is one incomplete row.
        async with await open_sqlite_ledger(tmp_path / "usage.sqlite3") as ledger:
            rows = await ledger.rows(failed_id)
    assert len(rows) == 1
    (row,) = rows
    assert row.complete is False
    assert row.output_tokens == 3
    assert row.input_tokens == response["usage"]["input_tokens"]
    assert row.model == "up"


async def test_upstream_error_chunk_mid_stream_fails_with_its_message() -> None:
    async def error_chunk(exchange: Exchange) -> None:
        await exchange.start()
        await exchange.event(chunk(content="Par"))
        await exchange.event({"error": {"message": "GPU fell over", "code": "server_error"}})
        await exchange.end()

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(error_chunk) as (upstream_url, _upstream):
            async with open_rollout(registry=gateway_registry(upstream_url)) as b:
                error = failed_error(await create(b))
                assert error == {
                    "code": "server_error",
                    "message": "The upstream failed mid-stream: GPU fell over",
                }
                assert await healthz(b) == 200


@pytest.mark.parametrize("first", [True, False])
async def test_malformed_chunk_fails_clearly(first: bool) -> None:
    async def garbage(exchange: Exchange) -> None:
        if exchange.upstream.hits > 1:
            await good(exchange)
            return
        await exchange.start()
        if not first:
            await exchange.event(chunk(content="Fine so far"))
        await exchange.raw(b"data: {this is not json\n\n")
        await exchange.raw(b"data: [DONE]\n\n")
        await exchange.end()

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(garbage) as (upstream_url, upstream):
            async with open_rollout(registry=gateway_registry(upstream_url, retries=2)) as b:
                error = failed_error(await create(b))
                assert error["code"] == "server_error"
                assert error["message"].startswith("The upstream sent a malformed chunk:")
                assert upstream.hits == 1  # a malformed answer is not retried
                await assert_healthy(b)


async def test_silent_upstream_hits_the_read_timeout() -> None:
    async def silent(exchange: Exchange) -> None:
        if exchange.upstream.hits > 1:
            await good(exchange)
            return
        await exchange.start()
        await exchange.hang_until_disconnect()

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(silent) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url, read_timeout=0.2)
            async with open_rollout(registry=registry) as b:
                error = failed_error(await create(b))
                assert error["code"] == "server_error"
                assert error["message"] == "The upstream model server timed out (ReadTimeout)."
                await upstream.disconnected.wait()  # and the upstream request was closed
                await assert_healthy(b)


# --- our client goes away ------------------------------------------------------------------------


async def slow(exchange: Exchange) -> None:
    """The first request: headers, one token, then silence until the client goes away."""
    if exchange.upstream.hits > 1:
        await good(exchange)
        return
    await exchange.start()
    await exchange.event(chunk(content="Thinking"))
    await exchange.hang_until_disconnect()


async def test_websocket_client_disconnect_cancels_the_upstream_request(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(slow) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url)
            async with open_rollout(registry=registry, data_dir=tmp_path) as b:
                async with open_ws(b) as ws:
                    await ws.send({"type": "response.create", "model": "up", "input": "Hi!"})
                    response_id = None
                    while True:
                        event = await ws.next_event()
                        if event["type"] == "response.created":
                            response_id = event["response"]["id"]
                        if event["type"] == "response.output_text.delta":
                            break
                    # Leaving the block closes the WebSocket mid-answer.
                await upstream.disconnected.wait()
                assert upstream.disconnects == 1
                await assert_healthy(b)
                # The WebSocket path too: a new connection gets a complete answer.
                async with open_ws(b) as ws:
                    await ws.send({"type": "response.create", "model": "up", "input": "Hi!"})
                    while True:
                        event = await ws.next_event()
                        if event["type"] in ("response.completed", "response.failed", "error"):
                            break
                    assert event["type"] == "response.completed"
        async with await open_sqlite_ledger(tmp_path / "usage.sqlite3") as ledger:
            rows = await ledger.rows(response_id)
    # The cancelled response's work still counts: the one token that arrived.
    assert [(r.complete, r.output_tokens) for r in rows] == [(False, 1)]


async def test_http_client_disconnect_cancels_the_upstream_request() -> None:
    async def headers_then_silence(exchange: Exchange) -> None:
        if exchange.body["messages"][-1]["content"] != "Hang!":
            await good(exchange)
            return
        await exchange.start()
        await exchange.hang_until_disconnect()

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(headers_then_silence) as (upstream_url, upstream):
            async with open_rollout(registry=gateway_registry(upstream_url)) as b:
                for stream in (True, False):
                    upstream.disconnected = trio.Event()
                    hit = upstream.hit
                    async with trio.open_nursery() as nursery:

                        async def request(stream: bool = stream) -> None:
                            async with httpx.AsyncClient(timeout=None) as client:
                                await client.post(
                                    f"{b}/responses",
                                    json={"model": "up", "input": "Hang!", "stream": stream},
                                )

                        nursery.start_soon(request)
                        await hit.wait()  # the upstream request is in flight
                        nursery.cancel_scope.cancel()  # our client goes away
                    await upstream.disconnected.wait()
                    await assert_healthy(b)
                assert upstream.disconnects == 2


# --- tool calls through the fault-free fake: the stream maps back ---------------------------------


async def test_upstream_tool_call_chunks_map_to_function_calls() -> None:
    async def calls(exchange: Exchange) -> None:
        await exchange.stream(
            call_chunks([("get_weather", '{"city":"Paris"}'), ("get_time", '{"city":"Oslo"}')])
        )

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(calls) as (upstream_url, upstream):
            async with open_rollout(registry=gateway_registry(upstream_url)) as b:
                response = await create(
                    b,
                    tools=[
                        {"type": "function", "name": "get_weather", "parameters": {}},
                        {"type": "function", "name": "get_time", "parameters": {}},
                    ],
                )
    assert response["status"] == "completed"
    assert [(o["type"], o["name"], o["arguments"]) for o in response["output"]] == [
        ("function_call", "get_weather", '{"city":"Paris"}'),
        ("function_call", "get_time", '{"city":"Oslo"}'),
    ]
    sent = upstream.bodies[0]
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather", "get_time"]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
