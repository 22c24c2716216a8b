"""A real model inside the coroutine: SmolLM2-135M-Instruct (`smollm2`, run by llama.cpp in
the server's process) through a 6-turn tool loop, every way a client can run it, against a
real server on loopback.

The loop is forced (`smollm2:calls=5`: five calls, then an answer, whatever the model would
choose), greedy (temperature 0), each mode as its own tenant (an API key of its own: the KV
index is per owner, so no mode reuses another's KV). What is proved, from `/metrics`:

- with the KV index on, the four modes (the rollout extension, the WebSocket chain, the HTTP
  chain with `store: true`, the stateless full resend) produce the same output items and the
  same usage, and each evaluates every token of the final context exactly once:
  `tokens_prefilled` == the final context (prefix, every item, the answer) minus what the
  model never had to read (the answer's end token, sampled not fed, and the template's text
  after it). Same tokens is provable here (not luck): with the same prefix kept, every mode
  evaluates the same tokens in the same chunks at the same positions, so llama.cpp computes
  the same logits bit for bit (`_llama_engine`: evaluation boundaries).
- with `--kv-cache-mb 0`, the stateless resend evaluates its whole context at every turn;
  the rollout and the WebSocket chain still keep theirs (their holders pin it).
- after a restart (a new process on the same data folder), the first continuation of a stored
  chain evaluates its whole context once (stored renderings spare the rendering, not the KV),
  and the next turn only its new tokens.

Each test needs the llama extra (`pip install -e '.[llama]'`): without it they skip, and fail
under `ROLLOUT_REQUIRE_ALL`.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from hypothesis import given
from hypothesis import strategies as st

from tests.llama_harness import require_llama, smollm2_renderer
from tests.server_harness import fetch_counters, open_test_server, open_ws
from tests.wire_scripts import examples

DEADLINE = 300  # a real model on 2 shared cores: seconds, not milliseconds
KEYS = {mode: f"sk-llama-{mode}" for mode in ("rollout", "ws_chain", "http_chain", "stateless")}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@attrs.frozen
class Script:
    """A tool loop: the user's question, the tools, how many calls the model must make
    (`smollm2:calls=N`), and the client's answers to them (cycled)."""

    question: str = "What is the weather in Paris right now?"
    instructions: str | None = "You are a weather assistant. Answer in one short sentence."
    tools: tuple[dict[str, Any], ...] = (WEATHER,)
    calls: int = 5  # a 6-turn tool loop
    outputs: tuple[str, ...] = tuple(
        f"Reading {n}: sunny, {18 + n} C, light wind from the west, humidity {40 + 3 * n}%."
        for n in range(5)
    )
    max_output_tokens: int = 96

    def settings(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": f"smollm2:calls={self.calls}",
            "tools": list(self.tools),
            "temperature": 0,
            "max_output_tokens": self.max_output_tokens,
        }
        if self.instructions is not None:
            body["instructions"] = self.instructions
        return body


LOOP = Script()


def bare(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in ("id", "call_id", "status")}


