"""The servers under test: a `rollout serve` subprocess started by the benchmark, or any
Responses server at a URL; its /metrics work counters; the subprocess's CPU and memory.

CPU and peak memory come from /proc of the server subprocess (utime + stime, and VmHWM, reset
before each run through /proc/PID/clear_refs where the kernel allows it); they are not
available for a server given by URL.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from ._errors import PreflightError, ServerStartError, ServerUnreachable

__all__ = [
    "Endpoint",
    "ProcStats",
    "check_reachable",
    "free_port",
    "open_local_server",
    "parse_counters",
    "parse_stage_sums",
    "preflight",
    "scrape_metrics",
    "stop_process",
]

# How long `rollout serve` gets to answer /healthz after it is started (it loads the o200k
# vocabulary, about half a second, then binds).
SERVER_START_TIMEOUT = 60.0
# How long it gets to shut down gracefully before it is killed.
SERVER_STOP_TIMEOUT = 20.0

_COUNTER_LINE = re.compile(r'^rollout_work_total\{counter="([a-z_]+)"\}\s+(\S+)$', re.M)
_STAGE_SUM_LINE = re.compile(r'^rollout_stage_seconds_sum\{stage="([a-z_]+)"\}\s+(\S+)$', re.M)


@attrs.frozen(kw_only=True)
class Endpoint:
    """A Responses server: its HTTP base URL (`http://host:port/v1`) and how to reach it."""

    label: str
    base_url: str
    api_key: str | None = None
    pid: int | None = None  # the local server subprocess, for /proc statistics
    spawned: bool = False

    @property
    def ws_url(self) -> str:
        url = self.base_url.rstrip("/")
        if url.startswith("https://"):
            url = "wss://" + url.removeprefix("https://")
        elif url.startswith("http://"):
            url = "ws://" + url.removeprefix("http://")
        return url + "/responses"

    @property
    def responses_url(self) -> str:
        return self.base_url.rstrip("/") + "/responses"

    @property
    def root_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url.removesuffix("/v1")

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def proc(self) -> ProcStats | None:
        return ProcStats(self.pid) if self.pid is not None else None


class ProcStats:
    """CPU seconds and peak resident memory of a local process and its children (the workers
    of `rollout serve --workers N`), from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _pids(self) -> list[int]:
        """The process and its live children (a worker's CPU is not the parent's until the
        worker exits)."""
        try:
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:
            children = []
        return [self.pid, *(int(c) for c in children)]

    def cpu_seconds(self) -> float | None:
        total: float | None = None
        for pid in self._pids():
            try:
                raw = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            # Fields after the parenthesised command name; utime and stime are fields 14 and 15.
            fields = raw.rsplit(")", 1)[1].split()
            total = (total or 0.0) + (int(fields[11]) + int(fields[12])) / self._tick
        return total

    def peak_rss_bytes(self) -> int | None:
        """The sum of each process's peak (their peaks need not coincide: an upper bound)."""
        total: int | None = None
        for pid in self._pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total = (total or 0) + int(line.split()[1]) * 1024
            except OSError:
                continue
        return total

    def reset_peak(self) -> bool:
        """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs). False if refused."""
        try:
            for pid in self._pids():
                Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_counters(text: str) -> dict[str, int]:
    return {name: int(float(value)) for name, value in _COUNTER_LINE.findall(text)}


def parse_stage_sums(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in _STAGE_SUM_LINE.findall(text)}


async def scrape_metrics(client: httpx.AsyncClient, endpoint: Endpoint) -> str | None:
    """The Prometheus text of /metrics, or None when the server has none."""
    try:
        response = await client.get(endpoint.root_url + "/metrics", headers=endpoint.headers())
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or "rollout_work_total" not in response.text:
        return None
    return response.text


# How long a server given by URL gets to answer the benchmark's first request.
REACHABLE_TIMEOUT = 10.0


async def check_reachable(client: httpx.AsyncClient, endpoint: Endpoint) -> None:
    """Raise `ServerUnreachable` unless something answers HTTP at the endpoint: before any
    phase runs, so that a wrong URL is one clear message rather than a run of failures."""
    url = endpoint.base_url.rstrip("/") + "/models"
    hint = "is the server running? --url takes its base URL, e.g. http://127.0.0.1:8000/v1"
    try:
        response = await client.get(url, headers=endpoint.headers(), timeout=REACHABLE_TIMEOUT)
    except httpx.TimeoutException:
        why = f"no answer within {REACHABLE_TIMEOUT:g} s"
    except httpx.ConnectError as exc:
        why = f"cannot connect ({exc or 'connection refused'})"
    except httpx.HTTPError as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    else:
        if response.status_code == 404 and not endpoint.base_url.rstrip("/").endswith("/v1"):
            raise ServerUnreachable(
                f"{endpoint.label}: {url} is 404; the base URL usually ends in /v1 "
                f"(try --url {endpoint.base_url.rstrip('/')}/v1)"
            )
        return
    raise ServerUnreachable(
        f"{endpoint.label}: nothing answers at {endpoint.base_url}: {why}; {hint}"
    )


