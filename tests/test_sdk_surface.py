"""Every request field, tool type, tool choice and input item type the installed `openai` SDK
can send is accepted: the lists come from the SDK's own types (`tests/sdk_surface.py`), never
from a hand-written list, so a new SDK field shows up here as a failing test.

- Decoding: for each TypedDict of the input-item, tool and tool-choice unions, an instance with
  every field and one with only the required fields decode without error, and decode again to
  the same value after encoding.
- Serving: each create field, sent to a real server over HTTP and over WebSocket, gives a
  completed response, except the few rollout refuses by design with `unsupported_parameter`
  naming the field (docs/protocol.md's request-field table says why).
- Conversations: a representative of each input item type (a call together with its output)
  goes through a two-turn conversation over HTTP (stored, listed back by `input_items`,
  continued on a WebSocket) and over WebSocket (cached on the socket); each tool type is
  declared through two turns and echoed back; and `sim` calls each tool kind a client runs
  (function, custom text and grammar, shell, local shell, apply_patch, computer), whose output
  is sent back and answered.
"""

from __future__ import annotations

import collections.abc
import copy
import json
import typing
from typing import Any

import httpx
import pytest
import trio
import typing_extensions as te
from rollout import protocol as p
from rollout.protocol._shapes import BUILTIN_TOOL_SHAPES, NESTED_TOOL_SHAPES, OPAQUE_ITEM_SHAPES

from tests.sdk_surface import (
    CREATE_FIELDS,
    INPUT_ITEM_TYPES,
    TOOL_CHOICE_TYPES,
    TOOL_TYPES,
    WS_CREATE_FIELDS,
    fields,
    instance,
    members,
    type_tags,
)
from tests.server_harness import open_test_server, open_ws

DEADLINE = 30
MODEL = "sim:tokens=8"

# Create fields rollout refuses by design, each with `unsupported_parameter` naming it: it
# cannot honour them, and ignoring them would mislead (docs/protocol.md: request fields).
REFUSED = {
    "conversation": "no Conversations API; use previous_response_id",
    "prompt": "no stored prompt templates",
    "background": "no background mode",
}
# Fields of WebSocket mode only: served over WebSocket, left out of the HTTP body (HTTP refuses
# them with `unsupported_parameter`: tests/test_server_http.py).
WS_ONLY = {"generate", "stream", "stream_id"}
# Fields whose instance the engine cannot take as is (they name things that must exist).
SEMANTIC = {"previous_response_id": "names a response that must exist"}


def _name(td: Any) -> str:
    return f"{td.__name__}:{'/'.join(type_tags(td)) or '-'}"


def _decode(body: dict[str, Any]) -> p.ResponseCreate:
    request = p.decode_create_body(json.dumps(body))
    again = p.decode_create_body(p.encode_json(request).replace('"type":"response.create",', ""))
    assert again == request
    return request


# --- decoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("full", [True, False], ids=["every-field", "required-only"])
@pytest.mark.parametrize("td", INPUT_ITEM_TYPES, ids=_name)
def test_every_input_item_type_decodes(td: Any, full: bool) -> None:
    item = instance(td, full=full)
    request = _decode({"model": "m", "input": [item]})
    assert isinstance(request.input, list) and len(request.input) == 1
    wire = p.to_wire(request.input[0])
    tags = type_tags(td)
    assert wire["type"] in (tags or ["item_reference", "message"])


@pytest.mark.parametrize("full", [True, False], ids=["every-field", "required-only"])
@pytest.mark.parametrize("td", TOOL_TYPES, ids=_name)
def test_every_tool_type_decodes(td: Any, full: bool) -> None:
    for tag in type_tags(td):
        tool = {**instance(td, full=full), "type": tag}
        request = _decode({"model": "m", "tools": [tool]})
        assert request.tools is not None and request.tools[0].type == tag


@pytest.mark.parametrize("td", TOOL_CHOICE_TYPES, ids=_name)
def test_every_tool_choice_decodes(td: Any) -> None:
    for tag in type_tags(td):
        request = _decode({"model": "m", "tool_choice": {**instance(td), "type": tag}})
        assert not isinstance(request.tool_choice, str)


