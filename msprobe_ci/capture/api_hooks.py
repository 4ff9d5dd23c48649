"""L1 capture: torch API calls through ``TorchFunctionMode``, their records, and their backward entries."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

from .. import amp
from . import naming
from .coverage import quiet
from .inject import Fault

#: in-place APIs that overwrite their first argument without reading it: that argument is recorded by shape only
OVERWRITES = frozenset({"copy_", "zero_", "fill_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                        "geometric_", "cauchy_", "log_normal_", "set_", "resize_"})


class _ApiMode(TorchFunctionMode):
    """Routes every torch API call to the session. Inside code that ``torch.compile`` traces it steps aside: API
    capture (and fault injection) cannot reach into compiled graphs; module hooks outside them still record."""

    def __init__(self, session):  # a CaptureSession
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            return func(*args, **(kwargs or {}))
        return self.session._on_api(func, args, kwargs or {})


_is_compiling = torch.compiler.is_compiling


class ApiCapture:
    """The API half of :class:`~msprobe_ci.capture.session.CaptureSession`: one record per outermost torch API
    call (isolation, free benchmark and faults around it), its backward entry from a hook on its output's grad_fn."""

    def _on_api(self, func, args, kwargs):
        if self._busy or not self.running:
            return func(*args, **kwargs)
        for a in args:  # a custom autograd Function's output: its backward's calls are to be seen too
            if type(a) is torch.Tensor and isinstance(a.grad_fn, BackwardCFunction) and \
                    _outside_torch(type(a.grad_fn)):
                self._see_backward_of(a.grad_fn)
        try:
            info = naming.lookup(func)
        except TypeError:  # unhashable callable
            info = None
        if info is None or info[2] == naming.SKIP:
            return self._passthrough(func, args, kwargs)
        prefix, api, kind = info
        if api == "view_as" and naming.called_from_hook_plumbing():
            return self._passthrough(func, args, kwargs)  # a hook's alias of a tensor keeps its provenance
        if prefix != "Functional":
            op = naming.operator_name(api, args)
            if op is not None:
                prefix, api = "Tensor", op
        key = f"{prefix}.{api}."
        n = self.api_counts.get(key, 0)
        fwd_name = f"{key}{n}.forward"
        api_id = f"{prefix}.{api}"
        faults = [f for f in self.faults if f.api == api_id and f.on_rank(self.fault_rank)] \
            if api_id in self._fault_apis else ()
        if self.with_construct and self.api_level:
            self.construct[fwd_name] = self._fwd_stack[-1] if self._fwd_stack else None
        # a cast into an FP8 format is where a quantization recipe's scale shows: recorded (and judged by the
        # quantization standard under isolation) although msprobe's FOCUS level leaves casts out
        record = self.api_level and (kind == naming.RECORD or (api in _CASTS and _fp8_cast(args, kwargs))) and \
            self._keep(fwd_name)
        entry = None
        if record and self._fwd_in:
            with self.machinery:
                files = self._tensor_file(fwd_name)
                # the destination of an op that overwrites it without reading it (FSDP1's copy_ into a fresh
                # low-precision shard) holds whatever was there, often uninitialised memory: its shape only
                entry = {
                    "input_args": [self.builder.shape_only(a) if i == 0 and api in OVERWRITES and
                                   isinstance(a, torch.Tensor) else
                                   self.builder.value(a, f"{fwd_name}.input.{i}" if files else None)
                                   for i, a in enumerate(args)],
                    "input_kwargs": {k: self.builder.value(v, f"{fwd_name}.kwargs.{k}" if files else None, k)
                                     for k, v in kwargs.items()},
                }
                self._stack(fwd_name)
        fwd_faults = [f for f in faults if f.direction == "forward" and f.matches(api_id, n, "forward",
                                                                                  self.current_step)]
        pending = None
        if record and self.free_bench is not None:
            def kernel(value: Any) -> Any:  # the target's kernel, fault included, for the bit-noise rerun
                for f in fwd_faults:
                    value = f.apply(value, n)
                return value
            with self.machinery:
                pending = self.free_bench.before(fwd_name, prefix, api, func, args, kwargs, kernel)
        iso = self.isolator if record else None
        call = None
        if iso is not None:
            with self.machinery:
                call, args, kwargs = iso.before(fwd_name, prefix, api, func, args, kwargs)
        cov = self.coverage if record else None
        if cov is not None:
            before = cov.grad_fns(args, kwargs)
            seen_before = cov.captured
            cov.depth += 1
        try:
            out = orig = self._call(func, args, kwargs)
            for f in fwd_faults:
                out = self.fault_log.apply(f, out, n)
        finally:
            if cov is not None:
                cov.depth -= 1
        unjudged = iso is not None and fwd_name in iso.unjudged
        if cov is not None and not unjudged:
            cov.adopt(out, before)
        self.api_counts[key] = n + 1
        if pending is not None:
            with self.machinery:
                self.free_bench.after(pending, out)
        if iso is not None:
            with self.machinery:
                iso.after(call, out)
            if cov is not None and fwd_name in iso.unjudged:  # computed, not judged: unseen in the coverage figure
                cov.unjudged(api_id, cov.captured - seen_before, iso.unjudged[fwd_name])
        elif self.isolator is not None:
            self.isolator.propagate(args, kwargs, out)
        if record:
            with self.machinery:
                files = self._tensor_file(fwd_name)
                if entry is None:
                    entry = {"input_args": [], "input_kwargs": {}}
                    self._stack(fwd_name)
                entry["output"] = (self._encode_output(out, f"{fwd_name}.output" if files else None)
                                   if self._fwd_out else [])
                ac = amp.autocast_dtype(args, kwargs)
                if ac is not None:  # the autocast dtype it ran under (msprobe_ci.amp; msprobe ignores the field)
                    entry[amp.FIELD] = str(ac)
                quantized = iso.results.get(fwd_name, {}).get("quantization") if iso is not None else None
                if quantized:  # a cast into FP8: its underflow, saturation and range (msprobe ignores the field)
                    entry["quantization"] = quantized
                self.data[fwd_name] = entry
        bwd_faults = [f for f in faults if f.matches(api_id, n, "backward", self.current_step)]
        if bwd_faults and call is not None and call.taps:
            # isolated: the fault goes onto the gradients w.r.t. the API's inputs, at its tap, where the
            # isolation sees the value before and after it
            iso.faults_at_tap[f"{key}{n}.backward"] = [(f, n) for f in bwd_faults]
            bwd_faults = []
        if (record and self._bwd) or bwd_faults:
            node = _first_grad_fn(orig)
            if node is not None and _is_input_node(node, args, kwargs):
                node = None  # identity (eval dropout, p=0) or alias: the node belongs to an earlier op
            if node is not None and torch.is_grad_enabled():
                bwd_name = f"{key}{n}.backward"
                node.register_hook(self._api_backward_hook(bwd_name, record and self._bwd and self._keep(bwd_name),
                                                           bwd_faults, n))
        return out

    def _see_backward_of(self, node) -> None:
        """Put this capture's API mode back on the stack while a custom autograd Function's backward runs.

        Autograd runs a node's backward without the torch-function modes of the code that built it, so the torch
        calls a Python backward makes (torchao's float8 gradient GEMMs, a fused op's own backward, a user's
        ``autograd.Function``) reached no capture: computed, not judged, counted as unseen by the coverage mode. A
        pre-hook on the node pushes the mode (where it is not on that thread's stack already) and a hook pops it
        when the node is done; the calls are then recorded, isolated and numbered as API calls made in the backward
        pass (``<Prefix>.<api>.<n>.forward``, as msprobe's patched functions record them), the gradients it is
        given counted as computed (no sources). Once per node; only for a
        Function defined outside PyTorch and msprobe-ci (:func:`_outside_torch`), and reentrant activation
        checkpointing (:data:`_RECOMPUTING`: its backward recomputes the segment and runs that recomputation's
        backward, the segment's only one); PyTorch's and ours are otherwise plumbing (module backward hooks,
        isolation taps, FSDP's post-backward, DTensor conversions), not the model's arithmetic."""
        if getattr(node, "_msprobe_ci_seen", None) is self._mode:
            return
        try:
            node._msprobe_ci_seen = self._mode
        except AttributeError:  # a node that takes no attribute: its backward stays unseen
            return
        mode, pushed = self._mode, []

        def pre(grad_outputs):
            on = mode is self._mode and self.running and mode not in _function_modes()
            if on:
                mode.__enter__()
            if self.running and self.isolator is not None:
                # the gradients reaching it were computed by the backward pass, not entered from outside: its
                # calls' inputs are no sources (compared with the bench's as a parameter would be)
                self.isolator.mark_produced(grad_outputs)
            pushed.append(on)

        def post(grad_inputs, grad_outputs):
            if pushed and pushed.pop():
                mode.__exit__(None, None, None)
        node.register_prehook(pre)
        node.register_hook(post)

    def _encode_output(self, out: Any, stem: str | None) -> Any:
        if isinstance(out, torch.Tensor):
            return [self.builder.value(out, f"{stem}.0" if stem else None)]
        if isinstance(out, tuple) and hasattr(out, "_fields") and not hasattr(out, "n_fields"):
            return self.builder.value(out, stem)
        if isinstance(out, (list, tuple)):
            return [self.builder.value(v, f"{stem}.{i}" if stem else None) for i, v in enumerate(out)]
        if isinstance(out, dict) or (hasattr(out, "to_tuple") and hasattr(out, "keys")):
            return self.builder.value(out, stem)
        return [self.builder.value(out, f"{stem}.0" if stem else None)]

    def _api_backward_hook(self, name: str, record: bool, faults: list[Fault], call: int):
        def hook(grad_inputs, grad_outputs):
            new = None
            if faults:
                new = tuple(grad_inputs)
                for f in faults:
                    new = self.fault_log.apply(f, new, call)
                grad_inputs = new
            if record and self.running and not self._busy:
                with self.machinery:
                    files = self._tensor_file(name)
                    if self.with_construct:
                        self.construct[name] = self._bwd_stack[-1] if self._bwd_stack else None
                    self.data[name] = {
                        "input": [self.builder.value(g, f"{name}.input.{i}" if files else None)
                                  for i, g in enumerate(grad_outputs)] if self._bwd_in else [],
                        "output": [self.builder.value(g, f"{name}.output.{i}" if files else None)
                                   for i, g in enumerate(grad_inputs)] if self._bwd_out else [],
                    }
            return new
        return quiet(hook)


