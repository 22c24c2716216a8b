"""Compaction: a smaller context under a deterministic policy, and a sealed snapshot of it.

Long because compaction has three parts that must agree: the policy that picks what to keep, the
sealed snapshot, and restoring a state from it.

The policy (`CompactionPolicy`), applied to a conversation's items and their rendered sizes:

1. Reasoning items are dropped (they are the model's scratch work).
2. System and developer messages are *pinned*: kept verbatim.
3. The last `keep_turns` user turns (from the `keep_turns`-th last user message on) are kept
   verbatim.
4. Everything older becomes a *stub*: messages and tool outputs (function and custom outputs,
   shell stdout and stderr, local shell output) keep their first `stub_chars` characters
   followed by " [...]"; a function call keeps its name and call id with its arguments
   replaced by `{"truncated": true}`; a custom tool's input and a patch's diff are cut like
   text; other items stay as they are. A tool call and its output (of any kind) are one unit:
   they are kept, stubbed or dropped together, so the window stays valid.
5. While the window is over `budget_tokens`: drop stub units, oldest first; then turn verbatim
   units into stubs, oldest first, and drop those; then the pinned ones likewise. The window
   is therefore always within its budget (an empty window if the budget is tiny).

The window's last item is a `compaction` item whose `encrypted_content` is a sealed snapshot of
the compacted state: the window items, their rendered tokens, the chained context digests, the
calls still open and the classifier state. A new chain started from it (input
`[..., compaction, new items]` with no previous_response_id, on any connection or over HTTP)
restores that state without rendering the window again; items before the compaction item are
superseded by it. The snapshot names the renderer of its tokens (the model's: `Route.renderer`,
else the engine's default): a chain started from it must render with the same one, and a model
of another chat template or tokenizer refuses it (snapshots from before renderers were per
model name only their template, and count as the engine default renderer's). The seal is
`version || msgpack payload || HMAC-SHA256(server key, owner ||
version || payload)`, base64url: a tampered or foreign item, or one made for another API key,
is refused. (It is integrity-protected, not encrypted: it contains
the window's own text, which the client already has.)
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from array import array
from collections.abc import Sequence
from typing import Any

import attrs
import msgpack
from rollout.protocol import (
    ApplyPatchCall,
    Compaction,
    ContentPart,
    CustomToolCall,
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    InputText,
    Item,
    LocalShellCallOutput,
    Message,
    OutputText,
    Reasoning,
    Refusal,
    RemoteProtocolError,
    ShellCallOutput,
    call_of,
    from_wire,
    output_of,
    status_of,
    to_wire,
)

from ._ids import new_id
from ._interfaces import SnapshotClassifier
from ._pipeline import Pipeline
from ._state import Lineage, ResponseState, Route

__all__ = [
    "DEFAULT_COMPACT_BUDGET",
    "CompactionPolicy",
    "SnapshotSeal",
    "compact_items",
    "compact_state",
    "restore_state",
]

# The default token budget of a compacted window (a request may ask for another).
DEFAULT_COMPACT_BUDGET = 8192
# Snapshot format version; bumped when the payload or the seal changes (2: bound to the owner).
SNAPSHOT_VERSION = 2
_MAC_BYTES = 32
# The largest sealed snapshot accepted, in characters (a window of ~1M tokens).
MAX_SNAPSHOT_CHARS = 16 * 1024 * 1024


@attrs.frozen(kw_only=True)
class CompactionPolicy:
    budget_tokens: int = DEFAULT_COMPACT_BUDGET
    keep_turns: int = 2
    stub_chars: int = 200


def _stub_text(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " [...]"


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        p.refusal
        if isinstance(p, Refusal)
        else p.text
        if isinstance(p, InputText | OutputText)
        else ""
        for p in content
    )


def _stub(item: Item, limit: int) -> Item:
    if isinstance(item, Message):
        text = _stub_text(_text(item.content), limit)
        if item.role == "assistant":
            return Message(
                role="assistant",
                content=[OutputText(text=text)],
                id=new_id("msg"),
                status="completed",
            )
        return Message(role=item.role, content=text, id=new_id("msg"))
    if isinstance(item, FunctionCall):
        return attrs.evolve(item, arguments='{"truncated": true}', id=new_id("fc"))
    if isinstance(item, FunctionCallOutput):
        return FunctionCallOutput(
            call_id=item.call_id, output=_stub_text(_text(item.output), limit), id=new_id("fco")
        )
    if isinstance(item, CustomToolCall):
        return attrs.evolve(item, input=_stub_text(item.input, limit), id=new_id("ctc"))
    if isinstance(item, CustomToolCallOutput):
        return CustomToolCallOutput(
            call_id=item.call_id, output=_stub_text(_text(item.output), limit), id=new_id("ctco")
        )
    if isinstance(item, LocalShellCallOutput):
        return attrs.evolve(item, output=_stub_text(item.output, limit))
    if isinstance(item, ShellCallOutput):
        cut = [
            attrs.evolve(o, stdout=_stub_text(o.stdout, limit), stderr=_stub_text(o.stderr, limit))
            for o in item.output
        ]
        return attrs.evolve(item, output=cut, id=new_id("sho"))
    if isinstance(item, ApplyPatchCall) and item.operation.diff is not None:
        operation = attrs.evolve(item.operation, diff=_stub_text(item.operation.diff, limit))
        return attrs.evolve(item, operation=operation, id=new_id("apc"))
    return item


@attrs.define
class _Unit:
    indices: list[int]
    pinned: bool
    mode: str  # "verbatim" | "stub" | "dropped"


def compact_items(
    items: Sequence[Item],
    verbatim_cost: Sequence[int],
    stub_cost: Any,  # Callable[[Item], tuple[Item, int]]: a stub and its rendered size
    policy: CompactionPolicy,
) -> tuple[list[Item], list[int | None]]:
    """Apply the policy. Returns the window's items and, for each, the index of the original
    item kept verbatim (None for a stub, whose tokens must be rendered)."""
    units: list[_Unit] = []
    call_units: dict[str, _Unit] = {}
    users = [i for i, it in enumerate(items) if isinstance(it, Message) and it.role == "user"]
    boundary = users[-policy.keep_turns] if len(users) >= policy.keep_turns else 0
    for i, item in enumerate(items):
        if isinstance(item, Reasoning):
            continue
        answer = output_of(item)
        if answer is not None and answer[0] in call_units:
            call_units[answer[0]].indices.append(i)
            continue
        pinned = isinstance(item, Message) and item.role in ("system", "developer")
        unit = _Unit([i], pinned, "verbatim" if pinned or i >= boundary else "stub")
        units.append(unit)
        call = call_of(item)
        if call is not None:
            call_units[call[0]] = unit

    stubs: dict[int, tuple[Item, int]] = {}

    def cost(unit: _Unit) -> int:
        if unit.mode == "dropped":
            return 0
        if unit.mode == "verbatim":
            return sum(verbatim_cost[i] for i in unit.indices)
        total = 0
        for i in unit.indices:
            if i not in stubs:
                stubs[i] = stub_cost(_stub(items[i], policy.stub_chars))
            total += stubs[i][1]
        return total

    total = sum(cost(u) for u in units)
    for pinned in (False, True):
        for from_mode, to_mode in (("stub", "dropped"), ("verbatim", "stub"), ("stub", "dropped")):
            for unit in units:
                if total <= policy.budget_tokens:
                    break
                if unit.pinned is pinned and unit.mode == from_mode:
                    total -= cost(unit)
                    unit.mode = to_mode
                    total += cost(unit)
    window: list[Item] = []
    origin: list[int | None] = []
    kept = sorted((i, unit.mode) for unit in units if unit.mode != "dropped" for i in unit.indices)
    for i, mode in kept:
        if mode == "verbatim":
            window.append(items[i])
            origin.append(i)
        else:
            window.append(stubs[i][0])
            origin.append(None)
    return window, origin


class SnapshotSeal:
    """Seals and opens compaction snapshots with a server key (HMAC-SHA256)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the compaction key must be at least 16 bytes")
        self._key = key

    def _mac(self, body: bytes, owner: str | None) -> bytes:
        """The MAC covers the owner (the API key's hash) too: an item is valid only for the key
        that made it, like the stored responses it summarizes."""
        tag = (owner or "").encode()
        message = len(tag).to_bytes(2, "big") + tag + body
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def seal(self, payload: dict[str, Any], *, owner: str | None) -> str:
        body = bytes([SNAPSHOT_VERSION]) + msgpack.packb(payload, use_bin_type=True)
        return base64.urlsafe_b64encode(body + self._mac(body, owner)).decode().rstrip("=")

    def open(self, text: str, *, param: str, owner: str | None) -> dict[str, Any]:
        def refuse(why: str) -> RemoteProtocolError:
            return RemoteProtocolError.invalid(
                f"Invalid compaction item: {why}. Compaction items can only be used with the "
                "server that made them, unmodified.",
                code="invalid_compaction",
                param=param,
            )

        if len(text) > MAX_SNAPSHOT_CHARS:
            raise refuse("it is too large")
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (ValueError, TypeError):
            raise refuse("it is not base64url") from None
        # Only the canonical encoding is accepted (no alternative spellings of the same bytes).
        if base64.urlsafe_b64encode(raw).decode().rstrip("=") != text:
            raise refuse("it is not in canonical base64url")
        if len(raw) < 1 + _MAC_BYTES:
            raise refuse("it is truncated")
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(body, owner)):
            raise refuse("its integrity check failed")
        if body[0] != SNAPSHOT_VERSION:
            raise refuse(f"snapshot version {body[0]} is not supported")
        try:
            payload = msgpack.unpackb(body[1:], raw=False)
        except Exception:
            raise refuse("its payload is unreadable") from None
        if not isinstance(payload, dict):
            raise refuse("its payload is unreadable")
        return payload


