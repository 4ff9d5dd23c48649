"""The offline mode: gate a dump recorded elsewhere (another runner, another framework) against a bench dump,
with no model run: compare, CSV, graph, overflow, the per-API pre-check of a tensor dump, one conclusion."""

from __future__ import annotations

import os

from ..judge.settings import JudgeSettings
from .conclude import Conclusion, conclude_check
from .context import CheckContext


def check_dumps(ctx: CheckContext, *, bench: str, target: str, fuzzy: bool = False, data_mapping: str | None = None,
                layer_mapping: str | None = None, cell_mapping: str | None = None,
                api_mapping: str | None = None, settings=None) -> Conclusion:
    """Judge ``target`` against ``bench`` as :func:`~msprobe_ci.check.single.run_check` judges its two sides.

    Args:
        ctx: the test's folders and run-wide choices.
        bench, target: a dump.json, rank folder or step folder with one rank each (by name only: msprobe's
            command line and the fixture's ``compare_dumps`` take the target first, the pipeline the bench first).
        fuzzy: msprobe's ``-fm`` matching. data_mapping, layer_mapping, cell_mapping, api_mapping: msprobe's
            ``-dm``/``-lm``/``-cm``/``-am`` YAML files (optional; a MindSpore dump against a PyTorch one needs none).
        settings: the run's :class:`~msprobe_ci.check.settings.CheckSettings`, whose rules a dump can honour are
            applied as :func:`~msprobe_ci.check.single.run_check` applies them: the drift rule's factors, the API
            standard and threshold overrides, the bench kernel of a replayed tensor dump. ``None``: the defaults.

    Returns:
        The :class:`~msprobe_ci.check.conclude.Conclusion`, its value the CompareReport.

    Raises:
        MsprobeError: unreadable dumps or mapping files.
    """
    from ..compare.crossframe import Mappings
    from ..dump.reader import rank_folders
    from .outcome import SideRun, evaluate, sources_rule, step_of

    folders = [os.path.dirname(os.path.abspath(p)) if os.path.isfile(p) else rank_folders(p)[0]
               for p in (target, bench)]
    mappings = Mappings.load(data=data_mapping, layer=layer_mapping, cell=cell_mapping, api=api_mapping)
    index, check_dir = ctx.next_check()
    os.makedirs(check_dir, exist_ok=True)
    # a later step of a multi-step dump: its weights and optimizer state trained apart by rounding (context)
    factor, rule = sources_rule(step_of(folders[0]))
    row = {"test": ctx.nodeid, "index": index, "dir": check_dir, "bench": f"dump {folders[1]}",
           "target": f"dump {folders[0]}", "level": "mix", "notes": [rule]}
    # the run's rules (drift factors, standards, bench kernel) judge dumps made elsewhere; the run's own devices
    # and dtypes say nothing about them (no cast allowance, no model-level outputs)
    rules = JudgeSettings() if settings is None else settings.judge
    outcome = evaluate(folders[1], SideRun(folders[0]), check_dir,
                       rules.replace(level="mix", fuzzy=fuzzy, isolate=True, mappings=mappings, source_factor=factor,
                                     cast_roundoff=0.0, output_rtol=None),
                       graph_dir=None if ctx.graph_dir is None else ctx.graph_dir(index))
    return conclude_check(row, outcome, check_dir, "mix", [], None, "--msprobe-target=cpu",
                          require_coverage=ctx.require_coverage)
