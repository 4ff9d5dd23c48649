"""msprobe's compare metrics, reproduced to the digit (``shared/spec/compare-overflow-visualization.md`` §1.4-1.5).

Statistics mode: ``Max diff, Min diff, Mean diff, L2norm diff`` (target − bench) and ``MaxRelativeErr,
MinRelativeErr, MeanRelativeErr, NormRelativeErr`` (``|diff / bench| × 100`` as a ``%`` string).

Real-data (tensor) mode, on flattened float64 copies: ``Cosine``, ``EucDist``, ``MaxAbsErr``, ``MaxRelativeErr``,
``One Thousandth Err Ratio``, ``Five Thousandths Err Ratio``.

Besides msprobe's columns every pair also gets :func:`relative_error`, the single number the verdicts use.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    import numpy as np

NA, NAN_STR, UNSUPPORTED = "N/A", "Nan", "unsupported"
STAT_DIFF_COLUMNS = ("Max diff", "Min diff", "Mean diff", "L2norm diff")
STAT_REL_COLUMNS = ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr")
TENSOR_COLUMNS = ("Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio",
                  "Five Thousandths Err Ratio")


def _cls(v: Any) -> str:
    if v is None or v == NA:
        return "na"
    if isinstance(v, bool):
        return "num"
    if isinstance(v, (int, float)):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return "num"
    s = str(v).strip().lower()
    if s in ("nan",):
        return "nan"
    if s in ("inf", "infinity"):
        return "inf"
    if s in ("-inf", "-infinity"):
        return "-inf"
    try:
        float(s)
        return "num"
    except ValueError:
        return "other"


def stat_diff(target: Any, bench: Any) -> tuple[Any, Any]:
    """One statistic: ``(diff, relative error string)`` with msprobe's special cases."""
    if type(target) is float and type(bench) is float and math.isfinite(target) and math.isfinite(bench):
        # the common case, without the string classification below (same results)
        if target == bench and math.copysign(1.0, target) == math.copysign(1.0, bench):
            return 0, 0
        diff = target - bench
        return (diff, "inf") if bench == 0 else (diff, f"{abs(diff / bench) * 100}%")
    if str(target) == str(bench):
        return 0, 0
    ct, cb = _cls(target), _cls(bench)
    if ct == "na" or cb == "na":
        return NA, NA
    if ct == "nan" or cb == "nan":
        return NAN_STR, NAN_STR
    if ct in ("inf", "-inf") or cb in ("inf", "-inf"):
        if ct == "inf":
            return "inf", "inf"
        if ct == "-inf":
            return "-inf", "-inf"
        return ("-inf", "-inf") if cb == "inf" else ("inf", "inf")
    if ct == "other" or cb == "other":
        return "Diff", "Diff"
    t, b = float(target), float(bench)
    diff = t - b
    if b == 0:
        return diff, "inf"
    return diff, f"{abs(diff / b) * 100}%"


def number_cells(values: tuple) -> str | None:
    """``",".join(map(str, values))`` for finite floats and ints (a float's ``repr``: the shortest text that
    reads back as the same float, as :mod:`csv` writes it), formatted by ``orjson`` (several times faster than
    ``repr`` one value at a time) and brought to ``repr``'s notation where the two differ: ``orjson`` writes
    ``0.0000123`` and ``2.5e-7`` where ``repr`` writes ``1.23e-05`` and ``2.5e-07``, the same digits. None when a
    value is anything else (``None``, a bool, a string, ``nan``/``inf``, an integer past 64 bits): the caller
    formats those one by one. A property test holds it equal to ``str``."""
    try:
        s = orjson.dumps(values).decode()
    except TypeError:
        return None
    if "null" in s or "true" in s or "false" in s or '"' in s:  # nan, inf, None; a bool; a string
        return None
    s = s[1:-1]
    if "e-" in s or "0.0000" in s:  # only the cells that need it are rewritten (string operations, no regex)
        cells = s.split(",")
        for i, c in enumerate(cells):
            if "e-" in c:
                if c[-2] == "-":  # a one-digit exponent: repr writes two
                    cells[i] = c[:-1] + "0" + c[-1]
            elif c.startswith("0.0000") or c.startswith("-0.0000"):
                cells[i] = _scientific(c)
        s = ",".join(cells)
    return s


def _scientific(cell: str) -> str:
    """``0.0000123`` -> ``1.23e-05``: repr's notation below 1e-4 (orjson writes fixed notation down to 1e-5)."""
    sign = "-" if cell[0] == "-" else ""
    body = cell[len(sign) + 2:]  # the digits after "0."
    digits = body.lstrip("0")
    exp = len(body) - len(digits) + 1
    return f"{sign}{digits[0]}.{digits[1:]}e-{exp:02d}" if len(digits) > 1 else f"{sign}{digits}e-{exp:02d}"