@pytest.mark.parametrize("field", sorted(set(CREATE_FIELDS) | set(WS_CREATE_FIELDS) - {"type"}))
def test_every_create_field_decodes(field: str) -> None:
    spec = WS_CREATE_FIELDS.get(field) or CREATE_FIELDS[field]
    value = instance(spec[1], key=field)
    event = json.dumps({"type": "response.create", "model": "m", field: value})
    decoded = p.decode_client_event(event)
    assert isinstance(decoded, p.ResponseCreate)
    assert getattr(decoded, field) is not None


def test_keys_of_carried_kinds_the_sdk_does_not_list_are_kept() -> None:
    """Codex (against the live API) sends `web_search` with `search_content_types`, which the
    SDK's type lacks: built-in tools and opaque items carry unknown keys as given."""
    tool = {"type": "web_search", "search_content_types": ["text", "image"], "new_knob": 1}
    item = {"type": "mcp_call", "id": "m", "name": "n", "server_label": "s", "arguments": "{}"}
    request = _decode({"model": "m", "tools": [tool], "input": [{**item, "new_field": True}]})
    assert request.tools is not None and p.to_wire(request.tools[0]) == tool
    assert isinstance(request.input, list)
    assert p.to_wire(request.input[0]) == {**item, "new_field": True}


def _sdk_literals(tp: Any) -> tuple[str, set[str]] | None:
    """("string", values) when a field is a Literal (or an optional one); ("array", values)
    when it is a list of a Literal."""
    values: set[str] = set()
    kind = "string"
    for member in members(tp):
        if member is type(None):
            continue
        args = typing.get_args(member)
        if typing.get_origin(member) in (list, collections.abc.Iterable) and args:
            kind, member, args = "array", args[0], typing.get_args(args[0])
        if typing.get_origin(member) is not typing.Literal:
            return None
        values |= {str(v) for v in args}
    return (kind, values) if values else None


def _shape_literals(spec: str) -> tuple[str, set[str]] | None:
    for kind in spec.split("|"):
        head, _, values = kind.partition("=")
        if values:
            return head, set(values.split(","))
    return None


def test_carried_kinds_take_the_sdks_literal_values() -> None:
    """A carried kind's string field that the SDK types as a Literal accepts exactly its
    values (anything else is `invalid_value`, as the live API answers, instead of being
    echoed into a response the SDK cannot parse); a plain string field takes any string."""
    checked = 0
    for td, shapes in [(td, BUILTIN_TOOL_SHAPES) for td in TOOL_TYPES] + [
        (td, OPAQUE_ITEM_SHAPES) for td in INPUT_ITEM_TYPES
    ]:
        for tag in type_tags(td):
            shape = {k.rstrip("?"): v for k, v in shapes.get(tag, {}).items()}
            for name, (_, tp) in fields(td).items():
                if name == "type" or name not in shape:
                    continue
                assert _shape_literals(shape[name]) == _sdk_literals(tp), (tag, name)
                checked += 1
    assert checked > 80, checked
    tool = {"type": "tool_search", "execution": ""}
    with pytest.raises(p.RemoteProtocolError) as refused:
        _decode({"model": "m", "tools": [tool]})
    assert (refused.value.code, refused.value.param) == ("invalid_value", "tools[0].execution")


def _tagged_variants(tp: Any) -> dict[str, tuple[set[str], dict[str, Any]]]:
    """The TypedDicts of a field's union tagged by a required `type`: value -> (the other
    required keys, field -> type)."""
    out: dict[str, tuple[set[str], dict[str, Any]]] = {}
    for member in members(tp):
        args = typing.get_args(member)
        if typing.get_origin(member) is not None and not te.is_typeddict(member):
            for arg in args:
                out |= _tagged_variants(arg)
            continue
        if not te.is_typeddict(member):
            continue
        known = fields(member)
        if "type" not in known or not known["type"][0]:
            continue
        required = {k for k, (req, _) in known.items() if req and k != "type"}
        for tag in type_tags(member):
            out[tag] = (required, {k: t for k, (_, t) in known.items() if k != "type"})
    return out


