"""The free benchmark mode: no bench side. Only the target runs; every API call is re-run on copies of its inputs
in higher precision and with bit-noised inputs (:mod:`msprobe_ci.free_benchmark`), and the check fails naming
the calls at risk."""

from __future__ import annotations

import os
from typing import Any, Callable

from ..errors import MsprobeError
from .conclude import RESULT, Draft, benchless_row, unapplied_message
from .outcome import num
from .context import CheckContext, check_available


def run_free_check(ctx: CheckContext, s, model: Any, inputs: tuple, loss_fn: Callable | None, row: dict,
                   regions: list):
    """``check()`` with no bench side: capture the target at L1 with the free benchmark and conclude, naming the
    API calls at risk (forward calls only; ``free_benchmark.csv`` and one JUnit testcase per call).

    Returns:
        A :class:`~msprobe_ci.check.conclude.Conclusion` whose value is ``{API call: result}``.

    Raises:
        MsprobeError: an unknown mode, or a baseline asked for (the free benchmark runs no bench).
        DeviceAbsent: the target's device is not here.
    """
    from ..free_benchmark import MODES, FreeBenchmark
    from .sides import run_side

    mode = s.free_benchmark
    mode = "improve_precision" if mode is True else mode
    if mode not in MODES:
        raise MsprobeError(f"free_benchmark: expected one of {list(MODES)}, got {mode!r}")
    if ctx.record or ctx.baseline:
        raise MsprobeError("--msprobe-free-benchmark runs no bench: it cannot record or read a baseline (drop one "
                           "of them)")
    check_available(s.target, row)
    check_dir = row["dir"]
    fb = FreeBenchmark(mode, seed=s.seed)
    level = "L1"  # the free benchmark judges API calls
    run = run_side(model, inputs, loss_fn, s.target, ctx.capture_config(s.task, level,
                                                                        os.path.join(check_dir, "target")),
                   faults=s.faults, seed=s.seed, regions=regions, eval_mode=False, free_bench=fb)
    csv_path = os.path.join(check_dir, "free_benchmark.csv")
    write_free_csv(csv_path, fb.results)
    nodes = [{"name": k, "status": v["status"], "metric": v.get("metric", "free_benchmark"),
              "value": num(v.get("value", 0.0)), "threshold": num(v.get("threshold", 0.0)),
              "input_error": "", "worst_row": v.get("row", ""), "message": v["message"],
              "standard": "free_benchmark", "seconds": v.get("seconds", 0.0)} for k, v in fb.results.items()]
    counts = {st: sum(n["status"] == st for n in nodes) for st in ("pass", "warning", "error", "skip")}
    errors = fb.errors()
    notes = row["notes"]
    notes.append(f"free benchmark ({mode}, bit-noise sensitivity): {len(nodes)} API calls, pass {counts['pass']}, "
                 f"at risk {counts['error']}, not judgeable {counts['skip']} (named in {csv_path})")
    if loss_fn is not None:
        notes.append("free benchmark judges forward calls only; the backward pass ran uncaptured by it")
    unapplied = list(run.unapplied)
    row = benchless_row(**dict(row, bench=f"none (free benchmark, {mode})", mode="free_benchmark", level=level,
                               csv=csv_path, nodes_compared=len(nodes), counts=dict(counts, unmatched=0),
                               first_divergence=errors[0][0] if errors else None, nodes=nodes,
                               unapplied=unapplied))
    d = Draft()
    d.properties += [(RESULT, row), ("msprobe.free_benchmark", mode), ("msprobe.error", counts["error"]),
                     ("msprobe.first_divergence", row["first_divergence"] or ""), ("msprobe.csv", csv_path)]
    if d.fail(unapplied_message(s.inject or ctx.inject_path, unapplied, check_dir)):
        return d.done(fb.results)
    if errors:
        name, rec = errors[0]
        more = "".join(f"\n  {v['message']}" for _, v in errors[1:5])
        rerun = str(rec.get("repro") or "")
        rerun = (f"\nreproduce this call alone, without the model (--no-fault leaves an injected fault out): "
                 f"python {rerun}") if rerun.endswith(".py") else ""
        d.fail(f"msprobe: free benchmark: {len(errors)} API call(s) at risk on {s.target.label}; first: "
               f"{rec['message']}{more}{rerun}\nArtifacts: {check_dir} (free_benchmark.csv)")
    return d.done(fb.results)


def write_free_csv(path: str, results: dict) -> None:
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
