"""rollout's performance goals, evaluated on a results document (reported, never asserted).

| id                       | goal                                                                 |
|--------------------------|----------------------------------------------------------------------|
| flat-overhead/MODE       | every mode's per-turn server overhead (its own work, the request's   |
|                          | JSON decode apart) at 95k+ history is at most 1.3x the overhead at   |
|                          | 0.5k-2k (long-context)                                               |
| stateless-vs-chain       | http-stateless per-turn ack latency (client-observed, request sent   |
|                          | to first event) at 95k+ history is at most 3x ws-chain's             |
| stateless-vs-own         | http-stateless per-turn ack latency at 95k+ history is at most 2x    |
|                          | its own at 0.5k-2k                                                   |
| near-limit/SCENARIO/TPS  | ws-rollout end-to-end within 5% of the physical limit at 1,000 tps,  |
|                          | within 10% at 4,000 tps (alpha-demo, codex-like)                     |
| keeps-pace               | with at least 16 concurrent ws-rollout rollouts at 4,000 tps, each   |
|                          | streams at >= 95% of the model's rate, its median turn within 10% of |
|                          | the model's own time, and none fails or loses tokens                 |
| flat-suspensions/bytes   | ws-rollout's last 5 suspensions (response.done + the resumed         |
|                          | response.in_progress) at most 1.05x the bytes of its first 5         |
|                          | (long-output, unpaced: 2 KB of arguments a step)                     |
| flat-suspensions/ack     | ... and their acknowledgement (append to the resume) at most 1.3x    |
"""

from __future__ import annotations

import math
from typing import Any

from ._stats import median

__all__ = [
    "HISTORY_WINDOWS",
    "OPENAI_REFERENCE",
    "SUSPENSION_WINDOW",
    "evaluate_goals",
    "suspensions",
    "window_label",
    "window_median",
]

OPENAI_REFERENCE = (
    "OpenAI (WebSocket mode for the Responses API): up to 40% faster end-to-end for agentic "
    "rollouts with many tool calls; 29% in their alpha demo of 20 tool calls"
)

LONG = "long-context"
# History windows (tokens before the turn): a figure "at" a window is the median over the
# turns whose history falls in it (both ends included), in the goals and in the per-turn
# overhead table alike, and both name the window the same way (`window_label`).
HISTORY_WINDOWS: tuple[tuple[float, float], ...] = (
    (500, 2_000),
    (8_000, 12_000),
    (45_000, 55_000),
    (95_000, math.inf),
)
LOW_HISTORY = HISTORY_WINDOWS[0]  # the goals' "short history"
HIGH_HISTORY = HISTORY_WINDOWS[-1]  # the goals' "long history"
FLAT_RATIO = 1.3
STATELESS_VS_CHAIN = 3.0  # http-stateless ack at 95k+ against ws-chain's
STATELESS_VS_OWN = 2.0  # http-stateless ack at 95k+ against its own at 0.5k-2k
LIMITS = {1000.0: 5.0, 4000.0: 10.0}
PACE_CONCURRENCY = 16
LONG_OUTPUT = "long-output"
FLAT_SUSPENSION_BYTES = 1.05  # the last suspensions' bytes against the first ones'
# Suspensions pooled at each end of a rollout ("the first 5", "the last 5").
SUSPENSION_WINDOW = 5

Suspension = tuple[int, float | None, float | None]


def suspensions(turns: list[dict[str, Any]]) -> list[Suspension]:
    """A ws-rollout's suspensions in order, from its per-turn records (one scenario, server and
    speed): the bytes of each (the `response.done` ending turn k plus the resumed
    `response.in_progress` acknowledging turn k + 1), the ack of turn k + 1 (append sent to the
    resume) and the tail of turn k (last output delta to `response.done`), each the median
    over repetitions."""
    by_turn = {t["turn"]: t for t in turns}
    out: list[Suspension] = []
    for k in sorted(by_turn):
        done, resumed = by_turn[k], by_turn.get(k + 1)
        if done["done_bytes"] is None or resumed is None or resumed["resume_bytes"] is None:
            continue
        ack, tail = resumed["ack_s"], done["tail_s"]
        out.append(
            (
                done["done_bytes"] + resumed["resume_bytes"],
                None if ack is None else float(ack["median"]),
                None if tail is None else float(tail["median"]),
            )
        )
    return out


