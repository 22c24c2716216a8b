"""`rollout bench --scenario gateway`: what rollout adds in front of a chat-completions model,
as the model server sees it.

Long because the measurement needs its own fake model server in another process and clients that
build their bytes before the clock starts (h11 and wsproto by hand-held connection), so no
library's time is counted.

The upstream is a fake chat-completions server in a process of its own (`FakeUpstream`: h11
over trio, `upstream_main`): it answers every request at once with one streamed tool call, and
stamps the moment each request's body has fully arrived on the clock the client stamps its
sends with (`time.monotonic()`: CLOCK_MONOTONIC, one clock for every process of the machine);
once a head is parsed, its body is read as it comes and parsed after the stamp, so the stamp
is the model server having the bytes, not this process having also parsed them.
A turn's **overhead** is that arrival minus the client's send: receiving and decoding the
request, resolving and keying the conversation, validating, rendering and classifying what is
new, encoding the chat request and writing it to
the model server. Nothing of the model's time is in it.

Each conversation starts with a history of about `size` tokens (a task, then tool calls and
their ~400-token outputs), then runs `warm + turns` turns, each adding one tool output of
`output_tokens`; the first `warm` turns (the history's first render, a cold cache) are not
counted. Four clients (`MODES`): a WebSocket chain (`previous_response_id`), an HTTP chain
(`store: true`), an HTTP stateless client (the whole history each turn, keep-alive) and a
WebSocket stateless client (the whole history in each `response.create`). Every conversation
has its own API key, so each starts cold in the server's owner-scoped caches; the content is
the same, so the upstream must receive the same bytes from every client (checked: a digest of
every upstream body, per turn, compared across clients). A repetition's conversations run side
by side, a turn of each in turn (`run_conversations`), so a machine whose speed drifts between
minutes moves every point alike.

The stage table is the server's own `rollout_stage_seconds` (from `/metrics`, before and after
each counted turn), per turn; what the stages do not cover is the transport
(the client library, the kernel, hypercorn's framing).

Another project's gateway (`--url`, `GatewayPlan.url`) runs in front of the same fake model
server, on a port fixed beforehand (`--upstream-port`) so that its configuration can name it;
the model the clients ask for is `--model`. Its stage table is there only when it serves
rollout's metrics. A client it fails (an error, a refused connection, a turn past the timeout)
is reported with the error: at the warm-up, the mode is refused and not run; later, its
conversation stops there and the others go on. A client whose history it drops shows as
another conversation (the messages the model was given, compared across clients: a digest of
their roles, text and calls, whatever the JSON's writing), not as a fast number; the same
messages in other bytes (another way of writing a stored turn) are said apart.

Goals (`GOALS`), on medians of the counted turns of every repetition: the WebSocket chain at
~100k at most 1.2x its own overhead at ~1k; the stateless HTTP client at ~100k at most 1.25x
its own at ~1k and at most 1.4x the WebSocket chain's at ~100k.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import h11
import httpx
import msgspec
import trio
from rollout.engine._http_limits import content_length
from rollout.engine._read import read_some
from rollout.protocol import SseDecoder

from ._errors import BenchError, ServerError
from ._server import (
    Endpoint,
    check_reachable,
    open_local_server,
    parse_stage_sums,
    scrape_metrics,
    stop_process,
)
from ._ws import ConnectionClosed, HandshakeError, WsSocket, open_bench_ws

__all__ = [
    "GOALS",
    "MODES",
    "SCHEMA",
    "FakeUpstream",
    "GatewayPlan",
    "judge",
    "render_gateway_summary",
    "run_gateway",
    "validate_gateway",
]

SCHEMA = "rollout-bench-gateway/1"
MODES = ("ws-chain", "http-chain", "http-stateless", "ws-stateless")
MODEL = "gateway"  # the model's name in the gateway's models file (`--model` sets another)
UPSTREAM_MODEL = "fake"
# The largest request body the fake upstream accepts (a ~100k-token history is ~0.6 MB).
MAX_UPSTREAM_BODY = 64 * 2**20
# Bodies kept until their arrival is listed (the benchmark lists after every turn, so one):
# past this, the oldest's content digest is worked out at once and its body let go.
MAX_UNLISTED_BODIES = 8
# The gateway's message limit for the run (the default, 16 MiB, is already above the history).
CLIENT_MAX_MESSAGE = 64 * 2**20
# The WebSocket client's read size. The fake upstream and the HTTP client read through the
# server's own `read_some` (up to 1 MiB into warm memory): a 1 MiB `receive_some` maps fresh
# pages for every read, and the page faults of a 0.5 MB body (~0.2 ms here) were counted in
# every client's overhead at ~100k, as the model's arrival.
RECEIVE_BUFFER = 1 << 20
UPSTREAM_START_TIMEOUT = 30.0
HISTORY_OUTPUT_TOKENS = 400  # each tool output of the starting history
TOOL = {
    "type": "function",
    "name": "run",
    "description": "Run a step of the task.",
    "parameters": {
        "type": "object",
        "properties": {"i": {"type": "integer"}},
        "required": ["i"],
        "additionalProperties": False,
    },
    "strict": True,
}
# Words of the filler text: common English words, each one o200k token with its space.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "up out who them some into more time only can other new could these two may first then do "
    "any like my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three file line code test value result output"
).split()


@attrs.frozen(kw_only=True)
class Goal:
    name: str
    what: str
    limit: float


GOALS = (
    Goal(name="ws-chain-flat", what="ws-chain overhead at ~100k / at ~1k", limit=1.2),
    Goal(name="stateless-flat", what="http-stateless overhead at ~100k / at ~1k", limit=1.25),
    Goal(
        name="stateless-vs-chain",
        what="http-stateless overhead / ws-chain overhead, at ~100k",
        limit=1.4,
    ),
)


@attrs.frozen(kw_only=True)
class GatewayPlan:
    sizes: tuple[int, ...] = (1_000, 100_000)  # tokens of starting history
    modes: tuple[str, ...] = MODES
    turns: int = 16  # counted turns per conversation
    warm: int = 2  # turns before them, not counted
    repetitions: int = 5
    output_tokens: int = 200  # each new tool output
    timeout: float = 60.0  # one turn's limit
    serve_args: tuple[str, ...] = ()  # extra `rollout serve` arguments
    model: str = MODEL  # the model the clients ask for
    upstream_port: int = 0  # the fake model server's port (0: a free one)
    # The gateway under test: a Responses server's base URL, started by someone else and
    # configured to call the fake model server at `upstream_port`; None: a `rollout serve` the
    # benchmark starts in front of it.
    url: str | None = None
    label: str = "rollout"  # the server's name in the results

    def keys(self) -> list[str]:
        return [
            conversation_key(mode, size, rep)
            for rep in range(self.repetitions)
            for size in self.sizes
            for mode in self.modes
        ]


def conversation_key(mode: str, size: int, rep: int) -> str:
    return f"sk-gw-{mode}-{size}-{rep}"


# --- the fake upstream ------------------------------------------------------------------------


@attrs.define
class Arrival:
    at: float  # time.monotonic() when the body had fully arrived
    nbytes: int
    digest: str  # sha256 of the body, first 16 hex digits
    # The conversation the body gives the model (`content_digest`), worked out when the
    # arrival is first listed (between turns: in nobody's overhead or turn time).
    content: str = ""
    body: bytes | None = attrs.field(default=None, repr=False)

    def listed(self) -> tuple[float, int, str, str]:
        if self.body is not None:
            self.content, self.body = content_digest(self.body), None
        return self.at, self.nbytes, self.digest, self.content


def upstream_main(argv: Sequence[str] | None = None) -> None:
    """The fake upstream as a process of its own (`python -m rollout.bench._gateway [PORT]`,
    on PORT or a port of the system's choosing): it prints its port, then serves until killed.
    Its arrival stamps are `time.monotonic()`, the machine's one monotonic clock
    (CLOCK_MONOTONIC on Linux), which the client stamps its sends with too."""
    args = sys.argv[1:] if argv is None else argv
    upstream = FakeUpstream(port=int(args[0]) if args else 0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(upstream.serve)
            print(upstream.port, flush=True)

    trio.run(main)


class _UpstreamProcess:
    """The fake upstream's process, seen from the benchmark: its port and its arrivals."""

    def __init__(self, port: int, client: httpx.AsyncClient) -> None:
        self.port = port
        self.client = client
        self.seen = 0  # arrivals taken by `new_arrivals` so far

    async def arrivals(self, since: int) -> list[Arrival]:
        answer = await self.client.get(f"http://127.0.0.1:{self.port}/arrivals?since={since}")
        return [Arrival(at=a, nbytes=n, digest=d, content=c) for a, n, d, c in answer.json()]

    async def new_arrivals(self) -> list[Arrival]:
        """The arrivals since the last call."""
        arrived = await self.arrivals(self.seen)
        self.seen += len(arrived)
        return arrived


@asynccontextmanager
async def open_upstream(log: Path, port: int = 0) -> AsyncIterator[_UpstreamProcess]:
    """Start the fake upstream in its own process (the client's work never delays its
    stamps) on `port` (0: a free one), yield it, stop it."""
    argv = [sys.executable, "-m", "rollout.bench._gateway", str(port)]
    with log.open("wb") as errors:
        process = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=errors, start_new_session=True
        )
        try:
            assert process.stdout is not None
            with trio.fail_after(UPSTREAM_START_TIMEOUT):
                line = b""
                while not line.endswith(b"\n"):
                    chunk = await process.stdout.receive_some(64)
                    if not chunk:
                        taken = f"is port {port} taken? " if port else ""
                        raise BenchError(f"the fake upstream exited at start ({taken}see {log})")
                    line += chunk
            async with httpx.AsyncClient() as client:
                yield _UpstreamProcess(int(line), client)
        finally:
            with trio.CancelScope(shield=True):
                await stop_process(process)


