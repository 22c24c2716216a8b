"""The answer to `POST /v1/responses/compact`: a conversation's compacted window, ending with
its compaction item, with the usage the client is told of committed before the reply.

The session prepares the conversation (`Session.prepare_only`: given as input items or by
`previous_response_id`); this compacts it (`_compact.compact_state`) and records one usage row
(step 0), as a response's usage is recorded before its terminal event.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rollout.protocol import Usage, as_listed, to_wire

from ._compact import DEFAULT_COMPACT_BUDGET, CompactionPolicy, compact_state
from ._errors import server_error
from ._ids import new_id
from ._interfaces import UsageRecord
from ._postinfer import PostJob, WriteFailed
from ._state import ResponseState

if TYPE_CHECKING:
    from ._services import EngineServices

__all__ = ["compaction"]

log = logging.getLogger("rollout.engine")


async def compaction(
    engine: EngineServices,
    source: ResponseState,
    *,
    budget_tokens: int = DEFAULT_COMPACT_BUDGET,
    owner: str | None,
) -> dict[str, Any]:
    """The compacted window of `source` (a prepared conversation), as the endpoint's JSON."""
    window, item = compact_state(
        engine.pipeline,
        source,
        CompactionPolicy(budget_tokens=budget_tokens),
        engine.seal,
        owner=owner,
    )
    usage = Usage.of(input_tokens=source.context_tokens, output_tokens=window.item_tokens)
    compaction_id = new_id("resp")
    # What the client is told it used goes into the ledger before the reply, as a response's
    # usage does before its terminal event: one record, step 0.
    record = UsageRecord(
        response_id=compaction_id,
        step=0,
        owner=owner,
        model=source.route.model,
        input_tokens=usage.input_tokens,
        cached_tokens=0,
        output_tokens=usage.output_tokens,
        complete=True,
        created_at=engine.wall_clock(),
    )
    try:
        await engine.post.commit(PostJob(records=(record,)))
    except WriteFailed:
        log.warning("compaction %s failed: its usage did not go through", compaction_id)
        raise server_error() from None
    return {
        "id": compaction_id,
        "object": "response.compaction",
        "created_at": engine.now(),
        "output": [to_wire(as_listed(i)) for i in [*window.items, item]],
        "usage": to_wire(usage),
    }
