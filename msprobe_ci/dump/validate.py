"""Validating a dump before anything trusts it: the JSON's nesting depth before a parser runs, every entry against
the dump schema (``data/dump.schema.json``; a fast structural pass first, the schema's validator for the one-line
error), the tensor records' ``data_name`` references."""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

from ..errors import MsprobeError


MAX_NESTING = 1000
"""Deepest JSON nesting a dump file may have (arrays and objects, the top object is level 1): about where
Python's own reader (the in-memory path) gives up; a real dump is under 20 levels deep."""

_NEST_RE = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*:\s*[\[{]\s*$')


def check_nesting(path: str, limit: int = MAX_NESTING, chunk: int = 1 << 22) -> None:
    """Refuse a JSON file nested deeper than ``limit`` before anything parses it: a streaming parser takes time
    and memory quadratic in the depth (100,000 nested arrays: minutes and all the memory there is).

    One pass over the bytes in ``chunk``-sized blocks (numpy, about 25 bytes of memory per byte of a block;
    brackets inside strings do not count).

    Raises:
        MsprobeError: one line naming the file, where the nesting is (``data[<entry>][<field>]``, from the last
            ``"key": [`` or ``"key": {`` opened at levels 3 and 4) and the byte offset.
    """
    import numpy as np

    depth, in_str, offset, pending, tail = 0, False, 0, b"", b""
    keys: dict[int, str] = {}  # level (3: a data entry, 4: its field) -> the key last opened there
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            buf = pending + block
            if not buf:
                return
            pending = b""
            if block and buf.endswith(b"\\"):  # an escape split by the block boundary: decide it with the next
                keep = len(buf) - len(buf.rstrip(b"\\"))
                buf, pending = buf[:-keep], buf[-keep:]
            # escaped backslashes, then escaped quotes, masked (same length, so offsets stay true)
            a = np.frombuffer(buf.replace(b"\\\\", b"__").replace(b'\\"', b"__"), np.uint8)
            quotes = np.cumsum(a == 34, dtype=np.int32)
            outside = (quotes & 1) == int(in_str)
            step = (((a == 91) | (a == 123)) & outside).view(np.int8) - (((a == 93) | (a == 125)) & outside).view(np.int8)
            level = np.cumsum(step, dtype=np.int32)
            level += depth
            over = np.flatnonzero(level > limit)
            end = int(over[0]) if over.size else len(a)
            last = {}
            for lv in (3, 4):
                opened = np.flatnonzero((level[:end] == lv) & (step[:end] == 1))
                if opened.size:
                    last[lv] = int(opened[-1])
                    at = len(tail) + last[lv]  # the key may have begun in the block before
                    found = _NEST_RE.search(tail + buf, max(0, at - 4096), at + 1)
                    keys[lv] = found.group(1).decode("utf-8", "replace") if found else "?"
            if 3 in last and last.get(4, -1) < last[3]:
                keys.pop(4, None)  # a new entry: its field is not the old entry's
            if over.size:
                where = "".join(f"[{keys[lv]!r}]" for lv in (3, 4) if lv in keys)
                raise MsprobeError(f"{path}: JSON nested deeper than {limit} levels"
                                   f"{f' in data{where}' if where else ''} at byte {offset + end}; "
                                   "a dump is a few levels deep")
            if a.size:
                depth, in_str = int(level[-1]), bool(quotes[-1] & 1) != in_str
            offset += len(buf)
            tail = (tail + buf)[-4096:]


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "dump.schema.json"),
              encoding="utf-8") as fh:
        return json.load(fh)


@functools.lru_cache(maxsize=1)
def _validator():
    import fastjsonschema

    return fastjsonschema.compile(_schema())


def _where(name: str, entries: dict) -> str:
    """``data['<entry>'].<field path>`` from fastjsonschema's dotted name (entry names hold dots themselves)."""
    rest = name[len("data."):] if name.startswith("data.") else name
    if not rest.startswith("data."):
        return rest or "top level"
    rest = rest[len("data."):]
    key = max((k for k in entries if rest == k or rest.startswith(k + ".") or rest.startswith(k + "[")),
              key=len, default=None)
    if key is None:
        return f"data.{rest}"
    return f"data[{key!r}]{rest[len(key):]}"


