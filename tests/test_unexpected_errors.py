"""No unexpected exception reaches the transport.

A bug inside a response (here: backends that raise `TypeError` before or in the middle of their
output, and a classifier that raises before the response starts) becomes, with a logged
traceback:
- after `response.created`: `response.failed` with `server_error` (WebSocket and SSE streams
  end with it; a non-streamed HTTP create answers the failed response);
- before: a request error with status 500 and `server_error` (an HTTP JSON body, never an
  empty 500; a WebSocket `error` event).
The WebSocket stays open and its queued requests run; the next request on it succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from rollout import protocol as p
from rollout.engine import ModelSpec, default_classifiers, default_registry
from rollout.engine._interfaces import SampleEvent, SampleRequest, TextDelta, TextStart
from rollout.engine._serve import ServerConfig, open_server

from tests.server_harness import TEST_GRACEFUL_TIMEOUT, open_ws

DEADLINE = 15


class Broken:
    """A backend with a bug: it raises TypeError, after `after` text deltas."""

    def __init__(self, after: int) -> None:
        self.after = after

    async def sample(self, request: SampleRequest) -> AsyncIterator[SampleEvent]:
        del request
        if self.after:
            yield TextStart()
        for _ in range(self.after):
            yield TextDelta("word ", 1)
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")


class BrokenClassifier:
    """Raises on text containing 'boom' (a bug before any event is sent)."""

    name = "broken"

    def __init__(self) -> None:
        self.inner = default_classifiers()

    def initial(self) -> Any:
        return self.inner.initial()

    def feed(self, state: Any, text: str, n_tokens: int) -> Any:
        if "boom" in text:
            raise KeyError("boom")
        return self.inner.feed(state, text, n_tokens)


async def open_broken_server() -> Any:
    registry = default_registry()
    registry.add(ModelSpec(name="broken-early", backend=Broken(0)))
    registry.add(ModelSpec(name="broken-late", backend=Broken(3)))
    return open_server(
        ServerConfig(
            port=0,
            registry=registry,
            classifier=BrokenClassifier(),
            graceful_timeout=TEST_GRACEFUL_TIMEOUT,
        )
    )


@pytest.mark.parametrize("model", ["broken-early", "broken-late"])
async def test_a_bug_inside_a_response_fails_it_and_nothing_else(
    model: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    with trio.fail_after(DEADLINE):
        async with await open_broken_server() as url:
            async with open_ws(url) as ws:
                # Two creates queued at once: the broken one, then a good one behind it.
                await ws.send({"type": "response.create", "model": model, "input": "Hi"})
                await ws.send({"type": "response.create", "model": "sim", "input": "Hi"})
                broken = await ws.until_terminal()
                after = await ws.until_terminal()
            async with httpx.AsyncClient(timeout=DEADLINE) as client:
                plain = await client.post(f"{url}/responses", json={"model": model, "input": "Hi"})
                streamed = await client.post(
                    f"{url}/responses", json={"model": model, "input": "Hi", "stream": True}
                )
    failed = broken[-1]
    assert failed.type == "response.failed"
    assert failed.response.error == p.ResponseError(
        code="server_error",
        message="The server had an error while processing your request. Sorry about that!",
    )
    assert broken[0].type == "response.created"
    assert after[-1].type == "response.completed"
    assert plain.status_code == 200
    assert plain.json()["status"] == "failed"
    assert plain.json()["error"]["code"] == "server_error"
    frames = [line for line in streamed.text.splitlines() if line.startswith("event: ")]
    assert frames[0] == "event: response.created"
    assert frames[-1] == "event: response.failed"
    assert "TypeError" in caplog.text  # the traceback is logged


async def test_a_bug_before_the_response_starts_is_a_500_with_a_body() -> None:
    with trio.fail_after(DEADLINE):
        async with await open_broken_server() as url:
            async with httpx.AsyncClient(timeout=DEADLINE) as client:
                resp = await client.post(f"{url}/responses", json={"model": "sim", "input": "boom"})
            async with open_ws(url) as ws:
                await ws.send({"type": "response.create", "model": "sim", "input": "boom"})
                error = await ws.error()
                events = await ws.create(model="sim", input="fine")
    assert resp.status_code == 500
    assert resp.json()["error"]["code"] == "server_error"
    assert resp.json()["error"]["type"] == "server_error"
    assert (error.status, error.error.code) == (500, "server_error")
    assert events[-1].type == "response.completed"
