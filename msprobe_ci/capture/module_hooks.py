"""L0 capture: forward and backward hooks on every submodule (each call one event for the engine's observers), one
alias node routing a module call's gradients, and parameter-gradient hooks."""

from __future__ import annotations

from typing import Any

import torch

from .coverage import quiet
from .observers import ModuleCall


#: modules that wrap the user's module and compute nothing of their own (FSDP1, activation checkpointing, CPU
#: offload): not recorded, and their attribute left out of the names beneath (:func:`model_path`)
WRAPPERS = frozenset({"FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper"})
_WRAPPED = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_offload_wrapped_module")


def model_path(path: str) -> str:
    """A module's path as the unwrapped model has it: the wrappers' attributes (:data:`WRAPPERS`:
    ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``) left out, so an FSDP1-wrapped or checkpointed model's
    nodes match an unwrapped bench and msprobe's dumps of the same model."""
    if "_wrapped_module" not in path:
        return path
    return ".".join(p for p in path.split(".") if p not in _WRAPPED)


def class_name(mod: torch.nn.Module) -> str:
    """The class name a module's nodes carry: its own, except for FSDP2's ``FSDP<Class>`` (the subclass
    ``fully_shard`` makes of ``(FSDPModule, Class)``), which keeps ``Class``: a sharded model's nodes match an
    unsharded bench and msprobe's dumps of the same model."""
    cls = type(mod)
    bases = cls.__bases__
    if cls.__name__.startswith("FSDP") and len(bases) == 2 and bases[0].__name__ == "FSDPModule" and \
            cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1].__name__
    return cls.__name__


