"""Shared pieces of the standards: dtype names, threshold data, array conversion, masks."""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

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
    """A tensor, array or scalar as a float64 NumPy array (bf16/fp8 through float32; complex kept)."""
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.is_complex():
            return x.resolve_conj().numpy().astype(np.complex128)
        if not x.is_floating_point():  # integers and bool
            return x.numpy().astype(np.float64)
        return x.to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def finite_masks(target: np.ndarray, bench: np.ndarray, small_value: float) -> tuple[np.ndarray, ...]:
    """``(finite, inf_nan, small, normal)`` masks: small = finite and ``|bench| <= small_value``."""
    finite = np.isfinite(target) & np.isfinite(bench)
    small = finite & (np.abs(bench) <= small_value)
    return finite, ~finite, small, finite & ~small


def ratio(mask: np.ndarray, of: np.ndarray) -> float:
    n = int(of.sum())
    return float((mask & of).sum() / n) if n else 0.0
