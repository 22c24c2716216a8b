"""The summary tables (terminal and Markdown) and the results files.

Long because each measured quantity gets its own table (end to end, overhead by history window,
transport, suspension, durability, deflate, concurrency, goals), in both terminal and Markdown
form.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from statistics import median as _median
from typing import Any, TextIO

import attrs
from rich.markup import escape

from ._client import MODES
from ._goals import (
    HIGH_HISTORY,
    HISTORY_WINDOWS,
    LOW_HISTORY,
    OPENAI_REFERENCE,
    SUSPENSION_WINDOW,
    ends,
    suspensions,
    window_label,
    window_median,
)
from ._load import load_warning
from ._schema import RESULTS_SCHEMA

__all__ = [
    "Table",
    "print_summary",
    "print_tables",
    "summary_tables",
    "table_width",
    "to_markdown",
    "verdict",
    "write_results",
]

# Modes whose responses are stored (store: true): the durability table marks them.
STORED_MODES = frozenset({"http-chain", "ws-chain-stored"})
# Modes the transport table reports (ws-chain-stored's frames are ws-chain's).
TRANSPORT_MODES = ("ws-chain", "ws-rollout")


@attrs.frozen
class Table:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""


def _ms(seconds: float | None, digits: int = 2) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f}"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}%" if signed else f"{value:.1f}%"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def _tps(tps: float | None) -> str:
    return "unpaced" if tps is None else f"{tps:g}"


def _med(stats: dict[str, Any] | None) -> float | None:
    return None if stats is None else float(stats["median"])


def _p(stats: dict[str, Any] | None, key: str) -> float | None:
    return None if stats is None else float(stats[key])


def _e2e_table(results: dict[str, Any], server: str) -> Table | None:
    rows = []
    for r in results["rollouts"]:
        if r["server"] != server or (r["tps"] is None and r["ttft_ms"] is not None):
            continue  # the unpaced overhead phase of the sim (a --model point is kept)
        rows.append(
            (
                r["scenario"],
                _tps(r["tps"]),
                r["mode"],
                str(r["repetitions"]),
                str(r["turns"]),
                _s(_med(r["e2e_s"])),
                _s(_p(r["e2e_s"], "p90")),
                _s(r["physical_limit_s"]),
                _pct(r["distance_pct"], signed=True),
                _pct(r["reduction_vs_http_stateless_pct"]),
                _ms(_med(r["server_overhead_s"]), 1),
                _s(_med(r["server_cpu_s"])),
                _mb(r["server_peak_rss_bytes"]),
            )
        )
    if not rows:
        return None
    return Table(
        title=f"[{server}] End-to-end rollout time by model speed (medians)",
        headers=(
            "scenario",
            "tps",
            "mode",
            "runs",
            "turns",
            "e2e s",
            "p90 s",
            "limit s",
            "vs limit",
            "cut vs stateless",
            "server ms/rollout",
            "server CPU s",
            "peak MB",
        ),
        rows=tuple(rows),
        note="limit: model time (TTFT + output/tps per turn) + tool time. "
        f"Reference: {OPENAI_REFERENCE}.",
    )


def _reduction_table(results: dict[str, Any], server: str) -> Table | None:
    """End-to-end time saved vs http-stateless, per scenario and model speed."""
    by_key = {
        (r["scenario"], r["tps"], r["mode"]): r
        for r in results["rollouts"]
        if r["server"] == server and r["tps"] is not None
    }
    modes = tuple(m for m in MODES if m != "http-stateless")
    rows = []
    for scenario, tps in sorted({(k[0], k[1]) for k in by_key}, key=lambda k: (k[0], k[1])):
        base = by_key.get((scenario, tps, "http-stateless"))
        if base is None:
            continue
        cells = [scenario, _tps(tps), _s(_med(base["e2e_s"]))]
        for mode in modes:
            r = by_key.get((scenario, tps, mode))
            cells.append("-" if r is None else _pct(r["reduction_vs_http_stateless_pct"]))
        rows.append(tuple(cells))
    if not rows:
        return None
    return Table(
        title=f"[{server}] End-to-end time saved vs http-stateless (medians)",
        headers=("scenario", "tps", "http-stateless e2e s", *modes),
        rows=tuple(rows),
        note=f"For comparison: {OPENAI_REFERENCE}.",
    )


def _overhead_table(results: dict[str, Any], server: str) -> Table | None:
    turns = [t for t in results["turns"] if t["server"] == server]
    if not turns:
        return None
    # Prefer long-context unpaced; else whatever scenario reaches furthest.
    scenarios = sorted(
        {(t["scenario"], t["tps"]) for t in turns},
        key=lambda st: (
            st[0] != "long-context",
            st[1] is not None,
            -max(t["history_tokens"] for t in turns if (t["scenario"], t["tps"]) == st),
        ),
    )
    scenario, tps = scenarios[0]
    first, last = HISTORY_WINDOWS[0], HISTORY_WINDOWS[-1]
    rows = []
    for mode in MODES:
        mine = [
            t for t in turns if t["mode"] == mode and (t["scenario"], t["tps"]) == (scenario, tps)
        ]
        if not mine:
            continue
        cells = [mode]
        cells += [_ms(window_median(mine, w, "server_overhead_s"), 3) for w in HISTORY_WINDOWS]
        cells += [_ms(window_median(mine, w, "decode_s"), 2) for w in (first, last)]
        cells += [_ms(window_median(mine, w, "ack_s"), 2) for w in HISTORY_WINDOWS]
        # the /metrics delta of each turn, as window_median reads a figure
        rendered = [
            {"history_tokens": t["history_tokens"], "n": {"median": counters["tokens_rendered"]}}
            for t in mine
            if (counters := t["counters"]) and "tokens_rendered" in counters
        ]
        for w in (first, last):
            value = window_median(rendered, w, "n")
            cells.append("-" if value is None else f"{value:.0f}")
        rows.append(tuple(cells))
    cols = [window_label(w) for w in HISTORY_WINDOWS]
    return _without_empty_columns(
        title=f"[{server}] Per-turn pre-inference overhead by history window ({scenario}, "
        f"{'unpaced model' if tps is None else f'{tps:g} tps'}; each cell the median over the "
        "turns whose history before the turn is in the window)",
        headers=(
            "mode",
            *(f"server ms {c}" for c in cols),
            f"decode ms {cols[0]}",
            f"decode ms {cols[-1]}",
            *(f"ack ms {c}" for c in cols),
            f"tokens rendered {cols[0]}",
            f"tokens rendered {cols[-1]}",
        ),
        rows=tuple(rows),
        note="server ms: the server's own stage timings (resolve, validate, render, classify, "
        "route, lookup, store; not the body's receipt, its decode or a model server's request "
        "sent, which move bytes); decode ms: its JSON decode and structuring of the request, "
        "which grows with what the client sends; ack ms: client-observed, request sent to response "
        "acknowledged (adds transport and event encoding); tokens rendered: /metrics counter "
        f"delta for that turn. History windows in tokens; {window_label(LOW_HISTORY)} and "
        f"{window_label(HIGH_HISTORY)} are the goals' (the same figures).",
    )


def _without_empty_columns(
    *, title: str, headers: tuple[str, ...], rows: tuple[tuple[str, ...], ...], note: str
) -> Table:
    """The table without the columns no row has a value in (history sizes a run's scenarios
    never reached, say)."""
    keep = [i for i in range(len(headers)) if not rows or any(row[i] != "-" for row in rows)]
    return Table(
        title=title,
        headers=tuple(headers[i] for i in keep),
        rows=tuple(tuple(row[i] for i in keep) for row in rows),
        note=note,
    )


def _durability_table(results: dict[str, Any], server: str) -> Table | None:
    """What `store: true` costs a turn: the tail (last delta to terminal event), where the
    commit before the acknowledgement shows, per mode, on the unpaced model."""
    turns = [t for t in results["turns"] if t["server"] == server and t["tps"] is None]
    rows = []
    tails: dict[tuple[str, str], float] = {}
    for scenario in sorted({t["scenario"] for t in turns}):
        for mode in MODES:
            mine = [t for t in turns if t["mode"] == mode and t["scenario"] == scenario]
            tail = [v for t in mine if (v := _med(t["tail_s"])) is not None]
            if not tail:
                continue
            tails[(scenario, mode)] = _median(tail)
            rows.append(
                (
                    scenario,
                    mode,
                    "yes" if mode in STORED_MODES else "no",
                    str(len(mine)),
                    _ms(_median(tail), 3),
                    _ms(_median([_p(t["turn_s"], "median") or 0.0 for t in mine]), 2),
                    _ms(_median([v for t in mine if (v := _p(t["tail_s"], "p90")) is not None])),
                )
            )
    if not rows:
        return None
    costs = []
    for scenario in sorted({k[0] for k in tails}):
        stored, plain = tails.get((scenario, "ws-chain-stored")), tails.get((scenario, "ws-chain"))
        if stored is not None and plain is not None:
            costs.append(f"{scenario}: {_ms(stored - plain, 3)} ms")
    return Table(
        title=f"[{server}] Durable acknowledgement: per-turn tail (unpaced model; medians)",
        headers=("scenario", "mode", "store", "turns", "tail ms", "turn ms", "tail p90 ms"),
        rows=tuple(rows),
        note="tail: last output delta to the terminal event, client-observed. rollout sends a "
        "terminal event once the response's usage (and, with store: true, the response) is "
        "committed (group commit); a rollout's suspensions (response.done) commit nothing, its "
        "one response commits once at the end. store: true over store: false on one WebSocket "
        f"(ws-chain-stored minus ws-chain): {'; '.join(costs) or 'not measured'}.",
    )


def _kb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1000:.2f}"


def _transport_table(results: dict[str, Any]) -> Table | None:
    """Per-turn client-observed latency and bytes on the wire, every server side by side, on
    the unpaced model: each scenario's first follow-up turn and its last turn."""
    deflate = {s["label"]: s["websocket_deflate"] for s in results["servers"]}
    order = {s["label"]: i for i, s in enumerate(results["servers"])}
    turns = [t for t in results["turns"] if t["tps"] is None and t["mode"] in TRANSPORT_MODES]
    rows = []
    for scenario in sorted({t["scenario"] for t in turns}):
        mine = [t for t in turns if t["scenario"] == scenario]
        last = max(t["turn"] for t in mine)
        for index in sorted({min(1, last), last}):
            for mode in TRANSPORT_MODES:
                picked = sorted(
                    (t for t in mine if t["turn"] == index and t["mode"] == mode),
                    key=lambda t: order.get(t["server"], 0),
                )
                for t in picked:
                    rows.append(
                        (
                            scenario,
                            str(index),
                            f"{t['history_tokens']:,}",
                            mode,
                            t["server"],
                            {True: "on", False: "off", None: "-"}[deflate.get(t["server"])],
                            _ms(_med(t["ack_s"])),
                            _ms(_med(t["ttft_s"])),
                            _ms(_med(t["turn_s"])),
                            _kb(t["payload_out_bytes"]),
                            _kb(t["wire_out_bytes"]),
                            _kb(t["payload_in_bytes"]),
                            _kb(t["wire_in_bytes"]),
                        )
                    )
    if not rows:
        return None
    return Table(
        title="WebSocket transport: per-turn latency and bytes by server",
        headers=(
            "scenario",
            "turn",
            "history",
            "mode",
            "server",
            "deflate",
            "ack ms",
            "first token ms",
            "turn ms",
            "sent KB",
            "sent wire KB",
            "received KB",
            "received wire KB",
        ),
        rows=tuple(rows),
        note="Unpaced model, medians. ack: request sent to response.created (or the resumed "
        "response.in_progress); first token: to the first output delta; turn: to the terminal "
        "event. sent / received: the messages' payload bytes (UTF-8 JSON) and the bytes on the "
        "wire (frames, compressed when the server accepted the client's permessage-deflate "
        "offer: deflate on).",
    )


