"""The rule modules pinned line by line: each test fails when one comparison, factor or word of the rule changes
(``python tools/mutation.py`` runs mutmut over these modules and counts what the suite notices).

Numbers come from the rules' docstrings: the node rule (``compare/verdict.py``), msprobe's overflow levels
(``overflow.py``, compare-overflow-visualization spec §2.1).
"""

import math
import os
import re

import pytest

from msprobe_ci import MsprobeError
from msprobe_ci.compare.verdict import CompareResult, Thresholds, judge, unit_roundoff
from msprobe_ci.dump.reader import Dump
from msprobe_ci.overflow import Anomaly, OverflowReport, anomalous, check_entry, check_overflow, new_overflows

U16 = 2.0 ** -8


# ---------------------------------------------------------------------------------------------------- verdict.py
def test_thresholds_defaults_are_the_documented_ones():
    th = Thresholds()
    assert (th.round_factor, th.propagation, th.error_factor, th.rel_floor, th.statistics_slack) == \
        (2.0, 1.0, 1.5, 1e-6, 1.25)


@pytest.mark.parametrize("key", ["round_factor", "propagation", "error_factor", "rel_floor", "statistics_slack"])
@pytest.mark.parametrize("bad", [-0.5, math.nan, True, "2"])
def test_thresholds_refuse_what_is_not_a_non_negative_number(key, bad):
    with pytest.raises(MsprobeError, match=rf"^threshold '{key}': expected a non-negative number, got "):
        Thresholds(**{key: bad})


def test_thresholds_zero_is_allowed_and_error_factor_is_at_least_one():
    Thresholds(round_factor=0, propagation=0, rel_floor=0, statistics_slack=0, error_factor=1)
    with pytest.raises(MsprobeError, match=r"^threshold 'error_factor': expected >= 1, got 0.99$"):
        Thresholds(error_factor=0.99)


def test_thresholds_from_a_mapping():
    assert Thresholds.from_mapping(None) == Thresholds()
    assert Thresholds.from_mapping({"round_factor": "3", "propagation": None, "error_factor": ""}) == \
        Thresholds(round_factor=3.0)
    assert Thresholds.from_mapping({"statistics_slack": 2}).statistics_slack == 2.0
    # the old option name atol is read by check.settings.merge only: the rule's own mapping refuses it
    with pytest.raises(MsprobeError, match=r"^thresholds: unknown key\(s\) \['a', 'atol', 'b'\]; allowed: "
                                           r"round_factor, propagation, error_factor, rel_floor, statistics_slack$"):
        Thresholds.from_mapping({"b": 1, "a": 2, "round_factor": 1, "atol": 1e-3})
    with pytest.raises(MsprobeError, match=r"^threshold 'propagation': expected a number, got 'x'$"):
        Thresholds.from_mapping({"propagation": "x"})
    with pytest.raises(MsprobeError, match=r"^threshold 'propagation': expected a number, got \[1\]$"):
        Thresholds.from_mapping({"propagation": [1]})


def test_budget_is_round_factor_u_plus_propagation_times_input_error_plus_floor():
    th = Thresholds()
    r = judge("n", 0.0, 0.01, U16, th)
    assert r.budget == pytest.approx(2 * U16 + 0.01 + 1e-6, rel=1e-12)
    assert r.threshold == pytest.approx(1.5 * r.budget, rel=1e-12)
    assert (r.input_error, r.roundoff, r.value, r.passing_threshold, r.name) == (0.01, U16, 0.0, 0.0, "n")
    assert judge("n", 0.25, 0.0, U16, th).passing_threshold == 0.25  # the loosest threshold that would pass
    # statistics widen only the propagation term, a gradient's cancellation multiplies both terms, not the floor
    assert judge("n", 0, 0.01, U16, th, statistics=True).budget == pytest.approx(2 * U16 + 1.25 * 0.01 + 1e-6)
    assert judge("n", 0, 0.01, U16, th, condition=3.0).budget == pytest.approx(3 * (2 * U16 + 0.01) + 1e-6)
    custom = Thresholds(round_factor=3, propagation=0.5, rel_floor=1e-3, error_factor=2, statistics_slack=2)
    r = judge("n", 0, 0.02, U16, custom, statistics=True)
    assert r.budget == pytest.approx(3 * U16 + 0.5 * 2 * 0.02 + 1e-3)
    assert r.threshold == pytest.approx(2 * r.budget)


def test_the_scale_tests_terms_and_message():
    th = Thresholds()
    r = judge("n", 0.02, 0.001, U16, th, statistics=True, second_order=1e-4, test="Norm", worst_row="n.output.0")
    assert r.budget == pytest.approx(2 * U16 + 1.25 * 0.001 + 1e-4 + 1e-6, rel=1e-12)
    assert r.status == "error" and r.message == (
        f"n: Norm RelativeErr 0.02 at n.output.0 vs threshold {r.threshold:.4g} (= 1.5 x (2*u 0.00391 + "
        "1.25*input Norm error 0.001 + input error^2 0.0001 + rel_floor 1e-06)): its scale moved more than its "
        "inputs' did")
    # the second-order term is added outside a gradient's cancellation factor
    assert judge("n", 0, 0.0, U16, th, condition=2.0, second_order=1e-3).budget == pytest.approx(
        2 * 2 * U16 + 1e-3 + 1e-6)
    ok = judge("n", 0.0, 0.001, U16, th, statistics=True, test="Norm")
    assert ok.status == "pass" and ok.message.endswith("rel_floor 1e-06))") and "input error^2" not in ok.message
    warn = judge("n", 1.2 * (2 * U16 + 1e-6), 0.0, U16, th, test="Norm")
    assert warn.status == "warning" and warn.message.endswith("its scale moved more than its inputs' did")


def test_model_cases_in_slices_match_the_whole(monkeypatch):
    import torch

    import msprobe_ci.check.outcome as check

    g = torch.Generator().manual_seed(0)
    b = torch.randn(37, 11, generator=g) * 1e20
    t = b * (1 + 1e-3 * torch.randn(37, 11, generator=g))
    b[3, 4] = t[3, 4] = float("inf")  # a shared overflow, in the first slice, left out of both norms
    whole = check.model_cases([("o", b)], [("o", t)], 1.0)[0]
    keep = torch.isfinite(b)
    expected = float(torch.linalg.vector_norm((t.double() - b.double())[keep]) /
                     torch.linalg.vector_norm(b.double()[keep]))
    assert whole["value"] == pytest.approx(expected, rel=1e-12)
    monkeypatch.setattr(check, "_CHUNK", 50)  # 9 slices, the last one short
    sliced = check.model_cases([("o", b)], [("o", t)], 1.0)[0]
    assert sliced["value"] == pytest.approx(expected, rel=1e-12)
    t[30, 0] = float("nan")  # one side only, in a later slice: counted over every slice
    t[0, 0] = float("-inf")
    (bad,) = check.model_cases([("o", b)], [("o", t)], 1.0)
    assert bad["message"] == "o: 2 element(s) NaN/Inf on one side only (target 3, bench 1 of 407 non-finite)"
    assert check._l2_in_chunks(t, b)[:4] == (2, 3, 1, 404)
    # the difference of two float32 outputs is taken in float64: opposite values near float32's range do not overflow
    (far,) = check.model_cases([("o", torch.tensor([3e38, 1.0]))], [("o", torch.tensor([-3e38, 1.0]))], 10.0)
    assert far["value"] == pytest.approx(2.0, rel=1e-12) and far["status"] == "pass"


def test_precision_notes_name_the_oracle_device_and_at_most_five_fallbacks():
    from types import SimpleNamespace

    import torch

    from msprobe_ci.check import precision_notes
    from msprobe_ci.isolate import Isolator

    backend = SimpleNamespace(label="cpu/fp64")
    capture = SimpleNamespace(precision_fallbacks={"torch._grouped_mm": "reference", "torch.foo": "torch.float32"},
                              isolator=Isolator(oracle_max=torch.float32, oracle_label="npu:0"))
    capture.isolator.oracle_fallbacks.update({f"torch.op{i}": f"why {i}" for i in range(7)})
    grouped, foo, oracle = precision_notes(capture, backend)
    assert grouped == ("cpu/fp64: torch._grouped_mm has no float64 kernel: it ran in float64 as its reference "
                       "decomposition (one matmul per group)")
    assert foo == ("cpu/fp64: torch.foo has no float64 kernel: it ran in torch.float32 (the best precision it "
                   "supports), its outputs cast back to float64")
    assert oracle == ("oracle on npu:0 (at most float32); 7 API(s) fell back to the CPU oracle; "
                      + "; ".join(f"torch.op{i}: why {i}" for i in range(5)) + " ...")
    capture.isolator.oracle_fallbacks.pop("torch.op6")
    assert precision_notes(capture, backend)[2].endswith("torch.op4: why 4 ...")  # six: one left out
    capture.isolator.oracle_fallbacks.pop("torch.op5")
    assert precision_notes(capture, backend)[2].endswith("torch.op4: why 4")  # five: no ellipsis
    capture.isolator = Isolator()  # the CPU float64 oracle: no note
    assert len(precision_notes(capture, backend)) == 2
    capture.isolator = None
    assert len(precision_notes(SimpleNamespace(precision_fallbacks={}), backend)) == 0


def test_the_standards_judge_where_a_float64_oracle_ran():
    """Isolation judges on the oracle's device when it computes in float64 there (CUDA: nothing copied to the
    host), on the CPU for the CPU oracle and for an oracle limited to float32 (an NPU's: the standards judge in
    float64); ``refs.judged`` moves a tensor there (detached) and leaves other values alone."""
    import torch

    from msprobe_ci.isolate import Isolator

    assert Isolator().judge_device == "cpu"
    assert Isolator(oracle_device="cuda:1").judge_device == "cuda:1"
    assert Isolator(oracle_device="npu:0", oracle_max=torch.float32).judge_device == "cpu"
    assert Isolator(oracle_max=torch.float32, oracle_label="npu:0").judge_device == "cpu"  # a CPU stand-in
    x = torch.ones(3, requires_grad=True) * 2
    moved = Isolator().refs.judged(x)
    assert not moved.requires_grad and moved.device.type == "cpu" and torch.equal(moved, x.detach())
    assert Isolator().refs.judged(1.5) == 1.5 and Isolator().refs.judged(None) is None


def test_pass_warning_error_at_the_exact_lines():
    th = Thresholds(rel_floor=0.0)
    budget = 2 * U16
    assert judge("n", budget, 0.0, U16, th).status == "pass"  # <= budget
    assert judge("n", math.nextafter(budget, 1), 0.0, U16, th).status == "warning"
    assert judge("n", 1.5 * budget, 0.0, U16, th).status == "warning"  # <= error_factor x budget
    assert judge("n", math.nextafter(1.5 * budget, 1), 0.0, U16, th).status == "error"
    assert judge("n", math.inf, 0.0, U16, th).status == "error"
    nan = judge("n", math.nan, 0.0, U16, th)
    assert (nan.status, nan.value) == ("error", math.inf)  # NaN error is no pass


def test_result_truth_and_message():
    th = Thresholds()
    r = judge("Functional.linear.0.forward", 0.5, 0.01, U16, th, worst_row="Functional.linear.0.forward.output.0",
              metrics={"Cosine": 0.9})
    assert not r and not r.passed and r.status == "error" and r.metric == "RelativeErr"
    assert r.message == ("Functional.linear.0.forward: RelativeErr 0.5 at Functional.linear.0.forward.output.0 vs "
                         f"threshold {1.5 * (2 * U16 + 0.01 + 1e-6):.4g} (= 1.5 x (2*u 0.00391 + 1*input error 0.01 + "
                         "rel_floor 1e-06))")
    assert r.worst_row == "Functional.linear.0.forward.output.0" and r.metrics == {"Cosine": 0.9}
    grad = judge("g", math.inf, math.inf, U16, th, condition=2.5)
    assert grad.message == ("g: RelativeErr inf at output vs threshold inf (= 1.5 x (cancellation 2.5 x "
                            "(2*u 0.00391 + 1*input error inf) + rel_floor 1e-06))")
    stats = judge("s", 0.0, 0.0, U16, th, statistics=True)
    assert "1.25*input error 0" in stats.message and stats and stats.passed
    assert CompareResult("w", "warning").passed and CompareResult("u", "unmatched").passed
    assert not CompareResult("e", "error").passed and bool(CompareResult("p", "pass"))
    assert judge("n", 0, 0, 0, th, metrics=None).metrics == {}


def test_unit_roundoff_is_the_coarsest_dtype():
    assert unit_roundoff("torch.bfloat16", "torch.float32") == 2.0 ** -8
    assert unit_roundoff("torch.float16") == 2.0 ** -11
    assert unit_roundoff("torch.float32") == 2.0 ** -24
    assert unit_roundoff("torch.int64", "torch.bool") == 0.0


# --------------------------------------------------------------------------------------------------- overflow.py
def _t(mx=1.0, mn=-1.0, mean=0.0, norm=1.0, **kw):
    return {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": mx, "Min": mn, "Mean": mean,
            "Norm": norm, **kw}


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity", "-Infinity", " NaN ", math.inf, -math.inf,
                                   math.nan])
def test_anomalous_reads_max_and_min(value):
    assert anomalous(_t(mx=value)) and anomalous(_t(mn=value))
    assert not anomalous(_t(mean=value)) and not anomalous(_t(norm=value))  # Max/Min decide when present
    assert anomalous({"Mean": value}) and not anomalous({"Norm": value})  # Mean only where both are absent
    assert anomalous({"Max": None, "Min": None, "Mean": value})


def test_finite_records_are_not_anomalous():
    assert not anomalous(_t(mx=3.4e38, mn=-3.4e38, mean="-inf"))
    assert not anomalous({}) and not anomalous({"Max": "1e5", "Min": 0})


def test_levels_critical_high_medium():
    clean, bad = _t(), _t(mx="nan")
    assert check_entry("A.f.0.forward", {"input_args": [clean], "output": [bad]}) == \
        Anomaly("A.f.0.forward", "critical", ("output.0",))
    assert check_entry("A.f.0.forward", {"input_args": [bad, clean], "input_kwargs": {"w": bad}, "output": [bad]}) == \
        Anomaly("A.f.0.forward", "high", ("input.0", "input.w", "output.0"))
    assert check_entry("A.f.0.forward", {"input_args": [bad], "output": [clean]}) == \
        Anomaly("A.f.0.forward", "medium", ("input.0",))
    assert check_entry("A.f.0.forward", {"input_args": [clean], "output": [clean]}) is None
    # a backward entry (input/output), nested records
    assert check_entry("A.f.0.backward", {"input": [[clean, {"x": bad}]], "output": [clean]}) == \
        Anomaly("A.f.0.backward", "medium", ("input.0.1.x",))
    assert check_entry("m.parameters_grad", {"weight": bad, "bias": clean}) == \
        Anomaly("m.parameters_grad", "critical", ("parameters_grad.weight",))
    assert check_entry("m.parameters_grad", {"weight": clean}) is None
    assert check_entry("x", ["not", "an", "entry"]) is None
    # which fields are inputs: a backward entry's "input" (with or without "output"); a forward entry's args and
    # kwargs; an entry with an output and no inputs at all has none
    assert check_entry("B.f.0.backward", {"input": [bad]}).level == "medium"
    assert check_entry("A.f.0.forward", {"input_kwargs": {"x": bad}}).level == "medium"
    assert check_entry("A.f.0.forward", {"output": [bad], "input_kwargs": {"x": bad}}).level == "critical"
    # a record is a dict with a dtype or a type; other dicts are containers
    assert check_entry("A.f.0.forward", {"input_args": [{"type": "torch.Tensor", "Max": "nan"}]}).level == "medium"
    assert check_entry("A.f.0.forward", {"input_args": [{"dtype": "torch.float32", "Min": "inf"}]}).level == "medium"
    assert check_entry("A.f.0.forward", {"input_args": [{"a": {"b": bad}}]}).rows == ("input.0.a.b",)


