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

import math
import os
from dataclasses import dataclass, field, replace
from typing import Mapping

from ..dump.reader import Dump
from ..errors import MsprobeError
from ..status import SEVERITY, SKIP
from .isolation_file import IsolationRecord
from .merge_pp import merge_pp
from .merge_tp import is_tensor_record, merge_tp, record_at, row_label, stat_number, tensor_records

__all__ = ["Merged", "Parallel", "align_shapes", "infer_parallel", "merge_isolation", "merge_pp", "merge_ranks", "merge_tp",
           "merged_groups", "merged_pairs"]

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
    norm = stat_number(rec.get("Norm"))
    if norm is not None:
        rec["Norm"] = norm * math.sqrt(n)
    del side.replicas[id(rec)]
    side.shards[id(rec)] = (n, None)
    side.dump.merge_notes.setdefault(name, []).append(
        f"{row_label(path)}: equal on the {n} tensor-parallel ranks but split in dimension {dim} (the other side "
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
            for path, rec in tensor_records(entry):
                o_rec = record_at(o_entry, path)
                if not is_tensor_record(o_rec):
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
                        f"{row_label(path)}: differs across ranks but has the unsplit shape of the other side: "
                        "not a shard; the first rank's statistics are shown")
                    changed += 1
    return changed


def merge_isolation(records: dict[int, Mapping[str, IsolationRecord] | None],
                    renames: dict[int, dict[str, str]]) -> dict[str, IsolationRecord] | None:
    """The isolation records of a merged group: every rank's records under their merged names; where several
    ranks judged the same node, the worst (by :data:`msprobe_ci.status.SEVERITY`, a skip below a pass, then the
    largest value) with its rank in the message. ``None`` when no rank has records."""
    def key(rec: IsolationRecord) -> tuple:
        return (SEVERITY[rec.status], rec.status != SKIP, stat_number(rec.value) or 0.0)
    out: dict[str, IsolationRecord] = {}
    any_records = False
    for rank, recs in records.items():
        if recs is None:
            continue
        any_records = True
        for old, rec in recs.items():
            new = renames.get(rank, {}).get(old, old)
            rec = replace(rec, rank=rank, message=f"rank{rank}: {rec.message}".rstrip(": "))
            cur = out.get(new)
            if cur is None or key(rec) > key(cur):
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
