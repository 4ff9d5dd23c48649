"""An API's output flattened into rows, msprobe's row naming: the pairs the judge takes one at a time."""

from __future__ import annotations

from typing import Any


def outputs(value: Any, stem: str) -> list[tuple[str, Any]]:
    """Flatten an API output into ``(row name, tensor or scalar)`` pairs, msprobe's row naming.

    Args:
        value: a tensor, a scalar, or nested lists/tuples of them.
        stem: the row prefix, e.g. ``Functional.linear.0.forward.output``.

    Returns:
        ``[(f"{stem}.0", value)]`` for a single value; ``[(f"{stem}.{i}", v), ...]`` for a sequence, nested
        sequences as ``{stem}.{i}.{j}``.
    """
    if isinstance(value, (list, tuple)):
        out = []
        for i, v in enumerate(value):
            out += outputs(v, f"{stem}.{i}") if isinstance(v, (list, tuple)) else [(f"{stem}.{i}", v)]
        return out
    return [(f"{stem}.0", value)]
