"""Error budgets: the RMS rounding a correct kernel of the target dtype commits on the way to each element
(:func:`forward_scale`, :func:`backward_scale`), from perturbed float64 runs of the call."""

from __future__ import annotations

from typing import Any

import torch

from .choice import _UNIT, ROUNDING_RMS, cast, tensors_of
from .modes import target_dtype
from .perturb import CPU_HALF_HELD, cpu_half_held, held_runs
from .references import reference, vjp



# ---------------------------------------------------------------------------------------------------- budgets
DRAWS = 4


def target_roundoff(tensors: list) -> float:
    """The unit roundoff of the coarsest floating dtype among ``tensors`` (:func:`target_dtype`; fp32's when there is
    none, or for a dtype without one here: float8 operands, whose GEMM rounds to its output's dtype)."""
    return _UNIT.get(target_dtype(tensors), 2.0 ** -24)


def _eta(run_dtype: torch.dtype, unit: float = 2.0 ** -24) -> float:
    """The jitter of the budget's runs: the target dtype's own unit roundoff ``unit``, so that what rounding at
    that size moves beyond first order (a ReLU or max-pool whose input lies within a rounding of its kink) shows
    too; at least 2^-30 in fp64 and 2^-10 in fp32 (where the run has no fp64 kernel), far above the run's own
    rounding."""
    return max(unit, 2.0 ** -30 if run_dtype == torch.float64 else 2.0 ** -10)


#: the unit roundoff kernels accumulate in: fp32 for every floating dtype up to fp32 (GEMMs, reductions and
#: elementwise math of bf16/fp16 tensors run in fp32 on CPUs, GPUs and NPUs alike: PyTorch's ``opmath_t``)
ACCUMULATION = 2.0 ** -24




def perturbation(run_dtype: torch.dtype, tensors: list, generator: torch.Generator) -> tuple:
    """``(eta, generator, inner, held, tiny, floor)`` of a budget's runs (:class:`Perturb`) in ``run_dtype`` for a
    call on ``tensors``: ``eta`` the RMS of one rounding to the target dtype (:data:`ROUNDING_RMS` times its
    roundoff, :func:`target_roundoff`, :func:`_eta`), ``inner`` of one rounding in the accumulation dtype
    (:data:`ACCUMULATION`, or the target's own where that is finer), the kernels known to hold their terms in
    the target dtype (:data:`CPU_HALF_HELD` for a bf16/fp16 call on the CPU; none elsewhere) and, with them, the
    target dtype's smallest normal number (``tiny``: below it a held sum rounds by half a subnormal step,
    absolute); ``floor``, that number for every rounding to a half-precision target on any device
    (:func:`~.perturb.jitter`). The scales are measured in units of the target's roundoff (:func:`unit_of`)."""
    cpu = any(t.device.type == "cpu" for t in tensors if t.is_floating_point())
    eta, held, tiny, floor = precision_of(run_dtype, target_dtype(tensors), cpu)
    unit = target_roundoff(tensors)
    return (eta, generator, _eta(run_dtype, min(unit, ACCUMULATION)) * ROUNDING_RMS, held, tiny, floor)


def precision_of(run_dtype: torch.dtype, dtype: torch.dtype, cpu: bool) -> tuple:
    """``(eta, held, tiny, floor)`` of a kernel computing in ``dtype`` for a budget's runs in ``run_dtype``
    (:func:`perturbation`'s fields; ``cpu``: on the CPU, where half-precision kernels hold what
    :data:`CPU_HALF_HELD` lists, as this CPU's kernels hold them: :func:`~.perturb.cpu_half_held`). What
    :func:`~.perturb.computed_in` takes for a call autocast ran in ``dtype``."""
    unit = _UNIT.get(dtype, 2.0 ** -24)
    half = unit > ACCUMULATION
    smallest = torch.finfo(dtype).smallest_normal if dtype.is_floating_point else 0.0
    cpu_half = half and cpu
    return (_eta(run_dtype, unit) * ROUNDING_RMS, cpu_half_held(dtype) if cpu_half else frozenset(),
            smallest if cpu_half else 0.0, smallest if half else 0.0)


def unit_of(perturb: tuple) -> float:
    """The target's roundoff a :func:`perturbation` was made for: the unit its scales are measured in."""
    return perturb[0] / ROUNDING_RMS


#: the attribute an error scale carries (``True``) where the budget's runs met a kernel charged as holding its
#: terms in the target dtype (:data:`CPU_HALF_HELD`, a bf16/fp16 call on the CPU): its elements may be off by a
#: rounding of their terms at the target's roundoff, not at fp32's (the benchmark standard's small values, whose
#: allowance is otherwise one fp32 rounding of their terms). The CPU half batch norm saves its ``invstd`` in the
#: dtype, and where a training batch of two makes its input gradient a cancellation to nearly 0 (LeViT's
#: classifier, batch 2, the model cast to fp16), every small element is off by about that rounding of its terms:
#: 60 of 70 small elements of a benign backward were past one fp32 rounding (small-value error ratio 60 > 2)
HELD_IN_DTYPE = "held_in_dtype"


