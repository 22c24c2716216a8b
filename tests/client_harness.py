"""Helpers of the client-compatibility tests: real agent CLIs (installed from their package
registry, pinned, into a shared cache) driving `rollout serve` as a real process, in front of a
scripted chat-completions upstream (`tests.upstream_harness`).

- `require(condition, reason)`: skip when a prerequisite (node, npm, git, the registry) is
  missing, unless `ROLLOUT_REQUIRE_ALL` is set (CI sets it): then the test fails instead, so a
  machine that cannot run a client never passes by skipping it.
- `npm_package(name, version)`: `npm install` once into `<cache>/npm/<name>-<version>` under a
  file lock (concurrent runs wait for each other; a marker file says the install finished).
- `open_rollout_process(...)`: `rollout serve --port 0` as a subprocess; its access log
  (stderr) is collected so a test can tell WebSocket from HTTP traffic.
- `run_client(...)`: a client process in its own session, killed with its whole process group
  when its deadline passes.

Every wait is bounded; nothing sleeps.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NoReturn

import attrs
import pytest
import trio

__all__ = [
    "REQUIRE_ALL_ENV",
    "ClientResult",
    "RolloutProcess",
    "cache_root",
    "client_env",
    "make_git_repo",
    "npm_package",
    "open_rollout_process",
    "require",
    "run_client",
    "unavailable",
]

# Set (to anything but "" or "0") by `.ci/run`: a missing prerequisite fails the test.
REQUIRE_ALL_ENV = "ROLLOUT_REQUIRE_ALL"
# Where installed clients are kept between runs (default `$XDG_CACHE_HOME/rollout-tests`, or
# `~/.cache/rollout-tests`).
CACHE_ENV = "ROLLOUT_TEST_CACHE"
# A cold `npm install` of the Codex CLI (two packages, 165 MB of tarballs) takes ~6 s here; a
# slow registry mirror gets fifty times that before the test gives up.
NPM_INSTALL_TIMEOUT = 300.0
# `rollout serve` prints "serving on ..." within a second; an overloaded CI box gets 30.
SERVER_START_TIMEOUT = 30.0
# After SIGTERM the server drains in-flight work (the graceful timeout is 2 s, passed below).
SERVER_GRACEFUL = 2.0
SERVER_STOP_TIMEOUT = 15.0
# Loopback traffic must never go through a proxy configured on the machine.
LOOPBACK = "127.0.0.1,localhost"


def unavailable(reason: str) -> NoReturn:
    """Skip the test, or fail it when `ROLLOUT_REQUIRE_ALL` is set."""
    if os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0"):
        pytest.fail(f"{reason} ({REQUIRE_ALL_ENV} is set, so this fails instead of skipping)")
    pytest.skip(reason)


def require(condition: object, reason: str) -> None:
    if not condition:
        unavailable(reason)


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "rollout-tests"


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


def npm_package(name: str, version: str, *, bin_name: str) -> Path:
    """The path of `bin_name` from the npm package `name@version`, installed on first use into
    the cache (one folder per pinned version). Concurrent callers serialize on a lock file; a
    `.installed` marker, written last, tells a finished install from an interrupted one."""
    npm = shutil.which("npm")
    require(npm and shutil.which("node"), f"node and npm are needed to install {name}@{version}")
    assert npm is not None
    folder = cache_root() / "npm" / f"{name.replace('/', '+').lstrip('@')}-{version}"
    marker = folder / ".installed"
    binary = folder / "node_modules" / ".bin" / bin_name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if marker.exists() and binary.exists():
            return binary
        shutil.rmtree(folder, ignore_errors=True)  # an interrupted install
        folder.mkdir()
        command = [
            npm,
            "install",
            "--no-audit",
            "--no-fund",
            "--no-save",
            "--prefix",
            str(folder),
            f"{name}@{version}",
        ]
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # npm's children die with it on a timeout
        )
        try:
            output, _ = process.communicate(timeout=NPM_INSTALL_TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            unavailable(f"`{' '.join(command)}` did not finish in {NPM_INSTALL_TIMEOUT:g} s")
        finally:
            if process.returncode is None:
                _kill_group(process)
        if process.returncode != 0 or not binary.exists():
            tail = output.decode(errors="replace")[-2000:]
            unavailable(f"`{' '.join(command)}` failed (exit {process.returncode}):\n{tail}")
        marker.write_text(f"{name}@{version}\n")
        return binary


def make_git_repo(path: Path) -> Path:
    """A throwaway git repository with one commit (agents look for the workspace's repo)."""
    git = shutil.which("git")
    require(git, "git is needed for the client's workspace")
    assert git is not None
    path.mkdir(parents=True, exist_ok=True)
    (path / "README.md").write_text("A scratch workspace for a client-compatibility test.\n")
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "rollout tests",
        "GIT_AUTHOR_EMAIL": "tests@rollout.invalid",
        "GIT_COMMITTER_NAME": "rollout tests",
        "GIT_COMMITTER_EMAIL": "tests@rollout.invalid",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
    }
    for args in (["init", "-q"], ["add", "README.md"], ["commit", "-q", "-m", "scratch"]):
        subprocess.run([git, *args], cwd=path, env=env, check=True, timeout=30)
    return path


