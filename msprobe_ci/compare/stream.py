"""Streaming compare: two large PyTorch dumps compared entry by entry, memory bounded by what is still unmatched.

``msprobe-ci compare`` on one target/bench pair of PyTorch dumps (no ``-fm``, no mapping files, no msprobe-ci
isolation records) reads both dump.json files incrementally (:func:`_items`: ``orjson`` on chunks of whole entries
where the layout allows, else ``ijson``'s C backend, yajl2), pairs target
and bench entries as they come (dumps of the same model list them in the same execution order; a bench entry not
yet needed waits in a window, and is dropped once matched), judges each node with the same rules as the in-memory
compare (:func:`msprobe_ci.compare.engine.compare_dumps`) and writes its CSV rows at once. Kept for the whole run:
entry names (duplicate detection), per forward entry the relative errors and bench norms of its rows (what its
backward twin and a module's ``parameters_grad`` judge their inputs by: a tuple of floats each, dropped for an API
once its backward call is judged), the target's
stack.json and the counts. Measured by ``benchmarks/scale.py``.

Each entry is validated against the dump schema as it is read (one-line errors naming file, entry and field);
duplicate entry names are caught, duplicate keys *inside* one entry are not (the in-memory reader catches both).
The dump mode (statistics/md5/tensor) is decided from the task and the first tensor record of each side.
Dumps this path does not take raise :class:`NotStreamable` and go to the in-memory compare: MindSpore dumps, a
header after ``data``, and JSON that yajl rejects (``NaN``/``Infinity`` tokens of overflowing runs, or a real
syntax error, which the in-memory reader then reports).
"""

from __future__ import annotations

import bisect
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Generator, Iterator

from ..dump.reader import check_nesting, entry_surely_valid, read_stack, validate_dump_json
from ..errors import MsprobeError
from ..dump.writer import timestamped_path
from ..outputs import atomic_write, release
from . import drift, engine
from .csvout import RowWriter
from .report import CompareReport, RowResult, accumulated
from .rows import _dtype_compatible, backward_key, entry_rows
from .verdict import CompareResult, Thresholds


class NotStreamable(Exception):
    """The dump needs the in-memory compare (another framework, header after the data)."""


@dataclass
class StreamResult:
    """What a streaming compare produced: the CSV, node counts, the first divergence, ``nodes`` judged."""

    csv: str
    mode: str
    counts: dict = field(default_factory=lambda: {s: 0 for s in ("pass", "warning", "error", "unmatched")})
    first_divergence: CompareResult | None = None
    nodes: int = 0


def _header(path: str) -> dict:
    """The top-level scalars before ``data`` (msprobe and msprobe-ci write them first)."""
    import ijson

    head: dict[str, Any] = {}
    key, depth = None, 0
    try:
        with open(path, "rb") as fh:
            # basic_parse: events without prefixes, whose building is quadratic in the nesting depth (a prefix per
            # event, built for a whole buffer at once), before check_nesting had a chance
            for event, value in ijson.basic_parse(fh, use_float=True):
                if event in ("start_map", "start_array"):
                    depth += 1
                elif event in ("end_map", "end_array"):
                    depth -= 1
                    if depth == 0:
                        break
                elif depth == 1 and event == "map_key":
                    key = value
                    if value == "data":
                        return head
                elif depth == 1 and event in ("string", "number", "boolean", "null"):
                    head[key] = value
    except FileNotFoundError:
        raise MsprobeError(f"{path}: file not found") from None
    except ijson.JSONError as exc:
        raise NotStreamable(f"{path}: {str(exc).splitlines()[0][:120]}") from None
    raise NotStreamable(f"{path}: no 'data' after the header")


_ENTRY_START = b'\n  "'  # an entry's first line in msprobe's indent=1 layout and in msprobe-ci's
_DATA_END = re.compile(rb'\s*}\s*}\s*$')  # data's and the document's closing braces
# orjson reads an integer past 64 bits as a float where json and ijson keep (or refuse) it: a chunk holding a
# 19-digit integer token (digits after a space, comma, colon, bracket or minus) goes to ijson instead
_INT_MAP = bytes(ord("0") if chr(c).isdigit() and c < 128 else ord(" ") if chr(c) in " \t\n\r,:[-" else ord("x")
                 for c in range(256))
