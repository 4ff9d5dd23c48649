"""Isolation of the backward pass: taps on an API's inputs, hooks on its outputs' gradients, and the oracle's and
bench's vector-Jacobian products for the gradients the target received."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from .. import amp, kernels
from ..kernels import cast as _cast
from ..judge import judge_pair
from .support import _Call

#: the APIs whose gradients a convolution backward kernel computes (:meth:`BackwardIsolation._holds_partial_sums`)
_CONVOLUTIONS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                           "conv_transpose3d"})


class BackwardIsolation:
    """The backward half of an API call's isolation (taps, gradient hooks, reference VJPs, budgets).

    Args:
        refs: the oracle and bench of a call (:class:`~.references.References`).
        records: where each verdict is kept (:class:`~.records.Records`).
        loans: what the driving capture lends (:class:`~.records.Loans`: the hooks' wrapper, the fault log, the
            reproducer).
        budget: the :class:`~.budget.IsolationBudget` each judgement's time is charged to, or ``None``.

    Attributes:
        faults_at_tap: ``{backward node: [(fault, call number)]}``: the faults to apply to the gradients the API
            hands on, at its tap, this step (the capture's fault observer fills it).
    """

    def __init__(self, refs, records, loans, budget=None):
        self.refs, self.records, self.loans, self.budget = refs, records, loans, budget
        self.faults_at_tap: dict[str, list] = {}

    def tap(self, call: _Call, bwd_name: str, args: tuple, kwargs: dict):
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
            node.register_prehook(self.tap_hook(call, bwd_name))
        return args, kwargs

    def grad_out_hook(self, call: _Call, i: int):
        def hook(grad: torch.Tensor) -> None:
            call.grad_out[i] = grad.detach()
        return self.loans.quiet(hook)

    def tap_hook(self, call: _Call, name: str):
        def prehook(grad_outputs):
            self.records.start(name)
            start = time.perf_counter()
            faults = self.faults_at_tap.pop(name, [])  # once: the same name at a later step is another call
            grads = tuple(grad_outputs)
            new = None
            if faults:  # the injector stands for a faulty backward kernel: it writes the gradients the API hands on
                new = grads
                for f, n in faults:
                    before, new = new, f.apply(new, n)
                    self.loans.on_fault_applied(f, before, new)
            try:
                self._judge_backward(call, name, list(new if new is not None else grads))
                record = self.records.results.get(name, {})
                if self.loans.reproducer is not None and record.get("status") == "error":
                    self.loans.reproducer.write(self.refs, call, "backward", record)
            except Exception as exc:  # noqa: BLE001 - never break the user's backward pass
                self.records.skip(name, f"backward isolation failed: {type(exc).__name__}: {exc}"[:200])
            finally:
                call.oracle_out = call.oracle_in = call.bench_out = call.bench_in = None
                call.inputs = call.raw = None
                if self.budget is not None:
                    self.budget.add(time.perf_counter() - start)
            return new
        return self.loans.quiet(prehook)

    def _judge_backward(self, call: _Call, name: str, targets: list) -> None:
        """Judge the gradients an API hands to its inputs (``targets``, by tap position) against the oracle's and
        the bench's vector-Jacobian products for the same incoming gradients."""
        if not call.grad_out:
            self.records.skip(name, "no gradient reached the API's outputs through a hook (nothing to compare with)")
            return
        def off():
            return amp.disabled(call.inputs) if call.autocast is not None else contextlib.nullcontext()
        pieces = self._pieces(call)
        if pieces is not None:
            if not self._rerunnable(call, name):
                return
            with off():
                oracle, bench = self._in_pieces(call, pieces)
            self._judge_gradients(call, name, targets, oracle, bench, call.oracle_how[0] == torch.float64)
            return
        with off():  # a call made under autocast: its references run on the inputs as its kernel saw them
            if not self._regraph(call, name):
                return
        args, kw = call.inputs
        f64 = bool(call.oracle_in) and call.oracle_in[0].dtype == torch.float64
        shared = self.refs.bench_is_oracle(call, args, kw)
        # one graph at a time: the oracle's is spent by its product and freed before the bench's is built (on
        # GPT-2's 50257-wide float64 loss the two graphs together were the whole check's peak memory)
        # a shared upcast/rounded bench is the oracle's product rounded once, unless the backward's kernels hold
        # intermediates (a broadcast operand's gradient summed over its copies): then the same graph's product
        # again, each kernel rounded (kernels.Materialized)
        probe = self.refs.probe(args, kw) if shared else None
        oracle = kernels.vjp(call.oracle_out, call.oracle_in, call.grad_out, None if probe is None else lambda: probe,
                             retain=probe is not None)
        bench = oracle
        if probe is not None and probe.read:
            bench = kernels.vjp(call.oracle_out, call.oracle_in, call.grad_out, self.refs.materialized(args, kw),
                                retain=False)
        call.oracle_out = call.oracle_in = None
        if not shared:
            with off():
                bench = self._bench_vjp(call, oracle)
        self._judge_gradients(call, name, targets, oracle, bench, f64)

    def _judge_gradients(self, call: _Call, name: str, targets: list, oracle: list, bench: list, f64: bool) -> None:
        """Judge the gradients the API handed on (``targets``, by tap position) against the oracle's and the
        bench's products (``f64``: the oracle computed in float64, for its note)."""
        stem = f"{name}.output"
        oracle = [self.refs.judged(g) for g in oracle]  # judged on the judge's device, the budget drawn on the CPU
        budget = self._backward_budget(call, len(targets), oracle)
        results, refs, reach = [], {}, []
        for i, t in enumerate(targets):
            if t is None:
                continue
            b = bench[i] if i < len(bench) else None
            o = oracle[i] if i < len(oracle) else None
            if o is None and b is None:
                continue
            if o is None:
                o = torch.zeros(t.shape, dtype=torch.float64, device=self.refs.judge_device)
            if i < len(call.grad_dtypes) and t.is_floating_point():
                # under autocast a gradient is as precise as the narrower of the dtype its kernel computed in and
                # the dtype the user's tensor holds (autocast's cast hands it back rounded to that): judged there,
                # the target cast exactly, the bench's gradient rounded as the cast's backward rounds it
                t = t.to(call.grad_dtypes[i])
                b = kernels.round_to(b, t)
            if call.bench_round:
                b = kernels.round_to(b, t)
            region = call.unwritten.get("grad", {}).get(i) if call.unwritten else None
            if region is not None:
                t, b, o = (kernels.zero_past(x, region) for x in (t, b, o))
            t, b = self.refs.judged(t), self.refs.judged(b)
            res = judge_pair(call.short, t, b, o, True, self.refs.standards, self.refs.thresholds,
                             terms=lambda i=i: budget(i))
            if res.status == "error" and self._holds_partial_sums(call, t):
                held = self._partial_sum_overflow(call, reach, i, t, b, o)
                if held is not None:
                    b, o, n = held
                    res = judge_pair(call.short, t, b, o, True, self.refs.standards, self.refs.thresholds,
                                     terms=lambda i=i: budget(i))
                    res = res.with_status(res.status, f"{res.message}; {n} element(s) overflowed where the "
                                                      "kernel's partial sums in the dtype may (sum of |terms| past "
                                                      "its largest value): the target's taken there")
            results.append((f"{stem}.{i}", res))
            refs[f"{stem}.{i}"] = o
        if results:
            self.records.store(name, results, refs)
            note = kernels.reference_note(call.func) if f64 else None
            if note:
                self.records.results[name]["oracle"] = note

    def _holds_partial_sums(self, call: _Call, t: Any) -> bool:
        """Whether the gradient ``t`` of this call came from a kernel holding its partial sums in ``t``'s dtype: a
        convolution's backward on a CPU half target where this CPU's kernel holds them
        (:func:`msprobe_ci.kernels.cpu_half_held`)."""
        return call.short in _CONVOLUTIONS and isinstance(t, torch.Tensor) and \
            t.dtype in (torch.float16, torch.bfloat16) and torch.device(self.refs.target_device).type == "cpu" and \
            "convolution_backward" in kernels.cpu_half_held(t.dtype)

    def _partial_sum_overflow(self, call: _Call, reach: list, i: int, t, b, o):
        """``(bench, oracle, n)`` with the target's values taken at the ``n`` elements where the target is inf or
        NaN and the bench is not the same, and the sum of the magnitudes of the element's terms is past the dtype's
        largest value: there a kernel adding its terms in the dtype (in any order) may pass the range on the way
        and keep the infinity (or reach ``inf - inf``), though the sum itself is in range (MobileNetV2's fp16
        weight gradients at a loss scale of 256, exact values of 1,600-65,000 whose terms' magnitudes add up to
        250,000-430,000, overflowed on the CPU; a ``GradScaler`` skips such a step).
        ``reach`` caches, per tap, the sums of magnitudes: the call's product on ``|inputs|`` and ``|incoming
        gradients|`` in float64. ``None`` where no such element is found."""
        if not (t.is_floating_point() and isinstance(o, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        bt = b.to(t.device)
        # the target's inf or NaN (inf - inf: its sums passed the range both ways) where the bench has another value
        over = ~torch.isfinite(t) & (t != bt) & ~(torch.isnan(t) & torch.isnan(bt))
        if not bool(over.any()):
            return None
        if not reach:
            args, kw = call.inputs

            def magnitude(x: torch.Tensor) -> torch.Tensor:
                return x.detach().abs().requires_grad_(x.requires_grad) if x.is_floating_point() else x
            leaves, out, _ = kernels.reference(call.func, kernels.cast(tuple(args), magnitude),
                                               {k: kernels.cast(v, magnitude) for k, v in kw.items()},
                                               torch.float64, "cpu", True)
            reach.extend(kernels.vjp(out, leaves, {k: g.abs() for k, g in call.grad_out.items()}, retain=False))
        r = reach[i] if i < len(reach) else None
        if not isinstance(r, torch.Tensor) or r.shape != t.shape:
            return None
        allowed = over & (r.to(t.device) > torch.finfo(t.dtype).max)
        n = int(allowed.sum())
        if not n:
            return None
        return (torch.where(allowed.to(b.device), t.to(device=b.device, dtype=b.dtype), b),
                torch.where(allowed.to(o.device), t.to(device=o.device, dtype=o.dtype), o), n)

    def _rerunnable(self, call: _Call, name: str) -> bool:
        """Whether the call's references can run again for its gradient: False (the gradient skipped, the reason
        said) where its inputs were not kept or were written in place since the call."""
        if call.inputs is None or call.oracle_how is None:
            self.records.skip(name, "the call's inputs were not kept (nothing to run its gradient on)")
            return False
        if not call.unchanged():
            self.records.skip(name, "its inputs were written in place after the call: its gradient is not isolated")
            return False
        return True

    def _oracle_run(self, call: _Call, args: tuple, kw: dict) -> tuple[list, Any]:
        """``(leaves, out)``: the call's oracle on copies of ``args``/``kw``, with its graph, as it ran at the call
        (its dtype; on the oracle's device, or the CPU only)."""
        dtype, cpu_only = call.oracle_how
        with torch.enable_grad():  # the autograd engine runs this hook with grad mode off
            if cpu_only:
                leaves, out, _ = kernels.reference(call.func, args, kw, dtype, "cpu", True)
            else:
                leaves, out, _ = self.refs.oracle(call.func, args, kw, dtype, True)
        return leaves, out

    def _regraph(self, call: _Call, name: str) -> bool:
        """Run the call's oracle again on its inputs, with its graph, for the vector-Jacobian product; False (the
        gradient skipped, the reason said) where the inputs were written in place since the call or the oracle
        cannot run."""
        if not self._rerunnable(call, name):
            return False
        call.oracle_in, call.oracle_out = self._oracle_run(call, *call.inputs)
        return True

    def _pieces(self, call: _Call):
        """The call's products cut along its batch (:func:`msprobe_ci.kernels.loss_pieces`: a batch-wise loss over a
        large input), or ``None``. Not where the ``upcast``/``rounded`` bench is the oracle's own run rounded
        (:meth:`~.references.References.bench_is_oracle`): that path shares one graph."""
        if call.inputs is None or call.oracle_how is None or not call.grad_out:
            return None
        args, kw = call.inputs
        pieces = kernels.loss_pieces(call.func, args, kw, call.grad_out)  # None at once for any other API
        if pieces is None or (self.refs.rounds_bench and not call.composite and
                              self.refs.bench_precision(args, kw) == call.oracle_how[0]):
            return None
        return pieces

    def _in_pieces(self, call: _Call, pieces) -> tuple[list, list]:
        """``(oracle, bench)`` gradients of a batch-wise loss (:class:`msprobe_ci.kernels.LossPieces`): the bench's
        product first (a ``device``/``decomposed`` bench whole, its own kernels; an ``upcast``/``rounded`` one,
        a higher-precision run rounded, in pieces too), then the oracle's in pieces beside it; where an
        ``upcast``/``rounded`` bench cannot run, the oracle's, as in the forward."""
        args, kw = call.inputs
        grad = call.grad_out[0]
        if self.refs.rounds_bench:
            def bench_run(a: tuple, k: dict) -> tuple[list, Any]:
                with torch.enable_grad():  # the autograd engine runs this hook with grad mode off
                    leaves, out, _ = self.refs.rounded_run(call.func, a, k, True)
                return leaves, out
            try:
                bench = pieces.vjp(bench_run, grad, self.refs.bench_context(args, kw))
            except Exception:  # noqa: BLE001 - no kernel in that precision: the best one there is, the oracle
                bench = None
        else:
            bench = self._bench_vjp(call, None)
        oracle = pieces.vjp(lambda a, k: self._oracle_run(call, a, k), grad)
        return oracle, oracle if bench is None else bench

    def _bench_vjp(self, call: _Call, oracle: list) -> list:
        """The same-dtype bench run again on the call's inputs with its graph, and its vector-Jacobian product for
        the gradients the target received (its graph freed by it); an ``upcast``/``rounded`` bench with no kernel
        in its precision is the oracle (``oracle``: its gradients), as in the forward."""
        args, kw = call.inputs
        try:
            with torch.enable_grad():  # the autograd engine runs this hook with grad mode off
                self.refs.bench(call, call.func, args, kw, True)
        except Exception:  # noqa: BLE001
            if not self.refs.rounds_bench:
                raise
            return oracle
        context = self.refs.bench_context(args, kw)
        try:
            return kernels.vjp(call.bench_out, call.bench_in, call.grad_out, context, retain=False)
        finally:
            call.bench_out = call.bench_in = None

    def _backward_budget(self, call: _Call, n: int, oracle: list):
        """The error scale of the gradient at tap ``i`` (:func:`msprobe_ci.kernels.backward_scale`), lazily
        (:meth:`.references.References.lazy_budget`; from the oracle's gradients where they are fp64)."""
        return self.refs.lazy_budget(call, n, lambda device: kernels.backward_scale(
            call.func, call.inputs[0], call.inputs[1], call.grad_out, self.refs.budget_draws,
            base=oracle, device=device))
