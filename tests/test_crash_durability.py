"""Nothing acknowledged is lost: `kill -9` under concurrent load, then a restart.

Many clients run `store: true` chains against a real `rollout serve` process, over WebSocket
and HTTP. The server is killed with SIGKILL right after the K-th terminal event any client
received (K drawn per example from a seeded generator: deterministic, no timing). After a
restart on the same data directory, every response whose terminal event a client received is
retrievable (the same response: status, output, usage), continuable with
`previous_response_id`, and its usage is in the ledger exactly once per sampling step, with
the tokens the client saw. Responses the kill interrupted may be missing; none is half-stored.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from rollout import protocol as p

from tests.client_harness import RolloutProcess, open_rollout_process
from tests.server_harness import open_ws

DEADLINE = 60
WS_CLIENTS = 12
HTTP_CLIENTS = 4
MODEL = "sim:tokens=6"


async def load_until_kill(server: RolloutProcess, kill_after: int) -> list[dict[str, Any]]:
    """Run the clients; kill the server right after `kill_after` acknowledgements. Returns the
    acknowledged responses (as wire JSON)."""
    acked: list[dict[str, Any]] = []

    def acknowledge(response: dict[str, Any]) -> None:
        acked.append(response)
        if len(acked) == kill_after:
            server.kill()

    async def ws_client(n: int) -> None:
        previous: str | None = None
        with _quiet():
            async with open_ws(server.url) as ws:
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
                    acknowledge(p.to_wire(final.response))
                    previous = final.response.id

    async def http_client(n: int) -> None:
        previous: str | None = None
        with _quiet():
            async with httpx.AsyncClient(timeout=DEADLINE) as client:
                for turn in range(1_000):
                    body: dict[str, Any] = {"model": MODEL, "input": f"http {n} turn {turn}"}
                    if previous is not None:
                        body["previous_response_id"] = previous
                    resp = await client.post(f"{server.url}/responses", json=body)
                    if resp.status_code != 200:
                        return
                    acknowledge(resp.json())
                    previous = resp.json()["id"]

    async with trio.open_nursery() as nursery:
        for n in range(WS_CLIENTS):
            nursery.start_soon(ws_client, n)
        for n in range(HTTP_CLIENTS):
            nursery.start_soon(http_client, n)
    return acked


class _quiet:
    """Swallow the errors a client sees when the server dies under it."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, Exception)


def ledger_rows(data_dir: Path) -> dict[str, list[tuple[int, int, int, int]]]:
    """response_id -> [(step, complete, input_tokens, output_tokens)] from the ledger file."""
    conn = sqlite3.connect(data_dir / "usage.sqlite3")
    try:
        rows: dict[str, list[tuple[int, int, int, int]]] = {}
        for rid, step, complete, inp, out in conn.execute(
            "SELECT response_id, step, complete, input_tokens, output_tokens FROM usage"
            " ORDER BY response_id, step"
        ):
            rows.setdefault(rid, []).append((step, complete, inp, out))
        return rows
    finally:
        conn.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_acknowledged_responses_survive_kill_9(tmp_path: Path, seed: int) -> None:
    kill_after = random.Random(seed).randint(10, 80)
    data_dir = tmp_path / "data"
    with trio.fail_after(DEADLINE):
        async with open_rollout_process(data_dir=data_dir) as server:
            acked = await load_until_kill(server, kill_after)
        assert server.killed and len(acked) >= kill_after
        rows = ledger_rows(data_dir)
        async with open_rollout_process(data_dir=data_dir) as restarted:
            async with httpx.AsyncClient(timeout=DEADLINE) as client:
                for response in acked:
                    got = await client.get(f"{restarted.url}/responses/{response['id']}")
                    assert got.status_code == 200, (response["id"], got.text)
                    assert got.json()["output"] == response["output"]
                    assert got.json()["usage"] == response["usage"]
                # Continuable: the newest acknowledged response of a few chains.
                for response in acked[-5:]:
                    resp = await client.post(
                        f"{restarted.url}/responses",
                        json={
                            "model": MODEL,
                            "input": "after the crash",
                            "previous_response_id": response["id"],
                        },
                    )
                    assert resp.json()["status"] == "completed", resp.text
    for response in acked:
        usage = response["usage"]
        steps = rows.get(response["id"])
        assert steps is not None, f"no usage for acknowledged {response['id']}"
        assert [s[0] for s in steps] == list(range(len(steps)))  # each step once
        assert all(s[1] == 1 for s in steps)
        assert sum(s[2] for s in steps) == usage["input_tokens"]
        assert sum(s[3] for s in steps) == usage["output_tokens"]
