"""Graphs: parity with msprobe's own .vis.db files, our verdict colours, schema, steps/ranks, bad inputs, CLI."""

import json
import os
import shutil
import sqlite3
from contextlib import closing

import pytest
from _files import read_json

from msprobe_ci import MsprobeError
from msprobe_ci.cli import main as cli_main
from msprobe_ci.dump import load_dump
from msprobe_ci.graph import build_graph, build_vis_db, compare_vis_db, write_vis_db
from msprobe_ci.graph.db import INDEXES, SCHEMA

CORE = ("type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad", "data_name", "value")


def _rows(db, source):
    with closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        return {r["node_name"]: dict(r) for r in conn.execute("select * from tb_nodes where data_source=?", (source,))}


def _core(data):
    return {k: {f: v for f, v in row.items() if f in CORE} for k, row in json.loads(data).items()}


@pytest.mark.parametrize("db, target, bench", [
    ("build_fp32_statistics", "fp32_statistics", None),
    ("build_fp16_overflow", "fp16_overflow_statistics", None),
    ("compare_bf16_vs_fp32_statistics", "bf16_statistics", "fp32_statistics"),
    ("compare_bf16_vs_fp32_tensor", "bf16_tensor", "fp32_tensor"),
    ("compare_bf16_vs_fp32_md5", "bf16_md5", "fp32_md5"),
])
def test_same_graph_as_msprobe(fixtures_dir, tmp_path, db, target, bench):
    tp = os.path.join(fixtures_dir, target, "step0", "proc0")
    if bench is None:
        ours = build_vis_db(tp, str(tmp_path), overflow=db.endswith("overflow"))
    else:
        ours = compare_vis_db(tp, os.path.join(fixtures_dir, bench, "step0", "proc0"), str(tmp_path))
    theirs = os.path.join(fixtures_dir, "msprobe-outputs", f"{db}.vis.db")
    for source in (["NPU"] if bench is None else ["NPU", "Bench"]):
        o, t = _rows(ours, source), _rows(theirs, source)
        assert set(o) == set(t) and len(o) == 47
        for name in t:
            for col in ("up_node", "sub_nodes", "node_type", "node_order", "micro_step_id", "overflow_level",
                        "matched_node_link"):
                if col == "overflow_level" and ".parameters_grad" in name:
                    continue  # msprobe leaves gradient nodes unchecked; ours mark their NaN/Inf (critical)
                assert (name, col, o[name][col]) == (name, col, t[name][col])
            assert _core(o[name]["input_data"]) == _core(t[name]["input_data"]), name
            assert _core(o[name]["output_data"]) == _core(t[name]["output_data"]), name
    with closing(sqlite3.connect(ours)) as a, closing(sqlite3.connect(theirs)) as b:
        q = "select graph_type, task, micro_steps, overflow_check, rank_list, step_list from tb_config"
        assert a.execute(q).fetchall() == b.execute(q).fetchall()


def test_a_check_hands_its_overflow_reports_to_the_graph(fixtures_dir, tmp_path, monkeypatch):
    """The check scans each dump for overflow once, for its verdict, and hands both reports to the graph
    (``write_compare_graph(..., found=...)``): the nodes' overflow levels are those reports', with no second scan;
    without them the graph scans the dumps itself, to the same levels."""
    import msprobe_ci.graph.service as service
    from msprobe_ci.compare import compare_dumps
    from msprobe_ci.graph.service import write_compare_graph
    from msprobe_ci.overflow import check_overflow

    target = load_dump(os.path.join(fixtures_dir, "fp16_overflow_statistics", "step0", "proc0"))
    bench = load_dump(os.path.join(fixtures_dir, "fp32_statistics", "step0", "proc0"))
    report = compare_dumps(bench=bench, target=target)
    found = (check_overflow(target), check_overflow(bench))
    assert found[0].has_overflow
    scanned = write_compare_graph(target, bench, report, str(tmp_path / "scanned"))

    def refuse(dump):
        raise AssertionError("scanned again")
    monkeypatch.setattr(service, "check_overflow", refuse)
    handed = write_compare_graph(target, bench, report, str(tmp_path / "handed"), found=found)
    levels = {n: r["overflow_level"] for n, r in _rows(handed, "NPU").items()}
    assert levels == {n: r["overflow_level"] for n, r in _rows(scanned, "NPU").items()}
    assert {a.name: a.level for a in found[0].anomalies if a.name in levels} == \
        {n: lv for n, lv in levels.items() if lv} != {}


