"""How much of a run's floating-point work the capture saw: the coverage figure written beside every dump.

An API-level capture judges the torch APIs it records. Whatever computes outside them (a private function nobody
listed, a custom op, a C++ extension, an op reached without ``__torch_function__``) is invisible to the per-API
verdicts: a kernel error there can only show up as drift of an enclosing module. This module measures it at the
ATen level, where every op is seen whichever Python API issued it:

* the **work** of an ATen op is the number of floating-point elements it writes (its floating outputs' ``numel``);
* it is **captured** when it ran inside a recorded API call: in the forward pass while the call runs (its fault,
  where one is planned, included), in the backward pass while autograd runs a node that call created;
* data movement, views, creation and metadata (:data:`MOVES`, view ops) and integer or bool outputs are not
  floating-point work: they are listed with their call counts, not counted. So is their backward
  (:func:`routes_gradients`): it routes gradients and sums the contributions of a value used more than once (a
  tensor sliced into q, k and v, an expanded bias), as does autograd at the capture's own module-boundary nodes;
  and the accumulation of a leaf's ``.grad`` (``AccumulateGrad``), whose result the ``parameters_grad`` records
  hold; a ``GradScaler``'s update of its loss scale (bookkeeping a user's own step runs); and communication
  (functional collectives, which DTensor issues in its redistributions: torch.distributed
  calls are recorded as ``Distributed.*``);
* what the capture machinery itself runs (statistics, the isolation's oracle and bench, the writer) is not seen.

``share = captured / (captured + uncaptured)`` elements, with the uncaptured ops by name, pass and count.
"""

from __future__ import annotations

import collections
import functools
import re
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels.choice import grad_fn_of, tensors_of

# ATen ops that move, copy, select or create values without arithmetic (overload packet names)
MOVES = frozenset("""
_to_copy to_copy copy_ clone contiguous detach detach_ lift_fresh lift_fresh_copy alias _unsafe_view _reshape_copy cat stack
index index_select gather index_put index_put_ _index_put_impl_ _unsafe_index masked_fill masked_fill_ where
constant_pad_nd repeat expand_copy slice_scatter select_scatter as_strided_scatter scatter scatter_ unfold tril triu
tril_ triu_ flip roll masked_select masked_scatter embedding narrow_copy split_with_sizes_copy split_copy
transpose_copy permute_copy t_copy view_copy unsqueeze_copy squeeze_copy set_ resize_ resize_as_ empty empty_like
empty_strided new_empty new_empty_strided zeros zeros_like ones ones_like full full_like new_zeros new_ones new_full
fill fill_ zero_ arange linspace logspace scalar_tensor eye rand rand_like randn randn_like randint randint_like
randperm normal normal_ uniform_ bernoulli bernoulli_ random_ exponential_ _local_scalar_dense sort topk max min
amax amin kthvalue median mode max_pool2d_with_indices max_pool1d max_pool3d_with_indices unique _unique2 nonzero
one_hot slice_backward select_backward index_select_backward _assert_async _assert_tensor_metadata _functional_assert_async sym_size sym_stride sym_numel
""".split())


# a GradScaler's loss-scale bookkeeping (growing or backing off its scale from the found-inf flag), which the user's
# own training step runs between the model's calls: not the model's arithmetic
_BOOKKEEPING = frozenset(("_amp_update_scale", "_amp_update_scale_"))

# view ops (by name) whose backward nodes route gradients: with MOVES, the data movement whose backward is
# gradient routing and fan-in (a sliced tensor's slices, an expanded tensor's sum)
_VIEWS = frozenset("""
view slice select expand transpose permute t unsqueeze squeeze reshape_alias as_strided split split_with_sizes unbind
narrow diagonal alias unfold chunk view_as_real view_as_complex unsafe_view reshape
""".split())
# nodes that only move gradients: the capture's own autograd plumbing (module-boundary aliases, module backward
# hooks) and DTensor's conversions between local tensors and distributed ones (their redistribution in the backward
# is communication, below)
_PLUMBING_NODES = frozenset(("_AliasBackward", "BackwardHookFunctionBackward", "_FromTorchTensorBackward",
                             "_ToTorchTensorBackward"))
# op namespaces of communication: collectives are recorded as Distributed.* where torch.distributed is called;
# the functional ones DTensor issues inside its redistributions are listed, not counted
_COMMUNICATION = frozenset(("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d"))
# op namespaces of data movement: FSDP2's copies into and out of its communication buffers (``fsdp::``
# ``all_gather_copy_in``, ``split_with_sizes_copy``, ``chunk_cat``: shards copied, padded and cast, in
# ``torch.distributed.fsdp._fully_shard._fsdp_collectives``), as ``cat`` and ``_to_copy`` are movement
_MOVING_NAMESPACES = frozenset(("fsdp",))


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


