"""Many hosts: two `rollout serve` instances sharing one store (PostgreSQL, as on many hosts;
and one SQLite data dir, as on one host), behind nginx.

nginx runs the documented example config (`docs/nginx.conf`, with its addresses and port
replaced) on a free port, in a prefix of its own in the test's tmp dir (`daemon off`, killed
at the end). The official `openai` SDK drives a chain of stored responses through the proxy:
each turn pins the other instance with the example's `x-rollout-instance` header and opens a
new connection (WebSocket turns: a new `client.responses.connect()`, the forced reconnect;
HTTP turns: `client.responses.create`), so every continuation runs on the instance that did
not make its parent. Each instance's access log proves which instance served what. Then
retrieval from either instance, deletion on one seen by the other, and the ledger total
equals the sum of the usage the client saw.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from openai.types.websocket_reconnection import ReconnectingEvent
from rollout.bench._server import free_port

from tests.client_harness import RolloutProcess, open_rollout_process, require
from tests.store_harness import Store

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "nginx.conf"
DEADLINE = 120
NGINX_START_TIMEOUT = 30.0
NGINX_STOP_TIMEOUT = 10.0
MODEL = "sim:tokens=8"
TURNS = 8  # instances a, b, a, b, ...; transports WebSocket, WebSocket, HTTP, HTTP, ...
INSTANCE = "x-rollout-instance"  # the example config's header that pins an instance


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)),
        None,
    )
    require(
        found,
        "nginx is not installed: install Debian's nginx-light (or nginx) package "
        "(`.ci/ensure-nginx` does so as root without starting its service)",
    )
    assert found is not None
    return found


@pytest.fixture
def nginx() -> str:
    """nginx's binary, looked up before a test starts anything: the test is skipped (or fails
    under ROLLOUT_REQUIRE_ALL) without it, with the reason. (A `pytest.skip` inside an async
    test's trio run is reported without its reason, as `python.py:187: Skipped`: pytest-trio
    0.8 skips again without one.)"""
    return nginx_binary()


def proxy_config(example: str, a: str, b: str, port: int) -> str:
    """The example with the instances' addresses and the proxy's port put in (each
    replacement checked, so the example and this test cannot drift apart)."""
    for old, new, count in (
        ("10.0.0.11:8000", a, 2),
        ("10.0.0.12:8000", b, 2),
        ("listen 80;", f"listen 127.0.0.1:{port};", 1),
    ):
        assert example.count(old) == count, f"docs/nginx.conf no longer has {old!r} x{count}"
        example = example.replace(old, new)
    return example


def nginx_command(prefix: Path, a: str, b: str, port: int) -> list[str]:
    """Writes the proxy's config into `prefix`; the command that runs nginx on it."""
    prefix.mkdir(parents=True)
    (prefix / "rollout.conf").write_text(proxy_config(EXAMPLE.read_text(), a, b, port))
    user = "user root;\n" if os.geteuid() == 0 else ""  # temp dirs below are ours
    temp_paths = "".join(
        f"    {kind}_temp_path {prefix / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (prefix / "nginx.conf").write_text(
        f"{user}daemon off;\nworker_processes 1;\npid {prefix / 'nginx.pid'};\n"
        f"error_log {prefix / 'error.log'} info;\n"
        "events { worker_connections 256; }\n"
        f"http {{\n    access_log {prefix / 'access.log'};\n{temp_paths}"
        f"    include {prefix / 'rollout.conf'};\n}}\n"
    )
    command = [nginx_binary(), "-p", str(prefix), "-c", str(prefix / "nginx.conf")]
    return [*command, "-e", str(prefix / "error.log")]


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@asynccontextmanager
async def open_nginx(prefix: Path, a: str, b: str) -> AsyncIterator[str]:
    """nginx in front of instances `a` and `b` (host:port); yields the proxy's base URL."""
    port = free_port()
    command = nginx_command(prefix, a, b, port)
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    healthy = False
    try:
        with trio.move_on_after(NGINX_START_TIMEOUT):
            async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
                while process.poll() is None:
                    try:
                        if (await client.get(url + "/healthz")).status_code == 200:
                            healthy = True
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.05)
        assert healthy, (
            f"nginx did not proxy /healthz (exit {process.poll()}):\n{tail(prefix / 'error.log')}"
        )
        yield url + "/v1"
    finally:
        with trio.CancelScope(shield=True):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(NGINX_STOP_TIMEOUT):
                    await process.wait()
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()


