"""A module's forward as data: the torch calls one run of it made, in order (a *tape*), replayed without the
module's code. It is what the standalone reproduction of a module isolated whole (L0 capture, a ``torch.compile``
region) runs in place of the model (written by :meth:`msprobe_ci.capture.repro.Reproducer.write_module`, run by
:mod:`msprobe_ci.repro`).

Recording (:class:`Recorder`, a ``TorchFunctionMode`` around one eager run of the module on copies of its state
and inputs) keeps each outermost torch call that returns a tensor or writes into one (``__setitem__``): the function
by its dump name (``Functional.linear``), its index among this run's calls of that API (the gate's call index,
which faults are matched by, is the module's first call index plus it), and its arguments with each tensor named:
an input (``t<n>``), a parameter or buffer (``state.<name>``), an output of an earlier call (``v<call>.<k>``) or
a constant saved as it was (``c<tape>_<n>``: a value the tape cannot derive, taken as the run saw it). A call that
returns no tensor (``size``, ``item``) is not kept: its value is already in the arguments of the calls that used
it. Python control flow is resolved as it ran: a tape is that run, for those inputs, in those dtypes, so a module
has one tape per precision the gate ran it in (its oracle, its bench, its target).

Replaying (:func:`replay`) is data, never code: a function is looked up on the replay allowlist
(:mod:`msprobe_ci.replay.allowlist`) by the names written, a property among :data:`PROPERTIES`; ``__setitem__``
is the one call beyond the allowlist, writing into a tensor the tape itself holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import MsprobeError
from ..kernels import tensors_of
from .repro_files import _Unsaved, _decode, _encode

#: tensor properties a tape may read (views and aliases of the tensor)
PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})
#: the one call beyond the replay allowlist: an indexed write into a tensor the tape holds
_SETITEM = ("Tensor", "__setitem__")


def signature(state: list, args: Any, kwargs: Any) -> list:
    """``[[dtype, device], ...]`` of the floating tensors in ``state`` (in order), then ``args`` and ``kwargs``:
    which of a module's tapes a run of it replays (its oracle's in fp64 on the CPU, its target's in its own)."""
    return [[str(t.dtype).replace("torch.", ""), t.device.type] for t in list(state) + tensors_of(args) +
            tensors_of(kwargs) if t.is_floating_point()]


def bind(encoded: Any, value: Any, env: dict) -> None:
    """Name the tensors of ``value`` by the keys its encoding ``encoded`` (:func:`~.repro_files._encode` of an
    argument of the same structure) gives them, into ``env``."""
    if isinstance(encoded, dict) and len(encoded) == 1:
        (tag, x), = encoded.items()
        if tag == "tensor" and isinstance(value, torch.Tensor):
            env[x] = value
        elif tag == "tuple" and isinstance(value, (list, tuple)):
            bind(x, value, env)
        elif tag == "dict" and isinstance(value, dict):
            for k, v in x.items():
                if k in value:
                    bind(v, value[k], env)
    elif isinstance(encoded, list) and isinstance(value, (list, tuple)):
        for e, v in zip(encoded, value):
            bind(e, v, env)


