"""Post-inference work: usage records into the ledger and responses into the store.

It runs in one background task fed by a bounded channel. A response's own job is *committed
before its terminal event goes out* (`commit`): the writer takes every job queued at that
moment and writes them together (group commit: one ledger call for all their usage records,
then the store writes), so once a client has seen `response.completed` (or `incomplete`, or
`failed`), the stored response and its usage are in the store and the ledger and survive a
crash of the process (SQLite in WAL mode with `synchronous=NORMAL`: a committed transaction is
in the WAL file, which the operating system keeps when the process dies; a power loss can
lose the last transactions, `synchronous=FULL` closes that too at an fsync per commit).
Concurrent responses share a commit, so the cost per response falls as load rises. It is never
lost:
- a response cut off by a disconnect or a cancellation cannot wait: its usage goes in with
  `submit_nowait`, which never blocks and never awaits (past the channel's bound, into an
  overflow list the writer drains first, bounded by the responses in flight); nothing on that
  path touches the ledger from the event loop;
- `aclose()` (graceful shutdown) drains the queue;
- if the engine's task is cancelled outright (its nursery torn down: no connection is served
  any more), the worker writes the usage records still queued with the ledger's blocking
  `record_sync` before it dies, and usage submitted after that is written the same way by
  its submitter (store writes still queued are lost in that case only; they are a cache of
  the conversation, usage is money);
- a ledger write that fails (the database is down) fails the commits waiting on it (those
  responses end `failed`, never acknowledged), and its records stay with the writer, which
  tries them again in a transaction of their own (never a group's: whatever is wrong with them
  fails no other response) after the next group's write goes through, or every
  `USAGE_RETRY_INTERVAL` while no group comes (rows are idempotent on `(response_id, step)`,
  so a write that landed unseen does no harm); at most `MAX_UNWRITTEN_USAGE` records wait so,
  past that the oldest are dropped, logged and counted (`usage_records_dropped`);
- reads see writes still queued (read-your-writes inside a process): `pending_get` answers for
  a response whose store write has not landed yet, so a store=true follow-up never misses; a
  write that failed is forgotten at once (its response failed: it is not found).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import attrs
import trio

from ._counters import Counters
from ._interfaces import ResponseStore, StoredResponse, UsageLedger, UsageRecord

__all__ = [
    "MAX_GROUP_COMMIT",
    "MAX_UNWRITTEN_USAGE",
    "POST_INFERENCE_QUEUE_LIMIT",
    "USAGE_RETRY_INTERVAL",
    "PostInference",
    "PostJob",
    "WriteFailed",
]

log = logging.getLogger("rollout.post")

# Jobs waiting for the background writer. When full, finishing a response waits for room
# (backpressure on the writer's slowest dependency instead of unbounded memory).
POST_INFERENCE_QUEUE_LIMIT = 1024
# Jobs written by one group commit at most (one ledger transaction for all their records).
MAX_GROUP_COMMIT = 256
# Usage records whose ledger write failed, kept for the next try (about 200 bytes each): a
# database outage of minutes under load. Past it the oldest are dropped, logged and counted.
MAX_UNWRITTEN_USAGE = 100_000
# Seconds between tries of those records while no new job comes to carry them.
USAGE_RETRY_INTERVAL = 1.0


class WriteFailed(Exception):
    """The store or the ledger failed to write a committed job (the response cannot be
    acknowledged as durable)."""


@attrs.define(eq=False)
class _Receipt:
    """Signalled once a job is written (or its write failed)."""

    written: trio.Event = attrs.field(factory=trio.Event)
    error: BaseException | None = None


@attrs.frozen(kw_only=True)
class PostJob:
    records: Sequence[UsageRecord] = ()
    stored: StoredResponse | None = None
    receipt: _Receipt | None = attrs.field(default=None, eq=False)  # a `commit` waits on it


class PostInference:
    def __init__(
        self,
        *,
        store: ResponseStore | None,
        ledger: UsageLedger | None,
        counters: Counters,
        limit: int = POST_INFERENCE_QUEUE_LIMIT,
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.counters = counters
        self._send, self._recv = trio.open_memory_channel[PostJob](limit)
        # Jobs from `submit_nowait` that found the channel full or closed; drained first.
        self._overflow: list[PostJob] = []
        self._torn_down = False  # the writer is gone: late usage is written by its submitter
        self._pending: dict[str, StoredResponse] = {}
        self._idle = trio.Event()
        self._idle.set()
        self._outstanding = 0  # submitted and not yet written
        # A failed ledger write's records, for the next try, by `(response_id, step)`: a
        # response whose commit failed and that tries again waits here once.
        self._unwritten: dict[tuple[str, int], UsageRecord] = {}

    @property
    def backlog(self) -> int:
        return self._outstanding

    @property
    def unwritten_usage(self) -> int:
        """Usage records waiting for the ledger to come back."""
        return len(self._unwritten)

    def pending_get(self, response_id: str) -> StoredResponse | None:
        return self._pending.get(response_id)

    def pending_items(self) -> list[StoredResponse]:
        return list(self._pending.values())

    def forget(self, response_id: str) -> bool:
        """Drop a queued store write (the response was deleted before it landed)."""
        return self._pending.pop(response_id, None) is not None

    async def submit(self, job: PostJob) -> None:
        """Queue a job (waits for room when the queue is full). If this is cancelled, the job
        was not queued and the caller still owns it."""
        if job.stored is not None and self.store is None:
            # Nothing will write it, so nothing would ever take it out of `_pending` either.
            job = attrs.evolve(job, stored=None)
        if job.stored is not None:
            self._pending[job.stored.response.id] = job.stored
        self._outstanding += 1
        if self._idle.is_set():
            self._idle = trio.Event()
        try:
            await self._send.send(job)
        except BaseException:
            if job.stored is not None:
                self._pending.pop(job.stored.response.id, None)
            self._done_one()
            raise

    async def commit(self, job: PostJob) -> None:
        """Queue a job and wait until it is written (commit-before-ack). Raises `WriteFailed`
        if the store or the ledger failed. Cancelled while waiting, the job is still written."""
        receipt = _Receipt()
        await self.submit(attrs.evolve(job, receipt=receipt))
        await receipt.written.wait()
        if receipt.error is not None:
            raise WriteFailed(f"post-inference write failed: {receipt.error!r}")

    def _done_one(self) -> None:
        self._outstanding -= 1
        if self._outstanding == 0:
            self._idle.set()

    def submit_nowait(self, job: PostJob) -> None:
        """Queue a job without waiting (the usage of a response cut off by a disconnect or a
        cancellation, whose task cannot await). Never blocks: past the channel's bound the job
        waits in the overflow list, which holds at most one job per response in flight."""
        if job.stored is not None:
            raise ValueError("submit_nowait takes usage only")
        if not job.records:
            return
        if self._torn_down:  # the engine's nursery is being torn down: nothing else runs
            self._write_now(job.records)
            return
        self._outstanding += 1
        if self._idle.is_set():
            self._idle = trio.Event()
        try:
            self._send.send_nowait(job)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self._overflow.append(job)  # the channel is full (the writer will wake) or closed

    async def flushed(self) -> None:
        """Wait until every job submitted so far has been written."""
        await self._idle.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                try:
                    job = await self._next_job()
                except trio.EndOfChannel:
                    break  # closed and drained: what still waits is written below
                if job is None:  # the retry interval passed with nothing new
                    await self._retry_usage(ledger_up=False)
                    continue
                batch, self._overflow = [*self._overflow, job], []
                while len(batch) < MAX_GROUP_COMMIT:
                    try:
                        batch.append(self._recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                error: BaseException | None = None
                try:
                    await self._process(batch)
                except Exception as exc:  # a failing store or ledger must not stop the writer
                    log.exception("a post-inference write failed")
                    error = exc
                finally:
                    for done in batch:
                        self._done_one()
                        if error is not None and done.stored is not None:
                            self._forget_stored(done.stored)  # its response failed
                        if done.receipt is not None:
                            done.receipt.error = error
                            done.receipt.written.set()
                if self._unwritten and error is None and any(done.records for done in batch):
                    await self._retry_usage(ledger_up=True)  # the ledger took this group's
        finally:
            # Cancelled (or closed): whatever usage is still queued is written now.
            self._torn_down = True
            leftover = [*self._unwritten.values()]
            self._unwritten = {}
            leftover += [record for job in self._overflow for record in job.records]
            for _ in self._overflow:
                self._done_one()
            self._overflow = []
            while True:
                try:
                    job = self._recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                leftover.extend(job.records)
                self._done_one()
            try:
                self._write_now(leftover)
            except Exception:  # the ledger is down as the engine stops: nothing else can
                log.exception("%d usage records could not be written at shutdown", len(leftover))

    async def _next_job(self) -> PostJob | None:
        """The next job, or None when records wait for a retry and `USAGE_RETRY_INTERVAL`
        passed with no job. `trio.EndOfChannel` once the channel is closed and drained."""
        with trio.move_on_after(USAGE_RETRY_INTERVAL if self._unwritten else math.inf):
            return await self._recv.receive()
        return None

    def _forget_stored(self, stored: StoredResponse) -> None:
        rid = stored.response.id
        if self._pending.get(rid) is stored:
            del self._pending[rid]

    async def _write_usage(self, records: Sequence[UsageRecord]) -> None:
        """One ledger transaction for a group's records. On failure they wait for a retry
        (bounded) and the error propagates to the group's commits."""
        assert self.ledger is not None
        try:
            await self.ledger.record(records)  # one transaction for the whole group
        except trio.Cancelled:  # the engine is torn down mid-write (idempotent rows)
            self._write_now(records)
            raise
        except Exception:
            self._keep(records)
            raise
        self.counters.ledger_records += len(records)

    def _keep(self, records: Sequence[UsageRecord]) -> None:
        for record in records:
            self._unwritten[record.response_id, record.step] = record
        overflow = len(self._unwritten) - MAX_UNWRITTEN_USAGE
        if overflow > 0:
            log.error("the ledger is down: %d usage records dropped (oldest)", overflow)
            self.counters.usage_records_dropped += overflow
            for key in list(self._unwritten)[:overflow]:
                del self._unwritten[key]

    async def _retry_usage(self, *, ledger_up: bool) -> None:
        """The waiting records, in a transaction of their own: never part of a group's, so
        whatever is wrong with them fails no response. Cancelled, they stay for teardown."""
        assert self.ledger is not None
        rows = list(self._unwritten.values())
        try:
            await self.ledger.record(rows)
        except Exception as exc:
            if ledger_up:  # a group's write just went through: these rows are refused
                log.error("the ledger refused %d waiting usage records: %r", len(rows), exc)
            else:
                log.warning("the ledger is still down (%d usage records wait): %r", len(rows), exc)
            return
        self._unwritten = {}
        self.counters.ledger_records += len(rows)

    def _write_now(self, records: Sequence[UsageRecord]) -> None:
        """Blocking write, only once the writer is cancelled with its engine (teardown)."""
        if records and self.ledger is not None:
            self.ledger.record_sync(records)
            self.counters.ledger_records += len(records)

    async def _process(self, batch: Sequence[PostJob]) -> None:
        records = [record for job in batch for record in job.records]
        if records and self.ledger is not None:
            await self._write_usage(records)
        wrote = False
        for job in batch:
            stored = job.stored
            if stored is not None and self.store is not None:
                rid = stored.response.id
                if self._pending.get(rid) is stored:
                    await self.store.put(stored)
                    self.counters.store_writes += 1
                    wrote = True
                    self._forget_stored(stored)
        if records or wrote:
            self.counters.post_inference_runs += 1

    async def aclose(self) -> None:
        """Stop accepting jobs; the worker drains what is queued and exits."""
        await self._send.aclose()
