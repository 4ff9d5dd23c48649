"""``PrecisionDebugger``: msprobe's dump entry point, so msprobe users switch by changing one import.

    from msprobe_ci import PrecisionDebugger      # was: from msprobe.pytorch import PrecisionDebugger
    debugger = PrecisionDebugger(config_path="config.json")
    for batch in loader:
        debugger.start(model)
        loss = model(batch).sum(); loss.backward()
        debugger.stop()
        debugger.step()

Differences from msprobe, on purpose: constructing a debugger patches nothing (capture uses
``TorchFunctionMode`` and module hooks installed at ``start``), and each construction is a new, independent
debugger rather than a process-wide singleton.
"""

from __future__ import annotations

import os
from typing import Any

from .config import check_factor, load_config


class PrecisionDebugger:
    """Dump model data in msprobe's format.

    Args:
        config_path: an msprobe ``config.json``; ``None`` uses the defaults (task statistics, level L1).
        task: overrides the file's ``task`` (``statistics`` or ``tensor``).
        dump_path: overrides ``dump_path``.
        level: overrides ``level`` (``L0``, ``L1``, ``mix``).
        step: overrides ``step`` (list of ints / ``"a-b"`` ranges).
        isolate: also judge every captured API call on its own inputs while the model runs (not in msprobe;
            default ``True``, ``False`` to capture only): ``isolation.json`` is written beside each ``dump.json``,
            and ``msprobe-ci compare`` or ``msprobe.compare_dumps`` of this dump against a bench dump uses those
            verdicts (:mod:`msprobe_ci.isolate`) instead of inferring them from drift. It costs what the gate's
            isolation costs (docs/verdicts.md, "Cost").
        bench_kernel: with ``isolate``, the same-dtype bench of the benchmark standard (:mod:`msprobe_ci.kernels`;
            default ``device``: the API on the CPU in the model's dtypes).
        isolate_budget: with ``isolate``, budgeted isolation (not in msprobe; :mod:`msprobe_ci.isolate.budget`):
            the first call of each API kind judged every step, the others rotating across steps as far as keeps the
            isolated step within this factor of the capture alone (above 1, e.g. ``1.5``); each step's
            ``isolation.json`` says what was judged. Default ``None``: every call.
        rotation_seed: what seeds that rotation (default ``""``; the gate uses the test id).
        inject: faults to inject into the captured run (not in msprobe): a fault YAML file
            (:func:`~msprobe_ci.capture.inject.load_faults`) or :class:`~msprobe_ci.capture.inject.Fault` objects,
            to prove that a gate on these dumps names a known fault; default none.
        ddp_reduction: record a ``DistributedDataParallel`` model's gradient all_reduce (not in msprobe, whose
            capture cannot see it either: DDP's reducer sums the buckets in C++). At ``start()`` a DDP model without
            a comm hook of its own gets one that reduces through ``torch.distributed.all_reduce``
            (:func:`msprobe_ci.backends.record_ddp_reduction`: torch's reference hook's arithmetic, synchronous), so
            each bucket's reduction is recorded as ``Distributed.all_reduce.<n>.forward`` and, with ``isolate``,
            judged. It changes your model for good (DDP takes one hook): no overlap of the reduction with the
            backward pass from then on. Default ``False``.

    Raises:
        MsprobeError: invalid configuration (one line naming the field), or at ``start()`` a dump folder that
            already holds files.
    """

    def __init__(self, config_path: str | os.PathLike | None = None, task: str | None = None,
                 dump_path: str | os.PathLike | None = None, level: str | None = None, step: Any = None,
                 isolate: bool = True, bench_kernel: str = "device", inject: Any = None,
                 isolate_budget: float | None = None, rotation_seed: str = "", ddp_reduction: bool = False):
        from .capture import CaptureSession
        from .capture.inject import load_faults

        self.config = load_config(config_path, task=task, dump_path=dump_path, level=level, step=step)
        isolator = None
        budget = check_factor(isolate_budget, "PrecisionDebugger: isolate_budget")
        if isolate:
            from .isolate import Isolator

            from .judge.settings import JudgeSettings

            isolator = Isolator.from_settings(JudgeSettings(bench_kernel=bench_kernel, isolate_budget=budget,
                                                            rotation_seed=str(rotation_seed)))
        if inject is None:
            faults: tuple = ()
        elif isinstance(inject, (str, os.PathLike)):
            faults = load_faults(inject)
        else:
            faults = tuple(inject)
        self.session = CaptureSession(self.config, faults=faults, isolator=isolator)
        self._warned: set[int] = set()  # faults already said to be unapplied (step)
        self.ddp_reduction = bool(ddp_reduction)

    def start(self, model: Any = None, token_range: Any = None) -> None:
        """Begin recording; ``model`` (an ``nn.Module`` or list of them) is required at L0 and mix.

        Args:
            token_range: ``[a, b]``: record only the root model's forward calls a..b (0-based, counted from the
                first ``start``), as msprobe does for inference; generation steps outside the range run uncaptured.
        """
        if self.ddp_reduction and model is not None:
            from .backends import record_ddp_reduction

            for m in model if isinstance(model, (list, tuple)) else [model]:
                record_ddp_reduction(m)  # a DDP model without a hook of its own: once (it keeps the hook)
        self.session.start(model, token_range=token_range)

    def stop(self) -> None:
        """Stop recording and write this step's dump.json, stack.json and construct.json."""
        self.session.stop()

    def step(self) -> None:
        """Close the step: counters reset and the next ``start()`` writes ``step{N+1}``.

        An injected fault meant for the step just closed (its ``step``, or any step for one without) that never
        fired or changed no value there is said in a ``UserWarning``, once: a self-test of the gate with such a
        fault proves nothing (an fp16 step that overflowed under a loss scale leaves NaN, which no scale moves).
        """
        closed = self.session.current_step
        self.session.step()
        log, warned = self.session.fault_log, self._warned
        due = [i for i, f in enumerate(log.faults)
               if i not in log.changed and i not in warned and (f.step is None or f.step == closed)
               and f.on_rank(self.session.fault_rank)]
        if due:
            import warnings

            warned.update(due)
            lines = log.unapplied(self.session.fault_rank, "no such call ran in this step", only=due)
            if lines:
                warnings.warn(f"msprobe: step {closed}: {'; '.join(lines)}: a fault that never fires or changes no "
                              "value proves nothing about the gate", stacklevel=2)
