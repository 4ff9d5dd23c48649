"""Capture: names, layout, statistics, tensor files, md5, filters and config errors."""

import json
import math
import os
import zlib

import pytest

from _files import read_json as _read_json
import torch
import torch.nn.functional as F
from torch import relu

from msprobe_ci import MsprobeError, PrecisionDebugger
from msprobe_ci.config import load_config


def _run(model, tmp_path, **kw):
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "dump"), **kw)
    dbg.start(model)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    loss = ((model(x) - 1) ** 2).mean()
    loss.backward()
    dbg.stop()
    dbg.step()
    folder = tmp_path / "dump" / "step0" / "rank"
    return folder, _read_json(folder / "dump.json")


def test_mix_names_match_msprobe_fixture(tinynet, tmp_path, fixtures_dir):
    folder, dump = _run(tinynet, tmp_path, level="mix")
    ref = _read_json(os.path.join(fixtures_dir, "fp32_statistics", "step0", "proc0", "dump.json"))
    ref_names = [k for k in ref["data"] if not k.startswith("Tensor.add_") and k != "Tensor.__mul__.0.forward"]
    ours = [k for k in dump["data"] if k != "Torch.randn.0.forward"]
    # same entries; the msprobe fixture scaled the input with one extra __mul__, so renumber ours by one
    assert len(ours) == len(ref_names)
    assert {k.replace("__mul__.1", "__mul__.X") for k in ref_names} == \
        {k.replace("__mul__.0", "__mul__.X") for k in ours}
    construct = _read_json(folder / "construct.json")
    assert construct["Functional.linear.0.forward"] == "Module.fc1.Linear.forward.0"
    assert construct["Functional.linear.1.backward"] == "Module.fc2.Linear.backward.0"
    stack = _read_json(folder / "stack.json")
    assert all(isinstance(v[0], list) and isinstance(v[1], list) for v in stack.values())


def test_statistics_values_and_backward_swap(tinynet, tmp_path):
    _, dump = _run(tinynet, tmp_path, level="L1")
    fwd = dump["data"]["Functional.linear.0.forward"]
    x = fwd["input_args"][0]
    assert x["type"] == "torch.Tensor" and x["dtype"] == "torch.float32" and x["shape"] == [4, 16]
    t = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    assert x["Max"] == pytest.approx(t.max().item()) and x["Norm"] == pytest.approx(t.norm().item())
    bwd = dump["data"]["Functional.linear.0.backward"]
    assert bwd["input"][0]["shape"] == [4, 32]            # grad w.r.t. the output
    assert [o and o["shape"] for o in bwd["output"]] == [[32], None, [16, 32]]  # bias, input (no grad), weight^T
    assert bwd["input"][0]["requires_grad"] is False
    ln = dump["data"]["Functional.layer_norm.0.forward"]["input_args"]
    assert ln[1] == [{"type": "int", "value": 32}]


def test_tensor_task_saves_files_and_md5(tinynet, tmp_path):
    folder, dump = _run(tinynet, tmp_path, level="L1", task="tensor")
    rec = dump["data"]["Functional.linear.0.forward"]["output"][0]
    assert rec["data_name"] == "Functional.linear.0.forward.output.0.pt"
    saved = torch.load(folder / "dump_tensor_data" / rec["data_name"], weights_only=True)
    assert list(saved.shape) == rec["shape"] and saved.max().item() == pytest.approx(rec["Max"])
    assert dump["dump_data_dir"].endswith("dump_tensor_data")

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"task": "statistics", "dump_path": str(tmp_path / "md5"), "level": "L1",
                               "statistics": {"summary_mode": "md5"}}))
    dbg = PrecisionDebugger(config_path=str(cfg))
    x = torch.randn(3, 5)
    dbg.start()
    torch.relu(x)
    dbg.stop()
    data = _read_json(tmp_path / "md5" / "step0" / "rank" / "dump.json")["data"]
    out = data["Torch.relu.0.forward"]["output"][0]
    assert out["md5"] == f"{zlib.crc32(torch.relu(x).numpy().tobytes()):08x}"


