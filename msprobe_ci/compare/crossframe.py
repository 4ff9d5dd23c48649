"""Cross-framework matching: a MindSpore dump against a PyTorch dump (either side), with no mapping file needed
for standard layers.

The MindSpore side's names are translated into PyTorch compare keys, then rows join on those keys as in a
same-framework compare (``rows.match_rows``):

* **Cells pair with Modules by their path** in the model (``Cell.fc1.Dense.forward.0`` ↔
  ``Module.fc1.Linear.forward.0``): path, direction and call index; class names may differ.
* **APIs** translate through ``msprobe_ci/dump/data/mindspore_to_pytorch.yaml`` (data, not code): ``Tensor.*`` keeps its name,
  ``Mint.*``/``MintFunctional.*`` become ``Torch.*``/``Functional.*``, primitives such as
  ``Primitive.dense.Dense`` become their PyTorch API (``Functional.linear``), with the argument positions and
  forward outputs the table gives (``layer_norm``: MindSpore (x, gamma, beta) ↔ PyTorch (x, normalized_shape,
  weight, bias)).
* **Parameters** rename (``gamma``/``beta`` ↔ ``weight``/``bias``) in ``parameters`` and ``parameters_grad`` rows.
* **Backward outputs** of a translated API pair by shape, a transposed 2-D gradient with its transpose (PyTorch's
  linear hands back dWᵀ), ties broken in order: MindSpore lists a primitive's gradients last input first.
* msprobe's own mapping files are accepted on top (``-dm`` data mapping ``{MindSpore row: PyTorch compare key}``
  wins over everything; ``-lm`` layer mapping ``{class: {MindSpore child: PyTorch child}}`` renames path parts;
  ``-cm`` cell mapping ``{Cell name part: Module name part}``; ``-am`` API mapping ``{MindSpore API: PyTorch
  API}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..dump import names
from ..dump.frameworks import table, torch_api
from ..errors import MsprobeError

def _fused_renames() -> dict[str, tuple[str, dict[str, str], dict[str, str], bool]]:
    """``{MindSpore API: (PyTorch API, forward renames, backward renames, last call of its group)}``."""
    out = {}
    for group in table()["fused"]:
        calls = list(group["calls"])
        for k, api in enumerate(calls):
            fwd: dict[str, str] = {}
            for i, (ck, j) in enumerate(group.get("inputs") or []):
                if ck == k:
                    fwd[f".input.{j}"] = f".input.{i}"
            for i, (ck, j) in enumerate(group.get("outputs") or []):
                if ck == k:
                    fwd[f".output.{j}"] = f".output.{i}"
            for j in range(8):  # everything else of this call is intermediate: never paired
                fwd.setdefault(f".input.{j}", f".input.intermediate{k}_{j}")
                fwd.setdefault(f".output.{j}", f".output.intermediate{k}_{j}")
            last = k == len(calls) - 1
            bwd = {} if last else {f".input.{j}": f".input.intermediate{k}_{j}" for j in range(8)}
            out[api] = (str(group["torch"]), fwd, bwd, last)
    return out


@dataclass
class Mappings:
    """msprobe's optional mapping files, loaded (all default to empty)."""

    data: dict[str, str] = field(default_factory=dict)    # -dm: MindSpore row -> PyTorch compare key
    layer: dict[str, str] = field(default_factory=dict)   # -lm, flattened: MindSpore child -> PyTorch child
    cell: dict[str, str] = field(default_factory=dict)    # -cm: Cell name part -> Module name part
    api: dict[str, str] = field(default_factory=dict)     # -am: MindSpore API -> PyTorch API

    @classmethod
    def load(cls, data: str | None = None, layer: str | None = None, cell: str | None = None,
             api: str | None = None) -> "Mappings":
        """Read the given YAML files (``yaml.safe_load``).

        Raises:
            MsprobeError: a file that is missing, not YAML, or not a mapping.
        """
        def read(path: str | None, flag: str) -> dict:
            if not path:
                return {}
            import yaml

            try:
                with open(path, encoding="utf-8") as fh:
                    doc = yaml.safe_load(fh)
            except OSError as exc:
                raise MsprobeError(f"{path}: {flag} mapping file cannot be read ({exc.strerror})") from None
            except yaml.YAMLError as exc:
                raise MsprobeError(f"{path}: {flag} mapping file is not YAML ({str(exc).splitlines()[0]})") from None
            if doc is None:
                return {}
            if not isinstance(doc, dict):
                raise MsprobeError(f"{path}: {flag} mapping file: expected a mapping, got {type(doc).__name__}")
            return doc

        layers: dict[str, str] = {}
        for cls_name, children in read(layer, "-lm").items():
            if not isinstance(children, dict):
                raise MsprobeError(f"{layer}: -lm entry {cls_name!r}: expected {{MindSpore child: PyTorch child}}")
            layers.update({str(k): str(v) for k, v in children.items()})
        return cls(data={str(k): str(v) for k, v in read(data, "-dm").items()}, layer=layers,
                   cell={str(k): str(v) for k, v in read(cell, "-cm").items()},
                   api={str(k): str(v) for k, v in read(api, "-am").items()})


