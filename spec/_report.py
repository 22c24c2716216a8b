"""Results: one `CheckResult` per check, a `Report` for the run, its JSON form and its table.

Long because a report has three readers: the JSON file, the terminal table, and the verdict per
profile with its failures.
"""

from __future__ import annotations

import enum
import json
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._context import Case, Profile, load_profiles

__all__ = [
    "CONFORMANT",
    "CORE_FAILED",
    "PROFILE_FAILED",
    "CheckResult",
    "Outcome",
    "ProfileVerdict",
    "Report",
    "Support",
    "print_cases",
    "print_report",
    "print_table",
]


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
    profile: str = "core"
    # The server's answer behind a failure, when one stands out (`_context.Answer`): checks
    # failed by the same cause are reported as one.
    cause: str | None = None
    # Skipped because the server does not support the check's feature (or its probe could
    # not run): with `--require` of its profile or feature, a failure.
    unsupported: bool = False

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
            "profile": self.profile,
            "cause": self.cause,
            "unsupported": self.unsupported,
        }


# Exit statuses of a run that reached a verdict (the preflight's are 3 and 4, usage errors 2):
# everything checked passed ...
CONFORMANT = 0
# ... the server breaks the core profile (the Responses API itself) ...
CORE_FAILED = 1
# ... the core passes, but a profile the server claims (it answered the probe) breaks, or a
# `--require`d profile is not supported.
PROFILE_FAILED = 5
# Failed checks sharing one cause (the same status and body) are reported as one line from
# this many on.
SHARED_CAUSE_MIN = 2


class Support(enum.Enum):
    """What a run found out about a profile."""

    SUPPORTED = "supported"  # its probes answered (or it has none and its checks ran)
    PARTLY = "partly supported"  # some of its features answered their probes, some not
    NOT_SUPPORTED = "not supported"  # its probes show the server does not implement it
    UNKNOWN = "unknown"  # a probe could not run (the server failed it)
    NOT_CHECKED = "not checked"  # every check skipped for want of an option
    NOT_SELECTED = "not selected"  # no check of it was selected


@attrs.frozen(kw_only=True)
class ProfileVerdict:
    """One profile's line in the summary: what the server supports, and how its checks ended."""

    name: str
    title: str
    support: Support
    evidence: tuple[str, ...] = ()
    passed: int = 0
    failed: int = 0
    weak: int = 0
    skipped: int = 0
    # Checks counted as failures of the run (failed required checks; with `required`, the
    # checks skipped as unsupported).
    failures: int = 0
    required: bool = False

    @property
    def verdict(self) -> str:
        """A word or two: `passes`, `FAILS`, `not supported`, ... (capitals: a failure)."""
        if self.support in (Support.SUPPORTED, Support.PARTLY):
            word = "FAILS" if self.failures else "passes"
            return f"partly: {word}" if self.support is Support.PARTLY else word
        word = str(self.support.value)
        return word.upper() if self.failures else word

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "support": self.support.value,
            "verdict": self.verdict,
            "evidence": list(self.evidence),
            "passed": self.passed,
            "failed": self.failed,
            "weak": self.weak,
            "skipped": self.skipped,
            "failures": self.failures,
            "required": self.required,
        }


