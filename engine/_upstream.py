"""A model backend that samples from an OpenAI-compatible `POST /v1/chat/completions` server
(vLLM, SGLang, llama.cpp's server, Ollama, a hosted endpoint, or another rollout).

Long because a remote model needs retries, error mapping, an incremental request body and a
streaming parser of its chunks, each tested against real servers.

- The conversation's chat messages are encoded once: a `ChatEncoder` lives in the lineage
  (`SampleRequest.derived`), so a follow-up encodes only its new items; earlier messages
  are joined into the body as bytes (the chat protocol itself forces re-sending them).
- Streaming (server-sent events) maps back to our sample events: text deltas, tool-call
  argument deltas, finish reasons (`length` -> incomplete), and the upstream's usage.
- Connect errors, connections dropped before any answer, and 5xx answers are retried before
  the first token; afterwards, or when the retries are spent, the response fails
  (`response.failed`) with the upstream's code and message, never a hang (connect, read and
  pool timeouts). Cancelling the response (our client went away) closes the upstream request.
- One bounded connection pool per backend, keep-alive, TCP_NODELAY (httpx on trio).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import stamina
import trio
from rollout.protocol import RESPONSE_ERROR_CODES, RemoteProtocolError, SseDecoder

from ._chat import ChatEncoder, ChatToolset, OpenCall
from ._errors import BackendError
from ._interfaces import (
    Finish,
    SampleEvent,
    SampleRequest,
    TextDelta,
    TextEnd,
    TextStart,
)

__all__ = ["UpstreamBackend", "UpstreamConfig", "UpstreamCounters"]

# The longest wait between two attempts, whatever the backoff doubling reaches (seconds).
MAX_RETRY_WAIT = 30.0
# The largest server-sent event accepted from an upstream (a chunk is a few hundred bytes).
MAX_UPSTREAM_LINE = 1 << 20
# After `data: [DONE]`, how long the rest of the body (the chunked encoding's end) is waited
# for, so the connection goes back to the pool; an upstream that holds it open longer gets it
# closed (seconds).
UPSTREAM_DRAIN_SECONDS = 1.0


@attrs.frozen(kw_only=True)
class UpstreamConfig:
    base_url: str  # e.g. http://127.0.0.1:8001/v1
    model: str  # the model name the upstream knows
    api_key_env: str | None = None  # environment variable holding the upstream's API key
    connect_timeout: float = 5.0
    read_timeout: float = 300.0  # the longest silence between two chunks
    retries: int = 2  # on connect errors and 5xx before the first token
    retry_backoff: float = 0.2  # seconds, doubled per retry
    max_connections: int = 64  # the pool's bound
    include_usage: bool = True  # ask for `stream_options.include_usage`


@attrs.define
class UpstreamCounters:
    requests: int = 0
    retries: int = 0
    failures: int = 0
    messages_encoded: int = 0
    # JSON encoded for request bodies: the conversation's messages (each once, the open
    # tool-call group each time) and each request's head (model, options, tools, system)
    message_bytes_encoded: int = 0
    head_bytes_encoded: int = 0
    bytes_sent: int = 0


class UpstreamBackend:
    """`count_tokens`: the model's own tokenizer (the models file's `tokenizer` key), which
    counts the output of a turn the upstream reports no usage for (see `_ChunkReader.end`)."""

    def __init__(
        self,
        config: UpstreamConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.config = config
        self.count_tokens = count_tokens
        self.counters = UpstreamCounters()
        self._transport = transport
        self._client: _Upstream | None = None
        self._key = f"chat:{id(self)}"

    def _http(self) -> _Upstream:
        if self._client is None:
            cfg = self.config
            transport = self._transport or httpx.AsyncHTTPTransport(
                limits=httpx.Limits(
                    max_connections=cfg.max_connections,
                    max_keepalive_connections=cfg.max_connections,
                ),
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            )
            headers = {"content-type": "application/json"}
            key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
            if key:
                headers["authorization"] = f"Bearer {key}"
            timeout = httpx.Timeout(
                connect=cfg.connect_timeout,
                read=cfg.read_timeout,
                write=cfg.read_timeout,
                pool=cfg.connect_timeout,
            )
            self._client = _Upstream(
                transport=transport,
                url=httpx.URL(cfg.base_url.rstrip("/") + "/chat/completions"),
                headers=headers,
                timeout=timeout.as_dict(),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.transport.aclose()
            self._client = None

    # --- request body ---
    def _encoder(self, request: SampleRequest) -> tuple[ChatEncoder, int]:
        """The conversation's encoder, its new items encoded, and its byte count before."""
        items = request.items
        derived = request.derived
        n = len(items)
        encoder = derived.get(self._key) if derived is not None else None
        if encoder is None or encoder.consumed > n:
            # No cache yet, or this state is older than the cache (a retry from an earlier
            # response): encode from scratch; keep it only when it can serve later turns.
            encoder = ChatEncoder()
            if derived is not None and self._key not in derived:
                derived[self._key] = encoder
        before = encoder.bytes_encoded
        self.counters.messages_encoded += encoder.extend(items, n)
        return encoder, before

    def body(self, request: SampleRequest, toolset: ChatToolset | None = None) -> bytes:
        """The request body (`body_chunks` joined)."""
        return b"".join(self.body_chunks(request, toolset))

    def body_chunks(
        self, request: SampleRequest, toolset: ChatToolset | None = None
    ) -> list[bytes]:
        """The request body as a few chunks: the head (model, options, tools, the system
        message), the conversation's messages as the encoder keeps them (encoded once, joined
        into a few segments: `ChatEncoder.body_chunks`), the closing brackets."""
        cfg = self.config
        encoder, before = self._encoder(request)
        messages = encoder.body_chunks()
        self.counters.message_bytes_encoded += encoder.bytes_encoded - before
        head: dict[str, Any] = {"model": cfg.model, "stream": True}
        if cfg.include_usage:
            head["stream_options"] = {"include_usage": True}
        if toolset is None:
            toolset = ChatToolset(request.tools, request.tool_choice)
        if toolset.definitions:
            head["tools"] = toolset.definitions
            head["tool_choice"] = toolset.choice
            head["parallel_tool_calls"] = request.parallel_tool_calls
        if request.temperature != 1.0:
            head["temperature"] = request.temperature
        if request.top_p != 1.0:
            head["top_p"] = request.top_p
        if request.max_output_tokens is not None:
            head["max_tokens"] = request.max_output_tokens
        fmt = request.text_format
        if fmt and fmt.get("type") == "json_schema":
            head["response_format"] = {
                "type": "json_schema",
                "json_schema": {k: v for k, v in fmt.items() if k != "type"},
            }
        prefix = json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode()
        opening = prefix[:-1] + b',"messages":['
        if request.instructions:
            system = json.dumps(
                {"role": "system", "content": request.instructions}, ensure_ascii=False
            ).encode()
            opening += system + b"," if messages else system
        self.counters.head_bytes_encoded += len(opening)
        return [opening, *messages, b"]}"]

    # --- sampling ---
    async def sample(self, request: SampleRequest) -> AsyncGenerator[SampleEvent, None]:
        toolset = ChatToolset(request.tools, request.tool_choice)
        started = time.perf_counter()
        # One copy of the body (~40 us for 0.5 MB): sent as one buffer it costs two writes
        # (headers, body); sent as the encoder's few chunks, a write per chunk, and each write to
        # a local model server cost more than the copy (measured: `bench/README.md`).
        data = b"".join(self.body_chunks(request, toolset))
        if request.observe is not None:
            request.observe("upstream_encode", time.perf_counter() - started)
        self.counters.bytes_sent += len(data)
        cfg = self.config
        # Retried (stamina: exponential backoff, no jitter) only before the first token: on
        # connect errors, a 5xx answer, or a reused connection dropped before any answer.
        retries = stamina.retry_context(
            on=_Retryable,
            attempts=cfg.retries + 1,
            timeout=None,
            wait_initial=cfg.retry_backoff,
            wait_max=MAX_RETRY_WAIT,
            wait_jitter=0,
            wait_exp_base=2,
        )
        try:
            async for attempt in retries:
                with attempt:
                    if attempt.num > 1:
                        self.counters.retries += 1
                    self.counters.requests += 1
                    body = _Body(data, request.observe)
                    async for event in self._attempt(body, toolset, request.max_output_tokens):
                        yield event
                    return
        except _Retryable as exc:  # the last attempt failed too
            self.counters.failures += 1
            raise BackendError(exc.message, code=exc.code) from None

    async def _attempt(
        self, body: _Body, toolset: ChatToolset, max_tokens: int | None
    ) -> AsyncGenerator[SampleEvent, None]:
        """One request to the upstream, streamed. Raises `_Retryable` for a failure before
        anything was received, `BackendError` for the rest. The stream is read to its end
        (`_parse_stream`) and closed before the turn's last events go up, so the connection is
        back in the pool before the response ends."""
        cfg = self.config
        answered = False  # response headers arrived
        reader = _ChunkReader(toolset, max_tokens, self.count_tokens)
        try:
            async with self._http().post(body) as resp:
                answered = True
                if resp.status_code >= 400:
                    message, code = await _error_of(resp)
                    shown = f"{resp.status_code} ({code})" if code else str(resp.status_code)
                    text = f"The upstream model server answered {shown}: {message}"
                    response_code = _response_code(code, resp.status_code)
                    if resp.status_code >= 500:
                        raise _Retryable(text, response_code)
                    self.counters.failures += 1
                    raise BackendError(text, code=response_code)
                async for event in _parse_stream(resp, reader):
                    yield event
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise _Retryable(
                f"Could not connect to the upstream model server at {cfg.base_url}: "
                f"{exc.__class__.__name__}"
            ) from None
        except httpx.TimeoutException as exc:
            self.counters.failures += 1
            raise BackendError(
                f"The upstream model server timed out ({exc.__class__.__name__})."
            ) from None
        except (httpx.HTTPError, httpx.StreamError) as exc:
            # Dropped before any answer (typically a keep-alive connection the upstream
            # closed as we reused it): nothing was received, so it is retried like a
            # connect error.
            if not answered and isinstance(exc, httpx.TransportError):
                raise _Retryable(
                    "The upstream closed the connection without answering: "
                    f"{exc.__class__.__name__}: {exc}"
                ) from None
            self.counters.failures += 1
            raise BackendError(
                f"The upstream stream broke: {exc.__class__.__name__}: {exc}"
            ) from None
        for event in reader.end(closed=not reader.done):
            yield event


