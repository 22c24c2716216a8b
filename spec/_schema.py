"""Schema validity of what a Responses server emits: the Response object, every server event
(over server-sent events or WebSocket mode) and the compacted window of
`POST /responses/compact`, against `responses.schema.json` (our JSON Schema, draft 2020-12,
whose facts come from the Open Responses OpenAPI document and the official SDK's types).

Each function returns human-readable problems, each starting with the JSON path of the
offending value (`$.response.tools[0]: ...`); an empty list means valid. Besides the schema,
a few rules JSON Schema cannot state are checked here: token counts add up
(`total_tokens == input_tokens + output_tokens`, `cached_tokens <= input_tokens`,
`reasoning_tokens <= output_tokens`), a response completes after it was created, item ids and
call ids are unique within a response, a completed function call's arguments are JSON, a
`tool_choice` naming a function names one of the response's tools, and the `output_indices`
of the rollout extension's `response.done` ascend. (Whether `response.done` names the calls and
items the stream carried needs the stream: the `rollout.*` checks see to it.)
"""

from __future__ import annotations

import functools
import importlib.resources
import itertools
import json
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import referencing
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

__all__ = [
    "SCHEMA_FILE",
    "compaction_problems",
    "event_problems",
    "load_schema",
    "response_problems",
]

SCHEMA_FILE = "responses.schema.json"
# A quoted value in a problem is cut after this many characters.
_QUOTE = 80
# Problems reported for one object at most (a badly broken object repeats itself).
MAX_PROBLEMS = 20

Transport = Literal["ws", "sse"]
# The `$defs` entry validating each kind of object.
_ENTRY = {
    "response": "Response",
    "sse": "SseEvent",
    "ws": "WsEvent",
    "compaction": "CompactResource",
}
_LIFECYCLE = frozenset(
    {
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
        "response.done",
    }
)
_CALL_TYPES = frozenset(
    {
        "function_call",
        "custom_tool_call",
        "shell_call",
        "local_shell_call",
        "apply_patch_call",
        "computer_call",
    }
)


@functools.cache
def load_schema() -> dict[str, Any]:
    """The schema document, read once from the package."""
    text = (
        importlib.resources.files("rollout.spec").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    )
    schema: dict[str, Any] = json.loads(text)
    return schema


@functools.cache
def _validator(entry: str) -> Any:
    schema = load_schema()
    registry: referencing.Registry[Any] = (
        referencing.Resource.from_contents(schema) @ referencing.Registry()
    )
    return Draft202012Validator({"$ref": f"{schema['$id']}#/$defs/{entry}"}, registry=registry)


# --- the public checks -------------------------------------------------------------------------


def response_problems(obj: Any) -> list[str]:
    """Problems of a Response object (a JSON body of `POST /responses`, `GET /responses/{id}`)."""
    return _finish(_schema_problems("response", obj) + _response_rules(obj, "$"))


def event_problems(obj: Any, *, transport: Transport) -> list[str]:
    """Problems of one server event: `sse` for an event of a server-sent-events stream (its
    `error` is flat), `ws` for a WebSocket-mode message (its `error` is nested; the rollout
    extension's `response.done`, a rollout's resumed `response.in_progress` naming its response,
    and `rollout.timing` are allowed)."""
    if transport not in ("ws", "sse"):
        raise ValueError(f"transport must be 'ws' or 'sse', not {transport!r}")
    problems = _schema_problems(transport, obj)
    if isinstance(obj, Mapping):
        kind = obj.get("type")
        if kind in _LIFECYCLE:
            problems += _response_rules(obj.get("response"), "$.response")
        if kind == "response.done":
            problems += _done_rules(obj)
        if kind == "response.output_item.done" and isinstance(obj.get("item"), Mapping):
            problems += _item_rules(obj["item"], "$.item")
    return _finish(problems)


def compaction_problems(obj: Any) -> list[str]:
    """Problems of the answer of `POST /responses/compact` (a `response.compaction`)."""
    problems = _schema_problems("compaction", obj)
    if isinstance(obj, Mapping):
        problems += _usage_rules(obj.get("usage"), "$.usage")
        problems += _unique_ids(obj.get("output"), "$.output")
    return _finish(problems)


# --- schema errors as problems -----------------------------------------------------------------


def _schema_problems(kind: str, obj: Any) -> list[str]:
    validator = _validator(_ENTRY[kind])
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [line for error in errors for leaf in _leaves(error) for line in _describe(leaf)]


def _leaves(error: ValidationError) -> Iterator[ValidationError]:
    """The specific errors behind one error. For `anyOf`/`oneOf` (a nullable object, a union):
    the errors of the one branch whose shape the value has (a branch failing only because the
    value is not of its type, say `null`, is not meant), else the most relevant error."""
    if not error.context:
        yield error
        return
    branches: dict[Any, list[ValidationError]] = {}
    for sub in error.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    meant = [errs for errs in branches.values() if not all(map(_not_this_shape, errs))]
    chosen = meant[0] if len(meant) == 1 else [best_match(error.context)]
    for sub in chosen:
        yield from _leaves(sub)


def _not_this_shape(error: ValidationError) -> bool:
    return not error.path and error.validator in ("type", "enum", "const")


