"""`GET /metrics`: the engine's counters and the server's gauges as Prometheus text (0.0.4)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ._counters import LATENCY_BUCKETS
from ._engine import Engine

__all__ = ["MetricsExporter", "ServerStats"]


class ServerStats(Protocol):
    """What the server counts itself (the app)."""

    @property
    def open_connections(self) -> int: ...

    @property
    def refused_connections(self) -> int: ...

    @property
    def http_requests(self) -> int: ...


class MetricsExporter:
    """One app's exposition, written by hand."""

    content_type = "text/plain; version=0.0.4"

    def __init__(self, engine: Engine, server: ServerStats) -> None:
        self._engine = engine
        self._server = server

    def exposition(self) -> bytes:
        engine, server = self._engine, self._server
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: Iterable[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(
                    f"{name}{labels} {value:g}"
                    if isinstance(value, float)
                    else f"{name}{labels} {value}"
                )

        metric(
            "rollout_work_total",
            "counter",
            "Deterministic work counters of the engine.",
            ((f'{{counter="{k}"}}', v) for k, v in engine.counters.as_dict().items()),
        )
        metric(
            "rollout_open_connections",
            "gauge",
            "Open WebSocket connections.",
            [('{transport="websocket"}', server.open_connections)],
        )
        metric(
            "rollout_refused_connections_total",
            "counter",
            "WebSocket upgrades refused at the connection limit.",
            [("", server.refused_connections)],
        )
        metric(
            "rollout_http_requests_total",
            "counter",
            "HTTP requests served.",
            [("", server.http_requests)],
        )
        metric(
            "rollout_responses_total",
            "counter",
            "Responses by final status.",
            ((f'{{status="{k}"}}', v) for k, v in sorted(engine.responses_by_status.items())),
        )
        metric(
            "rollout_post_inference_backlog",
            "gauge",
            "Post-inference jobs (usage records, store writes) not yet written.",
            [("", engine.post.backlog)],
        )
        lines.append("# HELP rollout_stage_seconds Pre-inference latency by pipeline stage.")
        lines.append("# TYPE rollout_stage_seconds histogram")
        for stage, hist in engine.timer.histograms.items():
            cumulative = 0
            for bound, count in zip(LATENCY_BUCKETS, hist.buckets, strict=True):
                cumulative += count
                lines.append(
                    f'rollout_stage_seconds_bucket{{stage="{stage}",le="{bound:g}"}} {cumulative}'
                )
            lines.append(f'rollout_stage_seconds_bucket{{stage="{stage}",le="+Inf"}} {hist.count}')
            lines.append(f'rollout_stage_seconds_sum{{stage="{stage}"}} {hist.total:.9f}')
            lines.append(f'rollout_stage_seconds_count{{stage="{stage}"}} {hist.count}')
        return ("\n".join(lines) + "\n").encode()
