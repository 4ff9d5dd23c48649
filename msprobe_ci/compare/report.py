"""What a compare produced: :class:`RowResult` per matched row, :class:`CompareReport` for a whole dump pair."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .rows import Row
from .verdict import CompareResult, Thresholds


@dataclass
class RowResult:
    """One compared row: the target row, its bench row (or None), msprobe's columns and our relative error."""

    target: Row
    bench: Row | None
    metrics: dict[str, Any]
    error: float
    norm_error: float = math.nan  # statistics mode: the Norm's own relative error (NaN: it says nothing)


@dataclass
class CompareReport:
    """Everything one compare produced.

    Attributes:
        mode: ``statistics``, ``tensor`` (msprobe's "all") or ``md5``.
        rows: per-row results in target dump order.
        nodes: node verdicts (one per target dump entry) in execution order.
        first_divergence: the earliest node whose own verdict is ``error``, or None.
        unmatched: target nodes without a bench counterpart.
    """

    mode: str
    rows: list[RowResult]
    nodes: list[CompareResult]
    target_stack: dict[str, list[str]] = field(default_factory=dict)
    thresholds: Thresholds = field(default_factory=Thresholds)
    isolated: bool = False
    seconds: dict[str, float] = field(default_factory=dict)  # node -> seconds its isolated verdict took
    frameworks: tuple[str, str] = ("pytorch", "pytorch")  # (target, bench), from dump.json
    entry_pairs: dict[str, str] = field(default_factory=dict)  # target entry -> bench entry (matched rows)
    replayed: list = field(default_factory=list)  # ApiResults of a tensor dump judged by replay (isolated.replay)
    _stack_cells: dict[int, tuple] = field(default_factory=dict, repr=False, compare=False)  # id -> (frames, cell)

    @property
    def first_divergence(self) -> CompareResult | None:
        """The earliest node whose own verdict is ``error``; a module that only contains a failing API (roll-up)
        is never the first divergence when that API is in the report."""
        errors = [n for n in self.nodes if n.status == "error"]
        own = [n for n in errors if "rollup" not in n.metrics]
        return (computed_first(own) or own or errors or [None])[0]

    @property
    def unmatched(self) -> list[str]:
        return [n.name for n in self.nodes if n.status == "unmatched"]

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("pass", "warning", "error", "unmatched")}
        for n in self.nodes:
            out[n.status] += 1
        return out

    def worst(self, k: int = 5) -> list[CompareResult]:
        """The ``k`` judged nodes with the largest value/threshold ratio, errors first."""
        judged = [n for n in self.nodes if n.status != "unmatched"]
        return sorted(judged, key=lambda n: -(n.value / n.threshold if n.threshold > 0 else math.inf))[:k]

    def __bool__(self) -> bool:
        return self.first_divergence is None

    def columns(self) -> list[str]:
        """The compare CSV's columns for this report's mode (msprobe's names)."""
        from .csvout import columns

        return columns(self.mode)

    def write_csv(self, out_dir: str, prefix: str = "compare_result") -> str:
        """Write ``<prefix>_<YYYYmmddHHMMSS>.csv`` with msprobe's columns; returns the path
        (:func:`msprobe_ci.compare.csvout.write_csv`)."""
        from .csvout import write_csv

        return write_csv(self, out_dir, prefix)



def accumulated(name: str) -> bool:
    """An accumulated parameter gradient (a ``parameters_grad`` entry). Such an entry stands where its parameter's
    gradient was first accumulated but holds the final sum: a weight tied to an embedding (BERT's decoder, T5's
    shared embedding) sums the gradients of calls made after its place in the dump, so its error is the first
    divergence only where no computed node fails."""
    return ".parameters_grad" in name


def computed_first(errors: list[CompareResult]) -> list[CompareResult]:
    """``errors`` without the :func:`accumulated` ones."""
    return [n for n in errors if not accumulated(n.name)]
