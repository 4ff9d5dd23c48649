"""Communication ops: the records of torch.distributed collectives while a capture runs (wrappers in :mod:`.comm`)."""

from __future__ import annotations

from typing import Any

import torch



class CommCapture:
    """The communication half of :class:`~msprobe_ci.capture.session.CaptureSession`: one
    ``Distributed.<op>.<N>.forward`` record per collective (:mod:`.comm` installs the wrappers)."""

    def _on_comm(self, op: str, func, args: tuple, kwargs: dict, functional: bool = False):
        """Run and record one communication op (``Distributed.<op>.<N>.forward``; see :mod:`.comm`); a
        ``functional`` (out-of-place) collective's output is its returned tensor."""
        if self._busy or not self.running:
            return func(*args, **kwargs)
        from ..isolate.collectives import JUDGED, input_of, output_of

        key = f"Distributed.{op}."
        n = self.api_counts.get(key, 0)
        self.api_counts[key] = n + 1
        name = f"{key}{n}.forward"
        if self.with_construct:
            self.construct[name] = self._fwd_stack[-1] if self._fwd_stack else None
        record = self._keep(name)
        entry = None
        if record:
            # an out-of-place collective's output buffer holds uninitialised memory before the call: its shape is
            # recorded, not its values (they would read as an overflow where the buffer held NaN bits)
            buf = output_of(op, args, kwargs) if op in JUDGED and JUDGED[op][1] is not None else None

            def arg(v, stem, key=None):
                if buf is not None and v is buf:
                    return self.builder.shape_only(v)
                return self._comm_value(v, stem, key)
            with self.machinery:
                files = self._tensor_file(name)
                rec_args, rec_kwargs = _resolved_groups(func, args, kwargs) if functional else (args, kwargs)
                entry = {"input_args": [arg(a, f"{name}.input.{i}" if files else None)
                                        for i, a in enumerate(rec_args)],
                         "input_kwargs": {k: arg(v, f"{name}.input.{k}" if files else None, k)
                                          for k, v in rec_kwargs.items()},
                         "output": []}
                self._stack(name)
                self.data[name] = entry
        api_id = f"Distributed.{op}"
        faults = [f for f in self.faults if f.on_rank(self.fault_rank) and
                  f.matches(api_id, n, "forward", self.current_step)] if api_id in self._fault_apis else []
        judged = self.isolator is not None and record and not functional and op in JUDGED
        before = None
        if judged and op == "all_reduce":  # it overwrites its input: the judgement needs the input as it was
            inp = input_of(op, args, kwargs)
            before = inp.detach().clone() if isinstance(inp, torch.Tensor) else None
        with self.machinery:  # a collective built from other collectives is one record, as msprobe's
            result = func(*args, **kwargs)

        def record_output() -> None:
            out = output_of(op, args, kwargs) if (faults or judged) else None
            if faults and out is not None:  # a faulty collective: what it wrote is off, as the rank receives it
                with self.machinery:
                    value = out
                    for f in faults:
                        value = self.fault_log.apply(f, value, n)
                    out.copy_(value)
            if judged:
                with self.machinery:
                    try:
                        self.isolator.judge_collective(name, op, args, kwargs, before, _group_of(args, kwargs))
                    except Exception as exc:  # noqa: BLE001 - never break the user's run
                        self.isolator.skip(name, f"collective isolation failed: {type(exc).__name__}: {exc}"[:200])
            if entry is None or not self._fwd_out:
                return
            with self.machinery:
                files = self._tensor_file(name)
                values = [result] if functional else list(args) + list(kwargs.values())
                self.builder.forget(values)
                entry["output"] = [self._comm_value(v, f"{name}.output.{i}" if files else None)
                                   for i, v in enumerate(values)]
                self._dirty = True

        from .comm import wrap_work

        if isinstance(result, list) and result and all(hasattr(w, "wait") for w in result):
            pending = {"left": len(result)}

            def one_done() -> None:
                pending["left"] -= 1
                if pending["left"] == 0:
                    record_output()
            return [wrap_work(w, one_done) for w in result]
        if not functional and result is not None and hasattr(result, "wait"):
            return wrap_work(result, record_output)
        record_output()
        return result

    def _comm_value(self, v: Any, name: str | None, key: str | None = None) -> Any:
        """Arguments of a communication op: process groups and reduce ops as msprobe records them."""
        import torch.distributed as dist

        from .comm import encode_group

        if isinstance(v, dist.ProcessGroup) or (key == "group" and v is None):
            return encode_group(v)
        if isinstance(v, (dist.ReduceOp, getattr(dist.ReduceOp, "RedOpType", dist.ReduceOp))):
            return {"type": "torch.distributed.ReduceOp", "value": str(v)}
        if isinstance(v, dist.P2POp):
            return {"class_type": "torch.distributed.P2POp", "tensor": self.builder.value(v.tensor, name),
                    "op": getattr(v.op, "__name__", str(v.op)), "peer": v.peer, "tag": v.tag,
                    "group_id": encode_group(v.group)["group_id"]}
        if isinstance(v, (list, tuple)) and v and not isinstance(v, torch.Size):
            return [self._comm_value(x, None if name is None else f"{name}.{i}") for i, x in enumerate(v)]
        return self.builder.value(v, name, key)


def _group_of(args: tuple, kwargs: dict) -> Any:
    """The process group a torch.distributed collective was called with (``None``: the default group)."""
    import torch.distributed as dist

    g = kwargs.get("group")
    if g is None:
        g = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return g


def _resolved_groups(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A functional collective's arguments with its ``group`` (ranks, DeviceMesh, ``(mesh, dim)``, a name)
    replaced by the ProcessGroup it names, for the record (the call itself gets the original arguments)."""
    import inspect

    from .comm import resolve_group

    if "group" in kwargs:
        pg = resolve_group(kwargs["group"])
        return args, (dict(kwargs, group=pg) if pg is not None else kwargs)
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return args, kwargs
    if "group" in params and params.index("group") < len(args):
        i = params.index("group")
        pg = resolve_group(args[i])
        if pg is not None:
            return args[:i] + (pg,) + args[i + 1:], kwargs
    return args, kwargs
