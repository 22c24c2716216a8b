"""The records of a run as the client sees it: each turn (its timing, bytes, the streams of its
output items as they arrived) and each rollout."""

from __future__ import annotations

import hashlib

import attrs

from ._ws import WireCounts

__all__ = ["RolloutRecord", "Stream", "TurnRecord"]

# Stages that time the request's bytes moving rather than the server's work on them: the body
# read off the socket (as fast as the client sends it), its JSON decode, and the model server's
# request written to its socket. `server_overhead` leaves them out (`decode` is reported apart).
TRANSPORT_STAGES = frozenset({"receive", "decode", "upstream_send"})


@attrs.define
class Stream:
    """One output item of a turn as it arrived: its deltas, joined, against the text the item
    has when it is done (a message's text, a call's arguments; None: it never completed)."""

    kind: str  # "text" or "arguments"
    item_id: str
    received: str
    final: str | None


@attrs.define
class TurnRecord:
    """One turn: a model response up to its function calls (or the final answer)."""

    index: int
    sent: float
    acknowledged: float | None = None  # response.created / the resumed response.in_progress
    first_token: float | None = None
    last_token: float | None = None
    ended: float = 0.0
    deltas: int = 0
    kind: str = "text"  # "tool_call" or "text"
    status: str | None = None  # the response's status at the turn's end (None: not given)
    output_tokens: int | None = None  # from the response's usage, where the mode has it
    context_tokens: int | None = None  # input tokens from the usage, where the mode has it
    cached_tokens: int | None = None  # of them, what the server says it did not evaluate
    stages: dict[str, float] | None = None  # server-reported pre-inference seconds by stage
    counters: dict[str, int] | None = None  # /metrics work-counter deltas (counting pass)
    wire: WireCounts | None = None  # WebSocket bytes over the turn, on the wire and of payloads
    # ws-rollout: payload bytes (UTF-8 JSON) of the suspension events: the `response.done` that
    # ended this turn, and the resumed `response.in_progress` that acknowledged it.
    done_bytes: int | None = None
    resume_bytes: int | None = None
    # What arrived: the events of the turn, their bytes (WebSocket message payloads, or the
    # server-sent-event stream over HTTP), and each output item's deltas against its final
    # text (`streams`, checked after the rollout: `check_streams`).
    events: int = 0
    bytes_in: int = 0
    streams: list[Stream] = attrs.field(factory=list)
    # The first delta's kind and text: its tokens arrive as the rate's clock starts.
    first_delta: tuple[str, str] | None = None
    received_tokens: int | None = None  # tokens counted in the deltas (None: no tokenizer)
    failure: str | None = None  # what the stream lost (the turn is no data point)
    # `encode_s`: seconds the server's codec takes to encode this turn's events, per event
    # (counting pass only: re-encoded in the benchmark's process, `measure_encoding`).
    frames: list[str] | None = None
    encode_s: float | None = None

    @property
    def bytes_per_event(self) -> float | None:
        return self.bytes_in / self.events if self.events else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def duration(self) -> float:
        return self.ended - self.sent

    @property
    def ack_latency(self) -> float | None:
        return None if self.acknowledged is None else self.acknowledged - self.sent

    @property
    def server_overhead(self) -> float | None:
        """The server's own pre-inference work: every stage but those that move the request's
        bytes, which grow with what the client sends (`TRANSPORT_STAGES`: the body's receipt,
        its JSON decode, reported apart as `decode`, and a model server's request sent)."""
        if self.stages is None:
            return None
        return sum(v for k, v in self.stages.items() if k not in TRANSPORT_STAGES)

    @property
    def decode(self) -> float | None:
        return None if self.stages is None else self.stages.get("decode")

    @property
    def tail(self) -> float | None:
        """Last output delta to the terminal event: post-inference work the client waits for
        (with `store: true`, the commit that makes the response durable)."""
        return None if self.last_token is None else self.ended - self.last_token


@attrs.define
class RolloutRecord:
    mode: str
    turns: list[TurnRecord] = attrs.field(factory=list)
    started: float = 0.0
    ended: float = 0.0
    transcript: list[str] = attrs.field(factory=list)  # the model's outputs, in order
    tool_s: float = 0.0  # time the client spent "running" tools (its sleeps, as measured)

    @property
    def duration(self) -> float:
        return self.ended - self.started

    @property
    def failures(self) -> list[str]:
        """What its streams lost, turn by turn (`_streams.check_streams`)."""
        return [f"turn {t.index}: {t.failure}" for t in self.turns if t.failure]

    def transcript_digest(self) -> str:
        """Equal for every mode when the server saw the same conversation."""
        return hashlib.sha256("\x00".join(self.transcript).encode()).hexdigest()[:16]
