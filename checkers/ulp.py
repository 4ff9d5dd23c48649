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
        parts, n = [], 0
        for t, ref, f in f64_slices(target, ref_src, floor):
            if t.is_complex() or ref.is_complex():
                raise TypeError("the ULP standard judges real values; a complex output has no unit in the last place")
            # each line is one or two ATen ops, a kernel launch each on an accelerator (about 28 a slice)
            finite = (t - t) == (ref - ref)  # both finite: x - x is +0 for a finite x, NaN for ±inf and NaN
            err = (t - ref).abs()  # inf - inf where both sides overflow: NaN, judged by position below
            if f is not None and f.shape == err.shape:
                err = (err - f.abs()).clamp_min(0.0)
            ulp = _in_ulp(err, ref, int(self.bits), int(self.min_exp))
            consistent = finite | (t == ref) | (torch.isnan(t) & torch.isnan(ref))
            kept = torch.where(finite, ulp, 0.0)  # every ULP error is >= 0: the left-out elements add nothing
            large = kept > self.large if self.large >= 0 else (ulp > self.large) & finite
            parts.append(torch.stack([kept.sum(), finite.sum(), large.sum(), consistent.sum(),  # as float64
                                      kept.amax() if kept.numel() else kept.new_zeros(())]))
            n += consistent.numel()
        (total, finite_n, large_n, consistent_n), (top,) = totals(parts, 4, 5)
        inconsistent = n - int(consistent_n)
        finite_n, large_n = int(finite_n), int(large_n)
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


def _in_ulp(err, ref, bits: int, min_exp: int):
    """``err`` (float64, >= 0) in units in the last place of a dtype with ``bits`` mantissa bits at ``ref``'s
    magnitude: ``err * 2^(bits - e)``, ``e`` the reference's exponent ``floor(log2 |ref|)`` raised to ``min_exp``
    (0 for an exact zero, msprobe's rule), rounded once as ``ldexp``. Built on the exponent fields of the float64
    bits (:func:`_exponent_field`, :func:`_scaled`), exact on every device, in eight ATen ops; the values at a
    non-finite ``ref`` are meaningless and left out by the caller."""
    import torch

    field = torch.where(ref == 0, 1023, _exponent_field(ref).clamp_min(min_exp + 1023))  # e + 1023
    # the exponent field of 2^(bits - e) is bits - e + 1023 = bits + 2046 - field
    return _scaled(err, (bits + 2046) - field, wide=bits - min_exp > 1023)


def _exponent_field(x):
    """The 11-bit exponent field of each float64 element (int64): ``floor(log2 |x|) + 1023`` for a normal
    number, 0 for zeros and subnormals (under every dtype's smallest ULP exponent, ``ulp_min_exp`` >= -1022, to
    which the caller raises them), 2047 for ±inf and NaN."""
    import torch

    return (x.view(torch.int64) >> 52) & 0x7FF


def _scaled(x, field, wide: bool = True):
    """``x * 2**k`` for float64 ``x``, given ``field = k + 1023``, the exponent field of ``2**k`` (elementwise,
    ``k`` from ``2 - 1023``: fp8 e5m2's largest ULP exponent, to ``52 + 1022``: fp64's smallest), rounded once as
    ``ldexp``: each power of two is built from its exponent bits, exact on every device, and ``k`` above 1023
    (2^1074 is no float64) takes the rest as a second factor (1.0 for every other ``k``). ``wide`` False: every
    ``k`` is at most 1023 (every dtype but float64: its ULP exponents stay above -1000), and the second factor,
    exactly 1.0, is not built (four ATen ops fewer: on an accelerator each is a launch)."""
    import torch

    if not wide:
        return x * (field << 52).view(torch.float64)
    first = field.clamp(max=2046)
    return x * (first << 52).view(torch.float64) * ((field - first + 1023) << 52).view(torch.float64)
