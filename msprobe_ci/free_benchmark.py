"""Free benchmark: judge every API the target runs with no bench device and no baseline.

msprobe's free_benchmark re-runs each API on perturbed inputs and flags outputs that move more than a per-dtype
relative threshold (fp16 0.002, bf16 0.004, fp32 0.0002; ``../shared/spec/peers-and-tolerances.md``). A fixed
threshold cries wolf on APIs that are ill-conditioned at the values they were given (a softmax over large logits
amplifies every rounding), so msprobe-ci judges each output against what the perturbations can explain:

1. **reference** (the error of the target's kernel): the same API on copies of the inputs in higher precision,
   ``improve_precision`` (default): fp16/bf16 inputs in fp32, fp32 inputs in fp64, on the target's own device (a
   different kernel from the one under test); ``to_cpu``: every floating input in fp64 on the CPU;
2. **sensitivity** (msprobe's ``bit_noise``): the API in the target's dtypes on the target's device with the last
   mantissa bit of every floating input element flipped (a seeded random sign per element). The output change
   it causes is how far rounding-level differences in the inputs move this output, here: the conditioning of
   the call, which a correct kernel's internal roundings may also show;
3. **verdict** per output row, with ``scale = ‖reference‖``:
   ``rel_rmse = rms(target − reference) / rms(reference)`` must stay within
   ``threshold(dtype) + rms(noisy − target) / rms(reference)``, and
   ``max_err = max|target − reference| / max|reference|`` within ``threshold(dtype) + max|noisy − target| /
   max|reference|``. NaN/Inf in the target where the reference is finite is an error (``overflow``).

A correctly rounded kernel is within one rounding unit of the reference (bf16 2^-8 < 0.004, fp16 2^-11 < 0.002,
fp32 2^-24 < 0.0002), so a well-conditioned API passes with room; a kernel that is 2% off fails even in bf16.
The sensitivity rerun goes through the same kernel as the target (an injected fault perturbs it as well, as a
buggy kernel would), so a consistent kernel error does not widen its own allowance.

What cannot be judged gets a named skip: random APIs, uninitialised memory, communication and device-only ops,
non-floating outputs, fp64-only calls (nothing more precise on the device), calls whose rerun fails.
Cost: two extra calls per API on copies of its inputs (no gradients), and one NumPy-free pass over each output.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .judge import unjudgeable
from .kernels import tensors_of as _tensors
from .kernels import cast as _cast
from .judge.rows import outputs as _flat_outputs

MODES = ("improve_precision", "to_cpu")
#: msprobe free_benchmark output relative-error thresholds by output dtype (peers-and-tolerances.md §3.3).
THRESHOLDS = {torch.float16: 0.002, torch.bfloat16: 0.004, torch.float32: 0.0002, torch.float64: 0.0002}
_HIGHER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


@dataclass
class _Pending:
    name: str
    reference: Any = None
    noisy: Any = None
    started: float = 0.0
    # a call made under autocast: its reruns wait for its output, which says the dtype its kernel computed in
    # (msprobe_ci.amp); ``deferred(args, kwargs)`` then runs them on the inputs cast that way
    deferred: Any = None
    inputs: Any = None
    # what the call's reproduction needs (a reproducer set): ``(func, prefix, api, args, kwargs, call index for the
    # bit-noise seed, autocast state)``, the arguments as given (an in-place call's first one as before the call)
    raw: Any = None


def bit_noise(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A copy of floating tensor ``t`` with every finite element moved by one ULP (its last mantissa bit), up or
    down by a seeded random sign; zeros move to ± the smallest subnormal, NaN/Inf stay.

    Args:
        t: a floating tensor (fp16, bf16, fp32, fp64), any shape and device.
        gen: a CPU ``torch.Generator`` (the signs are drawn on the CPU, so runs repeat across devices).

    Returns:
        A new tensor of ``t``'s shape, dtype and device.
    """
    x = t.detach()
    sign = torch.randint(0, 2, x.shape, generator=gen).to(x.device, torch.bool)
    toward = torch.where(sign, torch.full_like(x, math.inf), torch.full_like(x, -math.inf))
    return torch.where(torch.isfinite(x), torch.nextafter(x, toward), x)


