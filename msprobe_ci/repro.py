"""Running a standalone reproduction of one failing API call (``python repro/<node>.py``, written by
:mod:`msprobe_ci.capture.repro`, which describes the files, or for a per-API pre-check item by
:mod:`msprobe_ci.replay.repro`): the call re-run without the model through the same isolation the gate ran (a
pre-check item: the same replay), its metrics printed against their thresholds beside the gate's own verdict.

Reading is data, never code: the API is looked up on the replay allowlist (:mod:`msprobe_ci.replay.allowlist`),
dtypes and memory formats in torch's own tables, tensors come from safetensors; nothing in the files picks a
function, a path to write or an object to unpickle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from typing import Any

import torch

from .replay.repro_files import CUDA_MATMUL, VERSION, _DTYPES, _decode, _placed
from .errors import MsprobeError

# ------------------------------------------------------------------------------------------------ running
_BASE = (("node", str), ("prefix", str), ("api", str), ("call", int), ("direction", str), ("faults", list))
_COMMON = _BASE + (("args", list), ("kwargs", dict))
#: the fields each kind of reproduction must have: a live gate's call (capture), a replayed dump item's (replay),
#: a live gate's collective (collective)
_FIELDS = {"capture": _COMMON + (("forward", str), ("function", dict), ("requires_grad", dict),
                                 ("grad_outputs", dict), ("isolator", dict)),
           "replay": _COMMON + (("replayer", dict),),
           "collective": _BASE + (("collective", dict), ("isolator", dict)),
           "free": _COMMON + (("function", dict), ("free", dict)),
           "module": _COMMON + (("module", dict), ("requires_grad", dict), ("isolator", dict))}
#: the most ranks a collective's reproduction starts (one process each)
MAX_WORLD = 64


def load(path: str) -> tuple[dict, dict]:
    """The spec and the tensors of a reproduction (``path``: its ``.py``, ``.json`` or stem).

    Raises:
        MsprobeError: a missing or malformed file, naming it and the field.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    stem = re.sub(r"\.(py|json|safetensors)$", "", os.fspath(path))
    try:
        with open(stem + ".json", encoding="utf-8") as fh:
            spec = json.load(fh)
    except FileNotFoundError:
        raise MsprobeError(f"{stem}.json: reproduction settings not found") from None
    except ValueError as exc:
        raise MsprobeError(f"{stem}.json: not valid JSON ({exc})") from None
    if not isinstance(spec, dict) or spec.get("version") != VERSION:
        raise MsprobeError(f"{stem}.json: expected a reproduction spec of version {VERSION}")
    if spec.get("kind", "capture") not in _FIELDS:
        raise MsprobeError(f"{stem}.json: field 'kind': expected one of {', '.join(_FIELDS)}")
    for key, kind in _FIELDS[spec.get("kind", "capture")]:
        if not isinstance(spec.get(key), kind):
            raise MsprobeError(f"{stem}.json: field '{key}': expected {kind.__name__}")
    if spec["direction"] not in ("forward", "backward"):
        raise MsprobeError(f"{stem}.json: field 'direction': expected forward or backward")
    try:
        tensors = load_file(stem + ".safetensors")
    except FileNotFoundError:
        raise MsprobeError(f"{stem}.safetensors: reproduction inputs not found") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise MsprobeError(f"{stem}.safetensors: not a safetensors file ({str(exc)[:120]})") from None
    return spec, tensors


