"""Automatic mixed precision (issue 48): a side run under ``torch.autocast`` (``--msprobe-target-autocast``), and
every call made under autocast judged on its inputs as its kernel saw them (:mod:`msprobe_ci.amp`)."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from msprobe_ci import amp
from msprobe_ci.backends import Backend
from msprobe_ci.errors import MsprobeError
from msprobe_ci.judge import JudgeSettings


def test_the_kernel_sees_its_inputs_in_its_outputs_dtype():
    x, w = torch.randn(4, 8), torch.randn(16, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert amp.autocast_dtype((x, w), {}) == torch.bfloat16
        out = F.linear(x, w)
    args, kw, seen = amp.kernel_inputs((x, w), {}, out)
    assert seen == torch.bfloat16 and [a.dtype for a in args] == [torch.bfloat16, torch.bfloat16]
    assert torch.equal(args[0], x.to(torch.bfloat16)) and args[1].requires_grad and args[1].is_leaf
    assert torch.equal(F.linear(*args), out)  # what the target computed, bit for bit
    # a promote op (fp32 out of mixed inputs): the bf16 input is widened exactly; float64 is never cast
    h = torch.randn(3, dtype=torch.bfloat16)
    args, _, seen = amp.kernel_inputs((h, torch.randn(3), torch.randn(3, dtype=torch.float64)), {}, torch.zeros(3))
    assert seen == torch.float32 and [a.dtype for a in args] == [torch.float32, torch.float32, torch.float64]
    # nothing floating out: nothing cast
    assert amp.kernel_inputs((x,), {}, torch.zeros(2, dtype=torch.long))[2] is None
    # a gradient is as precise as the narrower dtype: an fp32 weight's through a bf16 kernel, a bf16 input's
    # through an fp32 kernel; equal widths take the kernel's
    assert amp.grad_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert amp.grad_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    assert amp.grad_dtype(torch.float16, torch.bfloat16) == torch.bfloat16


def test_autocast_state_is_read_per_device_and_off_outside_it():
    x = torch.randn(2, 2)
    assert amp.autocast_dtype((x,), {}) is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert amp.autocast_dtype((x,), {}) == torch.float16
        assert amp.autocast_dtype((x.double(),), {}) is None  # float64 is not eligible for autocast
        assert amp.autocast_dtype((torch.ones(2, dtype=torch.long),), {}) is None
        with amp.disabled((x,)):
            assert amp.autocast_dtype((x,), {}) is None and F.linear(x, x).dtype == torch.float32


def test_dumps_made_elsewhere_are_inferred_from_dtypes_as_msprobe_does():
    assert amp.infer(["torch.float32", "torch.float32"], ["torch.bfloat16"]) == "torch.bfloat16"
    assert amp.infer(["torch.float32"], ["torch.float32"]) is None
    assert amp.infer(["torch.bfloat16"], ["torch.bfloat16"]) is None
    assert amp.infer(["torch.float64"], ["torch.float16"]) is None


def test_backend_autocast_option():
    b = Backend.from_options("cpu", None, autocast="bf16")
    assert b.autocast == torch.bfloat16 and b.label == "cpu/model-dtype+autocast(bf16)"
    assert Backend.from_options("cpu", None, autocast="fp32").autocast is None
    assert Backend.from_options("cpu", None, autocast="fp16").grad_scaler() is not None and b.grad_scaler() is None
    with pytest.raises(MsprobeError, match="option 'autocast': expected fp16 or bf16"):
        Backend.from_options("cpu", None, autocast="fp64")
    with b.autocast_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def _isolated_under_autocast(model, x, folder, faults=()):
    """One isolated mix-level capture of ``model(x)`` and its backward under bf16 autocast: the Isolator."""
    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    iso = Isolator(backward=True)
    cap = CaptureSession(DumpConfig(dump_path=str(folder), level="mix"), faults=faults, isolator=iso)
    cap.start(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    cap.stop()
    cap.close()
    return iso


def test_isolation_judges_a_gemm_under_autocast_on_what_its_kernel_saw(tmp_path):
    """A linear layer called under bf16 autocast with fp32 weights: judged passing, and its record says which
    dtype it ran under and computed in; a 2% fault on it is named. (Before: every GEMM under autocast failed its
    ULP standard against an oracle fed the unrounded fp32 inputs.)"""
    from msprobe_ci.capture.inject import Fault

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    verdicts = {}
    for name, faults in (("benign", ()), ("fault", (Fault("Functional.linear", 1, "forward", "scale", 1.02),))):
        iso = _isolated_under_autocast(model, x, tmp_path / name, faults)
        verdicts[name] = {k: v for k, v in iso.results.items() if "linear" in k}
        dump = json.loads((tmp_path / name / "step0" / "rank" / "dump.json").read_text())
        assert dump["data"]["Functional.linear.0.forward"]["autocast"] == "torch.bfloat16"
    benign = verdicts["benign"]
    assert {k: v["status"] for k, v in benign.items()} == {f"Functional.linear.{i}.{d}": "pass"
                                                           for i in (0, 1) for d in ("forward", "backward")}
    assert benign["Functional.linear.0.forward"]["autocast"] == "torch.bfloat16"
    assert benign["Functional.linear.0.forward"]["computed_in"] == "torch.bfloat16"
    fault = verdicts["fault"]
    assert fault["Functional.linear.1.forward"]["status"] == "error"
    assert fault["Functional.linear.0.forward"]["status"] == "pass"


class _Scaled(torch.nn.Module):
    """CLIP's and SigLIP's head: a projection under autocast, times a learned fp32 0-d temperature, plus a learned
    fp32 0-d bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(32, 64)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6592))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-9.87))  # not a bf16 number

    def forward(self, x):
        return self.proj(x) * self.logit_scale.exp() + self.logit_bias


