"""The plugin end to end through pytester: pass, injected fault fails naming the API, JUnit content, bad options."""

import os

import pytest
from _suites import FAULT, MODEL_TEST

pytest.importorskip("junitparser")


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(test_model=MODEL_TEST)
    pytester.makefile(".yaml", faults=FAULT)
    return pytester


def test_bf16_target_passes(suite):
    result = suite.runpytest_subprocess("--msprobe-target-dtype=bf16", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*msprobe*", "*test_net*nodes compared*error 0*first divergence: none*"])
    stack = (suite.path / "msprobe-out" / "test_model.py_test_net" / "check0" / "target" / "step0" / "rank" /
             "stack.json").read_text()
    assert "test_model.py" in stack and "_pytest" not in stack and "pluggy" not in stack  # user frames only


@pytest.mark.parametrize("kernel", ["rounded", "decomposed"])
def test_bench_kernel_option_and_marker(suite, kernel):
    """--msprobe-bench-kernel picks the bench the isolated verdicts are judged against; the injected fault is
    named against it too; a marker's bench_kernel wins over the command line."""
    result = suite.runpytest_subprocess("--msprobe-target-dtype=bf16", f"--msprobe-bench-kernel={kernel}",
                                        "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*isolation: * API calls judged on their own inputs (bench kernel: {kernel})*"])
    result = suite.runpytest_subprocess("--msprobe-target-dtype=bf16", f"--msprobe-bench-kernel={kernel}",
                                        "--msprobe-inject", "faults.yaml", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at Functional.layer_norm.0.forward*"])
    suite.makepyfile(test_marker=MODEL_TEST.replace("def test_net(msprobe):",
                                                    "import pytest\n@pytest.mark.msprobe(bench_kernel='upcast')\n"
                                                    "def test_net(msprobe):"))
    result = suite.runpytest_subprocess("test_marker.py", "--msprobe-target-dtype=bf16",
                                        f"--msprobe-bench-kernel={kernel}", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*(bench kernel: upcast)*"])


def test_injected_fault_fails_naming_the_api(suite):
    result = suite.runpytest_subprocess("--msprobe-target-dtype=bf16", "--msprobe-inject", "faults.yaml",
                                        "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at Functional.layer_norm.0.forward (in Module.norm.LayerNorm"
                                 ".forward.0; at *test_model.py, line *): benchmark standard on its own inputs: * > *",
                                 "graph: *(open: msprobe-ci view *)",
                                 "replay this API alone: pytest --msprobe-api-check=*/step0/rank --msprobe-api-live "
                                 "--msprobe-target=cpu --msprobe-inject=*faults.yaml -k "
                                 "'Functional.layer_norm.0.forward'"])


def test_noise_fault_in_tensor_mode_and_backward_fault(suite):
    suite.makefile(".yaml", noise="faults:\n  - {api: Functional.gelu, perturb: noise, value: 0.05}\n",
                   bwd="faults:\n  - {api: Functional.linear, call: 1, direction: backward, perturb: scale, value: 1.1}\n")
    result = suite.runpytest_subprocess("--msprobe-task=tensor", "--msprobe-inject", "noise.yaml", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*first divergence at Functional.gelu.0.forward*"])
    result = suite.runpytest_subprocess("--msprobe-inject", "bwd.yaml", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*first divergence at Functional.linear.1.backward*"])


def test_junit_content(suite):
    from junitparser import Failure, JUnitXml

    result = suite.runpytest_subprocess("--msprobe-inject", "faults.yaml", "--msprobe-junitxml", "out.xml",
                                        "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    xml = JUnitXml.fromfile(str(suite.path / "out.xml"))
    suites = list(xml)
    assert len(suites) == 1
    cases = {c.name: c for c in suites[0]}
    assert "Functional.linear.0.forward" in cases and "overflow" in cases
    assert suites[0].name == "test_model.test_net check 0" and cases["overflow"].classname == suites[0].name
    assert cases["Functional.linear.0.forward"].time > 0  # the seconds its isolated verdict took
    assert cases["Module.norm.LayerNorm.forward.0"].time >= cases["Functional.layer_norm.0.forward"].time > 0
    failure = cases["Functional.layer_norm.0.forward"].result[0]
    assert "threshold" in failure.text and "worst row" in failure.text  # a body with the numbers
    bad = cases["Functional.layer_norm.0.forward"]
    assert any(isinstance(r, Failure) for r in bad.result)
    import xml.etree.ElementTree as ET

    case_el = next(c for c in ET.parse(str(suite.path / "out.xml")).iter("testcase")
                   if c.get("name") == "Functional.layer_norm.0.forward")
    props = {p.get("name"): p.get("value") for p in case_el.iter("property")}
    assert props["msprobe.status"] == "error" and float(props["msprobe.value"]) > float(props["msprobe.threshold"])
    assert not any(isinstance(r, Failure) for r in cases["Functional.linear.0.forward"].result)


def test_marker_and_per_call_options_win(suite):
    suite.makepyfile(test_marker=MODEL_TEST.replace("def test_net(msprobe):",
                                                    "import pytest\n@pytest.mark.msprobe(rel_floor=1.0, isolate='off', output_rtol=0.1)\ndef test_net(msprobe):"))
    result = suite.runpytest_subprocess("test_marker.py", "--msprobe-inject", "faults.yaml", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    # the per-API standard's thresholds, loosened by the marker, decide the isolated verdict
    loose = "{'benchmark': {'max_rel_err': 1e4, 'mean_rel_err': 1e4, 'rmse': 1e4}}"
    suite.makepyfile(test_marker=MODEL_TEST.replace("def test_net(msprobe):",
                                                    f"import pytest\n@pytest.mark.msprobe(api_thresholds={loose}, output_rtol=0.1)\n"
                                                    "def test_net(msprobe):"))
    result = suite.runpytest_subprocess("test_marker.py", "--msprobe-inject", "faults.yaml", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("args, message", [
    (["--msprobe-target=tpu"], "*--msprobe-target: device 'tpu': expected cpu, gpu, cuda, cuda:N, npu or npu:N*"),
    (["--msprobe-target=cpu:1"], "*--msprobe-target: device 'cpu:1': the CPU has no index 1 (write cpu)*"),
    (["--msprobe-target-dtype=fp8"], "*--msprobe-target-dtype: expected one of fp64, fp32, fp16, bf16, got 'fp8'*"),
    (["--msprobe-inject", "missing.yaml"], "*msprobe: missing.yaml: fault file not found*"),
    (["--msprobe-bench-kernel=gpu"], "*--msprobe-bench-kernel: expected one of device, upcast, rounded, decomposed, "
                                     "got 'gpu'*"),
])
def test_bad_options(suite, args, message):
    result = suite.runpytest_subprocess(*args, "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str()


def test_absent_device_is_a_clear_skip(suite):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = suite.runpytest_subprocess("--msprobe-target=gpu", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    # listed in the msprobe section without -rs
    result.stdout.fnmatch_lines(["*test_net ?check 0?: SKIPPED, nothing compared: device 'cuda' is not available*"])
    result = suite.runpytest_subprocess("--msprobe-target=gpu", "--msprobe-require-device", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: device 'cuda' is not available*(--msprobe-require-device)*"])


def test_same_bench_and_target_is_said(suite):
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*note: warning: bench and target are the same (cpu/model-dtype)*"])


def test_plugin_import_does_not_load_torch(pytester):
    pytester.makepyfile(test_plain="def test_x():\n    import sys\n    assert 'torch' not in sys.modules\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_xdist_workers_report_to_the_controller(suite):
    """Under ``-n 2`` each worker captures its own test into its own folder; only the controller writes JUnit."""
    pytest.importorskip("xdist")
    from junitparser import JUnitXml

    suite.makepyfile(test_mlp="""
import torch

def test_mlp(msprobe):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU())
    msprobe.check(model, torch.randn(4, 16, generator=torch.Generator().manual_seed(2)))
""")
    result = suite.runpytest_subprocess("-n", "2", "--msprobe-inject", "faults.yaml", "--msprobe-out", "art",
                                        "--msprobe-junitxml", "out.xml", "-p", "no:cacheprovider")
    # test_mlp has no layer_norm: the session's fault never fires there, which fails it (it proved nothing)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*test_mlp.py::test_mlp*nodes compared*error 0*"])  # finish order varies
    result.stdout.fnmatch_lines(["*test_model.py::test_net*first divergence: Functional.layer_norm.0.forward*"])
    suites = {s.name: s for s in JUnitXml.fromfile(str(suite.path / "out.xml"))}
    assert set(suites) == {"test_mlp.test_mlp check 0", "test_model.test_net check 0"}  # Jenkins-safe dots
    assert suites["test_model.test_net check 0"].failures >= 1
    mlp = {c.name: c for c in suites["test_mlp.test_mlp check 0"]}
    assert [n for n, c in mlp.items() if c.result and c.result[0].__class__.__name__ == "Failure"] == ["injected-faults"]
    folders = sorted(p.name for p in (suite.path / "art").iterdir() if p.name not in ("graphs", "report.html"))
    assert folders == ["test_mlp.py_test_mlp", "test_model.py_test_net"]
    report = (suite.path / "art" / "report.html").read_text(encoding="utf-8")  # one page, by the controller
    assert "2 check(s), 2 failing" in report and "test_model.py::test_net" in report and "test_mlp.py::test_mlp" in report
    assert sorted(p.name for p in (suite.path / "art" / "graphs").iterdir()) == [
        "test_mlp.py_test_mlp.check0", "test_model.py_test_net.check0"]
    assert all((suite.path / "art" / f / ".msprobe-ci").is_file() for f in folders)


def test_compiled_target_is_captured_at_module_level(suite):
    result = suite.runpytest_subprocess("--msprobe-target-compile", "--msprobe-target-dtype=bf16",
                                        "--msprobe-inject", "faults.yaml", "-p", "no:cacheprovider")
    # the fault's API runs inside a compiled region: it proves nothing, so the test fails and says why
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*msprobe: faults.yaml: fault Functional.layer_norm call 0 (forward) was never applied: it ran inside a "
        "torch.compile region*a fault that never fires or changes no value proves nothing*",
        "*test_net*nodes compared (cpu/model-dtype vs cpu/bf16+compile, statistics, L0)*error 0*",
        "*note: target compiled with * (3 region(s)); capture at L0*",
    ])
    result = suite.runpytest_subprocess("--msprobe-target-compile", "--msprobe-target-dtype=bf16",
                                        "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_fault_that_matches_no_call_is_reported(suite):
    suite.makefile(".yaml", typo="faults:\n  - {api: Functional.layer_norm, call: 7, perturb: scale, value: 1.1}\n")
    result = suite.runpytest_subprocess("--msprobe-inject", "typo.yaml", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*fault Functional.layer_norm call 7 (forward) was never applied: no such call ran*"])
    suite.makefile(".yaml", steps="faults:\n  - {api: Functional.layer_norm, step: 1, value: 1.1}\n",
                   badstep="faults:\n  - {api: Functional.layer_norm, step: -1, value: 1.1}\n")
    result = suite.runpytest_subprocess("--msprobe-inject", "steps.yaml", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)  # one check is one step (step 0): a step-1 fault never fires
    result = suite.runpytest_subprocess("--msprobe-inject", "badstep.yaml", "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*badstep.yaml: faults?0?.step: expected a non-negative int (a capture step)*"])


def test_graph_per_check_and_opt_out(suite):
    import xml.etree.ElementTree as ET

    result = suite.runpytest_subprocess("--junitxml=j.xml", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    props = {p.get("name"): p.get("value") for p in ET.parse(str(suite.path / "j.xml")).iter("property")}
    graph = props["msprobe.graph"]
    assert graph.endswith(".vis.db") and os.path.isfile(graph)
    assert os.path.basename(os.path.dirname(graph)) == "test_model.py_test_net.check0"
    result.stdout.fnmatch_lines(["*msprobe graphs: msprobe-ci view */msprobe-out/graphs*"])
    result = suite.runpytest_subprocess("--msprobe-no-graph", "--msprobe-out=plain", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert not (suite.path / "plain" / "graphs").exists()


def test_pytest_junitxml_carries_a_path_not_the_check(suite):
    import xml.etree.ElementTree as ET

    result = suite.runpytest_subprocess("--junitxml=pj.xml", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    props = {p.get("name"): p.get("value") for p in ET.parse(suite.path / "pj.xml").iter("property")}
    assert props["msprobe.result"].endswith("msprobe-result.json")
    assert os.path.isfile(props["msprobe.result"])
    assert (suite.path / "pj.xml").stat().st_size < 20_000


def test_two_runs_at_once_into_one_out_folder(suite):
    """Concurrent pytest processes with the same --msprobe-out both finish and both write their results."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--msprobe-out=shared-out",
           "--msprobe-target-dtype=bf16"]
    procs = [subprocess.Popen(cmd + [f"--msprobe-junitxml=j{i}.xml"], cwd=suite.path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("Traceback" not in o and "1 passed" in o for o in outs), outs
    check = suite.path / "shared-out" / "test_model.py_test_net" / "check0"
    assert len([f for f in os.listdir(check) if f.startswith("compare_result_")]) == 1
    assert all((suite.path / f"j{i}.xml").stat().st_size > 0 for i in range(2))


def test_cli_version_and_help_name_every_command():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "msprobe_ci.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("msprobe-ci ")
    for cmd in ("compare", "overflow", "graph", "view", "api-check"):
        r = subprocess.run([sys.executable, "-m", "msprobe_ci.cli", cmd, "-h"], capture_output=True, text=True)
        assert r.returncode == 0 and "example" in r.stdout, cmd
    r = subprocess.run([sys.executable, "-m", "msprobe_ci.cli", "view", "-h"], capture_output=True, text=True)
    assert "TCP port" in r.stdout and "address to listen on" in r.stdout


def test_check_on_a_plain_function_is_one_line(pytester):
    pytester.makepyfile("import torch\ndef test_fn(msprobe):\n    msprobe.check(torch.relu, torch.ones(2))\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: msprobe.check(model, ...): expected a torch.nn.Module, got *"])
    assert "AttributeError" not in result.stdout.str()
