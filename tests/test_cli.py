import os
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
    assert "first: Tensor.__mul__.1.forward: critical" in r.stdout


def test_cli_bad_path_is_one_line(tmp_path):
    r = _run("compare", "-tp", str(tmp_path / "nope"), "-gp", str(tmp_path), "-o", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no such dump file or folder" in r.stderr
