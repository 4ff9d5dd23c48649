"""MindSpore dumps made by msprobe 26.2.0 (tests/data/msprobe-26.2.0/mindspore-tinynet, the same TinyNet on the same
numbers as ../tinynet): read, compare MindSpore against MindSpore (msprobe's CSVs and graphs are the oracle) and
against PyTorch with no mapping file, replay, overflow, and the pytest gate."""

import csv
import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing

import numpy as np
import pytest

from _files import read_lines as _lines

from msprobe_ci import MsprobeError
from msprobe_ci.compare import compare_dumps
from msprobe_ci.dump import load_dump
from msprobe_ci.graph import build_vis_db, compare_vis_db
from msprobe_ci.overflow import check_overflow
from msprobe_ci.replay import ApiReplayer

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "msprobe-26.2.0")
MS = os.path.join(DATA, "mindspore-tinynet")
PT = os.path.join(DATA, "tinynet")
OUTS = os.path.join(MS, "msprobe-outputs")
SKIP = {"Result", "Err_message", "NPU_Stack_Info"}
STAT_DIFFS = {"Max diff", "Min diff", "Mean diff", "L2norm diff", "MaxRelativeErr", "MinRelativeErr",
              "MeanRelativeErr", "NormRelativeErr"}


def _ms(name):
    return os.path.join(MS, name, "step0", "proc0")


def _pt(name):
    return os.path.join(PT, name, "step0", "proc0")


def _csv(path):
    return list(csv.DictReader(_lines(path)))


def _close(a, b):
    try:
        return math.isclose(float(a.rstrip("%")), float(b.rstrip("%")), rel_tol=1e-9, abs_tol=1e-15)
    except ValueError:
        return False


@pytest.mark.parametrize("folder", sorted(d for d in os.listdir(MS) if d != "msprobe-outputs" and
                                          os.path.isdir(os.path.join(MS, d))))
def test_every_mindspore_fixture_reads(folder):
    for step in sorted(os.listdir(os.path.join(MS, folder))):
        dump = load_dump(os.path.join(MS, folder, step, "proc0"))
        assert dump.framework == "mindspore" and dump.construct and dump.stack
        assert any(k.startswith("Cell.") for k in dump.data) and any(k.startswith("Primitive.") for k in dump.data)
        if dump.task == "tensor":
            rec = dump.data["Primitive.dense.Dense.0.forward"]["output"][0]
            t = dump.load_tensor(rec["data_name"], rec["shape"])
            assert list(t.shape) == rec["shape"] and str(t.dtype).endswith(rec["dtype"].lower())


