"""Throughput helpers for the bulk phases (reading, comparing and graphing whole dumps)."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from typing import Any, Iterator

#: ``MSPROBE_CI_DEVICE_PATHS=1``: CPU tensors take the paths an accelerator's take where a host read would wait for
#: the device (:func:`reads_wait`), so the CPU runs, tests and counts what a device runs (``benchmarks/
#: host_syncs.py``); the verdicts are the same either way, a CPU run only does more work with it. Read at import;
#: a test sets the attribute.
DEVICE_PATHS = os.environ.get("MSPROBE_CI_DEVICE_PATHS", "") == "1"


def reads_wait(t: Any) -> bool:
    """Whether reading ``t``'s values on the host waits for its device: true off the CPU (each ``.item()``,
    ``float()``, ``bool()`` or ``tolist()`` there drains the device's queue first), and for CPU tensors too under
    :data:`DEVICE_PATHS`. Code that branches on it reads nothing per call where it is true (issue 51: no host
    synchronisation per hooked call), and where it is false takes the cheaper path a free read allows."""
    return takes_device_paths(t.device)


def takes_device_paths(device: Any) -> bool:
    """Whether work on ``device`` (a ``torch.device``) takes an accelerator's paths: off the CPU, and on it too under
    :data:`DEVICE_PATHS` (:func:`reads_wait`; the standards' float64 slices are then an accelerator's size too)."""
    return DEVICE_PATHS or device.type != "cpu"


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a bulk phase and restore it after (nesting-safe).

    Reading a dump builds millions of small, acyclic objects (JSON records, rows, nodes); the collector's
    generation-2 passes over them found nothing to free and cost about a third of a 30k-entry graph run
    (14.6 s -> 10 s measured, ``benchmarks/scale.py``). Reference counting still frees everything as usual.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def freeze_heap() -> bool:
    """Move every object alive now out of the cyclic collector's view until :func:`thaw_heap` (``gc.freeze``).

    While a capture runs, its records grow the heap and the collector's full (generation-2) passes walk every
    object of the process, torch's and the model's included, each time: on a step of 1,000 small hooked calls
    those passes were most of the capture's cost per call (``benchmarks/capture_overhead.py --size calls``).
    Frozen, they walk only what was made since. Garbage made during the capture is collected as always; cycles
    among the frozen objects wait for the thaw. Does nothing (returns False) where the collector is off or
    something else froze the heap already (a pre-fork server's own freeze is left as it is).

    Returns:
        Whether it froze (pass it to :func:`thaw_heap`).
    """
    if not gc.isenabled() or gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def thaw_heap(frozen: bool) -> None:
    """Undo :func:`freeze_heap` where it froze (``gc.unfreeze``)."""
    if frozen:
        gc.unfreeze()


@functools.lru_cache(maxsize=None)
def _glibc(name: str):
    """glibc's function ``name`` (``malloc_trim``, ``mallopt``), or ``None`` off glibc (musl, macOS, Windows)."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim(0)``; a no-op elsewhere).

    A side of a check frees its model copy, autograd graph and activations when it ends, but glibc keeps freed
    chunks below its mmap threshold in its arenas: after the fp32 bench side of GPT-2 small at 1024 tokens the
    process stayed at 3.9 GB resident with 0.7 GB of live tensors, and the target side then grew from there
    (``benchmarks/realistic_size.py``). Called between the phases of a check (after each side, after the
    judgement); it takes milliseconds.
    """
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


_M_MMAP_THRESHOLD = -3  # glibc malloc.h
_HEAP_BOUND = 1 << 20
_BOUNDED: list = []


def bound_heap() -> None:
    """Serve C allocations of 1 MiB and more from their own mappings, returned to the system when freed (glibc
    ``mallopt(M_MMAP_THRESHOLD, 1 MiB)``, once per process; a no-op elsewhere). ``MSPROBE_CI_HEAP=keep`` leaves
    glibc's policy alone (faster, more memory), ``MSPROBE_CI_HEAP=<bytes>`` sets another threshold; a
    ``MALLOC_MMAP_THRESHOLD_`` in the environment is glibc's own setting and wins.

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), so a forward pass's
    activations and the transient copies capture makes for statistics (a bf16 tensor's float32 view, freed at
    once) come from the heap, whose freed chunks stay resident and fragment: GPT-2 small at 1024 tokens, one bf16
    forward+backward under mix capture, peaked at 4.7 GB against 2.3 GB uncaptured, with the same live memory
    (2.0 GB) at the loss either way; with the threshold fixed at 1 MiB the captured step peaks at 2.4 GB. The
    price is a page fault per fresh block: ``benchmarks/realistic_size.py``'s check without isolation took 17.6 s
    and 3.3 GB instead of 15.0 s and 5.2 GB, with isolation 50.5 s and 5.0 GB instead of 36.2 s and 6.9 GB.
    Called when a check runs a side (``run_side``, ``run_training``, ``run_decode``): a check runs its sides,
    their copies and the judgement in one process, where the freed heap of one phase pinned the next (the
    isolation-off check of GPT-2 small at 1024 tokens peaked at 4,752 MB with a 32 MiB threshold, 3,038 MB with
    this one). A ``PrecisionDebugger`` or ``CaptureSession`` in a user's own process leaves that process's malloc
    policy alone: there the page faults were the capture's largest cost (a 4-layer transformer block, 8 x 128
    tokens, width 256: 1.87x the uncaptured step with the bound, 1.28x without, ``benchmarks/capture_overhead.py``;
    GPT-2 small's fp32 capture peaked at 4.9 GB without it, the uncaptured steps at 4.8 GB).

    Raises:
        MsprobeError: ``MSPROBE_CI_HEAP`` is neither ``keep`` nor a positive number of bytes.
    """
    if _BOUNDED:
        return
    import os

    choice = os.environ.get("MSPROBE_CI_HEAP", "").strip()
    if choice == "keep" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        _BOUNDED.append(None)
        return
    try:
        threshold = int(choice) if choice else _HEAP_BOUND
        if threshold <= 0:
            raise ValueError
    except ValueError:
        from .errors import MsprobeError

        raise MsprobeError(f"MSPROBE_CI_HEAP: expected 'keep' or a positive number of bytes, got {choice!r}") from None
    _BOUNDED.append(threshold)
    mallopt = _glibc("mallopt")
    if mallopt is not None:  # elsewhere the allocator keeps its own policy
        mallopt(_M_MMAP_THRESHOLD, threshold)
