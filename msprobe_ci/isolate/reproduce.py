"""The standalone reproduction of a module isolated whole (L0 capture, a ``torch.compile`` region): what the gate
writes for a failing one (:func:`module_reproduction`) and how a reproduction runs it again
(:func:`run_module`), through the same :class:`~.modules.ModuleIsolation` the gate judged it with.

The module's code is not in the files: its forward is kept as tapes (:mod:`msprobe_ci.replay.tape`), one per
precision and device the gate ran it in (its oracle and error budget in fp64 on the CPU, its bench, its target),
recorded by running it again on copies of its state and inputs as they were at the call. The target's tape is
replayed once more, with the faults injected into its calls, and must give the gate's target values bit for bit
(its output, or for a backward node the gradients it handed its inputs): then the reproduction re-runs the target
(``"target": "replayed"``, ``--no-fault`` leaves the faults out). Where it does not (a ``torch.compile`` region,
whose kernels are not the eager ones; an operation outside torch's API), the gate's own target values are saved
and judged (``"target": "recorded"``, with why).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..kernels import tensors_of
from ..replay.repro_files import _DTYPES, _decode, _encode, _saved, _Unwritten
from ..replay.tape import Recorder, TapeModule, bind, replay, signature


def module_reproduction(part, call, direction: str, observed: Any, faults: list,
                        name_of) -> tuple[dict, dict, list]:
    """The spec fields, tensors and injected faults of the reproduction of a failing module node.

    Args:
        part: the :class:`~.modules.ModuleIsolation` that judged it (its settings and runs).
        call: its pending call (state, inputs, oracle dtype, autocast state, first call indices).
        direction: ``forward`` or ``backward``.
        observed: the gate's target: the module's output (forward), or ``(grad_input, grad_output)``.
        faults: the faults due on this rank at this step (:class:`~msprobe_ci.capture.inject.Fault`).
        name_of: how the capture names and counts a call (:class:`~msprobe_ci.replay.tape.Recorder`).

    Raises:
        _Unwritten: the module cannot be kept as a tape (a call off the allowlist, inputs written since the call).
        _Unsaved: an argument the spec cannot hold.
    """
    refs = part.refs
    if tuple(t._version for t in tensors_of(call.args) + list(call.state.values()) + tensors_of(call.kwargs)) != \
            call.versions:
        raise _Unwritten(f"{call.name}: its inputs or state were written since the call")
    tensors: dict = {}
    keys: dict = {}
    grads: dict = {}
    layouts: dict = {}
    # an object among the inputs (a KV cache) is not kept: the tape holds the calls the module made on its tensors
    args = _encode(list(call.args), tensors, keys, grads, layouts, opaque=True)
    kwargs = _encode(dict(call.kwargs), tensors, keys, grads, layouts, opaque=True)
    state = []
    for name, v in call.state.items():
        key = f"state.{name}"
        tensors[key], layout = _saved(v)
        if layout is not None:
            layouts[key] = layout
        state.append({"name": name, "key": key, "parameter": isinstance(v, torch.nn.Parameter),
                      "requires_grad": bool(v.requires_grad)})
    kernel = refs.bench_kernel
    runs = [(call.dtype, "cpu")] + ([(torch.float64, "cpu")] if refs.budget_draws else [])
    runs.append((call.dtype if kernel == "upcast" else torch.float64, "cpu") if kernel in ("upcast", "rounded")
                else (None, refs.bench_device))
    runs.append((None, refs.target_device))  # the target's last
    module: dict = {"state": state, "tapes": [], "first": {k: int(v) for k, v in (call.first or {}).items()}}
    gout = observed[1] if direction == "backward" else None
    for dtype, device in runs:
        tape, real = _record(part, call, dtype, device, tensors, len(module["tapes"]), args, kwargs, gout, name_of)
        target = next((t for t in module["tapes"] if t["signature"] == tape["signature"]), None)
        if target is None:  # a run in a precision or on a device not taped yet: its tape must replay it exactly
            same = _bitwise(_replayed(part, call, tape, tensors, args, kwargs, dtype, device, gout), real,
                            "output" if gout is None else "input gradients")
            if same is not True:
                raise _Unwritten(f"{call.name}: in {str(dtype or 'its own dtype').replace('torch.', '')} on "
                                 f"{device}, {same}")
            module["tapes"].append(tape)
            target = tape
    first = module["first"]
    mine = [f for f in faults if f.api in first]
    due = []
    for entry in target["calls"]:
        name = entry.get("name")
        if name in first:
            n = first[name] + entry["index"]
            due += [{"api": f.api, "call": n, "direction": f.direction, "perturb": f.perturb, "value": f.value}
                    for f in mine if f.matches(name, n, f.direction)]
    gate = tensors_of(observed) if gout is None else [g for g in observed[0] if g is not None]
    if gout is not None:
        module["grad_outputs"] = _keep(tensors, "grad_output", gout)
    replayed = None
    try:
        replayed = _replayed(part, call, target, tensors, args, kwargs, None, refs.target_device, gout, first, mine,
                             as_target=True)
        same = _bitwise(replayed, gate, "output" if gout is None else "input gradients", "the gate's target")
    except Exception as exc:  # noqa: BLE001 - then the gate's values are the target
        same = f"its tape does not replay: {type(exc).__name__}: {str(exc)[:120]}"
    if same is True:
        module["target"] = "replayed"
    else:  # a compiled region's kernels are not the eager ones its tape replays; an order of summation
        module.update(target="recorded", why=same)
        if due and replayed is not None and _near(replayed, gate):
            # the faults replayed give the gate's values to a few units of roundoff (the gradients the capture's
            # hooks route through aliases, summed in another order): without them, the tape is the module
            module["clean"] = "replayed"
        if gout is None:
            module["target_outputs"] = _keep(tensors, "target", gate)
        else:
            module["target_grads"] = _keep(tensors, "target_grad", list(observed[0]))
    fields = {"args": args, "kwargs": kwargs, "requires_grad": grads, "layouts": layouts, "module": module,
              "grad_enabled": bool(call.grad), "autocast": call.autocast}
    return fields, tensors, due


def _keep(tensors: dict, stem: str, values: list) -> list:
    """Save ``values`` (``None`` kept as ``None``) as ``<stem>.<i>``; their keys."""
    out = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            tensors[f"{stem}.{i}"] = v.detach().to("cpu", copy=True).contiguous()
            out.append(f"{stem}.{i}")
        else:
            out.append(None)
    return out


def _autocast(state: dict | None):
    if isinstance(state, dict) and str(state.get("dtype")) in _DTYPES:
        return torch.autocast(str(state["device_type"]), dtype=_DTYPES[str(state["dtype"])])
    return contextlib.nullcontext()


def _record(part, call, dtype, device: str, tensors: dict, index: int, args: list, kwargs: dict,
            gout: list | None, name_of) -> tuple[dict, list]:
    """One tape: the module run again on copies of its state and inputs in ``dtype`` on ``device``; and what
    that run gave (its output tensors, or with ``gout`` the gradients it hands its positional inputs)."""
    st, leaves, a, k = part._module_copies(call, dtype, device, call.grad)
    env = {f"state.{n}": v for n, v in st.items()}
    bind(args, a, env)
    bind(kwargs, k, env)
    rec = Recorder({id(t): key for key, t in env.items()}, tensors, index, name_of)
    with _autocast(call.autocast):
        out = part._module_call(call, st, a, k, call.grad, context=lambda: rec)
    if rec.broken is not None:
        raise _Unwritten(f"{call.name}: {rec.broken}")
    tape = {"signature": signature(list(st.values()), a, k), "calls": rec.calls,
            "output": _encode(out, tensors, rec.keys, {}, None, rec.prefix, opaque=True)}
    return tape, _values(part, out, leaves, gout)


def _values(part, out: Any, leaves: list, gout: list | None) -> list:
    """A run's output tensors, or with ``gout`` the gradients it hands its positional inputs (``None`` left out)."""
    if gout is None:
        return tensors_of(out)
    return [g for g in part._module_vjp(out, leaves, gout) if g is not None]


