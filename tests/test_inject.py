"""Fault injection's own bookkeeping: a fault proves something about the gate only if it changed a value."""

import math

import pytest
import torch

from msprobe_ci.capture.inject import Fault, FaultLog


def _grad_fp16(scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(4, 12, generator=g) * scale).to(torch.float16)


def test_scale_below_fp16_subnormal_resolution_changes_nothing():
    # gradients of about 1e-7 are fp16 subnormals (step 2**-24 = 6e-8): a 2% scale rounds back to the same values
    fault = Fault("Functional.linear", 2, "backward", "scale", 1.02)
    log = FaultLog([fault])
    tiny = _grad_fp16(1e-7)
    assert tiny.abs().max() > 0
    out = log.apply(fault, (tiny, None), 2)
    assert torch.equal(out[0], tiny) and out[1] is None
    assert log.fired == {0} and log.changed == set()
    (line,) = log.unapplied(None, "no such call ran on the target")
    peak = float(tiny.abs().max())
    assert line == (f"fault Functional.linear call 2 (backward) fired but changed no value: scale 1.02 is below "
                    f"the resolution of torch.float16 at the values it touched (largest |x| {peak:.3g})")


def test_the_same_fault_on_normal_values_changes_them():
    fault = Fault("Functional.linear", 2, "backward", "scale", 1.02)
    log = FaultLog([fault])
    log.apply(fault, (_grad_fp16(1e-7),), 2)   # a first call that changed nothing
    log.apply(fault, (_grad_fp16(1.0),), 2)    # a later one that did: the fault proved something
    assert log.changed == {0} and log.unapplied(None, "-") == ()


def test_nan_elements_are_not_a_change_and_unfired_faults_keep_their_reason():
    scale, unfired = Fault("Torch.add", None, "forward", "offset", 0.0), Fault("Torch.mul", 1, "forward")
    log = FaultLog([scale, unfired])
    x = torch.tensor([1.0, math.nan, -2.0])
    log.apply(scale, x, 0)
    lines = log.unapplied(None, "no such call ran on the target")
    assert lines[0].startswith("fault Torch.add (forward) fired but changed no value: offset 0 is below the "
                               "resolution of torch.float32 at the values it touched (largest |x| 2)")
    assert lines[1] == "fault Torch.mul call 1 (forward) was never applied: no such call ran on the target"
    assert log.unapplied(3, "-")[1:] == (lines[1].replace("no such call ran on the target", "-"),)


def test_a_fault_on_an_integer_output_found_nothing_to_perturb():
    fault = Fault("Torch.argmax", 0, "forward", "scale", 2.0)
    log = FaultLog([fault])
    idx = torch.tensor([3, 1])
    assert log.apply(fault, (idx, torch.empty(0)), 0)[0] is idx
    assert log.unapplied(None, "-") == ("fault Torch.argmax call 0 (forward) fired but found no floating-point "
                                        "value to perturb",)


@pytest.mark.parametrize("perturb,value", [("scale", 1.0 + 2.0 ** -30), ("noise", 1e-12)])
def test_perturbations_below_fp32_resolution_are_reported(perturb, value):
    fault = Fault("Functional.gelu", 0, "forward", perturb, value)
    log = FaultLog([fault])
    log.apply(fault, torch.randn(64, generator=torch.Generator().manual_seed(1)), 0)
    assert log.changed == set() and "fired but changed no value" in log.unapplied(None, "-")[0]


def test_a_plugin_check_whose_fault_changes_nothing_fails_saying_so(pytester):
    from _suites import MODEL_TEST

    pytester.makepyfile(test_model=MODEL_TEST)
    pytester.makefile(".yaml", noop="faults:\n  - {api: Functional.layer_norm, call: 0, perturb: scale, value: 1.0}\n")
    result = pytester.runpytest_subprocess("--msprobe-inject", "noop.yaml", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*noop.yaml: fault Functional.layer_norm call 0 (forward) fired but changed no value: scale 1 is below the "
        "resolution of torch.float32*a fault that never fires or changes no value proves nothing about the gate*"])


def test_noise_faults_draw_the_same_noise_in_every_process():
    """A fault file reproduces: the noise of a ``noise`` fault does not depend on the process's string-hash
    salt (PYTHONHASHSEED)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from msprobe_ci.capture.inject import Fault; "
            "f = Fault('Functional.linear', 0, 'forward', 'noise', 0.02); "
            "print(float(f.apply(torch.ones(64), 0).sum()))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=seed)).stdout for seed in ("1", "2")}
    assert len(outs) == 1, outs


def test_a_users_loop_is_told_when_its_fault_proves_nothing(tmp_path):
    """PrecisionDebugger(inject=...) in the user's own loop: a fault meant for a step that never fired there, or
    that only touched values a scale cannot move (NaN, where an fp16 step overflowed under a loss scale), is said
    at that step's step() in one warning, once; a fault that changed values says nothing."""
    import warnings

    from msprobe_ci import PrecisionDebugger

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    faults = [Fault("Functional.linear", 1, "forward", "scale", 1.02, step=0),  # fires and changes values
              Fault("Functional.linear", 7, "forward", "scale", 1.02, step=1),  # no 8th linear: never fires
              Fault("Functional.relu", 0, "forward", "scale", 1.02, step=2)]    # fires on NaNs only
    debugger = PrecisionDebugger(dump_path=str(tmp_path), level="L1", inject=faults)
    said = []
    for step in range(3):
        x = torch.randn(4, 8) if step < 2 else torch.full((4, 8), float("nan"))  # an overflowed step's NaNs
        debugger.start(model)
        model(x)
        debugger.stop()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            debugger.step()
        said.append([str(w.message) for w in caught if "msprobe:" in str(w.message)])
    assert said[0] == []
    assert len(said[1]) == 1 and "step 1: fault Functional.linear call 7 (forward) was never applied: no such " \
                                   "call ran in this step" in said[1][0], said
    assert len(said[2]) == 1 and "step 2: fault Functional.relu call 0 (forward) fired but changed no value: every " \
                                   "torch.float32 value it touched was 0, inf or NaN" in said[2][0], said
