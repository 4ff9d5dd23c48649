"""msprobe ``config.json`` schema and validation.

The accepted fields follow msprobe 26.2.0's PyTorch dump configuration (see ``shared/spec/dump-format.md`` §2):

Top level: ``task`` (``statistics`` | ``tensor``; default ``statistics``), ``dump_path`` (str, required unless
given to the constructor), ``rank`` and ``step`` (lists of ints or ``"a-b"`` ranges; default ``[]`` = all),
``level`` (``L0`` | ``L1`` | ``mix``; default ``L1`` as msprobe), ``async_dump`` (bool, default ``False``).

Task section (a key named after the task): ``scope`` (``[]`` or two full names ``[start, end]``), ``list``
(substring filters), ``tensor_list`` (statistics only: substrings of names whose tensors are also saved),
``data_mode`` (subset of ``all, input, output, forward, backward``; default ``["all"]``), ``summary_mode``
(``statistics`` | ``md5``; default ``statistics``).

Every invalid value raises :class:`~msprobe_ci.errors.MsprobeError` with a one-line message naming the field, the
value and what is allowed. Unknown top-level keys that msprobe itself knows (``extra_info``, ``precision``, ...)
are accepted and ignored; any other unknown key is an error, so typos do not pass silently.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Iterable

from .errors import MsprobeError

TASKS = ("statistics", "tensor")
LEVELS = ("L0", "L1", "mix")
SUMMARY_MODES = ("statistics", "md5")
DATA_MODES = ("all", "input", "output", "forward", "backward")
BENCH_KERNELS = ("device", "upcast", "rounded", "decomposed")  # what --msprobe-bench-kernel accepts (msprobe_ci.kernels)


def check_factor(value, where: str = "isolate_budget") -> float | None:
    """``value`` as a cost factor above 1, or ``None`` for none.

    Raises:
        MsprobeError: ``{where}: expected a number above 1 (the isolated step's time over the capture alone), got
            ...``.
    """
    import math

    if value is None or value is False:
        return None
    try:
        factor = float(value)
    except (TypeError, ValueError):
        factor = math.nan
    if isinstance(value, bool) or not math.isfinite(factor) or factor <= 1.0:
        raise MsprobeError(f"{where}: expected a number above 1 (the isolated step's time over the capture alone), "
                           f"got {value!r}")
    return factor


_KNOWN_IGNORED = {"extra_info", "precision", "risk_level", "dump_enable", "custom_op_namespaces", "load",
                  "seed", "is_deterministic", "enable_dataloader", "structure", "acc_check", "diff_check",
                  "nan_check"}
_TOP_KEYS = {"task", "dump_path", "rank", "step", "level", "async_dump"} | set(TASKS) | _KNOWN_IGNORED
_SECTION_KEYS = {"scope", "list", "tensor_list", "data_mode", "summary_mode", "slice", "request_id", "bench_path",
                 "diff_nums"}


@dataclass(frozen=True)
class DumpConfig:
    """A validated dump configuration.

    Attributes:
        task: ``statistics`` (Max/Min/Mean/Norm per tensor) or ``tensor`` (statistics plus ``.pt`` files).
        dump_path: root folder of the dump; ``step{N}/rank[R]/`` folders are created below it.
        level: ``L0`` (modules), ``L1`` (torch APIs) or ``mix`` (both, plus construct.json parents).
        step: steps to dump; empty means every step.
        rank: ranks to dump; empty means every rank.
        async_dump: accepted for compatibility; statistics are always deferred to the flush.
        scope: empty, or ``[start, end]`` full names; both ends inclusive, in execution order.
        list: substrings; a record is kept when its name contains one of them (empty = keep all).
        tensor_list: with task ``statistics``, records whose name contains one of these also save tensors.
        data_mode: subset of ``all, input, output, forward, backward``.
        summary_mode: ``statistics`` or ``md5`` (CRC-32 of the raw bytes, written as 8 hex digits).
    """

    task: str = "statistics"
    dump_path: str = "./dump_path"
    level: str = "L1"
    step: tuple[int, ...] = ()
    rank: tuple[int, ...] = ()
    async_dump: bool = False
    scope: tuple[str, ...] = ()
    list: tuple[str, ...] = ()
    tensor_list: tuple[str, ...] = ()
    data_mode: tuple[str, ...] = ("all",)
    summary_mode: str = "statistics"

    def with_overrides(self, **kwargs: Any) -> "DumpConfig":
        """Return a validated copy with the non-``None`` keyword arguments replaced."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if "step" in kwargs:
            kwargs["step"] = parse_int_ranges(kwargs["step"], "step")
        if "rank" in kwargs:
            kwargs["rank"] = parse_int_ranges(kwargs["rank"], "rank")
        cfg = replace(self, **kwargs)
        cfg.validate()
        return cfg

    # -- derived flags ---------------------------------------------------------------------------------------
    @property
    def allowed_modes(self) -> frozenset[str]:
        """The msprobe data_mode expansion: directions and sides that are recorded."""
        modes = set(self.data_mode)
        if "all" in modes:
            return frozenset({"forward", "backward", "input", "output"})
        if not modes & {"forward", "backward"}:
            modes |= {"forward", "backward"}
        if not modes & {"input", "output"}:
            modes |= {"input", "output"}
        return frozenset(modes)

    def validate(self) -> None:
        """Raise :class:`MsprobeError` when a field holds a value msprobe would reject."""
        _choice("task", self.task, TASKS)
        _choice("level", self.level, LEVELS)
        _choice("summary_mode", self.summary_mode, SUMMARY_MODES)
        if not isinstance(self.dump_path, (str, os.PathLike)) or not str(self.dump_path):
            raise MsprobeError(f"config field 'dump_path': expected a non-empty path string, got {self.dump_path!r}")
        if not isinstance(self.async_dump, bool):
            raise MsprobeError(f"config field 'async_dump': expected true or false, got {self.async_dump!r}")
        for name in ("scope", "list", "tensor_list"):
            value = getattr(self, name)
            if not all(isinstance(v, str) for v in value):
                raise MsprobeError(f"config field '{name}': expected a list of strings, got {list(value)!r}")
        if self.scope and len(self.scope) != 2:
            raise MsprobeError(f"config field 'scope': expected [] or two full names [start, end], got {list(self.scope)!r}")
        modes = self.data_mode
        if not modes or not all(m in DATA_MODES for m in modes):
            raise MsprobeError(f"config field 'data_mode': expected a list from {list(DATA_MODES)}, got {list(modes)!r}")
        if "all" in modes and len(modes) > 1:
            raise MsprobeError(f"config field 'data_mode': 'all' cannot be combined with other modes, got {list(modes)!r}")
        if len(modes) > 4:
            raise MsprobeError(f"config field 'data_mode': at most 4 modes, got {list(modes)!r}")


def _choice(field_name: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise MsprobeError(f"config field '{field_name}': expected one of {', '.join(allowed)}, got {value!r}")


def parse_int_ranges(value: Any, field_name: str) -> tuple[int, ...]:
    """Parse msprobe's ``step``/``rank`` form: a list of ints and ``"a-b"`` strings.

    Args:
        value: the raw JSON value, e.g. ``[0, "2-4"]``; an int is accepted as a one-element list.
        field_name: used in the error message.

    Returns:
        Sorted, de-duplicated ints; ``()`` means "all".

    Raises:
        MsprobeError: for a non-list, a float, a negative number, or a malformed or reversed range.
    """
    if isinstance(value, bool):
        raise MsprobeError(f"config field '{field_name}': expected a list of ints or 'a-b' ranges, got {value!r}")
    if isinstance(value, int):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise MsprobeError(f"config field '{field_name}': expected a list of ints or 'a-b' ranges, got {value!r}")
    out: set[int] = set()
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise MsprobeError(f"config field '{field_name}': element {item!r} is not an int or an 'a-b' string")
        if isinstance(item, int):
            if not 0 <= item <= 1_000_000:
                raise MsprobeError(f"config field '{field_name}': element {item!r} is outside 0..1000000")
            out.add(item)
            continue
        parts = item.split("-")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise MsprobeError(f"config field '{field_name}': element {item!r} is not an int or an 'a-b' range") from None
        if len(nums) == 1:
            lo = hi = nums[0]
        elif len(nums) == 2:
            lo, hi = nums
        else:
            raise MsprobeError(f"config field '{field_name}': element {item!r} is not an int or an 'a-b' range")
        if lo < 0 or hi < lo:
            raise MsprobeError(f"config field '{field_name}': range {item!r} must satisfy 0 <= a <= b")
        out.update(range(lo, hi + 1))
    return tuple(sorted(out))


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> DumpConfig:
    """Load and validate an msprobe ``config.json``.

    Args:
        path: the JSON file; ``None`` starts from the defaults.
        **overrides: ``task``, ``dump_path``, ``level``, ``step`` ... (``None`` values are ignored), as the
            ``PrecisionDebugger`` constructor arguments override the file.

    Returns:
        The validated :class:`DumpConfig`.

    Raises:
        MsprobeError: the file is missing, not JSON, not an object, or a field is invalid.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = os.fspath(path)
        if not p.endswith(".json"):
            raise MsprobeError(f"{p}: expected a .json config file")
        try:
            with open(p, encoding="utf-8") as fh:
                raw = json.load(fh)
        except FileNotFoundError:
            raise MsprobeError(f"{p}: config file not found") from None
        except json.JSONDecodeError as exc:
            raise MsprobeError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
        if not isinstance(raw, dict):
            raise MsprobeError(f"{p}: expected a JSON object at the top level")
        unknown = sorted(set(raw) - _TOP_KEYS)
        if unknown:
            raise MsprobeError(f"{p}: unknown config field(s) {unknown}; allowed: {sorted(_TOP_KEYS)}")
    task = overrides.get("task") or raw.get("task", "statistics")
    _choice("task", task, TASKS)
    section = raw.get(task, {}) or {}
    if not isinstance(section, dict):
        raise MsprobeError(f"config field '{task}': expected an object with scope/list/data_mode/summary_mode")
    unknown = sorted(set(section) - _SECTION_KEYS)
    if unknown:
        raise MsprobeError(f"config section '{task}': unknown field(s) {unknown}; allowed: {sorted(_SECTION_KEYS)}")

    def _strs(name: str) -> tuple[str, ...]:
        value = section.get(name, [])
        if not isinstance(value, list):
            raise MsprobeError(f"config field '{task}.{name}': expected a list of strings, got {value!r}")
        return tuple(value)

    data_mode = section.get("data_mode", ["all"])
    if not isinstance(data_mode, list):
        raise MsprobeError(f"config field '{task}.data_mode': expected a list from {list(DATA_MODES)}, got {data_mode!r}")
    cfg = DumpConfig(
        task=task,
        dump_path=raw.get("dump_path", "./dump_path") if overrides.get("dump_path") is None else overrides["dump_path"],
        level=raw.get("level", "L1"),
        step=parse_int_ranges(raw.get("step", []), "step"),
        rank=parse_int_ranges(raw.get("rank", []), "rank"),
        async_dump=raw.get("async_dump", False),
        scope=_strs("scope"),
        list=_strs("list"),
        tensor_list=_strs("tensor_list") if task == "statistics" else (),
        data_mode=tuple(data_mode),
        summary_mode=section.get("summary_mode", "statistics"),
    )
    if path is not None and "dump_path" not in raw and overrides.get("dump_path") is None:
        raise MsprobeError(f"{os.fspath(path)}: config field 'dump_path' is required")
    cfg.validate()
    rest = {k: v for k, v in overrides.items() if k in ("level", "step", "dump_path") and v is not None}
    return cfg.with_overrides(**rest) if rest else cfg


__all__ = ["DumpConfig", "load_config", "parse_int_ranges", "TASKS", "LEVELS", "SUMMARY_MODES", "DATA_MODES"]
