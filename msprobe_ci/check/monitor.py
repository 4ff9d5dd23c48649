"""The monitor mode: msprobe's ``TrainerMon`` over the test's own training loop, needing no bench, concluded at
the loop's end on its first anomaly."""

from __future__ import annotations

import os
from typing import Any

from .conclude import RESULT, Draft, benchless_row
from .context import CheckContext


def open_monitor(ctx: CheckContext, model: Any, optimizer: Any = None, **options: Any):
    """A :class:`~msprobe_ci.monitor.TrainerMon` on ``model`` (and ``optimizer``) writing into the next check's
    ``monitor`` folder. Returns ``(monitor, folder, index)``.

    Raises:
        MsprobeError: bad monitor options, or the test folder cannot be made ours.
    """
    from ..monitor import TrainerMon

    index, check_dir = ctx.next_check()
    folder = os.path.join(check_dir, "monitor")
    mon = TrainerMon(folder, **options)
    mon.set_monitor(model, optimizer)
    return mon, folder, index


def conclude_monitor(ctx: CheckContext, report, folder: str, index: int):
    """One row (a testcase per monitored step), the monitor's properties, and a failure at the first anomaly
    naming its step, stage and module, with the plot's path."""
    first = report.first
    d = Draft()
    d.properties += [("msprobe.monitor", folder), ("msprobe.monitor_steps", report.steps),
                     ("msprobe.monitor_anomalies", len(report.anomalies))]
    if report.png:
        d.properties.append(("msprobe.monitor_png", report.png))
    by_step: dict[int, list] = {}
    for a in report.anomalies:
        by_step.setdefault(a.step, []).append(a)
    nodes = [{"name": f"step {i}", "status": "error" if i in by_step else "pass", "metric": "anomalies",
              "value": len(by_step.get(i, ())), "threshold": 0, "input_error": "",
              "worst_row": by_step[i][0].name if i in by_step else "",
              "message": by_step[i][0].message if i in by_step else "no anomaly", "standard": "monitor",
              "seconds": 0.0} for i in range(report.steps)]
    errors = sum(n["status"] == "error" for n in nodes)
    losses = ", ".join("nan" if v is None else f"{v:.6g}" for v in report.losses)
    row = benchless_row(
        test=ctx.nodeid, index=index, dir=os.path.dirname(folder), bench="none (monitor)",
        target="this test's loop", level="module", mode="monitor", nodes_compared=report.steps,
        counts={"pass": len(nodes) - errors, "warning": 0, "error": errors, "unmatched": 0},
        first_divergence=f"step{first.step} {first.name}" if first else None, nodes=nodes,
        notes=[f"monitor: {report.steps} steps, {len(report.anomalies)} anomalies; loss per step: {losses}; "
               f"plot {report.png or 'not drawn (no matplotlib)'}"])
    d.properties.append((RESULT, row))
    if first is not None:
        d.fail(f"msprobe: monitor: first anomaly at {first.message} ({len(report.anomalies)} in all). "
               f"Plot: {report.png}. Artifacts: {folder}")
    return d.done(report)
