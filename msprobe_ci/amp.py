"""Automatic mixed precision (``torch.autocast``): what a kernel saw under it, for every place a call is judged.

Under ``torch.autocast(device_type, dtype)`` a torch API is called with the model's fp32 tensors, and autocast casts
them below the API (in the dispatcher, where no ``TorchFunctionMode`` sees it) by the op's cast policy: to the
autocast dtype for the lower-precision ops (GEMMs, convolutions, attention), to float32 for the fp32 ops (softmax,
norms, losses on CUDA), to the widest input dtype for the promote ops (``cat``, ``stack``, ``addcmul``). In every
policy the floating inputs reach the kernel in the dtype the op then computes and returns: its output's floating
dtype. That is the rule here (:func:`kernel_inputs`), the same inference msprobe's api_accuracy_checker makes from
dtypes (fp32 inputs with a bf16/fp16 output, or mixed input dtypes) — read off the call's own output, not a table
of ops that differs between devices and torch versions. float64 tensors are never cast by autocast (its
eligibility rule), and an in-place or ``out=`` call is not autocast at all.

A judge that hands the oracle the fp32 inputs instead measures the autocast cast itself as the kernel's error: a
stock GPT-2 under bf16 autocast failed 42 of its calls against itself (issue 48).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

#: the dump field (per API entry) holding the autocast dtype a call ran under; msprobe's tools ignore it
FIELD = "autocast"


def _floating(value: Any) -> list[torch.Tensor]:
    from .kernels import tensors_of

    return [t for t in tensors_of(value) if t.is_floating_point()]


def _any_enabled() -> bool:
    """Whether autocast is on for any device type in this thread (torch's own flag; True where it is missing, so
    the per-device check below decides)."""
    flag = getattr(torch._C, "_is_any_autocast_enabled", None)
    return True if flag is None else bool(flag())


def autocast_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The autocast dtype a call with these arguments runs under: ``None`` unless autocast is enabled for the
    device type of its first floating tensor and one of its floating tensors is one autocast may cast (any
    floating dtype but float64)."""
    if not _any_enabled():  # the common case, paid once per captured call: 0.5 us instead of a walk (17 us)
        return None
    tensors = _floating(args) + _floating(kwargs)
    if not tensors or all(t.dtype == torch.float64 for t in tensors):
        return None
    device_type = tensors[0].device.type
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
        return None


def output_dtype(out: Any) -> torch.dtype | None:
    """The floating dtype of a call's first floating output, ``None`` where it has none."""
    found = _floating(out)
    return found[0].dtype if found else None


