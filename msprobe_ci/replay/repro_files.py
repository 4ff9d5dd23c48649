"""A reproduction's files, as both writers write them (capture's :class:`~msprobe_ci.capture.repro.Reproducer` for
a failing isolated call, :mod:`msprobe_ci.replay.repro` for a failing replayed one) and :mod:`msprobe_ci.repro`
reads them: the limits per step folder, the format version, the CUDA settings restored, how an argument is encoded
(tensors into safetensors, everything else as plain data) and the script beside them."""

from __future__ import annotations

import math
from typing import Any

import torch

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


def _encode(v: Any, tensors: dict, keys: dict, grads: dict, layouts: dict | None = None) -> Any:
    """``v`` as JSON, each tensor replaced by ``{"tensor": key}`` (the same tensor, the same key); a tensor that is
    not contiguous has its layout in ``layouts``."""
    if isinstance(v, torch.Tensor):
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            raise _Unsaved(f"a {type(v).__name__} argument")
        key = keys.get(id(v))
        if key is None:
            key = keys[id(v)] = f"t{len(keys)}"
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
        return {"slice": [_encode(x, tensors, keys, grads, layouts) for x in (v.start, v.stop, v.step)]}
    if v is Ellipsis:
        return {"ellipsis": True}
    if isinstance(v, list):
        return [_encode(x, tensors, keys, grads, layouts) for x in v]
    if isinstance(v, tuple) and not hasattr(v, "_fields"):
        return {"tuple": [_encode(x, tensors, keys, grads, layouts) for x in v]}
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"dict": {k: _encode(x, tensors, keys, grads, layouts) for k, x in v.items()}}
    raise _Unsaved(f"a {type(v).__name__} argument")


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
