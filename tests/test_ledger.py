"""Usage ledgers: the idempotency rule, durability, and `record_sync` beside the async path."""

from __future__ import annotations

import json
import operator
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
import trio.testing
from rollout.engine._interfaces import UsageLedger, UsageRecord
from rollout.engine._ledger import MemoryUsageLedger, SQLiteUsageLedger, open_sqlite_ledger
from rollout.engine._pg_ledger import (
    POSTGRES_USAGE_SCHEMA_VERSION,
    PostgresUsageLedger,
    open_postgres_ledger,
)
from rollout.engine._pg_store import POSTGRES_RESPONSES_SCHEMA_VERSION, open_postgres_store
from rollout.engine._store import RESPONSES_SCHEMA_VERSION, open_sqlite_store

from tests.pg_harness import read_usage_rows

Ledger = MemoryUsageLedger | SQLiteUsageLedger | PostgresUsageLedger

DEADLINE = 10


def _implements_the_protocol(
    a: MemoryUsageLedger, b: SQLiteUsageLedger, c: PostgresUsageLedger
) -> tuple[UsageLedger, UsageLedger, UsageLedger]:
    """Checked by mypy: every ledger is a `UsageLedger`."""
    return a, b, c


def rec(
    response_id: str = "resp_1",
    step: int = 0,
    *,
    complete: bool = True,
    owner: str | None = "alice",
    output_tokens: int = 5,
    created_at: float = 1_700_000_000.5,
) -> UsageRecord:
    return UsageRecord(
        response_id=response_id,
        step=step,
        owner=owner,
        model="test-model",
        input_tokens=100,
        cached_tokens=40,
        output_tokens=output_tokens,
        complete=complete,
        created_at=created_at,
    )


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """Which ledger, and where it keeps its data (a synchronous fixture, so that a PostgreSQL
    server that cannot be reached skips the test with its reason)."""
    if request.param == "postgresql":
        urls: Callable[[], str] = request.getfixturevalue("postgres_urls")
        return "postgresql", urls()
    return request.param, str(tmp_path / "nested" / "usage.db")


@pytest.fixture
async def ledger(where: tuple[str, str]) -> AsyncIterator[Ledger]:
    kind, location = where
    led: Ledger
    with trio.fail_after(DEADLINE):
        if kind == "memory":
            led = MemoryUsageLedger()
        elif kind == "sqlite":
            led = await open_sqlite_ledger(location)
        else:
            led = await open_postgres_ledger(location)
    yield led
    with trio.fail_after(DEADLINE):
        await led.aclose()


# (first record, second record, which one the ledger keeps). Output tokens tell them apart.
FIRST = rec(complete=False, output_tokens=1)
SECOND_INCOMPLETE = rec(complete=False, output_tokens=2)
FIRST_COMPLETE = rec(complete=True, output_tokens=3)
SECOND_COMPLETE = rec(complete=True, output_tokens=4)
IDEMPOTENCY_CASES = [
    pytest.param(FIRST, FIRST, FIRST, id="incomplete-retried"),
    pytest.param(FIRST_COMPLETE, FIRST_COMPLETE, FIRST_COMPLETE, id="complete-retried"),
    pytest.param(FIRST, FIRST_COMPLETE, FIRST_COMPLETE, id="complete-replaces-incomplete"),
    pytest.param(FIRST_COMPLETE, FIRST, FIRST_COMPLETE, id="incomplete-never-replaces-complete"),
    pytest.param(FIRST, SECOND_INCOMPLETE, FIRST, id="incomplete-twice-first-wins"),
    pytest.param(FIRST_COMPLETE, SECOND_COMPLETE, FIRST_COMPLETE, id="complete-twice-first-wins"),
]


