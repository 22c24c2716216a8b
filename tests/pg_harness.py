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

import contextlib
import os
import pwd
import secrets
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import attrs
import psycopg
import pytest
import trio
from psycopg import sql

from tests.client_harness import unavailable

__all__ = [
    "POSTGRES_ENV",
    "PrivateCluster",
    "in_schema",
    "open_private_postgres",
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


# --- a private PostgreSQL cluster (fault tests stop and start it) ----------------------------

PG_BIN = Path(os.environ.get("ROLLOUT_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
# initdb of an empty cluster takes ~2 s here; pg_ctl's own waits are bounded by `-t`.
PG_COMMAND_TIMEOUT = 60.0


@attrs.define
class PrivateCluster:
    """A PostgreSQL cluster of the test's own in a temporary folder, on a free port."""

    folder: Path
    port: int
    prefix: list[str]  # runs the server's binaries as its owner (`postgres` when we are root)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    async def _pg(self, *args: str) -> None:
        with trio.fail_after(PG_COMMAND_TIMEOUT):
            result = await trio.run_process(
                [*self.prefix, *args], capture_stdout=True, capture_stderr=True, check=False
            )
        if result.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout.decode(errors='replace')}{result.stderr.decode(errors='replace')}"
            )

    async def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=50"
        )
        await self._pg(
            str(PG_BIN / "pg_ctl"), "-D", str(self.folder / "data"), "-o", options,
            "-l", str(self.folder / "log"), "-w", "-t", "30", "start",
        )  # fmt: skip

    async def stop(self, mode: str = "fast") -> None:
        await self._pg(
            str(PG_BIN / "pg_ctl"), "-D", str(self.folder / "data"), "-m", mode, "-w", "-t",
            "30", "stop",
        )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@asynccontextmanager
async def open_private_postgres() -> AsyncIterator[PrivateCluster]:
    """initdb + pg_ctl start a cluster (as the `postgres` user when run as root, since initdb
    refuses root); always stopped and removed at the end. Skips (fails under
    ROLLOUT_REQUIRE_ALL) without PostgreSQL's server binaries."""
    for binary in ("initdb", "pg_ctl", "postgres"):
        if not (PG_BIN / binary).exists():
            unavailable(
                f"PostgreSQL's server binaries are not in {PG_BIN} (set ROLLOUT_TEST_PG_BIN, or "
                "on Debian `apt-get install postgresql-15`)"
            )
    prefix: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="rollout-pg-"))
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            owner = None
        if runuser is None or owner is None:
            shutil.rmtree(folder, ignore_errors=True)
            unavailable("running as root needs the `postgres` user and runuser to run initdb")
        assert owner is not None and runuser is not None
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        prefix = [runuser, "-u", "postgres", "--"]
    cluster = PrivateCluster(folder=folder, port=_free_port(), prefix=prefix)
    try:
        await cluster._pg(
            str(PG_BIN / "initdb"), "-D", str(folder / "data"), "-A", "trust", "-U", "postgres",
            "--no-sync", "--no-instructions",
        )  # fmt: skip
        await cluster.start()
        yield cluster
    finally:
        with trio.CancelScope(shield=True):
            if (folder / "data" / "postmaster.pid").exists():
                with contextlib.suppress(AssertionError, trio.TooSlowError):
                    await cluster.stop("immediate")
            shutil.rmtree(folder, ignore_errors=True)
