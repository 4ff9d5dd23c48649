"""Fault injection: perturb chosen target-side API outputs to prove that a gate catches a regression.

File format (YAML, loaded with ``yaml.safe_load``)::

    faults:
      - {api: Functional.layer_norm, call: 3, direction: forward, perturb: scale, value: 1.02}

* ``api``: ``{Prefix}.{name}`` as in dump names (``Functional.linear``, ``Tensor.__add__``, ``Torch.matmul``).
* ``call``: the call counter as it appears in the dump name (``Functional.layer_norm.3.forward`` is call 3);
  absent or ``null`` perturbs every call.
* ``direction``: ``forward`` (the API's outputs) or ``backward`` (the gradients it produces); default forward.
* ``perturb``: ``scale`` (``x * value``), ``offset`` (``x + value``) or ``noise`` (``x + value * |x| * N(0, 1)``,
  i.e. ``value`` is the relative standard deviation; the generator is seeded per fault and call, so runs repeat).
* ``step``: apply only at that capture step (``step<N>`` folder; absent or ``null``: every step).
* ``rank``: apply only on that rank of a multi-rank run (absent or ``null``: every rank).

The perturbed value is what the caller receives *and* what capture records, exactly as a buggy kernel would.
A fault that fires but changes no element (a 1% scale on fp16 gradients that live in the subnormal range, where
the step between neighbouring values is far above 1%) is reported like one that never fired: neither proves
anything about the gate (:class:`FaultLog`).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import MsprobeError

PERTURBS = ("scale", "offset", "noise")
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Fault:
    """One fault. See the module docstring for the fields."""

    api: str
    call: int | None = None
    direction: str = "forward"
    perturb: str = "scale"
    value: float = 1.0
    step: int | None = None
    rank: int | None = None

    def on_rank(self, rank: int | None) -> bool:
        """This fault applies on ``rank`` (every rank when the fault names none)."""
        return self.rank is None or rank is None or self.rank == rank

    def matches(self, api: str, call: int, direction: str, step: int | None = None) -> bool:
        """This fault applies to call ``call`` of ``api`` in ``direction`` (at capture step ``step`` when given)."""
        return self.api == api and self.direction == direction and (self.call is None or self.call == call) and \
            (self.step is None or step is None or self.step == step)

    def apply(self, value: Any, call: int) -> Any:
        """Perturb every floating or complex tensor in ``value`` (nested tuples/lists kept; a complex value's noise
        is relative to its modulus)."""
        import torch

        if isinstance(value, torch.Tensor):
            if not (value.is_floating_point() or value.is_complex()):
                return value
            base = value.detach()
            if self.perturb == "scale":
                delta = base * self.value - base
            elif self.perturb == "offset":
                delta = (base + self.value) - base
            else:
                gen = torch.Generator(device=value.device)
                # zlib.crc32, not hash(): str hashes are salted per process, which made the same fault file
                # draw other noise in every run
                gen.manual_seed((zlib.crc32(self.api.encode()) & 0xFFFF) * 1000 + call)
                noise = torch.randn(value.shape, generator=gen, device=value.device, dtype=torch.float32)
                delta = (self.value * base.abs().float() * noise).to(value.dtype)
            # delta comes from a detached copy: the values change, the op's own gradient does not (a forward-kernel
            # bug, not a backward one; a backward fault perturbs the gradients themselves)
            return value + delta
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self.apply(v, call) for v in value)
        if isinstance(value, list):
            return [self.apply(v, call) for v in value]
        return value


def parse_faults(raw: Any, source: str = "faults") -> tuple[Fault, ...]:
    """Validate the parsed YAML document; see the module docstring for the format.

    Raises:
        MsprobeError: naming the file, the fault index and the bad field.
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("faults"), list):
        raise MsprobeError(f"{source}: expected a mapping with a 'faults' list")
    out = []
    for i, item in enumerate(raw["faults"]):
        where = f"{source}: faults[{i}]"
        if not isinstance(item, dict):
            raise MsprobeError(f"{where}: expected a mapping, got {item!r}")
        unknown = sorted(set(item) - {"api", "call", "direction", "perturb", "value", "step", "rank"})
        if unknown:
            raise MsprobeError(f"{where}: unknown field(s) {unknown}")
        api = item.get("api")
        if not isinstance(api, str) or api.count(".") < 1:
            raise MsprobeError(f"{where}.api: expected '<Prefix>.<name>' such as 'Functional.linear', got {api!r}")
        call = item.get("call")
        if call is not None and (isinstance(call, bool) or not isinstance(call, int) or call < 0):
            raise MsprobeError(f"{where}.call: expected a non-negative int, got {call!r}")
        direction = item.get("direction", "forward")
        if direction not in DIRECTIONS:
            raise MsprobeError(f"{where}.direction: expected one of {', '.join(DIRECTIONS)}, got {direction!r}")
        perturb = item.get("perturb", "scale")
        if perturb not in PERTURBS:
            raise MsprobeError(f"{where}.perturb: expected one of {', '.join(PERTURBS)}, got {perturb!r}")
        value = item.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MsprobeError(f"{where}.value: expected a number, got {value!r}")
        step = item.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise MsprobeError(f"{where}.step: expected a non-negative int (a capture step), got {step!r}")
        rank = item.get("rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise MsprobeError(f"{where}.rank: expected a non-negative int (a rank), got {rank!r}")
        out.append(Fault(api, call, direction, perturb, float(value), step, rank))
    return tuple(out)


def load_faults(path: str | os.PathLike) -> tuple[Fault, ...]:
    """Read a fault file (YAML, ``safe_load``). Raises :class:`MsprobeError` for a missing or malformed file."""
    import yaml

    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except FileNotFoundError:
        raise MsprobeError(f"{p}: fault file not found") from None
    except yaml.YAMLError as exc:
        raise MsprobeError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return parse_faults(raw, p)


def select(faults: Iterable[Fault], api: str) -> tuple[Fault, ...]:
    return tuple(f for f in faults if f.api == api)


def _floating(value: Any) -> list:
    """The floating and complex tensors in ``value`` (nested tuples/lists), in order: exactly what :meth:`Fault.apply`
    perturbs (not ``kernels.tensors_of``, which also opens dicts and named tuples that a fault leaves alone)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() or value.is_complex() else []
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return [t for v in value for t in _floating(v)]
    return []


class FaultLog:
    """Which of a run's faults fired, and whether any of them changed a value.

    Args:
        faults: the run's faults (indices into it name them).

    ``fired``: indices of faults applied at least once. ``changed``: of those, the ones that changed at least one
    element (``after != before``; NaN where both are NaN counts as unchanged). ``touched``: per fired fault that
    has not changed anything yet, the largest finite ``|x|`` it was applied to and that tensor's dtype (for the
    message when nothing changed).
    """

    def __init__(self, faults: Iterable[Fault]):
        self.faults = tuple(faults)
        self.fired: set[int] = set()
        self.changed: set[int] = set()
        self.touched: dict[int, tuple[float, str]] = {}

    def apply(self, fault: Fault, value: Any, call: int) -> Any:
        """``fault.apply(value, call)``, logged."""
        out = fault.apply(value, call)
        self.record(fault, value, out)
        return out

    def record(self, fault: Fault, before: Any, after: Any) -> None:
        """Log that ``fault`` turned ``before`` into ``after`` (the same nesting of tensors)."""
        import torch

        i = self.faults.index(fault)
        self.fired.add(i)
        if i in self.changed:
            return
        for b, a in zip(_floating(before), _floating(after)):
            if b.numel() == 0:
                continue
            b, a = b.detach(), a.detach()
            if bool(((a != b) & ~(a.isnan() & b.isnan())).any()):
                self.changed.add(i)
                return
            peak = float(torch.nan_to_num(b.abs(), nan=0.0, posinf=0.0).amax())
            if peak >= self.touched.get(i, (-1.0, ""))[0]:
                self.touched[i] = (peak, str(b.dtype))

    def unapplied(self, rank: int | None, why: str, only: Iterable[int] | None = None) -> tuple[str, ...]:
        """One line per fault meant for ``rank`` that never fired (``why``: the reason to give) or fired and
        changed nothing; ``only``: just the faults of these indices."""
        out = []
        keep = None if only is None else set(only)
        for i, f in enumerate(self.faults):
            if not f.on_rank(rank) or i in self.changed or (keep is not None and i not in keep):
                continue
            what = f"fault {f.api}{'' if f.call is None else f' call {f.call}'} ({f.direction})"
            if i not in self.fired:
                out.append(f"{what} was never applied: {why}")
                continue
            if i not in self.touched:  # an integer, bool or empty output: nothing it could perturb
                out.append(f"{what} fired but found no floating-point value to perturb")
                continue
            peak, dtype = self.touched[i]
            if peak == 0:  # nothing finite and nonzero to move: zeros, or an overflow
                out.append(f"{what} fired but changed no value: every {dtype} value it touched was 0, inf or NaN "
                           "(an overflow: under a loss scale, a step the GradScaler skips)")
                continue
            out.append(f"{what} fired but changed no value: {f.perturb} {f.value:g} is below the resolution of "
                       f"{dtype} at the values it touched (largest |x| {peak:.3g})")
        return tuple(out)