class FakeUpstream:
    """A chat-completions server that answers every `POST .../chat/completions` at once with
    one streamed call of the tool `run` (its id and argument the number of tool messages in
    the request, so the same conversation gets the same answers from every client) and usage,
    and keeps an `Arrival` per request."""

    def __init__(self, port: int = 0) -> None:
        self.arrivals: list[Arrival] = []
        self._unlisted: deque[Arrival] = deque()  # arrivals still holding their bodies
        self.port = port  # 0: the system's choice, known once serving

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        async with stream:
            while True:
                chunks: list[bytes] = []
                size = 0
                arrived = time.monotonic()
                target = b""
                length: int | None = None  # the body's Content-Length, once the head is in
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        if length is not None and size < length:
                            # The rest of the body as it arrives, parsed after the stamp.
                            pieces = await _read_exactly(stream, length - size)
                            arrived = time.monotonic()
                            for piece in pieces:
                                conn.receive_data(piece)
                            if not pieces:
                                conn.receive_data(b"")
                            continue
                        data = await read_some(stream)
                        arrived = time.monotonic()
                        conn.receive_data(data)
                        continue
                    if isinstance(event, h11.Request):
                        target = event.target
                        length = content_length(event.headers)
                    elif isinstance(event, h11.Data):
                        size += len(event.data)
                        if size > MAX_UPSTREAM_BODY:
                            return
                        chunks.append(bytes(event.data))
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:  # ConnectionClosed, PAUSED
                        return
                body = b"".join(chunks)
                if target.endswith(b"/chat/completions"):
                    digest = body_digest(body)
                    arrival = Arrival(at=arrived, nbytes=len(body), digest=digest, body=body)
                    self.arrivals.append(arrival)
                    self._unlisted.append(arrival)
                    while len(self._unlisted) > MAX_UNLISTED_BODIES:
                        self._unlisted.popleft().listed()
                    await _answer(stream, conn, body)
                elif target.startswith(b"/arrivals"):
                    since = int(target.partition(b"=")[2] or 0)
                    listed = [a.listed() for a in self.arrivals[since:]]
                    self._unlisted.clear()
                    await _send(stream, conn, 200, b"application/json", json.dumps(listed).encode())
                else:
                    await _send(stream, conn, 404, b"application/json", b'{"error":"not found"}')
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()


