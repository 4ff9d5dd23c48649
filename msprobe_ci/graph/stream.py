"""Graphs of large dumps written while the dumps stream: memory bounded by the graph's structure, not its data.

``msprobe-ci graph`` on PyTorch dumps (no ``-fm``, no mapping files, no rank merging) takes this path; the result is
the same ``.vis.db`` the in-memory path (:mod:`msprobe_ci.graph.service`) writes, node for node (tested), except
that stack ids are numbered in dump order rather than post-order. Per (step, rank):

1. **skeleton**: the graph's structure (:func:`~msprobe_ci.graph.builder.build_graph`) from ``construct.json`` and
   the entry *names* of dump.json (one pass of the C JSON parser, values dropped), for the target and the bench;
   nodes are matched as the in-memory compare graph matches them (same name, same ancestors);
2. **data**: the two dump.json files are compared entry by entry (:class:`~msprobe_ci.compare.stream.NodeStream`,
   the streaming compare's verdicts); each target node's row is written to SQLite as soon as its verdict is known,
   each bench node's as soon as its entry is read, in batches inside the one transaction;
3. **the rest**: nodes without a dump entry (the root, API collections, modules without data) are written, the
   containers' colours rolled up from everything inside them are set (``UPDATE`` by primary key), and after every
   rank, communication nodes get their peers (``matched_distributed``).

Node data never accumulate: what stays is one skeleton per side (names, parents, children, order) and, across
ranks, the communication entries. Dumps this path does not take raise
:class:`~msprobe_ci.compare.stream.NotStreamable` before anything is written, or abort the file (nothing left
behind) when found mid-way (a ``NaN`` token); the caller then uses the in-memory path.
"""

from __future__ import annotations

import os
from typing import Any

from ..compare.stream import NodeStream, progress_bar, stream_files
from ..dump.scan import NameCheck, NotStreamable, duplicate_key, iter_entries, iter_items, read_header, scan_names
from ..dump.reader import Dump, layout, read_construct, read_stack
from ..errors import MsprobeError
from ..overflow import check_entry
from .builder import API, COLLECTION, ROOT, Graph, build_graph, node_data, node_frames, rows_data
from .compare import _match_exact, _roll_up, annotate
from .db import VisDbWriter, _encode, node_row
from .parts import RankPart, assemble, comm_graph


def _skeleton(file: str, head: dict, source: str, step: int, rank: int,
              like: Graph | None = None) -> tuple[Graph, NameCheck | None]:
    """The graph of one dump.json before its entries stream, from construct.json and the entry names (read from
    the entries' first lines, :func:`~msprobe_ci.dump.scan.scan_names`, checked as the entries stream: the
    :class:`~msprobe_ci.dump.scan.NameCheck`, ``None`` where the names were parsed). ``like``: the other side's
    graph, whose name objects this one's nodes take where the names are the same (a bench and its target share
    nearly every name: one copy each, not two).

    Raises:
        MsprobeError: a name the first lines give twice (the stream then keeps no set of every name).
    """
    folder = os.path.dirname(file)
    canon = _canon(like) if like is not None else None
    names = scan_names(file)
    if names is not None and canon is not None:
        names = [canon(n) for n in names]
    data = dict.fromkeys(names) if names is not None else {name: None for name, _ in iter_items(file)}
    if names is not None and len(data) != len(names):
        seen: set[str] = set()
        raise duplicate_key(file, next(n for n in names if n in seen or seen.add(n)))
    construct = read_construct(folder)
    if canon is not None:
        construct = {canon(k): v for k, v in construct.items()}  # parents become their nodes' own names anyway
    dump = Dump(folder=folder, task=str(head.get("task", "statistics")), level=str(head.get("level", "")),
                data=data, construct=construct)
    graph = build_graph(dump, data_source=source, step=step, rank=rank)
    if not dump.data:  # a structure-only graph: the in-memory path draws it (the node stream needs entries)
        raise NotStreamable(f"{file}: no entries in data")
    del dump, data, construct
    if names is None:
        return graph, None
    nodes = graph.nodes
    # the names held for the check are the nodes' own name objects where there is a node: one copy of each name
    names = [nodes[n].name if n in nodes else n for n in names]
    return graph, NameCheck(file, names)


