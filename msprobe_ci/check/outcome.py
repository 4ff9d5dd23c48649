"""The judgement every mode shares: two dumps in, one frozen :class:`CheckOutcome` out.

* :func:`judge`: compare the two dumps (msprobe's rows and metrics, drift as context) and apply the isolated
  verdicts of the target's ``isolation.json``;
* :func:`model_cases`: the model-level testcases (final outputs and loss against an end-to-end tolerance);
* :func:`evaluate`: all of it for one check (CSV, graph, model testcases, overflow, pre-check of a tensor dump),
  returned as a frozen :class:`CheckOutcome`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from .._perf import gc_paused, release_free_memory
from ..errors import MsprobeError
from ..compare.isolation_file import describe_budget, load_budget
from ..judge.settings import JudgeSettings


@dataclass(frozen=True)
class SideRun:
    """What one side produced.

    Attributes:
        folder: the rank folder of the dump (``.../step0/rank``).
        outputs: ``[(name, CPU tensor)]`` floating final outputs (``output.logits``) and ``loss``; empty when they
            were spilled (read them with :meth:`final_outputs`).
        unapplied: one line per injected fault that never fired (the gate proved nothing with it).
        notes: report lines about how the side ran (:func:`precision_notes`).
        spilled: the file the final outputs were written to while the other side ran, or ``None``.
    """

    folder: str
    outputs: list = field(default_factory=list)
    unapplied: tuple = ()
    notes: tuple = ()
    spilled: str | None = None

    def final_outputs(self) -> list:
        """The final outputs, read back (and their file removed) where they were spilled; ``[]`` where the file
        is gone (read once already, or removed by someone else: the model-level cases are then left out).

        Raises:
            MsprobeError: the file holds anything but tensors in lists and tuples (loaded ``weights_only``).
        """
        if self.spilled is None:
            return self.outputs
        import os

        import torch

        try:
            pairs = torch.load(self.spilled, weights_only=True)
        except FileNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001 - a replaced or damaged file: one line, nothing unpickled
            lines = str(exc).splitlines() or [""]
            raise MsprobeError(f"{self.spilled}: expected the side's final outputs as (name, tensor) pairs "
                               f"of tensors only ({type(exc).__name__}: {lines[0]})") from None
        try:
            os.remove(self.spilled)
        except OSError:
            pass
        return [(str(name), t) for name, t in pairs]


_NOT_GIVEN: Any = object()


def judge_dumps(bench_dump, target_dump, settings: JudgeSettings = JudgeSettings(), records: Any = _NOT_GIVEN):
    """The one judgement of two loaded dumps: compare them (:func:`~msprobe_ci.compare.compare_dumps`), then apply
    the isolated verdicts: ``records`` when given (``check_parallel``'s ranks merged by TP/PP: a transform of the
    dumps and their records before this judgement), else the target's ``isolation.json``, or for a tensor dump made
    without one its API calls replayed on their dumped inputs (:func:`~msprobe_ci.compare.isolated.replay`; the
    results kept in ``report.replayed``).

    Args:
        bench_dump, target_dump: :class:`~msprobe_ci.dump.reader.Dump` of each side.
        settings: what the judgement is told (:class:`~msprobe_ci.judge.JudgeSettings`), passed whole.
        records: isolation records to apply (``None``: none), or left out to read them as above.

    Returns:
        The :class:`~msprobe_ci.compare.report.CompareReport`; ``report.isolated`` tells whether isolation records
        were applied.

    Raises:
        MsprobeError: incompatible dumps.
    """
    from ..compare import compare_dumps
    from ..compare.isolated import apply_isolation, is_tensor_dump, replay, replay_isolation
    from ..compare.isolation_file import load_isolation

    s = settings
    report = compare_dumps(bench=bench_dump, target=target_dump, fuzzy=s.fuzzy, thresholds=s.thresholds,
                           mappings=s.mappings)
    if not s.isolate:
        records = None
    elif records is _NOT_GIVEN:
        records = load_isolation(target_dump.folder)
        if records is None and is_tensor_dump(target_dump):
            # a tensor dump made without isolation (msprobe's, another runner's): its calls replayed on their
            # dumped inputs are the verdicts; drift stays context
            report.replayed = replay(target_dump, s.bench_kernel, dict(s.api_standards), _thresholds(s))
            records = replay_isolation(report.replayed)
    if records is not None:
        apply_isolation(report, records, target_dump.construct, cast_roundoff=s.cast_roundoff,
                        source_factor=s.source_factor, bench_stack=bench_dump.stack, bench_data=bench_dump.data)
    return report


def judge(bench_folder: str, target_folder: str, settings: JudgeSettings = JudgeSettings()):
    """Load two dumps (a dump.json, a rank folder, or a step folder with one rank) and judge them
    (:func:`judge_dumps`).

    Returns:
        ``(report, target_dump, bench_dump)``.

    Raises:
        MsprobeError: unreadable or incompatible dumps.
    """
    from ..dump.reader import load_dump

    bench_dump = load_dump(bench_folder)
    target_dump = load_dump(target_folder)
    return judge_dumps(bench_dump, target_dump, settings), target_dump, bench_dump


def _thresholds(s: JudgeSettings) -> dict:
    return {k: dict(v) for k, v in s.api_thresholds.items()}


def num(x: float) -> float | str:
    """A JSON-safe number: ``inf``/``nan`` as strings (JSON has no such numbers)."""
    return x if math.isfinite(x) else str(x)


def flatten_outputs(out: Any, name: str = "output") -> list[tuple[str, Any]]:
    """Floating tensors of a model output, on CPU, named by their path (``output.logits``, ``output.0``)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [(name, out.detach().cpu())] if out.is_floating_point() else []
    if isinstance(out, dict) or (hasattr(out, "keys") and hasattr(out, "to_tuple")):  # a transformers ModelOutput
        items = [(str(k), out[k]) for k in out.keys()]
    elif isinstance(out, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(out)]
    else:
        return []
    result = []
    for k, v in items:
        if k in ("loss",):
            continue  # judged from the loss of loss_fn
        result += flatten_outputs(v, f"{name}.{k}")
    return result


