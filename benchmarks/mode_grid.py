"""Every mode through the grid ``gate_quality.py`` puts ``check`` through: benign runs must pass, faults must be
named exactly (with their step), nothing else blamed.

Modes (each on the dtype pairings asked: ``same`` fp32 against fp32, ``mixed`` bf16 against an fp32 bench, and
``amp-bf16``/``amp-fp16``, an AMP target (fp32 weights under torch.autocast; fp16 loops with a GradScaler)
against an fp32 bench):

* ``train-adamw``, ``train-sgd``: the loop gate of ``msprobe.check_training`` (3 steps, AdamW or SGD with
  momentum; ``run_training`` on both sides, every step judged as the fixture judges it); faults at step 1 or 2 in a
  forward API, a backward API and an optimizer API (``addcmul_``, ``lerp_``, ``addcdiv_``, ``mul_``, ``add_``).
* ``generate``: ``msprobe.check_generate`` (prefill + 3 teacher-forced decode steps); forward faults at decode
  steps 1 and 2.
* ``debugger``: ``msprobe_ci.PrecisionDebugger`` dumps (statistics, isolating while it captures, its default) of
  both sides, compared offline as ``msprobe-ci compare`` does; forward and backward faults.
* ``tensor``: tensor dumps made without isolation (``PrecisionDebugger(isolate=False, task="tensor")``, as msprobe
  makes them), compared offline: every dumped call replayed on its dumped inputs.
* ``statistics``: statistics dumps made without isolation, compared offline: the drift rule (said in its row).

Architectures: stock transformers configs none of the repo's tests or benchmarks use (OPT, BLOOM, Falcon,
StableLM), 2 layers, hidden 64, batch 2 x 12 tokens; seeds 7 and 8.

    python benchmarks/mode_grid.py [--modes train-adamw,train-sgd,generate,debugger,tensor,statistics]
                                   [--models opt,bloom,falcon,stablelm] [--seeds 2]
                                   [--dtypes same,mixed,amp-bf16,amp-fp16] [--verbose]

Prints one row per mode and dtype pairing: benign runs, false fails, faults, named exactly (node and step), other
API testcases failing besides the faulty one (enclosing modules aside).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
import warnings

import torch

from msprobe_ci.backends import Backend
from msprobe_ci.capture.inject import Fault
from msprobe_ci.check import SideRun, evaluate, run_decode, run_training
from msprobe_ci.compare.verdict import unit_roundoff
from msprobe_ci.config import DumpConfig
from msprobe_ci.isolate import Isolator
from msprobe_ci.judge import JudgeSettings

warnings.filterwarnings("ignore")
MODELS = ("opt", "bloom", "falcon", "stablelm")
MODES = ("train-adamw", "train-sgd", "generate", "debugger", "tensor", "statistics")
#: dtype pairing -> (bench dtype, target dtype, target autocast): ``amp-*`` is an AMP target (fp32 weights, its
#: forward and loss under torch.autocast; fp16 training with a GradScaler) against the fp32 bench
DTYPES = {"same": (torch.float32, torch.float32, None), "mixed": (torch.float32, torch.bfloat16, None),
          "amp-bf16": (torch.float32, None, "bf16"), "amp-fp16": (torch.float32, None, "fp16")}


def _computed_in(backend):
    """The dtype a side rounds in: its autocast dtype, else its own."""
    return backend.autocast if backend.autocast is not None else backend.dtype
OPTIMIZER_APIS = ("Tensor.addcmul_", "Tensor.lerp_", "Tensor.addcdiv_", "Tensor.mul_", "Tensor.add_")
FORWARD_APIS = ("Functional.linear", "Functional.softmax", "Functional.layer_norm", "Functional.gelu",
                "Functional.silu", "Tensor.__mul__", "Functional.scaled_dot_product_attention")


def build(kind: str, seed: int):
    """A stock transformers causal LM from a small config (no weights downloaded), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=128)
    if kind == "opt":
        cfg = transformers.OPTConfig(hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                                     max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, **common)
    elif kind == "bloom":
        cfg = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common)
    elif kind == "falcon":
        cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **common)
    elif kind == "stablelm":
        cfg = transformers.StableLmConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64,
                                          **common)
    else:
        raise SystemExit(f"unknown model {kind!r}; known: {', '.join(MODELS)}")
    cfg._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _ids(seed: int, n: int = 12, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _optimizer(mode: str):
    if mode == "train-adamw":
        return lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False)
    return lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=False)


def _errors(report) -> list[str]:
    return [n.name for n in report.nodes if n.status == "error" and not n.name.startswith("Module.")]


