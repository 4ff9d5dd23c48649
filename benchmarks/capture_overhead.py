"""Capture overhead: no capture vs msprobe-ci (mix, statistics), with isolation (every API also judged on its
own inputs against an fp64 oracle, forward and backward, once per bench kernel: "isolated-device" recomputes the
CPU target's own kernel, so a call bit-identical to it needs no error budget; "isolated-upcast", "-rounded" and
"-decomposed" are foreign benches, where a call that differs from its bench is also sized by its perturbed runs,
as on a device target) and msprobe's PrecisionDebugger, interleaved.

A 4-layer pre-LN transformer block stack written with explicit APIs, forward+backward, one thread.
    python benchmarks/capture_overhead.py [--size small|medium|calls] [--rounds 3] [--iters N]
        [--modes none,msprobe-ci,isolated-upcast,budgeted-upcast --isolate-budget 1.5]
Prints per-mode median ms per iteration, the ratio to no capture, records per step and microseconds per record, and the
physical floor: the bytes of the tensors captured per step, read once at the measured single-thread read bandwidth.
msprobe runs in a subprocess (its API wrapping is global and cannot be undone in-process).

    python benchmarks/capture_overhead.py --against /tmp/wt_old [--size calls --modes msprobe-ci,isolated-device]

``--against PATH`` times this checkout against another one (a ``git worktree`` of an earlier revision, whose
``msprobe_ci``, ``checkers`` and benchmark its workers import): each round runs both workers of a mode **at the same
time, one pinned to each CPU core** (the cores swapped every round), so the machine's drift, which moves one
process's timings by +-25% within minutes here, touches both alike; it prints each round's ratio ours / theirs
and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

SIZES = {"small": (2, 32, 128, 512), "medium": (8, 128, 256, 1024), "calls": (1, 1, 4, 0)}


class Block(torch.nn.Module):
    def __init__(self, d, ff, heads=4):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, ff), torch.nn.Linear(ff, d)
        self.h = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * (d // self.h) ** -0.5, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Net(torch.nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, ff) for _ in range(4))
        self.head = torch.nn.Linear(d, d)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x).mean()


class Calls(torch.nn.Module):
    """``--size calls``: 500 rounds of an add and a multiply on 4-element tensors: the hooked call's own cost
    (what an accelerator's step leaves to the host), next to nothing of arithmetic."""

    def __init__(self, n: int = 500):
        super().__init__()
        self.n, self.w = n, torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        for _ in range(self.n):
            x = torch.add(x, self.w) * 0.5
        return x.sum()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ISOLATED = ["isolated-device", "isolated-upcast", "isolated-rounded", "isolated-decomposed"]
#: budgeted isolation (msprobe_ci.isolate.budget) with the factor ``--isolate-budget``; run only when named in --modes
BUDGETED = ["budgeted-device", "budgeted-upcast"]
FACTOR = 1.5


def _setup(size, dtype="fp32"):
    torch.manual_seed(0)
    if size == "calls":
        return Calls().to(DTYPES[dtype]), torch.ones(4, dtype=DTYPES[dtype])
    b, t, d, ff = SIZES[size]
    return Net(d, ff).to(DTYPES[dtype]), torch.randn(b, t, d).to(DTYPES[dtype])


def _time_mode(mode, size, iters, warmup=3, dtype="fp32"):
    """Median ms per fwd+bwd iteration for one mode, and records per step."""
    model, x = _setup(size, dtype)
    records = 0
    tmp = tempfile.mkdtemp()
    dbg = None
    if mode == "msprobe-ci":
        from msprobe_ci import PrecisionDebugger
        dbg = PrecisionDebugger(dump_path=tmp, level="mix", task="statistics", isolate=False)  # capture alone
    elif mode.startswith(("isolated-", "budgeted-")):
        from msprobe_ci.capture import CaptureSession
        from msprobe_ci.config import DumpConfig
        from msprobe_ci.isolate import Isolator
        from msprobe_ci.isolate.budget import IsolationBudget
        budget = IsolationBudget(FACTOR, "capture_overhead") if mode.startswith("budgeted-") else None
        iso = Isolator(bench_kernel=mode.split("-", 1)[1], budget=budget)
        dbg = CaptureSession(DumpConfig(task="statistics", level="mix", dump_path=tmp), isolator=iso)
    elif mode == "msprobe":
        from _msprobe import statistics_config
        from msprobe.pytorch import PrecisionDebugger

        dbg = PrecisionDebugger(config_path=statistics_config(tmp, os.path.join(tmp, "d")))
    times = []
    for i in range(warmup + iters):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if dbg is not None:
            dbg.start(model)
        model(x).backward()
        if dbg is not None:
            dbg.stop()
            dbg.step()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt * 1000)
    distinct: dict = {}  # one more, untimed step
    if mode == "msprobe-ci":  # count the distinct tensors the statistics read (a tensor reused by the next op
        from msprobe_ci.capture.records import RecordBuilder  # is recorded twice but read once)

        orig = RecordBuilder.tensor

        def counting(self, t, data_name=None):
            try:
                distinct[(t.data_ptr(), t._version, tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
            except RuntimeError:
                pass
            return orig(self, t, data_name)

        RecordBuilder.tensor = counting
        model.zero_grad(set_to_none=True)
        dbg.start(model)
        model(x).backward()
        dbg.stop()
        dbg.step()
        RecordBuilder.tensor = orig
    share = None
    if mode.startswith("budgeted-"):  # the judged share of the timed steps, from each step's isolation.json
        judged = calls = 0
        for root, _, files in os.walk(tmp):
            if "isolation.json" in files and int(os.path.basename(os.path.dirname(root))[4:]) >= warmup:
                with open(os.path.join(root, "isolation.json")) as fh:
                    b = json.load(fh)["budget"]
                judged, calls = judged + b["judged"], calls + b["calls"]
        share = judged / calls if calls else None
    nbytes = 0
    if mode != "none":
        for root, _, files in os.walk(tmp):
            if "dump.json" in files:
                with open(os.path.join(root, "dump.json")) as fh:
                    data = json.load(fh)["data"]
                records = len(data)
                nbytes = sum(distinct.values()) if distinct else sum(_tensor_bytes(e) for e in data.values())
                break
    return statistics.median(times), records, nbytes, share


_ITEMSIZE = {"torch.float64": 8, "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2, "torch.int64": 8,
             "torch.int32": 4, "torch.bool": 1, "torch.uint8": 1, "torch.int8": 1}


def _tensor_bytes(value) -> int:
    """Bytes of every tensor record in a dump entry (what reading each captured tensor once costs)."""
    if isinstance(value, dict) and "dtype" in value and "shape" in value:
        n = 1
        for s in value["shape"]:
            n *= int(s)
        return n * _ITEMSIZE.get(value["dtype"], 4)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def read_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    """Measured single-thread read bandwidth in bytes/s: the best of ``repeats`` sums over an ``mb`` MB fp32
    tensor (a reduction reads every byte once, as a statistic does)."""
    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def main():
    global FACTOR
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="medium", choices=sorted(SIZES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                    help="model dtype (isolation's oracle is fp64 for fp32, fp32 for bf16/fp16)")
    ap.add_argument("--modes", default=None, help="comma-separated subset of the modes (default: all)")
    ap.add_argument("--json", help="also write the medians here: per mode ms/iter, ratio to no capture, records "
                                   "(benchmarks/floors.py reads it)")
    ap.add_argument("--isolate-budget", type=float, default=FACTOR,
                    help="the factor of the budgeted-device/budgeted-upcast modes (run when --modes names them)")
    ap.add_argument("--against", metavar="PATH", help="another checkout (an earlier revision's worktree): its "
                                                       "workers and ours run side by side, one per core")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    FACTOR = args.isolate_budget
    torch.set_num_threads(1)
    iters = args.iters or (20 if args.size == "small" else 8)
    if args.worker:
        print(json.dumps(_time_mode(args.worker, args.size, iters, dtype=args.dtype)))
        return
    if args.against:
        _against(args, iters)
        return
    try:
        import msprobe  # noqa: F401
        modes = ["none", "msprobe-ci", *ISOLATED, "msprobe"]
    except ImportError:
        modes = ["none", "msprobe-ci", *ISOLATED]
    if args.modes:
        modes = [m for m in modes + BUDGETED if m in args.modes.split(",")]
    results = {m: [] for m in modes}
    recs, captured, shares = {}, {}, {}
    for _ in range(args.rounds):
        for m in modes:  # interleaved; each mode in a fresh process so msprobe's global wrapping stays contained
            out = subprocess.run([sys.executable, __file__, "--size", args.size, "--iters", str(iters),
                                  "--dtype", args.dtype, "--isolate-budget", str(FACTOR), "--worker", m],
                                 capture_output=True, text=True, check=True)
            ms, n, nbytes, share = json.loads(out.stdout.strip().splitlines()[-1])
            shares.setdefault(m, []).append(share)
            results[m].append(ms)
            recs[m] = n
            captured[m] = nbytes
    base = statistics.median(results["none"])
    plain = statistics.median(results["msprobe-ci"])
    print(f"size={args.size} {SIZES[args.size] if args.size != 'calls' else '(500 x add, mul on 4 elements)'} (B, T, D, FF), {args.dtype}, 1 thread, {args.rounds} interleaved rounds x {iters} iters")
    bw = read_bandwidth()
    floor = captured["msprobe-ci"] / bw * 1000
    print(f"physical floor: {captured['msprobe-ci'] / 2**20:.1f} MB of distinct captured tensors per step, read "
          f"once at {bw / 1e9:.1f} GB/s (1 thread) = {floor:.2f} ms -> x{(base + floor) / base:.3f} of no capture "
          f"(four separate reductions, amax/amin/sum/norm, read them 4 times: x{(base + 4 * floor) / base:.3f})")
    summary = {"size": args.size, "dtype": args.dtype, "rounds": args.rounds, "iters": iters,
               "floor_ratio": (base + floor) / base, "modes": {}}
    for m in modes:
        med = statistics.median(results[m])
        per = (med - base) / recs[m] if recs.get(m) else float("nan")
        summary["modes"][m] = {"ms": med, "ratio": med / base, "records": recs.get(m, 0),
                               "us_per_record": per * 1000 if recs.get(m) else None}
        print(f"{m:>19}: {med:8.2f} ms/iter  x{med / base:5.2f}  records/step {recs.get(m, 0):4d}  "
              f"{per * 1000:6.1f} us/record" + (f"  (x{med / plain:.2f} of capture without isolation)"
                                         if m.startswith(("isolated", "budgeted")) else "")
              + (f", factor {FACTOR}: {statistics.median(shares[m]):.0%} of calls judged"
                 if m.startswith("budgeted") and None not in shares[m] else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1)


def _worker(root: str | None, args, mode: str, iters: int, core: int | None) -> subprocess.Popen:
    """One timing worker of ``mode``: this checkout's (``root`` None) or the one at ``root`` (its benchmark script,
    its ``msprobe_ci`` and the ``checkers``/``pytest_plugin`` packages an install maps into it), pinned to ``core``."""
    flags = ["--size", args.size, "--iters", str(iters), "--dtype", args.dtype, "--isolate-budget", str(FACTOR),
             "--worker", mode]
    env = dict(os.environ)
    if root is None:
        cmd, cwd = [sys.executable, __file__, *flags], None
    else:
        root = os.path.abspath(root)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        boot = ("import sys, runpy, msprobe_ci; "
                "assert msprobe_ci.__file__.startswith(sys.argv[1]), msprobe_ci.__file__; "
                "msprobe_ci.__path__.append(sys.argv[1]); sys.argv = sys.argv[2:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        cmd, cwd = [sys.executable, "-c", boot, root, os.path.join(root, "benchmarks", "capture_overhead.py"),
                    *flags], root

    def pin():
        if core is not None:
            os.sched_setaffinity(0, {core})
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=pin)


def _against(args, iters: int) -> None:
    """``--against``: this checkout's workers and the other's, side by side (see the module docstring)."""
    modes = (args.modes or "msprobe-ci,isolated-device").split(",")
    cores = sorted(os.sched_getaffinity(0))
    side = len(cores) >= 2
    ratios: dict = {m: [] for m in modes}
    pairs: dict = {m: [] for m in modes}

    def finish(p: subprocess.Popen, m: str) -> float:
        out, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"worker {m} failed:\n{err[-3000:]}")
        return json.loads(out.strip().splitlines()[-1])[0]

    for r in range(args.rounds):
        swap = r % 2 == 1
        for m in modes:
            if side:  # at the same time, one per core, swapped every round
                ours_core, theirs_core = (cores[1], cores[0]) if swap else (cores[0], cores[1])
                procs = [_worker(None, args, m, iters, ours_core),
                         _worker(args.against, args, m, iters, theirs_core)]
                ours, theirs = (finish(p, m) for p in procs)
            elif swap:  # one core: one after the other, the order swapped every round
                theirs = finish(_worker(args.against, args, m, iters, None), m)
                ours = finish(_worker(None, args, m, iters, None), m)
            else:
                ours = finish(_worker(None, args, m, iters, None), m)
                theirs = finish(_worker(args.against, args, m, iters, None), m)
            pairs[m].append((ours, theirs))
            ratios[m].append(ours / theirs)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"size={args.size}, {args.dtype}, 1 thread, {args.rounds} rounds x {iters} iters; ours = {here}, "
          f"theirs = {os.path.abspath(args.against)} ({'side by side, one core each' if side else 'in turn'})")
    for m in modes:
        ours = statistics.median([a for a, _ in pairs[m]])
        theirs = statistics.median([b for _, b in pairs[m]])
        print(f"{m:>19}: ours/theirs {statistics.median(ratios[m]):.3f} (rounds: "
              f"{', '.join(f'{x:.3f}' for x in ratios[m])}); ms/iter ours {ours:.1f}, theirs {theirs:.1f}")


if __name__ == "__main__":
    main()
