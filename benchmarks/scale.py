"""Compare and graph at scale: msprobe-ci against msprobe on deep statistics dumps, side by side in one run.

The dumps are made, not downloaded: a GPT-2 (2 layers, built from a config) is captured once with msprobe-ci's
PrecisionDebugger (mix level, statistics, forward and backward; fp32 bench, bf16 target), then **deepened**: the
entries of transformer block ``h.0`` (found through the names and construct.json) are repeated as blocks
``h.0 .. h.N-1`` with renamed modules and API call counters renumbered in execution order (forward blocks in
order, backward blocks in reverse, as a real N-layer model dumps them), so names, counters, construct.json and
stack.json stay consistent; the files are written as msprobe writes them (``indent=1``). Values are the template's (every block judges alike).

    python benchmarks/scale.py [--entries 10000 30000 100000] [--tools ours,msprobe] [--graph] [--repeat 3]

Prints, per size: entries, dump.json size, and for each tool the wall seconds, CPU seconds (user + system) and
peak resident memory of the command a user types (a fresh process, via /usr/bin/time; with ``--repeat`` the
fastest of the runs, the tools taking turns), plus the ratios msprobe / msprobe-ci of wall and of CPU time. Both
tools start from compiled bytecode, as installed packages do (msprobe-ci's is compiled first: an editable install
under ``PYTHONDONTWRITEBYTECODE`` would otherwise compile every module at every start).
"""

from __future__ import annotations

import argparse
import compileall
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

LAYER = re.compile(r"\.(h|layers|layer|blocks)\.(\d+)\.")