async def _wait_healthy(url: str, process: trio.Process, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = (await trio.Path(log_path).read_text(errors="replace"))[-2000:]
                raise ServerStartError(
                    f"`rollout serve` exited with status {process.returncode} before answering "
                    f"{url}; its log ends:\n{tail}"
                )
            try:
                response = await client.get(url, timeout=2.0)
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await trio.sleep(0.1)
    raise ServerStartError(f"`rollout serve` did not answer {url} within {SERVER_START_TIMEOUT}s")


@asynccontextmanager
async def open_local_server(
    *, log_path: Path, label: str = "rollout", extra_args: tuple[str, ...] = ()
) -> AsyncIterator[Endpoint]:
    """Start `rollout serve` on a free loopback port with its own temporary data dir; yield
    its endpoint; stop it (SIGTERM, then SIGKILL after a grace period). What it logs (at
    level warning) is kept at `log_path` if it logged anything. It runs in a session of its
    own: a Ctrl-C at the terminal stops the benchmark, which stops its server."""
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as data_dir:
        kept_log = log_path
        log_path = Path(data_dir) / "serve.log"
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "rollout",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--data-dir",
            data_dir,
            "--log-level",
            "warning",
            *extra_args,
        ]
        with log_path.open("wb") as log:
            process = await trio.lowlevel.open_process(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                await _wait_healthy(f"http://127.0.0.1:{port}/healthz", process, log_path)
                yield Endpoint(
                    label=label,
                    base_url=f"http://127.0.0.1:{port}/v1",
                    pid=process.pid,
                    spawned=True,
                )
            finally:
                with trio.CancelScope(shield=True):
                    await stop_process(process)
                    _keep_log(log_path, kept_log)


def _keep_log(log_path: Path, kept: Path) -> None:
    """Copy the server's log out of its temporary directory, unless it is empty."""
    try:
        if log_path.stat().st_size:
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log_path, kept)
    except OSError:
        pass


async def stop_process(process: trio.Process, limit: float = SERVER_STOP_TIMEOUT) -> None:
    """Terminate a subprocess, kill it if it has not exited within `limit` seconds; shielded,
    so a cancelled run still cleans up."""
    with trio.CancelScope(shield=True):
        if process.poll() is not None:
            return
        process.terminate()
        with trio.move_on_after(limit):
            await process.wait()
        if process.poll() is None:
            process.kill()
            await process.wait()


async def preflight(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    body: dict[str, Any],
    *,
    limit: float,
    tool: str,
) -> None:
    """One create of the scenario's shape (`body`: its model and tools, the call forced where
    the model is not `sim`) before anything runs: raise `PreflightError`, one line naming the
    server and the fix, unless the server accepts the key and the model and calls `tool`."""
    url = endpoint.responses_url
    label = endpoint.label
    try:
        response = await client.post(
            url, json={**body, "store": False}, headers=endpoint.headers(), timeout=limit
        )
    except httpx.HTTPError as exc:
        raise PreflightError(
            f"{label}: the benchmark's first request to {url} failed: "
            f"{type(exc).__name__}{': ' + str(exc) if str(exc) else ''}"
        ) from None
    model = body.get("model")
    if response.status_code != 200:
        message, code, param = _error_of(response)
        said = f"HTTP {response.status_code}{' ' + code if code else ''}: {message}"
        if response.status_code in (401, 403):
            fix = "pass the server's key with --api-key"
        elif code == "model_not_found" or param == "model" or response.status_code == 404:
            fix = (
                f"the server does not serve the model {model!r}; name one it serves with "
                f"--model (GET {endpoint.base_url.rstrip('/')}/models lists them)"
            )
            if endpoint.spawned:
                fix += (
                    "; a local `rollout serve` serves the `sim` models and those of a models "
                    "file: --local LABEL='--models FILE'"
                )
        else:
            fix = "the benchmark cannot run against it"
        raise PreflightError(f"{label}: refused the benchmark's first request ({said}); {fix}")
    try:
        output = response.json().get("output") or []
    except ValueError:
        raise PreflightError(f"{label}: answered the first request with no JSON") from None
    if not any(isinstance(i, dict) and i.get("type") == "function_call" for i in output):
        raise PreflightError(
            f"{label}: the model {model!r} did not call the `{tool}` tool when told to "
            "(tool_choice names it); the benchmark's agent loop needs a model that calls tools"
        )


def _error_of(response: httpx.Response) -> tuple[str, str | None, str | None]:
    """The error's message, code and param (OpenAI's shape), or the body's start."""
    message, code, param = error_fields(response.content)
    if message is None:
        return response.text[:200].strip() or "(no body)", None, None
    return message[:200], code, param


def error_fields(body: bytes) -> tuple[str | None, str | None, str | None]:
    """An HTTP error body's message, code and param in OpenAI's shape (`{"error": {...}}`);
    (None, None, None) for any other body."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if not isinstance(error, dict):
        return None, None, None
    code, param = error.get("code"), error.get("param")
    return (
        str(error.get("message") or ""),
        code if isinstance(code, str) else None,
        param if isinstance(param, str) else None,
    )
