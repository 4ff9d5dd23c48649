"""Node verdicts from isolation; whole-network drift kept as context.

Inputs: a :class:`~msprobe_ci.compare.CompareReport` (target vs bench, every row matched by name, drift verdicts
from :mod:`.verdict`) and the target's ``isolation.json`` (written by capture with an
:class:`~msprobe_ci.isolate.Isolator`). Rules:

* **API node** (forward or backward) with an isolation record: its status is the isolated status (the API's own
  standard on its own inputs). A skipped isolation passes, with the reason in the message.
* **Sources**: an API forward node whose input is a source (a parameter, buffer, model input or constant tensor
  no captured API produced, or a non-tensor argument) fails when that input differs from the bench's beyond what
  the dtype conversion explains: relative error (tensor, or the statistics stand-in) above
  ``source_factor × u`` (u: unit roundoff of the coarser of the two dtypes; default factor 4 = conversion rounding
  plus the statistics' own accumulation), a non-tensor argument that differs (floats beyond the same bound; an
  ``finfo`` constant of either dtype equals its counterpart). A source is judged once, at the first node that
  consumes it.
* **Module node**: judged whole where it was isolated whole (L0 capture, compiled regions); fails when a node
  inside it (construct.json ancestry) fails, naming it; otherwise passes.
* An API call budgeted isolation left out this step (its record's ``budget`` is True,
  :mod:`msprobe_ci.isolate.budget`) keeps the drift rule's verdict, as ``msprobe-ci compare`` of plain dumps
  gives it, and says so; where that rule is not calibrated (an in-place optimizer update, any call after a loop's
  first step: ``source_factor`` infinite) its drift error is a warning.
* Everything else (parameters_grad, API calls isolation skipped or never saw) passes: drift alone never fails a
  node; it stays in ``metrics`` (``drift_status``, ``drift_RelativeErr``) as context.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any, Mapping

from ..dtypes import finite_max
from ..dump import names
from .isolation_file import IsolationRecord
from .verdict import CompareResult, unit_roundoff

_STAT_U = 2.0 ** -24  # capture takes the statistics of fp32, fp16 and bf16 tensors in fp32 (fp64's in fp64)
_FINFO_CONSTANTS: dict[float, frozenset] = {}


def _in_place(name: str) -> bool:
    """Whether node ``name`` is an in-place call (``Tensor.addcdiv_.3.forward``; not a dunder ``__add__``)."""
    parts = name.split(".")
    return len(parts) > 1 and parts[1].endswith("_") and not parts[1].endswith("__")


def replay(target, bench_kernel: str = "device", standards: dict | None = None,
           thresholds: dict | None = None) -> list:
    """Every dumped API call of a tensor dump, forward and backward, replayed on CPU on its dumped inputs against
    the oracle and judged by its own standard (:class:`~msprobe_ci.replay.ApiReplayer`, the per-API pre-check):
    one :class:`~msprobe_ci.replay.result.ApiResult` each; a call that cannot be replayed (no such API here, a
    communication op, a missing tensor file) is a skip with its reason. Empty for a dump that is not PyTorch's
    (no MindSpore here)."""
    from ..replay import ApiReplayer

    if getattr(target, "framework", "pytorch") != "pytorch":
        return []
    replayer = ApiReplayer(target, bench_kernel=bench_kernel, standards=dict(standards or {}),
                           thresholds=dict(thresholds or {}))
    return [replayer.check(n) for n in replayer.api_names()]


def replay_isolation(results: list) -> dict[str, IsolationRecord] | None:
    """Isolation records for a tensor dump made without them (msprobe's own, another runner's) from its calls
    replayed (:func:`replay`): the verdict of each is its record, as a live capture's would be.

    Returns:
        ``{node: record}`` in :func:`~msprobe_ci.compare.isolation_file.load_isolation`'s form, ``replayed`` set in each record; ``None`` where
        nothing could be judged, so the drift rule decides rather than every node passing as "not isolated".
    """
    from ..isolate import verdict_fields

    records: dict[str, IsolationRecord] = {}
    for res in results:
        rec: dict[str, Any] = {"status": res.status, "replayed": True}
        bad = next(((row, r) for row, r in res.outputs if r.status == res.status), None)
        if res.status == "skip" or bad is None:
            rec["message"] = res.reason or res.message
        else:
            rec.update(verdict_fields(*bad, note=" (replayed from the tensor dump)"))
        records[res.name] = IsolationRecord.from_json(rec, f"replayed {res.name}")
    return records if any(r.status != "skip" for r in records.values()) else None


def is_tensor_dump(dump) -> bool:
    """Whether a dump holds tensor files (task ``tensor``): some entry names a ``data_name``."""
    def has(value, depth=0):
        if isinstance(value, dict):
            return "data_name" in value or (depth < 6 and any(has(v, depth + 1) for v in value.values()))
        if isinstance(value, list) and depth < 6:
            return any(has(v, depth + 1) for v in value)
        return False
    return any(has(entry) for entry in dump.data.values())


def _finfo_roles() -> dict[float, frozenset]:
    """``{value: roles}``: each floating dtype's ``finfo`` constants by what they are (``max``, ``min`` (= -max),
    ``eps``, ``tiny``, ``-tiny``); one value may play several roles (float16's and bfloat16's differ)."""
    if not _FINFO_CONSTANTS:
        import torch

        roles: dict[float, set] = {}
        for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            fi = torch.finfo(dt)
            for role, v in (("max", fi.max), ("min", fi.min), ("eps", fi.eps), ("tiny", fi.tiny),
                            ("-tiny", -fi.tiny)):
                roles.setdefault(float(v), set()).add(role)
        _FINFO_CONSTANTS.update({v: frozenset(r) for v, r in roles.items()})
    return _FINFO_CONSTANTS


def _scalar_differs(t: Any, b: Any, tol: float, t_max: float = math.inf) -> bool:
    """Scalars differ beyond ``tol`` (relative). Not a difference:

    * the same ``finfo`` constant of each side's dtype (``finfo(float16).min`` against ``finfo(float32).min`` as a
      mask value): the same role (max, min, eps, tiny), never one constant for another (fp16 ``eps`` is not fp32
      ``max``);
    * a bench value beyond ``t_max`` (the narrowest range of the target's data) against a target value of the
      same sign in the top binade of that range, the most the target could hold (T5 clamps fp16 activations at
      ``finfo(float16).max - 1000``); a target value further down is a difference.
    """
    if t == b:
        return False
    if isinstance(t, bool) or isinstance(b, bool) or not isinstance(t, (int, float)) or \
            not isinstance(b, (int, float)):
        return str(t) != str(b)
    t, b = float(t), float(b)
    if math.isnan(t) or math.isnan(b):
        return not (math.isnan(t) and math.isnan(b))  # NaN against a number differs (every comparison was False)
    roles = _finfo_roles()
    if roles.get(t, frozenset()) & roles.get(b, frozenset()):
        return False  # a dtype's own constant (finfo(dtype).min as a mask value) on each side
    if abs(b) > t_max >= abs(t) >= t_max / 2 and math.copysign(1, t) == math.copysign(1, b):
        return False
    return abs(t - b) > tol * max(abs(b), 1e-30)


def _call_site(frames: list | None) -> str | None:
    """The innermost frame of a stack entry as ``file basename:line:function`` (paths differ across machines);
    None when unknown."""
    if not frames or not isinstance(frames[0], str):
        return None
    head = frames[0].split("\n", 1)[0].strip().rstrip(",")
    parts = [p.strip() for p in head.split(", ")]
    if len(parts) < 3 or not parts[0].startswith("File "):
        return None
    return f"{os.path.basename(parts[0][5:])}:{parts[1]}:{parts[2]}"


def apply_isolation(report, isolation: Mapping[str, IsolationRecord | Mapping], construct: dict[str, Any] | None = None,
                    source_factor: float = 4.0, cast_roundoff: float = 0.0, bench_stack: dict | None = None,
                    bench_data: dict | None = None):
    """Replace the report's node verdicts by the isolated ones (see the module docstring); in place.

    Args:
        report: the :class:`~msprobe_ci.compare.CompareReport` of the target against the bench.
        isolation: the target's isolation records (:func:`~msprobe_ci.compare.isolation_file.load_isolation`;
            a JSON object is read as an :class:`~msprobe_ci.compare.isolation_file.IsolationRecord`).
        construct: the target's construct.json (``{node: parent}``) for the module roll-up.
        source_factor: sources may differ by ``source_factor × u`` (default 4).
        cast_roundoff: unit roundoff of the dtypes the sides' models and inputs were cast to (a bf16 target's
            buffers are bf16 even where the model later upcasts them): ``u`` is at least this.
        bench_stack: the bench's stack.json (``{entry: [frames]}``). Where a node's innermost frame differs from
            the target's (``report.target_stack``), the two calls of that name are different calls (code that
            branches on the dtype, as T5's fp16-only clamp, shifts the call counters): the target call's scalar
            arguments are compared with those of the bench call of the same API made at the same place, the same
            number of times before (``bench_data``: the bench's dump.json entries); its tensor sources are not
            compared, and a call the bench never made at that place has nothing to be compared with.
        bench_data: the bench dump's entries (``{entry: record}``), for the scalar sources of such a call.

    Returns:
        The same report, ``report.isolated`` set to ``True``.
    """
    construct = construct or {}
    isolation = {name: IsolationRecord.of(rec, f"isolation record {name}") for name, rec in isolation.items()}
    rows_by_name = {rr.target.name: rr for rr in report.rows}
    t_max = min((finite_max(rr.target.dtype) or math.inf for rr in report.rows if rr.target.is_tensor),
                default=math.inf)
    seen_sources: set[str] = set()
    sites = None  # (target index, bench index, target stack) by call site, for calls a branch shifted
    new_nodes: list[CompareResult] = []
    failing_api: list[str] = []  # in report order: the first one names its modules
    for node in report.nodes:
        rec = isolation.get(node.name)
        drift = {"drift_status": node.status, "drift_RelativeErr": node.value, "drift_threshold": node.threshold}
        if rec is None and names.is_api(node.name) and node.status in ("warning", "error"):
            # no isolation record (a call isolation did not see or skipped): drift alone never fails a node
            new_nodes.append(replace(node, status="pass", metrics=dict(node.metrics, **drift),
                                     message=f"{node.name}: not isolated; drift {node.status} ({node.message})"))
            continue
        if rec is None or not (names.is_api(node.name) or names.is_module(node.name)):
            new_nodes.append(node)
            continue
        src = None
        if rec.sources and _same_call(node.name, report, bench_stack):
            src = _judge_sources(node.name, rec.sources, rows_by_name, seen_sources, source_factor,
                                 cast_roundoff, t_max)
        elif rec.sources and bench_data:
            if sites is None:  # built once, on the first call a branch shifted
                t_stack = getattr(report, "target_stack", None) or {}
                sites = (_by_site(t_stack), _by_site(bench_stack or {}), t_stack)
            twin = _site_twin(node.name, *sites)
            if twin is not None and isinstance(bench_data.get(twin), dict):
                src = _judge_twin_scalars(node.name, twin, rec.sources, rows_by_name, bench_data[twin],
                                          source_factor * max(cast_roundoff, 2.0 ** -24) + 1e-7, t_max)
        if src is not None:
            new_nodes.append(replace(src, metrics=dict(node.metrics, **drift, isolated=True, standard="source",
                                                       **({"rank": rec.rank} if rec.rank is not None else {}))))
            failing_api.append(node.name)
            continue
        status = rec.status
        value, threshold = _float(rec.value), _float(rec.threshold)
        if status == "skip" and rec.budget:
            # left out by budgeted isolation this step: the drift rule's verdict is the node's, as without
            # isolation, where that rule was calibrated (a step's forward and backward from the bench's weights);
            # an optimizer's in-place update, or any call after a loop's first step (weights trained apart),
            # drifts by design: there its drift error is a warning
            held, why = node.status, ""
            if held == "error" and (not math.isfinite(source_factor) or _in_place(node.name)):
                held, why = "warning", " (a warning: the drift rule is not calibrated on an optimizer's update or " \
                                       "after a loop's first step)"
            new_nodes.append(replace(node, status=held, metrics=dict(node.metrics, **drift, budget=True),
                                     message=f"{node.name}: {rec.message}; drift {node.status}{why}"
                                             + (f" ({node.message})" if node.message else "")))
            if held == "error":
                failing_api.append(node.name)
            continue
        if status == "skip":
            msg = f"{node.name}: not isolated ({rec.message}); drift {node.status}"
            new_nodes.append(CompareResult(name=node.name, status="pass", metric="isolation", value=0.0,
                                           threshold=math.inf, budget=math.inf, input_error=node.input_error,
                                           worst_row=node.worst_row, passing_threshold=0.0,
                                           metrics=dict(node.metrics, **drift), message=msg))
            continue
        metric, row = str(rec.metric or rec.standard), str(rec.row or node.worst_row)
        msg = (f"{node.name}: {rec.standard} standard on its own inputs: {metric} "
               f"{_fmt(value)} {'>' if status == 'error' else '<='} {_fmt(threshold)} at {row} "
               f"({rec.message})")
        new_nodes.append(CompareResult(
            name=node.name, status=status, metric=metric,
            value=value, threshold=threshold, budget=threshold, input_error=node.input_error,
            worst_row=row,
            passing_threshold=value,
            metrics=dict(node.metrics, **drift, standard=rec.standard, isolated=True,
                         **({"rank": rec.rank} if rec.rank is not None else {}), **_errors_of(rec)), message=msg))
        if status == "error":
            failing_api.append(node.name)
    # module roll-up
    module_fail: dict[str, str] = {}
    for api in failing_api:
        parent = construct.get(api)
        hops = 0
        while parent and hops < 1000:
            module_fail.setdefault(parent, api)
            parent = construct.get(parent)
            hops += 1
    has_isolated_child: set[str] = set()
    for name in isolation:
        parent = construct.get(name)
        hops = 0
        while parent and hops < 1000:
            has_isolated_child.add(parent)
            parent = construct.get(parent)
            hops += 1
    final = []
    for node in new_nodes:
        if node.name in isolation and node.metrics.get("isolated") and node.name.startswith("Module."):
            if node.status != "error" and node.name in module_fail:
                api = module_fail[node.name]
                node = replace(node, status="error", metrics=dict(node.metrics, rollup=api),
                               message=f"{node.name}: contains failing node {api}")
        elif ".parameters_grad" in node.name and node.status in ("warning", "error"):
            node = replace(node, status="pass", metrics=dict(node.metrics, drift_status=node.status),
                           message=f"{node.name}: accumulated from isolated backward calls; drift {node.status}")
        elif node.name.startswith("Module.") and node.status != "unmatched":
            # a module whose whole isolation was skipped has its drift in its metrics already
            drift = {k: node.metrics[k] for k in _DRIFT} if "drift_status" in node.metrics else \
                {"drift_status": node.status, "drift_RelativeErr": node.value, "drift_threshold": node.threshold}
            if node.name in module_fail:
                api = module_fail[node.name]
                node = CompareResult(name=node.name, status="error", metric="contains", value=node.value,
                                     threshold=node.threshold, budget=node.budget, input_error=node.input_error,
                                     worst_row=node.worst_row, passing_threshold=node.value,
                                     metrics=dict(node.metrics, **drift, rollup=api),
                                     message=f"{node.name}: contains failing API {api}")
            else:  # nothing inside fails on its own inputs: drift is context
                inside = "every isolated API inside passes" if node.name in has_isolated_child else \
                    "no isolated call inside"
                node = replace(node, status="pass", metrics=dict(node.metrics, **drift),
                               message=f"{node.name}: {inside}; drift {drift['drift_status']}")
        final.append(node)
    report.nodes = final
    report.isolated = True
    report.seconds = _seconds(isolation, construct)
    return report


_DRIFT = ("drift_status", "drift_RelativeErr", "drift_threshold")


def _seconds(isolation: Mapping[str, IsolationRecord], construct: dict[str, Any]) -> dict[str, float]:
    """Seconds each node's isolated verdict took: an API's own (running it, its oracle and bench, judging); a
    module's own when isolated whole, plus those of the calls inside it."""
    out: dict[str, float] = {}
    for name, rec in isolation.items():
        sec = _float(rec.seconds)
        if not sec or not math.isfinite(sec):
            continue
        node, hops = name, 0
        while node is not None and hops < 10_000:
            out[node] = out.get(node, 0.0) + sec
            node, hops = construct.get(node), hops + 1
            if not isinstance(node, str):
                break
    return out


def _same_call(name: str, report, bench_stack: dict | None) -> bool:
    """The bench's call of this name was made where the target's was (True when either stack is unknown)."""
    if not bench_stack:
        return True
    bench_name = (getattr(report, "entry_pairs", None) or {}).get(name, name)
    t_site = _call_site((getattr(report, "target_stack", None) or {}).get(name))
    if t_site is not None and bench_name not in bench_stack:
        return False  # the bench made no call of that name: a branch shifted the counters
    b_site = _call_site(bench_stack.get(bench_name))
    return t_site is None or b_site is None or t_site == b_site


def _by_site(stack: dict) -> dict[tuple, list[str]]:
    """``{(api, direction, call site): [entry names in call order]}`` of a stack.json (``{entry: frames}``)."""
    index: dict[tuple, list[tuple[int, str]]] = {}
    for n, frames in stack.items():
        p = n.rsplit(".", 2)
        site = _call_site(frames) if len(p) == 3 and p[1].isdigit() else None
        if site is not None:
            index.setdefault((p[0], p[2], site), []).append((int(p[1]), n))
    return {k: [n for _, n in sorted(v)] for k, v in index.items()}


def _site_twin(name: str, t_index: dict, b_index: dict, t_stack: dict) -> str | None:
    """The bench call of ``name``'s API and direction made at the target call's place (innermost frame) with as
    many calls of it at that place before: the same call where a branch shifted the counters; None if none.
    ``t_index``/``b_index``: :func:`_by_site` of the two stacks."""
    parts = name.rsplit(".", 2)
    site = _call_site(t_stack.get(name))
    if site is None or len(parts) != 3:
        return None
    key = (parts[0], parts[2], site)
    mine, theirs = t_index.get(key, []), b_index.get(key, [])
    k = mine.index(name) if name in mine else -1
    return theirs[k] if 0 <= k < len(theirs) else None


def _record_at(entry: dict, path: str) -> Any:
    """The record of an input under a dump entry by its row path (``0``, ``2.1``, ``max``), or None."""
    head, *rest = path.split(".")
    args = entry.get("input_args") or []
    value = args[int(head)] if head.isdigit() and int(head) < len(args) else \
        (entry.get("input_kwargs") or {}).get(head)
    for k in rest:
        if not (isinstance(value, list) and k.isdigit() and int(k) < len(value)):
            return None
        value = value[int(k)]
    return value if isinstance(value, dict) else None


def _judge_twin_scalars(name: str, twin: str, sources: dict, rows: dict, bench_entry: dict, tol: float,
                        t_max: float) -> CompareResult | None:
    """The scalar sources of a target call against those of its bench twin at the same place
    (:func:`_site_twin`)."""
    for row_name, info in sources.items():
        if info.get("kind") != "scalar" or not row_name.startswith(f"{name}.input."):
            continue
        rr = rows.get(row_name)
        t = rr.target.record if rr is not None and rr.target is not None else None
        b = _record_at(bench_entry, row_name[len(f"{name}.input."):])
        if not isinstance(t, dict) or b is None or "value" not in t or "value" not in b:
            continue
        tv, bv = t.get("value"), b.get("value")
        if _scalar_differs(tv, bv, tol, t_max):
            return CompareResult(name=name, status="error", metric="source", value=math.inf, threshold=tol,
                                 budget=tol, worst_row=row_name, passing_threshold=math.inf,
                                 message=f"{name}: its input {row_name} (scalar, not computed by any captured API) "
                                         f"differs from the bench's call at the same place ({twin}): value {tv!r} "
                                         f"vs bench {bv!r}")
    return None


def _judge_sources(name: str, sources: dict, rows: dict, seen: set[str], factor: float,
                   cast_u: float = 0.0, t_max: float = math.inf) -> CompareResult | None:
    if not factor < math.inf:  # sources are context (a loop's later steps): never judged, even where u is 0
        return None
    for row_name, info in sources.items():
        sid = str(info.get("id"))
        if sid in seen:
            continue
        seen.add(sid)
        rr = rows.get(row_name)
        if rr is None or rr.bench is None:
            continue
        t, b = rr.target, rr.bench
        u = max(unit_roundoff(t.dtype, b.dtype), cast_u)
        tol = factor * u + 1e-7
        kind = info.get("kind", "tensor")
        if t.is_tensor and b.is_tensor:
            if t.shape != b.shape:
                bad, detail = True, f"shape {t.shape} vs bench {b.shape}"
            else:
                err = rr.error
                why = "dtype conversion"
                if not (t.record.get("data_name") and b.record.get("data_name")):
                    # compared by statistics: the target's Mean and Norm are sums taken in fp32 (capture's
                    # statistics), whose cascade summation errs by up to 2^-24 x log2(n) of the terms (an fp32
                    # weight of 12k elements against an fp64 bench: 3.4e-7 on a bound of 3.38e-7)
                    n = max(int(rr.target.numel), 2)
                    tol += (2.0 ** -53 if "float64" in str(t.dtype) else _STAT_U) * math.log2(n)
                    why += f" and fp32 statistics over {n} elements"
                bad = not (err <= tol)
                detail = f"RelativeErr {_fmt(err)} > {_fmt(tol)} (= {factor:g} x u {u:.3g}, {why})"
        elif not t.is_tensor and not b.is_tensor and t.record is not None and b.record is not None:
            tv, bv = t.record.get("value"), b.record.get("value")
            bad = _scalar_differs(tv, bv, tol, t_max)
            detail = f"value {tv!r} vs bench {bv!r}"
        else:
            continue
        if bad:
            return CompareResult(name=name, status="error", metric="source", value=_float(rr.error),
                                 threshold=tol, budget=tol, worst_row=row_name, passing_threshold=_float(rr.error),
                                 message=f"{name}: its input {row_name} ({kind}, not computed by any captured API) "
                                         f"differs from the bench: {detail}")
    return None


def _float(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _fmt(x: float) -> str:
    return f"{x:.4g}"  # inf, -inf and nan print as such (-inf printed "inf")


def _errors_of(rec: IsolationRecord) -> dict:
    """The target's and the bench's own relative errors from an isolation record's metrics (benchmark standard:
    ``target_max_rel_err``, ``bench_max_rel_err``, the means), so a lead can set each call's error beside its
    bench's; empty for the other standards."""
    m = rec.metrics
    return {k: m[k] for k in ("target_max_rel_err", "bench_max_rel_err", "target_mean_rel_err", "bench_mean_rel_err")
            if isinstance(m.get(k), (int, float))}
