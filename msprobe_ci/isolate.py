"""Isolation: judge every captured API call on the target's *own* inputs, while the target runs.

msprobe's online_dispatch idea at API level, with the per-API standards of :mod:`msprobe_ci.checkers`: for each
recorded API call on the target side,

1. the **oracle** is the same function on CPU with every floating input upcast: fp16/bf16-only calls to fp32,
   anything else to fp64 (msprobe's ``PRECISION_MAPPING``; fp32 where no fp64 kernel exists), computed *before*
   the target call on copies (so in-place APIs and BatchNorm running statistics are never touched twice);
2. the **same-dtype bench** is computed on its own copies of the inputs by the chosen bench kernel
   (:mod:`msprobe_ci.kernels`: the bench device's kernel, one precision up, correctly rounded, or other real CPU
   kernels), never taken from the target's own result: the judge reads tensors, not the fault plan;
3. every output is judged by :func:`msprobe_ci.replay.runner.judge_pair` (the pre-check's registry, thresholds and
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
judged by its zero share), uninitialised memory, communication and device-only ops, in-place ops in backward,
calls whose oracle fails on CPU.

**Sources.** A tensor input that no torch call of the run produced (a parameter, a buffer, a model input) is a
*source*: it is judged against the bench dump at compare time, at the first node that consumes it, together with
non-tensor arguments (scalars, shapes). Isolation alone cannot see a wrong weight, because the API is right for
the inputs it was given.

Cost: one oracle forward per API on CPU and one bench forward (kept as graphs until backward when gradients are
captured), the checkers' NumPy passes, and for a call that differs from its bench the budget's perturbed fp64 runs
(:data:`msprobe_ci.kernels.DRAWS` + 1). Memory: the oracle and bench graphs live until the backward pass consumes
them.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from . import kernels
from .capture.coverage import quiet
from .kernels import cast as _cast
from .kernels import tensors_of as _tensors
from .replay.runner import judged_as
from .replay.runner import _outputs as _flat_outputs  # msprobe's output row naming

_UNSUPPORTED_PREFIX = {"Distributed": "communication op", "MindSpeed": "MindSpeed fused op",
                       "NPU": "torch_npu op with no CPU kernel", "Aten": "aten op", "VF": "torch._VF op"}
_RANDOM = frozenset({"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
                     "bernoulli_", "normal", "normal_", "multinomial", "uniform_", "exponential_", "random_",
                     "poisson", "rrelu", "rrelu_", "gumbel_softmax", "alpha_dropout", "feature_alpha_dropout"})
_NOT_COMPARABLE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_DROPOUT = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d"})
_SCHEMA_VERSION = 1


def is_inplace(short: str) -> bool:
    """``add_``, ``__iadd__``: the API writes into its first argument."""
    if short.startswith("__") and short.endswith("__"):
        return short.startswith("__i") and short not in ("__index__", "__int__", "__invert__")
    return short.endswith("_")


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _copy_obj(value: Any, conv, depth: int = 0) -> Any:
    """A copy of an argument with every tensor converted by ``conv``, objects included (a KV cache passed to a
    module is copied with its tensors, so re-running the module never appends to the user's cache)."""
    import copy

    if isinstance(value, torch.Tensor):
        return conv(value)
    if depth > 6 or value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype,
                                                        torch.device, torch.nn.Module, type)) or callable(value):
        return value
    if isinstance(value, list):
        return [_copy_obj(v, conv, depth + 1) for v in value]
    if isinstance(value, tuple):
        items = [_copy_obj(v, conv, depth + 1) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _copy_obj(v, conv, depth + 1)
        return out
    if hasattr(value, "__dict__"):
        try:
            out = copy.copy(value)
            for k, v in vars(value).items():
                setattr(out, k, _copy_obj(v, conv, depth + 1))
            return out
        except Exception:  # noqa: BLE001 - an object that cannot be copied is passed as it is
            return value
    return value


def headline(result) -> tuple[str, float, float]:
    """``(metric, value, threshold)`` of a :class:`~msprobe_ci.checkers.CheckResult`: the thresholded metric
    closest to (or furthest past) its threshold; ``(standard, 0, 0)`` when nothing is thresholded."""
    best = (result.standard, 0.0, 0.0, -math.inf)
    for k, v in (result.passing or {}).items():
        th = (result.thresholds or {}).get(k)
        if th is None or not isinstance(v, (int, float)):
            continue
        r = v / th if th > 0 else (math.inf if v > 0 else 0.0)
        if r > best[3]:
            best = (k, float(v), float(th), r)
    return best[0], best[1], best[2]


@dataclass
class _Call:
    name: str
    short: str
    direction_ok: bool = True
    oracle_in: list = field(default_factory=list)   # oracle leaves that need grad, by tap position
    oracle_out: Any = None
    bench_in: list = field(default_factory=list)
    bench_out: Any = None
    bench_round: bool = False  # the bench is a higher-precision result, rounded to the target's dtype when judged
    taps: int = 0
    grad_out: dict = field(default_factory=dict)
    out_tensors: list = field(default_factory=list)
    dropout: tuple | None = None
    func: Any = None
    inputs: tuple | None = None  # the target's (args, kwargs), for the error budget, until the call is judged
    versions: tuple = ()  # the inputs' version counters at the call: an input written since is not the call's
    # grouped GEMMs over a padded buffer: {"output": {i: (dim, end)}, "grad": {tap: (dim, end)}}, the elements
    # past ``end`` are uninitialised memory (kernels.unwritten) and judged as 0 on every side
    unwritten: dict = field(default_factory=dict)
    # how the oracle ran at the call, to run it again for the backward pass: (dtype, on the CPU only)
    oracle_how: tuple | None = None


class Isolator:
    """Per-step isolation state of one target capture.

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

    Raises:
        MsprobeError: an unknown bench kernel.

    Attributes:
        results: ``{node name: record}``; a record holds ``status`` (pass/warning/error/skip), ``standard``,
            ``metric``, ``value``, ``threshold``, ``row``, ``message``, ``metrics`` and, for forward calls,
            ``sources`` (``{row: {"id", "kind"}}``).
    """

    def __init__(self, standards: dict | None = None, thresholds: dict | None = None, target_device: str = "cpu",
                 bench_device: str = "cpu", backward: bool = True, bench_kernel: str = "device",
                 budget_draws: int = kernels.DRAWS, oracle_device: str = "cpu",
                 oracle_max: torch.dtype = torch.float64, oracle_label: str | None = None):
        self.oracle_device = str(oracle_device)
        self.oracle_label = oracle_label or self.oracle_device  # the device as the user named it (npu:0)
        self.oracle_max = oracle_max
        self.oracle_fallbacks: dict[str, str] = {}  # API -> why its oracle ran on CPU, not on oracle_device
        self.standards = dict(standards or {})
        self.thresholds = {k: dict(v) for k, v in (thresholds or {}).items()}
        self.target_device = str(target_device)
        self.bench_device = str(bench_device)
        self.bench_kernel = kernels.check_bench_kernel(bench_kernel)
        self.backward = backward
        self.budget_draws = int(budget_draws)
        self.faults_at_tap: dict[str, list] = {}
        self.reset()

    def reset(self) -> None:
        """Start a new step."""
        self.results: dict[str, dict] = {}
        self._clock: dict[str, float] = {}  # node -> perf_counter() when its isolation began
        self._produced: dict[int, weakref.ref] = {}
        self._sources: dict[int, tuple[weakref.ref, str]] = {}
        self.faults_at_tap.clear()

    # ------------------------------------------------------------------ provenance
    def _seen(self, table: dict, t: torch.Tensor):
        hit = table.get(id(t))
        if hit is None:
            return None
        ref = hit[0] if isinstance(hit, tuple) else hit
        return hit if ref() is t else None

    def is_produced(self, t: torch.Tensor) -> bool:
        return self._seen(self._produced, t) is not None

    def mark_produced(self, value: Any) -> None:
        """Tensors in ``value`` were computed by captured code (an API or a module): not sources."""
        for t in _tensors(value):
            try:
                self._produced[id(t)] = weakref.ref(t)
            except TypeError:
                pass

    def alias(self, new: torch.Tensor, old: torch.Tensor) -> None:
        """``new`` holds ``old``'s values (a module hook's copy of an input or output): the same provenance, a
        computed tensor or the same source."""
        if self.is_produced(old):
            self.mark_produced(new)
            return
        try:
            self._sources[id(new)] = (weakref.ref(new), self._source_id(old))
        except TypeError:
            pass

    def propagate(self, args: tuple, kwargs: dict, out: Any) -> None:
        """For calls that are not judged (views, indexing, dtype casts, factories): their outputs are computed,
        not sources. Sources are what enters from outside: parameters, buffers, the model's inputs."""
        if isinstance(out, (torch.Tensor, list, tuple)):
            self.mark_produced(out)

    def _source_id(self, t: torch.Tensor) -> str:
        hit = self._seen(self._sources, t)
        if hit is not None:
            return hit[1]
        sid = f"S{len(self._sources)}"
        self._sources[id(t)] = (weakref.ref(t), sid)
        return sid

    def _source_rows(self, name: str, short: str, args: tuple, kwargs: dict) -> dict[str, dict]:
        rows: dict[str, dict] = {}

        def visit(v: Any, row: str, key: str) -> None:
            if isinstance(v, torch.Tensor):
                if not self.is_produced(v):
                    kind = "parameter" if isinstance(v, torch.nn.Parameter) else "tensor"
                    rows[row] = {"id": self._source_id(v), "kind": kind}
            elif isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
                for j, x in enumerate(v):
                    visit(x, f"{row}.{j}", f"{key}.{j}")
            elif isinstance(v, (bool, int, float)) or v is None:
                rows[row] = {"id": f"scalar:{short}:{key}:{v!r}", "kind": "scalar"}
        for i, a in enumerate(args):
            visit(a, f"{name}.input.{i}", str(i))
        for k, v in kwargs.items():
            if k not in ("out", "dtype", "device", "layout", "memory_format"):
                visit(v, f"{name}.input.{k}", k)
        return rows

    # ------------------------------------------------------------------ forward
    def skip(self, name: str, reason: str) -> None:
        self.results[name] = {"status": "skip", "message": reason}

    def before(self, name: str, prefix: str, api: str, func, args: tuple, kwargs: dict):
        """Prepare the isolation of one call: sources, the oracle and the bench on copies of the inputs, taps.

        Returns:
            ``(call or None, args, kwargs)``: the arguments to call the target with (tapped where gradients are
            isolated).
        """
        self._clock[name] = time.perf_counter()
        short = api.rsplit(".", 1)[-1]
        fwd_sources = self._source_rows(name, short, args, kwargs)
        bwd_name = name[: -len("forward")] + "backward"
        reason = None
        if prefix in _UNSUPPORTED_PREFIX:
            reason = f"{prefix}.{api}: {_UNSUPPORTED_PREFIX[prefix]}, no CPU reference"
        elif short in _NOT_COMPARABLE:
            reason = f"{api}: uninitialised memory, not comparable"
        elif short in _RANDOM or (kwargs.get("dropout_p") or 0) > 0:
            reason = f"{api}: random output, not comparable element-wise"
        elif _has_dtensor(args) or _has_dtensor(kwargs):
            reason = (f"{api}: DTensor call (its sharding may redistribute inside the op): no single-device "
                      "reference; the rank-merged compare shows its drift")
        if reason:
            self.skip(name, reason)
            self.skip(bwd_name, reason)
            self.results[name]["sources"] = fwd_sources
            return None, args, kwargs
        call = _Call(name, judged_as(short, args, kwargs, self.standards), func=func)
        self.results[name] = {"status": "skip", "message": "no output judged", "sources": fwd_sources}
        if short in _DROPOUT:
            p = kwargs.get("p", args[1] if len(args) > 1 and isinstance(args[1], (int, float)) else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 and isinstance(args[2], bool) else True)
            call.dropout = (float(p), bool(training))
            call.inputs = (tuple(args), dict(kwargs))
            return call, args, kwargs
        kw = {k: v for k, v in kwargs.items() if k != "out"}
        # an in-place call (``relu_``, or ``F.relu(x, inplace=True)``) is judged forward only: tapping its input
        # for the gradient would hand it a view torch forbids writing in place
        want_grad = (self.backward and torch.is_grad_enabled() and not is_inplace(short) and
                     kw.get("inplace") is not True and
                     any(kernels.needs_grad(t) for t in _tensors(args) + _tensors(kw)))
        from .checkers import standard_for

        # bit-exact standards (data movement, selection) compare the target with the bench only; the oracle is for
        # the others, and for every gradient
        need_oracle = want_grad or standard_for(short, "torch.float32", self.standards) != "binary"
        if need_oracle:
            dtype = kernels.oracle_dtype(_tensors(args) + _tensors(kw))
            note = kernels.reference_note(func) if dtype == torch.float64 else None
            if note:
                self.results[name]["oracle"] = note
            # no graphs now: the forward is judged on values; the backward runs the oracle and the bench again on
            # the call's inputs when its gradient arrives (holding every call's graphs until then cost more memory
            # than the target's own step: 7 GB on GPT-2 small at 1024 tokens)
            try:
                call.oracle_in, call.oracle_out, copies = self._oracle(func, args, kw, dtype, False)
                call.oracle_how = (dtype, False)
            except Exception:  # noqa: BLE001 - an API without an fp64 CPU kernel: try fp32
                try:
                    dtype = torch.float32
                    call.oracle_in, call.oracle_out, copies = kernels.reference(func, args, kw, dtype, "cpu", False)
                    call.oracle_how = (dtype, True)
                except Exception as exc:  # noqa: BLE001 - unjudgeable, not a crash of the user's run
                    self.results[name].update(message=f"oracle failed on CPU: {type(exc).__name__}: "
                                                      f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")
                    return None, args, kwargs
            ins = {id(t) for t in _tensors(copies[0]) + _tensors(copies[1])}
            if want_grad and any(id(t) in ins for t in _tensors(call.oracle_out)):
                want_grad = False  # it returned an input: it wrote in place (F.leaky_relu(x, 0.1, True)), as above
        try:
            self._bench(call, func, args, kw, False)
        except Exception as exc:  # noqa: BLE001
            self.results[name].update(message=f"same-dtype bench ({self.bench_kernel}) failed on "
                                              f"{self.bench_device}: {type(exc).__name__}")
            return None, args, kwargs
        kept = tuple(args)
        if is_inplace(short) and self.budget_draws and kept and isinstance(kept[0], torch.Tensor) and \
                kept[0].is_floating_point():
            # the call overwrites its first argument: its error budget re-runs it on a copy of what it read
            # (AdamW's addcdiv_ on the weights cancels where a weight and its update nearly meet)
            kept = (kept[0].detach().clone(), *kept[1:])
        call.inputs = (kept, dict(kw))
        call.versions = tuple(t._version for t in _tensors(kept) + _tensors(kw))
        regions = kernels.unwritten(func, tuple(args), kw)
        if regions:
            taps = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad and
                    (a.is_floating_point() or a.is_complex())]
            call.unwritten = {"output": {i: r for (kind, i), r in regions.items() if kind == "output"},
                              "grad": {taps.index(k): r for (kind, k), r in regions.items()
                                       if kind == "input" and k in taps}}
        if want_grad:
            args, kwargs = self._tap(call, bwd_name, args, kwargs)
        return call, args, kwargs

    def _bench(self, call: _Call, func, args: tuple, kw: dict, grad: bool) -> None:
        """The same-dtype bench of one call, by :attr:`bench_kernel` (:mod:`msprobe_ci.kernels`)."""
        kernel = self.bench_kernel
        if kernel in ("upcast", "rounded"):
            call.bench_round = True
            up = kernels.upcast_dtype(_tensors(args) + _tensors(kw)) if kernel == "upcast" else torch.float64
            oracle_leaves = [x for x in call.oracle_in if x is not None]
            if call.oracle_out is not None and all(x.dtype == up for x in _tensors(call.oracle_out)
                                                   if x.is_floating_point()) and \
                    all(x.dtype == up for x in oracle_leaves if x.is_floating_point()):
                call.bench_in, call.bench_out = call.oracle_in, call.oracle_out  # the oracle is that computation
                return
            device = "cpu" if kernel == "rounded" else self.bench_device
            try:
                call.bench_in, call.bench_out, _ = kernels.reference(func, args, kw, up, device, grad)
            except Exception:  # noqa: BLE001 - no kernel in that precision: the best one there is, the oracle
                if call.oracle_out is None:
                    raise
                call.bench_in, call.bench_out = call.oracle_in, call.oracle_out
            return
        context = kernels.decomposed if kernel == "decomposed" else None
        call.bench_in, call.bench_out, _ = kernels.reference(func, args, kw, None, self.bench_device, grad, context)

    def _tap(self, call: _Call, bwd_name: str, args: tuple, kwargs: dict):
        from torch.nn.modules._functions import BackwardHookFunction

        slots: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                slots.append(t)
            return t
        _cast(tuple(args), collect)
        for v in kwargs.values():
            _cast(v, collect)
        slots = [t for t in slots if t.is_floating_point() or t.is_complex()]
        if not slots:
            return args, kwargs
        tapped = list(BackwardHookFunction.apply(*slots))
        it = iter(tapped)

        def swap(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                return next(it)
            return t
        args = _cast(tuple(args), swap)
        kwargs = {k: _cast(v, swap) for k, v in kwargs.items()}
        call.taps = len(tapped)
        node = tapped[0].grad_fn
        if node is not None:
            node.register_prehook(self._tap_hook(call, bwd_name))
        return args, kwargs

    def after(self, call: _Call | None, out: Any) -> None:
        """Judge the target's output ``out`` and arm the backward hooks."""
        self.mark_produced(out)
        if call is None:
            return
        from .checkers import make_standard
        from .replay.runner import judge_pair, judge_rows

        stem = f"{call.name}.output"
        targets = _flat_outputs(out, stem)
        if call.dropout is not None:
            p, training = call.dropout
            args, kwargs = call.inputs
            call.inputs = None
            x = args[0] if args else kwargs.get("input")
            results = []
            for row, t in targets:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and training and p > 0:
                    results.append((row, make_standard("dropout", t.dtype, p=p)(t)))
                elif isinstance(t, torch.Tensor):  # dropout off: the output is its input
                    results.append((row, judge_pair("identity", t, x, None, False, self.standards,
                                                    self.thresholds)))
            self._store(call.name, results)
            return
        oracles = {row: _cpu(o) for row, o in _flat_outputs(call.oracle_out, stem)} if call.oracle_out is not None \
            else {}  # judged on CPU wherever the oracle ran
        bench = dict(_flat_outputs(call.bench_out, stem))
        rows = []
        for i, (row, t) in enumerate(targets):
            b = bench.get(row)
            if call.bench_round:
                b = kernels.round_to(b, t)
            if isinstance(b, torch.Tensor) and isinstance(t, torch.Tensor) and b.device != t.device:
                b = b.to(t.device)
            o = oracles.get(row)
            region = call.unwritten.get("output", {}).get(i) if call.unwritten else None
            if region is not None:
                t, b, o = (kernels.zero_past(x, region) for x in (t, b, o))
            rows.append((row, _cpu(t), _cpu(b), o))
        results = judge_rows(call.short, rows, standards=self.standards, thresholds=self.thresholds,
                             inputs=(call.func, *call.inputs) if call.inputs is not None else None,
                             budget=self._forward_budget(call, stem, len(targets)))
        if not call.taps:
            call.inputs = None
        self._store(call.name, results, oracles)
        if call.taps:
            call.out_tensors = [t for _, t in targets if isinstance(t, torch.Tensor) and t.requires_grad]
            for i, t in enumerate(call.out_tensors):
                t.register_hook(self._grad_out_hook(call, i))
        call.oracle_out = call.oracle_in = call.bench_out = call.bench_in = None  # the backward runs them again

    @property
    def oracle_on_target(self) -> bool:
        """Whether the oracle runs on the target's device (``--msprobe-oracle-device=target``) rather than as the
        CPU float64 oracle (a stand-in device whose tensors live on the CPU still has its precision limit)."""
        return self.oracle_device != "cpu" or self.oracle_max != torch.float64

    def _oracle(self, func, args: tuple, kw: dict, dtype: torch.dtype, grad: bool):
        """:func:`~msprobe_ci.kernels.reference` in ``dtype`` on :attr:`oracle_device`, or on CPU where that device
        offers no such precision (:attr:`oracle_max`: float32 on an NPU, as msprobe's own bench upcast) or the
        call fails there; each API that fell back is kept in :attr:`oracle_fallbacks` with the reason."""
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
                    return kernels.reference(func, args, kw, dtype, device, grad)
                except Exception as exc:  # noqa: BLE001 - the device lacks the op in this dtype: CPU then
                    first = str(exc).splitlines()[0][:120] if str(exc) else ""
                    self.oracle_fallbacks.setdefault(name, f"{type(exc).__name__} on {self.oracle_label}: {first}")
                    device = "cpu"
        return kernels.reference(func, args, kw, dtype, device, grad)

    def _unchanged(self, call: _Call) -> bool:
        """Whether the call's inputs still hold the values it was called with (no in-place write since)."""
        return call.inputs is not None and \
            tuple(t._version for t in _tensors(call.inputs[0]) + _tensors(call.inputs[1])) == call.versions

    def _lazy_budget(self, call: _Call, n: int, compute):
        """``budget(i)``: row ``i`` of ``compute()`` (a list of error scales), computed on first use, once per
        call, while the call's inputs are unchanged; ``None`` rows where it cannot be (no budget: relative to
        ``|oracle|`` alone, msprobe's own rule)."""
        cache: list = []

        def budget(i: int):
            if not self.budget_draws or call.inputs is None:
                return None
            if not cache:
                try:
                    if not self._unchanged(call):
                        raise RuntimeError("inputs written since the call")
                    cache.extend(compute())
                except Exception:  # noqa: BLE001 - no budget for this call
                    cache.extend([None] * n)
            return cache[i] if i < len(cache) else None
        return budget

    def _forward_budget(self, call: _Call, stem: str, n: int):
        """The error scale of output row ``i`` (:func:`msprobe_ci.kernels.forward_scale`), lazily
        (:meth:`_lazy_budget`): only a benchmark-standard row that is not bit-identical to its bench asks."""
        return self._lazy_budget(call, n, lambda: kernels.forward_scale(
            call.func, call.inputs[0], call.inputs[1], lambda v: [x for _, x in _flat_outputs(v, stem)],
            self.budget_draws, base=kernels.cast(call.oracle_out, _cpu)))

    def _store(self, name: str, results: list, refs: dict | None = None) -> None:
        """Keep the verdict of ``name`` (its worst row); ``refs`` (``{row: reference tensor}``) give the
        magnitude of a failing row, said in the message when values are near zero."""
        from .checkers import worst

        keep = self.results.get(name, {})
        start = self._clock.pop(name, None)
        status = worst([r for _, r in results]) if results else "skip"
        bad = next(((row, r) for row, r in results if r.status == status), results[0] if results else None)
        rec = {"status": status, "sources": keep.get("sources", {})}
        if keep.get("oracle"):
            rec["oracle"] = keep["oracle"]
        if bad is None:
            rec["message"] = "no output judged"
        else:
            row, r = bad
            rec.update(verdict_fields(row, r))
            ref = (refs or {}).get(row)
            if status == "error" and isinstance(ref, torch.Tensor) and ref.numel() and ref.is_floating_point():
                mag = float(torch.nan_to_num(ref.detach().abs(), nan=0.0, posinf=0.0).amax())
                rec["magnitude"] = mag
                if mag < 1e-3:
                    rec["message"] += f"; values near zero: max |reference| {mag:.3g}"
        if start is not None:
            rec["seconds"] = round(time.perf_counter() - start, 6)
        self.results[name] = rec

    # ------------------------------------------------------------------ whole modules
    def module_before(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                      input_sources: bool = True):
        """Isolate a module whose APIs capture cannot see (L0 capture, a ``torch.compile`` region): its class's
        eager ``forward`` on the target's own inputs, through :func:`torch.func.functional_call` over *copies* of
        its parameters and buffers (BatchNorm running statistics, caches: no state of the model moves), in the
        oracle precision on CPU and in the target's dtype on the bench device (the eager reference of a compiled
        region; on a CPU target the same eager code). Judged by the benchmark standard (msprobe's default).

        Args:
            input_sources: also treat inputs that no torch call produced as sources (needs API capture to follow
                views and casts; at L0 only the module's own parameters are sources).

        Returns:
            the pending call for :meth:`module_after`, or ``None`` when the module cannot be isolated (the reason
            is recorded).
        """
        self._clock[name] = time.perf_counter()
        state = dict(module.named_parameters())
        # buffers as they are now: the call may update them in place (BatchNorm's running statistics), and the
        # budget's runs after it need the state the call saw (parameters only move at the optimizer step)
        state.update({k: b.detach().clone() for k, b in module.named_buffers()})
        sources = self._source_rows(name, "module", args, kwargs) if input_sources else {}
        for pname, p in module.named_parameters(recurse=False):
            if not self.is_produced(p):
                sources[f"{name}.parameters.{pname}"] = {"id": self._source_id(p), "kind": "parameter"}
        self.results[name] = {"status": "skip", "message": "no output judged", "sources": sources}
        random = [m for m in module.modules() if m.training and isinstance(m, _DROPOUT_MODULES) and m.p > 0]
        if random:
            self.results[name].update(message=f"module not isolated: random (dropout p={random[0].p} in training "
                                              "mode inside)")
            return None
        wrapper = _EagerForward(module)
        dtype = kernels.oracle_dtype(_tensors(tuple(args)) + list(state.values()) + _tensors(kwargs))
        grad = self.backward and torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point() for a in args)
        # the inputs' structure is snapshot (tensors by reference, the containers and objects that hold them
        # copied): a KV cache the target's own forward appends to stays as this call saw it, for the budget's runs
        call = _ModuleCall(name, wrapper, state, _copy_obj(tuple(args), _same), _copy_obj(dict(kwargs), _same))
        try:
            call.oracle = self._module_run(call, dtype, "cpu", grad)
            kernel = self.bench_kernel
            if kernel in ("upcast", "rounded"):
                call.bench_round = True
                up = dtype if kernel == "upcast" else torch.float64
                call.bench = call.oracle if up == dtype else self._module_run(call, up, "cpu", grad)
            else:
                call.bench = self._module_run(call, None, self.bench_device, grad,
                                              kernels.decomposed if kernel == "decomposed" else None)
        except Exception as exc:  # noqa: BLE001 - unjudgeable module, the user's run goes on
            self.results[name].update(message=f"module not isolated: {type(exc).__name__}: "
                                              f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")
            return None
        call.versions = tuple(t._version for t in _tensors(call.args) + list(state.values()) + _tensors(call.kwargs))
        return call

    @staticmethod
    def _module_run(call: "_ModuleCall", dtype, device, grad: bool = False, context=None, perturb=None):
        """``(leaves, output)``: ``leaves`` are the copies of the positional tensor inputs that need grad (the
        inputs a full backward hook reports gradients for), in order, ``None`` for the others. ``context`` and
        ``perturb`` as for :func:`msprobe_ci.kernels.reference`."""
        import contextlib

        conv = kernels.copier(dtype, device, perturb)
        st = {f"module.{k}": conv(v) for k, v in call.state.items()}
        leaves: list = []
        a = []
        for v in call.args:
            c = _copy_obj(v, conv)
            if isinstance(v, torch.Tensor):
                if grad and v.requires_grad and c.is_floating_point():
                    c.requires_grad_(True)
                    leaves.append(c)
                else:
                    leaves.append(None)
            a.append(c)
        k = {key: _copy_obj(v, conv) for key, v in call.kwargs.items()}
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))  # the user's random stream stays
            stack.enter_context(torch.set_grad_enabled(grad))
            if context is not None:
                stack.enter_context(context())
            if perturb is not None:
                stack.enter_context(kernels.Perturb(*perturb))
            out = torch.func.functional_call(call.wrapper, st, tuple(a), k, strict=False)
        return leaves, out

    def _module_scale(self, call: "_ModuleCall", grad_output: list | None = None) -> list:
        """The error scale (:mod:`msprobe_ci.kernels`) of a module's output tensors, or with ``grad_output`` of the
        gradients it hands to its positional inputs: the module re-run in fp64 with its inputs, state and every
        intermediate jittered. Empty when the inputs were written since the call or the runs fail.

        Twice the API budget's draws: a whole block sums many rounding sites, and its max relative error is the
        extreme of thousands of elements judged against their estimates, whose lower tail 4 draws leave wide (T5's
        first block backward failed max_rel_err 10.6 > 10 against the correctly rounded bench with 4, passes with
        8; faults named as often as with 4, `gate_quality.py --level L0 --bench-kernel all`)."""
        if not self.budget_draws or tuple(t._version for t in _tensors(call.args) + list(call.state.values()) +
                                          _tensors(call.kwargs)) != call.versions:
            return []
        eta = kernels._eta(torch.float64, kernels.target_roundoff(_tensors(call.args) + list(call.state.values())
                                                                  + _tensors(call.kwargs)))
        gen = torch.Generator().manual_seed(0x30D)
        grad = grad_output is not None

        def one(perturb):
            leaves, out = self._module_run(call, torch.float64, "cpu", grad, perturb=perturb)
            if grad:
                return self._module_vjp(out, leaves, grad_output, perturb)
            return _tensors(out)
        try:
            base = one(None)
            draws = [one((eta, gen)) for _ in range(kernels._draws(2 * self.budget_draws,
                                                                   [b for b in base if b is not None]))]
        except Exception:  # noqa: BLE001 - no budget: relative to |oracle| alone
            return []
        diffs = [[None if x is None or b is None or x.shape != b.shape else x.detach().to(torch.float64) -
                  b.detach().to(torch.float64) for x, b in zip(d, base)] for d in draws]
        return kernels._rms(diffs, eta)

    def module_after(self, call, output: Any) -> None:
        """Judge a module isolated by :meth:`module_before` (``call`` ``None``: nothing to do)."""
        if call is None:
            return
        from .replay.runner import judge_pair

        name = call.name
        stem = f"{name}.output"
        t_list, b_list, o_list = _tensors(output), _tensors(call.bench[1]), _tensors(call.oracle[1])
        if not (len(t_list) == len(b_list) == len(o_list)):
            self.results[name].update(message=f"module output structure differs on re-run ({len(t_list)} vs "
                                              f"{len(o_list)} tensors)")
            return
        scales: list = []

        def budget(i: int):
            if not scales:
                scales.extend(self._module_scale(call) or [None] * len(t_list))
            return scales[i] if i < len(scales) else None
        results = []
        for i, (t, b, o) in enumerate(zip(t_list, b_list, o_list)):
            if call.bench_round:
                b = kernels.round_to(b, t)
            results.append((f"{stem}.{i}", judge_pair("module", _cpu(t), _cpu(b), _cpu(o), False, self.standards,
                                                      self.thresholds, terms=lambda i=i: budget(i))))
        self._store(name, results, {f"{stem}.{i}": o for i, o in enumerate(o_list)})

    def module_backward(self, call, name: str, grad_input: tuple, grad_output: tuple) -> None:
        """Judge the gradients a whole-isolated module hands to its inputs (``grad_input``) against the
        vector-Jacobian products of its oracle and same-dtype bench graphs for the same ``grad_output``."""
        if call is None:
            return
        from .replay.runner import judge_pair

        (o_leaves, o_out), (b_leaves, b_out) = call.oracle, call.bench
        self._clock[name] = time.perf_counter()
        try:
            gout = [g for g in grad_output]
            results = []
            oracle = self._module_vjp(o_out, o_leaves, gout)
            context = kernels.decomposed if self.bench_kernel == "decomposed" else None
            bench = oracle if b_leaves is o_leaves else self._module_vjp(b_out, b_leaves, gout, context=context)
            scales: list = []

            def budget(i: int):
                if not scales:
                    scales.extend(self._module_scale(call, gout) or [None] * len(grad_input))
                return scales[i] if i < len(scales) else None
            k = 0
            for i, t in enumerate(grad_input):
                if t is None:
                    continue
                o = oracle[i] if i < len(oracle) else None
                b = bench[i] if i < len(bench) else None
                if call.bench_round:
                    b = kernels.round_to(b, t)
                if o is not None and b is not None and o.shape == t.shape and b.shape == t.shape:
                    results.append((f"{name}.output.{k}", judge_pair("module", _cpu(t), _cpu(b), _cpu(o), True,
                                                                     self.standards, self.thresholds,
                                                                     terms=lambda i=i: budget(i))))
                k += 1
            if results:
                self._store(name, results)
            else:
                self.skip(name, "no input gradient to judge")
        except Exception as exc:  # noqa: BLE001 - never break the user's backward pass
            self.skip(name, f"module backward not isolated: {type(exc).__name__}: {exc}"[:200])
        finally:
            call.oracle = call.bench = None

    @staticmethod
    def _module_vjp(out: Any, leaves: list, grad_output: list, perturb=None, context=None) -> list:
        import contextlib

        outs = [t for t in _tensors(out)]
        pairs = [(t, g) for t, g in zip(outs, grad_output) if g is not None and t.requires_grad]
        pos = [j for j, x in enumerate(leaves) if x is not None]
        if not pairs or not pos:
            return [None] * len(leaves)
        grads = [g.detach().to(device=t.device, dtype=t.dtype) for t, g in pairs]
        if perturb is not None:
            grads = [kernels.jitter(g, *perturb) for g in grads]
        with contextlib.ExitStack() as stack:
            if context is not None:
                stack.enter_context(context())
            if perturb is not None:
                stack.enter_context(kernels.Perturb(*perturb))
            got = torch.autograd.grad([t for t, _ in pairs], [leaves[j] for j in pos], grads, allow_unused=True)
        res: list = [None] * len(leaves)
        for j, g in zip(pos, got):
            res[j] = g
        return res

    # ------------------------------------------------------------------ backward
    def _grad_out_hook(self, call: _Call, i: int):
        def hook(grad: torch.Tensor) -> None:
            call.grad_out[i] = grad.detach()
        return quiet(hook)

    def _tap_hook(self, call: _Call, name: str):
        def prehook(grad_outputs):
            self._clock[name] = time.perf_counter()
            faults = self.faults_at_tap.pop(name, [])  # once: the same name at a later step is another call
            grads = tuple(grad_outputs)
            new = None
            if faults:  # the injector stands for a faulty backward kernel: it writes the gradients the API hands on
                new = grads
                for f, n in faults:
                    before, new = new, f.apply(new, n)
                    self.on_fault_applied(f, before, new)
            try:
                self._judge_backward(call, name, list(new if new is not None else grads))
            except Exception as exc:  # noqa: BLE001 - never break the user's backward pass
                self.results[name] = {"status": "skip", "message": f"backward isolation failed: "
                                                                   f"{type(exc).__name__}: {exc}"[:200]}
            finally:
                call.oracle_out = call.oracle_in = call.bench_out = call.bench_in = None
                call.out_tensors = []
                call.inputs = None
            return new
        return quiet(prehook)

    def on_fault_applied(self, fault, before, after) -> None:  # replaced by the capture session's FaultLog.record
        pass

    def _judge_backward(self, call: _Call, name: str, targets: list) -> None:
        """Judge the gradients an API hands to its inputs (``targets``, by tap position) against the oracle's and
        the bench's vector-Jacobian products for the same incoming gradients."""
        from .replay.runner import judge_pair

        stem = f"{name}.output"
        if not call.grad_out:
            self.skip(name, "no gradient reached the API's outputs through a hook (nothing to compare with)")
            return
        if not self._regraph(call, name):
            return
        oracle = kernels.vjp(call.oracle_out, call.oracle_in, call.grad_out)
        context = kernels.decomposed if self.bench_kernel == "decomposed" else None
        bench = oracle if call.bench_in is call.oracle_in else \
            kernels.vjp(call.bench_out, call.bench_in, call.grad_out, context)
        oracle = [_cpu(g) for g in oracle]  # judged (and its budget drawn) on CPU wherever the oracle ran
        budget = self._backward_budget(call, len(targets), oracle)
        results, refs = [], {}
        for i, t in enumerate(targets):
            if t is None:
                continue
            b = bench[i] if i < len(bench) else None
            o = oracle[i] if i < len(oracle) else None
            if o is None and b is None:
                continue
            if o is None:
                o = torch.zeros(t.shape, dtype=torch.float64)
            if call.bench_round:
                b = kernels.round_to(b, t)
            region = call.unwritten.get("grad", {}).get(i) if call.unwritten else None
            if region is not None:
                t, b, o = (kernels.zero_past(x, region) for x in (t, b, o))
            results.append((f"{stem}.{i}", judge_pair(call.short, _cpu(t), _cpu(b), o, True, self.standards,
                                                      self.thresholds, terms=lambda i=i: budget(i))))
            refs[f"{stem}.{i}"] = o
        if results:
            self._store(name, results, refs)
            note = kernels.reference_note(call.func) if call.oracle_in and \
                call.oracle_in[0].dtype == torch.float64 else None
            if note:
                self.results[name]["oracle"] = note

    def _regraph(self, call: _Call, name: str) -> bool:
        """Run the call's oracle and bench again on its inputs, with graphs, for the vector-Jacobian products;
        False (the gradient skipped, the reason said) where the inputs were written in place since the call or
        the oracle cannot run."""
        if call.inputs is None or call.oracle_how is None:
            self.skip(name, "the call's inputs were not kept (nothing to run its gradient on)")
            return False
        if not self._unchanged(call):
            self.skip(name, "its inputs were written in place after the call: its gradient is not isolated")
            return False
        args, kw = call.inputs
        dtype, cpu_only = call.oracle_how
        with torch.enable_grad():  # the autograd engine runs this hook with grad mode off
            if cpu_only:
                call.oracle_in, call.oracle_out, _ = kernels.reference(call.func, args, kw, dtype, "cpu", True)
            else:
                call.oracle_in, call.oracle_out, _ = self._oracle(call.func, args, kw, dtype, True)
            self._bench(call, call.func, args, kw, True)
        return True

    def _backward_budget(self, call: _Call, n: int, oracle: list):
        """The error scale of the gradient at tap ``i`` (:func:`msprobe_ci.kernels.backward_scale`), lazily
        (:meth:`_lazy_budget`; from the oracle's gradients where they are fp64)."""
        return self._lazy_budget(call, n, lambda: kernels.backward_scale(
            call.func, call.inputs[0], call.inputs[1], call.grad_out, self.budget_draws, base=oracle))

    # ------------------------------------------------------------------ output
    def as_json(self) -> dict:
        return {"version": _SCHEMA_VERSION, "target_device": self.target_device, "bench_device": self.bench_device,
                "bench_kernel": self.bench_kernel, "nodes": self.results}


