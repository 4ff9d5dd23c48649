"""ULP error (msprobe 2.7) for matmul-like ops: the error in units in the last place of the target dtype at the
reference's magnitude. fp32 passes when mean ULP < 64 or the share of errors above 32 ULP is < 5%; fp16/bf16/fp8
when the share above 1 ULP is < 0.1%... against the fp64 oracle, where a correctly rounded result is 0.5 ULP."""

from __future__ import annotations

from .common import dtype_thresholds, f64_slices, totals
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
        import torch

        ref_src = oracle if oracle is not None else bench
        parts = []
        for t, ref, f in f64_slices(target, ref_src, floor):
            if t.is_complex() or ref.is_complex():
                raise TypeError("the ULP standard judges real values; a complex output has no unit in the last place")
            finite = torch.isfinite(t) & torch.isfinite(ref)
            # a non-finite reference's exponent bits read 1024: its element is left out of every sum below
            e = torch.where(ref != 0, _exponent(ref), 0).clamp_min(int(self.min_exp))
            err = (t - ref).abs()  # inf - inf where both sides overflow: NaN, judged by position below
            if f is not None and f.shape == err.shape:
                err = (err - f.abs()).clamp_min(0.0)
            ulp = _scaled(err, int(self.bits) - e, wide=int(self.bits) - int(self.min_exp) > 1023)
            inconsistent = ~finite & ~((torch.isnan(t) & torch.isnan(ref)) | (t == ref))
            kept = torch.where(finite, ulp, 0.0)  # every ULP error is >= 0: the left-out elements add nothing
            parts.append(torch.stack([kept.sum(), finite.sum(), ((ulp > self.large) & finite).sum(),  # as float64
                                      inconsistent.sum(),
                                      kept.amax() if kept.numel() else kept.new_zeros(())]))
        (total, finite_n, large_n, inconsistent), (top,) = totals(parts, 4, 5)
        finite_n, large_n, inconsistent = int(finite_n), int(large_n), int(inconsistent)
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


def _exponent(x):
    """``floor(log2 |x|)`` of each normal float64 element, read from its exponent bits (exact on every device);
    zeros and subnormals read -1023, under every dtype's smallest ULP exponent (``ulp_min_exp`` >= -1022),
    to which the caller raises them."""
    import torch

    return ((x.view(torch.int64) >> 52) & 0x7FF) - 1023


def _scaled(x, k, wide: bool = True):
    """``x * 2**k`` for float64 ``x`` and integer ``k`` (elementwise, from ``2 - 1023``: fp8 e5m2's largest ULP
    exponent, to ``52 + 1022``: fp64's smallest), rounded once as ``ldexp``: each power of two is built from its
    exponent bits, exact on every device, and ``k`` above 1023 (2^1074 is no float64) takes the rest as a second
    factor (1.0 for every other ``k``). ``wide`` False: every ``k`` is at most 1023 (every dtype but float64: its
    ULP exponents stay above -1000), and the second factor, exactly 1.0, is not built (six ATen ops fewer per
    slice: on an accelerator each is a launch)."""
    import torch

    if not wide:
        return x * ((k + 1023) << 52).view(torch.float64)
    first = k.clamp(max=1023)
    return x * ((first + 1023) << 52).view(torch.float64) * ((k - first + 1023) << 52).view(torch.float64)
