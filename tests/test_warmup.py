"""The start-up warm-up (`engine/_warmup.py`): the first request generates no code, and the
warm-up leaves nothing behind in the server's store, ledger or counters.

Code generated on first use (cattrs' (un)structure functions, compiled patterns) is
process-wide, so the first-request check runs in a fresh interpreter: it serves, then profiles
the first HTTP create (JSON, then streamed) and the first WebSocket create and counts calls to
`compile`. Without the warm-up the same script finds them (the check can fail).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
from rollout.engine._warmup import warm_up, warm_up_needed

from tests.server_harness import counters, open_test_server, parse_metrics

DEADLINE = 60

FIRST_REQUESTS = """
import cProfile, json, pstats, sys
import httpx, trio, trio_websocket
from rollout.engine._serve import ServerConfig, open_server

TOOLS = [{"type": "function", "name": "lookup", "parameters": {"type": "object",
          "properties": {"q": {"type": "string"}}, "required": ["q"]}}]
BODY = {"model": "sim", "input": "Look it up.", "tools": TOOLS, "store": True}


def compiles(profile):
    stats = pstats.Stats(profile).stats
    return sum(v[1] for k, v in stats.items() if k[2] == "<built-in method builtins.compile>")


async def http_first(url, http, counts):
    for name, body in (("http", BODY), ("sse", {**BODY, "stream": True})):
        profile = cProfile.Profile()
        profile.enable()
        resp = await http.post(url + "/responses", json=body)
        profile.disable()
        assert resp.status_code == 200, resp.text
        counts[name] = compiles(profile)


async def ws_first(url, counts):
    async with trio_websocket.open_websocket_url(url.replace("http", "ws") + "/responses") as ws:
        profile = cProfile.Profile()
        profile.enable()
        await ws.send_message(json.dumps({"type": "response.create", **BODY}))
        while json.loads(await ws.get_message())["type"] != "response.completed":
            pass
        profile.disable()
        counts["ws"] = compiles(profile)


async def main():
    config = ServerConfig(port=0, data_dir=None, warm_up=sys.argv[1] == "1")
    async with open_server(config) as url, httpx.AsyncClient(timeout=30) as http:
        await http.get(url.removesuffix("/v1") + "/healthz")  # the client's own first use
        counts = {}
        if sys.argv[2] == "ws":
            await ws_first(url, counts)
            await http_first(url, http, counts)
        else:
            await http_first(url, http, counts)
            await ws_first(url, counts)
        print(json.dumps(counts))


trio.run(main)
"""


def first_request_compiles(tmp_path: Path, warm: bool, first: str) -> dict[str, int]:
    """Calls to `compile` during each first request, `first` (http or ws) going first."""
    script = tmp_path / "first.py"
    script.write_text(FIRST_REQUESTS)
    done = subprocess.run(
        [sys.executable, str(script), "1" if warm else "0", first],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return counts


@pytest.mark.parametrize("first", ["http", "ws"])
def test_the_first_requests_generate_no_code(tmp_path: Path, first: str) -> None:
    assert first_request_compiles(tmp_path, True, first) == {"http": 0, "sse": 0, "ws": 0}


@pytest.mark.parametrize("first", ["http", "ws"])
def test_without_the_warm_up_they_do(tmp_path: Path, first: str) -> None:
    """The check above can fail: a server started cold compiles on its first request."""
    counts = first_request_compiles(tmp_path, False, first)
    assert counts[first] > 0, counts


async def test_warm_up_leaves_nothing_in_the_servers_store_ledger_or_counters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollout.engine._serve as serve_module

    ran = []

    async def warm_up_and_count() -> None:
        await warm_up()
        ran.append(1)

    monkeypatch.setattr(serve_module, "warm_up_needed", lambda: True)  # even if warm already
    monkeypatch.setattr(serve_module, "warm_up", warm_up_and_count)
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path / "data") as url:
            async with httpx.AsyncClient() as http:
                text = (await http.get(url.removesuffix("/v1") + "/metrics")).text
        metrics = parse_metrics(text)
        assert counters(metrics), "no work counters"
        nonzero = {name for (name, _), value in metrics.items() if value}
        # This one request, nothing else: counted, and its connection open while it is answered.
        assert nonzero == {"rollout_http_requests_total", "rollout_open_tcp_connections"}
        assert metrics["rollout_open_tcp_connections", frozenset()] == 1
    assert ran == [1]
    for name, table in (("responses", "responses"), ("usage", "usage")):
        with sqlite3.connect(tmp_path / "data" / f"{name}.sqlite3") as db:
            assert db.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)


async def test_warm_up_runs_alone() -> None:
    """The embedded entry point: every warm-up request ends as expected (a failure raises)."""
    with trio.fail_after(DEADLINE):
        await warm_up()


async def test_a_process_warms_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import rollout.engine._serve as serve_module

    with trio.fail_after(DEADLINE):
        await warm_up()
    assert not warm_up_needed()
    calls = []

    async def counted() -> None:
        calls.append(1)

    monkeypatch.setattr(serve_module, "warm_up", counted)
    with trio.fail_after(DEADLINE):
        async with open_test_server():
            pass
    assert calls == []  # what it would warm is warm already


async def test_a_failing_warm_up_is_logged_and_the_server_serves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import rollout.engine._serve as serve_module

    async def broken() -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(serve_module, "warm_up", broken)
    monkeypatch.setattr(serve_module, "warm_up_needed", lambda: True)
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, httpx.AsyncClient() as http:
            resp = await http.post(url + "/responses", json={"model": "sim", "input": "hi"})
            assert resp.status_code == 200
    assert "the warm-up failed; serving anyway" in caplog.text