def test_npy_with_objects_is_refused_not_unpickled(tmp_path):
    shutil.copytree(_ms("fp32_tensor"), tmp_path / "d")
    f = tmp_path / "d" / "dump_tensor_data" / "Primitive.relu.ReLU.0.forward.output.0.npy"
    np.save(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    dump = load_dump(str(tmp_path / "d"))
    rec = dump.data["Primitive.relu.ReLU.0.forward"]["output"][0]
    with pytest.raises(MsprobeError, match=r"ReLU.0.forward.output.0.npy: not a loadable .npy tensor file"):
        dump.load_tensor(rec["data_name"])


@pytest.mark.parametrize("mode", ["statistics", "tensor", "md5"])
def test_same_framework_rows_and_metrics_equal_msprobe(tmp_path, mode):
    report = compare_dumps(bench=load_dump(_ms(f"fp32_{mode}")), target=load_dump(_ms(f"fp16_{mode}")))
    ours = _csv(report.write_csv(str(tmp_path)))
    ref = _csv(os.path.join(OUTS, f"compare_ms_fp16_vs_ms_fp32_{mode}.csv"))
    assert [r["NPU Name"] for r in ours] == [r["NPU Name"] for r in ref] and len(ref) == 107
    assert list(ours[0]) == list(ref[0])
    bad = [(r["NPU Name"], k, o[k], r[k]) for o, r in zip(ours, ref) for k in r if k not in SKIP and o[k] != r[k]
           # msprobe's MindSpore statistics diffs differ from the exact double differences in the last digits
           and not (k in STAT_DIFFS and _close(o[k], r[k]))]
    assert bad == []
    # Float16 against Float32 is rounding, not an error (msprobe marks 65 rows error for the dtype alone)
    assert report.first_divergence is None and report.counts()["error"] == 0
    if mode != "md5":
        assert sum(r["Result"] == "error" for r in ref) == 65


@pytest.mark.parametrize("db, target, bench", [
    ("build_ms_fp32_statistics", "fp32_statistics", None),
    ("compare_ms_fp16_vs_ms_fp32_statistics", "fp16_statistics", "fp32_statistics"),
])
def test_graphs_have_msprobe_structure(tmp_path, db, target, bench):
    ours = build_vis_db(_ms(target), str(tmp_path)) if bench is None else \
        compare_vis_db(_ms(target), _ms(bench), str(tmp_path))
    theirs = os.path.join(OUTS, f"{db}.vis.db")
    cols = "node_name, up_node, sub_nodes, node_type, node_order, matched_node_link"
    for source in (["NPU"] if bench is None else ["NPU", "Bench"]):
        q = f"select {cols} from tb_nodes where data_source = ? order by node_name"
        with closing(sqlite3.connect(ours)) as a, closing(sqlite3.connect(theirs)) as b:
            mine, ref = a.execute(q, (source,)).fetchall(), b.execute(q, (source,)).fetchall()
        assert mine == ref and len(ref) == 44


def test_overflow_first_node_in_a_mindspore_dump():
    report = check_overflow(load_dump(_ms("fp16_overflow_statistics")))
    assert report.has_overflow and report.first.name == "Tensor.__mul__.1.forward"
    assert report.first.level == "critical"
    assert not check_overflow(load_dump(_ms("fp16_statistics"))).has_overflow


# --------------------------------------------------------------------------- MindSpore against PyTorch
def _pairs(report):
    return {r.target.name: r.bench.name for r in report.rows if r.bench is not None}


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_cross_framework_matches_what_msprobe_needs_a_79_entry_file_for(mode):
    report = compare_dumps(bench=load_dump(_pt(f"fp32_{mode}")), target=load_dump(_ms(f"fp32_{mode}")))
    ours = _pairs(report)
    ref = {r["NPU Name"]: r["Bench Name"] for r in _csv(os.path.join(OUTS, f"compare_ms_fp32_vs_pt_fp32_{mode}_dm.csv"))
           if r["Bench Name"] != "N/A"}
    assert len(ref) == 80 and len(ours) >= 80
    # every pair msprobe made with the hand-written -dm file, but the gradient PyTorch never computed (null)
    assert {k: v for k, v in ref.items() if ours.get(k) != v} == {
        "Tensor.__sub__.0.backward.output.1": "Tensor.__sub__.0.backward.output.1"}
    # and the transposed weight gradients msprobe's file leaves out (PyTorch's linear hands back dW^T)
    assert ours["Primitive.dense.Dense.0.backward.output.1"] == "Functional.linear.0.backward.output.2"
    assert ours["Cell.norm.LayerNorm.parameters_grad.0.gamma"] == "Module.norm.LayerNorm.parameters_grad.0.weight"
    assert ours["Primitive.layer_norm.LayerNorm.0.forward.input.1"] == "Functional.layer_norm.0.forward.input.2"
    # no false errors (msprobe: every matched row "error" for Float32 != torch.float32 and requires_grad N/A)
    assert report.counts()["error"] == 0 and report.first_divergence is None
    reverse = compare_dumps(bench=load_dump(_ms(f"fp32_{mode}")), target=load_dump(_pt(f"fp32_{mode}")))
    assert _pairs(reverse) == {v: k for k, v in ours.items()}
    assert reverse.counts()["error"] == 0


def test_classic_dense_matmul_plus_bias_add_is_one_linear():
    """nn.Dense dumps MatMul then BiasAdd; PyTorch has one F.linear: the table's fused rule pairs them."""
    report = compare_dumps(bench=load_dump(_pt("fp32_statistics")), target=load_dump(_ms("nn_fp32_statistics")))
    ours = _pairs(report)
    assert len(ours) >= 80 and report.counts()["error"] == 0
    assert ours["Primitive.matmul.MatMul.1.forward.input.1"] == "Functional.linear.1.forward.input.1"
    assert ours["Primitive.bias_add.BiasAdd.1.forward.input.1"] == "Functional.linear.1.forward.input.2"
    assert ours["Primitive.bias_add.BiasAdd.1.forward.output.0"] == "Functional.linear.1.forward.output.0"
    assert "Primitive.matmul.MatMul.1.forward.output.0" not in ours  # the intermediate x @ W^T has no twin
    assert ours["Primitive.matmul.MatMul.1.backward.output.0"] == "Functional.linear.1.backward.output.2"  # dW^T
    assert ours["Cell.fc1.Dense.forward.0.output.0"] == "Module.fc1.Linear.forward.0.output.0"


def test_cross_framework_fault_is_named(tmp_path):
    shutil.copytree(_ms("fp16_tensor"), tmp_path / "t")
    f = tmp_path / "t" / "dump_tensor_data" / "Primitive.layer_norm.LayerNorm.0.forward.output.0.npy"
    a = np.load(f)
    np.save(f, (a * 1.02).astype(a.dtype))
    report = compare_dumps(bench=load_dump(_pt("fp32_tensor")), target=load_dump(str(tmp_path / "t")))
    assert report.first_divergence.name == "Primitive.layer_norm.LayerNorm.0.forward"
    clean = compare_dumps(bench=load_dump(_pt("fp32_tensor")), target=load_dump(_ms("fp16_tensor")))
    assert clean.first_divergence is None


def test_cli_cross_framework_with_and_without_msprobe_mapping_files(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "msprobe_ci.cli", *args], capture_output=True, text=True)

    base = ["-tp", os.path.join(MS, "fp32_tensor", "step0"), "-gp", os.path.join(PT, "fp32_tensor", "step0")]
    r = run("compare", *base, "-o", str(tmp_path / "a"))
    assert r.returncode == 0 and "error 0" in r.stdout, r.stderr
    r = run("compare", *base, "-o", str(tmp_path / "b"), "-dm", os.path.join(OUTS, "data_mapping_ms_to_pt.yaml"),
            "-lm", os.path.join(OUTS, "layer_mapping_ms_to_pt.yaml"))
    assert r.returncode == 0, r.stderr
    rows = _csv(os.path.join(tmp_path / "b", os.listdir(tmp_path / "b")[0]))
    assert sum(r["Bench Name"] != "N/A" for r in rows) >= 80
    assert {r["Requires_grad Consistent"] for r in rows if r["Bench Name"] != "N/A"} == {"True"}
    (tmp_path / "bad.yaml").write_text("- a list\n")
    r = run("compare", *base, "-o", str(tmp_path / "c"), "-dm", str(tmp_path / "bad.yaml"))
    assert r.returncode == 2 and "bad.yaml: -dm mapping file: expected a mapping, got list" in r.stderr
    r = run("graph", *base, "-o", str(tmp_path / "g" / "run"))
    assert r.returncode == 0, r.stderr
    db = os.path.join(tmp_path / "g" / "run", os.listdir(tmp_path / "g" / "run")[0])
    with closing(sqlite3.connect(db)) as c:
        linked = c.execute("select count(*) from tb_nodes where data_source = 'NPU' and matched_node_link "
                           "not in ('[]', '') and precision_index is not null").fetchone()[0]
        red = c.execute("select count(*) from tb_nodes where precision_index = 1").fetchone()[0]
    with closing(sqlite3.connect(os.path.join(OUTS, "compare_ms_fp32_vs_pt_fp32_tensor_lm.vis.db"))) as c:
        theirs = c.execute("select count(*) from tb_nodes where data_source = 'NPU' and matched_node_link "
                           "not in ('[]', '')").fetchone()[0]
    assert linked > theirs and red == 0  # msprobe links 27 nodes and colours 22 red for the dtype spelling


