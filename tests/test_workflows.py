"""The GitHub workflows parse, and every msprobe flag they use is one the plugin defines."""

import os
import re
import shlex

import pytest
import yaml

from msprobe_ci.pytest_plugin.options import FLAGS, OPTIONS

ROOT = os.path.join(os.path.dirname(__file__), "..")
KNOWN = {flag for flag, *_ in OPTIONS} | {flag for flag, *_ in FLAGS}


def _load(name):
    with open(os.path.join(ROOT, ".github", "workflows", name), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _runs(job):
    return [step["run"] for step in job["steps"] if "run" in step]


def _flags(text):
    return set(re.findall(r"--msprobe-[a-z-]+", text))


def _readme_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    return [line.strip() for line in text.splitlines() if line.strip().startswith(("pytest ", "python3 -m venv"))]


@pytest.mark.parametrize("name", ["ci.yml", "accuracy-gate.yml"])
def test_workflow_flags_exist(name):
    wf = _load(name)
    used = set().union(*(_flags(run) for job in wf["jobs"].values() for run in _runs(job)))
    assert used <= KNOWN, f"{name} uses flags the plugin does not define: {sorted(used - KNOWN)}"


def test_ci_runs_the_readme_test_command_on_two_pythons():
    wf = _load("ci.yml")
    job = wf["jobs"]["tests"]
    assert len(job["strategy"]["matrix"]["python-version"]) == 2
    runs = [r.strip() for r in _runs(job)]
    readme = _readme_commands()
    assert "pytest tests/ -n 2" in readme and "pytest tests/ -n 2" in runs
    assert any(r.startswith("pytest examples/") and r in " ".join(readme) for r in runs)


def test_accuracy_gate_records_on_gpu_and_replays_on_npu():
    wf = _load("accuracy-gate.yml")
    record, gate = wf["jobs"]["record-bench"], wf["jobs"]["gate-npu"]
    assert "gpu" in record["runs-on"] and gate["runs-on"] == ["self-hosted", "npu"] and gate["needs"] == "record-bench"
    record_cmd = next(shlex.split(r) for r in _runs(record) if r.lstrip().startswith("pytest"))
    gate_cmd = next(shlex.split(r) for r in _runs(gate) if r.lstrip().startswith("pytest"))
    assert "--msprobe-record" in record_cmd and "--msprobe-bench=gpu" in record_cmd
    assert "--msprobe-record" not in gate_cmd and "--msprobe-target=npu" in gate_cmd
    assert "--msprobe-require-device" in gate_cmd  # an NPU runner without its NPU must not end green
    assert "--msprobe-require-checks" in gate_cmd and "--msprobe-require-checks" in record_cmd  # nor one that checks nothing
    baseline = lambda cmd: next(a.split("=", 1)[1] for a in cmd if a.startswith("--msprobe-baseline="))  # noqa: E731
    assert baseline(record_cmd) == baseline(gate_cmd)
    uploads = {s["with"]["name"]: s["with"]["path"] for s in record["steps"] if "upload-artifact" in s.get("uses", "")}
    downloads = {s["with"]["name"]: s["with"]["path"] for s in gate["steps"] if "download-artifact" in s.get("uses", "")}
    assert uploads == downloads and "msprobe-baseline" in uploads
    junit = next(a.split("=", 1)[1] for a in gate_cmd if a.startswith("--msprobe-junitxml="))
    report = next(s for s in gate["steps"] if "junit-report" in s.get("uses", ""))
    assert report["with"]["report_paths"] == junit and report["if"] == "always()"


def test_benchmark_job_runs_the_floors_weekly_and_on_demand_and_fails_below_a_floor():
    import importlib.util
    import sys

    wf = _load("benchmarks.yml")
    triggers = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as True
    assert "workflow_dispatch" in triggers and triggers["schedule"][0]["cron"]
    runs = " ".join(_runs(wf["jobs"]["floors"]))
    assert "python benchmarks/floors.py" in runs and "torch==2.13.0" in runs
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("floors", os.path.join(ROOT, "benchmarks", "floors.py"))
        floors = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(floors)
    finally:
        sys.path.pop(0)
    table, ok = floors.check([("capture", 1.21, "<= 1.3", True), ("graph", 2.02, ">= 3.0", False)])
    assert not ok and "| graph | 2.02 | >= 3.0 | **below floor** |" in table
    assert floors.check([("capture", 1.21, "<= 1.3", True)])[1]