class Recorder(TorchFunctionMode):
    """Records one run of a module as a tape (see the module docstring).

    Args:
        keys: ``{id(tensor): key}`` of the run's inputs and state (held alive by the caller for the run).
        tensors: where a constant is saved (shared by a module's tapes; ``c<tape>_<n>`` keys).
        tape: this tape's number (its constants' key prefix).
        name_of: ``(func, args) -> (prefix, api, counted name or None) | None``: how the capture names and counts
            a call (:func:`msprobe_ci.capture.naming.counted`, lent by the capture's reproducer).

    Attributes:
        calls: the kept calls: ``{"function": {"prefix", "api"}}`` or ``{"property": name}``, ``"name"`` (the dump
            name its call index counts under, ``None`` for a call capture does not count), ``"index"`` (its
            place among this run's calls of that name), ``"args"``, ``"kwargs"``.
        broken: why the run cannot be a tape (a call off the allowlist, an argument the spec cannot hold), or
            ``None``.
    """

    def __init__(self, keys: dict, tensors: dict, tape: int, name_of=None):
        super().__init__()
        self.name_of = name_of
        self.keys, self.tensors, self.prefix = dict(keys), tensors, f"c{tape}_"
        self.calls: list[dict] = []
        self.broken: str | None = None
        self._held: list = []  # every tensor named, alive while recording: an id names one tensor
        self._counts: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.broken is not None:
            return func(*args, **kwargs)
        entry = self._entry(func, args, kwargs)
        out = func(*args, **kwargs)
        if entry is None:
            return out
        produced = tensors_of(out)
        if not produced and tuple(entry.get("function", {}).values()) != _SETITEM:
            return out  # a value, not a tensor: already in the arguments of the calls that use it
        if "why" in entry:
            self.broken = entry["why"]
            return out
        name = entry.pop("counted", None)
        if name is not None:
            entry["name"], entry["index"] = name, self._counts.get(name, 0)
            self._counts[name] = entry["index"] + 1
        i = len(self.calls)
        self.calls.append(entry)
        for j, t in enumerate(produced):
            self.keys[id(t)] = f"v{i}.{j}"
            self._held.append(t)
        return out

    def _entry(self, func, args: tuple, kwargs: dict) -> dict | None:
        """The call as the tape keeps it (arguments encoded before it runs: an in-place call's input as it was),
        ``{"why": ...}`` when it cannot be kept, ``None`` when it cannot be named and will show as unkeepable only
        if it returns a tensor."""
        from . import allowlist

        try:
            enc_args = _encode(list(args), self.tensors, self.keys, {}, None, self.prefix)
            enc_kwargs = _encode(dict(kwargs), self.tensors, self.keys, {}, None, self.prefix)
        except _Unsaved as exc:
            return {"why": f"{exc} cannot be saved"}
        for t in tensors_of(list(args)) + tensors_of(dict(kwargs)):
            if self.keys.get(id(t), "").startswith(self.prefix) and t.requires_grad:
                return {"why": "a tensor reached a call by a way the tape cannot follow (its gradient would be lost)"}
            self._held.append(t)
        entry: dict = {"args": enc_args, "kwargs": enc_kwargs}
        owner = getattr(func, "__self__", None)
        if getattr(func, "__name__", None) == "__get__" and getattr(owner, "__objclass__", None) is \
                torch._C.TensorBase:
            prop = getattr(owner, "__name__", "")
            if prop not in PROPERTIES:
                return {"why": f"reads the tensor property {prop}, which a reproduction does not replay"}
            entry["property"] = prop
            return entry
        try:
            info = self.name_of(func, args) if self.name_of is not None else None
        except TypeError:  # an unhashable callable
            info = None
        if info is None:
            return {"why": f"calls {getattr(func, '__qualname__', None) or func!r}, which is not a torch API"}
        prefix, api, name = info
        if (prefix, api) != _SETITEM and allowlist.lookup(prefix, api) is not func:
            return {"why": f"calls {prefix}.{api}, which is not on the replay allowlist"}
        entry["function"] = {"prefix": prefix, "api": api}
        if name is not None:
            entry["counted"] = name
        return entry


def _resolve(entry: Any, where: str):
    """The callable of a tape entry (or the property name), checked against the allowlist."""
    from . import allowlist

    if not isinstance(entry, dict) or not isinstance(entry.get("args"), list) or \
            not isinstance(entry.get("kwargs"), dict):
        raise MsprobeError(f"{where}: expected a call with 'args' (a list) and 'kwargs' (a mapping)")
    if "property" in entry:
        if entry["property"] not in PROPERTIES:
            raise MsprobeError(f"{where}: field 'property': expected one of {', '.join(sorted(PROPERTIES))}")
        return None
    fn = entry.get("function")
    if not isinstance(fn, dict):
        raise MsprobeError(f"{where}: field 'function': expected {{prefix, api}}")
    key = (str(fn.get("prefix")), str(fn.get("api")))
    func = torch.Tensor.__setitem__ if key == _SETITEM else allowlist.lookup(*key)
    if func is None:
        raise MsprobeError(f"{where}: field 'function': {key[0]}.{key[1]} is not on the replay allowlist")
    name, index = entry.get("name"), entry.get("index")
    if name is not None and not (isinstance(name, str) and isinstance(index, int) and index >= 0):
        raise MsprobeError(f"{where}: fields 'name', 'index': expected an API name and a call index")
    return func


def replay(tape: dict, env: dict, first: dict | None = None, faults=(), where: str = "tape") -> Any:
    """Run a tape's calls in order; their outputs named into ``env`` (which holds its inputs, state and constants
    by key) as they come. ``faults`` (:class:`~msprobe_ci.capture.inject.Fault`) are applied as the gate applied
    them: to the output of the call whose dump name and call index (``first[name]`` + its index) match, forward;
    to the gradients its kernel's node hands back, backward.

    Returns:
        the module's output, decoded from the tape's ``output``.

    Raises:
        MsprobeError: a malformed tape (naming ``where`` and the call), a function off the allowlist.
    """
    first = first or {}
    for i, entry in enumerate(tape["calls"]):
        at = f"{where}, call {i}"
        func = _resolve(entry, at)
        args, kwargs = _decode(entry["args"], env, at), _decode(entry["kwargs"], env, at)
        if func is None:
            if len(args) != 1 or not isinstance(args[0], torch.Tensor) or kwargs:
                raise MsprobeError(f"{at}: a property reads one tensor")
            out = getattr(args[0], entry["property"])
        else:
            out = func(*args, **kwargs)
        name = entry.get("name")
        if faults and name is not None and name in first:
            n = int(first[name]) + entry["index"]
            out = _faulted(out, [f for f in faults if f.matches(name, n, "forward")],
                           [f for f in faults if f.matches(name, n, "backward")], n, args, kwargs)
        for j, t in enumerate(tensors_of(out)):
            env[f"v{i}.{j}"] = t
    return _decode(tape["output"], env, f"{where}, output")