def test_uninitialised_outputs_and_receive_buffers_are_not_anomalies():
    bad, clean = _t(mn="-inf"), _t()
    assert check_entry("Torch.empty.0.forward", {"input_args": [], "output": [bad]}) is None
    assert check_entry("Tensor.new_empty.0.forward", {"input_args": [clean], "output": [bad]}) is None
    assert check_entry("Torch.empty_like.1.forward", {"input_args": [bad], "output": [bad]}).level == "medium"
    assert check_entry("Distributed.recv.0.forward", {"input_args": [bad], "output": [clean]}) is None
    assert check_entry("Distributed.all_gather.0.forward", {"input_args": [[bad], clean], "output": [clean]}) is None
    assert check_entry("Distributed.all_reduce.0.forward", {"input_args": [bad], "output": [clean]}).level == "medium"
    assert check_entry("Distributed.all_gather.0.forward", {"input_args": [clean, bad], "output": [clean]}) == \
        Anomaly("Distributed.all_gather.0.forward", "medium", ("input.1",))


def test_norm_jump_is_high_but_no_overflow():
    small, big = _t(norm=1.0), _t(norm=100.5)
    jump = check_entry("A.f.0.forward", {"input_args": [small, _t(norm=-0.5)], "output": [big]})
    assert jump == Anomaly("A.f.0.forward", "high", ()) and not jump.is_overflow
    assert "norm jump" in jump.message and "not an overflow" in jump.message
    assert check_entry("A.f.0.forward", {"input_args": [small], "output": [_t(norm=100.0)]}) is None  # > 100x only
    assert check_entry("A.f.0.forward", {"input_args": [_t(norm=0)], "output": [_t(norm=100.5)]}).level == "high"
    assert check_entry("A.f.0.forward", {"input_args": [_t(norm=0)], "output": [_t(norm=100)]}) is None
    assert check_entry("A.f.0.forward", {"input_args": [_t(norm=-2)], "output": [_t(norm=-201)]}).level == "high"
    assert check_entry("A.f.0.forward", {"input_args": [_t(norm=20)], "output": [_t(norm=30)]}) is None  # a ratio
    assert check_entry("A.f.0.forward", {"input_args": [small], "output": [_t(norm="inf")]}) is None  # not finite
    # non-tensors, missing or non-finite norms take no part
    assert check_entry("A.f.0.forward", {"input_args": [{"type": "int", "value": 1, "Norm": 0.001}],
                                         "output": [big]}) is None
    assert check_entry("A.f.0.forward", {"input_args": [_t(norm="x")], "output": [big]}) is None
    assert check_entry("A.f.0.forward", {"input_args": [small], "output": [_t(norm=None)]}) is None


def test_report_first_overflow_and_bench_twins():
    nan_in, nan_out, clean = _t(mx="nan"), _t(mx="nan"), _t()
    dump = Dump(folder=".", task="statistics", level="L1", data={
        "A.jump.0.forward": {"input_args": [_t(norm=1)], "output": [_t(norm=1000)]},
        "A.carry.0.forward": {"input_args": [nan_in], "output": [clean]},
        "A.make.0.forward": {"input_args": [clean], "output": [nan_out]},
        "A.make.1.forward": {"input_args": [clean], "output": [nan_out]},
    })
    rep = check_overflow(dump)
    assert [a.name for a in rep.anomalies] == ["A.jump.0.forward", "A.carry.0.forward", "A.make.0.forward",
                                               "A.make.1.forward"]
    assert [a.name for a in rep.jumps] == ["A.jump.0.forward"]
    assert [a.name for a in rep.overflows] == ["A.carry.0.forward", "A.make.0.forward", "A.make.1.forward"]
    assert rep.first.name == "A.make.0.forward"  # the first critical, not the first overflow
    assert rep.has_overflow and not rep
    assert rep.first.message == "A.make.0.forward: critical overflow (NaN/Inf in output.0)"
    only_medium = OverflowReport((Anomaly("m", "medium", ("input.0",)), Anomaly("n", "medium", ("input.0",))))
    assert only_medium.first.name == "m"
    jumps = OverflowReport((Anomaly("j", "high", ()),))
    assert jumps.first is None and not jumps.has_overflow and jumps
    assert OverflowReport(()).first is None
    bench = OverflowReport((Anomaly("A.make.0.forward", "critical", ("output.0",)),
                            Anomaly("A.carry.0.forward", "high", ("input.0",))))
    new = new_overflows(rep, bench)
    assert [a.name for a in new.anomalies] == ["A.carry.0.forward", "A.make.1.forward"]  # same node, other level
    long = Anomaly("x", "high", tuple(f"input.{i}" for i in range(6)))
    assert long.message == "x: high overflow (NaN/Inf in input.0, input.1, input.2, input.3)"


# ---------------------------------------------------------------------------------------------------- junit.py
def _node(name, status, **kw):
    return {"name": name, "status": status, "metric": "RelativeErr", "value": 0.5, "threshold": 0.01,
            "input_error": 0.001, "worst_row": f"{name}.output.0", "message": f"{name}: msg", **kw}


def _check(**kw):
    return {"test": "tests/test_m.py::test_x[1.5]", "index": 0, "bench": "cpu/float32", "target": "cpu/bfloat16",
            "mode": "statistics", "dir": "out/t", "started": "2026-11-26T00:00:00", "first_divergence": "A.f.0.forward",
            "nodes": [], **kw}


def _junit(tmp_path, results):
    import xml.etree.ElementTree as ET

    from msprobe_ci.check.row import CheckRow
    from msprobe_ci.pytest_plugin.junit import write_junit

    path = tmp_path / "sub" / "j.xml"
    write_junit(str(path), [CheckRow.from_json(r) for r in results])  # as the plugin reads msprobe-result.json
    root = ET.parse(path).getroot()
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    return root, cases


def _props(case):
    found = case.find("properties")
    assert found is not None and all(p.tag == "property" for p in found)
    return {p.get("name"): p.get("value") for p in found}


def test_classname_splits_where_ci_viewers_split():
    from msprobe_ci.pytest_plugin.junit import classname

    assert classname("tests/test_m.py::test_x[1.5]", 2) == "tests.test_m.test_x[1_5] check 2"
    assert classname("a\\b.c/test_m.py::C::t", 0) == "a.b_c.test_m.C__t check 0"
    assert classname("tests/test_m.py", 1) == "tests.test_m check 1"
    assert classname("conftest", 0) == "conftest check 0"


def test_junit_every_verdict_has_its_testcase(tmp_path):
    cls = "tests.test_m.test_x[1_5] check 0"
    nodes = [_node("A.f.0.forward", "error", standard="benchmark", drift=0.2, drift_status="warning", seconds=0.25),
             _node("A.g.0.forward", "warning", standard=""), _node("A.h.0.forward", "unmatched", message=""),
             _node("A.i.0.forward", "skip", message="not judgeable"), _node("A.j.0.forward", "pass")]
    model = [{"name": "model.output.0", "status": "error", "metric": "RelativeErr", "value": "inf",
              "threshold": 1e-3, "message": "output.0: 3 element(s) NaN/Inf on one side only"},
             {"name": "model.loss", "status": "pass", "metric": "RelativeErr", "value": 1e-6, "threshold": 1e-3,
              "message": "loss ok"},
             {"name": "model.output.1", "status": "skip", "metric": "RelativeErr", "value": 0.07, "threshold": 1e-3,
              "message": "output.1: not judged end to end: the target's run left the bench's at A.j.0.forward"}]
    api = [{"name": "Functional.a.0.forward", "status": "error", "message": "api bad"},
           {"name": "Functional.b.0.forward", "status": "warning", "message": "api warn"},
           {"name": "Functional.c.0.forward", "status": "skip", "message": "api skip"},
           {"name": "Functional.d.0.forward", "status": "pass", "message": ""}]
    results = [_check(index=1, recorded=True),  # a recording run compares nothing
               _check(index=2, skipped="no npu device"),
               _check(nodes=nodes, model=model, unapplied=["Functional.x.0.forward: never fired", "y"],
                      overflow_failed=True, overflow_message="A.f.0.forward: critical overflow",
                      overflow_first="A.f.0.forward", api_checks=api)]
    root, cases = _junit(tmp_path, results)
    err = cases[(cls, "A.f.0.forward")].find("failure")
    assert (err.get("message"), err.get("type")) == ("A.f.0.forward: msg", "accuracy")
    assert err.text.splitlines() == ["metric             RelativeErr", "value              0.5",
                                     "threshold          0.01", "standard           benchmark",
                                     "worst row          A.f.0.forward.output.0", "input error        0.001",
                                     "drift RelativeErr  0.2", "drift status       warning"]
    assert cases[(cls, "A.f.0.forward")].get("time") == "0.250000"
    assert [c.tag for c in cases[(cls, "A.f.0.forward")]] == ["properties", "failure"]
    assert _props(cases[(cls, "A.f.0.forward")]) == {
        "msprobe.status": "error", "msprobe.metric": "RelativeErr", "msprobe.value": "0.5",
        "msprobe.threshold": "0.01", "msprobe.input_error": "0.001", "msprobe.worst_row": "A.f.0.forward.output.0",
        "msprobe.standard": "benchmark", "msprobe.drift_RelativeErr": "0.2", "msprobe.drift_status": "warning"}
    warn = cases[(cls, "A.g.0.forward")]
    assert warn.find("failure") is None and warn.find("skipped") is None
    assert warn.find("system-out").text == ("msprobe warning: A.g.0.forward: msg\nmetric             RelativeErr\n"
                                            "value              0.5\nthreshold          0.01\n"
                                            "worst row          A.g.0.forward.output.0\ninput error        0.001")
    assert _props(warn)["msprobe.standard"] == "" and _props(warn)["msprobe.drift_status"] == ""
    assert _props(warn)["msprobe.drift_RelativeErr"] == ""
    assert cases[(cls, "A.h.0.forward")].find("skipped").get("message") == "no bench data matched"
    assert _props(cases[(cls, "A.h.0.forward")])["msprobe.standard"] == ""  # no standard named
    assert cases[(cls, "A.i.0.forward")].find("skipped").get("message") == "not judgeable"
    ok = cases[(cls, "A.j.0.forward")]
    assert [c.tag for c in ok] == ["properties"]
    model_err = cases[(cls, "model.output.0")].find("failure")
    assert (model_err.get("type"), model_err.get("message")) == ("end-to-end drift", model[0]["message"])
    assert "value              inf" in model_err.text
    assert _props(cases[(cls, "model.output.0")]) == {"msprobe.metric": "RelativeErr", "msprobe.value": "inf",
                                                      "msprobe.threshold": "0.001"}
    assert [c.tag for c in cases[(cls, "model.loss")]] == ["properties"]
    assert cases[(cls, "model.output.1")].find("skipped").get("message") == model[2]["message"]  # never a pass
    assert cases[(cls, "model.output.1")].find("failure") is None
    fault = cases[(cls, "injected-faults")].find("failure")
    assert (fault.get("message"), fault.get("type")) == ("Functional.x.0.forward: never fired; y", "fault never fired")
    ov = cases[(cls, "overflow")]
    assert (ov.find("failure").get("type"), ov.find("failure").get("message")) == \
        ("overflow", "A.f.0.forward: critical overflow")
    assert _props(ov) == {"msprobe.first_overflow": "A.f.0.forward"}
    api_cls = f"{cls}[api-check]"
    assert cases[(api_cls, "Functional.a.0.forward")].find("failure").get("type") == "api-accuracy"
    assert cases[(api_cls, "Functional.a.0.forward")].find("failure").get("message") == "api bad"
    assert cases[(api_cls, "Functional.b.0.forward")].find("system-out").text == "msprobe warning: api warn"
    assert cases[(api_cls, "Functional.c.0.forward")].find("skipped").get("message") == "api skip"
    assert [c.tag for c in cases[(api_cls, "Functional.d.0.forward")]] == ["properties"]
    assert _props(cases[(api_cls, "Functional.d.0.forward")]) == {"msprobe.status": "pass"}
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert set(suites) == {cls, api_cls, "tests.test_m.test_x[1_5] check 2"}  # the recorded run has none
    main = suites[cls]
    assert main.get("timestamp") == "2026-11-26T00:00:00"
    assert {p.get("name"): p.get("value") for p in main.find("properties")} == {
        "msprobe.test": "tests/test_m.py::test_x[1.5]", "msprobe.bench": "cpu/float32",
        "msprobe.target": "cpu/bfloat16", "msprobe.mode": "statistics", "msprobe.first_divergence": "A.f.0.forward",
        "msprobe.artifacts": "out/t"}
    assert (main.get("tests"), main.get("failures"), main.get("skipped")) == ("10", "4", "3")
    assert [c.get("name") for c in main.iter("testcase")] == [
        "A.f.0.forward", "A.g.0.forward", "A.h.0.forward", "A.i.0.forward", "A.j.0.forward", "model.output.0",
        "model.loss", "model.output.1", "injected-faults", "overflow"]
    skipped = cases[("tests.test_m.test_x[1_5] check 2", "check")].find("skipped")
    assert skipped.get("message") == "no npu device"


def test_junit_says_a_check_that_raised_and_a_failure_no_node_shows(tmp_path):
    """A check that raised before it concluded is one failed ``check`` case of type ``check raised`` (its message);
    a check that failed for a reason none of its node cases shows (coverage required, a fault that never fired) gets
    one ``verdict`` case, once per check even over several step rows, so JUnit agrees with the test."""
    raised = _check(index=0, error="MsprobeError: dump.json: malformed JSON")
    quiet = [_check(index=f"1 step{i}", first_divergence="", verdict="fail", failure="coverage 93% < 100% required")
             for i in (0, 1)]
    shown = _check(index="2 step0", verdict="fail", failure="divergence", nodes=[_node("A.f.0.forward", "error")])
    clean = _check(index=3, first_divergence="", verdict="pass")
    root, cases = _junit(tmp_path, [raised, *quiet, shown, clean])
    cls = "tests.test_m.test_x[1_5] check {}".format
    check = cases[(cls(0), "check")]
    assert (check.find("failure").get("message"), check.find("failure").get("type")) == (
        "MsprobeError: dump.json: malformed JSON", "check raised")
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert [c.get("name") for c in suites[cls(0)].iter("testcase")] == ["check"]
    verdicts = [(c.get("classname"), c.find("failure").get("message"), c.find("failure").get("type"))
                for c in root.iter("testcase") if c.get("name") == "verdict"]
    assert verdicts == [(cls("1 step0"), "coverage 93% < 100% required", "check failed")]  # once, not per step
    assert (cls("2 step0"), "verdict") not in cases and (cls(3), "verdict") not in cases  # its node shows it; clean
    no_message = _check(index=4, first_divergence="", verdict="fail")
    _, cases = _junit(tmp_path, [no_message])
    assert cases[(cls(4), "verdict")].find("failure").get("message") == "the check failed"