def test_a_zero_dim_operand_under_autocast_is_read_as_the_kernel_read_it(tmp_path):
    """A bf16 activation times an fp32 0-d tensor under autocast is a bf16 output; the CPU ``mul`` reads the
    0-d tensor's fp32 value, ``add`` reads it cast to bf16 (``amp.scalar_reading``). Judged against the cast value
    the benign ``mul`` failed its absolute threshold (CLIP's ``logits * logit_scale.exp()``); now both pass over
    several seeds, and a 1% fault on the ``mul`` is named."""
    from msprobe_ci.capture.inject import Fault

    model = _Scaled()
    for seed in range(4):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
        for name, faults in (("benign", ()), ("fault", (Fault("Tensor.__mul__", 0, "forward", "scale", 1.01),))):
            if name == "fault" and seed:
                continue
            iso = _isolated_under_autocast(model, x, tmp_path / f"{name}{seed}", faults)
            status = {k: v["status"] for k, v in iso.results.items()}
            if name == "benign":
                assert status.get("Tensor.__mul__.0.forward") == "pass" and \
                    status.get("Tensor.__add__.0.forward") == "pass", (seed, iso.results.get("Tensor.__mul__.0.forward"))
                assert [k for k, v in status.items() if v == "error"] == [], (seed, status)
            else:
                assert status["Tensor.__mul__.0.forward"] == "error", status


AMP_SUITE = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0, embd_pdrop=0,
                     attn_pdrop=0)
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


class OwnAutocast(torch.nn.Module):
    # a user's model whose forward enters autocast itself: bench and target identical
    def __init__(self):
        super().__init__()
        self.m = gpt2()

    def forward(self, **kw):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.m(**kw)


IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def test_amp_target(msprobe):
    msprobe.check(gpt2().eval(), {"input_ids": IDS, "labels": IDS}, loss_fn=lambda o: o.loss)


def test_own_autocast(msprobe):
    msprobe.check(OwnAutocast().eval(), {"input_ids": IDS, "labels": IDS}, loss_fn=lambda o: o.loss,
                  target_autocast=None)


def test_amp_fault(msprobe):
    msprobe.check(gpt2().eval(), {"input_ids": IDS, "labels": IDS}, loss_fn=lambda o: o.loss, inject="faults.yaml")


def test_fp16_training(msprobe):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": i, "labels": i} for i in (torch.randint(0, 128, (1, 8), generator=g) for _ in range(2))]
    msprobe.check_training(LlamaForCausalLM(cfg), batches, lambda out: out.loss,
                           lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False), target_autocast="fp16")
