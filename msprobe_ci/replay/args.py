"""Rebuilding an API's arguments from its dump entry.

Tensor dumps give the real tensors (``.pt`` loaded with ``weights_only=True``). Statistics dumps give random values
drawn uniformly in ``[Min, Max]`` with both extremes planted (first and last element), so the rebuilt tensor has
the dumped extrema; NaN/Inf statistics are reproduced. Each API draws from its own generator seeded by a CRC of its
name, so an API's inputs do not depend on which other APIs ran before it (unlike msprobe's one global stream).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from ..dump.reader import Dump
from ..errors import MsprobeError

DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                               torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
                               torch.complex128)}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[f"torch.{_name}"] = getattr(torch, _name)
# MindSpore dump spellings of the same dtypes (``Float16`` is ``torch.float16``)
DTYPES.update({"Float16": torch.float16, "BFloat16": torch.bfloat16, "Float32": torch.float32,
               "Float64": torch.float64, "Int8": torch.int8, "UInt8": torch.uint8, "Int16": torch.int16,
               "Int32": torch.int32, "Int64": torch.int64, "Bool": torch.bool, "Complex64": torch.complex64,
               "Complex128": torch.complex128})


#: The most elements one rebuilt tensor may have (2**28: 2 GiB once upcast to float64). A dump's shape is data:
#: a statistics record claiming 10**12 elements must not make the replay allocate them.
MAX_ELEMENTS = 2 ** 28


def api_generator(name: str) -> torch.Generator:
    """The per-API random generator: seeded by CRC-32 of the API's call name (order-independent)."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


class Rebuilder:
    """Rebuilds argument values of one dump.

    Args:
        dump: the loaded dump (tensor files come from its ``dump_tensor_data/``).
        real: use the saved tensors when records name one (tensor task); random values otherwise.
    """

    def __init__(self, dump: Dump, real: bool = True):
        self.dump = dump
        self.real = real and dump.task == "tensor"

    def value(self, rec: Any, gen: torch.Generator, where: str) -> Any:
        """One argument: tensor records become tensors, others their Python value; lists and dicts recurse."""
        if rec is None:
            return None
        if isinstance(rec, list):
            return [self.value(r, gen, f"{where}.{i}") for i, r in enumerate(rec)]
        if not isinstance(rec, dict):
            return rec
        typ = rec.get("type")
        if typ in ("torch.Tensor", "torch.nn.parameter.Parameter") or str(typ).startswith("mindspore.") and \
                "dtype" in rec and "shape" in rec:
            return self.tensor(rec, gen, where)
        if typ in ("int", "float", "bool", "str"):
            return rec.get("value")
        if typ == "torch.Size":
            return torch.Size(rec.get("value") or [])
        if typ == "slice":
            return slice(*rec.get("value", [None, None, None]))
        if typ == "ellipsis":
            return Ellipsis
        if typ in ("torch.dtype", "mindspore.dtype"):
            dt = DTYPES.get(str(rec.get("value")))
            if dt is None:
                raise MsprobeError(f"{where}: unknown torch.dtype {rec.get('value')!r}")
            return dt
        if typ == "torch.device":
            return "cpu"
        if typ is None and rec:
            return {k: self.value(v, gen, f"{where}.{k}") for k, v in rec.items()}
        if typ is not None and "value" in rec:  # numpy scalars and other plain values
            return rec["value"]
        return None

    def tensor(self, rec: dict, gen: torch.Generator, where: str) -> torch.Tensor:
        dtype = DTYPES.get(str(rec.get("dtype")))
        if dtype is None:
            raise MsprobeError(f"{where}: unsupported tensor dtype {rec.get('dtype')!r}")
        shape = rec.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise MsprobeError(f"{where}: shape {shape!r} is not a list of non-negative ints")
        numel = math.prod(shape)
        if numel > MAX_ELEMENTS:
            raise MsprobeError(f"{where}: shape {shape} has {numel} elements, more than the replay materialises "
                               f"({MAX_ELEMENTS})")
        if self.real and rec.get("data_name"):
            return self.dump.load_tensor(str(rec["data_name"]), shape).to(dtype)
        return random_tensor(rec, dtype, shape, gen)


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def random_tensor(rec: dict, dtype: torch.dtype, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    """Uniform values in ``[Min, Max]`` of ``rec``, extremes planted at the first and last element."""
    numel = math.prod(shape)
    lo, hi = _num(rec.get("Min")), _num(rec.get("Max"))
    if lo is None or hi is None or numel == 0:
        lo = hi = 0.0 if lo is None or hi is None else lo
    if dtype == torch.bool:
        t = torch.randint(0, 2, (numel,), generator=gen).bool() if lo != hi else torch.full((numel,), bool(hi))
        if numel:
            t[0], t[-1] = bool(lo), bool(hi)
        return t.reshape(shape)
    if not dtype.is_floating_point and not dtype.is_complex:
        t = torch.randint(int(lo), int(hi) + 1, (numel,), generator=gen, dtype=torch.int64)
        if numel:
            t[0], t[-1] = int(lo), int(hi)
        return t.to(dtype).reshape(shape)
    flo = lo if math.isfinite(lo) else (torch.finfo(torch.float32).min if lo < 0 else 0.0)
    fhi = hi if math.isfinite(hi) else (torch.finfo(torch.float32).max if hi > 0 else flo)
    if math.isnan(lo) or math.isnan(hi):
        flo = fhi = 0.0
    t = torch.rand((numel,), generator=gen, dtype=torch.float64) * (fhi - flo) + flo
    if numel:
        t[0], t[-1] = lo, hi
    return t.to(dtype if not dtype.is_complex else torch.float32).to(dtype).reshape(shape)


def record_rows(recs: Any, stem: str) -> list[tuple[str, Any]]:
    """A dump entry's ``output`` records (a list, nested lists, or a dict of them) as ``(row name, record)``
    pairs, the row naming of :func:`msprobe_ci.judge.rows.outputs`."""
    if isinstance(recs, dict) and "type" not in recs:
        recs = list(recs.values())
    if not isinstance(recs, list):
        recs = [recs]
    out = []
    for i, r in enumerate(recs):
        out += record_rows(r, f"{stem}.{i}") if isinstance(r, list) else [(f"{stem}.{i}", r)]
    return out


def mindspore_order(targets: list, grads: list, last_first: bool) -> list:
    """Torch's gradients (in its autograd node's order, None where an input needs none) lined up with a MindSpore
    backward entry's outputs, which hold only the gradients that exist (a Primitive's last input first): paired
    by shape, equal shapes first (ties in MindSpore's order), then a 2-D gradient with its transpose (torch's
    ``addmm`` hands back dW transposed). Unchanged when some target finds no partner."""
    free = [g for g in grads if isinstance(g, torch.Tensor)]
    free = free[::-1] if last_first else free
    out: list = [None] * len(targets)
    for transposed in (False, True):
        for i, (_, t) in enumerate(targets):
            if out[i] is not None or not isinstance(t, torch.Tensor):
                continue
            want = tuple(t.shape)[::-1] if transposed else tuple(t.shape)
            if transposed and len(want) != 2:
                continue
            j = next((k for k, g in enumerate(free) if tuple(g.shape) == want), None)
            if j is not None:
                hit = free.pop(j)
                out[i] = hit.t() if transposed else hit
    if any(o is None and isinstance(t, torch.Tensor) for o, (_, t) in zip(out, targets)):
        return grads
    return out
