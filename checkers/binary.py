"""Binary consistency: bit-exact outputs (integers, bool, indices, data movement). msprobe 2.6: pass iff 0."""

from __future__ import annotations

import numpy as np

from .common import to_f64
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
        t, b = to_f64(target), to_f64(bench)
        n = t.size
        diff = ~((t == b) | (np.isnan(t) & np.isnan(b)))
        rate = float(diff.sum() / n) if n else 0.0
        status = "pass" if rate <= self.max_rate else "error"
        return CheckResult(self.name, status, {"mismatch_rate": rate}, {"mismatch_rate": self.max_rate},
                           {"mismatch_rate": rate},
                           f"{int(diff.sum())} of {n} elements differ" if status == "error" else "bit-exact")
