"""Multi-rank checks: spawn the ranks, capture bench and target on each, judge every rank and the run as a whole.

torch.distributed is the engine: ranks are processes started by ``torch.multiprocessing`` (spawn), joined over
``gloo`` on CPU (``nccl`` for CUDA, ``hccl`` for NPU targets), each on a free port of 127.0.0.1 chosen per check
(so checks under pytest-xdist do not collide). Every rank runs the bench side, then the target side, through
:func:`msprobe_ci.check.run_side` (isolation on the target), writing ``<check>/<side>/step0/rank<R>``. A rank that
raises ends the check with that rank's error; a rank killed by a signal, with the tail of its stderr
(``<check>/rank<R>.log``); a rank that hangs past ``timeout`` seconds is terminated and named. Ranks meet at a
barrier before they leave, so none closes its connections while a peer still works.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import MsprobeError


@dataclass(frozen=True)
class RankJob:
    """What every rank runs (pickled to the spawned processes)."""

    build: Callable[[int, int], Any]
    inputs: tuple
    loss_fn: Callable | None
    out: str
    sides: tuple  # ((side, device, dtype option, autocast option, compile), ...)
    level: str
    task: str
    seed: int
    faults: tuple
    judge: Any  # the check's JudgeSettings: isolation on or off, the isolator's standards, bench kernel, budget
    port: int
    backend: str
    oracle_device: str = "cpu"  # "cpu" or "target": each rank's own target device, at most its oracle_max
    optimizer: Callable | None = None  # with it, ``steps`` training steps per side (run_training)
    steps: int = 1


def takes_dtype(build: Callable) -> bool:
    """Whether ``build`` takes the side's dtype: a third positional parameter or a ``dtype`` keyword
    (``build(rank, world_size, dtype)``)."""
    import inspect

    try:
        params = list(inspect.signature(build).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params) or any(p.name == "dtype" for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


def build_side(build: Callable, rank: int, world: int, dtype) -> tuple[Any, bool]:
    """``(model, cast)``: this rank's model of one side, and whether the side casts it to its dtype. A ``build``
    that takes the dtype (:func:`takes_dtype`; ``None`` for ``model-dtype``) applies it itself, e.g. as an FSDP
    ``MixedPrecisionPolicy(param_dtype=dtype)``: its model is used as built."""
    if takes_dtype(build):
        return build(rank, world, dtype), False
    return build(rank, world), True


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, job: RankJob) -> None:  # runs in a spawned process
    import torch.distributed as dist

    from ..backends import Backend, compile_regions
    from .sides import compiled_note, run_side
    from ..config import DumpConfig

    _log_to(os.path.join(job.out, f"rank{rank}.log"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port))
    dist.init_process_group(job.backend, rank=rank, world_size=world)
    try:
        for side, device, dtype, autocast, compiled in job.sides:
            backend = Backend.from_options(device, dtype, compiled, autocast=autocast)
            isolator = None
            if side == "target" and job.judge.isolate:
                from ..isolate import Isolator

                isolator = Isolator.from_settings(job.judge, target_device=backend.torch_device,
                                                  backward=job.loss_fn is not None,
                                                  **backend.oracle_options(job.oracle_device))
            cfg = DumpConfig(dump_path=os.path.join(job.out, side), level=job.level, task=job.task)
            model, cast = build_side(job.build, rank, world, backend.dtype)
            faults = job.faults if side == "target" else ()
            # the model was built for this side: never copied (FSDP models cannot be)
            if job.optimizer is not None:
                from .training import run_training

                batch = job.inputs[0] if len(job.inputs) == 1 else job.inputs
                run = run_training(model, [batch] * job.steps, job.loss_fn, job.optimizer, backend, cfg,
                                   faults=faults, seed=job.seed, isolator=isolator, owned=True, cast=cast)
            else:
                # a compiled side: its blocks compiled by prepare_model, opaque to capture (judged whole)
                regions = compile_regions(model) if backend.compile else []
                run = run_side(model, job.inputs, job.loss_fn, backend, cfg, faults=faults, seed=job.seed,
                               isolator=isolator, owned=True, cast=cast, regions=regions)
            if run.unapplied:
                with open(os.path.join(job.out, f"unapplied.rank{rank}.txt"), "w", encoding="utf-8") as fh:
                    fh.write("\n".join(run.unapplied))
            notes = (() if job.optimizer is not None else compiled_note(backend, regions)) + tuple(run.notes)
            if notes:
                with open(os.path.join(job.out, f"notes.{side}.rank{rank}.txt"), "w", encoding="utf-8") as fh:
                    fh.write("\n".join(notes))
        # no rank leaves while a peer still works: a rank whose peer closed its gloo connections mid-run aborts
        # (gloo's IoException "Connection closed by peer" is thrown in its I/O thread: SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def rank_notes(out: str, rank: int) -> tuple[str, ...]:
    """The report lines a rank's bench and target runs left in ``out`` (``notes.<side>.rank<R>.txt``: how a side
    ran, e.g. an API without a float64 kernel run in float32), bench first."""
    lines: list[str] = []
    for side in ("bench", "target"):
        try:
            with open(os.path.join(out, f"notes.{side}.rank{rank}.txt"), encoding="utf-8") as fh:
                lines += [ln for ln in fh.read().splitlines() if ln]
        except OSError:
            continue
    return tuple(lines)


def _log_to(path: str) -> None:
    """Send this process's stderr (Python's and native code's, e.g. a C++ ``terminate`` message) to ``path``
    (``<check>/rank<R>.log``) instead of the terminal: its tail goes into the error when the rank dies by a
    signal, where a spawned process leaves no Python traceback."""
    import sys

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)


def _log_tail(path: str, lines: int = 6) -> str:
    """The last ``lines`` non-empty lines of a rank's log, joined by `` | `` (empty when there is none)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()[-20000:]
    except OSError:
        return ""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])


