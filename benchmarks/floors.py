"""The speed floors, measured against msprobe in one run: fails (exit 1) when a figure falls below its floor.

Runs, each as its own script (so each figure is also reproducible alone):

* ``capture_overhead.py --modes none,msprobe-ci,msprobe`` at every size it has: msprobe-ci's capture (mix,
  statistics, isolation off) against no capture and against msprobe's PrecisionDebugger, interleaved;
* ``scale.py --nonfinite --graph`` at 30k entries (both tools) and 100k (ours only, for memory): compare and graph
  of statistics dumps holding NaN/-Infinity statistics, as every masked model's dump does.

Floors (issue "Speed that stays"): capture at most 1.3x no capture on the medium block and below msprobe at every
size (the per-record cost printed beside msprobe's); ``compare`` at
least 5x and ``graph`` at least 3x faster than msprobe's ``compare``/``graph_visualize`` in CPU time at 30k entries;
peak memory of each at 100k entries at most 500 MB, and with ``--large-entries 1000000`` (the weekly workflow) at
most 1 GB. Prints a Markdown table; appends it to ``$GITHUB_STEP_SUMMARY``
when that is set (the job summary). Timings stay out of the test suite.

    python benchmarks/floors.py [--sizes small,medium] [--entries 30000] [--memory-entries 100000]
                                [--large-entries 1000000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

CAPTURE_MAX = 1.3       # x no capture, on the medium block (a transformer block of realistic width)
CAPTURE_SIZE = "medium"
COMPARE_MIN = 5.0       # msprobe CPU seconds / ours
GRAPH_MIN = 3.0
MEMORY_MAX_MB = 500.0   # at the memory size
LARGE_MAX_MB = 1024.0   # at the large size (1M entries in the workflow)


def _script(name: str, *args: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.json")
        subprocess.run([sys.executable, os.path.join(HERE, name), *args, "--json", out], check=True)
        with open(out, encoding="utf-8") as fh:
            return json.load(fh)


def check(rows: list[tuple[str, float, str, bool]]) -> tuple[str, bool]:
    """The Markdown table of ``(figure, value, floor text, ok)`` rows and whether every one holds."""
    lines = ["| figure | measured | floor | |", "|---|---|---|---|"]
    for figure, value, floor, ok in rows:
        lines.append(f"| {figure} | {value:.2f} | {floor} | {'ok' if ok else '**below floor**'} |")
    return "\n".join(lines), all(ok for *_, ok in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,medium", help="capture_overhead.py sizes")
    ap.add_argument("--entries", type=int, default=30_000, help="scale.py size timed against msprobe")
    ap.add_argument("--memory-entries", type=int, default=100_000, help="scale.py size whose peak memory is bounded "
                                                                        "(ours only; 0: skip)")
    ap.add_argument("--large-entries", type=int, default=0, help="scale.py size whose peak memory is bounded by "
                                                                     f"{LARGE_MAX_MB:.0f} MB (ours only; 0: skip)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per tool in scale.py (the fastest counts)")
    args = ap.parse_args()
    rows: list[tuple[str, float, str, bool]] = []
    for size in args.sizes.split(","):
        m = _script("capture_overhead.py", "--size", size, "--modes", "none,msprobe-ci,msprobe")["modes"]
        ours = m["msprobe-ci"]["ratio"]
        if size == CAPTURE_SIZE:
            rows.append((f"capture overhead, {size} block (x no capture)", ours, f"<= {CAPTURE_MAX}",
                         ours <= CAPTURE_MAX))
        else:  # a smaller block: its step is mostly per-record work, bounded by msprobe's alone
            rows.append((f"capture overhead, {size} block (x no capture)", ours, "below msprobe's", True))
        rows.append((f"capture, {size} block: microseconds per record", m["msprobe-ci"]["us_per_record"] or 0.0,
                     f"msprobe's {m['msprobe']['us_per_record']:.0f}" if "msprobe" in m else "-", True))
        if "msprobe" in m:
            theirs = m["msprobe"]["ratio"]
            rows.append((f"capture overhead, {size} block: msprobe's (x no capture)", theirs, f"> {ours:.2f} (ours)",
                         theirs > ours))
    sizes = _script("scale.py", "--entries", str(args.entries), "--nonfinite", "--graph", "--repeat",
                    str(args.repeat))["sizes"]
    r = sizes[str(args.entries)]
    for job, floor in (("compare", COMPARE_MIN), ("graph", GRAPH_MIN)):
        if f"msprobe_{job}" in r:
            x = r[f"msprobe_{job}"][1] / r[job][1]
            rows.append((f"{job}, {r['entries']} entries with NaN/-Infinity statistics (msprobe CPU s / ours)", x,
                         f">= {floor}", x >= floor))
    for entries, limit in ((args.memory_entries, MEMORY_MAX_MB), (args.large_entries, LARGE_MAX_MB)):
        if not entries:
            continue
        big = _script("scale.py", "--entries", str(entries), "--nonfinite", "--graph", "--tools",
                      "ours")["sizes"][str(entries)]
        for job in ("compare", "graph"):
            mb = big[job][2]
            rows.append((f"{job} peak memory, {big['entries']} entries (MB)", mb, f"<= {limit:.0f}", mb <= limit))
    table, ok = check(rows)
    print(table)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as fh:
            fh.write("## Speed floors (msprobe-ci vs msprobe, one run)\n\n" + table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
