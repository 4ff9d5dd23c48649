"""Model graphs from a dump, built as msprobe's ``graph_visualize`` builds them (``shared/spec/
compare-overflow-visualization.md`` §3.2), so tb-graph-ascend shows our dumps the way it shows msprobe's.

A graph has a root ``DefaultModel`` (a module node), the module and API nodes of ``construct.json`` under their
parents, ``X.parameters_grad.N`` entries under ``X.backward.N`` (or the last backward call), and every run of two
or more consecutive API nodes at the root wrapped into an ``Apis_Between_Modules.<k>`` collection. Node data are
the dump entry's rows as msprobe writes them in ``.vis.db`` (every value a string), micro-steps split where a module
forward follows a module backward, and ``order`` is the post-order index (children first, root last).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from ..compare.metrics import number_cells
from ..compare.rows import entry_rows
from ..dump.reader import Dump
from ..errors import MsprobeError

ROOT = "DefaultModel"
MODULE, API, COLLECTION = 0, 1, 9
_API_RE = re.compile(r"^(Tensor|Torch|Functional|NPU|VF|Distributed|Aten|Mint|Primitive|Jit|MintFunctional|MindSpeed)\.")
_PGRAD_RE = re.compile(r"^(?P<base>.+)\.parameters_grad(?:\.(?P<n>\d+))?$")
_BWD_RE = re.compile(r"\.backward(\.|$)")


@dataclass(slots=True)
class Node:
    """One graph node.

    Attributes:
        name: node id (``Module.fc1.Linear.forward.0``, ``Functional.linear.0.forward``, ``DefaultModel``).
        type: 0 module, 1 function API, 9 API collection (msprobe's ``NodeOp``).
        parent: parent name, ``None`` for the root.
        children: child names in display order (a list once the node has one; the shared ``()`` before).
        input_data, output_data: ``{row name: {field: str}}``, ``None`` where the node has none (the nodes of a
            streamed graph never hold data: a 1M-entry dump's 2M nodes would each hold three empty containers).
        stack: frame strings of the call site.
        micro_step: micro-step id (0 when no split).
        order: post-order index within the graph.
        precision_index: ``None``, 0, 0.5 or 1 (compare graphs, target side).
        overflow_level: ``None`` or ``medium``/``high``/``critical``.
        matched_link: ancestors + matched node (compare graphs), empty when unmatched.
        matched_distributed: for a communication node of a multi-rank graph, its peers on the other ranks, else
            None.
        merge_info: how a TP/PP-merged node's data were merged (``parallel_merge_info``), empty otherwise.
    """

    name: str
    type: int
    parent: str | None = None
    children: Sequence[str] = ()
    input_data: dict[str, dict] | None = None
    output_data: dict[str, dict] | None = None
    stack: Sequence[str] = ()  # the empty defaults are shared immutables: a 1M-node graph holds 2M nodes
    micro_step: int = 0
    order: int = 0
    precision_index: float | None = None
    overflow_level: str | None = None
    matched_link: Sequence[str] = ()
    matched_distributed: dict | None = None  # communication peers on other ranks (distributed.py)
    merge_info: Sequence[str] = ()  # TP/PP merge notes (parallel_merge_info)


@dataclass
class Graph:
    """All nodes of one (data_source, step, rank), root first in ``nodes`` insertion order."""

    nodes: dict[str, Node]
    data_source: str = "NPU"
    step: int = 0
    rank: int = 0
    dump_data_dir: str | None = None

    @property
    def root(self) -> Node:
        return self.nodes[ROOT]

    @property
    def graph_id(self) -> str:
        return f"{self.data_source}_{self.step}_{self.rank}"

    @property
    def micro_steps(self) -> int:
        return max((n.micro_step for n in self.nodes.values()), default=0) + 1

    def ancestors(self, name: str) -> list[str]:
        """Names from the root down to ``name``'s parent."""
        chain = []
        parent = self.nodes[name].parent
        while parent is not None:
            chain.append(parent)
            parent = self.nodes[parent].parent
        return chain[::-1]

    def post_order(self) -> list[Node]:
        return sorted(self.nodes.values(), key=lambda n: n.order)


def node_type(name: str) -> int:
    """msprobe's node type: 1 for torch APIs (``Tensor.``, ``Torch.``, ``Functional.`` ...), else 0 (module)."""
    return API if _API_RE.match(name) else MODULE


def _twin(name: str, a: str, b: str) -> str:
    return name.replace(f".{a}.", f".{b}.") if f".{a}." in name else re.sub(rf"\.{a}$", f".{b}", name)


def _parents(construct: dict[str, Any], where: str) -> dict[str, str | None]:
    """construct.json with msprobe's backward fix-ups, checked for dangling parents and cycles."""
    parents: dict[str, str | None] = {}
    for child, parent in construct.items():
        if parent is not None and not isinstance(parent, str):
            raise MsprobeError(f"{where}: {child!r}: parent must be a node name or null, got {parent!r}")
        if _BWD_RE.search(child) and (parent is None or ".forward" in parent):
            # a backward node without a (backward) parent borrows its forward twin's parent, renamed to backward
            twin_parent = construct.get(_twin(child, "backward", "forward"))
            if isinstance(twin_parent, str):
                candidate = _twin(twin_parent, "forward", "backward")
                if candidate in construct:
                    parent = candidate
        parents[child] = parent
    for child, parent in parents.items():
        if parent is not None and parent not in parents:
            raise MsprobeError(f"{where}: {child!r} has parent {parent!r}, which is not in construct.json")
    for start in parents:
        seen = [start]
        parent = parents[start]
        while parent is not None:
            if parent in seen:
                loop = " -> ".join(seen[seen.index(parent):] + [parent])
                raise MsprobeError(f"{where}: cycle in construct.json: {loop}")
            seen.append(parent)
            parent = parents[parent]
    return parents


def build_graph(dump: Dump, *, data_source: str = "NPU", step: int = 0, rank: int = 0) -> Graph:
    """Build the graph of one rank folder.

    Args:
        dump: a loaded dump with ``construct.json`` (level L0 or mix).
        data_source: ``NPU`` (target, also build graphs) or ``Bench``.
        step, rank: the graph's step and rank.

    Raises:
        MsprobeError: construct.json missing or empty (the message says L0 or mix is needed), a parent that is not
            a node, or a cycle.
    """
    where = f"{dump.folder}/construct.json"
    if not dump.construct:
        raise MsprobeError(f"{where}: missing or empty; a graph needs the module structure, dump with level L0 or "
                           f"mix (this dump is level {dump.level or 'L1'})")
    parents = _parents(dump.construct, where)
    nodes: dict[str, Node] = {ROOT: Node(ROOT, MODULE)}
    for name in parents:
        nodes[name] = Node(name, node_type(name))
    for name, parent in parents.items():
        up = nodes[parent or ROOT]
        nodes[name].parent = up.name  # the parent's own name object: construct.json's copies are let go
        _adopt(up, name)
    # parameter gradients: module-type children of the module's backward node
    backward_calls: dict[str, list[int]] = {}  # module base -> its backward call numbers (one pass, not per entry)
    for k in nodes:
        base, sep, n = k.rpartition(".backward.")
        if sep and n.isdigit():
            backward_calls.setdefault(base, []).append(int(n))
    for name in dump.data:
        m = _PGRAD_RE.match(name)
        if not m or name in nodes:
            continue
        base = m.group("base")
        backs = sorted(backward_calls.get(base, ()))
        if not backs:
            continue
        n = int(m.group("n")) if m.group("n") is not None and int(m.group("n")) in backs else backs[-1]
        parent = f"{base}.backward.{n}"
        nodes[name] = Node(name, MODULE, parent=nodes[parent].name)
        _adopt(nodes[parent], name)
    _group_root_apis(nodes)
    for node in nodes.values():
        if node.type == COLLECTION:
            continue
        entry = dump.data.get(node.name)
        if entry is not None:
            node.input_data, node.output_data = node_data(node.name, entry)
            notes = dump.merge_notes.get(node.name)
            if notes:
                node.merge_info = list(notes)
        frames = node_frames(dump.stack, node.name)
        if frames:
            node.stack = list(frames)
    _micro_steps(nodes)
    _post_order(nodes)
    data_dir = None
    if dump.task == "tensor":
        import os

        data_dir = os.path.join(dump.folder, "dump_tensor_data")
    return Graph(nodes, data_source, step, rank, data_dir)


def _adopt(parent: Node, name: str) -> None:
    """Append ``name`` to ``parent``'s children (its list made on the first)."""
    if isinstance(parent.children, list):
        parent.children.append(name)
    else:
        parent.children = [*parent.children, name]


def _group_root_apis(nodes: dict[str, Node]) -> None:
    root = nodes[ROOT]
    grouped: list[str] = []
    run: list[str] = []
    k = 0

    def close() -> None:
        nonlocal k
        if len(run) >= 2:
            name = f"Apis_Between_Modules.{k}"
            k += 1
            nodes[name] = Node(name, COLLECTION, parent=ROOT, children=list(run))
            for child in run:
                nodes[child].parent = name
            grouped.append(name)
        else:
            grouped.extend(run)
        run.clear()

    for child in root.children:
        if nodes[child].type == API:
            run.append(child)
        else:
            close()
            grouped.append(child)
    close()
    root.children = grouped


def _micro_steps(nodes: dict[str, Node]) -> None:
    step, seen_backward = 0, False
    for child in nodes[ROOT].children:
        node = nodes[child]
        if node.type == MODULE and ".forward" in child and seen_backward:
            step += 1
            seen_backward = False
        if node.type == MODULE and _BWD_RE.search(child):
            seen_backward = True
        stack = [child]
        while stack:
            n = nodes[stack.pop()]
            n.micro_step = step
            stack.extend(n.children)


def _post_order(nodes: dict[str, Node]) -> None:
    order = 0
    stack: list[tuple[str, bool]] = [(ROOT, False)]
    while stack:
        name, done = stack.pop()
        if done:
            nodes[name].order = order
            order += 1
            continue
        stack.append((name, True))
        stack.extend((c, False) for c in reversed(nodes[name].children))


def node_frames(stack: dict, name: str):
    """A node's call stack from ``{entry name: frames}``: its own, else (a backward call, which msprobe records no
    stack for) its forward twin's; None when neither has one."""
    frames = stack.get(name)
    if frames is None and _BWD_RE.search(name):
        frames = stack.get(_twin(name, "backward", "forward"))
    return frames


# --------------------------------------------------------------------------------------------- node data rows
def _text(v: Any) -> str:
    if v is None:
        return "null"
    t = type(v)
    if t is float or t is int or t is bool:  # the common case: no quote to strip
        return str(v)
    return str(v).replace("'", "")


def row_fields(record: Any, row: Any = None) -> dict[str, str]:
    """One data row as msprobe writes it into ``input_data``/``output_data`` (every value a string). ``row``: the
    record's :class:`~msprobe_ci.compare.rows.Row`, whose shape text is reused when it has one."""
    if not isinstance(record, dict):
        return {"value": "null"}
    if record.get("type") in ("torch.Tensor", "mindspore.Tensor") or "dtype" in record and "shape" in record:
        if record.get("Max") is None and "md5" not in record:
            return {"value": "null"}
        g = record.get
        mx, mn, mean, norm = g("Max"), g("Min"), g("Mean"), g("Norm")
        # statistics are floats but for integer tensors, md5 dumps and hand-made files; four finite floats are
        # formatted at once (number_cells: str's text, about half the time)
        cells = number_cells((mx, mn, mean, norm)) if type(mx) is float and type(norm) is float else None
        if cells is not None:
            s_mx, s_mn, s_mean, s_norm = cells.split(",")
        else:
            s_mx, s_mn, s_mean, s_norm = map(_text, (mx, mn, mean, norm))
        shape = g("shape")
        if row is not None and row.is_tensor and type(shape) is list:
            shape = row.shape  # str(list(shape)), computed once by the Row
            if "'" in shape:
                shape = shape.replace("'", "")
        else:
            shape = _text(shape)
        out = {"type": _text(g("type")), "dtype": _text(g("dtype")), "shape": shape,
               "Max": s_mx, "Min": s_mn, "Mean": s_mean, "Norm": s_norm,
               "requires_grad": _text(g("requires_grad")), "data_name": _text(g("data_name") or "-1")}
        if "md5" in record:
            out["md5"] = _text(record["md5"])
        return out
    value = record.get("value")
    if value is None and "value" not in record:
        return {k: _text(v) for k, v in record.items() if k not in ("state", "full_op_name")}
    out = {"type": _text(record.get("type")), "value": _text(value), "data_name": "-1", "requires_grad": "null"}
    out.update(Max=_text(value), Min=_text(value), Mean=_text(value), Norm=_text(value),
               dtype=f"<class {record.get('type')}>", shape="[]")
    return out


def node_data(name: str, entry: Any) -> tuple[dict[str, dict], dict[str, dict]]:
    """``(input_data, output_data)`` of one dump entry: rows with ``.output.`` (and no ``.input.``) are outputs;
    inputs, kwargs, parameters and parameter gradients are inputs, as msprobe files them."""
    return rows_data(entry_rows(name, entry))


def rows_data(rows) -> tuple[dict[str, dict], dict[str, dict]]:
    """``(input_data, output_data)`` of one entry's :class:`~msprobe_ci.compare.rows.Row` list (see
    :func:`node_data`)."""
    inputs: dict[str, dict] = {}
    outputs: dict[str, dict] = {}
    for row in rows:
        target = outputs if ".output." in row.name and ".input." not in row.name else inputs
        target[row.name] = row_fields(row.record, row)
    return inputs, outputs
