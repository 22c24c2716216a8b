"""PostgreSQL for the tests: a fresh database per test session, a fresh schema per use.

`postgres_database` (session) creates a database with a unique name on the server that
`ROLLOUT_TEST_POSTGRES` names (a libpq URL of a database to connect to for `CREATE DATABASE`;
default `postgresql://postgres@127.0.0.1:5432/postgres`) and drops it at the end of the session.
`postgres_urls` (per test) makes URLs of that database whose `search_path` is a fresh schema,
so each store or ledger a test opens starts empty; the schemas are dropped after the test.

When the server cannot be reached the tests that need it skip with a reason that says how to
run them, or fail under `ROLLOUT_REQUIRE_ALL` (`client_harness.unavailable`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from tests.client_harness import unavailable

__all__ = [
    "POSTGRES_ENV",
    "in_schema",
    "postgres_database",
    "postgres_urls",
    "read_usage_rows",
]

POSTGRES_ENV = "ROLLOUT_TEST_POSTGRES"
DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
# Seconds to reach the server before the PostgreSQL tests are skipped.
CONNECT_TIMEOUT = 5
HOW_TO_RUN = (
    f"set {POSTGRES_ENV} to a libpq URL of a database on a server where this user may "
    "CREATE DATABASE (any local PostgreSQL; on Debian: `apt-get install postgresql`), e.g. "
    f"{DEFAULT_SERVER}"
)


def with_database(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{dbname}"))


def in_schema(url: str, schema: str) -> str:
    """`url` with `search_path` set to `schema` (libpq's `options` parameter)."""
    parts = urlsplit(url)
    option = "options=" + quote(f"-c search_path={schema}", safe="")
    query = f"{parts.query}&{option}" if parts.query else option
    return urlunsplit(parts._replace(query=query))


def _admin(url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT)


@pytest.fixture(scope="session")
def postgres_database() -> Iterator[str]:
    """The URL of a database made for this test session (dropped at its end)."""
    server = os.environ.get(POSTGRES_ENV) or DEFAULT_SERVER
    try:
        admin = _admin(server)
    except psycopg.Error as exc:
        unavailable(
            f"PostgreSQL at {server} is unreachable ({exc}); to run these tests, {HOW_TO_RUN}"
        )
    name = f"rollout_test_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        with admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.Error as exc:
        unavailable(f"could not create a database on {server} ({exc}); {HOW_TO_RUN}")
    try:
        yield with_database(server, name)
    finally:
        with _admin(server) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def postgres_urls(postgres_database: str) -> Iterator[Callable[[], str]]:
    """Makes URLs of the session's database, each in a fresh, empty schema."""
    made: list[str] = []

    def make() -> str:
        schema = f"t_{secrets.token_hex(6)}"
        with _admin(postgres_database) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        made.append(schema)
        return in_schema(postgres_database, schema)

    yield make
    if made:
        with _admin(postgres_database) as conn:
            for schema in made:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )


def read_usage_rows(url: str) -> list[tuple[str, int, int, int, int, int]]:
    """(response_id, step, complete, input, cached, output) of a ledger, on a new connection."""
    with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT) as conn:
        return [
            (str(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]))
            for r in conn.execute(
                "SELECT response_id, step, complete, input_tokens, cached_tokens, output_tokens"
                " FROM usage ORDER BY response_id, step"
            )
        ]
