"""Response stores in SQL: the store's tables and queries written once over a `_sql.Dialect`,
run on SQLite here (`SQLiteResponseStore`, embedded and durable) and on PostgreSQL in
`_pg_store.py`; `MemoryResponseStore` is in `_memory.py`.

A store keeps the responses created with `store=true` so that a later request can name one as
`previous_response_id` and the engine can rebuild (hydrate) its context by walking parents up to
a root (`get_chain`). Stores are injected as the `ResponseStore` Protocol; the PostgreSQL one
serves several rollout processes behind a load balancer, where a follow-up request may land on
a process that never saw the parent.

Both SQL stores run the same statements (`ResponseSQL`) and operations (`SQLResponseStore`) on
the same table shape (`responses_schema`), and keep what the tests check for every store:

- **Idempotent put, last write wins**: `put` is an upsert on the response id
  (`INSERT ... ON CONFLICT (id) DO UPDATE ... WHERE` the owner is unchanged), so the
  post-inference queue may retry a write and a response may be re-stored with a later status;
  exactly one row per id remains.
- **Owner isolation**: a response stored by owner A is invisible to owner B for `get`,
  `get_chain` (a parent owned by someone else is a missing parent) and `delete`, and a `put`
  never moves an id to another owner. Owner `None` means "auth off" and matches only rows
  stored with owner `None`: owners are compared NULL-safely (`IS`, `IS NOT DISTINCT FROM`),
  never with `=`, which is never true for NULLs.
- **Items per owner**: the items table (`item_reference` lookups) is keyed by (owner, id):
  item ids may be chosen by the client, and another owner storing an id first changes
  nothing for this owner.
- **One round trip per chain**: `get_chain` is one recursive CTE, bounded by `max_depth`, so a
  deep history is not N queries across a network.

SQLite access: one dedicated connection in WAL mode, used from trio's worker threads
(`trio.to_thread.run_sync`) one call at a time under a `trio.Lock`; encoding and decoding run in
that worker thread too, so a large root response does not stall the event loop. Worker calls
are not abandoned on cancellation: a write that started finishes (or rolls back) before the
cancelled task unwinds, so the connection is never left mid-transaction.

Errors: `sqlite3.Error` from the database propagates unchanged; a missing or too-deep chain
raises `LookupError`; a `put` of an id stored under another owner, or a body that does not
decode, raises `ValueError`; a file from a newer schema raises `RuntimeError`; use after
`aclose()` raises `trio.ClosedResourceError`. (To be mapped onto the engine's exceptions module
at its boundary.)
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar

import attrs
import msgpack
import trio
from rollout.protocol import Item, RemoteProtocolError, Response, Tool, from_wire, to_wire

from ._interfaces import StoredResponse
from ._sql import SQLITE, Connection, Dialect, count_rows, migrate, upsert

__all__ = [
    "DEFAULT_BUSY_TIMEOUT",
    "MAX_CHAIN_DEPTH",
    "RESPONSES_SCHEMA",
    "RESPONSES_SCHEMA_VERSION",
    "SQLiteResponseStore",
    "open_sqlite_store",
]

T = TypeVar("T")

Synchronous: TypeAlias = Literal["NORMAL", "FULL"]

# The longest chain `get_chain` follows, counting the response itself. A chain is one response
# per turn between roots; agent rollouts run to a few hundred turns, so 10,000 is far beyond any
# real conversation while still bounding the work (and the memory of the recursive query) that
# one request can cause, including on a corrupted file whose parent pointers form a cycle.
MAX_CHAIN_DEPTH = 10_000

# How long (seconds) a connection waits for another connection's write lock before failing
# with "database is locked". Writers here hold the lock for milliseconds (one upsert, or one
# batch of usage rows); other processes sharing the file (or the ledger's `record_sync`) may
# queue behind them. Five seconds rides out a burst without hanging a caller forever.
DEFAULT_BUSY_TIMEOUT = 5.0

# --- the tables, for both databases ----------------------------------------------------------

# The response store's tables, one statement per entry (slots: `_sql.Dialect.sql`).
#   id          the response id (`resp_...`), the only lookup key.
#   owner       who stored it (the authenticated principal); NULL when auth is off.
#   parent_id   `previous_response_id` of the response, NULL for a conversation's first.
#   is_root     1 when `body` holds the whole conversation (hydration stops here).
#   created_at  `Response.created_at` (unix seconds), for retention sweeps.
#   body        msgpack map {"response", "items", "instructions", "tools"}: the wire
#               (`protocol.to_wire`) form of each; decoded leniently (unknown keys ignored) so
#               that a file written by a newer rollout that added fields still reads.
#   rendered    the rendering of the items (`_segments.py`: msgpack, versioned by template
#               and tokenizer), NULL when not kept; read only to hydrate.
# Hydration follows parent pointers through the primary key, so no other index is needed.
_RESPONSES_TABLE = """
    CREATE TABLE responses (
        id         TEXT PRIMARY KEY,
        owner      TEXT,
        parent_id  TEXT,
        is_root    {small_int} NOT NULL CHECK (is_root IN (0, 1)),
        created_at {big_int} NOT NULL,
        body       {blob} NOT NULL,
        rendered   {blob}
    )"""
# items: every item with an id that a stored response added (its input and output), for
# `item_reference`, keyed by owner and id: item ids may be chosen by the client, so an owner's
# first response to store an id keeps it, and another owner's item with the same id is another
# row (keyed by the id alone, one key storing an id first made another key's item silently
# unstored). With NULL owners (auth off) one owner: `UNIQUE NULLS NOT DISTINCT` where the
# database has it, else a unique index of the NULL owner's ids beside the (owner, id) one.
_ITEMS_TABLE = """
    CREATE TABLE items (
        owner       TEXT,
        id          TEXT NOT NULL,
        response_id TEXT NOT NULL,
        body        {blob} NOT NULL{key}
    )"""
_ITEMS_KEY_CONSTRAINT = (
    ",\n        CONSTRAINT items_owner_id_key UNIQUE NULLS NOT DISTINCT (owner, id)"
)
ITEMS_KEY = "CREATE UNIQUE INDEX items_key ON items (owner, id)"
ITEMS_KEY_ANONYMOUS = "CREATE UNIQUE INDEX items_key_anonymous ON items (id) WHERE owner IS NULL"
# A NULL-safe comparison (`IS NOT DISTINCT FROM`) is served by no index in PostgreSQL: lookups
# find the id through this one (one row per owner that stored it), then the owner.
ITEMS_BY_ID = "CREATE INDEX items_by_id ON items (id)"
ITEMS_BY_RESPONSE = "CREATE INDEX items_by_response ON items (response_id)"


def responses_schema(dialect: Dialect) -> tuple[str, ...]:
    """The response store's tables and indexes in `dialect`: responses, items, the items' key
    indexes, items by response."""
    keys: tuple[str, ...]
    if dialect.unique_nulls_not_distinct:
        key, keys = _ITEMS_KEY_CONSTRAINT, (ITEMS_BY_ID,)
    else:
        key, keys = "", (ITEMS_KEY, ITEMS_KEY_ANONYMOUS)
    return (
        dialect.sql(_RESPONSES_TABLE),
        dialect.sql(_ITEMS_TABLE.replace("{key}", key)),
        *keys,
        ITEMS_BY_RESPONSE,
    )


RESPONSES_SCHEMA_VERSION = 4

# The SQLite store's schema (version `RESPONSES_SCHEMA_VERSION`).
RESPONSES_SCHEMA = responses_schema(SQLITE)

# Upgrades from an older SQLite schema version: {from_version: statements to reach
# from_version + 1}. Version 2 added the items table, 3 the rendered column, 4 the items' key
# by owner.
RESPONSES_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """
        CREATE TABLE items (
            id          TEXT PRIMARY KEY,
            response_id TEXT NOT NULL,
            owner       TEXT,
            body        BLOB NOT NULL
        )""",
        "CREATE INDEX items_by_response ON items (response_id)",
    ),
    2: ("ALTER TABLE responses ADD COLUMN rendered BLOB",),
    # Items keyed by (owner, id): SQLite cannot change a primary key, so the table is copied.
    # Rows keep their ids (unique before, so unique per owner now).
    3: (
        "ALTER TABLE items RENAME TO items_v3",
        RESPONSES_SCHEMA[1],
        "INSERT INTO items (owner, id, response_id, body) "
        "SELECT owner, id, response_id, body FROM items_v3",
        "DROP TABLE items_v3",
        *RESPONSES_SCHEMA[2:],
    ),
}

# --- the queries, for both databases ---------------------------------------------------------

_COLUMNS = ("id", "owner", "parent_id", "is_root", "created_at", "body", "rendered")
_SELECT = "SELECT id, owner, parent_id, is_root, body, rendered FROM"

# The response, then each parent, while the previous row is not a root, up to `max_depth` rows.
# A parent owned by someone else is not joined, so it looks missing (owner isolation).
_CHAIN = """
WITH RECURSIVE chain (depth, id, owner, parent_id, is_root, body, rendered) AS (
    SELECT 0, id, owner, parent_id, is_root, body, rendered
    FROM responses WHERE id = :id AND owner {is} :owner
    UNION ALL
    SELECT chain.depth + 1, r.id, r.owner, r.parent_id, r.is_root, r.body, r.rendered
    FROM chain JOIN responses AS r ON r.id = chain.parent_id AND r.owner {is} :owner
    WHERE chain.is_root = 0 AND chain.depth + 1 < :max_depth
)
SELECT id, owner, parent_id, is_root, body, rendered FROM chain ORDER BY depth
"""


@attrs.frozen
class ResponseSQL:
    """The store's statements (templates, or in one dialect: `Dialect.render`)."""

    put: str
    put_item: str
    get: str
    delete: str
    delete_items: str
    get_item: str
    chain: str


