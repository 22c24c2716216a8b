"""The agent loop, driven five ways from the client side.

Long because the one agent loop runs over five transports (stateless, chained, stored,
WebSocket, the rollout extension), reads each stream's timing and probes what a foreign server
supports.

| mode             | transport                     | each turn sends                              |
|------------------|-------------------------------|----------------------------------------------|
| `http-stateless` | a new HTTP connection per turn | the whole history, `store: false`            |
| `http-chain`     | HTTP, one keep-alive client    | the tool output, `previous_response_id`,     |
|                  |                               | `store: true` (the server hydrates the store) |
| `ws-chain`       | one WebSocket                 | the tool output, `previous_response_id`,     |
|                  |                               | `store: false` (the connection's cache)       |
| `ws-chain-stored`| one WebSocket                 | as `ws-chain` with `store: true`: each turn   |
|                  |                               | is committed before its terminal event        |
| `ws-rollout`     | one WebSocket                 | `response.append` with the tool output to    |
|                  |                               | the one long-lived response (the extension)  |

Every turn records, on the client's clock (`time.perf_counter`): when the request was sent,
when the server acknowledged it (`response.created`, or the resumed `response.in_progress`),
the first and last output delta, and the terminal event (the tail, last delta to terminal
event, is where a durable store's commit shows); plus the server's own pre-inference
stage timings (`rollout.timing` frames over WebSocket, the `Server-Timing` header over HTTP)
and, in a counting pass, the deltas of the server's /metrics work counters.

Events are decoded with `json.loads` and dispatched on `type` only: the client must stay cheaper
than the server it measures. Over WebSocket the client is `rollout.spec.WsClient` (strict)
on its cheap path: `ClientConnection.receive_json` reads four keys of the parsed event to
follow the protocol and says when the turn is over (asked after every event but a delta, which
never ends one). The turn's own task reads the socket (`_ws.py`: wsproto, no reader task), and
takes every message a read completed, stamped with the read's time; tool outputs are made once
per scenario, before the first turn. Server-sent events are read with the protocol's
`SseDecoder`. The WebSocket offers permessage-deflate, as the openai SDK and Codex
do (the server decides; `_ws.py`), and each turn records its bytes on the wire and of the
messages' payloads, both ways; a ws-rollout turn also the payload bytes of its suspension
events (the resumed `response.in_progress` that acknowledged it, the `response.done` that
ended it), which must not grow with the rollout (PROTOCOL.md RX-2.5).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any

import attrs
import httpx
import trio
from rollout.protocol import ProtocolError, SseDecoder
from rollout.spec import WsClient

from ._errors import ServerError
from ._records import RolloutRecord, Stream, TurnRecord
from ._scenario import INSTRUCTIONS, TOOL_NAME, Scenario
from ._server import Endpoint, error_fields
from ._streams import check_streams, measure_encoding
from ._tokens import SIM, TokenCounter
from ._ws import ConnectionClosed, ConnectionRejected, HandshakeError, WsSocket, open_bench_ws

__all__ = [
    "MODES",
    "RolloutRecord",
    "RolloutSpec",
    "Stream",
    "TurnRecord",
    "parse_server_timing",
    "probe_rollout_extension",
    "probe_websocket",
    "run_rollout",
]

MODES = ("http-stateless", "http-chain", "ws-chain", "ws-chain-stored", "ws-rollout")

# The largest WebSocket message the client accepts (a rollout's final response carries every
# output item of the rollout).
CLIENT_MAX_MESSAGE_SIZE = 64 * 1024 * 1024
# Bytes read from the socket per receive: deltas are small, final responses are not.
CLIENT_RECEIVE_BUFFER = 256 * 1024
# Turns a rollout may take beyond its scenario's before the client gives up on the model.
EXTRA_TURNS = 2

_DELTAS = frozenset({"response.output_text.delta", "response.function_call_arguments.delta"})
_FAILURES = frozenset({"response.failed", "response.incomplete", "error"})
_ENDS = frozenset({"response.completed", "response.done"})

Scrape = Callable[[], Awaitable[dict[str, int] | None]]


@attrs.frozen(kw_only=True)
class RolloutSpec:
    """What one rollout runs: a scenario on a model, and how the client behaves."""

    scenario: Scenario
    model: str
    run_tools: bool = True  # sleep the tool latency (False in the counting pass)
    timing: bool = True  # ask for rollout.timing frames over WebSocket
    # For models that are not `sim`: force a call per turn with tool_choice (then "none" for
    # the answer) instead of relying on the sim's `steps`. A rollout is one response, whose
    # tool_choice can't change per turn: there the model chooses (`auto`), and the last tool
    # output comes with a user message asking for the answer (best effort).
    force_tool_choice: bool = False
    timeout: float = 900.0
    # How received tokens are counted (`_tokens.py`): the sim's exact count by default (a
    # turn whose count differs from its usage fails); a tokenizer the user named (a figure
    # beside the usage); None: the server's usage is the count. Text is checked in every case.
    counter: TokenCounter | None = SIM
    keep_frames: bool = False  # keep each turn's events as received (to time their encoding)
    # For a real model: the tools to declare instead of the scenario's (whose argument length
    # is the `sim` model's output size), and fields every create carries (`temperature`,
    # `max_output_tokens`).
    tools: tuple[dict[str, Any], ...] | None = None
    body: tuple[tuple[str, Any], ...] = ()
    # A turn that ends `response.incomplete` (max_output_tokens) is a turn like a completed
    # one, not a failure: a real model's answer is cut at the scenario's output size.
    incomplete_ends: bool = False


def parse_server_timing(header: str | None) -> dict[str, float] | None:
    """`stage;dur=ms, ...` -> {stage: seconds}."""
    if not header:
        return None
    out: dict[str, float] = {}
    for part in header.split(","):
        name, *params = (p.strip() for p in part.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur" and name:
                try:
                    out[name] = out.get(name, 0.0) + float(value) / 1000
                except ValueError:
                    continue
    return out


class _TurnReader:
    """Feeds a turn's events; knows when the turn is over."""

    def __init__(self, turn: TurnRecord, mode: str, *, incomplete_ends: bool = False) -> None:
        self.turn = turn
        self.mode = mode
        self.ends = _ENDS | {"response.incomplete"} if incomplete_ends else _ENDS
        self.items: list[dict[str, Any]] = []
        self.response: dict[str, Any] | None = None
        self.pending: list[str] | None = None
        self.deltas: dict[str, list[str]] = {}  # item id -> its deltas, as they came

    def feed(self, event: dict[str, Any], now: float) -> bool:
        kind = event.get("type")
        turn = self.turn
        turn.events += 1
        if kind in _DELTAS:
            if turn.first_token is None:
                turn.first_token = now
                turn.first_delta = (_delta_kind(kind), event["delta"])
            turn.last_token = now
            turn.deltas += 1
            pieces = self.deltas.get(event["item_id"])
            if pieces is None:
                pieces = self.deltas[event["item_id"]] = []
            pieces.append(event["delta"])
        elif kind == "response.output_item.done":
            self.items.append(event["item"])
        elif kind == "rollout.timing":
            turn.stages = {k: float(v) for k, v in event.get("stages", {}).items()}
        elif kind in ("response.created", "response.in_progress"):
            if turn.acknowledged is None:
                turn.acknowledged = now
        elif kind in self.ends:
            turn.ended = now
            self.response = event.get("response")
            turn.status = (self.response or {}).get("status")
            if kind == "response.done":
                self.pending = list(event.get("pending_call_ids") or [])
            usage = (self.response or {}).get("usage")
            if kind != "response.done" and usage:
                turn.output_tokens = usage.get("output_tokens")
                turn.context_tokens = usage.get("input_tokens")
                details = usage.get("input_tokens_details") or {}
                turn.cached_tokens = details.get("cached_tokens")
            return True
        elif kind in _FAILURES:
            raise ServerError(f"{self.mode}, turn {turn.index}: {_describe(event)}")
        return False

    def streams(self) -> list[Stream]:
        """Each output item's deltas against its final text (and deltas of no item)."""
        out: list[Stream] = []
        deltas = dict(self.deltas)
        for item in self.items:
            kind, final = _final_text(item)
            if kind is None:
                continue
            received = "".join(deltas.pop(str(item.get("id")), ()))
            out.append(
                Stream(kind=kind, item_id=str(item.get("id")), received=received, final=final)
            )
        for item_id, pieces in deltas.items():  # deltas of an item that never completed
            out.append(Stream(kind="text", item_id=item_id, received="".join(pieces), final=None))
        return out

    def calls(self) -> list[dict[str, Any]]:
        calls = [
            i
            for i in self.items
            if i.get("type") == "function_call" and i.get("status", "completed") == "completed"
        ]
        if self.pending is not None:
            calls = [c for c in calls if c.get("call_id") in self.pending]
        return calls


