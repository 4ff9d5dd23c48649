"""Per-API pre-check throughput: API calls judged per second on one core, and the speed-up with 2 workers.

Dumps: the example GPT-2 and Qwen2 models, forward+backward, level L1, task tensor, bf16, captured once. Then, on
the same dumps: in-process replay with one torch thread (APIs/s), and ``msprobe-ci api-check -n 1`` vs ``-n 2``
as fresh processes (wall time includes interpreter start and imports).

    python benchmarks/api_check_throughput.py [--rounds 3] [--calls 10000]

``--calls N``: instead, capture the GPT-2 example step after step (one ``step<k>`` folder each) until the dump root
holds at least N API calls, and time ``msprobe-ci api-check`` on the whole root with ``-n 1`` and ``-n 2`` (one pool
of spawned workers serves every step folder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _capture(root: str) -> list[str]:
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from test_gpt2 import build_gpt2
    from test_qwen2 import build_qwen2

    from msprobe_ci import PrecisionDebugger

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100))
    out = []
    for name, build in (("gpt2", build_gpt2), ("qwen2", build_qwen2)):
        model = build().to(torch.bfloat16)
        dbg = PrecisionDebugger(dump_path=os.path.join(root, name), level="L1", task="tensor")
        dbg.start()
        model(input_ids=ids, labels=ids).loss.backward()
        dbg.stop()
        out.append(os.path.join(root, name, "step0", "rank", "dump.json"))
    return out


def _at_scale(calls: int) -> None:
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from test_gpt2 import build_gpt2

    from msprobe_ci import PrecisionDebugger
    from msprobe_ci.dump import load_dump
    from msprobe_ci.dump.reader import layout
    from msprobe_ci.replay import ApiReplayer

    root = tempfile.mkdtemp()
    model = build_gpt2().to(torch.bfloat16)
    dbg = PrecisionDebugger(dump_path=os.path.join(root, "dump"), level="L1", task="tensor")
    total = 0
    while total < calls:
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100 + total))
        dbg.start()
        model(input_ids=ids, labels=ids).loss.backward()
        dbg.stop()
        dbg.step()
        folders = layout(os.path.join(root, "dump"))
        last = folders[max(folders)]
        total += len(ApiReplayer(load_dump(last)).api_names())
    cli = os.path.join(os.path.dirname(sys.executable), "msprobe-ci")
    times = {}
    for workers in (1, 2):
        out = os.path.join(root, f"out{workers}")
        t0 = time.perf_counter()
        proc = subprocess.run([cli, "api-check", "-api_info", os.path.join(root, "dump"), "-o", out, "-n",
                               str(workers)], capture_output=True, text=True)
        times[workers] = time.perf_counter() - t0
        summary = [ln for ln in proc.stdout.splitlines() if "API calls:" in ln]
        print(f"-n {workers}: {times[workers]:.1f} s ({total / times[workers]:.0f} API calls/s) {summary}")
    print(f"{total} API calls in {len(layout(os.path.join(root, 'dump')))} step folders: -n 2 speed-up "
          f"x{times[1] / times[2]:.2f}")
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=0, help="time api-check on a dump root of at least this many calls")
    args = ap.parse_args()
    if args.calls:
        _at_scale(args.calls)
        return
    import torch

    torch.set_num_threads(1)
    from msprobe_ci.dump import load_dump
    from msprobe_ci.replay import ApiReplayer

    root = tempfile.mkdtemp()
    dumps = _capture(root)
    cli = os.path.join(os.path.dirname(sys.executable), "msprobe-ci")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for path in dumps:
        names = ApiReplayer(load_dump(path)).api_names()
        inproc, one, two = [], [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            rp = ApiReplayer(load_dump(path))
            for n in names:
                rp.check(n)
            inproc.append(time.perf_counter() - t0)
            for workers, bucket in ((1, one), (2, two)):
                out = os.path.join(root, f"out{workers}")
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                subprocess.run([cli, "api-check", "-api_info", path, "-o", out, "-n", str(workers)], check=False,
                               capture_output=True, env=env)
                bucket.append(time.perf_counter() - t0)
        model = os.path.basename(os.path.dirname(os.path.dirname(os.path.dirname(path))))
        i, a, b = statistics.median(inproc), statistics.median(one), statistics.median(two)
        print(f"{model}: {len(names)} API calls | in-process, 1 thread: {i:.2f} s = {len(names) / i:.0f} APIs/s | "
              f"CLI -n 1: {a:.2f} s, -n 2: {b:.2f} s (speed-up x{a / b:.2f})")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
