"""Fuzzing one API around its dumped inputs with hypothesis, and writing a standalone reproducer on failure.

Each example keeps the dumped dtypes, shapes and non-tensor arguments and draws every tensor argument anew: uniform
values in the dumped ``[Min, Max]`` from a drawn seed, with a drawn list of edge values (Min, Max, 0, ±the
smallest normal, ±1, the midpoint; those inside the range) planted at the first positions. The target runs live
(the API in the dumped dtypes, plus any ``--msprobe-inject`` fault) and is judged against the fp64 oracle by the
API's standard. Hypothesis shrinks a failure (seed towards 0, fewer edge values); the minimal failing inputs are
saved next to ``repro_<api>.py``, which re-runs the API on bench and target and prints the metrics
(msprobe's ``generate_operator``, made automatic).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from .args import DTYPES
from .runner import ApiReplayer, ApiResult, parse_name


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
        :class:`ApiResult` and the path of the written ``repro_<api>.py``.
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    entry = replayer.dump.data.get(name)
    if not name.endswith(".forward") or not isinstance(entry, dict):
        return None, None
    args0, kwargs0 = replayer.arguments(name)
    failures: list[tuple[list, dict, ApiResult]] = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        args = [_draw(data, v, r, f"input.{i}") for i, (v, r) in enumerate(zip(entry.get("input_args") or [],
                                                                                args0))]
        kwargs = {k: _draw(data, entry.get("input_kwargs", {}).get(k), r, f"input.{k}") for k, r in kwargs0.items()}
        result = replayer.check_inputs(name, args, kwargs)
        if result.status == "error":
            failures.append((args, kwargs, result))
            raise AssertionError(result.message)

    try:
        run()
    except AssertionError:
        pass
    if not failures:
        return None, None
    args, kwargs, result = failures[-1]  # hypothesis replays the shrunk example last
    return result, write_repro(name, args, kwargs, result, out_dir, replayer.faults)


_REPRO = '''"""Reproduces a per-API accuracy failure found by msprobe-ci fuzzing.

API: {name}
Failure: {message}
Run: python {script}   (set TARGET_DEVICE to the device under test, e.g. "npu:0" with torch_npu imported)
"""

import torch

from msprobe_ci.checkers import make_standard, standard_for
from msprobe_ci.replay import resolve

TARGET_DEVICE = "cpu"
inputs = torch.load(__file__[:-3] + ".pt", weights_only=True)
args, kwargs = inputs["args"], inputs["kwargs"]
func = resolve({prefix!r}, {api!r})


def cast(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(cast(v, fn) for v in value)
    if isinstance(value, dict):
        return {{k: cast(v, fn) for k, v in value.items()}}
    return value


up = lambda t: t.double() if t.is_floating_point() else t  # noqa: E731
oracle = func(*cast(args, up), **cast(kwargs, up))
bench = func(*cast(args, torch.clone), **cast(kwargs, torch.clone))
target = func(*cast(args, lambda t: t.to(TARGET_DEVICE)), **cast(kwargs, lambda t: t.to(TARGET_DEVICE)))
{fault}
outs = lambda v: list(v) if isinstance(v, (list, tuple)) else [v]  # noqa: E731
for i, (t, b, o) in enumerate(zip(outs(target), outs(bench), outs(oracle))):
    name = standard_for({short!r}, t.dtype)
    result = make_standard(name, t.dtype, {short!r})(t.cpu(), b, o)
    print(f"output {{i}}: {{result.standard}} {{result.status}}: {{result.message}}")
    print(f"  metrics {{result.metrics}}")
    print(f"  thresholds {{result.thresholds}}; would pass at {{result.passing}}")
'''


def write_repro(name: str, args: list, kwargs: dict, result: ApiResult, out_dir: str, faults: tuple = ()) -> str:
    """Write ``repro_<api>.py`` and its ``.pt`` inputs under ``out_dir``; returns the script path."""
    prefix, api, n, _ = parse_name(name)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "repro_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", name))
    torch.save({"args": args, "kwargs": kwargs}, stem + ".pt")
    fault_lines = []
    for f in faults:
        if f.matches(f"{prefix}.{api}", n, "forward") and f.perturb in ("scale", "offset"):
            op = "*" if f.perturb == "scale" else "+"
            fault_lines.append(f"target = cast(target, lambda t: t {op} {f.value!r})  # injected by --msprobe-inject")
    with open(stem + ".py", "w", encoding="utf-8") as fh:
        fh.write(_REPRO.format(name=name, message=result.message.replace('"""', "'''"),
                               script=os.path.basename(stem) + ".py", prefix=prefix, api=api,
                               short=api.rsplit(".", 1)[-1], fault="\n".join(fault_lines)))
    return stem + ".py"
