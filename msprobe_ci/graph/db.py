"""The ``.vis.db`` SQLite file tb-graph-ascend opens (``shared/spec/compare-overflow-visualization.md`` §3.5, §4).

Tables ``tb_nodes``, ``tb_stack``, ``tb_config`` and indexes ``index1``…``index7`` exactly as msprobe creates
them. The file is written under a temporary name in the output folder, in one transaction without a journal,
indexes created after the inserts, switched to WAL journaling (as msprobe's files are), then renamed into place
and made not group/other-writable (the viewer refuses such files): an error leaves no partial ``.vis.db`` behind.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Iterable

import orjson

from ..dump.writer import timestamped_path
from ..outputs import publish, release, temp_path
from ..errors import MsprobeError
from .builder import Graph

SCHEMA = """
CREATE TABLE tb_nodes (id TEXT PRIMARY KEY, graph_id TEXT NOT NULL, node_order INTEGER NOT NULL,
  node_name TEXT NOT NULL, node_type TEXT NOT NULL, up_node TEXT, sub_nodes TEXT, precision_index INTEGER,
  overflow_level TEXT, micro_step_id INTEGER NOT NULL, matched_node_link TEXT, stack_id TEXT,
  parallel_merge_info TEXT, matched_distributed TEXT, modified INTEGER NOT NULL, input_data TEXT,
  output_data TEXT, data_source TEXT, dump_data_dir TEXT, step INTEGER NOT NULL, rank INTEGER NOT NULL,
  is_distributed INTEGER);
CREATE TABLE tb_stack (id TEXT PRIMARY KEY, stack_info TEXT);
CREATE TABLE tb_config (id TEXT PRIMARY KEY, graph_type TEXT NOT NULL, task TEXT, tool_tip TEXT,
  micro_steps INTEGER, overflow_check INTEGER, node_colors TEXT NOT NULL, rank_list TEXT NOT NULL,
  step_list TEXT NOT NULL);
