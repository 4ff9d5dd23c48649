import os
import re
import subprocess
import sys


def _run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "msprobe_ci.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_compare_cli_writes_csv(fixtures_dir, tmp_path):
    r = _run("compare", "-tp", os.path.join(fixtures_dir, "bf16_statistics", "step0"),
             "-gp", os.path.join(fixtures_dir, "fp32_statistics", "step0"), "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].startswith("compare_result_") and files[0].endswith(".csv")
    assert "first divergence: none" in r.stdout


def test_compare_cli_pairs_steps_of_dump_roots(fixtures_dir, tmp_path):
    r = _run("compare", "-tp", os.path.join(fixtures_dir, "bf16_statistics_2steps"),
             "-gp", os.path.join(fixtures_dir, "fp32_statistics_2steps"), "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert sorted(f.rsplit("_", 1)[0] for f in os.listdir(tmp_path)) == [
        "compare_result_step0_rank0", "compare_result_step1_rank0"]


def test_overflow_cli(fixtures_dir, tmp_path):
    r = _run("overflow", "-i", os.path.join(fixtures_dir, "fp16_overflow_statistics", "step0"), "-o", str(tmp_path))
    assert r.returncode == 1
    assert "first overflow: Tensor.__mul__.1.forward: critical" in r.stdout


def test_cli_bad_path_is_one_line(tmp_path):
    r = _run("compare", "-tp", str(tmp_path / "nope"), "-gp", str(tmp_path), "-o", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no such dump file or folder" in r.stderr


def _dumps(tmp_path, isolate):
    import torch

    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(4)])
    x = torch.randn(8, 32)
    folders = {}
    for side, faults in (("bench", ()), ("target", (Fault("Functional.linear", 1, "forward", "scale", 1.1),))):
        cap = CaptureSession(DumpConfig(task="statistics", level="mix", dump_path=str(tmp_path / side)),
                             faults=faults, isolator=Isolator() if isolate and side == "target" else None)
        cap.start(model)
        model(x).sum().backward()
        cap.stop()
        cap.close()
        folders[side] = cap.folders[0]
    return folders


def test_compare_cli_blames_the_first_cause_only(tmp_path):
    d = _dumps(tmp_path, isolate=False)
    r = _run("compare", "-tp", d["target"], "-gp", d["bench"], "-o", str(tmp_path / "out"))
    assert r.returncode == 1
    assert "first divergence: Functional.linear.1.forward" in r.stdout and "drift rule" in r.stdout
    import csv

    with open(os.path.join(tmp_path / "out", os.listdir(tmp_path / "out")[0]), encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    errors = {row["NPU Name"].split(".output")[0] for row in rows if row["Result"] == "error"}
    # only the faulty API and the modules enclosing it (same output); everything downstream is "propagated"
    assert {e for e in errors if not e.startswith("Module.")} == {"Functional.linear.1.forward"}
    assert errors <= {"Functional.linear.1.forward", "Module.1.0.Linear.forward.0", "Module.1.Sequential.forward.0"}
    assert any("propagated from Functional.linear.1.forward" in row["Err_message"] for row in rows)


def test_compare_cli_uses_isolation_records(tmp_path):
    d = _dumps(tmp_path, isolate=True)
    r = _run("compare", "-tp", d["target"], "-gp", d["bench"], "-o", str(tmp_path / "out"))
    assert r.returncode == 1
    assert "isolated verdicts" in r.stdout
    assert "first divergence: Functional.linear.1.forward: " in r.stdout


def test_api_check_cli_that_judges_nothing_fails(fixtures_dir, tmp_path):
    r = _run("api-check", "-api_info", os.path.join(fixtures_dir, "bf16_statistics", "step0", "proc0", "dump.json"),
             "-o", str(tmp_path))
    assert r.returncode == 1
    assert "api-check judged nothing" in r.stderr and "--live" in r.stderr


def test_precision_debugger_dumps_compare_with_isolated_verdicts_by_default(tmp_path):
    """One import changed in a training script: ``msprobe_ci.PrecisionDebugger`` isolates while it captures
    (``isolation.json`` beside ``dump.json`` by default), so ``msprobe-ci compare`` of a benign bf16 target dump
    against its fp32 bench dump passes on isolated verdicts, not on the drift rule."""
    import copy

    import torch

    from msprobe_ci import PrecisionDebugger

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(4)])
    x = torch.randn(8, 32)
    folders = {}
    for side, dtype in (("bench", torch.float32), ("target", torch.bfloat16)):
        m = copy.deepcopy(model).to(dtype)
        dbg = PrecisionDebugger(dump_path=str(tmp_path / side), level="mix")
        dbg.start(m)
        m(x.to(dtype)).float().sum().backward()
        dbg.stop()
        folders[side] = str(tmp_path / side / "step0" / "rank")
        assert os.path.isfile(os.path.join(folders[side], "isolation.json"))
    r = _run("compare", "-tp", folders["target"], "-gp", folders["bench"], "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "isolated verdicts" in r.stdout
    off = PrecisionDebugger(dump_path=str(tmp_path / "off"), level="L1", isolate=False)
    off.start()
    model(x).sum()
    off.stop()
    assert not os.path.exists(tmp_path / "off" / "step0" / "rank" / "isolation.json")


def test_tensor_dumps_made_elsewhere_are_judged_by_their_calls_replayed(fixtures_dir, tmp_path):
    """msprobe's own tensor dumps (no isolation.json): every dumped API call replayed on its dumped inputs is
    the verdict. The benign bf16 dump passes; a 2% error written into one call's output is named at that call
    (the calls after it read their own dumped inputs, so nothing downstream is blamed)."""
    import shutil

    import torch

    bench = os.path.join(fixtures_dir, "fp32_tensor", "step0", "proc0")
    r = _run("compare", "-tp", os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0"), "-gp", bench,
             "-o", str(tmp_path / "benign"))
    assert r.returncode == 0 and "isolated verdicts" in r.stdout, r.stdout + r.stderr
    target = tmp_path / "bf16"
    shutil.copytree(os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0"), target)
    pt = target / "dump_tensor_data" / "Functional.layer_norm.0.forward.output.0.pt"
    t = torch.load(pt, weights_only=True)
    torch.save((t.float() * 1.02).to(t.dtype), pt)
    r = _run("compare", "-tp", str(target), "-gp", bench, "-o", str(tmp_path / "fault"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "first divergence: Functional.layer_norm.0.forward" in r.stdout and "replayed" in r.stdout
    # its reproduction, beside the CSV: the call judged again from its saved inputs and dumped output, no dump
    m = re.search(r"reproduce Functional\.layer_norm\.0\.forward alone, without the model: python (\S+)", r.stdout)
    assert m and os.path.dirname(m.group(1)).startswith(str(tmp_path / "fault" / "compare_repro_")), r.stdout
    again = subprocess.run([sys.executable, m.group(1)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "status: error" in again.stdout, again.stdout + again.stderr
    # benign: none written
    assert not [p for p in os.listdir(tmp_path / "benign") if p.startswith("compare_repro_")]
