"""The per-API judge: every captured, isolated or replayed call ends here.

=======================  =============================================================================
:mod:`.support`          :func:`unjudgeable`: the one table of what cannot be judged, its first reason
:mod:`.rows`             :func:`outputs`: an API's output flattened into named rows
:mod:`.pair`             :func:`judge_pair` (one row), :func:`judge_rows` (every row of one call)
:mod:`.allowances`       the fp32 accumulation allowance, the magnitude of a reduction's terms
:mod:`.peaks`            the largest finite magnitude of a tensor, in one pass
:mod:`.settings`         :class:`JudgeSettings`: what the judgement of one check is told, passed whole
=======================  =============================================================================

Isolation (:mod:`msprobe_ci.isolate`), the offline replay (:mod:`msprobe_ci.replay`), collectives and whole modules
call it; it calls the standards (:mod:`msprobe_ci.checkers`) and nothing above them.
"""

import importlib

#: every public name and the submodule that holds it: loaded on first use, so :mod:`.support` and :mod:`.rows`
#: (no torch) stay cheap for the graph and the compare, which never run a reference
_WHERE = {"accumulation_count": "allowances", "accumulation_floor": "allowances", "accumulation_scale": "allowances",
          "FMA": "pair",
          "judge_dropout": "pair", "judge_pair": "pair", "judge_rows": "pair", "judged_as": "pair", "saturate": "pair", "abs_peak": "peaks",
          "finite_peak": "peaks", "outputs": "rows", "DROPOUT": "support", "NOT_COMPARABLE": "support",
          "RANDOM": "support", "UNSUPPORTED_PREFIX": "support", "unjudgeable": "support",
          "JudgeSettings": "settings"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        # kept in the package once loaded: a module's __getattr__ runs on every lookup it misses, and isolation
        # imports judge_pair inside functions that run for every captured call (an import_module each time: 10
        # per isolated call, 80 us of its 690)
        value = globals()[name] = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        return value
    raise AttributeError(f"module 'msprobe_ci.judge' has no attribute {name!r}")
