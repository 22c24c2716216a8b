"""Usage ledgers: `SQLiteUsageLedger` (embedded, durable) and `MemoryUsageLedger`.

The ledger records one `UsageRecord` per sampling step, keyed by `(response_id, step)`. Work
that was done counts even if the client never saw it, so an interrupted step (disconnect,
cancellation) is recorded with `complete=False` from a shielded cleanup through the blocking
`record_sync`; if the step is later recorded again as complete, that record wins.

Idempotency, the same for both implementations (and any shared one, e.g. PostgreSQL with the
same `INSERT ... ON CONFLICT ... DO UPDATE ... WHERE` statement):

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

import trio

from ._interfaces import UsageRecord
from ._memory import MemoryResource
from ._store import (
    DEFAULT_BUSY_TIMEOUT,
    Synchronous,
    _SQLiteResource,
    connect,
    ensure_schema,
)

__all__ = [
    "USAGE_SCHEMA",
    "USAGE_SCHEMA_VERSION",
    "MemoryUsageLedger",
    "SQLiteUsageLedger",
    "open_sqlite_ledger",
]

USAGE_SCHEMA_VERSION = 1

# The usage ledger's schema (version `USAGE_SCHEMA_VERSION`), one statement per entry. One row
# per sampling step; `owner` is NULL when auth is off; `complete` is 0 for an interrupted step;
# `created_at` is unix seconds. The (owner, created_at) index serves billing queries ("usage of
# owner X this month"); rows are small, so the table is clustered on its key (WITHOUT ROWID).
USAGE_SCHEMA: tuple[str, ...] = (
    """
    CREATE TABLE usage (
        response_id   TEXT NOT NULL,
        step          INTEGER NOT NULL,
        owner         TEXT,
        model         TEXT NOT NULL,
        input_tokens  INTEGER NOT NULL,
        cached_tokens INTEGER NOT NULL,
        output_tokens INTEGER NOT NULL,
        complete      INTEGER NOT NULL CHECK (complete IN (0, 1)),
        created_at    REAL NOT NULL,
        PRIMARY KEY (response_id, step)
    ) WITHOUT ROWID""",
    "CREATE INDEX usage_owner_created ON usage (owner, created_at)",
)

# Upgrades from an older schema version: {from_version: statements to reach from_version + 1}.
USAGE_MIGRATIONS: dict[int, tuple[str, ...]] = {}

_COLUMNS = (
    "response_id, step, owner, model, input_tokens, cached_tokens, output_tokens, complete, "
    "created_at"
)

# The idempotency rule, in SQL: replace a stored row only by a complete record over an
# incomplete row.
_RECORD = f"""
INSERT INTO usage ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
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


def _write(conn: sqlite3.Connection, records: Sequence[UsageRecord]) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(_RECORD, [_params(r) for r in records])
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _supersedes(new: UsageRecord, old: UsageRecord | None) -> bool:
    """The idempotency rule: does `new` replace the stored `old`?"""
    return old is None or (new.complete and not old.complete)


_TOTAL_KEYS = ("records", "incomplete", "input_tokens", "cached_tokens", "output_tokens")


class SQLiteUsageLedger(_SQLiteResource):
    """A `UsageLedger` in one SQLite file. Make one with `open_sqlite_ledger()`."""

    _what = "usage ledger"

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

    async def record(self, records: Sequence[UsageRecord]) -> None:
        """Record a batch in one transaction; committed when this returns."""
        if not records:
            return
        batch = list(records)
        await self._run(lambda conn: _write(conn, batch))

    def record_sync(self, records: Sequence[UsageRecord]) -> None:
        """Record a batch, blocking the calling thread, on a fresh connection (so it never
        waits for the async path's lock, only for SQLite's write lock, up to `busy_timeout`).
        For the last word of a cancelled rollout, from a shielded cleanup."""
        self._check_open()
        if not records:
            return
        conn = connect(self.path, synchronous=self._synchronous, busy_timeout=self._busy_timeout)
        try:
            _write(conn, records)
        finally:
            conn.close()

    async def totals(self, owner: str | None = None) -> dict[str, int]:
        """Sums over the ledger: `records`, `incomplete` (rows with complete=0),
        `input_tokens`, `cached_tokens`, `output_tokens`. `owner=None` sums every row (with
        auth off, every row has owner None); otherwise only that owner's."""
        query = (
            "SELECT count(*), coalesce(sum(1 - complete), 0), coalesce(sum(input_tokens), 0), "
            "coalesce(sum(cached_tokens), 0), coalesce(sum(output_tokens), 0) FROM usage"
        )
        params: tuple[Any, ...] = ()
        if owner is not None:
            query += " WHERE owner = ?"
            params = (owner,)

        def run(conn: sqlite3.Connection) -> dict[str, int]:
            row = conn.execute(query, params).fetchone()
            return {key: int(value) for key, value in zip(_TOTAL_KEYS, row, strict=True)}

        return await self._run(run)

    async def rows(self, response_id: str | None = None) -> list[UsageRecord]:
        """Every row (or one response's), ordered by `(response_id, step)`."""
        query = f"SELECT {_COLUMNS} FROM usage"
        params: tuple[Any, ...] = ()
        if response_id is not None:
            query += " WHERE response_id = ?"
            params = (response_id,)
        query += " ORDER BY response_id, step"

        def run(conn: sqlite3.Connection) -> list[UsageRecord]:
            return [_record(row) for row in conn.execute(query, params)]

        return await self._run(run)

    async def count(self) -> int:
        return await self._count_rows("usage")


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
