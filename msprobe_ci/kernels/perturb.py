"""The rounding real kernels commit, as a dispatch mode: :class:`Perturb` runs a reference with every ATen op's
result jittered as a kernel of the target dtype would round it (the error budgets of
:mod:`msprobe_ci.kernels.budgets`), with the tables of what each kind of kernel holds in which precision."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .._perf import reads_wait
from .choice import ROUNDING_RMS, cast, tensors_of
from .modes import _NO_ROUNDING, _NO_ROUNDING_INPLACE, _same_meta


#: ATen ops whose every output element is a sum of many products or terms (GEMMs, convolutions, sums): a kernel
#: accumulates them in fp32, so the rounding they commit is the random walk of their terms at fp32's roundoff
#: (``sqrt(sum t_j^2) * u32``), which jittering their inputs by the accumulation roundoff gives
_CONTRACTIONS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "convolution",
                           "_convolution", "convolution_backward", "mkldnn_convolution", "sum", "nansum", "mean",
                           "cumsum", "prod", "_grouped_mm", "embedding_bag", "_embedding_bag", "index_add",
                           "scatter_add", "scatter_reduce", "segment_reduce", "linalg_vector_norm", "norm"})

#: PyTorch's CPU kernels that hold their terms or partial sums in the tensor's half-precision dtype, where GPU and NPU
#: kernels accumulate in fp32 (measured: ``python benchmarks/cpu_half_accumulation.py``, docs/verdicts.md). A budget
#: for a bf16/fp16 target on the CPU charges these as a kernel holding everything in the target dtype: their inputs
#: (the terms) and every step of their decomposition jittered by the full unit roundoff (their sums grow past one
#: rounding per term; with the RMS of one rounding, BERT's embedding and GPT-2's LayerNorm backward in bf16 and
#: BERT's cross entropy in fp16 failed benign runs against the correctly rounded bench). Sources: the LayerNorm
#: backward keeps its weight- and bias-gradient sums in ``T`` (``aten/src/ATen/native/cpu/layer_norm_kernel.cpp``);
#: the mean ``nll_loss`` its cascade of partial sums (``LossNLL.cpp``); the embedding backward adds a repeated
#: token's gradient rows one by one in ``T`` (11-26 roundings at 512 repeats); the half convolution backward lands
#: 2.3-2.5 roundings off on average where one rounding is 0.36-0.43; the half batch norm rounds its statistics to
#: ``T`` (charged as :data:`STATS_ROUNDED` says, not as a fully held kernel); the log-softmax over the last dimension
#: its row's sum and that sum's log (charged as :data:`LSE_ROUNDED` says); the GLU backward its gate's sigmoid (as
#: :data:`GATE_ROUNDED` says).
#: The pooling backwards and ``col2im`` (``F.fold``, ``F.unfold``'s backward) add the gradients of overlapping
#: windows into the input gradient in ``T`` (an element that is the max of several windows: 1.2-1.5 roundings off
#: on average in bf16/fp16 where one rounding is 0.31; avg_pool2d backward 2.3 and col2im 1.9 against 0.36 and
#: 0.34): a ResNet's stem max-pool backward failed a benign bf16 run against the upcast bench (max_rel_err ratio
#: 19.7 where the sum cancels).
CPU_HALF_HELD = frozenset({"native_layer_norm", "native_layer_norm_backward", "nll_loss_forward", "nll_loss2d_forward",
                           "embedding_dense_backward", "convolution_backward", "native_batch_norm",
                           "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                           "max_pool2d_with_indices_backward",
                           "max_pool3d_with_indices_backward", "avg_pool2d_backward", "col2im", "_log_softmax",
                           "glu_backward"})
#: the shapes :func:`cpu_half_held` probes the CPU's half convolution backward at: ``(input, weight, stride,
#: padding, groups)``, a dense 3x3, a strided one with few input channels, a depthwise 7x7 (oneDNN picks its
#: implementation per shape)
_CONV_PROBES = (((4, 16, 16, 16), (32, 16, 3, 3), 1, 1, 1), ((2, 3, 32, 32), (16, 3, 3, 3), 2, 1, 1),
                ((2, 32, 14, 14), (32, 1, 7, 7), 1, 3, 32))


@functools.lru_cache(maxsize=None)
def cpu_half_held(dtype: torch.dtype) -> frozenset:
    """:data:`CPU_HALF_HELD` as this CPU's kernels of ``dtype`` hold them. The convolution backward is oneDNN's,
    whose precision follows the CPU: measured on an AMD EPYC with AVX-512 bf16 (torch 2.13,
    ``benchmarks/cpu_half_accumulation.py``), its bf16 input and weight gradients are the exact ones rounded once
    (mean error 1.00 times that of rounding once, dense, strided, 1x1 and depthwise alike) while its fp16 ones
    are 1.3-4.9 times off. Charged as held there, a bf16 convolution backward was budgeted about 4 times its error
    (RMSE ratio 0.24) and a 1% fault on it passed. So it is held only where the kernel, run here on
    :data:`_CONV_PROBES` (fixed, seeded), is more than 1.25 times off on any of them; the probe runs once per
    dtype and process, outside every mode (no capture sees it)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return CPU_HALF_HELD
    from torch.utils._python_dispatch import _disable_current_modes

    gen = torch.Generator().manual_seed(0x0C0)
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        for x_shape, w_shape, stride, padding, groups in _CONV_PROBES:
            x = torch.randn(x_shape, generator=gen, dtype=torch.float64)
            w = torch.randn(w_shape, generator=gen, dtype=torch.float64) * 0.1
            x, w = x.to(dtype), w.to(dtype)
            conv = ([stride] * 2, [padding] * 2, [1, 1], False, [0, 0], groups)
            out_shape = torch.ops.aten.convolution(x.double(), w.double(), None, *conv).shape
            up = torch.randn(out_shape, generator=gen, dtype=torch.float64).to(dtype)
            got = torch.ops.aten.convolution_backward(up, x, w, None, *conv, [True, True, False])[:2]
            exact = torch.ops.aten.convolution_backward(up.double(), x.double(), w.double(), None, *conv,
                                                        [True, True, False])[:2]
            for g, e in zip(got, exact):
                once = (e.to(dtype).double() - e).abs().mean()
                if (g.double() - e).abs().mean() > 1.25 * once:
                    return CPU_HALF_HELD
    return CPU_HALF_HELD - {"convolution_backward"}


