"""The compare CSV: msprobe's columns, our node verdict in ``Result``/``Err_message``, written at the speed of a
join (:func:`csv_record` writes the bytes :mod:`csv` would; a property test holds them equal).

``report`` is a :class:`~msprobe_ci.compare.report.CompareReport` and ``rr`` one of its
:class:`~msprobe_ci.compare.report.RowResult` rows throughout (read by attribute: this module imports neither, so
the report can write itself through it)."""

from __future__ import annotations

import json
import operator
from typing import Any

from ..dump.writer import timestamped_path
from ..outputs import atomic_write
from . import metrics as M
from .metrics import number_cells
from .verdict import CompareResult


def columns(mode: str) -> list[str]:
    """The compare CSV's columns of a mode (``statistics``, ``tensor``, ``md5``), msprobe's names."""
    head = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
            "NPU Requires_grad", "Bench Requires_grad"]
    stats = ["NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean",
             "Bench l2norm"]
    tail = ["Requires_grad Consistent", "Result", "Err_message", "NPU_Stack_Info"]
    if mode == "md5":
        return head + ["NPU MD5", "BENCH MD5"] + tail
    if mode == "tensor":
        return head + list(M.TENSOR_COLUMNS) + stats + tail + ["Data_name"]
    return head + list(M.STAT_DIFF_COLUMNS) + list(M.STAT_REL_COLUMNS) + stats + tail

def write_csv(report, out_dir: str, prefix: str = "compare_result") -> str:
    """Write ``compare_result_<YYYYmmddHHMMSS>.csv`` with msprobe's columns; returns the path.

    ``Result``/``Err_message`` carry our node verdict (on the node's output rows) instead of msprobe's
    dtype-blind one. Never overwrites: a clash in the same second gets a ``_N`` suffix.
    """
    path = timestamped_path(out_dir, prefix, ".csv")
    verdicts = {n.name: n for n in report.nodes}
    stack_done: set[str] = set()
    with atomic_write(path, "w", newline="", encoding="utf-8") as fh:
        with RowWriter(fh, report) as w:
            for rr in report.rows:
                w.write(rr, verdicts.get(rr.target.entry), stack_done)
    return path

def csv_line(report, rr, node: CompareResult | None, stack_done: set[str]) -> str:
    """The CSV record of one row: ``csv_record(csv_row(report, ...))``, built without a cell-by-cell pass for
    the common row (statistics, both sides tensor records; a test holds the two equal on every row of real
    compares). Its numeric cells (metrics and statistics: numbers, ``None``, or this module's own words such
    as ``N/A`` and ``12.5%``) are joined by ``str`` (``repr`` for a float, as :mod:`csv` writes them) and
    checked for a delimiter or quote before they are trusted; names, dtypes and requires_grad likewise."""
    t, b = rr.target, rr.bench
    if report.mode != "statistics" or b is None or not t.is_tensor or not b.is_tensor:
        return csv_record(csv_row(report, rr, node, stack_done))
    metrics = _stat_cells(rr.metrics)
    if None in metrics:
        return csv_record(csv_row(report, rr, node, stack_done))
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
        return csv_record(csv_row(report, rr, node, stack_done))
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
    stack = stack_cell(report, t.entry, stack_done)  # checked, or quoted, when it was cached
    return f"{t.name},{b.name},{t.dtype},{b.dtype},{ts},{bs},{t.requires_grad},{b.requires_grad},{nums}," \
           f"{tail},{stack}\r\n"

def stack_cell(report, entry: str, stack_done: set[str]) -> str:
    """The NPU_Stack_Info cell of an entry's first row (``N/A`` on the others, and without a stack): the
    stack once per stack.json group, a :class:`_Quoted` cell when it needs quotes."""
    if entry in stack_done:
        return "N/A"
    stack_done.add(entry)
    frames = report.target_stack.get(entry)
    if not frames:
        return "N/A"
    # stack.json groups the entries that share a stack: one cell per group, quoted for the CSV once
    known = report._stack_cells.get(id(frames))
    if known is None or known[0] is not frames:
        cell = str(list(frames))
        known = (frames, _Quoted(_quoted(cell)) if _NEEDS_QUOTES(cell) else cell)
        report._stack_cells[id(frames)] = known
    return known[1]

def csv_row(report, rr, node: CompareResult | None, stack_done: set[str]) -> list[Any]:
    t, b = rr.target, rr.bench
    na = "N/A"
    if b is None:
        row: list[Any] = [t.name, na, t.dtype, na, t.shape, na, t.requires_grad, na]
    else:
        row = [t.name, b.name, t.dtype, b.dtype, t.shape, b.shape, t.requires_grad, b.requires_grad]
    if t.record is None or (b is not None and b.record is None):
        # a null slot's dtype and shape: msprobe writes N/A for PyTorch dumps and None for MindSpore ones
        tn, bn = ("None" if fw == "mindspore" else na for fw in report.frameworks)
        if t.record is None:
            row[2] = row[4] = tn
        if b is not None and b.record is None:
            row[3] = row[5] = bn
    mode = report.mode
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
    row.append(stack_cell(report, t.entry, stack_done))
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

    def __init__(self, fh, report):
        self._fh, self._report = fh, report
        self._buf: list[str] = []
        fh.write(csv_record(report.columns()))

    def write(self, rr, node: CompareResult | None, stack_done: set[str]) -> None:
        """One record; ``stack_done`` holds the entries whose stack was written (msprobe writes it once)."""
        buf = self._buf
        buf.append(csv_line(self._report, rr, node, stack_done))
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
