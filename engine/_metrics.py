"""`GET /metrics`: the engine's counters and the server's gauges as Prometheus text.

Long because each family is declared with its help text, and the multiprocess merge
(`--workers`) needs its own collector and file bookkeeping.

prometheus_client writes the exposition (text format 0.0.4). Each app has its own
`CollectorRegistry` (never the process-global one: one process may run many servers, as the
tests do) with one custom collector that reads, at scrape time, what the engine already
counts:

    rollout_work_total{counter=...}       counter    the engine's deterministic work counters
    rollout_open_connections{transport=}  gauge      open WebSocket connections
    rollout_refused_connections_total     counter    upgrades refused at the connection limit
    rollout_open_tcp_connections          gauge      open TCP connections (HTTP and WebSocket)
    rollout_transport_refusals_total{reason=max_tcp_connections|descriptors|inflate_budget}
    rollout_transport_timeouts_total{phase=headers|body|keep_alive}            counter
    rollout_http_requests_total           counter    HTTP requests served
    rollout_responses_total{status=...}   counter    responses by final status
    rollout_post_inference_backlog        gauge      post-inference jobs not yet written
    rollout_stage_seconds{stage=...}      histogram  latency by stage (`_counters.STAGES`: the
                                                     body's receipt, pre-inference, an upstream
                                                     request's encoding and sending)
    rollout_render_cache_lookups_total{outcome=hit|miss}    counter  render cache lookups
    rollout_render_cache_tokens_reused_total                counter  tokens found, not rendered
    rollout_render_cache_dropped_total{reason=budget|ttl}   counter  entries dropped
    rollout_render_cache_bytes                              gauge    memory held (estimated)
    rollout_render_cache_entries                            gauge    entries held
    rollout_input_memo_requests_total{outcome=hit|miss|fallback} counter large creates decoded
    rollout_input_memo_items_reused_total                   counter  input items not decoded
    rollout_input_memo_bytes_parsed_total                   counter  input text parsed
    rollout_input_memo_bytes                                gauge    input text held
    rollout_upstream_bytes_encoded_total{model=,part=messages|head} counter  upstream JSON made
    rollout_upstream_bytes_sent_total{model=}               counter  upstream body bytes sent
    rollout_kv_cache_lookups_total{model=,outcome=hit|miss} counter  a real model's turns that
                                                                     kept a cached prefix or not
    rollout_kv_cache_tokens_reused_total{model=}            counter  context tokens whose KV was
                                                                     kept, not evaluated
    rollout_kv_cache_dropped_total{model=,reason=index|pool} counter sequences dropped: idle
                                                                     ones for --kv-cache-mb,
                                                                     kept ones for a full pool
    rollout_kv_cache_tokens{model=,state=running|kept|indexed} gauge tokens the KV pool holds
    rollout_kv_cache_bytes{model=}                          gauge    the KV pool's size
    rollout_model_steps_total{model=}                       counter  llama_decode calls
    rollout_model_tokens_total{model=,kind=prompt|decode}   counter  tokens evaluated
    rollout_model_busy_seconds_total{model=,phase=prefill|decode} counter the model thread's
                                                                     time (decode, sampling)
    rollout_model_step_sequences{model=}                    histogram sequences per step
    rollout_model_sequences{model=,state=decoding|prefilling|waiting} gauge turns by state
    rollout_model_prompt_queued_tokens{model=}              gauge    prompt tokens queued

The stage histograms stay the engine's own (`_counters.StageTimer`), exported here through
`HistogramMetricFamily`: the engine measures without depending on an exposition library (it
knows nothing of HTTP), a stage observation stays a few integer additions without a lock on
the hot path, and the bucket labels keep their `le="1"` spelling (prometheus_client's own
histograms would write `le="1.0"`, new series to every dashboard that reads these).

Under `rollout serve --workers N` a scrape reaches ONE worker, so `/metrics` aggregates across
the workers (no worker label: one deployment, one set of series), with prometheus_client's
multiprocess mode: each worker writes the families above into its own files in a directory the
workers share (`counter_PID.db`, `gauge_livesum_PID.db`, `histogram_PID.db`: the mode's mmap
files, written by `MmapedDict` as its metric values write them), every
`METRICS_SYNC_INTERVAL`, and whenever a scrape asks; the scraped worker merges every
worker's files with `MultiProcessCollector`. Counters and histograms sum over every worker that
ever ran (a restarted worker's earlier counts stay, so counters never go back); gauges sum over
the live workers (the parent removes a dead worker's files with `forget_worker`).

A scrape is as exact as one process's: the scraped worker stamps the request file the workers
share (`sync-request`, the monotonic clock, which every process on the host shares; a later
scrape's stamp is later), every worker polls it every `METRICS_POLL_INTERVAL` (one 8-byte
read), writes its counts and stamps its acknowledgement (`sync-ack-PID`), and the scrape
merges once every live worker has acknowledged it, or after `METRICS_SYNC_WAIT` (a worker
stuck that long is shown as of its last write). So a client that saw a turn end and then
scrapes sees that turn's counts, whichever worker ran it and whichever answers the scrape.
"""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from ._counters import LATENCY_BUCKETS
from ._engine import Engine
from ._http_limits import TransportStats
from ._llama_engine import STEP_SEQUENCE_BUCKETS

