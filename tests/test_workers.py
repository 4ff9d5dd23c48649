"""compare and graph over many (step, rank) pairs on workers: a process pool (``-n``) and dask.distributed
(``--scheduler local`` and a scheduler with two worker processes), each giving the serial output."""

import glob
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from contextlib import closing

import pytest
import torch
import torch.multiprocessing as mp

import _dist_workers
import _task_helpers
from msprobe_ci import workers
from msprobe_ci.cli import main as cli_main
from msprobe_ci.errors import MsprobeError

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
ENGINES = {"pool": ["-n", "2"], "dask": ["-n", "2", "--scheduler", "local"]}


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tensor-parallel MLP run on 2 ranks (gloo), a 5% gelu fault on rank 1, copied into a second step: 4
    (step, rank) pairs with collectives."""
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_dist_workers.tp_mlp, args=(2, _port(), str(out), 1, (), False), nprocs=2, join=True)
    for side in ("target", "bench"):
        shutil.copytree(out / side / "step0", out / side / "step1")
    return out


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "msprobe_ci.cli", *map(str, args)], capture_output=True, text=True)


def _plain(text: str, out) -> str:
    """Printed lines without the output folder and the timestamps of file names."""
    return re.sub(r"_\d{14}(_\d+)?", "_TS", text.replace(str(out), "OUT"))


def _csvs(folder) -> dict:
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.csv"))):
        with open(f, encoding="utf-8") as fh:
            out[re.sub(r"_\d{14}(_\d+)?", "", os.path.basename(f))] = fh.read()
    return out


def _sql(folder) -> str:
    """The whole .vis.db as SQL text, rows in the order they were written (``iterdump``)."""
    (db,) = glob.glob(os.path.join(folder, "*.vis.db"))
    assert sorted(os.listdir(folder)) == [os.path.basename(db)]  # no part, temporary or claim file left
    with closing(sqlite3.connect(db)) as c:
        return "\n".join(c.iterdump())


def _same_as_serial(root, tmp_path, engine_args, tag):
    serial = _cli("compare", "-tp", root / "target", "-gp", root / "bench", "-o", tmp_path / "s")
    spread = _cli("compare", "-tp", root / "target", "-gp", root / "bench", "-o", tmp_path / tag, *engine_args)
    assert serial.returncode == spread.returncode == 1, serial.stderr + spread.stderr
    assert _plain(serial.stdout, tmp_path / "s") == _plain(spread.stdout, tmp_path / tag)
    assert serial.stdout.startswith("first divergence: step0 rank1 Functional.gelu.0.forward: ")
    assert "step0 rank0 Distributed.all_reduce.0.forward: received diverged data through" in serial.stdout
    csvs = _csvs(tmp_path / "s")
    assert len(csvs) == 4 and csvs == _csvs(tmp_path / tag)
    for extra in ([], ["-fm"], ["-oc"]):  # streamed, in memory (fuzzy matching), overflow levels
        for golden in (["-gp", root / "bench"], []):  # compare and build graphs
            name = f"{tag}{'-'.join(map(str, extra))}{len(golden)}"
            a = _cli("graph", "-tp", root / "target", *golden, "-o", tmp_path / f"s{name}", *extra)
            b = _cli("graph", "-tp", root / "target", *golden, "-o", tmp_path / f"w{name}", *extra, *engine_args)
            assert a.returncode == b.returncode == 0, a.stderr + b.stderr
            assert _sql(tmp_path / f"s{name}") == _sql(tmp_path / f"w{name}")


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_workers_write_what_serial_writes(root, tmp_path, engine):
    """Printed lines, CSVs and .vis.db content (every row, in order) identical to serial; the cross-rank answer
    computed from the workers' per-rank summaries."""
    _same_as_serial(root, tmp_path, ENGINES[engine], engine)
    with closing(sqlite3.connect(glob.glob(str(tmp_path / f"w{engine}2/*.vis.db"))[0])) as c:
        assert c.execute("select rank_list, step_list from tb_config").fetchone() == ("[0, 1]", "[0, 1]")
        linked = c.execute("select count(*) from tb_nodes where is_distributed = 1 and matched_distributed "
                           "like '%nodes_info%'").fetchone()[0]
    assert linked == 8  # the all_reduce of 2 ranks x 2 steps x 2 sides, each linked to its peer


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_failed_task_names_its_step_and_rank_and_leaves_nothing(root, tmp_path, engine):
    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    dump = bad / "target" / "step1" / "rank1" / "dump.json"
    dump.write_text(dump.read_text()[: dump.stat().st_size // 2])
    for args in (["compare", "-o", tmp_path / "c"], ["graph", "-o", tmp_path / "g"],
                 ["graph", "-o", tmp_path / "g", "-fm"]):
        r = _cli(*args[:1], "-tp", bad / "target", "-gp", bad / "bench", *args[1:], *ENGINES[engine])
        assert r.returncode == 2, r.stdout + r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"msprobe-ci: step1 rank1: {dump}: malformed JSON"), r.stderr
        assert "Traceback" not in r.stderr and "Compute Failed" not in r.stderr
    assert os.listdir(tmp_path / "g") == []  # no graph, part, temporary or claim file
    assert not [f for f in os.listdir(tmp_path / "c") if f.startswith(".")]  # CSVs only, each complete


def test_a_dead_worker_is_named():
    with pytest.raises(MsprobeError, match=r"step0 rank2.*: a worker process died while running it"):
        workers.run(_task_helpers.square_or_die, [0, 1, 2], ["step0 rank0", "step0 rank1", "step0 rank2"],
                    workers=2)
    with pytest.raises(MsprobeError, match=r"^step0 rank3: failed in a worker \(ValueError: bad job 3\)$"):
        workers.run(_task_helpers.square_or_die, [0, 3], ["step0 rank0", "step0 rank3"], workers=2)
    assert workers.run(_task_helpers.square_or_die, [0, 1, 4], ["a", "b", "c"], workers=2) == [0, 1, 16]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the killed worker's sockets
def test_a_dead_dask_worker_is_named():
    import dask

    pytest.importorskip("distributed")  # loaded first: its config defaults must outlive the override below
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with pytest.raises(MsprobeError, match=r"^step0 rank2: the dask workers running it died"):
            workers.run(_task_helpers.square_or_die, [0, 1, 2], ["step0 rank0", "step0 rank1", "step0 rank2"],
                        workers=2, scheduler="local")


def test_scheduler_without_dask_or_unreachable_is_one_line(root, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if dask.distributed were not installed
    args = ["compare", "-tp", str(root / "target"), "-gp", str(root / "bench"), "-o", str(tmp_path / "o")]
    assert cli_main([*args, "--scheduler", "local"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'msprobe-ci[dask]'" in err
    monkeypatch.undo()
    start = time.monotonic()
    r = _cli(*args, "--scheduler", f"tcp://127.0.0.1:{_port()}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot connect to a dask scheduler there" in r.stderr and time.monotonic() - start < 60
    assert not os.path.exists(tmp_path / "o")


def test_merging_ranks_refuses_workers(root, tmp_path):
    r = _cli("compare", "-tp", root / "target", "-gp", root / "bench", "-o", tmp_path / "o", "--rank_size", "2",
             "1", "--tp", "2", "1", "-n", "2")
    assert r.returncode == 2 and "merging runs in one process" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_scheduler_and_two_worker_processes(root, tmp_path):
    """``dask scheduler`` and two ``dask worker`` processes, as on a cluster: the command's output is the serial
    one. The processes are stopped by their PIDs."""
    pytest.importorskip("distributed")
    port = _port()
    address = f"tcp://127.0.0.1:{port}"
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", str(port), "--no-dashboard"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    try:
        for _ in range(2):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                           "--nthreads", "1", "--no-dashboard", "--no-nanny"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        waited = subprocess.run([sys.executable, "-c", "import sys\nfrom distributed import Client\nwith Client("
                                 "sys.argv[1], timeout='60s') as c:\n    c.wait_for_workers(2, timeout=120)", address],
                                capture_output=True, text=True, timeout=200)  # not in this process: no event loop
        assert waited.returncode == 0, waited.stderr                           # left behind here
        _same_as_serial(root, tmp_path, ["--scheduler", address], "remote")
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a worker whose scheduler is gone may retry it for long
                p.kill()
                p.wait()