def test_junit_clean_check_and_no_overflow(tmp_path):
    cls = "tests.test_m.test_x[1_5] check 0"
    root, cases = _junit(tmp_path, [_check(nodes=[_node("A.f.0.forward", "pass", seconds=0)],
                                           first_divergence=None)])
    assert [c.tag for c in cases[(cls, "overflow")]] == ["properties"]
    assert _props(cases[(cls, "overflow")]) == {"msprobe.first_overflow": ""}
    assert cases[(cls, "A.f.0.forward")].get("time") in (None, "0", "0.000000")
    assert (cls, "injected-faults") not in cases
    suite = next(root.iter("testsuite"))
    assert {p.get("name"): p.get("value") for p in suite.find("properties")}["msprobe.first_divergence"] == ""
    assert root.iter("testsuite") and len(list(root.iter("testsuite"))) == 1
    first_line = (tmp_path / "sub" / "j.xml").read_bytes().split(b"\n")[0]
    assert first_line.startswith(b"<?xml version='1.0' encoding='utf-8'?>")
    _junit(tmp_path, [])  # our own report is replaced
    (tmp_path / "sub" / "j.xml").write_text("<not junit/>")
    with pytest.raises(MsprobeError, match=r"j.xml: JUnit XML exists and was not written by msprobe-ci"):
        _junit(tmp_path, [])  # a file that is not a JUnit report is never replaced


# ---------------------------------------------------------------------------------------------------- check.py
def test_model_cases_tolerance_and_error():
    import torch

    from msprobe_ci.check import model_cases

    b = torch.tensor([3.0, 4.0])
    assert model_cases(None, [("o", b)], None) == [] and model_cases([("o", b)], [], None) == []
    (case,) = model_cases([("o", b)], [("o", b * (1 + 1e-4))], None)
    assert case == {"name": "model.o", "status": "error", "metric": "RelativeErr",
                    "value": pytest.approx(1e-4, rel=1e-3), "threshold": 1e-5,  # fp32: 16 u is under the 1e-5 floor
                    "message": case["message"]}
    assert case["message"] == f"o: relative L2 error {case['value']:.4g} vs end-to-end tolerance 1e-05"
    bf = b.to(torch.bfloat16)
    (case,) = model_cases([("o", b)], [("o", bf)], None)
    assert case["threshold"] == 16 * 2.0 ** -8 and case["status"] == "pass"  # the coarser dtype's roundoff
    (case,) = model_cases([("o", b)], [("o", b * 1.001)], None, cast_u=2.0 ** -8)
    assert case["threshold"] == 16 * 2.0 ** -8 and case["status"] == "pass"  # the cast dtype counts
    (case,) = model_cases([("o", b)], [("o", b * 1.001)], 1e-4)
    assert case["threshold"] == 1e-4 and case["status"] == "error"
    (case,) = model_cases([("o", b)], [("o", b * 1.0001)], 1e-3)
    assert case["status"] == "pass" and case["value"] == pytest.approx(1e-4, rel=1e-2)
    (case,) = model_cases([("o", torch.tensor([2.0]))], [("o", torch.tensor([3.0]))], 0.5)
    assert case["value"] == 0.5 and case["status"] == "pass"  # err <= tol passes
    (case,) = model_cases([("o", b.to(torch.bfloat16))], [("o", b * 1.001)], None)
    assert case["threshold"] == 16 * 2.0 ** -8  # the bench's dtype counts too


def test_a_model_output_past_a_departure_is_skipped_and_says_where_the_runs_parted():
    """Past a decision the target made otherwise than the bench while computing correctly on its own inputs (an
    MoE router's top-k within a rounding, counted by ``histc``), the end-to-end distance is no rounding budget's:
    the case is ``skip`` with the node named, never a pass; NaN/Inf on one side only stays an error, and a non-isolated report (the drift
    rule alone, where that node is the failure) has no departure."""
    import torch

    from msprobe_ci.check import departure, model_cases
    from msprobe_ci.compare.report import CompareReport, RowResult
    from msprobe_ci.compare.rows import Row
    from msprobe_ci.compare.verdict import CompareResult

    # a floating node passing its own standard while its drift fails is what a fault under its threshold looks
    # like: no departure; a count (histc) or a node with an integer output is a decision
    nodes = [CompareResult("Functional.layer_norm.3.forward", "pass", metrics={"drift_status": "error"}),
             CompareResult("Torch.topk.0.forward", "pass", metrics={"drift_status": "pass"}),
             CompareResult("Torch.histc.0.forward", "pass", metrics={"drift_status": "error", "drift_RelativeErr":
                                                                     0.0613, "drift_threshold": 0.0492}),
             CompareResult("Torch.histc.1.forward", "pass", metrics={"drift_status": "error"})]
    where = departure(CompareReport("statistics", [], nodes, isolated=True))
    assert where is nodes[2]
    assert departure(CompareReport("statistics", [], nodes[:2], isolated=True)) is None
    assert departure(CompareReport("statistics", [], nodes, isolated=False)) is None
    assert departure(CompareReport("statistics", [], [CompareResult("Torch.histc.0.forward", "error", metrics={
        "drift_status": "error"})], isolated=True)) is None  # failing on its own inputs: no departure, a fault
    counts = Row("Torch.cumsum.0.forward.output.0", "Torch.cumsum.0.forward", "output",
                 {"type": "torch.Tensor", "dtype": "torch.int32", "shape": [4], "Max": 64, "Min": 17})
    cumsum = CompareResult("Torch.cumsum.0.forward", "pass", metrics={"drift_status": "error"})
    report = CompareReport("statistics", [RowResult(counts, counts, {}, 0.06)], [nodes[0], cumsum], isolated=True)
    assert departure(report) is cumsum
    # with digests (our dumps), a decision whose integer output differs from the bench's is one, drift or not
    rec = {"type": "torch.Tensor", "dtype": "torch.int64", "shape": [32, 2], "Max": 3, "Min": 0}
    mine = Row("Torch.topk.0.forward.output.1", "Torch.topk.0.forward", "output", dict(rec, digest="000000a1"))
    theirs = Row("Torch.topk.0.forward.output.1", "Torch.topk.0.forward", "output", dict(rec, digest="000000b2"))
    same = Row("Torch.topk.0.forward.output.1", "Torch.topk.0.forward", "output", dict(rec, digest="000000a1"))
    topk = CompareResult("Torch.topk.0.forward", "pass", metrics={"drift_status": "pass"})
    assert departure(CompareReport("statistics", [RowResult(mine, theirs, {}, 0.0)], [nodes[0], topk, cumsum],
                                   isolated=True)) is topk
    assert departure(CompareReport("statistics", [RowResult(mine, same, {}, 0.0)], [nodes[0], topk],
                                   isolated=True)) is None
    b = torch.tensor([3.0, 4.0])
    (case,) = model_cases([("o", b)], [("o", b * 1.1)], None, departure=where)
    assert case["status"] == "skip" and case["value"] == pytest.approx(0.1)
    assert "Torch.histc.0.forward (drift 0.0613 over 0.0492)" in case["message"]
    (case,) = model_cases([("o", b)], [("o", b * (1 + 1e-6))], None, departure=where)
    assert case["status"] == "pass"  # within the tolerance: judged as ever
    (case,) = model_cases([("o", b)], [("o", torch.tensor([3.0, float("nan")]))], None, departure=where)
    assert case["status"] == "error"
    (case,) = model_cases([("o", b)], [("o", b * 1.1)], None, departure=topk)
    assert "left the bench's at Torch.topk.0.forward (its integer outputs differ from the bench's)" in \
        case["message"]
    big = torch.tensor([1e30, 1e30])  # its norm overflows fp32: computed in float64
    (case,) = model_cases([("o", big)], [("o", big * 1.001)], None)
    assert case["value"] == pytest.approx(1e-3, rel=1e-3) and case["status"] == "error"
    # only outputs the bench has, with its shape
    assert model_cases([("o", b)], [("p", b), ("o", b[:1])], None) == []
    assert [c["name"] for c in model_cases([("o", b)], [("p", b), ("o", b)], None)] == ["model.o"]


def test_model_cases_nan_inf():
    import torch

    from msprobe_ci.check import model_cases

    inf = float("inf")
    b = torch.tensor([1.0, inf, 2.0])
    (shared,) = model_cases([("o", b)], [("o", b.clone())], None)
    assert shared["status"] == "pass" and shared["value"] == 0.0  # the bench's own overflow, compared on the rest
    (one,) = model_cases([("o", b)], [("o", torch.tensor([1.0, 3.0, float("nan")]))], None)
    assert one["status"] == "error" and one["value"] == "inf"
    assert one["message"] == "o: 2 element(s) NaN/Inf on one side only (target 1, bench 1 of 3 non-finite)"
    zero = torch.zeros(4)
    (z,) = model_cases([("o", zero)], [("o", zero.clone())], None)
    assert z["status"] == "pass" and z["value"] == 0.0
    tiny = torch.full((4,), 1e-40)  # fp32 subnormals: judged against sqrt(n) x the smallest normal
    (t,) = model_cases([("o", tiny)], [("o", tiny * 2)], None)
    expected = float(torch.linalg.vector_norm(tiny.double())) / (2 * 2.0 ** -126)
    assert t["status"] == "error" and t["value"] == pytest.approx(expected, rel=1e-9) and expected < 0.01
    (t,) = model_cases([("o", tiny)], [("o", tiny * 2)], 0.01)
    assert t["status"] == "pass"
    all_bad = torch.tensor([inf, -inf])
    (a,) = model_cases([("o", all_bad)], [("o", all_bad.clone())], None)
    assert a["status"] == "pass" and a["value"] == 0.0
    half = torch.full((4,), 1e-6)  # fp16 subnormals on one side, either side: fp16's smallest normal
    for b_, t_ in ((half, half.to(torch.float16)), (half.to(torch.float16), half)):
        (h,) = model_cases([("o", b_)], [("o", t_)], None)
        diff = float(torch.linalg.vector_norm(t_.double() - b_.double()))
        assert h["value"] == pytest.approx(diff / (2 * 2.0 ** -14), rel=1e-9), (b_.dtype, t_.dtype)
    (d,) = model_cases([("o", torch.zeros(1))], [("o", torch.ones(1))], None)
    assert d["value"] == pytest.approx(1 / 2.0 ** -126) and d["status"] == "error"


def test_flatten_outputs():
    import torch

    from msprobe_ci.check import flatten_outputs

    t = torch.ones(2)
    out = flatten_outputs({"logits": t, "loss": t, "ids": torch.ones(2, dtype=torch.long), "h": [t, (t,)]})
    assert [n for n, _ in out] == ["output.logits", "output.h.0", "output.h.1.0"]
    assert flatten_outputs(t, "x")[0][0] == "x" and flatten_outputs(3.0) == []

    class ModelOutput:  # transformers' shape: keys(), to_tuple() and item access
        def keys(self):
            return ["last_hidden_state"]

        def to_tuple(self):
            return (t,)

        def __getitem__(self, k):
            return t

    class KeysOnly:
        keys, __getitem__ = ModelOutput.keys, ModelOutput.__getitem__
    assert [n for n, _ in flatten_outputs(ModelOutput())] == ["output.last_hidden_state"]
    assert not hasattr(KeysOnly(), "to_tuple") and flatten_outputs(KeysOnly()) == []


class _Report:
    def __init__(self, first=None, nodes=(), unmatched=(), mode="statistics", isolated=True):
        self.first_divergence, self.nodes, self.unmatched, self.mode, self.isolated = first, list(nodes), \
            list(unmatched), mode, isolated
        self.seconds = {"A.f.0.forward": 0.1234567}

    def counts(self):
        return {"pass": len(self.nodes)}


class _Api:
    def __init__(self, status):
        self.name, self.status, self.message = f"api.{status}", status, status


def test_check_outcome_verdict_and_summary():
    from msprobe_ci.check import CheckOutcome

    node = CompareResult("A.f.0.forward", "error", value=math.inf, threshold=0.5, input_error=0.1,
                         worst_row="A.f.0.forward.output.0", message="m",
                         metrics={"standard": "benchmark", "drift_RelativeErr": 0.3, "drift_status": "warning"})
    plain = CompareResult("A.g.0.forward", "pass", value=0.001, threshold=0.5)
    ov = OverflowReport((Anomaly("A.f.0.forward", "critical", ("output.0",)),))
    clean = CheckOutcome(_Report(nodes=[plain]), None, None, "c.csv", None)
    assert clean.passed and not clean.overflow_failed and clean.model_errors == [] and clean.api_errors == []
    assert not clean.coverage_short
    assert not CheckOutcome(_Report(first=node), None, None, "c.csv", None).passed
    assert not CheckOutcome(_Report(), None, None, "c.csv", None, overflow=ov).passed
    assert CheckOutcome(_Report(), None, None, "c.csv", None, overflow=OverflowReport(())).passed
    model = ({"name": "model.o", "status": "error"}, {"name": "model.l", "status": "pass"})
    bad_model = CheckOutcome(_Report(), None, None, "c.csv", None, model=model)
    assert not bad_model.passed and bad_model.model_errors == [model[0]]
    apis = CheckOutcome(_Report(), None, None, "c.csv", None, api_checks=(_Api("error"), _Api("warning")))
    assert not apis.passed and [a.name for a in apis.api_errors] == ["api.error"]
    assert CheckOutcome(_Report(), None, None, "c.csv", None, api_checks=(_Api("warning"),)).passed
    assert CheckOutcome(_Report(), None, None, "c", None, coverage={"share": 0.99, "uncaptured": []}).coverage_short
    assert not CheckOutcome(_Report(), None, None, "c", None, coverage={"share": 1.0, "uncaptured": []}).coverage_short
    s = CheckOutcome(_Report(first=node, nodes=[node, plain], unmatched=[plain]), None, None, "c.csv", "g.vis.db",
                     model=model, overflow=ov, api_checks=(_Api("error"),),
                     coverage={"share": 0.5, "uncaptured": list(range(30))}).summary()
    assert s["csv"] == "c.csv" and s["graph"] == "g.vis.db" and s["mode"] == "statistics" and s["isolated"]
    assert s["nodes_compared"] == 1 and s["counts"] == {"pass": 2} and s["first_divergence"] == "A.f.0.forward"
    assert s["overflow_first"] == "A.f.0.forward" and s["overflow_failed"]
    assert s["overflow_message"] == "A.f.0.forward: critical overflow (NaN/Inf in output.0)"
    assert s["model"] == list(model) and s["api_checks"] == [{"name": "api.error", "status": "error",
                                                              "message": "error"}]
    assert s["coverage"] == {"share": 0.5, "uncaptured": list(range(20))}
    assert s["nodes"][0] == {"name": "A.f.0.forward", "status": "error", "metric": "RelativeErr", "value": "inf",
                             "threshold": 0.5, "input_error": 0.1, "worst_row": "A.f.0.forward.output.0",
                             "message": "m", "standard": "benchmark", "drift": 0.3, "drift_status": "warning",
                             "seconds": 0.123457}
    assert s["nodes"][1] == {"name": "A.g.0.forward", "status": "pass", "metric": "RelativeErr", "value": 0.001,
                             "threshold": 0.5, "input_error": 0.0, "worst_row": "", "message": "", "standard": "",
                             "drift": 0.001, "drift_status": "pass", "seconds": 0.0}
    quiet = CheckOutcome(_Report(), None, None, "c.csv", None,
                         overflow=OverflowReport((Anomaly("j", "high", ()),))).summary()
    assert quiet["overflow_first"] is None and not quiet["overflow_failed"] and quiet["overflow_message"] == ""
    assert "api_checks" not in quiet and "coverage" not in quiet and quiet["first_divergence"] is None
    medium = CheckOutcome(_Report(), None, None, "c", None,
                          overflow=OverflowReport((Anomaly("m", "medium", ("input.0",)),))).summary()
    assert medium["overflow_first"] == "m" and medium["overflow_message"].startswith("m: medium overflow")


