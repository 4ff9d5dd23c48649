"""Accumulative error (msprobe 2.9): the absolute-threshold test with ``small_value = 1`` and the dtype's error
bound as both rtol and atol, plus error balance EB within its threshold, counted over the elements that are not
the correctly rounded oracle (those carry no accumulation error). For long reductions (sum, mean, norm),
whose error grows with the number of accumulated terms but must stay unbiased."""

from __future__ import annotations

import numpy as np

from .absolute import judge_absolute
from .common import dtype_thresholds, to_f64
from .result import CheckResult


class AccumulativeStandard:
    """Args:
        dtype: target output dtype key: picks ``accumulative_bound`` and ``eb_threshold``.
        **overrides: any threshold of that dtype.
    """

    name = "accumulative"

    def __init__(self, dtype: str = "fp32", **overrides: float):
        th = dtype_thresholds(dtype, overrides)
        self.bound, self.eb = th["accumulative_bound"], th["eb_threshold"]

    def __call__(self, target, bench, oracle=None) -> CheckResult:
        """Judge ``target`` against ``oracle`` (or ``bench`` where there is no oracle).

        Args:
            target: the target's output, any shape; a torch tensor keeps its dtype for the rounding exclusion.
            bench: the bench's output of the same shape, or None. With an oracle it is used only for the bias
                test's null: its own error balance (see below); pass it only where it computes in the target's
                dtype (the same arithmetic), else None.
            oracle: the correctly computed result (float64), or None.

        Returns:
            A :class:`CheckResult` with ``error_balance`` among its metrics, and ``null_error_balance`` (the
            bench's own, the test's null) where it was measured: 100 or more of the bench's elements inexact.
        """
        ref = to_f64(oracle if oracle is not None else bench)
        t = to_f64(target)
        d = _inexact(t - ref, t, oracle if oracle is not None else bench, target)
        n = int(np.count_nonzero(d)) if d.size else 0
        eb = _balance(d, n)
        metrics = {"error_balance": eb}
        # EB is a bias test. Ours: an unbiased error has EB ~ 1/sqrt(N), so msprobe's fixed threshold alone would
        # fail plain rounding noise for N < 1/threshold^2 (16384 for bf16); we also require 4 standard deviations
        # of that sign test, and do not judge EB below 100 elements.
        eb_limit = max(self.eb, 4.0 / np.sqrt(n)) if n else self.eb
        null = None
        if oracle is not None and bench is not None and n:
            b = to_f64(bench)
            if b.shape == t.shape:
                db = _inexact(b - ref, b, oracle, bench)
                nb = int(np.count_nonzero(db))
                if nb >= 100:
                    # the sign test's null (every rounding as likely up as down) holds only where ties are rare.
                    # Terms with few significant bits (bf16 values, or their squares: 16 bits, held exactly in
                    # fp32) tie often, and round-half-even then rounds a running sum one way more often than the
                    # other: a correct fp32 mean of squared bf16 values (RMSNorm's variance) is off low for 530 of
                    # 802 rows and high for 272 (torch), 486/187 (numpy's pairwise), 1918/33 (sequential), where
                    # squares of full fp32 values give 416/406. The bench computing in the target's dtype shows the
                    # arithmetic's own bias on these terms: the target may have as much, plus 4 standard deviations
                    # of the difference of the two sign tests. Where the bench is the oracle rounded once (an
                    # ``upcast`` bench of an fp32 call), judge_rows passes PyTorch's CPU kernel in its place
                    null = _balance(db, nb)
                    metrics["null_error_balance"] = null
                    eb_limit = max(eb_limit, null + 4.0 * np.sqrt(1.0 / n + 1.0 / nb))
        res = judge_absolute(self.name, [(t, ref)], self.bound, 1.0, self.bound, metrics)
        thresholds = dict(res.thresholds, eb_threshold=eb_limit)
        passing = dict(res.passing, eb_threshold=eb)
        status = "error" if res.status == "error" or (n >= 100 and eb > eb_limit) else "pass"
        why = "biased accumulation" if null is None else f"biased accumulation; a correct kernel's own {null:.3g}"
        msg = res.message if res.status == "error" else (
            f"error balance {eb:.3g} > {eb_limit:.3g} ({why})" if status == "error" else res.message)
        return CheckResult(self.name, status, res.metrics, thresholds, passing, msg)


def _inexact(d, values, reference, like):
    """``d`` (``values - reference`` as float64) with 0 where ``values`` equal ``reference`` correctly rounded to
    the dtype of ``like``: such an element carries no accumulation error at all and is left out of the bias test
    (a mean's gradient broadcasts one rounded value to every element, so its rounding would otherwise count N times
    with one sign)."""
    rounded = _round_to(reference, like)
    if rounded is not None and rounded.shape == values.shape:
        return np.where(values == rounded, 0.0, d)
    return d


def _balance(d, n: int) -> float:
    """Error balance EB = ``|#(d > 0) - #(d < 0)| / n`` (msprobe's), 0 for ``n`` = 0."""
    return float(abs(int((d > 0).sum()) - int((d < 0).sum())) / n) if n else 0.0


def _round_to(reference, target):
    """``reference`` rounded to the dtype of ``target`` (round to nearest even, as torch casts), as float64; None
    when either is not a floating torch tensor."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    if not isinstance(reference, torch.Tensor) or not isinstance(target, torch.Tensor) or \
            not target.is_floating_point() or not reference.is_floating_point():
        return None
    return to_f64(reference.detach().cpu().to(target.dtype))
