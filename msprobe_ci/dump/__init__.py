"""Reader and writer of the on-disk dump (msprobe layout)."""

from .reader import Dump, layout, load_dump, rank_folders

__all__ = ["Dump", "layout", "load_dump", "rank_folders"]
