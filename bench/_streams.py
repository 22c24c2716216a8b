"""What arrived: the text of the deltas a rollout received, checked against the items' final
text; its tokens, counted where the benchmark knows how and set against the usage the server
reported; and the cost of encoding its events.

A benchmark that trusted the scenario's nominal sizes would let a server that loses output
"keep pace": rates come from what arrived instead, and a turn that lost anything is a failure
(reported, and never a data point).

**Checks**, per output item, whatever the model: its deltas, joined, must be the item's final
text (the message's `output_text`, the call's `arguments` in `response.output_item.done`).

**Counting** (`_tokens.py`). With the `sim` model (the default) the count is exact by
construction, and must equal `usage.output_tokens` (a rollout's, over all its turns, equals its
one response's usage): a count that differs is a lost token. With a tokenizer the user names,
the count is a figure beside the usage (`output_tokens_received` against
`output_tokens_reported`), never a failure. Without one, the server's usage is the count.

**Encoding.** In the counting pass the client keeps each turn's events as received; after the
rollout, each is decoded and encoded again with rollout's wire codec (`rollout.protocol`, what
the server encodes its events with), timed in the benchmark's process: the seconds per event
the server's encoder spends on such a stream, not a measurement inside the server.
"""

from __future__ import annotations

import math
import time

from rollout.protocol import ProtocolError, decode_server_event, encode_json

from ._records import RolloutRecord, TurnRecord
from ._tokens import TokenCounter

__all__ = ["achieved_tps", "check_streams", "measure_encoding"]

# Encodings per event when timing the codec (the fastest is kept: the cost without noise).
ENCODE_REPEATS = 3


def check_streams(record: RolloutRecord, counter: TokenCounter | None) -> None:
    """Check each turn's streams and note what they lost (`turn.failure`): deltas that do not
    add up to their item's text, always; with an exact counter (the sim's), a count that is not
    the usage (ws-rollout's one response has one usage: its turns' counts must add up to it).
    With a counter, `turn.received_tokens` is the count."""
    exact = counter is not None and counter.exact
    total = 0
    for turn in record.turns:
        problems: list[str] = []
        tokens = 0
        for stream in turn.streams:
            if counter is not None:
                tokens += counter.count(stream.kind, stream.received)
            if stream.final is None:
                problems.append(f"deltas for {stream.item_id}, an item that never completed")
            elif stream.received != stream.final:
                problems.append(
                    f"the {stream.kind} deltas of {stream.item_id} add up to "
                    f"{len(stream.received)} characters, the item has {len(stream.final)}"
                )
        turn.received_tokens = tokens if counter is not None else None
        total += tokens
        per_turn_usage = record.mode != "ws-rollout"
        if exact and per_turn_usage and turn.output_tokens is not None:
            if tokens != turn.output_tokens:
                problems.append(
                    f"received {tokens} tokens, usage.output_tokens is {turn.output_tokens}"
                )
        turn.failure = "; ".join(problems) or None
    if exact and record.mode == "ws-rollout" and record.turns:
        last = record.turns[-1]
        usage = last.output_tokens
        if usage is not None and total != usage:
            problem = (
                f"the rollout received {total} tokens over its turns, "
                f"usage.output_tokens is {usage}"
            )
            last.failure = f"{last.failure}; {problem}" if last.failure else problem


def achieved_tps(record: RolloutRecord, counter: TokenCounter | None) -> float | None:
    """Tokens per second the client received while tokens streamed: over every turn with at
    least two deltas, (tokens after the first delta) / (last delta - first delta). Tokens are
    counted with `counter`; without one they are the server's usage, less one token for each
    turn's first delta (a streamed delta is a token for servers that stream as they sample).
    None when no turn streamed, the tokens are unknown, or a turn lost output
    (`check_streams` first)."""
    if record.failures:
        return None
    tokens = 0
    seconds = 0.0
    if counter is None:
        streamed = [t for t in record.turns if t.deltas >= 2]
        if record.mode == "ws-rollout":  # one response: its usage, at the end, is every turn's
            usage = record.turns[-1].output_tokens if record.turns else None
            if usage is None:
                return None
            tokens = usage - len(streamed)
        else:
            streamed = [t for t in streamed if t.output_tokens is not None]
            tokens = sum((t.output_tokens or 0) - 1 for t in streamed)
        seconds = sum((t.last_token or 0.0) - (t.first_token or 0.0) for t in streamed)
        return tokens / seconds if seconds > 0 and streamed else None
    for turn in record.turns:
        if (
            turn.deltas >= 2
            and turn.first_token is not None
            and turn.last_token is not None
            and turn.received_tokens is not None
        ):
            first = counter.count(*turn.first_delta) if turn.first_delta else 0
            tokens += turn.received_tokens - first
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
