"""Dropout: outputs are random, so only the share of zeros is judged, against ``p``: it is Binomial(N, p)/N, and a
share more than ``sigmas`` standard deviations from ``p`` is an error (msprobe compares the two sides' zero counts
within 10%; judging against ``p`` also catches a dropout that is wrong on both). Fewer than ``min_numel`` elements
pass, as msprobe."""

from __future__ import annotations

import math


from .common import load_yaml, to_f64
from .result import CheckResult


class DropoutStandard:
    """Args:
        dtype: unused. ``p``: the drop probability (default 0.5, as torch). ``sigmas`` (5), ``min_numel`` (100).
    """

    name = "dropout"

    def __init__(self, dtype: str = "fp32", p: float = 0.5, **overrides: float):
        cfg = dict(load_yaml("thresholds.yaml")["dropout"], **overrides)
        self.p, self.sigmas, self.min_numel = float(p), float(cfg["sigmas"]), int(cfg["min_numel"])

    def __call__(self, target, bench=None, oracle=None) -> CheckResult:
        t = to_f64(target)
        n = t.size
        share = float((t == 0).sum() / n) if n else 0.0
        tol = self.sigmas * math.sqrt(self.p * (1 - self.p) / n) if n else 1.0
        th = {"p": self.p, "tolerance": tol}
        if n < self.min_numel:
            return CheckResult(self.name, "pass", {"zero_share": share}, th, {}, f"{n} elements: too few to judge")
        dev = abs(share - self.p)
        status = "pass" if dev <= tol + 1.0 / n else "error"
        return CheckResult(self.name, status, {"zero_share": share}, th, {"tolerance": dev},
                           f"zero share {share:.4f} vs p={self.p:g} (tolerance {tol:.4f})")
