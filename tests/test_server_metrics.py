"""`/metrics` exposition (`engine/_metrics.py`): prometheus_client writes it from a registry
per app, so servers in one process never share or collide; the engine's own histograms keep
their buckets and `le` spellings."""

from __future__ import annotations

import attrs
import prometheus_client
from prometheus_client.parser import text_string_to_metric_families
from rollout.engine._counters import LATENCY_BUCKETS, STAGES
from rollout.engine._engine import open_engine
from rollout.engine._http_limits import TransportStats
from rollout.engine._metrics import MetricsExporter

from tests.server_harness import counters, parse_metrics


@attrs.define
class Stats:
    open_connections: int = 0
    refused_connections: int = 0
    http_requests: int = 0
    transport: TransportStats = attrs.field(factory=TransportStats)


async def test_two_apps_in_one_process_keep_their_own_counts() -> None:
    async with open_engine() as one, open_engine() as two:
        stats_one, stats_two = Stats(open_connections=2, http_requests=5), Stats()
        first, second = MetricsExporter(one, stats_one), MetricsExporter(two, stats_two)
        one.counters.samplings += 3
        one.record_status("completed")
        samples_one = parse_metrics(first.exposition().decode())
        samples_two = parse_metrics(second.exposition().decode())
    assert counters(samples_one)["samplings"] == 3
    assert counters(samples_two)["samplings"] == 0
    assert samples_one[("rollout_open_connections", frozenset({("transport", "websocket")}))] == 2
    assert samples_one[("rollout_http_requests_total", frozenset())] == 5
    assert samples_one[("rollout_responses_total", frozenset({("status", "completed")}))] == 1
    assert ("rollout_responses_total", frozenset({("status", "completed")})) not in samples_two
    # Nothing leaks into the process-global registry.
    assert "rollout_work_total" not in prometheus_client.generate_latest().decode()


async def test_exposition_is_text_format_0_0_4_with_every_family() -> None:
    async with open_engine() as engine:
        exporter = MetricsExporter(engine, Stats(refused_connections=1))
        text = exporter.exposition().decode()
    assert exporter.content_type.startswith("text/plain; version=0.0.4")
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert families == {
        "rollout_work": "counter",
        "rollout_open_connections": "gauge",
        "rollout_refused_connections": "counter",
        "rollout_http_requests": "counter",
        "rollout_open_tcp_connections": "gauge",
        "rollout_transport_refusals": "counter",
        "rollout_transport_timeouts": "counter",
        "rollout_responses": "counter",
        "rollout_post_inference_backlog": "gauge",
        "rollout_stage_seconds": "histogram",
        "rollout_render_cache_lookups": "counter",
        "rollout_render_cache_tokens_reused": "counter",
        "rollout_render_cache_dropped": "counter",
        "rollout_render_cache_bytes": "gauge",
        "rollout_render_cache_entries": "gauge",
        "rollout_input_memo_requests": "counter",
        "rollout_input_memo_items_reused": "counter",
        "rollout_input_memo_bytes_parsed": "counter",
        "rollout_input_memo_bytes": "gauge",
    }
    assert parse_metrics(text)[("rollout_refused_connections_total", frozenset())] == 1
    # No `_created` samples: the collector reports what the engine counts, nothing more.
    assert "_created" not in text


async def test_stage_histograms_are_the_engines_own() -> None:
    async with open_engine() as engine:
        for seconds in (0.000001, 0.002, 0.002, 0.5, 10.0):
            engine.timer.histograms["render"].observe(seconds)
        samples = parse_metrics(MetricsExporter(engine, Stats()).exposition().decode())
    stages = {
        dict(labels)["stage"] for name, labels in samples if name == "rollout_stage_seconds_count"
    }
    assert stages == set(STAGES)
    buckets = {
        dict(labels)["le"]: value
        for (name, labels), value in samples.items()
        if name == "rollout_stage_seconds_bucket" and ("stage", "render") in labels
    }
    # The bucket bounds as before (`le="1"`, not "1.0"), cumulative, ending at +Inf == count.
    assert list(buckets) == [f"{bound:g}" for bound in LATENCY_BUCKETS] + ["+Inf"]
    assert buckets["1e-05"] == 1
    assert buckets["0.001"] == 1
    assert buckets["0.003"] == 3
    assert buckets["1"] == 4
    assert buckets["3"] == 4
    assert buckets["+Inf"] == 5
    render = frozenset({("stage", "render")})
    assert samples[("rollout_stage_seconds_count", render)] == 5
    assert abs(samples[("rollout_stage_seconds_sum", render)] - 10.504001) < 1e-9
