"""Replaying one dumped API call alone and judging each output with its own standard.

For a forward entry ``<Prefix>.<api>.<n>.forward``:

1. the arguments are rebuilt (:mod:`.args`);
2. the **oracle** runs on CPU with every floating tensor upcast to fp64 (fp32 where the API has no fp64 kernel);
3. the **bench** runs on CPU in the dumped dtypes (the reference implementation of the same precision, for the
   benchmark standard's "error of the bench itself");
4. the **target** is the output recorded in the dump (tensor task; offline, so a CPU runner judges an NPU dump),
   or, with ``live=True``, the API re-run in the dumped dtypes;
5. each output pair is judged by :func:`msprobe_ci.checkers.standard_for` (integer/bool outputs: binary).

Backward entries replay the forward on the oracle and bench sides with gradients enabled and feed the dumped
upstream gradient (``input[0]``); the gradients of the positional tensor arguments are compared with the dumped
target gradients (``output``).

What cannot be judged is skipped with the reason: communication and fused device ops (no CPU kernel), random ops
other than dropout, statistics dumps offline (their target outputs belong to other inputs), a missing forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checkers import CheckResult, worst
from ..dump import names
from ..dump.reader import Dump
from ..errors import MsprobeError
from ..judge import judge_dropout, judge_rows, judged_as, unjudgeable
from ..judge.rows import outputs as _outputs
from ..kernels import cast as _cast
from .args import Rebuilder, api_generator, mindspore_order, record_rows
from .apis import _short, parse_name, resolve
from .result import ApiResult


def _upcast(dtype: torch.dtype):
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        return t.to(dtype) if t.is_floating_point() else t
    return fn


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


class ApiReplayer:
    """Replays and judges the API calls of one dump.

    Args:
        dump: a loaded dump (L1 or mix; module entries are ignored), or ``None`` where every call's inputs are
            given (:meth:`check_inputs`, :meth:`check_grads`: a reproduction).
        live: re-run the target side on CPU in the dumped dtypes instead of reading recorded outputs (what a
            runner with the target device does; here it exercises statistics dumps).
        standards: user overrides ``{API fnmatch pattern: standard name}``.
        thresholds: user overrides ``{standard name: {threshold: value}}``.
        faults: :class:`~msprobe_ci.capture.inject.Fault` list applied to live target outputs (fuzzing, tests).
        target_device: where the live target runs (a torch device string, e.g. ``npu:0``); outputs come back to
            CPU for judging.
        bench_kernel: the same-dtype bench of the benchmark standard (:mod:`msprobe_ci.kernels`): ``device`` (the
            API on CPU in the dumped dtypes, default), ``upcast``, ``rounded``, ``decomposed``.
        budget_draws: perturbed runs that size a benchmark-standard row's error budget (0: none).

    Raises:
        MsprobeError: an unknown bench kernel.
    """

    def __init__(self, dump: Dump, *, live: bool = False, standards: dict[str, str] | None = None,
                 thresholds: dict[str, dict[str, float]] | None = None, faults: tuple = (),
                 target_device: str = "cpu", bench_kernel: str = "device", budget_draws: int | None = None):
        from .. import kernels

        self.bench_kernel = kernels.check_bench_kernel(bench_kernel)
        self.budget_draws = kernels.DRAWS if budget_draws is None else int(budget_draws)
        self.dump, self.live = dump, live
        self.faults = tuple(faults)
        self.target_device = target_device
        self.standards = standards or {}
        self.thresholds = thresholds or {}
        self.rebuild = Rebuilder(dump) if dump is not None else None  # None: inputs given (a reproduction)

    def api_names(self) -> list[str]:
        """Every API forward and backward entry, in dump order (modules and parameter gradients left out), the
        ones :attr:`~msprobe_ci.dump.reader.Dump.rejected` included (each a skip naming why)."""
        return [n for n in self.dump.names or self.dump.data
                if (p := names.parse(n, any_prefix=True)) is not None and p.kind == "api"]

    # ---------------------------------------------------------------------------------------------------------
    def check(self, name: str) -> ApiResult:
        """Judge one entry; never raises for a bad entry: it becomes a skip (unjudgeable) with the reason."""
        try:
            if name in self.dump.rejected:
                return ApiResult(name, "skip", reason=f"not judged, its record breaks the dump format: "
                                                      f"{self.dump.rejected[name]}")
            prefix, api, n, direction = parse_name(name)
            if (reason := unjudgeable(prefix, api, short=_short(prefix, api))) is not None:
                return ApiResult(name, "skip", reason=reason)
            func = resolve(prefix, api)
            if direction == "forward":
                return self._forward(name, prefix, api, n, func)
            return self._backward(name, prefix, api, n, func)
        except MsprobeError as exc:
            return ApiResult(name, "skip", reason=str(exc))

    def arguments(self, fwd_name: str) -> tuple[list, dict]:
        """The rebuilt ``(args, kwargs)`` of a forward entry (an ``out=`` tensor is dropped).

        Raises:
            MsprobeError: no such forward entry, or a record that cannot be rebuilt.
        """
        entry = self.dump.data.get(fwd_name)
        if fwd_name in self.dump.rejected:
            raise MsprobeError(f"not judged, its forward record breaks the dump format: {self.dump.rejected[fwd_name]}")
        if not isinstance(entry, dict):
            raise MsprobeError(f"{fwd_name}: no forward entry in the dump")
        gen = api_generator(fwd_name)
        args = [self.rebuild.value(v, gen, f"{fwd_name}.input.{i}")
                for i, v in enumerate(entry.get("input_args") or [])]
        kwargs = {k: self.rebuild.value(v, gen, f"{fwd_name}.input.{k}")
                  for k, v in (entry.get("input_kwargs") or {}).items()}
        kwargs.pop("out", None)
        return args, kwargs

    def _run(self, func, args, kwargs, cast):
        a, k = _cast(args, cast), _cast(kwargs, cast)
        return func(*a, **k)

    def _oracle(self, func, args, kwargs):
        """``(output, "fp64"|"fp32", composite)``: ``composite`` whether the fp64 run's kernels read an intermediate
        (:class:`msprobe_ci.kernels.Materialized`; a ``rounded`` bench is then not this run rounded once)."""
        from ..kernels import REFERENCES, Materialized

        probe = Materialized()
        try:  # an API without a float64 kernel (torch._grouped_mm) as its float64 reference decomposition
            with probe:
                out = self._run(REFERENCES.get(func, func), args, kwargs, _upcast(torch.float64))
            return out, "fp64", probe.read
        except (RuntimeError, TypeError, NotImplementedError):
            return self._run(func, args, kwargs, _upcast(torch.float32)), "fp32", True

    def _forward(self, name, prefix, api, n, func) -> ApiResult:
        entry = self.dump.data[name]
        args, kwargs = self.arguments(name)
        short = _short(prefix, api)
        records = record_rows(entry.get("output") or [], f"{name}.output")
        if "dropout" in short:
            return self._dropout(name, args, kwargs, records, func)
        from .. import amp

        # a call made under autocast (recorded in our dumps, inferred from dtypes as msprobe does for others):
        # replayed on its inputs as its kernel saw them, cast to the dtype it computed in
        dtype, how = amp.of_entry(entry)
        recorded = None if self.live else self._recorded(name, records)
        if dtype is not None:
            args, kwargs = self._as_read(func, args, kwargs, dtype, [t for _, t in recorded or ()])
        result = self.check_inputs(name, args, kwargs, recorded)
        if dtype is not None:
            result.autocast = f"{str(dtype).replace('torch.', '')} ({how})"
        return result

    def check_inputs(self, name: str, args: list, kwargs: dict, targets: list | None = None) -> ApiResult:
        """Judge forward entry ``name`` on the given inputs; ``targets`` ``None`` runs the target live (CPU, in the
        inputs' dtypes, with this replayer's ``faults`` applied to its output), as fuzzing does."""
        prefix, api, n, _ = parse_name(name)
        func = resolve(prefix, api)
        short = _short(prefix, api)
        try:
            oracle, how, composite = self._oracle(func, args, kwargs)
            bench = oracle if self.bench_kernel == "rounded" and how == "fp64" and not composite else \
                self._bench(func, args, kwargs, oracle)
        except Exception as exc:  # noqa: BLE001 - an API that fails on CPU is unjudgeable, not a crash
            raise MsprobeError(f"{name}: replay failed on CPU: {type(exc).__name__}: {exc}") from None
        recorded = targets
        if targets is None:
            dev = self.target_device
            target = _cast(self._run(func, args, kwargs, lambda t: t.detach().clone().to(dev)),
                           lambda t: t.detach().cpu())
            for f in self.faults:
                if f.matches(f"{prefix}.{api}", n, "forward"):
                    target = f.apply(target, n)
            targets = _outputs(target, f"{name}.output")
        short = judged_as(short, args, kwargs, self.standards)
        result = self._judge(name, short, targets, _outputs(bench, f"{name}.output"),
                             _outputs(oracle, f"{name}.output"), inputs=(func, args, kwargs),
                             budget=self._forward_budget(func, args, kwargs, name))
        if result.status == "error":
            result.replay = {"args": args, "kwargs": kwargs, "targets": recorded}
        return result

    def _bench(self, func, args, kwargs, oracle):
        """The same-dtype bench of a forward replay, by :attr:`bench_kernel` (outputs of ``upcast``/``rounded``
        are rounded to the target's dtypes where they are judged)."""
        from .. import kernels

        if self.bench_kernel == "device":
            return self._run(func, args, kwargs, _fresh)
        if self.bench_kernel == "decomposed":
            with kernels.decomposed():
                return self._run(func, args, kwargs, _fresh)
        # upcast/rounded: the call's kernels one precision up (float64), each result rounded once to the target
        # dtype where another kernel of the call reads it (kernels.Materialized)
        ts = kernels.tensors_of(args) + kernels.tensors_of(kwargs)
        up = torch.float64 if self.bench_kernel == "rounded" else kernels.upcast_dtype(ts)
        try:
            with kernels.Materialized(kernels.target_dtype(ts)):
                return self._run(kernels.REFERENCES.get(func, func) if up == torch.float64 else func, args, kwargs,
                                 _upcast(up))
        except (RuntimeError, TypeError, NotImplementedError):
            if self.bench_kernel == "rounded":
                return oracle  # no float64 kernel: the oracle's own precision
            raise

    def _forward_budget(self, func, args, kwargs, name):
        """``budget(i)``: the error scale of output row ``i`` (:func:`msprobe_ci.kernels.forward_scale`), computed
        on first use."""
        from .. import kernels

        cache: list = []

        def budget(i):
            if not self.budget_draws:
                return None
            if not cache:
                try:
                    cache.extend(kernels.forward_scale(func, tuple(args), dict(kwargs),
                                                       lambda v: [x for _, x in _outputs(v, "o")], self.budget_draws))
                except Exception:  # noqa: BLE001 - no budget: relative to |oracle| alone
                    cache.append(None)
            return cache[i] if i < len(cache) else None
        return budget

    @staticmethod
    def _as_read(func, args: list, kwargs: dict, dtype: torch.dtype, outputs: list) -> tuple:
        """A forward call made under autocast, its inputs as its kernel read them: cast to ``dtype``
        (:func:`msprobe_ci.amp.cast_inputs`), a 0-d operand of a wider dtype as its recorded ``outputs`` say it was
        read (:func:`msprobe_ci.amp.scalar_reading`; none recorded: the cast)."""
        from .. import amp

        cast = amp.cast_inputs(args, kwargs, dtype)
        if not outputs:
            return cast
        got = amp.scalar_reading(func, (args, kwargs), cast, outputs)
        return (list(got[0]) if isinstance(args, list) else got[0]), got[1]

    def _recorded(self, name: str, records: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        if self.dump.task != "tensor":
            raise MsprobeError(f"{name}: statistics dump: its target outputs belong to other inputs than the "
                               "regenerated ones; dump with task 'tensor' (or check live on the target device)")
        gen = api_generator(name)
        return [(row, self.rebuild.value(rec, gen, row)) for row, rec in records]

    def _judge(self, name, short, targets, benches, oracles, inputs=None, budget=None) -> ApiResult:
        backward = name.endswith(".backward")
        if len(targets) != len(benches):
            return ApiResult(name, "error", [(name, CheckResult("structure", "error", message=(
                f"{len(targets)} target outputs vs {len(benches)} bench outputs")))])
        from ..kernels import round_to

        rows = []
        info = {}
        for (row, t), (_, b), (_, o) in zip(targets, benches, oracles):
            if self.bench_kernel in ("upcast", "rounded"):
                b = round_to(b, t)
            rows.append((row, t, b, o))
            if isinstance(t, torch.Tensor):
                info[row] = (str(getattr(o, "dtype", " ")), str(t.dtype), str(tuple(t.shape)))
        results = judge_rows(short, rows, backward=backward, standards=self.standards, thresholds=self.thresholds,
                             inputs=inputs, budget=budget, floor_dtype=torch.float64)
        return ApiResult(name, worst([r for _, r in results]), results, info=info)

    def _dropout(self, name, args, kwargs, records, func) -> ApiResult:
        p = kwargs.get("p", args[1] if len(args) > 1 and isinstance(args[1], float) else 0.5)
        training = kwargs.get("training", args[2] if len(args) > 2 and isinstance(args[2], bool) else True)
        targets = (_outputs(self._run(func, args, kwargs, _fresh), f"{name}.output") if self.live
                   else self._recorded(name, records))
        if not training or p == 0:
            bench = self._run(func, args, kwargs, _fresh)
            return self._judge(name, "identity", targets, _outputs(bench, f"{name}.output"),
                               _outputs(bench, f"{name}.output"))
        x = args[0] if args else kwargs.get("input")
        short = name.split(".")[1] if name.count(".") >= 3 else "dropout"
        results = [(row, judge_dropout(short, t, x, p, self.thresholds)) for row, t in targets]
        return ApiResult(name, worst([r for _, r in results]), results)

    def _backward(self, name, prefix, api, n, func) -> ApiResult:
        entry = self.dump.data[name]
        fwd = f"{prefix}.{api}.{n}.forward"
        args, kwargs = self.arguments(fwd)
        grads_in = entry.get("input") or []
        if not grads_in:
            raise MsprobeError(f"{name}: no upstream gradient in the dump")
        gen = api_generator(name)
        upstream = self.rebuild.value(grads_in[0], gen, f"{name}.input.0")
        records = record_rows(entry.get("output") or [], f"{name}.output")

        fwd_entry = self.dump.data[fwd]
        mindspore = getattr(self.dump, "framework", "pytorch") == "mindspore"
        from .. import amp

        # made under autocast: the forward replayed on its inputs as its kernel saw them (msprobe_ci.amp.of_entry)
        amp_dtype, amp_how = amp.of_entry(fwd_entry)
        if amp_dtype is not None:
            outputs = []
            if not self.live and self.dump.task == "tensor":  # the forward's recorded outputs tell its reading
                try:
                    outputs = [t for _, t in self._recorded(fwd, record_rows(fwd_entry.get("output") or [],
                                                                             f"{fwd}.output"))]
                except Exception:  # noqa: BLE001 - an output that cannot be read: the cast reading
                    outputs = []
            args, kwargs = self._as_read(func, args, kwargs, amp_dtype, outputs)

        def want(r: Any) -> bool:  # MindSpore records have no requires_grad: every floating input may need one
            return isinstance(r, dict) and (bool(r.get("requires_grad")) or mindspore and "dtype" in r)

        wants = [want(r) for r in fwd_entry.get("input_args") or []]
        wants_kw = {k: want(r) for k, r in (fwd_entry.get("input_kwargs") or {}).items()}
        targets = None
        if not self.live:
            if self.dump.task != "tensor":
                raise MsprobeError(f"{name}: statistics dump: target gradients belong to other inputs; dump with "
                                   "task 'tensor'")
            targets = [(row, self.rebuild.value(rec, gen, row)) for row, rec in records]
        result = self.check_grads(name, args, kwargs, upstream, targets, wants, wants_kw, amp_dtype,
                                  mindspore=mindspore)
        if amp_dtype is not None:
            result.autocast = f"{str(amp_dtype).replace('torch.', '')} ({amp_how})"
        return result

    def check_grads(self, name: str, args: list, kwargs: dict, upstream: Any, targets: list | None,
                    wants: list[bool], wants_kw: dict[str, bool], amp_dtype: torch.dtype | None = None, *,
                    mindspore: bool = False) -> ApiResult:
        """Judge backward entry ``name``: the gradients the API's autograd node hands its inputs for ``upstream``.

        Args:
            args, kwargs: the forward's inputs, as its kernel saw them (cast to ``amp_dtype`` under autocast).
            upstream: the gradient that reached the forward's first output.
            targets: ``[(row, gradient or None)]`` the target's recorded gradients, or ``None`` to run it live.
            wants, wants_kw: which positional and keyword inputs needed grad in the dumped call.
            amp_dtype: the autocast dtype the call ran under, or ``None``.
            mindspore: a MindSpore dump (its gradients listed as it lists them).
        """
        from .. import amp

        prefix, api, n, _ = parse_name(name)
        func = resolve(prefix, api)
        recorded = targets

        def grads(cast, held=None):
            """The gradients the API's autograd node hands to its inputs (``grad_inputs``, the order the dump
            records them in), for the dumped upstream gradient. ``held``: the dtype an ``upcast``/``rounded``
            bench holds the call's intermediates in (:class:`msprobe_ci.kernels.Materialized`), forward and
            backward each."""
            import contextlib

            def mode():
                return contextlib.nullcontext() if held is None else kernels.Materialized(held)
            a = _cast(args, cast)
            k = _cast(kwargs, cast)
            for x, want in list(zip(a, wants)) + [(k.get(key), w) for key, w in wants_kw.items()]:
                if want and isinstance(x, torch.Tensor) and x.is_floating_point():
                    x.requires_grad_(True)  # as in the dumped call: the node's grad_inputs then line up
            with torch.enable_grad():
                with mode():
                    out = func(*a, **k)
                out0 = out[0] if isinstance(out, (tuple, list)) else out
                if not isinstance(out0, torch.Tensor) or out0.grad_fn is None:
                    raise MsprobeError(f"{name}: the forward output does not depend on an input that needs grad")
                captured: list = []
                handle = out0.grad_fn.register_hook(lambda grad_inputs, grad_outputs: captured.append(grad_inputs))
                g = cast(upstream) if isinstance(upstream, torch.Tensor) else upstream
                with mode():
                    out0.backward(g.to(out0.dtype))
                handle.remove()
            return list(captured[0]) if captured else []

        from .. import kernels

        try:
            try:
                oracle = grads(_upcast(torch.float64))
            except (RuntimeError, TypeError, NotImplementedError):
                oracle = grads(_upcast(torch.float32))
            if self.bench_kernel == "device":
                bench = grads(_fresh)
            elif self.bench_kernel == "decomposed":
                with kernels.decomposed():
                    bench = grads(_fresh)
            else:  # upcast/rounded: the call's kernels one precision up (float64), each rounded once
                held = kernels.target_dtype(kernels.tensors_of(args) + kernels.tensors_of(kwargs))
                up = torch.float64 if self.bench_kernel == "rounded" else \
                    kernels.upcast_dtype(kernels.tensors_of(args) + kernels.tensors_of(kwargs))
                try:
                    bench = grads(_upcast(up), held)
                except (RuntimeError, TypeError, NotImplementedError):
                    bench = oracle
        except MsprobeError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise MsprobeError(f"{name}: backward replay failed on CPU: {type(exc).__name__}: {exc}") from None
        if targets is None:
            targets = [(f"{name}.output.{i}", g) for i, g in enumerate(grads(_fresh))]
        targets = list(targets)
        if mindspore:  # MindSpore lists only the gradients that exist (a Primitive's last input first)
            last_first = prefix == "Primitive"
            bench = mindspore_order(targets, bench, last_first)
            oracle = mindspore_order(targets, oracle, last_first)
        if len(targets) != len(bench):
            return ApiResult(name, "error", [(name, CheckResult("structure", "error", message=(
                f"{len(targets)} target gradients vs {len(bench)} bench gradients")))])
        keep = [i for i, (_, t) in enumerate(targets) if t is not None]  # inputs that needed no grad
        if amp_dtype is not None:
            # a gradient is as precise as the narrower of the kernel's dtype and the user's tensor's (autocast's
            # cast hands it back rounded): the target judged there, the references rounded as the cast rounds
            for i in keep:
                row, t = targets[i]
                if isinstance(t, torch.Tensor) and t.is_floating_point() and \
                        amp.grad_dtype(t.dtype, amp_dtype) != t.dtype:
                    t = t.to(amp_dtype)
                    targets[i] = (row, t)
                if i < len(bench):
                    bench[i] = kernels.round_to(bench[i], t)
        scales: list = []

        def budget(j: int):
            """The error scale of the j-th kept gradient (:func:`msprobe_ci.kernels.backward_scale`): the leaves
            (inputs that need grad, in order) are matched to the kept gradients in order, by shape."""
            if not self.budget_draws or mindspore:
                return None
            if not scales:
                try:
                    def mark(x, w):
                        return x.detach().clone().requires_grad_(True) if w and isinstance(x, torch.Tensor) and \
                            x.is_floating_point() else x
                    a = [mark(x, w) for x, w in zip(args, wants + [False] * len(args))]
                    k = {key: mark(v, wants_kw.get(key, False)) for key, v in kwargs.items()}
                    leaf = iter(kernels.backward_scale(func, tuple(a), k, {0: upstream}, self.budget_draws))
                    nxt = next(leaf, None)
                    for i in keep:
                        t = targets[i][1]
                        if isinstance(nxt, torch.Tensor) and isinstance(t, torch.Tensor) and nxt.shape == t.shape:
                            scales.append(nxt)
                            nxt = next(leaf, None)
                        else:
                            scales.append(None)
                except Exception:  # noqa: BLE001 - no budget: relative to |oracle| alone
                    scales.append(None)
            return scales[j] if j < len(scales) else None
        result = self._judge(name, _short(prefix, api), [targets[i] for i in keep],
                             [(targets[i][0], bench[i]) for i in keep], [(targets[i][0], oracle[i]) for i in keep],
                             budget=budget)
        if result.status == "error":
            result.replay = {"args": args, "kwargs": kwargs, "targets": recorded, "upstream": upstream,
                             "wants": list(wants), "wants_kw": dict(wants_kw), "autocast": amp_dtype,
                             "mindspore": mindspore}
        return result
