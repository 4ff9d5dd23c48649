"""One ``.vis.db`` assembled from its (step, rank) parts: written one after another, or by workers.

Every (step, rank) of a graph file is independent until the end, when communication nodes are linked across
ranks (``matched_distributed``) and ``tb_config`` lists the steps and ranks. So a rank writer
(``write_rank(out, job) -> RankPart``) writes one (step, rank)'s node and stack rows and returns only what the end
needs: the communication nodes and entries, the compare mode and the micro-step count. :func:`assemble` runs the
rank writers

* serially, all into the final file's one writer, or
* as tasks of :func:`msprobe_ci.workers.run` (``-n``, ``--scheduler``), each into a hidden part file beside the
  final one, whose rows the parent then copies into the final file in (step, rank) order.

Either way the file holds the same rows in the same order; a failed task names its (step, rank), and no part file
or partial graph is left behind.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .. import workers as engine
from ..outputs import release, temp_path
from .builder import Graph
from .db import VisDbWriter
from .distributed import link as link_distributed

SOURCES = ("NPU", "Bench")


@dataclass
class RankPart:
    """What the end of a graph file needs from one (step, rank).

    Attributes:
        key: ``(step, rank)``.
        mode: the compare mode (statistics/tensor/md5).
        micro: micro steps of the rank's graphs.
        comm_graphs: per data source (``NPU``, ``Bench``), the graph's communication nodes alone.
        comms: per data source, the rank's ``Distributed.*`` dump entries.
        path: the part file a worker wrote (None when written into the final file).
    """

    key: tuple[int, int]
    mode: str = "statistics"
    micro: int = 1
    comm_graphs: dict[str, Graph] = field(default_factory=dict)
    comms: dict[str, dict] = field(default_factory=dict)
    path: str | None = None


def comm_graph(g: Graph) -> Graph:
    """``g``'s communication nodes alone (what cross-rank linking reads and fills)."""
    nodes = {n: node for n, node in g.nodes.items() if n.startswith("Distributed.")}
    return Graph(nodes, g.data_source, g.step, g.rank, g.dump_data_dir)


def _part_task(job: tuple) -> RankPart:
    """A worker's share: one rank writer into its part file."""
    write_rank, args, path = job
    out = VisDbWriter(path, part=True)
    try:
        part = write_rank(out, args)
    except BaseException:
        out.abort()
        raise
    out.close_part()
    part.path = path
    return part


def _finish(out: VisDbWriter, parts: list[RankPart], *, compare: bool, overflow: bool) -> str:
    for source in SOURCES:
        graphs = [p.comm_graphs[source] for p in parts if source in p.comm_graphs]
        if len({g.rank for g in graphs}) < 2:
            continue
        link_distributed(graphs, {p.key: p.comms.get(source, {}) for p in parts})
        out.update("matched_distributed", [(json.dumps(node.matched_distributed), f"{g.graph_id}_{name}")
                                           for g in graphs for name, node in g.nodes.items()
                                           if node.matched_distributed])
    return out.finish(compare=compare, task=parts[-1].mode if parts else "statistics", overflow_check=overflow,
                      micro_steps=max((p.micro for p in parts), default=1),
                      ranks=[p.key[1] for p in parts], steps=[p.key[0] for p in parts])


def assemble(path: str, write_rank: Callable[[VisDbWriter, Any], RankPart], jobs: Sequence[Any],
             keys: Sequence[tuple[int, int]], *, compare: bool, overflow: bool, workers: int = 1,
             scheduler: str | None = None, reraise: tuple[type, ...] = ()) -> str:
    """Write ``path`` (a reserved ``.vis.db`` name) from one rank writer call per job; returns ``path``.

    Args:
        path: the final file (must not exist).
        write_rank: a module-level function ``(writer, job) -> RankPart``.
        jobs, keys: its arguments and their ``(step, rank)``, in the file's order.
        compare, overflow: ``tb_config``'s graph type and ``-oc`` flag.
        workers, scheduler: see :func:`msprobe_ci.workers.run` (default: serial, into ``path``'s writer).
        reraise: exception types a task's error is re-raised as (e.g. ``NotStreamable``), not wrapped.

    Raises:
        MsprobeError: a task failed (named by its (step, rank)); the final file and every part are removed.
    """
    if not scheduler and (workers <= 1 or len(jobs) <= 1):
        with VisDbWriter(path) as out:
            parts = [write_rank(out, job) for job in jobs]
            return _finish(out, parts, compare=compare, overflow=overflow)
    part_paths = []
    try:
        for _ in jobs:
            part_paths.append(temp_path(path))
        labels = [f"step{s} rank{r}" for s, r in keys]
        parts = engine.run(_part_task, [(write_rank, job, p) for job, p in zip(jobs, part_paths)], labels,
                           workers=workers, scheduler=scheduler, reraise=reraise)
        with VisDbWriter(path) as out:
            for part in parts:
                out.append_part(part.path)
            return _finish(out, parts, compare=compare, overflow=overflow)
    except BaseException:
        release(path)  # the writer gives the name back when it fails; a failed task ends before there is one
        raise
    finally:
        for p in part_paths:
            for suffix in ("", "-journal", "-wal", "-shm"):
                if os.path.exists(p + suffix):
                    os.unlink(p + suffix)