def test_function_mode_sees_imported_names_and_operators(tmp_path):
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "d"), level="L1")
    x = torch.randn(3, requires_grad=True)
    dbg.start()
    y = relu(x)          # from torch import relu
    z = y * 2 + x        # operators
    w = F.layer_norm(z, (3,))  # calls torch.layer_norm inside: recorded once
    w.sum().backward()
    scale = 0.5
    with torch.no_grad():
        1 + x, scale * x, x * scale  # reflected operators reach torch as add/mul(x, scalar) too
    dbg.stop()
    data = _read_json(tmp_path / "d" / "step0" / "rank" / "dump.json")["data"]
    assert {"Torch.relu.0.forward", "Tensor.__mul__.0.forward", "Tensor.__add__.0.forward",
            "Functional.layer_norm.0.forward", "Tensor.sum.0.forward"} <= set(data)
    assert not any(k.startswith("Torch.layer_norm") for k in data)
    assert {"Tensor.__radd__.0.forward", "Tensor.__rmul__.0.forward", "Tensor.__mul__.1.forward"} <= set(data)
    assert "Functional.layer_norm.0.backward" in data


def test_statistics_follow_in_place_updates_and_cover_dtypes(tmp_path):
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "d"), level="L1")
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    dbg.start()
    y = torch.relu(x)
    torch.neg(y)          # same object, unchanged: statistics reused
    y.mul_(10)            # in place: the next record must see the new values
    torch.neg(y)
    torch.abs(x.bfloat16())
    torch.abs(torch.tensor([3, -7, 5]))
    torch.logical_not(torch.tensor([True, False]))
    torch.neg(torch.tensor(2.5))
    dbg.stop()
    data = _read_json(tmp_path / "d" / "step0" / "rank" / "dump.json")["data"]
    stat = lambda rec: (rec["Max"], rec["Min"], rec["Mean"], rec["Norm"])  # noqa: E731
    assert stat(data["Torch.relu.0.forward"]["output"][0]) == pytest.approx((4, 0, 2, 26 ** 0.5))
    assert stat(data["Torch.neg.0.forward"]["input_args"][0]) == pytest.approx((4, 0, 2, 26 ** 0.5))
    assert stat(data["Torch.neg.1.forward"]["input_args"][0]) == pytest.approx((40, 0, 20, 2600 ** 0.5))
    assert stat(data["Torch.abs.0.forward"]["output"][0]) == pytest.approx((4, 1, 2.5, 30 ** 0.5))
    ints = data["Torch.abs.1.forward"]["output"][0]
    assert (ints["Max"], ints["Min"], ints["Mean"], ints["dtype"]) == (7, 3, None, "torch.int64")
    bools = data["Torch.logical_not.0.forward"]["output"][0]
    assert (bools["Max"], bools["Min"]) == (True, False)
    assert stat(data["Torch.neg.2.forward"]["output"][0]) == pytest.approx((-2.5,) * 4)


def test_existing_dump_is_never_overwritten(tinynet, tmp_path):
    _run(tinynet, tmp_path, level="mix")
    before = (tmp_path / "dump" / "step0" / "rank" / "dump.json").read_bytes()
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "dump"), level="mix")
    with pytest.raises(MsprobeError, match="already exists and is not empty"):
        dbg.start(tinynet)
    assert (tmp_path / "dump" / "step0" / "rank" / "dump.json").read_bytes() == before


@pytest.mark.parametrize("raw, message", [
    ({"task": "overflow_check", "dump_path": "x"}, "config field 'task': expected one of statistics, tensor, got 'overflow_check'"),
    ({"level": "L5", "dump_path": "x"}, "config field 'level': expected one of L0, L1, mix, got 'L5'"),
    ({"step": [-1], "dump_path": "x"}, "config field 'step': element -1 is outside 0..1000000"),
    ({"dump_path": "x", "statistics": {"summary_mode": "crc"}}, "config field 'summary_mode': expected one of statistics, md5, got 'crc'"),
    ({"dump_path": "x", "statistics": {"data_mode": ["all", "input"]}}, "'all' cannot be combined"),
    ({"dump_path": "x", "tpyo": 1}, "unknown config field(s) ['tpyo']"),
])
def test_bad_config_fields(tmp_path, raw, message):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(raw))
    with pytest.raises(MsprobeError) as exc:
        load_config(str(cfg))
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_step_ranges_parse():
    from msprobe_ci.config import parse_int_ranges

    assert parse_int_ranges(["0-2", 5], "step") == (0, 1, 2, 5)


