"""Request bounds (issue 29): identifiers a client stores, how many tools, `allowed_tools`
entries and input items one request declares, and the JSON schemas' budget, each refused with
OpenAI's error (code, param) before any work proportional to it; a request whose schemas are
large is validated off the event loop, with the same errors in the same order; one bringing
much new text is rendered and classified off it, with the same outcome.

In-process over ASGI (the bounds are the app's, not the transport's). The event-loop time
each field costs at its limit is measured by `bench/loop_time.py`, not asserted here.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import trio
import trio.testing
from rollout.engine import MemoryResponseStore, _engine
from rollout.engine._app import AppConfig, RolloutApp
from rollout.engine._engine import (
    OFFLOAD_DECODE_BYTES,
    OFFLOAD_RENDER_CHARS,
    OFFLOAD_SCHEMA_NODES,
    Engine,
    open_engine,
)
from rollout.engine._render import ChatTemplateRenderer
from rollout.engine._schemas import MAX_REQUEST_SCHEMA_NODES
from rollout.engine._tokenizer import O200kTokenizer
from rollout.engine._validate import ConversationValidator
from rollout.protocol import Item, ResponseCreate, Tool
from rollout.protocol._events import (
    MAX_INPUT_ITEMS,
    MAX_PROMPT_CACHE_KEY_CHARS,
    MAX_SAFETY_IDENTIFIER_CHARS,
    MAX_TOOLS,
    MAX_USER_CHARS,
)

from tests.test_server_routes import call

JSON = [(b"content-type", b"application/json")]


@pytest.fixture
async def served() -> AsyncIterator[tuple[RolloutApp, Engine]]:
    async with open_engine(store=MemoryResponseStore()) as engine:
        yield RolloutApp(engine, AppConfig(max_message_size=64 * 2**20)), engine


async def create(app: RolloutApp, **body: Any) -> tuple[int, Any]:
    payload = json.dumps({"model": "sim", "input": "hi", **body}).encode()
    status, _, answer = await call(app, "POST", "/v1/responses", payload, headers=JSON)
    return status, answer


def error(answer: Any) -> tuple[str, str]:
    return answer["error"]["code"], answer["error"]["param"]


def function(name: str, parameters: Any = None) -> dict[str, Any]:
    tool: dict[str, Any] = {"type": "function", "name": name}
    if parameters is not None:
        tool["parameters"] = parameters
    return tool


def wide_schema(properties: int) -> dict[str, Any]:
    """An object schema of `properties` string properties: 2 values each, 3 more."""
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string"} for i in range(properties)},
    }


def json_format(schema: Any) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "name": "out",
        "description": "the answer",
        "schema": schema,
        "strict": False,
    }


@pytest.mark.parametrize(
    ("field", "limit"),
    [
        ("prompt_cache_key", MAX_PROMPT_CACHE_KEY_CHARS),
        ("safety_identifier", MAX_SAFETY_IDENTIFIER_CHARS),
        ("user", MAX_USER_CHARS),
    ],
)
async def test_identifiers_are_bounded(
    served: tuple[RolloutApp, Engine], field: str, limit: int
) -> None:
    app, _ = served
    status, answer = await create(app, **{field: "x" * limit})
    assert status == 200 and answer[field] == "x" * limit
    status, answer = await create(app, **{field: "x" * (limit + 1)})
    assert status == 400 and error(answer) == ("string_above_max_length", field)
    assert (
        f"Invalid '{field}': string too long. Expected a string with maximum length {limit}, "
        f"but got a string with length {limit + 1} instead." == answer["error"]["message"]
    )
    status, answer = await create(app, **{field: "x" * 10_000_000})  # the 10 MB
    assert status == 400 and error(answer) == ("string_above_max_length", field)


async def test_tools_entries_and_items_are_bounded(served: tuple[RolloutApp, Engine]) -> None:
    app, engine = served
    tools = [function(f"f{i}") for i in range(MAX_TOOLS)]
    status, _ = await create(app, tools=tools)
    assert status == 200
    status, answer = await create(app, tools=[*tools, function("one_more")])
    assert status == 400 and error(answer) == ("array_above_max_length", "tools")
    # Namespace members count: one namespace of MAX_TOOLS functions is MAX_TOOLS + 1 tools.
    namespace = {"type": "namespace", "name": "ns", "description": "d", "tools": tools}
    status, answer = await create(app, tools=[namespace])
    assert status == 400 and error(answer) == ("array_above_max_length", "tools")
    entries = [{"type": "function", "name": "f0"}] * (MAX_TOOLS + 1)
    choice = {"type": "allowed_tools", "mode": "auto", "tools": entries}
    status, answer = await create(app, tools=tools[:1], tool_choice=choice)
    assert status == 400 and error(answer) == ("array_above_max_length", "tool_choice.tools")
    message = {"role": "user", "content": "m"}
    status, _ = await create(app, input=[message] * MAX_INPUT_ITEMS)
    assert status == 200
    runs = engine.counters.pre_inference_runs
    status, answer = await create(app, input=[message] * (MAX_INPUT_ITEMS + 1))
    assert status == 400 and error(answer) == ("array_above_max_length", "input")
    assert engine.counters.pre_inference_runs == runs  # refused before any of it was staged


async def test_the_schemas_of_a_request_share_a_budget(served: tuple[RolloutApp, Engine]) -> None:
    app, _ = served
    # Each schema within its own bound (20,000 values), all of them over the request's.
    per_tool = 6_000  # properties: ~12,000 values each
    tools = [function(f"f{i}", wide_schema(per_tool)) for i in range(5)]
    assert 5 * 2 * per_tool > MAX_REQUEST_SCHEMA_NODES
    status, answer = await create(app, tools=tools)
    assert status == 400 and error(answer) == ("invalid_value", "tools")
    assert f"more than {MAX_REQUEST_SCHEMA_NODES} values" in answer["error"]["message"]
    text = {"format": json_format(wide_schema(per_tool))}
    status, answer = await create(app, tools=tools[:4], text=text)
    assert status == 400 and error(answer) == ("invalid_value", "tools")


async def test_large_schemas_are_validated_off_the_loop_with_the_same_errors(
    served: tuple[RolloutApp, Engine],
) -> None:
    app, engine = served
    large = wide_schema(OFFLOAD_SCHEMA_NODES)
    status, answer = await create(app, tools=[function("f", large)], tool_choice="none")
    assert status == 200 and engine.counters.offloaded_validations == 1
    # The same tools resent on a follow-up were validated with the parent: not again.
    status, answer = await create(
        app, tools=[function("f", large)], tool_choice="none", previous_response_id=answer["id"]
    )
    assert status == 200 and engine.counters.offloaded_validations == 1
    broken = {**large, "properties": {**large["properties"], "bad": {"type": 7}}}
    status, answer = await create(app, tools=[function("f", broken)])
    assert status == 400
    assert error(answer) == ("invalid_function_parameters", "tools[0].parameters")
    # Errors keep their order: a tool's duplicate name (checked before its schema) comes
    # first, and the text format's schema is checked off the loop too.
    status, answer = await create(app, tools=[function("f"), function("f", broken)])
    assert status == 400 and error(answer) == ("invalid_value", "tools[1].name")
    bad_text = {"format": json_format(broken)}
    status, answer = await create(app, text=bad_text)
    assert status == 400 and error(answer) == ("invalid_value", "text.format.schema")
    assert engine.counters.offloaded_validations == 4
    # Small schemas stay on the loop (a thread hop would cost more than the check).
    status, _ = await create(app, tools=[function("g", wide_schema(8))])
    assert status == 200 and engine.counters.offloaded_validations == 4


class HeldValidator(ConversationValidator):
    """The built-in validator, held in its worker thread until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def validate_request(self, request: ResponseCreate, *, tools_known: bool = False) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.entered.set()
            self.release.wait(timeout=60)
        super().validate_request(request, tools_known=tools_known)


