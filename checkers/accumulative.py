"""Accumulative error (msprobe 2.9): the absolute-threshold test with ``small_value = 1`` and the dtype's error
bound as both rtol and atol, plus error balance EB within its threshold. For long reductions (sum, mean, norm),
whose error grows with the number of accumulated terms but must stay unbiased."""

from __future__ import annotations

import numpy as np

from .absolute import judge_absolute
from .common import dtype_thresholds, to_f64
from .result import CheckResult


class AccumulativeStandard:
    """Args:
        dtype: target output dtype key: picks ``accumulative_bound`` and ``eb_threshold``.
        **overrides: any threshold of that dtype.
    """

    name = "accumulative"

    def __init__(self, dtype: str = "fp32", **overrides: float):
        th = dtype_thresholds(dtype, overrides)
        self.bound, self.eb = th["accumulative_bound"], th["eb_threshold"]

    def __call__(self, target, bench, oracle=None) -> CheckResult:
        ref = to_f64(oracle if oracle is not None else bench)
        t = to_f64(target)
        d = t - ref
        n = d.size
        eb = float(abs(int((d > 0).sum()) - int((d < 0).sum())) / n) if n else 0.0
        res = judge_absolute(self.name, t, ref, self.bound, 1.0, self.bound, {"error_balance": eb})
        thresholds = dict(res.thresholds, eb_threshold=max(self.eb, 4.0 / np.sqrt(n)) if n else self.eb)
        passing = dict(res.passing, eb_threshold=eb)
        # EB is a bias test. Ours: an unbiased error has EB ~ 1/sqrt(N), so msprobe's fixed threshold alone would
        # fail plain rounding noise for N < 1/threshold^2 (16384 for bf16); we also require 4 standard deviations
        # of that sign test, and do not judge EB below 100 elements.
        eb_limit = max(self.eb, 4.0 / np.sqrt(n)) if n else self.eb
        status = "error" if res.status == "error" or (n >= 100 and eb > eb_limit and not np.all(d == 0)) else "pass"
        msg = res.message if res.status == "error" else (
            f"error balance {eb:.3g} > {thresholds['eb_threshold']:.3g} (biased accumulation)" if status == "error" else res.message)
        return CheckResult(self.name, status, res.metrics, thresholds, passing, msg)