def held_scales(scales: list, held: bool) -> list:
    """``scales`` with :data:`HELD_IN_DTYPE` set on each tensor where ``held``."""
    if held:
        for s in scales:
            if isinstance(s, torch.Tensor):
                setattr(s, HELD_IN_DTYPE, True)
    return scales


#: a draw whose move at an element is this many times the RMS of the other draws' moves there (all but the two
#: largest) is a jump (:class:`_Spread`). A single rounding's draws lie within 3x of each other (:func:`~.perturb.
#: jitter`); a Gaussian sum of roundings reaches 16x in 1.7e-4 of the elements with 8 draws and none of 10^6 with
#: 16 (measured; 8x: 7.1e-3 and 1.3e-4). With 4 draws (an API's budget) a spread cannot be told from a jump
#: (a Gaussian's top draw reaches 8x the other three's RMS in 1.6% of the elements): no jump is looked for there
JUMP = 16.0
#: the fewest draws a jump is looked for in (a module's budget draws 8, a small output's 16)
JUMP_DRAWS = 8


class _Spread:
    """The scale estimate from the draws: per element, the RMS of (perturbed - unperturbed) / eta over the draws
    (``s * sqrt(chi2_R / R)`` for a true scale ``s``; the benchmark standard pools a row against its lower tail
    for the max relative error, :func:`msprobe_ci.checkers.benchmark._row_floor`).

    Where one or two of 8 draws or more *jumped* (moved :data:`JUMP` times the RMS of the others), the scale is the
    largest move: rounding moved a value across a kink (a ReLU or a max whose input lies within a rounding of
    it), and what follows changed discretely, not by a spread of roundings. A kernel of the target dtype may land
    on either side, so the whole jump is an outcome a correct kernel gives; the RMS over the draws credits it with
    ``jump * sqrt(k / R)`` only. Measured: T5's fp16 decoder block backward at L0 (a ReLU of its feed-forward within
    a rounding of 0 for one token) moved that token's input gradient by 88 units in the target and by 90 in 1
    of 8 draws (under 5 in the others); credited with the RMS, the benign block failed its RMSE against the
    correctly rounded bench (ratio 2.25 > 2).

    The draws are folded in one at a time (:meth:`add`): each draw's differences go into running sums (and, with
    :data:`JUMP_DRAWS` draws or more, the two largest moves) and are dropped, so a budget holds one or three tensors
    per output instead of every draw's (on GPT-2's logits, 1024 x 50,257 in float64, 411 MB a draw), in the same
    operations and order as over the draws held together.

    Args:
        eta: the unit the differences are measured in.
        n: the number of draws that will be added (decides whether jumps are looked for).
    """

    def __init__(self, eta: float, n: int):
        self.eta, self.n = eta, n
        self._cols: list | None = None  # per output: None (a draw had none), or [acc, top, second]

    def add(self, row: list) -> None:
        """Fold one draw's differences (``(perturbed - unperturbed)`` per output, ``None`` where it has none; every
        draw has the same outputs)."""
        if self._cols is None:
            self._cols = [[None, None, None] for _ in row]
        for k, (col, d) in enumerate(zip(self._cols, row)):
            if col is None:
                continue
            if d is None:
                self._cols[k] = None
                continue
            if self.n < JUMP_DRAWS:
                sq = (d / self.eta) ** 2
                col[0] = sq if col[0] is None else col[0] + sq
                continue
            m = (d / self.eta).abs()
            col[0] = m * m if col[0] is None else col[0] + m * m
            if col[1] is None:
                col[1], col[2] = m, torch.zeros_like(m)
            else:
                col[2] = torch.maximum(col[2], torch.minimum(col[1], m))
                col[1] = torch.maximum(col[1], m)

    def scales(self) -> list:
        """The scale of each output (``None`` where a draw had none): float64 tensors shaped like the differences."""
        out = []
        n = self.n
        for col in self._cols or []:
            if col is None or col[0] is None:
                out.append(None)
                continue
            acc, top, second = col
            rms = (acc / n).sqrt()
            if n >= JUMP_DRAWS:
                # the others: every draw but the two largest (two draws may have jumped)
                rest = ((acc - top * top - second * second).clamp(min=0.0) / (n - 2)).sqrt()
                rms = torch.where(top > JUMP * rest, torch.maximum(top, rms), rms)
            # a jitter that overflows a finfo.min mask to -inf makes inf - inf: no allowance there, not an infinite
            # one
            out.append(torch.nan_to_num(rms, nan=0.0, posinf=0.0))
        return out


def _fp64_or_fp32(func, args: tuple, kwargs: dict, grad: bool, device: str = "cpu"):
    """``(dtype, reference(...))`` on ``device`` in fp64, or in fp32 where the API has no fp64 kernel there."""
    try:
        return torch.float64, reference(func, args, kwargs, torch.float64, device, grad)
    except (RuntimeError, TypeError, NotImplementedError):
        return torch.float32, reference(func, args, kwargs, torch.float32, device, grad)


