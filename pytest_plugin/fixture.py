"""The ``msprobe`` fixture object: what a test sees, an adapter over :mod:`msprobe_ci.check`.

Each method merges its options (call > ``@pytest.mark.msprobe(...)`` > command line > ini) into
:class:`~msprobe_ci.check.settings.CheckSettings`, runs one mode of :mod:`msprobe_ci.check` in the test's
:class:`~msprobe_ci.check.context.CheckContext`, and maps the :class:`~msprobe_ci.check.conclude.Conclusion` to
pytest: its summary rows and properties onto the test report (JUnit, terminal summary, HTML report), its warnings,
and its failure as the test's one failure (``pytest.fail(..., pytrace=False)``). Bad input and absent devices are
mapped in :meth:`MsprobeFixture._guard`, the only place a check's error becomes a pytest outcome.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import pytest

from .session import ERROR_PROPERTY, RESULT_PROPERTY, ProbeSession


class MsprobeFixture:
    """What a test sees as ``msprobe``. Options: per call > ``@pytest.mark.msprobe(...)`` > command line > ini."""

    def __init__(self, request: pytest.FixtureRequest, session: ProbeSession):
        from ..check import CheckContext

        self.request = request
        self.session = session
        marker_opts: dict[str, Any] = {}
        for mark in reversed(list(request.node.iter_markers("msprobe"))):
            marker_opts.update(mark.kwargs)
        self._check_keys(marker_opts, "@pytest.mark.msprobe")
        self.marker_options = marker_opts
        nodeid = request.node.nodeid
        self.context = CheckContext(
            nodeid, test_dir=lambda: session.test_dir(nodeid),
            graph_dir=None if session.no_graph else (lambda index: session.graph_dir(nodeid, index)),
            inject_path=session.inject_path, baseline=session.baseline, record=session.record,
            require_coverage=session.require_coverage)

    @property
    def checks(self) -> int:
        """How many checks this test started."""
        return self.context.checks

    @staticmethod
    def _check_keys(options: dict, where: str) -> None:
        from ..check.settings import check_keys
        from ..errors import MsprobeError

        try:
            check_keys(options, where)
        except MsprobeError as exc:
            raise pytest.UsageError(f"msprobe: {exc}") from None

    def _settings(self, options: dict, what: str, compile_target: bool = False):
        """The check's :class:`~msprobe_ci.check.settings.CheckSettings`: the run's options, the marker's, the
        call's, merged and validated (the run's fault file and config.json loaded once)."""
        from ..check.settings import CheckSettings, merge

        self._check_keys(options, what)
        s = self.session
        s.validate_files()
        self.context.dump_config, self.context.faults = s.dump_config, s.faults
        merged = merge([s.check_options, self.marker_options, options])
        nodeid = self.request.node.nodeid
        # budgeted isolation rotates by the test id and, where pytest's cache keeps it, by the run
        seed = f"{nodeid}#run{s.rotation_run(nodeid)}" if merged.get("isolate_budget") else nodeid
        if merged.get("compile") and not compile_target:  # asked, and this mode runs eagerly: said, not silent
            warnings.warn(f"msprobe: {what}: compile (--msprobe-target-compile) is honoured by the modes that run "
                          f"a target (check, check_training, check_generate, check_parallel); this one runs none",
                          stacklevel=4)
        return CheckSettings.resolve(merged, run_faults=s.faults, compile_target=compile_target, rotation_seed=seed)

    @contextlib.contextmanager
    def _guard(self):
        """Map a check's errors to pytest: bad input fails the test with one line; an absent device skips it
        (listed in the summary) or, with ``--msprobe-require-device``, fails it."""
        __tracebackhide__ = True
        from ..check import DeviceAbsent
        from ..check.conclude import publish
        from ..check.row import CheckRow
        from ..errors import MsprobeError

        try:
            yield
        except DeviceAbsent as exc:
            if self.session.require_device:
                self.request.node.user_properties.append((ERROR_PROPERTY, f"msprobe: {exc} (--msprobe-require-device)"))
                raise pytest.fail.Exception(f"msprobe: {exc} (--msprobe-require-device)", pytrace=False) from None
            row = CheckRow.from_json(dict(exc.row, skipped=str(exc)))
            self.request.node.user_properties.append((RESULT_PROPERTY, publish(row)))
            raise pytest.skip.Exception(f"msprobe: {exc}") from None
        except MsprobeError as exc:
            self.request.node.user_properties.append((ERROR_PROPERTY, f"msprobe: {exc}"))
            raise pytest.fail.Exception(f"msprobe: {exc}", pytrace=False) from None
        except Exception as exc:  # a check that raised inside (the user's model, torch): it ran, and failed
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.request.node.user_properties.append((ERROR_PROPERTY, f"{type(exc).__name__}: {first}"[:500]))
            raise

    def _conclude(self, conclusion):
        """Map a :class:`~msprobe_ci.check.conclude.Conclusion`: rows (written as ``msprobe-result.json``, the
        report carrying the path) and properties onto the test report in order, its warnings, then its failure."""
        __tracebackhide__ = True
        from ..check.conclude import publish

        props = self.request.node.user_properties
        # the one verdict, decided by the Conclusion, stamped on every row it publishes: the terminal summary,
        # report.html, the job summary, pytest-html's extras and JUnit read it, never re-derive it
        for name, value in conclusion.properties:
            props.append((name, publish(value.stamped(conclusion.failure)) if name == RESULT_PROPERTY else value))
        for line in conclusion.warnings:
            warnings.warn(line, stacklevel=3)
        if conclusion.failure:
            pytest.fail(conclusion.failure, pytrace=False)
        return conclusion.value

    def _run(self, what: str, options: dict, mode: Callable, *args: Any, compile_target: bool = False,
             **kwargs: Any):
        """Run one mode, ``mode(context, settings, *args, **kwargs)``, and conclude it."""
        __tracebackhide__ = True
        with self._guard():
            conclusion = mode(self.context, self._settings(options, f"msprobe.{what}()", compile_target), *args,
                              **kwargs)
        return self._conclude(conclusion)

    def check(self, model: Any, *inputs: Any, loss_fn: Callable[[Any], Any] | None = None, **options: Any):
        """Run ``model(*inputs)`` on the bench and on the target under capture, compare, and fail on divergence.

        A single ``dict`` input is passed as keyword arguments (``model(**inputs)``), as transformers models take
        it. The model is deep-copied per side (same weights), moved to the side's device and cast to its dtype;
        floating inputs follow, integer inputs (token ids) only move. With ``loss_fn`` the backward pass runs too:
        ``loss_fn(output).backward()`` on each side.

        Args:
            model: an ``nn.Module`` (left untouched).
            *inputs: positional inputs, or one dict of keyword inputs.
            loss_fn: maps the model output to a scalar loss; enables backward capture.
            **options: ``bench``, ``target``, ``bench_dtype``, ``target_dtype``, ``level``, ``task``, ``inject``
                (a fault file), ``seed`` (default 1234), ``fuzzy``, ``compile`` (target through
                ``torch.compile``, capture at L0), ``api_standards`` (``{API pattern: standard}``) and
                ``api_thresholds`` (``{standard: {threshold: value}}``) for the per-API pre-check, and the
                rule factors ``round_factor``,
                ``propagation``, ``error_factor``, ``rel_floor`` (old name ``atol``) of the drift rule (see
                :mod:`msprobe_ci.compare.verdict`), ``free_benchmark`` (``improve_precision``/``to_cpu``: no bench
                side, see below).

        Free benchmark (``--msprobe-free-benchmark[=MODE]`` or ``free_benchmark=MODE``): for runners with neither
        a bench device nor a baseline. Only the target runs; every API call is re-run on copies of its inputs in
        higher precision and with bit-noised inputs and judged by :mod:`msprobe_ci.free_benchmark`; the test fails
        naming the API calls at risk (forward only; ``free_benchmark.csv`` and one JUnit testcase per call).

        Baselines: with ``--msprobe-record`` only the bench runs and its dump is stored under
        ``--msprobe-baseline=DIR`` (returns ``None``); with ``--msprobe-baseline=DIR`` alone the bench dump is read
        from there (the bench device need not exist) and the target is captured with the baseline's task/level.

        Returns:
            The :class:`~msprobe_ci.compare.CompareReport` (when the test has not failed), ``None`` when recording.

        Raises:
            pytest.fail.Exception: a node's verdict is ``error`` (the first line names the first diverging
                API/module, the metric, its value and the threshold) or the target overflows where the bench
                does not.
        """
        __tracebackhide__ = True
        from ..check import run_check

        return self._run("check", options, run_check, model, inputs, loss_fn, compile_target=True)

    def check_parallel(self, build: Callable[[int, int], Any], *inputs: Any, world_size: int,
                       bench_world_size: int | None = None, loss_fn: Callable[[Any], Any] | None = None,
                       timeout: float = 300.0, tp: int | tuple | None = None, pp: int | tuple | None = None,
                       optimizer: Callable | None = None, steps: int = 1, **options: Any):
        """Run a model split over ``world_size`` ranks on the bench and the target, compare rank by rank, and fail
        naming the rank whose own computation diverged first.

        ``build(rank, world_size)`` returns that rank's module (its shard of the weights); every rank gets the same
        ``inputs``. Ranks are spawned processes joined by torch.distributed (gloo on CPU) on a port chosen per
        check; each captures the bench side, then the target side (isolated verdicts), into
        ``<check>/<side>/step0/rank<R>``. Communication ops are captured on every rank; a rank that only received
        diverged data through a collective is named as such, not blamed. Faults take ``rank: N``.

        Args:
            build: a module-level function (it is sent to the rank processes), as are ``loss_fn`` and the inputs.
            world_size: ranks of the target run. bench_world_size: ranks of the bench run (default the same).
                When they differ, each side runs in its own ranks and its TP/PP ranks are merged into one model
                per data-parallel group before the compare (:mod:`msprobe_ci.compare.merge`; statistics merged
                as msprobe's graph merging does, partial sums standing for their all_reduce).
            tp, pp: the tensor/pipeline-parallel sizes, ``(target, bench)`` or one int for the target (the bench's
                then inferred); default inferred from each side's captured collectives (all_reduce process
                group, send/recv chain), as msprobe infers them.
            loss_fn: maps a rank's output to a scalar loss; enables backward capture. It runs on every rank, so a
                pipeline is checked forward-only here (a pipeline training step your own schedule dumped merges
                through ``msprobe-ci compare --pp``).
            timeout: seconds before hung ranks are terminated and the check fails naming them (default 300).
            optimizer: ``optimizer(parameters) -> torch.optim.Optimizer`` (module-level): each side trains
                ``steps`` steps on ``inputs``, every step judged, faults taking ``step: N`` (rank against rank:
                not with a merged bench).
            steps: training steps with an ``optimizer`` (default 1).
            options: as for :meth:`check` (bench, target, bench_dtype, target_dtype, level, task, inject, seed,
                isolate, api_standards, api_thresholds).

        Sharded models (FSDP2 ``fully_shard``, FSDP1): each side builds its own model on each rank, never a copy.
        A ``build(rank, world_size, dtype)`` gets the side's dtype (``None`` for ``model-dtype``) and applies it
        itself, e.g. ``fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=dtype,
        reduce_dtype=torch.float32))``: a mixed-precision policy target against an fp32 bench, the policy's casts
        part of the target's arithmetic. Collectives (FSDP's all-gathers and reduce-scatters included) are
        judged on the inputs every rank of their group gave them.

        Returns:
            ``{rank: CompareReport}`` (with several ``steps``: ``{(step, rank): CompareReport}``); when the sides
            were merged, ``{(step, data-parallel group): CompareReport}``.

        Raises:
            pytest.fail.Exception: a rank raised or hung, the first divergence, an overflow, a fault that never
                fired, or a per-API pre-check error; each message names the rank.
        """
        __tracebackhide__ = True
        from ..check import check_parallel

        return self._run("check_parallel", options, check_parallel, build, inputs, world_size=world_size,
                         bench_world_size=bench_world_size, loss_fn=loss_fn, timeout=timeout, tp=tp, pp=pp,
                         optimizer=optimizer, steps=steps, compile_target=True)

    def check_training(self, model: Any, batches: list, loss_fn: Callable[[Any], Any] | None, optimizer: Callable,
                       *, grad_cosine: float = 0.99, scaler_skips: int = 3, step: Callable | None = None,
                       **options: Any):
        """Train the model for one step per batch on the bench and the target, and fail at the first step whose
        computation diverges.

        Each side trains its own copy (same weights, cast to the side's dtype): forward, ``loss_fn(out)``, backward,
        ``optimizer(parameters).step()`` (its APIs captured in the same step), ``zero_grad()``, one ``step<N>``
        folder per step. Every step is judged with isolated verdicts, so a step whose inputs drifted because the
        weights trained apart is not blamed for it; the first step with an own divergence fails the test as
        ``first divergence at step 2: Functional.silu.1.forward ...``. Per step and parameter the gradients are
        compared as grad_probe does (norms, min/max, cosine of the gradient vectors, sign agreement); the loss
        curves of both sides and the first step whose gradient cosine drops below ``grad_cosine`` are reported.

        Args:
            model: an ``nn.Module`` (left untouched). batches: one batch per step (a tensor, a tuple of inputs or
                a dict of keyword inputs). loss_fn: output -> scalar loss.
            optimizer: ``optimizer(parameters) -> torch.optim.Optimizer`` (e.g. ``lambda p: torch.optim.AdamW(p,
                lr=1e-3)``).
            grad_cosine: the gradient-similarity level reported (default 0.99; reported, never failed on).
            scaler_skips: with ``target_autocast="fp16"`` (a ``GradScaler`` on the target): fail when its scaler
                skips this many optimizer steps in a row (default 3); fewer are reported as skipped, not failed.
            step: your own training step, ``step(model, batch, state) -> loss`` (forward, backward, clipping,
                accumulation, scheduler, your scaler and autocast, ``optimizer.step()``, ``zero_grad``), captured
                whole as one step per batch; ``state`` is what ``optimizer(parameters)`` returned (an optimizer, or
                a tuple holding a scheduler and a scaler too); ``loss_fn`` may be ``None``.
            options: as for :meth:`check` (bench, target, dtypes, level, task, inject, seed, isolate, compile:
                the target's blocks compiled regionally as :meth:`check` does, every step captured at L0), and
                ``monitor`` (default ``--msprobe-monitor``): run :class:`msprobe_ci.TrainerMon` on both sides and
                fail on a target anomaly (NaN/Inf, a 10x jump over the running median) the bench does not share.

        Returns:
            ``{"losses": {"bench": [...], "target": [...]}, "grads": [[per-parameter record, ...] per step],
            "reports": [CompareReport per step]}``.
        """
        __tracebackhide__ = True
        from ..check import check_training

        return self._run("check_training", options, check_training, model, batches, loss_fn, optimizer,
                         grad_cosine=grad_cosine, scaler_skips=scaler_skips, step=step, compile_target=True)

    def check_generate(self, model: Any, input_ids: Any, *, max_new_tokens: int, token_range: Any = None,
                       **options: Any):
        """Greedy generation, one captured forward per step (step 0 is the prefill, then one step per new token,
        with the model's KV cache), and fail at the first step whose computation diverges.

        The bench decodes freely; the target is teacher-forced on the bench's tokens, so every step compares the
        same computation even where a benign bf16 target would pick another token at a near tie. How often the
        target's own pick agrees with the bench's is reported (``msprobe.token_agreement``), never failed on.
        Each step is judged with isolated verdicts; the KV cache and inputs are compared with the bench at the
        prefill only (later the cache holds values that differ by rounding, which the steps that made them judged).

        Args:
            model: a causal LM taking ``input_ids``, ``past_key_values``, ``use_cache`` with ``.logits`` and
                ``.past_key_values`` in its output (transformers models).
            input_ids: ``[batch, prompt]`` token ids.
            max_new_tokens: decode steps after the prefill (>= 0).
            token_range: ``[a, b]`` (msprobe's ``start(token_range=...)``): capture and judge only forward calls
                a..b (0 = the prefill); the others run uncaptured, still teacher-forced. Default: the ``step``
                list of ``--msprobe-config``'s config.json when it has one, else every step.
            options: as for :meth:`check` (bench, target, dtypes, level, task, inject (faults take ``step: N``),
                seed, isolate ...).

        Returns:
            ``{"tokens": bench tokens per step, "target_picks": ..., "token_agreement": float, "reports": [...]}``.
        """
        __tracebackhide__ = True
        from ..check import check_generate

        return self._run("check_generate", options, check_generate, model, input_ids,
                         max_new_tokens=max_new_tokens, token_range=token_range, compile_target=True)

    @contextlib.contextmanager
    def monitor(self, model: Any, optimizer: Any = None, *, alert_factor: float = 10.0, warmup: int = 3,
                xy_distribution: bool = True, wg_distribution: bool = True, mv_distribution: bool = True):
        """Monitor the test's own training loop (msprobe's ``TrainerMon``) and fail at its first anomaly.

        Usage::

            with msprobe.monitor(model, opt) as mon:
                for batch in batches:
                    loss = model(**batch).loss
                    loss.backward(); mon.record_loss(loss)
                    opt.step(); opt.zero_grad()        # the optimizer's step closes each monitored step

        Without an optimizer call ``mon.close_step()`` at each step's end. Needs no bench and no baseline.

        Args:
            model: the ``nn.Module`` the loop trains. optimizer: its ``torch.optim.Optimizer`` (optional).
            alert_factor, warmup, xy_distribution, wg_distribution, mv_distribution: as
                :class:`msprobe_ci.TrainerMon` (jump rule: a norm above 10x the median of its previous values,
                once 3 exist).

        Yields:
            The :class:`msprobe_ci.TrainerMon`; ``mon.report`` holds the anomalies after the block.

        Raises:
            pytest.fail.Exception: at the end of the block, on the first anomaly (its step, stage and module),
                with the plot's path.
        """
        __tracebackhide__ = True
        from ..check import conclude_monitor, open_monitor

        with self._guard():
            mon, folder, index = open_monitor(self.context, model, optimizer, alert_factor=alert_factor,
                                              warmup=warmup, xy_distribution=xy_distribution,
                                              wg_distribution=wg_distribution, mv_distribution=mv_distribution)
        try:
            yield mon
        finally:
            report = mon.close()
        self._conclude(conclude_monitor(self.context, report, folder, index))

    def compare_dumps(self, target: str, bench: str, *, fuzzy: bool = False, data_mapping: str | None = None,
                      layer_mapping: str | None = None, cell_mapping: str | None = None,
                      api_mapping: str | None = None):
        """Gate a dump recorded elsewhere (another runner, another framework) against a bench dump.

        The same judgement as :meth:`check` without running a model: compare (a MindSpore dump against a PyTorch
        one, either way round, is matched across frameworks with no mapping file), CSV, graph, overflow, the
        per-API pre-check of a tensor dump, one JUnit testsuite, and a failure naming the first divergence.

        Args:
            target: the dump under test: a dump.json, rank folder or step folder with one rank.
            bench: the reference dump, same forms (a recorded baseline's rank folder works).
            fuzzy: msprobe's ``-fm`` matching.
            data_mapping, layer_mapping, cell_mapping, api_mapping: msprobe's ``-dm``/``-lm``/``-cm``/``-am`` YAML
                files (optional).

        Returns:
            The :class:`~msprobe_ci.compare.CompareReport`.

        Raises:
            pytest.fail.Exception: unreadable dumps (one line), or the first divergence / overflow.
        """
        __tracebackhide__ = True
        from ..check import check_dumps

        with self._guard():
            # the run's and the marker's rule settings, as check() takes them: the drift rule's factors (ini
            # msprobe_round_factor ...), msprobe_api_standards/msprobe_api_thresholds, the bench kernel of a
            # replayed tensor dump
            settings = self._settings({}, "msprobe.compare_dumps()")
            conclusion = check_dumps(self.context, bench=bench, target=target, fuzzy=fuzzy,
                                     data_mapping=data_mapping, layer_mapping=layer_mapping,
                                     cell_mapping=cell_mapping, api_mapping=api_mapping, settings=settings)
        return self._conclude(conclusion)

    def finish(self) -> None:
        """Teardown: move a recorded baseline into place (nothing is stored for a test that recorded no check);
        release the test folder's lock."""
        self.session.release(self.request.node.nodeid)
        self.context.finish()