_LONG_INT = b" " + b"0" * 19
_BLOCK = 1 << 20   # bytes read at a time
_CHUNK = 1 << 16   # entries parsed by one orjson call: about this many bytes


# NaN, Infinity and -Infinity as Python's json (and so msprobe) writes them: bare tokens JSON lacks, which orjson and
# yajl refuse. Every dump of a model with an attention mask holds some (-Infinity minima, NaN means).
_NONFINITE = re.compile(rb"(NaN|-Infinity|Infinity)(?=\s*[,\]}])")  # led by the token: few places to try
_MARK = b"@msprobe-ci-nonfinite:"
_MARKED = {f"@msprobe-ci-nonfinite:{k}": v for k, v in (("NaN", math.nan), ("Infinity", math.inf),
                                                         ("-Infinity", -math.inf))}


def _mark_nonfinite(body: bytes) -> tuple[bytes | None, list[int]]:
    """``body`` with each bare ``NaN``/``Infinity``/``-Infinity`` value token made a marker string orjson reads, and
    the offsets in ``body`` where there was one; ``(None, [])`` when the text already holds the marker (it could
    not be told apart).

    Only tokens in value position (after ``:``, ``,`` or ``[``, before ``,``, ``]`` or ``}``) are marked. Such a
    sequence inside a JSON string would get the marker's quotes, which end that string and leave the marker text
    bare: invalid JSON, so the chunk goes to the slower readers, never misread."""
    if b"NaN" not in body and b"Infinity" not in body:
        return body, []
    if _MARK in body:
        return None, []
    at: list[int] = []

    def mark(m: re.Match) -> bytes:
        j = m.start() - 1
        while j >= 0 and body[j] in b" \t\r\n":
            j -= 1
        if j < 0 or body[j] not in b":,[":  # not in value position: left bare (orjson refuses it)
            return m.group(0)
        at.append(m.start())
        return b'"' + _MARK + m.group(1) + b'"'
    return _NONFINITE.sub(mark, body), at


def _unmark(v: Any) -> Any:
    """A parsed value with :func:`_mark_nonfinite`'s marker strings back as the floats they stand for."""
    t = type(v)
    if t is str:
        return _MARKED.get(v, v)
    if t is dict:
        return {k: _unmark(x) for k, x in v.items()}
    if t is list:
        return [_unmark(x) for x in v]
    return v


def _unmark_entries(items: dict, starts: list[int], at: list[int]) -> dict:
    """``items`` (the entries of one chunk, in file order, the i-th starting at ``starts[i]`` in its text) with the
    markers put back in the entries whose text held one (``at``: the marks' offsets): the others are not walked."""
    hit = {bisect.bisect_right(starts, a) - 1 for a in at}
    if len(hit) == len(items):
        return {k: _unmark(v) for k, v in items.items()}
    return {k: _unmark(v) if i in hit else v for i, (k, v) in enumerate(items.items())}


