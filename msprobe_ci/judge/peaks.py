"""The largest magnitude of a tensor, in one pass: what the judge scales gradients and small values by."""

from __future__ import annotations

import math

import torch


def abs_peak(x: torch.Tensor) -> float:
    """``max |x|`` (NaN where ``x`` holds a NaN, as ``x.abs().amax()``) from one ``aminmax`` pass: no
    ``|x|`` copy (ten times faster on GPT-2's logits, CPU); 0.0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0
    if x.is_floating_point() and x.dtype.itemsize == 1:  # FP8: no reductions of its own, exact in float32
        x = x.float()
    lo, hi = (float(v) for v in torch.aminmax(x.detach()))
    if math.isnan(lo) or math.isnan(hi):
        return math.nan
    return max(abs(lo), abs(hi))


def finite_peak(x: torch.Tensor) -> float:
    """The largest finite ``|x|`` (NaN and inf left out; 0.0 when none is finite or ``x`` is empty), from one
    ``aminmax`` pass where every element is finite."""
    peak = abs_peak(x)
    if math.isfinite(peak):
        return peak
    if x.is_floating_point() and x.dtype.itemsize == 1:
        x = x.float()
    return float(torch.nan_to_num(x.detach().abs(), nan=0.0, posinf=0.0).amax())
