"""Full-network compare: every row of target vs bench, matched by name, msprobe's metrics, our node verdicts."""

from __future__ import annotations

import functools
import json
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any

from ..dump import names
from ..dtypes import finite_max, smallest_normal
from ..dump.reader import Dump
from ..dump.writer import timestamped_path
from ..outputs import atomic_write
from ..errors import MsprobeError
from . import metrics as M
from .metrics import number_cells
from .rows import Row, match_rows
from .verdict import CompareResult, Thresholds, judge, unit_roundoff



@dataclass
class RowResult:
    """One compared row: the target row, its bench row (or None), msprobe's columns and our relative error."""

    target: Row
    bench: Row | None
    metrics: dict[str, Any]
    error: float
    norm_error: float = math.nan  # statistics mode: the Norm's own relative error (NaN: it says nothing)


@dataclass
class CompareReport:
    """Everything one compare produced.

    Attributes:
        mode: ``statistics``, ``tensor`` (msprobe's "all") or ``md5``.
        rows: per-row results in target dump order.
        nodes: node verdicts (one per target dump entry) in execution order.
        first_divergence: the earliest node whose own verdict is ``error``, or None.
        unmatched: target nodes without a bench counterpart.
    """

    mode: str
    rows: list[RowResult]
    nodes: list[CompareResult]
    target_stack: dict[str, list[str]] = field(default_factory=dict)
    thresholds: Thresholds = field(default_factory=Thresholds)
    isolated: bool = False
    seconds: dict[str, float] = field(default_factory=dict)  # node -> seconds its isolated verdict took
    frameworks: tuple[str, str] = ("pytorch", "pytorch")  # (target, bench), from dump.json
    entry_pairs: dict[str, str] = field(default_factory=dict)  # target entry -> bench entry (matched rows)
    replayed: list = field(default_factory=list)  # ApiResults of a tensor dump judged by replay (isolated.replay)
    _stack_cells: dict[int, tuple] = field(default_factory=dict, repr=False, compare=False)  # id -> (frames, cell)

    @property
    def first_divergence(self) -> CompareResult | None:
        """The earliest node whose own verdict is ``error``; a module that only contains a failing API (roll-up)
        is never the first divergence when that API is in the report."""
        errors = [n for n in self.nodes if n.status == "error"]
        own = [n for n in errors if "rollup" not in n.metrics]
        return (computed_first(own) or own or errors or [None])[0]

    @property
    def unmatched(self) -> list[str]:
        return [n.name for n in self.nodes if n.status == "unmatched"]

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("pass", "warning", "error", "unmatched")}
        for n in self.nodes:
            out[n.status] += 1
        return out

    def worst(self, k: int = 5) -> list[CompareResult]:
        """The ``k`` judged nodes with the largest value/threshold ratio, errors first."""
        judged = [n for n in self.nodes if n.status != "unmatched"]
        return sorted(judged, key=lambda n: -(n.value / n.threshold if n.threshold > 0 else math.inf))[:k]

    def __bool__(self) -> bool:
        return self.first_divergence is None

    # ------------------------------------------------------------------ CSV
    def columns(self) -> list[str]:
        head = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
                "NPU Requires_grad", "Bench Requires_grad"]
        stats = ["NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean",
                 "Bench l2norm"]
        tail = ["Requires_grad Consistent", "Result", "Err_message", "NPU_Stack_Info"]
        if self.mode == "md5":
            return head + ["NPU MD5", "BENCH MD5"] + tail
        if self.mode == "tensor":
            return head + list(M.TENSOR_COLUMNS) + stats + tail + ["Data_name"]
        return head + list(M.STAT_DIFF_COLUMNS) + list(M.STAT_REL_COLUMNS) + stats + tail

    def write_csv(self, out_dir: str, prefix: str = "compare_result") -> str:
        """Write ``compare_result_<YYYYmmddHHMMSS>.csv`` with msprobe's columns; returns the path.

        ``Result``/``Err_message`` carry our node verdict (on the node's output rows) instead of msprobe's
        dtype-blind one. Never overwrites: a clash in the same second gets a ``_N`` suffix.
        """
        path = timestamped_path(out_dir, prefix, ".csv")
        verdicts = {n.name: n for n in self.nodes}
        stack_done: set[str] = set()
        with atomic_write(path, "w", newline="", encoding="utf-8") as fh:
            with RowWriter(fh, self) as w:
                for rr in self.rows:
                    w.write(rr, verdicts.get(rr.target.entry), stack_done)
        return path

    def _csv_line(self, rr: RowResult, node: CompareResult | None, stack_done: set[str]) -> str:
        """The CSV record of one row: ``csv_record(self._csv_row(...))``, built without a cell-by-cell pass for
        the common row (statistics, both sides tensor records; a test holds the two equal on every row of real
        compares). Its numeric cells (metrics and statistics: numbers, ``None``, or this module's own words such
        as ``N/A`` and ``12.5%``) are joined by ``str`` (``repr`` for a float, as :mod:`csv` writes them) and
        checked for a delimiter or quote before they are trusted; names, dtypes and requires_grad likewise."""
        t, b = rr.target, rr.bench
        if self.mode != "statistics" or b is None or not t.is_tensor or not b.is_tensor:
            return csv_record(self._csv_row(rr, node, stack_done))
        metrics = _stat_cells(rr.metrics)
        if None in metrics:
            return csv_record(self._csv_row(rr, node, stack_done))
        # the four differences and the eight statistics formatted at once; the relative errors are text already
        cells = number_cells((*metrics[:4], *t._stats, *b._stats))
        if cells is not None:
            d0, d1, d2, d3, stats = cells.split(",", 4)
            r0, r1, r2, r3 = metrics[4:]
            nums = f"{d0},{d1},{d2},{d3},{r0},{r1},{r2},{r3},{stats}"
        else:
            nums = ",".join(map(str, (*metrics, *t._stats, *b._stats)))
        words = ",".join((t.name, b.name, t.dtype, b.dtype, t.requires_grad, b.requires_grad))
        if nums.count(",") != 15 or words.count(",") != 5 or _NEEDS_QUOTES_BUT_COMMA(nums) or \
                _NEEDS_QUOTES_BUT_COMMA(words):
            return csv_record(self._csv_row(rr, node, stack_done))
        ts, bs = t.shape, b.shape
        if "," in ts:
            ts = '"' + ts + '"'  # str(list of ints): a comma, never a quote
        if "," in bs:
            bs = '"' + bs + '"'
        consistent = t.requires_grad == b.requires_grad or t.requires_grad == "N/A" or b.requires_grad == "N/A"
        if node is not None and t.side == "output" and node.status in ("warning", "error") and \
                node.worst_row == t.name:
            tail = f"{consistent},{node.status},{_quoted(json.dumps([f'{node.status}: {node.message}']))}"
        else:
            tail = "True,pass,[]" if consistent else "False,pass,[]"
        stack = self._stack_cell(t.entry, stack_done)  # checked, or quoted, when it was cached
        return f"{t.name},{b.name},{t.dtype},{b.dtype},{ts},{bs},{t.requires_grad},{b.requires_grad},{nums}," \
               f"{tail},{stack}\r\n"

    def _stack_cell(self, entry: str, stack_done: set[str]) -> str:
        """The NPU_Stack_Info cell of an entry's first row (``N/A`` on the others, and without a stack): the
        stack once per stack.json group, a :class:`_Quoted` cell when it needs quotes."""
        if entry in stack_done:
            return "N/A"
        stack_done.add(entry)
        frames = self.target_stack.get(entry)
        if not frames:
            return "N/A"
        # stack.json groups the entries that share a stack: one cell per group, quoted for the CSV once
        known = self._stack_cells.get(id(frames))
        if known is None or known[0] is not frames:
            cell = str(list(frames))
            known = (frames, _Quoted(_quoted(cell)) if _NEEDS_QUOTES(cell) else cell)
            self._stack_cells[id(frames)] = known
        return known[1]

    def _csv_row(self, rr: RowResult, node: CompareResult | None, stack_done: set[str]) -> list[Any]:
        t, b = rr.target, rr.bench
        na = "N/A"
        if b is None:
            row: list[Any] = [t.name, na, t.dtype, na, t.shape, na, t.requires_grad, na]
        else:
            row = [t.name, b.name, t.dtype, b.dtype, t.shape, b.shape, t.requires_grad, b.requires_grad]
        if t.record is None or (b is not None and b.record is None):
            # a null slot's dtype and shape: msprobe writes N/A for PyTorch dumps and None for MindSpore ones
            tn, bn = ("None" if fw == "mindspore" else na for fw in self.frameworks)
            if t.record is None:
                row[2] = row[4] = tn
            if b is not None and b.record is None:
                row[3] = row[5] = bn
        mode = self.mode
        if mode == "md5":
            row += [t.md5, b.md5 if b else na]
        else:
            get = rr.metrics.get
            row += [get(c, na) for c in (M.TENSOR_COLUMNS if mode == "tensor" else _STAT_COLUMNS)]
            row += ["None" if v is None else v for v in t.stats()]
            row += ["None" if v is None else v for v in b.stats()] if b else [na] * 4
        if b is None:
            row += ["True", "unmatched", _NO_BENCH]
        else:
            consistent = t.requires_grad == b.requires_grad or "N/A" in (t.requires_grad, b.requires_grad)
            if node is not None and t.side == "output" and node.status in ("warning", "error") and \
                    node.worst_row == t.name:
                row += [str(consistent), node.status, json.dumps([f"{node.status}: {node.message}"])]
            else:
                row += [str(consistent), "pass", "[]"]
        row.append(self._stack_cell(t.entry, stack_done))
        if mode == "tensor":
            row.append(str([t.data_name, b.data_name if b else "-1"]))
        return row


