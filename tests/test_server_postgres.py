"""Two servers on one PostgreSQL database (`ServerConfig.store_url`, `rollout serve --store`):
a stored chain alternates between them, each hydrating from the database what the other stored
(from the stored renderings: nothing is rendered again), retrieval, `input_items`,
`item_reference` and deletion work from either, a compaction item sealed by one opens on the
other (the key is shared through the database), and the ledger holds the usage the client saw.
A commit that fails (the database down) fails the response with `server_error`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest
import trio
from rollout import protocol as p
from rollout.engine import MemoryResponseStore, MemoryUsageLedger, UsageRecord, open_engine
from rollout.engine._pg_ledger import open_postgres_ledger

from tests.server_harness import fetch_counters, open_test_server

DEADLINE = 60
MODEL = "sim"
TURNS = 6


async def create(client: httpx.AsyncClient, url: str, **body: Any) -> dict[str, Any]:
    response = await client.post(f"{url}/responses", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    assert data["status"] == "completed", data
    return data


async def test_two_servers_share_stored_responses_and_usage(
    postgres_urls: Callable[[], str],
) -> None:
    store_url = postgres_urls()
    seen = {"input_tokens": 0, "output_tokens": 0, "records": 0}

    def saw(response: dict[str, Any]) -> None:
        seen["input_tokens"] += response["usage"]["input_tokens"]
        seen["output_tokens"] += response["usage"]["output_tokens"]
        seen["records"] += 1

    with trio.fail_after(DEADLINE):
        async with (
            open_test_server(store_url=store_url) as a,
            open_test_server(store_url=store_url) as b,
            httpx.AsyncClient(timeout=20) as client,
        ):
            servers = [a, b]
            ids: list[str] = []
            hydrated: list[tuple[int, int]] = []  # (tokens rendered, input tokens) per turn
            previous = None
            # Alternating, then three turns on `a` before one on `b` (which has seen none of
            # them: without stored renderings it would render all three).
            order = [turn % 2 for turn in range(TURNS)] + [0, 0, 0, 1]
            for turn, which in enumerate(order):
                url = servers[which]
                before = await fetch_counters(url)
                response = await create(
                    client,
                    url,
                    input=f"turn {turn}: tell me more about the weather in Rome",
                    previous_response_id=previous,
                )
                after = await fetch_counters(url)
                saw(response)
                if previous is not None and which != order[turn - 1]:
                    # The other server stored the parent: hydrated from the database, from its
                    # stored renderings.
                    assert after["hydrations"] - before["hydrations"] == 1
                    rendered = after["tokens_rendered"] - before["tokens_rendered"]
                    hydrated.append((rendered, response["usage"]["input_tokens"]))
                previous = response["id"]
                ids.append(previous)
            # Flat: this turn's input and output, never the history (which grows each turn by
            # ~50 tokens). The simulated model's words are not always one o200k token each
            # once joined, so the previous output's rendering may differ by a token or two.
            rendered_per_turn = [r for r, _ in hydrated]
            assert max(rendered_per_turn) - min(rendered_per_turn) <= 2, hydrated
            assert hydrated[-1][0] * 4 < hydrated[-1][1], hydrated
            for url in servers:
                for rid in ids:
                    got = await client.get(f"{url}/responses/{rid}")
                    assert got.status_code == 200 and got.json()["id"] == rid
            items = (await client.get(f"{b}/responses/{ids[-1]}/input_items?limit=100")).json()
            assert (
                len(items["data"]) == 2 * len(order) - 1
            )  # every user turn, every answer but last
            first = (await client.get(f"{a}/responses/{ids[0]}")).json()
            answer_id = first["output"][-1]["id"]
            referenced = await create(
                client,
                b,
                input=[
                    {"type": "item_reference", "id": answer_id},
                    {"role": "user", "content": "and tomorrow?"},
                ],
            )
            saw(referenced)
            compacted = await client.post(
                f"{a}/responses/compact", json={"model": MODEL, "previous_response_id": ids[-1]}
            )
            assert compacted.status_code == 200, compacted.text
            saw(compacted.json())  # a compaction's usage is billed like a response's
            window = compacted.json()["output"]
            assert window[-1]["type"] == "compaction"
            opened = await create(
                client, b, input=[window[-1], {"role": "user", "content": "so what next?"}]
            )
            saw(opened)
            assert opened["usage"]["input_tokens_details"]["cached_tokens"] > 0
            # Deleted on one, gone on both.
            assert (await client.delete(f"{b}/responses/{ids[0]}")).status_code == 200
            for url in servers:
                assert (await client.get(f"{url}/responses/{ids[0]}")).status_code == 404
        async with await open_postgres_ledger(store_url) as ledger:
            totals = await ledger.totals()
    assert totals == {**seen, "incomplete": 0, "cached_tokens": totals["cached_tokens"]}
    assert compacted.json()["usage"]["input_tokens"] > 0  # (so the total above counts it)


@pytest.mark.parametrize("url", ["sqlite:///x.db", "/tmp/rollout.db"])
def test_cli_refuses_a_store_that_is_not_postgresql(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollout._cli import main

    assert main(["serve", "--store", url, "--port", "0"]) == 2
    assert "--store: expected a postgresql:// URL" in capsys.readouterr().err


def test_cli_says_why_the_store_cannot_be_opened(capsys: pytest.CaptureFixture[str]) -> None:
    from rollout._cli import main

    code = main(["serve", "--store", "postgresql://nobody@127.0.0.1:1/none", "--port", "0"])
    assert code == 1  # could not start (tests/test_cli_serve.py has the whole message)
    err = capsys.readouterr().err
    assert "rollout serve: cannot open the store at postgresql://127.0.0.1:1/none" in err


class FailingLedger(MemoryUsageLedger):
    """A ledger whose database is down: every async write fails."""

    async def record(self, records: Sequence[UsageRecord]) -> None:
        raise OSError("the database is down")


@pytest.mark.parametrize("store", [False, True])
async def test_a_commit_that_fails_ends_the_response_with_server_error(store: bool) -> None:
    """The response cannot be acknowledged as durable: instead of its terminal event, a
    `response.failed` with `server_error` (same sequence number); its usage waits with the
    writer for the ledger to come back (tests/test_postinfer.py), and a stored copy is not
    found."""
    events: list[p.ServerEvent] = []

    async def emit(event: p.ServerEvent) -> None:
        events.append(event)

    ledger = FailingLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger, store=MemoryResponseStore()) as engine:
            state = await engine.session().create(
                p.ResponseCreate(model=MODEL, input="hi", store=store), emit
            )
            await engine.post.flushed()
            assert engine.counters.responses_failed == 1
            # Never written, so never found: not by a retrieval, not as a previous response.
            rid = events[0].response.id  # type: ignore[attr-defined]
            assert await engine.get_stored(rid, owner=None) is None
    assert state is None
    final = events[-1]
    assert isinstance(final, p.ResponseFailed), final
    assert final.response.error is not None and final.response.error.code == "server_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert not [e for e in events if e.type == "response.completed"]


def test_connections_are_set_to_notice_a_server_that_vanished(
    postgres_urls: Callable[[], str],
) -> None:
    """Our TCP keepalive and user-timeout defaults, under the URL's own settings, reach
    libpq: a real connection opens with them and reports them. (What they do when a host
    vanishes, a dropped connection noticed within ~25 s, needs packet filtering to show and is
    not tested here: this checks that the settings are in force, not their effect.)"""
    from rollout.engine._pg import connect, conninfo_of

    url = postgres_urls()
    with connect(conninfo_of(url)) as conn:
        params = conn.info.get_parameters()
    assert {k: params.get(k) for k in ("keepalives_idle", "keepalives_count")} == {
        "keepalives_idle": "10",
        "keepalives_count": "3",
    }, params
    assert params.get("tcp_user_timeout") == "30000", params
    own = url + ("&" if "?" in url else "?") + "keepalives_idle=60"
    with connect(conninfo_of(own)) as conn:
        assert conn.info.get_parameters().get("keepalives_idle") == "60"
