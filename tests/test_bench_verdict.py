"""`rollout bench`'s verdict: a loaded machine said (the rule, on fabricated CPU samples and
results), one figure per quantity (the goals and the overhead table over the same history
windows, named alike), a short stdout, the help's usage, examples and exit codes, and the
overhead plot's legend and lines (their structure: what a picture shows is not tested)."""

from __future__ import annotations

import argparse
import copy
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from rollout import bench
from rollout._cli import main as rollout_main
from rollout.bench._cli import add_parser
from rollout.bench._goals import evaluate_goals
from rollout.bench._load import CpuSample, _machine_busy_s, judge_load, load_warning
from rollout.bench._report import print_summary, summary_tables, to_markdown, verdict
from rollout.bench._runner import SCHEMA_ID

RESULTS = Path(bench.__file__).parent / "results"
# A full run (every goal measured, one server), and one against three servers (schema /7).
FULL = RESULTS / "results.json"
PEERS = RESULTS / "peers" / "bench-sim" / "results.json"
# /8 has /7's shape; only what `server_overhead_s` sums changed (SCHEMA.md), which these tests
# of the verdict and the tables do not read for its value: a /7 run is read as /8 here.
SAME_SHAPE = {"rollout-bench/7": SCHEMA_ID}

LOADED_REASON = "other processes used 1.00 of 2 CPUs on average during the run (at least 0.5)"
QUIET_REASON = "other processes used 0.20 of 2 CPUs on average during the run (under 0.5)"
WARNING = (
    "the machine was loaded (other processes used 1.00 of 2 CPUs on average during the run "
    "(at least 0.5)): the timings, and the goals judged by them, are not trustworthy; run "
    "again on a quiet machine"
)


def _results(path: Path = FULL) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(path.read_text())
    loaded["schema"] = SAME_SHAPE.get(loaded["schema"], loaded["schema"])
    return loaded


def _samples(other_busy_s: float) -> tuple[CpuSample, CpuSample]:
    """50 s of run in which the benchmark used 50 CPU seconds and the machine, all told,
    50 + `other_busy_s`."""
    return CpuSample(1000.0, 10.0, 100.0), CpuSample(1050.0 + other_busy_s, 60.0, 150.0)


def _with_load(results: dict[str, Any], other_busy_s: float) -> dict[str, Any]:
    out = copy.deepcopy(results)
    out["meta"]["machine_load"] = judge_load(*_samples(other_busy_s), 2, [0.1, 0.1, 0.1])
    return out


# --- a loaded machine -----------------------------------------------------------------------


def test_the_rule_on_fabricated_cpu_samples() -> None:
    loaded = judge_load(*_samples(50.0), 2, [3.0, 2.0, 1.0])
    assert loaded["loaded"] is True and loaded["other_cpus"] == 1.0
    assert loaded["reason"] == LOADED_REASON
    quiet = judge_load(*_samples(10.0), 2, [3.0, 2.0, 1.0])  # the load average is not used
    assert quiet["loaded"] is False and quiet["reason"] == QUIET_REASON
    # exactly a quarter of the CPUs is loaded
    assert judge_load(*_samples(25.0), 2, None)["loaded"] is True
    # a --url server on this machine counts as other work, and the reason says so
    by_url = judge_load(*_samples(50.0), 2, None, url_servers=True)
    assert by_url["reason"].endswith("; servers given by --url on this machine count as other work")
    # no /proc/stat: the load average at the start stands in
    blind = CpuSample(None, 10.0, 100.0), CpuSample(None, 60.0, 150.0)
    assert judge_load(*blind, 2, [1.2, 1.0, 1.0])["reason"] == (
        "the 1-minute load average was 1.20 on 2 CPUs at the start (at least 0.5; no "
        "/proc/stat to measure the run itself)"
    )
    assert judge_load(*blind, 2, [0.1, 0.1, 0.1])["loaded"] is False
    unknown = judge_load(*blind, None, None)
    assert unknown["loaded"] is None and unknown["reason"].startswith("not measured")


def test_machine_busy_time_from_proc_stat(tmp_path: Path) -> None:
    import os

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  400 100 200 9000 300 10 20 30 50 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    ticks = os.sysconf("SC_CLK_TCK")
    assert _machine_busy_s(stat) == pytest.approx((400 + 100 + 200 + 10 + 20 + 30) / ticks)
    assert _machine_busy_s(tmp_path / "missing") is None


def test_a_loaded_run_says_so_in_the_verdict_and_the_results() -> None:
    loaded, quiet = _with_load(_results(PEERS), 50.0), _with_load(_results(PEERS), 10.0)
    bench.validate_results(loaded)
    bench.validate_results(quiet)
    assert load_warning(loaded) == WARNING
    assert load_warning(quiet) is None
    assert verdict(loaded) == (
        "8 of 35 goals met, 1 MISSED (rollout: stateless-vs-own), 26 not measured; " + WARNING
    )
    assert verdict(quiet) == (
        "8 of 35 goals met, 1 MISSED (rollout: stateless-vs-own), 26 not measured"
    )
    for results, said in ((loaded, True), (quiet, False)):
        out = io.StringIO()
        print_summary(results, ["summary: x"], file=out)
        lines = out.getvalue().splitlines()
        assert ("THE MACHINE WAS LOADED" in lines[0]) is said
        assert lines[-1] == f"Verdict: {verdict(results)}"
        markdown = to_markdown(results, summary_tables(results))
        assert markdown.splitlines()[0] == f"Verdict: {verdict(results)}"
        assert (WARNING in markdown) is said


