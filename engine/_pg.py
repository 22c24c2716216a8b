"""PostgreSQL plumbing shared by the PostgreSQL response store and usage ledger.

Bridge from trio: psycopg's async API runs on asyncio only, so the store and the ledger use
its blocking API from trio's worker threads (`trio.to_thread.run_sync`), each on a connection
borrowed from a `psycopg_pool.ConnectionPool`. A `trio.CapacityLimiter` as large as the pool
bounds the threads, so a thread never waits inside the pool for a connection that another of
our threads holds. A call is one transaction: the pool commits when the call returns and rolls
back when it raises. Calls are not abandoned on cancellation (as with SQLite): a write that
started commits or rolls back before the cancelled task unwinds; every wait in it is bounded
(`CONNECT_TIMEOUT`, `POOL_TIMEOUT`, `STATEMENT_TIMEOUT`, and for a server that vanished
without closing its connections, TCP keepalives and `TCP_USER_TIMEOUT`).

After a restart of the server every pooled connection is dead. The pool checks a connection
when it lends it (`ConnectionPool.check_connection`, one empty round trip) and replaces a dead
one, so the first request after the server is back already succeeds; while it is down, calls
fail with `psycopg.OperationalError` (or `psycopg_pool.PoolTimeout`) within those timeouts.

Schema versions live in a `schema_versions` table (one row per component), as in a SQLite
file; concurrent processes creating or upgrading the tables take a transaction-scoped
advisory lock first, so exactly one of them does it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import trio

from ._sql import POSTGRES, migrate

# psycopg is imported where it is used: `import rollout.engine` stays as fast without it.
if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import ConnectionPool

__all__ = [
    "CONNECT_TIMEOUT",
    "DEFAULT_POOL_SIZE",
    "POOL_TIMEOUT",
    "STATEMENT_TIMEOUT",
    "StoreError",
    "is_postgres_url",
]

T = TypeVar("T")
Conn: TypeAlias = "psycopg.Connection[tuple[Any, ...]]"

# Connections one store (or ledger) keeps open at most. The engine writes from one background
# task (group commit) and reads for hydration, retrieval and `item_reference` lookups, each a
# few milliseconds; eight cover a busy process without crowding the server's `max_connections`
# (100 by default) when many processes share it.
DEFAULT_POOL_SIZE = 8
# Seconds to establish a connection (libpq's `connect_timeout`, unless the URL sets one).
CONNECT_TIMEOUT = 5
# Seconds a call waits for a pooled connection (all busy, or the server unreachable) before
# failing with `psycopg_pool.PoolTimeout`: with queries of milliseconds a healthy pool lends one
# far sooner, and while the server is down this is how long a request takes to fail.
POOL_TIMEOUT = 5.0
# Seconds one statement may run on the server before it is cancelled. Ours take milliseconds;
# this only bounds a server that has stopped answering (or a lock held by a stuck peer).
STATEMENT_TIMEOUT = 30.0
# A server that vanishes (its host down, the network cut: nothing closes the connection) is
# noticed by TCP, not by the server's own statement timeout: libpq's keepalives probe a
# connection idle `TCP_KEEPALIVE_IDLE` seconds, every `TCP_KEEPALIVE_INTERVAL`, and give it up
# after `TCP_KEEPALIVE_COUNT` unanswered probes (25 s: a query waiting for its answer fails
# then), and `TCP_USER_TIMEOUT` ms bounds data sent and never acknowledged. The kernel's
# defaults would hold a worker thread, and every commit queued behind it, for 15 minutes to
# 2 hours. A URL that sets any of these keeps its own.
TCP_KEEPALIVE_IDLE = 10
TCP_KEEPALIVE_INTERVAL = 5
TCP_KEEPALIVE_COUNT = 3
TCP_USER_TIMEOUT = 30_000
# Tries of one transaction that lost a deadlock or a serialization conflict to a concurrent
# writer. Every write is an idempotent upsert, so running it again is safe.
MAX_TRANSACTION_TRIES = 3
# Seconds `aclose` waits for the pool's background workers to stop.
POOL_CLOSE_TIMEOUT = 5.0


class StoreError(RuntimeError):
    """The PostgreSQL store or ledger could not be opened (the message says where and why)."""


def is_postgres_url(url: str) -> bool:
    """A libpq URL (`postgresql://...` or `postgres://...`)."""
    return url.startswith(("postgresql://", "postgres://"))


def conninfo_of(url: str) -> str:
    """`url` with our defaults for what it does not set itself."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    given = conninfo_to_dict(url)
    defaults = {
        "connect_timeout": str(CONNECT_TIMEOUT),
        "application_name": "rollout",
        "keepalives": "1",
        "keepalives_idle": str(TCP_KEEPALIVE_IDLE),
        "keepalives_interval": str(TCP_KEEPALIVE_INTERVAL),
        "keepalives_count": str(TCP_KEEPALIVE_COUNT),
        "tcp_user_timeout": str(TCP_USER_TIMEOUT),
    }
    return make_conninfo(url, **{k: v for k, v in defaults.items() if k not in given})


