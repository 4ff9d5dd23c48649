"""Node verdicts that are dtype-aware and input-aware, and the one result type every judgement returns.

The rule (per node = one dump entry: an API or module call, forward or backward, or a parameters_grad entry):

    r_out  = worst relative error over the node's output rows (target vs bench)
    r_in   = sum of the two largest relative errors over what the node computes from (three for backward and
             parameters_grad nodes): its input rows (args, kwargs, parameters) and, for a backward node, also the
             rows of its forward twin (the saved activations); for a parameters_grad entry, the module's forward
             inputs and backward inputs. Bilinear ops (mul, matmul, linear) add the errors of their operands.
             x**p multiplies it by |p|; for 1-Lipschitz elementwise APIs (sin, cos, tanh, gelu, silu ...) it is
             at least ``r_in · ‖in‖/‖out‖`` (their absolute error cannot grow).
             A module's parameters are inputs its entry does not show: a module node adds u to r_in.
             A routing API's backward (relu, max-pool, clamp ...: the gradient goes where a forward comparison
             sent it) is allowed at least ``sqrt(2 · r_fwd)`` (drift.routing_error).
    u      = unit roundoff of the coarser of the two output dtypes (bf16 2^-8, fp16 2^-11, fp32 2^-24,
             fp64 2^-53; integers and bool 0), and at least the coarsest dtype seen so far in the target's dump
             order (drift.carried_roundoff: an fp32 reduction of fp16 data carries fp16 error, which whole-tensor
             statistics of its input average away)
    kappa  = for a gradient (backward, parameters_grad) output, its cancellation factor (drift.cancellation):
             the random-walk size of the summed terms over the result's norm, >= 1 (a bias gradient that is zero
             by symmetry holds only the rounding noise of its terms)
    budget = kappa · (round_factor · u + propagation · r_in (· statistics_slack without tensors)) + rel_floor
    pass     if r_out <= budget
    warning  if budget < r_out <= error_factor · budget
    error    if r_out >  error_factor · budget

Relative error: ``‖t − b‖₂ / ‖b‖₂`` on real tensors (task ``tensor``); with statistics only, the worst of
Max/Min/Mean/Norm against ``max(|bench stat|, RMS)`` (:func:`~msprobe_ci.compare.metrics.relative_error_stats`;
bench values beyond the target dtype's range: Max and Min clamped to it, Mean and Norm left out).

Why: a bf16 target against an fp32 bench differs by bf16 rounding of every tensor (relative L2 about u/2), and an
op passes on what its own inputs already carried, so downstream nodes of a fault are not blamed (msprobe marks
every bf16-vs-fp32 row ``error`` for the dtype difference alone; its RelativeErr/RelativeWarn checkers use the same
"output error versus input error" idea with fixed ratios 10 and 0.5/0.1, §1.6 of the compare spec). Defaults:
round_factor 2 (an op result is rounded once to the target dtype, plus one rounding inside), propagation 1 (a
well-conditioned op passes its operands' error on), error_factor 1.5 (warning band between 1x and 1.5x the
budget). Where they sit, measured by ``tests/test_drift_rule.py`` on a stock Qwen2 config (2 layers, bf16 target
vs fp32 bench, statistics): a clean run peaks at 0.59x the budget; 2% scale faults on Linear outputs land at
1.12-2.11x, so the warning band and the error line both have faults beside them, and a changed error_factor fails
``test_two_percent_faults_near_the_error_line_pin_error_factor``.

Statistics mode adds a **scale test** (``drift._scale_test``): the output's Norm error alone
(:func:`~msprobe_ci.compare.metrics.norm_error`) against the inputs' Norm errors, by the same rule with
``r_in(Norm)`` and a second-order noise term ``r_in²``; the node takes the worse of the two verdicts. Rounding moves
a norm by at most ``u`` and noise moves it to second order, while a fault that scales an output moves it whole: on
GPT-2 small in bf16, benign forward Norms stay within 0.09u of the bench while Max and Min move by up to 4.5u, so a
2% fault is named even where its inputs' Max and Min carry as much. Two gradient allowances turn an error into a
warning that says why (``drift._gradient_allowances``, each test on its own failing row): a sum over K broadcast
rows judged again with ``u · K / 2`` and a weight gradient contracting K products with ``u · sqrt(K)`` (accumulated
in the target's dtype, as torch's CPU bf16 LayerNorm and fp16 conv2d backward kernels do), and a failing Max, Min or
Mean whose Norm passes the scale test (one gradient element sums products the operands' statistics do not bound). Calibrated on GPT-2 small and medium at 512-2048 tokens by ``benchmarks/drift_calibration.py``.

md5 mode can only say equal or not: a node whose output CRC differs while every input CRC matches (and the dtypes
agree) is an error; a difference that its inputs already carried passes; differing dtypes give a warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..dtypes import TABLE as _DTYPES
from ..dtypes import roundoff as _roundoff
from ..status import STATUSES  # noqa: F401 - the one vocabulary (msprobe_ci.status)

UNIT_ROUNDOFF = {d.dump: d.roundoff for d in _DTYPES}  # kept for readers of this module; see msprobe_ci.dtypes


@dataclass(frozen=True)
class Thresholds:
    """Factors of the node rule (see module docstring). Defaults: round_factor 2, propagation 1, error_factor
    1.5, rel_floor 1e-6 (a floor of the *relative* error budget; its old option name ``atol`` is read by
    :func:`msprobe_ci.check.settings.merge`), statistics_slack 1.25 (the propagation term is widened by this factor when only statistics
    are available, because a statistic is a coarser estimate of the error than the tensor itself)."""

    round_factor: float = 2.0
    propagation: float = 1.0
    error_factor: float = 1.5
    rel_floor: float = 1e-6
    statistics_slack: float = 1.25

    def __post_init__(self) -> None:
        from ..errors import MsprobeError

        for name in ("round_factor", "propagation", "error_factor", "rel_floor", "statistics_slack"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or math.isnan(v):
                raise MsprobeError(f"threshold '{name}': expected a non-negative number, got {v!r}")
        if self.error_factor < 1:
            raise MsprobeError(f"threshold 'error_factor': expected >= 1, got {self.error_factor!r}")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> "Thresholds":
        """Thresholds from ``{factor: number or numeric text}``; ``None`` or ``""`` keeps a factor's default.

        Raises:
            MsprobeError: an unknown key, or a value that is not a number.
        """
        from ..errors import MsprobeError

        raw = {k: v for k, v in dict(raw or {}).items() if v not in (None, "")}
        unknown = sorted(set(raw) - {"round_factor", "propagation", "error_factor", "rel_floor", "statistics_slack"})
        if unknown:
            raise MsprobeError(f"thresholds: unknown key(s) {unknown}; allowed: round_factor, propagation, "
                               "error_factor, rel_floor, statistics_slack")
        out = {}
        for k, v in raw.items():
            try:
                out[k] = float(v)
            except (TypeError, ValueError):
                raise MsprobeError(f"threshold '{k}': expected a number, got {v!r}") from None
        return cls(**out)


@dataclass(frozen=True)
class CompareResult:
    """The one result type: the verdict of one node (or row), with the numbers that produced it.

    Attributes:
        name: node name (dump entry), e.g. ``Functional.linear.0.forward``.
        status: ``pass`` / ``warning`` / ``error`` / ``unmatched``.
        metric: the metric judged (``RelativeErr`` or ``MD5``).
        value: r_out, the node's worst output relative error (0/1 in md5 mode).
        threshold: the error threshold applied (``error_factor × budget``).
        budget: the pass threshold (``round_factor·u + propagation·r_in + rel_floor``).
        input_error: r_in.
        worst_row: the output row that produced ``value``.
        passing_threshold: the loosest error threshold that would have passed this node (= value).
        metrics: msprobe columns of the worst row (Cosine, MaxAbsErr ... or the statistics diffs).
        message: one line explaining the verdict.
        roundoff: u, the unit roundoff the rule used (0 where it does not apply).
    """

    name: str
    status: str
    metric: str = "RelativeErr"
    value: float = 0.0
    threshold: float = math.inf
    budget: float = math.inf
    input_error: float = 0.0
    worst_row: str = ""
    passing_threshold: float = 0.0
    metrics: Mapping[str, Any] = field(default_factory=dict)
    message: str = ""
    roundoff: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status in ("pass", "warning", "unmatched")

    def __bool__(self) -> bool:
        return self.passed


def unit_roundoff(*dtypes: str) -> float:
    """The largest unit roundoff among ``dtypes`` (any spelling of :mod:`msprobe_ci.dtypes`, MindSpore's too;
    unknown and integer dtypes count 0)."""
    return _roundoff(*dtypes)


def judge(name: str, r_out: float, r_in: float, u: float, th: Thresholds, worst_row: str = "",
          metrics: Mapping[str, Any] | None = None, statistics: bool = False,
          condition: float = 1.0, second_order: float = 0.0, test: str = "") -> CompareResult:
    """Apply the node rule to measured errors (``statistics``: the errors come from statistics only;
    ``condition``: a gradient's cancellation factor, >= 1, multiplying its rounding and propagation terms;
    ``second_order``: added to the budget (the scale test's noise term); ``test``: ``"Norm"`` for the scale
    test, whose message names the statistic)."""
    prop = th.propagation * (th.statistics_slack if statistics else 1.0)
    budget = condition * (th.round_factor * u + prop * r_in) + second_order + th.rel_floor
    limit = th.error_factor * budget
    if math.isnan(r_out):
        r_out = math.inf
    if r_out <= budget:
        status = "pass"
    elif r_out <= limit:
        status = "warning"
    else:
        status = "error"
    what = f"{test} " if test else ""
    terms = f"{th.round_factor:g}*u {u:.3g} + {prop:g}*input {what}error {_fmt(r_in)}"
    if condition != 1.0:
        terms = f"cancellation {condition:.3g} x ({terms})"
    if second_order:
        terms += f" + input error^2 {second_order:.3g}"
    msg = (f"{name}: {what}RelativeErr {_fmt(r_out)} at {worst_row or 'output'} vs threshold {_fmt(limit)} "
           f"(= {th.error_factor:g} x ({terms} + rel_floor {th.rel_floor:g}))")
    if test == "Norm" and status != "pass":
        msg += ": its scale moved more than its inputs' did"
    return CompareResult(name=name, status=status, value=r_out, threshold=limit, budget=budget, input_error=r_in,
                         worst_row=worst_row, passing_threshold=r_out, metrics=dict(metrics or {}), message=msg,
                         roundoff=u)


def _fmt(x: float) -> str:
    return f"{x:.4g}"  # inf and nan print as such
