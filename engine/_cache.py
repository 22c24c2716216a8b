"""A connection's cache of response states, for `previous_response_id` continuation.

It follows the connection's lanes (`stream_id`, PROTOCOL.md WS-7): each state remembers the
lane that made it (or, for a state loaded from the store, the lane that asked for it), and
- the latest response of each lane stays cached (the count bound evicts other states first),
  so a lane's next turn finds its parent however busy the other lanes are;
- a continuation on any lane may fork from a state made on another;
- a failed continuation evicts its parent (OpenAI's rule) only when it ran on the parent's own
  lane: a fork that fails on another lane keeps the shared parent (`discard_failed_parent`).
"""

from __future__ import annotations

from collections import OrderedDict

from ._state import ResponseState

__all__ = ["DEFAULT_CACHE_RESPONSES", "DEFAULT_CACHE_TOKENS", "ResponseCache"]

# Responses a connection keeps for previous_response_id continuation, besides the latest of
# each lane. OpenAI keeps the most recent one per lane; a few more let a client retry or fork
# from an earlier turn without the store.
DEFAULT_CACHE_RESPONSES = 8
# Total rendered tokens a connection's cache may hold (about 4 bytes each, plus items): bounds
# memory per connection at roughly 100 MB for the largest contexts. A hard bound: past it even
# a lane's latest response goes (least recently used first).
DEFAULT_CACHE_TOKENS = 8_000_000


class ResponseCache:
    """A connection's ResponseStates, least recently used evicted first, bounded by count (the
    latest state of each lane excepted: at most one per lane more) and by the rendered tokens
    held (lineages shared by several states are counted once)."""

    def __init__(
        self,
        max_responses: int = DEFAULT_CACHE_RESPONSES,
        max_tokens: int = DEFAULT_CACHE_TOKENS,
    ) -> None:
        if max_responses < 1:
            raise ValueError("max_responses must be >= 1")
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self._states: OrderedDict[str, ResponseState] = OrderedDict()
        self._lane_of: dict[str, str | None] = {}  # response id -> the lane it belongs to
        self._latest: dict[str | None, str] = {}  # lane -> its latest response (kept)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._states

    def get(self, response_id: str) -> ResponseState | None:
        state = self._states.get(response_id)
        if state is not None:
            self._states.move_to_end(response_id)
        return state

    def put(self, state: ResponseState, *, lane: str | None = None, latest: bool = False) -> None:
        """Cache `state`, belonging to `lane` (None: the default lane); `latest`: it is the
        newest response made on that lane (kept while the lane makes no newer one)."""
        self._states[state.id] = state
        self._states.move_to_end(state.id)
        self._lane_of[state.id] = lane
        if latest:
            self._latest[lane] = state.id
        self._shrink()

    def evict(self, response_id: str) -> None:
        self._states.pop(response_id, None)
        lane = self._lane_of.pop(response_id, None)
        if self._latest.get(lane) == response_id:
            del self._latest[lane]

    def discard_failed_parent(self, parent_id: str, lane: str | None) -> None:
        """A continuation of `parent_id` on `lane` failed: the parent is evicted, unless it
        belongs to another lane (a failed fork keeps the parent its own lane continues)."""
        if self._lane_of.get(parent_id, lane) == lane:
            self.evict(parent_id)

    def tokens_held(self) -> int:
        lineages = {id(s.lineage): s.lineage for s in self._states.values()}
        return sum(len(lin.tokens) for lin in lineages.values())

    def _shrink(self) -> None:
        kept = set(self._latest.values())
        while len(self._states) > 1:
            over_tokens = self.tokens_held() > self.max_tokens
            if not over_tokens and len(self._states) <= self.max_responses:
                return
            victim = next((rid for rid in self._states if rid not in kept), None)
            if victim is None:  # only lanes' latest responses are left
                if not over_tokens:
                    return
                victim = next(iter(self._states))
            self.evict(victim)
