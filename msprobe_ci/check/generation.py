"""The generation mode: greedy decoding with the KV cache, one captured forward per step, the target
teacher-forced on the bench's tokens, the first diverging step named.

:func:`run_decode` decodes on one side; :func:`check_generate` is the whole check, concluded as a
:class:`~msprobe_ci.check.conclude.Conclusion`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._perf import bound_heap
from ..errors import MsprobeError
from .sides import compiled_note, precision_notes, unapplied_faults


@dataclass
class DecodeRun:
    """What one side of a generation check produced: per step (0 = prefill) the rank folder, the greedy next
    token the side itself would pick, and its last-position logits (float64 CPU)."""

    folders: list = field(default_factory=list)
    picks: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    unapplied: tuple = ()
    steps: list = field(default_factory=list)  # the captured steps, one per folder
    notes: tuple = ()  # report lines about how the side ran (precision_notes)


def run_decode(model: Any, input_ids, max_new_tokens: int, backend, cfg, *, forced: list | None = None,
               faults: tuple = (), seed: int = 1234, isolator=None, capture_steps=None,
               **generate_kwargs) -> DecodeRun:
    """Greedy decoding with the model's KV cache, one captured forward per step (step 0 is the prefill).

    Args:
        model: a causal LM taking ``input_ids``, ``past_key_values``, ``use_cache`` (transformers style) whose
            output has ``.logits`` and ``.past_key_values``.
        input_ids: ``[batch, prompt]`` token ids.
        max_new_tokens: decode steps after the prefill.
        forced: the tokens to feed at steps 1..N (teacher forcing on the bench's tokens); ``None`` feeds the
            side's own greedy picks.
        capture_steps: the steps to capture (a set of ints; ``None``: all); the others run uncaptured, so a long
            generation writes only what is judged (msprobe's ``token_range``).
        generate_kwargs: extra keyword inputs of every forward (e.g. ``attention_mask`` is not supported yet).

    Raises:
        MsprobeError: a model output without ``logits``/``past_key_values``, or nothing captured.
    """
    import torch

    from ..backends import compile_regions, deterministic
    from ..capture import CaptureSession

    side_model = backend.prepare_model(model, eval_mode=True)
    ids = backend.prepare_inputs((input_ids,))[0]
    bound_heap()  # a check's sides and judgement share one process (msprobe_ci._perf.bound_heap)
    regions = compile_regions(model) if backend.compile else []  # as run_training: no hooks inside, cfg at L0
    capture = CaptureSession(cfg, faults=faults, isolator=isolator, opaque_modules=regions)
    run = DecodeRun()
    torch.manual_seed(seed)
    past, step_ids = None, ids
    try:
        with deterministic(), torch.no_grad():
            for step in range(max_new_tokens + 1):
                captured = capture_steps is None or step in capture_steps
                if captured:
                    capture.start(side_model)
                with backend.autocast_context():  # the side's AMP, as the user serves
                    out = side_model(input_ids=step_ids, past_key_values=past, use_cache=True, **generate_kwargs)
                if captured:
                    capture.stop()
                logits, past = getattr(out, "logits", None), getattr(out, "past_key_values", None)
                if logits is None or past is None:
                    raise MsprobeError("check_generate: the model output needs .logits and .past_key_values "
                                       "(a causal LM called with use_cache=True)")
                last = logits[:, -1].detach().to("cpu", torch.float64)
                run.logits.append(last)
                run.picks.append(last.argmax(-1))
                if captured:
                    run.folders.append(capture.dump_folder())
                    run.steps.append(step)
                capture.step()
                if step == max_new_tokens:
                    break
                nxt = forced[step] if forced is not None else run.picks[-1]
                step_ids = nxt.reshape(-1, 1).to(ids.device)
    finally:
        capture.close()
    run.unapplied = unapplied_faults(faults, capture, bool(backend.compile))
    run.notes = compiled_note(backend, regions) + precision_notes(capture, backend)
    return run


def check_generate(ctx, s, model: Any, input_ids: Any, *, max_new_tokens: int, token_range: Any = None):
    """Greedy generation on both sides (the target teacher-forced on the bench's tokens), every captured step
    judged (the KV cache and inputs compared with the bench at the prefill only), concluded naming the first
    diverging step.

    Args:
        ctx: the test's :class:`~msprobe_ci.check.context.CheckContext`. s: the check's settings.
        model, input_ids, max_new_tokens: as :func:`run_decode`.
        token_range: ``[a, b]``: capture and judge only forward calls a..b (0 = the prefill). Default: the ``step``
            list of the run's config.json when it has one, else every step.

    Returns:
        A :class:`~msprobe_ci.check.conclude.Conclusion` whose value is ``{"tokens": bench tokens per step,
        "target_picks": ..., "token_agreement": float, "reports": [...]}``.

    Raises:
        MsprobeError: a bad ``max_new_tokens`` or ``token_range``, an encoder-decoder model, a model without
            logits/KV cache, unreadable step dumps.
    """
    import os

    from ..config import DumpConfig
    from .conclude import Draft, conclude_steps, judge_steps
    from .training import _require_module

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise MsprobeError(f"check_generate: max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    if token_range is not None:
        ok = isinstance(token_range, (list, tuple)) and len(token_range) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in token_range) and \
            token_range[0] <= token_range[1] <= max_new_tokens
        if not ok:
            raise MsprobeError(f"check_generate: token_range: expected [a, b] with 0 <= a <= b <= max_new_tokens "
                               f"({max_new_tokens}), got {token_range!r}")
        capture = set(range(token_range[0], token_range[1] + 1))
    else:
        config_steps = getattr(ctx.dump_config, "step", None) or None
        capture = {st for st in config_steps if st <= max_new_tokens} if config_steps else None
        if capture is not None and not capture:
            raise MsprobeError(f"check_generate: the config's step list {sorted(config_steps)} holds no step <= "
                               f"max_new_tokens ({max_new_tokens})")
    _require_module(model, "check_generate")
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        # its decode steps would feed each new token to the encoder as its whole input: a computation both sides
        # share, but no decoding the user runs
        raise MsprobeError(f"check_generate: {type(model).__name__} is an encoder-decoder model; check_generate "
                           "decodes a causal LM (input_ids and past_key_values in, logits out): gate a seq2seq "
                           "model's forward with msprobe.check or its training steps with msprobe.check_training")
    index, check_dir = ctx.next_check()

    def cfg(side: str) -> DumpConfig:
        return DumpConfig(dump_path=os.path.join(check_dir, side), level="L0" if s.target.compile else s.level,
                          task=s.task)

    try:
        bench_run = run_decode(model, input_ids, max_new_tokens, s.bench, cfg("bench"), seed=s.seed,
                               capture_steps=capture)
        target_run = run_decode(model, input_ids, max_new_tokens, s.target, cfg("target"), forced=bench_run.picks,
                                faults=s.faults, seed=s.seed, isolator=s.isolator(backward=False),
                                capture_steps=capture)
    except MsprobeError as exc:
        raise MsprobeError(f"{exc}. Artifacts: {check_dir}") from None
    steps = bench_run.steps
    outcomes = judge_steps(s, check_dir, bench_run.folders, target_run.folders, steps)
    agree = [bool((b == t).all()) for b, t in zip(bench_run.picks, target_run.picks)]
    agreement = sum(agree) / len(agree) if agree else 1.0
    note = (f"token agreement (target's own greedy pick vs the bench's, teacher-forced): {sum(agree)}/"
            f"{len(agree)}" + ("" if all(agree) else f", first differs at step {agree.index(False)}"))
    d = Draft()
    d.properties.append(("msprobe.token_agreement", agreement))
    if capture is not None:
        note += f"; captured and judged steps {steps[0]}..{steps[-1]} of 0..{max_new_tokens}" if \
            steps == list(range(steps[0], steps[-1] + 1)) else f"; captured and judged steps {steps}"
    conclude_steps(d, s, ctx.nodeid, index, check_dir, outcomes, target_run.unapplied,
                   [note, *bench_run.notes, *target_run.notes], [{"token_agrees": agree[st]} for st in steps],
                   lambda i: f"step {i} ({'prefill' if i == 0 else f'decode token {i}'})", note,
                   s.inject or ctx.inject_path, steps, require_coverage=ctx.require_coverage)
    return d.done({"tokens": [p.tolist() for p in bench_run.picks],
                   "target_picks": [p.tolist() for p in target_run.picks], "token_agreement": agreement,
                   "reports": [o.report for o in outcomes]})
