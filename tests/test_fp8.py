"""FP8 GEMMs (``torch._scaled_mm``) judged on their own inputs, and a call that computes but cannot be judged counted
as unseen in the coverage figure.

A bf16 model whose linear layers quantize their input and weight to e4m3 with per-tensor scales and call
``torch._scaled_mm`` (what torchao's and Transformer Engine's float8 linears do), against an fp32 bench. Before,
every ``_scaled_mm`` call was "not isolated (oracle failed on CPU: Invalid scaling configuration)": a 2% fault on
one passed, and coverage said nothing was missing.
"""

import json
import os

import pytest
import torch

from msprobe_ci.backends import Backend
from msprobe_ci.capture.inject import Fault
from msprobe_ci.check import judge, run_side
from msprobe_ci.config import BENCH_KERNELS, DumpConfig
from msprobe_ci.isolate import Isolator
from msprobe_ci.judge import JudgeSettings
from msprobe_ci.kernels import scaled_mm_reference

E4M3 = torch.float8_e4m3fn


class FP8Linear(torch.nn.Linear):
    """A linear layer that computes through an FP8 GEMM in low precision (per-tensor scales from the amax), and
    as itself in fp32 (the bench). ``scale_result``: also pass ``_scaled_mm`` a result scale (an FP8 output's)."""

    scale_result = False
    stale = None  # the second layer's activation scale from an amax this many times the current one (a stale history)

    def forward(self, x):
        if x.dtype == torch.float32:
            return super().forward(x)
        flat = x.reshape(-1, x.shape[-1])
        sx = flat.abs().amax().float().clamp_min(1e-12) / 448.0
        if self.stale is not None and self.out_features == 64:
            sx = sx * self.stale
        sw = self.weight.abs().amax().float().clamp_min(1e-12) / 448.0
        xq, wq = (flat.float() / sx).to(E4M3), (self.weight.float() / sw).to(E4M3)
        extra = {"scale_result": torch.tensor(1.0)} if self.scale_result else {}
        y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype, **extra)
        return (y + self.bias).reshape(*x.shape[:-1], -1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = FP8Linear(64, 128), FP8Linear(128, 64)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


def _check(tmp_path, kernel="device", faults=()):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 16, 64)
    cfg = DumpConfig(task="statistics", level="mix")
    b = run_side(model, (x,), None, Backend.from_options("cpu", "fp32"),
                 cfg.with_overrides(dump_path=os.path.join(tmp_path, "bench")))
    t = run_side(model, (x,), None, Backend.from_options("cpu", "bf16"),
                 cfg.with_overrides(dump_path=os.path.join(tmp_path, "target")), faults=tuple(faults),
                 isolator=Isolator(backward=False, bench_kernel=kernel))
    report, _, _ = judge(b.folder, t.folder, JudgeSettings(isolate=True))
    return report, t.folder


def test_scaled_mm_reference_is_its_definition():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(8, 32, generator=g).to(E4M3)
    b = torch.randn(16, 32, generator=g).to(E4M3).t()
    for sa, sb in ((torch.tensor(0.5), torch.tensor(2.0)), (torch.rand(8, 1, generator=g) + 0.5,
                                                          torch.rand(1, 16, generator=g) + 0.5)):
        kernel = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        ref = scaled_mm_reference(a.double(), b.double(), sa.double(), sb.double())
        terms = scaled_mm_reference(a.double().abs(), b.double().abs(), sa.double(), sb.double())
        # fp32 accumulation of 32 products: within 32 fp32 roundings of the sum of the terms' magnitudes
        assert ((kernel.double() - ref).abs() <= 32 * 2 ** -24 * terms).all()
        assert not ((kernel.double() - 1.01 * ref).abs() <= 32 * 2 ** -24 * terms).all()  # a 1% error would not pass
    with pytest.raises(ValueError, match="scale of shape"):
        scaled_mm_reference(a.double(), b.double(), torch.ones(3, 1, dtype=torch.float64), sb.double())


@pytest.mark.parametrize("kernel", BENCH_KERNELS)
def test_fp8_gemms_are_judged_and_a_two_percent_fault_is_named(tmp_path, kernel):
    report, _ = _check(tmp_path / "benign", kernel)
    gemms = [n for n in report.nodes if "_scaled_mm" in n.name]
    assert len(gemms) == 2 and all("on its own inputs" in n.message for n in gemms), [n.message for n in gemms]
    assert not [n.message for n in report.nodes if n.status == "error"]
    report, _ = _check(tmp_path / "fault", kernel, [Fault("Torch._scaled_mm", 1, "forward", "scale", 1.02)])
    assert report.first_divergence is not None and report.first_divergence.name == "Torch._scaled_mm.1.forward", \
        report.first_divergence and report.first_divergence.message


def test_a_call_that_computes_but_cannot_be_judged_is_unseen_in_coverage(tmp_path, monkeypatch):
    # an FP8 GEMM with a result scale: no reference here, so neither oracle runs; it must not count as covered
    monkeypatch.setattr(FP8Linear, "scale_result", True)
    report, folder = _check(tmp_path)
    with open(os.path.join(folder, "coverage.json"), encoding="utf-8") as fh:
        cov = json.load(fh)
    unseen = [u for u in cov["uncaptured"] if u["op"] == "Torch._scaled_mm"]
    assert cov["share"] < 1 and unseen and unseen[0]["calls"] == 2
    assert unseen[0]["pass"].startswith("forward, not judged: oracle failed on CPU")
    assert unseen[0]["elements"] == 4 * 16 * 128 + 4 * 16 * 64  # the two GEMMs' outputs


