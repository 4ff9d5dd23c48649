"""Which precision and which kernel: the oracle's and the bench's dtypes, the bench-kernel choice, float64
references of APIs that have no float64 kernel, and the argument helpers every side uses."""

from __future__ import annotations

from typing import Any

import torch

from ..config import BENCH_KERNELS  # the vocabulary lives where the torch-free option parsers read it


_HALF = (torch.float16, torch.bfloat16)

#: the FP8 formats this torch has (a cast into one is judged by the quantization standard)
FP8_DTYPES = frozenset(d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                                     "float8_e5m2fnuz")) if d is not None)


def check_bench_kernel(name: str) -> str:
    """``name`` if it is a bench kernel; raises :class:`~msprobe_ci.errors.MsprobeError` naming the choices."""
    from ..errors import MsprobeError

    if name not in BENCH_KERNELS:
        raise MsprobeError(f"bench kernel {name!r}: expected one of {', '.join(BENCH_KERNELS)}")
    return name


def default_bench_kernel(bench_device: str, target_device: str, target_kind: str | None = None) -> str:
    """The bench kernel used when none is asked for: ``device`` (the bench device's kernels), except when the
    target is declared as an accelerator kind but runs on the bench device itself (the stand-in ``npu`` of the
    tests, whose tensors live on the CPU): there the bench device's kernels are the target's own, so ``upcast`` is
    used and the run takes the path a real accelerator target takes.

    Args:
        bench_device, target_device: torch device strings (``cpu``, ``cuda:0``).
        target_kind: the device kind the user named for the target (``npu``, ``cuda``, ``cpu``), when it differs
            from the torch device type.
    """
    same = bench_device.split(":")[0] == target_device.split(":")[0]
    declared = (target_kind or target_device).split(":")[0]
    if same and declared != target_device.split(":")[0]:
        return "upcast"
    return "device"


def oracle_dtype(tensors: list) -> torch.dtype:
    """msprobe's ``PRECISION_MAPPING``: fp16/bf16-only inputs → fp32 (2^16 times finer than bf16, 2^13 than fp16),
    anything with fp32/fp64 → fp64."""
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    if floats and all(d in _HALF for d in floats):
        return torch.float32
    return torch.float64


def upcast_dtype(tensors: list) -> torch.dtype:
    """One precision up from the widest floating input: bf16/fp16 → fp32, fp32/fp64 → fp64."""
    return oracle_dtype(tensors)


_NESTS = (list, tuple, dict)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in an argument or output (lists, tuples, dicts), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return []
    out: list = []
    for v in value:  # a call's arguments are mostly flat: no call per leaf (isolation walks them ~16 times a call)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, _NESTS):
            out.extend(tensors_of(v))
    return out


def cast(value: Any, fn) -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)`` (lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        out = [fn(v) if isinstance(v, torch.Tensor) else cast(v, fn) if isinstance(v, _NESTS) else v for v in value]
        return out if isinstance(value, list) else tuple(out)
    if isinstance(value, dict):
        return {k: cast(v, fn) for k, v in value.items()}
    return value


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(e) for e in offs.tolist()]
    return list(zip([0, *ends[:-1]], ends))


