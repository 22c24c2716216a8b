"""The rendered state a stored response keeps, so that hydration renders nothing.

A stored response holds the items it added (`StoredResponse.items`: its input and output, or
the whole conversation for a root). Its *segment* is the rendering of exactly those items,
as msgpack (`StoredResponse.rendered`)::

    {"v": 1, "renderer": "<template_id>/<tokenizer name>",
     "tokens": bytes,            # the items' tokens (uint32, native order)
     "ends": bytes,              # cumulative token count after each item, from the segment's start
     "digests": [bytes], "keys": [bytes],  # the lineage's chained context digests and content
                                           # keys after each item (they continue the parent's)
     "csu": bytes,               # tool calls since the last user message, after each item
     "sizes": bytes,             # the memory estimate after each item, from the segment's
                                 # start (`Lineage.nbytes`)
     "classifier": ...,          # the classifier state after the response (SnapshotClassifier)
     "open": [[call_id, name]],  # calls waiting for output after the response
     "prefix": null | {"tokens": bytes, "classifier": ...}}  # instructions and tools, rendered:
                                 # only where they differ from the parent's

`renderer` is the render version of the response's tokens: its model's renderer (`Route.
renderer`, else the engine's default). Hydrating a chain whose segments all match the renderer
of the hydrated response's model concatenates them (copies of arrays, no rendering, no
classifying); any missing, foreign (another template or tokenizer: the model's renderer changed,
or the chain switched models on the way) or damaged segment makes hydration render the chain
instead (`Session._hydrate`), never fail.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import Any

import attrs
import msgpack

from ._compact import tokens_from
from ._interfaces import SnapshotClassifier, StoredResponse
from ._pipeline import Pipeline
from ._state import Lineage, Prefix, ResponseState, Route, digest_tokens, render_version
from ._tools import offered_tools

log = logging.getLogger("rollout.engine")

__all__ = ["SEGMENT_VERSION", "encode_segment", "render_version", "restore_segments"]

SEGMENT_VERSION = 1


def encode_segment(
    pipeline: Pipeline, state: ResponseState, *, start: int, with_prefix: bool
) -> bytes | None:
    """The segment of `state`'s items from `start` (see the module docstring); None when the
    classifier's state cannot be kept (hydration then classifies again)."""
    classifier = pipeline.classifier
    if not isinstance(classifier, SnapshotClassifier):
        return None
    version = state.lineage.render_version or state.route.bound_version
    lineage, n = state.lineage, state.n_items
    first = lineage.token_count(start)
    ends = array("Q", (lineage.token_count(i + 1) - first for i in range(start, n)))
    prefix = state.prefix
    payload = {
        "v": SEGMENT_VERSION,
        "renderer": version,
        "tokens": lineage.tokens[first : lineage.token_count(n)].tobytes(),
        "ends": ends.tobytes(),
        "digests": [lineage.digest(i + 1) for i in range(start, n)],
        "keys": [lineage.key(i + 1) for i in range(start, n)],
        "csu": array("I", (lineage.calls_since_user(i + 1) for i in range(start, n))).tobytes(),
        "sizes": array("Q", (lineage.nbytes_of(start, i + 1) for i in range(start, n))).tobytes(),
        "classifier": classifier.encode_state(state.classifier_state),
        "open": [list(call) for call in state.open_calls],
        "prefix": {
            "tokens": prefix.tokens.tobytes(),
            "classifier": classifier.encode_state(prefix.classifier_state),
        }
        if with_prefix
        else None,
    }
    packed: bytes = msgpack.packb(payload, use_bin_type=True)
    return packed


def restore_segments(
    pipeline: Pipeline, empty: ResponseState, chain: Sequence[StoredResponse], route: Route
) -> ResponseState | None:
    """The state of `chain[0]` (the chain newest first, down to a root) from its segments, or
    None when one is missing, foreign (not of `route`'s renderer) or damaged."""
    classifier = pipeline.classifier
    if not isinstance(classifier, SnapshotClassifier) or any(s.rendered is None for s in chain):
        return None
    version = route.bound_version
    try:
        segments = [_load(s.rendered, version) for s in reversed(chain)]
        items = [item for stored in reversed(chain) for item in stored.items]
        tokens = array("I")
        ends = array("Q")
        digests: list[bytes] = []
        keys: list[bytes] = []
        csu = array("I")
        sizes = array("Q")
        for segment in segments:
            offset = len(tokens)
            tokens.frombytes(segment["tokens"])
            ends.extend(offset + end for end in tokens_from(segment["ends"], "Q"))
            digests += segment["digests"]
            keys += segment["keys"]
            csu.frombytes(segment["csu"])
            base = sizes[-1] if sizes else 0
            sizes.extend(base + size for size in tokens_from(segment["sizes"], "Q"))
        lineage = Lineage.restore(
            items, tokens, ends, digests, csu, render_version=version, keys=keys, sizes=sizes
        )
        target, last = chain[0], segments[-1]
        prefix = _prefix(pipeline, target, chain, segments, version)
        if prefix is None:
            return None
        open_calls = tuple((str(c), str(name)) for c, name in last["open"])
        state = classifier.decode_state(last["classifier"])
    except _Foreign as exc:  # expected after a model switch or a change of renderer
        log.info("stored renderings of %s not used (%s): rendering it", chain[0].response.id, exc)
        return None
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        log.warning(
            "stored renderings of %s not used (%s): rendering it", chain[0].response.id, exc
        )
        return None
    own = 0 if target.is_root else len(items) - len(target.items)
    return attrs.evolve(
        empty,
        response=target.response,
        lineage=lineage,
        n_items=len(items),
        prefix=prefix,
        route=route,
        classifier_state=state,
        open_calls=open_calls,
        first_new_item=own,
    )


class _Foreign(ValueError):
    """A segment of another renderer than the one hydrating."""


def _load(blob: bytes | None, version: str) -> dict[str, Any]:
    segment = msgpack.unpackb(blob or b"", raw=False)
    if not isinstance(segment, dict) or segment.get("v") != SEGMENT_VERSION:
        raise ValueError("not a segment of this version")
    if segment.get("renderer") != version:
        raise _Foreign("rendered by another template or tokenizer")
    return segment


def _prefix(
    pipeline: Pipeline,
    target: StoredResponse,
    chain: Sequence[StoredResponse],
    segments: list[dict[str, Any]],
    version: str,
) -> Prefix | None:
    """The target's instructions and tools, from the newest segment that rendered them."""
    classifier = pipeline.classifier
    assert isinstance(classifier, SnapshotClassifier)
    for stored, segment in zip(chain, reversed(segments), strict=True):
        rendered = segment["prefix"]
        if rendered is None:
            continue
        if stored.instructions != target.instructions or stored.tools != target.tools:
            return None
        tokens = tokens_from(rendered["tokens"], "I")
        return Prefix(
            instructions=target.instructions,
            tools=tuple(target.tools),
            offered=offered_tools(target.tools, pipeline.hosted),
            tokens=tokens,
            digest=digest_tokens(tokens),
            classifier_state=classifier.decode_state(rendered["classifier"]),
            render_version=version,
        )
    return None