def _NEEDS_QUOTES(s: str) -> bool:
    """A cell the excel dialect quotes: it holds ``,``, ``"``, CR or LF (four substring scans: about a tenth of
    a regex character class's time on a compare row's text)."""
    return "," in s or '"' in s or "\n" in s or "\r" in s


def _NEEDS_QUOTES_BUT_COMMA(s: str) -> bool:
    """:func:`_NEEDS_QUOTES` but for ``,`` (text joined from cells, checked after its commas were counted)."""
    return '"' in s or "\n" in s or "\r" in s


def csv_record(row: list[Any]) -> str:
    """The line ``csv.writer(fh).writerow(row)`` writes (excel dialect, QUOTE_MINIMAL, ``\\r\\n``), built with
    one join: about half the writer's time on a compare row. Cells: ``str`` as is, ``None`` empty, anything else
    by ``str`` (``repr`` for a float); a cell holding ``,``, ``"``, CR or LF is quoted with ``"`` doubled. A
    property test holds it equal to :mod:`csv`'s output. A :class:`_Quoted` cell is written as it is."""
    if len(row) == 1 and row[0] in ("", None):
        return '""\r\n'
    return ",".join([_quoted(v) if v.__class__ is str and _NEEDS_QUOTES(v) else v if v.__class__ is str
                     else repr(v) if v.__class__ is float else _cell(v) for v in row]) + "\r\n"


