"""Encoding of captured values into msprobe dump records, with statistics deferred to the flush.

A tensor record is ``{"type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad"[, "md5"]
[, "data_name"]}`` exactly as msprobe 26.2.0 writes it (``shared/spec/dump-format.md`` §7-8). Statistics are
computed on the tensor's own device as one small stacked tensor per record and fetched with **one** host transfer
per device at :meth:`RecordBuilder.resolve` (no ``.item()`` per statistic in the hot path). A tensor object seen
again unchanged (same object, same ``_version``: the output of one API is the input of the next and the output of
its module) reuses its statistics, its CRC and its CPU copy: on the benchmark block this cuts the reduced elements
per step 2.65-fold. Identity is checked through a weak reference, so a freed tensor whose ``id`` is reused is
never mistaken for the old one.

Deviations from msprobe, on purpose: the Mean and Norm of a floating tensor are computed so that they cannot
overflow (:func:`_sum_and_norm`): a finite tensor has finite statistics wherever the value is representable (msprobe sums in the tensor's dtype, so an fp32 tensor of ``-1e38`` masks gets ``Mean -inf`` and
``Norm inf``, which its overflow check then reports); fp16/bf16 values are upcast to float32 for Max/Min/Norm
(msprobe keeps the tensor's own dtype, which rounds a bf16 Norm to 3 significant digits and would blur the
comparison); fp64 tensors get all four statistics (msprobe writes ``null`` for Mean/Norm there). An integer or
boolean tensor of more than one element also gets ``digest`` (an extra field msprobe ignores): 8 hex digits of a
positional checksum of its elements, computed on its device with the statistics (:meth:`RecordBuilder._digest`). Its Max and Min
cannot tell two index tensors apart (an MoE router that sent one token of 32 to another expert has the same
extremes); the digest can, so a compare can say where the target *decided* otherwise than the bench.
"""

from __future__ import annotations

import math
import threading
import weakref
import zlib
from typing import Any

import torch

from .._perf import reads_wait

_LOW_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
SCRATCH = 1 << 22  # elements: half tensors up to this size are upcast into RecordBuilder's buffer (16 MiB)
_ALL4 = ("Max", "Min", "Mean", "Norm")
_NORM_SQ = "Norm^2"  # a statistic fetched as the sum of squares: Norm is its square root, taken at resolve()
_ALL4_SQ = ("Max", "Min", "Mean", _NORM_SQ)
_DIGEST = "digest"
_DECIDED = ("Max", "Min", _DIGEST)  # an integer or boolean tensor: its extremes and its digest, fetched as int64