def _suspension_table(results: dict[str, Any], server: str) -> Table | None:
    """ws-rollout's suspensions early and late in the rollout: their bytes and times must not
    grow with it (PROTOCOL.md RX-2.5), whatever the model wrote before."""
    turns = [t for t in results["turns"] if t["server"] == server and t["mode"] == "ws-rollout"]
    rows = []
    for scenario, tps in sorted(
        {(t["scenario"], t["tps"]) for t in turns},
        key=lambda k: (k[0], k[1] is not None, k[1] or 0.0),
    ):
        mine = [t for t in turns if (t["scenario"], t["tps"]) == (scenario, tps)]
        found = suspensions(mine)
        if len(found) < 2:
            continue
        bytes_early, bytes_late = ends(found, 0)
        (ack_early, ack_late), (tail_early, tail_late) = ends(found, 1), ends(found, 2)
        rows.append(
            (
                scenario,
                _tps(tps),
                str(len(found)),
                f"{max(t['history_tokens'] for t in mine):,}",
                "-" if bytes_early is None else f"{bytes_early:.0f}",
                "-" if bytes_late is None else f"{bytes_late:.0f}",
                "-"
                if bytes_early is None or bytes_late is None
                else f"{bytes_late - bytes_early:+.0f}",
                _ms(ack_early, 3),
                _ms(ack_late, 3),
                _ms(tail_early, 3),
                _ms(tail_late, 3),
            )
        )
    if not rows:
        return None
    return Table(
        title=f"[{server}] ws-rollout suspensions, first {SUSPENSION_WINDOW} vs last "
        f"{SUSPENSION_WINDOW} (medians)",
        headers=(
            "scenario",
            "tps",
            "suspensions",
            "final history",
            "bytes first",
            "bytes last",
            "bytes growth",
            "ack ms first",
            "ack ms last",
            "done tail ms first",
            "done tail ms last",
        ),
        rows=tuple(rows),
        note="bytes: a suspension's response.done plus the resumed response.in_progress "
        "(payload, UTF-8 JSON), client-observed; ack: append sent to the resumed "
        "response.in_progress; done tail: the last output delta to response.done. A rollout "
        "that re-sent the response so far would grow by every item of every step (2 KB a step "
        "in long-output); the extension names the response instead (PROTOCOL.md RX-2.2).",
    )


