"""``--msprobe-api-check PATH``: every API call of a dump as a pytest item, judged by its own standard.

PATH is a dump.json, a rank folder or a step folder (every rank). Items are named by the dump name
(``Functional.linear.0.forward``), one per forward and one per backward, so ``-k``, ``--lf``, ``-n N`` and
``--junitxml`` work as for any test. error → failed; warning → passed with a ``msprobe.status=warning`` property
and a summary line; unjudgeable → skipped with the reason.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from .session import session_key

STATUS_PROPERTY = "msprobe.status"


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
        device = "cpu"
        if session.api_live:
            from ..backends import Backend

            backend = Backend.from_options(session.target, session.target_dtype)
            try:
                backend.check_available()
                device = backend.torch_device
            except MsprobeError as exc:
                raise self.CollectError(f"msprobe: --msprobe-api-live on --msprobe-target: {exc}") from None
        from ..kernels import default_bench_kernel

        kernel = session.bench_kernel or default_bench_kernel("cpu", device, session.target if session.api_live
                                                              else "cpu")
        self.replayer = ApiReplayer(dump, live=session.api_live, standards=session.api_standards,
                                    thresholds=session.api_thresholds, faults=session.faults, target_device=device,
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
        if result.status == "error":
            raise ApiCheckFailure(result.message)
        session = self.config.stash[session_key]
        if session.fuzz > 0 and self.name.endswith(".forward"):
            from ..replay.fuzz import fuzz_api

            failed, repro = fuzz_api(self.parent.replayer, self.name, session.fuzz,
                                     os.path.join(session.out, "repro"))
            self.user_properties.append(("msprobe.fuzz_examples", session.fuzz))
            if failed is not None:
                self.user_properties.append(("msprobe.repro", repro))
                raise ApiCheckFailure(f"fuzzing ({session.fuzz} examples) found a failing input: {failed.message}; "
                                      f"minimal reproducer: {repro}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ApiCheckFailure):
            return f"msprobe: {self.name}: {excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, 0, f"api-check: {self.name}"

