"""Isolation of one API call, forward: the oracle and the same-dtype bench on copies of the target's own inputs,
the call's outputs judged by its per-API standard, the record stored."""

from __future__ import annotations

from typing import Any

import torch

from .. import amp, kernels
from ..kernels import tensors_of as _tensors
from ..checkers import standard_for
from ..judge import judge_dropout, judge_pair, judge_rows, judged_as, unjudgeable
from ..judge.rows import outputs as _flat_outputs  # msprobe's output row naming
from ..judge.support import DROPOUT
from .support import _Call, _has_dtensor, is_inplace, local_pointwise, to_local


class ApiIsolation:
    """``before`` / ``after`` one captured API call (:class:`~msprobe_ci.capture.CaptureSession` calls them).

    Args:
        refs: the oracle and bench of a call (:class:`~.references.References`).
        records: where each verdict is kept (:class:`~.records.Records`).
        provenance: which inputs are sources (:class:`~.provenance.Provenance`).
        gradients: the backward half, which taps a call's inputs (:class:`~.backward.BackwardIsolation`).
        loans: what the driving capture lends (:class:`~.records.Loans`: the reproducer).
    """

    def __init__(self, refs, records, provenance, gradients, loans):
        self.refs, self.records, self.provenance, self.gradients, self.loans = \
            refs, records, provenance, gradients, loans

    def before(self, name: str, prefix: str, api: str, func, args: tuple, kwargs: dict):
        """Prepare the isolation of one call: sources, the oracle and the bench on copies of the inputs, taps.

        Returns:
            ``(call or None, args, kwargs)``: the arguments to call the target with (tapped where gradients are
            isolated).
        """
        self.records.start(name)
        short = api.rsplit(".", 1)[-1]
        fwd_sources = self.provenance.source_rows(name, short, args, kwargs)
        bwd_name = name[: -len("forward")] + "backward"
        reason = unjudgeable(prefix, api, kwargs, short=short)
        local = None
        if reason is None and (_has_dtensor(args) or _has_dtensor(kwargs)):
            local = local_pointwise(short, args, kwargs)
            if local is None:
                reason = (f"{api}: DTensor call (its sharding may redistribute inside the op): no single-device "
                          "reference; the rank-merged compare shows its drift")
        if reason:
            self.records.skip(name, reason)
            self.records.skip(bwd_name, reason)
            self.records.results[name]["sources"] = fwd_sources
            return None, args, kwargs
        call = _Call(name, judged_as(short, args, kwargs, self.refs.standards), func=func)
        self.records.results[name] = {"status": "skip", "message": "no output judged", "sources": fwd_sources}
        if local is not None:
            # a pointwise op on DTensors of one sharding (an optimizer's update of FSDP's sharded parameters): the
            # rank computes it on its local shards, judged there; its gradient is not isolated
            return self._local_call(call, func, short, bwd_name, args, kwargs, *local)
        if short in DROPOUT:
            p = kwargs.get("p", args[1] if len(args) > 1 and isinstance(args[1], (int, float)) else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 and isinstance(args[2], bool) else True)
            call.dropout = (float(p), bool(training))
            kept = tuple(args)  # the torch-function protocol passes F.dropout's input positionally, even as input=
            inplace = kwargs.get("inplace", args[3] if len(args) > 3 and isinstance(args[3], bool) else False)
            if inplace is True and kept and isinstance(kept[0], torch.Tensor):
                # ``nn.Dropout(inplace=True)`` writes its mask into its input: the input's own zeros (the
                # standard's ``source``) are read from a copy taken before
                kept = (kept[0].detach().clone(), *kept[1:])
            call.inputs = (kept, dict(kwargs))
            return call, args, kwargs
        kw = {k: v for k, v in kwargs.items() if k != "out"}
        # an in-place call (``relu_``, or ``F.relu(x, inplace=True)``) is judged forward only: tapping its input
        # for the gradient would hand it a view torch forbids writing in place
        want_grad = (self.refs.backward and torch.is_grad_enabled() and not is_inplace(short) and
                     kw.get("inplace") is not True and
                     any(kernels.needs_grad(t) for t in _tensors(args) + _tensors(kw)))
        call.autocast = None if is_inplace(short) or "out" in kwargs else amp.autocast_dtype(args, kw)
        if call.autocast is None:
            ok, want_grad = self._references(call, func, args, kw, want_grad)
            if not ok:
                return None, args, kwargs
        # else: under autocast the kernel sees its inputs cast by the op's policy, which its output's dtype tells:
        # the oracle and the bench run in after(), on the inputs cast as the kernel saw them (msprobe_ci.amp)
        self._keep_inputs(call, short, args, kw)
        if self.loans.reproducer is not None:
            self._keep_raw(call, short, args, kwargs)
        regions = kernels.unwritten(func, tuple(args), kw)
        if regions:
            taps = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad and
                    (a.is_floating_point() or a.is_complex())]
            call.unwritten = {"output": {i: r for (kind, i), r in regions.items() if kind == "output"},
                              "grad": {taps.index(k): r for (kind, k), r in regions.items()
                                       if kind == "input" and k in taps}}
        if want_grad:
            args, kwargs = self.gradients.tap(call, bwd_name, args, kwargs)
        return call, args, kwargs

    def _keep_raw(self, call: _Call, short: str, args: tuple, kwargs: dict) -> None:
        """Keep what the call's reproduction needs (:mod:`msprobe_ci.repro`): its arguments as given (an in-place
        call's first argument as it was before the call), the grad mode and the autocast state."""
        raw = tuple(args)
        if (is_inplace(short) or kwargs.get("inplace") is True) and raw and isinstance(raw[0], torch.Tensor):
            kept = call.inputs[0][0] if call.inputs and call.inputs[0] else None
            raw = ((kept if kept is not None and kept is not raw[0] else raw[0].detach().clone()), *raw[1:])
        call.raw = (raw, dict(kwargs))
        call.grad_enabled = torch.is_grad_enabled()
        if call.autocast is not None:
            floating = [t for t in _tensors(args) + _tensors(kwargs) if t.is_floating_point()]
            call.autocast_state = {"device_type": floating[0].device.type, "dtype": str(call.autocast).replace(
                "torch.", "")}

    def _local_call(self, call: _Call, func, short: str, bwd_name: str, args: tuple, kwargs: dict,
                    largs: tuple, lkw: dict):
        """:meth:`before` of a pointwise call on DTensors (:func:`~.support.local_pointwise`): its references on the
        local shards ``largs``/``lkw``, the target called with its own ``args``/``kwargs``; :meth:`after` judges
        the local shard of its output."""
        if torch.is_grad_enabled() and any(kernels.needs_grad(t) for t in _tensors(args) + _tensors(kwargs)):
            self.records.skip(bwd_name, f"{call.short}: DTensor call judged on its local shards, forward only")
        call.local = True
        kw = {k: v for k, v in lkw.items() if k != "out"}
        ok, _ = self._references(call, func, largs, kw, False)
        if not ok:
            return None, args, kwargs
        self._keep_inputs(call, short, largs, kw)
        return call, args, kwargs

    def _keep_inputs(self, call: _Call, short: str, args: tuple, kw: dict) -> None:
        """Keep the call's inputs (and their versions) for its error budget and its gradient."""
        kept = tuple(args)
        if is_inplace(short) and self.refs.budget_draws and kept and isinstance(kept[0], torch.Tensor) and \
                kept[0].is_floating_point():
            # the call overwrites its first argument: its error budget re-runs it on a copy of what it read
            # (AdamW's addcdiv_ on the weights cancels where a weight and its update nearly meet)
            kept = (kept[0].detach().clone(), *kept[1:])
        call.inputs = (kept, dict(kw))
        call.versions = tuple(t._version for t in _tensors(kept) + _tensors(kw))

    def _references(self, call: _Call, func, args: tuple, kw: dict, want_grad: bool) -> tuple[bool, bool]:
        """The oracle (where the standard needs one) and the same-dtype bench of one call, on copies of ``args``.

        Returns:
            ``(ok, want_grad)``: ``ok`` False where neither could run (the reason in the call's record);
            ``want_grad`` False where the call returned an input (it wrote in place: its gradient is not tapped).
        """
        name = call.name
        # bit-exact standards (data movement, selection) compare the target with the bench only; the oracle is for
        # the others, and for every gradient
        need_oracle = want_grad or standard_for(call.short, "torch.float32", self.refs.standards) != "binary"
        if need_oracle:
            dtype = kernels.oracle_dtype(_tensors(args) + _tensors(kw))
            note = kernels.reference_note(func) if dtype == torch.float64 else None
            if note:
                self.records.results[name]["oracle"] = note
            # no graphs now: the forward is judged on values; the backward runs the oracle and the bench again on
            # the call's inputs when its gradient arrives (holding every call's graphs until then cost more memory
            # than the target's own step: 7 GB on GPT-2 small at 1024 tokens)
            # an upcast/rounded bench is this run rounded once, unless the call's kernels hold intermediates
            held = self.refs.rounds_bench
            probe = self.refs.probe(args, kw) if held else None
            try:
                call.oracle_in, call.oracle_out, copies = self.refs.oracle(func, args, kw, dtype, False, probe)
                call.oracle_how = (dtype, False)
            except Exception:  # noqa: BLE001 - an API without an fp64 CPU kernel: try fp32
                try:
                    dtype = torch.float32
                    probe = self.refs.probe(args, kw) if held else None
                    call.oracle_in, call.oracle_out, copies = kernels.reference(
                        func, args, kw, dtype, "cpu", False, None if probe is None else (lambda: probe))
                    call.oracle_how = (dtype, True)
                except Exception as exc:  # noqa: BLE001 - unjudgeable, not a crash of the user's run
                    self.records.unjudgeable(name, f"oracle failed on CPU: {type(exc).__name__}: "
                                                   f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")
                    return False, want_grad
            call.composite = probe is not None and probe.read
            ins = {id(t) for t in _tensors(copies[0]) + _tensors(copies[1])}
            if want_grad and any(id(t) in ins for t in _tensors(call.oracle_out)):
                want_grad = False  # it returned an input: it wrote in place (F.leaky_relu(x, 0.1, True)), as above
        try:
            self.refs.bench(call, func, args, kw, False)
        except Exception as exc:  # noqa: BLE001
            self.records.unjudgeable(name, f"same-dtype bench ({self.refs.bench_kernel}) failed on "
                                           f"{self.refs.bench_device}: {type(exc).__name__}")
            return False, want_grad
        return True, want_grad

    def after(self, call: _Call | None, out: Any) -> None:
        """Judge the target's output ``out`` and arm the backward hooks."""
        self.provenance.mark_produced(out)
        if call is None:
            return
        stem = f"{call.name}.output"
        targets = _flat_outputs(to_local(out) if call.local else out, stem)
        if call.dropout is not None:
            p, training = call.dropout
            args, kwargs = call.inputs
            call.inputs = None
            x = args[0] if args else kwargs.get("input")
            results = []
            for row, t in targets:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and training and p > 0:
                    results.append((row, judge_dropout(call.short, t, x, p, self.refs.thresholds)))
                elif isinstance(t, torch.Tensor):  # dropout off: the output is its input
                    results.append((row, judge_pair("identity", t, x, None, False, self.refs.standards,
                                                    self.refs.thresholds)))
            self.records.store(call.name, results)
            return
        if call.autocast is not None and not self._autocast_references(call, out):
            call.inputs = None
            return
        # judged where the oracle ran when that device computes in float64 (CUDA: the standards' passes there,
        # counts and maxima brought back), on the CPU otherwise
        oracles = {row: self.refs.judged(o) for row, o in _flat_outputs(call.oracle_out, stem)} \
            if call.oracle_out is not None else {}
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
            rows.append((row, self.refs.judged(t), self.refs.judged(b), o))
        results = judge_rows(call.short, rows, standards=self.refs.standards, thresholds=self.refs.thresholds,
                             inputs=(call.func, *call.inputs) if call.inputs is not None else None,
                             budget=self._forward_budget(call, stem, len(targets)))
        quantized = self._quantization(call, targets)
        results += quantized
        if not call.taps:
            call.inputs = None
        self.records.store(call.name, results, oracles)
        if quantized:  # extra fields of the record and of the dump entry (msprobe ignores them)
            self.records.results[call.name]["quantization"] = {row: r.metrics for row, r in quantized}
        if self.loans.reproducer is not None and self.records.results[call.name].get("status") == "error":
            self.loans.reproducer.write(self.refs, call, "forward", self.records.results[call.name])
        if not call.taps:
            call.raw = None
        if call.taps:
            # the hooks live on the outputs' autograd nodes: the outputs themselves are not kept (an output that no
            # backward formula saves is freed as in the plain run)
            grads_of = [t for _, t in targets if isinstance(t, torch.Tensor) and t.requires_grad]
            for i, t in enumerate(grads_of):
                t.register_hook(self.gradients.grad_out_hook(call, i))
            del grads_of
        call.oracle_out = call.oracle_in = call.bench_out = call.bench_in = None  # the backward runs them again

    def _quantization(self, call: _Call, targets: list) -> list:
        """The ``quantization`` standard's rows (:class:`msprobe_ci.checkers.quantization.QuantizationStandard`) of
        a call that casts a wider floating tensor into an FP8 format: each FP8 output judged against the call's
        first wider floating input of its shape (the scaled tensor a recipe quantizes)."""
        fp8 = [(row, t) for row, t in targets if isinstance(t, torch.Tensor) and t.dtype in kernels.FP8_DTYPES]
        if call.inputs is None or not fp8:
            return []
        from ..checkers import make_standard

        sources = [x for x in _tensors(call.inputs[0]) + _tensors(call.inputs[1])
                   if x.is_floating_point() and x.dtype.itemsize > 1]
        out = []
        for row, t in fp8:
            x = next((x for x in sources if x.shape == t.shape), None)
            if x is not None:
                out.append((row, make_standard("quantization", t.dtype, **self.refs.thresholds.get("quantization", {}))(
                    t, x)))
        return out

    def _autocast_references(self, call: _Call, out: Any) -> bool:
        """The oracle and the bench of a call made under autocast, now that its output says which dtype its kernel
        computed in: on its inputs cast to that dtype (:func:`msprobe_ci.amp.kernel_inputs`), autocast off, so both
        see the inputs exactly as the target's kernel saw them. The cast inputs replace the call's own for its error
        budget and its backward. False where the references could not run (the reason in the record)."""
        before = [x for x in _tensors(call.inputs[0]) + _tensors(call.inputs[1]) if kernels.needs_grad(x)]
        args, kw, seen = amp.kernel_inputs(*call.inputs, out)
        after = [x for x in _tensors(args) + _tensors(kw) if kernels.needs_grad(x)]
        # gradients as precise as the dtype the kernel computed in, whichever way it read a 0-d operand
        call.grad_dtypes = [amp.grad_dtype(u.dtype, k.dtype) for u, k in zip(before, after)]
        args, kw = amp.scalar_reading(call.func, call.inputs, (args, kw), out)
        rec = self.records.results.setdefault(call.name, {})
        rec["autocast"] = str(call.autocast)
        if seen is not None:
            rec["computed_in"] = str(seen)
        with amp.disabled((args, kw)):
            ok, _ = self._references(call, call.func, args, kw, bool(call.taps))
        if ok:
            call.inputs = (args, kw)
            call.versions = tuple(t._version for t in _tensors(args) + _tensors(kw))
        return ok

    def _forward_budget(self, call: _Call, stem: str, n: int):
        """The error scale of output row ``i`` (:func:`msprobe_ci.kernels.forward_scale`), lazily
        (:meth:`.references.References.lazy_budget`): only a benchmark-standard row that is not bit-identical to
        its bench asks."""
        return self.refs.lazy_budget(call, n, lambda device: kernels.forward_scale(
            call.func, call.inputs[0], call.inputs[1], lambda v: [x for _, x in _flat_outputs(v, stem)],
            self.refs.budget_draws, base=call.oracle_out, device=device))

