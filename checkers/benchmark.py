"""Benchmark ratio (msprobe 2.4): the target's error and the bench's own error, both against the fp64 oracle, as
ratios ``target / max(bench, min_err)``; error when a ratio exceeds its level's threshold (L0: max relative error
10, mean relative error 2, RMSE 2, small-value error ratio 2; L1 and L2 APIs are stricter).

msprobe designed these ratios for an NPU kernel against a GPU kernel: two kernels of the same dtype with errors of
the same kind. Two things keep them true whatever kernel plays the bench:

* ``min_err`` floors the bench's error at the dtype's unit roundoff (bf16 2^-8, fp16 2^-11; msprobe's own floors):
  the bench is never credited with less error than one correct rounding, so a correctly rounded bench does not
  make the judge stricter than a typical kernel; the small-value error (a share of the small elements) is floored
  at one of them in error as well (``1 / n_small``): a kernel that cancels O(1) terms into one small element errs
  there by their rounding where a correctly rounded bench does not;
* with an error ``scale`` per element (:mod:`msprobe_ci.kernels`: the random-walk size of the rounding the
  arithmetic allows at that element), relative errors are measured against ``max(|oracle|, scale)``: where the
  arithmetic cancels (a LayerNorm output next to its bias, a weight gradient summed over the batch) a kernel's
  error is of the size of the terms, not of the result, for every kernel alike; a small value (judged by its
  absolute error) may carry one rounding of its row's terms at the accumulation roundoff (fp32 up to fp32).

A target no worse than a typical kernel of its dtype then passes against the most accurate bench, and a fault of a
few units of roundoff on every element (2% in bf16 is 5 of them) moves the mean relative error past ratio 2."""

from __future__ import annotations

import fnmatch
import functools
import math

import numpy as np

from .._perf import takes_device_paths
from .common import dtype_thresholds, f64, load_yaml, totals
from .result import CheckResult

METRICS = ("max_rel_err", "mean_rel_err", "rmse", "small_value_err")


ROW_FLOOR = 0.5

#: an error scale (:mod:`msprobe_ci.kernels`) is the RMS of the roundings a kernel commits, one rounding counting
#: ``u / sqrt(3)`` (``kernels.ROUNDING_RMS``); one rounding's error reaches ``u``. The mean relative error and the
#: RMSE, where a fault shows, are judged against the RMS; the max relative error, an extreme over every element,
#: against the bound: the scale times this
MAX_SCALE = 3.0 ** 0.5


def _row_floor(scale):
    """``scale`` raised to at least :data:`ROW_FLOOR` times the RMS of its row (the last dimension).

    An element's scale is estimated from a few random draws (:mod:`msprobe_ci.kernels`): ``s * sqrt(chi2_R / R)``,
    so among thousands of cancelled elements some fall far under their true scale (4 draws: one in a thousand
    under a third of it), and an ordinary rounding error there would read as a max relative error of 10 and more.
    The elements of one row (a token's hidden vector, one output channel's weight gradient) come from the same
    arithmetic, so their pooled RMS is a steady lower bound. Used for the max relative error only: the mean, where
    a fault shows, keeps each element's own scale, so the small members of a row (an attention row's small
    probabilities) stay judged at their own size."""
    import torch

    if scale.ndim == 0 or scale.shape[-1] < 2:
        return scale
    return torch.maximum(scale, ROW_FLOOR * torch.sqrt(torch.mean(scale ** 2, dim=-1, keepdim=True)))


