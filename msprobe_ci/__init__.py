"""msprobe-ci: pytest-native accuracy testing for PyTorch models, msprobe-compatible on disk.

The package imports torch lazily: ``import msprobe_ci`` is cheap, ``msprobe_ci.PrecisionDebugger`` loads torch.
"""

from .errors import MsprobeError, MsprobeInternalError

__version__ = "0.1.0"
__all__ = ["PrecisionDebugger", "TrainerMon", "MsprobeError", "MsprobeInternalError", "__version__"]


def __getattr__(name: str):
    if name == "PrecisionDebugger":
        from .debugger import PrecisionDebugger

        return PrecisionDebugger
    if name == "TrainerMon":
        from .monitor import TrainerMon

        return TrainerMon
    raise AttributeError(f"module 'msprobe_ci' has no attribute {name!r}")
