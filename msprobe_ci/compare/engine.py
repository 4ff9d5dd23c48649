"""Full-network compare: every row of target vs bench, matched by name, msprobe's metrics, our node verdicts.

This module orchestrates: match the rows (:mod:`.rows`), compare each pair (:func:`compare_row`, msprobe's
metrics from :mod:`.metrics`), judge each node (:func:`msprobe_ci.compare.drift.judge_node`), blame the first
cause (:func:`_blame_first`). The result is a :class:`~msprobe_ci.compare.report.CompareReport`; its CSV is
:mod:`.csvout`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

from ..dtypes import smallest_normal
from ..dump.reader import Dump
from ..errors import MsprobeError
from . import metrics as M
from .drift import carried_range, carried_roundoff, dtype_max, judge_node
from .report import CompareReport, RowResult, accumulated
from .rows import Row, match_rows
from .verdict import CompareResult, Thresholds


def compare_mode(target: Dump, bench: Dump) -> str:
    if target.task != bench.task:
        if {target.task, bench.task} <= {"statistics", "tensor"}:
            return "md5" if target.summary_mode == "md5" and bench.summary_mode == "md5" else "statistics"
        raise MsprobeError(f"dump tasks differ: target {target.task!r} vs bench {bench.task!r}")
    if target.task == "tensor":
        return "tensor"
    if target.summary_mode == "md5" and bench.summary_mode == "md5":
        return "md5"
    return "statistics"


def compare_dumps(*, bench: Dump, target: Dump, fuzzy: bool = False,
                  thresholds: Thresholds | None = None, mappings: Any = None) -> CompareReport:
    """Compare a target dump against a bench dump.

    Args:
        bench: the reference (msprobe's "Bench"/golden side).
        target: the dump under test (msprobe's "NPU" side). Both sides by name only: a call cannot exchange them.
        fuzzy: ignore call indices when matching (``-fm``).
        thresholds: node-rule factors; defaults as documented in :mod:`msprobe_ci.compare.verdict`.
        mappings: msprobe's mapping files (:class:`~msprobe_ci.compare.crossframe.Mappings`: ``-dm``, ``-lm``,
            ``-cm``, ``-am``). A MindSpore dump against a PyTorch one (either side) is matched across frameworks
            automatically (:mod:`msprobe_ci.compare.crossframe`); the files refine it.

    Returns:
        A :class:`CompareReport`; ``bool(report)`` is true when no node is an error.

    Raises:
        MsprobeError: incompatible dumps, or (tensor mode) a missing or non-tensor ``.pt`` file.
    """
    th = thresholds or Thresholds()
    mode = compare_mode(target, bench)
    t_fw, b_fw = getattr(target, "framework", "pytorch"), getattr(bench, "framework", "pytorch")
    cross = None
    if t_fw != b_fw and "mindspore" in (t_fw, b_fw):
        from .crossframe import translate

        cross = translate(target.data, bench.data, mappings, target_is_mindspore=t_fw == "mindspore")
    elif mappings is not None and (getattr(mappings, "layer", None) or getattr(mappings, "cell", None)):
        from .crossframe import layer_translation

        cross = layer_translation(target.data, bench.data, mappings)
    pairs = match_rows(target.data, bench.data, fuzzy=fuzzy, cross=cross,
                       data_map=getattr(mappings, "data", None) or None)
    rows: list[RowResult] = []
    reach = math.inf
    for t, b in pairs:
        reach = carried_range(t, b, reach)
        rows.append(compare_row(t, b, mode, target, bench, reach))
    by_entry: dict[str, list[RowResult]] = {}
    for rr in rows:
        by_entry.setdefault(rr.target.entry, []).append(rr)
    nodes, floor = [], 0.0
    for name in target.data:
        own = by_entry.get(name, [])
        floor = carried_roundoff(own, floor)
        nodes.append(judge_node(name, own, by_entry, mode, th, floor))
    entry_pairs: dict[str, str] = {}
    for t, b in pairs:
        if b is not None:
            entry_pairs.setdefault(t.entry, b.entry)
    return CompareReport(mode=mode, rows=rows, nodes=_blame_first(nodes, th), target_stack=target.stack,
                         thresholds=th, frameworks=(t_fw, b_fw), entry_pairs=entry_pairs)


def _blame_first(nodes: list[CompareResult], th: Thresholds) -> list[CompareResult]:
    """After the first error, an error node whose inputs differ from the bench's at all (input error above 0), or
    are not in the dump (an accumulated parameter gradient whose module's incoming gradient is unseen), is
    explained by what came before: it becomes a warning "propagated from X" (X: the first divergence). An error on
    inputs equal to the bench's stays an error (a second, independent divergence).

    Without isolation (two dumps on disk) this is the best attribution available: whole-network differences
    cannot tell a node's own error from an amplified one, and statistics understate what an input carries element
    by element (a fault's noise two layers on moved a GPT-2 projection's inputs' statistics by 1u in fp16 and its
    output's Max by 6u), so later blame goes to the first cause; fix it and run again to see a second one."""
    first = None
    out = []
    for n in nodes:
        if n.status == "error" and n.metric == "RelativeErr":
            if first is None:
                if not accumulated(n.name):
                    first = n.name
            elif n.input_error > 0.0 or n.metrics.get("inputs_unseen"):
                n = replace(n, status="warning", message=f"{n.name}: propagated from {first} ({n.message})",
                            metrics=dict(n.metrics, propagated_from=first))
        out.append(n)
    return out


def compare_row(t: Row, b: Row | None, mode: str, target: Dump, bench: Dump, reach: float = math.inf) -> RowResult:
    """One row's metrics and relative error. ``reach``: :func:`carried_range` up to this row (statistics are
    compared within the smaller of it and the target dtype's range)."""
    if b is None:
        return RowResult(t, None, {}, math.nan)
    if t.record is None or b.record is None:
        both_none = t.record is None and b.record is None
        cols = {c: M.UNSUPPORTED for c in M.TENSOR_COLUMNS} if mode == "tensor" else \
            M.stats_metrics(t.stats(), b.stats())
        return RowResult(t, b, cols, 0.0 if both_none else math.inf, 0.0 if both_none else math.nan)
    if not t.is_tensor or not b.is_tensor:
        tv, bv = t.stats()[0], b.stats()[0]
        err = 0.0 if str(tv) == str(bv) else _scalar_err(tv, bv)
        cols = {c: M.UNSUPPORTED for c in M.TENSOR_COLUMNS} if mode == "tensor" else \
            M.stats_metrics(t.stats(), b.stats())
        return RowResult(t, b, cols, err, err if math.isfinite(err) else math.nan)
    if mode == "md5":
        return RowResult(t, b, {}, 0.0 if t.md5 == b.md5 else 1.0)
    if mode == "tensor" and t.data_name != "-1" and b.data_name != "-1":
        tn = M.to_array(target.load_tensor(t.data_name, t.record.get("shape")))
        bn = M.to_array(bench.load_tensor(b.data_name, b.record.get("shape")))
        if _transposed(t, b):  # PyTorch's linear hands back dW transposed; paired by shape across frameworks
            bn = bn.T
        elif _regrouped(t, b):
            bn = bn.reshape(tn.shape)
        cols = M.tensor_metrics(tn, bn)
        return RowResult(t, b, cols, M.relative_error_arrays(tn, bn, _tiny(t.dtype, b.dtype)))
    if t.shape != b.shape and not _transposed(t, b) and not _regrouped(t, b):
        return RowResult(t, b, M.stats_metrics(t.stats(), b.stats()), math.inf)
    ts, bs = t.stats(), b.stats()
    t_max = dtype_max(t.dtype)
    if reach < t_max:
        t_max = reach
    # a bench value past half the range is a sentinel (a mask filled with finfo.min, on either side's dtype): no
    # computation lands there short of overflowing, and it swamps the Mean, the Norm and their RMS floor, which
    # then say nothing of the values it masks (fp32 scores + finfo(float32).min on both sides: a 1% fault in the
    # scores moved their Max alone, by 1%, and their drift error read 4e-42)
    t_max *= 0.5
    tiny = _tiny(t.dtype, b.dtype)
    cols, err = M.stats_pair(ts, bs, t.numel, t_max, tiny)
    return RowResult(t, b, cols, err, M.norm_error(ts, bs, t.numel, t_max, tiny) if err else 0.0)


@functools.lru_cache(maxsize=256)
def _tiny(t_dtype: str, b_dtype: str) -> float:
    return smallest_normal(t_dtype, b_dtype)


def _regrouped(t: Row, b: Row) -> bool:
    """A backward row of the same size in another shape. An API's backward record is the gradient its last
    autograd node hands back (msprobe records it so), and which node ends a composite API can depend on the dtype:
    CPU ``scaled_dot_product_attention`` in fp16 ends in a cast of a ``[2, 4, 16, 8]`` gradient, in fp32 in a view
    of an ``[8, 16, 8]`` one. Same values: statistics do not depend on the shape, tensors compare flattened."""
    return ".backward" in t.entry and t.numel == b.numel and t.shape != b.shape


def _transposed(t: Row, b: Row) -> bool:
    """Both 2-D tensors whose shapes are each other's transpose (and not equal)."""
    ts, bs = (list(r.record.get("shape") or []) if r.is_tensor else [] for r in (t, b))
    return len(ts) == 2 and ts != bs and ts == bs[::-1]


def _scalar_err(tv: Any, bv: Any) -> float:
    try:
        t, b = float(tv), float(bv)
    except (TypeError, ValueError):
        return math.inf
    if math.isnan(t) and math.isnan(b):
        return 0.0
    return abs(t - b) / max(abs(b), 1e-12)