def grouped_mm_reference(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch._grouped_mm`` (``F.grouped_mm``) as one ``matmul`` per group, in the inputs' dtype: the reference
    decomposition the oracle runs in float64, where the op itself has no float64 kernel. Differentiable (slices,
    matmuls, ``cat``), so its vector-Jacobian product is the oracle's gradient.

    Layouts (``offs``: int32 end offsets of the ``G`` groups along the jagged dimension):

    * ``(M, K) x (G, K, N)``: rows ``offs[g-1]:offs[g]`` of ``mat_a`` times ``mat_b[g]`` → ``(M, N)``; rows past
      ``offs[-1]``, which the kernel leaves unwritten, are 0;
    * ``(M, K) x (K, N)``: ``K`` jagged → ``(G, M, N)``, group ``g`` = ``mat_a[:, k0:k1] @ mat_b[k0:k1]``;
    * ``(G, M, K) x (K, N)``: ``N`` jagged → ``(M, N)``, columns ``n0:n1`` = ``mat_a[g] @ mat_b[:, n0:n1]``;
    * ``(G, M, K) x (G, K, N)``, no ``offs``: a batched matmul.

    ``bias`` (``(G, N)``) is added per group; ``out_dtype`` casts the result.

    Raises:
        ValueError: a layout other than these four.
    """
    da, db = mat_a.dim(), mat_b.dim()
    if offs is None and da == 3 and db == 3:
        out = torch.matmul(mat_a, mat_b)
        if bias is not None:
            out = out + bias.unsqueeze(1)
    elif offs is not None and da == 2 and db == 3:
        parts = [torch.matmul(mat_a[s:e], mat_b[g]) + (bias[g] if bias is not None else 0)
                 for g, (s, e) in enumerate(_group_bounds(offs))]
        rest = mat_a.shape[0] - (int(offs[-1]) if offs.numel() else 0)
        if rest > 0:
            parts.append(mat_a.new_zeros((rest, mat_b.shape[-1])))
        out = torch.cat(parts) if parts else mat_a.new_zeros((mat_a.shape[0], mat_b.shape[-1]))
    elif offs is not None and da == 2 and db == 2:
        out = torch.stack([torch.matmul(mat_a[:, s:e], mat_b[s:e]) + (bias[g] if bias is not None else 0)
                           for g, (s, e) in enumerate(_group_bounds(offs))])
    elif offs is not None and da == 3 and db == 2:
        out = torch.cat([torch.matmul(mat_a[g], mat_b[:, s:e]) + (bias[g, s:e] if bias is not None else 0)
                         for g, (s, e) in enumerate(_group_bounds(offs))], dim=-1)
    else:
        raise ValueError(f"grouped_mm: layout {tuple(mat_a.shape)} x {tuple(mat_b.shape)} with "
                         f"offs={'given' if offs is not None else 'None'} is not one of the four grouped layouts")
    return out.to(out_dtype) if out_dtype is not None else out


def scaled_mm_reference(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        bias: torch.Tensor | None = None, scale_result: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` (an FP8 GEMM: ``mat_a`` ``(M, K)`` and ``mat_b`` ``(K, N)`` in float8, their scales
    float32) as its definition, ``(mat_a * scale_a) @ (mat_b * scale_b) + bias``, in the inputs' dtype: the
    reference the oracle runs in float64, where the op only takes float8 operands. ``scale_a``/``scale_b``: one
    scale per tensor (a 0-d or 1-element tensor) or per row of ``mat_a`` (``(M, 1)``) and per column of ``mat_b``
    (``(1, N)``), which broadcast as written. ``out_dtype`` is the target's rounding, applied where the result is
    judged, not here; ``use_fast_accum`` is the kernel's accumulation, which the oracle does not imitate.

    Raises:
        ValueError: ``scale_result`` (an FP8 output's scale), or scales of any other shape.
    """
    if scale_result is not None:
        raise ValueError("_scaled_mm with scale_result (an fp8 output) has no float64 reference here")
    m, n = mat_a.shape[0], mat_b.shape[1]
    for s, ok in ((scale_a, (m, 1)), (scale_b, (1, n))):
        if s.numel() != 1 and tuple(s.shape) != ok:
            raise ValueError(f"_scaled_mm: scale of shape {tuple(s.shape)}; expected one element or {ok}")
    out = torch.matmul(mat_a * scale_a, mat_b * scale_b)  # a 0-d, (1,), (M, 1) or (1, N) scale broadcasts
    return out + bias if bias is not None else out


def unwritten(func, args: tuple, kwargs: dict) -> dict:
    """Where a grouped GEMM leaves its result unwritten: ``{("output", i) or ("input", k): (dim, end)}``, the
    elements at ``end`` and past it along ``dim`` (of output ``i``, or of the gradient w.r.t. positional input
    ``k``) are uninitialised memory when the groups (``offs[-1]``) stop short of the jagged dimension (a padded
    token buffer), so no judge may read them (msprobe zeroes the rows past a grouped matmul's valid length, for the
    same reason). Empty for every other API and where the groups cover the whole dimension."""
    if REFERENCES.get(func) is not grouped_mm_reference or len(args) < 2:
        return {}
    a, b, offs = args[0], args[1], kwargs.get("offs")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(offs, torch.Tensor)) or \
            not offs.numel():
        return {}
    end = int(offs[-1])
    if a.dim() == 2 and b.dim() == 3 and end < a.shape[0]:  # rows of mat_a jagged
        return {("output", 0): (0, end), ("input", 0): (0, end)}
    if a.dim() == 3 and b.dim() == 2 and end < b.shape[1]:  # columns of mat_b jagged
        return {("output", 0): (1, end), ("input", 1): (1, end)}
    if a.dim() == 2 and b.dim() == 2 and end < a.shape[1]:  # the contracted dimension jagged
        return {("input", 0): (1, end), ("input", 1): (0, end)}
    return {}


