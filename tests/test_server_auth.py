"""API-key checks (`engine/_auth.py`): who is let in, who owns what, and a comparison that
looks at every configured key whichever one matches."""

from __future__ import annotations

import hmac

import pytest
from rollout.engine import _auth
from rollout.engine._auth import ApiKeys, owner_of

KEYS = ("key-a", "key-b", "key-c")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_no_keys_means_auth_is_off() -> None:
    assert ApiKeys(()).authenticate({}) == (True, None)
    assert ApiKeys(()).authenticate(bearer("anything")) == (True, None)


@pytest.mark.parametrize("key", KEYS)
def test_each_configured_key_is_let_in_as_its_owner(key: str) -> None:
    assert ApiKeys(KEYS).authenticate(bearer(key)) == (True, owner_of(key))
    # The scheme is case-insensitive and the key may be padded with spaces.
    assert ApiKeys(KEYS).authenticate({"authorization": f"bearer   {key} "}) == (
        True,
        owner_of(key),
    )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": ""},
        bearer(""),
        bearer("key-"),
        bearer("key-a-"),
        bearer("KEY-A"),
        {"authorization": "Basic key-a"},
        {"authorization": "key-a"},
        bearer("k\xe9y"),  # a latin-1 header value, not a configured key
    ],
)
def test_anything_else_is_refused(headers: dict[str, str]) -> None:
    assert ApiKeys(KEYS).authenticate(headers) == (False, None)


def test_non_ascii_keys_compare_like_strings() -> None:
    keys = ApiKeys(("k\xe9y", "\udcff"))
    assert keys.authenticate(bearer("k\xe9y")) == (True, owner_of("k\xe9y"))
    assert keys.authenticate(bearer("key")) == (False, None)


@pytest.mark.parametrize("presented", [*KEYS, "wrong"])
def test_every_key_is_compared_whichever_matches(
    presented: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(_auth.hmac, "compare_digest", counting)
    ApiKeys(KEYS).authenticate(bearer(presented))
    assert len(calls) == len(KEYS)
    # Fixed-length digests: the comparison time does not depend on the key's length either.
    assert {len(a) for a, _ in calls} == {len(b) for _, b in calls} == {32}
