"""A dump's ``isolation.json`` (written by capture with an :class:`~msprobe_ci.isolate.Isolator`): its node records
(:func:`load_isolation`, each an :class:`IsolationRecord`) and its budgeted isolation's figures
(:func:`load_budget`, :func:`describe_budget`).

The isolator builds each record as a JSON object while the step runs (fields arrive from the judgement, the
reproducer, the quantization rows); every reader takes it as a frozen :class:`IsolationRecord`, checked field by
field: the file may come from another team's runner."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import MsprobeError
from ..status import ERROR
from ..typed import from_json, is_number

ISOLATION_FILE = "isolation.json"


@dataclass(frozen=True)
class IsolationRecord:
    """One node's isolated verdict: the API (or module, or collective) judged by its own standard on its own
    inputs while the target ran (:class:`msprobe_ci.isolate.Isolator`).

    Attributes:
        status: ``pass``/``warning``/``error``/``skip`` (:mod:`msprobe_ci.status`); ``bool(record)``: not an error.
        message: one line why (for a skip, why nothing was judged).
        standard: the per-API standard that judged it (``benchmark``, ``ulp``, ...). metric, value, threshold:
            the headline metric, its value and the threshold it was held to (``value`` is the threshold that would
            have passed, Polygraphy's habit); numbers, or ``"inf"``/``"-inf"``/``"nan"``.
        row: the output row that decided (``<node>.output.0``). metrics: every metric of that row.
        sources: ``{input row: {"id", "kind"}}``: the inputs no captured call produced (parameters, buffers, model
            inputs) and scalars, judged against the bench dump at compare time.
        seconds: what isolating it took. budget: left out by budgeted isolation this step.
        rank: the rank whose record it is, in a merged TP/PP group. replayed: judged by replaying a tensor dump.
        extra: every other field as written (``oracle``, ``autocast``, ``computed_in``, ``magnitude``,
            ``quantization``, ``collective``, ``repro``).
    """

    status: str
    message: str = ""
    standard: str | None = None
    metric: str | None = None
    value: Any = None
    threshold: Any = None
    row: str | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    seconds: float | None = None
    budget: bool = False
    rank: int | None = None
    replayed: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.status != ERROR

    @classmethod
    def from_json(cls, d: Any, where: str) -> "IsolationRecord":
        """A record from its JSON object, each field checked.

        Raises:
            MsprobeError: one line naming ``where`` and the field that is not what a record holds.
        """
        rec = from_json(cls, d, where)
        for name in ("message", "standard", "metric", "row"):
            v = getattr(rec, name)
            if v is not None and not isinstance(v, str):
                raise MsprobeError(f"{where}: field {name!r}: expected a string, got {type(v).__name__}")
        for name in ("value", "threshold", "seconds"):
            v = getattr(rec, name)
            if v is not None and not is_number(v):
                raise MsprobeError(f"{where}: field {name!r}: expected a number, got {v!r:.40}")
        for name in ("budget", "replayed"):
            if not isinstance(getattr(rec, name), bool):
                raise MsprobeError(f"{where}: field {name!r}: expected true or false")
        if rec.rank is not None and (not isinstance(rec.rank, int) or isinstance(rec.rank, bool)):
            raise MsprobeError(f"{where}: field 'rank': expected an integer")
        if not isinstance(rec.metrics, Mapping):
            raise MsprobeError(f"{where}: field 'metrics': expected an object")
        if not isinstance(rec.sources, Mapping) or not all(
                isinstance(v, Mapping) and isinstance(v.get("id"), str) and isinstance(v.get("kind", ""), str)
                for v in rec.sources.values()):
            raise MsprobeError(f"{where}: field 'sources': expected {{row: {{'id': str, 'kind': str}}}}")
        return rec

    @classmethod
    def of(cls, rec: "IsolationRecord | Mapping", where: str) -> "IsolationRecord":
        """``rec`` as a record: a record as it is, a JSON object through :meth:`from_json`."""
        return rec if isinstance(rec, cls) else cls.from_json(rec, where)


def load_isolation(folder: str) -> dict[str, IsolationRecord] | None:
    """``{node: record}`` from ``folder/isolation.json``, or ``None`` when the dump has none.

    Raises:
        MsprobeError: the file exists but is not an isolation record (one line naming the file, and the node and
            field where a record is not what it should be).
    """
    path = os.path.join(folder, ISOLATION_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise MsprobeError(f"{path}: not readable JSON ({exc})") from None
    nodes = raw.get("nodes") if isinstance(raw, dict) else None
    if not isinstance(nodes, dict) or not all(isinstance(v, dict) for v in nodes.values()):
        raise MsprobeError(f"{path}: expected {{'nodes': {{name: record}}}}")
    return {str(name): IsolationRecord.from_json(rec, f"{path}: node {name}") for name, rec in nodes.items()}


def load_budget(folder: str) -> dict | None:
    """The budgeted isolation's figures of the step in ``folder/isolation.json`` (its ``budget`` block,
    :meth:`msprobe_ci.isolate.budget.IsolationBudget.summary`), read without the nodes that follow it; ``None``
    where there is no file, no block, or the block is not a mapping."""
    import ijson

    path = os.path.join(folder, ISOLATION_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            block = next(ijson.items(fh, "budget", use_float=True), None)
    except (OSError, ijson.JSONError):
        return None
    return block if isinstance(block, dict) else None


def describe_budget(budget: dict) -> str:
    """One line for a step's budget figures (:func:`load_budget`): what was judged on its own inputs, what by the
    drift rule, and what the isolation cost."""
    calls, judged = int(budget.get("calls") or 0), int(budget.get("judged") or 0)
    share = judged / calls if calls else 1.0
    measured = budget.get("measured_factor")
    cost = ""
    if isinstance(measured, (int, float)):
        cost = f"; isolation cost {measured:.2f}x the capture alone"
        factor = budget.get("factor")
        if isinstance(factor, (int, float)) and measured > factor and judged <= int(budget.get("kinds") or 0):
            cost += " (above the factor asked: judging every API kind once a step costs that much here)"
        elif isinstance(factor, (int, float)) and measured > factor:
            cost += " (above the factor asked: the step's time is measured as it goes; the next step's share adapts)"
    return (f"budgeted isolation (factor {budget.get('factor')}): {judged} of {calls} API calls judged on their own "
            f"inputs ({share:.0%}: the first of each of {budget.get('kinds')} API kinds, the rest rotating over steps, "
            f"seed {budget.get('seed')!r}); the other {calls - judged} judged by the drift rule{cost}")
