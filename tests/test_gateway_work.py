"""rollout in front of a chat-completions model: the work of a turn is what is new in it, for
every kind of client, and the model server receives the same bytes whatever rollout kept.

- The upstream's messages are encoded once each: a turn's `message_bytes_encoded` is the bytes
  of the messages its body has that the previous turn's did not, for a WebSocket chain, an HTTP
  chain, a reconnect each turn, a stateless HTTP client and a stateless WebSocket client.
- A stateless client's input is decoded in the time of what is new (`_input_memo.py`): the
  items of the earlier turn come from the memo, keyed (the render cache keys nothing).
- The bodies the upstream receives are byte for byte those of a server with the render cache
  and the input memo off, over generated conversations (hypothesis).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.engine import _render_cache
from rollout.engine._chat import ChatEncoder

from tests.server_harness import open_ws
from tests.upstream_harness import (
    TOOLS,
    Exchange,
    backend_of,
    call_chunks,
    gateway_registry,
    open_fake_upstream,
    open_rollout,
    text_chunks,
)

DEADLINE = 60
KINDS = ("ws-chain", "ws-reconnect", "http-chain", "http-stateless", "ws-stateless")
# A first message large enough that stateless bodies take the input memo's path (32 KiB).
LONG_TASK = "Plan the trip. " + "Paris Oslo Rome Lisbon " * 2000
TURNS = 4


async def answer_with_a_call(exchange: Exchange) -> None:
    """Every turn: one call of `get_weather`."""
    await exchange.stream(call_chunks([("get_weather", '{"city":"Paris"}')]))


def output_for(call_id: str, turn: int) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": f"sunny, {turn}0 C"}


class Client:
    """One conversation, sent the way `kind` sends it."""

    def __init__(
        self,
        kind: str,
        url: str,
        key: str | None,
        stack: AsyncExitStack,
        task: str = LONG_TASK,
    ) -> None:
        self.kind = kind
        self.url = url
        self.key = key
        self.stack = stack
        self.history: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": task}]
        self.new: list[dict[str, Any]] = list(self.history)
        self.previous: str | None = None
        self.ws: Any = None
        self.http: httpx.AsyncClient | None = None

    async def _socket(self) -> Any:
        if self.ws is None or self.kind == "ws-reconnect":
            self.ws = await self.stack.enter_async_context(open_ws(self.url, key=self.key))
        return self.ws

    async def turn(self) -> dict[str, Any]:
        chained = self.kind in ("ws-chain", "ws-reconnect", "http-chain")
        body: dict[str, Any] = {
            "model": "up",
            "tools": TOOLS,
            "input": self.new if chained else self.history,
            "store": self.kind in ("ws-reconnect", "http-chain"),
        }
        if chained and self.previous is not None:
            body["previous_response_id"] = self.previous
        if self.kind.startswith("ws"):
            ws = await self._socket()
            await ws.send({"type": "response.create", **body})
            while True:
                event = await ws.next_event()
                if event["type"] in ("response.completed", "response.failed", "error"):
                    break
            assert event["type"] == "response.completed", event
            response: dict[str, Any] = event["response"]
        else:
            if self.http is None:
                headers = {"authorization": f"Bearer {self.key}"} if self.key else {}
                self.http = await self.stack.enter_async_context(
                    httpx.AsyncClient(timeout=DEADLINE, headers=headers)
                )
            answer = await self.http.post(f"{self.url}/responses", json=body)
            assert answer.status_code == 200, answer.text
            response = answer.json()
        calls = [o for o in response["output"] if o["type"] == "function_call"]
        new = [output_for(c["call_id"], len(self.history)) for c in calls]
        self.previous = response["id"]
        self.history += [*response["output"], *new]
        self.new = new
        return response


def messages_of(raw: bytes) -> list[bytes]:
    """The body's messages, each as rollout encodes one (compact JSON, UTF-8)."""
    body = json.loads(raw)
    return [
        json.dumps(m, ensure_ascii=False, separators=(",", ":")).encode() for m in body["messages"]
    ]


@pytest.mark.parametrize("kind", KINDS)
async def test_each_turn_encodes_only_its_new_messages(kind: str) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(answer_with_a_call) as (upstream_url, upstream):
            registry = gateway_registry(upstream_url)
            backend = backend_of(registry)
            async with open_rollout(registry=registry) as url, AsyncExitStack() as stack:
                client = Client(kind, url, None, stack)
                encoded = []
                for _ in range(TURNS):
                    before = backend.counters.message_bytes_encoded
                    await client.turn()
                    encoded.append(backend.counters.message_bytes_encoded - before)
    bodies = [messages_of(raw) for raw in upstream.raws]
    assert len(bodies) == TURNS
    previous: list[bytes] = []
    for turn, (messages, spent) in enumerate(zip(bodies, encoded, strict=True)):
        assert messages[: len(previous)] == previous, f"turn {turn}: the history changed"
        new = messages[len(previous) :]
        assert spent == sum(len(m) for m in new), f"turn {turn}: {spent} bytes encoded"
        previous = messages
    assert len(bodies[-1]) == 1 + 2 * (TURNS - 1)  # the task, then a call and its output


