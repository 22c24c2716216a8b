"""The rollout coroutine: one long-lived response that suspends at tool calls.

- It suspends at tool calls (`response.done`) naming the pending calls; a partial append keeps
  it suspended (the documented choice: wait for the rest); it resumes when every pending call
  has its output.
- Append errors leave it suspended and resumable: not suspended (`rollout_not_suspended`), an
  output for an unknown call or for a call already answered (`invalid_value` on
  `input[i].call_id`), a function call in an append; then a valid append resumes it.
- A rollout suspended longer than the limit ends `incomplete` with reason `rollout_timeout`.
- Sequence numbers run from 0 by one over the whole rollout, across suspensions; the final
  `response.completed` holds every output item and the usage of every step; post-inference
  runs once per rollout.
- Leaving the `open_rollout` block (or cancelling around it) while suspended or sampling ends
  the rollout: its usage is in the ledger, no task is left behind, and no cyclic garbage of
  ours is left (`gc.DEBUG_SAVEALL`).
"""

from __future__ import annotations

import gc
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from rollout import protocol as p
from rollout.engine import (
    ClassifierSet,
    Engine,
    MemoryUsageLedger,
    ModelRegistry,
    ModelSpec,
    PatternPolicy,
    PolicyRule,
    Rollout,
    Session,
    UsageRecord,
    open_engine,
)

DEADLINE = 30

