"""The gate on sharded training as people run it: stock transformers decoders wrapped with FSDP2 (``fully_shard`` on
every decoder layer and the root) on 2 CPU ranks (gloo), a ``MixedPrecisionPolicy`` target (param_dtype bf16 or
fp16, reduce_dtype fp32) against an fp32 bench, trained with AdamW for 2 steps through ``check_parallel``
(isolation on, each bench kernel asked for):

* a benign run (expected: passes, no failing node on any step or rank);
* faults at step 1 on rank 1, each expected to be named exactly (the check's first divergence is that node, at
  step 1 on rank 1): a 2% scale on a mid ``Functional.linear`` forward, on one's backward, and on one
  ``Distributed.reduce_scatter_single`` (FSDP's gradient reduce-scatter: a wrong scale of rank 1's gradient
  shard).

    python benchmarks/fsdp_gate.py [--models llama,qwen2,mistral,gemma,neox] [--kernels device,upcast]
                                   [--dtypes bf16,fp16] [--seeds 1]

Prints one line per model, kernel, dtype and seed.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate_quality as gq  # noqa: E402

from msprobe_ci.capture.inject import Fault  # noqa: E402
from msprobe_ci.check import CheckContext, CheckSettings, check_parallel  # noqa: E402

warnings.filterwarnings("ignore")
MODELS = ("llama", "qwen2", "mistral", "gemma", "neox")


def build(kind: str, seed: int, rank: int, world: int, dtype):
    """A stock decoder (2 layers, hidden 64), every decoder layer and the root sharded with FSDP2 under a
    mixed-precision policy computing in ``dtype`` (``None``: the model's fp32) and reducing in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = gq._llama(seed) if kind == "llama" else gq._decoder(kind, seed)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = model.gpt_neox.layers if kind == "neox" else model.model.layers
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def loss(out):
    return out.loss


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def run(kind: str, kernel: str, dname: str, seed: int, faults: tuple = ()):
    """One check_parallel: ``(failure message or None, seconds)``."""
    ids = gq._tokens(seed)
    tmp = tempfile.mkdtemp(prefix="fsdpq-")
    ctx = CheckContext(nodeid=f"fsdp_gate::{kind}", test_dir=lambda: tmp)
    s = CheckSettings.resolve({"bench": "cpu", "target": "cpu", "bench_dtype": None, "target_dtype": dname,
                               "level": "mix", "task": "statistics", "isolate": "on", "bench_kernel": kernel},
                              run_faults=tuple(faults))
    t0 = time.perf_counter()
    c = check_parallel(ctx, s, functools.partial(build, kind, seed), ({"input_ids": ids, "labels": ids},),
                       world_size=2, loss_fn=loss, optimizer=adamw, steps=2, timeout=900)
    return c.failure, time.perf_counter() - t0


def _first(failure: str | None) -> str | None:
    if not failure or "first divergence: " not in failure:
        return None
    return failure.split("first divergence: ", 1)[1].split(":", 1)[0].strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--kernels", default="device,upcast")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--seeds", default="1")
    a = ap.parse_args()
    # rank 1, step 1: a mid linear forward and backward, a mid gradient reduce-scatter (a decoder of 2 layers
    # issues 3 reduce-scatters per step: layer 1, layer 0, the root)
    faults = {"linear forward": (Fault("Functional.linear", 5, "forward", "scale", 1.02, step=1, rank=1),
                                 "step1 rank1 Functional.linear.5.forward"),
              "linear backward": (Fault("Functional.linear", 5, "backward", "scale", 1.02, step=1, rank=1),
                                  "step1 rank1 Functional.linear.5.backward"),
              "reduce-scatter": (Fault("Distributed.reduce_scatter_single", 1, "forward", "scale", 1.02, step=1,
                                       rank=1), "step1 rank1 Distributed.reduce_scatter_single.1.forward")}
    for kernel in a.kernels.split(","):
        for kind in a.models.split(","):
            for dname in a.dtypes.split(","):
                for seed in (int(x) for x in a.seeds.split(",")):
                    failure, secs = run(kind, kernel, dname, seed)
                    benign = "pass" if failure is None else f"FAIL {failure.splitlines()[0][:160]}"
                    named, misses = 0, []
                    for label, (fault, expect) in faults.items():
                        got, _ = run(kind, kernel, dname, seed, (fault,))
                        if _first(got) == expect:
                            named += 1
                        else:
                            misses.append((label, (got or "passed").splitlines()[0][:160]))
                    print(f"{kernel:8} {kind:8} {dname} seed {seed}: benign {benign} ({secs:.0f} s); faults named "
                          f"{named}/{len(faults)} {misses}", flush=True)


if __name__ == "__main__":
    main()