@pytest.mark.parametrize("kind", ["http-stateless", "ws-stateless"])
async def test_a_stateless_input_is_decoded_from_what_is_new(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the second turn on, the memo supplies the earlier items (keyed): the render
    cache's lookup hashes no item, and the memo parses only the new part of the input."""
    keyed: list[int] = []
    real = _render_cache.item_key

    def counting(item: Any) -> Any:
        keyed.append(1)
        return real(item)

    monkeypatch.setattr(_render_cache, "item_key", counting)
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(answer_with_a_call) as (upstream_url, _):
            registry = gateway_registry(upstream_url)
            async with open_rollout(registry=registry) as url, AsyncExitStack() as stack:
                client = Client(kind, url, None, stack)
                for _ in range(TURNS):
                    await client.turn()
                metrics = await scrape(url)
    assert keyed == []
    assert metrics['rollout_input_memo_requests_total{outcome="hit"}'] == TURNS - 1
    assert metrics['rollout_input_memo_requests_total{outcome="miss"}'] == 1
    # turn n reuses the n * 2 - 1 items of turn n - 1's input (the task, calls, outputs)
    assert metrics["rollout_input_memo_items_reused_total"] == sum(
        1 + 2 * n for n in range(TURNS - 1)
    )
    parsed = metrics["rollout_input_memo_bytes_parsed_total"]
    assert parsed < len(LONG_TASK) + 4096 * TURNS  # the task once, then only the new items


async def scrape(url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(url.removesuffix("/v1") + "/metrics")).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# --- the same bytes with and without the caches ----------------------------------------------

# rollout names the calls it relays (`call_` and 24 hex digits), whatever the model called
# them: each server its own. Bodies are compared with the names numbered in order of use.
_CALL_ID = re.compile(rb'"call_[0-9a-f]{24}"')


def numbered(raw: bytes) -> bytes:
    names: dict[bytes, bytes] = {}
    return _CALL_ID.sub(lambda m: names.setdefault(m.group(), b'"call#%d"' % len(names)), raw)


@asynccontextmanager
async def gateway(cached: bool, script: list[int]) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A gateway whose upstream answers turn i with `script[i]` parallel calls (text past the
    script), with the render cache (and with it the input memo) on or off; yields its URL and
    the bodies its upstream receives."""
    turn = 0

    async def scripted(exchange: Exchange) -> None:
        nonlocal turn
        calls = script[turn] if turn < len(script) else 0
        turn += 1
        if calls:
            await exchange.stream(
                call_chunks([("get_weather", f'{{"city":"C{turn}{i}"}}') for i in range(calls)])
            )
        else:
            await exchange.stream(text_chunks(["Done."]))

    async with open_fake_upstream(scripted) as (upstream_url, upstream):
        registry = gateway_registry(upstream_url)
        options = {} if cached else {"render_cache_bytes": 0}
        async with open_rollout(registry=registry, **options) as url:
            yield url, upstream.raws


async def upstream_bodies(
    kind: str, cached: bool, script: list[int], outputs: list[str], task: str
) -> list[bytes]:
    async with gateway(cached, script) as (url, raws), AsyncExitStack() as stack:
        client = Client(kind, url, None, stack, task)
        for text in outputs:
            await client.turn()
            if not client.new:
                break
            for item in client.new:
                item["output"] = text
        return [numbered(raw) for raw in raws]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    script=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    outputs=st.lists(st.text(max_size=200), min_size=1, max_size=5),
    task=st.sampled_from(["Go.", LONG_TASK]),
)
async def test_the_upstream_gets_the_same_bytes_with_and_without_the_caches(
    kind: str, script: list[int], outputs: list[str], task: str
) -> None:
    """A short task makes each turn's messages a segment as large as the ones before (the
    encoder's segments merge); a long one takes stateless clients through the input memo."""
    with trio.fail_after(DEADLINE):
        with_caches = await upstream_bodies(kind, True, script, outputs, task)
        without = await upstream_bodies(kind, False, script, outputs, task)
    assert with_caches == without
    assert with_caches


# --- the encoder's segments ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 300)), min_size=1, max_size=30))
def test_the_encoders_segments_join_to_its_messages(sizes: list[tuple[int, int]]) -> None:
    """Turn by turn (`calls` calls then their outputs of `n` characters, or a user message),
    the segments a body is sent as are the messages joined by commas, whatever merged."""
    encoder = ChatEncoder()
    items: list[Any] = []
    for turn, (calls, n) in enumerate(sizes):
        if calls == 0:
            items.append(p.Message(role="user", content="u" * n))
        for i in range(calls):
            items.append(
                p.FunctionCall(call_id=f"c{turn}.{i}", name="f", arguments="{}", id=f"fc{turn}{i}")
            )
        for i in range(calls):
            items.append(p.FunctionCallOutput(call_id=f"c{turn}.{i}", output="o" * n))
        encoder.extend(items, len(items))
        assert b"".join(encoder.body_chunks()) == b",".join(encoder.body_messages())
        assert len(encoder.body_chunks()) <= 2 + len(items).bit_length()