def encode_items(items: Sequence[Item]) -> list[Any]:
    return [to_wire(item) for item in items]


def decode_items(data: Sequence[Any]) -> list[Item]:
    return [from_wire(item, Item, strict=False) for item in data]


def tokens_from(data: bytes, typecode: str = "I") -> array[int]:
    out = array(typecode)
    out.frombytes(data)
    return out


# --- building and restoring compacted states ---------------------------------------------------


def compact_state(
    pipeline: Pipeline,
    source: ResponseState,
    policy: CompactionPolicy,
    seal: SnapshotSeal,
    *,
    owner: str | None,
) -> tuple[ResponseState, Compaction]:
    """The compacted window of `source` as a new state (a fresh lineage), and the compaction
    item that restores it. Stubs are rendered here (by `source`'s renderer); verbatim items
    reuse their tokens."""
    renderer = source.route.bound_renderer
    version = source.lineage.render_version or source.route.bound_version
    lineage = source.lineage
    items = list(source.items)
    costs = [lineage.token_count(i + 1) - lineage.token_count(i) for i in range(len(items))]
    rendered: dict[int, array[int]] = {}

    def stub_cost(stub: Item) -> tuple[Item, int]:
        tokens = renderer.render_item(stub)
        pipeline.counters.tokens_rendered += len(tokens)
        rendered[id(stub)] = tokens
        return stub, len(tokens)

    window, origin = compact_items(items, costs, stub_cost, policy)
    new = Lineage(version)
    state = pipeline.classifier.initial()
    open_calls: dict[str, str] = {}
    for item, index in zip(window, origin, strict=True):
        tokens = lineage.item_tokens(index) if index is not None else rendered[id(item)]
        new.append(item, tokens)
        verdict = pipeline.classifier.feed(state, renderer.item_text(item), len(tokens))
        pipeline.counters.chars_classified += verdict.scanned
        state = verdict.state
        call = call_of(item)
        answer = output_of(item) if call is None else None
        if call is not None:
            if status_of(item) != "incomplete":
                # A call cut off by max_output_tokens waits for no output (as in
                # `_validate.py`): a chain from the window accepts what the chain did.
                open_calls[call[0]] = call[2]
        elif answer is not None and answer[0] is not None:
            open_calls.pop(answer[0], None)
    classifier = pipeline.classifier
    payload = {
        "template": renderer.template_id,
        "renderer": version,
        "items": encode_items(window),
        "open": [[cid, name] for cid, name in open_calls.items()],
        "classifier": classifier.encode_state(state)
        if isinstance(classifier, SnapshotClassifier)
        else None,
        **new.snapshot(len(window)),
    }
    item = Compaction(
        id=new_id("cmp"), encrypted_content=seal.seal(payload, owner=owner), created_by="rollout"
    )
    compacted = attrs.evolve(
        source,
        lineage=new,
        n_items=len(window),
        classifier_state=state,
        open_calls=tuple(open_calls.items()),
        stored=False,
        first_new_item=0,
    )
    return compacted, item


