"""Server-sent events, sans-IO: an encoder for what the server streams, and an incremental
decoder for what a client (or the engine, reading an upstream) receives.

The encoder writes one event as an `event: <type>` line, one `data: <JSON>` line per line of
data (compact JSON has none inside) and a blank line. The decoder follows the WHATWG
EventSource parsing rules (https://html.spec.whatwg.org/multipage/server-sent-events.html,
"Interpreting an event stream") as far as they matter here:

* lines end with CRLF, LF or CR, and a CRLF split across two `feed` calls is one line end;
* a line starting with `:` is a comment; `field: value` loses one leading space of `value`;
  a line without a colon is a field with an empty value;
* `data` lines of one event are joined with `\\n`; a blank line dispatches the event, unless
  it has no `data` line at all; `event` names it; `id` sets the last event id (kept across
  events); `retry` and unknown fields are ignored;
* a leading UTF-8 byte order mark is dropped; at the end of the stream an event that was
  not ended by a blank line is discarded (`end()` says whether that happened).

Payload conventions such as the chat-completions `[DONE]` sentinel are the caller's.

Every byte the decoder holds for an event that is not complete yet counts against a limit
(`max_event_size`): a peer that never ends a line, or an event, cannot grow it without bound.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from ._codec import encode_json
from ._errors import RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_SSE_EVENT_SIZE",
    "ServerSentEvent",
    "SseDecoder",
    "encode_sse",
    "encode_sse_event",
]

# The most bytes one server-sent event (its unfinished line plus the data of its earlier
# lines) may take before the decoder gives up on the peer. Streaming events are small (a
# delta); the largest is a terminal event carrying the whole response, so the bound is the
# WebSocket message limit's order of magnitude: 64 MiB.
DEFAULT_MAX_SSE_EVENT_SIZE = 64 * 1024 * 1024

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


@attrs.frozen(kw_only=True)
class ServerSentEvent:
    """One dispatched event: its `event` name (None when the stream named none, which the
    WHATWG rules call `message`), its `data` lines joined with `\\n`, and the last event
    `id` seen so far in the stream."""

    event: str | None = None
    data: str
    id: str | None = None


def encode_sse(data: str, *, event: str | None = None) -> bytes:
    """One event's bytes: an optional `event:` line, a `data:` line per line of `data`, a
    blank line."""
    head = f"event: {event}\n" if event is not None else ""
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"{head}{lines}\n".encode()


def encode_sse_event(event: Any) -> bytes:
    """A Responses streaming event as the server sends it: `event: <type>` and its JSON."""
    return f"event: {event.type}\ndata: {encode_json(event)}\n\n".encode()


class SseDecoder:
    """Incremental: `feed(bytes)` returns the events completed by those bytes, in order;
    `end()` is called once at the end of the stream. Splitting the input at any byte gives
    the same events."""

    def __init__(self, *, max_event_size: int = DEFAULT_MAX_SSE_EVENT_SIZE) -> None:
        self.max_event_size = max_event_size
        self._buffer = bytearray()  # bytes of the line not yet ended
        self._skip_lf = False  # the last line ended with CR: a following LF belongs to it
        self._started = False  # past a possible byte order mark
        self._event: str | None = None
        self._data: list[str] = []
        self._size = 0  # bytes of data held for the pending event
        self.last_event_id: str | None = None
        self.ended = False

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        if self.ended:
            raise RuntimeError("feed() after end()")
        if self._skip_lf and data:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        # What the buffer held is an unended line, free of line ends: scan only the new bytes
        # (a long event arriving in many chunks costs linear time, not quadratic).
        scan_from = len(self._buffer)
        self._buffer += data
        if not self._started:
            if len(self._buffer) < len(_BOM) and _BOM.startswith(self._buffer):
                return []  # maybe the start of a byte order mark
            self._started, scan_from = True, 0
            if self._buffer.startswith(_BOM):
                del self._buffer[: len(_BOM)]
        events: list[ServerSentEvent] = []
        start = 0
        buffer = self._buffer
        for match in _LINE_END.finditer(buffer, scan_from):
            end = match.start()
            if match.group() == b"\r" and match.end() == len(buffer):
                self._skip_lf = True  # a CRLF may be split across feeds
            self._line(bytes(buffer[start:end]), events)
            start = match.end()
        del buffer[:start]
        if len(buffer) + self._size > self.max_event_size:
            raise self._too_large()
        return events

    def end(self) -> list[ServerSentEvent]:
        """The stream ended. Returns nothing (an event needs its blank line); `truncated`
        tells whether an incomplete event or line was discarded."""
        self.ended = True
        return []

    @property
    def truncated(self) -> bool:
        """Bytes of an event not ended by a blank line are held (or were, at `end()`)."""
        return bool(self._buffer or self._data or self._event is not None)

    def _line(self, raw: bytes, events: list[ServerSentEvent]) -> None:
        if not raw:
            if self._data:
                events.append(
                    ServerSentEvent(
                        event=self._event, data="\n".join(self._data), id=self.last_event_id
                    )
                )
            self._event, self._data, self._size = None, [], 0
            return
        if raw[:1] == b":":
            return
        line = raw.decode("utf-8", "replace")
        field, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if field == "data":
            self._data.append(value)
            self._size += len(raw) + 1
            if self._size > self.max_event_size:
                raise self._too_large()
        elif field == "event":
            self._event = value or None
        elif field == "id":
            if "\x00" not in value:
                self.last_event_id = value

    def _too_large(self) -> RemoteProtocolError:
        return RemoteProtocolError.invalid(
            f"A server-sent event is larger than the limit of {self.max_event_size} bytes.",
            code="message_too_large",
        )