#: held kernels that round only their per-channel statistics: the CPU half batch norm in training mode
#: (``batch_norm_kernel.cpp``, reduced-precision paths): the mean and the variance sum are computed in fp32 and
#: stored in the tensor's dtype (``mean_data[c] = param_t(mean_val)``), ``invstd`` is saved in that dtype too; the
#: transform folds them in fp32 (``alpha = invstd * w``, ``beta = b - mean * alpha``) and rounds each output once,
#: and its backward sums in fp32 with those saved statistics and rounds once (a plain kernel). Charged as a fully
#: held kernel (inputs and every step at the full unit roundoff) its budget was about three times the error it makes
#: (measured in bf16: RMS 0.77, 2.5, 7.6 roundings at per-channel mean/std 0, 5, 50), and a 1% fault on it passed
#: where msprobe's own rule flags it (docs/verdicts.md). Its inputs are exact, its statistics rounded as the kernel
#: rounds them (:meth:`Perturb._stats_rounded`); eval mode rounds the output only.
STATS_ROUNDED = frozenset({"native_batch_norm", "_native_batch_norm_legit"})
#: held kernels that save their per-row statistics in the tensor's dtype and use them only in the backward: the CPU
#: half LayerNorm (``layer_norm_kernel.cpp``, ``layer_norm_cpu``: ``mean`` and ``rstd`` are tensors of the input's
#: dtype where input, weight and bias share it; computed in fp32, the output folded from the fp32 values and
#: rounded once, each statistic rounded to the dtype as it is stored). The backward reads them back: its input
#: gradient is off by the rounding of ``rstd`` (every element of the row, relative) and of ``mean`` (``xhat``
#: moves by ``u |mean| rstd``), past one rounding of itself. Measured on torch 2.13 (ViT, bf16, the second
#: LayerNorm's input gradient): the saved statistics are the fp32 ones rounded, and the input gradient computed from
#: them in float64 and rounded once is the kernel's for every element (68% for the exact one rounded once); drawn as
#: random roundings of the statistics (RMS 0.58 u each), its budget missed where the actual roundings were near
#: their bound, and the benign gate failed the small-value error (ratio 4-7 > 2) against the upcast bench. The
#: roundings are read from the data (:meth:`Perturb._saved_rounded`), the same in every draw; the forward is not
#: charged as held (its output is one rounding of fp32 math).
SAVED_ROUNDED = frozenset({"native_layer_norm"})

#: kernels that round their row's log-sum-exp where they hold it: every ``log_softmax`` at its accumulation roundoff
#: (:meth:`Perturb._lse_rounded`), and, held, the CPU half one over the last dimension (``SoftMaxKernel.cpp``,
#: ``_vec_log_softmax_lastdim``: the row's max and ``sum(exp(x - max))`` in fp32, the sum stored in a buffer of
#: ``T`` and its log taken there, ``x - max - log(sum)`` in fp32 and rounded once; other dimensions are computed in
#: fp32 and rounded once). Its outputs are off by the rounding of ``log(sum)``, one rounding of a
#: number near 1 or above, absolute: far beyond one rounding of an output near 0 (the likeliest class). Measured on
#: torch 2.13: this model of the kernel gives its bits for 99.7-100% of the elements in bf16 and fp16 (the upcast
#: bench 50-93%), and outputs near 0 were 12-30 roundings of themselves off. A CLIP contrastive loss (two 2 x 2
#: logit matrices, one class at p = 0.96) failed a benign bf16 run at its cross entropy backward against every
#: foreign bench (max_rel_err ratio 110) before. The roundings are read from the data, the same in every draw.
LSE_ROUNDED = frozenset({"_log_softmax"})
#: held kernels that store their gate's sigmoid in the dtype: the CPU ``glu_backward`` (``GatedLinearUnit.cpp``:
#: ``sigmoid_out`` into a tensor of ``T``, then ``grad * sigmoid`` and ``grad * a * sigmoid * (1 - sigmoid)`` in fp32,
#: each rounded once). Where the gate saturates, ``1 - sigmoid`` of a rounded sigmoid has lost every digit: measured
#: on torch 2.13, the gate's gradient was up to 256 (bf16) and 361 (fp16) roundings of itself off where one rounding
#: of fp32 math is under 1, and this model of the kernel gives its bits for every element (both dtypes, last and
#: first dimension); a GLU's benign backward failed its max_rel_err (ratio 11.7-15.3 > 10) against the upcast bench.
#: The forward computes the sigmoid in fp32 (the upcast bench's bits).
GATE_ROUNDED = frozenset({"glu_backward"})
#: held kernels whose output elements each add up a data-dependent number of their first argument's elements, often
#: one (a max-pool input that is the max of a single window, a token seen once): the sum of one term is that term,
#: copied exactly, and only elements that summed two or more are charged (a 1% fault on a ResNet stem's max-pool
#: backward in bf16, 2.6 roundings on every element, passed when the copies were charged a rounding too)
_SCATTERED_SUMS = frozenset({"max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward",
                             "embedding_dense_backward"})
