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

from tests.client_harness import RolloutProcess, open_rollout_process
from tests.store_harness import (
    ChainLoad,
    check_acknowledged,
    check_acknowledged_usage,
    usage_by_response,
)

DEADLINE = 60
WS_CLIENTS = 12
HTTP_CLIENTS = 4


async def load_until_kill(server: RolloutProcess, kill_after: int) -> list[dict[str, Any]]:
    """Run the clients; kill the server right after `kill_after` acknowledgements. Returns the
    acknowledged responses (as wire JSON)."""
    acked: list[dict[str, Any]] = []

    def acknowledge(response: dict[str, Any]) -> None:
        acked.append(response)
        if len(acked) == kill_after:
            server.kill()

    async with trio.open_nursery() as nursery:
        ChainLoad(server, acknowledge, DEADLINE).start(
            nursery, ws_clients=WS_CLIENTS, http_clients=HTTP_CLIENTS
        )
    return acked


def ledger_rows(data_dir: Path) -> dict[str, list[tuple[int, int, int, int]]]:
    """response_id -> [(step, complete, input_tokens, output_tokens)] from the ledger file."""
    conn = sqlite3.connect(data_dir / "usage.sqlite3")
    try:
        return usage_by_response(
            conn.execute(
                "SELECT response_id, step, complete, input_tokens, output_tokens FROM usage"
                " ORDER BY response_id, step"
            )
        )
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
                await check_acknowledged(client, restarted.url, acked, then="after the crash")
    check_acknowledged_usage(acked, rows)
