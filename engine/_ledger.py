"""Usage ledgers: the ledger's table and statements written once over a `_sql.Dialect`, run on
SQLite here (`SQLiteUsageLedger`, embedded and durable) and on PostgreSQL in `_pg_ledger.py`;
and `MemoryUsageLedger`.

The ledger records one `UsageRecord` per sampling step, keyed by `(response_id, step)`. Work
that was done counts even if the client never saw it, so an interrupted step (disconnect,
cancellation) is recorded with `complete=False` from a shielded cleanup through the blocking
`record_sync`; if the step is later recorded again as complete, that record wins.

Idempotency, the same for every implementation (the SQL ones by one `INSERT ... ON CONFLICT
... DO UPDATE ... WHERE` statement):

- one row per `(response_id, step)`, whatever the number of times it is recorded;
- a `complete=True` record replaces a stored `complete=False` one;
- otherwise the stored row is kept (first write wins): a `complete=False` record never
  overwrites a complete one, and retries of an identical record are no-ops.

Records in one `record` call are applied in order in one transaction: after `record` returns
they are committed (visible to any new connection, and kept across a crash of the process;
across a power loss too with `synchronous="FULL"`).

SQLite access: `record` and the queries run in trio's worker threads on one dedicated
connection, one call at a time under a `trio.Lock`. `record_sync` runs in the caller's thread
on its own short-lived connection and never touches that lock, so it works while an async call
is in flight (it waits at most `busy_timeout` seconds for SQLite's write lock).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import ClassVar, TypeAlias, TypeVar

import attrs
import trio

from ._interfaces import UsageRecord
from ._memory import MemoryResource
from ._sql import SQLITE, Connection, Dialect, count_rows, upsert
from ._store import (
    DEFAULT_BUSY_TIMEOUT,
    Synchronous,
    _SQLiteResource,
    connect,
    ensure_schema,
    in_transaction,
)

__all__ = [
    "USAGE_SCHEMA",
    "USAGE_SCHEMA_VERSION",
    "MemoryUsageLedger",
    "SQLiteUsageLedger",
    "open_sqlite_ledger",
]

T = TypeVar("T")

# The usage ledger's table, one statement per entry (slots: `_sql.Dialect.sql`). One row per
# sampling step; `owner` is NULL when auth is off; `complete` is 0 for an interrupted step;
# `created_at` is unix seconds. The (owner, created_at) index serves billing queries ("usage of
# owner X this month"); rows are small, so the table is clustered on its key where the database
# can (SQLite's WITHOUT ROWID).
_USAGE_SCHEMA: tuple[str, ...] = (
    """
    CREATE TABLE usage (
        response_id   TEXT NOT NULL,
        step          INTEGER NOT NULL,
        owner         TEXT,
        model         TEXT NOT NULL,
        input_tokens  {big_int} NOT NULL,
        cached_tokens {big_int} NOT NULL,
        output_tokens {big_int} NOT NULL,
        complete      {small_int} NOT NULL CHECK (complete IN (0, 1)),
        created_at    {double} NOT NULL,
        PRIMARY KEY (response_id, step)
    ){clustered}""",
    "CREATE INDEX usage_owner_created ON usage (owner, created_at)",
)


def usage_schema(dialect: Dialect) -> tuple[str, ...]:
    """The usage ledger's table and index in `dialect`."""
    return tuple(dialect.sql(statement) for statement in _USAGE_SCHEMA)


USAGE_SCHEMA_VERSION = 1

# The SQLite ledger's schema (version `USAGE_SCHEMA_VERSION`).
USAGE_SCHEMA = usage_schema(SQLITE)

# Upgrades from an older schema version: {from_version: statements to reach from_version + 1}.
USAGE_MIGRATIONS: dict[int, tuple[str, ...]] = {}

_KEY = ("response_id", "step")
_COLUMNS = (
    *_KEY,
    "owner",
    "model",
    "input_tokens",
    "cached_tokens",
    "output_tokens",
    "complete",
    "created_at",
)
_TOTALS = (
    "SELECT count(*), coalesce(sum(1 - complete), 0), coalesce(sum(input_tokens), 0), "
    "coalesce(sum(cached_tokens), 0), coalesce(sum(output_tokens), 0) FROM usage"
)
_ROWS = f"SELECT {', '.join(_COLUMNS)} FROM usage"
_ORDER = " ORDER BY response_id, step"


