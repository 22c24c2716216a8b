"""Faults of instances sharing one PostgreSQL database (`rollout serve --store`).

SIGKILL mid-stream: two instances on one database; clients run `store: true` chains on the
first (over WebSocket and HTTP) while a long response streams from it; it is killed with SIGKILL
once K responses were acknowledged and the long one is mid-stream. From the second instance:
every acknowledged response is retrievable (the same output and usage) and continuable; the
interrupted one is stored nowhere (no response row, no item rows); the ledger holds each
acknowledged response's steps exactly once, complete, with the tokens the client saw.

PostgreSQL restarted under load: instances on a private cluster of the test's own (never the
machine's shared server) serve steady load while the cluster is stopped and started again.
While it is down every request ends, within the pool's bounded waits, with an OpenAI-shaped
`server_error` (HTTP 500, or a `failed` response: never a hang, never a traceback); once it is
back the same instances (never restarted) serve again, and what was stored before is there.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import psycopg
import pytest
import trio
from rollout import protocol as p

from tests.client_harness import RolloutProcess, open_rollout_process
from tests.pg_harness import open_private_postgres
from tests.server_harness import open_ws, sse_data
from tests.store_harness import (
    ChainLoad,
    check_acknowledged,
    check_acknowledged_usage,
    quiet,
    usage_by_response,
)

DEADLINE = 120
MODEL = "sim:tokens=6"
# A response that streams for ~20 s (the kill comes long before it ends).
LONG_MODEL = "sim:tokens=2000,tps=100"
WS_CLIENTS = 4
HTTP_CLIENTS = 2


@attrs.define
class KillRun:
    """The first instance's load, and the moment it dies."""

    server: RolloutProcess
    kill_after: int
    acked: list[dict[str, Any]] = attrs.field(factory=list)
    long_id: str | None = None
    long_deltas: int = 0

    def maybe_kill(self) -> None:
        if not self.server.killed and len(self.acked) >= self.kill_after and self.long_deltas >= 5:
            self.server.kill()

    def acknowledge(self, response: dict[str, Any]) -> None:
        self.acked.append(response)
        self.maybe_kill()

    async def long_client(self) -> None:
        body = {"model": LONG_MODEL, "input": "a long story", "stream": True, "store": True}
        with quiet():
            async with (
                httpx.AsyncClient(timeout=DEADLINE) as client,
                client.stream("POST", f"{self.server.url}/responses", json=body) as resp,
            ):
                async for data in sse_data(resp):
                    if data["type"] == "response.created":
                        self.long_id = data["response"]["id"]
                    elif data["type"] == "response.output_text.delta":
                        self.long_deltas += 1
                        self.maybe_kill()
                    elif data["type"] in ("response.completed", "response.failed"):
                        raise AssertionError(f"the long response ended: {data['type']}")

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.long_client)
            ChainLoad(self.server, self.acknowledge, DEADLINE).start(
                nursery, ws_clients=WS_CLIENTS, http_clients=HTTP_CLIENTS
            )


def usage_rows(url: str) -> dict[str, list[tuple[int, int, int, int]]]:
    """response_id -> [(step, complete, input_tokens, output_tokens)], from the database."""
    with psycopg.connect(url) as conn:
        return usage_by_response(
            conn.execute(
                "SELECT response_id, step, complete, input_tokens, output_tokens FROM usage"
                " ORDER BY response_id, step"
            )
        )


@pytest.mark.parametrize("seed", [1, 2])
async def test_sigkill_mid_stream_loses_nothing_acknowledged(
    tmp_path: Path, postgres_urls: Callable[[], str], seed: int
) -> None:
    url = postgres_urls()
    store = ["--store", url]
    with trio.fail_after(DEADLINE):
        async with (
            open_rollout_process(data_dir=tmp_path / "b", extra_args=store) as other,
            httpx.AsyncClient(timeout=DEADLINE) as client,
        ):
            async with open_rollout_process(data_dir=tmp_path / "a", extra_args=store) as doomed:
                run = KillRun(server=doomed, kill_after=random.Random(seed).randint(10, 40))
                await run.run()
            assert doomed.killed and len(run.acked) >= run.kill_after
            assert run.long_id is not None and run.long_deltas >= 5
            rows = usage_rows(url)
            # Retrievable and continuable from the other instance (which never saw these).
            await check_acknowledged(client, other.url, run.acked, then="after the kill")
            # The interrupted response: stored nowhere, not even in part.
            got = await client.get(f"{other.url}/responses/{run.long_id}")
            assert got.status_code == 404, got.text
            assert got.json()["error"]["code"] == "response_not_found"
            with psycopg.connect(url) as conn:
                for table, column in (("responses", "id"), ("items", "response_id")):
                    query = f"SELECT count(*) FROM {table} WHERE {column} = %s"
                    assert conn.execute(query, (run.long_id,)).fetchone() == (0,)
    check_acknowledged_usage(run.acked, rows)
    # Whatever the interrupted response had recorded (nothing, usually) is there once per step.
    long_steps = [s[0] for s in rows.get(run.long_id, [])]
    assert long_steps == sorted(set(long_steps))


# --- PostgreSQL restarted under load ---------------------------------------------------------

# A request while the database is down waits for a pooled connection (`_pg.POOL_TIMEOUT`, 5 s),
# and its commit may queue behind the writer's retry of earlier failed usage (another 5 s):
# two waits, plus slack for a loaded machine. Longer than this is a hang.
MAX_FAILURE_SECONDS = 25.0
RESTART_CLIENTS = 3


