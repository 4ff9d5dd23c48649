"""Tensor-parallel merging: the rank dumps of one TP group (the same code on shards) into one dump, record by
record: replicated, partial sums (their collective's output) and shards (see :mod:`.merge`)."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any, Iterator

from ..dump.reader import Dump

_STATS = ("Max", "Min", "Mean", "Norm")
_UNCERTAINTY = 1e-6  # msprobe's relative tolerance for non-deterministic Mean/Norm across ranks


def is_tensor_record(rec: Any) -> bool:
    return isinstance(rec, dict) and "dtype" in rec and "shape" in rec


def tensor_records(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """``(path, tensor record)`` of every tensor record in an entry (paths are key/index tuples)."""
    if is_tensor_record(value):
        yield path, value
    elif isinstance(value, dict) and "type" not in value:
        for k, v in value.items():
            yield from tensor_records(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from tensor_records(v, path + (i,))


def record_at(value: Any, path: tuple) -> Any:
    for k in path:
        if isinstance(value, dict) and k in value:
            value = value[k]
        elif isinstance(value, list) and isinstance(k, int) and k < len(value):
            value = value[k]
        else:
            return None
    return value


def stat_number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _close(a: Any, b: Any, rel: float) -> bool:
    x, y = stat_number(a), stat_number(b)
    if x is None or y is None:
        return a == b
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if x == y:
        return True
    return abs(x - y) <= rel * max(abs(x), abs(y))


def _same(a: dict, b: dict) -> bool:
    """Replicated: equal shapes and dtypes, Max/Min exact, Mean/Norm within msprobe's 1e-6."""
    if a.get("shape") != b.get("shape") or a.get("dtype") != b.get("dtype"):
        return False
    return all(_close(a.get(k), b.get(k), 0.0 if k in ("Max", "Min") else _UNCERTAINTY) for k in _STATS)


def _differs(recs: list) -> bool:
    """Tensor records on every rank that are not all replicas of the first."""
    return all(is_tensor_record(r) for r in recs) and not all(_same(recs[0], r) for r in recs[1:])


def _key(rec: dict) -> tuple:
    """Exact identity of a tensor's statistics (a partial sum and the collective input it is)."""
    return (str(rec.get("dtype")), tuple(rec.get("shape") or ()),) + tuple(repr(rec.get(k)) for k in _STATS)


def _shard_stats(recs: list[dict]) -> dict | None:
    vals = {k: [stat_number(r.get(k)) for r in recs] for k in _STATS}
    if any(v is None for vs in vals.values() for v in vs):
        return None
    return {"Max": max(vals["Max"]), "Min": min(vals["Min"]), "Mean": sum(vals["Mean"]) / len(recs),
            "Norm": math.sqrt(sum(v * v for v in vals["Norm"]))}


def _collective_inputs(dump: Dump) -> dict[tuple, list[tuple[int, str]]]:
    """``{statistics key: [(position, collective name)]}`` of the reducing collectives' inputs on one rank."""
    out: dict[tuple, list[tuple[int, str]]] = {}
    for pos, (name, entry) in enumerate(dump.data.items()):
        if not isinstance(entry, dict):
            continue
        if name.startswith("Distributed.all_reduce."):
            arg = record_at(entry, ("input_args", 0))
        elif name.startswith(("Distributed.reduce_scatter_tensor.", "Distributed.reduce_scatter_single.")):
            # torch.distributed's (output, input) or the functional (input, ...): the larger tensor is the input
            tensors = [a for a in entry.get("input_args") or [] if is_tensor_record(a)]
            arg = max(tensors, key=lambda a: math.prod(a.get("shape") or [1])) if tensors else None
        else:
            continue
        if is_tensor_record(arg):
            out.setdefault(_key(arg), []).append((pos, name))
    return out


def _summing(entry: dict) -> bool:
    values = list(entry.get("input_args") or []) + list((entry.get("input_kwargs") or {}).values())
    for v in values:
        if isinstance(v, dict) and v.get("type") == "torch.distributed.ReduceOp":
            return "SUM" in str(v.get("value"))
        if isinstance(v, dict) and v.get("type") == "str":  # a functional collective's reduceOp ("sum")
            return str(v.get("value")).lower() == "sum"
    return True  # the default op


def _reduced(dumps: list[Dump], names_: list[str]) -> tuple[dict | None, bool]:
    """The value a partial sum stands for: an all_reduce's output (replicated), or the merged shards of a
    reduce_scatter's outputs. Returns ``(record, is_shard)``."""
    outs = [record_at(d.data.get(n), ("output", 0)) for d, n in zip(dumps, names_)]
    if not all(is_tensor_record(o) for o in outs):
        return None, False
    if names_[0].startswith("Distributed.all_reduce."):
        return outs[0], False
    stats = _shard_stats(outs)
    return (dict(outs[0], **stats), True) if stats else (None, False)