@attrs.frozen
class UsageSQL:
    """The ledger's statements (templates, or in one dialect: `Dialect.render`)."""

    record: str
    totals: str
    totals_of: str
    rows: str
    rows_of: str


USAGE_SQL = UsageSQL(
    # The idempotency rule, in SQL: replace a stored row only by a complete record over an
    # incomplete row.
    record=upsert("usage", _COLUMNS, _KEY, where="excluded.complete > usage.complete"),
    totals=_TOTALS,
    totals_of=f"{_TOTALS} WHERE owner = ?",
    rows=_ROWS + _ORDER,
    rows_of=f"{_ROWS} WHERE response_id = ?{_ORDER}",
)


_Row: TypeAlias = tuple[str, int, str | None, str, int, int, int, int, float]


def _params(record: UsageRecord) -> _Row:
    return (
        record.response_id,
        record.step,
        record.owner,
        record.model,
        record.input_tokens,
        record.cached_tokens,
        record.output_tokens,
        int(record.complete),
        record.created_at,
    )


def _record(row: _Row) -> UsageRecord:
    response_id, step, owner, model, input_tokens, cached, output_tokens, complete, created = row
    return UsageRecord(
        response_id=response_id,
        step=step,
        owner=owner,
        model=model,
        input_tokens=input_tokens,
        cached_tokens=cached,
        output_tokens=output_tokens,
        complete=bool(complete),
        created_at=created,
    )


def _key(record: UsageRecord) -> tuple[str, int]:
    return record.response_id, record.step


def _write(sql: UsageSQL, records: Sequence[UsageRecord], conn: Connection) -> None:
    """In the caller's transaction, in key order: every writer locks rows in the same order, so
    two batches over the same rows never deadlock (PostgreSQL). The sort is stable, so the
    records of one key keep their order, which is all the outcome depends on (records of
    different keys are independent)."""
    conn.cursor().executemany(sql.record, [_params(r) for r in sorted(records, key=_key)])


def _supersedes(new: UsageRecord, old: UsageRecord | None) -> bool:
    """The idempotency rule: does `new` replace the stored `old`?"""
    return old is None or (new.complete and not old.complete)


_TOTAL_KEYS = ("records", "incomplete", "input_tokens", "cached_tokens", "output_tokens")


class SQLUsageLedger:
    """The `UsageLedger` operations over `_sql`'s statements, each one call of the resource's
    `_run` (a worker thread with a connection); writes go through `_write_batch` (one
    transaction, async) and `_write_batch_now` (one transaction on a connection of its own, in
    the calling thread), the resource's."""

    _what = "usage ledger"
    _sql: ClassVar[UsageSQL]

    async def _run(self, fn: Callable[[Connection], T]) -> T:
        raise NotImplementedError  # pragma: no cover (the resource's)

    def _check_open(self) -> object:
        raise NotImplementedError  # pragma: no cover (the resource's)

    async def _write_batch(self, write: Callable[[Connection], None]) -> None:
        raise NotImplementedError  # pragma: no cover (the backend's)

    def _write_batch_now(self, write: Callable[[Connection], None]) -> None:
        raise NotImplementedError  # pragma: no cover (the backend's)

    async def record(self, records: Sequence[UsageRecord]) -> None:
        """Record a batch in one transaction; committed when this returns."""
        if not records:
            return
        await self._write_batch(partial(_write, self._sql, list(records)))

    def record_sync(self, records: Sequence[UsageRecord]) -> None:
        """Record a batch, blocking the calling thread, on a connection of its own (so it never
        waits for the async path's lock or pool; SQLite: only for its write lock, up to
        `busy_timeout`). For the last word of a cancelled rollout, from a shielded cleanup."""
        self._check_open()
        if not records:
            return
        self._write_batch_now(partial(_write, self._sql, records))

    async def totals(self, owner: str | None = None) -> dict[str, int]:
        """Sums over the ledger: `records`, `incomplete` (rows with complete=0),
        `input_tokens`, `cached_tokens`, `output_tokens`. `owner=None` sums every row (with
        auth off, every row has owner None); otherwise only that owner's."""
        query, params = (self._sql.totals, ()) if owner is None else (self._sql.totals_of, (owner,))

        def run(conn: Connection) -> dict[str, int]:
            row = conn.execute(query, params).fetchone()
            return {key: int(value) for key, value in zip(_TOTAL_KEYS, row, strict=True)}

        return await self._run(run)

    async def rows(self, response_id: str | None = None) -> list[UsageRecord]:
        """Every row (or one response's), ordered by `(response_id, step)`."""
        query, params = (
            (self._sql.rows, ()) if response_id is None else (self._sql.rows_of, (response_id,))
        )

        def run(conn: Connection) -> list[UsageRecord]:
            return [_record(row) for row in conn.execute(query, params)]

        return await self._run(run)

    async def count(self) -> int:
        return await self._run(lambda conn: count_rows(conn, "usage"))