@attrs.frozen(kw_only=True)
class Report:
    base_url: str
    model: str
    results: tuple[CheckResult, ...]
    seconds: float
    # What the probes found: {"rollout": True/False/None, "deterministic": ...}; None: not probed.
    features: Mapping[str, bool | None] = attrs.field(factory=dict)
    # Each feature probe that ran: (supported, or None when the probe failed; its evidence or
    # failure; the cause of that failure).
    findings: Mapping[str, tuple[bool | None, str, str | None]] = attrs.field(factory=dict)
    # Profiles or features the caller required (`--require`): when not supported, their
    # skipped checks count as failures.
    required_features: tuple[str, ...] = ()
    # The run was stopped (Ctrl-C) before every selected check ended: `results` are those that
    # did, and the run is not a verdict.
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures and not self.interrupted

    def _required(self, r: CheckResult) -> bool:
        return r.profile in self.required_features or r.feature in self.required_features

    @property
    def failures(self) -> list[CheckResult]:
        out = [r for r in self.results if r.counts_as_failure]
        out += [
            r
            for r in self.results
            if r.outcome is Outcome.SKIPPED and r.unsupported and self._required(r)
        ]
        return out

    @property
    def core_ok(self) -> bool:
        """No failure in the core profile: the server speaks the Responses API."""
        return not any(r.profile == "core" for r in self.failures)

    @property
    def exit_code(self) -> int:
        if self.ok:
            return CONFORMANT
        if not self.core_ok or self.interrupted:
            return CORE_FAILED
        return PROFILE_FAILED

    def by_id(self) -> dict[str, CheckResult]:
        return {r.id: r for r in self.results}

    def counts(self) -> dict[str, int]:
        counts = {o.value: 0 for o in Outcome}
        for r in self.results:
            counts[r.outcome.value] += 1
        counts["required_failed"] = len(self.failures)
        return counts

    def causes(self) -> list[tuple[str, list[CheckResult]]]:
        """Causes shared by SHARED_CAUSE_MIN failed checks or more, with those checks, in the
        order of their first check: the same answer (`CheckResult.cause`), or, for failures
        without one, the same observation (their reasons are equal)."""
        groups: dict[str, list[CheckResult]] = {}
        for r in self.results:
            if r.outcome is Outcome.FAILED:
                groups.setdefault(r.cause or r.reason, []).append(r)
        return [(c, rs) for c, rs in groups.items() if len(rs) >= SHARED_CAUSE_MIN]

    def profiles(self) -> list[ProfileVerdict]:
        """Each profile of the case list, core first: support, evidence and counts."""
        failing = {r.id for r in self.failures}
        out = []
        for profile in load_profiles():
            results = [r for r in self.results if r.profile == profile.name]
            counts = {o: sum(r.outcome is o for r in results) for o in Outcome}
            support, evidence = self._support(profile, results)
            out.append(
                ProfileVerdict(
                    name=profile.name,
                    title=profile.title,
                    support=support,
                    evidence=evidence,
                    passed=counts[Outcome.PASSED],
                    failed=counts[Outcome.FAILED],
                    weak=counts[Outcome.WEAK],
                    skipped=counts[Outcome.SKIPPED],
                    failures=sum(r.id in failing for r in results),
                    required=profile.name in self.required_features
                    or any(f in self.required_features for f in profile.features),
                )
            )
        return out

    def _support(
        self, profile: Profile, results: Sequence[CheckResult]
    ) -> tuple[Support, tuple[str, ...]]:
        if not results:
            return Support.NOT_SELECTED, ()
        if profile.name == "core":
            return Support.SUPPORTED, ()
        probed = {f: self.findings[f] for f in profile.features if f in self.findings}
        evidence = []
        for feature, (supported, text, cause) in probed.items():
            if supported:
                continue
            if supported is None:
                text = f"could not be probed: {cause}" if cause else text
            prefix = f"{feature}: " if len(profile.features) > 1 else ""
            evidence.append(prefix + text)
        states = [supported for supported, _, _ in probed.values()]
        if not states:
            if all(r.outcome is Outcome.SKIPPED for r in results):
                return Support.NOT_CHECKED, _merged_needs(r.reason for r in results)
            return Support.SUPPORTED, ()
        if all(states):
            return Support.SUPPORTED, ()
        if any(states):
            return Support.PARTLY, tuple(evidence)
        if any(s is None for s in states):
            return Support.UNKNOWN, tuple(evidence)
        return Support.NOT_SUPPORTED, tuple(evidence)

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
            "exit_code": self.exit_code,
            "profiles": [p.to_json() for p in self.profiles()],
            "causes": [
                {"cause": cause, "checks": [r.id for r in results]}
                for cause, results in self.causes()
            ],
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
    """Every result: its title, the table of rows, the verdict line (an interrupted run is
    shown this way: what finished)."""
    title = f"rollout conform {report.base_url} (model {report.model})"
    if console.is_terminal:
        console.print(Text(title, style="bold"))
    else:
        _plain(console, title)
        _plain(console, "")
    _print_rows(report, console)
    _print_verdict(report, console)