TOOLS: list[p.Tool] = [
    p.FunctionTool(
        name="read_file",
        parameters={
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
    ),
    p.FunctionTool(
        name="run",
        parameters={
            "type": "object",
            "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["cmd"],
        },
    ),
]
# Three tool steps of two parallel calls, then a text answer; paced on trio's clock.
MODEL = "sim:steps=6,parallel=2,tokens=20,tps=200,ttft_ms=100"


def rollout_request(model: str = MODEL, **kw: Any) -> p.ResponseCreate:
    kw.setdefault("input", "fix the failing test")
    kw.setdefault("store", False)
    return p.ResponseCreate(model=model, tools=TOOLS, rollout=True, **kw)


def outputs_for(call_ids: list[str], tag: str = "ok") -> list[p.Item]:
    return [p.FunctionCallOutput(call_id=c, output=f"{tag}: {c[-4:]}") for c in call_ids]


def pending_ids(rollout: Rollout) -> list[str]:
    return [call_id for call_id, _name in rollout.pending_calls]


async def drain(rollout: Rollout, into: list[p.ServerEvent] | None = None) -> list[p.ServerEvent]:
    """Events up to the next suspension or the end."""
    events = [] if into is None else into
    async for event in rollout:
        events.append(event)
    return events


async def run_to_end(rollout: Rollout, events: list[p.ServerEvent]) -> None:
    """Answer every suspension until the rollout ends."""
    while not rollout.ended:
        if rollout.suspended:
            rollout.append(outputs_for(pending_ids(rollout)))
        await drain(rollout, events)


def raises(code: str, param: str | None, fn: Callable[[], Any]) -> p.RemoteProtocolError:
    with pytest.raises(p.RemoteProtocolError) as info:
        fn()
    assert (info.value.code, info.value.param) == (code, param)
    return info.value


# --- suspension and append -----------------------------------------------------------------


async def test_suspends_at_tool_calls_with_the_pending_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            async with session.open_rollout(rollout_request()) as rollout:
                events = await drain(rollout)
                done = events[-1]
                assert isinstance(done, p.ResponseDone)
                assert rollout.suspended and not rollout.done
                # response.done names the response and the step's items; the items went out
                # as output_item.done, and the handle shows the response so far.
                streamed = {e.output_index: e.item for e in events if e.type.endswith("item.done")}
                calls = [i for i in streamed.values() if isinstance(i, p.FunctionCall)]
                assert len(calls) == 2
                assert [c.status for c in calls] == ["completed", "completed"]
                assert done.pending_call_ids == [c.call_id for c in calls]
                assert done.output_indices == sorted(streamed)
                assert rollout.pending_calls == [(c.call_id, c.name) for c in calls]
                assert done.response == p.ResponseRef(id=rollout.response_id or "")
                assert rollout.response is not None
                assert rollout.response.output == list(streamed.values())
                await run_to_end(rollout, events)
            assert rollout.done and not rollout.suspended


async def test_partial_append_waits_for_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            async with engine.session().open_rollout(rollout_request()) as rollout:
                await drain(rollout)
                first, second = pending_ids(rollout)
                rollout.append(outputs_for([first]))
                assert rollout.suspended
                assert pending_ids(rollout) == [second]
                # Nothing happens while the other output is missing (well within the limit).
                idle: list[p.ServerEvent] = []
                with trio.move_on_after(10):
                    await drain(rollout, idle)
                assert idle == []
                assert engine.counters.samplings == 1
                rollout.append(outputs_for([second]))
                resumed = await drain(rollout)
                assert resumed[0].type == "response.in_progress"
                assert engine.counters.samplings == 2


async def test_append_errors_leave_the_rollout_suspended_and_resumable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            async with engine.session().open_rollout(rollout_request()) as rollout:
                # Before the first suspension: not suspended.
                raises(
                    "rollout_not_suspended",
                    "response_id",
                    lambda: rollout.append(outputs_for(["call_x"])),
                )
                events: list[p.ServerEvent] = []
                async for event in rollout:
                    events.append(event)
                    if event.type == "response.function_call_arguments.delta":
                        # While sampling: not suspended either.
                        raises(
                            "rollout_not_suspended",
                            "response_id",
                            lambda: rollout.append(outputs_for(["call_x"])),
                        )
                first, second = pending_ids(rollout)
                before = rollout.pending_calls

                raises(
                    "invalid_value",
                    "input[0].call_id",
                    lambda: rollout.append(outputs_for(["call_unknown"])),
                )
                # A later bad item refuses the whole append: the good one is not committed.
                raises(
                    "invalid_value",
                    "input[1].call_id",
                    lambda: rollout.append(outputs_for([first, "call_unknown"])),
                )
                assert rollout.pending_calls == before
                raises(
                    "invalid_value",
                    "input",
                    lambda: rollout.append(
                        [p.FunctionCall(call_id="call_new", name="run", arguments="{}")]
                    ),
                )
                assert rollout.pending_calls == before
                rollout.append(outputs_for([first]))
                # Already answered, alone or beside a good one.
                raises(
                    "invalid_value",
                    "input[0].call_id",
                    lambda: rollout.append(outputs_for([first])),
                )
                raises(
                    "invalid_value",
                    "input[1].call_id",
                    lambda: rollout.append(outputs_for([second, first])),
                )
                assert rollout.suspended and pending_ids(rollout) == [second]
                # A valid append resumes it; the rest of the rollout is unaffected.
                rollout.append(outputs_for([second]))
                await run_to_end(rollout, events)
                assert rollout.response is not None
                assert rollout.response.status == "completed"
                # After the end: not suspended.
                raises(
                    "rollout_not_suspended",
                    "response_id",
                    lambda: rollout.append(outputs_for([second])),
                )


async def test_append_accepts_a_response_append_event_and_extra_messages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            async with engine.session().open_rollout(rollout_request()) as rollout:
                await drain(rollout)
                assert rollout.response_id is not None
                rollout.append(
                    p.ResponseAppend(
                        response_id=rollout.response_id,
                        input=[
                            *outputs_for(pending_ids(rollout)),
                            p.Message(role="user", content="also check the docs"),
                        ],
                    )
                )
                events = await drain(rollout)
    assert events[0].type == "response.in_progress"


async def test_a_flagged_append_fails_the_rollout_and_bills_its_steps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = MemoryUsageLedger()
    blocking = ClassifierSet([PatternPolicy([PolicyRule(name="no_zebras", pattern="zebra")])])
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger, classifier=blocking) as engine:
            async with engine.session().open_rollout(rollout_request()) as rollout:
                events = await drain(rollout)
                rollout.append(outputs_for(pending_ids(rollout), tag="a zebra"))
                await drain(rollout, events)
            await engine.post.flushed()
            rows = await ledger.rows()
    final = events[-1]
    assert isinstance(final, p.ResponseFailed)
    assert final.response.error is not None and final.response.error.code == "invalid_prompt"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [(r.step, r.complete) for r in rows] == [(0, True)]


