"""msprobe acc_check's deciding chain (msprobe 2.1), for comparison with msprobe's own reports: cosine <= 0.99 is
an error; max absolute error < 0.001 passes; then fp16/bf16 need 99% of elements within 1% relative error (else
error) and pass with 99.9% within 0.1% (else warning); fp32/fp64 need 99.9% within 0.1% (else error) and pass with
99.99% within 0.01% (else warning)."""

from __future__ import annotations

import numpy as np

from .common import load_yaml, to_f64
from .result import CheckResult


def _share_within(re: np.ndarray, tol: float) -> float:
    return float((re < tol).sum() / re.size) if re.size else 1.0


class LegacyStandard:
    """Args:
        dtype: target output dtype key (``fp16``/``bf16`` or ``fp32``/``fp64`` rules).
        **overrides: ``cosine_min`` (0.99), ``max_abs_pass`` (0.001).
    """

    name = "legacy"

    def __init__(self, dtype: str = "fp32", **overrides: float):
        cfg = dict(load_yaml("thresholds.yaml")["legacy"], **overrides)
        self.cos_min, self.abs_pass, self.dtype = float(cfg["cosine_min"]), float(cfg["max_abs_pass"]), dtype

    def __call__(self, target, bench, oracle=None) -> CheckResult:
        t, b = to_f64(target).ravel(), to_f64(bench).ravel()
        metrics: dict[str, float] = {}
        th = {"cosine_min": self.cos_min, "max_abs_pass": self.abs_pass}
        if t.size > 1:
            mt, mb = np.max(np.abs(t)), np.max(np.abs(b))
            eps = np.finfo(np.float64).eps
            if mt <= eps and mb <= eps:
                cos = 1.0
            elif mt <= eps or mb <= eps:
                cos = 0.0
            else:
                tn, bn = t / mt, b / mb
                cos = float(np.clip(np.dot(tn, bn) / (np.linalg.norm(tn) * np.linalg.norm(bn)), -1, 1))
            metrics["cosine"] = cos
            if cos <= self.cos_min:  # NaN cosine passes, as msprobe
                return CheckResult(self.name, "error", metrics, th, {"cosine_min": cos}, f"cosine {cos:.6f}")
        ae = np.abs(t - b)
        max_abs = float(np.nanmax(ae)) if ae.size else 0.0
        metrics["max_abs_err"] = max_abs
        if max_abs < self.abs_pass:
            return CheckResult(self.name, "pass", metrics, th, {"max_abs_pass": max_abs},
                               f"max abs error {max_abs:.3g} < {self.abs_pass:g}")
        eps = 2.0 ** -8 if self.dtype == "bf16" else np.finfo(np.float64 if self.dtype in ("fp32", "fp64")
                                                              else np.float32).eps
        re = ae / (np.abs(b) + eps)
        if self.dtype in ("fp16", "bf16"):
            hund, thou = _share_within(re, 0.01), _share_within(re, 0.001)
            metrics.update(dual_hundredth=hund, dual_thousandth=thou)
            status = "error" if hund <= 0.99 else ("pass" if thou > 0.999 else "warning")
        else:
            thou, tenk = _share_within(re, 0.001), _share_within(re, 0.0001)
            metrics.update(dual_thousandth=thou, dual_ten_thousandth=tenk)
            status = "error" if thou <= 0.999 else ("pass" if tenk > 0.9999 else "warning")
        shares = {k: v for k, v in metrics.items() if k.startswith("dual_")}
        th.update({k: (0.99 if k == "dual_hundredth" else 0.999 if k == "dual_thousandth" else 0.9999)
                   for k in shares})
        return CheckResult(self.name, status, metrics, th, shares,
                           f"{status} by msprobe's ratio chain: " + ", ".join(f"{k} {v:.4f}" for k, v in shares.items()))
