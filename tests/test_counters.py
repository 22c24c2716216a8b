"""Counters count work done.

The classifier counter, `chars_classified`, is what the classifiers report having examined,
not a copy of `tokens_rendered`; so the counter tests elsewhere (a follow-up classifies only
its new items, a chain classifies each item once) can fail: a classifier that skips input, as
one here does, makes the same assertion fail. Decoding: the bytes of every client message and
the decode stage's time are recorded. Encoding: the characters and bytes of every frame, and
of a rollout's suspension events, which must not grow with the rollout (PROTOCOL.md RX-2.5)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import trio
from rollout import protocol as p
from rollout.engine import ClassifierSet, SecretDetector, open_engine
from rollout.engine._interfaces import ClassifierVerdict

from tests.engine_harness import conversation_chars
from tests.server_harness import (
    counters,
    fetch_counters,
    open_test_server,
    open_ws,
    parse_metrics,
)

DEADLINE = 30
MODEL = "sim:tokens=12"


class SkipsLongTexts:
    """A broken classifier: texts over 40 characters pass unexamined (and unflagged)."""

    name = "skips_long_texts"

    def __init__(self) -> None:
        self.inner = SecretDetector()

    def initial(self) -> Any:
        return self.inner.initial()

    def feed(self, state: Any, text: str, n_tokens: int) -> ClassifierVerdict:
        if len(text) > 40:
            return ClassifierVerdict(state=state)
        return self.inner.feed(state, text, n_tokens)


async def _classified(classifier: Any) -> tuple[int, int]:
    """(chars the classifiers reported, chars of the conversation) over a two-turn chain."""
    async with open_engine(classifier=classifier) as engine:
        session = engine.session()
        before = engine.counters.snapshot()
        first = await session.create(
            p.ResponseCreate(model=MODEL, input="hi", instructions="Be brief.", store=False)
        )
        assert first is not None
        second = await session.create(
            p.ResponseCreate(
                model=MODEL,
                input="a longer message that goes well past forty characters of text",
                instructions="Be brief.",  # the same prefix: not classified again
                previous_response_id=first.id,
                store=False,
            )
        )
        assert second is not None
        delta = engine.counters.snapshot() - before
        return delta.chars_classified, conversation_chars(engine, second)


async def test_an_honest_classifier_accounts_for_every_character() -> None:
    with trio.fail_after(DEADLINE):
        reported, conversation = await _classified(ClassifierSet([SecretDetector()]))
    assert reported == conversation > 60


async def test_a_classifier_that_skips_input_shows_in_the_counter() -> None:
    with trio.fail_after(DEADLINE):
        reported, conversation = await _classified(ClassifierSet([SkipsLongTexts()]))
    assert reported < conversation  # the check the counter tests make would fail


async def test_decoding_is_counted_and_timed() -> None:
    """Every client message decoded adds its bytes to `bytes_decoded` and one observation to
    the `decode` stage histogram, over HTTP and over WebSocket."""
    body = json.dumps({"model": MODEL, "input": "hello", "store": False})
    frame = json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "store": False})
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            async with httpx.AsyncClient() as client:
                resp = await client.post(
                    f"{url}/responses", content=body, headers={"content-type": "application/json"}
                )
                assert resp.status_code == 200
            async with open_ws(url) as ws:
                await ws.send_raw(frame)
                await ws.until_terminal()
            metrics = await fetch_metrics(url)
    assert counters(metrics)["bytes_decoded"] == len(body) + len(frame)
    assert metrics[("rollout_stage_seconds_count", frozenset({("stage", "decode")}))] == 2


async def fetch_metrics(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with httpx.AsyncClient() as client:
        resp = await client.get(f"{base_url.removesuffix('/v1')}/metrics")
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def test_encoding_is_counted() -> None:
    """`sse_bytes_encoded` is the SSE body the client received, byte for byte;
    `ws_chars_encoded` the characters of every WebSocket text frame it received."""
    body = json.dumps({"model": MODEL, "input": "hello", "store": False, "stream": True})
    frame = json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "store": False})
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            before = counters(await fetch_metrics(url))
            async with httpx.AsyncClient() as client:
                resp = await client.post(
                    f"{url}/responses", content=body, headers={"content-type": "application/json"}
                )
                assert resp.status_code == 200
            async with open_ws(url) as ws:
                await ws.send_raw(frame)
                await ws.until_terminal()
                received = sum(len(json.dumps(f, ensure_ascii=False, separators=(",", ":")))
                               for f in ws.raw)  # fmt: skip
            after = counters(await fetch_metrics(url))
    assert after["sse_bytes_encoded"] - before["sse_bytes_encoded"] == len(resp.content)
    assert after["ws_chars_encoded"] - before["ws_chars_encoded"] == received
    assert after["ws_bytes_encoded"] - before["ws_bytes_encoded"] == received  # ASCII here
    assert after["suspension_bytes_encoded"] == before["suspension_bytes_encoded"]


def _frame_bytes(frame: dict[str, Any]) -> int:
    """The bytes of a received frame as the server encoded it (compact JSON, UTF-8)."""
    return len(json.dumps(frame, ensure_ascii=False, separators=(",", ":")).encode())


# A tool whose every call writes 2,000 characters of arguments (the sim fills the schema).
WRITE_TOOL = {
    "type": "function",
    "name": "write_file",
    "description": "Write a file of the project.",
    "parameters": {
        "type": "object",
        "properties": {"content": {"type": "string", "minLength": 2000, "maxLength": 2000}},
        "required": ["content"],
        "additionalProperties": False,
    },
}
LONG_ROLLOUT_STEPS = 60
# How many bytes a suspension may gain over a rollout: the digits its sequence numbers and
# output indices gain (a response.done re-sending the response so far gains ~2 KB a step).
DIGITS_SLACK = 8


async def test_suspension_bytes_do_not_grow_with_the_rollout() -> None:
    """A 60-step rollout whose every call writes 2,000 characters: `suspension_bytes_encoded`,
    read at each `response.done`, grows by the same bytes per suspension (that response.done
    and the resumed response.in_progress before it) from the first step to the last, and
    counts exactly the suspension frames the client received; `rollout_suspensions` counts
    the 60 suspensions."""
    with trio.fail_after(120):
        async with open_test_server() as url, open_ws(url) as ws:
            before = await fetch_counters(url)
            events = await ws.create(
                model=f"sim:steps={LONG_ROLLOUT_STEPS},tokens=8",
                input="Write the project's files.",
                tools=[WRITE_TOOL],
                rollout=True,
                store=False,
            )
            readings = []  # suspension_bytes_encoded at each response.done
            while events[-1].type == "response.done":
                done = events[-1]
                readings.append((await fetch_counters(url))["suspension_bytes_encoded"])
                outputs = [
                    {"type": "function_call_output", "call_id": call_id, "output": "written"}
                    for call_id in done.pending_call_ids
                ]
                events = await ws.append(done.response.id, outputs)
            after = await fetch_counters(url)
    assert events[-1].type == "response.completed"
    calls = [i for i in events[-1].response.output if isinstance(i, p.FunctionCall)]
    assert len(calls) == LONG_ROLLOUT_STEPS and all(len(c.arguments) > 2000 for c in calls)
    assert after["rollout_suspensions"] - before["rollout_suspensions"] == LONG_ROLLOUT_STEPS
    # Per suspension: its response.done and the resumed response.in_progress before it.
    per_step = [b - a for a, b in itertools.pairwise(readings)]
    assert len(per_step) == LONG_ROLLOUT_STEPS - 1
    assert max(per_step) - min(per_step) <= DIGITS_SLACK, per_step
    assert per_step[-1] < 1000  # ids, a status, an index: not 2,000 characters of arguments
    # The counter is the suspension frames the client received, byte for byte.
    suspension_frames = [
        f
        for before, f in itertools.pairwise(ws.raw)
        if f["type"] == "response.done"
        or (f["type"] == "response.in_progress" and before["type"] == "response.done")
    ]
    assert len(suspension_frames) == 2 * LONG_ROLLOUT_STEPS
    assert after["suspension_bytes_encoded"] - before["suspension_bytes_encoded"] == sum(
        map(_frame_bytes, suspension_frames)
    )
