"""Encoding of captured values into msprobe dump records, with statistics deferred to the flush.

A tensor record is ``{"type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad"[, "md5"]
[, "data_name"]}`` exactly as msprobe 26.2.0 writes it (``shared/spec/dump-format.md`` §7-8). Statistics are
computed on the tensor's own device as one small stacked tensor per record and fetched with **one** host transfer
per device at :meth:`RecordBuilder.resolve` (no ``.item()`` per statistic in the hot path).

Deviation from msprobe, on purpose: Mean and Norm of fp16/bf16 tensors are accumulated in float32 (msprobe keeps
the tensor's own dtype, which rounds a bf16 Norm to 3 significant digits and would blur the comparison); fp64
tensors get all four statistics (msprobe writes ``null`` for Mean/Norm there).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

_LOW_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


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

    # -- tensors ---------------------------------------------------------------------------------------------
    def tensor(self, t: torch.Tensor, data_name: str | None = None) -> dict:
        """Record one tensor; ``data_name`` (a file name) also keeps a CPU copy for ``dump_tensor_data/``."""
        rec: dict[str, Any] = {
            "type": "torch.Tensor",
            "dtype": str(t.dtype),
            "shape": list(t.shape),
            "Max": None, "Min": None, "Mean": None, "Norm": None,
            "requires_grad": bool(t.requires_grad),
        }
        t = t.detach()
        numel = t.numel()
        if numel and t.device.type != "meta":
            dt = t.dtype
            if t.dim() == 0:
                v = t.float() if dt in _LOW_FLOATS else t
                self._pending.append((rec, v.reshape(1).expand(4)))
            elif dt in _LOW_FLOATS or dt == torch.float64:
                acc = torch.float64 if dt == torch.float64 else torch.float32
                mn, mx = torch.aminmax(t)
                self._pending.append((rec, torch.stack([mx.to(acc), mn.to(acc), t.mean(dtype=acc),
                                                        torch.linalg.vector_norm(t, dtype=acc)])))
            elif dt == torch.bool:
                self._pending.append((rec, torch.stack([t.any(), t.all()])))
            elif not dt.is_floating_point and not dt.is_complex:
                mn, mx = torch.aminmax(t)
                self._pending.append((rec, torch.stack([mx, mn])))
            elif dt.is_complex:
                a = t.abs()
                self._pending.append((rec, torch.stack([a.max(), a.min(), a.mean()])))
        if self.md5:
            rec["md5"] = crc32_hex(t)
        if data_name is not None:
            rec["data_name"] = data_name
            self.tensors[data_name] = t.to("cpu", copy=True).contiguous()
        return rec

    def resolve(self) -> None:
        """Fetch every pending statistic (one transfer per device and dtype) into its record."""
        groups: dict[tuple, list[tuple[dict, torch.Tensor]]] = {}
        for rec, st in self._pending:
            groups.setdefault((st.device, st.dtype, st.shape[0]), []).append((rec, st))
        self._pending = []
        for (_, dtype, width), items in groups.items():
            values = torch.stack([st for _, st in items]).tolist()
            for (rec, _), row in zip(items, values):
                if width == 4:
                    rec["Max"], rec["Min"], rec["Mean"], rec["Norm"] = row
                elif width == 3:
                    rec["Max"], rec["Min"], rec["Mean"] = row
                else:
                    rec["Max"], rec["Min"] = row

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
