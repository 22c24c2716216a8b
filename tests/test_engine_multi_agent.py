"""The multi-agent door to the rollout coroutine, in the engine (trio's mock clock).

- A multi-agent response waits at its tool calls without `response.done`; injects queued
  while it samples are taken when it waits, committed in order (each acknowledged in the
  response's sequence), and it samples again once no call is owed: one coroutine, one
  pre-inference and one post-inference for the whole loop.
- An inject whose input is refused commits nothing and is answered with the error; the
  response keeps waiting; a response that waits past the suspend limit ends `incomplete`
  (`rollout_timeout`); injects it never took are handed back (`unanswered`).
- Its queue of injects is bounded (`too_many_queued_requests`).
- The root agent's attribution is on the wire only: the cached state holds the items as the
  model made them.
- No cyclic garbage of ours is left around the door (`gc.DEBUG_SAVEALL`): injected to the end,
  a refused inject, a client that leaves while the response waits, a wait past the limit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from rollout import protocol as p
from rollout.engine import Rollout, Session, open_engine

from tests.engine_harness import READ_FILE
from tests.test_engine_rollout import no_cyclic_garbage

DEADLINE = 30
TOOLS: list[p.Tool] = [READ_FILE]
# Two tool steps of two parallel calls, then a text answer; paced on trio's clock.
MODEL = "sim:steps=4,parallel=2,tokens=20,tps=200,ttft_ms=100"


def request(model: str = MODEL, **kw: Any) -> p.ResponseCreate:
    kw.setdefault("input", "fix the failing test")
    kw.setdefault("store", False)
    kw.setdefault("tools", TOOLS)
    return p.ResponseCreate(model=model, multi_agent={"enabled": True}, **kw)


def inject(rollout: Rollout, *call_ids: str) -> p.ResponseInject:
    assert rollout.response_id is not None
    event = p.ResponseInject(
        response_id=rollout.response_id,
        input=[p.FunctionCallOutput(call_id=c, output=f"ok: {c[-4:]}") for c in call_ids],
    )
    rollout.inject(event)
    return event


async def run_injecting(rollout: Rollout) -> list[p.ServerEvent]:
    """Every event to the end, each call's output injected when its item is done."""
    events: list[p.ServerEvent] = []
    async for event in rollout:
        events.append(event)
        if isinstance(event, p.OutputItemDone) and isinstance(event.item, p.FunctionCall):
            inject(rollout, event.item.call_id)
    return events


