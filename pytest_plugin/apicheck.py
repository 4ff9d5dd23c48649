"""``--msprobe-api-check PATH``: every API call of a dump as a pytest item, judged by its own standard.

PATH is a dump.json, a rank folder or a step folder (every rank). Items are named by the dump name
(``Functional.linear.0.forward``), one per forward and one per backward, so ``-k``, ``--lf``, ``-n N`` and
``--junitxml`` work as for any test. error → failed; warning → passed with a ``msprobe.status=warning`` property
and a summary line; unjudgeable → skipped with the reason. A failing item writes a standalone reproduction
(:mod:`msprobe_ci.replay.repro`) under ``<msprobe-out>/api-check/<dump folder>/repro/`` and names it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from .session import API_CHECK_DIR, session_key

STATUS_PROPERTY = "msprobe.status"
#: the property naming a failing item's reproduction (``repro/<node>.py``, or why none was written)
REPRO_PROPERTY = "msprobe.repro"


class ApiCheckFailure(Exception):
    """An API whose verdict is error."""


class ApiDumpFile(pytest.File):
    """A dump.json as a collector of API items."""

    replayer: Any = None

    def collect(self):
        from ..dump.reader import load_dump
        from ..errors import MsprobeError
        from ..replay.runner import ApiReplayer

        session = self.config.stash[session_key]
        try:
            dump = load_dump(str(self.path))
        except MsprobeError as exc:
            raise self.CollectError(f"msprobe: {exc}") from None
        session.validate_files()
        run = session.check_options  # the run's options (the command line over ini)
        device = "cpu"
        if session.api_live:
            from ..backends import Backend

            backend = Backend.from_options(run["target"], run["target_dtype"])
            try:
                backend.check_available()
                device = backend.torch_device
            except MsprobeError as exc:
                raise self.CollectError(f"msprobe: --msprobe-api-live on --msprobe-target: {exc}") from None
        from ..kernels import default_bench_kernel

        kernel = run["bench_kernel"] or default_bench_kernel("cpu", device, run["target"] if session.api_live else "cpu")
        self.replayer = ApiReplayer(dump, live=session.api_live, standards=run["api_standards"],
                                    thresholds=run["api_thresholds"], faults=session.faults, target_device=device,
                                    bench_kernel=kernel)
        for name in self.replayer.api_names():
            yield ApiItem.from_parent(self, name=name)


class ApiItem(pytest.Item):
    """One API call in one direction."""

    def runtest(self) -> None:
        result = self.parent.replayer.check(self.name)
        self.user_properties.append((STATUS_PROPERTY, result.status))
        for row, r in result.outputs:
            self.user_properties.append((f"msprobe.{row}", f"{r.standard} {r.status}: {r.message}"))
        if result.status == "skip":
            try:  # report the skip at the item, not at this file
                raise pytest.skip.Exception(result.reason, _use_item_location=True)
            except TypeError:  # pragma: no cover - older pytest
                pytest.skip(result.reason)
        session = self.config.stash[session_key]
        if result.status == "error":
            from ..replay.repro import write

            repro = write(result, self.parent.replayer, self.repro_folder(session))
            self.user_properties.append((REPRO_PROPERTY, repro))
            raise ApiCheckFailure(f"{result.message}; reproduction: {repro}")
        if session.fuzz > 0 and self.name.endswith(".forward"):
            from ..replay.fuzz import fuzz_api

            failed, repro = fuzz_api(self.parent.replayer, self.name, session.fuzz, self.repro_folder(session))
            self.user_properties.append(("msprobe.fuzz_examples", session.fuzz))
            if failed is not None:
                self.user_properties.append((REPRO_PROPERTY, repro))
                raise ApiCheckFailure(f"fuzzing ({session.fuzz} examples) found a failing input: {failed.message}; "
                                      f"minimal reproduction: {repro}")

    def repro_folder(self, session) -> str:
        """``<msprobe-out>/api-check/<the dump's folder, relative to --msprobe-api-check>/repro``: where this
        item's reproduction goes (``api-check`` is emptied once per run, at the session's start)."""
        rel = os.path.relpath(os.path.dirname(str(self.path)), session.api_root)
        return os.path.join(session.out, API_CHECK_DIR, rel, "repro")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ApiCheckFailure):
            return f"msprobe: {self.name}: {excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, 0, f"api-check: {self.name}"