@attrs.define
class Outcome:
    server: int
    ok: bool
    started: float  # trio time
    seconds: float
    error: dict[str, Any] | None = None  # the OpenAI-shaped error when not ok


@attrs.define
class Load:
    """Clients running `store: true` chains on both instances until told to stop."""

    urls: list[str]
    outcomes: list[Outcome] = attrs.field(factory=list)
    stop: trio.Event = attrs.field(factory=trio.Event)
    changed: trio.Event = attrs.field(factory=trio.Event)

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, predicate: Callable[[list[Outcome]], bool]) -> None:
        while not predicate(self.outcomes):
            await self.changed.wait()

    async def http_client(self, n: int) -> None:
        server = n % len(self.urls)
        previous: str | None = None
        async with httpx.AsyncClient(timeout=2 * MAX_FAILURE_SECONDS) as client:
            for turn in range(10_000):
                if self.stop.is_set():
                    return
                body: dict[str, Any] = {"model": MODEL, "input": f"client {n} turn {turn}"}
                if previous is not None:
                    body["previous_response_id"] = previous
                start = trio.current_time()
                resp = await client.post(f"{self.urls[server]}/responses", json=body)
                seconds = trio.current_time() - start
                data = resp.json()
                if resp.status_code == 200 and data["status"] == "completed":
                    self.add(Outcome(server, True, start, seconds))
                    previous = data["id"]
                else:
                    error = data.get("error")
                    assert isinstance(error, dict), (
                        resp.status_code,
                        {
                            k: v
                            for k, v in data.items()
                            if k in ("status", "error", "incomplete_details", "output")
                        },
                    )
                    self.add(Outcome(server, False, start, seconds, error))
                    previous = None  # the chain may have lost its parent

    async def ws_client(self, n: int) -> None:
        server = n % len(self.urls)
        previous: str | None = None
        async with open_ws(self.urls[server]) as ws:
            for turn in range(10_000):
                if self.stop.is_set():
                    return
                start = trio.current_time()
                events = await ws.create(
                    model=MODEL,
                    input=f"ws {n} turn {turn}",
                    previous_response_id=previous,
                    store=True,
                )
                seconds = trio.current_time() - start
                final = events[-1]
                if final.type == "response.completed":
                    self.add(Outcome(server, True, start, seconds))
                    previous = final.response.id
                elif final.type == "response.failed":
                    error = final.response.error
                    self.add(Outcome(server, False, start, seconds, p.to_wire(error)))
                    previous = None
                else:
                    assert final.type == "error", final
                    self.add(Outcome(server, False, start, seconds, p.to_wire(final.error)))
                    previous = None


async def test_postgres_restart_under_load(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE * 2):
        async with open_private_postgres() as cluster:
            store = ["--store", cluster.url]
            async with (
                open_rollout_process(data_dir=tmp_path / "a", extra_args=store) as a,
                open_rollout_process(data_dir=tmp_path / "b", extra_args=store) as b,
                httpx.AsyncClient(timeout=DEADLINE) as client,
            ):
                before = await client.post(
                    f"{a.url}/responses", json={"model": MODEL, "input": "before the outage"}
                )
                assert before.json()["status"] == "completed"
                load = Load(urls=[a.url, b.url])
                phases: dict[str, int] = {}
                async with trio.open_nursery() as nursery:
                    for n in range(RESTART_CLIENTS):
                        nursery.start_soon(load.http_client, n)
                    nursery.start_soon(load.ws_client, 1)
                    await load.wait_for(lambda o: sum(x.ok for x in o) >= 20)
                    await cluster.stop("fast")
                    phases["down"] = len(load.outcomes)
                    # Every client's request in flight or sent now fails: several failures
                    # on both instances.
                    await load.wait_for(
                        lambda o: (
                            {x.server for x in o[phases["down"] :] if not x.ok} == {0, 1}
                            and sum(not x.ok for x in o[phases["down"] :]) >= 2 * RESTART_CLIENTS
                        )
                    )
                    await cluster.start()
                    phases["up"] = len(load.outcomes)
                    # Recovered: both instances serve again, a run of successes on each.
                    await load.wait_for(
                        lambda o: all(
                            sum(x.ok and x.server == s for x in o[phases["up"] :]) >= 10
                            for s in (0, 1)
                        )
                    )
                    load.stop.set()
                # The instances were never restarted: the response stored before the outage
                # is there on both, and continuable.
                for url in (a.url, b.url):
                    got = await client.get(f"{url}/responses/{before.json()['id']}")
                    assert got.status_code == 200, got.text
                resp = await client.post(
                    f"{b.url}/responses",
                    json={
                        "model": MODEL,
                        "input": "after the outage",
                        "previous_response_id": before.json()["id"],
                    },
                )
                assert resp.json()["status"] == "completed", resp.text
                assert not a.exited and not b.exited
    failures = [o for o in load.outcomes if not o.ok]
    assert failures and len(failures) < len(load.outcomes)
    for outcome in failures:
        assert outcome.error is not None
        assert outcome.error["code"] == "server_error", outcome
        assert "Traceback" not in outcome.error.get("message", ""), outcome
        assert outcome.seconds < MAX_FAILURE_SECONDS, outcome
    # After the restart, on each instance, every request sent after its first success
    # succeeds: nothing is left broken (no stale connection fails a later request).
    after = load.outcomes[phases["up"] :]
    for server in (0, 1):
        recovered = min(o.started + o.seconds for o in after if o.ok and o.server == server)
        later = [o for o in after if o.server == server and o.started > recovered]
        assert later and all(o.ok for o in later), (server, later)
