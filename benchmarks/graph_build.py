"""Graph build+compare: ``msprobe-ci graph`` vs ``msprobe graph_visualize`` on the same dumps, side by side.

Dumps: the example GPT-2 (2 layers) forward+backward at level mix, task tensor, bf16 target vs fp32 bench, captured
once with msprobe-ci's PrecisionDebugger. Both tools run as the command a user types (a fresh process each, so
interpreter start and imports count), interleaved, and the in-process time of our build+compare is printed too.

    python benchmarks/graph_build.py [--rounds 3] [--task tensor|statistics]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _dumps(root: str, task: str) -> tuple[str, str, int]:
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from test_gpt2 import build_gpt2

    from msprobe_ci import PrecisionDebugger

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100))
    folders = []
    for name, dtype in (("target", torch.bfloat16), ("bench", torch.float32)):
        model = build_gpt2().to(dtype)
        dbg = PrecisionDebugger(dump_path=os.path.join(root, name), level="mix", task=task)
        dbg.start(model)
        model(input_ids=ids, labels=ids).loss.float().backward()
        dbg.stop()
        folders.append(os.path.join(root, name, "step0", "rank"))
    from msprobe_ci.compare import compare_dumps
    from msprobe_ci.dump import load_dump

    rows = len(compare_dumps(bench=load_dump(folders[1]), target=load_dump(folders[0])).rows)
    return folders[0], folders[1], rows


def _timed(cmd: list[str], out: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--task", default="tensor", choices=["tensor", "statistics"])
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    target, bench, rows = _dumps(root, args.task)
    bindir = os.path.dirname(sys.executable)
    ours_cmd = [os.path.join(bindir, "msprobe-ci"), "graph", "-tp", target, "-gp", bench, "-o", os.path.join(root, "o1")]
    theirs_exe = shutil.which("msprobe", path=bindir) or shutil.which("msprobe")
    theirs_cmd = [theirs_exe, "graph_visualize", "-tp", target, "-gp", bench, "-o", os.path.join(root, "o2")] \
        if theirs_exe else None
    ours, theirs, inproc = [], [], []
    from msprobe_ci.graph import compare_vis_db

    for _ in range(args.rounds):
        ours.append(_timed(ours_cmd, os.path.join(root, "o1")))
        if theirs_cmd:
            theirs.append(_timed(theirs_cmd, os.path.join(root, "o2")))
        t0 = time.perf_counter()
        compare_vis_db(target, bench, os.path.join(root, f"o3-{len(inproc)}"))
        inproc.append(time.perf_counter() - t0)
    o, i = statistics.median(ours), statistics.median(inproc)
    print(f"GPT-2 (2 layers) mix {args.task} dumps, bf16 target vs fp32 bench: {rows} compare rows, "
          f"{args.rounds} interleaved rounds (median)")
    print(f"  msprobe-ci graph (CLI, fresh process): {o:6.2f} s   in-process build+compare+write: {i:6.2f} s")
    if theirs:
        t = statistics.median(theirs)
        print(f"  msprobe graph_visualize (CLI):        {t:6.2f} s   -> msprobe-ci is {t / o:4.1f}x faster "
              f"(CLI vs CLI), {t / i:4.1f}x in-process")
    else:
        print("  msprobe not installed: install the test extra for the side-by-side number")
    print(json.dumps({"rows": rows, "ours_cli_s": o, "ours_inproc_s": i,
                      "msprobe_cli_s": statistics.median(theirs) if theirs else None}))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
