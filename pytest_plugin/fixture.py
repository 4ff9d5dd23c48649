"""The ``msprobe`` fixture object: ``msprobe.check(model, *inputs, loss_fn=None, **options)``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from .session import CHECK_OPTIONS, RESULT_PROPERTY, ProbeSession

_NO_MODEL = object()  # _begin() without a model to check

class MsprobeFixture:
    """What a test sees as ``msprobe``. Options: per call > ``@pytest.mark.msprobe(...)`` > command line > ini."""

    def __init__(self, request: pytest.FixtureRequest, session: ProbeSession):
        self.request = request
        self.session = session
        self.checks = 0
        self._record = None
        self._base_dir = ""
        marker_opts: dict[str, Any] = {}
        for mark in reversed(list(request.node.iter_markers("msprobe"))):
            marker_opts.update(mark.kwargs)
        self._check_keys(marker_opts, "@pytest.mark.msprobe")
        self.marker_options = marker_opts

    @staticmethod
    def _check_keys(options: dict, where: str) -> None:
        unknown = sorted(set(options) - set(CHECK_OPTIONS))
        if unknown:
            raise pytest.UsageError(f"msprobe: {where}: unknown option(s) {unknown}; allowed: {list(CHECK_OPTIONS)}")

    def _settings(self, options: dict) -> dict:
        s = self.session
        merged = {"bench": s.bench, "target": s.target, "bench_dtype": s.bench_dtype, "target_dtype": s.target_dtype,
                  "level": s.level, "task": s.task, "inject": None, "seed": 1234, "fuzzy": False,
                  "compile": s.target_compile, "api_standards": s.api_standards, "isolate": s.isolate,
                  "bench_kernel": s.bench_kernel, "oracle_device": s.oracle_device,
                  "output_rtol": s.output_rtol,
                  "api_thresholds": s.api_thresholds, "free_benchmark": s.free_benchmark,
                  "monitor": s.monitor}
        merged.update(s.thresholds_raw)
        for layer in (self.marker_options, options):
            merged.update(layer)
            if "atol" in layer and "rel_floor" not in layer:  # the old name, set at this level, wins below it
                merged["rel_floor"] = layer["atol"]
        return merged

    def check(self, model: Any, *inputs: Any, loss_fn: Callable[[Any], Any] | None = None, **options: Any):
        """Run ``model(*inputs)`` on the bench and on the target under capture, compare, and fail on divergence.

        A single ``dict`` input is passed as keyword arguments (``model(**inputs)``), as transformers models take
        it. The model is deep-copied per side (same weights), moved to the side's device and cast to its dtype;
        floating inputs follow, integer inputs (token ids) only move. With ``loss_fn`` the backward pass runs too:
        ``loss_fn(output).backward()`` on each side.

        Args:
            model: an ``nn.Module`` (left untouched).
            *inputs: positional inputs, or one dict of keyword inputs.
            loss_fn: maps the model output to a scalar loss; enables backward capture.
            **options: ``bench``, ``target``, ``bench_dtype``, ``target_dtype``, ``level``, ``task``, ``inject``
                (a fault file), ``seed`` (default 1234), ``fuzzy``, ``compile`` (target through
                ``torch.compile``, capture at L0), ``api_standards`` (``{API pattern: standard}``) and
                ``api_thresholds`` (``{standard: {threshold: value}}``) for the per-API pre-check, and the
                rule factors ``round_factor``,
                ``propagation``, ``error_factor``, ``rel_floor`` (old name ``atol``) of the drift rule (see
                :mod:`msprobe_ci.compare.verdict`), ``free_benchmark`` (``improve_precision``/``to_cpu``: no bench
                side, see below).

        Free benchmark (``--msprobe-free-benchmark[=MODE]`` or ``free_benchmark=MODE``): for runners with neither
        a bench device nor a baseline. Only the target runs; every API call is re-run on copies of its inputs in
        higher precision and with bit-noised inputs and judged by :mod:`msprobe_ci.free_benchmark`; the test fails
        naming the API calls at risk (forward only; ``free_benchmark.csv`` and one JUnit testcase per call).

        Baselines: with ``--msprobe-record`` only the bench runs and its dump is stored under
        ``--msprobe-baseline=DIR`` (returns ``None``); with ``--msprobe-baseline=DIR`` alone the bench dump is read
        from there (the bench device need not exist) and the target is captured with the baseline's task/level.

        Returns:
            The :class:`~msprobe_ci.compare.CompareReport` (when the test has not failed), ``None`` when recording.

        Raises:
            pytest.fail.Exception: a node's verdict is ``error`` (the first line names the first diverging
                API/module, the metric, its value and the threshold) or the target overflows where the bench
                does not.
        """
        __tracebackhide__ = True
        from ..backends import Backend, compile_backend, compile_regions
        from ..baseline import load_check
        from ..capture.inject import load_faults
        from ..compare import Thresholds
        from ..errors import MsprobeError

        self._check_keys(options, "msprobe.check()")
        import torch

        if not isinstance(model, torch.nn.Module):
            raise pytest.fail.Exception(
                f"msprobe: msprobe.check(model, ...): expected a torch.nn.Module, got {type(model).__name__} "
                "(wrap a plain function in an nn.Module whose forward calls it)", pytrace=False)
        st = self._settings(options)
        self.session.validate_files()
        session = self.session
        replay = session.baseline is not None and not session.record
        try:
            bench = Backend.from_options(st["bench"], st["bench_dtype"])
            target = Backend.from_options(st["target"], st["target_dtype"], bool(st["compile"]))
            thresholds = Thresholds.from_mapping({k: st.get(k) for k in ("round_factor", "propagation",
                                                                           "error_factor", "rel_floor", "atol")})
            faults = load_faults(st["inject"]) if st["inject"] else session.faults
            isolate = _isolate_flag(st["isolate"])
            st["bench_kernel"] = _bench_kernel(st, bench, target)
            output_rtol = None if st["output_rtol"] is None else _positive(st["output_rtol"], "output_rtol")
            base_dir = session.test_dir(self.request.node.nodeid) if self.checks == 0 else self._base_dir
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}", pytrace=False) from None
        self._base_dir = base_dir
        index = self.checks
        self.checks += 1
        check_dir = os.path.join(base_dir, f"check{index}")
        nodeid = self.request.node.nodeid
        task, level = st["task"], ("L0" if target.compile else st["level"])
        # dropout: identical seeds give identical masks on one device type; across types the copies run in eval
        eval_mode = bool(getattr(model, "training", False)) and bench.kind != target.kind
        notes = []
        if eval_mode:
            notes.append("model copies in eval mode (dropout masks differ across device types)")
        if target.compile:
            regions = compile_regions(model)
            notes.append(f"target compiled with {compile_backend()} ({len(regions)} region(s)); capture at L0, "
                         "submodules inside compiled regions not captured")
        else:
            regions = []
        row = {"test": nodeid, "index": index, "dir": check_dir, "bench": bench.label, "target": target.label,
               "level": level, "notes": notes}
        if isolate:
            row["bench_kernel"] = st["bench_kernel"]
        if st["free_benchmark"]:
            return self._free_check(model, inputs, loss_fn, st, target, row, faults, regions)

        if session.record:
            try:
                bench.check_available()
            except MsprobeError as exc:
                self._absent(row, exc)
            recording = self._recording(bench, st, task, level)
            folder = self._run_side(model, inputs, loss_fn, bench, self._capture_config(task, level,
                                    recording.check_dir(index)), (), int(st["seed"]), regions, eval_mode).folder
            size = recording.add_check(index, folder)
            row.update(recorded=True, mode=task, baseline_bytes=size,
                       baseline=os.path.join(session.baseline, _folder(nodeid)))
            self.request.node.user_properties += [(RESULT_PROPERTY, _publish(row)),
                                                  ("msprobe.baseline_bytes", size)]
            return None

        stored = None
        if replay:
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    stored = load_check(session.baseline, nodeid, index, bench_device=bench.device,
                                        bench_dtype=st["bench_dtype"], task=task, level=level)
            except MsprobeError as exc:
                raise pytest.fail.Exception(f"msprobe: {exc}", pytrace=False) from None
            for w in caught:
                warnings.warn(w.message, stacklevel=2)
            task = stored.manifest.get("task", task)
            level = "L0" if target.compile else stored.manifest.get("level", level)
            recorded = stored.manifest.get("bench") or {}
            row.update(level=level, baseline=os.path.join(session.baseline, _folder(nodeid)),
                       baseline_bytes=stored.bytes,
                       bench=f"{recorded.get('device')}/{recorded.get('dtype') or 'model-dtype'} (baseline)")
        sides = [("target", target, faults)] if replay else [("bench", bench, ()), ("target", target, faults)]
        for _, backend, _ in sides:
            try:
                backend.check_available()
            except MsprobeError as exc:
                self._absent(row, exc)
        if not replay and bench.label == target.label:
            notes.append(f"warning: bench and target are the same ({bench.label}): only capture is checked; set "
                         "--msprobe-target/--msprobe-target-dtype (or --msprobe-bench-dtype) to compare two backends")
        runs: dict[str, Any] = {}
        for side, backend, side_faults in sides:
            isolator = None
            if side == "target" and isolate:
                isolator = _make_isolator(st, bench, backend, loss_fn is not None)
            runs[side] = self._run_side(
                model, inputs, loss_fn, backend, self._capture_config(task, level, os.path.join(check_dir, side)),
                side_faults, int(st["seed"]), regions, eval_mode, isolator)
        try:
            from ..check import evaluate
            from ..compare.verdict import unit_roundoff

            outcome = evaluate(
                stored.rank_folder if stored is not None else runs["bench"], runs["target"], check_dir, level=level,
                fuzzy=bool(st["fuzzy"]), thresholds=thresholds, isolate=isolate,
                cast_roundoff=unit_roundoff(str(target.dtype), str(bench.dtype)), output_rtol=output_rtol,
                graph_dir=None if session.no_graph else session.graph_dir(nodeid, index),
                api_standards=st["api_standards"], api_thresholds=st["api_thresholds"],
                bench_kernel=_bench_kernel(st, bench, target))
        except MsprobeError as exc:
            hint = f" (baseline {row['baseline']}; re-record it with --msprobe-record)" if replay else ""
            raise pytest.fail.Exception(f"msprobe: {exc}{hint}", pytrace=False) from None
        inject = st["inject"] or session.inject_path
        return self._conclude(row, outcome, check_dir, level, list(runs["target"].unapplied), inject,
                              f"--msprobe-target={target.device}", stored)

    def _free_check(self, model, inputs, loss_fn, st: dict, target, row: dict, faults, regions):
        """``check()`` with no bench side: capture the target at L1 with the free benchmark and fail naming the
        API calls at risk."""
        __tracebackhide__ = True
        from ..free_benchmark import MODES, FreeBenchmark

        mode = st["free_benchmark"]
        mode = "improve_precision" if mode is True else mode
        if mode not in MODES:
            raise pytest.fail.Exception(f"msprobe: free_benchmark: expected one of {list(MODES)}, got {mode!r}",
                                        pytrace=False)
        if self.session.record or self.session.baseline:
            raise pytest.fail.Exception("msprobe: --msprobe-free-benchmark runs no bench: it cannot record or read "
                                        "a baseline (drop one of them)", pytrace=False)
        try:
            target.check_available()
        except Exception as exc:  # noqa: BLE001 - MsprobeError: an absent device
            self._absent(row, exc)
        check_dir = row["dir"]
        fb = FreeBenchmark(mode, seed=int(st["seed"]))
        level = "L1"  # the free benchmark judges API calls
        run = self._run_side(model, inputs, loss_fn, target,
                             self._capture_config(st["task"], level, os.path.join(check_dir, "target")),
                             faults, int(st["seed"]), regions, False, None, fb)
        csv_path = os.path.join(check_dir, "free_benchmark.csv")
        _write_free_csv(csv_path, fb.results)
        nodes = [{"name": k, "status": v["status"], "metric": v.get("metric", "free_benchmark"),
                  "value": _num(v.get("value", 0.0)), "threshold": _num(v.get("threshold", 0.0)),
                  "input_error": "", "worst_row": v.get("row", ""), "message": v["message"],
                  "standard": "free_benchmark", "seconds": v.get("seconds", 0.0)} for k, v in fb.results.items()]
        counts = {s: sum(n["status"] == s for n in nodes) for s in ("pass", "warning", "error", "skip")}
        errors = fb.errors()
        notes = row["notes"]
        notes.append(f"free benchmark ({mode}, bit-noise sensitivity): {len(nodes)} API calls, pass {counts['pass']}, "
                     f"at risk {counts['error']}, not judgeable {counts['skip']} (named in {csv_path})")
        if loss_fn is not None:
            notes.append("free benchmark judges forward calls only; the backward pass ran uncaptured by it")
        unapplied = list(run.unapplied)
        row = _benchless_row(**dict(row, bench=f"none (free benchmark, {mode})", mode="free_benchmark", level=level,
                                    csv=csv_path, nodes_compared=len(nodes), counts=dict(counts, unmatched=0),
                                    first_divergence=errors[0][0] if errors else None, nodes=nodes,
                                    unapplied=unapplied))
        props = self.request.node.user_properties
        props += [(RESULT_PROPERTY, _publish(row)), ("msprobe.free_benchmark", mode),
                  ("msprobe.error", counts["error"]), ("msprobe.first_divergence", row["first_divergence"] or ""),
                  ("msprobe.csv", csv_path)]
        inject = st["inject"] or self.session.inject_path
        if unapplied:
            _fail_unapplied(inject, unapplied, check_dir)
        if errors:
            name, rec = errors[0]
            more = "".join(f"\n  {v['message']}" for _, v in errors[1:5])
            pytest.fail(f"msprobe: free benchmark: {len(errors)} API call(s) at risk on {target.label}; first: "
                        f"{rec['message']}{more}\nArtifacts: {check_dir} (free_benchmark.csv)", pytrace=False)
        return fb.results

    def _conclude(self, row: dict, outcome, check_dir: str, level: str, unapplied: list, inject: str | None,
                  target_flag: str, stored=None):
        """Publish one judged check (properties, result file) and fail the test on its first problem."""
        report, target_dump = outcome.report, outcome.target_dump
        csv_path, graph_path = outcome.csv, outcome.graph
        row.setdefault("notes", []).extend(outcome.notes)
        first = outcome.first_divergence
        row.update(outcome.summary(), unapplied=unapplied)
        replay_cmd = (f"pytest --msprobe-api-check={target_dump.folder} --msprobe-api-live {target_flag}"
                      + (f" --msprobe-inject={os.path.abspath(inject)}" if inject else ""))
        if first is not None:  # the report shows where and how to replay, as the failure message does
            row["first_where"] = _where(first.name, target_dump)
            if re.match(r"^(Tensor|Torch|Functional)\.", first.name):
                row["replay"] = f"{replay_cmd} -k '{first.name}'"
        props = self.request.node.user_properties
        props.append((RESULT_PROPERTY, _publish(row)))
        c = report.counts()
        props += [("msprobe.nodes_compared", row["nodes_compared"]), ("msprobe.pass", c["pass"]),
                  ("msprobe.warning", c["warning"]), ("msprobe.error", c["error"]),
                  ("msprobe.unmatched", c["unmatched"]),
                  ("msprobe.first_divergence", row["first_divergence"] or ""),
                  ("msprobe.csv", csv_path), ("msprobe.level", level)]
        if graph_path:
            props.append(("msprobe.graph", graph_path))
        if stored is not None:
            props += [("msprobe.baseline", row["baseline"]), ("msprobe.baseline_bytes", stored.bytes)]
        if unapplied:
            _fail_unapplied(inject, unapplied, check_dir)
        if first is not None:
            pytest.fail(_failure_message(report, check_dir, target_dump, graph_path, replay_cmd), pytrace=False)
        if outcome.overflow_failed:
            ov = outcome.overflow.first
            pytest.fail(f"msprobe: overflow on the target at {ov.name} ({ov.level}: NaN/Inf in "
                        f"{', '.join(ov.rows[:4])}); the bench has none there. Artifacts: {check_dir}", pytrace=False)
        if outcome.model_errors:
            c = outcome.model_errors[0]
            value = float(c["value"])  # "inf"/"nan" are stored as strings (JSON has no such numbers)
            if not math.isfinite(value):
                pytest.fail(f"msprobe: model output {c['name']}: {c['message'].split(': ', 1)[-1]}"
                            + ("; every isolated API passes its own standard" if report.isolated else "")
                            + f". Artifacts: {check_dir}", pytrace=False)
            pytest.fail(f"msprobe: model output {c['name']} drifts beyond the end-to-end tolerance: relative L2 error "
                        f"{value:.4g} > {float(c['threshold']):.4g} ("
                        + ("every isolated API passes its own standard; " if report.isolated else "")
                        + f"set output_rtol to accept this drift). Artifacts: {check_dir}", pytrace=False)
        api_errors = outcome.api_errors
        if api_errors:
            pytest.fail(f"msprobe: per-API pre-check: {len(api_errors)} API call(s) fail their own standard; first: "
                        f"{api_errors[0].name}: {api_errors[0].message}. Artifacts: {check_dir}", pytrace=False)
        _coverage(outcome, "", check_dir, self.session.require_coverage)
        return report

    def _begin(self, options: dict, what: str, model: Any = _NO_MODEL):
        """The common start of a loop or multi-rank check: option keys, settings, both backends, faults, the
        test folder and this check's index. Returns a :class:`_Check`; fails the test with one line on bad input."""
        import torch

        from ..backends import Backend
        from ..capture.inject import load_faults
        from ..errors import MsprobeError

        self._check_keys(options, f"msprobe.{what}()")
        if model is not _NO_MODEL and not isinstance(model, torch.nn.Module):
            raise pytest.fail.Exception(f"msprobe: {what}(model, ...): expected a torch.nn.Module, got "
                                        f"{type(model).__name__}", pytrace=False)
        st = self._settings(options)
        self.session.validate_files()
        nodeid = self.request.node.nodeid
        try:
            bench = Backend.from_options(st["bench"], st["bench_dtype"])
            target = Backend.from_options(st["target"], st["target_dtype"])
            faults = load_faults(st["inject"]) if st["inject"] else self.session.faults
            isolate = _isolate_flag(st["isolate"])
            st["bench_kernel"] = _bench_kernel(st, bench, target)
            base_dir = self.session.test_dir(nodeid) if self.checks == 0 else self._base_dir
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}", pytrace=False) from None
        self._base_dir = base_dir
        index = self.checks
        self.checks += 1
        return _Check(st, bench, target, tuple(faults), isolate, os.path.join(base_dir, f"check{index}"), index,
                      nodeid, st["inject"] or self.session.inject_path)

    def _judge_steps(self, c: "_Check", bench_folders: list, target_folders: list, steps: list | None = None) -> list:
        """Judge the step folders of a loop. Sources (weights, optimizer state, KV cache, inputs) match the bench
        only at step 0: later they have moved apart by rounding, which the steps that made them judged, so from
        step 1 on they are context (``source_factor`` inf)."""
        from ..check import SideRun, evaluate
        from ..compare.verdict import unit_roundoff
        from ..errors import MsprobeError

        try:
            steps = list(range(len(bench_folders))) if steps is None else steps
            return [evaluate(b, SideRun(t), os.path.join(c.dir, f"step{steps[i]}"), level=c.st["level"],
                             isolate=c.isolate, api_standards=c.st["api_standards"],
                             api_thresholds=c.st["api_thresholds"], bench_kernel=_bench_kernel(c.st, c.bench, c.target),
                             cast_roundoff=unit_roundoff(str(c.target.dtype), str(c.bench.dtype)),
                             source_factor=4.0 if steps[i] == 0 else math.inf)
                    for i, (b, t) in enumerate(zip(bench_folders, target_folders))]
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}. Artifacts: {c.dir}", pytrace=False) from None

    def _conclude_steps(self, c: "_Check", outcomes: list, unapplied: tuple, first_notes: list, extra: list,
                        label: Callable[[int], str], tail: str, steps: list | None = None) -> None:
        """Publish one result row per step (``extra[i]``: step fields) and fail on the first problem, naming the
        step (``label(i)``, e.g. ``step 2`` or ``step 2 (decode token 2)``); ``tail`` ends a divergence message."""
        props = self.request.node.user_properties
        steps = list(range(len(outcomes))) if steps is None else steps
        for i, outcome in enumerate(outcomes):
            row = {"test": c.nodeid, "index": f"{c.index} step{steps[i]}", "dir": os.path.join(c.dir, f"step{steps[i]}"),
                   "bench": c.bench.label, "target": c.target.label, "level": c.st["level"],
                   "bench_kernel": c.st["bench_kernel"] if c.isolate else None,
                   "notes": list(outcome.notes) + (list(first_notes) if i == 0 else [])}
            row.update(outcome.summary(), unapplied=[], step=steps[i], **extra[i])
            props.append((RESULT_PROPERTY, _publish(row)))
        if unapplied:
            _fail_unapplied(c.inject, unapplied, c.dir)
        for i, outcome in enumerate(outcomes):
            if outcome.first_divergence is not None:
                msg = _failure_message(outcome.report, os.path.join(c.dir, f"step{steps[i]}"), outcome.target_dump,
                                       outcome.graph)
                msg = msg.replace("msprobe: first divergence at ", f"msprobe: first divergence at {label(steps[i])}: ",
                                  1)
                pytest.fail(f"{msg}\n{tail}", pytrace=False)
            _fail_overflow_or_api(outcome, f"{label(steps[i])}: ", c.dir, self.session.require_coverage)

    def check_parallel(self, build: Callable[[int, int], Any], *inputs: Any, world_size: int,
                       bench_world_size: int | None = None, loss_fn: Callable[[Any], Any] | None = None,
                       timeout: float = 300.0, tp: int | tuple | None = None, pp: int | tuple | None = None,
                       **options: Any):
        """Run a model split over ``world_size`` ranks on the bench and the target, compare rank by rank, and fail
        naming the rank whose own computation diverged first.

        ``build(rank, world_size)`` returns that rank's module (its shard of the weights); every rank gets the same
        ``inputs``. Ranks are spawned processes joined by torch.distributed (gloo on CPU) on a port chosen per
        check; each captures the bench side, then the target side (isolated verdicts), into
        ``<check>/<side>/step0/rank<R>``. Communication ops are captured on every rank; a rank that only received
        diverged data through a collective is named as such, not blamed. Faults take ``rank: N``.

        Args:
            build: a module-level function (it is sent to the rank processes), as are ``loss_fn`` and the inputs.
            world_size: ranks of the target run. bench_world_size: ranks of the bench run (default the same).
                When they differ, each side runs in its own ranks and its TP/PP ranks are merged into one model
                per data-parallel group before the compare (:mod:`msprobe_ci.compare.merge`; statistics merged
                as msprobe's graph merging does, partial sums standing for their all_reduce).
            tp, pp: the tensor/pipeline-parallel sizes, ``(target, bench)`` or one int for the target (the bench's
                then inferred); default inferred from each side's captured collectives (all_reduce process
                group, send/recv chain), as msprobe infers them.
            loss_fn: maps a rank's output to a scalar loss; enables backward capture. It runs on every rank, so a
                pipeline is checked forward-only here (a pipeline training step your own schedule dumped merges
                through ``msprobe-ci compare --pp``).
            timeout: seconds before hung ranks are terminated and the check fails naming them (default 300).
            options: as for :meth:`check` (bench, target, bench_dtype, target_dtype, level, task, inject, seed,
                isolate, api_standards, api_thresholds).

        Returns:
            ``{rank: CompareReport}``; when the sides were merged, ``{(step, data-parallel group): CompareReport}``.

        Raises:
            pytest.fail.Exception: a rank raised or hung, the first divergence, an overflow, a fault that never
                fired, or a per-API pre-check error; each message names the rank.
        """
        __tracebackhide__ = True
        from ..check import SideRun, evaluate
        from ..compare.ranks import first_divergence_across_ranks
        from ..errors import MsprobeError
        from ..graph.service import compare_vis_db
        from ..parallel import RankJob, free_port, rank_notes, run_ranks, unapplied_faults_on_ranks

        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise pytest.fail.Exception(f"msprobe: check_parallel: world_size: expected a positive int, got "
                                        f"{world_size!r}", pytrace=False)
        bench_world_size = world_size if bench_world_size is None else bench_world_size
        if isinstance(bench_world_size, bool) or not isinstance(bench_world_size, int) or bench_world_size < 1:
            raise pytest.fail.Exception(f"msprobe: check_parallel: bench_world_size: expected a positive int, got "
                                        f"{bench_world_size!r}", pytrace=False)
        merged = bench_world_size != world_size or tp is not None or pp is not None
        c = self._begin(options, "check_parallel")
        st, bench, target, faults, check_dir, index, nodeid = c.st, c.bench, c.target, c.faults, c.dir, c.index, \
            c.nodeid
        session = self.session
        os.makedirs(check_dir, exist_ok=True)
        level, task = st["level"], st["task"]
        job = RankJob(build=build, inputs=tuple(inputs), loss_fn=loss_fn, out=check_dir,
                      sides=(("bench", st["bench"], st["bench_dtype"]), ("target", st["target"], st["target_dtype"])),
                      level=level, task=task, seed=int(st["seed"]), faults=tuple(faults),
                      isolate=c.isolate, standards=dict(st["api_standards"] or {}),
                      thresholds=dict(st["api_thresholds"] or {}), port=free_port(), backend=target.dist_backend,
                      bench_kernel=_bench_kernel(st, c.bench, c.target),
                      oracle_device=_oracle_choice(st, c.target))
        if merged:
            return self._check_merged(c, job, world_size, bench_world_size, tp, pp, float(timeout))
        outcomes = {}
        try:
            run_ranks(job, world_size, float(timeout))
            for rank in range(world_size):
                folder = {side: os.path.join(check_dir, side, "step0", f"rank{rank}") for side in ("bench", "target")}
                target_run = SideRun(folder["target"], notes=rank_notes(check_dir, rank))
                outcomes[rank] = evaluate(folder["bench"], target_run, os.path.join(check_dir, f"rank{rank}"),
                                          level=level, isolate=job.isolate,
                                          api_standards=st["api_standards"], api_thresholds=st["api_thresholds"],
                                          bench_kernel=job.bench_kernel)
            graph = None
            if not session.no_graph:
                graph = compare_vis_db(os.path.join(check_dir, "target"), os.path.join(check_dir, "bench"),
                                       session.graph_dir(nodeid, index),
                                       reports={(0, r): o.report for r, o in outcomes.items()})
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}. Artifacts: {check_dir}", pytrace=False) from None
        props = self.request.node.user_properties
        cross = first_divergence_across_ranks({(0, r): (o.report, o.target_dump) for r, o in outcomes.items()})
        per_rank = {d.rank: d for d in cross.ranks}
        for rank, outcome in outcomes.items():
            row = {"test": nodeid, "index": f"{index} rank{rank}", "dir": os.path.join(check_dir, f"rank{rank}"),
                   "bench": f"{bench.label} x{world_size}", "target": f"{target.label} x{world_size}",
                   "level": level, "bench_kernel": job.bench_kernel if job.isolate else None,
                   "notes": list(outcome.notes), "rank": rank,
                   # the cross-rank answer, for the report: this rank's own divergence or what it received
                   "rank_divergence": per_rank[rank].message if rank in per_rank else None,
                   "rank_first": cross.first is not None and cross.first.rank == rank}
            row.update(outcome.summary(), unapplied=[])
            props.append((RESULT_PROPERTY, _publish(row)))
        if graph:
            props.append(("msprobe.graph", graph))
        unapplied = unapplied_faults_on_ranks(faults, world_size, check_dir)
        if unapplied:
            _fail_unapplied(c.inject, unapplied, check_dir)
        if cross.first is not None:
            lines = [f"msprobe: {cross.headline}"]
            lines += [f"  also: {d.message}" for d in cross.ranks if d is not cross.first]
            if graph:
                lines.append(f"graph: {graph}  (open: msprobe-ci view {os.path.dirname(os.path.dirname(graph))}; "
                             "the rank switch shows each rank)")
            lines.append(f"Artifacts: {check_dir}")
            pytest.fail("\n".join(lines), pytrace=False)
        for rank, outcome in outcomes.items():
            _fail_overflow_or_api(outcome, f"rank{rank} ", check_dir, self.session.require_coverage)
        return {r: o.report for r, o in outcomes.items()}

    def _check_merged(self, c: "_Check", job, world: int, bench_world: int, tp, pp, timeout: float):
        """check_parallel of differently partitioned sides: each side in its own ranks, merged, compared per
        data-parallel group; failures name the rank whose isolated verdict failed."""
        __tracebackhide__ = True
        import dataclasses

        from ..compare.merge import Parallel
        from ..compare.verdict import unit_roundoff
        from ..errors import MsprobeError
        from ..graph.service import compare_vis_db
        from ..parallel import (evaluate_merged, free_port, merged_where, rank_notes, run_ranks,
                                unapplied_faults_on_ranks)

        check_dir, st = c.dir, c.st
        try:
            sizes = {}
            for key, value in (("tp", tp), ("pp", pp)):
                pair = tuple(value) if isinstance(value, (tuple, list)) else (value, None)
                if len(pair) != 2:
                    raise MsprobeError(f"check_parallel: {key}: expected an int or (target, bench), got {value!r}")
                sizes[key] = pair
            par = [None, None]
            for side, n in ((0, world), (1, bench_world)):
                t_, p_ = sizes["tp"][side], sizes["pp"][side]
                if t_ is not None or p_ is not None:
                    t_ = t_ if t_ is not None else max(1, n // (p_ or 1))
                    par[side] = Parallel(n, int(t_), int(p_) if p_ is not None else max(1, n // int(t_)))
            sides = dict((s[0], s) for s in job.sides)
            run_ranks(dataclasses.replace(job, sides=(sides["bench"],), port=free_port()), bench_world, timeout)
            run_ranks(dataclasses.replace(job, sides=(sides["target"],), port=free_port()), world, timeout)
            results = evaluate_merged(os.path.join(check_dir, "target", "step0"),
                                      os.path.join(check_dir, "bench", "step0"), check_dir, par[0], par[1],
                                      isolate=job.isolate,
                                      cast_roundoff=unit_roundoff(str(c.target.dtype), str(c.bench.dtype)),
                                      notes=tuple(dict.fromkeys(n for r in range(max(world, bench_world))
                                                                for n in rank_notes(check_dir, r))))
            graph = None
            if not self.session.no_graph:
                graph = compare_vis_db(os.path.join(check_dir, "target"), os.path.join(check_dir, "bench"),
                                       self.session.graph_dir(c.nodeid, c.index), parallel=(par[0], par[1]),
                                       reports={(s, i): o.report for s, i, _, o in results})
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}. Artifacts: {check_dir}", pytrace=False) from None
        props = self.request.node.user_properties
        for step, i, merged, outcome in results:
            row = {"test": c.nodeid, "index": f"{c.index} group{i}", "dir": os.path.join(check_dir,
                                                                                        f"step{step}_group{i}"),
                   "bench": f"{c.bench.label} x{bench_world}", "target": f"{c.target.label} x{world}",
                   "level": st["level"], "bench_kernel": st["bench_kernel"] if c.isolate else None,
                   "notes": list(outcome.notes)}
            row.update(outcome.summary(), unapplied=[])
            props.append((RESULT_PROPERTY, _publish(row)))
        if graph:
            props.append(("msprobe.graph", graph))
        unapplied = unapplied_faults_on_ranks(c.faults, world, check_dir)
        if unapplied:
            _fail_unapplied(c.inject, unapplied, check_dir)
        for step, i, merged, outcome in results:
            first = outcome.first_divergence
            if first is None:
                continue
            where = merged_where(first, merged.ranks)
            detail = first.message.split(": ", 1)[-1] if first.message else first.status
            lines = [f"msprobe: first divergence: step{step} {where} {first.name}: {detail}",
                     f"  target ranks {merged.ranks} merged (TP/PP) against a bench of {bench_world} rank(s); "
                     f"CSV: {outcome.csv}"]
            if graph:
                lines.append(f"graph: {graph}")
            lines.append(f"Artifacts: {check_dir}")
            pytest.fail("\n".join(lines), pytrace=False)
        for step, i, merged, outcome in results:
            _fail_overflow_or_api(outcome, f"step{step} ranks {merged.ranks} ", check_dir, self.session.require_coverage)
        return {(s, i): o.report for s, i, _, o in results}

    def check_training(self, model: Any, batches: list, loss_fn: Callable[[Any], Any], optimizer: Callable,
                       *, grad_cosine: float = 0.99, **options: Any):
        """Train the model for one step per batch on the bench and the target, and fail at the first step whose
        computation diverges.

        Each side trains its own copy (same weights, cast to the side's dtype): forward, ``loss_fn(out)``, backward,
        ``optimizer(parameters).step()`` (its APIs captured in the same step), ``zero_grad()``, one ``step<N>``
        folder per step. Every step is judged with isolated verdicts, so a step whose inputs drifted because the
        weights trained apart is not blamed for it; the first step with an own divergence fails the test as
        ``first divergence at step 2: Functional.silu.1.forward ...``. Per step and parameter the gradients are
        compared as grad_probe does (norms, min/max, cosine of the gradient vectors, sign agreement); the loss
        curves of both sides and the first step whose gradient cosine drops below ``grad_cosine`` are reported.

        Args:
            model: an ``nn.Module`` (left untouched). batches: one batch per step (a tensor, a tuple of inputs or
                a dict of keyword inputs). loss_fn: output -> scalar loss.
            optimizer: ``optimizer(parameters) -> torch.optim.Optimizer`` (e.g. ``lambda p: torch.optim.AdamW(p,
                lr=1e-3)``).
            grad_cosine: the gradient-similarity level reported (default 0.99; reported, never failed on).
            options: as for :meth:`check` (bench, target, dtypes, level, task, inject, seed, isolate ...), and
                ``monitor`` (default ``--msprobe-monitor``): run :class:`msprobe_ci.TrainerMon` on both sides and
                fail on a target anomaly (NaN/Inf, a 10x jump over the running median) the bench does not share.

        Returns:
            ``{"losses": {"bench": [...], "target": [...]}, "grads": [[per-parameter record, ...] per step],
            "reports": [CompareReport per step]}``.
        """
        __tracebackhide__ = True
        from ..check import grad_similarity, run_training
        from ..config import DumpConfig
        from ..errors import MsprobeError

        c = self._begin(options, "check_training", model)
        monitored = bool(c.st["monitor"])
        runs = {}
        try:
            for side, backend in (("bench", c.bench), ("target", c.target)):
                cfg = DumpConfig(dump_path=os.path.join(c.dir, side), level=c.st["level"], task=c.st["task"])
                runs[side] = run_training(model, list(batches), loss_fn, optimizer, backend, cfg,
                                          faults=c.faults if side == "target" else (), seed=int(c.st["seed"]),
                                          isolator=_isolator(c, backward=True) if side == "target" else None,
                                          monitor_dir=os.path.join(c.dir, "monitor", side) if monitored else None)
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}. Artifacts: {c.dir}", pytrace=False) from None
        outcomes = self._judge_steps(c, runs["bench"].folders, runs["target"].folders)
        grads = [grad_similarity(b, t) for b, t in zip(runs["bench"].grads, runs["target"].grads)]
        losses = {"bench": runs["bench"].losses, "target": runs["target"].losses}
        curve = ", ".join(f"step{i} {b:.6g}/{t:.6g}" for i, (b, t) in enumerate(zip(losses["bench"],
                                                                                   losses["target"])))
        low = next(((i, g) for i, step in enumerate(grads) for g in step if g["cosine"] < grad_cosine), None)
        sim = (f"gradient cosine first below {grad_cosine:g} at step{low[0]} {low[1]['param']} "
               f"({low[1]['cosine']:.6f})") if low else f"gradient cosine >= {grad_cosine:g} at every step"
        self.request.node.user_properties.extend([
            ("msprobe.loss_bench", json.dumps(losses["bench"])), ("msprobe.loss_target", json.dumps(losses["target"])),
            ("msprobe.grad_similarity", sim)])
        first_notes = [f"loss bench/target: {curve}", sim, *runs["bench"].notes, *runs["target"].notes]
        new_anomalies = []
        if monitored:
            bench_mon, target_mon = runs["bench"].monitor, runs["target"].monitor
            shared = {(a.step, a.stage, a.name, a.rule) for a in bench_mon.anomalies}
            new_anomalies = [a for a in target_mon.anomalies if (a.step, a.stage, a.name, a.rule) not in shared]
            first_notes.append(f"monitor: target {len(target_mon.anomalies)} anomalies ({len(new_anomalies)} not on "
                               f"the bench), bench {len(bench_mon.anomalies)}; plot {target_mon.png or 'not drawn'}")
            if bench_mon.first is not None:
                first_notes.append(f"monitor: the bench itself is anomalous: {bench_mon.first.message}")
            self.request.node.user_properties.append(("msprobe.monitor", os.path.dirname(target_mon.db)))
        self._conclude_steps(c, outcomes, runs["target"].unapplied, first_notes,
                             [{"loss_bench": losses["bench"][i], "loss_target": losses["target"][i],
                               "grads": grads[i]} for i in range(len(outcomes))],
                             lambda i: f"step {i}", f"loss bench/target: {curve}; {sim}")
        if new_anomalies:
            a = new_anomalies[0]
            pytest.fail(f"msprobe: monitor: first target anomaly at {a.message}; the bench has none there "
                        f"({len(new_anomalies)} in all). Plot: {runs['target'].monitor.png}. Artifacts: {c.dir}",
                        pytrace=False)
        return {"losses": losses, "grads": grads, "reports": [o.report for o in outcomes]}

    def check_generate(self, model: Any, input_ids: Any, *, max_new_tokens: int, token_range: Any = None,
                       **options: Any):
        """Greedy generation, one captured forward per step (step 0 is the prefill, then one step per new token,
        with the model's KV cache), and fail at the first step whose computation diverges.

        The bench decodes freely; the target is teacher-forced on the bench's tokens, so every step compares the
        same computation even where a benign bf16 target would pick another token at a near tie. How often the
        target's own pick agrees with the bench's is reported (``msprobe.token_agreement``), never failed on.
        Each step is judged with isolated verdicts; the KV cache and inputs are compared with the bench at the
        prefill only (later the cache holds values that differ by rounding, which the steps that made them judged).

        Args:
            model: a causal LM taking ``input_ids``, ``past_key_values``, ``use_cache`` with ``.logits`` and
                ``.past_key_values`` in its output (transformers models).
            input_ids: ``[batch, prompt]`` token ids.
            max_new_tokens: decode steps after the prefill (>= 0).
            token_range: ``[a, b]`` (msprobe's ``start(token_range=...)``): capture and judge only forward calls
                a..b (0 = the prefill); the others run uncaptured, still teacher-forced. Default: the ``step``
                list of ``--msprobe-config``'s config.json when it has one, else every step.
            options: as for :meth:`check` (bench, target, dtypes, level, task, inject (faults take ``step: N``),
                seed, isolate ...).

        Returns:
            ``{"tokens": bench tokens per step, "target_picks": ..., "token_agreement": float, "reports": [...]}``.
        """
        __tracebackhide__ = True
        from ..check import run_decode
        from ..config import DumpConfig
        from ..errors import MsprobeError

        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise pytest.fail.Exception(f"msprobe: check_generate: max_new_tokens: expected an int >= 0, got "
                                        f"{max_new_tokens!r}", pytrace=False)
        if token_range is not None:
            ok = isinstance(token_range, (list, tuple)) and len(token_range) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in token_range) and \
                token_range[0] <= token_range[1] <= max_new_tokens
            if not ok:
                raise pytest.fail.Exception(f"msprobe: check_generate: token_range: expected [a, b] with 0 <= a <= b <= "
                                            f"max_new_tokens ({max_new_tokens}), got {token_range!r}", pytrace=False)
            capture = set(range(token_range[0], token_range[1] + 1))
        else:
            config_steps = getattr(self.session.dump_config, "step", None) or None
            capture = {s for s in config_steps if s <= max_new_tokens} if config_steps else None
            if capture is not None and not capture:
                raise pytest.fail.Exception(f"msprobe: check_generate: the config's step list {sorted(config_steps)} "
                                            f"holds no step <= max_new_tokens ({max_new_tokens})", pytrace=False)
        c = self._begin(options, "check_generate", model)

        def cfg(side: str) -> DumpConfig:
            return DumpConfig(dump_path=os.path.join(c.dir, side), level=c.st["level"], task=c.st["task"])

        try:
            bench_run = run_decode(model, input_ids, max_new_tokens, c.bench, cfg("bench"), seed=int(c.st["seed"]),
                                   capture_steps=capture)
            target_run = run_decode(model, input_ids, max_new_tokens, c.target, cfg("target"), forced=bench_run.picks,
                                    faults=c.faults, seed=int(c.st["seed"]), isolator=_isolator(c, backward=False),
                                    capture_steps=capture)
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}. Artifacts: {c.dir}", pytrace=False) from None
        steps = bench_run.steps
        outcomes = self._judge_steps(c, bench_run.folders, target_run.folders, steps)
        agree = [bool((b == t).all()) for b, t in zip(bench_run.picks, target_run.picks)]
        agreement = sum(agree) / len(agree) if agree else 1.0
        note = (f"token agreement (target's own greedy pick vs the bench's, teacher-forced): {sum(agree)}/"
                f"{len(agree)}" + ("" if all(agree) else f", first differs at step {agree.index(False)}"))
        self.request.node.user_properties.append(("msprobe.token_agreement", agreement))
        if capture is not None:
            note += f"; captured and judged steps {steps[0]}..{steps[-1]} of 0..{max_new_tokens}" if \
                steps == list(range(steps[0], steps[-1] + 1)) else f"; captured and judged steps {steps}"
        self._conclude_steps(c, outcomes, target_run.unapplied, [note, *bench_run.notes, *target_run.notes],
                             [{"token_agrees": agree[s]} for s in steps],
                             lambda i: f"step {i} ({'prefill' if i == 0 else f'decode token {i}'})", note, steps)
        return {"tokens": [p.tolist() for p in bench_run.picks], "target_picks": [p.tolist() for p in
                target_run.picks], "token_agreement": agreement, "reports": [o.report for o in outcomes]}

    @contextlib.contextmanager
    def monitor(self, model: Any, optimizer: Any = None, *, alert_factor: float = 10.0, warmup: int = 3,
                xy_distribution: bool = True, wg_distribution: bool = True, mv_distribution: bool = True):
        """Monitor the test's own training loop (msprobe's ``TrainerMon``) and fail at its first anomaly.

        Usage::

            with msprobe.monitor(model, opt) as mon:
                for batch in batches:
                    loss = model(**batch).loss
                    loss.backward(); mon.record_loss(loss)
                    opt.step(); opt.zero_grad()        # the optimizer's step closes each monitored step

        Without an optimizer call ``mon.close_step()`` at each step's end. Needs no bench and no baseline.

        Args:
            model: the ``nn.Module`` the loop trains. optimizer: its ``torch.optim.Optimizer`` (optional).
            alert_factor, warmup, xy_distribution, wg_distribution, mv_distribution: as
                :class:`msprobe_ci.TrainerMon` (jump rule: a norm above 10x the median of its previous values,
                once 3 exist).

        Yields:
            The :class:`msprobe_ci.TrainerMon`; ``mon.report`` holds the anomalies after the block.

        Raises:
            pytest.fail.Exception: at the end of the block, on the first anomaly (its step, stage and module),
                with the plot's path.
        """
        __tracebackhide__ = True
        from ..errors import MsprobeError
        from ..monitor import TrainerMon

        nodeid = self.request.node.nodeid
        try:
            base_dir = self.session.test_dir(nodeid) if self.checks == 0 else self._base_dir
            self._base_dir = base_dir
            index = self.checks
            self.checks += 1
            folder = os.path.join(base_dir, f"check{index}", "monitor")
            mon = TrainerMon(folder, alert_factor=alert_factor, warmup=warmup, xy_distribution=xy_distribution,
                             wg_distribution=wg_distribution, mv_distribution=mv_distribution)
            mon.set_monitor(model, optimizer)
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}", pytrace=False) from None
        try:
            yield mon
        finally:
            report = mon.close()
        first = report.first
        props = self.request.node.user_properties
        props += [("msprobe.monitor", folder), ("msprobe.monitor_steps", report.steps),
                  ("msprobe.monitor_anomalies", len(report.anomalies))]
        if report.png:
            props.append(("msprobe.monitor_png", report.png))
        by_step: dict[int, list] = {}
        for a in report.anomalies:
            by_step.setdefault(a.step, []).append(a)
        nodes = [{"name": f"step {i}", "status": "error" if i in by_step else "pass", "metric": "anomalies",
                  "value": len(by_step.get(i, ())), "threshold": 0, "input_error": "",
                  "worst_row": by_step[i][0].name if i in by_step else "",
                  "message": by_step[i][0].message if i in by_step else "no anomaly", "standard": "monitor",
                  "seconds": 0.0} for i in range(report.steps)]
        errors = sum(n["status"] == "error" for n in nodes)
        losses = ", ".join("nan" if v is None else f"{v:.6g}" for v in report.losses)
        row = _benchless_row(
            test=nodeid, index=index, dir=os.path.dirname(folder), bench="none (monitor)", target="this test's loop",
            level="module", mode="monitor", nodes_compared=report.steps,
            counts={"pass": len(nodes) - errors, "warning": 0, "error": errors, "unmatched": 0},
            first_divergence=f"step{first.step} {first.name}" if first else None, nodes=nodes,
            notes=[f"monitor: {report.steps} steps, {len(report.anomalies)} anomalies; loss per step: {losses}; "
                   f"plot {report.png or 'not drawn (no matplotlib)'}"])
        props.append((RESULT_PROPERTY, _publish(row)))
        if first is not None:
            pytest.fail(f"msprobe: monitor: first anomaly at {first.message} ({len(report.anomalies)} in all). "
                        f"Plot: {report.png}. Artifacts: {folder}", pytrace=False)

    def compare_dumps(self, target: str, bench: str, *, fuzzy: bool = False, data_mapping: str | None = None,
                      layer_mapping: str | None = None, cell_mapping: str | None = None,
                      api_mapping: str | None = None):
        """Gate a dump recorded elsewhere (another runner, another framework) against a bench dump.

        The same judgement as :meth:`check` without running a model: compare (a MindSpore dump against a PyTorch
        one, either way round, is matched across frameworks with no mapping file), CSV, graph, overflow, the
        per-API pre-check of a tensor dump, one JUnit testsuite, and a failure naming the first divergence.

        Args:
            target: the dump under test: a dump.json, rank folder or step folder with one rank.
            bench: the reference dump, same forms (a recorded baseline's rank folder works).
            fuzzy: msprobe's ``-fm`` matching.
            data_mapping, layer_mapping, cell_mapping, api_mapping: msprobe's ``-dm``/``-lm``/``-cm``/``-am`` YAML
                files (optional).

        Returns:
            The :class:`~msprobe_ci.compare.CompareReport`.

        Raises:
            pytest.fail.Exception: unreadable dumps (one line), or the first divergence / overflow.
        """
        __tracebackhide__ = True
        from ..check import SideRun, evaluate
        from ..compare.crossframe import Mappings
        from ..dump.reader import rank_folders
        from ..errors import MsprobeError

        session = self.session
        try:
            folders = [os.path.dirname(os.path.abspath(p)) if os.path.isfile(p) else rank_folders(p)[0]
                       for p in (target, bench)]
            mappings = Mappings.load(data=data_mapping, layer=layer_mapping, cell=cell_mapping, api=api_mapping)
            base_dir = session.test_dir(self.request.node.nodeid) if self.checks == 0 else self._base_dir
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}", pytrace=False) from None
        self._base_dir = base_dir
        index = self.checks
        self.checks += 1
        check_dir = os.path.join(base_dir, f"check{index}")
        os.makedirs(check_dir, exist_ok=True)
        nodeid = self.request.node.nodeid
        row = {"test": nodeid, "index": index, "dir": check_dir, "bench": f"dump {folders[1]}",
               "target": f"dump {folders[0]}", "level": "mix", "notes": []}
        try:
            outcome = evaluate(folders[1], SideRun(folders[0]), check_dir, level="mix", fuzzy=fuzzy, isolate=True,
                               graph_dir=None if session.no_graph else session.graph_dir(nodeid, index),
                               mappings=mappings)
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}", pytrace=False) from None
        return self._conclude(row, outcome, check_dir, "mix", [], None, "--msprobe-target=cpu")

    def _absent(self, row: dict, exc: Exception) -> None:
        """An absent device: a failure with --msprobe-require-device, else a skip that the summary lists."""
        if self.session.require_device:
            raise pytest.fail.Exception(f"msprobe: {exc} (--msprobe-require-device)", pytrace=False)
        self.request.node.user_properties.append((RESULT_PROPERTY, _publish(dict(row, skipped=str(exc)))))
        raise pytest.skip.Exception(f"msprobe: {exc}")

    def _capture_config(self, task: str, level: str, dump_path: str):
        from ..config import DumpConfig

        base = self.session.dump_config or DumpConfig()
        summary = "md5" if task == "md5" else base.summary_mode
        return base.with_overrides(task="tensor" if task == "tensor" else "statistics", level=level,
                                   summary_mode=summary, dump_path=dump_path)

    def _recording(self, bench, st: dict, task: str, level: str):
        """The test's baseline recording, created at its first check and committed at teardown."""
        if self._record is None:
            from ..baseline import Recording, new_manifest

            nodeid = self.request.node.nodeid
            manifest = new_manifest(nodeid, bench_device=bench.device, bench_dtype=st["bench_dtype"], task=task,
                                    level=level, seed=int(st["seed"]))
            self._record = Recording(self.session.baseline, nodeid, manifest)
        return self._record

    def finish(self) -> None:
        """Teardown: move a recorded baseline into place (nothing is stored for a test that recorded no check);
        release the test folder's lock."""
        self.session.release(self.request.node.nodeid)
        if self._record is not None:
            if self._record.checks:
                self._record.commit()
            else:
                self._record.discard()
            self._record = None

    @staticmethod
    def _run_side(model, inputs, loss_fn, backend, cfg, faults, seed, regions, eval_mode, isolator=None,
                  free_bench=None):
        from ..check import run_side
        from ..errors import MsprobeError

        try:
            run = run_side(model, inputs, loss_fn, backend, cfg, faults=faults, seed=seed, regions=regions,
                           eval_mode=eval_mode, isolator=isolator, free_bench=free_bench)
        except MsprobeError as exc:
            raise pytest.fail.Exception(f"msprobe: {exc}", pytrace=False) from None
        return run