@attrs.frozen(kw_only=True)
class _Upstream:
    """The upstream's connection pool (an httpx transport: keep-alive, TCP_NODELAY, bounded)
    and what every request to it carries. Requests go to the transport as they are: httpx's
    client layers (URL merging, cookies, auth and redirect flows, event hooks) cost ~0.2 ms a
    request and do nothing here; the transport maps errors to httpx's exceptions as before."""

    transport: httpx.AsyncBaseTransport
    url: httpx.URL
    headers: dict[str, str]
    timeout: dict[str, float | None]

    @asynccontextmanager
    async def post(self, body: _Body) -> AsyncIterator[httpx.Response]:
        request = httpx.Request(
            "POST",
            self.url,
            headers={**self.headers, "content-length": str(len(body.data))},
            content=body.stream(),
            extensions={"timeout": self.timeout},
        )
        response = await self.transport.handle_async_request(request)
        response.request = request
        try:
            yield response
        finally:
            await response.aclose()


@attrs.frozen
class _Body:
    """A request body, and when its last byte was handed to the socket (the `upstream_send`
    stage, from the request's start: the connection, the headers and the body)."""

    data: bytes
    observe: Callable[[str, float], None] | None
    started: float = attrs.field(factory=time.perf_counter)  # made as the request starts

    async def stream(self) -> AsyncIterator[bytes]:
        yield self.data
        if self.observe is not None:
            self.observe("upstream_send", time.perf_counter() - self.started)