def _chunked_items(fh, progress=None) -> Generator[tuple[str, Any], None, bool | None]:
    """``(name, entry)`` of ``data``, parsed by ``orjson`` a chunk of whole entries at a time; returns True after
    the last entry, None at the first chunk it cannot vouch for (the caller reads on with ijson).

    Chunks are cut before lines that look like an entry's first line (``\\n  "``: JSON strings cannot hold a
    raw newline, so a newline is whitespace between tokens). A cut is trusted only when it proves itself: the
    text before the first entry, closed with ``}}``, must parse as a header whose last key is ``data`` (empty);
    each chunk, wrapped in ``{}``, must parse as an object with one key per cut inside it, and end in ``,``
    before the next cut (or in data's and the document's closing braces at the end of the file). A chunk that
    starts after a complete member and parses as complete members ends after one, so every cut is at an entry
    boundary. ``NaN``/``Infinity``/``-Infinity`` value tokens are read as Python's json reads them
    (:func:`_mark_nonfinite`). Any other layout (compact JSON, keys after ``data``), duplicate names in a chunk, an
    integer of 19 digits or more, or anything orjson refuses ends this path where it stands."""
    import orjson

    buf = fh.read(_BLOCK)
    eof = len(buf) < _BLOCK
    first = buf.find(_ENTRY_START)
    if first == -1:
        return
    try:
        head = orjson.loads(buf[:first] + b"}}")
    except orjson.JSONDecodeError:
        return
    if not isinstance(head, dict) or list(head)[-1:] != ["data"] or head["data"] != {}:
        return
    pos, offset = first, 0  # pos: the current entry's start in buf; offset: buf's start in the file
    while True:
        cuts = []
        cut = buf.find(_ENTRY_START, pos + 1)  # bytes.find: a fast substring search (a regex scans byte by byte)
        while cut != -1:
            cuts.append(cut)
            if cut - pos >= _CHUNK:
                break
            cut = buf.find(_ENTRY_START, cut + 1)
        if (not cuts or cuts[-1] - pos < _CHUNK) and not eof:
            more = fh.read(_BLOCK)
            eof = len(more) < _BLOCK
            buf, offset, pos = buf[pos:] + more, offset + pos, 0
            continue
        if cuts:
            body = buf[pos:cuts[-1]].rstrip()
            if not body.endswith(b","):
                return
            body, entries = body[:-1], len(cuts)
            starts = [0] + [c - pos for c in cuts[:-1]]  # each entry's offset in body
        else:
            starts = [0]
            tail = _DATA_END.search(buf, pos)
            if tail is None:
                return
            body, entries = buf[pos:tail.start()], 1
        if _LONG_INT in body.translate(_INT_MAP):
            return
        body, marks = _mark_nonfinite(body)
        if body is None:
            return
        try:
            items = orjson.loads(b"{" + body + b"}")
        except orjson.JSONDecodeError:
            return
        if len(items) != entries:
            return
        if marks:
            items = _unmark_entries(items, starts, marks)
        yield from items.items()
        if not cuts:
            return True
        pos = cuts[-1]
        if progress is not None:
            progress.update(offset + pos - progress.n)


def _items(path: str, progress=None) -> Iterator[tuple[str, Any]]:
    """``(name, entry)`` of dump.json's ``data`` in file order: :func:`_chunked_items` while it can, then
    ``ijson`` (its C backend, yajl2) from the first entry it did not give (the same values either way).

    Raises:
        NotStreamable: JSON yajl rejects (``NaN``/``Infinity``, a syntax error: the in-memory reader decides).
        MsprobeError: JSON nested deeper than :data:`~msprobe_ci.dump.reader.MAX_NESTING` levels (checked before
            yajl reads it).
    """
    import ijson

    done = 0
    with open(path, "rb") as fh:
        chunks = _chunked_items(fh, progress)
        while True:
            try:
                item = next(chunks)
            except StopIteration as stop:
                if stop.value:  # read to data's end
                    return
                break
            done += 1
            yield item
        check_nesting(path)  # yajl's prefixes cost time and memory quadratic in the depth: refuse absurd ones first
        fh.seek(0)
        it = ijson.kvitems(fh, "data", use_float=True)
        n = 0
        while True:
            try:
                item = next(it)
            except StopIteration:
                break
            except ijson.JSONError as exc:
                # yajl rejects NaN/Infinity, which Python's json (and msprobe's overflow dumps) use: the in-memory
                # reader takes over and reports real syntax errors itself
                raise NotStreamable(f"{path}: {str(exc).splitlines()[0][:120]}") from None
            except RecursionError:
                raise MsprobeError(f"{path}: JSON nested too deeply to be a dump") from None
            n += 1
            if n > done:
                if progress is not None and n % 2000 == 0:
                    progress.update(fh.tell() - progress.n)
                yield item


def _entries(path: str, head: dict, progress=None) -> Iterator[tuple[str, Any]]:
    """``(name, entry)`` of dump.json's ``data`` in file order, each validated; duplicate names are errors."""
    seen: set[str] = set()
    tensors = str(head.get("task", "statistics")) == "tensor"  # data_name opens files only in tensor dumps
    head_checked = False
    for name, entry in _items(path, progress):
        if name in seen:
            raise MsprobeError(f"{path}: duplicate key {name!r} in one JSON object (the first value would be "
                               "silently dropped)")
        seen.add(name)
        # the whole check (header included) on the first entry; after it, the schema only where the entry alone
        # is not surely valid (it words the error)
        if tensors or not head_checked or not entry_surely_valid(entry):
            validate_dump_json({**head, "data": {name: entry}}, path, data_names=tensors)
            head_checked = True
        yield name, entry
    if progress is not None:
        progress.update(max(0, os.path.getsize(path) - progress.n))