def stats_metrics(t_stats: tuple, b_stats: tuple) -> dict[str, Any]:
    """The eight statistics-mode columns for one pair of (Max, Min, Mean, Norm)."""
    out: dict[str, Any] = {}
    for i, (dc, rc) in enumerate(zip(STAT_DIFF_COLUMNS, STAT_REL_COLUMNS)):
        out[dc], out[rc] = stat_diff(t_stats[i], b_stats[i])
    return out


def stats_pair(t_stats: tuple, b_stats: tuple, numel: int, t_max: float, tiny: float) -> tuple[dict[str, Any], float]:
    """``(stats_metrics(t_stats, b_stats), relative_error_stats(t_stats, b_stats, numel, t_max, tiny))`` in one
    pass: the same values (a test holds them equal), computed inline when all eight statistics are finite floats
    and the bench's Max and Min lie within ``±t_max`` (the common row), else by the two functions."""
    t0, t1, t2, t3 = t_stats
    b0, b1, b2, b3 = b_stats
    isfinite = math.isfinite
    if not (type(t0) is float and type(t1) is float and type(t2) is float and type(t3) is float
            and type(b0) is float and type(b1) is float and type(b2) is float and type(b3) is float
            and isfinite(t0 + t1 + t2 + t3) and isfinite(b0 + b1 + b2 + b3)  # a finite sum: finite terms
            and b0 <= t_max and b1 >= -t_max):
        return stats_metrics(t_stats, b_stats), relative_error_stats(t_stats, b_stats, numel, t_max, tiny)
    copysign = math.copysign
    root = math.sqrt(numel if numel > 1 else 1)
    rms = abs(b3) / root
    if rms < tiny:
        rms = tiny
    norm_floor = tiny * root
    cols: dict[str, Any] = {}
    worst = 0.0
    pct_cols, pct = [], []  # the relative errors' text, formatted at once below
    for dc, rc, t, b, floor in (("Max diff", "MaxRelativeErr", t0, b0, rms),
                                ("Min diff", "MinRelativeErr", t1, b1, rms),
                                ("Mean diff", "MeanRelativeErr", t2, b2, rms),
                                ("L2norm diff", "NormRelativeErr", t3, b3, max(rms, norm_floor))):
        if t == b and copysign(1.0, t) == copysign(1.0, b):
            cols[dc] = cols[rc] = 0
            continue
        diff = t - b
        cols[dc] = diff
        if b == 0:
            cols[rc] = "inf"
        else:
            cols[rc] = None  # its place in msprobe's column order
            pct_cols.append(rc)
            pct.append(abs(diff / b) * 100)
        d = abs(diff)
        if d != 0.0:
            scale = abs(b)
            if scale < floor:
                scale = floor
            e = d / scale if scale > 0 else math.inf
            if e > worst:
                worst = e
    if pct:  # f"{x}%", as stat_diff writes it (a ratio that overflows to inf goes through str)
        text = number_cells(tuple(pct))
        for rc, cell in zip(pct_cols, text.split(",") if text is not None else map(str, pct)):
            cols[rc] = cell + "%"
    return cols, worst


def to_array(tensor) -> np.ndarray:
    """msprobe's reader: detach, bf16/fp8 → float32, numpy, squeeze. Complex tensors are compared as complex:
    their (real, imaginary) pairs (``torch.view_as_real``, a trailing axis of 2), never cast to real."""
    import numpy as np  # the tensor path only: a statistics compare does not load numpy
    import torch

    t = tensor.detach().cpu()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dtype in (torch.bfloat16,) or "float8" in str(t.dtype):
        t = t.float()
    return np.squeeze(t.numpy())


