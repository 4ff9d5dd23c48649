"""ULP error (msprobe 2.7) for matmul-like ops: the error in units in the last place of the target dtype at the
reference's magnitude. fp32 passes when mean ULP < 64 or the share of errors above 32 ULP is < 5%; fp16/bf16/fp8
when the share above 1 ULP is < 0.1%... against the fp64 oracle, where a correctly rounded result is 0.5 ULP."""

from __future__ import annotations

import numpy as np

from .common import dtype_thresholds, f64_slices
from .result import CheckResult


class UlpStandard:
    """Args:
        dtype: target output dtype key: ``ulp_min_exp``, ``ulp_mantissa_bits``, ``ulp_large``,
            ``ulp_max_large_ratio`` (and ``ulp_max_mean`` for fp32/fp64).
        **overrides: any of those.
    """

    name = "ulp"

    def __init__(self, dtype: str = "fp32", **overrides: float):
        th = dtype_thresholds(dtype, overrides)
        self.min_exp, self.bits = th["ulp_min_exp"], th["ulp_mantissa_bits"]
        self.large, self.max_ratio = th["ulp_large"], th["ulp_max_large_ratio"]
        self.max_mean = th.get("ulp_max_mean")

    def __call__(self, target, bench, oracle=None, floor=None) -> CheckResult:
        """Args:
            floor: optional per-element absolute error allowance (same shape), subtracted before the error is
                expressed in ULP: the accumulation error a correct kernel may add where a sum cancels (for a
                K-term dot product accumulated in fp32, ``K * 2^-24 * sum|a_k b_k|``).
        """
        ref_src = oracle if oracle is not None else bench
        total = finite_n = large_n = inconsistent = 0
        top = 0.0
        for t, ref, f in f64_slices(target, ref_src, floor):
            finite = np.isfinite(t) & np.isfinite(ref)
            _, ex = np.frexp(np.where(finite, ref, 0.0))  # |ref| = m * 2^ex, 0.5 <= m < 1: floor(log2|ref|) = ex - 1
            e = np.where(ref != 0, ex - 1, 0)
            np.maximum(e, int(self.min_exp), out=e)
            with np.errstate(invalid="ignore"):  # inf - inf where both sides overflow: judged by position below
                err = np.abs(t - ref)
            if f is not None and f.shape == err.shape:
                err = np.maximum(err - np.abs(f), 0.0)
            ulp = np.ldexp(err, (int(self.bits) - e).astype(np.int32))
            ulp = ulp if finite.all() else ulp[finite]
            inconsistent += int((~finite & ~((np.isnan(t) & np.isnan(ref)) | (t == ref))).sum())
            if ulp.size:
                total += float(ulp.sum())
                finite_n += ulp.size
                large_n += int((ulp > self.large).sum())
                top = max(top, float(ulp.max()))
        mean = total / finite_n if finite_n else 0.0
        share = large_n / finite_n if finite_n else 0.0
        metrics = {"max_ulp": top, "mean_ulp": mean, "large_ulp_ratio": share,
                   "inf_nan_mismatches": float(inconsistent)}
        thresholds = {"large_ulp_ratio": self.max_ratio, "ulp_large": self.large}
        ok = share < self.max_ratio
        if self.max_mean is not None:
            thresholds["mean_ulp"] = self.max_mean
            ok = ok or mean < self.max_mean
        status = "pass" if ok and not inconsistent else "error"
        msg = (f"{inconsistent} inf/nan positions differ" if inconsistent else
               f"mean ULP {mean:.3g}, {share:.3%} above {self.large:g} ULP"
               + (" beyond the accumulation allowance of cancelling sums" if floor is not None else ""))
        return CheckResult(self.name, status, metrics, thresholds, {"large_ulp_ratio": share, "mean_ulp": mean}, msg)
