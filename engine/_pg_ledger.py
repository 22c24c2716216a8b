"""`PostgresUsageLedger`: the usage ledger in a PostgreSQL database that several rollout
processes (on one host or many) share.

The idempotency rule of `_ledger.py`, in the same statement: `INSERT ... ON CONFLICT
(response_id, step) DO UPDATE ... WHERE excluded.complete > usage.complete`. PostgreSQL runs an
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

from collections.abc import Sequence
from typing import Any

from ._interfaces import UsageRecord
from ._ledger import _COLUMNS, _TOTAL_KEYS, _params, _record
from ._pg import DEFAULT_POOL_SIZE, Conn, PostgresResource, connect, open_pool, retrying

__all__ = [
    "POSTGRES_USAGE_SCHEMA",
    "POSTGRES_USAGE_SCHEMA_VERSION",
    "PostgresUsageLedger",
    "open_postgres_ledger",
]

POSTGRES_USAGE_SCHEMA_VERSION = 1

# The columns of `_ledger.USAGE_SCHEMA` (see there).
POSTGRES_USAGE_SCHEMA: tuple[str, ...] = (
    """
    CREATE TABLE usage (
        response_id   TEXT NOT NULL,
        step          INTEGER NOT NULL,
        owner         TEXT,
        model         TEXT NOT NULL,
        input_tokens  BIGINT NOT NULL,
        cached_tokens BIGINT NOT NULL,
        output_tokens BIGINT NOT NULL,
        complete      SMALLINT NOT NULL CHECK (complete IN (0, 1)),
        created_at    DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (response_id, step)
    )""",
    "CREATE INDEX usage_owner_created ON usage (owner, created_at)",
)

# Upgrades from an older schema version: {from_version: statements to reach from_version + 1}.
POSTGRES_USAGE_MIGRATIONS: dict[int, tuple[str, ...]] = {}

_RECORD = f"""
INSERT INTO usage ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (response_id, step) DO UPDATE SET
    owner = excluded.owner,
    model = excluded.model,
    input_tokens = excluded.input_tokens,
    cached_tokens = excluded.cached_tokens,
    output_tokens = excluded.output_tokens,
    complete = excluded.complete,
    created_at = excluded.created_at
WHERE excluded.complete > usage.complete
"""


def _key(record: UsageRecord) -> tuple[str, int]:
    return record.response_id, record.step


def _write(conn: Conn, records: Sequence[UsageRecord]) -> None:
    """In the caller's transaction (statements pipelined: one round trip), in key order: every
    writer locks rows in the same order, so two batches over the same rows never deadlock. The
    sort is stable, so the records of one key keep their order, which is all the outcome
    depends on (records of different keys are independent)."""
    conn.cursor().executemany(_RECORD, [_params(r) for r in sorted(records, key=_key)])


class PostgresUsageLedger(PostgresResource):
    """A `UsageLedger` in a PostgreSQL database. Make one with `open_postgres_ledger()`."""

    _what = "usage ledger"

    async def record(self, records: Sequence[UsageRecord]) -> None:
        """Record a batch in one transaction; committed when this returns."""
        if not records:
            return
        batch = list(records)
        await self._run(lambda conn: _write(conn, batch))

    def record_sync(self, records: Sequence[UsageRecord]) -> None:
        """Record a batch, blocking the calling thread, on a connection of its own (never
        waiting for the pool). For the last word of a cancelled rollout."""
        self._check_open()
        if not records:
            return
        with connect(self._conninfo) as conn:
            retrying(lambda c: _write(c, records), conn)

    async def totals(self, owner: str | None = None) -> dict[str, int]:
        """As `SQLiteUsageLedger.totals`."""
        query = (
            "SELECT count(*), coalesce(sum(1 - complete), 0), coalesce(sum(input_tokens), 0), "
            "coalesce(sum(cached_tokens), 0), coalesce(sum(output_tokens), 0) FROM usage"
        )
        params: tuple[Any, ...] = ()
        if owner is not None:
            query += " WHERE owner = %s"
            params = (owner,)

        def run(conn: Conn) -> dict[str, int]:
            row = conn.execute(query, params).fetchone()
            assert row is not None
            return {key: int(value) for key, value in zip(_TOTAL_KEYS, row, strict=True)}

        return await self._run(run)

    async def rows(self, response_id: str | None = None) -> list[UsageRecord]:
        """Every row (or one response's), ordered by `(response_id, step)`."""
        query = f"SELECT {_COLUMNS} FROM usage"
        params: tuple[Any, ...] = ()
        if response_id is not None:
            query += " WHERE response_id = %s"
            params = (response_id,)
        query += " ORDER BY response_id, step"

        def run(conn: Conn) -> list[UsageRecord]:
            return [_record(row) for row in conn.execute(query, params)]

        return await self._run(run)

    async def count(self) -> int:
        return await self._count_rows("usage")


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
