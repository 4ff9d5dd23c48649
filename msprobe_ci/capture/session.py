"""The capture engine: module hooks (L0), torch API capture through ``TorchFunctionMode`` (L1), and both (mix).

One :class:`CaptureSession` is the engine: its hooks (:mod:`.api_hooks`, :mod:`.module_hooks`, :mod:`.comm_hooks`)
turn what the model runs into events for a list of observers (:mod:`.observers`: statistics, free benchmark,
coverage, isolation, faults, called in that order on the way in and the reverse on the way out). It owns the per-step
state (:class:`~.state.StepState`: call counters, dump entries, construct parents, stacks), the one switch for its
own work (:class:`~.state.Machinery`), and writes an msprobe-layout dump folder, with each observer's files beside
it, at :meth:`CaptureSession.stop` / :meth:`CaptureSession.step`.

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

from .._perf import freeze_heap, thaw_heap
from ..config import DumpConfig
from ..dump.writer import ensure_fresh_dir, write_dump_folder
from ..errors import MsprobeError
from .api_hooks import ApiHooks, _ApiMode
from .comm_hooks import CommHooks
from .coverage import Coverage, quiet
from .inject import Fault, FaultLog
from .module_hooks import ModuleHooks
from .observers import CoverageObserver, FaultObserver, FreeBenchObserver, IsolationObserver, Listeners, Observer
from .state import Machinery, StepState
from .statistics import Statistics

if TYPE_CHECKING:
    from ..isolate import Isolator

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: the test harness's packages: a call stack's walk stops at their first frame (see ``CaptureSession._stack``)
_HARNESS_MODULES = ("_pytest", "pluggy", "pytest", "msprobe_ci.pytest_plugin")


def _harness_dirs() -> tuple[str, ...]:
    """The folders of the harness packages that are loaded, found in ``sys.modules`` and never imported here: a
    ``PrecisionDebugger`` user's process loads no test framework (and has no harness frames to stop at)."""
    dirs = []
    for name in _HARNESS_MODULES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(dirs)


