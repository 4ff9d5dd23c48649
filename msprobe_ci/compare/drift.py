"""The drift rule's inputs: how far a node's output may move given what its inputs carried.

:func:`judge_node` applies the node rule of :mod:`msprobe_ci.compare.verdict` (stated there as formulas) to one
node's compared rows: the inputs' errors, the roundoff its data carried (:func:`carried_roundoff`), the range it
carried (:func:`carried_range`), a gradient's cancellation (:func:`cancellation`) and summation lengths
(:func:`reduction_length`, :func:`contraction_length`), routing ops (:func:`routing_error`), the scale test on the
Norm and the gradient allowances. Used by the in-memory compare (:mod:`.engine`) and the streaming one
(:mod:`.stream`) alike.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

from ..dtypes import finite_max
from ..dump import names
from ..status import SEVERITY
from .rows import Row
from .report import RowResult
from .verdict import CompareResult, Thresholds, judge, unit_roundoff


@functools.lru_cache(maxsize=4096)  # asked three or four times per node in a row
def twin_entries(name: str) -> tuple[str, ...]:
    """Entries whose rows a node computes from, besides its own inputs (:mod:`msprobe_ci.dump.names`): a
    backward call's forward twin; a parameters_grad entry's module forward and backward calls."""
    node = names.parse(name, any_prefix=True)
    if node is None:
        return ()
    if node.kind in ("api", "module") and node.direction == "backward":
        return (node.twin("forward"),)
    if node.kind == "parameters_grad" and node.call is not None:
        return (node.twin("forward"), node.twin("backward"))
    return ()


def carried_range(t: Row, b: Row | None, reach: float) -> float:
    """The smallest finite range (``finfo.max``) among the dtypes of the matched rows seen so far in the target's
    dump order: ``reach`` and this pair's.

    What the target once held in a narrow dtype stays within that range after an upcast, while the bench's
    values need not: GPT-J adds its fp16 attention mask (``finfo(float16).min``) to fp32 scores, where the fp32
    bench adds ``finfo(float32).min`` and overflows to ``-inf``. Both mean "masked"; beyond the carried range
    statistics compare clamped (:func:`msprobe_ci.compare.metrics.relative_error_stats`)."""
    if b is None:
        return reach
    m = min(dtype_max(t.dtype), dtype_max(b.dtype))
    return m if m < reach else reach


@functools.lru_cache(maxsize=256)
def dtype_max(dtype: str) -> float:
    m = finite_max(dtype)
    return math.inf if m is None else m


def carried_roundoff(own: list[RowResult], floor: float) -> float:
    """The coarsest unit roundoff among the matched rows seen so far in the target's dump order: ``floor`` and
    ``own``'s target and bench dtypes.

    Data rounded once to a dtype carries that dtype's error into everything computed from it, even after an
    upcast (an fp32 RMSNorm reduction of fp16 activations). Statistics cannot show it: averaged over a whole tensor,
    per-element rounding cancels, so an input's Mean/Norm error understates what each reduced row carries. The node
    rule therefore uses at least this roundoff (see :mod:`msprobe_ci.compare.verdict`)."""
    for r in own:
        if r.bench is not None:
            u = max(_dtype_roundoff(r.target.dtype), _dtype_roundoff(r.bench.dtype))
            if u > floor:
                floor = u
    return floor


@functools.lru_cache(maxsize=256)
def _dtype_roundoff(dtype: str) -> float:
    return unit_roundoff(dtype)


def judge_node(name: str, own: list[RowResult], by_entry: dict[str, list[RowResult]], mode: str,
                th: Thresholds, floor: float) -> CompareResult:
    """One node's verdict. ``floor``: :func:`carried_roundoff` up to and including this node's rows (it covers
    the output dtypes, so it is the node's u)."""
    outputs = [r for r in own if r.target.side == "output" and r.bench is not None]
    inputs = [r for r in own if r.target.side == "input" and r.bench is not None]
    for twin in twin_entries(name):
        inputs += [r for r in by_entry.get(twin, []) if r.bench is not None]
    if not own or all(r.bench is None for r in own):
        return CompareResult(name=name, status="unmatched", message=f"{name}: no bench data matched")
    if not outputs:
        return CompareResult(name=name, status="pass", message=f"{name}: no output to judge")
    if mode == "md5":
        return _judge_md5(name, inputs, outputs)
    errs = sorted((r.error for r in inputs if not math.isnan(r.error)), reverse=True)
    # bilinear ops (mul, matmul, linear) add the errors of their two operands; a backward node combines the
    # incoming gradient with the saved operands of its forward twin, so three
    gradient = ".backward" in name or ".parameters_grad" in name
    r_in = sum(errs[:3] if gradient else errs[:2])
    api = _api_name(name)
    if api in POWER_APIS and ".forward" in name:
        r_in *= max(1.0, _exponent(api, own))
    kappa = 1.0
    routed = 0.0
    incoming: list = []
    saved: list = []
    if gradient:
        incoming, saved = _gradient_operands(name, own, by_entry)
        if api in ROUTING_APIS and saved:
            routed = routing_error(max(o[0] for o in saved))
            r_in = max(r_in, routed)
        scatter = api in SCATTER_APIS or ".Embedding." in name
        kappas = [(r, cancellation(_operand(r), incoming, saved, scatter)) for r in outputs]
        worst, kappa = max(kappas, key=lambda rk: (rk[0].error / rk[1] if not math.isnan(rk[0].error) else -1.0))
    else:
        kappas = [(r, 1.0) for r in outputs]
        worst = max(outputs, key=lambda r: (r.error if not math.isnan(r.error) else -1.0))
    if api in LIPSCHITZ_APIS and not gradient:  # a property of the forward function, not of its gradient
        r_in = max(r_in, _absolute_input_error(inputs, worst))
    u = floor
    module = name.startswith("Module.") and ".parameters_grad" not in name
    if module:
        r_in += u  # a module's parameters are inputs its entry does not show: they carry at least their rounding
    statistics = mode == "statistics"

    def verdict(u_eff: float) -> tuple[CompareResult, CompareResult | None]:
        """(the worst-statistic test, the scale test or None) at roundoff ``u_eff``."""
        drift = judge(name, worst.error, r_in, u_eff, th, worst.target.name, worst.metrics, statistics=statistics,
                      condition=kappa)
        if not statistics:
            return drift, None
        return drift, _scale_test(name, inputs, own, kappas, api, gradient, module, routed, u_eff, r_in, th)

    drift, scale = verdict(u)
    result = scale if scale is not None and SEVERITY[scale.status] > SEVERITY[drift.status] else drift
    if result.status == "error" and gradient and statistics:
        result = _gradient_allowances(result, drift, scale, verdict, outputs, incoming, saved, u)
    if result.status == "error" and ".parameters_grad" in name and not incoming:
        # the gradient its module's backward received is not in the dump (an embedding's: its input is integer
        # ids), so what this accumulated gradient was computed from is unseen, not clean (_blame_first)
            result = replace(result, metrics=dict(result.metrics, inputs_unseen=True))
    return result


def _gradient_allowances(result: CompareResult, drift: CompareResult, scale: CompareResult | None, verdict,
                         outputs: list[RowResult], incoming: list, saved: list, u: float) -> CompareResult:
    """A gradient's error (statistics mode) that a benign kernel or the statistics themselves can explain becomes
    a warning saying how, each test (worst statistic, scale) on its own failing row:

    * a sum over K broadcast rows (a bias's or a normalization weight's gradient, a per-row scale's) accumulated
      in the target's dtype, as CPU kernels may (GPU and NPU kernels accumulate in float32): worst case about
      ``u · K / 2``, so the test is judged again with that roundoff (CPU bf16 LayerNorm weight gradients of GPT-2
      small: 6% at 512 tokens, 33% at 2048, measured by ``benchmarks/drift_calibration.py``); a contraction over
      K (a weight gradient) so accumulated, whose products have no common sign: ``u · sqrt(K)`` (a CPU fp16
      conv2d weight gradient over 1,024 positions: 7.7u);
    * the worst statistic failing (a Max, Min or Mean: one element, or a sum with cancellation) while the scale test
      passes: each element of a gradient sums several products, each carrying its operands' own error, which the
      operands' statistics do not bound (their Max and Min are other elements). Measured on stock OPT at bf16:
      a weight gradient's Max 2.7x, a positional embedding gradient's Min 4.4x its inputs' worst statistic, with
      the norms within 0.5%. A gradient scaled by a fault moves its norm and fails the scale test."""
    why = []

    def summed(test: CompareResult, pick: int) -> bool:
        row = next((r for r in outputs if r.target.name == test.worst_row), None)
        if row is None:
            return False
        k = reduction_length(_operand(row), incoming)
        if k > 1:
            wide_u, how = u * k / 2, f"a sum over {k} rows accumulated in the target's dtype (u x {k}/2"
        else:
            k = contraction_length(_operand(row), incoming, saved)
            if not k:
                return False
            wide_u, how = u * math.sqrt(k), f"a contraction over {k} accumulated in the target's dtype (u x sqrt({k})"
        wide = verdict(wide_u)[pick]
        if wide is None or wide.status == "error":
            return False
        why.append(f"{test.worst_row} is within what {how} = {wide_u:.3g}; CPU kernels may accumulate so, GPU and "
                   f"NPU kernels accumulate in float32) can reach")
        return True

    scale_ok = scale is None or scale.status != "error" or summed(scale, 1)
    drift_ok = drift.status != "error" or summed(drift, 0)
    if not drift_ok and scale is not None and scale_ok:
        drift_ok = True
        why.append(f"its norm agrees with its inputs' ({scale.value:.3g} <= {scale.threshold:.3g}), and one "
                   f"element of a gradient may err more than its inputs' statistics show")
    if drift_ok and scale_ok:
        return replace(result, status="warning", message=f"{result.message}; {'; '.join(why)}: a warning, not an "
                                                         f"error")
    return result




def _scale_test(name: str, inputs: list[RowResult], own: list[RowResult], kappas: list, api: str, gradient: bool,
                module: bool, routed: float, u: float, r_in_drift: float, th: Thresholds) -> CompareResult | None:
    """The drift rule's scale test (statistics mode): the output's Norm error (:func:`metrics.norm_error`)
    against the inputs' Norm errors, as the node rule judges the worst statistic (round_factor, propagation,
    statistics slack, error_factor, a gradient's cancellation factor), plus the inputs' drift error squared (noise
    that is not a change of scale moves a norm to second order). Rounding moves a norm by at most ``u``, so a
    fault that scales an output by 2% stands out against bf16's ``u`` 0.4% even where the inputs' Max and Min
    carry as much: the worst-statistic test alone let such faults pass. None where an input's or every output's
    Norm says nothing (masked, missing, out of range): the inputs' scale error is then unknown."""
    ins = []
    for r in inputs:
        if math.isnan(r.norm_error):
            return None
        ins.append(r.norm_error)
    outs = [(r, k) for r, k in kappas if not math.isnan(r.norm_error)]
    if not outs:
        return None
    ins.sort(reverse=True)
    r_in = sum(ins[:3] if gradient else ins[:2])
    if api in POWER_APIS and not gradient:
        r_in *= max(1.0, _exponent(api, own))
    r_in = max(r_in, routed)
    worst, kappa = max(outs, key=lambda rk: rk[0].norm_error / rk[1])
    if api in LIPSCHITZ_APIS and not gradient:
        r_in = max(r_in, _absolute_input_error(inputs, worst, norm=True))
    if module:
        r_in += u
    res = judge(name, worst.norm_error, r_in, u, th, worst.target.name, dict(worst.metrics, test="scale"),
                statistics=True, condition=kappa, second_order=r_in_drift * r_in_drift, test="Norm")
    if r_in_drift > res.input_error:  # after a first divergence, inputs that carried error explain a node
        # (_blame_first), whichever statistic shows it
        res = replace(res, input_error=r_in_drift)
    return res


def _operand(r: RowResult) -> tuple[float, float, int, list] | None:
    """``(error, bench L2 norm, numel, shape)`` of a matched tensor row with a finite, non-zero bench norm."""
    b = r.bench
    if b is None or not b.is_tensor or math.isnan(r.error) or math.isinf(r.error):
        return None
    norm = row_norm(b)
    if not norm or math.isinf(norm) or math.isnan(norm):
        return None
    return (r.error, norm, b.numel, b.dims)


def _gradient_operands(name: str, own: list[RowResult], by_entry: dict[str, list[RowResult]]):
    """The incoming gradients of a backward or parameters_grad node (the backward call's own inputs; the module's
    backward inputs for parameters_grad) and the saved forward operands (the forward twin's inputs)."""
    incoming = [r for r in own if r.target.side == "input"] if ".backward" in name else []
    saved = []
    for twin in twin_entries(name):
        for r in by_entry.get(twin, []):
            if r.target.side != "input":
                continue
            (incoming if ".backward" in twin else saved).append(r)
    return ([o for o in map(_operand, incoming) if o is not None], [o for o in map(_operand, saved) if o is not None])


def cancellation(out: tuple | None, incoming: list[tuple], saved: list[tuple], scatter: bool = False) -> float:
    """How much a gradient output's relative error may exceed its operands' (>= 1), from L2 norms and shapes.

    A gradient is a sum: a bias or broadcast operand's gradient sums the incoming gradient ``g`` (times the other
    operand ``x``) over the broadcast axes; a weight gradient contracts ``g`` with a saved input over K tokens.
    Rounding errors of the terms add up like a random walk, ``‖δ‖ ≈ r · sqrt(Σ term²)``, whatever the terms add up
    to; where they cancel (a bias feeding a normalization or a softmax sums to zero by symmetry) the result is
    small and its relative error large. Estimated ``sqrt(Σ term²)``: reduction ``‖g‖·rms(x)`` (x: a saved operand
    of g's size, or ones), contraction over K ``‖g‖·‖x‖/√K`` (K a dimension of both, or the product of their
    leading dimensions, which a linear layer's weight gradient flattens; ``K² = numel(g)·numel(x) / numel(out)``).
    The factor is the largest estimate over the output's norm, and 1 for uncorrelated terms.

    Args:
        out: ``(error, bench norm, numel, shape)`` of the output row (None: no estimate, 1).
        incoming: the same tuples for the incoming gradients; saved: for the forward operands.
        scatter: an embedding's weight gradient, a scatter-add: each incoming element lands in one output row,
            so ``sqrt(Σ term²) = ‖g‖`` whatever the sizes.
    """
    if out is None:
        return 1.0
    _, n_out, size_out, dims_out = out
    kappa = 1.0
    free = sorted(d for d in dims_out if d != 1)
    for _, n_g, size_g, dims_g in incoming:
        if scatter:
            kappa = max(kappa, n_g / n_out)
        if _summed_over_broadcast(size_out, free, size_g, dims_g):
            kappa = max(kappa, n_g / n_out)  # x = ones
            for _, n_x, size_x, _ in saved:
                if size_x == size_g:
                    kappa = max(kappa, n_g * n_x / math.sqrt(size_x) / n_out)
        if size_out != size_g:
            for _, n_x, size_x, dims_x in saved:
                k = _contraction(size_g, dims_g, size_x, dims_x, size_out)
                if k:
                    kappa = max(kappa, n_g * n_x / math.sqrt(k) / n_out)
    return kappa


def _contraction(size_g: int, dims_g: tuple, size_x: int, dims_x: tuple, size_out: int) -> int:
    """K when a gradient of ``size_out`` elements contracts ``g`` with a saved ``x`` over K (``K² = numel(g) ·
    numel(x) / numel(out)``, K a dimension of both or their flattened rows), else 0."""
    k2 = size_g * size_x // size_out if size_out else 0
    k = math.isqrt(k2)
    if k >= 2 and k * k == k2 and k2 * size_out == size_g * size_x and _contracted(k, dims_g) \
            and _contracted(k, dims_x):
        return k
    return 0


def contraction_length(out: tuple | None, incoming: list[tuple], saved: list[tuple]) -> int:
    """K of a gradient output that contracts an incoming gradient with a saved operand over K (a weight gradient
    summing K tokens' products; :func:`cancellation`), else 0."""
    if out is None:
        return 0
    size_out, dims_out = out[2], out[3]
    k = 0
    for _, _, size_g, dims_g in incoming:
        if size_out != size_g:
            for _, _, size_x, dims_x in saved:
                k = max(k, _contraction(size_g, dims_g, size_x, dims_x, size_out))
            if not k and len(dims_out) >= 3 and len(dims_g) == len(dims_out) and dims_g[1] == dims_out[0]:
                k = size_g // dims_g[1]  # a convolution's weight gradient sums over the batch and the positions
    return k


def _contracted(k: int, dims: tuple) -> bool:
    """``k`` is a dimension of ``dims`` or the product of all but its last (the rows a linear layer flattens)."""
    if k in dims:
        return True
    lead = 1
    for d in dims[:-1]:
        lead *= d
    return len(dims) > 2 and lead == k


def _sub_multiset(small: list[int], dims: tuple) -> bool:
    pool = [d for d in dims if d != 1]
    for d in small:
        if d not in pool:
            return False
        pool.remove(d)
    return True


# Elementwise APIs with |f'(x)| <= ~1.1: their absolute output error is bounded by the absolute input error, so
# relative error may grow where |x| >> |f(x)| (sin/cos of large angles, as in rotary embeddings).
LIPSCHITZ_APIS = frozenset({"sin", "cos", "tanh", "sigmoid", "silu", "gelu", "relu", "leaky_relu", "elu",
                            "hardtanh", "softsign", "atan", "erf", "clamp", "abs"})


# Piecewise APIs whose backward routes the gradient by a comparison made in the forward (relu's sign, max-pool's
# argmax, clamp's bounds): an input error that moves a value across the decision point moves a whole gradient
# element, not a rounding of it (routing_error).
ROUTING_APIS = frozenset({"relu", "relu6", "hardtanh", "threshold", "clamp", "clip", "max_pool1d", "max_pool2d",
                          "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "max",
                          "min", "amax", "amin", "maximum", "minimum", "abs", "hardswish", "hardsigmoid",
                          "leaky_relu", "prelu", "rrelu", "topk", "sort", "median"})

# APIs whose backward is a scatter-add of the incoming gradient into a weight (cancellation(scatter=True))
SCATTER_APIS = frozenset({"embedding", "embedding_bag", "index_select", "gather"})


def routing_error(r_fwd: float) -> float:
    """The relative L2 error a routing API's gradient may carry when its forward input carried ``r_fwd``.

    Values within ``r_fwd·rms`` of a decision point (a ReLU's 0, a max-pool window's runner-up) may land on the
    other side: a fraction about ``r_fwd`` of the elements, each moving a whole gradient element, so the relative
    L2 error is about ``sqrt(2·r_fwd)`` (the square root of the moved fraction, over the half of the elements that
    carry a gradient). Rounding (relative, sign-keeping) never moves a value across 0 by itself; accumulated error
    does."""
    if math.isnan(r_fwd) or r_fwd <= 0:
        return 0.0
    return math.sqrt(2.0 * r_fwd)


# x**p multiplies a relative error by |p| (its condition number)
POWER_APIS = frozenset({"pow", "__pow__", "square", "float_power"})


def _exponent(api: str, rows: list[RowResult]) -> float:
    if api == "square":
        return 2.0
    for r in rows:
        if r.target.side == "input" and not r.target.is_tensor and r.target.record is not None:
            try:
                return abs(float(r.target.record.get("value")))
            except (TypeError, ValueError):
                continue
    return 1.0


def _api_name(node: str) -> str:
    parts = node.split(".")
    return parts[1] if len(parts) > 2 and parts[0] in ("Tensor", "Torch", "Functional") else ""


def _absolute_input_error(inputs: list[RowResult], out: RowResult, norm: bool = False) -> float:
    """Worst input error expressed relative to the output's scale: ``r_in · ‖in‖ / ‖out‖`` (Norm statistics;
    ``norm``: the inputs' Norm errors instead of their drift errors)."""
    out_norm = row_norm(out.bench)
    if not out_norm:
        return 0.0
    worst = 0.0
    for r in inputs:
        n = row_norm(r.bench)
        err = r.norm_error if norm else r.error
        if n and not math.isnan(err):
            worst = max(worst, err * n / out_norm)
    return worst


def reduction_length(out: tuple | None, incoming: list[tuple]) -> int:
    """How many incoming-gradient elements a gradient output sums into each of its own: ``numel(g) / numel(out)``
    where the output is ``g`` summed over broadcast axes (a bias's or a normalization weight's gradient: the
    tokens of a batch), else 1 (a contraction: :func:`contraction_length`)."""
    if out is None:
        return 1
    _, _, size_out, dims_out = out
    free = sorted(d for d in dims_out if d != 1)
    k = 1
    for _, _, size_g, dims_g in incoming:
        if _summed_over_broadcast(size_out, free, size_g, dims_g):
            k = max(k, size_g // size_out)
    return k


def _summed_over_broadcast(size_out: int, free: list[int], size_g: int, dims_g: tuple) -> bool:
    """An output of ``size_out`` elements (its dimensions other than 1: ``free``) is ``g`` summed over the axes
    it was broadcast along: smaller, dividing ``g``'s size, its dimensions among ``g``'s."""
    return 0 < size_out < size_g and size_g % size_out == 0 and _sub_multiset(free, dims_g)


def row_norm(row: Row | None) -> float:
    if row is None or not row.is_tensor:
        return 0.0
    try:
        return abs(float(row.stats()[3]))
    except (TypeError, ValueError):
        return 0.0


def _judge_md5(name: str, inputs: list[RowResult], outputs: list[RowResult]) -> CompareResult:
    diff_out = [r for r in outputs if r.error > 0]
    if not diff_out:
        return CompareResult(name=name, status="pass", metric="MD5", message=f"{name}: CRC-32 equal")
    worst = diff_out[0]
    if any(r.target.dtype != r.bench.dtype for r in outputs if r.bench is not None):
        return CompareResult(name=name, status="warning", metric="MD5", value=1.0, threshold=0.0,
                             worst_row=worst.target.name,
                             message=f"{name}: CRC-32 differs but the dtypes differ, md5 cannot judge")
    if any(r.error > 0 for r in inputs):
        return CompareResult(name=name, status="pass", metric="MD5", value=1.0, threshold=1.0,
                             worst_row=worst.target.name, message=f"{name}: CRC-32 differs as its inputs do")
    return CompareResult(name=name, status="error", metric="MD5", value=1.0, threshold=0.0, budget=0.0,
                         worst_row=worst.target.name, passing_threshold=1.0,
                         message=f"{name}: CRC-32 of {worst.target.name} differs while every input is identical")
