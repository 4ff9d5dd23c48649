"""The one result type every standard returns (Polygraphy-style: it knows the tolerance that would have passed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..status import STATUSES  # noqa: F401 - the one vocabulary (msprobe_ci.status); a result is never "unmatched"
from ..status import worst as _worst


@dataclass(frozen=True)
class CheckResult:
    """Verdict of one output pair under one standard.

    Attributes:
        standard: the standard's name (``benchmark``, ``absolute_threshold``, ``binary``, ``ulp``, ``thousandth``,
            ``accumulative``, ``legacy``, ``dropout``).
        status: ``pass`` / ``warning`` / ``error`` / ``skip``.
        metrics: the numbers measured (floats; names as in msprobe's details CSV where it has one).
        thresholds: the thresholds applied, by metric.
        passing: for each thresholded metric, the loosest threshold that would have passed (= the value measured,
            or the value a ``<=``-threshold must reach).
        message: one line saying why.
    """

    standard: str
    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    passing: dict[str, float] = field(default_factory=dict)
    message: str = ""

    @property
    def passed(self) -> bool:
        """``True`` for pass and warning (a warning passes the test and is reported)."""
        return self.status in ("pass", "warning")

    def with_status(self, status: str, message: str) -> "CheckResult":
        return CheckResult(self.standard, status, self.metrics, self.thresholds, self.passing, message)

    def as_dict(self) -> dict[str, Any]:
        return {"standard": self.standard, "status": self.status, "metrics": self.metrics,
                "thresholds": self.thresholds, "passing": self.passing, "message": self.message}


def worst(results: list[CheckResult]) -> str:
    """API-level status: error if any output errs, else warning, else pass (skips do not count unless all skip)."""
    return _worst(r.status for r in results)
