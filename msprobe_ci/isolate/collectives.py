"""Isolation of communication ops: a collective judged on the inputs every rank of its group gave it.

A collective computes nothing a single device can replay: its output on a rank depends on every rank's input. So
after the call, the target side gathers the inputs of the group (one extra ``all_gather_into_tensor`` of each
rank's input on the same group, issued at the same point of the program on every rank, so the ranks stay in step)
and judges the rank's own output against

* the **oracle**: the reduction of the gathered inputs in float64 (``SUM``, ``AVG``, ``PRODUCT``, ``MAX``,
  ``MIN``; an all-gather's output is its gathered inputs);
* the **same-dtype bench**: the same reduction in the output's dtype, one rank at a time in rank order, each
  partial result rounded (what gloo, and a ring reduction, do); an ``AVG`` divided and rounded once more;
* its **error scale** (:mod:`msprobe_ci.kernels`): the random walk of those roundings, the RMS of one rounding of
  each partial sum (``sqrt(sum_k partial_k^2) / sqrt(3)``);

by the benchmark standard at level L0, relative to the output's largest magnitude, as a gradient is judged
(:func:`msprobe_ci.judge.judge_pair` with ``backward=True``): a reduced gradient shard that one rank
scaled by 2% is named at the collective, on that rank.

Judged: ``all_reduce``, ``reduce_scatter_tensor``, ``reduce_scatter_single`` (FSDP2's gradient reduce-scatter),
``all_gather_into_tensor``, ``all_gather_single`` (FSDP2's parameter all-gather). Other collectives (lists of
tensors, point-to-point, ``broadcast``) keep their named skip. Cost: the gathered inputs, ``world_size`` times one
rank's input, on the rank's device, for the duration of the judgement.
"""

from __future__ import annotations

import math

import torch

#: collective -> its output argument and its input argument, each ``(position, keyword)``; the input ``None``
#: where the output is also the input (an ``all_reduce`` reads the tensor it writes: the caller snapshots it)
JUDGED = {"all_reduce": ((0, "tensor"), None),
          "reduce_scatter_tensor": ((0, "output"), (1, "input")),
          "reduce_scatter_single": ((0, "output"), (1, "input")),
          "all_gather_into_tensor": ((0, "output_tensor"), (1, "input_tensor")),
          "all_gather_single": ((0, "output_tensor"), (1, "input_tensor"))}


def _arg(where: tuple, args: tuple, kwargs: dict) -> torch.Tensor | None:
    pos, key = where
    t = args[pos] if len(args) > pos else kwargs.get(key)
    return t if isinstance(t, torch.Tensor) else None


