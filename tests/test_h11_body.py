"""h11 handing a whole buffer on without copying it (`engine/_h11_body.py`): the same bytes,
type and remaining buffer as h11's own method, the same events over random messages cut at
random points, no copy of a body that is the whole buffer, and the server installs it."""

from __future__ import annotations

import itertools
from typing import Any

import h11
from h11 import _receivebuffer
from hypothesis import given
from hypothesis import strategies as st
from rollout.engine import _serve
from rollout.engine._h11_body import hand_on_whole_buffers

ORIGINAL: Any = _receivebuffer.ReceiveBuffer.maybe_extract_at_most  # as imported
if getattr(ORIGINAL, "_rollout_whole", False):  # (another test's server patched it first)
    ORIGINAL = None


def _state(buffer: Any) -> tuple[bytes, int, int]:
    return bytes(buffer._data), buffer._next_line_search, buffer._multiple_lines_search


@given(
    pieces=st.lists(st.binary(max_size=40), max_size=5),
    counts=st.lists(st.integers(min_value=0, max_value=120), min_size=1, max_size=6),
)
def test_it_extracts_what_h11s_own_does(pieces: list[bytes], counts: list[int]) -> None:
    hand_on_whole_buffers()
    patched, plain = _receivebuffer.ReceiveBuffer(), _receivebuffer.ReceiveBuffer()
    for piece in pieces:
        patched += piece
        plain += piece
    plain.maybe_extract_next_line()  # a search position to reset
    patched.maybe_extract_next_line()
    for count in counts:
        got = patched.maybe_extract_at_most(count)
        expected = _h11s(plain, count)
        assert (None if got is None else bytes(got)) == (
            None if expected is None else bytes(expected)
        )
        assert type(got) is type(expected)
        assert _state(patched) == _state(plain)


def _h11s(buffer: Any, count: int) -> bytearray | None:
    """h11's own method where this process has it, else the same steps written out."""
    if ORIGINAL is not None:
        return ORIGINAL(buffer, count)  # type: ignore[no-any-return]
    out = buffer._data[:count]
    if not out:
        return None
    return buffer._extract(count)  # type: ignore[no-any-return]


def _events(message: bytes, cuts: list[int]) -> list[tuple[str, bytes]]:
    conn = h11.Connection(h11.SERVER)
    out: list[tuple[str, bytes]] = []
    edges = [0, *sorted(c % (len(message) + 1) for c in cuts), len(message)]
    for start, end in itertools.pairwise(edges):
        if start == end:
            continue  # (an empty piece is the end of the stream to h11)
        conn.receive_data(message[start:end])
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                break
            data = getattr(event, "data", b"")  # Data events carry bytes; others none
            out.append((type(event).__name__, bytes(data)))
    return out


@given(
    body=st.binary(max_size=3000),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=4),
)
def test_h11_gives_the_same_events_over_messages_cut_anywhere(body: bytes, cuts: list[int]) -> None:
    message = (
        b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )
    hand_on_whole_buffers()
    patched = _events(message, cuts)
    assert [e for e in patched if e[0] == "Request"]
    assert b"".join(d for kind, d in patched if kind == "Data") == body
    assert patched[-1][0] == "EndOfMessage"
    # The same events, Data chunk by chunk, as h11 without the patch.
    method: Any = _receivebuffer.ReceiveBuffer.maybe_extract_at_most
    if ORIGINAL is not None:
        _receivebuffer.ReceiveBuffer.maybe_extract_at_most = ORIGINAL  # type: ignore[method-assign]
        try:
            assert _events(message, cuts) == patched
        finally:
            _receivebuffer.ReceiveBuffer.maybe_extract_at_most = method  # type: ignore[method-assign]


def test_a_body_that_is_the_whole_buffer_is_handed_on_not_copied() -> None:
    hand_on_whole_buffers()
    body = b"x" * 550_000
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body))
    assert type(conn.next_event()).__name__ == "Request"
    conn.receive_data(body)
    held: Any = conn._receive_buffer._data  # (h11's internals: the buffer's bytearray)
    event = conn.next_event()
    assert isinstance(event, h11.Data) and event.data is held and bytes(event.data) == body


def test_the_server_installs_it() -> None:
    assert _serve.hand_on_whole_buffers is hand_on_whole_buffers
    hand_on_whole_buffers()
    hand_on_whole_buffers()  # idempotent
    assert getattr(_receivebuffer.ReceiveBuffer.maybe_extract_at_most, "_rollout_whole", False)
