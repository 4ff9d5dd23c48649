"""The statistics observer: the dump records (``dump.json``'s data, construct, stacks, tensor files) of every event
the capture engine sees, in msprobe 26.2.0's layout (``shared/spec/dump-format.md`` §4-7)."""

from __future__ import annotations

from typing import Any

import torch

from .. import amp
from .observers import ApiCall, CommCall, ModuleCall, Observer

#: in-place APIs that overwrite their first argument without reading it: that argument is recorded by shape only
OVERWRITES = frozenset({"copy_", "zero_", "fill_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                        "geometric_", "cauchy_", "log_normal_", "set_", "resize_"})


class Statistics(Observer):
    """Records each event into the engine's :class:`~.state.StepState` (its ``data``, ``construct`` and
    ``stacks``), with the step's :class:`~.records.RecordBuilder` computing each value's statistics (and tensor
    files, for the tensor task or ``tensor_list``). The first observer: it sees the inputs the model gave and
    (last, on the way out) the output the model got."""

    def __init__(self, engine):  # the CaptureSession
        self.engine = engine
        self.machinery = engine.machinery
        modes = engine.config.allowed_modes
        self.fwd_in = "forward" in modes and "input" in modes
        self.fwd_out = "forward" in modes and "output" in modes
        self.bwd_in = "backward" in modes and "input" in modes
        self.bwd_out = "backward" in modes and "output" in modes

    # ------------------------------------------------------------------ APIs
    def api_before(self, call: ApiCall) -> None:
        eng, state = self.engine, self.engine.state
        if eng.with_construct and eng.api_level:
            state.construct[call.name] = state.fwd_stack[-1] if state.fwd_stack else None
        if not (call.record and self.fwd_in):
            return
        name, args, kwargs, b = call.name, call.args, call.kwargs, state.builder
        with self.machinery:
            files = eng.tensor_file(name)
            # the destination of an op that overwrites it without reading it (FSDP1's copy_ into a fresh
            # low-precision shard) holds whatever was there, often uninitialised memory: its shape only
            call.entry = {
                "input_args": [b.shape_only(a) if i == 0 and call.api in OVERWRITES and isinstance(a, torch.Tensor)
                               else b.value(a, f"{name}.input.{i}" if files else None) for i, a in enumerate(args)],
                "input_kwargs": {k: b.value(v, f"{name}.kwargs.{k}" if files else None, k)
                                 for k, v in kwargs.items()},
            }
            eng.stack(name)

    def api_after(self, call: ApiCall) -> None:
        if not call.record:
            return
        eng, name = self.engine, call.name
        with self.machinery:
            files = eng.tensor_file(name)
            entry = call.entry
            if entry is None:
                entry = {"input_args": [], "input_kwargs": {}}
                eng.stack(name)
            entry["output"] = self.encode_output(call.out, f"{name}.output" if files else None) \
                if self.fwd_out else []
            ac = amp.autocast_dtype(call.args, call.kwargs)
            if ac is not None:  # the autocast dtype it ran under (msprobe_ci.amp; msprobe ignores the field)
                entry[amp.FIELD] = str(ac)
            entry.update(call.extra)
            eng.state.data[name] = entry
        call.entry = None

    def api_backward(self, call: ApiCall, grad_inputs: tuple, grad_outputs: tuple) -> None:
        eng = self.engine
        if not (call.record_bwd and eng.recording):
            return None
        name, state = call.bwd_name, eng.state
        b = state.builder
        with self.machinery:
            files = eng.tensor_file(name)
            if eng.with_construct:
                state.construct[name] = state.bwd_stack[-1] if state.bwd_stack else None
            state.data[name] = {
                "input": [b.value(g, f"{name}.input.{i}" if files else None)
                          for i, g in enumerate(grad_outputs)] if self.bwd_in else [],
                "output": [b.value(g, f"{name}.output.{i}" if files else None)
                           for i, g in enumerate(grad_inputs)] if self.bwd_out else [],
            }
        return None

    def encode_output(self, out: Any, stem: str | None) -> Any:
        """An API's or module's output as msprobe records it: a list of values (a ``ModelOutput`` or a named tuple
        as one record)."""
        b = self.engine.state.builder
        if isinstance(out, torch.Tensor):
            return [b.value(out, f"{stem}.0" if stem else None)]
        if isinstance(out, tuple) and hasattr(out, "_fields") and not hasattr(out, "n_fields"):
            return b.value(out, stem)
        if isinstance(out, (list, tuple)):
            return [b.value(v, f"{stem}.{i}" if stem else None) for i, v in enumerate(out)]
        if isinstance(out, dict) or (hasattr(out, "to_tuple") and hasattr(out, "keys")):
            return b.value(out, stem)
        return [b.value(out, f"{stem}.0" if stem else None)]

    # ------------------------------------------------------------------ modules
    def module_before(self, call: ModuleCall, module: Any, args: tuple, kwargs: dict) -> None:
        eng = self.engine
        if not eng.keep(call.name):
            return
        call.entry = entry = {"input_args": [], "input_kwargs": {}}
        if self.fwd_in:
            name, b = call.name, eng.state.builder
            with self.machinery:
                files = eng.tensor_file(name)
                entry["input_args"] = [b.value(a, f"{name}.input.{i}" if files else None) for i, a in enumerate(args)]
                entry["input_kwargs"] = {k: b.value(v, f"{name}.kwargs.{k}" if files else None, k)
                                         for k, v in kwargs.items()}
                eng.stack(name)

    def module_after(self, call: ModuleCall, module: Any, output: Any) -> None:
        eng, entry = self.engine, call.entry
        if entry is None or not eng.running:
            return
        name, state = call.name, eng.state
        with self.machinery:
            files = eng.tensor_file(name)
            entry["output"] = self.encode_output(output, f"{name}.output" if files else None) if self.fwd_out else []
            entry["parameters"] = {
                pname: state.builder.value(p, f"{name}.parameters.{pname}" if files else None)
                for pname, p in module.named_parameters(recurse=False)} if self.fwd_out else {}
            state.data.pop(name, None)  # placed after the APIs it contains (msprobe moves it there when done)
            state.data[name] = entry

    def module_backward_begin(self, call: ModuleCall) -> None:
        eng = self.engine
        call.bwd_recs = False  # the backward began; a list once recorded
        name = call.bwd_name
        if eng.keep(name):
            with self.machinery:
                files = eng.tensor_file(name)
                b = eng.state.builder
                call.bwd_recs = [b.value(g, f"{name}.input.{i}" if files else None)
                                 for i, g in enumerate(call.grad_out)] if self.bwd_in else []

    def module_backward_end(self, call: ModuleCall, grad_input: tuple, grad_output: tuple) -> None:
        recs, call.bwd_recs = call.bwd_recs, None
        eng = self.engine
        if recs is None or recs is False or not eng.running:
            return
        name = call.bwd_name
        with self.machinery:
            files = eng.tensor_file(name)
            b = eng.state.builder
            grads = [g for g in grad_input if g is not None]
            eng.state.data[name] = {
                "input": recs,
                "output": [b.value(g, f"{name}.output.{i}" if files else None)
                           for i, g in enumerate(grads)] if self.bwd_out else [],
            }

    def param_grad(self, name: str, pname: str, param: Any) -> None:
        eng = self.engine
        with self.machinery:
            files = eng.tensor_file(name)
            entry = eng.state.data.setdefault(name, {})
            entry[pname] = [eng.state.builder.value(param.grad, f"{name}.{pname}" if files else None)]

    # ------------------------------------------------------------------ collectives
    def comm_before(self, call: CommCall) -> None:
        if not call.record:
            return
        from ..isolate.collectives import JUDGED, output_of

        eng, name, op = self.engine, call.name, call.op
        # an out-of-place collective's output buffer holds uninitialised memory before the call: its shape is
        # recorded, not its values (they would read as an overflow where the buffer held NaN bits)
        buf = output_of(op, call.args, call.kwargs) if op in JUDGED and JUDGED[op][1] is not None else None

        def arg(v, stem, key=None):
            if buf is not None and v is buf:
                return eng.state.builder.shape_only(v)
            return self.comm_value(v, stem, key)
        with self.machinery:
            files = eng.tensor_file(name)
            if call.functional:
                from .comm import resolved_groups

                rec_args, rec_kwargs = resolved_groups(call.func, call.args, call.kwargs)
            else:
                rec_args, rec_kwargs = call.args, call.kwargs
            call.entry = {"input_args": [arg(a, f"{name}.input.{i}" if files else None)
                                         for i, a in enumerate(rec_args)],
                          "input_kwargs": {k: arg(v, f"{name}.input.{k}" if files else None, k)
                                           for k, v in rec_kwargs.items()},
                          "output": []}
            eng.stack(name)
            eng.state.data[name] = call.entry

    def comm_after(self, call: CommCall) -> None:
        if call.entry is None or not self.fwd_out:
            return
        eng, name = self.engine, call.name
        with self.machinery:
            files = eng.tensor_file(name)
            values = [call.result] if call.functional else list(call.args) + list(call.kwargs.values())
            eng.state.builder.forget(values)
            call.entry["output"] = [self.comm_value(v, f"{name}.output.{i}" if files else None)
                                    for i, v in enumerate(values)]
            eng.state.dirty = True

    def comm_value(self, v: Any, name: str | None, key: str | None = None) -> Any:
        """Arguments of a communication op: process groups and reduce ops as msprobe records them."""
        import torch.distributed as dist

        from .comm import encode_group

        b = self.engine.state.builder
        if isinstance(v, dist.ProcessGroup) or (key == "group" and v is None):
            return encode_group(v)
        if isinstance(v, (dist.ReduceOp, getattr(dist.ReduceOp, "RedOpType", dist.ReduceOp))):
            return {"type": "torch.distributed.ReduceOp", "value": str(v)}
        if isinstance(v, dist.P2POp):
            return {"class_type": "torch.distributed.P2POp", "tensor": b.value(v.tensor, name),
                    "op": getattr(v.op, "__name__", str(v.op)), "peer": v.peer, "tag": v.tag,
                    "group_id": encode_group(v.group)["group_id"]}
        if isinstance(v, (list, tuple)) and v and not isinstance(v, torch.Size):
            return [self.comm_value(x, None if name is None else f"{name}.{i}") for i, x in enumerate(v)]
        return b.value(v, name, key)
