"""`rollout serve` as a subprocess that a whole test session can share, and restart.

`ServerProcess` is synchronous (pytest's session-scoped fixtures run outside trio): it starts
`python -m rollout serve --port 0` (or `python -m tests.faulty_serve FAULT serve ...`, the same
entry point with one deliberate bug patched in), reads its stderr on a thread until the
"serving on" line gives the URL, and stops it with SIGTERM (a graceful shutdown, which must
exit 0) or SIGKILL. `restart` stops it and starts a new process on the same data folder and
a new port: what the old one acknowledged must be there. Every wait has a deadline; the
process runs in its own session and its group is killed on any failure.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import trio

from tests.client_harness import client_env

__all__ = ["ServerProcess"]

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 60.0  # an overloaded 2-core box imports the server in seconds, not a minute
STOP_TIMEOUT = 20.0
GRACEFUL = 2.0
_SERVING = re.compile(r"serving on (http://\S+)")


class ServerProcess:
    """One `rollout serve` process at a time; `url` is its base URL (`.../v1`)."""

    def __init__(
        self, data_dir: Path, *, api_keys: Sequence[str] = (), fault: str | None = None
    ) -> None:
        self.data_dir = data_dir
        self.api_keys = tuple(api_keys)
        self.fault = fault
        self.url = ""
        self.starts = 0
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self._process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        entry = (
            ["-m", "rollout"] if self.fault is None else ["-m", "tests.faulty_serve", self.fault]
        )
        command = [sys.executable, *entry, "serve", "--host", "127.0.0.1"]
        command += ["--port", "0", "--data-dir", str(self.data_dir)]
        command += ["--graceful-timeout", str(GRACEFUL), "--log-level", "info"]
        for key in self.api_keys:
            command += ["--api-key", key]
        return command

    def start(self) -> None:
        assert self._process is None
        serving = threading.Event()
        self.url = ""
        self._process = subprocess.Popen(
            self.command(),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=client_env(),
            start_new_session=True,
        )
        # (Each process has its own reader and event: the last lines of a stopped one must not
        # wake the wait for the next.)
        reader = threading.Thread(target=self._read, args=(self._process, serving), daemon=True)
        reader.start()
        if not serving.wait(START_TIMEOUT) or not self.url:
            self._kill()
            raise AssertionError(
                f"{' '.join(self.command())} did not start in {START_TIMEOUT:g} s:\n{self.tail()}"
            )
        self.starts += 1

    def _read(self, process: subprocess.Popen[bytes], serving: threading.Event) -> None:
        assert process.stderr is not None
        for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            match = _SERVING.search(line)
            if match and not serving.is_set():
                self.url = match[1].removesuffix("/v1") + "/v1"
                serving.set()
        serving.set()  # exited: stop waiting

    def stop(self, *, kill: bool = False) -> None:
        """SIGKILL, or SIGTERM and a clean exit (0) within the deadline."""
        process = self._process
        if process is None:
            return
        if kill:
            self._kill()
            return
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._kill()
            raise AssertionError(f"rollout serve did not stop on SIGTERM:\n{self.tail()}") from None
        self._process = None
        assert code == 0, f"rollout serve exited with {code}:\n{self.tail()}"

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=STOP_TIMEOUT)

    def restart_sync(self, *, kill: bool) -> None:
        self.stop(kill=kill)
        self.start()

    async def restart(self, *, kill: bool) -> None:
        """Stop (SIGKILL, or SIGTERM) and start a new process on the same data."""
        await trio.to_thread.run_sync(lambda: self.restart_sync(kill=kill))

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop(kill=exc[0] is not None)
        finally:
            self._kill()