_HALF = (torch.float16, torch.bfloat16)
_DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                    torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


@dataclass
class _ModuleCall:
    """A whole-isolated module call: its eager wrapper, the state and inputs it was called with, the oracle's and
    the bench's ``(leaves, output)``."""

    name: str
    wrapper: Any
    state: dict
    args: tuple
    kwargs: dict
    oracle: Any = None
    bench: Any = None
    bench_round: bool = False
    versions: tuple = ()


class _EagerForward(torch.nn.Module):
    """Calls the wrapped module's class ``forward`` (eager even when the instance's ``forward`` was replaced by a
    ``torch.compile`` wrapper), so :func:`torch.func.functional_call` can swap in copies of its state."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


def _cpu(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu() if v.device.type != "cpu" else v.detach()
    return v


def verdict_fields(row: str, result, note: str = "") -> dict[str, Any]:
    """The fields of an isolation record that say a row's verdict: standard, headline metric, value, threshold,
    row, message (``note`` appended) and every metric (non-finite numbers as strings, for JSON)."""
    metric, value, threshold = headline(result)
    return {"standard": result.standard, "metric": metric, "value": _num(value), "threshold": _num(threshold),
            "row": row, "message": f"{result.standard} {result.status}: {result.message}{note}",
            "metrics": {k: _num(v) for k, v in (result.metrics or {}).items()}}


def _num(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def _has_dtensor(value: Any, depth: int = 0) -> bool:
    """Whether a DTensor (``torch.distributed.tensor.DTensor``) is among the arguments (nested lists, tuples,
    dicts)."""
    if isinstance(value, torch.Tensor):
        return type(value) is not torch.Tensor and hasattr(value, "placements") and hasattr(value, "_local_tensor")
    if depth < 4 and isinstance(value, (list, tuple)):
        return any(_has_dtensor(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return any(_has_dtensor(v, depth + 1) for v in value.values())
    return False
