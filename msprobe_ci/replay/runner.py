"""Replaying one dumped API call alone and judging each output with its own standard.

For a forward entry ``<Prefix>.<api>.<n>.forward``:

1. the arguments are rebuilt (:mod:`.args`);
2. the **oracle** runs on CPU with every floating tensor upcast to fp64 (fp32 where the API has no fp64 kernel);
3. the **bench** runs on CPU in the dumped dtypes (the reference implementation of the same precision, for the
   benchmark standard's "error of the bench itself");
4. the **target** is the output recorded in the dump (tensor task; offline, so a CPU runner judges an NPU dump),
   or, with ``live=True``, the API re-run in the dumped dtypes;
5. each output pair is judged by :func:`msprobe_ci.checkers.standard_for` (integer/bool outputs: binary).

Backward entries replay the forward on the oracle and bench sides with gradients enabled and feed the dumped
upstream gradient (``input[0]``); the gradients of the positional tensor arguments are compared with the dumped
target gradients (``output``).

What cannot be judged is skipped with the reason: communication and fused device ops (no CPU kernel), random ops
other than dropout, statistics dumps offline (their target outputs belong to other inputs), a missing forward.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..checkers import CheckResult, make_standard, standard_for, worst
from ..checkers.common import dtype_thresholds
from ..dtypes import checker_key
from ..dump import names
from ..dump.reader import Dump
from ..errors import MsprobeError
from ..kernels import cast as _cast
from . import allowlist
from .args import Rebuilder, api_generator

_UNSUPPORTED_PREFIX = {"Distributed": "communication op", "MindSpeed": "MindSpeed fused op",
                       "NPU": "torch_npu op with no CPU kernel", "Aten": "aten op (not replayable here)",
                       "VF": "torch._VF op"}
_RANDOM = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
           "bernoulli_", "normal", "normal_", "multinomial", "uniform_", "exponential_", "random_", "poisson"}
_NOT_COMPARABLE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_ALPHA_OPS = frozenset({"add", "add_", "sub", "sub_", "rsub"})
FMA = "fused multiply-add"  # what an alpha op is judged as: no API entry, so the default (benchmark) standard


@dataclass
class ApiResult:
    """Verdict of one API call in one direction.

    Attributes:
        name: dump name, e.g. ``Functional.linear.0.forward``.
        status: ``pass`` / ``warning`` / ``error`` / ``skip``.
        outputs: ``[(row name, CheckResult)]`` per compared output.
        reason: why it was skipped (empty otherwise).
        info: ``{row: (oracle dtype, target dtype, shape)}`` for the details CSV.
        autocast: for a call made under autocast, the dtype its inputs were replayed in and how that is known
            (``bfloat16 (recorded)``, ``float16 (inferred)``: :func:`msprobe_ci.amp.of_entry`); empty otherwise.
    """

    name: str
    status: str
    outputs: list[tuple[str, CheckResult]] = field(default_factory=list)
    reason: str = ""
    info: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    autocast: str = ""

    @property
    def message(self) -> str:
        if self.status == "skip":
            return self.reason
        amp = f" [autocast: inputs replayed in {self.autocast}]" if self.autocast else ""
        bad = [(n, r) for n, r in self.outputs if r.status in ("error", "warning")]
        if not bad:
            return f"{len(self.outputs)} output(s) pass{amp}"
        n, r = bad[0]
        return f"{n}: {r.standard} {r.status}: {r.message}{amp}"


def parse_name(name: str) -> tuple[str, str, int, str]:
    """``(prefix, api, call, direction)`` of a dump name; raises MsprobeError for anything else."""
    p = names.parse(name, any_prefix=True)
    if p is None or p.kind != "api":
        raise MsprobeError(f"{name}: not an API call name (<Prefix>.<api>.<n>.forward|backward)")
    return p.prefix, p.api, int(p.call), p.direction


@functools.lru_cache(maxsize=None)
def resolve(prefix: str, api: str):
    """The torch callable of an API, or raise MsprobeError saying why it is not replayable.

    Names resolve only through the replay allowlist (:mod:`msprobe_ci.replay.allowlist`, data): a dump cannot
    name ``os.system``, ``load``, ``save`` or any other function that is not a listed tensor operation.
    """
    if prefix in _UNSUPPORTED_PREFIX:
        raise MsprobeError(f"{prefix}.{api}: {_UNSUPPORTED_PREFIX[prefix]}; not replayable on CPU")
    if prefix not in allowlist.PREFIXES:  # a MindSpore API whose PyTorch twin takes the same arguments
        from ..compare.crossframe import torch_api

        base, row = torch_api(prefix, api)
        if base is not None and (row.get("replay") or not row) and "." in base:
            t_prefix, t_api = base.split(".", 1)
            if t_prefix in allowlist.PREFIXES and (func := allowlist.lookup(t_prefix, t_api)) is not None:
                return func
            raise MsprobeError(f"{prefix}.{api}: its PyTorch twin {base} is not on the replay allowlist")
        raise MsprobeError(f"{prefix}.{api}: unknown API prefix (replay knows {', '.join(allowlist.PREFIXES)})")
    func = allowlist.lookup(prefix, api)
    if func is None:
        raise MsprobeError(f"{prefix}.{api}: not on the replay allowlist (tensor operations only; "
                           "I/O, process, file, RNG-state and serialisation functions are never replayed)")
    return func


@functools.lru_cache(maxsize=None)
def _short(prefix: str, api: str) -> str:
    """The API name the standards registry knows: ``linear`` for ``Functional.linear`` and for MindSpore's
    ``Primitive.dense.Dense`` (its PyTorch twin)."""
    if prefix not in allowlist.PREFIXES:
        from ..compare.crossframe import torch_api

        base, _ = torch_api(prefix, api)
        if base is not None:
            return base.rsplit(".", 1)[-1]
    return api.rsplit(".", 1)[-1]


def _upcast(dtype: torch.dtype):
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        return t.to(dtype) if t.is_floating_point() else t
    return fn


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _outputs(value: Any, stem: str) -> list[tuple[str, Any]]:
    """Flatten an API output into ``(row name, tensor or scalar)`` pairs, msprobe's row naming."""
    if isinstance(value, (list, tuple)):
        out = []
        for i, v in enumerate(value):
            out += _outputs(v, f"{stem}.{i}") if isinstance(v, (list, tuple)) else [(f"{stem}.{i}", v)]
        return out
    return [(f"{stem}.0", value)]