def test_nested_tagged_objects_of_tools_are_the_sdks() -> None:
    """Objects inside built-in tools that the SDK types as unions tagged by `type` (a
    container, an environment, filters, a user location) take exactly its variants, each
    with its required keys and Literal values; a wrong one is refused with the nested param."""
    checked = 0
    for td in TOOL_TYPES:
        for tag in type_tags(td):
            if tag not in BUILTIN_TOOL_SHAPES:
                continue
            for name, (_, tp) in fields(td).items():
                variants = _tagged_variants(tp)
                ours = NESTED_TOOL_SHAPES.get(tag, {}).get(name)
                if not variants:
                    assert ours is None, (tag, name)
                    continue
                assert ours is not None and set(ours) == set(variants), (tag, name)
                for value, (required, types) in variants.items():
                    shape = {k.rstrip("?"): v for k, v in ours[value].items()}
                    mine = {k.rstrip("?") for k in ours[value] if not k.endswith("?")}
                    assert mine == required, (tag, name, value)
                    for key, key_type in types.items():
                        assert key in shape, (tag, name, value, key)
                        assert _shape_literals(shape[key]) == _sdk_literals(key_type), key
                    checked += 1
    assert checked >= 15, checked
    tool = {"type": "code_interpreter", "container": {}}
    with pytest.raises(p.RemoteProtocolError) as refused:
        _decode({"model": "m", "tools": [tool]})
    assert refused.value.param == "tools[0].container.type"
    tool = {"type": "shell", "environment": {"type": "container_reference"}}
    with pytest.raises(p.RemoteProtocolError) as refused:
        _decode({"model": "m", "tools": [tool]})
    assert refused.value.param == "tools[0].environment.container_id"


def test_the_lists_are_the_sdks() -> None:
    """Guards against an empty or stale derivation: the unions hold what we know is there."""
    item_tags = {t for td in INPUT_ITEM_TYPES for t in type_tags(td)}
    assert {"function_call_output", "shell_call", "mcp_call", "program_output"} <= item_tags
    tool_tags = {t for td in TOOL_TYPES for t in type_tags(td)}
    assert {"function", "custom", "web_search", "apply_patch", "tool_search"} <= tool_tags
    assert {"client_metadata"}.isdisjoint(CREATE_FIELDS)  # Codex's field is not in the SDK
    assert {"generate", "stream_id", "stream"} <= set(WS_CREATE_FIELDS)


# --- serving each create field ----------------------------------------------------------------


def _field_value(field: str) -> Any:
    spec = WS_CREATE_FIELDS.get(field) or CREATE_FIELDS[field]
    value = instance(spec[1], key=field)
    if field == "input":
        return "Hello"
    if field == "model":
        return MODEL
    if field == "tools":  # a function tool; every tool type is served below
        return [{"type": "function", "name": "tool_a", "parameters": {"type": "object"}}]
    if field == "stream_id":
        return "lane-1"
    if field == "max_output_tokens":  # room for the answer (1 would end it incomplete)
        return 64
    return value


SERVED_FIELDS = sorted(
    (set(CREATE_FIELDS) | set(WS_CREATE_FIELDS)) - {"type", "input", "model"} - set(SEMANTIC)
)


@pytest.mark.parametrize("field", SERVED_FIELDS)
async def test_every_create_field_is_served(field: str) -> None:
    value = _field_value(field)
    body = {"model": MODEL, "input": "Hello", field: value}
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            http_body = {k: v for k, v in body.items() if k not in WS_ONLY}
            async with httpx.AsyncClient(timeout=DEADLINE) as client:
                resp = await client.post(f"{url}/responses", json=http_body)
            async with open_ws(url) as ws:
                events = await ws.create(**body)
    if field in REFUSED:
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] | {"message": ""} == {
            "type": "invalid_request_error",
            "code": "unsupported_parameter",
            "param": field,
            "message": "",
        }
        assert events[-1].type == "error"
        assert (events[-1].error.code, events[-1].error.param) == ("unsupported_parameter", field)
        return
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "completed"
    assert events[-1].type == "response.completed", events[-1]
    if field == "stream_id":  # the response ran on that lane
        assert {e.stream_id for e in events} == {value}


# --- conversations with every item type -------------------------------------------------------

