"""Writing a dump folder in msprobe's layout: ``dump.json``, ``stack.json``, ``construct.json`` and
``dump_tensor_data/*.pt`` under ``step{N}/rank[R]/`` (``shared/spec/dump-format.md`` §7-12).

Every file is written to a temporary name in the same folder and renamed into place, so a reader never sees a half
written file and a crash leaves the previous version intact.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from ..errors import MsprobeError
from ..outputs import atomic_write, temp_path


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file unique to this process and ``os.replace``."""
    with atomic_write(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def timestamped_path(out_dir: str, prefix: str, suffix: str) -> str:
    """``<out_dir>/<prefix>_<YYYYmmddHHMMSS>[_N]<suffix>``, reserved by an ``O_EXCL`` claim so no other run picks
    it (msprobe's naming; ``_N`` on a clash); the file itself appears only when written whole through
    :func:`msprobe_ci.outputs.atomic_write`; creates ``out_dir`` (:func:`msprobe_ci.outputs.reserve`).

    Raises:
        MsprobeError: ``out_dir`` exists as a file or cannot be created.
    """
    from ..outputs import reserve

    return reserve(out_dir, prefix, suffix)


def atomic_write_json(path: str, obj: Any) -> None:
    """``obj`` as JSON (:func:`json_text`); NaN/Inf are written as the bare literals msprobe uses."""
    atomic_write_text(path, json_text(obj))


def json_text(obj: Any) -> str:
    """``obj`` as JSON, the same value as ``json.dumps(obj, indent=1)`` (msprobe's layout), a mapping with one
    top-level entry per line: entries that hold containers each encoded by the C JSON encoder (the layout of
    :func:`dump_json_text`; ``indent`` forces the pure-Python encoder, which took 39 ms of a 1,000-call step's
    isolation.json, 16 ms so), a flat mapping (construct.json's names) by ``indent=1``, where the pure-Python
    encoder only joins the C encoder's strings and is the faster."""
    if not isinstance(obj, Mapping) or not obj or \
            not any(isinstance(v, (Mapping, list, tuple)) for v in obj.values()):
        return json.dumps(obj, indent=1, ensure_ascii=False)
    enc = json.JSONEncoder(ensure_ascii=False).encode
    # a key that is no string is converted as json.dumps converts it (a one-entry object's text, its value cut)
    return "{\n" + ",\n".join(f" {enc(k) if type(k) is str else enc({k: 0})[1:-4]}: {enc(v)}"
                               for k, v in obj.items()) + "\n}"


def dump_json_text(header: Mapping[str, Any], data: Mapping[str, Any]) -> str:
    """dump.json's text: the header fields, then ``data`` with **one entry per line** (each entry encoded by
    the C JSON encoder; ``indent`` would force the pure-Python one, 5x slower, a quarter of capture's cost).
    Same JSON value as msprobe's; NaN/Inf as the bare literals msprobe writes."""
    enc = json.JSONEncoder(ensure_ascii=False)
    lines = ["{"] + [f" {enc.encode(k)}: {enc.encode(v)}," for k, v in header.items()]
    if not data:
        return "\n".join(lines + [' "data": {}', "}"])
    items = [f"  {enc.encode(k)}: {enc.encode(v)}" for k, v in data.items()]
    return "\n".join(lines + [' "data": {', ",\n".join(items), " }", "}"])


def ensure_fresh_dir(path: str) -> None:
    """Create ``path``; refuse a folder that already holds files (never overwrite a dump silently).

    Raises:
        MsprobeError: ``path`` exists and is non-empty, or exists as a file.
    """
    if os.path.isfile(path):
        raise MsprobeError(f"{path}: dump folder path exists as a file")
    if os.path.isdir(path) and os.listdir(path):
        raise MsprobeError(f"{path}: dump folder already exists and is not empty; choose another dump_path "
                           "or remove it (msprobe-ci never overwrites a dump)")
    os.makedirs(path, exist_ok=True)


def write_dump_folder(folder: str, *, task: str, level: str, data: Mapping[str, Any],
                      stack: Mapping[str, Any], construct: Mapping[str, Any],
                      tensors: Mapping[str, Any] | None = None) -> None:
    """Write one rank folder. ``tensors`` maps file names to CPU tensors saved under ``dump_tensor_data/``."""
    os.makedirs(folder, exist_ok=True)
    data_dir = None
    if tensors:
        import torch

        data_dir = os.path.join(os.path.abspath(folder), "dump_tensor_data")
        os.makedirs(data_dir, exist_ok=True)
        for name, t in tensors.items():
            if os.sep in name or name.startswith("."):
                raise MsprobeError(f"{name}: tensor file name must stay inside dump_tensor_data/")
            target = os.path.join(data_dir, name)
            tmp = temp_path(target)
            torch.save(t, tmp)
            os.replace(tmp, target)
    elif task == "tensor":
        data_dir = os.path.join(os.path.abspath(folder), "dump_tensor_data")
        os.makedirs(data_dir, exist_ok=True)
    atomic_write_text(os.path.join(folder, "dump.json"), dump_json_text(
        {"task": task, "level": level, "framework": "pytorch", "dump_data_dir": data_dir}, data))
    atomic_write_json(os.path.join(folder, "stack.json"), dict(stack))
    atomic_write_json(os.path.join(folder, "construct.json"), dict(construct))