def run(path: str, fault: bool = True, target_device: str | None = None) -> tuple[dict, dict]:
    """Re-run a reproduction's call through isolation, as the gate ran it.

    Args:
        path: the reproduction's ``.py`` (or ``.json``, or their stem).
        fault: apply the faults the gate injected into this call (``False``: the call as its kernel computes it).
        target_device: where the target call runs (default: the gate's target device).

    Returns:
        ``(record, spec)``: the isolation record of the node (``status``, ``standard``, ``metric``, ``value``,
        ``threshold``, ``row``, ``message``, ``metrics``) and the spec read.

    Raises:
        MsprobeError: unreadable files, an API not on the replay allowlist, a bad field.
    """
    from .capture.inject import parse_faults
    from .replay import allowlist
    from .judge.rows import outputs as _outputs

    spec, tensors = load(path)
    where = re.sub(r"\.(py|json|safetensors)$", "", os.fspath(path)) + ".json"
    threads = spec.get("threads")
    if isinstance(threads, int) and threads > 0 and threads != torch.get_num_threads():
        torch.set_num_threads(threads)  # the gate's: a CPU kernel's summation order follows it
    if spec.get("kind") == "replay":
        return _replayed(spec, tensors, where, fault, target_device), spec
    if spec.get("kind") == "collective":
        return _collective(spec, tensors, where, fault), spec
    if spec.get("kind") == "free":
        return _free(spec, tensors, where, fault, target_device), spec
    if spec.get("kind") == "module":
        return _module(spec, tensors, where, fault, target_device), spec
    matmul = spec.get("cuda_matmul") or {}
    if not isinstance(matmul, dict):
        raise MsprobeError(f"{where}: field 'cuda_matmul': expected a mapping")
    for key in CUDA_MATMUL:  # the two settings named in code; the spec gives only their values
        if isinstance(matmul.get(key), bool):
            setattr(torch.backends.cuda.matmul, key, matmul[key])
    func = allowlist.lookup(str(spec["function"].get("prefix")), str(spec["function"].get("api")))
    if func is None:
        raise MsprobeError(f"{where}: field 'function': not on the replay allowlist")
    device = target_device or str(spec["isolator"].get("target_device") or "cpu")
    iso = _isolator(spec["isolator"], device)
    faults = parse_faults({"faults": spec["faults"]}, where) if fault else ()
    for key, want in spec["requires_grad"].items():
        t = tensors.get(key)
        if t is None:
            raise MsprobeError(f"{where}: field 'requires_grad': no tensor {key!r} in the inputs")
    moved = _placed(tensors, spec, device, where)
    for key, want in spec["requires_grad"].items():
        if want and (moved[key].is_floating_point() or moved[key].is_complex()):
            moved[key].requires_grad_(True)
    args = _decode(spec["args"], moved, where)
    kwargs = _decode(spec["kwargs"], moved, where)
    name, n = spec["forward"], spec["call"]
    prefix, api = spec["prefix"], spec["api"]
    api_id = f"{prefix}.{api}"
    ac = spec.get("autocast")
    # under autocast on the target's device type (the gate's, or the one --target-device names)
    autocast = torch.autocast(torch.device(device).type if target_device else str(ac["device_type"]),
                              dtype=_DTYPES[str(ac["dtype"])]) \
        if isinstance(ac, dict) and str(ac.get("dtype")) in _DTYPES else contextlib.nullcontext()
    with torch.set_grad_enabled(bool(spec.get("grad_enabled", True))), autocast:
        call, a, k = iso.before(name, prefix, api, func, tuple(args), dict(kwargs))
        out = func(*a, **k)
        for f in faults:
            if f.matches(api_id, n, "forward"):
                out = f.apply(out, n)
        bwd = [(f, n) for f in faults if f.matches(api_id, n, "backward")]
        if bwd and call is not None and call.taps:
            iso.faults_at_tap[f"{prefix}.{api}.{n}.backward"] = bwd
        iso.after(call, out)
    if spec["direction"] == "backward":
        flat = [t for _, t in _outputs(out, "output")
                if isinstance(t, torch.Tensor) and t.requires_grad]
        pairs = []
        for i, key in spec["grad_outputs"].items():
            if not str(i).isdigit() or int(i) >= len(flat) or key not in moved:
                raise MsprobeError(f"{where}: field 'grad_outputs': {i!r} names no output that requires grad")
            pairs.append((flat[int(i)], moved[key]))
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
    record = iso.results.get(spec["node"]) or {"status": "skip", "message": "nothing judged"}
    return record, spec


def _isolator(s: dict, device: str):
    """The :class:`~msprobe_ci.isolate.Isolator` a spec's ``isolator`` settings describe, its target on
    ``device``."""
    from .isolate import Isolator

    return Isolator(standards=s.get("standards") or {}, thresholds=s.get("thresholds") or {},
                    target_device=device, bench_device=str(s.get("bench_device") or "cpu"),
                    backward=bool(s.get("backward", True)), bench_kernel=str(s.get("bench_kernel") or "device"),
                    budget_draws=int(s.get("budget_draws", 3)), oracle_device=str(s.get("oracle_device") or "cpu"),
                    oracle_max=_DTYPES.get(str(s.get("oracle_max")), torch.float64), oracle_label=s.get("oracle_label"))


