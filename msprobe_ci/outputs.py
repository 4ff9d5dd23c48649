"""Where msprobe-ci writes, and the rules that keep user files safe.

One rule everywhere: **never overwrite or delete anything msprobe-ci did not create, and never write an output
onto an input.**

* Folders msprobe-ci owns carry a marker file (:data:`MARKER`); only a marked folder is ever emptied and replaced
  (:func:`owned_dir`). A non-empty folder without it is refused.
* An output file that already exists is replaced only when it is one of ours by content (a JUnit XML report,
  :func:`is_junit`), and never when it is one of the run's inputs (:func:`check_output_file`).
* Timestamped outputs are reserved with an ``O_EXCL`` claim file (:func:`reserve`) and written through a
  temporary file unique to the process (:func:`atomic_write`), so two runs writing into one folder never collide
  or overwrite each other, and a final name only ever holds a complete file.
* Per-test folders are guarded by an inter-process lock (:func:`folder_lock`, the ``filelock`` library): a second
  run of the same test into the same ``--msprobe-out`` waits instead of deleting the first run's files under it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from typing import Callable, Iterable, Iterator

from .errors import MsprobeError

MARKER = ".msprobe-ci"
LOCKS = "msprobe-ci-locks"


def check_output_dir(path: str, what: str = "output folder") -> str:
    """Validate that ``path`` is, or can become, a folder we may write into; creates nothing.

    Returns:
        The absolute path.

    Raises:
        MsprobeError: ``path`` is an existing file, or its nearest existing ancestor is not a writable folder.
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise MsprobeError(f"{path}: {what} exists and is a file, expected a folder")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise MsprobeError(f"{path}: {what} cannot be created ({probe} is a file)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise MsprobeError(f"{path}: {what} cannot be created or written ({probe} is not writable)")
    return path


def make_output_dir(path: str, what: str = "output folder") -> str:
    """:func:`check_output_dir`, then create it. Returns the absolute path; raises MsprobeError on failure."""
    path = check_output_dir(path, what)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise MsprobeError(f"{path}: {what} cannot be created ({exc.strerror})") from None
    return path


def is_junit(path: str) -> bool:
    """True when ``path`` holds a JUnit XML report (its first 4 KiB hold ``<testsuites`` or ``<testsuite``)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return b"<testsuites" in head or b"<testsuite" in head


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output_file(path: str, what: str, inputs: Iterable[str] = (),
                      replaceable: Callable[[str], bool] | None = None) -> str:
    """Validate an output file path before any work is done.

    Args:
        path: the output file.
        what: its name in messages (``--msprobe-junitxml``).
        inputs: files the run reads; the output may be none of them.
        replaceable: decides whether an existing file may be replaced (e.g. :func:`is_junit`); ``None`` refuses
            every existing file.

    Returns:
        The absolute path.

    Raises:
        MsprobeError: the path is a folder, is one of ``inputs``, exists and is not replaceable, or its folder
            cannot be created.
    """
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise MsprobeError(f"{path}: {what} is a folder, expected a file path")
    for src in inputs:
        if os.path.exists(path) and _same_file(path, src):
            raise MsprobeError(f"{path}: {what} is an input of this run; refusing to write an output onto it")
    if os.path.exists(path) and (replaceable is None or not replaceable(path)):
        raise MsprobeError(f"{path}: {what} exists and was not written by msprobe-ci; refusing to overwrite it")
    check_output_dir(os.path.dirname(path), f"folder of {what}")
    return path


def _claim(path: str) -> str:
    """The hidden claim file that holds ``path``'s name for one writer: ``.<name>.claim`` beside it."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.claim")


def reserve(out_dir: str, prefix: str, suffix: str) -> str:
    """Reserve and return ``<out_dir>/<prefix>_<YYYYmmddHHMMSS>[_N]<suffix>``, a name nobody else writes.

    msprobe's naming. The name is held by a hidden claim file (``.<name>.claim``, created with ``O_EXCL``, so
    two processes picking the same second get different names); the final file itself is **not** created: it
    appears only when the writer moves its complete temporary file there (:func:`atomic_write`,
    :func:`publish`), and :func:`release` gives the name back. A writer killed midway (``kill -9``) leaves hidden
    files only, never an empty or partial file under a final name. Creates ``out_dir``.

    Raises:
        MsprobeError: ``out_dir`` is a file or cannot be created.
    """
    out_dir = make_output_dir(out_dir)
    stamp = time.strftime("%Y%m%d%H%M%S")
    for i in range(10_000):
        path = os.path.join(out_dir, f"{prefix}_{stamp}{f'_{i}' if i else ''}{suffix}")
        if os.path.lexists(path):
            continue
        try:
            os.close(os.open(_claim(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        if os.path.lexists(path):  # published by the previous holder between our two looks
            release(path)
            continue
        return path
    raise MsprobeError(f"{out_dir}: no free name for {prefix}_{stamp}_N{suffix}")  # pragma: no cover


def release(path: str) -> None:
    """Give back the name :func:`reserve` claimed for ``path`` (nothing when it holds no claim)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_claim(path))


def publish(tmp: str, path: str) -> None:
    """Move the complete file ``tmp`` onto ``path`` (atomic within a folder) and release ``path``'s claim."""
    os.replace(tmp, path)
    release(path)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", **open_kwargs) -> Iterator:
    """Open a temporary file beside ``path`` (unique to this process) and move it onto ``path`` on success.

    Yields the open file; on an exception the temporary file is removed and ``path`` is untouched. Either way a
    name :func:`reserve` claimed for ``path`` is released. The temporary name (``.tmp-<name>-<random>``) does not
    end in ``path``'s suffix, so nothing that lists ``*.vis.db`` or ``*.csv`` picks it up.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".tmp-{os.path.basename(path)}-")
    try:
        with os.fdopen(fd, mode, **open_kwargs) as fh:
            yield fh
        publish(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        release(path)
        raise


def temp_path(path: str) -> str:
    """A fresh, unique temporary file name beside ``path`` (the file is created empty)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".tmp-{os.path.basename(path)}-")
    os.close(fd)
    return tmp


def owned_dir(path: str, note: str = "") -> str:
    """Empty and (re)create a folder msprobe-ci owns, writing :data:`MARKER` into it.

    An absent or empty folder is created; a folder holding our marker is replaced (its contents were ours);
    anything else is refused, never deleted.

    Raises:
        MsprobeError: the folder holds files and no marker, or is a file.
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise MsprobeError(f"{path}: exists and is a file, expected a folder msprobe-ci may write")
    if os.path.isdir(path) and os.listdir(path):
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise MsprobeError(f"{path}: exists and was not written by msprobe-ci (no {MARKER} marker); "
                               "choose another --msprobe-out")
        trash = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".old-")
        os.replace(path, os.path.join(trash, "x"))  # atomic: nobody sees a half-deleted folder
        shutil.rmtree(trash, ignore_errors=True)
    make_output_dir(path)
    with open(os.path.join(path, MARKER), "w", encoding="utf-8") as fh:
        fh.write(note + "\n")
    return path


def folder_lock(out: str, name: str):
    """An inter-process lock (``filelock.FileLock``) for the folder ``<out>/<name>``. Lock files live in the
    system temporary folder (``<tmp>/msprobe-ci-locks/<sha1 of the folder's absolute path>.lock``), so the output
    folder holds only results."""
    import hashlib

    from filelock import FileLock

    key = hashlib.sha1(os.path.abspath(os.path.join(out, name)).encode()).hexdigest()
    folder = make_output_dir(os.path.join(tempfile.gettempdir(), LOCKS), "lock folder")
    return FileLock(os.path.join(folder, key + ".lock"))


def file_stem(node: str) -> str:
    """A node's file name stem in ``repro/`` (anything but letters, digits, ``_.-`` made ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", node)


def repro_command(folder: str | None, name: str, report=None) -> str:
    """``python <script>`` for node ``name``: the one a compare wrote for a call it replayed from a tensor dump
    (``report.repros``: :func:`msprobe_ci.replay.repro.write_replayed`), else ``<folder>/repro/<name>.py`` where
    the capture wrote it (:mod:`msprobe_ci.repro`); '' where there is none."""
    written = (getattr(report, "repros", None) or {}).get(name, "")
    if str(written).endswith(".py") and os.path.isfile(written):
        return f"python {written}"
    if not folder:
        return ""
    path = os.path.join(folder, "repro", file_stem(name) + ".py")
    return f"python {path}" if os.path.isfile(path) else ""
