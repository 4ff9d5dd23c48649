"""The largest magnitude of a tensor, in one pass: what the judge scales gradients and small values by."""

from __future__ import annotations

import math

import torch

from .._perf import reads_wait


def abs_peak(x: torch.Tensor) -> float:
    """``max |x|`` (NaN where ``x`` holds a NaN, as ``x.abs().amax()``) from one ``aminmax`` pass: no
    ``|x|`` copy (ten times faster on GPT-2's logits, CPU); 0.0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0
    if x.is_floating_point() and x.dtype.itemsize == 1:  # FP8: no reductions of its own, exact in float32
        x = x.float()
    pair = torch.aminmax(x.detach())
    # two reads of 0-d CPU tensors, or one transfer from a device (each read would wait for it)
    lo, hi = torch.stack(pair).tolist() if reads_wait(x) else (float(v) for v in pair)
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


def row_facts(oracle: torch.Tensor | None, t: torch.Tensor | None = None, b: torch.Tensor | None = None) -> tuple:
    """``(abs_peak(oracle), finite_peak(oracle), torch.equal(t, b))`` for a row judged on an accelerator, brought to
    the host in **one** transfer (issue 51: each of them alone is a synchronisation of the device, three per
    judged row): one ``aminmax`` of the oracle and one comparison; the finite peak is the peak itself wherever the
    oracle is finite, and only an oracle holding an infinity or a NaN costs a second transfer for it. ``None`` for
    a part not asked (``oracle`` None; ``t``/``b`` None) or that cannot be given (an empty or non-floating
    oracle); shapes, dtypes or devices that differ are never equal. Each part is what its function returns (a NaN
    peak where the oracle holds a NaN; NaN never equal to itself)."""
    parts: list = []
    x = None
    if isinstance(oracle, torch.Tensor) and oracle.is_floating_point() and oracle.numel():
        x = oracle.detach()
        if x.dtype.itemsize == 1:  # FP8: no reductions of its own, exact in float32
            x = x.float()
        parts += list(torch.aminmax(x))
    same = None
    if isinstance(t, torch.Tensor) and isinstance(b, torch.Tensor):
        if t.shape != b.shape or t.dtype != b.dtype or t.device != b.device:
            same = False
        elif t.numel():
            parts.append((t.detach() == b.detach()).all())
        else:
            same = True
    if not parts:
        return None, None, same
    device = parts[0].device
    values = torch.stack([p.to(device=device, dtype=torch.float64) for p in parts]).tolist()
    peak = top = None
    if x is not None:
        lo, hi = values[:2]
        values = values[2:]
        peak = math.nan if math.isnan(lo) or math.isnan(hi) else max(abs(lo), abs(hi))
        top = peak if math.isfinite(peak) else float(torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).amax())
    if values:
        same = values[0] == 1.0
    return peak, top, same