def _module(spec: dict, tensors: dict, where: str, fault: bool, target_device: str | None) -> dict:
    """Judge a module isolated whole again (``"kind": "module"``, :mod:`msprobe_ci.isolate.reproduce`): rebuilt
    from its tapes, on the gate's devices, in the gate's precisions."""
    from .capture.inject import parse_faults
    from .isolate.reproduce import run_module

    device = str(spec["isolator"].get("target_device") or "cpu")
    if target_device is not None and torch.device(target_device) != torch.device(device):
        raise MsprobeError(f"{where}: a module's reproduction runs on the gate's target device ({device}): its "
                           "tapes were recorded there")
    faults = parse_faults({"faults": spec["faults"]}, where)
    return run_module(_isolator(spec["isolator"], device), spec, _placed(tensors, spec, device, where), where,
                      fault, faults)


def _replayed(spec: dict, tensors: dict, where: str, fault: bool, target_device: str | None) -> dict:
    """Judge a replayed dump item again (``"kind": "replay"``, :mod:`msprobe_ci.replay.repro`) through the
    :class:`~msprobe_ci.replay.runner.ApiReplayer` path that judged it, without the dump; its record as
    :func:`run` returns it."""
    from .capture.inject import parse_faults
    from .replay.repro import record_of
    from .replay.apis import parse_name, resolve
    from .replay.runner import ApiReplayer

    r = spec["replayer"]
    node = spec["node"]
    try:
        _, _, _, direction = parse_name(node)
        resolve(spec["prefix"], spec["api"])  # on the replay allowlist, or refused with why
    except MsprobeError as exc:
        raise MsprobeError(f"{where}: field 'node': {exc}") from None
    if direction != spec["direction"] or not node.startswith(f"{spec['prefix']}.{spec['api']}.{spec['call']}."):
        raise MsprobeError(f"{where}: field 'node': {node!r} is not {spec['prefix']}.{spec['api']}.{spec['call']}."
                           f"{spec['direction']}")
    try:
        replayer = ApiReplayer(None, live=bool(r.get("live")), standards=dict(r.get("standards") or {}),
                               thresholds=dict(r.get("thresholds") or {}),
                               faults=parse_faults({"faults": spec["faults"]}, where) if fault else (),
                               target_device=target_device or str(r.get("target_device") or "cpu"),
                               bench_kernel=str(r.get("bench_kernel") or "device"),
                               budget_draws=int(r.get("budget_draws", 3)))
    except (TypeError, ValueError) as exc:
        raise MsprobeError(f"{where}: field 'replayer': {exc}") from None
    tensors = _placed(tensors, spec, None, where)
    args, kwargs = _decode(spec["args"], tensors, where), _decode(spec["kwargs"], tensors, where)
    targets = spec.get("targets")
    if targets is not None:
        if not isinstance(targets, list) or not all(isinstance(t, list) and len(t) == 2 and isinstance(t[0], str)
                                                    for t in targets):
            raise MsprobeError(f"{where}: field 'targets': expected [[row, output], ...] or null")
        targets = [(row, _decode(v, tensors, where)) for row, v in targets]
    if direction == "forward":
        result = replayer.check_inputs(node, args, kwargs, targets)
    else:
        wants, wants_kw, amp = spec.get("wants"), spec.get("wants_kw"), spec.get("autocast")
        if not isinstance(wants, list) or not isinstance(wants_kw, dict) or \
                (amp is not None and str(amp) not in _DTYPES):
            raise MsprobeError(f"{where}: fields 'wants', 'wants_kw', 'autocast': expected a list, a mapping and "
                               "a dtype or null")
        result = replayer.check_grads(node, args, kwargs, _decode(spec.get("upstream"), tensors, where), targets,
                                      [bool(w) for w in wants], {str(k): bool(w) for k, w in wants_kw.items()},
                                      None if amp is None else _DTYPES[str(amp)],
                                      mindspore=bool(spec.get("mindspore")))
    return record_of(result)


