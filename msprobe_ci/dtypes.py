"""The one dtype table: short name ↔ torch dtype ↔ dump strings (PyTorch and MindSpore) ↔ unit roundoff ↔ checker key.

Every place that names a floating dtype (options, backends, verdicts, checkers, sources, model-level tolerances)
looks it up here. Importing this module does not import torch; :attr:`DType.torch` resolves lazily.

Unit roundoff u = 2^-p for a p-bit significand (IEEE 754: fp64 53, fp32 24, fp16 11; bfloat16 8; OCP FP8
e4m3 4, e5m2 3): the largest relative error of one correct rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .errors import MsprobeError


@dataclass(frozen=True)
class DType:
    """One floating dtype.

    Attributes:
        short: option spelling (``bf16``); also the checkers' threshold key.
        dump: PyTorch dump string (``torch.bfloat16``), as msprobe writes ``dtype``.
        mindspore: MindSpore dump string (``BFloat16``).
        roundoff: unit roundoff u (2^-p).
        aliases: other spellings accepted on input (``bfloat16``, ``torch.half`` ...).
        finite_max: the largest finite value (``torch.finfo(dtype).max``: fp16 65504).
        smallest_normal: ``torch.finfo(dtype).smallest_normal`` (fp16 2^-14). Below it values are subnormal and
            one rounding errs by up to ``u · smallest_normal`` absolute (half the subnormal spacing), not ``u·|x|``.
    """

    short: str
    dump: str
    mindspore: str
    roundoff: float
    aliases: tuple[str, ...] = ()
    finite_max: float = float("inf")
    smallest_normal: float = 0.0

    @property
    def torch(self):
        """The ``torch.dtype`` (imports torch)."""
        import torch

        return getattr(torch, self.dump.split(".", 1)[1])


TABLE: tuple[DType, ...] = (
    DType("fp64", "torch.float64", "Float64", 2.0 ** -53, ("float64", "double", "torch.double"),
          1.7976931348623157e308, 2.0 ** -1022),
    DType("fp32", "torch.float32", "Float32", 2.0 ** -24, ("float32", "float", "torch.float"), 3.4028234663852886e38,
          2.0 ** -126),
    DType("fp16", "torch.float16", "Float16", 2.0 ** -11, ("float16", "half", "torch.half"), 65504.0, 2.0 ** -14),
    DType("bf16", "torch.bfloat16", "BFloat16", 2.0 ** -8, ("bfloat16",), 3.3895313892515355e38, 2.0 ** -126),
    DType("fp8_e4m3", "torch.float8_e4m3fn", "Float8E4M3", 2.0 ** -4, ("float8_e4m3fn",), 448.0, 2.0 ** -6),
    DType("fp8_e5m2", "torch.float8_e5m2", "Float8E5M2", 2.0 ** -3, ("float8_e5m2",), 57344.0, 2.0 ** -14),
)
OPTION_NAMES = ("fp64", "fp32", "fp16", "bf16")  # what --msprobe-*-dtype accepts
_INDEX: dict[str, DType] = {}
for _d in TABLE:
    for _k in (_d.short, _d.dump, _d.mindspore, *_d.aliases):
        _INDEX[_k.lower()] = _d


def lookup(value: Any) -> DType | None:
    """The table row of a dtype given as a torch dtype, a dump string (PyTorch or MindSpore) or a short name;
    ``None`` for integer, bool, complex and unknown dtypes."""
    if value is None:
        return None
    try:
        return _lookup(value)
    except TypeError:  # unhashable
        return _INDEX.get(str(value).lower())


@functools.lru_cache(maxsize=256)
def _lookup(value: Any) -> DType | None:
    """:func:`lookup`, memoised (the judge asks it for every judged row; a spelling is read once)."""
    return _INDEX.get(str(value).lower())


def parse_option(name: str | None, where: str = "dtype"):
    """An option value (``fp64``/``fp32``/``fp16``/``bf16`` or their long names) → ``torch.dtype``; ``None`` or
    ``""`` → ``None`` (keep the model's own).

    Raises:
        MsprobeError: naming ``where`` and the accepted names.
    """
    if name is None or name == "":
        return None
    d = lookup(name)
    if d is None or d.short not in OPTION_NAMES:
        raise MsprobeError(f"{where} {name!r}: expected one of {', '.join(OPTION_NAMES)}")
    return d.torch


def short_name(value: Any, default: str = "model-dtype") -> str:
    """``bf16`` for ``torch.bfloat16`` (or any spelling); ``default`` for ``None``/unknown."""
    d = lookup(value)
    return d.short if d is not None else default


def roundoff(*dtypes: Any) -> float:
    """The largest unit roundoff among ``dtypes`` (integer, bool, unknown and ``None`` count 0)."""
    return max((d.roundoff for d in map(lookup, dtypes) if d is not None), default=0.0)


def checker_key(value: Any) -> str:
    """The checkers' threshold key: the short name of a floating dtype, else ``bool``, ``complex`` or ``int``."""
    d = lookup(value)
    if d is not None:
        return d.short
    s = str(value)
    if "bool" in s:
        return "bool"
    if "complex" in s:
        return "complex"
    return "int"


def finite_max(value: Any) -> float | None:
    """The largest finite value of a floating dtype of the table (any spelling); None for other dtypes."""
    d = lookup(value)
    return d.finite_max if d is not None else None


def smallest_normal(*dtypes: Any) -> float:
    """The largest ``smallest_normal`` among ``dtypes`` (the coarsest underflow; 0 for none of the table's)."""
    return max((d.smallest_normal for d in map(lookup, dtypes) if d is not None), default=0.0)


def is_floating(value: Any) -> bool:
    """A floating dtype of the table (dump strings of either framework, torch dtypes, short names)."""
    return lookup(value) is not None