class RecordBuilder:
    """Turns Python/torch values into JSON-ready records for one step.

    Args:
        summary_mode: ``statistics`` or ``md5`` (adds ``"md5"``: CRC-32 of the raw bytes, 8 lowercase hex digits,
            computed as ``zlib.crc32`` of the contiguous CPU copy, as msprobe).
        keep_tensors: when true, records get a ``data_name`` and a detached CPU copy is kept for saving.
    """

    def __init__(self, summary_mode: str = "statistics"):
        self.md5 = summary_mode == "md5"
        self._pending: list[tuple[dict, torch.Tensor]] = []
        self.tensors: dict[str, torch.Tensor] = {}
        # id(tensor) -> (weakref, _version, stats stack or None, md5 or None, cpu copy or None)
        self._seen: dict[int, list] = {}
        # (storage address, storage offset, numel, dtype, _version) of a dense tensor -> (weakref, stats): another
        # tensor object over the same elements (a view, a module's output re-wrapped) reuses the statistics
        self._dense: dict[tuple, tuple] = {}
        self._scratch: torch.Tensor | None = None  # float32 upcasts of CPU half tensors (see _upcast)
        self._scratch_lock = threading.Lock()  # held while the buffer is in use (another thread takes .float())
        self._weights: dict = {}  # device -> the digest's int32 weights (_digest)

    # -- tensors ---------------------------------------------------------------------------------------------
    def tensor(self, t: torch.Tensor, data_name: str | None = None) -> dict:
        """Record one tensor; ``data_name`` (a file name) also keeps a CPU copy for ``dump_tensor_data/``.
        A DTensor is recorded as this rank's local shard (shape and statistics), as every other rank's tensors
        are; merging ranks (:mod:`msprobe_ci.compare.merge`) puts the shards back together."""
        placement = None
        if type(t) is not torch.Tensor and hasattr(t, "_local_tensor") and hasattr(t, "placements"):
            # where the shard sits in the whole (extra fields msprobe ignores): placements and the global shape
            placement = {"placements": [repr(p) for p in t.placements], "global_shape": list(t.shape)}
            t = t._local_tensor
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return self._subclass(t, data_name)
        rec: dict[str, Any] = {
            "type": "torch.Tensor",
            "dtype": str(t.dtype),
            "shape": list(t.shape),
            "Max": None, "Min": None, "Mean": None, "Norm": None,
            "requires_grad": bool(t.requires_grad),
        }
        if placement is not None:
            rec.update(placement)
        src = t
        version = _version(src)
        hit = self._seen.get(id(src))
        if hit is not None and version is not None and hit[0]() is src and hit[1] == version:
            if hit[2] is not None:
                self._pending.append((rec, hit[2]))
            if self.md5:
                if hit[3] is None:
                    hit[3] = crc32_hex(src.detach())
                rec["md5"] = hit[3]
            if data_name is not None:
                rec["data_name"] = data_name
                if hit[4] is None:
                    hit[4] = src.detach().to("cpu", copy=True).contiguous()
                self.tensors[data_name] = hit[4]
            return rec
        t = t.detach()
        numel = t.numel()
        stats = None
        key = flat = None
        if numel and t.device.type != "meta" and version is not None:
            key, flat = _dense_key(t, version)
            known = self._dense.get(key) if key is not None else None
            if known is not None and _holds(known[0](), key):
                # the same elements in memory, unchanged since (the storage is alive while that tensor is):
                # statistics are order-free, so any view over exactly them has the same ones
                stats = known[1]
                numel = 0
        if numel and t.device.type != "meta":
            st = flat if flat is not None else t  # a permuted dense view is reduced in memory order (fast)
            dt = t.dtype
            if t.dim() == 0:
                v = st.float() if dt in _LOW_FLOATS else st.clone()  # a copy: an in-place op (all_reduce) may follow
                stats = (_ALL4, (v, v, v, v), None)
            elif dt in _LOW_FLOATS and reads_wait(st):
                # on an accelerator the cost is the host's, per kernel launched, not the bytes read: one aminmax
                # and two reductions accumulating in float64 (finite for any finite fp32 tensor: its squares reach
                # 1.2e77 of float64's 1.8e308), in the tensor's own dtype, no upcast copy, no scaled pass and no
                # host read (4 launches against 13 for a bf16 tensor through the CPU's path)
                mn, mx = torch.aminmax(st)
                stats = (_ALL4, (mx, mn, st.sum(dtype=torch.float64),
                                 torch.linalg.vector_norm(st, dtype=torch.float64)), numel)
            elif dt.is_floating_point:
                # amax/amin rather than aminmax: 3x faster on contiguous fp32 and 20x on transposed views
                # (CPU, torch 2.13); half types are upcast once, which beats four reductions in bf16. Mean is
                # the sum divided by numel on the host at resolve() (one kernel fewer per tensor).
                scratch = dt not in (torch.float32, torch.float64) and st.device.type == "cpu" and \
                    numel <= SCRATCH and st.is_contiguous() and self._scratch_lock.acquire(blocking=False)
                try:
                    w = st if dt in (torch.float32, torch.float64) else self._upcast(st) if scratch else st.float()
                    mx, mn = w.amax(), w.amin()
                    total, norm, divisor, squared = _sum_and_norm(w, dt, mx, mn, numel)
                finally:
                    if scratch:
                        self._scratch_lock.release()
                stats = (_ALL4_SQ if squared else _ALL4, (mx, mn, total, norm), divisor)
            elif dt == torch.bool:
                stats = (_DECIDED, (st.any().long(), st.all().long(), self._digest(st)), None)
            elif not dt.is_complex:
                mn, mx = torch.aminmax(st)
                stats = (_DECIDED, (mx.long(), mn.long(), self._digest(st)), None)
            else:
                a = st.abs()
                stats = (_ALL4[:3], (a.amax(), a.amin(), a.sum()), numel)
        if stats is not None:
            self._pending.append((rec, stats))
            if key is not None and key not in self._dense:
                self._dense[key] = (weakref.ref(src), stats)
        md5 = copy = None
        if self.md5:
            md5 = rec["md5"] = crc32_hex(t)
        if data_name is not None:
            rec["data_name"] = data_name
            copy = self.tensors[data_name] = t.to("cpu", copy=True).contiguous()
        if version is not None:
            self._seen[id(src)] = [weakref.ref(src), version, stats, md5, copy]
        return rec

    def _subclass(self, t: torch.Tensor, data_name: str | None) -> dict:
        """The record of a tensor subclass (other than DTensor): a scaled FP8 one (torchao's float8 training
        tensors) by the values it stands for (:func:`msprobe_ci.kernels.scaled_fp8_values`, in float32), with its
        storage format in ``fp8_dtype`` (an extra field msprobe ignores); any other by its own statistics where its
        ops give them, else shape only (its statistics ``None``): never an error in the user's run."""
        from ..kernels import scaled_fp8_values

        values = scaled_fp8_values(t, torch.float32)
        if values is not None:
            rec = self.tensor(values.to(t.dtype) if t.dtype != torch.float32 else values, data_name)
            rec["requires_grad"] = bool(t.requires_grad)
            rec["fp8_dtype"] = str(t._data.dtype)
            return rec
        try:
            with torch._C.DisableTorchFunctionSubclass():
                plain = t.as_subclass(torch.Tensor) if hasattr(t, "as_subclass") else t
            if plain.data_ptr() == 0:  # a wrapper with no storage of its own
                raise RuntimeError("no storage")
            return self.tensor(plain, data_name)
        except Exception:  # noqa: BLE001 - its ops may refuse ours: the shape, never a crash
            rec = self.shape_only(t)
            rec["type"] = "torch.Tensor"
            return rec

    def shape_only(self, t: torch.Tensor) -> dict:
        """The record of a tensor whose values mean nothing yet (a collective's output buffer before the call:
        uninitialised memory): type, dtype, shape, ``None`` statistics."""
        return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(getattr(t, "_local_tensor", t).shape),
                "Max": None, "Min": None, "Mean": None, "Norm": None, "requires_grad": bool(t.requires_grad)}

    def _digest(self, t: torch.Tensor) -> torch.Tensor:
        """A 0-d int64 tensor on ``t``'s device holding ``sum_i x_i * w_i`` over its elements in memory order,
        ``w_i = (i + 1) * 40503``, in int32 arithmetic that wraps (elements wider than 32 bits enter by their low
        32). Integer addition is exact and associative modulo 2^32, so every device and every reduction order gets
        the same number; changing one element, or swapping two unequal ones, changes it (the weights are distinct
        modulo 2^32). In int32 it costs less than the ``any``/``all`` of a boolean mask (0.4 against 1.7 ms for a
        1024 x 1024 causal mask on one CPU thread). The weights are kept per device and grown as needed."""
        flat = t.reshape(-1)
        n = flat.numel()
        w = self._weights.get(flat.device)
        if w is None or w.numel() < n:
            w = torch.arange(1, max(n, 1 << 12) + 1, dtype=torch.int32, device=flat.device).mul_(40503)
            self._weights[flat.device] = w
        # a copy (never the caller's tensor, even an int32 one), weighted in place
        return flat.to(torch.int32, copy=True).mul_(w[:n]).sum(dtype=torch.int32).long()

    def _upcast(self, t: torch.Tensor) -> torch.Tensor:
        """``t.float()`` (a contiguous CPU half tensor of at most :data:`SCRATCH` elements) written into one
        float32 buffer kept for the step: the same values in the same layout, so the same statistics, without a
        fresh allocation per tensor (each one mapped and faulted in under the capture's heap bound: 5.5 ms for a
        3M-element bf16 tensor against 1.0 ms here). The buffer grows to the largest such tensor, at most 16 MiB.
        The result is only read by the statistics taken right after."""
        n = t.numel()
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = torch.empty(max(n, 1 << 16), dtype=torch.float32)
        w = self._scratch[:n].view(t.shape)
        w.copy_(t)
        return w

    def resolve(self) -> None:
        """Fetch every pending statistic into its record: one ``torch.stack`` and one host transfer per device
        and dtype for the whole step."""
        groups: dict[tuple, list[tuple[dict, tuple]]] = {}
        for rec, st in self._pending:
            first = st[1][0]
            groups.setdefault((first.device, first.dtype), []).append((rec, st))
        self._pending = []
        self._seen.clear()
        self._dense.clear()
        for items in groups.values():
            values = torch.stack([x for _, st in items for x in st[1]]).tolist()
            i = 0
            for rec, (fields, tensors, numel) in items:
                for field, x in zip(fields, values[i:i + len(tensors)]):
                    if field is _NORM_SQ:
                        rec["Norm"] = math.sqrt(x) if x >= 0 else x  # inf stays inf, NaN stays NaN
                    elif field is _DIGEST:
                        rec["digest"] = f"{x & 0xFFFFFFFF:08x}"
                    elif fields is _DECIDED and rec["dtype"] == "torch.bool":
                        rec[field] = bool(x)  # fetched as int64 with the digest, written as msprobe does
                    else:
                        rec[field] = x
                i += len(tensors)
                if numel is not None and rec["Mean"] is not None:
                    rec["Mean"] = rec["Mean"] / numel

    def forget(self, value: Any) -> None:
        """Drop cached statistics of the tensors in ``value`` (by object and by storage range): a collective
        writes them in place without bumping their version counter, so the caches could not tell."""
        if isinstance(value, torch.Tensor):
            self._seen.pop(id(value), None)
            version = _version(value)
            if version is not None and value.numel():
                key, _ = _dense_key(value, version)
                self._dense.pop(key, None)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self.forget(v)
        elif isinstance(value, dict):
            for v in value.values():
                self.forget(v)

    # -- everything else --------------------------------------------------------------------------------------
    def value(self, v: Any, name: str | None, key: str | None = None) -> Any:
        """Encode any argument or output; ``name`` is the data_name stem (``None``: no tensor file)."""
        if isinstance(v, torch.Tensor):
            return self.tensor(v, f"{name}.pt" if name is not None else None)
        if v is None:
            return None
        if isinstance(v, bool):
            return {"type": "bool", "value": v}
        if isinstance(v, (int, float, str)):
            return {"type": type(v).__name__, "value": v}
        if isinstance(v, torch.Size):
            return {"type": "torch.Size", "value": list(v)}
        if isinstance(v, slice):
            return {"type": "slice", "value": [_int_or_none(v.start), _int_or_none(v.stop), _int_or_none(v.step)]}
        if v is Ellipsis:
            return {"type": "ellipsis", "value": "..."}
        if isinstance(v, torch.dtype):
            return {"type": "torch.dtype", "value": str(v)} if key in ("dtype", "output_dtype") else {}
        if isinstance(v, torch.device):
            return {"type": "torch.device", "value": f"{v.type}:{v.index}"} if key == "device" else {}
        if isinstance(v, torch.memory_format):
            return {"type": "torch.memory_format", "format": str(v).split(".")[-1]}
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            return {f: self.value(x, _join(name, f), f) for f, x in zip(v._fields, v)}
        if isinstance(v, (list, tuple)):
            return [self.value(x, _join(name, i)) for i, x in enumerate(v)]
        if isinstance(v, dict):
            return {str(k): self.value(x, _join(name, k), str(k)) for k, x in v.items()}
        if hasattr(v, "to_tuple") and hasattr(v, "keys"):  # transformers ModelOutput
            return {str(k): self.value(v[k], _join(name, k), str(k)) for k in v.keys()}
        if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0:
            return {"type": type(v).__name__, "value": v.item()}
        return None


