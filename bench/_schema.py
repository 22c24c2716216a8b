"""The JSON Schema of the results file (`results.json`), and its validation.

`RESULTS_SCHEMA` is the source of truth; `bench/results.schema.json` is the same document for
readers and other tools (a test keeps the two equal), and every run writes a copy next to its
results. Field meanings are in `bench/SCHEMA.md`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RESULTS_SCHEMA", "validate_results"]

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT_OR_NULL = {"type": ["integer", "null"]}
_STR_OR_NULL = {"type": ["string", "null"]}
_STATS = {"$ref": "#/$defs/stats"}
_STATS_OR_NULL = {"anyOf": [{"$ref": "#/$defs/stats"}, {"type": "null"}]}
_COUNTERS_OR_NULL = {"anyOf": [{"$ref": "#/$defs/counters"}, {"type": "null"}]}
_MODE = {"enum": ["http-stateless", "http-chain", "ws-chain", "ws-chain-stored", "ws-rollout"]}
_LOAD = {"type": "array", "items": _NUM, "minItems": 3, "maxItems": 3}
_TPS = {"type": ["number", "null"], "description": "model tokens per second; null: unpaced"}


def _record(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": sorted(properties),
        "additionalProperties": False,
        "properties": properties,
    }


RESULTS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://github.com/rollout/rollout/bench/results.schema.json",
    "title": "rollout bench results",
    "type": "object",
    "required": [
        "schema",
        "meta",
        "servers",
        "scenarios",
        "turns",
        "rollouts",
        "concurrency",
        "goals",
        "notes",
    ],
    "additionalProperties": False,
    "$defs": {
        "stats": _record(
            {
                "n": {"type": "integer", "minimum": 1},
                "mean": _NUM,
                "median": _NUM,
                "p90": _NUM,
                "p99": _NUM,
                "min": _NUM,
                "max": _NUM,
            }
        ),
        "counters": {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "description": "rollout_work_total{counter=...} deltas from the server's /metrics",
        },
    },
    "properties": {
        "schema": {"const": "rollout-bench/8"},
        "meta": _record(
            {
                "started_at": {"type": "string"},
                "finished_at": {"type": "string"},
                "duration_s": _NUM,
                "command": {"type": "array", "items": {"type": "string"}},
                "machine": _record(
                    {
                        "platform": {"type": "string"},
                        "system": {"type": "string"},
                        "release": {"type": "string"},
                        "machine": {"type": "string"},
                        "cpu_model": _STR_OR_NULL,
                        "cpu_count": _INT_OR_NULL,
                        "memory_bytes": _INT_OR_NULL,
                        "python": {"type": "string"},
                        "python_implementation": {"type": "string"},
                        "hostname": {"type": "string"},
                    }
                ),
                "load_average": _record(
                    {
                        "start": {"anyOf": [_LOAD, {"type": "null"}]},
                        "end": {"anyOf": [_LOAD, {"type": "null"}]},
                    }
                ),
                "machine_load": _record(
                    {
                        "cpu_count": _INT_OR_NULL,
                        "other_cpus": _NUM_OR_NULL,
                        "load_average_start": _NUM_OR_NULL,
                        "loaded": {"type": ["boolean", "null"]},
                        "reason": {"type": "string"},
                        "rule": {"type": "string"},
                    }
                ),
                "interrupted": {"type": "boolean"},
                "versions": {"type": "object", "additionalProperties": _STR_OR_NULL},
                "parameters": _record(
                    {
                        "preset": {"type": "string"},
                        "points": {
                            "type": "array",
                            "items": _record(
                                {
                                    "scenario": {"type": "string"},
                                    "tps": _TPS,
                                    "ttft_ms": _NUM_OR_NULL,
                                    "repetitions": {"type": "integer", "minimum": 1},
                                    "modes": {"type": "array", "items": _MODE},
                                }
                            ),
                        },
                        "concurrency": {"type": "array", "items": {"type": "integer"}},
                        "concurrency_modes": {"type": "array", "items": _MODE},
                        "concurrency_scenario": _STR_OR_NULL,
                        "concurrency_tps": _NUM,
                        "model_override": _STR_OR_NULL,
                        "tokenizer": {"type": "string"},
                        "counting_pass": {"type": "boolean"},
                        "pace_fraction": _NUM,
                        "pace_excess": _NUM,
                        "timeout_s": _NUM,
                    }
                ),
            }
        ),
        "servers": {
            "type": "array",
            "items": _record(
                {
                    "label": {"type": "string"},
                    "url": {"type": "string"},
                    "spawned": {"type": "boolean"},
                    "modes": {"type": "array", "items": _MODE},
                    "rollout_extension": {"type": "boolean"},
                    "metrics": {"type": "boolean"},
                    "proc_stats": {"type": "boolean"},
                    "websocket": {"type": "boolean"},
                    "websocket_deflate": {"type": ["boolean", "null"]},
                    "not_measured": {
                        "type": "object",
                        "propertyNames": _MODE,
                        "additionalProperties": {"type": "string"},
                    },
                    "serve_args": {"type": "array", "items": {"type": "string"}},
                    "notes": {"type": "array", "items": {"type": "string"}},
                    "stream_failures": {"type": "integer", "minimum": 0},
                }
            ),
        },
        "scenarios": {
            "type": "array",
            "items": _record(
                {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "steps": {"type": "integer", "minimum": 0},
                    "turns": {"type": "integer", "minimum": 1},
                    "tool_tokens": {"type": "array", "items": {"type": "integer"}},
                    "tool_latency_ms": _NUM,
                    "output_tokens": {"type": "integer"},
                    "prompt_tokens": {"type": "integer"},
                    "final_history_tokens": {"type": "integer"},
                    "final_context_tokens": {"type": "integer"},
                }
            ),
        },
        "turns": {
            "type": "array",
            "items": _record(
                {
                    "server": {"type": "string"},
                    "mode": _MODE,
                    "scenario": {"type": "string"},
                    "tps": _TPS,
                    "ttft_ms": _NUM_OR_NULL,
                    "turn": {"type": "integer", "minimum": 0},
                    "kind": {"enum": ["tool_call", "text"]},
                    "history_tokens": {"type": "integer"},
                    "new_input_tokens": {"type": "integer"},
                    "context_tokens": _INT_OR_NULL,
                    "output_tokens": _INT_OR_NULL,
                    "repetitions": {"type": "integer", "minimum": 1},
                    "model_s": _NUM_OR_NULL,
                    "ttft_s": _STATS_OR_NULL,
                    "turn_s": _STATS,
                    "excess_s": _STATS_OR_NULL,
                    "ack_s": _STATS_OR_NULL,
                    "tail_s": _STATS_OR_NULL,
                    "server_overhead_s": _STATS_OR_NULL,
                    "decode_s": _STATS_OR_NULL,
                    "stages_s": {
                        "anyOf": [
                            {"type": "object", "additionalProperties": _NUM},
                            {"type": "null"},
                        ]
                    },
                    "counters": _COUNTERS_OR_NULL,
                    "wire_in_bytes": _INT_OR_NULL,
                    "wire_out_bytes": _INT_OR_NULL,
                    "payload_in_bytes": _INT_OR_NULL,
                    "payload_out_bytes": _INT_OR_NULL,
                    "done_bytes": _INT_OR_NULL,
                    "resume_bytes": _INT_OR_NULL,
                    "received_tokens": _INT_OR_NULL,
                    "events_in": _INT_OR_NULL,
                    "bytes_per_event_in": _NUM_OR_NULL,
                    "encode_s_per_event": _NUM_OR_NULL,
                }
            ),
        },
        "rollouts": {
            "type": "array",
            "items": _record(
                {
                    "server": {"type": "string"},
                    "mode": _MODE,
                    "scenario": {"type": "string"},
                    "tps": _TPS,
                    "ttft_ms": _NUM_OR_NULL,
                    "repetitions": {"type": "integer", "minimum": 1},
                    "turns": {"type": "integer", "minimum": 1},
                    "e2e_s": _STATS,
                    "model_s": _NUM_OR_NULL,
                    "tool_s": _NUM,
                    "tool_nominal_s": _NUM,
                    "physical_limit_s": _NUM_OR_NULL,
                    "distance_s": _STATS_OR_NULL,
                    "distance_pct": _NUM_OR_NULL,
                    "server_overhead_s": _STATS_OR_NULL,
                    "ack_s": _STATS_OR_NULL,
                    "server_cpu_s": _STATS_OR_NULL,
                    "server_peak_rss_bytes": _INT_OR_NULL,
                    "counters": _COUNTERS_OR_NULL,
                    "counters_by_turn": {
                        "anyOf": [
                            {"type": "array", "items": _COUNTERS_OR_NULL},
                            {"type": "null"},
                        ]
                    },
                    "transcript_digest": _STR_OR_NULL,
                    "output_tokens_received": _INT_OR_NULL,
                    "output_tokens_reported": _INT_OR_NULL,
                    "token_ratio": _NUM_OR_NULL,
                    "reduction_vs_http_stateless_pct": _NUM_OR_NULL,
                    "reduction_vs_http_chain_pct": _NUM_OR_NULL,
                }
            ),
        },
        "concurrency": {
            "type": "array",
            "items": _record(
                {
                    "server": {"type": "string"},
                    "mode": _MODE,
                    "scenario": {"type": "string"},
                    "tps": _NUM,
                    "ttft_ms": _NUM_OR_NULL,
                    "concurrency": {"type": "integer", "minimum": 1},
                    "rollouts_ok": {"type": "integer"},
                    "rollouts_failed": {"type": "integer"},
                    "turns_failed": {"type": "integer", "minimum": 0},
                    "errors": {"type": "array", "items": {"type": "string"}},
                    "output_tokens_received": {"type": "integer", "minimum": 0},
                    "wall_s": _NUM,
                    "throughput_rollouts_per_s": _NUM_OR_NULL,
                    "throughput_output_tokens_per_s": _NUM_OR_NULL,
                    "e2e_s": _STATS_OR_NULL,
                    "ttft_s": _STATS_OR_NULL,
                    "turn_s": _STATS_OR_NULL,
                    "excess_s": _STATS_OR_NULL,
                    "achieved_tps_per_rollout": _STATS_OR_NULL,
                    "pace_ratio": _NUM_OR_NULL,
                    "excess_ratio": _NUM_OR_NULL,
                    "keeps_pace": {"type": ["boolean", "null"]},
                    "server_cpu_s": _NUM_OR_NULL,
                    "server_cpu_utilization": _NUM_OR_NULL,
                    "server_peak_rss_bytes": _INT_OR_NULL,
                    "client_cpu_s": _NUM,
                }
            ),
        },
        "goals": {
            "type": "array",
            "items": _record(
                {
                    "id": {"type": "string"},
                    "server": {"type": "string"},
                    "description": {"type": "string"},
                    "measured": _NUM_OR_NULL,
                    "threshold": _NUM,
                    "met": {"type": ["boolean", "null"]},
                    "detail": {"type": "string"},
                }
            ),
        },
        "notes": {"type": "array", "items": {"type": "string"}},
    },
}


# Results from before the machine's load was judged (the same schema id) have no
# `meta.machine_load`: their verdict cannot say whether the machine was loaded.
RESULTS_SCHEMA["properties"]["meta"]["required"].remove("machine_load")


def validate_results(results: Any) -> None:
    """Raise `jsonschema.ValidationError` unless `results` matches `RESULTS_SCHEMA`."""
    import jsonschema

    jsonschema.validate(results, RESULTS_SCHEMA, cls=jsonschema.Draft202012Validator)