def _quoted(s: str) -> str:
    return '"' + s.replace('"', '""') + '"'


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if v.__class__ is _Quoted:
        return str.__str__(v)
    s = str.__str__(v) if isinstance(v, str) else str(v)
    return _quoted(s) if _NEEDS_QUOTES(s) else s


class RowWriter:
    """Writes a report's header, then one CSV record per :class:`RowResult` (msprobe's columns; the bytes
    ``csv.writer`` writes, see :func:`csv_record`), handed to the file :data:`_WRITE_BATCH` records at a time
    (:meth:`flush` writes the rest; ``with RowWriter(...)`` flushes on a clean exit)."""

    def __init__(self, fh, report: CompareReport):
        self._fh, self._report = fh, report
        self._buf: list[str] = []
        fh.write(csv_record(report.columns()))

    def write(self, rr: RowResult, node: CompareResult | None, stack_done: set[str]) -> None:
        """One record; ``stack_done`` holds the entries whose stack was written (msprobe writes it once)."""
        buf = self._buf
        buf.append(self._report._csv_line(rr, node, stack_done))
        if len(buf) >= _WRITE_BATCH:
            self.flush()

    def flush(self) -> None:
        """Hand the records held so far to the file."""
        if self._buf:
            self._fh.write("".join(self._buf))
            self._buf.clear()

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.flush()


_WRITE_BATCH = 512


class _Quoted(str):
    """A cell already quoted (:func:`csv_record` writes it as it is)."""

    __slots__ = ()


_STAT_COLUMNS = M.STAT_DIFF_COLUMNS + M.STAT_REL_COLUMNS
_stat_cells = operator.itemgetter(*_STAT_COLUMNS)
_NO_BENCH = json.dumps(["warning: No bench data matched."])


def _mode(target: Dump, bench: Dump) -> str:
    if target.task != bench.task:
        if {target.task, bench.task} <= {"statistics", "tensor"}:
            return "md5" if target.summary_mode == "md5" and bench.summary_mode == "md5" else "statistics"
        raise MsprobeError(f"dump tasks differ: target {target.task!r} vs bench {bench.task!r}")
    if target.task == "tensor":
        return "tensor"
    if target.summary_mode == "md5" and bench.summary_mode == "md5":
        return "md5"
    return "statistics"


@functools.lru_cache(maxsize=4096)  # asked three or four times per node in a row
def _twin_entries(name: str) -> tuple[str, ...]:
    """Entries whose rows a node computes from, besides its own inputs (:mod:`msprobe_ci.dump.names`): a
    backward call's forward twin; a parameters_grad entry's module forward and backward calls."""
    node = names.parse(name, any_prefix=True)
    if node is None:
        return ()
    if node.kind in ("api", "module") and node.direction == "backward":
        return (node.twin("forward"),)
    if node.kind == "parameters_grad" and node.call is not None:
        return (node.twin("forward"), node.twin("backward"))
    return ()


def compare_dumps(target: Dump, bench: Dump, *, fuzzy: bool = False,
                  thresholds: Thresholds | None = None, mappings: Any = None) -> CompareReport:
    """Compare a target dump against a bench dump.

    Args:
        target: the dump under test (msprobe's "NPU" side).
        bench: the reference (msprobe's "Bench"/golden side).
        fuzzy: ignore call indices when matching (``-fm``).
        thresholds: node-rule factors; defaults as documented in :mod:`msprobe_ci.compare.verdict`.
        mappings: msprobe's mapping files (:class:`~msprobe_ci.compare.crossframe.Mappings`: ``-dm``, ``-lm``,
            ``-cm``, ``-am``). A MindSpore dump against a PyTorch one (either side) is matched across frameworks
            automatically (:mod:`msprobe_ci.compare.crossframe`); the files refine it.

    Returns:
        A :class:`CompareReport`; ``bool(report)`` is true when no node is an error.

    Raises:
        MsprobeError: incompatible dumps, or (tensor mode) a missing or non-tensor ``.pt`` file.
    """
    th = thresholds or Thresholds()
    mode = _mode(target, bench)
    t_fw, b_fw = getattr(target, "framework", "pytorch"), getattr(bench, "framework", "pytorch")
    cross = None
    if t_fw != b_fw and "mindspore" in (t_fw, b_fw):
        from .crossframe import translate

        cross = translate(target.data, bench.data, mappings, target_is_mindspore=t_fw == "mindspore")
    elif mappings is not None and (getattr(mappings, "layer", None) or getattr(mappings, "cell", None)):
        from .crossframe import layer_translation

        cross = layer_translation(target.data, bench.data, mappings)
    pairs = match_rows(target.data, bench.data, fuzzy=fuzzy, cross=cross,
                       data_map=getattr(mappings, "data", None) or None)
    rows: list[RowResult] = []
    reach = math.inf
    for t, b in pairs:
        reach = carried_range(t, b, reach)
        rows.append(_compare_row(t, b, mode, target, bench, reach))
    by_entry: dict[str, list[RowResult]] = {}
    for rr in rows:
        by_entry.setdefault(rr.target.entry, []).append(rr)
    nodes, floor = [], 0.0
    for name in target.data:
        own = by_entry.get(name, [])
        floor = carried_roundoff(own, floor)
        nodes.append(_judge_node(name, own, by_entry, mode, th, floor))
    entry_pairs: dict[str, str] = {}
    for t, b in pairs:
        if b is not None:
            entry_pairs.setdefault(t.entry, b.entry)
    return CompareReport(mode=mode, rows=rows, nodes=_blame_first(nodes, th), target_stack=target.stack,
                         thresholds=th, frameworks=(t_fw, b_fw), entry_pairs=entry_pairs)


