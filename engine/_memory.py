"""In-memory store (and the base of the in-memory ledger): the same rules as the SQLite ones
(owner isolation, chains, idempotent writes), for tests and for embedding without a disk."""

from __future__ import annotations

from types import TracebackType
from typing import Self

import trio
from rollout.protocol import Item

from ._interfaces import StoredResponse
from ._store import MAX_CHAIN_DEPTH, _broken_chain, _check_depth, _is_end, _not_stored

__all__ = ["MemoryResource", "MemoryResponseStore"]


class MemoryResource:
    """What the in-memory store and ledger share: closing, and a checkpoint that refuses use
    after close (as their SQLite counterparts do)."""

    _what = "resource"

    def __init__(self) -> None:
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"the {self._what} is closed")

    async def _checkpoint(self) -> None:
        self._check_open()
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._closed = True
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class MemoryResponseStore(MemoryResource):
    """A `ResponseStore` in a dict, with the same semantics as `SQLiteResponseStore`. Values
    are kept as given (not copied): treat stored responses as immutable."""

    _what = "response store"

    def __init__(self) -> None:
        super().__init__()
        self._responses: dict[str, StoredResponse] = {}

    def _visible(self, response_id: str | None, owner: str | None) -> StoredResponse | None:
        stored = self._responses.get(response_id) if response_id is not None else None
        return stored if stored is not None and stored.owner == owner else None

    async def put(self, stored: StoredResponse) -> None:
        await self._checkpoint()
        response_id = stored.response.id
        old = self._responses.get(response_id)
        if old is not None and old.owner != stored.owner:
            raise ValueError(f"response {response_id!r} is already stored under another owner")
        self._responses[response_id] = stored

    async def get(self, response_id: str, *, owner: str | None) -> StoredResponse | None:
        await self._checkpoint()
        return self._visible(response_id, owner)

    async def delete(self, response_id: str, *, owner: str | None) -> bool:
        await self._checkpoint()
        if self._visible(response_id, owner) is None:
            return False
        del self._responses[response_id]
        return True

    async def get_item(self, item_id: str, *, owner: str | None) -> Item | None:
        """See `SQLiteResponseStore.get_item` (a scan: the memory store is for tests)."""
        await self._checkpoint()
        for stored in self._responses.values():
            if stored.owner == owner:
                for item in stored.items:
                    if item.id == item_id:
                        return item
        return None

    async def get_chain(
        self, response_id: str, *, owner: str | None, max_depth: int = MAX_CHAIN_DEPTH
    ) -> list[StoredResponse]:
        """See `SQLiteResponseStore.get_chain`."""
        _check_depth(max_depth)
        await self._checkpoint()
        chain: list[StoredResponse] = []
        stored = self._visible(response_id, owner)
        while stored is not None:
            chain.append(stored)
            if _is_end(stored) or len(chain) >= max_depth:
                break
            stored = self._visible(stored.parent_id, owner)
        if not chain:
            raise _not_stored(response_id)
        if not _is_end(chain[-1]):
            last = chain[-1]
            raise _broken_chain(
                response_id, len(chain), last.response.id, last.parent_id, max_depth
            )
        return chain

    async def count(self) -> int:
        await self._checkpoint()
        return len(self._responses)
