"""Binary consistency: bit-exact outputs (integers, bool, indices, data movement). msprobe 2.6: pass iff 0."""

from __future__ import annotations

from .common import f64
from .result import CheckResult


class BinaryStandard:
    """Mismatch rate ``#(target != bench) / N``; passes only at 0 (NaN equals NaN).

    Args:
        dtype: unused (the rule is the same for every dtype); kept for a uniform constructor.
    """

    name = "binary"

    def __init__(self, dtype: str = "fp32", **overrides: float):
        self.max_rate = float(overrides.get("max_mismatch_rate", 0.0))

    def __call__(self, target, bench, oracle=None) -> CheckResult:
        import torch

        t = target.detach() if isinstance(target, torch.Tensor) else f64(target)
        b = bench.detach() if isinstance(bench, torch.Tensor) else f64(bench)
        if t.dtype != b.dtype:  # compared as values: float64 (complex128) both
            t, b = f64(t), f64(b)
        b = b.to(t.device)
        # counted where the target lies (bit-exact in its own dtype: int64 beyond 2^53 included), one number back
        n = t.numel()
        same = t == b
        if t.is_floating_point() or t.is_complex():
            same = same | (torch.isnan(t) & torch.isnan(b))
        n_diff = int((~same).sum())
        rate = n_diff / n if n else 0.0
        status = "pass" if rate <= self.max_rate else "error"
        return CheckResult(self.name, status, {"mismatch_rate": rate}, {"mismatch_rate": self.max_rate},
                           {"mismatch_rate": rate},
                           f"{n_diff} of {n} elements differ" if status == "error" else "bit-exact")
