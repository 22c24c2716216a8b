"""Pure analysis of event streams and responses, as plain JSON dicts. Sans-IO.

Every function returns a list of problems (empty when all is well) or raises `CheckFailed`
with one; a problem says what was observed and what was expected. Nothing here assumes a
particular model: items other than messages and function calls (reasoning, hosted tools) are
allowed wherever an item may appear, with whatever events they carry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from types import EllipsisType
from typing import Any

from rollout.protocol import (
    RESPONSE_END_TYPES,
    ClientConnection,
    Phase,
    RemoteProtocolError,
    sequence_problem,
    valid_stream_id,
)

from ._client import CheckFailed, describe_value

__all__ = [
    "as_dict",
    "call_items",
    "call_problems",
    "completed_response",
    "error_problems",
    "expect_error",
    "first_difference",
    "lifecycle_problems",
    "message_text",
    "normal_items",
    "order_problems",
    "sequence_problems",
    "shape",
    "text_problems",
]

Event = dict[str, Any]


def _q(value: Any) -> str:
    return describe_value(value)


def as_dict(value: Any) -> dict[str, Any]:
    """`value` when it is a JSON object, else an empty one (for lenient field access)."""
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def completed_response(events: Sequence[Event], what: str = "the response") -> dict[str, Any]:
    """The `response` of a stream that ended with `response.completed`, or `CheckFailed`
    naming what ended it instead."""
    if not events:
        raise CheckFailed(f"{what}: no events")
    last = events[-1]
    kind = last.get("type")
    if kind == "error":
        error = as_dict(last.get("error"))
        raise CheckFailed(
            f"{what}: expected response.completed, observed error "
            f"{_q(error.get('code'))}: {_q(error.get('message'))}"
        )
    if kind != "response.completed":
        raise CheckFailed(f"{what}: expected response.completed, observed {kind}")
    response = last.get("response")
    if not isinstance(response, dict):
        raise CheckFailed(f"{what}: response.completed has no `response` object")
    if response.get("status") != "completed":
        raise CheckFailed(
            f"{what}: response.completed carries status {_q(response.get('status'))}, "
            "expected 'completed'"
        )
    output = response.get("output")
    if not isinstance(output, list):
        raise CheckFailed(f"{what}: the completed response has no `output` list")
    return response


# --- errors ----------------------------------------------------------------------------------


def error_problems(
    event: Mapping[str, Any],
    *,
    code: str,
    status: int | None = 400,
    param: str | EllipsisType | None = ...,
    error_type: str | None = "invalid_request_error",
) -> list[str]:
    """Problems of a WebSocket `error` event against the expected status, code and param
    (`...` for param: not checked). The shape: `{"type": "error", "status": int,
    "error": {"type": str, "code": str|null, "message": str, "param": str|null}}`."""
    if event.get("type") != "error":
        brief = event.get("type")
        if brief == "response.created":
            return [f"expected an error event with code {code!r}, observed response.created"]
        return [f"expected an error event with code {code!r}, observed {brief}"]
    problems: list[str] = []
    body = event.get("error")
    if not isinstance(body, dict):
        return [f"the error event has no nested `error` object: {_q(event)}"]
    if body.get("code") != code:
        problems.append(f"error.code: expected {code!r}, observed {_q(body.get('code'))}")
    if status is not None and event.get("status") != status:
        problems.append(f"status: expected {status}, observed {_q(event.get('status'))}")
    if error_type is not None and body.get("type") != error_type:
        problems.append(f"error.type: expected {error_type!r}, observed {_q(body.get('type'))}")
    elif not isinstance(body.get("type"), str):
        problems.append(f"error.type: expected a string, observed {_q(body.get('type'))}")
    if not isinstance(body.get("message"), str) or not body.get("message"):
        problems.append(
            f"error.message: expected a non-empty string, observed {_q(body.get('message'))}"
        )
    if param is not ... and body.get("param") != param:
        problems.append(f"error.param: expected {param!r}, observed {_q(body.get('param'))}")
    return problems


def expect_error(event: Mapping[str, Any], **expected: Any) -> None:
    problems = error_problems(event, **expected)
    if problems:
        raise CheckFailed("; ".join(problems))


# --- sequence numbers and order --------------------------------------------------------------


def sequence_problems(events: Sequence[Event], *, start: int = 0) -> list[str]:
    """Every event carries an integer `sequence_number`; they start at `start` and grow by
    exactly one per event (the protocol's numbering rule, applied to a list that may begin
    mid-response, e.g. after a rollout resumed)."""
    for expected, event in enumerate(events, start=start):
        problem = sequence_problem(event.get("type"), event.get("sequence_number"), expected)
        if problem is not None:
            return [problem]
    return []


def lifecycle_problems(events: Sequence[Event], *, suspensions: bool = False) -> list[str]:
    """The order rules of WebSocket mode, as `rollout.protocol`'s client connection applies
    them (one grammar, `protocol/_state.py`, for the server, its builder, the clients and this
    harness): `[response.queued] response.created response.in_progress ... terminal`,
    sequence numbers from 0 without gaps, every lifecycle event naming the same response, and
    with `suspensions` (a rollout) `response.done` followed by `response.in_progress` once the
    pending calls are answered; inside, the item grammar (see `order_problems`). The first
    violation, or none."""
    if not events:
        return ["the response has no events"]
    connection = ClientConnection()
    create: dict[str, Any] = {"type": "response.create", "rollout": suspensions}
    lane = events[0].get("stream_id")
    if not isinstance(lane, str):
        lane = None
    elif valid_stream_id(lane):  # a response on a named lane: its events carry the lane
        create["stream_id"] = lane
    connection.sent_raw(create)
    for n, event in enumerate(events):
        kind = event.get("type")
        view = connection.lane(lane)
        if kind in RESPONSE_END_TYPES and view is not None and view.open_item is not None:
            return [f"item {view.open_item} was never done"]  # (a failed response's too)
        try:
            connection.receive_json(event)
        except RemoteProtocolError as exc:
            reason = str(exc.__cause__ or exc)
            return [f"event {n} ({kind}): {reason.removeprefix(f'{kind}: ')}"]
        view = connection.lane(lane)
        if view is None or view.response_id is None:
            return [f"the response begins with {kind}, expected response.created"]
        if kind == "response.done":  # answer every pending call, as the client would
            outputs = [
                {"type": "function_call_output", "call_id": call_id}
                for call_id in view.pending_call_ids
            ]
            connection.sent_raw(
                {"type": "response.append", "response_id": view.response_id, "input": outputs}
            )
    view = connection.lane(lane)
    if view is None or view.phase is not Phase.IDLE:
        return [f"the response ends with {events[-1].get('type')}, expected a terminal event"]
    return []


def order_problems(events: Sequence[Event], *, suspensions: bool = False) -> list[str]:
    """The event grammar of one response, replayed through `rollout.protocol`'s client
    connection (`lifecycle_problems`): its table in `protocol/_state.py` is the one grammar.

        [response.queued] response.created response.in_progress item* terminal

    where an item is `output_item.added` ... `output_item.done` for one `output_index` (in
    increasing order from 0, one item at a time); a message's content parts are
    `content_part.added` (text|refusal deltas) (text|refusal done) `content_part.done`; a
    function call has `function_call_arguments.delta`* then `.done` and no content parts (a
    custom tool call likewise `custom_tool_call_input`); every part, text and call event
    names its item (`output_index`, `item_id`) and part (`content_index`). With
    `suspensions` (the rollout extension), `response.done` response.in_progress may appear
    between items. Events of unknown types are allowed between items or inside the item
    their `output_index` names. An item left open at the end was never done (even when the
    response failed). The first violation, or none.
    """
    return lifecycle_problems(events, suspensions=suspensions)


# --- consistency of deltas, done events and the final output ---------------------------------


def _final_output(events: Sequence[Event]) -> list[Any]:
    response = events[-1].get("response") if events else None
    output = response.get("output") if isinstance(response, dict) else None
    return output if isinstance(output, list) else []


def _item_done(events: Sequence[Event]) -> dict[int, dict[str, Any]]:
    done: dict[int, dict[str, Any]] = {}
    for event in events:
        if event.get("type") == "response.output_item.done" and isinstance(event.get("item"), dict):
            index = event.get("output_index")
            if isinstance(index, int):
                done[index] = event["item"]
    return done


def text_problems(events: Sequence[Event]) -> list[str]:
    """For every output_text part: the concatenated deltas equal `output_text.done.text`,
    the `content_part.done` part's text, the text in `output_item.done` and the text in the
    terminal response's `output`. Raises `CheckFailed` when there is no message at all."""
    problems: list[str] = []
    done_items = _item_done(events)
    final = _final_output(events)
    found = False
    for index, item in sorted(done_items.items()):
        if item.get("type") != "message":
            continue
        found = True
        item_id = item.get("id")
        content = as_list(item.get("content"))
        for ci, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "output_text":
                continue

            def of(kind: str, ci: int = ci, item_id: Any = item_id) -> list[Event]:
                return [
                    e
                    for e in events
                    if e.get("type") == kind
                    and e.get("item_id") == item_id
                    and e.get("content_index") == ci
                ]

            deltas = "".join(str(e.get("delta", "")) for e in of("response.output_text.delta"))
            views: list[tuple[str, Any]] = []
            text_done = of("response.output_text.done")
            views.append(("output_text.done.text", text_done[0].get("text") if text_done else None))
            part_done = of("response.content_part.done")
            part_obj = part_done[0].get("part") if part_done else None
            views.append(
                (
                    "content_part.done.part.text",
                    part_obj.get("text") if isinstance(part_obj, dict) else None,
                )
            )
            views.append(("output_item.done text", part.get("text")))
            final_text = None
            if index < len(final) and isinstance(final[index], dict):
                if final[index].get("id") != item_id:
                    problems.append(
                        f"output[{index}].id is {_q(final[index].get('id'))} in the terminal "
                        f"response, expected {_q(item_id)}"
                    )
                fcontent = final[index].get("content")
                if (
                    isinstance(fcontent, list)
                    and ci < len(fcontent)
                    and isinstance(fcontent[ci], dict)
                ):
                    final_text = fcontent[ci].get("text")
            views.append((f"response output[{index}] text", final_text))
            for name, value in views:
                if value != deltas:
                    problems.append(
                        f"item {index} part {ci}: the deltas concatenate to {_q(deltas)} but "
                        f"{name} is {_q(value)}"
                    )
    if not found:
        raise CheckFailed("the response has no assistant message to check")
    return problems[:5]


