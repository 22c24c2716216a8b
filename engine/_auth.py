"""API keys: who may call, and who owns what they store.

With keys configured, a request needs `Authorization: Bearer <key>` with one of them; its
owner (a hash of the key) scopes the stored responses it can see. Without keys auth is off
and the owner is None. The presented key is compared with every configured key in constant
time (`hmac.compare_digest` over SHA-256 digests, so lengths do not leak either), all of
them, whichever matches.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence

__all__ = ["ApiKeys", "owner_of"]


def owner_of(key: str | None) -> str | None:
    """Stored responses belong to a hash of the API key that created them."""
    if key is None:
        return None
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _digest(key: str) -> bytes:
    # Header values are decoded as latin-1 and configured keys may carry surrogate escapes:
    # any str encodes, and equal strings give equal digests.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """The configured API keys (none: auth is off)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = tuple(_digest(key) for key in keys)

    def authenticate(self, headers: Mapping[str, str]) -> tuple[bool, str | None]:
        """(allowed, owner) for a request's headers (names lower-cased)."""
        if not self._digests:
            return True, None
        scheme, _, key = headers.get("authorization", "").partition(" ")
        key = key.strip()
        presented = _digest(key)
        matched = False
        for digest in self._digests:  # no early exit: the time does not say which key
            matched |= hmac.compare_digest(presented, digest)
        if scheme.lower() != "bearer" or not matched:
            return False, None
        return True, owner_of(key)
