"""Our compare on msprobe's own fixture dumps reproduces msprobe's CSV metrics exactly."""

import csv
import glob
import os

import pytest

from _files import read_lines as _lines

from msprobe_ci.compare import compare_dumps
from msprobe_ci.dump import load_dump
from msprobe_ci.overflow import check_overflow

SKIP = {"Result", "Err_message", "NPU_Stack_Info"}


@pytest.mark.parametrize("mode", ["statistics", "tensor", "md5"])
def test_metrics_equal_msprobe_csv(fixtures_dir, tmp_path, mode):
    target = load_dump(os.path.join(fixtures_dir, f"bf16_{mode}", "step0", "proc0"))
    bench = load_dump(os.path.join(fixtures_dir, f"fp32_{mode}", "step0", "proc0"))
    report = compare_dumps(bench=bench, target=target)
    ours = list(csv.DictReader(_lines(report.write_csv(str(tmp_path)))))
    ref = list(csv.DictReader(_lines(os.path.join(fixtures_dir, "msprobe-outputs", f"compare_bf16_vs_fp32_{mode}.csv"))))
    assert [r["NPU Name"] for r in ours] == [r["NPU Name"] for r in ref]
    assert list(ours[0].keys()) == list(ref[0].keys())
    mismatches = [(r["NPU Name"], k, o[k], r[k]) for o, r in zip(ours, ref) for k in r if k not in SKIP and o[k] != r[k]]
    assert mismatches == []


def test_bf16_precision_loss_passes_where_msprobe_errors(fixtures_dir):
    target = load_dump(os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0"))
    bench = load_dump(os.path.join(fixtures_dir, "fp32_tensor", "step0", "proc0"))
    report = compare_dumps(bench=bench, target=target)
    assert report.first_divergence is None
    assert report.counts()["error"] == 0
    ref = list(csv.DictReader(_lines(os.path.join(fixtures_dir, "msprobe-outputs", "compare_bf16_vs_fp32_tensor.csv"))))
    assert sum(r["Result"] == "error" for r in ref) > 50  # msprobe blames the dtype on every bf16 row


def test_fuzzy_match_rows_equal_msprobe(fixtures_dir):
    target = load_dump(os.path.join(fixtures_dir, "bf16_statistics", "step0", "proc0"))
    bench = load_dump(os.path.join(fixtures_dir, "fp32_statistics", "step0", "proc0"))
    report = compare_dumps(bench=bench, target=target, fuzzy=True)
    ref = list(csv.DictReader(_lines(os.path.join(fixtures_dir, "msprobe-outputs",
                                                "compare_bf16_vs_fp32_statistics_fuzzy.csv"))))
    assert [r.target.name for r in report.rows] == [r["NPU Name"] for r in ref]
    # msprobe 26.2.0's -fm output pairs no row at all (every Bench Name is N/A); ours pairs what exact mode pairs
    assert all(r["Bench Name"] == "N/A" for r in ref)
    exact = compare_dumps(bench=bench, target=target)
    assert [r.bench.name for r in report.rows] == [r.bench.name for r in exact.rows]


def test_overflow_levels_match_msprobe_graph(fixtures_dir):
    import sqlite3

    dump = load_dump(os.path.join(fixtures_dir, "fp16_overflow_statistics", "step0", "proc0"))
    report = check_overflow(dump)
    assert report.first.name == "Tensor.__mul__.1.forward" and report.first.level == "critical"
    db = sqlite3.connect(os.path.join(fixtures_dir, "msprobe-outputs", "build_fp16_overflow.vis.db"))
    theirs = dict(db.execute("select node_name, overflow_level from tb_nodes where overflow_level is not null"))
    ours = {a.name: a.level for a in report.anomalies}
    assert {k: ours.get(k) for k in theirs} == theirs


@pytest.mark.parametrize("folder", sorted(glob.glob(os.path.join(
    os.path.dirname(__file__), "data", "msprobe-26.2.0", "tinynet", "*", "step*", "proc0"))))
def test_reader_loads_every_fixture(folder):
    dump = load_dump(folder)
    assert dump.data and dump.construct and dump.stack
