"""The gate at a realistic size against the plain steps it gates, side by side in one run, and where its memory goes.

Stock GPT-2 small (124M; ``--config gpt2-medium``: 350M), built from its config (no weights), 1 x ``--tokens``
tokens, forward+backward (the LM loss), statistics, mix level. Each way runs as a fresh process under
/usr/bin/time (wall seconds, peak resident memory):

* ``plain fp32`` / ``plain bf16``: one step of the model in that dtype, no capture;
* ``check``: what ``msprobe.check`` runs: the fp32 bench side captured, the bf16 target side captured with
  isolation (the CPU oracle, bench kernel ``device``), then the judgement (compare, isolated verdicts, CSV, graph,
  model-level cases); ``check, isolation off``: the same with the drift rule; ``check-budget``: budgeted
  isolation (``--isolate-budget``, :mod:`msprobe_ci.isolate.budget`), its judged share and measured factor printed.

For the check runs a sampler thread reads the process's resident memory every 20 ms and the run marks its
phases, so the table says which phase set the peak and how long each phase took. Both sides spill their final
outputs to the dump folder until the judgement, as ``msprobe.check`` does. Issue 31's goals: check time <= 2x
(plain fp32 + plain bf16), peak memory <= 1.5x plain fp32.

    python benchmarks/realistic_size.py [--tokens 1024] [--config gpt2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


class Sampler(threading.Thread):
    """Resident memory every 20 ms; ``mark(phase)`` starts a phase; ``peaks()`` is the peak per phase."""

    def __init__(self):
        super().__init__(daemon=True)
        self.phase, self.peak, self.at, self.stop = "start", {}, {}, False
        self.seconds, self._t = {}, time.perf_counter()

    def run(self):
        while not self.stop:
            phase = self.phase  # read once: a phase marked between two reads must not inherit the last one's peak
            self.peak[phase] = max(self.peak.get(phase, 0.0), _rss_mb())
            time.sleep(0.02)

    def mark(self, phase: str) -> None:
        now = _rss_mb()
        self.peak[self.phase] = max(self.peak.get(self.phase, 0.0), now)
        t = time.perf_counter()
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + t - self._t
        self._t = t
        self.phase = phase
        self.at[phase] = now  # what is still resident when the phase starts


def _model(config: str, tokens: int):
    import torch
    import transformers

    torch.manual_seed(11)
    cfg = transformers.GPT2Config.from_dict(transformers.GPT2Config().to_dict()) if config == "gpt2" else \
        transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16)  # gpt2-medium's shape, 350M
    cfg.n_positions = max(cfg.n_positions, tokens)
    cfg._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(12))
    return model, {"input_ids": ids, "labels": ids}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


BUDGET = 1.5  # --isolate-budget


def child(mode: str, config: str, tokens: int, threads: int, device: str = "cpu", kernel: str = "") -> None:
    """One way, in this process; prints a JSON line of its phases' peak memory (check modes). On a CUDA device
    one plain fp32 and one plain bf16 step run first in every way (the context, cuBLAS and the kernels loaded
    before the clock starts), and the line holds the device's peak allocated memory (``gpu_mb``)."""
    import copy
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    model, batch = _model(config, tokens)
    cuda = device.startswith("cuda")
    if cuda:
        for dt in (torch.float32, torch.bfloat16):
            warm = copy.deepcopy(model).to(device, dt)
            warm(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
            del warm
        _sync(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def gpu() -> dict:
        return {"gpu_mb": torch.cuda.max_memory_allocated() / 2 ** 20} if cuda else {}
    start = time.perf_counter()  # the step, not the process start and the model's construction
    if mode.startswith("plain"):
        m = model.to(device, torch.bfloat16 if mode == "plain-bf16" else torch.float32)
        m(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
        _sync(device)
        print(json.dumps({"seconds": time.perf_counter() - start, **gpu()}))
        return
    from msprobe_ci.backends import Backend
    from msprobe_ci.check import evaluate, run_side
    from msprobe_ci.judge import JudgeSettings
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator
    from msprobe_ci.kernels import default_bench_kernel

    sampler = Sampler()
    sampler.start()
    tmp = tempfile.mkdtemp(prefix="realistic-")
    try:
        cfg = DumpConfig(task="statistics", level="mix")
        bench, target = Backend.from_options(device, "fp32"), Backend.from_options(device, "bf16")
        sampler.mark("bench side")
        b = run_side(model, (batch,), lambda out: out.loss, bench, cfg.with_overrides(
            dump_path=os.path.join(tmp, "bench")), spill_outputs=True)
        sampler.mark("target side")
        # as msprobe.check builds it: the bench kernel and the oracle's device by default (on CUDA: the target's
        # own device, float64)
        from msprobe_ci.isolate.budget import IsolationBudget

        budget = IsolationBudget(BUDGET, "realistic_size") if mode == "check-budget" else None
        iso = Isolator(backward=True, target_device=target.torch_device, bench_device=bench.torch_device,
                       bench_kernel=kernel or default_bench_kernel(bench.torch_device, target.torch_device),
                       budget=budget, **target.oracle_options("target")) if mode in ("check", "check-budget") else None
        t = run_side(model, (batch,), lambda out: out.loss, target, cfg.with_overrides(
            dump_path=os.path.join(tmp, "target")), isolator=iso, spill_outputs=True)
        oracle = (iso.oracle_device, len(iso.oracle_fallbacks)) if iso is not None else (None, 0)
        budgeted = budget.summary() if budget is not None else None
        iso_on = iso is not None
        del iso
        import gc

        gc.collect()
        sampler.mark("judgement")
        outcome = evaluate(b, t, os.path.join(tmp, "out"), JudgeSettings(level="mix", isolate=iso_on),
                           graph_dir=os.path.join(tmp, "graphs"))
        sampler.mark("end")
        _sync(device)
        print(json.dumps({"seconds": time.perf_counter() - start, "peaks": sampler.peak, "at": sampler.at, **gpu(),
                          "oracle": oracle[0], "oracle_fallbacks": oracle[1],
                          "phase_seconds": sampler.seconds, "budget": budgeted,
                          "first": outcome.first_divergence.name
                          if outcome.first_divergence is not None else None}))
    finally:
        sampler.stop = True
        shutil.rmtree(tmp, ignore_errors=True)


def timed(args: list[str]) -> tuple[float, float, str]:
    """``(wall seconds, peak resident MB, stdout)`` of this script run as a child with ``args``: the child's own
    resource usage from ``os.wait4`` (no external ``time`` program needed)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, __file__, *args], stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{args} failed:\n{err.read()[-3000:]}")
        return wall, usage.ru_maxrss / 1024, out.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--config", choices=("gpt2", "gpt2-medium"), default="gpt2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: bench fp32 and target bf16 on the GPU, the "
                    "oracle there in float64 (msprobe.check's default on CUDA)")
    ap.add_argument("--isolate-budget", type=float, default=1.5,
                    help="the cost factor of the check-budget way (msprobe_ci.isolate.budget)")
    ap.add_argument("--ways", default="plain-fp32,plain-bf16,check,check-noiso",
                    help="which ways to run, comma-separated (the ratios need both plain steps)")
    ap.add_argument("--bench-kernel", default="", help="the isolation's same-dtype bench kernel (device, upcast, "
                    "rounded, decomposed; default: msprobe.check's for the devices)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global BUDGET
    BUDGET = args.isolate_budget
    if args.child:
        child(args.child, args.config, args.tokens, args.threads, args.device, args.bench_kernel)
        return
    common = ["--config", args.config, "--tokens", str(args.tokens), "--threads", str(args.threads),
              "--isolate-budget", str(args.isolate_budget),
              "--bench-kernel", args.bench_kernel,
              "--device", args.device]
    where = args.device
    if args.device.startswith("cuda"):
        import torch

        where = f"{args.device} ({torch.cuda.get_device_name()}, torch {torch.__version__})"
    print(f"{args.config}, 1 x {args.tokens} tokens, forward+backward, on {where}, {args.threads} threads, "
          f"{os.cpu_count()} cores; each way a fresh process")
    res = {}
    for mode in args.ways.split(","):
        try:
            wall, rss, out = timed(["--child", mode, *common])
        except SystemExit as exc:  # the other ways still run
            print(f"  {mode:<12} {exc}", flush=True)
            continue
        info = json.loads(out.strip().splitlines()[-1])
        res[mode] = (info["seconds"], rss, info.get("gpu_mb"))
        line = f"  {mode:<12} step {info['seconds']:7.2f} s (process {wall:6.1f} s) {rss:8.0f} MB peak"
        if "gpu_mb" in info:
            line += f", GPU {info['gpu_mb']:7.0f} MB peak"
            if mode.startswith("check") and "plain-fp32" in res:
                line += f" ({info['gpu_mb'] / res['plain-fp32'][2]:4.2f}x plain fp32's)"
        if info.get("budget"):
            b = info["budget"]
            line += (f"; budget {b['factor']}: {b['judged']} of {b['calls']} calls isolated, isolation "
                     f"{b['measured_factor']}x the capture alone")
        if info.get("oracle"):
            line += f"; oracle on {info['oracle']} ({info['oracle_fallbacks']} APIs fell back to the CPU)"
        if mode.startswith("check") and not {"plain-fp32", "plain-bf16"} <= set(res):
            line += f"; first divergence {info['first']}"  # a benign run names none
        if mode.startswith("check") and {"plain-fp32", "plain-bf16"} <= set(res):
            plain = res["plain-fp32"][0] + res["plain-bf16"][0]
            line += (f"   time {info['seconds'] / plain:4.2f}x (plain fp32 + bf16 steps), memory "
                     f"{rss / res['plain-fp32'][1]:4.2f}x (plain fp32); first divergence {info['first']}; peak by "
                     "phase (resident at its start, its seconds): " + ", ".join(
                         f"{k} {v:.0f} MB ({info['at'].get(k, 0):.0f}) {info['phase_seconds'].get(k, 0):.1f} s"
                     for k, v in info["peaks"].items()
                         if k != "start"))
        print(line, flush=True)


if __name__ == "__main__":
    main()
