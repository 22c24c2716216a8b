"""ResponseState: what a finished response leaves behind for the next turn.

Long because the lineage keeps per-item indexes (ids, calls, media, digests) incrementally, so
that no turn recomputes them over the whole conversation.

Everything fast in rollout is reuse of this state; everything slow is rebuilding it.

A conversation's items, their rendered tokens, a running digest of the context and the index of
function calls live in a `Lineage`: append-only storage shared by every state along one chain
of responses. A `ResponseState` is a view of the first `n_items` items of a lineage plus the
small per-turn values (the prefix, the classifier state, the route, the calls still waiting for
output). Extending the newest state of a chain appends in place, so a follow-up costs work
proportional to its new items only, never to the history. Extending an older state (a fork:
two children of one parent) first copies the shared prefix into a new lineage; that is the only
operation whose cost grows with the conversation, and it happens only on forks.

Tokens are those of one renderer, the route's (`Route.renderer`: the model's own tokenizer and
chat template, else the engine's default), named by its render version (`render_version`: the
template and the tokenizer). A lineage and a prefix each record the version they were rendered
with; a continuation on a model of another renderer renders its conversation again onto a new
lineage (`Pipeline.prepare_input`), the other operation whose cost grows with the conversation,
and it happens only on such a switch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

import attrs
from rollout.protocol import (
    CallKind,
    InputFile,
    InputImage,
    Item,
    Message,
    OpaqueItem,
    Response,
    Tool,
    call_of,
    parts_of,
)

from ._interfaces import Backend, Flag, Renderer
from ._itemkey import ROOT_KEY, chain_key, item_key

__all__ = [
    "CallRecord",
    "ItemsView",
    "Lineage",
    "Prefix",
    "ResponseState",
    "Route",
    "Staged",
    "digest_tokens",
    "render_version",
]

# Memory per item besides its content and tokens, estimated (the item object and its parts,
# its entries in the per-item indexes): see `Lineage.nbytes`.
_ITEM_BYTES = 400
_EMPTY_DIGEST = hashlib.blake2b(b"rollout-context", digest_size=16).digest()


def render_version(renderer: Renderer) -> str:
    """What rendered tokens depend on: the chat template and the tokenizer (two renderers of
    one version render alike). Computed once per renderer (`ModelSpec`, `Pipeline`)."""
    # A renderer may name its tokenizer (`tokenizer.name`); the Protocol leaves it optional,
    # so a renderer of the embedder's own needs none.
    tokenizer = getattr(renderer, "tokenizer", None)
    return f"{renderer.template_id}/{getattr(tokenizer, 'name', '?')}"


def _version_of(renderer: Renderer | None) -> str | None:
    return render_version(renderer) if renderer is not None else None


def digest_tokens(tokens: array[int]) -> bytes:
    return hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()


def _chain(previous: bytes, item_digest: bytes) -> bytes:
    return hashlib.blake2b(previous + item_digest, digest_size=16).digest()


@attrs.define(eq=False)
class CallRecord:
    """A tool call of the conversation (any kind: function, custom, shell, ...)."""

    kind: CallKind
    name: str  # the tool's name (a built-in tool's call: its kind)
    added_at: int  # index of the call item in the lineage


class Lineage:
    """Append-only storage shared along a chain of states (copy-on-fork)."""

    __slots__ = (
        "_calls",
        "_digests",
        "_ends",
        "_ids",
        "_keys",
        "_media",
        "_since_user",
        "_sizes",
        "derived",
        "items",
        "render_version",
        "tokens",
    )

    def __init__(self, render_version: str | None = None) -> None:
        # The renderer its tokens are of (see `render_version`); None while it holds nothing.
        self.render_version = render_version
        # Per-lineage caches that backends derive from the items (e.g. encoded chat messages),
        # keyed by backend; a fork starts without them (they are rebuilt on first use).
        self.derived: dict[str, Any] = {}
        self.items: list[Item] = []
        self.tokens: array[int] = array("I")
        self._ends: array[int] = array("Q")  # cumulative token count after each item
        self._digests: list[bytes] = []  # chained context digest after each item
        self._keys: list[bytes] = []  # chained content key after each item (`_itemkey.py`)
        # Memory held, estimated (token arrays, the items' content, a fixed cost per item),
        # cumulative after each item: see `nbytes`.
        self._sizes: array[int] = array("Q")
        self._since_user: array[int] = array("I")  # tool calls since the last user message
        # (images, files) in content since the last user message, that message included
        self._media: list[tuple[int, int]] = []
        self._calls: dict[str, CallRecord] = {}
        self._ids: dict[str, int] = {}  # item id -> index (for item_reference)

    def __len__(self) -> int:
        return len(self.items)

    def token_count(self, n_items: int) -> int:
        return self._ends[n_items - 1] if n_items else 0

    def digest(self, n_items: int) -> bytes:
        return self._digests[n_items - 1] if n_items else _EMPTY_DIGEST

    @property
    def nbytes(self) -> int:
        """The memory this lineage holds, estimated (what the render cache budgets)."""
        return self._sizes[-1] if self._sizes else 0

    def nbytes_of(self, start: int, stop: int) -> int:
        """The estimated memory of items `start` to `stop` (exclusive)."""
        return (self._sizes[stop - 1] if stop else 0) - (self._sizes[start - 1] if start else 0)

    def key(self, n_items: int) -> bytes:
        """The content key of the first `n_items` items (what the render cache finds)."""
        return self._keys[n_items - 1] if n_items else ROOT_KEY

    def calls_since_user(self, n_items: int) -> int:
        return self._since_user[n_items - 1] if n_items else 0

    def media_since_user(self, n_items: int) -> tuple[int, int]:
        return self._media[n_items - 1] if n_items else (0, 0)

    def item_tokens(self, index: int) -> array[int]:
        start = self._ends[index - 1] if index else 0
        return self.tokens[start : self._ends[index]]

    def call(self, call_id: str, n_items: int) -> CallRecord | None:
        """The tool call with `call_id` among the first `n_items` items, if any."""
        found = self._calls.get(call_id)
        if found is None or found.added_at >= n_items:
            return None
        return found

    def find(self, item_id: str, n_items: int) -> Item | None:
        """The item with this id among the first `n_items`, if any."""
        index = self._ids.get(item_id)
        return self.items[index] if index is not None and index < n_items else None

    def append(self, item: Item, item_tokens: array[int]) -> None:
        index = len(self.items)
        self.items.append(item)
        if item.id is not None:
            self._ids.setdefault(item.id, index)
        self.tokens.extend(item_tokens)
        self._ends.append(len(self.tokens))
        self._digests.append(_chain(self.digest(index), digest_tokens(item_tokens)))
        key, size = item_key(item)
        self._keys.append(chain_key(self.key(index), key))
        self._sizes.append(self.nbytes + _ITEM_BYTES + size + 4 * len(item_tokens))
        since_user = self.calls_since_user(index)
        images, files = self.media_since_user(index)
        call = call_of(item)
        if isinstance(item, Message) and item.role == "user":
            since_user = 0
            images = files = 0
        elif call is not None:
            since_user += 1
            self._calls[call[0]] = CallRecord(call[1], call[2], index)
        elif isinstance(item, OpaqueItem) and item.type.endswith("_call"):
            since_user += 1  # a hosted tool's call (web_search_call, mcp_call, ...)
        self._since_user.append(since_user)
        more_images, more_files = _parts_media(item)
        self._media.append((images + more_images, files + more_files))

    @classmethod
    def restore(
        cls,
        items: list[Item],
        tokens: array[int],
        ends: array[int],
        digests: list[bytes],
        since_user: array[int],
        *,
        render_version: str,
        keys: list[bytes] | None = None,
        sizes: array[int] | None = None,
    ) -> Lineage:
        """A lineage rebuilt from a snapshot (see `snapshot`) of tokens rendered by
        `render_version`, without rendering; the content keys and memory estimates are
        computed from the items unless given."""
        if not (len(items) == len(ends) == len(digests) == len(since_user)) or (
            ends and ends[-1] != len(tokens)
        ):
            raise ValueError("inconsistent lineage snapshot")
        new = cls(render_version)
        new.items = items
        new.tokens = tokens
        new._ends = ends
        new._digests = digests
        new._since_user = since_user
        if keys is None or sizes is None:
            keys, sizes = _keys(items, ends)
        if not len(keys) == len(sizes) == len(items):
            raise ValueError("inconsistent lineage snapshot")
        new._keys = keys
        new._sizes = sizes
        new._media = _media_counts(items)
        for i, item in enumerate(items):
            call = call_of(item)
            if call is not None:
                new._calls[call[0]] = CallRecord(call[1], call[2], i)
        for i, item in enumerate(items):
            if item.id is not None:
                new._ids.setdefault(item.id, i)
        return new

    def snapshot(self, n_items: int) -> dict[str, Any]:
        """What `restore` needs for the first `n_items` items, as plain data."""
        return {
            "tokens": self.tokens[: self.token_count(n_items)].tobytes(),
            "ends": self._ends[:n_items].tobytes(),
            "digests": self._digests[:n_items],
            "csu": self._since_user[:n_items].tobytes(),  # calls since the user message
        }

    def fork(self, n_items: int) -> Lineage:
        """A new lineage holding a copy of the first `n_items` items (O(history))."""
        new = Lineage(self.render_version)
        new.items = self.items[:n_items]
        new._ends = self._ends[:n_items]
        new.tokens = self.tokens[: self.token_count(n_items)]
        new._digests = self._digests[:n_items]
        new._keys = self._keys[:n_items]
        new._sizes = self._sizes[:n_items]
        new._since_user = self._since_user[:n_items]
        new._media = self._media[:n_items]
        new._calls = {k: v for k, v in self._calls.items() if v.added_at < n_items}
        new._ids = {k: v for k, v in self._ids.items() if v < n_items}
        return new


def _parts_media(item: Item) -> tuple[int, int]:
    found = parts_of(item)
    if found is None:
        return (0, 0)
    parts = found[1]
    images = sum(1 for part in parts if isinstance(part, InputImage))
    files = sum(1 for part in parts if isinstance(part, InputFile))
    return (images, files)


def _keys(items: Sequence[Item], ends: array[int]) -> tuple[list[bytes], array[int]]:
    """The chained content keys of `items`, and their cumulative memory estimates."""
    keys: list[bytes] = []
    sizes: array[int] = array("Q")
    key = ROOT_KEY
    nbytes = start = 0
    for item, end in zip(items, ends, strict=True):
        one, size = item_key(item)
        key = chain_key(key, one)
        keys.append(key)
        nbytes += _ITEM_BYTES + size + 4 * (end - start)
        sizes.append(nbytes)
        start = end
    return keys, sizes


def _media_counts(items: Sequence[Item]) -> list[tuple[int, int]]:
    """(images, files) since the last user message, after each item."""
    out: list[tuple[int, int]] = []
    images = files = 0
    for item in items:
        if isinstance(item, Message) and item.role == "user":
            images = files = 0
        more = _parts_media(item)
        images, files = images + more[0], files + more[1]
        out.append((images, files))
    return out


class ItemsView(Sequence[Item]):
    """A read-only view of a state's items, without copying the history."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[Item], n: int) -> None:
        self._items = items
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> Item: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Item]: ...
    def __getitem__(self, index: int | slice) -> Item | Sequence[Item]:
        if isinstance(index, slice):
            items = self._items
            return [items[i] for i in range(*index.indices(self._n))]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(index)
        return self._items[index]

    def __iter__(self) -> Iterator[Item]:
        items = self._items
        for i in range(self._n):
            yield items[i]