def accumulated(name: str) -> bool:
    """An accumulated parameter gradient (a ``parameters_grad`` entry). Such an entry stands where its parameter's
    gradient was first accumulated but holds the final sum: a weight tied to an embedding (BERT's decoder, T5's
    shared embedding) sums the gradients of calls made after its place in the dump, so its error is the first
    divergence only where no computed node fails."""
    return ".parameters_grad" in name


def computed_first(errors: list[CompareResult]) -> list[CompareResult]:
    """``errors`` without the :func:`accumulated` ones."""
    return [n for n in errors if not accumulated(n.name)]


def _blame_first(nodes: list[CompareResult], th: Thresholds) -> list[CompareResult]:
    """After the first error, an error node whose inputs differ from the bench's at all (input error above 0), or
    are not in the dump (an accumulated parameter gradient whose module's incoming gradient is unseen), is
    explained by what came before: it becomes a warning "propagated from X" (X: the first divergence). An error on
    inputs equal to the bench's stays an error (a second, independent divergence).

    Without isolation (two dumps on disk) this is the best attribution available: whole-network differences
    cannot tell a node's own error from an amplified one, and statistics understate what an input carries element
    by element (a fault's noise two layers on moved a GPT-2 projection's inputs' statistics by 1u in fp16 and its
    output's Max by 6u), so later blame goes to the first cause; fix it and run again to see a second one."""
    first = None
    out = []
    for n in nodes:
        if n.status == "error" and n.metric == "RelativeErr":
            if first is None:
                if not accumulated(n.name):
                    first = n.name
            elif n.input_error > 0.0 or n.metrics.get("inputs_unseen"):
                n = replace(n, status="warning", message=f"{n.name}: propagated from {first} ({n.message})",
                            metrics=dict(n.metrics, propagated_from=first))
        out.append(n)
    return out


def _compare_row(t: Row, b: Row | None, mode: str, target: Dump, bench: Dump, reach: float = math.inf) -> RowResult:
    """One row's metrics and relative error. ``reach``: :func:`carried_range` up to this row (statistics are
    compared within the smaller of it and the target dtype's range)."""
    if b is None:
        return RowResult(t, None, {}, math.nan)
    if t.record is None or b.record is None:
        both_none = t.record is None and b.record is None
        cols = {c: M.UNSUPPORTED for c in M.TENSOR_COLUMNS} if mode == "tensor" else \
            M.stats_metrics(t.stats(), b.stats())
        return RowResult(t, b, cols, 0.0 if both_none else math.inf, 0.0 if both_none else math.nan)
    if not t.is_tensor or not b.is_tensor:
        tv, bv = t.stats()[0], b.stats()[0]
        err = 0.0 if str(tv) == str(bv) else _scalar_err(tv, bv)
        cols = {c: M.UNSUPPORTED for c in M.TENSOR_COLUMNS} if mode == "tensor" else \
            M.stats_metrics(t.stats(), b.stats())
        return RowResult(t, b, cols, err, err if math.isfinite(err) else math.nan)
    if mode == "md5":
        return RowResult(t, b, {}, 0.0 if t.md5 == b.md5 else 1.0)
    if mode == "tensor" and t.data_name != "-1" and b.data_name != "-1":
        tn = M.to_array(target.load_tensor(t.data_name, t.record.get("shape")))
        bn = M.to_array(bench.load_tensor(b.data_name, b.record.get("shape")))
        if _transposed(t, b):  # PyTorch's linear hands back dW transposed; paired by shape across frameworks
            bn = bn.T
        elif _regrouped(t, b):
            bn = bn.reshape(tn.shape)
        cols = M.tensor_metrics(tn, bn)
        return RowResult(t, b, cols, M.relative_error_arrays(tn, bn, _tiny(t.dtype, b.dtype)))
    if t.shape != b.shape and not _transposed(t, b) and not _regrouped(t, b):
        return RowResult(t, b, M.stats_metrics(t.stats(), b.stats()), math.inf)
    ts, bs = t.stats(), b.stats()
    t_max = _dtype_max(t.dtype)
    if reach < t_max:
        t_max = reach
    # a bench value past half the range is a sentinel (a mask filled with finfo.min, on either side's dtype): no
    # computation lands there short of overflowing, and it swamps the Mean, the Norm and their RMS floor, which
    # then say nothing of the values it masks (fp32 scores + finfo(float32).min on both sides: a 1% fault in the
    # scores moved their Max alone, by 1%, and their drift error read 4e-42)
    t_max *= 0.5
    tiny = _tiny(t.dtype, b.dtype)
    cols, err = M.stats_pair(ts, bs, t.numel, t_max, tiny)
    return RowResult(t, b, cols, err, M.norm_error(ts, bs, t.numel, t_max, tiny) if err else 0.0)


def carried_range(t: Row, b: Row | None, reach: float) -> float:
    """The smallest finite range (``finfo.max``) among the dtypes of the matched rows seen so far in the target's
    dump order: ``reach`` and this pair's.

    What the target once held in a narrow dtype stays within that range after an upcast, while the bench's
    values need not: GPT-J adds its fp16 attention mask (``finfo(float16).min``) to fp32 scores, where the fp32
    bench adds ``finfo(float32).min`` and overflows to ``-inf``. Both mean "masked"; beyond the carried range
    statistics compare clamped (:func:`msprobe_ci.compare.metrics.relative_error_stats`)."""
    if b is None:
        return reach
    m = min(_dtype_max(t.dtype), _dtype_max(b.dtype))
    return m if m < reach else reach


