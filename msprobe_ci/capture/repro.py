"""Writing a standalone reproduction beside every failing API call: ``repro/<node>.py``, its inputs and its
settings (running one: :mod:`msprobe_ci.repro`).

When isolation judges a call (or the gradients it hands back) and it fails its standard, the capture writes three
files into ``repro/`` beside the step's ``dump.json``:

* ``<node>.safetensors``: the tensors the call was given, as it was given them (an in-place call's first argument
  as it was before the call; under autocast the user's tensors, before autocast cast them), and for a backward node
  the gradients that reached its outputs. safetensors, never pickle: the file holds tensors and nothing that runs.
* ``<node>.json``: everything else the gate used: the API and its call index, the non-tensor arguments (and the
  layout of an argument that is not contiguous), which tensors required grad, the grad mode and autocast state, the
  CPU thread count (a kernel's summation order follows it), the step, the bench kernel and devices, the oracle's
  device, the standards' overrides and the error-budget draws, the faults injected into this call, and the gate's
  own verdict (to print beside the reproduction's).
* ``<node>.py``: ``python <node>.py`` re-runs that one call without the model through the same isolation the gate
  ran (:class:`~msprobe_ci.isolate.Isolator`, the same oracle, bench kernel, budget and standard), prints the
  standard's metrics against their thresholds, and exits 1 when the call fails (0 when it passes, 2 when the files
  cannot be read). ``--no-fault`` leaves an injected fault out; ``--target-device`` runs the target elsewhere.

Reading is data, never code: the API is looked up on the replay allowlist (:mod:`msprobe_ci.replay.allowlist`),
dtypes and memory formats in torch's own tables, tensors come from safetensors; nothing in the files picks a
function, a path to write or an object to unpickle.

Limits (a node that hits one gets no files, and its isolation record says why in ``repro``): at most
:data:`MAX_FILES` reproductions and :data:`MAX_BYTES` of inputs per step folder; a call whose arguments hold
something other than tensors, numbers, strings, dtypes, devices, shapes, slices and their lists, tuples and dicts
(a KV-cache object, a DTensor's local shard); dropout (random by definition).

A judged collective (:mod:`msprobe_ci.isolate.collectives`) that fails writes the same three files from what its
judgement gathered: ``inputs`` (every rank of its group's input, in rank order) and, in the spec, the collective,
its reduce op, the group's size and this rank's place in it. Its script re-runs the collective on a fresh gloo
group of that size (one process per rank, a file store in a temporary folder: no port opened), this rank's
injected fault applied as the gate applied it, and judges this rank's output as the gate did.

A call the free benchmark (:mod:`msprobe_ci.free_benchmark`) finds at risk writes them too (``"kind": "free"``):
its arguments as for a call isolation fails, and the free benchmark's mode, seed, the call's index in its step
(which seeds its bit-noise signs) and thresholds; its script re-runs the reference and the bit-noise rerun and
judges the call as the gate did.
"""

from __future__ import annotations

import json
import os

import torch

from ..outputs import file_stem
from ..replay.repro_files import CUDA_MATMUL, MAX_BYTES, MAX_FILES, VERSION, _SCRIPT, _encode, _saved, _Unsaved, \
    _Unwritten