def base_dumps(root: str) -> tuple[str, str]:
    """Capture the 2-layer GPT-2 template: returns (target rank folder, bench rank folder)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from msprobe_ci import PrecisionDebugger

    out = {}
    if all(os.path.isfile(os.path.join(root, side, "step0", "rank", "dump.json")) for side in ("bench", "target")):
        return os.path.join(root, "target", "step0", "rank"), os.path.join(root, "bench", "step0", "rank")
    for side, dtype in (("bench", torch.float32), ("target", torch.bfloat16)):
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg).to(dtype)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        dbg = PrecisionDebugger(dump_path=os.path.join(root, side), level="mix", task="statistics")
        dbg.start(model)
        model(input_ids=ids, labels=ids).loss.backward()
        dbg.stop()
        out[side] = os.path.join(root, side, "step0", "rank")
    return out["target"], out["bench"]


def _layer(name: str, construct: dict, depth: int = 0) -> int | None:
    m = LAYER.search(name)
    if m:
        return int(m.group(2))
    parent = construct.get(name)
    return _layer(parent, construct, depth + 1) if parent and depth < 64 else None


_API = re.compile(r"^(?P<base>[A-Za-z_]+\.[^.]+)\.(?P<call>\d+)\.(?P<dir>forward|backward)$")


def mask_statistics(data: dict) -> int:
    """Give every attention call (softmax, scaled_dot_product_attention) the statistics a masked attention dumps
    (msprobe writes them as bare ``-Infinity``, ``Infinity`` and ``NaN`` tokens): its first input's Min and Mean
    -inf and Norm inf (scores with a -inf mask), its backward's first output Mean NaN; on both sides alike.
    Returns the entries changed."""
    changed = 0
    for name, entry in data.items():
        if not ("softmax" in name or "scaled_dot_product_attention" in name) or not isinstance(entry, dict):
            continue
        key, field = ("input_args", ("Min", "Mean", "Norm")) if name.endswith(".forward") else ("output", ("Mean",))
        recs = entry.get(key) or []
        if recs and isinstance(recs[0], dict):
            for f, v in zip(field, (-math.inf, -math.inf, math.inf) if len(field) == 3 else (math.nan,)):
                recs[0][f] = v
            changed += 1
    return changed


def deepen(src: str, dst: str, layers: int, nonfinite: bool = False) -> int:
    """Write a ``layers``-block version of the dump in ``src`` (a rank folder) to ``dst``; returns its entries
    (``nonfinite``: with :func:`mask_statistics`)."""
    with open(os.path.join(src, "dump.json"), encoding="utf-8") as fh:
        dump = json.load(fh)
    if nonfinite:
        mask_statistics(dump["data"])
    with open(os.path.join(src, "construct.json"), encoding="utf-8") as fh:
        construct = json.load(fh)
    with open(os.path.join(src, "stack.json"), encoding="utf-8") as fh:
        stack = json.load(fh)
    data = dump["data"]
    names = list(data)
    tags = [_layer(n, construct) for n in names]
    # the dump in segments: runs of entries outside blocks, and runs of block entries (forward: ascending
    # layers, backward: descending); every block run is replaced by N copies of the block-0 entries it holds
    out_order: list[tuple[str, int | None]] = []  # (template name, copy layer or None)
    i = 0
    while i < len(names):
        if tags[i] is None:
            out_order.append((names[i], None))
            i += 1
            continue
        j = i
        while j < len(names) and tags[j] is not None:
            j += 1
        run = list(range(i, j))
        template = [names[k] for k in run if tags[k] == 0]
        ascending = tags[i] == 0
        for layer in (range(layers) if ascending else reversed(range(layers))):
            out_order += [(n, layer) for n in template]
        i = j
    counters: dict[str, int] = {}
    call_map: dict[tuple[str, str, int | None], int] = {}

    def rename(name: str, layer: int | None) -> str:
        if name is None:
            return None
        if layer is not None:
            name = LAYER.sub(lambda m: f".{m.group(1)}.{layer}.", name, count=1)
        m = _API.match(name)
        if not m:
            return name
        key = (m["base"], m["call"], layer)
        if key not in call_map:
            call_map[key] = counters.get(m["base"], 0)
            counters[m["base"]] = call_map[key] + 1
        return f"{m['base']}.{call_map[key]}.{m['dir']}"

    new_data, new_construct, renamed = {}, {}, {}
    for name, layer in out_order:
        new = rename(name, layer)
        renamed.setdefault(name, []).append(new)
        new_data[new] = data[name]
        parent = construct.get(name)
        if name in construct:
            new_construct[new] = rename(parent, layer if parent and _layer(parent, construct) is not None
                                        else None) if parent else None
    new_stack = {}
    for k, (group, frames) in stack.items():
        new_stack[k] = [[n for old in group for n in renamed.get(old, [])], frames]
    os.makedirs(dst, exist_ok=True)
    dump["data"] = new_data
    for fname, obj in (("dump.json", dump), ("construct.json", new_construct), ("stack.json", new_stack)):
        with open(os.path.join(dst, fname), "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=1)  # the layout msprobe writes
    return len(new_data)


_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(cmd: list[str], out: str) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS in MB) of ``cmd`` as a fresh process (GNU time's %e, %U + %S, %M);
    ``out`` must hold a result file afterwards (a tool that failed is reported, never timed)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        proc = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", tf.name, *cmd], capture_output=True,
                              text=True, env=_ENV)
        if not any(f.endswith((".csv", ".db")) for f in os.listdir(out)):
            raise SystemExit(f"{' '.join(cmd)} wrote no result ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")
        wall, user, system, rss = tf.read().split()[-4:]
    return float(wall), float(user) + float(system), float(rss) / 1024


def run(cmd: list[str], folder: str) -> tuple[float, float, float]:
    out = tempfile.mkdtemp(dir=folder)
    try:
        return timed([*cmd, "-o", out], out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def best(runs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The fastest wall and CPU time and the largest peak memory of repeated runs."""
    return min(r[0] for r in runs), min(r[1] for r in runs), max(r[2] for r in runs)


def cell(r: tuple[float, float, float]) -> str:
    return f"{r[0]:>6.1f} s {r[1]:>6.1f} cpu {r[2]:>5.0f} MB"


