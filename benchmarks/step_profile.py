"""Where one captured step's time goes, on whatever device is present (issue 51: "where a goal meets a floor, show
the floor with a profile, not an argument").

A stock GPT-2 (built from its config, no weights; ``--layers`` blocks, 1 x ``--tokens`` tokens, forward+backward,
the LM loss), the bf16 target side as ``msprobe.check`` captures it (statistics, mix) with isolation against the
fp64 oracle (``--bench-kernel device|upcast``, or ``off`` for capture alone), one warm step first, then one step
under ``torch.profiler``; a plain bf16 step of the same model is timed in the same run for scale. Printed:

* the wall time of the profiled step and of the plain step (the profiler adds its own cost: compare shares, not
  seconds, with ``realistic_size.py``);
* the **host**: the ATen ops and their self time (top ``--top``), and on CUDA the runtime calls that launch
  kernels and those that wait for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, device-to-host
  copies), counted and timed;
* the **device** (CUDA): the union of its kernels' intervals (seconds the device was busy) as a share of the
  wall time, and the kernels that took longest.

A step whose device is busy a small share of its wall time and whose waits are short is host-bound: its floor is
the host's work (Python and launches), not the device's. ``--trace PATH`` also writes the Chrome trace.

    python benchmarks/step_profile.py [--device cpu|cuda] [--bench-kernel device|upcast|off] [--layers 12]
        [--tokens 1024] [--top 12] [--trace trace.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from realistic_size import _sync  # noqa: E402 - a sibling script

#: CUDA runtime and driver calls that queue a kernel (host time per launch)
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
#: CUDA calls where the host waits for the device: synchronisations and copies to host memory
WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cuMemcpyDtoHAsync", "cuStreamSynchronize")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (any unit): overlapping kernels on several streams
    count once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _plain_seconds(model, batch, device: str) -> float:
    import copy

    m = copy.deepcopy(model).to(device, torch.bfloat16)
    inputs = {k: v.to(device) for k, v in batch.items()}
    m(**inputs).loss.backward()  # warm
    m.zero_grad(set_to_none=True)
    _sync(device)
    t0 = time.perf_counter()
    m(**inputs).loss.backward()
    _sync(device)
    return time.perf_counter() - t0


def profile_step(device: str, mode: str, layers: int, tokens: int):
    """``(profiler, wall seconds of the profiled step, wall seconds of a plain bf16 step)``."""
    from torch.profiler import ProfilerActivity, profile

    from host_syncs import _model
    from msprobe_ci.backends import Backend
    from msprobe_ci.check import run_side
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    model, batch = _model(layers, tokens)
    plain = _plain_seconds(model, batch, device)
    target = Backend.from_options(device, "bf16")
    bench = Backend.from_options(device, "fp32")
    tmp = tempfile.mkdtemp(prefix="step-profile-")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    try:
        prof = wall = None
        for profiled in (False, True):
            iso = None if mode == "off" else Isolator(
                target_device=target.torch_device, bench_device=bench.torch_device, bench_kernel=mode,
                **target.oracle_options("target"))
            cfg = DumpConfig(task="statistics", level="mix", dump_path=os.path.join(tmp, f"s{int(profiled)}"))
            ctx = profile(activities=activities) if profiled else contextlib.nullcontext()
            _sync(device)
            t0 = time.perf_counter()
            with ctx as p:
                run_side(model, (batch,), lambda o: o.loss, target, cfg, isolator=iso)
                _sync(device)
            if profiled:
                prof, wall = p, time.perf_counter() - t0
        return prof, wall, plain
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def summary(prof, top: int) -> dict:
    """The host's and the device's figures of a finished profile (see the module docstring), seconds."""
    kernels, launches, waits = [], [0, 0.0], [0, 0.0]
    host_ops: dict[str, list] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((evt.time_range.start, evt.time_range.end, evt.name))
            continue
        name = evt.name
        if name in LAUNCH_CALLS:
            launches[0] += 1
            launches[1] += evt.cpu_time_total / 1e6
        elif name in WAIT_CALLS:
            waits[0] += 1
            waits[1] += evt.cpu_time_total / 1e6
        elif name.startswith("aten::"):
            agg = host_ops.setdefault(name, [0, 0.0])
            agg[0] += 1
            agg[1] += evt.self_cpu_time_total / 1e6
    by_kernel: dict[str, float] = {}
    for s, e, name in kernels:
        by_kernel[name] = by_kernel.get(name, 0.0) + (e - s) / 1e6
    return {"aten_ops": sum(v[0] for v in host_ops.values()),
            "aten_self_s": sum(v[1] for v in host_ops.values()),
            "top_ops": sorted(host_ops.items(), key=lambda kv: -kv[1][1])[:top],
            "kernels": len(kernels), "busy_s": busy_seconds([(s, e) for s, e, _ in kernels]) / 1e6,
            "top_kernels": sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top],
            "launches": launches, "waits": waits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bench-kernel", default="device", help="device, upcast (isolation), or off (capture alone)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--trace", default=None, help="also write the Chrome trace here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    card = torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU"
    prof, wall, plain = profile_step(a.device, a.bench_kernel, a.layers, a.tokens)
    s = summary(prof, a.top)
    what = "capture alone" if a.bench_kernel == "off" else f"isolation, {a.bench_kernel} bench"
    print(f"GPT-2, {a.layers} blocks, 1 x {a.tokens} tokens, bf16 target side, {what}, on {a.device} ({card}); "
          f"torch {torch.__version__}")
    print(f"  profiled step {wall:.2f} s (a plain bf16 step {plain:.3f} s, {wall / plain:.1f}x, the profiler's "
          f"cost included)")
    print(f"  host: {s['aten_ops']} ATen ops, {s['aten_self_s']:.2f} s of their self time")
    if a.device.startswith("cuda"):
        n, t = s["launches"]
        w, wt = s["waits"]
        print(f"  host: {n} kernel launches, {t:.2f} s in the launch calls ({1e6 * t / max(n, 1):.1f} us each); "
              f"{w} waits for the device (synchronisations, copies to the host), {wt:.2f} s")
        print(f"  device: {s['kernels']} kernels, busy {s['busy_s']:.2f} s = {s['busy_s'] / wall:.0%} of the "
              f"wall time; idle {wall - s['busy_s']:.2f} s")
        print("  kernels that took longest (s):")
        for name, sec in s["top_kernels"]:
            print(f"    {sec:9.3f}  {name[:110]}")
    print("  ATen ops by self time on the host (calls, s):")
    for name, (count, sec) in s["top_ops"]:
        print(f"    {count:7d} {sec:9.3f}  {name}")
    if a.trace:
        prof.export_chrome_trace(a.trace)
        print(f"  trace: {a.trace}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