def _print_rows(report: Report, console: Console) -> None:
    """The results: a table in a terminal wide enough, one line per check with its reason
    below in a narrow one, a Markdown table when the output is not a terminal."""
    rows = [(r.id, r.rule, _label(r), r.reason, _STYLE[r.outcome]) for r in report.results]
    if not console.is_terminal:
        _plain(console, "| check | rule | result | reason |")
        _plain(console, "|---|---|---|---|")
        for check, rule, label, reason, _ in rows:
            _plain(console, f"| {check} | {rule} | {label} | {_md(reason)} |")
        _plain(console, "")
    elif _fits(console, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]):
        table = Table(expand=True)
        table.add_column("check", no_wrap=True)
        table.add_column("rule", no_wrap=True)
        table.add_column("result", no_wrap=True)
        table.add_column("reason", ratio=1, overflow="fold")
        for check, rule, label, reason, style in rows:
            # Text, not markup: reasons quote server data, which may hold `[...]`.
            table.add_row(Text(check), Text(rule), Text(label, style=style), Text(reason))
        console.print(table)
    else:
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


def verdict_line(report: Report) -> str:
    """The last line: the verdict, the counts, and which profiles fail or are absent."""
    counts = report.counts()
    weak = f", {counts['weak']} weak (structure only)" if counts["weak"] else ""
    summary = (
        f"{counts['passed']} passed{weak}, {counts['failed']} failed, {counts['skipped']} "
        f"skipped in {report.seconds:.1f}s"
    )
    if report.interrupted:
        return f"INTERRUPTED (no verdict): {summary}"
    word = "NOT CONFORMANT" if report.failures else "conformant"
    notes = []
    profiles = report.profiles()
    if report.failures:
        notes.append("core fails" if not report.core_ok else "core passes")
        failing = [p.name for p in profiles if p.name != "core" and p.failures]
        if failing:
            notes.append("fails: " + ", ".join(failing))
    for support, what in ((Support.NOT_SUPPORTED, "not supported"), (Support.UNKNOWN, "unknown")):
        absent = [p.name for p in profiles if p.support is support and not p.failures]
        if absent:
            notes.append(f"{what}: " + ", ".join(absent))
    return f"{word}: {summary}" + (f" ({'; '.join(notes)})" if notes else "")


def _print_verdict(report: Report, console: Console) -> None:
    style = "bold yellow" if report.interrupted else "bold red" if report.failures else "bold green"
    console.print(Text(verdict_line(report), style=style), soft_wrap=not console.is_terminal)


def _merged_needs(reasons: Iterable[str]) -> tuple[str, ...]:
    """Distinct skip reasons, the `needs --option` ones merged into one."""
    needs: dict[str, None] = {}
    other: dict[str, None] = {}
    for reason in reasons:
        if reason.startswith("needs "):
            needs.update(dict.fromkeys(o.strip() for o in reason[6:].split(",")))
        else:
            other[reason] = None
    merged = ("needs " + ", ".join(needs),) if needs else ()
    return merged + tuple(other)


# The columns of the profile summary: name, verdict, then the counts.
_PROFILE_COLUMNS = (("profile", 12), ("result", 18))
_COUNT_COLUMNS = (("passed", 7), ("failed", 7), ("weak", 5), ("skipped", 8))


