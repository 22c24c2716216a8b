"""What arrived: the tokens counted in the deltas a rollout received, checked against the
items' final text and the usage the server reported, and the cost of encoding its events.

A benchmark that trusted the scenario's nominal sizes would let a server that loses tokens
"keep pace": rates come from what is counted here instead, and a turn that lost anything is
a failure (reported, and never a data point).

**Counting.** With the `sim` model (the default), tokens are counted exactly as the sim counts
them: a message's text is a run of words from its vocabulary, one token each (so the count is
the number of words), and a call's arguments stream in 4-character pieces, one token each (so
the count is the characters / 4, rounded up). The sum is what the sim reports as
`usage.output_tokens`, so a turn's count must equal it (a rollout's, over all its turns,
equals its one response's usage). With another model (`--model`) the deltas' text is counted
in o200k tokens, an estimate of the model's own count: only the text is checked then.

**Checks**, per output item: its deltas, joined, must be the item's final text (the message's
`output_text`, the call's `arguments` in `response.output_item.done`).

**Encoding.** In the counting pass the client keeps each turn's events as received; after the
rollout, each is decoded and encoded again with rollout's wire codec (`rollout.protocol`, what
the server encodes its events with), timed in the benchmark's process: the seconds per event
the server's encoder spends on such a stream, not a measurement inside the server.
"""

from __future__ import annotations

import functools
import math
import time

from rollout.protocol import ProtocolError, decode_server_event, encode_json

from ._records import RolloutRecord, TurnRecord

__all__ = ["achieved_tps", "check_streams", "count_tokens", "measure_encoding"]

# The sim's arguments stream in pieces of this many characters, one token each.
SIM_ARGUMENT_CHARS = 4
# Encodings per event when timing the codec (the fastest is kept: the cost without noise).
ENCODE_REPEATS = 3


@functools.cache
def _o200k() -> object:
    from rollout.engine._tokenizer import O200kTokenizer

    return O200kTokenizer()


def count_tokens(kind: str, text: str, *, sim: bool) -> int:
    """Tokens in `text`, the deltas of a message (`kind` "text") or of a call's arguments."""
    if not text:
        return 0
    if sim:
        if kind == "text":
            return len(text.split())
        return math.ceil(len(text) / SIM_ARGUMENT_CHARS)
    tokenizer = _o200k()
    return len(tokenizer.encode(text))  # type: ignore[attr-defined]


def check_streams(record: RolloutRecord, *, sim: bool) -> None:
    """Count each turn's received tokens and note what its streams lost (`turn.failure`):
    deltas that do not add up to their item's text, and (with `sim`) a count that is not the
    usage. ws-rollout's one response has one usage: its turns' counts must add up to it."""
    total = 0
    for turn in record.turns:
        problems: list[str] = []
        tokens = 0
        for stream in turn.streams:
            tokens += count_tokens(stream.kind, stream.received, sim=sim)
            if stream.final is None:
                problems.append(f"deltas for {stream.item_id}, an item that never completed")
            elif stream.received != stream.final:
                problems.append(
                    f"the {stream.kind} deltas of {stream.item_id} add up to "
                    f"{len(stream.received)} characters, the item has {len(stream.final)}"
                )
        turn.received_tokens = tokens
        total += tokens
        per_turn_usage = record.mode != "ws-rollout"
        if sim and per_turn_usage and turn.output_tokens is not None:
            if tokens != turn.output_tokens:
                problems.append(
                    f"received {tokens} tokens, usage.output_tokens is {turn.output_tokens}"
                )
        turn.failure = "; ".join(problems) or None
    if sim and record.mode == "ws-rollout" and record.turns:
        last = record.turns[-1]
        usage = last.output_tokens
        if usage is not None and total != usage:
            problem = (
                f"the rollout received {total} tokens over its turns, "
                f"usage.output_tokens is {usage}"
            )
            last.failure = f"{last.failure}; {problem}" if last.failure else problem


def _first_tokens(turn: TurnRecord, *, sim: bool) -> int:
    if turn.first_delta is None:
        return 0
    kind, text = turn.first_delta
    return count_tokens(kind, text, sim=sim)


def achieved_tps(record: RolloutRecord, *, sim: bool = True) -> float | None:
    """Tokens per second the client received while tokens streamed: over every turn with at
    least two deltas, (tokens counted after the first delta) / (last delta - first delta).
    None when no turn streamed, or a turn lost tokens (`check_streams` first)."""
    if record.failures:
        return None
    tokens = 0
    seconds = 0.0
    for turn in record.turns:
        if (
            turn.deltas >= 2
            and turn.first_token is not None
            and turn.last_token is not None
            and turn.received_tokens is not None
        ):
            tokens += turn.received_tokens - _first_tokens(turn, sim=sim)
            seconds += turn.last_token - turn.first_token
    if seconds <= 0:
        return None
    return tokens / seconds


def measure_encoding(turn: TurnRecord, *, sse: bool) -> None:
    """Time the wire codec on the turn's kept events (`turn.encode_s`, seconds per event),
    then let the events go. Frames outside the protocol's grammar (`rollout.timing`) are
    skipped."""
    frames, turn.frames = turn.frames, None
    if not frames:
        return
    events = []
    for frame in frames:
        try:
            events.append(decode_server_event(frame, sse=sse))
        except (ProtocolError, ValueError):
            continue
    if not events:
        return
    best = math.inf
    for _ in range(ENCODE_REPEATS):
        start = time.perf_counter()
        for event in events:
            encode_json(event)
        best = min(best, time.perf_counter() - start)
    turn.encode_s = best / len(events)