def describe(conninfo: str) -> str:
    """The server and database of a connection string, without credentials (for messages)."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(conninfo)
    host = params.get("host") or "localhost"
    port = params.get("port") or "5432"
    return f"postgresql://{host}:{port}/{params.get('dbname') or ''}"


def configure(conn: Conn) -> None:
    """Every new connection: bound each statement's run time."""
    conn.execute(
        "SELECT set_config('statement_timeout', %s, false)", (f"{int(STATEMENT_TIMEOUT * 1000)}",)
    )
    conn.commit()


def connect(conninfo: str) -> Conn:
    """One connection outside the pool (migrations, `record_sync`)."""
    import psycopg

    conn = psycopg.connect(conninfo)
    try:
        configure(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def ensure_schema(
    conn: Conn,
    *,
    component: str,
    version: int,
    schema: Sequence[str],
    migrations: dict[int, tuple[str, ...]],
) -> None:
    """Create `component`'s tables, or upgrade them to `version`, in one transaction; processes
    starting together wait for each other (an advisory lock keyed by the component)."""
    with conn.transaction():
        migrate(
            conn,
            POSTGRES,
            component=component,
            version=version,
            schema=schema,
            migrations=migrations,
        )


def retrying(fn: Callable[[Conn], T], conn: Conn) -> T:
    """Run `fn` as one transaction on `conn`, again if it lost a deadlock or a serialization
    conflict (at most `MAX_TRANSACTION_TRIES` times)."""
    from psycopg import errors

    for attempt in range(1, MAX_TRANSACTION_TRIES + 1):
        try:
            with conn.transaction():
                return fn(conn)
        except (errors.DeadlockDetected, errors.SerializationFailure):
            if attempt == MAX_TRANSACTION_TRIES:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


async def open_pool(
    url: str,
    *,
    component: str,
    version: int,
    schema: Sequence[str],
    migrations: dict[int, tuple[str, ...]],
    pool_size: int,
) -> tuple[ConnectionPool[Conn], str]:
    """Bring `component`'s tables up to date over one direct connection (its errors say what
    is wrong, e.g. the server refusing connections), then open a pool."""
    if pool_size < 1:
        raise ValueError(f"pool_size must be at least 1, not {pool_size}")
    from psycopg_pool import ConnectionPool

    conninfo = conninfo_of(url)

    def run() -> ConnectionPool[Conn]:
        with connect(conninfo) as conn:
            ensure_schema(
                conn, component=component, version=version, schema=schema, migrations=migrations
            )
        pool: ConnectionPool[Conn] = ConnectionPool(
            conninfo,
            min_size=1,
            max_size=pool_size,
            timeout=POOL_TIMEOUT,
            configure=configure,
            check=ConnectionPool.check_connection,
            name=f"rollout-{component}",
            open=False,
        )
        try:
            pool.open(wait=True, timeout=POOL_TIMEOUT)
        except BaseException:
            pool.close()
            raise
        return pool

    return await trio.to_thread.run_sync(run), conninfo


class PostgresResource(trio.abc.AsyncResource):
    """A connection pool used from trio's worker threads, one transaction per call."""

    _what = "resource"

    def __init__(self, pool: ConnectionPool[Conn], conninfo: str) -> None:
        self._pool = pool
        self._conninfo = conninfo
        self._closed = False
        self._limiter = trio.CapacityLimiter(pool.max_size)
        self.where = describe(conninfo)

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"the {self._what} at {self.where} is closed")

    def _call(self, fn: Callable[[Conn], T]) -> T:
        from psycopg_pool import PoolClosed

        self._check_open()  # in the thread: a call queued behind the limiter sees aclose()
        try:
            with self._pool.connection() as conn:
                return retrying(fn, conn)
        except PoolClosed:
            raise trio.ClosedResourceError(f"the {self._what} at {self.where} is closed") from None

    async def _run(self, fn: Callable[[Conn], T]) -> T:
        self._check_open()
        return await trio.to_thread.run_sync(self._call, fn, limiter=self._limiter)

    async def aclose(self) -> None:
        """Close the pool. Calls not yet running fail with `ClosedResourceError`; a call in
        flight finishes first (its connection is closed when it is returned). Idempotent."""
        self._closed = True
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._pool.close, POOL_CLOSE_TIMEOUT)