def _para(console: Console, text: str, indent: int, style: str = "") -> None:
    """`text` indented: wrapped between words in a terminal, one line when piped."""
    if not console.is_terminal:
        _plain(console, " " * indent + text)
        return
    width = max(console.width - indent, 20)
    for line in textwrap.wrap(text, width, break_on_hyphens=False):
        console.print(Text(" " * indent + line, style=style), soft_wrap=True)


def print_report(report: Report, console: Console, *, verbose: bool = False) -> None:
    """What a user reads: the summary per profile (supported or not and why, the counts),
    then only the failures (its rule, what was expected and what was observed; failures
    with one cause as one line naming it and how many checks it broke), then the verdict.
    `verbose` adds every row."""
    title = f"rollout conform {report.base_url} (model {report.model})"
    if console.is_terminal:
        console.print(Text(title, style="bold"))
    else:
        _plain(console, title)
    _plain(console, "")
    head = "".join(n.ljust(w) for n, w in _PROFILE_COLUMNS)
    head += "".join(n.rjust(w) for n, w in _COUNT_COLUMNS)
    _plain(console, head)
    for p in report.profiles():
        if p.support is Support.NOT_SELECTED:
            continue
        counts = (p.passed, p.failed, p.weak, p.skipped)
        line = Text.assemble(
            p.name.ljust(_PROFILE_COLUMNS[0][1]),
            (p.verdict.ljust(_PROFILE_COLUMNS[1][1]), _profile_style(p)),
            "".join(str(c).rjust(w) for c, (_, w) in zip(counts, _COUNT_COLUMNS, strict=True)),
        )
        console.print(line, soft_wrap=True)
        for text in p.evidence:
            _para(console, text, INDENT)
    if verbose:
        _plain(console, "")
        _print_rows(report, console)
    _print_failures(report, console)
    _plain(console, "")
    _print_verdict(report, console)


def _profile_style(p: ProfileVerdict) -> str:
    if p.failures:
        return "bold red"
    if p.support in (Support.SUPPORTED, Support.PARTLY):
        return "green"
    return "yellow"


def _print_failures(report: Report, console: Console) -> None:
    failed = [r for r in report.results if r.outcome is Outcome.FAILED]
    unsupported = [p for p in report.profiles() if p.required and p.failures and p.evidence]
    if not failed and not unsupported:
        return
    _plain(console, "")
    shared = {r.id: (cause, rs) for cause, rs in report.causes() for r in rs}
    causes = len({cause for cause, _ in shared.values()})
    alone = len(failed) - len(shared)
    what = f"{len(failed)} failed check{'s' if len(failed) != 1 else ''}"
    if shared:
        what += f" ({causes} shared cause{'s' if causes != 1 else ''}, {alone} alone)"
    _plain(console, what + ":")
    shown: set[str] = set()
    for r in failed:
        if r.id in shared:
            cause, results = shared[r.id]
            if cause in shown:
                continue
            shown.add(cause)
            one = "one cause" if results[0].cause == cause else "one observation"
            _failure_head(console, _group_label(results), f"{len(results)} checks, {one}")
            _para(console, cause, INDENT)
            _para(console, "broke: " + ", ".join(x.id for x in results), INDENT, "dim")
            continue
        _failure_head(console, _label(r), f"{r.id}  {r.rule}  {r.title}")
        _para(console, r.reason, INDENT)
    for p in unsupported:
        _failure_head(console, "FAILED", f"--require {p.name}: {p.support.value}")
        for text in p.evidence:
            _para(console, text, INDENT)


def _group_label(results: Sequence[CheckResult]) -> str:
    return "failed" if any(r.required for r in results) else "failed (optional)"


def _failure_head(console: Console, label: str, text: str) -> None:
    style = _STYLE[Outcome.FAILED] if label != "failed (optional)" else "red"
    if console.is_terminal:
        console.print(Text.assemble((label, style), "  ", text), soft_wrap=False)
    else:
        _plain(console, f"{label}  {text}")


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
