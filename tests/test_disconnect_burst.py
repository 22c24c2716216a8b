"""A burst of disconnects does not block the event loop: the usage of every response cut off
mid-stream goes through the post-inference writer (never a blocking ledger call on the trio
thread), and a response on another connection streams to completion throughout.

The ledger here counts its blocking `record_sync` calls: while the engine runs, there must be
none (a cut-off response used to write its usage that way, with a new SQLite connection on the
event loop, so a burst of them stalled every connection). Trio's autojump clock drives the
paced sim model.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
import trio.testing
from rollout import protocol as p
from rollout.engine import MemoryUsageLedger, open_engine
from rollout.engine._interfaces import UsageRecord

CUT_OFF = 100
MODEL = "sim:tokens=200,tps=100"  # two seconds of streaming, on the mock clock


class CountingLedger(MemoryUsageLedger):
    def __init__(self) -> None:
        super().__init__()
        self.blocking_calls = 0
        self._in_record = False

    async def record(self, records: Sequence[UsageRecord]) -> None:
        self._in_record = True  # the memory ledger's async path reuses record_sync
        try:
            await super().record(records)
        finally:
            self._in_record = False

    def record_sync(self, records: Sequence[UsageRecord]) -> None:
        if not self._in_record:
            self.blocking_calls += 1
        super().record_sync(records)


def _request(text: str) -> p.ResponseCreate:
    return p.ResponseCreate(model=MODEL, input=text, store=False)


async def test_a_burst_of_disconnects_goes_through_the_writer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = CountingLedger()
    streaming = trio.Semaphore(0)
    bystander: list[str] = []
    with trio.fail_after(60):
        async with open_engine(ledger=ledger) as engine:

            async def cut_off(n: int, scope: trio.CancelScope) -> None:
                started = False

                async def emit(event: p.ServerEvent) -> None:
                    nonlocal started
                    if event.type == "response.output_text.delta" and not started:
                        started = True
                        streaming.release()

                with scope:
                    await engine.session(owner="k").create(_request(f"cut {n}"), emit)

            async def keep(event: p.ServerEvent) -> None:
                bystander.append(event.type)

            async with trio.open_nursery() as nursery:
                scopes = [trio.CancelScope() for _ in range(CUT_OFF)]
                for n, scope in enumerate(scopes):
                    nursery.start_soon(cut_off, n, scope)
                nursery.start_soon(engine.session(owner="other").create, _request("stay"), keep)
                for _ in range(CUT_OFF):
                    await streaming.acquire()
                for scope in scopes:  # every client leaves at the same instant
                    scope.cancel()
            await engine.post.flushed()
            assert ledger.blocking_calls == 0
            totals = await ledger.totals(owner="k")
            assert totals["records"] == CUT_OFF and totals["incomplete"] == CUT_OFF
            assert bystander[-1] == "response.completed"
            assert bystander.count("response.output_text.delta") > 100