def validate_dump_json(raw: Any, file: str, data_names: bool = True) -> None:
    """Check a parsed dump.json against ``data/dump.schema.json`` (JSON Schema draft-07, compiled once with
    ``fastjsonschema``: about 27 us per GPT-2 entry; a dump the conservative :func:`_surely_valid` accepts, about
    5 us per entry, skips it, and anything else goes through it for its error message) and that every
    ``data_name`` belongs to its own entry (``data_names=False`` skips that walk: for dumps whose files are never
    opened, statistics and md5).

    Raises:
        MsprobeError: one line naming the file, the entry and the field, e.g.
            ``dump.json: data['Functional.linear.0.forward'].input_args[0].Max must be number or boolean or null``.
    """
    import fastjsonschema

    if not _surely_valid(raw):  # else the schema would accept it: the compiled validator costs 5x more
        try:
            _validator()(raw)
        except fastjsonschema.JsonSchemaValueException as exc:
            where = _where(exc.name, raw.get("data") or {})
            msg = exc.message[len(exc.name):].strip() if exc.message.startswith(exc.name) else exc.message
            if msg.startswith("must be one of"):
                msg = "is not a known torch or MindSpore dtype" if where.endswith("dtype") else "is not an allowed value"
            value = repr(exc.value) if isinstance(exc.value, (str, int, float, bool, type(None))) else \
                f"a JSON {type(exc.value).__name__}".replace("dict", "object").replace("list", "array")
            raise MsprobeError(f"{file}: {where}: {value[:60]} {msg[:120]}") from None
        except RecursionError:
            raise MsprobeError(f"{file}: records nested too deeply to be a dump") from None
    if not data_names:
        return
    for name, entry in raw["data"].items():
        for data_name in _data_names(entry):
            if not (data_name == name or data_name.startswith(name + ".")):
                raise MsprobeError(f"{file}: data[{name!r}]: data_name {data_name!r} belongs to another entry "
                                   f"(expected a name starting with {name + '.'!r})")


_TENSOR_TYPES = frozenset(("torch.Tensor", "torch.nn.parameter.Parameter", "mindspore.Tensor", "mindspore.Parameter",
                           "mindspore.common.parameter.Parameter", "mindspore.common.tensor.Tensor"))
_SCALARS = (str, int, float, bool, type(None))
_STAT_TYPES = (int, float, bool, type(None))
_STAT_KEYS = ("Max", "Min", "Mean", "Norm")
_ENTRY_LISTS = ("input_args", "input")
_ENTRY_MAPS = ("input_kwargs", "parameters")
_MAX_FAST_DEPTH = 48


@functools.lru_cache(maxsize=1)
def _dtypes() -> frozenset:
    return frozenset(_schema()["definitions"]["dtype"]["enum"])


def _surely_valid(raw: Any) -> bool:
    """True only when ``data/dump.schema.json`` accepts ``raw`` (a parsed dump.json); False means "not sure": the
    compiled schema decides and words the error. Checks exact JSON types only (``type(x) is int``, never a
    subclass) and gives up past :data:`_MAX_FAST_DEPTH` levels; property-tested against the schema
    (``tests/test_bad_inputs.py``)."""
    if type(raw) is not dict:
        return False
    for key in ("task", "level", "framework"):
        if key in raw and type(raw[key]) is not str:
            return False
    if "dump_data_dir" in raw and type(raw["dump_data_dir"]) not in (str, type(None)):
        return False
    data = raw.get("data")
    if type(data) is not dict:
        return False
    for entry in data.values():
        if not entry_surely_valid(entry):
            return False
    return True


def entry_surely_valid(entry: Any) -> bool:
    """:func:`_surely_valid` for one entry of ``data`` (the header aside): True only when the schema accepts it."""
    if type(entry) is not dict:
        return False
    dtypes = _dtypes()
    for key, v in entry.items():
        if key in _ENTRY_LISTS:
            if type(v) is not list:
                return False
        elif key in _ENTRY_MAPS:
            if type(v) is not dict:
                return False
        elif key == "output":
            if type(v) is dict:
                if "type" in v:
                    return False
            elif type(v) is not list:
                return False
        if not _value_ok(v, dtypes, 0):
            return False
    return True


def _value_ok(v: Any, dtypes: frozenset, depth: int) -> bool:
    t = type(v)
    if t in _SCALARS:
        return True
    if depth > _MAX_FAST_DEPTH:
        return False
    if t is list:
        for x in v:
            if type(x) is dict and type(x.get("type")) is str and x["type"] in _TENSOR_TYPES:
                if not _tensor_ok(x, dtypes):  # the common leaf, without a call to this function
                    return False
            elif not _value_ok(x, dtypes, depth + 1):
                return False
        return True
    if t is not dict:
        return False
    if "type" in v:
        typ = v["type"]
        if type(typ) is str:
            if typ in _TENSOR_TYPES:
                return _tensor_ok(v, dtypes)
            return "value" not in v or _value_ok(v["value"], dtypes, depth + 1)  # other keys are free
    for x in v.values():
        if not _value_ok(x, dtypes, depth + 1):
            return False
    return True


def _tensor_ok(v: dict, dtypes: frozenset) -> bool:
    dtype, shape = v.get("dtype"), v.get("shape")
    if type(dtype) is not str or dtype not in dtypes or type(shape) is not list:
        return False
    for n in shape:
        if type(n) is not int or n < 0:
            return False
    for key in _STAT_KEYS:
        if key in v and type(v[key]) not in _STAT_TYPES:
            return False
    if "requires_grad" in v and type(v["requires_grad"]) not in (bool, type(None), str):
        return False
    if "data_name" in v and (type(v["data_name"]) is not str or not v["data_name"]):
        return False
    return "md5" not in v or type(v["md5"]) is str


def _data_names(value: Any):
    if isinstance(value, dict):
        dn = value.get("data_name")
        if isinstance(dn, str) and "type" in value:
            yield dn
        for v in value.values():
            if isinstance(v, (dict, list)):
                yield from _data_names(v)
    elif isinstance(value, list):
        for v in value:
            yield from _data_names(v)