class ModuleHooks:
    """L0 capture's hooks (L0 and mix): each module call one :class:`~.observers.ModuleCall` for the engine's
    observers, its backward routed through one :class:`_Alias` node, its parameters' gradients seen as they
    accumulate. The engine's bookkeeping (call counters, the construct's parents, the module stacks) is done here;
    the observers record and judge.

    Args:
        engine: the :class:`~msprobe_ci.capture.session.CaptureSession`.
    """

    def __init__(self, engine):
        self.engine = engine
        self.hooked: dict[int, list] = {}  # id(model) -> its hook handles

    def hook_model(self, model: torch.nn.Module, root_prefix: str) -> None:
        """Hook every submodule of ``model`` once (the root itself and :data:`WRAPPERS` are not recorded; the
        engine's opaque regions get no hooks below them)."""
        if id(model) in self.hooked:
            return
        eng = self.engine
        handles = []
        for path, mod in model.named_modules():
            if mod is model or path.startswith(eng.opaque_prefixes):
                continue
            base = f"Module.{root_prefix}{model_path(path)}.{class_name(mod)}"
            # a wrapper records nothing of its own; the module it wraps at the root is the model itself
            wrapper = class_name(mod) in WRAPPERS or not model_path(path)
            # modules whose APIs are not seen (L0 capture, a torch.compile region) are isolated whole
            whole = eng.isolator is not None and (not eng.api_level or f"{path}." in eng.opaque_prefixes)
            if not wrapper:
                handles.append(mod.register_forward_pre_hook(self._fwd_pre_hook(base, whole), with_kwargs=True))
                handles.append(mod.register_forward_hook(self._fwd_hook(), with_kwargs=True, always_call=True))
                if whole:
                    # judged before any hook registered earlier runs: FSDP2's post-forward hook reshards the
                    # module, freeing the unsharded parameters the isolation's re-runs read (a segfault, not an
                    # error), and the judged output is the forward's own
                    handles.append(mod.register_forward_hook(self._isolate_hook(), prepend=True))
            if eng.bwd:
                # the module's backward hooks are set per call by the forward hooks (see _module_io)
                for pname, p in mod.named_parameters(recurse=False):
                    if p.requires_grad:
                        handles.append(p.register_post_accumulate_grad_hook(self._pgrad_hook(base, pname)))
        self.hooked[id(model)] = handles

    def remove(self) -> None:
        """Remove every hook installed."""
        for handles in self.hooked.values():
            for h in handles:
                h.remove()
        self.hooked.clear()

    def _fwd_pre_hook(self, base: str, whole: bool = False):
        key = f"{base}.forward."
        bkey = f"{base}.backward."
        eng = self.engine

        def hook(module, args, kwargs):
            if not eng.recording:
                return None
            state = eng.state
            n = state.module_counts.get(key, 0)
            state.module_counts[key] = n + 1
            name = f"{key}{n}"
            if eng.with_construct:
                state.construct[name] = state.fwd_stack[-1] if state.fwd_stack else None
            state.fwd_stack.append(name)
            call = ModuleCall(name, whole)
            for before in eng.on.module_before:
                before(call, module, args, kwargs)
            new_args = None
            if eng.bwd and torch.is_grad_enabled():
                call.bwd_name, call.n_in = f"{bkey}{n}", len(args)
                new_args = self._module_io(call, args, inputs=True)
            state.pending_fwd.setdefault(id(module), []).append(call)
            return None if new_args is None else (new_args, kwargs)
        return quiet(hook)

    def _module_io(self, call: ModuleCall, value: Any, inputs: bool) -> Any:
        """Route a module call's positional inputs (or its outputs) through one :class:`_Alias` node, whose
        backward hooks see the gradients w.r.t. them: what ``register_full_backward_hook`` does, but with aliases
        where torch makes views. Returns the new args (outputs), or None when no tensor in them requires grad.

        Only a top-level tensor or tuple of tensors is followed (torch's rule; a ``ModelOutput`` dict gets no
        backward record, as in msprobe)."""
        single = isinstance(value, torch.Tensor)
        if not single and not isinstance(value, tuple):
            return None
        items = [value] if single else list(value)
        idx = [i for i, v in enumerate(items) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not idx:
            return None
        eng = self.engine
        with eng.machinery:
            new = _Alias.apply(*(items[i] for i in idx))
        for i, t in zip(idx, new):
            for aliased in eng.on.aliased:
                aliased(t, items[i])
            items[i] = t
        node = new[0].grad_fn
        if inputs:
            call.in_idx, call.n_in = idx, len(items)
            node.register_hook(self._bwd_hook(call))
        else:
            call.out_idx, call.n_out = idx, len(items)
            node.register_prehook(self._bwd_pre_hook(call))
        if single:
            return items[0]
        return tuple(items) if type(value) is tuple else type(value)(*items)

    def _fwd_hook(self):
        eng = self.engine

        def hook(module, args, kwargs, output):
            if eng.machinery.busy:
                return None
            state = eng.state
            pending = state.pending_fwd.get(id(module))
            if not pending:
                return None
            call = pending.pop()
            if state.fwd_stack and state.fwd_stack[-1] == call.name:
                state.fwd_stack.pop()
            for after in eng.on.module_after:
                after(call, module, output)
            if not call.bwd_name:
                return None
            return self._module_io(call, output, inputs=False)
        return quiet(hook)

    def _isolate_hook(self):
        """A whole-isolated module's forward is judged as soon as it returns (registered first, see
        :meth:`hook_model`); the recording hook that runs last then has nothing left to judge."""
        eng = self.engine

        def hook(module, args, output):
            if eng.machinery.busy:
                return None
            pending = eng.state.pending_fwd.get(id(module))
            call = pending[-1] if pending else None
            if call is not None and not call.judged:
                for judge in eng.on.module_judge:
                    judge(call, output)
            return None
        return quiet(hook)

    def _bwd_pre_hook(self, call: ModuleCall):
        """Gradients w.r.t. a module call's outputs arrived: the backward entry begins (its ``input``)."""
        eng = self.engine

        def hook(grad_outputs):
            grads = [None] * call.n_out
            for i, g in zip(call.out_idx, grad_outputs):
                grads[i] = g
            call.grad_out = tuple(grads)
            if eng.recording:
                state = eng.state
                if eng.with_construct:
                    state.construct[call.bwd_name] = state.bwd_stack[-1] if state.bwd_stack else None
                state.bwd_stack.append(call.bwd_name)
                call.bwd_recs = False  # the backward began
                for begin in eng.on.module_backward_begin:
                    begin(call)
            if call.in_idx is None:  # no input requires grad: the module's backward ends here
                self._bwd_done(call, (None,) * call.n_in)
            return None
        return quiet(hook)

    def _bwd_hook(self, call: ModuleCall):
        """Gradients w.r.t. a module call's inputs are computed: the backward entry ends (its ``output``)."""
        def hook(grad_inputs, _grad_outputs):
            grads = [None] * call.n_in
            for i, g in zip(call.in_idx, grad_inputs):
                grads[i] = g
            self._bwd_done(call, tuple(grads))
            return None
        return quiet(hook)

    def _bwd_done(self, call: ModuleCall, grad_input: tuple) -> None:
        grad_output, call.grad_out = call.grad_out, None
        if grad_output is None:  # gradient reached the inputs but not through the outputs (double backward)
            return
        begun = call.bwd_recs is not None
        for end in self.engine.on.module_backward_end:
            end(call, grad_input, grad_output)
        stack = self.engine.state.bwd_stack
        if begun and call.bwd_name in stack:
            stack.remove(call.bwd_name)

    def _pgrad_hook(self, base: str, pname: str):
        key = f"{base}.parameters_grad"
        eng = self.engine

        def hook(param):
            if not eng.recording or param.grad is None:
                return
            # one entry per backward pass: a new one when the module's first parameter accumulates again
            state = eng.state.pgrad.setdefault(key, [None, 0, None])  # first param, count, current entry name
            if state[0] is None:
                state[0] = pname
            if pname == state[0] or state[2] is None:
                state[2] = f"{key}.{state[1]}"
                state[1] += 1
            name = state[2]
            if not eng.keep(name):
                return
            for seen in eng.on.param_grad:
                seen(name, pname, param)
        return quiet(hook)


class _Alias(torch.autograd.Function):
    """Identity whose outputs share storage and version counter with its inputs (``detach``) but are not autograd
    views: in-place ops on them are allowed and behave as on the tensors they alias (saved-tensor checks
    included), where the views of ``register_full_backward_hook`` forbid them ("Output 0 of BackwardHookFunction
    is a view and is being modified inplace": Falcon's ``mlp_output += attention_output``, ResNet's
    ``out += identity``, ``nn.ReLU(inplace=True)``). No copy is made; gradients pass unchanged.

    One difference from the uncaptured run remains, where torch's own hooks raise instead: after an in-place op on
    an alias, a *different* reference to the same tensor used later in the graph does not carry that op's
    gradient."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return grads