_TORCH_MODULE_FILE = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "module.py")


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
            inputs (``isolation.json`` beside dump.json), and each failing one gets a standalone reproduction
            (``repro/<node>.py``, :mod:`msprobe_ci.capture.repro`); ``None`` (default) captures only.
        free_bench: a :class:`~msprobe_ci.free_benchmark.FreeBenchmark`: every recorded API call is also re-run
            in higher precision and on bit-noised inputs and judged with no bench (``free_benchmark.json`` beside
            dump.json); ``None`` (default) does not.
        coverage: at L1 and mix, count every ATen op's floating-point work inside and outside the recorded APIs
            (``coverage.json`` beside dump.json, :mod:`.coverage`); default True.
        observers: more :class:`~msprobe_ci.capture.observers.Observer` objects, called right after the
            statistics on the way in and right before them on the way out: they see each call's inputs as the model
            gave them and its output as the model got it (faults applied, the isolation's verdict known), and each
            one's ``files()`` are written beside dump.json. Default none.

    Raises:
        MsprobeError: at ``start()`` when the step folder already holds a dump, or a model is needed and missing.
    """

    def __init__(self, config: DumpConfig, faults: Iterable[Fault] = (), rank: int | None = None,
                 opaque_modules: Iterable[str] = (), isolator: "Isolator | None" = None, free_bench=None,
                 coverage: bool = True, observers: Iterable[Observer] = ()):
        config.validate()
        self._extra = tuple(observers)
        self.config = config
        self.rank = rank
        self.free_bench = free_bench
        self._harness = _harness_dirs()  # where a call stack's walk stops (the test harness, when one runs)
        # API -> how it ran where float64 had no kernel: "float32", or "reference" (its float64 decomposition)
        self.precision_fallbacks: dict[str, str] = {}
        self.opaque_prefixes = tuple(f"{p}." for p in opaque_modules if p)
        self.faults = tuple(faults)
        self.fault_apis = frozenset(f.api for f in self.faults)
        self.fault_log = FaultLog(self.faults)  # which faults fired, and which changed a value
        self.current_step = 0
        self.running = False
        self._armed = False  # started: recording unless a token_range says this root call is outside it
        self._token_range: tuple[int, int] | None = None
        self._token_hooked: dict[int, tuple] = {}
        self._root_calls = 0
        self._frozen = False  # freeze_heap() froze the heap at start(): stop() thaws it
        self._folders_written: list[str] = []
        self.api_level = config.level in ("L1", "mix")
        self.module_level = config.level in ("L0", "mix")
        self.with_construct = self.module_level
        self.bwd = "backward" in config.allowed_modes
        # the share of floating-point work inside recorded APIs (coverage.json), for API-level captures
        self.coverage = Coverage(lambda: self.machinery.busy) if self.api_level and coverage else None
        self.machinery = Machinery(self.coverage)  # ``with self.machinery:`` around the capture's own work
        self.state = StepState(config.summary_mode, bool(config.scope))
        self.apis, self.modules, self.comms = ApiHooks(self), ModuleHooks(self), CommHooks(self)
        self._comm = None  # the torch.distributed patch while recording (capture/comm.py)
        self.isolator = isolator  # builds the observers
        self._reset_observers()

    # ------------------------------------------------------------------ observers
    @property
    def isolator(self) -> "Isolator | None":
        """The :class:`~msprobe_ci.isolate.Isolator` judging every recorded call (None: captures only)."""
        return self._isolator

    @isolator.setter
    def isolator(self, isolator: "Isolator | None") -> None:
        self._isolator = isolator
        if isolator is not None:
            from .repro import Reproducer

            # the isolation's own hooks (its backward oracle and bench) are the machinery's work: the capture
            # wraps them so that their ops stay out of the coverage count, as its own hooks do; a fault it applies
            # at a tap is logged with the others; a failing call's reproduction goes into repro/ beside dump.json
            isolator.attach(quiet=quiet, on_fault_applied=self.fault_log.record, reproducer=Reproducer(self))
        if self.free_bench is not None:  # a call at risk: its reproduction too
            from .repro import Reproducer

            self.free_bench.attach(reproducer=Reproducer(self))
        self.observers: tuple[Observer, ...] = self._observers()
        self.on = Listeners(self.observers)  # per event, the observers' methods the hooks call

    def _observers(self) -> tuple[Observer, ...]:
        """The observers, in the order they are called on the way in (the reverse on the way out,
        :mod:`.observers`): statistics, the caller's own, free benchmark, coverage, isolation, faults; each only
        where it is on."""
        out: list[Observer] = [Statistics(self), *self._extra]
        if self.free_bench is not None:
            out.append(FreeBenchObserver(self.free_bench, self.machinery))
        if self.coverage is not None:
            out.append(CoverageObserver(self.coverage))
        if self._isolator is not None:
            out.append(IsolationObserver(self._isolator, self.machinery, input_sources=self.api_level))
        if self.faults:
            out.append(FaultObserver(self.fault_log, self.machinery))
        return tuple(out)

    def _reset_observers(self) -> None:
        for o in self.observers:
            o.reset(self.current_step)

    @property
    def recording(self) -> bool:
        """Recording, and not inside the capture's own machinery: a hook records the call it sees."""
        return self.running and not self.machinery.busy

    def faults_due(self, api_id: str, n: int) -> tuple[list[Fault], list[Fault]]:
        """The faults on this rank due on call ``n`` of ``api_id`` at the current step: ``(forward, backward)``."""
        rank, step = self.fault_rank, self.current_step
        mine = [f for f in self.faults if f.api == api_id and f.on_rank(rank)]
        return ([f for f in mine if f.matches(api_id, n, "forward", step)],
                [f for f in mine if f.matches(api_id, n, "backward", step)])

    # ------------------------------------------------------------------ lifecycle
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
                self.modules.hook_model(m, f"{i}." if len(models) > 1 else "")
        if token_range is not None:
            self._token_range = (token_range[0], token_range[1])
            for m in (list(model) if isinstance(model, (list, tuple)) else [model]):
                if isinstance(m, torch.nn.Module) and id(m) not in self._token_hooked:
                    self._token_hooked[id(m)] = (m.register_forward_pre_hook(self._token_pre, prepend=True),
                                                 m.register_forward_hook(self._token_post))
        state = self.state
        if self.step_enabled and self.rank_dir() and not state.folder_checked:
            ensure_fresh_dir(self.dump_folder())
            state.folder_checked = True
        if self.running:
            return
        self.running = self.step_enabled and bool(self.rank_dir())
        if self.running and not self._frozen:
            self._frozen = freeze_heap()  # the collector's full passes skip what was alive before recording
        state.dirty = state.dirty or self.running
        self._armed = self.running
        if self._token_range is not None:
            self.running = False  # until a root forward call inside the range begins
        if (self.api_level or self.fault_apis) and self.apis.mode is None:
            self.apis.mode = _ApiMode(self.apis)
            self.apis.mode.__enter__()
            for o in self.observers:
                o.start()
        if self.api_level and self._comm is None and torch.distributed.is_available():
            from .comm import CommPatch

            self._comm = CommPatch(self.comms.on_comm)

    def _token_pre(self, module, args):
        n = self._root_calls
        self._root_calls += 1
        a, b = self._token_range
        self.running = self._armed and a <= n <= b

    def _token_post(self, module, args, output):
        self.running = False

    def aside(self, fn, *args):
        """``fn(*args)``, with the torch calls it makes left out of the dump and the coverage count: the
        machinery's own work between the capture's start and stop (a side's final outputs read before its
        backward pass)."""
        with self.machinery:
            return quiet(fn)(*args)

    def stop(self) -> None:
        """Stop recording and write the current step's files (atomically)."""
        self.running = False
        self._armed = False
        thaw_heap(self._frozen)
        self._frozen = False
        if self.apis.mode is not None:
            mode, self.apis.mode = self.apis.mode, None
            for o in reversed(self.observers):
                o.stop()
            # a custom Function's backward that raised left its push of the mode (ApiHooks._see_backward_of)
            for _ in range(max(0, torch.overrides._get_current_function_mode_stack().count(mode) - 1)):
                mode.__exit__(None, None, None)
            mode.__exit__(None, None, None)
        if self._comm is not None:
            comm, self._comm = self._comm, None
            comm.remove()
        self.flush()

    def step(self) -> None:
        """Flush, then start a new step: counters and per-step caches reset, the next folder is ``step{N+1}``."""
        self.flush()
        self.current_step += 1
        self.state = StepState(self.config.summary_mode, bool(self.config.scope))
        self._reset_observers()

    def close(self) -> None:
        """Stop and remove every hook this session installed."""
        if self.running or self.apis.mode is not None:
            self.stop()
        self.modules.remove()
        for handles in self._token_hooked.values():
            for h in handles:
                h.remove()
        self._token_hooked.clear()

    def flush(self) -> None:
        """Write the step's files when something was recorded since the last flush (stop() then step() writes
        once): the dump folder, then each observer's own files beside it."""
        state = self.state
        if not state.dirty or not state.folder_checked or (not state.data and not state.construct):
            return
        state.dirty = False
        state.builder.resolve()
        folder = self.dump_folder()
        stack = {}
        for i, (frames, names) in enumerate(state.stacks.items()):
            stack[str(i)] = [names, [_format_frame(f) for f in frames]]
        save_tensors = self.config.task == "tensor" or bool(self.config.tensor_list)
        write_dump_folder(folder, task=self.config.task, level=self.config.level, data=state.data, stack=stack,
                          construct=state.construct if self.with_construct else {},
                          tensors=state.builder.tensors if save_tensors else None)
        from ..dump.writer import atomic_write_json

        for o in self.observers:
            for file, value in o.files().items():
                atomic_write_json(os.path.join(folder, file), value)
        if folder not in self._folders_written:
            self._folders_written.append(folder)

    @property
    def folders(self) -> list[str]:
        """Rank folders written so far."""
        return list(self._folders_written)

    # ------------------------------------------------------------------ filters
    def keep(self, name: str) -> bool:
        """Whether node ``name`` is recorded: the config's ``scope`` (from its first node to its last, once) and
        ``list`` (a name containing an entry, or inside a module whose name does) filters."""
        cfg, state = self.config, self.state
        if cfg.scope:
            if not state.in_scope:
                if state.scope_done or name != cfg.scope[0]:
                    return False
                state.in_scope = True
            if name == cfg.scope[1]:
                state.in_scope, state.scope_done = False, True
        if cfg.list:
            if any(s in name for s in cfg.list):
                return True
            return any(s in m for m in state.fwd_stack + state.bwd_stack for s in cfg.list if s.startswith("Module"))
        return True

    def tensor_file(self, name: str) -> bool:
        """Whether node ``name``'s tensors are saved as files (the tensor task, or a ``tensor_list`` match)."""
        if self.config.task == "tensor":
            return True
        return any(s in name for s in self.config.tensor_list)

    def stack(self, name: str) -> None:
        """Record the call stack of ``name``: the user's frames (and torch's), innermost first; our own frames are
        left out and the walk stops at the test harness (pytest, pluggy, our plugin), whose frames say nothing
        about the model and cost megabytes per check."""
        f = sys._getframe(2)
        harness = self._harness
        frames = []
        while f is not None:
            fn = f.f_code.co_filename
            if fn.startswith(harness):
                break
            if not fn.startswith(_PKG_DIR):
                frames.append((fn, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        self.state.stacks.setdefault(tuple(frames), []).append(name)

    # ------------------------------------------------------------------ running a call
    def call_kernel(self, func, args, kwargs):
        """The API call itself; in float32 where it has no float64 kernel
        (:func:`~msprobe_ci.kernels.float32_fallback`, noted in :attr:`precision_fallbacks`)."""
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            from ..kernels import float32_fallback

            with self.machinery:  # the fallback's casts are plumbing, not the model's calls
                out = float32_fallback(func, args, kwargs, exc)
        from ..kernels import REFERENCES, _qualified

        self.precision_fallbacks.setdefault(_qualified(func), "reference" if func in REFERENCES else "float32")
        return out


def _format_frame(frame: tuple) -> str:
    fn, lineno, func = frame
    src = linecache.getline(fn, lineno).strip()
    return f"File {fn}, line {lineno}, in {func}, \n {src}"
