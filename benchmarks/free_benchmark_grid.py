"""The free benchmark (no bench device, no baseline) over stock GPT-2 and Llama configs in bf16, fp16 and fp32 and
several seeds: calls at risk in benign runs (goal: none), and whether a 2% scale fault on one call is the only call
named (goal: every run).

    python benchmarks/free_benchmark_grid.py                 # gpt2, llama x bf16, fp16, fp32 x seeds 0-3
    python benchmarks/free_benchmark_grid.py --seeds 0 1 --dtypes bf16

Each run: the model built from its config (2 layers, no weights downloaded) with ``torch.manual_seed(seed)``,
input ids drawn with the same seed, one forward under capture with the free benchmark (``improve_precision``);
then the same run with ``Fault(api, call, scale 1.02)`` injected on the model's one faulted call (GPT-2: its
fourth ``layer_norm``; Llama: its second ``silu``). Prints one row per run and a summary line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FAULTS = {"gpt2": ("Functional.layer_norm", 3), "llama": ("Functional.silu", 1)}


def build(name: str, dtype: torch.dtype, seed: int):
    import transformers

    torch.manual_seed(seed)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg)
    return model.eval().to(dtype)


def run(model, ids, faults=()):
    from msprobe_ci.free_benchmark import run_forward

    with tempfile.TemporaryDirectory() as out:
        return run_forward(model, {"input_ids": ids}, out, faults=faults)


def main(argv: list[str] | None = None) -> int:
    from msprobe_ci.capture.inject import Fault

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(FAULTS), default=sorted(FAULTS))
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = at_risk_runs = exact = 0
    print(f"{'model':6} {'dtype':5} {'seed':>4} {'judged':>6} {'at risk (benign)':>16}  fault named   seconds")
    for name in args.models:
        api, call = FAULTS[name]
        fault = Fault(api, call=call, perturb="scale", value=1.02)
        target = f"{api}.{call}.forward"
        for dt in args.dtypes:
            for seed in args.seeds:
                start = time.perf_counter()
                ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
                clean = run(build(name, DTYPES[dt], seed), ids)
                judged = sum(v["status"] != "skip" for v in clean.results.values())
                risky = [k for k, _ in clean.errors()]
                named = [k for k, _ in run(build(name, DTYPES[dt], seed), ids, (fault,)).errors()]
                runs += 1
                at_risk_runs += bool(risky)
                exact += named == [target]
                verdict = "exact" if named == [target] else f"MISSED/EXTRA {named[:3]}"
                print(f"{name:6} {dt:5} {seed:4d} {judged:6d} {len(risky):16d}  {verdict:12} "
                      f"{time.perf_counter() - start:7.1f}" + (f"  {risky[:2]}" if risky else ""))
    print(f"\n{runs} runs: {at_risk_runs} benign runs with a call at risk; the 2% fault named alone in {exact}/{runs}")
    return 0 if at_risk_runs == 0 and exact == runs else 1


if __name__ == "__main__":
    sys.exit(main())