def _delta_kind(event_type: str) -> str:
    return "text" if event_type == "response.output_text.delta" else "arguments"


def _final_text(item: dict[str, Any]) -> tuple[str | None, str]:
    """What an output item's deltas must add up to: ("text", a message's text) or
    ("arguments", a function call's); (None, "") for items that stream nothing."""
    if item.get("type") == "message":
        parts = item.get("content") or []
        return "text", "".join(
            str(p.get("text", "")) for p in parts if p.get("type") == "output_text"
        )
    if item.get("type") == "function_call":
        return "arguments", str(item.get("arguments", ""))
    return None, ""


def _describe(event: dict[str, Any]) -> str:
    if event.get("type") == "error":
        error = event.get("error") or event
        return f"error {error.get('code')}: {error.get('message')}"
    response = event.get("response") or {}
    detail = response.get("error") or response.get("incomplete_details")
    return f"{event.get('type')}: {detail}"


def _tool_output(call: dict[str, Any], spec: RolloutSpec, step: int) -> dict[str, Any]:
    return {
        "type": "function_call_output",
        "call_id": call["call_id"],
        "output": spec.scenario.tool_output(step),
    }


FINAL_NUDGE = "That was the last command. Answer now, without calling tools."


def _base_body(spec: RolloutSpec, turn: int, *, rollout: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": spec.model,
        "instructions": INSTRUCTIONS,
        "tools": list(spec.tools) if spec.tools is not None else spec.scenario.tools(),
        **dict(spec.body),
    }
    if spec.force_tool_choice and not rollout:
        body["tool_choice"] = (
            {"type": "function", "name": TOOL_NAME} if turn < spec.scenario.steps else "none"
        )
    return body


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _Transport:
    """One mode's way of sending a turn and reading its events."""

    mode: str
    # The conversation is over (ws-rollout's one response reached a terminal event): the
    # rollout ends there, whatever that response holds.
    ended: bool = False

    async def turn(
        self, index: int, new_input: list[dict[str, Any]], record: TurnRecord
    ) -> _TurnReader:
        raise NotImplementedError