def _records(recs: Any, stem: str) -> list[tuple[str, Any]]:
    if isinstance(recs, dict) and "type" not in recs:
        recs = list(recs.values())
    if not isinstance(recs, list):
        recs = [recs]
    out = []
    for i, r in enumerate(recs):
        out += _records(r, f"{stem}.{i}") if isinstance(r, list) else [(f"{stem}.{i}", r)]
    return out


def _mindspore_order(targets: list, grads: list, last_first: bool) -> list:
    """Torch's gradients (in its autograd node's order, None where an input needs none) lined up with a MindSpore
    backward entry's outputs, which hold only the gradients that exist (a Primitive's last input first): paired
    by shape, equal shapes first (ties in MindSpore's order), then a 2-D gradient with its transpose (torch's
    ``addmm`` hands back dW transposed). Unchanged when some target finds no partner."""
    free = [g for g in grads if isinstance(g, torch.Tensor)]
    free = free[::-1] if last_first else free
    out: list = [None] * len(targets)
    for transposed in (False, True):
        for i, (_, t) in enumerate(targets):
            if out[i] is not None or not isinstance(t, torch.Tensor):
                continue
            want = tuple(t.shape)[::-1] if transposed else tuple(t.shape)
            if transposed and len(want) != 2:
                continue
            j = next((k for k, g in enumerate(free) if tuple(g.shape) == want), None)
            if j is not None:
                hit = free.pop(j)
                out[i] = hit.t() if transposed else hit
    if any(o is None and isinstance(t, torch.Tensor) for o, (_, t) in zip(out, targets)):
        return grads
    return out


