"""Dual thousandth (msprobe 2.8, conv1d/conv2d): at least 99.9% of elements within 0.1% relative error."""

from __future__ import annotations

import math

import numpy as np

from .common import to_f64
from .result import CheckResult


class ThousandthStandard:
    """Args:
        dtype: unused (msprobe applies one rule); overrides ``rel_tol`` (0.001) and ``min_ratio`` (0.999).
    """

    name = "thousandth"

    def __init__(self, dtype: str = "fp32", **overrides: float):
        self.tol = float(overrides.get("rel_tol", 0.001))
        self.min_ratio = float(overrides.get("min_ratio", 0.999))

    def __call__(self, target, bench, oracle=None) -> CheckResult:
        ref = to_f64(oracle if oracle is not None else bench)
        t = to_f64(target)
        re = np.abs(t - ref) / (np.abs(ref) + np.finfo(np.float32).eps)
        re = np.where(np.isnan(t) & np.isnan(ref), 0.0, re)
        n = re.size
        share = float((re <= self.tol).sum() / n) if n else 1.0
        status = "pass" if share >= self.min_ratio else "error"
        q = float(np.quantile(re[np.isfinite(re)], self.min_ratio)) if np.isfinite(re).any() else math.inf
        return CheckResult(self.name, status, {"rel_err_thousandth": share},
                           {"rel_tol": self.tol, "min_ratio": self.min_ratio}, {"rel_tol": q},
                           f"{share:.4%} of elements within {self.tol:g} relative error")
