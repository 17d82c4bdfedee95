"""Percentiles and the few numbers every timing is reduced to."""

from __future__ import annotations

import math
from typing import Any, Sequence


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (q in 0..100)."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarize(seconds: Sequence[float]) -> dict[str, Any]:
    """Latency samples in seconds → milliseconds: n, p50, p99, p99.9, mean, min, max."""
    ordered = sorted(seconds)
    if not ordered:
        return {"n": 0}
    ms = 1000.0
    return {
        "n": len(ordered),
        "p50_ms": percentile(ordered, 50) * ms,
        "p99_ms": percentile(ordered, 99) * ms,
        "p999_ms": percentile(ordered, 99.9) * ms,
        "mean_ms": sum(ordered) / len(ordered) * ms,
        "min_ms": ordered[0] * ms,
        "max_ms": ordered[-1] * ms,
    }


def ratio(value: float | None, floor: float | None) -> float | None:
    if value is None or floor is None or floor == 0 or math.isnan(value) or math.isnan(floor):
        return None
    return value / floor
