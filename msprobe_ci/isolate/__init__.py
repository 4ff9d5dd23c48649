"""Isolation: judge every captured API call on the target's *own* inputs, while the target runs.

msprobe's online_dispatch idea at API level, with the per-API standards of :mod:`msprobe_ci.checkers`: for each
recorded API call on the target side,

1. the **oracle** is the same function on CPU with every floating input upcast: fp16/bf16-only calls to fp32,
   anything else to fp64 (msprobe's ``PRECISION_MAPPING``; fp32 where no fp64 kernel exists), computed *before*
   the target call on copies (so in-place APIs and BatchNorm running statistics are never touched twice);
2. the **same-dtype bench** is computed on its own copies of the inputs by the chosen bench kernel
   (:mod:`msprobe_ci.kernels`: the bench device's kernel, one precision up, correctly rounded, or other real CPU
   kernels), never taken from the target's own result: the judge reads tensors, not the fault plan;
3. every output is judged by :func:`msprobe_ci.judge.judge_pair` (the pre-check's registry, thresholds and
   user overrides: one rule for pre-check and isolation); a benchmark-standard output that is not bit-identical to
   its bench is judged against the error scale its dtype and arithmetic allow
   (:func:`msprobe_ci.kernels.forward_scale`), computed only then;
4. **backward**: the API's tensor inputs that require grad pass through an identity autograd node (a *tap*, torch's
   own ``BackwardHookFunction``, as module full-backward hooks use), so the gradients the API produces w.r.t. its
   inputs are seen exactly; the gradients arriving at its outputs are taken by tensor hooks; the oracle's and the
   bench's saved graphs give the reference vector-Jacobian products for those same upstream gradients (and
   :func:`msprobe_ci.kernels.backward_scale` their budget, when the target differs from the bench).

Only metrics are kept (no tensors), so isolation works with the statistics task, against a recorded baseline and
on a runner whose only other device is a CPU. What cannot be judged gets a named skip: random ops (dropout is
judged by its zero share), uninitialised memory, device-only ops, in-place ops in backward, calls whose oracle
fails on CPU. Collectives are judged on the inputs every rank of their group gave them
(:mod:`msprobe_ci.isolate.collectives`).

**Sources.** A tensor input that no torch call of the run produced (a parameter, a buffer, a model input) is a
*source*: it is judged against the bench dump at compare time, at the first node that consumes it, together with
non-tensor arguments (scalars, shapes). Isolation alone cannot see a wrong weight, because the API is right for
the inputs it was given.

Cost: one oracle forward per API (on the CPU, or on the target's device: ``oracle_device``) and one bench
forward, without graphs; for a call with a gradient both run
again on its inputs when the gradient arrives, with graphs, one at a time (the oracle's freed by its
vector-Jacobian product before the bench's is built); the standards' passes, in torch where the oracle ran when
it computes in float64 there (:attr:`Isolator.judge_device`), in slices; and for a call that differs from its
bench the budget's perturbed fp64 runs (:data:`msprobe_ci.kernels.DRAWS` + 1) where the standards judge
(:attr:`Isolator.budget_device`: beside a CUDA float64 oracle, else the CPU). Whole modules (L0, compiled
targets) keep their oracle, bench and budget runs on the CPU. Memory: each call with a gradient keeps its inputs (not its outputs)
until its gradient arrives.
"""

from __future__ import annotations

import time

import torch

from .. import kernels
from .api import ApiIsolation
from .backward import BackwardIsolation
from .budget import IsolationBudget
from .collectives import CollectiveIsolation
from .modules import ModuleIsolation
from .provenance import Provenance
from .records import Loans, Records
from .references import References
from ..judge.fields import headline, verdict_fields
from .support import is_inplace, _SCHEMA_VERSION


__all__ = ["Isolator", "headline", "is_inplace", "verdict_fields"]


def _setting(name: str, doc: str) -> property:
    """A read-only view of the isolator's :class:`~.references.References` setting ``name``."""
    return property(lambda self: getattr(self.refs, name), doc=doc)


