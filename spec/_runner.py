"""Running the checks: select, gate (missing options, absent features), run in the order of
the case list with bounded concurrency and a deadline each, collect a `Report`.

The run never hangs: every check has a deadline, every network operation inside it a
timeout, and a server that cannot be reached at all fails every selected check at once
(a TCP connect with a short timeout is tried first).
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Sequence

import httpx
import trio

from ._catalog import CHECKS, FEATURE_PROBES
from ._client import CheckFailed, CheckSkipped
from ._context import (
    OPTION_FLAGS,
    Case,
    Context,
    Options,
    ProbeFailed,
    Probes,
    load_cases,
    load_profiles,
)
from ._preflight import connect_problem
from ._report import CheckResult, Outcome, Report

__all__ = ["run_conformance", "run_conformance_sync", "select_cases"]

OnStart = Callable[[Case], None]
OnResult = Callable[[CheckResult], None]


def select_cases(
    cases: Sequence[Case], patterns: Sequence[str], profiles: Sequence[str] = ()
) -> list[Case]:
    """The cases of `profiles` (all of them when empty) whose id, rule, feature or profile
    matches one of `patterns` (exact, or a glob such as `rollout.*` or `WS-3.*`); all cases
    without patterns. A pattern or a profile matching nothing is an error."""
    if profiles:
        known = [p.name for p in load_profiles()]
        for name in profiles:
            if name not in known:
                raise ValueError(
                    f"--profile {name!r} is not a profile (the profiles: {', '.join(known)})"
                )
        cases = [c for c in cases if c.profile in profiles]
    if not patterns:
        return list(cases)
    chosen: set[str] = set()
    for pattern in patterns:
        hits = {
            c.id
            for c in cases
            if any(
                fnmatch.fnmatchcase(name, pattern) for name in (c.id, c.rule, c.feature, c.profile)
            )
        }
        if not hits:
            raise ValueError(f"--filter {pattern!r} matches no check id, rule or feature")
        chosen |= hits
    return [c for c in cases if c.id in chosen]


def _leaf(exc: BaseException) -> BaseException:
    """The most telling exception inside an exception group (a check verdict if any)."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves: list[BaseException] = []
    stack: list[BaseException] = [exc]
    while stack:
        node = stack.pop()
        if isinstance(node, BaseExceptionGroup):
            stack.extend(node.exceptions)
        else:
            leaves.append(node)
    for kind in (CheckFailed, CheckSkipped):
        for leaf in leaves:
            if isinstance(leaf, kind):
                return leaf
    return leaves[0] if leaves else exc


async def _run_case(
    case: Case,
    base_url: str,
    options: Options,
    http: httpx.AsyncClient,
    probes: Probes,
) -> CheckResult:
    ctx = Context(base_url, options, http, probes, case)
    started = trio.current_time()
    outcome, reason = Outcome.PASSED, ""
    unsupported = False
    probe_ctx: Context | None = None
    with trio.CancelScope(deadline=started + options.timeout) as scope:
        ctx.deadline_scope = scope
        try:
            missing = [n for n in case.needs if getattr(options, n, None) is None]
            if missing:
                raise CheckSkipped("needs " + ", ".join(OPTION_FLAGS.get(n, n) for n in missing))
            probe = FEATURE_PROBES.get(case.feature)
            if probe is not None:
                # The probe talks to the server in a context of its own: what it sees is its
                # own evidence, not the check's.
                probe_ctx = Context(base_url, options, http, probes, case)
                probe_ctx.deadline_scope = scope
                try:
                    why_not = await probes.get(
                        case.feature, functools.partial(probe, probe_ctx), probe_ctx.cause
                    )
                except ProbeFailed as exc:
                    unsupported = True
                    raise CheckSkipped(f"not probed: {exc}") from None
                if why_not:
                    unsupported = True
                    raise CheckSkipped(str(why_not))
            ctx.step = ""
            await CHECKS[case.id](ctx)
        except Exception as exc:
            leaf = _leaf(exc)
            if isinstance(leaf, CheckFailed):
                outcome, reason = Outcome.FAILED, str(leaf)
            elif isinstance(leaf, CheckSkipped):
                outcome, reason = Outcome.SKIPPED, str(leaf)
            else:
                outcome = Outcome.FAILED
                reason = f"unexpected {type(leaf).__name__}: {leaf}"
    if outcome is Outcome.PASSED and ctx.weak:
        outcome, reason = Outcome.WEAK, "; ".join(dict.fromkeys(ctx.weak))
    if scope.cancelled_caught:
        outcome = Outcome.FAILED
        reason = f"timed out after {trio.current_time() - started:.1f}s"
        step = ctx.step or (probe_ctx.step if probe_ctx is not None else "")
        if step:
            reason += f" ({step})"
    return CheckResult(
        id=case.id,
        rule=case.rule,
        title=case.title,
        feature=case.feature,
        required=case.required,
        outcome=outcome,
        reason=reason,
        seconds=trio.current_time() - started,
        profile=case.profile,
        cause=ctx.cause(reason) if outcome is Outcome.FAILED else None,
        unsupported=unsupported and outcome is Outcome.SKIPPED,
    )


async def run_conformance(
    base_url: str,
    options: Options | None = None,
    *,
    on_start: OnStart | None = None,
    on_result: OnResult | None = None,
) -> Report:
    """Run the selected checks against the server at `base_url` (e.g.
    `http://127.0.0.1:8000/v1`) and return the report. `on_start` and `on_result` are called
    as each check starts and ends (for a progress view)."""
    options = options or Options()
    cases = select_cases(load_cases(), options.filter, options.profiles)
    missing = [c.id for c in cases if c.id not in CHECKS]
    if missing:
        raise LookupError(f"checks.json lists checks with no implementation: {missing}")
    started = trio.current_time()
    results: dict[str, CheckResult] = {}
    probes = Probes()
    problem = await connect_problem(base_url)
    if problem is not None:
        unreachable = problem.message
        for case in cases:
            result = CheckResult(
                id=case.id,
                rule=case.rule,
                title=case.title,
                feature=case.feature,
                required=case.required,
                outcome=Outcome.FAILED,
                reason=unreachable,
                profile=case.profile,
                cause=unreachable,
            )
            results[case.id] = result
            if on_result is not None:
                on_result(result)
    else:
        # Checks start in the order of the case list, at most `concurrency` at once: a slot is
        # taken before a check starts and given back once its result is out.
        slots = trio.Semaphore(options.concurrency)
        async with httpx.AsyncClient(timeout=options.timeout, follow_redirects=False) as http:

            async def one(case: Case) -> None:
                try:
                    if on_start is not None:
                        on_start(case)
                    result = await _run_case(case, base_url, options, http, probes)
                    results[case.id] = result
                    if on_result is not None:
                        on_result(result)
                finally:
                    slots.release()

            async with trio.open_nursery() as nursery:
                for case in cases:
                    await slots.acquire()
                    nursery.start_soon(one, case)
    return Report(
        base_url=base_url,
        model=options.model,
        results=tuple(results[c.id] for c in cases),
        seconds=trio.current_time() - started,
        features=probes.known(),
        findings=probes.findings(),
        required_features=tuple(options.require),
    )


def run_conformance_sync(base_url: str, options: Options | None = None) -> Report:
    """`run_conformance` for synchronous callers (starts its own trio run)."""
    return trio.run(functools.partial(run_conformance, base_url, options))
