"""Fuzzing one API around its dumped inputs with hypothesis, and writing a standalone reproducer on failure.

Each example keeps the dumped dtypes, shapes and non-tensor arguments and draws every tensor argument anew: uniform
values in the dumped ``[Min, Max]`` from a drawn seed, with a drawn list of edge values (Min, Max, 0, ±the
smallest normal, ±1, the midpoint; those inside the range) planted at the first positions. The target runs live
(the API in the dumped dtypes, plus any ``--msprobe-inject`` fault) and is judged against the fp64 oracle by the
API's standard. Hypothesis shrinks a failure (seed towards 0, fewer edge values); the minimal failing inputs are
written as the item's standalone reproduction (:mod:`msprobe_ci.replay.repro`: ``<node>.py`` beside its
safetensors inputs), which judges the call again as the fuzzer did and prints the metrics (msprobe's
``generate_operator``, made automatic).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .args import DTYPES
from .result import ApiResult
from .runner import ApiReplayer


def _edges(rec: dict, dtype: torch.dtype) -> list[float]:
    lo, hi = float(rec.get("Min") or 0), float(rec.get("Max") or 0)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [v for v in (lo, hi) if not math.isnan(v)]
    tiny = torch.finfo(dtype).tiny if dtype.is_floating_point else 1
    cands = [lo, hi, 0.0, tiny, -tiny, 1.0, -1.0, (lo + hi) / 2]
    return sorted({c for c in cands if lo <= c <= hi})


def _draw_tensor(data, rec: dict, where: str) -> torch.Tensor:
    from hypothesis import strategies as st

    dtype = DTYPES[str(rec["dtype"])]
    shape = list(rec["shape"])
    numel = math.prod(shape)
    lo, hi = float(rec.get("Min") or 0), float(rec.get("Max") or 0)
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label=f"{where} seed")
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        flo, fhi = (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else (-1.0, 1.0)
        t = torch.rand(numel, generator=gen, dtype=torch.float64) * (fhi - flo) + flo
    elif dtype == torch.bool:
        t = torch.randint(0, 2, (numel,), generator=gen).double()
    else:
        t = torch.randint(int(lo), int(hi) + 1, (numel,), generator=gen).double()
    edges = data.draw(st.lists(st.sampled_from(_edges(rec, dtype) or [0.0]), max_size=min(4, numel)),
                      label=f"{where} edges") if numel else []
    for i, v in enumerate(edges):
        t[i] = v
    return t.to(dtype).reshape(shape)


def _draw(data, value: Any, rebuilt: Any, where: str) -> Any:
    if isinstance(value, dict) and value.get("type") in ("torch.Tensor", "torch.nn.parameter.Parameter") \
            and str(value.get("dtype")) in DTYPES and isinstance(value.get("shape"), list):
        return _draw_tensor(data, value, where)
    if isinstance(value, list) and isinstance(rebuilt, list):
        return [_draw(data, v, r, f"{where}.{i}") for i, (v, r) in enumerate(zip(value, rebuilt))]
    return rebuilt


def fuzz_api(replayer: ApiReplayer, name: str, examples: int, out_dir: str) -> tuple[ApiResult | None, str | None]:
    """Run ``examples`` hypothesis examples for forward entry ``name``.

    Returns:
        ``(None, None)`` when every example passes (or the entry cannot be fuzzed), else the minimal failing
        :class:`ApiResult` and its reproduction's path under ``out_dir`` (or why none was written).
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    entry = replayer.dump.data.get(name)
    if not name.endswith(".forward") or not isinstance(entry, dict):
        return None, None
    args0, kwargs0 = replayer.arguments(name)
    failures: list[ApiResult] = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        args = [_draw(data, v, r, f"input.{i}") for i, (v, r) in enumerate(zip(entry.get("input_args") or [],
                                                                                args0))]
        kwargs = {k: _draw(data, entry.get("input_kwargs", {}).get(k), r, f"input.{k}") for k, r in kwargs0.items()}
        result = replayer.check_inputs(name, args, kwargs)
        if result.status == "error":
            failures.append(result)
            raise AssertionError(result.message)

    try:
        run()
    except AssertionError:
        pass
    if not failures:
        return None, None
    result = failures[-1]  # hypothesis replays the shrunk example last
    from .repro import write

    return result, write(result, replayer, out_dir)