#: held kernels without a decomposition whose every output element is a sum of products, one element of each floating
#: argument per product (run on ones, the kernel gives each element's number of terms): below the dtype's smallest
#: normal number each partial sum the kernel holds rounds at the format's fixed step, absolute, whatever the size of
#: the terms, so the held model's terms jittered relative to themselves leave those roundings out. The CPU fp16
#: depthwise 7x7 convolution's input gradient (ConvNeXt under fp16 autocast with a ``GradScaler``, every element
#: under 1.6e-5, 270 steps) was 5.3 times one rounding off (4.3 times for the same call a thousand times larger) and
#: failed a benign run at rmse ratio 3.07 against the upcast bench; such elements are charged the partial sums'
#: roundings (:meth:`Perturb._subnormal_sums`)
_COUNTED_SUMS = frozenset({"convolution_backward"})
#: held kernels that add each input row into its output row in the tensor's dtype, in the order of the indices: the
#: CPU embedding backward (``Embedding.cpp``, ``embedding_dense_backward_cpu``: ``grad_weight[k].add_(grad[i])``
#: for every position ``i`` in order, the vocabulary split over the threads, so each row's sum is one chain
#: whatever their number; a ``padding_idx`` position adds nothing). The budget runs that chain (:func:`_in_order_sum`):
#: every partial sum the fp32 sum of the row so far and the next gradient row, rounded to the dtype, the roundings
#: read from the data, the kernel's bits. A token seen many times (a padding token, BERT's token types: one row of
#: two summing every position's gradient) stagnates there. Charged as a held kernel (its terms and one sum at the
#: full unit) the benign gate failed against the upcast bench: token types over 8 x 512 positions RMSE ratio 78
#: (bf16) and 16 (fp16); 50% padding, the padding row 5-11% off in bf16, 8.8 (26 with a coherent gradient); 82
#: repeats of each of 50 tokens, max relative error ratio 10-13. With ``scale_grad_by_freq``, a held kernel
#: (:meth:`Perturb._held`).
IN_ORDER = frozenset({"embedding_dense_backward"})
#: held kernels whose math is fp32 but that add their rows into a half-precision buffer one by one: the LayerNorm
#: backward (``layer_norm_kernel.cpp``: the input gradient and each row's sums in ``opmath_t``, fp32; the rows are
#: split over the intra-op threads as ``at::parallel_for(0, M, 1, ...)`` splits them, and each thread's ``dgamma``/
#: ``dbeta`` buffer of ``T`` gets row after row of its share, each addition in fp32 rounded back to ``T``; the
#: threads' buffers are then added in fp32 and rounded once). The budget runs that sum as the kernel runs it
#: (:func:`_buffered_sum`), every partial sum rounded to the dtype, so its error is read from the data, not drawn:
#: each addition rounds at the size of the partial sum so far, and where the terms share a sign (a bias gradient
#: over the tokens of one sequence) the sum stagnates, its roundings correlated. Measured on GPT-2 small, 1 x 1024
#: tokens, bf16 (the first LayerNorm's bias gradient, terms coherent at 8 times their random walk): the kernel's
#: RMSE was 2.0 (2 threads) and 2.7 (1 thread) times the random walk of independent roundings of its partial sums
#: (``u sqrt(sum_k s_k^2)``, the model before), whose benign gate failed against the upcast bench (RMSE ratio
#: 2.02 > 2), and its weight gradient's 0.33-0.41 times it (a 1% fault on it passed); the simulation gives the
#: kernel's bits for every element at 1, 2 and 3 threads. Before that: Swin's, Wav2Vec2's and CLIP's LayerNorm
#: backward failed benign bf16/fp16 runs against every foreign bench when charged their terms only, and charging
#: the whole kernel as held hid a 1% fault on its input gradient.
ROWS_SUMMED = frozenset({"native_layer_norm_backward"})
#: held kernels that sum their terms as a cascade of half-precision partial sums: the CPU ``nll_loss`` (and
#: ``nll_loss2d``) with a mean or sum reduction (``LossNLL.cpp``, ``LossNLL2d.cpp``: ``loss_partial_sums`` of
#: ``scalar_t``, levels of 16 terms added one by one, each level's total added into the next). The error is the
#: random walk of every partial sum (:func:`_cascade_error`), not of the terms: DeBERTa's fp16 loss over 32 tokens,
#: 2.6 roundings off, failed a benign run against every foreign bench when charged its terms only. Each partial sum
#: is charged the full unit roundoff (a rounding's bound, as :meth:`Perturb._held`), not its RMS: the loss is one
#: number, and the kernel's relative error, RMS 1.0-1.3 u over 16 to 2048 tokens, reaches 2.5-3.3 u in 60 draws.
CASCADE_SUMMED = frozenset({"nll_loss_forward", "nll_loss2d_forward"})
#: the terms one level of :data:`CASCADE_SUMMED`'s cascade adds one by one
CASCADE_STEP = 16
#: add and sub with an ``alpha`` (``p.add_(grad, alpha=-lr)``): the CPU half kernels cast ``alpha`` to the tensor's
#: dtype (measured: 0.25 u of the term in bf16, 0.5 u in fp16, for alpha -0.1)
_ALPHA_OPS = frozenset({"add", "sub", "add_", "sub_"})

#: inside a fused attention kernel (:class:`FusedAttention`): the results held in the input dtype. Flash attention
#: kernels (PyTorch's CPU ``_scaled_dot_product_flash_attention_for_cpu``, FlashAttention-2 on CUDA) compute
#: ``Q K^T``, the softmax and ``dP`` in fp32 but cast the probabilities ``P`` (and in the backward ``dS``) to the
#: input dtype for the GEMMs that follow; everything else stays in fp32.
ATTENTION_HELD = frozenset({"_softmax", "_safe_softmax", "_softmax_backward_data"})
#: and whose inputs are held too: a flash backward's ``D = rowsum(dO * O)`` reads the forward output ``O`` rounded
#: to the input dtype, so ``dP - D`` cancels at the size of a rounding of its terms (the probabilities and their
#: gradient rounded where they enter ``dS = P * (dP - D)``); T5's attention backward missed by 10.7 u otherwise.
#: ``D``'s own rounding, shared by a query's whole row, is drawn apart (:func:`_stored_output_terms`)
ATTENTION_HELD_INPUTS = frozenset({"_softmax_backward_data"})

_KERNEL = threading.local()  # the stack of fused kernels the running ops are inside (their held results)


def _inside() -> list:
    if not hasattr(_KERNEL, "stack"):
        _KERNEL.stack = []
    return _KERNEL.stack


def held_runs() -> int:
    """How many held kernels (:data:`CPU_HALF_HELD`, charged as holding their terms in the target dtype) the
    budget's runs on this thread have met so far: a scale producer compares it before and after its draws."""
    return getattr(_KERNEL, "held_runs", 0)


def _precision() -> tuple | None:
    """``(eta, held, tiny, floor)`` of the dtype the running kernel computes in where :func:`computed_in` set one,
    else ``None`` (every :class:`Perturb` rounds as it was made)."""
    return getattr(_KERNEL, "precision", None)


@contextlib.contextmanager
def computed_in(precision: tuple | None) -> Iterator[None]:
    """Every :class:`Perturb` (and :class:`~.attention.FusedAttention`) of this thread rounds as a kernel of
    another dtype while inside: ``precision`` is ``(eta, held, tiny, floor)`` of that dtype (:func:`~.budgets.
    precision_of`), ``None`` their own. What a module's budget needs where ``torch.autocast`` ran some of its calls
    in bf16/fp16 and the rest in fp32 (:mod:`.amp_sites`); the accumulation roundoff (``inner``) stays fp32's."""
    before = getattr(_KERNEL, "precision", None)
    _KERNEL.precision = precision
    try:
        yield
    finally:
        _KERNEL.precision = before


