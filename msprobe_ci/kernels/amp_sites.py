"""The budget of a whole module run under ``torch.autocast``: which of its calls computed in the autocast dtype.

Under autocast a module is no kernel of one dtype. Its GEMMs, convolutions and attention compute in bf16/fp16 on
inputs autocast rounded to that dtype, and the norms, softmaxes and residual adds in fp32 (the op's cast policy,
:mod:`msprobe_ci.amp`). A budget that rounds every call as fp32 allows a GPT-2 block under bf16 autocast a
hundredth of the error its bf16 GEMMs make: the block false-failed at L0 with no fault (max relative error ratio
102 against the ``upcast`` bench, 11.9 in fp16). One that rounds every call in bf16 would hide a fault in the fp32
ones.

So the module is run as the target ran it (its dtypes, its device, the autocast state: the ``device`` bench's own
run, or one run more), and each outermost torch call that returns a floating tensor is noted with the dtype it
computed in, read off its output as :func:`msprobe_ci.amp.kernel_inputs` reads it, and the dtypes of its floating
inputs (:func:`record_sites`). The budget's float64 runs, where autocast casts nothing (float64 is never eligible), meet the same calls in the same
order: :class:`Sites` lines the two lists up by name (:class:`difflib.SequenceMatcher`: code that branches on a
dtype, ``T5``'s ``hidden_states.to(self.wo.weight.dtype)``, adds or drops calls) and runs each call that computed
in another dtype than the module's as a kernel of that dtype (:func:`~.perturb.computed_in`): the inputs autocast
cast down rounded to it, its result rounded to it, its accumulation fp32's, and in the backward every autograd node
the call made as well (the gradient a low-precision output receives is rounded to its dtype first). A call the two
lists do not pair is rounded as every call of that name was in the target's run, or as the module's where they
differ.
"""

from __future__ import annotations

import difflib
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .choice import cast as cast_all, tensors_of
from .perturb import _KERNEL, _precision, computed_in, jitter


@dataclass(frozen=True)
class Site:
    """One outermost torch call of a module's target run that returned a floating tensor: its ``name``
    (``torch.nn.functional.linear``), the dtype its first floating output has (``kernel``: the dtype it computed
    in under autocast) and its floating inputs' dtypes in the order :func:`~.choice.tensors_of` gives them
    (``None``: unknown, every input taken as cast)."""

    name: str
    kernel: torch.dtype
    inputs: tuple


def _name(func: Any) -> str:
    try:
        return torch.overrides.resolve_name(func) or repr(func)
    except Exception:  # noqa: BLE001 - a callable torch cannot name
        return getattr(func, "__qualname__", repr(func))


def _floating(value: Any) -> list[torch.Tensor]:
    return [t for t in tensors_of(value) if t.is_floating_point()]


class _Record(torch.overrides.TorchFunctionMode):
    """Notes a :class:`Site` for each outermost call (this mode is off while the call runs)."""

    def __init__(self):
        super().__init__()
        self.sites: list[Site] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        found = _floating(out)
        if found:
            self.sites.append(Site(_name(func), found[0].dtype,
                                   tuple(t.dtype for t in _floating(args) + _floating(kwargs))))
        return out


def record_sites(run: Callable[[], Any], keep: bool = False) -> Any:
    """The :class:`Site` of every outermost floating call ``run()`` makes (``run``: the module as the target ran
    it, under its autocast); with ``keep``, ``(sites, run()'s result)``. Raises whatever ``run`` raises."""
    mode = _Record()
    with mode:
        out = run()
    return (mode.sites, out) if keep else mode.sites