@functools.lru_cache(maxsize=1024)
def routes_gradients(node_type: str) -> bool:
    """Whether a backward node (by type name, ``SliceBackward0``) belongs to data movement or to the capture's
    plumbing: its backward moves gradients and sums the contributions of a value used more than once."""
    if node_type in _PLUMBING_NODES:
        return True
    op = _snake(re.sub(r"Backward\d*$", "", node_type))
    return op in _VIEWS or op in MOVES or f"_{op}" in MOVES


_QUIET = [0]  # > 0 while a hook of the capture or the isolation runs
_TAG = "msprobe_ci.coverage"  # the key of a captured call's autograd nodes in their metadata
_ACTIVE: list = []  # the Coverage modes of the running capture sessions


def quiet(fn):
    """``fn`` (a hook of the capture or of the isolation) with its ATen ops left out of the coverage count:
    statistics of a module's gradients, the isolation's backward oracle, are the machinery's work, not the
    model's. The mode steps off the dispatch stack meanwhile, so those ops do not pass through Python."""
    def wrapper(*args, **kwargs):
        _QUIET[0] += 1
        off = [c for c in _ACTIVE if c.suspend()]
        try:
            return fn(*args, **kwargs)
        finally:
            for c in reversed(off):
                c.resume()
            _QUIET[0] -= 1
    # named after ``fn`` (a traceback's frame), without functools.wraps's copying: wrapped once per hooked call
    wrapper.__name__ = getattr(fn, "__name__", "quiet")
    wrapper.__qualname__ = getattr(fn, "__qualname__", wrapper.__name__)
    wrapper.__wrapped__ = fn
    return wrapper


