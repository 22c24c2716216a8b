"""One SQL layer for two databases (`engine/_sql.py`): a dialect renders the shared statements
for each database, and the tables the shared code makes are the ones the code before it made,
so a database made by that code opens and works (SQLite and PostgreSQL)."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
from rollout.engine._ledger import open_sqlite_ledger
from rollout.engine._pg_ledger import open_postgres_ledger
from rollout.engine._pg_store import open_postgres_store
from rollout.engine._sql import POSTGRES, SQLITE
from rollout.engine._store import open_sqlite_store
from rollout.protocol import Message

from tests.test_ledger import Ledger, rec
from tests.test_store import Store, make

DEADLINE = 10

# The tables as the code before the shared layer made them (a fresh database: SQLite store
# schema 4 and ledger schema 1; PostgreSQL store schema 2 and ledger schema 1), verbatim.
SCHEMA_VERSIONS = """
CREATE TABLE IF NOT EXISTS schema_versions (
    component TEXT PRIMARY KEY,
    version   INTEGER NOT NULL
)"""
SQLITE_BEFORE = (
    SCHEMA_VERSIONS,
    """
    CREATE TABLE responses (
        id         TEXT PRIMARY KEY,
        owner      TEXT,
        parent_id  TEXT,
        is_root    INTEGER NOT NULL CHECK (is_root IN (0, 1)),
        created_at INTEGER NOT NULL,
        body       BLOB NOT NULL,
        rendered   BLOB
    )""",
    """
    CREATE TABLE items (
        owner       TEXT,
        id          TEXT NOT NULL,
        response_id TEXT NOT NULL,
        body        BLOB NOT NULL
    )""",
    "CREATE UNIQUE INDEX items_key ON items (owner, id)",
    "CREATE UNIQUE INDEX items_key_anonymous ON items (id) WHERE owner IS NULL",
    "CREATE INDEX items_by_response ON items (response_id)",
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
    "INSERT INTO schema_versions (component, version) VALUES ('responses', 4), ('usage', 1)",
)
POSTGRES_BEFORE = (
    SCHEMA_VERSIONS,
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
    "CREATE INDEX items_by_id ON items (id)",
    """
    CREATE TABLE secrets (
        name  TEXT PRIMARY KEY,
        value BYTEA NOT NULL
    )""",
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
    "INSERT INTO schema_versions (component, version) VALUES ('responses', 2), ('usage', 1)",
)


def test_dialect_renders_parameters_and_slots() -> None:
    template = "SELECT '?:x' || ?::text, {blob} FROM t WHERE a {is} :owner AND b = :max_depth"
    assert SQLITE.sql(template) == (
        "SELECT '?:x' || ?::text, BLOB FROM t WHERE a IS :owner AND b = :max_depth"
    )
    assert POSTGRES.sql(template) == (
        "SELECT '?:x' || %s::text, BYTEA FROM t "
        "WHERE a IS NOT DISTINCT FROM %(owner)s AND b = %(max_depth)s"
    )
    with pytest.raises(ValueError, match="a literal % in SQL for postgresql"):
        POSTGRES.sql("SELECT 5 % ?")


async def use(
    where: tuple[str, ...],
    open_store: Callable[[str], Awaitable[Store]],
    open_ledger: Callable[[str], Awaitable[Ledger]],
) -> None:
    """In each database, the store and the ledger open and work on the tables they find."""
    with trio.fail_after(DEADLINE):
        for place in where:
            async with await open_store(place) as store, await open_ledger(place) as ledger:
                await use_one(store, ledger)


async def use_one(store: Store, ledger: Ledger) -> None:
    await store.put(make("r1", owner="alice"))
    await store.put(make("r2", parent_id="r1", owner="alice"))
    await store.put(make("r3"))
    assert [s.response.id for s in await store.get_chain("r2", owner="alice")] == ["r2", "r1"]
    assert isinstance(await store.get_item("msg_r3", owner=None), Message)
    assert await store.get_item("msg_r3", owner="alice") is None
    with pytest.raises(ValueError, match="already stored under another owner"):
        await store.put(make("r3", owner="bob"))
    assert await store.delete("r3", owner=None)
    assert await store.count() == 2
    await ledger.record([rec(step=0, complete=False), rec(step=0), rec(step=1)])
    ledger.record_sync([rec(step=2, owner=None)])
    assert (await ledger.totals())["records"] == 3
    assert (await ledger.totals("alice"))["incomplete"] == 0


def _sqlite_tables(path: Path) -> list[tuple[str, str]]:
    """(name, whitespace-normalized SQL) of every table and index in the file."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT name, sql FROM sqlite_master ORDER BY name").fetchall()
    finally:
        conn.close()
    return [(name, re.sub(r"\s+", " ", sql or "").strip()) for name, sql in rows]


async def test_sqlite_file_of_the_code_before_opens(tmp_path: Path) -> None:
    before, fresh = tmp_path / "before.db", tmp_path / "fresh.db"
    conn = sqlite3.connect(before)
    for statement in SQLITE_BEFORE:
        conn.execute(statement)
    conn.commit()
    conn.close()
    await use((str(before), str(fresh)), open_sqlite_store, open_sqlite_ledger)
    assert _sqlite_tables(fresh) == _sqlite_tables(before)


def _postgres_tables(url: str) -> dict[str, Any]:
    """The columns (by name: their order is not compared), indexes and constraints of the
    tables in the URL's schema."""
    with psycopg.connect(url) as conn:
        columns = conn.execute(
            "SELECT table_name, column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_schema = current_schema() "
            "ORDER BY table_name, column_name"
        ).fetchall()
        indexes = conn.execute(
            "SELECT tablename, indexname, regexp_replace(indexdef, ' ON \\S+\\.', ' ON ') "
            "FROM pg_indexes WHERE schemaname = current_schema() ORDER BY indexname"
        ).fetchall()
        constraints = conn.execute(
            "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
            "FROM pg_constraint WHERE connamespace = current_schema()::regnamespace "
            "ORDER BY conname"
        ).fetchall()
        versions = conn.execute("SELECT * FROM schema_versions ORDER BY component").fetchall()
    return {
        "columns": columns,
        "indexes": indexes,
        "constraints": constraints,
        "versions": versions,
    }


async def test_postgres_database_of_the_code_before_opens(
    postgres_urls: Callable[[], str],
) -> None:
    before, fresh = postgres_urls(), postgres_urls()
    with psycopg.connect(before) as conn:
        for statement in POSTGRES_BEFORE:
            conn.execute(statement)
    await use((before, fresh), open_postgres_store, open_postgres_ledger)
    made = _postgres_tables(fresh)
    assert made == _postgres_tables(before)
    assert len(made["indexes"]) == 8 and len(made["constraints"]) == 7, made