@functools.lru_cache(maxsize=256)
def _dtype_max(dtype: str) -> float:
    m = finite_max(dtype)
    return math.inf if m is None else m


@functools.lru_cache(maxsize=256)
def _tiny(t_dtype: str, b_dtype: str) -> float:
    return smallest_normal(t_dtype, b_dtype)


def _regrouped(t: Row, b: Row) -> bool:
    """A backward row of the same size in another shape. An API's backward record is the gradient its last
    autograd node hands back (msprobe records it so), and which node ends a composite API can depend on the dtype:
    CPU ``scaled_dot_product_attention`` in fp16 ends in a cast of a ``[2, 4, 16, 8]`` gradient, in fp32 in a view
    of an ``[8, 16, 8]`` one. Same values: statistics do not depend on the shape, tensors compare flattened."""
    return ".backward" in t.entry and t.numel == b.numel and t.shape != b.shape


def _transposed(t: Row, b: Row) -> bool:
    """Both 2-D tensors whose shapes are each other's transpose (and not equal)."""
    ts, bs = (list(r.record.get("shape") or []) if r.is_tensor else [] for r in (t, b))
    return len(ts) == 2 and ts != bs and ts == bs[::-1]


def _scalar_err(tv: Any, bv: Any) -> float:
    try:
        t, b = float(tv), float(bv)
    except (TypeError, ValueError):
        return math.inf
    if math.isnan(t) and math.isnan(b):
        return 0.0
    return abs(t - b) / max(abs(b), 1e-12)


def carried_roundoff(own: list[RowResult], floor: float) -> float:
    """The coarsest unit roundoff among the matched rows seen so far in the target's dump order: ``floor`` and
    ``own``'s target and bench dtypes.

    Data rounded once to a dtype carries that dtype's error into everything computed from it, even after an
    upcast (an fp32 RMSNorm reduction of fp16 activations). Statistics cannot show it: averaged over a whole tensor,
    per-element rounding cancels, so an input's Mean/Norm error understates what each reduced row carries. The node
    rule therefore uses at least this roundoff (see :mod:`msprobe_ci.compare.verdict`)."""
    for r in own:
        if r.bench is not None:
            u = max(_dtype_roundoff(r.target.dtype), _dtype_roundoff(r.bench.dtype))
            if u > floor:
                floor = u
    return floor


@functools.lru_cache(maxsize=256)
def _dtype_roundoff(dtype: str) -> float:
    return unit_roundoff(dtype)


def _judge_node(name: str, own: list[RowResult], by_entry: dict[str, list[RowResult]], mode: str,
                th: Thresholds, floor: float) -> CompareResult:
    """One node's verdict. ``floor``: :func:`carried_roundoff` up to and including this node's rows (it covers
    the output dtypes, so it is the node's u)."""
    outputs = [r for r in own if r.target.side == "output" and r.bench is not None]
    inputs = [r for r in own if r.target.side == "input" and r.bench is not None]
    for twin in _twin_entries(name):
        inputs += [r for r in by_entry.get(twin, []) if r.bench is not None]
    if not own or all(r.bench is None for r in own):
        return CompareResult(name=name, status="unmatched", message=f"{name}: no bench data matched")
    if not outputs:
        return CompareResult(name=name, status="pass", message=f"{name}: no output to judge")
    if mode == "md5":
        return _judge_md5(name, inputs, outputs)
    errs = sorted((r.error for r in inputs if not math.isnan(r.error)), reverse=True)
    # bilinear ops (mul, matmul, linear) add the errors of their two operands; a backward node combines the
    # incoming gradient with the saved operands of its forward twin, so three
    gradient = ".backward" in name or ".parameters_grad" in name
    r_in = sum(errs[:3] if gradient else errs[:2])
    api = _api_name(name)
    if api in POWER_APIS and ".forward" in name:
        r_in *= max(1.0, _exponent(api, own))
    kappa = 1.0
    routed = 0.0
    incoming: list = []
    saved: list = []
    if gradient:
        incoming, saved = _gradient_operands(name, own, by_entry)
        if api in ROUTING_APIS and saved:
            routed = routing_error(max(o[0] for o in saved))
            r_in = max(r_in, routed)
        scatter = api in SCATTER_APIS or ".Embedding." in name
        kappas = [(r, cancellation(_operand(r), incoming, saved, scatter)) for r in outputs]
        worst, kappa = max(kappas, key=lambda rk: (rk[0].error / rk[1] if not math.isnan(rk[0].error) else -1.0))
    else:
        kappas = [(r, 1.0) for r in outputs]
        worst = max(outputs, key=lambda r: (r.error if not math.isnan(r.error) else -1.0))
    if api in LIPSCHITZ_APIS and not gradient:  # a property of the forward function, not of its gradient
        r_in = max(r_in, _absolute_input_error(inputs, worst))
    u = floor
    module = name.startswith("Module.") and ".parameters_grad" not in name
    if module:
        r_in += u  # a module's parameters are inputs its entry does not show: they carry at least their rounding
    statistics = mode == "statistics"

    def verdict(u_eff: float) -> tuple[CompareResult, CompareResult | None]:
        """(the worst-statistic test, the scale test or None) at roundoff ``u_eff``."""
        drift = judge(name, worst.error, r_in, u_eff, th, worst.target.name, worst.metrics, statistics=statistics,
                      condition=kappa)
        if not statistics:
            return drift, None
        return drift, _scale_test(name, inputs, own, kappas, api, gradient, module, routed, u_eff, r_in, th)

    drift, scale = verdict(u)
    result = scale if scale is not None and _SEVERITY[scale.status] > _SEVERITY[drift.status] else drift
    if result.status == "error" and gradient and statistics:
        result = _gradient_allowances(result, drift, scale, verdict, outputs, incoming, saved, u)
    if result.status == "error" and ".parameters_grad" in name and not incoming:
        # the gradient its module's backward received is not in the dump (an embedding's: its input is integer
        # ids), so what this accumulated gradient was computed from is unseen, not clean (_blame_first)
            result = replace(result, metrics=dict(result.metrics, inputs_unseen=True))
    return result