def _pooled(turns: list[dict[str, Any]], key: str) -> float | None:
    """The median over turns of a per-turn value (a stats object's median, or a number)."""
    values = [v["median"] if isinstance(v, dict) else v for t in turns if (v := t[key]) is not None]
    return _median(values) if values else None


def _deflate_table(results: dict[str, Any]) -> Table | None:
    """What permessage-deflate costs (or saves) a turn: one server with it, one without, the
    difference of their medians over every follow-up turn of a scenario (the transport's cost
    depends on the messages' sizes, not on the history; pooling the turns steadies it)."""
    on = [s["label"] for s in results["servers"] if s["websocket_deflate"] is True]
    off = [s["label"] for s in results["servers"] if s["websocket_deflate"] is False]
    if len(on) != 1 or len(off) != 1:
        return None
    rows = []
    turns = [t for t in results["turns"] if t["mode"] in TRANSPORT_MODES and t["turn"] >= 1]
    for scenario, tps in sorted(
        {(t["scenario"], t["tps"]) for t in turns}, key=lambda k: (k[1] is not None, k)
    ):
        for mode in TRANSPORT_MODES:
            mine = [
                t for t in turns if (t["scenario"], t["tps"], t["mode"]) == (scenario, tps, mode)
            ]
            with_ = [t for t in mine if t["server"] == on[0]]
            without = [t for t in mine if t["server"] == off[0]]
            if not with_ or not without:
                continue
            cells = [scenario, _tps(tps), mode, str(min(len(with_), len(without)))]
            for direction in ("out", "in"):
                payload = _pooled(with_, f"payload_{direction}_bytes")
                wire = _pooled(with_, f"wire_{direction}_bytes")
                cells.append(_kb(None if payload is None else round(payload)))
                cells.append("-" if not payload or not wire else f"{payload / wire:.1f}x")
            for key in ("ack_s", "ttft_s", "turn_s"):
                a, b = _pooled(with_, key), _pooled(without, key)
                cells.append(_ms(b))
                cells.append("-" if a is None or b is None else f"{(a - b) * 1000:+.2f}")
            rows.append(tuple(cells))
    if not rows:
        return None
    return Table(
        title=f"permessage-deflate per turn: {on[0]} (on) vs {off[0]} (off), follow-up turns",
        headers=(
            "scenario",
            "tps",
            "mode",
            "turns",
            "sent KB",
            "sent ratio",
            "received KB",
            "received ratio",
            "ack ms off",
            "ack on-off ms",
            "first token ms off",
            "first token on-off ms",
            "turn ms off",
            "turn on-off ms",
        ),
        rows=tuple(rows),
        note="Medians over the follow-up turns of the per-turn medians, client-observed. "
        "ratio: payload bytes over bytes on the wire with deflate on (without it the wire "
        "carries the payload plus frame headers). on-off: positive when deflate is slower.",
    )


