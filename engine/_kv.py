"""The KV index: which llama.cpp sequence holds which tokens, and who keeps it.

A real model's context (`_llama_engine.py`) has `slots` sequences, each with its own KV cells
(`capacity` tokens: one sequence's numbers never depend on what the others hold). Each
sequence is a **slot** holding the KV of exactly its `tokens` (positions 0..n-1).
A slot is, at any time, one of:

    running   a turn evaluates on it (prefill, then a token per step): never matched, never
              evicted; it reserves the cells its turn may still fill
    kept      idle and pinned by a holder: a rollout between its turns (suspended at a tool
              call), or a WebSocket lane whose latest response it holds. Found first by that
              holder's next turn; evicted only when the pool is short (least recently used)
    indexed   idle, unpinned: found by any turn of the same owner whose context starts like it
              (an HTTP chain, a stateless resend, a reconnect). Their total is bounded by
              `index_tokens` (`--kv-cache-mb`); least recently used dropped first
    free      empty

`plan(owner, context, holders)` picks the slot a turn runs on and how much of its KV to keep:

    best = the idle slot of this owner with the longest common token prefix with `context`
           (ties: one pinned by the turn's own holders, then the most recently used)
    best unpinned, or pinned only by the turn's holders  -> run on it, keeping the prefix
    best pinned by another holder                        -> run on a free slot, copying its
                                                            KV (then cutting it to the prefix;
                                                            the other keeps its own)
    no match                                             -> a free slot, nothing kept
    then, while the pool (or the slot count) is short: evict indexed slots, then kept ones,
    least recently used first; None when only running turns hold it (the turn waits)

At least the context's last token is always evaluated (its logits sample the first output).
After the turn, `finish` records what the sequence now holds (the context and the sampled
tokens fed back) and pins it with the turn's holders; a holder keeps one slot per index (a
newer turn's slot replaces its older one). `release(holder)` unpins.

Pure bookkeeping, no llama.cpp and no clock: the caller applies a plan's operations on the
model's thread (`Plan.ops`). Memory: `cells` is the pool's size in tokens (every slot's
`capacity`, unless a shared pool is described: then a turn's cells come from the pool, and the
least recently used idle slots go when it is short).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import attrs

__all__ = ["KVIndex", "KVStats", "Plan", "Slot", "common_prefix"]


def common_prefix(a: array[int], b: array[int]) -> int:
    """The length of the longest common prefix of two token arrays (array slices compare in
    C; a binary search finds the first difference in O(log n) such comparisons)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@attrs.define(eq=False)
class Slot:
    """One sequence of the model's context."""

    seq: int
    tokens: array[int] = attrs.field(factory=lambda: array("I"))
    owner: str | None = None
    pins: set[object] = attrs.field(factory=set)  # holders keeping it
    running: bool = False
    reserved: int = 0  # cells a running turn may still fill (its context's rest, its output)
    used: int = 0  # the tick of its last use (least recently used goes first)

    @property
    def idle(self) -> bool:
        return not self.running


@attrs.frozen
class Plan:
    """Where a turn runs: `slot`, keeping the KV of `context[:keep]`; `copy_from` supplies
    that prefix from another slot first; `evict` lists sequences to clear before anything."""

    slot: Slot
    keep: int
    copy_from: Slot | None = None
    evict: tuple[int, ...] = ()

    def ops(self) -> list[tuple[str, int, int, int]]:
        """The sequence operations, in order: ("rm", seq, p0, p1) removes positions [p0, p1)
        (p1 -1: to the end), ("cp", src, dst, -1) copies the whole of src to dst (llama.cpp
        copies between sequences with cells of their own only whole)."""
        out = [("rm", seq, 0, -1) for seq in self.evict]
        dst = self.slot.seq
        if self.copy_from is not None:
            out.append(("rm", dst, 0, -1))
            if self.keep:
                out.append(("cp", self.copy_from.seq, dst, -1))
                out.append(("rm", dst, self.keep, -1))
        else:
            out.append(("rm", dst, self.keep, -1))
        return out


@attrs.define
class KVStats:
    """Counts of the KV index (exported on /metrics)."""

    hits: int = 0  # turns that kept a cached prefix
    misses: int = 0  # turns that kept nothing
    tokens_reused: int = 0  # context tokens whose KV was kept instead of evaluated
    copies: int = 0  # prefixes copied from a slot another holder keeps
    evictions: int = 0  # indexed slots dropped (budget or pool)
    kept_evictions: int = 0  # kept slots dropped because the pool was short
    waits: int = 0  # plans refused because running turns hold the whole pool


