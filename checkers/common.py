"""Shared pieces of the standards: dtype names, threshold data, array conversion, masks."""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from .._perf import takes_device_paths
from ..dtypes import checker_key
from ..errors import MsprobeError  # type: ignore[misc]

DATA = os.path.join(os.path.dirname(__file__), "data")
FLOAT_KEYS = ("fp16", "bf16", "fp32", "fp64", "fp8_e4m3", "fp8_e5m2")


def dtype_key(dtype: Any) -> str:
    """``fp16``/``bf16``/``fp32``/``fp64``/``fp8_e4m3``/``fp8_e5m2`` for floating dtypes (torch dtype or its
    string, MindSpore's too: :mod:`msprobe_ci.dtypes`), ``bool``, ``complex`` or ``int`` otherwise."""
    return checker_key(dtype)


@functools.lru_cache(maxsize=None)
def load_yaml(name: str) -> dict:
    """A data file of this package, read with ``yaml.safe_load``."""
    import yaml

    path = os.path.join(DATA, name)
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    if not isinstance(data, dict):
        raise MsprobeError(f"{path}: expected a mapping")
    return data


def dtype_thresholds(key: str, overrides: dict | None = None) -> dict[str, float]:
    """Thresholds for a dtype key (fp32's for non-float keys), with ``overrides`` applied.

    Raises:
        MsprobeError: an override names a threshold that does not exist.
    """
    table = load_yaml("thresholds.yaml")
    base = dict(table.get(key if key in FLOAT_KEYS else "fp32"))
    for k, v in (overrides or {}).items():
        if k not in base:
            raise MsprobeError(f"threshold override {k!r}: unknown; known: {sorted(base)}")
        base[k] = float(v)
    return base


def to_f64(x: Any) -> np.ndarray:
    """A tensor, array or scalar as a float64 NumPy array on the host (complex128 for complex values): :func:`f64`
    for the standards that judge in NumPy (accumulative, thousandth, legacy, dropout)."""
    return f64(x, "cpu").resolve_conj().numpy()


SLICE = 1 << 16  # elements per float64 slice on the CPU: 512 KB a tensor, under the 1 MiB heap bound (_perf)
DEVICE_SLICE = 1 << 22  # on an accelerator: 32 MB a tensor, few kernel launches per output


def f64(x: Any, device: Any = None):
    """A tensor, array or scalar as a float64 torch tensor (complex128 for complex values) on ``device`` (the
    tensor's own when ``None``, the CPU for arrays and scalars); bf16/fp16/fp8 and integers are converted
    exactly."""
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach()
        return x.to(device=device, dtype=torch.complex128 if x.is_complex() else torch.float64)
    arr = np.asarray(x)
    return torch.as_tensor(arr, dtype=torch.complex128 if np.iscomplexobj(arr) else torch.float64, device=device)


def f64_slices(target: Any, ref: Any, floor: Any = None):
    """``(target, reference, floor)`` as float64 torch tensors on the target's device (the CPU for arrays), in
    slices of at most :data:`SLICE` elements on the CPU and :data:`DEVICE_SLICE` on an accelerator (and on the CPU
    where it takes an accelerator's paths, :func:`~msprobe_ci._perf.takes_device_paths`), in order,
    for the elementwise standards (ULP, absolute threshold), which judge where the target lies and bring back
    counts and maxima, never the tensors. On the CPU the judgement's memory stays bounded (a whole float64 copy
    of GPT-2's 1024-token logits is 411 MB a side, and a standard makes several) and each slice's passes stay in
    cache; slices of 512 KB are taken from the heap, where larger tensors would each be mapped, faulted in and
    unmapped under the capture's heap bound (7x slower on those logits). A reference of another shape
    (broadcasting) comes whole; a floor of another shape than the target's is left out (``None``), as the
    whole-tensor rules leave it out. ``floor`` None: the third item is None."""
    import torch

    device = target.device if isinstance(target, torch.Tensor) else torch.device("cpu")
    shape = tuple(np.shape(target))
    if tuple(np.shape(ref)) != shape:
        yield f64(target), f64(ref, device), None if floor is None else f64(floor, device)
        return
    t, r = _flat(target), _flat(ref)
    f = _flat(floor) if floor is not None and tuple(np.shape(floor)) == shape else None
    step = DEVICE_SLICE if takes_device_paths(device) else SLICE
    for i in range(0, t.shape[0], step):
        part = slice(i, i + step)
        yield f64(t[part]), f64(r[part], device), None if f is None else f64(f[part], device)


def _flat(x: Any):
    import torch

    return x.detach().reshape(-1) if isinstance(x, torch.Tensor) else np.ravel(x)


def totals(parts: list, n_sums: int, width: int) -> tuple[list, list]:
    """The sums of the first ``n_sums`` and the maxima of the remaining columns over the slices' rows of
    statistics (``parts``: 1-D tensors of ``width`` float64 values, one per slice), brought to the host in one
    transfer: ``([sum, ...], [max, ...])``; zeros when there were no slices. A NaN maximum stays NaN."""
    import torch

    if not parts:
        return [0.0] * n_sums, [0.0] * (width - n_sums)
    if len(parts) == 1:  # one slice (every output on an accelerator up to 4M elements): its row as it is
        row = parts[0].tolist()
    else:
        table = torch.stack(parts)
        row = torch.cat([table[:, :n_sums].sum(0), table[:, n_sums:].amax(0)]).tolist()
    return row[:n_sums], row[n_sums:]


def finite_masks(target, bench, small_value: float) -> tuple:
    """``(finite, small, normal, magnitude)`` of two float tensors: the boolean masks finite (both sides),
    small = finite and ``|bench| <= small_value``, normal = finite and not small, and ``|bench|``; six ATen ops
    (``torch.isfinite`` is four a tensor: ``x - x == 0`` holds both sides' in three)."""
    finite = (target - target) == (bench - bench)  # x - x is +0 for a finite x, NaN for ±inf and NaN
    magnitude = bench.abs()
    small = (magnitude <= small_value) & finite
    return finite, small, finite ^ small, magnitude  # small lies within finite: xor is "and not"


def share(n: int, of: int) -> float:
    """``n / of``, 0.0 when ``of`` is 0 (a ratio over an empty mask: nothing there to fail)."""
    return n / of if of else 0.0