def _concurrency_table(results: dict[str, Any], server: str) -> Table | None:
    rows = []
    for c in results["concurrency"]:
        if c["server"] != server:
            continue
        rows.append(
            (
                c["mode"],
                _tps(c["tps"]),
                str(c["concurrency"]),
                f"{c['rollouts_ok']}/{c['rollouts_ok'] + c['rollouts_failed']}",
                "-"
                if c["throughput_rollouts_per_s"] is None
                else f"{c['throughput_rollouts_per_s']:.2f}",
                "-"
                if c["throughput_output_tokens_per_s"] is None
                else f"{c['throughput_output_tokens_per_s']:.0f}",
                _ms(_med(c["ttft_s"]), 1),
                _ms(_p(c["ttft_s"], "p99"), 1),
                _ms(_med(c["turn_s"]), 1),
                _ms(_p(c["turn_s"], "p99"), 1),
                "-" if c["pace_ratio"] is None else f"{c['pace_ratio'] * 100:.0f}%",
                "-" if c["excess_ratio"] is None else f"+{c['excess_ratio'] * 100:.1f}%",
                {True: "yes", False: "NO", None: "-"}[c["keeps_pace"]],
                "-"
                if c["server_cpu_utilization"] is None
                else f"{c['server_cpu_utilization'] * 100:.0f}%",
                f"{c['client_cpu_s'] / c['wall_s'] * 100:.0f}%" if c["wall_s"] else "-",
            )
        )
    if not rows:
        return None
    return Table(
        title=f"[{server}] Concurrent rollouts",
        headers=(
            "mode",
            "tps",
            "K",
            "ok",
            "rollouts/s",
            "tokens/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "turn p50 ms",
            "turn p99 ms",
            "stream rate",
            "turn excess",
            "keeps pace",
            "server CPU",
            "client CPU",
        ),
        rows=tuple(rows),
        note="stream rate: tokens/s each rollout received while its output streamed, as a "
        "share of the model's tps (median over rollouts); turn excess: median turn time over "
        "the model's own (TTFT + output/tps); keeps pace: stream rate >= 95% and turn excess "
        "<= 10%. Rollouts start spread over one turn. CPU: share of one core over the wave.",
    )


