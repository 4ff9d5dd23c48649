"""Overflow / NaN-Inf checks on a dump: msprobe's anomaly levels and the first anomalous node.

Levels (``shared/spec/compare-overflow-visualization.md`` §2.1; first matching scene wins):

========  =============================================================================================
critical  no anomaly in the inputs, anomaly in the output (the node itself produced the NaN/Inf)
high      anomaly in the inputs and in the output, or a numerical mutation: the largest output Norm is
          more than 100× the largest input Norm (input Norms all 0: output Norm > 100)
medium    anomaly in the inputs only
========  =============================================================================================

A record is anomalous when its ``Max`` or ``Min`` is ``inf``, ``-inf`` or ``nan``: the tensor's own values (Mean only
where a record has neither, Norm never). Departure from msprobe, which reads Mean too: a finite tensor near the
dtype's max (an fp32 ``-1e38`` mask) has a Mean that overflows when it is summed in its own dtype, as msprobe does,
and that is no overflow of the model; any NaN or Inf element shows in Max or Min. Outputs of ``Torch.empty*`` are
ignored (uninitialised memory).

**Overflow** means NaN/Inf, one rule for the CLI, the pytest plugin and the graphs: a numerical mutation (a norm
jump with every value finite) is reported as a ``norm_jump`` anomaly, which msprobe's graphs colour as ``high``,
but it is never an overflow: :attr:`OverflowReport.overflows`, :attr:`OverflowReport.first` and
:attr:`OverflowReport.has_overflow` see NaN/Inf only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

from .dump.reader import Dump

LEVELS = ("critical", "high", "medium")
_IGNORED_OUTPUT = ("Torch.empty", "Torch.empty_like", "Torch.empty_strided", "Tensor.new_empty")


@dataclass(frozen=True)
class Anomaly:
    """One anomalous node: its name, level, and the rows (``input``/``output`` paths) that are NaN/Inf.

    ``rows`` is empty for a norm jump (:attr:`is_overflow` False): finite values whose output Norm is over 100x the
    largest input Norm.
    """

    name: str
    level: str
    rows: tuple[str, ...]

    @property
    def is_overflow(self) -> bool:
        """True for NaN/Inf; False for a norm jump."""
        return bool(self.rows)

    @property
    def message(self) -> str:
        if not self.rows:
            return f"{self.name}: norm jump (output Norm > 100x the input Norm; all values finite, not an overflow)"
        return f"{self.name}: {self.level} overflow (NaN/Inf in {', '.join(self.rows[:4])})"


def _bad(v: Any) -> bool:
    return str(v).strip().lower() in ("inf", "-inf", "nan", "infinity", "-infinity")


def anomalous(record: dict) -> bool:
    """Whether a tensor record holds NaN/Inf: its Max or Min is non-finite (Mean only where both are absent)."""
    ext = (record.get("Max"), record.get("Min"))
    if any(v is not None for v in ext):
        return any(_bad(v) for v in ext)
    return _bad(record.get("Mean"))


def _records(value: Any, path: str) -> Iterator[tuple[str, dict]]:
    if isinstance(value, dict) and ("dtype" in value or "type" in value):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _records(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _records(v, f"{path}.{i}")


#: communication ops whose first argument is a receive buffer: its contents before the op are not data
#: (``torch.empty`` memory may hold NaN/Inf), so they are no input anomaly
_RECEIVE_BUFFER_OPS = tuple(f"Distributed.{op}." for op in (
    "recv", "irecv", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "all_to_all", "all_to_all_single"))  # (the *_single names are also functional collectives, whose first
#                                           argument is data: their NaN shows at the op that made it anyway)


def _sides(entry: dict, name: str) -> tuple[list, list]:
    if "input" in entry or "output" in entry and "input_args" not in entry:
        ins = list(_records(entry.get("input") or [], "input"))
    else:
        ins = list(_records(entry.get("input_args") or [], "input")) + \
            list(_records(entry.get("input_kwargs") or {}, "input"))
    if name.startswith(_RECEIVE_BUFFER_OPS):
        ins = [(p, r) for p, r in ins if p != "input.0" and not p.startswith("input.0.")]
    outs = list(_records(entry.get("output") or [], "output"))
    return ins, outs


def check_entry(name: str, entry: Any) -> Anomaly | None:
    """The anomaly level of one dump entry, or None."""
    if not isinstance(entry, dict):
        return None
    if ".parameters_grad" in name:
        outs = list(_records(entry, "parameters_grad"))
        bad = [p for p, r in outs if anomalous(r)]
        return Anomaly(name, "critical", tuple(bad)) if bad else None
    ins, outs = _sides(entry, name)
    bad_in = [p for p, r in ins if anomalous(r)]
    bad_out = [p for p, r in outs if anomalous(r)]
    if any(name.startswith(p + ".") for p in _IGNORED_OUTPUT):
        bad_out = []
    if bad_out and not bad_in:
        return Anomaly(name, "critical", tuple(bad_out))
    if bad_out and bad_in:
        return Anomaly(name, "high", tuple(bad_in + bad_out))
    if bad_in:
        return Anomaly(name, "medium", tuple(bad_in))
    norms_in = [_num(r.get("Norm")) for _, r in ins if r.get("type") == "torch.Tensor"]
    norms_out = [_num(r.get("Norm")) for _, r in outs if r.get("type") == "torch.Tensor"]
    norms_in = [abs(n) for n in norms_in if n is not None]
    norms_out = [abs(n) for n in norms_out if n is not None]
    if norms_in and norms_out:
        mi, mo = max(norms_in), max(norms_out)
        if (mi == 0 and mo > 100) or (mi > 0 and mo / mi > 100):
            return Anomaly(name, "high", ())
    return None


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


@dataclass(frozen=True)
class OverflowReport:
    """All anomalies of a dump (NaN/Inf and norm jumps), in execution order."""

    anomalies: tuple[Anomaly, ...]

    @property
    def overflows(self) -> tuple[Anomaly, ...]:
        """The NaN/Inf anomalies only."""
        return tuple(a for a in self.anomalies if a.is_overflow)

    @property
    def jumps(self) -> tuple[Anomaly, ...]:
        """Norm jumps (finite values): context for a reader, never an overflow."""
        return tuple(a for a in self.anomalies if not a.is_overflow)

    @property
    def first(self) -> Anomaly | None:
        """The first node where NaN/Inf appears (the first ``critical``; else the first overflow of any level);
        None without NaN/Inf."""
        ovs = self.overflows
        crit = [a for a in ovs if a.level == "critical"]
        return crit[0] if crit else (ovs[0] if ovs else None)

    @property
    def has_overflow(self) -> bool:
        """True when any node produced or carried NaN/Inf (norm jumps do not count)."""
        return bool(self.overflows)

    def __bool__(self) -> bool:
        return not self.has_overflow


def new_overflows(target: OverflowReport, bench: OverflowReport) -> OverflowReport:
    """Anomalies of the target that the bench does not have at the same node and level (NaN/Inf that a model
    produces by design, such as ``-inf`` attention masks, appear on both sides and are not blamed)."""
    seen = {(a.name, a.level, a.rows) for a in bench.overflows}
    return OverflowReport(tuple(a for a in target.overflows if (a.name, a.level, a.rows) not in seen))


def check_overflow(dump: Dump) -> OverflowReport:
    """Scan every entry of ``dump`` in order."""
    found = [a for a in (check_entry(k, e) for k, e in dump.data.items()) if a is not None]
    return OverflowReport(tuple(found))
