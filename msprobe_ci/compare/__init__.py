"""Compare: matching (exact, fuzzy), msprobe metrics, node verdicts, first divergence, compare CSV."""

from .engine import compare_dumps
from .report import CompareReport, RowResult
from .verdict import CompareResult, Thresholds

__all__ = ["CompareReport", "CompareResult", "RowResult", "Thresholds", "compare_dumps"]
