"""Capture of torch.distributed communication ops as ``Distributed.<op>.<N>.forward`` entries.

Collectives do not reach ``__torch_function__``, so while a capture session runs, the functions below are replaced
on ``torch.distributed`` and ``torch.distributed.distributed_c10d`` by wrappers (as msprobe wraps them) and put
back when it stops. An entry is laid out as msprobe lays it out (``shared/spec/dump-format.md`` §4.1, §7.2):

* ``input_args`` / ``input_kwargs``: the arguments **before** the op (an in-place collective overwrites them);
* ``output``: the arguments and keyword values **after** the op (``args + kwargs values``), so an ``all_reduce``
  output lists the reduced tensor and its ``ReduceOp``;
* a process group is ``{"type": "torch.ProcessGroup", "group_ranks": [...], "group_id": "<crc32>"}``, a reduce op
  ``{"type": "torch.distributed.ReduceOp", "value": "RedOpType.SUM"}``; ``src``/``dst`` are plain ints.

With ``async_op=True`` the output is recorded when the returned work is waited on (the call's own record holds
the pre-op values until then). Communication ops have no backward entry and are not replayed from a dump; the
live isolation judges the collectives :mod:`msprobe_ci.isolate.collectives` lists.

The functional collectives of ``torch.distributed._functional_collectives`` (:data:`FUNCTIONAL_OPS`), which DTensor
redistribution and ``torch.compile``-friendly code call, are recorded under the same names
(``Distributed.all_reduce``, ``Distributed.all_gather_single`` ...): they are out of place, so their ``output`` is
the returned tensor (waited for), and their ``group`` (ranks, a DeviceMesh, ``(mesh, dim)``, a group name) is
recorded as the process group it resolves to.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

#: the torch.distributed functions recorded (msprobe's ``distributed`` wrap list, the ones torch still has)
OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
       "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather",
       "scatter", "send", "recv", "isend", "irecv", "all_to_all", "all_to_all_single", "barrier",
       "batch_isend_irecv")
_NOT_RECORDED_ARGS = ("all_gather_object",)
#: the functional (out-of-place) collectives recorded
FUNCTIONAL_OPS = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor",
                  "reduce_scatter_single", "all_to_all_single", "broadcast")


def encode_group(group: Any) -> dict:
    """msprobe's record of a process group (the default group when ``None``)."""
    import torch.distributed as dist

    try:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except Exception:  # noqa: BLE001 - a group object this torch cannot describe
        ranks = []
    return {"type": "torch.ProcessGroup", "group_ranks": list(ranks),
            "group_id": format(zlib.crc32(str(list(ranks)).encode()), "08x")}


class _Work:
    """The async work an op returned, recording the op's output again when waited on."""

    def __init__(self, work: Any, on_done: Callable[[], None]):
        self._work, self._on_done = work, on_done

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        done, self._on_done = self._on_done, None
        if done is not None:
            done()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommPatch:
    """Replaces the communication functions while a session records; :meth:`remove` puts the originals back.

    Args:
        on_call: ``on_call(op, func, args, kwargs)`` runs the op and records it (the session's method).
    """

    def __init__(self, on_call: Callable[[str, Callable, tuple, dict], Any]):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self._saved: list[tuple[Any, str, Any]] = []
        wrappers: dict[int, Callable] = {}
        for module in (dist, c10d):
            for op in OPS:
                orig = getattr(module, op, None)
                if orig is None or getattr(orig, "_msprobe_ci_original", None) is not None:
                    continue
                if id(orig) not in wrappers:
                    wrappers[id(orig)] = _wrapper(op, orig, on_call)
                self._saved.append((module, op, orig))
                setattr(module, op, wrappers[id(orig)])
        try:
            import torch.distributed._functional_collectives as funcol
        except ImportError:  # an older torch
            return
        for op in FUNCTIONAL_OPS:
            orig = getattr(funcol, op, None)
            if orig is None or getattr(orig, "_msprobe_ci_original", None) is not None:
                continue
            self._saved.append((funcol, op, orig))
            setattr(funcol, op, _wrapper(op, orig, on_call, functional=True))

    def remove(self) -> None:
        for module, op, orig in reversed(self._saved):
            setattr(module, op, orig)
        self._saved.clear()


def _wrapper(op: str, orig: Callable, on_call: Callable, functional: bool = False) -> Callable:
    if functional:
        def wrapper(*args, **kwargs):
            return on_call(op, orig, args, kwargs, functional=True)
    else:
        def wrapper(*args, **kwargs):
            return on_call(op, orig, args, kwargs)

    wrapper.__name__ = getattr(orig, "__name__", op)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper._msprobe_ci_original = orig  # type: ignore[attr-defined]
    return wrapper


def resolve_group(group: Any) -> Any:
    """The ProcessGroup a functional collective's ``group`` argument names (ranks, DeviceMesh, ``(mesh, dim)``,
    group name), or ``None`` when this torch cannot say."""
    try:
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        return c10d._resolve_process_group(funcol._resolve_group_name(group))
    except Exception:  # noqa: BLE001 - private helpers that differ across torch versions
        return None


def wrap_work(work: Any, on_done: Callable[[], None]) -> Any:
    """``work`` (a ``torch.distributed.Work`` or None) whose ``wait()`` also calls ``on_done`` once."""
    if work is None or not hasattr(work, "wait"):
        return work
    return _Work(work, on_done)


def group_of(args: tuple, kwargs: dict) -> Any:
    """The process group a torch.distributed collective was called with (``None``: the default group)."""
    import torch.distributed as dist

    g = kwargs.get("group")
    if g is None:
        g = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return g


def resolved_groups(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A functional collective's arguments with its ``group`` (ranks, DeviceMesh, ``(mesh, dim)``, a name)
    replaced by the ProcessGroup it names, for the record (the call itself gets the original arguments)."""
    import inspect

    if "group" in kwargs:
        pg = resolve_group(kwargs["group"])
        return args, (dict(kwargs, group=pg) if pg is not None else kwargs)
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return args, kwargs
    if "group" in params and params.index("group") < len(args):
        i = params.index("group")
        pg = resolve_group(args[i])
        if pg is not None:
            return args[:i] + (pg,) + args[i + 1:], kwargs
    return args, kwargs
