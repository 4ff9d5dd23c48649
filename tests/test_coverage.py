"""Nothing that computes goes unseen: MoE experts' grouped GEMMs are captured APIs, and coverage.json beside every
dump says which share of the floating-point work ran inside a captured API and names what did not."""

import json
import os
import textwrap

import pytest
import torch

from msprobe_ci import PrecisionDebugger
from msprobe_ci.capture import naming

transformers = pytest.importorskip("transformers")


def _mixtral(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


def _dump(tmp_path, model, name: str = "dump", isolate: bool = False):
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    dbg = PrecisionDebugger(dump_path=str(tmp_path / name), level="mix", task="statistics", isolate=isolate)
    dbg.start(model)
    model(input_ids=ids, labels=ids).loss.backward()
    dbg.stop()
    folder = tmp_path / name / "step0" / "rank"
    with open(folder / "coverage.json") as fh:
        cov = json.load(fh)
    with open(folder / "dump.json") as fh:
        data = json.load(fh)["data"]
    return cov, data


@pytest.mark.parametrize("isolate", [False, True])
def test_moe_grouped_gemms_are_captured_and_coverage_is_full(tmp_path, isolate):
    """Stock Mixtral (transformers' default grouped_mm experts): torch._grouped_mm is captured forward and backward
    as Torch._grouped_mm (2 per layer), and every floating-point ATen op of the step ran inside a captured API
    (the isolation's own oracle and bench runs are not the model's work)."""
    cov, data = _dump(tmp_path, _mixtral(), isolate=isolate)
    gemms = sorted(k for k in data if k.startswith("Torch._grouped_mm."))
    assert gemms == ["Torch._grouped_mm.0.backward", "Torch._grouped_mm.0.forward", "Torch._grouped_mm.1.backward",
                     "Torch._grouped_mm.1.forward"]
    assert cov["share"] == 1.0 and cov["uncaptured"] == [] and cov["uncaptured_elements"] == 0
    assert cov["captured_ops"]["aten._grouped_mm"] > 0 and cov["captured_elements"] > 0
    assert cov["excluded"]["aten.view"] > 0  # views are listed, not counted


def test_an_uncaptured_api_is_named_forward_and_backward(tmp_path, monkeypatch):
    """With torch._grouped_mm left out of the capture (as it was before), coverage.json names it, forward and in
    the backward of its autograd node, and the share drops to what the other APIs compute."""
    monkeypatch.setattr(naming, "COMPUTE_PRIVATE", frozenset())
    monkeypatch.setattr(naming, "_TABLE", None)
    cov, data = _dump(tmp_path, _mixtral())
    assert not [k for k in data if "_grouped_mm" in k]
    ops = {(u["op"], u["pass"]): u for u in cov["uncaptured"]}
    assert set(ops) == {("aten._grouped_mm", "forward"), ("aten._grouped_mm", "backward of GroupedMmBackward0")}
    assert ops[("aten._grouped_mm", "forward")]["calls"] == 2
    assert ops[("aten._grouped_mm", "backward of GroupedMmBackward0")]["calls"] == 4  # d(input) and d(weight) each
    assert 0.3 < cov["share"] < 0.95
    total = cov["captured_elements"] + cov["uncaptured_elements"]
    assert cov["uncaptured_elements"] == sum(u["elements"] for u in cov["uncaptured"])
    assert cov["share"] == pytest.approx(cov["captured_elements"] / total)


@torch.library.custom_op("msprobe_ci_test::cube", mutates_args=())
def _cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@_cube.register_fake
def _(x):
    return torch.empty_like(x)


class _CustomOpNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.ops.msprobe_ci_test.cube(self.fc(x))


def test_a_custom_op_is_uncaptured_work_named_by_its_namespace(tmp_path):
    """An op no capture list knows (a torch.library custom op) computes outside every captured API: it is named
    with its own namespace and counted by the elements it writes; the Linear around it is captured."""
    torch.manual_seed(0)
    model, x = _CustomOpNet(), torch.randn(4, 8)
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "d"), level="mix", task="statistics", isolate=False)
    dbg.start(model)
    model(x)
    dbg.stop()
    cov = json.loads((tmp_path / "d" / "step0" / "rank" / "coverage.json").read_text())
    assert [(u["op"], u["pass"], u["calls"], u["elements"]) for u in cov["uncaptured"]] == \
        [("msprobe_ci_test.cube", "forward", 1, 32)]
    assert cov["captured_elements"] == 32 and cov["share"] == 0.5  # the Linear's 4x8 output, then the cube's