class SQLiteUsageLedger(_SQLiteResource, SQLUsageLedger):
    """A `UsageLedger` in one SQLite file. Make one with `open_sqlite_ledger()`."""

    _sql = SQLITE.render(USAGE_SQL)

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        *,
        synchronous: Synchronous = "NORMAL",
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    ) -> None:
        super().__init__(conn, path)
        self._synchronous: Synchronous = synchronous
        self._busy_timeout = busy_timeout

    async def _write_batch(self, write: Callable[[Connection], None]) -> None:
        await self._run(partial(in_transaction, write))

    def _write_batch_now(self, write: Callable[[Connection], None]) -> None:
        conn = connect(self.path, synchronous=self._synchronous, busy_timeout=self._busy_timeout)
        try:
            in_transaction(write, conn)
        finally:
            conn.close()


async def open_sqlite_ledger(
    path: str | Path,
    *,
    synchronous: Synchronous = "NORMAL",
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
) -> SQLiteUsageLedger:
    """Open (creating directories, file and tables as needed) a usage ledger. Close it with
    `aclose()`, or use it as `async with await open_sqlite_ledger(path) as ledger:`. The file
    may be the response store's."""
    file = Path(path)

    def run() -> sqlite3.Connection:
        file.parent.mkdir(parents=True, exist_ok=True)
        conn = connect(file, synchronous=synchronous, busy_timeout=busy_timeout)
        try:
            ensure_schema(
                conn,
                component="usage",
                version=USAGE_SCHEMA_VERSION,
                schema=USAGE_SCHEMA,
                migrations=USAGE_MIGRATIONS,
            )
        except BaseException:
            conn.close()
            raise
        return conn

    conn = await trio.to_thread.run_sync(run)
    return SQLiteUsageLedger(conn, file, synchronous=synchronous, busy_timeout=busy_timeout)


class MemoryUsageLedger(MemoryResource):
    """A `UsageLedger` in a dict, with the same idempotency rule as `SQLiteUsageLedger`."""

    _what = "usage ledger"

    def __init__(self) -> None:
        super().__init__()
        self._rows: dict[tuple[str, int], UsageRecord] = {}

    async def record(self, records: Sequence[UsageRecord]) -> None:
        await self._checkpoint()
        self.record_sync(records)

    def record_sync(self, records: Sequence[UsageRecord]) -> None:
        self._check_open()
        for new in records:
            key = (new.response_id, new.step)
            if _supersedes(new, self._rows.get(key)):
                self._rows[key] = new

    async def totals(self, owner: str | None = None) -> dict[str, int]:
        await self._checkpoint()
        rows = [r for r in self._rows.values() if owner is None or r.owner == owner]
        return {
            "records": len(rows),
            "incomplete": sum(not r.complete for r in rows),
            "input_tokens": sum(r.input_tokens for r in rows),
            "cached_tokens": sum(r.cached_tokens for r in rows),
            "output_tokens": sum(r.output_tokens for r in rows),
        }

    async def rows(self, response_id: str | None = None) -> list[UsageRecord]:
        await self._checkpoint()
        return [
            self._rows[key]
            for key in sorted(self._rows)
            if response_id is None or key[0] == response_id
        ]

    async def count(self) -> int:
        await self._checkpoint()
        return len(self._rows)