def _canon(graph: Graph):
    """A name as ``graph``'s own name object where it has that node (stack.json's keys,
    :func:`~msprobe_ci.dump.reader.read_stack`, and the other side's skeleton take them: one copy of each name)."""
    nodes = graph.nodes

    def canon(name: str) -> str:
        node = nodes.get(name)
        return name if node is None else node.name

    return canon


class _Side:
    """Writes one graph's node rows as their data arrive, then the rest."""

    def __init__(self, graph: Graph, stack: dict[str, list[str]], out: VisDbWriter, overflow: bool,
                 matched: dict[str, str] | None, comm: dict, names: NameCheck | None = None):
        self.g, self.stack, self.out, self.overflow = graph, stack, out, overflow
        self.names = names  # the skeleton's names, held to the entries as they stream
        self.matched = matched or {}  # exact matching: same name, same ancestors on both sides
        self.comm = comm              # Distributed entries, for cross-rank linking
        self.stacks: dict[str, str] = {}
        self._by_frames: dict[int, tuple[Any, str]] = {}  # id(frames list) -> (the list, its stack id)
        self._written = bytearray(len(graph.nodes))  # by node order (post-order index: 0 .. n-1, each once)

    def written(self, name: str) -> bool:
        node = self.g.nodes.get(name)
        return node is not None and self._written[node.order] == 1

    def _stack_id(self, name: str) -> str:
        frames = node_frames(self.stack, name)
        known = self._by_frames.get(id(frames))  # stack.json's groups share one frames list: encoded once each
        if known is not None and known[0] is frames:
            return known[1]
        key = _encode(list(frames or []))
        sid = self.stacks.get(key)
        if sid is None:
            sid = self.stacks[key] = f"{self.g.graph_id}_{len(self.stacks)}"
            self.out.add_stack(sid, key)
        self._by_frames[id(frames)] = (frames, sid)
        return sid

    def _link(self, name: str) -> list[str]:
        """``matched_node_link``: the ancestors and the node itself (the same on both sides when matched)."""
        return self.g.ancestors(name) + [name] if name in self.matched else []

    def seen(self, name: str, entry: Any) -> None:
        """Every entry as it is read: overflow level and communication entries."""
        if self.names is not None:
            self.names.see(name)
        node = self.g.nodes.get(name)
        if node is not None and self.overflow:
            a = check_entry(name, entry)
            node.overflow_level = a.level if a is not None else None
        if name.startswith("Distributed."):
            self.comm[name] = entry

    def write(self, name: str, inputs: dict, outputs: dict) -> None:
        node = self.g.nodes[name]
        self.out.add_node(node_row(self.g, node, self._stack_id(name), inputs, outputs, self._link(name)))
        self._written[node.order] = 1

    def entry(self, name: str, entry: Any, rows: list | None = None) -> None:
        """A node's entry (build graphs, the bench side): its rows as they are (``rows``: its
        :func:`~msprobe_ci.compare.rows.entry_rows`, when the caller has them)."""
        self.seen(name, entry)
        if name in self.g.nodes and not self.written(name):
            self.write(name, *(node_data(name, entry) if rows is None else rows_data(rows)))

    def rest(self) -> None:
        """Every node not written yet, with no data (after the last entry: every name the skeleton had seen)."""
        if self.names is not None:
            self.names.done()
        written = self._written
        for node in self.g.post_order():
            if not written[node.order]:
                self.write(node.name, {}, {})



