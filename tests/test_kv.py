"""The KV index's bookkeeping (`engine/_kv.py`), without a model: which sequence a turn runs
on, what it keeps, who keeps it after, and what the budgets evict."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st
from rollout.engine._kv import KVIndex, common_prefix


def toks(*values: int) -> array[int]:
    return array("I", values)


def run(index: KVIndex, owner: str | None, context: array[int], *holders: object) -> int:
    """Plan a turn, pretend it evaluated the rest and sampled one token; returns the keep."""
    plan = index.plan(owner, context, holders, reserve=1)
    assert plan is not None
    done = array("I", context)
    done.append(999)
    index.finish(plan.slot, done, holders)
    return plan.keep


def test_common_prefix() -> None:
    assert common_prefix(toks(1, 2, 3), toks(1, 2, 3, 4)) == 3
    assert common_prefix(toks(1, 2, 3), toks(1, 9, 3)) == 1
    assert common_prefix(toks(), toks(1)) == 0
    assert common_prefix(toks(5), toks(6)) == 0
    long = array("I", range(10_000))
    other = array("I", long)
    other[7_777] = 0
    assert common_prefix(long, other) == 7_777


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_matches_a_scan(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(array("I", a), array("I", b)) == n


def test_a_rollout_keeps_its_sequence_between_turns() -> None:
    index = KVIndex(slots=4, cells=1000, index_tokens=0)  # no index: only holders keep
    rollout = object()
    assert run(index, "k", toks(1, 2, 3), rollout) == 0
    # Its next turn: the context so far, its output fed back (999), then new tokens.
    assert run(index, "k", toks(1, 2, 3, 999, 7, 8), rollout) == 4
    assert index.stats.tokens_reused == 4


def test_the_last_token_is_always_evaluated() -> None:
    index = KVIndex(slots=2, cells=100, index_tokens=100)
    run(index, None, toks(1, 2, 3))
    plan = index.plan(None, toks(1, 2, 3))  # the same context again: all of it is cached
    assert plan is not None and plan.keep == 2


def test_without_an_index_a_finished_turn_nobody_keeps_is_dropped() -> None:
    index = KVIndex(slots=2, cells=100, index_tokens=0)
    run(index, None, toks(1, 2, 3))
    assert index.indexed_tokens == 0
    assert run(index, None, toks(1, 2, 3, 999, 4)) == 0


def test_the_index_serves_the_same_owner_only() -> None:
    index = KVIndex(slots=4, cells=100, index_tokens=100)
    run(index, "a", toks(1, 2, 3))
    assert run(index, "b", toks(1, 2, 3, 999, 4)) == 0
    assert run(index, "a", toks(1, 2, 3, 999, 4)) == 4


def test_releasing_a_holder_moves_its_sequence_to_the_index() -> None:
    index = KVIndex(slots=2, cells=100, index_tokens=100)
    lane = object()
    run(index, None, toks(1, 2, 3), lane)
    assert index.kept_tokens == 4 and index.indexed_tokens == 0
    assert index.release(lane) == []
    assert index.kept_tokens == 0 and index.indexed_tokens == 4


def test_the_index_budget_drops_the_least_recently_used() -> None:
    index = KVIndex(slots=4, cells=100, index_tokens=8)
    run(index, None, toks(1, 2, 3))  # holds 4
    run(index, None, toks(5, 6, 7))  # holds 4: 8 in all
    plan = index.plan(None, toks(9, 9, 9))
    assert plan is not None
    evicted = index.finish(plan.slot, toks(9, 9, 9, 999))
    assert len(evicted) == 1 and index.indexed_tokens == 8
    assert run(index, None, toks(1, 2, 3, 999, 4)) == 0  # the oldest went
    assert index.stats.evictions >= 1


def test_a_holder_keeps_one_sequence_its_newest() -> None:
    index = KVIndex(slots=4, cells=100, index_tokens=0)
    lane = object()
    run(index, None, toks(1, 2, 3), lane)
    run(index, None, toks(7, 8), lane)  # an unrelated conversation on the same lane
    assert index.kept_tokens == 3  # the first one's sequence went to the (empty) index


def test_another_holders_sequence_is_copied_not_taken() -> None:
    index = KVIndex(slots=4, cells=100, index_tokens=0)
    mine, theirs = object(), object()
    run(index, None, toks(1, 2, 3, 4), theirs)
    plan = index.plan(None, toks(1, 2, 3, 4, 999, 5), [mine])
    assert plan is not None
    assert plan.copy_from is not None and plan.keep == 5 and plan.slot is not plan.copy_from
    src, dst = plan.copy_from.seq, plan.slot.seq
    # (llama.cpp copies a sequence with cells of its own only whole: then cut to the prefix)
    assert plan.ops() == [("rm", dst, 0, -1), ("cp", src, dst, -1), ("rm", dst, 5, -1)]
    assert index.kept_tokens == 5  # theirs still holds its own


def test_a_full_pool_evicts_indexed_then_kept_and_waits_for_running() -> None:
    index = KVIndex(slots=4, cells=10, index_tokens=10)
    kept = object()
    run(index, None, toks(1, 2, 3), kept)  # kept: 4 cells
    run(index, None, toks(4, 5))  # indexed: 3 cells
    plan = index.plan(None, toks(6, 7, 8, 9))  # needs 4: 7 + 4 > 10 -> the indexed one goes
    assert plan is not None and len(plan.evict) == 1
    assert index.stats.evictions == 1 and index.stats.kept_evictions == 0
    running = plan
    plan = index.plan(None, toks(10, 11, 12, 13, 14))  # 4 kept + 4 running + 5 > 10
    assert plan is not None and index.stats.kept_evictions == 1
    assert index.plan(None, toks(20, 21)) is None  # only running turns hold the pool
    assert index.stats.waits == 1
    index.finish(running.slot, toks(6, 7, 8, 9, 999))
    assert index.plan(None, toks(20, 21)) is not None


def test_a_refused_plan_changes_nothing() -> None:
    index = KVIndex(slots=2, cells=10, index_tokens=10)
    first = index.plan(None, toks(1, 2, 3, 4, 5))
    run(index, None, toks(6, 7))
    assert first is not None
    before = [(s.seq, list(s.tokens), s.running) for s in index.slots]
    assert index.plan(None, toks(8, 9, 10, 11, 12, 13)) is None
    assert [(s.seq, list(s.tokens), s.running) for s in index.slots] == before


def test_a_dropped_sequence_is_forgotten() -> None:
    index = KVIndex(slots=2, cells=100, index_tokens=100)
    holder = object()
    plan = index.plan(None, toks(1, 2, 3), [holder])
    assert plan is not None
    index.drop(plan.slot)
    assert run(index, None, toks(1, 2, 3, 4)) == 0
    assert index.release(holder) == []


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["run", "release"]),
            st.integers(0, 2),  # holder
            st.lists(st.integers(0, 2), min_size=1, max_size=12),  # context
        ),
        max_size=30,
    )
)
def test_invariants_hold_under_any_sequence_of_turns(ops: list[tuple[str, int, list[int]]]) -> None:
    index = KVIndex(slots=3, cells=30, index_tokens=10)
    holders = [object(), object(), object()]
    for op, h, values in ops:
        context = array("I", values)
        if op == "release":
            index.release(holders[h])
        else:
            plan = index.plan("o", context, [holders[h]], reserve=1)
            if plan is None:
                continue
            # The kept prefix is really a prefix of the context, and of what the slot held.
            assert plan.slot.tokens == context[: plan.keep]
            assert plan.keep < len(context)
            done = array("I", context)
            done.append(7)
            index.finish(plan.slot, done, [holders[h]])
        assert index.cells_used <= index.cells
        assert index.indexed_tokens <= index.index_tokens
        assert sum(1 for s in index.slots if s.running) == 0
        kept = [s for s in index.slots if s.pins]
        assert all(s.tokens for s in kept)