@dataclass(frozen=True)
class _Check:
    """One loop or multi-rank check's settings (see ``MsprobeFixture._begin``)."""

    st: dict
    bench: Any
    target: Any
    faults: tuple
    isolate: bool
    dir: str
    index: int
    nodeid: str
    inject: str | None


def _isolator(c: _Check, backward: bool):
    """The target side's Isolator (``None`` with isolation off)."""
    return _make_isolator(c.st, c.bench, c.target, backward) if c.isolate else None


def _bench_kernel(st: dict, bench, target) -> str:
    """The bench kernel of a check: the option, or :func:`msprobe_ci.kernels.default_bench_kernel`."""
    from ..kernels import check_bench_kernel, default_bench_kernel

    if st.get("bench_kernel"):
        return check_bench_kernel(st["bench_kernel"])
    return default_bench_kernel(bench.torch_device if _available(bench) else "cpu", target.torch_device,
                                target.device)


def _oracle_choice(st: dict, target) -> str:
    """``cpu`` (float64 on the CPU) or ``target`` (the target's device, at most its
    :attr:`~msprobe_ci.backends.Backend.oracle_max`: :meth:`~msprobe_ci.backends.Backend.oracle_options`); unset:
    ``target`` on CUDA, ``cpu`` elsewhere; a CPU target's oracle is the CPU's."""
    from ..errors import MsprobeError

    choice = st.get("oracle_device") or ("target" if target.kind == "cuda" else "cpu")
    if choice not in ("cpu", "target"):
        raise MsprobeError(f"option 'oracle_device': expected 'cpu' or 'target', got {choice!r}")
    return "cpu" if target.kind == "cpu" else choice


