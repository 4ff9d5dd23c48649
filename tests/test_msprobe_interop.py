"""Our dumps fed to msprobe's own ``msprobe compare``: it reads them, and every metric column it writes equals ours.

Needs the ``test`` extra (mindstudio-probe); skipped with the reason otherwise. msprobe runs as a subprocess, as a
user would run it, so its global API wrapping never touches this process.
"""

import csv
import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _files import read_lines as _lines
from conftest import TinyNet

from msprobe_ci import PrecisionDebugger
from msprobe_ci.compare import compare_dumps
from msprobe_ci.dump import load_dump

pytest.importorskip("msprobe", reason="mindstudio-probe (test extra) not installed")

SKIP = {"Result", "Err_message", "NPU_Stack_Info"}  # verdict columns: ours are dtype-aware on purpose


def _msprobe_cli():
    exe = os.path.join(os.path.dirname(sys.executable), "msprobe")
    return exe if os.path.exists(exe) else shutil.which("msprobe")


def _capture(tmp_path, dtype, task, summary_mode=None):
    torch.manual_seed(7)
    model = TinyNet().to(dtype)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = tmp_path / f"{dtype}_{task}_{summary_mode}"
    kwargs = {}
    if summary_mode:
        cfg = tmp_path / f"config_{summary_mode}.json"
        cfg.write_text('{"task": "statistics", "level": "mix", "statistics": {"summary_mode": "md5"}}')
        kwargs["config_path"] = str(cfg)
    dbg = PrecisionDebugger(dump_path=str(out), level="mix", task=task, **kwargs)
    dbg.start(model)
    model(x).float().pow(2).mean().backward()
    dbg.stop()
    dbg.step()
    return out / "step0" / "rank"


@pytest.mark.parametrize("task,summary_mode", [("statistics", None), ("tensor", None), ("statistics", "md5")])
def test_msprobe_compare_reads_our_dumps_with_equal_metrics(tmp_path, task, summary_mode):
    cli = _msprobe_cli()
    if cli is None:
        pytest.skip("the msprobe command is not on PATH")
    target = _capture(tmp_path, torch.bfloat16, task, summary_mode)
    bench = _capture(tmp_path, torch.float32, task, summary_mode)
    out = tmp_path / "msprobe-out"
    proc = subprocess.run([cli, "compare", "-tp", str(target / "dump.json"), "-gp", str(bench / "dump.json"),
                           "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (theirs_path,) = glob.glob(str(out / "compare_result_*.csv"))
    theirs = list(csv.DictReader(_lines(theirs_path)))
    report = compare_dumps(bench=load_dump(str(bench)), target=load_dump(str(target)))
    ours = list(csv.DictReader(_lines(report.write_csv(str(tmp_path / "ours")))))
    assert len(ours) == len(theirs) > 40
    assert [r["NPU Name"] for r in ours] == [r["NPU Name"] for r in theirs]
    assert list(ours[0]) == list(theirs[0])
    mismatches = [(t["NPU Name"], k, o[k], t[k]) for o, t in zip(ours, theirs) for k in t
                  if k not in SKIP and o[k] != t[k]]
    assert mismatches == []
    assert report.counts()["error"] == 0  # bf16 rounding explains every difference; msprobe's Result column errs


def test_msprobe_compare_reads_our_multi_rank_dumps(tmp_path):
    """A TP=2 run (gloo, two processes): msprobe pairs our rank folders and its rows and metrics equal ours."""
    import socket

    import torch.multiprocessing as mp

    import _dist_workers

    cli = _msprobe_cli()
    if cli is None:
        pytest.skip("the msprobe command is not on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_dist_workers.tp_mlp, args=(2, port, str(tmp_path / "o"), -1, (), False), nprocs=2, join=True)
    out = tmp_path / "msprobe-out"
    proc = subprocess.run([cli, "compare", "-tp", str(tmp_path / "o" / "target" / "step0"),
                           "-gp", str(tmp_path / "o" / "bench" / "step0"), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in (0, 1):
        (theirs_path,) = glob.glob(str(out / f"compare_result_rank{rank}_*.csv"))
        theirs = list(csv.DictReader(_lines(theirs_path)))
        rank_dir = tmp_path / "o" / "{}" / "step0" / f"rank{rank}"
        report = compare_dumps(bench=load_dump(str(rank_dir).format("bench")),
                               target=load_dump(str(rank_dir).format("target")))
        ours = list(csv.DictReader(_lines(report.write_csv(str(tmp_path / f"ours{rank}")))))
        assert [r["NPU Name"] for r in ours] == [r["NPU Name"] for r in theirs]
        assert "Distributed.all_reduce.0.forward.output.0" in {r["NPU Name"] for r in ours}
        mismatches = [(t["NPU Name"], k, o[k], t[k]) for o, t in zip(ours, theirs) for k in t
                      if k not in SKIP and o[k] != t[k]]
        assert mismatches == []


def test_msprobe_graph_merger_reads_our_tp_dumps(tmp_path):
    """msprobe's own TP graph merging (``graph_visualize --rank_size 2 1 --tp 2 1``) reads our TP=2 dumps against
    a one-rank bench, and where both tools merge a node (the column-parallel fc1's weight and output shards) the
    merged statistics agree with ours."""
    import json
    import socket
    import sqlite3

    import torch.multiprocessing as mp

    import _dist_workers
    from msprobe_ci.compare.merge import Parallel, merged_pairs

    cli = _msprobe_cli()
    if cli is None:
        pytest.skip("the msprobe command is not on PATH")
    for world in (2, 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_dist_workers.tp_mlp, args=(world, port, str(tmp_path / f"w{world}"), -1, (), False),
                 nprocs=world, join=True)
    target, bench = tmp_path / "w2" / "target" / "step0", tmp_path / "w1" / "bench" / "step0"
    proc = subprocess.run([cli, "graph_visualize", "-tp", str(target), "-gp", str(bench), "-o", str(tmp_path / "g"),
                           "--rank_size", "2", "1", "--tp", "2", "1", "--pp", "1", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (db,) = glob.glob(str(tmp_path / "g" / "*.vis.db"))
    with sqlite3.connect(db) as c:
        theirs = {n: (json.loads(i or "{}"), json.loads(o or "{}")) for n, i, o in c.execute(
            "SELECT node_name, input_data, output_data FROM tb_nodes WHERE data_source = 'NPU'")}
    ((_, _, ours, _),) = merged_pairs(str(target), str(bench), Parallel(2, 2, 1), Parallel(1))
    entry = ours.dump.data["Module.fc1.Linear.forward.0"]
    their_in, their_out = theirs["Module.fc1.Linear.forward.0"]
    for rec, row in ((entry["parameters"]["weight"], their_in["Module.fc1.Linear.forward.0.parameters.weight"]),
                     (entry["output"][0], their_out["Module.fc1.Linear.forward.0.output.0"])):
        for k in ("Max", "Min", "Mean", "Norm"):
            assert float(row[k]) == pytest.approx(rec[k], rel=1e-2), (k, row, rec)