def test_coverage_merge_and_read(tmp_path):
    import json

    from msprobe_ci.check import merge_coverage, read_coverage

    a = {"share": 0.9, "captured_elements": 90, "uncaptured": [{"op": "aten.mm", "pass": "forward", "calls": 2,
                                                                 "elements": 10}]}
    b = {"share": 0.5, "captured_elements": 30, "uncaptured": [{"op": "aten.mm", "pass": "forward", "calls": 1,
                                                                 "elements": 20},
                                                                {"op": "aten.mm", "pass": "backward", "calls": 1,
                                                                 "elements": 10}]}
    notes = []
    m = merge_coverage([a, None, b], notes)
    assert m == {"share": 120 / 160, "captured_elements": 120, "uncaptured_elements": 40, "uncaptured": [
        {"op": "aten.mm", "pass": "forward", "calls": 3, "elements": 30},
        {"op": "aten.mm", "pass": "backward", "calls": 1, "elements": 10}]}
    assert notes == ["coverage 75.0% of floating-point work; uncaptured: aten.mm x3 (forward), aten.mm x1 (backward)"]
    assert merge_coverage([None]) is None
    full = {"share": 1.0, "captured_elements": 0, "uncaptured": []}
    notes = []
    assert merge_coverage([full, dict(full, share=1.0)], notes)["share"] == 1.0 and notes == []
    assert merge_coverage([dict(full, share=0.25)])["share"] == 0.25  # no elements: the ranks' own figure
    assert merge_coverage([{"share": 1.0, "uncaptured": []}, a])["captured_elements"] == 90  # absent counts 0
    assert read_coverage(str(tmp_path)) is None
    notes = []
    (tmp_path / "coverage.json").write_text(json.dumps(dict(a, share=1)))
    got = read_coverage(str(tmp_path), notes)
    assert got["share"] == 1.0 and isinstance(got["share"], float) and notes == []
    (tmp_path / "coverage.json").write_text(json.dumps({"share": 0}))  # no ops listed; a share of 0 is a share
    assert read_coverage(str(tmp_path), notes) == {"share": 0.0} and notes == ["coverage 0.0% of floating-point work"]
    notes = []
    (tmp_path / "coverage.json").write_text(json.dumps(a))
    assert read_coverage(str(tmp_path), notes)["uncaptured"] == a["uncaptured"]
    assert notes == ["coverage 90.0% of floating-point work; uncaptured: aten.mm x2 (forward)"]
    for bad, why in [({"share": 1.5}, "share: expected a number in [0, 1], got 1.5"),
                     ({"share": -0.1}, "share: expected a number in [0, 1], got -0.1"),
                     ({"share": True}, "share: expected a number in [0, 1], got True"),
                     ({"share": "1"}, "share: expected a number in [0, 1], got '1'"),
                     ({"share": 0.5, "uncaptured": {}}, "uncaptured: expected a list of {op, pass, calls, elements}"),
                     ({"share": 0.5, "uncaptured": [{"op": "x", "pass": "f", "calls": 1, "elements": 1.5}]},
                      "uncaptured: expected"),
                     ({"share": 0.5, "uncaptured": [{"op": 1, "pass": "f", "calls": 1, "elements": 1}]},
                      "uncaptured: expected"),
                     ({"share": 0.5, "uncaptured": [{"op": "x", "pass": None, "calls": 1, "elements": 1}]},
                      "uncaptured: expected"),
                     ({"share": 0.5, "uncaptured": [{"op": "x", "pass": "f", "calls": "1", "elements": 1}]},
                      "uncaptured: expected"),
                     ({"share": 0.5, "uncaptured": ["x"]}, "uncaptured: expected"),
                     ({}, "share: missing"), ([], "list indices must be integers")]:
        (tmp_path / "coverage.json").write_text(json.dumps(bad))
        notes = []
        assert read_coverage(str(tmp_path), notes) is None
        assert notes[0].startswith(f"coverage.json unreadable ({tmp_path / 'coverage.json'}: {why}")
        assert notes[0].endswith("): no coverage figure") and notes[0].count(":") == 2 + why.count(":")
        assert "missing" not in notes[0] or why == "share: missing"
    (tmp_path / "coverage.json").write_text(json.dumps({"share": "x" * 500}))
    notes = []
    read_coverage(str(tmp_path), notes)
    assert notes == [f"coverage.json unreadable ({tmp_path / 'coverage.json'}: "
                     f"{('share: expected a number in [0, 1], got ' + repr('x' * 500))[:160]}): no coverage figure"]
    (tmp_path / "coverage.json").write_text("{")
    assert read_coverage(str(tmp_path)) is None
    (tmp_path / "coverage.json").write_bytes(b"\xff")
    notes = []
    assert read_coverage(str(tmp_path), notes) is None
    assert notes == [f"coverage.json unreadable ({tmp_path / 'coverage.json'}: 'utf-8' codec can't decode byte 0xff "
                     "in position 0: invalid start byte): no coverage figure"]


def test_grad_similarity():
    import torch

    from msprobe_ci.check import grad_similarity

    b = {"gone": torch.ones(1), "shape": torch.ones(2), "w": torch.tensor([1.0, -2.0, 0.0, 3.0]), "z": torch.zeros(2),
         "e": torch.zeros(0)}
    t = {"w": torch.tensor([1.0, 2.0, 0.5, 3.0]), "z": torch.zeros(2), "e": torch.zeros(0), "shape": torch.ones(3)}
    w, z, e = grad_similarity(b, t)
    assert w == {"param": "w", "cosine": pytest.approx(6 / (14 * 14.25) ** 0.5), "sign_agreement": 0.5,
                 "bench_norm": pytest.approx(14 ** 0.5), "target_norm": pytest.approx(14.25 ** 0.5), "bench_min": -2.0,
                 "bench_max": 3.0, "target_min": 0.5, "target_max": 3.0}
    assert z["cosine"] == 1.0 and z["sign_agreement"] == 1.0  # both zero: the same gradient
    assert e["cosine"] == 1.0 and e["sign_agreement"] == 1.0
    assert e["bench_min"] == e["bench_max"] == e["target_min"] == e["target_max"] == 0.0
    (small,) = grad_similarity({"w": torch.tensor([0.5, 0.0])}, {"w": torch.tensor([0.5, 0.5])})
    assert small["cosine"] == pytest.approx(0.5 ** 0.5)  # norms under 1 are no special case
    (one_zero,) = grad_similarity({"w": torch.zeros(2)}, {"w": torch.ones(2)})
    assert one_zero["cosine"] == 0.0 and one_zero["sign_agreement"] == 0.0


def test_precision_notes_name_the_api_and_how_it_ran():
    from types import SimpleNamespace

    from msprobe_ci.check import precision_notes

    capture = SimpleNamespace(precision_fallbacks={"Torch._grouped_mm": "reference", "Torch._scaled_mm": "float32"})
    assert precision_notes(capture, SimpleNamespace(label="cpu/float64")) == (
        "cpu/float64: Torch._grouped_mm has no float64 kernel: it ran in float64 as its reference decomposition "
        "(one matmul per group)",
        "cpu/float64: Torch._scaled_mm has no float64 kernel: it ran in float32 (the best precision it supports), "
        "its outputs cast back to float64")


# ------------------------------------------------------------------------------------------ compare/isolated.py
def _rec(mx, dt="torch.bfloat16", norm=1.0, **kw):
    return {"type": "torch.Tensor", "dtype": dt, "shape": [4], "Max": mx, "Min": -1.0, "Mean": 0.0, "Norm": norm,
            "requires_grad": False, **kw}


def _pair(target_out=3.0, bench_out=3.0, t_weight=2.0, b_weight=2.0, t_scalar=0.5, b_scalar=0.5, grad=1.0):
    """A target (bf16) and a bench (fp32) dump of one module holding a linear and a clamp, and a parameters_grad."""
    def data(dt, out, weight, scalar, g):
        return {
            "Functional.linear.0.forward": {"input_args": [_rec(1.0, dt), _rec(weight, dt)], "input_kwargs": {},
                                            "output": [_rec(out, dt)]},
            "Torch.clamp.0.forward": {"input_args": [_rec(out, dt), {"type": "float", "value": scalar}],
                                      "input_kwargs": {}, "output": [_rec(0.5, dt)]},
            "Functional.relu.0.forward": {"input_args": [_rec(1.0, dt)], "input_kwargs": {}, "output": [_rec(1.0, dt)]},
            "Module.m.Block.forward.0": {"input_args": [_rec(1.0, dt)], "input_kwargs": {}, "output": [_rec(out, dt)]},
            "Module.n.Other.forward.0": {"input_args": [_rec(1.0, dt)], "input_kwargs": {}, "output": [_rec(out, dt)]},
            "Module.m.Block.parameters_grad": {"weight": _rec(g, dt)},
        }
    construct = {"Functional.linear.0.forward": "Module.m.Block.forward.0",
                 "Torch.clamp.0.forward": "Module.m.Block.forward.0", "Module.m.Block.forward.0": "Module.top.forward.0",
                 "Functional.relu.0.forward": "Module.n.Other.forward.0"}
    t = Dump(folder=".", task="statistics", level="mix", data=data("torch.bfloat16", target_out, t_weight, t_scalar,
                                                                    grad), construct=construct)
    b = Dump(folder=".", task="statistics", level="mix", data=data("torch.float32", bench_out, b_weight, b_scalar, 1.0),
             construct=construct)
    return t, b


def _isolated(t, b, isolation, **kw):
    from msprobe_ci.compare import compare_dumps
    from msprobe_ci.compare.isolated import apply_isolation

    report = compare_dumps(bench=b, target=t)
    drift = {n.name: n for n in report.nodes}
    apply_isolation(report, isolation, t.construct, **kw)
    assert report.isolated
    return {n.name: n for n in report.nodes}, drift


_ERR = {"status": "error", "standard": "benchmark", "metric": "rmse", "value": 5.25, "threshold": 1.2,
        "row": "Functional.linear.0.forward.output.0", "message": "benchmark error: ratio 6.9 > 2", "seconds": 0.5}


def test_isolation_replaces_drift_for_api_nodes():
    t, b = _pair(target_out=3.3)  # linear's output drifts 9%
    nodes, drift = _isolated(t, b, {"Functional.linear.0.forward": _ERR,
                                    "Torch.clamp.0.forward": {"status": "skip", "message": "no oracle"},
                                    "Functional.relu.0.forward": dict(_ERR, status="warning", value=1.1)})
    lin = nodes["Functional.linear.0.forward"]
    assert (lin.status, lin.metric, lin.value, lin.threshold, lin.budget, lin.passing_threshold) == \
        ("error", "rmse", 5.25, 1.2, 1.2, 5.25)
    assert lin.message == ("Functional.linear.0.forward: benchmark standard on its own inputs: rmse 5.25 > 1.2 at "
                           "Functional.linear.0.forward.output.0 (benchmark error: ratio 6.9 > 2)")
    assert lin.worst_row == "Functional.linear.0.forward.output.0" and lin.input_error == drift[lin.name].input_error
    assert lin.metrics["standard"] == "benchmark" and lin.metrics["isolated"] is True and "rank" not in lin.metrics
    assert lin.metrics["drift_status"] == drift[lin.name].status and \
        lin.metrics["drift_RelativeErr"] == drift[lin.name].value
    assert lin.metrics["drift_threshold"] == drift[lin.name].threshold
    relu = nodes["Functional.relu.0.forward"]
    assert relu.status == "warning" and " 1.1 <= 1.2 at " in relu.message
    errors = {"target_max_rel_err": 0.02, "bench_max_rel_err": 0.004, "target_mean_rel_err": 0.01,
              "bench_mean_rel_err": 0.002}  # each call's error beside its bench's, for the lead
    again, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(_ERR, metrics=dict(errors, rmse_ratio="inf"))})
    assert {k: again["Functional.linear.0.forward"].metrics[k] for k in errors} == errors
    assert "rmse_ratio" not in again["Functional.linear.0.forward"].metrics
    clamp = nodes["Torch.clamp.0.forward"]
    assert (clamp.status, clamp.metric, clamp.value, clamp.threshold, clamp.budget) == \
        ("pass", "isolation", 0.0, math.inf, math.inf)
    assert clamp.message == "Torch.clamp.0.forward: not isolated (no oracle); drift pass"
    assert clamp.metrics["drift_status"] == "pass" and clamp.worst_row == drift[clamp.name].worst_row
    # modules: one holds the failing API, one only passing isolated calls, one nothing isolated
    block = nodes["Module.m.Block.forward.0"]
    assert (block.status, block.metric, block.metrics["rollup"]) == ("error", "contains", "Functional.linear.0.forward")
    assert block.message == "Module.m.Block.forward.0: contains failing API Functional.linear.0.forward"
    assert block.value == drift[block.name].value and block.passing_threshold == drift[block.name].value
    assert block.metrics["drift_status"] == drift[block.name].status
    other = nodes["Module.n.Other.forward.0"]
    assert other.status == "pass" and other.message.startswith(
        "Module.n.Other.forward.0: every isolated API inside passes; drift ")
    grads = nodes["Module.m.Block.parameters_grad"]
    assert grads.status == drift[grads.name].status  # parameters_grad that passed its drift stays as it is


