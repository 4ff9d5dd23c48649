"""Communication nodes linked across ranks (``matched_distributed``, as msprobe's graphs fill it).

For every ``Distributed.*`` node of a multi-rank graph, the nodes of the other ranks it exchanged data with
(``shared/spec/compare-overflow-visualization.md`` §3.6):

* point to point: the k-th ``send``/``isend`` from rank r to d pairs with the k-th ``recv``/``irecv`` on d from r
  (``dst``/``src`` from the recorded arguments);
* collectives: the n-th call of the same op in the same process group (``group_ranks``, the default group being
  every rank) on each member rank; ``broadcast``/``scatter`` send from their root and ``reduce``/``gather`` receive
  at it, the rest exchange both ways.

``matched_distributed`` is ``{"communications_type": "send"|"receive"|"send_receive", "nodes_info": {"<rank>":
["<peer precision_index or overflow_level, Nan when none>", "<peer node name>"]}}``.
"""

from __future__ import annotations

from typing import Any

from ..dump import names

_P2P_SEND = ("send", "isend")
_P2P_RECV = ("recv", "irecv")
_ROOT_SENDS = ("broadcast", "scatter")
_ROOT_RECEIVES = ("reduce", "gather")


def _arg(entry: dict, key: str, pos: int) -> Any:
    kwargs = entry.get("input_kwargs") or {}
    rec = kwargs.get(key)
    if rec is None:
        args = entry.get("input_args") or []
        rec = args[pos] if len(args) > pos else None
    return rec.get("value") if isinstance(rec, dict) else None


def _group(entry: dict, world: list[int]) -> tuple[int, ...]:
    for v in list(entry.get("input_args") or []) + list((entry.get("input_kwargs") or {}).values()):
        if isinstance(v, dict) and v.get("type") == "torch.ProcessGroup" and v.get("group_ranks"):
            return tuple(int(r) for r in v["group_ranks"])
    return tuple(world)


def comm_calls(data: dict[str, Any], rank: int, world: list[int]) -> list[dict]:
    """The communication calls of one rank's dump, in order, with what linking needs."""
    out, seen = [], {}
    for name, entry in data.items():
        p = names.parse(name, any_prefix=True)
        if p is None or p.prefix != "Distributed" or p.direction != "forward" or not isinstance(entry, dict):
            continue
        op = p.api
        if op in _P2P_SEND or op in _P2P_RECV:
            peer = _arg(entry, "dst" if op in _P2P_SEND else "src", 1)
            key = ("p2p", "send" if op in _P2P_SEND else "recv", rank, peer)
        else:
            group = _group(entry, world)
            key = ("coll", op, group)
        k = seen.get(key, 0)
        seen[key] = k + 1
        out.append({"name": name, "op": op, "key": key, "n": k,
                    "root": _arg(entry, "src" if op in _ROOT_SENDS else "dst", 1)})
    return out


def link(graphs: list, data_by_key: dict[tuple[int, int], dict]) -> None:
    """Fill ``matched_distributed`` on the communication nodes of ``graphs`` (all ranks of each data source and
    step), in place. ``data_by_key``: ``{(step, rank): that rank's dump data}``."""
    by_side: dict[tuple[str, int], dict[int, Any]] = {}
    for g in graphs:
        by_side.setdefault((g.data_source, g.step), {})[g.rank] = g
    for (source, step), ranks in by_side.items():
        if len(ranks) < 2:
            continue
        world = sorted(ranks)
        calls = {r: comm_calls(data_by_key.get((step, r), {}), r, world) for r in world}
        index = {(r, c["key"], c["n"]): c for r in world for c in calls[r]}

        def info(rank: int, call: dict) -> list[str]:
            node = ranks[rank].nodes.get(call["name"])
            if node is None:
                return ["Nan", call["name"]]
            level = node.overflow_level if node.overflow_level is not None else node.precision_index
            return ["Nan" if level is None else str(level), call["name"]]

        for r in world:
            for c in calls[r]:
                node = ranks[r].nodes.get(c["name"])
                if node is None:
                    continue
                kind, peers = "send_receive", {}
                if c["key"][0] == "p2p":
                    _, direction, _, peer = c["key"]
                    if not isinstance(peer, int) or peer not in ranks:
                        continue
                    twin = index.get((peer, ("p2p", "recv" if direction == "send" else "send", peer, r), c["n"]))
                    kind = "send" if direction == "send" else "receive"
                    if twin is not None:
                        peers[peer] = info(peer, twin)
                else:
                    _, op, group = c["key"]
                    for other in group:
                        twin = index.get((other, c["key"], c["n"])) if other != r and other in ranks else None
                        if twin is not None:
                            peers[other] = info(other, twin)
                    if op in _ROOT_SENDS + _ROOT_RECEIVES and isinstance(c["root"], int):
                        at_root = c["root"] == r
                        kind = ("send" if at_root else "receive") if op in _ROOT_SENDS else \
                            ("receive" if at_root else "send")
                if peers:
                    node.matched_distributed = {"communications_type": kind,
                                                "nodes_info": {str(k): v for k, v in sorted(peers.items())}}
