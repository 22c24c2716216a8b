"""h11's receive buffer holding and handing on the bytes received as they are
(`engine/_h11_body.py`): the same answers and remaining buffer as h11's own class over random
operations, the same events over random messages cut at random points, a body received after
its head handed on as the object received, and the server installs it."""

from __future__ import annotations

import itertools
from typing import Any

import h11
from h11 import _connection, _receivebuffer
from hypothesis import given
from hypothesis import strategies as st
from rollout.engine import _serve
from rollout.engine._h11_body import WholeReceiveBuffer, hand_on_whole_buffers

H11S: Any = _receivebuffer.ReceiveBuffer  # h11's own class (the patch replaces a name only)

_chunks = st.binary(max_size=40).map(lambda b: b.replace(b"x", b"\r\n"))
_operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), _chunks, st.booleans()),  # bytes, or a bytearray
        st.tuples(st.just("at_most"), st.integers(min_value=0, max_value=120)),
        st.tuples(st.just("next_line")),
        st.tuples(st.just("lines")),
        st.tuples(st.just("invalid")),
        st.tuples(st.just("bytes")),
    ),
    max_size=12,
)


def _apply(buffer: Any, operation: tuple[Any, ...]) -> Any:
    """One operation on a buffer, and its answer in comparable form."""
    name = operation[0]
    if name == "add":
        buffer += operation[1] if operation[2] else bytearray(operation[1])
        return len(buffer)
    if name == "at_most":
        got = buffer.maybe_extract_at_most(operation[1])
        return None if got is None else bytes(got)
    if name == "next_line":
        got = buffer.maybe_extract_next_line()
        return None if got is None else bytes(got)
    if name == "lines":
        lines = buffer.maybe_extract_lines()
        # h11 edits the lines in place: they must be bytearrays, as h11's own
        return None if lines is None else [(type(line), bytes(line)) for line in lines]
    if name == "invalid":
        return buffer.is_next_line_obviously_invalid_request_line()
    return bytes(buffer)


def _state(buffer: Any) -> tuple[bytes, int, int, bool]:
    return bytes(buffer), buffer._next_line_search, buffer._multiple_lines_search, bool(buffer)


@given(operations=_operations)
def test_it_answers_as_h11s_own_buffer(operations: list[tuple[Any, ...]]) -> None:
    ours, theirs = WholeReceiveBuffer(), H11S()
    for operation in operations:
        assert _apply(ours, operation) == _apply(theirs, operation)
        assert _state(ours) == _state(theirs)


def _events(message: bytes, cuts: list[int], buffer: type[Any]) -> list[tuple[str, bytes]]:
    """h11's events for `message` received in pieces cut at `cuts`, its connection's buffer
    of class `buffer`."""
    saved = _connection.ReceiveBuffer
    _connection.ReceiveBuffer = buffer  # type: ignore[attr-defined]
    try:
        conn = h11.Connection(h11.SERVER)
    finally:
        _connection.ReceiveBuffer = saved  # type: ignore[attr-defined]
    assert type(conn._receive_buffer) is buffer
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
    chunked=st.booleans(),
)
def test_h11_gives_the_same_events_over_messages_cut_anywhere(
    body: bytes, cuts: list[int], chunked: bool
) -> None:
    head = b"POST /v1/responses HTTP/1.1\r\nhost: x\r\n"
    if chunked:
        half = len(body) // 2
        parts = [body[:half], body[half:]]
        message = head + b"transfer-encoding: chunked\r\n\r\n"
        message += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"
    else:
        message = head + b"content-length: %d\r\n\r\n" % len(body) + body
    ours = _events(message, cuts, WholeReceiveBuffer)
    assert [e for e in ours if e[0] == "Request"]
    assert b"".join(d for kind, d in ours if kind == "Data") == body
    assert ours[-1][0] == "EndOfMessage"
    assert ours == _events(message, cuts, H11S)


def test_a_body_after_its_head_is_handed_on_as_the_bytes_received() -> None:
    """The bytes object the server read is the Data event's (h11's own class copies it into
    its buffer, and slices it out again)."""
    hand_on_whole_buffers()
    body = b"x" * 550_000
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body))
    assert type(conn.next_event()).__name__ == "Request"
    conn.receive_data(body)
    event = conn.next_event()
    assert isinstance(event, h11.Data) and event.data is body
    assert isinstance(conn.next_event(), h11.EndOfMessage)


def test_the_server_installs_it() -> None:
    assert _serve.hand_on_whole_buffers is hand_on_whole_buffers
    hand_on_whole_buffers()
    hand_on_whole_buffers()  # idempotent
    assert _connection.ReceiveBuffer is WholeReceiveBuffer
    assert type(h11.Connection(h11.SERVER)._receive_buffer) is WholeReceiveBuffer