def _floating_elements(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() if (out.is_floating_point() or out.is_complex()) else 0
    if isinstance(out, (list, tuple)):
        return sum(_floating_elements(o) for o in out)
    return 0


class Coverage(TorchDispatchMode):
    """Counts the floating-point work of every ATen op a captured run issues, split into what ran inside a
    recorded API call and what did not (see the module docstring for the rules).

    Args:
        busy: a callable that is true while the capture machinery itself runs (its ops are not the model's).
    """

    def __init__(self, busy):
        super().__init__()
        self.busy = busy
        self.depth = 0  # > 0 while a recorded API call runs (forward)
        self._suspended = False
        self.reset()

    # ------------------------------------------------------------------ on and off the dispatch stack
    def start(self) -> None:
        """Push the mode: count from now on."""
        self.__enter__()
        self._suspended = False
        _ACTIVE.append(self)

    def stop(self) -> None:
        """Pop the mode (it is off the stack already while suspended)."""
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self._suspended:
            self._suspended = False
        else:
            self.__exit__(None, None, None)

    def suspend(self) -> bool:
        """Step off the dispatch stack while the capture machinery runs (its ops then cost no Python call);
        only when this mode is the innermost one. Returns whether it stepped off."""
        n = torch._C._len_torch_dispatch_stack()
        if self._suspended or self not in _ACTIVE or not n or torch._C._get_dispatch_stack_at(n - 1) is not self:
            return False
        torch._C._pop_torch_dispatch_stack(None)  # the C stack only: __exit__'s flag bookkeeping costs more than
        self._suspended = True                    # the ops it would save, and the flags stay as they were
        return True

    def resume(self) -> None:
        """Back on the dispatch stack after :meth:`suspend`."""
        if self._suspended:
            self._suspended = False
            torch._C._push_on_torch_dispatch_stack(self)

    def reset(self) -> None:
        """Forget the step's counts and the autograd nodes of its recorded calls."""
        self.captured = 0
        self.uncaptured: collections.Counter = collections.Counter()  # (op, pass) -> elements
        self.uncaptured_calls: collections.Counter = collections.Counter()
        self.captured_ops: collections.Counter = collections.Counter()  # op -> elements (inside recorded APIs)
        self.excluded: collections.Counter = collections.Counter()  # op -> calls (data movement, views, ...)
        # the autograd nodes of this step's recorded calls carry this token in their metadata (a tag on the C++
        # node: no reference held, so a graph nobody runs backward through is freed as it would be)
        self.token = object()

    # ------------------------------------------------------------------ the capture session's side
    @staticmethod
    def grad_fns(args: tuple, kwargs: dict) -> set:
        """The autograd nodes that produced a call's inputs (where the walk of :meth:`adopt` stops)."""
        return {g for g in map(grad_fn_of, tensors_of(args) + tensors_of(kwargs)) if g is not None}

    def adopt(self, out: Any, before: set, limit: int = 10_000) -> None:
        """Mark the autograd nodes a recorded call created (from its outputs back to its inputs' nodes) as
        captured: their backward work is the call's."""
        stack = [g for g in map(grad_fn_of, tensors_of(out)) if g is not None]
        while stack and limit > 0:
            node = stack.pop()
            if node in before or type(node).__name__ == "AccumulateGrad" or self.captures(node):
                continue
            node.metadata[_TAG] = self.token
            limit -= 1
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def unjudged(self, api: str, elements: int, reason: str) -> None:
        """A recorded call that computed ``elements`` floating-point elements but could not be judged (its oracle or
        bench failed, ``reason``): counted as unseen, not captured, so ``--msprobe-require-coverage`` sees it."""
        if elements <= 0:
            return
        self.captured -= elements
        key = (api, f"forward, not judged: {reason}"[:160])
        self.uncaptured[key] += elements
        self.uncaptured_calls[key] += 1

    def captures(self, node) -> bool:
        """Whether ``node`` was created by one of this step's recorded calls (:meth:`adopt`)."""
        return node.metadata.get(_TAG) is self.token

    # ------------------------------------------------------------------ the dispatch side
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _QUIET[0] or self.busy():
            return out
        name = func.overloadpacket.__name__
        if func.namespace in _COMMUNICATION:
            self.excluded[f"{func.namespace}.{name} (communication)"] += 1
            return out
        if func.is_view or name in MOVES or name in _BOOKKEEPING or func.namespace in _MOVING_NAMESPACES:
            self.excluded[f"{func.namespace}.{name}"] += 1
            return out
        elements = _floating_elements(out)
        if not elements:
            return out
        if self.depth:
            self.captured += elements
            self.captured_ops[f"{func.namespace}.{name}"] += elements
            return out
        node = torch._C._current_autograd_node()
        if node is None:
            key = (f"{func.namespace}.{name}", "forward")
        elif self.captures(node):
            self.captured += elements
            self.captured_ops[f"{func.namespace}.{name}"] += elements
            return out
        else:
            kind = type(node).__name__
            if kind == "AccumulateGrad":
                self.excluded["AccumulateGrad (parameters_grad)"] += 1
                return out
            if routes_gradients(kind):
                self.excluded[f"aten.{name} (backward of {kind}: gradient routing and fan-in)"] += 1
                return out
            key = (f"{func.namespace}.{name}", f"backward of {kind}")
        self.uncaptured[key] += elements
        self.uncaptured_calls[key] += 1
        return out

    # ------------------------------------------------------------------ the figure
    @property
    def share(self) -> float:
        """Captured floating-point elements over all counted ones (1.0 when nothing computed)."""
        total = self.captured + sum(self.uncaptured.values())
        return self.captured / total if total else 1.0

    def as_json(self) -> dict:
        """``coverage.json``: the share, the element counts, the uncaptured ops (most work first), the ops
        counted inside captured APIs and the excluded ops with their call counts."""
        unc = sum(self.uncaptured.values())
        return {
            "share": self.share,
            "captured_elements": self.captured,
            "uncaptured_elements": unc,
            "uncaptured": [{"op": op, "pass": where, "calls": self.uncaptured_calls[(op, where)], "elements": n}
                           for (op, where), n in self.uncaptured.most_common()],
            "captured_ops": dict(self.captured_ops.most_common()),
            "excluded": dict(sorted(self.excluded.items())),
            "rule": "floating-point output elements of ATen ops; captured = inside a recorded API call (forward) "
                    "or in an autograd node one created (backward); data movement, views, creation and integer "
                    "outputs excluded",
        }


def summary(cov: dict, limit: int = 5) -> str:
    """One line: ``coverage 97.3% of floating-point work; uncaptured: aten.mm x4 (forward), ...``."""
    line = f"coverage {100 * cov['share']:.1f}% of floating-point work"
    if cov.get("uncaptured"):
        ops = [f"{u['op']} x{u['calls']} ({u['pass']})" for u in cov["uncaptured"][:limit]]
        more = len(cov["uncaptured"]) - limit
        line += "; uncaptured: " + ", ".join(ops) + (f", and {more} more" if more > 0 else "")
    return line
