"""Quantization into an FP8 format (``float8_e4m3fn``, ``float8_e5m2``), judged against the call's own wider input.

A cast ``q = (x / scale).to(float8)`` is bit-exact against any bench (the cast is correctly rounded everywhere), so
the binary standard passes it whatever the scale. What the call may lose is set by the scale: FP8 has a relative
precision of one part in 16 (e4m3) or 8 (e5m2) for normal numbers whatever their magnitude, and loses more only where
values fall into its subnormals or to zero (a scale too small: a stale amax history) or are clipped at its largest
value (a scale too large). The standard measures, on the wider input ``x`` the cast was given:

* ``quant_err``: the normwise relative error ``||q - x|| / ||x||`` of the cast as made;
* ``ideal_quant_err``: the same for ``x`` scaled by its own amax to the format's largest value (the scale a
  current-scaling recipe picks: torchao's and Transformer Engine's per-tensor current scaling), mapped back;
* ``quant_err_ratio``: their ratio (the benchmark standard's idea: the target's error over the error a good
  implementation makes on the same input), at most :data:`thresholds.yaml` ``quantization.quant_err_ratio``;
* ``underflow_share``: non-zero finite elements quantized to 0 (Transformer Engine's ``underflows%``);
* ``saturated_share``: finite elements beyond the format's largest value by more than half its spacing there
  (where rounding cannot reach: the cast clips them, or makes them NaN where the format has no saturation). A
  recipe that clamps before its cast (torchao's ``to_fp8_saturated``) hands the cast values already clipped: that
  clipping is the clamp's, out of this standard's sight;
* reported only: ``subnormal_share`` (non-zero elements left with fewer mantissa bits), ``dynamic_range``
  (``log2(amax) - log2(smallest non-zero |x|)``, Transformer Engine's ``dynamic_range``), ``amax`` and
  ``amax_use`` (``amax / format max``: how much of the range the scale uses).
"""

from __future__ import annotations

import math

import numpy as np

from .common import load_yaml
from .result import CheckResult


class QuantizationStandard:
    """Args:
        dtype: the FP8 format key (``fp8_e4m3`` or ``fp8_e5m2``). ``overrides``: thresholds by name.
    """

    name = "quantization"

    def __init__(self, dtype: str = "fp8_e4m3", **overrides: float):
        cfg = dict(load_yaml("thresholds.yaml")["quantization"], **overrides)
        self.dtype = dtype
        self.thresholds = {k: float(cfg[k]) for k in ("quant_err_ratio", "underflow_share", "saturated_share")}

    def __call__(self, quantized, source) -> CheckResult:
        """Judge ``quantized`` (an FP8 torch tensor) against ``source`` (the wider tensor it was cast from, same
        shape). Both are read as float64 on the CPU."""
        import torch

        fmt = torch.finfo(quantized.dtype)
        q = quantized.detach().cpu().double().numpy().ravel()
        x = source.detach().cpu().double().numpy().ravel()
        finite = np.isfinite(x)
        xf = x[finite]
        n = max(int(xf.size), 1)
        nonzero = xf != 0
        ax = np.abs(xf)
        amax = float(ax.max()) if xf.size else 0.0
        qf = q[finite]
        metrics = {
            "underflow_share": float((nonzero & (qf == 0)).sum() / max(int(nonzero.sum()), 1)),
            # beyond the largest value by more than half its spacing: rounding cannot reach it, the cast clips
            # (values exactly at the largest value are not counted: an amax a current scale maps there, and its
            # ties, sit there by design)
            "saturated_share": float((ax > float(fmt.max) + 2.0 ** math.floor(math.log2(float(fmt.max))) *
                                      float(fmt.eps) / 2).sum() / n),
            "subnormal_share": float((nonzero & (np.abs(qf) < fmt.smallest_normal)).sum() /
                                     max(int(nonzero.sum()), 1)),
            "amax": amax, "amax_use": amax / float(fmt.max),
            "dynamic_range": float(math.log2(amax) - math.log2(float(ax[nonzero].min()))) if nonzero.any() else 0.0,
        }
        norm = float(np.linalg.norm(xf))
        if norm == 0 or not np.isfinite(norm):
            return CheckResult(self.name, "pass", metrics, dict(self.thresholds), {}, "nothing to quantize (all zero)")
        err = float(np.linalg.norm(np.nan_to_num(qf, nan=0.0) - xf) / norm)
        factor = float(fmt.max) / amax
        ideal_t = torch.from_numpy(xf * factor).to(quantized.dtype).double().numpy() / factor
        ideal = float(np.linalg.norm(ideal_t - xf) / norm)
        # the error of FP8's own rounding at the ideal scale is the floor: at least half a unit of its precision
        floor = max(ideal, float(fmt.eps) / 64)
        metrics.update(quant_err=err, ideal_quant_err=ideal, quant_err_ratio=err / floor)
        bad = [f"{k} {metrics[k]:.3g} > {th:g}" for k, th in self.thresholds.items() if metrics[k] > th]
        passing = {k: metrics[k] for k in self.thresholds}
        summary = (f"normwise error {err:.3g} vs {ideal:.3g} at its own amax scale, underflow "
                   f"{metrics['underflow_share']:.2%}, saturated {metrics['saturated_share']:.2%}, subnormal "
                   f"{metrics['subnormal_share']:.2%}, amax {amax:.3g} of {fmt.max:g}")
        if bad:
            return CheckResult(self.name, "error", metrics, dict(self.thresholds), passing,
                               f"quantization error: {', '.join(bad)} ({summary}): its scale does not fit the tensor")
        return CheckResult(self.name, "pass", metrics, dict(self.thresholds), passing, f"quantization pass: {summary}")