@attrs.frozen(eq=False)
class Prefix:
    """Instructions and tools, rendered once and reused while a chain keeps them (and its
    renderer) unchanged."""

    instructions: str | None
    tools: tuple[Tool, ...]
    tokens: array[int]
    digest: bytes
    # The tools offered to the model: `tools` without the hosted ones no executor can run.
    offered: tuple[Tool, ...]
    classifier_state: Any
    flags: tuple[Any, ...] = ()  # classifier flags raised by the prefix (fail the response)
    render_version: str | None = None  # the renderer of `tokens` (None: no renderer's, empty)


@attrs.frozen(eq=False)
class Route:
    """Where a model string resolved to. `model` is the string the client sent. `renderer`
    is the renderer it renders with and `render_version` its version: the registry gives the
    model's own (its tokenizer and chat template; the version computed once per model), None
    for a model without one; the route stage binds the engine's default to such a route when
    it resolves it (`_models.Router`), so a route of a request or a state always carries its
    renderer (`bound_renderer`, `bound_version`)."""

    model: str
    name: str  # the registry entry
    params: dict[str, str]
    context_window: int
    backend: Backend
    renderer: Renderer | None = None
    render_version: str | None = attrs.field(
        default=attrs.Factory(lambda route: _version_of(route.renderer), takes_self=True)
    )

    @property
    def bound_renderer(self) -> Renderer:
        """`renderer`, on a route the route stage resolved (which binds the default)."""
        if self.renderer is None:
            raise ValueError(f"the route of {self.model!r} has no renderer bound")
        return self.renderer

    @property
    def bound_version(self) -> str:
        """`render_version`, on a route the route stage resolved (which binds the default)."""
        if self.render_version is None:
            raise ValueError(f"the route of {self.model!r} has no renderer bound")
        return self.render_version


