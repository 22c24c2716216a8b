"""Results: one `CheckResult` per check, a `Report` for the run, its JSON form and its table."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["CheckResult", "Outcome", "Report", "print_table"]


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

    @property
    def ok(self) -> bool:
        return not self.failures

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


def print_table(report: Report, console: Console) -> None:
    title = Text(f"rollout conform {report.base_url} (model {report.model})")
    table = Table(title=title, expand=True)
    table.add_column("check", no_wrap=True)
    table.add_column("rule", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("reason", ratio=1, overflow="fold")
    for r in report.results:
        label = r.outcome.value
        if r.outcome is Outcome.FAILED and not r.required:
            label += " (optional)"
        # Text, not markup: reasons quote server data, which may hold `[...]`.
        table.add_row(
            Text(r.id), Text(r.rule), Text(label, style=_STYLE[r.outcome]), Text(r.reason)
        )
    console.print(table)
    counts = report.counts()
    weak = f", {counts['weak']} weak (structure only)" if counts["weak"] else ""
    summary = (
        f"{counts['passed']} passed{weak}, {counts['failed']} failed, {counts['skipped']} "
        f"skipped in {report.seconds:.1f}s"
    )
    if report.failures:
        console.print(Text(f"NOT CONFORMANT: {summary}", style="bold red"))
    else:
        console.print(Text(f"conformant: {summary}", style="bold green"))