def test_colours_come_from_our_verdicts(fixtures_dir, tmp_path):
    db = compare_vis_db(os.path.join(fixtures_dir, "bf16_statistics", "step0", "proc0"),
                        os.path.join(fixtures_dir, "fp32_statistics", "step0", "proc0"), str(tmp_path))
    npu = _rows(db, "NPU")
    theirs = _rows(os.path.join(fixtures_dir, "msprobe-outputs", "compare_bf16_vs_fp32_statistics.vis.db"), "NPU")
    assert sum(r["precision_index"] == 1 for r in theirs.values()) > 20  # msprobe: the dtype alone is an error
    assert {r["precision_index"] for r in npu.values()} <= {0, None}    # ours: bf16 rounding passes
    assert npu["DefaultModel"]["precision_index"] is None
    assert all(r["precision_index"] is None for r in _rows(db, "Bench").values())
    out = json.loads(npu["Functional.linear.0.forward"]["output_data"])["Functional.linear.0.forward.output.0"]
    assert out["Result"] == "pass" and out["MaxRelativeErr"].endswith("%") and "Max diff" in out


def test_injected_fault_is_red_on_the_api_and_its_module(tmp_path, tinynet):
    import torch

    from msprobe_ci import PrecisionDebugger
    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.config import DumpConfig

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "bench"), level="mix")
    dbg.start(tinynet)
    tinynet(x).pow(2).mean().backward()
    dbg.stop()
    tinynet.zero_grad()
    cap = CaptureSession(DumpConfig(dump_path=str(tmp_path / "target"), level="mix"),
                         faults=[Fault("Functional.layer_norm", 0, "forward", "scale", 1.05)])
    cap.start(tinynet)
    tinynet(x).pow(2).mean().backward()
    cap.stop()
    cap.close()
    db = compare_vis_db(str(tmp_path / "target"), str(tmp_path / "bench"), str(tmp_path / "out"))
    npu = _rows(db, "NPU")
    red = {n for n, r in npu.items() if r["precision_index"] == 1}
    assert red == {"Functional.layer_norm.0.forward", "Module.norm.LayerNorm.forward.0"}
    assert npu["Functional.linear.1.forward"]["precision_index"] == 0


def test_schema_config_and_stacks(fixtures_dir, tmp_path):
    db = compare_vis_db(os.path.join(fixtures_dir, "bf16_statistics_2steps"),
                        os.path.join(fixtures_dir, "fp32_statistics_2steps"), str(tmp_path))
    with closing(sqlite3.connect(db)) as conn:
        sql = {r[0]: " ".join(r[1].split()) for r in conn.execute("select name, sql from sqlite_master where sql is not null")}
        expected = [" ".join(s.split()) for s in (SCHEMA + INDEXES).split(";") if s.strip()]
        assert sorted(sql.values()) == sorted(expected)
        assert conn.execute("select rank_list, step_list, graph_type from tb_config").fetchone() == ("[0]", "[0, 1]", "compare")
        graphs = [r[0] for r in conn.execute("select distinct graph_id from tb_nodes order by 1")]
        assert graphs == ["Bench_0_0", "Bench_1_0", "NPU_0_0", "NPU_1_0"]
        assert conn.execute("select count(*) from tb_nodes n left join tb_stack s on n.stack_id = s.id "
                            "where s.id is null").fetchone() == (0,)
        assert conn.execute("select count(*) from tb_nodes where up_node = ''").fetchone() == (4,)
        assert conn.execute("pragma journal_mode").fetchone() == ("wal",)
    assert not [f for f in os.listdir(tmp_path) if not f.endswith(".vis.db")]  # no -wal/-shm/tmp left
    assert oct(os.stat(db).st_mode & 0o022) == "0o0"  # the viewer refuses group/other-writable files


