"""`rollout serve --workers 2`: one port, two processes, one store.

A real `rollout serve --workers 2` subprocess. Which worker holds a connection is read from
the kernel (psutil: the worker process whose socket has the client's port as its peer), so
the tests prove where each request ran: connections land on both workers, a stored chain
alternates between them, retrieval and deletion work from either, /metrics sums both, a
worker killed is reported and restarted while the other goes on, and SIGTERM to the parent
drains an in-flight stream to completion and leaves the ledger equal to the usage clients saw.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio
from rollout import protocol as p

from tests.client_harness import RolloutProcess, open_rollout_process
from tests.server_harness import WsClient, open_ws
from tests.store_harness import Store

DEADLINE = 90
MODEL = "sim:tokens=8"
# Connections opened at most to find one on a given worker: the kernel hands each to whichever
# worker accepts first, so a few tries suffice; this many bounds a pathological machine.
MAX_TRIES = 64
_READY = re.compile(r"worker (\d+) \(pid (\d+)\) ready")
_SIGTERM = re.compile(r"worker \d+ received SIGTERM")


def workers(server: RolloutProcess) -> dict[int, int]:
    """Worker number -> pid, from the parent's log (the latest start of each)."""
    found: dict[int, int] = {}
    for line in server.lines:
        match = _READY.search(line)
        if match:
            found[int(match[1])] = int(match[2])
    return found


def worker_of(server: RolloutProcess, client_port: int) -> int:
    """The pid of the worker holding the connection from `client_port` (0 if none does)."""
    for pid in workers(server).values():
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        if any(c.raddr and c.raddr.port == client_port for c in connections):
            return pid
    return 0


@asynccontextmanager
async def ws_on(server: RolloutProcess, pid: int) -> AsyncIterator[WsClient]:
    """A WebSocket held by worker `pid` (connections are opened until one lands there)."""
    for _ in range(MAX_TRIES):
        async with open_ws(server.url) as ws:
            if worker_of(server, ws.ws.local.port) == pid:
                yield ws
                return
    raise AssertionError(f"no WebSocket landed on worker {pid} in {MAX_TRIES} tries")