def _replayed(part, call, tape: dict, tensors: dict, args: list, kwargs: dict, dtype, device: str,
              gout: list | None, first: dict | None = None, faults=(), as_target: bool = False) -> list:
    """What ``tape`` gives, replayed on copies of the call's state and inputs in ``dtype`` on ``device`` (its
    constants placed there, as a reproduction places them), ``faults`` applied: as :func:`_values`.
    ``as_target``: its parameters require grad where the target's did, as a reproduction's rebuilt module
    (:class:`~msprobe_ci.replay.tape.TapeModule`) replays the target (a kernel may take another path for them)."""
    st, leaves, a, k = part._module_copies(call, dtype, device, call.grad, as_target=as_target)
    env = {key: t.to(device) for key, t in tensors.items() if key.startswith("c")}
    env.update({f"state.{n}": v for n, v in st.items()})
    bind(args, a, env)
    bind(kwargs, k, env)
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(call.grad), _autocast(call.autocast):
        return _values(part, replay(tape, env, first, faults), leaves, gout)


def _bitwise(mine: list, gate: list, what: str, whose: str = "the module's"):
    """``True`` when ``mine`` are ``gate`` bit for bit (NaN where NaN), else why not."""
    if len(mine) != len(gate):
        return f"its tape gives {len(mine)} {what}, {whose} {len(gate)}"
    for i, (x, y) in enumerate(zip(mine, gate)):
        if x.shape != y.shape or x.dtype != y.dtype or not bool(((x == y) | (x.isnan() & y.isnan())).all()
                                                                if x.is_floating_point() else torch.equal(x, y)):
            return f"its tape's {what} {i} differs from {whose}"
    return True


