"""rollout's conformance harness: the WebSocket-mode and rollout-extension specification
(PROTOCOL.md), its machine-readable case list (checks.json), and the checks that verify a
server against it.

    report = await spec.run_conformance("http://127.0.0.1:8000/v1", spec.Options(model="sim"))
    assert report.ok, report.failures

`run_conformance_sync` does the same for synchronous callers; `rollout conform BASE_URL` is
the command-line form.
"""

from ._client import CheckFailed, CheckSkipped
from ._context import Case, Options, load_cases
from ._report import CheckResult, Outcome, Report
from ._runner import run_conformance, run_conformance_sync, select_cases

__version__ = "0.1.0"

__all__ = [
    "Case",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "Options",
    "Outcome",
    "Report",
    "load_cases",
    "run_conformance",
    "run_conformance_sync",
    "select_cases",
]
