"""Every tool kind a client runs, and usage, through a chat-completions upstream.

- The upstream sees a custom tool as a function taking `{"input": ...}` (its grammar in the
  description) and a built-in client tool as a function named by its kind whose arguments are
  the action or operation; its calls come back as `custom_tool_call` / `shell_call` /
  `apply_patch_call` items, and their outputs reach the upstream as tool messages.
- `usage.input_tokens_details.cached_tokens <= input_tokens` always: the upstream's own cached
  figure when it reports one (clamped), else the share of its prompt rollout reused.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from tests.server_harness import open_ws
from tests.upstream_harness import (
    Exchange,
    call_chunks,
    chunk,
    gateway_registry,
    open_fake_upstream,
    open_rollout,
    text_chunks,
)

DEADLINE = 30
GRAMMAR = 'start: "ok " WORD\nWORD: /[a-z]+/\n'
TOOLS: list[dict[str, Any]] = [
    {"type": "shell", "environment": {"type": "local"}},
    {"type": "apply_patch"},
    {
        "type": "custom",
        "name": "note",
        "description": "Write a note.",
        "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR},
    },
    {"type": "web_search"},  # hosted, no executor: not offered upstream
]
PATCH = {"type": "create_file", "path": "a.txt", "diff": "+hello\n"}


async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=DEADLINE) as client:
        resp = await client.post(f"{url}/responses", json=body)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


async def test_client_tools_through_an_upstream() -> None:
    async def scripted(exchange: Exchange) -> None:
        if exchange.body["messages"][-1]["role"] == "user":
            await exchange.stream(
                call_chunks(
                    [
                        ("shell", json.dumps({"commands": ["echo hi"]})),
                        ("apply_patch", json.dumps(PATCH)),
                        ("note", json.dumps({"input": "ok done"})),
                    ]
                )
            )
        else:
            await exchange.stream(text_chunks(["All", " set."]))

    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(scripted) as (upstream_url, upstream):
            async with open_rollout(registry=gateway_registry(upstream_url)) as url:
                first = await post(url, {"model": "up", "input": "Go.", "tools": TOOLS})
                shell, patch, note = first["output"]
                outcome = {"type": "exit", "exit_code": 0}
                outputs = [
                    {
                        "type": "shell_call_output",
                        "call_id": shell["call_id"],
                        "output": [{"stdout": "hi\n", "stderr": "", "outcome": outcome}],
                    },
                    {
                        "type": "apply_patch_call_output",
                        "call_id": patch["call_id"],
                        "status": "completed",
                        "output": "created a.txt",
                    },
                    {
                        "type": "custom_tool_call_output",
                        "call_id": note["call_id"],
                        "output": "saved",
                    },
                ]
                second = await post(
                    url,
                    {
                        "model": "up",
                        "tools": TOOLS,
                        "previous_response_id": first["id"],
                        "input": outputs,
                    },
                )
    assert (shell["type"], shell["action"]) == ("shell_call", {"commands": ["echo hi"]})
    assert (patch["type"], patch["operation"]) == ("apply_patch_call", PATCH)
    assert (note["type"], note["name"], note["input"]) == ("custom_tool_call", "note", "ok done")
    assert second["output"][0]["content"][0]["text"] == "All set."
    request, follow_up = upstream.bodies
    functions = {t["function"]["name"]: t["function"] for t in request["tools"]}
    assert set(functions) == {"shell", "apply_patch", "note"}  # web_search is not offered
    assert functions["note"]["parameters"]["required"] == ["input"]
    assert GRAMMAR.strip() in functions["note"]["description"]
    assert functions["shell"]["parameters"]["required"] == ["commands"]
    user, group, *results = follow_up["messages"]
    assert user == {"role": "user", "content": "Go."}
    assert [c["function"]["name"] for c in group["tool_calls"]] == ["shell", "apply_patch", "note"]
    assert json.loads(group["tool_calls"][2]["function"]["arguments"]) == {"input": "ok done"}
    assert [r["role"] for r in results] == ["tool"] * 3
    assert json.loads(results[0]["content"])[0]["stdout"] == "hi\n"
    assert results[2]["content"] == "saved"


def usage_chunks(prompt: int, cached: int | None) -> list[dict[str, Any]]:
    """A two-token text answer whose usage reports `prompt` input tokens (and `cached`)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": 2,
        "total_tokens": prompt + 2,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return [chunk(content="Hi"), chunk(content="."), chunk(finish="stop"), chunk(usage=usage)]


async def test_cached_tokens_never_exceed_the_upstreams_input() -> None:
    reported: list[int | None] = [None, None, 7, 50]  # per request: what the upstream reports

    async def scripted(exchange: Exchange) -> None:
        await exchange.stream(usage_chunks(11, reported[exchange.upstream.hits - 1]))

    long_input = "Tell me a long story about ships. " * 40
    with trio.fail_after(DEADLINE):
        async with open_fake_upstream(scripted) as (upstream_url, _upstream):
            async with open_rollout(registry=gateway_registry(upstream_url)) as url:
                async with open_ws(url) as ws:
                    events = await ws.create(model="up", input=long_input, store=False)
                    responses = [events[-1].response]
                    for _ in range(3):  # continued from the socket's cache: most reused
                        events = await ws.create(
                            model="up",
                            input="Again.",
                            previous_response_id=responses[-1].id,
                            store=False,
                        )
                        responses.append(events[-1].response)
    usages = [r.usage for r in responses]
    for usage in usages:
        assert usage is not None
        assert usage.input_tokens == 11
        assert usage.input_tokens_details.cached_tokens <= usage.input_tokens
    first, reused, own, claimed = (u.input_tokens_details.cached_tokens for u in usages if u)
    assert first == 0  # nothing reused, nothing reported
    # Nothing reported: the share of the upstream's prompt rollout did not render again
    # (most of it here), never more than the prompt.
    assert 0 < reused < 11
    assert own == 7  # the upstream's own figure
    assert claimed == 11  # clamped to its input when it claims more