class _InPlaceCNN(torch.nn.Module):
    """nn.ReLU(inplace=True) modules and an in-place residual add on a module's output (torchvision style)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.relu = torch.nn.ReLU(inplace=True)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(h))
        out += h
        return self.fc(self.relu(out).mean((2, 3)))


def _falcon():
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(3)
    cfg = FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    cfg._attn_implementation = "eager"
    return FalconForCausalLM(cfg).eval()


def _loss_and_grads(model, loss_of, dbg=None):
    """The loss and every parameter gradient of one forward+backward (captured when ``dbg`` is given); the
    model's state (BatchNorm running statistics) is put back afterwards."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad(set_to_none=True)
    if dbg is not None:
        dbg.start(model)
    loss = loss_of(model)
    loss.backward()
    if dbg is not None:
        dbg.stop()
        dbg.step()
    model.load_state_dict(state)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["falcon", "cnn"])
def test_in_place_ops_on_module_inputs_and_outputs(kind, tmp_path):
    """Falcon's ``mlp_output += attention_output`` and ``nn.ReLU(inplace=True)`` modify a hooked module's output
    or input in place, which torch forbids on the views its full backward hooks make. Captured forward+backward at
    mix level, the run gives the loss and every parameter gradient bit for bit as without capture, and each
    module's backward is recorded."""
    if kind == "falcon":
        model = _falcon()
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))

        def loss_of(m):
            return m(input_ids=ids, labels=ids).loss
        node = "Module.transformer.h.0.mlp.FalconMLP.backward.0"
    else:
        torch.manual_seed(5)
        model = _InPlaceCNN().train()
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))

        def loss_of(m):
            return m(x).pow(2).mean()
        node = "Module.relu.ReLU.backward.1"

    loss0, grads0 = _loss_and_grads(model, loss_of)
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "dump"), level="mix", task="statistics")
    loss1, grads1 = _loss_and_grads(model, loss_of, dbg)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    data = _read_json(tmp_path / "dump" / "step0" / "rank" / "dump.json")["data"]
    rec = data[node]
    assert rec["input"] and rec["output"], rec
    assert sum(k.startswith("Module.") and ".backward." in k for k in data) >= 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_statistics_of_a_finite_tensor_near_the_max_stay_finite(dtype):
    """An RWKV-style -1e38 mask (fp32, bf16) or -1e305 (fp64): Mean (a float64 sum) and Norm (scaled by the largest
    magnitude) are finite and right to the float64 value; a real Inf or NaN still shows in Max/Min/Norm."""
    from msprobe_ci.capture.records import RecordBuilder

    big = -1e305 if dtype == torch.float64 else -1e38
    t = torch.tensor([big] * 999 + [1.0], dtype=dtype)
    exact = t.double()
    rb = RecordBuilder()
    rec = rb.tensor(t)
    rb.resolve()
    assert all(isinstance(rec[k], float) and math.isfinite(rec[k]) for k in ("Max", "Min", "Mean", "Norm")), rec
    assert rec["Mean"] == pytest.approx(float(exact.mean()), rel=1e-12)
    want_norm = float(exact.abs().max()) * float((exact / exact.abs().max()).norm())
    assert rec["Norm"] == pytest.approx(want_norm, rel=1e-6)
    small = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    rec2 = rb.tensor(small)
    rb.resolve()
    assert rec2["Norm"] == pytest.approx(float(small.double().norm()), rel=1e-6)  # no scaling needed there
    for special, key in ((float("inf"), "Max"), (float("nan"), "Max")):
        bad = t.clone()
        bad[0] = special
        rec3 = rb.tensor(bad)
        rb.resolve()
        assert str(rec3[key]) in ("inf", "nan") and str(rec3["Norm"]) in ("inf", "nan")


