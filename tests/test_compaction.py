"""Compaction: `POST /v1/responses/compact`, chains started from a compaction item, automatic
compaction (`context_management`), and the seal.

- Over HTTP with the official SDK: `client.responses.compact(...)` from input items and from
  previous_response_id gives the same window (modulo ids), within `budget_tokens`, ending with
  one `compaction` item; a missing model is 400. A new chain started from the window (no
  previous_response_id) works over HTTP and over WebSocket on another connection, skips the
  items before the compaction item, reuses the window's tokens (`cached_tokens`), and answers
  exactly as a stateless request carrying the window's items in full.
- `context_management: [{"type": "compaction", "compact_threshold": N}]` compacts once the
  context passes N, over HTTP and WebSocket: the compaction item is the first output item, the
  context shrinks, and the conversation continues (from the connection's cache, from the store
  and from the compaction item on a new chain: all three agree).
- A hypothesis property (engine level): for generated agent scripts and budgets, a chain
  continued from the compaction item (fast path) produces the same outputs and final context as
  the same chain sent statelessly with the window's items in full (slow path); the window is
  within its budget; and the fast path renders and classifies only the prefix, the new input
  and the outputs (the compacted history is never rendered again).
- The seal: flipping any byte of the decoded payload (every byte, first to last), a foreign
  key, truncation and non-canonical base64url are each refused as `invalid_compaction` naming
  `input[k].encrypted_content`; the session (and the WebSocket) stays usable.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rollout import protocol as p
from rollout.engine import (
    Engine,
    MemoryResponseStore,
    MemoryUsageLedger,
    ResponseState,
    Session,
    UsageRecord,
    open_engine,
)
from rollout.engine._compact import SnapshotSeal

from tests.engine_harness import (
    MAX_TURNS,
    Script,
    classified_chars,
    pending_calls,
    same_items,
    scripts,
)
from tests.server_harness import open_test_server, open_ws, run_in_thread

DEADLINE = 20
KEY = bytes(range(32))
KEY_A, KEY_B = "sk-compaction-a", "sk-compaction-b"
LONG = "Tell me more about the history of the harbour and its ships. " * 6
TURNS = [f"{LONG} (turn {i})" for i in range(5)]
MODEL = "sim:steps=0,tokens=24"


def sdk(url: str, *, strict: bool = True) -> openai.OpenAI:
    # The SDK's `CompactedResponse.output` is typed as output items (assistant messages
    # only), though the API's window holds user messages too: compaction is parsed leniently.
    return openai.OpenAI(
        base_url=url,
        api_key="sk-test",
        max_retries=0,
        timeout=10,
        _strict_response_validation=strict,
    )


def compact_raw(client: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    """`client.responses.compact(...)`: the parsed object's id and type checked, the raw JSON
    returned (so the window is echoed back exactly as the server sent it)."""
    raw = client.responses.with_raw_response.compact(**kw)
    parsed = raw.parse()
    assert parsed.object == "response.compaction"
    assert parsed.output[-1].type == "compaction"
    body: dict[str, Any] = raw.http_response.json()
    assert body["id"] == parsed.id
    return body


def strip(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for item in items:
        wire = p.to_wire(p.from_wire(item, p.Item))
        wire.pop("id", None)
        out.append(wire)
    return out


def answer(response: Any) -> tuple[str, int]:
    return response.output_text, response.usage.input_tokens


# --- /v1/responses/compact over HTTP, new chains over HTTP and WebSocket ------------------------


def http_compact(url: str) -> dict[str, Any]:
    client = sdk(url)
    lenient = sdk(url, strict=False)
    out: dict[str, Any] = {}
    prev = None
    history: list[dict[str, Any]] = []
    for text in TURNS:
        response = client.responses.create(model=MODEL, input=text, previous_response_id=prev)
        prev = response.id
        history.append({"role": "user", "content": text})
        history.extend(o.model_dump(exclude_none=True) for o in response.output)
    budget = 400
    by_id = compact_raw(
        lenient, model="sim", previous_response_id=prev, extra_body={"budget_tokens": budget}
    )
    by_items = compact_raw(
        lenient, model="sim", input=history, extra_body={"budget_tokens": budget}
    )
    out["by_id"], out["by_items"], out["budget"] = by_id, by_items, budget
    out["source_tokens"] = client.responses.input_tokens.count(
        model="sim", previous_response_id=prev
    ).input_tokens
    window = by_id["output"]
    question = {"role": "user", "content": "So what happened next?"}
    # A new chain from the whole window (items before the compaction item are superseded),
    # from the compaction item alone, and the slow path: the window's items in full.
    out["from_window"] = client.responses.create(model=MODEL, input=[*window, question])
    out["from_item"] = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "ignored"}, window[-1], question]
    )
    out["slow"] = client.responses.create(model=MODEL, input=[*window[:-1], question])
    out["slow_continued"] = client.responses.create(
        model=MODEL,
        input=[
            *window[:-1],
            question,
            *(o.model_dump(exclude_none=True) for o in out["slow"].output),
            {"role": "user", "content": "And then?"},
        ],
    )
    # Errors: no model; a bad budget; a compaction item with previous_response_id.
    raw = httpx.Client(base_url=url, timeout=10)
    errors = {}
    for name, body in {
        "no_model": {"input": history},
        "bad_budget": {"model": "sim", "input": history, "budget_tokens": -1},
    }.items():
        response = raw.post("/responses/compact", json=body)
        errors[name] = (response.status_code, response.json()["error"])
    try:
        client.responses.create(
            model=MODEL, input=[window[-1], question], previous_response_id=prev
        )
    except openai.BadRequestError as exc:
        errors["with_previous"] = (exc.status_code, dict(exc.body))  # type: ignore[call-overload]
    out["errors"] = errors
    return out


async def test_compact_endpoint_and_new_chains() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            got = await run_in_thread(http_compact, url)
            window = got["by_id"]["output"]
            question = {"role": "user", "content": "So what happened next?"}
            async with open_ws(url) as ws:  # another connection than every request above
                events = await ws.create(model=MODEL, input=[window[-1], question])
                ws_first = events[-1].response
                events = await ws.create(
                    model=MODEL, input="And then?", previous_response_id=ws_first.id
                )
                ws_continued = events[-1].response
    by_id, by_items, budget = got["by_id"], got["by_items"], got["budget"]
    # The same window either way, within its budget, ending with one compaction item.
    assert strip(by_id["output"][:-1]) == strip(by_items["output"][:-1])
    assert [i["type"] for i in by_id["output"]].count("compaction") == 1
    assert by_id["output"][-1]["type"] == "compaction"
    assert by_id["output"][-1]["encrypted_content"]
    assert by_id["usage"]["output_tokens"] <= budget
    assert by_id["usage"]["input_tokens"] == got["source_tokens"] > budget
    # Reasoning is dropped; the last two user turns are kept verbatim (listed as the API lists
    # items: one text part, and a status).
    users = [i for i in window if i.get("role") == "user"]
    assert [u["content"] for u in users[-2:]] == [
        [{"type": "input_text", "text": turn}] for turn in TURNS[-2:]
    ]
    assert all(i["status"] == "completed" for i in window if i["type"] == "message")
    # New chains from the window: equal to the slow path, reusing the window's tokens.
    fast, slow = got["from_window"], got["slow"]
    assert answer(fast) == answer(got["from_item"]) == answer(slow)
    window_tokens = by_id["usage"]["output_tokens"]
    assert fast.usage.input_tokens_details.cached_tokens == window_tokens
    assert slow.usage.input_tokens_details.cached_tokens == 0
    # Over WebSocket, on another connection: the same answers.
    assert ws_first.usage is not None and ws_continued.usage is not None
    assert (ws_first.output[0].content[0].text, ws_first.usage.input_tokens) == answer(fast)
    # Continued from the connection's cache: the same as the slow path continued.
    assert (ws_continued.output[0].content[0].text, ws_continued.usage.input_tokens) == answer(
        got["slow_continued"]
    )

    errors = got["errors"]
    status, error = errors["no_model"]
    assert (status, error["code"], error["param"]) == (400, "missing_required_parameter", "model")
    status, error = errors["bad_budget"]
    assert (status, error["param"]) == (400, "budget_tokens")
    status, error = errors["with_previous"]
    assert (status, error["param"]) == (400, "input[0]")


# --- automatic compaction -------------------------------------------------------------------------

THRESHOLD = 300
AUTO = [{"type": "compaction", "compact_threshold": THRESHOLD}]


def http_auto(url: str) -> dict[str, Any]:
    client = sdk(url)
    prev = None
    for text in TURNS[:3]:
        prev = client.responses.create(model=MODEL, input=text, previous_response_id=prev).id
    small = client.responses.create(
        model=MODEL,
        input="short",
        context_management=[{"type": "compaction", "compact_threshold": 100_000}],
    )
    auto = client.responses.create(
        model=MODEL, input="Go on.", previous_response_id=prev, context_management=AUTO
    )
    # Continue: hydrated from the store, and a new chain from the compaction item.
    continued = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=auto.id)
    dumped = [o.model_dump(exclude_none=True) for o in auto.output]
    from_item = client.responses.create(
        model=MODEL, input=[*dumped, {"role": "user", "content": "Thanks."}]
    )
    return {
        "small": small,
        "auto": auto,
        "continued": continued,
        "from_item": from_item,
        "source": client.responses.input_tokens.count(
            model=MODEL, input="Go on.", previous_response_id=prev
        ).input_tokens,
    }


async def test_automatic_compaction_http_and_websocket(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            got = await run_in_thread(http_auto, url)
            async with open_ws(url) as ws:
                prev = None
                for text in TURNS[:3]:
                    events = await ws.create(model=MODEL, input=text, previous_response_id=prev)
                    prev = events[-1].response.id
                events = await ws.create(
                    model=MODEL, input="Go on.", previous_response_id=prev, context_management=AUTO
                )
                ws_auto_events = events
                events = await ws.create(
                    model=MODEL, input="Thanks.", previous_response_id=events[-1].response.id
                )
                ws_continued = events[-1].response
    small, auto = got["small"], got["auto"]
    assert [o.type for o in small.output] == ["message"]
    assert [o.type for o in auto.output] == ["compaction", "message"]
    assert got["source"] > THRESHOLD
    assert auto.usage.input_tokens <= THRESHOLD // 2 < got["source"]
    assert auto.usage.input_tokens_details.cached_tokens == 0
    # The compaction item goes out as the response's first output item, in stream order.
    ws_auto = ws_auto_events[-1].response
    added = [e.item.type for e in ws_auto_events if e.type == "response.output_item.added"]
    assert added == ["compaction", "message"]
    assert [o.type for o in ws_auto.output] == ["compaction", "message"]
    assert ws_auto.output[1].content[0].text == auto.output_text
    assert ws_auto.usage is not None and ws_auto.usage.input_tokens == auto.usage.input_tokens
    # Continuing from the cache (WebSocket), the store (HTTP) and the compaction item agree.
    assert answer(got["continued"]) == answer(got["from_item"])
    assert ws_continued.usage is not None
    assert (ws_continued.output[0].content[0].text, ws_continued.usage.input_tokens) == answer(
        got["continued"]
    )


async def test_invalid_context_management_is_refused_before_the_response_starts() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url, open_ws(url) as ws:
            await ws.send(
                {
                    "type": "response.create",
                    "model": "sim",
                    "input": "hi",
                    "context_management": [{"type": "compaction", "compact_threshold": 0}],
                }
            )
            first = await ws.recv()
    assert first.type == "error"
    assert first.error.param == "context_management"


# --- the property: fast path == slow path ---------------------------------------------------------


def rendered(engine: Engine, items: list[p.Item]) -> int:
    return sum(len(engine.pipeline.renderer.render_item(i)) for i in items)


async def drive(
    session: Session,
    script: Script,
    first_input: list[p.Item],
    turns: list[str],
    *,
    stateless: bool,
) -> tuple[list[p.Item], list[ResponseState]]:
    """Run `turns` (the first one after `first_input`) answering tool calls, chained from
    `first_input` (previous_response_id) or statelessly (the whole history each time)."""
    outputs: list[p.Item] = []
    states: list[ResponseState] = []
    history: list[p.Item] = list(first_input)
    new: list[p.Item] = list(first_input)
    prev: str | None = None
    n = 0
    for k, text in enumerate(turns):
        message = p.Message(role="user", content=text)
        history.append(message)
        new = [*new, message] if k == 0 else [message]
        for _ in range(MAX_TURNS):
            request = (
                script.create(input=list(history), store=False)
                if stateless
                else script.create(input=new, previous_response_id=prev, store=False)
            )
            state = await session.create(request)
            assert state is not None
            states.append(state)
            outputs.extend(state.response.output)
            history.extend(state.response.output)
            prev = state.id
            calls = pending_calls(state.response.output)
            if not calls or state.response.status != "completed":
                break
            new = [script.answer(c, n + i) for i, c in enumerate(calls)]
            n += len(calls)
            history.extend(new)
    return outputs, states


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    script=scripts(max_user_turns=4),
    repeat=st.integers(1, 12),
    percent=st.integers(0, 110) | st.just(100),
    after=st.lists(st.text(max_size=30), min_size=1, max_size=2),
)
async def test_fast_path_equals_slow_path(
    script: Script, repeat: int, percent: int, after: list[str]
) -> None:
    """`percent` sets the budget relative to the conversation's item tokens, so windows range
    from empty through partial (stubs, dropped units) to whole; `repeat` lengthens the user
    turns and tool outputs past the 200 characters a stub keeps."""
    script = attrs.evolve(
        script,
        user_turns=tuple(t * repeat for t in script.user_turns),
        tool_outputs=tuple(t * repeat for t in script.tool_outputs),
    )
    with trio.fail_after(30):
        async with open_engine() as engine:
            session = engine.session()
            _, states = await drive(session, script, [], list(script.user_turns), stateless=False)
            source = list(states[-1].items)
            budget = states[-1].item_tokens * percent // 100
            compacted = await session.compact(
                script.create(previous_response_id=states[-1].id), budget_tokens=budget
            )
            window = [p.from_wire(i, p.Item) for i in compacted["output"]]
            item = window.pop()
            assert isinstance(item, p.Compaction)
            assert not any(isinstance(i, p.Compaction | p.Reasoning) for i in window)
            kept = sum(i in source for i in window)
            shape = "empty" if not window else "whole" if kept == len(source) else "part"
            event(f"window: {shape}")
            event(f"stubs: {kept < len(window)}")
            event(f"calls in window: {any(isinstance(i, p.FunctionCall) for i in window)}")
            # Within budget, and the usage says so.
            assert rendered(engine, window) == compacted["usage"]["output_tokens"] <= budget
            assert compacted["usage"]["input_tokens"] == states[-1].context_tokens

            # The fast path's first request, on a new session (another connection).
            fast_session = engine.session()
            first = script.create(
                input=[item, p.Message(role="user", content=after[0])], store=False
            )
            before = engine.counters.snapshot()
            state = await fast_session.create(first)
            delta = engine.counters - before
            assert state is not None
            new_tokens = rendered(engine, [p.Message(role="user", content=after[0])])
            out_tokens = rendered(engine, list(state.response.output))
            # The instructions and tools were rendered by the first session: the render
            # cache has them.
            assert delta.tokens_rendered == new_tokens + out_tokens
            assert delta.chars_classified == classified_chars(
                engine, [p.Message(role="user", content=after[0]), *state.response.output]
            )
            assert state.response.usage is not None
            details = state.response.usage.input_tokens_details
            assert details is not None
            # Cached: all but the new message (the window, and the render cache's instructions
            # and tools).
            assert details.cached_tokens == state.response.usage.input_tokens - new_tokens

            fast_out, fast_states = await drive(
                engine.session(), script, [item], after, stateless=False
            )
            slow_out, slow_states = await drive(
                engine.session(), script, window, after, stateless=True
            )
    assert same_items(fast_out, slow_out)
    assert same_items(list(state.response.output), fast_out[: len(state.response.output)])
    fast_final, slow_final = fast_states[-1], slow_states[-1]
    assert fast_final.context() == slow_final.context()
    assert fast_final.context_digest == slow_final.context_digest
    assert fast_final.classifier_state == slow_final.classifier_state
    fast_usage = [r.response.usage for r in fast_states]
    slow_usage = [r.response.usage for r in slow_states]
    assert [u.input_tokens for u in fast_usage if u] == [u.input_tokens for u in slow_usage if u]


# --- the seal ------------------------------------------------------------------------------------


def b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


async def make_item(engine: Engine, budget: int = 300) -> p.Compaction:
    session = engine.session()
    prev = None
    for text in TURNS[:3]:
        state = await session.create(
            p.ResponseCreate(model=MODEL, input=text, previous_response_id=prev, store=False)
        )
        assert state is not None
        prev = state.id
    compacted = await session.compact(
        p.ResponseCreate(model="sim", previous_response_id=prev), budget_tokens=budget
    )
    item = p.from_wire(compacted["output"][-1], p.Item)
    assert isinstance(item, p.Compaction)
    return item


async def refused(session: Session, item: p.Compaction, text: str) -> p.ErrorBody:
    """Create with `[superseded message, compaction with `text`, question]`: the error."""
    tampered = p.Compaction(encrypted_content=text, id=item.id, created_by=item.created_by)
    request = p.ResponseCreate(
        model=MODEL,
        input=[
            p.Message(role="user", content="superseded"),
            tampered,
            p.Message(role="user", content="?"),
        ],
        store=False,
    )
    with pytest.raises(p.RemoteProtocolError) as info:
        await session.create(request)
    return info.value.body


def non_canonical(text: str) -> dict[str, str]:
    variants = {
        "padded": text + "=" * (-len(text) % 4 or 4),
        "standard_alphabet": text.replace("-", "+").replace("_", "/"),
        "newline": text[:40] + "\n" + text[40:],
        "space": " " + text,
    }
    # Each spells the same bytes (a lenient decoder accepts them all).
    assert variants["standard_alphabet"] != text
    for variant in variants.values():
        assert base64.b64decode(variant.replace("-", "+").replace("_", "/") + "==") == (
            b64decode(text)
        )
    return variants


async def test_tampering_any_byte_is_refused() -> None:
    with trio.fail_after(DEADLINE):
        async with (
            open_engine(compaction_key=KEY) as engine,
            open_engine(compaction_key=bytes(32)) as foreign_engine,
        ):
            item = await make_item(engine)
            foreign = await make_item(foreign_engine)
            raw = b64decode(item.encrypted_content)
            assert b64encode(raw) == item.encrypted_content
            session = engine.session()
            param = "input[1].encrypted_content"
            # Every byte, first to last: the version, the payload and the MAC.
            assert 200 < len(raw) < 20_000
            for i in range(len(raw)):
                flipped = bytearray(raw)
                flipped[i] ^= 0xFF
                error = await refused(session, item, b64encode(bytes(flipped)))
                assert (error.code, error.param) == ("invalid_compaction", param), i
            # A single bit anywhere, too (a sample of positions).
            for i in range(0, len(raw), max(1, len(raw) // 64)):
                for bit in (0x01, 0x80):
                    flipped = bytearray(raw)
                    flipped[i] ^= bit
                    error = await refused(session, item, b64encode(bytes(flipped)))
                    assert (error.code, error.param) == ("invalid_compaction", param)
            # Foreign (another key), truncated, extended, non-canonical, empty.
            texts = {
                "foreign": foreign.encrypted_content,
                "truncated_char": item.encrypted_content[:-1],
                "truncated_block": item.encrypted_content[:-4],
                "truncated_bytes": b64encode(raw[:-1]),
                "mac_only": b64encode(raw[-32:]),
                "version_only": b64encode(raw[:1]),
                "extended": b64encode(raw + b"\x00"),
                "empty": "",
                "not_base64": "!!!!" + item.encrypted_content[4:],
                **non_canonical(item.encrypted_content),
            }
            for name, text in texts.items():
                error = await refused(session, item, text)
                assert (error.code, error.param) == ("invalid_compaction", param), name
                assert "Invalid compaction item" in error.message
            # Sealed by this server but not a snapshot: refused too (naming the item).
            for payload in ({"template": "another"}, {"items": "nope"}, {}):
                error = await refused(session, item, engine.seal.seal(payload, owner=None))
                assert (error.code, error.param) == ("invalid_compaction", "input[1]"), payload
            # The session is still usable: the genuine item works, here and on the engine
            # with the same key (a restarted server keeps its key).
            for target in (session, engine.session()):
                state = await target.create(
                    p.ResponseCreate(
                        model=MODEL, input=[item, p.Message(role="user", content="?")], store=False
                    )
                )
                assert state is not None and state.response.status == "completed"
        async with open_engine(compaction_key=KEY) as restarted:
            state = await restarted.session().create(
                p.ResponseCreate(
                    model=MODEL, input=[item, p.Message(role="user", content="?")], store=False
                )
            )
            assert state is not None and state.response.status == "completed"


def test_a_seal_is_bound_to_its_owner() -> None:
    """An item made for one API key is refused for another (and for no key), byte for byte
    the same text: the owner is part of what the MAC covers."""
    seal = SnapshotSeal(KEY)
    text = seal.seal({"pad": "x"}, owner="owner-a")
    assert seal.open(text, param="p", owner="owner-a") == {"pad": "x"}
    for other in ("owner-b", None, "owner-a "):
        with pytest.raises(p.RemoteProtocolError) as info:
            seal.open(text, param="p", owner=other)
        assert info.value.body.code == "invalid_compaction"


async def test_a_compaction_item_of_key_a_is_refused_for_key_b() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(api_keys=(KEY_A, KEY_B)) as url:
            async with httpx.AsyncClient(timeout=DEADLINE) as client:
                a = {"authorization": f"Bearer {KEY_A}"}
                b = {"authorization": f"Bearer {KEY_B}"}
                body = {"model": MODEL, "input": [{"role": "user", "content": t} for t in TURNS]}
                window = (
                    await client.post(f"{url}/responses/compact", json=body, headers=a)
                ).json()["output"]
                follow = {"model": MODEL, "input": [window[-1], {"role": "user", "content": "?"}]}
                ok = await client.post(f"{url}/responses", json=follow, headers=a)
                refused = await client.post(f"{url}/responses", json=follow, headers=b)
    assert ok.status_code == 200, ok.text
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "invalid_compaction"


def test_seal_accepts_only_the_canonical_spelling() -> None:
    """Trailing bits: base64url text whose length leaves spare bits has other spellings of
    the same bytes (change the spare bits of its last character); only one is accepted."""
    seal = SnapshotSeal(KEY)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    checked = 0
    for size in range(3):  # three payload lengths: every residue of the encoded length
        text = seal.seal({"pad": "x" * size}, owner=None)
        assert seal.open(text, param="p", owner=None) == {"pad": "x" * size}
        if len(text) % 4 == 0:
            continue
        # The lowest bit of the last character is a spare bit (2 or 4 spare bits there).
        other = text[:-1] + alphabet[alphabet.index(text[-1]) ^ 1]
        assert b64decode(other) == b64decode(text)
        with pytest.raises(p.RemoteProtocolError) as info:
            seal.open(other, param="p", owner=None)
        assert (info.value.body.code, info.value.body.param) == ("invalid_compaction", "p")
        checked += 1
    assert checked == 2
    with pytest.raises(ValueError):
        SnapshotSeal(b"short")


async def test_tampered_items_over_websocket_and_http() -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:

            def make(url: str) -> dict[str, Any]:
                client = sdk(url)
                prev = None
                for text in TURNS[:3]:
                    prev = client.responses.create(
                        model=MODEL, input=text, previous_response_id=prev
                    ).id
                return compact_raw(
                    sdk(url, strict=False),
                    model="sim",
                    previous_response_id=prev,
                    extra_body={"budget_tokens": 300},
                )["output"][-1]

            item = await run_in_thread(make, url)
            raw = b64decode(item["encrypted_content"])
            positions = sorted({0, 1, len(raw) // 2, len(raw) - 33, len(raw) - 1})
            question = {"role": "user", "content": "?"}
            async with open_ws(url) as ws:
                for i in positions:
                    flipped = bytearray(raw)
                    flipped[i] ^= 0xFF
                    bad = dict(item, encrypted_content=b64encode(bytes(flipped)))
                    await ws.send(
                        {
                            "type": "response.create",
                            "model": MODEL,
                            "input": [question, bad, question],
                        }
                    )
                    error = await ws.error()
                    assert (error.status, error.error.code, error.error.param) == (
                        400,
                        "invalid_compaction",
                        "input[1].encrypted_content",
                    )
                events = await ws.create(model=MODEL, input=[item, question])
                assert events[-1].type == "response.completed"

            def http_bad(url: str) -> dict[str, Any]:
                bad = dict(item, encrypted_content=item["encrypted_content"][:-4])
                try:
                    sdk(url).responses.create(model=MODEL, input=[bad, question])
                except openai.BadRequestError as exc:
                    return dict(exc.body)  # type: ignore[call-overload]
                raise AssertionError("accepted")

            body = await run_in_thread(http_bad, url)
    assert (body["code"], body["param"]) == ("invalid_compaction", "input[0].encrypted_content")


async def test_params_after_a_compaction_item_count_from_the_whole_input() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            item = await make_item(engine)
            bad = p.Message(role="user", content=[p.InputImage(image_url="ftp://x/y.png")])
            with pytest.raises(p.RemoteProtocolError) as info:
                await engine.session().create(
                    p.ResponseCreate(model=MODEL, input=[item, bad], store=False)
                )
    assert info.value.body.param == "input[1].content[0].image_url"


async def test_reference_after_a_compaction_item_names_its_index() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            item = await make_item(engine)
            with pytest.raises(p.RemoteProtocolError) as info:
                await engine.session().create(
                    p.ResponseCreate(
                        model=MODEL,
                        input=[
                            p.Message(role="user", content="superseded"),
                            item,
                            p.Message(role="user", content="?"),
                            p.ItemReference(id="msg_unknown"),
                        ],
                        store=False,
                    )
                )
    assert (info.value.body.code, info.value.body.param) == ("item_not_found", "input[3].id")


async def test_chain_from_a_compaction_item_continues_from_the_store() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(store=MemoryResponseStore()) as engine:
            item = await make_item(engine)
            session = engine.session()
            first = await session.create(
                p.ResponseCreate(model=MODEL, input=[item, p.Message(role="user", content="?")])
            )
            assert first is not None
            follow = p.ResponseCreate(model=MODEL, input="And then?", previous_response_id=first.id)
            await engine.post.flushed()
            hydrated = await engine.session().create(follow)  # another connection: the store
            cached = await session.create(follow)  # the same connection: its cache
    assert cached is not None and hydrated is not None
    assert hydrated.context() == cached.context()


# --- what a compaction costs goes into the ledger ---------------------------------------------


class _DownLedger(MemoryUsageLedger):
    """A ledger whose database is down: every async write fails."""

    async def record(self, records: Sequence[UsageRecord]) -> None:
        raise OSError("the database is down")


async def test_a_compactions_usage_is_in_the_ledger_when_its_reply_is() -> None:
    """The usage a compaction reports is recorded once, under its id, before `compact`
    returns (nothing flushed first): the ledger's total is what clients were told."""
    with trio.fail_after(DEADLINE):
        ledger = MemoryUsageLedger()
        async with open_engine(ledger=ledger) as engine:
            session = engine.session(owner="team-a")
            state = await session.create(p.ResponseCreate(model=MODEL, input=TURNS[0]))
            assert state is not None
            compacted = await session.compact(
                p.ResponseCreate(model="sim", previous_response_id=state.id), budget_tokens=300
            )
            rows = await ledger.rows(compacted["id"])
            usage = compacted["usage"]
            assert [
                (r.step, r.owner, r.model, r.input_tokens, r.output_tokens, r.complete)
                for r in rows
            ] == [(0, "team-a", "sim", usage["input_tokens"], usage["output_tokens"], True)]
            assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0


async def test_a_compaction_whose_usage_cannot_be_recorded_is_a_server_error() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine(ledger=_DownLedger()) as engine:
            session = engine.session()
            with pytest.raises(p.RemoteProtocolError) as raised:
                await session.compact(p.ResponseCreate(model="sim", input=TURNS[0]))
    assert raised.value.status == 500 and raised.value.body.code == "server_error"