def _module_path(base: str, mappings: Mappings) -> str:
    """``fc1`` of ``Cell.fc1.Dense`` / ``Module.fc1.Linear`` (child renames of -lm / -cm applied)."""
    parts = base.split(".")[1:-1]
    return ".".join(mappings.cell.get(p, mappings.layer.get(p, p)) for p in parts)


@dataclass
class Translation:
    """The target side's entries as PyTorch compare keys.

    Attributes:
        entries: ``{target entry: bench entry name}`` for entries with a counterpart.
        rows: ``{target entry: {row suffix: bench row suffix}}`` argument and parameter renames.
        by_shape: target backward entries whose outputs pair with the bench's by shape.
        last_first: those of them that list gradients last input first (MindSpore primitives).
    """

    entries: dict[str, str] = field(default_factory=dict)
    rows: dict[str, dict[str, str]] = field(default_factory=dict)
    by_shape: set[str] = field(default_factory=set)
    last_first: set[str] = field(default_factory=set)


def layer_translation(target: dict[str, Any], bench: dict[str, Any], mappings: Mappings) -> Translation:
    """Same framework, different suites (``-lm``/``-cm`` on two PyTorch dumps): the target's Module and
    parameters_grad entries paired with the bench's by their module path after the mapping's child renames
    (``mlp.dense_h_to_4h`` ↔ ``mlp.fc1``), direction and call index, class names free to differ; APIs keep their
    names."""
    modules: dict[tuple, str] = {}
    for k in bench:
        p = names.parse(k, any_prefix=True)
        if p is not None and p.kind in ("module", "parameters_grad"):
            modules[(_module_path(p.base, Mappings()), p.kind, p.direction, p.call)] = k
    out = Translation()
    for k in target:
        p = names.parse(k, any_prefix=True)
        if p is not None and p.kind in ("module", "parameters_grad"):
            hit = modules.get((_module_path(p.base, mappings), p.kind, p.direction, p.call))
            if hit is not None and hit != k:
                out.entries[k] = hit
    return out