def ends(found: list[Suspension], i: int) -> tuple[float | None, float | None]:
    """The median of value `i` over the first and over the last `SUSPENSION_WINDOW`
    suspensions (at most half of them each)."""
    n = min(SUSPENSION_WINDOW, len(found) // 2)

    def pooled(part: list[Suspension]) -> float | None:
        values = [float(v) for row in part if (v := row[i]) is not None]
        return median(values) if values else None

    return (pooled(found[:n]), pooled(found[-n:])) if n else (None, None)


def window_label(window: tuple[float, float]) -> str:
    """A history window as the tables and goals name it: "0.5k-2k", "95k+"."""
    lo, hi = window
    return f"{lo / 1000:g}k+" if math.isinf(hi) else f"{lo / 1000:g}k-{hi / 1000:g}k"


def window_median(
    turns: list[dict[str, Any]], window: tuple[float, float], key: str
) -> float | None:
    """The median of the turns' `key` medians (a stats field) over the turns whose history
    falls in `window`, or None when none does."""
    lo, hi = window
    values = [
        float(t[key]["median"])
        for t in turns
        if t.get(key) is not None and lo <= t["history_tokens"] <= hi
    ]
    return median(values) if values else None


def _overhead(
    turns: list[dict[str, Any]],
    server: str,
    mode: str,
    window: tuple[float, float],
    key: str = "server_overhead_s",
) -> float | None:
    """Median per-turn `key` (server overhead, or ack latency) of long-context turns in the
    history `window`: from the unpaced overhead phase when it ran (the server busy with
    nothing else), else from every speed."""
    mine = [
        t
        for t in turns
        if t["server"] == server
        and t["mode"] == mode
        and t["scenario"] == LONG
        and t.get(key) is not None
        and window[0] <= t["history_tokens"] <= window[1]
    ]
    unpaced = [t for t in mine if t["tps"] is None]
    return window_median(unpaced or mine, window, key)


def _ratio_goal(
    goal_id: str,
    server: str,
    description: str,
    high: float | None,
    low: float | None,
    limit: float,
    detail: str,
) -> dict[str, Any]:
    if high is None or low is None or low <= 0:
        return _goal(goal_id, server, description, None, limit, None, "not measured")
    ratio = high / low
    return _goal(
        goal_id,
        server,
        description,
        ratio,
        limit,
        ratio <= limit,
        detail.format(high=high * 1e3, low=low * 1e3, ratio=ratio),
    )


def _goal(
    goal_id: str,
    server: str,
    description: str,
    measured: Any,
    threshold: Any,
    met: bool | None,
    detail: str,
) -> dict[str, Any]:
    return {
        "id": goal_id,
        "server": server,
        "description": description,
        "measured": measured,
        "threshold": threshold,
        "met": met,
        "detail": detail,
    }


def _wave_summary(wave: dict[str, Any]) -> str:
    """K, the stream rate as a share of the model's and the turn excess; or what failed."""
    head = f"K={wave['concurrency']}: "
    if wave["turns_failed"]:
        return head + f"{wave['turns_failed']} turns lost output"
    if wave["rollouts_failed"]:
        return head + f"{wave['rollouts_failed']} rollouts failed"
    pace, excess = wave["pace_ratio"], wave["excess_ratio"]
    if pace is None or excess is None:
        return head + "not measured"
    return head + f"{pace * 100:.0f}%/+{excess * 100:.0f}%"


def evaluate_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []
    turns = results["turns"]
    for server in [s["label"] for s in results["servers"]]:
        low_at, high_at = window_label(LOW_HISTORY), window_label(HIGH_HISTORY)
        for mode in ("ws-chain", "ws-rollout", "http-stateless", "http-chain"):
            low = _overhead(turns, server, mode, LOW_HISTORY)
            high = _overhead(turns, server, mode, HIGH_HISTORY)
            if low is None and high is None and mode.startswith("http"):
                continue  # (a server benchmarked over WebSocket only)
            goals.append(
                _ratio_goal(
                    f"flat-overhead/{mode}",
                    server,
                    f"{mode} per-turn server overhead (decode apart) at {high_at} history <= "
                    f"{FLAT_RATIO}x the overhead at {low_at}",
                    high,
                    low,
                    FLAT_RATIO,
                    f"{{low:.3f}} ms at {low_at}, {{high:.3f}} ms at {high_at}: {{ratio:.2f}}x",
                )
            )
        ack_sl = _overhead(turns, server, "http-stateless", HIGH_HISTORY, "ack_s")
        goals.append(
            _ratio_goal(
                "stateless-vs-chain",
                server,
                f"http-stateless per-turn ack latency at {high_at} history <= "
                f"{STATELESS_VS_CHAIN:g}x ws-chain's",
                ack_sl,
                _overhead(turns, server, "ws-chain", HIGH_HISTORY, "ack_s"),
                STATELESS_VS_CHAIN,
                f"http-stateless {{high:.2f}} ms, ws-chain {{low:.2f}} ms at {high_at}: "
                "{ratio:.2f}x",
            )
        )
        goals.append(
            _ratio_goal(
                "stateless-vs-own",
                server,
                f"http-stateless per-turn ack latency at {high_at} history <= "
                f"{STATELESS_VS_OWN:g}x its own at {low_at}",
                ack_sl,
                _overhead(turns, server, "http-stateless", LOW_HISTORY, "ack_s"),
                STATELESS_VS_OWN,
                f"{{low:.2f}} ms at {low_at}, {{high:.2f}} ms at {high_at}: {{ratio:.2f}}x",
            )
        )
        for scenario in ("alpha-demo", "codex-like"):
            for tps, limit in LIMITS.items():
                found = [
                    r
                    for r in results["rollouts"]
                    if r["server"] == server
                    and r["mode"] == "ws-rollout"
                    and r["scenario"] == scenario
                    and r["tps"] == tps
                ]
                description = (
                    f"ws-rollout on {scenario} at {tps:g} tps within {limit:g}% of the physical "
                    "limit (model time + tool time)"
                )
                gid = f"near-limit/{scenario}/{tps:g}"
                if not found or found[0]["distance_pct"] is None:
                    goals.append(_goal(gid, server, description, None, limit, None, "not measured"))
                    continue
                r = found[0]
                pct = r["distance_pct"]
                goals.append(
                    _goal(
                        gid,
                        server,
                        description,
                        pct,
                        limit,
                        pct <= limit,
                        f"median {r['e2e_s']['median']:.3f} s vs limit "
                        f"{r['physical_limit_s']:.3f} s (+{pct:.2f}%, {r['repetitions']} runs)",
                    )
                )
        found = suspensions(
            [
                t
                for t in turns
                if t["server"] == server
                and t["mode"] == "ws-rollout"
                and t["scenario"] == LONG_OUTPUT
                and t["tps"] is None
            ]
        )
        # (_ratio_goal reports its values times 1,000: seconds as ms, and kB as bytes)
        for key, i, limit, what, detail in (
            ("bytes", 0, FLAT_SUSPENSION_BYTES, "bytes", "{low:.0f} B first, {high:.0f} B last"),
            ("ack", 1, FLAT_RATIO, "acknowledgement", "{low:.3f} ms first, {high:.3f} ms last"),
        ):
            first, last = ends(found, i)
            unit = 1e3 if i == 0 else 1.0
            goals.append(
                _ratio_goal(
                    f"flat-suspensions/{key}",
                    server,
                    f"ws-rollout's last {SUSPENSION_WINDOW} suspensions on {LONG_OUTPUT} "
                    f"(unpaced) at most {limit:g}x the {what} of its first {SUSPENSION_WINDOW}",
                    None if last is None else last / unit,
                    None if first is None else first / unit,
                    limit,
                    detail + ": {ratio:.3f}x",
                )
            )
        waves = sorted(
            (
                c
                for c in results["concurrency"]
                if c["server"] == server
                and c["mode"] == "ws-rollout"
                and c["tps"] == 4000.0
                and c["keeps_pace"] is not None
            ),
            key=lambda c: c["concurrency"],
        )
        description = (
            f"the server keeps pace with 4,000 tps per rollout for >= {PACE_CONCURRENCY} "
            "concurrent ws-rollout rollouts"
        )
        if not waves:
            goals.append(
                _goal(
                    "keeps-pace", server, description, None, PACE_CONCURRENCY, None, "not measured"
                )
            )
            continue
        kept = 0
        for wave in waves:
            if not wave["keeps_pace"] or wave["rollouts_failed"]:
                break
            kept = wave["concurrency"]
        tried = ", ".join(_wave_summary(w) for w in waves)
        met: bool | None = kept >= PACE_CONCURRENCY
        if not met and all(w["keeps_pace"] for w in waves):
            met = None  # never failed, but not tried at 16
        goals.append(
            _goal(
                "keeps-pace",
                server,
                description,
                kept,
                PACE_CONCURRENCY,
                met,
                f"largest K keeping pace: {kept} (stream rate as a share of the model's, and "
                f"median turn over the model's time: {tried})",
            )
        )
    return goals