def _make_isolator(st: dict, bench, target, backward: bool):
    from ..isolate import Isolator

    return Isolator(standards=dict(st["api_standards"] or {}), thresholds=dict(st["api_thresholds"] or {}),
                    target_device=target.torch_device, bench_device=bench.torch_device if _available(bench) else "cpu",
                    backward=backward, bench_kernel=_bench_kernel(st, bench, target),
                    **target.oracle_options(_oracle_choice(st, target)))


def _fail_unapplied(inject: str | None, unapplied: list, artifacts: str) -> None:
    """Fail the test for injected faults that never fired or changed no value: such a check proves nothing about
    the gate, whatever its verdict."""
    more = f" (+{len(unapplied) - 1} more)" if len(unapplied) > 1 else ""
    pytest.fail(f"msprobe: {inject}: {unapplied[0]}{more}; a fault that never fires or changes no value proves "
                f"nothing about the gate (fix its api/call/step/value). Artifacts: {artifacts}", pytrace=False)


def _coverage(outcome, where: str, artifacts: str, required: bool) -> None:
    """Warn (or with ``--msprobe-require-coverage`` fail) where the target computed outside every captured API."""
    __tracebackhide__ = True
    if not getattr(outcome, "coverage_short", False):
        return
    from ..capture.coverage import summary

    line = (f"msprobe: {where}{summary(outcome.coverage)}: that work has no per-API verdict (only the drift of an "
            f"enclosing module shows it). Artifacts: {artifacts} (coverage.json)")
    if required:
        pytest.fail(line + " [--msprobe-require-coverage]", pytrace=False)
    warnings.warn(line, stacklevel=3)


