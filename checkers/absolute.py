"""Absolute threshold (msprobe 2.5): every normal element within ``rtol`` relative error, every small element
within ``small_value_atol`` absolute error, every inf/nan position consistent. Used for one-rounding elementwise
arithmetic, where the dtype's unit roundoff bounds the error of each element."""

from __future__ import annotations

import numpy as np

from .common import dtype_thresholds, f64, f64_slices, finite_masks, share, totals
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
        pairs: ``(target, reference, ...)`` tensors or NumPy arrays (judged as float64 tensors, the reference on
            the target's device), the output whole or in slices (:func:`~.common.f64_slices`): the ratios are
            counted and the maxima taken over all of them where the target lies, and brought back once.
        rtol: relative error allowed to normal elements. small: ``|reference|`` at or under it is a small value.
        atol: absolute error allowed to small values. extra: metrics added as they are.
    """
    import torch

    eps = float(np.finfo(np.float64).eps)
    parts, n = [], 0
    for t, ref, *_ in pairs:
        t = f64(t)
        ref = f64(ref, t.device)
        # each line is one to six ATen ops, a kernel launch each on an accelerator (about 30 a slice)
        finite, small_m, normal, mag = finite_masks(t, ref, small)
        ae = (t - ref).abs()  # inf - inf where both sides overflow: NaN, judged by position below
        re = torch.where(normal, ae / (mag + eps), 0.0)
        small_ae = torch.where(small_m, ae, 0.0)
        consistent = finite | (t == ref) | (torch.isnan(t) & torch.isnan(ref))
        # the errors are 0 outside their masks: a threshold >= 0 counts only the elements within them
        rel = re > rtol if rtol >= 0 else (re > rtol) & normal
        absolute = small_ae > atol if atol >= 0 else (ae > atol) & small_m
        counts = [finite, consistent, normal, rel, small_m, absolute]
        parts.append(torch.stack([c.sum() for c in counts] +  # int64 counts, stacked as float64
                                 [re.amax() if re.numel() else re.new_zeros(()),
                                  small_ae.amax() if ae.numel() else ae.new_zeros(())]))
        n += finite.numel()
    (n_finite, n_consistent, n_normal, n_rel, n_small, n_abs), (top_re, top_ae) = totals(parts, 6, 8)
    n_bad, n_inconsistent = n - int(n_finite), n - int(n_consistent)
    metrics = {"inf_nan_err_ratio": share(n_inconsistent, n_bad), "rel_err_ratio": share(n_rel, n_normal),
               "abs_err_ratio": share(n_abs, n_small)}
    passing = {"rtol": top_re, "small_value_atol": top_ae}
    metrics.update(extra or {})
    failed = [k for k in ("inf_nan_err_ratio", "rel_err_ratio", "abs_err_ratio") if metrics[k] > 0]
    status = "error" if failed else "pass"
    msg = ", ".join(f"{k} {metrics[k]:.3g}" for k in failed) or f"max relative error {passing['rtol']:.3g} <= {rtol:.3g}"
    return CheckResult(name, status, metrics, {"rtol": rtol, "small_value": small, "small_value_atol": atol},
                       passing, msg)
