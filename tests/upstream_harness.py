"""Shared helpers of the upstream tests: rollout servers on loopback (A serving the simulated
model, B a gateway in front of it), a scriptable fake chat-completions upstream served by
hypercorn, and small builders of chat-completion chunks.

Nothing here sleeps or sets deadlines: every test wraps its I/O in `trio.fail_after`.
"""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import attrs
import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from rollout import protocol as p
from rollout.engine._defaults import default_registry
from rollout.engine._models import ModelRegistry, ModelSpec
from rollout.engine._serve import ServerConfig, open_server
from rollout.engine._upstream import UpstreamBackend, UpstreamConfig

from tests.server_harness import WEATHER_TOOLS

__all__ = [
    "SIM_MODEL",
    "TOOLS",
    "Exchange",
    "FakeUpstream",
    "backend_of",
    "call_chunks",
    "chunk",
    "closed_port_url",
    "gateway_registry",
    "healthz",
    "open_fake_upstream",
    "open_raw_upstream",
    "open_rollout",
    "run_in_thread",
    "strip_ids",
    "text_chunks",
]

T = TypeVar("T")

# The simulated model every gateway test routes to: two tool turns' worth of parallel calls.
SIM_MODEL = "sim:steps=2,parallel=2"
# Shutdown at the end of a test must not wait for stragglers.
TEST_GRACEFUL_TIMEOUT = 2.0
# A retry backoff small enough that retried faults end at once (the default is 0.2 s, doubled).
TEST_RETRY_BACKOFF = 0.001

# The two function tools every server test uses (shared with tests.server_harness).
TOOLS = WEATHER_TOOLS


@asynccontextmanager
async def open_rollout(
    *, registry: ModelRegistry | None = None, data_dir: Path | None = None, **overrides: Any
) -> AsyncIterator[str]:
    """A rollout server on 127.0.0.1, an ephemeral port; yields `http://127.0.0.1:PORT/v1`."""
    overrides.setdefault("graceful_timeout", TEST_GRACEFUL_TIMEOUT)
    config = ServerConfig(port=0, data_dir=data_dir, registry=registry, **overrides)
    async with open_server(config) as url:
        yield url


def gateway_registry(
    upstream_url: str, *, name: str = "up", model: str = SIM_MODEL, **config: Any
) -> ModelRegistry:
    """The default registry plus `name` routed to `upstream_url` (a tiny retry backoff unless
    given). Built directly, not from TOML, because the file does not expose `retry_backoff`."""
    config.setdefault("retry_backoff", TEST_RETRY_BACKOFF)
    registry = default_registry()
    registry.add(
        ModelSpec(
            name=name,
            backend=UpstreamBackend(UpstreamConfig(base_url=upstream_url, model=model, **config)),
        )
    )
    return registry


def backend_of(registry: ModelRegistry, name: str = "up") -> UpstreamBackend:
    backend = registry.resolve(name).backend
    assert isinstance(backend, UpstreamBackend)
    return backend


async def run_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking client (the openai SDK, or an asyncio loop) in a worker thread. The
    thread is abandoned if the test's deadline fires; closing the servers then ends it."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


async def healthz(base_url: str) -> int:
    async with httpx.AsyncClient() as client:
        resp = await client.get(base_url.removesuffix("/v1") + "/healthz")
    return resp.status_code


def strip_ids(item: Any) -> dict[str, Any]:
    """An output item (SDK model, attrs item or dict) as JSON without `id` and `call_id`."""
    wire: dict[str, Any]
    if hasattr(item, "model_dump"):
        wire = item.model_dump(mode="json", exclude_none=True)
    elif attrs.has(type(item)):
        wire = dict(p.to_wire(item))
    else:
        wire = dict(item)
    wire.pop("id", None)
    wire.pop("call_id", None)
    return wire


def closed_port_url() -> str:
    """A loopback base URL nobody listens on (the port was bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


# --- the fake upstream ------------------------------------------------------------------------

Handler = Callable[["Exchange"], Awaitable[None]]


def chunk(
    *,
    content: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    finish: str | None = None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`."""
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    body: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake",
        "choices": []
        if usage is not None
        else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def text_chunks(pieces: Sequence[str], *, prompt_tokens: int = 11) -> list[dict[str, Any]]:
    """A whole text answer: one chunk per piece, the finish, the usage."""
    out = [chunk(content=piece) for piece in pieces]
    out.append(chunk(finish="stop"))
    out.append(
        chunk(
            usage={
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(pieces),
                "total_tokens": prompt_tokens + len(pieces),
            }
        )
    )
    return out