@pytest.mark.parametrize(("first", "second", "kept"), IDEMPOTENCY_CASES)
@pytest.mark.parametrize("how", ["two-calls", "one-batch", "sync-then-async"])
async def test_idempotency(
    ledger: Ledger, how: str, first: UsageRecord, second: UsageRecord, kept: UsageRecord
) -> None:
    with trio.fail_after(DEADLINE):
        other = rec(step=1)
        if how == "two-calls":
            await ledger.record([first, other])
            await ledger.record([second])
        elif how == "one-batch":
            await ledger.record([first, other, second])
        else:
            ledger.record_sync([first])
            await ledger.record([second, other])
        assert await ledger.count() == 2
        assert await ledger.rows("resp_1") == [kept, other]


async def test_totals_and_rows(ledger: Ledger) -> None:
    with trio.fail_after(DEADLINE):
        assert await ledger.totals() == {
            "records": 0,
            "incomplete": 0,
            "input_tokens": 0,
            "cached_tokens": 0,
            "output_tokens": 0,
        }
        await ledger.record([])
        records = [
            rec("resp_b", 1, owner="bob", output_tokens=7),
            rec("resp_a", 0, owner="alice"),
            rec("resp_a", 1, owner="alice", complete=False, output_tokens=2),
            rec("resp_b", 0, owner="bob"),
            rec("resp_n", 0, owner=None),
        ]
        await ledger.record(records)
        assert await ledger.totals() == {
            "records": 5,
            "incomplete": 1,
            "input_tokens": 500,
            "cached_tokens": 200,
            "output_tokens": 5 + 2 + 7 + 5 + 5,
        }
        assert await ledger.totals("bob") == {
            "records": 2,
            "incomplete": 0,
            "input_tokens": 200,
            "cached_tokens": 80,
            "output_tokens": 12,
        }
        assert (await ledger.totals("nobody"))["records"] == 0
        by_key = operator.attrgetter("response_id", "step")
        assert await ledger.rows() == sorted(records, key=by_key)
        assert await ledger.rows("resp_b") == [records[3], records[0]]
        assert await ledger.rows("resp_x") == []
        assert await ledger.count() == 5


async def test_record_sync_while_async_record_in_flight(ledger: Ledger) -> None:
    with trio.fail_after(DEADLINE):
        batch = [rec("resp_async", step) for step in range(2000)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ledger.record, batch)
            # The async record is now blocked in its worker thread (SQLite) or done (memory).
            await trio.testing.wait_all_tasks_blocked()
            ledger.record_sync([rec("resp_sync", 0, complete=False)])
        assert await ledger.count() == 2001
        assert (await ledger.rows("resp_sync"))[0].complete is False


async def test_record_sync_does_not_need_the_async_lock(tmp_path: Path) -> None:
    """`record_sync` runs from a shielded cleanup, possibly while another task holds the
    ledger's lock (an async call queued or in flight); it must not wait for that lock."""
    with trio.fail_after(DEADLINE):
        async with await open_sqlite_ledger(tmp_path / "usage.db") as ledger:
            async with ledger._lock:
                ledger.record_sync([rec()])
            assert await ledger.rows() == [rec()]


async def test_record_sync_waits_for_sqlite_write_lock(tmp_path: Path) -> None:
    """Another connection holding SQLite's write lock delays `record_sync` (busy timeout)
    instead of failing it."""
    with trio.fail_after(DEADLINE):
        path = tmp_path / "usage.db"
        async with await open_sqlite_ledger(path) as ledger:
            other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            try:
                other.execute("BEGIN IMMEDIATE")
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trio.to_thread.run_sync, ledger.record_sync, [rec()])
                    await trio.testing.wait_all_tasks_blocked()
                    other.execute("COMMIT")
            finally:
                other.close()
            assert await ledger.rows() == [rec()]


