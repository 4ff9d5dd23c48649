"""Host reads per hooked call and per judged call (issue 51, item 2): every place a tensor's value comes back to the
host while a side is captured, counted, on whatever device is present.

On an accelerator each such read is a synchronisation: the host waits for the device's queue to drain. The goal is
none per call: statistics stay on the device until the step's one transfer (``RecordBuilder.resolve``), the
standards bring back one row of totals per output. This script counts, for one captured step of a stock GPT-2
(built from a config, no weights; ``--layers`` blocks, 1 x ``--tokens`` tokens, forward+backward, the LM loss,
statistics, mix level), bf16 target against an fp32 bench:

* the **Python reads**: every call of ``Tensor.item``/``tolist``/``numpy``/``__bool__``/``__float__``/``__int__``/
  ``__index__``, ``torch.equal``, ``Tensor.nonzero``/``torch.nonzero``/``torch.masked_select`` and boolean-mask
  indexing made while the side runs (``__bool__`` and ``__float__`` call ``item``: each read counted once, at the
  outermost), each with the line of this project that made it (``--sites``);
* on CUDA, also the **synchronising operations** PyTorch itself reports (``torch.cuda.set_sync_debug_mode``),
  which include copies to pageable host memory that no Python read shows;
* the **ATen ops** the side dispatches beyond one plain bf16 step of the model, views and aliases (``detach``,
  ``view``, ``slice``... : ``OpOverload.is_view``) and CPU scalars left out: on an accelerator each is a kernel
  launch, microseconds of host time whatever its size, so per record they are the capture's host cost there.

On the CPU a read costs no wait, and code that branches on it (``msprobe_ci._perf.reads_wait``) takes the path
where reads are free: run it with ``MSPROBE_CI_DEVICE_PATHS=1`` to count, on the CPU, what the same code reads on
a device (reads of tensors that live on the CPU on any device, :data:`HOST_ONLY`, are counted apart), and on the
device for the device's own figure.

    python benchmarks/host_syncs.py [--device cpu|cuda] [--modes off,device,upcast] [--layers 2] [--tokens 128]
        [--sites 8]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import sys
import tempfile
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "nonzero")
#: reads of tensors that live on the CPU whatever the device: no wait on an accelerator ((file, function): why)
HOST_ONLY = {("msprobe_ci/kernels/perturb.py", "jitter"): "a budget's offset into its draws, from a CPU generator",
             ("msprobe_ci/judge/pair.py", "judged_as"): "a Python scalar rounded to the dtype on the CPU"}


class Reads:
    """Counts the Python-level host reads of tensor values while active (see the module docstring)."""

    def __init__(self):
        self.count = 0  # reads that wait for an accelerator
        self.host = 0  # reads of tensors on the CPU whatever the device (HOST_ONLY)
        self.by_kind: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self.active = False
        self._depth = 0
        self._saved: list = []


    def _wrap(self, owner, name: str, test=None):
        orig = getattr(owner, name)
        reads = self

        def counted(*args, **kwargs):
            if reads.active and reads._depth == 0 and (test is None or test(args)):
                site = _site()
                reads.sites[site] += 1
                if _host_only(site) is None:
                    reads.count += 1
                    reads.by_kind[name] += 1
                else:
                    reads.host += 1
            reads._depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                reads._depth -= 1
        self._saved.append((owner, name, orig))
        setattr(owner, name, counted)

    def install(self) -> None:
        for name in _READS:
            self._wrap(torch.Tensor, name)
        self._wrap(torch, "equal")
        self._wrap(torch, "nonzero")
        self._wrap(torch, "masked_select")

        def boolean_index(args) -> bool:
            idx = args[1] if len(args) > 1 else None
            idx = idx if isinstance(idx, tuple) else (idx,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        self._wrap(torch.Tensor, "__getitem__", boolean_index)

    def uninstall(self) -> None:
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)
        self._saved.clear()


def _site(depth: int = 40) -> str:
    """The innermost frame of this project (msprobe_ci/, checkers/) that led here."""
    for fr in reversed(traceback.extract_stack(limit=depth)):
        path = fr.filename
        if path.startswith(_HERE) and "/benchmarks/" not in path and "site-packages" not in path:
            return f"{os.path.relpath(path, _HERE)}:{fr.lineno} {fr.name}"
    return "(the model or torch)"


#: the budget's models of the CPU's half-precision kernels that hold their terms in bf16/fp16
#: (``kernels.perturb.CPU_HALF_HELD``, for a target on the CPU only): their ATen ops are counted apart, as no
#: accelerator's target runs them
HELD_MODELS = ("_stats_rounded", "_saved_rounded", "_gate_rounded", "_rows", "_in_order", "_cascade", "_held")


#: ATen ops that are no view yet launch no kernel: a 0-d tensor made on the CPU (a Python scalar an op takes)
_NO_KERNEL = {torch.ops.aten.scalar_tensor.default, torch.ops.aten.lift_fresh.default}


class Launches(TorchDispatchMode):
    """Counts the ATen ops dispatched while active: on an accelerator each is a kernel launch, a few microseconds of
    host time whatever its size (the model's own and the capture's alike); ``held``: those of them dispatched inside
    :data:`HELD_MODELS`."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.n = self.held = 0
        self.in_held = 0
        self.sites: collections.Counter | None = collections.Counter() if sites else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in _NO_KERNEL:
            self.n += 1
            self.held += self.in_held > 0
            if self.sites is not None:
                self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def marking_held(self):
        """While active, the ops of :data:`HELD_MODELS` are counted in :attr:`held` as well."""
        from msprobe_ci.kernels.perturb import Perturb

        saved = {name: getattr(Perturb, name) for name in HELD_MODELS if hasattr(Perturb, name)}
        launches = self

        def marked(orig):
            def run(*args, **kwargs):
                launches.in_held += 1
                try:
                    return orig(*args, **kwargs)
                finally:
                    launches.in_held -= 1
            return run
        for name, orig in saved.items():
            setattr(Perturb, name, marked(orig))
        try:
            yield self
        finally:
            for name, orig in saved.items():
                setattr(Perturb, name, orig)


