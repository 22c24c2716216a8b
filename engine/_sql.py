"""One SQL text for SQLite and PostgreSQL: a `Dialect` holds, as data, what the two databases
spell differently, and the schema-version runner both use is written once here.

The response store's and the usage ledger's statements and tables are written once (`_store.py`,
`_ledger.py`) in sqlite3's parameter styles (`?`, `:name`) with slots for what differs
(`{blob}`, `{is}`, ...); `Dialect.sql` renders one for a database. What differs:

- parameters: `?` and `:name` (sqlite3) against `%s` and `%(name)s` (psycopg);
- column types: BLOB/BYTEA, INTEGER/SMALLINT/BIGINT, REAL/DOUBLE PRECISION, and SQLite's
  `WITHOUT ROWID` for a table clustered on its key;
- NULL-safe equality, for owners (NULL means auth off): `IS` against `IS NOT DISTINCT FROM`;
- a unique key over a nullable column: PostgreSQL (15+) says `UNIQUE NULLS NOT DISTINCT`;
  SQLite's unique indexes keep NULLs apart, so NULL needs an index of its own;
- the lock taken before creating or upgrading tables: a transaction-scoped advisory lock in
  PostgreSQL, where several processes may start together; none in SQLite, whose
  `BEGIN IMMEDIATE` already lets one writer in.

The upsert (`INSERT ... ON CONFLICT ... DO UPDATE SET ... WHERE`, or `DO NOTHING`) is spelled
the same in both (SQLite 3.24+), so `upsert` writes it once. Transactions, threads and
connections stay each driver's own (`_store.py` for sqlite3, `_pg.py` for psycopg): the
functions here run in the caller's transaction on a `Connection`, which both drivers' are.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import attrs
from attrs import AttrsInstance

__all__ = [
    "POSTGRES",
    "SCHEMA_VERSIONS_DDL",
    "SQLITE",
    "Connection",
    "Dialect",
    "count_rows",
    "migrate",
    "schema_steps",
    "upsert",
]


class Cursor(Protocol):
    """What the shared code reads from a cursor (sqlite3's and psycopg's both qualify)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def executemany(self, query: str, params: Iterable[Any], /) -> object: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """A DB-API connection as sqlite3 and psycopg both have it."""

    def execute(self, query: str, params: Any = ..., /) -> Cursor: ...

    def cursor(self) -> Cursor: ...


# A string literal, a PostgreSQL cast (`::`), a named parameter, a positional one.
_TOKEN = re.compile(r"'(?:[^']|'')*'|::|:(\w+)|\?")


A = TypeVar("A", bound=AttrsInstance)


@attrs.frozen
class Dialect:
    """What one database spells its own way; the defaults are SQLite's spelling, the one the
    templates are written in."""

    name: str
    # Parameters: the positional one, and a named one with `{}` for the name.
    placeholder: str = "?"
    named_placeholder: str = ":{}"
    # Column types.
    blob: str = "BLOB"
    small_int: str = "INTEGER"
    big_int: str = "INTEGER"
    double: str = "REAL"
    # After a `CREATE TABLE`'s parentheses: a table stored in its primary key's order.
    clustered: str = " WITHOUT ROWID"
    # NULL-safe equality.
    is_: str = "IS"
    # Whether a unique key can treat NULLs as equal (`UNIQUE NULLS NOT DISTINCT`).
    unique_nulls_not_distinct: bool = False
    # Run (with a key) first in the transaction that creates or upgrades a component's tables.
    schema_lock: str | None = None

    def sql(self, template: str) -> str:
        """`template` (sqlite3's parameter styles, slots `{blob}`, `{small_int}`, `{big_int}`,
        `{double}`, `{clustered}`, `{is}`) in this dialect. String literals are kept as they
        are."""
        text = template.format(
            blob=self.blob,
            small_int=self.small_int,
            big_int=self.big_int,
            double=self.double,
            clustered=self.clustered,
            **{"is": self.is_},
        )
        if self.placeholder == "?":
            return text
        if "%" in text:  # psycopg reads `%` as the start of a parameter
            raise ValueError(f"a literal % in SQL for {self.name}: {text!r}")

        def replace(match: re.Match[str]) -> str:
            token = match.group(0)
            if token == "?":
                return self.placeholder
            if match.group(1) is not None:
                return self.named_placeholder.format(match.group(1))
            return token

        return _TOKEN.sub(replace, text)

    def render(self, statements: A) -> A:
        """`statements` (attrs fields of templates) with each field in this dialect."""
        templates: dict[str, str] = attrs.asdict(statements, recurse=False)
        return type(statements)(**{k: self.sql(v) for k, v in templates.items()})