_API_PREFIXES = ("Functional.", "Torch.", "Tensor.", "Aten.", "Distributed.", "NPU.", "VF.", "MindSpeed.")


class _TwinBench:
    """What a twin's row keeps of its bench record: its L2 norm (``stats()[3]``), size and shape."""

    __slots__ = ("norm", "numel", "dims")
    is_tensor = True

    def __init__(self, norm: float, numel: int, dims: list):
        self.norm, self.numel, self.dims = norm, numel, dims

    def stats(self):
        return (None, None, None, self.norm)


class _TwinTarget:
    """What a twin's row keeps of its target record: its side (input/output)."""

    __slots__ = ("side",)

    def __init__(self, side: str):
        self.side = side


def _twin_row(r) -> tuple:
    b = r.bench
    return (r.error, drift.row_norm(b), r.target.side, b.numel, b.dims, r.norm_error)


def _first_tensor_md5(entry: Any) -> bool | None:
    """True/False when the entry holds a tensor record (with/without ``md5``); None when it holds none."""
    if isinstance(entry, dict):
        if "dtype" in entry and "shape" in entry and entry.get("type") in ("torch.Tensor", "mindspore.Tensor",
                                                                          "torch.nn.parameter.Parameter"):
            return "md5" in entry
        vals = entry.values()
    elif isinstance(entry, list):
        vals = entry
    else:
        return None
    for v in vals:
        r = _first_tensor_md5(v)
        if r is not None:
            return r
    return None


def stream_files(target_folder: str, bench_folder: str) -> tuple[list[str], list[dict]]:
    """The two dump.json files and their headers, checked for this path.

    Raises:
        MsprobeError: a missing file.
        NotStreamable: a MindSpore dump, no task before ``data``, or JSON yajl rejects before ``data``.
    """
    files = [f if os.path.isfile(f) else os.path.join(f, "dump.json") for f in (target_folder, bench_folder)]
    heads = [_header(f) for f in files]
    for h, f in zip(heads, files):
        if str(h.get("framework") or "pytorch").lower() != "pytorch":
            raise NotStreamable(f"{f}: framework {h.get('framework')!r}")
        if "task" not in h:
            raise NotStreamable(f"{f}: no task before data")
    return files, heads