def _goals_table(results: dict[str, Any]) -> Table | None:
    rows = []
    for g in results["goals"]:
        met = {True: "met", False: "MISSED", None: "n/a"}[g["met"]]
        measured = g["measured"]
        rows.append(
            (
                g["server"],
                g["id"],
                met,
                "-" if measured is None else f"{measured:.3g}",
                f"{g['threshold']:g}",
                g["detail"],
            )
        )
    if not rows:
        return None
    return Table(
        title=GOALS_TITLE,
        headers=("server", "goal", "status", "measured", "threshold", "detail"),
        rows=tuple(rows),
        note=load_warning(results) or "",
    )


GOALS_TITLE = (
    f"Goals (measured, not asserted; history windows {window_label(LOW_HISTORY)} and "
    f"{window_label(HIGH_HISTORY)}, as in the per-turn overhead table)"
)
STATUS = {True: "met", False: "MISSED", None: "n/a"}
# Goals met at or above their threshold (the others at or below it).
AT_LEAST = frozenset({"keeps-pace"})


def verdict(results: dict[str, Any]) -> str:
    """One line: how many goals were met, which were missed, and whether the machine was
    loaded (then the goals are not to be trusted)."""
    line = _goals_count(results)
    warning = load_warning(results)
    if warning:
        line += f"; {warning}"
    elif results["meta"].get("machine_load") is None:
        line += "; whether the machine was loaded was not recorded"
    if results["meta"]["interrupted"]:
        line += "; the run was interrupted (these are the rollouts that finished)"
    return line


