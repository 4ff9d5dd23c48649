"""Judging one output of one API call by its per-API standard: :func:`judge_pair` for one row,
:func:`judge_rows` for every row of a call (isolation, the offline replay, collectives and whole modules alike).

The shape follows torch.testing's ``_comparison.py``: the call's outputs are flattened into rows
(:func:`msprobe_ci.judge.rows.outputs`), then each ``(target, bench, oracle)`` row is judged on its own. Which
standard judges a row is msprobe's registry (:func:`msprobe_ci.checkers.standard_for`); its thresholds are
``checkers/data/thresholds.yaml``; the adaptations of msprobe's rules made here (gradients in units of their own
scale, small values in units of the tensor's scale, sums in units of their terms, the fp32 accumulation allowance)
say their sources where they are made.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import numpy as np
import torch

from .._perf import reads_wait
from ..checkers import CheckResult, make_standard, standard_for
from ..checkers.common import dtype_thresholds
from ..dtypes import checker_key
from ..kernels.budgets import HELD_IN_DTYPE
from .allowances import (_LINEAR_REDUCTIONS, _PRODUCTS, accumulation_count, accumulation_floor, accumulation_scale,
                         same_dtype_result)
from .peaks import abs_peak, finite_peak, row_facts

_ALPHA_OPS = frozenset({"add", "add_", "sub", "sub_", "rsub"})
_SCANS = frozenset({"cumsum", "cumsum_", "cumprod", "cumprod_", "logcumsumexp"})
FMA = "fused multiply-add"  # what an alpha op is judged as: no API entry, so the default (benchmark) standard


def judge_pair(short: str, t: Any, b: Any, o: Any, backward: bool = False, standards: dict | None = None,
               thresholds: dict | None = None, floor: Any = None, scale: Any = None, terms: Any = None,
               as_dtype: Any = None, count: float | None = None, null: Any = None) -> CheckResult:
    """Judge one output (or gradient) of API ``short`` by its per-API standard.

    Args:
        short: the API name without prefix and call number (``linear``, ``__add__``).
        t: the target value (tensor or scalar). b: the same-dtype bench value. o: the fp64 (or fp32) oracle.
        backward: ``t`` is a gradient: judged by the benchmark standard at msprobe's default level L0, whatever
            the forward's standard and level (see below).
        standards: ``{API fnmatch pattern: standard}`` overrides. thresholds: ``{standard: {name: value}}``.
        floor: the ULP standard's accumulation allowance (:func:`accumulation_floor`), when known.
        scale: the accumulative standard's magnitude of the summed terms (:func:`accumulation_scale`), when known:
            a forward output is judged in units of it; with ``count``, the most terms one output element adds
            up (:func:`accumulation_count`), in units of ``max(|oracle|, 2 * count * u_acc * scale / bound)``:
            its own size, or what accumulating its terms in fp32 may leave where they cancel. For a product
            (``prod``), ``count`` is its factors per output element, and the output is judged relative to
            itself: in bf16/fp16 within one rounding per factor after the first where that is wider than the
            standard's bound (a kernel may hold its running product in the dtype, as PyTorch's CPU one does).
        terms: the benchmark standard's error scale per element (:func:`msprobe_ci.kernels.forward_scale`,
            :func:`~msprobe_ci.kernels.backward_scale`), or a callable returning it (asked only when the standard
            is the benchmark and the target is not bit-identical to the bench): relative errors are measured
            against ``max(|oracle|, terms)``, so cancelling arithmetic is judged at the size of its terms.
        as_dtype: judge ``t`` as a result computed in this dtype (its standard, thresholds and floors; ``terms``
            in units of its roundoff), its values compared as they are: a module whose GEMMs autocast ran in bf16
            returns fp32 tensors as precise as bf16 (:meth:`msprobe_ci.isolate.modules.ModuleIsolation.
            computed_in`). ``None``: ``t``'s own dtype.

        null: for the accumulative standard with an oracle, a correct kernel's result in ``t``'s dtype
            (:func:`same_dtype_result`) standing in for ``b`` as its bias test's null (the bench serves where it is
            in ``t``'s dtype).

    Returns:
        The standard's :class:`~msprobe_ci.checkers.CheckResult` (``structure``/``scalar``/``empty``/``none``
        results for shape mismatches, non-tensors, empty tensors, missing values).
    """
    standards = standards or {}
    if t is None and b is None:
        return CheckResult("none", "skip", message="no output")
    if isinstance(t, torch.Tensor) != isinstance(b, torch.Tensor):  # (a tensor's == would be a tensor)
        def kind(v):
            return f"tensor {list(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
        return CheckResult("structure", "error", message=f"target {kind(t)} vs bench {kind(b)}")
    if not isinstance(t, torch.Tensor):
        both_nan = isinstance(t, float) and isinstance(b, float) and math.isnan(t) and math.isnan(b)
        same = both_nan or t == b
        return CheckResult("scalar", "pass" if same else "error", message=f"target {t!r} vs bench {b!r}")
    if list(t.shape) != list(b.shape):
        return CheckResult("structure", "error", message=f"shape {list(t.shape)} vs bench {list(b.shape)}")
    if t.numel() == 0:
        return CheckResult("empty", "pass", message="empty tensor: shapes agree, nothing to compare")
    if null is not None and isinstance(null, torch.Tensor) and isinstance(t, torch.Tensor) and \
            null.shape == t.shape and o is not None:
        b = null  # the accumulative standard reads the bench only for its null where there is an oracle
    same_arithmetic = t.dtype == b.dtype
    judged = as_dtype if as_dtype is not None and t.is_floating_point() else t.dtype
    std_name = standard_for(short, judged, standards)
    level_api = short
    if backward and t.is_floating_point() and not any(fnmatch.fnmatchcase(short, p) for p in standards):
        # a gradient is not the forward's computation: an elementwise op's is not one rounding (div: -g*a/b^2,
        # broadcasting sums), a gather's or an embedding's adds up every use of a row, a matmul's weight gradient
        # reduces over the batch with its own cancellation (a bias gradient that is zero by symmetry holds only
        # rounding noise); its error is judged against the bench's own error (benchmark standard). At msprobe's
        # default level L0: its L1/L2 lists tighten the forward outputs of named kernels, while the reductions of a
        # backward pass legitimately differ in order and in the precision of their partial sums (torch's own CPU
        # bf16 LayerNorm backward accumulates its weight gradient in bf16)
        std_name, level_api = "benchmark", ""
    overrides = (thresholds or {}).get(std_name, {})
    if std_name == "accumulative" and short in _SCANS and "eb_threshold" not in overrides:
        overrides = dict(overrides)  # copied only here: every judged row passes through this line
        # a scan's outputs are running sums, each the last plus one term: their errors are one random walk, not
        # independent draws, and a sign test over them reads the walk's long excursions as bias (the CPU's own
        # bf16 cumsum of 200,000 terms: error balance 0.61 against a limit of 0.32). The bound still holds
        overrides["eb_threshold"] = 1.0
    std = make_standard(std_name, judged, level_api, **overrides)
    oracle = o if isinstance(o, torch.Tensor) and o.is_floating_point() else None
    ask_equal = std_name == "benchmark" and t.dtype == b.dtype and t.device == b.device
    peak = top = identical = None
    if reads_wait(t) and (oracle is None or oracle.device == t.device):
        # on an accelerator every host read waits for the device: what the row's judgement reads before its
        # standard runs (the oracle's peaks, whether the target is the bench) comes back in one transfer. On the
        # CPU a read costs nothing, and each is taken only where it is needed
        peak, top, identical = row_facts(oracle if t.is_floating_point() else None,
                                         *((t, b) if ask_equal else (None, None)))
    if oracle is not None and t.is_floating_point():
        saturated = saturate(oracle, t.dtype, peak)
        if saturated is not oracle:  # values past the dtype's range became infinities: its finite peak moved
            top = None
        oracle = saturated
    if ask_equal and (identical if identical is not None else torch.equal(t, b)):
        # the target is bit-identical to the same-dtype bench: its error against the oracle *is* the bench's
        # error, so every ratio of the standard is exactly 1 (<= every level's threshold); nothing is recomputed
        ratios = {k: 1.0 for k in ("max_rel_err", "mean_rel_err", "rmse", "small_value_err")}
        return CheckResult("benchmark", "pass", {f"{k}_ratio": 1.0 for k in ratios}, dict(std.ratios), ratios,
                           "bit-identical to the same-dtype bench: every ratio 1, not recomputed")
    lazy = terms if std_name == "benchmark" and callable(terms) else None
    held = bool(getattr(terms, HELD_IN_DTYPE, False))  # read before the unit divisions make new tensors
    if lazy is not None or not isinstance(terms, torch.Tensor) or std_name != "benchmark" or terms.shape != t.shape:
        terms = None
    unit = 1.0  # a gradient's own scale, which its error scale is divided by too
    if backward and oracle is not None and t.is_floating_point() and b.is_floating_point():
        # gradients have no natural scale (they scale with the loss): judge them relative to their own largest
        # magnitude, so the standards' small-value band is a fraction of the tensor's scale, not an absolute value
        scale = finite_peak(oracle) if top is None else top
        if scale > 0:
            t, b, oracle = (x.detach().to(torch.float64) / scale for x in (t, b, oracle))
            terms = terms / scale if terms is not None else None
            unit = scale
    if not backward and oracle is not None and t.is_floating_point() and b.is_floating_point() and \
            std_name in ("benchmark", "absolute_threshold", "thousandth"):
        # msprobe's small-value rule (|value| under a fixed threshold: absolute error) was made for O(1) outputs:
        # a tensor of 1e-9 numbers (AdamW's second moment, eval-mode activations of a deep CNN) would be all "small"
        # and pass a 5% fault. Below scale 1 the rule is applied in units of the tensor's own scale (the largest
        # finite |oracle|, rounded down to a power of two so every value keeps its mantissa), never finer than the
        # dtype's smallest normal number: fp16 subnormals are still judged by absolute error
        down = _own_scale(oracle, judged, top)
        if down < 1.0:
            t, b, oracle = (x.detach().to(torch.float64) / down for x in (t, b, oracle))
            terms = terms / down if terms is not None else None
            unit = down
    if std_name == "accumulative" and not backward and isinstance(scale, torch.Tensor) and \
            scale.shape == t.shape and t.is_floating_point() and b.is_floating_point():
        # msprobe's accumulative standard judges |values| <= 1 by absolute error, as if the summed terms were of
        # magnitude 1: a mean of 1e-5 values (RMSNorm of small activations) would pass a 5% error. In units of the
        # terms' own magnitude the same test holds for any scale, and a cancelling sum is still judged at its terms
        s64 = scale.detach().to(device=t.device, dtype=torch.float64)  # drawn on the CPU, judged where t lies
        bound = dtype_thresholds(checker_key(t.dtype))["accumulative_bound"]
        if count is not None and oracle is not None:
            # a correct kernel accumulates in fp32 (u_acc 2^-24, what PyTorch's opmath and GPU/NPU kernels do) and
            # rounds the result once: it errs by up to count * u_acc of the terms plus half a rounding of the
            # result. Units of the terms alone would let a 1% fault through wherever the terms cancel to a result
            # under 1/2.6 of them (ConvNeXt's channels-first LayerNorm, x.mean(1) of centred activations, passed
            # 1% in bf16); twice the accumulation's bound keeps a correct kernel at half the standard's bound
            s64 = torch.maximum(oracle.detach().to(device=t.device, dtype=torch.float64).abs(),
                                s64 * min(1.0, 2.0 * count * 2.0 ** -24 / bound))
        s64 = torch.where(s64 > 0, s64, torch.ones_like(s64))
        # never finer than the dtype can hold: a result rounded into fp16's subnormal range errs by up to half of
        # its smallest subnormal (3e-8) whatever the terms, which is within the bound in units of at least this
        s64 = s64.clamp(min=torch.finfo(t.dtype).smallest_normal * torch.finfo(t.dtype).eps / bound)
        t, b, oracle = _in_units(t, b, oracle, s64)
    if std_name == "accumulative" and short in _PRODUCTS and not backward and oracle is not None and \
            t.is_floating_point() and b.is_floating_point():
        # a product errs relative to itself (msprobe's absolute test below 1 would let a 0.01 product off by 80%):
        # judged in units of |oracle|. A half-precision kernel may hold its running product in the dtype (PyTorch's
        # CPU one does), up to one rounding per factor after the first, where that is wider than the bound
        if count and t.dtype in (torch.bfloat16, torch.float16):
            held = (count - 1.0) * torch.finfo(t.dtype).eps / 2
            if held > dtype_thresholds(checker_key(t.dtype), overrides)["accumulative_bound"]:
                std = make_standard(std_name, judged, level_api, **dict(overrides, accumulative_bound=held))
        s64 = oracle.detach().to(device=t.device, dtype=torch.float64).abs()
        s64 = torch.where(s64 > 0, s64, torch.ones_like(s64)).clamp(min=torch.finfo(t.dtype).smallest_normal)
        t, b, oracle = _in_units(t, b, oracle, s64)
    # NaN/Inf outputs (an overflowing fp16 optimizer step) are counted by the standards through their masks;
    # numpy's RuntimeWarnings on the masked-out inf - inf are noise in the user's test run
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if std_name == "binary":
            return std(t, b)
        if std_name == "ulp" and floor is not None:
            return std(t, b, oracle, floor=floor)
        if std_name == "benchmark":
            res = std(t, b, oracle, scale=terms, held=held)
            if lazy is not None and not (res.status == "pass" and res.metrics.get("bench_at_floor")):
                # the error scale is computed only where it can change the verdict: a plain pass against a bench
                # whose errors are all at their floor stays a pass with it (it only lowers the target's errors)
                s = lazy()
                if isinstance(s, torch.Tensor) and s.shape == t.shape:
                    res = std(t, b, oracle, scale=s / unit, held=getattr(s, HELD_IN_DTYPE, False))
            return res
        if std_name == "accumulative" and oracle is not None and not same_arithmetic:
            # the bench's own bias is the error balance's null only where it computes in the target's dtype: an
            # fp32 bench of a bf16 mean rounds differently from any bf16 kernel
            return std(t, None, oracle)
        return std(t, b, oracle)


def judge_rows(short: str, rows: list, *, backward: bool = False, standards: dict | None = None,
               thresholds: dict | None = None, inputs: tuple | None = None, budget=None,
               floor_dtype: Any = None) -> list:
    """Judge every output row of one API call: the one per-API step of isolation and replay alike.

    Each row goes through :func:`judge_pair`; a forward linear reduction with one output is judged in units of
    its result, or of its terms where they cancel (:func:`accumulation_scale`, :func:`accumulation_count`), and a
    row the ULP standard fails is judged once more with the fp32 accumulation allowance
    (:func:`accumulation_floor`), computed only then.

    Args:
        short: the API name without prefix and call number.
        rows: ``[(row name, target, bench, oracle)]``, on the CPU, the bench already rounded where it must be.
        backward: the rows are gradients.
        inputs: ``(func, args, kwargs)`` of the call (None: no scale, no allowance).
        budget: ``budget(i)``, the benchmark standard's error scale of row ``i`` (asked lazily), or None.
        floor_dtype: the dtype the allowance is computed in: the oracle row's dtype when None (float64 for a
            non-tensor oracle).

    Returns:
        ``[(row name, CheckResult)]`` in the order of ``rows``.
    """
    scale = count = None
    single = inputs is not None and len(rows) == 1
    if short in _LINEAR_REDUCTIONS and not backward and single:
        try:
            scale = accumulation_scale(short, *inputs)
            count = accumulation_count(short, *inputs, scale)
        except Exception:  # noqa: BLE001 - msprobe's unit scale then
            scale = count = None
    elif short in _PRODUCTS and not backward and single and isinstance(rows[0][1], torch.Tensor) and inputs[1] and \
            isinstance(inputs[1][0], torch.Tensor):  # the factors each output element multiplies
        count = inputs[1][0].numel() / max(rows[0][1].numel(), 1)
    out = []
    for i, (row, t, b, o) in enumerate(rows):
        res = judge_pair(short, t, b, o, backward, standards, thresholds, scale=scale,
                         terms=(lambda i=i: budget(i)) if budget is not None else None, count=count)
        if res.standard == "accumulative" and res.status == "error" and single and isinstance(t, torch.Tensor) and \
                "null_error_balance" not in res.metrics and \
                res.metrics.get("error_balance", 0.0) > res.thresholds.get("eb_threshold", math.inf):
            # a sign test failed against its symmetric null: judged once more against a correct kernel's own bias
            # on these terms, computed only then
            same = same_dtype_result(*inputs, t)
            if same is not None:
                res = judge_pair(short, t, b, o, backward, standards, thresholds, scale=scale, count=count, null=same)
        if res.standard == "ulp" and res.status == "error" and single:
            dtype = floor_dtype or (o.dtype if isinstance(o, torch.Tensor) else torch.float64)
            try:  # cancelling sums: the fp32 accumulation allowance, computed only when it matters
                floor = accumulation_floor(short, *inputs, dtype=dtype,
                                           target=t.dtype if isinstance(t, torch.Tensor) else None)
            except Exception:  # noqa: BLE001 - no allowance then: the verdict stands
                floor = None
            if floor is not None:
                res = judge_pair(short, t, b, o, backward, standards, thresholds, floor=floor)
        out.append((row, res))
    return out


def _in_units(t: torch.Tensor, b: torch.Tensor, oracle: torch.Tensor | None, s64: torch.Tensor) -> tuple:
    """``(t, b, oracle)`` as float64 in units of ``s64`` (the accumulative standard's element scale), with every
    element of ``t`` equal to the correctly rounded oracle set to the oracle exactly: it carries no accumulation
    error (the standard leaves it out of its bias test by comparing with the oracle rounded to the target's dtype,
    which float64 units hide); the same for ``b``, whose own bias is the test's null."""
    if oracle is None:
        return t.detach().to(torch.float64) / s64, b.detach().to(torch.float64) / s64, None
    exact, exact_b = (x.detach() == oracle.detach().to(x.dtype) for x in (t, b))
    t, b, oracle = (x.detach().to(torch.float64) / s64 for x in (t, b, oracle))
    return torch.where(exact, oracle, t), torch.where(exact_b, oracle, b), oracle


def _own_scale(oracle: torch.Tensor, dtype: torch.dtype, top: float | None = None) -> float:
    """The power of two at or under the largest finite ``|oracle|`` (``top`` where it is known already), at least
    the dtype's smallest normal number over its ``small_value`` threshold (so the scaled small-value band never
    reaches into subnormals); 1.0 for a tensor of scale 1 or more, an empty one, or one of zeros."""
    if top is None:
        top = finite_peak(oracle)
    if not 0.0 < top < 1.0:
        return 1.0
    small = dtype_thresholds(checker_key(dtype))["small_value"]
    lowest = torch.finfo(dtype).tiny / small if dtype.is_floating_point else 0.0
    return min(1.0, 2.0 ** math.floor(math.log2(max(top, lowest))))


def judged_as(short: str, args: Any, kwargs: dict, standards: dict | None = None) -> str:
    """The name an elementwise call is judged under: :data:`FMA` (no API entry: the default, benchmark standard,
    against the bench) where it rounds twice, else ``short``. msprobe's absolute-threshold standard allows one
    rounding of the result; it is exceeded legitimately by ``a + alpha*b`` (``alpha`` != 1: SGD's
    ``param.add_(buf, alpha=-lr)``, which cancels) and by a Python-float operand the target's dtype cannot hold
    (torch's CPU bf16/fp16 kernels round the scalar to the tensor's dtype first: AdamW's ``denom.add_(eps)``
    with ``eps`` 1e-8 is off by 1.1 roundings at values near 1e-8)."""
    if short in _ALPHA_OPS and kwargs.get("alpha", 1) != 1:
        return FMA
    if standard_for(short, "torch.float32", standards or {}) != "absolute_threshold":
        return short
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors or tensors[0].dtype == torch.float64:
        return short
    dtype = tensors[0].dtype
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, float) and math.isfinite(v) and float(torch.tensor(v, dtype=dtype)) != v:
            return FMA
    return short