def _plain_launches(model, batch, device: str) -> int:
    """The ATen ops of one plain bf16 step of ``model`` (no capture), counted."""
    import copy

    m = copy.deepcopy(model).to(device, torch.bfloat16)
    inputs = {k: v.to(device) for k, v in batch.items()}
    m(**inputs).loss.backward()  # warm
    m.zero_grad(set_to_none=True)
    with Launches() as launches:
        m(**inputs).loss.backward()
    return launches.n


def _host_only(site: str) -> str | None:
    """Why a read at ``site`` (``path:line function``) waits for no device, or ``None``."""
    path, _, rest = site.partition(":")
    return HOST_ONLY.get((path, rest.partition(" ")[2]))


def _model(layers: int, tokens: int):
    import transformers

    torch.manual_seed(11)
    cfg = transformers.GPT2Config(n_layer=layers, n_positions=max(1024, tokens))
    cfg._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(12))
    return model, {"input_ids": ids, "labels": ids}


def _judged(folder: str) -> tuple[int, int]:
    """``(records, judged)``: the dump's records and the isolation records judged on their own inputs (pass,
    warning or error; skips left out)."""
    import json

    from msprobe_ci.compare.isolation_file import load_isolation

    with open(os.path.join(folder, "dump.json")) as fh:
        records = len(json.load(fh)["data"])
    iso = load_isolation(folder) or {}
    return records, sum(1 for r in iso.values() if r.status != "skip")