def test_nodes_without_records_pass_on_drift_alone():
    t, b = _pair(target_out=3.3, grad=1.2)
    nodes, drift = _isolated(t, b, {"Torch.clamp.0.forward": dict(_ERR, status="pass", value=0.1)})
    lin = nodes["Functional.linear.0.forward"]
    assert drift[lin.name].status == "error" and lin.status == "pass"
    assert lin.message == f"Functional.linear.0.forward: not isolated; drift error ({drift[lin.name].message})"
    assert lin.metrics["drift_status"] == "error"
    other = nodes["Module.n.Other.forward.0"]
    assert other.status == "pass" and other.message.startswith("Module.n.Other.forward.0: no isolated call inside")
    assert drift["Module.m.Block.parameters_grad"].status in ("warning", "error")
    grads = nodes["Module.m.Block.parameters_grad"]
    assert grads.status == "pass" and grads.metrics["drift_status"] == drift[grads.name].status
    assert grads.message == ("Module.m.Block.parameters_grad: accumulated from isolated backward calls; drift "
                             f"{drift[grads.name].status}")


def test_a_module_isolated_whole_fails_when_a_call_inside_fails():
    t, b = _pair()
    rec_ok = dict(_ERR, status="pass", value=0.5, rank=3)
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": _ERR, "Module.m.Block.forward.0": rec_ok,
                                "Module.top.forward.0": rec_ok})
    block = nodes["Module.m.Block.forward.0"]
    assert block.status == "error" and block.metrics["rollup"] == "Functional.linear.0.forward"
    assert block.message == "Module.m.Block.forward.0: contains failing node Functional.linear.0.forward"
    assert block.metrics["rank"] == 3
    assert nodes["Functional.linear.0.forward"].metrics.get("rank") is None
    nodes, _ = _isolated(t, b, {"Module.m.Block.forward.0": rec_ok})
    assert nodes["Module.m.Block.forward.0"].status == "pass"


def test_sources_differ_beyond_the_conversion_of_their_dtype():
    rec = dict(_ERR, status="pass", value=0.1)
    weight = {"Functional.linear.0.forward.input.1": {"kind": "tensor", "id": "w"}}
    scalar = {"Torch.clamp.0.forward.input.1": {"kind": "scalar", "id": "s"}}
    t, b = _pair(t_weight=2.0 * (1 + 4 * 2.0 ** -8))  # 4 u of bf16, plus the 1e-7: just inside
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources=weight)})
    assert nodes["Functional.linear.0.forward"].status == "pass"
    t, b = _pair(t_weight=2.0 * 1.02)
    nodes, drift = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources=weight, rank=1)})
    lin = nodes["Functional.linear.0.forward"]
    assert (lin.status, lin.metric, lin.worst_row, lin.metrics["standard"], lin.metrics["rank"]) == \
        ("error", "source", "Functional.linear.0.forward.input.1", "source", 1)
    assert lin.threshold == lin.budget == pytest.approx(4 * 2.0 ** -8 + 1e-7 + 2.0 ** -24 * 2)
    assert lin.message == (
        "Functional.linear.0.forward: its input Functional.linear.0.forward.input.1 (tensor, not computed by any "
        f"captured API) differs from the bench: RelativeErr {lin.value:.4g} > {lin.threshold:.4g} (= 4 x u 0.00391, "
        "dtype conversion and fp32 statistics over 4 elements)")
    assert nodes["Module.m.Block.forward.0"].status == "error"  # the module holds the failing node
    # a source is judged once, at its first consumer; sources are context where the factor is infinite
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources=weight)}, source_factor=math.inf)
    assert nodes["Functional.linear.0.forward"].status == "pass"
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources=weight)})
    assert nodes["Functional.linear.0.forward"].metric == "source" and "rank" not in \
        nodes["Functional.linear.0.forward"].metrics  # a record of one rank's capture names no rank
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources=weight)}, source_factor=12)
    assert nodes["Functional.linear.0.forward"].status == "pass"  # 12 u covers 2%
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources=weight)}, cast_roundoff=2.0 ** -4)
    assert nodes["Functional.linear.0.forward"].status == "pass"  # the cast dtype's roundoff counts
    t, b = _pair(t_scalar=0.6)
    nodes, _ = _isolated(t, b, {
        "Functional.linear.0.forward": dict(rec, sources={"Functional.linear.0.forward.input.0": {"id": "x"}}),
        "Torch.clamp.0.forward": dict(rec, sources={"Torch.clamp.0.forward.input.1": {"kind": "scalar", "id": "x"}})})
    assert nodes["Torch.clamp.0.forward"].status == "pass"  # "x" was judged (and passed) at the linear
    t, b = _pair(t_scalar=0.6)
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": dict(rec, sources=scalar)})
    clamp = nodes["Torch.clamp.0.forward"]
    assert clamp.status == "error" and clamp.message.endswith(
        "input Torch.clamp.0.forward.input.1 (scalar, not computed by any captured API) differs from the bench: "
        "value 0.6 vs bench 0.5")
    t, b = _pair(t_scalar=0.5 * (1 + 1e-9))
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": dict(rec, sources=scalar)})
    assert nodes["Torch.clamp.0.forward"].status == "pass"


def test_seconds_roll_up_the_construct_tree():
    from msprobe_ci.compare.isolated import _seconds
    from msprobe_ci.compare.isolation_file import IsolationRecord

    construct = {"a": "m", "b": "m", "m": "top", "top": None, "c": 7}
    recs = {"a": 0.5, "b": 0.25, "m": 1, "y": "inf", "z": None, "c": 2.0, "n": "nan", "zero": 0.0}
    assert _seconds({k: IsolationRecord("pass", seconds=v) for k, v in recs.items()}, construct) == \
        {"a": 0.5, "b": 0.25, "m": 1.75, "top": 1.75, "c": 2.0}


def _frames(file, line, fn):
    return [f"File {file}, line {line}, in {fn},\n  code()", "File outer.py, line 1, in main"]


def test_call_sites_and_twins():
    from msprobe_ci.compare.isolated import _by_site, _call_site, _record_at, _site_twin

    assert _call_site(_frames("/a/b/model.py", 12, "forward")) == "model.py:line 12:in forward"
    assert _call_site(["File /x.py, line 3"]) is None and _call_site([]) is None and _call_site(None) is None
    assert _call_site([{"not": "a string"}]) is None and _call_site(["x.py, line 3, in f"]) is None
    assert _call_site(["  File /a/m.py, line 7, in g,\n  x = 1"]) == "m.py:line 7:in g"  # indented, comma-ended
    assert _call_site(["File m.py, line 7, in g, extra"]) == "m.py:line 7:in g"
    assert _call_site(["File m.py, line 7"]) is None and _call_site(["file m.py, line 7, in g"]) is None
    stack = {"Torch.clamp.0.forward": _frames("m.py", 5, "f"), "Torch.clamp.1.forward": _frames("m.py", 9, "f"),
             "Torch.clamp.2.forward": _frames("m.py", 5, "f"), "Torch.clamp.10.forward": _frames("m.py", 5, "f"),
             "Module.x.forward.0": _frames("m.py", 5, "f"), "Torch.clamp.3.backward": _frames("m.py", 5, "f"),
             "Torch.clamp.4.forward": ["no frame"]}
    index = _by_site(stack)
    assert index == {("Torch.clamp", "forward", "m.py:line 5:in f"): ["Torch.clamp.0.forward", "Torch.clamp.2.forward",
                                                                     "Torch.clamp.10.forward"],
                     ("Torch.clamp", "forward", "m.py:line 9:in f"): ["Torch.clamp.1.forward"],
                     ("Torch.clamp", "backward", "m.py:line 5:in f"): ["Torch.clamp.3.backward"]}
    bench = _by_site({"Torch.clamp.0.forward": _frames("m.py", 9, "f"), "Torch.clamp.1.forward": _frames("m.py", 5, "f"),
                      "Torch.clamp.2.forward": _frames("m.py", 5, "f")})
    assert _site_twin("Torch.clamp.0.forward", index, bench, stack) == "Torch.clamp.1.forward"
    assert _site_twin("Torch.clamp.2.forward", index, bench, stack) == "Torch.clamp.2.forward"
    assert _site_twin("Torch.clamp.10.forward", index, bench, stack) is None  # the bench made two there
    assert _site_twin("Torch.clamp.1.forward", index, bench, stack) == "Torch.clamp.0.forward"
    assert _site_twin("Torch.clamp.4.forward", index, bench, stack) is None  # no call site
    assert _site_twin("Torch.clamp.7.forward", index, bench, {"Torch.clamp.7.forward": _frames("m.py", 5, "f")}) \
        is None
    assert _site_twin("clamp", index, bench, {"clamp": _frames("m.py", 5, "f")}) is None
    entry = {"input_args": [{"type": "float", "value": 1.0}, [{"type": "int", "value": 2}, [{"type": "int",
                                                                                             "value": 3}]]],
             "input_kwargs": {"max": {"type": "float", "value": 4.0}}}
    assert _record_at(entry, "0") == {"type": "float", "value": 1.0}
    assert _record_at(entry, "1.1.0") == {"type": "int", "value": 3} and _record_at(entry, "1.0")["value"] == 2
    assert _record_at(entry, "max")["value"] == 4.0 and _record_at(entry, "min") is None
    assert _record_at(entry, "2") is None and _record_at(entry, "1.5") is None and _record_at(entry, "1") is None
    assert _record_at(entry, "1.x") is None and _record_at(entry, "0.0") is None
    assert _record_at({}, "0") is None


def test_a_branch_shifted_call_is_judged_against_its_twin_at_the_same_place():
    """The bench made clamp.0 at line 9 and clamp.1 at line 5; the target's clamp.0 is at line 5: its scalar is
    compared with the bench's clamp.1 (the same place), never with the bench's clamp.0."""
    t, b = _pair(t_scalar=0.5, b_scalar=0.7)
    b.data["Torch.clamp.1.forward"] = dict(b.data["Torch.clamp.0.forward"],
                                           input_args=[_rec(3.0, "torch.float32"), {"type": "float", "value": 0.5}])
    t.stack = {"Torch.clamp.0.forward": _frames("m.py", 5, "f")}
    b.stack = {"Torch.clamp.0.forward": _frames("m.py", 9, "f"), "Torch.clamp.1.forward": _frames("m.py", 5, "f")}
    rec = dict(_ERR, status="pass", value=0.1, sources={"Torch.clamp.0.forward.input.1": {"kind": "scalar",
                                                                                           "id": "s"}})
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": rec}, bench_stack=b.stack, bench_data=b.data)
    assert nodes["Torch.clamp.0.forward"].status == "pass"
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": rec}, bench_stack=None, bench_data=b.data)
    assert nodes["Torch.clamp.0.forward"].status == "error"  # stacks unknown: the call of the same name
    b.data["Torch.clamp.1.forward"]["input_args"][1] = {"type": "float", "value": 0.6}
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": rec}, bench_stack=b.stack, bench_data=b.data)
    clamp = nodes["Torch.clamp.0.forward"]
    assert (clamp.status, clamp.metric, clamp.value, clamp.passing_threshold, clamp.worst_row) == \
        ("error", "source", math.inf, math.inf, "Torch.clamp.0.forward.input.1")
    assert clamp.threshold == clamp.budget == 4 * 2.0 ** -24 + 1e-7  # the cast dtype's u (fp32 at least)
    assert clamp.message == ("Torch.clamp.0.forward: its input Torch.clamp.0.forward.input.1 (scalar, not computed by "
                             "any captured API) differs from the bench's call at the same place "
                             "(Torch.clamp.1.forward): value 0.5 vs bench 0.6")
    assert clamp.metrics["standard"] == "source" and nodes["Module.m.Block.forward.0"].status == "error"
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": rec}, bench_stack=b.stack, bench_data=b.data,
                         cast_roundoff=2.0 ** -3)  # 4 x 1/8: 0.5 vs 0.6 is within
    assert nodes["Torch.clamp.0.forward"].status == "pass"
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": rec}, bench_stack=b.stack, bench_data={})
    assert nodes["Torch.clamp.0.forward"].status == "pass"  # no bench entries: nothing to compare with
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": rec}, bench_stack=b.stack,
                         bench_data={"Torch.clamp.1.forward": "not an entry"})
    assert nodes["Torch.clamp.0.forward"].status == "pass"
    tensor_only = dict(rec, sources={"Torch.clamp.0.forward.input.0": {"kind": "tensor", "id": "t"},
                                     "Functional.relu.0.forward.input.1": {"kind": "scalar", "id": "r"}})
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": tensor_only}, bench_stack=b.stack, bench_data=b.data)
    assert nodes["Torch.clamp.0.forward"].status == "pass"  # tensors and other calls' rows are not compared there


def test_same_call():
    from types import SimpleNamespace

    from msprobe_ci.compare.isolated import _same_call

    here, there = _frames("m.py", 5, "f"), _frames("m.py", 9, "f")
    rep = SimpleNamespace(target_stack={"A.f.0.forward": here}, entry_pairs={"A.f.0.forward": "A.g.0.forward"})
    assert _same_call("A.f.0.forward", rep, None) and _same_call("A.f.0.forward", rep, {})
    assert _same_call("A.f.0.forward", rep, {"A.g.0.forward": here})  # through the entry pairing
    assert not _same_call("A.f.0.forward", rep, {"A.g.0.forward": there})
    assert not _same_call("A.f.0.forward", rep, {"A.f.0.forward": here})  # the bench made no A.g.0
    assert _same_call("A.f.0.forward", rep, {"A.g.0.forward": ["?"]})  # bench site unknown
    plain = SimpleNamespace(target_stack={}, entry_pairs=None)
    assert _same_call("A.f.0.forward", plain, {"X": here})  # target site unknown
    assert _same_call("A.f.0.forward", SimpleNamespace(), {"A.f.0.forward": there})


