"""Per-API pre-check: the standards, replay from msprobe's and our dumps, pytest items, CLI CSVs, bad inputs."""

import csv
import json
import os
import shutil

import pytest
import torch
from _files import read_json, read_lines
from hypothesis import given, settings
from hypothesis import strategies as st

from msprobe_ci.checkers import STANDARDS, make_standard, standard_for
from msprobe_ci.cli import main as cli_main
from msprobe_ci.errors import MsprobeError
from msprobe_ci.dump import load_dump
from msprobe_ci.replay import ApiReplayer
from msprobe_ci.replay.args import Rebuilder, api_generator


def _oracle(n=4096, seed=0):
    return torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["absolute_threshold", "ulp", "benchmark", "accumulative", "legacy"])
def test_standard_passes_rounding_and_fails_a_one_percent_error(name):
    oracle = _oracle()
    right = oracle.bfloat16()          # correctly rounded target
    bench = oracle.bfloat16()          # the same-dtype reference
    std = make_standard(name, torch.bfloat16, "x")
    assert std(right, bench, oracle).status == "pass"
    wrong = (oracle * 1.01).bfloat16()
    res = std(wrong, bench, oracle)
    assert res.status == "error", res
    assert res.passing and set(res.thresholds)  # the result knows what it measured and what would have passed


def test_result_reports_the_loosest_passing_threshold():
    oracle = _oracle()
    res = make_standard("absolute_threshold", torch.bfloat16)((oracle * 1.01).bfloat16(), None, oracle)
    assert res.thresholds["rtol"] == 2 ** -8
    assert 0.005 < res.passing["rtol"] < 0.02  # about the 1% that was injected
    relaxed = make_standard("absolute_threshold", torch.bfloat16, rtol=res.passing["rtol"],
                            small_value_atol_absolute=1.0)
    assert relaxed((oracle * 1.01).bfloat16(), None, oracle).status == "pass"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=64), min_size=1, max_size=64))
def test_correct_rounding_always_passes_absolute_threshold(values):
    oracle = torch.tensor(values, dtype=torch.float64)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        if dt == torch.float16 and oracle.abs().max() > 6e4:
            continue
        assert make_standard("absolute_threshold", dt)(oracle.to(dt), None, oracle).status == "pass"


def test_binary_dropout_and_registry():
    idx = torch.tensor([3, 1, 2])
    assert make_standard("binary", idx.dtype)(idx, idx).status == "pass"
    assert make_standard("binary", idx.dtype)(idx, torch.tensor([3, 2, 1])).metrics["mismatch_rate"] == 2 / 3
    x = torch.ones(10000)
    torch.manual_seed(0)
    drop = torch.nn.functional.dropout(x, p=0.3)
    assert make_standard("dropout", x.dtype, p=0.3)(drop).status == "pass"
    assert make_standard("dropout", x.dtype, p=0.3)(x).status == "error"  # nothing dropped
    assert standard_for("linear", torch.bfloat16) == "ulp"
    assert standard_for("argmax", torch.int64) == "binary"
    assert standard_for("conv2d", torch.float32) == "thousandth" and standard_for("conv2d", torch.bfloat16) == "benchmark"
    assert standard_for("some_new_api", torch.float32) == "benchmark"  # documented default
    assert standard_for("linear", torch.float32, {"lin*": "legacy"}) == "legacy"
    assert set(STANDARDS) == {"absolute_threshold", "accumulative", "benchmark", "binary", "dropout", "legacy",
                              "quantization", "thousandth", "ulp"}


