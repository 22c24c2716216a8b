"""Results: one `CheckResult` per check, a `Report` for the run, its JSON form and its table."""

from __future__ import annotations

import enum
import json
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._context import Case

__all__ = ["CheckResult", "Outcome", "Report", "print_cases", "print_table"]


class Outcome(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    # Ran without a failure, but could only check structure (e.g. outputs compared by kind
    # because the model is not deterministic): not evidence of the rule, so never PASSED;
    # counted apart, and not a failure.
    WEAK = "weak"


@attrs.frozen(kw_only=True)
class CheckResult:
    id: str
    rule: str
    title: str
    feature: str
    required: bool
    outcome: Outcome
    reason: str = ""
    seconds: float = 0.0

    @property
    def counts_as_failure(self) -> bool:
        """A failed required check fails the run; a failed optional check (a SHOULD) does not."""
        return self.outcome is Outcome.FAILED and self.required

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "rule": self.rule,
            "title": self.title,
            "feature": self.feature,
            "required": self.required,
            "outcome": self.outcome.value,
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
        }


@attrs.frozen(kw_only=True)
class Report:
    base_url: str
    model: str
    results: tuple[CheckResult, ...]
    seconds: float
    # What the probes found: {"rollout": True/False/None, "deterministic": ...}; None: not probed.
    features: Mapping[str, bool | None] = attrs.field(factory=dict)
    # Features the caller required (`--require`): their skipped checks count as failures.
    required_features: tuple[str, ...] = ()
    # The run was stopped (Ctrl-C) before every selected check ended: `results` are those that
    # did, and the run is not a verdict.
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures and not self.interrupted

    @property
    def failures(self) -> list[CheckResult]:
        out = [r for r in self.results if r.counts_as_failure]
        out += [
            r
            for r in self.results
            if r.outcome is Outcome.SKIPPED and r.required and r.feature in self.required_features
        ]
        return out

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def by_id(self) -> dict[str, CheckResult]:
        return {r.id: r for r in self.results}

    def counts(self) -> dict[str, int]:
        counts = {o.value: 0 for o in Outcome}
        for r in self.results:
            counts[r.outcome.value] += 1
        counts["required_failed"] = len(self.failures)
        return counts

    def to_json(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "ok": self.ok,
            "interrupted": self.interrupted,
            "seconds": round(self.seconds, 3),
            "features": dict(self.features),
            "required_features": list(self.required_features),
            "summary": self.counts(),
            "checks": [r.to_json() for r in self.results],
        }

    def write_json(self, path: str | Path) -> None:
        text = json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n"
        if str(path) == "-":
            print(text, end="")
        else:
            Path(path).write_text(text, encoding="utf-8")


_STYLE = {
    Outcome.PASSED: "green",
    Outcome.FAILED: "bold red",
    Outcome.SKIPPED: "yellow",
    Outcome.WEAK: "magenta",
}
# The narrowest reason (or title) column a table is drawn with; a narrower terminal gets one
# line per check with its reason on the lines below, so no value is split mid-word.
MIN_TEXT_COLUMN = 40
# What a table's borders and padding take besides its cells: 3 per column and 1.
_TABLE_FRAME = 3 * 4 + 1


def _label(r: CheckResult) -> str:
    label = r.outcome.value
    if r.outcome is Outcome.FAILED and not r.required:
        label += " (optional)"
    return label


def _md(value: str) -> str:
    """A Markdown table cell: one line, `|` escaped."""
    return " ".join(value.split()).replace("|", "\\|")


def _plain(console: Console, line: str) -> None:
    """One line as is: no wrapping, no markup, no highlighting."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def _fits(console: Console, *columns: list[str]) -> bool:
    """Whether a table of these no-wrap columns leaves MIN_TEXT_COLUMN for the last one."""
    widths = sum(max((len(v) for v in values), default=0) for values in columns)
    return console.width >= widths + _TABLE_FRAME + MIN_TEXT_COLUMN


def print_table(report: Report, console: Console) -> None:
    """The results: a table in a terminal wide enough, one line per check with its reason
    below in a narrow one, a Markdown table when the output is not a terminal."""
    title = f"rollout conform {report.base_url} (model {report.model})"
    rows = [(r.id, r.rule, _label(r), r.reason, _STYLE[r.outcome]) for r in report.results]
    if not console.is_terminal:
        _plain(console, title)
        _plain(console, "")
        _plain(console, "| check | rule | result | reason |")
        _plain(console, "|---|---|---|---|")
        for check, rule, label, reason, _ in rows:
            _plain(console, f"| {check} | {rule} | {label} | {_md(reason)} |")
        _plain(console, "")
    elif _fits(console, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]):
        table = Table(title=Text(title), expand=True)
        table.add_column("check", no_wrap=True)
        table.add_column("rule", no_wrap=True)
        table.add_column("result", no_wrap=True)
        table.add_column("reason", ratio=1, overflow="fold")
        for check, rule, label, reason, style in rows:
            # Text, not markup: reasons quote server data, which may hold `[...]`.
            table.add_row(Text(check), Text(rule), Text(label, style=style), Text(reason))
        console.print(table)
    else:
        console.print(Text(title, style="bold"))
        label_w, check_w = (max((len(r[n]) for r in rows), default=0) for n in (2, 0))
        rule_w = max((len(r[1]) for r in rows), default=0)
        if label_w + check_w + rule_w + 4 > console.width:
            check_w = 0  # unaligned, but whole
        for check, rule, label, reason, style in rows:
            line = Text.assemble(
                (label.ljust(label_w), style), "  ", check.ljust(check_w), "  ", (rule, "dim")
            )
            console.print(line)
            _indented(console, reason)
    counts = report.counts()
    weak = f", {counts['weak']} weak (structure only)" if counts["weak"] else ""
    summary = (
        f"{counts['passed']} passed{weak}, {counts['failed']} failed, {counts['skipped']} "
        f"skipped in {report.seconds:.1f}s"
    )
    if report.interrupted:
        console.print(Text(f"INTERRUPTED (no verdict): {summary}", style="bold yellow"))
    elif report.failures:
        console.print(Text(f"NOT CONFORMANT: {summary}", style="bold red"))
    else:
        console.print(Text(f"conformant: {summary}", style="bold green"))


def print_cases(cases: Sequence[Case], console: Console) -> None:
    """The case list (`rollout conform --list`): a table in a terminal wide enough, each check
    with its title on the line below in a narrow one, a Markdown table when not a terminal."""
    rows = [(c.id, c.rule, "required" if c.required else "optional", c.title) for c in cases]
    if not console.is_terminal:
        _plain(console, "| check | rule | required | title |")
        _plain(console, "|---|---|---|---|")
        for check, rule, kind, title in rows:
            _plain(console, f"| {check} | {rule} | {kind} | {_md(title)} |")
    elif _fits(console, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]):
        table = Table(expand=True)
        for name in ("check", "rule", "required"):
            table.add_column(name, no_wrap=True)
        table.add_column("title", ratio=1)
        for row in rows:
            table.add_row(*(Text(v) for v in row))
        console.print(table)
    else:
        for check, rule, kind, title in rows:
            console.print(Text.assemble(check, "  ", (rule, "dim"), "  ", kind))
            _indented(console, title)


# The indent of a reason or title on the lines below its check, in the narrow layout.
INDENT = 4


def _indented(console: Console, text: str) -> None:
    """`text` on lines of their own, indented, wrapped between words (a word longer than a
    line is the only thing ever split)."""
    width = max(console.width - INDENT, 20)
    for line in textwrap.wrap(text, width, break_on_hyphens=False):
        _plain(console, " " * INDENT + line)