def zero_past(t: Any, region: tuple | None) -> Any:
    """A copy of tensor ``t`` with the elements past ``region`` (``(dim, end)``, :func:`unwritten`) set to 0;
    ``t`` itself where there is no region or no tensor."""
    if region is None or not isinstance(t, torch.Tensor) or t.dim() <= region[0]:
        return t
    dim, end = region
    out = t.detach().clone()
    if end < out.shape[dim]:
        out.narrow(dim, end, out.shape[dim] - end).zero_()
    return out


def _references() -> dict:
    refs = {}
    for owner, name in ((torch, "_grouped_mm"), (torch.nn.functional, "grouped_mm")):
        fn = getattr(owner, name, None)
        if fn is not None:
            refs[fn] = grouped_mm_reference
    if hasattr(torch, "_scaled_mm"):
        refs[torch._scaled_mm] = scaled_mm_reference
    return refs


# APIs with no float64 kernel whose float64 oracle is a reference decomposition (said in the record)
REFERENCES: dict = _references()


class Float64References(torch.overrides.TorchFunctionMode):
    """Runs each call that has no float64 kernel as its float64 reference decomposition (:data:`REFERENCES`)
    wherever one of its arguments is float64: the float64 runs of a module isolated whole (its oracle, its budget's
    draws) meet ``torch._grouped_mm`` inside transformers' MoE experts, where it raised and left the Mixtral MoE
    block without a budget (a bf16 target's benign block failed at max relative error ratio 527, judged
    relative to its values alone) or, for an fp32 or autocast target, not isolated at all."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ref = REFERENCES.get(func)
        if ref is not None and in_float64(func, args, kwargs):
            return ref(*args, **kwargs)
        return func(*args, **kwargs)


def reference_note(func) -> str | None:
    """How the float64 oracle computes ``func`` when it is a reference decomposition, else None."""
    if func in REFERENCES:
        return f"{_qualified(func)} has no float64 kernel: its float64 oracle is one matmul per group"
    return None


def _qualified(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or "torch"  # torch's C functions (torch._grouped_mm) have none
    return f"{module}.{name}"


def in_float64(func, args: tuple, kwargs: dict) -> bool:
    """Whether the call has a float64 tensor among its arguments."""
    return any(t.dtype == torch.float64 for t in tensors_of(args) + tensors_of(kwargs))


def call_best_precision(func, args: tuple, kwargs: dict) -> tuple[Any, torch.dtype | None]:
    """``func(*args, **kwargs)``, in float32 where float64 has no kernel (:func:`float32_fallback`).

    Returns:
        ``(output, dtype)``: ``dtype`` is ``torch.float32`` where the call fell back, ``torch.float64`` where it
        ran as its float64 reference decomposition (:data:`REFERENCES`), else ``None``.
    """
    try:
        return func(*args, **kwargs), None
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        out = float32_fallback(func, args, kwargs, exc)
        return out, (torch.float64 if func in REFERENCES else torch.float32)


def float32_fallback(func, args: tuple, kwargs: dict, error: BaseException) -> Any:
    """The call that raised ``error`` once more: as its float64 reference decomposition where it has one
    (:data:`REFERENCES`), else with every float64 tensor cast to float32 and the floating outputs
    cast back to float64: the best precision the API supports, for a bench one precision up from an fp32 target
    or an fp64 oracle (``torch._grouped_mm``, which transformers' MoE experts call, has no float64 kernel). The
    casts are differentiable, so the backward runs in float32 too.

    Raises:
        error: itself, where no argument is float64 (nothing to fall back from).
        MsprobeError: float32 fails too: one line naming the API and both errors, and what to do.
    """
    from ..errors import MsprobeError

    if not in_float64(func, args, kwargs):
        raise error
    if func in REFERENCES:
        return REFERENCES[func](*args, **kwargs)

    def down(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32) if t.dtype == torch.float64 else t
    try:
        out = func(*cast(args, down), **cast(kwargs, down))
    except Exception as exc:  # noqa: BLE001 - reported with the first error, in one line
        name = getattr(func, "__name__", repr(func))
        raise MsprobeError(f"{name} runs neither in float64 ({str(error).splitlines()[0]}) nor in float32 "
                           f"({str(exc).splitlines()[0]}): run the bench in the target's dtype "
                           f"(--msprobe-bench-dtype) or leave this API out of the capture") from None
    return cast(out, lambda t: t.to(torch.float64) if t.is_floating_point() else t)


def needs_grad(t: torch.Tensor) -> bool:
    """A tensor whose gradient autograd computes (floating or complex, ``requires_grad``)."""
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


#: the unit roundoff of each floating dtype a budget knows (float8: none, its GEMM rounds to its output's dtype)
_UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}

#: the RMS of one round-to-nearest error in units of the unit roundoff ``u``: the error is uniform over
#: ``[-u, u] / m`` for a value of mantissa ``m`` in ``[1, 2)``, so its RMS is ``u / (m sqrt(3))``, at most
#: ``u / sqrt(3)`` (0.42 u averaged over log-uniform mantissas; PyTorch's CPU flash attention in bf16 measured 0.43-0.53
#: u of the random walk of its held probabilities). Each jitter draws an error of this RMS (:func:`jitter`).
ROUNDING_RMS = 3.0 ** -0.5


def grad_fn_of(t: torch.Tensor):
    """``t.grad_fn``, or ``None`` where PyTorch refuses to say: a view made under ``no_grad`` and then written in
    place (``nn.Embedding(..., padding_idx=0)`` zeroes its padding row so when it is built) raises on the access,
    and a capture hook must never raise in the user's code."""
    try:
        return t.grad_fn
    except RuntimeError:
        return None


def first_grad_fn(value: Any):
    """The autograd node of the first tensor in ``value`` that requires grad (lists, tuples, dicts), or ``None``."""
    if isinstance(value, torch.Tensor):
        return grad_fn_of(value) if value.requires_grad else None
    if isinstance(value, (list, tuple)):
        for v in value:
            node = first_grad_fn(v)
            if node is not None:
                return node
    if isinstance(value, dict):
        for v in value.values():
            node = first_grad_fn(v)
            if node is not None:
                return node
    return None


def is_input_node(node, args, kwargs) -> bool:
    """Whether ``node`` is the autograd node of one of the call's inputs (an identity or alias output)."""
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and grad_fn_of(v) is node:
            return True
        if isinstance(v, (list, tuple)):
            if any(isinstance(x, torch.Tensor) and grad_fn_of(x) is node for x in v):
                return True
    return False
