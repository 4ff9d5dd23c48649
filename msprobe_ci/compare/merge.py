"""Merge the rank dumps of a tensor/pipeline-parallel run into one dump per data-parallel group, so a TP=2 or PP=2
target can be compared with a TP=1/PP=1 bench (``msprobe graph_visualize --rank_size --tp --pp``).

Ranks and groups follow Megatron's default order ``tp-dp-pp`` (tp varies fastest: rank = tp_i + tp * (dp_i + dp *
pp_i)); ``order`` names another. Merging works on statistics (``Max``/``Min``/``Mean``/``Norm``), one data-parallel
group at a time:

**Tensor parallel** (the ranks of one TP group ran the same code on shards; entries pair by name). For each tensor
record, over the group's ranks:

* equal on every rank (``Max``/``Min`` exactly, ``Mean``/``Norm`` within a relative 1e-6, msprobe's tolerance for
  non-deterministic reductions): **replicated**, kept as is, unless the other side of the compare has it with one
  dimension ``n`` times longer: then it was ``n`` shards of equal value (a zero-initialised column-parallel bias)
  and takes that shape with ``Norm`` × sqrt(n) (:func:`align_shapes`);
* different, and on every rank equal to the input of a later ``all_reduce`` (or ``reduce_scatter_tensor``) on the
  same rank: a **partial sum** (a row-parallel matmul's output, a column-parallel input gradient; with a max
  reduction, a vocab-parallel local maximum); it stands for the reduced value, so it takes the collective's output
  (for reduce_scatter, the merged shards of its outputs);
* otherwise a **shard**: ``Max`` = max, ``Min`` = min, ``Mean`` = the mean of the means (shards are equal-sized),
  ``Norm`` = sqrt(sum of Norm²). The full shape is the shard's with the one dimension the compare's other side
  says was split (:func:`align_shapes`); without another side it stays the shard's shape. Where the other side,
  unsplit, has the very same shape, the record was no shard (ranks that differ in the last bits): it takes back
  the first rank's statistics.

**Pipeline parallel** (the ranks of one PP group each ran a stage, in group order). Module containers numbered per
stage (``layers.0`` on every stage, Megatron's local numbering) are renumbered by the layers of earlier stages;
API call counters (``Functional.linear.N``, ``Distributed.send.N``) likewise by each API's calls on earlier stages.
A module present on several stages (the root, wrappers) becomes one entry: forward inputs from the first stage and
outputs from the last; backward the other way round. Entries are ordered as the whole model ran: every stage's
forward in stage order, then the backward in reverse stage order (one micro-batch per stage).

Every merged entry carries human-readable notes (``Dump.merge_notes``; the graph's ``parallel_merge_info``), and
the renaming of every rank's entries is kept (isolation records follow their node).
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from ..dump import names
from ..dump.reader import Dump
from ..errors import MsprobeError

_STATS = ("Max", "Min", "Mean", "Norm")
_UNCERTAINTY = 1e-6  # msprobe's relative tolerance for non-deterministic Mean/Norm across ranks
_DIMS = ("tp", "dp", "pp")


@dataclass(frozen=True)
class Parallel:
    """One side's parallel layout.

    Attributes:
        rank_size: ranks of the run (world size).
        tp, pp: tensor- and pipeline-parallel sizes (data parallel = rank_size / (tp * pp)).
        order: the dimensions from fastest to slowest varying, ``-``-separated (default ``tp-dp-pp``;
            Megatron's ``tp-cp-ep-dp-pp`` is accepted, cp and ep being 1).

    Raises:
        MsprobeError: a size below 1, ``tp * pp`` not dividing ``rank_size``, or an unknown order.
    """

    rank_size: int
    tp: int = 1
    pp: int = 1
    order: str = "tp-dp-pp"

    def __post_init__(self):
        for key in ("rank_size", "tp", "pp"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MsprobeError(f"--{key}: expected a positive integer, got {v!r}")
        if self.rank_size % (self.tp * self.pp):
            raise MsprobeError(f"--rank_size {self.rank_size} is not divisible by --tp {self.tp} x --pp {self.pp}")
        dims = [d for d in self.order.split("-") if d not in ("cp", "ep")]
        if sorted(dims) != sorted(_DIMS):
            raise MsprobeError(f"--order {self.order!r}: expected the dimensions tp, dp and pp (e.g. tp-dp-pp)")

    @property
    def dp(self) -> int:
        return self.rank_size // (self.tp * self.pp)

    def rank(self, tp: int, dp: int, pp: int) -> int:
        dims = [d for d in self.order.split("-") if d in _DIMS]
        pos = {"tp": tp, "dp": dp, "pp": pp}
        rank, stride = 0, 1
        for d in dims:
            rank += pos[d] * stride
            stride *= getattr(self, d)
        return rank

    def groups(self) -> list[list[list[int]]]:
        """Per data-parallel group, its pipeline stages in order, each the ranks of one TP group in TP order."""
        return [[[self.rank(t, d, p) for t in range(self.tp)] for p in range(self.pp)] for d in range(self.dp)]


@dataclass
class Merged:
    """One data-parallel group merged into one model's dump.

    Attributes:
        dump: the merged :class:`Dump` (``folder`` is the group's first rank folder; ``merge_notes`` filled).
        ranks: the group's ranks (stage by stage, TP order within a stage).
        renames: ``{rank: {entry name on that rank: merged entry name}}`` (identity names included).
        shards: ``{id(record): (number of shards, first rank's statistics)}`` of records merged as shards (for
            :func:`align_shapes`).
        replicas: ``{id(record): number of ranks}`` of records equal on every rank of their TP group (replicated,
            or shards of equal value: :func:`align_shapes` tells them apart by the other side's shape).
    """

    dump: Dump
    ranks: list[int]
    renames: dict[int, dict[str, str]]
    shards: dict[int, tuple] = field(default_factory=dict)
    replicas: dict[int, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ record walking
def _is_tensor(rec: Any) -> bool:
    return isinstance(rec, dict) and "dtype" in rec and "shape" in rec


def _tensors(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """``(path, tensor record)`` of every tensor record in an entry (paths are key/index tuples)."""
    if _is_tensor(value):
        yield path, value
    elif isinstance(value, dict) and "type" not in value:
        for k, v in value.items():
            yield from _tensors(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _tensors(v, path + (i,))


def _at(value: Any, path: tuple) -> Any:
    for k in path:
        if isinstance(value, dict) and k in value:
            value = value[k]
        elif isinstance(value, list) and isinstance(k, int) and k < len(value):
            value = value[k]
        else:
            return None
    return value


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _close(a: Any, b: Any, rel: float) -> bool:
    x, y = _num(a), _num(b)
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
    return all(_is_tensor(r) for r in recs) and not all(_same(recs[0], r) for r in recs[1:])


def _key(rec: dict) -> tuple:
    """Exact identity of a tensor's statistics (a partial sum and the collective input it is)."""
    return (str(rec.get("dtype")), tuple(rec.get("shape") or ()),) + tuple(repr(rec.get(k)) for k in _STATS)


def _shard_stats(recs: list[dict]) -> dict | None:
    vals = {k: [_num(r.get(k)) for r in recs] for k in _STATS}
    if any(v is None for vs in vals.values() for v in vs):
        return None
    return {"Max": max(vals["Max"]), "Min": min(vals["Min"]), "Mean": sum(vals["Mean"]) / len(recs),
            "Norm": math.sqrt(sum(v * v for v in vals["Norm"]))}


# ------------------------------------------------------------------------------------------------ tensor parallel
def _collective_inputs(dump: Dump) -> dict[tuple, list[tuple[int, str]]]:
    """``{statistics key: [(position, collective name)]}`` of the reducing collectives' inputs on one rank."""
    out: dict[tuple, list[tuple[int, str]]] = {}
    for pos, (name, entry) in enumerate(dump.data.items()):
        if not isinstance(entry, dict):
            continue
        if name.startswith("Distributed.all_reduce."):
            arg = _at(entry, ("input_args", 0))
        elif name.startswith(("Distributed.reduce_scatter_tensor.", "Distributed.reduce_scatter_single.")):
            # torch.distributed's (output, input) or the functional (input, ...): the larger tensor is the input
            tensors = [a for a in entry.get("input_args") or [] if _is_tensor(a)]
            arg = max(tensors, key=lambda a: math.prod(a.get("shape") or [1])) if tensors else None
        else:
            continue
        if _is_tensor(arg):
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
    outs = [_at(d.data.get(n), ("output", 0)) for d, n in zip(dumps, names_)]
    if not all(_is_tensor(o) for o in outs):
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
        differing = [path for path, _ in _tensors(first.data[name])
                     if _differs([_at(d.data[name], path) for d in dumps])]
        if not differing:  # replicated as a whole: shared, not copied
            data[name] = first.data[name]
            replicas.update((id(rec), len(dumps)) for _, rec in _tensors(data[name]))
            continue
        entry = copy.deepcopy(first.data[name])
        data[name] = entry
        split = set(differing)
        replicas.update((id(rec), len(dumps)) for path, rec in _tensors(entry) if path not in split)
        merged_rows: list[str] = []
        for path in differing:
            rec = _at(entry, path)
            others = [_at(d.data[name], path) for d in dumps]
            row = _row_label(path)
            hits = [collectives[i].get(_key(o), []) for i, o in enumerate(others)]
            reduced_by = _first_common_later(hits, [positions[i][name] for i in range(len(dumps))])
            if reduced_by is not None:
                value, is_shard = _reduced(dumps, [reduced_by] * len(dumps))
                if value is not None:
                    _set(entry, path, dict(rec, **{k: value.get(k) for k in _STATS}, shape=value.get("shape")))
                    if is_shard:
                        shards[id(_at(entry, path))] = (len(dumps), None)
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


def _row_label(path: tuple) -> str:
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
    parent = _at(entry, path[:-1])
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


# ---------------------------------------------------------------------------------------------- pipeline parallel
_INT = re.compile(r"^\d+$")


def _module_path(name: str) -> tuple[str, str] | None:
    """``(prefix, module path)`` of a module or parameters_grad entry (``Module.layers.0.mlp.MLP.forward.0`` →
    ``("Module", "layers.0.mlp")``)."""
    p = names.parse(name)
    if p is None or p.kind == "api":
        return None
    parts = p.base.split(".")
    if p.kind == "parameters_grad":
        return parts[0], ".".join(parts[1:])
    return parts[0], ".".join(parts[1:-1])  # drop the class name


def _container_indices(names_: list[str]) -> dict[str, set[int]]:
    """``{container path: its outermost integer indices}`` (``layers`` → {0, 1}) of one stage's modules."""
    out: dict[str, set[int]] = {}
    for n in names_:
        mp = _module_path(n)
        if mp is None:
            continue
        parts = mp[1].split(".")
        for i, part in enumerate(parts):
            if _INT.match(part):
                out.setdefault(".".join(parts[:i]), set()).add(int(part))
                break
    return out


def _rename_module(name: str, offsets: dict[str, int]) -> str:
    mp = _module_path(name)
    if mp is None or not offsets:
        return name
    prefix, path = mp
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _INT.match(part):
            off = offsets.get(".".join(parts[:i]), 0)
            if not off:
                return name
            parts[i] = str(int(part) + off)
            new_path = ".".join(parts)
            return f"{prefix}.{new_path}" + name[len(prefix) + 1 + len(path):]
    return name


def _rename_api(name: str, offsets: dict[str, int]) -> str:
    p = names.parse(name, any_prefix=True)
    if p is None or p.kind != "api" or not offsets.get(p.base):
        return name
    return f"{p.base}.{p.call + offsets[p.base]}.{p.direction}"


def _api_counts(names_: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names_:
        p = names.parse(n, any_prefix=True)
        if p is not None and p.kind == "api":
            out[p.base] = max(out.get(p.base, 0), p.call + 1)
    return out


def _backward_start(order: list[str]) -> int:
    for i, n in enumerate(order):
        p = names.parse(n, any_prefix=True)
        if p is not None and (p.direction == "backward" or p.kind == "parameters_grad"):
            return i
    return len(order)


def merge_pp(stages: list[Dump], stage_ranks: list[list[int]]) -> tuple[Dump, list[dict[str, str]]]:
    """Merge the stage dumps of one pipeline (already TP-merged), in stage order; see the module docstring.

    Returns:
        ``(dump, renames)``: the merged dump and, per stage, ``{entry name on the stage: merged name}``.
    """
    if len(stages) == 1:
        return stages[0], [{n: n for n in stages[0].data}]
    indices = [_container_indices(list(s.data) + list(s.construct)) for s in stages]
    module_offsets: list[dict[str, int]] = [{} for _ in stages]
    for cont in {c for ix in indices for c in ix}:
        sets = [ix.get(cont, set()) for ix in indices]
        overlapping = any(sets[i] & sets[j] for i in range(len(sets)) for j in range(i))
        if not overlapping:
            continue  # globally numbered already
        off = 0
        for s, idx in enumerate(sets):
            module_offsets[s][cont] = off
            off += (max(idx) + 1) if idx else 0
    api_offsets: list[dict[str, int]] = []
    running: dict[str, int] = {}
    for s in stages:
        api_offsets.append(dict(running))
        for base, n in _api_counts(list(s.data)).items():
            running[base] = running.get(base, 0) + n

    def rename(s: int, n: str) -> str:
        return _rename_api(_rename_module(n, module_offsets[s]), api_offsets[s])

    renames = [{n: rename(s, n) for n in list(st.data) + list(st.construct)} for s, st in enumerate(stages)]
    # merged order: forward of every stage in order, then backward in reverse stage order
    sequence: list[tuple[int, str]] = []
    splits = [_backward_start(list(st.data)) for st in stages]
    for s, st in enumerate(stages):
        sequence += [(s, n) for n in list(st.data)[:splits[s]]]
    for s in reversed(range(len(stages))):
        sequence += [(s, n) for n in list(stages[s].data)[splits[s]:]]
    inverse = [{v: k for k, v in r.items()} for r in renames]
    occurrences: dict[str, list[int]] = {}
    for s, n in sequence:
        occurrences.setdefault(renames[s][n], []).append(s)
    data: dict[str, Any] = {}
    notes: dict[str, list[str]] = {}
    placed = set()
    for i in reversed(range(len(sequence))):  # a shared entry lands at its last occurrence
        s, n = sequence[i]
        new = renames[s][n]
        if new in placed:
            continue
        placed.add(new)
        owners = occurrences[new]
        if len(owners) == 1:
            data[new] = stages[s].data[n]
            own = getattr(stages[s], "merge_notes", {}).get(n)
            notes[new] = ([f"Pipeline stage {s} (ranks {stage_ranks[s]})" + (f", renamed from {n}" if n != new
                                                                                else "") + "."] + list(own or []))
        else:
            data[new] = _shared_entry(new, [(o, stages[o].data[inverse[o][new]]) for o in owners])
            notes[new] = [f"Present on pipeline stages {owners}: inputs from the stage the data entered, outputs "
                          "from the stage it left."]
    data = dict(reversed(list(data.items())))
    construct: dict[str, Any] = {}
    stack: dict[str, list[str]] = {}
    for s, st in enumerate(stages):
        for child, parent in st.construct.items():
            construct.setdefault(renames[s].get(child, child),
                                 None if parent is None else renames[s].get(parent, rename(s, parent)))
        for k, v in st.stack.items():
            stack.setdefault(renames[s].get(k, rename(s, k)), v)
    merged = replace(stages[0], data=data, construct=construct, stack=stack, merge_notes=notes)
    return merged, renames


def _shared_entry(name: str, owners: list[tuple[int, Any]]) -> Any:
    """A module on several stages: forward inputs from the first stage and outputs from the last; backward
    (gradients flow the other way) inputs from the last and outputs from the first."""
    first, last = owners[0][1], owners[-1][1]
    if not isinstance(first, dict) or not isinstance(last, dict):
        return first
    p = names.parse(name)
    backward = p is not None and p.direction == "backward"
    src_in, src_out = (last, first) if backward else (first, last)
    entry = {k: v for k, v in src_in.items() if k != "output"}
    if "output" in src_out:
        entry["output"] = src_out["output"]
    return entry


# ---------------------------------------------------------------------------------------------------- the whole
def merge_ranks(dumps: dict[int, Dump], par: Parallel) -> list[Merged]:
    """Merge every data-parallel group of one step's rank dumps.

    Args:
        dumps: ``{rank: Dump}`` of every rank ``0 .. par.rank_size - 1``.
        par: the run's layout.

    Returns:
        One :class:`Merged` per data-parallel group, in group order.

    Raises:
        MsprobeError: ranks missing or extra for the layout, or a non-PyTorch dump.
    """
    if sorted(dumps) != list(range(par.rank_size)):
        where = os.path.dirname(os.path.normpath(next(iter(dumps.values())).folder)) if dumps else "?"
        raise MsprobeError(f"{where}: --rank_size {par.rank_size}: expected {par.rank_size} rank folders (ranks "
                           f"0..{par.rank_size - 1}), found ranks {sorted(dumps)}")
    for r, d in dumps.items():
        if d.framework != "pytorch":
            raise MsprobeError(f"{d.folder}: merging TP/PP ranks supports PyTorch dumps (rank {r} is {d.framework})")
    out: list[Merged] = []
    for stages in par.groups():
        stage_dumps, shards_all, replicas_all = [], {}, {}
        for tp_ranks in stages:
            merged, shards, replicas = merge_tp([dumps[r] for r in tp_ranks], tp_ranks)
            stage_dumps.append(merged)
            shards_all.update(shards)
            replicas_all.update(replicas)
        dump, stage_renames = merge_pp(stage_dumps, stages)
        renames: dict[int, dict[str, str]] = {}
        for s, tp_ranks in enumerate(stages):
            for r in tp_ranks:
                renames[r] = {n: stage_renames[s].get(n, n) for n in dumps[r].data}
        ranks = [r for st in stages for r in st]
        if par.tp * par.pp > 1 and dump.task not in ("statistics",):
            dump = replace(dump, task="statistics")
        out.append(Merged(dump, ranks, renames, shards_all, replicas_all))
    return out


def _settle_replica(side: Merged, name: str, path: tuple, rec: dict, n: int, dim: int) -> None:
    """A record equal on ``n`` ranks found to be ``n`` shards of equal value: ``Norm`` × sqrt(n), noted."""
    norm = _num(rec.get("Norm"))
    if norm is not None:
        rec["Norm"] = norm * math.sqrt(n)
    del side.replicas[id(rec)]
    side.shards[id(rec)] = (n, None)
    side.dump.merge_notes.setdefault(name, []).append(
        f"{_row_label(path)}: equal on the {n} tensor-parallel ranks but split in dimension {dim} (the other side "
        "has it longer there): shards of equal value, merged (Norm x sqrt(n))")


def align_shapes(target: Merged, bench: Merged) -> int:
    """Settle merged shards and replicas against the other side, record by record:

    * a record merged from ``n`` shards whose other-side record (``m`` shards, 1 if not merged) has a shape equal
      to it but for one dimension ``d`` with ``shape[d] * n == other[d] * m``: both take that full shape;
    * a record equal on all ``n`` ranks of its TP group, against an other-side record that is ``n / m`` times
      longer in one dimension: it was ``n`` shards of equal value (a zero-initialised column-parallel bias, a
      constant fill), not a replica: it takes the full shape and ``Norm`` × sqrt(n) (``Max``/``Min``/``Mean`` of
      equal shards are the shard's), noted;
    * a record merged from ``n`` shards whose other-side record, not merged, has **the same shape**: it was no
      shard (a replicated tensor whose ranks differ in the last bits, or a partial value never reduced): it takes
      back the first rank's statistics, noted, rather than a merge that inflates its Norm by sqrt(n).

    Aligning is idempotent: a bench group paired with several target groups is settled once.

    Returns:
        How many records changed.
    """
    changed = 0
    for side, other in ((target, bench), (bench, target)):
        for name, entry in side.dump.data.items():
            o_entry = other.dump.data.get(name)
            if o_entry is None:
                continue
            for path, rec in _tensors(entry):
                o_rec = _at(o_entry, path)
                if not _is_tensor(o_rec):
                    continue
                replica = id(rec) in side.replicas
                if replica:
                    n, orig = side.replicas[id(rec)], None
                else:
                    n, orig = side.shards.get(id(rec), (1, None))
                m = other.shards.get(id(o_rec), (other.replicas.get(id(o_rec), 1), None))[0]
                if n <= 1 or n == m:
                    continue
                ts, bs = list(rec.get("shape") or []), list(o_rec.get("shape") or [])
                if len(ts) != len(bs):
                    continue
                dims = [d for d in range(len(ts)) if ts[d] != bs[d]]
                if len(dims) == 1 and ts[dims[0]] * n == bs[dims[0]] * m:
                    full = list(ts)
                    full[dims[0]] = ts[dims[0]] * n
                    for mine, r, count in ((side, rec, n), (other, o_rec, m)):
                        r["shape"] = list(full)
                        if id(r) in mine.replicas and count > 1:
                            _settle_replica(mine, name, path, r, count, dims[0])
                        elif count > 1:
                            mine.shards[id(r)] = (count, None)  # settled: never taken back by a later pairing
                    changed += 1
                elif not dims and m == 1 and orig is not None:
                    rec.update(orig)
                    side.shards.pop(id(rec), None)
                    side.dump.merge_notes.setdefault(name, []).append(
                        f"{_row_label(path)}: differs across ranks but has the unsplit shape of the other side: "
                        "not a shard; the first rank's statistics are shown")
                    changed += 1
    return changed


def merge_isolation(records: dict[int, dict[str, dict] | None], renames: dict[int, dict[str, str]]) -> dict | None:
    """The isolation records of a merged group: every rank's records under their merged names; where several
    ranks judged the same node, the worst (error > warning > pass > skip, then the largest value) with its rank
    in the message. ``None`` when no rank has records."""
    rank_order = {"error": 3, "warning": 2, "pass": 1, "skip": 0}
    out: dict[str, dict] = {}
    any_records = False
    for rank, recs in records.items():
        if recs is None:
            continue
        any_records = True
        for old, rec in recs.items():
            new = renames.get(rank, {}).get(old, old)
            rec = dict(rec, rank=rank, message=f"rank{rank}: {rec.get('message', '')}".rstrip(": "))
            cur = out.get(new)
            key = (rank_order.get(str(rec.get("status")), 0), _num(rec.get("value")) or 0.0)
            if cur is None or key > (rank_order.get(str(cur.get("status")), 0), _num(cur.get("value")) or 0.0):
                out[new] = rec
    return out if any_records else None


def _step_dumps(lay: dict[tuple[int, int], str], step: int) -> dict[int, Dump]:
    from ..dump.reader import load_dump

    return {r: load_dump(f) for (s, r), f in sorted(lay.items()) if s == step}


def merged_groups(path: str, par: Parallel | None) -> list[tuple[int, int, Merged]]:
    """Every step of one multi-rank dump merged: ``[(step, group index, Merged)]`` (``par`` ``None``: inferred
    per step, :func:`infer_parallel`). Raises MsprobeError as :func:`merge_ranks`."""
    from ..dump.reader import layout

    lay = layout(path)
    out = []
    for step in sorted({s for s, _ in lay}):
        dumps = _step_dumps(lay, step)
        out += [(step, i, m) for i, m in enumerate(merge_ranks(dumps, par or infer_parallel(dumps)))]
    return out


def infer_parallel(dumps: dict[int, Dump]) -> Parallel:
    """A run's layout read from its communication entries, as msprobe infers it: the pipeline from the chain of
    ``send``/``isend`` destinations starting at rank 0, tensor parallelism from the process group of rank 0's first
    ``all_reduce``/``reduce_scatter``; ``tp = pp = 1`` where nothing says otherwise."""
    world = len(dumps)
    nxt: dict[int, int] = {}
    for r, d in dumps.items():
        for name, entry in d.data.items():
            if (name.startswith("Distributed.send.") or name.startswith("Distributed.isend.")) and \
                    isinstance(entry, dict):
                dst = (entry.get("input_kwargs") or {}).get("dst")
                args = entry.get("input_args") or []
                dst = dst if dst is not None else (args[1] if len(args) > 1 else None)
                dst = dst.get("value") if isinstance(dst, dict) else dst
                if isinstance(dst, int) and not isinstance(dst, bool):
                    nxt[r] = dst
                    break
    pp, cur, seen = 1, 0, {0}
    while cur in nxt and nxt[cur] not in seen:
        cur = nxt[cur]
        seen.add(cur)
        pp += 1
    tp = 1
    first = dumps.get(0)
    if first is not None:
        for name, entry in first.data.items():
            if name.startswith(("Distributed.all_reduce.", "Distributed.reduce_scatter")) and isinstance(entry, dict):
                values = list(entry.get("input_args") or []) + list((entry.get("input_kwargs") or {}).values())
                groups = [v.get("group_ranks") for v in values if isinstance(v, dict) and
                          v.get("type") == "torch.ProcessGroup" and v.get("group_ranks")]
                tp = len(groups[0]) if groups else world
                break
    if world % (tp * pp):
        tp = 1 if world % pp == 0 else tp
        pp = pp if world % (tp * pp) == 0 else 1
    return Parallel(world, tp, pp)


def merged_pairs(target: str, golden: str, par_t: Parallel | None, par_b: Parallel | None
                 ) -> list[tuple[int, int, Merged, Merged]]:
    """Pair the merged data-parallel groups of two multi-rank dumps, step by step.

    Args:
        target, golden: dump roots or step folders (:func:`~msprobe_ci.dump.reader.layout`).
        par_t, par_b: each side's layout; ``None`` infers it (:func:`infer_parallel`).

    Returns:
        ``[(step, group index, target group, bench group)]``: group ``i`` with group ``i``, or every target group
        with the bench's only group.

    Raises:
        MsprobeError: no step in common, a layout that does not fit the rank folders, or group counts that cannot
            be paired.
    """
    from ..dump.reader import layout

    t_lay, g_lay = layout(target), layout(golden)
    steps = sorted({s for s, _ in t_lay} & {s for s, _ in g_lay})
    if not steps:
        raise MsprobeError(f"{target} and {golden} share no step folder")
    out = []
    for step in steps:
        t_dumps, g_dumps = _step_dumps(t_lay, step), _step_dumps(g_lay, step)
        t_groups = merge_ranks(t_dumps, par_t or infer_parallel(t_dumps))
        g_groups = merge_ranks(g_dumps, par_b or infer_parallel(g_dumps))
        if len(g_groups) not in (1, len(t_groups)):
            raise MsprobeError(f"step{step}: the target has {len(t_groups)} data-parallel groups and the bench "
                               f"{len(g_groups)}; expected as many, or one bench group")
        for i, t in enumerate(t_groups):
            g = g_groups[i if len(g_groups) > 1 else 0]
            align_shapes(t, g)
            out.append((step, i, t, g))
    return out