__all__ = [
    "METRICS_POLL_INTERVAL",
    "METRICS_SYNC_INTERVAL",
    "METRICS_SYNC_WAIT",
    "MetricsExporter",
    "ServerStats",
    "forget_worker",
]

# How often (seconds) a worker writes its counts unasked. Writing is one pass over about a
# hundred samples into a memory-mapped file, so once a second costs nothing measurable.
METRICS_SYNC_INTERVAL = 1.0
# How often (seconds) a worker looks for scrapes' requests (one 8-byte read): the delay a
# scrape adds, at most this much. The read costs nothing; waking an idle process does (on a
# 2-vCPU VM, ~0.5 ms of CPU per wake-up: an idle two-worker server used 11% of a core polling
# every 10 ms, 3% every 50 ms).
METRICS_POLL_INTERVAL = 0.05
# How long (seconds) a scrape waits for every worker's acknowledgement before it answers with
# what the files hold.
METRICS_SYNC_WAIT = 0.5


class ServerStats(Protocol):
    """What the server counts itself (the app)."""

    @property
    def open_connections(self) -> int: ...

    @property
    def refused_connections(self) -> int: ...

    @property
    def http_requests(self) -> int: ...

    @property
    def transport(self) -> TransportStats: ...


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
        yield from self._transport()
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
        yield from self._input_memo()
        yield from self._upstreams()
        yield from self._kv_caches()

    def _transport(self) -> Iterator[Metric]:
        """The TCP connections (`_http_limits.py`): open, refused by reason, timed out by
        phase (every reason and phase listed, 0 until it happens)."""
        transport = self._server.transport
        yield GaugeMetricFamily(
            "rollout_open_tcp_connections",
            "Open TCP connections, HTTP and WebSocket.",
            value=transport.open_tcp,
        )
        refusals = CounterMetricFamily(
            "rollout_transport_refusals",
            "Connections refused: past --max-tcp-connections, descriptors exhausted (accept "
            "tries that failed), WebSocket messages past the inflate budget (closed 1013).",
            labels=["reason"],
        )
        for reason in ("max_tcp_connections", "descriptors", "inflate_budget"):
            refusals.add_metric([reason], transport.refusals[reason])
        yield refusals
        timeouts = CounterMetricFamily(
            "rollout_transport_timeouts",
            "Connections closed by a timeout of a phase the peer controls.",
            labels=["phase"],
        )
        for phase in ("headers", "body", "keep_alive"):
            timeouts.add_metric([phase], transport.timeouts[phase])
        yield timeouts

    def _kv_caches(self) -> Iterator[Metric]:
        """The KV index of every real model that has run (`_kv.py`)."""
        from ._kv import KVIndex

        models = [
            (spec.name, spec.backend)
            for spec in self._engine.registry.specs()
            # an optional backend capability (a KV index): not in the Backend Protocol
            if isinstance(getattr(spec.backend, "kv", None), KVIndex)
        ]
        if not models:
            return
        lookups = CounterMetricFamily(
            "rollout_kv_cache_lookups",
            "A real model's turns by whether they kept a cached prefix's KV.",
            labels=["model", "outcome"],
        )
        reused = CounterMetricFamily(
            "rollout_kv_cache_tokens_reused",
            "Context tokens whose KV was kept instead of evaluated.",
            labels=["model"],
        )
        dropped = CounterMetricFamily(
            "rollout_kv_cache_dropped",
            "KV sequences dropped: idle ones for the index budget (--kv-cache-mb), kept ones "
            "(suspended rollouts, WebSocket lanes) because the pool was full.",
            labels=["model", "reason"],
        )
        held = GaugeMetricFamily(
            "rollout_kv_cache_tokens",
            "Tokens whose KV the pool holds, by state.",
            labels=["model", "state"],
        )
        size = GaugeMetricFamily(
            "rollout_kv_cache_bytes", "The size of a real model's KV pool.", labels=["model"]
        )
        for name, backend in models:
            kv = backend.kv  # type: ignore[attr-defined]
            stats = kv.stats
            lookups.add_metric([name, "hit"], stats.hits)
            lookups.add_metric([name, "miss"], stats.misses)
            reused.add_metric([name], stats.tokens_reused)
            dropped.add_metric([name, "index"], stats.evictions)
            dropped.add_metric([name, "pool"], stats.kept_evictions)
            running = sum(len(s.tokens) + s.reserved for s in kv.slots if s.running)
            held.add_metric([name, "running"], running)
            held.add_metric([name, "kept"], kv.kept_tokens)
            held.add_metric([name, "indexed"], kv.indexed_tokens)
            size.add_metric([name], kv.cells * backend.kv_bytes_per_token)  # type: ignore[attr-defined]
        yield from (lookups, reused, dropped, held, size)
        yield from self._model_threads(models)

    def _model_threads(self, models: Sequence[tuple[str, object]]) -> Iterator[Metric]:
        """The model threads of the real models that have run (`_llama_engine.py`: what each
        step did, the turns waiting to be admitted)."""
        running = [
            (name, backend, backend.runtime_stats)  # type: ignore[attr-defined]
            for name, backend in models
            # an optional backend capability (batching statistics): not in the Protocol
            if getattr(backend, "runtime_stats", None) is not None
        ]
        if not running:
            return
        steps = CounterMetricFamily(
            "rollout_model_steps", "llama_decode calls of a real model.", labels=["model"]
        )
        tokens = CounterMetricFamily(
            "rollout_model_tokens",
            "Tokens a real model evaluated: prompt tokens, and sampled tokens fed back (decode).",
            labels=["model", "kind"],
        )
        busy = CounterMetricFamily(
            "rollout_model_busy_seconds",
            "The model thread's time in llama_decode and sampling, by kind of step: prefill "
            "(it evaluated prompt tokens, beside any decoding), decode (only decoding).",
            labels=["model", "phase"],
        )
        per_step = HistogramMetricFamily(
            "rollout_model_step_sequences",
            "Sequences served by each step (batch size in sequences).",
            labels=["model"],
        )
        sequences = GaugeMetricFamily(
            "rollout_model_sequences",
            "A real model's turns by state: decoding, prefilling (reading their prompt), "
            "waiting (for the prompt queue's bound or the KV pool).",
            labels=["model", "state"],
        )
        queued = GaugeMetricFamily(
            "rollout_model_prompt_queued_tokens",
            "Prompt tokens started and not yet evaluated (bounded by prefill_queue_tokens).",
            labels=["model"],
        )
        for name, backend, stats in running:
            steps.add_metric([name], stats.steps)
            tokens.add_metric([name, "prompt"], stats.prompt_tokens)
            tokens.add_metric([name, "decode"], stats.decode_tokens)
            busy.add_metric([name, "prefill"], stats.prefill_seconds)
            busy.add_metric([name, "decode"], stats.decode_seconds)
            cumulative, buckets = 0, []
            for bound, count in zip(STEP_SEQUENCE_BUCKETS, stats.step_sequences, strict=True):
                cumulative += count
                buckets.append((str(bound), cumulative))
            buckets.append(("+Inf", cumulative))
            per_step.add_metric([name], buckets, sum_value=stats.sequences)
            sequences.add_metric([name, "decoding"], stats.decoding)
            sequences.add_metric([name, "prefilling"], stats.prefilling)
            sequences.add_metric([name, "waiting"], backend.waiting)  # type: ignore[attr-defined]
            queued.add_metric([name], stats.queued_prompt)
        yield from (steps, tokens, busy, per_step, sequences, queued)

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

    def _input_memo(self) -> Iterator[Metric]:
        memo = self._engine.input_memo
        stats = memo.stats
        requests = CounterMetricFamily(
            "rollout_input_memo_requests",
            "Large creates by how the input memo decoded them: from an earlier input's items "
            "(hit), all parsed (miss), or left to the protocol's decoder (fallback).",
            labels=["outcome"],
        )
        requests.add_metric(["hit"], stats.hits)
        requests.add_metric(["miss"], stats.misses)
        requests.add_metric(["fallback"], stats.fallbacks)
        yield requests
        yield CounterMetricFamily(
            "rollout_input_memo_items_reused",
            "Input items taken from an earlier input instead of decoded.",
            value=stats.items_reused,
        )
        yield CounterMetricFamily(
            "rollout_input_memo_bytes_parsed",
            "Input text the input memo parsed (the new part of each input).",
            value=stats.bytes_parsed,
        )
        yield GaugeMetricFamily(
            "rollout_input_memo_bytes", "Input text the input memo holds.", value=memo.bytes_held
        )

    def _upstreams(self) -> Iterator[Metric]:
        """What the chat-completions upstreams' requests cost to make (`_upstream.py`)."""
        from ._upstream import UpstreamBackend

        models = [
            (spec.name, spec.backend)
            for spec in self._engine.registry.specs()
            if isinstance(spec.backend, UpstreamBackend)
        ]
        if not models:
            return
        encoded = CounterMetricFamily(
            "rollout_upstream_bytes_encoded",
            "JSON encoded for upstream request bodies: the conversation's messages (each "
            "once) and each request's head (model, options, tools, system message).",
            labels=["model", "part"],
        )
        sent = CounterMetricFamily(
            "rollout_upstream_bytes_sent", "Request body bytes sent upstream.", labels=["model"]
        )
        for name, backend in models:
            encoded.add_metric([name, "messages"], backend.counters.message_bytes_encoded)
            encoded.add_metric([name, "head"], backend.counters.head_bytes_encoded)
            sent.add_metric([name], backend.counters.bytes_sent)
        yield from (encoded, sent)

    def _stages(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "rollout_stage_seconds",
            "Latency by stage: an HTTP body's receipt, the pre-inference stages, an upstream "
            "request's encoding and sending.",
            labels=["stage"],
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


class _SharedFiles:
    """This process's multiprocess-mode files (the collector's families, written in place) and
    its scrape requests and acknowledgements."""

    # The mode's file of each metric type: its merge reads the type from the name, and a
    # gauge's way of merging (`livesum`: the sum over the live processes) from the name too.
    _FILES = {"counter": "counter", "gauge": "gauge_livesum", "histogram": "histogram"}

    def __init__(self, directory: Path, pid: int) -> None:
        self.directory = directory
        self.pid = pid
        self._files: dict[str, Any] = {
            kind: MmapedDict(str(directory / f"{name}_{pid}.db"))  # type: ignore[no-untyped-call]
            for kind, name in self._FILES.items()
        }
        self._request = _Stamp(directory / _REQUEST, reset=False)  # every worker's
        self._ack = _Stamp(directory / f"{_ACK}{pid}")

    def request(self, when: float) -> None:
        self._request.write(when)

    def acknowledge(self, when: float) -> None:
        self._ack.write(when)

    def latest_request(self) -> float:
        """The newest request of any scrape, of any worker (one 8-byte read: every worker
        polls it every `METRICS_POLL_INTERVAL`)."""
        return self._request.value()

    def all_acknowledged(self, since: float) -> bool:
        """Has every live worker (one with a gauge file) written its counts after `since`?"""
        for gauges in self.directory.glob("gauge_livesum_*.db"):
            pid = gauges.name.removeprefix("gauge_livesum_").removesuffix(".db")
            if pid != str(self.pid) and _Stamp.read(self.directory / f"{_ACK}{pid}") < since:
                return False
        return True

    def write(self, families: Iterable[Metric]) -> None:
        for family in families:
            file = self._files[family.type]
            below: dict[tuple[tuple[str, str], ...], float] = {}
            for sample in family.samples:
                value = sample.value
                if sample.name.endswith("_count") and family.type == "histogram":
                    continue  # the merge counts the buckets
                if "le" in sample.labels:
                    # The files hold each bucket's own count; the merge makes them cumulative.
                    series = tuple((k, v) for k, v in sample.labels.items() if k != "le")
                    value, below[series] = value - below.get(series, 0.0), value
                key = mmap_key(
                    family.name,
                    sample.name,
                    list(sample.labels),
                    list(sample.labels.values()),
                    family.documentation,
                )
                file.write_value(key, value, 0.0)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._request.close()
        self._ack.close()


_REQUEST = "sync-request"
_ACK = "sync-ack-"


class _Stamp:
    """A monotonic-clock reading in a file of its own (8 bytes, written in place). `reset`:
    start it at 0 (a worker's own acknowledgement); the shared request file keeps what
    another worker's scrape wrote."""

    def __init__(self, path: Path, *, reset: bool = True) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if reset:
            self.write(0.0)

    def write(self, when: float) -> None:
        os.pwrite(self._fd, struct.pack("d", when), 0)

    def value(self) -> float:
        raw = os.pread(self._fd, 8, 0)
        return float(struct.unpack("d", raw)[0]) if len(raw) == 8 else 0.0

    def close(self) -> None:
        os.close(self._fd)

    @staticmethod
    def read(path: Path) -> float:
        try:
            with path.open("rb") as f:
                raw = f.read(8)
        except FileNotFoundError:
            return 0.0  # a worker that just exited (or not yet started)
        return float(struct.unpack("d", raw)[0]) if len(raw) == 8 else 0.0


def forget_worker(directory: Path, pid: int) -> None:
    """After worker `pid` exited: its gauges and its acknowledgement go (its counts stay)."""
    mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
    (directory / f"{_ACK}{pid}").unlink(missing_ok=True)


class _MergedCollector:
    """Every worker's files, merged (sums), with the bucket labels spelled as ours are."""

    def __init__(self, directory: Path) -> None:
        self._merged = MultiProcessCollector(None, path=str(directory))  # type: ignore[no-untyped-call]

    def collect(self) -> Iterator[Metric]:
        for metric in self._merged.collect():  # type: ignore[no-untyped-call]
            if metric.type == "histogram":
                metric.samples = [
                    s._replace(labels={**s.labels, "le": _le(s.labels["le"])})
                    if "le" in s.labels
                    else s
                    for s in metric.samples
                ]
            yield metric


def _le(bound: str) -> str:
    """A bucket bound as `_stages` spells it (`1`, not the merge's `1.0`)."""
    return bound if bound == "+Inf" else f"{float(bound):g}"


class MetricsExporter:
    """One app's registry and its exposition. With `shared_dir` (one of several worker
    processes), the exposition merges every worker's counts (see the module docstring)."""

    def __init__(
        self, engine: Engine, server: ServerStats, *, shared_dir: Path | None = None
    ) -> None:
        self._collector = _RolloutCollector(engine, server)
        self._shared: _SharedFiles | None = None
        if shared_dir is None:
            self.registry = CollectorRegistry(auto_describe=True)
            self.registry.register(self._collector)
        else:
            self._shared = _SharedFiles(shared_dir, os.getpid())
            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(_MergedCollector(shared_dir))
        # Text format 0.0.4, whatever the scraper's Accept header asks (as before).
        self._encode, self.content_type = choose_encoder("")

    def exposition(self) -> bytes:
        """The text of every series now (a worker's: with the others' as last written)."""
        self.sync()
        return self._encode(self.registry)

    async def scrape(self) -> bytes:
        """The text of every series, for `GET /metrics`: a worker first has every other worker
        write its counts (see the module docstring)."""
        shared = self._shared
        if shared is not None:
            asked = time.monotonic()
            shared.request(asked)
            with trio.move_on_after(METRICS_SYNC_WAIT):
                while True:
                    if shared.all_acknowledged(asked):
                        break
                    await trio.sleep(METRICS_POLL_INTERVAL / 2)
        return self.exposition()

    def sync(self) -> None:
        """Write this worker's counts for the other workers' scrapes (no-op alone)."""
        if self._shared is not None:
            stamp = time.monotonic()
            self._shared.write(self._collector.collect())
            self._shared.acknowledge(stamp)

    async def sync_forever(self) -> None:
        """A worker's background: `sync` when a scrape asks, and every
        `METRICS_SYNC_INTERVAL` seconds unasked."""
        shared = self._shared
        if shared is None:
            return
        synced = -math.inf
        while True:
            now = time.monotonic()
            if shared.latest_request() > synced or now - synced >= METRICS_SYNC_INTERVAL:
                synced = now
                self.sync()
            await trio.sleep(METRICS_POLL_INTERVAL)

    def close(self) -> None:
        """A last `sync` (a stopping worker's final counts), then close the files."""
        if self._shared is not None:
            self.sync()
            self._shared.close()
            self._shared = None
