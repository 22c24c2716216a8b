"""Was the machine busy with other work during the run? (`meta.machine_load`)

The rule (bench/README.md, "A loaded machine"): the machine was **loaded** when the other
processes on it (and, on a virtual machine, the time its hypervisor took: steal) used on
average at least `LOADED_SHARE` of its CPUs while the run lasted: 0.5 of 2 CPUs. Other work
is the machine's busy CPU time (`/proc/stat`: user, nice, system, irq, softirq, steal) minus
the benchmark's own (its process and its servers', `getrusage` of itself and of its waited
children), over the run's wall time. Where `/proc/stat` cannot be read, the 1-minute load
average at the start of the run stands in for it (loaded at `LOADED_SHARE` of the CPUs).

On a loaded machine the timings, and the goals judged by them, are not trustworthy: the
verdict says so (the goals are still reported).
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import attrs

__all__ = ["LOADED_SHARE", "CpuSample", "judge_load", "load_warning", "sample_cpu"]

# The share of the machine's CPUs that other work must use, on average over the run, for the
# machine to count as loaded.
LOADED_SHARE = 0.25
# /proc/stat's first line: the machine's CPU time by state, in clock ticks.
PROC_STAT = Path("/proc/stat")
# Its busy states (user nice system idle iowait irq softirq steal ...: all but idle, iowait
# and the guest times, which user already counts).
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)

RULE = (
    f"loaded: other processes (and steal) used at least {LOADED_SHARE:.0%} of the CPUs on "
    "average during the run (/proc/stat's busy time minus the benchmark's own CPU time, its "
    "servers' included); without /proc/stat, a 1-minute load average at the start of at "
    f"least {LOADED_SHARE:.0%} of the CPUs"
)


@attrs.frozen
class CpuSample:
    """The machine's busy CPU seconds (None: no /proc/stat), the benchmark's own CPU
    seconds (its process and its waited children) and the wall clock, at one moment."""

    machine_busy_s: float | None
    own_s: float
    wall_s: float


def _machine_busy_s(stat: Path = PROC_STAT) -> float | None:
    try:
        first = stat.read_text().splitlines()[0].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return sum(int(first[1 + i]) for i in _BUSY_FIELDS) / ticks
    except (OSError, ValueError, IndexError):
        return None


def sample_cpu() -> CpuSample:
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return CpuSample(_machine_busy_s(), own, time.monotonic())


def judge_load(
    start: CpuSample | None,
    end: CpuSample | None,
    cpu_count: int | None,
    load_start: list[float] | None,
    *,
    url_servers: bool = False,
) -> dict[str, Any]:
    """`meta.machine_load`: the other work's CPUs, the load average at the start, whether the
    machine was loaded (null: neither could be measured), the rule and the reason in words."""
    other: float | None = None
    if (
        start is not None
        and end is not None
        and start.machine_busy_s is not None
        and end.machine_busy_s is not None
        and end.wall_s > start.wall_s
    ):
        used = (end.machine_busy_s - start.machine_busy_s) - (end.own_s - start.own_s)
        other = max(0.0, used / (end.wall_s - start.wall_s))
    load = None if load_start is None else load_start[0]
    loaded: bool | None = None
    reason = "not measured: no /proc/stat, load average or CPU count"
    if cpu_count:
        limit = LOADED_SHARE * cpu_count
        if other is not None:
            loaded = other >= limit
            reason = (
                f"other processes used {other:.2f} of {cpu_count} CPUs on average during the run "
                f"({'at least' if loaded else 'under'} {limit:g})"
            )
            if loaded and url_servers:
                reason += "; servers given by --url on this machine count as other work"
        elif load is not None:
            loaded = load >= limit
            reason = (
                f"the 1-minute load average was {load:.2f} on {cpu_count} CPUs at the start "
                f"({'at least' if loaded else 'under'} {limit:g}; no /proc/stat to measure the "
                "run itself)"
            )
    return {
        "cpu_count": cpu_count,
        "other_cpus": other,
        "load_average_start": load,
        "loaded": loaded,
        "reason": reason,
        "rule": RULE,
    }


def load_warning(results: dict[str, Any]) -> str | None:
    """The verdict's sentence on a loaded machine (None: it was not loaded, or results from
    before `machine_load` was recorded)."""
    load = results["meta"].get("machine_load")
    if not load or not load["loaded"]:
        return None
    return (
        f"the machine was loaded ({load['reason']}): the timings, and the goals judged by "
        "them, are not trustworthy; run again on a quiet machine"
    )