"""


def test_an_amp_target_passes_against_fp32_and_a_fault_under_it_is_named(pytester):
    pytest.importorskip("transformers")
    pytester.makepyfile(test_amp_suite=AMP_SUITE)
    pytester.makefile(".yaml", faults="faults:\n  - {api: Torch.addmm, call: 2, direction: forward, perturb: scale, "
                                      "value: 1.02}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-autocast=bf16",
                                           "--msprobe-junitxml=j.xml")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_amp_target*cpu/model-dtype vs cpu/model-dtype+autocast(bf16)*error 0*"])
    result.stdout.fnmatch_lines(["*test_amp_fault*error 5, unmatched 0; first divergence: Torch.addmm.2.forward;*"])
    result.stdout.fnmatch_lines(["*msprobe: first divergence at Torch.addmm.2.forward*"])
    result.stdout.fnmatch_lines(["*GradScaler (target): loss scale 65536 at step 0*"])
    assert "error 0" in next(ln for ln in result.outlines if "test_own_autocast [check 0]" in ln)


def _own_loop(folder, dtype=None, autocast=None, faults=None, steps=2):
    """A user's own loop (AdamW, clip_grad_norm_, fp16 with a GradScaler) dumped by PrecisionDebugger."""
    from msprobe_ci import PrecisionDebugger

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    if dtype is not None:
        model = model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu") if autocast == torch.float16 else None
    debugger = PrecisionDebugger(dump_path=str(folder), level="mix", inject=faults)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        debugger.start(model)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(x.to(dtype) if dtype is not None else x).float().pow(2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()


@pytest.mark.parametrize("setup", ["bf16", "amp-bf16", "amp-fp16"])
def test_a_users_own_loop_dumped_over_steps_compares_clean_and_names_a_step_1_fault(tmp_path, setup):
    """Issue 48's table: the user's loop dumped over two steps against an fp32 bench. From step 1 the weights have
    trained apart by rounding: context, not the first divergence (before: step 1 failed on a parameter input)."""
    import subprocess
    import sys

    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.check import judge

    kw = {"bf16": {"dtype": torch.bfloat16}, "amp-bf16": {"autocast": torch.bfloat16},
          "amp-fp16": {"autocast": torch.float16}}[setup]
    _own_loop(tmp_path / "bench")
    _own_loop(tmp_path / "target", **kw)
    _own_loop(tmp_path / "fault", faults=[Fault("Functional.layer_norm", 0, "forward", "scale", 1.02, step=1)], **kw)
    cli = [sys.executable, "-m", "msprobe_ci.cli", "compare", "-gp", str(tmp_path / "bench")]
    done = subprocess.run([*cli, "-tp", str(tmp_path / "target"), "-o", str(tmp_path / "cmp")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if "compare_result_step" in ln]
    assert len(lines) == 2 and all("error 0" in ln for ln in lines), done.stdout
    assert "step 1: parameters and optimizer state are context" in lines[1]
    # the rule is what makes step 1 clean: its sources judged as at step 0, a parameter input fails
    strict, _, _ = judge(str(tmp_path / "bench" / "step1" / "rank"), str(tmp_path / "target" / "step1" / "rank"),
                         JudgeSettings(source_factor=4.0))
    if setup == "bf16":
        assert strict.first_divergence is not None
    done = subprocess.run([*cli, "-tp", str(tmp_path / "fault"), "-o", str(tmp_path / "cmp2")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert "first divergence: step1 rank0 Functional.layer_norm.0.forward" in done.stdout, done.stdout


#: a stock Llama from a small config, for the pytester suites below
LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)
"""

OWN_STEP = LLAMA + """

def state(params):
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), torch.amp.GradScaler("cpu")


def step(model, batch, state):
    # the user's own step: two micro-batches accumulated, fp16 autocast, a GradScaler, clipping, a scheduler
    opt, sched, scaler = state
    opt.zero_grad()
    for half in batch["input_ids"].chunk(2):
        loss = model(input_ids=half, labels=half).loss / 2  # under the side's autocast (target_autocast)
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()
    return loss


def batches():
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 128, (2, 8), generator=g)} for _ in range(2)]


def test_own_step(msprobe):
    r = msprobe.check_training(build(), batches(), None, state, step=step, target_autocast="fp16")
    assert len(r["losses"]["target"]) == 2


def test_own_step_fault(msprobe):
    msprobe.check_training(build(), batches(), None, state, step=step, target_autocast="fp16",
                           inject="faults.yaml")
"""


def test_a_users_own_training_step_with_amp_is_gated(pytester):
    """check_training(step=...): the user's own step (accumulation, a GradScaler, clipping, a scheduler) under fp16
    autocast on the target (``target_autocast`` wraps the whole step) against the same step in fp32 (a GradScaler
    scales by powers of two: exact there): benign passes, a 2% fault at step 1 is named there."""
    pytest.importorskip("transformers")
    pytester.makepyfile(test_own=OWN_STEP)
    pytester.makefile(".yaml", faults="faults:\n  - {api: Functional.silu, call: 1, perturb: scale, value: 1.02, "
                                      "step: 1}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at step 1: Functional.silu.1.forward*"])


def test_a_tensor_dump_made_under_autocast_replays_as_its_kernels_saw_their_inputs(tmp_path):
    """The offline replay (api-check, a tensor dump's verdicts): a call made under bf16 autocast is replayed on its
    inputs cast to bf16, whether our dump recorded it or the dtypes say it (a dump made elsewhere, msprobe's
    inference). Fed the fp32 inputs as dumped, the GEMM failed its standard."""
    from msprobe_ci import PrecisionDebugger
    from msprobe_ci.dump.reader import load_dump
    from msprobe_ci.replay.runner import ApiReplayer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    debugger = PrecisionDebugger(dump_path=str(tmp_path / "dump"), task="tensor", level="L1", isolate=False)
    debugger.start(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(32, 64))
    debugger.stop()
    folder = tmp_path / "dump" / "step0" / "rank"
    result = ApiReplayer(load_dump(str(folder))).check("Functional.linear.0.forward")
    assert result.status == "pass" and result.autocast == "bfloat16 (recorded)", result.message
    assert "[autocast: inputs replayed in bfloat16 (recorded)]" in result.message
    # the same dump as another runner writes it: no autocast field, the dtypes tell
    path = folder / "dump.json"
    dump = json.loads(path.read_text())
    for entry in dump["data"].values():
        entry.pop("autocast", None)
    path.write_text(json.dumps(dump))
    result = ApiReplayer(load_dump(str(folder))).check("Functional.linear.0.forward")
    assert result.status == "pass" and result.autocast == "bfloat16 (inferred)", result.message
    # and what it was before: the fp32 inputs as dumped, against the bf16 output
    replayer = ApiReplayer(load_dump(str(folder)))
    args, kwargs = replayer.arguments("Functional.linear.0.forward")
    gen_targets = replayer._recorded("Functional.linear.0.forward", [
        ("Functional.linear.0.forward.output.0", dump["data"]["Functional.linear.0.forward"]["output"][0])])
    assert replayer.check_inputs("Functional.linear.0.forward", args, kwargs, gen_targets).status == "error"


def test_a_tensor_dump_replays_a_zero_dim_operand_as_its_kernel_read_it(tmp_path):
    """The offline replay of the scaled head above from a tensor dump: the ``mul`` by the fp32 0-d temperature and
    the ``add`` of the fp32 0-d bias pass forward and backward over several inputs, each read as the recorded output
    says its kernel read it (``ApiReplayer._as_read``)."""
    from msprobe_ci import PrecisionDebugger
    from msprobe_ci.dump.reader import load_dump
    from msprobe_ci.replay.runner import ApiReplayer

    model = _Scaled()
    for seed in range(4):
        debugger = PrecisionDebugger(dump_path=str(tmp_path / f"dump{seed}"), task="tensor", level="L1",
                                     isolate=False)
        debugger.start(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))).float().pow(2).mean().backward()
        debugger.stop()
        replayer = ApiReplayer(load_dump(str(tmp_path / f"dump{seed}" / "step0" / "rank")))
        for name in ("Tensor.__mul__.0.forward", "Tensor.__add__.0.forward", "Tensor.__mul__.0.backward"):
            result = replayer.check(name)
            assert result.status == "pass", (seed, name, result.message)


SCALER = LLAMA + """
import pytest

from msprobe_ci.backends import Backend


@pytest.fixture(autouse=True)
def huge_loss_scale(monkeypatch):
    # a loss scale of 2^40: fp16 scaled gradients overflow, the scaler skips and halves it each step
    monkeypatch.setattr(Backend, "grad_scaler", lambda self: torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
                        if self.autocast == torch.float16 else None)


def batches(n):
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": i, "labels": i} for i in (torch.randint(0, 128, (1, 8), generator=g) for _ in range(n))]


def adamw(p):
    return torch.optim.AdamW(p, lr=1e-2, foreach=False)


def test_two_skips(msprobe):
    msprobe.check_training(build(), batches(2), lambda o: o.loss, adamw, target_autocast="fp16")


def test_three_skips(msprobe):
    msprobe.check_training(build(), batches(3), lambda o: o.loss, adamw, target_autocast="fp16")


def own_state(p):  # the user's own scaler, in the state their factory returns
    return adamw(p), torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)