def restore_state(
    pipeline: Pipeline,
    base: ResponseState,
    payload: dict[str, Any],
    *,
    param: str,
    route: Route | None,
) -> ResponseState:
    """`base` (an empty state) holding the conversation a snapshot describes, without
    rendering it (and without classifying it, when the classifier state was sealed too).
    The snapshot must be of `route`'s renderer; with no route (the request's model did not
    resolve: the route stage refuses it next), of the engine's default renderer."""
    renderer = pipeline.renderer if route is None else route.bound_renderer
    version = pipeline.render_version if route is None else route.bound_version
    try:
        if payload.get("template") != renderer.template_id:
            raise ValueError("it was made with another chat template")
        made = payload.get("renderer", pipeline.render_version)
        if made != version:
            raise ValueError(f"it was made with another tokenizer ({made}, not {version})")
        items = decode_items(payload["items"])
        lineage = Lineage.restore(
            items,
            tokens_from(payload["tokens"], "I"),
            tokens_from(payload["ends"], "Q"),
            list(payload["digests"]),
            tokens_from(payload["csu"], "I"),
            render_version=version,
        )
        classifier = pipeline.classifier
        if payload.get("classifier") is not None and isinstance(classifier, SnapshotClassifier):
            state = classifier.decode_state(payload["classifier"])
        else:
            state = classifier.initial()
            for i, item in enumerate(items):
                n = lineage.token_count(i + 1) - lineage.token_count(i)
                verdict = classifier.feed(state, renderer.item_text(item), n)
                state = verdict.state
                pipeline.counters.chars_classified += verdict.scanned
        open_calls = tuple((str(c), str(n)) for c, n in payload["open"])
    except (KeyError, TypeError, ValueError, RemoteProtocolError) as exc:
        raise RemoteProtocolError.invalid(
            f"Invalid compaction item: {exc}.", code="invalid_compaction", param=param
        ) from None
    return attrs.evolve(
        base,
        lineage=lineage,
        n_items=len(items),
        classifier_state=state,
        open_calls=open_calls,
        stored=False,
        first_new_item=len(items),
    )
