"""``msprobe-ci api-check`` over folders of dumps: every API call of every folder replayed and judged, spread over a
pool of worker processes (:mod:`msprobe_ci.workers`), reports written per folder (msprobe's two CSVs, and a
standalone reproduction of each failing call beside them), and the JUnit XML."""

from __future__ import annotations

import os

from .result import ApiResult
from .runner import ApiReplayer


def _check_chunk(job: tuple[str, list[str], bool, str]) -> list:
    from ..dump.reader import load_dump

    path, names, live, kernel = job
    replayer = ApiReplayer(load_dump(path, skip_bad_entries=True), live=live, bench_kernel=kernel)
    return [replayer.check(n) for n in names]


def check_folders(folders: list[str], *, workers: int = 1, scheduler: str | None = None, live: bool = False,
                  bench_kernel: str = "device", out_path: str | None = None) -> list[ApiResult]:
    """Every folder's API calls checked, reports written per folder (their paths printed): the two CSVs and, for
    each failing call, its reproduction in ``accuracy_checking_repro_<the CSVs' timestamp>/``.

    With ``workers`` N > 1 (or a ``scheduler``) each folder's calls are split in N shares, all queued at once on one
    pool of N spawned workers (the ~1.7 s torch import per worker paid once per run, not per folder), each worker
    pinned to this process's torch thread count: the benchmark standard's bench is CPU arithmetic in the target
    dtype whose rounding follows how reductions are split across threads (a bf16 layer_norm backward with 1 thread
    instead of 2 fails 4 of 109 GPT-2 calls), so verdicts do not depend on ``workers``.

    Args:
        folders: rank folders (or dump.json files), in order.
        workers: worker processes (1: in this process). scheduler: a dask.distributed scheduler address.
        live: re-run the target on CPU instead of reading recorded outputs. bench_kernel: the benchmark
            standard's same-dtype bench (:mod:`msprobe_ci.kernels`).
        out_path: where the CSV reports go (default: beside each dump).

    Returns:
        One :class:`~msprobe_ci.replay.result.ApiResult` per API call, folder by folder, in dump order.
    """
    from .. import workers as engine
    from ..dump.reader import load_dump
    from .report import write_reports

    jobs: list[tuple[int, tuple[str, list[str], bool, str]]] = []
    labels = []
    names_by_folder = []
    for i, folder in enumerate(folders):
        names = ApiReplayer(load_dump(folder, skip_bad_entries=True), live=live).api_names()
        names_by_folder.append(names)
        chunks = [names] if workers == 1 else [names[k::workers] for k in range(workers)]
        for k, c in enumerate(chunks):
            if c:
                jobs.append((i, (folder, c, live, bench_kernel)))
                labels.append(f"{folder} (share {k + 1} of {len(chunks)})")
    parts = engine.run(_check_chunk, [job for _, job in jobs], labels, workers=workers, scheduler=scheduler)
    results = []
    for i, names in enumerate(names_by_folder):
        by_name = {r.name: r for (j, _), part in zip(jobs, parts) if j == i for r in part}
        folder_results = [by_name[n] for n in names]
        paths = write_reports(folder_results, out_path)
        for csv_path in paths:
            print(csv_path)
        _reproductions(folder_results, live, bench_kernel,
                       paths[0].replace("accuracy_checking_result_", "accuracy_checking_repro_")[: -len(".csv")])
        results += folder_results
    return results


def _reproductions(results: list[ApiResult], live: bool, bench_kernel: str, repro_dir: str) -> None:
    """Each failing call's standalone reproduction (:mod:`msprobe_ci.replay.repro`) in ``repro_dir`` (named as
    the run's CSVs, so never overwritten), printed with the folder; a call left without one says why."""
    from .repro import write

    failing = [r for r in results if r.status == "error"]
    if not failing:
        return
    replayer = ApiReplayer(None, live=live, bench_kernel=bench_kernel)  # the settings the workers judged with
    unwritten = [(r.name, why) for r in failing if (why := write(r, replayer, repro_dir)).startswith("not written")]
    if len(unwritten) < len(failing):
        print(f"{repro_dir}{os.sep} ({len(failing) - len(unwritten)} reproduction(s): python <node>.py)")
    for name, why in unwritten:
        print(f"{name}: reproduction {why}")


def write_api_junit(results: list[ApiResult], path: str) -> None:
    """One ``msprobe api-check`` suite, a testcase per API call (:func:`msprobe_ci.junit.api_case`)."""
    from junit_xml import TestSuite

    from ..junit import api_case, write_junit_xml

    cases = [api_case(r.name, r.status, r.message, "msprobe.api_check") for r in results]
    write_junit_xml(path, [TestSuite("msprobe api-check", cases)])