def _sum_and_norm(w: torch.Tensor, dtype: torch.dtype, mx: torch.Tensor, mn: torch.Tensor, numel: int):
    """``(sum, norm, divisor, squared)`` of ``w`` (``dtype``: the recorded tensor's; Mean = sum / divisor at
    resolve, or the Mean itself where the divisor is None; ``squared``: ``norm`` is the sum of squares, its square
    root taken at resolve), finite wherever every element is finite and the statistic itself is representable.

    A contiguous CPU tensor's sum of squares is one BLAS dot product of it with itself (1.5-2x faster than
    ``vector_norm`` on one thread, ``benchmarks/capture_overhead.py``), safe from overflow by the same bound.

    Summed and squared in its own dtype, as msprobe does, an fp32 tensor of ``-1e38`` masks has ``Mean -inf`` and
    ``Norm inf``. Where that could happen (``s^2 * numel`` near the dtype's max, ``s`` the largest magnitude) both
    are taken of ``w / s`` and scaled back in float64. On the CPU the scaled pass runs only then (one host read of
    ``s`` decides); where a read waits for the device (:func:`~msprobe_ci._perf.reads_wait`) it always runs, which
    keeps statistics free of host syncs (only float64 tensors come here there: the others accumulate in float64,
    :meth:`RecordBuilder.tensor`). fp16 (upcast to fp32) cannot overflow."""
    cpu = w.device.type == "cpu"
    if cpu and w.is_contiguous():
        def plain():
            v = w.view(-1)
            return w.sum(), torch.dot(v, v), numel, True
    else:
        def plain():
            return w.sum(), torch.linalg.vector_norm(w), numel, False
    if dtype == torch.float16:
        return plain()
    if not reads_wait(w):
        bound = max(float(mx), -float(mn))  # two host reads of 0-d CPU tensors: cheaper than one more op
        # s^2 * n below the max bounds the sum (s * n) too: s >= 1 makes it the larger, s < 1 leaves s * n < n
        if not math.isfinite(bound) or bound * bound * numel < torch.finfo(w.dtype).max / 4:
            return plain()
    s = torch.maximum(mx, -mn)
    scale = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    scaled = w / scale
    big = scale.to(torch.float64)
    return scaled.sum(dtype=torch.float64) * (big / numel), torch.linalg.vector_norm(scaled) * big, None, False