class NodeStream:
    """Two PyTorch dumps judged node by node, in the target's dump order, reading each file once.

    ``mode`` (statistics/md5/tensor) and ``report`` (an empty :class:`~msprobe_ci.compare.report.CompareReport`
    holding the mode, thresholds and the target's stack, for CSV rows) are known on construction; iterating yields
    ``(entry name, [RowResult], NodeResult)`` for every target entry, with the drift rule's propagation already
    applied (a later error explained by its inputs' error is a warning ``propagated from`` the first). Callbacks:
    ``on_target(name, entry)`` and ``on_bench(name, entry, rows)`` see every entry as it is read (validated; ``rows``
    its :func:`~msprobe_ci.compare.rows.entry_rows`);
    ``drain_bench`` reads the bench to its end after the target's last entry (so ``on_bench`` sees every bench
    entry, matched or not).

    Raises (on construction or while iterating):
        MsprobeError: bad dumps (one line naming the file and entry) or tasks that cannot be compared.
        NotStreamable: a dump this path does not handle (see the module docstring).
    """

    def __init__(self, files: list[str], heads: list[dict], thresholds: Thresholds | None = None, *, bar=None,
                 on_target=None, on_bench=None, drain_bench: bool = False):
        self.th = thresholds or Thresholds()
        self.files = files
        self._on_target, self._on_bench, self._drain = on_target, on_bench, drain_bench
        t_head, b_head = heads
        self._targets = _entries(files[0], t_head, bar)
        self._benches = _entries(files[1], b_head)
        self._window: dict[str, Any] = {}  # bench entries read ahead, by renumbered name
        self._bench_done = False
        self._b_seen: dict[str, int] = {}
        self._t_seen: dict[str, int] = {}
        first_t = next(self._targets, None)
        if first_t is None:
            raise MsprobeError(f"{files[0]}: no entries in data")
        t_task, b_task = str(t_head.get("task", "statistics")), str(b_head.get("task", "statistics"))
        first_key = backward_key(first_t[0], self._t_seen)
        first_b = self._bench_for(first_key)
        shells = []
        for task, entry in ((t_task, first_t[1]), (b_task, first_b[1] if first_b else None)):
            md5 = _first_tensor_md5(entry) if entry is not None else None
            shells.append(_Shell(task=task, md5=bool(md5)))
        self.mode = engine.compare_mode(*shells)
        self._t_dump, self._b_dump = _Shell(task=t_task, folder=os.path.dirname(files[0])), \
            _Shell(task=b_task, folder=os.path.dirname(files[1]))
        if self.mode == "tensor":
            from ..dump.reader import Dump

            self._t_dump = Dump(folder=os.path.dirname(files[0]), task=t_task, level="", data={})
            self._b_dump = Dump(folder=os.path.dirname(files[1]), task=b_task, level="", data={})
        self.report = CompareReport(mode=self.mode, rows=[], nodes=[],
                                           target_stack=read_stack(os.path.dirname(files[0])), thresholds=self.th)
        self._first = (first_t, first_key, first_b)

    def _bench_for(self, key: str):
        window = self._window
        while key not in window and not self._bench_done:
            try:
                name, entry = next(self._benches)
            except StopIteration:
                self._bench_done = True
                break
            rows = entry_rows(name, entry)
            if self._on_bench is not None:
                self._on_bench(name, entry, rows)
            window[backward_key(name, self._b_seen)] = (name, entry, rows)
        return window.pop(key, None)

    def __iter__(self) -> Iterator[tuple[str, list, Any]]:
        from ..dump.names import parse

        mode, th, t_dump, b_dump = self.mode, self.th, self._t_dump, self._b_dump
        twins: dict[str, tuple] = {}       # forward/module entry -> ((error, bench norm) per row)
        queue: list[list] = []             # [name, own rows, node or None, twin names awaited], in dump order
        head = 0
        first_error: str | None = None
        floor = 0.0                        # the coarsest roundoff seen so far (drift.carried_roundoff)
        reach = math.inf                   # the narrowest range seen so far (drift.carried_range)

        def rows_of(name: str, key: str, entry: Any, bench_item) -> list:
            b_rows = {}
            if bench_item is not None:
                b_name, _, rows = bench_item
                if b_name == key:  # named as the target's key (a forward call): rows need no renaming
                    b_rows = {r.name: r for r in rows}
                else:
                    b_rows = {key + r.name[len(b_name):] if r.name.startswith(b_name) else r.name: r for r in rows}
            own = []
            nonlocal reach
            same = name == key
            for t in entry_rows(name, entry):
                tk = t.name if same else key + t.name[len(name):] if t.name.startswith(name) else t.name
                b = b_rows.get(tk)
                if b is not None and not _dtype_compatible(t, b):
                    b = None
                reach = drift.carried_range(t, b, reach)
                own.append(engine.compare_row(t, b, mode, t_dump, b_dump, reach))
            return own

        def node_of(slot: list) -> None:
            name, own = slot[0], slot[1]
            by_entry = {tw: [RowResult(_TwinTarget(side), _TwinBench(norm, numel, dims), {}, err, nerr)
                             for err, norm, side, numel, dims, nerr in twins[tw]]
                        for tw in drift.twin_entries(name) if tw in twins}
            slot[2] = drift.judge_node(name, own, by_entry, mode, th, slot[4])
            if name.startswith(_API_PREFIXES) and name.endswith(".backward"):
                for tw in by_entry:  # an API's forward twin serves its one backward call only
                    twins.pop(tw, None)

        def add(name: str, key: str, entry: Any, bench_item) -> None:
            if self._on_target is not None:
                self._on_target(name, entry)
            nonlocal floor
            own = rows_of(name, key, entry, bench_item)
            floor = drift.carried_roundoff(own, floor)
            p = parse(name, any_prefix=True)
            awaited = [tw for tw in drift.twin_entries(name) if tw not in twins]
            slot = [name, own, None, awaited, floor]
            queue.append(slot)
            if not awaited:  # a parameters_grad entry precedes its module's backward entry: it waits for it
                node_of(slot)
            if p is not None and (p.direction == "forward" or p.kind == "module"):
                twins[name] = tuple(_twin_row(r) for r in own if r.bench is not None)
                for waiting in queue[head:]:
                    if waiting[2] is None and name in waiting[3]:
                        waiting[3].remove(name)
                        if not waiting[3]:
                            node_of(waiting)

        def ready(final: bool = False) -> Iterator[tuple[str, list, Any]]:
            nonlocal head, first_error
            while head < len(queue):
                slot = queue[head]
                if slot[2] is None:
                    if not final:
                        break
                    node_of(slot)
                name, own, node = slot[0], slot[1], slot[2]
                if node.status == "error" and node.metric == "RelativeErr":
                    if first_error is None:
                        if not accumulated(name):
                            first_error = name
                    elif node.input_error > 0.0 or node.metrics.get("inputs_unseen"):
                        node = replace(node, status="warning", message=f"{name}: propagated from {first_error} "
                                                                        f"({node.message})",
                                       metrics=dict(node.metrics, propagated_from=first_error))
                queue[head] = None
                head += 1
                yield name, own, node
            if head > 1024 and head * 2 > len(queue):
                del queue[:head]
                head = 0

        first_t, first_key, first_b = self._first
        add(first_t[0], first_key, first_t[1], first_b)
        yield from ready()
        for name, entry in self._targets:
            key = backward_key(name, self._t_seen)
            add(name, key, entry, self._bench_for(key))
            yield from ready()
        yield from ready(final=True)
        if self._drain:
            while not self._bench_done:
                self._bench_for("\0")  # a key no entry has: reads every remaining bench entry


