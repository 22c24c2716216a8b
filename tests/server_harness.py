"""Shared helpers of the end-to-end server tests: a real server on a loopback port (port 0),
the WebSocket-mode client of `rollout.spec` speaking rollout's wire types, and a Prometheus
text parser.

Every helper is I/O with a deadline set by the calling test (`trio.fail_after`); nothing here
sleeps. `WsClient.assert_quiet` waits a short real time with `trio.move_on_after` to prove the
absence of a frame, the only way to observe "nothing was sent".
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import attrs
import httpx
import trio
import trio_websocket
from rollout import protocol as p
from rollout import spec
from rollout.engine._serve import ServerConfig, open_server

__all__ = [
    "TERMINAL",
    "WEATHER_TOOLS",
    "WsClient",
    "auth_headers",
    "counters",
    "fetch_counters",
    "function_outputs",
    "open_test_server",
    "open_ws",
    "parse_metrics",
    "run_in_thread",
    "sse_data",
    "strip_ids",
    "ws_url",
]

T = TypeVar("T")

# Events after which a WebSocket request sends nothing more (`response.done` suspends a rollout).
TERMINAL = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "error", "response.done"}
)
# A quiet period long enough for a frame already on its way over loopback to arrive.
QUIET_SECONDS = 0.1
# Shutdown at the end of a test must not wait for stragglers.
TEST_GRACEFUL_TIMEOUT = 2.0

WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
]


@asynccontextmanager
async def open_test_server(data_dir: Path | None = None, **overrides: Any) -> AsyncIterator[str]:
    """A rollout server on 127.0.0.1, an ephemeral port; yields `http://127.0.0.1:PORT/v1`.
    `data_dir=None` keeps the store and ledger in memory."""
    overrides.setdefault("graceful_timeout", TEST_GRACEFUL_TIMEOUT)
    config = ServerConfig(port=0, data_dir=data_dir, **overrides)
    async with open_server(config) as url:
        yield url


async def run_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking client (the openai SDK, or an asyncio loop) in a worker thread. The
    thread is abandoned if the test's deadline fires; closing the server then ends it."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


def ws_url(base_url: str) -> str:
    """The WebSocket-mode endpoint for an HTTP base URL, as the SDKs build it."""
    return re.sub(r"^http", "ws", base_url.rstrip("/")) + "/responses"


def auth_headers(key: str | None) -> list[tuple[bytes, bytes]]:
    return [] if key is None else [(b"authorization", f"Bearer {key}".encode())]


def strip_ids(item: Any) -> dict[str, Any]:
    """An output item as wire JSON without its `id` and `call_id` (which are random)."""
    wire = dict(p.to_wire(item)) if attrs.has(type(item)) else dict(item)
    wire.pop("id", None)
    wire.pop("call_id", None)
    return wire


class WsClient(spec.WsClient):
    """The suite's face of the one WebSocket-mode client (`rollout.spec`'s, strict: a server
    event out of order fails the test): typed events in, the transport's exceptions as they
    are, every frame also kept as parsed JSON in `raw`."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        super().__init__(conn=ws, timeout=math.inf, strict=True)
        self.ws = ws
        self.raw = self.log  # every frame received, as parsed JSON

    async def send(self, event: dict[str, Any] | Any) -> None:
        await self.ws.send_message(self.encode(event))

    async def send_raw(self, data: str | bytes) -> None:
        await self.ws.send_message(self.encode(data))

    async def recv(self) -> Any:  # type: ignore[override]
        """The next server event, decoded with `protocol.decode_server_event`."""
        message = await self.ws.get_message()
        self.raw.append(json.loads(message))
        self.follow(self.raw[-1])
        return p.decode_server_event(message)

    async def until_terminal(self) -> list[Any]:
        """Events up to and including the next terminal one (or `response.done`)."""
        events: list[Any] = []
        while True:
            event = await self.recv()
            events.append(event)
            if event.type in TERMINAL:
                return events

    async def create(self, **fields: Any) -> list[Any]:  # type: ignore[override]
        """Send a `response.create` and collect its events up to the terminal one."""
        await self.send({"type": "response.create", **fields})
        return await self.until_terminal()

    async def append(self, response_id: str, items: Sequence[dict[str, Any]]) -> list[Any]:
        await self.send({"type": "response.append", "response_id": response_id, "input": items})
        return await self.until_terminal()

    async def error(self) -> p.ErrorEvent:
        event = await self.recv()
        assert event.type == "error", event
        assert isinstance(event, p.ErrorEvent)
        return event

    async def assert_quiet(self, seconds: float = QUIET_SECONDS) -> None:
        """Nothing arrives within `seconds`."""
        with trio.move_on_after(seconds):
            message = await self.ws.get_message()
            raise AssertionError(f"unexpected frame: {message[:300]!r}")


