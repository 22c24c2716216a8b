"""A request body handed on by h11 as the bytes the server read, not copied on the way.

h11 (0.14-0.16) keeps what a connection has received in a `bytearray` (`ReceiveBuffer`): each
`receive_data` copies the bytes read into it, and a body chunk is handed on by
`maybe_extract_at_most(count)`, which slices it out of that buffer twice (once to see whether
there are any, once more to return) before deleting them from it. hypercorn then makes the
chunk `bytes` again for the ASGI message (`bytes(event.data)`): four copies of a body, ~0.1 ms
or more for the 0.55 MB a stateless client sends at ~100k tokens.

`WholeReceiveBuffer` is h11's buffer with two shortcuts, and otherwise h11's own methods:
- bytes received into an empty buffer are held as they are (the `bytes` object the server
  read), turned into h11's `bytearray` only when more bytes join them or part of them is taken
  (a request's head: the server hands a head on by itself, `_http_limits._hand_over`);
- a chunk that is all the buffer holds is handed on as the object held, an empty buffer in its
  place.
A body that arrives after its head, in one read, is then the same `bytes` object from the
socket read to the app (hypercorn's `bytes()` of a `bytes` is no copy); what h11 parses and what
stays buffered are h11's own.

`hand_on_whole_buffers()` makes h11's connections use it (h11's `Connection` creates its buffer
from the name `ReceiveBuffer` in `h11._connection`): one idempotent patch for the process,
serving every h11 user in it alike, the upstream client's responses included; connections made
before it keep h11's class. `tests/test_h11_body.py` holds it to h11's class over random
operations and to h11's events over random messages cut at random points.
"""

from __future__ import annotations

from typing import Any

from h11 import _connection, _receivebuffer

__all__ = ["WholeReceiveBuffer", "hand_on_whole_buffers"]


class WholeReceiveBuffer(_receivebuffer.ReceiveBuffer):
    """h11's receive buffer, holding bytes received into it when empty as they are, and
    handing a chunk that is all it holds on as the object it holds (module docstring)."""

    # h11's `_data` is a bytearray; here it may also be the bytes first received into it.
    _data: Any

    def __iadd__(self, byteslike: bytes | bytearray) -> WholeReceiveBuffer:
        if not self._data and type(byteslike) is bytes:
            self._data = byteslike
            return self
        if type(self._data) is bytes:
            self._data = bytearray(self._data)
        self._data += byteslike
        return self

    def _extract(self, count: int) -> bytearray:
        if type(self._data) is bytes:
            self._data = bytearray(self._data)
        return super()._extract(count)

    def maybe_extract_at_most(self, count: int) -> Any:
        data = self._data
        if data and count >= len(data):
            self._data = bytearray()
            self._next_line_search = 0
            self._multiple_lines_search = 0
            return data
        return super().maybe_extract_at_most(count)


def hand_on_whole_buffers() -> None:
    """From now on, h11's new connections receive into a `WholeReceiveBuffer`."""
    module: Any = _connection  # (h11's internals: the name its Connection instantiates)
    module.ReceiveBuffer = WholeReceiveBuffer