"""
INDEXES = """
CREATE INDEX index1 ON tb_nodes (step, rank, data_source, up_node, node_order);
CREATE INDEX index2 ON tb_nodes (step, rank, data_source, node_name);
CREATE INDEX index3 ON tb_nodes (step, rank, data_source, node_order);
CREATE INDEX index4 ON tb_nodes (step, rank, node_order);
CREATE INDEX index5 ON tb_nodes (step, rank, micro_step_id, node_order);
CREATE INDEX index6 ON tb_nodes (step, rank, modified, matched_node_link);
CREATE INDEX index7 ON tb_nodes (is_distributed);
"""

_DESCRIPTION = ("node verdict of msprobe-ci (dtype- and input-aware relative error against its threshold); the "
                "darker, the further the target is from the bench")
NODE_COLORS = {
    "#FFFCF3": {"value": [0, 0.3], "description": _DESCRIPTION, "accuracy_level": "pass"},
    "#FFDC7F": {"value": [0.3, 0.6], "description": _DESCRIPTION, "accuracy_level": "warning"},
    "#FF704D": {"value": [0.6, 1], "description": _DESCRIPTION, "accuracy_level": "error"},
    "#C7C7C7": {"value": [], "description": "no bench node matched this node", "accuracy_level": "unmatched"},
}
TOOL_TIPS = {
    "summary": {"Max diff": "target minus bench maximum", "Min diff": "target minus bench minimum",
                "Mean diff": "target minus bench mean", "L2norm diff": "target minus bench L2 norm"},
    "all": {"Cosine": "", "EucDist": "", "MaxAbsErr": "", "MaxRelativeErr": "", "One Thousandth Err Ratio": "",
            "Five Thousandths Err Ratio": ""},
    "md5": {"md5": "CRC-32 of the tensor bytes"},
}
TASKS = {"statistics": "summary", "tensor": "all", "md5": "md5"}


def out_path(out_dir: str, kind: str) -> str:
    """``<out_dir>/<kind>_<YYYYmmddHHMMSS>.vis.db`` that does not exist yet (see
    :func:`~msprobe_ci.dump.writer.timestamped_path`)."""
    return timestamped_path(out_dir, kind, ".vis.db")


class VisDbWriter:
    """A ``.vis.db`` written incrementally: nodes and stacks added in batches inside one transaction, indexes and
    ``tb_config`` at :meth:`finish`, then renamed into place; :meth:`abort` (or an exception inside ``with``)
    leaves nothing behind. Row tuples come from :func:`node_row`.

    Raises:
        MsprobeError: ``path`` exists, or its folder cannot be written.
    """

    BATCH = 5000

    def __init__(self, path: str, *, part: bool = False):
        """``part``: write the tables straight into ``path``, an empty temporary file (a worker's share of one
        graph file: :meth:`close_part`, then the parent's :meth:`append_part`)."""
        if not part and os.path.lexists(path):
            raise MsprobeError(f"{path}: exists; msprobe-ci never overwrites a graph file")
        self.path = path
        self.tmp = path if part else temp_path(path)
        try:
            self.conn = sqlite3.connect(self.tmp, isolation_level=None)  # transactions are explicit below
        except sqlite3.Error as exc:
            raise MsprobeError(f"{path}: cannot create ({exc})") from None
        self._nodes: list[tuple] = []
        self._stacks: list[tuple] = []
        try:
            # a new file that is renamed into place only when complete (deleted otherwise) needs no journal; a WAL
            # would take every page of the one big transaction (6 GB at 1M entries), and the index builds and the
            # final checkpoint would read them back through it. WAL is set once the file is complete, as msprobe
            # leaves its files (the viewer opens them in WAL mode).
            self.conn.execute("PRAGMA journal_mode=OFF")
            self.conn.execute("PRAGMA synchronous=OFF")
            self.conn.execute("BEGIN")
            for statement in _statements(SCHEMA):
                self.conn.execute(statement)
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> "VisDbWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.abort()

    def add_node(self, row: tuple) -> None:
        self._nodes.append(row)
        if len(self._nodes) >= self.BATCH:
            self._flush()

    def add_stack(self, stack_id: str, stack_info: str) -> None:
        self._stacks.append((stack_id, stack_info))

    def update(self, column: str, values: list[tuple]) -> None:
        """``UPDATE tb_nodes SET column = value WHERE id = node id`` for ``[(value, node id)]`` (rows added
        earlier: a container's rolled-up colour, a communication node's peers)."""
        if column not in ("precision_index", "matched_distributed"):
            raise ValueError(column)
        self._flush()
        self.conn.executemany(f"UPDATE tb_nodes SET {column} = ? WHERE id = ?", values)

    def _flush(self) -> None:
        if self._nodes:
            self.conn.executemany("INSERT INTO tb_nodes VALUES (" + ",".join("?" * 22) + ")", self._nodes)
            self._nodes.clear()
        if self._stacks:
            self.conn.executemany("INSERT INTO tb_stack VALUES (?, ?)", self._stacks)
            self._stacks.clear()

    def close_part(self) -> None:
        """Commit the rows written so far and close (a part: no indexes, no ``tb_config``)."""
        try:
            self._flush()
            self.conn.execute("COMMIT")
            self.conn.close()
        except BaseException:
            self.abort()
            raise

    def append_part(self, part: str) -> None:
        """Copy every ``tb_nodes`` and ``tb_stack`` row of the part file ``part`` here, in the order it wrote them
        (so the file holds what one writer writing the parts one after another would). SQLite copies them itself
        (``INSERT ... SELECT`` from the attached part); the file has no journal, so committing between parts
        changes nothing but lets the part be attached."""
        self._flush()
        try:
            self.conn.execute("COMMIT")
            self.conn.execute("ATTACH DATABASE ? AS part", (part,))
            try:
                self.conn.execute("BEGIN")
                for table in ("tb_nodes", "tb_stack"):
                    self.conn.execute(f"INSERT INTO main.{table} SELECT * FROM part.{table} ORDER BY rowid")
                self.conn.execute("COMMIT")
            finally:
                self.conn.execute("DETACH DATABASE part")
            self.conn.execute("BEGIN")
        except sqlite3.Error as exc:
            raise MsprobeError(f"{part}: a worker's part of {self.path} cannot be read ({exc})") from None

    def finish(self, *, compare: bool, task: str, overflow_check: bool, micro_steps: int, ranks: list[int],
               steps: list[int]) -> str:
        """Write ``tb_config`` and the indexes, commit, and move the file into place; returns its path."""
        try:
            self._flush()
            mode = TASKS.get(task, task)
            self.conn.execute("INSERT OR IGNORE INTO tb_config VALUES (?,?,?,?,?,?,?,?,?)", (
                "1", "compare" if compare else "build", mode if compare else "",
                json.dumps(TOOL_TIPS.get(mode, {})) if compare else None, micro_steps, int(overflow_check),
                json.dumps(NODE_COLORS) if compare else "null", json.dumps(sorted(set(ranks)) or [0]),
                json.dumps(sorted(set(steps)) or [0])))
            for statement in _statements(INDEXES):
                self.conn.execute(statement)
            self.conn.execute("COMMIT")
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.close()
            os.chmod(self.tmp, 0o644)
            publish(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Close and delete the temporary file (and its WAL files); the reserved name is given back."""
        if hasattr(self, "conn"):
            self.conn.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.tmp + suffix):
                os.unlink(self.tmp + suffix)
        release(self.path)


_encode = json.JSONEncoder(ensure_ascii=False).encode  # one encoder: json.dumps(ensure_ascii=False) builds one per call
_ascii = json.JSONEncoder().encode  # json.dumps's own output, without its per-call argument handling


def _data_text(data: dict) -> str:
    """A node's ``input_data``/``output_data`` as JSON text: ``orjson`` (compact, UTF-8, several times faster
    than :mod:`json` on the string-valued rows every node holds), :func:`_encode` where orjson refuses (a key
    that is not a string, an integer past 64 bits). Every value row_fields and annotate put there is a string (a
    float would be written ``null`` for NaN where :mod:`json` writes ``NaN``). Raises ``TypeError`` on values that
    are not JSON."""
    try:
        return orjson.dumps(data).decode()
    except TypeError:
        return _encode(data)


def node_row(g: Graph, node, stack_id: str, input_data: dict | None = None, output_data: dict | None = None,
             matched_link: list[str] | None = None) -> tuple:
    """The ``tb_nodes`` row of ``node`` in graph ``g`` (``input_data``/``output_data``/``matched_link`` override
    the node's own, for writers that do not keep them on the node)."""
    text = _data_text
    link = node.matched_link if matched_link is None else matched_link
    return (f"{g.graph_id}_{node.name}", g.graph_id, node.order, node.name, str(node.type), node.parent or "",
            _ascii(node.children) if node.children else "", node.precision_index, node.overflow_level,
            node.micro_step, _ascii(list(link)) if link else "[]", stack_id,
            _encode(node.merge_info) if node.merge_info else "",
            _ascii(node.matched_distributed) if node.matched_distributed else "{}", 0,
            text((node.input_data or {}) if input_data is None else input_data),
            text((node.output_data or {}) if output_data is None else output_data), g.data_source, g.dump_data_dir,
            g.step, g.rank, int(node.name.startswith("Distributed")))


def add_graph(out: VisDbWriter, g: Graph) -> None:
    """Every node and stack row of a built graph, in post-order (stack ids numbered in that order)."""
    stacks: dict[str, str] = {}
    for node in g.post_order():
        key = _encode(list(node.stack))
        if key not in stacks:
            stacks[key] = f"{g.graph_id}_{len(stacks)}"
            out.add_stack(stacks[key], key)
        out.add_node(node_row(g, node, stacks[key]))


def write_vis_db(path: str, graphs: Iterable[Graph], *, compare: bool, task: str = "statistics",
                 overflow_check: bool = False) -> str:
    """Write ``graphs`` (every side, step and rank) to ``path``; returns ``path``.

    Args:
        path: the ``.vis.db`` file to create (must not exist).
        graphs: built (and for ``compare`` compared) graphs.
        compare: ``graph_type`` ``compare`` (colour legend, task) or ``build``.
        task: the compare mode: ``statistics`` (stored as msprobe's ``summary``), ``tensor`` (``all``), ``md5``.
        overflow_check: the ``-oc`` flag shown by the viewer.

    Raises:
        MsprobeError: ``path`` exists, or its folder cannot be written.
    """
    graphs = list(graphs)
    with VisDbWriter(path) as out:
        for g in graphs:
            add_graph(out, g)
        return out.finish(compare=compare, task=task, overflow_check=overflow_check,
                          micro_steps=max((g.micro_steps for g in graphs), default=1),
                          ranks=[g.rank for g in graphs], steps=[g.step for g in graphs])


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
