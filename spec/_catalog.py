"""Every check by id, gathered from the modules of their subjects, and the feature probes: the
one place that knows all check modules (the runner and the tests read it)."""

from __future__ import annotations

from ._checks_chain import checks as chain
from ._checks_errors import checks as errors
from ._checks_events import checks as events
from ._checks_http import checks as http
from ._checks_inject import checks as inject
from ._checks_inject import probe_multi_agent
from ._checks_lanes import checks as lanes
from ._checks_rollout import checks as rollout
from ._checks_schema import checks as schema
from ._checks_steer import checks as steer
from ._checks_ws import checks as ws
from ._context import CheckFn, CheckSet
from ._probes import FEATURE_PROBES as _PROBES

__all__ = ["CHECKS", "FEATURE_PROBES"]


def _gather(*sets: CheckSet) -> dict[str, CheckFn]:
    """The union of the modules' checks; an id registered by two modules is an error."""
    every = CheckSet()
    for one in sets:
        for check_id, fn in one.by_id.items():
            every.add(check_id, fn)
    return every.by_id


CHECKS: dict[str, CheckFn] = _gather(
    http, ws, lanes, events, chain, rollout, steer, inject, schema, errors
)
# Each optional feature's probe: None when the server supports it, else why not (its checks
# are then skipped).
FEATURE_PROBES = {**_PROBES, "multi_agent": probe_multi_agent}
