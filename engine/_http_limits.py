"""What a TCP peer can hold of the server, bounded below the app: connections, descriptors,
idle and body time, header bytes, HTTP/2, and the HTTP/1.1 framing hypercorn lets through.

Long because each bound needs its own hook into hypercorn's h11 and h2 protocols and its TCP
server, which offer no public place for them.

hypercorn (0.17, 0.18) accepts every connection trio's listener hands it, serves HTTP/2 to
any client that asks for it (an `Upgrade: h2c` request, or the HTTP/2 preface on a plain
port), reads a request's body for as long as the client takes, accepts a request with both
`Content-Length` and `Transfer-Encoding` (h11 reads it by the latter and keeps the connection
open, which RFC 9112 6.1 forbids: a smuggled request would be answered), bounds header bytes
only while they are incomplete (a 70 KB header block arriving in one read passes a 64 KB
bound), and trio's accept loop logs every `EMFILE` with a traceback ten times a second. Here:

- **connections**: at most `max_tcp_connections` TCP connections at once, HTTP and WebSocket
  alike (`TransportStats.open_tcp`, the gauge `rollout_open_tcp_connections`), fitted under
  the process's descriptor limit (`fit_connection_cap`, which raises the soft `RLIMIT_NOFILE`
  towards the hard one first and keeps `FD_RESERVE` descriptors for the store, the logs and
  the models). One past the cap is answered `503 too_many_connections` with
  `Connection: close` and closed (refusal `max_tcp_connections`); at most `MAX_REFUSING`
  refusals linger at once (each up to `REFUSAL_LINGER` s reading what the client sent, so its
  close is not a reset that loses the answer), more are reset at once. Descriptors exhausted
  anyway (another process's, a file) make trio's accept loop back off 0.1 s per try; its log
  line is let through at most once per `ACCEPT_ERROR_LOG_INTERVAL` seconds, without the
  traceback (refusal `descriptors`, counted per try).
- **idle**: hypercorn closes a connection with no request in progress after
  `keep_alive_timeout` seconds; a request's headers are not "in progress" until they are
  complete, so the same clock bounds a slow header block (`slowloris`) and the idle time
  between two requests (timeout phase `keep_alive`, or `headers` when part of a request had
  arrived).
- **body**: `BodyClock` wraps an HTTP request's ASGI `receive` in the app: the body must
  arrive within `body_timeout` seconds of the headers plus one second per `body_min_rate`
  bytes received (Apache's `mod_reqtimeout` rule), or the request gets
  `408 request_timeout` and its connection is closed (timeout phase `body`). HTTP/2 streams
  read their bodies through the same wrapper. A body ends with the message that brings its
  `Content-Length`'s last byte, not with hypercorn's empty message after it.
- **framing** (HTTP/1.1, `BoundedH11Protocol`): both `Content-Length` and
  `Transfer-Encoding` is a 400 and the connection closes; a header block over
  `max_header_bytes` is a 431 however it arrived; hypercorn's own refusals (h11's parse
  errors) carry an OpenAI-shaped body instead of an empty one.
- **HTTP/2** is off unless `http2` (`rollout serve --http2`): an `Upgrade: h2c` request is
  served as the HTTP/1.1 request it also is (the upgrade is not negotiated, as RFC 9110 7.8
  allows), and a client sending the HTTP/2 preface gets the server's SETTINGS and a GOAWAY
  with `HTTP_1_1_REQUIRED` (RFC 9113 7), then the connection closes. On, each connection
  has at most `h2_max_streams` concurrent streams and `max_header_bytes` of headers, each
  stream's body is bounded like an HTTP/1.1 one (size, `BodyClock`), and the streams of a
  connection that drops mid-body end at once (`BoundedH2Protocol` releases their send
  buffers, on which hypercorn left them waiting until shutdown).
- **the TCP server** (`BoundedTCPServer`): it reads up to 1 MiB at a time into warm memory
  (`_read.py`: a large body that has arrived is one read, not nine), and hands a request's
  head to hypercorn by itself, cut from what followed it in the read (`_hand_over`,
  `HEAD_READ`: a WebSocket's handshake is seen before the frames sent behind it, which then
  meet the deflate pace; a body then reaches h11 whole, as the bytes read); its EOF is sent
  under the connection's send lock
  (pipelined requests met `trio.BusyResourceError` in the app otherwise), and a WebSocket
  that negotiated permessage-deflate is handed its bytes `INFLATE_READ` at a time, each
  after the server's inflation pace, so one turn of the event loop inflates at most ~1 MiB
  of a compression bomb and the server at most its pace (`_ws_deflate.py`).

`bound_transport()` installs it (idempotent patches of hypercorn's `ProtocolWrapper` and trio
`worker_serve`'s `TCPServer` and of trio's accept logger), inert unless the server's hypercorn
config is a `HypercornConfig` with `transport` set: other hypercorn servers in the process
keep hypercorn's behaviour. `tests/test_hostile_transport.py` pins the hypercorn names this
relies on and tests each bound against a real `rollout serve` process.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import math
import resource
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import attrs
import h11
import trio

from ._read import read_cut, read_some

__all__ = [
    "ACCEPT_ERROR_LOG_INTERVAL",
    "DEFAULT_BODY_MIN_RATE",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_H2_MAX_STREAMS",
    "DEFAULT_HTTP2",
    "DEFAULT_KEEP_ALIVE_TIMEOUT",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_TCP_CONNECTIONS",
    "BodyClock",
    "TransportLimits",
    "TransportStats",
    "bound_transport",
    "content_length",
    "fit_connection_cap",
]

log = logging.getLogger("rollout.server")

# TCP connections at once, HTTP and WebSocket: twice the WebSocket cap (`--max-connections`,
# 1,024), so HTTP clients still get in when every WebSocket place is taken; well under the
# 65,536 descriptors of a typical hard limit (and fitted under the soft one at start-up).
DEFAULT_MAX_TCP_CONNECTIONS = 2048
# Descriptors kept out of the connection cap: the SQLite files and their journals, the
# listening socket, logs, a model file, PostgreSQL connections, the worker threads' pipes.
FD_RESERVE = 64
# Seconds a connection may stay without a request in progress (between requests, or before a
# request's headers are complete): hypercorn's default, short enough that idle keep-alive
# connections do not pile up against the cap.
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0
# A request body must arrive within this many seconds after its headers, plus one second per
# `DEFAULT_BODY_MIN_RATE` bytes: a 64 MiB body (the message limit) may take up to ~70 minutes
# at the minimum rate, a client that sends nothing is answered 408 after 30 s.
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_BODY_MIN_RATE = 16384  # bytes per second: 128 kbit/s, a poor mobile link
# Header bytes of one request (names and values, as h11 counts its incomplete-event limit):
# nginx's default large_client_header_buffers is 4 x 8 KB; 64 KiB leaves room for long
# cookies and tokens.
DEFAULT_MAX_HEADER_BYTES = 65536
DEFAULT_HTTP2 = False  # the API's clients speak HTTP/1.1 (and WebSocket over it)
# Concurrent streams of one HTTP/2 connection (SETTINGS_MAX_CONCURRENT_STREAMS): hypercorn's
# and the RFC's recommended minimum.
DEFAULT_H2_MAX_STREAMS = 100
# How often the log says the process is out of descriptors while it is (trio retries the
# accept every 0.1 s, each try a traceback: 559 lines in one measured attack).
ACCEPT_ERROR_LOG_INTERVAL = 10.0
# A refused connection: how long its request is read (and dropped) after the 503 before the
# close, so the client reads the answer instead of a reset; and how many may linger so at
# once (more are reset at once: a flood of refusals must not hold descriptors itself).
REFUSAL_LINGER = 1.0
MAX_REFUSING = 256
REFUSAL_READ = 65536  # bytes read per try while lingering
# Bytes handed at a time to a WebSocket that negotiated permessage-deflate (hypercorn reads
# 64 KiB): what one turn of the event loop may inflate is ~1,000 times this, ~3 ms of CPU
# (see `BoundedTCPServer._read_data`). Measured with a 40-socket bomb beside a client polling
# every 0.5 s: 64 KiB reads, worst latency 0.8-1.7 s; 4 KiB, 0.7-1.7 s; 1 KiB, under 1 s.
INFLATE_READ = 1024

_LINGER_RESET = struct.pack("ii", 1, 0)


@attrs.frozen(kw_only=True)
class TransportLimits:
    max_tcp_connections: int = DEFAULT_MAX_TCP_CONNECTIONS
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    http2: bool = DEFAULT_HTTP2
    h2_max_streams: int = DEFAULT_H2_MAX_STREAMS


@attrs.define
class TransportStats:
    """What the transport counts (the app's /metrics reads it): open TCP connections, the
    connections refused by reason, the timeouts by phase."""

    open_tcp: int = 0
    refusing: int = 0  # refused connections lingering (`REFUSAL_LINGER`)
    refusals: collections.Counter[str] = attrs.field(factory=collections.Counter)
    timeouts: collections.Counter[str] = attrs.field(factory=collections.Counter)


def fit_connection_cap(requested: int, reserve: int = FD_RESERVE) -> int:
    """The connection cap that fits the process's descriptor limit: the soft `RLIMIT_NOFILE`
    is raised (towards the hard limit) to hold `requested` connections and `reserve` other
    descriptors; where it cannot, the cap is lowered to what fits (logged once)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = requested + reserve
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return requested
    fitted = max(1, soft - reserve)
    log.warning(
        "--max-tcp-connections %d does not fit the descriptor limit (%d, hard %s): serving "
        "at most %d connections; raise the limit (ulimit -n) to serve more",
        requested,
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        fitted,
    )
    return fitted


class BodyClock:
    """An HTTP request's ASGI `receive`, with the body's deadline: `timeout` seconds after
    the first call (the headers are in), plus one second per `min_rate` bytes received. Past
    it, `on_timeout()` is called and the read raises what it returns; once the body is
    complete, `receive` passes through (a streamed response waits on `http.disconnect`).

    With the request's `Content-Length` (`length`), the message that brings the body's last
    byte says so (`more_body` false): hypercorn sends the end of a body as a message of its
    own, which cost the app another wait on its queue, behind the reader's next turn (the
    `receive` stage of a 0.55 MB body 0.17-0.18 ms with it, 0.07-0.08 without; of a small
    one 0.10-0.11 and 0.06-0.07: `bench/README.md`); that empty message is passed over when it
    comes."""

    def __init__(
        self,
        receive: Callable[[], Awaitable[dict[str, Any]]],
        *,
        timeout: float,
        min_rate: float,
        on_timeout: Callable[[], Exception],
        length: int | None = None,
    ) -> None:
        self._receive = receive
        self._timeout = timeout
        self._min_rate = min_rate
        self._on_timeout = on_timeout
        self._length = length
        self._started: float | None = None
        self._received = 0
        self._complete = False
        self._end_pending = False  # hypercorn's end-of-body message, not yet passed over

    async def __call__(self) -> dict[str, Any]:
        if self._complete:
            message = await self._receive()
            if self._end_pending:
                self._end_pending = False
                if _is_end(message):
                    message = await self._receive()
            return message
        if not math.isfinite(self._timeout):
            return self._seen(await self._receive())
        if self._started is None:
            self._started = trio.current_time()
        deadline = self._started + self._timeout + self._received / self._min_rate
        with trio.move_on_at(deadline):
            return self._seen(await self._receive())
        raise self._on_timeout()

    def _seen(self, message: dict[str, Any]) -> dict[str, Any]:
        self._received += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._complete = True
        elif self._received == self._length:
            self._complete = self._end_pending = True
            message = {**message, "more_body": False}
        return message


def content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """A request's `Content-Length` from its headers (an ASGI scope's, or h11's), when it has
    one; None without one (a chunked body) or with a value that is not one number (h11 and h2
    have held the body to a valid one)."""
    found: int | None = None
    for name, value in headers:
        if name.lower() == b"content-length":
            if found is not None or not value.isdigit():
                return None
            found = int(value)
    return found


def _is_end(message: dict[str, Any]) -> bool:
    """hypercorn's message for the end of a request body: empty, no more to come."""
    return (
        message["type"] == "http.request"
        and not message.get("body")
        and not message.get("more_body", False)
    )


# --- accept errors -----------------------------------------------------------------------


class _AcceptErrorFilter(logging.Filter):
    """trio's accept loop (`trio.serve_listeners`): out of descriptors it logs an error with a
    traceback every 0.1 s. Let one line through per `ACCEPT_ERROR_LOG_INTERVAL`, without the
    traceback, saying how many tries failed since; count each try."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: TransportStats | None = None
        self._last = -math.inf
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.stats is not None:
            self.stats.refusals["descriptors"] += 1
        now = time.monotonic()
        if now - self._last < ACCEPT_ERROR_LOG_INTERVAL:
            self._suppressed += 1
            return False
        self._last = now
        exc = record.exc_info[1] if record.exc_info else None
        # any exception: an OSError's errno
        reason = errno.errorcode.get(getattr(exc, "errno", 0) or 0, "an error")
        record.msg = (
            "cannot accept connections (%s: out of descriptors or memory); retrying, "
            "%d failed tries since the last such line"
        )
        record.args = (reason, self._suppressed)
        record.exc_info = None
        record.exc_text = None
        self._suppressed = 0
        return True


_accept_filter = _AcceptErrorFilter()


# --- refusing a connection past the cap ----------------------------------------------------


def _refusal(open_tcp: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"This server has {open_tcp} open connections, its limit; retry later.",
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n%s"
    ) % (len(body), body)


async def _refuse(stream: Any, stats: TransportStats) -> None:
    """Answer 503 and close: the request is read (and dropped) for up to `REFUSAL_LINGER`
    seconds after the answer so the close is not a reset; past `MAX_REFUSING` lingering
    refusals, the connection is reset at once."""
    # hypercorn's private internals, typed by neither it nor us
    sock = getattr(stream, "socket", None)
    if stats.refusing >= MAX_REFUSING:
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            except OSError:
                pass
        await stream.aclose()
        return
    stats.refusing += 1
    try:
        with trio.move_on_after(REFUSAL_LINGER):
            await stream.send_all(_refusal(stats.open_tcp))
            await stream.send_eof()
            while await stream.receive_some(REFUSAL_READ):
                pass
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        stats.refusing -= 1
        await stream.aclose()


# --- HTTP/1.1 framing ------------------------------------------------------------------------

# hypercorn's refusals of a request h11 cannot serve, with an OpenAI-shaped body.
_REFUSALS = {
    400: ("invalid_request", "The request is not valid HTTP/1.1 ({detail})."),
    431: (
        "request_header_fields_too_large",
        "The request's headers are larger than this server's limit of {limit} bytes.",
    ),
}


def _error_payload(status: int, detail: str, limit: int) -> bytes:
    code, message = _REFUSALS.get(status, ("invalid_request", "The request was refused."))
    return json.dumps(
        {
            "error": {
                "message": message.format(detail=detail, limit=limit),
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()


def _header_bytes(headers: Any) -> int:
    return sum(len(name) + len(value) for name, value in headers)


def _bounded_h11_protocol(base: type[Any]) -> type[Any]:
    """hypercorn's `H11Protocol` with rollout's framing rules (see the module docstring)."""
    import h11
    from hypercorn.events import Closed, RawData
    from hypercorn.protocol.h11 import H2ProtocolAssumedError

    class StrictConnection(h11.Connection):
        """h11's server connection, refusing after parsing what h11 accepts: both framing
        headers (400), a header block over the limit that arrived at once (431)."""

        max_header_bytes = DEFAULT_MAX_HEADER_BYTES

        refusal_detail = ""

        def next_event(self) -> Any:
            try:
                event = super().next_event()
            except h11.RemoteProtocolError as exc:
                self.refusal_detail = str(exc)
                raise
            if isinstance(event, h11.Request):
                names = {name for name, _ in event.headers}
                if b"content-length" in names and b"transfer-encoding" in names:
                    self.refusal_detail = "both Content-Length and Transfer-Encoding"
                    raise h11.RemoteProtocolError(
                        "both Content-Length and Transfer-Encoding", error_status_hint=400
                    )
                if _header_bytes(event.headers) > self.max_header_bytes:
                    raise h11.RemoteProtocolError("header block too large", error_status_hint=431)
            return event

    class BoundedH11Protocol(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # our setting on hypercorn's Config (a plain Config lacks it)
            limits: TransportLimits | None = getattr(self.config, "transport", None)
            self._limits = limits
            self._refused = False
            if limits is not None:
                connection = StrictConnection(
                    h11.SERVER, max_incomplete_event_size=limits.max_header_bytes
                )
                connection.max_header_bytes = limits.max_header_bytes
                self.connection = connection

        async def handle(self, event: Any) -> None:
            if self._refused:
                return
            await super().handle(event)

        async def _check_protocol(self, event: Any) -> None:
            limits = self._limits
            if limits is None or limits.http2:
                await super()._check_protocol(event)
                return
            if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
                # The HTTP/2 preface on a server without HTTP/2: its SETTINGS, then GOAWAY
                # HTTP_1_1_REQUIRED (the client's h2 library reports it), then close.
                self._refused = True
                await self.send(RawData(data=_goaway_http_1_1_required()))
                await self.send(Closed())
                raise H2ProtocolAssumedError(b"")  # (`ProtocolWrapper` lets it go: see below)
            # An `Upgrade: h2c` request is served as the HTTP/1.1 request it also is.

        async def _send_error_response(self, status_code: int) -> None:
            if self._limits is None:
                await super()._send_error_response(status_code)
                return
            # ours, on the bounded h11 connection
            detail = getattr(self.connection, "refusal_detail", "") or "malformed"
            payload = _error_payload(status_code, detail, self._limits.max_header_bytes)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(payload)),
                (b"connection", b"close"),
                *self.config.response_headers("h11"),
            ]
            await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
            await self._send_h11_event(h11.Data(data=payload))
            await self._send_h11_event(h11.EndOfMessage())

    return BoundedH11Protocol


def _bounded_h2_protocol(base: type[Any]) -> type[Any]:
    """hypercorn's `H2Protocol`, releasing every stream's send buffer when its connection
    closes. hypercorn's sender task stops at the close, and a stream's app still writing (an
    answer to the `http.disconnect` it was just told, say) waited forever on a buffer no task
    drained: every request whose connection dropped mid-body stayed, with what it had read,
    until the server stopped (measured: 50 of 50)."""
    from hypercorn.events import Closed

    class BoundedH2Protocol(base):  # type: ignore[misc]
        async def handle(self, event: Any) -> None:
            # our setting on hypercorn's Config (a plain Config lacks it)
            if isinstance(event, Closed) and getattr(self.config, "transport", None) is not None:
                for buffer in list(self.stream_buffers.values()):
                    await buffer.close()  # (wakes a writer waiting on it; refuses more)
            await super().handle(event)

    return BoundedH2Protocol


def _goaway_http_1_1_required() -> bytes:
    import h2.config
    import h2.connection
    import h2.errors

    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    connection.initiate_connection()
    connection.close_connection(error_code=h2.errors.ErrorCodes.HTTP_1_1_REQUIRED)
    return connection.data_to_send()


# --- installing it -----------------------------------------------------------------------


def bound_transport() -> None:
    """Install the bounds of this module into hypercorn (see the module docstring): inert for
    servers whose config has no `transport`. Idempotent."""
    import hypercorn.protocol as protocol_module
    import hypercorn.trio.run as run_module
    from hypercorn.events import Closed, RawData
    from hypercorn.protocol.h11 import H2ProtocolAssumedError
    from hypercorn.trio.tcp_server import TCPServer

    # getattr by name: hypercorn's modules are untyped (and our mark on the patched class)
    if getattr(getattr(run_module, "TCPServer"), "_rollout_bounded", False):  # noqa: B009
        return
    logging.getLogger("trio.serve_listeners").addFilter(_accept_filter)

    bounded_h11 = _bounded_h11_protocol(getattr(protocol_module, "H11Protocol"))  # noqa: B009
    bounded_h2 = _bounded_h2_protocol(getattr(protocol_module, "H2Protocol"))  # noqa: B009
    original_handle = protocol_module.ProtocolWrapper.handle

    async def wrapper_handle(self: Any, event: Any) -> None:
        protocol = self.protocol
        # hypercorn's private internals, typed by neither it nor us
        limits = getattr(protocol, "_limits", None)
        if limits is None or limits.http2:
            await original_handle(self, event)
            return
        # HTTP/2 off: the error the protocol raises to stop after refusing the preface must
        # not become hypercorn's switch to HTTP/2.
        try:
            await protocol.handle(event)
        except H2ProtocolAssumedError:
            pass

    setattr(protocol_module, "H11Protocol", bounded_h11)  # noqa: B010
    setattr(protocol_module, "H2Protocol", bounded_h2)  # noqa: B010
    protocol_module.ProtocolWrapper.handle = wrapper_handle  # type: ignore[method-assign]

    class BoundedTCPServer(TCPServer):
        """hypercorn's TCP server, counted against the cap; past it, refused (503)."""

        async def run(self) -> None:
            # our setting on hypercorn's Config (a plain Config lacks it)
            stats: TransportStats | None = getattr(self.config, "transport_stats", None)
            limits: TransportLimits | None = getattr(self.config, "transport", None)
            if stats is None or limits is None:
                await super().run()
                return
            if stats.open_tcp >= limits.max_tcp_connections:
                stats.refusals["max_tcp_connections"] += 1
                await _refuse(self.stream, stats)
                return
            stats.open_tcp += 1
            try:
                await super().run()
            finally:
                stats.open_tcp -= 1

        async def _close(self) -> None:
            """hypercorn's close (half-close, then close) with the EOF sent under the
            connection's `send_lock`: unlocked, a response written as the connection closed
            (a pipelined request's, as keep_alive_max_requests ends it) met the EOF's send in
            progress and failed with `trio.BusyResourceError` in the app. Under the lock it
            waits for the EOF, then finds the stream broken (hypercorn's `Closed`). With a
            write in progress (a peer that does not read), no EOF: the close ends the write."""
            # our setting on hypercorn's Config (a plain Config lacks it)
            if getattr(self.config, "transport", None) is None:
                await super()._close()
                return
            if not self.send_lock.locked():
                async with self.send_lock:
                    try:
                        await self.stream.send_eof()
                    except (
                        trio.BrokenResourceError,
                        AttributeError,
                        trio.BusyResourceError,
                        trio.ClosedResourceError,
                    ):
                        pass  # gone already, or a TLS stream
            await self.stream.aclose()

        async def _read_data(self) -> None:
            """hypercorn's reader, reading up to 1 MiB a read into warm memory (`_read.py`),
            a request's head cut from what follows it in the read (`read_cut`, `_head_end`),
            each handed on by `_hand_over`."""
            # our setting on hypercorn's Config (a plain Config lacks it)
            if getattr(self.config, "transport", None) is None:
                await super()._read_data()
                return
            while True:
                try:
                    with trio.fail_after(self.config.read_timeout or math.inf):
                        if _waits_for_head(self.protocol):
                            data, rest = await read_cut(self.stream, _head_end)
                        else:
                            data, rest = await read_some(self.stream), b""
                except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                    break
                if data == b"":
                    await self.protocol.handle(RawData(b""))
                    break
                await self._hand_over(data)
                if rest:
                    await self._hand_over(rest)
            await self.protocol.handle(Closed())

        async def _hand_over(self, data: bytes) -> None:
            """`data` to the protocol, in the pieces its state asks for:
            - while an HTTP/1.1 connection waits for a request's head, up to the head's end
              (at most `HEAD_READ`), so what follows a head reaches the protocol in a later
              call, after the head has set its state;
            - once a WebSocket negotiated permessage-deflate (`_ws_deflate.py` marks it as the
              app accepts the handshake), `INFLATE_READ` at a time, each after the server's
              inflation pace (`InflatePace`): a 64 KiB read of a compression bomb inflates to
              64 MiB in one turn of the event loop (~0.2 s of it), 1 KiB to 1 MiB (~3 ms), so
              other clients are served between pieces. Frames sent behind the handshake reach
              a later call than the handshake, where the pace is decided (hypercorn refuses
              frames that come before the app accepts);
            - otherwise (a body, frames, HTTP/2) whole."""
            start = 0
            while start < len(data):
                # ours, set on connections that negotiated deflate
                inflater = getattr(self, "rollout_inflater", None)
                if inflater is not None and inflater.enabled():
                    await inflater.pace()  # at most the server's pace (`InflatePace`)
                    end = start + INFLATE_READ
                elif _waits_for_head(self.protocol):
                    end = _head_end(data, len(data), start)
                else:
                    end = len(data)
                whole = start == 0 and end >= len(data)
                await self.protocol.handle(RawData(data if whole else data[start:end]))
                start = end

        async def _idle_timeout(self) -> None:
            # our setting on hypercorn's Config (a plain Config lacks it)
            stats: TransportStats | None = getattr(self.config, "transport_stats", None)
            with trio.move_on_after(self.config.keep_alive_timeout):
                await self.context.terminated.wait()
            if stats is not None and not self.context.terminated.is_set():
                stats.timeouts[_idle_phase(self)] += 1
            with trio.CancelScope(shield=True):
                await self._initiate_server_close()

    BoundedTCPServer._rollout_bounded = True  # type: ignore[attr-defined]
    setattr(run_module, "TCPServer", BoundedTCPServer)  # noqa: B010


# The most of a request's head handed to the protocol at once (hypercorn's own read size),
# when its end is not found sooner: what follows a head in it reaches the protocol in the same
# call (see `_hand_over`). 64 KiB of a deflate bomb inflates to 64 MiB, ~0.2 s of the loop.
HEAD_READ = 1 << 16
HEAD_END = b"\r\n\r\n"


def _waits_for_head(wrapper: Any) -> bool:
    """Whether an HTTP/1.1 connection waits for a request's head (h11 not reading a body, not
    upgraded to a WebSocket); not for HTTP/2."""
    # hypercorn's ProtocolWrapper.protocol (H11Protocol) and its h11 connection; once upgraded
    # to a WebSocket, hypercorn's pass-through connection instead (not an h11.Connection)
    connection = getattr(getattr(wrapper, "protocol", None), "connection", None)
    return isinstance(connection, h11.Connection) and connection.their_state is not h11.SEND_BODY


def _head_end(data: bytes | bytearray, size: int, start: int = 0) -> int:
    """Where the request head starting at `start` in `data` (of which `size` bytes count)
    ends: after its blank line, looked for in at most `HEAD_READ` bytes; else `HEAD_READ` on
    (h11 also takes a head ending in bare LFs, which is then handed on in such pieces)."""
    stop = min(size, start + HEAD_READ)
    end = data.find(HEAD_END, start, stop)
    return end + len(HEAD_END) if end >= 0 else stop


def _idle_phase(server: Any) -> str:
    """`headers` when part of a request had arrived when the idle clock ran out, else
    `keep_alive`."""
    # hypercorn's private internals, typed by neither it nor us
    protocol = getattr(getattr(server, "protocol", None), "protocol", None)
    connection = getattr(protocol, "connection", None)
    pending = getattr(connection, "trailing_data", (b"", False))[0]
    return "headers" if pending else "keep_alive"


def watch_accept_errors(stats: TransportStats) -> None:
    """Count accept failures (out of descriptors) in `stats` (the latest server's)."""
    _accept_filter.stats = stats