def _gradient_allowances(result: CompareResult, drift: CompareResult, scale: CompareResult | None, verdict,
                         outputs: list[RowResult], incoming: list, saved: list, u: float) -> CompareResult:
    """A gradient's error (statistics mode) that a benign kernel or the statistics themselves can explain becomes
    a warning saying how, each test (worst statistic, scale) on its own failing row:

    * a sum over K broadcast rows (a bias's or a normalization weight's gradient, a per-row scale's) accumulated
      in the target's dtype, as CPU kernels may (GPU and NPU kernels accumulate in float32): worst case about
      ``u · K / 2``, so the test is judged again with that roundoff (CPU bf16 LayerNorm weight gradients of GPT-2
      small: 6% at 512 tokens, 33% at 2048, measured by ``benchmarks/drift_calibration.py``); a contraction over
      K (a weight gradient) so accumulated, whose products have no common sign: ``u · sqrt(K)`` (a CPU fp16
      conv2d weight gradient over 1,024 positions: 7.7u);
    * the worst statistic failing (a Max, Min or Mean: one element, or a sum with cancellation) while the scale test
      passes: each element of a gradient sums several products, each carrying its operands' own error, which the
      operands' statistics do not bound (their Max and Min are other elements). Measured on stock OPT at bf16:
      a weight gradient's Max 2.7x, a positional embedding gradient's Min 4.4x its inputs' worst statistic, with
      the norms within 0.5%. A gradient scaled by a fault moves its norm and fails the scale test."""
    why = []

    def summed(test: CompareResult, pick: int) -> bool:
        row = next((r for r in outputs if r.target.name == test.worst_row), None)
        if row is None:
            return False
        k = reduction_length(_operand(row), incoming)
        if k > 1:
            wide_u, how = u * k / 2, f"a sum over {k} rows accumulated in the target's dtype (u x {k}/2"
        else:
            k = contraction_length(_operand(row), incoming, saved)
            if not k:
                return False
            wide_u, how = u * math.sqrt(k), f"a contraction over {k} accumulated in the target's dtype (u x sqrt({k})"
        wide = verdict(wide_u)[pick]
        if wide is None or wide.status == "error":
            return False
        why.append(f"{test.worst_row} is within what {how} = {wide_u:.3g}; CPU kernels may accumulate so, GPU and "
                   f"NPU kernels accumulate in float32) can reach")
        return True

    scale_ok = scale is None or scale.status != "error" or summed(scale, 1)
    drift_ok = drift.status != "error" or summed(drift, 0)
    if not drift_ok and scale is not None and scale_ok:
        drift_ok = True
        why.append(f"its norm agrees with its inputs' ({scale.value:.3g} <= {scale.threshold:.3g}), and one "
                   f"element of a gradient may err more than its inputs' statistics show")
    if drift_ok and scale_ok:
        return replace(result, status="warning", message=f"{result.message}; {'; '.join(why)}: a warning, not an "
                                                         f"error")
    return result


_SEVERITY = {"pass": 0, "unmatched": 0, "warning": 1, "error": 2}


def _scale_test(name: str, inputs: list[RowResult], own: list[RowResult], kappas: list, api: str, gradient: bool,
                module: bool, routed: float, u: float, r_in_drift: float, th: Thresholds) -> CompareResult | None:
    """The drift rule's scale test (statistics mode): the output's Norm error (:func:`metrics.norm_error`)
    against the inputs' Norm errors, as the node rule judges the worst statistic (round_factor, propagation,
    statistics slack, error_factor, a gradient's cancellation factor), plus the inputs' drift error squared (noise
    that is not a change of scale moves a norm to second order). Rounding moves a norm by at most ``u``, so a
    fault that scales an output by 2% stands out against bf16's ``u`` 0.4% even where the inputs' Max and Min
    carry as much: the worst-statistic test alone let such faults pass. None where an input's or every output's
    Norm says nothing (masked, missing, out of range): the inputs' scale error is then unknown."""
    ins = []
    for r in inputs:
        if math.isnan(r.norm_error):
            return None
        ins.append(r.norm_error)
    outs = [(r, k) for r, k in kappas if not math.isnan(r.norm_error)]
    if not outs:
        return None
    ins.sort(reverse=True)
    r_in = sum(ins[:3] if gradient else ins[:2])
    if api in POWER_APIS and not gradient:
        r_in *= max(1.0, _exponent(api, own))
    r_in = max(r_in, routed)
    worst, kappa = max(outs, key=lambda rk: rk[0].norm_error / rk[1])
    if api in LIPSCHITZ_APIS and not gradient:
        r_in = max(r_in, _absolute_input_error(inputs, worst, norm=True))
    if module:
        r_in += u
    res = judge(name, worst.norm_error, r_in, u, th, worst.target.name, dict(worst.metrics, test="scale"),
                statistics=True, condition=kappa, second_order=r_in_drift * r_in_drift, test="Norm")
    if r_in_drift > res.input_error:  # after a first divergence, inputs that carried error explain a node
        # (_blame_first), whichever statistic shows it
        res = replace(res, input_error=r_in_drift)
    return res