def test_isolation_files_and_replayed_records(tmp_path):
    import json

    from msprobe_ci.checkers import CheckResult
    from msprobe_ci.compare.isolated import _float, _fmt, is_tensor_dump, replay_isolation
    from msprobe_ci.compare.isolation_file import ISOLATION_FILE, IsolationRecord, load_isolation
    from msprobe_ci.replay.result import ApiResult

    assert ISOLATION_FILE == "isolation.json" and load_isolation(str(tmp_path)) is None
    path = tmp_path / "isolation.json"
    path.write_text(json.dumps({"nodes": {"a": {"status": "pass"}}}))
    assert load_isolation(str(tmp_path)) == {"a": IsolationRecord("pass")}
    for bad, why in [("{", "not readable JSON"), ("[]", "expected {'nodes': {name: record}}"),
                     ('{"nodes": []}', "expected"), ('{"nodes": {"a": 1}}', "expected")]:
        path.write_text(bad)
        with pytest.raises(MsprobeError, match=rf"^{path}: {why}"):
            load_isolation(str(tmp_path))
    # each record is typed, field by field: a file from another runner never reaches the compare malformed
    for rec, why in [({"status": "bogus"}, "status 'bogus', expected one of pass"),
                     ({"message": "x"}, "missing field 'status'"),
                     ({"status": "error", "value": "abc"}, "field 'value': expected a number"),
                     ({"status": "pass", "threshold": True}, "field 'threshold': expected a number"),
                     ({"status": "pass", "message": 3}, "field 'message': expected a string, got int$"),
                     ({"status": "pass", "sources": [1]}, "field 'sources': expected"),
                     ({"status": "pass", "sources": {"r": {"kind": "tensor"}}}, "field 'sources': expected"),
                     ({"status": "skip", "budget": "yes"}, "field 'budget': expected true or false"),
                     ({"status": "pass", "rank": "1"}, "field 'rank': expected an integer"),
                     ({"status": "pass", "metrics": [1]}, "field 'metrics': expected an object")]:
        path.write_text(json.dumps({"nodes": {"Functional.f.0.forward": rec}}))
        with pytest.raises(MsprobeError, match=rf"^{path}: node Functional.f.0.forward: {why}") as info:
            load_isolation(str(tmp_path))
        assert "\n" not in str(info.value)
    path.write_text(json.dumps({"nodes": {"Functional.f.0.forward": {
        "status": "error", "standard": "benchmark", "value": "inf", "threshold": 2, "seconds": 0.5, "rank": 1,
        "sources": {"Functional.f.0.forward.input.0": {"id": "S0", "kind": "parameter"}}, "oracle": "note"}}}))
    rec = load_isolation(str(tmp_path))["Functional.f.0.forward"]
    assert not rec and rec.value == "inf" and rec.threshold == 2 and rec.rank == 1 and rec.seconds == 0.5
    assert rec.sources["Functional.f.0.forward.input.0"]["id"] == "S0" and rec.extra == {"oracle": "note"}
    assert IsolationRecord("pass") and IsolationRecord("warning") and IsolationRecord("skip")
    ok = CheckResult("benchmark", "pass", {"rmse_ratio": 0.5}, {"rmse": 2.0}, {"rmse": 0.5}, "fine")
    bad = CheckResult("benchmark", "error", {"rmse_ratio": math.inf}, {"rmse": 2.0}, {"rmse": math.inf}, "ratio inf")
    recs = replay_isolation([ApiResult("A.f.0.forward", "error", [("A.f.0.forward.output.0", ok),
                                                                   ("A.f.0.forward.output.1", bad)]),
                             ApiResult("A.g.0.forward", "skip", reason="no such API"),
                             ApiResult("A.h.0.forward", "pass", [])])
    f = recs["A.f.0.forward"]
    assert f.status == "error" and not f and f.replayed is True and f.row == "A.f.0.forward.output.1"
    assert f.message == "benchmark error: ratio inf (replayed from the tensor dump)"
    assert f.value == "inf" and f.metrics == {"rmse_ratio": "inf"}  # JSON's non-finite numbers, as written
    assert recs["A.g.0.forward"] == IsolationRecord("skip", replayed=True, message="no such API")
    skipped = CheckResult("benchmark", "skip", {}, {}, {}, "nothing to compare")  # a skip with rows: its reason
    assert replay_isolation([ApiResult("A.k.0.forward", "skip", [("A.k.0.forward.output.0", skipped)], reason="why"),
                             ApiResult("A.h.0.forward", "pass", [])])["A.k.0.forward"] == \
        IsolationRecord("skip", replayed=True, message="why")
    assert recs["A.h.0.forward"] == IsolationRecord("pass", replayed=True, message="0 output(s) pass")
    assert replay_isolation([ApiResult("A.g.0.forward", "skip", reason="x")]) is None
    assert replay_isolation([]) is None
    assert _float("2.5") == 2.5 and math.isnan(_float(None)) and math.isnan(_float("x"))
    assert _fmt(math.inf) == "inf" and _fmt(1.23456) == "1.235" and _fmt(-math.inf) == "-inf"
    tensor = Dump(folder=".", task="tensor", level="L1", data={
        "a": {"input_args": [[[[[{"data_name": "a.pt"}]]]]]}})
    assert is_tensor_dump(tensor)
    assert is_tensor_dump(Dump(folder=".", task="tensor", level="L1", data={"a": {"output": {"k": {"data_name": "x"}}}}))
    assert not is_tensor_dump(Dump(folder=".", task="tensor", level="L1", data={
        "a": {"x": [[[[[[[{"data_name": "too deep"}]]]]]]]}}))

    def nested(k, as_list):
        v = {"data_name": "x"}
        for _ in range(k):
            v = [v] if as_list else {"m": v}
        return Dump(folder=".", task="tensor", level="L1", data={"a": v})

    # searched six levels below an entry
    assert [is_tensor_dump(nested(k, False)) for k in (5, 6, 7)] == [True, True, False]
    assert [is_tensor_dump(nested(k, True)) for k in (5, 6, 7)] == [True, True, False]
    assert is_tensor_dump(Dump(folder=".", task="tensor", level="L1", data={"a": [], "b": {"data_name": "x"}}))
    assert not is_tensor_dump(Dump(folder=".", task="statistics", level="L1", data={"a": {"output": [_rec(1.0)]}}))


def test_finfo_roles_and_scalar_rules():
    import torch

    from msprobe_ci.compare import isolated

    isolated._FINFO_CONSTANTS.clear()  # built once per process: rebuilt here from the table
    roles = isolated._finfo_roles()
    f16, bf16, f32, f64 = (torch.finfo(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    assert roles[f16.max] == {"max"} and roles[f16.min] == {"min"} and roles[f16.eps] == {"eps"}
    assert roles[f16.tiny] == {"tiny"} and roles[-f16.tiny] == {"-tiny"}
    assert roles[bf16.max] == {"max"} and roles[bf16.eps] == {"eps"} and roles[f32.tiny] == {"tiny"}  # bf16's too
    assert roles[f32.max] == {"max"} and roles[f32.min] == {"min"} and roles[f64.max] == {"max"}
    assert roles[f64.eps] == {"eps"} and roles[-f64.tiny] == {"-tiny"} and roles[f32.eps] == {"eps"}
    assert len(roles) == 18  # 4 dtypes x 5 constants, bf16's tiny and -tiny shared with fp32's
    assert isolated._finfo_roles() is roles
    differs = isolated._scalar_differs

    def d(t, b):
        return differs(t, b, 1e-6)

    assert not d(True, True) and d(True, False) and d(True, 1.5)
    assert d(1, True) is False  # 1 == True in Python: equal before the type rules
    assert not d("a", "a") and d("a", "b") and d(None, 0) and not d(None, None)
    assert d([1], [2]) and not d([1], [1]) and not d("1", 1)  # non-numbers compare as text
    assert not d(math.nan, math.nan) and d(math.nan, 1.0) and d(1.0, math.nan)
    assert not differs(1.0, 1.0 + 1e-7, 1e-6) and differs(1.0, 1.0 + 2e-6, 1e-6)
    assert not differs(0.0, 1e-37, 1e-6)  # relative to at least 1e-30
    assert differs(0.0, 1e-35, 1e-6) and not differs(-2.0, -2.0 * (1 + 1e-7), 1e-6)
    assert differs(f16.max, f16.min, 1e-6) and not differs(f16.min, f32.min, 1e-6)
    assert not differs(-f16.tiny, -f32.tiny, 1e-6) and differs(f16.tiny, -f32.tiny, 1e-6)
    # the top-binade allowance: bench beyond the target's range, target in [t_max / 2, t_max], same sign
    top = f16.max
    assert not differs(top, 1e6, 1e-6, t_max=top) and not differs(top / 2, 1e6, 1e-6, t_max=top)
    assert differs(top / 2 - 1, 1e6, 1e-6, t_max=top) and differs(top * 1.5, 1e6, 1e-6, t_max=top)
    assert differs(top, top, 0, t_max=top) is False and differs(-top, 1e6, 1e-6, t_max=top)
    assert not differs(-top, -1e6, 1e-6, t_max=top) and differs(top, 1e6, 1e-6)  # no range given: a difference
    assert differs(top, top * 1.5, 1e-6, t_max=top * 1.5)  # the bench within the range: compared as numbers


def _cnode(name, status="pass", **kw):
    base = dict(value=0.01, threshold=0.02, budget=0.013, input_error=0.004, worst_row=f"{name}.output.0",
                metrics={"Cosine": 0.99}, message=f"{name}: drift msg")
    return CompareResult(name, status, **{**base, **kw})


def _report(nodes, rows=(), **kw):
    from types import SimpleNamespace

    return SimpleNamespace(nodes=list(nodes), rows=list(rows), target_stack={}, entry_pairs={}, **kw)


def test_a_module_isolation_skipped_rolls_up_what_is_inside_it():
    """A module isolation could not judge whole (dropout inside, sharded state) is judged by what is inside it."""
    from msprobe_ci.compare.isolated import apply_isolation

    construct = {"Functional.f.0.forward": "Module.m.forward.0", "Functional.g.0.forward": "Module.n.forward.0"}
    skipped = {"status": "skip", "message": "module not isolated: random (dropout p=0.1 in training mode inside)"}
    report = _report([_cnode("Functional.f.0.forward", "error"), _cnode("Module.m.forward.0", "error"),
                      _cnode("Functional.g.0.forward", "pass"), _cnode("Module.n.forward.0", "error")])
    apply_isolation(report, {"Functional.f.0.forward": dict(_ERR, row="Functional.f.0.forward.output.0"),
                             "Module.m.forward.0": skipped, "Functional.g.0.forward": dict(_ERR, status="pass"),
                             "Module.n.forward.0": dict(skipped)}, construct)
    out = {n.name: n for n in report.nodes}
    m, n = out["Module.m.forward.0"], out["Module.n.forward.0"]
    assert (m.status, m.metric, m.message) == ("error", "contains", "Module.m.forward.0: contains failing API "
                                                                    "Functional.f.0.forward")
    assert (n.status, n.message) == ("pass", "Module.n.forward.0: every isolated API inside passes; drift error")
    assert (n.metrics["drift_status"], n.metrics["drift_RelativeErr"], n.metrics["drift_threshold"]) == \
        ("error", 0.01, 0.02)  # the module's own drift, not the skip's placeholder numbers


def test_apply_isolation_keeps_each_nodes_numbers():
    from msprobe_ci.compare.isolated import apply_isolation

    construct = {"Functional.f.0.forward": "Module.m.forward.0", "Module.m.forward.0": "Module.top.forward.0",
                 "Functional.g.0.forward": "Module.n.forward.0"}
    nodes = [_cnode("Functional.w.0.forward", "warning"), _cnode("Functional.nostatus.0.forward", "error"),
             _cnode("Functional.f.0.forward", "error"), _cnode("Functional.g.0.forward", "warning"),
             _cnode("Module.m.forward.0", "warning"), _cnode("Module.top.forward.0", "pass"),
             _cnode("Module.n.forward.0", "error"), _cnode("Module.u.forward.0", "unmatched"),
             _cnode("Module.m.parameters_grad", "warning"), _cnode("Module.iso.forward.0", "error"),
             _cnode("Module.n.parameters_grad", "error")]
    with pytest.raises(MsprobeError, match=r"^isolation record Functional.nostatus.0.forward: missing field 'status'$"):
        apply_isolation(_report(nodes), {"Functional.nostatus.0.forward": {}}, construct)
    isolation = {"Functional.nostatus.0.forward": {"status": "skip"},
                 "Functional.f.0.forward": {"status": "error", "standard": "ulp", "value": "inf", "threshold": 1.0,
                                   "seconds": 0.25},
                 "Functional.g.0.forward": {"status": "warning", "standard": "benchmark", "metric": "rmse", "value": 1.1,
                                   "threshold": 1.2, "row": "Functional.g.0.forward.output.1", "message": "close"},
                 "Module.iso.forward.0": {"status": "error", "standard": "benchmark", "value": 3, "threshold": 2}}
    report = _report(nodes)
    apply_isolation(report, isolation, construct)
    out = {n.name: n for n in report.nodes}
    drift = {"drift_status", "drift_RelativeErr", "drift_threshold"}
    w = out["Functional.w.0.forward"]  # a drift warning without a record: passes, saying so
    assert w.status == "pass" and w.message == "Functional.w.0.forward: not isolated; drift warning (Functional.w.0.forward: drift msg)"
    assert w.metrics == {"Cosine": 0.99, "drift_status": "warning", "drift_RelativeErr": 0.01, "drift_threshold": 0.02}
    ns = out["Functional.nostatus.0.forward"]  # a skip record without a message
    assert (ns.status, ns.metric, ns.input_error, ns.worst_row, ns.passing_threshold) == \
        ("pass", "isolation", 0.004, "Functional.nostatus.0.forward.output.0", 0.0)
    assert ns.message == "Functional.nostatus.0.forward: not isolated (); drift error" and ns.metrics["Cosine"] == 0.99
    assert drift <= set(ns.metrics)
    f = out["Functional.f.0.forward"]
    assert (f.status, f.metric, f.value, f.threshold, f.input_error, f.worst_row) == \
        ("error", "ulp", math.inf, 1.0, 0.004, "Functional.f.0.forward.output.0")  # metric: the standard; row: the node's
    assert f.message == ("Functional.f.0.forward: ulp standard on its own inputs: ulp inf > 1 at "
                         "Functional.f.0.forward.output.0 ()")
    assert f.metrics["Cosine"] == 0.99 and f.metrics["standard"] == "ulp" and drift <= set(f.metrics)
    g = out["Functional.g.0.forward"]
    assert (g.status, g.metric, g.worst_row, g.message) == ("warning", "rmse", "Functional.g.0.forward.output.1",
                                                            "Functional.g.0.forward: benchmark standard on its own inputs: "
                                                            "rmse 1.1 <= 1.2 at Functional.g.0.forward.output.1 (close)")
    m = out["Module.m.forward.0"]  # holds the failing call
    assert (m.status, m.metric, m.value, m.threshold, m.budget, m.input_error, m.worst_row, m.passing_threshold) == \
        ("error", "contains", 0.01, 0.02, 0.013, 0.004, "Module.m.forward.0.output.0", 0.01)
    assert m.metrics == {"Cosine": 0.99, "drift_status": "warning", "drift_RelativeErr": 0.01,
                         "drift_threshold": 0.02, "rollup": "Functional.f.0.forward"}
    assert out["Module.top.forward.0"].metrics["rollup"] == "Functional.f.0.forward"
    n = out["Module.n.forward.0"]
    assert n.status == "pass" and n.message == "Module.n.forward.0: every isolated API inside passes; drift error"
    assert n.metrics == {"Cosine": 0.99, "drift_status": "error", "drift_RelativeErr": 0.01, "drift_threshold": 0.02}
    assert out["Module.u.forward.0"].status == "unmatched" and out["Module.u.forward.0"].message.endswith("drift msg")
    pg = out["Module.m.parameters_grad"]
    assert pg.status == "pass" and pg.metrics == {"Cosine": 0.99, "drift_status": "warning"}
    assert (out["Module.n.parameters_grad"].status, out["Module.n.parameters_grad"].message) == (
        "pass", "Module.n.parameters_grad: accumulated from isolated backward calls; drift error")  # at its calls
    iso = out["Module.iso.forward.0"]  # isolated whole and failing on its own: its own message stays
    assert iso.status == "error" and iso.message.startswith("Module.iso.forward.0: benchmark standard on its own")
    assert report.seconds == {"Functional.f.0.forward": 0.25, "Module.m.forward.0": 0.25, "Module.top.forward.0": 0.25}
    # records without sources never look for a twin, whatever bench data is given
    report = _report([_cnode("Functional.f.0.forward")])
    apply_isolation(report, {"Functional.f.0.forward": {"status": "pass", "standard": "ulp"}}, construct, bench_data={"x": {}},
                    bench_stack={"Functional.f.0.forward": ["File a.py, line 1, in f"]})
    assert report.nodes[0].status == "pass"


def test_roll_up_is_bounded_on_a_construct_cycle_and_reaches_1000_ancestors():
    from msprobe_ci.compare.isolated import apply_isolation

    cycle = {"Functional.f.0.forward": "Module.a.forward.0", "Module.a.forward.0": "Module.b.forward.0",
             "Module.b.forward.0": "Module.a.forward.0"}
    report = _report([_cnode("Functional.f.0.forward"), _cnode("Module.a.forward.0"), _cnode("Module.b.forward.0")])
    apply_isolation(report, {"Functional.f.0.forward": {"status": "error", "standard": "ulp", "value": 2, "threshold": 1}},
                    cycle)
    assert [n.status for n in report.nodes] == ["error", "error", "error"]
    chain = {"Functional.f.0.forward": "Module.m0.forward.0"}
    chain.update({f"Module.m{i}.forward.0": f"Module.m{i + 1}.forward.0" for i in range(1001)})
    report = _report([_cnode("Functional.f.0.forward"), _cnode("Module.m999.forward.0"), _cnode("Module.m1000.forward.0")])
    apply_isolation(report, {"Functional.f.0.forward": {"status": "error", "standard": "ulp", "value": 2, "threshold": 1}},
                    chain)
    assert [n.status for n in report.nodes] == ["error", "error", "pass"]  # 1000 ancestors, not one more


def test_top_binade_allowance_reads_the_target_range_from_its_rows():
    from msprobe_ci.compare import compare_dumps
    from msprobe_ci.compare.isolated import apply_isolation

    f16max, f32max = 65504.0, 3.4028234663852886e38

    def dump(dt, clamp):
        return Dump(folder=".", task="statistics", level="L1", data={"Torch.clamp.0.forward": {
            "input_args": [_rec(1.0, dt), {"type": "float", "value": clamp}], "input_kwargs": {},
            "output": [_rec(1.0, dt)]}})

    rec = {"status": "pass", "standard": "ulp", "value": 0.1, "threshold": 1,
           "sources": {"Torch.clamp.0.forward.input.1": {"kind": "scalar", "id": "c"}}}
    for t_clamp, status in ((f16max - 1000, "pass"), (f16max / 4, "error")):
        report = compare_dumps(bench=dump("torch.float32", f32max - 1000), target=dump("torch.float16", t_clamp))
        apply_isolation(report, {"Torch.clamp.0.forward": rec})
        assert report.nodes[0].status == status, t_clamp
    scalars_only = Dump(folder=".", task="statistics", level="L1", data={"Torch.clamp.0.forward": {
        "input_args": [{"type": "float", "value": 2.0}], "input_kwargs": {}, "output": [{"type": "float",
                                                                                          "value": 2.0}]}})
    report = compare_dumps(bench=scalars_only, target=scalars_only)  # no tensor row: the range is unbounded
    apply_isolation(report, {"Torch.clamp.0.forward": dict(rec, sources={
        "Torch.clamp.0.forward.input.0": {"kind": "scalar", "id": "s"}})})
    assert report.nodes[0].status == "pass"


def test_source_rule_details():
    rec = dict(_ERR, status="pass", value=0.1)
    weight = "Functional.linear.0.forward.input.1"
    t, b = _pair(t_weight=2.0 * 1.02)
    # no kind given: a tensor; rows the bench lacks and ids already judged are passed over, the next one still judged
    sources = {"Functional.linear.0.forward.input.9": {"id": "missing"}, weight: {"id": "w"}}
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources=sources)})
    lin = nodes["Functional.linear.0.forward"]
    assert lin.status == "error" and f"its input {weight} (tensor, not computed" in lin.message
    assert lin.passing_threshold == lin.value and lin.value > 0.019
    seen_first = {"Functional.linear.0.forward.input.0": {"id": "x"}, "Functional.relu.0.forward.input.0": {"id": "x"},
                  weight: {"id": "w"}}
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources=seen_first)})
    assert nodes["Functional.linear.0.forward"].status == "error"
    # a shape that differs from the bench's is a difference whatever the values
    t, b = _pair()
    t.data["Functional.linear.0.forward"]["input_args"][1]["shape"] = [5]
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources={weight: {"id": "w"}})})
    lin = nodes["Functional.linear.0.forward"]
    assert lin.status == "error" and lin.message.endswith("differs from the bench: shape [5] vs bench [4]")
    # a tensor on one side and a scalar on the other is not compared as a source
    t, b = _pair()
    b.data["Functional.linear.0.forward"]["input_args"][1] = {"type": "float", "value": 2.0}
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources={weight: {"id": "w"}})})
    assert nodes["Functional.linear.0.forward"].status == "pass"
    # float64 sources: fp64's roundoff, and fp64 statistics' own accumulation allowance
    t, b = _pair(t_weight=2.0 * (1 + 1e-6))
    for d in (t, b):
        for r in d.data["Functional.linear.0.forward"]["input_args"]:
            r["dtype"] = "torch.float64"
    nodes, _ = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources={weight: {"id": "w"}})})
    lin = nodes["Functional.linear.0.forward"]
    assert lin.status == "error" and lin.threshold == pytest.approx(4 * 2.0 ** -53 + 1e-7 + 2.0 ** -53 * 2)


