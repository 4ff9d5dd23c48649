"""The references of one isolated call: where and in what precision its oracle and its same-dtype bench run, on
copies of the target's own inputs, and where the standards judge them. Settings and computations only: no record
of any call is kept here (:mod:`.records` keeps them)."""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels
from ..kernels import tensors_of as _tensors
from .support import _Call


class References:
    """The oracle and the same-dtype bench of an isolated call, by an :class:`~msprobe_ci.isolate.Isolator`'s
    settings (its arguments of the same names; read-only once built).

    Attributes:
        oracle_fallbacks: ``{API: why}``: each API whose oracle ran on the CPU rather than on ``oracle_device``.
        budget_fallbacks: ``{API: why}``: each API whose error budget was drawn on the CPU rather than on
            :attr:`budget_device`.
    """

    def __init__(self, standards: dict | None = None, thresholds: dict | None = None, target_device: str = "cpu",
                 bench_device: str = "cpu", backward: bool = True, bench_kernel: str = "device",
                 budget_draws: int = kernels.DRAWS, oracle_device: str = "cpu",
                 oracle_max: torch.dtype = torch.float64, oracle_label: str | None = None):
        self.standards = dict(standards or {})
        self.thresholds = {k: dict(v) for k, v in (thresholds or {}).items()}
        self.target_device = str(target_device)
        self.bench_device = str(bench_device)
        self.backward = backward
        self.bench_kernel = kernels.check_bench_kernel(bench_kernel)
        self.budget_draws = int(budget_draws)
        self.oracle_device = str(oracle_device)
        self.oracle_max = oracle_max
        self.oracle_label = oracle_label or self.oracle_device  # the device as the user named it (npu:0)
        self.oracle_fallbacks: dict[str, str] = {}
        self.budget_fallbacks: dict[str, str] = {}

    @property
    def oracle_on_target(self) -> bool:
        """Whether the oracle runs on the target's device (``--msprobe-oracle-device=target``) rather than as the
        CPU float64 oracle (a stand-in device whose tensors live on the CPU still has its precision limit)."""
        return self.oracle_device != "cpu" or self.oracle_max != torch.float64

    @property
    def judge_device(self) -> str:
        """Where the per-API standards judge: the oracle's device when it runs on the target's device in float64
        (CUDA), so its outputs and the target's are never copied to the host (the elementwise standards count
        there and bring back their counts and maxima); the CPU otherwise (an NPU's oracle is float32, and the
        standards judge in float64)."""
        return self.oracle_device if self.oracle_on_target and self.oracle_max == torch.float64 else "cpu"

    @property
    def budget_device(self) -> str:
        """Where the error budgets' perturbed float64 runs are made (:func:`msprobe_ci.kernels.forward_scale`):
        :attr:`judge_device`, so on CUDA with the float64 oracle there they run beside it and their scales are
        where the standards read them (issue 51: on an H100 the CPU's draws were most of an ``upcast`` bench's
        check); the CPU otherwise, and for any API whose runs fail there (:attr:`budget_fallbacks`)."""
        return self.judge_device

    def budget_runs(self, func, compute) -> list:
        """``compute(device)`` (a budget's scales) on :attr:`budget_device`, or on the CPU where it raises there
        (an op without a float64 kernel on the device): each API (``func``) that fell back is kept in
        :attr:`budget_fallbacks` with the reason. Raises what the CPU's run raises."""
        device = self.budget_device
        if device != "cpu":
            try:
                return compute(device)
            except Exception as exc:  # noqa: BLE001 - the CPU's float64 then
                first = str(exc).splitlines()[0][:120] if str(exc) else ""
                self.budget_fallbacks.setdefault(kernels._qualified(func), f"{type(exc).__name__} on {device}: "
                                                                           f"{first}")
        return compute("cpu")

    def judged(self, v: Any) -> Any:
        """``v`` detached on :attr:`judge_device` (a non-tensor as it is)."""
        return v.detach().to(self.judge_device) if isinstance(v, torch.Tensor) else v

    @property
    def rounds_bench(self) -> bool:
        """Whether the same-dtype bench is a higher-precision run rounded to the target's dtype (``upcast``,
        ``rounded``) rather than a kernel of the target's dtype (``device``, ``decomposed``)."""
        return self.bench_kernel in ("upcast", "rounded")

    def split_k_gemms(self) -> list[str]:
        """The target dtypes whose GEMMs the ``upcast``/``rounded`` bench splits as the target's may split them
        (:func:`msprobe_ci.kernels.reduced_precision_reduction`): empty off CUDA or with the flags off."""
        if not self.rounds_bench:
            return []
        return [str(d).replace("torch.", "") for d in (torch.bfloat16, torch.float16)
                if kernels.reduced_precision_reduction(self.target_device, d)]

    def oracle(self, func, args: tuple, kw: dict, dtype: torch.dtype, grad: bool, probe=None):
        """:func:`~msprobe_ci.kernels.reference` in ``dtype`` on ``oracle_device``, or on CPU where that device
        offers no such precision (``oracle_max``: float32 on an NPU, as msprobe's own bench upcast) or the call
        fails there; each API that fell back is kept in :attr:`oracle_fallbacks` with the reason. ``probe``: a
        :class:`~msprobe_ci.kernels.Materialized` the run is recorded under (a fresh one per try)."""
        context = None if probe is None else (lambda: probe)
        device = self.oracle_device
        if self.oracle_on_target:
            name = kernels._qualified(func)
            if dtype.itemsize > self.oracle_max.itemsize:
                self.oracle_fallbacks.setdefault(name, f"{self.oracle_label} offers no "
                                                       f"{str(dtype).replace('torch.', '')} "
                                                       f"(at most {str(self.oracle_max).replace('torch.', '')})")
                device = "cpu"
            else:
                try:
                    return kernels.reference(func, args, kw, dtype, device, grad, context)
                except Exception as exc:  # noqa: BLE001 - the device lacks the op in this dtype: CPU then
                    first = str(exc).splitlines()[0][:120] if str(exc) else ""
                    self.oracle_fallbacks.setdefault(name, f"{type(exc).__name__} on {self.oracle_label}: {first}")
                    device = "cpu"
        return kernels.reference(func, args, kw, dtype, device, grad, context)

    def bench(self, call: _Call, func, args: tuple, kw: dict, grad: bool) -> None:
        """The same-dtype bench of one call, by ``bench_kernel`` (:mod:`msprobe_ci.kernels`), into
        ``call.bench_in``/``call.bench_out``."""
        kernel = self.bench_kernel
        if self.rounds_bench:
            call.bench_round = True
            if self.bench_is_oracle(call, args, kw):
                call.bench_in, call.bench_out = call.oracle_in, call.oracle_out  # the oracle is that computation
                return
            try:
                call.bench_in, call.bench_out, _ = self.rounded_run(func, args, kw, grad)
            except Exception:  # noqa: BLE001 - no kernel in that precision: the best one there is, the oracle
                if call.oracle_out is None:
                    raise
                call.bench_in, call.bench_out = call.oracle_in, call.oracle_out
            return
        context = kernels.decomposed if kernel == "decomposed" else None
        call.bench_in, call.bench_out, _ = kernels.reference(func, args, kw, None, self.bench_device, grad, context)

    def rounded_run(self, func, args: tuple, kw: dict, grad: bool) -> tuple:
        """The ``upcast``/``rounded`` bench's run of ``func`` (:func:`~msprobe_ci.kernels.reference`'s
        ``(leaves, out, copies)``): on copies in :meth:`bench_precision`, on the bench device (``rounded``: the
        CPU), each kernel rounded once (:meth:`materialized`). Raises what the run raises."""
        device = "cpu" if self.bench_kernel == "rounded" else self.bench_device
        return kernels.reference(func, args, kw, self.bench_precision(args, kw), device, grad,
                                 self.materialized(args, kw))

    def bench_context(self, args: tuple, kw: dict):
        """The context a bench's vector-Jacobian product runs in: the decomposed kernels, the ``upcast``/``rounded``
        bench's rounding (:meth:`materialized`), or none (``device``)."""
        if self.bench_kernel == "decomposed":
            return kernels.decomposed
        return self.materialized(args, kw) if self.rounds_bench else None

    def materialized(self, args: tuple, kw: dict):
        """The ``upcast``/``rounded`` bench's context: the call's kernels, each rounded once to the target dtype,
        its GEMMs split as the target's may split them (:class:`msprobe_ci.kernels.Materialized`)."""
        dtype = kernels.target_dtype(_tensors(args) + _tensors(kw))
        return kernels.materialized(dtype, kernels.reduced_precision_reduction(self.target_device, dtype))

    def probe(self, args: tuple, kw: dict) -> "kernels.Materialized":
        """A recording :class:`~msprobe_ci.kernels.Materialized` for the oracle's run: whether the ``upcast``/
        ``rounded`` bench must be a run of its own (an intermediate held, a GEMM split; only a CUDA target's
        GEMMs split, so elsewhere no dtype is looked for)."""
        split = self.target_device.startswith("cuda") and kernels.reduced_precision_reduction(
            self.target_device, kernels.target_dtype(_tensors(args) + _tensors(kw)))
        return kernels.Materialized(split=split)

    def bench_precision(self, args: tuple, kw: dict) -> torch.dtype:
        """The precision the ``upcast`` (one up from the inputs') or ``rounded`` (float64) bench computes in."""
        if self.bench_kernel == "upcast":
            return kernels.upcast_dtype(_tensors(args) + _tensors(kw))
        return torch.float64

    def bench_is_oracle(self, call: _Call, args: tuple, kw: dict) -> bool:
        """Whether the ``upcast``/``rounded`` bench of a call is its oracle's own computation (the oracle's outputs
        and leaves are already in the bench's precision): then it is not run twice."""
        if not self.rounds_bench or call.oracle_out is None or call.composite:
            return False
        up = self.bench_precision(args, kw)
        return all(x.dtype == up for x in _tensors(call.oracle_out) if x.is_floating_point()) and \
            all(x.dtype == up for x in call.oracle_in if x is not None and x.is_floating_point())

    def lazy_budget(self, call: _Call, n: int, compute):
        """``budget(i)``: row ``i`` of ``compute(device)`` (a list of error scales drawn on ``device``:
        :meth:`budget_runs`), computed on first use, once per call, while the call's inputs are unchanged;
        ``None`` rows where it cannot be (no budget: relative to ``|oracle|`` alone, msprobe's own rule)."""
        cache: list = []

        def budget(i: int):
            if not self.budget_draws or call.inputs is None:
                return None
            if not cache:
                try:
                    if not call.unchanged():
                        raise RuntimeError("inputs written since the call")
                    cache.extend(self.budget_runs(call.func, compute))
                except Exception:  # noqa: BLE001 - no budget for this call
                    cache.extend([None] * n)
            return cache[i] if i < len(cache) else None
        return budget