def _response_code(code: str | None, status: int) -> str:
    """The `ResponseError.code` for an upstream failure: the upstream's own code when it is one
    the Responses API defines (rate limits, image errors, ...), else by status (the upstream's
    code stays in the message)."""
    if code in RESPONSE_ERROR_CODES:
        return code
    if status == 429:
        return "rate_limit_exceeded"
    return "server_error" if status >= 500 else "invalid_prompt"


class _Retryable(Exception):
    """A failure before anything was received: worth another attempt."""

    def __init__(self, message: str, code: str = "server_error") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


async def _error_of(resp: httpx.Response) -> tuple[str, str | None]:
    """(message, code) of an error answer: OpenAI's `{"error": {...}}`, vLLM's top-level
    `{"object": "error", "message", "code": 400}`, Ollama's `{"error": "..."}`, or raw text.
    Only a string code is kept (an integer one is the HTTP status again)."""
    raw = await resp.aread()
    text = raw[:200].decode(errors="replace")
    try:
        body = json.loads(raw)
        error = body.get("error", body)
        if isinstance(error, dict):
            code = error.get("code")
            return str(error.get("message") or text), code if isinstance(code, str) else None
        return str(error), None
    except (ValueError, AttributeError):
        return text, None


async def _parse_stream(resp: httpx.Response, reader: _ChunkReader) -> AsyncIterator[SampleEvent]:
    """Chat-completion chunks -> sample events, until `data: [DONE]` (`reader.done`) or the
    end of the stream; after `[DONE]`, what is left of the body (the chunked encoding's last
    chunk) is read, at most `MAX_UPSTREAM_LINE` bytes for `UPSTREAM_DRAIN_SECONDS`, so the
    connection can serve the next request. Raises BackendError on malformed chunks."""
    decoder = SseDecoder(max_event_size=MAX_UPSTREAM_LINE)
    body = resp.aiter_bytes()
    async for raw in body:
        try:
            events = decoder.feed(raw)
        except RemoteProtocolError:
            raise BackendError("The upstream sent an oversized chunk.") from None
        for sse in events:
            data = sse.data.strip()
            if data == "[DONE]":
                reader.done = True
                break
            try:
                for event in reader.chunk(json.loads(data)):
                    yield event
            except BackendError:
                raise
            except (ValueError, AttributeError, TypeError, KeyError) as exc:
                raise BackendError(f"The upstream sent a malformed chunk: {exc}") from None
        if reader.done:
            break
    if reader.done:
        with trio.move_on_after(UPSTREAM_DRAIN_SECONDS):
            left = 0
            async for raw in body:
                left += len(raw)
                if left > MAX_UPSTREAM_LINE:
                    break