class _Reference:
    """What the metrics of the target and of the bench share: the reference and, from it (and the error scale),
    each element's relative-error denominator, whether it is a small value and the absolute error a small value
    may carry (``atol``; with an error scale, at least one rounding at the accumulation roundoff ``u_acc`` of its
    row's terms, the bound the max relative error uses: a LayerNorm output where ``x`` is next to its row's mean is
    the difference of two terms rounded in fp32, ``x * rstd`` and ``mean * rstd``, and a correct kernel lands a
    fraction of their rounding off, far past msprobe's fp32 ``atol`` of 2^-30 where they are about 0.02)."""

    def __init__(self, ref, small_value: float, scale=None, atol: float = 0.0, u_acc: float = 0.0, *, held: bool):
        import torch

        eps = float(np.finfo(np.float64).eps)
        self.ref = ref
        # with an error scale, an element is "small" (judged by absolute error) only where its terms are small
        # too: a cancelled sum of large terms is judged relative to them
        self.den = ref.abs() if scale is None else torch.maximum(ref.abs(), scale)
        # the key (ref, or den with a scale) is finite where den is (|ref| is ref's magnitude) and its magnitude is
        # den: x - x == 0 is isfinite in two kernels (torch.isfinite launches four)
        finite = (self.den - self.den) == 0
        small = self.den <= small_value
        # where the key is finite: the small elements (judged by absolute error), the normal ones (relative)
        self.small = small & finite
        self.normal = finite ^ self.small  # small lies within finite: xor is "and not"
        self.den_sq = self.den.square()
        self.den_eps = self.den + eps
        self.den_max_eps = self.den_eps if scale is None else \
            torch.maximum(ref.abs(), MAX_SCALE * _row_floor(scale)) + eps
        bound = self.den_max_eps
        if held and scale is not None:
            # at the dtype's roundoff a small value's allowance bounds two errors that add: the result's own
            # rounding (at most |ref|) and what the kernel held before it, bounded by the scale's draws (which hold
            # that rounding too, in quadrature, estimated from a few draws). Where the held part is about the size
            # of the rounding (the CPU half LayerNorm backward's input gradient, off by its saved statistics) the
            # larger of the two alone was exceeded by 2.8% of ViT's benign small elements in bf16 (a small-value
            # error ratio 4-7 against the upcast bench, whose once-rounded values never exceed it; 25-54 in fp16)
            bound = ref.abs() + MAX_SCALE * _row_floor(scale) + eps
        self.atol = atol if scale is None or not u_acc else torch.clamp(u_acc * bound, min=atol)


#: the sums of one slice's statistics of one side, in order (:func:`_partial`); its maximum comes last
_SUMS = ("sq_err", "left_out", "rel_err", "n_rel", "den_sq", "n_normal", "small_err", "n_small")


def _partial(x, r: _Reference, finite=None) -> list:
    """One slice's statistics of ``x`` against the reference (masks as :func:`~.common.finite_masks`): the
    :data:`_SUMS` and the largest relative error for the max (0 when none), as 0-d tensors on their device;
    :func:`_metrics` makes msprobe's metrics of their totals. ``finite``: ``x``'s finite mask where it is made
    already (``x - x == 0``). About 20 kernel launches (33 before they were counted)."""
    import torch

    if finite is None:
        finite = (x - x) == 0
    small = finite & r.small
    normal = finite & r.normal  # what is left out (non-finite, or small) is its complement
    ae = (x - r.ref).abs()  # inf - inf where both sides overflow: NaN, judged by position, not here
    # a normal element's relative error is never NaN (x and ref finite, den_eps finite and > 0): every normal
    # element has one, and the left-out ones count 0
    re = torch.where(normal, ae / r.den_eps, 0.0)
    if r.den_max_eps is r.den_eps:
        top = re
    else:  # a NaN from a non-finite scale's row is no value, as the elements left out
        re_max = torch.where(normal, ae / r.den_max_eps, -1.0)
        top = torch.where(re_max >= 0, re_max, 0.0)
    n_normal = normal.sum()
    return [torch.where(normal, ae, 0.0).square().sum(), normal.numel() - n_normal, re.sum(), n_normal,
            torch.where(normal, r.den_sq, 0.0).sum(), n_normal, ((ae > r.atol) & small).sum(), small.sum(),
            top.amax() if top.numel() else top.new_zeros(())]


def _metrics(n: int, sums: dict, top: float) -> dict[str, float]:
    """msprobe's benchmark metrics of ``n`` elements from the totals of :func:`_partial` (``sums`` by the names
    of :data:`_SUMS`, ``top`` the largest relative error): MSE with msprobe's correction for the elements left
    out, mean relative error over the normal elements, small-value error ratio over the small ones, and the RMS
    of the normal elements' denominators (``scale_rms``, the RMSE floor's unit)."""
    def per(a: str, of: str) -> float:
        return sums[a] / sums[of] if sums[of] else 0.0
    mse = sums["sq_err"] / n * (n / (n - sums["left_out"] + 1e-4) + 1e-4) if n else 0.0
    return {"scale_rms": math.sqrt(per("den_sq", "n_normal")), "max_rel_err": top,
            "mean_rel_err": per("rel_err", "n_rel"), "rmse": math.sqrt(mse),
            "small_value_err": per("small_err", "n_small")}


