"""Gate quality: false fails, detection and exact localization of injected faults, on stock model configs.

Runs the same pipeline as ``msprobe.check`` (:mod:`msprobe_ci.check`: bench and target under capture, target
isolated, compare, isolated verdicts, model-level outputs) on models built from stock ``transformers`` configs
(random weights, no downloads) and a small CNN with BatchNorm (training mode) and max-pool, forward+backward,
several seeds, targets bf16 / fp16 against an fp32 bench and fp32 against an fp64 bench, and AMP targets (``amp-bf16``,
``amp-fp16``: fp32 weights, the forward under ``torch.autocast``) against the fp32 bench.

Faults: for each run, forward and backward APIs picked early, mid and late in the target's own dump, scaled by
1.02/1.05 (bf16, fp16) or 1.01/1.02 (fp32), plus a 2% noise fault. The bench kernel (``--bench-kernel``,
:mod:`msprobe_ci.kernels`) is the same-dtype bench isolation compares with; ``all`` runs each in turn. Printed per
bench kernel and target dtype:

* benign runs that fail (goal 0);
* faults detected (any error) and localized exactly (the first divergence is the injected node);
* API testcases failing besides the injected one (goal 0; enclosing modules roll up and are not counted);
* isolation overhead (target side with vs without isolation, same run).

With ``--no-isolation`` the target is judged by the drift rule alone (``msprobe-ci compare`` on two plain dumps);
models ``neox,phi3,qwen2,mistral,gemma`` are stock decoder configs; ``bert-sdpa`` is the padded BERT through SDPA
(its padding a boolean mask there).

    python benchmarks/gate_quality.py [--seeds 2] [--models llama,bert,gpt2,t5,cnn] [--bench-kernel all]
                                      [--no-isolation] [--anchor]

``--anchor``: faults at the anchor's level (scale 1.01 and 1% noise at bf16/fp16, 1.001 and 0.1% at fp32).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import defaultdict

import torch

from msprobe_ci.backends import Backend, compile_regions
from msprobe_ci.capture.inject import Fault
from msprobe_ci.check import departure, judge, model_cases, run_side
from msprobe_ci.compare.verdict import unit_roundoff
from msprobe_ci.config import DumpConfig
from msprobe_ci.isolate import Isolator
from msprobe_ci.judge import JudgeSettings
from msprobe_ci.kernels import BENCH_KERNELS
from msprobe_ci.kernels.perturb import FLUSH

warnings.filterwarnings("ignore")


def _llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).eval()


def _gpt2(seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg).eval()


def _bert(seed, attention="eager"):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = attention
    return BertForMaskedLM(cfg).eval()


def _t5(seed):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg).eval()


def _decoder(kind, seed):
    """GPT-NeoX, Phi-3, Qwen2, Mistral, Gemma from their stock configs (2 layers, hidden 64, eager attention)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                  vocab_size=256, max_position_embeddings=64)
    if kind == "neox":
        cfg = transformers.GPTNeoXConfig(**common)
        cls = transformers.GPTNeoXForCausalLM
    elif kind == "phi3":
        cfg = transformers.Phi3Config(num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1, **common)
        cls = transformers.Phi3ForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(num_key_value_heads=2, **common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(num_key_value_heads=2, **common)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.GemmaConfig(num_key_value_heads=2, head_dim=16, **common)
        cls = transformers.GemmaForCausalLM
    cfg._attn_implementation = "eager"
    return cls(cfg).eval()


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.conv2, self.bn2 = torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def _cnn(seed):
    torch.manual_seed(seed)
    return CNN().train()


def _tokens(seed, n=16):
    return torch.randint(3, 256, (2, n), generator=torch.Generator().manual_seed(seed))


def case(name, seed):
    """(model, inputs, loss_fn) for a model name and seed."""
    ids = _tokens(seed)
    if name == "llama":
        return _llama(seed), ({"input_ids": ids, "labels": ids},), lambda o: o.loss
    if name == "gpt2":
        return _gpt2(seed), ({"input_ids": ids, "labels": ids},), lambda o: o.loss
    if name in ("bert", "bert-sdpa"):
        # bert-sdpa: the padding reaches F.scaled_dot_product_attention as the boolean mask transformers makes of it
        mask = torch.ones_like(ids)
        mask[1, 11:] = 0
        return _bert(seed, "sdpa" if name == "bert-sdpa" else "eager"), \
            ({"input_ids": ids, "attention_mask": mask, "labels": ids},), lambda o: o.loss
    if name == "t5":
        return _t5(seed), ({"input_ids": ids, "labels": _tokens(seed + 1, 8)},), lambda o: o.loss
    if name in ("neox", "phi3", "qwen2", "mistral", "gemma"):
        return _decoder(name, seed), ({"input_ids": ids, "labels": ids},), lambda o: o.loss
    if name == "cnn":
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
        return _cnn(seed), (x,), lambda o: o.float().pow(2).mean()
    raise ValueError(name)


DTYPES = {"bf16": ("fp32", "bf16", (1.02, 1.05)), "fp16": ("fp32", "fp16", (1.02, 1.05)),
          "fp32": ("fp64", "fp32", (1.01, 1.02)),
          # an AMP target: fp32 weights, its forward under torch.autocast in bf16/fp16, against the fp32 bench
          "amp-bf16": ("fp32", "amp-bf16", (1.02, 1.05)), "amp-fp16": ("fp32", "amp-fp16", (1.02, 1.05))}
NOISE = {"bf16": 0.02, "fp16": 0.02, "fp32": 0.02, "amp-bf16": 0.02, "amp-fp16": 0.02}  # the noise fault's size
_JUDGED = ("linear", "layer_norm", "softmax", "gelu", "silu", "matmul", "__mul__", "__add__", "conv2d",
           "batch_norm", "scaled_dot_product_attention", "embedding", "mean", "rsqrt", "tanh", "relu", "__matmul__",
           "cross_entropy", "pow", "sum", "bmm", "max_pool2d", "dropout")


LEVEL = "mix"
TASK = "statistics"
COMPILE = False
FORWARD_ONLY = False
ISOLATE = True
ISOLATOR: dict = {}
DEVICE = "cpu"  # --device: both sides and the isolation there (cuda: the oracle in float64 there, as msprobe.check)


def _one(model, inputs, loss_fn, bench_dtype, target_dtype, faults, isolate=None, bench_folder=None, level=None,
         inspect=None):
    isolate = ISOLATE if isolate is None else isolate
    tmp = tempfile.mkdtemp(prefix="gateq-")
    if FORWARD_ONLY:
        loss_fn = None
    compiled = COMPILE and level is None
    try:
        bench = Backend.from_options(DEVICE, bench_dtype)
        amp = target_dtype[4:] if isinstance(target_dtype, str) and target_dtype.startswith("amp-") else None
        target = Backend.from_options(DEVICE, "fp32" if amp else target_dtype, compiled, autocast=amp)
        regions = compile_regions(model) if compiled else []
        cfg = DumpConfig(task=TASK, level=level or LEVEL)
        if bench_folder is None:
            b = run_side(model, inputs, loss_fn, bench, cfg.with_overrides(dump_path=os.path.join(tmp, "bench")),
                         regions=regions)
        else:
            b = bench_folder
        where = {} if DEVICE == "cpu" else dict(target_device=target.torch_device, bench_device=bench.torch_device,
                                                **target.oracle_options("target"))
        iso = Isolator(backward=loss_fn is not None, **where, **ISOLATOR) if isolate else None
        t0 = time.perf_counter()
        t = run_side(model, inputs, loss_fn, target, cfg.with_overrides(dump_path=os.path.join(tmp, "target")),
                     faults=faults, isolator=iso, regions=regions)
        elapsed = time.perf_counter() - t0
        cast_u = unit_roundoff(str(target.autocast if amp else target.dtype), str(bench.dtype))
        report, tdump, _ = judge(b.folder, t.folder, JudgeSettings(isolate=isolate, cast_roundoff=cast_u))
        cases = model_cases(b.outputs, t.outputs, None, cast_u, departure(report))
        if inspect is not None:  # before the folders go
            inspect(report, t.folder)
        return report, cases, tdump, elapsed, t.unapplied
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _floating(entry):
    recs = [r for r in (entry or {}).get("output") or [] if isinstance(r, dict) and "dtype" in r]
    return bool(recs) and any(t in str(recs[0]["dtype"]) for t in ("float", "bfloat"))


def under_floor(entry, fault) -> bool:
    """The fault moves no element of its API's first output by more than the absolute error a correct kernel of
    that dtype may make there (``kernels.jitter``'s floor): bf16, fp32's smallest normal number, which x86's bf16
    instructions flush (a bf16 ``conv2d`` whose outputs are 3.5e-37 is off by 1.6 of it, 5% of its largest
    elements); fp16, half its subnormal step (2^-25). Such a fault is a kernel's own error: a miss of it is no gap
    in the gate, and the grids print it as such."""
    recs = [r for r in (entry or {}).get("output") or [] if isinstance(r, dict) and "dtype" in r]
    if not recs or recs[0].get("Max") is None:
        return False
    dtype = str(recs[0]["dtype"])
    floor = FLUSH if "bfloat16" in dtype else 2.0 ** -25 if "float16" in dtype else 0.0
    if fault.perturb == "offset":
        return abs(fault.value) < floor
    size = abs(fault.value - 1.0) if fault.perturb == "scale" else 3.0 * fault.value  # noise: 3 sigma
    largest = max(abs(float(recs[0]["Max"])), abs(float(recs[0]["Min"])))
    return largest * size < floor


def anchor_faults() -> None:
    """Faults at the anchor's level from here on (issue 53; what msprobe's benchmark standard flags): scale 1.01
    and 1% noise at bf16/fp16, scale 1.001 and 0.1% noise at fp32."""
    for name, size in (("bf16", 0.01), ("fp16", 0.01), ("fp32", 0.001), ("amp-bf16", 0.01), ("amp-fp16", 0.01)):
        DTYPES[name] = (*DTYPES[name][:2], (1 + size,))
        NOISE[name] = size


def _pick_faults(data, scales, seed, noise=0.02):
    """Faults on APIs whose first output is floating (a scale fault cannot change an integer output)."""
    names = [n for n in data if not n.startswith("Module.") and _floating(data[n])]
    fwd = [n for n in names if n.endswith(".forward") and n.split(".")[1] in _JUDGED and "dropout" not in n]
    bwd = [n for n in names if n.endswith(".backward") and n.split(".")[1] in _JUDGED]
    picks = []
    for lst, d in ((fwd, "forward"), (bwd, "backward")):
        if not lst:
            continue
        for pos in (0.15, 0.5, 0.85):
            picks.append((lst[min(int(pos * len(lst)), len(lst) - 1)], d))
    out = []
    for i, (node, d) in enumerate(picks):
        prefix, api, call = node.split(".")[:3]
        scale = scales[(i + seed) % len(scales)]
        out.append((node, Fault(f"{prefix}.{api}", int(call), d, "scale", scale)))
    node, d = picks[len(picks) // 3]
    prefix, api, call = node.split(".")[:3]
    out.append((node, Fault(f"{prefix}.{api}", int(call), d, "noise", noise)))
    return out


def check_repro(report, folder: str, s: dict, failures: list, label: str) -> None:
    """``--repro``: the first divergence's reproduction (``repro/<node>.py``, msprobe_ci.repro), run alone in a fresh
    process, must fail with the gate's message and every metric to the printed digits, and pass with the fault
    left out (``--no-fault``)."""
    import json
    import subprocess

    from msprobe_ci.repro import _fmt

    first = report.first_divergence
    if first is None:
        return
    script = os.path.join(folder, "repro", f"{first.name}.py")
    with open(os.path.join(folder, "isolation.json"), encoding="utf-8") as fh:
        record = json.load(fh)["nodes"].get(first.name, {})
    s["repro_tried"] += 1
    if not os.path.isfile(script):
        failures.append(f"{label}: no reproduction for {first.name}: {record.get('repro')}")
        return

    def run(*flags):
        proc = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, timeout=600)
        fields = {}
        for line in proc.stdout.splitlines():
            k, _, v = line.strip().partition(": ")
            fields.setdefault(k, v)
        return proc.returncode, fields
    rc, out = run()
    same = rc == 1 and out.get("message") == record.get("message") and \
        all(out.get(k) == _fmt(v) for k, v in (record.get("metrics") or {}).items())
    s["repro_same"] += same
    if not same:
        failures.append(f"{label}: reproduction of {first.name} differs: rc {rc}, {out.get('message')!r} vs "
                        f"{record.get('message')!r}")
    rc, out = run("--no-fault")
    s["repro_clean_pass"] += rc == 0
    if rc != 0:
        failures.append(f"{label}: reproduction of {first.name} without the fault: rc {rc}, {out.get('message')!r}")


def rep_construct(report, name, ref_dump):
    """The parent of a module node in the reference dump's construct.json."""
    return ref_dump.construct.get(name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--models", default="llama,bert,gpt2,t5,cnn")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--level", default="mix", choices=("mix", "L1", "L0"),
                    help="capture level (L0: modules isolated whole; faults still perturb APIs)")
    ap.add_argument("--task", default="statistics", choices=("statistics", "tensor"))
    ap.add_argument("--forward-only", action="store_true", help="no loss, no backward")
    ap.add_argument("--compile", action="store_true",
                    help="target through torch.compile per block (captured at L0 on both sides, as msprobe.check); "
                         "benign runs only")
    ap.add_argument("--bench-kernel", default="device", choices=BENCH_KERNELS + ("all",),
                    help="same-dtype bench of the standards (msprobe_ci.kernels): the bench device's kernel (here "
                         "the target's own, recomputed), the API one precision up rounded once, the fp64 result "
                         "correctly rounded, or the API through PyTorch's decompositions with oneDNN off; 'all': "
                         "each in turn, a row per kernel")
    ap.add_argument("--budget-draws", type=int, default=None,
                    help="perturbed runs per benchmark-standard call that size its error budget (default: the "
                         "Isolator's)")
    ap.add_argument("--no-isolation", action="store_true",
                    help="judge two plain dumps (the drift rule of `msprobe-ci compare`), no isolation records")
    ap.add_argument("--anchor", action="store_true",
                    help="faults at the anchor's level (issue 53): scale 1.01 and 1%% noise at bf16/fp16, scale "
                         "1.001 and 0.1%% noise at fp32")
    ap.add_argument("--repro", action="store_true",
                    help="run each fault's first-divergence reproduction (repro/<node>.py) alone: it must fail with "
                         "the gate's values and pass with --no-fault")
    ap.add_argument("--device", default="cpu",
                    help="both sides on this device (cuda: the oracle there in float64, as msprobe.check builds it)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.anchor:
        anchor_faults()
    global LEVEL, TASK, COMPILE, FORWARD_ONLY, ISOLATE, DEVICE
    DEVICE = args.device
    if args.budget_draws is not None:
        ISOLATOR.update(budget_draws=args.budget_draws)
    LEVEL = "L0" if args.compile else args.level
    TASK, COMPILE, FORWARD_ONLY = args.task, args.compile, args.forward_only
    ISOLATE = not args.no_isolation
    torch.set_num_threads(1)
    kernels = BENCH_KERNELS if args.bench_kernel == "all" else (args.bench_kernel,)
    rows, failures = [], []
    for kernel in kernels:
        ISOLATOR.update(bench_kernel=kernel)
        stats = _measure(args, failures, kernel)
        rows += [(kernel, dname, s) for dname, s in stats.items()]
    print(f"level {LEVEL}, task {TASK}" + (", compiled target" if COMPILE else "")
          + (", forward only" if FORWARD_ONLY else ", forward+backward") + f", models {args.models}, "
          f"{args.seeds} seed(s)")
    print(f"{'bench kernel':<13} {'target':<22} {'benign':>6} {'false fails':>11} {'faults':>6} {'detected':>9} "
          f"{'exact':>9} {'other API fails':>15} {'isolation overhead':>18}")
    for kernel, dname, s in rows:
        bench_dtype, target_dtype, _ = DTYPES[dname]
        f = max(s["faults"], 1)
        print(f"{kernel:<13} {target_dtype + ' vs ' + bench_dtype + ' bench':<22} {int(s['benign']):>6} "
              f"{int(s['false_fail']):>11} {int(s['faults']):>6} {s['detected'] / f:>8.1%} {s['exact'] / f:>8.1%} "
              f"{int(s['other_api_fails']):>15} {s['overhead_sum'] / max(s['benign'], 1):>17.2f}x")
    if args.repro:
        print(f"{'bench kernel':<13} {'target':<22} {'reproductions':>13} {'same values':>11} {'pass w/o fault':>14}")
        for kernel, dname, s in rows:
            bench_dtype, target_dtype, _ = DTYPES[dname]
            print(f"{kernel:<13} {target_dtype + ' vs ' + bench_dtype + ' bench':<22} {int(s['repro_tried']):>13} "
                  f"{int(s['repro_same']):>11} {int(s['repro_clean_pass']):>14}")
    for line in failures:
        print("  " + line)


def _measure(args, failures: list, kernel: str) -> dict:
    """One bench kernel over every dtype, model and seed: ``{dtype: counts}``; failures appended as lines."""
    stats = defaultdict(lambda: defaultdict(float))
    for dname in args.dtypes.split(","):
        bench_dtype, target_dtype, scales = DTYPES[dname]
        for mname in args.models.split(","):
            for seed in range(args.seeds):
                model, inputs, loss_fn = case(mname, 100 + seed)
                s = stats[dname]
                report, cases, tdump, t_iso, _ = _one(model, inputs, loss_fn, bench_dtype, target_dtype, ())
                if ISOLATE:
                    _, _, _, t_plain, _ = _one(model, inputs, loss_fn, bench_dtype, target_dtype, (), isolate=False)
                    s["overhead_sum"] += t_iso / t_plain
                s["benign"] += 1
                errors = [n.name for n in report.nodes if n.status == "error"]
                bad_model = [c["name"] for c in cases if c["status"] == "error"]
                if errors or bad_model:
                    s["false_fail"] += 1
                    failures.append(f"{kernel}: benign {dname} {mname} seed {seed}: {errors[:3]} {bad_model}")
                # faults are picked from an API-level dump; at L0 the expected node is the innermost module
                # around the faulty call (forward or backward), its enclosing modules may fail too
                ref = tdump if LEVEL != "L0" else _one(model, inputs, loss_fn, bench_dtype, target_dtype, (),
                                                       level="mix")[2]
                if COMPILE:
                    # APIs inside compiled regions neither fire faults nor count calls, so a fault picked from an
                    # eager dump lands elsewhere: compiled runs measure false fails only
                    continue
                for node, fault in _pick_faults(ref.data, scales, seed, NOISE[dname]):
                    expected = node if LEVEL != "L0" else ref.construct.get(node)
                    if expected is None:
                        continue
                    label = (f"{kernel}: fault {dname} {mname} seed {seed} {fault.api}.{fault.call} {fault.direction} "
                             f"{fault.perturb} {fault.value}")
                    inspect = (lambda r, folder: check_repro(r, folder, s, failures, label)) \
                        if args.repro and ISOLATE else None
                    rep, _, _, _, unapplied = _one(model, inputs, loss_fn, bench_dtype, target_dtype, (fault,),
                                                   inspect=inspect)
                    if unapplied:
                        continue
                    s["faults"] += 1
                    first = rep.first_divergence
                    own = [n.name for n in rep.nodes if n.status == "error" and "rollup" not in n.metrics]
                    if own:
                        s["detected"] += 1
                    if first is not None and first.name == expected:
                        s["exact"] += 1
                    else:
                        floor = " (under the dtype's floor)" if under_floor(ref.data.get(node), fault) else ""
                        failures.append(f"{kernel}: fault {dname} {mname} seed {seed} {fault.api}.{fault.call} "
                                        f"{fault.direction} {fault.perturb} {fault.value}: first "
                                        f"{first.name if first is not None else None}{floor}")
                    # modules enclosing the faulty node (forward and backward) may fail: by roll-up with isolation,
                    # on their own output's drift without it
                    chain, parent = set(), expected
                    while parent:
                        chain.update({parent, parent.replace(".forward.", ".backward."),
                                      parent.replace(".backward.", ".forward.")})
                        parent = rep_construct(rep, parent, ref)
                    others = [n for n in own if n not in chain and n != node]
                    s["other_api_fails"] += len(others)
                    if others and args.verbose:
                        failures.append(f"  others for {kernel} {dname} {mname} seed {seed} {fault.api}.{fault.call} "
                                        f"{fault.direction} {fault.perturb} {fault.value}: {others[:4]}")
    return stats


if __name__ == "__main__":
    sys.exit(main())