class Reproducer:
    """Writes the reproduction of each failing call of a capture (set as an isolator's ``reproducer`` by
    :class:`~msprobe_ci.capture.CaptureSession`).

    Args:
        session: the capture session (its step folder, step, rank and faults).
    """

    def __init__(self, session):
        self.session = session
        self._written: dict[str, tuple[int, int]] = {}  # folder -> (files, bytes)

    def folder(self) -> str:
        return os.path.join(self.session.dump_folder(), "repro")

    def write(self, iso, call, direction: str, record: dict) -> None:
        """Write the files of ``call``'s failing ``direction`` (``forward``/``backward``); the script's path (or
        why none was written) goes into ``record["repro"]``. ``iso``: the isolator's settings
        (:class:`msprobe_ci.isolate.references.References`), which the reproduction rebuilds. Never raises: the
        user's run goes on."""
        _into(record, self._write, iso, call, direction, record)

    def _write(self, iso, call, direction: str, record: dict) -> str:
        from . import naming
        from ..replay import allowlist

        if call.raw is None:  # dropout, a DTensor call judged on its local shards
            return f"not written: {call.name}: its arguments were not kept for it"
        info = naming.lookup(call.func)
        if info is None or allowlist.lookup(info[0], info[1]) is not call.func:
            return f"not written: {call.name}: its function is not on the replay allowlist"
        stem_name = call.name[: -len(".forward")]
        prefix, api, n = stem_name.split(".", 1)[0], stem_name.split(".", 1)[1].rsplit(".", 1)[0], \
            int(stem_name.rsplit(".", 1)[1])
        node = f"{stem_name}.{direction}"
        tensors: dict[str, torch.Tensor] = {}
        keys: dict[int, str] = {}
        grads: dict[str, bool] = {}
        args, kwargs = call.raw
        layouts: dict[str, dict] = {}
        spec_args = _encode(list(args), tensors, keys, grads, layouts)
        spec_kwargs = _encode(dict(kwargs), tensors, keys, grads, layouts)
        grad_out = {}
        if direction == "backward":
            for i, g in sorted(call.grad_out.items()):
                key = f"g{i}"
                tensors[key], layout = _saved(g)
                if layout is not None:
                    layouts[key] = layout
                grad_out[str(i)] = key
        spec = {
            "node": node, "forward": call.name, "prefix": prefix, "api": api, "call": n,
            "direction": direction, "function": {"prefix": info[0], "api": info[1]},
            "args": spec_args, "kwargs": spec_kwargs, "requires_grad": grads, "grad_outputs": grad_out,
            "layouts": layouts,
            "grad_enabled": call.grad_enabled, "autocast": call.autocast_state,
            # whether a CUDA half GEMM may add split-K partial sums in its dtype (the bench allows it where it may)
            "cuda_matmul": {k: bool(getattr(torch.backends.cuda.matmul, k, False)) for k in CUDA_MATMUL},
            "isolator": _isolator(iso),
        }
        return self._files(node, f"{prefix}.{api}", n, direction, spec, tensors, record)

    def first_calls(self) -> dict[str, int]:
        """``{API name: its next call index}`` of each API a fault names, now: where a module's calls begin
        counting (its tape's calls are numbered from there, :mod:`msprobe_ci.replay.tape`)."""
        counts = self.session.state.api_counts
        return {api: counts.get(f"{api}.", 0) for api in self.session.fault_apis}

    @staticmethod
    def name_of(func, args: tuple):
        """How this capture names and counts a call: :func:`msprobe_ci.capture.naming.counted`."""
        from .naming import counted

        return counted(func, args)

    def faults_now(self) -> list:
        """The faults due on this rank at this step (any API, call and direction)."""
        s = self.session
        return [f for f in s.faults if f.on_rank(s.fault_rank) and (f.step is None or f.step == s.current_step)]

    def write_module(self, iso, node: str, direction: str, record: dict, build) -> None:
        """Write the reproduction of failing module node ``node`` (``Module.<path>.<Class>.<direction>.<n>``):
        ``build()`` gives its spec fields, tensors and the faults injected into its calls
        (:func:`msprobe_ci.isolate.reproduce.module_reproduction`), run only within this step's limits. The script's
        path (or why none was written) goes into ``record["repro"]``. Never raises."""
        _into(record, self._write_module, iso, node, direction, record, build)

    def _write_module(self, iso, node: str, direction: str, record: dict, build) -> str:
        files, _ = self._written.get(self.folder(), (0, 0))
        if files >= MAX_FILES:
            return f"not written: {MAX_FILES} reproductions in this step already"
        fields, tensors, faults = build()
        path_class, d, n = node.rsplit(".", 2)
        spec = {"kind": "module", "node": node, "forward": f"{path_class}.forward.{n}", "prefix": "Module",
                "api": path_class.split(".", 1)[1], "call": int(n), "direction": direction, **fields,
                "isolator": _isolator(iso)}
        return self._files(node, path_class, int(n), direction, spec, tensors, record, faults)

    def write_free(self, fb, name: str, raw: tuple, record: dict) -> None:
        """Write the reproduction of call ``name`` that the free benchmark ``fb`` judged at risk: ``raw`` is
        ``(func, prefix, api, args, kwargs, call index, autocast state)`` as its ``before`` kept them; the script
        re-runs the call's higher-precision reference and bit-noise rerun with the same seed and judges it as the
        gate did (:mod:`msprobe_ci.repro`). The script's path (or why none was written) goes into
        ``record["repro"]``. Never raises."""
        _into(record, self._write_free, fb, name, raw, record)

    def _write_free(self, fb, name: str, raw: tuple, record: dict) -> str:
        from . import naming
        from ..replay import allowlist

        func, prefix, api, args, kwargs, calls, autocast = raw
        info = naming.lookup(func)
        if info is None or allowlist.lookup(info[0], info[1]) is not func:
            return f"not written: {name}: its function is not on the replay allowlist"
        n = int(name[: -len(".forward")].rsplit(".", 1)[1])
        tensors: dict[str, torch.Tensor] = {}
        keys: dict[int, str] = {}
        grads: dict[str, bool] = {}
        layouts: dict[str, dict] = {}
        spec = {"kind": "free", "node": name, "forward": name, "prefix": prefix, "api": api, "call": n,
                "direction": "forward", "function": {"prefix": info[0], "api": info[1]},
                "args": _encode(list(args), tensors, keys, grads, layouts),
                "kwargs": _encode(dict(kwargs), tensors, keys, grads, layouts), "layouts": layouts,
                "autocast": autocast,
                "free": {"mode": fb.mode, "seed": fb.seed, "calls": int(calls),
                         "thresholds": {str(k).replace("torch.", ""): float(v) for k, v in fb.thresholds.items()}}}
        return self._files(name, f"{prefix}.{api}", n, "forward", spec, tensors, record)

    def write_collective(self, iso, name: str, collective: dict, gathered: torch.Tensor, input_shape: list,
                         output: torch.Tensor, record: dict) -> None:
        """Write the reproduction of failing collective ``name`` (``Distributed.<op>.<N>.forward``): the inputs of
        every rank of its group (``gathered``, rank order, each of ``input_shape``), what it computed on this
        rank (``output``'s shape and dtype) and ``collective`` (``op``, ``reduce_op``, ``world_size``,
        ``rank_in_group``); it re-runs on a gloo group of that size (:mod:`msprobe_ci.repro`). The script's path
        (or why none was written) goes into ``record["repro"]``. Never raises."""
        _into(record, self._write_collective, iso, name, collective, gathered, input_shape, output, record)

    def _write_collective(self, iso, name: str, collective: dict, gathered: torch.Tensor, input_shape: list,
                          output: torch.Tensor, record: dict) -> str:
        prefix, rest = name.split(".", 1)
        api, n = rest[: -len(".forward")].rsplit(".", 1)
        spec = {"kind": "collective", "node": name, "forward": name, "prefix": prefix, "api": api,
                "call": int(n), "direction": "forward",
                "collective": dict(collective, input_shape=[int(x) for x in input_shape],
                                   output_shape=list(output.shape),
                                   output_dtype=str(output.dtype).replace("torch.", "")),
                "isolator": {"standards": iso.standards, "thresholds": iso.thresholds}}
        world = int(collective["world_size"])
        inputs = gathered.detach().reshape(world, *input_shape).to("cpu", copy=True).contiguous()
        return self._files(name, f"{prefix}.{api}", int(n), "forward", spec, {"inputs": inputs}, record)

    def _files(self, node: str, api_id: str, n: int, direction: str, spec: dict, tensors: dict,
               record: dict, faults: list | None = None) -> str:
        """Write ``<node>.safetensors``, ``.json`` and ``.py`` for ``spec`` (completed here with what every kind
        holds: the step, rank, thread count, the faults injected into this call and the gate's verdict) within
        the step folder's limits; the script's path, or why nothing was written."""
        from safetensors.torch import save_file

        folder = self.folder()
        files, size = self._written.get(folder, (0, 0))
        if files >= MAX_FILES:
            return f"not written: {MAX_FILES} reproductions in this step already"
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if size + nbytes > MAX_BYTES:
            return f"not written: its inputs ({nbytes / 2**20:.0f} MiB) pass this step's {MAX_BYTES >> 20} MiB"
        session = self.session
        rank = session.fault_rank
        if faults is None:
            faults = [{"api": f.api, "call": n, "direction": f.direction, "perturb": f.perturb, "value": f.value}
                      for f in session.faults if f.matches(api_id, n, direction, session.current_step)
                      and f.on_rank(rank)]
        spec = {"version": VERSION, **spec, "step": session.current_step, "rank": rank,
                # a CPU kernel's reduction order follows its thread count (LayerNorm's weight gradient in bf16)
                "threads": torch.get_num_threads(), "faults": faults,
                "gate": {k: record.get(k) for k in ("status", "standard", "metric", "value", "threshold", "row",
                                                    "message")}}
        os.makedirs(folder, exist_ok=True)
        stem = os.path.join(folder, file_stem(node))
        if os.path.exists(stem + ".py"):
            return f"not written: {stem}.py exists (never overwritten)"
        save_file(tensors, stem + ".safetensors")
        with open(stem + ".json", "w", encoding="utf-8") as fh:
            json.dump(spec, fh, indent=1)
        gate = str(record.get("message", "")).replace("\\", "/").replace('"""', "'''")
        with open(stem + ".py", "w", encoding="utf-8") as fh:
            fh.write(_SCRIPT.format(node=node, gate=gate, name=os.path.basename(stem)))
        self._written[folder] = (files + 1, size + nbytes)
        return stem + ".py"


def _isolator(iso) -> dict:
    """The isolator's settings a reproduction rebuilds it from (``iso``:
    :class:`msprobe_ci.isolate.references.References`)."""
    return {"standards": iso.standards, "thresholds": iso.thresholds, "target_device": iso.target_device,
            "bench_device": iso.bench_device, "backward": iso.backward, "bench_kernel": iso.bench_kernel,
            "budget_draws": iso.budget_draws, "oracle_device": iso.oracle_device,
            "oracle_max": str(iso.oracle_max).replace("torch.", ""), "oracle_label": iso.oracle_label}


def _into(record: dict, write, *args) -> None:
    """``record["repro"] = write(*args)``: the script's path, or why none was written (an argument the spec
    cannot hold, anything else that went wrong): a reproduction is a by-product, never the run's failure."""
    try:
        record["repro"] = write(*args)
    except _Unsaved as exc:
        record["repro"] = f"not written: {exc} cannot be saved"
    except _Unwritten as exc:
        record["repro"] = f"not written: {exc}"
    except Exception as exc:  # noqa: BLE001 - the user's run goes on
        record["repro"] = f"not written: {type(exc).__name__}: {str(exc)[:120]}"
