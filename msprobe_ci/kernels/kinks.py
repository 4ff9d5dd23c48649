"""Kinks: where a module's result changes by a step for a move of its input within a rounding (a ReLU whose input
lies within a rounding of 0), and the oracle that lands on the target's side of them.

A whole module (L0, a compiled region) is judged against a float64 run of it from the target's own inputs. Inside
it, the input of a ReLU is an intermediate: the target computed it in its own dtype, and where it lies within a
rounding of the kink, a correct kernel lands on either side. The forward moves by that tiny value only, but the
backward's mask flips, and every gradient the unit feeds moves by a whole term: T5's encoder feed-forward under bf16
autocast (its GEMMs' inputs cast to bf16, which moves a pre-activation by about a rounding of its terms) handed back
an input gradient whose row for one token was 45.9 times the max relative error allowed, with no fault. The budget's
draws (:class:`~.budgets._Spread`) credit a flip that one of them shows; one that none of 8 shows is a rare event a
correct kernel still has among thousands of units.

So a failing module is judged once more against the oracle run again with every kink input that lies within
:data:`SPREADS` of its spread (the RMS of the budget's draws there, :class:`Spread`) of a kink, and on the other side
of it than the target's own value (a run of the module as the target ran it, :class:`Record`), mirrored across the
kink (:class:`Force`): the oracle takes the side the target took, its distance from the kink its own. A fault that
moves a value by more than that is judged as before; a fault's flips within a rounding are not what it is judged by.

The kinks known (:data:`KINKS`): ReLU, ReLU6 and hardtanh, leaky ReLU, threshold, clamp with number bounds, abs;
each read from its ``torch`` call (a :class:`torch.overrides.TorchFunctionMode`), whichever of its names the code
calls (``torch.nn.functional.relu``, ``torch.relu``, ``Tensor.relu``, their in-place forms). And selections: a
``topk`` (an MoE router), a ``max``/``min``/``argmax``/``argmin`` along a dim, where the target chose other elements
of a row than the oracle and every pair the two choices differ by lies within :data:`SPREADS` of their combined
spread: the oracle's values of each pair are swapped (:func:`_selection_step`). Ties of a max-pool's windows are
not modelled.

The target's side is read off a run of the module made for it: in the target's dtypes, on its device, under its
autocast, with gradients enabled and parameters requiring grad where the target's did (a CPU kernel may take another
path for them: T5's attention under bf16 autocast moved a ReLU input from 0.00081 to -0.00007 in a run without), and
without the faults a test injects (as the budget's autocast sites are).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .amp_sites import _name

#: how far from a kink, in units of the spread of the budget's draws at that element, the target's side is taken as
#: a correct kernel's outcome. A Gaussian error reaches 6 of its RMS in 2e-9 of the elements; a spread from 8 draws
#: is under half the true one in about 1% of the elements (chi with 8 degrees of freedom), which still leaves 2.7 true
#: spreads
SPREADS = 6.0


def _relu(args, kwargs):
    return [0.0]


def _hardtanh(args, kwargs):
    lo = kwargs.get("min_val", args[1] if len(args) > 1 else -1.0)
    hi = kwargs.get("max_val", args[2] if len(args) > 2 else 1.0)
    return [lo, hi]


def _relu6(args, kwargs):
    return [0.0, 6.0]


def _threshold(args, kwargs):
    return [kwargs.get("threshold", args[1] if len(args) > 1 else None)]


def _clamp(args, kwargs):
    lo = kwargs.get("min", args[1] if len(args) > 1 else None)
    hi = kwargs.get("max", args[2] if len(args) > 2 else None)
    return [lo, hi]


def _clamp_min(args, kwargs):
    return [kwargs.get("min", args[1] if len(args) > 1 else None)]


def _clamp_max(args, kwargs):
    return [kwargs.get("max", args[1] if len(args) > 1 else None)]


def _arg(args, kwargs, i, key, default):
    return kwargs.get(key, args[i] if len(args) > i else default)


def _topk(args, kwargs):
    return _Select(int(_arg(args, kwargs, 1, "k", 1)), int(_arg(args, kwargs, 2, "dim", -1)),
                   bool(_arg(args, kwargs, 3, "largest", True)))


def _arg_select(largest):
    def points(args, kwargs):
        dim = _arg(args, kwargs, 1, "dim", None)
        if not isinstance(dim, int) or isinstance(dim, bool):  # over the whole tensor: one element, no row
            return None
        return _Select(1, dim, largest)
    return points


class _Select(tuple):
    """A selection's kink: ``(k, dim, largest)`` of a ``topk`` (``max``/``argmax`` along a dim: k = 1)."""

    def __new__(cls, k: int, dim: int, largest: bool):
        return super().__new__(cls, (k, dim, largest))