def _operand(r: RowResult) -> tuple[float, float, int, list] | None:
    """``(error, bench L2 norm, numel, shape)`` of a matched tensor row with a finite, non-zero bench norm."""
    b = r.bench
    if b is None or not b.is_tensor or math.isnan(r.error) or math.isinf(r.error):
        return None
    norm = _norm(b)
    if not norm or math.isinf(norm) or math.isnan(norm):
        return None
    return (r.error, norm, b.numel, b.dims)


def _gradient_operands(name: str, own: list[RowResult], by_entry: dict[str, list[RowResult]]):
    """The incoming gradients of a backward or parameters_grad node (the backward call's own inputs; the module's
    backward inputs for parameters_grad) and the saved forward operands (the forward twin's inputs)."""
    incoming = [r for r in own if r.target.side == "input"] if ".backward" in name else []
    saved = []
    for twin in _twin_entries(name):
        for r in by_entry.get(twin, []):
            if r.target.side != "input":
                continue
            (incoming if ".backward" in twin else saved).append(r)
    return ([o for o in map(_operand, incoming) if o is not None], [o for o in map(_operand, saved) if o is not None])


def cancellation(out: tuple | None, incoming: list[tuple], saved: list[tuple], scatter: bool = False) -> float:
    """How much a gradient output's relative error may exceed its operands' (>= 1), from L2 norms and shapes.

    A gradient is a sum: a bias or broadcast operand's gradient sums the incoming gradient ``g`` (times the other
    operand ``x``) over the broadcast axes; a weight gradient contracts ``g`` with a saved input over K tokens.
    Rounding errors of the terms add up like a random walk, ``‖δ‖ ≈ r · sqrt(Σ term²)``, whatever the terms add up
    to; where they cancel (a bias feeding a normalization or a softmax sums to zero by symmetry) the result is
    small and its relative error large. Estimated ``sqrt(Σ term²)``: reduction ``‖g‖·rms(x)`` (x: a saved operand
    of g's size, or ones), contraction over K ``‖g‖·‖x‖/√K`` (K a dimension of both, or the product of their
    leading dimensions, which a linear layer's weight gradient flattens; ``K² = numel(g)·numel(x) / numel(out)``).
    The factor is the largest estimate over the output's norm, and 1 for uncorrelated terms.

    Args:
        out: ``(error, bench norm, numel, shape)`` of the output row (None: no estimate, 1).
        incoming: the same tuples for the incoming gradients; saved: for the forward operands.
        scatter: an embedding's weight gradient, a scatter-add: each incoming element lands in one output row,
            so ``sqrt(Σ term²) = ‖g‖`` whatever the sizes.
    """
    if out is None:
        return 1.0
    _, n_out, size_out, dims_out = out
    kappa = 1.0
    free = sorted(d for d in dims_out if d != 1)
    for _, n_g, size_g, dims_g in incoming:
        if scatter:
            kappa = max(kappa, n_g / n_out)
        if _summed_over_broadcast(size_out, free, size_g, dims_g):
            kappa = max(kappa, n_g / n_out)  # x = ones
            for _, n_x, size_x, _ in saved:
                if size_x == size_g:
                    kappa = max(kappa, n_g * n_x / math.sqrt(size_x) / n_out)
        if size_out != size_g:
            for _, n_x, size_x, dims_x in saved:
                k = _contraction(size_g, dims_g, size_x, dims_x, size_out)
                if k:
                    kappa = max(kappa, n_g * n_x / math.sqrt(k) / n_out)
    return kappa


def _contraction(size_g: int, dims_g: tuple, size_x: int, dims_x: tuple, size_out: int) -> int:
    """K when a gradient of ``size_out`` elements contracts ``g`` with a saved ``x`` over K (``K² = numel(g) ·
    numel(x) / numel(out)``, K a dimension of both or their flattened rows), else 0."""
    k2 = size_g * size_x // size_out if size_out else 0
    k = math.isqrt(k2)
    if k >= 2 and k * k == k2 and k2 * size_out == size_g * size_x and _contracted(k, dims_g) \
            and _contracted(k, dims_x):
        return k
    return 0


def contraction_length(out: tuple | None, incoming: list[tuple], saved: list[tuple]) -> int:
    """K of a gradient output that contracts an incoming gradient with a saved operand over K (a weight gradient
    summing K tokens' products; :func:`cancellation`), else 0."""
    if out is None:
        return 0
    size_out, dims_out = out[2], out[3]
    k = 0
    for _, _, size_g, dims_g in incoming:
        if size_out != size_g:
            for _, _, size_x, dims_x in saved:
                k = max(k, _contraction(size_g, dims_g, size_x, dims_x, size_out))
            if not k and len(dims_out) >= 3 and len(dims_g) == len(dims_out) and dims_g[1] == dims_out[0]:
                k = size_g // dims_g[1]  # a convolution's weight gradient sums over the batch and the positions
    return k


def _contracted(k: int, dims: tuple) -> bool:
    """``k`` is a dimension of ``dims`` or the product of all but its last (the rows a linear layer flattens)."""
    if k in dims:
        return True
    lead = 1
    for d in dims[:-1]:
        lead *= d
    return len(dims) > 2 and lead == k


def _sub_multiset(small: list[int], dims: tuple) -> bool:
    pool = [d for d in dims if d != 1]
    for d in small:
        if d not in pool:
            return False
        pool.remove(d)
    return True