def address(server: RolloutProcess) -> str:
    return server.url.removeprefix("http://").removesuffix("/v1")


def drive_chain(base_url: str) -> dict[str, Any]:
    """The SDK's side (blocking; run in a thread): the chain, retrievals and the deletion.
    Returns every response's usage and where each turn was sent."""
    client = openai.OpenAI(
        base_url=base_url,
        api_key="unused",
        max_retries=0,
        timeout=30,
        http_client=httpx.Client(trust_env=False, timeout=30),
    )
    usage: list[dict[str, int]] = []
    chain: list[str] = []
    texts: list[str] = []
    for turn in range(TURNS):
        pin = {INSTANCE: "ab"[turn % 2]}
        fields: dict[str, Any] = {"model": MODEL, "input": f"turn {turn}", "store": True}
        if chain:
            fields["previous_response_id"] = chain[-1]
        if (turn // 2) % 2 == 0:
            # WebSocket mode on a new connection: the previous socket is closed, the chain
            # continues on the other instance, which has only the store to go on.
            with client.responses.connect(extra_headers=pin) as conn:
                conn.response.create(**fields)
                for event in conn:
                    assert event.type not in ("error", "response.failed"), event
                    if event.type == "response.completed":
                        response = event.response
                        break
        else:
            response = client.responses.create(**fields, extra_headers=pin)
        assert response.status == "completed", response
        assert response.usage is not None
        if usage:  # the continuation saw the whole history: its input grew
            assert response.usage.input_tokens > usage[-1]["input_tokens"]
        usage.append(response.usage.model_dump())
        chain.append(response.id)
        texts.append(response.output_text)

    for rid, text in zip(chain, texts, strict=True):
        for instance in "ab":
            got = client.responses.retrieve(rid, extra_headers={INSTANCE: instance})
            assert (got.id, got.output_text) == (rid, text)
    deleted = client.responses.delete(chain[-1], extra_headers={INSTANCE: "a"})
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(chain[-1], extra_headers={INSTANCE: "b"})
    # Without a pin the proxy's pool picks an instance; the chain's rest still continues.
    after = client.responses.create(model=MODEL, input="after", previous_response_id=chain[-2])
    assert after.status == "completed" and after.usage is not None
    usage.append(after.usage.model_dump())
    return {"usage": usage}


def served(server: RolloutProcess) -> tuple[int, int]:
    """(WebSocket connections closed, HTTP creates) in an instance's access log."""
    records = server.access()
    sockets = sum(r.get("event") == "ws_closed" for r in records)
    creates = sum(
        r.get("event") == "http" and r.get("method") == "POST" and r.get("path") == "/v1/responses"
        for r in records
    )
    return sockets, creates


async def test_a_chain_alternates_between_instances_behind_nginx(
    nginx: str, tmp_path: Path, shared_store: Store
) -> None:
    with trio.fail_after(DEADLINE):
        async with (
            open_rollout_process(data_dir=tmp_path / "a", extra_args=shared_store.args) as a,
            open_rollout_process(data_dir=tmp_path / "b", extra_args=shared_store.args) as b,
            open_nginx(tmp_path / "nginx", address(a), address(b)) as proxy,
        ):
            result = await trio.to_thread.run_sync(drive_chain, proxy, abandon_on_cancel=True)
            # Each instance served its pinned turns: two WebSocket connections and two
            # HTTP creates each (the last, unpinned create went to either).
            # (An access record is written once its response went out: polled for.)
            while True:
                if served(a)[0] + served(b)[0] >= 4 and served(a)[1] + served(b)[1] >= 5:
                    break
                await trio.sleep(0.05)
            assert served(a)[0] == served(b)[0] == 2
            assert served(a)[1] + served(b)[1] == 5
            assert min(served(a)[1], served(b)[1]) >= 2
    seen = result["usage"]
    rows, inp, out = shared_store.totals()
    assert rows == len(seen) == TURNS + 1
    assert (inp, out) == (
        sum(u["input_tokens"] for u in seen),
        sum(u["output_tokens"] for u in seen),
    )


def test_the_example_config_passes_websocket_upgrades() -> None:
    """Structure only (the test above runs it): the settings a WebSocket needs through
    nginx are in the documented example."""
    example = EXAMPLE.read_text()
    for needed in (
        "proxy_http_version 1.1;",
        "proxy_set_header Upgrade $http_upgrade;",
        "proxy_set_header Connection $rollout_connection;",
        "proxy_read_timeout",
        "proxy_buffering off;",
    ):
        assert needed in example, needed


def open_websockets(server: RolloutProcess) -> int:
    """The instance's `rollout_open_connections` gauge, scraped from it directly."""
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", trust_env=False).text
    match = re.search(r'rollout_open_connections\{transport="websocket"\} (\S+)', text)
    assert match is not None, text
    return int(float(match[1]))


async def test_the_sdk_reconnects_through_the_proxy_when_its_instance_goes_away(
    nginx: str, tmp_path: Path, shared_store: Store
) -> None:
    """One `client.responses.connect()` through the proxy's pool (no pin): its instance stops
    (SIGTERM: the idle socket closes with 1001, going away); the SDK reconnects by itself
    through the proxy, lands on the other instance, and the stored chain continues there."""
    closes: list[int] = []

    def on_reconnecting(event: ReconnectingEvent) -> None:
        closes.append(event.close_code)

    with trio.fail_after(DEADLINE):
        async with (
            open_rollout_process(data_dir=tmp_path / "a", extra_args=shared_store.args) as a,
            open_rollout_process(data_dir=tmp_path / "b", extra_args=shared_store.args) as b,
            open_nginx(tmp_path / "nginx", address(a), address(b)) as proxy,
        ):
            client = openai.OpenAI(
                base_url=proxy,
                api_key="unused",
                max_retries=0,
                timeout=30,
                http_client=httpx.Client(trust_env=False, timeout=30),
            )
            manager = client.responses.connect(
                on_reconnecting=on_reconnecting, initial_delay=0.05, max_delay=0.5
            )
            conn = await trio.to_thread.run_sync(manager.enter)
            events_in, events = trio.open_memory_channel[Any](math.inf)

            def pump() -> None:  # the SDK's iterator, reconnecting inside, in a thread
                for event in conn:
                    trio.from_thread.run_sync(events_in.send_nowait, event)

            async def turn(**fields: Any) -> Any:
                create = functools.partial(conn.response.create, model=MODEL, store=True, **fields)
                await trio.to_thread.run_sync(create)
                async for event in events:
                    assert event.type not in ("error", "response.failed"), event
                    if event.type == "response.completed":
                        return event.response
                raise AssertionError("the connection ended")

            async def holding(*servers: RolloutProcess) -> list[int]:
                """The open WebSocket count of each server, once they add up to one."""
                while True:
                    counts = [await trio.to_thread.run_sync(open_websockets, s) for s in servers]
                    if sum(counts) == 1:
                        return counts
                    await trio.sleep(0.05)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(trio.to_thread.run_sync, pump, abandon_on_cancel=True)
                )
                first = await turn(input="before")
                gone, other = (a, b) if (await holding(a, b))[0] else (b, a)
                gone.terminate()
                await holding(other)  # the SDK reconnected, through the proxy, to the other
                second = await turn(input="after", previous_response_id=first.id)
                assert await holding(other) == [1]
                assert second.usage.input_tokens > first.usage.input_tokens
                await trio.to_thread.run_sync(conn.close)
    assert closes == [1001]
    seen = [first.usage, second.usage]
    assert shared_store.totals() == (
        2,
        sum(u.input_tokens for u in seen),
        sum(u.output_tokens for u in seen),
    )