def saturate(oracle: torch.Tensor, dtype: torch.dtype, peak: float | None = None) -> torch.Tensor:
    """The oracle with its values beyond ``dtype``'s finite range made ±inf, as correct rounding to ``dtype``
    gives (IEEE round to nearest: ``|x| >= max + ulp(max)/2`` overflows). A target that returns inf there (an
    fp32 ``finfo.min`` mask plus a bf16 one in GPT-Neo's attention) computed the right value, not an overflow
    error. Returns ``oracle`` itself when nothing lies beyond the range (one ``amax`` pass, or none where its
    ``peak``, :func:`~.peaks.abs_peak`, is known); shape and dtype are kept."""
    if oracle.dtype == dtype or not dtype.is_floating_point:
        return oracle
    if peak is None:
        peak = abs_peak(oracle)
    if peak <= torch.finfo(dtype).max:  # a NaN peak goes on: other elements may still overflow
        return oracle
    rounded = oracle.detach().to(dtype)
    over = torch.isinf(rounded) & torch.isfinite(oracle)
    return torch.where(over, rounded.to(oracle.dtype), oracle) if bool(over.any()) else oracle


def judge_dropout(short: str, target: Any, source: Any, p: float, thresholds: dict | None = None) -> CheckResult:
    """A dropout's output row judged by its share of zeros against ``p`` (the dropout standard), counting only the
    draws its mask made: ``source`` (the dropout's input, taken before an in-place call) leaves out the elements
    that were zero already, and a channel dropout (``short`` ``dropout1d``/``2d``/``3d``) draws once per channel
    (:func:`~.support.dropout_block`). ``source`` of another shape, or not a tensor, is not used."""
    from .support import dropout_block

    shape = tuple(getattr(target, "shape", ()))
    src = source if isinstance(source, torch.Tensor) and tuple(source.shape) == shape else None
    std = make_standard("dropout", getattr(target, "dtype", "fp32"), p=float(p),
                        **(thresholds or {}).get("dropout", {}))
    return std(target, source=src, block=dropout_block(short, shape))
