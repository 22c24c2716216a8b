"""rollout's conformance harness: the WebSocket-mode and rollout-extension specification
(PROTOCOL.md), its machine-readable case list (checks.json), and the checks that verify a
server against it.

    report = await spec.run_conformance("http://127.0.0.1:8000/v1", spec.Options(model="sim"))
    assert report.ok, report.failures

`run_conformance_sync` does the same for synchronous callers; `rollout conform BASE_URL` is
the command-line form. `WsClient` (opened with `open_ws`) is rollout's WebSocket-mode client,
driving `rollout.protocol.ClientConnection`; the benchmark and the test suite use it too.
"""

from ._client import CheckFailed, CheckSkipped, WsClient, open_ws
from ._context import Case, Options, Profile, load_cases, load_profiles
from ._report import CheckResult, Outcome, ProfileVerdict, Report, Support
from ._runner import run_conformance, run_conformance_sync, select_cases

__version__ = "0.1.0"

__all__ = [
    "Case",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "Options",
    "Outcome",
    "Profile",
    "ProfileVerdict",
    "Report",
    "Support",
    "WsClient",
    "load_cases",
    "load_profiles",
    "open_ws",
    "run_conformance",
    "run_conformance_sync",
    "select_cases",
]
