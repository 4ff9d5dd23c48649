"""The training mode: one step per batch on each side, every step judged, the first diverging step named.

:func:`run_training` trains one side; :func:`grad_similarity` is grad_probe's per-parameter record of a step;
:func:`check_training` is the whole check (both sides, per-step judgement, losses, gradients, the monitor),
concluded as a :class:`~msprobe_ci.check.conclude.Conclusion`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .._perf import bound_heap
from ..errors import MsprobeError
from .sides import compiled_note, precision_notes, unapplied_faults


@dataclass
class TrainingRun:
    """What one side of a training check produced.

    Attributes:
        folders: the rank folder of each step (``.../step<N>/rank``).
        losses: the loss of each step (float).
        grads: per step, ``{parameter name: float64 CPU gradient}`` after backward, before the optimizer step.
        unapplied: injected faults that never fired.
        monitor: the :class:`~msprobe_ci.monitor.MonitorReport` when the loop was monitored, else ``None``.
        notes: report lines about how the side ran (:func:`precision_notes`).
        scales: with a ``GradScaler`` (fp16 autocast), the loss scale each step ran with.
        skipped: with a ``GradScaler``, per step whether the scaler skipped the optimizer step (inf/NaN in the
            scaled gradients: the scale then falls).
    """

    folders: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    unapplied: tuple = ()
    monitor: Any = None
    notes: tuple = ()
    scales: list = field(default_factory=list)
    skipped: list = field(default_factory=list)


def run_training(model: Any, batches: list, loss_fn: Callable, optimizer: Callable, backend, cfg, *,
                 faults: tuple = (), seed: int = 1234, isolator=None, monitor_dir: str | None = None,
                 step: Callable | None = None, owned: bool = False, cast: bool = True) -> TrainingRun:
    """Train a copy of ``model`` on ``backend`` for one step per batch under capture, one ``step<N>`` folder each.

    Each step: forward (``model(*batch)``, a dict batch as keywords, a tensor as the one input), ``loss_fn(out)``,
    backward, the gradients kept for grad_probe statistics, ``optimizer.step()`` (its APIs are captured in the
    same step), ``zero_grad()``.

    Args:
        optimizer: ``optimizer(parameters) -> torch.optim.Optimizer``, called once per side; with ``step``, it may
            return any training state (an optimizer, a tuple with a scheduler and a ``GradScaler`` ...), handed to
            ``step`` as it is.
        monitor_dir: also run the training monitor (:class:`~msprobe_ci.monitor.TrainerMon`) into this folder.
        step: the user's own training step, ``step(model, batch, state) -> loss``: forward, backward, clipping,
            accumulation, scheduler, scaler, its own autocast, ``optimizer.step()`` and ``zero_grad`` as the user's
            loop does them; captured whole as one step (``loss_fn`` unused). The side's ``autocast`` option, if
            set, wraps the whole call. Gradients are recorded as ``step`` leaves them (``None`` after a
            ``zero_grad(set_to_none=True)`` at its end: then none are compared).
        owned, cast: as :meth:`~msprobe_ci.backends.Backend.prepare_model` (a rank's model built for this side:
            trained in place, FSDP-sharded ones included; its gradients kept as this rank's shards).

    Raises:
        MsprobeError: a batch list that is empty, or nothing captured.
    """
    import torch

    from ..backends import compile_regions, deterministic
    from ..capture import CaptureSession

    if not batches:
        raise MsprobeError("check_training: batches is empty (one training step per batch)")
    side_model = backend.prepare_model(model, owned=owned, cast=cast)
    side_model.train()
    opt = optimizer(side_model.parameters())
    # fp16 autocast trains with a loss scale, as torch.amp prescribes (the user's own step brings its own: found in
    # the state its factory returned, its skips read from its scale)
    scaler = backend.grad_scaler() if step is None else None
    own_scalers = _grad_scalers(opt) if step is not None else []
    bound_heap()  # a check's sides and judgement share one process (msprobe_ci._perf.bound_heap)
    # a compiled side (its blocks compiled regionally by prepare_model, as msprobe.check compiles them): no hooks
    # inside the regions, each judged whole against its eager self by module isolation (cfg's level is L0)
    regions = compile_regions(model) if backend.compile else []
    capture = CaptureSession(cfg, faults=faults, isolator=isolator, opaque_modules=regions)
    run = TrainingRun()
    mon = None
    if monitor_dir is not None:
        from ..monitor import TrainerMon

        mon = TrainerMon(monitor_dir).set_monitor(
            side_model, opt if isinstance(opt, torch.optim.Optimizer) else None)
    torch.manual_seed(seed)
    try:
        with deterministic():
            for batch in batches:
                inputs = backend.prepare_inputs((batch,))[0]
                capture.start(side_model)
                if step is not None:
                    scales = [float(sc.get_scale()) for sc in own_scalers]
                    with backend.autocast_context():
                        loss = step(side_model, inputs, opt)
                    if own_scalers:  # update() backs the scale off after a step it skipped (inf/NaN found)
                        run.scales.append(scales[0])
                        run.skipped.append(any(float(sc.get_scale()) < b for sc, b in zip(own_scalers, scales)))
                    if not isinstance(loss, torch.Tensor):
                        raise MsprobeError(f"check_training: step(model, batch, state) returned "
                                           f"{type(loss).__name__}; expected the step's loss tensor")
                    if mon is not None:
                        mon.record_loss(loss)
                    run.losses.append(float(loss.detach().float().cpu()))
                    run.grads.append(_grads(side_model))
                    capture.stop()
                    run.folders.append(capture.dump_folder())
                    capture.step()
                    continue
                with backend.autocast_context():  # forward and loss under the side's AMP; backward outside it
                    if isinstance(inputs, dict):
                        out = side_model(**inputs)
                    elif isinstance(inputs, (list, tuple)):
                        out = side_model(*inputs)
                    else:
                        out = side_model(inputs)
                    loss = loss_fn(out)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)  # the parameters' gradients are recorded and judged unscaled
                else:
                    loss.backward()
                if mon is not None:
                    mon.record_loss(loss)
                run.losses.append(float(loss.detach().float().cpu()))
                run.grads.append(_grads(side_model))
                if scaler is not None:
                    scale = float(scaler.get_scale())
                    scaler.step(opt)  # skipped where the scaled gradients hold inf/NaN
                    capture.aside(scaler.update)  # the loss scale's bookkeeping, not the model's arithmetic
                    run.scales.append(scale)
                    run.skipped.append(float(scaler.get_scale()) < scale)
                else:
                    opt.step()
                opt.zero_grad()
                capture.stop()
                run.folders.append(capture.dump_folder())
                capture.step()
    finally:
        capture.close()
        if mon is not None:
            run.monitor = mon.close()
    run.unapplied = unapplied_faults(faults, capture, bool(backend.compile))
    run.notes = compiled_note(backend, regions) + precision_notes(capture, backend)
    return run


def _grads(model: Any) -> dict:
    """``{parameter name: float64 CPU copy of its gradient}`` (a DTensor's: this rank's local shard)."""
    import torch

    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = getattr(g, "_local_tensor", g)
        out[n] = g.detach().to("cpu", torch.float64).clone()
    return out


def grad_similarity(bench: dict, target: dict) -> list[dict]:
    """grad_probe's per-parameter record of one step: norm, min and max on both sides, the cosine of the two
    gradient vectors, and sign agreement (the share of elements whose signs agree)."""
    import torch

    out = []
    for name, b in bench.items():
        t = target.get(name)
        if t is None or t.shape != b.shape:
            continue
        bf, tf = b.reshape(-1), t.reshape(-1)
        denom = float(bf.norm() * tf.norm())
        cos = float(bf @ tf) / denom if denom > 0 else (1.0 if float(bf.norm()) == float(tf.norm()) else 0.0)
        out.append({"param": name, "cosine": cos, "sign_agreement": float((torch.sign(bf) == torch.sign(tf))
                                                                            .double().mean()) if bf.numel() else 1.0,
                    "bench_norm": float(bf.norm()), "target_norm": float(tf.norm()),
                    "bench_min": float(bf.min()) if bf.numel() else 0.0, "bench_max": float(bf.max()) if bf.numel()
                    else 0.0, "target_min": float(tf.min()) if tf.numel() else 0.0,
                    "target_max": float(tf.max()) if tf.numel() else 0.0})
    return out


def check_training(ctx, s, model: Any, batches: list, loss_fn: Callable[[Any], Any] | None, optimizer: Callable, *,
                   grad_cosine: float = 0.99, scaler_skips: int = 3, step: Callable | None = None):
    """Train ``model`` one step per batch on both sides (isolation on the target), judge every step, conclude.

    Args:
        ctx: the test's :class:`~msprobe_ci.check.context.CheckContext`. s: the check's
            :class:`~msprobe_ci.check.settings.CheckSettings` (``monitor``: TrainerMon on both sides, failing on a
            target anomaly the bench does not share).
        model, batches, loss_fn, optimizer, step: as :func:`run_training` (``step``: the user's own training step;
            ``loss_fn`` may then be ``None``).
        grad_cosine: the gradient-similarity level reported (default 0.99; reported, never failed on).
        scaler_skips: with fp16 autocast (a ``GradScaler`` on that side), how many consecutive optimizer steps the
            target's scaler may skip (inf/NaN in its scaled gradients, the loss scale halved each time) before the
            check fails; fewer are reported as skipped by the scaler, with the scale, never as an overflow failure.
            A loss scale that keeps falling is msprobe's sign of trouble; default 3 (torch's scaler starts at
            2^16 and halves per skip).

    Returns:
        A :class:`~msprobe_ci.check.conclude.Conclusion` whose value is ``{"losses": {"bench": [...], "target":
        [...]}, "grads": [[per-parameter record, ...] per step], "reports": [CompareReport per step]}``.

    Raises:
        MsprobeError: bad input or unreadable step dumps (``. Artifacts: <check dir>`` appended).
    """
    import json
    import os

    from ..config import DumpConfig
    from .conclude import Draft, conclude_steps, judge_steps

    _require_module(model, "check_training")
    index, check_dir = ctx.next_check()
    runs = {}
    level = "L0" if s.target.compile else s.level  # both sides, so that their module nodes pair
    try:
        for side, backend in (("bench", s.bench), ("target", s.target)):
            cfg = DumpConfig(dump_path=os.path.join(check_dir, side), level=level, task=s.task)
            runs[side] = run_training(model, list(batches), loss_fn, optimizer, backend, cfg,
                                      faults=s.faults if side == "target" else (), seed=s.seed,
                                      isolator=s.isolator(backward=True) if side == "target" else None,
                                      monitor_dir=os.path.join(check_dir, "monitor", side) if s.monitor else None,
                                      step=step)
    except MsprobeError as exc:
        raise MsprobeError(f"{exc}. Artifacts: {check_dir}") from None
    outcomes = judge_steps(s, check_dir, runs["bench"].folders, runs["target"].folders)
    grads = [grad_similarity(b, t) for b, t in zip(runs["bench"].grads, runs["target"].grads)]
    losses = {"bench": runs["bench"].losses, "target": runs["target"].losses}
    curve = ", ".join(f"step{i} {b:.6g}/{t:.6g}" for i, (b, t) in enumerate(zip(losses["bench"], losses["target"])))
    low = next(((i, g) for i, step in enumerate(grads) for g in step if g["cosine"] < grad_cosine), None)
    sim = (f"gradient cosine first below {grad_cosine:g} at step{low[0]} {low[1]['param']} "
           f"({low[1]['cosine']:.6f})") if low else f"gradient cosine >= {grad_cosine:g} at every step"
    d = Draft()
    d.properties += [("msprobe.loss_bench", json.dumps(losses["bench"])),
                     ("msprobe.loss_target", json.dumps(losses["target"])), ("msprobe.grad_similarity", sim)]
    first_notes = [f"loss bench/target: {curve}", sim, *runs["bench"].notes, *runs["target"].notes]
    skips = _scaler_skips(runs)
    first_notes += skips["notes"]
    new_anomalies = []
    if s.monitor:
        bench_mon, target_mon = runs["bench"].monitor, runs["target"].monitor
        shared = {(a.step, a.stage, a.name, a.rule) for a in bench_mon.anomalies}
        new_anomalies = [a for a in target_mon.anomalies if (a.step, a.stage, a.name, a.rule) not in shared]
        first_notes.append(f"monitor: target {len(target_mon.anomalies)} anomalies ({len(new_anomalies)} not on "
                           f"the bench), bench {len(bench_mon.anomalies)}; plot {target_mon.png or 'not drawn'}")
        if bench_mon.first is not None:
            first_notes.append(f"monitor: the bench itself is anomalous: {bench_mon.first.message}")
        d.properties.append(("msprobe.monitor", os.path.dirname(target_mon.db)))
    value = {"losses": losses, "grads": grads, "reports": [o.report for o in outcomes]}
    if conclude_steps(d, s, ctx.nodeid, index, check_dir, outcomes, runs["target"].unapplied, first_notes,
                      [{"loss_bench": losses["bench"][i], "loss_target": losses["target"][i], "grads": grads[i]}
                       for i in range(len(outcomes))],
                      lambda i: f"step {i}", f"loss bench/target: {curve}; {sim}", s.inject or ctx.inject_path,
                      require_coverage=ctx.require_coverage,
                      scaler_skipped=frozenset(i for i, k in enumerate(runs["target"].skipped) if k)):
        return d.done(value)
    if skips["run"] >= max(1, int(scaler_skips)):
        d.fail(f"msprobe: the target's GradScaler skipped {skips['run']} optimizer steps in a row (steps "
               f"{skips['steps']}; loss scale {skips['scales']}): its scaled gradients keep overflowing fp16 "
               f"(scaler_skips={scaler_skips}). Artifacts: {check_dir}")
    if new_anomalies:
        a = new_anomalies[0]
        d.fail(f"msprobe: monitor: first target anomaly at {a.message}; the bench has none there "
               f"({len(new_anomalies)} in all). Plot: {runs['target'].monitor.png}. Artifacts: {check_dir}")
    return d.done(value)


def _grad_scalers(state: Any) -> list:
    """The enabled ``torch.amp.GradScaler`` objects in the training state a user's optimizer factory returned:
    the state itself, or an item of the tuple, list or dict it is (one level down)."""
    import torch

    items = [state]
    if isinstance(state, (list, tuple)):
        items += list(state)
    elif isinstance(state, dict):
        items += list(state.values())
    return [x for x in items if isinstance(x, torch.amp.GradScaler) and x.is_enabled()]


def _scaler_skips(runs: dict) -> dict:
    """The steps each side's ``GradScaler`` skipped: report lines, and the target's longest run of consecutive
    skips (``run``) with those steps and their loss scales."""
    notes, longest, cur = [], [], []
    for side in ("bench", "target"):
        r = runs[side]
        if not r.scales:
            continue
        skipped = [i for i, k in enumerate(r.skipped) if k]
        notes.append(f"GradScaler ({side}): loss scale {r.scales[0]:g} at step 0, {r.scales[-1]:g} at the last "
                     f"step; steps skipped by the scaler (inf/NaN in the scaled gradients): {skipped or 'none'}")
        if side == "target":
            for i, k in enumerate(r.skipped):
                cur = cur + [i] if k else []
                longest = cur if len(cur) > len(longest) else longest
    target = runs["target"]
    return {"notes": notes, "run": len(longest), "steps": longest,
            "scales": [target.scales[i] for i in longest]}


def _require_module(model: Any, what: str) -> None:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise MsprobeError(f"{what}(model, ...): expected a torch.nn.Module, got {type(model).__name__}")