def call_items(output: Iterable[Any]) -> list[dict[str, Any]]:
    return [i for i in output if isinstance(i, dict) and i.get("type") == "function_call"]


def call_problems(events: Sequence[Event], *, name: str | None = None) -> list[str]:
    """For every function call: the concatenated argument deltas equal
    `function_call_arguments.done.arguments`, the item's `arguments` in `output_item.done` and
    in the terminal response's `output`, and parse as a JSON object; `call_id` and `name` agree
    everywhere. Raises `CheckFailed` when there is no call."""
    problems: list[str] = []
    done_items = _item_done(events)
    final = _final_output(events)
    added = {
        e.get("output_index"): e.get("item")
        for e in events
        if e.get("type") == "response.output_item.added" and isinstance(e.get("item"), dict)
    }
    calls = [(i, it) for i, it in sorted(done_items.items()) if it.get("type") == "function_call"]
    if not calls:
        raise CheckFailed("the response has no function_call item to check")
    for index, item in calls:
        item_id = item.get("id")
        deltas = "".join(
            str(e.get("delta", ""))
            for e in events
            if e.get("type") == "response.function_call_arguments.delta"
            and e.get("item_id") == item_id
        )
        dones = [
            e
            for e in events
            if e.get("type") == "response.function_call_arguments.done"
            and e.get("item_id") == item_id
        ]
        views: list[tuple[str, Any]] = [
            (
                "function_call_arguments.done.arguments",
                dones[0].get("arguments") if dones else None,
            ),
            ("output_item.done arguments", item.get("arguments")),
        ]
        final_item = final[index] if index < len(final) and isinstance(final[index], dict) else {}
        views.append((f"response output[{index}].arguments", final_item.get("arguments")))
        for view, value in views:
            if value != deltas:
                problems.append(
                    f"call {index}: the deltas concatenate to {_q(deltas)} but {view} is "
                    f"{_q(value)}"
                )
        try:
            parsed = json.loads(deltas)
        except ValueError:
            problems.append(f"call {index}: the arguments {_q(deltas)} are not JSON")
        else:
            if not isinstance(parsed, dict):
                problems.append(f"call {index}: the arguments {_q(deltas)} are not a JSON object")
        first = added.get(index) or {}
        for key in ("call_id", "name"):
            seen = {first.get(key), item.get(key), final_item.get(key)}
            if len(seen) != 1:
                problems.append(
                    f"call {index}: {key} differs between added/done/output: "
                    f"{sorted(map(str, seen))}"
                )
        if name is not None and item.get("name") != name:
            problems.append(f"call {index}: name {_q(item.get('name'))}, expected {name!r}")
    return problems[:5]


