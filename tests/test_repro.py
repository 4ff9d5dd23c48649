"""A standalone reproduction beside every failing API call (issue 52, :mod:`msprobe_ci.repro`): written by the capture
where isolation fails a call, run alone in a fresh process it fails with the gate's own metric values, and passes
with the injected fault left out."""

import json
import os
import subprocess
import sys

import pytest
import torch

from msprobe_ci.backends import Backend
from msprobe_ci.capture.inject import Fault
from msprobe_ci.check.outcome import judge
from msprobe_ci.check.sides import run_side
from msprobe_ci.replay import repro_files
from msprobe_ci.compare.verdict import unit_roundoff
from msprobe_ci.config import DumpConfig
from msprobe_ci.errors import MsprobeError
from msprobe_ci.isolate import Isolator
from msprobe_ci import repro
from msprobe_ci.capture import repro as writer
from msprobe_ci.judge import JudgeSettings


def _llama(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
    return model, (ids,), lambda out: out.logits.float().square().mean()


def _gate(tmp_path, fault, dtype, kernel):
    """The isolated check of a small Llama (fp32 bench): (first divergence, the target's step folder)."""
    model, inputs, loss_fn = _llama()
    bench, target = Backend.from_options("cpu", "fp32"), Backend.from_options("cpu", dtype)
    cfg = DumpConfig(task="statistics", level="mix")
    b = run_side(model, inputs, loss_fn, bench, cfg.with_overrides(dump_path=os.path.join(tmp_path, "bench")))
    t = run_side(model, inputs, loss_fn, target, cfg.with_overrides(dump_path=os.path.join(tmp_path, "target")),
                 faults=(fault,), isolator=Isolator(backward=True, bench_kernel=kernel))
    cast_u = unit_roundoff(str(target.dtype), "torch.float32")
    report, _, _ = judge(b.folder, t.folder, JudgeSettings(isolate=True, cast_roundoff=cast_u))
    return report.first_divergence, t.folder


def _json(path):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _write(path, text):
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _run(script, *flags):
    """The reproduction alone, in a fresh process: (exit code, {printed field: value}, stdout)."""
    proc = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(script))
    fields = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.strip().partition(": ")
        fields.setdefault(key, value)
    return proc.returncode, fields, proc.stdout + proc.stderr


@pytest.mark.parametrize("fault, dtype, kernel", [
    (Fault("Functional.linear", 3, "forward", "scale", 1.02), "bf16", "device"),
    (Fault("Functional.linear", 5, "backward", "scale", 1.02), "fp16", "upcast"),
    (Fault("Functional.scaled_dot_product_attention", 1, "backward", "noise", 0.02), "bf16", "rounded"),
])
def test_a_failing_call_reproduces_alone_with_the_gates_values(tmp_path, fault, dtype, kernel):
    first, folder = _gate(tmp_path, fault, dtype, kernel)
    node = f"{fault.api}.{fault.call}.{fault.direction}"
    assert first is not None and first.name == node
    record = _json(os.path.join(folder, "isolation.json"))["nodes"][node]
    script = os.path.join(folder, "repro", node + ".py")
    assert record["repro"] == script and os.path.isfile(script.replace(".py", ".safetensors"))
    rc, out, text = _run(script)
    assert rc == 1, text
    assert out["message"] == record["message"] and out["status"] == "error"
    for k, v in record["metrics"].items():  # every metric, to the printed digits
        assert out[k] == repro._fmt(v), (k, out[k], v)
    rc, out, text = _run(script, "--no-fault")
    assert rc == 0 and out["status"] == "pass", text


def test_the_inputs_are_the_calls_own_and_hold_no_code(tmp_path):
    # an in-place call's first argument is saved as it was before the call; the files are safetensors and JSON
    from msprobe_ci.capture import CaptureSession

    x = torch.randn(8, 16, dtype=torch.bfloat16)
    before = x.clone()
    iso = Isolator(backward=False)
    session = CaptureSession(DumpConfig(task="statistics", level="L1", dump_path=str(tmp_path)),
                             faults=(Fault("Tensor.mul_", 0, "forward", "scale", 1.05),), isolator=iso)
    session.start()
    x.mul_(torch.full((16,), 0.5, dtype=torch.bfloat16))
    session.stop()
    script = iso.results["Tensor.mul_.0.forward"]["repro"]
    spec, tensors = repro.load(script)
    assert torch.equal(tensors[spec["args"][0]["tensor"]], before)
    assert spec["faults"] == [{"api": "Tensor.mul_", "call": 0, "direction": "forward", "perturb": "scale",
                               "value": 1.05}]
    record, _ = repro.run(script)
    assert record["status"] == "error" and record["message"] == iso.results["Tensor.mul_.0.forward"]["message"]
    assert repro.run(script, fault=False)[0]["status"] == "pass"
    # the CUDA GEMM settings the gate ran with are restored (its bench splits GEMMs as they allow), by value only
    matmul = torch.backends.cuda.matmul
    assert spec["cuda_matmul"] == {k: bool(getattr(matmul, k)) for k in writer.CUDA_MATMUL}
    before = matmul.allow_bf16_reduced_precision_reduction
    spec_path = os.path.splitext(script)[0] + ".json"
    try:
        _write(spec_path, json.dumps({**spec, "cuda_matmul": {"allow_bf16_reduced_precision_reduction": not before,
                                                              "torch.load": True}}))
        repro.run(script)
        assert matmul.allow_bf16_reduced_precision_reduction is (not before) and not hasattr(matmul, "torch.load")
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before
    _write(spec_path, json.dumps({**spec, "cuda_matmul": ["allow_bf16_reduced_precision_reduction"]}))
    with pytest.raises(MsprobeError, match="field 'cuda_matmul': expected a mapping"):
        repro.run(script)