class BrokenBackend:
    """A backend with a bug (not a `BackendError`): the crash must reach the caller."""

    async def sample(self, request: Any) -> AsyncIterator[Any]:
        raise RuntimeError("backend bug")
        yield  # an async generator, like every backend


async def test_a_crash_in_the_rollout_is_never_swallowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """However the reader and the dying rollout task are scheduled (trio varies the order), a
    backend's crash ends the rollout with `response.failed` (`server_error`) and its traceback
    in the log: never silently, never as an exception into the caller's transport."""
    registry = ModelRegistry([ModelSpec(name="broken", backend=BrokenBackend())])
    with trio.fail_after(DEADLINE):
        async with open_engine(registry=registry) as engine:
            for _ in range(25):
                caplog.clear()
                request = p.ResponseCreate(model="broken", input="x", rollout=True)
                async with engine.session().open_rollout(request) as rollout:
                    events = await drain(rollout)
                assert events[-1].type == "response.failed"
                assert isinstance(events[-1], p.ResponseFailed)
                assert events[-1].response.error is not None
                assert events[-1].response.error.code == "server_error"
                assert "RuntimeError: backend bug" in caplog.text


async def test_a_rollout_suspended_too_long_ends_incomplete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = MemoryUsageLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger, rollout_suspend_limit=7.5) as engine:
            async with engine.session().open_rollout(rollout_request()) as rollout:
                events = await drain(rollout)
                suspended_at = trio.current_time()
                await drain(rollout, events)
                waited = trio.current_time() - suspended_at
                raises(
                    "rollout_not_suspended",
                    "response_id",
                    lambda: rollout.append(outputs_for(["call_x"])),
                )
            await engine.post.flushed()
            rows = await ledger.rows()
            status = dict(engine.responses_by_status)
    assert waited == pytest.approx(7.5)
    # Straight from the suspension to the end: no resume in between.
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["response.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert isinstance(final, p.ResponseIncomplete)
    assert final.response.incomplete_details is not None
    assert final.response.incomplete_details.reason == "rollout_timeout"
    # The calls it made are in the output, and the step it sampled is billed.
    assert [i.type for i in final.response.output] == ["function_call", "function_call"]
    assert final.response.usage is not None and final.response.usage.output_tokens > 0
    assert [(r.step, r.complete) for r in rows] == [(0, True)]
    assert rows[0].output_tokens == final.response.usage.output_tokens
    assert status == {"incomplete": 1}


# --- the whole rollout ---------------------------------------------------------------------


async def test_sequence_numbers_output_usage_and_post_inference_over_a_rollout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = MemoryUsageLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine:
            before = engine.counters.snapshot()
            events: list[p.ServerEvent] = []
            async with engine.session().open_rollout(rollout_request()) as rollout:
                await run_to_end(rollout, events)
            await engine.post.flushed()
            delta = engine.counters.snapshot() - before
            rows = await ledger.rows()

    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.done") == 3  # three tool steps
    assert kinds.count("response.created") == 1
    for i, kind in enumerate(kinds):
        if kind == "response.done":
            assert kinds[i + 1] == "response.in_progress"  # resumed, same response
    assert len({r.id for e in events if (r := getattr(e, "response", None)) is not None}) == 1

    final = events[-1]
    assert isinstance(final, p.ResponseCompleted)
    response = final.response
    done_items = [e.item for e in events if isinstance(e, p.OutputItemDone)]
    assert response.output == done_items
    assert [i.type for i in response.output] == ["function_call"] * 6 + ["message"]
    for e in events:
        if isinstance(e, p.OutputItemDone):
            assert response.output[e.output_index] == e.item

    # Usage: the sum of the steps, as billed.
    assert [(r.step, r.complete) for r in rows] == [(i, True) for i in range(4)]
    assert response.usage is not None
    assert response.usage.input_tokens == sum(r.input_tokens for r in rows)
    assert response.usage.output_tokens == sum(r.output_tokens for r in rows)
    assert response.usage.input_tokens_details.cached_tokens == sum(r.cached_tokens for r in rows)
    assert rows[0].cached_tokens == 0
    assert all(r.cached_tokens > 0 for r in rows[1:])

    # Post-inference ran once for the whole rollout, recording its four steps.
    assert delta.post_inference_runs == 1
    assert delta.ledger_records == 4
    assert delta.samplings == 4
    assert delta.responses_completed == 1


# --- cancellation --------------------------------------------------------------------------


def task_names() -> list[str]:
    names: list[str] = []
    root = trio.lowlevel.current_root_task()
    assert root is not None
    stack = [root]
    while stack:
        task = stack.pop()
        names.append(task.name)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return names


def rollout_tasks() -> list[str]:
    return [n for n in task_names() if n.startswith("rollout.engine.") and "PostInference" not in n]


async def suspend_then_leave(session: Session) -> Rollout:
    async with session.open_rollout(rollout_request()) as rollout:
        await drain(rollout)
        rollout.append(outputs_for(pending_ids(rollout)))
        await drain(rollout)
        assert rollout.suspended
        assert rollout_tasks()
    return rollout


async def suspend_then_cancel(session: Session) -> Rollout:
    with trio.CancelScope() as scope:
        async with session.open_rollout(rollout_request()) as rollout:
            await drain(rollout)
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    return rollout


async def cancel_mid_sampling(session: Session) -> Rollout:
    with trio.CancelScope() as scope:
        async with session.open_rollout(rollout_request()) as rollout:
            await drain(rollout)
            rollout.append(outputs_for(pending_ids(rollout)))
            async for event in rollout:
                if event.type == "response.function_call_arguments.delta":
                    scope.cancel()
                    await trio.sleep_forever()
    return rollout


@pytest.mark.parametrize(
    ("leave", "complete_steps", "interrupted"),
    [
        (suspend_then_leave, 2, False),
        (suspend_then_cancel, 1, False),
        (cancel_mid_sampling, 1, True),
    ],
)
async def test_cancelling_a_rollout_records_its_usage_and_leaves_nothing_running(
    autojump_clock: trio.testing.MockClock,
    leave: Callable[[Session], Awaitable[Rollout]],
    complete_steps: int,
    interrupted: bool,
) -> None:
    ledger = MemoryUsageLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger) as engine:
            session = engine.session()
            result: list[Rollout] = []
            # A nursery we own: it must close as soon as the rollout is left.
            async with trio.open_nursery() as nursery:

                async def scenario() -> None:
                    result.append(await leave(session))

                nursery.start_soon(scenario)
            left_at = trio.current_time()
            (rollout,) = result
            assert rollout.done and not rollout.suspended
            assert rollout_tasks() == []
            await engine.post.flushed()
            assert rollout.response_id is not None
            rows = await ledger.rows(rollout.response_id)
            assert trio.current_time() == left_at  # nothing waited for a timer
    complete = [r for r in rows if r.complete]
    assert [r.step for r in complete] == list(range(complete_steps))
    assert all(r.output_tokens > 0 for r in complete)
    incomplete = [r for r in rows if not r.complete]
    if interrupted:
        (cut,) = incomplete
        assert cut.step == complete_steps
        assert cut.input_tokens > complete[-1].input_tokens
    else:
        assert incomplete == []


