"""Stock transformers decoders split by DTensor tensor parallelism (TP=2, 2 layers, from a config) against the
unsplit fp32 model on one rank, through the plugin (``msprobe.check_parallel``): clean bf16 and fp16 runs, and a 3%
scale fault on rank 0's first activation, which must be named with its rank.

    python benchmarks/tp_models.py [--models llama,qwen2,qwen3,mistral,gemma,olmo] [--dtypes bf16,fp16]

Prints one line per model and dtype: nodes compared and failing in the clean run, the worst merged drift (the
largest drift RelativeErr of any node; context, not a verdict), and the first divergence of the fault run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM", "silu"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "silu"),
          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "silu"), "mistral": ("MistralConfig", "MistralForCausalLM",
                                                                            "silu"),
          "gemma": ("GemmaConfig", "GemmaForCausalLM", "gelu"), "olmo": ("OlmoConfig", "OlmoForCausalLM", "silu")}

TEST = textwrap.dedent('''
    import os, sys
    import pytest
    import torch
    sys.path.insert(0, {examples!r})
    from test_parallel import _dtensor_tp, llama_loss

    def build(rank, world):
        return _dtensor_tp({config!r}, {model!r}, world)

    @pytest.mark.parametrize("dtype", {dtypes!r})
    @pytest.mark.parametrize("fault", [False, True])
    def test_tp(msprobe, dtype, fault):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        msprobe.check_parallel(build, ids, world_size=2, bench_world_size=1, loss_fn=llama_loss, target_dtype=dtype,
                               **({{"inject": {fault_file!r}}} if fault else {{}}))
''')


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="bf16,fp16")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    for name in args.models.split(","):
        config, model, act = MODELS[name]
        work = tempfile.mkdtemp(prefix=f"tp-{name}-")
        fault_file = os.path.join(work, "fault.yaml")
        with open(fault_file, "w") as fh:
            fh.write(f"faults:\n  - {{api: Functional.{act}, call: 0, perturb: scale, value: 1.03, rank: 0}}\n")
        with open(os.path.join(work, "test_tp.py"), "w") as fh:
            fh.write(TEST.format(examples=os.path.join(os.path.dirname(HERE), "examples"), config=config, model=model,
                                 dtypes=dtypes, fault_file=fault_file))
        out = os.path.join(work, "out")
        junit = os.path.join(work, "junit.xml")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--msprobe-no-graph",
                               f"--msprobe-out={out}", f"--junitxml={junit}", "test_tp.py"], cwd=work,
                              capture_output=True, text=True)
        failures = {}
        if os.path.exists(junit):
            for case in ET.parse(junit).getroot().iter("testcase"):
                f = case.find("failure")
                failures[case.get("name")] = None if f is None else f.get("message", "").split("\n")[0]
        for dtype in dtypes:
            rows = {}
            for fault in (False, True):
                folder = glob.glob(os.path.join(out, f"*test_tp*{fault}-{dtype}*", "check0"))
                results = [json.load(open(f)) for f in
                           glob.glob(os.path.join(folder[0], "**", "msprobe-result.json"), recursive=True)] \
                    if folder else []
                rows[fault] = results
            clean = rows[False]
            nodes = sum(r["nodes_compared"] for r in clean)
            failing = sum(r["counts"]["error"] for r in clean)
            drift = max((float(n["drift"]) for r in clean for n in r["nodes"]
                         if isinstance(n.get("drift"), (int, float)) and n["status"] != "unmatched"), default=0.0)
            named = failures.get(f"test_tp[True-{dtype}]") or ""
            named = named.split("first divergence: ", 1)[-1].split(":")[0] if "first divergence" in named else named
            print(f"{name:<8} {dtype}: clean {nodes} nodes, {failing} failing ({failures.get(f'test_tp[False-{dtype}]') or 'passed'}), "
                  f"worst merged drift {100 * drift:.2f}%; 3% fault on rank 0's first {act}: {named or 'not caught'}",
                  flush=True)
        if proc.returncode not in (0, 1):
            print(proc.stdout[-2000:], proc.stderr[-2000:])


if __name__ == "__main__":
    main()
