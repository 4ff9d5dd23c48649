"""One status vocabulary for every verdict: a standard's result on one output, an API node of the compare, a
JUnit testcase, a check's row.

``pass``, ``warning`` and ``error`` judge; ``skip`` (nothing could be judged: the reason is in the message) and
``unmatched`` (a node with no counterpart on the other side) judge nothing, so they weigh as a pass when statuses
are combined. Torch-free: the pytest plugin and the compare read it.
"""

from __future__ import annotations

from typing import Iterable

PASS, WARNING, ERROR, SKIP, UNMATCHED = "pass", "warning", "error", "skip", "unmatched"
STATUSES = (PASS, WARNING, ERROR, SKIP, UNMATCHED)
#: how bad each status is when statuses are combined (the worst wins)
SEVERITY = {PASS: 0, SKIP: 0, UNMATCHED: 0, WARNING: 1, ERROR: 2}


def worst(statuses: Iterable[str]) -> str:
    """The worst of ``statuses``: ``error`` if any, else ``warning``, else ``pass``; ``skip`` when every one is a
    skip (or there is none: nothing was judged)."""
    judged = [s for s in statuses if s != SKIP]
    if not judged:
        return SKIP
    bad = max(judged, key=SEVERITY.__getitem__)
    return bad if SEVERITY[bad] else PASS