def test_statistics_inputs_plant_the_extremes_and_do_not_depend_on_order(fixtures_dir):
    dump = load_dump(os.path.join(fixtures_dir, "bf16_statistics", "step0", "proc0"))
    rec = dump.data["Functional.linear.0.forward"]["input_args"][0]
    a = Rebuilder(dump).value(rec, api_generator("Functional.linear.0.forward"), "x")
    Rebuilder(dump).value(rec, api_generator("Functional.relu.0.forward"), "y")  # another API in between
    b = Rebuilder(dump).value(rec, api_generator("Functional.linear.0.forward"), "x")
    assert torch.equal(a, b) and list(a.shape) == rec["shape"] and a.dtype == torch.bfloat16
    assert a.max().item() == rec["Max"] and a.min().item() == rec["Min"]


def _pytest_api(pytester, path, *args):
    return pytester.runpytest_subprocess(f"--msprobe-api-check={path}", "-p", "no:cacheprovider", "-rfs", *args)


def test_fixture_tensor_dump_has_no_error_and_one_wrong_output_fails_alone(pytester, fixtures_dir, tmp_path):
    src = os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0")
    result = _pytest_api(pytester, src)
    result.assert_outcomes(passed=25)
    bad = tmp_path / "proc0"
    shutil.copytree(src, bad)
    name = read_json(bad / "dump.json")["data"]["Functional.layer_norm.0.forward"]["output"][0]["data_name"]
    t = torch.load(bad / "dump_tensor_data" / name, weights_only=True)
    torch.save(t * 1.02, bad / "dump_tensor_data" / name)
    result = _pytest_api(pytester, str(bad), "--junitxml=j.xml")
    result.assert_outcomes(passed=24, failed=1)
    result.stdout.fnmatch_lines(["*FAILED proc0/dump.json::Functional.layer_norm.0.forward*"])
    result.stdout.fnmatch_lines(["*msprobe: Functional.layer_norm.0.forward: *.output.0: benchmark error*"])
    # its reproduction, named in the failure; the next run's start replaces the folder (no stale reproduction)
    repro = pytester.path / "msprobe-out" / "api-check" / "proc0" / "repro" / "Functional.layer_norm.0.forward.py"
    assert repro.is_file()
    result.stdout.fnmatch_lines([f"*reproduction: {repro}*"])
    result = _pytest_api(pytester, str(bad), "-k", "linear")
    result.assert_outcomes(passed=4)
    assert not repro.exists() and (pytester.path / "msprobe-out" / "api-check" / ".msprobe-ci").is_file()
    # per-project overrides in the ini: a looser benchmark for this API family passes it; a bad line is refused
    pytester.makeini("[pytest]\nmsprobe_api_thresholds =\n    benchmark.max_rel_err = 100\n"
                     "    benchmark.mean_rel_err = 100\n    benchmark.rmse = 100\n")
    _pytest_api(pytester, str(bad)).assert_outcomes(passed=25)
    pytester.makeini("[pytest]\nmsprobe_api_standards =\n    layer_norm = nonsense\n")
    result = _pytest_api(pytester, str(bad))
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*msprobe_api_standards: 'layer_norm = nonsense': expected 'PATTERN = STANDARD'*"])


def test_statistics_dump_skips_offline_and_runs_live(pytester, fixtures_dir):
    path = os.path.join(fixtures_dir, "bf16_statistics", "step0")
    result = _pytest_api(pytester, path, "-k", "linear")
    result.assert_outcomes(skipped=4)
    result.stdout.fnmatch_lines(["*statistics dump: its target outputs belong to other inputs*"])
    result.stdout.fnmatch_lines(["msprobe: --msprobe-api-check judged nothing: all 4 API calls were skipped (*); add "
                                 "--msprobe-api-live*"])
    assert result.ret == 1  # a gate that judged nothing does not end green
    result = _pytest_api(pytester, path, "--msprobe-api-live", "-k", "linear", "-n", "2")
    result.assert_outcomes(passed=4)
    for kernel in ("rounded", "decomposed"):  # the pre-check takes the bench kernels too
        result = _pytest_api(pytester, path, "--msprobe-api-live", f"--msprobe-bench-kernel={kernel}")
        assert result.ret == 0, result.stdout.str()[-2000:]