def test_isolation_roll_up_and_helper_edges():
    from types import SimpleNamespace

    from msprobe_ci.compare.isolated import _record_at, _same_call, _seconds, _site_twin, apply_isolation
    from msprobe_ci.compare.isolation_file import IsolationRecord

    err = {"status": "error", "standard": "ulp", "value": 2, "threshold": 1}
    construct = {"Functional.f.0.forward": "Module.m.forward.0", "Module.m.forward.0": "Module.top.forward.0",
                 "Functional.g.0.forward": "Module.n.forward.0", "Module.n.forward.0": "Module.ntop.forward.0",
                 "Functional.h.0.forward": "Module.iso.forward.0"}
    report = _report([_cnode("Functional.f.0.forward"), _cnode("Functional.g.0.forward"),
                      _cnode("Functional.h.0.forward"), _cnode("Module.m.forward.0"),
                      _cnode("Module.ntop.forward.0", "warning"), _cnode("Module.iso.forward.0")])
    apply_isolation(report, {"Functional.f.0.forward": err, "Functional.g.0.forward": dict(err, status="pass"),
                             "Functional.h.0.forward": err, "Module.m.forward.0": {"status": "skip"},
                             "Module.iso.forward.0": dict(err, standard="benchmark")}, construct)
    out = {n.name: n for n in report.nodes}
    assert out["Module.m.forward.0"].status == "error"  # a skipped module record: the roll-up still names the API
    assert out["Module.m.forward.0"].metrics["rollup"] == "Functional.f.0.forward"
    assert out["Module.ntop.forward.0"].message.startswith(
        "Module.ntop.forward.0: every isolated API inside passes")  # two levels up
    iso = out["Module.iso.forward.0"]  # failing on its own and holding a failing call: its own message stays
    assert iso.status == "error" and iso.message.startswith("Module.iso.forward.0: benchmark standard on its own")
    # sources: a failing source's node keeps its metrics and rolls up by name
    rec = dict(_ERR, status="pass", value=0.1)
    t, b = _pair(t_weight=2.0 * 1.02)
    nodes, drift = _isolated(t, b, {"Functional.linear.0.forward": dict(rec, sources={
        "Functional.linear.0.forward.input.1": {"kind": "tensor", "id": "w"}})})
    lin = nodes["Functional.linear.0.forward"]
    assert lin.metrics["isolated"] is True and lin.metrics["drift_status"] == drift[lin.name].status
    assert set(drift[lin.name].metrics) <= set(lin.metrics)
    assert nodes["Module.m.Block.forward.0"].metrics["rollup"] == "Functional.linear.0.forward"
    # seconds on a construct cycle: bounded
    secs = _seconds({"a": IsolationRecord("pass", seconds=1.0)}, {"a": "b", "b": "a"})
    assert set(secs) == {"a", "b"} and secs["a"] + secs["b"] == 10_000
    # the bench call of the same name where nothing pairs them
    here = _frames("m.py", 5, "f")
    assert _same_call("A.f.0.forward", SimpleNamespace(target_stack={"A.f.0.forward": here}, entry_pairs={}),
                      {"A.f.0.forward": here})
    stack = {"Torch.clamp.0.forward": here}
    assert _site_twin("Torch.clamp.0.forward", {}, {}, stack) is None  # no index entry on either side
    mine = {("Torch.clamp", "forward", "m.py:line 5:in f"): ["Torch.clamp.0.forward"]}
    assert _site_twin("Torch.clamp.0.forward", mine, {}, stack) is None
    assert _record_at({"input_args": [[{"type": "int", "value": 1}, {"type": "int", "value": 2}]]}, "0.2") is None


def test_twin_scalars_after_other_sources():
    """The twin's scalar is judged whatever sources come before it: tensors, other calls' rows, rows not dumped."""
    t, b = _pair(t_scalar=0.5, b_scalar=0.7)
    b.data["Torch.clamp.1.forward"] = dict(b.data["Torch.clamp.0.forward"],
                                           input_args=[_rec(3.0, "torch.float32"), {"type": "float", "value": 0.6}])
    t.stack = {"Torch.clamp.0.forward": _frames("m.py", 5, "f")}
    b.stack = {"Torch.clamp.0.forward": _frames("m.py", 9, "f"), "Torch.clamp.1.forward": _frames("m.py", 5, "f")}
    sources = {"Torch.clamp.0.forward.input.0": {"kind": "tensor", "id": "t"},
               "Functional.relu.0.forward.input.1": {"kind": "scalar", "id": "r"},
               "Torch.clamp.0.forward.input.7": {"kind": "scalar", "id": "gone"},
               "Torch.clamp.0.forward.input.1": {"kind": "scalar", "id": "s"}}
    rec = dict(_ERR, status="pass", value=0.1, sources=sources)
    nodes, _ = _isolated(t, b, {"Torch.clamp.0.forward": rec}, bench_stack=b.stack, bench_data=b.data)
    assert nodes["Torch.clamp.0.forward"].status == "error"
    assert "(Torch.clamp.1.forward): value 0.5 vs bench 0.6" in nodes["Torch.clamp.0.forward"].message


def test_check_options_merge_in_layers_with_the_old_atol_name_read_once():
    """Call > marker > run; ``atol`` set at a layer without a ``rel_floor`` of its own (unset or empty) sets
    ``rel_floor`` there (and so wins over the layers below), a ``rel_floor`` at the same layer wins over it; the
    merged options hold ``rel_floor`` alone, and the rule reads it (:func:`thresholds`)."""
    from msprobe_ci.check.settings import merge, thresholds

    run = {"rel_floor": "1e-6", "seed": 1234}
    assert merge([run, {}, {}]) == run
    assert merge([run, {"atol": 1e-3}, {}]) == {"rel_floor": 1e-3, "seed": 1234}
    assert merge([run, {"atol": 1e-3}, {"rel_floor": 1e-4}])["rel_floor"] == 1e-4
    assert merge([run, {"rel_floor": 1e-4}, {"atol": 1e-2}])["rel_floor"] == 1e-2
    assert merge([run, {"atol": 1e-3, "rel_floor": 1e-5}, {}])["rel_floor"] == 1e-5
    assert merge([run, {"atol": 1e-3, "rel_floor": ""}, {}])["rel_floor"] == 1e-3
    assert merge([run, {"atol": ""}, {}])["rel_floor"] == "1e-6"  # an empty old name sets nothing
    assert merge([{"atol": "1e-3", "seed": 1}, {}, {}]) == {"rel_floor": "1e-3", "seed": 1}  # the run's ini too
    assert merge([dict(run, atol="1e-3"), {}, {}])["rel_floor"] == "1e-6"  # both set at one layer: the new name
    assert merge([run, {"seed": 1}, {"seed": 2}])["seed"] == 2
    assert thresholds(merge([{"atol": "1e-3", "round_factor": "3"}])) == Thresholds(round_factor=3.0, rel_floor=1e-3)
    assert thresholds({}) == Thresholds()


@pytest.mark.parametrize("key, value, message", [
    ("isolate", "maybe", "option 'isolate': expected 'on' or 'off' (or a bool), got 'maybe'"),
    ("output_rtol", 0, "option 'output_rtol': expected a positive number, got 0"),
    ("output_rtol", "x", "option 'output_rtol': expected a positive number, got 'x'"),
    ("oracle_device", "gpu", "option 'oracle_device': expected 'cpu' or 'target', got 'gpu'"),
    ("bench", "tpu", "tpu"),
    ("isolate_budget", 1, "option 'isolate_budget': expected a number above 1 (the isolated step's time over the "
                          "capture alone), got 1"),
])
def test_check_settings_refuse_bad_options_with_one_line(key, value, message):
    from msprobe_ci.check.settings import CheckSettings, check_keys
    from msprobe_ci.errors import MsprobeError

    options = {"bench": "cpu", "target": "cpu", "bench_dtype": None, "target_dtype": "bf16", "level": "mix",
               "task": "statistics", "isolate": "on", "oracle_device": "target"}
    s = CheckSettings.resolve(options)
    assert (s.isolate, s.oracle_device, s.seed, s.output_rtol) == (True, "cpu", 1234, None)  # a CPU target's
    with pytest.raises(MsprobeError, match=re.escape(message)):
        CheckSettings.resolve(dict(options, **{key: value}, target="cuda" if key == "oracle_device" else "cpu"))
    with pytest.raises(MsprobeError, match=re.escape("where: unknown option(s) ['x']; allowed: [")):
        check_keys({"x": 1, "seed": 2}, "where")


def test_marker_help_lists_every_check_option(pytester):
    from msprobe_ci.check.settings import CHECK_OPTIONS

    result = pytester.runpytest("--markers")
    line = next(x for x in result.outlines if x.startswith("@pytest.mark.msprobe("))
    assert all(f" {o}," in line or f"({o}," in line or f" {o})" in line for o in CHECK_OPTIONS), line


def test_heap_policy_is_chosen_by_environment_with_one_line_for_a_bad_value():
    """``MSPROBE_CI_HEAP``: a positive byte count or ``keep``; anything else is refused with one line when a
    check's side starts (a subprocess: the choice is made once per process)."""
    import subprocess
    import sys

    code = ("from msprobe_ci._perf import bound_heap, _BOUNDED\n"
            "try:\n    bound_heap(); print('chose', _BOUNDED)\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    runs = {v: subprocess.run([sys.executable, "-c", code], env=dict(env, MSPROBE_CI_HEAP=v), capture_output=True,
                              text=True).stdout.strip() for v in ("", "keep", "4194304", "-1", "lots")}
    assert runs[""] == "chose [1048576]" and runs["4194304"] == "chose [4194304]" and runs["keep"] == "chose [None]"
    for bad in ("-1", "lots"):
        assert runs[bad] == (f"MsprobeError MSPROBE_CI_HEAP: expected 'keep' or a positive number of bytes, got "
                             f"{bad!r}")


