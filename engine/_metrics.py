"""`GET /metrics`: the engine's counters and the server's gauges as Prometheus text.

prometheus_client writes the exposition (text format 0.0.4). Each app has its own
`CollectorRegistry` (never the process-global one: one process may run many servers, as the
tests do) with one custom collector that reads, at scrape time, what the engine already
counts:

    rollout_work_total{counter=...}       counter    the engine's deterministic work counters
    rollout_open_connections{transport=}  gauge      open WebSocket connections
    rollout_refused_connections_total     counter    upgrades refused at the connection limit
    rollout_http_requests_total           counter    HTTP requests served
    rollout_responses_total{status=...}   counter    responses by final status
    rollout_post_inference_backlog        gauge      post-inference jobs not yet written
    rollout_stage_seconds{stage=...}      histogram  pre-inference latency by pipeline stage
    rollout_render_cache_lookups_total{outcome=hit|miss}    counter  render cache lookups
    rollout_render_cache_tokens_reused_total                counter  tokens found, not rendered
    rollout_render_cache_dropped_total{reason=budget|ttl}   counter  entries dropped
    rollout_render_cache_bytes                              gauge    memory held (estimated)
    rollout_render_cache_entries                            gauge    entries held

The stage histograms stay the engine's own (`_counters.StageTimer`), exported here through
`HistogramMetricFamily`: the engine measures without depending on an exposition library (it
knows nothing of HTTP), a stage observation stays a few integer additions without a lock on
the hot path, and the bucket labels keep their `le="1"` spelling (prometheus_client's own
histograms would write `le="1.0"`, new series to every dashboard that reads these).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

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


class _RolloutCollector:
    """Reads the engine's and the server's counts at each scrape."""

    def __init__(self, engine: Engine, server: ServerStats) -> None:
        self._engine = engine
        self._server = server

    def collect(self) -> Iterator[Metric]:
        engine, server = self._engine, self._server
        work = CounterMetricFamily(
            "rollout_work_total", "Deterministic work counters of the engine.", labels=["counter"]
        )
        for name, value in engine.counters.as_dict().items():
            work.add_metric([name], value)
        yield work
        connections = GaugeMetricFamily(
            "rollout_open_connections", "Open WebSocket connections.", labels=["transport"]
        )
        connections.add_metric(["websocket"], server.open_connections)
        yield connections
        yield CounterMetricFamily(
            "rollout_refused_connections_total",
            "WebSocket upgrades refused at the connection limit.",
            value=server.refused_connections,
        )
        yield CounterMetricFamily(
            "rollout_http_requests_total", "HTTP requests served.", value=server.http_requests
        )
        responses = CounterMetricFamily(
            "rollout_responses_total", "Responses by final status.", labels=["status"]
        )
        for status, count in sorted(engine.responses_by_status.items()):
            responses.add_metric([status], count)
        yield responses
        yield GaugeMetricFamily(
            "rollout_post_inference_backlog",
            "Post-inference jobs (usage records, store writes) not yet written.",
            value=engine.post.backlog,
        )
        yield self._stages()
        yield from self._render_cache()

    def _render_cache(self) -> Iterator[Metric]:
        cache = self._engine.render_cache
        stats = cache.stats
        lookups = CounterMetricFamily(
            "rollout_render_cache_lookups",
            "Render cache lookups (a conversation's longest rendered prefix, or its "
            "instructions and tools) by outcome.",
            labels=["outcome"],
        )
        lookups.add_metric(["hit"], stats.hits)
        lookups.add_metric(["miss"], stats.misses)
        yield lookups
        yield CounterMetricFamily(
            "rollout_render_cache_tokens_reused",
            "Rendered tokens the render cache supplied instead of rendering them.",
            value=stats.tokens_reused,
        )
        dropped = CounterMetricFamily(
            "rollout_render_cache_dropped",
            "Render cache entries dropped, for the memory budget or the TTL.",
            labels=["reason"],
        )
        dropped.add_metric(["budget"], stats.evictions)
        dropped.add_metric(["ttl"], stats.expirations)
        yield dropped
        yield GaugeMetricFamily(
            "rollout_render_cache_bytes",
            "Memory the render cache holds (estimated: tokens, item content, per-item cost).",
            value=cache.bytes_held,
        )
        yield GaugeMetricFamily(
            "rollout_render_cache_entries", "Render cache entries held.", value=len(cache)
        )

    def _stages(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "rollout_stage_seconds", "Pre-inference latency by pipeline stage.", labels=["stage"]
        )
        for stage, hist in self._engine.timer.histograms.items():
            buckets: list[tuple[str, float]] = []
            cumulative = 0
            for bound, count in zip(LATENCY_BUCKETS, hist.buckets, strict=True):
                cumulative += count
                buckets.append((f"{bound:g}", cumulative))
            buckets.append(("+Inf", hist.count))
            family.add_metric([stage], buckets, sum_value=hist.total)
        return family


class MetricsExporter:
    """One app's registry and its exposition."""

    def __init__(self, engine: Engine, server: ServerStats) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_RolloutCollector(engine, server))
        # Text format 0.0.4, whatever the scraper's Accept header asks (as before).
        self._encode, self.content_type = choose_encoder("")

    def exposition(self) -> bytes:
        return self._encode(self.registry)
