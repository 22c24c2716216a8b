"""Usage is never lost: the engine's ledger (SQLite and PostgreSQL) after kills, read back from
the file or the database on a connection of its own.

A rollout with several tool steps runs under a paced sim model with the `async with
open_engine(...)` block inside a cancel scope, and the scope is cancelled (the engine's nursery
killed) at chosen points: while suspended after 1, 2 or 3 completed steps, at the first token
of a step, and at a sweep of instants over the whole rollout. The ledger file, reopened with a
fresh `sqlite3` connection, then holds every completed sampling step exactly once (one row per
`(response_id, step)`, complete, with the token counts of an uninterrupted run), and at most
one interrupted step (complete=0, the next step, no more output than it would have had).

Chain mode: the responses completed before a kill are all in the ledger (post-inference jobs
still queued are written synchronously as the worker dies); leaving `open_engine` normally
flushes everything.

Both ledgers run in worker threads. Under the autojump clock a test blocked on a thread looks
idle, and the clock would jump to the test's own deadline; so the ledger is opened and closed
with a real-time grace (`threads_may_run`), and the paced runs touch the database only through
the ledger's blocking `record_sync` (the engine's teardown path), never through a thread.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeAlias

import attrs
import pytest
import trio
import trio.testing
from rollout import protocol as p
from rollout.engine import (
    Engine,
    MemoryUsageLedger,
    ResponseState,
    Rollout,
    Session,
    UsageLedger,
    UsageRecord,
    open_engine,
    open_sqlite_ledger,
)
from rollout.engine._pg_ledger import open_postgres_ledger

from tests.pg_harness import read_usage_rows

DEADLINE = 60  # trio seconds (virtual under the autojump clock)
# Real seconds the autojump clock waits for a worker thread before it jumps.
THREAD_GRACE = 1.0

TOOLS: list[p.Tool] = [
    p.FunctionTool(
        name="grep",
        parameters={
            "type": "object",
            "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
            "required": ["pattern", "path"],
            "additionalProperties": False,
        },
    ),
    p.FunctionTool(
        name="edit",
        parameters={
            "type": "object",
            "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
            "required": ["path", "line"],
        },
    ),
]
# Four tool steps of two calls, then a text answer: five sampling steps, about 1.8 s.
MODEL = "sim:steps=8,parallel=2,tokens=30,tps=100,ttft_ms=150"
STEPS = 5
UNPACED = "sim:steps=8,parallel=2,tokens=30"


def rollout_request(model: str = MODEL) -> p.ResponseCreate:
    return p.ResponseCreate(
        model=model, tools=TOOLS, input="rename the helper", rollout=True, store=False
    )


@contextmanager
def threads_may_run(clock: trio.testing.MockClock) -> Iterator[None]:
    old = clock.autojump_threshold
    clock.autojump_threshold = THREAD_GRACE
    try:
        yield
    finally:
        clock.autojump_threshold = old


Rows: TypeAlias = list[tuple[str, int, int, int, int, int]]


def read_rows(path: Path) -> Rows:
    """(response_id, step, complete, input, cached, output) from a fresh connection."""
    conn = sqlite3.connect(path)
    try:
        return list(
            conn.execute(
                "SELECT response_id, step, complete, input_tokens, cached_tokens, output_tokens"
                " FROM usage ORDER BY response_id, step"
            )
        )
    finally:
        conn.close()


@attrs.frozen
class Target:
    """Where a test's ledgers live: `open(name)` opens ledger `name` (a new one per name) and
    `rows(name)` reads it back on a connection of its own."""

    open: Callable[[str], Awaitable[UsageLedger]]
    rows: Callable[[str], Rows]


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "sqlite":
        return Target(
            open=lambda name: open_sqlite_ledger(tmp_path / f"{name}.db"),
            rows=lambda name: read_rows(tmp_path / f"{name}.db"),
        )
    make_url: Callable[[], str] = request.getfixturevalue("postgres_urls")
    urls: dict[str, str] = {}

    def url(name: str) -> str:
        if name not in urls:
            urls[name] = make_url()
        return urls[name]

    return Target(
        open=lambda name: open_postgres_ledger(url(name)),
        rows=lambda name: read_usage_rows(url(name)),
    )


@attrs.frozen
class Step:
    step: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int


@attrs.define
class Driver:
    """Runs the rollout, answering tool calls with outputs that depend only on their order
    (so every run sees the same contexts and the sim model samples the same tokens)."""

    kill: Callable[[p.ServerEvent, Driver], bool] = lambda event, driver: False
    scope: trio.CancelScope | None = None  # what `kill` cancels
    model: str = MODEL
    suspensions: int = 0
    calls_answered: int = 0
    response_id: str | None = None

    async def run(self, engine: Engine) -> None:
        async with engine.session().open_rollout(rollout_request(self.model)) as rollout:
            await self.drive(rollout)

    async def drive(self, rollout: Rollout) -> None:
        while not rollout.ended:
            if rollout.suspended:
                outputs: list[p.Item] = []
                for call_id, name in rollout.pending_calls:
                    outputs.append(
                        p.FunctionCallOutput(
                            call_id=call_id, output=f"{name}#{self.calls_answered}"
                        )
                    )
                    self.calls_answered += 1
                rollout.append(outputs)
            async for event in rollout:
                self.response_id = rollout.response_id
                if event.type == "response.done":
                    self.suspensions += 1
                if self.kill(event, self) and self.scope is not None:
                    self.scope.cancel()


async def reference_steps() -> tuple[list[Step], float]:
    """An uninterrupted run: its steps as billed, and how long it takes."""
    ledger = MemoryUsageLedger()
    async with open_engine(ledger=ledger) as engine:
        start = trio.current_time()
        await Driver().run(engine)
        duration = trio.current_time() - start
        await engine.post.flushed()
    rows = await ledger.rows()
    assert [r.step for r in rows] == list(range(STEPS)) and all(r.complete for r in rows)
    return [Step(r.step, r.input_tokens, r.cached_tokens, r.output_tokens) for r in rows], duration


async def killed_run(
    target: Target,
    name: str,
    clock: trio.testing.MockClock,
    *,
    kill: Callable[[p.ServerEvent, Driver], bool] = lambda event, driver: False,
    after: float | None = None,
) -> tuple[Driver, list[tuple[str, int, int, int, int, int]]]:
    """Run the rollout inside a cancel scope that holds the whole engine, kill it (on an event
    or after `after` seconds), and read the ledger file back."""
    with threads_may_run(clock):
        ledger = await target.open(name)
    try:
        with trio.CancelScope() as scope:
            driver = Driver(kill=kill, scope=scope)
            if after is not None:
                scope.deadline = trio.current_time() + after
            async with open_engine(ledger=ledger) as engine:
                await driver.run(engine)
        assert scope.cancelled_caught, "the kill came after the rollout ended"
    finally:
        with threads_may_run(clock):
            await ledger.aclose()
    return driver, target.rows(name)


def check_rows(
    rows: Rows,
    reference: list[Step],
    *,
    response_id: str | None,
) -> tuple[int, bool]:
    """The invariants of any kill; returns (complete steps, whether one step was cut)."""
    assert {r[0] for r in rows} <= {response_id}
    steps = [r[1] for r in rows]
    assert steps == sorted(set(steps))  # one row per step
    complete = [r for r in rows if r[2] == 1]
    cut = [r for r in rows if r[2] == 0]
    assert [r[1] for r in complete] == list(range(len(complete)))
    for _rid, step, _c, input_tokens, cached, output in complete:
        assert Step(step, input_tokens, cached, output) == reference[step]
    assert len(cut) <= 1
    if cut:
        (_rid, step, _c, input_tokens, cached, output) = cut[0]
        assert step == len(complete)
        assert (input_tokens, cached) == (
            reference[step].input_tokens,
            reference[step].cached_tokens,
        )
        assert 0 <= output <= reference[step].output_tokens
    return len(complete), bool(cut)


def kill_when_suspended(n: int) -> Callable[[p.ServerEvent, Driver], bool]:
    def kill(event: p.ServerEvent, driver: Driver) -> bool:
        return event.type == "response.done" and driver.suspensions == n

    return kill


def kill_at_first_token(n: int) -> Callable[[p.ServerEvent, Driver], bool]:
    """At the first token of the step after `n` completed ones."""

    def kill(event: p.ServerEvent, driver: Driver) -> bool:
        return driver.suspensions == n and event.type in (
            "response.function_call_arguments.delta",
            "response.output_text.delta",
        )

    return kill


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_kill_while_suspended_keeps_every_completed_step(
    target: Target, autojump_clock: trio.testing.MockClock, n: int
) -> None:
    with trio.fail_after(DEADLINE):
        reference, _ = await reference_steps()
        driver, rows = await killed_run(
            target, "usage", autojump_clock, kill=kill_when_suspended(n)
        )
    assert check_rows(rows, reference, response_id=driver.response_id) == (n, False)


@pytest.mark.parametrize("n", [0, 1, 2, 4])
async def test_kill_mid_sampling_records_the_cut_step_once_as_incomplete(
    target: Target, autojump_clock: trio.testing.MockClock, n: int
) -> None:
    with trio.fail_after(DEADLINE):
        reference, _ = await reference_steps()
        driver, rows = await killed_run(
            target, "usage", autojump_clock, kill=kill_at_first_token(n)
        )
    assert check_rows(rows, reference, response_id=driver.response_id) == (n, True)
    (cut,) = [r for r in rows if r[2] == 0]
    assert cut[5] >= 1  # the token the client saw is billed


async def test_kills_at_any_instant_keep_the_invariants(
    target: Target, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(DEADLINE):
        reference, duration = await reference_steps()
        seen: list[tuple[int, bool]] = []
        instants = [duration * k / 24 for k in range(1, 24)]
        for i, after in enumerate(instants):
            driver, rows = await killed_run(target, f"usage-{i}", autojump_clock, after=after)
            complete, cut = check_rows(rows, reference, response_id=driver.response_id)
            assert complete >= driver.suspensions
            seen.append((complete, cut))
    # Later kills never lose steps; the sweep hits every step, and hits some mid-sampling.
    assert [c for c, _ in seen] == sorted(c for c, _ in seen)
    assert {c for c, _ in seen} == set(range(STEPS))
    assert any(cut for _, cut in seen)


# --- chain mode ----------------------------------------------------------------------------

CHAIN_MODEL = "sim:steps=2,parallel=2,tokens=12"


async def chain_turn(session: Session, prev: ResponseState | None, k: int) -> ResponseState:
    items: list[p.Item] = []
    if prev is not None:
        items = [
            p.FunctionCallOutput(call_id=call_id, output=f"{name}#{k}")
            for call_id, name in prev.open_calls
        ]
    items.append(p.Message(role="user", content=f"turn {k}"))
    state = await session.create(
        p.ResponseCreate(
            model=CHAIN_MODEL,
            tools=TOOLS,
            input=items,
            previous_response_id=prev.id if prev is not None else None,
            store=False,
        )
    )
    assert state is not None and state.response.status == "completed"
    return state


async def test_chain_responses_completed_before_a_kill_are_all_recorded(
    target: Target,
) -> None:
    """Commit before acknowledgement: when a response's terminal event has gone out, its usage
    row is already in the ledger file (read from another connection while the engine runs),
    so a kill right after loses nothing and leaves nothing queued."""
    completed: list[str] = []
    with trio.fail_after(DEADLINE):
        ledger = await target.open("usage")
        try:
            with trio.CancelScope() as scope:
                async with open_engine(ledger=ledger) as engine:
                    session = engine.session()
                    prev = None
                    for k in range(12):
                        prev = await chain_turn(session, prev, k)
                        completed.append(prev.id)
                        assert engine.post.backlog == 0
                        assert prev.id in {r[0] for r in target.rows("usage")}
                    # The kill, right after the last acknowledgement.
                    scope.cancel()
                    await trio.sleep_forever()
            assert scope.cancelled_caught
        finally:
            await ledger.aclose()
    rows = target.rows("usage")
    assert sorted(r[0] for r in rows) == sorted(completed)
    assert all(r[1] == 0 and r[2] == 1 for r in rows)


async def test_graceful_close_flushes_everything(target: Target) -> None:
    with trio.fail_after(DEADLINE):
        ledger: UsageLedger = await target.open("usage")
        try:
            async with open_engine(ledger=ledger) as engine:
                session = engine.session()
                prev = None
                ids = []
                for k in range(12):
                    prev = await chain_turn(session, prev, k)
                    ids.append(prev.id)
                rollout_driver = Driver(model=UNPACED)  # the real clock runs here
                await rollout_driver.run(engine)
                # No flushed(): leaving the block must drain the queue.
        finally:
            await ledger.aclose()
    rows = target.rows("usage")
    assert rollout_driver.response_id is not None
    assert sorted({r[0] for r in rows}) == sorted([*ids, rollout_driver.response_id])
    assert all(r[2] == 1 for r in rows)
    assert [r[1] for r in rows if r[0] == rollout_driver.response_id] == list(range(STEPS))
    assert len(rows) == len(ids) + STEPS


async def test_an_interrupted_row_is_superseded_by_the_complete_one(target: Target) -> None:
    """The idempotency rule the engine relies on, read back from the file or database."""
    record = UsageRecord(
        response_id="resp_x",
        step=0,
        owner=None,
        model=MODEL,
        input_tokens=10,
        cached_tokens=0,
        output_tokens=3,
        complete=False,
        created_at=1.0,
    )
    with trio.fail_after(DEADLINE):
        ledger = await target.open("usage")
        try:
            ledger.record_sync([record])
            await ledger.record([attrs.evolve(record, complete=True, output_tokens=7)])
            ledger.record_sync([record])  # a late interrupted retry changes nothing
        finally:
            await ledger.aclose()
    assert target.rows("usage") == [("resp_x", 0, 1, 10, 0, 7)]