class _HttpTransport(_Transport):
    def __init__(
        self, endpoint: Endpoint, spec: RolloutSpec, *, chain: bool, stack: AsyncExitStack
    ) -> None:
        self.mode = "http-chain" if chain else "http-stateless"
        self.endpoint = endpoint
        self.spec = spec
        self.chain = chain
        self.stack = stack
        self.history: list[dict[str, Any]] = []
        self.previous: str | None = None
        self.client: httpx.AsyncClient | None = None
        self.headers = {"content-type": "application/json", **endpoint.headers()}

    async def turn(
        self, index: int, new_input: list[dict[str, Any]], record: TurnRecord
    ) -> _TurnReader:
        body = _base_body(self.spec, index)
        body["stream"] = True
        if self.chain:
            body["input"] = new_input
            body["store"] = True
            if self.previous is not None:
                body["previous_response_id"] = self.previous
        else:
            self.history.extend(new_input)
            body["input"] = self.history
            body["store"] = False
        payload = _dumps(body).encode()
        reader = _TurnReader(record, self.mode, incomplete_ends=self.spec.incomplete_ends)
        if self.client is None:
            # http-stateless: a new connection per request (no keep-alive), as a stateless
            # client; http-chain keeps its connection. One client either way: creating an
            # httpx client costs more than a request (it builds an SSL context).
            limits = httpx.Limits(max_keepalive_connections=None if self.chain else 0)
            self.client = await self.stack.enter_async_context(
                httpx.AsyncClient(timeout=httpx.Timeout(self.spec.timeout), limits=limits)
            )
        record.sent = time.perf_counter()
        await self._post(self.client, payload, reader)
        if reader.response is None:
            raise ServerError(f"{self.mode}, turn {index}: the stream ended without a response")
        if self.chain:
            self.previous = reader.response.get("id")
        else:
            self.history.extend(reader.response.get("output") or reader.items)
        return reader

    async def _post(self, client: httpx.AsyncClient, payload: bytes, reader: _TurnReader) -> None:
        url = self.endpoint.responses_url
        async with client.stream("POST", url, content=payload, headers=self.headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:500]
                raise ServerError(
                    f"{self.mode}, turn {reader.turn.index}: HTTP {response.status_code}: {text}"
                )
            reader.turn.stages = parse_server_timing(response.headers.get("server-timing"))
            done = False
            decoder = SseDecoder()
            turn = reader.turn
            frames = turn.frames = [] if self.spec.keep_frames else None
            async for chunk in response.aiter_bytes():
                turn.bytes_in += len(chunk)
                for sse in decoder.feed(chunk):
                    if frames is not None:
                        frames.append(sse.data)
                    if not done and reader.feed(json.loads(sse.data), time.perf_counter()):
                        done = True  # read on to the end of the stream, keeping the connection


