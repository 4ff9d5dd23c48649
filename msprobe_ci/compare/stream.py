"""Streaming compare: two large PyTorch dumps compared entry by entry, memory bounded by what is still unmatched.

``msprobe-ci compare`` on one target/bench pair of PyTorch dumps (no ``-fm``, no mapping files, no msprobe-ci
isolation records) reads both dump.json files incrementally (:mod:`msprobe_ci.dump.scan`: ``orjson`` on chunks of
whole entries where the layout allows, else ``ijson``'s C backend, yajl2), pairs target and bench entries as they
come (dumps of the same model list them in the same execution order; a bench entry not yet needed waits in a window,
and is dropped once matched), judges each node with the same rules as the in-memory compare
(:func:`msprobe_ci.compare.engine.compare_dumps`) and writes its CSV rows at once. Kept for the whole run: entry
names (duplicate detection; not where the caller has shown them unique, as the streamed graph does), per forward
entry the relative errors, bench norms and shapes of its matched rows (what its backward twin and a module's
``parameters_grad`` judge their inputs by: packed doubles and shared shape tuples, :func:`_twin`, dropped for an
API once its backward call is judged), the target's stack.json and the counts. Measured by ``benchmarks/scale.py``.

Each entry is validated against the dump schema as it is read (one-line errors naming file, entry and field);
duplicate entry names are caught, duplicate keys *inside* one entry are not (the in-memory reader catches both).
The dump mode (statistics/md5/tensor) is decided from the task and the first tensor record of each side.
Dumps this path does not take raise :class:`NotStreamable` and go to the in-memory compare: MindSpore dumps, a
header after ``data``, and JSON that yajl rejects (``NaN``/``Infinity`` tokens of overflowing runs, or a real
syntax error, which the in-memory reader then reports).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from ..dump.reader import read_stack
from ..dump.scan import NotStreamable, iter_entries, read_header
from ..errors import MsprobeError
from ..dump.writer import timestamped_path
from ..outputs import atomic_write, release
from . import drift, engine
from .csvout import RowWriter
from .report import CompareReport, RowResult, accumulated
from .rows import _dtype_compatible, backward_key, entry_rows
from .verdict import CompareResult, Thresholds


@dataclass
class StreamResult:
    """What a streaming compare produced: the CSV, node counts, the first divergence, ``nodes`` judged."""

    csv: str
    mode: str
    counts: dict = field(default_factory=lambda: {s: 0 for s in ("pass", "warning", "error", "unmatched")})
    first_divergence: CompareResult | None = None
    nodes: int = 0


_API_PREFIXES = ("Functional.", "Torch.", "Tensor.", "Aten.", "Distributed.", "NPU.", "VF.", "MindSpeed.")


class _TwinBench:
    """What a twin's row keeps of its bench record: its L2 norm (``stats()[3]``) and shape (its size follows)."""

    __slots__ = ("norm", "numel", "dims")
    is_tensor = True

    def __init__(self, norm: float, dims: tuple):
        self.norm, self.dims = norm, dims
        self.numel = math.prod(dims) if dims else 1  # a record's numel (rows.Row.numel), from its shape

    def stats(self):
        return (None, None, None, self.norm)


class _TwinTarget:
    """What a twin's row keeps of its target record: its side (input/output)."""

    __slots__ = ("side",)

    def __init__(self, side: str):
        self.side = side


def _twin(own: list, shapes: dict[tuple, tuple]) -> tuple:
    """What a forward entry keeps of its matched rows until its twins are judged, as compactly as Python holds it:
    ``(packed, side, shape, side, shape, ...)``, ``packed`` each row's error, bench norm (``stats()[3]``) and norm
    error as doubles (exact: they are Python floats), each shape one tuple shared by every row of that shape
    (``shapes``) rather than the bench record's list. The forward twins held until their backward calls were a
    quarter of a streamed graph's memory before (100k entries: 38 of 145 MB traced)."""
    numbers: list[float] = []
    refs: list = []
    for r in own:
        b = r.bench
        if b is None:
            continue
        dims = tuple(b.dims)
        numbers += (r.error, drift.row_norm(b), r.norm_error)
        refs += (r.target.side, shapes.setdefault(dims, dims))
    return (struct.pack(f"{len(numbers)}d", *numbers), *refs)


def _twin_rows(twin: tuple) -> list[RowResult]:
    """The rows :func:`_twin` kept, as the judge reads them."""
    numbers = struct.unpack(f"{len(twin[0]) // 8}d", twin[0])
    return [RowResult(_TwinTarget(twin[1 + 2 * i]), _TwinBench(numbers[3 * i + 1], twin[2 + 2 * i]), {},
                      numbers[3 * i], numbers[3 * i + 2]) for i in range(len(numbers) // 3)]


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
    heads = [read_header(f) for f in files]
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
    entry, matched or not); ``unique`` (target, bench): the caller has shown that side's entry names unique
    (:func:`~msprobe_ci.dump.scan.iter_entries`); ``target_stack``: the target's stack.json as read by the caller.

    Raises (on construction or while iterating):
        MsprobeError: bad dumps (one line naming the file and entry) or tasks that cannot be compared.
        NotStreamable: a dump this path does not handle (see the module docstring).
    """

    def __init__(self, files: list[str], heads: list[dict], thresholds: Thresholds | None = None, *, bar=None,
                 on_target=None, on_bench=None, drain_bench: bool = False, unique: tuple[bool, bool] = (False, False),
                 target_stack: dict | None = None):
        self.th = thresholds or Thresholds()
        self.files = files
        self._on_target, self._on_bench, self._drain = on_target, on_bench, drain_bench
        t_head, b_head = heads
        self._targets = iter_entries(files[0], t_head, bar, unique=unique[0])
        self._benches = iter_entries(files[1], b_head, unique=unique[1])
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
                                    target_stack=read_stack(os.path.dirname(files[0])) if target_stack is None
                                    else target_stack, thresholds=self.th)
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
        twins: dict[str, tuple] = {}       # forward/module entry -> its matched rows (_twin)
        shapes: dict[tuple, tuple] = {}    # one tuple per distinct shape, shared by the twins' rows
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
            by_entry = {tw: _twin_rows(twins[tw]) for tw in drift.twin_entries(name) if tw in twins}
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
                twins[name] = _twin(own, shapes)
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
