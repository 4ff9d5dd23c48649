"""Reading a large dump.json entry by entry, memory bounded: the header's scalars, then ``(name, entry)`` of its
``data`` in file order, each validated as it is read (:func:`iter_entries`). ``orjson`` parses chunks of whole entries
where the layout allows (:func:`_chunked_items`), else ``ijson``'s C backend (yajl2) goes on from the first entry
it did not give: the same values either way. What this path cannot take raises :class:`NotStreamable` (the
in-memory reader, :mod:`msprobe_ci.dump.reader`, then decides)."""

from __future__ import annotations

import bisect
import math
import os
import re
from typing import Any, Generator, Iterator

from ..errors import MsprobeError
from .validate import check_nesting, entry_surely_valid, validate_dump_json


class NotStreamable(Exception):
    """The dump needs the in-memory compare (another framework, header after the data)."""


def read_header(path: str) -> dict:
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
_MARK = b"@msprobe-ci-nonfinite:"
_MARKED = {f"@msprobe-ci-nonfinite:{k}": v for k, v in (("NaN", math.nan), ("Infinity", math.inf),
                                                         ("-Infinity", -math.inf))}


def _mark_nonfinite(body: bytes) -> tuple[bytes | None, list[int]]:
    """``body`` with each bare ``NaN``/``Infinity``/``-Infinity`` value token made a marker string orjson reads, and
    the offsets in ``body`` where there was one; ``(None, [])`` when the text already holds the marker (it could
    not be told apart).

    Only tokens in value position (after ``:``, ``,`` or ``[``, before ``,``, ``]`` or ``}``, whitespace between)
    are marked. Such a sequence inside a JSON string would get the marker's quotes, which end that string and leave
    the marker text bare: invalid JSON, so the chunk goes to the slower readers, never misread. The tokens are
    found by ``bytes.find`` (a regex scanned the text at a quarter of the speed, a third of the streamed parse)."""
    if b"NaN" not in body and b"Infinity" not in body:
        return body, []
    if _MARK in body:
        return None, []
    n = len(body)
    spots: list[tuple[int, int]] = []  # (start, end) of each token in value position
    for token in (b"NaN", b"Infinity"):
        i = body.find(token)
        while i != -1:
            start, end = i, i + len(token)
            if token == b"Infinity" and i and body[i - 1] == 45:  # "-Infinity"
                start -= 1
            j = end
            while j < n and body[j] in b" \t\r\n":
                j += 1
            k = start - 1
            while k >= 0 and body[k] in b" \t\r\n":
                k -= 1
            if j < n and body[j] in b",]}" and k >= 0 and body[k] in b":,[":
                spots.append((start, end))
            i = body.find(token, i + 1)
    if not spots:
        return body, []
    spots.sort()
    parts, last = [], 0
    for start, end in spots:
        parts += (body[last:start], b'"', _MARK, body[start:end], b'"')
        last = end
    parts.append(body[last:])
    return b"".join(parts), [start for start, _ in spots]


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


def scan_names(path: str) -> list[str] | None:
    """dump.json's entry names in file order, read from each entry's first line (``\\n  "<name>":``, the indented
    layout :func:`_chunked_items` reads) without parsing a value: a graph's skeleton needs the names before its
    entries stream, and parsing the file twice cost a tenth of a graph. A claim, not a reading: the streamed reader
    that follows checks every name against it (:class:`NameCheck`). ``None`` where the layout is another or a name
    holds an escape or is not UTF-8 (the caller parses instead). Memory: one block at a time.
    """
    import orjson

    names: list[str] = []
    with open(path, "rb") as fh:
        buf = fh.read(_BLOCK)
        eof = len(buf) < _BLOCK
        first = buf.find(_ENTRY_START)
        if first == -1:
            return None
        try:
            head = orjson.loads(buf[:first] + b"}}")
        except orjson.JSONDecodeError:
            return None
        if not isinstance(head, dict) or list(head)[-1:] != ["data"] or head["data"] != {}:
            return None
        pos = first
        while True:
            i = buf.find(_ENTRY_START, pos)
            q = -1 if i == -1 else buf.find(b'"', i + len(_ENTRY_START))
            if q == -1 or q + 1 >= len(buf):  # the next name may straddle the block's end
                if eof:
                    return names
                keep = i if i != -1 else max(pos, len(buf) - len(_ENTRY_START))
                more = fh.read(_BLOCK)
                eof = len(more) < _BLOCK
                buf, pos = buf[keep:] + more, 0
                continue
            raw = buf[i + len(_ENTRY_START):q]
            if b"\\" in raw or buf[q + 1:q + 2] != b":":
                return None
            try:
                names.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                return None
            pos = q + 1


class NameCheck:
    """Holds a stream of entries to the names :func:`scan_names` claimed, in order: :meth:`see` each name as it
    streams, :meth:`done` after the last.

    Raises:
        NotStreamable: a name that is not the next one claimed, or names left over (the caller's in-memory path
            then reads the file as a whole).
    """

    def __init__(self, path: str, names: list[str]):
        self.path, self.names, self.i = path, names, 0

    def see(self, name: str) -> None:
        if self.i >= len(self.names) or self.names[self.i] != name:
            raise NotStreamable(f"{self.path}: entry {name!r} is not the name its first line gave")
        self.i += 1

    def done(self) -> None:
        if self.i != len(self.names):
            raise NotStreamable(f"{self.path}: {len(self.names) - self.i} entry name(s) seen on first lines but "
                                "not read")


def iter_items(path: str, progress=None) -> Iterator[tuple[str, Any]]:
    """``(name, entry)`` of dump.json's ``data`` in file order: :func:`_chunked_items` while it can, then
    ``ijson`` (its C backend, yajl2) from the first entry it did not give (the same values either way).

    Raises:
        NotStreamable: JSON yajl rejects (``NaN``/``Infinity``, a syntax error: the in-memory reader decides).
        MsprobeError: JSON nested deeper than :data:`~msprobe_ci.dump.validate.MAX_NESTING` levels (checked before
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


def duplicate_key(path: str, name: str) -> MsprobeError:
    """The error of a dump.json whose ``data`` names one entry twice."""
    return MsprobeError(f"{path}: duplicate key {name!r} in one JSON object (the first value would be silently "
                        "dropped)")


def iter_entries(path: str, head: dict, progress=None, *, unique: bool = False) -> Iterator[tuple[str, Any]]:
    """``(name, entry)`` of dump.json's ``data`` in file order, each validated; duplicate names are errors.

    ``unique``: the caller has shown the names to be unique (a :class:`NameCheck` over names without a repeat), so no
    set of every name is kept (at 1M entries, one fresh string and a set slot each: about 110 MB per file).
    """
    seen: set[str] | None = None if unique else set()
    tensors = str(head.get("task", "statistics")) == "tensor"  # data_name opens files only in tensor dumps
    head_checked = False
    for name, entry in iter_items(path, progress):
        if seen is not None:
            if name in seen:
                raise duplicate_key(path, name)
            seen.add(name)
        # the whole check (header included) on the first entry; after it, the schema only where the entry alone
        # is not surely valid (it words the error)
        if tensors or not head_checked or not entry_surely_valid(entry):
            validate_dump_json({**head, "data": {name: entry}}, path, data_names=tensors)
            head_checked = True
        yield name, entry
    if progress is not None:
        progress.update(max(0, os.path.getsize(path) - progress.n))
