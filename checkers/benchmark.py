"""Benchmark ratio (msprobe 2.4): the target's error and the bench's own error, both against the fp64 oracle, as
ratios ``target / max(bench, min_err)``; error when a ratio exceeds its level's threshold (L0: max relative error
10, mean relative error 2, RMSE 2, small-value error ratio 2; L1 and L2 APIs are stricter).

msprobe designed these ratios for an NPU kernel against a GPU kernel: two kernels of the same dtype with errors of
the same kind. Two things keep them true whatever kernel plays the bench:

* ``min_err`` floors the bench's error at the dtype's unit roundoff (bf16 2^-8, fp16 2^-11; msprobe's own floors):
  the bench is never credited with less error than one correct rounding, so a correctly rounded bench does not
  make the judge stricter than a typical kernel;
* with an error ``scale`` per element (:mod:`msprobe_ci.kernels`: the random-walk size of the rounding the
  arithmetic allows at that element), relative errors are measured against ``max(|oracle|, scale)``: where the
  arithmetic cancels (a LayerNorm output next to its bias, a weight gradient summed over the batch) a kernel's
  error is of the size of the terms, not of the result, for every kernel alike.

A target no worse than a typical kernel of its dtype then passes against the most accurate bench, and a fault of a
few units of roundoff on every element (2% in bf16 is 5 of them) moves the mean relative error past ratio 2."""

from __future__ import annotations

import fnmatch
import functools

import numpy as np

from .common import dtype_thresholds, load_yaml, to_f64
from .result import CheckResult

METRICS = ("max_rel_err", "mean_rel_err", "rmse", "small_value_err")


ROW_FLOOR = 0.5


def _row_floor(scale: np.ndarray) -> np.ndarray:
    """``scale`` raised to at least :data:`ROW_FLOOR` times the RMS of its row (the last dimension).

    An element's scale is estimated from a few random draws (:mod:`msprobe_ci.kernels`): ``s * sqrt(chi2_R / R)``,
    so among thousands of cancelled elements some fall far under their true scale (4 draws: one in a thousand
    under a third of it), and an ordinary rounding error there would read as a max relative error of 10 and more.
    The elements of one row (a token's hidden vector, one output channel's weight gradient) come from the same
    arithmetic, so their pooled RMS is a steady lower bound. Used for the max relative error only: the mean, where
    a fault shows, keeps each element's own scale, so the small members of a row (an attention row's small
    probabilities) stay judged at their own size."""
    if scale.ndim == 0 or scale.shape[-1] < 2:
        return scale
    return np.maximum(scale, ROW_FLOOR * np.sqrt(np.mean(scale ** 2, axis=-1, keepdims=True)))


class _Reference:
    """What the metrics of the target and of the bench share: the reference and, from it (and the error scale),
    each element's relative-error denominator and whether it is a small value."""

    def __init__(self, ref: np.ndarray, small_value: float, scale: np.ndarray | None = None):
        eps = np.finfo(np.float64).eps
        self.ref = ref
        # with an error scale, an element is "small" (judged by absolute error) only where its terms are small
        # too: a cancelled sum of large terms is judged relative to them
        self.den = np.abs(ref) if scale is None else np.maximum(np.abs(ref), scale)
        key = ref if scale is None else self.den
        self.finite = np.isfinite(key)
        self.small = np.abs(key) <= small_value
        self.den_eps = self.den + eps
        self.den_max_eps = self.den_eps if scale is None else np.maximum(self.den, _row_floor(scale)) + eps


def _metrics(x: np.ndarray, r: _Reference, atol: float) -> dict[str, float]:
    """msprobe's benchmark metrics of ``x`` against the reference (masks as :func:`~.common.finite_masks`)."""
    finite = np.isfinite(x) & r.finite
    bad = ~finite
    small = finite & r.small
    normal = finite & ~r.small
    with np.errstate(invalid="ignore"):  # inf - inf where both sides overflow: judged by position, not here
        ae = np.abs(x - r.ref)
        re = np.where(normal, ae / r.den_eps, -1.0)
        re_max = re if r.den_max_eps is r.den_eps else np.where(normal, ae / r.den_max_eps, -1.0)
    n = x.size
    ae_ok = np.where(bad | small, 0.0, ae)
    cnt = int((bad | small).sum())
    mse = float(np.mean(ae_ok ** 2)) * (n / (n - cnt + 1e-4) + 1e-4) if n else 0.0
    pos, pos_max = re[re >= 0], re_max[re_max >= 0]
    scale_rms = float(np.sqrt(np.mean(r.den[normal] ** 2))) if normal.any() else 0.0
    return {"scale_rms": scale_rms,
            "max_rel_err": float(pos_max.max()) if pos_max.size else 0.0,
            "mean_rel_err": float(pos.mean()) if pos.size else 0.0, "rmse": float(np.sqrt(mse)),
            "small_value_err": float(((ae > atol) & small).sum() / small.sum()) if small.any() else 0.0}


