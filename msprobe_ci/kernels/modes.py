"""The dispatch modes a reference or a budget runs under: :class:`Decomposed` (PyTorch's decompositions),
:class:`Materialized` (each kernel's result rounded once) and the split-K GEMMs of reduced-precision reductions;
the rounding real kernels commit is :class:`~msprobe_ci.kernels.perturb.Perturb`, the fused attention's mode
:class:`~msprobe_ci.kernels.attention.FusedAttention`."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .choice import _UNIT, tensors_of



# ---------------------------------------------------------------------------------------------------- dispatch modes
class Decomposed(TorchDispatchMode):
    """Runs every ATen op that PyTorch has a Python decomposition for (``torch._decomp.decomposition_table``, the
    reference implementations inductor and export lower through) as that decomposition, one level deep: the
    ``decomposed`` bench kernel. An op whose decomposition fails at these arguments runs as itself."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._decomp import decomposition_table

        kwargs = kwargs or {}
        fn = decomposition_table.get(func)
        native = func(*args, **kwargs)
        if fn is None or func._schema.is_mutable or func.is_view:
            return native
        try:
            out = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a decomposition that does not take these arguments: the op itself
            return native
        # the autograd node recorded above this mode is the op's own: its backward reads the op's auxiliary
        # outputs (an attention's logsumexp in fp32), so those stay the op's own where the decomposition's differ
        # in dtype or shape; the main output is the decomposition's wherever it has the op's dtype and shape
        if _same_meta(out, native):
            return out
        if isinstance(out, (tuple, list)) and isinstance(native, (tuple, list)) and out and native and \
                _same_meta(out[0], native[0]):
            return type(native)([out[0], *native[1:]])
        return native


def _same_meta(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b))
    return type(a) is type(b)


@contextlib.contextmanager
def decomposed():
    """The ``decomposed`` kernel's context: core-ATen decompositions, oneDNN off (restored on exit)."""
    was = torch._C._get_mkldnn_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "TF32 acceleration on top of oneDNN is available for Intel GPUs"
        torch._C._set_mkldnn_enabled(False)
    try:
        with Decomposed():
            yield
    finally:
        torch._C._set_mkldnn_enabled(was)


def target_dtype(tensors: list) -> torch.dtype:
    """The coarsest floating dtype among ``tensors`` (the one a call's results are rounded to; fp32 when none)."""
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    return max(floats, key=lambda d: _UNIT.get(d, 0.0), default=torch.float32)


#: cuBLAS's reduced-precision reduction (PyTorch's default for bf16 and fp16 GEMMs on CUDA:
#: ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` and ``..._fp16_...`` are True): a GEMM
#: whose few output tiles leave the device's multiprocessors idle splits its reduction over K into partial sums,
#: rounds each to the output dtype and adds them in that dtype. Measured on an H100 (torch 2.11 + CUDA 13,
#: ``benchmarks/reduced_precision_gemm.py``, GPT-2 small's LM-head input gradient, 1024 x 50,257 x 768): the mean
#: relative error 2.44 (bf16) and 3.07 (fp16) times the fp32-accumulated product's rounded once, its max 10x; with
#: the flag off 1.00, and 1.00 for the same head's K = 768 and K = 1,024 GEMMs. Sequential half-precision
#: accumulation of S partials reproduces it (bf16: 2.33x at S = 16, 2.47x at 20, 2.61x at 25; fp16 3.65x at 16).
#: The bench of such a GEMM allows one partial per :data:`SPLIT_K_TERMS` terms, at most :data:`SPLIT_K_MAX`
#: (25 at K = 50,257: above both measurements); a GEMM of K <= 2,048 is not split.
SPLIT_K_TERMS = 2048
SPLIT_K_MAX = 32
_SPLIT_GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def reduced_precision_reduction(device: str, dtype: torch.dtype) -> bool:
    """Whether half-precision GEMMs of ``dtype`` on ``device`` may add their split-K partial sums in ``dtype``:
    a CUDA device with PyTorch's ``allow_bf16_reduced_precision_reduction`` / ``allow_fp16_...`` on (their
    default). False on every other device (the CPU's GEMMs accumulate in fp32; an NPU's settings are its own)."""
    if not str(device).startswith("cuda") or dtype not in (torch.bfloat16, torch.float16):
        return False
    matmul = torch.backends.cuda.matmul
    name = "allow_bf16_reduced_precision_reduction" if dtype == torch.bfloat16 else \
        "allow_fp16_reduced_precision_reduction"
    return bool(getattr(matmul, name, False))


