"""Bench baselines end to end through pytester: record, replay, faults, missing/corrupt files, absent devices, xdist."""

import json

import pytest
from _suites import FAULT, MODEL_TEST

TWO_TESTS = MODEL_TEST + """

def test_net_twice(msprobe):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    msprobe.check(build(), x)
    msprobe.check(build(), 2 * x)
"""


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(test_model=TWO_TESTS)
    pytester.makefile(".yaml", faults=FAULT)
    return pytester


def _run(suite, *args):
    return suite.runpytest_subprocess(*args, "-p", "no:cacheprovider", "-rs")


def _record(suite, *args):
    result = _run(suite, "--msprobe-baseline=bl", "--msprobe-record", *args)
    result.assert_outcomes(passed=2)
    return result


def test_record_then_replay(suite):
    result = _record(suite, "--msprobe-bench-dtype=fp32")
    result.stdout.fnmatch_lines(["*test_model.py::test_net ?check 0?: recorded the bench (cpu/fp32, statistics, mix): "
                                 "* KiB in */bl/test_model.py_test_net"])
    manifest = json.loads((suite.path / "bl" / "test_model.py_test_net_twice" / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["test"] == "test_model.py::test_net_twice"
    assert manifest["bench"] == {"device": "cpu", "dtype": "fp32"}
    assert (manifest["task"], manifest["level"], manifest["seed"]) == ("statistics", "mix", 1234)
    assert set(manifest["versions"]) == {"torch", "torch_npu", "msprobe_ci"} and manifest["date"].endswith("+00:00")
    assert [c["index"] for c in manifest["checks"]] == [0, 1] and all(c["bytes"] > 1000 for c in manifest["checks"])
    assert (suite.path / "bl" / "test_model.py_test_net_twice" / "check1" / "step0" / "rank" / "dump.json").is_file()
    assert not list((suite.path / "bl").glob(".staging-*"))

    result = _run(suite, "--msprobe-baseline=bl", "--msprobe-bench-dtype=fp32", "--msprobe-target-dtype=bf16")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_model.py::test_net ?check 0?: * nodes compared (cpu/fp32 (baseline) vs "
                                 "cpu/bf16, statistics, mix)*error 0*", "*bench from baseline */bl/test_model.py_test_net (* KiB)"])
    # the baseline was used, not a fresh bench: no bench dump under the artifacts
    assert not (suite.path / "msprobe-out" / "test_model.py_test_net" / "check0" / "bench").exists()


def test_replay_with_injected_fault_fails_naming_the_api(suite):
    _record(suite)
    result = _run(suite, "--msprobe-baseline=bl", "--msprobe-inject", "faults.yaml", "-k", "test_net and not twice")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at Functional.layer_norm.0.forward*"])


def test_missing_and_corrupt_baselines_are_clear_failures(suite):
    result = _run(suite, "--msprobe-baseline=bl", "-k", "test_net and not twice")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: no baseline for test_model.py::test_net in */bl; record it with: "
                                 "pytest 'test_model.py::test_net' --msprobe-baseline=*/bl --msprobe-record "
                                 "--msprobe-bench=cpu"])
    _record(suite)
    folder = suite.path / "bl" / "test_model.py_test_net"
    (folder / "manifest.json").write_text("{not json")
    result = _run(suite, "--msprobe-baseline=bl", "-k", "test_net and not twice")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: */manifest.json: baseline manifest is not valid JSON*record it with*"])

    twice = suite.path / "bl" / "test_model.py_test_net_twice"
    (twice / "check1" / "step0" / "rank" / "dump.json").write_text('{"data": ')
    result = _run(suite, "--msprobe-baseline=bl", "-k", "twice")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: */check1/step0/rank/dump.json*re-record it with --msprobe-record*"])
    assert "Traceback" not in result.stdout.str() and "During handling" not in result.stdout.str()


def test_absent_bench_device_is_stood_in_by_the_baseline(suite):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = _run(suite, "--msprobe-bench=gpu", "-k", "test_net and not twice")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*device 'cuda' is not available*use a recorded baseline*"])
    _record(suite)  # recorded on cpu, replayed where the requested bench (gpu) does not exist
    result = _run(suite, "--msprobe-baseline=bl", "--msprobe-bench=gpu", "-k", "test_net and not twice")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*BaselineWarning: msprobe: baseline */bl/test_model.py_test_net was recorded with "
                                 "device 'cpu' (requested 'cuda')*"])


def test_baseline_value_taken_as_rootdir_is_refused(suite, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")  # outside the project: pytest makes it the rootdir
    result = suite.runpytest_subprocess("--msprobe-baseline", str(elsewhere), "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*msprobe: write --msprobe-baseline=*elsewhere* (with *=*)*"])


def test_xdist_records_and_replays_without_collisions(suite):
    pytest.importorskip("xdist")
    result = _run(suite, "-n", "2", "--msprobe-baseline=bl", "--msprobe-record")
    result.assert_outcomes(passed=2)
    assert sorted(p.name for p in (suite.path / "bl").iterdir()) == ["test_model.py_test_net",
                                                                      "test_model.py_test_net_twice"]
    result = _run(suite, "-n", "2", "--msprobe-baseline=bl", "--msprobe-target-dtype=bf16",
                  "--msprobe-junitxml", "out.xml")
    result.assert_outcomes(passed=2)
    assert (suite.path / "out.xml").read_text().count("<testsuite ") == 3  # test_net + 2 checks of test_net_twice
