"""The input memo: a stateless client's request decoded in the time of what is new in it.

Long because it must give exactly the protocol decoder's answer: every path it takes falls back
to that decoder on anything unusual, and its bounds are kept per owner.

A client without `previous_response_id` (HTTP, or a WebSocket `response.create` with the whole
input) sends its whole conversation every turn: at ~100k tokens, ~0.5 MB of JSON, of which a
few KB are new. Parsing it all and structuring every item (cattrs) cost ~5 ms a turn, and
keying every item for the render cache ~1 ms more. This module makes it cost what is new:

1. The body is split, not parsed: msgspec's decoder validates the whole JSON text (strictly:
   syntax, escapes, UTF-8) and hands back each top-level value as raw bytes (~0.25 ms/MB).
2. The `input` array's raw text is compared with what this owner sent before: each entry of
   the memo is the raw text of an earlier request's input up to the end of its last item,
   with the items it decoded to and their content keys (`_itemkey.py`). An input that starts
   with an entry's bytes, at an item boundary, has those items: only the rest is parsed
   (msgspec) and structured (the protocol's converter), and only the new items are keyed.
3. The request is returned with its input as `KeyedInput`: the items and the content key
   after each, which the session hands to the render cache's lookup (`RenderCache.longest`).

Exactness: this path only ever accepts. Anything it does not handle (an input that is a
string, msgpack, a `type` in an HTTP body, an integer out of range, more items than allowed, a
value any of its parsers or the converter refuses) is decoded again by the protocol's own
decoder (`decode_create_body`, `decode_client_event`), whose result or error is the answer:
the same errors, codes and params as without the memo. Items taken from an entry are the
values the same bytes decoded to before (decoding is a function of the bytes).

Bounds (module constants): `MEMO_CONVERSATIONS_PER_OWNER` entries per API key, most recent
first (a request that extends an entry replaces it); `DEFAULT_INPUT_MEMO_BYTES` of raw text in
all, least recently used dropped first; an entry unused for the render cache's TTL is dropped
(a `store: false` conversation lives in memory no longer than there). Bodies under
`FAST_DECODE_MIN_BYTES` take the protocol's decoder directly: nothing to gain.

Thread safety: `split` runs on the event loop, `finish` may run in a worker thread (a large
new part); the memo's dict is guarded by a lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Literal

import attrs
import msgspec
from rollout.protocol import (
    Compaction,
    Item,
    ItemReference,
    ResponseCreate,
    from_wire,
)
from rollout.protocol._events import MAX_INPUT_ITEMS

from ._itemkey import ROOT_KEY, chain_key, item_key

__all__ = [
    "DEFAULT_INPUT_MEMO_BYTES",
    "FAST_DECODE_MIN_BYTES",
    "MEMO_CONVERSATIONS_PER_OWNER",
    "InputMemo",
    "KeyedInput",
    "Split",
]

# Bodies smaller than this are decoded by the protocol's decoder: there is nothing to gain.
FAST_DECODE_MIN_BYTES = 32 * 1024
# Raw input text the memo holds in all (least recently used entries go first).
DEFAULT_INPUT_MEMO_BYTES = 128 * 2**20
# Conversations remembered per owner (API key), most recently used first.
MEMO_CONVERSATIONS_PER_OWNER = 4
# The protocol's integer range (`_codec._int64`): larger integers are refused by its decoder.
_MIN_INT, _MAX_INT = -(2**63), 2**64 - 1
_WHITESPACE = b" \t\r\n"

_split_body = msgspec.json.Decoder(dict[str, msgspec.Raw])
_parse = msgspec.json.Decoder()


class KeyedInput(list[Item]):
    """A request's input items and, for each, the content key of the conversation up to and
    including it (`_itemkey.chain_key`), computed as the request was decoded; and what the
    session would otherwise look for in every item each turn: how many are item references,
    and where the last compaction item is (-1: none)."""

    __slots__ = ("keys", "last_compaction", "references")

    def __init__(
        self, items: Iterable[Item], keys: list[bytes], references: int, last_compaction: int
    ) -> None:
        super().__init__(items)
        self.keys = keys
        self.references = references
        self.last_compaction = last_compaction


class _Fallback(Exception):
    """This path does not decode this message: the protocol's decoder does."""


@attrs.define(eq=False)
class _Entry:
    """What an earlier message of an owner decoded to. `head` is its text up to the end of its
    input's last item (the first `head_end` bytes of `data`, the message itself: kept whole,
    not copied), `start` where the input's text begins in it (`text`: the input up to its last
    item). When the input's place in the message is known, `rest` is the text after the
    input's closing bracket and `shell` the request the message makes with an empty input: a
    message of the same kind that starts with `head` and ends with `rest` is decoded from the
    text between them alone (`InputMemo._match_around`)."""

    owner: str | None
    kind: str
    data: bytes
    head_end: int
    start: int
    items: KeyedInput
    expires: float
    rest: bytes | None = None
    shell: ResponseCreate | None = None

    @property
    def head(self) -> memoryview:
        return memoryview(self.data)[: self.head_end]

    @property
    def text(self) -> memoryview:
        return memoryview(self.data)[self.start : self.head_end]

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.rest or b"")


