"""The three ways of running a rollout are the same rollout.

Over generated agent scripts (random tools of every kind a client runs: function tools with
random JSON schemas, custom tools with text, regex and lark formats, shell, local shell,
apply_patch and computer; unicode user text, random `steps`/`parallel`, random tool
outputs), the stateless mode (whole history per request), the previous_response_id chain and
the rollout coroutine produce the same output items in the same order (equal modulo
generated ids), the same final rendered context and the same usage totals; and their work
counters show the point of the design.
"""

from __future__ import annotations

import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.engine import open_engine

from tests.engine_harness import (
    EVERY_KIND,
    Script,
    check_arguments,
    conversation_chars,
    run_chain,
    run_rollout,
    run_stateless,
    same_items,
    scripts,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(script=scripts())
async def test_three_modes_produce_the_same_rollout(script: Script) -> None:
    await check_three_modes(script)


@pytest.mark.parametrize("kind", sorted(EVERY_KIND))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
async def test_three_modes_agree_for_every_tool_kind(kind: str, data: st.DataObject) -> None:
    """Every script makes calls of this kind (custom text, regex and lark; shell, local
    shell, apply_patch, computer), answered with outputs of the same kind."""
    script = data.draw(scripts(with_tool=EVERY_KIND[kind]))
    made = await check_three_modes(script)
    assert made, f"no {kind} call was made"


async def check_three_modes(script: Script) -> set[str]:
    """Run the script three ways, check they agree; returns the call types made."""
    with trio.fail_after(60):
        async with open_engine() as engine:
            before = engine.counters.snapshot()
            stateless = await run_stateless(engine, script)
            await engine.post.flushed()
            after_stateless = engine.counters.snapshot()
            chain = await run_chain(engine, script)
            await engine.post.flushed()
            after_chain = engine.counters.snapshot()
            rollout = await run_rollout(engine, script)
            await engine.post.flushed()
            after_rollout = engine.counters.snapshot()

    n_calls = sum(1 for i in chain.outputs if p.call_of(i) is not None)
    event(f"tool calls: {min(n_calls, 5)}{'+' if n_calls > 5 else ''}")
    for kind in sorted({i.type for i in chain.outputs if p.call_of(i) is not None}):
        event(f"made a {kind}")
    event(f"responses in chain: {min(len(chain.responses), 5)}")

    # Same output items, in the same order, modulo ids.
    assert same_items(stateless.outputs, chain.outputs)
    assert same_items(chain.outputs, rollout.outputs)
    check_arguments(script, chain.outputs)

    # Same final rendered context.
    final = chain.final.context()
    assert stateless.final.context() == final
    assert rollout.final.context() == final

    # Same usage totals (input, output, total).
    assert stateless.usage() == chain.usage() == rollout.usage()

    # Work counters: chain and rollout render and classify each context token exactly once;
    # stateless renders every prefix of the conversation again.
    final_len = len(final)
    final_chars = conversation_chars(engine, chain.final)
    for delta in (after_chain - after_stateless, after_rollout - after_chain):
        assert delta.tokens_rendered == final_len
        assert delta.chars_classified == final_chars
    stateless_work = after_stateless - before
    assert stateless_work.tokens_rendered == sum(s.context_tokens for s in stateless.states)
    assert stateless_work.chars_classified == sum(
        conversation_chars(engine, s) for s in stateless.states
    )
    # The rollout runs post-inference once per rollout (one per user turn here), the chain
    # once per response.
    assert (after_rollout - after_chain).post_inference_runs == len(script.user_turns)
    assert (after_chain - after_stateless).post_inference_runs == len(chain.responses)
    # Routing is resolved once per chain and per rollout, every time for stateless.
    assert (after_chain - after_stateless).route_resolutions == 1
    assert stateless_work.route_resolutions == len(stateless.responses)
    return {i.type for i in chain.outputs if p.call_of(i) is not None and i.type != "function_call"}