def _free(spec: dict, tensors: dict, where: str, fault: bool, target_device: str | None) -> dict:
    """Judge a call the free benchmark found at risk (``"kind": "free"``, written by
    :meth:`~msprobe_ci.capture.repro.Reproducer.write_free`) again: the same higher-precision reference and
    bit-noise rerun (the same seed and call index), the call under the gate's autocast state, its injected fault
    applied to its output and to the bit-noise rerun as the gate applied it; the free benchmark's record."""
    from .capture.inject import parse_faults
    from .free_benchmark import FreeBenchmark
    from .replay import allowlist

    func = allowlist.lookup(str(spec["function"].get("prefix")), str(spec["function"].get("api")))
    if func is None:
        raise MsprobeError(f"{where}: field 'function': not on the replay allowlist")
    f = spec["free"]
    th = f.get("thresholds") or {}
    if not isinstance(th, dict) or not all(str(k) in _DTYPES and isinstance(v, (int, float)) for k, v in th.items()) \
            or not isinstance(f.get("seed"), int) or not isinstance(f.get("calls"), int) or f["calls"] < 0:
        raise MsprobeError(f"{where}: field 'free': expected mode, an int seed and call index, thresholds by dtype")
    try:
        fb = FreeBenchmark(str(f.get("mode")), seed=f["seed"], thresholds={_DTYPES[str(k)]: float(v)
                                                                           for k, v in th.items()})
    except ValueError as exc:
        raise MsprobeError(f"{where}: field 'free.mode': {exc}") from None
    fb._calls = f["calls"]  # the bit-noise signs are seeded by the call's index in its step
    device = target_device or "cpu"
    moved = _placed(tensors, spec, device, where)
    args, kwargs = _decode(spec["args"], moved, where), _decode(spec["kwargs"], moved, where)
    n, node = spec["call"], spec["node"]
    api_id = f"{spec['prefix']}.{spec['api']}"
    faults = [x for x in (parse_faults({"faults": spec["faults"]}, where) if fault else ())
              if x.matches(api_id, n, "forward")]

    def kernel(value: Any) -> Any:
        for x in faults:
            value = x.apply(value, n)
        return value
    ac = spec.get("autocast")
    autocast = torch.autocast(torch.device(device).type if target_device else str(ac["device_type"]),
                              dtype=_DTYPES[str(ac["dtype"])]) \
        if isinstance(ac, dict) and str(ac.get("dtype")) in _DTYPES else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        pending = fb.before(node, spec["prefix"], spec["api"], func, tuple(args), dict(kwargs), kernel)
        out = kernel(func(*args, **kwargs))
        fb.after(pending, out)
    return fb.results.get(node) or {"status": "skip", "message": "nothing judged"}


def _collective(spec: dict, tensors: dict, where: str, fault: bool) -> dict:
    """Re-run a failing collective (``"kind": "collective"``, written by
    :meth:`~msprobe_ci.capture.repro.Reproducer.write_collective`) on a fresh gloo group of the dumped group's size,
    one process per rank (``torch.multiprocessing.spawn``; a file store in a temporary folder), each rank giving
    the input it gave in the gate; the rank that failed applies its injected fault (unless ``fault`` is False) and
    every rank judges as the gate did (:meth:`~msprobe_ci.isolate.Isolator.judge_collective`). That rank's record.

    An ``AVG`` (which gloo lacks) runs as a ``SUM`` divided by the group's size in the output's dtype, as the
    judgement's same-dtype bench computes it."""
    import tempfile

    import torch.multiprocessing as mp

    from .capture.inject import parse_faults
    from .isolate.collectives import JUDGED

    c = spec["collective"]
    op, red = c.get("op"), c.get("reduce_op")
    world, rank = c.get("world_size"), c.get("rank_in_group")
    if op not in JUDGED or spec["api"] != op:
        raise MsprobeError(f"{where}: field 'collective.op': expected one of {', '.join(JUDGED)} (the node's API)")
    if red not in ("SUM", "AVG", "PRODUCT", "MAX", "MIN"):
        raise MsprobeError(f"{where}: field 'collective.reduce_op': expected SUM, AVG, PRODUCT, MAX or MIN")
    if not isinstance(world, int) or not 1 <= world <= MAX_WORLD or not isinstance(rank, int) or \
            not 0 <= rank < world:
        raise MsprobeError(f"{where}: fields 'collective.world_size', 'rank_in_group': expected 1 <= world_size <= "
                           f"{MAX_WORLD} and 0 <= rank_in_group < world_size")
    shape, out_shape = c.get("input_shape"), c.get("output_shape")
    if not all(isinstance(x, list) and all(isinstance(i, int) and i >= 0 for i in x) for x in (shape, out_shape)) \
            or str(c.get("output_dtype")) not in _DTYPES:
        raise MsprobeError(f"{where}: fields 'collective.input_shape', 'output_shape', 'output_dtype': expected "
                           "two shapes and a dtype")
    inputs = tensors.get("inputs")
    if inputs is None or list(inputs.shape) != [world, *shape] or not inputs.is_floating_point():
        raise MsprobeError(f"{where}: tensor 'inputs': expected the group's floating inputs of shape "
                           f"{[world, *shape]}")
    faults = parse_faults({"faults": spec["faults"]}, where) if fault else ()
    faults = [f for f in faults if f.matches(f"{spec['prefix']}.{op}", spec["call"], "forward")]
    s = spec["isolator"]
    job = {"node": spec["node"], "op": op, "reduce_op": red, "world": world, "rank": rank, "call": spec["call"],
           "output_shape": out_shape, "output_dtype": str(c["output_dtype"]), "threads": spec.get("threads"),
           "standards": dict(s.get("standards") or {}), "thresholds": dict(s.get("thresholds") or {})}
    with tempfile.TemporaryDirectory(prefix="msprobe-ci-repro-") as tmp:
        result = os.path.join(tmp, "record.json")
        try:
            mp.spawn(_collective_rank, args=(job, inputs, faults, os.path.join(tmp, "store"), result),
                     nprocs=world, join=True)
        except Exception as exc:  # noqa: BLE001 - a rank's failure, reported in one line
            raise MsprobeError(f"{where}: the collective's re-run failed: "
                               f"{str(exc).strip().splitlines()[-1][:200]}") from None
        with open(result, encoding="utf-8") as fh:
            return json.load(fh)