def judge_pair(short: str, t: Any, b: Any, o: Any, backward: bool = False, standards: dict | None = None,
               thresholds: dict | None = None, floor: Any = None, scale: Any = None, terms: Any = None) -> CheckResult:
    """Judge one output (or gradient) of API ``short`` by its per-API standard.

    Args:
        short: the API name without prefix and call number (``linear``, ``__add__``).
        t: the target value (tensor or scalar). b: the same-dtype bench value. o: the fp64 (or fp32) oracle.
        backward: ``t`` is a gradient: judged by the benchmark standard at msprobe's default level L0, whatever
            the forward's standard and level (see below).
        standards: ``{API fnmatch pattern: standard}`` overrides. thresholds: ``{standard: {name: value}}``.
        floor: the ULP standard's accumulation allowance (:func:`accumulation_floor`), when known.
        scale: the accumulative standard's magnitude of the summed terms (:func:`accumulation_scale`), when known:
            a forward output is judged in units of it.
        terms: the benchmark standard's error scale per element (:func:`msprobe_ci.kernels.forward_scale`,
            :func:`~msprobe_ci.kernels.backward_scale`), or a callable returning it (asked only when the standard
            is the benchmark and the target is not bit-identical to the bench): relative errors are measured
            against ``max(|oracle|, terms)``, so cancelling arithmetic is judged at the size of its terms.

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
    std_name = standard_for(short, t.dtype, standards)
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
    std = make_standard(std_name, t.dtype, level_api, **(thresholds or {}).get(std_name, {}))
    oracle = o if isinstance(o, torch.Tensor) and o.is_floating_point() else None
    if oracle is not None and t.is_floating_point():
        oracle = saturate(oracle, t.dtype)
    if std_name == "benchmark" and t.dtype == b.dtype and t.device == b.device and torch.equal(t, b):
        # the target is bit-identical to the same-dtype bench: its error against the oracle *is* the bench's
        # error, so every ratio of the standard is exactly 1 (<= every level's threshold); nothing is recomputed
        ratios = {k: 1.0 for k in ("max_rel_err", "mean_rel_err", "rmse", "small_value_err")}
        return CheckResult("benchmark", "pass", {f"{k}_ratio": 1.0 for k in ratios}, dict(std.ratios), ratios,
                           "bit-identical to the same-dtype bench: every ratio 1, not recomputed")
    lazy = terms if std_name == "benchmark" and callable(terms) else None
    if lazy is not None or not isinstance(terms, torch.Tensor) or std_name != "benchmark" or terms.shape != t.shape:
        terms = None
    unit = 1.0  # a gradient's own scale, which its error scale is divided by too
    if backward and oracle is not None and t.is_floating_point() and b.is_floating_point():
        # gradients have no natural scale (they scale with the loss): judge them relative to their own largest
        # magnitude, so the standards' small-value band is a fraction of the tensor's scale, not an absolute value
        scale = finite_peak(oracle)
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
        down = _own_scale(oracle, t.dtype)
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
        s64 = torch.where(s64 > 0, s64, torch.ones_like(s64))
        # never finer than the dtype can hold: a result rounded into fp16's subnormal range errs by up to half of
        # its smallest subnormal (3e-8) whatever the terms, which is within the bound in units of at least this
        bound = dtype_thresholds(checker_key(t.dtype))["accumulative_bound"]
        s64 = s64.clamp(min=torch.finfo(t.dtype).smallest_normal * torch.finfo(t.dtype).eps / bound)
        # elements equal to the correctly rounded oracle carry no accumulation error (the standard leaves them out
        # of its bias test by comparing with the oracle rounded to the target's dtype, which float64 units hide)
        exact = t.detach() == oracle.detach().to(t.dtype) if oracle is not None else None
        t, b = t.detach().to(torch.float64) / s64, b.detach().to(torch.float64) / s64
        oracle = oracle.detach().to(torch.float64) / s64 if oracle is not None else None
        if exact is not None:
            t = torch.where(exact, oracle, t)
    # NaN/Inf outputs (an overflowing fp16 optimizer step) are counted by the standards through their masks;
    # numpy's RuntimeWarnings on the masked-out inf - inf are noise in the user's test run
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if std_name == "binary":
            return std(t, b)
        if std_name == "ulp" and floor is not None:
            return std(t, b, oracle, floor=floor)
        if std_name == "benchmark":
            res = std(t, b, oracle, scale=terms)
            if lazy is not None and not (res.status == "pass" and res.metrics.get("bench_at_floor")):
                # the error scale is computed only where it can change the verdict: a plain pass against a bench
                # whose errors are all at their floor stays a pass with it (it only lowers the target's errors)
                s = lazy()
                if isinstance(s, torch.Tensor) and s.shape == t.shape:
                    res = std(t, b, oracle, scale=s / unit)
            return res
        return std(t, b, oracle)


def judge_rows(short: str, rows: list, *, backward: bool = False, standards: dict | None = None,
               thresholds: dict | None = None, inputs: tuple | None = None, budget=None,
               floor_dtype: Any = None) -> list:
    """Judge every output row of one API call: the one per-API step of isolation and replay alike.

    Each row goes through :func:`judge_pair`; a forward linear reduction with one output is judged in units of
    its terms (:func:`accumulation_scale`), and a row the ULP standard fails is judged once more with the fp32
    accumulation allowance (:func:`accumulation_floor`), computed only then.

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
    scale = None
    single = inputs is not None and len(rows) == 1
    if short in _LINEAR_REDUCTIONS and not backward and single:
        try:
            scale = accumulation_scale(short, *inputs)
        except Exception:  # noqa: BLE001 - msprobe's unit scale then
            scale = None
    out = []
    for i, (row, t, b, o) in enumerate(rows):
        res = judge_pair(short, t, b, o, backward, standards, thresholds, scale=scale,
                         terms=(lambda i=i: budget(i)) if budget is not None else None)
        if res.standard == "ulp" and res.status == "error" and single:
            dtype = floor_dtype or (o.dtype if isinstance(o, torch.Tensor) else torch.float64)
            try:  # cancelling sums: the fp32 accumulation allowance, computed only when it matters
                floor = accumulation_floor(short, *inputs, dtype=dtype)
            except Exception:  # noqa: BLE001 - no allowance then: the verdict stands
                floor = None
            if floor is not None:
                res = judge_pair(short, t, b, o, backward, standards, thresholds, floor=floor)
        out.append((row, res))
    return out


