"""Every check by id, gathered from the modules of their subjects, and the feature probes: the
one place that knows all check modules (the runner and the tests read it)."""

from __future__ import annotations

from collections.abc import Mapping

from ._checks_chain import CHECKS as CHAIN
from ._checks_errors import CHECKS as ERRORS
from ._checks_events import CHECKS as EVENTS
from ._checks_http import CHECKS as HTTP
from ._checks_rollout import CHECKS as ROLLOUT
from ._checks_schema import CHECKS as SCHEMA
from ._checks_ws import CHECKS as WS
from ._context import CheckFn, CheckSet
from ._probes import FEATURE_PROBES

__all__ = ["CHECKS", "FEATURE_PROBES"]


def _gather(*parts: CheckSet | Mapping[str, CheckFn]) -> dict[str, CheckFn]:
    """The union of the modules' checks; an id registered by two modules is an error."""
    every = CheckSet()
    for part in parts:
        for check_id, fn in (part.by_id if isinstance(part, CheckSet) else part).items():
            every.add(check_id, fn)
    return every.by_id


CHECKS: dict[str, CheckFn] = _gather(HTTP, WS, EVENTS, CHAIN, ROLLOUT, SCHEMA, ERRORS)