async def test_injects_resume_the_same_response(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            before = engine.counters.snapshot()
            session = engine.session()
            async with session.open_rollout(request()) as rollout:
                events = await run_injecting(rollout)
            await engine.post.flushed()
            work = engine.counters - before
            assert rollout.response_id is not None
            state = session.cache.get(rollout.response_id)
    kinds = [e.type for e in events]
    assert "response.done" not in kinds and kinds.count("response.in_progress") == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert isinstance(final, p.ResponseCompleted)
    acks = [e for e in events if isinstance(e, p.ResponseInjectCreated)]
    assert len(acks) == 4 and {a.response_id for a in acks} == {final.response.id}
    # What a suspension costs on the wire: an ack per inject, of a constant size (no snapshot
    # of the response so far, however long it grew).
    assert max(len(p.encode_json(a)) for a in acks) <= 130
    # Each step's two acks come together, after its calls and before the next step's items.
    for ack in acks:
        i = events.index(ack)
        assert isinstance(events[i - 1], p.OutputItemDone | p.ResponseInjectCreated)
    assert work.pre_inference_runs == 1
    assert work.post_inference_runs == 1
    assert work.samplings == 3
    assert work.injects_committed == 4
    assert work.items_validated == 1 + 4
    # On the wire, the root agent's items; in the state, the model's items unchanged.
    assert all(item.agent == p.ROOT_AGENT for item in final.response.output)
    last = final.response.output[-1]
    assert isinstance(last, p.Message) and last.phase == "final_answer"
    assert state is not None
    produced = [i for i in state.items if isinstance(i, p.FunctionCall | p.Message)]
    assert produced and all(i.agent is None for i in produced)
    assert all(i.phase is None for i in produced if isinstance(i, p.Message))


async def test_a_refused_inject_commits_nothing(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            async with session.open_rollout(request("sim:steps=1,parallel=1")) as rollout:
                events: list[p.ServerEvent] = []
                async for event in rollout:
                    events.append(event)
                    if isinstance(event, p.OutputItemDone) and isinstance(
                        event.item, p.FunctionCall
                    ):
                        call_id = event.item.call_id
                        inject(rollout, call_id, "call_unknown")  # refused: nothing committed
                        inject(rollout, call_id)
    errors = [e for e in events if isinstance(e, p.ErrorEvent)]
    assert [(e.error.code, e.error.param) for e in errors] == [
        ("invalid_value", "input[1].call_id")
    ]
    acks = [e for e in events if isinstance(e, p.ResponseInjectCreated)]
    assert len(acks) == 1
    assert events.index(errors[0]) < events.index(acks[0])
    assert events[-1].type == "response.completed"


async def test_waiting_past_the_limit_ends_incomplete_and_hands_back_late_injects(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(rollout_suspend_limit=7.5) as engine:
            async with engine.session().open_rollout(request()) as rollout:
                events = [e async for e in rollout]
            late = inject(rollout, "call_late")
            assert rollout.unanswered() == [late]
            assert rollout.unanswered() == []
    final = events[-1]
    assert isinstance(final, p.ResponseIncomplete)
    assert final.response.incomplete_details is not None
    assert final.response.incomplete_details.reason == "rollout_timeout"
    assert [e.type for e in events[-3:]] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]


async def test_a_late_injects_input_continues_in_a_new_response(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The Agents SDK's path after `response_already_completed`: the returned input goes into
    a new response continuing the ended one (previous_response_id)."""
    with trio.fail_after(DEADLINE):
        async with open_engine(rollout_suspend_limit=7.5) as engine:
            session = engine.session()
            async with session.open_rollout(request("sim:steps=1,parallel=1")) as rollout:
                events = [e async for e in rollout]
            call = next(e.item for e in events if isinstance(e, p.OutputItemDone))
            assert isinstance(call, p.FunctionCall)
            inject(rollout, call.call_id)  # too late: the response has ended
            (late,) = rollout.unanswered()
            follow = request(
                "sim:steps=1,parallel=1",
                previous_response_id=rollout.response_id,
                input=late.input,
            )
            async with session.open_rollout(follow) as second:
                more = [e async for e in second]
    assert events[-1].type == "response.incomplete"
    final = more[-1]
    assert isinstance(final, p.ResponseCompleted)
    assert [i.type for i in final.response.output] == ["message"]
    assert final.response.output[-1].phase == "final_answer"  # type: ignore[union-attr]


async def test_the_inject_queue_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            async with session.open_rollout(request("sim:steps=1,parallel=1,ttft_ms=1000")) as r:
                async for event in r:
                    assert event.type == "response.created"
                    break
                for n in range(r.max_queued_injects):
                    inject(r, f"call_{n}")
                with pytest.raises(p.RemoteProtocolError) as info:
                    inject(r, "call_one_too_many")
    assert (info.value.status, info.value.code) == (429, "too_many_queued_requests")


def test_the_root_agent_view_holds_a_message_until_its_phase_is_known() -> None:
    message = p.Message(id="msg_1", role="assistant", status="completed", content=[])
    call = p.FunctionCall(id="fc_1", call_id="call_1", name="f", arguments="{}", status="completed")
    view = p.RootAgentView()
    assert view.events(p.OutputItemDone(sequence_number=2, output_index=0, item=message)) == []
    out = view.events(p.OutputItemAdded(sequence_number=3, output_index=1, item=call))
    assert [e.sequence_number for e in out] == [2, 3]
    assert out[0].item == p.Message(
        id="msg_1", role="assistant", status="completed", content=[],
        phase="commentary", agent=p.ROOT_AGENT,
    )  # fmt: skip
    assert out[1].item.agent == p.ROOT_AGENT  # type: ignore[union-attr]
    assert view.events(p.OutputItemDone(sequence_number=4, output_index=2, item=message)) == []
    final = p.ResponseCompleted(sequence_number=5, response=p.Response(
        id="resp_1", created_at=0, model="sim", status="completed", output=[call, message]
    ))  # fmt: skip
    done, completed = view.events(final)
    assert isinstance(done, p.OutputItemDone) and isinstance(done.item, p.Message)
    assert done.item.phase == "final_answer"
    assert isinstance(completed, p.ResponseCompleted)
    assert completed.response.output == [attrs.evolve(call, agent=p.ROOT_AGENT), done.item]
    assert call.agent is None and message.phase is None  # the input objects are left alone


# --- no cyclic garbage around the inject door --------------------------------------------------


async def injected_to_the_end(session: Session) -> Rollout:
    async with session.open_rollout(request()) as rollout:
        await run_injecting(rollout)
    return rollout


async def refused_then_finished(session: Session) -> Rollout:
    async with session.open_rollout(request("sim:steps=1,parallel=1")) as rollout:
        async for event in rollout:
            if isinstance(event, p.OutputItemDone) and isinstance(event.item, p.FunctionCall):
                inject(rollout, "call_unknown")
                inject(rollout, event.item.call_id)
    return rollout


async def waiting_then_left(session: Session) -> Rollout:
    async with session.open_rollout(request()) as rollout:
        async for event in rollout:
            if isinstance(event, p.OutputItemDone):
                break  # leave while the response samples or waits: it is cancelled
    return rollout


async def waited_too_long(session: Session) -> Rollout:
    async with session.open_rollout(request()) as rollout:
        async for _event in rollout:
            pass
    inject(rollout, "call_late")
    rollout.unanswered()
    return rollout


@pytest.mark.parametrize(
    "scenario",
    [injected_to_the_end, refused_then_finished, waiting_then_left, waited_too_long],
    ids=lambda f: f.__name__,
)
async def test_no_cyclic_garbage_around_the_inject_door(
    autojump_clock: trio.testing.MockClock, scenario: Callable[[Session], Awaitable[Rollout]]
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(rollout_suspend_limit=5) as engine:
            await scenario(engine.session())  # warm up (lazy imports, caches)
            async with no_cyclic_garbage():
                for _ in range(2):
                    await scenario(engine.session())
                await engine.post.flushed()
