"""rollout bench: the agent loop driven five ways (HTTP stateless, HTTP with
previous_response_id, WebSocket with previous_response_id unstored and stored, the WebSocket
rollout extension)
against a `rollout serve` subprocess or any Responses server, measured per turn.

`rollout bench` is the command line (`bench/_cli.py`); `run_benchmark(BenchConfig(...))`
returns the results document described by `RESULTS_SCHEMA` (see bench/SCHEMA.md).
"""

from ._client import MODES, RolloutRecord, RolloutSpec, TurnRecord, run_rollout
from ._errors import BenchError, ServerError, ServerStartError
from ._plots import write_plots
from ._report import write_results
from ._runner import BenchConfig, ServerSpec, SweepPoint, run_benchmark
from ._scenario import CONCURRENCY_SCENARIO, PRESETS, SPEED_SWEEP, Scenario, filler_text
from ._schema import RESULTS_SCHEMA, validate_results
from ._server import Endpoint, open_local_server

__all__ = [
    "CONCURRENCY_SCENARIO",
    "MODES",
    "PRESETS",
    "RESULTS_SCHEMA",
    "SPEED_SWEEP",
    "BenchConfig",
    "BenchError",
    "Endpoint",
    "RolloutRecord",
    "RolloutSpec",
    "Scenario",
    "ServerError",
    "ServerSpec",
    "ServerStartError",
    "SweepPoint",
    "TurnRecord",
    "filler_text",
    "open_local_server",
    "run_benchmark",
    "run_rollout",
    "validate_results",
    "write_plots",
    "write_results",
]
