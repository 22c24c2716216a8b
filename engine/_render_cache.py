"""The render cache: conversation prefixes rendered once, for every connection of the process.

A connection's `ResponseCache` answers `previous_response_id` on that connection. This cache
answers a different question, for every client: has this process already rendered, classified
and validated a conversation that starts like this one, for this model's renderer? It is
content-addressed: an entry is a `ResponseState` that a finished response left behind (or that
hydration rebuilt), found by

    (owner, render version, content key of its items)

where the render version names the renderer of its tokens (`_state.render_version`: the chat
template and tokenizer of its model, `Route.renderer`, else the engine's default), so a request
for one model never reuses another model's rendering, and the content key is the chain of item
keys of `_itemkey.py` (id-free: a client echoing items with or without ids, or an assistant
message as a plain string, finds it). The session resolves a request's route before it looks
anything up here. The state's lineage is shared, not copied: a request that extends the newest
state of a lineage appends in place (O(new items)); one that extends an older state forks it (a
copy of the prefix, as any fork does). Instructions and tools are cached apart (`Prefix`, keyed
by the render version and their canonical JSON), since items render and classify independently
of them: a tools change mid-conversation still finds its items.

What it never is: a way to resolve an id. `store: false` responses stay unknown outside their
connection; an id continued over HTTP or on another connection is first confirmed by the store
for its owner, and only then looked up here (`by_response`: the state as its own model rendered
it; a continuation on a model of another renderer renders it again, `Pipeline.prepare_input`).

Bounds, all documented options of `rollout serve`:
- `max_bytes`: memory held, as `Lineage.nbytes` estimates it (token arrays, the items' content,
  a fixed cost per item; lineages shared by several entries counted once, at the size they had
  when last registered); least recently used entries go first.
- `ttl`: an entry not used for this many seconds is dropped (a `store: false` conversation
  lives in memory no longer than this, and never anywhere else).
- `max_bytes=0` turns the cache off (every request renders its whole input, as before).

Besides, the key of an instructions-and-tools pair is remembered by the objects it was worked
out from, for the `MAX_KEYED_PREFIXES` pairs most recently looked up and `MAX_KEYED_PREFIX_BYTES`
of their text (module constants): a stateless client's request, decoded around the input memo,
brings its previous turn's very objects, and its lookup then costs no JSON of its tools.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs
from rollout.protocol import Item, Tool

from ._itemkey import KEY_BYTES, ROOT_KEY, chain_key, item_key
from ._render import canonical_tools_json
from ._state import Lineage, Prefix, ResponseState

__all__ = [
    "DEFAULT_RENDER_CACHE_BYTES",
    "DEFAULT_RENDER_CACHE_TTL",
    "RenderCache",
    "RenderCacheStats",
    "RenderHit",
]

# Memory the render cache holds: about 50 million tokens of conversation (a conversation costs
# about 10 bytes per rendered token: the token, its text, the per-item indexes).
DEFAULT_RENDER_CACHE_BYTES = 512 * 2**20
# Seconds an unused entry lives (and with it, a store: false conversation's content).
DEFAULT_RENDER_CACHE_TTL = 1800.0
# The instructions-and-tools keys remembered by the objects they were computed from
# (`RenderCache._prefix_digest`): this many, the most recently used, holding at most this many
# bytes of instructions and canonical tools JSON between them (a larger pair is not kept).
MAX_KEYED_PREFIXES = 64
MAX_KEYED_PREFIX_BYTES = 4 * 2**20


@attrs.define
class RenderCacheStats:
    """Counts of the render cache (exported on /metrics)."""

    hits: int = 0  # lookups that found a rendered prefix (conversation or instructions+tools)
    misses: int = 0  # lookups that found nothing
    tokens_reused: int = 0  # rendered tokens found instead of rendered
    evictions: int = 0  # entries dropped for the token budget
    expirations: int = 0  # entries dropped for the TTL


# Where an entry is: (owner, render version, content key or instructions-and-tools key).
_Key = tuple[str | None, str | None, bytes]


@attrs.frozen
class RenderHit:
    """The longest cached prefix of a conversation: its first `n_items` items are `state`'s."""

    state: ResponseState
    n_items: int
    keys: list[bytes]  # the content key after each of the request's items


