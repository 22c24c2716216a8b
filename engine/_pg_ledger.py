"""`PostgresUsageLedger`: the usage ledger in a PostgreSQL database that several rollout
processes (on one host or many) share.

The table, statements and operations of `_ledger.py` (written once over `_sql.Dialect`), so the
idempotency rule in the same statement: `INSERT ... ON CONFLICT (response_id, step) DO UPDATE
... WHERE excluded.complete > usage.complete`. PostgreSQL runs an
`ON CONFLICT DO UPDATE` atomically per row at any isolation level: of two processes recording
the same step at once, one inserts and the other waits for its commit and then takes the
update branch against the committed row. So there is exactly one row per `(response_id, step)`
whatever the number of writers, a complete record replaces an incomplete one, and otherwise the
first write is kept. A batch is one transaction, committed when `record` returns; its rows are
written in key order, so concurrent batches over the same rows wait for each other instead of
deadlocking (and a transaction that still loses a deadlock or a serialization conflict runs
again: `_pg.retrying`).

`record_sync` (the engine's teardown) opens its own connection in the caller's thread: it never
waits for the pool or the worker threads.
"""

from __future__ import annotations

from collections.abc import Callable

from ._ledger import USAGE_SQL, SQLUsageLedger, usage_schema
from ._pg import DEFAULT_POOL_SIZE, PostgresResource, connect, open_pool, retrying
from ._sql import POSTGRES, Connection

__all__ = [
    "POSTGRES_USAGE_SCHEMA",
    "POSTGRES_USAGE_SCHEMA_VERSION",
    "PostgresUsageLedger",
    "open_postgres_ledger",
]

POSTGRES_USAGE_SCHEMA_VERSION = 1

# The table of `_ledger.usage_schema` (see there).
POSTGRES_USAGE_SCHEMA = usage_schema(POSTGRES)

# Upgrades from an older schema version: {from_version: statements to reach from_version + 1}.
POSTGRES_USAGE_MIGRATIONS: dict[int, tuple[str, ...]] = {}


class PostgresUsageLedger(PostgresResource, SQLUsageLedger):
    """A `UsageLedger` in a PostgreSQL database. Make one with `open_postgres_ledger()`."""

    _sql = POSTGRES.render(USAGE_SQL)

    async def _write_batch(self, write: Callable[[Connection], None]) -> None:
        await self._run(write)  # a call is one transaction (statements pipelined: one round trip)

    def _write_batch_now(self, write: Callable[[Connection], None]) -> None:
        with connect(self._conninfo) as conn:
            retrying(write, conn)


async def open_postgres_ledger(
    url: str, *, pool_size: int = DEFAULT_POOL_SIZE
) -> PostgresUsageLedger:
    """Open a usage ledger in the PostgreSQL database at `url`, creating or upgrading its
    tables (the database may be the response store's). At most `pool_size` connections."""
    pool, conninfo = await open_pool(
        url,
        component="usage",
        version=POSTGRES_USAGE_SCHEMA_VERSION,
        schema=POSTGRES_USAGE_SCHEMA,
        migrations=POSTGRES_USAGE_MIGRATIONS,
        pool_size=pool_size,
    )
    return PostgresUsageLedger(pool, conninfo)
