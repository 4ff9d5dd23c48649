"""The first divergence over many ranks: which rank's own computation went wrong first.

Each (step, rank) pair is compared on its own (isolated verdicts where the target has ``isolation.json``). Ranks
then exchange data only through communication ops, so a rank's first divergence happened in its *communication
epoch*: the number of ``Distributed.*`` calls before it in the rank's dump. A rank whose first divergence is a
collective whose own inputs agree with the bench did not compute anything wrong: it **received** a diverged
tensor, from the ranks of the collective's group whose inputs to the same call diverged. It names the collective
and those source ranks instead of blaming itself.

The answer is the earliest own divergence: the smallest (step, epoch), then the lowest rank (within one epoch ranks
run concurrently; the lowest rank is reported and the others are listed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..dump import names

COMM_PREFIX = "Distributed."


@dataclass(frozen=True)
class RankDivergence:
    """One rank's first divergence.

    Attributes:
        step, rank: where.
        node: the node's verdict (a :class:`~msprobe_ci.compare.verdict.CompareResult`).
        epoch: communication ops before it on this rank.
        received_from: ``(collective name, source ranks)`` when the rank only received diverged data.
        repro: the command that re-runs the node alone where the capture wrote its reproduction, else ''.
    """

    step: int
    rank: int
    node: Any
    epoch: int
    received_from: tuple[str, tuple[int, ...]] | None = None
    repro: str = ""

    @property
    def where(self) -> str:
        return f"step{self.step} rank{self.rank} {self.node.name}"

    @property
    def message(self) -> str:
        if self.received_from is not None:
            coll, srcs = self.received_from
            src = ", ".join(f"rank{r}" for r in srcs) or "another rank"
            return f"{self.where}: received diverged data through {coll} from {src}"
        detail = self.node.message.split(": ", 1)[-1] if self.node.message else self.node.status
        return f"{self.where}: {detail}"


@dataclass(frozen=True)
class CrossRankResult:
    """Every rank's first divergence and the one that came first (``first``; None when all ranks agree)."""

    first: RankDivergence | None
    ranks: tuple[RankDivergence, ...] = field(default_factory=tuple)

    @property
    def headline(self) -> str:
        """``first divergence: ...`` (one line), and where the first one's reproduction was written, the command
        that re-runs it alone on a second line."""
        if self.first is None:
            return "first divergence: none"
        line = f"first divergence: {self.first.message}"
        if self.first.repro and self.first.received_from is None:
            line += ("\nreproduce this call alone, without the model (--no-fault leaves an injected fault out): "
                     + self.first.repro)
        return line


def _group_ranks(entry: dict) -> tuple[int, ...] | None:
    """The ranks of a collective's process group, from its recorded ``group`` argument (None: the default group,
    every rank)."""
    values = list(entry.get("input_args") or []) + list((entry.get("input_kwargs") or {}).values())
    for v in values:
        if isinstance(v, dict) and v.get("type") == "torch.ProcessGroup" and v.get("group_ranks"):
            return tuple(int(r) for r in v["group_ranks"])
    return None


def _diverged_inputs(report) -> frozenset[str]:
    """The communication nodes one of whose inputs diverged from the bench (beyond the drift rule's budget)."""
    from .verdict import unit_roundoff

    th = report.thresholds
    out = set()
    for rr in report.rows:
        name = rr.target.entry
        if rr.target.side != "input" or rr.bench is None or name in out or not name.startswith(COMM_PREFIX):
            continue
        u = unit_roundoff(rr.target.dtype, rr.bench.dtype)
        if rr.error > th.error_factor * (th.round_factor * u + th.rel_floor):
            out.add(name)
    return frozenset(out)


def _epoch(dump, node_name: str) -> int:
    n = 0
    for key in dump.data:
        if key == node_name:
            return n
        if key.startswith(COMM_PREFIX):
            n += 1
    return n


@dataclass(frozen=True)
class RankSummary:
    """What the cross-rank answer needs of one compared (step, rank): small enough to come back from a worker
    process instead of the whole report and dump.

    Attributes:
        step, rank: where.
        first: the rank's first divergence (a :class:`~msprobe_ci.compare.verdict.CompareResult`), or None.
        epoch: communication ops before ``first`` in the rank's dump.
        group: the recorded process group of ``first`` when it is a collective (None: every rank).
        comm_names: the rank's communication nodes.
        diverged_inputs: those whose inputs diverged from the bench.
        repro: the command that re-runs ``first`` alone where the capture wrote its reproduction, else ''.
    """

    step: int
    rank: int
    first: Any
    epoch: int = 0
    group: tuple[int, ...] | None = None
    comm_names: frozenset[str] = frozenset()
    diverged_inputs: frozenset[str] = frozenset()
    repro: str = ""


def summarize(step: int, rank: int, report, dump) -> RankSummary:
    """The :class:`RankSummary` of one compared pair (``report``: its CompareReport; ``dump``: the target Dump)."""
    first = report.first_divergence
    comm = frozenset(k for k in dump.data if k.startswith(COMM_PREFIX))
    if first is None:
        return RankSummary(step, rank, None, comm_names=comm, diverged_inputs=_diverged_inputs(report))
    from ..outputs import repro_command

    entry = dump.data.get(first.name)
    group = _group_ranks(entry) if isinstance(entry, dict) and first.name.startswith(COMM_PREFIX) else None
    return RankSummary(step, rank, first, _epoch(dump, first.name), group, comm, _diverged_inputs(report),
                       repro_command(getattr(dump, "folder", None), first.name, report))


def first_divergence_across_ranks(compared) -> CrossRankResult:
    """Find the first own divergence over ranks.

    Args:
        compared: a :class:`RankSummary` per compared pair (any order), or ``{(step, rank): (report, target
            dump)}``.
    """
    if isinstance(compared, dict):
        compared = [summarize(step, rank, report, dump) for (step, rank), (report, dump) in compared.items()]
    by_key = {(s.step, s.rank): s for s in compared}
    world_by_step: dict[int, list[int]] = {}
    for step, rank in by_key:
        world_by_step.setdefault(step, []).append(rank)
    found: list[RankDivergence] = []
    for (step, rank), s in sorted(by_key.items()):
        node = s.first
        if node is None:
            continue
        received = None
        if node.name.startswith(COMM_PREFIX) and node.name not in s.diverged_inputs:
            p = names.parse(node.name, any_prefix=True)
            group = s.group if s.group is not None else tuple(sorted(world_by_step[step]))
            sources = []
            for other in group:
                o = by_key.get((step, other))
                if other == rank or o is None or p is None:
                    continue
                if node.name in o.comm_names and node.name in o.diverged_inputs:
                    sources.append(other)
            if sources:
                received = (node.name, tuple(sources))
        found.append(RankDivergence(step, rank, node, s.epoch, received, s.repro))
    own = [d for d in found if d.received_from is None]
    pool = own or found
    first = min(pool, key=lambda d: (d.step, d.epoch, d.rank)) if pool else None
    return CrossRankResult(first, tuple(found))