_CASTS = frozenset({"to", "type"})
_function_modes = torch.overrides._get_current_function_mode_stack


@functools.lru_cache(maxsize=None)
def _outside_torch(node_type: type) -> bool:
    """Whether a custom autograd Function's node (by type) belongs to a Function defined outside PyTorch and
    msprobe-ci (torchao, Transformer Engine, a user's op): whose backward computes the model's gradients."""
    cls = getattr(node_type, "_forward_cls", None)
    module = str(getattr(cls, "__module__", "") or "")
    if cls is not None and f"{module}.{cls.__name__}" in _RECOMPUTING:
        return True
    return cls is not None and module.split(".", 1)[0] not in ("torch", "msprobe_ci")


#: PyTorch's own Functions whose backward runs the model's arithmetic: reentrant activation checkpointing
#: (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, transformers' ``gradient_checkpointing_enable()``
#: default) runs its segment's forward under ``no_grad`` and recomputes it with grad in its backward, then runs the
#: backward of that recomputation: the segment's only gradients
_RECOMPUTING = frozenset({"torch.utils.checkpoint.CheckpointFunction"})


def _fp8_cast(args: tuple, kwargs: dict) -> bool:
    """Whether a ``to``/``type`` call names an FP8 dtype (:data:`msprobe_ci.kernels.FP8_DTYPES`)."""
    from ..kernels import FP8_DTYPES

    return any(a in FP8_DTYPES for a in args if isinstance(a, torch.dtype)) or kwargs.get("dtype") in FP8_DTYPES


def _first_grad_fn(value: Any):
    if isinstance(value, torch.Tensor):
        return value.grad_fn if value.requires_grad else None
    if isinstance(value, (list, tuple)):
        for v in value:
            node = _first_grad_fn(v)
            if node is not None:
                return node
    if isinstance(value, dict):
        for v in value.values():
            node = _first_grad_fn(v)
            if node is not None:
                return node
    return None


def _is_input_node(node, args, kwargs) -> bool:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.grad_fn is node:
            return True
        if isinstance(v, (list, tuple)):
            if any(isinstance(x, torch.Tensor) and x.grad_fn is node for x in v):
                return True
    return False
