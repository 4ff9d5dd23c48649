"""One side of a check: the model copied onto a backend and run under capture (and isolation).

* :func:`run_side`: deep-copy the model onto a backend, run forward (and backward) under
  :class:`~msprobe_ci.capture.CaptureSession`, return the dump folder, the final outputs and the faults that never
  fired, as a :class:`SideRun`;
* :func:`precision_notes`, :func:`unapplied_faults`: what every mode's sides report about how they ran.
"""

from __future__ import annotations

from typing import Any, Callable

from .._perf import bound_heap, release_free_memory
from ..errors import MsprobeError
from .outcome import SideRun, flatten_outputs


def run_side(model: Any, inputs: tuple, loss_fn: Callable | None, backend, cfg, *, faults: tuple = (),
             seed: int = 1234, regions: list | tuple = (), eval_mode: bool = False, isolator=None,
             free_bench=None, spill_outputs: bool = False, owned: bool = False, cast: bool = True) -> SideRun:
    """Run ``model(*inputs)`` (one dict input: ``model(**inputs)``) on ``backend`` under capture.

    Args:
        model: the user's ``nn.Module`` (deep-copied by the backend, left untouched, unless ``owned``).
        inputs: positional inputs, or one dict of keyword inputs.
        loss_fn: maps the output to a scalar loss; its ``backward()`` is captured too.
        backend: a :class:`~msprobe_ci.backends.Backend`.
        cfg: the side's :class:`~msprobe_ci.config.DumpConfig` (dump_path = the side's folder).
        faults: :class:`~msprobe_ci.capture.inject.Fault` list (target side).
        seed: ``torch.manual_seed`` before the run (default 1234).
        regions: module paths compiled by the backend (no hooks inside).
        eval_mode: put the copy in eval mode.
        isolator: an :class:`~msprobe_ci.isolate.Isolator` (target side), or ``None``.
        free_bench: a :class:`~msprobe_ci.free_benchmark.FreeBenchmark` (a target with no bench), or ``None``.
        spill_outputs: final outputs of :data:`SPILL_BYTES` or more are written to a file in ``cfg.dump_path``
            after the forward pass, until the judgement reads them back (:meth:`SideRun.final_outputs`), rather
            than held in memory through the backward pass and the other side (GPT-2's fp32 logits at 1024 tokens
            are 206 MB).
        owned: ``model`` was built for this side alone: prepared in place, not copied (an FSDP-sharded model
            cannot be copied; :meth:`~msprobe_ci.backends.Backend.prepare_model`).
        cast: cast the model to the backend's dtype (default); ``False``: its build applied the dtype (an FSDP
            ``MixedPrecisionPolicy``), the model is used in its own dtypes.

    Raises:
        MsprobeError: nothing was captured.
    """
    import torch

    from ..backends import deterministic
    from ..capture import CaptureSession

    side_model = backend.prepare_model(model, eval_mode=eval_mode, owned=owned, cast=cast)
    side_inputs = backend.prepare_inputs(inputs)
    bound_heap()  # a check's sides and judgement share one process (msprobe_ci._perf.bound_heap)
    capture = CaptureSession(cfg, faults=faults, opaque_modules=regions, isolator=isolator, free_bench=free_bench)
    torch.manual_seed(seed)  # seeds every device's generator: identical dropout masks on one device type
    out = loss = spilled = None
    try:
        with deterministic():
            capture.start(side_model)
            with backend.autocast_context():  # the forward and the loss under the side's AMP, as users train
                if len(side_inputs) == 1 and isinstance(side_inputs[0], dict):
                    out = side_model(**side_inputs[0])
                else:
                    out = side_model(*side_inputs)
                if loss_fn is not None:
                    loss = loss_fn(out)
            # the final outputs are read before the backward pass and, when large, written out: the model's output
            # object is then not held through the backward (a plain step frees GPT-2's logits there)
            flat = capture.aside(_final_outputs, out, loss)
            out = None
            spilled = capture.aside(_spill, flat, cfg.dump_path) if spill_outputs else None
            if spilled:
                flat = []
            if loss_fn is not None:
                loss.backward()
            capture.stop()
    finally:
        capture.close()
        out = loss = side_model = side_inputs = None  # noqa: F841 - the side's graph and model copy go now
        release_free_memory()  # the side's model copy, graph and activations are freed: hand their pages back
    if not capture.folders:
        raise MsprobeError("nothing was captured (no torch API or submodule ran)")
    return SideRun(capture.folders[0], flat, unapplied_faults(faults, capture, bool(backend.compile)),
                   precision_notes(capture, backend), spilled)