def test_overflow_reads_max_and_min_not_an_overflowed_mean(tmp_path):
    """A model that adds a -1e38 fp32 mask (finite) has no overflow: the dump's statistics are finite and the
    overflow check reads Max/Min; a record made elsewhere with a Mean of -inf but finite Max/Min (msprobe sums in
    the tensor's dtype) is no anomaly either, while an Inf in Max or Min still is."""
    from msprobe_ci.dump.reader import load_dump
    from msprobe_ci.overflow import anomalous, check_entry, check_overflow

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            mask = torch.triu(torch.full((8, 8), -1e38), diagonal=1)
            return torch.softmax(self.fc(x) + mask, dim=-1)

    torch.manual_seed(0)
    model = Masked()
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "d"), level="mix", task="statistics", isolate=False)
    dbg.start(model)
    model(torch.randn(8, 8))
    dbg.stop()
    dump = load_dump(str(tmp_path / "d" / "step0" / "rank"))
    add = dump.data["Tensor.__add__.0.forward"]["output"][0]
    assert add["Min"] == pytest.approx(-1e38, rel=1e-6) and abs(add["Mean"]) < 1e38 and add["Norm"] < 1e39
    assert not check_overflow(dump).has_overflow
    rec = {"type": "torch.Tensor", "dtype": "torch.float32", "Max": 1.0, "Min": -1e38, "Mean": "-inf", "Norm": "inf"}
    assert not anomalous(rec)
    assert check_entry("Tensor.__add__.0.forward", {"input_args": [], "output": [rec]}) is None
    assert anomalous({**rec, "Min": "-inf"}) and anomalous({**rec, "Max": "nan"})
    assert anomalous({"type": "torch.Tensor", "Max": None, "Min": None, "Mean": "nan"})
    assert check_entry("Tensor.__add__.0.forward", {"input_args": [], "output": [{**rec, "Min": "-inf"}]}).level \
        == "critical"


def test_statistics_where_reads_wait_for_the_device_take_no_host_read_and_four_ops(monkeypatch):
    """Issue 51: where a host read waits for the device (``msprobe_ci._perf.reads_wait``, taken on the CPU with
    ``DEVICE_PATHS``), a floating tensor's statistics cost one ``aminmax`` and two float64-accumulated reductions
    (ATen ops: those and its ``detach``),
    and nothing is read before the step's one transfer (``resolve``). Max and Min are the CPU paths' exactly, Mean
    and Norm theirs to fp32's accumulation (float64 sums are the closer): for fp32, bf16, fp16, a transposed view,
    a -1e38 mask that would overflow an fp32 sum, an infinity, a NaN; float64 tensors keep the scaled pass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from msprobe_ci import _perf
    from msprobe_ci.capture.records import RecordBuilder

    gen = torch.Generator().manual_seed(9)
    tensors = [torch.randn(300, 70, generator=gen), torch.randn(128, 64, generator=gen).to(torch.bfloat16) * 40,
               torch.randn(5000, generator=gen).to(torch.float16), torch.randn(64, 48, generator=gen).t(),
               torch.tensor([-1e38] * 999 + [1.0]), torch.tensor([1.0, float("inf"), -2.0]),
               torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16), torch.tensor([-1e305] * 9 + [2.0],
                                                                                        dtype=torch.float64)]

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.n += 1
            return func(*args, **(kwargs or {}))
    reads = []
    for name in ("item", "tolist", "__float__", "__bool__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **k: (reads.append(_n),
                                                                                        _o(self, *a, **k))[1])

    def stats(device_paths: bool) -> list:
        monkeypatch.setattr(_perf, "DEVICE_PATHS", device_paths)
        rb = RecordBuilder()
        reads.clear()
        Ops.n = 0
        with Ops():
            recs = [rb.tensor(t) for t in tensors[:-1]]
        ops, before = Ops.n, list(reads)
        recs.append(rb.tensor(tensors[-1]))
        rb.resolve()
        return [(r["Max"], r["Min"], r["Mean"], r["Norm"]) for r in recs], ops, before
    cpu, _, cpu_reads = stats(False)
    dev, ops, dev_reads = stats(True)
    assert cpu_reads and not dev_reads  # the CPU's paths read a bound per tensor; the device's none
    assert ops <= 4 * (len(tensors) - 1) + 1  # a detach, aminmax, sum, norm each; the transposed one's flat view
    for (c, d) in zip(cpu, dev):
        assert d[:2] == c[:2] or all(math.isnan(x) for x in d[:2] + c[:2] if isinstance(x, float) and x != x)
        for x, y in zip(c[2:], d[2:]):
            assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-6), (c, d)
    assert all(math.isfinite(v) for v in dev[4])  # the -1e38 mask: finite statistics on both paths


def test_half_statistics_from_the_scratch_buffer_are_those_of_a_fresh_upcast(monkeypatch):
    """fp16/bf16 CPU tensors up to ``SCRATCH`` elements are upcast into one reused float32 buffer: every statistic
    is bit-for-bit the one a fresh ``.float()`` gives (contiguous tensors of growing and shrinking sizes, so the
    buffer is reused and regrown; a transposed view and a tensor over the limit take ``.float()``), and a tensor
    recorded after another does not change the first one's statistics."""
    from msprobe_ci.capture import records

    gen = torch.Generator().manual_seed(4)
    shapes = [(3, 5), (1000, 300), (17,), (2, 3, 4096), (9, 9)]
    tensors = [torch.randn(*s, generator=gen).to(dt) * 300 for s in shapes for dt in (torch.bfloat16, torch.float16)]
    tensors += [torch.randn(64, 96, generator=gen).to(torch.bfloat16).t(),  # not contiguous
                torch.randn((1 << 16) + 7, generator=gen).to(torch.float16), torch.full((5,), -3.0, dtype=torch.bfloat16)]

    def stats(limit: int) -> list:
        monkeypatch.setattr(records, "SCRATCH", limit)
        rb = records.RecordBuilder()
        recs = [rb.tensor(t) for t in tensors]
        rb.resolve()
        assert not rb._scratch_lock.locked()  # handed back after each tensor (another thread may take it)
        return [(r["Max"], r["Min"], r["Mean"], r["Norm"]) for r in recs], rb._scratch

    fresh, none = stats(0)
    reused, scratch = stats(1 << 16)  # the (2^16 + 7)-element tensor is over it
    assert none is None and scratch is not None and scratch.numel() == 1 << 16  # its least size, never regrown
    assert reused == fresh
    assert fresh[-1] == (-3.0, -3.0, -3.0, pytest.approx(3.0 * math.sqrt(5)))