def _pair(names: list[str], target: list[Site]) -> tuple[list[Site | None], int]:
    """The target's site of each call ``names`` lists (a float64 run's outermost floating calls, in order), lined
    up by name (:class:`difflib.SequenceMatcher`); a call the two lists do not pair takes the site of every call of
    its name where those all computed in one dtype, else ``None``. Returns ``(sites, unpaired)``."""
    theirs = [s.name for s in target]
    matcher = difflib.SequenceMatcher(a=names, b=theirs, autojunk=False)
    kernels: list[Site | None] = [None] * len(names)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            kernels[block.a + k] = target[block.b + k]
    by_name: dict[str, set] = {}
    for s in target:
        by_name.setdefault(s.name, set()).add(s)
    unpaired = 0
    for i, (name, site) in enumerate(zip(names, kernels)):
        if site is None:
            unpaired += 1
            same = {s.kernel for s in by_name.get(name, ())}
            if len(same) == 1:  # every call of that name computed in one dtype
                kernels[i] = next(iter(by_name[name]))
    return kernels, unpaired


class _Paired(torch.overrides.TorchFunctionMode):
    """A mode over a module's runs whose first run notes its outermost floating calls' names, and whose later runs
    meet each call with the target's site :func:`_pair` gives it (:meth:`_site`)."""

    def __init__(self, target: list[Site]):
        super().__init__()
        self.target = target
        self.names: list[str] = []
        self.kernels: list[Site | None] | None = None  # per call of the float64 runs, its target site
        self.index = 0

    def __enter__(self):
        self.index = 0
        return super().__enter__()

    def _site(self, func) -> Site | None:
        """The target's site of the call ``func`` makes now (``None`` in the first run, where this run took
        another path than it, or where no site pairs it)."""
        if self.kernels is None:
            return None
        site = self.kernels[self.index] if self.index < len(self.kernels) else None
        return None if site is not None and self.names[self.index] != _name(func) else site

    def _as_it_is(self, func, args, kwargs):
        """The call run as it is; its name noted in the first run, the run's place in the plan moved on after."""
        out = func(*args, **kwargs)
        if _floating(out):
            if self.kernels is None:
                self.names.append(_name(func))
            else:
                self.index += 1
        return out


class Sites(_Paired):
    """The budget's float64 runs of a module whose target ran under autocast (see the module docstring).

    Args:
        target: the target run's sites (:func:`record_sites`).
        own: the dtype the module's budget rounds as (its :func:`~.budgets.perturbation`'s target dtype).
        precision: ``dtype -> (eta, held, tiny, floor)`` of a kernel computing in ``dtype``
            (:func:`~.budgets.precision_of` for the budget's run dtype and device).
        generator: the draws of the casts' roundings.

    The first run through this mode (the unperturbed one) only notes the calls' names; :meth:`plan` then pairs
    them with ``target``, and every later run rounds as the plan says. Entered around the module's forward, with
    :class:`~.perturb.Perturb` (and :class:`~.attention.FusedAttention`) already active.
    """

    def __init__(self, target: list[Site], own: torch.dtype, precision: Callable[[torch.dtype], tuple],
                 generator: torch.Generator):
        super().__init__(target)
        self.own, self.precision, self.generator = own, precision, generator
        self.fallback: torch.dtype | None = None  # every call in this dtype (:meth:`everywhere`)

    # ------------------------------------------------------------------------------------------------- pairing
    @classmethod
    def everywhere(cls, dtype: torch.dtype, own: torch.dtype, precision: Callable[[torch.dtype], tuple],
                   generator: torch.Generator) -> "Sites":
        """Every call rounded as a kernel of ``dtype`` (the autocast dtype), every input charged autocast's cast:
        where the target's calls could not be run again to note theirs, a budget no tighter than any the target's
        sites would give."""
        sites = cls([], own, precision, generator)
        sites.fallback = dtype
        return sites

    def plan(self) -> dict:
        """Pair the noted float64 calls with the target's sites; returns ``{"paired", "unpaired", "low"}`` counts
        (``low``: calls that computed in another dtype than the module's)."""
        if self.fallback is not None:
            self.kernels = [Site(n, self.fallback, None) for n in self.names]
            return {"paired": 0, "unpaired": len(self.names), "low": len(self.names)}
        kernels, unpaired = _pair(self.names, self.target)
        self.kernels = kernels
        low = sum(1 for s in kernels if s is not None and s.kernel != self.own)
        return {"paired": len(self.names) - unpaired, "unpaired": unpaired, "low": low}

    # --------------------------------------------------------------------------------------------------- calls
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        site = self._site(func)  # None in the unperturbed run: names only
        if site is None or not site.kernel.is_floating_point or \
                (site.kernel == self.own and not _casts(site)):
            return self._as_it_is(func, args, kwargs)
        low = site.kernel != self.own
        precision = self.precision(site.kernel)
        wider = iter(site.inputs if site.inputs is not None else ())

        def cast(t: torch.Tensor) -> torch.Tensor:
            # autocast's cast of an input held wider than the kernel's dtype: one rounding to that dtype (every
            # input where the target's dtypes are unknown, :meth:`everywhere`)
            was = next(wider, None) if site.inputs is not None else torch.float64
            if was is None or torch.finfo(was).eps >= torch.finfo(site.kernel).eps:
                return t
            # the cast's backward hands the gradient back exactly: the rounding is the value's alone (an
            # infinity, a mask's -inf, stays itself: -inf - -inf would be NaN)
            with _disable_current_modes():  # its arithmetic is no kernel of the budget's modes
                d = t.detach()
                moved = jitter(d, precision[0], self.generator, precision[3]) - d
                return t + torch.where(torch.isfinite(d), moved, torch.zeros_like(d))
        before = {id(t.grad_fn) for t in tensors_of((args, kwargs)) if t.grad_fn is not None}
        leaf_args = cast_all(tuple(args), lambda t: cast(t) if t.is_floating_point() else t)
        leaf_kwargs = {k: cast_all(v, lambda t: cast(t) if t.is_floating_point() else t) for k, v in kwargs.items()}
        with computed_in(precision):
            out = func(*leaf_args, **leaf_kwargs)
        if _floating(out):
            self.index += 1
        if low and torch.is_grad_enabled():
            _round_backward(out, before | {id(t.grad_fn) for t in tensors_of((leaf_args, leaf_kwargs))
                                           if t.grad_fn is not None}, precision, self.generator)
        return out


