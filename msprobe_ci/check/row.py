"""The summary row of one check (or one step or rank of it), typed: what the terminal summary, JUnit XML,
report.html and the CI job summary read, and what ``msprobe-result.json`` holds.

A mode builds its row as a dict while it judges (fields arrive from several places); its
:class:`~msprobe_ci.check.conclude.Conclusion` freezes it into a :class:`CheckRow`, the fixture stamps the verdict
the Conclusion decided on it (:meth:`CheckRow.stamped`), and every front end reads that one field through
:attr:`CheckRow.failed`. Each judged part is a frozen result that knows its verdict (``bool(result)``: it passes)
and what would have passed (:attr:`NodeRow.threshold` against :attr:`NodeRow.value`, Polygraphy's habit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import MsprobeError
from ..status import ERROR
from ..typed import from_json as _from


@dataclass(frozen=True)
class NodeRow:
    """One compared node's verdict (a JUnit testcase).

    Attributes:
        name: the node (``Functional.linear.3.forward``). status: ``pass``/``warning``/``error``/``skip``/``unmatched``.
        metric, value, threshold: the metric that decided, its value and the threshold it was held to (``value`` is
            what a threshold would have had to be to pass); numbers, or ``"inf"``/``"nan"`` (JSON has none).
        input_error: the error of its inputs. worst_row: the output row that decided. message: one line why.
        standard: the per-API standard of an isolated verdict. drift, drift_status: the node's drift from the bench
            (context for an isolated verdict). seconds: what judging it took.
    """

    name: str
    status: str
    metric: str = ""
    value: Any = None
    threshold: Any = None
    input_error: Any = None
    worst_row: str = ""
    message: str = ""
    standard: str = ""
    drift: Any = None
    drift_status: str = ""
    seconds: float = 0.0

    def __bool__(self) -> bool:
        return self.status != ERROR


@dataclass(frozen=True)
class ModelCase:
    """A model-level output compared end to end (the loss, the logits): relative L2 error against the
    ``output_rtol`` tolerance (``value`` is the tolerance that would have passed)."""

    name: str
    status: str
    metric: str = ""
    value: Any = None
    threshold: Any = None
    message: str = ""

    def __bool__(self) -> bool:
        return self.status != ERROR


@dataclass(frozen=True)
class ApiCheckRow:
    """One call of the per-API pre-check of a tensor dump."""

    name: str
    status: str
    message: str = ""

    def __bool__(self) -> bool:
        return self.status != ERROR


@dataclass(frozen=True)
class CheckRow:
    """One check's summary (a loop has one per step, a multi-rank check one per rank and step).

    Attributes:
        test, index, dir: the test's node id, the check's index in it (``"0"``, ``"0 step2"``, ``"0 rank1"``), its
            artifacts folder.
        bench, target, mode, level, bench_kernel: what ran (``mode``: ``statistics``/``tensor``/``md5``,
            ``free_benchmark``, ``monitor``).
        verdict, failure: the verdict the check's :class:`~msprobe_ci.check.conclude.Conclusion` decided
            (``pass``/``fail``; None on a row not yet published) and its failure's first line.
        error: the check raised before it concluded. skipped: why nothing was compared (an absent device).
        recorded, baseline, baseline_bytes: a recording run (``--msprobe-record``) and the baseline it wrote.
        csv, graph: the compare CSV and the ``.vis.db``.
        nodes_compared, counts, nodes: nodes compared, ``{status: count}``, each node's :class:`NodeRow`.
        model, api_checks: the :class:`ModelCase` and :class:`ApiCheckRow` results.
        first_divergence, first_where, replay: the first diverging node, where it was called, a replay command.
        overflow_first, overflow_failed, overflow_message: the first NaN/Inf node, whether it fails (the bench has
            none there), the line saying so.
        isolated: verdicts isolated per API. unapplied: faults that never fired. notes: lines to show.
        coverage, isolation_budget: coverage.json's share and largest gaps; a budgeted isolation's summary.
        step, rank, rank_first, rank_divergence: a loop step's / a rank's row: which, whether that rank diverged
            first, the cross-rank answer for it.
        loss_bench, loss_target, grads: a training step's losses and gradient records (context).
        token_agrees: a generation step's greedy token agreement (context).
        started: when the check started (ISO 8601), where known.
        extra: fields of no name here (a newer version's, or a mode's own), kept as they are.
    """

    test: str
    index: Any
    dir: str = ""
    bench: str = ""
    target: str = ""
    mode: str = ""
    level: str = ""
    bench_kernel: str | None = None
    verdict: str | None = None
    failure: str | None = None
    error: str | None = None
    skipped: str | None = None
    recorded: bool = False
    baseline: str | None = None
    baseline_bytes: int | None = None
    csv: str = ""
    graph: str | None = None
    nodes_compared: int = 0
    counts: Mapping[str, int] = field(default_factory=dict)
    nodes: tuple[NodeRow, ...] = ()
    model: tuple[ModelCase, ...] = ()
    api_checks: tuple[ApiCheckRow, ...] = ()
    first_divergence: str | None = None
    first_where: str | None = None
    replay: str | None = None
    overflow_first: str | None = None
    overflow_failed: bool = False
    overflow_message: str = ""
    isolated: bool = False
    unapplied: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    coverage: Mapping[str, Any] | None = None
    isolation_budget: Mapping[str, Any] | None = None
    step: int | None = None
    rank: int | None = None
    rank_first: bool = False
    rank_divergence: str | None = None
    loss_bench: float | None = None
    loss_target: float | None = None
    grads: tuple | None = None
    token_agrees: bool | None = None
    started: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ the verdict
    @property
    def step_failed(self) -> bool:
        """Whether this row's own evidence fails (one step or rank of a loop or multi-rank check): a first
        divergence, a new overflow, a fault that never fired, a failing model-level case or per-API pre-check."""
        return bool(self.first_divergence or self.overflow_failed or self.unapplied or
                    not all(self.model) or not all(self.api_checks))

    @property
    def failed(self) -> bool:
        """Whether the check this row belongs to failed its test: the verdict its Conclusion decided, stamped on
        every row it published (:attr:`verdict`: a fault that never fired, coverage short under
        ``--msprobe-require-coverage``, a check that raised included). A row without the stamp (an older version's)
        falls back to its own evidence (:attr:`step_failed`)."""
        if self.verdict in ("pass", "fail"):
            return self.verdict == "fail"
        return self.step_failed

    def __bool__(self) -> bool:
        return not self.failed

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_json(cls, d: Any, where: str = "msprobe-result.json") -> "CheckRow":
        """A row from its JSON object (``msprobe-result.json``, or a mode's dict).

        Raises:
            MsprobeError: not an object, ``test`` or ``index`` missing, a node/model/api-check entry that is not an
                object with ``name`` and a known ``status`` (``where`` names the file in the message).
        """
        if not isinstance(d, Mapping):
            raise MsprobeError(f"{where}: expected an object, got {type(d).__name__}")
        d = dict(d)
        for key, kind in (("nodes", NodeRow), ("model", ModelCase), ("api_checks", ApiCheckRow)):
            items = d.get(key) or ()
            if not isinstance(items, (list, tuple)):
                raise MsprobeError(f"{where}: {key}: expected a list, got {type(items).__name__}")
            d[key] = tuple(x if isinstance(x, kind) else _from(kind, x, f"{where}: {key}[{i}]")
                           for i, x in enumerate(items))
        for key in ("unapplied", "notes"):
            d[key] = tuple(d.get(key) or ())
        if d.get("grads") is not None:
            d["grads"] = tuple(d["grads"])
        return _from(cls, d, where)

    def as_json(self) -> dict[str, Any]:
        """The JSON object (every field; ``extra``'s fields at the top level, as they came)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        for key in ("nodes", "model", "api_checks"):
            out[key] = [dataclasses.asdict(x) for x in out[key]]
        for key in ("unapplied", "notes"):
            out[key] = list(out[key])
        if out["grads"] is not None:
            out["grads"] = list(out["grads"])
        out["counts"] = dict(out["counts"])
        return {**self.extra, **out}

    def stamped(self, failure: str | None) -> "CheckRow":
        """This row with the verdict of its check (``failure``: the Conclusion's, None when it passed)."""
        return dataclasses.replace(self, verdict="fail" if failure else "pass",
                                   failure=failure.splitlines()[0] if failure else None)