class FreeBenchmark:
    """Per-step free-benchmark state of one target capture (see the module docstring for the rule).

    Args:
        mode: ``improve_precision`` (default) or ``to_cpu``: where the reference runs.
        seed: seeds the bit-noise signs (default 0): identical runs give identical verdicts.
        thresholds: ``{dtype: relative threshold}`` overrides of msprobe's fp16 0.002 / bf16 0.004 /
            fp32 0.0002.

    Raises:
        ValueError: an unknown mode.

    Attributes:
        results: ``{node name: record}`` in execution order; a record holds ``status`` (pass/error/skip),
            ``metric`` (``rel_rmse``, ``max_err`` or ``overflow``), ``value``, ``threshold`` (the allowance that
            applied: the dtype threshold plus the sensitivity), ``row``, ``dtype``, ``sensitivity``,
            ``message`` and ``seconds``.
    """

    def __init__(self, mode: str = "improve_precision", seed: int = 0,
                 thresholds: dict | None = None):
        if mode not in MODES:
            raise ValueError(f"free benchmark mode: expected one of {list(MODES)}, got {mode!r}")
        self.mode = mode
        self.seed = int(seed)
        self.thresholds = dict(THRESHOLDS)
        self.thresholds.update(thresholds or {})
        # writes a standalone reproduction of each call at risk (msprobe_ci.capture.repro.Reproducer; the capture
        # session lends it through attach)
        self.reproducer = None
        self.reset()

    def attach(self, *, reproducer=None) -> None:
        """What the capture that drives this free benchmark lends it: the writer of each call-at-risk's standalone
        reproduction (:class:`msprobe_ci.capture.repro.Reproducer`; None: left as it is)."""
        if reproducer is not None:
            self.reproducer = reproducer

    def reset(self) -> None:
        """Start a new step."""
        self.results: dict[str, dict] = {}
        self._calls = 0

    def skip(self, name: str, reason: str) -> None:
        self.results[name] = {"status": "skip", "message": reason}

    def before(self, name: str, prefix: str, api: str, func: Callable, args: tuple, kwargs: dict,
               kernel: Callable[[Any], Any] = lambda v: v) -> _Pending | None:
        """Run the reference and the bit-noise rerun of one call on copies of its inputs, before the target call
        (so an in-place API never sees its own result).

        Args:
            name: the dump name (``Functional.linear.0.forward``). prefix, api: its parts.
            func: the torch callable the target is about to call.
            kernel: what the target's kernel does to an output beyond torch's own result (an injected fault),
                applied to the bit-noise rerun, which runs through that same kernel.

        Returns:
            The pending call for :meth:`after`, or ``None`` when the call gets a named skip.
        """
        started = time.perf_counter()
        short = api.rsplit(".", 1)[-1]
        reason = unjudgeable(prefix, api, kwargs, short=short, dropout=True)
        floats = [t for t in _tensors(args) + _tensors(kwargs) if t.is_floating_point()]
        if reason is None and not floats:
            reason = "no floating input: nothing to perturb"
        if reason is None and all(t.dtype == torch.float64 for t in floats):
            reason = "fp64 inputs: nothing more precise to compare with"
        if reason is not None:
            self.skip(name, reason)
            return None
        kw = {k: v for k, v in kwargs.items() if k != "out"}
        from . import amp
        from .isolate import is_inplace

        ac = amp.autocast_dtype(args, kw)
        raw = None
        if self.reproducer is not None:
            first = tuple(args)
            if (is_inplace(short) or kwargs.get("inplace") is True) and first and isinstance(first[0], torch.Tensor):
                first = (first[0].detach().clone(), *first[1:])
            raw = (func, prefix, api, first, dict(kwargs), self._calls,
                   None if ac is None else {"device_type": floats[0].device.type,
                                            "dtype": str(ac).replace("torch.", "")})
        if "out" not in kwargs and not is_inplace(short) and ac is not None:
            # under autocast the kernel sees its inputs cast by the op's policy: rerun after the call, on those
            return _Pending(name, started=started, inputs=(tuple(args), kw),
                            deferred=lambda a, k: self._reruns(name, func, a, k, kernel, started, raw))
        return self._reruns(name, func, args, kw, kernel, started, raw)

    def _reruns(self, name: str, func: Callable, args: tuple, kw: dict, kernel: Callable[[Any], Any],
                started: float, raw: Any = None) -> _Pending | None:
        """The reference (higher precision) and the bit-noise rerun of one call on copies of ``args``/``kw``."""
        floats = [t for t in _tensors(args) + _tensors(kw) if t.is_floating_point()]
        low = min((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits)
        # to_cpu: everything fp64 on the CPU; improve_precision: one level above the lowest floating input, on the
        # target's device (an fp32 input of an fp16 call stays fp32; nothing is ever lowered)
        ref_dtype, ref_device = (torch.float64, "cpu") if self.mode == "to_cpu" else \
            (_HIGHER.get(low, torch.float64), None)

        def higher(dtype: torch.dtype) -> torch.dtype:
            return dtype if torch.finfo(dtype).bits > torch.finfo(ref_dtype).bits else ref_dtype

        def up(t: torch.Tensor) -> torch.Tensor:
            x = t.detach()
            dev = ref_device or x.device
            return x.to(device=dev, dtype=higher(x.dtype), copy=True) if x.is_floating_point() else \
                x.to(device=dev, copy=True)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self._calls)
        self._calls += 1

        def noisy(t: torch.Tensor) -> torch.Tensor:
            return bit_noise(t, gen) if t.is_floating_point() else t.detach().clone()
        try:
            with torch.no_grad():
                ref_kw = {k: _cast(v, up) for k, v in kw.items()}
                if isinstance(ref_kw.get("dtype"), torch.dtype) and ref_kw["dtype"].is_floating_point:
                    ref_kw["dtype"] = higher(ref_kw["dtype"])
                reference = func(*_cast(tuple(args), up), **ref_kw)
                noise_out = kernel(func(*_cast(tuple(args), noisy), **{k: _cast(v, noisy) for k, v in kw.items()}))
        except Exception as exc:  # noqa: BLE001 - unjudgeable, never a crash of the user's run
            self.skip(name, f"rerun failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
            return None
        return _Pending(name, reference, noise_out, started, raw=raw)

    def after(self, pending: _Pending | None, out: Any) -> None:
        """Judge the target's output ``out`` of a call prepared by :meth:`before`."""
        if pending is None:
            return
        if pending.deferred is not None:
            from . import amp

            args, kw, _ = amp.kernel_inputs(*pending.inputs, out)
            with amp.disabled((args, kw)):
                pending = pending.deferred(args, kw)
            if pending is None:
                return
        stem = f"{pending.name}.output"
        refs = dict(_flat_outputs(pending.reference, stem))
        noisy = dict(_flat_outputs(pending.noisy, stem))
        worst: dict | None = None
        judged = 0
        for row, t in _flat_outputs(out, stem):
            r, n = refs.get(row), noisy.get(row)
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and isinstance(r, torch.Tensor)
                    and isinstance(n, torch.Tensor) and list(t.shape) == list(r.shape) == list(n.shape)) \
                    or t.numel() == 0:
                continue
            judged += 1
            rec = self._judge(row, t, r, n)
            if worst is None or (rec["status"] == "error", rec["ratio"]) > (worst["status"] == "error",
                                                                             worst["ratio"]):
                worst = rec
        if worst is None:
            self.skip(pending.name, "no floating output to judge")
            return
        worst.pop("ratio")
        worst["seconds"] = round(time.perf_counter() - pending.started, 6)
        worst["rows"] = judged
        self.results[pending.name] = worst
        if worst["status"] == "error" and self.reproducer is not None and pending.raw is not None:
            self.reproducer.write_free(self, pending.name, pending.raw, worst)

    def _judge(self, row: str, t: torch.Tensor, r: torch.Tensor, n: torch.Tensor) -> dict:
        y = t.detach().to("cpu", torch.float64)
        ref = r.detach().to("cpu", torch.float64)
        nz = n.detach().to("cpu", torch.float64)
        thr = self.thresholds.get(t.dtype, THRESHOLDS[torch.float32])
        base = {"row": row, "dtype": str(t.dtype)}
        y_bad, r_bad = ~torch.isfinite(y), ~torch.isfinite(ref)
        if bool((y_bad & ~r_bad).any()):
            k = int((y_bad & ~r_bad).sum())
            return {**base, "status": "error", "metric": "overflow", "value": k, "threshold": 0, "ratio": math.inf,
                    "sensitivity": 0.0,
                    "message": f"{row}: {k} NaN/Inf element(s) where the higher-precision reference is finite"}
        keep = ~(y_bad | r_bad)  # both non-finite: the inputs made them so, not the kernel
        y, ref, nz = y[keep], ref[keep], torch.nan_to_num(nz[keep], nan=0.0, posinf=0.0, neginf=0.0)
        if y.numel() == 0:
            return {**base, "status": "pass", "metric": "rel_rmse", "value": 0.0, "threshold": thr, "ratio": 0.0,
                    "sensitivity": 0.0, "message": "every element non-finite on both sides"}
        err, sens = (y - ref).abs(), (nz - y).abs()
        rms_ref, max_ref = float(ref.square().mean().sqrt()), float(ref.abs().max())
        if max_ref == 0.0:
            value = float(err.max())
            status = "pass" if value == 0.0 else "error"
            return {**base, "status": status, "metric": "max_abs_err", "value": value, "threshold": 0.0,
                    "ratio": math.inf if value else 0.0, "sensitivity": float(sens.max()),
                    "message": f"{row}: the reference is all zeros; target max |value| {value:.3g}"}
        rel_rmse = float(err.square().mean().sqrt()) / rms_ref
        max_err = float(err.max()) / max_ref
        sens_rms = float(sens.square().mean().sqrt()) / rms_ref
        sens_max = float(sens.max()) / max_ref
        cands = [("rel_rmse", rel_rmse, thr + sens_rms, sens_rms), ("max_err", max_err, thr + sens_max, sens_max)]
        metric, value, allowed, s = max(cands, key=lambda c: c[1] / c[2])
        status = "error" if value > allowed else "pass"
        verb = "exceeds" if status == "error" else "within"
        return {**base, "status": status, "metric": metric, "value": value, "threshold": allowed,
                "ratio": value / allowed, "sensitivity": s,
                "message": f"{row}: {metric} {value:.4g} {verb} {allowed:.4g} (free benchmark threshold "
                           f"{thr:g} for {str(t.dtype).replace('torch.', '')} + bit-noise sensitivity {s:.3g})"}

    def errors(self) -> list[tuple[str, dict]]:
        """The calls at risk, in execution order."""
        return [(k, v) for k, v in self.results.items() if v["status"] == "error"]

    def as_json(self) -> dict:
        """The step's verdicts as written to ``free_benchmark.json``."""
        return {"version": 1, "mode": self.mode, "perturbation": "bit_noise",
                "thresholds": {str(k): v for k, v in self.thresholds.items()},
                "nodes": {k: {f: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                              for f, v in rec.items()} for k, rec in self.results.items()}}


def run_forward(model: Any, inputs: dict, dump_path: str, *, faults: tuple = (), mode: str = "improve_precision",
                level: str = "L1") -> FreeBenchmark:
    """One forward of ``model(**inputs)`` under capture (statistics) with the free benchmark; returns its verdicts.

    Args:
        model: the model on its device and in its dtype (run as it is, under ``torch.no_grad``).
        inputs: keyword inputs of the forward.
        dump_path: where the capture writes its dump (a fresh folder).
        faults: :class:`~msprobe_ci.capture.inject.Fault` list applied to the run (tests, benchmarks).
        mode: ``improve_precision`` (default) or ``to_cpu``.
        level: the capture level (default ``L1``: API calls).

    Raises:
        ValueError: an unknown mode. MsprobeError: a dump folder that holds files.
    """
    from .capture import CaptureSession
    from .config import DumpConfig

    fb = FreeBenchmark(mode)
    cs = CaptureSession(DumpConfig(dump_path=dump_path, level=level, task="statistics"), faults=faults, free_bench=fb)
    cs.start(model)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        cs.stop()
        cs.close()
    return fb