def own_step(model, batch, state):
    opt, scaler = state
    opt.zero_grad()
    loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def test_own_two_skips(msprobe):
    msprobe.check_training(build(), batches(2), None, own_state, step=own_step, target_autocast="fp16")


def test_own_three_skips(msprobe):
    msprobe.check_training(build(), batches(3), None, own_state, step=own_step, target_autocast="fp16")
"""


def test_steps_the_grad_scaler_skips_are_reported_and_only_a_run_of_them_fails(pytester):
    """A step whose fp16 scaled gradients overflow is skipped by the GradScaler: reported with the loss scale,
    its overflow not failed on; ``scaler_skips`` (3) skips in a row fail the check, naming the steps and scales.
    The same with the user's own step and scaler."""
    pytest.importorskip("transformers")
    pytester.makepyfile(test_scaler=SCALER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    # the user's own step: their GradScaler found in the state, its skips read from its scale (the fp32 bench,
    # scaled the same, skips none: its steps stay aligned with the target's by number)
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert out.count("GradScaler (target): loss scale 1.09951e+12 at step 0, 5.49756e+11 at the last step; steps "
                     "skipped by the scaler (inf/NaN in the scaled gradients): [0, 1]\n") == 2, out
    assert "GradScaler (bench): loss scale 1.09951e+12 at step 0, 1.09951e+12 at the last step; steps skipped by " \
           "the scaler (inf/NaN in the scaled gradients): none" in out, out
    for name in ("test_three_skips", "test_own_three_skips"):
        assert f"FAILED test_scaler.py::{name} - Failed: msprobe: the target's G" in out, out
    assert "msprobe: the target's GradScaler skipped 3 optimizer steps in a row (steps [0, 1, 2]" in out, out


def test_the_free_benchmark_reruns_a_call_under_autocast_as_its_kernel_saw_it(pytester):
    """The free benchmark (no bench side) on an AMP target: each call made under autocast is rerun after it, on its
    inputs cast to the dtype it computed in, autocast off (before: its higher-precision rerun ran under autocast
    too and was cast back down, so a bf16 GEMM of bf16 inputs was compared with itself, and a 2% fault on
    ``Torch.matmul.0`` came with a second call at risk). Benign passes; the fault is the one call at risk."""
    pytest.importorskip("transformers")
    pytester.makepyfile(test_amp_suite=AMP_SUITE)
    pytester.makefile(".yaml", mm="faults:\n  - {api: Torch.matmul, call: 0, perturb: scale, value: 1.02}\n")
    args = ("-p", "no:cacheprovider", "--msprobe-free-benchmark", "--msprobe-target-autocast=bf16",
            "-k", "test_amp_target")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess(*args, "--msprobe-inject=mm.yaml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: free benchmark: 1 API call(s) at risk on cpu/model-dtype+autocast(bf16); "
                                 "first: Torch.matmul.0.forward.output.0*"])