@asynccontextmanager
async def http_on(server: RolloutProcess, pid: int) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client whose kept-alive connection is held by worker `pid`."""
    for _ in range(MAX_TRIES):
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as client:
            response = await client.get(server.url.removesuffix("/v1") + "/healthz")
            port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
            if worker_of(server, port) == pid:
                yield client
                return
    raise AssertionError(f"no HTTP connection landed on worker {pid} in {MAX_TRIES} tries")


@asynccontextmanager
async def open_workers(data_dir: Path, *args: str) -> AsyncIterator[RolloutProcess]:
    async with open_rollout_process(
        data_dir=data_dir, extra_args=["--workers", "2", *args]
    ) as server:
        assert sorted(workers(server)) == [1, 2], server.tail()
        yield server


async def test_connections_land_on_both_workers_and_a_chain_alternates(
    tmp_path: Path, shared_store: Store
) -> None:
    seen: list[dict[str, Any]] = []  # every completed response's usage, as clients saw it
    with trio.fail_after(DEADLINE):
        async with open_workers(tmp_path / "data", *shared_store.args) as server:
            pids = workers(server)
            # Many connections at once: the kernel spreads them over both workers.
            async with AsyncExitStack() as stack:
                sockets = [await stack.enter_async_context(open_ws(server.url)) for _ in range(16)]
                holders = {worker_of(server, ws.ws.local.port) for ws in sockets}
            assert holders == set(pids.values()), (holders, pids)

            one, two = pids[1], pids[2]
            async with (
                ws_on(server, one) as ws1,
                ws_on(server, two) as ws2,
                http_on(server, one) as http1,
                http_on(server, two) as http2,
            ):

                async def completed(http: httpx.AsyncClient) -> float:
                    """`/metrics`' completed responses, as the worker `http` reaches sums them
                    (no waiting: a scrape sees every turn a client saw end)."""
                    text = (await http.get(server.url.removesuffix("/v1") + "/metrics")).text
                    assert 'rollout_stage_seconds_bucket{le="1",stage="render"}' in text
                    match = re.search(r'rollout_responses_total\{status="completed"\} (\S+)', text)
                    assert match is not None, text
                    return float(match[1])

                # A stored chain alternating between the workers, over WebSockets held by each;
                # after each turn, the other worker's /metrics counts it.
                previous: str | None = None
                chain: list[str] = []
                for turn in range(6):
                    ws, other = ((ws1, http2), (ws2, http1))[turn % 2]
                    events = await ws.create(
                        model=MODEL,
                        input=f"turn {turn}",
                        previous_response_id=previous,
                        store=True,
                    )
                    final = events[-1]
                    assert final.type == "response.completed", final
                    seen.append(p.to_wire(final.response)["usage"])
                    previous = final.response.id
                    chain.append(previous)
                    # Each continuation ran with the whole history: its input grows.
                    if turn:
                        assert final.response.usage.input_tokens > seen[-2]["input_tokens"]
                    assert await completed(other) == turn + 1

                # Retrieval and input items from either worker; deletion on one, seen by the
                # other.
                for rid in chain:
                    for http in (http1, http2):
                        got = await http.get(f"/responses/{rid}")
                        assert got.status_code == 200, got.text
                        assert got.json()["id"] == rid
                items = await http2.get(f"/responses/{chain[0]}/input_items")
                assert items.status_code == 200 and items.json()["data"], items.text
                deleted = await http1.delete(f"/responses/{chain[-1]}")
                assert deleted.status_code == 200, deleted.text
                gone = await http2.get(f"/responses/{chain[-1]}")
                assert gone.status_code == 404, gone.text
                # The rest of the chain still continues, from the other worker over HTTP.
                resp = await http2.post(
                    "/responses",
                    json={"model": MODEL, "input": "after", "previous_response_id": chain[-2]},
                )
                assert resp.json()["status"] == "completed", resp.text
                seen.append(resp.json()["usage"])
                assert await completed(http1) == await completed(http2) == len(seen)
    rows, inp, out = shared_store.totals()
    assert rows == len(seen)
    assert (inp, out) == (
        sum(u["input_tokens"] for u in seen),
        sum(u["output_tokens"] for u in seen),
    )


@pytest.mark.parametrize("signalled", ["parent", "group"])
async def test_sigterm_drains_every_worker(
    tmp_path: Path, shared_store: Store, signalled: str
) -> None:
    """SIGTERM to the parent (or, as a service manager may, to the whole process group, and
    again while the workers drain): a stream in flight on each worker completes, the parent
    exits 0 (checked by the harness), and the ledger holds exactly the usage the clients
    saw."""
    seen: list[dict[str, Any]] = []
    slow = "sim:tokens=80,tps=80"  # a second of streaming, within the 2 s grace
    with trio.fail_after(DEADLINE):
        async with open_workers(tmp_path / "data", *shared_store.args) as server:
            pids = workers(server)
            async with ws_on(server, pids[1]) as ws1, ws_on(server, pids[2]) as ws2:
                for ws in (ws1, ws2):
                    await ws.send({"type": "response.create", "model": slow, "input": "go"})
                for ws in (ws1, ws2):  # both streaming
                    while (await ws.recv()).type != "response.output_text.delta":
                        pass
                if signalled == "parent":
                    server.terminate()
                else:
                    server.terminated = True  # the harness then only waits for the exit
                    os.killpg(server.pid, signal.SIGTERM)
                    await server.wait_for(  # both workers took the first
                        lambda s: sum(bool(_SIGTERM.search(line)) for line in s.lines) == 2
                    )
                    os.killpg(server.pid, signal.SIGTERM)
                for ws in (ws1, ws2):
                    events = await ws.until_terminal()
                    assert events[-1].type == "response.completed", events[-1]
                    seen.append(p.to_wire(events[-1].response)["usage"])
                    assert events[-1].response.usage.output_tokens == 80
        stopping = (
            "received SIGTERM: stopping 2 workers, each waiting up to 2 s (--graceful-timeout) "
            "for its responses in flight"
        )
        assert any(stopping in line for line in server.lines), server.tail()
        for number, pid in pids.items():
            assert any(f"worker {number} (pid {pid}) stopped" in line for line in server.lines)
            waiting = (
                f"worker pid {pid} stopping: waiting up to 2 s (--graceful-timeout) for 1 "
                "response in flight"
            )
            assert any(waiting in line for line in server.lines), server.tail()
    rows, inp, out = shared_store.totals()
    assert rows == 2
    assert (inp, out) == (
        sum(u["input_tokens"] for u in seen),
        sum(u["output_tokens"] for u in seen),
    )


async def test_a_dead_worker_is_reported_and_restarted(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_workers(tmp_path / "data") as server:
            pids = workers(server)
            async with ws_on(server, pids[2]) as survivor:
                psutil.Process(pids[1]).kill()
                await server.wait_for(lambda s: workers(s)[1] != pids[1])
                assert any(
                    f"worker 1 (pid {pids[1]}) was killed by SIGKILL; restarting" in line
                    for line in server.lines
                ), server.tail()
                # The other worker's connection went on; the new worker serves.
                events = await survivor.create(model=MODEL, input="still here", store=False)
                assert events[-1].type == "response.completed"
                async with ws_on(server, workers(server)[1]) as fresh:
                    events = await fresh.create(model=MODEL, input="new worker", store=False)
                    assert events[-1].type == "response.completed"


@pytest.mark.parametrize("workers_arg", ["0", "-1", "two"])
def test_workers_must_be_a_positive_count(workers_arg: str, capsys: Any) -> None:
    from rollout._cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--workers", workers_arg])
    assert exit_.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_a_worker_that_cannot_start_stops_the_server(tmp_path: Path) -> None:
    """A worker dying before it served (here: its model file is missing; the parent does not
    read it) is not restarted in a loop: the server stops with status 1, saying why."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from rollout.engine._logging import configure_logging\n"
        "from rollout.engine._serve import ServerConfig\n"
        "from rollout.engine._workers import run_workers\n"
        "configure_logging('info')\n"
        f"config = ServerConfig(port=0, data_dir=Path({str(tmp_path / 'data')!r}))\n"
        f"sys.exit(run_workers(config, workers=2, models=Path({str(tmp_path / 'no.toml')!r})))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=DEADLINE)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 1, stderr
    assert "before it served: stopping the server" in stderr, stderr
    assert "restarting" not in stderr, stderr