def model_cases(bench: list | None, target: list | None, rtol: float | None, cast_u: float = 0.0,
                departure: Any = None) -> list[dict]:
    """The model-level testcases: relative L2 error of each final output (and the loss) against the bench.

    Default tolerance: 16 x the unit roundoff of the coarsest dtype involved (the outputs' and ``cast_u``, the
    dtype the models were cast to), at least 1e-5 (an end-to-end
    budget: each layer adds about one rounding of the target dtype; isolation judges the layers themselves).
    The error is relative to ``max(‖bench‖₂, √numel · smallest normal)`` of the outputs' coarser dtype: outputs
    below that dtype's normal range (a random-init MobileNetV2 whose fp32 logits are 1e-26, 0 in fp16) are
    judged by their absolute rounding, as :func:`msprobe_ci.compare.metrics.relative_error_arrays` does.

    ``departure``: the first decision the target made otherwise than the bench while computing correctly on its
    own inputs (:func:`departure`), or ``None``. An output over the tolerance after one is ``skip``, not ``error``,
    and its message names the node: past a discrete choice made within a rounding (an MoE router's top-k, a
    histogram's count) the two runs compute different, equally correct things, and no rounding budget bounds their
    distance.
    """
    from ..compare.verdict import unit_roundoff
    from ..dtypes import smallest_normal

    if not bench or not target:
        return []
    bench_map = dict(bench)
    cases = []
    for name, t in target:
        b = bench_map.get(name)
        if b is None or tuple(b.shape) != tuple(t.shape):
            continue
        tol = rtol if rtol is not None else max(16 * max(unit_roundoff(str(t.dtype), str(b.dtype)), cast_u), 1e-5)
        # NaN/Inf in the same elements on both sides (an overflow the bench shares) is compared on the rest;
        # NaN/Inf where the other side is finite is an error of its own, said with the counts
        one_side, t_bad, b_bad, finite, b_norm, diff = _l2_in_chunks(t, b)
        if one_side:
            err = math.inf
            message = (f"{name}: {one_side} element(s) NaN/Inf on one side only (target {t_bad}, bench {b_bad} of "
                       f"{t.numel()} non-finite)")
        else:
            denom = max(b_norm, math.sqrt(finite) * smallest_normal(str(t.dtype), str(b.dtype)))
            err = diff / denom if denom > 0 else 0.0  # denom 0: no finite element, nothing differs
            message = f"{name}: relative L2 error {err:.4g} vs end-to-end tolerance {tol:.4g}"
        status = "error" if not err <= tol else "pass"
        if status == "error" and departure is not None and not one_side:
            status = "skip"
            m = departure.metrics
            how = (f"drift {float(m.get('drift_RelativeErr', 0.0)):.3g} over {float(m.get('drift_threshold', 0.0)):.3g}"
                   if m.get("drift_status") == "error" else "its integer outputs differ from the bench's")
            message += (f"; not judged end to end: the target's run left the bench's at {departure.name} ({how}), "
                        "which computed correctly on its own inputs (a discrete choice within a rounding: a top-k, "
                        "a count); every call was judged on its own inputs")
        cases.append({"name": f"model.{name}", "status": status,
                      "metric": "RelativeErr", "value": num(err), "threshold": tol, "message": message})
    return cases