def _gpt2_l0_amp(tmp_path, autocast, fault, kernel="upcast"):
    """GPT-2 (2 layers) at L0 with its target under ``torch.autocast`` (fp32 weights), the ``upcast`` bench: the
    isolated check's first divergence."""
    import transformers

    from msprobe_ci.check.outcome import judge
    from msprobe_ci.check.sides import run_side
    from msprobe_ci.compare.verdict import unit_roundoff
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    torch.manual_seed(7)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0,
                                  embd_pdrop=0, attn_pdrop=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(8))
    inputs = ({"input_ids": ids, "labels": ids},)
    bench, target = Backend.from_options("cpu", "fp32"), Backend.from_options("cpu", "fp32", autocast=autocast)
    cfg = DumpConfig(task="statistics", level="L0")
    b = run_side(model, inputs, lambda o: o.loss, bench, cfg.with_overrides(dump_path=str(tmp_path / "b")))
    t = run_side(model, inputs, lambda o: o.loss, target, cfg.with_overrides(dump_path=str(tmp_path / "t")),
                 faults=(fault,) if fault else (), isolator=Isolator(backward=True, bench_kernel=kernel))
    report, _, _ = judge(b.folder, t.folder, JudgeSettings(isolate=True, cast_roundoff=unit_roundoff(
        str(target.autocast), "torch.float32")))
    return report


@pytest.mark.parametrize("autocast, kernel", [("bf16", "upcast"), ("fp16", "upcast")])
def test_a_whole_module_under_autocast_is_budgeted_as_its_calls_computed(tmp_path, autocast, kernel):
    """L0 under autocast: a GPT-2 block is no kernel of one dtype (its GEMMs in bf16/fp16, its norms, softmax and
    residual adds in fp32). Budgeted as fp32 throughout, the benign block failed against the upcast bench (max
    relative error ratio 102 in bf16, 11.9 in fp16); budgeted per call (kernels.amp_sites) it passes, and a 2%
    fault on one of its GEMMs, forward or backward, is named at the innermost module around it."""
    from msprobe_ci.capture.inject import Fault

    report = _gpt2_l0_amp(tmp_path / "benign", autocast, None, kernel)
    assert report.first_divergence is None, report.first_divergence.message
    for direction in ("forward", "backward"):
        report = _gpt2_l0_amp(tmp_path / direction, autocast, Fault("Torch.addmm", 5, direction, "scale", 1.02),
                              kernel)
        first = report.first_divergence
        assert first is not None and first.name == f"Module.transformer.h.1.attn.c_proj.Conv1D.{direction}.0", \
            first and first.message