#: ``torch`` call name (:func:`torch.overrides.resolve_name`) -> ``(kink points of (args, kwargs), in place)``.
#: A point that is not a number (a tensor bound of clamp, ``None``) is no kink here
KINKS: dict[str, tuple[Callable[[tuple, dict], list], bool]] = {}
for _names, _points in (
        (("torch.nn.functional.relu", "torch.relu", "torch.Tensor.relu"), _relu),
        (("torch.nn.functional.leaky_relu",), _relu),
        (("torch.nn.functional.relu6",), _relu6),
        (("torch.nn.functional.hardtanh",), _hardtanh),
        (("torch.nn.functional.threshold",), _threshold),
        (("torch.clamp", "torch.Tensor.clamp", "torch.clip", "torch.Tensor.clip"), _clamp),
        (("torch.clamp_min", "torch.Tensor.clamp_min"), _clamp_min),
        (("torch.clamp_max", "torch.Tensor.clamp_max"), _clamp_max),
        (("torch.abs", "torch.Tensor.abs", "torch.Tensor.__abs__", "torch.absolute"), _relu)):
    for _n in _names:
        KINKS[_n] = (_points, False)
        if not _n.endswith("__"):
            KINKS[_n + "_"] = (_points, True)
for _n, _points in (("torch.topk", _topk), ("torch.Tensor.topk", _topk),
                   ("torch.max", _arg_select(True)), ("torch.Tensor.max", _arg_select(True)),
                   ("torch.argmax", _arg_select(True)), ("torch.Tensor.argmax", _arg_select(True)),
                   ("torch.min", _arg_select(False)), ("torch.Tensor.min", _arg_select(False)),
                   ("torch.argmin", _arg_select(False)), ("torch.Tensor.argmin", _arg_select(False))):
    KINKS[_n] = (_points, False)


def _kink_of(func, args: tuple, kwargs: dict) -> tuple[str, torch.Tensor, list[float], bool] | None:
    """``(name, input, kink points, in place by name)`` of a kink call, ``None`` for any other call (or a kink call whose
    input is no floating tensor, or that has no number as a kink point)."""
    name = _name(func)
    entry = KINKS.get(name)
    if entry is None or not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        return None
    points_of, in_place = entry
    in_place = in_place or bool(kwargs.get("inplace", False))
    try:
        points = points_of(args, kwargs)
        if isinstance(points, _Select):
            return name, args[0], points, False
        points = [float(p) for p in points or () if isinstance(p, (int, float)) and not isinstance(p, bool)]
    except (IndexError, TypeError, ValueError):
        return None
    if not points:
        return None
    return name, args[0], points, in_place


def _nearest(x: torch.Tensor, points: list[float]) -> torch.Tensor:
    """Per element of ``x`` (float64), the kink point nearest to it."""
    best = torch.full_like(x, points[0])
    for p in points[1:]:
        best = torch.where((x - p).abs() < (x - best).abs(), torch.full_like(x, p), best)
    return best


class Record(torch.overrides.TorchFunctionMode):
    """Notes the input of every outermost kink call a run makes, as float64 ``(name, points, values)`` in call
    order (:attr:`sites`); with ``spread``, adds each run's to it instead (:meth:`Spread.add`)."""

    def __init__(self, spread: "Spread | None" = None):
        super().__init__()
        self.sites: list[tuple[str, list[float], torch.Tensor]] = []
        self.spread = spread

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kink = _kink_of(func, args, kwargs)
        if kink is not None:
            name, x, points, _ = kink
            with _disable_current_modes():  # no kernel of a budget's modes: its draws stay as they were
                self.sites.append((name, points, x.detach().to(torch.float64, copy=True)))
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self.spread is not None and exc[0] is None:
            self.spread.add(self.sites)
            self.sites = []
        return out


class Spread:
    """The spread of a module's kink inputs over a budget's runs: the first run (unperturbed) gives each kink's
    values, every later one (a draw) adds its squared move; :meth:`sigma` is their RMS. A draw whose kink calls
    differ in name or shape from the first run's adds nothing at that kink."""

    def __init__(self):
        self.base: list[tuple[str, list[float], torch.Tensor]] | None = None
        self.squares: list[torch.Tensor | None] = []
        self.counts: list[int] = []
        self.draws = 0

    def record(self) -> Record:
        """A :class:`Record` for one run of the budget, whose sites are added here when the run ends."""
        return Record(self)

    def add(self, sites: list) -> None:
        if self.base is None:
            self.base = sites
            self.squares = [None] * len(sites)
            self.counts = [0] * len(sites)
            return
        self.draws += 1
        with _disable_current_modes():  # the budget's modes may still be active around the run that ended
            for i, (name, _, x) in enumerate(sites[:len(self.base)]):
                b_name, _, b = self.base[i]
                if name != b_name or x.shape != b.shape:
                    continue
                sq = (x - b) ** 2
                self.squares[i] = sq if self.squares[i] is None else self.squares[i] + sq
                self.counts[i] += 1

    def sigma(self, i: int) -> torch.Tensor | None:
        """The RMS move of kink ``i``'s input over the draws that met it (float64, its shape), ``None`` where no
        draw met it as the first run did (same name, same shape at its place in the order)."""
        if i >= len(self.squares) or self.squares[i] is None:
            return None
        with _disable_current_modes():
            return (self.squares[i] / self.counts[i]).sqrt()

    def __len__(self) -> int:
        return len(self.base or ())


