"""Writing the reproduction of a failing per-API pre-check item (``--msprobe-api-check``, ``--msprobe-fuzz``).

The same three files a live gate writes (:mod:`msprobe_ci.capture.repro` describes them), in the folder the caller
names (the plugin: ``<msprobe-out>/api-check/<the dump's folder>/repro/``):

* ``<node>.safetensors``: the call's inputs as they were judged (rebuilt from the dump, fuzzed, or cast as its
  kernel saw them under autocast), a backward's upstream gradient, and the target outputs the dump recorded (none
  where the target ran live). safetensors, never pickle;
* ``<node>.json``: ``"kind": "replay"`` and everything else the verdict used: the API, which inputs needed grad,
  the autocast dtype, the replayer's settings (live or recorded, target device, bench kernel, standards, the
  budget's draws), the faults applied to a live target, the CPU thread count, and the item's own verdict;
* ``<node>.py``: ``python <node>.py`` judges that one call again through the same
  :class:`~msprobe_ci.replay.runner.ApiReplayer` path without the dump (:func:`msprobe_ci.repro.run`), prints the
  standard's metrics against their thresholds and exits 1 when it fails (0 when it passes, 2 when the files cannot
  be read).

Limits (the item says why no files were written): at most :data:`~msprobe_ci.replay.repro_files.MAX_FILES`
reproductions and :data:`~msprobe_ci.replay.repro_files.MAX_BYTES` of inputs per folder; an argument the spec cannot hold
(:func:`~msprobe_ci.replay.repro_files._encode`); dropout (random by definition).
"""

from __future__ import annotations

import glob
import json
import os

import torch

from ..outputs import file_stem
from .repro_files import _SCRIPT, MAX_BYTES, MAX_FILES, VERSION, _encode, _Unsaved

#: the ``kind`` of a replayed item's reproduction (a live gate's has none)
KIND = "replay"


def record_of(result) -> dict:
    """An :class:`~msprobe_ci.replay.result.ApiResult` as an isolation record: ``status``, ``message`` and, unless
    it passed, the verdict fields of its first row with that status (standard, metric, value, threshold, row,
    metrics: :func:`~msprobe_ci.judge.fields.verdict_fields`). The spec's ``gate`` and a re-run's record alike."""
    from ..judge.fields import verdict_fields

    bad = next(((row, c) for row, c in result.outputs if c.status == result.status), None)
    record = dict(verdict_fields(*bad)) if bad is not None and result.status != "pass" else {}
    record.update(status=result.status, message=result.message)
    return record


def write(result, replayer, folder: str) -> str:
    """Write the reproduction of ``result`` (an :class:`~msprobe_ci.replay.result.ApiResult` whose ``replay`` is
    set) into ``folder``.

    Returns:
        the script's path, or ``"not written: <why>"``. Never raises: the item's verdict stands either way.
    """
    try:
        return _write(result, replayer, folder)
    except _Unsaved as exc:
        return f"not written: {exc} cannot be saved"
    except Exception as exc:  # noqa: BLE001 - a reproduction is a by-product, never the item's failure
        return f"not written: {type(exc).__name__}: {str(exc)[:120]}"


def _write(result, replayer, folder: str) -> str:
    from safetensors.torch import save_file

    from .apis import parse_name

    r = result.replay
    if r is None:
        return f"not written: {result.name}: no failing verdict with its inputs"
    prefix, api, n, direction = parse_name(result.name)
    stem = os.path.join(folder, file_stem(result.name))
    if os.path.exists(stem + ".py"):
        return f"not written: {stem}.py exists (never overwritten)"
    written = glob.glob(os.path.join(glob.escape(folder), "*.py"))
    if len(written) >= MAX_FILES:
        return f"not written: {MAX_FILES} reproductions in {folder} already"
    tensors: dict[str, torch.Tensor] = {}
    keys: dict[int, str] = {}
    grads: dict[str, bool] = {}
    layouts: dict[str, dict] = {}

    def enc(v):
        return _encode(v, tensors, keys, grads, layouts)

    spec_args, spec_kwargs = enc(list(r["args"])), enc(dict(r["kwargs"]))
    targets = None if r["targets"] is None else [[row, enc(t)] for row, t in r["targets"]]
    extra = {}
    if direction == "backward":
        amp = r.get("autocast")
        extra = {"upstream": enc(r["upstream"]), "wants": [bool(w) for w in r["wants"]],
                 "wants_kw": {str(k): bool(w) for k, w in r["wants_kw"].items()},
                 "autocast": None if amp is None else str(amp).replace("torch.", ""),
                 "mindspore": bool(r.get("mindspore"))}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
    if size + nbytes > MAX_BYTES:
        return f"not written: its inputs ({nbytes / 2**20:.0f} MiB) pass the folder's {MAX_BYTES >> 20} MiB"
    faults = [{"api": f.api, "call": n, "direction": f.direction, "perturb": f.perturb, "value": f.value}
              for f in replayer.faults if f.matches(f"{prefix}.{api}", n, direction)] \
        if targets is None and direction == "forward" else []
    gate = record_of(result)
    spec = {
        "version": VERSION, "kind": KIND, "node": result.name, "prefix": prefix, "api": api, "call": n,
        "direction": direction, "args": spec_args, "kwargs": spec_kwargs, "layouts": layouts,
        "targets": targets, **extra,
        "threads": torch.get_num_threads(),
        "replayer": {"live": targets is None, "target_device": replayer.target_device,
                     "bench_kernel": replayer.bench_kernel, "budget_draws": replayer.budget_draws,
                     "standards": dict(replayer.standards),
                     "thresholds": {k: dict(v) for k, v in replayer.thresholds.items()}},
        "faults": faults,
        "gate": {k: gate.get(k) for k in ("status", "standard", "metric", "value", "threshold", "row", "message")},
    }
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, stem + ".safetensors")
    with open(stem + ".json", "w", encoding="utf-8") as fh:
        json.dump(spec, fh, indent=1)
    message = str(result.message).replace("\\", "/").replace('"""', "'''")
    with open(stem + ".py", "w", encoding="utf-8") as fh:
        fh.write(_SCRIPT.format(node=result.name, gate=message, name=os.path.basename(stem)))
    return stem + ".py"



def write_replayed(report, folder: str, bench_kernel: str = "device", standards: dict | None = None,
                   thresholds: dict | None = None) -> dict[str, str]:
    """Write the reproduction of every failing call a compare replayed from a tensor dump (``report.replayed``:
    :func:`msprobe_ci.compare.isolated.replay`, the dump made without isolation) into ``folder``, with the settings
    they were judged with; ``report.repros`` maps each node to its script (or why none was written). The same
    files as the per-API pre-check's: ``python <node>.py`` judges that call again without the dump."""
    from .runner import ApiReplayer

    failing = [r for r in (getattr(report, "replayed", None) or ()) if r.status == "error"]
    if not failing:
        return {}
    replayer = ApiReplayer(None, bench_kernel=bench_kernel, standards=dict(standards or {}),
                           thresholds=dict(thresholds or {}))  # the settings the calls were judged with
    repros = {r.name: write(r, replayer, folder) for r in failing}
    report.repros = dict(getattr(report, "repros", None) or {}, **repros)
    return repros
