"""The rule modules pinned line by line: each test fails when one comparison, factor or word of the rule changes
(``python tools/mutation.py`` runs mutmut over these modules and counts what the suite notices).

Numbers come from the rules' docstrings: the node rule (``compare/verdict.py``), msprobe's overflow levels
(``overflow.py``, compare-overflow-visualization spec §2.1).
"""

import math

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
    # atol is rel_floor's old name; an explicit rel_floor wins, an empty one does not
    assert Thresholds.from_mapping({"atol": 1e-3}).rel_floor == 1e-3
    assert Thresholds.from_mapping({"atol": 1e-3, "rel_floor": ""}).rel_floor == 1e-3
    assert Thresholds.from_mapping({"atol": 1e-3, "rel_floor": 2e-3}).rel_floor == 2e-3
    assert Thresholds.from_mapping({"statistics_slack": 2}).statistics_slack == 2.0
    with pytest.raises(MsprobeError, match=r"^thresholds: unknown key\(s\) \['a', 'b'\]; allowed: round_factor, "
                                           r"propagation, error_factor, rel_floor \(old name: atol\)$"):
        Thresholds.from_mapping({"b": 1, "a": 2, "round_factor": 1})
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
