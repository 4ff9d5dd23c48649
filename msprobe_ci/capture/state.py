"""The capture engine's own state: what one step records (:class:`StepState`), and the switch that tells the
model's torch calls from the machinery's (:class:`Machinery`)."""

from __future__ import annotations

from typing import Any

from .records import RecordBuilder


class StepState:
    """Everything one step of a capture records, replaced whole at each step (``CaptureSession.step``).

    Attributes:
        data: ``dump.json``'s ``data``: ``{node name: record}`` in recording order.
        construct: ``construct.json``: ``{node name: parent module node or None}``.
        stacks: ``{call stack frames: [node names]}`` (``stack.json``).
        api_counts, module_counts: the next call index per ``{Prefix}.{api}.`` / ``Module.{path}.{Class}.forward.``.
        builder: the step's :class:`~.records.RecordBuilder` (statistics, tensor files).
        fwd_stack, bwd_stack: the module calls running now (forward) / whose backward runs now.
        pending_fwd: ``{id(module): [module calls begun, not yet returned]}``.
        pgrad: ``{Module.<path>.<Class>.parameters_grad: [first parameter, entries made, current entry name]}``.
        in_scope, scope_done: the ``scope`` filter's position (:meth:`CaptureSession.keep`).
        folder_checked: the step's folder was checked to hold no dump yet (``ensure_fresh_dir``).
        dirty: something was recorded since the last flush.
    """

    __slots__ = ("data", "construct", "stacks", "api_counts", "module_counts", "builder", "fwd_stack", "bwd_stack",
                 "pending_fwd", "pgrad", "in_scope", "scope_done", "folder_checked", "dirty")

    def __init__(self, summary_mode: str, scoped: bool):
        self.data: dict[str, Any] = {}
        self.construct: dict[str, Any] = {}
        self.stacks: dict[tuple, list[str]] = {}
        self.api_counts: dict[str, int] = {}
        self.module_counts: dict[str, int] = {}
        self.builder = RecordBuilder(summary_mode)
        self.fwd_stack: list[str] = []
        self.bwd_stack: list[str] = []
        self.pending_fwd: dict[int, list] = {}
        self.pgrad: dict[str, list] = {}
        self.in_scope = not scoped
        self.scope_done = False
        self.folder_checked = False
        self.dirty = False


class Machinery:
    """``with machinery:`` around the capture's own work (statistics, isolation, the writer, fault kernels): the
    torch calls made inside are not the model's, neither recorded nor counted. The blocks nest; the outermost one
    steps the coverage mode (where one counts) off the dispatch stack and back. One instance per capture (no
    allocation per use).

    Attributes:
        busy: True inside a block: every hook of the capture lets the call through unrecorded.
    """

    __slots__ = ("busy", "_was", "coverage")

    def __init__(self, coverage: Any = None):
        self.busy = False
        self._was: list[bool] = []
        self.coverage = coverage  # a capture.coverage.Coverage, or None

    def __enter__(self) -> None:
        self._was.append(self.busy)
        if not self.busy:
            self.busy = True
            if self.coverage is not None:
                self.coverage.suspend()

    def __exit__(self, *exc) -> bool:
        if not self._was.pop():
            self.busy = False
            if self.coverage is not None:
                self.coverage.resume()
        return False
