"""A connection's cache of response states, for `previous_response_id` continuation."""

from __future__ import annotations

from collections import OrderedDict

from ._state import ResponseState

__all__ = ["DEFAULT_CACHE_RESPONSES", "DEFAULT_CACHE_TOKENS", "ResponseCache"]

# Responses a connection keeps for previous_response_id continuation. OpenAI keeps the most
# recent one; a few more let a client retry or fork from an earlier turn without the store.
DEFAULT_CACHE_RESPONSES = 8
# Total rendered tokens a connection's cache may hold (about 4 bytes each, plus items): bounds
# memory per connection at roughly 100 MB for the largest contexts.
DEFAULT_CACHE_TOKENS = 8_000_000


class ResponseCache:
    """A connection's ResponseStates, least recently used evicted first, bounded by count and
    by the rendered tokens held (lineages shared by several states are counted once)."""

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

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._states

    def get(self, response_id: str) -> ResponseState | None:
        state = self._states.get(response_id)
        if state is not None:
            self._states.move_to_end(response_id)
        return state

    def put(self, state: ResponseState) -> None:
        self._states[state.id] = state
        self._states.move_to_end(state.id)
        while len(self._states) > self.max_responses or (
            len(self._states) > 1 and self.tokens_held() > self.max_tokens
        ):
            self._states.popitem(last=False)

    def evict(self, response_id: str) -> None:
        self._states.pop(response_id, None)

    def tokens_held(self) -> int:
        lineages = {id(s.lineage): s.lineage for s in self._states.values()}
        return sum(len(lin.tokens) for lin in lineages.values())
