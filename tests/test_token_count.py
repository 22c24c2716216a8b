"""`POST /v1/responses/input_tokens` and `GET /v1/responses/{id}/input_items`.

- The count is exact: it equals the `usage.input_tokens` the engine reports when the same
  request is created (the same pipeline renders both), for plain text, instructions and tools,
  images and files, item references and previous_response_id (from the cache, from the store,
  and after a tool call); counting samples nothing and stores nothing. A hypothesis property
  checks it at every turn of generated agent scripts, chained and stateless.
- input_items pages like the OpenAI API: `limit` (1..100, default 20), `order` (asc/desc,
  default desc), the `after` cursor, `has_more`, `first_id`/`last_id`; the official SDK's
  `client.responses.input_items.list(...)` (strictly validated) auto-paginates through all of
  them in either order. A continued response lists its whole conversation up to its own
  output. Bad parameters are 400 naming the param; another key's response is 404.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import openai
import trio
from hypothesis import HealthCheck, given, settings
from rollout import protocol as p
from rollout.engine import MemoryResponseStore, open_engine

from tests.engine_harness import MAX_TURNS, Script, pending_calls, scripts
from tests.server_harness import (
    WEATHER_TOOLS,
    fetch_counters,
    open_test_server,
    run_in_thread,
)

DEADLINE = 20
KEY_A, KEY_B = "sk-count-a", "sk-count-b"
PNG_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + bytes(40)).decode()
TEXT_FILE = "data:text/plain;base64," + base64.b64encode(b"a small text file").decode()


def sdk(url: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url, api_key=key, max_retries=0, timeout=10, _strict_response_validation=True
    )


# --- input_tokens -------------------------------------------------------------------------------

REQUESTS: list[dict[str, Any]] = [
    {"model": "sim:tokens=3", "input": "hello there"},
    {
        "model": "sim:tokens=3,steps=0",
        "instructions": "Be brief.",
        "tools": WEATHER_TOOLS,
        "input": [
            {"role": "developer", "content": "Answer in French."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in these?"},
                    {"type": "input_image", "image_url": PNG_URL, "detail": "low"},
                    {"type": "input_image", "image_url": "https://example.com/a.png"},
                    {"type": "input_file", "file_data": TEXT_FILE, "filename": "a.txt"},
                    {"type": "input_file", "file_id": "file-1"},
                ],
            },
        ],
    },
]


def http_counts(url: str) -> dict[str, Any]:
    client = sdk(url)
    pairs: list[tuple[int, int]] = []

    def same(**request: Any) -> Any:
        """Count, then create the same request: both numbers."""
        counted = client.responses.input_tokens.count(**request)
        assert counted.object == "response.input_tokens"
        created = client.responses.create(**request)
        assert created.usage is not None
        pairs.append((counted.input_tokens, created.usage.input_tokens))
        return created

    for request in REQUESTS:
        same(**request)
    # previous_response_id: hydrated from the store, after a tool call.
    first = same(model="sim:steps=1,tokens=3", input="weather?", tools=WEATHER_TOOLS)
    outputs = [
        {"type": "function_call_output", "call_id": o.call_id, "output": "sunny"}
        for o in first.output
        if o.type == "function_call"
    ]
    assert outputs
    second = same(
        model="sim:steps=1,tokens=3",
        input=outputs,
        tools=WEATHER_TOOLS,
        previous_response_id=first.id,
    )
    # New instructions on a continuation: the prefix is rendered anew, and counted so.
    same(
        model="sim:tokens=3",
        input="and now?",
        instructions="Other instructions.",
        previous_response_id=second.id,
    )
    # Without a model the count uses the default renderer all models share.
    default = client.responses.input_tokens.count(input="hello there").input_tokens
    errors = {}
    for name, request in {
        "unknown_parent": {"input": "x", "previous_response_id": "resp_missing"},
        "bad_part": {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "missing_output": {"input": "x", "previous_response_id": first.id},
    }.items():
        try:
            errors[name] = client.responses.input_tokens.count(model="sim", **request)
        except openai.BadRequestError as exc:
            errors[name] = dict(exc.body)  # type: ignore[call-overload]
    return {"pairs": pairs, "default": default, "errors": errors}


async def test_count_equals_created_input_tokens(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path) as url:
            got = await run_in_thread(http_counts, url)
            before = await fetch_counters(url)

            def counts_only(url: str) -> int:
                client = sdk(url)
                return sum(
                    client.responses.input_tokens.count(**request).input_tokens
                    for request in REQUESTS
                )

            await run_in_thread(counts_only, url)
            after = await fetch_counters(url)
    pairs = got["pairs"]
    assert len(pairs) == 5
    for counted, created in pairs:
        assert counted == created > 0
    assert got["default"] == pairs[0][0]
    errors = got["errors"]
    assert (errors["unknown_parent"]["code"], errors["unknown_parent"]["param"]) == (
        "previous_response_not_found",
        "previous_response_id",
    )
    assert errors["bad_part"]["param"] == "input[0].content[0].image_url"
    # Counting a request whose tool call is still unanswered is fine (nothing is sampled).
    assert getattr(errors["missing_output"], "input_tokens", 0) > 0
    # Counting samples nothing, stores nothing and records no usage.
    for counter in ("samplings", "store_writes", "ledger_records", "responses_completed"):
        assert after[counter] == before[counter], counter
    assert after["tokens_rendered"] > before["tokens_rendered"]


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(script=scripts())
async def test_count_is_exact_at_every_turn(script: Script) -> None:
    """At every turn of a generated rollout, `prepare_only` (what input_tokens answers) gives
    the input tokens of the create that follows, chained (from the cache and from the store)
    and stateless."""
    with trio.fail_after(30):
        async with open_engine(store=MemoryResponseStore()) as engine:
            session = engine.session()
            history: list[p.Item] = []
            prev: str | None = None
            n = 0
            for text in script.user_turns:
                new: list[p.Item] = [p.Message(role="user", content=text)]
                for _ in range(MAX_TURNS):
                    history.extend(new)
                    chained = script.create(input=new, previous_response_id=prev, store=True)
                    stateless = script.create(input=list(history), store=False)
                    cached_count = (await session.prepare_only(chained)).context_tokens
                    stateless_count = (
                        await engine.session().prepare_only(stateless)
                    ).context_tokens
                    if prev is not None:
                        await engine.post.flushed()
                        stored_count = (await engine.session().prepare_only(chained)).context_tokens
                        assert stored_count == cached_count
                    state = await session.create(chained)
                    assert state is not None and state.response.usage is not None
                    assert state.response.usage.input_tokens == cached_count == stateless_count
                    prev = state.id
                    history.extend(state.response.output)
                    calls = pending_calls(state.response.output)
                    if not calls or state.response.status != "completed":
                        break
                    new = []
                    for call in calls:
                        new.append(script.answer(call, n))
                        n += 1


# --- input_items --------------------------------------------------------------------------------

N_INPUTS = 25


def http_listing(url: str) -> dict[str, Any]:
    client = sdk(url)
    raw = httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY_A}"}, timeout=10)
    out: dict[str, Any] = {}
    inputs: list[dict[str, Any]] = [
        {"role": "user", "content": f"message {i}"} for i in range(N_INPUTS - 1)
    ]
    inputs.append(
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "message 24"},
                {"type": "input_image", "image_url": PNG_URL, "detail": "high"},
            ],
        }
    )
    first = client.responses.create(model="sim:tokens=4", input=inputs, store=True)
    out["first"] = first
    # Pages with the SDK's auto-pagination (each page strictly validated).
    out["desc"] = list(client.responses.input_items.list(first.id, limit=7))
    out["asc"] = list(client.responses.input_items.list(first.id, limit=10, order="asc"))
    out["default_page"] = client.responses.input_items.list(first.id)
    # The raw pages: first_id / last_id / has_more / after.
    out["raw_default"] = raw.get(f"/responses/{first.id}/input_items").json()
    ids_asc = [i.id for i in out["asc"]]
    out["raw_after"] = raw.get(
        f"/responses/{first.id}/input_items",
        params={"order": "asc", "after": ids_asc[9], "limit": 5},
    ).json()
    out["raw_last"] = raw.get(
        f"/responses/{first.id}/input_items",
        params={"order": "asc", "after": ids_asc[19], "limit": 5},
    ).json()
    out["raw_max"] = raw.get(f"/responses/{first.id}/input_items", params={"limit": 100}).json()
    # A continuation lists its conversation up to (not including) its own output.
    second = client.responses.create(
        model="sim:tokens=4", input="and one more", previous_response_id=first.id
    )
    out["second"] = second
    out["second_items"] = list(client.responses.input_items.list(second.id, order="asc"))
    bad = {}
    for name, params in {
        "limit_zero": {"limit": 0},
        "limit_big": {"limit": 101},
        "limit_text": {"limit": "many"},
        "order": {"order": "sideways"},
    }.items():
        response = raw.get(f"/responses/{first.id}/input_items", params=params)
        bad[name] = (response.status_code, response.json()["error"])
    missing = raw.get("/responses/resp_nope/input_items")
    bad["missing"] = (missing.status_code, missing.json()["error"])
    other = raw.get(
        f"/responses/{first.id}/input_items", headers={"authorization": f"Bearer {KEY_B}"}
    )
    bad["other_key"] = (other.status_code, other.json()["error"])
    out["bad"] = bad
    return out


def text_of(item: Any) -> str:
    return str(item.content[0].text)


async def test_input_items_pagination(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, api_keys=(KEY_A, KEY_B)) as url:
            got = await run_in_thread(http_listing, url)
    expected = [f"message {i}" for i in range(N_INPUTS)]
    desc, asc = got["desc"], got["asc"]
    assert [text_of(i) for i in asc] == expected
    assert [text_of(i) for i in desc] == expected[::-1]
    assert [i.id for i in desc] == [i.id for i in asc][::-1]
    assert len({i.id for i in asc}) == N_INPUTS and all(i.id.startswith("msg_") for i in asc)
    assert all(i.type == "message" and i.role == "user" for i in asc)
    assert asc[-1].content[1].type == "input_image"
    # The response's own output is not an input item.
    assert not {o.id for o in got["first"].output} & {i.id for i in asc}

    page = got["default_page"]
    assert len(page.data) == 20 and page.has_more is True
    raw = got["raw_default"]
    assert raw["object"] == "list" and raw["has_more"] is True
    assert [d["id"] for d in raw["data"]] == [i.id for i in desc[:20]]
    assert (raw["first_id"], raw["last_id"]) == (desc[0].id, desc[19].id)
    after = got["raw_after"]
    assert [d["id"] for d in after["data"]] == [i.id for i in asc[10:15]]
    assert after["has_more"] is True
    assert (after["first_id"], after["last_id"]) == (asc[10].id, asc[14].id)
    last = got["raw_last"]
    assert [d["id"] for d in last["data"]] == [i.id for i in asc[20:25]]
    assert last["has_more"] is False
    assert len(got["raw_max"]["data"]) == N_INPUTS and got["raw_max"]["has_more"] is False

    second_items = got["second_items"]
    first_output = [o.id for o in got["first"].output]
    assert [i.id for i in second_items] == [i.id for i in asc] + first_output + [
        second_items[-1].id
    ]
    assert text_of(second_items[-1]) == "and one more"
    assert not {o.id for o in got["second"].output} & {i.id for i in second_items}

    bad = got["bad"]
    for name, param in (
        ("limit_zero", "limit"),
        ("limit_big", "limit"),
        ("limit_text", "limit"),
        ("order", "order"),
    ):
        status, error = bad[name]
        assert (status, error["code"], error["param"]) == (400, "invalid_value", param), name
    for name in ("missing", "other_key"):
        status, error = bad[name]
        assert (status, error["code"]) == (404, "response_not_found"), name


async def test_count_and_compact_refuse_malformed_bodies() -> None:
    """The bodies of input_tokens and compact are decoded as strictly as a create's: bad JSON,
    a non-object and nesting deeper than the decoder's recursion are 400s, never 500s."""
    bodies = {
        "nested": (
            b'{"model": "sim", "input": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            "invalid_json",
        ),
        "array": (b'[{"model": "sim"}]', "invalid_type"),
        "not_json": (b'{"model": ', "invalid_json"),
        "nan": (b'{"model": "sim", "input": "x", "temperature": NaN}', "invalid_json"),
    }

    def post_all(url: str) -> dict[tuple[str, str], tuple[int, str]]:
        out = {}
        with httpx.Client(base_url=url, timeout=10) as client:
            for path in ("/responses/input_tokens", "/responses/compact"):
                for name, (body, _code) in bodies.items():
                    response = client.post(
                        path, content=body, headers={"content-type": "application/json"}
                    )
                    out[(path, name)] = (response.status_code, response.json()["error"]["code"])
        return out

    with trio.fail_after(DEADLINE):
        async with open_test_server() as url:
            got = await run_in_thread(post_all, url)
    for (path, name), answer in got.items():
        assert answer == (400, bodies[name][1]), (path, name)