@attrs.frozen(eq=False)
class _Keyed:
    """The key of an instructions and tools pair, and the objects it was computed from (held:
    their ids name them only while they live)."""

    instructions: str | None
    tools: Sequence[Tool]
    digest: bytes
    size: int


@attrs.define(eq=False)
class _Held:
    """A lineage some entries refer to, and the bytes counted for it."""

    lineage: Lineage
    refs: int = 0
    nbytes: int = 0


@attrs.define(eq=False)
class _Entry:
    value: ResponseState | Prefix
    expires: float
    nbytes: int = 0  # a Prefix's own (a state's are its lineage's)


class RenderCache:
    """Process-wide, owner-scoped, content-addressed (see the module docstring). Single-task:
    the engine's event loop calls it, never a worker thread."""

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_RENDER_CACHE_BYTES,
        ttl: float = DEFAULT_RENDER_CACHE_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0 or ttl <= 0:
            raise ValueError("the render cache needs max_bytes >= 0 and ttl > 0")
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.stats = RenderCacheStats()
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self._by_response: dict[str, _Key] = {}
        self._lineages: dict[int, _Held] = {}  # by id()
        self._nbytes = 0
        # The key of each Prefix seen (held weakly: it lives as long as its states).
        self._prefix_keys: weakref.WeakKeyDictionary[Prefix, tuple[bytes, int]] = (
            weakref.WeakKeyDictionary()
        )
        # The key of the instructions and tools objects lookups were given, by their ids.
        self._keyed: OrderedDict[tuple[int, int], _Keyed] = OrderedDict()
        self._keyed_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes_held(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    # --- lookups ---------------------------------------------------------------------------

    def longest(
        self,
        owner: str | None,
        items: Sequence[Item],
        render_version: str,
        keys: list[bytes] | None = None,
    ) -> RenderHit | None:
        """The longest prefix of `items` this owner's conversations already rendered with the
        renderer `render_version` names, or None. Computes every item's content key once
        (O(items), no rendering), unless `keys` brings them (the content key after each item,
        as the input memo computed them while decoding: `_input_memo.py`)."""
        if not self.enabled or not items:
            return None
        if keys is None or len(keys) != len(items):
            keys = []
            key = ROOT_KEY
            for item in items:
                key = chain_key(key, item_key(item)[0])
                keys.append(key)
        for n in range(len(keys), 0, -1):
            state = self._get((owner, render_version, keys[n - 1]))
            if isinstance(state, ResponseState):
                self.stats.hits += 1
                self.stats.tokens_reused += state.item_tokens
                return RenderHit(state=state, n_items=n, keys=keys)
        self.stats.misses += 1
        return None

    def by_response(self, owner: str | None, response_id: str) -> ResponseState | None:
        """The state a response left behind, when its owner is `owner` (the caller has
        confirmed the id with the store: this never resolves an id by itself), as its own
        model's renderer rendered it (the state's route names it; a continuation on another
        renderer renders it again)."""
        where = self._by_response.get(response_id)
        if where is None or where[0] != owner:
            return None
        state = self._get(where)
        if isinstance(state, ResponseState) and state.id == response_id:
            self.stats.hits += 1
            self.stats.tokens_reused += state.item_tokens
            return state
        return None

    def prefix(
        self,
        owner: str | None,
        instructions: str | None,
        tools: Sequence[Tool],
        render_version: str,
    ) -> Prefix | None:
        """Instructions and tools as the renderer `render_version` names rendered them."""
        if not self.enabled:
            return None
        found = self._get((owner, render_version, self._prefix_digest(instructions, tools)))
        if isinstance(found, Prefix):
            self.stats.hits += 1
            self.stats.tokens_reused += len(found.tokens)
            return found
        self.stats.misses += 1
        return None

    # --- registration ----------------------------------------------------------------------

    def put(self, owner: str | None, state: ResponseState) -> None:
        """Register the conversation of `state` (its items, tokens, classifier state, open
        calls) and its instructions and tools, each under the renderer that rendered it. Only
        states that passed classification may be put: a hit skips the classifiers for the
        prefix it covers."""
        if not self.enabled:
            return
        key = (owner, state.lineage.render_version, state.lineage.key(state.n_items))
        if key in self._entries:
            self._drop(key)
        self._entries[key] = _Entry(state, self.clock() + self.ttl)
        if state.id:
            self._by_response[state.id] = key
        self._hold(state.lineage)
        prefix = state.prefix
        known = self._prefix_keys.get(prefix)
        if known is None:  # once per Prefix: a chain keeping its parent's reuses the key
            known = self._prefix_keys[prefix] = _prefix_key(prefix.instructions, prefix.tools)
        digest, size = known
        prefix_key = (owner, prefix.render_version, digest)
        # Held already: used again, its TTL starts again (an expired one is dropped here).
        if self._get(prefix_key) is None and prefix.tokens:
            nbytes = size + 4 * len(prefix.tokens)
            self._entries[prefix_key] = _Entry(prefix, self.clock() + self.ttl, nbytes)
            self._nbytes += nbytes
        self._shrink()

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    # --- internals -------------------------------------------------------------------------

    def _prefix_digest(self, instructions: str | None, tools: Sequence[Tool]) -> bytes:
        """`_prefix_key`'s digest of `instructions` and `tools`, computed once for these objects
        while they are among the `MAX_KEYED_PREFIXES` most recently given: a stateless client's
        requests decoded around the input memo's entry carry the very objects of its previous
        turn (`_input_memo.py`), and canonical tools JSON costs ~6 us per tool every turn."""
        ident = (id(instructions), id(tools))
        known = self._keyed.get(ident)
        if known is not None and known.instructions is instructions and known.tools is tools:
            self._keyed.move_to_end(ident)
            return known.digest
        digest, size = _prefix_key(instructions, tools)
        if size <= MAX_KEYED_PREFIX_BYTES:  # (ids of held objects are not reused: no entry)
            self._keyed[ident] = _Keyed(instructions, tools, digest, size)
            self._keyed_bytes += size
            while len(self._keyed) > MAX_KEYED_PREFIXES or (
                self._keyed_bytes > MAX_KEYED_PREFIX_BYTES
            ):
                self._keyed_bytes -= self._keyed.popitem(last=False)[1].size
        return digest

    def _get(self, key: _Key) -> ResponseState | Prefix | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self.clock()
        if entry.expires <= now:
            self._drop(key)
            self.stats.expirations += 1
            return None
        entry.expires = now + self.ttl
        self._entries.move_to_end(key)
        return entry.value

    def _hold(self, lineage: Lineage) -> None:
        held = self._lineages.get(id(lineage))
        if held is None:
            held = self._lineages[id(lineage)] = _Held(lineage)
        held.refs += 1
        self._nbytes += lineage.nbytes - held.nbytes  # it may have grown since
        held.nbytes = lineage.nbytes

    def _release(self, key: _Key, entry: _Entry) -> None:
        value = entry.value
        if isinstance(value, Prefix):
            self._nbytes -= entry.nbytes
            return
        if self._by_response.get(value.id) == key:
            del self._by_response[value.id]
        held = self._lineages[id(value.lineage)]
        held.refs -= 1
        if held.refs == 0:
            self._nbytes -= held.nbytes
            del self._lineages[id(value.lineage)]

    def _drop(self, key: _Key) -> None:
        self._release(key, self._entries.pop(key))

    def _shrink(self) -> None:
        now = self.clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires <= now:
                self.stats.expirations += 1
            elif self._nbytes > self.max_bytes:
                self.stats.evictions += 1
            else:
                break
            self._drop(key)


def _prefix_key(instructions: str | None, tools: Sequence[Tool]) -> tuple[bytes, int]:
    """The key of instructions and tools (a digest of the instructions' UTF-8, length-framed,
    and of the tools' canonical JSON), and its size. The instructions are hashed as they are:
    JSON-escaping them first cost ~4 ms per MiB of the event loop (64 MiB: ~250 ms)."""
    digest = hashlib.sha256(b"prefix\0")
    size = 0
    if instructions is None:
        digest.update(b"\0")
    else:
        data = instructions.encode("utf-8", "surrogatepass")
        digest.update(b"\1" + len(data).to_bytes(8, "big"))
        digest.update(data)
        size += len(data)
    if tools:
        data = canonical_tools_json(tools).encode("utf-8", "surrogatepass")
        digest.update(data)
        size += len(data)
    return digest.digest()[:KEY_BYTES], size