class KVIndex:
    """Slots of one model's context (see the module docstring). Single-task: the event loop
    calls it, never the model's thread."""

    def __init__(
        self, *, slots: int, cells: int, index_tokens: int, capacity: int | None = None
    ) -> None:
        if slots < 1 or cells < 1 or index_tokens < 0:
            raise ValueError("the KV index needs slots >= 1, cells >= 1, index_tokens >= 0")
        self.cells = cells
        self.capacity = cells if capacity is None else capacity  # tokens one slot holds
        self.index_tokens = index_tokens
        self.slots = [Slot(seq) for seq in range(slots)]
        self.stats = KVStats()
        self._tick = 0
        self._kept: dict[object, Slot] = {}  # holder -> the slot it keeps

    # --- accounting ------------------------------------------------------------------------

    @property
    def cells_used(self) -> int:
        return sum(len(s.tokens) + s.reserved for s in self.slots)

    @property
    def indexed_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.slots if s.idle and not s.pins)

    @property
    def kept_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.slots if s.idle and s.pins)

    @property
    def running(self) -> int:
        return sum(1 for s in self.slots if s.running)

    # --- a turn ----------------------------------------------------------------------------

    def plan(
        self,
        owner: str | None,
        context: array[int],
        holders: Sequence[object] = (),
        *,
        reserve: int = 0,
    ) -> Plan | None:
        """The slot a turn on `context` runs on (marked running), or None when running turns
        hold the pool (wait for one to finish). `reserve`: cells the turn's output may fill.
        Raises ValueError when the turn could never fit the pool."""
        if not context:
            raise ValueError("a turn needs at least one context token")
        need = len(context) + reserve
        if need > min(self.cells, self.capacity):
            room = min(self.cells, self.capacity)
            raise ValueError(f"a turn of {need} tokens does not fit a sequence of {room}")
        mine = set(holders)
        best, keep = self._best(owner, context, mine)
        keep = min(keep, len(context) - 1)  # the last token is evaluated: its logits sample
        copy_from: Slot | None = None
        slot: Slot | None = best
        if best is not None and keep == 0:
            slot = None
        elif best is not None and not best.pins <= mine:
            copy_from, slot = best, None  # another holder keeps it: copy its prefix
        # Decide everything before changing anything: a plan refused changes nothing.
        order = self._victims(protected={copy_from} if copy_from is not None else set())
        if slot is None:
            slot = next((s for s in self.slots if s.idle and not s.tokens and not s.pins), None)
            if slot is None:
                if not order:
                    self.stats.waits += 1
                    return None
                slot = order.pop(0)  # the least recently used idle slot becomes this turn's
        victims = [slot] if slot is not best and slot.tokens else []
        used = self.cells_used - len(slot.tokens) + need
        for victim in order:
            if used <= self.cells:
                break
            if victim is slot:
                continue
            victims.append(victim)
            used -= len(victim.tokens)
        if used > self.cells:
            self.stats.waits += 1
            return None
        evicted = tuple(self._evict(v) for v in victims if v is not slot)
        if slot in victims:
            self._evict(slot)
        self._tick += 1
        for holder in [h for h, s in self._kept.items() if s is slot]:
            del self._kept[holder]
        slot.pins.clear()
        kept_tokens = (copy_from if copy_from is not None else slot).tokens[:keep]
        slot.tokens = array("I", kept_tokens)
        slot.owner = owner
        slot.running = True
        slot.reserved = need - keep  # the rest of its context, then its output
        slot.used = self._tick
        if keep:
            self.stats.hits += 1
            self.stats.tokens_reused += keep
        else:
            self.stats.misses += 1
        if copy_from is not None and keep:
            self.stats.copies += 1
        return Plan(slot=slot, keep=keep, copy_from=copy_from if keep else None, evict=evicted)

    def finish(self, slot: Slot, tokens: array[int], holders: Iterable[object] = ()) -> list[int]:
        """A turn ended: `slot` holds the KV of `tokens` (its kept prefix, what it evaluated);
        it is pinned by `holders`. Returns the sequences to clear (evicted for the index's
        budget)."""
        self._tick += 1
        slot.running = False
        slot.reserved = 0
        slot.tokens = tokens
        slot.used = self._tick
        for holder in holders:
            previous = self._kept.get(holder)
            if previous is not None and previous is not slot:
                previous.pins.discard(holder)
            self._kept[holder] = slot
            slot.pins.add(holder)
        return self._enforce_index()

    def release(self, holder: object) -> list[int]:
        """The holder's scope ended (its rollout finished, its connection closed): its slot
        joins the index. Returns the sequences to clear."""
        slot = self._kept.pop(holder, None)
        if slot is None:
            return []
        slot.pins.discard(holder)
        return self._enforce_index()

    def drop(self, slot: Slot) -> None:
        """Forget what a slot holds (its turn failed midway: its KV is unknown)."""
        slot.running = False
        slot.reserved = 0
        slot.tokens = array("I")
        for holder in [h for h, s in self._kept.items() if s is slot]:
            del self._kept[holder]
        slot.pins.clear()

    # --- helpers -----------------------------------------------------------------------------

    def _best(
        self, owner: str | None, context: array[int], mine: set[object]
    ) -> tuple[Slot | None, int]:
        best: Slot | None = None
        best_key = (0, False, 0)
        for slot in self.slots:
            if slot.running or not slot.tokens or slot.owner != owner:
                continue
            n = common_prefix(slot.tokens, context)
            key = (n, bool(slot.pins & mine), slot.used)
            if n and key > best_key:
                best, best_key = slot, key
        return best, best_key[0]

    def _victims(self, protected: set[Slot]) -> list[Slot]:
        """Idle slots holding tokens, in eviction order: indexed before kept, least recently
        used first."""
        candidates = [s for s in self.slots if s.idle and s.tokens and s not in protected]
        return sorted(candidates, key=lambda s: (bool(s.pins), s.used))

    def _evict(self, slot: Slot) -> int:
        if slot.pins:
            self.stats.kept_evictions += 1
        else:
            self.stats.evictions += 1
        self.drop(slot)
        return slot.seq

    def _enforce_index(self) -> list[int]:
        evicted: list[int] = []
        while self.indexed_tokens > self.index_tokens:
            indexed = [s for s in self.slots if s.idle and s.tokens and not s.pins]
            evicted.append(self._evict(min(indexed, key=lambda s: s.used)))
        return evicted
