"""Hostile input cannot stall or bloat the server (issue: hold under hostile input).

Against a real `rollout serve` process, each request from the probe that found the problems
(and the limits around them) is answered within `ANSWER_DEADLINE` with a 400 naming the
offending param, while a well-behaved client keeps completing responses on a WebSocket of its
own, and the process's peak RSS stays under `PEAK_RSS_BOUND`:

1. a `text.format` schema (or a tool's `parameters`) asking for `minItems` / `minLength` of
   1e308: refused before anything builds an instance;
2. a 5 MB body of 1.7 million empty arrays as `input`: the decoder stops at the first bad
   element, and a body that large is parsed off the event loop;
3. a draft-04 tool schema with an `enum` of 4,000 objects: refused by size; one of 1,000 (the
   limit) is checked in O(n log n), not pairwise;
4. malformed schemas (`"properties": "x"`, `"required": [["a"]]`), a tool schema nested 100
   levels, and `sim:tps=1e308,interval_ms=1e300`: clear 400s, never a traceback.

Generated variants (hypothesis): random bounds, nesting and enum sizes at random places in a
schema are refused or accepted with work bounded by the walk's node budget, and the simulated
model never raises anything but a `BackendError` on what gets through.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.engine._errors import BackendError
from rollout.engine._schemas import MAX_ENUM_VALUES, MAX_SCHEMA_NODES, _walk, check_untrusted_schema
from rollout.engine._sim import InstanceTooLarge, schema_instance

from tests.client_harness import open_rollout_process
from tests.server_harness import open_ws

# Each hostile request gets its answer within this (the probe saw no answer at all, or 12-31 s).
ANSWER_DEADLINE = 10
# The server's peak RSS over the whole run (the probe saw 2.5-3 GB); an idle server is ~90 MB.
PEAK_RSS_BOUND = 600 * 1024 * 1024


def deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "name": "f", "parameters": parameters}


def text_format(schema: Any) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "x", "schema": schema}}


OBJECTS = [{"k": i} for i in range(4000)]
CASES: list[tuple[str, str | dict[str, Any], str]] = [
    # (name, body, the param of the 400)
    (
        "text-format-minItems-1e308",
        {"model": "sim", "input": "answer", "store": False,
         "text": text_format({"type": "array", "minItems": 1e308})},
        "text.format.schema",
    ),
    (
        "text-format-minLength-1e308",
        {"model": "sim", "input": "a", "text": text_format({"type": "string", "minLength": 1e308})},
        "text.format.schema",
    ),
    (
        "tool-minItems-1e308",
        {"model": "sim", "input": "a", "tools": [tool(
            {"type": "object", "properties": {"a": {"type": "array", "minItems": 1e308}}}
        )]},
        "tools[0].parameters",
    ),
    (
        "tool-minLength-1e308",
        {"model": "sim", "input": "a", "tools": [tool(
            {"type": "object", "properties": {"a": {"type": "string", "minLength": 1e308}}}
        )]},
        "tools[0].parameters",
    ),
    (
        "input-of-1.7M-empty-arrays",
        '{"model":"sim","input":[' + ",".join(["[]"] * 1_700_000) + "]}",
        "input[0]",
    ),
    (
        "draft-04-enum-of-4000-objects",
        {"model": "sim", "input": "a", "tools": [tool({
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "object",
            "properties": {"a": {"enum": OBJECTS}},
        })]},
        "tools[0].parameters",
    ),
    (
        "properties-not-an-object",
        {"model": "sim", "input": "a", "text": text_format({"type": "object", "properties": "x"})},
        "text.format.schema",
    ),
    (
        "required-of-arrays",
        {"model": "sim", "input": "a",
         "text": text_format({"type": "object", "required": [["a"]]})},
        "text.format.schema",
    ),
    (
        "tool-schema-nested-100-levels",
        {"model": "sim", "input": "a", "tools": [tool(deep_schema(100))]},
        "tools[0].parameters",
    ),
    (
        "sim-parameters-out-of-range",
        {"model": "sim:tps=1e308,interval_ms=1e300", "input": "a"},
        "model",
    ),
]  # fmt: skip


async def test_hostile_requests_are_answered_quickly_in_bounded_memory(tmp_path: Path) -> None:
    answered: dict[str, tuple[int, dict[str, Any]]] = {}
    completed = 0
    served = trio.Event()  # set at each response the well-behaved client completes
    async with open_rollout_process(data_dir=tmp_path / "data") as server:
        url = server.url

        async def well_behaved(task_status: trio.TaskStatus[None]) -> None:
            nonlocal completed, served
            async with open_ws(url) as ws:
                task_status.started()
                while True:
                    events = await ws.create(model="sim:tokens=4", input="Hi", store=False)
                    assert events[-1].type == "response.completed"
                    completed += 1
                    served.set()
                    served = trio.Event()

        async with trio.open_nursery() as nursery:
            await nursery.start(well_behaved)
            async with httpx.AsyncClient(timeout=ANSWER_DEADLINE * 2) as client:
                for name, body, _param in CASES:
                    content = body if isinstance(body, str) else json.dumps(body)
                    with trio.fail_after(ANSWER_DEADLINE):
                        resp = await client.post(
                            f"{url}/responses",
                            content=content,
                            headers={"content-type": "application/json"},
                        )
                        # The other client is served meanwhile (or right after).
                        await served.wait()
                    answered[name] = (resp.status_code, resp.json())
                # The 1,000-object enum (at the limit) is accepted, its check bounded.
                with trio.fail_after(ANSWER_DEADLINE):
                    resp = await client.post(
                        f"{url}/responses",
                        json={"model": "sim", "input": "a", "tool_choice": "none", "tools": [
                            tool({
                                "$schema": "http://json-schema.org/draft-04/schema#",
                                "type": "object",
                                "properties": {"a": {"enum": OBJECTS[:MAX_ENUM_VALUES]}},
                            })
                        ]},
                    )  # fmt: skip
                assert resp.status_code == 200, resp.text
            nursery.cancel_scope.cancel()
        peak = server.peak_rss_bytes()
    log = server.tail(200)
    for name, _body, param in CASES:
        status, body = answered[name]
        assert status == 400, (name, body, log)
        assert body["error"]["param"] == param, (name, body)
        assert body["error"]["message"], name
    assert peak < PEAK_RSS_BOUND, f"peak RSS {peak / 2**20:.0f} MiB"
    assert "Traceback" not in log, log


# --- generated variants ------------------------------------------------------------------------

BOUND_KEYWORDS = ["minItems", "minLength", "minProperties", "maxItems", "maxLength"]
hostile_numbers = st.sampled_from([0, 3, 10_000, 10_001, 1e6, 1e308, 2**63 - 1, 1.5])


@st.composite
def hostile_schemas(draw: st.DrawFn) -> Any:
    """Schemas with hostile numbers, depths and enum sizes at random places."""
    depth = draw(st.integers(0, 80))
    leaf: dict[str, Any] = {"type": draw(st.sampled_from(["array", "string", "object"]))}
    for key in draw(st.lists(st.sampled_from(BOUND_KEYWORDS), max_size=3, unique=True)):
        leaf[key] = draw(hostile_numbers)
    if draw(st.booleans()):
        leaf["enum"] = [{"i": i} for i in range(draw(st.sampled_from([1, 10, 1000, 1001])))]
    if draw(st.booleans()):
        leaf["items"] = {"type": "string", "minLength": draw(hostile_numbers)}
    schema: Any = leaf
    for _ in range(depth):
        schema = draw(
            st.sampled_from(
                [
                    {"type": "object", "properties": {"p": schema}, "required": ["p"]},
                    {"type": "array", "items": schema, "minItems": 1},
                    {"anyOf": [schema]},
                ]
            )
        )
    return schema


@settings(max_examples=200, deadline=None)
@given(schema=hostile_schemas(), seed=st.integers(0, 2**32))
def test_generated_hostile_schemas_are_refused_or_bounded(schema: Any, seed: int) -> None:
    try:
        check_untrusted_schema(schema, "text.format.schema", what="text format 'x'")
    except p.RemoteProtocolError as exc:
        assert exc.status == 400 and exc.param == "text.format.schema"
        return
    # Accepted: the walk's copy is within the node budget, and an instance is either produced
    # or refused by the instance budget (never another exception, never unbounded work).
    assert _walk(schema, "x") is not None
    try:
        document = json.dumps(schema_instance(schema, random.Random(seed)))
    except InstanceTooLarge:
        return
    assert len(document) < 2_000_000


def test_a_schema_over_the_node_budget_is_refused_before_it_is_checked() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(12_000)}}
    with pytest.raises(p.RemoteProtocolError) as refused:
        check_untrusted_schema(schema, "tools[0].parameters", what="function 'f'")
    assert str(MAX_SCHEMA_NODES) in refused.value.body.message


def test_enums_are_checked_as_canonical_strings() -> None:
    """What jsonschema's metaschema check sees: each enum as sortable strings (uniqueness in
    O(n log n)); duplicates are still duplicates."""
    copy = _walk({"enum": [{"b": 1, "a": 2}, [1], "x"]}, "p")
    assert copy == {"enum": ['{"a":2,"b":1}', "[1]", '"x"']}
    duplicate = {"$schema": "http://json-schema.org/draft-04/schema#", "enum": [{"a": 1}, {"a": 1}]}
    with pytest.raises(p.RemoteProtocolError):
        check_untrusted_schema(duplicate, "p", what="function 'f'")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": "x"},
        {"type": "object", "properties": {"a": {}}, "required": [["a"]]},
        {"type": "array", "minItems": "many"},
        {"type": "integer", "minimum": "low"},
        {"anyOf": "x"},
    ],
)
def test_the_simulated_model_never_raises_on_a_malformed_schema(schema: Any) -> None:
    """Defence in depth behind validation: the model writes a best-effort instance or fails
    the response (`BackendError`), never an exception that would reach the transport."""
    from rollout.engine._sim import _written

    try:
        _written("x", lambda: json.dumps(schema_instance(schema, random.Random(0))))
    except BackendError:
        pass


def test_the_decoder_stops_at_the_first_bad_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """However many bad elements follow, one error is built (the probe saw one per element:
    31 s and 3 GB for 1.7 million)."""
    from rollout.protocol._validate import InvalidField

    made = 0
    original = InvalidField.wrong_type.__func__  # type: ignore[attr-defined]

    def counting(cls: type[InvalidField], *args: Any, **kwargs: Any) -> InvalidField:
        nonlocal made
        made += 1
        return original(cls, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(InvalidField, "wrong_type", classmethod(counting))
    body = '{"model":"sim","input":[' + ",".join(["[]"] * 100_000) + "]}"
    with pytest.raises(p.RemoteProtocolError) as refused:
        p.decode_create_body(body)
    assert refused.value.param == "input[0]"
    assert made == 1
