"""`rollout serve --workers N`: N worker processes serving one port.

Long because supervising processes is its own craft: restarts, signals to a process group, the
shared listening socket and storage prepared once.

The parent starts N workers with multiprocessing's `spawn` method (a fresh interpreter each,
as hypercorn's own multi-worker mode does); each worker is a whole `serve()` (its own engine,
caches, store and ledger connections) listening on the port through a socket of its own with
`SO_REUSEPORT`, handed to hypercorn as an `fd://` bind. The kernel spreads new connections
over the workers' sockets by a hash of their addresses, and a WebSocket stays in the worker
that accepted it for its life, with its connection cache. The parent binds the port first,
without listening (so it takes no connection): a port in use fails there, with the one-line
error of one process, `--port 0` picks the port every worker then joins, and the port stays
held while workers restart.

`SO_REUSEPORT` rather than one listening socket shared by every worker: with one shared
socket, connections that arrive together (a benchmark's, or a fleet of agents reconnecting)
all went to whichever worker woke first (16 of 16 in a loaded test run); the kernel's hash
spreads them evenly, which is what lets N workers use N cores. The cost: a worker that dies
loses the connections waiting in its own accept queue (they are reset, and clients
reconnect), and processes of the same user may join the port's group.

State the workers share is only what is durable: stored responses and the usage ledger, in
the store (SQLite in WAL mode, each worker with its own connections and a busy timeout; or
PostgreSQL with `store_url`, each worker with its own pools). The parent opens the store and
ledger once before any worker starts, so the files, their WAL mode, the tables, their
migrations and the compaction key are made by one process, never raced. A `store: true`
response is visible to every worker once its create has completed, so continuation,
retrieval and deletion work from any worker.

Shutdown: SIGINT or SIGTERM to the parent asks every worker to stop over its control pipe;
each drains as one process does (`graceful_timeout`, then the responses still running end,
the ledger is flushed) and exits; the parent kills a worker still alive
`WORKER_STOP_MARGIN` after that and exits 0 once all stopped cleanly. Workers ignore SIGINT
(a terminal's Ctrl-C reaches the whole process group; the parent coordinates); a SIGTERM sent
to one worker stops it gracefully, and so do more (a service manager may signal the whole
group), so unlike one process a second signal does not cut the drain short. A parent that
dies without a word (SIGKILL) closes the control pipes: its workers then stop gracefully
too.

A worker that exits while the server runs is reported (its number, pid and exit status) and
restarted after `WORKER_RESTART_DELAY`; the others go on serving meanwhile. A worker that
exits before it started serving (a store that cannot open, a bad model file) stops the whole
server with status 1: a restart would fail the same way.

/metrics aggregates across the workers (see `_metrics.py`): the parent makes the directory
the workers share their counts through, and removes a dead worker's gauges from it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import attrs
import trio

from ._logging import LogFormat, configure_logging
from ._metrics import forget_worker
from ._serve import KEYS_REQUIRED, ServerConfig, _open_durable, bind_error, serve

__all__ = [
    "DEFAULT_WORKERS",
    "WORKER_RESTART_DELAY",
    "WORKER_STOP_MARGIN",
    "reuseport_socket",
    "run_workers",
]

log = logging.getLogger("rollout.server")

DEFAULT_WORKERS = 1
# A worker that died is restarted after this long (seconds): long enough that a worker dying
# at once on every start does not spin a core, short enough to be back before clients' retries
# give up.
WORKER_RESTART_DELAY = 1.0
# Past the graceful timeout (and the server's own margin for the last events), the time a
# worker gets to close its store and exit before it is killed.
WORKER_STOP_MARGIN = 5.0

_STOP = "stop"  # parent -> worker, on the control pipe
_READY = "ready"  # worker -> parent: (_READY, pid, base URL)


@attrs.frozen(kw_only=True)
class _WorkerSpec:
    """What a worker gets (pickled for the spawned interpreter): the config without the model
    registry, which each worker loads again from the file."""

    config: ServerConfig
    address: tuple[str, int]  # (host, port) every worker binds with SO_REUSEPORT
    models: Path | None
    log_level: str
    log_format: LogFormat
    metrics_dir: Path


def run_workers(
    config: ServerConfig,
    *,
    workers: int,
    models: Path | None = None,
    log_level: str = "info",
    log_format: LogFormat = "text",
) -> int:
    """Serve `config` with `workers` processes until SIGINT/SIGTERM; the exit status (0 when
    every worker stopped cleanly). `config` must be picklable (no registry, classifier, hosted
    tools or app wrapper objects: `models` names the registry's file) and name a store that
    processes can share (a data dir or a store URL). A port that cannot be bound or a data
    folder that cannot be used raises `StartupError`, a PostgreSQL store that cannot be opened
    `StoreError`, before any worker starts."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    if config.data_dir is None and config.store_url is None:
        raise ValueError("workers share the store: a data dir or a store URL is needed")
    supervisor = _Supervisor(
        config, workers=workers, models=models, log_level=log_level, log_format=log_format
    )
    return trio.run(supervisor.run)


class _Supervisor:
    def __init__(
        self,
        config: ServerConfig,
        *,
        workers: int,
        models: Path | None,
        log_level: str,
        log_format: LogFormat,
    ) -> None:
        self._config = config
        self._workers = workers
        self._models = models
        self._log_level = log_level
        self._log_format = log_format
        self._stopping = trio.Event()
        self._status = 0
        self._ready: set[int] = set()
        self._announced = False

    async def run(self) -> int:
        config = self._config
        # The port held (bound, not listening) before the store opens, as one process does.
        host = config.host.strip("[]")
        try:
            holder = reuseport_socket(host, config.port)
        except (OverflowError, OSError) as exc:
            raise bind_error(f"{config.host}:{config.port}", exc) from None
        address: tuple[str, int] = holder.getsockname()[:2]
        self._url = f"http://{_address(holder)}/v1"
        metrics_dir = Path(tempfile.mkdtemp(prefix="rollout-metrics-"))
        try:
            await _prepare_storage(config)
            spec = _WorkerSpec(
                config=attrs.evolve(config, registry=None),
                address=address,
                models=self._models,
                log_level=self._log_level,
                log_format=self._log_format,
                metrics_dir=metrics_dir,
            )
            async with trio.open_nursery() as signals:
                await signals.start(self._signals)
                async with trio.open_nursery() as slots:
                    for index in range(1, self._workers + 1):
                        slots.start_soon(self._slot, spec, index)
                signals.cancel_scope.cancel()
            return self._status
        finally:
            holder.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def _stop(self, status: int = 0) -> None:
        self._status = self._status or status
        self._stopping.set()

    async def _signals(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Installed before the first worker starts and kept until the last has stopped, so a
        # second signal never kills the parent while its workers drain.
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
            task_status.started()
            grace = self._config.graceful_timeout
            async for signum in received:
                name = signal.Signals(signum).name
                if not self._stopping.is_set():
                    log.info(
                        "received %s: stopping %d workers, each waiting up to %g s "
                        "(--graceful-timeout) for its responses in flight",
                        name,
                        self._workers,
                        grace,
                    )
                else:
                    log.info(
                        "received %s again: already stopping (the workers end what still "
                        "runs %g s after the first signal)",
                        name,
                        grace,
                    )
                self._stop()

    async def _slot(self, spec: _WorkerSpec, index: int) -> None:
        """Worker `index`: started, restarted when it dies, until the server stops."""
        while not self._stopping.is_set():
            worker = _Worker.start(spec, index)
            ready, code = await self._supervise(worker)
            status = _exit_status(code)
            forget_worker(spec.metrics_dir, worker.pid)
            if self._stopping.is_set():
                if code == 0:
                    log.info("worker %d (pid %d) stopped", index, worker.pid)
                else:
                    log.error("worker %d (pid %d) %s while stopping", index, worker.pid, status)
                    self._status = self._status or 1
                return
            self._ready.discard(index)
            if not ready:
                log.error(
                    "worker %d (pid %d) %s before it served: stopping the server",
                    index,
                    worker.pid,
                    status,
                )
                self._stop(1)
                return
            log.error(
                "worker %d (pid %d) %s; restarting it in %g s",
                index,
                worker.pid,
                status,
                WORKER_RESTART_DELAY,
            )
            with trio.move_on_after(WORKER_RESTART_DELAY):
                await self._stopping.wait()

    async def _supervise(self, worker: _Worker) -> tuple[bool, int | None]:
        """Until the worker exits: note when it is ready, ask it to stop when the server
        stops (killing it if it outstays its grace). Whether it ever was ready, and its exit
        code."""
        ready = False

        async def await_ready() -> None:
            nonlocal ready
            message = await worker.receive()
            if message is not None and message[0] == _READY:
                ready = True
                self._ready.add(worker.index)
                log.info("worker %d (pid %d) ready", worker.index, worker.pid)
                if len(self._ready) == self._workers and not self._announced:
                    self._announced = True
                    log.info(
                        "rollout serving on %s with %d workers (WebSocket %s%s)",
                        self._url,
                        self._workers,
                        "on" if self._config.websocket else "off",
                        KEYS_REQUIRED if self._config.api_keys else "",
                    )

        async def stop_on_request() -> None:
            await self._stopping.wait()
            worker.send_stop()
            await trio.sleep(self._config.graceful_timeout + WORKER_STOP_MARGIN + 1.0)
            log.error(
                "worker %d (pid %d) did not stop in time: killing it", worker.index, worker.pid
            )
            worker.process.kill()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(await_ready)
                nursery.start_soon(stop_on_request)
                await trio.lowlevel.wait_readable(worker.process.sentinel)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                if not _exited(worker.process):
                    worker.process.kill()
                    await trio.to_thread.run_sync(worker.process.join)
                code = worker.process.exitcode
                worker.close()
        return ready, code


@attrs.define(eq=False)
class _Worker:
    index: int
    process: BaseProcess
    pid: int
    control: Connection  # the parent's end of the control pipe

    @classmethod
    def start(cls, spec: _WorkerSpec, index: int) -> _Worker:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(
            target=_worker_main,
            args=(spec, index, theirs),
            name=f"rollout-worker-{index}",
            daemon=False,
        )
        process.start()
        theirs.close()
        return cls(index=index, process=process, pid=process.pid or 0, control=ours)

    async def receive(self) -> tuple[object, ...] | None:
        """The worker's next message, or None once its end is closed (it exited)."""
        await trio.lowlevel.wait_readable(self.control.fileno())
        try:
            message = self.control.recv()
        except (EOFError, OSError):
            return None
        return message if isinstance(message, tuple) else None

    def send_stop(self) -> None:
        try:
            self.control.send((_STOP,))
        except OSError:
            pass  # it has exited already

    def close(self) -> None:
        self.control.close()
        self.process.close()


def _exited(process: BaseProcess) -> bool:
    process.join(timeout=0)
    return process.exitcode is not None


def _exit_status(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with `SO_REUSEPORT` (and `SO_REUSEADDR`, as
    hypercorn binds), not listening yet."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _prepare_storage(config: ServerConfig) -> None:
    """Create (or migrate) the store, the ledger and the compaction key once, as one process
    opens them, before the workers open them."""
    store, ledger, _ = await _open_durable(config)
    await ledger.aclose()
    await store.aclose()


# --- in the worker process --------------------------------------------------------------------


def _worker_main(spec: _WorkerSpec, index: int, control: Connection) -> None:
    """A worker process's entry point (spawned: a fresh interpreter)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(spec.log_level, spec.log_format)
    listener = reuseport_socket(*spec.address)  # hypercorn listens on it
    registry = None
    if spec.models is not None:
        from ._config import load_registry

        registry = load_registry(spec.models, kv_cache_mb=spec.config.kv_cache_mb)
    config = attrs.evolve(
        spec.config,
        registry=registry,
        listen_fd=listener.detach(),  # hypercorn's socket owns the descriptor from here
        metrics_dir=spec.metrics_dir,
    )
    trio.run(_serve_worker, config, index, control)


async def _serve_worker(config: ServerConfig, index: int, control: Connection) -> None:
    """Serve until the parent asks (or its end of the control pipe closes) or SIGTERM comes.
    SIGTERM stays handled for the worker's whole life: a service manager may signal every
    process of the group, and a second SIGTERM must not kill a draining worker."""
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM) as signals:

        async def on_signal() -> None:
            async for _ in signals:
                log.info(
                    "worker %d received SIGTERM, %s",
                    index,
                    "draining" if stop.is_set() else "stopping",
                )
                stop.set()

        async def on_parent() -> None:
            await trio.lowlevel.wait_readable(control.fileno())
            stop.set()

        async with trio.open_nursery() as watchers:
            watchers.start_soon(on_signal)
            watchers.start_soon(on_parent)
            async with trio.open_nursery() as server:
                url = await server.start(
                    lambda task_status: serve(
                        config, shutdown_trigger=stop.wait, task_status=task_status
                    )
                )
                try:
                    control.send((_READY, os.getpid(), url))
                except OSError:
                    stop.set()  # the parent is gone
            watchers.cancel_scope.cancel()
