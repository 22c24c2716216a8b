"""Content keys of conversation items: what the render cache (`_render_cache.py`) is addressed by.

An item's key is a 128-bit digest of its canonical content: what it renders, classifies and
validates as. Two items with the same key are the same conversation item to every stage of
the pipeline, so a conversation prefix rendered once can be found again from the items a
client resends, with or without ids:

- left out: `id` (except where it names a call, as a `local_shell_call_output`'s does),
  `status` (but a call cut off as `incomplete` waits for no output, so that is kept),
  `created_by`, and an output text part's `annotations` and `logprobs`, none of which render;
- kept: `call_id` (it links an output to its call, and upstream models receive it), and every
  other field;
- the same: a message whose content is a string and one whose content is a single text part
  holding that string (an assistant message echoed back as `{"role": "assistant", "content":
  "..."}` is the output message it came from).

A difference this form does not normalize is a cache miss, never a wrong hit: a miss costs
one rendering, a wrong hit a wrong context. Keys are SHA-256 (hardware-accelerated on x86-64
and ARMv8, ~2 GB/s here) truncated to 16 bytes, over length-prefixed fields. A conversation's
key after n items is the chain `chain(key after n-1, item key)` from `ROOT_KEY`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from rollout.protocol import (
    ContentPart,
    CustomToolCall,
    FunctionCall,
    FunctionCallOutput,
    InputText,
    Item,
    Message,
    OutputText,
    call_of,
    output_of,
    status_of,
    to_wire,
)

from ._render import canonical_json

__all__ = ["KEY_BYTES", "ROOT_KEY", "chain_key", "item_key"]

KEY_BYTES = 16
ROOT_KEY = hashlib.sha256(b"rollout-conversation").digest()[:KEY_BYTES]

# Fields of an item's wire form that are not part of its key (see the module docstring).
_UNKEYED = frozenset({"id", "status", "created_by"})


def chain_key(previous: bytes, key: bytes) -> bytes:
    return hashlib.sha256(previous + key).digest()[:KEY_BYTES]


def item_key(item: Item) -> tuple[bytes, int]:
    """The content key of one item (see the module docstring), and the number of bytes of
    content it covers (what the render cache counts as the item's size)."""
    h = hashlib.sha256()
    size = 0

    def field(value: str) -> None:
        nonlocal size
        data = value.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        size += len(data)

    if isinstance(item, Message) and (texts := _texts(item.content)) is not None:
        field("message")
        field(item.role)
        field(item.phase or "")
        for text in texts:
            field(text)
    elif (
        isinstance(item, FunctionCall | CustomToolCall)
        and item.caller is None
        and (item.async_ is None)
    ):
        field(item.type)
        field(item.call_id)
        field(item.namespace or "")
        field(item.name)
        field(item.arguments if isinstance(item, FunctionCall) else item.input)
        field("incomplete" if item.status == "incomplete" else "")
    elif (
        isinstance(item, FunctionCallOutput)
        and item.name is None
        and item.namespace is None
        and item.caller is None
        and (texts := _texts(item.output)) is not None
    ):
        field("function_call_output")
        field(item.call_id or "")
        for text in texts:
            field(text)
    else:
        field("json")
        wire = {k: v for k, v in to_wire(item).items() if k not in _UNKEYED}
        answer = output_of(item)
        if answer is not None and answer[0] is not None:
            wire["\0answers"] = answer[0]  # a local shell output names its call in `id`
        if call_of(item) is not None and status_of(item) == "incomplete":
            wire["\0incomplete"] = True
        field(canonical_json(wire))
    return h.digest()[:KEY_BYTES], size


def _texts(content: str | Sequence[ContentPart]) -> list[str] | None:
    """The texts of content made of text only (a string, or input / output text parts with
    nothing but their text), else None (keyed by its full wire form instead)."""
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    for part in content:
        if isinstance(part, InputText) and part.prompt_cache_breakpoint is None:
            texts.append(part.text)
        elif isinstance(part, OutputText):
            texts.append(part.text)
        else:
            return None
    return texts