@pytest.mark.parametrize("stale, metric", [(3e4, "underflow_share"), (0.05, "saturated_share")])
def test_a_scale_that_does_not_fit_is_named_at_its_cast(tmp_path, monkeypatch, stale, metric):
    """A stale amax history (a scale 30000x too large: every activation in e4m3's subnormals or flushed to zero)
    or a wrong one (20x too small: a third of the values clipped at 448) fails at the cast that quantized with it,
    against the cast's own wider input; the benign casts pass, their underflow, saturation and range in the dump."""
    report, folder = _check(tmp_path / "benign")
    casts = [n for n in report.nodes if n.name.startswith("Tensor.to.")]
    assert len(casts) == 4 and not [n.message for n in report.nodes if n.status == "error"]
    with open(os.path.join(folder, "dump.json"), encoding="utf-8") as fh:
        data = json.load(fh)["data"]
    q = data["Tensor.to.0.forward"]["quantization"]["Tensor.to.0.forward.output.0"]
    assert q["underflow_share"] < 0.01 and q["saturated_share"] == 0 and q["amax_use"] == pytest.approx(1.0)
    assert q["dynamic_range"] > 5
    monkeypatch.setattr(FP8Linear, "stale", stale)
    report, _ = _check(tmp_path / "stale")
    first = report.first_divergence
    assert first is not None and first.name == "Tensor.to.2.forward", first and first.message
    assert f"quantization standard on its own inputs: {metric}" in first.message and "scale does not fit" in first.message


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(cfg), (ids,), lambda out: out.logits.float().square().mean()


def _fp8_check(tmp_path, faults=(), kernel="upcast"):
    """A stock Llama whose linears compute through torchao's float8 training (bf16 model, FP8 GEMMs) against an
    fp32 bench, isolated forward and backward: (report, target folder)."""
    from msprobe_ci.check.settings import CheckSettings

    model, inputs, loss_fn = _llama()
    s = CheckSettings.resolve({"bench": "cpu", "target": "cpu", "bench_dtype": "fp32", "target_dtype": "bf16",
                               "target_fp8": True, "level": "mix", "task": "statistics", "bench_kernel": kernel,
                               "isolate": "on"})
    cfg = DumpConfig(task="statistics", level="mix")
    b = run_side(model, inputs, loss_fn, s.bench, cfg.with_overrides(dump_path=os.path.join(tmp_path, "bench")))
    t = run_side(model, inputs, loss_fn, s.target, cfg.with_overrides(dump_path=os.path.join(tmp_path, "target")),
                 faults=tuple(faults), isolator=s.isolator(backward=True))
    report, _, _ = judge(b.folder, t.folder, JudgeSettings(isolate=True, cast_roundoff=s.cast_roundoff))
    return report, t.folder


def test_an_fp8_target_through_torchao_passes_and_a_one_percent_gemm_fault_is_named(tmp_path):
    pytest.importorskip("torchao")
    report, folder = _fp8_check(tmp_path / "benign")
    assert not [n.message for n in report.nodes if n.status == "error"]
    gemms = [n for n in report.nodes if n.name.startswith("Torch.mm.")]  # torchao's float8 mm, by its own name
    # 15 linears: their forward GEMMs, then the two gradient GEMMs of each, which torchao computes inside its
    # autograd function's backward (captured as calls of the backward pass)
    assert len(gemms) == 45 and all("on its own inputs" in n.message for n in gemms)
    with open(os.path.join(folder, "dump.json"), encoding="utf-8") as fh:
        data = json.load(fh)["data"]
    ins = data["Torch.mm.0.forward"]["input_args"]
    assert [r["fp8_dtype"] for r in ins] == ["torch.float8_e4m3fn"] * 2 and ins[0]["dtype"] == "torch.bfloat16"
    grad = data["Torch.mm.15.forward"]["input_args"]  # the last linear's input gradient: e5m2 gradients
    assert [r["fp8_dtype"] for r in grad] == ["torch.float8_e5m2", "torch.float8_e4m3fn"]
    casts = [e["quantization"] for e in data.values() if isinstance(e, dict) and "quantization" in e]
    assert casts and all(q["underflow_share"] < 0.05 and q["quant_err_ratio"] < 1.01
                         for c in casts for q in c.values())
    for call in (9, 40):  # a forward GEMM, a gradient GEMM
        report, _ = _fp8_check(tmp_path / f"fault{call}", [Fault("Torch.mm", call, "forward", "scale", 1.01)])
        assert report.first_divergence is not None and report.first_divergence.name == f"Torch.mm.{call}.forward", \
            report.first_divergence and report.first_divergence.message


def test_the_fp8_option_says_what_it_needs(monkeypatch):
    import sys

    from msprobe_ci.backends import to_float8
    from msprobe_ci.errors import MsprobeError

    pytest.importorskip("torchao")
    with pytest.raises(MsprobeError, match="no nn.Linear whose in and out features are multiples of 16"):
        to_float8(torch.nn.Sequential(torch.nn.Linear(10, 20)))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(MsprobeError, match=r"option 'fp8': needs torchao \(pip install torchao\)"):
        to_float8(Net())
    assert Backend.from_options("cpu", "bf16", fp8=True).label == "cpu/bf16+fp8"


def test_the_fp8_target_flag_in_a_users_suite(pytester):
    pytest.importorskip("torchao")
    pytester.makepyfile(test_fp8_suite="""
import torch


def test_block(msprobe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    msprobe.check(model, torch.randn(4, 16, 64), loss_fn=lambda out: out.float().square().mean())
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16",
                                           "--msprobe-target-fp8", "--msprobe-bench-kernel=upcast")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_block*cpu/model-dtype vs cpu/bf16+fp8*error 0*"])