def test_arguments_round_trip_and_a_hostile_spec_is_refused(tmp_path):
    t = torch.arange(6.0).reshape(2, 3)
    value = [t, (1, 2.5, float("inf")), {"dim": -1, "dtype": torch.float16}, slice(0, None, 2), Ellipsis, None,
             torch.Size([2, 3]), torch.channels_last, torch.device("cpu"), "mean", True, t]
    tensors, keys, grads = {}, {}, {}
    encoded = json.loads(json.dumps(writer._encode(value, tensors, keys, grads)))
    back = repro._decode(encoded, tensors, "spec")
    assert back[0] is back[-1] and len(tensors) == 1  # one tensor passed twice is one tensor
    assert back[1:-1] == value[1:-1]
    for arg in (t.t(), t[:, ::2], torch.arange(3.0).expand(4, 3), t[1:]):  # its layout kept: the same kernel path
        flat, layout = writer._saved(arg)
        back = repro_files._viewed(flat, json.loads(json.dumps(layout)), "spec") if layout else flat.reshape(arg.shape)
        assert torch.equal(back, arg) and back.stride() == arg.stride()
    with pytest.raises(MsprobeError, match="reaches past the saved tensor"):
        repro_files._viewed(torch.zeros(4), {"size": [3, 3], "stride": [3, 1]}, "spec")
    with pytest.raises(writer._Unsaved, match="object"):
        writer._encode(object(), {}, {}, {})
    for bad in ({"call": "os.system"}, {"dtype": "__class__"}, {"tensor": "missing"}):
        with pytest.raises(MsprobeError, match="unexpected argument encoding"):
            repro._decode(bad, tensors, "spec")
    # a reproduction whose function is not a tensor operation on the replay allowlist never runs
    first, folder = _gate(tmp_path, Fault("Functional.linear", 3, "forward", "scale", 1.05), "bf16", "device")
    script = os.path.join(folder, "repro", "Functional.linear.3.forward.py")
    spec_path = script[:-3] + ".json"
    spec = _json(spec_path)
    spec["function"] = {"prefix": "Torch", "api": "load"}
    _write(spec_path, json.dumps(spec))
    rc, _, text = _run(script)
    assert rc == 2 and "field 'function': not on the replay allowlist" in text
    _write(spec_path, "{")
    rc, _, text = _run(script)
    assert rc == 2 and "not valid JSON" in text and "Traceback" not in text


def test_the_failure_message_prints_the_command(pytester):
    pytest.importorskip("transformers")
    pytester.makepyfile(test_amp_repro="""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

def test_amp_fault(msprobe):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0, embd_pdrop=0,
                     attn_pdrop=0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    msprobe.check(GPT2LMHeadModel(cfg).eval(), {"input_ids": ids, "labels": ids}, loss_fn=lambda o: o.loss,
                  inject="faults.yaml")
""")
    pytester.makefile(".yaml", faults="faults:\n  - {api: Torch.addmm, call: 2, direction: backward, perturb: scale, "
                                      "value: 1.02}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-autocast=bf16")
    result.assert_outcomes(failed=1)
    line = next(ln for ln in result.outlines if "reproduce this call alone" in ln)
    script = line.rsplit("python ", 1)[1].strip()
    assert script.endswith(os.path.join("repro", "Torch.addmm.2.backward.py"))
    rc, out, text = _run(script)
    assert rc == 1 and "autocast bfloat16 on cpu" in text, text
    record = _json(os.path.join(os.path.dirname(os.path.dirname(script)), "isolation.json"))
    assert out["message"] == record["nodes"]["Torch.addmm.2.backward"]["message"]
    assert _run(script, "--no-fault")[0] == 0


