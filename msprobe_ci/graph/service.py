"""Build or compare graphs from msprobe path layouts and write one ``.vis.db``.

Layouts (as ``msprobe graph_visualize``): a rank folder (``dump.json``, ``construct.json``, ``stack.json``), a step
folder with ``rank``/``rank<N>``/``proc<pid>`` folders, or a dump root with ``step<N>`` folders. Every step and rank
goes into the same file (``step``/``rank`` columns, ``step_list``/``rank_list`` in ``tb_config``); compare pairs the
target's and the bench's (step, rank) folders and needs at least one in common.
"""

from __future__ import annotations

from .._perf import gc_paused
from ..compare import compare_dumps
from ..compare.report import CompareReport
from ..dump.reader import Dump, layout, load_dump
from ..errors import MsprobeError
from ..overflow import check_overflow
from .builder import Graph, build_graph
from .compare import compare_graphs
from ..outputs import release
from .db import VisDbWriter, add_graph, out_path, write_vis_db
from .parts import RankPart, assemble, comm_graph


def _graph(dump: Dump, source: str, step: int, rank: int, overflow: bool, found=None) -> Graph:
    """The graph of ``dump``; with ``overflow``, each node's overflow level from ``found`` (the dump's
    :class:`~msprobe_ci.overflow.OverflowReport` where the caller has it already) or a scan of the dump."""
    g = build_graph(dump, data_source=source, step=step, rank=rank)
    if overflow:
        for a in (found if found is not None else check_overflow(dump)).anomalies:
            if a.name in g.nodes:
                g.nodes[a.name].overflow_level = a.level
    return g


def _comm_entries(dump: Dump) -> dict:
    """The communication entries of a dump (all that cross-rank linking needs to keep in memory)."""
    return {k: v for k, v in dump.data.items() if k.startswith("Distributed.")}


def _compared(target: Dump, bench: Dump, report: CompareReport, key: tuple[int, int], overflow: bool,
              fuzzy: bool, found: tuple = (None, None)) -> list[Graph]:
    """The target (NPU) and bench graphs of one (step, rank), matched and annotated (``found``: the two dumps'
    overflow reports where the caller has them)."""
    t_graph = _graph(target, "NPU", *key, overflow, found[0])
    g_graph = _graph(bench, "Bench", *key, overflow, found[1])
    compare_graphs(t_graph, g_graph, report, fuzzy=fuzzy)
    return [t_graph, g_graph]


def _renames(mappings) -> bool:
    """Mapping files that rename PyTorch entries (``-dm``/``-lm``/``-cm``; ``-am`` only maps MindSpore APIs)."""
    return mappings is not None and any(getattr(mappings, k, None) for k in ("data", "layer", "cell"))


def _streamed(write, out_dir: str, kind: str) -> str | None:
    """``write(path)`` on a newly reserved ``<kind>_<ts>.vis.db``: its path, or None when the dumps need the
    in-memory path (:class:`~msprobe_ci.compare.stream.NotStreamable`). Either way, or on an error, the reserved
    name is given back."""
    from ..compare.stream import NotStreamable

    path = out_path(out_dir, kind)
    try:
        return write(path)
    except NotStreamable:
        return None
    finally:
        release(path)


@gc_paused()
def build_vis_db(target: str, out_dir: str, *, overflow: bool = False, merge: bool = False, parallel=None,
                 stream: bool = True, workers: int = 1, scheduler: str | None = None) -> str:
    """``build_<ts>.vis.db`` for every step and rank under ``target``; returns its path.

    PyTorch dumps (not merged) are written while they stream (:func:`~msprobe_ci.graph.stream.stream_build_vis_db`,
    memory bounded by the graph's structure); others, or ``stream=False``, are loaded whole.

    ``merge``: merge the TP/PP ranks of each step into one graph per data-parallel group, with the layout
    ``parallel`` (a :class:`~msprobe_ci.compare.merge.Parallel`; ``None``: inferred from the collectives). The
    graph's ``rank`` column is the group index; shards keep their per-rank shapes, there being no other side to
    tell the split dimension.

    ``workers``/``scheduler``: (step, rank) pairs written by worker processes (:mod:`msprobe_ci.workers`; the
    same file, node for node); merging runs in this process.
    """
    if not merge and stream:
        from .stream import stream_build_vis_db

        done = _streamed(lambda path: stream_build_vis_db(target, path, overflow=overflow, workers=workers,
                                                           scheduler=scheduler), out_dir, "build")
        if done is not None:
            return done
    if merge:
        from ..compare.merge import merged_groups

        graphs = [_graph(m.dump, "NPU", step, i, overflow) for step, i, m in merged_groups(target, parallel)]
        return write_vis_db(out_path(out_dir, "build"), graphs, compare=False, overflow_check=overflow)
    keys = sorted(layout(target).items())
    return assemble(out_path(out_dir, "build"), _build_rank, [(key, folder, overflow) for key, folder in keys],
                    [k for k, _ in keys], compare=False, overflow=overflow, workers=workers, scheduler=scheduler)


def _build_rank(out: VisDbWriter, job: tuple) -> RankPart:
    """One (step, rank) of a build graph, loaded whole (a rank writer of :func:`~msprobe_ci.graph.parts.assemble`)."""
    (step, rank), folder, overflow = job
    dump = load_dump(folder)
    g = _graph(dump, "NPU", step, rank, overflow)
    add_graph(out, g)
    return RankPart((step, rank), "statistics", g.micro_steps, {"NPU": comm_graph(g)}, {"NPU": _comm_entries(dump)})


