"""What isolation sets beside a target API call: the oracle, the same-dtype bench kernels, and the perturbed runs
that size an API's error budget.

**Bench kernels** (``--msprobe-bench-kernel``). The benchmark standard (msprobe 2.4) judges the target's error
against the error of a same-dtype *bench* kernel, both measured against the oracle. Which kernel plays the bench is a
choice, so one CPU-only machine can run the path a GPU bench and an NPU target take:

============  ==========================================================================================================
``device``    the API on the bench device in the target's dtypes: the bench device's own kernels (a GPU bench for an
              NPU target; on a CPU-vs-CPU run, the target's own kernel, recomputed)
``upcast``    the API computed one precision up from the target-dtype inputs (bf16/fp16 → fp32, fp32 → fp64), each
              of its ATen kernels' results rounded once to the target's dtype (:class:`Materialized`: only an
              intermediate another kernel of the call reads, and the outputs): what GPU kernels with fp32
              accumulation and fp32 intermediates give
``rounded``   the API's kernels in fp64 from the target-dtype inputs, each result rounded once: the correctly
              rounded kernels, the most accurate the dtype allows
``decomposed``  the API with every ATen op that has a Python decomposition in PyTorch (the reference implementations
              inductor and ``torch.export`` lower through) run as that decomposition, with oneDNN off, in the target's
              dtypes on the bench device: real CPU kernels other than the target's own. Measured on torch 2.13 CPU
              (``benchmarks/bench_kernels.py``, share of elements whose bits differ): scaled_dot_product_attention
              37% (bf16) / 35% (fp16) / 89% (fp32) forward, 20-44% backward; cross_entropy in fp16 and fp32; in
              fp32 softmax 53%, layer_norm 31%, gelu 18%, silu 25%, conv2d 89% (oneDNN off) and their backward
              68-69%. Another intra-op thread count changed only the LayerNorm backward (0.7%), so it is not offered
============  ==========================================================================================================

**The oracle** is msprobe's ``PRECISION_MAPPING``: fp16/bf16-only calls in fp32, anything else in fp64, on CPU.

**Error budgets** (:func:`forward_scale`, :func:`backward_scale`). How far a *correct* kernel of a dtype may land
from the oracle depends on the arithmetic, not only on the output's magnitude: an element that is a sum of terms
that cancel (a weight gradient summed over the batch, an fp32 LayerNorm output next to its bias, an attention
output ``P @ V`` with ``P`` held in bf16) carries an error of the size of its terms, which can be many times the
element itself. Relative errors measured against ``|oracle|`` alone then fail every benign kernel that is not
bit-for-bit the bench's own, and they would make a correctly rounded bench the strictest judge of all. The *scale*
of an element is the RMS of the rounding a typical kernel of the target dtype commits on the way to it, in units of
the dtype's unit roundoff ``u``: the API is run in fp64 (forward, and the backward with the incoming gradient) under
:class:`Perturb`, which models what real kernels do:

* the inputs are exact: a kernel reads values that already are of the target dtype;
* every ATen kernel's result is rounded once to the target dtype;
* inside a kernel, GEMMs, convolutions and reductions accumulate in fp32 (the random walk of their terms at fp32's
  roundoff) and elementwise math runs in fp32 (PyTorch's ``opmath_t``; GPU and NPU kernels alike);
* intermediates are held in the target dtype only where a kernel is known to hold them there, each with its
  source: a fused attention's probabilities and their gradient (:data:`ATTENTION_HELD`), and PyTorch's own CPU
  half-precision kernels measured to keep half sums (:data:`CPU_HALF_HELD`, for a CPU target only); a flash
  attention backward reads the output it stored in the target dtype for ``D = rowsum(dO * O)``, whose rounding a
  query's whole row shares (``attention._stored_output_terms``).

Each rounding is a random error of RMS ``u / sqrt(3)`` (:data:`ROUNDING_RMS`; a random sign times a magnitude
on ``[0.5, 1.5]`` of it, :func:`jitter`), and ``scale = rms over draws
of (perturbed - unperturbed) / u``. An elementwise op's scale is then its output's size (one rounding), a bf16
GEMM's the same, an fp32 GEMM's the random walk of its terms. A fault of 1% in bf16 (2.56 u) is a fault at every
element where the arithmetic does not cancel; the benchmark standard judges the max relative error against the
bound of one rounding (``sqrt(3)`` times the scale) and the mean and RMSE against the RMS.

A module isolated whole (L0, a compiled region) that ran under ``torch.autocast`` is no kernel of one dtype: each
of its calls is rounded in the dtype autocast ran it in (:mod:`.amp_sites`). Where rounding carried a kink's input
across it in some draws (a ReLU within a rounding of 0), the draws jump rather than spread, and the jump is credited
whole (:class:`~.budgets._Spread`); where the target's rounding carried one across and no draw did, a failing module is
judged once more against the oracle on the target's side of it (:mod:`.kinks`).
"""

# one package, seven rooms: which kernel (choice), the dispatch modes, the kernels' rounding (perturb), the fused
# attention, running references, error budgets, a batch-wise loss's product in pieces;
# every name is importable from here as it was from the single module
from ..config import BENCH_KERNELS  # noqa: F401 (the vocabulary lives where the torch-free option parsers read it)
from .choice import (  # noqa: F401
    _group_bounds, _HALF, _qualified, _references, _UNIT, call_best_precision, Float64References, cast, check_bench_kernel, default_bench_kernel, float32_fallback, FP8_DTYPES, grouped_mm_reference, in_float64, needs_grad, oracle_dtype, reference_note, REFERENCES, ROUNDING_RMS, scaled_mm_reference, tensors_of, unwritten, upcast_dtype, zero_past)
from .modes import (  # noqa: F401
    _NO_ROUNDING, _NO_ROUNDING_INPLACE, _same_meta, Decomposed, decomposed, Materialized, materialized, reduced_precision_reduction, split_k_parts, SPLIT_K_MAX, SPLIT_K_TERMS, target_dtype)
from .perturb import (  # noqa: F401
    _ALPHA_OPS, _CONTRACTIONS, _draw, _DRAWN, _DRAWN_SIZE, _fused, _inside, _KERNEL, _reduces, _rounds_in_place, _SPREAD, _terms, ATTENTION_HELD, ATTENTION_HELD_INPUTS, CPU_HALF_HELD, cpu_half_held, held_runs, jitter, Perturb)
from .attention import _attention_math, _FusedAttention, _round_out, _SDPA, FusedAttention  # noqa: F401
from .references import (  # noqa: F401
    _clone_wrapper, budget_modes, copier, forked_rng, reference, round_to, scaled_fp8_values, vjp)
from .budgets import (  # noqa: F401
    _draws, _eta, _fp64_or_fp32, _Spread, ACCUMULATION, backward_scale, DRAWS, forward_scale, HELD_IN_DTYPE, held_scales,
    perturbation, precision_of, target_roundoff, unit_of)
from .pieces import LossPieces, loss_pieces  # noqa: F401
