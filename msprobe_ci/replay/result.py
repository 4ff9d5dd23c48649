"""The verdict of one replayed API call: :class:`ApiResult`, what the per-API reports, the JUnit writer and the
reproductions read."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checkers import CheckResult


@dataclass
class ApiResult:
    """Verdict of one API call in one direction.

    Attributes:
        name: dump name, e.g. ``Functional.linear.0.forward``.
        status: ``pass`` / ``warning`` / ``error`` / ``skip``.
        outputs: ``[(row name, CheckResult)]`` per compared output.
        reason: why it was skipped (empty otherwise).
        info: ``{row: (oracle dtype, target dtype, shape)}`` for the details CSV.
        autocast: for a call made under autocast, the dtype its inputs were replayed in and how that is known
            (``bfloat16 (recorded)``, ``float16 (inferred)``: :func:`msprobe_ci.amp.of_entry`); empty otherwise.
        replay: on an error, what reproduces it (see the field).
    """

    name: str
    status: str
    outputs: list[tuple[str, CheckResult]] = field(default_factory=list)
    reason: str = ""
    info: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    autocast: str = ""
    #: what reproduces a failing verdict without the dump (kept on an error only): the inputs as they were judged,
    #: the recorded target outputs (``None``: the target ran live), a backward's upstream gradient and which inputs
    #: needed grad (written by :func:`msprobe_ci.replay.repro.write`)
    replay: dict | None = field(default=None, repr=False)

    @property
    def message(self) -> str:
        if self.status == "skip":
            return self.reason
        amp = f" [autocast: inputs replayed in {self.autocast}]" if self.autocast else ""
        bad = [(n, r) for n, r in self.outputs if r.status in ("error", "warning")]
        if not bad:
            return f"{len(self.outputs)} output(s) pass{amp}"
        n, r = bad[0]
        return f"{n}: {r.standard} {r.status}: {r.message}{amp}"
