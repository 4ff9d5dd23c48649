"""Which torch callable a dump name calls: :func:`parse_name` splits it, :func:`resolve` looks it up through the
replay allowlist (:mod:`msprobe_ci.replay.allowlist`, data), :func:`_short` gives the name the standards registry
knows."""

from __future__ import annotations

import functools

from ..dump import names
from ..errors import MsprobeError
from ..judge import UNSUPPORTED_PREFIX, unjudgeable
from . import allowlist


def parse_name(name: str) -> tuple[str, str, int, str]:
    """``(prefix, api, call, direction)`` of a dump name; raises MsprobeError for anything else."""
    p = names.parse(name, any_prefix=True)
    if p is None or p.kind != "api":
        raise MsprobeError(f"{name}: not an API call name (<Prefix>.<api>.<n>.forward|backward)")
    return p.prefix, p.api, int(p.call), p.direction


@functools.lru_cache(maxsize=None)
def resolve(prefix: str, api: str):
    """The torch callable of an API, or raise MsprobeError saying why it is not replayable.

    Names resolve only through the replay allowlist (:mod:`msprobe_ci.replay.allowlist`, data): a dump cannot
    name ``os.system``, ``load``, ``save`` or any other function that is not a listed tensor operation.
    """
    if prefix in UNSUPPORTED_PREFIX:
        raise MsprobeError(unjudgeable(prefix, api))
    if prefix not in allowlist.PREFIXES:  # a MindSpore API whose PyTorch twin takes the same arguments
        from ..dump.frameworks import torch_api

        base, row = torch_api(prefix, api)
        if base is not None and (row.get("replay") or not row) and "." in base:
            t_prefix, t_api = base.split(".", 1)
            if t_prefix in allowlist.PREFIXES and (func := allowlist.lookup(t_prefix, t_api)) is not None:
                return func
            raise MsprobeError(f"{prefix}.{api}: its PyTorch twin {base} is not on the replay allowlist")
        raise MsprobeError(f"{prefix}.{api}: unknown API prefix (replay knows {', '.join(allowlist.PREFIXES)})")
    func = allowlist.lookup(prefix, api)
    if func is None:
        raise MsprobeError(f"{prefix}.{api}: not on the replay allowlist (tensor operations only; "
                           "I/O, process, file, RNG-state and serialisation functions are never replayed)")
    return func


@functools.lru_cache(maxsize=None)
def _short(prefix: str, api: str) -> str:
    """The API name the standards registry knows: ``linear`` for ``Functional.linear`` and for MindSpore's
    ``Primitive.dense.Dense`` (its PyTorch twin)."""
    if prefix not in allowlist.PREFIXES:
        from ..dump.frameworks import torch_api

        base, _ = torch_api(prefix, api)
        if base is not None:
            return base.rsplit(".", 1)[-1]
    return api.rsplit(".", 1)[-1]