class Perturb(TorchDispatchMode):
    """The rounding a typical kernel of the target dtype commits, as random relative jitter of an fp64 run.

    * Inputs are exact (they already are values of the target dtype; :func:`reference` copies them unchanged).
    * Every ATen op is a kernel: its floating result is materialized in the target dtype, so it is multiplied by
      ``1 + eta * xi`` (``xi``: random errors of RMS 1 from ``generator``, :func:`jitter`; ``eta``: the RMS of one rounding to the target
      dtype, :func:`perturbation`).
    * Inside a kernel, intermediates are held in fp32 (``inner``: one rounding in fp32, or ``eta`` where the target
      is fp32 itself): a contraction (:data:`_CONTRACTIONS`) accumulates its terms there (its inputs jittered by
      ``inner`` before it runs: the random walk of the terms), a half-precision kernel combining several tensors
      (``a + alpha * b``, an in-place ``addcdiv_``) rounds its terms there too (what shows where they cancel), and a
      *reduction* (an op whose floating outputs are all smaller than its largest floating input: a mean, a loss)
      that PyTorch can decompose runs as that decomposition, each step jittered by ``inner``, the result rounded once to the target dtype.
    * Exceptions where a kernel is known to hold intermediates in the target dtype, each with its source:
      ``held`` (:data:`CPU_HALF_HELD` for a half-precision target on the CPU: inputs and every step of the
      decomposition jittered by the full unit roundoff ``unit``) and, inside a fused attention
      (:class:`FusedAttention`), :data:`ATTENTION_HELD`.

    ``inner`` ``None``: every step by ``eta`` (a kernel holding everything in the target dtype)."""

    def __init__(self, eta: float, generator: torch.Generator, inner: float | None = None,
                 held: frozenset = frozenset(), tiny: float = 0.0, floor: float = 0.0):
        super().__init__()
        self.generator = generator
        self._own = (eta, held, tiny, floor)
        self.inner = eta if inner is None else inner
        self._all_at: float | None = None  # inside a held kernel: every result and term at the full ``unit``
        self._rows_summed = False  # inside a held kernel that sums its rows one by one (:data:`ROWS_SUMMED`)

    # the rounding of the kernel running now: the target dtype's, or under a precision of :func:`computed_in` (a
    # call autocast ran in another dtype than the module around it) that dtype's
    @property
    def eta(self) -> float:
        return (_precision() or self._own)[0]

    @property
    def held(self) -> frozenset:
        return (_precision() or self._own)[1]

    @property
    def tiny(self) -> float:
        return (_precision() or self._own)[2]

    @property
    def floor(self) -> float:
        return (_precision() or self._own)[3]

    @property
    def unit(self) -> float:
        return self.eta / ROUNDING_RMS

    @property
    def half(self) -> torch.dtype:
        """The half-precision dtype a held kernel stores in (bf16 or fp16, told apart by the unit roundoff)."""
        return torch.bfloat16 if self.unit > 2.0 ** -10 else torch.float16

    def _at(self, eta: float, value: Any) -> Any:
        floor = self.floor if eta >= self.eta else 0.0  # a rounding to the target dtype, subnormals and all
        return tree_map(lambda t: jitter(t, eta, self.generator, floor), value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_ROUNDING:
            return func(*args, **kwargs)
        if self.held and self._all_at is None and name in _ALPHA_OPS and len(args) > 1 and \
                kwargs.get("alpha", 1) != 1:
            # PyTorch's CPU half add/sub casts ``alpha`` to the tensor's dtype: the ``alpha * b`` term is off by
            # up to a rounding of its own (0.25-0.5 u measured for alpha 0.1)
            args = (args[0], self._at(self.unit, args[1]), *args[2:])
        if func._schema.is_mutable:
            if not _rounds_in_place(name):
                return func(*args, **kwargs)
            if self._all_at is None and _fused(func, args, kwargs):
                # a fused update (``exp_avg.lerp_(grad, 0.1)``: ``a + w * (b - a)``) rounds inside, on its
                # overwritten tensor's terms too (jittered where it lies: the op must write into it)
                if isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                    args[0].copy_(jitter(args[0], self.inner, self.generator))
                args = (args[0], *self._at(self.inner, tuple(args[1:])))
                kwargs = self._at(self.inner, kwargs)
            elif self._all_at is None and self.inner < self.eta and _terms(args, kwargs) > 1:
                # its fp32 math rounds the terms it adds to the tensor it overwrites (not that tensor itself)
                args = (args[0], *self._at(self.inner, tuple(args[1:])))
                kwargs = self._at(self.inner, kwargs)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                inside = _inside()
                eta = self._all_at or (self.inner if inside and name not in inside[-1] else self.eta)
                # an in-place kernel rounds what it writes
                out.copy_(jitter(out, eta, self.generator, self.floor if eta >= self.eta else 0.0))
            return out
        if self._all_at is not None:  # a step of a held kernel
            if name in _CONTRACTIONS:
                args, kwargs = self._at(self._all_at, args), self._at(self._all_at, kwargs)
            out = func(*args, **kwargs)
            return self._at(self._all_at, out)
        inside = _inside()
        if self._rows_summed and name == "sum" and _sums_rows(args):  # a half buffer's row-by-row sum
            return _buffered_sum(func, args, kwargs, self.half)
        if name in self.held and not inside and name not in SAVED_ROUNDED:
            _KERNEL.held_runs = held_runs() + 1
        if name in LSE_ROUNDED and not inside:  # every log-softmax rounds its log-sum, held or not
            return self._lse_rounded(func, args, kwargs)
        if name in self.held and not inside:
            if name in STATS_ROUNDED:
                return self._stats_rounded(func, args, kwargs)
            if name in SAVED_ROUNDED:
                return self._saved_rounded(func, args, kwargs)
            if name in GATE_ROUNDED:
                return self._gate_rounded(func, args, kwargs)
            if name in ROWS_SUMMED:
                return self._rows(func, args, kwargs)
            if name in IN_ORDER:
                return self._in_order(func, args, kwargs)
            if name in CASCADE_SUMMED:
                return self._cascade(func, args, kwargs)
            return self._held(func, args, kwargs)
        # the rounding of this op's result: the target dtype's for a kernel's output or a held intermediate
        out_eta = self.inner if inside and name not in inside[-1] else self.eta
        if inside and name in ATTENTION_HELD_INPUTS and self.inner < self.eta:  # a half-precision attention
            args = self._at(self.eta, args)
        if name in _CONTRACTIONS or (self.inner < self.eta and _terms(args, kwargs) > 1) or \
                _fused(func, args, kwargs):
            # an accumulation in fp32, or a half kernel's fp32 math combining several terms (``a + alpha * b``,
            # ``addcdiv``): its terms rounded at fp32's roundoff, what shows where they cancel
            out = func(*self._at(self.inner, args), **self._at(self.inner, kwargs))
            return self._at(out_eta, out)
        out = func(*args, **kwargs)
        if _reduces(args, kwargs, out):
            steps = self._steps(func, args, kwargs, out, held=False)
            if steps is not None:
                return self._at(out_eta, steps)
        return self._at(out_eta, out)

    def _steps(self, func, args, kwargs, out, held: bool):
        """``func`` run as its decomposition, each step an op of this mode inside the kernel (``held``: every step
        at the full unit roundoff); None where PyTorch has none, or it does not take these arguments or gives
        results of other dtypes or shapes than ``out``."""
        from torch._decomp import decomposition_table

        fn = decomposition_table.get(func)
        if fn is None:
            return None
        if held:
            self._all_at = self.unit
        else:
            _inside().append(frozenset())
        try:
            with self:
                steps = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a decomposition that does not take these arguments
            return None
        finally:
            if held:
                self._all_at = None
            else:
                _inside().pop()
        return steps if _same_meta(steps, out) else None

    def _rows(self, func, args, kwargs):
        """A kernel whose math is fp32 but which adds its rows into a buffer of the target dtype
        (:data:`ROWS_SUMMED`): its decomposition with every step at the accumulation roundoff, as any kernel, except
        those row sums, run as the kernel's threads run them with every partial sum rounded to the target dtype
        (:func:`_buffered_sum`); each result rounded once (the threads' buffers added in fp32). Without a
        decomposition, a held kernel (:meth:`_held`)."""
        out = func(*args, **kwargs)
        self._rows_summed = True
        try:
            steps = self._steps(func, args, kwargs, out, held=False)
        finally:
            self._rows_summed = False
        return self._held(func, args, kwargs) if steps is None else self._at(self.eta, steps)

    def _in_order(self, func, args, kwargs):
        """The CPU half ``embedding_dense_backward`` (:data:`IN_ORDER`) on its exact inputs: each position's
        gradient row added into its token's row in index order, every partial sum rounded to the target dtype
        (:func:`_in_order_sum`). With ``scale_grad_by_freq`` or another form, a held kernel (:meth:`_held`)."""
        names = ("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")
        a = dict(zip(names, args))
        a.update(kwargs)
        grad, ids, n = a.get("grad_output"), a.get("indices"), a.get("num_weights")
        if a.get("scale_grad_by_freq") or not isinstance(grad, torch.Tensor) or not isinstance(ids, torch.Tensor) \
                or not isinstance(n, int) or grad.dim() == 0 or ids.is_floating_point() or \
                grad.numel() != ids.numel() * grad.shape[-1]:
            return self._held(func, args, kwargs)
        out = func(*args, **kwargs)
        half = self.half
        pad = a.get("padding_idx", -1)
        summed = _in_order_sum(grad.reshape(-1, grad.shape[-1]), ids.reshape(-1), n, pad, half)
        return summed.to(out.dtype) if summed.shape == out.shape else self._held(func, args, kwargs)

    def _stats_rounded(self, func, args, kwargs):
        """The CPU half batch norm (:data:`STATS_ROUNDED`) on its exact inputs. In training mode its saved
        statistics are what the kernel stores: the mean (summed in fp32, each draw jittered at fp32's roundoff)
        rounded to the target dtype, the variance sum rounded to it and ``invstd`` computed from that and rounded
        again; they are returned so, as the kernel saves them for its backward, and the output is folded from them
        (``x * alpha + beta``, fp32 math) and rounded once. That rounding of the statistics is the same in every draw
        (it is the kernel's, read from the data), so the budget holds the error this kernel makes on these numbers,
        not a guess of its size. In eval mode the output is rounded once. Another form: a held kernel
        (:meth:`_held`)."""
        names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
        a = dict(zip(names, args))
        a.update(kwargs)
        x, w, b, eps = a.get("input"), a.get("weight"), a.get("bias"), a.get("eps")
        if len(args) + len(kwargs) != len(names) or not isinstance(x, torch.Tensor) or x.dim() < 2 or \
                not isinstance(eps, (int, float)):
            return self._held(func, args, kwargs)
        out, mean, invstd = func(*args, **kwargs)
        if not a.get("training") or mean.numel() != x.shape[1] or invstd.numel() != x.shape[1]:
            return self._at(self.eta, out), mean, invstd
        half = self.half
        n = x.numel() // x.shape[1]
        mean = jitter(mean, self.inner, self.generator).to(half).to(mean.dtype)
        var_sum = ((1.0 / invstd.square() - eps) * n).to(half).to(invstd.dtype)
        invstd = (1.0 / (var_sum / n + eps).sqrt()).to(half).to(invstd.dtype)
        alpha = invstd if w is None else invstd * w
        beta = -mean * alpha if b is None else b - mean * alpha
        shape = [1, -1] + [1] * (x.dim() - 2)
        folded = x * alpha.view(shape) + beta.view(shape)
        return jitter(folded.to(out.dtype), self.eta, self.generator, self.floor), mean, invstd

    def _saved_rounded(self, func, args, kwargs):
        """The CPU half ``native_layer_norm`` (:data:`SAVED_ROUNDED`) on its exact inputs: its output rounded once,
        and its saved statistics (every floating output after the first: ``mean``, ``rstd``) computed in fp32 (each
        draw jittered at fp32's roundoff) and rounded to the target dtype as the kernel stores them, for the
        backward that reads them. Other outputs as any kernel's."""
        out = func(*args, **kwargs)
        if not isinstance(out, tuple) or len(out) < 2:
            return self._at(self.eta, out)
        half = self.half
        saved = [jitter(t, self.inner, self.generator).to(half).to(t.dtype)
                 if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in out[1:]]
        return (jitter(out[0], self.eta, self.generator, self.floor), *saved)

    def _lse_rounded(self, func, args, kwargs):
        """A ``log_softmax`` (:data:`LSE_ROUNDED`) on its exact inputs: ``x - max - log(sum(exp(x - max)))``, its
        result rounded once, and the row's sum and that sum's log each rounded where the kernel holds them. A kernel
        holds them in its accumulation dtype (fp32 math, jittered at ``inner``): an output near 0 is then off by a
        rounding of a number near 1, not of itself (an fp32 target's confident class: 280-11,000 roundings of
        itself, measured on the CPU, under the benchmark standard's floor of the bench error there; a GPU kernel
        computes ``log(sum)`` in fp32 too, and a module judged whole carries it). The CPU half kernel over the
        last dimension holds them in the target dtype, rounded as it rounds them (read from the data). Another
        form: one rounding of the result."""
        names = ("self", "dim", "half_to_float")
        a = dict(zip(names, args))
        a.update(kwargs)
        x, dim = a.get("self"), a.get("dim")
        out = func(*args, **kwargs)
        if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or x.dim() == 0 or a.get("half_to_float") \
                or not x.is_floating_point():
            return self._at(self.eta, out)
        top = x.amax(dim, keepdim=True)
        total = jitter((x - top).exp().sum(dim, keepdim=True), self.inner, self.generator)
        if "_log_softmax" in self.held and dim % x.dim() == x.dim() - 1:
            half = self.half
            lse = total.to(half).to(x.dtype).log().to(half).to(x.dtype)
        else:
            lse = jitter(total.log(), self.inner, self.generator)
        return jitter((x - top - lse).to(out.dtype), self.eta, self.generator, self.floor)

    def _gate_rounded(self, func, args, kwargs):
        """The CPU half ``glu_backward`` (:data:`GATE_ROUNDED`) on its exact inputs: the gate's sigmoid rounded to
        the target dtype as the kernel stores it, both halves of the input gradient computed from it and each
        rounded once. Another form: one rounding of the result."""
        names = ("grad_output", "self", "dim")
        a = dict(zip(names, args))
        a.update(kwargs)
        grad, x, dim = a.get("grad_output"), a.get("self"), a.get("dim", -1)
        out = func(*args, **kwargs)
        if not isinstance(grad, torch.Tensor) or not isinstance(x, torch.Tensor) or not isinstance(dim, int) or \
                x.dim() == 0 or x.shape[dim] % 2:
            return self._at(self.eta, out)
        half = self.half
        first, second = x.chunk(2, dim)
        gate = torch.sigmoid(second).to(half).to(x.dtype)
        held = torch.cat([grad * gate, grad * first * gate * (1 - gate)], dim)
        return jitter(held.to(out.dtype), self.eta, self.generator, self.floor) if held.shape == out.shape else \
            self._at(self.eta, out)

    def _cascade(self, func, args, kwargs):
        """The CPU half ``nll_loss`` with a reduction (:data:`CASCADE_SUMMED`): its exact result plus the error
        of its cascade of half-precision partial sums over the picked terms ``-w[t] x[i, t]``, each at the full
        unit roundoff (:func:`_cascade_error`), divided by the total weight for ``mean``; the result rounded once.
        Other forms (no reduction), a held kernel (:meth:`_held`)."""
        names = ("self", "target", "weight", "reduction", "ignore_index")
        a = dict(zip(names, args))
        a.update(kwargs)
        x, target, weight = a.get("self"), a.get("target"), a.get("weight")
        reduction, ignore = a.get("reduction", 1), a.get("ignore_index", -100)
        if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor) or x.dim() < 2 or \
                reduction not in (1, 2):
            return self._held(func, args, kwargs)
        loss, total = func(*args, **kwargs)
        valid = target != ignore
        safe = torch.where(valid, target, torch.zeros_like(target))
        picked = -x.gather(1, safe.unsqueeze(1)).squeeze(1)
        if isinstance(weight, torch.Tensor):
            picked = picked * weight[safe]
        picked = torch.where(valid, picked, torch.zeros_like(picked))
        err = _cascade_error(picked.reshape(-1), self.unit, self.generator, self.tiny)
        if reduction == 1:
            err = err / total
        return self._at(self.eta, loss + err), total

    def _held(self, func, args, kwargs):
        """A kernel holding its terms in the target dtype: its inputs (the terms), every step of its decomposition
        (where PyTorch has one) and its result jittered by the full unit roundoff, not the RMS of one rounding:
        these kernels' half sums grow past one rounding per term (a sequential sum's error is the random walk of
        its partial sums), measured in ``benchmarks/cpu_half_accumulation.py``."""
        name = func.overloadpacket.__name__
        jargs, jkwargs = self._at(self.unit, args), self._at(self.unit, kwargs)
        out = func(*jargs, **jkwargs)
        steps = self._steps(func, jargs, jkwargs, out, held=True)
        out = steps if steps is not None else self._at(self.unit, out)
        if name in _SCATTERED_SUMS and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            # an element that received one term is that term, copied: exact (only the sums round)
            counted = [torch.ones_like(args[0]), *args[1:]]
            if name == "embedding_dense_backward":  # count the rows, not their frequency-scaled weights
                counted[4:5] = [False] if len(counted) > 4 else []
            count = func(*counted, **{k: v for k, v in kwargs.items() if k != "scale_grad_by_freq"})
            out = torch.where(count > 1.5, out, func(*args, **kwargs))
        if name in _COUNTED_SUMS and self.floor > 0.0:
            out = self._subnormal_sums(func, args, kwargs, out)
        return out

    def _subnormal_sums(self, func, args, kwargs, out):
        """``out`` of a held kernel of :data:`_COUNTED_SUMS` with, on each element under the magnitude where the
        dtype's rounding is absolute (:func:`_below`), one draw of the random walk of its other partial sums:
        ``sqrt(terms - 1)`` roundings at that absolute step (the result's own rounding is already drawn), charged at
        the full unit roundoff as the held model charges every rounding. An element of one term, or above that
        magnitude, is left as it is."""
        below = _below(self.floor, self.unit)
        step = self.unit * below
        if not any(isinstance(t, torch.Tensor) and t.is_floating_point() and bool((t.abs() < below).any())
                   for t in tensors_of(out)):
            return out
        counts = _term_counts(func, args, kwargs)

        def walk(t, c):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and isinstance(c, torch.Tensor)) or \
                    c.shape != t.shape:
                return t
            small = (t.abs() < below) & (c > 1.5)
            xi = _draw(t.numel(), self.generator, t.dtype, t.device).view(t.shape)
            return torch.where(small, t + xi * (c - 1).clamp_min(0).sqrt() * step, t)
        if isinstance(out, (tuple, list)):
            return type(out)(walk(t, c) for t, c in zip(out, counts))
        return walk(out, counts)