def _on(base: Any, device: str) -> Any:
    """``base`` (an output: tensors in lists, tuples, dicts) with its tensors detached on ``device``."""
    return cast(base, lambda t: t.detach().to(device))


def forward_scale(func, args: tuple, kwargs: dict, flatten, draws: int = DRAWS, seed: int = 0,
                  base: Any = None, device: str = "cpu") -> list:
    """Per-output error scale of ``func`` at these arguments (see the module docstring), as float64 tensors shaped
    like each output (``None`` for non-floating outputs), in the order ``flatten(out)`` gives them, on ``device``.

    Runs ``func`` ``draws + 1`` times in fp64 on ``device`` (default the CPU; an accelerator whose float64 the
    oracle already uses, issue 51: the runs stay there, no tensor crosses to the host; fp32 where it has no fp64
    kernel, with a coarser ``eta``); ``draws`` times when ``base``, its unjittered fp64 output (the oracle of an
    fp32 call), is given. The jitter is drawn from a CPU generator on the CPU and from a generator seeded by it on
    another device (:func:`~.perturb.jitter`): reproducible on each, equal in distribution across them.
    Raises whatever ``func`` raises.
    """
    fp64 = base is not None and all(t.dtype == torch.float64 for t in tensors_of(base) if t.is_floating_point())
    if fp64:
        dtype = torch.float64
        base = _on(base, device)
    else:
        dtype, (_, base, _) = _fp64_or_fp32(func, args, kwargs, False, device)
    perturb = perturbation(dtype, tensors_of(args) + tensors_of(kwargs), torch.Generator().manual_seed(0x5CA1E + seed))
    eta = unit_of(perturb)
    base_rows = flatten(base)
    n = _draws(draws, [b for b in base_rows if isinstance(b, torch.Tensor)])
    spread = _Spread(eta, n)  # each draw folded in as it comes: one draw's output alive at a time
    held = held_runs()
    for _ in range(n):
        _, out, _ = reference(func, args, kwargs, dtype, device, False, perturb=perturb)
        spread.add([(o.to(torch.float64) - b.to(torch.float64))
                    if isinstance(o, torch.Tensor) and o.is_floating_point() and isinstance(b, torch.Tensor)
                    and o.shape == b.shape else None for o, b in zip(flatten(out), base_rows)])
        del out
    return held_scales(spread.scales(), held_runs() > held)


SMALL, SMALL_DRAWS = 64, 16


def _draws(draws: int, outputs: list) -> int:
    """``draws``, or :data:`SMALL_DRAWS` when an output has fewer than :data:`SMALL` elements (a loss): there no
    row pools the estimate, whose lower tail with few draws is wide (a scalar made of two rounding sites of equal
    size reads 0 in 6% of 4-draw estimates), and the extra runs are cheap next to a large output's."""
    if draws and any(t.numel() < SMALL for t in outputs):
        return max(draws, SMALL_DRAWS)
    return draws


def backward_scale(func, args: tuple, kwargs: dict, grad_out: dict, draws: int = DRAWS, seed: int = 0,
                   base: list | None = None, device: str = "cpu") -> list:
    """Per-leaf error scale of the gradients ``func`` hands to its inputs that require grad (in :func:`reference`'s
    leaf order) for the incoming gradients ``grad_out`` (as :func:`vjp`): the forward recomputed in fp64 with
    inputs and intermediates jittered, then the vector-Jacobian product with the incoming gradients and the
    backward's own intermediates jittered (see the module docstring). ``None`` where a leaf gets no gradient.
    ``base``: the unjittered fp64 gradients when known (the oracle's of an fp32 call), saving one run.
    ``device``: where the runs are made and the scales returned (as :func:`forward_scale`)."""
    if base is not None and all(g is None or g.dtype == torch.float64 for g in base):
        dtype = torch.float64
        base = _on(base, device)
    else:
        dtype, (leaves, out, _) = _fp64_or_fp32(func, args, kwargs, True, device)
        base = vjp(out, leaves, grad_out, retain=False)
        del leaves, out
    perturb = perturbation(dtype, tensors_of(args) + tensors_of(kwargs), torch.Generator().manual_seed(0xBAC + seed))
    eta = unit_of(perturb)
    n = _draws(draws, [g for g in base if isinstance(g, torch.Tensor)])
    spread = _Spread(eta, n)  # each draw folded in as it comes: one draw's gradients alive at a time
    held = held_runs()
    for _ in range(n):
        p_leaves, p_out, _ = reference(func, args, kwargs, dtype, device, True, perturb=perturb)
        got = vjp(p_out, p_leaves, grad_out, perturb=perturb, retain=False)
        del p_leaves, p_out
        spread.add([None if g is None or b is None or g.shape != b.shape else (g.detach() - b.detach())
                    for g, b in zip(got, base)])
        del got
    return held_scales(spread.scales(), held_runs() > held)