def _collective_rank(rank: int, job: dict, inputs: torch.Tensor, faults: list, store: str, result: str) -> None:
    """One rank of :func:`_collective` (a ``torch.multiprocessing.spawn`` target)."""
    import warnings

    import torch.distributed as dist

    from .isolate import Isolator

    threads = job.get("threads")
    if isinstance(threads, int) and threads > 0:
        torch.set_num_threads(threads)
    world, op, red = job["world"], job["op"], job["reduce_op"]
    # closed tables, never a name from the file looked up on a module: the spec was checked against these
    reduce = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "PRODUCT": dist.ReduceOp.PRODUCT,
              "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN}[red]
    call = {"reduce_scatter_tensor": dist.reduce_scatter_tensor, "all_gather_into_tensor": dist.all_gather_into_tensor,
            # the *_single names of torch 2.13 (older torch records none)
            "reduce_scatter_single": getattr(dist, "reduce_scatter_single", None),
            "all_gather_single": getattr(dist, "all_gather_single", None)}.get(op)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        inp = inputs[rank].clone()
        before = None
        if op == "all_reduce":
            before, out = inp.clone(), inp
            dist.all_reduce(out, op=dist.ReduceOp.SUM if red == "AVG" else reduce)
            args, kwargs = (out,), {"op": reduce}
        else:
            out = torch.empty(job["output_shape"], dtype=_DTYPES[job["output_dtype"]])
            kwargs = {"op": reduce} if op.startswith("reduce_scatter") else {}
            with warnings.catch_warnings():  # the gate's own call (torch 2.13 deprecates the *_tensor names)
                warnings.simplefilter("ignore", FutureWarning)
                call(out, inp, **({"op": dist.ReduceOp.SUM} if red == "AVG" and kwargs else kwargs))
            args = (out, inp)
        if red == "AVG" and kwargs:
            out.div_(world)
        if rank == job["rank"] and faults:  # what this rank received, off as the gate made it
            value = out
            for f in faults:
                value = f.apply(value, job["call"])
            out.copy_(value)
        iso = Isolator(standards=job["standards"], thresholds=job["thresholds"])
        iso.judge_collective(job["node"], op, args, kwargs, before, None)
        if rank == job["rank"]:
            with open(result, "w", encoding="utf-8") as fh:
                json.dump(iso.results.get(job["node"]) or {"status": "skip", "message": "nothing judged"}, fh)
    finally:
        dist.destroy_process_group()


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    """``python repro/<node>.py [--no-fault] [--target-device DEV]``: prints the verdict, returns the exit code
    (1: fails its standard, 0: passes, 2: the reproduction cannot run)."""
    argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(prog=os.path.basename(argv[0]),
                                     description="Re-run one failing API call as the msprobe-ci gate ran it.")
    parser.add_argument("--no-fault", action="store_true", help="leave out the fault the gate injected")
    parser.add_argument("--target-device", default=None, help="run the target call on this device "
                                                              "(default: the gate's)")
    opts = parser.parse_args(argv[1:])
    try:
        record, spec = run(argv[0], fault=not opts.no_fault, target_device=opts.target_device)
    except MsprobeError as exc:
        print(f"msprobe-ci repro: {exc}", file=sys.stderr)
        return 2
    faults = [] if opts.no_fault else spec["faults"]
    fault_text = (", fault: " + "; ".join(f"{f['perturb']} {f['value']:g} on the {f['direction']}" for f in faults)
                  if faults else (", fault left out" if spec["faults"] else ""))
    print(f"node: {spec['node']}")
    if spec.get("kind") == "collective":
        c = spec["collective"]
        print(f"re-run as the gate ran it: {c['op']} ({c['reduce_op']}) on a gloo group of {c['world_size']} "
              f"process(es), judged on rank {c['rank_in_group']} of it"
              + (f", step {spec.get('step')}" if spec.get("step") else "") + fault_text)
    elif spec.get("kind") == "free":
        f = spec["free"]
        ac = spec.get("autocast")
        print(f"re-run as the free benchmark ran it: reference {f.get('mode')}, bit-noise seed {f.get('seed')} at "
              f"call {f.get('calls')} of its step, target {opts.target_device or 'cpu'}"
              + (f", autocast {ac['dtype']} on {ac['device_type']}" if isinstance(ac, dict) else "") + fault_text)
    elif spec.get("kind") == "replay":
        r = spec["replayer"]
        target = (f"run live on {opts.target_device or r.get('target_device')}" if r.get("live")
                  else "the outputs the dump recorded")
        amp = f", autocast {spec['autocast']}" if spec.get("autocast") else ""
        print(f"replayed as the pre-check did: target {target}, bench kernel {r.get('bench_kernel')} on cpu, "
              f"oracle cpu{amp}{fault_text}")
    else:
        s = spec["isolator"]
        ac = spec.get("autocast")
        m = spec.get("module")
        if isinstance(m, dict):  # a module isolated whole: its code is its tapes
            tapes = m.get("tapes") or [{}]
            print(f"module rebuilt from its tapes ({len(tapes[-1].get('calls') or [])} torch calls in the target's); "
                  + ("target replayed" if m.get("target") == "replayed" else
                     "target replayed without its fault (with it, its tape gives the gate's values to a few units "
                     "of roundoff)" if opts.no_fault and m.get("clean") == "replayed" else
                     f"target values as the gate recorded them ({m.get('why')})"
                     + ("" if m.get("clean") == "replayed" else ": --no-fault cannot remove a fault")))
        print(f"ran as the gate: target {opts.target_device or s.get('target_device')}, bench kernel "
              f"{s.get('bench_kernel')} on {s.get('bench_device')}, oracle {s.get('oracle_label') or 'cpu'}"
              + (f", autocast {ac['dtype']} on {ac['device_type']}" if isinstance(ac, dict) else "")
              + (f", step {spec.get('step')}" if spec.get("step") else "") + fault_text)
    print(f"status: {record.get('status')}")
    if record.get("standard"):
        print(f"standard: {record['standard']}: {record.get('metric')} {_fmt(record.get('value'))} "
              f"(threshold {_fmt(record.get('threshold'))}, row {record.get('row')})")
    elif record.get("metric"):  # the free benchmark's record: its metric against the allowance that applied
        print(f"metric: {record['metric']} {_fmt(record.get('value'))} (allowed {_fmt(record.get('threshold'))}, "
              f"row {record.get('row')})")
    print(f"message: {record.get('message')}")
    for k, v in sorted((record.get("metrics") or {}).items()):
        print(f"  {k}: {_fmt(v)}")
    gate = spec.get("gate") or {}
    print(f"gate: {gate.get('status')}: {gate.get('message')}")
    return 1 if record.get("status") == "error" else 0