def test_check_settings_carry_every_option_they_were_given(tmp_path):
    """Each field of CheckSettings comes from its own option (a wrong key or a dropped value shows here); the
    check's fault file wins over the run's faults; compile only where the mode honours it; the oracle's default
    is the target's device on CUDA, the CPU elsewhere; isolate's spellings."""
    from msprobe_ci.check.settings import CheckSettings, isolate_flag, oracle_choice, positive

    faults = tmp_path / "faults.yaml"
    faults.write_text("faults:\n  - {api: Functional.linear, perturb: scale, value: 1.02}\n")
    options = {"bench": "cpu", "target": "cpu", "bench_dtype": "fp64", "target_dtype": "bf16", "level": "L1",
               "task": "tensor", "inject": str(faults), "seed": 7, "fuzzy": True, "compile": True,
               "isolate": "off", "bench_kernel": "upcast", "oracle_device": None, "output_rtol": "0.5",
               "round_factor": "3", "propagation": 2, "error_factor": None, "rel_floor": None, "atol": None,
               "api_standards": {"lin*": "legacy"}, "api_thresholds": {"legacy": {"rtol": 0.1}},
               "free_benchmark": "to_cpu", "monitor": 1}
    s = CheckSettings.resolve(options, run_faults=("run",))
    assert (s.bench_device, s.target_device, s.bench_dtype, s.target_dtype) == ("cpu", "cpu", "fp64", "bf16")
    assert (str(s.bench.dtype), str(s.target.dtype), s.target.compile) == ("torch.float64", "torch.bfloat16", True)
    assert (s.level, s.task, s.inject, s.seed, s.fuzzy, s.isolate) == ("L1", "tensor", str(faults), 7, True, False)
    assert [f.api for f in s.faults] == ["Functional.linear"]
    assert (s.bench_kernel, s.oracle_device, s.output_rtol) == ("upcast", "cpu", 0.5)
    assert (s.thresholds.round_factor, s.thresholds.propagation) == (3.0, 2.0)
    assert s.api_standards == {"lin*": "legacy"} and s.api_thresholds == {"legacy": {"rtol": 0.1}}
    assert (s.free_benchmark, s.monitor) == ("to_cpu", True)
    assert s.cast_roundoff == unit_roundoff("bfloat16", "float64")
    bare = CheckSettings.resolve(dict(options, inject=None, seed=1234, fuzzy=None, compile=None, monitor=None),
                                 run_faults=("run",), compile_target=True)
    assert (bare.faults, bare.fuzzy, bare.target.compile, bare.monitor, bare.seed) == (("run",), False, False, False,
                                                                                       1234)
    assert CheckSettings.resolve(options, compile_target=False).target.compile is False
    assert [isolate_flag(v) for v in (True, "on", "true", "1", False, "off", "false", "0", None)] == [True] * 4 + \
        [False] * 5
    assert positive("0.25", "x") == 0.25

    class Kind:
        def __init__(self, kind):
            self.kind = kind

    assert [oracle_choice(None, Kind(k)) for k in ("cuda", "npu", "cpu")] == ["target", "cpu", "cpu"]
    assert [oracle_choice(c, Kind("npu")) for c in ("cpu", "target")] == ["cpu", "target"]
    assert oracle_choice("target", Kind("cpu")) == "cpu"


def test_default_bench_kernel_follows_the_bench_device_or_the_cpu_where_it_is_absent():
    """No bench_kernel option: the bench device's kernels (``device``), but ``upcast`` where the target is a
    stand-in accelerator on the bench's own device; an absent bench device counts as the CPU."""
    from msprobe_ci.check.settings import available, bench_kernel

    class Side:
        def __init__(self, torch_device, device=None, here=True):
            self.torch_device, self.device, self.here = torch_device, device or torch_device, here

        def check_available(self):
            if not self.here:
                raise MsprobeError(f"no {self.device} device")

    stand_in_npu = Side("cpu", "npu")
    assert available(Side("cpu")) and not available(Side("cuda:0", here=False))
    assert bench_kernel(None, Side("cpu"), stand_in_npu) == "upcast"
    assert bench_kernel(None, Side("cuda:0", here=False), stand_in_npu) == "upcast"  # absent: the CPU runs it
    assert bench_kernel(None, Side("cuda:0"), stand_in_npu) == "device"
    assert bench_kernel(None, Side("cpu"), Side("cpu")) == "device"
    assert bench_kernel("rounded", Side("cpu"), stand_in_npu) == "rounded"


def test_check_settings_build_the_target_sides_isolator_from_the_check():
    """The Isolator gets the check's standards, thresholds, bench kernel and direction, the target's device (the
    one given, else the check's), the bench's device or the CPU where it is absent, and the oracle where
    ``oracle_device`` says; none with isolation off."""
    import dataclasses

    import torch

    from msprobe_ci.backends import Backend
    from msprobe_ci.check.settings import CheckSettings

    o = {"bench": "cuda", "target": "cpu", "bench_dtype": None, "target_dtype": "bf16", "level": "mix",
         "task": "statistics", "isolate": "on", "api_standards": {"lin*": "legacy"},
         "api_thresholds": {"legacy": {"rtol": 0.1}}, "bench_kernel": "rounded"}
    s = CheckSettings.resolve(o)
    iso = s.isolator(backward=False)
    assert (iso.standards, iso.thresholds) == ({"lin*": "legacy"}, {"legacy": {"rtol": 0.1}})
    assert (iso.target_device, iso.bench_device, iso.backward, iso.bench_kernel) == ("cpu", "cpu", False, "rounded")
    assert (iso.oracle_device, iso.oracle_max) == ("cpu", torch.float64)
    assert s.isolator(backward=True).backward is True
    on_gpu = CheckSettings.resolve(dict(o, bench="cpu", target="cuda", oracle_device="target"))
    iso = on_gpu.isolator(True)
    assert (iso.target_device, iso.bench_device, iso.oracle_device, iso.oracle_label) == ("cuda", "cpu", "cuda", "cuda")
    iso = s.isolator(True, Backend.from_options("cuda", "bf16"))  # a rank's own target: its device, the check's oracle
    assert (iso.target_device, iso.oracle_device) == ("cuda", "cpu")
    assert CheckSettings.resolve(dict(o, isolate="off")).isolator(True) is None

    class HereBench:  # a bench device that is on this machine and is not the CPU
        torch_device = "meta"
        dtype = None  # the model's own (a check's settings read it for the cast allowance)

        def check_available(self):
            return None

    assert dataclasses.replace(s, bench=HereBench()).isolator(True).bench_device == "meta"


def test_a_side_spills_its_final_outputs_until_the_judgement_reads_them(tmp_path, monkeypatch):
    """``run_side(spill_outputs=True)`` writes final outputs of ``SPILL_BYTES`` or more to a file after the forward
    pass (nothing held through the backward), ``final_outputs()`` reads them back once and removes the file;
    smaller outputs stay in memory; reading them records no API call in the dump."""
    import json

    import torch

    from msprobe_ci.backends import Backend
    from msprobe_ci.check import sides
    from msprobe_ci.config import DumpConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    want = model(x).detach()

    def side(name: str):
        cfg = DumpConfig(task="statistics", level="mix").with_overrides(dump_path=str(tmp_path / name))
        return sides.run_side(model, (x,), lambda out: out.square().sum(), Backend.from_options("cpu", "fp32"), cfg,
                              spill_outputs=True)

    total = want.numel() * 4 + 4  # the output and the float32 loss
    monkeypatch.setattr(sides, "SPILL_BYTES", total)  # "SPILL_BYTES or more"
    spilled = side("spilled")
    assert spilled.outputs == [] and os.path.dirname(spilled.spilled) == str(tmp_path / "spilled")
    name = os.path.basename(spilled.spilled)
    assert name.startswith("model-outputs-") and name.endswith(".pt")
    got = dict(spilled.final_outputs())
    assert not os.path.exists(spilled.spilled) and spilled.final_outputs() == []
    torch.testing.assert_close(got["output"], want, rtol=0, atol=0)
    torch.testing.assert_close(got["loss"], want.square().sum(), rtol=0, atol=0)
    monkeypatch.setattr(sides, "SPILL_BYTES", total + 1)
    kept = side("kept")
    assert kept.spilled is None and [k for k, _ in kept.final_outputs()] == ["output", "loss"]

    def calls(run):
        with open(os.path.join(run.folder, "dump.json"), encoding="utf-8") as fh:
            return sorted(json.load(fh)["data"])
    assert calls(spilled) == calls(kept) and not any("detach" in k or ".float." in k for k in calls(kept))


class _Payload:
    """Unpickled, it creates the file ``path`` (what a pickle may run when it is loaded without ``weights_only``)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_spilled_outputs_file_is_read_as_tensors_only(tmp_path):
    """A spilled outputs file is loaded with ``weights_only=True``: a file holding anything else (here a call of
    ``open``) is refused with one line naming the file and the loader's first line, never run."""
    import torch

    from msprobe_ci.check.outcome import SideRun
    from msprobe_ci.errors import MsprobeError

    good = tmp_path / "model-outputs-good.pt"
    torch.save([("output", torch.ones(2))], good)
    assert [k for k, _ in SideRun("x", spilled=str(good)).final_outputs()] == ["output"]
    bad, ran = tmp_path / "model-outputs-bad.pt", tmp_path / "ran"
    torch.save([("output", _Payload(str(ran)))], bad)
    with pytest.raises(Exception) as loader:
        torch.load(bad, weights_only=True)
    with pytest.raises(MsprobeError) as info:
        SideRun("x", spilled=str(bad)).final_outputs()
    first = str(loader.value).splitlines()[0]
    assert str(info.value) == (f"{bad}: expected the side's final outputs as (name, tensor) pairs of tensors only "
                               f"({type(loader.value).__name__}: {first})")
    assert not ran.exists() and "\n" not in str(info.value) and bad.exists()


def test_one_status_vocabulary():
    """One vocabulary for a standard's result, a compare node and a check (msprobe_ci.status), and one way to
    combine statuses: the worst judged one; skip only when nothing was judged; unmatched weighs as a pass."""
    from msprobe_ci import status
    from msprobe_ci.checkers import CheckResult, result, worst
    from msprobe_ci.compare import verdict

    assert result.STATUSES is verdict.STATUSES is status.STATUSES
    assert status.STATUSES == ("pass", "warning", "error", "skip", "unmatched")
    cases = [([], "skip"), (["skip"], "skip"), (["pass", "skip"], "pass"), (["skip", "warning", "pass"], "warning"),
             (["pass", "error", "warning"], "error"), (["warning", "error"], "error"), (["unmatched", "pass"], "pass"),
             (["unmatched", "warning"], "warning"), (["unmatched"], "pass")]
    assert [status.worst(s) for s, _ in cases] == [want for _, want in cases]
    assert worst([CheckResult("binary", s) for s in ("pass", "skip", "warning")]) == "warning"


def test_every_option_is_declared_once_and_reaches_the_check(pytester):
    """The plugin's option table names the check option each row sets; the session reads every row in one loop,
    the fixture passes those on as the run's layer, and the judge takes every field it shares with the check's
    settings: a new option is a table row plus its settings field, and a row wired nowhere fails here. Command
    line over ini, marker over both, ``atol`` (ini) read as ``rel_floor``."""
    from msprobe_ci.check.settings import CHECK_OPTIONS
    from msprobe_ci.pytest_plugin.options import FLAGS, OPTIONS, RULE_INI

    by_run = {o.check for o in OPTIONS + FLAGS if o.check} | {k for k, _ in RULE_INI} | \
        {"free_benchmark", "api_standards", "api_thresholds"}
    assert by_run <= set(CHECK_OPTIONS)
    assert set(CHECK_OPTIONS) - by_run == {"inject", "seed", "fuzzy"}  # a check's own: its call and marker only
    pytester.makeini("[pytest]\nmsprobe_level = L1\nmsprobe_task = tensor\nmsprobe_bench_kernel = upcast\n"
                     "msprobe_isolate = off\nmsprobe_isolate_budget = 1.5\nmsprobe_target_dtype = bf16\n"
                     "msprobe_target_autocast = fp16\nmsprobe_monitor = true\nmsprobe_atol = 0.5\n"
                     "msprobe_round_factor = 3\nmsprobe_free_benchmark = to_cpu\n"
                     "msprobe_api_standards =\n    lin* = legacy\n")
    pytester.makepyfile(
        "import math, pytest\n"
        "def test_run(msprobe):\n"
        "    s = msprobe._settings({}, 't')\n"
        "    assert (s.level, s.task, s.bench_kernel, s.isolate, s.isolate_budget) == ('mix', 'tensor', 'upcast', "
        "False, 1.5)\n"
        "    assert (s.bench_device, s.target_dtype, s.target_autocast, s.monitor) == ('cpu', 'bf16', 'fp16', True)\n"
        "    assert (s.free_benchmark, s.api_standards) == ('to_cpu', {'lin*': 'legacy'})\n"
        "    assert (s.thresholds.rel_floor, s.thresholds.round_factor, s.thresholds.propagation) == (0.5, 3.0, 1.0)\n"
        "    j = s.judge\n"
        "    assert (j.thresholds, j.isolate, j.isolate_budget, j.bench_kernel, j.level) == (s.thresholds, False, 1.5,"
        " 'upcast', 'mix')\n"
        "    assert j.api_standards == s.api_standards and j.api_standards is not s.api_standards\n"
        "    assert j.cast_roundoff == s.cast_roundoff > 0 and j.source_factor == 4.0\n"
        "@pytest.mark.msprobe(rel_floor=0.25, level='L0')\n"
        "def test_marker(msprobe):\n"
        "    s = msprobe._settings({'round_factor': 5}, 't')\n"
        "    assert (s.thresholds.rel_floor, s.thresholds.round_factor, s.level) == (0.25, 5.0, 'L0')\n")
    pytester.runpytest("-p", "no:cacheprovider", "--msprobe-level=mix").assert_outcomes(passed=2)
    pytester.makeini("[pytest]\nmsprobe_atol = x\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert "msprobe: threshold 'rel_floor': expected a number, got 'x'" in result.stderr.str()


def test_junit_states_a_budgeted_isolations_judged_share_on_its_suite(tmp_path):
    """A check whose isolation ran under a budget says on its suite how many calls were judged on their own inputs,
    the factor asked and the one measured; a check without a budget says nothing of it."""
    budget = {"judged": 120, "calls": 480, "factor": 2.0, "measured_factor": 1.87}
    root, _ = _junit(tmp_path, [_check(index=0, isolation_budget=budget), _check(index=1)])
    props = {s.get("name"): {p.get("name"): p.get("value") for p in s.find("properties")} for s in root.iter("testsuite")}
    with_budget, without = props["tests.test_m.test_x[1_5] check 0"], props["tests.test_m.test_x[1_5] check 1"]
    assert {k: v for k, v in with_budget.items() if "isolat" in k} == {
        "msprobe.isolated_calls": "120/480", "msprobe.isolation_budget": "2.0", "msprobe.isolation_cost": "1.87"}
    assert not [k for k in without if "isolat" in k]