def test_autocast_sites_pair_the_budgets_calls_with_the_targets_and_round_each_in_its_dtype():
    """kernels.amp_sites: the target's run notes the dtype each call computed in; the float64 budget run's calls
    are paired with them by name, also where code branches on a dtype (an extra cast in one run only), and only
    the paired GEMMs (and the unpaired calls whose name always computed in bf16) round at bf16's roundoff."""
    from msprobe_ci import kernels
    from msprobe_ci.kernels import amp_sites

    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)
    x = torch.randn(4, 16, dtype=torch.float64)

    def block(x, w1, w2):
        h = F.linear(x, w1)
        if h.dtype != w2.dtype:  # T5's feed-forward casts back where autocast left it in bf16
            h = h.to(w2.dtype)
        return x + F.linear(torch.tanh(h), w2)
    fp32 = (x.float(), w1.float(), w2.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        target = amp_sites.record_sites(lambda: block(*fp32))
    assert [(s.name.split(".")[-1], s.kernel) for s in target] == [
        ("linear", torch.bfloat16), ("to", torch.float32), ("tanh", torch.float32), ("linear", torch.bfloat16),
        ("add", torch.float32)]
    gen = torch.Generator().manual_seed(0)
    perturb = kernels.perturbation(torch.float64, [x.float()], gen)
    sites = amp_sites.Sites(target, torch.float32, lambda d: kernels.precision_of(torch.float64, d, True), gen)
    with sites:
        base = block(x, w1, w2)
    assert sites.plan() == {"paired": 4, "unpaired": 0, "low": 2}
    assert [s.name.split(".")[-1] for s in sites.kernels] == ["linear", "tanh", "linear", "add"]

    def spread(sites):
        import contextlib

        diffs = []
        for _ in range(8):
            with contextlib.ExitStack() as stack:
                kernels.budget_modes(stack, perturb)
                if sites is not None:
                    stack.enter_context(sites)
                diffs.append((block(x, w1, w2) - base).norm() / base.norm())
        return float(torch.stack(diffs).mean())
    as_fp32, as_amp = spread(None), spread(sites)
    # the bf16 GEMMs' roundings (2^-8) against fp32's (2^-24): the spread grows by about 2^16
    assert 2.0 ** -12 < as_amp < 2.0 ** -6 and as_amp > 1e4 * as_fp32, (as_fp32, as_amp)
    # where the target's calls cannot be run again: every call rounded in the autocast dtype, wider still
    everywhere = amp_sites.Sites.everywhere(torch.bfloat16, torch.float32,
                                            lambda d: kernels.precision_of(torch.float64, d, True), gen)
    with everywhere:
        block(x, w1, w2)
    assert everywhere.plan()["low"] == 4 and spread(everywhere) > as_amp


def test_t5_under_fp16_autocast_at_l0_passes_its_decoder_blocks(tmp_path):
    """T5 at L0 under fp16 autocast: its decoder blocks take an fp32 causal mask (fp64's lowest value in the budget's
    float64 runs) into a scaled-dot-product attention autocast runs in fp16. The budget rounds that cast; done as
    ``x + (rounded - x)`` inside the budget's modes it made ``-inf - -inf``, the attention's rows NaN and the
    block's budget 0 (max relative error ratio 311 with no fault). (bf16 autocast, same seed: below.)"""
    from test_sensitivity import t5_l0

    report, folder = t5_l0(tmp_path, Backend.from_options("cpu", "fp32", autocast="fp16"), "upcast")
    assert report.first_divergence is None, report.first_divergence.message
    with open(os.path.join(folder, "isolation.json"), encoding="utf-8") as fh:
        nodes = json.load(fh)["nodes"]
    assert nodes["Module.decoder.block.1.T5Block.forward.0"]["status"] == "pass"


@pytest.mark.parametrize("kernel", ["upcast", "rounded", "device"])
def test_a_relu_network_under_bf16_autocast_takes_the_targets_side_of_its_kinks_at_l0(tmp_path, kernel):
    """T5 at L0 under bf16 autocast: the input casts of its feed-forward's first GEMM move a ReLU's pre-activation
    by about a rounding of its terms, and the target lands on the other side of 0 than the float64 oracle for 4 of
    4,096 units, within one spread of the budget's draws (none of the 8 draws flipped them). Each flip moves that
    token's input gradient by a whole term: the benign feed-forward failed (max relative error ratio 45.9 > 10).
    Judged once more against the oracle on the target's side of those kinks (kernels.kinks) it passes, saying so;
    a 2% fault on the ReLU's output is named there, and the feed-forward around it, judged on the target's side
    of its kinks, still fails (against the ``device`` bench too, whose own run is kept as the bench)."""
    from msprobe_ci.capture.inject import Fault
    from test_sensitivity import t5_l0

    ffn = "Module.encoder.block.0.layer.1.DenseReluDense"
    if kernel != "device":
        report, folder = t5_l0(tmp_path / "benign", Backend.from_options("cpu", "fp32", autocast="bf16"), kernel)
        assert report.first_divergence is None, report.first_divergence.message
        with open(os.path.join(folder, "isolation.json"), encoding="utf-8") as fh:
            node = json.load(fh)["nodes"][f"{ffn}.T5DenseActDense.backward.0"]
        assert node["status"] == "pass" and "oracle on the target's side of 4 kink inputs" in node["message"], node
    if kernel == "rounded":
        return
    report, folder = t5_l0(tmp_path / "fault", Backend.from_options("cpu", "fp32", autocast="bf16"), kernel,
                           faults=[Fault("Functional.relu", 0, "forward", "scale", 1.02)])
    first = report.first_divergence
    assert first is not None and first.name == f"{ffn}.act.ReLU.forward.0", first and first.message
    with open(os.path.join(folder, "isolation.json"), encoding="utf-8") as fh:
        node = json.load(fh)["nodes"][f"{ffn}.T5DenseActDense.forward.0"]
    assert node["status"] == "error" and "target's side" in node["message"], node


def test_a_fault_on_a_blocks_fp32_residual_under_autocast_is_named_at_l0(tmp_path):
    """A GPT-2 block under bf16 autocast returns fp32 tensors whose errors are its bf16 GEMMs': judged against
    fp32's floors (msprobe's ``min_err`` 2^-14) with a budget of bf16 roundings, a 2% fault on its fp32 residual
    add read a ratio of 0.005 and nothing failed; judged as a bf16 result (``ModuleIsolation.computed_in``) the block
    fails and is named, here against the ``device`` bench."""
    from msprobe_ci.capture.inject import Fault

    report = _gpt2_l0_amp(tmp_path, "bf16", Fault("Tensor.__add__", 2, "forward", "scale", 1.02), "device")
    first = report.first_divergence
    assert first is not None and first.name == "Module.transformer.h.0.GPT2Block.forward.0", first


def _t5_loop(folder, autocast, seed=6, steps=3):
    """A user's own T5 training loop (AdamW, ``steps`` steps, fresh batches each), under bf16 autocast or none,
    its last step dumped at L0 by PrecisionDebugger with the upcast bench kernel."""
    import transformers
    from _loops import debugged_loop

    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=256, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0)).train()
    g = torch.Generator().manual_seed(11)
    batches = [{"input_ids": torch.randint(3, 256, (2, 24), generator=g),
                "labels": torch.randint(3, 256, (2, 12), generator=g)} for _ in range(steps)]
    debugged_loop(model, batches, folder, autocast, level="L0", bench_kernel="upcast", step=[steps - 1])
    return os.path.join(folder, f"step{steps - 1}", "rank")