def _faulted(out: Any, forward: list, backward: list, n: int, args: tuple, kwargs: dict) -> Any:
    """``out`` with its forward faults applied, its kernel's node hooked to apply the backward ones (as the
    capture's fault observer does: :class:`msprobe_ci.capture.observers.FaultObserver`)."""
    from ..kernels.choice import first_grad_fn, is_input_node

    if backward and torch.is_grad_enabled():
        node = first_grad_fn(out)
        if node is not None and not is_input_node(node, args, kwargs):
            def hook(grad_inputs, _grad_outputs):
                new = tuple(grad_inputs)
                for f in backward:
                    new = f.apply(new, n)
                return new
            node.register_hook(hook)
    for f in forward:
        out = f.apply(out, n)
    return out


class TapeModule(torch.nn.Module):
    """A module rebuilt from its tapes: its parameters and buffers (in the order the gate's module listed them,
    as ``p<i>`` / ``b<i>``), a forward that replays the tape recorded in the precision and on the devices it is
    called with. What :class:`~msprobe_ci.isolate.modules.ModuleIsolation` isolates in a reproduction, as it
    isolated the user's module in the gate.

    Args:
        spec: the reproduction's ``module`` field: ``state`` (``[{name, key, parameter, requires_grad}]``),
            ``tapes`` (``[{signature, calls, output}]``).
        args, kwargs: the encoded inputs (the spec's ``args`` and ``kwargs``).
        tensors: the saved tensors, placed.
        where: the spec's file, for messages.

    Raises:
        MsprobeError: a malformed field, naming it.
    """

    def __init__(self, spec: dict, args: list, kwargs: dict, tensors: dict, where: str):
        super().__init__()
        state, tapes = spec.get("state"), spec.get("tapes")
        if not isinstance(state, list) or not isinstance(tapes, list) or not tapes:
            raise MsprobeError(f"{where}: field 'module': expected 'state' (a list) and 'tapes' (a list of tapes)")
        self._state: list[tuple[str, str]] = []
        for i, s in enumerate(state):
            key = s.get("key") if isinstance(s, dict) else None
            if key not in tensors or not isinstance(s.get("name"), str):
                raise MsprobeError(f"{where}: field 'module.state[{i}]': expected a name and a saved tensor's key")
            if s.get("parameter"):
                self.register_parameter(f"p{i}", torch.nn.Parameter(tensors[key],
                                                                    requires_grad=bool(s.get("requires_grad"))))
                self._state.append((f"state.{s['name']}", f"p{i}"))
            else:
                self.register_buffer(f"b{i}", tensors[key])
                self._state.append((f"state.{s['name']}", f"b{i}"))
        for i, tape in enumerate(tapes):
            if not isinstance(tape, dict) or not isinstance(tape.get("calls"), list) or "output" not in tape or \
                    not isinstance(tape.get("signature"), list):
                raise MsprobeError(f"{where}: field 'module.tapes[{i}]': expected a signature, calls and an output")
            for j, entry in enumerate(tape["calls"]):
                _resolve(entry, f"{where}: field 'module.tapes[{i}].calls[{j}]'")
        self.tapes, self.where = tapes, where
        self.encoded = (args, kwargs)
        self.constants = {k: t for k, t in tensors.items() if k.startswith("c")}
        first = spec.get("first") or {}
        if not isinstance(first, dict) or not all(isinstance(v, int) for v in first.values()):
            raise MsprobeError(f"{where}: field 'module.first': expected {{API name: call index}}")
        self.first = first
        self.faults: tuple = ()  # set for the target's run only

    def forward(self, *args, **kwargs):
        env = dict(self.constants)
        state = [getattr(self, attr) for _, attr in self._state]
        env.update({key: t for (key, _), t in zip(self._state, state)})
        bind(self.encoded[0], list(args), env)
        bind(self.encoded[1], kwargs, env)
        sig = signature(state, list(args), kwargs)
        for i, tape in enumerate(self.tapes):
            if tape["signature"] == sig:
                return replay(tape, env, self.first, self.faults, f"{self.where}: tape {i}")
        raise MsprobeError(f"{self.where}: no tape recorded for inputs and state in {sig[:4]}...: the reproduction "
                           "runs in the precisions and on the devices the gate ran")