def test_replay_of_a_mindspore_dump():
    rep = ApiReplayer(load_dump(_ms("fp32_tensor")))
    got = {n: rep.check(n) for n in rep.api_names()}
    # Tensor methods and the primitives with a same-argument PyTorch twin replay, forward and backward
    for name in ("Tensor.__sub__.0.backward", "Primitive.dense.Dense.1.backward", "Primitive.dense.Dense.0.forward",
                 "Primitive.relu.ReLU.0.backward", "Tensor.__mul__.1.forward"):
        assert got[name].status == "pass", (name, got[name].message)
    assert got["Primitive.layer_norm.LayerNorm.0.forward"].status == "skip"  # different arguments: said
    assert not [n for n, r in got.items() if r.status == "error"]


GATE = """
import os

DATA = {data!r}


def test_mindspore_run_against_pytorch_bench(msprobe):
    msprobe.compare_dumps(os.path.join(DATA, "mindspore-tinynet", "fp16_statistics", "step0", "proc0"),
                          os.path.join(DATA, "tinynet", "fp32_statistics", "step0", "proc0"))


def test_broken_mindspore_run(msprobe, tmp_path):
    import json, shutil
    src = os.path.join(DATA, "mindspore-tinynet", "fp16_statistics", "step0", "proc0")
    shutil.copytree(src, tmp_path / "t")
    doc = json.loads((tmp_path / "t" / "dump.json").read_text())
    rec = doc["data"]["Primitive.relu.ReLU.0.forward"]["output"][0]
    rec["Max"] *= 1.05
    rec["Norm"] *= 1.05
    (tmp_path / "t" / "dump.json").write_text(json.dumps(doc))
    msprobe.compare_dumps(str(tmp_path / "t"), os.path.join(DATA, "tinynet", "fp32_statistics", "step0", "proc0"))
"""


def test_pytest_gates_a_mindspore_run_against_a_pytorch_bench(pytester):
    pytester.makepyfile(test_gate=GATE.format(data=DATA))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-junitxml=j.xml")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at Primitive.relu.ReLU.0.forward*"])
    text = (pytester.path / "j.xml").read_text()
    assert "Primitive.dense.Dense.0.forward" in text and "Cell.fc1.Linear.forward.0" in text
    results = [json.loads(p.read_text()) for p in (pytester.path / "msprobe-out").rglob("msprobe-result.json")]
    assert {r["target"].split(" ")[0] for r in results} == {"dump"}