@attrs.define(eq=False)
class Split:
    """A message split by `InputMemo.split`: what is left to decode (`new_bytes` of it), to be
    finished by `InputMemo.finish` (on the event loop, or in a worker thread)."""

    owner: str | None
    kind: str
    data: bytes  # the whole message
    fields: dict[str, msgspec.Raw]  # the top-level values but `input` (none: `shell` has them)
    raw_input: bytes  # the input's text (empty when `shell` is known)
    base: _Entry | None  # the entry whose items the input starts with
    tail: bytes  # the input's text after the entry's items (all of it without one)
    new_bytes: int
    shell: ResponseCreate | None = None  # the request but its input, from `base`
    close: int = -1  # where the input's closing bracket is in `data`, when known


@attrs.define
class InputMemoStats:
    hits: int = 0  # requests whose input started with an entry's items
    misses: int = 0  # requests decoded here with no entry to start from
    fallbacks: int = 0  # messages left to the protocol's decoder (not counted above)
    items_reused: int = 0  # items taken from entries instead of decoded
    bytes_parsed: int = 0  # input text parsed here (the new part of each input)


class InputMemo:
    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_INPUT_MEMO_BYTES,
        ttl: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.stats = InputMemoStats()
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id(), least recent first
        self._owners: dict[str | None, list[_Entry]] = {}  # each owner's, most recent last
        self._nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes_held(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    # --- decoding ----------------------------------------------------------------------------

    def split(
        self,
        data: str | bytes,
        owner: str | None,
        *,
        kind: Literal["body", "event"],
        max_size: int,
    ) -> Split | None:
        """Split a `POST /v1/responses` body (`kind` "body") or a WebSocket message ("event")
        and find the entry its input starts with. None: the protocol's decoder takes it."""
        if not self.enabled or len(data) < FAST_DECODE_MIN_BYTES:
            return None
        try:
            raw = data.encode() if isinstance(data, str) else data
            if len(raw) > max_size:  # the protocol's decoder words the refusal
                self._count_fallback()
                return None
            around = self._match_around(owner, kind, raw)
            if around is not None:
                return around
            fields = _split_body.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeEncodeError, RecursionError):
            self._count_fallback()
            return None
        if kind == "body" and "type" in fields:
            self._count_fallback()
            return None
        if kind == "event" and bytes(fields.get("type", b"")) != b'"response.create"':
            self._count_fallback()
            return None
        value = fields.pop("input", None)
        raw_input = bytes(value) if value is not None else b""
        if not raw_input.startswith(b"["):
            self._count_fallback()
            return None
        base, tail = self._match(owner, raw_input)
        return Split(
            owner=owner,
            kind=kind,
            data=raw,
            fields=fields,
            raw_input=raw_input,
            base=base,
            tail=tail,
            new_bytes=len(tail) + sum(len(v) for v in fields.values()),
        )

    def _match_around(self, owner: str | None, kind: str, raw: bytes) -> Split | None:
        """A message that is an entry's, but for items added at the end of its input: the
        same text up to the end of the entry's last item, the same text after the input. The
        part between (`,` and the new items, or nothing, then `]`) is all there is to parse:
        the rest is text an earlier message of this owner had, which decoded without error.
        The entry with the longest such text, if any."""
        best: _Entry | None = None
        best_close = -1
        now = self.clock()
        with self._lock:
            for entry in self._owners.get(owner, ()):
                rest = entry.rest
                if rest is None or entry.kind != kind or entry.expires <= now:
                    continue
                close = len(raw) - len(rest) - 1
                if (
                    (best is None or entry.head_end > best.head_end)
                    and close >= entry.head_end
                    and raw[close] == 0x5D  # "]"
                    and raw.startswith(entry.head)
                    and raw.endswith(rest)
                ):
                    best, best_close = entry, close
            if best is None:
                return None
            self._entries.move_to_end(id(best))
        middle = raw[best.head_end : best_close]
        return Split(
            owner=owner,
            kind=kind,
            data=raw,
            fields={},
            raw_input=b"",
            base=best,
            tail=middle,
            new_bytes=len(middle),
            shell=best.shell,
            close=best_close,
        )

    def finish(self, split: Split) -> ResponseCreate | None:
        """The request, its input a `KeyedInput`; None: the protocol's decoder takes it."""
        try:
            return self._finish(split)
        except (_Fallback, Exception):  # any refusal is the protocol decoder's to word
            with self._lock:
                self.stats.fallbacks += 1
            return None

    def _finish(self, split: Split) -> ResponseCreate:
        others = {k: _parse.decode(v) for k, v in split.fields.items()}
        _check_ints(others.values())
        base = split.base
        if base is None:
            values = _parse.decode(split.raw_input)
        elif split.shell is not None:  # the text between the entry's items and its rest
            between = split.tail.lstrip(_WHITESPACE)
            if between and not between.startswith(b","):
                raise _Fallback
            values = _parse.decode(b"[" + between[1:] + b"]") if between else []
            if between and not values:  # `[..., ]`: a trailing comma
                raise _Fallback
        else:
            rest = split.tail.lstrip(_WHITESPACE)
            values = _parse.decode(b"[" + rest[1:]) if rest.startswith(b",") else []
        if not isinstance(values, list):
            raise _Fallback
        if base is not None:
            known = base.items
            items = KeyedInput(known, list(known.keys), known.references, known.last_compaction)
        else:
            items = KeyedInput((), [], 0, -1)
        if len(items) + len(values) > MAX_INPUT_ITEMS:
            raise _Fallback
        _check_ints(values)
        keys = items.keys
        key = keys[-1] if keys else ROOT_KEY
        for value in values:
            item: Item = from_wire(value, Item)
            key = chain_key(key, item_key(item)[0])
            if isinstance(item, ItemReference):
                items.references += 1
            elif isinstance(item, Compaction):
                items.last_compaction = len(items)
            items.append(item)
            keys.append(key)
        shell = split.shell
        if shell is None:
            shell = from_wire({**others, "input": []}, ResponseCreate)
        request = attrs.evolve(shell, input=items)
        self._remember(split, items, len(values), shell)
        return request

    # --- the entries -------------------------------------------------------------------------

    def _count_fallback(self) -> None:
        with self._lock:
            self.stats.fallbacks += 1

    def _match(self, owner: str | None, raw_input: bytes) -> tuple[_Entry | None, bytes]:
        """The longest live entry of `owner` whose input text `raw_input` starts with, at an
        item boundary, and the text after it."""
        best: _Entry | None = None
        best_n = 0
        now = self.clock()
        with self._lock:
            for entry in self._owners.get(owner, ()):
                if entry.expires <= now:
                    continue
                text = entry.text
                n = len(text)
                if best_n < n <= len(raw_input) and raw_input.startswith(text):
                    if raw_input[n:].lstrip(_WHITESPACE).startswith((b",", b"]")):
                        best, best_n = entry, n
            if best is not None:
                self._entries.move_to_end(id(best))
        return best, raw_input[best_n:]

    def _remember(self, split: Split, items: KeyedInput, new: int, shell: ResponseCreate) -> None:
        base = split.base
        data = split.data
        close = split.close
        if close < 0 and split.raw_input:  # the input's place: its text, once in the message
            found = data.find(split.raw_input)
            if found >= 0 and data.find(split.raw_input, found + 1) < 0:
                close = found + len(split.raw_input) - 1
        entry: _Entry | None = None
        if items and close >= 0:
            head_end = close  # up to the end of the last item: the whitespace before `]` off
            while head_end > 0 and data[head_end - 1] in _WHITESPACE:
                head_end -= 1
            if split.raw_input:
                start = close + 1 - len(split.raw_input)
            else:  # decoded around an entry's text: its input starts where the entry's did
                assert base is not None
                start = base.start
            entry = _Entry(
                split.owner,
                split.kind,
                data,
                head_end,
                start,
                KeyedInput(items, items.keys, items.references, items.last_compaction),
                self.clock() + self.ttl,
                rest=data[close + 1 :],
                shell=shell,
            )
        elif items:
            text = split.raw_input.rstrip(_WHITESPACE)[:-1].rstrip(_WHITESPACE)
            entry = _Entry(
                split.owner,
                split.kind,
                text,
                len(text),
                0,
                KeyedInput(items, items.keys, items.references, items.last_compaction),
                self.clock() + self.ttl,
            )
        with self._lock:
            if base is not None:
                self.stats.hits += 1
                self.stats.items_reused += len(items) - new
            else:
                self.stats.misses += 1
            self.stats.bytes_parsed += len(split.tail)
            if entry is None:
                return
            if base is not None and id(base) in self._entries:
                self._drop(base)  # this entry's conversation now goes on in the new one
            self._entries[id(entry)] = entry
            mine = self._owners.setdefault(split.owner, [])
            mine.append(entry)
            self._nbytes += entry.nbytes
            now = self.clock()
            for old in [e for e in mine if e.expires <= now]:
                self._drop(old)
            while len(mine) > MEMO_CONVERSATIONS_PER_OWNER:
                self._drop(mine[0])
            while self._nbytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries.values())))

    def _drop(self, entry: _Entry) -> None:
        del self._entries[id(entry)]
        mine = self._owners[entry.owner]
        mine.remove(entry)
        if not mine:
            del self._owners[entry.owner]
        self._nbytes -= entry.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._owners.clear()
            self._nbytes = 0


def _check_ints(values: Iterable[Any]) -> None:
    """Refuse what the protocol's decoder refuses and msgspec does not: integers outside its
    range (`_codec._int64`)."""
    stack = list(values)
    while stack:
        node = stack.pop()
        if type(node) is int:
            if not _MIN_INT <= node <= _MAX_INT:
                raise _Fallback
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
