"""A batch-wise loss's vector-Jacobian product computed a piece of its batch at a time.

An oracle's gradient of a language model's loss is the largest product isolation makes: ``F.cross_entropy`` over
the logits (tokens x vocabulary) in float64 holds, inside one ``autograd.grad``, the input's float64 copy, the
log-softmax it saved, the loss's dense gradient into it and the result, four tensors the logits' size (4 x 411 MB
for GPT-2 at 1,024 tokens; Llama 3's 128,256-word vocabulary at 4,096 tokens, 4 x 4.2 GB), the peak of the whole
check on the CPU (``docs/development.md``, where the CPU check's memory peaks).

``F.cross_entropy`` and ``F.nll_loss`` with class-index targets treat the rows of their input (dimension 0)
independently, and their ``mean`` divides the rows' sum by a constant of the targets alone: the total weight of the
targets that are not ``ignore_index`` (their count without ``weight``; PyTorch's ``total_weight``, also for
label smoothing). The gradient of row ``i`` is then the gradient of the call with ``reduction="none"`` on that row
for the incoming gradient ``grad / total_weight`` (``grad`` for ``sum``, its own row's for ``none``), which is
exactly how PyTorch's ``nll_loss`` backward scales it, so each piece's product holds only the piece's rows and the
result is written into one tensor the input's size (the float64 product of GPT-2's loss above: 1,609 -> 481 MB).
Float64 results equal the whole call's to its roundoff (bit for bit without ``weight`` and label smoothing).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

#: elements of a CPU input a piece holds (4 MB in float64: under glibc's default policy larger pieces fragment the
#: heap, measured on the loss above: 8 rows of 50,257 peaked at 70 MB over the result, 64 rows at 440 MB)
PIECE_ELEMENTS = 1 << 19
#: elements of an accelerator's input a piece holds (128 MB in float64: each piece is a dozen kernel launches, and a
#: caching allocator reuses its blocks)
DEVICE_PIECE_ELEMENTS = 1 << 24
#: inputs smaller than this are computed whole (128 MB in float64: too little to save for the pieces' host time)
MIN_ELEMENTS = 1 << 24

_LOSSES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}


class LossPieces:
    """A batch-wise loss call (``F.cross_entropy``/``F.nll_loss``, class-index targets) cut along dimension 0.

    Built by :func:`loss_pieces`, which decides whether a call may be cut.

    Attributes:
        func: the loss.
        rows: the input's size along dimension 0.
        step: rows per piece.
    """

    def __init__(self, func, bound: inspect.BoundArguments, rows: int, step: int):
        self.func, self._bound, self.rows, self.step = func, bound, rows, step
        self._totals: dict = {}

    def piece(self, start: int, stop: int) -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` for rows ``start:stop``, with ``reduction="none"`` (views of the inputs,
        no copy)."""
        a = self._bound.arguments
        kw = {k: v for k, v in a.items() if k not in ("input", "target", "size_average", "reduce")}
        kw["reduction"] = "none"
        return (a["input"][start:stop], a["target"][start:stop]), kw

    def total_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``mean``'s divisor in ``dtype`` (0-dim, on the input's device): the weight of the targets that are
        not ``ignore_index``, their count without ``weight`` (PyTorch's ``nll_loss`` ``total_weight``)."""
        a = self._bound.arguments
        target, weight = a["target"], a.get("weight")
        kept = target != a.get("ignore_index", -100)
        if weight is None:
            return kept.sum().to(dtype)
        return weight.detach().to(dtype)[target[kept]].sum()

    def grad(self, grad_out: torch.Tensor, start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
        """The incoming gradient of the piece ``start:stop`` whose ``reduction="none"`` output is ``like``: the
        call's scalar gradient divided by :meth:`total_weight` (``mean``) or as it is (``sum``), in ``like``'s
        dtype and device, or the piece's rows of the call's own (``none``)."""
        reduction = self._bound.arguments.get("reduction", "mean")
        g = grad_out.detach().to(device=like.device, dtype=like.dtype)
        if reduction == "none":
            return g[start:stop]
        if reduction == "mean":
            key = (like.dtype, like.device)
            if key not in self._totals:  # once per product, not per piece
                self._totals[key] = self.total_weight(like.dtype).to(like.device)
            g = g / self._totals[key]
        return g.expand(like.shape)

    def vjp(self, run: Callable[[tuple, dict], tuple], grad_out: torch.Tensor, context=None) -> list:
        """The gradient w.r.t. the input, piece by piece, as :func:`~.references.vjp` returns it (one entry: the
        input is the call's only leaf).

        Args:
            run: ``run(args, kwargs) -> (leaves, out)``: the call on copies of a piece's inputs, with its graph
                (:func:`~.references.reference` in the precision and on the device the product is wanted in).
            grad_out: the gradient the call's output received (0-dim for ``mean``/``sum``).
            context: as for :func:`~.references.vjp` (each piece's product runs in it).

        Returns:
            ``[gradient]``: the input's shape, in the run's dtype and device.
        """
        from .references import vjp

        result = None
        for start in range(0, self.rows, self.step):
            stop = min(start + self.step, self.rows)
            leaves, out = run(*self.piece(start, stop))
            g = vjp(out, leaves, {0: self.grad(grad_out, start, stop, out)}, context, retain=False)[0]
            del leaves, out
            if result is None:
                shape = (self.rows, *self._bound.arguments["input"].shape[1:])
                result = torch.zeros(shape, dtype=g.dtype if g is not None else torch.float64,
                                     device=g.device if g is not None else "cpu")
            if g is not None:
                result[start:stop] = g
        return [result]


def loss_pieces(func, args: tuple, kwargs: dict, grad_out: dict, min_elements: int | None = None,
                piece_elements: int | None = None) -> LossPieces | None:
    """The call cut into pieces of its batch, or ``None`` where it is computed whole: not ``F.cross_entropy``/
    ``F.nll_loss``, an input under ``min_elements`` or of one row, probability targets, a ``weight`` that requires
    grad, the legacy ``size_average``/``reduce``, a ``mean`` whose targets are all ignored (PyTorch's 0/0), or an
    incoming gradient of another shape than the output's.

    Args:
        func: the API as captured (the Python function).
        args, kwargs: its arguments as the call received them.
        grad_out: ``{output index: gradient}`` the call's output received (:func:`~.references.vjp`'s).
        min_elements: the smallest input cut (default :data:`MIN_ELEMENTS`).
        piece_elements: the input elements a piece holds, at least one row (default :data:`PIECE_ELEMENTS` for a
            CPU input, :data:`DEVICE_PIECE_ELEMENTS` for another).
    """
    min_elements = MIN_ELEMENTS if min_elements is None else min_elements
    sig = _LOSSES.get(func)
    if sig is None or set(grad_out) != {0}:
        return None
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    a = bound.arguments
    x, target, weight = a.get("input"), a.get("target"), a.get("weight")
    reduction = a.get("reduction", "mean")
    if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2 and x.numel() >= min_elements
            and isinstance(target, torch.Tensor) and not target.is_floating_point() and not target.is_complex()
            and target.dim() == x.dim() - 1 and target.shape[0] == x.shape[0] and x.shape[0] > 1
            and reduction in ("mean", "sum", "none") and a.get("size_average") is None and a.get("reduce") is None
            and not (isinstance(weight, torch.Tensor) and weight.requires_grad)):
        return None
    g = grad_out[0]
    if not isinstance(g, torch.Tensor) or (reduction == "none" and tuple(g.shape) != tuple(target.shape)) or \
            (reduction != "none" and g.numel() != 1):
        return None
    if piece_elements is None:
        piece_elements = PIECE_ELEMENTS if x.device.type == "cpu" else DEVICE_PIECE_ELEMENTS
    pieces = LossPieces(func, bound, x.shape[0], max(1, piece_elements // max(1, x[0].numel())))
    if reduction == "mean" and not bool(pieces.total_weight(torch.float64) != 0):
        return None
    return pieces

