"""Capture: module hooks (L0), torch API capture (L1), mix; statistics; naming and call counters."""

from .inject import Fault, load_faults, parse_faults
from .session import CaptureSession

__all__ = ["CaptureSession", "Fault", "load_faults", "parse_faults"]
