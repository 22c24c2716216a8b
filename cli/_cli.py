"""The `rollout` command line: `serve`, `conform`, `bench`.

Long because `serve` has some forty options, each with its help text, metavariable and the check
that turns a bad value into one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, cast

from . import __version__

__all__ = ["main"]


def _number(kind: type[int] | type[float], *, zero: bool) -> Callable[[str], int | float]:
    """An argparse type: a number of `kind` > 0 (>= 0 with `zero`); a mistake is argparse's
    one-line error naming the option."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value >= 0 or (value == 0 and not zero):  # NaN too
            raise argparse.ArgumentTypeError(
                f"expected a number {'>=' if zero else '>'} 0, got {text}"
            )
        return value

    parse.__name__ = kind.__name__
    return parse


_POSITIVE_INT = _number(int, zero=False)
_POSITIVE = _number(float, zero=False)
_NON_NEGATIVE_INT = _number(int, zero=True)
_NON_NEGATIVE = _number(float, zero=True)


def _port(text: str) -> int:
    """An argparse type: a port number, 0-65535 (0: any free port); `abc` and `99999` get the
    same one-line error."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return value


def _fraction(text: str) -> float:
    """An argparse type: a fraction in (0, 1]."""
    value = float(_POSITIVE(text))
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse's parser; with `one_line_errors` (serve's), a mistake in the arguments is one
    line on stderr, as serve's other start-up errors are (`rollout serve: --port: ...`), and
    exit status 2."""

    def __init__(self, *args: Any, one_line_errors: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.one_line_errors = one_line_errors

    def error(self, message: str) -> NoReturn:
        if not self.one_line_errors:
            super().error(message)
        self.exit(2, f"{self.prog}: {_one_line_error(self.prog, message)}\n")


def _one_line_error(prog: str, message: str) -> str:
    """argparse's `message` for one line: `--port: ...` for its `argument --port: ...`; an
    unknown option says where the options are listed."""
    message = message.removeprefix("argument ")
    if message.startswith("unrecognized arguments:"):
        message += f" ({prog} --help lists the options)"
    return message


_SERVE_EPILOG = """\
exit status:
  0    stopped (SIGINT or SIGTERM) after a graceful shutdown
  1    could not start: the port, the host, the data folder, or the --store
       database (unreachable, or refusing the connection)
  2    a bad argument or models file (nothing was started)
  130  interrupted before the server was up
"""


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rollout.protocol import DEFAULT_MAX_MESSAGE_SIZE

    from .engine._app import DEFAULT_KEY_CONNECTION_SHARE, DEFAULT_MAX_CONNECTIONS
    from .engine._deflate import DEFAULT_WEBSOCKET_DEFLATE
    from .engine._engine import DEFAULT_ROLLOUT_SUSPEND_LIMIT
    from .engine._http_limits import (
        DEFAULT_BODY_MIN_RATE,
        DEFAULT_BODY_TIMEOUT,
        DEFAULT_H2_MAX_STREAMS,
        DEFAULT_KEEP_ALIVE_TIMEOUT,
        DEFAULT_MAX_HEADER_BYTES,
        DEFAULT_MAX_TCP_CONNECTIONS,
    )
    from .engine._llama import DEFAULT_KV_INDEX_MB
    from .engine._render_cache import DEFAULT_RENDER_CACHE_BYTES, DEFAULT_RENDER_CACHE_TTL
    from .engine._ws import (
        DEFAULT_CONNECTION_AGE_LIMIT,
        DEFAULT_IDLE_LIMIT,
        DEFAULT_MAX_BUFFERED_BYTES,
        DEFAULT_MAX_QUEUED_CREATES,
        DEFAULT_PING_INTERVAL,
        DEFAULT_PING_TIMEOUT,
        DEFAULT_SEND_STALL_LIMIT,
    )
    from .engine._ws_deflate import DEFAULT_INFLATE_BUDGET, DEFAULT_INFLATE_RATE

    p = sub.add_parser(
        "serve",
        usage="rollout serve [options]",
        one_line_errors=True,
        help="serve the Responses API (HTTP, SSE and WebSocket mode) on one port",
        description="Serve the Responses API over HTTP (with server-sent events) and WebSocket\n"
        "mode on one port, with the built-in simulated models, a SQLite response store\n"
        "and a SQLite usage ledger.",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--host", default="127.0.0.1", metavar="HOST", help="address to bind (default 127.0.0.1)"
    )
    p.add_argument(
        "--port",
        type=_port,
        default=8000,
        metavar="PORT",
        help="port to bind, 0 for any free one (default 8000)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path("rollout-data"),
        metavar="DIR",
        help="folder of the SQLite store and usage ledger (default ./rollout-data)",
    )
    p.add_argument(
        "--store",
        metavar="URL",
        help="keep stored responses and usage in this PostgreSQL database "
        "(postgresql://USER@HOST:PORT/DBNAME) instead of SQLite files in --data-dir: every "
        "instance pointed at the same database serves the same stored responses",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this API key (repeatable; also ROLLOUT_API_KEYS, comma-separated); "
        "without keys auth is off",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages of this origin (scheme://host[:port]) call the server (repeatable; "
        "* for any); by default only loopback pages, and none with --api-key; requests "
        "without an Origin header (SDKs, curl) are always served",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="answer requests whose Host header names this host (repeatable; * for any): bound "
        "to a loopback address only localhost, 127.0.0.1 and [::1] are answered (against DNS "
        "rebinding); bound elsewhere every Host unless names are listed",
    )
    p.add_argument("--no-websocket", action="store_true", help="refuse WebSocket upgrades (426)")
    # Which of the pair is the default is said plainly, once each: "(default off)" on the
    # switch that turns it off read as a contradiction.
    on_default, off_default = (
        ("the default", "permessage-deflate is on by default; this turns it off")
        if DEFAULT_WEBSOCKET_DEFLATE
        else ("permessage-deflate is off by default; this turns it on", "the default")
    )
    deflate = p.add_mutually_exclusive_group()
    deflate.add_argument(
        "--websocket-deflate",
        dest="websocket_deflate",
        action="store_true",
        default=DEFAULT_WEBSOCKET_DEFLATE,
        help="accept permessage-deflate when a WebSocket client offers it (the openai SDK and "
        "Codex do): fewer bytes on the wire for more CPU per frame; for slow or metered "
        f"links ({on_default})",
    )
    deflate.add_argument(
        "--no-websocket-deflate",
        dest="websocket_deflate",
        action="store_false",
        help="decline permessage-deflate: frames go uncompressed, the faster choice on "
        f"loopback, LAN and datacenter networks ({off_default})",
    )
    p.add_argument(
        "--websocket-inflate-budget-mb",
        type=_POSITIVE,
        default=DEFAULT_INFLATE_BUDGET / 2**20,
        metavar="MB",
        help="with --websocket-deflate, inflated bytes of unfinished messages the server holds "
        "at once across connections; a message past it closes its WebSocket with 1013 "
        f"(default {DEFAULT_INFLATE_BUDGET // 2**20})",
    )
    p.add_argument(
        "--websocket-inflate-rate-mb",
        type=_POSITIVE,
        default=DEFAULT_INFLATE_RATE / 2**20,
        metavar="MB",
        help="with --websocket-deflate, MiB the server inflates a second across connections; "
        "a connection past it waits before its next read, so compressed messages cannot take "
        f"the event loop (default {DEFAULT_INFLATE_RATE // 2**20})",
    )
    p.add_argument(
        "--models",
        type=Path,
        metavar="FILE",
        help="a TOML model registry (upstream OpenAI-compatible servers); the built-in sim "
        "models stay available",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        metavar="LEVEL",
        help="the least severe log lines written to stderr: debug, info, warning or error; "
        "info includes one access line per "
        "HTTP request and per closed WebSocket (default info)",
    )
    p.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        metavar="FORMAT",
        help="text: one readable line per record; json: one JSON object per line, every line "
        "(timestamp, level, logger, message and the record's fields) (default text)",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="on a start-up failure, show the traceback instead of a one-line message",
    )
    p.add_argument(
        "--max-message-size",
        type=_POSITIVE_INT,
        default=DEFAULT_MAX_MESSAGE_SIZE,
        metavar="BYTES",
        help="largest request body / WebSocket message in bytes "
        f"(default {DEFAULT_MAX_MESSAGE_SIZE})",
    )
    p.add_argument(
        "--connection-age-limit",
        type=_POSITIVE,
        default=DEFAULT_CONNECTION_AGE_LIMIT,
        metavar="SECONDS",
        help="seconds before a WebSocket connection must reconnect (default 3600)",
    )
    p.add_argument(
        "--max-queued-creates",
        type=_NON_NEGATIVE_INT,
        default=DEFAULT_MAX_QUEUED_CREATES,
        metavar="N",
        help=f"response.create events waiting per connection, across its lanes (default "
        f"{DEFAULT_MAX_QUEUED_CREATES})",
    )
    p.add_argument(
        "--max-connections",
        type=_POSITIVE_INT,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"open WebSocket connections at most; more are refused with 503 "
        f"(default {DEFAULT_MAX_CONNECTIONS})",
    )
    p.add_argument(
        "--max-buffered-bytes",
        type=_POSITIVE_INT,
        default=DEFAULT_MAX_BUFFERED_BYTES,
        metavar="BYTES",
        help="bytes of outgoing frames a WebSocket (or an SSE response) holds for a slow reader "
        f"(default {DEFAULT_MAX_BUFFERED_BYTES})",
    )
    p.add_argument(
        "--send-stall-limit",
        type=_POSITIVE,
        default=DEFAULT_SEND_STALL_LIMIT,
        metavar="SECONDS",
        help="seconds a response may wait on a client that does not read before both end "
        f"(default {DEFAULT_SEND_STALL_LIMIT:g})",
    )
    p.add_argument(
        "--websocket-idle-limit",
        type=_POSITIVE,
        default=DEFAULT_IDLE_LIMIT,
        metavar="SECONDS",
        help="a WebSocket with no response running or waiting and no client message for this "
        f"long is closed (1000) (default {DEFAULT_IDLE_LIMIT:g})",
    )
    p.add_argument(
        "--websocket-ping-interval",
        type=_POSITIVE,
        default=DEFAULT_PING_INTERVAL,
        metavar="SECONDS",
        help="the server pings each WebSocket this often; inf: never "
        f"(default {DEFAULT_PING_INTERVAL:g})",
    )
    p.add_argument(
        "--websocket-ping-timeout",
        type=_POSITIVE,
        default=DEFAULT_PING_TIMEOUT,
        metavar="SECONDS",
        help="a WebSocket whose peer does not answer a ping within this is aborted "
        f"(default {DEFAULT_PING_TIMEOUT:g})",
    )
    p.add_argument(
        "--key-connection-share",
        type=_fraction,
        default=DEFAULT_KEY_CONNECTION_SHARE,
        metavar="FRACTION",
        help="the fraction of --max-connections one API key (without auth: one client "
        "address) may hold; more are refused with 429 too_many_connections_for_key; 1: no "
        f"share (default {DEFAULT_KEY_CONNECTION_SHARE:g})",
    )
    p.add_argument(
        "--max-tcp-connections",
        type=_POSITIVE_INT,
        default=DEFAULT_MAX_TCP_CONNECTIONS,
        metavar="N",
        help="open TCP connections at most, HTTP and WebSocket (fitted under the descriptor "
        "limit, ulimit -n); more are answered 503 and closed "
        f"(default {DEFAULT_MAX_TCP_CONNECTIONS})",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=_POSITIVE,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT,
        metavar="SECONDS",
        help="an HTTP connection with no request in progress (idle between requests, or "
        f"still sending a request's headers) is closed after this (default "
        f"{DEFAULT_KEEP_ALIVE_TIMEOUT:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=_POSITIVE,
        default=DEFAULT_BODY_TIMEOUT,
        metavar="SECONDS",
        help="a request body must arrive within this after the headers, plus a second per "
        f"--body-min-rate bytes; else 408 and close (default {DEFAULT_BODY_TIMEOUT:g})",
    )
    p.add_argument(
        "--body-min-rate",
        type=_POSITIVE,
        default=DEFAULT_BODY_MIN_RATE,
        metavar="BYTES",
        help=f"bytes a second; see --body-timeout (default {DEFAULT_BODY_MIN_RATE})",
    )
    p.add_argument(
        "--max-header-bytes",
        type=_POSITIVE_INT,
        default=DEFAULT_MAX_HEADER_BYTES,
        metavar="BYTES",
        help="a request's header bytes at most; more: 431 and close "
        f"(default {DEFAULT_MAX_HEADER_BYTES})",
    )
    p.add_argument(
        "--http2",
        action="store_true",
        help="serve HTTP/2 (h2c upgrade and prior knowledge); off, an h2c upgrade is served as "
        "HTTP/1.1 and the HTTP/2 preface gets GOAWAY HTTP_1_1_REQUIRED (default off)",
    )
    p.add_argument(
        "--h2-max-streams",
        type=_POSITIVE_INT,
        default=DEFAULT_H2_MAX_STREAMS,
        metavar="N",
        help=f"with --http2, concurrent streams per connection (default {DEFAULT_H2_MAX_STREAMS})",
    )
    p.add_argument(
        "--rollout-suspend-limit",
        type=_POSITIVE,
        default=DEFAULT_ROLLOUT_SUSPEND_LIMIT,
        metavar="SECONDS",
        help="seconds a suspended rollout waits for tool outputs (default 600)",
    )
    p.add_argument(
        "--render-cache-mb",
        type=_NON_NEGATIVE,
        default=DEFAULT_RENDER_CACHE_BYTES / 2**20,
        metavar="MB",
        help="memory for conversations rendered once and found again by any connection, "
        f"least recently used dropped first (default {DEFAULT_RENDER_CACHE_BYTES // 2**20})",
    )
    p.add_argument(
        "--render-cache-ttl",
        type=_POSITIVE,
        default=DEFAULT_RENDER_CACHE_TTL,
        metavar="SECONDS",
        help="an unused render cache entry (a store: false conversation's only copy) is "
        f"dropped after this (default {DEFAULT_RENDER_CACHE_TTL:g})",
    )
    p.add_argument(
        "--kv-cache-mb",
        type=_NON_NEGATIVE,
        default=DEFAULT_KV_INDEX_MB,
        metavar="MB",
        help="per real model (smollm2, gguf models), memory of evaluated context (KV) that "
        "idle conversations keep for their next turn, found by any connection of the same "
        "key; 0: only rollouts and WebSocket connections keep theirs "
        f"(default {DEFAULT_KV_INDEX_MB:g})",
    )
    p.add_argument(
        "--no-render-cache",
        action="store_true",
        help="render every request's whole input (the render cache off: for comparison)",
    )
    p.add_argument(
        "--workers",
        type=_POSITIVE_INT,
        default=1,
        metavar="N",
        help="worker processes serving the port (default 1); raise it, up to one per core, "
        "when one process's CPU is the limit (JSON encoding and frame sending for many "
        "concurrent streams); workers share the store, a WebSocket stays in its worker",
    )
    p.add_argument(
        "--graceful-timeout",
        type=_NON_NEGATIVE,
        default=10.0,
        metavar="SECONDS",
        help="seconds in-flight responses get to finish at shutdown (default 10)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout",
        description=(
            "An OpenAI-Responses-compatible engine for agent rollouts over a persistent "
            "WebSocket: serve it, test a server's conformance, or benchmark the agent loop."
        ),
    )
    parser.add_argument("--version", action="version", version=f"rollout {__version__}")
    # Each command's parser a `_Parser` (serve's says a mistake in one line), typed as what
    # the commands' `add_parser` functions take.
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser),
    )
    _add_serve(sub)
    from .bench._cli import add_parser as add_bench
    from .spec._cli import add_parser as add_conform

    add_conform(sub)
    add_bench(sub)
    return parser