@pytest.mark.parametrize("kernel", ["device", "rounded"])
def test_our_capture_of_an_example_model(tmp_path, kernel):
    """A GPT-2 dumped in bf16 by PrecisionDebugger with isolation: every API passes its isolated verdict and its
    offline replay, against the CPU's own kernel and against the correctly rounded bench."""
    pytest.importorskip("transformers")
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from test_gpt2 import build_gpt2

    from msprobe_ci import PrecisionDebugger

    model = build_gpt2().to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100))
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "d"), level="L1", task="tensor", isolate=True,
                            bench_kernel=kernel)
    dbg.start()
    model(input_ids=ids, labels=ids).loss.backward()
    dbg.stop()
    folder = str(tmp_path / "d" / "step0" / "rank")
    with open(os.path.join(folder, "isolation.json"), encoding="utf-8") as fh:
        iso = json.load(fh)
    assert iso["bench_kernel"] == kernel
    judged_live = [r for r in iso["nodes"].values() if r["status"] != "skip"]
    assert len(judged_live) > 100 and [r for r in judged_live if r["status"] == "error"] == []
    replayer = ApiReplayer(load_dump(folder), bench_kernel=kernel)
    results = [replayer.check(n) for n in replayer.api_names()]
    judged = [r for r in results if r.status != "skip"]
    assert len(judged) > 0.8 * len(results) and len(results) > 100
    assert [(r.name, r.message) for r in results if r.status == "error"] == []