def _row_slices(*xs, device):
    """The tensors ``xs`` (same shape, or None) as 2-D views of whole rows (the last dimension; 0-d and 1-d as
    one row), cut into slices of whole rows of about :data:`~.common.SLICE` elements on the CPU
    (:data:`~.common.DEVICE_SLICE` elsewhere): the row floor sees every row whole, the memory stays bounded."""
    from . import common

    rows = [None if x is None else x.reshape(1, -1) if x.ndim < 2 else x.reshape(-1, x.shape[-1]) for x in xs]
    width = max(rows[0].shape[1], 1)
    step = max(1, (common.DEVICE_SLICE if takes_device_paths(device) else common.SLICE) // width)
    for i in range(0, rows[0].shape[0], step):
        yield [None if x is None else x[i:i + step] for x in rows]


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
        # kernels of every dtype up to fp32 hold their intermediates in fp32 (PyTorch's ``opmath_t``; GPU and NPU
        # kernels alike, msprobe_ci.kernels); fp64 kernels in fp64
        self.u_acc = 2.0 ** -53 if dtype == "fp64" else 2.0 ** -24
        table = load_yaml("thresholds.yaml")["benchmark"]
        self.level = level = _level(api)
        self.ratios = dict(table["levels"][level], **ratio_over)

    def __call__(self, target, bench, oracle=None, scale=None, held: bool = False) -> CheckResult:
        """Args:
            target, bench, oracle: same shape; ``oracle`` ``None`` judges against the bench itself.
            scale: optional per-element error scale, same shape (``None``: relative to ``|oracle|`` alone).
            held: the scale's budget met a kernel that holds its terms in the target dtype (PyTorch's CPU half
                kernels, ``msprobe_ci.kernels.CPU_HALF_HELD``): a small value may carry a rounding of its terms at
                the dtype's roundoff (``min_err``), not at fp32's, bounded by the scale, beside its own rounding.
        """
        import torch

        def tensor(x):  # NumPy values and scalars become float64 tensors; tensors are converted slice by slice
            return x.detach() if isinstance(x, torch.Tensor) else f64(x)
        t = tensor(target)
        b, sc = tensor(bench), tensor(scale) if scale is not None else None
        ref = tensor(oracle) if oracle is not None else b
        if sc is not None and sc.shape != t.shape:
            sc = None
        parts = []
        # judged where the target lies, in float64 slices of whole rows; every metric comes back in one transfer
        for ts, bs, rs, ss in _row_slices(t, b, ref, sc, device=t.device):
            ts, bs, rs = f64(ts), f64(bs, ts.device), f64(rs, ts.device)
            ref_s = _Reference(rs, self.small, None if ss is None else f64(ss, ts.device), self.atol,
                               max(self.u_acc, self.min_err) if held else self.u_acc, held=held)
            finite_t, finite_b = (ts - ts) == 0, (bs - bs) == 0
            mine, theirs = _partial(ts, ref_s, finite_t), _partial(bs, ref_s, finite_b)
            # inf/nan: the target must have them exactly where the same-dtype bench has them (both finite, the
            # same infinity, or both NaN); the others are counted
            matched = (finite_t & finite_b) | (ts == bs) | (torch.isnan(ts) & torch.isnan(bs))
            parts.append(torch.stack([*mine[:-1], *theirs[:-1], matched.numel() - matched.sum(),  # as float64
                                      mine[-1], theirs[-1]]))
        k = len(_SUMS)
        sums, (top_t, top_b) = totals(parts, 2 * k + 1, 2 * k + 3)  # one transfer from the device
        n = t.numel()
        mt = _metrics(n, dict(zip(_SUMS, sums[:k])), top_t)
        mb = _metrics(n, dict(zip(_SUMS, sums[k:])), top_b)  # without an oracle: the bench against itself, 0
        inf_nan = sums[-1] > 0
        ratios, failed = {}, []
        # the bench is credited with at least one rounding (min_err, msprobe's floor) of the data's own size: the
        # relative metrics in units of 1, the RMSE (an absolute metric) in units of the RMS magnitude of the judged
        # elements, so a bench that happens to be exact at a loss of 5.5 does not make a half-ulp target fail
        floors = {k: self.min_err for k in METRICS}
        if mt["scale_rms"] > 0:
            floors["rmse"] = self.min_err * mt["scale_rms"]
        # the small-value error is a share of the small elements: the bench is credited with at least one of them
        # in error, as with one rounding above (a rate of 1/n_small is that share's resolution: with one small
        # element, 0 against 1 error is no ratio of 16384)
        n_small = sums[_SUMS.index("n_small")]
        if n_small > 0:
            floors["small_value_err"] = max(self.min_err, 1.0 / n_small)
        for k in METRICS:
            r = mt[k] / max(abs(mb[k]), floors[k])
            ratios[k] = r
            if not r <= self.ratios[k]:  # NaN fails
                failed.append(k)
        if inf_nan:
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
