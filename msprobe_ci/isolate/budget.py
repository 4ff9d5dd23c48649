"""Budgeted isolation: judge every API kind each step, and as many of the other calls as a cost factor allows,
rotating them across steps (issue 51).

Full isolation runs an oracle, a bench and an error budget beside every call: on a large job several times the
step's own cost. :class:`IsolationBudget` keeps it within ``factor`` times the capture alone:

* the first call of every API kind (``Functional.linear``, ``Tensor.__add__``) in a step is always judged;
* every other call has a *priority* in ``[0, 1)``: a hash of the rotation seed (the test id), its kind and its call
  number, moved on by the golden ratio each step (``(h + step * 0.618...) mod 1``), so every call comes round at
  the same rate and consecutive steps judge different calls; a call is judged when its priority is below the step's
  *share* and the isolation spent so far in the step is within ``(factor - 1)`` times the capture's own time so far
  (the guard that holds the factor inside one step, whatever the share);
* the share starts at ``(factor - 1) / (PRIOR_OVERHEAD - 1)`` and after each step moves by the ratio of the
  isolation time allowed to the time spent (at most doubling), so later steps judge what the factor pays for.

The gate's seed is the test id and the run's number (pytest's cache counts the sessions that ran the test, where
the cache is kept): a run rotates over its steps, the next run through another order.
Which calls are candidates is deterministic (seed, kind, call number, step); how far down the list a step goes
depends on measured time, and the step's figures say it (:meth:`IsolationBudget.summary`). A call not judged is
judged by the drift rule, as ``msprobe-ci compare`` judges plain dumps, and says so in its message.
"""

from __future__ import annotations

import math
import time
import zlib

from ..config import check_factor

#: the golden ratio's conjugate: a step moves every priority by it (a low-discrepancy rotation)
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
#: full isolation's cost over the capture alone assumed before a step is measured (the CPU figure at GPT-2 small,
#: docs/development.md: 4.1-4.7x)
PRIOR_OVERHEAD = 4.5
#: the share never falls below this: some rotation goes on even when the kinds alone spend the budget
MIN_SHARE = 0.01


class IsolationBudget:
    """Which calls of a step are isolated, within ``factor`` (see the module docstring).

    Args:
        factor: the isolated target step's time over the same step captured without isolation, at most (> 1).
        seed: the rotation's seed (the test id; any string).
        clock: seconds, monotonic (``time.perf_counter``; a test passes its own).

    Raises:
        MsprobeError: a factor that is not a number above 1.
    """

    def __init__(self, factor: float, seed: str = "", clock=time.perf_counter):
        self.factor = check_factor(factor)
        self.seed = str(seed)
        self._hash = zlib.crc32(self.seed.encode("utf-8"))
        self._clock = clock
        self.share = min(1.0, max(MIN_SHARE, (self.factor - 1.0) / (PRIOR_OVERHEAD - 1.0)))
        self._started = False
        self.start(0)

    def start(self, step: int) -> None:
        """Begin ``step``: the share moves by what the last step measured (when it judged anything)."""
        if self._started and self.spent > 0.0:
            allowed = (self.factor - 1.0) * self.capture_seconds()
            self.share = min(1.0, max(MIN_SHARE, self.share * min(2.0, allowed / self.spent)))
        self._started = True
        self.step = int(step)
        self.kinds: set[str] = set()
        self.calls = self.judged = 0
        self.spent = 0.0  # seconds of isolation work in this step
        self._t0 = self._clock()

    def priority(self, kind: str, call: int) -> float:
        """The call's place in this step's rotation, in ``[0, 1)``."""
        h = zlib.crc32(f"{kind}.{call}".encode("utf-8"), self._hash) / 2.0 ** 32
        return (h + self.step * GOLDEN) % 1.0

    def take(self, kind: str, call: int) -> bool:
        """Whether call number ``call`` of API ``kind`` is isolated in this step (counted either way)."""
        self.calls += 1
        if kind not in self.kinds:
            self.kinds.add(kind)
            self.judged += 1
            return True
        if self.priority(kind, call) >= self.share or self.spent > (self.factor - 1.0) * self.capture_seconds():
            return False
        self.judged += 1
        return True

    def add(self, seconds: float) -> None:
        """Isolation work of ``seconds`` done in this step."""
        self.spent += seconds

    def capture_seconds(self) -> float:
        """This step's time so far without its isolation work."""
        return max(0.0, self._clock() - self._t0 - self.spent)

    def reason(self) -> str:
        """Why a call was not isolated: the message of its record."""
        return (f"budgeted isolation (factor {self.factor:g}, step {self.step}, share {self.share:.0%}): not judged "
                "on its own inputs this step; the drift rule judges it, and the rotation isolates it in a later step")

    def summary(self) -> dict:
        """The step's figures: factor asked and measured, share, calls seen, judged, API kinds, seconds."""
        capture = self.capture_seconds()
        return {"factor": self.factor, "seed": self.seed, "step": self.step, "share": round(self.share, 4),
                "calls": self.calls, "judged": self.judged, "kinds": len(self.kinds),
                "isolation_seconds": round(self.spent, 6), "capture_seconds": round(capture, 6),
                "measured_factor": round((capture + self.spent) / capture, 4) if capture > 0 else None}