@attrs.frozen(kw_only=True, eq=False)
class Staged:
    """Items validated, rendered and classified (`Pipeline.stage`), not yet committed to a
    lineage (`ResponseState.commit`)."""

    items: list[Item]
    tokens: list[array[int]]
    render_version: str  # the renderer of `tokens`
    classifier_state: Any
    open_calls: dict[str, str]
    flags: tuple[Flag, ...]

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


@attrs.frozen(eq=False)
class ResponseState:
    """A response and the conversation it leaves behind (see the module docstring)."""

    response: Response
    lineage: Lineage
    n_items: int
    prefix: Prefix
    classifier_state: Any
    route: Route
    open_calls: tuple[tuple[str, str], ...]  # (call_id, name) of calls with no output yet
    stored: bool  # this response and all its ancestors are in the store
    first_new_item: int  # index of this response's first own item (its parent's n_items)

    @property
    def id(self) -> str:
        return self.response.id

    @property
    def items(self) -> ItemsView:
        return ItemsView(self.lineage.items, self.n_items)

    @property
    def own_items(self) -> list[Item]:
        """The items this response added: its new input, then its output."""
        return self.lineage.items[self.first_new_item : self.n_items]

    @property
    def item_tokens(self) -> int:
        return self.lineage.token_count(self.n_items)

    @property
    def context_tokens(self) -> int:
        return len(self.prefix.tokens) + self.item_tokens

    @property
    def calls_since_user(self) -> int:
        return self.lineage.calls_since_user(self.n_items)

    @property
    def media_since_user(self) -> tuple[int, int]:
        return self.lineage.media_since_user(self.n_items)

    @property
    def context_digest(self) -> bytes:
        return _chain(self.prefix.digest, self.lineage.digest(self.n_items))

    def context(self) -> array[int]:
        """The whole rendered context (copies: for tests, storage and slow paths only)."""
        out = array("I", self.prefix.tokens)
        out.extend(self.lineage.tokens[: self.item_tokens])
        return out

    def commit(self, staged: Staged, **changes: Any) -> ResponseState:
        """This state with `staged` items appended to its conversation (in place on the tip
        of a chain), and `changes`. They must be of the renderer of what they join
        (`Pipeline.rerender` otherwise)."""
        lineage = self.writable_lineage()
        if staged.items:
            if not lineage.items:
                lineage.render_version = staged.render_version
            elif lineage.render_version != staged.render_version:
                raise ValueError(
                    f"items rendered by {staged.render_version} can't join a conversation "
                    f"rendered by {lineage.render_version}"
                )
        for item, toks in zip(staged.items, staged.tokens, strict=True):
            lineage.append(item, toks)
        return attrs.evolve(
            self,
            lineage=lineage,
            n_items=self.n_items + len(staged.items),
            classifier_state=staged.classifier_state,
            open_calls=tuple(staged.open_calls.items()),
            **changes,
        )

    def writable_lineage(self) -> Lineage:
        """The lineage a child of this state appends to: shared when this state is the tip,
        a copy of this state's history when it is not (a fork)."""
        if len(self.lineage) == self.n_items:
            return self.lineage
        return self.lineage.fork(self.n_items)

    def equivalent(self, other: ResponseState) -> bool:
        """Same conversation, tokens, classifier state, pending calls and route."""
        return (
            list(self.items) == list(other.items)
            and self.context() == other.context()
            and self.context_digest == other.context_digest
            and self.classifier_state == other.classifier_state
            and self.prefix.classifier_state == other.prefix.classifier_state
            and self.open_calls == other.open_calls
            and self.route.name == other.route.name
            and self.route.params == other.route.params
        )