def _compare_rank(out: VisDbWriter, job: tuple) -> RankPart:
    """One (step, rank) of a compare graph, streamed into ``out`` (a rank writer of
    :func:`~msprobe_ci.graph.parts.assemble`)."""
    (step, rank), files, heads, overflow, thresholds, progress = job
    tg, t_names = _skeleton(files[0], heads[0], "NPU", step, rank)
    bg, b_names = _skeleton(files[1], heads[1], "Bench", step, rank, like=tg)
    pairs = _match_exact(tg, bg)
    t_comm, b_comm = {}, {}
    bench = _Side(bg, read_stack(os.path.dirname(files[1]), _canon(bg)), out, overflow, pairs, b_comm, b_names)
    side = _Side(tg, read_stack(os.path.dirname(files[0]), _canon(tg)), out, overflow, pairs, t_comm, t_names)
    bar = progress_bar(files[0], "graph", progress)
    try:
        # names the skeleton's NameCheck holds the stream to are unique (checked there): no set of them is kept
        nodes = NodeStream(files, heads, thresholds, bar=bar, on_target=side.seen, on_bench=bench.entry,
                           drain_bench=True, unique=(t_names is not None, b_names is not None),
                           target_stack=side.stack)
        for name, own, verdict in nodes:
            node = tg.nodes.get(name)
            if node is None or side.written(name):
                continue
            inputs, outputs = rows_data([rr.target for rr in own])
            if name in pairs and node.type != COLLECTION and name != ROOT:
                annotate(node, inputs, outputs, {rr.target.name: rr for rr in own}, verdict, nodes.mode)
            side.write(name, inputs, outputs)
    finally:
        if bar is not None:
            bar.close()
    _roll_up(tg, ROOT, pairs)
    out.update("precision_index", [(n.precision_index, f"{tg.graph_id}_{n.name}")
                                   for n in tg.nodes.values() if n.type != API and side.written(n.name)])
    side.rest()
    bench.rest()
    return RankPart((step, rank), nodes.mode, max(tg.micro_steps, bg.micro_steps),
                    {"NPU": comm_graph(tg), "Bench": comm_graph(bg)}, {"NPU": t_comm, "Bench": b_comm})


def stream_compare_vis_db(target: str, golden: str, path: str, *, overflow: bool = False, thresholds=None,
                          progress: bool | None = None, workers: int = 1, scheduler: str | None = None) -> str:
    """Write ``path`` (a ``.vis.db`` that does not exist; a :func:`~msprobe_ci.outputs.reserve` name), the compare
    graph of every (step, rank) the two dump paths share, streaming; returns ``path``.

    ``workers``/``scheduler``: (step, rank) pairs written by worker processes
    (:func:`~msprobe_ci.graph.parts.assemble`; the same file).

    Raises:
        MsprobeError: no (step, rank) in common, bad dumps, construct.json missing, dangling parents or cycles.
        NotStreamable: a dump this path does not take (nothing is left behind): use
            :func:`~msprobe_ci.graph.service.compare_vis_db`'s in-memory path.
    """
    t_layout, g_layout = layout(target), layout(golden)
    common = sorted(set(t_layout) & set(g_layout))
    if not common:
        raise MsprobeError(f"{target} and {golden} share no step/rank folder (target has {sorted(t_layout)}, "
                           f"golden has {sorted(g_layout)})")
    checked = [(key, *stream_files(t_layout[key], g_layout[key])) for key in common]
    serial = workers <= 1 and not scheduler
    jobs = [(key, files, heads, overflow, thresholds, progress if serial else False) for key, files, heads in checked]
    return assemble(path, _compare_rank, jobs, common, compare=True, overflow=overflow, workers=workers,
                    scheduler=scheduler, reraise=(NotStreamable,))


def _build_rank(out: VisDbWriter, job: tuple) -> RankPart:
    """One (step, rank) of a build graph, streamed into ``out``."""
    (step, rank), folder, file, head, overflow = job
    comm: dict = {}
    g, names = _skeleton(file, head, "NPU", step, rank)
    side = _Side(g, read_stack(folder, _canon(g)), out, overflow, None, comm, names)
    for name, entry in iter_entries(file, head, unique=names is not None):
        side.entry(name, entry)
    side.rest()
    return RankPart((step, rank), "statistics", g.micro_steps, {"NPU": comm_graph(g)}, {"NPU": comm})


def stream_build_vis_db(target: str, path: str, *, overflow: bool = False, workers: int = 1,
                        scheduler: str | None = None) -> str:
    """Write ``path``, the build graph of every (step, rank) under ``target``, streaming; returns ``path``.

    Raises:
        MsprobeError, NotStreamable: as :func:`stream_compare_vis_db`.
    """
    keys = sorted(layout(target).items())
    jobs = []
    for key, folder in keys:
        file = os.path.join(folder, "dump.json")
        head = read_header(file)
        if str(head.get("framework") or "pytorch").lower() != "pytorch":
            raise NotStreamable(f"{file}: framework {head.get('framework')!r}")
        jobs.append((key, folder, file, head, overflow))
    return assemble(path, _build_rank, jobs, [k for k, _ in keys], compare=False, overflow=overflow,
                    workers=workers, scheduler=scheduler, reraise=(NotStreamable,))