class _WsTransport(_Transport):
    def __init__(
        self, ws: WsSocket, spec: RolloutSpec, *, rollout: bool, store: bool = False
    ) -> None:
        self.mode = "ws-rollout" if rollout else "ws-chain-stored" if store else "ws-chain"
        self.socket = ws
        self.ws = WsClient(conn=ws, timeout=spec.timeout, strict=True)
        self.counts = ws.counts
        self.spec = spec
        self.rollout = rollout
        self.store = store
        self.previous: str | None = None
        self.response_id: str | None = None

    async def turn(
        self, index: int, new_input: list[dict[str, Any]], record: TurnRecord
    ) -> _TurnReader:
        if self.rollout and self.response_id is not None:
            message: dict[str, Any] = {
                "type": "response.append",
                "response_id": self.response_id,
                "input": new_input,
            }
        else:
            message = {
                "type": "response.create",
                **_base_body(self.spec, index, rollout=self.rollout),
            }
            message["input"] = new_input
            message["store"] = self.store
            if self.rollout:
                message["rollout"] = True
            elif self.previous is not None:
                message["previous_response_id"] = self.previous
        client = self.ws
        text = client.encode(message)
        reader = _TurnReader(record, self.mode, incomplete_ends=self.spec.incomplete_ends)
        before = self.counts.snapshot()
        now = record.sent = time.perf_counter()
        appended = message["type"] == "response.append"
        frames = record.frames = [] if self.spec.keep_frames else None
        socket = self.socket
        queued = socket.messages  # what each read completed (WsClient.next_event, inlined)
        try:
            await socket.send_message(text)
            while True:
                if not queued:
                    while not queued:
                        await socket.read()
                    now = time.perf_counter()  # when this read's messages arrived
                frame = queued.popleft()
                if frames is not None:
                    frames.append(frame if isinstance(frame, str) else frame.decode())
                event = json.loads(frame)
                client.follow(event)
                reader.feed(event, now)
                kind = event.get("type")
                if kind in _DELTAS:  # (no delta ends a turn: the connection would refuse it)
                    continue
                if self.rollout and kind == "response.done":
                    record.done_bytes = _payload_bytes(frame)
                elif appended and kind == "response.in_progress" and record.resume_bytes is None:
                    record.resume_bytes = _payload_bytes(frame)
                if not client.awaiting:  # completed, suspended, or refused
                    break
            record.wire = self.counts.since(before)
            record.bytes_in = record.wire.payload_in
        except ConnectionClosed as exc:
            raise ServerError(
                f"{self.mode}, turn {index}: the server closed the WebSocket ({exc.reason})"
            ) from None
        response = reader.response or {}
        if self.rollout:
            forced = self.spec.force_tool_choice  # a model that is not sim: it decides
            if reader.pending is None and index < self.spec.scenario.steps and not forced:
                raise ServerError(
                    f"{self.mode}, turn {index}: the server ended the rollout with "
                    "response.completed at a tool call (no rollout extension?)"
                )
            # A terminal event (not a suspension) ends the rollout, whatever it holds.
            self.ended = reader.pending is None
            self.response_id = response.get("id")
        else:
            self.previous = response.get("id")
        return reader