# rollout names the calls it relays itself (`call_` and 24 hex digits), whatever the model
# called them: the digest numbers them in order of appearance, so the same conversation has the
# same digest from every client.
_CALL_ID = re.compile(rb'"call_[0-9a-f]{24}"')


async def _read_exactly(stream: trio.SocketStream, count: int) -> list[bytes]:
    """The next `count` bytes of `stream` as read (fewer if it ends first), with nothing
    done between reads: the arrival stamp is when the model server has the body, not when
    this process has also parsed each piece of it (h11's copies, ~0.3 ms for 0.5 MB here)."""
    pieces: list[bytes] = []
    while count > 0:
        data = await read_some(stream)
        if not data:
            break
        pieces.append(data)
        count -= len(data)
    return pieces


def content_digest(body: bytes) -> str:
    """The conversation a chat-completions body gives the model, whatever a gateway's way of
    writing it: each message's role, text (null, "" and text parts alike), calls (name and
    arguments) and the call it answers, every call id numbered in order of appearance. Two
    gateways' bodies, or two clients' through one gateway, that say the same to the model have
    the same digest; a history dropped or changed gives another. Not JSON: "not json"."""
    try:
        messages = msgspec.json.decode(body).get("messages")
    except (msgspec.DecodeError, AttributeError):
        return "not json"
    names: dict[str, str] = {}

    def name(call_id: Any) -> str:
        return names.setdefault(str(call_id), f"#{len(names)}")

    said: list[list[Any]] = []
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            said.append(["?", repr(message)])
            continue
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(
                str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content
            )
        calls = [
            [
                name(c.get("id")),
                (c.get("function") or {}).get("name"),
                (c.get("function") or {}).get("arguments"),
            ]
            for c in message.get("tool_calls") or []
            if isinstance(c, dict)
        ]
        answers = message.get("tool_call_id")
        said.append(
            [message.get("role"), content, calls, None if answers is None else name(answers)]
        )
    return hashlib.sha256(msgspec.json.encode(said)).hexdigest()[:16]


def body_digest(body: bytes) -> str:
    names: dict[bytes, bytes] = {}

    def number(match: re.Match[bytes]) -> bytes:
        return names.setdefault(match.group(), b'"call#%d"' % len(names))

    return hashlib.sha256(_CALL_ID.sub(number, body)).hexdigest()[:16]


async def _send(
    stream: trio.SocketStream, conn: h11.Connection, status: int, kind: bytes, payload: bytes
) -> None:
    headers = [(b"content-type", kind), (b"content-length", str(len(payload)).encode())]
    data = conn.send(h11.Response(status_code=status, headers=headers))
    assert data is not None
    out = data + (conn.send(h11.Data(data=payload)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
    await stream.send_all(out)


# A tool message of the request, however its JSON is spaced (gateways other than rollout write
# `"role": "tool"`).
_TOOL_ROLE = re.compile(rb'"role"\s*:\s*"tool"')


async def _answer(stream: trio.SocketStream, conn: h11.Connection, body: bytes) -> None:
    n = len(_TOOL_ROLE.findall(body))
    chunk: dict[str, Any] = {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": UPSTREAM_MODEL,
    }
    call = {
        "index": 0,
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "run", "arguments": json.dumps({"i": n})},
    }
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}}]},
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {
            **chunk,
            "choices": [],
            "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": 6, "total_tokens": 0},
        },
    ]
    payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    await _send(stream, conn, 200, b"text/event-stream", payload + b"data: [DONE]\n\n")


# --- the conversations ------------------------------------------------------------------------