def _judge_steps(bench_folders, target_folders, tmp, bench, target, steps=None):
    """Every step judged as the loop fixtures judge it: sources compared with the bench at step 0 only."""
    cast_u = unit_roundoff(str(_computed_in(target)), str(bench.dtype))
    steps = steps if steps is not None else list(range(len(bench_folders)))
    settings = JudgeSettings(level="mix", cast_roundoff=cast_u)
    return [(steps[i], evaluate(b, SideRun(t), os.path.join(tmp, f"judge{steps[i]}"),
                                settings.for_step(steps[i])).report)
            for i, (b, t) in enumerate(zip(bench_folders, target_folders))]


#: --bench-kernel and --isolate-budget: the target's isolator (device kernel, every call isolated by default)
ISOLATION: dict = {"bench_kernel": "device", "budget": None}


def _isolator(backward: bool, seed: int) -> Isolator:
    from msprobe_ci.isolate.budget import IsolationBudget

    factor = ISOLATION["budget"]
    return Isolator(backward=backward, bench_kernel=ISOLATION["bench_kernel"],
                    budget=IsolationBudget(factor, f"mode_grid-{seed}") if factor else None)


def run_loop(mode, model, seed, bench, target, faults, tmp):
    """``[(step, report)]`` of one loop gate."""
    cfg = DumpConfig(task="statistics", level="mix")
    if mode.startswith("train"):
        g = torch.Generator().manual_seed(seed)
        batches = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(3, 128, (2, 12), generator=g)
                                                                   for _ in range(3))]
        runs = {}
        for side, backend in (("bench", bench), ("target", target)):
            runs[side] = run_training(model, batches, lambda out: out.loss, _optimizer(mode), backend,
                                      cfg.with_overrides(dump_path=os.path.join(tmp, side)),
                                      faults=faults if side == "target" else (),
                                      isolator=_isolator(True, seed) if side == "target" else None)
        return _judge_steps(runs["bench"].folders, runs["target"].folders, tmp, bench, target)
    prompt = _ids(seed, n=8, batch=1)
    b = run_decode(model, prompt, 3, bench, cfg.with_overrides(dump_path=os.path.join(tmp, "bench")))
    t = run_decode(model, prompt, 3, target, cfg.with_overrides(dump_path=os.path.join(tmp, "target")),
                   forced=b.picks, faults=faults, isolator=_isolator(False, seed))
    return _judge_steps(b.folders, t.folders, tmp, bench, target, b.steps)


def run_dumps(mode, model, seed, bench, target, faults, tmp):
    """``[(0, report)]`` of two PrecisionDebugger dumps compared offline."""
    from msprobe_ci import PrecisionDebugger

    ids = _ids(seed)
    folders = {}
    for side, backend in (("bench", bench), ("target", target)):
        m = backend.prepare_model(model)
        dbg = PrecisionDebugger(dump_path=os.path.join(tmp, side), level="mix",
                                task="tensor" if mode == "tensor" else "statistics", isolate=mode == "debugger",
                                inject=faults if side == "target" else None, bench_kernel=ISOLATION["bench_kernel"],
                                isolate_budget=ISOLATION["budget"] if mode == "debugger" else None,
                                rotation_seed=f"mode_grid-{seed}")
        torch.manual_seed(1234)
        dbg.start(m)
        with backend.autocast_context():
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        dbg.stop()
        folders[side] = os.path.join(tmp, side, "step0", "rank")
    cast_u = unit_roundoff(str(_computed_in(target)), str(bench.dtype))
    out = evaluate(folders["bench"], SideRun(folders["target"]), os.path.join(tmp, "judge"),
                   JudgeSettings(level="mix", cast_roundoff=cast_u))
    return [(0, out.report)]


