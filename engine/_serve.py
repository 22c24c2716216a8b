"""`rollout serve`: the engine on hypercorn's trio worker, HTTP and WebSocket on one port.

Long because starting a server is many small steps: the configuration, binding, the durable
store and ledger (SQLite or PostgreSQL), signals and the shutdown's messages, each with its one-
line failure.

`serve(config)` binds the port first (a `StartupError` if it cannot, with nothing opened), then
opens the store and usage ledger (SQLite files in `data_dir`, or the PostgreSQL database at
`store_url`, which several instances share), the engine, and the ASGI app, and serves until
SIGINT/SIGTERM (or `shutdown_trigger`). Shutdown is graceful: stop accepting, let in-flight
responses finish within `graceful_timeout` (then interrupt them: each ends `incomplete`,
reason `server_shutdown`, with the output that streamed and the usage recorded, stored like any
response), close idle WebSocket connections with 1001, and flush the ledger; a second SIGINT/SIGTERM
(Ctrl-C again) ends the grace period at once. Each step is one log line: the signal, how many
responses it waits for and how long (`stopping_message`), and the interruption
(`interrupting_message`). `open_server(config)` does the same in the background for tests and
embedding, and yields the base URL (`http://host:port/v1`). One process of `rollout serve
--workers N` is a `serve` on a socket it bound with `SO_REUSEPORT` (`listen_fd`; see
`_workers.py`).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import socket
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
from rollout.protocol import DEFAULT_MAX_MESSAGE_SIZE

from ._app import DEFAULT_KEY_CONNECTION_SHARE, DEFAULT_MAX_CONNECTIONS, AppConfig, RolloutApp
from ._defaults import default_registry
from ._deflate import DEFAULT_WEBSOCKET_DEFLATE, HypercornConfig, decline_deflate_offers
from ._engine import DEFAULT_ROLLOUT_SUSPEND_LIMIT, open_engine
from ._errors import EngineError
from ._h11_body import hand_on_whole_buffers
from ._heap import freeze_startup_heap
from ._http_limits import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_H2_MAX_STREAMS,
    DEFAULT_HTTP2,
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_TCP_CONNECTIONS,
    TransportLimits,
    TransportStats,
    bound_transport,
    fit_connection_cap,
    watch_accept_errors,
)
from ._interfaces import Classifier, HostedTool, ResponseStore, UsageLedger
from ._ledger import open_sqlite_ledger
from ._llama import DEFAULT_KV_INDEX_MB
from ._logging import HTTP_LOGGER
from ._models import ModelRegistry
from ._render_cache import DEFAULT_RENDER_CACHE_BYTES, DEFAULT_RENDER_CACHE_TTL, RenderCache
from ._store import open_sqlite_store
from ._transport import offer_transport
from ._warmup import warm_up, warm_up_needed
from ._write import write_directly
from ._ws import (
    WebSocketLimits,
)
from ._ws_deflate import (
    DEFAULT_INFLATE_BUDGET,
    DEFAULT_INFLATE_RATE,
    INFLATE_MARGIN,
    InflateBudget,
    InflateLimits,
    InflatePace,
    bound_inflation,
)
from ._ws_mask import unmask_in_c

__all__ = ["API_KEYS_ENV", "ServerConfig", "StartupError", "open_server", "serve"]

log = logging.getLogger("rollout.server")

# Time after the grace period for interrupted responses' terminal events and the sockets'
# close frames to go out before hypercorn cancels what is left.
SHUTDOWN_MARGIN = 1.0

# Environment variable holding API keys (comma-separated), added to --api-key.
API_KEYS_ENV = "ROLLOUT_API_KEYS"


@attrs.frozen(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path | None = Path("rollout-data")  # None: in-memory store and ledger
    # A PostgreSQL URL (`postgresql://...`): the store, the ledger and the compaction key live
    # in that database, shared by every instance pointed at it; `data_dir` is then unused.
    store_url: str | None = None
    api_keys: tuple[str, ...] = ()
    # Browser rules (`_browser.py`): `--allow-host`, `--allow-origin`.
    allow_hosts: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()
    websocket: bool = True
    websocket_deflate: bool = DEFAULT_WEBSOCKET_DEFLATE  # permessage-deflate when offered
    # With deflate: inflated bytes of unfinished messages the server holds at once, across
    # connections (`_ws_deflate.py`); a message past it fails with 1013.
    websocket_inflate_budget: int = DEFAULT_INFLATE_BUDGET
    # With deflate: inflated bytes a second across connections (`_ws_deflate.InflatePace`).
    websocket_inflate_rate: float = DEFAULT_INFLATE_RATE
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    # Each WebSocket connection's limits (`_ws.py`): its age, its queue, lanes and responses
    # in flight, its outbox and stall limit, its idle limit, pings and their pongs.
    websocket_limits: WebSocketLimits = attrs.field(factory=WebSocketLimits)
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # The fraction of `max_connections` one key (without auth, one client address) may hold.
    key_connection_share: float = DEFAULT_KEY_CONNECTION_SHARE
    # The transport (`_http_limits.py`): TCP connections at once (fitted under the descriptor
    # limit), the idle time between requests (and for a request's headers), a body's time and
    # rate, header bytes, HTTP/2 (off unless asked for) and its streams per connection.
    max_tcp_connections: int = DEFAULT_MAX_TCP_CONNECTIONS
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    body_min_rate: float = DEFAULT_BODY_MIN_RATE
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    http2: bool = DEFAULT_HTTP2
    h2_max_streams: int = DEFAULT_H2_MAX_STREAMS
    rollout_suspend_limit: float = DEFAULT_ROLLOUT_SUSPEND_LIMIT
    graceful_timeout: float = 10.0
    max_cached_responses: int = 8
    render_cache_bytes: int = DEFAULT_RENDER_CACHE_BYTES  # 0: no render cache
    render_cache_ttl: float = DEFAULT_RENDER_CACHE_TTL
    # What idle conversations' KV may hold per real model (`--kv-cache-mb`; `registry` None:
    # the built-in models get it; a registry built elsewhere has its own).
    kv_cache_mb: float = DEFAULT_KV_INDEX_MB
    # Send a few requests through a throwaway engine before serving (`_warmup.py`; once per
    # process), so the first client's request is not the one that builds what is built on
    # first use.
    warm_up: bool = True
    # After the warm-up, set the heap built so far aside from the garbage collector
    # (`_heap.py`): a decision about the whole process, so `rollout serve` makes it and an
    # application serving in its own process does not by default.
    freeze_heap: bool = False
    registry: ModelRegistry | None = None
    classifier: Classifier | None = None  # None: the default classifiers
    hosted_tools: tuple[HostedTool, ...] = ()  # executors of hosted tools (offered by type)
    # Wraps the ASGI app before it is served (tests serve deliberately broken variants).
    app_wrapper: Callable[[RolloutApp], Any] | None = None
    # A worker of `rollout serve --workers N`: listen on this bound socket (its own, with
    # `SO_REUSEPORT`; `host` and `port` are then only its address) and share /metrics counts
    # through this directory.
    listen_fd: int | None = None
    metrics_dir: Path | None = None

    def app_config(self) -> AppConfig:
        return AppConfig(
            api_keys=self.api_keys,
            websocket=self.websocket,
            max_message_size=self.max_message_size,
            ws_limits=self.websocket_limits,
            max_connections=self.max_connections,
            key_connection_share=self.key_connection_share,
            max_tcp_connections=self.max_tcp_connections,
            max_cached_responses=self.max_cached_responses,
            metrics_dir=self.metrics_dir,
            bound_host=self.host,
            allow_hosts=self.allow_hosts,
            allow_origins=self.allow_origins,
            body_timeout=self.body_timeout,
            body_min_rate=self.body_min_rate,
        )


def answer_peer_protocol_errors() -> None:
    """Close with the RFC 6455 code when a client's frames are invalid (1007 for text that is
    not UTF-8, 1002 for a malformed frame), instead of dropping the TCP connection.

    wsproto reports such a frame as a `CloseConnection` event while its connection is still
    OPEN, and hypercorn answers a close only in state REMOTE_CLOSING (a close the peer sent),
    so the client saw the connection drop with no close frame. Marking the connection as
    remotely closing makes hypercorn send the close frame with wsproto's code. Idempotent;
    applies to every wsproto connection in the process (RFC behaviour for clients too)."""
    from wsproto.connection import Connection, ConnectionState
    from wsproto.events import CloseConnection

    original = Connection.events
    if getattr(original, "_rollout_patched", False):  # our mark on wsproto's function
        return

    def events(self: Connection) -> Any:
        for event in original(self):
            if isinstance(event, CloseConnection) and self.state is ConnectionState.OPEN:
                self._state = ConnectionState.REMOTE_CLOSING
            yield event

    events._rollout_patched = True  # type: ignore[attr-defined]
    Connection.events = events  # type: ignore[method-assign]


@asynccontextmanager
async def _open_stop_signals(enabled: bool) -> AsyncIterator[AsyncIterator[int] | None]:
    """SIGINT and SIGTERM, received for the whole life of `serve` (when `enabled`: no other
    shutdown trigger): the first starts the graceful shutdown, a second ends its grace period
    at once (see `_next_signal`), so Ctrl-C twice never becomes a KeyboardInterrupt cutting
    responses off without their terminal events and usage."""
    if not enabled:
        yield None
        return
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        yield received


async def _next_signal(signals: AsyncIterator[int] | None) -> str:
    """The name of the next stop signal (`SIGINT`, `SIGTERM`); waits forever without."""
    if signals is None:
        await trio.sleep_forever()
    signum = await anext(aiter(signals))
    return signal.Signals(signum).name


def _responses(n: int) -> str:
    return f"{n} response{'' if n == 1 else 's'}"


def stopping_message(signame: str | None, in_flight: int, grace: float) -> str | None:
    """The line a shutdown starts with: the signal that asked for it (None: the embedder's
    trigger, or a worker's parent), what it waits for and for how long, and how to stop at
    once. None when there is nothing to say (a trigger with nothing in flight)."""
    if in_flight == 0 and signame is None:
        return None
    if in_flight == 0:
        return f"received {signame}: no responses in flight, stopping now"
    responses = _responses(in_flight)
    waiting = f"waiting up to {grace:g} s (--graceful-timeout) for {responses} in flight"
    if signame is None:
        return f"stopping: {waiting}"
    again = "press Ctrl-C again" if signame == "SIGINT" else f"send {signame} again"
    return f"received {signame}: {waiting}; {again} to stop now"


def interrupting_message(signame: str | None, in_flight: int, grace: float) -> str | None:
    """The line when the responses still running are interrupted: by a second signal
    (`signame`), or at the end of the grace period (None; nothing to say if none runs)."""
    if signame is not None:
        if in_flight == 0:
            return f"received {signame} again: stopping now"
        responses = _responses(in_flight)
        return f"received {signame} again: interrupting {responses} in flight, stopping now"
    if in_flight == 0:
        return None
    return f"grace period of {grace:g} s over: interrupting {_responses(in_flight)} still running"


class StartupError(EngineError):
    """`serve` could not start: the port, the host or the data folder. The message says what
    happened and what to do, in a line (the command prints it, without a traceback)."""


def bind_sockets(hconfig: HypercornConfig) -> Sockets:
    """The listening sockets, bound before anything else opens (a port in use leaves no data
    folder behind). A failure is a `StartupError` naming the address."""
    (bind,) = hconfig.bind
    try:
        sockets = hconfig.create_sockets()
    except (OverflowError, OSError) as exc:
        raise bind_error(bind, exc) from None
    for sock in sockets.insecure_sockets:
        sock.listen(hconfig.backlog)
    return sockets


def bind_error(bind: str, exc: OverflowError | OSError) -> StartupError:
    """The `StartupError` for binding `bind` (host:port) failing with `exc`."""
    if isinstance(exc, OverflowError):  # a port over 65535 (the CLI refuses it first)
        return StartupError(f"{bind} is not a valid address: a port is 0-65535.")
    if isinstance(exc, socket.gaierror):
        return StartupError(
            f"cannot listen on {bind}: unknown host ({exc.strerror}); use an IP address or a "
            "name that resolves (--host)."
        )
    if exc.errno == errno.EADDRINUSE:
        return StartupError(
            f"{bind} is already in use (another rollout serve?); stop that server or pick "
            "another --port."
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(
            f"cannot listen on {bind}: no such address on this machine; use one of its "
            "addresses, 127.0.0.1 or 0.0.0.0 (--host)."
        )
    if exc.errno == errno.EACCES:
        return StartupError(
            f"cannot listen on {bind}: permission denied (ports below 1024 need "
            "privileges); pick a port from 1024 up (--port)."
        )
    return StartupError(f"cannot listen on {bind}: {exc.strerror or exc}.")


def _hypercorn_config(config: ServerConfig, stats: TransportStats) -> HypercornConfig:
    hconfig = HypercornConfig()
    hconfig.transport_stats = stats
    # A worker of `rollout serve --workers N` listens on the socket it bound.
    bind = (
        f"{config.host}:{config.port}" if config.listen_fd is None else f"fd://{config.listen_fd}"
    )
    hconfig.bind = [bind]
    hconfig.websocket_deflate = config.websocket_deflate
    # hypercorn closes the socket (1009) above its own limit; ours answers with a
    # `message_too_large` error event below it, so hypercorn's is set above ours.
    hconfig.websocket_max_message_size = config.max_message_size * 2 + (1 << 20)
    # Compressed messages are inflated in steps, failing (1009) past the message limit plus a
    # margin, and within the server's inflate budget (1013).
    hconfig.websocket_inflate = InflateLimits(
        config.max_message_size + INFLATE_MARGIN,
        InflateBudget(config.websocket_inflate_budget, stats.refusals),
        InflatePace(config.websocket_inflate_rate),
    )
    hconfig.h11_max_incomplete_size = config.max_header_bytes
    hconfig.keep_alive_timeout = config.keep_alive_timeout
    hconfig.h2_max_concurrent_streams = config.h2_max_streams
    hconfig.h2_max_header_list_size = config.max_header_bytes
    if not config.http2:
        hconfig.alpn_protocols = ["http/1.1"]
    hconfig.transport = TransportLimits(
        max_tcp_connections=fit_connection_cap(config.max_tcp_connections),
        keep_alive_timeout=config.keep_alive_timeout,
        max_header_bytes=config.max_header_bytes,
        http2=config.http2,
        h2_max_streams=config.h2_max_streams,
    )
    # Past our grace period the engine interrupts what still runs (each response ends with a
    # terminal event, each socket with 1001); hypercorn's own deadline, which cancels
    # outright, comes after, leaving time for those to go out.
    hconfig.graceful_timeout = config.graceful_timeout + SHUTDOWN_MARGIN
    hconfig.accesslog = None  # ours is `rollout.access`
    hconfig.errorlog = logging.getLogger(HTTP_LOGGER)
    return hconfig


async def _open_durable(config: ServerConfig) -> tuple[ResponseStore, UsageLedger, bytes | None]:
    """The store, the ledger and the compaction key: PostgreSQL at `store_url`, SQLite in
    `data_dir`, else in memory."""
    if config.store_url is not None:
        return await _open_postgres(config.store_url)
    if config.data_dir is None:
        from ._ledger import MemoryUsageLedger
        from ._memory import MemoryResponseStore

        return MemoryResponseStore(), MemoryUsageLedger(), None
    where = config.data_dir
    try:
        where.mkdir(parents=True, exist_ok=True)
        compaction_key = _compaction_key(where / "compaction.key")
    except OSError as exc:
        raise StartupError(
            f"cannot use {where} as the data folder: {exc.strerror or exc}; pick another "
            "--data-dir."
        ) from None
    path = where / "responses.sqlite3"
    try:
        store = await open_sqlite_store(path)
        try:
            path = where / "usage.sqlite3"
            ledger = await open_sqlite_ledger(path)
        except BaseException:
            with trio.CancelScope(shield=True):
                await store.aclose()
            raise
    except sqlite3.Error as exc:
        raise StartupError(
            f"cannot open {path}: {exc}; move the file away or pick another --data-dir."
        ) from None
    return store, ledger, compaction_key


async def serve(
    config: ServerConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until the trigger returns (default: SIGINT or SIGTERM). The port is bound first,
    then the data folder opened; either failing is a `StartupError`."""
    answer_peer_protocol_errors()
    decline_deflate_offers()
    write_directly()
    offer_transport()
    bound_transport()
    bound_inflation()
    unmask_in_c()
    hand_on_whole_buffers()
    stats = TransportStats()
    hconfig = _hypercorn_config(config, stats)
    sockets = bind_sockets(hconfig)
    try:
        store, ledger, compaction_key = await _open_durable(config)
    except BaseException:
        _close(sockets)
        raise
    registry = config.registry or default_registry(kv_cache_mb=config.kv_cache_mb)
    try:
        async with (
            open_engine(
                registry=registry,
                classifier=config.classifier,
                hosted_tools=config.hosted_tools,
                store=store,
                ledger=ledger,
                rollout_suspend_limit=config.rollout_suspend_limit,
                compaction_key=compaction_key,
                render_cache=RenderCache(
                    max_bytes=config.render_cache_bytes, ttl=config.render_cache_ttl
                ),
            ) as engine,
            _open_stop_signals(enabled=shutdown_trigger is None) as signals,
        ):
            if config.warm_up and warm_up_needed():
                try:
                    await warm_up()
                except Exception:  # never a reason not to serve: the first requests are slower
                    log.warning("the warm-up failed; serving anyway", exc_info=True)
            if config.freeze_heap:
                frozen = freeze_startup_heap()
                log.debug("%d objects of the startup heap frozen", frozen)
            # One key's share of the TCP connections is of the cap as fitted (`hconfig`).
            app_config = attrs.evolve(
                config.app_config(), max_tcp_connections=hconfig.transport.max_tcp_connections
            )
            app = RolloutApp(engine, app_config, transport=stats)
            watch_accept_errors(stats)
            interrupter = trio.CancelScope()
            grace = config.graceful_timeout

            async def interrupt_after_grace() -> None:
                with interrupter:
                    again: str | None = None
                    with trio.move_on_after(grace):
                        again = await _next_signal(signals)
                    message = interrupting_message(again, engine.in_flight, grace)
                    if message is not None:
                        log.info(message)
                    engine.interrupt_all()

            async def shutdown() -> None:
                signame: str | None = None
                if shutdown_trigger is None:
                    signame = await _next_signal(signals)
                else:
                    await shutdown_trigger()
                app.shutting_down.set()
                message = stopping_message(signame, engine.in_flight, grace)
                if message is not None:
                    if config.listen_fd is not None:  # a worker: its parent logs the signal
                        message = f"worker pid {os.getpid()} {message}"
                    log.info(message)
                background.start_soon(interrupt_after_grace)

            class _Status:
                def started(self, urls: list[str] | None = None) -> None:
                    bound = (urls or [f"http://{config.host}:{config.port}"])[0]
                    if config.listen_fd is None:
                        websocket = "on" if config.websocket else "off"
                        log.info(
                            "rollout serving on %s/v1 (WebSocket %s%s)",
                            bound,
                            websocket,
                            KEYS_REQUIRED if config.api_keys else "",
                        )
                    else:  # a worker: its parent says "serving on" once all are
                        log.info("worker pid %d accepting on %s", os.getpid(), bound)
                    task_status.started(bound + "/v1")

            asgi = app if config.app_wrapper is None else config.app_wrapper(app)
            async with trio.open_nursery() as background:
                if config.metrics_dir is not None:
                    background.start_soon(app.metrics.sync_forever)
                await worker_serve(
                    wrap_app(asgi, hconfig.wsgi_max_body_size, "asgi"),  # type: ignore[arg-type]
                    hconfig,
                    sockets=sockets,
                    shutdown_trigger=shutdown,
                    task_status=_Status(),
                )
                interrupter.cancel()
                background.cancel_scope.cancel()  # the metrics writer
            log.info("server stopped; flushing post-inference work")
        app.metrics.close()  # a worker's final counts, once the ledger is flushed
    finally:
        _close(sockets)
        with trio.CancelScope(shield=True):
            await store.aclose()
            await ledger.aclose()
            await registry.aclose()


async def _open_postgres(url: str) -> tuple[ResponseStore, UsageLedger, bytes]:
    """The PostgreSQL store and ledger, and the compaction key every instance shares (so one
    instance opens the compaction items another sealed)."""
    import psycopg

    from ._pg import StoreError, describe
    from ._pg_ledger import open_postgres_ledger
    from ._pg_store import open_postgres_store

    def failed(what: str, exc: psycopg.Error) -> StoreError:
        return StoreError(
            f"cannot open {what} at {describe(url)}: {_libpq_cause(exc)}; check --store and "
            "that PostgreSQL is running there."
        )

    try:
        store = await open_postgres_store(url)
    except psycopg.Error as exc:
        raise failed("the store", exc) from exc
    try:
        ledger = await open_postgres_ledger(url)
        key = await store.shared_secret("compaction_key")
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            await store.aclose()
        if isinstance(exc, psycopg.Error):
            raise failed("the usage ledger", exc) from exc
        raise
    log.info("store and usage ledger: %s", store.where)
    return store, ledger, key


# libpq's "connection to server at "HOST", port PORT failed: " before the cause, which the
# message names already (without the URL's user and password), and a server's severity.
_LIBPQ_PREFIX = re.compile(
    r"^(?:connection failed: )?(?:connection to server (?:at|on) .*? failed: )?(?:FATAL: +)?"
)


def _libpq_cause(exc: Exception) -> str:
    """The cause of a failed connection in short: the first line of libpq's message (its next
    are hints: "Is the server running on that host and accepting TCP/IP connections?"), without
    the server's address."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    return _LIBPQ_PREFIX.sub("", first).rstrip(".") or first


def _close(sockets: Sockets) -> None:
    for sock in sockets.insecure_sockets:
        sock.close()


@asynccontextmanager
async def open_server(config: ServerConfig) -> AsyncIterator[str]:
    """Run a server in the background; yields its base URL (`http://127.0.0.1:PORT/v1`).
    Leaving the block shuts it down gracefully."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(
            lambda task_status: serve(config, shutdown_trigger=stop.wait, task_status=task_status)
        )
        try:
            yield url
        finally:
            stop.set()


def _compaction_key(path: Path) -> bytes:
    """The key sealing compaction items, made once per data dir (owner-only permissions)."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
    return path.read_bytes()


# What the start-up line adds when API keys are configured: every request needs one.
KEYS_REQUIRED = "; API key required: Authorization: Bearer KEY"


def api_keys_from_env() -> tuple[str, ...]:
    raw = os.environ.get(API_KEYS_ENV, "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())