def kernel_inputs(args: tuple, kwargs: dict, out: Any) -> tuple[tuple, dict, torch.dtype | None]:
    """The arguments as the kernel saw them under autocast: every floating tensor but float64 cast to the dtype of
    the call's floating output (exact for the fp32 and promote policies, autocast's own rounding for the
    lower-precision one). The casts are new leaf tensors that keep ``requires_grad``, detached from the user's
    graph.

    Returns:
        ``(args, kwargs, dtype)``: ``dtype`` is the output's floating dtype (``None``: nothing cast, the
        arguments returned as they are).
    """
    from .kernels import cast

    seen = output_dtype(out)
    if seen is None:
        return args, kwargs, None

    def conv(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype in (seen, torch.float64):
            return t
        return t.detach().to(seen).requires_grad_(t.requires_grad)
    return cast(tuple(args), conv), {k: cast(v, conv) for k, v in kwargs.items()}, seen


def scalar_reading(func, own: tuple, cast: tuple, out: Any) -> tuple:
    """Which arguments a kernel under autocast read: ``cast`` (:func:`kernel_inputs`' ``(args, kwargs)``), or
    ``own``, the call's own ``(args, kwargs)`` with only its 0-d floating tensors left at their own precision,
    whichever gives the target's output ``out`` more nearly when run in float64.

    A 0-d tensor of a wider dtype (a learned ``logit_scale.exp()`` in fp32 times a bf16 activation) does not set
    the output's dtype, and kernels differ in what they read of it: measured on torch 2.13's CPU, ``mul`` and
    ``div`` by it use its fp32 value (the output is the exact product rounded once, 100% of the elements), while
    ``add``, ``sub``, ``pow``, ``atan2``, ``hypot`` and ``addcmul`` use it cast to the tensor's dtype (100%; the
    other reading 10-77%). Either is a correct kernel; judged against the cast value, CLIP's ``logits * logit_scale``
    under bf16 autocast failed the absolute-threshold standard (relative error 0.41% > 2^-8: the scale's own
    rounding, 0.24%, and the output's). Returns ``cast`` where no 0-d operand loses digits in the cast, or where
    the float64 runs fail; the runs are made only for a call with such an operand."""
    from .kernels import cast as cast_all, tensors_of

    casts = [t for t in tensors_of(cast[0]) + tensors_of(cast[1]) if t.is_floating_point()]
    owns = [t for t in tensors_of(own[0]) + tensors_of(own[1]) if t.is_floating_point()]
    if len(casts) != len(owns) or not any(o.dim() == 0 and o.dtype != c.dtype and bool(o.detach() != c.detach())
                                          for o, c in zip(owns, casts)):
        return cast
    pairs = {id(c): o for o, c in zip(owns, casts)}

    def keep(t: torch.Tensor) -> torch.Tensor:  # a 0-d operand at its own precision, the rest as the cast
        o = pairs.get(id(t))
        return o.detach().requires_grad_(t.requires_grad) if o is not None and o.dim() == 0 else t
    kept = (cast_all(tuple(cast[0]), keep), {k: cast_all(v, keep) for k, v in cast[1].items()})
    targets = _floating(out)

    def miss(arguments: tuple) -> float:
        def wide(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", torch.float64) if t.is_floating_point() else t.detach()
        with torch.no_grad(), disabled(arguments):
            got = _floating(func(*cast_all(tuple(arguments[0]), wide),
                                 **{k: cast_all(v, wide) for k, v in arguments[1].items()}))
        if len(got) != len(targets):
            raise ValueError("outputs differ")
        return sum(float((g - t.detach().to("cpu", torch.float64)).abs().nan_to_num().sum())
                   for g, t in zip(got, targets) if g.shape == t.shape)
    try:
        return kept if miss(kept) < miss(cast) else cast
    except Exception:  # noqa: BLE001 - no float64 run of this call: the cast reading, as before
        return cast


def cast_inputs(args: Any, kwargs: dict, dtype: torch.dtype) -> tuple[Any, dict]:
    """``args``/``kwargs`` with every floating tensor but float64 cast to ``dtype`` (detached): a replayed call
    made under autocast, as its kernel saw its inputs."""
    from .kernels import cast

    def conv(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype) if t.is_floating_point() and t.dtype not in (dtype, torch.float64) else t
    return cast(args, conv), {k: cast(v, conv) for k, v in kwargs.items()}


def of_entry(entry: dict) -> tuple[torch.dtype | None, str]:
    """The dtype a dumped forward call's kernel computed in under autocast, and how that is known: ``recorded``
    (our dumps' :data:`FIELD` says autocast was on: the dtype is then its floating output's, as
    :func:`kernel_inputs` reads it live), ``inferred`` (a dump made elsewhere: :func:`infer` on its dtypes), or
    ``(None, "")`` where it did not run under autocast. A dump is data: its strings pick rows of our own dtype
    table (:mod:`msprobe_ci.dtypes`), nothing else."""
    from .dtypes import lookup

    def dtypes(recs: Any) -> list[str]:
        out: list[str] = []
        if isinstance(recs, dict) and isinstance(recs.get("dtype"), str):
            return [recs["dtype"]]
        if isinstance(recs, dict):
            recs = list(recs.values())
        if isinstance(recs, list):
            for r in recs:
                out += dtypes(r)
        return out

    def floating(names: list[str]) -> list[str]:
        return [d.dump for d in map(lookup, names) if d is not None and d.short in ("fp64", "fp32", "fp16", "bf16")]
    ins = floating(dtypes([entry.get("input_args"), entry.get("input_kwargs")]))
    outs = floating(dtypes(entry.get("output")))
    if isinstance(entry.get(FIELD), str):
        if not outs or outs[0] == "torch.float64":
            return None, ""
        return lookup(outs[0]).torch, "recorded"
    guess = infer(ins, outs)
    if guess is None:
        return None, ""
    return lookup(guess).torch, "inferred"


def grad_dtype(user: torch.dtype, kernel: torch.dtype) -> torch.dtype:
    """The dtype a gradient w.r.t. a tensor the user passed in ``user`` is as precise as, when its kernel computed
    in ``kernel``: the narrower of the two (autocast's cast hands a kernel's gradient back in the user's dtype, so
    a bf16 kernel's gradient of an fp32 weight holds bf16 values, and an fp32 kernel's of a bf16 input is rounded
    to bf16); the kernel's where both are as wide (bf16 and fp16)."""
    return user if user.itemsize < kernel.itemsize else kernel


def infer(input_dtypes: list[str], output_dtypes: list[str]) -> str | None:
    """For a dump made elsewhere (no :data:`FIELD`): the dtype the call computed in when its dtypes say it ran
    under autocast as msprobe infers it: float32 inputs with a bf16/fp16 floating output. ``None`` otherwise.

    Args:
        input_dtypes, output_dtypes: the dump's ``dtype`` strings (``torch.float32`` ...) of the call's floating
            inputs and outputs.
    """
    low = ("torch.bfloat16", "torch.float16")
    outs = [d for d in output_dtypes if d in low]
    if outs and "torch.float32" in input_dtypes and all(d in ("torch.float32", *low) for d in input_dtypes):
        return outs[0]
    return None


@contextlib.contextmanager
def disabled(values: Any) -> Iterator[None]:
    """Autocast off for the device types of ``values``' tensors (and the CPU): a reference or bench computation
    runs on inputs already cast as the kernel saw them, in exactly their dtypes."""
    from .kernels import tensors_of

    kinds = {"cpu"} | {t.device.type for t in tensors_of(values)}
    with contextlib.ExitStack() as stack:
        for kind in sorted(kinds):
            try:
                stack.enter_context(torch.autocast(kind, enabled=False))
            except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
                continue
        yield
