"""JSON Schemas a client sends (function `parameters`, `text.format` json_schema): bounded,
then checked, in time and memory independent of how hostile they are.

A schema is walked once, iteratively, before anything else touches it: at most
`MAX_SCHEMA_NODES` JSON values, nested at most `MAX_SCHEMA_DEPTH` deep, no `enum` longer than
`MAX_ENUM_VALUES`, and no size keyword (`minItems`, `minLength`, `minProperties`, ...) above
`MAX_SIZE_KEYWORD`. Only then does jsonschema's `check_schema` run (its recursion is now
bounded), on a copy whose `enum` arrays are replaced by their canonical JSON strings:
draft-04's metaschema asks for unique enum values, and jsonschema compares unsortable values
(objects) pairwise, which is quadratic; strings sort, so uniqueness is checked in O(n log n)
with the same answer.

Each failure is a 400 naming the offending place (`tools[0].parameters`,
`text.format.schema`).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from rollout.protocol import RemoteProtocolError

__all__ = [
    "MAX_ENUM_VALUES",
    "MAX_REQUEST_SCHEMA_NODES",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_NODES",
    "MAX_SIZE_KEYWORD",
    "check_untrusted_schema",
    "count_nodes",
]

# JSON values in one schema. OpenAI's structured outputs allow up to 5,000 object properties
# in a schema; with their keyword objects that is ~10,000 values at most in practice.
MAX_SCHEMA_NODES = 20_000
# Nesting of JSON values (not of schemas): ~3 per schema level, so ~20 schema levels, twice
# what OpenAI's structured outputs allow (10); it also keeps jsonschema's recursion shallow.
MAX_SCHEMA_DEPTH = 64
# JSON values in all the schemas of one request (its function tools' parameters and its
# `text.format` schema). Checking a schema costs ~30 us per value (draft 7) to ~110 us (2020-12,
# the default, whose `$dynamicRef`s jsonschema resolves at every level): one schema at the
# limit above costs ~2 s. Without a budget a 64 MiB body holds ~4 million values (minutes of
# CPU); 50,000 is 1,024 tools of ~50 values each (a function with five described parameters
# has ~25), and at most ~6 s of a worker thread: a request whose schemas are large is checked
# off the event loop (`Engine.validate_off_loop`).
MAX_REQUEST_SCHEMA_NODES = 50_000
# Values of one `enum` (OpenAI allows 1,000 across a structured-outputs schema).
MAX_ENUM_VALUES = 1_000
# The largest lower bound a size keyword may ask for: anything that must produce that many
# items, characters or properties (a model writing the instance, a validator checking it).
MAX_SIZE_KEYWORD = 10_000
_LOWER_BOUNDS = frozenset({"minItems", "minLength", "minProperties", "minContains"})


def _invalid(message: str, param: str, code: str = "invalid_value") -> RemoteProtocolError:
    return RemoteProtocolError.invalid(message, code=code, param=param)


def _walk(schema: Any, param: str) -> Any:
    """Check the bounds; returns the copy to hand to `check_schema` (enums as strings)."""
    root: list[Any] = [None]
    stack: list[tuple[Any, list[Any] | dict[str, Any], Any, int]] = [(schema, root, 0, 0)]
    nodes = 0
    while stack:
        value, parent, key, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _invalid(
                f"The schema has more than {MAX_SCHEMA_NODES} values.",
                param,
            )
        if depth > MAX_SCHEMA_DEPTH:
            raise _invalid(f"The schema is nested more than {MAX_SCHEMA_DEPTH} levels deep.", param)
        if isinstance(value, dict):
            copy: dict[str, Any] = {}
            parent[key] = copy
            for name, sub in value.items():
                if name == "enum" and isinstance(sub, list):
                    if len(sub) > MAX_ENUM_VALUES:
                        raise _invalid(
                            f"An enum has {len(sub)} values, more than the limit of "
                            f"{MAX_ENUM_VALUES}.",
                            param,
                        )
                    # Counted and depth-checked like the rest, before they are serialized.
                    nodes = _count(sub, nodes, depth + 1, param)
                    copy[name] = [_canonical(v) for v in sub]
                    continue
                if name in _LOWER_BOUNDS and isinstance(sub, int | float):
                    if not isinstance(sub, bool) and sub > MAX_SIZE_KEYWORD:
                        raise _invalid(
                            f"'{name}' is {sub:g}, more than the limit of {MAX_SIZE_KEYWORD}.",
                            param,
                        )
                stack.append((sub, copy, name, depth + 1))
        elif isinstance(value, list):
            items: list[Any] = [None] * len(value)
            parent[key] = items
            for i, sub in enumerate(value):
                stack.append((sub, items, i, depth + 1))
        else:
            parent[key] = value
    return root[0]


def _count(value: Any, nodes: int, depth: int, param: str) -> int:
    """`nodes` plus the JSON values in `value`, within the node and depth bounds."""
    stack = [(value, depth)]
    while stack:
        node, level = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _invalid(f"The schema has more than {MAX_SCHEMA_NODES} values.", param)
        if level > MAX_SCHEMA_DEPTH:
            raise _invalid(f"The schema is nested more than {MAX_SCHEMA_DEPTH} levels deep.", param)
        if isinstance(node, dict):
            stack.extend((v, level + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, level + 1) for v in node)
    return nodes


def count_nodes(value: Any, cap: int) -> int:
    """The JSON values in `value`, counting up to `cap` at most (an iterative walk that stops
    there: the cost is bounded by `cap`, whatever the client sent)."""
    stack = [value]
    nodes = 0
    while stack and nodes < cap:
        node = stack.pop()
        nodes += 1
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return nodes


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def check_untrusted_schema(schema: Any, param: str, *, what: str) -> None:
    """Bound, then check, a client's JSON Schema. `what` names it in messages
    ("function 'f'", "text format 'x'")."""
    if not isinstance(schema, dict):
        raise _invalid(f"Invalid schema for {what}: a schema must be an object.", param)
    bounded = _walk(schema, param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(bounded)
    except jsonschema.SchemaError as exc:
        raise _invalid(
            f"Invalid schema for {what}: {exc.message}.",
            param,
            "invalid_function_parameters" if what.startswith("function") else "invalid_value",
        ) from None