def test_results_from_before_the_rule_still_read() -> None:
    results = _results(PEERS)
    assert "machine_load" not in results["meta"]
    bench.validate_results(results)
    assert verdict(results).endswith("; whether the machine was loaded was not recorded")


# --- one quantity, one figure ---------------------------------------------------------------


def test_the_goals_and_the_overhead_table_give_one_figure_per_window() -> None:
    """The goals' ~1k and ~100k figures are the overhead table's cells, and both name the
    same history windows (0.5k-2k and 95k+)."""
    results = _results()
    results["goals"] = evaluate_goals(results)
    tables = summary_tables(results)
    (table,) = [t for t in tables if "overhead by history window" in t.title]
    (goals,) = [t for t in tables if t.title.startswith("Goals")]
    assert "history windows 0.5k-2k and 95k+" in goals.title
    assert "each cell the median over the turns whose history before the turn is in the " \
        "window" in table.title  # fmt: skip
    assert table.headers[:5] == (
        "mode", "server ms 0.5k-2k", "server ms 8k-12k", "server ms 45k-55k", "server ms 95k+",
    )  # fmt: skip
    rows = {row[0]: dict(zip(table.headers, row, strict=True)) for row in table.rows}
    by_id = {g["id"]: g for g in results["goals"]}
    for mode in ("ws-chain", "ws-rollout", "http-stateless", "http-chain"):
        goal = by_id[f"flat-overhead/{mode}"]
        low, high = rows[mode]["server ms 0.5k-2k"], rows[mode]["server ms 95k+"]
        assert goal["detail"].startswith(f"{low} ms at 0.5k-2k, {high} ms at 95k+: ")
        assert "at 95k+ history" in goal["description"]
    stateless = by_id["stateless-vs-own"]["detail"]
    cells = rows["http-stateless"]
    assert stateless.startswith(f"{cells['ack ms 0.5k-2k']} ms at 0.5k-2k, ")
    assert f"{cells['ack ms 95k+']} ms at 95k+" in stateless


# --- a short stdout -------------------------------------------------------------------------


def test_the_summary_of_a_quick_run_is_short() -> None:
    """A full run's goals (one server): the verdict first and last, one line per goal,
    the files: at most 30 lines, none of the tables."""
    results = _with_load(_results(), 50.0)
    outputs = [
        "results: out/results.json (schema: out/results.schema.json)",
        "summary: out/summary.md (every table)",
        *(f"plot:    out/{name}.png" for name in ("overhead", "e2e", "concurrency")),
        "took 241 s",
    ]
    out = io.StringIO()
    print_summary(results, outputs, file=out)
    lines = out.getvalue().splitlines()
    assert len(lines) <= 30, out.getvalue()
    assert lines[0] == (
        "rollout bench: 13 of 13 goals met; THE MACHINE WAS LOADED (the verdict is at the end; "
        "every table is in summary.md, or printed with --verbose)"
    )
    assert lines[-1] == f"Verdict: 13 of 13 goals met; {WARNING}"
    assert "  met     flat-overhead/ws-chain        1.17 (at most 1.3)" in lines
    assert "  met     keeps-pace                    16 (at least 16)" in lines
    assert not [line for line in lines if line.startswith("|")]


# --- the help -------------------------------------------------------------------------------


def _help() -> str:
    parser = argparse.ArgumentParser(prog="rollout")
    add_parser(parser.add_subparsers(dest="command"))
    bench_parser = parser._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    text: str = bench_parser.format_help()
    return text


def test_help_has_a_short_usage_examples_and_exit_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    text = _help()
    usage = text.split("\n\n")[0]
    assert usage == "usage: rollout bench [options]  (or: rollout bench --report RESULTS_JSON)"
    codes = text.split("exit status:\n")[1].split("\n\n")[0]
    assert re.findall(r"^  (\d+) ", codes, re.M) == ["0", "1", "2", "130"]
    examples = text.split("examples:\n")[1]
    assert examples.splitlines()[0] == "  rollout bench"
    assert "  rollout bench --report bench-results/results.json --verbose" in examples
    assert "--verbose" in text and "--no-progress" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_an_option_the_run_cannot_use_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert rollout_main(["bench", "--steps", "0", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "rollout bench: --steps must be at least 1, not 0\n"
    assert captured.out == ""


# --- the overhead plot ----------------------------------------------------------------------


def test_overhead_plot_legend_is_outside_the_panels_and_modes_are_told_apart() -> None:
    """Structure only (what the picture looks like is not tested): the legend is the
    figure's, below the panels and clear of each; in the right panel, where the five modes'
    lines coincide, each has its own marker on points of its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rollout.bench import _plots

    fig = _plots._overhead(plt, _results())
    try:
        fig.canvas.draw()
        assert all(ax.get_legend() is None for ax in fig.axes)
        (legend,) = fig.legends
        labels = [t.get_text() for t in legend.get_texts()]
        assert labels == ["http-stateless", "http-chain", "ws-chain", "ws-chain-stored",
                          "ws-rollout"]  # fmt: skip
        box = legend.get_window_extent()
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent()), ax.get_title()
        lines = fig.axes[2].get_lines()
        assert len(lines) == 5
        styles = {(line.get_marker(), line.get_markevery()) for line in lines}
        assert len({marker for marker, _ in styles}) == 5
        assert len({every for _, every in styles}) == 5
        assert {line.get_markerfacecolor() for line in lines} == {"none"}
    finally:
        plt.close(fig)
