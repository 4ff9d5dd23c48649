"""A reproduction's files, as both writers write them (capture's :class:`~msprobe_ci.capture.repro.Reproducer` for
a failing isolated call, :mod:`msprobe_ci.replay.repro` for a failing replayed one) and :mod:`msprobe_ci.repro`
reads them: the limits per step folder, the format version, the CUDA settings restored, how an argument is encoded
(tensors into safetensors, everything else as plain data) and the script beside them."""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ..errors import MsprobeError

#: reproductions written per step folder at most (a model broken everywhere would otherwise write one per call)
MAX_FILES = 32
#: bytes of saved inputs per step folder at most (GPT-2's LM-head weight alone is 154 MB in fp32)
MAX_BYTES = 1 << 30
#: the spec's format version
VERSION = 1

#: the CUDA GEMM settings a reproduction restores (:func:`msprobe_ci.kernels.reduced_precision_reduction`)
CUDA_MATMUL = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")




class _Unsaved(Exception):
    """An argument the spec cannot hold (the reason is the message)."""


class _Unwritten(Exception):
    """A reproduction that cannot be written (the reason is the message)."""


# ------------------------------------------------------------------------------------------------ encoding
def _saved(t: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
    """A CPU copy of ``t`` to save, and its layout where it is not contiguous: the storage range it spans, copied
    as one flat tensor, with the sizes and strides that view it (a transposed, expanded or sliced argument runs the
    same kernel path as in the gate: a contiguous copy of a broadcast gradient reduced in another order)."""
    t = t.detach()
    if t.is_contiguous() or t.numel() == 0:
        return t.to("cpu", copy=True).contiguous(), None
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    flat = t.as_strided((span,), (1,), t.storage_offset()).to("cpu", copy=True)
    return flat, {"size": list(t.shape), "stride": list(t.stride())}


def _encode(v: Any, tensors: dict, keys: dict, grads: dict, layouts: dict | None = None, prefix: str = "t",
            opaque: bool = False) -> Any:
    """``v`` as JSON, each tensor replaced by ``{"tensor": key}`` (the same tensor, the same key; a new key is
    ``prefix`` and a number); a tensor that is not contiguous has its layout in ``layouts``. ``opaque``: an object
    the spec cannot hold becomes ``{"opaque": its type's name}`` (read back as ``None``: a module's tape already
    holds the calls it made on its tensors, :mod:`msprobe_ci.replay.tape`) instead of raising."""
    if isinstance(v, torch.Tensor):
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            raise _Unsaved(f"a {type(v).__name__} argument")
        key = keys.get(id(v))
        if key is None:
            key = keys[id(v)] = f"{prefix}{len(keys)}"
            tensors[key], layout = _saved(v)
            if layout is not None and layouts is not None:
                layouts[key] = layout
            grads[key] = bool(v.requires_grad)
        return {"tensor": key}
    if v is None or isinstance(v, (bool, str)) or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).replace("torch.", "")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).replace("torch.", "")}
    if isinstance(v, torch.layout):
        return {"layout": str(v).replace("torch.", "")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.Size):
        return {"size": list(v)}
    if isinstance(v, slice):
        return {"slice": [_encode(x, tensors, keys, grads, layouts, prefix, opaque) for x in (v.start, v.stop, v.step)]}
    if v is Ellipsis:
        return {"ellipsis": True}
    if isinstance(v, list):
        return [_encode(x, tensors, keys, grads, layouts, prefix, opaque) for x in v]
    if isinstance(v, tuple) and not hasattr(v, "_fields"):
        return {"tuple": [_encode(x, tensors, keys, grads, layouts, prefix, opaque) for x in v]}
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"dict": {k: _encode(x, tensors, keys, grads, layouts, prefix, opaque) for k, x in v.items()}}
    if opaque and not isinstance(v, torch.Tensor):
        return {"opaque": type(v).__name__}
    raise _Unsaved(f"a {type(v).__name__} argument")