def run_mode(mode, model, seed, bench, target, faults=()):
    tmp = tempfile.mkdtemp(prefix="modegrid-")
    try:
        runner = run_loop if mode.startswith("train") or mode == "generate" else run_dumps
        return runner(mode, model, seed, bench, target, tuple(faults), tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pick_faults(mode, reports, dtype) -> list[tuple[Fault, int, str]]:
    """``(fault, step, expected node)`` from a benign run's step reports: a forward API mid-model, a backward one,
    an optimizer API in training (at step 1 or 2), forward faults at decode steps 1 and 2 in generation."""
    scale = 1.01 if dtype == torch.float32 else 1.02
    by_step = dict(reports)
    out = []

    def first(step, pred, skip=0):
        names = [n.name for n in by_step[step].nodes if pred(n.name)]
        return names[min(skip, len(names) - 1)] if names else None

    def fault(node, step, direction):
        prefix, api, call = node.split(".")[:3]
        return Fault(f"{prefix}.{api}", int(call), direction, "scale", scale, step=step if step else None), step, node

    loop = mode.startswith("train") or mode == "generate"
    steps = [1, 2] if loop else [0]
    for i, step in enumerate(steps):
        if step not in by_step:
            continue
        fwd = first(step, lambda n: n.endswith(".forward") and n.rsplit(".", 2)[0] in FORWARD_APIS, skip=2 + 3 * i)
        if fwd:
            out.append(fault(fwd, step, "forward"))
        if mode != "generate":
            bwd = first(step, lambda n: n.endswith(".backward") and n.rsplit(".", 2)[0] in FORWARD_APIS, skip=i)
            if bwd:
                out.append(fault(bwd, step, "backward"))
        if mode.startswith("train"):
            opt = first(step, lambda n: n.endswith(".forward") and n.rsplit(".", 2)[0] in OPTIMIZER_APIS,
                        skip=3 + 5 * i)
            if opt:
                out.append(fault(opt, step, "forward"))
    return out


def grid(mode: str, dkey: str, models, seeds, verbose: bool = False) -> tuple[dict, list[str]]:
    """One row of the grid: ``({benign, false, faults, exact, other}, lines naming each miss)``."""
    bench_dtype, target_dtype, autocast = DTYPES[dkey]
    bench = Backend.from_options("cpu", bench_dtype)
    target = Backend.from_options("cpu", target_dtype, autocast=autocast)
    s = dict(benign=0, false=0, faults=0, exact=0, other=0)
    lines = []
    for kind in models:
        for seed in seeds:
            model = build(kind, seed)
            reports = run_mode(mode, model, seed, bench, target)
            s["benign"] += 1
            bad = [(st, e) for st, r in reports for e in _errors(r)]
            if bad:
                s["false"] += 1
                lines.append(f"  benign {mode} {dkey} {kind} seed {seed}: {bad[:4]}")
            for f, step, node in pick_faults(mode, reports, _computed_in(target)):
                got = run_mode(mode, model, seed, bench, target, [f])
                s["faults"] += 1
                errors = [(st, e) for st, r in got for e in _errors(r)]
                first = next(((st, r.first_divergence.name) for st, r in got if r.first_divergence is not None),
                             None)
                if first == (step, node):
                    s["exact"] += 1
                else:
                    lines.append(f"  fault {mode} {dkey} {kind} seed {seed} {f.api}.{f.call} {f.direction} "
                                 f"step {step}: first {first}")
                others = [(st, e) for st, e in errors if (st, e) != (step, node)]
                s["other"] += len(others)
                if others and verbose:
                    lines.append(f"    others for {mode} {dkey} {kind} seed {seed} {node} step {step}: {others[:4]}")
    return s, lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--dtypes", default="same,mixed")
    ap.add_argument("--bench-kernel", default="device", help="the isolation's same-dtype bench (msprobe_ci.kernels)")
    ap.add_argument("--isolate-budget", type=float, default=None,
                    help="budgeted isolation's factor (msprobe_ci.isolate.budget); default: every call isolated")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    ISOLATION.update(bench_kernel=args.bench_kernel, budget=args.isolate_budget)
    torch.set_num_threads(1)
    seeds = list(range(7, 7 + args.seeds))
    print(f"models {args.models}, seeds {seeds}, {args.bench_kernel} bench kernel"
          + (f", budgeted isolation {args.isolate_budget}" if args.isolate_budget else "")
          + ", forward+backward where the mode has one")
    print(f"{'mode':<12} {'target':<22} {'benign':>6} {'false fails':>11} {'faults':>6} {'exact':>7} "
          f"{'other API fails':>15} {'seconds':>8}")
    lines = []
    for mode in args.modes.split(","):
        for dkey in args.dtypes.split(","):
            t0 = time.perf_counter()
            s, more = grid(mode, dkey, args.models.split(","), seeds, args.verbose)
            lines += more
            bench_dtype, target_dtype, autocast = DTYPES[dkey]
            label = (f"{autocast} autocast" if autocast else str(target_dtype)[6:]) + f" vs {str(bench_dtype)[6:]} bench"
            exact = f"{100 * s['exact'] / s['faults']:.1f}%" if s["faults"] else "-"
            print(f"{mode:<12} {label:<22} {s['benign']:>6} {s['false']:>11} {s['faults']:>6} {exact:>7} "
                  f"{s['other']:>15} {time.perf_counter() - t0:>8.0f}", flush=True)
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