def _fail_overflow_or_api(outcome, where: str, artifacts: str, require_coverage: bool = False) -> None:
    """Fail on a judged outcome's new overflow or per-API pre-check error; ``where`` names the step or rank
    (``"step 2: "``, ``"rank1 "``); warn or fail on its coverage (:func:`_coverage`)."""
    __tracebackhide__ = True
    _coverage(outcome, where, artifacts, require_coverage)
    if outcome.overflow_failed:
        ov = outcome.overflow.first
        pytest.fail(f"msprobe: overflow on the target at {where}{ov.name} ({ov.level}); the bench has none there. "
                    f"Artifacts: {artifacts}", pytrace=False)
    if outcome.api_errors:
        a = outcome.api_errors[0]
        pytest.fail(f"msprobe: per-API pre-check at {where}{a.name}: {a.message}. Artifacts: {artifacts}",
                    pytrace=False)


def _benchless_row(**fields: Any) -> dict:
    """A result row for a check with no compare behind it (free benchmark, monitor): the compare fields the
    terminal summary and the JUnit writer read, empty, under ``fields``."""
    row = {"csv": "", "graph": None, "overflow_first": None, "overflow_failed": False, "isolated": False,
           "model": [], "overflow_message": "", "unapplied": [], "notes": []}
    row.update(fields)
    return row


