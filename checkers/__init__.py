"""Per-API accuracy standards (``msprobe_ci.checkers``).

One module per standard, each configured once with its thresholds (per dtype, from ``data/thresholds.yaml``,
every number annotated with its source) and called per output pair ``(target, bench, oracle)``, all returning
:class:`CheckResult`. :func:`standard_for` picks the standard of an API from ``data/registry.yaml`` (integer and
bool outputs: binary; unknown APIs: the documented default, benchmark); users override per API pattern.

============================  =================================================================================
standard                      rule (source)
============================  =================================================================================
``absolute_threshold``        every element within the dtype's rtol / small-value atol (msprobe 2.5)
``binary``                    bit-exact (msprobe 2.6)
``ulp``                       ULP error against the fp64 oracle (msprobe 2.7)
``thousandth``                99.9% within 0.1% (msprobe 2.8, conv)
``benchmark``                 target error / bench error against the fp64 oracle within 2-10x (msprobe 2.4)
``accumulative``              reductions: error bound and error balance (msprobe 2.9)
``legacy``                    msprobe acc_check's cosine / MaxAbsErr / dual-hundredth chain (msprobe 2.1)
``dropout``                   share of zeros against p
``quantization``              a cast into FP8 against its own wider input: error against the input's own amax
                              scale, underflow and saturation shares (Transformer Engine's debug statistics)
============================  =================================================================================
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any

from .absolute import AbsoluteThresholdStandard
from .accumulative import AccumulativeStandard
from .benchmark import BenchmarkStandard
from .binary import BinaryStandard
from .common import dtype_key, load_yaml
from .dropout import DropoutStandard
from .legacy import LegacyStandard
from .quantization import QuantizationStandard
from .result import CheckResult, worst
from .thousandth import ThousandthStandard
from .ulp import UlpStandard

STANDARDS = {cls.name: cls for cls in (AbsoluteThresholdStandard, AccumulativeStandard, BenchmarkStandard,
                                       BinaryStandard, DropoutStandard, LegacyStandard, QuantizationStandard,
                                       ThousandthStandard, UlpStandard)}

__all__ = ["CheckResult", "STANDARDS", "standard_for", "make_standard", "dtype_key", "worst"] + \
    [cls.__name__ for cls in STANDARDS.values()]


def standard_for(api: str, out_dtype: Any, overrides: dict[str, str] | None = None) -> str:
    """The standard's name for ``api`` (name without prefix and call number, e.g. ``linear``) and its output dtype.

    Order: integer/bool outputs → ``binary``; ``overrides`` (``{fnmatch pattern: standard}``, user's, first match);
    ``data/registry.yaml``; its ``default`` (``benchmark``).

    Raises:
        MsprobeError: an override names an unknown standard.
    """
    return _standard_for(api, dtype_key(out_dtype), tuple((overrides or {}).items()))


@functools.lru_cache(maxsize=4096)
def _standard_for(api: str, key: str, overrides: tuple) -> str:
    """:func:`standard_for`, memoised: it runs for every captured call under isolation."""
    from ..errors import MsprobeError

    for pattern, name in overrides:
        if name not in STANDARDS:
            raise MsprobeError(f"standard override {pattern!r}: {name!r} unknown; known: {sorted(STANDARDS)}")
        if fnmatch.fnmatchcase(api, pattern):
            return name
    if key in ("int", "bool"):
        return "binary"
    reg = load_yaml("registry.yaml")
    for name, patterns in reg["standards"].items():
        if any(fnmatch.fnmatchcase(api, p) for p in patterns):
            if name == "thousandth" and key not in ("fp32", "fp64"):
                break  # msprobe applies it to fp32 (HF32) convolutions; a half-precision result cannot meet 0.1%
            return name
    return reg["default"]


def make_standard(name: str, out_dtype: Any, api: str = "", **overrides: float):
    """An instance of standard ``name`` for the output dtype (and the API, which sets the benchmark level).

    Instances are shared (memoised by their arguments: one is asked for every judged row): a standard keeps its
    thresholds only, read-only after construction, and hands copies of them to its results."""
    try:
        return _make_standard(name, dtype_key(out_dtype), api, tuple(sorted(overrides.items())))
    except TypeError:  # an unhashable override: built afresh (the constructor says what it expects)
        return _build_standard(name, dtype_key(out_dtype), api, overrides)


@functools.lru_cache(maxsize=1024)
def _make_standard(name: str, key: str, api: str, overrides: tuple):
    return _build_standard(name, key, api, dict(overrides))


def _build_standard(name: str, key: str, api: str, overrides: dict):
    cls = STANDARDS[name]
    if cls is BenchmarkStandard:
        return cls(key, api=api, **overrides)
    return cls(key, **overrides)
