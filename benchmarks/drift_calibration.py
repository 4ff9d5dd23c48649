"""The drift rule (statistics dumps without ``isolation.json``) at realistic sizes.

Stock GPT-2 configs (``small``: 124M, 12 layers x 768; ``medium``: 355M, 24 layers x 1024; no weights
downloaded), 1 x T tokens, forward and backward (LM loss), a bf16 or fp16 target against an fp32 bench, both dumped
with ``msprobe_ci.PrecisionDebugger(task="statistics", level="mix", isolate=False)`` as a user's training script
would (or msprobe's own debugger: the same files), then judged offline by ``check.judge`` as ``msprobe-ci compare``
does. For each run: the benign pair's errors and warnings, the node closest to its threshold, and for each fault
(2% scale on one forward API output) the first divergence and the other errors.

    python benchmarks/drift_calibration.py [--sizes small,medium] [--tokens 512,1024,2048]
                                           [--dtypes bf16,fp16] [--faults Functional.layer_norm:11,Torch.addmm:20,...]
                                           [--threads 2] [--worst 5] [--msprobe]

``--msprobe``: the benign pairs dumped by msprobe's own ``PrecisionDebugger`` (mindstudio-probe) instead.

A row per (size, tokens, dtype): benign errors / warnings / worst value-over-budget; then per fault: named
exactly (yes/no), first divergence, other error nodes.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import tempfile
import time
import warnings

import torch
import transformers

from msprobe_ci import PrecisionDebugger
from msprobe_ci.capture.inject import Fault
from msprobe_ci.check import judge, unapplied_faults
from msprobe_ci.judge import JudgeSettings

warnings.filterwarnings("ignore")
SIZES = {"small": dict(n_embd=768, n_layer=12, n_head=12), "medium": dict(n_embd=1024, n_layer=24, n_head=16)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build(size: str, seed: int = 11):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_positions=2048, **SIZES[size])
    cfg._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(cfg).eval()


def dump(model, ids, dtype, folder, faults=()):
    m = copy.deepcopy(model).to(dtype)
    dbg = PrecisionDebugger(dump_path=folder, level="mix", task="statistics", isolate=False,
                            inject=list(faults) or None)
    torch.manual_seed(1234)
    dbg.start(m)
    m(input_ids=ids, labels=ids).loss.backward()
    dbg.stop()
    del m
    if faults:
        missed = unapplied_faults(tuple(faults), dbg.session)
        if missed:
            raise SystemExit(f"fault not applied: {missed}")
    return os.path.join(folder, "step0", "rank")


def dump_msprobe(size: str, tokens: int, dtype: str, folder: str) -> str:
    """The same step dumped by msprobe's own ``PrecisionDebugger`` (statistics, mix), in a fresh process (its
    debugger is one per process); returns the rank folder holding its dump.json."""
    import glob
    import subprocess
    import sys

    subprocess.run([sys.executable, os.path.abspath(__file__), "--child-msprobe", size, str(tokens), dtype, folder],
                   check=True, capture_output=True)
    return os.path.dirname(sorted(glob.glob(os.path.join(folder, "**", "dump.json"), recursive=True))[0])


def _child_msprobe(size: str, tokens: str, dtype: str, folder: str) -> None:
    from msprobe.pytorch import PrecisionDebugger as MsprobeDebugger

    model = build(size)
    ids = torch.randint(0, model.config.vocab_size, (1, int(tokens)), generator=torch.Generator().manual_seed(12))
    m = model.to({"fp32": torch.float32, **DTYPES}[dtype])
    os.makedirs(folder, exist_ok=True)
    from _msprobe import statistics_config

    dbg = MsprobeDebugger(config_path=statistics_config(folder, os.path.join(folder, "dump")))
    torch.manual_seed(1234)
    dbg.start(m)
    m(input_ids=ids, labels=ids).loss.backward()
    dbg.stop()
    dbg.step()


def verdicts(bench, target, worst: int = 5):
    """``(report, errors, warnings, the worst nodes)`` of the target judged against the bench as ``msprobe-ci
    compare`` judges two statistics dumps without isolation records."""
    report, _, _ = judge(bench, target, JudgeSettings(isolate=False))
    errors = [n for n in report.nodes if n.status == "error"]
    warns = [n for n in report.nodes if n.status == "warning"]
    return report, errors, warns, report.worst(worst)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small")
    ap.add_argument("--tokens", default="512")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--faults", default="Functional.layer_norm:11,Torch.addmm:20,Functional.scaled_dot_product_attention:5,Torch.tanh:3,Tensor.__add__:30")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worst", type=int, default=5)
    ap.add_argument("--keep", default="")
    ap.add_argument("--msprobe", action="store_true",
                    help="benign pairs dumped by msprobe's own PrecisionDebugger instead (no faults: it injects none)")
    ap.add_argument("--child-msprobe", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_msprobe:
        torch.set_num_threads(args.threads)
        _child_msprobe(*args.child_msprobe)
        return
    torch.set_num_threads(args.threads)
    for size in args.sizes.split(","):
        model = build(size)
        for tokens in map(int, args.tokens.split(",")):
            ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(12))
            tmp = args.keep or tempfile.mkdtemp(prefix="driftcal-")
            t0 = time.perf_counter()
            if args.msprobe:
                bench = dump_msprobe(size, tokens, "fp32", os.path.join(tmp, "bench"))
            else:
                bench = dump(model, ids, torch.float32, os.path.join(tmp, "bench"))
            tb = time.perf_counter() - t0
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                t0 = time.perf_counter()
                target = dump_msprobe(size, tokens, dname, os.path.join(tmp, f"target-{dname}")) if args.msprobe \
                    else dump(model, ids, dtype, os.path.join(tmp, f"target-{dname}"))
                tt = time.perf_counter() - t0
                t0 = time.perf_counter()
                report, errors, warns, worst = verdicts(bench, target, args.worst)
                tj = time.perf_counter() - t0
                print(f"{size} {tokens} {dname}: benign {len(errors)} errors, {len(warns)} warnings of "
                      f"{len(report.nodes)} nodes; dump bench {tb:.0f} s target {tt:.0f} s, judge {tj:.0f} s",
                      flush=True)
                for n in worst:
                    print(f"    worst {n.status:7s} {n.value / n.budget if n.budget else float('inf'):6.2f}x "
                          f"{n.message[:230]}", flush=True)
                for spec in filter(None, [] if args.msprobe else args.faults.split(",")):
                    api, call = spec.split(":")
                    fault = Fault(api, int(call), "forward", "scale", 1.02)
                    folder = dump(model, ids, dtype, os.path.join(tmp, f"fault-{dname}-{api}{call}"), (fault,))
                    report, errors, warns, _ = verdicts(bench, folder)
                    want = f"{api}.{call}.forward"
                    first = report.first_divergence
                    name = first.name if first is not None else None
                    others = [n.name for n in errors if n.name != want and not n.name.startswith("Module.")]
                    print(f"    fault {want} x1.02: {'named' if name == want else 'MISSED'}; first {name}; "
                          f"{len(others)} other API errors {others[:4]}", flush=True)
                    if first is not None and name != want:
                        print(f"        {first.message[:230]}")
                    shutil.rmtree(os.path.dirname(os.path.dirname(folder)), ignore_errors=True)
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
