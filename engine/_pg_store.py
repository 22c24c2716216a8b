"""`PostgresResponseStore`: the response store in a PostgreSQL database that several rollout
processes (on one host or many) share.

The same rules as `SQLiteResponseStore` (`_store.py`), with the same table shape (`BYTEA` for
the body and the rendered segments, `_segments.py`):

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
from typing import TypeAlias

import trio
from rollout.protocol import Item

from ._interfaces import StoredResponse
from ._pg import DEFAULT_POOL_SIZE, Conn, PostgresResource, open_pool
from ._store import (
    MAX_CHAIN_DEPTH,
    _broken_chain,
    _check_depth,
    _decode,
    _decode_item,
    _encode,
    _encode_item,
    _not_stored,
    backfilled_items,
)

__all__ = [
    "POSTGRES_RESPONSES_SCHEMA",
    "POSTGRES_RESPONSES_SCHEMA_VERSION",
    "PostgresResponseStore",
    "open_postgres_store",
]

POSTGRES_RESPONSES_SCHEMA_VERSION = 2

# The response store's schema (version `POSTGRES_RESPONSES_SCHEMA_VERSION`): the columns of
# `_store.RESPONSES_SCHEMA` (see there), and `secrets`: values made once and shared by every
# process (name -> bytes; the first process to store a name wins).
POSTGRES_RESPONSES_SCHEMA: tuple[str, ...] = (
    """
    CREATE TABLE responses (
        id         TEXT PRIMARY KEY,
        owner      TEXT,
        parent_id  TEXT,
        is_root    SMALLINT NOT NULL CHECK (is_root IN (0, 1)),
        created_at BIGINT NOT NULL,
        body       BYTEA NOT NULL,
        rendered   BYTEA
    )""",
    """
    CREATE TABLE items (
        id          TEXT NOT NULL,
        response_id TEXT NOT NULL,
        owner       TEXT,
        body        BYTEA NOT NULL,
        CONSTRAINT items_owner_id_key UNIQUE NULLS NOT DISTINCT (owner, id)
    )""",
    "CREATE INDEX items_by_response ON items (response_id)",
    _ITEMS_BY_ID := "CREATE INDEX items_by_id ON items (id)",
    """
    CREATE TABLE secrets (
        name  TEXT PRIMARY KEY,
        value BYTEA NOT NULL
    )""",
)

_BACKFILL_MARK = "items_backfill_pending"
# Responses' bodies read per round trip while putting items back (a server-side cursor).
_BACKFILL_BATCH = 500

# Items are keyed by (owner, id) (version 2; see `_store.RESPONSES_SCHEMA`): NULL owners (auth
# off) are one owner (`NULLS NOT DISTINCT`, PostgreSQL 15). Lookups compare owners with `IS NOT
# DISTINCT FROM`, which no index serves: they find the id through `items_by_id` (one row per
# owner that stored it), then the owner.

# Upgrades from an older schema version: {from_version: statements to reach from_version + 1}.
POSTGRES_RESPONSES_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "ALTER TABLE items DROP CONSTRAINT items_pkey",
        "ALTER TABLE items ADD CONSTRAINT items_owner_id_key UNIQUE NULLS NOT DISTINCT (owner, id)",
        _ITEMS_BY_ID,
        # The items an id-keyed table left out are put back from the bodies once the store is
        # open (`_backfill_items`): this marks that the upgrade happened.
        f"INSERT INTO secrets (name, value) VALUES ('{_BACKFILL_MARK}', '\\x01'::bytea) "
        "ON CONFLICT (name) DO NOTHING",
    ),
}

_PUT = """
INSERT INTO responses (id, owner, parent_id, is_root, created_at, body, rendered)
VALUES (%s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (id) DO UPDATE SET
    parent_id = excluded.parent_id,
    is_root = excluded.is_root,
    created_at = excluded.created_at,
    body = excluded.body,
    rendered = excluded.rendered
WHERE responses.owner IS NOT DISTINCT FROM excluded.owner
"""
_PUT_ITEM = (
    "INSERT INTO items (id, response_id, owner, body) VALUES (%s, %s, %s, %s) "
    "ON CONFLICT (owner, id) DO NOTHING"
)
_GET = (
    "SELECT id, owner, parent_id, is_root, body, rendered FROM responses "
    "WHERE id = %s AND owner IS NOT DISTINCT FROM %s"
)
_DELETE = "DELETE FROM responses WHERE id = %s AND owner IS NOT DISTINCT FROM %s"
_DELETE_ITEMS = "DELETE FROM items WHERE response_id = %s AND owner IS NOT DISTINCT FROM %s"
_GET_ITEM = "SELECT body FROM items WHERE id = %s AND owner IS NOT DISTINCT FROM %s"

# As `_store._CHAIN`: the response, then each parent while the previous row is not a root.
_CHAIN = """
WITH RECURSIVE chain (depth, id, owner, parent_id, is_root, body, rendered) AS (
    SELECT 0, id, owner, parent_id, is_root, body, rendered
    FROM responses WHERE id = %(id)s AND owner IS NOT DISTINCT FROM %(owner)s
    UNION ALL
    SELECT chain.depth + 1, r.id, r.owner, r.parent_id, r.is_root, r.body, r.rendered
    FROM chain JOIN responses AS r
        ON r.id = chain.parent_id AND r.owner IS NOT DISTINCT FROM %(owner)s
    WHERE chain.is_root = 0 AND chain.depth + 1 < %(max_depth)s
)
SELECT id, owner, parent_id, is_root, body, rendered FROM chain ORDER BY depth
"""

_SECRET_PUT = "INSERT INTO secrets (name, value) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING"
_SECRET_GET = "SELECT value FROM secrets WHERE name = %s"

_Row: TypeAlias = tuple[str, str | None, str | None, int, bytes, bytes | None]


class PostgresResponseStore(PostgresResource):
    """A `ResponseStore` in a PostgreSQL database. Make one with `open_postgres_store()`."""

    _what = "response store"

    async def put(self, stored: StoredResponse) -> None:
        """Store (or replace: last write wins) a response and its items, in one transaction.
        Raises `ValueError` if the id is already stored under another owner."""
        response_id = stored.response.id

        def run(conn: Conn) -> int:
            cursor = conn.execute(
                _PUT,
                (
                    response_id,
                    stored.owner,
                    stored.parent_id,
                    int(stored.is_root),
                    stored.response.created_at,
                    _encode(stored),
                    stored.rendered,
                ),
            )
            if cursor.rowcount:
                items = [
                    (item.id, response_id, stored.owner, _encode_item(item))
                    for item in stored.items
                    if getattr(item, "id", None) is not None
                ]
                if items:
                    conn.cursor().executemany(_PUT_ITEM, items)
            return cursor.rowcount

        if await self._run(run) == 0:
            raise ValueError(f"response {response_id!r} is already stored under another owner")

    async def get(self, response_id: str, *, owner: str | None) -> StoredResponse | None:
        def run(conn: Conn) -> _Row | None:
            row: _Row | None = conn.execute(_GET, (response_id, owner)).fetchone()
            return row

        row = await self._run(run)
        return None if row is None else _decode(row)

    async def delete(self, response_id: str, *, owner: str | None) -> bool:
        def run(conn: Conn) -> bool:
            deleted = conn.execute(_DELETE, (response_id, owner)).rowcount > 0
            if deleted:
                conn.execute(_DELETE_ITEMS, (response_id, owner))
            return deleted

        return await self._run(run)

    async def get_item(self, item_id: str, *, owner: str | None) -> Item | None:
        """An item a stored response added, by its id (owner isolation as for responses)."""

        def run(conn: Conn) -> bytes | None:
            row = conn.execute(_GET_ITEM, (item_id, owner)).fetchone()
            return None if row is None else bytes(row[0])

        blob = await self._run(run)
        return None if blob is None else _decode_item(blob)

    async def get_chain(
        self, response_id: str, *, owner: str | None, max_depth: int = MAX_CHAIN_DEPTH
    ) -> list[StoredResponse]:
        """As `SQLiteResponseStore.get_chain`: newest first, down to the first root; one
        query. Raises `LookupError` for a missing (or foreign) response or parent, or no root
        within `max_depth` responses."""
        _check_depth(max_depth)

        def run(conn: Conn) -> list[StoredResponse]:
            rows: list[_Row] = conn.execute(
                _CHAIN, {"id": response_id, "owner": owner, "max_depth": max_depth}
            ).fetchall()
            if not rows:
                raise _not_stored(response_id)
            last_id, _, last_parent, last_is_root, _, _ = rows[-1]
            if not last_is_root and last_parent is not None:
                raise _broken_chain(response_id, len(rows), last_id, last_parent, max_depth)
            return [_decode(row) for row in rows]  # in the worker thread, as SQLite does

        return await self._run(run)

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

    async def count(self) -> int:
        """How many responses are stored (all owners); for tests and metrics."""
        return await self._count_rows("responses")


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
                conn.cursor().executemany(_PUT_ITEM, items)
