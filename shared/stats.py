"""One percentile definition for every benchmark in the project: the nearest rank.

p-th percentile of n values = the ceil(p * n)-th smallest (1-based), the smallest value with at least p of the
values at or below it. It is always one of the measured values, never an interpolation between two; p50 of an even
count is the lower middle value. (vLLM's benchmark_serving uses numpy's interpolating percentile, which can give a
value no request saw; the two agree to within one neighbouring value.)
"""
from __future__ import annotations

import math


def percentile(values, q: float) -> float:
    """The nearest-rank q-quantile (0 < q <= 1) of `values` (not empty)."""
    if not 0 < q <= 1:
        raise ValueError(f"percentile: q must be in (0, 1], got {q!r}")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile: no values")
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]