def test_the_targets_side_of_a_kink_is_read_off_a_run_that_requires_grad_as_the_target_did(tmp_path):
    """A user's own T5 loop under bf16 autocast, dumped at L0, step 2: the target's side of each ReLU was read off
    a run of the block without gradients, whose attention took another CPU kernel path than the target's (whose
    parameters require grad) and moved the feed-forward's pre-activations by a bf16 rounding: one unit at 0.00081 in
    the target sat at -0.00007 there. The oracle was not put on the target's side of it, and that token's input
    gradient row of the encoder's first block missed by a whole term (max relative error ratio 18.8 > 10, no
    fault). The side is read off a run that requires grad where the target's tensors did."""
    from msprobe_ci.check import judge
    from msprobe_ci.compare.verdict import unit_roundoff

    bench, target = _t5_loop(tmp_path / "bench", False), _t5_loop(tmp_path / "target", True)
    report, _, _ = judge(bench, target, JudgeSettings(isolate=True, cast_roundoff=unit_roundoff(
        "torch.bfloat16", "torch.float32")).for_step(2))
    assert not [n.message for n in report.nodes if n.status == "error"]
    with open(os.path.join(target, "isolation.json"), encoding="utf-8") as fh:
        node = json.load(fh)["nodes"]["Module.encoder.block.0.T5Block.backward.0"]
    assert node["status"] == "pass" and "oracle on the target's side of" in node["message"], node


