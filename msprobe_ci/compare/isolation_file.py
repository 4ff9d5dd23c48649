"""A dump's ``isolation.json`` (written by capture with an :class:`~msprobe_ci.isolate.Isolator`): its node records
(:func:`load_isolation`) and its budgeted isolation's figures (:func:`load_budget`, :func:`describe_budget`)."""

from __future__ import annotations

import json
import os

from ..errors import MsprobeError

ISOLATION_FILE = "isolation.json"


def load_isolation(folder: str) -> dict | None:
    """``{node: record}`` from ``folder/isolation.json``, or ``None`` when the dump has none.

    Raises:
        MsprobeError: the file exists but is not an isolation record.
    """
    path = os.path.join(folder, ISOLATION_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise MsprobeError(f"{path}: not readable JSON ({exc})") from None
    nodes = raw.get("nodes") if isinstance(raw, dict) else None
    if not isinstance(nodes, dict) or not all(isinstance(v, dict) for v in nodes.values()):
        raise MsprobeError(f"{path}: expected {{'nodes': {{name: record}}}}")
    return nodes


def load_budget(folder: str) -> dict | None:
    """The budgeted isolation's figures of the step in ``folder/isolation.json`` (its ``budget`` block,
    :meth:`msprobe_ci.isolate.budget.IsolationBudget.summary`), read without the nodes that follow it; ``None``
    where there is no file, no block, or the block is not a mapping."""
    import ijson

    path = os.path.join(folder, ISOLATION_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            block = next(ijson.items(fh, "budget", use_float=True), None)
    except (OSError, ijson.JSONError):
        return None
    return block if isinstance(block, dict) else None


def describe_budget(budget: dict) -> str:
    """One line for a step's budget figures (:func:`load_budget`): what was judged on its own inputs, what by the
    drift rule, and what the isolation cost."""
    calls, judged = int(budget.get("calls") or 0), int(budget.get("judged") or 0)
    share = judged / calls if calls else 1.0
    measured = budget.get("measured_factor")
    cost = ""
    if isinstance(measured, (int, float)):
        cost = f"; isolation cost {measured:.2f}x the capture alone"
        factor = budget.get("factor")
        if isinstance(factor, (int, float)) and measured > factor and judged <= int(budget.get("kinds") or 0):
            cost += " (above the factor asked: judging every API kind once a step costs that much here)"
        elif isinstance(factor, (int, float)) and measured > factor:
            cost += " (above the factor asked: the step's time is measured as it goes; the next step's share adapts)"
    return (f"budgeted isolation (factor {budget.get('factor')}): {judged} of {calls} API calls judged on their own "
            f"inputs ({share:.0%}: the first of each of {budget.get('kinds')} API kinds, the rest rotating over steps, "
            f"seed {budget.get('seed')!r}); the other {calls - judged} judged by the drift rule{cost}")