def test_bad_inputs_are_named_skips(fixtures_dir, tmp_path):
    bad = tmp_path / "proc0"
    shutil.copytree(os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0"), bad)
    dump = read_json(bad / "dump.json")
    data = dump["data"]
    os.remove(bad / "dump_tensor_data" / data["Functional.relu.0.forward"]["input_args"][0]["data_name"])
    torch.save({"not": "a tensor"}, bad / "dump_tensor_data" / data["Functional.linear.1.forward"]["input_args"][0]["data_name"])
    data["Functional.layer_norm.0.forward"]["input_args"][0]["shape"] = [7, 7]
    data["Torch.no_such_api.0.forward"] = {"input_args": [], "input_kwargs": {}, "output": []}
    data["Distributed.all_reduce.0.forward"] = {"input_args": [], "input_kwargs": {}, "output": []}
    (bad / "dump.json").write_text(json.dumps(dump))
    replayer = ApiReplayer(load_dump(str(bad)))
    got = {n: replayer.check(n) for n in ("Functional.relu.0.forward", "Functional.linear.1.forward",
                                          "Functional.layer_norm.0.forward", "Torch.no_such_api.0.forward",
                                          "Distributed.all_reduce.0.forward")}
    assert all(r.status == "skip" for r in got.values())
    assert "Functional.relu.0.forward.input.0.pt" in got["Functional.relu.0.forward"].reason
    assert got["Functional.linear.1.forward"].reason.endswith(
        "dump_tensor_data/Functional.linear.1.forward.input.0.pt: expected a torch.Tensor, found dict")
    assert "holds shape [4, 32], dump.json says [7, 7]" in got["Functional.layer_norm.0.forward"].reason
    assert "not on the replay allowlist" in got["Torch.no_such_api.0.forward"].reason
    assert "communication op" in got["Distributed.all_reduce.0.forward"].reason
    assert replayer.check("Functional.linear.0.forward").status == "pass"  # the rest still runs


@pytest.mark.parametrize("workers", ["1", "2"])
def test_one_bad_record_skips_its_api_and_the_rest_is_judged(fixtures_dir, tmp_path, capsys, workers):
    """An unknown dtype in one API's input (a newer torch, a fork's dtype) skips that API, forward and backward,
    with the field named; the other 23 calls are judged as before (it rejected the whole dump). A bad header
    still rejects the file."""
    bad = tmp_path / "proc0"
    shutil.copytree(os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0"), bad)
    dump = read_json(bad / "dump.json")
    dump["data"]["Functional.relu.0.forward"]["input_args"][0]["dtype"] = "torch.float4_e9m9"
    (bad / "dump.json").write_text(json.dumps(dump))
    assert cli_main(["api-check", "-api_info", str(bad), "-o", str(tmp_path / "o"), "-n", workers]) == 0
    assert "25 API calls: pass 23, warning 0, error 0, skip 2" in capsys.readouterr().out
    (res,) = [f for f in os.listdir(tmp_path / "o") if f.startswith("accuracy_checking_result_")]
    rows = {r[0]: r[1:] for r in csv.reader(read_lines(tmp_path / "o" / res))}
    assert rows["Functional.relu.0"] == ["SKIP", "SKIP", "not judged, its record breaks the dump format: "
                                         "data['Functional.relu.0.forward'].input_args[0].dtype: 'torch.float4_e9m9' "
                                         "is not a known torch or MindSpore dtype"]
    assert list(rows)[3] == "Functional.relu.0"  # in dump order
    assert rows["Functional.layer_norm.0"] == ["pass", "pass", " "]
    dump["task"] = 7
    (bad / "dump.json").write_text(json.dumps(dump))
    assert cli_main(["api-check", "-api_info", str(bad), "-o", str(tmp_path / "o2")]) == 2
    assert "dump.json: task: 7" in capsys.readouterr().err


def test_cli_writes_msprobe_csvs_and_workers_agree(fixtures_dir, tmp_path, capsys):
    path = os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0", "dump.json")
    assert cli_main(["api-check", "-api_info", path, "-o", str(tmp_path / "one")]) == 0
    assert cli_main(["api-check", "-api_info", path, "-o", str(tmp_path / "two"), "-n", "2",
                     "--junitxml", str(tmp_path / "j.xml")]) == 0
    out = {}
    for d in ("one", "two"):
        (res,) = [f for f in os.listdir(tmp_path / d) if f.startswith("accuracy_checking_result_")]
        (det,) = [f for f in os.listdir(tmp_path / d) if f.startswith("accuracy_checking_details_")]
        rows = list(csv.reader(read_lines(tmp_path / d / res)))
        assert rows[0][0].lstrip("\ufeff") == "API name" and rows[0][1:] == ["Forward Test Success",
                                                                          "Backward Test Success", "Message"]
        details = list(csv.reader(read_lines(tmp_path / d / det)))
        assert len(details[0]) == 23 and details[0][-2:] == ["Status", "Message"]
        out[d] = (rows, [r[:-1] for r in details])
    assert out["one"] == out["two"]
    assert ["Functional.linear.0", "pass", "pass", " "] in out["one"][0]
    assert (tmp_path / "j.xml").read_text().count("<testcase") == 25


def test_cli_writes_a_reproduction_of_each_failing_call_beside_its_csvs(fixtures_dir, tmp_path, capsys):
    """``msprobe-ci api-check`` (two workers): the failing call's reproduction, named as the run's CSVs, judges it
    again with the same verdict; a second run writes its own folder, never over the first."""
    from msprobe_ci.repro import run

    bad = tmp_path / "proc0"
    shutil.copytree(os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0"), bad)
    name = read_json(bad / "dump.json")["data"]["Functional.linear.1.forward"]["output"][0]["data_name"]
    torch.save(torch.load(bad / "dump_tensor_data" / name, weights_only=True) * 1.03, bad / "dump_tensor_data" / name)
    for _ in range(2):
        assert cli_main(["api-check", "-api_info", str(bad), "-o", str(tmp_path / "o"), "-n", "2"]) == 1
    printed = capsys.readouterr().out
    folders = sorted(f for f in os.listdir(tmp_path / "o") if f.startswith("accuracy_checking_repro_"))
    assert len(folders) == 2 and printed.count("1 reproduction(s): python <node>.py") == 2
    for folder in folders:
        assert sorted(os.listdir(tmp_path / "o" / folder)) == [f"Functional.linear.1.forward.{x}" for x in
                                                               ("json", "py", "safetensors")]
    record, spec = run(str(tmp_path / "o" / folders[0] / "Functional.linear.1.forward.py"))
    assert record["status"] == spec["gate"]["status"] == "error" and record["message"] == spec["gate"]["message"]


def test_cli_pool_serves_every_step_folder_once(fixtures_dir, tmp_path, capsys):
    """A dump root with two steps: ``-n 2`` checks both folders in one pool and writes what ``-n 1`` writes; so
    do two one-thread dask workers (``--scheduler local``, whose workers start with 1 torch thread and are pinned
    to ours)."""
    import shutil

    src = os.path.join(fixtures_dir, "bf16_tensor", "step0")
    for step in ("step0", "step1"):
        shutil.copytree(src, tmp_path / "root" / step)
    out = {}
    for n in ("1", "2", "local"):
        how = ["-n", "2", "--scheduler", "local"] if n == "local" else ["-n", n]
        assert cli_main(["api-check", "-api_info", str(tmp_path / "root"), "-o", str(tmp_path / n), *how]) == 0
        printed = capsys.readouterr().out
        assert "50 API calls: pass 50" in printed, printed
        files = sorted(os.listdir(tmp_path / n))
        assert len([f for f in files if f.startswith("accuracy_checking_result_")]) == 2
        out[n] = sorted(tuple(map(tuple, csv.reader(read_lines(tmp_path / n / f))))
                        for f in files if f.startswith("accuracy_checking_result_"))
    assert out["1"] == out["2"] == out["local"]


def test_fuzzing_finds_a_faulty_kernel_and_writes_a_reproducer(fixtures_dir, tmp_path):
    """The fuzzer's minimal failing inputs become the item's reproduction (safetensors, never pickle): it fails
    with the live target's fault and passes without it."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.replay.fuzz import fuzz_api

    dump = load_dump(os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0"))
    clean = ApiReplayer(dump)
    assert fuzz_api(clean, "Functional.layer_norm.0.forward", 15, str(tmp_path / "clean")) == (None, None)
    faulty = ApiReplayer(dump, faults=(Fault("Functional.layer_norm", 0, "forward", "scale", 1.02),))
    failed, repro = fuzz_api(faulty, "Functional.layer_norm.0.forward", 15, str(tmp_path / "r"))
    assert failed.status == "error" and os.path.basename(repro) == "Functional.layer_norm.0.forward.py"
    assert sorted(os.listdir(tmp_path / "r")) == [f"Functional.layer_norm.0.forward.{x}" for x in
                                                  ("json", "py", "safetensors")]
    inputs = load_file(repro[:-3] + ".safetensors")
    assert inputs["t0"].dtype == torch.bfloat16 and list(inputs["t0"].shape) == [4, 32]
    assert read_json(repro[:-3] + ".json")["replayer"]["live"] is True
    run = subprocess.run([sys.executable, repro], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "status: error" in run.stdout and "fault: scale 1.02 on the forward" in run.stdout
    run = subprocess.run([sys.executable, repro, "--no-fault"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0 and "status: pass" in run.stdout, run.stdout + run.stderr


def test_a_failing_item_reproduces_without_the_dump(fixtures_dir, tmp_path):
    """A forward and a backward item judged on recorded target outputs: each reproduction judges the call again
    with the dump gone, with the item's verdict and numbers; a passing item writes none, nothing is overwritten,
    and the files are data (a node off the allowlist, a tampered field: one line, exit 2)."""
    from msprobe_ci.repro import main as repro_main
    from msprobe_ci.repro import run
    from msprobe_ci.replay.repro import write

    src = os.path.join(fixtures_dir, "bf16_tensor", "step0", "proc0")
    bad = tmp_path / "proc0"
    shutil.copytree(src, bad)
    data = read_json(bad / "dump.json")["data"]
    for node, scale in (("Functional.layer_norm.0.forward", 1.02), ("Functional.linear.0.backward", 1.05)):
        name = data[node]["output"][0]["data_name"]
        t = torch.load(bad / "dump_tensor_data" / name, weights_only=True)
        torch.save(t * scale, bad / "dump_tensor_data" / name)
    replayer = ApiReplayer(load_dump(str(bad)))
    folder = str(tmp_path / "repro")
    verdicts = {}
    for node in ("Functional.layer_norm.0.forward", "Functional.linear.0.backward", "Functional.relu.0.forward"):
        result = replayer.check(node)
        verdicts[node] = (result.status, result.message)
        path = write(result, replayer, folder)
        if result.status == "pass":
            assert result.replay is None and path.startswith("not written: ")
            continue
        assert result.status == "error" and path == os.path.join(folder, f"{node}.py")
    assert write(replayer.check("Functional.linear.0.backward"), replayer, folder).endswith(
        "Functional.linear.0.backward.py exists (never overwritten)")
    shutil.rmtree(bad)  # without the dump
    for node in ("Functional.layer_norm.0.forward", "Functional.linear.0.backward"):
        record, spec = run(os.path.join(folder, f"{node}.py"))
        assert (spec["kind"], spec["replayer"]["live"], spec["gate"]["status"]) == ("replay", False, "error")
        assert (record["status"], record["message"]) == verdicts[node]
        assert record["value"] == spec["gate"]["value"] and record["threshold"] == spec["gate"]["threshold"]
        assert repro_main([os.path.join(folder, f"{node}.py")]) == 1
    spec_path = os.path.join(folder, "Functional.layer_norm.0.forward.json")
    spec = read_json(spec_path)
    for field, value in (("node", "os.system.0.forward"), ("prefix", "Torch"), ("targets", "x"),
                         ("replayer", None)):
        with open(spec_path, "w", encoding="utf-8") as fh:
            json.dump(dict(spec, **{field: value}), fh)
        with pytest.raises(MsprobeError, match=r"Functional.layer_norm.0.forward.json: field"):
            run(spec_path)
    assert repro_main([spec_path]) == 2


def test_special_cases_multi_output_inplace_empty_scalar_nan(tmp_path):
    from msprobe_ci import PrecisionDebugger

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 16, generator=g, dtype=torch.bfloat16)
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "d"), level="L1", task="tensor")
    dbg.start()
    torch.topk(x, 3, dim=1)                       # values (float) + indices (int64): two standards
    torch.max(x, dim=0)                           # named tuple output
    y = x.clone()
    y.add_(torch.ones_like(y))                    # in place
    torch.sum(x)                                  # 0-d output
    torch.relu(x[:0])                             # empty
    torch.log(x)                                  # NaN where x < 0: positions must agree
    torch.nn.functional.dropout(torch.ones(64, 64, dtype=torch.bfloat16), p=0.25)
    dbg.stop()
    replayer = ApiReplayer(load_dump(str(tmp_path / "d" / "step0" / "rank")))
    got = {n: replayer.check(n) for n in replayer.api_names()}
    assert {n: r.status for n, r in got.items() if r.status != "pass"} == {}
    topk = got["Torch.topk.0.forward"].outputs
    assert [(row.rsplit(".", 2)[-1], r.standard) for row, r in topk] == [("0", "binary"), ("1", "binary")]
    assert got["Torch.sum.0.forward"].outputs[0][1].standard == "accumulative"
    assert got["Torch.relu.0.forward"].outputs[0][1].standard == "empty"
    assert got["Functional.dropout.0.forward"].outputs[0][1].standard == "dropout"
    assert got["Torch.log.0.forward"].outputs[0][1].standard == "benchmark"