def stream_compare(target_folder: str, bench_folder: str, out_dir: str, *, thresholds: Thresholds | None = None,
                   prefix: str = "compare_result", progress: bool | None = None) -> StreamResult:
    """Compare two PyTorch rank folders (or dump.json files) entry by entry and write msprobe's CSV.

    Args:
        target_folder, bench_folder: rank folders holding dump.json (or the dump.json files).
        out_dir: where ``{prefix}_<timestamp>.csv`` goes (never overwritten).
        thresholds: node-rule factors (:mod:`msprobe_ci.compare.verdict`).
        progress: a tqdm bar on stderr; ``None`` (default): only when stderr is a terminal.

    Returns:
        A :class:`StreamResult` (same verdicts as the in-memory compare's drift rule).

    Raises:
        MsprobeError: bad dumps (one line naming the file and entry) or tasks that cannot be compared.
        NotStreamable: a dump this path does not handle (MindSpore, header after data): use the in-memory one.
    """
    files, heads = stream_files(target_folder, bench_folder)
    bar = progress_bar(files[0], "compare", progress)
    path = None
    try:
        nodes = NodeStream(files, heads, thresholds, bar=bar)
        report = nodes.report
        path = timestamped_path(out_dir, prefix, ".csv")
        result = StreamResult(csv=path, mode=nodes.mode)
        with atomic_write(path, "w", newline="", encoding="utf-8") as fh:
            with RowWriter(fh, report) as writer:
                for name, own, node in nodes:
                    result.counts[node.status] += 1
                    result.nodes += 1
                    if node.status == "error" and (result.first_divergence is None or (
                            accumulated(result.first_divergence.name) and not accumulated(name))):
                        result.first_divergence = node  # a computed node before an accumulated gradient
                    done: set[str] = set()
                    for rr in own:
                        writer.write(rr, node, done)
    except BaseException:
        if path is not None:
            release(path)  # the name reserved for this CSV
        raise
    finally:
        if bar is not None:
            bar.close()
    return result


def progress_bar(file: str, desc: str, show: bool | None):
    """A tqdm bar over ``file``'s bytes on stderr, or None (``show`` None: only when stderr is a terminal)."""
    import sys

    if not (sys.stderr.isatty() if show is None else show):
        return None
    from tqdm import tqdm

    return tqdm(total=os.path.getsize(file), unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False)


@dataclass
class _Shell:
    """The few Dump fields the row comparison reads (task, summary mode, folder)."""

    task: str
    md5: bool = False
    folder: str = ""

    @property
    def summary_mode(self) -> str:
        return "md5" if self.md5 else "statistics"


__all__ = ["stream_compare", "StreamResult", "NotStreamable", "NodeStream", "stream_files"]