def test_coverage_note_and_a_bad_coverage_file(tmp_path):
    """read_coverage: a share below 1 adds its one-line summary to the notes; a hostile or broken coverage.json
    is a note saying why, never a crash of the compare."""
    from msprobe_ci.check import read_coverage

    folder = tmp_path / "f"
    folder.mkdir()
    assert read_coverage(str(folder)) is None
    (folder / "coverage.json").write_text(json.dumps({"share": 0.75, "uncaptured": [
        {"op": "aten.mm", "pass": "forward", "calls": 3, "elements": 12}]}))
    notes: list = []
    cov = read_coverage(str(folder), notes)
    assert cov["share"] == 0.75
    assert notes == ["coverage 75.0% of floating-point work; uncaptured: aten.mm x3 (forward)"]
    for bad in ('{"share": 2}', '{"share": "1"}', '{"share": 1, "uncaptured": [{"op": 1}]}', "[", '{"x": 1}'):
        (folder / "coverage.json").write_text(bad)
        notes = []
        assert read_coverage(str(folder), notes) is None
        assert len(notes) == 1 and notes[0].startswith("coverage.json unreadable (") and "\n" not in notes[0]


CUSTOM_OP_TEST = textwrap.dedent('''
    import torch

    @torch.library.custom_op("msprobe_ci_suite::cube", mutates_args=())
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x * x * x

    @cube.register_fake
    def _(x):
        return torch.empty_like(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.ops.msprobe_ci_suite.cube(self.fc(x))

    def test_net(msprobe):
        torch.manual_seed(0)
        msprobe.check(Net(), torch.randn(4, 8))
''')


def test_plugin_warns_and_require_coverage_fails(pytester):
    """In the plugin a check whose target computed outside every captured API passes with a warning naming the
    op; --msprobe-require-coverage makes it the test's failure, one line."""
    pytester.makepyfile(test_custom=CUSTOM_OP_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "always")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*msprobe: coverage 50.0% of floating-point work; uncaptured: "
                                 "msprobe_ci_suite.cube x1 (forward)*"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-require-coverage")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: coverage 50.0% of floating-point work; uncaptured: msprobe_ci_suite.cube "
                                 "x1 (forward): that work has no per-API verdict*--msprobe-require-coverage*"])
    assert os.path.isfile(pytester.path / "msprobe-out" / "test_custom.py_test_net" / "check0" / "target" /
                          "step0" / "rank" / "coverage.json")


def test_ranks_merge_into_one_coverage_figure():
    """check_parallel's merged (TP/PP) outcome carries the ranks' coverage as one figure: elements summed, the
    uncaptured ops merged by op and pass, the summary in the notes; ranks without a figure are left out."""
    from msprobe_ci.check import merge_coverage

    r0 = {"share": 0.5, "captured_elements": 10, "uncaptured_elements": 10,
          "uncaptured": [{"op": "aten.mm", "pass": "forward", "calls": 1, "elements": 10}]}
    r1 = {"share": 0.75, "captured_elements": 30, "uncaptured_elements": 10,
          "uncaptured": [{"op": "aten.mm", "pass": "forward", "calls": 2, "elements": 6},
                         {"op": "aten.exp", "pass": "backward of ExpBackward0", "calls": 1, "elements": 4}]}
    notes: list = []
    merged = merge_coverage([r0, None, r1], notes)
    assert merged["share"] == pytest.approx(40 / 60)
    assert merged["uncaptured"] == [{"op": "aten.mm", "pass": "forward", "calls": 3, "elements": 16},
                                    {"op": "aten.exp", "pass": "backward of ExpBackward0", "calls": 1, "elements": 4}]
    assert notes == ["coverage 66.7% of floating-point work; uncaptured: aten.mm x3 (forward), "
                     "aten.exp x1 (backward of ExpBackward0)"]
    assert merge_coverage([None, None]) is None
    full = {"share": 1.0, "captured_elements": 5, "uncaptured_elements": 0, "uncaptured": []}
    notes = []
    assert merge_coverage([full], notes)["share"] == 1.0 and notes == []