_COUNTS: dict = {}  # the last kernel's term counts: a budget's draws run the same call on the same shapes
_COUNTS_KEPT = 1 << 20  # elements of counts kept between calls at most (8 MB of float64)


def _term_counts(func, args, kwargs):
    """How many terms each output element of a kernel of :data:`_COUNTED_SUMS` adds up: the kernel run on ones in
    place of its floating arguments. Kept for the last call's shapes and other arguments (a budget's draws ask
    again for each); not kept where an integer tensor is among them (its values would count)."""
    plain = all(t.is_floating_point() for t in tensors_of(args) + tensors_of(kwargs))
    key = (func, repr(cast((tuple(args), kwargs), lambda t: (tuple(t.shape), t.dtype, t.device.type)))) \
        if plain else None
    if key is not None and key in _COUNTS:
        return _COUNTS[key]
    counts = func(*cast(tuple(args), lambda t: torch.ones_like(t) if t.is_floating_point() else t), **kwargs)
    _COUNTS.clear()
    if key is not None and sum(t.numel() for t in tensors_of(counts)) <= _COUNTS_KEPT:
        _COUNTS[key] = counts
    return counts


# in-place ops that write no arithmetic result: copies, fills, random draws, index writes, metadata
def _terms(args, kwargs) -> int:
    """How many floating tensors an op reads (the terms its arithmetic may combine)."""
    return sum(1 for t in tensors_of(args) + tensors_of(kwargs) if t.is_floating_point())


