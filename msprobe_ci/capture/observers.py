"""What the capture engine tells its observers, and the observers other than the statistics.

The engine (:class:`~msprobe_ci.capture.session.CaptureSession`) sees three kinds of event: a torch API call
(:class:`ApiCall`), a module call (:class:`ModuleCall`) and a collective (:class:`CommCall`). It calls its
observers in one order, the one they are listed in (statistics, free benchmark, coverage, isolation, faults), on the
way in, and in the reverse order on the way out: each observer wraps the ones after it, as context managers nest.
So the faults, innermost, change an output first; the isolation judges the output the model gets; the coverage,
around the isolation, knows whether the call could be judged; the statistics, outermost, record the inputs the
model gave and the output it got. Every observer method is a no-op here: an observer overrides what it needs.

Per-call notes live on the call objects (slots), one per observer that needs one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .coverage import Coverage
    from .inject import FaultLog
    from .state import Machinery


class ApiCall:
    """One torch API call, as the observers see it.

    Attributes:
        name: its forward node (``Functional.linear.3.forward``); ``bwd_name`` its backward node.
        prefix, api, api_id, n: ``Functional``, ``linear``, ``Functional.linear``, the call index.
        func, args, kwargs: the callable and the arguments the kernel is called with (the isolation may tap them).
        record: recorded (and so judged, counted and benchmarked); an unrecorded call can still carry faults.
        record_bwd: its backward is recorded.
        fwd_faults, bwd_faults: the faults due on this call's output / on the gradients it produces.
        out: the output as the model gets it (a fault applied); ``orig`` the kernel's own.
        entry: the statistics' record. pending: the free benchmark's. iso: the isolation's call (or None).
        unjudged: why the isolation could not judge it (None: judged or not isolated).
        cov_before, cov_seen: the coverage's note (the input nodes, the captured count before the call).
        extra: fields other observers add to the dump record (msprobe ignores them: ``quantization``).
    """

    __slots__ = ("name", "bwd_name", "prefix", "api", "api_id", "n", "func", "args", "kwargs", "record",
                 "record_bwd", "fwd_faults", "bwd_faults", "out", "orig", "entry", "pending", "iso", "unjudged",
                 "cov_before", "cov_seen", "extra")

    def __init__(self, name: str, prefix: str, api: str, n: int, func: Any, args: tuple, kwargs: dict,
                 record: bool, fwd_faults: list, bwd_faults: list):
        self.name, self.prefix, self.api, self.n = name, prefix, api, n
        self.api_id = f"{prefix}.{api}"
        self.bwd_name = f"{self.api_id}.{n}.backward"
        self.func, self.args, self.kwargs = func, args, kwargs
        self.record, self.record_bwd = record, False
        self.fwd_faults, self.bwd_faults = fwd_faults, bwd_faults
        self.out = self.orig = self.entry = self.pending = self.iso = self.unjudged = None
        self.cov_before, self.cov_seen = None, 0
        self.extra: dict[str, Any] = {}

    def release(self) -> None:
        """Drop the call's tensors once its forward is done (its backward event needs its names and faults)."""
        self.func = self.out = self.orig = self.entry = self.pending = self.iso = self.cov_before = None
        self.args, self.kwargs, self.extra = (), {}, {}


class ModuleCall:
    """One forward call of a hooked module: its dump name, the statistics' entry, the isolation's call and the
    backward-hook state (the engine's)."""

    __slots__ = ("name", "entry", "iso", "whole", "judged", "bwd_name", "bwd_recs", "in_idx", "n_in", "out_idx",
                 "n_out", "grad_out")

    def __init__(self, name: str, whole: bool):
        self.name = name
        self.whole = whole  # isolated whole (its APIs are not seen)
        self.entry: dict | None = None  # the statistics' record (None: filtered out)
        self.iso: Any = None  # the isolation's module call
        self.judged = True  # the forward's isolation done (or none asked): the isolation sets it False
        self.bwd_name = ""  # set when the call's backward is hooked
        self.bwd_recs: list | bool | None = None  # None: backward not begun; False: begun, not recorded
        self.in_idx: list[int] | None = None  # positional args routed through the input alias node
        self.n_in = 0
        self.out_idx: list[int] = []
        self.n_out = 0
        self.grad_out: tuple | None = None


