"""Dropout: outputs are random, so only the share of zeros is judged, against ``p``: it is Binomial(N, p)/N, and a
share more than ``sigmas`` standard deviations from ``p`` is an error (msprobe compares the two sides' zero counts
within 10%; judging against ``p`` also catches a dropout that is wrong on both). Fewer than ``min_numel`` elements
pass, as msprobe.

Two things make the share of zeros not Binomial(numel, p), and the standard counts the draws that are:

* an input element that is zero is zero whatever the mask (a ReLU's output, padding): with the ``source`` (the
  dropout's input) given, only elements whose input is not zero are counted (MobileNetV2's classifier dropout,
  p=0.8 after ReLU6 and pooling, showed a zero share of 0.90 and failed a benign run);
* ``dropout1d``/``2d``/``3d`` drop whole channels: one draw per ``block`` elements (the channel's length, area or
  volume); a draw dropped when its whole block is zero, and a block whose input is all zero is not a draw;
* an element that is inf or NaN is no draw either: its input was (``inf * 0`` and ``NaN * 0`` are NaN), so the mask
  cannot be read there, dropped or kept alike (a pure fp16 MobileNetV2 whose first step overflowed trained its
  weights to NaN: its classifier dropout read a zero share of 0 against p=0.8 and failed as a wrong dropout)."""

from __future__ import annotations

import math

import numpy as np

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

    def __call__(self, target, bench=None, oracle=None, *, source=None, block: int = 1) -> CheckResult:
        """Judge ``target``'s share of zeros (a tensor or array of any shape).

        Args:
            source: the dropout's input, of ``target``'s shape, or ``None``: its zero elements are not draws.
            block: elements per draw, the trailing ones (1 for ``dropout``; H x W for ``dropout2d`` on
                (N, C, H, W)); the element count must divide by it.
        """
        t = to_f64(target).reshape(-1)
        src = to_f64(source).reshape(-1) if source is not None else None
        block = int(block) if block and t.size % int(block) == 0 else 1
        dropped = (t == 0).reshape(-1, block).all(axis=1)
        live = np.ones(dropped.shape, dtype=bool) if src is None or src.size != t.size else \
            (src != 0).reshape(-1, block).any(axis=1)
        odd = ~np.isfinite(t).reshape(-1, block).all(axis=1)
        live &= ~odd
        n_el, n = t.size, int(live.sum())
        share = float(dropped[live].sum() / n) if n else 0.0
        tol = self.sigmas * math.sqrt(self.p * (1 - self.p) / n) if n else 1.0
        th = {"p": self.p, "tolerance": tol}
        draws = f" over {n} draws" if n != n_el else ""
        if odd.any():
            draws += f" ({int(odd.sum())} inf/nan {'blocks' if block > 1 else 'elements'} read as no draw)"
        if n_el < self.min_numel or n < 2:
            return CheckResult(self.name, "pass", {"zero_share": share}, th, {},
                               f"{n_el} elements{draws.replace(' over', ',')}: too few to judge")
        dev = abs(share - self.p)
        status = "pass" if dev <= tol + 1.0 / n else "error"
        return CheckResult(self.name, status, {"zero_share": share}, th, {"tolerance": dev},
                           f"zero share {share:.4f}{draws} vs p={self.p:g} (tolerance {tol:.4f})")
