"""`rollout serve` as a real process: start, serve, SIGTERM, a clean exit, a complete ledger.

The server runs as `python -m rollout serve` on a free port with its own data folder. The test
waits for its "serving on" log line (no polling sleeps), checks `/healthz`, runs a rollout-mode
response with a tool step and a few `previous_response_id` chain responses over WebSocket plus
one HTTP response, then sends SIGTERM with one idle WebSocket connection open: the connection
is closed with 1001 (going away), the process exits 0 within its grace period, and the SQLite
usage ledger has a complete row for every sampling step of every response seen.
"""

from __future__ import annotations

import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
import trio_websocket
from rollout import protocol as p

from tests.server_harness import WEATHER_TOOLS, open_ws

GRACEFUL = 5.0
DEADLINE = 40


def free_port() -> int:
    """A port that was free a moment ago (`rollout serve --port 0` would not report its port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def drain(stream: trio.abc.ReceiveStream, lines: list[str], ready: trio.Event) -> None:
    """Read the server's stderr to the end (so it never blocks on a full pipe)."""
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            line = raw.decode(errors="replace")
            lines.append(line)
            if "serving on" in line:
                ready.set()


async def test_serve_process_sigterm_and_ledger(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    url = f"http://127.0.0.1:{port}/v1"
    command = [
        sys.executable,
        "-m",
        "rollout",
        "serve",
        "--port",
        str(port),
        "--data-dir",
        str(data),
        "--graceful-timeout",
        str(GRACEFUL),
    ]
    lines: list[str] = []
    ready = trio.Event()
    process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE)
    try:
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                assert process.stderr is not None
                nursery.start_soon(drain, process.stderr, lines, ready)
                with trio.fail_after(20):
                    await ready.wait()
                async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                    health = await http.get(f"http://127.0.0.1:{port}/healthz")
                    assert health.status_code == 200 and health.json() == {"status": "ok"}
                    seen = await exercise(url, http)

                # SIGTERM with an idle connection open: it is closed as "going away".
                async with open_ws(url) as idle:
                    process.send_signal(signal.SIGTERM)
                    with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                        await idle.recv()
                    reason = closed.value.reason
                    assert reason is not None and reason.code == 1001
                with trio.fail_after(GRACEFUL + 5):
                    code = await process.wait()
                assert code == 0, "\n".join(lines[-30:])
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()

    stopping = "received SIGTERM: no responses in flight, stopping now"
    assert any(stopping in line for line in lines), lines[-10:]
    with sqlite3.connect(data / "usage.sqlite3") as db:
        rows = db.execute("SELECT response_id, step, complete FROM usage").fetchall()
    steps: dict[str, list[int]] = {}
    for response_id, step, complete in rows:
        assert complete == 1, (response_id, step)
        steps.setdefault(response_id, []).append(step)
    assert set(steps) == set(seen)
    for response_id, n_steps in seen.items():
        assert sorted(steps[response_id]) == list(range(n_steps)), response_id


async def exercise(url: str, http: httpx.AsyncClient) -> dict[str, int]:
    """Serve a rollout, a chain and an HTTP response; returns {response id: sampling steps}."""
    seen: dict[str, int] = {}
    async with open_ws(url) as client:
        # A rollout-mode response with one tool step: two sampling steps, one response.
        await client.send(
            {
                "type": "response.create",
                "model": "sim:steps=1",
                "input": "weather in Oslo?",
                "tools": WEATHER_TOOLS,
                "rollout": True,
            }
        )
        done = (await client.until_terminal())[-1]
        assert isinstance(done, p.ResponseDone)
        outputs = [
            {"type": "function_call_output", "call_id": cid, "output": "snow"}
            for cid in done.pending_call_ids
        ]
        events = await client.append(done.response.id, outputs)
        assert events[-1].type == "response.completed"
        seen[done.response.id] = 2
        # A chain of three responses continuing the rollout.
        previous = done.response.id
        for text in ("and tomorrow?", "and the day after?", "thanks"):
            events = await client.create(
                model="sim",
                input=text,
                previous_response_id=previous,
                tools=WEATHER_TOOLS,
                tool_choice="none",
            )
            assert events[-1].type == "response.completed", client.raw[-1]
            previous = events[-1].response.id
            seen[previous] = 1
    resp = await http.post("/responses", json={"model": "sim", "input": "hello"})
    assert resp.status_code == 200
    seen[resp.json()["id"]] = 1
    return seen


def rollout_command() -> list[str]:
    script = Path(sys.executable).parent / "rollout"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollout"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--help"], ["serve", "COMMAND"]),
        (["serve", "--help"], ["--port", "--data-dir", "--api-key", "--graceful-timeout"]),
    ],
    ids=["rollout", "rollout_serve"],
)
async def test_cli_help(args: list[str], expected: list[str]) -> None:
    with trio.fail_after(DEADLINE):
        for base in {tuple(rollout_command()), (sys.executable, "-m", "rollout")}:
            done = await trio.run_process([*base, *args], capture_stdout=True, capture_stderr=True)
            assert done.returncode == 0
            text = done.stdout.decode()
            assert text.startswith("usage: rollout")
            for word in expected:
                assert word in text