def _final_outputs(out: Any, loss: Any) -> list:
    flat = flatten_outputs(out)
    if loss is not None:
        flat.append(("loss", loss.detach().float().cpu()))
    return flat


SPILL_BYTES = 32 << 20


def _spill(flat: list, folder: str) -> str | None:
    """Write the final outputs to a new file in ``folder`` when they hold :data:`SPILL_BYTES` or more; its path,
    or ``None`` (kept in memory) for smaller outputs."""
    import os
    import tempfile

    import torch

    if sum(t.numel() * t.element_size() for _, t in flat) < SPILL_BYTES:
        return None
    fd, path = tempfile.mkstemp(prefix="model-outputs-", suffix=".pt", dir=folder)
    with os.fdopen(fd, "wb") as fh:
        torch.save([(name, t) for name, t in flat], fh)
    return path


def compiled_note(backend, regions: list) -> tuple[str, ...]:
    """The report line of a loop's compiled side (none where ``regions`` is empty): the compile backend, the
    regions, and that every step was captured at L0."""
    if not regions:
        return ()
    from ..backends import compile_backend

    return (f"{backend.label}: compiled with {compile_backend()} ({len(regions)} region(s)); every step captured at "
            "L0, submodules inside compiled regions not captured",)


def precision_notes(capture, backend) -> tuple[str, ...]:
    """One report line per API the side ran below its dtype because it has no kernel there (a float64 bench's
    ``torch._grouped_mm``: :func:`~msprobe_ci.kernels.float32_fallback`)."""
    notes = tuple(f"{backend.label}: {api} has no float64 kernel: " + (
        "it ran in float64 as its reference decomposition (one matmul per group)" if how == "reference" else
        f"it ran in {how} (the best precision it supports), its outputs cast back to float64")
        for api, how in capture.precision_fallbacks.items())
    isolator = getattr(capture, "isolator", None)
    if isolator is not None and isolator.oracle_on_target:  # --msprobe-oracle-device=target
        notes += (f"oracle on {isolator.oracle_label} (at most {str(isolator.oracle_max).replace('torch.', '')}); "
                  f"{len(isolator.oracle_fallbacks)} API(s) fell back to the CPU oracle" +
                  "".join(f"; {api}: {why}" for api, why in list(isolator.oracle_fallbacks.items())[:5]) +
                  (" ..." if len(isolator.oracle_fallbacks) > 5 else ""),)
    if isolator is not None and isolator.budget_device != "cpu":
        falls = isolator.budget_fallbacks
        notes += (f"error budgets drawn on {isolator.budget_device} in float64; {len(falls)} API(s) drew on "
                  "the CPU" + "".join(f"; {api}: {why}" for api, why in list(falls.items())[:5]) +
                  (" ..." if len(falls) > 5 else ""),)
    return notes


def unapplied_faults(faults: tuple, capture, compiled: bool = False) -> tuple[str, ...]:
    """One line per fault meant for this rank that never fired in ``capture``, or fired and changed no value
    (:class:`~msprobe_ci.capture.inject.FaultLog`)."""
    why = ("it ran inside a torch.compile region, where APIs cannot be reached" if compiled
           else "no such call ran on the target")
    return capture.fault_log.unapplied(capture.fault_rank, why)