def measure(mode: str, device: str, layers: int, tokens: int, reads: Reads, launch_sites: bool = False) -> dict:
    """One captured target step (``mode``: ``off`` for capture alone, else the isolation's bench kernel), after
    an uncounted one of the same kind (kernels loaded, caches warm)."""
    from msprobe_ci.backends import Backend
    from msprobe_ci.check import run_side
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    model, batch = _model(layers, tokens)
    plain = _plain_launches(model, batch, device)
    target = Backend.from_options(device, "bf16")
    bench = Backend.from_options(device, "fp32")
    tmp = tempfile.mkdtemp(prefix="host-syncs-")
    cuda = device.startswith("cuda")
    try:
        out = {}
        for counted in (False, True):
            iso = None if mode == "off" else Isolator(
                target_device=target.torch_device, bench_device=bench.torch_device, bench_kernel=mode,
                **target.oracle_options("target"))
            cfg = DumpConfig(task="statistics", level="mix", dump_path=os.path.join(tmp, f"t{int(counted)}"))
            syncs = 0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda and counted:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                reads.active = counted
                launches = Launches(sites=counted and launch_sites)
                try:
                    with launches, launches.marking_held():
                        side = run_side(model, (batch,), lambda o: o.loss, target, cfg, isolator=iso)
                finally:
                    reads.active = False
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
                syncs = sum(1 for w in caught if "synchroniz" in str(w.message))
            if counted:
                records, judged = _judged(side.folder)
                out = {"records": records, "judged": judged, "reads": reads.count, "host": reads.host,
                       "syncs": syncs if cuda else None, "launches": launches.n - plain, "held": launches.held,
                       "launch_sites": launches.sites}
            else:
                reads.count = reads.host = 0
                reads.by_kind.clear()
                reads.sites.clear()
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--modes", default="off,device,upcast", help="off (capture alone) and/or bench kernels")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sites", type=int, default=8, help="the lines that read most, per mode (0: none)")
    ap.add_argument("--launch-sites", type=int, default=0, help="the lines of this project that dispatch the most "
                    "ATen ops, per mode (slow: a stack walk per op)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    card = torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU"
    print(f"GPT-2, {a.layers} blocks, 1 x {a.tokens} tokens, bf16 target, mix, statistics, on {a.device} ({card}); "
          f"torch {torch.__version__}")
    reads = Reads()
    reads.install()
    try:
        for mode in a.modes.split(","):
            r = measure(mode, a.device, a.layers, a.tokens, reads, a.launch_sites > 0)
            label = "capture alone" if mode == "off" else f"isolation, {mode} bench"
            per_rec = r["reads"] / max(r["records"], 1)
            judged = f", {r['reads'] / r['judged']:.2f} per judged call ({r['judged']} judged)" if r["judged"] else ""
            sync = f"; CUDA synchronising ops {r['syncs']} ({r['syncs'] / max(r['records'], 1):.2f} per record)" \
                if r["syncs"] is not None else ""
            print(f"{label:>26}: {r['records']} records, {r['reads']} host reads ({per_rec:.2f} per record"
                  f"{judged}){sync}; {r['host']} more of CPU tensors; ATen ops beyond the plain step's "
                  f"{r['launches']} ({r['launches'] / max(r['records'], 1):.1f} per record)")
            if r["held"]:
                rest = r["launches"] - r["held"]
                print(f"{'':>28}of which {r['held']} model the CPU's half kernels that hold their terms (a CPU "
                      f"target's budgets only): {rest} ({rest / max(r['records'], 1):.1f} per record"
                      + (f", {rest / r['judged']:.1f} per judged call" if r["judged"] else "") + ") elsewhere")
            kinds = ", ".join(f"{k} {v}" for k, v in reads.by_kind.most_common())
            print(f"{'':>28}by kind: {kinds or 'none'}")
            for site, n in reads.sites.most_common(a.sites):
                why = _host_only(site)
                print(f"{n:>34}  {site}" + (f"  (on the CPU on any device: {why})" if why else ""))
            if r["launch_sites"]:
                print(f"{'':>28}ATen ops by line:")
                for site, n in r["launch_sites"].most_common(a.launch_sites):
                    print(f"{n:>34}  {site}")
    finally:
        reads.uninstall()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
