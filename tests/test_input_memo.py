"""The input memo (`engine/_input_memo.py`): a stateless client's request decoded in the time
of what is new in it, with exactly the protocol decoder's answers.

- A follow-up that extends an earlier input decodes to what the protocol's decoder makes of
  it, its items keyed as the render cache keys them; only its new part is parsed.
- Every refusal is the protocol decoder's, word for word (message, code, param), whether the
  bad part is new or the memo could not take the message at all.
- Owners do not share entries; the per-owner count, the byte budget and the TTL hold.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import trio
from rollout.engine._engine import Engine, open_engine
from rollout.engine._input_memo import (
    FAST_DECODE_MIN_BYTES,
    MEMO_CONVERSATIONS_PER_OWNER,
    InputMemo,
    KeyedInput,
)
from rollout.engine._itemkey import ROOT_KEY, chain_key, item_key
from rollout.protocol import RemoteProtocolError, decode_create_body
from rollout.protocol._events import MAX_INPUT_ITEMS

LIMIT = 64 * 2**20
TASK = {"type": "message", "role": "user", "content": "Plan the trip. " + "word " * 8000}
TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
DEADLINE = 10


def body(items: list[Any], **fields: Any) -> bytes:
    return json.dumps({"model": "m", "tools": TOOLS, "input": items, **fields}).encode()


def turn(n: int) -> list[dict[str, Any]]:
    """A call and its output: the items a stateless client adds each turn."""
    return [
        {"type": "function_call", "call_id": f"c{n}", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": f"c{n}", "output": f"result {n}"},
    ]


def decode(memo: InputMemo, data: bytes, owner: str | None = None) -> Any:
    split = memo.split(data, owner, kind="body", max_size=LIMIT)
    return None if split is None else memo.finish(split)


def keys_of(items: list[Any]) -> list[bytes]:
    out, key = [], ROOT_KEY
    for item in items:
        key = chain_key(key, item_key(item)[0])
        out.append(key)
    return out


def test_a_follow_up_decodes_as_the_protocol_does_from_what_is_new() -> None:
    memo = InputMemo()
    items: list[Any] = [TASK]
    for n in range(4):
        items += turn(n)
        data = body(items)
        request = decode(memo, data)
        assert request == decode_create_body(data, max_size=LIMIT)
        assert isinstance(request.input, KeyedInput)
        assert request.input.keys == keys_of(list(request.input))
    assert memo.stats.misses == 1 and memo.stats.hits == 3
    assert memo.stats.items_reused == 3 + 5 + 7
    # the task's text was parsed once: after it, each request's new part (two small items)
    assert memo.stats.bytes_parsed < len(json.dumps([TASK])) + 3 * 400


def test_whitespace_between_items_is_an_item_boundary() -> None:
    memo = InputMemo()
    first = json.dumps({"model": "m", "input": [TASK]}).encode()
    decode(memo, first)
    spaced = first[: first.rindex(b"]")] + b' ,\n {"role": "user", "content": "more"}  ]}'
    request = decode(memo, spaced)
    assert request == decode_create_body(spaced, max_size=LIMIT)
    assert memo.stats.hits == 1


def test_an_input_that_only_starts_like_an_entry_is_not_taken_from_it() -> None:
    """The bytes of the entry's last item must end an item of the new input."""
    memo = InputMemo()
    long = {**TASK, "content": TASK["content"] + "x"}
    decode(memo, body([TASK]))
    data = body([long])
    # the text up to the end of the old item differs at its last quote: no hit, and the
    # answer is the protocol decoder's
    assert decode(memo, data) == decode_create_body(data, max_size=LIMIT)
    assert memo.stats.hits == 0


def test_owners_do_not_share_entries() -> None:
    memo = InputMemo()
    decode(memo, body([TASK, *turn(0)]), owner="a")
    decode(memo, body([TASK, *turn(0), *turn(1)]), owner="b")
    assert memo.stats.hits == 0 and memo.stats.misses == 2
    decode(memo, body([TASK, *turn(0), *turn(1)]), owner="a")
    assert memo.stats.hits == 1


def test_the_bounds_hold() -> None:
    now = [0.0]
    memo = InputMemo(ttl=10.0, clock=lambda: now[0])
    for n in range(MEMO_CONVERSATIONS_PER_OWNER + 2):
        decode(memo, body([{**TASK, "content": f"{n} " + TASK["content"]}]))
    assert len(memo) == MEMO_CONVERSATIONS_PER_OWNER
    # a request that extends an entry replaces it
    decode(memo, body([{**TASK, "content": "5 " + TASK["content"]}, *turn(0)]))
    assert len(memo) == MEMO_CONVERSATIONS_PER_OWNER and memo.stats.hits == 1
    now[0] = 11.0  # every entry expired: none serves, and the next one drops them
    decode(memo, body([{**TASK, "content": "5 " + TASK["content"]}, *turn(0), *turn(1)]))
    assert memo.stats.hits == 1 and len(memo) == 1
    small = InputMemo(max_bytes=len(body([TASK])) + 100)
    decode(small, body([TASK]), owner="a")
    decode(small, body([TASK]), owner="b")
    assert len(small) == 1 and small.bytes_held <= small.max_bytes


def test_small_messages_and_other_shapes_go_to_the_protocols_decoder() -> None:
    memo = InputMemo()
    assert decode(memo, body([{"role": "user", "content": "hi"}])) is None  # small
    assert memo.stats.fallbacks == 0
    assert decode(memo, json.dumps({"model": "m", "input": TASK["content"]}).encode()) is None
    assert memo.split(body([TASK]), None, kind="event", max_size=LIMIT) is None  # no type
    assert InputMemo(max_bytes=0).split(body([TASK]), None, kind="body", max_size=LIMIT) is None