def _own_scale(oracle: torch.Tensor, dtype: torch.dtype) -> float:
    """The power of two at or under the largest finite ``|oracle|``, at least the dtype's smallest normal number
    over its ``small_value`` threshold (so the scaled small-value band never reaches into subnormals); 1.0 for a
    tensor of scale 1 or more, an empty one, or one of zeros."""
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


def saturate(oracle: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The oracle with its values beyond ``dtype``'s finite range made ±inf, as correct rounding to ``dtype``
    gives (IEEE round to nearest: ``|x| >= max + ulp(max)/2`` overflows). A target that returns inf there (an
    fp32 ``finfo.min`` mask plus a bf16 one in GPT-Neo's attention) computed the right value, not an overflow
    error. Returns ``oracle`` itself when nothing lies beyond the range (one ``amax`` pass); shape and dtype
    are kept."""
    if oracle.dtype == dtype or not dtype.is_floating_point:
        return oracle
    peak = abs_peak(oracle)
    if peak <= torch.finfo(dtype).max:  # a NaN peak goes on: other elements may still overflow
        return oracle
    rounded = oracle.detach().to(dtype)
    over = torch.isinf(rounded) & torch.isfinite(oracle)
    return torch.where(over, rounded.to(oracle.dtype), oracle) if bool(over.any()) else oracle


# matmul-family APIs: which tensor argument's last dimension is contracted
_CONTRACTED = {"matmul": 0, "__matmul__": 0, "mm": 0, "bmm": 0, "linear": 0, "mv": 0, "addmm": 1, "baddbmm": 1,
               "addbmm": 1, "addmv": 1, "_grouped_mm": 0, "grouped_mm": 0}


def accumulation_floor(short: str, func, args, kwargs, dtype=torch.float64, sigmas: float = 4.0):
    """The error a correct matmul-family kernel may add by accumulating a K-term sum in fp32, elementwise:
    ``sigmas * 2^-24 * sqrt(K) * ||terms||_2``, where ``||terms||_2 = sqrt(A^2 @ B^2)`` is computed with the same
    API on the squared inputs (squared scalars) in ``dtype`` on CPU; ``None`` for APIs whose contracted dimension
    is not known.

    Why: the ULP standard measures error at the magnitude of the result. Where a K-term sum cancels, the result is
    far smaller than its terms, and fp32 accumulation (standard for every half-precision matmul) leaves a
    rounding error that grows like a random walk over the partial sums, about ``u * sqrt(K) * ||terms||_2``
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1 and the probabilistic remark
    there); ``sigmas`` (default 4) standard deviations of it are allowed. A scale fault of 1% is orders of
    magnitude above it wherever the sum does not cancel.
    """
    pos = _CONTRACTED.get(short)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if pos is None or len(tensors) <= pos or tensors[pos].dim() == 0:
        return None
    k = int(tensors[pos].shape[-1])

    def square(v):
        if isinstance(v, torch.Tensor):
            x = v.detach().cpu()
            return x.to(dtype).square() if x.is_floating_point() else x
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v * v
        return v
    from ..kernels import REFERENCES

    fn = REFERENCES.get(func, func) if dtype == torch.float64 else func  # torch._grouped_mm: no float64 kernel
    with torch.no_grad():
        sq = fn(*[square(a) for a in args], **{key: square(v) for key, v in kwargs.items() if key != "out"})
    if not isinstance(sq, torch.Tensor):
        return None
    return sq.clamp_min(0).sqrt() * (sigmas * math.sqrt(k) * 2.0 ** -24)


_LINEAR_REDUCTIONS = frozenset({"sum", "mean", "nansum", "nanmean", "cumsum"})


def accumulation_scale(short: str, func, args, kwargs) -> torch.Tensor | None:
    """The magnitude of the terms a linear reduction adds up, per output element: the same call on ``|x|`` in
    float64 on CPU (``mean(|x|)`` for a mean), for ``sum``, ``mean``, ``nansum``, ``nanmean``, ``cumsum``; None for
    other APIs or when the first argument is not a floating tensor.

    The accumulative standard (msprobe 2.9) judges values up to 1 by absolute error, which assumes terms of about
    unit size; :func:`judge_pair` divides by this scale so that it holds at any magnitude."""
    if short not in _LINEAR_REDUCTIONS or not args or not isinstance(args[0], torch.Tensor) or \
            not args[0].is_floating_point():
        return None
    kw = {k: v for k, v in kwargs.items() if k not in ("out", "dtype")}
    with torch.no_grad():
        out = func(args[0].detach().cpu().to(torch.float64).abs(), *args[1:], **kw)
    return out if isinstance(out, torch.Tensor) else None


class ApiReplayer:
    """Replays and judges the API calls of one dump.

    Args:
        dump: a loaded dump (L1 or mix; module entries are ignored).
        live: re-run the target side on CPU in the dumped dtypes instead of reading recorded outputs (what a
            runner with the target device does; here it exercises statistics dumps).
        standards: user overrides ``{API fnmatch pattern: standard name}``.
        thresholds: user overrides ``{standard name: {threshold: value}}``.
        faults: :class:`~msprobe_ci.capture.inject.Fault` list applied to live target outputs (fuzzing, tests).
        target_device: where the live target runs (a torch device string, e.g. ``npu:0``); outputs come back to
            CPU for judging.
        bench_kernel: the same-dtype bench of the benchmark standard (:mod:`msprobe_ci.kernels`): ``device`` (the
            API on CPU in the dumped dtypes, default), ``upcast``, ``rounded``, ``decomposed``.
        budget_draws: perturbed runs that size a benchmark-standard row's error budget (0: none).

    Raises:
        MsprobeError: an unknown bench kernel.
    """

    def __init__(self, dump: Dump, *, live: bool = False, standards: dict[str, str] | None = None,
                 thresholds: dict[str, dict[str, float]] | None = None, faults: tuple = (),
                 target_device: str = "cpu", bench_kernel: str = "device", budget_draws: int | None = None):
        from .. import kernels

        self.bench_kernel = kernels.check_bench_kernel(bench_kernel)
        self.budget_draws = kernels.DRAWS if budget_draws is None else int(budget_draws)
        self.dump, self.live = dump, live
        self.faults = tuple(faults)
        self.target_device = target_device
        self.standards = standards or {}
        self.thresholds = thresholds or {}
        self.rebuild = Rebuilder(dump)

    def api_names(self) -> list[str]:
        """Every API forward and backward entry, in dump order (modules and parameter gradients left out), the
        ones :attr:`~msprobe_ci.dump.reader.Dump.rejected` included (each a skip naming why)."""
        return [n for n in self.dump.names or self.dump.data
                if (p := names.parse(n, any_prefix=True)) is not None and p.kind == "api"]

    # ---------------------------------------------------------------------------------------------------------
    def check(self, name: str) -> ApiResult:
        """Judge one entry; never raises for a bad entry: it becomes a skip (unjudgeable) with the reason."""
        try:
            if name in self.dump.rejected:
                return ApiResult(name, "skip", reason=f"not judged, its record breaks the dump format: "
                                                      f"{self.dump.rejected[name]}")
            prefix, api, n, direction = parse_name(name)
            if _short(prefix, api) in _NOT_COMPARABLE:
                return ApiResult(name, "skip", reason=f"{api}: uninitialised memory, not comparable")
            if _short(prefix, api) in _RANDOM:
                return ApiResult(name, "skip", reason=f"{api}: random output, not comparable element-wise")
            func = resolve(prefix, api)
            if direction == "forward":
                return self._forward(name, prefix, api, n, func)
            return self._backward(name, prefix, api, n, func)
        except MsprobeError as exc:
            return ApiResult(name, "skip", reason=str(exc))

    def arguments(self, fwd_name: str) -> tuple[list, dict]:
        """The rebuilt ``(args, kwargs)`` of a forward entry (an ``out=`` tensor is dropped).

        Raises:
            MsprobeError: no such forward entry, or a record that cannot be rebuilt.
        """
        entry = self.dump.data.get(fwd_name)
        if fwd_name in self.dump.rejected:
            raise MsprobeError(f"not judged, its forward record breaks the dump format: {self.dump.rejected[fwd_name]}")
        if not isinstance(entry, dict):
            raise MsprobeError(f"{fwd_name}: no forward entry in the dump")
        gen = api_generator(fwd_name)
        args = [self.rebuild.value(v, gen, f"{fwd_name}.input.{i}")
                for i, v in enumerate(entry.get("input_args") or [])]
        kwargs = {k: self.rebuild.value(v, gen, f"{fwd_name}.input.{k}")
                  for k, v in (entry.get("input_kwargs") or {}).items()}
        kwargs.pop("out", None)
        return args, kwargs

    def _run(self, func, args, kwargs, cast):
        a, k = _cast(args, cast), _cast(kwargs, cast)
        return func(*a, **k)

    def _oracle(self, func, args, kwargs):
        """``(output, "fp64"|"fp32", composite)``: ``composite`` whether the fp64 run's kernels read an intermediate
        (:class:`msprobe_ci.kernels.Materialized`; a ``rounded`` bench is then not this run rounded once)."""
        from ..kernels import REFERENCES, Materialized

        probe = Materialized()
        try:  # an API without a float64 kernel (torch._grouped_mm) as its float64 reference decomposition
            with probe:
                out = self._run(REFERENCES.get(func, func), args, kwargs, _upcast(torch.float64))
            return out, "fp64", probe.read
        except (RuntimeError, TypeError, NotImplementedError):
            return self._run(func, args, kwargs, _upcast(torch.float32)), "fp32", True

    def _forward(self, name, prefix, api, n, func) -> ApiResult:
        entry = self.dump.data[name]
        args, kwargs = self.arguments(name)
        short = _short(prefix, api)
        records = _records(entry.get("output") or [], f"{name}.output")
        if "dropout" in short:
            return self._dropout(name, args, kwargs, records, func)
        from .. import amp

        # a call made under autocast (recorded in our dumps, inferred from dtypes as msprobe does for others):
        # replayed on its inputs as its kernel saw them, cast to the dtype it computed in
        dtype, how = amp.of_entry(entry)
        if dtype is not None:
            args, kwargs = amp.cast_inputs(args, kwargs, dtype)
        result = self.check_inputs(name, args, kwargs, None if self.live else self._recorded(name, records))
        if dtype is not None:
            result.autocast = f"{str(dtype).replace('torch.', '')} ({how})"
        return result

    def check_inputs(self, name: str, args: list, kwargs: dict, targets: list | None = None) -> ApiResult:
        """Judge forward entry ``name`` on the given inputs; ``targets`` ``None`` runs the target live (CPU, in the
        inputs' dtypes, with this replayer's ``faults`` applied to its output), as fuzzing does."""
        prefix, api, n, _ = parse_name(name)
        func = resolve(prefix, api)
        short = _short(prefix, api)
        try:
            oracle, how, composite = self._oracle(func, args, kwargs)
            bench = oracle if self.bench_kernel == "rounded" and how == "fp64" and not composite else \
                self._bench(func, args, kwargs, oracle)
        except Exception as exc:  # noqa: BLE001 - an API that fails on CPU is unjudgeable, not a crash
            raise MsprobeError(f"{name}: replay failed on CPU: {type(exc).__name__}: {exc}") from None
        if targets is None:
            dev = self.target_device
            target = _cast(self._run(func, args, kwargs, lambda t: t.detach().clone().to(dev)),
                           lambda t: t.detach().cpu())
            for f in self.faults:
                if f.matches(f"{prefix}.{api}", n, "forward"):
                    target = f.apply(target, n)
            targets = _outputs(target, f"{name}.output")
        short = judged_as(short, args, kwargs, self.standards)
        return self._judge(name, short, targets, _outputs(bench, f"{name}.output"),
                           _outputs(oracle, f"{name}.output"), inputs=(func, args, kwargs),
                           budget=self._forward_budget(func, args, kwargs, name))

    def _bench(self, func, args, kwargs, oracle):
        """The same-dtype bench of a forward replay, by :attr:`bench_kernel` (outputs of ``upcast``/``rounded``
        are rounded to the target's dtypes where they are judged)."""
        from .. import kernels

        if self.bench_kernel == "device":
            return self._run(func, args, kwargs, _fresh)
        if self.bench_kernel == "decomposed":
            with kernels.decomposed():
                return self._run(func, args, kwargs, _fresh)
        # upcast/rounded: the call's kernels one precision up (float64), each result rounded once to the target
        # dtype where another kernel of the call reads it (kernels.Materialized)
        ts = kernels.tensors_of(args) + kernels.tensors_of(kwargs)
        up = torch.float64 if self.bench_kernel == "rounded" else kernels.upcast_dtype(ts)
        try:
            with kernels.Materialized(kernels.target_dtype(ts)):
                return self._run(kernels.REFERENCES.get(func, func) if up == torch.float64 else func, args, kwargs,
                                 _upcast(up))
        except (RuntimeError, TypeError, NotImplementedError):
            if self.bench_kernel == "rounded":
                return oracle  # no float64 kernel: the oracle's own precision
            raise

    def _forward_budget(self, func, args, kwargs, name):
        """``budget(i)``: the error scale of output row ``i`` (:func:`msprobe_ci.kernels.forward_scale`), computed
        on first use."""
        from .. import kernels

        cache: list = []

        def budget(i):
            if not self.budget_draws:
                return None
            if not cache:
                try:
                    cache.extend(kernels.forward_scale(func, tuple(args), dict(kwargs),
                                                       lambda v: [x for _, x in _outputs(v, "o")], self.budget_draws))
                except Exception:  # noqa: BLE001 - no budget: relative to |oracle| alone
                    cache.append(None)
            return cache[i] if i < len(cache) else None
        return budget

    def _recorded(self, name: str, records: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        if self.dump.task != "tensor":
            raise MsprobeError(f"{name}: statistics dump: its target outputs belong to other inputs than the "
                               "regenerated ones; dump with task 'tensor' (or check live on the target device)")
        gen = api_generator(name)
        return [(row, self.rebuild.value(rec, gen, row)) for row, rec in records]

    def _judge(self, name, short, targets, benches, oracles, inputs=None, budget=None) -> ApiResult:
        backward = name.endswith(".backward")
        if len(targets) != len(benches):
            return ApiResult(name, "error", [(name, CheckResult("structure", "error", message=(
                f"{len(targets)} target outputs vs {len(benches)} bench outputs")))])
        from ..kernels import round_to

        rows = []
        info = {}
        for (row, t), (_, b), (_, o) in zip(targets, benches, oracles):
            if self.bench_kernel in ("upcast", "rounded"):
                b = round_to(b, t)
            rows.append((row, t, b, o))
            if isinstance(t, torch.Tensor):
                info[row] = (str(getattr(o, "dtype", " ")), str(t.dtype), str(tuple(t.shape)))
        results = judge_rows(short, rows, backward=backward, standards=self.standards, thresholds=self.thresholds,
                             inputs=inputs, budget=budget, floor_dtype=torch.float64)
        return ApiResult(name, worst([r for _, r in results]), results, info=info)

    def _pair(self, short: str, t: Any, b: Any, o: Any, backward: bool = False) -> CheckResult:
        return judge_pair(short, t, b, o, backward, self.standards, self.thresholds)

    def _dropout(self, name, args, kwargs, records, func) -> ApiResult:
        p = kwargs.get("p", args[1] if len(args) > 1 and isinstance(args[1], float) else 0.5)
        training = kwargs.get("training", args[2] if len(args) > 2 and isinstance(args[2], bool) else True)
        targets = (_outputs(self._run(func, args, kwargs, _fresh), f"{name}.output") if self.live
                   else self._recorded(name, records))
        if not training or p == 0:
            bench = self._run(func, args, kwargs, _fresh)
            return self._judge(name, "identity", targets, _outputs(bench, f"{name}.output"),
                               _outputs(bench, f"{name}.output"))
        results = [(row, make_standard("dropout", getattr(t, "dtype", "fp32"), p=float(p))(t)) for row, t in targets]
        return ApiResult(name, worst([r for _, r in results]), results)

    def _backward(self, name, prefix, api, n, func) -> ApiResult:
        entry = self.dump.data[name]
        fwd = f"{prefix}.{api}.{n}.forward"
        args, kwargs = self.arguments(fwd)
        grads_in = entry.get("input") or []
        if not grads_in:
            raise MsprobeError(f"{name}: no upstream gradient in the dump")
        gen = api_generator(name)
        upstream = self.rebuild.value(grads_in[0], gen, f"{name}.input.0")
        records = _records(entry.get("output") or [], f"{name}.output")

        fwd_entry = self.dump.data[fwd]
        mindspore = getattr(self.dump, "framework", "pytorch") == "mindspore"
        from .. import amp

        # made under autocast: the forward replayed on its inputs as its kernel saw them (msprobe_ci.amp.of_entry)
        amp_dtype, amp_how = amp.of_entry(fwd_entry)
        if amp_dtype is not None:
            args, kwargs = amp.cast_inputs(args, kwargs, amp_dtype)

        def want(r: Any) -> bool:  # MindSpore records have no requires_grad: every floating input may need one
            return isinstance(r, dict) and (bool(r.get("requires_grad")) or mindspore and "dtype" in r)

        wants = [want(r) for r in fwd_entry.get("input_args") or []]
        wants_kw = {k: want(r) for k, r in (fwd_entry.get("input_kwargs") or {}).items()}

        def grads(cast, held=None):
            """The gradients the API's autograd node hands to its inputs (``grad_inputs``, the order the dump
            records them in), for the dumped upstream gradient. ``held``: the dtype an ``upcast``/``rounded``
            bench holds the call's intermediates in (:class:`msprobe_ci.kernels.Materialized`), forward and
            backward each."""
            import contextlib

            def mode():
                return contextlib.nullcontext() if held is None else kernels.Materialized(held)
            a = _cast(args, cast)
            k = _cast(kwargs, cast)
            for x, want in list(zip(a, wants)) + [(k.get(key), w) for key, w in wants_kw.items()]:
                if want and isinstance(x, torch.Tensor) and x.is_floating_point():
                    x.requires_grad_(True)  # as in the dumped call: the node's grad_inputs then line up
            with torch.enable_grad():
                with mode():
                    out = func(*a, **k)
                out0 = out[0] if isinstance(out, (tuple, list)) else out
                if not isinstance(out0, torch.Tensor) or out0.grad_fn is None:
                    raise MsprobeError(f"{name}: the forward output does not depend on an input that needs grad")
                captured: list = []
                handle = out0.grad_fn.register_hook(lambda grad_inputs, grad_outputs: captured.append(grad_inputs))
                g = cast(upstream) if isinstance(upstream, torch.Tensor) else upstream
                with mode():
                    out0.backward(g.to(out0.dtype))
                handle.remove()
            return list(captured[0]) if captured else []

        from .. import kernels

        try:
            try:
                oracle = grads(_upcast(torch.float64))
            except (RuntimeError, TypeError, NotImplementedError):
                oracle = grads(_upcast(torch.float32))
            if self.bench_kernel == "device":
                bench = grads(_fresh)
            elif self.bench_kernel == "decomposed":
                with kernels.decomposed():
                    bench = grads(_fresh)
            else:  # upcast/rounded: the call's kernels one precision up (float64), each rounded once
                held = kernels.target_dtype(kernels.tensors_of(args) + kernels.tensors_of(kwargs))
                up = torch.float64 if self.bench_kernel == "rounded" else \
                    kernels.upcast_dtype(kernels.tensors_of(args) + kernels.tensors_of(kwargs))
                try:
                    bench = grads(_upcast(up), held)
                except (RuntimeError, TypeError, NotImplementedError):
                    bench = oracle
        except MsprobeError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise MsprobeError(f"{name}: backward replay failed on CPU: {type(exc).__name__}: {exc}") from None
        if self.live:
            targets = [(f"{name}.output.{i}", g) for i, g in enumerate(grads(_fresh))]
        else:
            if self.dump.task != "tensor":
                raise MsprobeError(f"{name}: statistics dump: target gradients belong to other inputs; dump with "
                                   "task 'tensor'")
            targets = [(row, self.rebuild.value(rec, gen, row)) for row, rec in records]
        if mindspore:  # MindSpore lists only the gradients that exist (a Primitive's last input first)
            last_first = prefix == "Primitive"
            bench = _mindspore_order(targets, bench, last_first)
            oracle = _mindspore_order(targets, oracle, last_first)
        if len(targets) != len(bench):
            return ApiResult(name, "error", [(name, CheckResult("structure", "error", message=(
                f"{len(targets)} target gradients vs {len(bench)} bench gradients")))])
        keep = [i for i, (_, t) in enumerate(targets) if t is not None]  # inputs that needed no grad
        if amp_dtype is not None:
            # a gradient is as precise as the narrower of the kernel's dtype and the user's tensor's (autocast's
            # cast hands it back rounded): the target judged there, the references rounded as the cast rounds
            for i in keep:
                row, t = targets[i]
                if isinstance(t, torch.Tensor) and t.is_floating_point() and \
                        amp.grad_dtype(t.dtype, amp_dtype) != t.dtype:
                    t = t.to(amp_dtype)
                    targets[i] = (row, t)
                if i < len(bench):
                    bench[i] = kernels.round_to(bench[i], t)
        scales: list = []

        def budget(j: int):
            """The error scale of the j-th kept gradient (:func:`msprobe_ci.kernels.backward_scale`): the leaves
            (inputs that need grad, in order) are matched to the kept gradients in order, by shape."""
            if not self.budget_draws or mindspore:
                return None
            if not scales:
                try:
                    def mark(x, w):
                        return x.detach().clone().requires_grad_(True) if w and isinstance(x, torch.Tensor) and \
                            x.is_floating_point() else x
                    a = [mark(x, w) for x, w in zip(args, wants + [False] * len(args))]
                    k = {key: mark(v, wants_kw.get(key, False)) for key, v in kwargs.items()}
                    leaf = iter(kernels.backward_scale(func, tuple(a), k, {0: upstream}, self.budget_draws))
                    nxt = next(leaf, None)
                    for i in keep:
                        t = targets[i][1]
                        if isinstance(nxt, torch.Tensor) and isinstance(t, torch.Tensor) and nxt.shape == t.shape:
                            scales.append(nxt)
                            nxt = next(leaf, None)
                        else:
                            scales.append(None)
                except Exception:  # noqa: BLE001 - no budget: relative to |oracle| alone
                    scales.append(None)
            return scales[j] if j < len(scales) else None
        result = self._judge(name, _short(prefix, api), [targets[i] for i in keep],
                             [(targets[i][0], bench[i]) for i in keep], [(targets[i][0], oracle[i]) for i in keep],
                             budget=budget)
        if amp_dtype is not None:
            result.autocast = f"{str(amp_dtype).replace('torch.', '')} ({amp_how})"
        return result