async def test_bench_counts_the_workers(tmp_path: Path) -> None:
    """`rollout bench --workers N` starts its local servers with it, and the bench's server
    CPU and memory include the workers (the parent alone does almost nothing)."""
    from rollout._cli import build_parser
    from rollout.bench._cli import _servers
    from rollout.bench._server import ProcStats

    args = build_parser().parse_args(["bench", "--workers", "2", "--local", "one=--workers 1"])
    assert [s.serve_args for s in _servers(args)] == [("--workers", "1")]
    args = build_parser().parse_args(["bench", "--workers", "2"])
    assert [s.serve_args for s in _servers(args)] == [("--workers", "2")]

    with trio.fail_after(DEADLINE):
        async with open_workers(tmp_path / "data") as server:
            stats = ProcStats(server.pid)
            alone = psutil.Process(server.pid)
            workers_cpu = sum(
                sum(psutil.Process(pid).cpu_times()[:2]) for pid in workers(server).values()
            )
            total = stats.cpu_seconds()
            assert total is not None
            assert total >= sum(alone.cpu_times()[:2]) + workers_cpu - 0.05
            peak = stats.peak_rss_bytes()
            assert peak is not None and peak > alone.memory_info().rss * 2


def test_metrics_merge_every_workers_files(tmp_path: Path) -> None:
    """What each worker writes (its own totals) merges into one set of series: counters and
    histograms summed over every worker that ran, gauges over the live ones, bucket labels
    spelled as one process spells them."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.multiprocess import mark_process_dead
    from rollout.engine._metrics import _MergedCollector, _SharedFiles

    def families(n: int) -> list[Any]:
        work = CounterMetricFamily("rollout_work_total", "Work.", labels=["counter"])
        work.add_metric(["tokens_rendered"], n)
        open_ = GaugeMetricFamily("rollout_open_connections", "Open.", labels=["transport"])
        open_.add_metric(["websocket"], n)
        stages = HistogramMetricFamily("rollout_stage_seconds", "Stages.", labels=["stage"])
        stages.add_metric(["render"], [("0.1", n), ("1", 2 * n), ("+Inf", 3 * n)], n / 10)
        return [work, open_, stages]

    def scrape() -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_MergedCollector(tmp_path))
        return generate_latest(registry).decode()

    one, two = _SharedFiles(tmp_path, 101), _SharedFiles(tmp_path, 102)
    one.write(families(1))
    two.write(families(2))
    text = scrape()
    assert 'rollout_work_total{counter="tokens_rendered"} 3.0' in text
    assert 'rollout_open_connections{transport="websocket"} 3.0' in text
    assert 'rollout_stage_seconds_bucket{le="0.1",stage="render"} 3.0' in text
    assert 'rollout_stage_seconds_bucket{le="1",stage="render"} 6.0' in text
    assert 'rollout_stage_seconds_bucket{le="+Inf",stage="render"} 9.0' in text
    assert 'rollout_stage_seconds_count{stage="render"} 9.0' in text
    assert "rollout_stage_seconds_sum" in text and 'le="1.0"' not in text
    one.write(families(5))  # a worker writes its totals again: they replace its earlier ones
    assert 'rollout_work_total{counter="tokens_rendered"} 7.0' in scrape()
    two.close()
    mark_process_dead(102, str(tmp_path))  # the parent, when worker 102 exits
    text = scrape()
    assert 'rollout_open_connections{transport="websocket"} 5.0' in text  # live ones only
    assert 'rollout_work_total{counter="tokens_rendered"} 7.0' in text  # its counts stay
    one.close()


def test_a_port_in_use_is_one_line_before_any_worker_starts(tmp_path: Path) -> None:
    """The parent holds the port before anything else, as one process binds: a port another
    server listens on (without SO_REUSEPORT) is refused with one process's one-line error."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "rollout", "serve", "--workers", "2"]
        command += ["--port", str(port), "--data-dir", str(tmp_path / "data")]
        process = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            stdin=subprocess.DEVNULL,
        )
    assert process.returncode == 1, process.stderr
    assert f"127.0.0.1:{port} is already in use" in process.stderr
    assert "worker" not in process.stderr and not (tmp_path / "data").exists()