#: APIs whose floating outputs are counts: a decision as much as an integer output is (gpt-oss's and Mixtral's
#: routers count their tokens per expert with ``torch.histc``)
COUNTS = frozenset({"histc", "bincount"})


def departure(report: Any) -> Any:
    """The first *decision* of an isolated ``report`` that the target made otherwise than the bench: a node whose
    own verdict passes (it computed correctly on the target's inputs) while its drift against the bench is an
    error, and whose outputs are a decision (an integer or boolean tensor: indices, masks, a ``cumsum`` of
    counts; or a count, :data:`COUNTS`). gpt-oss's router in bf16 sent one token of 32 to another expert than the
    fp32 bench (router logits within a rounding of a tie): ``histc`` counted it there, and that token's logits moved
    by 41%. A floating node whose drift fails while it passes its own standard is no departure: that is what a
    fault under its standard's threshold looks like (a 0.006% LayerNorm fault in fp32, which only the logits show).
    Where both dumps carry ``digest`` (ours do, for every integer and boolean tensor: :mod:`msprobe_ci.capture.
    records`), a decision node whose digest differs from the bench's is one at once, its drift whatever it is: at
    L0 the router module's statistics barely move for one token of 32, its indices' digest does. ``None`` for a
    report that is not isolated, or where the target decided as the bench did."""
    from ..dtypes import is_floating

    if not getattr(report, "isolated", False):
        return None
    decides, differs = set(), set()
    for r in report.rows:
        t = r.target
        if t.side != "output" or not t.is_tensor or is_floating(t.dtype):
            continue
        decides.add(t.entry)
        mine = t.record.get("digest") if isinstance(t.record, dict) else None
        theirs = r.bench.record.get("digest") if r.bench is not None and isinstance(r.bench.record, dict) else None
        if isinstance(mine, str) and isinstance(theirs, str) and mine != theirs:
            differs.add(t.entry)
    for n in report.nodes:
        if n.status not in ("pass", "warning"):
            continue
        if n.name in differs:
            return n
        if n.metrics.get("drift_status") == "error" and \
                (n.name in decides or (n.name.split(".")[1:2] or [""])[0] in COUNTS):
            return n
    return None




_CHUNK = 1 << 21  # elements per float64 slice: 16 MB a side, where a 1024-token GPT-2 logits copy is 411 MB


