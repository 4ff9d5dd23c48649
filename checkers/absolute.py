"""Absolute threshold (msprobe 2.5): every normal element within ``rtol`` relative error, every small element
within ``small_value_atol`` absolute error, every inf/nan position consistent. Used for one-rounding elementwise
arithmetic, where the dtype's unit roundoff bounds the error of each element."""

from __future__ import annotations

import numpy as np

from .common import dtype_thresholds, f64_slices, finite_masks, share
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
        ref = oracle if oracle is not None else bench
        return judge_absolute(self.name, f64_slices(target, ref), self.rtol, self.small, self.atol)


def judge_absolute(name: str, pairs, rtol: float, small: float, atol: float,
                   extra: dict | None = None) -> CheckResult:
    """The absolute-threshold verdict of one output.

    Args:
        pairs: ``(target, reference, ...)`` float64 arrays, the output whole or in slices
            (:func:`~.common.f64_slices`): the ratios are counted and the maxima taken over all of them.
        rtol: relative error allowed to normal elements. small: ``|reference|`` at or under it is a small value.
        atol: absolute error allowed to small values. extra: metrics added as they are.
    """
    eps = np.finfo(np.float64).eps
    n_bad = n_inconsistent = n_normal = n_rel = n_small = n_abs = 0
    top_re = top_ae = 0.0
    for t, ref, *_ in pairs:
        finite, bad, small_m, normal = finite_masks(t, ref, small)
        with np.errstate(invalid="ignore"):  # inf - inf where both sides overflow: judged by position below
            ae = np.abs(t - ref)
            re = np.where(normal, ae / (np.abs(ref) + eps), 0.0)
        consistent = (np.isnan(t) & np.isnan(ref)) | (t == ref)
        n_bad += int(bad.sum())
        n_inconsistent += int((~consistent & bad).sum())
        n_normal += int(normal.sum())
        n_rel += int(((re > rtol) & normal).sum())
        n_small += int(small_m.sum())
        n_abs += int(((ae > atol) & small_m).sum())
        if normal.any():
            top_re = max(top_re, float(re[normal].max()))
        if small_m.any():
            top_ae = max(top_ae, float(ae[small_m].max()))
    metrics = {"inf_nan_err_ratio": share(n_inconsistent, n_bad), "rel_err_ratio": share(n_rel, n_normal),
               "abs_err_ratio": share(n_abs, n_small)}
    passing = {"rtol": top_re, "small_value_atol": top_ae}
    metrics.update(extra or {})
    failed = [k for k in ("inf_nan_err_ratio", "rel_err_ratio", "abs_err_ratio") if metrics[k] > 0]
    status = "error" if failed else "pass"
    msg = ", ".join(f"{k} {metrics[k]:.3g}" for k in failed) or f"max relative error {passing['rtol']:.3g} <= {rtol:.3g}"
    return CheckResult(name, status, metrics, {"rtol": rtol, "small_value": small, "small_value_atol": atol},
                       passing, msg)
