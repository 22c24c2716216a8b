"""The server-sent-events codec: the encoder's bytes, and the incremental decoder against the
WHATWG rules (multi-line data, CR / LF / CRLF line ends, comments, the `event` and `id`
fields, one leading space stripped, a trailing incomplete event discarded), split at every
byte boundary and at generated ones, and its buffer limit.

`test_a_decoder_blind_to_split_crlf_is_caught` shows the chunking property failing against a
deliberately broken decoder (one that forgets a CR ended the previous chunk's line).
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rollout import protocol as p

SAMPLE = (
    b"\xef\xbb\xbf: a comment\r\n"
    b"event: response.output_text.delta\r\n"
    b'data: {"a":\r\n'
    b"data:1}\r\n"
    b"\r\n"
    b"id: 7\n"
    b"data\n"
    b"data:  two spaces\n"
    b"\n"
    b"event: ignored without data\r"
    b"\r"
    b"retry: 10\r"
    b"unknown: x\r"
    b"data: [DONE]\r"
    b"\r"
    b"data: never ended"
)
EXPECTED = [
    p.ServerSentEvent(event="response.output_text.delta", data='{"a":\n1}'),
    p.ServerSentEvent(data="\n two spaces", id="7"),
    p.ServerSentEvent(data="[DONE]", id="7"),
]


def decode(chunks: list[bytes], decoder: p.SseDecoder | None = None) -> list[p.ServerSentEvent]:
    decoder = decoder or p.SseDecoder()
    events = [e for chunk in chunks for e in decoder.feed(chunk)]
    return events + decoder.end()


def test_the_rules() -> None:
    decoder = p.SseDecoder()
    assert decode([SAMPLE], decoder) == EXPECTED
    assert decoder.truncated  # "data: never ended" had no blank line


def test_every_split_point_gives_the_same_events() -> None:
    for cut in range(len(SAMPLE) + 1):
        assert decode([SAMPLE[:cut], SAMPLE[cut:]]) == EXPECTED, cut
    assert decode([SAMPLE[i : i + 1] for i in range(len(SAMPLE))]) == EXPECTED


@given(st.lists(st.integers(0, len(SAMPLE)), max_size=8))
def test_arbitrary_chunking_gives_the_same_events(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(SAMPLE)]
    assert decode([SAMPLE[a:b] for a, b in itertools.pairwise(bounds)]) == EXPECTED


@given(
    st.lists(
        st.text(
            st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=20
        ),
        min_size=1,
    ),
    st.sampled_from([None, "response.completed"]),
    st.sampled_from(["\n", "\r", "\r\n"]),
)
def test_encoded_events_round_trip(lines: list[str], name: str | None, newline: str) -> None:
    data = "\n".join(lines)
    wire = p.encode_sse(data, event=name).replace(b"\n", newline.encode())
    assert decode([wire]) == [p.ServerSentEvent(event=name, data=data)]


def test_the_server_event_encoding_is_unchanged() -> None:
    event = p.OutputTextDelta(
        sequence_number=3, item_id="msg_1", output_index=0, content_index=0, delta="hé\n"
    )
    wire = p.encode_sse_event(event)
    assert wire == f"event: {event.type}\ndata: {p.encode_json(event)}\n\n".encode()
    (decoded,) = decode([wire])
    assert decoded.event == event.type
    assert p.decode_server_event(decoded.data, sse=True) == event
    assert json.loads(decoded.data)["delta"] == "hé\n"


def test_the_buffer_is_bounded() -> None:
    decoder = p.SseDecoder(max_event_size=64)
    assert decoder.feed(b"data: " + b"x" * 40 + b"\n\n")
    with pytest.raises(p.RemoteProtocolError, match="limit of 64 bytes"):
        decoder.feed(b"data: " + b"x" * 70)  # one line that never ends
    decoder = p.SseDecoder(max_event_size=64)
    with pytest.raises(p.RemoteProtocolError) as caught:
        for _ in range(10):  # many short lines of one event that never ends
            decoder.feed(b"data: 0123456789\n")
    assert caught.value.code == "message_too_large"


class _CrBlindDecoder(p.SseDecoder):
    """Broken on purpose: treats every feed as starting a fresh line, so a CRLF split
    between two chunks is read as CR, then an empty line (which dispatches)."""

    def feed(self, data: bytes) -> list[p.ServerSentEvent]:
        self._skip_lf = False
        return super().feed(data)


def test_a_decoder_blind_to_split_crlf_is_caught() -> None:
    cut = SAMPLE.index(b'{"a":\r\n') + len(b'{"a":\r')
    assert decode([SAMPLE[:cut], SAMPLE[cut:]]) == EXPECTED
    broken = decode([SAMPLE[:cut], SAMPLE[cut:]], _CrBlindDecoder())
    assert broken != EXPECTED
    assert broken[0] == p.ServerSentEvent(event="response.output_text.delta", data='{"a":')
