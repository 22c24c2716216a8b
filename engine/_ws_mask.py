"""A WebSocket client's frames unmasked in C.

Every frame a client sends is masked (RFC 6455, 5.3): the server XORs its payload with a
4-byte key before it can read it. wsproto, under hypercorn, does it in Python
(`frame_protocol.XorMaskerSimple.process`: four strided `translate`s), on the event loop:
~0.8 ms per MiB on this project's 2-core VM, 0.44 ms for the 0.55 MB a client resending its
whole conversation sends at ~100k tokens. `websockets` (a maintained library) ships the same
operation in C, `websockets.speedups.apply_mask`: ~12 us for those 0.55 MB.

`unmask_in_c()` makes `XorMaskerSimple.process` call it, keeping the method's contract: the
payload XORed with the key, as a new `bytearray`, and the key rotated by the payload's length
mod 4 (a frame's payload arrives in pieces, each continuing the key where the last stopped).
The bytes are the same, so it is one idempotent patch for the whole process (wsproto's masker
serves every wsproto user in it, clients included, alike). Where `websockets` has no C
extension (a platform without its wheel), wsproto's own stays. `tests/test_ws_mask.py` holds
it to wsproto's own over random payloads, keys and pieces.
"""

from __future__ import annotations

from typing import Any

__all__ = ["unmask_in_c"]


def unmask_in_c() -> bool:
    """Unmask with `websockets`' C helper from now on; False when it is not available."""
    try:
        from websockets.speedups import apply_mask
    except ImportError:  # no C extension on this platform: wsproto's Python stays
        return False
    from wsproto import frame_protocol

    masker: Any = frame_protocol.XorMaskerSimple  # (untyped internals of wsproto)
    if getattr(masker.process, "_rollout_c", False):  # our mark: patched already
        return True

    def process(self: Any, data: bytearray) -> bytearray:
        if not data:
            return bytearray(data)
        key = self._masking_key
        unmasked = bytearray(apply_mask(data, key))
        turn = len(data) % 4
        self._masking_key = key[turn:] + key[:turn]
        return unmasked

    process._rollout_c = True  # type: ignore[attr-defined]
    masker.process = process
    return True
