"""Model graphs and the ``.vis.db`` files the tb-graph-ascend TensorBoard plugin opens.

``build_graph`` (one rank folder → :class:`Graph`), ``compare_graphs`` (match, metrics, colours from our
verdicts), ``write_vis_db`` (the SQLite file), and ``build_vis_db`` / ``compare_vis_db`` over msprobe's path
layouts (rank folder, step folder, dump root).
"""

from .builder import Graph, Node, build_graph
from .compare import compare_graphs
from .db import write_vis_db
from ..dump.reader import layout
from .service import build_vis_db, compare_vis_db

__all__ = ["Graph", "Node", "build_graph", "compare_graphs", "write_vis_db", "build_vis_db", "compare_vis_db",
           "layout"]
