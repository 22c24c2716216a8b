"""PNG plots of a results document (matplotlib, Agg backend, imported lazily).

- `overhead.png`: per-turn pre-inference overhead vs history tokens per mode (server-reported
  and client-observed), and the tokens the server rendered per turn (work counters).
- `e2e.png`: end-to-end rollout time over its physical limit, by model speed and mode.
- `concurrency.png`: turn latency, streaming rate and throughput vs concurrent rollouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._errors import BenchError

__all__ = ["MATPLOTLIB_MISSING", "write_plots"]

MATPLOTLIB_MISSING = (
    "matplotlib is not installed, so no plots are written; install it with "
    "`pip install 'rollout-engine[bench]'` (or `pip install matplotlib`)"
)

MODE_COLORS = {
    "http-stateless": "#d62728",
    "http-chain": "#ff7f0e",
    "ws-chain": "#1f77b4",
    "ws-chain-stored": "#9467bd",
    "ws-rollout": "#2ca02c",
}
# Each mode's marker: where lines overlap (the tokens rendered per turn are the same in every
# mode) the markers, hollow and on different turns for each mode (`_mode_style`), still show
# all of them.
MODE_MARKERS = {
    "http-stateless": "o",
    "http-chain": "s",
    "ws-chain": "^",
    "ws-chain-stored": "D",
    "ws-rollout": "v",
}
SERVER_STYLES = ("-", "--", ":", "-.")
DPI = 90


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise BenchError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the plots that the results have data for; return their paths."""
    plt = _matplotlib()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (
        ("overhead.png", _overhead),
        ("e2e.png", _e2e),
        ("concurrency.png", _concurrency),
    ):
        fig = draw(plt, results)
        if fig is None:
            continue
        for ax in fig.axes:
            if ax.get_yscale() == "log":
                _plain_log_ticks(ax)
        if fig.get_layout_engine() is None:
            fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _plain_log_ticks(ax: Any) -> None:
    """Log axis ticks at 1, 2, 5 x 10^n, labelled as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _servers(results: dict[str, Any]) -> list[str]:
    return [s["label"] for s in results["servers"]]


def _style(results: dict[str, Any], server: str) -> str:
    return SERVER_STYLES[_servers(results).index(server) % len(SERVER_STYLES)]


def _label(results: dict[str, Any], server: str, mode: str) -> str:
    return mode if len(_servers(results)) == 1 else f"{server}: {mode}"


def _overhead_source(turns: list[dict[str, Any]]) -> tuple[str, float | None] | None:
    keys = {(t["scenario"], t["tps"]) for t in turns}
    if not keys:
        return None
    return min(
        keys,
        key=lambda k: (
            k[0] != "long-context",
            k[1] is not None,
            -max(t["history_tokens"] for t in turns if (t["scenario"], t["tps"]) == k),
        ),
    )


def _overhead(plt: Any, results: dict[str, Any]) -> Any:
    source = _overhead_source(results["turns"])
    if source is None:
        return None
    scenario, tps = source
    # The legend goes below the panels, outside them (constrained layout keeps it clear).
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.9), layout="constrained")
    for server in _servers(results):
        for mode, color in MODE_COLORS.items():
            turns = sorted(
                (
                    t
                    for t in results["turns"]
                    if t["server"] == server
                    and t["mode"] == mode
                    and (t["scenario"], t["tps"]) == source
                ),
                key=lambda t: t["history_tokens"],
            )
            if not turns:
                continue
            x = [t["history_tokens"] / 1000 for t in turns]
            style = {
                "linestyle": _style(results, server),
                "color": color,
                "label": _label(results, server, mode),
                **_mode_style(results, server, mode),
            }
            for ax, key in ((axes[0], "server_overhead_s"), (axes[1], "ack_s")):
                pts = [
                    (xi, t[key]["median"] * 1000) for xi, t in zip(x, turns, strict=True) if t[key]
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), **style)
            pts = [
                (xi, t["counters"]["tokens_rendered"])
                for xi, t in zip(x, turns, strict=True)
                if t["counters"] and "tokens_rendered" in t["counters"]
            ]
            if pts:
                axes[2].plot(*zip(*pts, strict=True), **style)
    titles = (
        "server-reported pre-inference overhead per turn",
        "client-observed: request sent -> response acknowledged",
        "tokens the server rendered per turn (/metrics)",
    )
    units = ("ms", "ms", "tokens")
    for ax, title, unit in zip(axes, titles, units, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("history before the turn (thousand tokens)")
        _latency_scale(ax, unit)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(
            handles, labels, loc="outside lower center", ncol=min(len(labels), 5), fontsize=9
        )
    fig.suptitle(
        f"Per-turn overhead vs history ({scenario}, "
        f"{'unpaced model' if tps is None else f'{tps:g} tps'}; medians)",
        fontsize=11,
    )
    return fig


def _mode_style(results: dict[str, Any], server: str, mode: str) -> dict[str, Any]:
    """A series' line: its mode's own hollow marker, on every Nth point from an offset of
    the series' own (N: the number of series, every server's modes), and a width that shrinks
    down the series, so that where lines coincide the ones drawn first still show around the
    later ones."""
    count = len(MODE_MARKERS) * len(_servers(results))
    index = _servers(results).index(server) * len(MODE_MARKERS) + list(MODE_MARKERS).index(mode)
    return {
        "marker": MODE_MARKERS[mode],
        "markevery": (index, count),
        "markerfacecolor": "none",
        "markersize": 6,
        "linewidth": 1.0 + 1.8 * (count - 1 - index) / max(1, count - 1),
    }


def _e2e(plt: Any, results: dict[str, Any]) -> Any:
    rollouts = [r for r in results["rollouts"] if r["tps"] is not None and r["physical_limit_s"]]
    if not rollouts:
        return None
    scenarios = list(dict.fromkeys(r["scenario"] for r in rollouts))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.6 * len(scenarios), 4.8), squeeze=False)
    series = [(s, m) for s in _servers(results) for m in MODE_COLORS]
    missing = False
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        mine = [r for r in rollouts if r["scenario"] == scenario]
        speeds = sorted({r["tps"] for r in mine})
        present = [sm for sm in series if any((r["server"], r["mode"]) == sm for r in mine)]
        width = 0.8 / max(1, len(present))
        for i, (server, mode) in enumerate(present):
            xs, ys, gaps = [], [], []
            for j, tps in enumerate(speeds):
                x = j + (i - (len(present) - 1) / 2) * width
                found = [
                    r
                    for r in mine
                    if r["server"] == server and r["mode"] == mode and r["tps"] == tps
                ]
                if not found:
                    gaps.append(x)  # this mode did not run at this speed
                    continue
                xs.append(x)
                ys.append(found[0]["e2e_s"]["median"] / found[0]["physical_limit_s"])
            hatch = "" if _servers(results).index(server) == 0 else "//"
            ax.bar(
                xs,
                ys,
                width,
                color=MODE_COLORS[mode],
                hatch=hatch,
                label=_label(results, server, mode),
            )
            for x in gaps:
                missing = True
                ax.annotate("n/a", (x, 0.9), ha="center", va="bottom", fontsize=8, color="grey",
                            xytext=(0, 2), textcoords="offset points")  # fmt: skip
        limits = {
            tps: min(r["physical_limit_s"] for r in mine if r["tps"] == tps) for tps in speeds
        }
        ax.set_xticks(
            range(len(speeds)), [f"{s:g} tps\nlimit {limits[s]:.1f} s" for s in speeds], fontsize=9
        )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(scenario, fontsize=11)
        ax.set_ylabel("end-to-end / physical limit")
        top = max((b.get_height() for b in ax.patches), default=1.0)
        ax.set_ylim(0.9, max(1.1, top * 1.05))
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "End-to-end rollout time over the physical limit (model + tool time; 1.0 = no "
        "overhead), by model speed and mode (medians)"
        + ("\nn/a: the mode did not run at that speed" if missing else ""),
        fontsize=10,
    )
    return fig


def _concurrency(plt: Any, results: dict[str, Any]) -> Any:
    waves = results["concurrency"]
    if not waves:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for server in _servers(results):
        for mode, color in MODE_COLORS.items():
            mine = sorted(
                (w for w in waves if w["server"] == server and w["mode"] == mode),
                key=lambda w: w["concurrency"],
            )
            if not mine:
                continue
            ks = [w["concurrency"] for w in mine]
            style = _style(results, server)
            label = _label(results, server, mode)
            p50 = [w["turn_s"]["median"] * 1000 if w["turn_s"] else None for w in mine]
            p99 = [w["turn_s"]["p99"] * 1000 if w["turn_s"] else None for w in mine]
            axes[0].plot(ks, p50, style, color=color, marker="o", label=f"{label} p50")
            axes[0].plot(ks, p99, style, color=color, marker="^", alpha=0.5, label=f"{label} p99")
            pace = [w["pace_ratio"] * 100 if w["pace_ratio"] is not None else None for w in mine]
            axes[1].plot(ks, pace, style, color=color, marker="o", label=f"{label} stream rate")
            share = [
                100 / (1 + w["excess_ratio"]) if w["excess_ratio"] is not None else None
                for w in mine
            ]
            axes[1].plot(ks, share, ":", color=color, marker="s", alpha=0.7,
                         label=f"{label} model time / turn")  # fmt: skip
            tput = [w["throughput_output_tokens_per_s"] for w in mine]
            axes[2].plot(ks, tput, style, color=color, marker="o", label=label)
    speeds = sorted({w["tps"] for w in waves})
    ideal = _ideal_turn_ms(results)
    if ideal is not None:
        axes[0].axhline(ideal, color="black", linewidth=0.8, linestyle="--", label="model time")
    ticks = sorted({w["concurrency"] for w in waves})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(k) for k in ticks])
        ax.set_xlabel("concurrent rollouts (K)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title("turn latency", fontsize=10)
    _latency_scale(axes[0], "ms")
    axes[1].set_title(
        "keeping pace: stream rate (% of the model's tps, >= 95)\n"
        "and model time / median turn (%, >= 91)",
        fontsize=9,
    )
    axes[1].axhline(
        95, color="black", linewidth=0.8, linestyle="--", label="stream rate threshold (95%)"
    )
    axes[1].axhline(
        100 / 1.1,
        color="grey",
        linewidth=0.8,
        linestyle=":",
        label="model time / turn threshold (91%)",
    )
    # Up to the highest point drawn (a stream can run above the model's rate once it
    # catches up after a late start: its late tokens arrive together).
    drawn = [w["pace_ratio"] * 100 for w in waves if w.get("pace_ratio") is not None]
    axes[1].set_ylim(0, max([110.0, *(v * 1.05 for v in drawn)]))
    axes[1].set_ylabel("%")
    axes[1].legend(fontsize=7, loc="lower left")
    axes[2].set_title("throughput (output tokens/s received, all rollouts)", fontsize=10)
    _latency_scale(axes[2], "tokens/s")
    axes[0].legend(fontsize=7)
    scenario = waves[0]["scenario"]
    ttft = waves[0]["ttft_ms"]
    fig.suptitle(
        f"Latency vs concurrency ({scenario}, "
        + ", ".join(f"{t:g} tps" for t in speeds)
        + ("" if ttft is None else f", TTFT {ttft:g} ms")
        + ")",
        fontsize=11,
    )
    return fig


# A value axis spanning at least this ratio (largest / smallest) is drawn on a log scale;
# a narrower one is linear (a log scale over 200-270 ms only hides the differences).
LOG_SCALE_RATIO = 10.0


def _latency_scale(ax: Any, unit: str) -> None:
    """Log scale for the axis if its data spans `LOG_SCALE_RATIO`, else linear from 0."""
    values = [
        float(v) for line in ax.get_lines() for v in line.get_ydata() if v is not None and v > 0
    ]
    if values and max(values) / min(values) >= LOG_SCALE_RATIO:
        ax.set_yscale("log")
        ax.set_ylabel(f"{unit} (log)")
    else:
        ax.set_ylim(bottom=0)
        ax.set_ylabel(unit)


def _ideal_turn_ms(results: dict[str, Any]) -> float | None:
    """The model's own time per turn in the concurrency sweep (TTFT + output / tps)."""
    waves = results["concurrency"]
    wave = waves[0]
    if wave["ttft_ms"] is None:
        return None
    scenario = next((s for s in results["scenarios"] if s["name"] == wave["scenario"]), None)
    if scenario is None:
        return None
    return float(wave["ttft_ms"] + scenario["output_tokens"] / wave["tps"] * 1000)
