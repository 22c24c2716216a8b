"""API keys: who may call, and who owns what they store.

With keys configured, a request needs `Authorization: Bearer <key>` with one of them; its
owner (a hash of the key) scopes the stored responses it can see. Without keys auth is off
and the owner is None.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

__all__ = ["ApiKeys", "owner_of"]


def owner_of(key: str | None) -> str | None:
    """Stored responses belong to a hash of the API key that created them."""
    if key is None:
        return None
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class ApiKeys:
    """The configured API keys (none: auth is off)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = tuple(keys)

    def authenticate(self, headers: Mapping[str, str]) -> tuple[bool, str | None]:
        """(allowed, owner) for a request's headers (names lower-cased)."""
        if not self._keys:
            return True, None
        scheme, _, key = headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or key not in self._keys:
            return False, None
        return True, owner_of(key)