class _ProjectedNorm(torch.nn.Module):
    """LeViT's ``MLPLayerWithBN``: a Linear without bias into a training BatchNorm1d over the flattened tokens."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 32, bias=False)
        self.norm = torch.nn.BatchNorm1d(32)

    def forward(self, x):
        h = self.linear(x)
        return self.norm(h.flatten(0, 1)).reshape_as(h)


class _ProjectedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 16)
        self.proj = _ProjectedNorm()
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.proj(self.embed(x)))


def _scaled_fp16_loop(folder, amp: bool, faults=(), steps=2):
    """A user's own loop over ``_ProjectedNet`` (batch 2, one token), under fp16 autocast with a default
    ``GradScaler`` (loss scale 65536) or plain fp32, every step dumped at L0 with the upcast bench kernel; the
    projection's first output channel has zero weights (a channel the batch norm sees as constant)."""
    from msprobe_ci import PrecisionDebugger

    torch.manual_seed(0)
    model = _ProjectedNet()
    with torch.no_grad():
        model.proj.linear.weight[0] = 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    scaler = torch.amp.GradScaler("cpu") if amp else None
    dbg = PrecisionDebugger(dump_path=str(folder), level="L0", bench_kernel="upcast", inject=list(faults))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(2, 1, 16, generator=g), torch.randn(2, 1, 4, generator=g)
        dbg.start(model)
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = F.mse_loss(model(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        dbg.stop()
        dbg.step()
    return scaler


def test_an_overflow_every_correct_fp16_run_makes_inside_a_module_is_no_false_fail_at_l0(tmp_path):
    """LeViT under fp16 autocast with a GradScaler, in its own loop at L0: a batch norm over two samples whose
    channel is constant hands its Linear a gradient 316 times (1/sqrt(eps)) the incoming one, past fp16's range at
    the loss scale. The target holds that gradient in fp16, so it is infinite there and the module's input
    gradient NaN (the scaler skips the step); the float64 oracle of the whole module held it finite, and the
    module failed ("inf/nan positions differ") at every step. Its oracle, run again holding every intermediate and
    every gradient in the range of the dtype the target held it in (``kernels.amp_sites.Ranges``), overflows as
    the target does: the module passes and says so, at every step, and a 2% fault on the head is still named."""
    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.check import judge
    from msprobe_ci.compare.verdict import unit_roundoff

    _scaled_fp16_loop(tmp_path / "bench", False)
    scaler = _scaled_fp16_loop(tmp_path / "target", True)
    assert scaler.get_scale() == 2.0 ** 14  # both steps overflowed and were skipped
    _scaled_fp16_loop(tmp_path / "fault", True, [Fault("Functional.linear", 2, "forward", "scale", 1.02)])
    settings = JudgeSettings(isolate=True, cast_roundoff=unit_roundoff("torch.float16", "torch.float32"))
    node = "Module.proj._ProjectedNorm.backward.0"
    for step in range(2):
        folder = os.path.join(tmp_path, "target", f"step{step}", "rank")
        report, _, _ = judge(os.path.join(tmp_path, "bench", f"step{step}", "rank"), folder,
                             settings.for_step(step))
        assert not [n.message for n in report.nodes if n.status == "error"], step
        with open(os.path.join(folder, "isolation.json"), encoding="utf-8") as fh:
            nodes = json.load(fh)["nodes"]
        assert node in nodes, sorted(nodes)
        record = nodes[node]
        assert record["status"] == "pass" and "oracle held in the range of the target's dtypes" in \
            record["message"], record
        report, _, _ = judge(os.path.join(tmp_path, "bench", f"step{step}", "rank"),
                             os.path.join(tmp_path, "fault", f"step{step}", "rank"), settings.for_step(step))
        first = report.first_divergence
        assert first is not None and first.name == "Module.head.Linear.forward.0", first and first.message


class _Shifted(torch.nn.Module):
    """``x * scale + shift``, a pure fp16 module."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((64,), 1.9814453125))
        self.shift = torch.nn.Parameter(torch.full((64,), 16.0))

    def forward(self, x):
        return x * self.scale + self.shift


def test_an_overflow_within_the_budgets_reach_of_fp16s_largest_value_is_no_false_fail_at_l0(tmp_path):
    """A pure fp16 module whose exact result is 65,514.7, under the 65,520 that rounds to infinity: its product
    rounds up to 65,504 first and the sum overflows. Either is an outcome of a correct fp16 computation (a
    rounding decides it), but the oracle, holding the product in fp16's range, stays finite and the module failed
    ("inf/nan positions differ"; a LeViT stage in fp16 reached 92% of the range in its oracle and the target
    overflowed). The budget's draws, held in range, overflow there too, so the oracle takes that infinity: the
    module passes and says so, and a 2% fault on its product still fails it."""
    from msprobe_ci import PrecisionDebugger
    from msprobe_ci.capture.inject import Fault

    g = torch.Generator().manual_seed(0)
    x = (100 * torch.randn(2, 64, generator=g)).to(torch.float16)
    x[0, 0] = 33056.0  # 33056 * 1.9814453125 = 65498.66: 65504 in fp16, and + 16 rounds to inf
    model = torch.nn.Sequential(_Shifted()).half()
    assert torch.isinf(model(x)[0, 0]) and float(x[0, 0].double() * 1.9814453125 + 16) < 65520
    node = "Module.0._Shifted.forward.0"
    verdicts = {}
    for name, faults in (("benign", []), ("fault", [Fault("Tensor.__mul__", 0, "forward", "scale", 1.02)])):
        dbg = PrecisionDebugger(dump_path=str(tmp_path / name), level="L0", bench_kernel="upcast", inject=faults)
        dbg.start(model)
        with torch.no_grad():
            model(x)
        dbg.stop()
        with open(tmp_path / name / "step0" / "rank" / "isolation.json", encoding="utf-8") as fh:
            verdicts[name] = json.load(fh)["nodes"][node]
    benign = verdicts["benign"]
    assert benign["status"] == "pass" and "draws of the budget overflow, as the target did" in benign["message"], \
        benign
    assert verdicts["fault"]["status"] == "error", verdicts["fault"]


def _isolated_fp16_conv(folder, x, up, faults=()):
    """An fp16 1x1 convolution (48 -> 8 channels, no bias) captured at mix with isolation, its backward from
    ``up``: the Isolator's verdicts."""
    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    torch.manual_seed(0)
    model = torch.nn.Conv2d(48, 8, 1, bias=False)
    with torch.no_grad():
        model.weight.mul_(0.5)
    model = model.half()
    iso = Isolator(backward=True, bench_kernel="upcast")
    cap = CaptureSession(DumpConfig(dump_path=str(folder), level="mix"), faults=faults, isolator=iso)
    cap.start(model)
    model(x).backward(up)
    cap.stop()
    cap.close()
    return iso.results["Functional.conv2d.0.backward"], model.weight.grad


def test_an_fp16_convolution_backward_may_overflow_where_its_partial_sums_pass_the_range(tmp_path):
    """Under a loss scale, an fp16 weight gradient whose exact value is in range (14,000-18,000) is the sum of
    terms whose magnitudes add up to 120,000-230,000: PyTorch's CPU kernel, adding them in fp16, overflows on the
    way and returns inf (a ``GradScaler`` then skips the step), where the upcast bench is finite. That is an
    outcome of a correct kernel holding its sums in the dtype, and the call passes (it failed "inf/nan positions
    differ from the bench", MobileNetV2's own loop at every step); an infinity where the terms' magnitudes stay
    in range is still a failure."""
    from msprobe_ci.capture.inject import Fault

    g = torch.Generator().manual_seed(0)
    x = (torch.rand(2, 48, 8, 8, generator=g) + 0.5).half()
    up = torch.empty(2, 8, 8, 8)
    up[0], up[1] = 1500.0, -1400.0
    up = (up * (1 + 0.01 * torch.randn(up.shape, generator=g))).half()
    verdict, grad = _isolated_fp16_conv(tmp_path / "scaled", x, up)
    if bool(torch.isinf(grad).any()):  # this CPU's kernel holds its sums in fp16 (kernels.cpu_half_held)
        assert verdict["status"] == "pass", verdict["message"]
    # in range everywhere (terms' magnitudes under 1,000): a fault that overflows the gradient fails
    small = (torch.randn(2, 8, 8, 8, generator=g)).half()
    verdict, grad = _isolated_fp16_conv(tmp_path / "fault", x, small,
                                        (Fault("Functional.conv2d", 0, "backward", "scale", 1e6),))
    assert bool(torch.isinf(grad).any())
    assert verdict["status"] == "error", verdict["message"]
