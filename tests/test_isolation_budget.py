"""Budgeted isolation (issue 51, item 3): every API kind judged each step, the other calls rotating across steps
within a cost factor; what was not judged is judged by the drift rule and said so in every artifact."""

import json
import math
import os
import xml.etree.ElementTree as ET

import pytest
import torch

from msprobe_ci.errors import MsprobeError
from msprobe_ci.isolate.budget import MIN_SHARE, IsolationBudget


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _step(budget, clock, kinds=4, calls=50, capture=1.0, cost=0.1):
    """One step of ``kinds`` x ``calls`` calls: each takes ``capture`` / (kinds x calls) seconds of its own, and a
    judged one ``cost`` seconds more. Returns the judged (kind, call) pairs."""
    judged = set()
    for i in range(calls):
        for k in range(kinds):
            clock.now += capture / (kinds * calls)
            if budget.take(f"Functional.k{k}", i):
                judged.add((k, i))
                clock.now += cost
                budget.add(cost)
    return judged


def test_every_kind_each_step_the_rest_rotating_deterministically():
    clock = Clock()
    budget = IsolationBudget(1e9, seed="tests/test_x.py::test_y", clock=clock)  # time never binds
    budget.share = 0.25
    seen, per_step = set(), []
    for step in range(12):
        budget.start(step)
        budget.share = 0.25  # held: the rotation alone
        judged = _step(budget, clock, cost=0.0)
        assert {(k, 0) for k in range(4)} <= judged  # the first call of every kind
        per_step.append(judged)
        seen |= judged
    assert seen == {(k, i) for k in range(4) for i in range(50)}  # every call came round within 12 steps
    assert all(0.15 < (len(j) - 4) / 196 < 0.35 for j in per_step)  # about the share each step
    assert len(per_step[0] & per_step[1]) < len(per_step[0]) / 2  # consecutive steps judge other calls
    again = IsolationBudget(1e9, seed="tests/test_x.py::test_y", clock=Clock())
    again.start(3)
    again.share = 0.25
    assert _step(again, Clock(), cost=0.0) == per_step[3]  # the same seed and step: the same calls
    other = IsolationBudget(1e9, seed="tests/test_x.py::test_z", clock=Clock())
    other.start(3)
    other.share = 0.25
    assert _step(other, Clock(), cost=0.0) != per_step[3]  # another test rotates otherwise


def test_the_factor_holds_within_a_step_and_the_share_follows_what_was_spent():
    clock = Clock()
    budget = IsolationBudget(1.5, clock=clock)
    assert budget.share == pytest.approx(0.5 / 3.5)  # the prior: full isolation 4.5x the capture alone
    budget.share = 1.0  # asks for everything: the guard alone holds the factor
    _step(budget, clock, capture=1.0, cost=0.05)
    s = budget.summary()
    assert s["kinds"] == 4 and s["calls"] == 200 and 4 < s["judged"] < 200
    # within the factor up to one call's cost (the guard admits a call while it is within)
    assert s["isolation_seconds"] <= 0.5 * s["capture_seconds"] + 0.05 + 1e-9
    assert s["measured_factor"] == pytest.approx((s["capture_seconds"] + s["isolation_seconds"]) /
                                                 s["capture_seconds"], rel=1e-3)
    # a step that spent twice what was allowed halves the share; one that spent a tenth doubles it (at most)
    budget.share, budget.spent, budget._t0 = 0.4, 1.0, clock.now - 2.0  # 1.0 s capture, 1.0 s isolation
    budget.start(1)
    assert budget.share == pytest.approx(0.2)
    budget.spent, budget._t0 = 0.05, clock.now - 1.05
    budget.start(2)
    assert budget.share == pytest.approx(0.4)
    budget.share, budget.spent, budget._t0 = 0.001, 100.0, clock.now - 101.0
    budget.start(3)
    assert budget.share == MIN_SHARE