def _goals_count(results: dict[str, Any]) -> str:
    goals = results["goals"]
    missed = [g for g in goals if g["met"] is False]
    met = sum(1 for g in goals if g["met"])
    unmeasured = sum(1 for g in goals if g["met"] is None)
    several = len(results["servers"]) > 1
    names = [f"{g['server']}: {g['id']}" if several else g["id"] for g in missed]
    line = f"{met} of {len(goals)} goals met"
    if missed:
        line += f", {len(missed)} MISSED ({', '.join(names)})"
    if unmeasured:
        line += f", {unmeasured} not measured"
    return line


def _goal_lines(results: dict[str, Any]) -> list[str]:
    """One line per goal met or missed (its measure and threshold); the goals not measured
    in one line per server."""
    several = len(results["servers"]) > 1

    def name(goal: dict[str, Any]) -> str:
        return f"{goal['server']}: {goal['id']}" if several else goal["id"]

    measured = [g for g in results["goals"] if g["met"] is not None]
    width = max((len(name(g)) for g in measured), default=0)
    lines = []
    for goal in measured:
        bound = "at least" if goal["id"] in AT_LEAST else "at most"
        lines.append(
            f"  {STATUS[goal['met']]:<6}  {name(goal):<{width}}  {goal['measured']:.3g} "
            f"({bound} {goal['threshold']:g})"
        )
    for server in [s["label"] for s in results["servers"]]:
        missing = [g["id"] for g in results["goals"] if g["server"] == server and g["met"] is None]
        if missing:
            where = f" on {server}" if several else ""
            lines.append(f"  n/a     not measured{where}: {', '.join(missing)}")
    return lines


def print_summary(
    results: dict[str, Any],
    outputs: Sequence[str],
    *,
    file: TextIO | None = None,
) -> None:
    """The short report of a run: the verdict, the machine, one line per goal, where the
    results went (`outputs`, lines), and the verdict again, last. Every table is in
    summary.md (`rollout bench --verbose` prints them too)."""
    out = file if file is not None else sys.stdout
    line = verdict(results)
    loaded = "; THE MACHINE WAS LOADED" if load_warning(results) else ""
    lines = [
        f"rollout bench: {_goals_count(results)}{loaded} (the verdict is at the end; every "
        "table is in summary.md, or printed with --verbose)",
        f"Machine: {machine_line(results)}",
        f"{GOALS_TITLE}:",
        *_goal_lines(results),
    ]
    notes = sum(len(s["notes"]) for s in results["servers"])
    if notes:
        lines.append(f"notes:   {notes} on the servers (in summary.md)")
    lines += [*outputs, f"Verdict: {line}"]
    out.write("\n".join(lines) + "\n")


NOT_MEASURED = "not measured"


def _cell_missing(server: dict[str, Any], mode: str) -> str:
    """A side-by-side cell with no figure: the mode could not run there, or it failed."""
    if mode in server.get("not_measured", {}):
        return NOT_MEASURED
    return "failed" if mode not in server["modes"] else "-"


def _why_not(servers: Sequence[dict[str, Any]]) -> str:
    """One sentence per server that could not run some modes: which, and the evidence."""
    parts = []
    for server in servers:
        by_reason: dict[str, list[str]] = {}
        for mode, why in server.get("not_measured", {}).items():
            by_reason.setdefault(why, []).append(mode)
        for why, modes in by_reason.items():
            parts.append(f"{server['label']}: {', '.join(modes)} {NOT_MEASURED} ({why}).")
        if not server["metrics"]:
            parts.append(f"{server['label']}: no rollout /metrics: server-side time not measured.")
    return " ".join(parts)