def test_views_over_the_same_elements_share_statistics_and_others_do_not():
    """A dense view (a transpose, a reshape, a permute) over exactly the elements of a tensor already recorded,
    unchanged since, reuses its statistics; a slice with gaps, another range, or a write in place since gets its
    own; a parameter whose ``.data`` was swapped (its old storage freed, its address free to be reused) no longer
    vouches for the range. Every statistic is that of the tensor's own values (computed in float64)."""
    from msprobe_ci.capture import records

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, 32, generator=gen)
    rb = records.RecordBuilder()
    cases = [x, x.transpose(1, 2), x.view(240, 32), x.permute(2, 0, 1), x[:, ::2], x[1:3].transpose(0, 1)]
    recs = [rb.tensor(t) for t in cases]
    expected = [t.detach().double().clone() for t in cases]
    shared = [st for _, st in rb._pending]
    assert shared[1] is shared[0] and shared[2] is shared[0] and shared[3] is shared[0]
    assert shared[4] is not shared[0] and shared[5] is not shared[0]
    x.mul_(2)  # a new version: its own statistics
    cases.append(x.transpose(0, 2))
    recs.append(rb.tensor(cases[-1]))
    expected.append(cases[-1].double())
    assert rb._pending[-1][1] is not shared[0]
    rb.resolve()
    for d, r in zip(expected, recs):
        assert r["Max"] == pytest.approx(float(d.max()), rel=1e-6) and r["Min"] == pytest.approx(float(d.min()), rel=1e-6)
        assert r["Mean"] == pytest.approx(float(d.mean()), rel=1e-4, abs=1e-6)
        assert r["Norm"] == pytest.approx(float(d.norm()), rel=1e-5)
    p = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    key, _ = records._dense_key(p.detach(), p._version)
    assert records._holds(p, key)
    p.data = torch.randn(8, 8, generator=gen)
    assert not records._holds(p, key)


