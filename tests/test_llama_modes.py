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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from tests.llama_harness import require_llama, smollm2_renderer
from tests.server_harness import fetch_counters, open_test_server, open_ws

DEADLINE = 300  # a real model on 2 shared cores: seconds, not milliseconds
CALLS = 5  # a 6-turn tool loop
MODEL = f"smollm2:calls={CALLS}"
INSTRUCTIONS = "You are a weather assistant. Answer in one short sentence."
QUESTION = "What is the weather in Paris right now?"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
SETTINGS: dict[str, Any] = {
    "model": MODEL,
    "instructions": INSTRUCTIONS,
    "tools": TOOLS,
    "temperature": 0,
    "max_output_tokens": 96,
}
KEYS = {mode: f"sk-llama-{mode}" for mode in ("rollout", "ws_chain", "http_chain", "stateless")}


def tool_output(n: int) -> str:
    return f"Reading {n}: sunny, {18 + n} C, light wind from the west, humidity {40 + 3 * n}%."


def bare(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in ("id", "call_id", "status")}


@attrs.define
class Outcome:
    mode: str
    items: list[dict[str, Any]] = attrs.field(factory=list)  # output items, without ids
    input_tokens: list[int] = attrs.field(factory=list)  # per response
    output_tokens: list[int] = attrs.field(factory=list)
    last_input: int = 0  # the context the answer was sampled from
    last_output: int = 0  # the answer's tokens (its end token included)
    prefilled: int = 0

    def outputs_for(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        calls = [i for i in items if i["type"] == "function_call"]
        done = sum(1 for i in self.items if i["type"] == "function_call") - len(calls)
        return [
            {
                "type": "function_call_output",
                "call_id": c["call_id"],
                "output": tool_output(done + k),
            }
            for k, c in enumerate(calls)
        ]


# --- the four ways -------------------------------------------------------------------------


async def run_rollout(url: str, outcome: Outcome) -> None:
    """One response: `rollout: true`, suspended at each call (`response.done`), resumed by
    `response.append`."""
    async with open_ws(url, key=KEYS[outcome.mode]) as ws:
        events = await ws.create(input=QUESTION, rollout=True, store=False, **SETTINGS)
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
        assert last.type == "response.completed", last
        response = json.loads(json.dumps(ws.raw[-1]["response"]))
        usage = response["usage"]
        outcome.input_tokens.append(usage["input_tokens"])
        outcome.output_tokens.append(usage["output_tokens"])


async def run_ws_chain(url: str, outcome: Outcome) -> None:
    """A create per turn on one connection, continuing with `previous_response_id`."""
    async with open_ws(url, key=KEYS[outcome.mode]) as ws:
        body: dict[str, Any] = {"input": QUESTION}
        while True:
            await ws.create(store=False, **SETTINGS, **body)
            response = ws.raw[-1]["response"]
            assert response["status"] == "completed", response
            _take(outcome, response)
            if not any(i["type"] == "function_call" for i in response["output"]):
                return
            body = {
                "previous_response_id": response["id"],
                "input": outcome.outputs_for(response["output"]),
            }


async def run_http(url: str, outcome: Outcome, *, chain: bool) -> None:
    """`POST /v1/responses` per turn: a stored chain (`previous_response_id`), or the whole
    history every time (`store: false`)."""
    headers = {"Authorization": f"Bearer {KEYS[outcome.mode]}"}
    history: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": QUESTION}]
    body: dict[str, Any] = {"input": QUESTION, "store": chain}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=DEADLINE) as http:
        while True:
            resp = await http.post("/responses", json={**SETTINGS, **body})
            assert resp.status_code == 200, resp.text
            response = resp.json()
            assert response["status"] == "completed", response
            _take(outcome, response)
            outputs = outcome.outputs_for(response["output"])
            if not outputs:
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


async def run_mode(url: str, mode: str) -> Outcome:
    outcome = Outcome(mode=mode)
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


async def test_every_mode_evaluates_each_token_once_and_samples_the_same(tmp_path: Path) -> None:
    require_llama()
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, api_keys=tuple(KEYS.values())) as url:
            outcomes = [await run_mode(url, mode) for mode in MODES]
    base = next(o for o in outcomes if o.mode == "ws_chain")
    calls = [i for i in base.items if i["type"] == "function_call"]
    assert len(calls) == CALLS and base.items[-1]["type"] == "message", base.items
    assert all(json.loads(c["arguments"]) for c in calls)  # valid JSON: the grammar's doing
    expected = read_once(base)
    for outcome in outcomes:
        assert outcome.items == base.items, (outcome.mode, outcome.items, base.items)
        assert sum(outcome.input_tokens) == sum(base.input_tokens), outcome.mode
        assert sum(outcome.output_tokens) == sum(base.output_tokens), outcome.mode
        assert outcome.prefilled == expected, (outcome.mode, outcome.prefilled, expected)
    # The rollout is one response whose usage is the six turns' sum.
    rollout = next(o for o in outcomes if o.mode == "rollout")
    assert len(rollout.input_tokens) == 1 and len(base.input_tokens) == CALLS + 1


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
    first = {**SETTINGS, "input": QUESTION, "store": True}
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
                        **SETTINGS,
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
