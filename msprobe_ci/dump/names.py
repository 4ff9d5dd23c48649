"""The grammar of dump node names, in one place (msprobe 26.2.0, ``shared/spec/dump-format.md`` §4-7).

* API call: ``{Prefix}.{api}.{n}.forward`` / ``.backward`` (``Functional.linear.0.forward``,
  ``Torch.linalg.norm.0.forward``; MindSpore: ``Mint.``, ``MintFunctional.``, ``Primitive.``, ``Jit.``).
* Module call: ``Module.{path}.{Class}.forward.{n}`` / ``.backward.{n}`` (MindSpore: ``Cell.``).
* Parameter gradients: ``Module.{path}.{Class}.parameters_grad[.{n}]``.

Names are data read from dumps: nothing here resolves them to code.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

API_PREFIXES = ("Tensor", "Torch", "Functional", "NPU", "Aten", "VF", "Distributed", "MindSpeed", "Mint",
                "MintFunctional", "Primitive", "Jit")
MODULE_PREFIXES = ("Module", "Cell")
_API = re.compile(r"^(?P<prefix>" + "|".join(API_PREFIXES) + r")\.(?P<api>.+)\.(?P<n>\d+)\.(?P<dir>forward|backward)$")
_ANY_API = re.compile(r"^(?P<prefix>[A-Za-z]+)\.(?P<api>.+)\.(?P<n>\d+)\.(?P<dir>forward|backward)$")
_MODULE = re.compile(r"^(?P<base>(?:" + "|".join(MODULE_PREFIXES) + r")\..+)\.(?P<dir>forward|backward)\.(?P<n>\d+)$")
_PGRAD = re.compile(r"^(?P<base>.+)\.parameters_grad(?:\.(?P<n>\d+))?$")
_CALL_INDEX = re.compile(r"\.\d+\.(forward|backward)")


@dataclass(frozen=True)
class NodeName:
    """A parsed node name.

    Attributes:
        kind: ``api``, ``module`` or ``parameters_grad``.
        prefix: ``Functional``, ``Module`` ... (the first segment).
        base: for APIs ``{Prefix}.{api}``, for modules and parameter gradients the name up to the direction.
        api: the API name without prefix (``linear``, ``linalg.norm``); empty for modules.
        call: the call index (``None`` for an unnumbered parameters_grad entry).
        direction: ``forward``, ``backward`` or ``""`` (parameters_grad).
    """

    kind: str
    prefix: str
    base: str
    api: str
    call: int | None
    direction: str

    @property
    def short(self) -> str:
        """The API's last segment (``norm`` for ``linalg.norm``); empty for modules."""
        return self.api.rsplit(".", 1)[-1] if self.api else ""

    def twin(self, direction: str) -> str:
        """The same call in the other direction (``...forward`` ↔ ``...backward``)."""
        if self.kind == "api":
            return f"{self.base}.{self.call}.{direction}"
        if self.kind == "module":
            return f"{self.base}.{direction}.{self.call}"
        return f"{self.base}.{direction}.{self.call or 0}"


_MODULE_STARTS = tuple(p + "." for p in MODULE_PREFIXES)


@functools.lru_cache(maxsize=4096)  # a streaming compare parses each name two or three times in a row
def parse(name: str, any_prefix: bool = False) -> NodeName | None:
    """Parse a node name; ``None`` for anything else. ``any_prefix``: accept API prefixes outside
    :data:`API_PREFIXES` (msprobe's replay tolerates them and skips them by name later)."""
    m = _PGRAD.match(name) if "parameters_grad" in name else None  # the regexes only when they can match
    if m:
        n = m.group("n")
        return NodeName("parameters_grad", name.split(".", 1)[0], m.group("base"), "", int(n) if n else None, "")
    m = _MODULE.match(name) if name.startswith(_MODULE_STARTS) else None
    if m:
        return NodeName("module", name.split(".", 1)[0], m.group("base"), "", int(m.group("n")), m.group("dir"))
    m = (_ANY_API if any_prefix else _API).match(name)
    if m and m.group("prefix") not in MODULE_PREFIXES:
        return NodeName("api", m.group("prefix"), f"{m.group('prefix')}.{m.group('api')}", m.group("api"),
                        int(m.group("n")), m.group("dir"))
    return None


def is_api(name: str) -> bool:
    """An API call entry (either direction) with a known prefix."""
    p = parse(name)
    return p is not None and p.kind == "api"


def is_module(name: str) -> bool:
    return name.split(".", 1)[0] in MODULE_PREFIXES


def without_call_index(name: str) -> str:
    """Drop the call index: ``Functional.linear.3.forward.input.0`` → ``Functional.linear.forward.input.0``."""
    return _CALL_INDEX.sub(lambda m: "." + m.group(1), name, count=1)