@asynccontextmanager
async def open_ws(
    base_url: str,
    *,
    key: str | None = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> AsyncIterator[WsClient]:
    async with trio_websocket.open_websocket_url(
        ws_url(base_url),
        extra_headers=auth_headers(key) + list(headers),
        max_message_size=64 * 1024 * 1024,
        connect_timeout=10,
        disconnect_timeout=5,
    ) as ws:
        yield WsClient(ws)


async def sse_data(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON data of each server-sent event of a streaming response (read with the
    protocol's `SseDecoder`)."""
    decoder = p.SseDecoder()
    async for chunk in resp.aiter_bytes():
        for event in decoder.feed(chunk):
            yield json.loads(event.data)


def function_outputs(items: Sequence[Any], output: str = "ok") -> list[dict[str, Any]]:
    """A `function_call_output` for every completed function call among `items`."""
    return [
        {"type": "function_call_output", "call_id": item.call_id, "output": f"{item.name}:{output}"}
        for item in items
        if isinstance(item, p.FunctionCall)
    ]


# --- Prometheus text ------------------------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(
    rf"^(?P<name>{_NAME})(?:\{{(?P<labels>[^}}]*)\}})? (?P<value>[-+]?(?:[0-9.eE+-]+|Inf|NaN))$"
)
_LABEL = re.compile(r'^(?P<k>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<v>(?:[^"\\]|\\.)*)"$')
_COMMENT = re.compile(
    rf"^# (?:HELP {_NAME} .*|TYPE {_NAME} (?:counter|gauge|histogram|summary|untyped))$"
)


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Parse Prometheus text exposition (0.0.4) strictly, line by line: every line is a
    HELP/TYPE comment or a sample with well-formed labels and a number."""
    assert text.endswith("\n"), "exposition must end with a newline"
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("#"):
            assert _COMMENT.match(line), f"bad comment line: {line!r}"
            if line.startswith("# TYPE "):
                typed.add(line.split()[2])
            continue
        match = _SAMPLE.match(line)
        assert match, f"bad sample line: {line!r}"
        labels: set[tuple[str, str]] = set()
        if match["labels"]:
            for part in match["labels"].split(","):
                lm = _LABEL.match(part)
                assert lm, f"bad label {part!r} in {line!r}"
                labels.add((lm["k"], lm["v"]))
        name = match["name"]
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in typed or family in typed, f"sample without TYPE: {line!r}"
        key = (name, frozenset(labels))
        assert key not in samples, f"duplicate sample: {line!r}"
        samples[key] = float(match["value"])
    return samples


def counters(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> dict[str, int]:
    """The engine's work counters from parsed metrics (`rollout_work_total{counter=...}`)."""
    return {
        dict(labels)["counter"]: int(value)
        for (name, labels), value in samples.items()
        if name == "rollout_work_total"
    }


async def fetch_counters(base_url: str, key: str | None = None) -> dict[str, int]:
    """The work counters, read from the server's `/metrics` (with `key` when it has keys)."""
    root = base_url.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(headers=headers) as client:
        resp = await client.get(f"{root}/metrics")
    resp.raise_for_status()
    return counters(parse_metrics(resp.text))
