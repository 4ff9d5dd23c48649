"""The parallel mode: a model split over ranks on both sides (torch.distributed), judged rank by rank, concluded
naming the rank whose own computation diverged first; differently partitioned sides are merged (TP/PP) per
data-parallel group first (:func:`evaluate_merged`, which ``msprobe-ci compare --tp/--pp`` runs too). The ranks
themselves run on :mod:`msprobe_ci.check.ranks`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from ..errors import MsprobeError
from ..judge.settings import JudgeSettings
from .conclude import RESULT, Draft, overflow_or_api, unapplied_message
from .context import CheckContext


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MsprobeError(f"check_parallel: {name}: expected a positive int, got {value!r}")
    return value


def check_parallel(ctx: CheckContext, s, build: Callable[[int, int], Any], inputs: tuple, *, world_size: int,
                   bench_world_size: int | None = None, loss_fn: Callable[[Any], Any] | None = None,
                   timeout: float = 300.0, tp: Any = None, pp: Any = None, optimizer: Callable | None = None,
                   steps: int = 1):
    """Run ``build(rank, world_size)`` on every rank of both sides, judge, conclude.

    Args:
        ctx: the test's :class:`~msprobe_ci.check.context.CheckContext`. s: the check's settings.
        build: a module-level function returning a rank's module; inputs: every rank's inputs. A ``build`` that
            takes a third argument, the side's dtype (``build(rank, world_size, dtype)``; ``None`` for
            ``model-dtype``), applies it itself (an FSDP ``MixedPrecisionPolicy(param_dtype=dtype)``, the
            policy's casts then part of the target's arithmetic): its model is not cast.
        optimizer: ``optimizer(parameters) -> torch.optim.Optimizer`` (module-level): each side trains ``steps``
            steps on ``inputs`` (forward, loss, backward, ``step()``, ``zero_grad()``, as
            :func:`~msprobe_ci.check.training.run_training`), one ``step<N>`` folder each, every step judged; from
            step 1 on the weights are context (they moved apart by rounding, which the steps that made them
            judged). ``loss_fn`` is required then.
        steps: training steps with an ``optimizer`` (default 1).
        world_size, bench_world_size: ranks of the target and of the bench (default the same).
        loss_fn: output -> scalar loss on every rank. timeout: seconds before hung ranks are terminated.
        tp, pp: tensor/pipeline-parallel sizes, ``(target, bench)`` or one int for the target; any of
            ``bench_world_size != world_size``, ``tp``, ``pp`` merges each side per data-parallel group.

    Returns:
        A :class:`~msprobe_ci.check.conclude.Conclusion` whose value is ``{rank: CompareReport}`` (with several
        ``steps``: ``{(step, rank): CompareReport}``), or when merged ``{(step, data-parallel group):
        CompareReport}``.

    Raises:
        MsprobeError: a bad size, a rank that raised or hung, unreadable dumps (``. Artifacts: <dir>`` appended).
    """
    from ..compare.ranks import first_divergence_across_ranks
    from ..graph.service import compare_vis_db
    from .ranks import RankJob, free_port, rank_notes, run_ranks, unapplied_faults_on_ranks
    from .outcome import SideRun, evaluate

    world_size = _positive_int(world_size, "world_size")
    bench_world_size = _positive_int(world_size if bench_world_size is None else bench_world_size,
                                     "bench_world_size")
    merged = bench_world_size != world_size or tp is not None or pp is not None
    steps = _positive_int(steps, "steps")
    if optimizer is not None and loss_fn is None:
        raise MsprobeError("check_parallel: optimizer needs a loss_fn (the loss each training step backpropagates)")
    if steps > 1 and optimizer is None:
        raise MsprobeError(f"check_parallel: steps={steps} needs an optimizer (one training step per step)")
    if merged and optimizer is not None:
        raise MsprobeError("check_parallel: training steps (optimizer) are checked rank against rank; a bench of "
                           "another partition (bench_world_size, tp, pp) is checked for one forward/backward")
    if s.target.fp8:
        raise MsprobeError("check_parallel: target_fp8 converts a copy of one model, and each rank builds its own "
                           "(sharded) model: convert it in your build function (torchao.float8."
                           "convert_to_float8_training before fully_shard, as torchao's FSDP2 recipe does)")
    index, check_dir = ctx.next_check()
    os.makedirs(check_dir, exist_ok=True)
    # a compiled target (each rank's blocks compiled regionally, as msprobe.check compiles them): both sides at
    # L0, so that module nodes pair; each compiled block judged whole against its eager self on the rank
    level = "L0" if s.target.compile else s.level
    job = RankJob(build=build, inputs=tuple(inputs), loss_fn=loss_fn, out=check_dir,
                  sides=(("bench", s.bench_device, s.bench_dtype, s.bench_autocast, False),
                         ("target", s.target_device, s.target_dtype, s.target_autocast, s.target.compile)),
                  level=level, task=s.task, seed=s.seed, faults=tuple(s.faults), judge=s.judge.replace(level=level),
                  port=free_port(), backend=s.target.dist_backend, oracle_device=s.oracle_device,
                  optimizer=optimizer, steps=steps if optimizer is not None else 1)
    if merged:
        return _check_merged(ctx, s, job, index, world_size, bench_world_size, tp, pp, float(timeout))
    outcomes = {}
    try:
        run_ranks(job, world_size, float(timeout))
        for step in range(job.steps):
            for rank in range(world_size):
                folder = {side: os.path.join(check_dir, side, f"step{step}", f"rank{rank}")
                          for side in ("bench", "target")}
                target_run = SideRun(folder["target"], notes=rank_notes(check_dir, rank) if step == 0 else ())
                out = os.path.join(check_dir, f"rank{rank}" if job.steps == 1 else f"step{step}_rank{rank}")
                # from step 1 on the weights and optimizer state are context (moved apart by rounding)
                outcomes[(step, rank)] = evaluate(folder["bench"], target_run, out, job.judge.for_step(step))
        graph = None
        if ctx.graph_dir is not None:
            graph = compare_vis_db(os.path.join(check_dir, "target"), os.path.join(check_dir, "bench"),
                                   ctx.graph_dir(index), reports={k: o.report for k, o in outcomes.items()})
    except MsprobeError as exc:
        raise MsprobeError(f"{exc}. Artifacts: {check_dir}") from None
    d = Draft()
    cross = first_divergence_across_ranks({k: (o.report, o.target_dump) for k, o in outcomes.items()})
    per_rank = {(r.step, r.rank): r for r in cross.ranks}
    for (step, rank), outcome in outcomes.items():
        where = f"rank{rank}" if job.steps == 1 else f"step{step} rank{rank}"
        row = {"test": ctx.nodeid, "index": f"{index} {where}",
               "dir": os.path.join(check_dir, where.replace(" ", "_")),
               "bench": f"{s.bench.label} x{world_size}", "target": f"{s.target.label} x{world_size}",
               "level": job.level, "bench_kernel": s.bench_kernel if s.isolate else None,
               "notes": list(outcome.notes), "rank": rank, **({"step": step} if job.steps > 1 else {}),
               # the cross-rank answer, for the report: this rank's own divergence or what it received
               "rank_divergence": per_rank[(step, rank)].message if (step, rank) in per_rank else None,
               "rank_first": cross.first is not None and (cross.first.step, cross.first.rank) == (step, rank)}
        row.update(outcome.summary(), unapplied=[])
        d.properties.append((RESULT, row))
    if graph:
        d.properties.append(("msprobe.graph", graph))
    value = {k if job.steps > 1 else k[1]: o.report for k, o in outcomes.items()}
    inject = s.inject or ctx.inject_path
    if d.fail(unapplied_message(inject, unapplied_faults_on_ranks(s.faults, world_size, check_dir), check_dir)):
        return d.done(value)
    if cross.first is not None:
        lines = [f"msprobe: {cross.headline}"]
        lines += [f"  also: {r.message}" for r in cross.ranks if r is not cross.first]
        if graph:
            lines.append(f"graph: {graph}  (open: msprobe-ci view {os.path.dirname(os.path.dirname(graph))}; "
                         "the rank switch shows each rank)")
        lines.append(f"Artifacts: {check_dir}")
        d.fail("\n".join(lines))
        return d.done(value)
    for (step, rank), outcome in outcomes.items():
        where = f"rank{rank} " if job.steps == 1 else f"step{step} rank{rank} "
        if overflow_or_api(d, outcome, where, check_dir, ctx.require_coverage):
            break
    return d.done(value)


def _check_merged(ctx: CheckContext, s, job, index: int, world: int, bench_world: int, tp, pp, timeout: float):
    """check_parallel of differently partitioned sides: each side in its own ranks, merged, compared per
    data-parallel group; failures name the rank whose isolated verdict failed."""
    from ..compare.merge import Parallel
    from ..graph.service import compare_vis_db
    from .ranks import free_port, rank_notes, run_ranks, unapplied_faults_on_ranks

    check_dir = job.out
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
        sides = dict((side[0], side) for side in job.sides)
        run_ranks(dataclasses.replace(job, sides=(sides["bench"],), port=free_port()), bench_world, timeout)
        run_ranks(dataclasses.replace(job, sides=(sides["target"],), port=free_port()), world, timeout)
        results = evaluate_merged(os.path.join(check_dir, "bench", "step0"),
                                  os.path.join(check_dir, "target", "step0"), check_dir, job.judge, par[1], par[0],
                                  notes=tuple(dict.fromkeys(n for r in range(max(world, bench_world))
                                                            for n in rank_notes(check_dir, r))))
        graph = None
        if ctx.graph_dir is not None:
            graph = compare_vis_db(os.path.join(check_dir, "target"), os.path.join(check_dir, "bench"),
                                   ctx.graph_dir(index), parallel=(par[0], par[1]),
                                   reports={(st, i): o.report for st, i, _, o in results})
    except MsprobeError as exc:
        raise MsprobeError(f"{exc}. Artifacts: {check_dir}") from None
    d = Draft()
    for step, i, merged, outcome in results:
        row = {"test": ctx.nodeid, "index": f"{index} group{i}", "dir": os.path.join(check_dir, f"step{step}_group{i}"),
               "bench": f"{s.bench.label} x{bench_world}", "target": f"{s.target.label} x{world}",
               "level": job.level, "bench_kernel": s.bench_kernel if s.isolate else None,
               "notes": list(outcome.notes)}
        row.update(outcome.summary(), unapplied=[])
        d.properties.append((RESULT, row))
    if graph:
        d.properties.append(("msprobe.graph", graph))
    value = {(st, i): o.report for st, i, _, o in results}
    if d.fail(unapplied_message(s.inject or ctx.inject_path, unapplied_faults_on_ranks(s.faults, world, check_dir),
                                check_dir)):
        return d.done(value)
    for step, i, merged, outcome in results:
        first = outcome.first_divergence
        if first is None:
            continue
        at = merged_where(first, merged.ranks)
        detail = first.message.split(": ", 1)[-1] if first.message else first.status
        lines = [f"msprobe: first divergence: step{step} {at} {first.name}: {detail}",
                 f"  target ranks {merged.ranks} merged (TP/PP) against a bench of {bench_world} rank(s); "
                 f"CSV: {outcome.csv}"]
        if graph:
            lines.append(f"graph: {graph}")
        lines.append(f"Artifacts: {check_dir}")
        d.fail("\n".join(lines))
        return d.done(value)
    for step, i, merged, outcome in results:
        if overflow_or_api(d, outcome, f"step{step} ranks {merged.ranks} ", check_dir, ctx.require_coverage):
            break
    return d.done(value)


def evaluate_merged(bench: str, target: str, out_dir: str, settings: JudgeSettings = JudgeSettings(), par_b=None,
                    par_t=None, *, notes: tuple = ()) -> list:
    """Judge a multi-rank target against a differently partitioned bench: merge each side's TP/PP ranks into one
    model per data-parallel group (:mod:`msprobe_ci.compare.merge`), and judge the merged dumps with the target
    ranks' isolation records under their merged names (a node judged on several ranks keeps the worst verdict,
    naming its rank): the merging is a transform of the dumps and their records before the one judgement
    (:func:`~msprobe_ci.check.outcome.judge_dumps`).

    Args:
        bench, target: the sides' step folders (``.../step0`` holding ``rank<R>``) or dump roots.
        out_dir: where the compare CSVs go (``compare_result_step<S>_group<i>_<ts>.csv``).
        settings: what the judgement is told (:class:`~msprobe_ci.judge.JudgeSettings`; its ``mappings``: the
            ``-lm``/``-cm`` module renames between suites).
        par_b, par_t: each side's :class:`~msprobe_ci.compare.merge.Parallel` (``None``: inferred).
        notes: report lines of the runs (:func:`msprobe_ci.check.ranks.rank_notes`), added to every group's outcome.

    Returns:
        ``[(step, group index, Merged target, CheckOutcome)]``.

    Raises:
        MsprobeError: unreadable dumps, or layouts that do not fit the rank folders.
    """
    from ..compare.isolation_file import load_isolation
    from ..compare.merge import merge_isolation, merged_pairs
    from ..overflow import check_overflow, new_overflows
    from .outcome import CheckOutcome, judge_dumps, merge_coverage, read_coverage

    out = []
    for step, i, t, b in merged_pairs(target, bench, par_t, par_b):
        records = None
        if settings.isolate:
            folders = {r: _rank_folder(t.dump.folder, r) for r in t.ranks}
            records = merge_isolation({r: load_isolation(f) for r, f in folders.items()}, t.renames)
        report = judge_dumps(b.dump, t.dump, settings, records=records)
        csv_path = report.write_csv(out_dir, prefix=f"compare_result_step{step}_group{i}")
        overflow = new_overflows(check_overflow(t.dump), check_overflow(b.dump))
        merged = [f"merged target ranks {t.ranks} against bench ranks {sorted({r for r in b.renames})}", *notes]
        coverage = merge_coverage([read_coverage(_rank_folder(t.dump.folder, r)) for r in t.ranks], merged)
        out.append((step, i, t, CheckOutcome(report, t.dump, b.dump, csv_path, None, (), overflow, (), tuple(merged),
                                             coverage)))
    return out


def _rank_folder(first_folder: str, rank: int) -> str:
    """The folder of ``rank`` beside ``first_folder`` (``.../rank0`` → ``.../rank<rank>``)."""
    parent = os.path.dirname(os.path.normpath(first_folder))
    return os.path.join(parent, f"rank{rank}")


def merged_where(node, ranks: list[int]) -> str:
    """Where a merged group's node diverged: ``rank<R>`` when a rank's isolation record judged it (the record's
    ``rank``), else the group's ranks."""
    rank = (node.metrics or {}).get("rank")
    return f"rank{rank}" if rank is not None else f"ranks {ranks} (merged)"
