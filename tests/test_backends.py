"""Backends: device specs, the accelerator code path exercised with a stand-in kind on cpu, compile regions,
determinism, and GPU/NPU smoke tests that run where the device exists."""

import copy
import importlib.util

import pytest
import torch
from _suites import FAULT, MODEL_TEST

from msprobe_ci import MsprobeError
from msprobe_ci.backends import (DEVICE_KINDS, Backend, DeviceKind, compile_regions, deterministic, parse_device)

STAND_IN = "msprobe_ci_stand_in_runtime"


@pytest.fixture
def npu_on_cpu(monkeypatch, tmp_path):
    """The npu kind, with its runtime module a stand-in file and its namespace torch.cpu."""
    (tmp_path / f"{STAND_IN}.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(DEVICE_KINDS, "npu", DeviceKind("npu", STAND_IN, "cpu", "stand-in"))


@pytest.mark.parametrize("spec, device", [("cpu", "cpu"), ("gpu", "cuda"), ("CUDA:1", "cuda:1"), ("npu:0", "npu:0")])
def test_parse_device(spec, device):
    assert parse_device(spec) == device


def test_accelerator_path_with_a_stand_in_kind(npu_on_cpu):
    backend = Backend.from_options("npu", "bf16")
    backend.check_available()
    assert backend.torch_device == "cpu" and backend.label == "npu/bf16"
    model = torch.nn.Linear(4, 2)
    moved = backend.prepare_model(model)
    assert moved is not model and moved.weight.dtype == torch.bfloat16 and model.weight.dtype == torch.float32
    x, ids = backend.prepare_inputs((torch.randn(2, 4), torch.tensor([1, 2])))
    assert x.dtype == torch.bfloat16 and ids.dtype == torch.int64
    with pytest.raises(MsprobeError, match=r"^device 'npu:3' is not available: only 1 npu device\(s\) here$"):
        Backend.from_options("npu:3").check_available()


def test_missing_runtime_and_missing_device_messages(monkeypatch):
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(MsprobeError, match=r"^device 'npu' is not available: torch_npu is not installed "
                                               r"\(pip install torch_npu on an Ascend runner, or use a recorded "
                                               r"baseline: --msprobe-baseline=DIR\)$"):
            Backend.from_options("npu").check_available()
    if not torch.cuda.is_available():
        with pytest.raises(MsprobeError, match=r"^device 'cuda' is not available: torch.cuda finds no device"):
            Backend.from_options("gpu").check_available()
    monkeypatch.setitem(DEVICE_KINDS, "npu", DeviceKind("npu", "no_such_runtime_xyz", "npu", "hint"))
    with pytest.raises(MsprobeError, match=r"no_such_runtime_xyz is not installed \(hint\)$"):
        Backend.from_options("npu").check_available()


def test_stand_in_npu_target_end_to_end(pytester):
    """The plugin's whole path for --msprobe-target=npu, with the npu kind standing in on cpu."""
    pytester.makepyfile(**{STAND_IN: "LOADED = True\n", "test_model": MODEL_TEST})
    pytester.makeconftest(f"""
from msprobe_ci.backends import DEVICE_KINDS, DeviceKind
DEVICE_KINDS["npu"] = DeviceKind("npu", "{STAND_IN}", "cpu", "stand-in")
""")
    result = pytester.runpytest_subprocess("--msprobe-target=npu", "--msprobe-target-dtype=bf16", "-p",
                                           "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_net*(cpu/model-dtype vs npu/bf16, statistics, mix)*error 0*"])
    # the stand-in runs on the bench device's own kernels: the bench is a foreign kernel by default, so the run
    # takes the path a real NPU target takes (every call judged on its numbers, none assumed identical)
    result.stdout.fnmatch_lines(["*isolation: * API calls judged on their own inputs (bench kernel: upcast)*"])


ORACLE_TESTS = MODEL_TEST + """

def test_faulty(msprobe):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    msprobe.check(build(), x, loss_fn=lambda out: out.float().pow(2).mean(), inject="faults.yaml")
"""


