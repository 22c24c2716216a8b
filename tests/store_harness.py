"""The store `rollout serve` processes keep, for tests that start them: the one several
processes share (a PostgreSQL database in a fresh schema, `pg_harness`, or one SQLite data dir:
the processes' arguments, and the ledger's totals read directly, not through rollout); and the
checks that a store kept what a server acknowledged: `store: true` chains run against a
server (`ChainLoad`), then read back and continued from a server after a crash.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from rollout import protocol as p

from tests.client_harness import RolloutProcess
from tests.pg_harness import read_usage_rows
from tests.server_harness import open_ws

__all__ = [
    "ChainLoad",
    "Store",
    "check_acknowledged",
    "check_acknowledged_usage",
    "quiet",
    "shared_store",
    "usage_by_response",
]

MODEL = "sim:tokens=6"


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


# --- what a server acknowledged is kept ------------------------------------------------------


class quiet:
    """Swallow the errors a client sees when the server dies under it."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, Exception)


@attrs.define
class ChainLoad:
    """Clients running `store: true` chains against `server` until it fails them, over
    WebSocket and HTTP; each response a client sees completed is passed to `acknowledge`
    (wire JSON)."""

    server: RolloutProcess
    acknowledge: Callable[[dict[str, Any]], None]
    timeout: float

    def start(self, nursery: trio.Nursery, *, ws_clients: int, http_clients: int) -> None:
        for n in range(ws_clients):
            nursery.start_soon(self.ws_client, n)
        for n in range(http_clients):
            nursery.start_soon(self.http_client, n)

    async def ws_client(self, n: int) -> None:
        previous: str | None = None
        with quiet():
            async with open_ws(self.server.url) as ws:
                for turn in range(1_000):
                    events = await ws.create(
                        model=MODEL,
                        input=f"client {n} turn {turn}",
                        previous_response_id=previous,
                        store=True,
                    )
                    final = events[-1]
                    if final.type != "response.completed":
                        return
                    self.acknowledge(p.to_wire(final.response))
                    previous = final.response.id

    async def http_client(self, n: int) -> None:
        previous: str | None = None
        with quiet():
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                for turn in range(1_000):
                    body: dict[str, Any] = {"model": MODEL, "input": f"http {n} turn {turn}"}
                    if previous is not None:
                        body["previous_response_id"] = previous
                    resp = await client.post(f"{self.server.url}/responses", json=body)
                    if resp.status_code != 200:
                        return
                    self.acknowledge(resp.json())
                    previous = resp.json()["id"]


async def check_acknowledged(
    client: httpx.AsyncClient, url: str, acked: list[dict[str, Any]], *, then: str
) -> None:
    """Every acknowledged response is retrievable from the server at `url` (the same output
    and usage), and the newest of a few chains continue there (input `then`)."""
    for response in acked:
        got = await client.get(f"{url}/responses/{response['id']}")
        assert got.status_code == 200, (response["id"], got.text)
        assert got.json()["output"] == response["output"]
        assert got.json()["usage"] == response["usage"]
    for response in acked[-5:]:
        resp = await client.post(
            f"{url}/responses",
            json={"model": MODEL, "input": then, "previous_response_id": response["id"]},
        )
        assert resp.json()["status"] == "completed", resp.text


def usage_by_response(
    rows: Iterable[tuple[str, int, int, int, int]],
) -> dict[str, list[tuple[int, int, int, int]]]:
    """response_id -> [(step, complete, input_tokens, output_tokens)], from the ledger's
    (response_id, step, complete, input_tokens, output_tokens) rows."""
    steps: dict[str, list[tuple[int, int, int, int]]] = {}
    for rid, step, complete, inp, out in rows:
        steps.setdefault(rid, []).append((step, complete, inp, out))
    return steps


def check_acknowledged_usage(
    acked: list[dict[str, Any]], steps: dict[str, list[tuple[int, int, int, int]]]
) -> None:
    """The ledger holds each acknowledged response's steps exactly once, complete, with the
    tokens the client saw."""
    for response in acked:
        usage = response["usage"]
        mine = steps.get(response["id"])
        assert mine is not None, f"no usage for acknowledged {response['id']}"
        assert [s[0] for s in mine] == list(range(len(mine)))  # each step once
        assert all(s[1] == 1 for s in mine)
        assert sum(s[2] for s in mine) == usage["input_tokens"]
        assert sum(s[3] for s in mine) == usage["output_tokens"]
