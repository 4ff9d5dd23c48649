"""What a correct kernel may add beyond one rounding, computed from the call's own inputs: the fp32 accumulation
allowance of matmul-family APIs (:func:`accumulation_floor`) and the magnitude of the terms a linear reduction adds
up (:func:`accumulation_scale`) and how many it adds (:func:`accumulation_count`); a correct kernel's own result in
the target's dtype, the accumulative standard's null for its bias test (:func:`same_dtype_result`)."""

from __future__ import annotations

import math
from typing import Any

import torch


# matmul-family APIs: which tensor argument's last dimension is contracted
_CONTRACTED = {"matmul": 0, "__matmul__": 0, "mm": 0, "bmm": 0, "linear": 0, "mv": 0, "addmm": 1, "baddbmm": 1,
               "addbmm": 1, "addmv": 1, "_grouped_mm": 0, "grouped_mm": 0}


#: matmul-family APIs that add a bias (or an input) to their product: where it is. ``linear``'s third argument; the
#: ``add*`` family's ``input`` (its first), scaled by ``beta``
_BIASED = {"linear": 2, "addmm": 0, "baddbmm": 0, "addbmm": 0, "addmv": 0}


def accumulation_floor(short: str, func, args, kwargs, dtype=torch.float64, sigmas: float = 4.0,
                       target: torch.dtype | None = None):
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

    With ``target`` a half-precision dtype and a bias (:data:`_BIASED`), also a rounding of the product to it:
    ``u(target) * |product|``. A kernel may round its product before adding the bias: PyTorch's CPU bf16
    ``linear`` does for a non-contiguous input (RecurrentGemma's ``linear_out`` on a transposed activation under
    autocast: 100% of its outputs equal that two-rounding model; where a trained bias of 0.001 cancelled the
    product, 2.6% of them were more than 1 ULP off the correctly rounded result, up to 147).
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
    floor = sq.clamp_min(0).sqrt() * (sigmas * math.sqrt(k) * 2.0 ** -24)
    at = _BIASED.get(short)
    if target in (torch.bfloat16, torch.float16) and at is not None and len(args) > at and \
            isinstance(args[at], torch.Tensor):
        def wide(v):
            return v.detach().cpu().to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        with torch.no_grad():
            if short == "linear":
                product = fn(wide(args[0]), wide(args[1]))
            else:
                product = fn(*[wide(a) for a in args], **{key: wide(v) for key, v in kwargs.items() if key != "out"},
                             **({} if "beta" in kwargs else {"beta": 0}))
                if "beta" in kwargs:  # the caller's beta: the product alone is alpha * (m1 @ m2)
                    product = product - kwargs["beta"] * wide(args[at])
        if isinstance(product, torch.Tensor) and product.shape == floor.shape:
            floor = floor + product.abs() * (torch.finfo(target).eps / 2)
    return floor


_LINEAR_REDUCTIONS = frozenset({"sum", "mean", "nansum", "nanmean", "cumsum"})
#: reductions that multiply their terms: their error is relative to the result, one rounding per partial product
#: where a kernel holds the running product in the tensor's dtype. PyTorch's CPU bf16/fp16 ``prod`` does (measured on
#: torch 2.13: each partial product rounded to the dtype gives its bits for every element; fp32 math rounded once
#: for 45-55%), up to ``(factors - 1)`` roundings; GPU kernels multiply in fp32 and round once
_PRODUCTS = frozenset({"prod"})


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


def accumulation_count(short: str, func, args, kwargs, scale: Any) -> float | None:
    """The most terms one output element of a linear reduction adds up: the input's elements per output element
    (``sum``, ``mean``, ``nansum``, ``nanmean``), the length of the scanned dimension (``cumsum``); None where
    :func:`accumulation_scale` gave none (``scale``, the terms' magnitude per output element)."""
    if scale is None or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if short == "cumsum":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return float(x.shape[dim]) if isinstance(dim, int) and x.dim() else float(max(x.numel(), 1))
    return float(max(x.numel(), 1)) / float(max(scale.numel(), 1))


def same_dtype_result(func, args, kwargs, like: torch.Tensor) -> torch.Tensor | None:
    """The call's result from PyTorch's CPU kernel on the call's own inputs in their own dtypes: a correct
    accumulation in the target's arithmetic, whose error balance against the oracle is the accumulative standard's
    null (:class:`~msprobe_ci.checkers.AccumulativeStandard`'s ``bench``). None where the result is not one
    floating tensor of ``like``'s shape and dtype, or the call fails on the CPU.

    Why: the standard's sign test assumes a correct rounding is as likely up as down. Terms with few significant
    bits (bf16 values upcast to fp32, or their squares: RMSNorm's fp32 ``pow(2).mean(-1)`` in a bf16 model) tie
    often, and round-half-even then biases any fp32 running sum one way (measured: docs/verdicts.md)."""
    def cpu(v):
        return v.detach().cpu() if isinstance(v, torch.Tensor) else v
    try:
        with torch.no_grad():
            out = func(*[cpu(a) for a in args], **{k: cpu(v) for k, v in kwargs.items() if k != "out"})
    except Exception:  # noqa: BLE001 - no null then: msprobe's own test stands
        return None
    if not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != like.dtype:
        return None
    return out
