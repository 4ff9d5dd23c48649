"""The fields of a record that say a verdict (isolation's records, a replayed item's, a reproduction's): the
headline metric of a :class:`~msprobe_ci.checkers.CheckResult` against its threshold, and the rest as JSON."""

from __future__ import annotations

import math
from typing import Any


def headline(result) -> tuple[str, float, float]:
    """``(metric, value, threshold)`` of a :class:`~msprobe_ci.checkers.CheckResult`: the thresholded metric
    closest to (or furthest past) its threshold; ``(standard, 0, 0)`` when nothing is thresholded."""
    best = (result.standard, 0.0, 0.0, -math.inf)
    for k, v in (result.passing or {}).items():
        th = (result.thresholds or {}).get(k)
        if th is None or not isinstance(v, (int, float)):
            continue
        r = v / th if th > 0 else (math.inf if v > 0 else 0.0)
        if r > best[3]:
            best = (k, float(v), float(th), r)
    return best[0], best[1], best[2]


def verdict_fields(row: str, result, note: str = "") -> dict[str, Any]:
    """The fields of an isolation record that say a row's verdict: standard, headline metric, value, threshold,
    row, message (``note`` appended) and every metric (non-finite numbers as strings, for JSON)."""
    metric, value, threshold = headline(result)
    return {"standard": result.standard, "metric": metric, "value": _num(value), "threshold": _num(threshold),
            "row": row, "message": f"{result.standard} {result.status}: {result.message}{note}",
            "metrics": {k: _num(v) for k, v in (result.metrics or {}).items()}}


def _num(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x
