"""Event-loop time per request field at its limit (issue 29): what one request can cost every
other client of the process.

Each case sends one `POST /v1/responses` to the app in-process (ASGI, the default limits, an
in-memory store) and measures, with a trio instrument, the longest single step of any task
(how long the event loop served nobody else: the bound other clients feel) and the loop's busy
time in all, beside the wall time (which includes work in worker threads). The engine is
warmed up first (a small request with a tool: what is built on first use), then each case runs
once, cold for its own content (an attacker varies its requests: no cache helps).

    python -m tests.bench_loop_time            # every case: a Markdown table on stdout
    python -m tests.bench_loop_time tools      # the cases whose name contains "tools"

Measured, not asserted: a loaded machine moves the numbers (STYLE: speed lives in scripts).
"""

from __future__ import annotations

import base64
import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio
from rollout.engine import MemoryResponseStore
from rollout.engine._app import AppConfig, RolloutApp
from rollout.engine._engine import open_engine
from rollout.engine._schemas import MAX_REQUEST_SCHEMA_NODES, MAX_SCHEMA_NODES
from rollout.engine._tools import MAX_GRAMMAR_CHARS
from rollout.engine._validate import MAX_IMAGE_BYTES
from rollout.protocol import DEFAULT_MAX_MESSAGE_SIZE
from rollout.protocol._events import (
    MAX_CLIENT_METADATA_KEY_CHARS,
    MAX_CLIENT_METADATA_PAIRS,
    MAX_CLIENT_METADATA_VALUE_CHARS,
    MAX_INPUT_ITEMS,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_PROMPT_CACHE_KEY_CHARS,
    MAX_SAFETY_IDENTIFIER_CHARS,
    MAX_TOOLS,
    MAX_USER_CHARS,
)

from tests.test_server_routes import call


class LoopSteps(trio.abc.Instrument):
    """The longest task step, and the steps' total, while installed."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.busy = 0.0
        self._began = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._began:
            step = time.perf_counter() - self._began
            self.worst = max(self.worst, step)
            self.busy += step
        self._began = 0.0


@attrs.frozen
class Case:
    field: str
    limit: str
    body: Callable[[], dict[str, Any]]


def wide(values: int) -> dict[str, Any]:
    """An object schema of about `values` JSON values (string properties: 2 values each)."""
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string"} for i in range(values // 2 - 2)},
    }


def text_to_the_limit(other: dict[str, Any], field: str) -> dict[str, Any]:
    """`other` with `field` a string filling the message size (words, as text tokenizes)."""
    room = DEFAULT_MAX_MESSAGE_SIZE - len(json.dumps(other)) - 64
    return {**other, field: ("lorem ipsum " * (room // 12 + 1))[:room]}


def tools(n: int, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    made: list[dict[str, Any]] = []
    for i in range(n):
        tool: dict[str, Any] = {"type": "function", "name": f"f{i}", "description": "a tool"}
        if parameters is not None:
            tool["parameters"] = parameters
        made.append(tool)
    return made


BASE: dict[str, Any] = {"model": "sim", "input": "hi", "tool_choice": "none"}
PER_TOOL = MAX_REQUEST_SCHEMA_NODES // MAX_TOOLS  # values per tool at the budget
IMAGE = (
    "data:image/png;base64," + base64.b64encode(b"\x89PNG" + bytes(MAX_IMAGE_BYTES - 1024)).decode()
)

CASES = [
    Case("(a small request)", "", lambda: dict(BASE)),
    Case(
        "input: messages",
        f"{MAX_INPUT_ITEMS:,} items",
        lambda: {**BASE, "input": [{"role": "user", "content": "m"}] * MAX_INPUT_ITEMS},
    ),
    Case(
        "input: calls and outputs",
        f"{MAX_INPUT_ITEMS:,} items",
        lambda: {
            **BASE,
            "tools": tools(1),
            "input": [
                item
                for i in range(MAX_INPUT_ITEMS // 2)
                for item in (
                    {"type": "function_call", "call_id": f"c{i}", "name": "f0", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": f"c{i}", "output": "ok"},
                )
            ],
        },
    ),
    Case(
        "input: item_reference",
        f"{MAX_INPUT_ITEMS:,} items",
        lambda: {**BASE, "input": [{"type": "item_reference", "id": "msg_kept"}] * MAX_INPUT_ITEMS},
    ),
    Case(
        "input: one message's text",
        "64 MiB (--max-message-size)",
        lambda: text_to_the_limit(BASE, "input"),
    ),
    Case(
        "instructions",
        "64 MiB (--max-message-size)",
        lambda: text_to_the_limit(BASE, "instructions"),
    ),
    Case(
        "input: an inline image",
        "20 MB decoded",
        lambda: {
            **BASE,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}],
        },
    ),
    Case(
        "tools: plain functions",
        f"{MAX_TOOLS:,} tools",
        lambda: {**BASE, "tools": tools(MAX_TOOLS)},
    ),
    Case(
        "tools: parameters schemas",
        f"{MAX_TOOLS:,} tools, {MAX_REQUEST_SCHEMA_NODES:,} values",
        lambda: {**BASE, "tools": tools(MAX_TOOLS, wide(PER_TOOL))},
    ),
    Case(
        "tools: one parameters schema",
        f"{MAX_SCHEMA_NODES:,} values",
        lambda: {**BASE, "tools": tools(1, wide(MAX_SCHEMA_NODES))},
    ),
    Case(
        "tools: custom grammars",
        f"{DEFAULT_MAX_MESSAGE_SIZE // MAX_GRAMMAR_CHARS - 2} x {MAX_GRAMMAR_CHARS // 1024} KiB",
        lambda: {
            **BASE,
            "tools": [
                {
                    "type": "custom",
                    "name": f"c{i}",
                    "format": {
                        "type": "grammar",
                        "syntax": "lark",
                        "definition": 'start: "a"\n' + "// " + "x" * (MAX_GRAMMAR_CHARS - 16),
                    },
                }
                for i in range(DEFAULT_MAX_MESSAGE_SIZE // MAX_GRAMMAR_CHARS - 2)
            ],
        },
    ),
    Case(
        "tool_choice.allowed_tools",
        f"{MAX_TOOLS:,} entries, {MAX_TOOLS:,} tools",
        lambda: {
            **BASE,
            "tools": tools(MAX_TOOLS),
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": f"f{i}"} for i in range(MAX_TOOLS)],
            },
        },
    ),
    Case(
        "text.format schema",
        f"{MAX_SCHEMA_NODES:,} values",
        lambda: {
            **BASE,
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "out",
                    "description": "d",
                    "strict": False,
                    "schema": wide(MAX_SCHEMA_NODES),
                }
            },
        },
    ),
    Case(
        "metadata, client_metadata",
        f"{MAX_METADATA_PAIRS} x {MAX_METADATA_VALUE_CHARS}, "
        f"{MAX_CLIENT_METADATA_PAIRS} x {MAX_CLIENT_METADATA_VALUE_CHARS} chars",
        lambda: {
            **BASE,
            "metadata": {
                f"{i:0{MAX_METADATA_KEY_CHARS}}": "v" * MAX_METADATA_VALUE_CHARS
                for i in range(MAX_METADATA_PAIRS)
            },
            "client_metadata": {
                f"{i:0{MAX_CLIENT_METADATA_KEY_CHARS}}": "v" * MAX_CLIENT_METADATA_VALUE_CHARS
                for i in range(MAX_CLIENT_METADATA_PAIRS)
            },
        },
    ),
    Case(
        "user, prompt_cache_key, safety_identifier",
        f"{MAX_USER_CHARS}, {MAX_PROMPT_CACHE_KEY_CHARS}, {MAX_SAFETY_IDENTIFIER_CHARS} chars",
        lambda: {
            **BASE,
            "user": "u" * MAX_USER_CHARS,
            "prompt_cache_key": "k" * MAX_PROMPT_CACHE_KEY_CHARS,
            "safety_identifier": "s" * MAX_SAFETY_IDENTIFIER_CHARS,
        },
    ),
]


async def measure(app: RolloutApp, payload: bytes) -> tuple[int, float, float, float]:
    """(status, worst step, loop busy, wall) of one request, in seconds. The request runs in
    a task of its own, started once the instrument is in place (so its first step counts)."""
    gc.collect()
    steps = LoopSteps()
    statuses: list[int] = []

    async def one() -> None:
        status, _, _ = await call(
            app, "POST", "/v1/responses", payload, [(b"content-type", b"application/json")]
        )
        statuses.append(status)

    trio.lowlevel.add_instrument(steps)
    began = time.perf_counter()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
    finally:
        trio.lowlevel.remove_instrument(steps)
    return statuses[0], steps.worst, steps.busy, time.perf_counter() - began


async def main(pattern: str) -> None:
    print("| request field | at its limit | body | status | worst loop step | loop busy | wall |")
    print("|---|---|---|---|---|---|---|")
    async with open_engine(store=MemoryResponseStore()) as engine:
        app = RolloutApp(engine, AppConfig())
        warm = {**BASE, "tools": [{"type": "function", "name": "w", "parameters": wide(8)}]}
        await measure(app, json.dumps(warm).encode())
        # An item for the item_reference case to name (stored: the store answers its lookups).
        stored = {**BASE, "input": [{"role": "user", "content": "kept", "id": "msg_kept"}]}
        await measure(app, json.dumps(stored).encode())
        for case in CASES:
            if pattern not in case.field:
                continue
            payload = json.dumps(case.body()).encode()
            status, worst, busy, wall = await measure(app, payload)
            size = (
                f"{len(payload) / 2**20:.1f} MiB"
                if len(payload) > 2**20
                else f"{len(payload) / 1024:.0f} KiB"
            )
            print(
                f"| {case.field} | {case.limit} | {size} | {status} | {worst * 1000:.0f} ms "
                f"| {busy * 1000:.0f} ms | {wall * 1000:.0f} ms |",
                flush=True,
            )


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "")