async def test_record_sync_gives_up_after_busy_timeout(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        path = tmp_path / "usage.db"
        async with await open_sqlite_ledger(path, busy_timeout=0.01) as ledger:
            other = sqlite3.connect(path, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")
                with pytest.raises(sqlite3.OperationalError, match="locked"):
                    ledger.record_sync([rec()])
            finally:
                other.execute("ROLLBACK")
                other.close()
            assert await ledger.count() == 0


async def test_durable_after_record_returns(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        path = tmp_path / "usage.db"
        ledger = await open_sqlite_ledger(path)
        await ledger.record([rec(step=0), rec(step=1, complete=False)])
        ledger.record_sync([rec(step=2)])
        # Seen by a brand-new connection while the ledger is still open ...
        conn = sqlite3.connect(path)
        try:
            assert conn.execute("SELECT step, complete FROM usage ORDER BY step").fetchall() == [
                (0, 1),
                (1, 0),
                (2, 1),
            ]
        finally:
            conn.close()
        await ledger.aclose()
        # ... and by a reopened ledger.
        async with await open_sqlite_ledger(path) as reopened:
            assert await reopened.rows() == [rec(step=0), rec(step=1, complete=False), rec(step=2)]
            await reopened.record([rec(step=1)])
            assert (await reopened.totals())["incomplete"] == 0


async def test_shares_a_file_with_the_store(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        path = tmp_path / "rollout.db"
        async with await open_sqlite_store(path) as store, await open_sqlite_ledger(path) as led:
            await led.record([rec()])
            assert await store.count() == 0
        conn = sqlite3.connect(path)
        try:
            assert conn.execute(
                "SELECT component, version FROM schema_versions ORDER BY component"
            ).fetchall() == [("responses", RESPONSES_SCHEMA_VERSION), ("usage", 1)]
        finally:
            conn.close()


async def test_closed(ledger: Ledger) -> None:
    with trio.fail_after(DEADLINE):
        await ledger.aclose()
        await ledger.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await ledger.record([rec()])
        with pytest.raises(trio.ClosedResourceError):
            ledger.record_sync([rec()])


# --- PostgreSQL only -------------------------------------------------------------------------

# One writer process: opens the ledger, says "ready", waits for "go" on stdin, then records
# every key of KEYS steps x RESPONSES responses in batches of a seeded random order, each key
# complete or not by a seeded coin, some batches through `record_sync`; prints its records.
WRITER = """
import json, random, sys, trio
from rollout.engine._interfaces import UsageRecord
from rollout.engine._pg_ledger import open_postgres_ledger

url, seed, responses, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
records = [
    UsageRecord(response_id=f"resp_{r}", step=s, owner="alice", model="m", input_tokens=100,
                cached_tokens=0, output_tokens=seed, complete=rng.random() < 0.3,
                created_at=float(seed))
    for r in range(responses) for s in range(steps)
]
rng.shuffle(records)

async def main():
    async with await open_postgres_ledger(url, pool_size=4) as ledger:
        print("ready", flush=True)
        sys.stdin.readline()
        for i in range(0, len(records), 25):
            batch = records[i : i + 25]
            if i % 100 == 0:
                await trio.to_thread.run_sync(ledger.record_sync, batch)
            else:
                await ledger.record(batch)
    print(json.dumps([[r.response_id, r.step, r.complete] for r in records]), flush=True)

trio.run(main)
"""
WRITERS = 4
PROCESS_DEADLINE = 60


class Lines:
    """Lines from a process's stdout (a trio stream)."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def readline(self) -> str:
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some()
            if not chunk:
                raise EOFError("the process closed its stdout")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


async def run_writers(script: str, url: str, n: int, *args: str) -> list[list[list[Any]]]:
    """Start `n` writer processes (`script URL SEED ARGS...`), let them all write at once when
    every one is connected, and return what each printed last (JSON)."""
    outputs: list[list[list[Any]]] = []
    procs: list[trio.Process] = []
    try:
        for seed in range(1, n + 1):
            procs.append(
                await trio.lowlevel.open_process(
                    [sys.executable, "-c", script, url, str(seed), *args],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
            )
        lines = []
        for proc in procs:
            assert proc.stdout is not None
            lines.append(Lines(proc.stdout))
        for out in lines:
            assert await out.readline() == "ready"
        for proc in procs:  # every writer is connected: let them all go at once
            assert proc.stdin is not None
            await proc.stdin.send_all(b"go\n")
        for proc, out in zip(procs, lines, strict=True):
            outputs.append(json.loads(await out.readline()))
            assert await proc.wait() == 0
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return outputs


async def test_postgres_exactly_once_with_writers_in_several_processes(
    postgres_urls: Callable[[], str],
) -> None:
    """Four processes record the same 600 steps at once, in different orders, each step
    complete in some processes and not in others: one row per step; complete wherever any
    process recorded it complete (and then a complete process's row); otherwise the row of
    one of the writers."""
    url = postgres_urls()
    responses, steps = 30, 20
    with trio.fail_after(PROCESS_DEADLINE):
        async with await open_postgres_ledger(url) as ledger:  # the tables exist before
            outputs = await run_writers(WRITER, url, WRITERS, str(responses), str(steps))
            rows = await ledger.rows()
    assert len(rows) == responses * steps == await _count(url)
    complete_by: dict[tuple[str, int], set[int]] = {}
    for seed, recorded in enumerate(outputs, start=1):
        for response_id, step, complete in recorded:
            if complete:
                complete_by.setdefault((response_id, step), set()).add(seed)
    assert complete_by, "no step was recorded complete: the test would prove nothing"
    for row in rows:
        key = (row.response_id, row.step)
        assert row.input_tokens == 100
        if key in complete_by:
            assert row.complete and row.output_tokens in complete_by[key], row
        else:
            assert not row.complete and 1 <= row.output_tokens <= WRITERS, row


async def _count(url: str) -> int:
    async with await open_postgres_ledger(url) as ledger:
        return await ledger.count()


async def test_postgres_durable_on_a_new_connection(postgres_urls: Callable[[], str]) -> None:
    """Committed when `record` returns: a new connection (another process's) sees the rows,
    and so does a reopened ledger."""
    url = postgres_urls()
    with trio.fail_after(DEADLINE):
        async with await open_postgres_ledger(url) as ledger:
            await ledger.record([rec(step=0), rec(step=1, complete=False)])
            ledger.record_sync([rec(step=2)])
            assert read_usage_rows(url) == [
                ("resp_1", 0, 1, 100, 40, 5),
                ("resp_1", 1, 0, 100, 40, 5),
                ("resp_1", 2, 1, 100, 40, 5),
            ]
        async with await open_postgres_ledger(url) as reopened:
            assert await reopened.rows() == [rec(step=0), rec(step=1, complete=False), rec(step=2)]


async def test_postgres_record_sync_does_not_need_the_pool(
    postgres_urls: Callable[[], str],
) -> None:
    """`record_sync` writes on its own connection while every pooled one is taken."""
    with trio.fail_after(DEADLINE):
        async with await open_postgres_ledger(postgres_urls(), pool_size=1) as ledger:
            with ledger._pool.connection():  # the only pooled connection, held
                await trio.to_thread.run_sync(ledger.record_sync, [rec()])
            assert await ledger.rows() == [rec()]


async def test_postgres_shares_a_database_with_the_store(
    postgres_urls: Callable[[], str],
) -> None:
    url = postgres_urls()
    with trio.fail_after(DEADLINE):
        async with (
            await open_postgres_store(url) as store,
            await open_postgres_ledger(url) as led,
        ):
            await led.record([rec()])
            assert await store.count() == 0
            assert await led.count() == 1
        with psycopg.connect(url) as conn:
            assert conn.execute(
                "SELECT component, version FROM schema_versions ORDER BY component"
            ).fetchall() == [
                ("responses", POSTGRES_RESPONSES_SCHEMA_VERSION),
                ("usage", POSTGRES_USAGE_SCHEMA_VERSION),
            ]