def _write_free_csv(path: str, results: dict) -> None:
    """The free benchmark's verdicts, one row per API call in execution order."""
    import csv

    from ..outputs import atomic_write, make_output_dir

    make_output_dir(os.path.dirname(path))
    with atomic_write(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["API Name", "Status", "Metric", "Value", "Allowed", "Bit-noise Sensitivity", "Dtype", "Row",
                    "Message"])
        for name, r in results.items():
            w.writerow([name, r["status"], r.get("metric", ""), r.get("value", ""), r.get("threshold", ""),
                        r.get("sensitivity", ""), r.get("dtype", ""), r.get("row", ""), r["message"]])


def _publish(row: dict) -> str:
    """Write one check's summary to ``<check dir>/msprobe-result.json`` and return the path: the test report (and
    so pytest's own ``--junitxml``) carries the path, not a JSON blob of every node."""
    from ..dump.writer import atomic_write_json

    os.makedirs(row["dir"], exist_ok=True)
    path = os.path.join(row["dir"], "msprobe-result.json")
    atomic_write_json(path, row)
    return path


def _available(backend) -> bool:
    from ..errors import MsprobeError

    try:
        backend.check_available()
    except MsprobeError:
        return False
    return True


def _isolate_flag(value: Any) -> bool:
    from ..errors import MsprobeError

    if value in (True, "on", "true", "1"):
        return True
    if value in (False, "off", "false", "0", None):
        return False
    raise MsprobeError(f"option 'isolate': expected 'on' or 'off' (or a bool), got {value!r}")


