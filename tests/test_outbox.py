"""The WebSocket outbox (`engine/_outbox.py`) on trio's mock clock: frames within the byte
bound queue at once; past it a putter waits for the writer to make room; one that waits the
stall limit calls `on_stall` and fails with `SlowConsumer`; control frames take no room; a
close frame seals it; a stopped outbox lets the writer finish what is queued, or nothing."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from rollout.engine._outbox import Outbox, SlowConsumer

STALL = 5.0


def frame(n: int) -> dict[str, Any]:
    return {"type": "websocket.send", "text": "x" * n}


def outbox(stalls: list[float], limit: int = 100) -> Outbox:
    return Outbox(
        max_buffered_bytes=limit,
        send_stall_limit=STALL,
        on_stall=lambda: stalls.append(trio.current_time()),
    )


async def test_frames_within_the_bound_queue_at_once_and_in_order() -> None:
    box = outbox([])
    with trio.fail_after(1):
        await box.put(frame(60), 60)
        await box.put(frame(40), 40)
        assert box.buffered == 100
        assert await box.get() == (frame(60), 60)
        box.written(60)
        assert await box.get() == (frame(40), 40)
        box.written(40)
    assert box.buffered == 0


async def test_a_putter_past_the_bound_waits_for_the_writer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    box = outbox([])
    put_at: list[float] = []

    async def put_second() -> None:
        await box.put(frame(80), 80)
        put_at.append(trio.current_time())

    with trio.fail_after(STALL * 2):
        await box.put(frame(200), 200)  # larger than the bound: queued alone
        async with trio.open_nursery() as nursery:
            nursery.start_soon(put_second)
            await trio.sleep(1)
            assert not put_at  # no room yet
            taken = await box.get()
            assert taken is not None
            box.written(taken[1])
        assert put_at == [1.0]


async def test_a_putter_that_waits_the_stall_limit_is_a_slow_consumer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stalls: list[float] = []
    box = outbox(stalls)
    with trio.fail_after(STALL * 2):
        await box.put(frame(100), 100)
        with pytest.raises(SlowConsumer):
            await box.put(frame(1), 1)
    assert stalls == [STALL]


async def test_control_frames_take_no_room_and_the_close_frame_seals() -> None:
    box = outbox([])
    with trio.fail_after(1):
        await box.put(frame(100), 100)
        box.put_control({"type": "rollout.ping"})  # no wait, though the outbox is full
        box.put_control({"type": "websocket.close", "code": 1000}, last=True)
        assert box.buffered == 100
        with pytest.raises(trio.ClosedResourceError):
            await box.put(frame(1), 1)
        kinds = []
        for _ in range(3):
            taken = await box.get()
            assert taken is not None
            kinds.append(taken[0]["type"])
            box.written(taken[1])
    assert kinds == ["websocket.send", "rollout.ping", "websocket.close"]


async def test_a_stopped_outbox_ends_the_writer_after_what_is_queued_or_at_once() -> None:
    with trio.fail_after(1):
        box = outbox([])
        await box.put(frame(10), 10)
        box.stop()
        with pytest.raises(trio.ClosedResourceError):
            await box.put(frame(1), 1)
        assert await box.get() == (frame(10), 10)
        assert await box.get() is None
        dropped = outbox([])
        await dropped.put(frame(10), 10)
        dropped.stop(drop=True)
        assert await dropped.get() is None


async def test_a_putter_waiting_for_room_fails_once_the_writer_stops(
    autojump_clock: trio.testing.MockClock,
) -> None:
    box = outbox([])
    failed: list[BaseException] = []

    async def put_late() -> None:
        try:
            await box.put(frame(50), 50)
        except trio.ClosedResourceError as exc:
            failed.append(exc)

    with trio.fail_after(STALL):
        await box.put(frame(100), 100)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(put_late)
            await trio.sleep(1)
            taken = await box.get()
            assert taken is not None
            box.stop()  # the write failed: the connection is closing
            box.written(taken[1])
    assert len(failed) == 1 and not isinstance(failed[0], SlowConsumer)