def output_of(op: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor a judged collective writes its result into (``None`` for other ops)."""
    return _arg(JUDGED[op][0], args, kwargs) if op in JUDGED else None


def input_of(op: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor a judged collective reads, before the call (an ``all_reduce``'s is its output)."""
    if op not in JUDGED:
        return None
    return _arg(JUDGED[op][1] or JUDGED[op][0], args, kwargs)


def _reduce_op(args: tuple, kwargs: dict, op: str) -> str:
    import torch.distributed as dist

    red = kwargs.get("op")
    if red is None:
        pos = {"all_reduce": 1, "reduce_scatter_tensor": 2, "reduce_scatter_single": 2}.get(op)
        red = args[pos] if pos is not None and len(args) > pos else dist.ReduceOp.SUM
    return str(red).rsplit(".", 1)[-1].upper()


def references(op: str, red: str, gathered: torch.Tensor, world: int, rank: int, dtype: torch.dtype):
    """``(oracle, bench, scale)`` of one rank's output of collective ``op`` with reduce op ``red`` (``SUM``,
    ``AVG``, ``PRODUCT``, ``MAX``, ``MIN``) from the group's inputs ``gathered`` (``world`` inputs concatenated,
    rank order): float64 oracle, the rank-order reduction in ``dtype`` (the bench), the error scale (float64).

    Raises:
        ValueError: a reduce op other than those.
    """
    chunks = gathered.reshape(world, -1)
    if op.startswith("all_gather"):
        flat = chunks.reshape(-1)
        return flat.to(torch.float64), flat.to(dtype), torch.zeros_like(flat, dtype=torch.float64)
    if op.startswith("reduce_scatter"):
        n = chunks.shape[1] // world
        chunks = chunks[:, rank * n:(rank + 1) * n]
    x64 = chunks.to(torch.float64)
    partial = chunks[0].to(dtype)
    sq = torch.zeros_like(x64[0])
    if red in ("SUM", "AVG"):
        oracle = x64.sum(0)
        for k in range(1, world):
            partial = (partial.to(torch.float64) + x64[k]).to(dtype)
            sq += partial.to(torch.float64) ** 2
        if red == "AVG":
            oracle = oracle / world
            partial = (partial.to(torch.float64) / world).to(dtype)
            sq += partial.to(torch.float64) ** 2
    elif red == "PRODUCT":
        oracle = x64.prod(0)
        for k in range(1, world):
            partial = (partial.to(torch.float64) * x64[k]).to(dtype)
            sq += partial.to(torch.float64) ** 2
    elif red in ("MAX", "MIN"):
        oracle = x64.amax(0) if red == "MAX" else x64.amin(0)
        partial = oracle.to(dtype)
    else:
        raise ValueError(f"reduce op {red}")
    return oracle, partial, sq.sqrt() / math.sqrt(3.0)


class CollectiveIsolation:
    """The communication half of an :class:`~msprobe_ci.isolate.Isolator` (see the module docstring).

    Args:
        refs: the settings and the judge's device (:class:`~.references.References`).
        records: where each verdict is kept (:class:`~.records.Records`).
        loans: what the driving capture lends (:class:`~.records.Loans`: the reproducer).
    """

    def __init__(self, refs, records, loans):
        self.refs, self.records, self.loans = refs, records, loans

    def judge_collective(self, name: str, op: str, args: tuple, kwargs: dict, before: torch.Tensor | None,
                         group) -> None:
        """Judge collective ``name`` (``Distributed.<op>.<N>.forward``) after it completed: its output in
        ``args``/``kwargs``, its input (``before``: a copy taken before an in-place ``all_reduce``), ``group`` its
        process group (``None``: the default group). Every rank of the group must call this at the same point."""
        import torch.distributed as dist

        from ..judge import judge_pair

        out = output_of(op, args, kwargs)
        inp = before if before is not None else input_of(op, args, kwargs)
        if out is None or inp is None or not out.is_floating_point():
            self.records.skip(name, f"Distributed.{op}: no floating input and output tensor to judge")
            return
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        gathered = torch.empty((world * inp.numel(),), dtype=inp.dtype, device=inp.device)
        # all_gather_single where torch has it (2.13 deprecates all_gather_into_tensor for it)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, inp.detach().contiguous().reshape(-1), group=group)
        red = _reduce_op(args, kwargs, op)
        try:
            oracle, bench, scale = references(op, red, gathered, world, rank, out.dtype)
        except ValueError:
            self.records.skip(name, f"Distributed.{op}: reduce op {red} has no reference")
            return
        t = out.detach().reshape(-1)
        if t.shape != oracle.shape:
            self.records.skip(name, f"Distributed.{op}: output of {t.numel()} elements, its inputs reduce to "
                                    f"{oracle.numel()}")
            return
        oracle, bench, t = (self.refs.judged(x) for x in (oracle, bench, t))
        res = judge_pair(op, t, bench, oracle, True, self.refs.standards, self.refs.thresholds,
                         terms=lambda: scale.reshape(t.shape))
        row = f"{name}.output.0"
        self.records.store(name, [(row, res)], {row: oracle})
        self.records.results[name]["collective"] = {"op": red, "world_size": world, "rank_in_group": rank}
        record = self.records.results[name]
        if self.loans.reproducer is not None and record.get("status") == "error":
            coll = {"op": op, "reduce_op": red, "world_size": world, "rank_in_group": rank}
            self.loans.reproducer.write_collective(self.refs, name, coll, gathered, list(inp.shape), out, record)