def _l2_in_chunks(t, b) -> tuple[int, int, int, int, float, float]:
    """``(elements non-finite on one side only, non-finite in target, in bench, finite in both, ‖b‖₂, ‖t − b‖₂)``
    over the elements finite on both sides, in float64, :data:`_CHUNK` elements at a time (norms combined with
    ``math.hypot``, which neither overflows nor underflows), so no float64 copy of a whole output is made."""
    import torch

    tf, bf = t.reshape(-1), b.reshape(-1)
    one_side = t_bad = b_bad = finite = 0
    b_norm = diff = 0.0
    for start in range(0, tf.numel(), _CHUNK):
        tc, bc = tf[start:start + _CHUNK].to(torch.float64), bf[start:start + _CHUNK].to(torch.float64)
        tb, bb = ~torch.isfinite(tc), ~torch.isfinite(bc)
        nt, nb = int(tb.sum()), int(bb.sum())
        t_bad, b_bad = t_bad + nt, b_bad + nb
        if nt or nb:
            one_side += int((tb ^ bb).sum())
            keep = ~(tb | bb)
            tc, bc = tc[keep], bc[keep]
        finite += tc.numel()
        if not one_side:
            b_norm = math.hypot(b_norm, float(torch.linalg.vector_norm(bc)))
            diff = math.hypot(diff, float(torch.linalg.vector_norm(tc - bc)))
    return one_side, t_bad, b_bad, finite, b_norm, diff


@dataclass(frozen=True)
class CheckOutcome:
    """Everything one check found, frozen: what the JUnit writer, the terminal summary and the fixture read.

    Attributes:
        report: the :class:`~msprobe_ci.compare.CompareReport` (isolated verdicts when ``report.isolated``).
        target_dump, bench_dump: the two loaded dumps.
        csv: the compare CSV (msprobe's columns). graph: the ``.vis.db`` or ``None``.
        model: the model-level testcases (:func:`model_cases`).
        overflow: the target's new overflows (:func:`msprobe_ci.overflow.new_overflows`).
        api_checks: per-API pre-check results (tensor task at L1/mix), else empty.
        notes: lines for the report (e.g. why no graph was written).
        coverage: the target dump's ``coverage.json`` (:func:`read_coverage`): the share of floating-point work
            inside captured APIs and the uncaptured ops; ``None`` where the dump has none (L0, made elsewhere).
        isolation_budget: budgeted isolation's figures of the target's step (calls, judged, API kinds, factor
            asked and measured; :func:`msprobe_ci.compare.isolation_file.load_budget`), or ``None``: every call isolated.
    """

    report: Any
    target_dump: Any
    bench_dump: Any
    csv: str
    graph: str | None
    model: tuple = ()
    overflow: Any = None
    api_checks: tuple = ()
    notes: tuple = ()
    coverage: dict | None = None
    isolation_budget: dict | None = None

    @property
    def first_divergence(self):
        return self.report.first_divergence

    @property
    def overflow_failed(self) -> bool:
        return bool(self.overflow is not None and self.overflow.has_overflow)

    @property
    def model_errors(self) -> list[dict]:
        return [c for c in self.model if c["status"] == "error"]

    @property
    def api_errors(self) -> list:
        return [r for r in self.api_checks if r.status == "error"]

    @property
    def coverage_short(self) -> bool:
        """Some floating-point work of the target ran outside every captured API (share below 1)."""
        return self.coverage is not None and self.coverage["share"] < 1.0

    @property
    def passed(self) -> bool:
        return self.first_divergence is None and not self.overflow_failed and not self.model_errors and \
            not self.api_errors

    def summary(self) -> dict:
        """The serialisable part (plain types) the plugin stores per check."""
        report, first, ov = self.report, self.first_divergence, self.overflow
        return {
            "csv": self.csv, "graph": self.graph, "mode": report.mode,
            "nodes_compared": len(report.nodes) - len(report.unmatched), "counts": report.counts(),
            "first_divergence": first.name if first is not None else None,
            "overflow_first": ov.first.name if ov is not None and ov.first else None,  # first: NaN/Inf only
            "overflow_failed": self.overflow_failed, "isolated": report.isolated, "model": list(self.model),
            "overflow_message": ov.first.message if ov is not None and ov.first else "",
            "nodes": [{"name": n.name, "status": n.status, "metric": n.metric, "value": num(n.value),
                       "threshold": num(n.threshold), "input_error": num(n.input_error), "worst_row": n.worst_row,
                       "message": n.message, "standard": n.metrics.get("standard") or "",
                       "drift": num(float(n.metrics.get("drift_RelativeErr", n.value))),
                       "drift_status": n.metrics.get("drift_status", n.status),
                       "seconds": round(report.seconds.get(n.name, 0.0), 6)} for n in report.nodes],
            **({"api_checks": [{"name": r.name, "status": r.status, "message": r.message} for r in self.api_checks]}
               if self.api_checks else {}),
            **({"coverage": {"share": self.coverage["share"], "uncaptured": self.coverage["uncaptured"][:20]}}
               if self.coverage is not None else {}),
            **({"isolation_budget": dict(self.isolation_budget)} if self.isolation_budget is not None else {}),
        }


