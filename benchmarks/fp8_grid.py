"""FP8 targets on stock decoders: benign runs must pass, 1% faults on FP8 GEMMs must be named exactly.

Each model (a stock transformers config, 2 layers, hidden 64, built from its config; no weights downloaded) runs as
a bf16 target whose ``nn.Linear`` layers compute through torchao's float8 training linears (``target_fp8``:
per-tensor dynamic scaling, e4m3 forward, e5m2 gradients) against an fp32 bench, isolated forward and backward
with the bench kernel asked, as ``msprobe.check(..., target_dtype="bf16", target_fp8=True)`` runs it. Faults: a
1% scale on an early, a middle and a late forward FP8 GEMM (``Torch.mm.N``, torchao's float8 mm by its own name)
and on one gradient GEMM (e5m2 gradients; torchao computes them inside its autograd function's backward, captured
as calls of the backward pass); each must be the first divergence, with no other API failing.

    python benchmarks/fp8_grid.py [--models llama,mistral,qwen2,opt,falcon,stablelm,gemma] [--seeds 7,8]
                                  [--kernels upcast,device]

Falcon's layers are ``FalconLinear`` (an ``nn.Linear`` subclass with its own forward), which the FP8 target leaves
in bf16 (``backends.to_float8`` swaps plain ``nn.Linear`` only): its FP8 GEMMs are the LM head's, too few to pick
forward faults from.

Prints one line per kernel, model and seed: the benign run's failing API testcases and model-level cases (none
expected), the FP8 GEMM calls judged, and the faults named exactly / applied (other APIs failing beside them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import warnings

import torch

warnings.filterwarnings("ignore")
MODELS = ("llama", "mistral", "qwen2", "opt", "falcon", "stablelm", "gemma")


def build(kind: str, seed: int):
    """``(model, inputs, loss_fn)`` of a stock config: 2 layers, hidden 64, every linear's features a multiple of
    16 (torchao's float8 linears need that)."""
    import transformers

    torch.manual_seed(seed)
    small = dict(vocab_size=256, max_position_embeddings=64)
    decoder = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    gqa = dict(intermediate_size=128, num_key_value_heads=2)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**decoder, **small, **gqa),
        "mistral": lambda: transformers.MistralConfig(**decoder, **small, **gqa),
        "qwen2": lambda: transformers.Qwen2Config(**decoder, **small, **gqa),
        "opt": lambda: transformers.OPTConfig(**decoder, **small, ffn_dim=128, word_embed_proj_dim=64),
        "falcon": lambda: transformers.FalconConfig(**decoder, vocab_size=256),
        "stablelm": lambda: transformers.StableLmConfig(**decoder, **small, **gqa),
        "gemma": lambda: transformers.GemmaConfig(**decoder, **small, **gqa, head_dim=16),
    }
    if kind not in configs:
        raise SystemExit(f"unknown model {kind!r}; known: {', '.join(configs)}")
    cfg = configs[kind]()
    cfg._attn_implementation = "eager"
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    return transformers.AutoModelForCausalLM.from_config(cfg).eval(), ({"input_ids": ids, "labels": ids},), \
        lambda o: o.loss


def check(root: str, case, kernel: str, faults=()):
    """One isolated check of ``case``: ``(report, model cases, target dump data)``."""
    from msprobe_ci.check import judge, model_cases, run_side
    from msprobe_ci.check.settings import CheckSettings
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.dump import load_dump

    model, inputs, loss_fn = case
    s = CheckSettings.resolve({"bench": "cpu", "target": "cpu", "bench_dtype": "fp32", "target_dtype": "bf16",
                               "target_fp8": True, "level": "mix", "task": "statistics", "bench_kernel": kernel,
                               "isolate": "on"})
    cfg = DumpConfig(task="statistics", level="mix")
    b = run_side(model, inputs, loss_fn, s.bench, cfg.with_overrides(dump_path=os.path.join(root, "bench")))
    t = run_side(model, inputs, loss_fn, s.target, cfg.with_overrides(dump_path=os.path.join(root, "target")),
                 faults=tuple(faults), isolator=s.isolator(backward=True))
    report, _, _ = judge(b.folder, t.folder, s.judge)
    cases = model_cases(b.outputs, t.outputs, s.output_rtol, s.cast_roundoff)
    return report, cases, load_dump(t.folder).data


def main() -> None:
    from msprobe_ci.capture.inject import Fault

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seeds", default="7,8")
    ap.add_argument("--kernels", default="upcast,device")
    args = ap.parse_args()
    torch.set_num_threads(1)
    totals = {"benign": 0, "false": 0, "faults": 0, "exact": 0, "other": 0}
    for kernel in args.kernels.split(","):
        for kind in args.models.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                root = tempfile.mkdtemp(prefix="fp8grid-")
                try:
                    report, cases, data = check(os.path.join(root, "benign"), build(kind, seed), kernel)
                    bad = [n.name for n in report.nodes if n.status == "error" and n.name.startswith(
                        ("Torch.", "Tensor.", "Functional.", "Aten."))]
                    bad_cases = [c["name"] for c in cases if c["status"] == "error"]
                    gemms = sorted({int(n.split(".")[2]) for n in data if n.startswith("Torch.mm.")})
                    judged = sum(1 for n in report.nodes if n.name.startswith("Torch.mm.") and
                                 "on its own inputs" in n.message)
                    totals["benign"] += 1
                    totals["false"] += bool(bad or bad_cases)
                    # a forward GEMM's operands are both e4m3; a gradient GEMM (torchao computes them inside its
                    # autograd function's backward; captured as calls of the backward pass) takes e5m2 gradients
                    def e5m2(call):
                        return any(isinstance(r, dict) and r.get("fp8_dtype") == "torch.float8_e5m2"
                                   for r in data[f"Torch.mm.{call}.forward"].get("input_args") or [])
                    fwd = [c for c in gemms if not e5m2(c)]
                    grad = [c for c in gemms if e5m2(c)]
                    picks = [("forward", fwd[1]), ("forward", fwd[len(fwd) // 2]), ("forward", fwd[-2])] \
                        if len(fwd) >= 3 else []
                    picks += [("forward", grad[len(grad) // 2])] if grad else []
                    exact, misses, other = 0, [], 0
                    for direction, call in picks:
                        node = f"Torch.mm.{call}.{direction}"
                        rep, _, _ = check(os.path.join(root, node), build(kind, seed), kernel,
                                             (Fault("Torch.mm", call, direction, "scale", 1.01),))
                        first = rep.first_divergence
                        others = [n.name for n in rep.nodes if n.status == "error" and n.name != node and
                                  not n.name.startswith("Module.")]
                        other += bool(others)
                        if others:
                            misses.append((node, "also failing: " + ", ".join(others[:2])))
                        if first is not None and first.name == node:
                            exact += 1
                        else:
                            misses.append((node, first.name if first is not None else None))
                    totals["faults"] += len(picks)
                    totals["exact"] += exact
                    totals["other"] += other
                    print(f"{kernel:<8} {kind:<9} seed {seed}: benign API errors {bad[:2]} model {bad_cases}; "
                          f"FP8 GEMM calls judged {judged}; faults exact {exact}/{len(picks)} {misses[:2]}; "
                          f"other APIs failing in {other}", flush=True)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
    print(f"total: {totals['benign']} benign runs, {totals['false']} false fails; {totals['faults']} faults, "
          f"{totals['exact']} named exactly, {totals['other']} with another API failing")


if __name__ == "__main__":
    main()
