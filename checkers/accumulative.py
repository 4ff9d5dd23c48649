"""Accumulative error (msprobe 2.9): the absolute-threshold test with ``small_value = 1`` and the dtype's error
bound as both rtol and atol, plus error balance EB within its threshold, counted over the elements that are not
the correctly rounded oracle (those carry no accumulation error). For long reductions (sum, mean, norm),
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
        # an element equal to the oracle correctly rounded to the target's dtype carries no accumulation error at
        # all: it is left out of the bias test (a mean's gradient broadcasts one rounded value to every element,
        # so its rounding would otherwise count N times with one sign)
        rounded = _round_to(oracle if oracle is not None else bench, target)
        if rounded is not None and rounded.shape == t.shape:
            d = np.where(t == rounded, 0.0, d)
        n = int(np.count_nonzero(d)) if d.size else 0
        eb = float(abs(int((d > 0).sum()) - int((d < 0).sum())) / n) if n else 0.0
        res = judge_absolute(self.name, [(t, ref)], self.bound, 1.0, self.bound, {"error_balance": eb})
        thresholds = dict(res.thresholds, eb_threshold=max(self.eb, 4.0 / np.sqrt(n)) if n else self.eb)
        passing = dict(res.passing, eb_threshold=eb)
        # EB is a bias test. Ours: an unbiased error has EB ~ 1/sqrt(N), so msprobe's fixed threshold alone would
        # fail plain rounding noise for N < 1/threshold^2 (16384 for bf16); we also require 4 standard deviations
        # of that sign test, and do not judge EB below 100 elements.
        eb_limit = max(self.eb, 4.0 / np.sqrt(n)) if n else self.eb
        status = "error" if res.status == "error" or (n >= 100 and eb > eb_limit) else "pass"
        msg = res.message if res.status == "error" else (
            f"error balance {eb:.3g} > {thresholds['eb_threshold']:.3g} (biased accumulation)" if status == "error" else res.message)
        return CheckResult(self.name, status, res.metrics, thresholds, passing, msg)


def _round_to(reference, target):
    """``reference`` rounded to the dtype of ``target`` (round to nearest even, as torch casts), as float64; None
    when either is not a floating torch tensor."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    if not isinstance(reference, torch.Tensor) or not isinstance(target, torch.Tensor) or \
            not target.is_floating_point() or not reference.is_floating_point():
        return None
    return to_f64(reference.detach().cpu().to(target.dtype))