class Isolator:
    """Isolation of one target capture: one object per part, built here and sharing only what they are given.

    * :attr:`refs` (:class:`~.references.References`): the settings, the oracle and the same-dtype bench of a call;
    * :attr:`records` (:class:`~.records.Records`): one step's verdicts, what could not be judged;
    * :attr:`provenance` (:class:`~.provenance.Provenance`): which inputs are sources;
    * :attr:`loans` (:class:`~.records.Loans`): what the driving capture lends (:meth:`attach`);
    * the parts that judge, each given the pieces above it needs: :attr:`api` (:class:`~.api.ApiIsolation`),
      :attr:`gradients` (:class:`~.backward.BackwardIsolation`), :attr:`modules`
      (:class:`~.modules.ModuleIsolation`), :attr:`collectives` (:class:`~.collectives.CollectiveIsolation`).

    The judge sees tensors only: the target's output (and the gradients it hands back), the oracle and the
    same-dtype bench, each computed from the target's own inputs; never the fault plan. Work is skipped only where
    the data proves it needless (a target bit-identical to the bench needs no error budget).

    Args:
        standards: ``{API fnmatch pattern: standard}`` overrides (as the pre-check's).
        thresholds: ``{standard: {threshold: value}}`` overrides.
        target_device: torch device string of the target (``cpu``, ``npu:0``).
        bench_device: where the same-dtype bench runs (default ``cpu``).
        backward: also isolate the backward pass (keeps the oracle and bench graphs until backward).
        bench_kernel: which kernel is the same-dtype bench of the benchmark standard (:mod:`msprobe_ci.kernels`):
            ``device`` (default), ``upcast``, ``rounded``, ``decomposed``.
        budget_draws: perturbed runs that size a benchmark-standard call's error budget
            (:func:`msprobe_ci.kernels.forward_scale`; default 3); 0 judges relative to ``|oracle|`` alone.
        oracle_device, oracle_max, oracle_label: where the oracle runs, the widest dtype it has there, the device
            as the user named it (:meth:`msprobe_ci.backends.Backend.oracle_options`; default the CPU in float64).
        budget: an :class:`~.budget.IsolationBudget` (budgeted isolation: every API kind each step, the other
            calls rotating within a cost factor), or ``None`` to isolate every call (the default).

    Raises:
        MsprobeError: an unknown bench kernel.
    """

    standards = _setting("standards", "``{API fnmatch pattern: standard}`` overrides.")
    thresholds = _setting("thresholds", "``{standard: {threshold: value}}`` overrides.")
    target_device = _setting("target_device", "The target's torch device string.")
    bench_device = _setting("bench_device", "Where the same-dtype bench runs.")
    backward = _setting("backward", "Whether gradients are isolated too.")
    bench_kernel = _setting("bench_kernel", "The same-dtype bench's kernel (``device``, ``upcast``, ...).")
    budget_draws = _setting("budget_draws", "Perturbed runs per error budget.")
    oracle_device = _setting("oracle_device", "Where the oracle runs.")
    oracle_max = _setting("oracle_max", "The widest dtype the oracle has on its device.")
    oracle_label = _setting("oracle_label", "The oracle's device as the user named it.")
    oracle_on_target = _setting("oracle_on_target", "Whether the oracle runs on the target's device.")
    judge_device = _setting("judge_device", "Where the per-API standards judge.")
    budget_device = _setting("budget_device", "Where the error budgets' perturbed runs are made.")
    oracle_fallbacks = _setting("oracle_fallbacks", "``{API: why}`` its oracle ran on the CPU.")
    budget_fallbacks = _setting("budget_fallbacks", "``{API: why}`` its error budget was drawn on the CPU.")

    def __init__(self, standards: dict | None = None, thresholds: dict | None = None, target_device: str = "cpu",
                 bench_device: str = "cpu", backward: bool = True, bench_kernel: str = "device",
                 budget_draws: int = kernels.DRAWS, oracle_device: str = "cpu",
                 oracle_max: torch.dtype = torch.float64, oracle_label: str | None = None,
                 budget: IsolationBudget | None = None):
        self.refs = References(standards, thresholds, target_device, bench_device, backward, bench_kernel,
                               budget_draws, oracle_device, oracle_max, oracle_label)
        self.budget = budget
        self.records = Records()
        self.provenance = Provenance()
        self.loans = Loans()
        self.gradients = BackwardIsolation(self.refs, self.records, self.loans, budget)
        self.api = ApiIsolation(self.refs, self.records, self.provenance, self.gradients, self.loans)
        self.modules = ModuleIsolation(self.refs, self.records, self.provenance, self.loans)
        self.collectives = CollectiveIsolation(self.refs, self.records, self.loans)
        self.reset()

    @classmethod
    def from_settings(cls, settings, *, target_device: str = "cpu", bench_device: str = "cpu", backward: bool = True,
                      **oracle) -> "Isolator":
        """The one way a check builds its isolator: the standards, thresholds, bench kernel and budget of a
        :class:`~msprobe_ci.judge.JudgeSettings`, on the given devices.

        Args:
            settings: the check's :class:`~msprobe_ci.judge.JudgeSettings`.
            target_device, bench_device: torch device strings. backward: isolate gradients too.
            oracle: ``oracle_device``, ``oracle_max``, ``oracle_label``
                (:meth:`msprobe_ci.backends.Backend.oracle_options`).
        """
        draws = kernels.DRAWS if settings.budget_draws is None else int(settings.budget_draws)
        budget = None if settings.isolate_budget is None else \
            IsolationBudget(settings.isolate_budget, settings.rotation_seed)
        return cls(standards=dict(settings.api_standards),
                   thresholds={k: dict(v) for k, v in settings.api_thresholds.items()},
                   target_device=target_device, bench_device=bench_device, backward=backward,
                   bench_kernel=settings.bench_kernel, budget_draws=draws, budget=budget, **oracle)

    # the records, the capture reads

    @property
    def results(self) -> dict[str, dict]:
        """``{node name: record}`` of this step (:attr:`.records.Records.results`)."""
        return self.records.results

    @property
    def unjudged(self) -> dict[str, str]:
        """``{node: why}``: calls that computed but could not be judged (:attr:`.records.Records.unjudged`)."""
        return self.records.unjudged

    @property
    def faults_at_tap(self) -> dict[str, list]:
        """``{backward node: [(fault, call number)]}`` to apply at the API's tap this step."""
        return self.gradients.faults_at_tap

    @property
    def reproducer(self):
        """The capture's reproducer (:class:`~msprobe_ci.capture.repro.Reproducer`), or ``None``."""
        return self.loans.reproducer

    def skip(self, name: str, reason: str) -> None:
        """``name`` is not judged, for ``reason``."""
        self.records.skip(name, reason)

    def reset(self, step: int | None = None) -> None:
        """Start a new step (``step``: its number, which moves a budget's rotation; ``None``: the same)."""
        if self.budget is not None:
            self.budget.start(self.budget.step if step is None else step)
        self.records.reset()
        self.provenance.reset()
        self.gradients.faults_at_tap.clear()

    def attach(self, *, quiet=None, on_fault_applied=None, reproducer=None) -> None:
        """What the capture that drives this isolator lends it (each None: left as it is; :class:`.records.Loans`).

        Args:
            quiet: wraps the isolation's own autograd hooks (their ops are the machinery's, not the model's).
            on_fault_applied: ``(fault, before, after)``, called when a fault is applied at a tap.
            reproducer: writes each failing call's standalone reproduction
                (:class:`msprobe_ci.capture.repro.Reproducer`).
        """
        if quiet is not None:
            self.loans.quiet = quiet
        if on_fault_applied is not None:
            self.loans.on_fault_applied = on_fault_applied
        if reproducer is not None:
            self.loans.reproducer = reproducer

    def as_json(self) -> dict:
        """isolation.json's content: the settings that matter to a reader, the budget's summary, every record."""
        return {"version": _SCHEMA_VERSION, "target_device": self.target_device, "bench_device": self.bench_device,
                "bench_kernel": self.bench_kernel, "split_k_gemms": self.split_k_gemms(),
                **({"budget": self.budget.summary()} if self.budget is not None else {}), "nodes": self.results}

    def split_k_gemms(self) -> list[str]:
        """:meth:`.references.References.split_k_gemms`."""
        return self.refs.split_k_gemms()

    # API calls

    def before(self, name: str, prefix: str, api: str, func, args: tuple, kwargs: dict):
        """:meth:`.api.ApiIsolation.before`, within the budget where there is one: a call it leaves out gets a
        ``skip`` record (``budget`` True) for its forward and its backward and runs as it is."""
        if self.budget is None:
            return self.api.before(name, prefix, api, func, args, kwargs)
        kind, call_no, _ = name.rsplit(".", 2)
        if not self.budget.take(kind, int(call_no) if call_no.isdigit() else 0):
            record = {"status": "skip", "message": self.budget.reason(), "budget": True}
            self.results[name] = dict(record)
            self.results[name[: -len("forward")] + "backward"] = dict(record)
            return None, args, kwargs
        start = time.perf_counter()
        try:
            return self.api.before(name, prefix, api, func, args, kwargs)
        finally:
            self.budget.add(time.perf_counter() - start)

    def after(self, call, out) -> None:
        """:meth:`.api.ApiIsolation.after`, its time charged to the budget where there is one."""
        if self.budget is None or call is None:
            return self.api.after(call, out)
        start = time.perf_counter()
        try:
            return self.api.after(call, out)
        finally:
            self.budget.add(time.perf_counter() - start)

    # provenance of the tensors the captured code passes around

    def is_produced(self, t: torch.Tensor) -> bool:
        """:meth:`.provenance.Provenance.is_produced`."""
        return self.provenance.is_produced(t)

    def mark_produced(self, value) -> None:
        """:meth:`.provenance.Provenance.mark_produced`."""
        self.provenance.mark_produced(value)

    def alias(self, new: torch.Tensor, old: torch.Tensor) -> None:
        """:meth:`.provenance.Provenance.alias`."""
        self.provenance.alias(new, old)

    def propagate(self, args: tuple, kwargs: dict, out) -> None:
        """:meth:`.provenance.Provenance.propagate`."""
        self.provenance.propagate(args, kwargs, out)

    # whole modules and collectives

    def module_before(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                      input_sources: bool = True):
        """:meth:`.modules.ModuleIsolation.module_before`."""
        return self.modules.module_before(name, module, args, kwargs, input_sources)

    def module_after(self, call, output) -> None:
        """:meth:`.modules.ModuleIsolation.module_after`."""
        self.modules.module_after(call, output)

    def module_backward(self, call, name: str, grad_input: tuple, grad_output: tuple) -> None:
        """:meth:`.modules.ModuleIsolation.module_backward`."""
        self.modules.module_backward(call, name, grad_input, grad_output)

    def judge_collective(self, name: str, op: str, args: tuple, kwargs: dict, before, group) -> None:
        """:meth:`.collectives.CollectiveIsolation.judge_collective`."""
        self.collectives.judge_collective(name, op, args, kwargs, before, group)
