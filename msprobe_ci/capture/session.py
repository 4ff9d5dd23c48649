"""The capture engine: module hooks (L0), torch API capture through ``TorchFunctionMode`` (L1), and both (mix).

One :class:`CaptureSession` owns the per-step state (call counters, dump entries, construct parents, stacks) and
writes an msprobe-layout dump folder at :meth:`CaptureSession.stop` / :meth:`CaptureSession.step`.

Names, counters and the JSON layout follow msprobe 26.2.0 (``shared/spec/dump-format.md`` §4-7):

* API forward/backward: ``{Prefix}.{api}.{n}.forward`` / ``.backward``; one counter per ``{Prefix}.{api}.``,
  read before the call and incremented after it; only the outermost API call is seen (the mode is off while it
  runs the call), so ``F.layer_norm`` calling ``torch.layer_norm`` yields one record.
* Module: ``Module.{path}.{Class}.forward.{n}`` / ``.backward.{n}`` (the backward has the index of the forward
  call it belongs to: each call sets up its own backward hook); the root model itself is not hooked.
* Parameter gradients: ``Module.{path}.{Class}.parameters_grad.{k}`` = ``{param: [record]}`` in hook order.
* Backward entries swap sides: ``input`` = gradients w.r.t. the forward outputs, ``output`` = gradients the node
  produces (w.r.t. its forward inputs; module backward lists only inputs that required grad).
* Module entries are placed after the APIs they contain (msprobe moves them to the end when they complete).
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch.overrides import TorchFunctionMode

from ..config import DumpConfig
from ..dump.writer import ensure_fresh_dir, write_dump_folder
from ..errors import MsprobeError
from . import naming
from .coverage import Coverage, quiet
from .inject import Fault, FaultLog
from .records import RecordBuilder

if TYPE_CHECKING:
    from ..isolate import Isolator

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_HARNESS_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                      for m in (__import__("_pytest"), __import__("pluggy"), __import__("pytest")))
_HARNESS_DIRS += (os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "pytest_plugin") + os.sep,)
_TORCH_MODULE_FILE = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "module.py")


class _ApiMode(TorchFunctionMode):
    """Routes every torch API call to the session. Inside code that ``torch.compile`` traces it steps aside: API
    capture (and fault injection) cannot reach into compiled graphs; module hooks outside them still record."""

    def __init__(self, session: "CaptureSession"):
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            return func(*args, **(kwargs or {}))
        return self.session._on_api(func, args, kwargs or {})


_is_compiling = torch.compiler.is_compiling


class CaptureSession:
    """Capture one model run (or a training loop) into msprobe-compatible dumps.

    Args:
        config: the validated :class:`~msprobe_ci.config.DumpConfig` (task, level, dump_path, filters).
        faults: target-side :class:`~msprobe_ci.capture.inject.Fault` list; their APIs are perturbed even at L0.
        rank: rank folder suffix; ``None`` picks ``torch.distributed.get_rank()`` when initialised, else the
            folder is plain ``rank``.
        opaque_modules: module paths (as in ``named_modules()``) whose submodules get no hooks: regions run
            through ``torch.compile``, where a hook inside would be traced or break the graph. The module itself
            is still captured.
        isolator: an :class:`~msprobe_ci.isolate.Isolator`: every recorded API call is also judged on its own
            inputs (``isolation.json`` beside dump.json); ``None`` (default) captures only.
        free_bench: a :class:`~msprobe_ci.free_benchmark.FreeBenchmark`: every recorded API call is also re-run
            in higher precision and on bit-noised inputs and judged with no bench (``free_benchmark.json`` beside
            dump.json); ``None`` (default) does not.
        coverage: at L1 and mix, count every ATen op's floating-point work inside and outside the recorded APIs
            (``coverage.json`` beside dump.json, :mod:`.coverage`); default True.

    Raises:
        MsprobeError: at ``start()`` when the step folder already holds a dump, or a model is needed and missing.
    """

    def __init__(self, config: DumpConfig, faults: Iterable[Fault] = (), rank: int | None = None,
                 opaque_modules: Iterable[str] = (), isolator: "Isolator | None" = None, free_bench=None,
                 coverage: bool = True):
        config.validate()
        self.isolator = isolator
        self.free_bench = free_bench
        # API -> how it ran where float64 had no kernel: "float32", or "reference" (its float64 decomposition)
        self.precision_fallbacks: dict[str, str] = {}
        self.opaque_prefixes = tuple(f"{p}." for p in opaque_modules if p)
        self.config = config
        self.faults = tuple(faults)
        self._fault_apis = {f.api for f in self.faults}
        self.fault_log = FaultLog(self.faults)  # which faults fired, and which changed a value
        if isolator is not None:
            isolator.on_fault_applied = self.fault_log.record
        self.rank = rank
        self.current_step = 0
        self.running = False
        self._armed = False  # started: recording unless a token_range says this root call is outside it
        self._token_range: tuple[int, int] | None = None
        self._token_hooked: dict[int, tuple] = {}
        self._root_calls = 0
        self._busy_flag = False
        self._mode: _ApiMode | None = None
        self._comm = None  # the torch.distributed patch while recording (capture/comm.py)
        self._hooked: dict[int, list] = {}
        self._folders_written: list[str] = []
        self.api_level = config.level in ("L1", "mix")
        self.module_level = config.level in ("L0", "mix")
        self.with_construct = self.module_level
        modes = config.allowed_modes
        self._fwd_in = "forward" in modes and "input" in modes
        self._fwd_out = "forward" in modes and "output" in modes
        self._bwd_in = "backward" in modes and "input" in modes
        self._bwd_out = "backward" in modes and "output" in modes
        self._bwd = "backward" in modes
        # the share of floating-point work inside recorded APIs (coverage.json), for API-level captures
        self.coverage = Coverage(lambda: self._busy) if self.api_level and coverage else None
        self._reset_step_state()

    # ------------------------------------------------------------------ lifecycle
    @property
    def _busy(self) -> bool:
        """True while the capture machinery itself runs (statistics, isolation, writer): its torch calls are
        not the model's. Setting it steps the coverage mode off the dispatch stack and back."""
        return self._busy_flag

    @_busy.setter
    def _busy(self, value: bool) -> None:
        cov = getattr(self, "coverage", None)
        if cov is not None and value != self._busy_flag:
            if value:
                cov.suspend()
            else:
                cov.resume()
        self._busy_flag = value

    def _reset_step_state(self) -> None:
        self.data: dict[str, Any] = {}
        self.construct: dict[str, Any] = {}
        self.stacks: dict[tuple, list[str]] = {}
        self.api_counts: dict[str, int] = {}
        self.module_counts: dict[str, int] = {}
        self.builder = RecordBuilder(self.config.summary_mode)
        self._fwd_stack: list[str] = []
        self._bwd_stack: list[str] = []
        self._pending_fwd: dict[int, list[_ModuleCall]] = {}
        self._pgrad: dict[str, list] = {}
        self._in_scope = not self.config.scope
        self._scope_done = False
        self._folder_checked = False
        self._dirty = False  # something was recorded since the last flush
        if getattr(self, "isolator", None) is not None:
            self.isolator.reset()
        if getattr(self, "free_bench", None) is not None:
            self.free_bench.reset()
        if getattr(self, "coverage", None) is not None:
            self.coverage.reset()

    @property
    def step_enabled(self) -> bool:
        return not self.config.step or self.current_step in self.config.step

    @property
    def fault_rank(self) -> int | None:
        """This process's rank for faults with a ``rank`` (None outside torch.distributed)."""
        if self.rank is not None:
            return self.rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return None

    def rank_dir(self) -> str:
        rank = self.rank
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        if self.config.rank and (rank or 0) not in self.config.rank:
            return ""
        return "rank" if rank is None else f"rank{rank}"

    def dump_folder(self, step: int | None = None) -> str:
        """``{dump_path}/step{N}/rank[R]`` for the current (or given) step."""
        return os.path.join(os.fspath(self.config.dump_path), f"step{self.current_step if step is None else step}",
                            self.rank_dir() or "rank")

    def start(self, model: Any = None, token_range: Any = None) -> None:
        """Install the hooks (once per model) and begin recording.

        Args:
            model: an ``nn.Module`` or a list/tuple of them; required at L0 and mix, and with ``token_range``.
            token_range: ``[a, b]`` (msprobe's): count the forward calls of the root model(s) from the first
                ``start`` on (0-based) and record only calls a..b, and nothing outside them (inference).

        Raises:
            MsprobeError: a missing or unhookable model, a malformed ``token_range``.
        """
        if self.module_level and model is None:
            raise MsprobeError(f"level {self.config.level} needs the model: call start(model)")
        if isinstance(model, torch.jit.ScriptModule):
            raise MsprobeError("start(model): torch.jit.ScriptModule cannot be hooked; pass the eager module")
        if token_range is not None:
            if not (isinstance(token_range, (list, tuple)) and len(token_range) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in token_range)
                    and token_range[0] <= token_range[1]):
                raise MsprobeError(f"start(token_range=...): expected [a, b] with 0 <= a <= b, got {token_range!r}")
            if model is None:
                raise MsprobeError("start(token_range=...) needs the model: its forward calls are what is counted")
        if model is not None and self.module_level:
            models = list(model) if isinstance(model, (list, tuple)) else [model]
            for i, m in enumerate(models):
                if not isinstance(m, torch.nn.Module):
                    raise MsprobeError(f"start(model): expected torch.nn.Module, got {type(m).__name__}")
                self._hook_model(m, f"{i}." if len(models) > 1 else "")
        if token_range is not None:
            self._token_range = (token_range[0], token_range[1])
            for m in (list(model) if isinstance(model, (list, tuple)) else [model]):
                if isinstance(m, torch.nn.Module) and id(m) not in self._token_hooked:
                    self._token_hooked[id(m)] = (m.register_forward_pre_hook(self._token_pre, prepend=True),
                                                 m.register_forward_hook(self._token_post))
        if self.step_enabled and self.rank_dir() and not self._folder_checked:
            ensure_fresh_dir(self.dump_folder())
            self._folder_checked = True
        if self.running:
            return
        self.running = self.step_enabled and bool(self.rank_dir())
        self._dirty = self._dirty or self.running
        self._armed = self.running
        if self._token_range is not None:
            self.running = False  # until a root forward call inside the range begins
        if (self.api_level or self._fault_apis) and self._mode is None:
            self._mode = _ApiMode(self)
            self._mode.__enter__()
            if self.coverage is not None:
                self.coverage.start()
        if self.api_level and self._comm is None and torch.distributed.is_available():
            from .comm import CommPatch

            self._comm = CommPatch(self._on_comm)

    def _token_pre(self, module, args):
        n = self._root_calls
        self._root_calls += 1
        a, b = self._token_range
        self.running = self._armed and a <= n <= b

    def _token_post(self, module, args, output):
        self.running = False

    def stop(self) -> None:
        """Stop recording and write the current step's files (atomically)."""
        self.running = False
        self._armed = False
        if self._mode is not None:
            mode, self._mode = self._mode, None
            if self.coverage is not None:
                self.coverage.stop()
            mode.__exit__(None, None, None)
        if self._comm is not None:
            comm, self._comm = self._comm, None
            comm.remove()
        self.flush()

    def step(self) -> None:
        """Flush, then start a new step: counters and per-step caches reset, the next folder is ``step{N+1}``."""
        self.flush()
        self.current_step += 1
        self._reset_step_state()

    def close(self) -> None:
        """Stop and remove every hook this session installed."""
        if self.running or self._mode is not None:
            self.stop()
        for handles in list(self._hooked.values()) + list(self._token_hooked.values()):
            for h in handles:
                h.remove()
        self._hooked.clear()
        self._token_hooked.clear()

    def flush(self) -> None:
        """Write the step's files when something was recorded since the last flush (stop() then step() writes once)."""
        if not self._dirty or not self._folder_checked or (not self.data and not self.construct):
            return
        self._dirty = False
        self.builder.resolve()
        folder = self.dump_folder()
        stack = {}
        for i, (frames, names) in enumerate(self.stacks.items()):
            stack[str(i)] = [names, [_format_frame(f) for f in frames]]
        save_tensors = self.config.task == "tensor" or bool(self.config.tensor_list)
        write_dump_folder(folder, task=self.config.task, level=self.config.level, data=self.data, stack=stack,
                          construct=self.construct if self.with_construct else {},
                          tensors=self.builder.tensors if save_tensors else None)
        if self.isolator is not None:
            from ..dump.writer import atomic_write_json

            atomic_write_json(os.path.join(folder, "isolation.json"), self.isolator.as_json())
        if self.free_bench is not None:
            from ..dump.writer import atomic_write_json

            atomic_write_json(os.path.join(folder, "free_benchmark.json"), self.free_bench.as_json())
        if self.coverage is not None:
            from ..dump.writer import atomic_write_json

            atomic_write_json(os.path.join(folder, "coverage.json"), self.coverage.as_json())
        if folder not in self._folders_written:
            self._folders_written.append(folder)

    @property
    def folders(self) -> list[str]:
        """Rank folders written so far."""
        return list(self._folders_written)

    # ------------------------------------------------------------------ filters
    def _keep(self, name: str) -> bool:
        cfg = self.config
        if cfg.scope:
            if not self._in_scope:
                if self._scope_done or name != cfg.scope[0]:
                    return False
                self._in_scope = True
            if name == cfg.scope[1]:
                self._in_scope, self._scope_done = False, True
        if cfg.list:
            if any(s in name for s in cfg.list):
                return True
            return any(s in m for m in self._fwd_stack + self._bwd_stack for s in cfg.list if s.startswith("Module"))
        return True

    def _tensor_file(self, name: str) -> bool:
        if self.config.task == "tensor":
            return True
        return any(s in name for s in self.config.tensor_list)

    def _stack(self, name: str) -> None:
        """Record the call stack of ``name``: the user's frames (and torch's), innermost first; our own frames are
        left out and the walk stops at the test harness (pytest, pluggy, our plugin), whose frames say nothing
        about the model and cost megabytes per check."""
        f = sys._getframe(2)
        frames = []
        while f is not None:
            fn = f.f_code.co_filename
            if fn.startswith(_HARNESS_DIRS):
                break
            if not fn.startswith(_PKG_DIR):
                frames.append((fn, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        self.stacks.setdefault(tuple(frames), []).append(name)

    # ------------------------------------------------------------------ L1: APIs
    def _call(self, func, args, kwargs):
        """The API call itself; in float32 where it has no float64 kernel
        (:func:`~msprobe_ci.kernels.float32_fallback`, noted in :attr:`precision_fallbacks`)."""
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            from ..kernels import float32_fallback

            was, self._busy = self._busy, True  # the fallback's casts are plumbing, not the model's calls
            try:
                out = float32_fallback(func, args, kwargs, exc)
            finally:
                self._busy = was
        from ..kernels import REFERENCES, _qualified

        self.precision_fallbacks.setdefault(_qualified(func), "reference" if func in REFERENCES else "float32")
        return out

    def _passthrough(self, func, args, kwargs):
        out = self._call(func, args, kwargs)
        if self.isolator is not None and self.running and not self._busy:
            self.isolator.propagate(args, kwargs, out)
        return out

    def _on_api(self, func, args, kwargs):
        if self._busy or not self.running:
            return func(*args, **kwargs)
        try:
            info = naming.table().get(func)
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
        record = self.api_level and kind == naming.RECORD and self._keep(fwd_name)
        entry = None
        if record and self._fwd_in:
            self._busy = True
            try:
                files = self._tensor_file(fwd_name)
                entry = {
                    "input_args": [self.builder.value(a, f"{fwd_name}.input.{i}" if files else None)
                                   for i, a in enumerate(args)],
                    "input_kwargs": {k: self.builder.value(v, f"{fwd_name}.kwargs.{k}" if files else None, k)
                                     for k, v in kwargs.items()},
                }
                self._stack(fwd_name)
            finally:
                self._busy = False
        fwd_faults = [f for f in faults if f.direction == "forward" and f.matches(api_id, n, "forward",
                                                                                  self.current_step)]
        pending = None
        if record and self.free_bench is not None:
            def kernel(value: Any) -> Any:  # the target's kernel, fault included, for the bit-noise rerun
                for f in fwd_faults:
                    value = f.apply(value, n)
                return value
            self._busy = True
            try:
                pending = self.free_bench.before(fwd_name, prefix, api, func, args, kwargs, kernel)
            finally:
                self._busy = False
        iso = self.isolator if record else None
        call = None
        if iso is not None:
            self._busy = True
            try:
                call, args, kwargs = iso.before(fwd_name, prefix, api, func, args, kwargs)
            finally:
                self._busy = False
        cov = self.coverage if record else None
        if cov is not None:
            before = cov.grad_fns(args, kwargs)
            cov.depth += 1
        try:
            out = orig = self._call(func, args, kwargs)
            for f in fwd_faults:
                out = self.fault_log.apply(f, out, n)
        finally:
            if cov is not None:
                cov.depth -= 1
        if cov is not None:
            cov.adopt(out, before)
        self.api_counts[key] = n + 1
        if pending is not None:
            self._busy = True
            try:
                self.free_bench.after(pending, out)
            finally:
                self._busy = False
        if iso is not None:
            self._busy = True
            try:
                iso.after(call, out)
            finally:
                self._busy = False
        elif self.isolator is not None:
            self.isolator.propagate(args, kwargs, out)
        if record:
            self._busy = True
            try:
                files = self._tensor_file(fwd_name)
                if entry is None:
                    entry = {"input_args": [], "input_kwargs": {}}
                    self._stack(fwd_name)
                entry["output"] = (self._encode_output(out, f"{fwd_name}.output" if files else None)
                                   if self._fwd_out else [])
                self.data[fwd_name] = entry
            finally:
                self._busy = False
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

    def _on_comm(self, op: str, func, args: tuple, kwargs: dict, functional: bool = False):
        """Run and record one communication op (``Distributed.<op>.<N>.forward``; see :mod:`.comm`); a
        ``functional`` (out-of-place) collective's output is its returned tensor."""
        if self._busy or not self.running:
            return func(*args, **kwargs)
        key = f"Distributed.{op}."
        n = self.api_counts.get(key, 0)
        self.api_counts[key] = n + 1
        name = f"{key}{n}.forward"
        if self.with_construct:
            self.construct[name] = self._fwd_stack[-1] if self._fwd_stack else None
        record = self._keep(name)
        entry = None
        if record:
            self._busy = True
            try:
                files = self._tensor_file(name)
                rec_args, rec_kwargs = _resolved_groups(func, args, kwargs) if functional else (args, kwargs)
                entry = {"input_args": [self._comm_value(a, f"{name}.input.{i}" if files else None)
                                        for i, a in enumerate(rec_args)],
                         "input_kwargs": {k: self._comm_value(v, f"{name}.input.{k}" if files else None, k)
                                          for k, v in rec_kwargs.items()},
                         "output": []}
                self._stack(name)
                self.data[name] = entry
            finally:
                self._busy = False
        self._busy = True  # a collective built from other collectives is one record, as msprobe's
        try:
            result = func(*args, **kwargs)
        finally:
            self._busy = False

        def record_output() -> None:
            if entry is None or not self._fwd_out:
                return
            was, self._busy = self._busy, True
            try:
                files = self._tensor_file(name)
                values = [result] if functional else list(args) + list(kwargs.values())
                self.builder.forget(values)
                entry["output"] = [self._comm_value(v, f"{name}.output.{i}" if files else None)
                                   for i, v in enumerate(values)]
                self._dirty = True
            finally:
                self._busy = was

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
                self._busy = True
                try:
                    files = self._tensor_file(name)
                    if self.with_construct:
                        self.construct[name] = self._bwd_stack[-1] if self._bwd_stack else None
                    self.data[name] = {
                        "input": [self.builder.value(g, f"{name}.input.{i}" if files else None)
                                  for i, g in enumerate(grad_outputs)] if self._bwd_in else [],
                        "output": [self.builder.value(g, f"{name}.output.{i}" if files else None)
                                   for i, g in enumerate(grad_inputs)] if self._bwd_out else [],
                    }
                finally:
                    self._busy = False
            return new
        return quiet(hook)

    # ------------------------------------------------------------------ L0: modules
    def _hook_model(self, model: torch.nn.Module, root_prefix: str) -> None:
        if id(model) in self._hooked:
            return
        handles = []
        for path, mod in model.named_modules():
            if mod is model or path.startswith(self.opaque_prefixes):
                continue
            base = f"Module.{root_prefix}{path}.{type(mod).__name__}"
            # modules whose APIs are not seen (L0 capture, a torch.compile region) are isolated whole
            whole = self.isolator is not None and (not self.api_level or f"{path}." in self.opaque_prefixes)
            handles.append(mod.register_forward_pre_hook(self._fwd_pre_hook(base, whole), with_kwargs=True))
            handles.append(mod.register_forward_hook(self._fwd_hook(base), with_kwargs=True, always_call=True))
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
                    self._busy = True
                    try:
                        files = self._tensor_file(name)
                        entry["input_args"] = [self.builder.value(a, f"{name}.input.{i}" if files else None)
                                               for i, a in enumerate(args)]
                        entry["input_kwargs"] = {k: self.builder.value(v, f"{name}.kwargs.{k}" if files else None, k)
                                                 for k, v in kwargs.items()}
                        self._stack(name)
                    finally:
                        self._busy = False
            mcall = None
            if whole and entry is not None:
                self._busy = True
                try:
                    # without API capture (L0) nothing follows views and casts between modules, so only a
                    # module's own parameters count as sources there
                    mcall = self.isolator.module_before(name, module, args, kwargs, input_sources=self.api_level)
                finally:
                    self._busy = False
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
        self._busy = True
        try:
            new = _Alias.apply(*(items[i] for i in idx))
        finally:
            self._busy = False
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
                self._busy = True
                try:
                    self.isolator.module_after(mcall, output)
                finally:
                    self._busy = False
                self.isolator.mark_produced(output)
            if entry is not None and self.running:
                self._busy = True
                try:
                    files = self._tensor_file(name)
                    entry["output"] = self._encode_output(output, f"{name}.output" if files else None) \
                        if self._fwd_out else []
                    entry["parameters"] = {
                        pname: self.builder.value(p, f"{name}.parameters.{pname}" if files else None)
                        for pname, p in module.named_parameters(recurse=False)} if self._fwd_out else {}
                    self.data.pop(name, None)
                    self.data[name] = entry
                finally:
                    self._busy = False
            if not call.bwd_name:
                return None
            return self._module_io(call, output, inputs=False)
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
                    self._busy = True
                    try:
                        files = self._tensor_file(name)
                        call.bwd_recs = [self.builder.value(g, f"{name}.input.{i}" if files else None)
                                         for i, g in enumerate(call.grad_out)] if self._bwd_in else []
                    finally:
                        self._busy = False
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
            self._busy = True
            try:
                self.isolator.module_backward(call.mcall, name, grad_input, grad_output)
            finally:
                self._busy = False
        recs, call.bwd_recs = call.bwd_recs, None
        if recs is None:
            return
        if name in self._bwd_stack:
            self._bwd_stack.remove(name)
        if recs is False or not self.running:
            return
        self._busy = True
        try:
            files = self._tensor_file(name)
            grads = [g for g in grad_input if g is not None]
            self.data[name] = {
                "input": recs,
                "output": [self.builder.value(g, f"{name}.output.{i}" if files else None)
                           for i, g in enumerate(grads)] if self._bwd_out else [],
            }
        finally:
            self._busy = False

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
            self._busy = True
            try:
                files = self._tensor_file(name)
                entry = self.data.setdefault(name, {})
                entry[pname] = [self.builder.value(param.grad, f"{name}.{pname}" if files else None)]
            finally:
                self._busy = False
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

    __slots__ = ("name", "entry", "mcall", "bwd_name", "bwd_recs", "in_idx", "n_in", "out_idx", "n_out",
                 "grad_out")

    def __init__(self, name: str, entry: dict | None, mcall: Any):
        self.name, self.entry, self.mcall = name, entry, mcall
        self.bwd_name = ""  # set when the call's backward is hooked
        self.bwd_recs: list | bool | None = None  # None: backward not begun; False: begun, not recorded
        self.in_idx: list[int] | None = None  # positional args routed through the input alias node
        self.n_in = 0
        self.out_idx: list[int] = []
        self.n_out = 0
        self.grad_out: tuple | None = None


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


def _format_frame(frame: tuple) -> str:
    fn, lineno, func = frame
    src = linecache.getline(fn, lineno).strip()
    return f"File {fn}, line {lineno}, in {func}, \n {src}"


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