def call_chunks(
    calls: Sequence[tuple[str, str]], *, prompt_tokens: int = 11
) -> list[dict[str, Any]]:
    """Parallel tool calls `(name, arguments)`, each arguments string sent in two halves."""
    out: list[dict[str, Any]] = []
    for index, (name, arguments) in enumerate(calls):
        half = len(arguments) // 2
        out.append(
            chunk(
                tool_calls=[
                    {
                        "index": index,
                        "id": f"call_fake{index}",
                        "type": "function",
                        "function": {"name": name, "arguments": arguments[:half]},
                    }
                ]
            )
        )
        out.append(
            chunk(tool_calls=[{"index": index, "function": {"arguments": arguments[half:]}}])
        )
    out.append(chunk(finish="tool_calls"))
    out.append(
        chunk(
            usage={
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 2 * len(calls),
                "total_tokens": prompt_tokens + 2 * len(calls),
            }
        )
    )
    return out


@attrs.define(eq=False)
class Exchange:
    """One request to the fake upstream, as its handler sees it."""

    body: Any  # the parsed JSON body (or the raw bytes when it is not JSON)
    receive: Callable[[], Awaitable[dict[str, Any]]]
    send: Callable[[dict[str, Any]], Awaitable[None]]
    upstream: FakeUpstream

    async def start(self, status: int = 200, content_type: bytes = b"text/event-stream") -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", content_type)],
            }
        )

    async def raw(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def event(self, body: dict[str, Any]) -> None:
        await self.raw(b"data: " + json.dumps(body).encode() + b"\n\n")

    async def end(self) -> None:
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def stream(self, chunks: Sequence[dict[str, Any]], *, done: bool = True) -> None:
        """A complete streamed answer (headers, chunks, `[DONE]`, end of body)."""
        await self.start()
        for body in chunks:
            await self.event(body)
        if done:
            await self.raw(b"data: [DONE]\n\n")
        await self.end()

    async def json(self, status: int, body: Any) -> None:
        payload = json.dumps(body).encode()
        await self.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": payload, "more_body": False})

    async def hang_until_disconnect(self) -> None:
        """Say nothing more; return when the client goes away (recorded on the upstream)."""
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.upstream.disconnects += 1
                self.upstream.disconnected.set()
                return


@attrs.define(eq=False)
class FakeUpstream:
    """An OpenAI-compatible chat-completions server whose answers a test scripts: `handler`
    gets each request's `Exchange`. Records the hits and the request bodies."""

    handler: Handler
    hits: int = 0
    bodies: list[Any] = attrs.field(factory=list)
    raws: list[bytes] = attrs.field(factory=list)  # the bodies as they arrived
    paths: list[str] = attrs.field(factory=list)
    disconnects: int = 0
    disconnected: trio.Event = attrs.field(factory=trio.Event)
    hit: trio.Event = attrs.field(factory=trio.Event)  # set at each request (then replaced)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw += message.get("body", b"")
            if not message.get("more_body", False):
                break
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = raw
        self.hits += 1
        self.bodies.append(body)
        self.raws.append(raw)
        self.paths.append(scope["path"])
        hit, self.hit = self.hit, trio.Event()
        hit.set()
        await self.handler(Exchange(body=body, receive=receive, send=send, upstream=self))


@asynccontextmanager
async def open_fake_upstream(handler: Handler) -> AsyncIterator[tuple[str, FakeUpstream]]:
    """Serve a `FakeUpstream` on 127.0.0.1, an ephemeral port; yields (`http://.../v1`, it).
    Leaving the block cancels the server outright (a fake needs no graceful shutdown)."""
    upstream = FakeUpstream(handler=handler)
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("tests.fake_upstream")
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            lambda task_status: hypercorn_serve(
                upstream,  # type: ignore[arg-type]
                config,
                shutdown_trigger=trio.sleep_forever,
                task_status=task_status,
            )
        )
        try:
            yield binds[0] + "/v1", upstream
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_raw_upstream(
    handler: Callable[[trio.SocketStream, int], Awaitable[None]],
) -> AsyncIterator[str]:
    """A bare TCP server for faults below HTTP (a connection closed without any answer):
    `handler(stream, hit)` gets each connection and its number (1, 2, ...). Yields the base
    URL; leaving the block cancels it."""
    hits = 0

    async def serve_one(stream: trio.SocketStream) -> None:
        nonlocal hits
        hits += 1
        async with stream:
            await handler(stream, hits)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve_one, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            nursery.cancel_scope.cancel()


async def read_request(stream: trio.SocketStream) -> bytes:
    """Read one HTTP request's head and body (Content-Length framed, as httpx sends it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    match = re.search(rb"(?i)content-length: *(\d+)", head)
    length = int(match[1]) if match else 0
    while len(body) < length:
        body += await stream.receive_some(65536)
    return body


def raw_sse_answer(chunks: Sequence[dict[str, Any]]) -> bytes:
    """A whole HTTP/1.1 answer, its event stream ended by closing the connection."""
    events = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        + events
        + b"data: [DONE]\n\n"
    )