class Force(torch.overrides.TorchFunctionMode):
    """The oracle's run on the target's side of its kinks (see the module docstring).

    Args:
        target: the target run's kink inputs (:attr:`Record.sites`, in its call order).
        spread: the budget's draws at the oracle's kinks (:class:`Spread`, in the same order).
        spreads: how many spreads from a kink the target's side is taken (:data:`SPREADS`).

    :attr:`moved` counts the elements put on the other side. A kink call whose name or shape differs from the
    target's or the spread's at its place in the order is run as it is.
    """

    def __init__(self, target: list, spread: Spread, spreads: float = SPREADS):
        super().__init__()
        self.target, self.spread, self.spreads = target, spread, spreads
        self.index = 0
        self.moved = 0

    def __enter__(self):
        self.index, self.moved = 0, 0
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kink = _kink_of(func, args, kwargs)
        if kink is None:
            return func(*args, **kwargs)
        i = self.index
        self.index += 1
        name, x, points, in_place = kink
        sigma = self.spread.sigma(i)
        if i >= len(self.target) or sigma is None or self.target[i][0] != name or \
                self.target[i][2].shape != x.shape or sigma.shape != x.shape:
            return func(*args, **kwargs)
        theirs = self.target[i][2].to(x.device)
        if isinstance(points, _Select):
            with torch.no_grad(), _disable_current_modes():
                step, n = _selection_step(x.detach().to(torch.float64), theirs, sigma.to(x.device), points,
                                          self.spreads)
            if n == 0:
                return func(*args, **kwargs)
            self.moved += n
            with _disable_current_modes():
                forced = x + step.to(x.dtype)
            return func(forced, *args[1:], **kwargs)
        with torch.no_grad(), _disable_current_modes():
            ours = x.detach().to(torch.float64)
            kink_at = _nearest(ours, points)
            distance = (ours - kink_at).abs()
            side_t, side_o = theirs > kink_at, ours > kink_at
            flip = (side_t != side_o) & (distance <= self.spreads * sigma.to(x.device))
            n = int(flip.sum())
            if n == 0:
                return func(*args, **kwargs)
            self.moved += n
            # the target's side, the oracle's distance (the target's own where the oracle sits on the kink)
            away = torch.where(distance > 0, distance, (theirs - kink_at).abs())
            mirrored = torch.where(side_t, kink_at + away, kink_at - away)
            step = torch.where(flip, mirrored - ours, torch.zeros_like(ours)).to(x.dtype)
        with _disable_current_modes():
            forced = x + step  # the value moves, the gradient passes as it would through x
        result = func(forced, *args[1:], **kwargs)
        if in_place or result is forced:  # an in-place form wrote into the copy: the caller's tensor holds it
            return x.copy_(result)
        return result


#: rows of a selection looked at one by one at most (a fault that reorders every row is judged as it is)
SELECT_ROWS = 4096


def _selection_step(ours: torch.Tensor, theirs: torch.Tensor, sigma: torch.Tensor, select: _Select,
                    spreads: float) -> tuple[torch.Tensor, int]:
    """``(step, moved)``: the move of a selection's input (float64, its shape) that makes the oracle select what the
    target selected, in the target's order, in each row where that is a permutation of the oracle's own values
    among the elements involved, each element taking the value of one within ``spreads`` of their combined spread
    (the oracle's set of values, the target's choice and order: a router's indices are compared as they are), and
    the number of elements moved."""
    k, dim, largest = select
    sign = 1.0 if largest else -1.0
    o, t, sg = (v.movedim(dim, -1) for v in (ours, theirs, sigma))
    n = o.shape[-1]
    if not 0 < k <= n:
        return torch.zeros_like(ours), 0
    o2, t2, s2 = o.reshape(-1, n), t.reshape(-1, n), sg.reshape(-1, n)
    order_o = (sign * o2).topk(k, dim=1).indices
    order_t = (sign * t2).topk(k, dim=1).indices
    rows = torch.nonzero((order_o != order_t).any(dim=1)).flatten()[:SELECT_ROWS]
    new = o2.clone()
    moved = 0
    for r in rows.tolist():
        mine, theirs_r = order_o[r].tolist(), order_t[r].tolist()
        # rank by rank, the target's element takes the oracle's value of that rank; an element the oracle chose
        # and the target did not takes the value of one the target chose and the oracle did not
        source = dict(zip(theirs_r, mine))
        source.update(zip([x for x in mine if x not in theirs_r], [x for x in theirs_r if x not in mine]))
        pairs = [(e, src) for e, src in source.items() if e != src]
        dst = torch.tensor([e for e, _ in pairs])
        src = torch.tensor([x for _, x in pairs])
        gap = (o2[r, dst] - o2[r, src]).abs()
        if not bool((gap <= spreads * torch.sqrt(s2[r, dst] ** 2 + s2[r, src] ** 2)).all()):
            continue
        new[r, dst] = o2[r, src]
        moved += len(pairs)
    step = (new - o2).reshape(o.shape).movedim(-1, dim)
    return step, moved