async def test_a_caller_cancelled_during_validation_leaves_at_once() -> None:
    """The caller does not wait for the worker thread: cancelled while the validation runs in
    it, the request ends; the thread finishes its bounded work on its own."""
    validator = HeldValidator()
    tools = [function(f"f{i}", wide_schema(1_500)) for i in range(4)]  # ~12,000 values
    payload = json.dumps({"model": "sim", "input": "hi", "tools": tools}).encode()
    assert len(payload) < OFFLOAD_DECODE_BYTES  # decoded on the loop, validated in a thread
    async with open_engine(store=MemoryResponseStore(), validator=validator) as engine:
        app = RolloutApp(engine, AppConfig())
        try:
            with trio.fail_after(10):
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(call, app, "POST", "/v1/responses", payload, JSON)
                        await trio.to_thread.run_sync(
                            validator.entered.wait, abandon_on_cancel=True
                        )
                        assert engine.counters.offloaded_validations == 1
                        scope.cancel()
                assert scope.cancelled_caught
                assert not validator.release.is_set()  # the thread is still held
        finally:
            validator.release.set()


LARGE = 100_000  # characters: what the recording renderer records


class ThreadRecordingRenderer(ChatTemplateRenderer):
    """The default renderer, recording which threads rendered large items and prefixes."""

    def __init__(self) -> None:
        super().__init__(O200kTokenizer())
        self.threads: list[str] = []

    def _record(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.threads.append("loop" if main else "worker")

    def render_item(self, item: Item) -> array[int]:
        if len(self.item_text(item)) > LARGE:
            self._record()
        return super().render_item(item)

    def render_prefix(self, instructions: str | None, tools: Sequence[Tool]) -> array[int]:
        if len(instructions or "") > LARGE:
            self._record()
        return super().render_prefix(instructions, tools)


async def large_text_run(offload: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The same requests with large text, rendered off the loop or (`offload` False) on it:
    what each answered, the work counters, and where each rendering ran."""
    if not offload:
        monkeypatch.setattr(_engine, "OFFLOAD_RENDER_CHARS", 2**62)
    big = "All work and no play makes Jack a dull boy. " * 8_000  # 352 KB
    assert len(big) >= OFFLOAD_RENDER_CHARS
    renderer = ThreadRecordingRenderer()
    seen: dict[str, Any] = {}
    async with open_engine(store=MemoryResponseStore(), renderer=renderer) as engine:
        app = RolloutApp(engine, AppConfig())
        with trio.fail_after(30):
            status, first = await create(app, input=[{"role": "user", "content": big}])
            seen["first"] = (status, first["usage"]["input_tokens"], renderer.threads)
            renderer.threads = []
            status, second = await create(app, instructions=big, input="Hi.")
            seen["instructions"] = (status, second["usage"]["input_tokens"], renderer.threads)
            renderer.threads = []
            # A follow-up with the same instructions: its prefix is the parent's (not again).
            status, third = await create(
                app, instructions=big, input="More.", previous_response_id=second["id"]
            )
            seen["follow-up"] = (status, third["usage"]["input_tokens"], renderer.threads)
            renderer.threads = []
            # Large and invalid: the output of a call that does not exist.
            bad = [{"type": "function_call_output", "call_id": "call_nope", "output": big}]
            status, answer = await create(app, input=bad)
            seen["invalid"] = (status, answer["error"])
        counters = engine.counters
        seen["counters"] = (
            counters.tokens_rendered,
            counters.chars_classified,
            counters.items_validated,
        )
        seen["offloaded"] = counters.offloaded_renders
    return seen


async def test_large_text_is_rendered_and_classified_off_the_loop_with_the_same_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request bringing `OFFLOAD_RENDER_CHARS` of new text (an input message, instructions)
    is rendered and classified in a worker thread, and everything a client or the counters
    see is what rendering it on the loop gives: usage, errors, tokens rendered, characters
    classified. A prefix reused from the parent is not rendered again, in a thread or not."""
    off = await large_text_run(True, monkeypatch)
    on = await large_text_run(False, monkeypatch)
    assert off["first"][2] == ["worker"] and on["first"][2] == ["loop"]
    assert off["instructions"][2] == ["worker"] and on["instructions"][2] == ["loop"]
    assert off["follow-up"][2] == on["follow-up"][2] == []  # the parent's prefix, taken
    assert off["offloaded"] == 3 and on["offloaded"] == 0  # first, instructions, invalid
    for key in ("first", "instructions", "follow-up"):
        assert off[key][:2] == on[key][:2], key
        assert off[key][0] == 200
    assert off["invalid"] == on["invalid"] and off["invalid"][0] == 400, off["invalid"]
    assert off["counters"] == on["counters"]