def _side_by_side_table(results: dict[str, Any]) -> Table | None:
    """Every server's per-turn and whole-rollout time for each point and mode, side by side,
    with what could not be measured and why: the comparison a user asks for."""
    servers = results["servers"]
    if len(servers) < 2:
        return None
    rollouts = {(r["server"], r["scenario"], r["tps"], r["mode"]): r for r in results["rollouts"]}
    turn_s: dict[tuple[str, str, float | None, str], list[float]] = {}
    for t in results["turns"]:
        turn_s.setdefault((t["server"], t["scenario"], t["tps"], t["mode"]), []).append(
            t["turn_s"]["median"]
        )
    rows = []
    for point in results["meta"]["parameters"]["points"]:
        for mode in [m for m in MODES if m in point["modes"]]:
            cells = []
            for server in servers:
                key = (server["label"], point["scenario"], point["tps"], mode)
                r = rollouts.get(key)
                if r is None:
                    cells.append(_cell_missing(server, mode))
                    continue
                cells.append(f"{_ms(_median(turn_s[key]), 1)} / {_s(_med(r['e2e_s']))}")
            if any(c not in ("-", NOT_MEASURED) for c in cells):
                rows.append((point["scenario"], _tps(point["tps"]), mode, *cells))
    if not rows:
        return None
    return Table(
        title="Side by side: median turn ms / median rollout s, by server",
        headers=("scenario", "tps", "mode", *(s["label"] for s in servers)),
        rows=tuple(rows),
        note="turn: the client's send to the turn's last event, the median over a rollout's "
        "turns; rollout: end to end. " + _why_not(servers),
    )


def _side_by_side_concurrency(results: dict[str, Any]) -> Table | None:
    servers = results["servers"]
    if len(servers) < 2 or not results["concurrency"]:
        return None
    waves = {(c["server"], c["mode"], c["concurrency"]): c for c in results["concurrency"]}
    rows = []
    for mode in results["meta"]["parameters"]["concurrency_modes"]:
        for k in results["meta"]["parameters"]["concurrency"]:
            cells = []
            for server in servers:
                c = waves.get((server["label"], mode, k))
                if c is None:
                    cells.append(_cell_missing(server, mode))
                    continue
                rate = c["throughput_rollouts_per_s"]
                cells.append(
                    f"{'-' if rate is None else f'{rate:.2f}'}/s, {c['rollouts_ok']}/{k} ok"
                )
            rows.append((mode, str(k), *cells))
    return Table(
        title="Side by side: concurrent rollouts, throughput and rollouts completed",
        headers=("mode", "K", *(s["label"] for s in servers)),
        rows=tuple(rows),
    )


def summary_tables(results: dict[str, Any]) -> list[Table]:
    tables: list[Table | None] = [
        _side_by_side_table(results),
        _side_by_side_concurrency(results),
    ]
    for server in [s["label"] for s in results["servers"]]:
        tables += [
            _overhead_table(results, server),
            _durability_table(results, server),
            _suspension_table(results, server),
            _e2e_table(results, server),
            _reduction_table(results, server),
            _concurrency_table(results, server),
        ]
    tables.append(_transport_table(results))
    tables.append(_deflate_table(results))
    tables.append(_goals_table(results))
    return [t for t in tables if t is not None]


def machine_line(results: dict[str, Any]) -> str:
    m = results["meta"]["machine"]
    mem = m["memory_bytes"]
    return (
        f"{m['cpu_model'] or m['machine']}, {m['cpu_count']} CPUs"
        + (f", {mem / 2**30:.0f} GiB" if mem else "")
        + f"; {m['platform']}; Python {m['python']}"
        + _load(results)
        + f"; preset {results['meta']['parameters']['preset']}, "
        f"{results['meta']['duration_s']:.0f} s, {results['meta']['finished_at']}"
    )


def _load(results: dict[str, Any]) -> str:
    load = results["meta"]["load_average"]
    if load["start"] is None or load["end"] is None:
        return ""
    return f"; load average {load['start'][0]:.2f} at start, {load['end'][0]:.2f} at end"


def to_markdown(results: dict[str, Any], tables: Sequence[Table]) -> str:
    lines = [f"Verdict: {verdict(results)}", "", f"Machine: {machine_line(results)}", ""]
    for server in results["servers"]:
        if server["notes"]:
            lines.append(
                f"Server `{server['label']}` ({server['url']}): " + "; ".join(server["notes"])
            )
            lines.append("")
    for table in tables:
        lines.append(f"**{table.title}**")
        lines.append("")
        lines.append("| " + " | ".join(table.headers) + " |")
        lines.append("|" + "|".join("---" for _ in table.headers) + "|")
        for row in table.rows:
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
        if table.note:
            lines.append("")
            lines.append(table.note)
        lines.append("")
    return "\n".join(lines)