def test_the_heap_alive_at_start_is_frozen_while_recording_and_thawed_at_stop(tmp_path):
    """The collector's full passes skip what was alive before recording (gc.freeze: they walked torch's and the
    model's objects again and again, most of a small hooked call's cost); stop() thaws it, garbage made while
    recording is still collected, and a freeze made by someone else is left alone."""
    import gc

    assert gc.isenabled() and gc.get_freeze_count() == 0
    debugger = PrecisionDebugger(dump_path=str(tmp_path / "a"), level="L1", isolate=False)
    debugger.start()
    try:
        assert gc.get_freeze_count() > 0
        cycle = [torch.ones(2)]
        cycle.append(cycle)
        del cycle
        assert gc.collect() > 0  # made while recording: collected
        torch.relu(torch.ones(3))
    finally:
        debugger.stop()
    assert gc.get_freeze_count() == 0
    gc.freeze()  # someone else's (a pre-fork server's): recording neither adds to it nor thaws it
    try:
        theirs = gc.get_freeze_count()
        other = PrecisionDebugger(dump_path=str(tmp_path / "b"), level="L1", isolate=False)
        other.start()
        torch.relu(torch.ones(3))
        assert gc.get_freeze_count() == theirs
        other.stop()
        assert gc.get_freeze_count() == theirs
    finally:
        gc.unfreeze()


def test_an_observer_of_the_capture_sees_each_call_in_the_documented_order(tmp_path):
    """The engine calls its observers in order on the way in and in reverse on the way out: an observer of the
    caller's (right after the statistics) sees the inputs the model gave, the output the model got (a 2% fault
    applied to the kernel's own output) with the isolation's verdict already known, the gradients of the call, and
    its files land beside dump.json."""
    from msprobe_ci.capture import CaptureSession, Fault, Observer
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    log = []

    class Seen(Observer):
        def __init__(self, tag, iso=None):
            self.tag, self.iso, self.outs = tag, iso, {}

        def api_before(self, call):
            if call.record:
                log.append((self.tag, "before", call.name))

        def api_after(self, call):
            if call.record:
                log.append((self.tag, "after", call.name))
                if self.iso is not None:
                    status = self.iso.results[call.name]["status"]
                    self.outs[call.name] = (call.out.detach().clone(), call.orig.detach().clone(), status)

        def api_backward(self, call, grad_inputs, grad_outputs):
            log.append((self.tag, "backward", call.bwd_name))

        def files(self):
            return {f"seen_{self.tag}.json": sorted(self.outs)}

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    iso = Isolator()
    first, second = Seen("a", iso), Seen("b")
    cap = CaptureSession(DumpConfig(dump_path=str(tmp_path / "d"), level="mix", task="statistics"),
                         faults=[Fault("Functional.linear", 1, "forward", "scale", 1.02)], isolator=iso,
                         observers=[first, second])
    cap.start(model)
    model(torch.randn(8, 16)).square().mean().backward()
    cap.stop()
    cap.close()

    mine = [e for e in log if e[2].startswith("Functional.linear.1.")]
    assert mine[:4] == [("a", "before", "Functional.linear.1.forward"), ("b", "before", "Functional.linear.1.forward"),
                        ("b", "after", "Functional.linear.1.forward"), ("a", "after", "Functional.linear.1.forward")]
    assert ("b", "backward", "Functional.linear.1.backward") in mine and ("a", "backward", "Functional.linear.1.backward") in mine
    assert mine.index(("b", "backward", "Functional.linear.1.backward")) < mine.index(("a", "backward", "Functional.linear.1.backward"))
    out, orig, status = first.outs["Functional.linear.1.forward"]
    assert torch.allclose(out, orig * 1.02) and not torch.equal(out, orig)
    assert status == "error"  # judged on the output the model got, before the outer observer's after
    assert first.outs["Functional.linear.0.forward"][2] == "pass"
    folder = tmp_path / "d" / "step0" / "rank"
    assert {"Functional.linear.0.forward", "Functional.linear.1.forward", "Functional.gelu.0.forward"} <= \
        set(_read_json(folder / "seen_a.json"))
    assert (folder / "seen_b.json").exists() and (folder / "isolation.json").exists()
    dump = _read_json(folder / "dump.json")
    assert dump["data"]["Functional.linear.1.forward"]["output"][0]["Max"] == pytest.approx(float(out.max()), rel=1e-6)