class _PaddedExperts(torch.nn.Module):
    """Three experts over a 16-row token buffer whose groups end at row 12: rows 12-15 are padding, which
    torch._grouped_mm leaves unwritten (uninitialised memory) in its output and in the gradient of its input."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 16, 8) / 4)

    def forward(self, x):
        y = torch._grouped_mm(x, self.w, offs=torch.tensor([4, 8, 12], dtype=torch.int32))
        return y[:12]


@pytest.mark.parametrize("kernel", ["device", "upcast"])
def test_grouped_gemm_over_a_padded_buffer_judges_only_what_it_writes(tmp_path, kernel):
    """The rows past the last group are no result (msprobe zeroes them for its grouped matmul): benign runs pass
    forward and backward whatever the uninitialised memory holds, and a 2% fault on the written rows is caught,
    forward and backward."""
    from msprobe_ci.capture.inject import Fault

    def run(name, faults=()):
        torch.manual_seed(0)
        model = _PaddedExperts().to(torch.bfloat16)
        x = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)
        dbg = PrecisionDebugger(dump_path=str(tmp_path / name), level="mix", task="statistics",
                                bench_kernel=kernel, inject=faults)
        dbg.start(model)
        model(x).float().pow(2).mean().backward()
        dbg.stop()
        nodes = json.loads((tmp_path / name / "step0" / "rank" / "isolation.json").read_text())["nodes"]
        return {k: v["status"] for k, v in nodes.items() if k.startswith("Torch._grouped_mm")}

    for i in range(3):
        assert run(f"benign{i}") == {"Torch._grouped_mm.0.forward": "pass", "Torch._grouped_mm.0.backward": "pass"}
    assert run("fwd", [Fault("Torch._grouped_mm", 0, "forward", "scale", 1.02)])["Torch._grouped_mm.0.forward"] == \
        "error"
    assert run("bwd", [Fault("Torch._grouped_mm", 0, "backward", "scale", 1.02)])["Torch._grouped_mm.0.backward"] \
        == "error"


def test_unwritten_regions_of_each_grouped_layout():
    """kernels.unwritten: which output and input-gradient elements a grouped GEMM does not write, per layout."""
    from msprobe_ci import kernels

    offs = torch.tensor([4, 8], dtype=torch.int32)
    g = torch._grouped_mm
    assert kernels.unwritten(g, (torch.ones(12, 16), torch.ones(2, 16, 8)), {"offs": offs}) == \
        {("output", 0): (0, 8), ("input", 0): (0, 8)}
    assert kernels.unwritten(g, (torch.ones(2, 6, 16), torch.ones(16, 12)), {"offs": offs}) == \
        {("output", 0): (1, 8), ("input", 1): (1, 8)}
    assert kernels.unwritten(g, (torch.ones(6, 12), torch.ones(12, 4)), {"offs": offs}) == \
        {("input", 0): (1, 8), ("input", 1): (0, 8)}
    assert kernels.unwritten(g, (torch.ones(8, 16), torch.ones(2, 16, 8)), {"offs": offs}) == {}  # all covered
    assert kernels.unwritten(torch.matmul, (torch.ones(8, 16), torch.ones(16, 8)), {"offs": offs}) == {}
    t = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(kernels.zero_past(t, (0, 2))[2:], torch.zeros(2, 3)) and torch.equal(t[2:], t[2:])
    assert kernels.zero_past(t, None) is t


def test_an_fp32_grouped_gemm_record_says_its_oracle_is_the_reference_decomposition(tmp_path):
    """fp32 inputs get a float64 oracle, which torch._grouped_mm has no kernel for: both isolation records say the
    oracle ran as one float64 matmul per group, and the call passes against it."""
    torch.manual_seed(0)
    model = _PaddedExperts()
    x = torch.randn(16, 16, requires_grad=True)
    dbg = PrecisionDebugger(dump_path=str(tmp_path / "d"), level="mix", task="statistics", bench_kernel="upcast")
    dbg.start(model)
    model(x).pow(2).mean().backward()
    dbg.stop()
    nodes = json.loads((tmp_path / "d" / "step0" / "rank" / "isolation.json").read_text())["nodes"]
    for name in ("Torch._grouped_mm.0.forward", "Torch._grouped_mm.0.backward"):
        assert nodes[name]["status"] == "pass", nodes[name]
        assert nodes[name]["oracle"] == ("torch._grouped_mm has no float64 kernel: its float64 oracle is one matmul "
                                         "per group")


def test_a_tensor_dump_of_moe_experts_is_replayed_offline(tmp_path):
    """A tensor dump made without isolation (another runner's): the grouped GEMMs are on the replay allowlist by
    name and replayed against their float64 reference; benign calls pass, a 2% fault on one is named."""
    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.dump import load_dump
    from msprobe_ci.replay import ApiReplayer

    def replay(name, faults=()):
        model = _mixtral()
        ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        dbg = PrecisionDebugger(dump_path=str(tmp_path / name), level="mix", task="tensor", isolate=False,
                                inject=faults)
        dbg.start(model)
        model(input_ids=ids, labels=ids).loss.backward()
        dbg.stop()
        r = ApiReplayer(load_dump(str(tmp_path / name / "step0" / "rank")), bench_kernel="upcast")
        return {n: r.check(n).status for n in r.api_names() if n.startswith("Torch._grouped_mm.")}

    assert replay("benign") == {f"Torch._grouped_mm.{i}.{d}": "pass" for i in (0, 1) for d in ("forward", "backward")}
    faulty = replay("fault", [Fault("Torch._grouped_mm", 1, "forward", "scale", 1.02)])
    assert faulty["Torch._grouped_mm.1.forward"] == "error"
    assert faulty["Torch._grouped_mm.0.forward"] == "pass"


class _OwnMatmul(torch.autograd.Function):
    """A user's autograd.Function whose backward is Python: two GEMMs that autograd runs without the caller's
    torch-function modes."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


class _OwnNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32, generator=torch.Generator().manual_seed(3)) / 6)

    def forward(self, x):
        return torch.tanh(_OwnMatmul.apply(x, self.w)).square().mean()