def test_oracle_on_the_target_device(pytester):
    """--msprobe-oracle-device=target through the backend interface: a stand-in npu whose highest precision is
    float32 (an NPU's, as msprobe's bench upcast). A bf16 target's oracle runs there in float32 (every call; the
    benign run passes, a 2% fault is named); an fp32 target needs float64, which the device lacks, so each API
    falls back to the CPU oracle and the report says so; the verdicts are those of the CPU oracle."""
    pytester.makepyfile(**{STAND_IN: "LOADED = True\n", "test_model": ORACLE_TESTS})
    pytester.makefile(".yaml", faults=FAULT)
    pytester.makeconftest(f"""
from msprobe_ci.backends import DEVICE_KINDS, DeviceKind
DEVICE_KINDS["npu"] = DeviceKind("npu", "{STAND_IN}", "cpu", "stand-in", "float32")
""")
    common = ["--msprobe-target=npu", "-p", "no:cacheprovider", "-rA"]
    half = pytester.runpytest_subprocess(*common, "--msprobe-target-dtype=bf16", "--msprobe-oracle-device=target")
    half.assert_outcomes(passed=1, failed=1)
    half.stdout.fnmatch_lines(["*first divergence at Functional.layer_norm.0.forward*"])
    # the model's calls are bf16 (a float32 oracle, on the device); the loss function's are fp32 (float64: CPU)
    note = [ln for ln in half.stdout.lines if "note: oracle on npu" in ln]
    assert len(note) == 2 and note[0].endswith("note: oracle on npu (at most float32); 2 API(s) fell back to the CPU "
                                               "oracle; torch.pow: npu offers no float64 (at most float32); "
                                               "torch.mean: npu offers no float64 (at most float32)"), note
    full = pytester.runpytest_subprocess(*common, "--msprobe-oracle-device=target", "-k", "test_net")
    full.assert_outcomes(passed=1)
    full.stdout.fnmatch_lines(["*oracle on npu (at most float32); 5 API(s) fell back to the CPU oracle; "
                               "torch._C._nn.linear: npu offers no float64 (at most float32); "
                               "torch.nn.functional.layer_norm: npu offers no float64*"])
    default = pytester.runpytest_subprocess(*common, "--msprobe-target-dtype=bf16", "-k", "test_net")
    default.assert_outcomes(passed=1)  # not CUDA: the CPU oracle unless asked
    assert "oracle on npu" not in default.stdout.str()
    bad = pytester.runpytest_subprocess(*common, "--msprobe-oracle-device=gpu")
    assert bad.ret == 4 and "expected one of cpu, target, got 'gpu'" in bad.stderr.str()


def test_compile_regions():
    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(2, 2)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))

    assert compile_regions(Blocks()) == ["layers.0", "layers.1", "layers.2"]
    assert compile_regions(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())) == ["0", "1"]


def test_deterministic_restores_the_previous_setting():
    """Deterministic algorithms for the duration, without filling new allocations (a pass over each, a launch on
    an accelerator); both settings restored after."""
    import torch.utils.deterministic as det

    before = torch.are_deterministic_algorithms_enabled()
    fill = det.fill_uninitialized_memory
    with deterministic():
        assert torch.are_deterministic_algorithms_enabled()
        assert det.fill_uninitialized_memory is False
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.empty(1000)
        assert "aten::empty" in {e.name for e in prof.events()}
        assert "aten::fill_" not in {e.name for e in prof.events()}  # no pass over the new allocation
    assert torch.are_deterministic_algorithms_enabled() == before
    assert det.fill_uninitialized_memory == fill


@pytest.mark.parametrize("device", [
    pytest.param("gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")),
    pytest.param("npu", marks=pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None,
                                                 reason="torch_npu not installed")),
])
def test_device_smoke(pytester, device):
    """On a machine with the device: cpu bench vs device target passes, and the device appears in the report."""
    pytester.makepyfile(test_model=MODEL_TEST)
    result = pytester.runpytest_subprocess(f"--msprobe-target={device}", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*vs {'cuda' if device == 'gpu' else 'npu'}/model-dtype*error 0*"])


def test_a_ddp_copy_keeps_the_users_comm_hook_or_reduces_where_a_capture_sees_it():
    """A side's copy of a ``DistributedDataParallel`` model is wrapped anew: the user's own comm hook is carried
    over to it (before, the copy reduced with DDP's built-in C++ path instead); without one, the copy's buckets are
    reduced by ``torch.distributed.all_reduce`` (a call captures record), with the reference hook's arithmetic: the
    gradients equal the plain module's on one rank."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from msprobe_ci.backends import Backend

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        ddp = DDP(copy.deepcopy(plain))
        side = Backend.from_options("cpu").prepare_model(ddp)
        assert [h.__name__ for h, _ in side._comm_hooks] == ["recorded_allreduce"]
        calls = []
        real = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            calls.append(tensor.numel())
            return real(tensor, *args, **kwargs)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        dist.all_reduce = counting
        try:
            side(x).square().sum().backward()
        finally:
            dist.all_reduce = real
        plain(x).square().sum().backward()
        assert calls == [sum(p.numel() for p in plain.parameters())]  # one bucket, through the public function
        for p, q in zip(side.module.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        assert [h for h, _ in Backend.from_options("cpu").prepare_model(ddp)._comm_hooks] == \
            [default_hooks.allreduce_hook]
    finally:
        dist.destroy_process_group()