# Output item type -> the call item type it answers.
_ANSWERS = {
    "function_call_output": "function_call",
    "custom_tool_call_output": "custom_tool_call",
    "local_shell_call_output": "local_shell_call",
    "shell_call_output": "shell_call",
    "apply_patch_call_output": "apply_patch_call",
    "computer_call_output": "computer_call",
}
_BY_TAG = {tag: td for td in INPUT_ITEM_TYPES for tag in type_tags(td)}
# Filled in by the test from a real conversation.
_NEEDS_SERVER = {"item_reference", "compaction"}


def _item(tag: str, call_id: str) -> dict[str, Any]:
    item: dict[str, Any] = {**instance(_BY_TAG[tag]), "type": tag}
    if "call_id" in item or tag in _ANSWERS.values():
        item["call_id"] = call_id
    if tag == "local_shell_call_output":
        item["id"] = call_id
    if tag == "message" and item.get("role") == "assistant":
        item["id"] = "msg_echo"
    return item


def representatives() -> list[tuple[str, list[dict[str, Any]]]]:
    """(type, input items) for every input item type: a call with its output."""
    out: list[tuple[str, list[dict[str, Any]]]] = []
    for i, tag in enumerate(sorted(_BY_TAG)):
        if tag in _NEEDS_SERVER or tag in _ANSWERS.values():
            continue
        call_id = f"call_rep_{i}"
        if tag in _ANSWERS:
            out.append((tag, [_item(_ANSWERS[tag], call_id), _item(tag, call_id)]))
        else:
            out.append((tag, [_item(tag, call_id)]))
    return out


def _without_ids(wire: Any) -> Any:
    return {k: v for k, v in wire.items() if k not in ("id",)} if isinstance(wire, dict) else wire


@pytest.mark.parametrize(("tag", "items"), representatives(), ids=[t for t, _ in representatives()])
async def test_every_item_type_through_two_turns(tag: str, items: list[dict[str, Any]]) -> None:
    first = [{"role": "user", "content": "Start."}, *items, {"role": "user", "content": "Go on."}]
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, httpx.AsyncClient(timeout=DEADLINE) as client:
            # HTTP, stored: turn one, listed back, turn two over HTTP and on a new socket.
            resp = await client.post(
                f"{url}/responses", json={"model": MODEL, "input": first, "store": True}
            )
            assert resp.status_code == 200, resp.text
            one = resp.json()
            listed = (
                await client.get(f"{url}/responses/{one['id']}/input_items?order=asc&limit=100")
            ).json()["data"]
            sent = [p.to_wire(p.as_listed(p.from_wire(i, p.Item))) for i in first]
            assert [_without_ids(i) for i in listed] == [_without_ids(i) for i in sent]
            follow = {"model": MODEL, "input": "Again.", "previous_response_id": one["id"]}
            two_http = (await client.post(f"{url}/responses", json=follow)).json()
            async with open_ws(url) as ws:
                two_ws_hydrated = (await ws.create(**follow))[-1].response
            # WebSocket, not stored: turn two from the socket's cache.
            async with open_ws(url) as ws:
                one_ws = (await ws.create(model=MODEL, input=first, store=False))[-1].response
                two_ws = (
                    await ws.create(
                        model=MODEL, input="Again.", previous_response_id=one_ws.id, store=False
                    )
                )[-1].response
    assert two_http["status"] == "completed", two_http
    assert two_ws.status == two_ws_hydrated.status == "completed"
    # The same context whichever way it came: the same token count and the same answer.
    assert one_ws.usage is not None and two_ws.usage is not None
    assert one_ws.usage.input_tokens == one["usage"]["input_tokens"]
    assert two_ws.usage.input_tokens == two_http["usage"]["input_tokens"]
    assert two_ws_hydrated.usage is not None
    assert two_ws_hydrated.usage.input_tokens == two_http["usage"]["input_tokens"]
    assert p.to_wire(two_ws.output[0])["content"] == two_http["output"][0]["content"]


def test_representatives_cover_every_item_type() -> None:
    covered = {t for _, items in representatives() for t in (i["type"] for i in items)}
    assert covered | _NEEDS_SERVER == set(_BY_TAG)


# --- every tool type, declared through two turns ---------------------------------------------


def _tool(tag: str, td: Any) -> dict[str, Any]:
    tool: dict[str, Any] = {**instance(td), "type": tag}
    if tag == "custom":
        tool["format"] = {"type": "text"}
    if tag == "namespace":
        tool["tools"] = [{"type": "function", "name": "inner", "parameters": {"type": "object"}}]
    if tag == "shell":
        tool["environment"] = {"type": "local"}
    return tool


