"""The multi-agent beta, sans-IO: its handshake header, its request field, and how a
multi-agent response looks on the wire.

A WebSocket opened with `OpenAI-Beta: responses_multi_agent=v1` (the header may list several
betas, comma-separated, and may be repeated) may create responses with
`multi_agent: {enabled: true, max_concurrent_subagents?}`. Such a response does not complete
when it emits client-owned tool calls: it waits for `response.inject`, and goes on in the same
response once no call is owed (the rollout coroutine's suspension under OpenAI's names).

rollout serves the beta with single-agent semantics: it spawns no subagents (no backend asks
for them), so `max_concurrent_subagents` is accepted and has nothing to bound, and every item
belongs to the root agent. `RootAgentView` shows a multi-agent response as the beta's
clients read it: output items carry `agent: {agent_name: "/root"}`, and an assistant message
carries `phase`: `final_answer` when the response completes right after it, else
`commentary`. The view is presentation only: the response's state (what is rendered,
cached, keyed and continued from) holds the items as the model made them, the same in every
mode.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from typing import Any

import attrs

from ._errors import RemoteProtocolError
from ._events import (
    OutputItemAdded,
    OutputItemDone,
    ResponseCompleted,
    ResponseCreate,
    ServerEvent,
    response_of,
)
from ._items import AgentRef, Item, Message
from ._items import Phase as MessagePhase
from ._response import Response

__all__ = [
    "MULTI_AGENT_BETA",
    "ROOT_AGENT",
    "RootAgentView",
    "betas_of",
    "check_multi_agent",
    "multi_agent_enabled",
]

# The `OpenAI-Beta` value of the multi-agent beta (what the Agents SDK's hosted multi-agent
# model sends on its handshake).
MULTI_AGENT_BETA = "responses_multi_agent=v1"
# The agent every item of a single-agent response belongs to.
ROOT_AGENT = AgentRef(agent_name="/root")

_CONFIG_KEYS = ("enabled", "max_concurrent_subagents")


def betas_of(header_values: Iterable[str]) -> frozenset[str]:
    """The betas named by `OpenAI-Beta` header values (each may list several, separated by
    commas); unknown ones are kept and ignored by the caller."""
    return frozenset(
        name.strip() for value in header_values for name in value.split(",") if name.strip()
    )


def multi_agent_enabled(request: ResponseCreate) -> bool:
    """Whether a create asks for a multi-agent response (`multi_agent.enabled: true`)."""
    config = request.multi_agent
    return isinstance(config, dict) and config.get("enabled") is True


def check_multi_agent(config: dict[str, Any] | None) -> None:
    """`multi_agent` as the SDK's `MultiAgentConfigParam` types it: `enabled` (a boolean,
    required) and `max_concurrent_subagents` (a positive integer, optional). Raises
    `RemoteProtocolError` naming the offending param."""
    if config is None:
        return
    for key in config:
        if key not in _CONFIG_KEYS:
            raise RemoteProtocolError.invalid(
                f"Unknown parameter: 'multi_agent.{key}'.",
                code="unknown_parameter",
                param=f"multi_agent.{key}",
            )
    enabled = config.get("enabled")
    if not isinstance(enabled, bool):
        missing = "enabled" not in config
        raise RemoteProtocolError.invalid(
            "Missing required parameter: 'multi_agent.enabled'."
            if missing
            else "Invalid type for 'multi_agent.enabled': expected a boolean.",
            code="missing_required_parameter" if missing else "invalid_type",
            param="multi_agent.enabled",
        )
    limit = config.get("max_concurrent_subagents")
    if limit is None:
        return
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise RemoteProtocolError.invalid(
            "Invalid type for 'multi_agent.max_concurrent_subagents': expected an integer.",
            code="invalid_type",
            param="multi_agent.max_concurrent_subagents",
        )
    if limit < 1:
        raise RemoteProtocolError.invalid(
            "Invalid 'multi_agent.max_concurrent_subagents': integer below minimum value. "
            f"Expected a value >= 1, but got {limit} instead.",
            code="integer_below_min_value",
            param="multi_agent.max_concurrent_subagents",
        )


def _attributed(item: Item, phase: MessagePhase | None = None) -> Item:
    """The item attributed to the root agent (and, for an assistant message, its phase)."""
    if isinstance(item, Message):
        if item.role != "assistant":
            return item
        return attrs.evolve(item, agent=ROOT_AGENT, phase=phase or item.phase)
    if "agent" in attrs.fields_dict(type(item)):
        return typing.cast(Item, attrs.evolve(typing.cast(Any, item), agent=ROOT_AGENT))
    return item


def _attributed_response(response: Response, *, completed: bool) -> Response:
    output = response.output
    last = len(output) - 1
    return attrs.evolve(
        response,
        output=[
            _attributed(
                item,
                "final_answer" if completed and i == last else "commentary",
            )
            for i, item in enumerate(output)
        ],
    )


class RootAgentView:
    """A multi-agent response's events as the beta shows them (see the module docstring).

    Feed every event of the response to `events`, in order; it returns what to send. A
    message's `output_item.done` is held until the next event, which says its phase
    (`response.completed` next: the final answer; a response always ends with a terminal
    event, so nothing stays held). Sequence numbers and order are unchanged."""

    def __init__(self) -> None:
        self._held: OutputItemDone | None = None

    def events(self, event: ServerEvent) -> list[ServerEvent]:
        out: list[ServerEvent] = []
        if self._held is not None:
            held, self._held = self._held, None
            final = isinstance(event, ResponseCompleted)
            phase: MessagePhase = "final_answer" if final else "commentary"
            out.append(attrs.evolve(held, item=_attributed(held.item, phase)))
        if isinstance(event, OutputItemDone) and isinstance(event.item, Message):
            self._held = event
            return out
        out.append(_attributed_event(event))
        return out


def _attributed_event(event: ServerEvent) -> ServerEvent:
    if isinstance(event, OutputItemAdded | OutputItemDone):
        return attrs.evolve(event, item=_attributed(event.item))
    response = response_of(event)
    if response is None:
        return event
    completed = isinstance(event, ResponseCompleted)
    viewed = attrs.evolve(
        typing.cast(Any, event), response=_attributed_response(response, completed=completed)
    )
    return typing.cast(ServerEvent, viewed)
