"""The isolation's record book (one record per judged node, what could not be judged, how long each judgement
took) and what the capture that drives an isolator lends it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..checkers import worst
from ..judge import finite_peak
from ..judge.fields import verdict_fields


def _as_is(fn):
    """An isolator's hook wrapper when no capture drives it (a reproduction run alone): the hook as it is."""
    return fn


def _ignored(fault, before, after) -> None:
    """No log of the faults applied at a tap (an isolator no capture drives)."""


@dataclass
class Loans:
    """What the capture that drives an isolator lends it (:meth:`msprobe_ci.isolate.Isolator.attach`).

    Attributes:
        quiet: wraps the isolation's own autograd hooks (their ops are the machinery's, not the model's: the
            capture's coverage leaves them out); alone (a reproduction) a hook runs as it is.
        on_fault_applied: ``(fault, before, after)``, called when a fault is applied at a tap.
        reproducer: writes each failing call's standalone reproduction
            (:class:`msprobe_ci.capture.repro.Reproducer`); ``None``: none written.
    """

    quiet: Callable = _as_is
    on_fault_applied: Callable = _ignored
    reproducer: Any = None


class Records:
    """One step's isolation records, by node name (``Functional.linear.0.forward``).

    Attributes:
        results: ``{node: record}``; a record holds ``status`` (pass/warning/error/skip), ``standard``, ``metric``,
            ``value``, ``threshold``, ``row``, ``message``, ``metrics``, ``seconds`` and, for forward calls,
            ``sources`` (``{row: {"id", "kind"}}``).
        unjudged: ``{node: why}``: calls that computed but could not be judged (their oracle or bench failed),
            over the whole run; the capture counts them as unseen in its coverage figure.
    """

    def __init__(self):
        self.unjudged: dict[str, str] = {}
        self.reset()

    def reset(self) -> None:
        """A new step: no record, no clock."""
        self.results: dict[str, dict] = {}
        self._clock: dict[str, float] = {}  # node -> perf_counter() when its isolation began

    def start(self, name: str) -> None:
        """The judgement of ``name`` begins now (its record's ``seconds`` count from here)."""
        self._clock[name] = time.perf_counter()

    def skip(self, name: str, reason: str) -> None:
        """``name`` is not judged, for ``reason``."""
        self.results[name] = {"status": "skip", "message": reason}

    def unjudgeable(self, name: str, message: str) -> None:
        """``name`` computed but its references could not run: said in its record and counted as unseen."""
        self.results[name].update(message=message)
        self.unjudged[name] = message

    def store(self, name: str, results: list, refs: dict | None = None) -> None:
        """Keep the verdict of ``name`` (its worst row) from ``results`` (``[(row, CheckResult)]``); ``refs``
        (``{row: reference tensor}``) give the magnitude of a failing row, said in the message when values are
        near zero (below 1e-3)."""
        keep = self.results.get(name, {})
        start = self._clock.pop(name, None)
        status = worst([r for _, r in results]) if results else "skip"
        bad = next(((row, r) for row, r in results if r.status == status), results[0] if results else None)
        rec = {"status": status, "sources": keep.get("sources", {})}
        for k in ("oracle", "autocast", "computed_in"):
            if keep.get(k):
                rec[k] = keep[k]
        if bad is None:
            rec["message"] = "no output judged"
        else:
            row, r = bad
            rec.update(verdict_fields(row, r))
            ref = (refs or {}).get(row)
            if status == "error" and isinstance(ref, torch.Tensor) and ref.numel() and ref.is_floating_point():
                mag = finite_peak(ref)
                rec["magnitude"] = mag
                if mag < 1e-3:
                    rec["message"] += f"; values near zero: max |reference| {mag:.3g}"
        if start is not None:
            rec["seconds"] = round(time.perf_counter() - start, 6)
        self.results[name] = rec