def _positive(value: Any, name: str) -> float:
    from ..errors import MsprobeError

    try:
        v = float(value)
    except (TypeError, ValueError):
        raise MsprobeError(f"option '{name}': expected a positive number, got {value!r}") from None
    if not v > 0:
        raise MsprobeError(f"option '{name}': expected a positive number, got {value!r}")
    return v


def _folder(nodeid: str) -> str:
    from ..baseline import folder_for_test

    return folder_for_test(nodeid)


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _where(name: str, target_dump) -> str:
    """``in <module>; at <file, line, function>`` of a node: its module (construct.json) and the source line that
    called it (the first stack frame outside torch), as far as the dump knows them; empty when it knows neither."""
    construct = getattr(target_dump, "construct", {}) or {}
    stack = getattr(target_dump, "stack", {}) or {}
    where = []
    module = construct.get(name)
    if module:
        where.append(f"in {module}")
    frames = [str(f).split(", \n")[0].replace("File ", "") for f in stack.get(name) or []]
    user = [f for f in frames if f"{os.sep}torch{os.sep}" not in f]  # the line that called the API
    # a model made of torch's own modules has no frame outside torch: its module's line, not the dispatcher's
    torch_module = [f for f in frames if f"{os.sep}nn{os.sep}modules{os.sep}" in f]
    if frames:
        where.append(f"at {(user or torch_module or frames)[0]}")
    return "; ".join(where)


def _failure_message(report, check_dir: str, target_dump=None, graph_path: str | None = None,
                     replay: str = "") -> str:
    """First line: the API, its module, the source line, the standard, metric, value and threshold; then where to
    look (graph, replay command) and the other failing nodes."""
    first = report.first_divergence
    where = _where(first.name, target_dump)
    loc = f" ({where})" if where else ""
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
