"""Small statistics helpers: nearest-rank percentiles and medians that tolerate gaps."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no data."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def median(values: Iterable[float | None]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan
