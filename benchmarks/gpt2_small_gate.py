"""The isolated gate at a realistic size: stock GPT-2 small (124M, from its config, no weights), 1 x 1024 tokens,
forward+backward, bf16 target against an fp32 bench on this CPU, statistics, mix; a benign run and a 2% forward
fault on ``Functional.layer_norm.11``.

    python benchmarks/gpt2_small_gate.py [--bench-kernel upcast] [--threads 2]

Prints the failing API testcases of the benign run (how many, the first five with their messages), the first
divergence of the fault run with the other API testcases failing there, and the target side's wall time with
isolation.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate_quality as gq  # noqa: E402

from msprobe_ci.capture.inject import Fault  # noqa: E402

warnings.filterwarnings("ignore")


def _api_errors(report) -> list:
    return [n for n in report.nodes if n.status == "error" and not n.name.startswith("Module.")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-kernel", default="upcast")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="both sides on this device (cuda: the oracle there, float64)")
    ap.add_argument("--no-reduced-precision-reduction", action="store_true",
                    help="cuBLAS bf16/fp16 GEMMs reduce split-K partials in fp32 "
                         "(torch.backends.cuda.matmul.allow_bf16/fp16_reduced_precision_reduction = False)")
    ap.add_argument("--benign-only", action="store_true", help="skip the fault run")
    ap.add_argument("--layers", type=int, default=12, help="transformer blocks (GPT-2 small: 12; the LM head, "
                    "768 x 50,257, is the same at any depth)")
    ap.add_argument("--fault", default="layer_norm", choices=("layer_norm", "lm_head"),
                    help="the fault run's fault: 2%% on the last LayerNorm's forward, or 1%% on the LM head's "
                         "backward (Functional.linear.0, its input gradient a GEMM over the 50,257 logits)")
    ap.add_argument("--no-split-bench", action="store_true",
                    help="the upcast/rounded bench without the split-K GEMMs of a reduced-precision reduction (as "
                         "before kernels.reduced_precision_reduction): the comparison run")
    args = ap.parse_args()
    if args.no_split_bench:
        import msprobe_ci.kernels as kernels

        kernels.reduced_precision_reduction = lambda device, dtype: False
    torch.set_num_threads(args.threads)
    gq.DEVICE = args.device
    if args.no_reduced_precision_reduction:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    gq.ISOLATOR.update(bench_kernel=args.bench_kernel)
    torch.manual_seed(11)
    cfg = transformers.GPT2Config(n_layer=args.layers)
    cfg._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(12))
    inputs = ({"input_ids": ids, "labels": ids},)

    def loss(out):
        return out.loss

    rep, cases, _, elapsed, _ = gq._one(model, inputs, loss, torch.float32, torch.bfloat16, ())
    bad = _api_errors(rep)
    where = args.device + (", reduced-precision reduction off" if args.no_reduced_precision_reduction else "") + \
        (", bench without split-K GEMMs" if args.no_split_bench else "") + f", {args.layers} layers"
    print(f"benign ({args.bench_kernel}, {where}): {len(bad)} API testcases failing, model cases failing "
          f"{[c['name'] for c in cases if c['status'] == 'error']}; target with isolation {elapsed:.0f} s")
    for n in bad[:5]:
        print("   ", n.message[:400])
    if args.benign_only:
        return
    fault = Fault("Functional.layer_norm", 2 * args.layers - 1, "forward", "scale", 1.02) \
        if args.fault == "layer_norm" else Fault("Functional.linear", 0, "backward", "scale", 1.01)
    rep, _, _, _, unapplied = gq._one(model, inputs, loss, torch.float32, torch.bfloat16, (fault,))
    first = rep.first_divergence  # a CompareResult is falsy: compare with None
    name = first.name if first is not None else None
    print(f"fault {fault.api}.{fault.call} {fault.direction} x{fault.value}{' (not applied)' if unapplied else ''}: first "
          f"divergence {name}; {len([n for n in _api_errors(rep) if n.name != name])} other API testcases failing")
    if first is not None:
        print("   ", first.message[:400])


if __name__ == "__main__":
    main()
