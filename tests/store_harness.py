"""The store several `rollout serve` processes share, for tests that start them: a
PostgreSQL database (a fresh schema, `pg_harness`) or one SQLite data dir; each gives the
processes' arguments and reads the ledger's totals directly (not through rollout)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from tests.pg_harness import read_usage_rows

__all__ = ["Store", "shared_store"]


@attrs.frozen
class Store:
    """Where the instances keep responses and usage: their `rollout serve` arguments, and the
    ledger's (rows, input tokens, output tokens) of complete steps, read directly."""

    args: tuple[str, ...]
    totals: Callable[[], tuple[int, int, int]]


@pytest.fixture(params=["postgres", "sqlite"])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "sqlite":
        data_dir = tmp_path / "shared"
        return Store(args=("--data-dir", str(data_dir)), totals=lambda: sqlite_totals(data_dir))
    url = request.getfixturevalue("postgres_urls")()
    return Store(args=("--store", url), totals=lambda: postgres_totals(url))


def sqlite_totals(data_dir: Path) -> tuple[int, int, int]:
    conn = sqlite3.connect(data_dir / "usage.sqlite3")
    try:
        rows, inp, out = conn.execute(
            "SELECT count(*), coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0) "
            "FROM usage WHERE complete = 1"
        ).fetchone()
        return int(rows), int(inp), int(out)
    finally:
        conn.close()


def postgres_totals(url: str) -> tuple[int, int, int]:
    rows = [r for r in read_usage_rows(url) if r[2] == 1]
    return len(rows), sum(r[3] for r in rows), sum(r[5] for r in rows)
