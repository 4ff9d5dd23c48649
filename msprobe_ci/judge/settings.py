"""What the judgement of one check is told, in one frozen object passed whole from every entry point.

The pytest fixture, the marker, ``msprobe-ci compare``, ``check_parallel``'s ranks, the offline ``check_dumps`` and
the benchmarks all build one :class:`JudgeSettings` (the checks from :attr:`msprobe_ci.check.CheckSettings.judge`)
and hand it on unchanged; a step of a loop changes one field with :meth:`JudgeSettings.replace`. The isolator of a
capture is built from it (:meth:`msprobe_ci.isolate.Isolator.from_settings`), the node judgement reads it
(:func:`msprobe_ci.check.outcome.judge`), the model-level cases and the per-API pre-check too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class JudgeSettings:
    """Every choice the judge makes from options, validated where the options are read.

    Attributes:
        isolate: judge each target API on its own inputs (its ``isolation.json``, or a tensor dump's calls
            replayed); False: the drift rule of two plain dumps. Default True.
        fuzzy: msprobe's fuzzy name matching of target and bench nodes. Default False.
        thresholds: the drift rule's factors (:class:`~msprobe_ci.compare.verdict.Thresholds`; ``None``: their
            defaults).
        cast_roundoff: the unit roundoff of casting the bench's values to the dtype the target computes in (0.0
            where the bench is coarser); sources may differ by it, and the model-level tolerance follows it.
        source_factor: how far sources (parameters, buffers, inputs, optimizer state) may differ from the bench, in
            units of ``u`` (default 4.0); ``inf`` from a training loop's second step on, where weights have trained
            apart by rounding (``sources_rule``).
        output_rtol: the model-level relative L2 tolerance (``None``: the dtype's default).
        level: the capture level (the per-API pre-check of a tensor dump needs API entries: ``L1`` or ``mix``).
        bench_kernel: the same-dtype bench of the per-API standards (:mod:`msprobe_ci.kernels`; ``device`` default).
        budget_draws: perturbed runs that size a benchmark-standard call's error budget (``None``: the kernels'
            default, :data:`msprobe_ci.kernels.DRAWS`).
        isolate_budget: budgeted isolation's cost factor (the isolated target step's time over its capture alone,
            above 1; :mod:`msprobe_ci.isolate.budget`), or ``None`` to isolate every call (the default).
        rotation_seed: what seeds budgeted isolation's rotation (the test id; default ``""``).
        api_standards: ``{API fnmatch pattern: standard}`` overrides of msprobe's registry.
        api_thresholds: ``{standard: {threshold: value}}`` overrides of ``checkers/data/thresholds.yaml``.
        mappings: msprobe's cross-framework mapping files (:class:`~msprobe_ci.compare.crossframe.Mappings`).
    """

    isolate: bool = True
    fuzzy: bool = False
    thresholds: Any = None
    cast_roundoff: float = 0.0
    source_factor: float = 4.0
    output_rtol: float | None = None
    level: str = "mix"
    bench_kernel: str = "device"
    budget_draws: int | None = None
    isolate_budget: float | None = None
    rotation_seed: str = ""
    api_standards: Mapping[str, str] = field(default_factory=dict)
    api_thresholds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    mappings: Any = None

    def replace(self, **changes: Any) -> "JudgeSettings":
        """A copy with ``changes`` (field names only; an unknown one raises TypeError)."""
        return dataclasses.replace(self, **changes)

    def for_step(self, step: int) -> "JudgeSettings":
        """The settings of step ``step`` of a loop: sources held to :attr:`source_factor` at step 0, context
        (``inf``) after it, where the weights and optimizer state have legitimately trained apart."""
        return self if step == 0 else self.replace(source_factor=math.inf)
