"""A request body handed on by h11 without copying it twice on the way.

h11 (0.14-0.16) keeps what a connection has received in a `bytearray`, and hands a body on by
`ReceiveBuffer.maybe_extract_at_most(count)`, which slices the bytes it returns out of that
buffer twice (once to see whether there are any, once more to return) before deleting them
from it: two copies of every body chunk, ~22 us for the 0.55 MB a stateless client sends at
~100k tokens, in one piece since the server reads up to 1 MiB at a time (`_read.py`).

`hand_on_whole_buffers()` makes the method hand over the buffer object itself when the chunk
is all of it (the usual case for a body: the head was taken before), a fresh empty buffer in
its place, and otherwise do what h11 does. The bytes returned, the type (`bytearray`) and
what stays buffered are h11's own, so it is one idempotent patch for the whole process (h11's
buffer serves every h11 user in it, the upstream client's responses included, alike).
`tests/test_h11_body.py` holds it to h11's own method and to h11's events over random
messages cut at random points.
"""

from __future__ import annotations

from typing import Any

__all__ = ["hand_on_whole_buffers"]


def hand_on_whole_buffers() -> None:
    """From now on h11 hands a body chunk that is its whole buffer on without copying."""
    from h11 import _receivebuffer

    buffer: Any = _receivebuffer.ReceiveBuffer  # (untyped internals of h11)
    if getattr(buffer.maybe_extract_at_most, "_rollout_whole", False):  # patched already
        return
    original = buffer.maybe_extract_at_most

    def maybe_extract_at_most(self: Any, count: int) -> bytearray | None:
        data = self._data
        if data and count >= len(data):
            self._data = bytearray()
            self._next_line_search = 0
            self._multiple_lines_search = 0
            return data  # type: ignore[no-any-return]
        return original(self, count)  # type: ignore[no-any-return]

    maybe_extract_at_most._rollout_whole = True  # type: ignore[attr-defined]
    buffer.maybe_extract_at_most = maybe_extract_at_most