# Elementwise APIs with |f'(x)| <= ~1.1: their absolute output error is bounded by the absolute input error, so
# relative error may grow where |x| >> |f(x)| (sin/cos of large angles, as in rotary embeddings).
LIPSCHITZ_APIS = frozenset({"sin", "cos", "tanh", "sigmoid", "silu", "gelu", "relu", "leaky_relu", "elu",
                            "hardtanh", "softsign", "atan", "erf", "clamp", "abs"})


# Piecewise APIs whose backward routes the gradient by a comparison made in the forward (relu's sign, max-pool's
# argmax, clamp's bounds): an input error that moves a value across the decision point moves a whole gradient
# element, not a rounding of it (routing_error).
ROUTING_APIS = frozenset({"relu", "relu6", "hardtanh", "threshold", "clamp", "clip", "max_pool1d", "max_pool2d",
                          "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "max",
                          "min", "amax", "amin", "maximum", "minimum", "abs", "hardswish", "hardsigmoid",
                          "leaky_relu", "prelu", "rrelu", "topk", "sort", "median"})

# APIs whose backward is a scatter-add of the incoming gradient into a weight (cancellation(scatter=True))
SCATTER_APIS = frozenset({"embedding", "embedding_bag", "index_select", "gather"})


def routing_error(r_fwd: float) -> float:
    """The relative L2 error a routing API's gradient may carry when its forward input carried ``r_fwd``.

    Values within ``r_fwd·rms`` of a decision point (a ReLU's 0, a max-pool window's runner-up) may land on the
    other side: a fraction about ``r_fwd`` of the elements, each moving a whole gradient element, so the relative
    L2 error is about ``sqrt(2·r_fwd)`` (the square root of the moved fraction, over the half of the elements that
    carry a gradient). Rounding (relative, sign-keeping) never moves a value across 0 by itself; accumulated error
    does."""
    if math.isnan(r_fwd) or r_fwd <= 0:
        return 0.0
    return math.sqrt(2.0 * r_fwd)


# x**p multiplies a relative error by |p| (its condition number)
POWER_APIS = frozenset({"pow", "__pow__", "square", "float_power"})


def _exponent(api: str, rows: list[RowResult]) -> float:
    if api == "square":
        return 2.0
    for r in rows:
        if r.target.side == "input" and not r.target.is_tensor and r.target.record is not None:
            try:
                return abs(float(r.target.record.get("value")))
            except (TypeError, ValueError):
                continue
    return 1.0


def _api_name(node: str) -> str:
    parts = node.split(".")
    return parts[1] if len(parts) > 2 and parts[0] in ("Tensor", "Torch", "Functional") else ""


def _absolute_input_error(inputs: list[RowResult], out: RowResult, norm: bool = False) -> float:
    """Worst input error expressed relative to the output's scale: ``r_in · ‖in‖ / ‖out‖`` (Norm statistics;
    ``norm``: the inputs' Norm errors instead of their drift errors)."""
    out_norm = _norm(out.bench)
    if not out_norm:
        return 0.0
    worst = 0.0
    for r in inputs:
        n = _norm(r.bench)
        err = r.norm_error if norm else r.error
        if n and not math.isnan(err):
            worst = max(worst, err * n / out_norm)
    return worst


def reduction_length(out: tuple | None, incoming: list[tuple]) -> int:
    """How many incoming-gradient elements a gradient output sums into each of its own: ``numel(g) / numel(out)``
    where the output is ``g`` summed over broadcast axes (a bias's or a normalization weight's gradient: the
    tokens of a batch), else 1 (a contraction: :func:`contraction_length`)."""
    if out is None:
        return 1
    _, _, size_out, dims_out = out
    free = sorted(d for d in dims_out if d != 1)
    k = 1
    for _, _, size_g, dims_g in incoming:
        if _summed_over_broadcast(size_out, free, size_g, dims_g):
            k = max(k, size_g // size_out)
    return k


def _summed_over_broadcast(size_out: int, free: list[int], size_g: int, dims_g: tuple) -> bool:
    """An output of ``size_out`` elements (its dimensions other than 1: ``free``) is ``g`` summed over the axes
    it was broadcast along: smaller, dividing ``g``'s size, its dimensions among ``g``'s."""
    return 0 < size_out < size_g and size_g % size_out == 0 and _sub_multiset(free, dims_g)


def _norm(row: Row | None) -> float:
    if row is None or not row.is_tensor:
        return 0.0
    try:
        return abs(float(row.stats()[3]))
    except (TypeError, ValueError):
        return 0.0


def _judge_md5(name: str, inputs: list[RowResult], outputs: list[RowResult]) -> CompareResult:
    diff_out = [r for r in outputs if r.error > 0]
    if not diff_out:
        return CompareResult(name=name, status="pass", metric="MD5", message=f"{name}: CRC-32 equal")
    worst = diff_out[0]
    if any(r.target.dtype != r.bench.dtype for r in outputs if r.bench is not None):
        return CompareResult(name=name, status="warning", metric="MD5", value=1.0, threshold=0.0,
                             worst_row=worst.target.name,
                             message=f"{name}: CRC-32 differs but the dtypes differ, md5 cannot judge")
    if any(r.error > 0 for r in inputs):
        return CompareResult(name=name, status="pass", metric="MD5", value=1.0, threshold=1.0,
                             worst_row=worst.target.name, message=f"{name}: CRC-32 differs as its inputs do")
    return CompareResult(name=name, status="error", metric="MD5", value=1.0, threshold=0.0, budget=0.0,
                         worst_row=worst.target.name, passing_threshold=1.0,
                         message=f"{name}: CRC-32 of {worst.target.name} differs while every input is identical")