def client_env(**extra: str) -> dict[str, str]:
    """The environment for a client or server process: ours, never a proxy for loopback."""
    env = dict(os.environ)
    for key in ("NO_PROXY", "no_proxy"):
        env[key] = ",".join(filter(None, [LOOPBACK, env.get(key, "")]))
    env.update(extra)
    return env


# --- rollout serve as a process -------------------------------------------------------------

# The server runs with `--log-format json`: each stderr line is one JSON record.
_SERVING = re.compile(r"serving on (http://[^\s\"]+)")


@attrs.define(eq=False)
class RolloutProcess:
    """A running `rollout serve`: its base URL and what its stderr said so far."""

    url: str = ""
    pid: int = 0
    killed: bool = False  # `kill()` was called: the exit is not checked
    terminated: bool = False  # `terminate()` was called: leaving the block only waits
    lines: list[str] = attrs.field(factory=list)
    exited: bool = False  # its stderr closed
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def access(self) -> list[dict[str, Any]]:
        """The access-log records so far (HTTP requests, WebSocket connections closed)."""
        records = []
        for line in self.lines:
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("logger") == "rollout.access":
                    records.append(record)
        return records

    def terminate(self) -> None:
        """SIGTERM the server (a graceful shutdown), now."""
        self.terminated = True
        os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        """`kill -9` the server (its whole process group), now."""
        self.killed = True
        _signal_group(self.pid, signal.SIGKILL)

    def peak_rss_bytes(self) -> int:
        """The process's peak resident set size so far (Linux `VmHWM`)."""
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc status")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    async def wait_for(self, predicate: Callable[[RolloutProcess], bool]) -> None:
        """Until `predicate(self)` holds, re-checked at every stderr line (the caller bounds
        the wait with its own deadline)."""
        while not predicate(self):
            await self._changed.wait()

    def _add(self, line: str) -> None:
        self.lines.append(line)
        if not self.url:
            match = _SERVING.search(line)
            if match:
                self.url = match[1]
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()


async def _drain(stream: trio.abc.ReceiveStream, server: RolloutProcess) -> None:
    buffer = b""
    async for data in stream:
        buffer += data
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            server._add(raw.decode(errors="replace"))
    if buffer:
        server._add(buffer.decode(errors="replace"))
    server.exited = True
    server._notify()


@asynccontextmanager
async def open_rollout_process(
    *,
    data_dir: Path,
    models: Path | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[RolloutProcess]:
    """`python -m rollout serve --port 0` (the `rollout serve` entry point); yields once it is
    serving. Leaving the block sends SIGTERM and waits for the exit (SIGKILL if it hangs)."""
    command = [
        sys.executable,
        "-m",
        "rollout",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--data-dir",
        str(data_dir),
        "--graceful-timeout",
        str(SERVER_GRACEFUL),
        "--log-level",
        "info",
        "--log-format",
        "json",
    ]
    if models is not None:
        command += ["--models", str(models)]
    command += list(extra_args)
    server = RolloutProcess()
    process = await trio.lowlevel.open_process(
        command,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else client_env(),
        start_new_session=True,
    )
    server.pid = process.pid
    try:
        async with trio.open_nursery() as nursery:
            assert process.stderr is not None
            nursery.start_soon(_drain, process.stderr, server)
            with trio.move_on_after(SERVER_START_TIMEOUT):
                await server.wait_for(lambda s: bool(s.url) or s.exited)
            if not server.url:
                raise AssertionError(
                    f"rollout serve did not start in {SERVER_START_TIMEOUT:g} s "
                    f"(exit {process.poll()}):\n{server.tail()}"
                )
            yield server
            if server.killed:
                with trio.fail_after(SERVER_STOP_TIMEOUT):
                    await process.wait()
                return
            if not server.terminated:
                process.send_signal(signal.SIGTERM)
            with trio.fail_after(SERVER_STOP_TIMEOUT):
                code = await process.wait()
            assert code == 0, f"rollout serve exited with {code}:\n{server.tail()}"
    finally:
        if process.returncode is None:
            with trio.CancelScope(shield=True):
                _signal_group(process.pid, signal.SIGKILL)
                await process.wait()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


# --- a client process -----------------------------------------------------------------------


@attrs.frozen
class ClientResult:
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-6000:]}"
        )


async def _collect(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
    async for data in stream:
        into += data


async def run_client(
    command: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    time_limit: float,
) -> ClientResult:
    """Run a client to completion with stdin closed. It runs in a session of its own, so when
    `time_limit` (seconds) passes, its whole process group (shells and sandbox helpers
    included) is killed and the test fails with what the client printed so far."""
    stdout, stderr = bytearray(), bytearray()
    process = await trio.lowlevel.open_process(
        list(command),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        with trio.move_on_after(time_limit) as scope:
            async with trio.open_nursery() as nursery:
                assert process.stdout is not None and process.stderr is not None
                nursery.start_soon(_collect, process.stdout, stdout)
                nursery.start_soon(_collect, process.stderr, stderr)
                await process.wait()
                # Whatever it left running in its group would hold the pipes open.
                _signal_group(process.pid, signal.SIGKILL)
    finally:
        if process.returncode is None:
            _signal_group(process.pid, signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await process.wait()
    assert process.returncode is not None  # waited for above
    result = ClientResult(
        returncode=process.returncode,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
    )
    if scope.cancelled_caught:
        raise AssertionError(
            f"{command[0]} did not finish in {time_limit:g} s:\n{result.describe()}"
        )
    return result