def test_a_custom_functions_python_backward_is_captured_and_judged(tmp_path):
    """The calls a custom autograd.Function's backward makes (torchao's float8 gradient GEMMs, a user's op) ran
    where autograd leaves the capture's mode off: unseen work. They are recorded as API calls of the backward pass
    (forward entries, numbered after the forward's), coverage is full, and each is judged on its own inputs: a 2%
    fault on the weight-gradient GEMM is named at it, the input-gradient GEMM passes."""
    from msprobe_ci.backends import Backend
    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.check import run_side
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    def side(name, faults=()):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
        run = run_side(_OwnNet(), (x,), lambda out: out, Backend.from_options("cpu", "bf16"),
                       DumpConfig(task="statistics", level="mix", dump_path=str(tmp_path / name)),
                       faults=tuple(faults), isolator=Isolator(backward=True))
        found = {}
        for f in ("dump.json", "coverage.json", "isolation.json"):
            with open(os.path.join(run.folder, f)) as fh:
                found[f] = json.load(fh)
        return found["dump.json"]["data"], found["coverage.json"], found["isolation.json"]["nodes"]

    data, cov, nodes = side("benign")
    gemms = sorted(k for k in data if k.startswith("Tensor.__matmul__."))
    assert gemms == [f"Tensor.__matmul__.{i}.forward" for i in range(3)]  # the forward's, then the backward's two
    assert cov["share"] == 1.0 and cov["uncaptured"] == [], cov["uncaptured"]
    assert [nodes[g]["status"] for g in gemms] == ["pass"] * 3
    _, _, nodes = side("fault", [Fault("Tensor.__matmul__", 2, "forward", "scale", 1.02)])
    assert (nodes["Tensor.__matmul__.1.forward"]["status"], nodes["Tensor.__matmul__.2.forward"]["status"]) == \
        ("pass", "error")


def test_gradients_entering_a_custom_functions_backward_are_computed_not_sources(tmp_path):
    """The gradient autograd hands a custom Function's backward was computed by the backward pass: the calls that
    backward makes take it as a computed input, never as a source to match the bench's (a 2% fault on the
    backward of the op after the Function, tanh, reaches them; before, the offline compare also failed both
    backward GEMMs on that input, beside the fault: BLOOM's GeLUFunction in training, issue 52)."""
    from msprobe_ci.backends import Backend
    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.check import run_side
    from msprobe_ci.check.outcome import judge
    from msprobe_ci.compare.verdict import unit_roundoff
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator
    from msprobe_ci.judge import JudgeSettings

    def side(name, dtype, faults=(), isolator=None):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
        return run_side(_OwnNet(), (x,), lambda out: out, Backend.from_options("cpu", dtype),
                        DumpConfig(task="statistics", level="mix", dump_path=str(tmp_path / name)),
                        faults=tuple(faults), isolator=isolator).folder

    bench = side("bench", "fp32")
    target = side("target", "bf16", [Fault("Torch.tanh", 0, "backward", "scale", 1.02)], Isolator(backward=True))
    report, _, _ = judge(bench, target, JudgeSettings(isolate=True, cast_roundoff=unit_roundoff("torch.bfloat16",
                                                                                             "torch.float32")))
    errors = [n.name for n in report.nodes if n.status == "error" and not n.name.startswith("Module.")]
    assert report.first_divergence.name == "Torch.tanh.0.backward" and errors == ["Torch.tanh.0.backward"], \
        [(n.name, n.message) for n in report.nodes if n.status == "error"]
