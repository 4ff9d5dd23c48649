"""Training monitor: per-step statistics of activations, gradients and optimizer states, with anomaly alerts.

msprobe's ``TrainerMon`` (``msprobe.pytorch.monitor``) for a user's own loop, with its field names::

    from msprobe_ci import TrainerMon
    mon = TrainerMon("monitor_output")
    mon.set_monitor(model, optimizer=opt)          # hooks; the optimizer's step closes each monitored step
    for batch in loader:
        loss = loss_fn(model(batch)); loss.backward()
        mon.record_loss(loss)
        opt.step(); opt.zero_grad()
    report = mon.close()                           # report.first: the first anomalous step and module

Recorded per step (``step`` counts optimizer steps from 0), for each name, the ops ``norm`` (L2), ``min``,
``max``, ``mean``, ``zeros`` (share of exact zeros) and ``nans`` (count of NaN/Inf elements):

* ``actv``: every submodule's output tensors (``model.layers.0.mlp.output``; a tuple output's tensors as
  ``output.0``, ``output.1``), per forward call (repeated calls of one module in a step add ``:1``, ``:2``);
* ``actv_grad``: the gradient arriving at each of those outputs in the backward pass (``...output_grad``);
* ``post_grad``: each parameter's gradient when the optimizer steps (msprobe's weight-gradient statistics);
* ``exp_avg``, ``exp_avg_sq`` (Adam/AdamW), ``momentum_buffer`` (SGD): the optimizer state after its step;
* ``loss``: what :meth:`TrainerMon.record_loss` was given.

Anomaly rules, checked online at each step's end (msprobe's ``AnomalyNan`` and a turbulence rule):

* ``AnomalyNan``: a NaN/Inf element, or a NaN/Inf loss;
* ``AnomalyJump``: a ``norm`` (or the loss) above ``alert_factor`` × the median of its previous values, once
  ``warmup`` previous values exist and that median is above the dtype-free floor 1e-12 (default factor 10 over
  at least 3 steps: a benign run's norms drift by far less within a few steps; an exploding layer jumps by
  orders of magnitude).

The first anomaly is the earliest in time: smallest step, then the order the values were produced in (forward
before backward before the optimizer, modules in execution order). Output under ``output_dir``: ``monitor.db``
(SQLite, table ``monitor_metrics``), msprobe-style CSVs ``{stage}_{first}-{last}.csv`` (columns ``vpp_stage, name,
step`` and the ops), ``anomaly.json`` and, when matplotlib is installed, ``monitor.png`` (the loss and the worst
names' norms over steps).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .errors import MsprobeError

OPS = ("norm", "min", "max", "mean", "zeros", "nans")
STAGES = ("loss", "actv", "actv_grad", "post_grad", "exp_avg", "exp_avg_sq", "momentum_buffer")
_FLOOR = 1e-12


@dataclass(frozen=True)
class Anomaly:
    """One alert: ``rule`` (``AnomalyNan``/``AnomalyJump``) fired on ``stage``/``name`` at ``step`` for ``op``
    (``value``; ``median`` of the previous values for a jump)."""

    step: int
    stage: str
    name: str
    op: str
    value: float
    rule: str
    median: float | None = None
    order: int = 0

    @property
    def message(self) -> str:
        if self.rule == "AnomalyNan":
            what = "loss is NaN/Inf" if self.stage == "loss" else f"{self.stage} has {self.value:g} NaN/Inf element(s)"
        else:
            what = (f"{self.stage} {self.op} {self.value:.4g} jumped to {self.value / self.median:.3g}x the median "
                    f"{self.median:.4g} of its previous steps")
        return f"step {self.step}: {self.name}: {what} ({self.rule})"


@dataclass
class MonitorReport:
    """What a monitored run found.

    Attributes:
        steps: monitored steps. anomalies: every alert in time order. losses: the recorded loss per step.
        db, csv, png: the files written (``png`` is ``None`` without matplotlib).
    """

    steps: int = 0
    anomalies: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    db: str = ""
    csv: list = field(default_factory=list)
    png: str | None = None
    anomaly_json: str = ""

    @property
    def first(self) -> Anomaly | None:
        return self.anomalies[0] if self.anomalies else None

    @property
    def passed(self) -> bool:
        return not self.anomalies


def _stats(t: torch.Tensor) -> dict[str, float]:
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.double() if x.dtype != torch.float64 else x
    n = x.numel()
    if n == 0:
        return {op: 0.0 for op in OPS}
    bad = ~torch.isfinite(x)
    nans = int(bad.sum())
    f = torch.where(bad, torch.zeros_like(x), x) if nans else x
    return {"norm": float(torch.linalg.vector_norm(f)) if not nans else math.nan,
            "min": float(f.min()), "max": float(f.max()), "mean": float(f.mean()),
            "zeros": float((x == 0).sum()) / n, "nans": float(nans)}


class TrainerMon:
    """Monitor a training loop (see the module docstring).

    Args:
        output_dir: where ``monitor.db``, the CSVs, ``anomaly.json`` and ``monitor.png`` go (created; an
            existing ``monitor.db`` there is an error, never overwritten).
        xy_distribution: record ``actv``/``actv_grad`` (default ``True``). wg_distribution: record ``post_grad``
            (default ``True``). mv_distribution: record the optimizer state (default ``True``).
        alert_factor: the jump rule's multiple of the running median (default 10, > 1).
        warmup: previous values needed before the jump rule applies (default 3, >= 1).
        plot: write ``monitor.png`` when matplotlib is importable (default ``True``).

    Raises:
        MsprobeError: a bad factor or warmup, or an output folder that already holds a monitor.db.
    """

    def __init__(self, output_dir: str | os.PathLike, *, xy_distribution: bool = True, wg_distribution: bool = True,
                 mv_distribution: bool = True, alert_factor: float = 10.0, warmup: int = 3, plot: bool = True):
        if isinstance(alert_factor, bool) or not isinstance(alert_factor, (int, float)) or not alert_factor > 1:
            raise MsprobeError(f"TrainerMon: alert_factor: expected a number > 1, got {alert_factor!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise MsprobeError(f"TrainerMon: warmup: expected an int >= 1, got {warmup!r}")
        self.output_dir = os.path.abspath(os.fspath(output_dir))
        self.db_path = os.path.join(self.output_dir, "monitor.db")
        if os.path.exists(self.db_path):
            raise MsprobeError(f"TrainerMon: {self.db_path} already exists; pick a new output_dir (nothing is "
                               "overwritten)")
        self.xy, self.wg, self.mv = bool(xy_distribution), bool(wg_distribution), bool(mv_distribution)
        self.alert_factor, self.warmup, self.plot = float(alert_factor), warmup, plot
        self.step = 0
        self._rows: list[tuple] = []        # (step, order, stage, name, *ops) of the current step
        self._history: dict[tuple[str, str], list[float]] = {}
        self._seen: dict[str, int] = {}    # per-step call counts of a module
        self._order = 0
        self._handles: list = []
        self._model = None
        self._optimizer = None
        self._loss: float | None = None
        self.report = MonitorReport(db=self.db_path)
        self._conn: sqlite3.Connection | None = None
        self._closed = False

    # ------------------------------------------------------------------ set-up
    def set_monitor(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    grad_acc_steps: int = 1) -> "TrainerMon":
        """Hook ``model`` (every named submodule) and, when given, ``optimizer`` (its step records ``post_grad``
        before and the optimizer state after, then closes the monitored step).

        Args:
            grad_acc_steps: accepted for msprobe compatibility; only 1 is supported (one optimizer step per
                monitored step either way).

        Raises:
            MsprobeError: ``model`` is not an ``nn.Module``, or ``grad_acc_steps`` is not 1.
        """
        if not isinstance(model, torch.nn.Module):
            raise MsprobeError(f"TrainerMon.set_monitor: expected a torch.nn.Module, got {type(model).__name__}")
        if grad_acc_steps != 1:
            raise MsprobeError("TrainerMon.set_monitor: grad_acc_steps other than 1 is not supported")
        os.makedirs(self.output_dir, exist_ok=True)
        self._conn = sqlite3.connect(self.db_path)
        with self._conn:
            self._conn.execute("CREATE TABLE monitor_metrics (step INTEGER, ord INTEGER, stage TEXT, name TEXT, "
                               + ", ".join(f"{op} REAL" for op in OPS) + ")")
            self._conn.execute("CREATE INDEX idx_metrics ON monitor_metrics (stage, name, step)")
        self._model = model
        if self.xy:
            for name, module in model.named_modules():
                self._handles.append(module.register_forward_hook(self._actv_hook(name or "root")))
        if optimizer is not None:
            self._optimizer = optimizer
            self._handles.append(optimizer.register_step_pre_hook(lambda opt, a, k: self._grads()))
            self._handles.append(optimizer.register_step_post_hook(lambda opt, a, k: self._after_optimizer()))
        return self

    def _actv_hook(self, name: str):
        def hook(module, args, output):
            k = self._seen.get(name, 0)
            self._seen[name] = k + 1
            base = name if k == 0 else f"{name}:{k}"
            tensors = [output] if isinstance(output, torch.Tensor) else (
                [t for t in output if isinstance(t, torch.Tensor)] if isinstance(output, (tuple, list)) else [])
            single = isinstance(output, torch.Tensor)
            for i, t in enumerate(tensors):
                if not (t.is_floating_point() or t.is_complex()):
                    continue
                row = f"{base}.output" if single else f"{base}.output.{i}"
                self._add("actv", row, t)
                if t.requires_grad:
                    t.register_hook(self._grad_hook(f"{row}_grad"))
        return hook

    def _grad_hook(self, row: str):
        def hook(grad: torch.Tensor) -> None:
            self._add("actv_grad", row, grad)
        return hook

    def _add(self, stage: str, name: str, t: torch.Tensor) -> None:
        s = _stats(t)
        self._rows.append((self.step, self._order, stage, name, *(s[op] for op in OPS)))
        self._order += 1

    def _grads(self) -> None:
        if not self.wg or self._model is None:
            return
        for name, p in self._model.named_parameters():
            if p.grad is not None:
                self._add("post_grad", name, p.grad)

    def _after_optimizer(self) -> None:
        if self.mv and self._optimizer is not None and self._model is not None:
            names = {id(p): n for n, p in self._model.named_parameters()}
            for group in self._optimizer.param_groups:
                for p in group["params"]:
                    for key, v in self._optimizer.state.get(p, {}).items():
                        if key in ("exp_avg", "exp_avg_sq", "momentum_buffer") and isinstance(v, torch.Tensor):
                            self._add(key, names.get(id(p), f"param{id(p)}"), v)
        self.close_step()

    # ------------------------------------------------------------------ steps
    def record_loss(self, loss: Any) -> None:
        """The step's loss (a scalar tensor or number); recorded as stage ``loss``, name ``loss``."""
        value = float(loss.detach().float().cpu()) if isinstance(loss, torch.Tensor) else float(loss)
        self._loss = value
        self._rows.append((self.step, self._order, "loss", "loss", value if math.isfinite(value) else math.nan,
                           value, value, value, float(value == 0), 0.0 if math.isfinite(value) else 1.0))
        self._order += 1

    def close_step(self) -> None:
        """End the current step: gradients are read now when no optimizer was given, rows are stored, the rules
        run. Called by the optimizer's step when :meth:`set_monitor` got one."""
        if self._conn is None:
            raise MsprobeError("TrainerMon: call set_monitor(model) first")
        if self._optimizer is None:
            self._grads()
        rows, self._rows = self._rows, []
        with self._conn:
            self._conn.executemany(f"INSERT INTO monitor_metrics VALUES ({', '.join('?' * (4 + len(OPS)))})", rows)
        for step, order, stage, name, *vals in rows:
            s = dict(zip(OPS, vals))
            if s["nans"] > 0:
                self.report.anomalies.append(Anomaly(step, stage, name, "nans", s["nans"], "AnomalyNan",
                                                     order=order))
                continue
            hist = self._history.setdefault((stage, name), [])
            value = abs(s["norm"])
            if len(hist) >= self.warmup:
                med = statistics.median(hist)
                if med > _FLOOR and value > self.alert_factor * med:
                    self.report.anomalies.append(Anomaly(step, stage, name, "norm", value, "AnomalyJump", med,
                                                         order))
            hist.append(value)
        self.report.losses.append(self._loss)
        self._loss = None
        self._seen.clear()
        self.report.steps += 1
        self.step += 1
        self._order = 0

    def close(self) -> MonitorReport:
        """Remove the hooks, close a step left open, and write the CSVs, ``anomaly.json`` and the plot.

        Returns:
            The :class:`MonitorReport` (anomalies in time order).
        """
        if self._closed:
            return self.report
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._conn is None:
            return self.report
        if self._rows:
            self.close_step()
        self.report.anomalies.sort(key=lambda a: (a.step, a.order))
        self._write_csv()
        self.report.anomaly_json = os.path.join(self.output_dir, "anomaly.json")
        from .outputs import atomic_write

        with atomic_write(self.report.anomaly_json, "w", encoding="utf-8") as fh:
            json.dump([dict(asdict(a), message=a.message) for a in self.report.anomalies], fh, indent=1,
                      default=str)
        if self.plot:
            self.report.png = self._plot()
        self._conn.close()
        return self.report

    def __enter__(self) -> "TrainerMon":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ files
    def _write_csv(self) -> None:
        import csv

        last = max(self.step - 1, 0)
        for stage in STAGES:
            rows = self._conn.execute("SELECT name, step, " + ", ".join(OPS) + " FROM monitor_metrics WHERE stage = ? "
                                      "ORDER BY step, ord", (stage,)).fetchall()
            if not rows:
                continue
            path = os.path.join(self.output_dir, f"{stage}_0-{last}.csv")
            with open(path, "w", newline="", encoding="utf-8") as fh:
                w = csv.writer(fh)
                w.writerow(["vpp_stage", "name", "step", *OPS])
                w.writerows([0, *r] for r in rows)
            self.report.csv.append(path)

    def _plot(self) -> str | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        # the names that moved most: largest max/median of their norm over steps (anomalous ones first)
        flagged = {(a.stage, a.name) for a in self.report.anomalies if a.stage != "loss"}
        series = {}
        for stage, name, step, norm in self._conn.execute(
                "SELECT stage, name, step, norm FROM monitor_metrics WHERE stage != 'loss' ORDER BY step, ord"):
            series.setdefault((stage, name), {})[step] = norm

        def spread(item):
            vals = [v for v in item[1].values() if v is not None and math.isfinite(v)]
            med = statistics.median(vals) if vals else 0.0
            return (item[0] in flagged, max(vals) / med if vals and med > _FLOOR else 0.0)
        worst = sorted(series.items(), key=spread, reverse=True)[:5]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        steps = list(range(len(self.report.losses)))
        ax1.plot(steps, [math.nan if v is None else v for v in self.report.losses], marker="o")
        ax1.set_ylabel("loss")
        ax1.set_title("msprobe-ci monitor")
        for (stage, name), pts in worst:
            ax2.plot(list(pts), [v if v is not None and v > 0 else math.nan for v in pts.values()], marker=".",
                     label=f"{stage} {name}"[:60])
        for a in self.report.anomalies[:1]:
            for ax in (ax1, ax2):
                ax.axvline(a.step, color="red", linestyle="--")
        ax2.set_yscale("log")
        ax2.set_ylabel("norm")
        ax2.set_xlabel("step")
        if worst:
            ax2.legend(fontsize=7)
        path = os.path.join(self.output_dir, "monitor.png")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return path