def _compare_rank(out: VisDbWriter, job: tuple) -> RankPart:
    """One (step, rank) of a compare graph, loaded whole: both dumps, their compare (unless ``report`` is given),
    the two graphs matched and annotated."""
    key, t_folder, g_folder, overflow, fuzzy, thresholds, mappings, report = job
    t_dump, g_dump = load_dump(t_folder), load_dump(g_folder)
    if report is None:
        kwargs = {"thresholds": thresholds} if thresholds is not None else {}
        report = compare_dumps(bench=g_dump, target=t_dump, fuzzy=fuzzy, mappings=mappings, **kwargs)
    t_graph, g_graph = _compared(t_dump, g_dump, report, key, overflow, fuzzy)
    add_graph(out, t_graph)
    add_graph(out, g_graph)
    return RankPart(key, report.mode, max(t_graph.micro_steps, g_graph.micro_steps),
                    {"NPU": comm_graph(t_graph), "Bench": comm_graph(g_graph)},
                    {"NPU": _comm_entries(t_dump), "Bench": _comm_entries(g_dump)})


@gc_paused()
def compare_vis_db(target: str, golden: str, out_dir: str, *, overflow: bool = False, fuzzy: bool = False,
                   thresholds=None, reports: dict[tuple[int, int], CompareReport] | None = None,
                   mappings=None, parallel=None, stream: bool = True, workers: int = 1,
                   scheduler: str | None = None) -> str:
    """``compare_<ts>.vis.db`` of every (step, rank) the two sides share; returns its path.

    PyTorch dumps without ``fuzzy``, ``mappings``, ``parallel`` or ``reports`` are compared and written while they
    stream (:func:`~msprobe_ci.graph.stream.stream_compare_vis_db`: same file, memory bounded by the graphs'
    structure); the rest, or ``stream=False``, are loaded whole.

    Args:
        target, golden: dump paths (see :func:`layout`).
        out_dir: output folder (created; must not be a file).
        overflow: mark overflow levels on nodes (``-oc``).
        fuzzy: msprobe's ``-fm`` node matching (and fuzzy row matching in the compare).
        thresholds: :class:`~msprobe_ci.compare.Thresholds` for the node verdicts (default rule).
        reports: already computed compare reports by (step, rank), to skip recomputing them.
        mappings: msprobe's ``-dm``/``-lm``/``-cm``/``-am`` files (:class:`~msprobe_ci.compare.crossframe.Mappings`);
            a MindSpore side against a PyTorch side is matched automatically without them.
        parallel: ``(target Parallel, bench Parallel)`` (either ``None``: inferred) merges each side's TP/PP ranks
            into one graph per data-parallel group (:func:`~msprobe_ci.compare.merge.merged_pairs`; the graphs'
            ``rank`` is the group index, ``reports`` keyed by (step, group)).
        stream: False forces the in-memory path.
        workers, scheduler: (step, rank) pairs written by worker processes (:mod:`msprobe_ci.workers`; the same
            file, node for node); merging (``parallel``) and ``reports`` run in this process.

    Raises:
        MsprobeError: no (step, rank) in common, unreadable dumps, construct.json missing, dangling parents or
            cycles.
    """
    if parallel is not None:
        from ..compare.merge import merged_pairs

        graphs, mode = [], "statistics"
        for step, i, t, g in merged_pairs(target, golden, *parallel):
            report = (reports or {}).get((step, i))
            if report is None:
                kwargs = {"thresholds": thresholds} if thresholds is not None else {}
                report = compare_dumps(bench=g.dump, target=t.dump, fuzzy=fuzzy, mappings=mappings, **kwargs)
            mode = report.mode
            graphs += _compared(t.dump, g.dump, report, (step, i), overflow, fuzzy)
        return write_vis_db(out_path(out_dir, "compare"), graphs, compare=True, task=mode, overflow_check=overflow)
    if stream and not fuzzy and not _renames(mappings) and not reports:
        from .stream import stream_compare_vis_db

        done = _streamed(lambda path: stream_compare_vis_db(target, golden, path, overflow=overflow,
                                                            thresholds=thresholds, workers=workers,
                                                            scheduler=scheduler), out_dir, "compare")
        if done is not None:
            return done
    t_layout, g_layout = layout(target), layout(golden)
    common = sorted(set(t_layout) & set(g_layout))
    if not common:
        raise MsprobeError(f"{target} and {golden} share no step/rank folder (target has {sorted(t_layout)}, "
                           f"golden has {sorted(g_layout)})")
    if reports:
        workers, scheduler = 1, None
    jobs = [(key, t_layout[key], g_layout[key], overflow, fuzzy, thresholds, mappings, (reports or {}).get(key))
            for key in common]
    return assemble(out_path(out_dir, "compare"), _compare_rank, jobs, common, compare=True, overflow=overflow,
                    workers=workers, scheduler=scheduler)


@gc_paused()
def write_compare_graph(target: Dump, bench: Dump, report: CompareReport, out_dir: str, *, overflow: bool = True,
                        fuzzy: bool = False, step: int = 0, rank: int = 0, found: tuple = (None, None)) -> str:
    """``compare_<ts>.vis.db`` of two loaded dumps whose compare ``report`` is already computed (the plugin's
    path), with the two dumps' overflow reports ``found`` where the check has them (each scanned here
    otherwise); returns its path. Raises :class:`MsprobeError` as :func:`compare_vis_db`."""
    return write_vis_db(out_path(out_dir, "compare"),
                        _compared(target, bench, report, (step, rank), overflow, fuzzy, found),
                        compare=True, task=report.mode, overflow_check=overflow)
