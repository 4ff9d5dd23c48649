"""Standalone reproductions of modules isolated whole (issue 52): at L0 (and in a ``torch.compile`` region) the
gate judges modules, not API calls; a failing one writes ``repro/<node>.py`` whose code is its tapes
(:mod:`msprobe_ci.replay.tape`), which re-runs it alone, without the model, with the gate's values."""

from __future__ import annotations

import json
import os

import pytest
import torch

from msprobe_ci import repro
from msprobe_ci.backends import Backend
from msprobe_ci.capture import CaptureSession
from msprobe_ci.capture.inject import Fault
from msprobe_ci.capture.naming import counted
from msprobe_ci.capture.repro import Reproducer
from msprobe_ci.check.outcome import judge
from msprobe_ci.check.sides import run_side
from msprobe_ci.compare.verdict import unit_roundoff
from msprobe_ci.config import DumpConfig
from msprobe_ci.errors import MsprobeError
from msprobe_ci.isolate import Isolator
from msprobe_ci.judge import JudgeSettings
from msprobe_ci.replay import tape
from test_repro import _json, _llama, _run, _write


def _gate_l0(tmp_path, fault, dtype, kernel):
    """The L0 isolated check of a small Llama (fp32 bench): (first divergence, the target's step folder)."""
    model, inputs, loss_fn = _llama()
    bench, target = Backend.from_options("cpu", "fp32"), Backend.from_options("cpu", dtype)
    cfg = DumpConfig(task="statistics", level="L0")
    b = run_side(model, inputs, loss_fn, bench, cfg.with_overrides(dump_path=os.path.join(tmp_path, "bench")))
    t = run_side(model, inputs, loss_fn, target, cfg.with_overrides(dump_path=os.path.join(tmp_path, "target")),
                 faults=(fault,) if fault is not None else (), isolator=Isolator(backward=True, bench_kernel=kernel))
    report, _, _ = judge(b.folder, t.folder, JudgeSettings(isolate=True, cast_roundoff=unit_roundoff(
        str(target.dtype), "torch.float32")))
    return report.first_divergence, t.folder


@pytest.mark.parametrize("fault, dtype, kernel, node", [
    (Fault("Functional.linear", 3, "forward", "scale", 1.02), "bf16", "device",
     "Module.model.layers.0.self_attn.o_proj.Linear.forward.0"),
    # a module given a KV-cache object: the tape holds the calls the module made, the object is not kept
    (Fault("Functional.scaled_dot_product_attention", 0, "forward", "scale", 1.02), "bf16", "device",
     "Module.model.layers.0.self_attn.LlamaAttention.forward.0"),
    (Fault("Functional.linear", 5, "backward", "scale", 1.02), "bf16", "rounded",
     "Module.model.layers.0.mlp.up_proj.Linear.backward.0"),
])
def test_a_failing_module_reproduces_alone_with_the_gates_values(tmp_path, fault, dtype, kernel, node):
    first, folder = _gate_l0(tmp_path, fault, dtype, kernel)
    assert first is not None and first.name == node
    nodes = _json(os.path.join(folder, "isolation.json"))["nodes"]
    record = nodes[node]
    script = os.path.join(folder, "repro", node + ".py")
    assert record["repro"] == script, record.get("repro")
    spec = _json(script[:-3] + ".json")
    assert spec["kind"] == "module" and spec["module"]["target"] == "replayed"
    assert [f["api"] for f in spec["faults"]] == [fault.api] and spec["faults"][0]["call"] == fault.call
    # one tape per precision the gate ran the module in: its oracle (fp32 for a bf16 module), the error
    # budget's fp64 and its own bf16
    assert sorted({s[0] for t in spec["module"]["tapes"] for s in t["signature"]}) == ["bfloat16", "float32",
                                                                                       "float64"]
    # the modules around it fail too and point at it
    for other, rec in nodes.items():
        if rec.get("status") == "error" and other != node and other.split(".")[-2] == node.split(".")[-2]:
            assert rec["repro"].startswith("not written: ") and "inside it fails too" in rec["repro"], rec
    rc, out, text = _run(script)
    assert rc == 1 and out["status"] == "error", text
    assert "module rebuilt from its tapes" in text and "target replayed" in text, text
    assert out["message"] == record["message"]
    for k, v in record["metrics"].items():  # every metric, to the printed digits
        assert out[k] == repro._fmt(v), (k, out[k], v)
    rc, out, text = _run(script, "--no-fault")
    assert rc == 0 and out["status"] == "pass", text


