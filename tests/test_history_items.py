"""History items that clients echo back: assistant messages with `phase`, reasoning items and
`item_reference`s.

- They are accepted as input and rendered the way the engine rendered them when they were
  output: a conversation continued from the cache (previous_response_id on one session), the
  same conversation hydrated from the store (previous_response_id over HTTP), and the same
  conversation sent statelessly with the response's output echoed back (as the official SDK
  dumps it) have the same rendered context, so the deterministic simulated model gives the
  same next answer.
- `phase` is part of what renders (commentary and final_answer are different channels);
  a reasoning item renders its summary (or its encrypted content when it has no text).
- `item_reference` names an item of a stored response (store=true) by the id the server gave
  it: from `GET /v1/responses/{id}/input_items` or from `response.output`; it resolves on
  another request, over HTTP or on another WebSocket, to exactly that item. An unknown id, an
  item of a store=false response, or another API key's item is `item_not_found` with
  `param: input[i].id`, and the socket stays usable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import trio
from rollout import protocol as p
from rollout.engine import ChatTemplateRenderer, O200kTokenizer, open_engine
from rollout.engine._render import CHANNEL

from tests.engine_harness import same_items
from tests.server_harness import WEATHER_TOOLS, open_test_server, open_ws, run_in_thread

DEADLINE = 20
KEY_A, KEY_B = "sk-owner-a", "sk-owner-b"

REASONING_SUMMARY = {
    "type": "reasoning",
    "id": "rs_echo_1",
    "summary": [{"type": "summary_text", "text": "The user wants the weather; check first."}],
    "encrypted_content": "gAAAAB-opaque-blob-from-another-turn",
}
REASONING_OPAQUE = {
    "type": "reasoning",
    "id": "rs_echo_2",
    "summary": [],
    "encrypted_content": "gAAAAB-only-an-opaque-blob",
}
COMMENTARY = {
    "type": "message",
    "role": "assistant",
    "phase": "commentary",
    "status": "completed",
    "content": [{"type": "output_text", "text": "Checking the forecast now.", "annotations": []}],
}
FINAL = {
    "type": "message",
    "role": "assistant",
    "phase": "final_answer",
    "status": "completed",
    "content": [{"type": "output_text", "text": "It will be sunny.", "annotations": []}],
}
CALL = {
    "type": "function_call",
    "call_id": "call_echo_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
    "status": "completed",
}
CALL_OUTPUT = {"type": "function_call_output", "call_id": "call_echo_1", "output": "sunny, 24C"}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    REASONING_SUMMARY,
    COMMENTARY,
    CALL,
    CALL_OUTPUT,
    REASONING_OPAQUE,
    FINAL,
    {"role": "user", "content": "And tomorrow?"},
]
MODEL = "sim:steps=1,tokens=12"


def items_of(wire: list[dict[str, Any]]) -> list[p.Item]:
    return [p.from_wire(item, p.Item) for item in wire]


# --- rendering ----------------------------------------------------------------------------------


def test_phase_and_reasoning_render_as_documented() -> None:
    renderer = ChatTemplateRenderer(O200kTokenizer())
    text = renderer.tokenizer.encode

    def channel(item: dict[str, Any]) -> list[int]:
        tokens = list(renderer.render_item(items_of([item])[0]))
        start = tokens.index(CHANNEL) + 1
        return tokens[start : start + len(text(item.get("phase") or "final"))]

    assert channel(COMMENTARY) == text("commentary")
    assert channel(FINAL) == text("final_answer")
    assert channel({**FINAL, "phase": None}) == text("final")
    # The same text in another phase is another context.
    assert renderer.render_item(items_of([COMMENTARY])[0]) != renderer.render_item(
        items_of([{**COMMENTARY, "phase": "final_answer"}])[0]
    )
    summary, opaque = items_of([REASONING_SUMMARY, REASONING_OPAQUE])
    assert renderer.decode(renderer.render_item(summary)).endswith(
        "<|message|>The user wants the weather; check first.<|end|>"
    )
    assert renderer.decode(renderer.render_item(opaque)).endswith(
        "<|message|>gAAAAB-only-an-opaque-blob<|end|>"
    )
    # Ids and status never render: an echoed item equals the item the engine produced.
    assert renderer.render_item(items_of([{**FINAL, "id": "msg_x", "status": None}])[0]) == (
        renderer.render_item(items_of([FINAL])[0])
    )


async def test_engine_echo_equals_cached_continuation() -> None:
    """Engine level: the cached continuation's state and a stateless request echoing the
    output (wire round trip) have the same context, digest and next output."""
    tools = [p.from_wire(t, p.Tool) for t in WEATHER_TOOLS]
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            first = await session.create(
                p.ResponseCreate(model=MODEL, input=items_of(HISTORY), tools=tools, store=False)
            )
            assert first is not None
            calls = [o for o in first.response.output if isinstance(o, p.FunctionCall)]
            assert calls, "the script wants a tool call to echo"
            follow: list[dict[str, Any]] = [
                {"type": "function_call_output", "call_id": c.call_id, "output": "rain"}
                for c in calls
            ]
            cached = await session.create(
                p.ResponseCreate(
                    model=MODEL,
                    input=items_of(follow),
                    tools=tools,
                    previous_response_id=first.id,
                    store=False,
                )
            )
            echoed = [p.to_wire(o) for o in first.response.output]
            stateless = await engine.session().create(
                p.ResponseCreate(
                    model=MODEL,
                    input=items_of(HISTORY + echoed + follow),
                    tools=tools,
                    store=False,
                )
            )
    assert cached is not None and stateless is not None
    assert cached.context() == stateless.context()
    assert cached.context_digest == stateless.context_digest
    assert same_items(cached.response.output, stateless.response.output)
    cached_usage, stateless_usage = cached.response.usage, stateless.response.usage
    assert cached_usage is not None and stateless_usage is not None
    assert cached_usage.input_tokens == stateless_usage.input_tokens
    assert cached_usage.output_tokens == stateless_usage.output_tokens
    # The echoed history kept its phases and reasoning items.
    kinds = [(i.type, getattr(i, "phase", None)) for i in stateless.items]
    assert kinds[:8] == [
        ("message", None),
        ("reasoning", None),
        ("message", "commentary"),
        ("function_call", None),
        ("function_call_output", None),
        ("reasoning", None),
        ("message", "final_answer"),
        ("message", None),
    ]


# --- over HTTP and WebSocket --------------------------------------------------------------------


def sdk(url: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url, api_key=key, max_retries=0, timeout=10, _strict_response_validation=True
    )


def http_echo(url: str) -> dict[str, Any]:
    client = sdk(url)
    first = client.responses.create(model=MODEL, input=HISTORY, tools=WEATHER_TOOLS, store=True)
    follow = [
        {"type": "function_call_output", "call_id": o.call_id, "output": "rain"}
        for o in first.output
        if o.type == "function_call"
    ]
    # Continued: the parent is hydrated from the store (a fresh session per HTTP request).
    continued = client.responses.create(
        model=MODEL, input=follow, tools=WEATHER_TOOLS, previous_response_id=first.id
    )
    echoed = [o.model_dump(exclude_none=True) for o in first.output]
    stateless = client.responses.create(
        model=MODEL, input=HISTORY + echoed + follow, tools=WEATHER_TOOLS, store=False
    )
    return {
        "first": first.model_dump(exclude_none=True),
        "follow": follow,
        "continued": continued,
        "stateless": stateless,
    }


def answer_of(response: Any) -> tuple[list[dict[str, Any]], int]:
    """A response's output modulo ids, and its input tokens, from an SDK response, an SDK
    response dumped to a dict, or a `protocol.Response`."""
    if hasattr(response, "model_dump"):
        response = response.model_dump(exclude_none=True)
    elif not isinstance(response, dict):
        response = p.to_wire(response)
    out = []
    for item in response["output"]:
        wire = p.to_wire(p.from_wire(item, p.Item))
        wire.pop("id", None)
        wire.pop("call_id", None)
        out.append(wire)
    return out, response["usage"]["input_tokens"]


async def test_echoed_history_equals_continuation_http_and_websocket(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, api_keys=(KEY_A,)) as url:
            got = await run_in_thread(http_echo, url)
            # WebSocket: the same first turn, then the continuation from the connection's cache.
            async with open_ws(url, key=KEY_A) as ws:
                events = await ws.create(model=MODEL, input=HISTORY, tools=WEATHER_TOOLS)
                first = events[-1].response
                follow = [
                    {"type": "function_call_output", "call_id": o.call_id, "output": "rain"}
                    for o in first.output
                    if isinstance(o, p.FunctionCall)
                ]
                events = await ws.create(
                    model=MODEL, input=follow, tools=WEATHER_TOOLS, previous_response_id=first.id
                )
                ws_continued = events[-1].response
    continued = answer_of(got["continued"])
    assert got["follow"], "the first turn ends with a tool call"
    assert continued == answer_of(got["stateless"])
    assert continued[0] == answer_of(ws_continued)[0]
    assert ws_continued.usage is not None and ws_continued.usage.input_tokens == continued[1]
    # The first turn was the same on both transports (same context, same sampled calls).
    assert answer_of(got["first"])[0] == answer_of(first)[0]


def http_references(url: str) -> dict[str, Any]:
    a, b = sdk(url, KEY_A), sdk(url, KEY_B)
    out: dict[str, Any] = {}
    first = a.responses.create(
        model="sim:tokens=6", input=[{"role": "user", "content": "Remember: blue."}], store=True
    )
    inputs = list(a.responses.input_items.list(first.id))
    assert [i.type for i in inputs] == ["message"]
    user_id = inputs[0].id
    output_id = first.output[0].id
    assert user_id and user_id.startswith("msg_") and output_id != user_id
    out["ids"] = (user_id, output_id)
    question = {"role": "user", "content": "What colour?"}
    refs = [{"type": "item_reference", "id": user_id}, {"type": "item_reference", "id": output_id}]
    out["referenced"] = a.responses.create(model="sim:tokens=6", input=[*refs, question])
    out["echoed"] = a.responses.create(
        model="sim:tokens=6",
        input=[
            {"role": "user", "content": "Remember: blue."},
            first.output[0].model_dump(exclude_none=True),
            question,
        ],
    )
    out["continued"] = a.responses.create(
        model="sim:tokens=6", input=[question], previous_response_id=first.id
    )
    out["count"] = a.responses.input_tokens.count(model="sim:tokens=6", input=[*refs, question])

    def refused(client: openai.OpenAI, items: list[dict[str, Any]]) -> dict[str, Any]:
        try:
            client.responses.create(model="sim", input=items)
        except openai.BadRequestError as exc:
            return dict(exc.body)  # type: ignore[call-overload]
        raise AssertionError("accepted")

    out["other_key"] = refused(b, [question, refs[0]])
    out["unknown"] = refused(a, [question, {"type": "item_reference", "id": "msg_nope"}])
    unstored = a.responses.create(model="sim:tokens=2", input="not stored", store=False)
    out["unstored"] = refused(a, [{"type": "item_reference", "id": unstored.output[0].id}])
    return out


async def test_item_references(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, api_keys=(KEY_A, KEY_B)) as url:
            got = await run_in_thread(http_references, url)
            user_id, output_id = got["ids"]
            refs = [
                {"type": "item_reference", "id": user_id},
                {"type": "item_reference", "id": output_id},
            ]
            question = {"role": "user", "content": "What colour?"}
            # Another connection, the same key: the references resolve.
            async with open_ws(url, key=KEY_A) as ws:
                events = await ws.create(model="sim:tokens=6", input=[*refs, question])
                ws_referenced = events[-1].response
            # Another key's socket: not found, then the socket still works.
            async with open_ws(url, key=KEY_B) as ws:
                await ws.send(
                    {
                        "type": "response.create",
                        "model": "sim",
                        "input": [question, question, refs[1]],
                    }
                )
                error = await ws.error()
                events = await ws.create(model="sim:tokens=2", input="still here?")
    referenced = answer_of(got["referenced"])
    assert referenced == answer_of(got["echoed"]) == answer_of(got["continued"])
    assert got["count"].input_tokens == referenced[1]
    assert answer_of(ws_referenced) == referenced
    for body, param in (
        (got["other_key"], "input[1].id"),
        (got["unknown"], "input[1].id"),
        (got["unstored"], "input[0].id"),
    ):
        assert (body["code"], body["param"]) == ("item_not_found", param), body
    assert (error.status, error.error.code, error.error.param) == (
        400,
        "item_not_found",
        "input[2].id",
    )
    assert events[-1].type == "response.completed"


async def test_reference_within_the_conversation_being_continued() -> None:
    """An item_reference may also name an item of the parent's conversation (here one that
    was never stored), resolved from the session's cache."""
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            first = await session.create(
                p.ResponseCreate(model="sim:tokens=4", input="first words", store=False)
            )
            assert first is not None
            said = first.response.output[0]
            ref = p.ItemReference(id=said.id or "")
            continued = await session.create(
                p.ResponseCreate(
                    model="sim:tokens=4",
                    input=[ref, p.Message(role="user", content="again")],
                    previous_response_id=first.id,
                    store=False,
                )
            )
            stateless = await engine.session().create(
                p.ResponseCreate(
                    model="sim:tokens=4",
                    input=[
                        p.Message(role="user", content="first words"),
                        said,
                        said,
                        p.Message(role="user", content="again"),
                    ],
                    store=False,
                )
            )
    assert continued is not None and stateless is not None
    assert continued.context() == stateless.context()
    assert same_items(continued.response.output, stateless.response.output)
