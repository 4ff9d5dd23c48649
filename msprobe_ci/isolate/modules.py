"""Isolation of whole modules (L0 capture, ``torch.compile`` regions): the module's eager forward on copies of
its state and the target's own inputs, forward and backward."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from .. import kernels
from ..kernels import tensors_of as _tensors
from .support import _copy_obj, _same


_HALF = (torch.float16, torch.bfloat16)
_DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                    torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def _is_dtensor(value) -> bool:
    """Whether ``value`` is a ``torch.distributed`` DTensor (an FSDP2 shard, a tensor-parallel weight)."""
    if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(value, DTensor)


_MISSING = object()


def _hidden_state(module: torch.nn.Module) -> list:
    """``[(submodule, name, value)]``: the tensors (detached) and ``None`` values a module and its submodules keep
    as plain attributes, neither parameters nor buffers, as they are now: state a forward reads and rebinds
    (RecurrentGemma's ``rg_lru.recurrent_states`` and ``conv1d_state``, a KV cache kept on the module). It is an
    input of the call as much as its arguments are. Kept by reference (each re-run gets its own copy): a forward
    that rebinds the attribute leaves it as the call saw it, one that writes into it in place does not."""
    out = []
    for m in module.modules():
        for key, v in vars(m).items():
            if v is None or (isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)):
                out.append((m, key, v.detach() if v is not None else None))
    return out


class _State(dict):
    """The copies of a call's parameters and buffers by name (what :func:`torch.func.functional_call` swaps in),
    and of its hidden state (:func:`_hidden_state`) as ``hidden``, converted as they are."""

    hidden: list = []


#: what every ``nn.Module`` keeps in its ``__dict__`` (parameters, buffers, submodules, hooks): never swapped
_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)


class _KeptAttributes:
    """A re-run of a module on its call's hidden state, leaving the live module as it was: every attribute of every
    submodule is set to the call's starting value (``hidden``) for the run, and every attribute the run rebinds,
    adds or deletes is put back after it. Without it, a re-run made before RecurrentGemma's own forward left its fp64
    ``recurrent_states`` on the model for that forward to start from, and one made after it started from the final
    state of the target's run, whose graph its backward then freed (the user's ``loss.backward()`` failed:
    "Trying to backward through the graph a second time").

    A container attribute (a dict, list or set of the module's own: a cache) is given to the run as a shallow copy,
    so what the run stores in it stays out of the live module: LeViT's eval-mode attention caches its bias in a dict
    keyed by device, and an fp64 re-run's entry, left there, made the target's next forward mix dtypes and raise
    ("expected scalar type Float but found BFloat16"). Tensors inside are shared: a write into one stays."""

    def __init__(self, root: torch.nn.Module, hidden: list):
        self.root, self.hidden, self.saved = root, hidden, []

    def __enter__(self):
        self.saved = [(m, m.__dict__.copy()) for m in self.root.modules()]
        for m, key, v in self.hidden:
            m.__dict__[key] = v
        copies: dict = {}  # one copy per container: modules that share one share its copy
        for m, before in self.saved:
            for key, v in before.items():
                if key not in _MODULE_KEYS and isinstance(v, (dict, list, set)) and m.__dict__.get(key) is v:
                    m.__dict__[key] = copies.setdefault(id(v), copy.copy(v))
        return self

    def __exit__(self, *exc):
        for m, before in self.saved:
            d = m.__dict__
            for key in [key for key in d if key not in before]:
                del d[key]
            for key, v in before.items():
                if d.get(key, _MISSING) is not v:
                    d[key] = v
        return False


@dataclass
class _ModuleCall:
    """A whole-isolated module call: its eager wrapper, the state and inputs it was called with, the oracle's and
    the bench's ``(leaves, output)``."""

    name: str
    wrapper: Any
    state: dict
    args: tuple
    kwargs: dict
    oracle: Any = None
    bench: Any = None
    bench_round: bool = False
    versions: tuple = ()
    dtype: Any = None  # the oracle's
    grad: bool = False
    autocast: dict | None = None  # {device_type, dtype} where the call ran under autocast
    first: dict | None = None  # the capture's next call index per faulted API when the call began
    sites: list | None = None  # under autocast: the dtype each of its calls computed in (kernels.amp_sites)
    kink_spread: Any = None  # the budget's draws at its kinks' inputs (kernels.kinks.Spread)
    kink_target: list | None = None  # the target's kink inputs (kernels.kinks.Record.sites)
    hidden: list | None = None  # the module's hidden state when the call began (_hidden_state)


class _EagerForward(torch.nn.Module):
    """Calls the wrapped module's class ``forward`` (eager even when the instance's ``forward`` was replaced by a
    ``torch.compile`` wrapper), so :func:`torch.func.functional_call` can swap in copies of its state."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


class ModuleIsolation:
    """``module_before`` / ``module_after`` / ``module_backward`` of a module isolated whole.

    Args:
        refs: the settings and the judge's device (:class:`~.references.References`).
        records: where each verdict is kept (:class:`~.records.Records`).
        provenance: which inputs and parameters are sources (:class:`~.provenance.Provenance`).
        loans: what the driving capture lends (:class:`~.records.Loans`: the reproducer of a failing module).
    """

    def __init__(self, refs, records, provenance, loans=None):
        from .records import Loans

        self.refs, self.records, self.provenance = refs, records, provenance
        self.loans = loans if loans is not None else Loans()

    def module_before(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                      input_sources: bool = True):
        """Isolate a module whose APIs capture cannot see (L0 capture, a ``torch.compile`` region): its class's
        eager ``forward`` on the target's own inputs, through :func:`torch.func.functional_call` over *copies* of
        its parameters and buffers (BatchNorm running statistics, caches: no state of the model moves), in the
        oracle precision on CPU and in the target's dtype on the bench device (the eager reference of a compiled
        region; on a CPU target the same eager code). Judged by the benchmark standard (msprobe's default).

        Args:
            input_sources: also treat inputs that no torch call produced as sources (needs API capture to follow
                views and casts; at L0 only the module's own parameters are sources).

        Returns:
            the pending call for :meth:`module_after`, or ``None`` when the module cannot be isolated (the reason
            is recorded).
        """
        self.records.start(name)
        state = dict(module.named_parameters())
        # buffers as they are now: the call may update them in place (BatchNorm's running statistics), and the
        # budget's runs after it need the state the call saw (parameters only move at the optimizer step)
        state.update({k: b.detach().clone() for k, b in module.named_buffers()})
        sources = self.provenance.source_rows(name, "module", args, kwargs) if input_sources else {}
        for pname, p in module.named_parameters(recurse=False):
            if not self.provenance.is_produced(p):
                sources[f"{name}.parameters.{pname}"] = {"id": self.provenance.source_id(p), "kind": "parameter"}
        self.records.results[name] = {"status": "skip", "message": "no output judged", "sources": sources}
        random = [m for m in module.modules() if m.training and isinstance(m, _DROPOUT_MODULES) and m.p > 0]
        if random:
            self.records.results[name].update(message=f"module not isolated: random (dropout p={random[0].p} in "
                                                      "training mode inside)")
            return None
        sharded = next((k for k, v in state.items() if _is_dtensor(v)), None)
        if sharded is not None:
            # its re-runs would gather that state (FSDP's and DTensor's collectives) as many times as this rank's
            # judgement asks, a number that differs between ranks: the ranks would wait on each other for ever
            self.records.results[name].update(message=f"module not isolated: its state is sharded across ranks "
                                                      f"({sharded} is a DTensor); its submodules are judged")
            return None
        wrapper = _EagerForward(module)
        dtype = kernels.oracle_dtype(_tensors(tuple(args)) + list(state.values()) + _tensors(kwargs))
        grad = self.refs.backward and torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point() for a in args)
        # the inputs' structure is snapshot (tensors by reference, the containers and objects that hold them
        # copied): a KV cache the target's own forward appends to stays as this call saw it, for the budget's runs
        call = _ModuleCall(name, wrapper, state, _copy_obj(tuple(args), _same), _copy_obj(dict(kwargs), _same),
                           dtype=dtype, grad=grad, autocast=_autocast_of(list(state.values()) + _tensors(tuple(args))),
                           hidden=_hidden_state(module))
        if self.loans.reproducer is not None:
            call.first = self.loans.reproducer.first_calls()
        try:
            drew: list = []
            call.oracle = self._module_run(call, dtype, "cpu", grad, drew=drew)
            if any(drew):
                # a random op no dropout module shows (Swin's stochastic depth: torch.rand in a drop_path
                # function): each re-run draws anew, so the oracle would not be the target's computation
                self.records.results[name].update(message="module not isolated: random (it draws from the "
                                                          "generator); its submodules are judged")
                return None
            kernel = self.refs.bench_kernel
            if kernel in ("upcast", "rounded"):
                call.bench_round = True
                up = dtype if kernel == "upcast" else torch.float64
                call.bench = call.oracle if up == dtype else self._module_run(call, up, "cpu", grad)
            else:
                context = kernels.decomposed if kernel == "decomposed" else None
                if self._same_autocast(call):
                    # the bench runs as the target ran, autocast and all: its calls are the target's sites, noted
                    # here for free (computed_in, the budget) instead of by a run of their own
                    from ..kernels import amp_sites

                    st, leaves, a, k = self._module_copies(call, None, self.refs.bench_device, grad)
                    call.sites, out = amp_sites.record_sites(
                        lambda: self._module_call(call, st, a, k, grad, context), keep=True)
                    call.bench = (leaves, out)
                else:
                    call.bench = self._module_run(call, None, self.refs.bench_device, grad, context)
        except Exception as exc:  # noqa: BLE001 - unjudgeable module, the user's run goes on
            self.records.results[name].update(message=f"module not isolated: {type(exc).__name__}: "
                                                      f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")
            return None
        call.versions = tuple(t._version for t in _tensors(call.args) + list(state.values()) + _tensors(call.kwargs))
        return call

    @staticmethod
    def _module_run(call: "_ModuleCall", dtype, device, grad: bool = False, context=None, perturb=None,
                    sites=None, kinks=None, drew: list | None = None, ranges=None):
        """``(leaves, output)``: ``leaves`` are the copies of the positional tensor inputs that need grad (the
        inputs a full backward hook reports gradients for), in order, ``None`` for the others. ``context`` and
        ``perturb`` as for :func:`msprobe_ci.kernels.reference`; ``sites``: a budget's
        :class:`~msprobe_ci.kernels.amp_sites.Sites` (a module run under autocast); ``kinks``: a
        :class:`~msprobe_ci.kernels.kinks.Record` or :class:`~msprobe_ci.kernels.kinks.Force` mode; ``ranges``: a
        :class:`~msprobe_ci.kernels.amp_sites.Ranges` mode (above ``sites``)."""
        st, leaves, a, k = ModuleIsolation._module_copies(call, dtype, device, grad)
        return leaves, ModuleIsolation._module_call(call, st, a, k, grad, context, perturb, sites, kinks, drew,
                                                    ranges)

    @staticmethod
    def _module_copies(call: "_ModuleCall", dtype, device, grad: bool = False, as_target: bool = False) -> tuple:
        """``(state, leaves, args, kwargs)``: copies of the call's state (by name) and inputs, floating ones in
        ``dtype`` (``None``: their own) on ``device``; ``leaves`` as for :meth:`_module_run`. ``as_target`` (with
        ``grad``): each copy of a parameter requires grad where the target's does, as the target ran it; a kernel
        may take another path for a tensor that requires grad (T5's attention under CPU bf16 autocast moved its
        output by a bf16 rounding, and a ReLU input 0.00081 landed at -0.00007)."""
        conv = kernels.copier(dtype, device)
        st = _State((k, conv(v)) for k, v in call.state.items())
        st.hidden = [(m, key, v if v is None else conv(v)) for m, key, v in (call.hidden or ())]
        if as_target and grad:
            for key, v in call.state.items():
                if v.requires_grad and st[key].is_floating_point():
                    st[key].requires_grad_(True)
        leaves: list = []
        a = []
        for v in call.args:
            c = _copy_obj(v, conv)
            if isinstance(v, torch.Tensor):
                if grad and v.requires_grad and c.is_floating_point():
                    c.requires_grad_(True)
                    leaves.append(c)
                else:
                    leaves.append(None)
            a.append(c)
        return st, leaves, a, {key: _copy_obj(v, conv) for key, v in call.kwargs.items()}

    @staticmethod
    def _module_call(call: "_ModuleCall", st: dict, a: list, k: dict, grad: bool, context=None, perturb=None,
                     sites=None, kinks=None, drew: list | None = None, ranges=None):
        """The module's eager forward on the copies of :meth:`_module_copies`. ``drew``: a list that gets whether
        the run drew from the CPU generator (its state moved: a random op that draws; a dropout of ``p = 0`` or a
        fused attention without dropout draws nothing). Read off the generator, not off the ops: a dispatch mode
        around a region's run broke ``torch.compile``'s guards for the compiled target after it."""
        import contextlib

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))  # the user's random stream stays
            if drew is not None:
                start = torch.random.get_rng_state()
                stack.callback(lambda: drew.append(not torch.equal(start, torch.random.get_rng_state())))
            stack.enter_context(torch.set_grad_enabled(grad))
            if any(t.dtype == torch.float64 for t in list(st.values()) + _tensors((a, k))):
                # under every other mode: a call without a float64 kernel, as the modes above it pass it on (a
                # float64 run only: no mode on the target's and the bench's own runs)
                stack.enter_context(kernels.Float64References())
            if context is not None:
                stack.enter_context(context())
            if perturb is not None:
                kernels.budget_modes(stack, perturb)
            if sites is not None:  # above the budget's modes: it sets the precision they round in per call
                stack.enter_context(sites)
            if ranges is not None:  # above those: what it holds in range is each call's result as they made it
                stack.enter_context(ranges)
            if kinks is not None:
                stack.enter_context(kinks)
            stack.enter_context(_KeptAttributes(call.wrapper.module, getattr(st, "hidden", None) or []))
            return torch.func.functional_call(call.wrapper, {f"module.{n}": v for n, v in st.items()}, tuple(a), k,
                                              strict=False)

    def _module_scale(self, call: "_ModuleCall", grad_output: list | None = None, judged: list | None = None) -> list:
        """The error scale (:mod:`msprobe_ci.kernels`) of a module's output tensors, or with ``grad_output`` of the
        gradients it hands to its positional inputs: the module re-run in fp64 with its inputs, state and every
        intermediate jittered. Empty when the inputs were written since the call or the runs fail.

        Under autocast (``call.autocast``) each of its calls is rounded in the dtype it computed in
        (:mod:`msprobe_ci.kernels.amp_sites`: the GEMMs in bf16/fp16, the rest in fp32), and each scale is measured
        in units of the roundoff of the dtype its tensor is judged in (``judged``: the target's dtypes, one per
        output or input gradient; ``None`` where there is none): a bf16 output of a Linear under autocast and the
        fp32 output of a block whose GEMMs ran in bf16 are judged in their own dtypes.

        Twice the API budget's draws: a whole block sums many rounding sites, and its max relative error is the
        extreme of thousands of elements judged against their estimates, whose lower tail 4 draws leave wide (T5's
        first block backward failed max_rel_err 10.6 > 10 against the correctly rounded bench with 4, passes with
        8; faults named as often as with 4, `gate_quality.py --level L0 --bench-kernel all`)."""
        if not self.refs.budget_draws or tuple(t._version for t in _tensors(call.args) + list(call.state.values()) +
                                          _tensors(call.kwargs)) != call.versions:
            return []
        from ..kernels import amp_sites, kinks

        tensors = _tensors(call.args) + list(call.state.values()) + _tensors(call.kwargs)
        perturb = kernels.perturbation(torch.float64, tensors, torch.Generator().manual_seed(0x30D))
        eta = kernels.unit_of(perturb)
        grad = grad_output is not None
        sites = self._autocast_sites(call, tensors, perturb)
        spread = kinks.Spread()

        def one(perturb):
            try:
                leaves, out = self._module_run(call, torch.float64, "cpu", grad, perturb=perturb, sites=sites,
                                               kinks=spread.record())
                if grad:
                    return self._module_vjp(out, leaves, grad_output, perturb)
                return _tensors(out)
            finally:
                amp_sites.settle()
        try:
            base = one(None)
            if sites is not None:
                sites.plan()
            held = kernels.held_runs()
            n = kernels._draws(2 * self.refs.budget_draws, [b for b in base if b is not None])
            folded = kernels._Spread(eta, n)  # each draw folded in as it comes: one draw alive at a time
            for _ in range(n):
                d = one(perturb)
                folded.add([None if x is None or b is None or x.shape != b.shape else x.detach().to(torch.float64) -
                            b.detach().to(torch.float64) for x, b in zip(d, base)])
                del d
            held = kernels.held_runs() > held
        except Exception:  # noqa: BLE001 - no budget: relative to |oracle| alone
            return []
        if len(spread) and call.kink_spread is None:
            call.kink_spread = spread
        scales = folded.scales()
        if sites is not None and judged:
            units = [kernels._UNIT.get(d, eta) if d is not None else eta for d in judged]
            scales = [s if s is None or i >= len(units) else s * (eta / units[i]) for i, s in enumerate(scales)]
        return kernels.held_scales(scales, held)

    def _autocast_sites(self, call: "_ModuleCall", tensors: list, perturb: tuple):
        """For a module that ran under autocast: a :class:`~msprobe_ci.kernels.amp_sites.Sites` for its budget's
        runs, from one run of it as the target ran it (its dtypes and device, the autocast state; noted once per
        call); ``None`` outside autocast."""
        from ..kernels import amp_sites

        if not call.autocast:
            return None
        device = self._record_sites(call, tensors)
        dtype = _autocast_dtype(call.autocast)
        own, cpu = kernels.target_dtype(tensors), device.type == "cpu"

        def precision(d):
            return kernels.precision_of(torch.float64, d, cpu)
        if not call.sites:
            return amp_sites.Sites.everywhere(dtype, own, precision, perturb[1])
        return amp_sites.Sites(call.sites, own, precision, perturb[1])

    def _same_autocast(self, call: "_ModuleCall") -> bool:
        """Whether the call ran under autocast and the bench device is of the autocast's device type (the same
        autocast state covers it: the bench's calls compute in the target's dtypes)."""
        return bool(call.autocast) and torch.device(self.refs.bench_device).type == call.autocast.get("device_type")

    def _record_sites(self, call: "_ModuleCall", tensors: list) -> torch.device:
        """Note ``call.sites`` once (:func:`~msprobe_ci.kernels.amp_sites.record_sites`: the module run again as
        the target ran it, under its autocast; ``[]`` where that run fails). Returns the target's device."""
        from ..kernels import amp_sites

        device = _device_of(tensors)
        if call.sites is None:
            st, _, a, k = self._module_copies(call, None, device)
            autocast = _autocast_context(call.autocast)
            try:
                call.sites = amp_sites.record_sites(lambda: self._module_call(call, st, a, k, False, autocast))
            except Exception:  # noqa: BLE001 - not run again: every call as the autocast dtype's kernel
                call.sites = []
        return device

    def computed_in(self, call: "_ModuleCall") -> torch.dtype | None:
        """The dtype a module is as precise as. Under autocast: the coarsest its calls computed in (the
        autocast dtype where one of them is a GEMM, a convolution or an attention; fp32 where none is) or its own
        tensors hold. Its outputs and input gradients are judged as results of that
        dtype (``judge_pair``'s ``as_dtype``): a GPT-2 block under bf16 autocast returns fp32 tensors whose errors
        are its bf16 GEMMs', and judged against fp32's floors (msprobe's ``min_err`` 2^-14) a 2% fault inside it
        read as a ratio of 0.005; a LayerNorm under autocast computes in fp32 and is judged so.

        Outside autocast, the coarsest dtype of its inputs and state where that is bf16 or fp16 (``None`` for
        fp32 and wider): an fp32 output of a bf16 module (Mixtral's router scores, ``softmax(logits.float())``
        of bf16 logits; a loss of bf16 logits) is as precise as bf16, and its budget is in bf16's units (judged as
        fp32, the benign router failed its RMSE, ratio 3.37 > 2)."""
        tensors = _tensors(call.args) + list(call.state.values()) + _tensors(call.kwargs)
        if not call.autocast:
            own = kernels.target_dtype(tensors)
            return own if kernels._UNIT.get(own, 0.0) > kernels.ACCUMULATION else None
        self._record_sites(call, tensors)
        dtypes = [s.kernel for s in call.sites or () if s.kernel.is_floating_point]
        if not call.sites:
            dtypes.append(_autocast_dtype(call.autocast))
        dtypes.append(kernels.target_dtype(tensors))
        return max(dtypes, key=lambda d: kernels._UNIT.get(d, 0.0))

    def module_after(self, call, output: Any) -> None:
        """Judge a module isolated by :meth:`module_before` (``call`` ``None``: nothing to do)."""
        if call is None:
            return
        from ..judge import judge_pair

        name = call.name
        stem = f"{name}.output"
        t_list, b_list, o_list = _tensors(output), _tensors(call.bench[1]), _tensors(call.oracle[1])
        if not (len(t_list) == len(b_list) == len(o_list)):
            self.records.results[name].update(message=f"module output structure differs on re-run ({len(t_list)} vs "
                                                      f"{len(o_list)} tensors)")
            return
        scales: list = []
        within = self.computed_in(call)
        judged = [_coarser(t.dtype, within) for t in t_list]

        def budget(i: int):
            if not scales:
                scales.extend(self._module_scale(call, judged=judged) or [None] * len(t_list))
            return scales[i] if i < len(scales) else None
        def judge(b_list, o_list):
            results = []
            for i, (t, b, o) in enumerate(zip(t_list, b_list, o_list)):
                if call.bench_round:
                    b = _rounded_as(b, t, judged[i] if within is not None else None)
                t, b, o = (self.refs.judged(x) for x in (t, b, o))
                results.append((f"{stem}.{i}", judge_pair("module", t, b, o, False, self.refs.standards,
                                                          self.refs.thresholds, terms=lambda i=i: budget(i),
                                                          as_dtype=judged[i] if within is not None else None)))
            return results
        results = judge(b_list, o_list)
        if any(r.status == "error" for _, r in results) and _overflowed(t_list, o_list):
            held = self._in_range(call, t_list)
            if held is not None:
                (o_held, b_held), note = held
                o_list = _infinities_of(t_list, o_held, both=True)
                if b_held is not None:
                    b_list = _infinities_of(t_list, b_held, both=True)
                results = _noted(judge(b_list, o_list), _range_note(note))
        if any(r.status == "error" for _, r in results):
            if call.kink_spread is None:
                # the kinks' spread comes with the budget's draws, which only a floating row judged against its
                # bench asks for: a router whose indices alone differ (a top-k within a rounding, the Qwen3-Next
                # router at L0 in bf16) failed the binary standard with none drawn, and no kink was looked at
                budget(0)
            forced = self._on_target_side(call, False)
            if forced is not None:
                run, b_run, moved = forced
                o_list = _tensors(run[1])
                if b_run is not None:  # the oracle rounded; a kernel's own run stays as it ran
                    b_list = _tensors(b_run[1])
                results = _noted(judge(b_list, o_list), _kinks_note(moved))
        self.records.store(name, results, {f"{stem}.{i}": o for i, o in enumerate(o_list)})
        if not call.grad:  # no backward to judge: the kinks' draws are not needed again
            call.kink_spread = call.kink_target = None
        self._reproduce(call, name, "forward", output)

    def module_backward(self, call, name: str, grad_input: tuple, grad_output: tuple) -> None:
        """Judge the gradients a whole-isolated module hands to its inputs (``grad_input``) against the
        vector-Jacobian products of its oracle and same-dtype bench graphs for the same ``grad_output``."""
        if call is None:
            return
        from ..judge import judge_pair

        (o_leaves, o_out), (b_leaves, b_out) = call.oracle, call.bench
        self.records.start(name)
        try:
            gout = [g for g in grad_output]
            results = []
            oracle = self._module_vjp(o_out, o_leaves, gout)
            context = kernels.decomposed if self.refs.bench_kernel == "decomposed" else None
            bench = oracle if b_leaves is o_leaves else self._module_vjp(b_out, b_leaves, gout, context=context)
            scales: list = []
            within = self.computed_in(call)
            judged = [None if g is None else _coarser(g.dtype, within) for g in grad_input]

            def budget(i: int):
                if not scales:
                    scales.extend(self._module_scale(call, gout, judged) or [None] * len(grad_input))
                return scales[i] if i < len(scales) else None
            def judge(oracle, bench):
                results, k = [], 0
                for i, t in enumerate(grad_input):
                    if t is None:
                        continue
                    o = oracle[i] if i < len(oracle) else None
                    b = bench[i] if i < len(bench) else None
                    if call.bench_round:
                        b = _rounded_as(b, t, judged[i] if within is not None else None)
                    if o is not None and b is not None and o.shape == t.shape and b.shape == t.shape:
                        t, b, o = (self.refs.judged(x) for x in (t, b, o))
                        results.append((f"{name}.output.{k}", judge_pair(
                            "module", t, b, o, True, self.refs.standards, self.refs.thresholds,
                            terms=lambda i=i: budget(i), as_dtype=judged[i] if within is not None else None)))
                    k += 1
                return results
            results = judge(oracle, bench)
            if any(r.status == "error" for _, r in results) and _overflowed(list(grad_input), oracle):
                held = self._in_range(call, list(grad_input), gout)
                if held is not None:
                    (o_held, b_held), note = held
                    oracle = _infinities_of(list(grad_input), o_held, both=True)
                    if b_held is not None:
                        bench = _infinities_of(list(grad_input), b_held, both=True)
                    results = _noted(judge(oracle, bench), _range_note(note))
            if any(r.status == "error" for _, r in results):
                forced = self._on_target_side(call, True)
                if forced is not None:
                    (f_leaves, f_out), b_run, moved = forced
                    oracle = self._module_vjp(f_out, f_leaves, gout)
                    if b_run is not None:
                        bench = oracle if b_run[0] is f_leaves else self._module_vjp(b_run[1], b_run[0], gout)
                    results = _noted(judge(oracle, bench), _kinks_note(moved))
            if results:
                self.records.store(name, results)
                self._reproduce(call, name, "backward", (grad_input, gout))
            else:
                self.records.skip(name, "no input gradient to judge")
        except Exception as exc:  # noqa: BLE001 - never break the user's backward pass
            self.records.skip(name, f"module backward not isolated: {type(exc).__name__}: {exc}"[:200])
        finally:
            call.oracle = call.bench = call.kink_spread = call.kink_target = None

    def _in_range(self, call: "_ModuleCall", target: list, grad_output: list | None = None):
        """The oracle of a module whose ``target`` outputs (with ``grad_output``: its input gradients) overflowed
        where the oracle's did not, run again holding every intermediate in the range of the dtype the target held
        it in (:class:`~msprobe_ci.kernels.amp_sites.Ranges`, paired with the target's sites): ``((oracle, bench),
        note)``, the bench ``None`` where it is a kernel's own run; ``None`` where neither that run nor a draw of
        the budget overflows (the overflow is then the target's alone).

        Where the oracle stays within range but the budget's draws (:meth:`_module_scale`'s, held in range too)
        overflow, an overflow is an outcome a correct kernel of the dtype gives: a pure fp16 LeViT stage's
        backward reached 92% of fp16's largest value in the oracle, and the batch norms of channels a batch sees as
        constant amplify roundings by 10% on the way; 3 of 8 draws overflowed, as the target did. The oracle then
        takes the infinities of the draw whose inf/nan positions agree best with the target's, its other values
        staying the unperturbed oracle's."""
        from ..kernels import amp_sites

        tensors = _tensors(call.args) + list(call.state.values()) + _tensors(call.kwargs)
        self._record_sites(call, tensors)
        if not call.sites:
            return None
        grad = grad_output is not None

        def result(run, perturb=None) -> list:
            leaves, out = run
            return list(self._module_vjp(out, leaves, grad_output, perturb) if grad else _tensors(out))

        def held(dtype):
            ranges = amp_sites.Ranges(call.sites)
            self._module_run(call, dtype, "cpu", grad, ranges=ranges)  # notes the calls' names
            ranges.plan()
            return result(self._module_run(call, dtype, "cpu", grad, ranges=ranges)), ranges.moved
        try:
            oracle, moved = held(call.dtype)
            up = call.dtype if self.refs.bench_kernel == "upcast" else torch.float64
            bench = (oracle if up == call.dtype else held(up)[0]) if call.bench_round else None
            note = f"{moved} value{'s' if moved != 1 else ''} past it turned to infinities, as the target's " \
                   "tensors hold them"
            if not moved:
                drawn = self._overflowing_draw(call, tensors, target, grad_output)
                if drawn is None:
                    return None
                draw, hits, n = drawn
                oracle = _infinities_of(draw, oracle)
                bench = _infinities_of(draw, bench) if bench is not None else None
                note = f"{hits} of {n} draws of the budget overflow, as the target did; the oracle takes the " \
                       "infinities of the draw nearest the target's"
        except Exception:  # noqa: BLE001 - judged as it is
            return None
        return (oracle, bench), note

    def _overflowing_draw(self, call: "_ModuleCall", tensors: list, target: list, grad_output: list | None):
        """``(draw, hits, draws)``: of the budget's draws of the module (:meth:`_module_scale`'s perturbation and
        autocast sites) held in the range of the target's dtypes, the result of the one whose inf/nan positions
        agree best with ``target``'s, how many overflowed and how many ran; ``None`` where none overflowed."""
        from ..kernels import amp_sites

        if not self.refs.budget_draws:
            return None
        grad = grad_output is not None
        perturb = kernels.perturbation(torch.float64, tensors, torch.Generator().manual_seed(0x30D))
        sites = self._autocast_sites(call, tensors, perturb)
        ranges = amp_sites.Ranges(call.sites)
        odd = [~torch.isfinite(t) if isinstance(t, torch.Tensor) else None for t in target]

        def one(p):
            try:
                ranges.moved = 0
                leaves, out = self._module_run(call, torch.float64, "cpu", grad, perturb=p, sites=sites,
                                               ranges=ranges)
                return list(self._module_vjp(out, leaves, grad_output, p) if grad else _tensors(out))
            finally:
                amp_sites.settle()
        one(None)  # notes the calls' names for both modes
        if sites is not None:
            sites.plan()
        ranges.plan()
        best, hits, n = None, 0, 2 * self.refs.budget_draws
        for _ in range(n):
            got = one(perturb)
            if not ranges.moved:
                continue
            hits += 1
            agree = sum(int((~torch.isfinite(g) == m.to(g.device)).sum()) for g, m in zip(got, odd)
                        if isinstance(g, torch.Tensor) and m is not None and g.shape == m.shape)
            if best is None or agree > best[0]:
                best = (agree, got)
        return None if best is None else (best[1], hits, n)

    def _on_target_side(self, call: "_ModuleCall", grad: bool):
        """The oracle of a failing module run again on the target's side of every kink within
        :data:`~msprobe_ci.kernels.kinks.SPREADS` spreads of the budget's draws (:mod:`msprobe_ci.kernels.kinks`):
        ``((leaves, output), bench, moved)``, the bench the same run where it is the oracle rounded (``upcast``,
        ``rounded``) and ``None`` where it is a kernel's own run; ``None`` where no kink input was moved (no kink,
        no budget drawn, or the target's run cannot be made)."""
        from ..kernels import kinks

        spread = call.kink_spread
        if spread is None or not len(spread):
            return None
        if call.kink_target is None:
            device = _device_of(_tensors(call.args) + list(call.state.values()) + _tensors(call.kwargs))
            record = kinks.Record()
            try:
                st, _, a, k = self._module_copies(call, None, device, call.grad, as_target=True)
                self._module_call(call, st, a, k, call.grad, _autocast_context(call.autocast), kinks=record)
                call.kink_target = record.sites
            except Exception:  # noqa: BLE001 - the target's sides unknown: judged as it is
                call.kink_target = []
        if not call.kink_target:
            return None
        force = kinks.Force(call.kink_target, spread)
        try:
            run = self._module_run(call, call.dtype, "cpu", grad, kinks=force)
        except Exception:  # noqa: BLE001 - judged as it is
            return None
        if not force.moved:
            return None
        bench = None
        if call.bench_round:
            up = call.dtype if self.refs.bench_kernel == "upcast" else torch.float64
            bench = run if up == call.dtype else self._module_run(call, up, "cpu", grad,
                                                                  kinks=kinks.Force(call.kink_target, spread))
        return run, bench, force.moved

    @staticmethod
    def _module_vjp(out: Any, leaves: list, grad_output: list, perturb=None, context=None) -> list:
        import contextlib

        outs = [t for t in _tensors(out)]
        pairs = [(t, g) for t, g in zip(outs, grad_output) if g is not None and t.requires_grad]
        pos = [j for j, x in enumerate(leaves) if x is not None]
        if not pairs or not pos:
            return [None] * len(leaves)
        grads = [g.detach().to(device=t.device, dtype=t.dtype) for t, g in pairs]  # exact: target-dtype values
        with contextlib.ExitStack() as stack:
            if context is not None:
                stack.enter_context(context())
            if perturb is not None:
                kernels.budget_modes(stack, perturb, forward=False)
            got = torch.autograd.grad([t for t, _ in pairs], [leaves[j] for j in pos], grads, allow_unused=True)
        res: list = [None] * len(leaves)
        for j, g in zip(pos, got):
            res[j] = g
        return res

    def _reproduce(self, call: "_ModuleCall", node: str, direction: str, observed: Any) -> None:
        """Write the standalone reproduction of a failing module node (the capture's reproducer, when one is lent):
        its tapes (:mod:`msprobe_ci.replay.tape`) and the gate's view of its target, into ``record["repro"]``."""
        record = self.records.results.get(node) or {}
        reproducer = self.loans.reproducer
        if reproducer is None or record.get("status") != "error":
            return
        from .reproduce import module_reproduction

        inner = _failing_inside(self.records.results, node)
        if inner is not None:
            record["repro"] = f"not written: {inner} inside it fails too (its reproduction is the one to run)"
            return
        reproducer.write_module(self.refs, node, direction, record,
                                lambda: module_reproduction(self, call, direction, observed,
                                                            reproducer.faults_now(), reproducer.name_of))


def _noted(results: list, note: str) -> list:
    """``results`` with ``note`` added to each message (how the oracle was run again)."""
    import dataclasses

    return [(row, dataclasses.replace(r, message=f"{r.message}; {note}" if r.message else note))
            for row, r in results]


def _kinks_note(moved: int) -> str:
    from ..kernels.kinks import SPREADS

    return (f"oracle on the target's side of {moved} kink input{'s' if moved != 1 else ''} (ReLU, top-k and the "
            f"like) within {SPREADS:g} spreads of the budget's draws")


def _range_note(how: str) -> str:
    return f"oracle held in the range of the target's dtypes ({how})"


def _overflowed(target: list, oracle: list) -> bool:
    """Whether a target tensor holds an infinity or a NaN where its oracle's value is finite."""
    for t, o in zip(target, oracle):
        if isinstance(t, torch.Tensor) and isinstance(o, torch.Tensor) and t.shape == o.shape and \
                t.is_floating_point() and bool((~torch.isfinite(t) & torch.isfinite(o.to(t.device))).any()):
            return True
    return False


def _infinities_of(source: list, into: list, both: bool = False) -> list:
    """``into`` (an oracle's or a bench's outputs, :meth:`ModuleIsolation._in_range`) with ``source``'s infinities
    and NaNs where ``source`` has them; with ``both``, only where ``into`` has one too. ``source`` the target's,
    with ``both``: which of the two a sum of infinities gives (inf - inf) is the summation order's, no kernel's
    error, and a value finite on one side only stays as it is; ``source`` a draw of the budget: its overflows."""
    out = []
    for x, o in zip(source, into):
        if isinstance(x, torch.Tensor) and isinstance(o, torch.Tensor) and x.shape == o.shape:
            x = x.detach().to(device=o.device, dtype=o.dtype)
            take = ~torch.isfinite(x) & (~torch.isfinite(o) if both else True)
            o = torch.where(take, x, o.detach())
        out.append(o)
    return out + list(into[len(out):])


def _failing_inside(results: dict, node: str) -> str | None:
    """A failing module node of the same direction (``forward``/``backward``) whose module lies inside ``node``'s,
    or ``None``: node names are ``Module.<path>.<Class>.<direction>.<n>``."""
    parts = node.rsplit(".", 3)
    if len(parts) != 4:
        return None
    path, direction = parts[0], parts[2]
    for other, rec in results.items():
        if other.startswith(path + ".") and rec.get("status") == "error":
            o = other.rsplit(".", 3)
            if len(o) == 4 and o[2] == direction and o[0] != path:
                return other
    return None


#: the dtypes autocast computes in, by the names ``_autocast_of`` (and a reproduction's spec) give them: a name is
#: looked up here, never on ``torch`` (a spec is data)
_AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _autocast_dtype(state: dict) -> torch.dtype:
    """The dtype of an autocast state ``{device_type, dtype}``; bf16 for a name not in :data:`_AUTOCAST_DTYPES`."""
    return _AUTOCAST_DTYPES.get(str(state.get("dtype")), torch.bfloat16)


def _device_of(tensors: list) -> torch.device:
    """The target's device: its first floating tensor's (the CPU where there is none)."""
    floating = [t for t in tensors if t.is_floating_point()]
    return floating[0].device if floating else torch.device("cpu")


def _rounded_as(bench: Any, target: Any, computed: torch.dtype | None) -> Any:
    """The ``upcast``/``rounded`` bench of a module's output rounded once to the target's dtype, or, where the
    module computed in a coarser dtype under autocast (``computed``, :meth:`ModuleIsolation.computed_in`), to that
    dtype first: a result of bf16 GEMMs is judged as a bf16 result, and its bench is one too. Rounded to fp32 only,
    the bench held every small element of a ViT's input gradient (the tokens other than the classifier's, 250 times
    under its peak) exactly, and the target's bf16 casts put all 157 of them in error (small-value error ratio 157
    with no fault); the relative metrics are floored at the computed dtype's rounding either way."""
    bench = kernels.round_to(bench, target)
    if computed is not None and isinstance(bench, torch.Tensor) and bench.is_floating_point() and \
            _coarser(bench.dtype, computed) != bench.dtype:
        bench = bench.to(computed).to(target.dtype)
    return bench


def _autocast_context(state: dict | None):
    """A context factory entering the autocast state ``{device_type, dtype}`` a call ran under (``None`` for
    none): the module run again as the target ran it."""
    if not state:
        return None
    dtype = _autocast_dtype(state)

    def autocast():
        return torch.autocast(str(state["device_type"]), dtype=dtype)
    return autocast


def _coarser(dtype: torch.dtype, other: torch.dtype | None) -> torch.dtype:
    """The coarser of two floating dtypes (``dtype`` where ``other`` is ``None`` or either is not floating)."""
    if other is None or not dtype.is_floating_point:
        return dtype
    return max((dtype, other), key=lambda d: kernels._UNIT.get(d, 0.0))


def _autocast_of(tensors: list) -> dict | None:
    """``{device_type, dtype}`` of the autocast region the call runs in (on its first floating tensor's device
    type), ``None`` outside one."""
    floating = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floating:
        return None
    dev = floating[0].device.type
    try:
        if not torch.is_autocast_enabled(dev):
            return None
        return {"device_type": dev, "dtype": str(torch.get_autocast_dtype(dev)).replace("torch.", "")}
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None
