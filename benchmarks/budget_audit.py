"""Where a benchmark-standard budget sits far above the error of the kernel it judges: benign isolated runs of
stock models, every call the benchmark standard judged against an error budget, its RMSE ratio (the target's RMSE
against the oracle over the budget's), gathered per API and direction. Calls bit-identical to the bench and calls
in fp32 in a half model (upcast logits, a LayerNorm's variance: the standard's fp32 floor decides) are left out.

    python benchmarks/budget_audit.py [--models gpt2,bert-sdpa,llama,...] [--dtypes bf16,fp16]
                                      [--bench-kernel upcast] [--seeds 0] [--below 0.2]

A correct kernel lands near 1 (a budget drawn as the kernel's own rounding) and must stay under 2 (the standard's
threshold). A kind whose median is far under 1 is budgeted for more error than its kernel makes, so a fault of
that size passes unseen: a boolean attention mask budgeted as no mask at all (RMSE ratio 0.003-0.01,
``docs/verdicts.md``) sat there. Prints one line per API kind and direction (calls, median, lowest, highest),
the kinds whose median is under ``--below`` marked ``LOW``. Models: ``gate_quality.py``'s and
``unseen_architectures.py``'s names.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate_quality as gq  # noqa: E402
import unseen_architectures as ua  # noqa: E402

from msprobe_ci.compare.isolation_file import load_isolation  # noqa: E402

warnings.filterwarnings("ignore")


def _case(name: str, seed: int):
    try:
        return gq.case(name, seed)
    except ValueError:
        return ua.build(name, seed)


def _kind(node: str) -> str:
    """``Functional.linear.3.backward`` -> ``Functional.linear backward``."""
    parts = node.split(".")
    return f"{parts[0]}.{parts[1]} {parts[-1]}" if len(parts) >= 4 else node


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,bert-sdpa,llama,t5,cnn,vit,opt,mixtral")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--bench-kernel", default="upcast")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--below", type=float, default=0.2, help="a median RMSE ratio under this is marked LOW")
    args = ap.parse_args()
    gq.ISOLATOR.update(bench_kernel=args.bench_kernel)
    ratios: dict = defaultdict(list)
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                model, inputs, loss_fn = _case(name, seed)
                bench_dtype, target_dtype, _ = gq.DTYPES[dtype]
                got: dict = {}
                dtypes: dict = {}

                def inspect(rep, folder, got=got, dtypes=dtypes):
                    got.update(load_isolation(folder) or {})
                    with open(os.path.join(folder, "dump.json"), encoding="utf-8") as f:
                        data = json.load(f).get("data", {})
                    for node, entry in data.items():
                        for i, rec in enumerate((entry or {}).get("output") or []):
                            if isinstance(rec, dict) and "dtype" in rec:
                                dtypes[f"{node}.output.{i}"] = str(rec["dtype"])
                report = gq._one(model, inputs, loss_fn, bench_dtype, target_dtype, (), inspect=inspect)[0]
                failing = sum(n.status == "error" for n in report.nodes)
                for node, rec in got.items():
                    r, m = rec.metrics.get("rmse_ratio"), rec.metrics
                    # only the calls a budget judged: not those bit-identical to the bench (every ratio 1, no
                    # errors measured), nor fp32 calls in a half model (upcast logits, a LayerNorm's variance:
                    # the standard's floor for fp32 decides there)
                    if rec.standard == "benchmark" and isinstance(r, (int, float)) and r == r and \
                            "target_rmse" in m and "float32" not in dtypes.get(rec.row, "float32"):
                        ratios[(_kind(node), dtype)].append((float(r), f"{name}:{node}"))
                print(f"{name} {dtype} seed {seed}: {len(got)} records, {failing} nodes failing", flush=True)
    print(f"\n{'API and direction':48} {'dtype':6} {'calls':>5} {'median':>8} {'lowest':>8} {'highest':>8}")
    for (kind, dtype), rows in sorted(ratios.items(), key=lambda kv: statistics.median(r for r, _ in kv[1])):
        values = [r for r, _ in rows]
        med = statistics.median(values)
        low = min(rows)
        mark = ("  LOW" if med < args.below else "") + f"  (lowest: {low[1]})"
        print(f"{kind:48} {dtype:6} {len(values):5d} {med:8.3f} {low[0]:8.3f} {max(values):8.3f}{mark}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