@gc_paused()
def evaluate(bench: SideRun | str, target: SideRun, out_dir: str, settings: JudgeSettings = JudgeSettings(), *,
             graph_dir: str | None = None) -> CheckOutcome:
    """Judge one check from its two sides: compare (isolated verdicts), CSV, graph, model-level testcases,
    overflow, and the per-API pre-check of a tensor dump.

    Args:
        bench: the bench :class:`SideRun`, or the rank folder of a recorded baseline (no final outputs then).
        target: the target :class:`SideRun`.
        out_dir: where the compare CSV goes. graph_dir: where the ``.vis.db`` goes (``None``: no graph).
        settings: what the judgement is told (:class:`~msprobe_ci.judge.JudgeSettings`: isolation, name matching,
            the drift rule, the sources' allowance, the model-level tolerance, the capture level the pre-check
            needs, the bench kernel and the standards' overrides), passed whole to :func:`judge_dumps`.

    Raises:
        MsprobeError: unreadable or incompatible dumps.
    """
    from ..overflow import check_overflow, new_overflows

    from ..replay.repro import write_replayed

    s = settings
    report, target_dump, bench_dump = judge(bench if isinstance(bench, str) else bench.folder, target.folder, s)
    csv_path = report.write_csv(out_dir)
    # a tensor dump judged by replay: its failing calls' reproductions beside the CSV
    write_replayed(report, os.path.join(out_dir, "repro"), s.bench_kernel, dict(s.api_standards), _thresholds(s))
    graph_path = None
    notes = [*(() if isinstance(bench, str) else bench.notes), *target.notes]
    found = (check_overflow(target_dump), check_overflow(bench_dump))  # for the verdict and the graph alike
    if graph_dir is not None:
        from ..graph.service import write_compare_graph

        try:
            graph_path = write_compare_graph(target_dump, bench_dump, report, graph_dir, fuzzy=s.fuzzy, found=found)
        except MsprobeError as exc:  # e.g. an L1 dump has no construct.json
            notes.append(f"no graph: {exc}")
    cases = model_cases(None if isinstance(bench, str) else bench.final_outputs(), target.final_outputs(),
                        s.output_rtol, s.cast_roundoff, departure(report))
    overflow = new_overflows(*found)
    api_checks: list = []
    if report.mode == "tensor" and s.level in ("L1", "mix"):
        from ..replay import ApiReplayer

        if report.replayed:  # judge replayed every call already (a tensor dump made without isolation)
            api_checks = list(report.replayed)
        else:
            replayer = ApiReplayer(target_dump, standards=dict(s.api_standards), thresholds=_thresholds(s),
                                   bench_kernel=s.bench_kernel)
            api_checks = [replayer.check(n) for n in replayer.api_names()]
    coverage = read_coverage(target.folder, notes)
    budget = load_budget(target.folder) if s.isolate else None
    if budget is not None:
        notes.append(describe_budget(budget))
    release_free_memory()  # the judgement's transient copies are freed: hand their pages back
    return CheckOutcome(report, target_dump, bench_dump, csv_path, graph_path, tuple(cases), overflow,
                        tuple(api_checks), tuple(notes), coverage, budget)