def _casts(site: Site) -> bool:
    """Whether autocast cast an input of the call down to the dtype it computed in (an fp32 weight of a GEMM whose
    other input already was bf16: the module rounds as bf16, the weight's cast is a rounding all the same)."""
    if site.inputs is None:
        return True
    narrow = torch.finfo(site.kernel).eps
    return any(torch.finfo(d).eps < narrow for d in site.inputs)


def _round_backward(out: Any, before: set, precision: tuple, generator: torch.Generator) -> None:
    """Every autograd node a low-precision call made (from its outputs back to the nodes its inputs came with)
    runs as a kernel of that dtype, and the gradients its outputs receive are rounded to it first."""
    outs = [t for t in _floating(out) if t.grad_fn is not None]
    if not outs:
        return
    heads = {id(t.grad_fn) for t in outs}
    seen: dict[int, Any] = {}
    todo = [t.grad_fn for t in outs]
    while todo and len(seen) < 10_000:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in before or type(node).__name__ == "AccumulateGrad":
            continue
        seen[id(node)] = node
        todo.extend(n for n, _ in node.next_functions)

    def pre(node):
        def hook(grad_outputs):
            _entered().append(_set(precision))
            if id(node) in heads:
                with _disable_current_modes():
                    return tuple(jitter(g, precision[0], generator, precision[3]) if isinstance(g, torch.Tensor)
                                 else g for g in grad_outputs)
            return None
        return hook

    def post(grad_inputs, grad_outputs):
        if _entered():
            _set(_entered().pop())
    for node in seen.values():
        node.register_prehook(pre(node))
        node.register_hook(post)


_STATE = threading.local()  # the precisions the running backward nodes replaced, innermost last


def _entered() -> list:
    if not hasattr(_STATE, "entered"):
        _STATE.entered = []
    return _STATE.entered


def _set(precision: tuple | None) -> tuple | None:
    """Make ``precision`` the running kernel's (:func:`~.perturb.computed_in`); returns the one it replaced."""
    before = _precision()
    _KERNEL.precision = precision
    return before


