"""A shutdown interrupting responses (`Engine.interrupt_all`: the grace period is over, or a
second Ctrl-C): each ends `incomplete`, reason `server_shutdown`, with what it streamed.

- A response cut off while its text streams: its terminal event carries the message so far
  (closed `incomplete`, the text of every delta sent), the usage the ledger recorded for it
  (the same input, cached and output tokens), and the stored response is that same response.
- A rollout cut off while suspended at its calls keeps the calls (completed), billed for the
  step that made them; one cut off in its second step keeps the calls of the first and the
  text of the second, billed for both (the second as an interrupted step).
- A response running under an interruption gets nothing more from the model, and the events
  it sent are numbered without a gap.

All on trio's mock clock, with the simulated model; the in-memory store and ledger.
"""

from __future__ import annotations

from typing import Any

import trio
import trio.testing
from rollout import protocol as p
from rollout.engine import (
    Engine,
    MemoryResponseStore,
    MemoryUsageLedger,
    UsageRecord,
    open_engine,
)

from tests.engine_harness import READ_FILE

DEADLINE = 30
# A long answer, paced on trio's clock: far from done when it is interrupted.
LONG = "sim:tokens=2000,tps=50"
TOOLS: list[p.Tool] = [READ_FILE]
# One tool step (a call), then a long text answer.
AGENT = "sim:steps=1,tokens=2000,tps=50"


def _totals(rows: list[UsageRecord]) -> tuple[int, int, int]:
    return (
        sum(r.input_tokens for r in rows),
        sum(r.cached_tokens for r in rows),
        sum(r.output_tokens for r in rows),
    )


def _usage(response: p.Response) -> tuple[int, int, int]:
    usage = response.usage
    assert usage is not None
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    return usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens


def _streamed_text(events: list[p.ServerEvent]) -> str:
    return "".join(e.delta for e in events if isinstance(e, p.OutputTextDelta))


def _interrupted(events: list[p.ServerEvent]) -> p.Response:
    """The terminal response of an interrupted stream, checked for what every one must say."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert isinstance(final, p.ResponseIncomplete), [e.type for e in events[-3:]]
    response = final.response
    assert response.status == "incomplete"
    assert response.incomplete_details == p.IncompleteDetails(reason="server_shutdown")
    assert response.error is None
    return response


async def _interrupt_after(engine: Engine, deltas: int) -> tuple[list[p.ServerEvent], Any]:
    """An emitter that interrupts every response after `deltas` text deltas went out."""
    events: list[p.ServerEvent] = []

    async def emit(event: p.ServerEvent) -> None:
        events.append(event)
        if isinstance(event, p.OutputTextDelta):
            if sum(isinstance(e, p.OutputTextDelta) for e in events) == deltas:
                engine.interrupt_all()

    return events, emit


async def test_a_response_cut_off_mid_text_keeps_its_text_and_usage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = MemoryUsageLedger()
    store = MemoryResponseStore()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger, store=store) as engine:
            events, emit = await _interrupt_after(engine, 40)
            request = p.ResponseCreate(model=LONG, input="Tell me everything.")
            await engine.session().create(request, emit)
            response = _interrupted(events)
            stored = await engine.get_stored(response.id, owner=None)
            await engine.post.flushed()
            rows = await ledger.rows(response.id)
            status = dict(engine.responses_by_status)
    # The message so far: every delta's text, closed incomplete (its done events went out).
    (message,) = response.output
    assert isinstance(message, p.Message) and message.status == "incomplete"
    text = _streamed_text(events)
    assert len(text) > 0 and message.content == [p.OutputText(text=text)]
    done = [e for e in events if isinstance(e, p.OutputItemDone)]
    assert [d.item for d in done] == [message]
    # Billed as the ledger has it: one step, interrupted; the same numbers to the client.
    assert [(r.step, r.complete) for r in rows] == [(0, False)]
    assert _usage(response) == _totals(rows)
    assert response.usage is not None and response.usage.output_tokens >= 40
    # Stored as it ended.
    assert stored is not None and stored.response == response
    assert status == {"incomplete": 1}


async def test_a_rollout_cut_off_while_suspended_keeps_its_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = MemoryUsageLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine:
            request = p.ResponseCreate(model=AGENT, input="Read it.", tools=TOOLS, rollout=True)
            async with engine.session().open_rollout(request) as rollout:
                events = [event async for event in rollout]
                assert isinstance(events[-1], p.ResponseDone)
                engine.interrupt_all()
                events += [event async for event in rollout]
            await engine.post.flushed()
    response = _interrupted(events)
    (call,) = response.output
    assert isinstance(call, p.FunctionCall) and call.status == "completed"
    rows = await ledger.rows(response.id)
    assert [(r.step, r.complete) for r in rows] == [(0, True)]
    assert _usage(response) == _totals(rows)


async def test_a_rollout_cut_off_in_its_second_step_keeps_both(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = MemoryUsageLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine:
            request = p.ResponseCreate(model=AGENT, input="Read it.", tools=TOOLS, rollout=True)
            async with engine.session().open_rollout(request) as rollout:
                events = [event async for event in rollout]
                (call_id, _name), *_ = rollout.pending_calls
                rollout.append([p.FunctionCallOutput(call_id=call_id, output="contents")])
                async for event in rollout:
                    events.append(event)
                    if len([e for e in events if isinstance(e, p.OutputTextDelta)]) == 25:
                        engine.interrupt_all()
            await engine.post.flushed()
    response = _interrupted(events)
    call, message = response.output
    assert isinstance(call, p.FunctionCall) and call.status == "completed"
    assert isinstance(message, p.Message) and message.status == "incomplete"
    assert message.content == [p.OutputText(text=_streamed_text(events))]
    rows = await ledger.rows(response.id)
    assert [(r.step, r.complete) for r in rows] == [(0, True), (1, False)]
    assert _usage(response) == _totals(rows)


async def test_an_event_waiting_for_room_as_the_shutdown_comes_still_goes_out_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The shutdown cancels a response while its sink holds an event back (a full outbox: the
    client reads slowly): that event was built, numbered and cut off the stream's text, so it
    still goes out, before the events that close the response, and the stream stays numbered
    without a gap."""
    ledger = MemoryUsageLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine:
            events: list[p.ServerEvent] = []
            room = trio.Event()

            async def emit(event: p.ServerEvent) -> None:
                deltas = sum(isinstance(e, p.OutputTextDelta) for e in events)
                if isinstance(event, p.OutputTextDelta) and deltas == 10 and not room.is_set():
                    await room.wait()  # the outbox is full until the client reads
                events.append(event)

            async def shutdown_then_read() -> None:
                await trio.sleep(1.0)  # the response waits on its 11th delta by then
                engine.interrupt_all()
                await trio.sleep(1.0)
                room.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(shutdown_then_read)
                request = p.ResponseCreate(model=LONG, input="Tell me everything.")
                await engine.session().create(request, emit)
            await engine.post.flushed()
    response = _interrupted(events)
    (message,) = response.output
    assert isinstance(message, p.Message) and message.status == "incomplete"
    assert message.content == [p.OutputText(text=_streamed_text(events))]
    assert sum(isinstance(e, p.OutputTextDelta) for e in events) == 11