def merge_coverage(covs: list, notes: list | None = None) -> dict | None:
    """The coverage of several ranks' dumps as one: elements summed, the uncaptured ops merged by (op, pass); a
    share below 1 adds its summary to ``notes``. ``None`` when no rank has a figure."""
    import collections

    from ..capture.coverage import summary

    covs = [c for c in covs if c is not None]
    if not covs:
        return None
    captured = sum(int(c.get("captured_elements", 0)) for c in covs)
    calls: collections.Counter = collections.Counter()
    elements: collections.Counter = collections.Counter()
    for c in covs:
        for u in c["uncaptured"]:
            calls[(u["op"], u["pass"])] += u["calls"]
            elements[(u["op"], u["pass"])] += u["elements"]
    unc = sum(elements.values())
    total = captured + unc
    out = {"share": captured / total if total else min(c["share"] for c in covs), "captured_elements": captured,
           "uncaptured_elements": unc,
           "uncaptured": [{"op": op, "pass": where, "calls": calls[(op, where)], "elements": n}
                          for (op, where), n in elements.most_common()]}
    if out["share"] < 1.0 and notes is not None:
        notes.append(summary(out))
    return out


def read_coverage(folder: str, notes: list | None = None) -> dict | None:
    """The ``coverage.json`` beside a dump (:mod:`msprobe_ci.capture.coverage`), checked field by field: ``share``
    a number in [0, 1], ``uncaptured`` a list of ``{op, pass, calls, elements}``. A share below 1 adds its one-line
    summary to ``notes``; an unreadable file adds a line saying why and gives ``None`` (the compare goes on).

    Returns:
        ``{"share": float, "uncaptured": [...]}`` and the file's other fields, or ``None`` where there is none.
    """
    import json
    import os

    from ..capture.coverage import summary

    path = os.path.join(folder, "coverage.json")
    if not os.path.isfile(path):
        return None
    notes = notes if notes is not None else []
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        share = data["share"]
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"share: expected a number in [0, 1], got {share!r}"[:160])
        unc = data.get("uncaptured", [])
        if not isinstance(unc, list) or not all(
                isinstance(u, dict) and isinstance(u.get("op"), str) and isinstance(u.get("pass"), str) and
                isinstance(u.get("calls"), int) and isinstance(u.get("elements"), int) for u in unc):
            raise ValueError("uncaptured: expected a list of {op, pass, calls, elements}")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        why = f"{exc.args[0]}: missing" if isinstance(exc, KeyError) else str(exc).partition("\n")[0] or repr(exc)
        notes.append(f"coverage.json unreadable ({path}: {why}): no coverage figure")
        return None
    data["share"] = float(share)
    if data["share"] < 1.0:
        notes.append(summary(data))
    return data




def sources_rule(step: int | None) -> tuple[float, str]:
    """How far a dump's sources (parameters, buffers, optimizer state, inputs not computed by a captured API) may
    differ from the bench at training step ``step``: ``source_factor`` 4 (units of the coarser dtype's roundoff,
    the cast's rounding) at step 0 or an unknown step, where both sides start from the same weights; infinite
    (context, never judged) from step 1 on, where they have trained apart by rounding that the steps which made
    them judged, as :func:`~msprobe_ci.check.conclude.judge_steps` does for ``check_training``.

    Returns:
        ``(source_factor, note)``: the note says which rule applied, for the summary.
    """
    if step is None or step == 0:
        return 4.0, "sources (parameters, inputs) compared with the bench"
    return math.inf, (f"step {step}: parameters and optimizer state are context (trained apart by rounding since "
                      "step 0; the steps that made them are judged)")


def step_of(folder: str) -> int | None:
    """The training step of a dump folder (``.../step<N>/rank<R>`` or ``.../step<N>``), ``None`` when its path
    names none."""
    import re

    for part in reversed(os.path.normpath(os.path.abspath(folder)).split(os.sep)[-3:]):
        m = re.fullmatch(r"step(\d+)", part)
        if m:
            return int(m.group(1))
    return None
