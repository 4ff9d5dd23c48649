"""L1 capture: torch API calls through ``TorchFunctionMode``, each one event for the engine's observers, and its
backward."""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

from . import naming
from .coverage import quiet
from .observers import ApiCall
from ..kernels.choice import first_grad_fn as _first_grad_fn, grad_fn_of as _grad_fn_of, is_input_node as _is_input_node


class _ApiMode(TorchFunctionMode):
    """Routes every torch API call to the session. Inside code that ``torch.compile`` traces it steps aside: API
    capture (and fault injection) cannot reach into compiled graphs; module hooks outside them still record."""

    def __init__(self, hooks: "ApiHooks"):
        super().__init__()
        self.on_api = hooks.on_api

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            return func(*args, **(kwargs or {}))
        return self.on_api(func, args, kwargs or {})


_is_compiling = torch.compiler.is_compiling


class ApiHooks:
    """L1 capture's hooks: one :class:`~.observers.ApiCall` per outermost torch API call, passed through the
    engine's observers (in order on the way in, in reverse on the way out; :mod:`.observers`), and its backward
    event from a hook on its output's grad_fn.

    Args:
        engine: the :class:`~msprobe_ci.capture.session.CaptureSession` (its state, filters, observers).
    """

    def __init__(self, engine):
        self.engine = engine
        self.mode: _ApiMode | None = None  # the TorchFunctionMode while recording

    def on_api(self, func, args, kwargs):
        eng = self.engine
        if eng.machinery.busy or not eng.running:
            return func(*args, **kwargs)
        for a in args:  # a custom autograd Function's output: its backward's calls are to be seen too
            node = _grad_fn_of(a) if type(a) is torch.Tensor else None
            if isinstance(node, BackwardCFunction) and _outside_torch(type(node)):
                self._see_backward_of(node)
        try:
            info = naming.lookup(func)
        except TypeError:  # unhashable callable
            info = None
        if info is None or info[2] == naming.SKIP:
            return self.passthrough(func, args, kwargs)
        prefix, api, kind = info
        if api == "view_as" and naming.called_from_hook_plumbing():
            return self.passthrough(func, args, kwargs)  # a hook's alias of a tensor keeps its provenance
        if prefix != "Functional":
            op = naming.operator_name(api, args)
            if op is not None:
                prefix, api = "Tensor", op
        key = f"{prefix}.{api}."
        counts = eng.state.api_counts
        n = counts.get(key, 0)
        fwd_name = f"{key}{n}.forward"
        fwd_faults = bwd_faults = ()
        if eng.fault_apis and f"{prefix}.{api}" in eng.fault_apis:
            fwd_faults, bwd_faults = eng.faults_due(f"{prefix}.{api}", n)
        # a cast into an FP8 format is where a quantization recipe's scale shows: recorded (and judged by the
        # quantization standard under isolation) although msprobe's FOCUS level leaves casts out
        record = eng.api_level and (kind == naming.RECORD or (api in _CASTS and _fp8_cast(args, kwargs))) and \
            eng.keep(fwd_name)
        call = ApiCall(fwd_name, prefix, api, n, func, args, kwargs, record, fwd_faults, bwd_faults)
        on = eng.on
        for before in on.api_before:
            before(call)
        try:
            call.out = call.orig = eng.call_kernel(func, call.args, call.kwargs)
        except BaseException:
            for raised in on.api_raised:
                raised(call)
            raise
        counts[key] = n + 1
        for after in on.api_after:
            after(call)
        if (record and eng.bwd) or call.bwd_faults:
            node = _first_grad_fn(call.orig)
            if node is not None and _is_input_node(node, call.args, call.kwargs):
                node = None  # identity (eval dropout, p=0) or alias: the node belongs to an earlier op
            if node is not None and torch.is_grad_enabled():
                call.record_bwd = record and eng.bwd and eng.keep(call.bwd_name)
                node.register_hook(self._api_backward_hook(call))
        out = call.out
        call.release()  # a call its backward hook holds keeps no tensor alive
        return out

    def passthrough(self, func, args, kwargs):
        """A torch call that is not an API record: run (with the float64 fallback) and shown to the observers
        that follow values through every call (provenance)."""
        eng = self.engine
        out = eng.call_kernel(func, args, kwargs)
        if eng.recording:
            for seen in eng.on.api_passthrough:
                seen(args, kwargs, out)
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
        if getattr(node, "_msprobe_ci_seen", None) is self.mode:
            return
        try:
            node._msprobe_ci_seen = self.mode
        except AttributeError:  # a node that takes no attribute: its backward stays unseen
            return
        mode, pushed, eng = self.mode, [], self.engine

        def pre(grad_outputs):
            on = mode is self.mode and eng.running and mode not in _function_modes()
            if on:
                mode.__enter__()
            if eng.running:
                for seen in eng.on.function_backward:
                    seen(grad_outputs)
            pushed.append(on)

        def post(grad_inputs, grad_outputs):
            if pushed and pushed.pop():
                mode.__exit__(None, None, None)
        node.register_prehook(pre)
        node.register_hook(post)

    def _api_backward_hook(self, call: ApiCall):
        listeners = self.engine.on.api_backward

        def hook(grad_inputs, grad_outputs):
            new = None
            for backward in listeners:
                r = backward(call, grad_inputs, grad_outputs)
                if r is not None:
                    new = grad_inputs = r
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