def translate(target: dict[str, Any], bench: dict[str, Any], mappings: Mappings | None = None,
              target_is_mindspore: bool = True) -> Translation:
    """Translate the MindSpore side's entry names into the PyTorch side's.

    Args:
        target, bench: the two dumps' ``data`` mappings.
        mappings: msprobe's mapping files.
        target_is_mindspore: which side is MindSpore (the other is PyTorch).
    """
    m = mappings or Mappings()
    ms, pt = (target, bench) if target_is_mindspore else (bench, target)
    modules: dict[tuple, str] = {}
    for k in pt:
        p = names.parse(k, any_prefix=True)
        if p is not None and p.kind in ("module", "parameters_grad"):
            modules[(_module_path(p.base, Mappings()), p.kind, p.direction, p.call)] = k
    params = table()["parameters"]
    out = Translation()
    for k in ms:
        p = names.parse(k, any_prefix=True)
        if p is None:
            continue
        if p.kind in ("module", "parameters_grad"):
            hit = modules.get((_module_path(p.base, m), p.kind, p.direction, p.call))
            if hit is not None:
                out.entries[k] = hit
                entry = ms[k] if isinstance(ms[k], dict) else {}
                own = entry if p.kind == "parameters_grad" else entry.get("parameters") or {}
                stem = "." if p.kind == "parameters_grad" else ".parameters."
                # only the parameters this Cell has (a Linear's weight stays weight; a LayerNorm's gamma -> weight)
                out.rows[k] = {f"{stem}{a}": f"{stem}{params[a]}" for a in own if a in params}
            continue
        if p.kind != "api":
            continue
        fused = _fused_renames().get(f"{p.prefix}.{p.api}")
        if fused is not None and f"{p.prefix}.{p.api}" not in m.api:
            base, fwd, bwd, _ = fused
            out.entries[k] = f"{base}.{p.call}.{p.direction}"
            out.rows[k] = fwd if p.direction == "forward" else bwd
            if p.direction == "backward":
                out.by_shape.add(k)
                out.last_first.add(k)
            continue
        base, row = torch_api(p.prefix, p.api, m.api)
        if base is None:
            continue
        out.entries[k] = f"{base}.{p.call}.{p.direction}"
        renames: dict[str, str] = {}
        if p.direction == "forward":
            for i, j in enumerate(row.get("inputs") or []):
                renames[f".input.{i}"] = f".input.{j}"
            outs = row.get("outputs")
            if outs is not None:
                for i in range(8):
                    renames[f".output.{i}"] = f".output.{outs[i]}" if i < len(outs) else f".output.unmatched{i}"
        elif row:  # a different API on the other side: its gradients pair by shape
            out.by_shape.add(k)
            if p.prefix == "Primitive":
                out.last_first.add(k)
        out.rows[k] = renames
    if not target_is_mindspore:  # the caller joins target rows to bench rows: invert to PyTorch -> MindSpore
        inv = Translation()
        for ms_entry, pt_entry in out.entries.items():
            inv.entries[pt_entry] = ms_entry
            inv.rows[pt_entry] = {b: a for a, b in out.rows.get(ms_entry, {}).items()}
            if ms_entry in out.by_shape:
                inv.by_shape.add(pt_entry)
            if ms_entry in out.last_first:
                inv.last_first.add(pt_entry)
        return inv
    return out


def rename_row(name: str, entry: str, renames: dict[str, str]) -> str:
    """Apply an entry's row-suffix renames (longest prefix wins) to a row name."""
    rest = name[len(entry):]
    for a in sorted(renames, key=len, reverse=True):
        if rest == a or rest.startswith(a + "."):
            return renames[a] + rest[len(a):]
    return rest


def pair_by_shape(t_rows: list, b_rows: list, last_first: bool) -> list[tuple[Any, Any]]:
    """Pair backward output rows by shape: equal shapes first (ties in order, the MindSpore side reversed when it
    lists a primitive's gradients last input first), then 2-D transposes."""
    def shape(r) -> tuple:
        rec = r.record
        return tuple(rec.get("shape") or ()) if isinstance(rec, dict) and "shape" in rec else ()

    t_list = [r for r in t_rows if r.record is not None]
    t_list = t_list[::-1] if last_first else t_list
    free = [r for r in b_rows if r.record is not None]
    pairs: dict[int, Any] = {}
    for transposed in (False, True):
        for t in t_list:
            if id(t) in pairs:
                continue
            want = shape(t)[::-1] if transposed else shape(t)
            if transposed and len(want) != 2:
                continue
            hit = next((b for b in free if shape(b) == want), None)
            if hit is not None:
                pairs[id(t)] = hit
                free.remove(hit)
    return [(t, pairs.get(id(t))) for t in t_rows]