def _serve_failed(args: argparse.Namespace, message: str) -> None:
    """A start-up failure, one line on stderr: plain text, or a JSON record with --log-format
    json (so that every line such a server writes parses)."""
    if args.log_format == "json":
        import logging

        logging.getLogger("rollout.server").error(message)
    else:
        print(f"rollout serve: {message}", file=sys.stderr)


def _store_url_problem(url: str) -> str | None:
    """What makes `url` no PostgreSQL URL (a bad argument, before anything starts; the URL
    itself is not repeated unless it is no postgresql:// URL at all, as it may hold a
    password); None for one to connect to."""
    from .engine._pg import is_postgres_url

    if not is_postgres_url(url):
        return f"expected a postgresql:// URL, got {url!r}"
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(url)
    except psycopg.Error as exc:
        return str(exc).strip().splitlines()[0]
    port = str(params.get("port") or "5432")
    if not all(p.isdigit() for p in port.split(",") if p):
        return f"expected a port number in the URL, got {port!r}"
    return None


def _serve(args: argparse.Namespace) -> int:
    """Exit status (`_SERVE_EPILOG`): 0 after a clean shutdown; 2 for arguments or a models
    file that cannot work (nothing was opened); 1 when the server could not start (port, host,
    data folder, a --store database it cannot reach)."""
    import attrs
    import trio

    from .engine._logging import configure_logging
    from .engine._pg import StoreError
    from .engine._serve import ServerConfig, StartupError, api_keys_from_env, serve
    from .engine._ws import WebSocketLimits

    configure_logging(args.log_level, args.log_format)
    registry = None
    if args.models is not None:
        import logging

        from .engine._config import ConfigError, load_registry, missing_api_keys

        try:
            registry = load_registry(args.models, kv_cache_mb=args.kv_cache_mb)
        except ConfigError as exc:
            _serve_failed(args, str(exc))
            return 2
        for warning in missing_api_keys(registry):
            logging.getLogger("rollout.server").warning(warning)
    if args.store is not None:
        problem = _store_url_problem(args.store)
        if problem is not None:
            _serve_failed(args, f"--store: {problem}")
            return 2
    from .engine._browser import BrowserRules

    if any(not key.strip() for key in args.api_key):
        _serve_failed(
            args,
            "--api-key: an empty key would refuse every request without one and admit none; "
            "give a key, or leave --api-key out to serve without authentication.",
        )
        return 2
    api_keys = tuple(args.api_key) + api_keys_from_env()
    try:
        BrowserRules.make(
            bound_host=args.host,
            keys_configured=bool(api_keys),
            allow_hosts=args.allow_host,
            allow_origins=args.allow_origin,
        )
    except ValueError as exc:
        _serve_failed(args, str(exc))
        return 2
    config = ServerConfig(
        registry=registry,
        store_url=args.store,
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        api_keys=api_keys,
        allow_hosts=tuple(args.allow_host),
        allow_origins=tuple(args.allow_origin),
        websocket=not args.no_websocket,
        websocket_deflate=args.websocket_deflate,
        websocket_inflate_budget=int(args.websocket_inflate_budget_mb * 2**20),
        websocket_inflate_rate=args.websocket_inflate_rate_mb * 2**20,
        max_message_size=args.max_message_size,
        websocket_limits=WebSocketLimits(
            connection_age_limit=args.connection_age_limit,
            max_queued_creates=args.max_queued_creates,
            max_buffered_bytes=args.max_buffered_bytes,
            send_stall_limit=args.send_stall_limit,
            idle_limit=args.websocket_idle_limit,
            ping_interval=args.websocket_ping_interval,
            ping_timeout=args.websocket_ping_timeout,
        ),
        max_connections=args.max_connections,
        key_connection_share=args.key_connection_share,
        max_tcp_connections=args.max_tcp_connections,
        keep_alive_timeout=args.keep_alive_timeout,
        body_timeout=args.body_timeout,
        body_min_rate=args.body_min_rate,
        max_header_bytes=args.max_header_bytes,
        http2=args.http2,
        h2_max_streams=args.h2_max_streams,
        rollout_suspend_limit=args.rollout_suspend_limit,
        graceful_timeout=args.graceful_timeout,
        render_cache_bytes=0 if args.no_render_cache else int(args.render_cache_mb * 2**20),
        render_cache_ttl=args.render_cache_ttl,
        kv_cache_mb=args.kv_cache_mb,
        freeze_heap=True,  # this process is the server's own (engine/_heap.py)
    )
    try:
        if args.workers > 1:
            from .engine._workers import run_workers

            return run_workers(
                attrs.evolve(config, registry=None),
                workers=args.workers,
                models=args.models,
                log_level=args.log_level,
                log_format=args.log_format,
            )
        trio.run(serve, config)
    except (StoreError, StartupError) as exc:
        if args.debug:
            raise
        _serve_failed(args, str(exc))
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the server was up (then it shuts down itself)
        return 130
    except BaseExceptionGroup as group:  # the same, raised inside the server's task groups
        if group.split(KeyboardInterrupt)[1] is not None:
            raise
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's own check, but serve's parser says it (one line)
        message = f"unrecognized arguments: {' '.join(unknown)}"
        if args.command == "serve":
            print(f"rollout serve: {_one_line_error('rollout serve', message)}", file=sys.stderr)
            return 2
        parser.error(message)
    if args.command is None:  # a usage error, as argparse's own: usage on stderr, status 2
        parser.print_usage(sys.stderr)
        print(
            "rollout: a command is required: serve, conform or bench (rollout --help says more)",
            file=sys.stderr,
        )
        return 2
    from .bench._cli import run as run_bench
    from .spec._cli import run as run_conform

    handlers = {"serve": _serve, "conform": run_conform, "bench": run_bench}
    return handlers[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
