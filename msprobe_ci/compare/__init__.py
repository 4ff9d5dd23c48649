"""Compare: matching (exact, fuzzy), msprobe metrics, node verdicts, first divergence, compare CSV."""

from .engine import CompareReport, RowResult, compare_dumps
from .verdict import CompareResult, Thresholds

__all__ = ["CompareReport", "CompareResult", "RowResult", "Thresholds", "compare_dumps"]