def merge_tp(dumps: list[Dump], ranks: list[int]) -> tuple[Dump, dict[int, tuple], dict[int, int]]:
    """Merge the dumps of one TP group (same code on shards) into one; see the module docstring.

    Returns:
        ``(dump, shards, replicas)``: the merged dump (``merge_notes`` filled), ``{id(record): (shard count, the
        first rank's statistics or None)}`` for records merged from shards (:func:`align_shapes` may take a record
        back to the first rank's values) and ``{id(record): rank count}`` for records equal on every rank
        (:func:`align_shapes` may find them to be shards of equal value).
    """
    first = dumps[0]
    if len(dumps) == 1:
        return replace(first, merge_notes=dict(getattr(first, "merge_notes", {}) or {})), {}, {}
    collectives = [_collective_inputs(d) for d in dumps]
    positions = [{n: i for i, n in enumerate(d.data)} for d in dumps]
    notes: dict[str, list[str]] = {}
    shards: dict[int, tuple] = {}
    replicas: dict[int, int] = {}
    data: dict[str, Any] = {}
    for name in _ordered_union([list(d.data) for d in dumps]):
        present = [i for i, d in enumerate(dumps) if name in d.data]
        if len(present) < len(dumps):
            src = present[0]
            data[name] = dumps[src].data[name]
            notes.setdefault(name, []).append(f"Only ranks {[ranks[i] for i in present]} of TP group {ranks} "
                                              "recorded this call; their first record is shown.")
            continue
        differing = [path for path, _ in tensor_records(first.data[name])
                     if _differs([record_at(d.data[name], path) for d in dumps])]
        if not differing:  # replicated as a whole: shared, not copied
            data[name] = first.data[name]
            replicas.update((id(rec), len(dumps)) for _, rec in tensor_records(data[name]))
            continue
        entry = copy.deepcopy(first.data[name])
        data[name] = entry
        split = set(differing)
        replicas.update((id(rec), len(dumps)) for path, rec in tensor_records(entry) if path not in split)
        merged_rows: list[str] = []
        for path in differing:
            rec = record_at(entry, path)
            others = [record_at(d.data[name], path) for d in dumps]
            row = row_label(path)
            hits = [collectives[i].get(_key(o), []) for i, o in enumerate(others)]
            reduced_by = _first_common_later(hits, [positions[i][name] for i in range(len(dumps))])
            if reduced_by is not None:
                value, is_shard = _reduced(dumps, [reduced_by] * len(dumps))
                if value is not None:
                    _set(entry, path, dict(rec, **{k: value.get(k) for k in _STATS}, shape=value.get("shape")))
                    if is_shard:
                        shards[id(record_at(entry, path))] = (len(dumps), None)
                    what = "partial sums" if _summing(first.data[reduced_by]) else "partial values"
                    merged_rows.append(f"{row}: {what} on ranks {ranks}; the reduced value is the output "
                                       f"of {reduced_by}")
                    continue
            stats = _shard_stats(others)
            if stats is None:
                continue
            new = dict(rec, **stats)
            _set(entry, path, new)
            shards[id(new)] = (len(dumps), {k: rec.get(k) for k in _STATS})
            merged_rows.append(f"{row}: shards of ranks {ranks}: Max = max, Min = min, Mean = mean of means, "
                               "Norm = sqrt(sum of Norm^2)")
        if merged_rows:
            notes[name] = [f"Merged from the tensor-parallel ranks {ranks}."] + merged_rows
    merged = replace(first, data=data, construct=_union_dicts([d.construct for d in dumps]),
                     stack=_union_dicts([d.stack for d in dumps]), merge_notes=notes)
    return merged, shards, replicas


def row_label(path: tuple) -> str:
    """msprobe's row suffix of a record path (``("input_args", 1)`` → ``input.1``)."""
    head = {"input_args": "input", "input_kwargs": "input"}.get(str(path[0]), str(path[0])) if path else ""
    return ".".join([head] + [str(p) for p in path[1:]])


def _first_common_later(hits: list[list[tuple[int, str]]], positions: list[int]) -> str | None:
    """The first collective, by name on every rank, at or after the row's entry, whose input it is."""
    common = None
    for (pos, h) in zip(positions, hits):
        later = {n for p, n in h if p >= pos}
        common = later if common is None else common & later
    if not common:
        return None
    return min(common, key=lambda n: next(p for p, nn in hits[0] if nn == n))


def _set(entry: Any, path: tuple, value: Any) -> None:
    parent = record_at(entry, path[:-1])
    parent[path[-1]] = value


def _ordered_union(orders: list[list[str]]) -> list[str]:
    """Names of several orders, the first order's kept and others' extra names after their predecessor."""
    out = list(orders[0])
    seen = set(out)
    for order in orders[1:]:
        after: dict[str | None, list[str]] = {}
        prev = None
        for n in order:
            if n in seen:
                prev = n
                continue
            after.setdefault(prev, []).append(n)
            seen.add(n)
        if not after:
            continue
        res = list(after.get(None, []))
        for n in out:
            res.append(n)
            res.extend(after.get(n, []))
        out = res
    return out


def _union_dicts(ds: list[dict]) -> dict:
    out: dict = {}
    for d in ds:
        for k, v in d.items():
            out.setdefault(k, v)
    return out