class CommCall:
    """One torch.distributed collective (``Distributed.<op>.<n>.forward``).

    Attributes:
        op, n, name, func, args, kwargs: the op (``all_reduce``), call index, node, callable and arguments.
        functional: an out-of-place functional collective (its output is ``result``).
        record: recorded. faults: the faults due on what it writes. judged: the isolation judges it.
        entry: the statistics' record. before: the isolation's copy of an input the op overwrites.
        result: what the call returned.
    """

    __slots__ = ("op", "n", "name", "api_id", "func", "args", "kwargs", "functional", "record", "faults", "judged",
                 "entry", "before", "result")

    def __init__(self, op: str, n: int, func: Any, args: tuple, kwargs: dict, functional: bool, record: bool,
                 faults: list):
        self.op, self.n, self.func, self.args, self.kwargs = op, n, func, args, kwargs
        self.api_id = f"Distributed.{op}"
        self.name = f"{self.api_id}.{n}.forward"
        self.functional, self.record, self.faults = functional, record, faults
        self.judged = False
        self.entry = self.before = self.result = None


class Observer:
    """The events of a capture; every method a no-op. The engine calls ``*_before`` in its observers' order and
    ``*_after`` (and the backward events) in the reverse order."""

    def api_before(self, call: ApiCall) -> None:
        """Before the kernel runs (an observer may replace ``call.args``/``call.kwargs``)."""

    def api_raised(self, call: ApiCall) -> None:
        """The kernel raised (the error propagates to the model after this)."""

    def api_after(self, call: ApiCall) -> None:
        """The kernel returned ``call.orig``; ``call.out`` is what the model gets (an observer may replace it)."""

    def api_backward(self, call: ApiCall, grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
        """The gradients w.r.t. the call's inputs are computed; returns replacements, or None to keep them."""
        return None

    def api_passthrough(self, args: tuple, kwargs: dict, out: Any) -> None:
        """A torch call that is not an API record ran (a view, a cast, a call inside the machinery's reach)."""

    def function_backward(self, grad_outputs: tuple) -> None:
        """A custom autograd Function's backward begins with these gradients (computed by the backward pass)."""

    def module_before(self, call: ModuleCall, module: Any, args: tuple, kwargs: dict) -> None:
        """A module's forward begins."""

    def module_judge(self, call: ModuleCall, output: Any) -> None:
        """A whole-isolated module's forward returned (before any hook registered earlier than the capture's)."""

    def module_after(self, call: ModuleCall, module: Any, output: Any) -> None:
        """A module's forward returned ``output``."""

    def aliased(self, new: Any, old: Any) -> None:
        """The engine routed ``old`` through an alias node: ``new`` stands for it from here on."""

    def module_backward_begin(self, call: ModuleCall) -> None:
        """Gradients w.r.t. a module call's outputs arrived (``call.grad_out``)."""

    def module_backward_end(self, call: ModuleCall, grad_input: tuple, grad_output: tuple) -> None:
        """Gradients w.r.t. a module call's inputs are computed."""

    def param_grad(self, name: str, pname: str, param: Any) -> None:
        """A parameter's gradient was accumulated (``name``: its ``parameters_grad`` node)."""

    def comm_before(self, call: CommCall) -> None:
        """Before a collective runs."""

    def comm_after(self, call: CommCall) -> None:
        """A collective's output is there (at once, or when its work is waited on)."""

    def reset(self, step: int) -> None:
        """A new step begins."""

    def start(self) -> None:
        """Recording begins (the API mode is on)."""

    def stop(self) -> None:
        """Recording ends."""

    def files(self) -> dict[str, Any]:
        """``{file name: JSON-able value}`` to write beside the step's dump.json."""
        return {}


#: the events called in the observers' order, and those called in the reverse order (the way out)
_INWARD = ("api_before", "api_passthrough", "function_backward", "module_before", "aliased", "module_backward_begin",
           "param_grad", "comm_before")
_OUTWARD = ("api_raised", "api_after", "api_backward", "module_judge", "module_after", "module_backward_end",
            "comm_after")


class Listeners:
    """Per event, the bound methods of the observers that override it, in the order the engine calls them: a hook
    calls only those (a call no observer follows costs no Python call per observer)."""

    def __init__(self, observers: tuple):
        for event in _INWARD + _OUTWARD:
            base = getattr(Observer, event)
            mine = [getattr(o, event) for o in observers if getattr(type(o), event) is not base]
            setattr(self, event, tuple(reversed(mine) if event in _OUTWARD else mine))


class FreeBenchObserver(Observer):
    """The free benchmark (:class:`~msprobe_ci.free_benchmark.FreeBenchmark`): each recorded call re-run in higher
    precision and on bit-noised inputs, the target's kernel (its forward faults included) the one under test."""

    def __init__(self, free_bench: Any, machinery: "Machinery"):
        self.free_bench, self.machinery = free_bench, machinery

    def api_before(self, call: ApiCall) -> None:
        if not call.record:
            return
        faults, n = call.fwd_faults, call.n

        def kernel(value: Any) -> Any:  # the target's kernel, fault included, for the bit-noise rerun
            for f in faults:
                value = f.apply(value, n)
            return value
        with self.machinery:
            call.pending = self.free_bench.before(call.name, call.prefix, call.api, call.func, call.args,
                                                  call.kwargs, kernel)

    def api_after(self, call: ApiCall) -> None:
        if call.pending is not None:
            with self.machinery:
                self.free_bench.after(call.pending, call.out)

    def reset(self, step: int) -> None:
        self.free_bench.reset()

    def files(self) -> dict[str, Any]:
        return {"free_benchmark.json": self.free_bench.as_json()}


class CoverageObserver(Observer):
    """The coverage figure (:class:`~msprobe_ci.capture.coverage.Coverage`): the ATen work inside a recorded call
    is captured; a call the isolation could not judge counts as unseen (it wraps the isolation, so it knows)."""

    def __init__(self, coverage: "Coverage"):
        self.coverage = coverage

    def api_before(self, call: ApiCall) -> None:
        if call.record:
            cov = self.coverage
            call.cov_before = cov.grad_fns(call.args, call.kwargs)
            call.cov_seen = cov.captured
            cov.depth += 1

    def api_raised(self, call: ApiCall) -> None:
        if call.record:
            self.coverage.depth -= 1

    def api_after(self, call: ApiCall) -> None:
        if not call.record:
            return
        cov = self.coverage
        cov.depth -= 1
        if call.unjudged is None:
            cov.adopt(call.out, call.cov_before)
        else:  # computed, not judged: unseen in the coverage figure (and so is its backward)
            cov.unjudged(call.api_id, cov.captured - call.cov_seen, call.unjudged)
        call.cov_before = None

    def reset(self, step: int) -> None:
        self.coverage.reset()

    def start(self) -> None:
        self.coverage.start()

    def stop(self) -> None:
        self.coverage.stop()

    def files(self) -> dict[str, Any]:
        return {"coverage.json": self.coverage.as_json()}


class IsolationObserver(Observer):
    """The isolation (:class:`~msprobe_ci.isolate.Isolator`): each recorded call judged on its own inputs while
    the target runs; provenance followed through every other call; whole modules judged where their APIs are not
    seen; a call's backward faults moved onto its tap, where the isolation sees the gradient before and after."""

    def __init__(self, isolator: Any, machinery: "Machinery", input_sources: bool = True):
        self.isolator, self.machinery = isolator, machinery
        # without API capture (L0) nothing follows views and casts between modules, so only a module's own
        # parameters count as sources there
        self.input_sources = input_sources

    def api_before(self, call: ApiCall) -> None:
        if not call.record:
            return
        with self.machinery:
            call.iso, call.args, call.kwargs = self.isolator.before(call.name, call.prefix, call.api, call.func,
                                                                    call.args, call.kwargs)
        call.unjudged = self.isolator.unjudged.get(call.name)

    def api_after(self, call: ApiCall) -> None:
        iso = self.isolator
        if not call.record:
            iso.propagate(call.args, call.kwargs, call.out)
            return
        with self.machinery:
            iso.after(call.iso, call.out)
        call.unjudged = iso.unjudged.get(call.name)
        quantized = iso.results.get(call.name, {}).get("quantization")
        if quantized:  # a cast into FP8: its underflow, saturation and range
            call.extra["quantization"] = quantized
        if call.bwd_faults and call.iso is not None and call.iso.taps:
            # isolated: the fault goes onto the gradients w.r.t. the API's inputs, at its tap
            iso.faults_at_tap[call.bwd_name] = [(f, call.n) for f in call.bwd_faults]
            call.bwd_faults = []

    def api_passthrough(self, args: tuple, kwargs: dict, out: Any) -> None:
        self.isolator.propagate(args, kwargs, out)

    def function_backward(self, grad_outputs: tuple) -> None:
        # the gradients reaching a custom Function were computed by the backward pass, not entered from outside:
        # its calls' inputs are no sources (compared with the bench's as a parameter would be)
        self.isolator.mark_produced(grad_outputs)

    def module_before(self, call: ModuleCall, module: Any, args: tuple, kwargs: dict) -> None:
        if call.whole and call.entry is not None:
            with self.machinery:
                call.iso = self.isolator.module_before(call.name, module, args, kwargs,
                                                       input_sources=self.input_sources)
            call.judged = call.iso is None

    def module_judge(self, call: ModuleCall, output: Any) -> None:
        if not call.judged:
            call.judged = True
            with self.machinery:
                self.isolator.module_after(call.iso, output)

    def module_after(self, call: ModuleCall, module: Any, output: Any) -> None:
        self.module_judge(call, output)  # not judged on return (a call that raised)
        self.isolator.mark_produced(output)

    def aliased(self, new: Any, old: Any) -> None:
        self.isolator.alias(new, old)

    def module_backward_end(self, call: ModuleCall, grad_input: tuple, grad_output: tuple) -> None:
        if call.iso is not None:
            with self.machinery:
                self.isolator.module_backward(call.iso, call.bwd_name, grad_input, grad_output)

    def comm_before(self, call: CommCall) -> None:
        from ..isolate.collectives import JUDGED, input_of

        call.judged = call.record and not call.functional and call.op in JUDGED
        if call.judged and call.op == "all_reduce":  # it overwrites its input: the judgement needs it as it was
            inp = input_of(call.op, call.args, call.kwargs)
            call.before = inp.detach().clone() if hasattr(inp, "detach") else None

    def comm_after(self, call: CommCall) -> None:
        if not call.judged:
            return
        from .comm import group_of

        with self.machinery:
            try:
                self.isolator.judge_collective(call.name, call.op, call.args, call.kwargs, call.before,
                                               group_of(call.args, call.kwargs))
            except Exception as exc:  # noqa: BLE001 - never break the user's run
                self.isolator.skip(call.name, f"collective isolation failed: {type(exc).__name__}: {exc}"[:200])

    def reset(self, step: int) -> None:
        self.isolator.reset(step)

    def files(self) -> dict[str, Any]:
        return {"isolation.json": self.isolator.as_json()}


class FaultObserver(Observer):
    """Fault injection (:mod:`.inject`): a due fault perturbs an API's output, the gradients it produces (where the
    isolation did not take them onto its tap) or what a collective wrote, logged in the :class:`~.inject.FaultLog`."""

    def __init__(self, log: "FaultLog", machinery: "Machinery"):
        self.log, self.machinery = log, machinery

    def api_after(self, call: ApiCall) -> None:
        for f in call.fwd_faults:
            call.out = self.log.apply(f, call.out, call.n)

    def api_backward(self, call: ApiCall, grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
        if not call.bwd_faults:
            return None
        new = tuple(grad_inputs)
        for f in call.bwd_faults:
            new = self.log.apply(f, new, call.n)
        return new

    def comm_after(self, call: CommCall) -> None:
        if not call.faults:
            return
        from ..isolate.collectives import output_of

        out = output_of(call.op, call.args, call.kwargs)
        if out is None:
            return
        with self.machinery:  # a faulty collective: what it wrote is off, as the rank receives it
            value = out
            for f in call.faults:
                value = self.log.apply(f, value, call.n)
            out.copy_(value)
