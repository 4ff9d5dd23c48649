"""Capture: module hooks (L0), torch API capture (L1), mix; statistics; naming and call counters.

Imported lazily: ``msprobe_ci.capture.inject`` (fault files) does not load torch.
"""

from .inject import Fault, load_faults, parse_faults

__all__ = ["CaptureSession", "Fault", "Observer", "load_faults", "parse_faults"]


def __getattr__(name: str):
    if name == "CaptureSession":
        from .session import CaptureSession

        return CaptureSession
    if name == "Observer":
        from .observers import Observer

        return Observer
    raise AttributeError(f"module 'msprobe_ci.capture' has no attribute {name!r}")