def tensor_metrics(n: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """The six real-data columns for one pair of arrays (already squeezed)."""
    import numpy as np  # the tensor path only: a statistics compare does not load numpy

    if n.size == 0 or b.size == 0:
        return {c: UNSUPPORTED for c in TENSOR_COLUMNS}
    if n.shape != b.shape:
        return {c: "shape unmatched" for c in TENSOR_COLUMNS}
    working = np.result_type(n.dtype, b.dtype, np.float32)
    eps = float(np.finfo(working).eps) if np.issubdtype(working, np.floating) else float(np.finfo(np.float32).eps)
    n64 = n.astype(np.float64).reshape(-1)
    b64 = b.astype(np.float64).reshape(-1)
    if n.dtype == bool or b.dtype == bool:
        n64, b64 = n64.astype(np.float64), b64.astype(np.float64)
    n_bad, b_bad = ~np.isfinite(n64), ~np.isfinite(b64)
    if n_bad.any() or b_bad.any():
        same = (np.array_equal(np.isnan(n64), np.isnan(b64)) and np.array_equal(np.isposinf(n64), np.isposinf(b64))
                and np.array_equal(np.isneginf(n64), np.isneginf(b64)))
        if not same:
            return {c: NA for c in TENSOR_COLUMNS}
        n64 = np.where(n_bad, 0.0, n64)
        b64 = np.where(b_bad, 0.0, b64)
    zero_dim = n.ndim == 0
    out: dict[str, Any] = {}
    if zero_dim or n64.size == 1:
        out["Cosine"] = UNSUPPORTED
    else:
        nn, nb = np.linalg.norm(n64), np.linalg.norm(b64)
        if nn <= np.finfo(np.float64).eps and nb <= np.finfo(np.float64).eps:
            out["Cosine"] = 1.0
        elif nn <= np.finfo(np.float64).eps or nb <= np.finfo(np.float64).eps:
            out["Cosine"] = NAN_STR
        else:
            cos = float(np.dot(n64, b64) / (nn * nb))
            cos = round(cos, 12)
            out["Cosine"] = round(cos, 6) if cos > 0.9999 else cos
    out["EucDist"] = UNSUPPORTED if zero_dim else float(np.linalg.norm(n64 - b64))
    abs_err = np.abs(n64 - b64)
    out["MaxAbsErr"] = round(float(abs_err.max()), 12)
    # relative error in the working dtype (float32 for fp32/bf16/fp16 data), as msprobe computes it
    nw, bw = n64.astype(working), b64.astype(working)
    zero = bw == 0
    nw = np.where(zero, nw + working.type(eps), nw)
    bw = np.where(zero, bw + working.type(eps), bw)
    rel = np.abs((nw - bw) / bw)
    out["MaxRelativeErr"] = round(float(rel.max()), 12)
    if zero_dim:
        out["One Thousandth Err Ratio"] = out["Five Thousandths Err Ratio"] = UNSUPPORTED
    else:
        out["One Thousandth Err Ratio"] = float(np.sum(rel < 0.001) / rel.size)
        out["Five Thousandths Err Ratio"] = float(np.sum(rel < 0.005) / rel.size)
    return out


def relative_error_arrays(n: np.ndarray, b: np.ndarray, tiny: float = 0.0) -> float:
    """``‖target − bench‖₂ / max(‖bench‖₂, √numel · tiny)`` in float64; NaN/Inf at identical positions ignored,
    else ``inf``. ``tiny``: the coarser dtype's smallest normal (:func:`msprobe_ci.dtypes.smallest_normal`), so
    data in the subnormal range, where one rounding errs by ``u · tiny`` absolute, does not read as a large
    relative error (default 0: plain relative error)."""
    import numpy as np  # the tensor path only: a statistics compare does not load numpy

    if n.shape != b.shape:
        return math.inf
    n64 = n.astype(np.float64).reshape(-1)
    b64 = b.astype(np.float64).reshape(-1)
    if n64.size == 0:
        return 0.0
    n_bad, b_bad = ~np.isfinite(n64), ~np.isfinite(b64)
    if n_bad.any() or b_bad.any():
        if not np.array_equal(n_bad, b_bad) or not np.array_equal(n64[n_bad], b64[b_bad]) and \
                not (np.isnan(n64[n_bad]) == np.isnan(b64[b_bad])).all():
            return math.inf
        n64, b64 = n64[~n_bad], b64[~b_bad]
    diff = float(np.linalg.norm(n64 - b64))
    scale = max(float(np.linalg.norm(b64)), math.sqrt(n64.size) * tiny)
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def relative_error_stats(t_stats: tuple, b_stats: tuple, numel: int, t_max: float | None = None,
                         tiny: float = 0.0) -> float:
    """Statistics-mode stand-in for the relative error: the worst of Max, Min, Mean and Norm, each measured
    against ``max(|bench statistic|, bench RMS)`` (RMS = Norm/√numel keeps near-zero Means and Mins from
    exploding). Missing statistics are skipped; a non-finite target statistic where the bench is finite is
    ``inf``.

    ``t_max`` is the largest finite value the target could hold (``torch.finfo(dtype).max`` of its dtype, or of a
    narrower one its data went through: :func:`msprobe_ci.compare.drift.carried_range`). Where the bench holds
    values beyond it (its Max above ``t_max`` or its Min below ``-t_max``, as an attention mask filled with
    ``finfo(float32).min`` does against one filled with ``finfo(float16).min``), the target cannot hold them: it
    stores ``±t_max``, rounds them to ``±inf``, or holds its own sentinel, scaled as the bench's was (CodeGen
    divides masked scores by √d: -65504/4 against -8.5e37). That statistic is then not compared, and neither are
    Mean and Norm, which add up the values the target cannot hold (and overflow to ``inf`` on the bench); the
    statistic on the other side, within range, is.

    ``tiny`` is the coarser dtype's smallest normal (:func:`msprobe_ci.dtypes.smallest_normal`; fp16 2^-14).
    Below it one rounding errs by up to ``u · tiny`` absolute (gradual underflow), so Max, Min and Mean are
    measured against at least ``tiny`` and Norm against at least ``√numel · tiny``: fp16 data of 1e-6 (a
    ConvNeXt layer scale) rounds by 1%, which is the dtype's rounding, not a 1% error (default 0)."""
    if t_max is not None and _beyond(b_stats, t_max):
        hi, lo = _number(b_stats[0]), _number(b_stats[1])
        keep_hi = hi is None or hi <= t_max
        keep_lo = lo is None or lo >= -t_max
        t_stats = (t_stats[0] if keep_hi else None, t_stats[1] if keep_lo else None, None, None)
        b_stats = (b_stats[0] if keep_hi else None, b_stats[1] if keep_lo else None, None, None)
    norm_b = b_stats[3]
    if type(norm_b) is float and math.isfinite(norm_b):
        rms = abs(norm_b) / math.sqrt(max(numel, 1))
    else:
        rms = abs(float(norm_b)) / math.sqrt(max(numel, 1)) if _cls(norm_b) == "num" else 0.0
    if rms < tiny:
        rms = tiny  # for Norm, max(|Norm|, rms) with rms >= tiny is compared below with √numel·tiny
    norm_floor = tiny * math.sqrt(max(numel, 1))
    worst = 0.0
    last = len(t_stats) - 1
    for i, (t, b) in enumerate(zip(t_stats, b_stats)):
        if type(t) is float and type(b) is float and math.isfinite(t) and math.isfinite(b):
            d = abs(t - b)  # the common case, without the classification below (same results)
            if d != 0.0:
                scale = max(abs(b), rms, norm_floor) if i == last else max(abs(b), rms)
                worst = max(worst, d / scale if scale > 0 else math.inf)
            continue
        ct, cb = _cls(t), _cls(b)
        if ct == "na" or cb == "na" or ct == "other" or cb == "other":
            continue
        if ct != "num" or cb != "num":
            if ct == cb:
                continue
            return math.inf
        t, b = float(t), float(b)
        d = abs(t - b)
        if d == 0.0:
            continue
        scale = max(abs(b), rms, norm_floor) if i == last else max(abs(b), rms)
        worst = max(worst, d / scale if scale > 0 else math.inf)
    return worst


def norm_error(t_stats: tuple, b_stats: tuple, numel: int, t_max: float | None = None,
               tiny: float = 0.0) -> float:
    """The relative error of the L2 norm alone, ``|Norm_t - Norm_b| / max(|Norm_b|, sqrt(numel) * tiny)``, or NaN
    where it says nothing: either Norm missing or not finite, or the bench holding values beyond ``t_max`` (the
    target cannot hold them; see :func:`relative_error_stats`).

    Rounding every element once moves a norm by at most ``u`` relative, and noise that is not a change of scale
    moves it only to second order, while a fault that scales a tensor moves it by the whole factor: the drift
    rule's scale test (:mod:`msprobe_ci.compare.verdict`) judges this error against the inputs' own."""
    if t_max is not None and _beyond(b_stats, t_max):
        return math.nan
    t, b = t_stats[3], b_stats[3]
    if type(t) is not float or type(b) is not float:  # the common row has floats: no conversion
        t, b = _number(t), _number(b)
        if t is None or b is None:
            return math.nan
    if not (math.isfinite(t) and math.isfinite(b)):
        return math.nan
    d = abs(t - b)
    if d == 0.0:
        return 0.0
    scale = max(abs(b), tiny * math.sqrt(max(numel, 1)))
    return d / scale if scale > 0 else math.inf


def _number(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _beyond(b_stats: tuple, t_max: float) -> bool:
    """The bench's Max is above ``t_max`` or its Min below ``-t_max`` (infinities included)."""
    hi, lo = b_stats[0], b_stats[1]
    if type(hi) is float and type(lo) is float:  # the common case
        return hi > t_max or lo < -t_max
    hi, lo = _number(hi), _number(lo)
    return (hi is not None and hi > t_max) or (lo is not None and lo < -t_max)
