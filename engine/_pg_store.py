"""`PostgresResponseStore`: the response store in a PostgreSQL database that several rollout
processes (on one host or many) share.

The same statements, operations and table shape as `SQLiteResponseStore` (`_store.py`, written
once over `_sql.Dialect`: `BYTEA` for the body and the rendered segments), so the same rules:

- **Idempotent put, last write wins**; a put never moves an id to another owner (the upsert's
  `WHERE` compares owners with `IS NOT DISTINCT FROM`, so owner NULL, auth off, matches NULL).
- **All or nothing**: a put writes the response and its items in one transaction, and a
  delete removes both in one; once `put` returns the response is committed, so every process
  sees it (a follow-up landing on another process hydrates it).
- **Owner isolation** for `get`, `get_chain`, `get_item` and `delete`; items keyed by
  (owner, id), so another owner's item with the same (client-chosen) id is another row.
- **One round trip per chain**: `get_chain` is one recursive query bounded by `max_depth`.

It also keeps secrets that every process must share (`shared_secret`: the key sealing
compaction items, so one process opens what another sealed).

Errors: `psycopg.Error` (the server down: `psycopg.OperationalError`; no free connection in
time: `psycopg_pool.PoolTimeout`) propagates unchanged, as `sqlite3.Error` does from the SQLite
store; the rest as in `_store.py` (`LookupError`, `ValueError`, `RuntimeError` for a newer
schema, `trio.ClosedResourceError` after `aclose()`). Threads, pool and timeouts: `_pg.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import trio

from ._pg import DEFAULT_POOL_SIZE, Conn, PostgresResource, open_pool
from ._sql import POSTGRES
from ._store import ITEMS_BY_ID, RESPONSE_SQL, SQLResponseStore, backfilled_items, responses_schema

T = TypeVar("T")

__all__ = [
    "POSTGRES_RESPONSES_SCHEMA",
    "POSTGRES_RESPONSES_SCHEMA_VERSION",
    "PostgresResponseStore",
    "open_postgres_store",
]

POSTGRES_RESPONSES_SCHEMA_VERSION = 2

# The response store's schema (version `POSTGRES_RESPONSES_SCHEMA_VERSION`): the tables of
# `_store.responses_schema` (see there), and `secrets`: values made once and shared by every
# process (name -> bytes; the first process to store a name wins).
POSTGRES_RESPONSES_SCHEMA: tuple[str, ...] = (
    *responses_schema(POSTGRES),
    """
    CREATE TABLE secrets (
        name  TEXT PRIMARY KEY,
        value BYTEA NOT NULL
    )""",
)

_BACKFILL_MARK = "items_backfill_pending"
# Responses' bodies read per round trip while putting items back (a server-side cursor).
_BACKFILL_BATCH = 500

# Upgrades from an older schema version: {from_version: statements to reach from_version + 1}.
# Version 2 keyed the items by (owner, id) (see `_store.responses_schema`).
POSTGRES_RESPONSES_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "ALTER TABLE items DROP CONSTRAINT items_pkey",
        "ALTER TABLE items ADD CONSTRAINT items_owner_id_key UNIQUE NULLS NOT DISTINCT (owner, id)",
        ITEMS_BY_ID,
        # The items an id-keyed table left out are put back from the bodies once the store is
        # open (`_backfill_items`): this marks that the upgrade happened.
        f"INSERT INTO secrets (name, value) VALUES ('{_BACKFILL_MARK}', '\\x01'::bytea) "
        "ON CONFLICT (name) DO NOTHING",
    ),
}

_SECRET_PUT = "INSERT INTO secrets (name, value) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING"
_SECRET_GET = "SELECT value FROM secrets WHERE name = %s"


class PostgresResponseStore(PostgresResource, SQLResponseStore):
    """A `ResponseStore` in a PostgreSQL database. Make one with `open_postgres_store()`."""

    _sql = POSTGRES.render(RESPONSE_SQL)

    async def _write(self, fn: Callable[[Conn], T]) -> T:
        return await self._run(fn)  # a call is one transaction already (`PostgresResource`)

    async def shared_secret(self, name: str, *, size: int = 32) -> bytes:
        """A random secret of `size` bytes made by the first process to ask for `name`; every
        process gets that same value."""
        candidate = os.urandom(size)

        def run(conn: Conn) -> bytes:
            conn.execute(_SECRET_PUT, (name, candidate))
            row = conn.execute(_SECRET_GET, (name,)).fetchone()
            assert row is not None
            return bytes(row[0])

        return await self._run(run)


async def open_postgres_store(
    url: str, *, pool_size: int = DEFAULT_POOL_SIZE
) -> PostgresResponseStore:
    """Open a response store in the PostgreSQL database at `url` (`postgresql://...`, any libpq
    URL), creating or upgrading its tables. Close it with `aclose()`, or use it as
    `async with await open_postgres_store(url) as store:`. At most `pool_size` connections."""
    pool, conninfo = await open_pool(
        url,
        component="responses",
        version=POSTGRES_RESPONSES_SCHEMA_VERSION,
        schema=POSTGRES_RESPONSES_SCHEMA,
        migrations=POSTGRES_RESPONSES_MIGRATIONS,
        pool_size=pool_size,
    )
    store = PostgresResponseStore(pool, conninfo)
    try:
        await store._run(_backfill_items)
    except BaseException:
        with trio.CancelScope(shield=True):
            await store.aclose()
        raise
    return store


def _backfill_items(conn: Conn) -> None:
    """After the upgrade to items keyed by (owner, id), once (the first process to take the
    mark does it, the others wait for its transaction and find none): the items the id-keyed
    table left out, from the responses' bodies in the order they were created."""
    if conn.execute(f"DELETE FROM secrets WHERE name = '{_BACKFILL_MARK}'").rowcount == 0:
        return
    with conn.cursor(name="rollout_items_backfill") as rows:
        rows.execute("SELECT id, owner, body FROM responses ORDER BY created_at, id")
        while batch := rows.fetchmany(_BACKFILL_BATCH):
            items = list(backfilled_items(batch))
            if items:
                conn.cursor().executemany(PostgresResponseStore._sql.put_item, items)