def _describe(error: ValidationError) -> list[str]:
    path = error.json_path
    if error.validator == "required":
        # One error per missing property, each carrying the whole list: name them all (the
        # duplicates are dropped by `_finish`).
        missing = [k for k in error.validator_value if k not in error.instance]
        return [f"{path}.{name}: required property is missing" for name in missing]
    return [_message(error, path)]


def _message(error: ValidationError, path: str) -> str:
    value = _quote(error.instance)
    kind = error.validator
    if kind == "type":
        expected = error.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        return f"{path}: {value} is not of type {expected}"
    if kind == "enum":
        return f"{path}: {value} is not one of {_quote(error.validator_value)}"
    if kind == "const":
        return f"{path}: {value} is not {_quote(error.validator_value)}"
    if kind == "not":
        return f"{path}: {value} is not allowed here"
    if kind in ("minimum", "maximum", "minItems", "minLength", "pattern", "uniqueItems"):
        return f"{path}: {value} fails {kind} {_quote(error.validator_value)}"
    return f"{path}: {_clip(error.message)}"


def _quote(value: Any) -> str:
    return _clip(json.dumps(value, ensure_ascii=False, default=repr))


def _clip(text: str) -> str:
    return text if len(text) <= _QUOTE else text[:_QUOTE] + "..."


def _finish(problems: list[str]) -> list[str]:
    unique = list(dict.fromkeys(problems))
    if len(unique) > MAX_PROBLEMS:
        return [*unique[:MAX_PROBLEMS], f"... and {len(unique) - MAX_PROBLEMS} more problems"]
    return unique


# --- rules JSON Schema cannot state ------------------------------------------------------------


def _int(value: Any) -> int | None:
    """An integer as JSON Schema counts them (`3` or `3.0`), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value)


def _usage_rules(usage: Any, path: str) -> list[str]:
    if not isinstance(usage, Mapping):
        return []
    problems = []
    total, inp, out = (
        _int(usage.get(k)) for k in ("total_tokens", "input_tokens", "output_tokens")
    )
    if total is not None and inp is not None and out is not None and total != inp + out:
        problems.append(
            f"{path}.total_tokens: {total} is not input_tokens + output_tokens = {inp + out}"
        )
    for details, key, whole in (
        ("input_tokens_details", "cached_tokens", "input_tokens"),
        ("output_tokens_details", "reasoning_tokens", "output_tokens"),
    ):
        part = usage.get(details)
        value = _int(part.get(key)) if isinstance(part, Mapping) else None
        limit = _int(usage.get(whole))
        if value is not None and limit is not None and value > limit:
            problems.append(f"{path}.{details}.{key}: {value} is more than {whole} ({limit})")
    return problems


def _unique_ids(items: Any, path: str) -> list[str]:
    if not isinstance(items, list):
        return []
    problems = []
    seen: dict[str, int] = {}
    calls: dict[str, int] = {}
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue
        item_id = item.get("id")
        if isinstance(item_id, str):
            if item_id in seen:
                problems.append(
                    f"{path}[{i}].id: {item_id!r} is also the id of item {seen[item_id]}"
                )
            seen.setdefault(item_id, i)
        call_id = item.get("call_id")
        if item.get("type") in _CALL_TYPES and isinstance(call_id, str):
            if call_id in calls:
                problems.append(
                    f"{path}[{i}].call_id: {call_id!r} is also the call_id of item {calls[call_id]}"
                )
            calls.setdefault(call_id, i)
    return problems


def _item_rules(item: Mapping[str, Any], path: str) -> list[str]:
    """A completed function call's arguments are a JSON text."""
    if item.get("type") != "function_call" or item.get("status") != "completed":
        return []
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        return []
    try:
        json.loads(arguments)
    except ValueError:
        return [f"{path}.arguments: {_quote(arguments)} is not JSON (the call is completed)"]
    return []


def _response_rules(response: Any, path: str) -> list[str]:
    if not isinstance(response, Mapping):
        return []
    problems = _usage_rules(response.get("usage"), f"{path}.usage")
    created, completed = _int(response.get("created_at")), _int(response.get("completed_at"))
    if created is not None and completed is not None and completed < created:
        problems.append(f"{path}.completed_at: {completed} is before created_at ({created})")
    output = response.get("output")
    problems += _unique_ids(output, f"{path}.output")
    if isinstance(output, list):
        for i, item in enumerate(output):
            if isinstance(item, Mapping):
                problems += _item_rules(item, f"{path}.output[{i}]")
    choice = response.get("tool_choice")
    tools = response.get("tools")
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(tools, list):
        names = set()
        for tool in tools:
            if not isinstance(tool, Mapping):
                continue
            members = tool.get("tools") if tool.get("type") == "namespace" else [tool]
            for member in members if isinstance(members, list) else []:
                if isinstance(member, Mapping) and member.get("type") == "function":
                    names.add(member.get("name"))
        if choice.get("name") not in names:
            problems.append(
                f"{path}.tool_choice.name: {_quote(choice.get('name'))} names no function of "
                "the response's tools"
            )
    return problems


def _done_rules(done: Mapping[str, Any]) -> list[str]:
    """`response.done`: the output indices of the step ascend."""
    indices = done.get("output_indices")
    if not isinstance(indices, list):
        return []
    return [
        f"$.output_indices[{i}]: {_quote(b)} does not follow {_quote(a)} (they ascend)"
        for i, (a, b) in enumerate(itertools.pairwise(indices), start=1)
        if _int(a) is not None and _int(b) is not None and b <= a
    ]
