"""Pipeline-parallel merging: the stage dumps of one pipeline into one model's dump, containers and API counters
renumbered, shared modules stitched, entries in the model's execution order (see :mod:`.merge`)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ..dump import names
from ..dump.reader import Dump

_INT = re.compile(r"^\d+$")


def _module_path(name: str) -> tuple[str, str] | None:
    """``(prefix, module path)`` of a module or parameters_grad entry (``Module.layers.0.mlp.MLP.forward.0`` →
    ``("Module", "layers.0.mlp")``)."""
    p = names.parse(name)
    if p is None or p.kind == "api":
        return None
    parts = p.base.split(".")
    if p.kind == "parameters_grad":
        return parts[0], ".".join(parts[1:])
    return parts[0], ".".join(parts[1:-1])  # drop the class name


def _container_indices(names_: list[str]) -> dict[str, set[int]]:
    """``{container path: its outermost integer indices}`` (``layers`` → {0, 1}) of one stage's modules."""
    out: dict[str, set[int]] = {}
    for n in names_:
        mp = _module_path(n)
        if mp is None:
            continue
        parts = mp[1].split(".")
        for i, part in enumerate(parts):
            if _INT.match(part):
                out.setdefault(".".join(parts[:i]), set()).add(int(part))
                break
    return out


def _rename_module(name: str, offsets: dict[str, int]) -> str:
    mp = _module_path(name)
    if mp is None or not offsets:
        return name
    prefix, path = mp
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _INT.match(part):
            off = offsets.get(".".join(parts[:i]), 0)
            if not off:
                return name
            parts[i] = str(int(part) + off)
            new_path = ".".join(parts)
            return f"{prefix}.{new_path}" + name[len(prefix) + 1 + len(path):]
    return name


def _rename_api(name: str, offsets: dict[str, int]) -> str:
    p = names.parse(name, any_prefix=True)
    if p is None or p.kind != "api" or not offsets.get(p.base):
        return name
    return f"{p.base}.{p.call + offsets[p.base]}.{p.direction}"


def _api_counts(names_: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names_:
        p = names.parse(n, any_prefix=True)
        if p is not None and p.kind == "api":
            out[p.base] = max(out.get(p.base, 0), p.call + 1)
    return out


def _backward_start(order: list[str]) -> int:
    for i, n in enumerate(order):
        p = names.parse(n, any_prefix=True)
        if p is not None and (p.direction == "backward" or p.kind == "parameters_grad"):
            return i
    return len(order)


def merge_pp(stages: list[Dump], stage_ranks: list[list[int]]) -> tuple[Dump, list[dict[str, str]]]:
    """Merge the stage dumps of one pipeline (already TP-merged), in stage order; see the module docstring.

    Returns:
        ``(dump, renames)``: the merged dump and, per stage, ``{entry name on the stage: merged name}``.
    """
    if len(stages) == 1:
        return stages[0], [{n: n for n in stages[0].data}]
    indices = [_container_indices(list(s.data) + list(s.construct)) for s in stages]
    module_offsets: list[dict[str, int]] = [{} for _ in stages]
    for cont in {c for ix in indices for c in ix}:
        sets = [ix.get(cont, set()) for ix in indices]
        overlapping = any(sets[i] & sets[j] for i in range(len(sets)) for j in range(i))
        if not overlapping:
            continue  # globally numbered already
        off = 0
        for s, idx in enumerate(sets):
            module_offsets[s][cont] = off
            off += (max(idx) + 1) if idx else 0
    api_offsets: list[dict[str, int]] = []
    running: dict[str, int] = {}
    for s in stages:
        api_offsets.append(dict(running))
        for base, n in _api_counts(list(s.data)).items():
            running[base] = running.get(base, 0) + n

    def rename(s: int, n: str) -> str:
        return _rename_api(_rename_module(n, module_offsets[s]), api_offsets[s])

    renames = [{n: rename(s, n) for n in list(st.data) + list(st.construct)} for s, st in enumerate(stages)]
    # merged order: forward of every stage in order, then backward in reverse stage order
    sequence: list[tuple[int, str]] = []
    splits = [_backward_start(list(st.data)) for st in stages]
    for s, st in enumerate(stages):
        sequence += [(s, n) for n in list(st.data)[:splits[s]]]
    for s in reversed(range(len(stages))):
        sequence += [(s, n) for n in list(stages[s].data)[splits[s]:]]
    inverse = [{v: k for k, v in r.items()} for r in renames]
    occurrences: dict[str, list[int]] = {}
    for s, n in sequence:
        occurrences.setdefault(renames[s][n], []).append(s)
    data: dict[str, Any] = {}
    notes: dict[str, list[str]] = {}
    placed = set()
    for i in reversed(range(len(sequence))):  # a shared entry lands at its last occurrence
        s, n = sequence[i]
        new = renames[s][n]
        if new in placed:
            continue
        placed.add(new)
        owners = occurrences[new]
        if len(owners) == 1:
            data[new] = stages[s].data[n]
            own = getattr(stages[s], "merge_notes", {}).get(n)
            notes[new] = ([f"Pipeline stage {s} (ranks {stage_ranks[s]})" + (f", renamed from {n}" if n != new
                                                                                else "") + "."] + list(own or []))
        else:
            data[new] = _shared_entry(new, [(o, stages[o].data[inverse[o][new]]) for o in owners])
            notes[new] = [f"Present on pipeline stages {owners}: inputs from the stage the data entered, outputs "
                          "from the stage it left."]
    data = dict(reversed(list(data.items())))
    construct: dict[str, Any] = {}
    stack: dict[str, list[str]] = {}
    for s, st in enumerate(stages):
        for child, parent in st.construct.items():
            construct.setdefault(renames[s].get(child, child),
                                 None if parent is None else renames[s].get(parent, rename(s, parent)))
        for k, v in st.stack.items():
            stack.setdefault(renames[s].get(k, rename(s, k)), v)
    merged = replace(stages[0], data=data, construct=construct, stack=stack, merge_notes=notes)
    return merged, renames


def _shared_entry(name: str, owners: list[tuple[int, Any]]) -> Any:
    """A module on several stages: forward inputs from the first stage and outputs from the last; backward
    (gradients flow the other way) inputs from the last and outputs from the first."""
    first, last = owners[0][1], owners[-1][1]
    if not isinstance(first, dict) or not isinstance(last, dict):
        return first
    p = names.parse(name)
    backward = p is not None and p.direction == "backward"
    src_in, src_out = (last, first) if backward else (first, last)
    entry = {k: v for k, v in src_in.items() if k != "output"}
    if "output" in src_out:
        entry["output"] = src_out["output"]
    return entry