def run_ranks(job: RankJob, world: int, timeout: float) -> None:
    """Spawn ``world`` ranks running ``job`` and wait for them.

    Raises:
        MsprobeError: ``build``/``loss_fn``/inputs cannot be sent to a process (not module-level), a rank raised
            (its exception's last line and the rank), or ranks still ran after ``timeout`` seconds (terminated).
    """
    import torch.multiprocessing as mp

    try:
        pickle.dumps(job)
    except Exception as exc:  # noqa: BLE001 - lambdas, closures, local classes
        raise MsprobeError(f"check_parallel: build, loss_fn and inputs are sent to spawned rank processes and must "
                           f"be picklable (module-level functions): {type(exc).__name__}: {exc}") from None
    ctx = mp.start_processes(_rank_main, args=(world, job), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                raise MsprobeError(f"check_parallel: rank(s) {alive} still running after {timeout:g} s (hung in a "
                                   "collective?); terminated")
    except mp.ProcessRaisedException as exc:
        last = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        raise MsprobeError(f"check_parallel: rank {exc.error_index} raised: {last[-1] if last else exc}") from None
    except mp.ProcessExitedException as exc:
        log = os.path.join(job.out, f"rank{exc.error_index}.log")
        tail = _log_tail(log)
        raise MsprobeError(f"check_parallel: rank {exc.error_index} exited with code {exc.exit_code}"
                           + (f"; its log ({log}) ends: {tail}" if tail else "")) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)


def unapplied_faults_on_ranks(faults, world: int, check_dir: str) -> list[str]:
    """Faults that changed a value on none of the ranks they target (each rank lists its faults that never fired
    or changed nothing in ``unapplied.rank<R>.txt``)."""
    out = []
    for f in faults:
        ranks = [r for r in range(world) if f.on_rank(r)]
        files = [os.path.join(check_dir, f"unapplied.rank{r}.txt") for r in ranks]
        if ranks and all(os.path.isfile(p) and f"fault {f.api}" in _text(p) for p in files):
            # the first rank's own reason (e.g. the call ran inside a torch.compile region)
            lines = [ln for ln in _text(files[0]).splitlines() if ln.startswith(f"fault {f.api}")]
            why = lines[0].split(": ", 1)[1] if lines and ": " in lines[0] else ""
            out.append(f"fault {f.api} never fired or changed no value on rank(s) {ranks}"
                       + (f": {why}" if why else ""))
    return out


def _text(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()