# ------------------------------------------------------------------------------------------------ decoding
_DTYPES = {str(d).replace("torch.", ""): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_FORMATS = {str(f).replace("torch.", ""): f for f in vars(torch).values() if isinstance(f, torch.memory_format)}
_LAYOUTS = {str(f).replace("torch.", ""): f for f in vars(torch).values() if isinstance(f, torch.layout)}


def _decode(v: Any, tensors: dict, where: str) -> Any:
    """The inverse of :func:`_encode`, with every tag checked against a closed list (the spec is data)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_decode(x, tensors, where) for x in v]
    if isinstance(v, dict) and len(v) == 1:
        (tag, x), = v.items()
        if tag == "tensor" and isinstance(x, str) and x in tensors:
            return tensors[x]
        if tag == "float" and x in ("inf", "-inf", "nan"):
            return float(x)
        if tag == "dtype" and x in _DTYPES:
            return _DTYPES[x]
        if tag == "memory_format" and x in _FORMATS:
            return _FORMATS[x]
        if tag == "layout" and x in _LAYOUTS:
            return _LAYOUTS[x]
        if tag == "device" and isinstance(x, str):
            return torch.device(x)
        if tag == "size" and isinstance(x, list) and all(isinstance(i, int) for i in x):
            return torch.Size(x)
        if tag == "slice" and isinstance(x, list) and len(x) == 3:
            return slice(*(_decode(i, tensors, where) for i in x))
        if tag == "ellipsis" and x is True:
            return Ellipsis
        if tag == "opaque" and isinstance(x, str):
            return None
        if tag == "tuple" and isinstance(x, list):
            return tuple(_decode(i, tensors, where) for i in x)
        if tag == "dict" and isinstance(x, dict):
            return {str(k): _decode(i, tensors, where) for k, i in x.items()}
    raise MsprobeError(f"{where}: unexpected argument encoding {json.dumps(v)[:80]}")



def _placed(tensors: dict, spec: dict, device: str | None, where: str) -> dict:
    """The saved tensors on ``device`` (``None``: where they are), each argument that was not contiguous viewed
    again with its layout (the spec's ``layouts``)."""
    moved = {k: t.to(device) for k, t in tensors.items()} if device is not None else dict(tensors)
    layouts = spec.get("layouts") or {}
    if not isinstance(layouts, dict):
        raise MsprobeError(f"{where}: field 'layouts': expected a mapping")
    for key, layout in layouts.items():
        moved[key] = _viewed(moved.get(key), layout, f"{where}: field 'layouts.{key}'")
    return moved


def _viewed(base: torch.Tensor | None, layout: Any, where: str) -> torch.Tensor:
    """The saved flat range ``base`` viewed with the layout the argument had (:func:`_saved`), after checking that
    the layout stays inside it."""
    size, stride = (layout.get("size"), layout.get("stride")) if isinstance(layout, dict) else (None, None)
    if base is None or base.dim() != 1 or not isinstance(size, list) or not isinstance(stride, list) or \
            len(size) != len(stride) or not all(isinstance(x, int) and x >= 0 for x in size + stride):
        raise MsprobeError(f"{where}: expected sizes and strides of a saved flat tensor")
    if any(n == 0 for n in size):
        return base[:0].reshape(size)
    if 1 + sum((n - 1) * st for n, st in zip(size, stride)) > base.numel():
        raise MsprobeError(f"{where}: the layout reaches past the saved tensor ({base.numel()} elements)")
    return base.as_strided(size, stride, 0).detach()



# ------------------------------------------------------------------------------------------------ writing


_SCRIPT = '''"""msprobe-ci: reproduce one failing API call without the model.

Node: {node}
Gate: {gate}

Run:  python {name}.py [--no-fault] [--target-device DEVICE]
Inputs in {name}.safetensors, settings in {name}.json. Exits 1 when the call fails its standard, 0 when it passes.
"""

import sys

from msprobe_ci.repro import main

if __name__ == "__main__":
    sys.exit(main([__file__, *sys.argv[1:]]))
'''