SQLITE = Dialect(name="sqlite")

POSTGRES = Dialect(
    name="postgresql",
    placeholder="%s",
    named_placeholder="%({})s",
    blob="BYTEA",
    small_int="SMALLINT",
    big_int="BIGINT",
    double="DOUBLE PRECISION",
    clustered="",
    is_="IS NOT DISTINCT FROM",
    unique_nulls_not_distinct=True,
    schema_lock="SELECT pg_advisory_xact_lock(?)",
)


def upsert(
    table: str, columns: Sequence[str], key: Sequence[str], *, where: str, keep: Sequence[str] = ()
) -> str:
    """`INSERT INTO table (columns) VALUES (?, ...)` that, on a row with the same `key`,
    replaces its other columns (but `keep`) when `where` holds (`excluded.` names the new
    row)."""
    sets = ",\n    ".join(f"{c} = excluded.{c}" for c in columns if c not in (*key, *keep))
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})\n"
        f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET\n    {sets}\nWHERE {where}"
    )


def count_rows(conn: Connection, table: str) -> int:
    (n,) = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(n)


# --- schema versions -------------------------------------------------------------------------

# Bookkeeping shared by every component that keeps tables in one database (the store and the
# usage ledger may share one): one row per component with its schema version.
SCHEMA_VERSIONS_DDL = """
CREATE TABLE IF NOT EXISTS schema_versions (
    component TEXT PRIMARY KEY,
    version   INTEGER NOT NULL
)"""

_VERSION = "SELECT version FROM schema_versions WHERE component = ?"
_INSERT_VERSION = "INSERT INTO schema_versions (component, version) VALUES (?, ?)"
_UPDATE_VERSION = "UPDATE schema_versions SET version = ? WHERE component = ?"


def schema_steps(
    component: str,
    found: int | None,
    version: int,
    schema: Sequence[str],
    migrations: dict[int, tuple[str, ...]],
) -> list[str]:
    """The statements that bring `component`'s tables from schema version `found` (None: no
    tables yet) to `version`: the whole schema, or the migrations in order. Raises
    `RuntimeError` for tables newer than this rollout or a missing migration."""
    if found is None:
        return list(schema)
    if found > version:
        raise RuntimeError(
            f"the {component} tables have schema version {found}, newer than this "
            f"rollout's {version}: upgrade rollout to use them"
        )
    steps: list[str] = []
    for step in range(found, version):
        if step not in migrations:
            raise RuntimeError(f"no migration of the {component} tables from schema version {step}")
        steps.extend(migrations[step])
    return steps


def migrate(
    conn: Connection,
    dialect: Dialect,
    *,
    component: str,
    version: int,
    schema: Sequence[str],
    migrations: dict[int, tuple[str, ...]],
) -> None:
    """Create `component`'s tables, or upgrade them to `version`, in the caller's transaction
    (the statements are the dialect's own)."""
    if dialect.schema_lock is not None:
        conn.execute(dialect.sql(dialect.schema_lock), (zlib.crc32(component.encode()),))
    conn.execute(SCHEMA_VERSIONS_DDL)
    row = conn.execute(dialect.sql(_VERSION), (component,)).fetchone()
    steps = schema_steps(
        component, None if row is None else int(row[0]), version, schema, migrations
    )
    for statement in steps:
        conn.execute(statement)
    if row is None:
        conn.execute(dialect.sql(_INSERT_VERSION), (component, version))
    else:
        conn.execute(dialect.sql(_UPDATE_VERSION), (version, component))