@attrs.define
class Outcome:
    mode: str
    script: Script = LOOP
    items: list[dict[str, Any]] = attrs.field(factory=list)  # output items, without ids
    input_tokens: list[int] = attrs.field(factory=list)  # per response
    output_tokens: list[int] = attrs.field(factory=list)
    last_input: int = 0  # the context the answer was sampled from
    last_output: int = 0  # the answer's tokens (its end token included)
    prefilled: int = 0

    def outputs_for(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        calls = [i for i in items if i["type"] == "function_call"]
        done = sum(1 for i in self.items if i["type"] == "function_call") - len(calls)
        outputs = self.script.outputs
        return [
            {
                "type": "function_call_output",
                "call_id": c["call_id"],
                "output": outputs[(done + k) % len(outputs)],
            }
            for k, c in enumerate(calls)
        ]


# --- the four ways -------------------------------------------------------------------------


async def run_rollout(url: str, outcome: Outcome, key: str | None = None) -> None:
    """One response: `rollout: true`, suspended at each call (`response.done`), resumed by
    `response.append`; under the mode's API key unless `key` is given."""
    async with open_ws(url, key=key or KEYS[outcome.mode]) as ws:
        script = outcome.script
        events = await ws.create(
            input=script.question, rollout=True, store=False, **script.settings()
        )
        while True:
            turn = [
                json.loads(json.dumps(r["item"]))
                for r in ws.raw[-len(events) :]
                if r["type"] == "response.output_item.done"
            ]
            outcome.items += [bare(i) for i in turn]
            last = events[-1]
            if last.type != "response.done":
                break
            events = await ws.append(last.response.id, outcome.outputs_for(turn))
        assert last.type in ("response.completed", "response.incomplete"), last
        response = json.loads(json.dumps(ws.raw[-1]["response"]))
        usage = response["usage"]
        outcome.input_tokens.append(usage["input_tokens"])
        outcome.output_tokens.append(usage["output_tokens"])


async def run_ws_chain(url: str, outcome: Outcome) -> None:
    """A create per turn on one connection, continuing with `previous_response_id`."""
    async with open_ws(url, key=KEYS[outcome.mode]) as ws:
        body: dict[str, Any] = {"input": outcome.script.question}
        while True:
            await ws.create(store=False, **outcome.script.settings(), **body)
            response = ws.raw[-1]["response"]
            assert response["status"] in ("completed", "incomplete"), response
            _take(outcome, response)
            if response["status"] == "incomplete" or not any(
                i["type"] == "function_call" for i in response["output"]
            ):
                return  # answered, or cut off (a call cut off has no output to send)
            body = {
                "previous_response_id": response["id"],
                "input": outcome.outputs_for(response["output"]),
            }


async def run_http(url: str, outcome: Outcome, *, chain: bool) -> None:
    """`POST /v1/responses` per turn: a stored chain (`previous_response_id`), or the whole
    history every time (`store: false`)."""
    headers = {"Authorization": f"Bearer {KEYS[outcome.mode]}"}
    question = outcome.script.question
    history: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": question}]
    body: dict[str, Any] = {"input": question, "store": chain}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=DEADLINE) as http:
        while True:
            resp = await http.post("/responses", json={**outcome.script.settings(), **body})
            assert resp.status_code == 200, resp.text
            response = resp.json()
            assert response["status"] in ("completed", "incomplete"), response
            _take(outcome, response)
            outputs = outcome.outputs_for(response["output"])
            if not outputs or response["status"] == "incomplete":
                return
            history += response["output"] + outputs
            if chain:
                body = {"previous_response_id": response["id"], "input": outputs, "store": True}
            else:
                body = {"input": history, "store": False}


def _take(outcome: Outcome, response: dict[str, Any]) -> None:
    outcome.items += [bare(i) for i in response["output"]]
    usage = response["usage"]
    outcome.input_tokens.append(usage["input_tokens"])
    outcome.output_tokens.append(usage["output_tokens"])
    outcome.last_input, outcome.last_output = usage["input_tokens"], usage["output_tokens"]


MODES: dict[str, Callable[[str, Outcome], Any]] = {
    "rollout": run_rollout,
    "ws_chain": run_ws_chain,
    "http_chain": lambda url, o: run_http(url, o, chain=True),
    "stateless": lambda url, o: run_http(url, o, chain=False),
}


async def run_mode(url: str, mode: str, script: Script = LOOP) -> Outcome:
    outcome = Outcome(mode=mode, script=script)
    before = await fetch_counters(url, KEYS[mode])
    await MODES[mode](url, outcome)
    after = await fetch_counters(url, KEYS[mode])
    outcome.prefilled = after["tokens_prefilled"] - before["tokens_prefilled"]
    return outcome


def read_once(outcome: Outcome) -> int:
    """What evaluating every token of the final context once costs: the context the answer
    was sampled from, the generation prompt, and the answer's tokens but its end token (sampled,
    never fed back); the template's text after it is never read."""
    generation_prompt = len(smollm2_renderer().generation_prompt)
    return outcome.last_input + generation_prompt + outcome.last_output - 1


# --- the tests -------------------------------------------------------------------------------


def assert_equivalent(outcomes: list[Outcome]) -> None:
    """The same items and usage every way, each evaluating every token of the final context
    once."""
    base = next(o for o in outcomes if o.mode == "ws_chain")
    expected = read_once(base)
    for outcome in outcomes:
        assert outcome.items == base.items, (outcome.mode, outcome.items, base.items)
        assert sum(outcome.input_tokens) == sum(base.input_tokens), outcome.mode
        assert sum(outcome.output_tokens) == sum(base.output_tokens), outcome.mode
        assert outcome.prefilled == expected, (outcome.mode, outcome.prefilled, expected)


async def test_every_mode_evaluates_each_token_once_and_samples_the_same(tmp_path: Path) -> None:
    require_llama()
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, api_keys=tuple(KEYS.values())) as url:
            outcomes = [await run_mode(url, mode) for mode in MODES]
    assert_equivalent(outcomes)
    base = next(o for o in outcomes if o.mode == "ws_chain")
    calls = [i for i in base.items if i["type"] == "function_call"]
    assert len(calls) == LOOP.calls and base.items[-1]["type"] == "message", base.items
    assert all(json.loads(c["arguments"]) for c in calls)  # valid JSON: the grammar's doing
    # The rollout is one response whose usage is the six turns' sum.
    rollout = next(o for o in outcomes if o.mode == "rollout")
    assert len(rollout.input_tokens) == 1 and len(base.input_tokens) == LOOP.calls + 1


SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {
        "type": "object",
        "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
        "required": ["path", "line"],
    },
    {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        },
        "required": ["query"],
    },
    {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
        "required": ["unit"],
    },
]
WORDS = st.text(alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyz ,.?!'0123456789"))


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    """Small tool loops: 1-3 forced calls of one of 1-2 tools, short answers (a real model on
    2 cores: each script runs four ways)."""
    n_tools = draw(st.integers(1, 2))
    tools = tuple(
        {
            "type": "function",
            "name": f"tool_{i}_{draw(st.sampled_from(['lookup', 'fetch', 'search']))}",
            "description": draw(WORDS.filter(str.strip).map(str.strip)),
            "parameters": draw(st.sampled_from(SCHEMAS)),
        }
        for i in range(n_tools)
    )
    return Script(
        question=draw(WORDS.filter(lambda t: len(t.strip()) > 3)),
        instructions=draw(st.none() | WORDS.filter(str.strip)),
        tools=tools,
        calls=draw(st.integers(1, 3)),
        outputs=tuple(draw(st.lists(WORDS.filter(str.strip), min_size=1, max_size=3))),
        max_output_tokens=draw(st.sampled_from([48, 64, 96])),
    )


@examples(default=1, ci=2, deep=12)
@given(script=scripts())
async def test_generated_tool_loops_sample_the_same_every_way(script: Script) -> None:
    require_llama()
    with tempfile.TemporaryDirectory() as data, trio.fail_after(DEADLINE):
        async with open_test_server(Path(data), api_keys=tuple(KEYS.values())) as url:
            outcomes = [await run_mode(url, mode, script) for mode in MODES]
    assert_equivalent(outcomes)


async def test_without_the_kv_index_a_stateless_client_pays_for_its_whole_context(
    tmp_path: Path,
) -> None:
    require_llama()
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, api_keys=tuple(KEYS.values()), kv_cache_mb=0) as url:
            kept = [await run_mode(url, mode) for mode in ("rollout", "ws_chain")]
            stateless = await run_mode(url, "stateless")
    generation_prompt = len(smollm2_renderer().generation_prompt)
    # Every turn: its whole context, the generation prompt, its tokens fed back.
    whole = sum(
        i + generation_prompt + o - 1
        for i, o in zip(stateless.input_tokens, stateless.output_tokens, strict=True)
    )
    assert stateless.prefilled == whole
    for outcome in kept:  # the rollout and the connection keep theirs: each token once
        assert outcome.prefilled == read_once(kept[1]), outcome.mode
    assert whole > 2 * read_once(kept[1])


async def test_after_a_restart_the_first_continuation_evaluates_its_context_once(
    tmp_path: Path,
) -> None:
    require_llama()
    headers = {"Authorization": f"Bearer {KEYS['http_chain']}"}
    first = {**LOOP.settings(), "input": LOOP.question, "store": True}
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, api_keys=tuple(KEYS.values())) as url:
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
                resp = (await http.post("/responses", json=first)).json()
        outcome = Outcome(mode="http_chain")
        # A new server (a new process's state: no KV, no render cache) on the same data.
        async with open_test_server(tmp_path, api_keys=tuple(KEYS.values())) as url:
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
                prefilled = []
                for _ in range(2):
                    before = (await fetch_counters(url, KEYS["http_chain"]))["tokens_prefilled"]
                    body = {
                        **LOOP.settings(),
                        "previous_response_id": resp["id"],
                        "input": outcome.outputs_for(resp["output"]),
                        "store": True,
                    }
                    outcome.items += [bare(i) for i in resp["output"]]
                    resp = (await http.post("/responses", json=body)).json()
                    assert resp["status"] == "completed", resp
                    prefilled.append(
                        (await fetch_counters(url, KEYS["http_chain"]))["tokens_prefilled"] - before
                    )
                    usage = resp["usage"]
                    outcome.input_tokens.append(usage["input_tokens"])
                    outcome.output_tokens.append(usage["output_tokens"])
    generation_prompt = len(smollm2_renderer().generation_prompt)
    inputs, outputs = outcome.input_tokens, outcome.output_tokens
    # The first continuation: the whole context, never evaluated in this process.
    assert prefilled[0] == inputs[0] + generation_prompt + outputs[0] - 1
    # The next one: only what is new since (the previous answer's end, the tool output), then
    # its own tokens fed back.
    assert prefilled[1] == (inputs[1] - inputs[0] - (outputs[0] - 1)) + (outputs[1] - 1)
