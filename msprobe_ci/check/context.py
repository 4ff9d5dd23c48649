"""What a check needs from around it: where its folders go, what the run decided, a baseline being recorded.

The pytest plugin builds one :class:`CheckContext` per test from its session (folders under ``--msprobe-out``,
locked per test); a script or another front end builds its own. The modes (:mod:`msprobe_ci.check`) read it and
never pytest's objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import MsprobeError


class DeviceAbsent(MsprobeError):
    """A side's device is not on this machine: the check compared nothing. The pytest plugin skips the test
    (listing it in the summary) or, with ``--msprobe-require-device``, fails it.

    Attributes:
        row: the check's summary row so far (test, index, folder, sides), published with ``skipped``.
    """

    def __init__(self, message: str, row: dict):
        super().__init__(message)
        self.row = row


def check_available(backend, row: dict) -> None:
    """Raise :class:`~msprobe_ci.check.context.DeviceAbsent` (carrying ``row``) where ``backend``'s device is not
    on this machine."""
    try:
        backend.check_available()
    except MsprobeError as exc:
        raise DeviceAbsent(str(exc), row) from None


@dataclass
class CheckContext:
    """One test's checks: their folders, graphs, baseline and the run-wide choices around them.

    Attributes:
        nodeid: the test's id (names its folders and its baseline).
        test_dir: returns the test's folder, created (and, in the plugin, locked) at the first check.
        graph_dir: ``graph_dir(index)``, the folder of a check's ``.vis.db``; ``None``: no graphs.
        dump_config: the run's msprobe ``config.json`` (:class:`~msprobe_ci.config.DumpConfig`) or ``None``.
        faults: the run's fault plan (``--msprobe-inject``), applied to the target; inject_path: its file.
        baseline: ``--msprobe-baseline`` (a folder) or ``None``; record: store the bench there, compare nothing.
        require_coverage: target work outside every captured API fails the check instead of warning.
        checks: how many checks the test started so far (the next one's index).
    """

    nodeid: str
    test_dir: Callable[[], str]
    graph_dir: Callable[[int], str] | None = None
    dump_config: Any = None
    faults: tuple = ()
    inject_path: str | None = None
    baseline: str | None = None
    record: bool = False
    require_coverage: bool = False
    checks: int = 0
    _base: str = field(default="", repr=False)
    _recording: Any = field(default=None, repr=False)

    def next_check(self) -> tuple[int, str]:
        """The next check's index and folder, ``<test folder>/check<index>`` (the folder is not created).

        Raises:
            MsprobeError: the test folder cannot be made ours (see :func:`msprobe_ci.outputs.owned_dir`).
        """
        base = self.test_dir() if self.checks == 0 else self._base
        self._base = base
        index = self.checks
        self.checks += 1
        return index, os.path.join(base, f"check{index}")

    def capture_config(self, task: str, level: str, dump_path: str):
        """The capture config of one side: the run's ``config.json`` (if any) with this check's task, level and
        dump path (``md5`` is a summary mode of the statistics task)."""
        from ..config import DumpConfig

        base = self.dump_config or DumpConfig()
        summary = "md5" if task == "md5" else base.summary_mode
        return base.with_overrides(task="tensor" if task == "tensor" else "statistics", level=level,
                                   summary_mode=summary, dump_path=dump_path)

    def recording(self, bench_device: str, bench_dtype: str | None, task: str, level: str, seed: int):
        """The test's baseline :class:`~msprobe_ci.baseline.Recording`, created at its first check and moved into
        place by :meth:`finish`."""
        if self._recording is None:
            from ..baseline import Recording, new_manifest

            manifest = new_manifest(self.nodeid, bench_device=bench_device, bench_dtype=bench_dtype, task=task,
                                    level=level, seed=seed)
            self._recording = Recording(self.baseline, self.nodeid, manifest)
        return self._recording

    def finish(self) -> None:
        """Move a recorded baseline into place (nothing is stored for a test that recorded no check)."""
        if self._recording is not None:
            if self._recording.checks:
                self._recording.commit()
            else:
                self._recording.discard()
            self._recording = None
