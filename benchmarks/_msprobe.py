"""What the benchmarks that run mindstudio-probe itself share."""

from __future__ import annotations

import json
import os


def statistics_config(folder: str, dump_path: str) -> str:
    """Write msprobe's ``config.json`` for a statistics dump at mix level into ``folder`` and return its path."""
    path = os.path.join(folder, "config.json")
    with open(path, "w") as fh:
        json.dump({"task": "statistics", "dump_path": dump_path, "level": "mix", "rank": [], "step": [],
                   "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}, fh)
    return path
