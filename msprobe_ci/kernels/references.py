"""Running a call's references: its inputs copied to a dtype and device, the call run there, the
vector-Jacobian products of its gradients."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .choice import FP8_DTYPES, REFERENCES, cast, needs_grad, tensors_of
from .attention import _SDPA, FusedAttention
from .perturb import Perturb



# ---------------------------------------------------------------------------------------------------- references
def scaled_fp8_values(t: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
    """The values a scaled FP8 tensor subclass stands for, as a plain tensor in ``dtype`` (exact in float64: an
    FP8 value divided by a float32 scale), or ``None`` for any other tensor.

    Known: torchao's ``Float8TrainingTensor`` (what ``torchao.float8.convert_to_float8_training`` linears hand to
    ``torch.mm``): its ``_data`` (float8) times ``1 / _scale`` (its documented convention: multiply by the scale to
    go to the float8 range, divide to come back; "Float8-aware user code can use the private fields")."""
    if type(t).__name__ != "Float8TrainingTensor" or not type(t).__module__.startswith("torchao."):
        return None
    data, scale = getattr(t, "_data", None), getattr(t, "_scale", None)
    if not isinstance(data, torch.Tensor) or not isinstance(scale, torch.Tensor) or data.dtype not in FP8_DTYPES:
        return None
    return data.detach().to(dtype) / scale.detach().to(dtype)


def _clone_wrapper(t: torch.Tensor, device: str) -> torch.Tensor:
    """A detached copy of a traceable wrapper subclass (``__tensor_flatten__``, torch's protocol for them) with its
    inner tensors cloned onto ``device``: the same subclass, so the same kernel runs on it."""
    inner, ctx = t.__tensor_flatten__()
    # torch 2.13's DTensor lists its DeviceMesh among the inner attributes: only tensors are copied
    parts = {k: (v.detach().to(device=device, copy=True) if isinstance(v, torch.Tensor) else v)
             for k, v in ((k, getattr(t, k)) for k in inner)}
    return type(t).__tensor_unflatten__(parts, ctx, t.shape, t.stride())


def copier(dtype: torch.dtype | None, device: str):
    """A function making a detached copy of a tensor on ``device``: floating ones in ``dtype`` (complex ones in
    complex128) when it is given, others as they are. A scaled FP8 subclass (:func:`scaled_fp8_values`) becomes
    the plain tensor of its values in ``dtype``; kept in its own dtype, a wrapper subclass is rebuilt around copies
    of its inner tensors."""
    def conv(t: torch.Tensor) -> torch.Tensor:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            if dtype is not None and t.is_floating_point():
                values = scaled_fp8_values(t, dtype)
                if values is not None:
                    return values.to(device)
            elif dtype is None and hasattr(t, "__tensor_flatten__") and hasattr(type(t), "__tensor_unflatten__"):
                return _clone_wrapper(t, device)
        x = t.detach()
        if dtype is not None and t.is_floating_point():
            return x.to(device=device, dtype=dtype, copy=True)
        if dtype is not None and t.is_complex():
            return x.to(device=device, dtype=torch.complex128, copy=True)
        return x.to(device=device, copy=True)
    return conv


class _RngFork:
    """The state of the CPU's generator (and of one accelerator's, ``module``/``index``) saved on entering and put
    back on leaving: :func:`torch.random.fork_rng`'s effect for a fixed set of devices, without its per-use
    accelerator lookup and generator machinery (a reference runs this once per call, four times per isolated API)."""

    __slots__ = ("module", "index", "cpu", "dev")

    def __init__(self, module: Any = None, index: int | None = None):
        self.module, self.index = module, index

    def __enter__(self) -> None:
        self.cpu = torch.default_generator.get_state()  # torch.get_rng_state()
        if self.module is not None:
            self.dev = self.module.get_rng_state(self.index)

    def __exit__(self, *exc) -> bool:
        torch.default_generator.set_state(self.cpu)  # torch.set_rng_state()
        if self.module is not None:
            self.module.set_rng_state(self.dev, self.index)
        return False


def forked_rng(device: Any):
    """A context forking the CPU's generator and, for a run on an accelerator (``device``), that device's current
    one, as :func:`torch.random.fork_rng` does: a reference or a budget's run that draws (a module's dropout)
    leaves the user's random streams where they were on both. The CPU's alone where the device has no generator to
    fork."""
    if device == "cpu":
        return _RngFork()
    d = torch.device(device)
    if d.type == "cpu":
        return _RngFork()
    module = getattr(torch, d.type, None)
    if module is None or not hasattr(module, "get_rng_state") or not hasattr(module, "current_device"):
        return _RngFork()
    return _RngFork(module, d.index if d.index is not None else module.current_device())


def reference(func, args: tuple, kwargs: dict, dtype: torch.dtype | None, device: str, grad: bool,
              context=None, perturb: tuple | None = None):
    """Run ``func`` on detached copies of the arguments.

    Args:
        dtype: floating tensors are copied in this dtype (complex ones in complex128), ``None`` keeps theirs; a
            floating ``dtype=`` keyword follows it.
        device: where the copies live.
        grad: copies of the tensors that require grad become leaves that require grad (their order is the order
            of :func:`cast`'s traversal).
        context: a context manager factory the call runs in (the ``decomposed`` kernel).
            An API without a float64 kernel runs in float64 as its reference decomposition (:data:`REFERENCES`).
        perturb: ``(eta, generator, inner)``: the rounding of a typical kernel of the target dtype
            (:func:`budget_modes`); the inputs stay exact.

    Returns:
        ``(leaves, out, (args, kwargs))``: the leaves, the output and the copied arguments.
    """
    leaves: list = []
    copy = copier(dtype, device)
    if dtype == torch.float64 and func in REFERENCES:  # no float64 kernel: its float64 reference decomposition
        func = REFERENCES[func]

    def conv(t: torch.Tensor) -> torch.Tensor:
        x = copy(t)
        if grad and needs_grad(t):
            x.requires_grad_(True)
            leaves.append(x)
        return x
    a = cast(tuple(args), conv)
    k = {key: cast(v, conv) for key, v in kwargs.items()}
    if dtype is not None and isinstance(k.get("dtype"), torch.dtype) and k["dtype"].is_floating_point:
        k["dtype"] = dtype
    with torch.set_grad_enabled(grad), forked_rng(device), _modes(context, perturb, func, True):
        out = func(*a, **k)
    return leaves, out, (a, k)


def _modes(context, perturb: tuple | None, func: Any, forward: bool):
    """The contexts a run enters beside its grad mode and RNG fork: ``context()`` and a budget's modes
    (:func:`budget_modes`), in that order; a no-op context where there are none (most runs: no stack to build)."""
    if context is None and perturb is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    try:
        if context is not None:
            stack.enter_context(context())
        if perturb is not None:
            budget_modes(stack, perturb, func, forward=forward)
    except BaseException:
        stack.close()
        raise
    return stack


def vjp(outs: Any, leaves: list, grad_out: dict, context=None, perturb=None, retain: bool = True) -> list:
    """The gradients w.r.t. ``leaves`` of the outputs of ``outs`` that require grad, for the incoming gradients
    ``grad_out`` (``{index among those outputs: gradient}``), cast to each output's dtype and device; ``None``
    where a leaf gets none. ``context``/``perturb`` as for :func:`reference` (the incoming gradients stay exact:
    they are values of the target dtype); the graph is kept unless ``retain`` is False (its saved tensors are freed
    as the product is computed)."""
    ref_outs = [t for t in tensors_of(outs) if t.requires_grad]
    keep, grads = [], []
    for i, t in enumerate(ref_outs):
        g = grad_out.get(i)
        if g is None:
            continue
        g = g.detach().to(device=t.device, dtype=t.dtype)
        keep.append(t)
        grads.append(g)
    pos = [j for j, x in enumerate(leaves) if x is not None]
    if not keep or not pos:
        return [None] * len(leaves)
    with _modes(context, perturb, None, False):
        got = torch.autograd.grad(keep, [leaves[j] for j in pos], grads, allow_unused=True, retain_graph=retain)
    out: list = [None] * len(leaves)
    for j, g in zip(pos, got):
        out[j] = g
    return out


def budget_modes(stack: contextlib.ExitStack, perturb: tuple, func: Any = None, forward: bool = True) -> None:
    """Enter the modes of a budget's run on ``stack``: :class:`Perturb`, and for a forward that may call
    ``F.scaled_dot_product_attention`` (``func`` that API, or ``None``: a module's code) :class:`FusedAttention`
    (``perturb``: ``(eta, generator[, inner[, held[, tiny[, floor]]]])``, :func:`perturbation`)."""
    eta, gen = perturb[0], perturb[1]
    stack.enter_context(Perturb(eta, gen, *perturb[2:]))
    if forward and (func is None or func is _SDPA):
        # a budget charging the CPU half kernels (a non-empty held set) charges the CPU flash backward's block sums
        stack.enter_context(FusedAttention(eta, gen, perturb[5] if len(perturb) > 5 else 0.0,
                                           bool(perturb[3]) if len(perturb) > 3 else False))


def round_to(ref: Any, like: Any) -> Any:
    """``ref`` correctly rounded to ``like``'s dtype and moved to its device (round to nearest even, as torch
    casts); anything that is not a pair of floating tensors is returned as it is."""
    if isinstance(ref, torch.Tensor) and isinstance(like, torch.Tensor) and like.is_floating_point() and \
            ref.is_floating_point():
        return ref.detach().to(device=like.device, dtype=like.dtype)
    return ref