RESPONSE_SQL = ResponseSQL(
    put=upsert(
        "responses",
        _COLUMNS,
        ("id",),
        where="responses.owner {is} excluded.owner",
        keep=("owner",),
    ),
    # The first response of an owner to store an item id keeps it.
    put_item="INSERT INTO items (id, response_id, owner, body) VALUES (?, ?, ?, ?) "
    "ON CONFLICT DO NOTHING",
    get=f"{_SELECT} responses WHERE id = ? AND owner {{is}} ?",
    delete="DELETE FROM responses WHERE id = ? AND owner {is} ?",
    delete_items="DELETE FROM items WHERE response_id = ? AND owner {is} ?",
    get_item="SELECT body FROM items WHERE id = ? AND owner {is} ?",
    chain=_CHAIN,
)


_Row: TypeAlias = tuple[str, str | None, str | None, int, bytes, bytes | None]


# --- shared SQLite plumbing (also used by the usage ledger) ----------------------------------


def connect(
    path: Path, *, synchronous: Synchronous = "NORMAL", busy_timeout: float = DEFAULT_BUSY_TIMEOUT
) -> sqlite3.Connection:
    """A connection in WAL mode and autocommit (transactions are explicit `BEGIN`s), usable
    from any thread (callers serialize access themselves)."""
    conn = sqlite3.connect(
        path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
    )
    try:
        (mode,) = conn.execute("PRAGMA journal_mode=WAL").fetchone()
        if str(mode).lower() != "wal":
            raise RuntimeError(f"{path}: could not switch SQLite to WAL mode (got {mode!r})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
    except BaseException:
        conn.close()
        raise
    return conn


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction (`BEGIN IMMEDIATE`: the write lock first), committed at the end
    of the block, rolled back if it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def in_transaction(fn: Callable[[sqlite3.Connection], T], conn: sqlite3.Connection) -> T:
    """`fn(conn)` as one write transaction (`transaction`)."""
    with transaction(conn):
        return fn(conn)


def ensure_schema(
    conn: sqlite3.Connection,
    *,
    component: str,
    version: int,
    schema: Sequence[str],
    migrations: dict[int, tuple[str, ...]],
) -> None:
    """Create `component`'s tables in an empty file, or upgrade them to `version`, atomically."""
    with transaction(conn):
        migrate(
            conn,
            SQLITE,
            component=component,
            version=version,
            schema=schema,
            migrations=migrations,
        )


class _SQLiteResource(trio.abc.AsyncResource):
    """One connection, used from worker threads one call at a time."""

    _what = "resource"

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn: sqlite3.Connection | None = conn
        self._closed = False
        self._lock = trio.Lock()
        self.path = path

    def _check_open(self) -> sqlite3.Connection:
        if self._closed or self._conn is None:
            raise trio.ClosedResourceError(f"the {self._what} at {self.path} is closed")
        return self._conn

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        self._check_open()
        async with self._lock:
            return await trio.to_thread.run_sync(fn, self._check_open())

    async def aclose(self) -> None:
        """Close the connection. Calls queued behind the lock fail with `ClosedResourceError`;
        a call in flight finishes first (shielded: at most one statement or batch). Idempotent."""
        self._closed = True
        with trio.CancelScope(shield=True):
            async with self._lock:
                conn, self._conn = self._conn, None
                if conn is not None:
                    await trio.to_thread.run_sync(conn.close)


# --- encoding --------------------------------------------------------------------------------


def _encode(stored: StoredResponse) -> bytes:
    body = {
        "response": to_wire(stored.response),
        "items": to_wire(stored.items),
        "instructions": stored.instructions,
        "tools": to_wire(stored.tools),
    }
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def _encode_item(item: Item) -> bytes:
    packed: bytes = msgpack.packb(to_wire(item), use_bin_type=True)
    return packed


def _decode_item(blob: bytes) -> Item:
    item: Item = from_wire(msgpack.unpackb(blob, raw=False), Item, strict=False)
    return item


def _decode(row: _Row) -> StoredResponse:
    response_id, owner, parent_id, is_root, blob, rendered = row
    try:
        body: Any = msgpack.unpackb(blob, raw=False)
        if not isinstance(body, dict):
            raise TypeError(f"the body is {type(body).__name__}, not a map")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise TypeError(f"instructions is {type(instructions).__name__}")
        return StoredResponse(
            response=from_wire(body["response"], Response, strict=False),
            items=from_wire(body["items"], list[Item], strict=False),
            instructions=instructions,
            tools=from_wire(body["tools"], list[Tool], strict=False),
            parent_id=parent_id,
            is_root=bool(is_root),
            owner=owner,
            rendered=rendered,
        )
    except (RemoteProtocolError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"stored response {response_id!r} could not be decoded: {exc}") from exc


def _check_depth(max_depth: int) -> None:
    if max_depth < 1:
        raise ValueError(f"max_depth must be at least 1, not {max_depth}")


def _broken_chain(
    response_id: str, length: int, last_id: str, last_parent: str | None, max_depth: int
) -> LookupError:
    if length >= max_depth:
        return LookupError(
            f"the chain of response {response_id!r} has no root within {max_depth} responses"
        )
    return LookupError(
        f"the chain of response {response_id!r} is broken: response "
        f"{last_id!r} names parent {last_parent!r}, which is not stored"
    )


def _not_stored(response_id: str) -> LookupError:
    return LookupError(f"response {response_id!r} is not stored")


def _is_end(stored: StoredResponse) -> bool:
    return stored.is_root or stored.parent_id is None


# Before schema version 4 (SQLite; 2 in PostgreSQL) items were keyed by their id alone, so an
# item whose id another owner had stored first was left out of the table. The upgrade puts such
# items back from the responses' bodies, once, in the order the responses were created (the
# first response of an owner to store an id keeps it, as `put` does).
ITEMS_BY_OWNER_SINCE = 4


def backfilled_items(
    rows: Iterable[tuple[str, str | None, bytes]],
) -> Iterator[tuple[str, str, str | None, bytes]]:
    """The items rows (id, response_id, owner, body) of stored responses' (id, owner, body)
    rows; a body that does not decode is skipped (`get` reports it when it is read)."""
    for response_id, owner, blob in rows:
        try:
            body: Any = msgpack.unpackb(bytes(blob), raw=False)
        except (ValueError, TypeError):  # msgpack's unpacking errors are ValueErrors
            continue
        items = body.get("items") if isinstance(body, dict) else None
        for item in items if isinstance(items, list) else ():
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                packed: bytes = msgpack.packb(item, use_bin_type=True)
                yield item["id"], response_id, owner, packed


# --- the store's operations, for both databases ----------------------------------------------


class SQLResponseStore:
    """The `ResponseStore` operations over `_sql`'s statements: each one call of the resource's
    (a worker thread with a connection), with encoding and decoding in that thread. A write
    (`_write`: a response and its items, a delete) is one transaction in both databases, so a
    crash or an error between its statements leaves nothing of it; a read is `_run`."""

    _what = "response store"
    _sql: ClassVar[ResponseSQL]

    async def _run(self, fn: Callable[[Connection], T]) -> T:
        raise NotImplementedError  # pragma: no cover (the resource's)

    async def _write(self, fn: Callable[[Connection], T]) -> T:
        raise NotImplementedError  # pragma: no cover (the database's: one transaction)

    async def put(self, stored: StoredResponse) -> None:
        """Store (or replace: last write wins) a response and its items. Raises `ValueError`
        if the id is already stored under another owner."""
        response_id = stored.response.id
        sql = self._sql

        def run(conn: Connection) -> int:
            cursor = conn.execute(
                sql.put,
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
                    if item.id is not None
                ]
                if items:
                    conn.cursor().executemany(sql.put_item, items)
            return cursor.rowcount

        if await self._write(run) == 0:
            raise ValueError(f"response {response_id!r} is already stored under another owner")

    async def get(self, response_id: str, *, owner: str | None) -> StoredResponse | None:
        sql = self._sql

        def run(conn: Connection) -> StoredResponse | None:
            row: _Row | None = conn.execute(sql.get, (response_id, owner)).fetchone()
            return None if row is None else _decode(row)

        return await self._run(run)

    async def delete(self, response_id: str, *, owner: str | None) -> bool:
        sql = self._sql

        def run(conn: Connection) -> bool:
            deleted = conn.execute(sql.delete, (response_id, owner)).rowcount > 0
            if deleted:
                conn.execute(sql.delete_items, (response_id, owner))
            return deleted

        return await self._write(run)

    async def get_item(self, item_id: str, *, owner: str | None) -> Item | None:
        """An item a stored response added, by its id (owner isolation as for responses)."""
        sql = self._sql

        def run(conn: Connection) -> Item | None:
            row = conn.execute(sql.get_item, (item_id, owner)).fetchone()
            return None if row is None else _decode_item(row[0])

        return await self._run(run)

    async def get_chain(
        self, response_id: str, *, owner: str | None, max_depth: int = MAX_CHAIN_DEPTH
    ) -> list[StoredResponse]:
        """The response and its ancestors, newest first, ending at the first root (`is_root`
        or no parent): never empty, and its last element is always a root. Raises
        `LookupError` if the response or a parent is missing (or owned by someone else), or
        if no root is reached within `max_depth` responses. One query."""
        _check_depth(max_depth)
        sql = self._sql

        def run(conn: Connection) -> list[StoredResponse]:
            rows: list[_Row] = conn.execute(
                sql.chain, {"id": response_id, "owner": owner, "max_depth": max_depth}
            ).fetchall()
            if not rows:
                raise _not_stored(response_id)
            last_id, _, last_parent, last_is_root, _, _ = rows[-1]
            if not last_is_root and last_parent is not None:
                # Checked before decoding: a broken chain costs no decoding.
                raise _broken_chain(response_id, len(rows), last_id, last_parent, max_depth)
            return [_decode(row) for row in rows]

        return await self._run(run)

    async def count(self) -> int:
        """How many responses are stored (all owners); for tests and metrics."""
        return await self._run(lambda conn: count_rows(conn, "responses"))


# --- SQLite ----------------------------------------------------------------------------------


def _schema_version(conn: sqlite3.Connection, component: str) -> int | None:
    """`component`'s schema version in this file, None before its tables exist."""
    try:
        row = conn.execute(
            "SELECT version FROM schema_versions WHERE component = ?", (component,)
        ).fetchone()
    except sqlite3.OperationalError:  # no schema_versions table: a new file
        return None
    return None if row is None else int(row[0])


class SQLiteResponseStore(_SQLiteResource, SQLResponseStore):
    """A `ResponseStore` in one SQLite file. Make one with `open_sqlite_store()`."""

    _sql = SQLITE.render(RESPONSE_SQL)

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        # The connection is in autocommit mode (`connect`): one statement, one transaction.
        return await self._run(partial(in_transaction, fn))


def _backfill_items(conn: sqlite3.Connection) -> None:
    """Put back the items an older schema left out (see `ITEMS_BY_OWNER_SINCE`)."""
    with transaction(conn):
        rows = conn.execute("SELECT id, owner, body FROM responses ORDER BY created_at, rowid")
        conn.executemany(SQLiteResponseStore._sql.put_item, backfilled_items(rows))


async def open_sqlite_store(
    path: str | Path,
    *,
    synchronous: Synchronous = "NORMAL",
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
) -> SQLiteResponseStore:
    """Open (creating directories, file and tables as needed) a response store. Close it with
    `aclose()`, or use it as `async with await open_sqlite_store(path) as store:`.

    `synchronous="NORMAL"` (WAL) keeps every committed write across a crash of the process;
    `"FULL"` also across a power loss, at the cost of an fsync per write."""
    file = Path(path)

    def run() -> sqlite3.Connection:
        file.parent.mkdir(parents=True, exist_ok=True)
        conn = connect(file, synchronous=synchronous, busy_timeout=busy_timeout)
        try:
            found = _schema_version(conn, "responses")
            ensure_schema(
                conn,
                component="responses",
                version=RESPONSES_SCHEMA_VERSION,
                schema=RESPONSES_SCHEMA,
                migrations=RESPONSES_MIGRATIONS,
            )
            if found is not None and found < ITEMS_BY_OWNER_SINCE:
                _backfill_items(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    return SQLiteResponseStore(await trio.to_thread.run_sync(run), file)