TOOL_CASES = [(tag, _tool(tag, td)) for td in TOOL_TYPES for tag in type_tags(td)]


@pytest.mark.parametrize(("tag", "tool"), TOOL_CASES, ids=[t for t, _ in TOOL_CASES])
async def test_every_tool_type_is_declared_and_echoed(tag: str, tool: dict[str, Any]) -> None:
    body = {"model": MODEL, "input": "Hello", "tools": [tool], "tool_choice": "none"}
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, httpx.AsyncClient(timeout=DEADLINE) as client:
            one = (await client.post(f"{url}/responses", json=body)).json()
            assert one.get("status") == "completed", one
            follow = {**body, "input": "Again.", "previous_response_id": one["id"]}
            two = (await client.post(f"{url}/responses", json=follow)).json()
            async with open_ws(url) as ws:
                ws_one = (await ws.create(**body))[-1].response
    assert two["status"] == "completed", two
    assert ws_one.status == "completed"
    (echoed,) = one["tools"]
    expected = p.to_wire(p.echo_tools([p.from_wire(tool, p.Tool)])[0])
    assert echoed == expected
    for key, value in tool.items():  # what the client sent comes back (strict made explicit)
        assert echoed[key] == value or key == "tools" or (key == "strict" and value is None)


# --- sim calls every kind of tool a client runs ------------------------------------------------

