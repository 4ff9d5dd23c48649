"""Module-level task functions the worker tests hand to msprobe_ci.workers (importable by spawned workers)."""

import os
import time


def square_or_die(job):
    """``job * job``; job 2 kills its worker process (as the kernel's OOM killer would), job 3 raises."""
    if job == 2:
        time.sleep(0.2)
        os._exit(9)
    if job == 3:
        raise ValueError("bad job 3")
    return job * job
