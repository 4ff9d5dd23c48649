"""Backends: where a side (bench or target) runs and in which dtype.

A backend is a device spec plus a dtype policy. ``cpu`` runs here; ``gpu``/``cuda[:N]`` needs a CUDA build of
torch and ``npu[:N]`` needs ``torch_npu`` (imported lazily, only when asked for). A backend that is not
available raises :class:`MsprobeError` with a one-line reason naming the device and how to fix it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import MsprobeError

if TYPE_CHECKING:  # pragma: no cover
    import torch

DTYPE_NAMES = ("fp64", "fp32", "fp16", "bf16")
_DEVICE_RE = re.compile(r"^(cpu|gpu|cuda|npu)(?::(\d+))?$")


def parse_device(spec: str) -> str:
    """Normalise a device spec: ``cpu``, ``gpu`` (alias ``cuda``), ``cuda:N``, ``npu``, ``npu:N``.

    Raises:
        MsprobeError: for anything else.
    """
    m = _DEVICE_RE.match(str(spec).strip().lower())
    if not m:
        raise MsprobeError(f"device {spec!r}: expected cpu, gpu, cuda, cuda:N, npu or npu:N")
    kind, index = m.groups()
    if kind == "gpu":
        kind = "cuda"
    if kind == "cpu":
        return "cpu"
    return f"{kind}:{index}" if index is not None else kind


def parse_dtype(name: str | None) -> "torch.dtype | None":
    """Map ``fp64``/``fp32``/``fp16``/``bf16`` (or ``None`` = keep the model's own) to a torch dtype."""
    if name is None or name == "":
        return None
    import torch

    table = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
             "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    try:
        return table[str(name).lower()]
    except KeyError:
        raise MsprobeError(f"dtype {name!r}: expected one of {', '.join(DTYPE_NAMES)}") from None


@dataclass(frozen=True)
class Backend:
    """One side of a check.

    Attributes:
        device: normalised device string (``cpu``, ``cuda``, ``cuda:1``, ``npu:0`` ...).
        dtype: floating dtype the model and floating inputs are cast to; ``None`` keeps the model's own.
        compile: run the model through ``torch.compile`` (module-level capture only).
    """

    device: str = "cpu"
    dtype: Any = None
    compile: bool = False

    @classmethod
    def from_options(cls, device: str, dtype: str | None = None, compile: bool = False) -> "Backend":
        return cls(parse_device(device), parse_dtype(dtype), bool(compile))

    @property
    def label(self) -> str:
        import torch

        names = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
        return f"{self.device}/{names.get(self.dtype, 'model-dtype')}"

    def check_available(self) -> None:
        """Raise :class:`MsprobeError` when the device cannot run here."""
        import torch

        kind = self.device.split(":")[0]
        if kind == "cpu":
            return
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise MsprobeError(f"device {self.device!r} is not available: this torch build sees no CUDA GPU "
                                   "(install a CUDA build of torch on a GPU runner, or use a recorded baseline)")
            return
        if kind == "npu":
            try:
                import torch_npu  # noqa: F401  (registers the npu device)
            except ImportError:
                raise MsprobeError(f"device {self.device!r} is not available: torch_npu is not installed "
                                   "(pip install torch_npu on an Ascend runner, or use a recorded baseline)") from None
            if not torch.npu.is_available():  # type: ignore[attr-defined]
                raise MsprobeError(f"device {self.device!r} is not available: torch_npu found no Ascend device")
            return
        raise MsprobeError(f"device {self.device!r}: unsupported")

    def prepare_model(self, model: "torch.nn.Module") -> "torch.nn.Module":
        """Return a deep copy of ``model`` on this device, floating parameters/buffers cast to ``dtype``."""
        self.check_available()
        clone = copy.deepcopy(model)
        clone.to(self.device)
        if self.dtype is not None:
            clone.to(self.dtype)  # nn.Module.to(dtype) casts floating params and buffers only
        return clone

    def prepare_inputs(self, value: Any) -> Any:
        """Move tensors (nested in lists/tuples/dicts) to the device; cast floating ones to ``dtype``."""
        import torch

        if isinstance(value, torch.Tensor):
            value = value.detach().clone().to(self.device)
            if self.dtype is not None and value.is_floating_point():
                value = value.to(self.dtype)
            return value
        if isinstance(value, dict):
            return type(value)((k, self.prepare_inputs(v)) for k, v in value.items())
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(self.prepare_inputs(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(self.prepare_inputs(v) for v in value)
        return value
