"""The single check: one forward (and backward) of a model on the bench and the target, judged and concluded.

Three ways it runs: both sides here; the target against a recorded baseline (``--msprobe-baseline``); the bench
alone, recorded into a baseline (``--msprobe-record``). With ``free_benchmark`` there is no bench at all
(:mod:`msprobe_ci.check.free`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

from ..errors import MsprobeError
from .conclude import RESULT, Conclusion, conclude_check
from .context import CheckContext, check_available
from .settings import CheckSettings
from .sides import run_side


def run_check(ctx: CheckContext, s: CheckSettings, model: Any, inputs: tuple,
              loss_fn: Callable[[Any], Any] | None = None) -> Conclusion:
    """Run ``model(*inputs)`` on both sides under capture (isolation on the target), judge, conclude.

    Args:
        ctx: the test's folders, baseline and run-wide choices. s: the check's settings.
        model: an ``nn.Module`` (deep-copied per side, left untouched). inputs: positional inputs, or one dict of
            keyword inputs. loss_fn: output -> scalar loss (enables backward capture).

    Returns:
        The :class:`~msprobe_ci.check.conclude.Conclusion`; its value is the CompareReport (``None`` when
        recording, the free benchmark's results with ``free_benchmark``).

    Raises:
        DeviceAbsent: a side's device is not here. MsprobeError: bad input, unreadable dumps or baseline.
    """
    import torch

    from ..backends import compile_backend, compile_regions
    from ..baseline import folder_for_test, load_check

    if not isinstance(model, torch.nn.Module):
        raise MsprobeError(f"msprobe.check(model, ...): expected a torch.nn.Module, got {type(model).__name__} "
                           "(wrap a plain function in an nn.Module whose forward calls it)")
    bench, target = s.bench, s.target
    index, check_dir = ctx.next_check()
    nodeid = ctx.nodeid
    replay = ctx.baseline is not None and not ctx.record
    if ctx.baseline is not None and s.bench_autocast:
        raise MsprobeError("bench_autocast with --msprobe-baseline: a baseline's manifest records the bench's "
                           "device and dtype, not its autocast; record and gate an fp32 (or cast) bench instead")
    task, level = s.task, ("L0" if target.compile else s.level)
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
    if s.isolate:
        row["bench_kernel"] = s.bench_kernel
    if s.free_benchmark:
        from .free import run_free_check

        return run_free_check(ctx, s, model, inputs, loss_fn, row, regions)

    if ctx.record:
        check_available(bench, row)
        recording = ctx.recording(bench.device, s.bench_dtype, task, level, s.seed)
        folder = run_side(model, inputs, loss_fn, bench, ctx.capture_config(task, level, recording.check_dir(index)),
                          seed=s.seed, regions=regions, eval_mode=eval_mode).folder
        size = recording.add_check(index, folder)
        row.update(recorded=True, mode=task, baseline_bytes=size,
                   baseline=os.path.join(ctx.baseline, folder_for_test(nodeid)))
        return Conclusion(None, ((RESULT, row), ("msprobe.baseline_bytes", size)))

    stored = None
    if replay:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stored = load_check(ctx.baseline, nodeid, index, bench_device=bench.device, bench_dtype=s.bench_dtype,
                                task=task, level=level)
        for w in caught:
            warnings.warn(w.message, stacklevel=2)
        task = stored.manifest.get("task", task)
        level = "L0" if target.compile else stored.manifest.get("level", level)
        recorded = stored.manifest.get("bench") or {}
        row.update(level=level, baseline=os.path.join(ctx.baseline, folder_for_test(nodeid)),
                   baseline_bytes=stored.bytes,
                   bench=f"{recorded.get('device')}/{recorded.get('dtype') or 'model-dtype'} (baseline)")
    sides = [("target", target, s.faults)] if replay else [("bench", bench, ()), ("target", target, s.faults)]
    for _, backend, _ in sides:
        check_available(backend, row)
    if not replay and bench.label == target.label:
        notes.append(f"warning: bench and target are the same ({bench.label}): only capture is checked; set "
                     "--msprobe-target/--msprobe-target-dtype (or --msprobe-bench-dtype) to compare two backends")
    runs: dict[str, Any] = {}
    for side, backend, side_faults in sides:
        isolator = s.isolator(loss_fn is not None, backend) if side == "target" else None
        runs[side] = run_side(model, inputs, loss_fn, backend,
                              ctx.capture_config(task, level, os.path.join(check_dir, side)), faults=side_faults,
                              seed=s.seed, regions=regions, eval_mode=eval_mode, isolator=isolator,
                              spill_outputs=True)
    from .outcome import evaluate

    try:
        outcome = evaluate(
            stored.rank_folder if stored is not None else runs["bench"], runs["target"], check_dir,
            s.judge.replace(level=level), graph_dir=None if ctx.graph_dir is None else ctx.graph_dir(index))
    except MsprobeError as exc:
        hint = f" (baseline {row['baseline']}; re-record it with --msprobe-record)" if replay else ""
        raise MsprobeError(f"{exc}{hint}") from None
    inject = s.inject or ctx.inject_path
    return conclude_check(row, outcome, check_dir, level, list(runs["target"].unapplied), inject,
                          f"--msprobe-target={target.device}", stored, ctx.require_coverage)
