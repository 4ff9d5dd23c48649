"""Absolute threshold (msprobe 2.5): every normal element within ``rtol`` relative error, every small element
within ``small_value_atol`` absolute error, every inf/nan position consistent. Used for one-rounding elementwise
arithmetic, where the dtype's unit roundoff bounds the error of each element."""

from __future__ import annotations

import numpy as np

from .common import dtype_thresholds, finite_masks, ratio, to_f64
from .result import CheckResult


class AbsoluteThresholdStandard:
    """Args:
        dtype: the target output dtype key (``bf16`` ...): picks ``rtol``, ``small_value``,
            ``small_value_atol_absolute`` from ``data/thresholds.yaml``.
        **overrides: any of those thresholds.
    """

    name = "absolute_threshold"

    def __init__(self, dtype: str = "fp32", **overrides: float):
        th = dtype_thresholds(dtype, overrides)
        self.rtol, self.small, self.atol = th["rtol"], th["small_value"], th["small_value_atol_absolute"]

    def __call__(self, target, bench, oracle=None) -> CheckResult:
        ref = to_f64(oracle if oracle is not None else bench)
        t = to_f64(target)
        return judge_absolute(self.name, t, ref, self.rtol, self.small, self.atol)


def judge_absolute(name: str, t: np.ndarray, ref: np.ndarray, rtol: float, small: float, atol: float,
                   extra: dict | None = None) -> CheckResult:
    finite, bad, small_m, normal = finite_masks(t, ref, small)
    with np.errstate(invalid="ignore"):  # inf - inf where both sides overflow: judged by position below
        ae = np.abs(t - ref)
        re = np.where(normal, ae / (np.abs(ref) + np.finfo(np.float64).eps), 0.0)
    consistent = (np.isnan(t) & np.isnan(ref)) | (t == ref)
    metrics = {"inf_nan_err_ratio": ratio(~consistent, bad), "rel_err_ratio": ratio(re > rtol, normal),
               "abs_err_ratio": ratio(ae > atol, small_m)}
    passing = {"rtol": float(re[normal].max()) if normal.any() else 0.0,
               "small_value_atol": float(ae[small_m].max()) if small_m.any() else 0.0}
    metrics.update(extra or {})
    failed = [k for k in ("inf_nan_err_ratio", "rel_err_ratio", "abs_err_ratio") if metrics[k] > 0]
    status = "error" if failed else "pass"
    msg = ", ".join(f"{k} {metrics[k]:.3g}" for k in failed) or f"max relative error {passing['rtol']:.3g} <= {rtol:.3g}"
    return CheckResult(name, status, metrics, {"rtol": rtol, "small_value": small, "small_value_atol": atol},
                       passing, msg)