@pytest.mark.parametrize("op, world", [("all_reduce", 2), ("reduce_scatter_tensor", 3)])
def test_a_failing_collective_reproduces_on_a_gloo_group_of_its_size(tmp_path, op, world):
    """A collective one rank received 2% off (an injected fault on the last rank): its reproduction, run alone in
    a fresh process, re-runs it on a new gloo group of the dumped size, fails with the gate's values and passes
    without the fault; the other ranks pass and write none; the cross-rank answer prints the command."""
    import socket

    import torch.multiprocessing as mp

    import _dist_workers
    from msprobe_ci.cli import main as cli

    def port():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    out = tmp_path / "o"
    mp.spawn(_dist_workers.tp_isolated, args=(world, port(), str(out), op,
                                              Fault(f"Distributed.{op}", 0, "forward", "scale", 1.02)),
             nprocs=world, join=True)
    node = f"Distributed.{op}.0.forward"
    last = world - 1
    for rank in range(last):
        record = _json(out / "step0" / f"rank{rank}" / "isolation.json")["nodes"][node]
        assert record["status"] == "pass" and "repro" not in record, record
    record = _json(out / "step0" / f"rank{last}" / "isolation.json")["nodes"][node]
    script = str(out / "step0" / f"rank{last}" / "repro" / f"{node}.py")
    assert record["status"] == "error" and record["repro"] == script, record
    spec = _json(script.replace(".py", ".json"))
    assert spec["kind"] == "collective" and spec["collective"]["world_size"] == world
    rc, fields, text = _run(script)
    assert rc == 1 and fields["status"] == "error", text
    assert f"on a gloo group of {world} process(es), judged on rank {last} of it" in text, text
    assert fields["message"] == record["message"], text
    for k, v in record["metrics"].items():  # every metric, to the printed digits
        assert fields[k] == repro._fmt(v), (k, fields[k], v)
    rc, fields, text = _run(script, "--no-fault")
    assert rc == 0 and fields["status"] == "pass", text
    for key, bad in (("world_size", 1000), ("op", "barrier"), ("reduce_op", "__class__")):  # data, checked
        hostile = tmp_path / f"hostile_{key}"
        hostile.mkdir()
        with open(hostile / "n.json", "w", encoding="utf-8") as fh:
            json.dump(dict(spec, collective=dict(spec["collective"], **{key: bad})), fh)
        os.link(script.replace(".py", ".safetensors"), hostile / "n.safetensors")
        with pytest.raises(MsprobeError, match=rf"n\.json: field.* 'collective\.{key}'"):
            repro.run(str(hostile / "n.py"))
    # the cross-rank answer names it and prints the command (the bench: the same run without the fault)
    mp.spawn(_dist_workers.tp_isolated, args=(world, port(), str(tmp_path / "b"), op, None), nprocs=world, join=True)
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli(["compare", "-tp", str(out / "step0"), "-gp", str(tmp_path / "b" / "step0"),
                  "-o", str(tmp_path / "cmp")])
    printed = buf.getvalue()
    assert rc == 1 and f"first divergence: step0 rank{last} {node}: " in printed, printed
    assert f"reproduce this call alone, without the model (--no-fault leaves an injected fault out): python " \
           f"{script}" in printed, printed


class _Autocast(torch.nn.Module):
    """A model whose forward runs under bf16 autocast (an AMP target)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kw):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(**kw)


@pytest.mark.parametrize("amp", [False, True])
def test_a_call_the_free_benchmark_finds_at_risk_reproduces_alone(tmp_path, amp):
    """The free benchmark (no bench) finds a 2% fault on a SiLU at risk (bf16, or under bf16 autocast, where its
    reruns wait for the kernel's dtype): its reproduction, run alone in a fresh process, re-runs the same
    higher-precision reference and bit-noise rerun (same seed and call index) and fails with the gate's message,
    to the printed digits; without the fault it passes."""
    from msprobe_ci.free_benchmark import run_forward

    model, (ids,), _ = _llama()
    model = _Autocast(model) if amp else model.bfloat16()
    fb = run_forward(model, {"input_ids": ids}, str(tmp_path / "d"),
                     faults=(Fault("Functional.silu", 1, "forward", "scale", 1.02),))
    node = "Functional.silu.1.forward"
    record = fb.results[node]
    assert [k for k, _ in fb.errors()] == [node] and record["repro"].endswith(f"repro/{node}.py"), record
    spec = _json(record["repro"].replace(".py", ".json"))
    assert spec["kind"] == "free" and (spec["autocast"] or {}).get("dtype") == ("bfloat16" if amp else None)
    rc, out, text = _run(record["repro"])
    assert rc == 1 and out["status"] == "error" and out["message"] == record["message"], text
    assert out["metric"].startswith(f"{record['metric']} {repro._fmt(record['value'])} (allowed "
                                    f"{repro._fmt(record['threshold'])}"), text
    rc, out, text = _run(record["repro"], "--no-fault")
    assert rc == 0 and out["status"] == "pass", text
