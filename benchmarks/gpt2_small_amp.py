"""The training gate at a realistic size, run as a user runs it: stock GPT-2 small (124M, from its config, no
weights), 1 x 1024 tokens per step, 2 steps of AdamW, the target under ``torch.autocast`` (bf16 by default) with
reentrant activation checkpointing, against the fp32 bench, through ``msprobe.check_training`` in a pytest file
that this script writes into a temporary folder and runs with the installed plugin.

    python benchmarks/gpt2_small_amp.py [--bench-kernel upcast] [--autocast bf16] [--tokens 1024]
                                        [--fault Functional.scaled_dot_product_attention:17:backward:1.01]

``--fault API:CALL:DIRECTION:SCALE`` injects one scale fault on the target at step 1 (a fault file, ``inject``).
With reentrant checkpointing a layer's backward runs on its recomputed forward: the attention calls whose backward
is judged are 12 to 23 (the last layer first). Prints the gate's summary lines per step (nodes, pass/error,
first divergence), the failure's first lines and pytest's exit status; a benign run must pass, a fault run must
name the faulty call first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import yaml

TEST = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build():
    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": True}})
    return model


def batches():
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, 50257, (1, {tokens}), generator=g) for _ in range(2)]
    return [{{"input_ids": i, "labels": i}} for i in ids]


def test_gpt2_small_amp(msprobe):
    msprobe.check_training(build(), batches(), lambda o: o.loss,
                           lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=False),
                           target_autocast={autocast!r}, bench_kernel={kernel!r}, inject={inject!r})
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-kernel", default="upcast")
    ap.add_argument("--autocast", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--fault", default=None, help="API:CALL:DIRECTION:SCALE, injected at step 1")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpt2_small_amp_") as tmp:
        inject = None
        if args.fault:
            api, call, direction, value = args.fault.split(":")
            inject = os.path.join(tmp, "faults.yaml")
            with open(inject, "w") as fh:
                yaml.safe_dump({"faults": [{"api": api, "call": int(call), "direction": direction,
                                            "perturb": "scale", "value": float(value), "step": 1}]}, fh)
        path = os.path.join(tmp, "test_gpt2_small_amp.py")
        with open(path, "w") as fh:
            fh.write(textwrap.dedent(TEST.format(tokens=args.tokens, autocast=args.autocast,
                                                 kernel=args.bench_kernel, inject=inject)))
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider",
                              f"--msprobe-out={os.path.join(tmp, 'out')}", "-W", "ignore"],
                             cwd=tmp, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    lines = run.stdout.splitlines()
    shown = [ln for ln in lines if "[check 0 step" in ln or ln.startswith("msprobe:") or ln.startswith("E   ")
             or "more node(s) fail" in ln or ln.lstrip().startswith(("failure:", "note:"))]
    print(f"GPT-2 small, 1 x {args.tokens} tokens, 2 steps, target autocast {args.autocast}, bench kernel "
          f"{args.bench_kernel}, fault {args.fault or 'none'}")
    print("\n".join(dict.fromkeys(shown)) or "\n".join(lines[-30:]))
    print(f"pytest exit status {run.returncode}, {wall:.0f} s")


if __name__ == "__main__":
    main()
