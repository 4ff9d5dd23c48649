"""The MindSpore -> PyTorch name table (data, not code): which PyTorch API a MindSpore dump's API is, by prefix
(``Mint.*`` -> ``Torch.*``) or by row (``Primitive.dense.Dense`` -> ``Functional.linear``, with its argument
positions and forward outputs), and the parameter renames (``gamma``/``beta`` -> ``weight``/``bias``).

The compare reads it to pair a MindSpore dump with a PyTorch one (:mod:`msprobe_ci.compare.crossframe`); the
offline replay reads it to replay a MindSpore API through its PyTorch twin (:mod:`msprobe_ci.replay`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mindspore_to_pytorch.yaml")


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    """The packaged MindSpore → PyTorch table (``prefixes``, ``apis``, ``parameters``)."""
    import yaml  # imported where a YAML file is read: a PyTorch compare without mapping files never loads it

    with open(_TABLE, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    return {"prefixes": dict(doc.get("prefixes") or {}), "apis": dict(doc.get("apis") or {}),
            "parameters": dict(doc.get("parameters") or {}), "fused": list(doc.get("fused") or [])}


def torch_api(prefix: str, api: str, extra: dict[str, str] | None = None) -> tuple[str | None, dict]:
    """``(PyTorch API base, table row)`` of a MindSpore API (``Primitive``, ``dense.Dense``), or ``(None, {})``."""
    base = f"{prefix}.{api}"
    if extra and base in extra:
        return extra[base], {}
    row = table()["apis"].get(base)
    if row:
        return str(row["torch"]), row
    pt_prefix = table()["prefixes"].get(prefix)
    if pt_prefix and "." not in api:
        return f"{pt_prefix}.{api}", {}
    return None, {}