def _copy_rank(fixtures_dir, tmp_path):
    src = os.path.join(fixtures_dir, "fp32_statistics", "step0", "proc0")
    dst = tmp_path / "rank"
    shutil.copytree(src, dst)
    return dst


def test_bad_inputs(fixtures_dir, tmp_path):
    rank = _copy_rank(fixtures_dir, tmp_path)
    construct = read_json(rank / "construct.json")
    (rank / "construct.json").write_text("{}")
    with pytest.raises(MsprobeError, match=r"construct.json: missing or empty; a graph needs the module structure, "
                                           r"dump with level L0 or mix"):
        build_graph(load_dump(str(rank)))
    bad = dict(construct, **{"Functional.linear.0.forward": "Module.nowhere.forward.0"})
    (rank / "construct.json").write_text(json.dumps(bad))
    with pytest.raises(MsprobeError, match=r"'Functional.linear.0.forward' has parent 'Module.nowhere.forward.0', "
                                           r"which is not in construct.json"):
        build_graph(load_dump(str(rank)))
    loop = dict(construct, **{"Module.fc1.Linear.forward.0": "Functional.linear.0.forward"})
    (rank / "construct.json").write_text(json.dumps(loop))
    with pytest.raises(MsprobeError, match=r"cycle in construct.json: Functional.linear.0.forward -> "
                                           r"Module.fc1.Linear.forward.0 -> Functional.linear.0.forward"):
        build_graph(load_dump(str(rank)))
    (rank / "construct.json").write_text(json.dumps(construct))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(MsprobeError, match=r"afile: output folder exists and is a file, expected a folder"):
        build_vis_db(str(rank), str(tmp_path / "afile"))


def test_failed_write_leaves_no_file(fixtures_dir, tmp_path):
    graph = build_graph(load_dump(os.path.join(fixtures_dir, "fp32_statistics", "step0", "proc0")))
    graph.nodes["DefaultModel"].input_data = {"x": {"bad": object()}}  # not JSON: fails mid-write
    out = tmp_path / "g"
    out.mkdir()
    with pytest.raises(TypeError):
        write_vis_db(str(out / "build.vis.db"), [graph], compare=False)
    assert list(out.iterdir()) == []


def test_cli_graph(fixtures_dir, tmp_path, capsys):
    tp = os.path.join(fixtures_dir, "bf16_statistics", "step0")
    gp = os.path.join(fixtures_dir, "fp32_statistics", "step0")
    assert cli_main(["graph", "-tp", tp, "-gp", gp, "-o", str(tmp_path / "o"), "-oc"]) == 0
    path = capsys.readouterr().out.splitlines()[0]
    assert os.path.basename(path).startswith("compare_") and path.endswith(".vis.db") and os.path.isfile(path)
    assert cli_main(["graph", "-tp", str(tmp_path / "missing"), "-o", str(tmp_path / "o")]) == 2
    assert "missing: no such dump folder" in capsys.readouterr().err


