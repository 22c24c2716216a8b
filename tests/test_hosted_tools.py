"""Hosted tools (`web_search`, `file_search`, `mcp`, ...): accepted and echoed always; offered to
the model only when an executor for the type is configured (`open_engine(hosted_tools=...)`).

- Without an executor the tool is left out of the model's context: the rendered context is
  the one without it, the model answers in text, and a `tool_choice` forcing it is refused with
  `unsupported_parameter`.
- With one, the model's call runs on the server inside the response: the executor's items go
  out as output items, the model samples again, and the conversation continues with them (also
  after hydration from the store). An executor that fails fails the response
  (`server_error`), not the engine; a model that keeps calling is cut off after
  `MAX_HOSTED_ROUNDS` steps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs
import pytest
import trio
from rollout import protocol as p
from rollout.engine import HostedCall, MemoryResponseStore, MemoryUsageLedger, open_engine
from rollout.engine._engine import MAX_HOSTED_ROUNDS

DEADLINE = 10
WEB_SEARCH = p.BuiltinTool(type="web_search", settings={"search_context_size": "low"})
MODEL = "sim:tokens=6"


@attrs.define
class FakeSearch:
    """A web_search executor: records its calls, answers with a completed web_search_call."""

    type: str = "web_search"
    calls: list[HostedCall] = attrs.field(factory=list)
    fail: bool = False

    async def run(self, call: HostedCall) -> Sequence[p.Item]:
        self.calls.append(call)
        await trio.lowlevel.checkpoint()
        if self.fail:
            raise RuntimeError("the search index is down")
        query = json.loads(call.arguments)["query"]
        return [
            p.OpaqueItem(
                type="web_search_call",
                data={
                    "id": f"ws_{len(self.calls)}",
                    "status": "completed",
                    "action": {"type": "search", "query": query},
                },
            )
        ]


def create(**fields: object) -> p.ResponseCreate:
    return p.from_wire({"type": "response.create", "model": MODEL, **fields}, p.ResponseCreate)


async def test_without_an_executor_a_hosted_tool_is_echoed_but_not_offered() -> None:
    with trio.fail_after(DEADLINE):
        async with open_engine() as engine:
            session = engine.session()
            plain = await session.respond(create(input="Search the news."))
            hosted = await session.respond(
                create(
                    input="Search the news.", tools=[p.to_wire(WEB_SEARCH)], tool_choice="required"
                )
            )
            with pytest.raises(p.RemoteProtocolError) as refused:
                await session.respond(
                    create(
                        input="Search the news.",
                        tools=[{"type": "web_search_preview"}],
                        tool_choice={"type": "web_search_preview"},
                    )
                )
    assert hosted.tools == [WEB_SEARCH]
    assert [o.type for o in hosted.output] == ["message"]
    # Not rendered: the same context, hence the same answer, as without the tool.
    assert hosted.usage is not None and plain.usage is not None
    assert hosted.usage.input_tokens == plain.usage.input_tokens
    assert hosted.output[0].content == plain.output[0].content  # type: ignore[union-attr]
    assert (refused.value.code, refused.value.param) == ("unsupported_parameter", "tool_choice")


async def test_with_an_executor_the_call_runs_inside_the_response() -> None:
    search = FakeSearch()
    store = MemoryResponseStore()
    tools = [p.to_wire(WEB_SEARCH)]
    with trio.fail_after(DEADLINE):
        async with open_engine(hosted_tools=[search], store=store) as engine:
            events: list[p.ServerEvent] = []

            async def keep(event: p.ServerEvent) -> None:
                events.append(event)

            before = engine.counters.snapshot()
            first = await engine.session().create(
                create(input="Search the news.", tools=tools), keep
            )
            work = engine.counters - before
            assert first is not None
            (call,) = search.calls
            # Continued from the store, on another session, and the same history resent
            # statelessly: the search result is part of the context either way, the same.
            follow = "And more?"
            again = await engine.session().respond(
                create(input=follow, tools=tools, tool_choice="none", previous_response_id=first.id)
            )
            history = [
                {"role": "user", "content": "Search the news."},
                *(p.to_wire(o) for o in first.response.output),
                {"role": "user", "content": follow},
            ]
            resent = await engine.session().respond(
                create(input=history, tools=tools, tool_choice="none")
            )
    response = first.response
    assert [o.type for o in response.output] == ["web_search_call", "message"]
    assert call.tool == WEB_SEARCH
    assert json.loads(call.arguments)["query"]
    assert response.output[0] == search_item(call)
    # Two samplings in one response (the search, then the answer), one hosted call.
    assert (work.samplings, work.hosted_calls) == (2, 1)
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.done") == 2
    assert kinds[-1] == "response.completed"
    assert again.status == resent.status == "completed"
    assert again.usage is not None and resent.usage is not None
    assert again.usage.input_tokens == resent.usage.input_tokens
    assert again.output[0].content == resent.output[0].content  # type: ignore[union-attr]


def search_item(call: HostedCall) -> p.OpaqueItem:
    return p.OpaqueItem(
        type="web_search_call",
        data={
            "id": "ws_1",
            "status": "completed",
            "action": {"type": "search", "query": json.loads(call.arguments)["query"]},
        },
    )


async def test_a_failing_executor_fails_the_response_not_the_engine() -> None:
    search = FakeSearch(fail=True)
    with trio.fail_after(DEADLINE):
        async with open_engine(hosted_tools=[search], ledger=MemoryUsageLedger()) as engine:
            failed = await engine.session().respond(
                create(input="Search.", tools=[p.to_wire(WEB_SEARCH)])
            )
            fine = await engine.session().respond(create(input="Hello."))
    assert failed.status == "failed"
    assert failed.error is not None and failed.error.code == "server_error"
    assert "the search index is down" in failed.error.message
    assert fine.status == "completed"


async def test_a_model_that_keeps_searching_is_cut_off() -> None:
    search = FakeSearch()
    with trio.fail_after(DEADLINE):
        async with open_engine(hosted_tools=[search]) as engine:
            response = await engine.session().respond(
                create(
                    model="sim:steps=1000,tokens=4",
                    input="Search forever.",
                    tools=[p.to_wire(WEB_SEARCH)],
                )
            )
    assert len(search.calls) == MAX_HOSTED_ROUNDS + 1
    assert response.status == "completed"
    assert response.output[-1].type == "web_search_call"
