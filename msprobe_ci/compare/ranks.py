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
    """

    step: int
    rank: int
    node: Any
    epoch: int
    received_from: tuple[str, tuple[int, ...]] | None = None

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
        return f"first divergence: {self.first.message}" if self.first else "first divergence: none"


def _group_ranks(entry: dict, world: list[int]) -> list[int]:
    """The ranks of a collective's process group, from its recorded ``group`` argument (default: every rank)."""
    values = list(entry.get("input_args") or []) + list((entry.get("input_kwargs") or {}).values())
    for v in values:
        if isinstance(v, dict) and v.get("type") == "torch.ProcessGroup" and v.get("group_ranks"):
            return [int(r) for r in v["group_ranks"]]
    return world


def _inputs_diverged(report, node_name: str) -> bool:
    from .verdict import unit_roundoff

    th = report.thresholds
    for rr in report.rows:
        if rr.target.entry != node_name or rr.target.side != "input" or rr.bench is None:
            continue
        u = unit_roundoff(rr.target.dtype, rr.bench.dtype)
        if rr.error > th.error_factor * (th.round_factor * u + th.rel_floor):
            return True
    return False


def _epoch(dump, node_name: str) -> int:
    n = 0
    for key in dump.data:
        if key == node_name:
            return n
        if key.startswith(COMM_PREFIX):
            n += 1
    return n


def first_divergence_across_ranks(compared: dict[tuple[int, int], tuple[Any, Any]]) -> CrossRankResult:
    """Find the first own divergence over ranks.

    Args:
        compared: ``{(step, rank): (report, target dump)}`` of every compared pair.
    """
    world_by_step: dict[int, list[int]] = {}
    for step, rank in compared:
        world_by_step.setdefault(step, []).append(rank)
    found: list[RankDivergence] = []
    for (step, rank), (report, dump) in sorted(compared.items()):
        node = report.first_divergence
        if node is None:
            continue
        received = None
        if node.name.startswith(COMM_PREFIX) and not _inputs_diverged(report, node.name):
            p = names.parse(node.name, any_prefix=True)
            group = _group_ranks(dump.data.get(node.name) or {}, sorted(world_by_step[step]))
            sources = []
            for other in group:
                pair = compared.get((step, other))
                if other == rank or pair is None or p is None:
                    continue
                o_report, o_dump = pair
                if node.name in o_dump.data and _inputs_diverged(o_report, node.name):
                    sources.append(other)
            if sources:
                received = (node.name, tuple(sources))
        found.append(RankDivergence(step, rank, node, _epoch(dump, node.name), received))
    own = [d for d in found if d.received_from is None]
    pool = own or found
    first = min(pool, key=lambda d: (d.step, d.epoch, d.rank)) if pool else None
    return CrossRankResult(first, tuple(found))