LARK = 'start: "ls " NAME\nNAME: /[a-z]{2,5}/\n'
CLIENT_TOOLS: dict[str, tuple[dict[str, Any], Any, str]] = {
    # kind: (tool, tool_choice forcing it, output item type)
    "function": (
        {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
        {"type": "function", "name": "lookup"},
        "function_call_output",
    ),
    "custom-text": (
        {"type": "custom", "name": "note", "format": {"type": "text"}},
        {"type": "custom", "name": "note"},
        "custom_tool_call_output",
    ),
    "custom-lark": (
        {
            "type": "custom",
            "name": "run",
            "format": {"type": "grammar", "syntax": "lark", "definition": LARK},
        },
        {"type": "custom", "name": "run"},
        "custom_tool_call_output",
    ),
    "custom-regex": (
        {
            "type": "custom",
            "name": "code",
            "format": {"type": "grammar", "syntax": "regex", "definition": r"[A-Z]{3}-\d{4}"},
        },
        {"type": "custom", "name": "code"},
        "custom_tool_call_output",
    ),
    "shell": ({"type": "shell"}, {"type": "shell"}, "shell_call_output"),
    "local_shell": ({"type": "local_shell"}, "required", "local_shell_call_output"),
    "apply_patch": ({"type": "apply_patch"}, {"type": "apply_patch"}, "apply_patch_call_output"),
    "computer": ({"type": "computer"}, {"type": "computer"}, "computer_call_output"),
}


def output_for(call: dict[str, Any], kind: str) -> dict[str, Any]:
    """What a client sends back after running the call."""
    call_id = call["call_id"]
    if kind == "function_call_output":
        return {"type": kind, "call_id": call_id, "output": "done"}
    if kind == "custom_tool_call_output":
        return {"type": kind, "call_id": call_id, "output": f"ran {call['input']}"}
    if kind == "local_shell_call_output":
        return {"type": kind, "id": call_id, "output": "hello"}
    if kind == "shell_call_output":
        outcome = {"type": "exit", "exit_code": 0}
        return {
            "type": kind,
            "call_id": call_id,
            "output": [{"stdout": "hello\n", "stderr": "", "outcome": outcome}],
        }
    if kind == "apply_patch_call_output":
        return {"type": kind, "call_id": call_id, "status": "completed", "output": "ok"}
    screenshot = {"type": "computer_screenshot", "image_url": "https://example.com/s.png"}
    return {"type": kind, "call_id": call_id, "output": screenshot}


def check_call(kind: str, call: dict[str, Any]) -> None:
    """The call is what its tool needs: input in the grammar, a valid action or operation."""
    if kind == "custom-lark":
        assert call["type"] == "custom_tool_call"
        assert call["input"].startswith("ls ") and 2 <= len(call["input"]) - 3 <= 5
    elif kind == "custom-regex":
        import re

        assert re.fullmatch(r"[A-Z]{3}-\d{4}", call["input"]), call["input"]
    elif kind == "shell":
        assert call["type"] == "shell_call" and call["action"]["commands"]
    elif kind == "local_shell":
        assert call["type"] == "local_shell_call" and call["action"]["type"] == "exec"
    elif kind == "apply_patch":
        assert call["type"] == "apply_patch_call"
        assert call["operation"]["type"] in ("create_file", "update_file", "delete_file")
    elif kind == "computer":
        assert call["type"] == "computer_call" and call["action"]["type"]


@pytest.mark.parametrize("transport", ["http", "websocket"])
@pytest.mark.parametrize("kind", sorted(CLIENT_TOOLS))
async def test_sim_calls_every_client_tool(kind: str, transport: str) -> None:
    tool, choice, output_type = CLIENT_TOOLS[kind]
    body = {"model": MODEL, "input": "Do it.", "tools": [tool], "tool_choice": choice}
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            if transport == "http":
                async with httpx.AsyncClient(timeout=DEADLINE) as client:
                    one = (await client.post(f"{url}/responses", json=body)).json()
                    call = one["output"][-1]
                    follow = {
                        "model": MODEL,
                        "tools": [tool],
                        "previous_response_id": one["id"],
                        "input": [output_for(call, output_type)],
                    }
                    two = (await client.post(f"{url}/responses", json=follow)).json()
            else:
                async with open_ws(url) as ws:
                    first = (await ws.create(**body, store=False))[-1].response
                    one = p.to_wire(first)
                    call = one["output"][-1]
                    second = await ws.create(
                        model=MODEL,
                        tools=[tool],
                        previous_response_id=first.id,
                        input=[output_for(call, output_type)],
                        store=False,
                    )
                    two = p.to_wire(second[-1].response)
    assert one["status"] == "completed", one
    check_call(kind, call)
    assert two["status"] == "completed", two
    assert two["output"][-1]["type"] == "message"


async def test_an_output_must_answer_a_call_of_its_kind() -> None:
    tool, choice, _ = CLIENT_TOOLS["shell"]
    body = {"model": MODEL, "input": "Do it.", "tools": [tool], "tool_choice": choice}
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, httpx.AsyncClient(timeout=DEADLINE) as client:
            one = (await client.post(f"{url}/responses", json=body)).json()
            call = copy.deepcopy(one["output"][-1])
            wrong = {"type": "function_call_output", "call_id": call["call_id"], "output": "x"}
            resp = await client.post(
                f"{url}/responses",
                json={"model": MODEL, "previous_response_id": one["id"], "input": [wrong]},
            )
            missing = await client.post(
                f"{url}/responses",
                json={
                    "model": MODEL,
                    "input": [{"type": "function_call_output", "output": "x"}],
                },
            )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "input[0].type"
    assert "answers a shell call" in resp.json()["error"]["message"]
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == "missing_required_parameter"
    assert missing.json()["error"]["param"] == "input[0].call_id"


async def test_client_metadata_is_kept_with_the_response() -> None:
    """Codex's `client_metadata` (not in the SDK): stored with the response, bounded."""
    metadata = {"x-codex-turn-metadata": json.dumps({"turn": 1, "cwd": "/" + "a" * 900})}
    body = {"model": MODEL, "input": "Hello", "client_metadata": metadata}
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, httpx.AsyncClient(timeout=DEADLINE) as client:
            created = (await client.post(f"{url}/responses", json=body)).json()
            stored = (await client.get(f"{url}/responses/{created['id']}")).json()
            too_long = await client.post(
                f"{url}/responses",
                json={**body, "client_metadata": {"k": "v" * 4097}},
            )
            too_many = await client.post(
                f"{url}/responses",
                json={**body, "client_metadata": {f"k{i}": "v" for i in range(33)}},
            )
    assert created["client_metadata"] == stored["client_metadata"] == metadata
    assert too_long.status_code == too_many.status_code == 400
    assert too_long.json()["error"]["param"] == "client_metadata.k"
    assert too_many.json()["error"]["code"] == "object_above_max_properties"
