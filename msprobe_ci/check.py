"""One check, end to end, without pytest: run a side under capture (and isolation), then judge.

The fixture (``pytest_plugin/fixture.py``) merges options and maps outcomes to pass/skip/fail; this module does the
work, so benchmarks and other front ends run the very same pipeline:

* :func:`run_side`: deep-copy the model onto a backend, run forward (and backward) under
  :class:`~msprobe_ci.capture.CaptureSession`, return the dump folder, the final outputs and the faults that never
  fired;
* :func:`judge`: compare the two dumps (msprobe's rows and metrics, drift as context) and apply the isolated
  verdicts of the target's ``isolation.json``;
* :func:`model_cases`: the model-level testcases (final outputs and loss against an end-to-end tolerance);
* :func:`evaluate`: all of it for one check (CSV, graph, model testcases, overflow, pre-check of a tensor dump),
  returned as a frozen :class:`CheckOutcome`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ._perf import gc_paused
from .errors import MsprobeError


@dataclass(frozen=True)
class SideRun:
    """What one side produced.

    Attributes:
        folder: the rank folder of the dump (``.../step0/rank``).
        outputs: ``[(name, CPU tensor)]`` floating final outputs (``output.logits``) and ``loss``.
        unapplied: one line per injected fault that never fired (the gate proved nothing with it).
        notes: report lines about how the side ran (:func:`precision_notes`).
    """

    folder: str
    outputs: list = field(default_factory=list)
    unapplied: tuple = ()
    notes: tuple = ()


def run_side(model: Any, inputs: tuple, loss_fn: Callable | None, backend, cfg, *, faults: tuple = (),
             seed: int = 1234, regions: list | tuple = (), eval_mode: bool = False, isolator=None,
             free_bench=None) -> SideRun:
    """Run ``model(*inputs)`` (one dict input: ``model(**inputs)``) on ``backend`` under capture.

    Args:
        model: the user's ``nn.Module`` (deep-copied by the backend, left untouched).
        inputs: positional inputs, or one dict of keyword inputs.
        loss_fn: maps the output to a scalar loss; its ``backward()`` is captured too.
        backend: a :class:`~msprobe_ci.backends.Backend`.
        cfg: the side's :class:`~msprobe_ci.config.DumpConfig` (dump_path = the side's folder).
        faults: :class:`~msprobe_ci.capture.inject.Fault` list (target side).
        seed: ``torch.manual_seed`` before the run (default 1234).
        regions: module paths compiled by the backend (no hooks inside).
        eval_mode: put the copy in eval mode.
        isolator: an :class:`~msprobe_ci.isolate.Isolator` (target side), or ``None``.
        free_bench: a :class:`~msprobe_ci.free_benchmark.FreeBenchmark` (a target with no bench), or ``None``.

    Raises:
        MsprobeError: nothing was captured.
    """
    import torch

    from .backends import deterministic
    from .capture import CaptureSession

    side_model = backend.prepare_model(model, eval_mode=eval_mode)
    side_inputs = backend.prepare_inputs(inputs)
    capture = CaptureSession(cfg, faults=faults, opaque_modules=regions, isolator=isolator, free_bench=free_bench)
    torch.manual_seed(seed)  # seeds every device's generator: identical dropout masks on one device type
    try:
        with deterministic():
            capture.start(side_model)
            if len(side_inputs) == 1 and isinstance(side_inputs[0], dict):
                out = side_model(**side_inputs[0])
            else:
                out = side_model(*side_inputs)
            if loss_fn is not None:
                loss = loss_fn(out)
                loss.backward()
            capture.stop()
        flat = flatten_outputs(out)
        if loss_fn is not None:
            flat.append(("loss", loss.detach().float().cpu()))
    finally:
        capture.close()
    if not capture.folders:
        raise MsprobeError("nothing was captured (no torch API or submodule ran)")
    return SideRun(capture.folders[0], flat, unapplied_faults(faults, capture, bool(backend.compile)),
                   precision_notes(capture, backend))


def precision_notes(capture, backend) -> tuple[str, ...]:
    """One report line per API the side ran below its dtype because it has no kernel there (a float64 bench's
    ``torch._grouped_mm``: :func:`~msprobe_ci.kernels.float32_fallback`)."""
    notes = tuple(f"{backend.label}: {api} has no float64 kernel: " + (
        "it ran in float64 as its reference decomposition (one matmul per group)" if how == "reference" else
        f"it ran in {how} (the best precision it supports), its outputs cast back to float64")
        for api, how in capture.precision_fallbacks.items())
    isolator = getattr(capture, "isolator", None)
    if isolator is not None and isolator.oracle_on_target:  # --msprobe-oracle-device=target
        notes += (f"oracle on {isolator.oracle_label} (at most {str(isolator.oracle_max).replace('torch.', '')}); "
                  f"{len(isolator.oracle_fallbacks)} API(s) fell back to the CPU oracle" +
                  "".join(f"; {api}: {why}" for api, why in list(isolator.oracle_fallbacks.items())[:5]) +
                  (" ..." if len(isolator.oracle_fallbacks) > 5 else ""),)
    return notes


def judge(bench_folder: str, target_folder: str, *, fuzzy: bool = False, thresholds=None, isolate: bool = True,
          cast_roundoff: float = 0.0, mappings=None, source_factor: float = 4.0, bench_kernel: str = "device",
          api_standards: dict | None = None, api_thresholds: dict | None = None):
    """Compare the target dump with the bench dump and apply the isolated verdicts: the target's
    ``isolation.json``, or for a tensor dump made without one, its API calls replayed on their dumped inputs
    (:func:`~msprobe_ci.compare.isolated.replay`, with ``bench_kernel``, ``api_standards`` and
    ``api_thresholds``; the results kept in ``report.replayed``).

    Returns:
        ``(report, target_dump, bench_dump)``; ``report.isolated`` tells whether isolation records were found.

    Raises:
        MsprobeError: unreadable or incompatible dumps.
    """
    from .compare import compare_dumps
    from .compare.isolated import apply_isolation, is_tensor_dump, load_isolation, replay, replay_isolation
    from .dump.reader import load_dump

    bench_dump = load_dump(bench_folder)
    target_dump = load_dump(target_folder)
    report = compare_dumps(target_dump, bench_dump, fuzzy=fuzzy, thresholds=thresholds, mappings=mappings)
    records = load_isolation(target_dump.folder) if isolate else None
    if records is None and isolate and is_tensor_dump(target_dump):
        # a tensor dump made without isolation (msprobe's, another runner's): its calls replayed on their dumped
        # inputs are the verdicts; drift stays context
        report.replayed = replay(target_dump, bench_kernel, api_standards, api_thresholds)
        records = replay_isolation(report.replayed)
    if records is not None:
        apply_isolation(report, records, target_dump.construct, cast_roundoff=cast_roundoff,
                        source_factor=source_factor, bench_stack=bench_dump.stack, bench_data=bench_dump.data)
    return report, target_dump, bench_dump


def _num(x: float) -> float | str:
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


def model_cases(bench: list | None, target: list | None, rtol: float | None, cast_u: float = 0.0) -> list[dict]:
    """The model-level testcases: relative L2 error of each final output (and the loss) against the bench.

    Default tolerance: 16 x the unit roundoff of the coarsest dtype involved (the outputs' and ``cast_u``, the
    dtype the models were cast to), at least 1e-5 (an end-to-end
    budget: each layer adds about one rounding of the target dtype; isolation judges the layers themselves).
    The error is relative to ``max(‖bench‖₂, √numel · smallest normal)`` of the outputs' coarser dtype: outputs
    below that dtype's normal range (a random-init MobileNetV2 whose fp32 logits are 1e-26, 0 in fp16) are
    judged by their absolute rounding, as :func:`msprobe_ci.compare.metrics.relative_error_arrays` does.
    """
    from .compare.verdict import unit_roundoff
    from .dtypes import smallest_normal

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
        cases.append({"name": f"model.{name}", "status": "error" if not err <= tol else "pass",
                      "metric": "RelativeErr", "value": _num(err), "threshold": tol, "message": message})
    return cases




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
            "nodes": [{"name": n.name, "status": n.status, "metric": n.metric, "value": _num(n.value),
                       "threshold": _num(n.threshold), "input_error": _num(n.input_error), "worst_row": n.worst_row,
                       "message": n.message, "standard": n.metrics.get("standard") or "",
                       "drift": _num(float(n.metrics.get("drift_RelativeErr", n.value))),
                       "drift_status": n.metrics.get("drift_status", n.status),
                       "seconds": round(report.seconds.get(n.name, 0.0), 6)} for n in report.nodes],
            **({"api_checks": [{"name": r.name, "status": r.status, "message": r.message} for r in self.api_checks]}
               if self.api_checks else {}),
            **({"coverage": {"share": self.coverage["share"], "uncaptured": self.coverage["uncaptured"][:20]}}
               if self.coverage is not None else {}),
        }


@gc_paused()
def evaluate(bench: SideRun | str, target: SideRun, out_dir: str, *, level: str, fuzzy: bool = False,
             thresholds=None, isolate: bool = True, cast_roundoff: float = 0.0, output_rtol: float | None = None,
             graph_dir: str | None = None, api_standards: dict | None = None,
             api_thresholds: dict | None = None, mappings=None, source_factor: float = 4.0,
             bench_kernel: str = "device") -> CheckOutcome:
    """Judge one check from its two sides: compare (isolated verdicts), CSV, graph, model-level testcases,
    overflow, and the per-API pre-check of a tensor dump.

    Args:
        bench: the bench :class:`SideRun`, or the rank folder of a recorded baseline (no final outputs then).
        target: the target :class:`SideRun`.
        out_dir: where the compare CSV goes. graph_dir: where the ``.vis.db`` goes (``None``: no graph).
        level: the capture level (the pre-check needs API entries: L1 or mix).
        mappings: msprobe's cross-framework mapping files (:class:`~msprobe_ci.compare.crossframe.Mappings`).
        source_factor: how far sources (parameters, buffers, inputs, state) may differ from the bench, in units
            of u (default 4); ``inf`` after the first training step, where weights and optimizer state have
            legitimately trained apart.
        bench_kernel: the bench kernel of the per-API pre-check of a tensor dump (:mod:`msprobe_ci.kernels`).

    Raises:
        MsprobeError: unreadable or incompatible dumps.
    """
    from .errors import MsprobeError
    from .overflow import check_overflow, new_overflows

    bench_folder = bench if isinstance(bench, str) else bench.folder
    report, target_dump, bench_dump = judge(bench_folder, target.folder, fuzzy=fuzzy, thresholds=thresholds,
                                            isolate=isolate, cast_roundoff=cast_roundoff, mappings=mappings,
                                            source_factor=source_factor, bench_kernel=bench_kernel,
                                            api_standards=api_standards, api_thresholds=api_thresholds)
    csv_path = report.write_csv(out_dir)
    graph_path = None
    notes = [*(() if isinstance(bench, str) else bench.notes), *target.notes]
    if graph_dir is not None:
        from .graph.service import write_compare_graph

        try:
            graph_path = write_compare_graph(target_dump, bench_dump, report, graph_dir, fuzzy=fuzzy)
        except MsprobeError as exc:  # e.g. an L1 dump has no construct.json
            notes.append(f"no graph: {exc}")
    cases = model_cases(None if isinstance(bench, str) else bench.outputs, target.outputs, output_rtol,
                        cast_roundoff)
    overflow = new_overflows(check_overflow(target_dump), check_overflow(bench_dump))
    api_checks: list = []
    if report.mode == "tensor" and level in ("L1", "mix"):
        from .replay import ApiReplayer

        if report.replayed:  # judge replayed every call already (a tensor dump made without isolation)
            api_checks = list(report.replayed)
        else:
            replayer = ApiReplayer(target_dump, standards=dict(api_standards or {}),
                                   thresholds=dict(api_thresholds or {}), bench_kernel=bench_kernel)
            api_checks = [replayer.check(n) for n in replayer.api_names()]
    coverage = read_coverage(target.folder, notes)
    return CheckOutcome(report, target_dump, bench_dump, csv_path, graph_path, tuple(cases), overflow,
                        tuple(api_checks), tuple(notes), coverage)


def merge_coverage(covs: list, notes: list | None = None) -> dict | None:
    """The coverage of several ranks' dumps as one: elements summed, the uncaptured ops merged by (op, pass); a
    share below 1 adds its summary to ``notes``. ``None`` when no rank has a figure."""
    import collections

    from .capture.coverage import summary

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

    from .capture.coverage import summary

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


@dataclass
class TrainingRun:
    """What one side of a training check produced.

    Attributes:
        folders: the rank folder of each step (``.../step<N>/rank``).
        losses: the loss of each step (float).
        grads: per step, ``{parameter name: float64 CPU gradient}`` after backward, before the optimizer step.
        unapplied: injected faults that never fired.
        monitor: the :class:`~msprobe_ci.monitor.MonitorReport` when the loop was monitored, else ``None``.
        notes: report lines about how the side ran (:func:`precision_notes`).
    """

    folders: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    unapplied: tuple = ()
    monitor: Any = None
    notes: tuple = ()


def run_training(model: Any, batches: list, loss_fn: Callable, optimizer: Callable, backend, cfg, *,
                 faults: tuple = (), seed: int = 1234, isolator=None, monitor_dir: str | None = None) -> TrainingRun:
    """Train a copy of ``model`` on ``backend`` for one step per batch under capture, one ``step<N>`` folder each.

    Each step: forward (``model(*batch)``, a dict batch as keywords, a tensor as the one input), ``loss_fn(out)``,
    backward, the gradients kept for grad_probe statistics, ``optimizer.step()`` (its APIs are captured in the
    same step), ``zero_grad()``.

    Args:
        optimizer: ``optimizer(parameters) -> torch.optim.Optimizer``, called once per side.
        monitor_dir: also run the training monitor (:class:`~msprobe_ci.monitor.TrainerMon`) into this folder.

    Raises:
        MsprobeError: a batch list that is empty, or nothing captured.
    """
    import torch

    from .backends import deterministic
    from .capture import CaptureSession

    if not batches:
        raise MsprobeError("check_training: batches is empty (one training step per batch)")
    side_model = backend.prepare_model(model)
    side_model.train()
    opt = optimizer(side_model.parameters())
    capture = CaptureSession(cfg, faults=faults, isolator=isolator)
    run = TrainingRun()
    mon = None
    if monitor_dir is not None:
        from .monitor import TrainerMon

        mon = TrainerMon(monitor_dir).set_monitor(side_model, opt)
    torch.manual_seed(seed)
    try:
        with deterministic():
            for batch in batches:
                inputs = backend.prepare_inputs((batch,))[0]
                capture.start(side_model)
                if isinstance(inputs, dict):
                    out = side_model(**inputs)
                elif isinstance(inputs, (list, tuple)):
                    out = side_model(*inputs)
                else:
                    out = side_model(inputs)
                loss = loss_fn(out)
                loss.backward()
                if mon is not None:
                    mon.record_loss(loss)
                run.losses.append(float(loss.detach().float().cpu()))
                run.grads.append({n: p.grad.detach().to("cpu", torch.float64).clone()
                                  for n, p in side_model.named_parameters() if p.grad is not None})
                opt.step()
                opt.zero_grad()
                capture.stop()
                run.folders.append(capture.dump_folder())
                capture.step()
    finally:
        capture.close()
        if mon is not None:
            run.monitor = mon.close()
    run.unapplied = unapplied_faults(faults, capture)
    run.notes = precision_notes(capture, backend)
    return run


def unapplied_faults(faults: tuple, capture, compiled: bool = False) -> tuple[str, ...]:
    """One line per fault meant for this rank that never fired in ``capture``, or fired and changed no value
    (:class:`~msprobe_ci.capture.inject.FaultLog`)."""
    why = ("it ran inside a torch.compile region, where APIs cannot be reached" if compiled
           else "no such call ran on the target")
    return capture.fault_log.unapplied(capture.fault_rank, why)


def grad_similarity(bench: dict, target: dict) -> list[dict]:
    """grad_probe's per-parameter record of one step: norm, min and max on both sides, the cosine of the two
    gradient vectors, and sign agreement (the share of elements whose signs agree)."""
    import torch

    out = []
    for name, b in bench.items():
        t = target.get(name)
        if t is None or t.shape != b.shape:
            continue
        bf, tf = b.reshape(-1), t.reshape(-1)
        denom = float(bf.norm() * tf.norm())
        cos = float(bf @ tf) / denom if denom > 0 else (1.0 if float(bf.norm()) == float(tf.norm()) else 0.0)
        out.append({"param": name, "cosine": cos, "sign_agreement": float((torch.sign(bf) == torch.sign(tf))
                                                                            .double().mean()) if bf.numel() else 1.0,
                    "bench_norm": float(bf.norm()), "target_norm": float(tf.norm()),
                    "bench_min": float(bf.min()) if bf.numel() else 0.0, "bench_max": float(bf.max()) if bf.numel()
                    else 0.0, "target_min": float(tf.min()) if tf.numel() else 0.0,
                    "target_max": float(tf.max()) if tf.numel() else 0.0})
    return out


@dataclass
class DecodeRun:
    """What one side of a generation check produced: per step (0 = prefill) the rank folder, the greedy next
    token the side itself would pick, and its last-position logits (float64 CPU)."""

    folders: list = field(default_factory=list)
    picks: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    unapplied: tuple = ()
    steps: list = field(default_factory=list)  # the captured steps, one per folder
    notes: tuple = ()  # report lines about how the side ran (precision_notes)


def run_decode(model: Any, input_ids, max_new_tokens: int, backend, cfg, *, forced: list | None = None,
               faults: tuple = (), seed: int = 1234, isolator=None, capture_steps=None,
               **generate_kwargs) -> DecodeRun:
    """Greedy decoding with the model's KV cache, one captured forward per step (step 0 is the prefill).

    Args:
        model: a causal LM taking ``input_ids``, ``past_key_values``, ``use_cache`` (transformers style) whose
            output has ``.logits`` and ``.past_key_values``.
        input_ids: ``[batch, prompt]`` token ids.
        max_new_tokens: decode steps after the prefill.
        forced: the tokens to feed at steps 1..N (teacher forcing on the bench's tokens); ``None`` feeds the
            side's own greedy picks.
        capture_steps: the steps to capture (a set of ints; ``None``: all); the others run uncaptured, so a long
            generation writes only what is judged (msprobe's ``token_range``).
        generate_kwargs: extra keyword inputs of every forward (e.g. ``attention_mask`` is not supported yet).

    Raises:
        MsprobeError: a model output without ``logits``/``past_key_values``, or nothing captured.
    """
    import torch

    from .backends import deterministic
    from .capture import CaptureSession

    side_model = backend.prepare_model(model, eval_mode=True)
    ids = backend.prepare_inputs((input_ids,))[0]
    capture = CaptureSession(cfg, faults=faults, isolator=isolator)
    run = DecodeRun()
    torch.manual_seed(seed)
    past, step_ids = None, ids
    try:
        with deterministic(), torch.no_grad():
            for step in range(max_new_tokens + 1):
                captured = capture_steps is None or step in capture_steps
                if captured:
                    capture.start(side_model)
                out = side_model(input_ids=step_ids, past_key_values=past, use_cache=True, **generate_kwargs)
                if captured:
                    capture.stop()
                logits, past = getattr(out, "logits", None), getattr(out, "past_key_values", None)
                if logits is None or past is None:
                    raise MsprobeError("check_generate: the model output needs .logits and .past_key_values "
                                       "(a causal LM called with use_cache=True)")
                last = logits[:, -1].detach().to("cpu", torch.float64)
                run.logits.append(last)
                run.picks.append(last.argmax(-1))
                if captured:
                    run.folders.append(capture.dump_folder())
                    run.steps.append(step)
                capture.step()
                if step == max_new_tokens:
                    break
                nxt = forced[step] if forced is not None else run.picks[-1]
                step_ids = nxt.reshape(-1, 1).to(ids.device)
    finally:
        capture.close()
    run.unapplied = unapplied_faults(faults, capture)
    run.notes = precision_notes(capture, backend)
    return run