@pytest.mark.parametrize("bad", [1, 0.5, "fast", float("nan"), float("inf"), True])
def test_a_factor_that_is_not_above_one_is_refused_in_one_line(bad):
    from msprobe_ci import PrecisionDebugger

    with pytest.raises(MsprobeError, match=r"isolate_budget: expected a number above 1 .*got") as info:
        IsolationBudget(bad)
    assert "\n" not in str(info.value)
    with pytest.raises(MsprobeError, match=r"PrecisionDebugger: isolate_budget: expected a number above 1"):
        PrecisionDebugger(isolate_budget=bad)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def test_a_users_loop_rotates_over_steps_and_every_call_is_judged_in_some_step(tmp_path):
    from msprobe_ci import PrecisionDebugger

    model = _gpt2()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    debugger = PrecisionDebugger(dump_path=str(tmp_path), level="mix", isolate_budget=1.5, rotation_seed="loop")
    steps = 6
    for _ in range(steps):
        debugger.start(model)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()
    judged: set = set()
    firsts, counts = [], []
    for step in range(steps):
        record = json.loads((tmp_path / f"step{step}" / "rank" / "isolation.json").read_text())
        budget, nodes = record["budget"], record["nodes"]
        forward = [n for n in nodes if n.endswith(".forward") and not n.startswith("Module.")]
        left_out = [n for n in forward if nodes[n].get("budget")]
        assert budget["step"] == step and budget["calls"] == len(forward)
        assert budget["judged"] == len(forward) - len(left_out)
        counts.append(len(left_out))
        kinds = {n.rsplit(".", 2)[0] for n in forward}
        assert budget["kinds"] == len(kinds)
        assert all(not nodes[f"{k}.0.forward"].get("budget") for k in kinds)  # the first of each kind
        for n in left_out:  # said, forward and backward
            assert "budgeted isolation" in nodes[n]["message"] and "drift rule" in nodes[n]["message"]
            back = n[: -len("forward")] + "backward"
            assert back not in nodes or nodes[back].get("budget")
        judged |= {n for n in forward if not nodes[n].get("budget")}
        firsts.append({f"{k}.0.forward" for k in kinds})
    # the rotation reaches calls beyond the first of each kind, other ones in other steps (how many a step
    # reaches is measured time: benchmarks/capture_overhead.py --modes budgeted-device)
    assert len(judged) > len(firsts[0]), (len(judged), len(firsts[0]))
    assert any(counts), counts  # and leaves calls out


