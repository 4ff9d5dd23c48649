"""Provenance: which tensors the run produced, and where each source (a parameter, buffer or model input) was
first consumed."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..kernels import tensors_of as _tensors


class Provenance:
    """Tracks the tensors torch calls produced (by id, weakly) and names every other tensor input a *source*,
    judged against the bench dump at compare time (:mod:`msprobe_ci.compare.isolated`). One step's worth: the
    isolator resets it with each step."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """A new step: no tensor produced yet, no source named."""
        self._produced: dict[int, weakref.ref] = {}
        self._sources: dict[int, tuple[weakref.ref, str]] = {}

    def _seen(self, table: dict, t: torch.Tensor):
        hit = table.get(id(t))
        if hit is None:
            return None
        ref = hit[0] if isinstance(hit, tuple) else hit
        return hit if ref() is t else None

    def is_produced(self, t: torch.Tensor) -> bool:
        return self._seen(self._produced, t) is not None

    def mark_produced(self, value: Any) -> None:
        """Tensors in ``value`` were computed by captured code (an API or a module): not sources."""
        for t in _tensors(value):
            try:
                self._produced[id(t)] = weakref.ref(t)
            except TypeError:
                pass

    def alias(self, new: torch.Tensor, old: torch.Tensor) -> None:
        """``new`` holds ``old``'s values (a module hook's copy of an input or output): the same provenance, a
        computed tensor or the same source."""
        if self.is_produced(old):
            self.mark_produced(new)
            return
        try:
            self._sources[id(new)] = (weakref.ref(new), self.source_id(old))
        except TypeError:
            pass

    def propagate(self, args: tuple, kwargs: dict, out: Any) -> None:
        """For calls that are not judged (views, indexing, dtype casts, factories): their outputs are computed,
        not sources. Sources are what enters from outside: parameters, buffers, the model's inputs."""
        if isinstance(out, (torch.Tensor, list, tuple)):
            self.mark_produced(out)

    def source_id(self, t: torch.Tensor) -> str:
        """The source id (``S<n>``) of ``t``, named on first sight."""
        hit = self._seen(self._sources, t)
        if hit is not None:
            return hit[1]
        sid = f"S{len(self._sources)}"
        self._sources[id(t)] = (weakref.ref(t), sid)
        return sid

    def source_rows(self, name: str, short: str, args: tuple, kwargs: dict) -> dict[str, dict]:
        """``{row: {"id", "kind"}}`` of node ``name``'s inputs that are sources (``kind`` ``parameter``,
        ``tensor``) or scalars (``kind`` ``scalar``, the value in the id), by msprobe's input row names."""
        rows: dict[str, dict] = {}

        def visit(v: Any, row: str, key: str) -> None:
            if isinstance(v, torch.Tensor):
                if not self.is_produced(v):
                    kind = "parameter" if isinstance(v, torch.nn.Parameter) else "tensor"
                    rows[row] = {"id": self.source_id(v), "kind": kind}
            elif isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
                for j, x in enumerate(v):
                    visit(x, f"{row}.{j}", f"{key}.{j}")
            elif isinstance(v, (bool, int, float)) or v is None:
                rows[row] = {"id": f"scalar:{short}:{key}:{v!r}", "kind": "scalar"}
        for i, a in enumerate(args):
            visit(a, f"{name}.input.{i}", str(i))
        for k, v in kwargs.items():
            if k not in ("out", "dtype", "device", "layout", "memory_format"):
                visit(v, f"{name}.input.{k}", k)
        return rows