def _fused(func, args, kwargs) -> bool:
    """Whether a pointwise op's arithmetic rounds inside, before its result: it reads three floating tensors or
    more (``addcmul``, ``addcdiv``, ``lerp`` with a tensor weight) or two and a floating scalar factor (``lerp(a, b,
    0.1)``, ``add(a, b, alpha=-0.1)``). Its terms are rounded at the accumulation roundoff (:class:`Perturb`), which
    matters where that is the target's own (fp32: the CPU's ``lerp`` is ``a + w * (b - a)`` in fp32, three roundings
    where the correctly rounded result has one, off by 2 u where AdamW's first moment cancels). Only ATen ops
    tagged ``pointwise``: a normalization's inputs (LayerNorm's ``x, weight, bias``) are not terms it adds."""
    if torch.Tag.pointwise not in getattr(func, "tags", ()):
        return False
    n = _terms(args, kwargs)
    if n >= 3:
        return True
    scalars = [v for v in list(args) + list(kwargs.values()) if isinstance(v, float) and not isinstance(v, bool)]
    return n >= 2 and any(v not in (1.0, -1.0, 0.0) for v in scalars)


def _rounds_in_place(name: str) -> bool:
    """An in-place ATen op (``add_``, ``addcdiv_``, ``lerp_``) whose written result is arithmetic: rounded once
    in the target dtype like its functional form."""
    return name.endswith("_") and not name.startswith("_foreach") and name not in _NO_ROUNDING_INPLACE and \
        name[:-1] not in _NO_ROUNDING


