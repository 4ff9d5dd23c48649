"""The fast subset of ``benchmarks/mode_grid.py``: every mode on a stock OPT config (an architecture no other
test uses), one seed: benign runs pass, each fault (forward, backward and optimizer APIs at steps 1 and 2 of the
loops; forward and backward in offline dumps, statistics dumps judged by the drift rule included) is named exactly
at its step, and nothing else fails."""

import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import mode_grid  # noqa: E402


@pytest.mark.parametrize("mode, dkey", [("train-adamw", "mixed"), ("train-adamw", "same"), ("train-sgd", "same"),
                                        ("generate", "mixed"), ("debugger", "mixed"), ("tensor", "same"),
                                        ("statistics", "mixed"), ("statistics", "same")])
def test_mode_is_truthful(mode, dkey):
    stats, misses = mode_grid.grid(mode, dkey, ["opt"], [7], verbose=True)
    assert stats["benign"] == 1 and stats["faults"] >= 2, stats
    assert (stats["false"], stats["exact"], stats["other"]) == (0, stats["faults"], 0), misses
