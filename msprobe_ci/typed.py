"""Typed results read from JSON: a frozen dataclass built from a JSON object by its field names, with a one-line
error naming the file (or record) and the field where the object is not what the dataclass holds. Torch-free."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .errors import MsprobeError
from .status import STATUSES


def from_json(cls, d: Any, where: str):
    """``cls`` from a JSON object: its fields by name, the rest kept in ``extra`` where ``cls`` has one.

    Args:
        cls: a dataclass. d: the JSON object. where: what the message names (``path: node``).

    Raises:
        MsprobeError: ``d`` is not an object, lacks a required field or carries an unknown status.
    """
    if not isinstance(d, Mapping):
        raise MsprobeError(f"{where}: expected an object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise MsprobeError(f"{where}: missing field {missing[0]!r}")
    kw = {k: v for k, v in d.items() if k in names and k != "extra"}
    if "extra" in names:
        kw["extra"] = {k: v for k, v in d.items() if k not in names or k == "extra"}
    status = kw.get("status")
    if status is not None and status not in STATUSES:
        raise MsprobeError(f"{where}: status {status!r}, expected one of {', '.join(STATUSES)}")
    return cls(**kw)


#: a number as results write it: JSON has no inf or nan, so those are the strings ``inf``, ``-inf``, ``nan``
NON_FINITE = ("inf", "-inf", "nan")


def is_number(v: Any) -> bool:
    """Whether ``v`` is a result's number: an int or float (not a bool), or one of :data:`NON_FINITE`."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in NON_FINITE