def _reduces(args, kwargs, out) -> bool:
    ins = [t.numel() for t in tensors_of(args) + tensors_of(kwargs) if t.is_floating_point()]
    outs = [t.numel() for t in tensors_of(out) if t.is_floating_point()]
    return bool(ins) and bool(outs) and max(outs) < max(ins)


#: one buffer of rounding errors per device, drawn once on the CPU (and copied once to each other device a budget
#: runs on): each jitter reads it from a random offset
_DRAWN: dict = {}
_DRAWN_SIZE = 1 << 22
_SPREAD = (13.0 / 12.0) ** -0.5  # |xi| = this * (0.5 + U(0, 1)): RMS 1


def _draw(n: int, generator: torch.Generator, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
    """``n`` draws of ``xi``: a random sign times a magnitude uniform on ``[0.5, 1.5]``, scaled to RMS 1, on
    ``device`` (``None``: the CPU). ``generator`` is a CPU generator: off the CPU the draws come from a generator of
    that device seeded from it (one 0-d CPU draw), so a budget's runs there draw there, reproducibly, and never copy
    draws across (a budget over GPT-2's 51M-element logits would move 411 MB per jittered op)."""
    if device is not None and torch.device(device).type != "cpu":
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        generator = torch.Generator(device=device).manual_seed(seed)
    sign = torch.randint(0, 2, (n,), generator=generator, dtype=dtype, device=device).mul_(2).sub_(1)
    return torch.rand(n, generator=generator, dtype=dtype, device=device).add_(0.5).mul_(sign).mul_(_SPREAD)


def _drawn(device: torch.device) -> torch.Tensor:
    """The buffer of :data:`_DRAWN_SIZE` draws (float32) on ``device``: the CPU's, drawn once with a fixed seed, or
    a copy of it made once per device."""
    buf = _DRAWN.get(device)
    if buf is None:
        cpu = torch.device("cpu")
        if cpu not in _DRAWN:
            _DRAWN[cpu] = _draw(_DRAWN_SIZE, torch.Generator().manual_seed(0x516E), torch.float64).to(torch.float32)
        buf = _DRAWN[device] = _DRAWN[cpu].to(device)
    return buf


def _sums_rows(args) -> bool:
    """Whether a ``sum.dim_IntList`` step adds whole rows: it reduces leading dimensions, never the last (a
    LayerNorm backward's weight and bias gradients; its per-row sums over the normalized dimension are fp32)."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], (list, tuple)):
        return False
    x, dims = args[0], args[1]
    if x.dim() < 2 or not dims:
        return False
    return (x.dim() - 1) not in {d % x.dim() for d in dims}


def row_chains(rows: int, threads: int) -> tuple[int, int]:
    """``(chains, length)``: how ``at::parallel_for(0, rows, 1, f)`` splits ``rows`` over ``threads`` intra-op
    threads (``aten/src/ATen/ParallelOpenMP.h``: one thread where there is one row or one thread, else
    ``min(threads, rows)`` threads, each taking ``ceil(rows / threads)`` consecutive rows, the last fewer; a thread
    past the end takes none), as the number of consecutive runs and the rows of the longest."""
    if rows <= 1 or threads <= 1:
        return 1, max(rows, 0)
    length = -(-rows // min(threads, rows))
    return -(-rows // length), length


def _buffered_sum(func, args, kwargs, half: torch.dtype, threads: int | None = None) -> torch.Tensor:
    """``sum(x, dims)`` over leading dimensions (the rows, row-major) as :data:`ROWS_SUMMED`'s kernel adds them:
    the rows split over ``threads`` (default: this process's intra-op thread count, the target's; :func:`row_chains`),
    each thread's rows added one by one into a buffer of ``half``, every partial sum the fp32 sum of the buffer and
    the row rounded to ``half``; the buffers added (in ``x``'s precision: the kernel adds them in fp32 and rounds
    once, which the caller's one rounding of the result charges). Subnormal partial sums round on the dtype's own
    grid. ``x``'s dtype, shaped as ``func``'s result."""
    x, dims = args[0], sorted({d % args[0].dim() for d in args[1]})
    keep = [d for d in range(x.dim()) if d not in dims]
    out = func(*args, **kwargs)
    terms = x.permute(*dims, *keep).reshape(-1, *[x.shape[d] for d in keep])
    chains, length = row_chains(terms.shape[0], torch.get_num_threads() if threads is None else threads)
    pad = chains * length - terms.shape[0]  # zero rows: adding 0 leaves a buffer as it is
    if pad:
        terms = torch.cat([terms, terms.new_zeros(pad, *terms.shape[1:])])
    terms = terms.view(chains, length, *terms.shape[1:])
    buf = terms.new_zeros(chains, *terms.shape[2:])
    for k in range(length):
        buf = (buf + terms[:, k]).to(torch.float32).to(half).to(x.dtype)
    return buf.sum(0).reshape(out.shape).to(out.dtype)


def _in_order_sum(rows: torch.Tensor, ids: torch.Tensor, n: int, pad: int, half: torch.dtype) -> torch.Tensor:
    """``out[k] = sum of rows[i] where ids[i] == k`` (``n`` x width, ``rows``' dtype) as :data:`IN_ORDER`'s kernel
    adds them: for each token, its rows in index order, the first copied, each later partial sum the fp32 sum
    rounded to ``half``; rows at ``pad`` add nothing. The j-th rows of every token are added together, one step
    per rank (as many steps as the most frequent token has rows)."""
    keep = ids != pad
    rows, ids = rows[keep], ids[keep].long()
    out = rows.new_zeros(n, rows.shape[-1])
    if ids.numel() == 0:
        return out
    order = torch.argsort(ids, stable=True)  # each token's positions together, in index order
    counts = torch.bincount(ids, minlength=n)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel()) - first[ids[order]]  # how many of its token came before
    by_rank = torch.argsort(rank, stable=True)
    widths = torch.bincount(rank).tolist()
    start = 0
    for r, width in enumerate(widths):  # the tokens of one rank are distinct: their rows are added at once
        pos = by_rank[start:start + width]
        k = ids[pos]
        # a token's first row is copied (0 + g: exact, as for the kernel's own half rows; a budget's jittered row
        # is not rounded twice), every later partial sum rounded
        out[k] = rows[pos] if r == 0 else (out[k] + rows[pos]).to(torch.float32).to(half).to(out.dtype)
        start += width
    return out


def _cascade_error(terms: torch.Tensor, eta: float, generator: torch.Generator, tiny: float = 0.0) -> torch.Tensor:
    """The error of summing ``terms`` (1-D, in order) as a cascade of partial sums in the target dtype
    (:data:`CASCADE_SUMMED`): every partial sum of each level's runs of :data:`CASCADE_STEP` jittered by ``eta``
    (absolute ``eta * tiny`` below the smallest normal, :func:`_below`), the runs' totals the next
    level's terms. A 0-d tensor."""
    err = terms.new_zeros(())
    level = terms
    while level.numel() > 1:
        pad = (-level.numel()) % CASCADE_STEP
        runs = torch.cat([level, level.new_zeros(pad)]).view(-1, CASCADE_STEP).cumsum(-1)
        real = (torch.arange(runs.numel()) < level.numel()).view(runs.shape)  # the padding adds nothing
        size = torch.where(real, runs.abs().clamp(min=_below(tiny, eta)), torch.zeros_like(runs))
        err = err + (jitter(size, eta, generator) - size).sum()
        level = runs[:, -1]
    return err


def jitter(t: Any, eta: float, generator: torch.Generator, floor: float = 0.0) -> Any:
    """``t * (1 + eta * xi)`` for a floating tensor ``t``, anything else unchanged: ``xi`` a random sign times a
    magnitude uniform on ``[0.5, 1.5]``, scaled to RMS 1, so ``eta * xi`` has the RMS ``eta`` of one rounding.

    The budget estimates each element's error RMS from a few draws, so ``xi`` is chosen for that estimate, not to
    mimic one rounding's (uniform) error: a random sign of fixed size (every draw of a one-rounding element
    exact) let two roundings of equal size cancel exactly in half of the draws, and 4 draws estimated a scale of 0
    in 1 case out of 16 (Mixtral's router softmax backward, ``y_i (g_i - sum_j g_j y_j)`` over two routed
    experts, false-failed the small-value rule there); a uniform error never cancels, but one of 4 draws near 0
    estimates a one-rounding element far under its size (GPT-2's attention backward false-failed its max
    relative error). Magnitudes on ``[0.5, 1.5]`` do neither: a one-rounding element is estimated within
    ``[0.48, 1.44]`` of its size, two equal roundings never cancel exactly.

    A complex ``t`` (``torch.polar``, FFTs, a rotary embedding's ``view_as_complex``) is jittered on its real and
    imaginary parts apart, as a kernel rounds each: unjittered, a complex intermediate carried no rounding, and a
    gradient whose terms cancel through one (an angle that the loss does not depend on) was budgeted at zero and
    failed its fp32 ``polar`` backward at max_rel_err ratio 1.6e4.

    ``floor``: the target dtype's smallest normal number, for a rounding to that dtype. Below it the format's step
    is fixed (fp16's subnormal step 2^-24 = 6e-8), so an element smaller than ``floor`` is off by ``eta`` times
    ``floor``, absolute, not relative to itself (IEEE 754-2008 §3.4; Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., §2.1: ``fl(x) = x(1 + d) + e``, ``|e|`` up to half the subnormal step); and by
    :data:`FLUSH` at least, for a kernel that flushes fp32's subnormals (elements under ``FLUSH / eta``,
    :func:`_below`). A Llama decoder layer's fp16 backward on the CPU, whose gradients reach 1e-6 (9% of its
    output gradient is subnormal), failed its max relative error at 18.9 times the budget without it
    (``tests/test_sensitivity.py``). A CPU tensor with no element below ``_below(floor, eta)`` draws exactly as
    without it.

    The draws are a window of one buffer of 4M at an offset ``generator`` draws: drawing one per element of every
    jittered intermediate took 60% of a budget's time, and windows at independent random offsets are as good as
    fresh draws for a random walk (tensors larger than half the buffer draw their own)."""
    if isinstance(t, torch.Tensor) and t.is_complex() and t.numel():
        # a complex result is two floating ones, each rounded on its own (an fp32 kernel's complex64)
        return torch.view_as_complex(jitter(torch.view_as_real(t.resolve_conj()), eta, generator, floor).contiguous())
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return t
    n = t.numel()
    if n > _DRAWN_SIZE // 2:
        xi = _draw(n, generator, t.dtype, t.device).view(t.shape)
    else:
        start = int(torch.randint(0, _DRAWN_SIZE - n + 1, (1,), generator=generator))  # a CPU draw: no sync
        xi = _drawn(t.device)[start:start + n].view(t.shape).to(t.dtype, copy=True)  # never the buffer itself
    xi = xi.mul_(eta)
    out = t * (xi + 1.0)
    if floor > 0.0:
        below = _below(floor, eta)  # where the absolute error (eta * below) is larger than the relative one
        small = (t.abs() < below) & (t != 0)  # an exact zero (a mask, a ReLU) is no rounding
        if reads_wait(t) or bool(small.any()):  # on a device, never a sync per op
            # only there: infinities and the rest keep their relative draw (an additive one made inf + -inf)
            out = torch.where(small, t + xi * torch.copysign(torch.full_like(t, below), t), out)
    return out


#: fp32's smallest normal number, 2^-126. Kernels of a half-precision dtype that compute in fp32 may flush fp32
#: intermediates and results under it to zero whatever the FPU's mode: x86's bf16 instructions (AVX512-BF16's
#: ``VCVTNEPS2BF16`` and ``VDPBF16PS``, AMX's ``TDPBF16PS``) treat denormal inputs as zero and flush denormal
#: results, as accelerators' flush-to-zero modes do. Measured on this project's CPU (``benchmarks/
#: unseen_architectures.py --models efficientnet``): a bf16 ``conv2d`` whose exact outputs lie under 4e-38 returned
#: 0 for 91 of 128 of them, and outputs of 1e-37 lost 2.5 times this number to flushed products. A bf16 result
#: may so be off by about this much, absolute: one unit of ``eta`` at ``FLUSH / eta``. fp16's own subnormal step is
#: far coarser (:func:`_below` keeps it).
FLUSH = torch.finfo(torch.float32).smallest_normal


def _below(floor: float, eta: float) -> float:
    """The magnitude under which a rounding with relative RMS ``eta`` to a dtype of smallest normal number ``floor``
    errs absolutely, by ``eta`` times it: ``floor`` itself (the format's fixed subnormal step), or ``FLUSH / eta``
    where a flush of fp32's subnormals (:data:`FLUSH`) is the larger error (bf16, whose smallest normal is fp32's);
    0 for no floor (no absolute error modelled)."""
    return max(floor, FLUSH / eta) if floor > 0.0 and eta > 0.0 else floor