def _dense_key(t: torch.Tensor, version: int) -> tuple[tuple | None, torch.Tensor | None]:
    """``(key, flat)`` of a tensor whose elements fill one gap-free range of its storage (contiguous, or a
    permutation of contiguous: a transpose): ``key`` names that range and its contents' version, ``flat`` is the
    range as a contiguous 1-D view where ``t`` itself is not contiguous (``None`` otherwise). ``(None, None)`` for
    any other layout (a slice with gaps, a broadcast, a tensor without storage)."""
    if t.is_contiguous():
        flat = None
    else:
        expect = 1
        for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
            if stride != expect:
                return None, None
            expect *= size
        flat = t.as_strided((t.numel(),), (1,))
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (a functional or wrapper subclass)
        return None, None
    return (ptr, t.device, t.storage_offset(), t.numel(), t.dtype, version), flat


def _holds(ref: torch.Tensor | None, key: tuple) -> bool:
    """Whether ``ref`` (the tensor a dense key was made from) is alive and still over that storage range at that
    version: then the storage cannot have been freed and its address reused (a parameter whose ``.data`` was
    swapped no longer holds it)."""
    if ref is None:
        return False
    try:
        return ref.untyped_storage().data_ptr() == key[0] and ref.storage_offset() == key[2] and \
            ref._version == key[5]
    except (RuntimeError, NotImplementedError):
        return False


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter, or ``None`` where it has none (inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _join(name: str | None, part: Any) -> str | None:
    return None if name is None else f"{name}.{part}"


def _int_or_none(x: Any) -> int | None:
    return None if x is None else int(x)


def crc32_hex(t: torch.Tensor) -> str:
    """CRC-32 of a tensor's raw bytes as 8 lowercase hex digits (msprobe summary_mode md5)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return f"{zlib.crc32(b''):08x}"
    return f"{zlib.crc32(flat.view(torch.uint8).numpy().tobytes()):08x}"