def split_k_parts(k: int) -> int:
    """How many partial sums the bench allows a reduced-precision GEMM over ``k`` terms (:data:`SPLIT_K_TERMS`)."""
    return min(SPLIT_K_MAX, -(-int(k) // SPLIT_K_TERMS))


def _split_gemm(name: str, args: tuple, kwargs: dict, parts: int, dtype: torch.dtype) -> torch.Tensor:
    """``mm``/``addmm``/``bmm``/``baddbmm`` with its reduction split into ``parts`` partial sums, each computed in
    the arguments' precision, rounded to ``dtype`` and added to the running sum in ``dtype``; the bias term of
    ``addmm``/``baddbmm`` added after, in the arguments' precision (a GEMM's epilogue)."""
    bias, (a, b) = (args[0], args[1:3]) if name in ("addmm", "baddbmm") else (None, args[:2])
    k = a.shape[-1]
    bounds = [k * i // parts for i in range(parts + 1)]
    product = torch.bmm if a.dim() == 3 else torch.mm
    total = None
    for lo, hi in zip(bounds, bounds[1:]):
        part = product(a.narrow(-1, lo, hi - lo), b.narrow(-2, lo, hi - lo)).to(dtype).to(a.dtype)
        total = part if total is None else (total + part).to(dtype).to(a.dtype)
    if bias is None:
        return total
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    return alpha * total + (beta * bias if beta != 0 else 0)


class Materialized(TorchDispatchMode):
    """An ``upcast``/``rounded`` bench run as the ATen kernels the call is made of, each one rounded once.

    A call that PyTorch's definition splits into several kernels (``Tensor.__matmul__`` of a multi-query attention
    broadcasts one key over the heads: its key gradient is a ``bmm`` per head, rounded to the target dtype, then
    their ``sum``; ``F.cross_entropy`` is ``log_softmax`` materialized in the target dtype, then ``nll_loss``) holds
    those intermediates in the target dtype on every device: the decomposition happens above the device's kernels.
    A bench computing the whole call one precision up and rounding only its result is then more accurate than
    any device's (a Falcon fp16 key gradient measured 2.05 times the upcast bench's mean relative error, bit for
    bit the per-head rounding). Here every floating tensor that an arithmetic kernel of the call produced and
    another reads (an *intermediate*) is rounded to ``dtype`` where it is read; the call's inputs, and in a
    backward the tensors the forward saved, are not (a fused backward kernel reads those as they are).

    ``split`` (the target's GEMMs may add split-K partial sums in its dtype, :func:`reduced_precision_reduction`):
    every ``mm``/``addmm``/``bmm``/``baddbmm`` over more than :data:`SPLIT_K_TERMS` terms is computed as
    :func:`split_k_parts` partial sums added in ``dtype`` (:func:`_split_gemm`); :attr:`split` then holds the
    largest number of partial sums used.

    ``dtype`` ``None`` rounds nothing and only records, in :attr:`read`, whether the call has an intermediate or a
    GEMM that would be split (then the one-kernel shortcut, the oracle rounded once, is not the bench)."""

    def __init__(self, dtype: torch.dtype | None = None, split: bool = False):
        super().__init__()
        self.dtype = dtype
        self.produced: set[int] = set()
        self.read = False
        self.may_split, self.split = split, 0

    @staticmethod
    def _key(t: torch.Tensor) -> int | None:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass wrapper)
            return None

    def _held(self, value: Any) -> Any:
        def one(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_complex() and \
                    self._key(t) in self.produced:
                self.read = True
                if self.dtype is not None and t.dtype != self.dtype and \
                        _UNIT.get(t.dtype, 1.0) < _UNIT.get(self.dtype, 0.0):
                    return t.to(self.dtype).to(t.dtype)
            return t
        return tree_map(one, value)

    def _parts(self, name: str, args: tuple, kwargs: dict) -> int:
        """The partial sums a split GEMM is computed in here (1: not split)."""
        if not self.may_split or name not in _SPLIT_GEMMS or "out" in kwargs:
            return 1
        a = args[1] if name in ("addmm", "baddbmm") else args[0]
        if not isinstance(a, torch.Tensor) or not a.is_floating_point() or a.dim() not in (2, 3):
            return 1
        return split_k_parts(a.shape[-1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        arithmetic = not (func.is_view or name in _NO_ROUNDING or name in _NO_ROUNDING_INPLACE)
        ins = {self._key(t) for t in tensors_of(args) + tensors_of(kwargs)}
        if arithmetic and not ins.isdisjoint(self.produced):  # else no argument is an intermediate: none is held
            if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
                first = self._held(args[0])
                if first is not args[0]:
                    args[0].copy_(first)  # an in-place kernel reads the intermediate it overwrites as held
                args = (args[0], *self._held(tuple(args[1:])))
            else:
                args = self._held(args)
            kwargs = self._held(kwargs)
        parts = self._parts(name, args, kwargs)
        if parts > 1:
            self.read, self.split = True, max(self.split, parts)
        out = func(*args, **kwargs) if parts < 2 or self.dtype is None else \
            _split_gemm(name, args, kwargs, parts, self.dtype)
        # an arithmetic kernel's new results (not views of, or writes into, its arguments) are intermediates of
        # the call; a copy, a view or a gather of one is one too
        if arithmetic or not ins.isdisjoint(self.produced):
            for t in tensors_of(out):
                key = self._key(t)
                if key and key not in ins:
                    self.produced.add(key)
            if not arithmetic and func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
                self.produced.add(self._key(args[0]))  # an intermediate copied into a buffer: the buffer holds it
        return out


def materialized(dtype: torch.dtype | None, split: bool = False):
    """A context factory for :func:`reference`/:func:`vjp`: the call run under :class:`Materialized`."""
    return lambda: Materialized(dtype, split)


# ops whose result is a copy, a view, a fill or metadata: no arithmetic, nothing a kernel rounds
_NO_ROUNDING = frozenset({"detach", "lift_fresh", "lift_fresh_copy", "ones_like", "zeros_like", "empty_like",
                          "full_like", "_to_copy", "clone", "copy", "alias", "new_ones", "new_zeros", "new_empty",
                          "new_full", "scalar_tensor", "full", "ones", "zeros", "empty", "empty_strided", "expand",
                          "view", "_unsafe_view", "slice", "select", "cat", "stack", "index_select", "gather",
                          "constant_pad_nd", "where", "masked_fill", "embedding",
                          "permute", "transpose", "t", "squeeze", "unsqueeze", "reshape", "contiguous", "split",
                          "split_with_sizes", "unbind", "narrow", "flip", "roll", "repeat", "index", "as_strided"})

# in-place ops that write a copy, a fill, random values or metadata: nothing a kernel rounds
_NO_ROUNDING_INPLACE = frozenset({"copy_", "fill_", "zero_", "set_", "resize_", "resize_as_", "normal_", "uniform_",
                                  "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
                                  "masked_fill_", "index_fill_", "scatter_", "index_put_", "_index_put_impl_",
                                  "put_", "detach_", "requires_grad_", "as_strided_", "squeeze_", "unsqueeze_",
                                  "transpose_", "t_", "clamp_", "clamp_min_", "clamp_max_", "relu_", "masked_scatter_"})
