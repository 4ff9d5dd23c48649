"""compare and graph over many (step, rank) pairs: serial against a process pool and against dask workers, side by
side in one run.

The dump root is made, not downloaded: the GPT-2 template of ``benchmarks/scale.py`` (captured once with
msprobe-ci's PrecisionDebugger, mix level, statistics, fp32 bench, bf16 target) deepened to ``--entries`` entries,
then laid out as ``step<S>/rank<R>`` folders (``--ranks`` x ``--steps``) on both sides, as a pretraining job's dump
root is. Each command is timed as a user runs it (a fresh process, via /usr/bin/time; with ``--repeat`` the fastest
of the runs, the ways taking turns):

* ``serial``: ``msprobe-ci compare|graph -tp ROOT -gp ROOT``;
* ``-n 2``: a local pool of two spawned processes;
* ``dask``: ``--scheduler local -n 2``, two one-thread dask workers (a LocalCluster started by the command: its
  start-up is in the time).

    python benchmarks/many_ranks.py [--ranks 16] [--steps 2] [--entries 2000] [--repeat 3] [--keep DIR]

Prints wall, CPU and peak memory (of the parent: GNU time counts the largest process of the tree) per way and the
ratio of each to serial wall time. The issue's goal: two workers <= 0.75x serial on 2 cores. Outputs are checked
identical to serial before anything is timed (same CSVs, same .vis.db rows in the same order).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import closing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale import base_dumps, best, cell, deepen, timed  # noqa: E402  (a sibling benchmark's dump maker)


def make_root(root: str, ranks: int, steps: int, entries: int) -> tuple[str, str]:
    """Both sides' dump roots (``<root>/{target,bench}/step<S>/rank<R>``); returns (target root, bench root)."""
    target0, bench0 = base_dumps(os.path.join(root, "base"))
    with open(os.path.join(target0, "dump.json"), encoding="utf-8") as fh:
        per_block = max(1, len(__import__("json").load(fh)["data"]) // 2)
    layers = max(1, round(entries / per_block))
    for side, src in (("target", target0), ("bench", bench0)):
        one = os.path.join(root, "deep", side)
        if not os.path.exists(os.path.join(one, "dump.json")):
            deepen(src, one, layers)
        for s in range(steps):
            for r in range(ranks):
                dst = os.path.join(root, side, f"step{s}", f"rank{r}")
                if not os.path.exists(dst):
                    shutil.copytree(one, dst)
    return os.path.join(root, "target"), os.path.join(root, "bench")


def _content(out: str) -> tuple:
    csvs = {}
    for f in sorted(glob.glob(os.path.join(out, "*.csv"))):
        with open(f, encoding="utf-8") as fh:
            csvs[re.sub(r"_\d{14}(_\d+)?", "", os.path.basename(f))] = fh.read()
    sql = []
    for db in glob.glob(os.path.join(out, "*.vis.db")):
        with closing(sqlite3.connect(db)) as c:
            sql.append("\n".join(c.iterdump()))
    return csvs, sql


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--entries", type=int, default=2000, help="entries per dump.json (about)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--keep", help="keep the dumps under this folder")
    args = ap.parse_args()
    root = args.keep or tempfile.mkdtemp(prefix="msprobe-ci-ranks-")
    target, bench = make_root(root, args.ranks, args.steps, args.entries)
    ours = os.path.join(os.path.dirname(sys.executable), "msprobe-ci")
    ways = {"serial": [], "-n 2": ["-n", "2"], "dask": ["--scheduler", "local", "-n", "2"]}
    with open(os.path.join(target, "step0", "rank0", "dump.json"), encoding="utf-8") as fh:
        entries = len(__import__("json").load(fh)["data"])
    print(f"{args.ranks} ranks x {args.steps} steps, {entries} entries per dump.json, {os.cpu_count()} cores; "
          f"best of {args.repeat}; ratio: wall time / serial wall time")
    for command in ("compare", "graph"):
        base = [ours, command, "-tp", target, "-gp", bench]
        outs = {}
        for name, extra in ways.items():  # identical outputs first
            out = tempfile.mkdtemp(dir=root)
            proc = subprocess.run([*base, "-o", out, *extra], capture_output=True, text=True)
            if proc.returncode not in (0, 1):
                raise SystemExit(f"{name} {command} failed:\n{proc.stderr[-2000:]}")
            outs[name] = _content(out)
            shutil.rmtree(out)
        same = all(v == outs["serial"] for v in outs.values())
        runs: dict[str, list] = {k: [] for k in ways}
        for _ in range(args.repeat):
            for name, extra in ways.items():
                out = tempfile.mkdtemp(dir=root)
                runs[name].append(timed([*base, "-o", out, *extra], out))
                shutil.rmtree(out)
        r = {k: best(v) for k, v in runs.items()}
        for name in ways:
            print(f"{command:>8} {name:>7}: {cell(r[name])}  {r[name][0] / r['serial'][0]:5.2f}x"
                  + ("" if name != "serial" else f"  (outputs identical to serial: {same})"), flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
