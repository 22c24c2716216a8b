"""Work counters and stage timings.

Counters are deterministic and count work done (items validated, tokens rendered, characters
the classifiers report examining, bytes decoded and encoded, ...): tests assert them and the
benchmark reports them. Timings are wall-clock (`time.perf_counter`) and are
only reported, never asserted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import attrs

__all__ = ["STAGES", "Counters", "StageTimer"]

# The stages whose latency is measured, in a request's order: receiving an HTTP body; the
# pre-inference stages (`lookup`: the render cache's search for a stateless client's known
# prefix); an upstream model's request: encoding its body, and sending it (from the request's
# start to its last byte handed to the socket, the connection included).
STAGES = (
    "receive",
    "decode",
    "resolve",
    "lookup",
    "validate",
    "render",
    "classify",
    "route",
    "store",
    "upstream_encode",
    "upstream_send",
)

# Histogram bucket upper bounds in seconds for per-stage latency (Prometheus-style, cumulative).
LATENCY_BUCKETS = (
    0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0,
)  # fmt: skip


@attrs.define
class Counters:
    """Deterministic work counters of one engine (or one request, for per-request deltas)."""

    items_validated: int = 0
    tokens_rendered: int = 0
    chars_classified: int = 0  # characters the classifiers examined (as they report)
    route_resolutions: int = 0
    pre_inference_runs: int = 0  # responses prepared (Session.prepare): one per response
    injects_committed: int = 0  # response.inject events committed to a waiting response
    cache_hits: int = 0
    cache_misses: int = 0
    hydrations: int = 0
    store_reads: int = 0
    store_writes: int = 0
    ledger_records: int = 0
    usage_records_dropped: int = 0  # a failed ledger write's records past MAX_UNWRITTEN_USAGE
    post_inference_runs: int = 0
    samplings: int = 0
    rollout_suspensions: int = 0  # rollouts suspended at tool calls (`response.done` sent)
    tokens_sampled: int = 0
    # samplings whose output tokens are an estimate (an upstream that reported no usage: its
    # chunks counted), not the model's own count
    usage_estimated: int = 0
    # Tokens a model evaluated as context (prompt chunks, and sampled tokens fed back): with
    # every reuse working, each token of a conversation's context once. Backends that keep no
    # evaluated state (sim, a chat-completions upstream) report none.
    tokens_prefilled: int = 0
    hosted_calls: int = 0  # hosted tools' calls run by their executors
    bytes_decoded: int = 0  # client messages (WebSocket frames, HTTP bodies) decoded
    ws_chars_encoded: int = 0  # characters of the WebSocket text frames encoded
    ws_bytes_encoded: int = 0  # bytes (UTF-8) of the WebSocket text frames encoded
    # Of those, the rollout extension's suspension events (`response.done` and the resumed
    # `response.in_progress`): constant per suspension however long the rollout (RX-2.2).
    suspension_bytes_encoded: int = 0
    sse_bytes_encoded: int = 0  # bytes of the server-sent-event frames encoded
    offloaded_decodes: int = 0  # client messages large enough to decode in a worker thread
    # requests whose JSON schemas were large enough to validate in a worker thread
    offloaded_validations: int = 0
    # requests whose new text was large enough to render and classify in a worker thread
    offloaded_renders: int = 0
    # requests and WebSocket upgrades refused by the browser rules (`_browser.py`): a foreign
    # Host, an Origin not allowed, a form or text body
    browser_refusals: int = 0
    # clients torn down for not reading (WebSocket, or an HTTP response's write held past the
    # stall limit): responses cancelled, connections reset
    slow_consumers: int = 0
    # WebSocket connections cut off at the TCP level (reset: a slow consumer, a ping unanswered)
    ws_aborts: int = 0
    ws_ping_timeouts: int = 0  # WebSocket peers that did not answer a ping in time (aborted)
    ws_idle_closes: int = 0  # WebSocket connections closed (1000) for being idle too long
    ws_age_closes: int = 0  # WebSocket connections past their age limit (closed once idle)
    # WebSocket upgrades refused because the key (or, without auth, the client address)
    # already held its share of the connections
    ws_key_share_refusals: int = 0
    # HTTP requests refused (429) because their key (or client address) had its share of the
    # TCP connections in requests already
    http_key_share_refusals: int = 0
    responses_completed: int = 0
    responses_incomplete: int = 0
    responses_failed: int = 0
    request_errors: int = 0
    steers_accepted: int = 0  # steering submissions queued on a running response
    steer_successors: int = 0  # successor responses started with queued steering input

    def ws_frame_encoded(self, text: str, *, suspension: bool = False) -> None:
        """A WebSocket text frame was encoded (`suspension`: a rollout's suspension event)."""
        size = len(text) if text.isascii() else len(text.encode())
        self.ws_chars_encoded += len(text)
        self.ws_bytes_encoded += size
        if suspension:
            self.suspension_bytes_encoded += size

    def snapshot(self) -> Counters:
        return attrs.evolve(self)

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            **{
                # every counter, by its attrs field (the class is all counters)
                f.name: getattr(self, f.name) - getattr(other, f.name)
                for f in attrs.fields(Counters)
            }
        )

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


@attrs.define
class _Histogram:
    buckets: list[int] = attrs.field(factory=lambda: [0] * len(LATENCY_BUCKETS))
    count: int = 0
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.buckets[i] += 1
                break


@attrs.define
class StageTimer:
    """Per-stage latency histograms (engine-wide), and the last request's split for callers
    that ask for timing (the benchmark reads it from the server)."""

    histograms: dict[str, _Histogram] = attrs.field(
        factory=lambda: {stage: _Histogram() for stage in STAGES}
    )

    def observe(self, stage: str, seconds: float, into: dict[str, float] | None = None) -> None:
        """A stage timed by the caller (a backend's own: `SampleRequest.observe`)."""
        self.histograms[stage].observe(seconds)
        if into is not None:
            into[stage] = into.get(stage, 0.0) + seconds

    def measure_if(self, stage: str, into: dict[str, float] | None) -> AbstractContextManager[None]:
        """`measure` when the caller times (`into` given); nothing at all without: a worker
        thread's work (rendering ahead) touches no shared histogram, its caller times it."""
        return nullcontext() if into is None else self.measure(stage, into)

    @contextmanager
    def measure(self, stage: str, into: dict[str, float] | None = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.histograms[stage].observe(elapsed)
            if into is not None:
                into[stage] = into.get(stage, 0.0) + elapsed
