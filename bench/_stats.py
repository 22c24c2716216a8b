"""Summary statistics: median and tail percentiles of small samples."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["median", "percentile", "stats"]


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    data = sorted(values)
    if not data:
        raise ValueError("percentile of no values")
    if len(data) == 1:
        return data[0]
    rank = (len(data) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (rank - lo)


def median(values: Iterable[float]) -> float:
    return percentile(values, 50)


def stats(values: Iterable[float | None]) -> dict[str, Any] | None:
    """{n, mean, median, p90, p99, min, max} of the values that are not None; None if none."""
    data = [float(v) for v in values if v is not None]
    if not data:
        return None
    return {
        "n": len(data),
        "mean": sum(data) / len(data),
        "median": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
        "min": min(data),
        "max": max(data),
    }