def _payload_bytes(frame: str | bytes) -> int:
    return len(frame) if isinstance(frame, bytes) else len(frame.encode())


def _transcript_entry(calls: list[dict[str, Any]], reader: _TurnReader) -> str:
    if calls:
        return "|".join(f"{c.get('name')}({c.get('arguments')})" for c in calls)
    texts = []
    for item in reader.items:
        if item.get("type") == "message":
            for part in item.get("content") or []:
                texts.append(str(part.get("text", "")))
    return "".join(texts)


async def run_rollout(
    mode: str, endpoint: Endpoint, spec: RolloutSpec, *, scrape: Scrape | None = None
) -> RolloutRecord:
    """Run the scenario's rollout once in `mode`. With `scrape`, /metrics counters are read
    before the first turn and after each turn, and each turn gets its deltas."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; the modes are {', '.join(MODES)}")
    record = RolloutRecord(mode=mode)
    spec.scenario.prepare(EXTRA_TURNS)  # the tool outputs, before the first turn's clock
    try:
        with trio.fail_after(spec.timeout):
            async with AsyncExitStack() as stack:
                transport: _Transport
                if mode.startswith("http"):
                    transport = _HttpTransport(
                        endpoint, spec, chain=mode == "http-chain", stack=stack
                    )
                else:
                    ws = await stack.enter_async_context(_open_ws(endpoint, timing=spec.timing))
                    transport = _WsTransport(
                        ws, spec, rollout=mode == "ws-rollout", store=mode == "ws-chain-stored"
                    )
                await _loop(transport, spec, record, scrape)
    # Foreign errors become ours at this boundary, naming the mode and the turn reached.
    except trio.TooSlowError:
        raise ServerError(
            f"{mode}: the rollout did not finish within {spec.timeout:g} s "
            f"(turn {len(record.turns)})"
        ) from None
    except (httpx.HTTPError, HandshakeError, ConnectionClosed, OSError) as exc:
        raise ServerError(
            f"{mode}, turn {len(record.turns)}: transport error: {_reason(exc)}"
        ) from None
    except ProtocolError as exc:  # the server broke the event order, or an oversized event
        raise ServerError(
            f"{mode}, turn {len(record.turns)}: the server broke the protocol: {exc}"
        ) from None
    except (ValueError, KeyError) as exc:  # undecodable JSON, an event missing its fields
        raise ServerError(
            f"{mode}, turn {len(record.turns)}: malformed answer from the server: {exc!r}"
        ) from None
    # After the rollout, off its clock: what arrived, counted and checked.
    check_streams(record, spec.counter)
    if spec.keep_frames:
        for turn in record.turns:
            measure_encoding(turn, sse=mode.startswith("http"))
    return record


def _open_ws(endpoint: Endpoint, *, timing: bool) -> AbstractAsyncContextManager[WsSocket]:
    """A WebSocket to the endpoint, offering permessage-deflate as the openai SDK and Codex
    do (the server decides)."""
    headers = [(k.encode(), v.encode()) for k, v in endpoint.headers().items()]
    if timing:
        headers.append((b"x-rollout-timing", b"1"))
    return open_bench_ws(
        endpoint.ws_url,
        extra_headers=headers,
        offer_deflate=True,
        max_message_size=CLIENT_MAX_MESSAGE_SIZE,
        receive_buffer_size=CLIENT_RECEIVE_BUFFER,
    )


async def probe_websocket(endpoint: Endpoint, limit: float = 60.0) -> tuple[bool | None, str]:
    """Whether the server has WebSocket mode, and accepts the client's permessage-deflate
    offer: (True or False, "") when the handshake succeeds, (None, why) when it does not."""
    try:
        with trio.fail_after(limit):
            async with _open_ws(endpoint, timing=False) as ws:
                return bool(ws.deflate), ""
    except trio.TooSlowError:
        return None, f"no WebSocket handshake within {limit:g} s"
    except ConnectionRejected as exc:
        said = _error_message(exc.body)
        return None, f"no WebSocket mode: the upgrade was answered HTTP {exc.status_code}" + (
            f": {said}" if said else ""
        )
    except (OSError, HandshakeError, ConnectionClosed) as exc:
        return None, f"no WebSocket mode: the handshake failed ({_reason(exc)})"


async def _loop(
    transport: _Transport, spec: RolloutSpec, record: RolloutRecord, scrape: Scrape | None
) -> None:
    scenario = spec.scenario
    before = await scrape() if scrape is not None else None
    new_input: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": scenario.prompt()}
    ]
    for index in range(scenario.turns + EXTRA_TURNS):
        turn = TurnRecord(index=index, sent=0.0)
        reader = await transport.turn(index, new_input, turn)
        turn.streams = reader.streams()
        if index == 0:
            record.started = turn.sent
        record.ended = turn.ended
        record.turns.append(turn)
        calls = reader.calls()
        turn.kind = "tool_call" if calls else "text"
        record.transcript.append(_transcript_entry(calls, reader))
        if scrape is not None and before is not None:
            after = await scrape()
            if after is not None:
                turn.counters = {k: v - before.get(k, 0) for k, v in after.items()}
                before = after
        if not calls or transport.ended:
            return
        if spec.run_tools:
            t0 = time.perf_counter()
            await trio.sleep(scenario.tool_latency_ms / 1000)
            record.tool_s += time.perf_counter() - t0
        new_input = [_tool_output(call, spec, index) for call in calls]
        if (
            spec.force_tool_choice
            and transport.mode == "ws-rollout"
            and index + 1 >= scenario.steps
        ):
            new_input.append({"type": "message", "role": "user", "content": FINAL_NUDGE})
    raise ServerError(
        f"{transport.mode}: the model made more than {scenario.turns + EXTRA_TURNS - 1} tool "
        "calls; is the scenario's model a `sim` model with `steps`?"
    )


async def probe_rollout_extension(
    endpoint: Endpoint, model: str, scenario: Scenario, limit: float = 60.0
) -> tuple[bool, str]:
    """Whether the server runs the rollout extension: a `rollout: true` create that is forced
    to call the tool must suspend with `response.done`. Returns (supported, why not)."""
    message = {
        "type": "response.create",
        "model": model,
        "instructions": INSTRUCTIONS,
        "tools": scenario.tools(),
        "tool_choice": {"type": "function", "name": TOOL_NAME},
        "input": [{"type": "message", "role": "user", "content": "probe"}],
        "store": False,
        "rollout": True,
    }
    try:
        with trio.fail_after(limit):
            async with _open_ws(endpoint, timing=False) as ws:
                client = WsClient(conn=ws, timeout=limit)
                await client.send(message)
                while True:
                    event = await client.next_event()
                    kind = event.get("type")
                    if kind == "response.done" and "pending_call_ids" in event:
                        return True, ""
                    if kind == "response.completed":
                        return False, "ignored `rollout: true` and completed at the tool call"
                    if kind in _FAILURES:
                        return False, f"answered {_describe(event)}"
    except trio.TooSlowError:
        return False, f"no answer within {limit:g}s"
    except (OSError, ConnectionClosed) as exc:
        return False, f"WebSocket failed: {_reason(exc)}"
    except Exception as exc:  # a handshake refusal and the like: report, don't crash
        return False, f"the WebSocket could not be opened: {_reason(exc)}"


def _error_message(body: bytes, limit: int = 120) -> str:
    """What an HTTP error body says (`error_fields`), cut to `limit` characters."""
    message = error_fields(body)[0]
    text = body.decode(errors="replace").strip() if not message else message
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(exc: BaseException) -> str:
    """An exception in words, with its cause when it says nothing itself (`_ws.py`'s
    `HandshakeError()` wrapping the `OSError` of a refused connection)."""
    text = str(exc)
    if not text and exc.__cause__ is not None:
        return _reason(exc.__cause__)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