def ratio(theirs: tuple, ours: tuple) -> str:
    return f"{theirs[0] / ours[0]:4.1f}x/{theirs[1] / ours[1]:4.1f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, nargs="+", default=[10_000, 30_000, 100_000])
    ap.add_argument("--tools", default="ours,msprobe", help="comma list: ours, msprobe")
    ap.add_argument("--graph", action="store_true", help="also time graph build+compare")
    ap.add_argument("--keep", help="keep the dumps under this folder")
    ap.add_argument("--repeat", type=int, default=1, help="runs per tool and size, the tools taking turns")
    ap.add_argument("--nonfinite", action="store_true",
                    help="softmax statistics as a masked attention dumps them: -Infinity, Infinity, NaN tokens")
    ap.add_argument("--json", help="also write the measurements here: per size, per job (compare, msprobe_compare, "
                                   "graph, msprobe_graph), [wall s, CPU s, peak MB] (benchmarks/floors.py reads it)")
    args = ap.parse_args()
    measured: dict = {}
    import msprobe_ci

    compileall.compile_dir(os.path.dirname(msprobe_ci.__file__), quiet=1)
    root = args.keep or tempfile.mkdtemp(prefix="msprobe-ci-scale-")
    bindir = os.path.dirname(sys.executable)
    ours = os.path.join(bindir, "msprobe-ci")
    theirs = shutil.which("msprobe", path=bindir) if "msprobe" in args.tools else None
    target0, bench0 = base_dumps(os.path.join(root, "base"))
    with open(os.path.join(target0, "dump.json"), encoding="utf-8") as fh:
        per_layer = sum(1 for v in [_layer(n, json.load(open(os.path.join(target0, "construct.json"))))
                                    for n in json.load(fh)["data"]] if v == 0)
    print(f"template: GPT-2 2 layers, mix statistics fwd+bwd, {per_layer} entries per block; torch CPU, "
          f"{os.cpu_count()} cores; best of {args.repeat}; ratios msprobe / msprobe-ci in wall/CPU time")
    w = len(cell((0, 0, 0)))
    head = f"{'entries':>9} {'dump MB':>8} | {'msprobe-ci compare':>{w}} | {'msprobe compare':>{w}} | {'ratio':>11}"
    if args.graph:
        head += f" | {'msprobe-ci graph':>{w}} | {'msprobe graph_visualize':>{w}} | {'ratio':>11}"
    print(head)
    for n in args.entries:
        layers = max(1, round(n / per_layer))
        folder = os.path.join(root, f"n{n}{'-nonfinite' if args.nonfinite else ''}")
        t, b = os.path.join(folder, "target", "step0", "rank"), os.path.join(folder, "bench", "step0", "rank")
        if not os.path.exists(os.path.join(t, "dump.json")):
            entries = deepen(target0, t, layers, args.nonfinite)
            deepen(bench0, b, layers, args.nonfinite)
        else:
            with open(os.path.join(t, "dump.json"), encoding="utf-8") as fh:
                entries = len(json.load(fh)["data"])
        mb = os.path.getsize(os.path.join(t, "dump.json")) / 2 ** 20
        line = f"{entries:>9} {mb:>8.1f}"
        t, b = os.path.dirname(t), os.path.dirname(b)  # step folders: what both tools take
        jobs = [("o", [ours, "compare", "-tp", t, "-gp", b])]
        if theirs:
            jobs.append(("m", [theirs, "compare", "-tp", t, "-gp", b]))
        if args.graph:
            jobs.append(("g", [ours, "graph", "-tp", t, "-gp", b]))
            if theirs:
                jobs.append(("mg", [theirs, "graph_visualize", "-tp", t, "-gp", b]))
        runs: dict[str, list] = {k: [] for k, _ in jobs}
        for _ in range(args.repeat):
            for k, cmd in jobs:
                runs[k].append(run(cmd, folder))
        r = {k: best(v) for k, v in runs.items()}
        names = {"o": "compare", "m": "msprobe_compare", "g": "graph", "mg": "msprobe_graph"}
        measured[str(n)] = {"entries": entries, "dump_mb": mb, **{names[k]: list(v) for k, v in r.items()}}
        line += f" | {cell(r['o'])}"
        line += f" | {cell(r['m'])} | {ratio(r['m'], r['o'])}" if theirs else f" | {'-':>{w}} | {'-':>11}"
        if args.graph:
            line += f" | {cell(r['g'])}"
            line += f" | {cell(r['mg'])} | {ratio(r['mg'], r['g'])}" if theirs else f" | {'-':>{w}} | {'-':>11}"
        print(line, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"nonfinite": args.nonfinite, "repeat": args.repeat, "sizes": measured}, fh, indent=1)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
