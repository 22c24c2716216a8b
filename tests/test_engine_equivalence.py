"""The ways of running a rollout are the same rollout.

Over generated agent scripts (random tools of every kind a client runs: function tools with
random JSON schemas, custom tools with text, regex and lark formats, shell, local shell,
apply_patch and computer; unicode user text, random `steps`/`parallel`, random tool
outputs), the stateless mode (whole history per request), the previous_response_id chain and
the rollout coroutine through both its doors (the extension's `response.append`, and the
multi-agent beta's `response.inject`, each output injected as soon as its call is done)
produce the same output items in the same order (equal modulo generated ids, and modulo the
beta's root-agent attribution on the wire), the same final rendered context and the same
usage totals; and their work counters show the point of the design.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.engine import Engine, RenderCache, open_engine
from rollout.engine._counters import Counters

from tests.engine_harness import (
    EVERY_KIND,
    Script,
    check_arguments,
    conversation_chars,
    echo_bare,
    run_chain,
    run_inject,
    run_rollout,
    run_stateless,
    same_items,
    scripts,
)
from tests.engine_harness import Run as _Run

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
    """Run the script every way, each in its own engine, and check they agree: stateless
    without the render cache (the baseline), stateless with it (outputs echoed as sent, and
    bare: without ids, assistant text as a string), the chain and the rollout. Returns the
    call types made."""
    with trio.fail_after(60):
        async with open_engine(render_cache=RenderCache(max_bytes=0)) as engine:
            uncached, uncached_work = await _measured(engine, run_stateless(engine, script))
            uncached_chars = [conversation_chars(engine, s) for s in uncached.states]
        async with open_engine() as engine:
            stateless, stateless_work = await _measured(engine, run_stateless(engine, script))
        async with open_engine() as engine:
            bare, bare_work = await _measured(engine, run_stateless(engine, script, echo_bare))
        async with open_engine() as engine:
            chain, chain_work = await _measured(engine, run_chain(engine, script))
            final_chars = conversation_chars(engine, chain.final)
        async with open_engine() as engine:
            rollout, rollout_work = await _measured(engine, run_rollout(engine, script))
        async with open_engine() as engine:
            injected, inject_work = await _measured(engine, run_inject(engine, script))

    n_calls = sum(1 for i in chain.outputs if p.call_of(i) is not None)
    event(f"tool calls: {min(n_calls, 5)}{'+' if n_calls > 5 else ''}")
    for kind in sorted({i.type for i in chain.outputs if p.call_of(i) is not None}):
        event(f"made a {kind}")
    event(f"responses in chain: {min(len(chain.responses), 5)}")

    # Same output items, in the same order, modulo ids.
    for other in (uncached, stateless, bare, rollout, injected):
        assert same_items(other.outputs, chain.outputs)
    check_arguments(script, chain.outputs)

    # Same final rendered context.
    final = chain.final.context()
    for other in (uncached, stateless, bare, rollout, injected):
        assert other.final.context() == final

    # Same usage totals (input, output, total).
    assert uncached.usage() == stateless.usage() == bare.usage() == chain.usage()
    assert chain.usage() == rollout.usage() == injected.usage()
    # Cached tokens are context not rendered for a request: every way that keeps what it
    # rendered (the connection's cache, the coroutine, the render cache) reports the same, and
    # the baseline, which renders every prefix again, none.
    assert stateless.cached() == bare.cached() == chain.cached()
    assert chain.cached() == rollout.cached() == injected.cached()
    assert uncached.cached() == 0

    # Work counters: every way but the uncached baseline renders and classifies each context
    # token exactly once (the stateless ones through the render cache); the baseline renders
    # every prefix of the conversation again.
    for work in (stateless_work, bare_work, chain_work, rollout_work, inject_work):
        assert work.tokens_rendered == len(final)
        assert work.chars_classified == final_chars
    assert uncached_work.tokens_rendered == sum(s.context_tokens for s in uncached.states)
    assert uncached_work.chars_classified == sum(uncached_chars)
    # The rollout runs post-inference once per rollout (one per user turn here), the chain
    # once per response.
    assert rollout_work.post_inference_runs == len(script.user_turns)
    assert inject_work.post_inference_runs == len(script.user_turns)
    assert (
        rollout_work.pre_inference_runs == inject_work.pre_inference_runs == len(script.user_turns)
    )
    assert chain_work.post_inference_runs == len(chain.responses)
    # Routing is resolved once per chain and per rollout, every time for stateless.
    assert chain_work.route_resolutions == 1
    assert stateless_work.route_resolutions == len(stateless.responses)
    return {i.type for i in chain.outputs if p.call_of(i) is not None and i.type != "function_call"}


async def _measured(engine: Engine, run: Coroutine[Any, Any, _Run]) -> tuple[_Run, Counters]:
    """Run, wait for post-inference, and return the run and the work it did."""
    before = engine.counters.snapshot()
    result = await run
    await engine.post.flushed()
    return result, engine.counters - before