class _ChunkReader:
    """The state of one chat-completions stream: the item open (text or a call), the finish
    reason and the usage, fed chunk by chunk. With `count_tokens` (the model's tokenizer), the
    turn's output text is kept as it streams, to be counted when the upstream reports no
    usage: each message's text, and each function call's name and arguments, each tokenized
    on its own."""

    def __init__(
        self,
        toolset: ChatToolset,
        max_tokens: int | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.toolset = toolset
        self.max_tokens = max_tokens
        self.count_tokens = count_tokens
        # The output's texts, when counted: one list of pieces per message text, call name,
        # call arguments (in stream order).
        self.texts: list[list[str]] | None = [] if count_tokens is not None else None
        self.open_kind: str | None = None  # "text" | "call"
        self.call: OpenCall | None = None
        self.call_index: int | None = None
        # The open function call's arguments as received (checked when it closes: a call cut
        # by the length limit, or a model's malformed JSON, never ends a response completed).
        self.arguments: list[str] = []
        self.escaper = ControlEscaper()
        self.broken_call = False
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False  # `data: [DONE]` arrived

    def chunk(self, chunk: dict[str, Any]) -> list[SampleEvent]:
        if chunk.get("error"):
            error = chunk["error"]
            code = error.get("code") if isinstance(error, dict) else None
            raise BackendError(
                f"The upstream failed mid-stream: {error.get('message', error)}",
                code=_response_code(code if isinstance(code, str) else None, 500),
            )
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return []
        choice = choices[0]
        delta = choice.get("delta") or {}
        out = self._text(delta.get("content"))
        for piece in delta.get("tool_calls") or []:
            out += self._call_piece(piece)
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        return out

    def _text(self, content: str | None) -> list[SampleEvent]:
        if not content:
            return []
        out: list[SampleEvent] = []
        if self.call is not None:
            out += self.call.end()
            self.call, self.open_kind = None, None
        if self.open_kind is None:
            out.append(TextStart())
            self.open_kind = "text"
            if self.texts is not None:
                self.texts.append([])
        if self.texts is not None:
            self.texts[-1].append(content)
        out.append(TextDelta(content, 1))
        return out

    def _call_piece(self, piece: dict[str, Any]) -> list[SampleEvent]:
        out: list[SampleEvent] = []
        index = piece.get("index", 0)
        function = piece.get("function") or {}
        if index != self.call_index:
            out += self._close()
            chat_name = str(function.get("name", ""))
            self.call = OpenCall(self.toolset.find(chat_name))
            self.arguments, self.escaper = [], ControlEscaper()
            out.append(self.call.start(chat_name))
            self.open_kind, self.call_index = "call", index
            if self.texts is not None:
                self.texts += [[chat_name], []]  # the name, then the arguments to come
        arguments = function.get("arguments")
        if arguments and self.texts is not None and self.open_kind == "call":
            self.texts[-1].append(str(arguments))
        if arguments and self.call is not None:
            arguments = self.escaper.feed(arguments)
            if self.call.buffered is None:
                self.arguments.append(arguments)
            more = self.call.delta(arguments)
            if more is not None:
                out.append(more)
        return out

    def _close(self) -> list[SampleEvent]:
        if self.open_kind == "text":
            return [TextEnd()]
        if self.call is not None:
            if self._open_call_broken():
                self.broken_call = True
            return list(self.call.end())
        return []

    def _open_call_broken(self) -> bool:
        """The open function call's arguments are not JSON (so far)."""
        call = self.call
        if call is None or self.open_kind != "call" or call.buffered is not None:
            return False
        return not _is_json("".join(self.arguments))

    def end(self, *, closed: bool) -> list[SampleEvent]:
        """The last events: the open item closed, then `Finish` with the upstream's usage."""
        if self.finish is None:
            raise BackendError(
                "The upstream stream ended before the answer finished"
                + (" (connection closed)" if closed else "")
                + "."
            )
        reason = {"length": "max_output_tokens", "tool_calls": "tool_calls"}.get(
            self.finish, "stop"
        )
        usage = self.usage
        if self.broken_call:  # a call before the last one: malformed, whatever the limit
            raise BackendError(_NOT_JSON)
        closing: list[SampleEvent] = []
        if self._open_call_broken():
            produced = usage.get("completion_tokens") if usage else None
            cut = reason == "max_output_tokens" or (
                self.max_tokens is not None
                and isinstance(produced, int)
                and produced >= self.max_tokens
            )
            if not cut:  # malformed, not by the length limit (whatever the finish says)
                raise BackendError(_NOT_JSON)
            # Cut by the limit (llama-cpp-python says "tool_calls" even then): the call stays
            # open, and the response ends incomplete with it (closed `incomplete`).
            reason = "max_output_tokens"
        else:
            closing = self._close()
        details = (usage or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        reported = usage.get("completion_tokens") if usage else None
        output = reported if isinstance(reported, int) else self._counted()
        finish = Finish(
            reason,  # type: ignore[arg-type]
            input_tokens=usage.get("prompt_tokens") if usage else None,
            output_tokens=output,
            cached_tokens=cached if isinstance(cached, int) else None,
            estimated=output is None,
        )
        return [*closing, finish]

    def _counted(self) -> int | None:
        """The output's tokens by the model's tokenizer (None without one): each text of
        `texts` encoded on its own. Not counted: what the model writes around a call (its
        markers, the JSON of name and arguments together) and the end-of-turn token."""
        if self.count_tokens is None or self.texts is None:
            return None
        return sum(self.count_tokens("".join(pieces)) for pieces in self.texts)


_NOT_JSON = "The upstream model's tool call arguments are not valid JSON."
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


class ControlEscaper:
    """Escapes raw control characters inside the JSON strings of a call's streamed arguments,
    across pieces. JSON forbids them, but llama-cpp-python's grammar lets a model write a raw
    newline in a string (seen with SmolLM2 and a string with a `maxLength`: the command ended
    with a line break before its closing quote): escaped, the arguments are the JSON the
    model meant, and every delta and the final arguments agree. Everything else passes
    unchanged."""

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False  # the previous character, in a string, was a backslash

    def feed(self, piece: str) -> str:
        out: list[str] = []
        for c in piece:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                elif c < " ":
                    out.append(_ESCAPES.get(c) or f"\\u{ord(c):04x}")
                    continue
            elif c == '"':
                self.in_string = True
            out.append(c)
        return "".join(out)


def _is_json(text: str) -> bool:
    """Valid JSON, or nothing (a call of a tool without parameters)."""
    if not text.strip():
        return True
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
