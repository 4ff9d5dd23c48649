"""Bench baselines: record the bench side once (on a GPU runner), replay it where only the target runs (an NPU
runner), in the record/compare workflow of pytest-regressions.

Layout under the baseline root ``DIR``, one folder per test id (the id sanitised as for ``--msprobe-out``)::

    DIR/<test>/manifest.json
    DIR/<test>/check0/step0/rank/{dump.json, stack.json, construct.json[, dump_tensor_data/]}
    DIR/<test>/check1/...

Each ``check{i}`` is an msprobe dump root, so ``msprobe compare`` and ``msprobe-ci compare`` read it as it is.
``manifest.json`` (format version 1) says what was recorded and where::

    {"format_version": 1, "test": "<node id>", "bench": {"device": "cuda", "dtype": "fp32"},
     "task": "statistics", "level": "mix", "seed": 1234,
     "versions": {"torch": "2.13.0", "torch_npu": null, "msprobe_ci": "0.1.0"},
     "commit": "<git sha or null>", "date": "<UTC ISO 8601>",
     "checks": [{"index": 0, "dump": "check0/step0/rank", "bytes": 48213}]}

A test's folder is written under a temporary name and renamed into place when the test ends, so a reader (or an
xdist worker) never sees half a baseline and a failed re-record leaves the previous one intact.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import subprocess
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

from .errors import MsprobeError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class BaselineWarning(UserWarning):
    """The baseline was recorded with another bench (device, dtype, task or level) than the one requested."""


def folder_for_test(nodeid: str) -> str:
    """File-system-safe folder name for a pytest node id (also used for ``--msprobe-out``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:150]



def folder_bytes(path: str) -> int:
    """Total size in bytes of the regular files under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _git_commit() -> str | None:
    for var in ("GITHUB_SHA", "CI_COMMIT_SHA"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def runtime_versions() -> dict[str, str | None]:
    """Versions of torch, torch_npu (``None`` when absent; never imported here) and msprobe-ci."""
    from importlib import metadata

    from . import __version__

    def dist(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"torch": dist("torch"), "torch_npu": dist("torch_npu") or dist("torch-npu"), "msprobe_ci": __version__}


@dataclass
class Recording:
    """One test's baseline being recorded: a staging folder renamed into place by :meth:`commit`."""

    root: str
    nodeid: str
    manifest: dict[str, Any]
    staging: str = ""
    checks: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        self.staging = os.path.join(self.root, f".staging-{folder_for_test(self.nodeid)}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.staging)

    def check_dir(self, index: int) -> str:
        """The dump root for check ``index`` (pass it as the capture's ``dump_path``)."""
        return os.path.join(self.staging, f"check{index}")

    def add_check(self, index: int, rank_folder: str) -> int:
        """Register check ``index`` whose dump was written to ``rank_folder``; returns its size in bytes."""
        size = folder_bytes(os.path.join(self.staging, f"check{index}"))
        rel = os.path.relpath(rank_folder, self.staging).replace(os.sep, "/")
        self.checks.append({"index": index, "dump": rel, "bytes": size})
        return size

    def commit(self) -> str:
        """Write the manifest and move the folder into place (replacing an older baseline); returns the path."""
        final = os.path.join(self.root, folder_for_test(self.nodeid))
        manifest = dict(self.manifest, checks=sorted(self.checks, key=lambda c: c["index"]))
        with open(os.path.join(self.staging, MANIFEST), "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
        old = None
        if os.path.exists(final):
            old = f"{final}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(self.staging, final)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def new_manifest(nodeid: str, *, bench_device: str, bench_dtype: str | None, task: str, level: str,
                 seed: int) -> dict[str, Any]:
    """The manifest fields known before any check runs (``checks`` is added at commit)."""
    return {
        "format_version": FORMAT_VERSION, "test": nodeid,
        "bench": {"device": bench_device, "dtype": bench_dtype},
        "task": task, "level": level, "seed": seed,
        "versions": runtime_versions(), "commit": _git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    }


def record_command(nodeid: str, root: str, bench_device: str, bench_dtype: str | None) -> str:
    """The command line that (re-)records the baseline of one test."""
    cmd = f"pytest '{nodeid}' --msprobe-baseline={root} --msprobe-record --msprobe-bench={bench_device}"
    return cmd + (f" --msprobe-bench-dtype={bench_dtype}" if bench_dtype else "")


@dataclass(frozen=True)
class StoredCheck:
    """A recorded bench dump ready for replay."""

    rank_folder: str
    bytes: int
    manifest: dict[str, Any]


def load_check(root: str, nodeid: str, index: int, *, bench_device: str, bench_dtype: str | None,
               task: str, level: str) -> StoredCheck:
    """Find the bench dump of check ``index`` of test ``nodeid`` under ``root``.

    Warns with :class:`BaselineWarning` when the manifest's bench device/dtype, task or level differ from the
    requested ones.

    Raises:
        MsprobeError: the baseline is missing (the message gives the command that records it), or its manifest is
            unreadable, of another format version, for another test, or names a dump folder that is not there.
    """
    folder = os.path.join(root, folder_for_test(nodeid))
    how = f"record it with: {record_command(nodeid, root, bench_device, bench_dtype)}"
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        raise MsprobeError(f"no baseline for {nodeid} in {root}; {how}")
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise MsprobeError(f"{path}: baseline manifest missing; {how}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MsprobeError(f"{path}: baseline manifest is not valid JSON ({exc}); {how}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("checks"), list):
        raise MsprobeError(f"{path}: baseline manifest must be an object with a 'checks' list; {how}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise MsprobeError(f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}; "
                           f"{how}")
    if manifest.get("test") != nodeid:
        raise MsprobeError(f"{path}: baseline belongs to test {manifest.get('test')!r}, not {nodeid!r}; {how}")
    entry = next((c for c in manifest["checks"] if isinstance(c, dict) and c.get("index") == index), None)
    if entry is None or not isinstance(entry.get("dump"), str):
        raise MsprobeError(f"{path}: no recorded check {index} (the test calls msprobe.check more often than when "
                           f"it was recorded); {how}")
    base = os.path.abspath(folder)
    rank_folder = os.path.abspath(os.path.join(base, entry["dump"]))
    if not rank_folder.startswith(base + os.sep):
        raise MsprobeError(f"{path}: checks[{index}].dump {entry['dump']!r} points outside the baseline folder")
    if not os.path.isfile(os.path.join(rank_folder, "dump.json")):
        raise MsprobeError(f"{rank_folder}: dump.json missing from the baseline; {how}")
    bench = manifest.get("bench") or {}
    wanted = {"device": bench_device, "dtype": bench_dtype, "task": task, "level": level}
    got = {"device": bench.get("device"), "dtype": bench.get("dtype"), "task": manifest.get("task"),
           "level": manifest.get("level")}
    diff = [f"{k} {got[k]!r} (requested {wanted[k]!r})" for k in wanted if got[k] != wanted[k]]
    if diff:
        warnings.warn(BaselineWarning(f"msprobe: baseline {folder} was recorded with {', '.join(diff)}; "
                                      f"the baseline's task and level are used. {how.replace('record', 're-record', 1)}"),
                      stacklevel=3)
    return StoredCheck(rank_folder, int(entry.get("bytes") or folder_bytes(rank_folder)), manifest)
