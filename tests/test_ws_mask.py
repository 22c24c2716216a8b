"""Client frames unmasked in C (`engine/_ws_mask.py`): the same bytes and the same key
rotation as wsproto's own masker, payload after payload, whatever the pieces a frame arrives
in; and the server installs it."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from rollout.engine._ws_mask import unmask_in_c
from wsproto import frame_protocol

ORIGINAL: Any = frame_protocol.XorMaskerSimple.process  # as imported, before any patch
if getattr(ORIGINAL, "_rollout_c", False):  # (another test's server patched it first)
    ORIGINAL = None


def _wsprotos(key: bytes, pieces: list[bytes]) -> tuple[list[bytes], bytes]:
    """wsproto's own XOR (its Python, written out as it does it) of `pieces` in turn."""
    masking_key = bytearray(key)
    out = []
    for piece in pieces:
        data = bytearray(piece)
        out.append(bytes(b ^ masking_key[i % 4] for i, b in enumerate(data)))
        turn = len(data) % 4
        masking_key = masking_key[turn:] + masking_key[:turn]
    return out, bytes(masking_key)


@given(
    key=st.binary(min_size=4, max_size=4),
    pieces=st.lists(st.binary(max_size=64), max_size=6),
)
def test_the_c_masker_gives_wsprotos_bytes_and_rotation(key: bytes, pieces: list[bytes]) -> None:
    assert unmask_in_c()
    masker = frame_protocol.XorMaskerSimple(bytearray(key))
    got = [masker.process(bytearray(piece)) for piece in pieces]
    expected, final_key = _wsprotos(key, pieces)
    assert [bytes(g) for g in got] == expected
    assert all(isinstance(g, bytearray) for g in got)
    assert bytes(masker._masking_key) == final_key


def test_a_large_frame_in_pieces_matches_wsproto() -> None:
    """0.5 MB in pieces of odd sizes, against wsproto's original method where this process has
    it (the C masker is then compared with wsproto's code itself, not a rewrite of it)."""
    payload = bytes(range(256)) * 2048
    cuts = [0, 3, 70_001, 300_002, len(payload)]
    pieces = [payload[a:b] for a, b in itertools.pairwise(cuts)]
    key = b"\x13\x37\xbe\xef"
    assert unmask_in_c()
    fast = frame_protocol.XorMaskerSimple(bytearray(key))
    got = b"".join(bytes(fast.process(bytearray(p))) for p in pieces)
    if ORIGINAL is not None:
        slow = frame_protocol.XorMaskerSimple(bytearray(key))
        assert got == b"".join(bytes(ORIGINAL(slow, bytearray(p))) for p in pieces)
        assert fast._masking_key == slow._masking_key
    expected, _ = _wsprotos(key, pieces)
    assert got == b"".join(expected)


def test_the_server_unmasks_in_c() -> None:
    """`serve` installs it (the same call every server start makes), and again is harmless."""
    from rollout.engine import _serve

    assert _serve.unmask_in_c is unmask_in_c
    assert unmask_in_c() and unmask_in_c()
    assert getattr(frame_protocol.XorMaskerSimple.process, "_rollout_c", False)