def print_tables(
    results: dict[str, Any], tables: Sequence[Table], *, file: TextIO | None = None
) -> None:
    """The tables for a reader: on a terminal, boxed tables that fit its width, each row as a
    list of `header: value` lines where the columns would not fit without splitting a cell's
    words; piped, the Markdown of summary.md (no padding, no colour)."""
    from rich.console import Console

    out = file if file is not None else sys.stdout
    console = Console(file=out)
    if not console.is_terminal:
        out.write(to_markdown(results, tables))
        return
    console.print(f"[bold]Machine:[/bold] {machine_line(results)}", highlight=False)
    for server in results["servers"]:
        for note in server["notes"]:
            console.print(f"[yellow]{server['label']}:[/yellow] {note}", highlight=False)
    for table in tables:
        if table_width(table) <= console.width:
            console.print(_boxed(table, console.width))
        else:
            _print_records(console, table)


# A boxed table's width beyond its columns': a border left of each column and one at the end,
# and a space of padding either side of each cell.
def table_width(table: Table) -> int:
    """The narrowest a boxed table can be without splitting a word of any cell: each column
    as wide as its longest word (header words included)."""
    widths = _min_widths(table)
    return sum(widths) + 3 * len(widths) + 1


def _min_widths(table: Table) -> list[int]:
    def longest_word(text: str) -> int:
        return max((len(w) for w in text.split()), default=0)

    return [
        max([longest_word(header)] + [longest_word(row[i]) for row in table.rows if i < len(row)])
        for i, header in enumerate(table.headers)
    ]


def _style(cell: str) -> str:
    if cell in ("MISSED", "NO"):
        return f"[red]{cell}[/red]"
    if cell == "met":
        return f"[green]{cell}[/green]"
    return escape(cell)


def _column_widths(table: Table, width: int) -> list[int]:
    """Each column as wide as its widest cell or header, narrowed (the one with the most to
    spare first, never below its longest word) until the table fits `width`."""
    least = _min_widths(table)
    widths = [
        max([len(header)] + [len(row[i]) for row in table.rows if i < len(row)])
        for i, header in enumerate(table.headers)
    ]
    excess = sum(widths) + 3 * len(widths) + 1 - width
    while excess > 0:
        spare, i = max((w - m, i) for i, (w, m) in enumerate(zip(widths, least, strict=True)))
        if spare <= 0:
            break
        widths[i] -= 1
        excess -= 1
    return widths


def _boxed(table: Table, width: int) -> Any:
    from rich.table import Table as RichTable

    rich_table = RichTable(
        title=table.title, caption=table.note or None, title_justify="left", highlight=False
    )
    for header, column in zip(table.headers, _column_widths(table, width), strict=True):
        rich_table.add_column(header, width=column, overflow="fold")
    for row in table.rows:
        rich_table.add_row(*(_style(c) for c in row))
    return rich_table


def _print_records(console: Any, table: Table) -> None:
    """A table too wide for the terminal: each row a block, its first cell as the heading,
    then one `header: value` line per other cell (values wrap between words only)."""
    width = console.width
    console.print(f"[italic]{escape(table.title)}[/italic]", highlight=False)
    label = min(max((len(h) for h in table.headers[1:]), default=0) + 2, width // 2)
    for row in table.rows:
        console.print(f"[bold]{escape(table.headers[0])}: {escape(row[0])}[/bold]", highlight=False)
        for header, cell in zip(table.headers[1:], row[1:], strict=False):
            lines = textwrap.wrap(
                cell, width=max(width - label - 2, 10), break_long_words=False
            ) or [""]
            head = f"  {header + ':':<{label}}"
            console.print(f"{escape(head)}{_style(lines[0])}", highlight=False, soft_wrap=True)
            for line in lines[1:]:
                console.print(" " * (label + 2) + escape(line), highlight=False, soft_wrap=True)
    if table.note:
        console.print(escape(table.note), highlight=False)
    console.print()


def write_results(results: dict[str, Any], out_dir: Path) -> Path:
    """Write results.json, results.schema.json and summary.md into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "results.schema.json").write_text(json.dumps(RESULTS_SCHEMA, indent=2) + "\n")
    (out_dir / "summary.md").write_text(to_markdown(results, summary_tables(results)))
    return path
