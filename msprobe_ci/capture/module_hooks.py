"""L0 capture: forward and backward hooks on every submodule, one alias node routing a module call's gradients,
and parameter-gradient hooks."""

from __future__ import annotations

from typing import Any

import torch

from .coverage import quiet


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


class ModuleCapture:
    """The module half of :class:`~msprobe_ci.capture.session.CaptureSession` (L0 and mix)."""

    # ------------------------------------------------------------------ L0: modules
    def _hook_model(self, model: torch.nn.Module, root_prefix: str) -> None:
        if id(model) in self._hooked:
            return
        handles = []
        for path, mod in model.named_modules():
            if mod is model or path.startswith(self.opaque_prefixes):
                continue
            base = f"Module.{root_prefix}{model_path(path)}.{class_name(mod)}"
            # a wrapper records nothing of its own; the module it wraps at the root is the model itself
            wrapper = class_name(mod) in WRAPPERS or not model_path(path)
            # modules whose APIs are not seen (L0 capture, a torch.compile region) are isolated whole
            whole = self.isolator is not None and (not self.api_level or f"{path}." in self.opaque_prefixes)
            if not wrapper:
                handles.append(mod.register_forward_pre_hook(self._fwd_pre_hook(base, whole), with_kwargs=True))
                handles.append(mod.register_forward_hook(self._fwd_hook(base), with_kwargs=True,
                                                         always_call=True))
                if whole:
                    # judged before any hook registered earlier runs: FSDP2's post-forward hook reshards the
                    # module, freeing the unsharded parameters the isolation's re-runs read (a segfault, not an
                    # error), and the judged output is the forward's own
                    handles.append(mod.register_forward_hook(self._isolate_hook(), prepend=True))
            if self._bwd:
                # the module's backward hooks are set per call by the forward hooks (see _module_io)
                for pname, p in mod.named_parameters(recurse=False):
                    if p.requires_grad:
                        handles.append(p.register_post_accumulate_grad_hook(self._pgrad_hook(base, pname)))
        self._hooked[id(model)] = handles

    def _fwd_pre_hook(self, base: str, whole: bool = False):
        key = f"{base}.forward."
        bkey = f"{base}.backward."

        def hook(module, args, kwargs):
            if not self.running or self._busy:
                return None
            n = self.module_counts.get(key, 0)
            self.module_counts[key] = n + 1
            name = f"{key}{n}"
            if self.with_construct:
                self.construct[name] = self._fwd_stack[-1] if self._fwd_stack else None
            self._fwd_stack.append(name)
            entry = None
            if self._keep(name):
                entry = {"input_args": [], "input_kwargs": {}}
                if self._fwd_in:
                    with self.machinery:
                        files = self._tensor_file(name)
                        entry["input_args"] = [self.builder.value(a, f"{name}.input.{i}" if files else None)
                                               for i, a in enumerate(args)]
                        entry["input_kwargs"] = {k: self.builder.value(v, f"{name}.kwargs.{k}" if files else None, k)
                                                 for k, v in kwargs.items()}
                        self._stack(name)
            mcall = None
            if whole and entry is not None:
                with self.machinery:
                    # without API capture (L0) nothing follows views and casts between modules, so only a
                    # module's own parameters count as sources there
                    mcall = self.isolator.module_before(name, module, args, kwargs, input_sources=self.api_level)
            call = _ModuleCall(name, entry, mcall)
            new_args = None
            if self._bwd and torch.is_grad_enabled():
                call.bwd_name, call.n_in = f"{bkey}{n}", len(args)
                new_args = self._module_io(call, args, inputs=True)
            self._pending_fwd.setdefault(id(module), []).append(call)
            return None if new_args is None else (new_args, kwargs)
        return quiet(hook)

    def _module_io(self, call: "_ModuleCall", value: Any, inputs: bool) -> Any:
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
        with self.machinery:
            new = _Alias.apply(*(items[i] for i in idx))
        for i, t in zip(idx, new):
            if self.isolator is not None:
                self.isolator.alias(t, items[i])
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

    def _fwd_hook(self, base: str):
        def hook(module, args, kwargs, output):
            if self._busy:
                return None
            pending = self._pending_fwd.get(id(module))
            if not pending:
                return None
            call = pending.pop()
            name, entry, mcall = call.name, call.entry, call.mcall
            if self._fwd_stack and self._fwd_stack[-1] == name:
                self._fwd_stack.pop()
            if self.isolator is not None:
                if not call.judged:  # not judged by _isolate_hook (a call that raised)
                    call.judged = True
                    with self.machinery:
                        self.isolator.module_after(mcall, output)
                self.isolator.mark_produced(output)
            if entry is not None and self.running:
                with self.machinery:
                    files = self._tensor_file(name)
                    entry["output"] = self._encode_output(output, f"{name}.output" if files else None) \
                        if self._fwd_out else []
                    entry["parameters"] = {
                        pname: self.builder.value(p, f"{name}.parameters.{pname}" if files else None)
                        for pname, p in module.named_parameters(recurse=False)} if self._fwd_out else {}
                    self.data.pop(name, None)
                    self.data[name] = entry
            if not call.bwd_name:
                return None
            return self._module_io(call, output, inputs=False)
        return quiet(hook)

    def _isolate_hook(self):
        """A whole-isolated module's forward is judged as soon as it returns (registered first, see
        :meth:`_hook_model`); the recording hook that runs last then has nothing left to judge."""
        def hook(module, args, output):
            if self._busy:
                return None
            pending = self._pending_fwd.get(id(module))
            call = pending[-1] if pending else None
            if call is not None and not call.judged:
                call.judged = True
                with self.machinery:
                    self.isolator.module_after(call.mcall, output)
            return None
        return quiet(hook)

    def _bwd_pre_hook(self, call: "_ModuleCall"):
        """Gradients w.r.t. a module call's outputs arrived: the backward entry begins (its ``input``)."""
        def hook(grad_outputs):
            grads = [None] * call.n_out
            for i, g in zip(call.out_idx, grad_outputs):
                grads[i] = g
            call.grad_out = tuple(grads)
            if self.running and not self._busy:
                name = call.bwd_name
                if self.with_construct:
                    self.construct[name] = self._bwd_stack[-1] if self._bwd_stack else None
                self._bwd_stack.append(name)
                call.bwd_recs = False  # the backward began; a list once recorded
                if self._keep(name):
                    with self.machinery:
                        files = self._tensor_file(name)
                        call.bwd_recs = [self.builder.value(g, f"{name}.input.{i}" if files else None)
                                         for i, g in enumerate(call.grad_out)] if self._bwd_in else []
            if call.in_idx is None:  # no input requires grad: the module's backward ends here
                self._bwd_done(call, (None,) * call.n_in)
            return None
        return quiet(hook)

    def _bwd_hook(self, call: "_ModuleCall"):
        """Gradients w.r.t. a module call's inputs are computed: the backward entry ends (its ``output``)."""
        def hook(grad_inputs, _grad_outputs):
            grads = [None] * call.n_in
            for i, g in zip(call.in_idx, grad_inputs):
                grads[i] = g
            self._bwd_done(call, tuple(grads))
            return None
        return quiet(hook)

    def _bwd_done(self, call: "_ModuleCall", grad_input: tuple) -> None:
        grad_output, call.grad_out = call.grad_out, None
        if grad_output is None:  # gradient reached the inputs but not through the outputs (double backward)
            return
        name = call.bwd_name
        if self.isolator is not None and call.mcall is not None:
            with self.machinery:
                self.isolator.module_backward(call.mcall, name, grad_input, grad_output)
        recs, call.bwd_recs = call.bwd_recs, None
        if recs is None:
            return
        if name in self._bwd_stack:
            self._bwd_stack.remove(name)
        if recs is False or not self.running:
            return
        with self.machinery:
            files = self._tensor_file(name)
            grads = [g for g in grad_input if g is not None]
            self.data[name] = {
                "input": recs,
                "output": [self.builder.value(g, f"{name}.output.{i}" if files else None)
                           for i, g in enumerate(grads)] if self._bwd_out else [],
            }

    def _pgrad_hook(self, base: str, pname: str):
        key = f"{base}.parameters_grad"

        def hook(param):
            if not self.running or self._busy or param.grad is None:
                return
            state = self._pgrad.setdefault(key, [None, 0, None])  # first param, count, current entry name
            if state[0] is None:
                state[0] = pname
            if pname == state[0] or state[2] is None:
                state[2] = f"{key}.{state[1]}"
                state[1] += 1
            name = state[2]
            if not self._keep(name):
                return
            with self.machinery:
                files = self._tensor_file(name)
                entry = self.data.setdefault(name, {})
                entry[pname] = [self.builder.value(param.grad, f"{name}.{pname}" if files else None)]
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


class _ModuleCall:
    """One forward call of a hooked module: its dump name, entry, isolation call and backward-hook state."""

    __slots__ = ("name", "entry", "mcall", "judged", "bwd_name", "bwd_recs", "in_idx", "n_in", "out_idx", "n_out",
                 "grad_out")

    def __init__(self, name: str, entry: dict | None, mcall: Any):
        self.name, self.entry, self.mcall = name, entry, mcall
        self.judged = mcall is None  # the forward's isolation done (or none asked)
        self.bwd_name = ""  # set when the call's backward is hooked
        self.bwd_recs: list | bool | None = None  # None: backward not begun; False: begun, not recorded
        self.in_idx: list[int] | None = None  # positional args routed through the input alias node
        self.n_in = 0
        self.out_idx: list[int] = []
        self.n_out = 0
        self.grad_out: tuple | None = None