@functools.lru_cache(maxsize=4096)
def _level(api: str) -> str:
    """msprobe's benchmark level of an API (``data/thresholds.yaml`` ``benchmark.apis``; default L0)."""
    level = "L0"
    for lv, names in load_yaml("thresholds.yaml")["benchmark"]["apis"].items():
        if any(fnmatch.fnmatchcase(api, n) for n in names):
            level = lv
    return level


class BenchmarkStandard:
    """Args:
        dtype: target output dtype key (``small_value``, ``small_value_atol``, ``min_err``).
        api: the API name, for its level (``data/thresholds.yaml`` ``benchmark.apis``; default L0).
        **overrides: dtype thresholds, or ratio thresholds ``max_rel_err``, ``mean_rel_err``, ``rmse``,
            ``small_value_err``.
    """

    name = "benchmark"

    def __init__(self, dtype: str = "fp32", api: str = "", **overrides: float):
        ratio_over = {k: float(overrides.pop(k)) for k in list(overrides) if k in METRICS}
        th = dtype_thresholds(dtype, overrides)
        self.small, self.atol, self.min_err = th["small_value"], th["small_value_atol"], th["min_err"]
        table = load_yaml("thresholds.yaml")["benchmark"]
        self.level = level = _level(api)
        self.ratios = dict(table["levels"][level], **ratio_over)

    def __call__(self, target, bench, oracle=None, scale=None) -> CheckResult:
        """Args:
            target, bench, oracle: same shape; ``oracle`` ``None`` judges against the bench itself.
            scale: optional per-element error scale, same shape (``None``: relative to ``|oracle|`` alone).
        """
        t, b = to_f64(target), to_f64(bench)
        ref = to_f64(oracle) if oracle is not None else b
        sc = to_f64(scale) if scale is not None else None
        if sc is not None and sc.shape != t.shape:
            sc = None
        r = _Reference(ref, self.small, sc)
        mt = _metrics(t, r, self.atol)
        mb = _metrics(b, r, self.atol) if oracle is not None else {k: 0.0 for k in mt}
        ratios, failed = {}, []
        # the bench is credited with at least one rounding (min_err, msprobe's floor) of the data's own size: the
        # relative metrics in units of 1, the RMSE (an absolute metric) in units of the RMS magnitude of the judged
        # elements, so a bench that happens to be exact at a loss of 5.5 does not make a half-ulp target fail
        floors = {k: self.min_err for k in METRICS}
        if mt["scale_rms"] > 0:
            floors["rmse"] = self.min_err * mt["scale_rms"]
        for k in METRICS:
            r = mt[k] / max(abs(mb[k]), floors[k])
            ratios[k] = r
            if not r <= self.ratios[k]:  # NaN fails
                failed.append(k)
        # inf/nan: the target must have them exactly where the same-dtype bench has them
        if (np.isfinite(t) != np.isfinite(b)).any() or (np.isnan(t) != np.isnan(b)).any() or \
                (np.isinf(t) & (t != b)).any():
            failed.append("inf_nan")
        metrics = {f"target_{k}": mt[k] for k in METRICS} | {f"bench_{k}": mb[k] for k in METRICS} | \
                  {f"{k}_ratio": ratios[k] for k in METRICS}
        # the bench's error is at most its floor in every error metric: then an error scale could only lower the
        # target's errors against the same denominators, and a pass here is a pass with it (judge_pair skips it)
        metrics["bench_at_floor"] = float(all(abs(mb[k]) <= floors[k] for k in ("max_rel_err", "mean_rel_err",
                                                                                 "rmse")))
        status = "error" if failed else "pass"
        msg = ", ".join(f"{k} ratio {ratios[k]:.3g} > {self.ratios[k]:g}" for k in failed
                        if k != "inf_nan") or f"max ratio {max(ratios.values()):.3g} (level {self.level})"
        if "inf_nan" in failed:
            msg = "inf/nan positions differ from the bench" + (f"; {msg}" if len(failed) > 1 else "")
        return CheckResult(self.name, status, metrics, dict(self.ratios), ratios, msg)