def test_fuzzy_matching_pairs_renumbered_apis(fixtures_dir, tmp_path):
    from msprobe_ci.compare import compare_dumps
    from msprobe_ci.graph import compare_graphs

    target = load_dump(os.path.join(fixtures_dir, "bf16_statistics", "step0", "proc0"))
    bench = load_dump(os.path.join(fixtures_dir, "fp32_statistics", "step0", "proc0"))
    t, b = build_graph(target), build_graph(bench, data_source="Bench")
    # renumber one bench API as another framework version might: fuzzy still pairs it, exact does not
    node = b.nodes.pop("Functional.linear.0.forward")
    node.name = "Functional.linear.7.forward"
    b.nodes[node.name] = node
    parent = b.nodes[node.parent]
    parent.children = [node.name if c == "Functional.linear.0.forward" else c for c in parent.children]
    report = compare_dumps(bench=bench, target=target, fuzzy=True)
    pairs = compare_graphs(t, b, report, fuzzy=True)
    assert pairs["Functional.linear.0.forward"] == "Functional.linear.7.forward"
    assert t.nodes["Functional.linear.0.forward"].matched_link[-1] == "Functional.linear.7.forward"
    assert b.nodes["Functional.linear.7.forward"].matched_link[-1] == "Functional.linear.0.forward"
    t2 = build_graph(target)
    for n in b.nodes.values():
        n.matched_link = []
    exact = compare_graphs(t2, b, compare_dumps(bench=bench, target=target))  # exact matching needs the same name
    assert "Functional.linear.0.forward" not in exact and not t2.nodes["Functional.linear.0.forward"].matched_link
    assert exact["Functional.relu.0.forward"] == "Functional.relu.0.forward"


def test_error_four_levels_down_is_red_all_the_way_up(tmp_path):
    import torch

    from msprobe_ci import PrecisionDebugger
    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.config import DumpConfig

    class Sign(torch.nn.Module):  # hides the fault from every box above: their outputs match the bench exactly
        def forward(self, h):
            return torch.sign(h)

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), Sign())
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Sequential(inner)), torch.nn.Linear(8, 4))
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "bench"), level="mix")
    dbg.start(model)
    model(x).sum().backward()
    dbg.stop()
    model.zero_grad()
    cap = CaptureSession(DumpConfig(dump_path=str(tmp_path / "target"), level="mix"),
                         faults=[Fault("Functional.layer_norm", 0, "forward", "scale", 1.05)])
    cap.start(model)
    model(x).sum().backward()
    cap.stop()
    cap.close()
    db = compare_vis_db(str(tmp_path / "target"), str(tmp_path / "bench"), str(tmp_path / "out"))
    with closing(sqlite3.connect(db)) as conn:
        rows = {n: (p, up) for n, p, up in conn.execute(
            "select node_name, precision_index, up_node from tb_nodes where data_source = 'NPU'")}
    node, chain = "Functional.layer_norm.0.forward", []
    while node in rows and rows[node][1]:
        chain.append(node)
        node = rows[node][1]
    assert len(chain) >= 4, chain  # API, LayerNorm, inner Sequential ... up to the top-level box
    assert all(rows[n][0] == 1 for n in chain), {n: rows[n][0] for n in chain}


def test_node_data_text_rounds_decimals_as_msprobe():
    """Node-data text: a decimal string (optionally a percentage) with more than 6 decimals is rounded to 6, as
    msprobe's ``^(\\d+\\.\\d+)(%?)$`` rule does; everything else is kept (string methods, checked against the regex
    on random text, float reprs and percentages)."""
    import re

    from hypothesis import given, settings, strategies as st

    from msprobe_ci.graph.compare import _text

    rule = re.compile(r"^(\d+\.\d+)(%?)$")

    def reference(v):
        if v is None:
            return "null"
        if type(v) is not str:
            return str(v)
        m = rule.match(v) if len(v) > 8 else None
        if m and len(m.group(1)) - m.group(1).index(".") > 7:
            return f"{float(m.group(1)):.6f}{m.group(2)}"
        return v

    @settings(max_examples=3000, deadline=None)
    @given(st.one_of(st.text(alphabet="0123456789.%\n-e ٣²x", max_size=14), st.floats().map(lambda f: f"{f}%"),
                     st.floats().map(repr), st.floats(), st.none(), st.integers()))
    def check(v):
        assert _text(v) == reference(v)

    check()
    assert _text("0.1379868487607486%") == "0.137987%"
    assert _text("12.5%") == "12.5%" and _text("1.5e-07%") == "1.5e-07%"
