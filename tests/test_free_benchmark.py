"""Free benchmark (no bench device, no baseline): every API call of the target re-run in higher precision and with
bit-noised inputs. Benign low-precision runs of stock transformers models pass; a 2% kernel fault is named as the
one API at risk, never what runs after it."""

import csv
import math

import pytest
import torch

from msprobe_ci.capture import CaptureSession
from msprobe_ci.capture.inject import Fault
from msprobe_ci.config import DumpConfig
from msprobe_ci.free_benchmark import FreeBenchmark, bit_noise, run_forward

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_bit_noise_moves_every_finite_element_by_exactly_one_ulp(dtype):
    x = torch.tensor([1.0, -1.0, 0.0, 3.5, -1e-3, math.inf, math.nan, 65000.0 if dtype == torch.float16 else 1e30],
                     dtype=dtype)
    y = bit_noise(x, torch.Generator().manual_seed(0))
    assert y.dtype == dtype and y.shape == x.shape
    finite = torch.isfinite(x)
    assert torch.equal(y[~finite].isnan(), x[~finite].isnan()) and bool((y[5] == x[5]))
    up = torch.nextafter(x, torch.full_like(x, math.inf))
    down = torch.nextafter(x, torch.full_like(x, -math.inf))
    assert bool(((y == up) | (y == down))[finite].all())
    assert bool((y != x)[finite].all())


def _llama(dtype, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval().to(dtype)


def _run(model, ids, faults=(), mode="improve_precision", tmp_path=None):
    return run_forward(model, {"input_ids": ids}, str(tmp_path), faults=faults, mode=mode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_benign_low_precision_llama_passes_and_a_2_percent_silu_fault_is_the_only_error(tmp_path, dtype, seed):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    clean = _run(_llama(dtype, seed), ids, tmp_path=tmp_path / "clean")
    judged = [v for v in clean.results.values() if v["status"] != "skip"]
    assert len(judged) > 50 and not clean.errors(), clean.errors()[:2]
    # every allowance starts from msprobe's threshold for the output's dtype: bf16 0.004, fp16 0.002, fp32 0.0002
    assert str(dtype) in {v["dtype"] for v in judged}
    assert all(v["threshold"] >= {"torch.bfloat16": 0.004, "torch.float16": 0.002, "torch.float32": 0.0002}[v["dtype"]]
               for v in judged)
    fault = Fault("Functional.silu", call=1, perturb="scale", value=1.02)
    faulty = _run(_llama(dtype, seed), ids, (fault,), tmp_path=tmp_path / "fault")
    assert [k for k, _ in faulty.errors()] == ["Functional.silu.1.forward"]
    rec = faulty.results["Functional.silu.1.forward"]
    assert rec["metric"] in ("rel_rmse", "max_err") and rec["value"] > 0.015 and rec["value"] > rec["threshold"]
    assert (tmp_path / "fault" / "step0" / "rank" / "free_benchmark.json").is_file()


class _Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x * 40.0, dim=-1) @ x  # large logits: softmax amplifies every input rounding


def test_an_ill_conditioned_call_is_allowed_what_its_bit_noise_sensitivity_explains(tmp_path):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    fb = FreeBenchmark()
    cs = CaptureSession(DumpConfig(dump_path=str(tmp_path), level="L1", task="statistics"), free_bench=fb)
    cs.start()
    _Softmax()(x)
    cs.stop()
    cs.close()
    soft = fb.results["Torch.softmax.0.forward"]
    assert soft["status"] == "pass" and soft["sensitivity"] > 0.004  # a fixed 0.004 alone would not explain it
    assert not fb.errors()


def test_fp64_calls_and_random_calls_get_named_skips(tmp_path):
    fb = FreeBenchmark("to_cpu")
    cs = CaptureSession(DumpConfig(dump_path=str(tmp_path), level="L1", task="statistics"), free_bench=fb)
    cs.start()
    a = torch.randn(4, 4, dtype=torch.float64)
    torch.matmul(a, a)
    torch.nn.functional.dropout(torch.randn(4, 4), p=0.5)
    torch.relu(torch.randn(4, 4))
    cs.stop()
    cs.close()
    assert "fp64" in fb.results["Torch.matmul.0.forward"]["message"]
    assert fb.results["Functional.dropout.0.forward"]["status"] == "skip"
    assert fb.results["Torch.relu.0.forward"]["status"] == "pass"
    with pytest.raises(ValueError, match="free benchmark mode"):
        FreeBenchmark("to_gpu")


PLUGIN_TEST = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def test_clean(msprobe):
    results = msprobe.check(build(), {"input_ids": IDS})
    assert sum(r["status"] == "pass" for r in results.values()) > 20


@pytest.mark.msprobe(inject="faults.yaml")
def test_faulty_layer_norm(msprobe):
    msprobe.check(build(), {"input_ids": IDS})
"""


def test_plugin_free_benchmark_runs_no_bench_and_names_the_faulty_api(pytester):
    pytester.makepyfile(test_fb="import pytest\n" + PLUGIN_TEST)
    pytester.makefile(".yaml", faults="faults:\n  - {api: Functional.layer_norm, call: 3, perturb: scale, "
                                      "value: 1.02}\n")
    # the bench device does not exist here: the free benchmark must not need it
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-free-benchmark",
                                           "--msprobe-bench=npu", "--msprobe-target-dtype=bf16",
                                           "--msprobe-junitxml=j.xml")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*msprobe: free benchmark: 1 API call(s) at risk on cpu/bf16; first: "
                                 "Functional.layer_norm.3.forward.output.0: rel_rmse * exceeds *"])
    result.stdout.fnmatch_lines(["*none (free benchmark, improve_precision) vs cpu/bf16*"])
    result.stdout.fnmatch_lines(["reproduce this call alone, without the model (--no-fault leaves an injected fault "
                                 "out): python *test_fb.py_test_faulty_layer_norm/check0/target/step0/rank/repro/"
                                 "Functional.layer_norm.3.forward.py"])
    junit = (pytester.path / "j.xml").read_text()
    assert 'name="Functional.layer_norm.3.forward"' in junit and junit.count("<failure") == 1
    with open(next((pytester.path / "msprobe-out").rglob("free_benchmark.csv")), newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and {r["Status"] for r in rows} <= {"pass", "error", "skip"}
    assert not (pytester.path / "msprobe-out" / "test_fb.py_test_clean" / "check0" / "bench").exists()


def test_free_benchmark_mode_is_validated(pytester):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-free-benchmark=to_gpu")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*--msprobe-free-benchmark: expected one of improve_precision, to_cpu*"])