def _near(mine: list, gate: list, units: float = 4.0) -> bool:
    """Whether ``mine`` are ``gate`` to ``units`` units of roundoff of each tensor's dtype at its largest finite
    magnitude (NaN where NaN, infinities equal)."""
    if len(mine) != len(gate):
        return False
    for x, y in zip(mine, gate):
        if x.shape != y.shape or x.dtype != y.dtype or not x.is_floating_point():
            return False
        x, y = x.detach().double(), y.detach().double()
        finite = torch.isfinite(y)
        if not torch.equal(finite, torch.isfinite(x)) or not torch.equal(x[~finite].nan_to_num(),
                                                                        y[~finite].nan_to_num()):
            return False
        if not bool(finite.any()):
            continue
        peak = float(y[finite].abs().max())
        if float((x[finite] - y[finite]).abs().max()) > units * torch.finfo(mine[0].dtype).eps * peak:
            return False
    return True


def run_module(iso, spec: dict, tensors: dict, where: str, fault: bool, faults: list) -> dict:
    """Judge a module reproduction (``"kind": "module"``) again: the module rebuilt from its tapes
    (:class:`~msprobe_ci.replay.tape.TapeModule`) isolated by ``iso`` as the gate isolated it, its target replayed
    with ``faults`` (or the gate's recorded target values); the node's isolation record.

    Raises:
        MsprobeError: a malformed field, naming it.
    """
    from ..errors import MsprobeError

    m = spec["module"]
    module = TapeModule(m, spec["args"], spec["kwargs"], tensors, where)
    for key, want in spec["requires_grad"].items():
        if want and key in tensors and tensors[key].is_floating_point():
            tensors[key].requires_grad_(True)
    args, kwargs = _decode(spec["args"], tensors, where), _decode(spec["kwargs"], tensors, where)
    fwd, node = spec["forward"], spec["node"]
    grad = bool(spec.get("grad_enabled", True))
    # the target replayed: its tape gives the gate's values bit for bit, or, left without its faults, nearly
    replayed = m.get("target") == "replayed" or (not fault and m.get("clean") == "replayed")
    if not replayed and not fault and spec.get("faults"):
        raise MsprobeError(f"{where}: the target's values were recorded with the fault ({m.get('why')}): "
                           "--no-fault cannot leave it out")
    with torch.set_grad_enabled(grad), _autocast(spec.get("autocast")):
        call = iso.module_before(fwd, module, tuple(args), dict(kwargs), input_sources=False)
        if call is None:
            return iso.results.get(fwd) or {"status": "skip", "message": "nothing judged"}
        if replayed:
            module.faults = tuple(faults) if fault else ()
            out = module(*args, **kwargs)
            module.faults = ()
        if spec["direction"] == "forward":
            if not replayed:
                out = [_saved_value(tensors, key, where) for key in m.get("target_outputs") or []]
            iso.module_after(call, out)
            return iso.results.get(node) or {"status": "skip", "message": "nothing judged"}
    gout = [None if key is None else _saved_value(tensors, key, where) for key in m.get("grad_outputs") or []]
    if replayed:
        # one entry per positional argument, as the gate's backward hook hands them (None: no gradient)
        leaves = [a if isinstance(a, torch.Tensor) and a.requires_grad else None for a in args]
        grad_input = tuple(iso.modules._module_vjp(out, leaves, gout))
    else:
        keys = m.get("target_grads")
        if not isinstance(keys, list):
            raise MsprobeError(f"{where}: field 'module.target_grads': expected a list of keys")
        grad_input = tuple(None if key is None else _saved_value(tensors, key, where) for key in keys)
    iso.module_backward(call, node, grad_input, gout)
    return iso.results.get(node) or {"status": "skip", "message": "nothing judged"}


def _saved_value(tensors: dict, key: Any, where: str) -> torch.Tensor:
    from ..errors import MsprobeError

    if not isinstance(key, str) or key not in tensors:
        raise MsprobeError(f"{where}: field 'module': no saved tensor {key!r}")
    return tensors[key]
