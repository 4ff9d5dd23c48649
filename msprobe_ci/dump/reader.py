"""Reading dumps written by msprobe-ci or by msprobe itself.

Accepted paths (as ``msprobe compare``): a ``dump.json`` file, a rank folder (``rank``, ``rank{N}``, ``proc*``,
holding dump.json), or a step folder holding exactly one rank folder (several: see :func:`rank_folders`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import MsprobeError
from .validate import validate_dump_json

_RANK_RE = re.compile(r"^(rank\d*|proc\d+)$")


@dataclass
class Dump:
    """One rank folder of one step.

    Attributes:
        folder: the folder holding dump.json.
        task: ``statistics`` / ``tensor`` / ... from dump.json.
        level: ``L0`` / ``L1`` / ``mix``.
        data: the ``data`` mapping, in file (execution) order.
        stack: ``{entry name: [frame strings]}`` (msprobe's grouped format inverted), empty when absent.
        construct: ``{name: parent or None}``, empty when absent.
        framework: ``pytorch`` (default) or ``mindspore``, from dump.json.
        merge_notes: ``{entry name: [note]}`` for a dump merged from TP/PP ranks (:mod:`msprobe_ci.compare.merge`),
            shown as the graph's ``parallel_merge_info``; empty otherwise.
        rejected: ``{entry name: why}``, in file order, for entries left out of ``data`` because they broke the
            dump schema (``load_dump(..., skip_bad_entries=True)``: api-check judges the rest); empty otherwise.
        names: every entry name in file order, rejected ones included, when any was rejected; else empty.
    """

    folder: str
    task: str
    level: str
    data: dict[str, Any]
    stack: dict[str, list[str]] = field(default_factory=dict)
    construct: dict[str, Any] = field(default_factory=dict)
    framework: str = "pytorch"
    merge_notes: dict[str, list[str]] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)

    @property
    def summary_mode(self) -> str:
        """``md5`` when any tensor record carries an ``md5`` field (msprobe's rule), else ``statistics``."""
        for entry in self.data.values():
            if '"md5"' in json.dumps(entry):
                return "md5"
        return "statistics"

    def tensor_path(self, data_name: str) -> str:
        """The file of ``data_name``, confined to ``dump_tensor_data/``.

        Raises:
            MsprobeError: the name escapes the folder.
        """
        base = os.path.realpath(os.path.join(self.folder, "dump_tensor_data"))
        path = os.path.realpath(os.path.join(base, data_name))
        if not path.startswith(base + os.sep):
            raise MsprobeError(f"{self.folder}/dump.json: data_name {data_name!r} points outside dump_tensor_data/")
        return path

    def load_tensor(self, data_name: str, shape: Any = None):
        """Load one saved tensor with ``torch.load(weights_only=True)``.

        Args:
            data_name: the record's ``data_name`` (a file under ``dump_tensor_data/``).
            shape: the record's ``shape``; when given, the file must hold a tensor of exactly that shape.

        Raises:
            MsprobeError: missing file, unreadable file, a file that holds something other than a tensor, or one
                whose shape disagrees with dump.json.
        """
        import torch

        path = self.tensor_path(data_name)
        if not os.path.isfile(path):
            raise MsprobeError(f"{path}: tensor file listed in dump.json is missing")
        if path.endswith(".npy"):  # MindSpore dumps: NumPy arrays, never pickles
            obj = _load_npy(path)
        else:
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # pickle errors, zip errors, weights_only refusals
                raise MsprobeError(f"{path}: not a loadable tensor file ({type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
        if not isinstance(obj, torch.Tensor):
            raise MsprobeError(f"{path}: expected a torch.Tensor, found {type(obj).__name__}")
        if shape is not None and list(shape) == [] and list(obj.shape) == [1] and path.endswith(".npy"):
            obj = obj.reshape(())  # MindSpore saves a 0-d tensor as a one-element array
        if shape is not None and list(obj.shape) != list(shape):
            raise MsprobeError(f"{path}: holds shape {list(obj.shape)}, dump.json says {list(shape)} for "
                               f"{data_name}")
        return obj


def _load_npy(path: str):
    """A MindSpore ``.npy`` tensor file as a torch tensor (``allow_pickle=False``: object arrays are refused)."""
    import numpy as np
    import torch

    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as exc:  # ValueError for pickled object arrays, OSError/format errors for the rest
        raise MsprobeError(f"{path}: not a loadable .npy tensor file ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biufc":
        raise MsprobeError(f"{path}: expected a numeric NumPy array, found dtype {getattr(arr, 'dtype', '?')}")
    return torch.from_numpy(np.ascontiguousarray(arr))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Duplicate(dup)
    return obj


class _Duplicate(ValueError):
    pass


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh, object_pairs_hook=_no_duplicates)
    except FileNotFoundError:
        raise MsprobeError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise MsprobeError(f"{path}: is a folder, expected a JSON file") from None
    except _Duplicate as exc:
        raise MsprobeError(f"{path}: duplicate key {exc.args[0]!r} in one JSON object (the first value would be "
                           "silently dropped)") from None
    except json.JSONDecodeError as exc:
        raise MsprobeError(f"{path}: malformed JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise MsprobeError(f"{path}: JSON nested too deeply to be a dump") from None
    except UnicodeDecodeError:
        raise MsprobeError(f"{path}: not a UTF-8 text file") from None


def rank_folders(path: str) -> list[str]:
    """Rank folders below a step folder, sorted by rank number; ``[path]`` for a rank folder itself."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "dump.json")):
        return [path]
    if not os.path.isdir(path):
        raise MsprobeError(f"{path}: no such dump file or folder")
    subs = [d for d in os.listdir(path) if _RANK_RE.match(d) and os.path.isfile(os.path.join(path, d, "dump.json"))]
    if not subs:
        raise MsprobeError(f"{path}: expected dump.json, or rank/rank<N>/proc<pid> folders holding one")
    subs.sort(key=lambda d: int(re.sub(r"\D", "", d) or -1))
    return [os.path.join(path, d) for d in subs]


def load_dump(path: str | os.PathLike, *, skip_bad_entries: bool = False) -> Dump:
    """Load a dump from a dump.json file, a rank folder, or a step folder with a single rank folder.

    Args:
        path: the dump.json, rank folder or step folder.
        skip_bad_entries: an entry that breaks the dump schema (an unknown dtype, a string where a number
            belongs) is left out of ``data`` and listed in :attr:`Dump.rejected` with its one-line reason, instead
            of rejecting the file (msprobe's api_accuracy_checker skips such an API and checks the rest). The
            header and the JSON itself must still be sound. Default False: any bad entry rejects the file.

    Raises:
        MsprobeError: missing files, malformed JSON, a dump.json without a ``data`` object, a bad header, or (without
            ``skip_bad_entries``) a bad entry.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".json"):
            raise MsprobeError(f"{path}: not a dump; expected a dump.json, a rank folder, a step folder or a dump "
                               "root")
        folder, file = os.path.dirname(path) or ".", path
    else:
        folders = rank_folders(path)
        if len(folders) > 1:
            raise MsprobeError(f"{path}: holds {len(folders)} rank folders; pass one of them")
        folder = folders[0]
        file = os.path.join(folder, "dump.json")
    raw = _read_json(file)
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        raise MsprobeError(f"{file}: expected a JSON object with a 'data' object (an msprobe dump.json)")
    rejected, names = {}, []
    try:
        validate_dump_json(raw, file)
    except MsprobeError:
        if not skip_bad_entries:
            raise
        rejected, names = _bad_entries(raw, file), list(raw["data"])
        raw["data"] = {k: v for k, v in raw["data"].items() if k not in rejected}
    return Dump(folder=folder, task=str(raw.get("task", "statistics")), level=str(raw.get("level", "")),
                data=raw["data"], stack=read_stack(folder), construct=read_construct(folder),
                framework=str(raw.get("framework") or "pytorch").lower(), rejected=rejected, names=names)


def _bad_entries(raw: dict, file: str) -> dict[str, str]:
    """``{name: reason}`` of the entries that fail :func:`validate_dump_json` alone; the header is checked
    first, with no entry (its errors still reject the file)."""
    head = {k: v for k, v in raw.items() if k != "data"}
    validate_dump_json({**head, "data": {}}, file)
    bad = {}
    for name, entry in raw["data"].items():
        try:
            validate_dump_json({**head, "data": {name: entry}}, file)
        except MsprobeError as exc:
            text = str(exc)
            bad[name] = text[len(file) + 2:] if text.startswith(file + ": ") else text
    return bad


def read_construct(folder: str) -> dict[str, Any]:
    """``{name: parent or None}`` from ``folder/construct.json``; empty when there is none.

    Raises:
        MsprobeError: malformed JSON, or not a JSON object.
    """
    construct: dict[str, Any] = {}
    construct_file = os.path.join(folder, "construct.json")
    if os.path.isfile(construct_file):
        construct = _read_json(construct_file) or {}
        if not isinstance(construct, dict):
            raise MsprobeError(f"{construct_file}: expected a JSON object {{name: parent}}")
    return construct


def read_stack(folder: str, canon: Callable[[str], str] | None = None) -> dict[str, list[str]]:
    """``{entry name: [frame strings]}`` from ``folder/stack.json`` (msprobe's grouped format
    ``{"0": [[names], [frames]], ...}`` inverted, or the older flat one); empty when there is none.

    ``canon``: maps a name to the string object to key it by (a graph's own node name, so a 1M-entry stack.json does
    not keep a second copy of every name; grouped format only).

    Raises:
        MsprobeError: malformed JSON, or a group that is not ``[[names], [frames]]``.
    """
    stack: dict[str, list[str]] = {}
    stack_file = os.path.join(folder, "stack.json")
    if os.path.isfile(stack_file):
        raw_stack = _read_json(stack_file)
        if isinstance(raw_stack, dict):
            if "0" in raw_stack:  # grouped: {"0": [[names...], [frames...]], ...}
                for key, group in raw_stack.items():
                    if not (isinstance(group, list) and len(group) == 2 and isinstance(group[0], list)
                            and isinstance(group[1], list)):
                        raise MsprobeError(f"{stack_file}: entry {key!r}: expected [[names], [frames]]")
                    frames = group[1]
                    for n in group[0]:
                        n = str(n)
                        stack[n if canon is None else canon(n)] = frames
            else:
                stack = raw_stack
    return stack


_STEP_RE = re.compile(r"^step(\d+)$")


def _rank_of(folder: str) -> int:
    m = re.match(r"^rank(\d+)$", os.path.basename(os.path.normpath(folder)))
    return int(m.group(1)) if m else 0


def layout(path: str) -> dict[tuple[int, int], str]:
    """``{(step, rank): rank folder}`` for a rank folder, a step folder or a dump root.

    Raises:
        MsprobeError: the path holds no dump in any of the three layouts.
    """
    if not os.path.exists(path):
        raise MsprobeError(f"{path}: no such dump folder")
    if os.path.isfile(path):
        path = os.path.dirname(path) or "."
    if os.path.isfile(os.path.join(path, "dump.json")):
        m = _STEP_RE.match(os.path.basename(os.path.dirname(os.path.abspath(path))))
        return {(int(m.group(1)) if m else 0, _rank_of(path)): path}
    steps = sorted((int(m.group(1)), d) for d in os.listdir(path) if (m := _STEP_RE.match(d))
                   and os.path.isdir(os.path.join(path, d)))
    if steps:
        out = {}
        for step, d in steps:
            for folder in rank_folders(os.path.join(path, d)):
                out[(step, _rank_of(folder))] = folder
        return out
    m = _STEP_RE.match(os.path.basename(os.path.normpath(path)))
    return {(int(m.group(1)) if m else 0, _rank_of(f)): f for f in rank_folders(path)}
