"""Every check pipeline, without pytest: one module per mode around one judgement and one conclude step.

============================  ==============================================================================
module                        what it does
============================  ==============================================================================
:mod:`.settings`              :class:`CheckSettings`: a check's options, merged in layers and validated once
:mod:`.context`               :class:`CheckContext`: the test's folders, graphs, baseline, run-wide choices
:mod:`.sides`                 :func:`run_side`: one side of a check under capture (and isolation)
:mod:`.outcome`               :func:`judge` / :func:`evaluate`: two dumps in, a frozen :class:`CheckOutcome` out
:mod:`.conclude`              outcomes in, a frozen :class:`Conclusion` out (rows, properties, first failure)
:mod:`.single`                :func:`run_check`: both sides here, against a baseline, or recording one
:mod:`.free`                  the free benchmark: the target alone, each API re-run higher and bit-noised
:mod:`.training`              :func:`check_training`: one step per batch, the first diverging step named
:mod:`.generation`            :func:`check_generate`: greedy decoding, teacher-forced, per step
:mod:`.parallel`              :func:`check_parallel`: ranks on both sides, merged when partitioned differently
:mod:`.offline`               :func:`check_dumps`: two dumps recorded elsewhere
:mod:`.monitor`               :func:`open_monitor` / :func:`conclude_monitor`: TrainerMon over a test's loop
============================  ==============================================================================

Front ends are adapters over these: the pytest fixture (``msprobe.check`` and the other modes) builds a
:class:`CheckContext` and :class:`CheckSettings`, calls a mode and maps its :class:`Conclusion` to pass, skip or
fail; ``msprobe-ci compare`` judges two dumps with :func:`judge`; benchmarks call :func:`run_side` and
:func:`evaluate` as the fixture does.
"""

from .conclude import Conclusion, failure_message
from .row import CheckRow
from .context import CheckContext, DeviceAbsent
from .generation import DecodeRun, check_generate, run_decode
from .monitor import conclude_monitor, open_monitor
from .offline import check_dumps
from .outcome import (CheckOutcome, SideRun, departure, evaluate, flatten_outputs, judge, merge_coverage,
                      model_cases, read_coverage)
from .parallel import check_parallel
from .settings import CHECK_OPTIONS, CheckSettings
from .sides import precision_notes, run_side, unapplied_faults
from .single import run_check
from .training import TrainingRun, check_training, grad_similarity, run_training

__all__ = ["CHECK_OPTIONS", "CheckContext", "CheckOutcome", "CheckRow", "CheckSettings", "Conclusion", "DecodeRun",
           "DeviceAbsent", "SideRun", "TrainingRun", "check_dumps", "check_generate", "check_parallel",
           "check_training", "conclude_monitor", "departure", "evaluate", "failure_message", "flatten_outputs",
           "grad_similarity", "judge", "merge_coverage", "model_cases", "open_monitor", "precision_notes",
           "read_coverage", "run_check", "run_decode", "run_side", "run_training", "unapplied_faults"]