PLUGIN_SUITE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def test_gpt2(msprobe):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    msprobe.check(GPT2LMHeadModel(cfg).eval(), {"input_ids": ids, "labels": ids}, loss_fn=lambda o: o.loss)
'''


def test_the_judged_share_is_stated_in_every_artifact(pytester, monkeypatch):
    pytest.importorskip("transformers")
    pytester.makepyfile(test_budget=PLUGIN_SUITE)
    summary = pytester.path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16",
                                           "--msprobe-isolate-budget=1.2", "--msprobe-junitxml=msprobe.xml")
    result.assert_outcomes(passed=1)
    (path,) = (pytester.path / "msprobe-out").rglob("msprobe-result.json")
    row = json.loads(path.read_text())
    budget = row["isolation_budget"]
    assert budget["factor"] == 1.2 and budget["seed"] == "test_budget.py::test_gpt2#run0"  # no cache: run 0
    assert 0 < budget["judged"] < budget["calls"]
    line = (f"budgeted isolation (factor 1.2): {budget['judged']} of {budget['calls']} API calls judged on their "
            "own inputs")
    assert any(line in ln for ln in result.outlines)  # the terminal
    assert line in (pytester.path / "msprobe-out" / "report.html").read_text(encoding="utf-8")
    assert line in summary.read_text(encoding="utf-8")  # the job summary
    suite = next(s for s in ET.parse(pytester.path / "msprobe.xml").getroot().iter("testsuite")
                 if s.find("properties") is not None)
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["msprobe.isolated_calls"] == f"{budget['judged']}/{budget['calls']}"
    assert props["msprobe.isolation_budget"] == "1.2"
    # a budgeted-out node is judged by the drift rule and says so in its testcase
    nodes = {n["name"]: n for n in row["nodes"]}
    left_out = [n for n in nodes.values() if "budgeted isolation" in n["message"]]
    assert left_out and all(n["status"] == n["drift_status"] for n in left_out)
    # a factor that is not above 1 is refused before anything runs, flag and ini alike
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-isolate-budget=1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--msprobe-isolate-budget: expected a number above 1*"])
    pytester.makeini("[pytest]\nmsprobe_isolate_budget = 0.9\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0 and "msprobe_isolate_budget" in result.stdout.str() + result.stderr.str()


def test_a_left_out_call_keeps_the_drift_verdict_and_rolls_up():
    from msprobe_ci.compare.isolated import apply_isolation
    from msprobe_ci.compare.isolation_file import IsolationRecord
    from msprobe_ci.compare.verdict import CompareResult
    from types import SimpleNamespace

    def node(name, status):
        return CompareResult(name, status, value=0.05, threshold=0.02, budget=0.02, input_error=0.0,
                             worst_row=f"{name}.output.0", metrics={}, message=f"{name}: drift {status}")
    nodes = [node("Functional.linear.1.forward", "error"), node("Functional.linear.2.forward", "pass"),
             node("Module.block.forward.0", "pass")]
    left = {"status": "skip", "message": "budgeted isolation (factor 1.5, step 0, share 10%): not judged", "budget": True}
    report = SimpleNamespace(nodes=nodes, rows=[], target_stack={}, entry_pairs={})
    apply_isolation(report, {"Functional.linear.1.forward": left, "Functional.linear.2.forward": dict(left)},
                    {"Functional.linear.1.forward": "Module.block.forward.0",
                     "Functional.linear.2.forward": "Module.block.forward.0"})
    out = {n.name: n for n in report.nodes}
    bad, ok = out["Functional.linear.1.forward"], out["Functional.linear.2.forward"]
    assert bad.status == "error" and bad.value == 0.05
    assert bad.message == ("Functional.linear.1.forward: budgeted isolation (factor 1.5, step 0, share 10%): not "
                           "judged; drift error (Functional.linear.1.forward: drift error)")
    assert bad.metrics == {"drift_status": "error", "drift_RelativeErr": 0.05, "drift_threshold": 0.02, "budget": True}
    assert ok.status == "pass" and ok.message == ("Functional.linear.2.forward: budgeted isolation (factor 1.5, step "
                                                  "0, share 10%): not judged; drift pass (Functional.linear.2.forward: "
                                                  "drift pass)")
    block = out["Module.block.forward.0"]  # the enclosing module names it
    assert block.status == "error" and block.message == "Module.block.forward.0: contains failing API " \
        "Functional.linear.1.forward"
    quiet = [CompareResult("Functional.linear.1.forward", "warning", value=0.05, threshold=0.02, budget=0.02,
                           input_error=0.0, worst_row="r", metrics={"Cosine": 0.9}, message="")]
    report = SimpleNamespace(nodes=quiet, rows=[], target_stack={}, entry_pairs={})
    apply_isolation(report, {"Functional.linear.1.forward": IsolationRecord.from_json(left, "x")}, {})
    w = report.nodes[0]  # a drift warning stays a warning; a node without a message adds none
    assert w.status == "warning" and w.metrics["Cosine"] == 0.9 and w.metrics["budget"] is True
    assert w.message == ("Functional.linear.1.forward: budgeted isolation (factor 1.5, step 0, share 10%): not "
                         "judged; drift warning")
    # where the drift rule is not calibrated its error is a warning: an optimizer's in-place update, and every
    # call after a loop's first step (sources are context there: source_factor inf)
    update = [node("Tensor.addcdiv_.2.forward", "error"), node("Tensor.__add__.1.forward", "error")]
    report = SimpleNamespace(nodes=update, rows=[], target_stack={}, entry_pairs={})
    apply_isolation(report, {n.name: dict(left) for n in update}, {})
    out = {n.name: n for n in report.nodes}
    assert out["Tensor.addcdiv_.2.forward"].status == "warning" and out["Tensor.addcdiv_.2.forward"].message == (
        "Tensor.addcdiv_.2.forward: budgeted isolation (factor 1.5, step 0, share 10%): not judged; drift error (a "
        "warning: the drift rule is not calibrated on an optimizer's update or after a loop's first step) "
        "(Tensor.addcdiv_.2.forward: drift error)")
    assert out["Tensor.__add__.1.forward"].status == "error"
    later = [node("Functional.linear.1.forward", "error")]
    report = SimpleNamespace(nodes=later, rows=[], target_stack={}, entry_pairs={})
    apply_isolation(report, {"Functional.linear.1.forward": dict(left)}, {}, source_factor=math.inf)
    assert report.nodes[0].status == "warning" and "drift error" in report.nodes[0].message


def test_isolation_json_holds_the_budget_and_the_compare_reads_it(tmp_path):
    from msprobe_ci.compare.isolation_file import describe_budget, load_budget

    assert load_budget(str(tmp_path)) is None
    (tmp_path / "isolation.json").write_text(json.dumps({"version": 1, "budget": {
        "factor": 1.5, "seed": "s", "step": 2, "share": 0.2, "calls": 10, "judged": 4, "kinds": 3,
        "isolation_seconds": 0.5, "capture_seconds": 1.0, "measured_factor": 1.5}, "nodes": {}}))
    budget = load_budget(str(tmp_path))
    assert budget["judged"] == 4 and budget["measured_factor"] == 1.5
    assert describe_budget(budget) == (
        "budgeted isolation (factor 1.5): 4 of 10 API calls judged on their own inputs (40%: the first of each of 3 "
        "API kinds, the rest rotating over steps, seed 's'); the other 6 judged by the drift rule; isolation cost "
        "1.50x the capture alone")
    over = dict(budget, judged=3, measured_factor=3.7)  # the kinds alone cost more than the factor
    assert describe_budget(over).endswith("isolation cost 3.70x the capture alone (above the factor asked: judging "
                                          "every API kind once a step costs that much here)")
    rotating = dict(budget, judged=4, measured_factor=1.6)  # more than the kinds judged: the share adapts
    assert describe_budget(rotating).endswith("; the other 6 judged by the drift rule; isolation cost 1.60x the "
                                              "capture alone (above the factor asked: the step's time is measured "
                                              "as it goes; the next step's share adapts)")
    assert describe_budget(dict(budget, judged=3, measured_factor=1.5)).endswith("1.50x the capture alone")
    assert describe_budget({"factor": 2}) == (  # no calls yet, no measurement: nothing judged by the drift rule
        "budgeted isolation (factor 2): 0 of 0 API calls judged on their own inputs (100%: the first of each of None "
        "API kinds, the rest rotating over steps, seed None); the other 0 judged by the drift rule")
    assert describe_budget({"factor": 2, "calls": 3}).startswith("budgeted isolation (factor 2): 0 of 3 API calls "
                                                                 "judged on their own inputs (0%:")
    (tmp_path / "isolation.json").write_text("{not json")
    assert load_budget(str(tmp_path)) is None
    assert os.path.isfile(tmp_path / "isolation.json")  # read, never rewritten


def test_consecutive_runs_rotate_on_through_pytests_cache(pytester):
    """With pytest's cache on, each session is the next run of a test's rotation: its seed says which (another
    seed, another order of the calls: test_every_kind_each_step_the_rest_rotating_deterministically)."""
    pytest.importorskip("transformers")
    pytester.makepyfile(test_budget=PLUGIN_SUITE)
    seeds = []
    for run in range(2):
        result = pytester.runpytest_subprocess("--msprobe-target-dtype=bf16", "--msprobe-isolate-budget=1.2",
                                               f"--msprobe-out=out{run}")
        result.assert_outcomes(passed=1)
        (path,) = (pytester.path / f"out{run}").rglob("msprobe-result.json")
        row = json.loads(path.read_text())
        seeds.append(row["isolation_budget"]["seed"])
    assert seeds == ["test_budget.py::test_gpt2#run0", "test_budget.py::test_gpt2#run1"]


def test_the_budgets_figures_and_rules_exactly():
    """The numbers each rule produces, pinned one by one (the rotation's priority, the share's bounds, the
    guard's edge, the step's summary)."""
    import zlib

    from msprobe_ci.isolate.budget import GOLDEN

    clock = Clock()
    budget = IsolationBudget(1e9, clock=clock)
    assert (budget.share, budget.step, budget.seed) == (1.0, 0, "")  # a share never above 1, step 0 first
    assert budget.summary() == {"factor": 1e9, "seed": "", "step": 0, "share": 1.0, "calls": 0, "judged": 0,
                                "kinds": 0, "isolation_seconds": 0.0, "capture_seconds": 0.0,
                                "measured_factor": None}  # nothing measured yet: no factor
    budget = IsolationBudget(2.0, seed="s", clock=clock)
    budget.start(2)
    h = zlib.crc32(b"Tensor.mul.3", zlib.crc32(b"s")) / 2.0 ** 32
    assert budget.priority("Tensor.mul", 3) == pytest.approx((h + 2 * GOLDEN) % 1.0, abs=1e-15)
    assert budget.reason() == ("budgeted isolation (factor 2, step 2, share 29%): not judged on its own inputs this "
                               "step; the drift rule judges it, and the rotation isolates it in a later step")
    assert budget.take("Tensor.mul", 0) and budget.judged == 1 and budget.kinds == {"Tensor.mul"}
    budget.share = budget.priority("Tensor.mul", 3)
    assert not budget.take("Tensor.mul", 3)  # a priority equal to the share is out
    budget.share = min(1.0, budget.priority("Tensor.mul", 3) + 1e-9)
    assert budget.take("Tensor.mul", 3) and (budget.calls, budget.judged) == (3, 2)
    assert budget.take("Tensor.add", 7) and (budget.calls, budget.judged) == (4, 3)  # another kind's first
    clock.now += 0.2501234567
    budget.add(0.1234567)
    assert budget.capture_seconds() == pytest.approx(0.1266667567)  # under a second: what it is
    assert budget.summary() == {"factor": 2.0, "seed": "s", "step": 2, "share": round(budget.share, 4), "calls": 4,
                                "judged": 3, "kinds": 2, "isolation_seconds": 0.123457, "capture_seconds": 0.126667,
                                "measured_factor": round(0.2501234567 / 0.1266667567, 4)}
    budget.add(0.2)  # now past (factor - 1) x capture: the guard refuses even a call the share admits
    budget.share = 1.0
    assert budget.priority("Tensor.mul", 4) < 1.0 and not budget.take("Tensor.mul", 4)
    # the share after a step: times allowed / spent, allowed = (factor - 1) x the step's capture (2 s here)
    budget = IsolationBudget(2.0, clock=clock)
    budget.share, budget.spent, budget._t0 = 0.5, 4.0, clock.now - 6.0
    budget.start(1)
    assert budget.share == pytest.approx(0.25)
    budget.share, budget.spent, budget._t0 = 0.9, 0.1, clock.now - 2.1
    budget.start(2)
    assert budget.share == 1.0  # doubled at most, and never above 1


def test_a_calls_backward_judgement_is_charged_to_the_budget(tmp_path):
    """The gradient a tap judges costs isolation time too: each backward judgement adds at least the seconds its
    record states (it added ~0 once, the clock read after the record had taken it)."""
    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    budget = IsolationBudget(1e9, seed="t")  # every call judged
    charged: list[float] = []
    add = budget.add
    budget.add = lambda s: (charged.append(s), add(s))[1]
    iso = Isolator(backward=True, budget=budget)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    cap = CaptureSession(DumpConfig(dump_path=str(tmp_path), level="mix"), isolator=iso)
    cap.start(model)
    loss = model(torch.randn(32, 64)).square().mean()
    forward = len(charged)
    loss.backward()
    cap.stop()
    during = charged[forward:]  # what the backward pass charged: one charge per tapped call
    backward = {n: r for n, r in iso.results.items() if n.endswith(".backward") and "seconds" in r}
    assert {"Functional.linear.0.backward", "Functional.gelu.0.backward", "Functional.linear.1.backward"} <= \
        set(backward)
    assert len(during) == len(backward)
    assert sum(during) >= sum(r["seconds"] for r in backward.values()) > 0
    cap.close()