def filler(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def history(size: int) -> list[dict[str, Any]]:
    """A conversation of about `size` tokens: a task, then calls and their outputs (the same
    for every client and repetition: the upstream bodies are compared across clients)."""
    rng = random.Random(size)
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": "Work through the task. " + filler(rng, 40)}
    ]
    tokens = 50
    i = 0
    while tokens < size:
        words = min(HISTORY_OUTPUT_TOKENS, max(size - tokens, 20))
        call_id = f"call_h{i}"
        items.append(
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "run",
                "arguments": f'{{"i":{i}}}',
            }
        )
        items.append(
            {"type": "function_call_output", "call_id": call_id, "output": filler(rng, words)}
        )
        tokens += words + 12
        i += 1
    return items


def tool_output(call_id: str, turn: int, tokens: int) -> dict[str, Any]:
    rng = random.Random(1_000_003 * turn + tokens)
    return {"type": "function_call_output", "call_id": call_id, "output": filler(rng, tokens)}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@attrs.define
class TurnResult:
    overhead: float  # upstream arrival - client send (seconds)
    turn_time: float  # client send -> terminal event (seconds)
    request_bytes: int  # what the client sent
    upstream_bytes: int
    digest: str  # of the upstream body's bytes (`body_digest`)
    content_digest: str  # of the conversation it gives the model (`content_digest`)


class _HttpClient:
    """A keep-alive HTTP/1.1 client (h11 over trio): a request's bytes are made before its
    send is stamped, so the overhead measured is the server's, not a client library's."""

    def __init__(self, stream: trio.SocketStream, host: str, headers: dict[str, str]) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)
        self.host = host
        self.headers = [(k, v) for k, v in headers.items()]

    def request(self, target: str, body: bytes) -> bytes:
        headers = [
            ("host", self.host),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            *self.headers,
        ]
        parts = [
            self.conn.send(h11.Request(method="POST", target=target, headers=headers)),
            self.conn.send(h11.Data(data=body)),
            self.conn.send(h11.EndOfMessage()),
        ]
        return b"".join(p for p in parts if p)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The response's server-sent events, to the end of the response."""
        decoder = SseDecoder(max_event_size=CLIENT_MAX_MESSAGE)
        status = 0
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await read_some(self.stream))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                if status != 200:
                    text = bytes(event.data).decode(errors="replace")[:300]
                    raise ServerError(f"HTTP {status}: {text}")
                for sse in decoder.feed(bytes(event.data)):
                    yield json.loads(sse.data)
            elif isinstance(event, h11.EndOfMessage):
                self.conn.start_next_cycle()
                return
            else:
                raise ServerError(f"the server closed the connection ({event!r})")


class _Client:
    """One conversation's client in one mode."""

    def __init__(self, mode: str, endpoint: Endpoint, size: int, plan: GatewayPlan) -> None:
        self.mode = mode
        self.endpoint = endpoint
        self.plan = plan
        self.history = history(size)
        self.pending: list[dict[str, Any]] = list(self.history)  # not yet sent (chains)
        self.previous: str | None = None
        self.ws: WsSocket | None = None
        self.http: _HttpClient | None = None

    async def open(self, stack: AsyncExitStack) -> None:
        headers = self.endpoint.headers()
        if self.mode.startswith("ws"):
            self.ws = await stack.enter_async_context(
                open_bench_ws(
                    self.endpoint.ws_url,
                    extra_headers=[(k.encode(), v.encode()) for k, v in headers.items()],
                    offer_deflate=False,
                    max_message_size=CLIENT_MAX_MESSAGE,
                    receive_buffer_size=RECEIVE_BUFFER,
                )
            )
        else:
            parts = urlsplit(self.endpoint.base_url)
            assert parts.hostname is not None
            stream = await trio.open_tcp_stream(parts.hostname, parts.port or 80)
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await stack.enter_async_context(stream)
            self.http = _HttpClient(stream, parts.netloc, headers)

    def payload(self) -> str:
        body: dict[str, Any] = {"model": self.plan.model, "tools": [TOOL]}
        chain = self.mode.endswith("chain")
        body["input"] = self.pending if chain else self.history
        if chain and self.previous is not None:
            body["previous_response_id"] = self.previous
        body["store"] = self.mode == "http-chain"
        if self.ws is not None:
            return _dumps({"type": "response.create", **body})
        return _dumps({**body, "stream": True})

    async def turn(self) -> tuple[float, float, int, dict[str, Any]]:
        """Send one turn; (send time, end time, bytes sent, the final response). The send
        is stamped as the request's first byte goes to the socket."""
        text = self.payload()
        with trio.fail_after(self.plan.timeout):
            if self.ws is not None:
                data = self.ws.frame(text)
                sent = time.monotonic()
                await self.ws.send_frame(data)
                response = await self._ws_response()
            else:
                assert self.http is not None
                target = urlsplit(self.endpoint.responses_url).path
                data = self.http.request(target, text.encode())
                sent = time.monotonic()
                await self.http.stream.send_all(data)
                response = await self._http_response()
            ended = time.monotonic()
        return sent, ended, len(data), response

    async def _ws_response(self) -> dict[str, Any]:
        assert self.ws is not None
        while True:
            event = json.loads(await self.ws.get_message())
            kind = event.get("type")
            if kind in ("response.completed", "response.incomplete", "response.failed"):
                return _finished(self.mode, event)
            if kind == "error":
                raise ServerError(f"{self.mode}: error event: {_dumps(event)[:300]}")

    async def _http_response(self) -> dict[str, Any]:
        assert self.http is not None
        final: dict[str, Any] | None = None
        async for event in self.http.events():
            if event.get("type") in (
                "response.completed",
                "response.incomplete",
                "response.failed",
            ):
                final = _finished(self.mode, event)
        if final is None:
            raise ServerError(f"{self.mode}: the stream ended without a terminal event")
        return final

    def next_input(self, response: dict[str, Any], turn: int) -> None:
        outputs = response.get("output") or []
        calls = [o for o in outputs if o.get("type") == "function_call"]
        if not calls:
            raise ServerError(f"{self.mode}: turn {turn} ended without the tool call")
        new = tool_output(calls[0]["call_id"], turn, self.plan.output_tokens)
        self.previous = response.get("id")
        self.history.extend([*outputs, new])
        self.pending = [new]


