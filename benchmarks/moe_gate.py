"""The isolated gate on MoE experts' grouped GEMMs: stock Mixtral and Qwen2-MoE configs (transformers'
default ``grouped_mm`` experts, which call ``torch._grouped_mm``), bf16 and fp16 targets against an fp32 bench,
per bench kernel: benign runs, and a 2% scale fault on each ``Torch._grouped_mm`` call, forward and backward,
each expected to be named exactly (the first divergence is that call, and no other API fails; the modules that
contain it, the experts and the MoE block, fail by their own isolated verdicts).

    python benchmarks/moe_gate.py [--models mixtral,qwen2_moe] [--kernels upcast,device] [--dtypes bf16,fp16]
                                  [--seeds 7,8]

Prints one line per kernel, model, dtype and seed: the grouped GEMM calls captured, the API and module testcases
failing in the benign run, and the faults named exactly with the misses.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate_quality as gq  # noqa: E402

from msprobe_ci.capture.inject import Fault  # noqa: E402

warnings.filterwarnings("ignore")
MODELS = ("mixtral", "qwen2_moe")


def build(kind: str, seed: int, n: int = 16):
    """``(model, inputs, loss_fn)`` of a stock MoE config, 2 layers, hidden 64, 4 experts, top-2."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=256, max_position_embeddings=64, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=4)
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                                          shared_expert_intermediate_size=64)
    else:
        raise SystemExit(f"unknown model {kind!r}; known: {', '.join(MODELS)}")
    cfg._attn_implementation = "eager"
    x = torch.randint(3, 256, (2, n), generator=torch.Generator().manual_seed(seed))
    return transformers.AutoModelForCausalLM.from_config(cfg).eval(), ({"input_ids": x, "labels": x},), \
        lambda o: o.loss


def run(kind: str, kernel: str, dname: str, seed: int, scale: float = 1.02) -> dict:
    """One benign run and one run per grouped GEMM fault; returns the figures."""
    gq.ISOLATOR.update(bench_kernel=kernel)
    bench_dtype, target_dtype, _ = gq.DTYPES[dname]
    model, inputs, loss_fn = build(kind, seed)
    report, cases, tdump, _, _ = gq._one(model, inputs, loss_fn, bench_dtype, target_dtype, ())
    benign = [n.name for n in report.nodes if n.status == "error"] + \
        [c["name"] for c in cases if c["status"] == "error"]
    gemms = sorted(n for n in tdump.data if n.startswith("Torch._grouped_mm."))
    exact, misses = 0, []
    for node in gemms:
        _, api, call, direction = node.split(".")
        fault = Fault(f"Torch.{api}", int(call), direction, "scale", scale)
        rep, _, _, _, unapplied = gq._one(model, inputs, loss_fn, bench_dtype, target_dtype, (fault,))
        # the enclosing modules (experts, MoE block) contain the fault: their own isolated verdicts fail too
        failing = [n.name for n in rep.nodes if n.status == "error" and not n.name.startswith("Module.")]
        first = rep.first_divergence
        if not unapplied and first is not None and first.name == node and failing == [node]:
            exact += 1
        else:
            misses.append((node, None if first is None else first.name, failing[:3], bool(unapplied)))
    return {"gemms": gemms, "benign": benign, "exact": exact, "misses": misses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--kernels", default="upcast,device")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--seeds", default="7,8")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for kernel in args.kernels.split(","):
        for kind in args.models.split(","):
            for dname in args.dtypes.split(","):
                for seed in map(int, args.seeds.split(",")):
                    r = run(kind, kernel, dname, seed)
                    print(f"{kernel:<8} {kind:<10} {dname} seed {seed}: {len(r['gemms'])} grouped GEMM calls, "
                          f"benign failing {r['benign'][:3]}  faults exact {r['exact']}/{len(r['gemms'])} "
                          f"{r['misses'][:2]}", flush=True)


if __name__ == "__main__":
    main()