# --- no cyclic garbage ---------------------------------------------------------------------

_OUR_FILES = ("/engine/", "/protocol/")


def _ours(obj: object) -> bool:
    module = type(obj).__module__ or ""
    if module.startswith(("engine", "protocol", "rollout.engine", "rollout.protocol")):
        return True
    if isinstance(obj, trio.lowlevel.Task):
        return True
    code = None
    if isinstance(obj, types.FrameType):
        code = obj.f_code
    elif isinstance(obj, types.CoroutineType):
        code = obj.cr_code
    elif isinstance(obj, types.AsyncGeneratorType):
        code = obj.ag_code
    elif isinstance(obj, types.GeneratorType):
        code = obj.gi_code
    elif isinstance(obj, types.FunctionType):
        code = obj.__code__
    return code is not None and any(part in code.co_filename for part in _OUR_FILES)


@asynccontextmanager
async def no_cyclic_garbage() -> AsyncIterator[None]:
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
        gc.collect()
        garbage = [repr(type(o)) for o in gc.garbage if _ours(o)]
        assert garbage == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def bad_request(session: Session) -> Rollout:
    request = rollout_request(previous_response_id="resp_missing")
    async with session.open_rollout(request) as rollout:
        events = await drain(rollout)
    assert events[-1].type == "error"
    assert rollout.error is not None and rollout.error.code == "previous_response_not_found"
    return rollout