# --- comparing outputs -----------------------------------------------------------------------


def message_text(item: Mapping[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p)


def normal_items(output: Iterable[Any]) -> list[dict[str, Any]]:
    """Output items without what a server generates afresh each time (ids, call ids):
    messages as role + text, calls as name + parsed arguments, other items by type."""
    out: list[dict[str, Any]] = []
    for item in output:
        if not isinstance(item, dict):
            out.append({"type": repr(item)})
            continue
        kind = item.get("type")
        if kind == "message":
            out.append({"type": kind, "role": item.get("role"), "text": message_text(item)})
        elif kind == "function_call":
            arguments = item.get("arguments")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                pass
            out.append({"type": kind, "name": item.get("name"), "arguments": arguments})
        else:
            out.append({"type": kind})
    return out


def shape(output: Iterable[Any]) -> list[str]:
    """The item kinds of an output (calls with their function name)."""
    kinds = []
    for item in normal_items(output):
        kinds.append(
            f"function_call:{item['name']}"
            if item["type"] == "function_call"
            else str(item["type"])
        )
    return kinds


def first_difference(a: Sequence[Any], b: Sequence[Any], *, names: tuple[str, str]) -> str | None:
    """The first difference between two outputs modulo ids, or None when they are equal."""
    left, right = normal_items(a), normal_items(b)
    for n, (x, y) in enumerate(zip(left, right, strict=False)):
        if x != y:
            return f"item {n}: {names[0]} has {_q(x)}, {names[1]} has {_q(y)}"
    if len(left) != len(right):
        return f"{names[0]} has {len(left)} items, {names[1]} has {len(right)}"
    return None