def test_integer_and_boolean_tensors_carry_a_digest_their_extremes_cannot_give():
    """Two index tensors with the same extremes (an MoE router that sent one token to another expert) differ in
    ``digest``, an extra field msprobe ignores: 8 hex digits of a positional int32 checksum computed on the
    tensor's device; equal tensors agree, whatever object or view holds them; bool tensors keep true/false
    extremes; floating tensors, 0-d and empty ones have none."""
    from msprobe_ci.capture.records import RecordBuilder

    rb = RecordBuilder()
    a, b = torch.tensor([[0, 3], [1, 2]]), torch.tensor([[0, 3], [2, 1]])
    a32 = a.to(torch.int32)
    recs = [rb.tensor(x) for x in (a, b, a.clone(), torch.tensor([True, False, True]), torch.tensor(5),
                                   torch.zeros(0, dtype=torch.int64), torch.ones(3), a32)]
    rb.resolve()
    assert a32.tolist() == [[0, 3], [1, 2]]  # the digest weighs a copy, never the model's own tensor
    ra, rb_, rc, rm, r0, re, rf, r32 = recs
    assert (ra["Max"], ra["Min"], rb_["Max"], rb_["Min"]) == (3, 0, 3, 0)
    assert ra["digest"] != rb_["digest"] and ra["digest"] == rc["digest"] == r32["digest"]
    assert len(ra["digest"]) == 8 and int(ra["digest"], 16) >= 0
    assert (rm["Max"], rm["Min"]) == (True, False) and isinstance(rm["Max"], bool) and "digest" in rm
    assert "digest" not in r0 and "digest" not in re and "digest" not in rf


def test_a_module_built_inside_the_capture_window_does_not_break_the_run(tmp_path):
    """``nn.Embedding(..., padding_idx=0)`` zeroes its padding row under ``no_grad`` through a view; PyTorch then
    refuses to give that view's ``grad_fn`` at all (RuntimeError), and a capture hook that asked for it raised in
    the user's code (a loop that builds its batch, or a lazily built module, between ``start`` and ``stop``). The
    hooks treat it as no autograd node: the module is built, the step's dump is written, and the backward runs."""
    from msprobe_ci import PrecisionDebugger

    m = torch.nn.Linear(4, 4)
    dbg = PrecisionDebugger(dump_path=str(tmp_path), level="mix")
    dbg.start(m)
    y = m(torch.randn(2, 4))
    emb = torch.nn.Embedding(10, 4, padding_idx=0)
    (y.sum() + emb(torch.tensor([0, 3])).sum()).backward()
    dbg.stop()
    dbg.step()
    assert float(emb.weight.detach()[0].abs().sum()) == 0.0 and m.weight.grad is not None
    (dump,) = list(tmp_path.rglob("dump.json"))
    import json

    data = json.loads(dump.read_text())["data"]
    assert any(k.startswith("Functional.linear.0.forward") for k in data) and \
        any(k.startswith("Tensor.fill_.") for k in data), sorted(data)[:10]


def test_the_step_files_are_the_json_value_msprobe_writes_one_entry_a_line():
    """stack.json, construct.json and the observers' files (isolation.json) hold the JSON value
    ``json.dumps(obj, indent=1)`` gives (msprobe's layout), NaN and Infinity as its bare literals and keys that are
    no strings converted as json.dumps converts them; a mapping whose entries hold containers is written one
    top-level entry a line by the C encoder (indent forces the pure-Python one, 2.4x slower on a 1,000-call
    isolation.json), a flat one with indent=1."""
    from msprobe_ci.dump.writer import json_text

    nested = {"nodes": {"a": {"x": [1.5, math.nan]}, "b": {"y": math.inf}}, 3: [None, True], "é": {"k": "ü"}}
    flat = {"Module.a": None, "Tensor.add.0.forward": "Module.a"}
    for obj in (nested, flat, {}, [1, {"a": 2}], "text"):
        text = json_text(obj)
        assert text == json.dumps(obj, indent=1, ensure_ascii=False) or \
            json.loads(text) == json.loads(json.dumps(obj, ensure_ascii=False)), text
    assert json_text(flat) == json.dumps(flat, indent=1, ensure_ascii=False)
    lines = json_text(nested).splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and len(lines) == 2 + len(nested)
    assert lines[1].startswith(' "nodes": {"a": {"x": [1.5, NaN]}') and lines[2] == ' "3": [null, true],'
    assert "é" in lines[3] and "ü" in lines[3]
