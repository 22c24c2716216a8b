"""The post-inference writer when the ledger goes down: the usage of responses that failed for
it waits with the writer and lands once the ledger is back, exactly once, on the writer's own
retry timer (no new response needed to carry it); what waits is bounded; shutdown with the
ledger still down logs what it could not write instead of crashing. Trio's autojump clock runs
the retry interval; the ledger is the in-memory one, failing on command."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import trio
import trio.testing
from rollout import protocol as p
from rollout.engine import MemoryUsageLedger, Session, UsageRecord, _postinfer, open_engine
from rollout.engine._postinfer import USAGE_RETRY_INTERVAL, PostJob, WriteFailed

DEADLINE = 60  # trio seconds (virtual under the autojump clock)
MODEL = "sim"


class SwitchedLedger(MemoryUsageLedger):
    """A ledger whose database is down while `down` is set (async and blocking writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.failed_writes = 0

    async def record(self, records: Sequence[UsageRecord]) -> None:
        if self.down:
            self.failed_writes += 1
            raise OSError("the database is down")
        await super().record(records)

    def record_sync(self, records: Sequence[UsageRecord]) -> None:
        if self.down:
            raise OSError("the database is down")
        super().record_sync(records)


def record(response_id: str, step: int = 0) -> UsageRecord:
    return UsageRecord(
        response_id=response_id,
        step=step,
        owner=None,
        model=MODEL,
        input_tokens=10,
        cached_tokens=0,
        output_tokens=5,
        complete=False,
        created_at=0.0,
    )


async def failed_response(session: Session, text: str) -> str:
    events: list[p.ServerEvent] = []

    async def emit(event: p.ServerEvent) -> None:
        events.append(event)

    state = await session.create(p.ResponseCreate(model=MODEL, input=text, store=False), emit)
    assert state is None
    final = events[-1]
    assert isinstance(final, p.ResponseFailed) and final.response.error is not None
    assert final.response.error.code == "server_error"
    return final.response.id


async def test_usage_of_responses_failed_by_a_down_ledger_lands_once_it_is_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = SwitchedLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine:
            session = engine.session()
            ledger.down = True
            first = await failed_response(session, "hello")
            second = await failed_response(session, "hello again")
            assert engine.post.unwritten_usage == 2  # one sampling step each
            await trio.sleep(3 * USAGE_RETRY_INTERVAL)  # still down: tried, still waiting
            assert engine.post.unwritten_usage == 2 and ledger.failed_writes >= 4
            ledger.down = False
            await trio.sleep(2 * USAGE_RETRY_INTERVAL)  # no new response: the timer carries them
            assert engine.post.unwritten_usage == 0
            rows = await ledger.rows()
            assert sorted((r.response_id, r.step) for r in rows) == sorted(
                [(first, 0), (second, 0)]
            )
            assert all(r.input_tokens > 0 and r.output_tokens > 0 for r in rows)
            # And once back, a response completes and is billed once, beside them.
            state = await session.create(p.ResponseCreate(model=MODEL, input="third"))
            assert state is not None
            await engine.post.flushed()
            assert len(await ledger.rows()) == 3
            assert engine.counters.ledger_records == 3


async def test_waiting_usage_follows_the_next_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Back before the timer fires, the waiting records go in right after the next group's
    write (in a transaction of their own), not a retry interval later."""
    ledger = SwitchedLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine:
            ledger.down = True
            engine.post.submit_nowait(PostJob(records=[record("resp_a")]))
            await engine.post.flushed()
            engine.post.submit_nowait(PostJob(records=[record("resp_a")]))  # tried again
            await engine.post.flushed()
            assert engine.post.unwritten_usage == 1  # one record waits once
            ledger.down = False
            start = trio.current_time()
            await engine.post.commit(PostJob(records=[record("resp_b")]))
            await trio.testing.wait_all_tasks_blocked()
            assert engine.post.unwritten_usage == 0
            assert trio.current_time() - start < USAGE_RETRY_INTERVAL
            assert [r.response_id for r in await ledger.rows()] == ["resp_a", "resp_b"]


async def test_what_waits_for_the_ledger_is_bounded(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(_postinfer, "MAX_UNWRITTEN_USAGE", 5)
    ledger = SwitchedLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine:
            ledger.down = True
            for n in range(8):
                engine.post.submit_nowait(PostJob(records=[record(f"resp_{n}")]))
                await engine.post.flushed()
            assert engine.post.unwritten_usage == 5
            assert engine.counters.usage_records_dropped == 3
            ledger.down = False
            await trio.sleep(2 * USAGE_RETRY_INTERVAL)
            # The newest five were kept; the oldest three were dropped, and said so.
            assert [r.response_id for r in await ledger.rows()] == [
                f"resp_{n}" for n in range(3, 8)
            ]
    assert "usage records dropped" in caplog.text


async def test_shutdown_writes_what_waits_or_says_it_could_not(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    back = SwitchedLedger()
    still_down = SwitchedLedger()
    with trio.fail_after(DEADLINE):
        for ledger, comes_back in ((back, True), (still_down, False)):
            async with open_engine(ledger=ledger) as engine:
                ledger.down = True
                engine.post.submit_nowait(PostJob(records=[record("resp_a")]))
                await engine.post.flushed()
                ledger.down = not comes_back  # and the engine closes before the timer fires
    assert [r.response_id for r in await back.rows()] == ["resp_a"]
    assert await still_down.rows() == []
    assert any(
        r.levelno == logging.ERROR and "could not be written at shutdown" in r.getMessage()
        for r in caplog.records
    )


class RefusingLedger(MemoryUsageLedger):
    """A working ledger that refuses any write holding one particular response's usage."""

    async def record(self, records: Sequence[UsageRecord]) -> None:
        if any(r.response_id == "resp_refused" for r in records):
            raise ValueError("refused")
        await super().record(records)


async def test_a_waiting_record_the_ledger_refuses_fails_no_other_response(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = RefusingLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine:
            with pytest.raises(WriteFailed):
                await engine.post.commit(PostJob(records=[record("resp_refused")]))
            for n in range(3):  # each goes through, though the refused one is retried beside
                await engine.post.commit(PostJob(records=[record(f"resp_{n}")]))
                await trio.sleep(2 * USAGE_RETRY_INTERVAL)
            assert [r.response_id for r in await ledger.rows()] == ["resp_0", "resp_1", "resp_2"]
            assert engine.post.unwritten_usage == 1
    assert "the ledger refused 1 waiting usage records" in caplog.text
