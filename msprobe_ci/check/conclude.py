"""The one conclude step: judged outcomes in, a frozen :class:`Conclusion` out (rows, properties, warnings, the
first failure).

Every mode ends here, so a problem is worded once and ranked once: faults that never fired, then the first
divergence, then a new overflow, the model-level outputs, the per-API pre-check, and coverage. Front ends map a
:class:`Conclusion` to their own terms: the pytest fixture publishes its rows and properties and fails the test
with :attr:`Conclusion.failure`; a script reads :attr:`Conclusion.passed`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..outputs import repro_command
from ..errors import MsprobeError
from .row import CheckRow

#: the property key of a check's summary row (its value: the row, published as ``msprobe-result.json``)
RESULT = "msprobe.result"


@dataclass(frozen=True)
class Conclusion:
    """What one check concluded, frozen.

    Attributes:
        value: what the check returns to its caller (a CompareReport, ``{rank: report}``, a loop's dict ...).
        properties: ``(name, value)`` pairs in order, for JUnit; a :data:`RESULT` pair carries a summary row
            (a :class:`~msprobe_ci.check.row.CheckRow`, frozen here from the dict a mode built).
        warnings: lines to warn about (coverage short of 1) before the failure, if any.
        failure: the first problem, a message whose first line names it (``None``: the check passed).
    """

    value: Any = None
    properties: tuple = ()
    warnings: tuple = ()
    failure: str | None = None

    def __post_init__(self):
        rows = tuple((k, CheckRow.from_json(v, f"{k} row") if k == RESULT and not isinstance(v, CheckRow) else v)
                     for k, v in self.properties)
        object.__setattr__(self, "properties", rows)

    @property
    def passed(self) -> bool:
        return self.failure is None

    def __bool__(self) -> bool:
        return self.failure is None

    @property
    def rows(self) -> list[CheckRow]:
        """The summary rows, in order."""
        return [v for k, v in self.properties if k == RESULT]


class Draft:
    """A conclusion being written: properties and warnings in order; the first failure set wins."""

    def __init__(self):
        self.properties: list = []
        self.warnings: list = []
        self.failure: str | None = None

    def fail(self, message: str | None) -> bool:
        """Record ``message`` as the failure unless one is set; return whether the draft has failed."""
        if message and self.failure is None:
            self.failure = message
        return self.failure is not None

    def done(self, value: Any = None) -> Conclusion:
        return Conclusion(value, tuple(self.properties), tuple(self.warnings), self.failure)


def publish(row: CheckRow) -> str:
    """Write one check's summary row to ``<check dir>/msprobe-result.json`` and return the path: a test report
    (and so pytest's own ``--junitxml``) carries the path, not a JSON blob of every node."""
    from ..dump.writer import atomic_write_json

    os.makedirs(row.dir, exist_ok=True)
    path = os.path.join(row.dir, "msprobe-result.json")
    atomic_write_json(path, row.as_json())
    return path


def benchless_row(**fields: Any) -> dict:
    """A result row for a check with no compare behind it (free benchmark, monitor): the compare fields the
    terminal summary and the JUnit writer read, empty, under ``fields``."""
    row = {"csv": "", "graph": None, "overflow_first": None, "overflow_failed": False, "isolated": False,
           "model": [], "overflow_message": "", "unapplied": [], "notes": []}
    row.update(fields)
    return row


def unapplied_message(inject: str | None, unapplied: Sequence[str], artifacts: str) -> str | None:
    """The failure of injected faults that never fired or changed no value: such a check proves nothing about
    the gate, whatever its verdict. ``None`` when every fault fired."""
    if not unapplied:
        return None
    more = f" (+{len(unapplied) - 1} more)" if len(unapplied) > 1 else ""
    return (f"msprobe: {inject}: {unapplied[0]}{more}; a fault that never fires or changes no value proves nothing "
            f"about the gate (fix its api/call/step/value). Artifacts: {artifacts}")


def coverage(draft: Draft, outcome, where: str, artifacts: str, required: bool) -> bool:
    """Warn (or with ``required`` fail) where the target computed outside every captured API; return whether
    the draft has failed."""
    if not getattr(outcome, "coverage_short", False):
        return draft.failure is not None
    from ..capture.coverage import summary

    line = (f"msprobe: {where}{summary(outcome.coverage)}: that work has no per-API verdict (only the drift of an "
            f"enclosing module shows it). Artifacts: {artifacts} (coverage.json)")
    if required:
        return draft.fail(line + " [--msprobe-require-coverage]")
    draft.warnings.append(line)
    return False


def overflow_or_api(draft: Draft, outcome, where: str, artifacts: str, require_coverage: bool = False) -> bool:
    """Coverage (:func:`coverage`), then a judged outcome's new overflow or per-API pre-check error; ``where``
    names the step or rank (``"step 2: "``, ``"rank1 "``). Returns whether the draft has failed."""
    if coverage(draft, outcome, where, artifacts, require_coverage):
        return True
    if outcome.overflow_failed:
        ov = outcome.overflow.first
        return draft.fail(f"msprobe: overflow on the target at {where}{ov.name} ({ov.level}); the bench has none "
                          f"there. Artifacts: {artifacts}")
    if outcome.api_errors:
        a = outcome.api_errors[0]
        rerun = repro_command(getattr(outcome.target_dump, "folder", None), a.name, outcome.report)
        return draft.fail(f"msprobe: per-API pre-check at {where}{a.name}: {a.message}. Artifacts: {artifacts}"
                          + (f"\nreproduce this call alone: {rerun}" if rerun else ""))
    return False


def conclude_check(row: dict, outcome, check_dir: str, level: str, unapplied: list, inject: str | None,
                   target_flag: str, stored=None, require_coverage: bool = False) -> Conclusion:
    """One judged check: its row and properties, then its first problem (faults that never fired, the first
    divergence, a new overflow, a model-level output, the per-API pre-check, coverage). The value is the
    :class:`~msprobe_ci.compare.CompareReport`."""
    report, target_dump = outcome.report, outcome.target_dump
    csv_path, graph_path = outcome.csv, outcome.graph
    row.setdefault("notes", []).extend(outcome.notes)
    first = outcome.first_divergence
    row.update(outcome.summary(), unapplied=unapplied)
    replay_cmd = (f"pytest --msprobe-api-check={target_dump.folder} --msprobe-api-live {target_flag}"
                  + (f" --msprobe-inject={os.path.abspath(inject)}" if inject else ""))
    if first is not None:  # the report shows where and how to replay, as the failure message does
        row["first_where"] = where(first.name, target_dump)
        if re.match(r"^(Tensor|Torch|Functional)\.", first.name):
            row["replay"] = f"{replay_cmd} -k '{first.name}'"
    d = Draft()
    d.properties.append((RESULT, row))
    c = report.counts()
    d.properties += [("msprobe.nodes_compared", row["nodes_compared"]), ("msprobe.pass", c["pass"]),
                     ("msprobe.warning", c["warning"]), ("msprobe.error", c["error"]),
                     ("msprobe.unmatched", c["unmatched"]),
                     ("msprobe.first_divergence", row["first_divergence"] or ""),
                     ("msprobe.csv", csv_path), ("msprobe.level", level)]
    if graph_path:
        d.properties.append(("msprobe.graph", graph_path))
    if stored is not None:
        d.properties += [("msprobe.baseline", row["baseline"]), ("msprobe.baseline_bytes", stored.bytes)]
    if d.fail(unapplied_message(inject, unapplied, check_dir)):
        return d.done(report)
    if first is not None:
        d.fail(failure_message(report, check_dir, target_dump, graph_path, replay_cmd))
        return d.done(report)
    if outcome.overflow_failed:
        ov = outcome.overflow.first
        d.fail(f"msprobe: overflow on the target at {ov.name} ({ov.level}: NaN/Inf in {', '.join(ov.rows[:4])}); "
               f"the bench has none there. Artifacts: {check_dir}")
        return d.done(report)
    if outcome.model_errors:
        m = outcome.model_errors[0]
        value = float(m["value"])  # "inf"/"nan" are stored as strings (JSON has no such numbers)
        lead = closest_calls(report) if report.isolated else ""
        if not math.isfinite(value):
            d.fail(f"msprobe: model output {m['name']}: {m['message'].split(': ', 1)[-1]}"
                   + ("; every isolated API passes its own standard" if report.isolated else "")
                   + f". Artifacts: {check_dir}" + lead)
        else:
            d.fail(f"msprobe: model output {m['name']} drifts beyond the end-to-end tolerance: relative L2 error "
                   f"{value:.4g} > {float(m['threshold']):.4g} ("
                   + ("every isolated API passes its own standard; " if report.isolated else "")
                   + f"set output_rtol to accept this drift). Artifacts: {check_dir}" + lead)
        return d.done(report)
    api_errors = outcome.api_errors
    if api_errors:
        rerun = repro_command(getattr(target_dump, "folder", None), api_errors[0].name, report)
        d.fail(f"msprobe: per-API pre-check: {len(api_errors)} API call(s) fail their own standard; first: "
               f"{api_errors[0].name}: {api_errors[0].message}. Artifacts: {check_dir}"
               + (f"\nreproduce this call alone: {rerun}" if rerun else ""))
        return d.done(report)
    coverage(d, outcome, "", check_dir, require_coverage)
    return d.done(report)


def judge_steps(s, check_dir: str, bench_folders: list, target_folders: list, steps: list | None = None) -> list:
    """Judge the step folders of a loop (:func:`~msprobe_ci.check.outcome.evaluate` per step). Sources (weights,
    optimizer state, KV cache, inputs) match the bench only at step 0: later they have moved apart by rounding,
    which the steps that made them judged, so from step 1 on they are context (``source_factor`` inf).

    Raises:
        MsprobeError: unreadable or incompatible step dumps (``. Artifacts: <check dir>`` appended).
    """
    from .outcome import SideRun, evaluate

    try:
        steps = list(range(len(bench_folders))) if steps is None else steps
        return [evaluate(b, SideRun(t), os.path.join(check_dir, f"step{steps[i]}"), s.judge.for_step(steps[i]))
                for i, (b, t) in enumerate(zip(bench_folders, target_folders))]
    except MsprobeError as exc:
        raise MsprobeError(f"{exc}. Artifacts: {check_dir}") from None


def conclude_steps(d: Draft, s, nodeid: str, index: int, check_dir: str, outcomes: list, unapplied: tuple,
                   first_notes: list, extra: list, label: Callable[[int], str], tail: str, inject: str | None,
                   steps: list | None = None, require_coverage: bool = False,
                   scaler_skipped: frozenset = frozenset()) -> bool:
    """One result row per step of a loop (``extra[i]``: the step's own fields), then the first problem, naming
    the step (``label(i)``, e.g. ``step 2`` or ``step 2 (decode token 2)``; ``tail`` ends a divergence message).
    ``scaler_skipped``: steps the target's ``GradScaler`` skipped (inf/NaN in its scaled gradients): their new
    overflow is the scaler's business, reported as a note, not failed on (the check fails on ``scaler_skips`` in a
    row instead). Returns whether the draft has failed."""
    steps = list(range(len(outcomes))) if steps is None else steps
    skipped_notes = {}
    for i, outcome in enumerate(outcomes):
        if steps[i] in scaler_skipped:
            ov = outcome.overflow.first if outcome.overflow_failed else None
            skipped_notes[i] = (f"step {steps[i]} skipped by the target's GradScaler (inf/NaN in its scaled "
                                "gradients)" + (f"; its overflow at {ov.name} is the scaler's to handle, not failed "
                                                "on" if ov is not None else ""))
    outcomes = [_without_overflow(o) if i in skipped_notes else o for i, o in enumerate(outcomes)]
    for i, outcome in enumerate(outcomes):
        row = {"test": nodeid, "index": f"{index} step{steps[i]}", "dir": os.path.join(check_dir, f"step{steps[i]}"),
               "bench": s.bench.label, "target": s.target.label, "level": "L0" if s.target.compile else s.level,
               "bench_kernel": s.bench_kernel if s.isolate else None,
               "notes": list(outcome.notes) + (list(first_notes) if i == 0 else [])}
        row.update(outcome.summary(), unapplied=[], step=steps[i], **extra[i])
        if i in skipped_notes:
            row["notes"].append(skipped_notes[i])
        d.properties.append((RESULT, row))
    if d.fail(unapplied_message(inject, unapplied, check_dir)):
        return True
    for i, outcome in enumerate(outcomes):
        if outcome.first_divergence is not None:
            msg = failure_message(outcome.report, os.path.join(check_dir, f"step{steps[i]}"), outcome.target_dump,
                                  outcome.graph)
            msg = msg.replace("msprobe: first divergence at ", f"msprobe: first divergence at {label(steps[i])}: ", 1)
            return d.fail(f"{msg}\n{tail}")
        if overflow_or_api(d, outcome, f"{label(steps[i])}: ", check_dir, require_coverage):
            return True
    return False


def where(name: str, target_dump) -> str:
    """``in <module>; at <file, line, function>`` of a node: its module (construct.json) and the source line that
    called it (the first stack frame outside torch), as far as the dump knows them; empty when it knows neither."""
    construct = getattr(target_dump, "construct", {}) or {}
    stack = getattr(target_dump, "stack", {}) or {}
    out = []
    module = construct.get(name)
    if module:
        out.append(f"in {module}")
    frames = [str(f).split(", \n")[0].replace("File ", "") for f in stack.get(name) or []]
    user = [f for f in frames if f"{os.sep}torch{os.sep}" not in f]  # the line that called the API
    # a model made of torch's own modules has no frame outside torch: its module's line, not the dispatcher's
    torch_module = [f for f in frames if f"{os.sep}nn{os.sep}modules{os.sep}" in f]
    if frames:
        out.append(f"at {(user or torch_module or frames)[0]}")
    return "; ".join(out)


def failure_message(report, check_dir: str, target_dump=None, graph_path: str | None = None, replay: str = "") -> str:
    """First line: the API, its module, the source line, the standard, metric, value and threshold; then where to
    look (graph, replay command) and the other failing nodes."""
    first = report.first_divergence
    at = where(first.name, target_dump)
    loc = f" ({at})" if at else ""
    if report.isolated and first.metrics.get("isolated"):
        detail = first.message.split(": ", 1)[-1]
    else:
        detail = (f"{first.metric} {first.value:.4g} > threshold {first.threshold:.4g} (row {first.worst_row}; "
                  f"input error {first.input_error:.3g})") if first.metric != "source" else \
            first.message.split(": ", 1)[-1]
    lines = [f"msprobe: first divergence at {first.name}{loc}: {detail}"]
    own = [n for n in report.nodes if n.status == "error" and "rollup" not in n.metrics]
    if graph_path:
        lines.append(f"graph: {graph_path}  (open: msprobe-ci view {os.path.dirname(os.path.dirname(graph_path))}; "
                     f"red boxes lead down to {first.name}, or type it in the viewer's search)")
    rerun = repro_command(getattr(target_dump, "folder", None), first.name, report)
    if rerun:
        lines.append(f"reproduce this call alone, without the model (--no-fault leaves an injected fault out): "
                     f"{rerun}")
    if replay and re.match(r"^(Tensor|Torch|Functional)\.", first.name):
        lines.append(f"replay this API alone: {replay} -k '{first.name}'")
    if len(own) > 1:
        lines.append(f"{len(own) - 1} more node(s) fail on their own: " +
                     ", ".join(n.name for n in own[1:6]) + (" ..." if len(own) > 6 else ""))
    c = report.counts()
    lines.append(f"{len(report.nodes)} nodes: pass {c['pass']}, warning {c['warning']}, error {c['error']} "
                 f"(incl. modules containing a failing API), unmatched {c['unmatched']}. "
                 f"Compare CSV and dumps: {check_dir}")
    return "\n".join(lines)


def closest_calls(report, k: int = 3) -> str:
    """A lead where the model output fails and every API passes its own standard: the ``k`` API calls whose judged
    metric came closest to its threshold (value / threshold, highest first), each with its target's and its
    bench's own relative errors where the standard measured them. A second line of the failure message ('' when
    no call was judged)."""
    calls = []
    for n in report.nodes:
        if n.name.startswith("Module.") or not n.metrics.get("isolated") or n.metrics.get("standard") == "source":
            continue
        if "bit-identical" in (n.message or ""):  # its error is its bench's: never a lead
            continue
        try:
            ratio = float(n.value) / float(n.threshold)
        except (TypeError, ValueError, ZeroDivisionError):
            continue
        if math.isfinite(ratio):
            calls.append((ratio, n))
    if not calls:
        return ""
    calls.sort(key=lambda c: c[0], reverse=True)
    parts = []
    for ratio, n in calls[:k]:
        m = n.metrics
        errs = ""
        if "target_max_rel_err" in m and "bench_max_rel_err" in m:
            errs = (f"; max rel err target {m['target_max_rel_err']:.3g} vs bench {m['bench_max_rel_err']:.3g}, "
                    f"mean {m.get('target_mean_rel_err', math.nan):.3g} vs {m.get('bench_mean_rel_err', math.nan):.3g}")
        parts.append(f"{n.name} ({n.metric} {float(n.value):.4g} of {float(n.threshold):.4g}: {ratio:.0%} of its "
                     f"threshold{errs})")
    return "\nclosest to their own standards (a lead, none failing): " + "; ".join(parts)


def _without_overflow(outcome):
    """``outcome`` with its new overflow set aside (a step the target's GradScaler skipped)."""
    from dataclasses import replace

    return replace(outcome, overflow=None)