# What ends a conversation early rather than the run: the server under test refused or broke a
# turn (a gateway other than rollout may not support every client).
TURN_FAILURES: tuple[type[BaseException], ...] = (
    ServerError,
    HandshakeError,
    ConnectionClosed,
    trio.TooSlowError,
    trio.BrokenResourceError,
    OSError,
    h11.ProtocolError,
    json.JSONDecodeError,  # a body or an event that is not JSON
)
ERROR_CHARS = 500  # of a failure's message, kept in the results


def _finished(mode: str, event: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = event.get("response") or {}
    if event.get("type") != "response.completed":
        raise ServerError(f"{mode}: the response ended {response.get('status')}: {response}")
    return response


class _Conversation:
    """One conversation of one client: its turns, taken one at a time (`step`), and the
    server's stage seconds of its counted turns."""

    def __init__(
        self,
        mode: str,
        endpoint: Endpoint,
        size: int,
        plan: GatewayPlan,
        upstream: _UpstreamProcess,
    ) -> None:
        self.mode = mode
        self.size = size
        self.plan = plan
        self.upstream = upstream
        self.client = _Client(mode, endpoint, size, plan)
        self.turn = 0
        self.turns: list[TurnResult] = []
        self.stages: dict[str, float] = {}
        self.error: str | None = None  # why the conversation stopped early

    async def fail(self, exc: BaseException) -> None:
        """Stop the conversation at this turn with the reason, and take the upstream requests
        its turn made (they are no other conversation's)."""
        text = str(exc) or type(exc).__name__
        if not text.startswith(self.mode):
            text = f"{self.mode}: turn {self.turn}: {type(exc).__name__}: {text}"
        self.error = text[:ERROR_CHARS]
        await self.upstream.new_arrivals()

    async def step(self, metrics: Callable[[], Any]) -> None:
        """One turn; a counted turn's stages are the server's stage sums just before and
        just after it (nothing else runs on the server in between)."""
        turn, plan = self.turn, self.plan
        counted = turn >= plan.warm
        before = await metrics() if counted else {}
        sent, ended, nbytes, response = await self.client.turn()
        arrived = await self.upstream.new_arrivals()
        if len(arrived) != 1:
            raise ServerError(
                f"{self.mode}: turn {turn} made {len(arrived)} upstream requests, not one"
            )
        if counted:
            after = await metrics()
            for k, v in after.items():
                self.stages[k] = self.stages.get(k, 0.0) + v - before.get(k, 0.0)
            self.turns.append(
                TurnResult(
                    overhead=arrived[0].at - sent,
                    turn_time=ended - sent,
                    request_bytes=nbytes,
                    upstream_bytes=arrived[0].nbytes,
                    digest=arrived[0].digest,
                    content_digest=arrived[0].content,
                )
            )
        self.client.next_input(response, turn)
        self.turn += 1

    def result(self) -> dict[str, Any]:
        stages = {k: v / max(len(self.turns), 1) for k, v in self.stages.items()}
        result = {
            "mode": self.mode,
            "size": self.size,
            "history_bytes": len(_dumps(history(self.size)).encode()),
            "turns": [attrs.asdict(t) for t in self.turns],
            "stages_s": {k: v for k, v in sorted(stages.items()) if v > 0},
        }
        if self.error is not None:
            result["error"] = self.error
        return result


async def run_conversations(
    conversations: list[_Conversation], metrics: Callable[[], Any]
) -> list[dict[str, Any]]:
    """The conversations side by side, a turn of each in turn (their order rotating each
    round), so every client and size is measured in the same minutes: a machine whose speed
    drifts between minutes moves them all alike, and the ratios between them hold. A
    conversation the server fails (an error, a refused connection, a turn past the plan's
    timeout) stops there with its reason (`error` in its result); the others go on."""
    async with AsyncExitStack() as stack:
        for conversation in conversations:
            try:
                with trio.fail_after(conversation.plan.timeout):
                    await conversation.client.open(stack)
            except TURN_FAILURES as exc:
                await conversation.fail(exc)
        rounds = conversations[0].plan.warm + conversations[0].plan.turns
        for n in range(rounds):
            shift = n % len(conversations)
            for conversation in [*conversations[shift:], *conversations[:shift]]:
                if conversation.error is not None:
                    continue
                try:
                    await conversation.step(metrics)
                except TURN_FAILURES as exc:
                    await conversation.fail(exc)
    return [c.result() for c in conversations]


async def run_conversation(
    mode: str,
    endpoint: Endpoint,
    size: int,
    plan: GatewayPlan,
    upstream: _UpstreamProcess,
    metrics: Callable[[], Any],
) -> dict[str, Any]:
    """One conversation alone: its counted turns and the server's stage seconds per counted
    turn."""
    conversation = _Conversation(mode, endpoint, size, plan, upstream)
    return (await run_conversations([conversation], metrics))[0]


@asynccontextmanager
async def _gateway(plan: GatewayPlan, out: Path, port: int) -> AsyncIterator[Endpoint]:
    """The gateway under test: the server at `plan.url` (checked to answer), or a `rollout
    serve` started in front of the fake model server at `port`."""
    if plan.url is not None:
        endpoint = Endpoint(label=plan.label, base_url=plan.url)
        async with httpx.AsyncClient() as client:
            await check_reachable(client, endpoint)
        yield endpoint
        return
    models = out / "gateway-models.toml"
    models.write_text(
        f"[models.{json.dumps(plan.model)}]\n"
        f'upstream = "http://127.0.0.1:{port}/v1"\nmodel = "{UPSTREAM_MODEL}"\n'
    )
    keys = tuple(a for key in [*plan.keys(), "sk-gw-warmup"] for a in ("--api-key", key))
    args = ("--models", str(models), "--max-message-size", str(CLIENT_MAX_MESSAGE), *keys)
    async with open_local_server(
        log_path=out / "server-gateway.log", label="rollout", extra_args=(*args, *plan.serve_args)
    ) as endpoint:
        yield endpoint


async def run_gateway(
    plan: GatewayPlan,
    out: Path,
    progress: Callable[[str], None],
    *,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Run the plan against its gateway. `api_key`: the one key every request to a server
    given by URL sends (without it, each conversation sends a key of its own, as to the
    `rollout serve` the benchmark starts; never written into the results)."""
    from ._runner import _loadavg

    started = time.time()
    loadavg_at_start = _loadavg()
    runs: list[dict[str, Any]] = []
    refused: dict[str, str] = {}

    def key(conversation: str) -> str:
        return api_key or conversation

    async with (
        open_upstream(out / "upstream-gateway.log", plan.upstream_port) as upstream,
        _gateway(plan, out, upstream.port) as base,
        httpx.AsyncClient() as scraper,
    ):
        # The server's stage table needs rollout's metrics: asked once, never per turn of a
        # server without them.
        scraped = attrs.evolve(base, api_key=key("sk-gw-warmup"))
        stage_metrics = await scrape_metrics(scraper, scraped) is not None

        async def metrics() -> dict[str, float]:
            if not stage_metrics:
                return {}
            return parse_stage_sums(await scrape_metrics(scraper, scraped) or "")

        # One conversation of every mode at the smallest size, not recorded: imports,
        # first connections and the code's first runs are not the gateway's overhead. A mode
        # the server fails here is refused (said in the results) and not run further.
        for mode in plan.modes:
            endpoint = attrs.evolve(base, api_key=key("sk-gw-warmup"))
            warm = attrs.evolve(plan, warm=1, turns=1)
            run = await run_conversation(mode, endpoint, plan.sizes[0], warm, upstream, metrics)
            if "error" in run:
                refused[mode] = run["error"]
                progress(f"{mode} refused: {run['error']}")
        modes = [m for m in plan.modes if m not in refused]
        for rep in range(plan.repetitions if modes else 0):
            progress(f"repetition {rep + 1}/{plan.repetitions}: every client at every size")
            conversations = [
                _Conversation(
                    mode,
                    attrs.evolve(base, api_key=key(conversation_key(mode, size, rep))),
                    size,
                    plan,
                    upstream,
                )
                for size in plan.sizes
                for mode in modes
            ]
            for run in await run_conversations(conversations, metrics):
                run["repetition"] = rep
                runs.append(run)
    server = {
        "label": base.label,
        "url": plan.url,
        "started": plan.url is None,
        "stage_metrics": stage_metrics,
        "upstream_port": upstream.port,
    }
    results = build_results(plan, runs, started, server=server, refused=refused)
    results["meta"]["loadavg_at_start"] = loadavg_at_start
    return results


# --- results ----------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def build_results(
    plan: GatewayPlan,
    runs: list[dict[str, Any]],
    started: float,
    *,
    server: dict[str, Any] | None = None,
    refused: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The results document (`SCHEMA`): a point per mode and size (a refused mode's without
    turns, its error said; a point whose conversations sent the model other bytes than the
    other clients' says `bodies: differ`), every run, the comparison of the bodies, the goals.
    `server`: which gateway ran (`run_gateway`'s); `refused`: the modes it refused, each with
    the error."""
    from ._runner import _loadavg, _machine, _versions

    refused = refused or {}
    differing, other_bytes = _compare_bodies(runs)
    points = []
    for size in plan.sizes:
        for mode in plan.modes:
            mine = [r for r in runs if r["mode"] == mode and r["size"] == size]
            turns = [t for r in mine for t in r["turns"]]
            stage_names = sorted({s for r in mine for s in r["stages_s"]})
            errors = [r["error"] for r in mine if "error" in r]
            names = {(mode, size, r["repetition"]) for r in mine}
            bodies = (
                "differ" if names & differing else "other-bytes" if names & other_bytes else "same"
            )
            points.append(
                {
                    "mode": mode,
                    "size": size,
                    "history_bytes": mine[0]["history_bytes"] if mine else None,
                    "turns": len(turns),
                    "overhead_ms": _ms(_median([t["overhead"] for t in turns])),
                    "turn_ms": _ms(_median([t["turn_time"] for t in turns])),
                    "request_bytes": _median([t["request_bytes"] for t in turns]),
                    "upstream_bytes": _median([t["upstream_bytes"] for t in turns]),
                    "stages_ms": {
                        s: _ms(_median([r["stages_s"].get(s, 0.0) for r in mine]))
                        for s in stage_names
                    },
                    "error": refused.get(mode) or (errors[0] if errors else None),
                    "bodies": bodies if turns else None,
                }
            )
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "meta": {
            "started": started,
            "seconds": round(time.time() - started, 1),
            "machine": _machine(),
            "loadavg": _loadavg(),
            "versions": _versions(),
            "plan": attrs.asdict(plan),
            "server": server or {"label": plan.label, "url": plan.url, "started": True},
        },
        "points": points,
        "refused": refused,
        "runs": runs,
        "same_upstream_bodies": same_bodies(runs, (differing, other_bytes)),
    }
    results["goals"] = judge(results)
    return results


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def same_bodies(
    runs: list[dict[str, Any]],
    compared: tuple[set[tuple[str, int, int]], set[tuple[str, int, int]]] | None = None,
) -> dict[str, Any]:
    """Whether every client gave the upstream the same conversation at every turn of a size:
    the conversations are the same, so they must. `differ`: the conversations whose messages
    differ (`content_digest`: a history dropped or changed); `other_bytes`: those that said
    the same in other bytes (another gateway's way of writing a stored turn, say); rollout
    sends the same bytes from every client. The reference at each size is what most
    conversations sent (the first of equals): one client that drops its history differs, not
    the three that keep it. A conversation that failed is not compared (its error is
    reported). `compared`: `_compare_bodies(runs)`, when the caller has it."""
    differ, other_bytes = compared or _compare_bodies(runs)
    return {
        "compared": sum("error" not in r for r in runs),
        "differ": _names(differ),
        "other_bytes": _names(other_bytes),
    }


def _compare_bodies(
    runs: list[dict[str, Any]],
) -> tuple[set[tuple[str, int, int]], set[tuple[str, int, int]]]:
    """The conversations that gave the model another conversation, and those that said the
    same in other bytes (`same_bodies`)."""
    differ = _differing(runs, "content_digest")
    return differ, _differing(runs, "digest") - differ


def _names(conversations: set[tuple[str, int, int]]) -> list[str]:
    def order(conversation: tuple[str, int, int]) -> tuple[int, int, int]:
        mode, size, rep = conversation
        return size, rep, MODES.index(mode) if mode in MODES else len(MODES)

    return [f"{mode}#{rep} at ~{size}" for mode, size, rep in sorted(conversations, key=order)]


def _differing(runs: list[dict[str, Any]], digest: str) -> set[tuple[str, int, int]]:
    """(mode, size, repetition) of each compared conversation whose turns' `digest` differ
    from its size's reference sequence (`same_bodies`). Results written before content
    digests compare the bytes' digests."""
    by_size: dict[int, list[tuple[tuple[str, int, int], tuple[str, ...]]]] = {}
    for run in runs:
        if "error" in run:
            continue
        name = (run["mode"], run["size"], run.get("repetition", 0))
        digests = tuple(t.get(digest, t["digest"]) for t in run["turns"])
        by_size.setdefault(run["size"], []).append((name, digests))
    differ: set[tuple[str, int, int]] = set()
    for seen in by_size.values():
        counts = Counter(d for _, d in seen)
        reference = max(counts, key=lambda d: counts[d])  # the first of equals: dicts keep order
        differ.update(name for name, d in seen if d != reference)
    return differ


def judge(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal: its ratio from the points' median overheads, and MET, MISSED or not
    measured."""
    # A point that failed or sent the model other bytes is not a measure of the same work.
    points = {
        (p["mode"], p["size"]): p["overhead_ms"]
        for p in results["points"]
        if not p.get("error") and p.get("bodies") != "differ"
    }
    sizes = sorted({p["size"] for p in results["points"]})
    small, large = (sizes[0], sizes[-1]) if sizes else (0, 0)
    pairs = {
        "ws-chain-flat": (("ws-chain", large), ("ws-chain", small)),
        "stateless-flat": (("http-stateless", large), ("http-stateless", small)),
        "stateless-vs-chain": (("http-stateless", large), ("ws-chain", large)),
    }
    out = []
    for goal in GOALS:
        top, bottom = (points.get(k) for k in pairs[goal.name])
        ratio = None if not top or not bottom or small == large else top / bottom
        verdict = "not measured" if ratio is None else "MET" if ratio <= goal.limit else "MISSED"
        out.append(
            {
                "name": goal.name,
                "what": goal.what,
                "limit": goal.limit,
                "ratio": None if ratio is None else round(ratio, 3),
                "verdict": verdict,
            }
        )
    return out


def validate_gateway(results: dict[str, Any]) -> None:
    """The structure the summary and the tests rely on (a check of structure only)."""
    if results.get("schema") != SCHEMA:
        raise BenchError(f"not a gateway run: schema {results.get('schema')!r}")
    for key in ("meta", "points", "runs", "goals", "same_upstream_bodies"):
        if key not in results:
            raise BenchError(f"gateway results lack {key!r}")
    # Added since the first runs (optional, so that those still read): which server ran, the
    # modes it refused, and each point's error and bodies.
    server = results["meta"].get("server", {})
    if not isinstance(server, dict) or not isinstance(server.get("label", ""), str):
        raise BenchError(f"gateway results: meta.server is not a server's record: {server!r}")
    refused = results.get("refused", {})
    if not isinstance(refused, dict) or not all(isinstance(v, str) for v in refused.values()):
        raise BenchError(f"gateway results: refused is not a mode -> error map: {refused!r}")
    for point in results["points"]:
        if point.get("bodies") not in (None, "same", "other-bytes", "differ"):
            raise BenchError(f"gateway results: a point's bodies is {point['bodies']!r}")
        if not isinstance(point.get("error") or "", str):
            raise BenchError(f"gateway results: a point's error is {point['error']!r}")


def render_gateway_summary(results: dict[str, Any]) -> str:
    points = results["points"]
    sizes = sorted({p["size"] for p in points})
    modes = list(dict.fromkeys(p["mode"] for p in points))
    by = {(p["mode"], p["size"]): p for p in points}
    meta = results["meta"]
    server = meta.get("server") or {}
    lines = ["# rollout bench: gateway", ""]
    if server.get("url"):
        lines += [
            f"Server: {server.get('label')} at {server['url']} (not started by the bench), "
            f"model `{meta['plan'].get('model', MODEL)}`, the fake model server on port "
            f"{server.get('upstream_port')}",
            "",
        ]
    for goal in results["goals"]:
        ratio = "-" if goal["ratio"] is None else f"{goal['ratio']:.2f}x"
        lines.append(f"- {goal['verdict']}: {goal['what']} = {ratio} (goal <= {goal['limit']}x)")
    bodies = results["same_upstream_bodies"]
    lines.append(
        f"- upstream bodies: {len(bodies['differ'])} of {bodies['compared']} conversations "
        "gave the model another conversation than the other clients' (the same content: they "
        "must not)"
        + (
            f"; {len(bodies['other_bytes'])} said the same in other bytes"
            if bodies.get("other_bytes")
            else ""
        )
    )
    lines += [
        "",
        "Overhead: the client's send to the request complete at the model (median ms)",
        "",
    ]
    lines.append("| client | " + " | ".join(f"~{s} tokens" for s in sizes) + " |")
    lines.append("|---|" + "---|" * len(sizes))
    for mode in modes:
        cells = [_overhead_cell(by.get((mode, s), {})) for s in sizes]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    refused = results.get("refused") or {}
    failed = [p for p in points if p.get("error") and p["mode"] not in refused]
    if refused or failed or bodies["differ"] or bodies.get("other_bytes"):
        lines.append("")
    for mode, error in refused.items():
        lines.append(f"- {mode} refused (its warm-up conversation failed): {error}")
    for p in failed:
        lines.append(f"- {p['mode']} at ~{p['size']} failed: {p['error']}")
    if bodies["differ"]:
        lines.append(
            "- differs: the model was given another conversation by this client than by the "
            f"others (the same content): {', '.join(bodies['differ'])}; its times are not of "
            "the same work"
        )
    if bodies.get("other_bytes"):
        lines.append(
            "- the same messages in other bytes (another way of writing them, not another "
            f"conversation): {', '.join(bodies['other_bytes'])}"
        )
    stage_names = sorted({s for p in points for s in p["stages_ms"]})
    if server.get("stage_metrics") is False:
        lines += [
            "",
            f"No stage table: {server.get('label')} serves no rollout metrics "
            "(`rollout_stage_seconds` at /metrics).",
        ]
        lines += ["", _load_line(meta), ""]
        return "\n".join(lines)
    lines += ["", "The server's stages per turn (ms, median of the conversations' means)", ""]
    lines.append("| client | size | " + " | ".join(stage_names) + " | rest |")
    lines.append("|---|---|" + "---|" * (len(stage_names) + 1))
    for size in sizes:
        for mode in modes:
            p = by.get((mode, size))
            if p is None:
                continue
            st = p["stages_ms"]
            rest = None
            if p["overhead_ms"] is not None:
                rest = p["overhead_ms"] - sum(v or 0.0 for v in st.values())
            cells = [_cell(st.get(s)) for s in stage_names]
            lines.append(f"| {mode} | ~{size} | " + " | ".join(cells) + f" | {_cell(rest)} |")
    lines += ["", _load_line(meta), ""]
    return "\n".join(lines)


def _load_line(meta: dict[str, Any]) -> str:
    """The machine's load averages (1, 5, 15 minutes) at the run's start and end: other work
    on the machine shows there."""

    def load(values: list[float] | None) -> str:
        return "-" if values is None else " / ".join(f"{v:.2f}" for v in values)

    at_start = (
        f"at the start {load(meta['loadavg_at_start'])}, " if "loadavg_at_start" in meta else ""
    )
    return f"loadavg (1/5/15 min) {at_start}at the end {load(meta['loadavg'])}; {meta['seconds']} s"


def _overhead_cell(point: dict[str, Any]) -> str:
    """A point's median overhead; `differs` or `failed` instead when it is not a measure of
    the same work (the number stays in results.json)."""
    if point.get("bodies") == "differ":
        return "differs"
    if point.get("error"):
        return "failed" if point.get("turns") else "refused"
    return _cell(point.get("overhead_ms"))


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    upstream_main()
