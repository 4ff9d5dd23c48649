"""Independent tasks (one per (step, rank) pair of a dump root) spread over processes by an existing engine.

Three ways, chosen by the command line (``-n/--num_workers N``, ``--scheduler ADDRESS|local``):

* **serial** (``-n 1``, no scheduler): the tasks run in this process, one after another;
* **a local pool** (``-n N``): :class:`concurrent.futures.ProcessPoolExecutor` with N *spawned* processes (a forked
  copy of a process whose torch thread pools are running can deadlock);
* **dask.distributed** (``--scheduler``): each task is a future on a running cluster (``tcp://host:8786``) or, with
  ``local``, on a :class:`distributed.LocalCluster` of N one-thread worker processes started for the run. Workers
  read dumps by path and write their outputs where the serial run would: the paths must be shared storage.

Whatever the engine, results come back in the order of the jobs, and every worker runs torch with the parent's
thread count (a reduction's rounding in a low-precision dtype follows how it is split across threads, so a verdict
must not depend on the engine). A task that raises, or a worker process that dies under it, ends the run with one
:class:`~msprobe_ci.errors.MsprobeError` naming the task (``step0 rank3: ...``); the caller removes whatever the
run left unfinished.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

from ._perf import gc_paused
from .errors import MsprobeError

DASK_HINT = "pip install 'msprobe-ci[dask]' (or: pip install 'dask[distributed]')"


def threads(load: bool = False) -> int | None:
    """This process's torch intra-op thread count (what workers are pinned to); None when torch is not loaded
    here and ``load`` is False (local workers then start with the same default, from the same environment)."""
    if "torch" not in sys.modules and not load:
        return None
    import torch

    return torch.get_num_threads()


_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def pin_threads(n: int | dict | None) -> None:
    """Run torch in this (worker) process with the thread count serial would use: ``n`` threads, whether torch
    is loaded yet or later (``OMP_NUM_THREADS``/``MKL_NUM_THREADS``, which torch reads when it loads); a dict: the
    parent's values of those variables (None: unset), for a worker on the parent's machine whose torch is not
    loaded yet (a dask nanny sets them to 1). OpenMP threads wait passively (N workers with all-core pools
    otherwise spin against each other: 3x slower than one process). ``None``: the defaults."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if isinstance(n, dict):
        for key, value in n.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        return
    if n is None:
        return
    for key in _THREAD_VARS:
        os.environ[key] = str(n)
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _pinned(fn: Callable, job: Any, n: int | dict | None) -> Any:
    """``fn(job)`` in a dask worker, torch pinned to ``n`` threads first, the cyclic collector paused as in the
    serial run (:func:`~msprobe_ci._perf.gc_paused`)."""
    pin_threads(n)
    with gc_paused():
        return fn(job)


def _tracked(fn: Callable, job: Any, label: str, started) -> Any:
    """``fn(job)`` in a pool worker, announcing the task's start and end on ``started`` (a manager queue), so a
    worker that dies can be named."""
    started.put((label, True))
    try:
        with gc_paused():  # as the serial run (msprobe_ci.cli.main)
            return fn(job)
    finally:
        started.put((label, False))


def _failed(label: str, exc: BaseException) -> MsprobeError:
    text = str(exc).strip().splitlines()
    detail = text[0] if text else type(exc).__name__
    if isinstance(exc, MsprobeError):
        return MsprobeError(f"{label}: {detail}")
    return MsprobeError(f"{label}: failed in a worker ({type(exc).__name__}: {detail})")


def run(fn: Callable[[Any], Any], jobs: Sequence[Any], labels: Sequence[str], *, workers: int = 1,
        scheduler: str | None = None, reraise: tuple[type, ...] = ()) -> list:
    """``[fn(job) for job in jobs]`` on the engine the arguments choose; see the module docstring.

    Args:
        fn: a module-level function (pickled by reference) of one picklable argument.
        jobs: the tasks' arguments.
        labels: one name per job for messages (``"step0 rank3"``).
        workers: processes of the local pool, or of the ``local`` dask cluster (default 1: serial).
        scheduler: a dask scheduler address, or ``"local"``; None: no dask.
        reraise: exception types re-raised as the task raised them (not wrapped in a message naming the task).

    Returns:
        The results, in the order of ``jobs``.

    Raises:
        MsprobeError: a task raised (serial: its own error, as it is), a worker died, the scheduler cannot be
            reached, or dask is not installed.
    """
    if scheduler:
        return _dask(fn, jobs, labels, workers, scheduler, reraise)
    if workers <= 1 or len(jobs) <= 1:
        return [fn(job) for job in jobs]
    return _pool(fn, jobs, labels, workers, reraise)


def _collect(futures, labels, reraise: tuple[type, ...], died: type, death: Callable[[str], str]) -> list:
    """The futures' results in order; the first failure raised, naming its task (``died``: the engine's error
    for a dead worker, worded by ``death(label)``)."""
    results = []
    for future, label in zip(futures, labels):
        try:
            results.append(future.result())
        except died:
            raise MsprobeError(death(label)) from None
        except reraise:
            raise
        except Exception as exc:
            raise _failed(label, exc) from None
    return results


def _running(started) -> str:
    """The tasks that announced their start and not their end on the queue ``started``, comma-separated."""
    running: dict[str, None] = {}
    while not started.empty():
        name, begun = started.get()
        if begun:
            running[name] = None
        else:
            running.pop(name, None)
    return ", ".join(running)


def _pool(fn, jobs, labels, workers: int, reraise: tuple[type, ...]) -> list:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        started = manager.Queue()
        pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx, initializer=pin_threads,
                                   initargs=(threads(),))
        try:
            futures = [pool.submit(_tracked, fn, job, label, started) for job, label in zip(jobs, labels)]
            return _collect(futures, labels, reraise, BrokenProcessPool, lambda label: (
                f"{_running(started) or label}: a worker process died while running it (killed, or out of "
                "memory); nothing of it is kept"))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _dask(fn, jobs, labels, workers: int, scheduler: str, reraise: tuple[type, ...]) -> list:
    try:
        import logging

        from distributed import Client, LocalCluster
        from distributed.scheduler import KilledWorker
    except ImportError:
        raise MsprobeError(f"--scheduler needs dask.distributed, which is not installed: {DASK_HINT}") from None
    cluster = None
    try:
        if scheduler == "local":
            cluster = LocalCluster(n_workers=max(1, workers), threads_per_worker=1, processes=True,
                                   dashboard_address=":0", silence_logs=logging.CRITICAL)  # a free port: never 8787 twice
            client = Client(cluster)
        else:
            try:
                client = Client(scheduler, timeout="10s")
            except (OSError, ValueError, TypeError) as exc:
                raise MsprobeError(f"--scheduler {scheduler}: cannot connect to a dask scheduler there "
                                   f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        with client:
            # a dask worker starts with 1 thread (its nanny sets OMP_NUM_THREADS=1): pin workers to this process's
            # count; a local cluster's workers, while torch is not loaded here, to this process's environment
            n = threads(load=scheduler != "local") or {key: os.environ.get(key) for key in _THREAD_VARS}
            futures = [client.submit(_pinned, fn, job, n, key=f"msprobe-ci {label} {i} {os.getpid()}", pure=False)
                       for i, (job, label) in enumerate(zip(jobs, labels))]
            try:
                return _collect(futures, labels, reraise, KilledWorker, lambda label: (
                    f"{label}: the dask workers running it died (killed, or out of memory); nothing of it is kept"))
            finally:
                client.cancel(futures)
    finally:
        if cluster is not None:
            cluster.close()