async def timed_out(session: Session) -> Rollout:
    async with session.open_rollout(rollout_request()) as rollout:
        await drain(rollout)
        await drain(rollout)
    assert rollout.response is not None and rollout.response.status == "incomplete"
    return rollout


async def append_errors_then_finish(session: Session) -> Rollout:
    async with session.open_rollout(rollout_request()) as rollout:
        events: list[p.ServerEvent] = []
        await drain(rollout, events)
        function_call = p.FunctionCall(call_id="call_new", name="run", arguments="{}")
        for bad in (outputs_for(["call_nope"]), [function_call]):
            try:
                rollout.append(bad)
            except p.RemoteProtocolError:
                pass
        await run_to_end(rollout, events)
    return rollout


async def completed(session: Session) -> Rollout:
    async with session.open_rollout(rollout_request()) as rollout:
        await run_to_end(rollout, [])
    return rollout


SCENARIOS = [
    suspend_then_leave,
    suspend_then_cancel,
    cancel_mid_sampling,
    bad_request,
    timed_out,
    append_errors_then_finish,
    completed,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
async def test_no_cyclic_garbage_around_suspend_resume_and_cancel(
    autojump_clock: trio.testing.MockClock, scenario: Callable[[Session], Awaitable[Rollout]]
) -> None:
    ledger = MemoryUsageLedger()
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=ledger, rollout_suspend_limit=5) as engine:

            async def cycle() -> None:
                rollout = await scenario(engine.session())
                assert rollout.done or rollout.error is not None

            await cycle()  # warm up (lazy imports, caches)
            async with no_cyclic_garbage():
                for _ in range(2):
                    await cycle()
                await engine.post.flushed()


async def test_no_cyclic_garbage_in_chain_mode_errors_and_cancellation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def cycle(engine: Engine) -> None:
        session = engine.session()
        state = await session.create(p.ResponseCreate(model=MODEL, tools=TOOLS, input="hi"))
        assert state is not None
        with pytest.raises(p.RemoteProtocolError):
            await session.create(
                p.ResponseCreate(
                    model=MODEL,
                    tools=TOOLS,
                    previous_response_id=state.id,
                    input=outputs_for(["call_unknown"]),
                )
            )
        with trio.move_on_after(0.15):
            await session.create(p.ResponseCreate(model=MODEL, tools=TOOLS, input="again"))

    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=MemoryUsageLedger()) as engine:
            await cycle(engine)
            async with no_cyclic_garbage():
                await cycle(engine)
                await engine.post.flushed()


def test_usage_record_is_the_public_type() -> None:
    """The ledger rows these tests read are the public `UsageRecord`s."""
    assert UsageRecord.__module__.startswith("rollout.engine")