class _Block(torch.nn.Module):
    """Exercises what a tape must follow: an in-place write, an indexed write, a property view, a call that returns
    no tensor, a structured return, a buffer and a plain tensor attribute (a constant)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("shift", torch.linspace(-1, 1, 8))
        self.table = torch.arange(8.0)  # not registered: a constant of the run

    def forward(self, x, scale=1.0):
        h = self.fc(x).mul_(scale)
        h[..., : h.size(-1) // 2] = h[..., : h.size(-1) // 2].tanh()
        w = (h.T @ h).mT + self.table
        top = torch.max(w, dim=-1)
        return {"out": torch.nn.functional.gelu(h + self.shift), "top": top.values, "idx": top.indices}


def _taped(module, args, kwargs):
    """Record one run of ``module``: (tape, tensors, the run's output)."""
    tensors, keys, grads = {}, {}, {}
    from msprobe_ci.replay.repro_files import _encode

    enc_args = _encode(list(args), tensors, keys, grads, opaque=True)
    enc_kwargs = _encode(dict(kwargs), tensors, keys, grads, opaque=True)
    state = dict(module.named_parameters()) | dict(module.named_buffers())
    env = {f"state.{n}": v for n, v in state.items()}
    tape.bind(enc_args, list(args), env)
    tape.bind(enc_kwargs, kwargs, env)
    rec = tape.Recorder({id(t): k for k, t in env.items()}, tensors, 0, counted)
    with rec:
        out = module(*args, **kwargs)
    assert rec.broken is None, rec.broken
    taped = {"signature": [], "calls": rec.calls, "output": _encode(out, tensors, rec.keys, {}, None, rec.prefix)}
    return json.loads(json.dumps(taped)), tensors, env, out


def test_a_tape_replays_its_run_bit_for_bit_and_numbers_calls_as_capture_does():
    torch.manual_seed(0)
    module = _Block()
    x = torch.randn(4, 8, requires_grad=True)
    taped, tensors, env, out = _taped(module, (x,), {"scale": 0.5})
    names = [c.get("name") for c in taped["calls"]]
    assert "size" not in json.dumps(taped["calls"])  # a call returning no tensor is not kept
    assert names.count("Functional.linear") == 1 and "Tensor.__matmul__" in names
    assert any(c.get("property") == "T" for c in taped["calls"])
    assert any(c.get("function", {}).get("api") == "__setitem__" for c in taped["calls"])
    assert [k for k in tensors if k.startswith("c0_")], "the plain tensor attribute is saved as a constant"
    replayed = tape.replay(taped, {**tensors, **env})
    for k in ("out", "top", "idx"):
        assert torch.equal(replayed[k], out[k]), k
    # gradients flow through the replay as through the module
    g = torch.autograd.grad(replayed["out"].sum(), x)[0]
    assert torch.equal(g, torch.autograd.grad(module(x, scale=0.5)["out"].sum(), x)[0])
    # a fault is applied at the call the gate's capture numbers as it (its first call index plus its own)
    faulted = tape.replay(taped, {**tensors, **env}, {"Functional.gelu": 7},
                          (Fault("Functional.gelu", 7, "forward", "scale", 2.0),))
    assert torch.equal(faulted["out"], out["out"] * 2) and torch.equal(faulted["top"], out["top"])


def test_a_run_the_tape_cannot_follow_is_refused():
    class Raw(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten.mul.Tensor(x, 1.5)  # an ATen op: not a torch API the allowlist names

    x = torch.randn(3)
    rec = tape.Recorder({id(x): "t0"}, {}, 0, counted)
    with rec:
        Raw()(x)
    assert rec.broken is not None and "not a torch API" in rec.broken

    class Sneaky(torch.nn.Module):
        def forward(self, x):
            return x.grad  # .grad is no view of the tensor

    x = torch.randn(3, requires_grad=True)
    x.grad = torch.ones(3)
    rec = tape.Recorder({id(x): "t0"}, {}, 0, counted)
    with rec:
        Sneaky()(x)
    assert rec.broken is not None and "property grad" in rec.broken


def test_a_tape_is_data(tmp_path):
    first, folder = _gate_l0(tmp_path, Fault("Functional.linear", 3, "forward", "scale", 1.02), "bf16", "device")
    script = os.path.join(folder, "repro", first.name + ".py")
    spec_path = script[:-3] + ".json"
    spec = _json(spec_path)

    def refused(mutate, match):
        bad = json.loads(json.dumps(spec))
        mutate(bad)
        _write(spec_path, json.dumps(bad))
        with pytest.raises(MsprobeError, match=match):
            repro.run(script)

    def function(s):
        s["module"]["tapes"][0]["calls"][0]["function"] = {"prefix": "Torch", "api": "load"}
    refused(function, r"tapes\[0\]\.calls\[0\]'?: field 'function': Torch\.load is not on the replay allowlist")

    def prop(s):
        s["module"]["tapes"][0]["calls"][0] = {"property": "__class__", "args": [], "kwargs": {}}
    refused(prop, "field 'property': expected one of")

    def state(s):
        s["module"]["state"][0]["key"] = "../../etc/passwd"
    refused(state, r"field 'module.state\[0\]': expected a name and a saved tensor's key")

    def first_calls(s):
        s["module"]["first"] = {"Functional.linear": "3; rm -rf /"}
    refused(first_calls, "field 'module.first'")
    _write(spec_path, json.dumps(spec))
    with pytest.raises(MsprobeError, match="runs on the gate's target device"):
        repro.run(script, target_device="meta")
    rc, out, text = _run(script)
    assert rc == 1 and "Traceback" not in text


def test_a_target_the_tape_does_not_give_is_judged_as_the_gate_saw_it(tmp_path):
    """A target kernel whose values are not the eager module's (a compiled region's fused kernel; here the gate
    is handed an output 3% off): the reproduction saves the gate's target values and judges them, with the same
    values as the gate, and says why --no-fault cannot remove anything."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).bfloat16()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    iso = Isolator(backward=False)
    session = CaptureSession(DumpConfig(task="statistics", level="L0", dump_path=str(tmp_path)), isolator=iso)
    iso.attach(reproducer=Reproducer(session))
    call = iso.module_before("Module.block.Sequential.forward.0", module, (x,), {}, input_sources=False)
    iso.module_after(call, module(x) * 1.03)
    record = iso.results["Module.block.Sequential.forward.0"]
    assert record["status"] == "error" and record["repro"].endswith(".py"), record
    spec = _json(record["repro"][:-3] + ".json")
    assert spec["module"]["target"] == "recorded" and "differs from the gate's target" in spec["module"]["why"]
    rc, out, text = _run(record["repro"])
    assert rc == 1 and out["message"] == record["message"], text
    for k, v in record["metrics"].items():
        assert out[k] == repro._fmt(v), (k, out[k], v)
    assert "--no-fault cannot remove a fault" in text


def test_no_fault_refuses_a_target_recorded_with_its_fault(tmp_path):
    """A faulted module whose tape, replayed with the fault, does not give the gate's target values (here the gate
    is handed an output 3% off, not the fault's 50%): the reproduction judges the gate's recorded values, which
    hold the fault. Without it there is no target to judge, so ``--no-fault`` exits 2 saying so; judging the
    recorded values reported the fault's own failure as the module's without it (T5 under bf16 autocast, a backward
    fault on a residual add: mean_rel_err ratio 2.58 "without the fault")."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).bfloat16()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    iso = Isolator(backward=False)
    session = CaptureSession(DumpConfig(task="statistics", level="L0", dump_path=str(tmp_path)), isolator=iso,
                             faults=[Fault("Functional.linear", 0, "forward", "scale", 1.5)])
    iso.attach(reproducer=Reproducer(session))
    call = iso.module_before("Module.block.Sequential.forward.0", module, (x,), {}, input_sources=False)
    iso.module_after(call, module(x) * 1.03)
    record = iso.results["Module.block.Sequential.forward.0"]
    spec = _json(record["repro"][:-3] + ".json")
    assert spec["faults"] and spec["module"]["target"] == "recorded" and "clean" not in spec["module"], spec
    rc, out, text = _run(record["repro"])
    assert rc == 1 and out["message"] == record["message"], text
    rc, _, text = _run(record["repro"], "--no-fault")
    assert rc == 2 and "recorded with the fault" in text and "--no-fault cannot leave it out" in text, text



def test_the_target_is_replayed_with_its_parameters_requiring_grad_as_a_reproduction_replays_it(tmp_path):
    """T5 at L0 under bf16 autocast, a 2% fault on the first attention's output: the reproduction's rebuilt module
    replays the target on parameters that require grad (as the model's did), where a CPU kernel takes another
    path than on detached copies. Checked against the gate on detached copies, the tape did not give the gate's
    target ("its tape's output 0 differs") and the gate's values were saved instead; checked as the reproduction
    replays it, the target is replayed bit for bit, fails alone with the gate's message and passes without the
    fault."""
    from test_sensitivity import t5_l0

    node = "Module.encoder.block.0.layer.0.SelfAttention.T5Attention.forward.0"
    report, folder = t5_l0(tmp_path, Backend.from_options("cpu", "fp32", autocast="bf16"), "upcast",
                           faults=[Fault("Functional.scaled_dot_product_attention", 0, "forward", "scale", 1.02)])
    assert report.first_divergence is not None and report.first_divergence.name == node
    script = os.path.join(folder, "repro", f"{node}.py")
    spec = _json(script[:-3] + ".json")
    assert spec["module"]["target"] == "replayed", spec["module"].get("why")
    with open(os.path.join(folder, "isolation.json"), encoding="utf-8") as fh:
        record = json.load(fh)["nodes"][node]
    rc, out, text = _run(script)
    assert rc == 1 and out["message"] == record["message"], text
    rc, _, text = _run(script, "--no-fault")
    assert rc == 0, text


def test_an_l0_check_prints_the_modules_reproduction(pytester):
    """Through ``msprobe.check`` at L0, as a user gates a model: the failure names the innermost failing module
    and prints its reproduction's command, which fails alone with the gate's message and passes without the
    fault."""
    pytest.importorskip("transformers")
    pytester.makepyfile(test_l0_repro="""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

def test_l0_fault(msprobe):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0, embd_pdrop=0,
                     attn_pdrop=0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    msprobe.check(GPT2LMHeadModel(cfg).eval(), {"input_ids": ids, "labels": ids}, loss_fn=lambda o: o.loss,
                  level="L0", inject="faults.yaml")
""")
    pytester.makefile(".yaml", faults="faults:\n  - {api: Torch.addmm, call: 2, direction: forward, perturb: scale, "
                                      "value: 1.02}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16")
    result.assert_outcomes(failed=1)
    line = next(ln for ln in result.outlines if "reproduce this call alone" in ln)
    script = line.rsplit("python ", 1)[1].strip()
    assert os.path.basename(script) == "Module.transformer.h.0.mlp.c_fc.Conv1D.forward.0.py", script
    rc, out, text = _run(script)
    assert rc == 1 and "module rebuilt from its tapes" in text, text
    record = _json(os.path.join(os.path.dirname(os.path.dirname(script)), "isolation.json"))
    assert out["message"] == record["nodes"][os.path.basename(script)[:-3]]["message"]
    assert _run(script, "--no-fault")[0] == 0


def test_a_target_replayed_to_a_few_units_of_roundoff_is_judged_as_recorded_and_replayed_without_its_fault(
        tmp_path):
    """T5's cross-attention backward at L0, a 2% fault on its residual add: replayed with the fault, its tape gives
    the gate's input gradient to a unit of fp32's roundoff, not bit for bit (the capture's hooks route the gradient
    through aliases). The reproduction judges the gate's recorded values (the gate's message and metrics) and,
    with ``--no-fault``, replays the tape without the fault, which passes."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(100)
    cfg = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(100)
    inputs = ({"input_ids": torch.randint(3, 256, (2, 16), generator=g),
               "labels": torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(101))},)
    bench, target = Backend.from_options("cpu", "fp64"), Backend.from_options("cpu", "fp32")
    cfg_dump = DumpConfig(task="statistics", level="L0")
    b = run_side(model, inputs, lambda o: o.loss, bench, cfg_dump.with_overrides(dump_path=str(tmp_path / "b")))
    t = run_side(model, inputs, lambda o: o.loss, target, cfg_dump.with_overrides(dump_path=str(tmp_path / "t")),
                 faults=(Fault("Tensor.__add__", 22, "backward", "scale", 1.02),), isolator=Isolator(backward=True))
    report, _, _ = judge(b.folder, t.folder, JudgeSettings(isolate=True, cast_roundoff=unit_roundoff(
        "torch.float32", "torch.float64")))
    node = "Module.decoder.block.1.layer.1.T5LayerCrossAttention.backward.0"
    assert report.first_divergence is not None and report.first_divergence.name == node
    record = _json(os.path.join(t.folder, "isolation.json"))["nodes"][node]
    spec = _json(record["repro"][:-3] + ".json")
    assert spec["module"]["target"] == "recorded" and spec["module"]["clean"] == "replayed", spec["module"]["why"]
    rc, out, text = _run(record["repro"])
    assert rc == 1 and out["message"] == record["message"], text
    for k, v in record["metrics"].items():
        assert out[k] == repro._fmt(v), (k, out[k], v)
    rc, out, text = _run(record["repro"], "--no-fault")
    assert rc == 0 and "target replayed without its fault" in text, text
