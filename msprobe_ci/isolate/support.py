"""What every part of isolation shares: copies of a call's inputs, the per-call state (:class:`_Call`) and the
record fields a verdict becomes (what cannot be judged at all: :mod:`msprobe_ci.judge.support`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels import tensors_of

_SCHEMA_VERSION = 1


def is_inplace(short: str) -> bool:
    """``add_``, ``__iadd__``: the API writes into its first argument."""
    if short.startswith("__") and short.endswith("__"):
        return short.startswith("__i") and short not in ("__index__", "__int__", "__invert__")
    return short.endswith("_")


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _copy_obj(value: Any, conv, depth: int = 0) -> Any:
    """A copy of an argument with every tensor converted by ``conv``, objects included (a KV cache passed to a
    module is copied with its tensors, so re-running the module never appends to the user's cache)."""
    import copy

    if isinstance(value, torch.Tensor):
        return conv(value)
    if depth > 6 or value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype,
                                                        torch.device, torch.nn.Module, type)) or callable(value):
        return value
    if isinstance(value, list):
        return [_copy_obj(v, conv, depth + 1) for v in value]
    if isinstance(value, tuple):
        items = [_copy_obj(v, conv, depth + 1) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _copy_obj(v, conv, depth + 1)
        return out
    if hasattr(value, "__dict__"):
        try:
            out = copy.copy(value)
            for k, v in vars(value).items():
                setattr(out, k, _copy_obj(v, conv, depth + 1))
            return out
        except Exception:  # noqa: BLE001 - an object that cannot be copied is passed as it is
            return value
    return value


@dataclass
class _Call:
    name: str
    short: str
    direction_ok: bool = True
    oracle_in: list = field(default_factory=list)   # oracle leaves that need grad, by tap position
    oracle_out: Any = None
    bench_in: list = field(default_factory=list)
    bench_out: Any = None
    bench_round: bool = False  # the bench is a higher-precision result, rounded to the target's dtype when judged
    composite: bool = False  # its forward's kernels read an intermediate (kernels.Materialized): the bench reruns
    taps: int = 0
    grad_out: dict = field(default_factory=dict)
    dropout: tuple | None = None
    local: bool = False  # a pointwise call on DTensors, judged on the local shards (local_pointwise)
    func: Any = None
    inputs: tuple | None = None  # the target's (args, kwargs), for the error budget, until the call is judged
    versions: tuple = ()  # the inputs' version counters at the call: an input written since is not the call's
    # grouped GEMMs over a padded buffer: {"output": {i: (dim, end)}, "grad": {tap: (dim, end)}}, the elements
    # past ``end`` are uninitialised memory (kernels.unwritten) and judged as 0 on every side
    unwritten: dict = field(default_factory=dict)
    # how the oracle ran at the call, to run it again for the backward pass: (dtype, on the CPU only)
    oracle_how: tuple | None = None
    # the autocast dtype the call ran under (msprobe_ci.amp); its oracle and bench then run after the call
    autocast: torch.dtype | None = None
    # under autocast: the dtype each tapped input's gradient is judged in (the narrower of the user's tensor's and
    # the kernel's), by tap position
    grad_dtypes: list = field(default_factory=list)
    # for its reproduction (msprobe_ci.repro), while a reproducer is set: the (args, kwargs) the API was given (an
    # in-place call's first argument copied before the call), the grad mode and the autocast state at the call
    raw: tuple | None = None
    grad_enabled: bool = True
    autocast_state: dict | None = None

    def unchanged(self) -> bool:
        """Whether the call's kept inputs still hold the values it was called with (no in-place write since)."""
        return self.inputs is not None and \
            tuple(t._version for t in tensors_of(self.inputs[0]) + tensors_of(self.inputs[1])) == self.versions



def _has_dtensor(value: Any, depth: int = 0) -> bool:
    """Whether a DTensor (``torch.distributed.tensor.DTensor``) is among the arguments (nested lists, tuples,
    dicts)."""
    if isinstance(value, torch.Tensor):
        return type(value) is not torch.Tensor and hasattr(value, "placements") and hasattr(value, "_local_tensor")
    if depth < 4 and isinstance(value, (list, tuple)):
        return any(_has_dtensor(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return any(_has_dtensor(v, depth + 1) for v in value.values())
    return False



#: Python operator names of the Tensor API -> the ATen op they call (for :func:`local_pointwise`)
_DUNDER_ATEN = {"__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__rsub__": "rsub",
                "__isub__": "sub_", "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div",
                "__rtruediv__": "div", "__itruediv__": "div_", "__neg__": "neg", "__pow__": "pow",
                "__rpow__": "pow", "__ipow__": "pow_"}


@functools.lru_cache(maxsize=1024)
def _pointwise(short: str) -> bool:
    """Whether API ``short`` is an ATen op tagged ``pointwise`` (each output element from the same element of its
    inputs: ``mul_``, ``lerp_``, ``addcdiv_``, ``sqrt``, ``gelu``)."""
    packet = getattr(torch.ops.aten, _DUNDER_ATEN.get(short, short), None)
    try:
        return packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
    except (AttributeError, RuntimeError):
        return False


def local_pointwise(short: str, args: tuple, kwargs: dict):
    """``(args, kwargs)`` with every DTensor replaced by this rank's local shard (:func:`to_local`), where that is the
    whole call: a pointwise op whose DTensors share one mesh, placements (``Shard``/``Replicate``, no pending
    ``Partial`` sum) and shape, beside no other tensor but 0-d ones (an optimizer's update of a sharded parameter:
    what the rank computes is the op on its shards). ``None`` otherwise."""
    if not _pointwise(short):
        return None
    found = tensors_of(args) + tensors_of(kwargs)
    dts = [t for t in found if _has_dtensor(t)]
    if not dts or any(not _has_dtensor(t) and t.dim() > 0 for t in found):
        return None
    first = dts[0]
    for t in dts:
        if t.device_mesh != first.device_mesh or tuple(t.placements) != tuple(first.placements) or \
                t.shape != first.shape or any(p.is_partial() for p in t.placements):
            return None
    return to_local(tuple(args)), to_local(dict(kwargs))


def to_local(value: Any, depth: int = 0) -> Any:
    """``value`` with every DTensor replaced by its local shard (nested lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        return value._local_tensor if _has_dtensor(value) else value
    if depth < 4 and isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_local(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return {k: to_local(v, depth + 1) for k, v in value.items()}
    return value
