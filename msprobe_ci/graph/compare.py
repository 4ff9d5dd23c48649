"""Compare two graphs: match nodes, attach our metrics to the target side, colour nodes by our verdicts.

Matching follows msprobe's graph comparator (``shared/spec/compare-overflow-visualization.md`` §3.3): a target node
matches the bench node with the same name when both ancestor chains are equal; with ``fuzzy`` module and collection
nodes match by name alone and the API children of a matched pair by their name without call numbers plus their
order of occurrence. Both nodes of a pair get the same ``matched_link`` (ancestors + the partner's name).

Colours come from our node verdicts (:mod:`msprobe_ci.compare.verdict`), not from msprobe's dtype-blind Result:
``precision_index`` is 0 (pass), 0.5 (warning) or 1 (error) on matched target nodes with data; every container
(modules, API collections) takes the worst of its own verdict and everything inside it, all the way up, so a
failing API four levels down makes the top-level boxes red; NULL on the root, bench nodes and unmatched nodes
(grey in the viewer).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

from ..compare.report import CompareReport
from ..compare.metrics import number_cells
from ..compare.rows import fuzzy_name
from ..judge.support import NOT_COMPARABLE
from .builder import API, COLLECTION, ROOT, Graph

PRECISION = {"pass": 0, "warning": 0.5, "error": 1}


def _match_exact(target: Graph, bench: Graph) -> dict[str, str]:
    pairs = {}
    for name in target.nodes:
        if name in bench.nodes and target.ancestors(name) == bench.ancestors(name):
            pairs[name] = name
    return pairs


def _match_entries(target: Graph, bench: Graph, entry_pairs: dict[str, str]) -> dict[str, str]:
    """Across frameworks: nodes pair as the compare paired their dump entries (Cell ↔ Module by path,
    ``Primitive.dense.Dense`` ↔ ``Functional.linear`` ...), the root with the root, API collections by name."""
    pairs = {ROOT: ROOT} if ROOT in target.nodes and ROOT in bench.nodes else {}
    pairs.update({t: b for t, b in entry_pairs.items() if t in target.nodes and b in bench.nodes})
    for name, node in target.nodes.items():
        if node.type == COLLECTION and name in bench.nodes:
            pairs[name] = name
    return pairs


def _match_fuzzy(target: Graph, bench: Graph) -> dict[str, str]:
    pairs = {n: n for n, node in target.nodes.items() if node.type != API and n in bench.nodes}
    for t_name, b_name in list(pairs.items()):
        t_apis = [c for c in target.nodes[t_name].children if target.nodes[c].type == API]
        b_by_key: dict[str, list[str]] = defaultdict(list)
        for c in bench.nodes[b_name].children:
            if bench.nodes[c].type == API:
                b_by_key[_api_key(c)].append(c)
        seen: dict[str, int] = defaultdict(int)
        for c in t_apis:
            key = _api_key(c)
            i = seen[key]
            seen[key] += 1
            if i < len(b_by_key[key]):
                pairs[c] = b_by_key[key][i]
    return pairs


def _api_key(name: str) -> str:
    return re.sub(r"_rank\d+", "", fuzzy_name(name))


def compare_graphs(target: Graph, bench: Graph, report: CompareReport, *, fuzzy: bool = False) -> dict[str, str]:
    """Match ``target`` (data_source NPU) against ``bench`` and annotate both in place.

    Args:
        target, bench: graphs of the two sides of the same step and rank.
        report: :func:`~msprobe_ci.compare.compare_dumps` of the same two dumps (metrics and node verdicts).
        fuzzy: msprobe's ``-fm`` matching.

    Returns:
        ``{target node name: bench node name}`` for every matched pair.
    """
    cross = report.frameworks[0] != report.frameworks[1]
    pairs = _match_fuzzy(target, bench) if fuzzy else _match_entries(target, bench, report.entry_pairs) \
        if cross else _match_exact(target, bench)
    for t_name, b_name in pairs.items():
        if fuzzy or cross:  # crosswise, as msprobe stores them
            target.nodes[t_name].matched_link = bench.ancestors(b_name) + [b_name]
            bench.nodes[b_name].matched_link = target.ancestors(t_name) + [t_name]
        else:
            link = target.ancestors(t_name) + [t_name]
            target.nodes[t_name].matched_link = link
            bench.nodes[b_name].matched_link = list(link)
    rows = {rr.target.name: rr for rr in report.rows}
    verdicts = {n.name: n for n in report.nodes}
    for t_name in pairs:
        node = target.nodes[t_name]
        if node.type == COLLECTION or t_name == ROOT:
            continue
        annotate(node, node.input_data or {}, node.output_data or {}, rows, verdicts.get(t_name), report.mode)
    _roll_up(target, ROOT, pairs)
    return pairs


def annotate(node, input_data: dict, output_data: dict, rows: dict, verdict, mode: str) -> None:
    """Put one matched target node's compare results on its data rows and colour it (in place).

    Args:
        node: the target :class:`~msprobe_ci.graph.builder.Node` (its ``precision_index`` is set).
        input_data, output_data: its ``{row name: {field: str}}`` (the node's own, or a streaming writer's).
        rows: ``{row name: RowResult}`` holding at least this node's rows.
        verdict: its :class:`~msprobe_ci.compare.verdict.NodeResult`, or None.
        mode: the compare mode (``md5`` colours uninitialised-memory APIs red, other modes green).
    """
    for data in (input_data, output_data):
        for row_name, fields in data.items():
            rr = rows.get(row_name)
            if rr is None or rr.bench is None:
                continue
            fields.update(_metric_texts(rr.metrics))
            consistent = rr.target.requires_grad == rr.bench.requires_grad or \
                "N/A" in (rr.target.requires_grad, rr.bench.requires_grad)  # MindSpore records have none
            status, message = "pass", []
            if verdict is not None and verdict.worst_row == row_name and verdict.status in ("warning", "error"):
                status, message = verdict.status, [f"{verdict.status}: {verdict.message}"]
            fields.update({"Requires_grad Consistent": str(consistent), "Result": status,
                           "Err_message": json.dumps(message) if message else "[]"})
    if verdict is not None and verdict.status in PRECISION and (input_data or output_data):
        node.precision_index = PRECISION[verdict.status]
        name = node.name
        api = name.split(".")[1] if name.count(".") >= 1 else ""
        if api in NOT_COMPARABLE:  # uninitialised memory is never comparable
            node.precision_index = 1 if mode == "md5" else 0


def _roll_up(graph: Graph, name: str, pairs: dict[str, str]) -> None:
    """Colour every matched module and API collection by the worst of its own verdict and everything inside it,
    bottom-up, so the path from the top-level boxes down to the first error is red all the way. The root stays
    NULL (msprobe's graphs leave it so; it is the canvas, not a box)."""
    stack, order = [name], []
    while stack:  # iterative post-order: deep module trees do not hit the recursion limit
        n = stack.pop()
        order.append(n)
        stack.extend(c for c in graph.nodes[n].children if c in graph.nodes)
    for n in reversed(order):
        node = graph.nodes[n]
        if n == ROOT or node.type == API or n not in pairs:
            continue
        values = [graph.nodes[c].precision_index for c in node.children if c in graph.nodes]
        values = [v for v in values if v is not None]
        if node.precision_index is not None:
            values.append(node.precision_index)
        if values or node.type == COLLECTION:
            node.precision_index = max(values, default=0)


_DECIMAL = re.compile(r"^(\d+\.\d+)(%?)$")


def _metric_texts(metrics: dict) -> dict[str, str]:
    """A row's metrics as node-data text: floats as ``str`` writes them, everything else by :func:`_text`; a
    statistics row's four differences formatted at once (:func:`~msprobe_ci.compare.metrics.number_cells`)."""
    if len(metrics) == 8 and tuple(metrics) == _STATS_KEYS:
        d0, r0, d1, r1, d2, r2, d3, r3 = metrics.values()
        cells = number_cells((d0, d1, d2, d3))
        if cells is not None:
            d0, d1, d2, d3 = cells.split(",")
            return {"Max diff": d0, "MaxRelativeErr": _text(r0), "Min diff": d1, "MinRelativeErr": _text(r1),
                    "Mean diff": d2, "MeanRelativeErr": _text(r2), "L2norm diff": d3,
                    "NormRelativeErr": _text(r3)}
    return {k: str(v) if type(v) is float else _text(v) for k, v in metrics.items()}


_STATS_KEYS = ("Max diff", "MaxRelativeErr", "Min diff", "MinRelativeErr", "Mean diff", "MeanRelativeErr",
               "L2norm diff", "NormRelativeErr")


def _text(v) -> str:
    """msprobe's node-data formatting: decimal strings (``12.3456789``, ``0.1234567%``) with more than 6 decimals
    are rounded to 6 (what ``^(\\d+\\.\\d+)(%?)$`` matches, checked by string methods)."""
    if v is None:
        return "null"
    if type(v) is not str:
        return str(v)
    if len(v) <= 8:
        return v
    if v[-1] == "\n":  # where the regex's $ matches before a final newline
        m = _DECIMAL.match(v)
        if m and len(m.group(1)) - m.group(1).index(".") > 7:
            return f"{float(m.group(1)):.6f}{m.group(2)}"
        return v
    num = v[:-1] if v[-1] == "%" else v
    i = num.find(".")
    if i > 0 and len(num) - i > 7 and num[:i].isdecimal() and num[i + 1:].isdecimal():  # more than 6 decimals
        return f"{float(num):.6f}{v[len(num):]}"
    return v
