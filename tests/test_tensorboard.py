"""A real TensorBoard with tb-graph-ascend serves a .vis.db the plugin wrote for an example model with an injected
fault: the config loads, the root expands, node info carries our metrics, the precision-error screen lists the API.

TensorBoard runs as ``msprobe-ci view`` (a subprocess) on 127.0.0.1 and a free port, with tb-graph-ascend's plugin
only (mindstudio-probe registers a plugin under the same name, so plain ``tensorboard`` would refuse to start), and
is stopped by PID.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("server.plugin", reason="tb-graph-ascend (test extra) not installed")
pytest.importorskip("transformers")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fault_graphs(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "examples/test_gpt2.py::test_gpt2_forward", "--msprobe-target-dtype=bf16",
         "--msprobe-inject", "examples/faults/layer_norm.yaml", f"--msprobe-out={out}", "-p", "no:cacheprovider",
         "-q"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "first divergence at Functional.layer_norm.3.forward" in proc.stdout, proc.stdout
    return out / "graphs"


@pytest.fixture
def tensorboard(fault_graphs, tmp_path):
    yield from _serve(fault_graphs, tmp_path)


def _serve(logdir, tmp_path):
    port = _free_port()
    log = open(tmp_path / "tensorboard.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "msprobe_ci.cli", "view", str(logdir), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/data/plugin/graph_ascend/"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(base + "load_meta_dir", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((tmp_path / "tensorboard.log").read_text()[-2000:]) from None
                time.sleep(0.5)
        yield base
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@contextlib.contextmanager
def _opened(logdir, tmp_path, run):
    """A TensorBoard serving ``logdir``, with ``run``'s one graph loaded: yields (plugin base URL, metaData)."""
    serve = _serve(logdir, tmp_path)
    base = next(serve)
    try:
        (tag,) = _get(base + "load_meta_dir")["data"][run]["tags"]
        md = {"run": run, "tag": tag, "type": "db", "lang": "en", "microStep": -1, "rank": 0, "step": 0}
        assert _post(base + "loadGraphConfigInfo", {"metaData": md})["success"]
        yield base, md
    finally:
        serve.close()


def _get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _post(url, payload):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_tb_graph_ascend_serves_our_graph(tensorboard):
    meta = _get(tensorboard + "load_meta_dir")
    assert meta["error"] == []
    run = "test_gpt2.py_test_gpt2_forward.check0"
    (tag,) = meta["data"][run]["tags"]
    assert meta["data"][run]["type"] == "db" and tag.startswith("compare_")
    md = {"run": run, "tag": tag, "type": "db", "lang": "en", "microStep": -1, "rank": 0, "step": 0}

    config = _post(tensorboard + "loadGraphConfigInfo", {"metaData": md})
    assert config["success"] and config["data"]["isSingleGraph"] is False and config["data"]["overflowCheck"]

    root = _post(tensorboard + "changeNodeExpandState", {"nodeInfo": {"nodeName": "root", "nodeType": "NPU"},
                                                          "metaData": md})
    assert root["success"] and root["data"]["DefaultModel"]["isRoot"]
    assert "Module.transformer.GPT2Model.forward.0" in root["data"]

    info = _post(tensorboard + "getNodeInfo", {"nodeInfo": {"nodeName": "Functional.layer_norm.3.forward",
                                                            "nodeType": "NPU"}, "metaData": md})
    row = info["data"]["npu"]["output_data"]["Functional.layer_norm.3.forward.output.0"]
    assert row["Result"] == "error" and row["NormRelativeErr"].endswith("%") and "Max diff" in row
    assert "Functional.layer_norm.3.forward" in row["Err_message"]

    screen = _post(tensorboard + "screen", {"type": "precision", "values": [[0.6, 1]], "metaData": md})
    assert screen == {"success": True, "data": ["Functional.layer_norm.3.forward"]}


def test_tb_graph_ascend_opens_a_mindspore_against_pytorch_graph(tmp_path):
    from msprobe_ci.graph import compare_vis_db

    data = os.path.join(ROOT, "tests", "data", "msprobe-26.2.0")
    compare_vis_db(os.path.join(data, "mindspore-tinynet", "fp16_tensor", "step0", "proc0"),
                   os.path.join(data, "tinynet", "fp32_tensor", "step0", "proc0"), str(tmp_path / "logs" / "ms_vs_pt"))
    with _opened(tmp_path / "logs", tmp_path, "ms_vs_pt") as (base, md):
        root = _post(base + "changeNodeExpandState", {"nodeInfo": {"nodeName": "root", "nodeType": "NPU"},
                                                      "metaData": md})
        assert root["success"] and "Cell.fc1.Linear.forward.0" in root["data"]
        info = _post(base + "getNodeInfo", {"nodeInfo": {"nodeName": "Primitive.layer_norm.LayerNorm.0.forward",
                                                         "nodeType": "NPU"}, "metaData": md})
        row = info["data"]["npu"]["input_data"]["Primitive.layer_norm.LayerNorm.0.forward.input.1"]
        assert row["Result"] == "pass" and float(row["Cosine"]) > 0.9999  # gamma against PyTorch's weight
        screen = _post(base + "screen", {"type": "precision", "values": [[0.6, 1]], "metaData": md})
        assert screen == {"success": True, "data": []}  # fp16 rounding: nothing red


def test_tb_graph_ascend_opens_a_rank_merged_graph(tmp_path):
    """A DTensor TP=2 run merged against its one-rank bench: tb-graph-ascend opens the graph and shows a node's
    merge notes (parallel_merge_info) and its verdict."""
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(__file__))
    import _dist_workers

    from msprobe_ci.graph import compare_vis_db

    for world, side in ((2, "target"), (1, "bench")):
        mp.spawn(_dist_workers.dtensor_mlp, args=(world, _free_port(), str(tmp_path / side)), nprocs=world,
                 join=True)
    compare_vis_db(str(tmp_path / "target"), str(tmp_path / "bench"), str(tmp_path / "logs" / "tp2_vs_tp1"),
                   parallel=(None, None))
    with _opened(tmp_path / "logs", tmp_path, "tp2_vs_tp1") as (base, md):
        info = _post(base + "getNodeInfo", {"nodeInfo": {"nodeName": "Functional.linear.1.forward",
                                                         "nodeType": "NPU"}, "metaData": md})
        npu = info["data"]["npu"]
        assert any("partial sums on ranks [0, 1]" in line for line in npu["parallel_merge_info"]), npu
        assert npu["output_data"]["Functional.linear.1.forward.output.0"]["Result"] == "pass"
