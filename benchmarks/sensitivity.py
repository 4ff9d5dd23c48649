"""Sensitivity: the smallest single-API scale fault the gate names exactly, per standard and dtype, beside what
msprobe's own thresholds flag on the same numbers.

On the gate-quality models (``benchmarks/gate_quality.py``: stock transformers Llama, BERT, GPT-2, T5 and a CNN,
forward+backward, CPU target, statistics task), faults are picked as there (forward and backward APIs early, mid
and late) and each is run at every size of a ladder (scale ``1 + size``). Each faulty run is judged twice:

* **ours**: isolation with the error budgets (:mod:`msprobe_ci.kernels`), named exactly when the first divergence
  is the faulty API;
* **msprobe**: the same isolated numbers judged relative to ``|oracle|`` alone (``budget_draws=0``: msprobe's
  benchmark metrics and ratio thresholds with its ``min_err`` floors), flagged when the faulty API errors.

Printed per dtype and standard (the one that judged the faulty API): the faults, and for each size the share named
exactly (ours) and flagged (msprobe); then the smallest size at which every fault is named / flagged.

    python benchmarks/sensitivity.py [--models llama,bert,gpt2,t5,cnn] [--dtypes bf16,fp16,fp32]
                                     [--bench-kernel upcast] [--seeds 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate_quality as gq  # noqa: E402 - the grid's models and pipeline

from msprobe_ci.capture.inject import Fault  # noqa: E402
from msprobe_ci.kernels import BENCH_KERNELS  # noqa: E402

warnings.filterwarnings("ignore")

LADDER = {"bf16": (0.005, 0.01, 0.02), "fp16": (0.001, 0.002, 0.005, 0.01),
          "fp32": (0.0001, 0.0002, 0.0005, 0.001)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama,bert,gpt2,t5,cnn")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--bench-kernel", default="upcast", choices=BENCH_KERNELS)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--sizes", default=None, help="comma-separated fault sizes (default: the dtype's ladder)")
    ap.add_argument("--misses", action="store_true", help="print each fault ours does not name, as it runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # {(dtype, standard): {size: [ours named, msprobe flagged, faults]}}
    table: dict = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    for dname in args.dtypes.split(","):
        bench_dtype, target_dtype, _ = gq.DTYPES[dname]
        for mname in args.models.split(","):
            for seed in range(args.seeds):
                model, inputs, loss_fn = gq.case(mname, 100 + seed)
                gq.ISOLATOR.clear()
                gq.ISOLATOR.update(bench_kernel=args.bench_kernel)
                _, _, ref, _, _ = gq._one(model, inputs, loss_fn, bench_dtype, target_dtype, ())
                for node, fault in gq._pick_faults(ref.data, (1.0,), seed):
                    if fault.perturb != "scale":
                        continue
                    for size in ([float(v) for v in args.sizes.split(",")] if args.sizes else LADDER[dname]):
                        f = Fault(fault.api, fault.call, fault.direction, "scale", 1 + size)
                        gq.ISOLATOR.update(budget_draws=4)
                        rep, _, _, _, unapplied = gq._one(model, inputs, loss_fn, bench_dtype, target_dtype, (f,))
                        if unapplied:
                            continue
                        mine = _node(rep, node)
                        standard = (mine.metrics.get("standard") if mine is not None else None) or "?"
                        first = rep.first_divergence
                        row = table[(dname, standard)][size]
                        row[2] += 1
                        row[0] += int(first is not None and first.name == node)
                        if args.misses and (first is None or first.name != node):
                            print(f"miss {dname} {mname} seed {100 + seed} {node} {size:.2%} ({standard}): first "
                                  f"{first.name if first is not None else None}; its verdict "
                                  f"{mine.status if mine is not None else None}", flush=True)
                        gq.ISOLATOR.update(budget_draws=0)
                        rep0, _, _, _, _ = gq._one(model, inputs, loss_fn, bench_dtype, target_dtype, (f,))
                        theirs = _node(rep0, node)
                        row[1] += int(theirs is not None and theirs.status == "error")
                gq.ISOLATOR.pop("budget_draws", None)
    print(f"bench kernel {args.bench_kernel}, models {args.models}, {args.seeds} seed(s), forward+backward, "
          "statistics task, CPU target")
    print(f"{'dtype':<6} {'standard':<12} {'faults':>6}  " + "  ".join(f"{'size':>6} {'ours':>5} {'msprobe':>7}"
                                                                       for _ in range(1)))
    for (dname, standard), sizes in sorted(table.items()):
        n = max(v[2] for v in sizes.values())
        cells = "  ".join(f"{s:>6.2%} {v[0] / max(v[2], 1):>5.0%} {v[1] / max(v[2], 1):>7.0%}"
                          for s, v in sorted(sizes.items()))
        ours = next((s for s, v in sorted(sizes.items()) if v[2] and v[0] == v[2]), None)
        theirs = next((s for s, v in sorted(sizes.items()) if v[2] and v[1] == v[2]), None)
        print(f"{dname:<6} {standard:<12} {n:>6}  {cells}  | smallest named 100%: "
              f"{'-' if ours is None else f'{ours:.2%}'}, msprobe flags 100%: "
              f"{'-' if theirs is None else f'{theirs:.2%}'}")


def _node(report, name):
    return next((n for n in report.nodes if n.name == name), None)


if __name__ == "__main__":
    main()