# --- refusals: the protocol decoder's, word for word -------------------------------------------

BAD = {
    "trailing-comma": body([TASK])[:-2] + b",]}",
    "lone-surrogate": body([TASK, {"role": "user", "content": "\\ud800"}]).replace(
        b"\\\\ud800", b"\\ud800"
    ),
    "nan-in-tools": body([TASK]).replace(b'"object"}', b'"object", "x": NaN}'),
    "huge-float": body([TASK]).replace(b'"object"}', b'"object", "x": 1e400}'),
    "int-out-of-range": body([TASK]).replace(b'"object"}', b'"object", "x": 18446744073709551616}'),
    "type-in-a-body": body([TASK], type="response.create"),
    "unknown-item-type": body([TASK, {"type": "nonsense"}]),
    "bad-item-field": body([TASK, {"role": "user", "content": 7}]),
    "too-many-items": body([TASK] + [{"role": "user", "content": "x"}] * MAX_INPUT_ITEMS),
    "too-large": body([TASK]),
}


def protocol_error(data: bytes, limit: int) -> tuple[str, str | None, str | None]:
    with pytest.raises(RemoteProtocolError) as caught:
        decode_create_body(data, max_size=limit)
    error = caught.value.body
    return error.message, error.code, error.param


@pytest.mark.parametrize("case", sorted(BAD))
async def test_a_refusal_is_the_protocol_decoders(case: str) -> None:
    data = BAD[case]
    assert len(data) >= FAST_DECODE_MIN_BYTES
    limit = len(data) - 1 if case == "too-large" else LIMIT
    expected = protocol_error(data, limit)
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            # an entry the bad message starts with, so a memo hit is possible
            await decode_with(engine, body([TASK]), LIMIT)
            with pytest.raises(RemoteProtocolError) as caught:
                await decode_with(engine, data, limit)
    error = caught.value.body
    assert (error.message, error.code, error.param) == expected


async def decode_with(engine: Engine, data: bytes, limit: int) -> Any:
    return await engine.decode_create(
        functools.partial(decode_create_body, max_size=limit),
        data,
        owner=None,
        kind="body",
        max_size=limit,
    )


async def test_a_bad_new_item_after_a_memo_hit_names_its_place() -> None:
    """The error of an item after the remembered ones names its index in the whole input."""
    items: list[Any] = [TASK, *turn(0)]
    bad = body([*items, {"type": "function_call_output", "call_id": 3}])
    expected = protocol_error(bad, LIMIT)
    assert expected[2] == "input[3].call_id"
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            await decode_with(engine, body(items), LIMIT)
            with pytest.raises(RemoteProtocolError) as caught:
                await decode_with(engine, bad, LIMIT)
            assert engine.input_memo.stats.misses == 1
    error = caught.value.body
    assert (error.message, error.code, error.param) == expected


def test_references_and_compaction_items_are_counted_as_they_are_decoded() -> None:
    """The session reads these instead of looking through every item each turn."""
    memo = InputMemo()
    compaction = {"type": "compaction", "encrypted_content": "sealed"}
    items: list[Any] = [compaction, TASK]
    first = decode(memo, body(items))
    assert (first.input.references, first.input.last_compaction) == (0, 0)
    items += [{"type": "item_reference", "id": "msg_1"}, compaction, *turn(0)]
    second = decode(memo, body(items))
    assert memo.stats.hits == 1
    assert (second.input.references, second.input.last_compaction) == (1, 3)
    assert second == decode_create_body(body(items), max_size=LIMIT)


def test_other_fields_may_change_around_a_remembered_input() -> None:
    """A message whose text around the input is the entry's is decoded from the new items
    alone (its other fields are the entry's); one whose other fields changed is split again,
    and its input still starts from the entry's items. Either way, the protocol's answer."""
    memo = InputMemo()
    items: list[Any] = [TASK, *turn(0)]
    decode(memo, body(items, store=False))
    items += turn(1)
    same = body(items, store=False)
    parsed = memo.stats.bytes_parsed
    assert decode(memo, same) == decode_create_body(same, max_size=LIMIT)
    assert memo.stats.hits == 1 and memo.stats.bytes_parsed - parsed < 300
    items += turn(2)
    changed = body(items, store=True, temperature=0.5)
    assert decode(memo, changed) == decode_create_body(changed, max_size=LIMIT)
    assert memo.stats.hits == 2
    items += turn(3)
    again = body(items, store=True, temperature=0.5)
    assert decode(memo, again) == decode_create_body(again, max_size=LIMIT)
    assert memo.stats.hits == 3 and memo.stats.fallbacks == 0


def test_a_body_is_not_taken_for_an_event_around_the_same_text() -> None:
    """HTTP bodies and WebSocket messages have their own entries: a body never reuses a
    `response.create`'s (whose `type` a body may not carry)."""
    memo = InputMemo()
    event = json.dumps({"type": "response.create", "model": "m", "input": [TASK]}).encode()
    split = memo.split(event, None, kind="event", max_size=LIMIT)
    assert split is not None and memo.finish(split) is not None
    longer = event[: event.rindex(b"]")] + b', {"role": "user", "content": "x"}]}'
    assert decode(memo, longer) is None  # a body with `type`: the protocol's refusal
    assert memo.stats.fallbacks == 1