def settle() -> None:
    """Every precision a backward node set is undone (after a budget's run, whether its backward finished or
    raised)."""
    entered = _entered()
    if entered:
        _KERNEL.precision = entered[0]
        entered.clear()


class Ranges(_Paired):
    """An oracle's run of a module that keeps the range of the dtypes the target held its tensors in.

    The oracle computes a module in float64 (float32 for a bf16/fp16-only one), where no intermediate overflows.
    The target holds each call's result in the dtype that call computed in (:class:`Site`), and the gradient each of
    them receives in the same dtype: an fp16 one cannot hold 65,520 or more, whatever the kernel. A LeViT MLP under
    fp16 autocast with a ``GradScaler`` (Linear into a training BatchNorm1d over two samples, one channel's
    variance 2e-8 next to eps 1e-5) hands its Linear a gradient of 887,000 at a loss scale of 256: every correct
    fp16 run overflows there, the scaler skips the step, and the module's input gradient is NaN. The float64 oracle
    returned finite values and the module failed ("inf/nan positions differ") at every step of its own loop.

    So, like :class:`Sites`, the first run through this mode notes the calls' names; :meth:`plan` pairs them with
    the target's; every later run turns each finite value past the paired site's dtype into the infinity a
    rounding to that dtype gives, in the call's result, in the inputs autocast cast down to it, and in the gradient
    the result receives. Values within the range keep the oracle's precision; the result carries the gradient
    straight through, as a cast does. :attr:`moved` counts the values turned.

    Args:
        target: the target run's sites (:func:`record_sites`).
    """

    def __init__(self, target: list[Site]):
        super().__init__(target)
        self.moved = 0

    def plan(self) -> None:
        """Pair the noted calls with the target's sites (:func:`_pair`)."""
        self.kernels, _ = _pair(self.names, self.target)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        site = self._site(func)  # None in the first run: names only
        if site is None or not site.kernel.is_floating_point:
            return self._as_it_is(func, args, kwargs)
        dtype = site.kernel
        wider = iter(site.inputs if site.inputs is not None else ())

        def cast(t: torch.Tensor) -> torch.Tensor:
            was = next(wider, None)
            if was is None or not was.is_floating_point or torch.finfo(was).max <= torch.finfo(dtype).max:
                return t
            return self._held(t, dtype, hook=False)
        given = {id(t) for t in tensors_of((args, kwargs))}
        args = cast_all(tuple(args), lambda t: cast(t) if t.is_floating_point() else t)
        kwargs = {k: cast_all(v, lambda t: cast(t) if t.is_floating_point() else t) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if not _floating(out):
            return out
        self.index += 1
        # an in-place call's result is a tensor it was given, held already where it was made
        given |= {id(t) for t in tensors_of((args, kwargs))}
        return cast_all(out, lambda t: self._held(t, dtype) if t.is_floating_point() and id(t) not in given else t)

    def _past(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Where ``t``'s finite values round to an infinity in ``dtype``; ``None`` where none does."""
        if torch.finfo(t.dtype).max <= torch.finfo(dtype).max or not t.numel():
            return None
        d = t.detach()
        past = torch.isfinite(d) & torch.isinf(d.to(dtype))
        return past if bool(past.any()) else None

    def _held(self, t: torch.Tensor, dtype: torch.dtype, hook: bool = True) -> torch.Tensor:
        """``t`` with its values past ``dtype``'s range turned to infinities (the gradient straight through), and
        with ``hook``, the gradient it receives held so too."""
        if torch.finfo(t.dtype).max <= torch.finfo(dtype).max:
            return t
        with _disable_current_modes():  # its arithmetic is no call of the module's
            past = self._past(t, dtype)
            if past is not None:
                self.moved += int(past.sum())
                d = t.detach()
                t = t + torch.where(past, d.sign() * float("inf"), torch.zeros_like(d))
        if hook and t.requires_grad:
            t.register_hook(lambda g: self._held_grad(g, dtype))
        return t

    def _held_grad(self, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        with _disable_current_modes():
            past = self._past(g, dtype)
            if past is None:
                return None
            self.moved += int(past.sum())
            return torch.where(past, g.sign() * float("inf"), g)

