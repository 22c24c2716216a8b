"""`WriteWatchdog`: one task looks over every HTTP request's writes; a write held past the
limit resets its connection within 1.5 x the limit, and nothing else is touched."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from rollout.engine._transport import WriteWatch, WriteWatchdog

pytestmark = pytest.mark.trio

LIMIT = 10.0


class FakeTransport:
    def __init__(self) -> None:
        self.aborted_at: float | None = None

    def abort(self) -> bool:
        if self.aborted_at is not None:
            return False
        self.aborted_at = trio.current_time()
        return True


async def held(message: dict[str, Any]) -> None:
    await trio.sleep_forever()  # a client that stopped reading


async def quick(message: dict[str, Any]) -> None:
    await trio.sleep(LIMIT * 0.9)  # slow, but under the limit


async def test_one_task_resets_a_held_write_within_one_and_a_half_limits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    watchdog = WriteWatchdog(LIMIT)
    stalls: list[str] = []
    stuck, fine = FakeTransport(), FakeTransport()
    stuck_watch = WriteWatch(held, stuck, LIMIT, lambda: stalls.append("stuck"))  # type: ignore[arg-type]
    fine_watch = WriteWatch(quick, fine, LIMIT, lambda: stalls.append("fine"))  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watchdog.run)
        await trio.testing.wait_all_tasks_blocked()
        assert watchdog.running
        began = trio.current_time() + 1.0
        await trio.sleep(1.0)  # a write that begins between two looks
        for watch in (stuck_watch, fine_watch):
            watchdog.add(watch)
        with trio.move_on_after(LIMIT * 3):
            async with trio.open_nursery() as requests:
                requests.start_soon(stuck_watch.send, {})
                for _ in range(3):
                    requests.start_soon(fine_watch.send, {})
                    await trio.sleep(LIMIT)
        nursery.cancel_scope.cancel()
    assert stalls == ["stuck"]
    assert stuck.aborted_at is not None
    assert began + LIMIT <= stuck.aborted_at <= began + 1.5 * LIMIT
    assert fine.aborted_at is None
    assert len(watchdog) == 1  # the held one was dropped once reset; the other is the caller's
    assert not watchdog.running


async def test_without_the_watchdog_a_watch_task_does_the_same(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stalls: list[str] = []
    transport = FakeTransport()
    watch = WriteWatch(held, transport, LIMIT, lambda: stalls.append("stuck"))  # type: ignore[arg-type]
    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.send, {})
        await watch.watch()
        nursery.cancel_scope.cancel()
    assert stalls == ["stuck"]
    assert transport.aborted_at is not None
    assert began + LIMIT <= transport.aborted_at <= began + 1.5 * LIMIT
