"""The per-API standards (``checkers/``) pinned number by number: each threshold, comparison and message of
msprobe's standards as this project implements them (``python tools/mutation.py --modules checkers`` counts what
these tests notice). Sources of the numbers: ``checkers/data/thresholds.yaml``."""

import math

import numpy as np
import pytest
import torch

from msprobe_ci import MsprobeError
from msprobe_ci.checkers import STANDARDS, CheckResult, dtype_key, make_standard, standard_for, worst
from msprobe_ci.checkers.common import dtype_thresholds, finite_masks, load_yaml, share, to_f64

NAN, INF = math.nan, math.inf


def _t(*v, dtype=torch.float64):
    return torch.tensor(v, dtype=dtype)


# ------------------------------------------------------------------------------------------------ result, common
def test_check_result_and_worst():
    r = CheckResult("ulp", "warning", {"a": 1.0}, {"a": 2.0}, {"a": 1.0}, "m")
    assert r.passed and CheckResult("x", "pass").passed
    assert not CheckResult("x", "error").passed and not CheckResult("x", "skip").passed
    e = r.with_status("error", "now bad")
    assert (e.standard, e.status, e.metrics, e.thresholds, e.passing, e.message) == \
        ("ulp", "error", {"a": 1.0}, {"a": 2.0}, {"a": 1.0}, "now bad")
    assert r.as_dict() == {"standard": "ulp", "status": "warning", "metrics": {"a": 1.0}, "thresholds": {"a": 2.0},
                           "passing": {"a": 1.0}, "message": "m"}
    assert CheckResult("x", "pass").metrics == {} and CheckResult("x", "pass").message == ""
    s = {k: CheckResult("x", k) for k in ("pass", "warning", "error", "skip")}
    assert worst([s["pass"], s["warning"], s["skip"]]) == "warning"
    assert worst([s["warning"], s["error"]]) == "error" and worst([s["error"], s["warning"]]) == "error"
    assert worst([s["pass"], s["skip"]]) == "pass" and worst([s["skip"]]) == "skip" and worst([]) == "skip"


def test_common_pieces():
    assert [dtype_key(d) for d in (torch.float16, "torch.bfloat16", torch.float32, torch.float64, torch.int8,
                                   torch.bool, torch.complex64)] == ["fp16", "bf16", "fp32", "fp64", "int", "bool",
                                                                     "complex"]
    th = dtype_thresholds("bf16", {"rtol": "0.5"})
    assert th["rtol"] == 0.5 and th["small_value"] == 2.0 ** -10 and isinstance(th["rtol"], float)
    assert dtype_thresholds("int") == dtype_thresholds("fp32") and dtype_thresholds("fp16")["rtol"] == 2.0 ** -10
    with pytest.raises(MsprobeError, match=r"^threshold override 'nope': unknown; known: \['accumulative_bound', "):
        dtype_thresholds("fp32", {"nope": 1})
    assert load_yaml("thresholds.yaml") is load_yaml("thresholds.yaml")  # read once
    a = to_f64(torch.tensor([1.5, 2.0], dtype=torch.bfloat16))
    assert a.dtype == np.float64 and a.tolist() == [1.5, 2.0]
    assert to_f64(torch.tensor([True, False])).tolist() == [1.0, 0.0]
    assert to_f64(torch.tensor([3], dtype=torch.int64)).dtype == np.float64
    c = to_f64(torch.tensor([1 + 2j], dtype=torch.complex64).conj())
    assert c.dtype == np.complex128 and c.tolist() == [1 - 2j]
    assert to_f64([1, 2]).dtype == np.float64 and to_f64(3).shape == ()
    g = torch.ones(2, requires_grad=True) * 2
    assert to_f64(g).tolist() == [2.0, 2.0]
    finite, small, normal, mag = finite_masks(_t(1.0, INF, 1e-9, 5.0, -INF, 0.0), _t(1.0, 1.0, -1e-9, NAN, 2.0, -INF),
                                              1e-6)
    assert finite.tolist() == [True, False, True, False, False, False]
    assert small.tolist() == [False, False, True, False, False, False]
    assert normal.tolist() == [True, False, False, False, False, False]
    torch.testing.assert_close(mag, _t(1.0, 1.0, 1e-9, NAN, 2.0, INF), rtol=0, atol=0, equal_nan=True)
    edge = finite_masks(_t(1e-6), _t(-1e-6), 1e-6)[1]
    assert edge.tolist() == [True]  # |bench| <= small_value is small
    assert share(1, 2) == 0.5  # one of two masked elements
    assert share(0, 0) == 0.0  # an empty mask


def test_registry_and_constructors():
    assert set(STANDARDS) == {"absolute_threshold", "accumulative", "benchmark", "binary", "dropout", "legacy",
                              "quantization", "thousandth", "ulp"}
    assert all(cls.name == name for name, cls in STANDARDS.items())
    assert standard_for("argmax", torch.bool) == "binary" and standard_for("linear", "torch.int32") == "binary"
    assert standard_for("linear", torch.int32, {"lin*": "ulp"}) == "ulp"  # an override wins over the dtype rule
    assert standard_for("conv1d", torch.float64) == "thousandth" and standard_for("conv1d", torch.float16) == \
        "benchmark"
    assert standard_for("sum", torch.float32) == "accumulative" and standard_for("add", torch.float32) == \
        "absolute_threshold"
    assert standard_for("linear", torch.float32, {"x*": "legacy", "l*": "binary", "li*": "ulp"}) == "binary"
    with pytest.raises(MsprobeError, match=r"^standard override 'x\*': 'nope' unknown; known: \['absolute_threshold'"):
        standard_for("linear", torch.float32, {"x*": "nope"})
    b = make_standard("benchmark", torch.bfloat16, "softmax")
    assert (b.level, b.min_err) == (load_benchmark_level("softmax"), 2.0 ** -8)
    assert make_standard("ulp", torch.float16).bits == 10
    assert make_standard("absolute_threshold", torch.float32, rtol=0.5).rtol == 0.5


def load_benchmark_level(api):
    for lv, names in load_yaml("thresholds.yaml")["benchmark"]["apis"].items():
        if api in names:
            return lv
    return "L0"


# ---------------------------------------------------------------------------------------------- binary, dropout
def test_binary():
    std = make_standard("binary", torch.int64)
    ok = std(_t(1, NAN, 3), _t(1, NAN, 3))
    assert (ok.status, ok.metrics, ok.thresholds, ok.passing, ok.message) == \
        ("pass", {"mismatch_rate": 0.0}, {"mismatch_rate": 0.0}, {"mismatch_rate": 0.0}, "bit-exact")
    bad = std(_t(1, 2, 3, 4), _t(1, NAN, 3, 5))
    assert (bad.status, bad.metrics["mismatch_rate"], bad.message) == ("error", 0.5, "2 of 4 elements differ")
    assert bad.passing == {"mismatch_rate": 0.5} and bad.standard == "binary"
    assert std(_t(), _t()).status == "pass" and std(_t(), _t()).metrics["mismatch_rate"] == 0.0
    loose = make_standard("binary", torch.int64, max_mismatch_rate=0.5)
    assert loose(_t(1, 2, 3, 4), _t(1, 2, 0, 0)).status == "pass"  # <= the rate passes
    assert loose(_t(1, 2, 3, 4), _t(1, 0, 0, 0)).status == "error"


def test_dropout():
    std = make_standard("dropout", torch.float32, p=0.3)
    x = torch.ones(10000)
    x[:3000] = 0
    r = std(x)
    assert (r.status, r.metrics, r.passing) == ("pass", {"zero_share": 0.3}, {"tolerance": 0.0})
    tol = 5 * math.sqrt(0.3 * 0.7 / 10000)
    assert r.thresholds == {"p": 0.3, "tolerance": pytest.approx(tol)}
    assert r.message == f"zero share 0.3000 vs p=0.3 (tolerance {tol:.4f})"
    edge = int(round((0.3 + tol) * 10000))  # at the tolerance (plus the one-element slack): passes
    x = torch.ones(10000)
    x[:edge] = 0
    assert std(x).status == "pass"
    x[:edge + 2] = 0
    far = std(x)
    assert far.status == "error" and far.passing["tolerance"] == pytest.approx((edge + 2) / 10000 - 0.3)
    x = torch.ones(10000)
    x[:int(round((0.3 - tol) * 10000)) - 2] = 0
    assert std(x).status == "error"  # too few dropped, as much as too many
    few = std(torch.ones(99))
    assert (few.status, few.message, few.passing) == ("pass", "99 elements: too few to judge", {})
    assert few.metrics == {"zero_share": 0.0} and few.thresholds["p"] == 0.3
    assert make_standard("dropout", torch.float32)(torch.ones(0)).thresholds["tolerance"] == 1.0
    default = make_standard("dropout", torch.float32)
    assert (default.p, default.sigmas, default.min_numel) == (0.5, 5.0, 100)
    assert make_standard("dropout", torch.float32, sigmas=1, min_numel=10).min_numel == 10
    assert make_standard("dropout", torch.float32)(torch.ones(100)).status == "error"  # 100 elements are judged


def test_dropout_reads_no_draw_where_its_input_was_inf_or_nan():
    """``NaN * 0`` and ``inf * 0`` are NaN: where the input was not finite the mask cannot be read. A pure fp16
    MobileNetV2 whose first step overflowed trained its weights to NaN, and its classifier dropout (p=0.8) read a
    zero share of 0 and failed as a wrong dropout; those elements are no draws (the share is read off the finite
    rest, and a dropout at the wrong p among them still fails), and with none finite there is nothing to judge."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=g)
    x[:20] = float("nan")
    x[20:24] = float("inf")
    std = make_standard("dropout", torch.float32, p=0.8)
    torch.manual_seed(0)
    y = F.dropout(x, 0.8, training=True)
    r = std(y, source=x)
    assert r.status == "pass" and "over 10240 draws" in r.message and "6144 inf/nan elements" in r.message, r.message
    assert std(y).status == "pass"  # without the input: read off the output alone
    wrong = F.dropout(x, 0.5, training=True)
    assert std(wrong, source=x).status == "error"
    blank = std(torch.full((2, 1280), float("nan")), source=torch.full((2, 1280), float("nan")))
    assert blank.status == "pass" and "too few to judge" in blank.message, blank.message
    chan = make_standard("dropout", torch.float32, p=0.5)(F.dropout2d(x.reshape(8, 32, 8, 8), 0.5),
                                                          source=x.reshape(8, 32, 8, 8), block=64)
    assert chan.status == "pass" and "inf/nan blocks" in chan.message, chan.message


def test_dropout_counts_the_draws_the_mask_made():
    """An input element that is zero is zero whatever the mask (MobileNetV2's classifier dropout, p=0.8 after
    ReLU6 and pooling, showed a zero share of 0.90 and failed a benign run); a channel dropout draws once per
    channel."""
    import torch.nn.functional as F

    from msprobe_ci.judge.support import dropout_block

    g = torch.Generator().manual_seed(3)
    x = F.relu(torch.randn(64, 256, generator=g))  # about half the elements are zero before dropout
    keep = torch.rand(x.shape, generator=g) >= 0.8
    y = torch.where(keep, x / 0.2, torch.zeros_like(x))
    std = make_standard("dropout", torch.float32, p=0.8)
    assert std(y).status == "error"  # every zero counted as dropped: 0.9 against 0.8
    r = std(y, source=x)
    live = int((x != 0).sum())
    assert r.status == "pass" and r.metrics["zero_share"] == pytest.approx(float((~keep & (x != 0)).sum()) / live)
    assert r.thresholds["tolerance"] == pytest.approx(5 * math.sqrt(0.8 * 0.2 / live))
    assert f"over {live} draws vs p=0.8" in r.message
    wrong = torch.where(torch.rand(x.shape, generator=g) >= 0.5, x * 2, torch.zeros_like(x))
    assert std(wrong, source=x).status == "error"  # a dropout at p=0.5 where 0.8 was asked
    # dropout2d: one draw per channel (8 x 16 of 6 x 6), judged against p with that many draws
    x2 = torch.randn(8, 16, 6, 6, generator=g)
    assert dropout_block("dropout2d", x2.shape) == 36 and dropout_block("dropout", x2.shape) == 1
    assert dropout_block("dropout1d", (4, 5)) == 5 and dropout_block("dropout3d", (2, 3, 4, 5, 6)) == 120
    chan = torch.rand(8, 16, 1, 1, generator=g) >= 0.5
    y2 = torch.where(chan, x2 * 2, torch.zeros_like(x2))
    half = make_standard("dropout", torch.float32, p=0.5)
    r2 = half(y2, source=x2, block=36)
    assert r2.metrics["zero_share"] == pytest.approx(float((~chan).sum()) / 128) and r2.status == "pass"
    assert r2.thresholds["tolerance"] == pytest.approx(5 * math.sqrt(0.25 / 128))
    assert half(y2, source=x2, block=7).thresholds["tolerance"] == pytest.approx(5 * math.sqrt(0.25 / 4608))
    few = half(torch.zeros(200), source=torch.cat([torch.ones(1), torch.zeros(199)]))
    assert (few.status, few.message) == ("pass", "200 elements, 1 draws: too few to judge")
    # the judge's entry, as isolation and the offline replay call it
    from msprobe_ci.judge import judge_dropout

    assert judge_dropout("dropout", y, x, 0.8).message == r.message
    assert judge_dropout("dropout2d", y2, x2, 0.5).message == r2.message
    assert judge_dropout("dropout", y, x[:, :8], 0.8).status == "error"  # a source of another shape: not used
    assert judge_dropout("dropout", y, x, 0.8, {"dropout": {"sigmas": 0.01}}).status == "error"  # overrides apply


# ------------------------------------------------------------------------------------------------- thousandth
def test_thousandth():
    std = make_standard("thousandth", torch.float32)
    ref = torch.ones(1000, dtype=torch.float64)
    t = ref.clone()
    t[0] = 1.002  # one element in a thousand beyond 0.1%: 99.9% within, passes
    r = std(t, None, ref)
    assert (r.status, r.metrics["rel_err_thousandth"], r.thresholds) == \
        ("pass", 0.999, {"rel_tol": 0.001, "min_ratio": 0.999})
    assert r.message == "99.9000% of elements within 0.001 relative error" and r.standard == "thousandth"
    t[1] = 1.002
    assert std(t, None, ref).status == "error"
    t = ref * (1 + 0.001)
    assert std(t, None, ref).status == "pass"  # exactly 0.1% is within
    t = ref.clone()
    t[:2] = NAN
    assert std(t, None, torch.where(torch.arange(1000) < 2, NAN, ref)).status == "pass"  # NaN at NaN is no error
    q = std(ref * 1.01, ref).passing["rel_tol"]
    assert q == pytest.approx(0.01 / (1 + np.finfo(np.float32).eps))  # relative to |ref| + fp32 eps
    assert std(ref, ref).metrics["rel_err_thousandth"] == 1.0  # the bench stands in for a missing oracle
    assert std(_t(), _t()).metrics["rel_err_thousandth"] == 1.0
    assert std(_t(INF), _t(1.0)).passing["rel_tol"] == INF
    custom = make_standard("thousandth", torch.float32, rel_tol=0.1, min_ratio=0.5)
    assert custom(_t(1.0, 2.0), _t(1.0, 1.0)).status == "pass" and custom.tol == 0.1


# ------------------------------------------------------------------------------------------------------ legacy
def test_legacy_chain():
    std = make_standard("legacy", torch.float32)
    b = torch.linspace(10, 20, 10000, dtype=torch.float64)
    r = std(b, b)
    assert (r.status, r.metrics["cosine"], r.metrics["max_abs_err"]) == ("pass", pytest.approx(1.0), 0.0)
    assert r.message == "max abs error 0 < 0.001" and r.passing == {"max_abs_pass": 0.0}
    assert r.thresholds == {"cosine_min": 0.99, "max_abs_pass": 0.001}
    flip = std(-b, b)
    assert (flip.status, flip.metrics["cosine"]) == ("error", pytest.approx(-1.0))
    assert flip.passing == {"cosine_min": flip.metrics["cosine"]}
    assert flip.message == "cosine -1.000000" and "max_abs_err" not in flip.metrics
    edge = make_standard("legacy", torch.float32, cosine_min=flip.metrics["cosine"])
    assert edge(-b, b).status == "error"  # cosine <= cosine_min is an error
    # fp32: dual thousandth decides (error), dual ten-thousandth (warning)
    t = b.clone()
    t[:11] *= 1.002  # 0.11% of elements beyond 0.1%
    r = std(t, b)
    assert (r.status, r.metrics["dual_thousandth"]) == ("error", pytest.approx(0.9989))
    assert r.thresholds == {"cosine_min": 0.99, "max_abs_pass": 0.001, "dual_thousandth": 0.999,
                            "dual_ten_thousandth": 0.9999}
    assert r.passing == {"dual_thousandth": pytest.approx(0.9989), "dual_ten_thousandth": pytest.approx(0.9989)}
    assert r.message == "error by msprobe's ratio chain: dual_thousandth 0.9989, dual_ten_thousandth 0.9989"
    t = b.clone()
    t[:10] *= 1.002  # exactly 0.1% beyond: error (needs more than 99.9%)
    assert std(t, b).status == "error"
    t = b.clone()
    t[:9] *= 1.0005  # beyond 0.01% only: warning
    assert std(t, b).status == "warning"
    t = b.clone()
    t[:1] *= 1.0005
    assert std(t, b).status == "warning"  # 99.99% within 0.01% is not more than 99.99%
    t = b.clone()
    t[:1] *= 1.01
    assert std(t, b).status == "warning"
    t = b * (1 + 0.9e-4)
    assert std(t, b).status == "pass"


def test_legacy_half_precision_and_edges():
    std = make_standard("legacy", torch.bfloat16)
    b = torch.linspace(10, 20, 1000, dtype=torch.float64)
    t = b.clone()
    t[:11] *= 1.02  # 1.1% of elements beyond 1%: error
    r = std(t, b)
    assert r.status == "error" and r.metrics["dual_hundredth"] == pytest.approx(0.989)
    assert r.thresholds["dual_hundredth"] == 0.99 and r.thresholds["dual_thousandth"] == 0.999
    t = b.clone()
    t[:10] *= 1.02
    assert std(t, b).status == "error"  # 99% is not more than 99%
    t = b.clone()
    t[:9] *= 1.02
    assert std(t, b).status == "warning"
    t = b.clone()
    t[:1] *= 1.002
    assert std(t, b).status == "warning"  # 99.9% within 0.1% is not more than 99.9%
    t = b * (1 + 0.0009)
    assert std(t, b).status == "pass"
    fp16 = make_standard("legacy", torch.float16)
    assert fp16(b * 1.005, b).status == "warning"  # fp16 takes the half-precision chain
    tiny = torch.tensor([1e-20, 2e-20], dtype=torch.float64)
    assert std(tiny, tiny).metrics["cosine"] == 1.0  # both below eps: equal
    assert std(torch.zeros(2, dtype=torch.float64), tiny * 1e10).metrics["cosine"] == 0.0
    assert std(tiny * 1e10, torch.zeros(2, dtype=torch.float64)).metrics["cosine"] == 0.0
    one = std(_t(5.0), _t(1.0))
    assert "cosine" not in one.metrics and one.metrics["max_abs_err"] == 4.0 and one.status == "error"
    empty = std(_t(), _t())
    assert empty.status == "pass" and empty.metrics == {"max_abs_err": 0.0}
    nan = std(_t(NAN, 1.0), _t(1.0, 1.0))
    assert nan.status == "pass" and math.isnan(nan.metrics["cosine"])  # NaN cosine passes, as msprobe
    custom = make_standard("legacy", torch.float32, cosine_min=0.5, max_abs_pass=10)
    assert custom(_t(1.0, 2.0), _t(2.0, 1.0)).status == "pass"  # cosine 0.8 > 0.5, max abs 1 < 10


# --------------------------------------------------------------------------------------------------------- ulp
def test_ulp_half_precision():
    std = make_standard("ulp", torch.bfloat16)
    assert (std.min_exp, std.bits, std.large, std.max_ratio, std.max_mean) == (-126, 7, 1, 0.001, None)
    ref = torch.full((1000,), 1.5, dtype=torch.float64)  # exponent 0: one bf16 ULP is 2^-7
    r = std(ref + 2.0 ** -7, None, ref)
    assert (r.metrics["max_ulp"], r.metrics["mean_ulp"], r.metrics["large_ulp_ratio"]) == (1.0, 1.0, 0.0)
    assert r.status == "pass" and r.thresholds == {"large_ulp_ratio": 0.001, "ulp_large": 1}
    assert r.passing == {"large_ulp_ratio": 0.0, "mean_ulp": 1.0} and r.metrics["inf_nan_mismatches"] == 0.0
    assert r.message == "mean ULP 1, 0.000% above 1 ULP" and r.standard == "ulp"
    t = ref.clone()
    t[0] += 2 * 2.0 ** -7  # one element of 1000 above 1 ULP: 0.1% is not under 0.1%
    bad = std(t, None, ref)
    assert bad.status == "error" and bad.metrics["large_ulp_ratio"] == 0.001 and bad.metrics["max_ulp"] == 2.0
    t = torch.cat([ref, ref])
    t[0] += 2 * 2.0 ** -7
    assert std(t, None, torch.cat([ref, ref])).status == "pass"  # 1 in 2000
    neg = torch.full((4,), -3.0, dtype=torch.float64)  # exponent 1: one ULP is 2^-6
    assert std(neg + 2.0 ** -6, None, neg).metrics["max_ulp"] == 1.0
    small = torch.full((4,), 2.0 ** -130, dtype=torch.float64)  # below 2^-126: ULP at the minimum exponent
    assert std(small * 2, None, small).metrics["max_ulp"] == pytest.approx(2.0 ** -130 / 2.0 ** -133)
    zero = torch.zeros(4, dtype=torch.float64)  # an exact zero is measured at exponent 0
    assert std(zero + 2.0 ** -7, None, zero).metrics["max_ulp"] == 1.0
    assert std(ref, ref).metrics["max_ulp"] == 0.0  # the bench stands in for a missing oracle


def test_ulp_fp32_mean_rule_inf_nan_and_floor():
    std = make_standard("ulp", torch.float32)
    ref = torch.full((100,), 1.0, dtype=torch.float64)
    u = 2.0 ** -23
    t = ref + 40 * u  # every element 40 ULP: above 32 everywhere, but mean 40 < 64 passes
    r = std(t, None, ref)
    assert r.status == "pass" and r.metrics["large_ulp_ratio"] == 1.0
    assert r.thresholds == {"large_ulp_ratio": 0.05, "ulp_large": 32, "mean_ulp": 64}
    assert std(ref + 64 * u, None, ref).status == "error"  # mean 64 is not under 64
    t = ref.clone()
    t[:4] += 1000 * u  # 4% above 32 ULP: the share rule passes
    assert std(t, None, ref).status == "pass"
    t[:5] += 1000 * u
    assert std(t, None, ref).status == "error"  # 5%, mean 100
    bad = std(_t(1.0, INF, NAN, 2.0), None, _t(1.0, 5.0, NAN, 2.0))
    assert bad.status == "error" and bad.metrics["inf_nan_mismatches"] == 1.0
    assert bad.message == "1 inf/nan positions differ"
    same = std(_t(1.0, INF, NAN), None, _t(1.0, INF, NAN))
    assert same.status == "pass" and same.metrics["max_ulp"] == 0.0
    assert std(_t(-INF), None, _t(INF)).status == "error"
    floor = std(ref + 100 * u, None, ref, floor=torch.full((100,), 99 * u, dtype=torch.float64))
    assert floor.metrics["max_ulp"] == pytest.approx(1.0) and floor.status == "pass"
    assert floor.message.endswith(" beyond the accumulation allowance of cancelling sums")
    neg_floor = std(ref + 100 * u, None, ref, floor=torch.full((100,), -99 * u, dtype=torch.float64))
    assert neg_floor.metrics["max_ulp"] == pytest.approx(1.0)  # its size counts
    over = std(ref + u, None, ref, floor=torch.full((100,), 5 * u, dtype=torch.float64))
    assert over.metrics["max_ulp"] == 0.0  # never below zero
    assert std(ref + 100 * u, None, ref, floor=torch.ones(3)).metrics["max_ulp"] == pytest.approx(100)  # wrong shape
    empty = std(_t(), None, _t())
    assert empty.metrics == {"max_ulp": 0.0, "mean_ulp": 0.0, "large_ulp_ratio": 0.0, "inf_nan_mismatches": 0.0}
    assert make_standard("ulp", torch.float32, ulp_max_mean=1000)(ref + 64 * u, None, ref).status == "pass"


# ----------------------------------------------------------------------------------------- absolute, accumulative
def test_absolute_threshold():
    std = make_standard("absolute_threshold", torch.bfloat16)
    assert (std.rtol, std.small, std.atol) == (2.0 ** -8, 2.0 ** -10, 2.0 ** -18)
    ref = _t(1.0, 2.0, 1e-4, -1e-4, INF, NAN)
    ok = std(_t(1.0 + 2.0 ** -8, 2.0 * (1 + 2.0 ** -8), 1e-4 + 2.0 ** -18, -1e-4, INF, NAN), None, ref)
    assert ok.status == "pass" and ok.metrics == {"inf_nan_err_ratio": 0.0, "rel_err_ratio": 0.0,
                                                  "abs_err_ratio": 0.0}
    assert ok.thresholds == {"rtol": 2.0 ** -8, "small_value": 2.0 ** -10, "small_value_atol": 2.0 ** -18}
    assert ok.passing["rtol"] == pytest.approx(2.0 ** -8) and ok.standard == "absolute_threshold"
    assert ok.message == f"max relative error {ok.passing['rtol']:.3g} <= {2.0 ** -8:.3g}"
    rel = std(_t(1.0, 2.0 * (1 + 2.0 ** -7)), None, _t(1.0, 2.0))
    assert rel.status == "error" and rel.metrics["rel_err_ratio"] == 0.5
    assert rel.message == "rel_err_ratio 0.5" and rel.passing["rtol"] == pytest.approx(2.0 ** -7)
    small = std(_t(1e-4 + 2.0 ** -17, 1e-4), None, _t(1e-4, 1e-4))
    assert small.status == "error" and small.metrics["abs_err_ratio"] == 0.5
    assert small.passing["small_value_atol"] == pytest.approx(2.0 ** -17) and small.passing["rtol"] == 0.0
    edge = std(_t(2.0 ** -10 * 1.5), None, _t(2.0 ** -10))  # |ref| at small_value is small: absolute error
    assert edge.metrics["abs_err_ratio"] == 1.0 and edge.metrics["rel_err_ratio"] == 0.0
    nan = std(_t(NAN, INF, 1.0), None, _t(INF, INF, 1.0))
    assert nan.status == "error" and nan.metrics["inf_nan_err_ratio"] == 0.5  # of the two non-finite positions
    assert nan.message == "inf_nan_err_ratio 0.5"
    both = std(_t(NAN, -INF), None, _t(NAN, INF))
    assert both.metrics["inf_nan_err_ratio"] == 0.5
    two = std(_t(NAN, 1.0 * 1.1, 1e-4 + 1e-3), None, _t(1.0, 1.0, 1e-4))
    assert two.message == "inf_nan_err_ratio 1, rel_err_ratio 1, abs_err_ratio 1"
    assert std(_t(1.0), _t(1.0)).status == "pass"  # the bench stands in for a missing oracle
    assert std(_t(), None, _t()).passing == {"rtol": 0.0, "small_value_atol": 0.0}
    assert std(_t(1.0, 2.0, 2.0 ** -11), None, _t(1.0, 2.0, 0.0)).metrics["rel_err_ratio"] == 0.0


def test_accumulative():
    std = make_standard("accumulative", torch.bfloat16)
    assert (std.bound, std.eb) == (2.0 ** -7, 2.0 ** -7)
    n = 10000
    ref = torch.linspace(1, 2, n, dtype=torch.float64)
    noise = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).double() * 2.0 ** -9
    r = std(ref * (1 + noise), None, ref)
    assert r.status == "pass" and r.metrics["error_balance"] == 0.0
    assert r.thresholds["eb_threshold"] == max(2.0 ** -7, 4 / math.sqrt(n))
    assert r.thresholds["rtol"] == 2.0 ** -7 and r.thresholds["small_value"] == 1.0
    assert r.passing["eb_threshold"] == 0.0 and r.standard == "accumulative"
    biased = std(ref * (1 + abs(noise)), None, ref)  # every error one way: EB 1
    assert biased.status == "error" and biased.metrics["error_balance"] == 1.0
    assert biased.message == f"error balance 1 > {biased.thresholds['eb_threshold']:.3g} (biased accumulation)"
    assert biased.passing["eb_threshold"] == 1.0
    few = std(ref[:99] * (1 + abs(noise[:99])), None, ref[:99])
    assert few.status == "pass"  # EB is not judged below 100 elements
    hundred = std(ref[:100] * (1 + abs(noise[:100])), None, ref[:100])
    assert hundred.status == "error" and hundred.thresholds["eb_threshold"] == pytest.approx(0.4)
    big = std(ref * (1 + 2.0 ** -6), None, ref)
    assert big.status == "error" and big.message.startswith("rel_err_ratio 1")
    # an element equal to the oracle rounded to the target's dtype carries no accumulation error
    ref32 = torch.full((200,), 1.0 + 2.0 ** -12, dtype=torch.float64)
    rounded = ref32.to(torch.bfloat16)
    r = std(rounded, None, ref32)
    assert r.metrics["error_balance"] == 0.0 and r.status == "pass"
    assert std(rounded.double(), None, ref32).metrics["error_balance"] == 1.0  # not a bf16 tensor: counted
    zero = std(ref, None, ref)
    assert zero.thresholds["eb_threshold"] == 2.0 ** -7 and zero.metrics["error_balance"] == 0.0
    assert std(_t(), None, _t()).status == "pass"
    assert std(ref[:2], ref[:2]).status == "pass"  # the bench stands in for a missing oracle
    odd = torch.full((300,), 1.0, dtype=torch.float64)
    odd_t = odd.clone()
    odd_t[:200] += 2.0 ** -9
    odd_t[200:] -= 2.0 ** -9
    assert std(odd_t, None, odd).metrics["error_balance"] == pytest.approx(100 / 300)


# --------------------------------------------------------------------------------------------------- benchmark
U8 = 2.0 ** -8


def test_benchmark_levels_and_overrides():
    levels = load_yaml("thresholds.yaml")["benchmark"]["levels"]
    assert make_standard("benchmark", torch.bfloat16, "layer_norm").ratios == levels["L2"] == \
        {"max_rel_err": 2, "mean_rel_err": 1.2, "rmse": 1.2, "small_value_err": 2}
    assert make_standard("benchmark", torch.bfloat16, "embedding").level == "L1"
    assert make_standard("benchmark", torch.bfloat16, "some_api").ratios == levels["L0"] == \
        {"max_rel_err": 10, "mean_rel_err": 2, "rmse": 2, "small_value_err": 2}
    std = make_standard("benchmark", torch.float16, "x", max_rel_err=3, small_value=0.5)
    assert std.ratios["max_rel_err"] == 3.0 and std.ratios["rmse"] == 2 and std.small == 0.5
    assert (std.atol, std.min_err) == (1e-16, 2.0 ** -11)


def test_benchmark_ratios_against_the_bench_error_floored_at_one_rounding():
    std = make_standard("benchmark", torch.bfloat16, "x")
    oracle = torch.ones(1000, dtype=torch.float64)
    bench = oracle * (1 + U8)
    same = std(oracle, oracle, oracle)
    assert same.status == "pass" and same.message == "max ratio 0 (level L0)" and same.standard == "benchmark"
    assert same.metrics["bench_at_floor"] == 1.0 and same.thresholds == std.ratios
    ok = std(oracle * (1 + 2 * U8), bench, oracle)
    assert ok.status == "pass"  # ratio 2 is within 2
    assert ok.passing["mean_rel_err"] == pytest.approx(2) and ok.passing["rmse"] == pytest.approx(2)
    assert ok.passing["max_rel_err"] == pytest.approx(2) and ok.passing["small_value_err"] == 0.0
    assert ok.metrics["target_mean_rel_err"] == pytest.approx(2 * U8) and ok.metrics["bench_rmse"] == \
        pytest.approx(U8, rel=1e-4)  # msprobe's RMSE carries a 1e-4 correction
    assert ok.metrics["mean_rel_err_ratio"] == ok.passing["mean_rel_err"]
    assert set(ok.metrics) == {f"{p}_{k}" for p in ("target", "bench") for k in
                               ("max_rel_err", "mean_rel_err", "rmse", "small_value_err")} | \
        {f"{k}_ratio" for k in ("max_rel_err", "mean_rel_err", "rmse", "small_value_err")} | {"bench_at_floor"}
    bad = std(oracle * (1 + 2.5 * U8), bench, oracle)
    assert bad.status == "error" and bad.message == "mean_rel_err ratio 2.5 > 2, rmse ratio 2.5 > 2"
    exact_bench = std(oracle * (1 + 1.9 * U8), oracle, oracle)  # an exact bench is credited with one rounding
    assert exact_bench.status == "pass" and exact_bench.metrics["bench_at_floor"] == 1.0
    worse = std(oracle * (1 + 4 * U8), oracle * (1 + 2 * U8), oracle)  # a worse bench earns a looser target
    assert worse.status == "pass" and worse.metrics["bench_at_floor"] == 0.0
    neg = std(oracle * (1 + 2.5 * U8), oracle * (1 - 2 * U8), oracle)
    assert neg.status == "pass"  # the bench's error counts by its size
    no_oracle = std(oracle * (1 + 1.9 * U8), oracle)  # against the bench itself: its error is 0, the floor counts
    assert no_oracle.metrics["bench_mean_rel_err"] == 0.0 and no_oracle.status == "pass"
    assert std(oracle * (1 + 3 * U8), oracle).status == "error"
    big = make_standard("benchmark", torch.bfloat16, "x", mean_rel_err=3, rmse=3)
    assert big(oracle * (1 + 2.5 * U8), bench, oracle).status == "pass"


def test_benchmark_rmse_floor_below_unit_scale():
    std = make_standard("benchmark", torch.bfloat16, "x")
    oracle = torch.full((100,), 0.5, dtype=torch.float64)
    r = std(oracle * (1 + 2.5 * U8), oracle, oracle)  # the floor is min_err x 0.5, not min_err
    assert r.passing["rmse"] == pytest.approx(2.5, rel=1e-3) and r.status == "error"


def test_benchmark_rmse_floor_scales_with_the_data():
    std = make_standard("benchmark", torch.bfloat16, "x")
    oracle = torch.full((100,), 5.5, dtype=torch.float64)
    t = oracle * (1 + 0.5 * U8)  # half an ulp-sized error at a loss of 5.5, the bench exact
    r = std(t, oracle, oracle)
    assert r.status == "pass" and r.passing["rmse"] == pytest.approx(0.5, rel=1e-4)  # rmse / (min_err x RMS 5.5)
    assert r.metrics["target_rmse"] == pytest.approx(5.5 * 0.5 * U8, rel=1e-4)


def test_benchmark_small_values_and_inf_nan():
    std = make_standard("benchmark", torch.bfloat16, "x")
    oracle = torch.full((100,), 1e-4, dtype=torch.float64)  # all under small_value 2^-10: absolute judgement
    r = std(oracle + 1e-15, oracle, oracle)
    assert r.metrics["target_small_value_err"] == 1.0 and r.metrics["target_mean_rel_err"] == 0.0
    # the bench credited with one of the 100 small elements in error (1/100 > U8): every one of them off is 100x
    assert r.status == "error" and r.message == "small_value_err ratio 100 > 2"
    assert std(oracle + 1e-17, oracle, oracle).status == "pass"  # within small_value_atol 1e-16
    assert r.metrics["target_rmse"] == 0.0  # small elements are left out of the RMSE
    assert r.metrics["target_max_rel_err"] == 0.0 and r.metrics["target_mean_rel_err"] == 0.0
    at_atol = std(torch.full((4,), 1e-16, dtype=torch.float64), torch.zeros(4, dtype=torch.float64),
                  torch.zeros(4, dtype=torch.float64))
    assert at_atol.metrics["target_small_value_err"] == 0.0  # an error of exactly atol is within
    edge = torch.full((4,), 2.0 ** -10, dtype=torch.float64)  # |oracle| at small_value is small
    assert std(edge + 1e-12, edge, edge).metrics["target_small_value_err"] == 1.0
    empty = std(_t(), _t(), _t())
    assert empty.status == "pass" and empty.metrics["target_rmse"] == 0.0 and empty.metrics["target_max_rel_err"] \
        == 0.0
    both = torch.tensor([1.0, INF, NAN], dtype=torch.float64)
    ok = std(both.clone(), both.clone(), both.clone())
    assert ok.status == "pass" and ok.metrics["target_max_rel_err"] == 0.0
    for t in ([1.0, 1.0, NAN], [1.0, INF, 1.0], [1.0, -INF, NAN], [1.0, NAN, NAN]):
        r = std(torch.tensor(t, dtype=torch.float64), both.clone(), both.clone())
        assert r.status == "error" and r.message == "inf/nan positions differ from the bench", t
    r = std(torch.tensor([1.5, NAN, NAN], dtype=torch.float64), both.clone(), both.clone())
    assert r.message == ("inf/nan positions differ from the bench; max_rel_err ratio 128 > 10, mean_rel_err ratio "
                         "128 > 2, rmse ratio 128 > 2")
    ref = torch.ones(100, dtype=torch.float64)
    ref[-1] = NAN
    t = torch.ones(100, dtype=torch.float64)
    t[0] += 11 * U8  # one element 11 roundings off (max ratio 11 > 10, mean and RMSE within), one NaN missing
    r = std(t, ref, ref)
    assert r.message == "inf/nan positions differ from the bench; max_rel_err ratio 11 > 10"
    r = std(torch.tensor([2.0, INF, NAN]), both.clone(), both.clone())  # same positions: the ratios alone
    assert r.message == "max_rel_err ratio 256 > 10, mean_rel_err ratio 256 > 2, rmse ratio 256 > 2"


def test_benchmark_small_value_share_is_floored_at_one_element():
    """The small-value error is a share of the small elements: the bench is credited with at least one of them
    in error. An fp32 LayerNorm whose output cancels to 6.9e-7 next to its bias (the one small element of its
    1536) errs there by a rounding of its O(1) terms (8.2e-9 > atol 2^-30) where a correctly rounded bench does
    not: 0 against 1 element was a ratio of 16384 (BLOOM, AMP, step 2). Three small elements off of three fail."""
    std = make_standard("benchmark", torch.float32, "layer_norm")
    oracle = torch.linspace(-3, 3, 1536, dtype=torch.float64)
    oracle[700] = 6.92e-7
    target = oracle.float().double()
    target[700] -= 8.2e-9
    r = std(target, oracle.float().double(), oracle)
    assert r.metrics["target_small_value_err"] == 1.0 and r.metrics["bench_small_value_err"] == 0.0
    assert r.status == "pass" and r.passing["small_value_err"] == 1.0, r.message
    oracle[[100, 700, 1200]] = torch.tensor([3e-7, 6.92e-7, -5e-7], dtype=torch.float64)
    zeroed = oracle.float().double()
    zeroed[[100, 700, 1200]] = 0.0  # a kernel flushing small values to zero
    r = std(zeroed, oracle.float().double(), oracle)
    assert r.status == "error" and r.message == "small_value_err ratio 3 > 2", r.message


def test_benchmark_error_scale_and_row_floor():
    from msprobe_ci.checkers.benchmark import MAX_SCALE, ROW_FLOOR, _row_floor

    std = make_standard("benchmark", torch.bfloat16, "x")
    oracle = torch.tensor([1e-3, 1.0, -1.0, 2.0], dtype=torch.float64)  # a cancelled element among large ones
    t = oracle + torch.tensor([1e-2 * U8, 0, 0, 0], dtype=torch.float64)
    plain = std(t, oracle, oracle)
    assert plain.metrics["target_max_rel_err"] == pytest.approx(10 * U8, rel=1e-6)
    scale = torch.tensor([1e-2, 1.0, 1.0, 2.0], dtype=torch.float64)
    scaled = std(t, oracle, oracle, scale=scale)  # judged against the size of its terms
    assert scaled.metrics["target_mean_rel_err"] == pytest.approx(U8 / 4, rel=1e-6)
    assert std(t, oracle, oracle, scale=torch.ones(3)).metrics == plain.metrics  # a wrong shape is ignored
    row = _t(1e-6, 1.0, 1.0, 1.0)[None]
    assert ROW_FLOOR == 0.5
    assert float(_row_floor(row)[0, 0]) == pytest.approx(0.5 * math.sqrt((1e-12 + 3) / 4))
    assert float(_row_floor(row)[0, 1]) == 1.0 and _row_floor(_t(3.0)).tolist() == [3.0]
    two = _row_floor(_t(0.0, 2.0, 0.0, 4.0).reshape(2, 2))  # rows of two are floored, each by its own RMS
    # (approximately: the row's mean of squares is summed in the order the CPU's vector width gives)
    assert two.flatten().tolist() == pytest.approx([0.5 * math.sqrt(2), 2.0, 0.5 * math.sqrt(8), 4.0], rel=1e-15)
    assert float(_row_floor(torch.tensor(2.0, dtype=torch.float64))) == 2.0
    cube = _t(0.0, 2.0, 0.0, 4.0, 3.0, 3.0, 6.0, 6.0).reshape(2, 2, 2)  # the last dimension's rows
    assert _row_floor(cube)[:, :, 0].flatten().tolist() == pytest.approx(
        [0.5 * math.sqrt(2), 0.5 * math.sqrt(8), 3.0, 6.0], rel=1e-15)
    # the row floor serves the max relative error only; the mean keeps each element's own scale
    t2 = oracle + torch.tensor([1e-3 * U8, 0, 0, 0], dtype=torch.float64)
    small_scale = torch.tensor([1e-3, 1.0, 1.0, 2.0], dtype=torch.float64)
    r = std(t2, oracle, oracle, scale=small_scale)
    assert r.metrics["target_mean_rel_err"] == pytest.approx(U8 / 4, rel=1e-6)
    mixed = torch.tensor([1e-5, 1.0, 1e-5, 1.0], dtype=torch.float64)  # small elements take no part in the max
    rm = std(mixed + torch.tensor([1e-6, 0, 1e-6, 0], dtype=torch.float64), mixed, mixed,
             scale=torch.tensor([1e-5, 1.0, 1e-5, 1.0], dtype=torch.float64))
    assert rm.metrics["target_max_rel_err"] == 0.0 and rm.metrics["target_small_value_err"] == 1.0
    floor = 0.5 * math.sqrt((1e-6 + 1 + 1 + 4) / 4)
    # the max against the bound of one rounding: the RMS scale times sqrt(3)
    assert r.metrics["target_max_rel_err"] == pytest.approx(1e-3 * U8 / (MAX_SCALE * floor), rel=1e-6)
    # with a scale, an element is small only where its terms are small too
    tiny = torch.tensor([1e-5, 1.0], dtype=torch.float64)
    r = std(tiny + torch.tensor([1e-6, 0.0], dtype=torch.float64), tiny, tiny, scale=torch.tensor([1.0, 1.0]))
    assert r.metrics["target_small_value_err"] == 0.0 and r.metrics["target_mean_rel_err"] == pytest.approx(5e-7)


# ------------------------------------------------------------------- the per-API judge (msprobe_ci.judge.judge_pair)
def test_judge_pair_structure_scalars_and_dispatch():
    from msprobe_ci.judge import judge_pair

    assert judge_pair("x", None, None, None) == CheckResult("none", "skip", message="no output")
    s = judge_pair("x", 2, 2, None)
    assert (s.standard, s.status, s.message) == ("scalar", "pass", "target 2 vs bench 2")
    assert judge_pair("x", 2, 3, None).status == "error" and judge_pair("x", NAN, NAN, None).status == "pass"
    assert judge_pair("x", NAN, 1.0, None).status == "error"
    one = judge_pair("x", torch.ones(1), 1.0, None)  # a tensor where the bench has a scalar: a structure error
    assert (one.standard, one.status, one.message) == ("structure", "error", "target tensor [1] vs bench 1.0")
    assert judge_pair("x", 1.0, torch.ones(2, 3), None).message == "target 1.0 vs bench tensor [2, 3]"
    assert judge_pair("x", None, torch.ones(2), None).status == "error"
    shape = judge_pair("x", torch.ones(2), torch.ones(3), None)
    assert (shape.standard, shape.status, shape.message) == ("structure", "error", "shape [2] vs bench [3]")
    empty = judge_pair("x", torch.ones(0), torch.ones(0), None)
    assert (empty.standard, empty.status) == ("empty", "pass")
    idx = torch.tensor([1, 2, 3])
    assert judge_pair("argmax", idx, idx, None).standard == "binary"
    assert judge_pair("argmax", idx, torch.tensor([1, 2, 4]), None).status == "error"
    o = torch.linspace(1, 2, 64, dtype=torch.float64)
    assert judge_pair("add", o.float(), o.float(), o).standard == "absolute_threshold"
    assert judge_pair("linear", o.bfloat16(), o.bfloat16(), o).standard == "ulp"
    assert judge_pair("add", o.float(), o.float(), o, standards={"ad*": "legacy"}).standard == "legacy"
    th = judge_pair("add", o.float() * 1.5, o.float(), o, thresholds={"absolute_threshold": {"rtol": 0.6}})
    assert th.status == "pass" and th.thresholds["rtol"] == 0.6
    assert judge_pair("add", o.float() * 1.5, o.float(), o).status == "error"


def test_judge_pair_benchmark_paths():
    from msprobe_ci.judge import judge_pair

    o = torch.linspace(1, 2, 64, dtype=torch.float64)
    b = o.bfloat16()
    same = judge_pair("some_api", b.clone(), b, o)
    assert same.status == "pass" and same.passing == dict.fromkeys(("max_rel_err", "mean_rel_err", "rmse",
                                                                    "small_value_err"), 1.0)
    assert same.message == "bit-identical to the same-dtype bench: every ratio 1, not recomputed"
    assert same.metrics == {f"{k}_ratio": 1.0 for k in same.passing} and same.thresholds["max_rel_err"] == 10
    assert judge_pair("some_api", b.float(), b, o).message != same.message  # another dtype is recomputed
    asked = []

    def terms():
        asked.append(1)
        return torch.ones(64, dtype=torch.float64) * 100

    fine = judge_pair("some_api", (o * (1 + 2.0 ** -9)).bfloat16(), b, o, terms=terms)
    assert fine.status == "pass"
    bad_t = (o * 1.03).bfloat16()
    bad = judge_pair("some_api", bad_t, b, o)
    assert bad.status == "error"
    scaled = judge_pair("some_api", bad_t, b, o, terms=terms)  # terms 100x the values: a 3% error is small there
    assert scaled.status == "pass" and asked
    assert judge_pair("some_api", bad_t, b, o, terms=torch.ones(64, dtype=torch.float64) * 100).status == "pass"
    assert judge_pair("some_api", bad_t, b, o, terms=torch.ones(3) * 100).status == "error"  # wrong shape: ignored
    assert judge_pair("some_api", bad_t, b, o, terms=lambda: None).status == "error"
    assert judge_pair("some_api", bad_t, b, o, terms=lambda: torch.ones(2)).status == "error"
    asked.clear()
    judge_pair("some_api", b.clone(), b, o, terms=terms)
    assert not asked  # a bit-identical target needs no error scale


def test_judge_pair_gradients_and_small_tensors():
    from msprobe_ci.judge import judge_pair

    o = torch.linspace(1, 2, 256, dtype=torch.float64)
    lin = judge_pair("linear", (o * 1.001).bfloat16(), o.bfloat16(), o, backward=True)
    assert lin.standard == "benchmark" and lin.thresholds["max_rel_err"] == 10  # L0, whatever the forward's
    assert judge_pair("layer_norm", o.bfloat16(), o.bfloat16(), o, backward=True).thresholds["max_rel_err"] == 10
    assert judge_pair("layer_norm", o.bfloat16(), o.bfloat16(), o).thresholds.get("max_rel_err") == 2
    assert judge_pair("linear", o.bfloat16(), o.bfloat16(), o, backward=True, standards={"lin*": "ulp"}).standard == \
        "ulp"
    # a gradient is judged at its own scale: the same relative fault at 1e-12 and at 1
    tiny = o * 1e-12
    for fault, status in ((1.0, "pass"), (1.05, "error")):
        t_small = (tiny * fault).bfloat16()
        assert judge_pair("mul", t_small, tiny.bfloat16(), tiny, backward=True).status == status
        assert judge_pair("mul", (o * fault).bfloat16(), o.bfloat16(), o, backward=True).status == status
    zero = torch.zeros(4, dtype=torch.float64)
    assert judge_pair("mul", zero.bfloat16(), zero.bfloat16(), zero, backward=True).status == "pass"
    # a forward output of small scale is judged in its own units (AdamW's second moment, 1e-9)
    v = o * 1e-9
    assert judge_pair("some_api", (v * 1.05).float(), v.float(), v).status == "error"
    assert judge_pair("some_api", v.float(), v.float(), v).status == "pass"
    assert judge_pair("add", (v * 1.05).float(), v.float(), v).status == "error"
    assert judge_pair("add", (v * (1 + 2.0 ** -24)).float(), v.float(), v).status == "pass"
    # an oracle beyond the target dtype's range is the inf correct rounding gives
    big = torch.tensor([1e39, 1.0], dtype=torch.float64)
    out = torch.tensor([INF, 1.0])
    assert judge_pair("add", out, out, big).status == "pass"


def test_own_scale_saturate_and_judged_as():
    from msprobe_ci.judge import FMA, judged_as, saturate
    from msprobe_ci.judge.pair import _own_scale

    assert _own_scale(torch.tensor([0.3, -0.6], dtype=torch.float64), torch.float32) == 0.5
    assert _own_scale(torch.tensor([1.0, 0.1]), torch.float32) == 1.0
    assert _own_scale(torch.tensor([2.0]), torch.float32) == 1.0 and _own_scale(torch.zeros(3), torch.float32) == 1.0
    assert _own_scale(torch.zeros(0), torch.float32) == 1.0
    assert _own_scale(torch.tensor([0.3, NAN, INF]), torch.float32) == 0.25  # non-finite left out
    assert _own_scale(torch.tensor([1e-30], dtype=torch.float64), torch.float16) == \
        2.0 ** math.floor(math.log2(torch.finfo(torch.float16).tiny / 2.0 ** -10))  # never into subnormals
    assert _own_scale(torch.tensor([1e-30], dtype=torch.float64), torch.int32) == 2.0 ** math.floor(math.log2(1e-30))
    o = torch.tensor([1e39, -1e39, 1.0, NAN], dtype=torch.float64)
    sat = saturate(o, torch.float32)
    assert sat[0] == INF and sat[1] == -INF and sat[2] == 1.0 and math.isnan(sat[3]) and sat.dtype == torch.float64
    fine = torch.tensor([3.0e38, 1.0], dtype=torch.float64)
    assert saturate(fine, torch.float32) is fine
    assert saturate(fine, torch.float64) is fine and saturate(torch.zeros(0, dtype=torch.float64), torch.float32).numel() \
        == 0
    assert saturate(fine, torch.int32) is fine
    edge = torch.tensor([torch.finfo(torch.float32).max * (1 + 2.0 ** -25)], dtype=torch.float64)  # rounds down
    assert saturate(edge, torch.float32) is edge
    nan_peak = torch.tensor([NAN, 1e39], dtype=torch.float64)
    assert saturate(nan_peak, torch.float32)[1] == INF
    assert saturate(torch.tensor([-1e6], dtype=torch.float64), torch.float16)[0] == -INF  # one element (a loss)
    x = torch.ones(3, dtype=torch.bfloat16)
    assert judged_as("add", [x, x], {"alpha": 2}) == FMA and judged_as("add", [x, x], {"alpha": 1}) == "add"
    assert judged_as("sub_", [x, x], {"alpha": 0.5}) == FMA and judged_as("mul", [x, x], {"alpha": 2}) == "mul"
    assert judged_as("add", [x, 1e-8], {}) == FMA  # a Python float bf16 cannot hold
    assert judged_as("add", [x, 0.5], {}) == "add" and judged_as("add", [x, math.inf], {}) == "add"
    assert judged_as("add", [x.double(), 1e-8], {}) == "add"  # fp64 holds it
    assert judged_as("add", [1.0, 2.0], {}) == "add"
    assert judged_as("linear", [x, 1e-8], {}) == "linear"  # not an absolute-threshold API
    assert judged_as("add", [x], {"other": 1e-8}) == FMA
    assert judged_as("add", [x, 1e-8], {}, {"add": "ulp"}) == "add"
    assert judged_as("add", [torch.ones(2, dtype=torch.int64), 1e-8], {}) == "add"


def test_accumulation_floor_and_scale():
    from msprobe_ci.judge import accumulation_floor, accumulation_scale

    a = torch.tensor([[1.0, -1.0, 2.0]])
    w = torch.tensor([[3.0, 3.0, 1.0]])
    f = accumulation_floor("linear", torch.nn.functional.linear, [a, w], {})
    expected = math.sqrt(9 + 9 + 4) * 4 * math.sqrt(3) * 2.0 ** -24
    assert f.shape == (1, 1) and float(f) == pytest.approx(expected) and f.dtype == torch.float64
    assert float(accumulation_floor("linear", torch.nn.functional.linear, [a, w], {}, sigmas=1)) == \
        pytest.approx(expected / 4)
    assert accumulation_floor("linear", torch.nn.functional.linear, [a, w], {}, dtype=torch.float32).dtype == \
        torch.float32
    add = accumulation_floor("addmm", torch.addmm, [torch.zeros(1, 1), a, w.T], {"beta": 2.0, "alpha": 3.0})
    # the squared call: beta^2 * 0 + alpha^2 * (a^2 @ w^2): sqrt(9 * 22), over K = 3 terms (a's last dimension)
    assert float(add) == pytest.approx(math.sqrt(9 * 22) * 4 * math.sqrt(3) * 2.0 ** -24)
    assert accumulation_floor("add", torch.add, [a, w], {}) is None
    assert accumulation_floor("addmm", torch.addmm, [a], {}) is None  # its contracted operand is absent
    assert accumulation_floor("matmul", torch.matmul, [torch.tensor(2.0), torch.tensor(3.0)], {}) is None
    assert accumulation_floor("mm", torch.mm, [a, w.T], {"out": None}).shape == (1, 1)
    x = torch.tensor([[1.0, -2.0], [3.0, -4.0]], dtype=torch.bfloat16)
    assert accumulation_scale("sum", torch.sum, [x], {}).tolist() == 10.0
    assert accumulation_scale("mean", torch.mean, [x, 1], {"dtype": torch.float32, "out": None}).tolist() == [1.5, 3.5]
    assert accumulation_scale("sum", torch.sum, [x], {}).dtype == torch.float64
    assert accumulation_scale("prod", torch.prod, [x], {}) is None
    assert accumulation_scale("sum", torch.sum, [torch.ones(2, dtype=torch.int64)], {}) is None
    assert accumulation_scale("sum", torch.sum, [], {}) is None and accumulation_scale("sum", torch.sum, [3.0], {}) \
        is None


# ------------------------------------------------------------------------------ boundaries the tests above miss
def test_standards_default_to_fp32_and_keep_their_names():
    from msprobe_ci.checkers import (AbsoluteThresholdStandard, AccumulativeStandard, BenchmarkStandard,
                                     BinaryStandard, DropoutStandard)

    fp32 = dtype_thresholds("fp32")
    assert AbsoluteThresholdStandard().rtol == fp32["rtol"] and AccumulativeStandard().bound == \
        fp32["accumulative_bound"]
    assert BenchmarkStandard().min_err == fp32["min_err"] and BenchmarkStandard().level == "L0"
    assert BinaryStandard().max_rate == 0.0 and DropoutStandard().p == 0.5
    assert make_standard("accumulative", torch.bfloat16, accumulative_bound=0.5).bound == 0.5
    few = make_standard("dropout", torch.float32)(torch.ones(0))
    assert few.standard == "dropout" and few.metrics["zero_share"] == 0.0
    assert make_standard("dropout", torch.float32)(torch.ones(1000)).standard == "dropout"
    assert to_f64([1, 2]).tolist() == [1.0, 2.0] and float(to_f64(3)) == 3.0


def test_dropout_tie_passes():
    x = torch.ones(100)
    x[:76] = 0  # |0.76 - 0.5| is exactly 5 sigma + 1/n
    assert make_standard("dropout", torch.float32)(x).status == "pass"
    x[:77] = 0
    assert make_standard("dropout", torch.float32)(x).status == "error"


def test_accumulative_error_balance_boundaries():
    std = make_standard("accumulative", torch.bfloat16)
    e = 2.0 ** -9

    def with_signs(pos, neg, zero=0):
        d = torch.tensor([e] * pos + [-e] * neg + [0.0] * zero, dtype=torch.float64)
        return std((torch.ones(len(d), dtype=torch.float64) + d).numpy(), None, torch.ones(len(d)).numpy())

    at = with_signs(70, 30)  # EB 0.4 = 4 / sqrt(100): at the limit passes
    assert at.metrics["error_balance"] == pytest.approx(0.4) and at.status == "pass"
    assert at.message == f"max relative error {at.passing['rtol']:.3g} <= {2.0 ** -7:.3g}"
    assert set(at.passing) == {"rtol", "small_value_atol", "eb_threshold"}
    assert with_signs(72, 28).status == "error"  # EB 0.44 > 0.4 (5 sigma would let it pass)
    assert with_signs(65, 35).status == "pass"  # EB 0.3: under 4 sigma, over msprobe's 2^-7
    zeros = with_signs(200, 100, zero=100)  # exact elements are no part of the sign test
    assert zeros.metrics["error_balance"] == pytest.approx(100 / 300)
    # numpy inputs (no dtype to round to) and mixed exact / inexact elements of a rounded target
    half = torch.full((200,), 1.0 + 2.0 ** -12, dtype=torch.float64)
    t = half.to(torch.bfloat16).clone()
    t[:150] += 2.0 ** -7
    r = std(t, None, half)
    assert r.metrics["error_balance"] == 1.0 and r.status == "error"  # 150 inexact, all one way; 50 exact
    assert std(t.double().numpy(), None, half).metrics["error_balance"] == 0.5  # no dtype: the 50 count (down)
    assert std(half.to(torch.bfloat16), half).metrics["error_balance"] == 0.0  # the bench rounds too
    assert std(half.to(torch.bfloat16), None, half.numpy()).metrics["error_balance"] == 1.0  # no tensor to round
    assert std(torch.ones(200, dtype=torch.int32), None, half).metrics["error_balance"] == 1.0
    ints = torch.full((200,), 257, dtype=torch.int32)  # an integer reference is never rounded to the target
    assert std(torch.full((200,), 256.0, dtype=torch.bfloat16), None, ints).metrics["error_balance"] == 1.0
    empty = std(_t(), None, _t())
    assert empty.thresholds["eb_threshold"] == 2.0 ** -7 and empty.metrics["error_balance"] == 0.0


def test_accumulative_error_balance_null_of_a_correct_kernel():
    """The sign test's null where round-half-even ties are common: RMSNorm's fp32 ``pow(2).mean(-1)`` of bf16
    values (16-bit squares, exact in fp32) is biased low in PyTorch's own correct fp32 kernel (530 of 802 inexact
    rows low against 272 high here); the target may be as biased as a correct kernel, not more."""
    from msprobe_ci.judge import judge_rows

    torch.manual_seed(0)
    x = torch.randn(2048, 256).bfloat16().float().pow(2)
    o = x.double().mean(-1, keepdim=True)
    t = x.mean(-1, keepdim=True)
    inputs = (torch.Tensor.mean, (x, -1), {"keepdim": True})
    std = make_standard("accumulative", torch.float32)
    alone = std(t, None, o)  # msprobe's symmetric null: a correct kernel fails its own sign test
    assert alone.status == "error" and alone.metrics["error_balance"] == pytest.approx(258 / 802)
    assert alone.message.endswith("(biased accumulation)")
    # the same against an upcast bench (the oracle rounded once: no bias of its own) with the call's inputs: the
    # CPU kernel's bias on these terms is the null
    (_, r), = judge_rows("mean", [("out", t, o.float(), o)], inputs=inputs)
    assert r.status == "pass" and r.metrics["null_error_balance"] == pytest.approx(258 / 802)
    assert r.thresholds["eb_threshold"] == pytest.approx(258 / 802 + 4 * math.sqrt(2 / 802))
    # a bench in the target's dtype summing in another order is the null itself (no call needed)
    other = x.view(2048, 16, 16).sum(-1).sum(-1, keepdim=True) / 256
    assert not torch.equal(other, t)
    assert std(t, other, o).status == "pass" and "null_error_balance" in std(t, other, o).metrics
    # a bench of another dtype is no null of this arithmetic
    (_, wide), = judge_rows("mean", [("out", t, o, o)], inputs=None)
    assert wide.status == "error" and "null_error_balance" not in wide.metrics
    # a biased kernel is still found: every row off low by 2^-22 relative, far inside the bound
    low = (o * (1 - 2.0 ** -22)).float()
    (_, biased), = judge_rows("mean", [("out", low, o.float(), o)], inputs=inputs)
    assert biased.status == "error" and biased.metrics["error_balance"] == 1.0
    assert biased.message == (f"error balance 1 > {biased.thresholds['eb_threshold']:.3g} "
                              f"(biased accumulation; a correct kernel's own {258 / 802:.3g})")
    # terms with full fp32 significands tie rarely: the symmetric null holds and nothing is recomputed
    y = torch.randn(2048, 256).pow(2)
    oy = y.double().mean(-1)
    (_, full), = judge_rows("mean", [("out", y.mean(-1), oy.float(), oy)], inputs=(torch.Tensor.mean, (y, -1), {}))
    assert full.status == "pass" and "null_error_balance" not in full.metrics
    assert full.metrics["error_balance"] < 4 / math.sqrt(800)


def test_legacy_cosine_details():
    std = make_standard("legacy", torch.float32)
    eps = np.finfo(np.float64).eps
    at = torch.tensor([eps, eps], dtype=torch.float64)  # at eps both count as zero: equal
    assert std(at, at).metrics["cosine"] == 1.0
    assert std(at, torch.tensor([1.0, 1.0], dtype=torch.float64)).metrics["cosine"] == 0.0
    assert std(torch.tensor([1.0, 1.0], dtype=torch.float64), at).metrics["cosine"] == 0.0
    big = torch.tensor([1e200, 2e200], dtype=torch.float64)  # normalised first: no overflow
    assert std(big, big * 1.0001).metrics["cosine"] == pytest.approx(1.0)
    assert make_standard("legacy", torch.float32, cosine_min=0.5)(_t(1.0, 2.0), _t(2.0, 1.0)).metrics["cosine"] == \
        pytest.approx(0.8)
    assert make_standard("legacy", torch.float32, cosine_min=0.5)(_t(1.0, 4.0), _t(2.0, 1.0)).metrics["cosine"] == \
        pytest.approx(6 / math.sqrt(17 * 5))
    v = torch.tensor([-0.1321048632913019, 0.6404226504432821, 0.10490011715303971, -0.535669373161111,
                      0.36159505490948474], dtype=torch.float64)  # rounding puts its cosine with itself past 1
    assert std(v, v).metrics["cosine"] == 1.0 and std(-v, v).metrics["cosine"] == -1.0


def test_boundaries_at_exact_ties_and_denominators():
    from msprobe_ci.checkers import LegacyStandard

    # thousandth: an error of exactly 0.1% (against |ref| + fp32 eps) is within; fp32's eps, not fp64's
    th = make_standard("thousandth", torch.float32)
    tie = th(_t(0.001 * 2.0 ** -23), None, _t(0.0))
    assert tie.status == "pass" and tie.metrics["rel_err_thousandth"] == 1.0
    assert th(_t(1e-11), None, _t(0.0)).status == "pass"  # 8.4e-5 against fp32's eps
    assert th(_t(NAN), None, _t(1.0)).status == "error"  # NaN on one side only is no match
    # legacy: relative errors against |bench| + the dtype's eps (bf16 2^-8, fp16 fp32's, fp32/fp64 fp64's)
    b = torch.cat([torch.zeros(20, dtype=torch.float64), torch.linspace(10, 20, 980, dtype=torch.float64)])
    b[-1] = 1000.0

    def at_zeros(v):
        t = b.clone()
        t[:20] = v
        t[-1] = 1000.002  # max abs error over 0.001: the chain decides
        return t

    bf16 = make_standard("legacy", torch.bfloat16)
    assert bf16(at_zeros(3e-5), b).status == "warning"  # 3e-5 / 2^-8 = 0.8%: within 1%, not within 0.1%
    assert bf16(at_zeros(6e-5), b).status == "error"  # 1.5% on 2% of the elements
    fp16 = make_standard("legacy", torch.float16)
    assert fp16(at_zeros(1e-10), b).status == "pass"  # 1e-10 / fp32 eps: 0.08%
    for std in (make_standard("legacy", torch.float32), make_standard("legacy", torch.float64), LegacyStandard()):
        assert std(at_zeros(1e-14), b).status == "error"  # 1e-14 / fp64 eps: 45x
    tie = make_standard("legacy", torch.float32, max_abs_pass=0)(_t(0.001 * 2.0 ** -52, 0.0), _t(0.0, 0.0))
    assert tie.status == "error" and tie.metrics["dual_thousandth"] == 0.5  # exactly 0.1% is not within 0.1%
    at_abs = make_standard("legacy", torch.float32, max_abs_pass=2.0 ** -10)(_t(1.0 + 2.0 ** -10, 1.0), _t(1.0, 1.0))
    assert at_abs.status == "warning"  # max abs error at the threshold is not under it: the chain decides
    v = torch.linspace(1, 2, 16, dtype=torch.float64)
    cos = make_standard("legacy", torch.float32)(v, v).metrics["cosine"]
    at_cos = make_standard("legacy", torch.float32, cosine_min=cos)(v, v)
    assert at_cos.status == "error" and at_cos.standard == "legacy" and at_cos.thresholds["cosine_min"] == cos
    chain = make_standard("legacy", torch.float32)(v * 1.01, v)
    assert chain.standard == "legacy" and chain.status == "error"
    # ulp: the bench stands in for a missing oracle; NaN against a number is inconsistent
    ulp = make_standard("ulp", torch.bfloat16)
    one = torch.full((4,), 1.5, dtype=torch.float64)
    assert ulp(one + 2.0 ** -7, one).metrics["max_ulp"] == 1.0
    assert ulp(_t(NAN, 1.0), None, _t(1.0, 1.0)).metrics["inf_nan_mismatches"] == 1.0
    # benchmark: a 0-d tensor; the bench exactly at its floor; msprobe's RMSE correction
    std = make_standard("benchmark", torch.float32, "x")
    zero_d = std(torch.tensor(1.5, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64),
                 torch.tensor(1.5, dtype=torch.float64))
    assert zero_d.status == "pass" and zero_d.metrics["target_max_rel_err"] == 0.0
    oracle = torch.full((4,), 2.0, dtype=torch.float64)
    bench = oracle.clone()
    bench[0] += 2.0 ** -13  # relative error 2^-14 = fp32's min_err, exactly
    at_floor = std(oracle, bench, oracle)
    assert at_floor.metrics["bench_max_rel_err"] == 2.0 ** -14 and at_floor.metrics["bench_at_floor"] == 1.0
    small = torch.tensor([1.0, 1.0, 1.0, 1e-8], dtype=torch.float64)  # one small element of four
    t = small + torch.tensor([1e-3, 0, 0, 0], dtype=torch.float64)
    r = std(t, small, small)
    ae = float(t[0] - small[0])
    assert r.metrics["target_rmse"] == pytest.approx(math.sqrt(ae ** 2 / 4 * (4 / (3 + 1e-4) + 1e-4)), rel=1e-9)


def test_judge_pair_scaling_paths():
    from msprobe_ci.judge import judge_pair

    empty = judge_pair("x", torch.ones(0), torch.ones(0), None)
    assert empty.message == "empty tensor: shapes agree, nothing to compare"
    o = torch.linspace(1, 2, 64, dtype=torch.float64)
    assert judge_pair("some_api", o.bfloat16(), o.bfloat16(), o).standard == "benchmark"
    # without a floating oracle the bench is the reference
    assert judge_pair("add", (o * 1.01).float(), o.float(), None).status == "error"
    assert judge_pair("add", o.float(), o.float(), torch.ones(64, dtype=torch.int64)).status == "pass"
    # the oracle saturates only for a floating target
    idx = torch.tensor([1, 2])
    assert judge_pair("argmax", idx, idx, torch.tensor([1e39, 1.0], dtype=torch.float64)).status == "pass"
    # gradients: scaled by the largest finite |oracle| (NaN and inf left out), the error scale with them
    g = o * 1e-6
    g_nan = torch.cat([g, torch.tensor([NAN, INF], dtype=torch.float64)])
    t_nan = torch.cat([(g * 1.05).bfloat16(), torch.tensor([NAN, INF], dtype=torch.bfloat16)])
    b_nan = torch.cat([g.bfloat16(), torch.tensor([NAN, INF], dtype=torch.bfloat16)])
    assert judge_pair("mul", t_nan, b_nan, g_nan, backward=True).status == "error"
    assert judge_pair("mul", b_nan.clone(), b_nan, g_nan, backward=True).status == "pass"
    big_terms = torch.full((64,), 1e-4, dtype=torch.float64)  # 100x the gradient: a 5% error is small there
    bad = (g * 1.05).bfloat16()
    assert judge_pair("mul", bad, g.bfloat16(), g, backward=True).status == "error"
    assert judge_pair("mul", bad, g.bfloat16(), g, backward=True, terms=big_terms).status == "pass"
    assert judge_pair("mul", bad, g.bfloat16(), g, backward=True, terms=lambda: big_terms).status == "pass"
    assert judge_pair("mul", bad, g.bfloat16(), g, backward=True, terms=big_terms * 1e-4).status == "error"
    # forward outputs under scale 1 likewise, the error scale divided by the same unit (thousandth too)
    v = o * 1e-3
    bad_v = (v * 1.05).bfloat16()
    assert judge_pair("some_api", bad_v, v.bfloat16(), v).status == "error"
    assert judge_pair("some_api", bad_v, v.bfloat16(), v, terms=v * 100).status == "pass"
    assert judge_pair("some_api", bad_v, v.bfloat16(), v, terms=lambda: v * 100).status == "pass"
    assert judge_pair("some_api", bad_v, v.bfloat16(), v, terms=lambda: v * 1e-3).status == "error"
    w = torch.linspace(0.5, 1.0, 64, dtype=torch.float64) * 2.0 ** -30  # conv2d fp32: thousandth, own scale
    tw = (w * (1 + 2e-4)).float()
    assert judge_pair("conv2d", tw, w.float(), w).standard == "thousandth"
    assert judge_pair("conv2d", tw, w.float(), w).status == "pass"
    assert judge_pair("conv2d", (w * 1.01).float(), w.float(), w).status == "error"
    one = torch.linspace(0.5, 1.0, 64, dtype=torch.float64)  # top |oracle| 1: no rescaling
    assert judge_pair("some_api", (one * 1.05).bfloat16(), one.bfloat16(), one).status == "error"
    # the ULP standard takes the accumulation floor when given
    lin = torch.full((8,), 1.0, dtype=torch.float64)
    off = (lin + 2.0 ** -6).bfloat16()
    assert judge_pair("linear", off, lin.bfloat16(), lin).status == "error"
    assert judge_pair("linear", off, lin.bfloat16(), lin, floor=torch.full((8,), 2.0 ** -6)).status == "pass"
    assert judge_pair("add", off, lin.bfloat16(), lin, floor=torch.full((8,), 2.0 ** -6)).status == "error"


def test_judge_pair_accumulative_in_units_of_the_terms():
    from msprobe_ci.judge import judge_pair

    mean = torch.full((256,), 1e-5, dtype=torch.float64)  # a mean of terms of size 1e-5
    terms = torch.full((256,), 1e-5, dtype=torch.float64)
    signs = torch.where(torch.arange(256) % 2 == 0, 1.0, -1.0).double()
    bad = (mean * (1 + 0.05 * signs)).float()  # 5% either way: no bias for the error balance to see
    assert judge_pair("mean", bad, mean.float(), mean).standard == "accumulative"
    assert judge_pair("mean", bad, mean.float(), mean).status == "pass"  # absolute below 1: 5% passes unscaled
    r = judge_pair("mean", bad, mean.float(), mean, scale=terms)
    assert r.status == "error" and r.metrics["abs_err_ratio"] == 1.0  # 5% of the terms: over the bound
    assert judge_pair("mean", mean.float(), mean.float(), mean, scale=terms).status == "pass"
    assert judge_pair("mean", bad, mean.float(), mean, scale=terms, backward=True).standard == "benchmark"
    assert judge_pair("mean", bad, mean.float(), mean, scale=torch.ones(3)).status == "pass"  # wrong shape: unscaled
    assert judge_pair("mean", bad, mean.float(), mean, scale=terms.numpy()).status == "pass"  # not a tensor
    zero = judge_pair("mean", bad, mean.float(), mean, scale=torch.zeros(256, dtype=torch.float64))
    assert zero.status == "pass"  # zero terms count as unit terms
    tiny = torch.full((256,), 1e-12, dtype=torch.float64)  # terms below what fp16 can hold: clamped
    t16 = torch.full((256,), 1e-12, dtype=torch.float64).half()  # 0 in fp16
    assert judge_pair("mean", t16, t16, tiny, scale=tiny).status == "pass"
    assert judge_pair("sum", bad, mean.float(), None, scale=terms).status == "error"  # the bench as reference


def test_judge_pair_units_and_references_exactly():
    import warnings

    from msprobe_ci.judge import judge_pair

    # the lazy error scale in a forward of scale 1 or more is taken as it is (unit 1)
    o = torch.linspace(1, 2, 64, dtype=torch.float64)
    bad = (o * 1.03).bfloat16()
    assert judge_pair("some_api", bad, o.bfloat16(), o, terms=lambda: torch.full((64,), 10.0)).status == "pass"
    assert judge_pair("some_api", bad, o.bfloat16(), o, terms=lambda: torch.full((64,), 5.0)).status == "error"
    # a gradient divided by its (non power of two) scale in float64: a target equal to the oracle stays at 0 ULP
    g = torch.tensor([0.75, -1.5, 3.0], dtype=torch.float64)  # bf16-exact, largest |g| 3
    r = judge_pair("x", g.bfloat16(), g.bfloat16(), g, backward=True, standards={"x": "ulp"})
    assert r.standard == "ulp" and r.metrics["max_ulp"] == 0.0
    # the ULP standard with a floor: against the oracle, never the bench
    lin = torch.full((8,), 1.0, dtype=torch.float64)
    floor = torch.full((8,), 2.0 ** -9, dtype=torch.float64)
    worse_bench = (lin + 2.0 ** -6).bfloat16()
    assert judge_pair("linear", lin.bfloat16(), worse_bench, lin, floor=floor).status == "pass"
    assert judge_pair("linear", worse_bench, lin.bfloat16(), lin, floor=floor).status == "error"
    # the benchmark standard against the oracle, the bench's own error its allowance
    assert judge_pair("some_api", o.bfloat16(), (o * (1 + 3 * 2.0 ** -8)).bfloat16(), o).status == "pass"
    # accumulative in units of the terms: the target, the bench and the oracle all divided by the same terms
    mean = torch.full((256,), 1e-5, dtype=torch.float64)
    terms = torch.full((256,), 1e-5, dtype=torch.float64)
    signs = torch.where(torch.arange(256) % 2 == 0, 1.0, -1.0).double()
    close = (mean * (1 + 1e-5 * signs)).float()  # within the bound in units of the terms, not correctly rounded
    assert not torch.equal(close, mean.float())
    assert judge_pair("mean", close, mean.float(), mean, scale=terms).status == "pass"
    assert judge_pair("mean", close, close.clone(), None, scale=terms).status == "pass"  # the bench as reference
    # terms below what fp16 can hold are clamped at fp16's smallest normal x eps / bound: half a subnormal passes,
    # three subnormals do not
    tiny = torch.full((128,), 1e-12, dtype=torch.float64)
    z16 = torch.zeros(128, dtype=torch.float16)
    assert judge_pair("mean", z16, z16, torch.full((128,), 2.9e-8, dtype=torch.float64), scale=tiny).status == "pass"
    flush = torch.where(torch.arange(128) % 2 == 0, 3.2e-8, -3.2e-8).double()  # a kernel flushing one subnormal
    assert judge_pair("mean", z16, z16, flush, scale=tiny).status == "pass"
    alt = torch.where(torch.arange(128) % 2 == 0, 2e-7, -2e-7).double()  # no bias: the bound alone decides
    assert judge_pair("mean", z16, z16, alt, scale=tiny).status == "error"
    # nothing in the standards warns on overflowed or NaN outputs (a user's -W error run must not fail on them)
    x = torch.tensor([1.0, INF, -INF, NAN, 0.0], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("benchmark", "absolute_threshold", "ulp", "thousandth", "accumulative", "legacy", "binary"):
            for t in (x.float(), torch.tensor([NAN, 1.0, INF, 1.0, INF])):
                judge_pair("x", t, x.float(), x, standards={"x": name})
                judge_pair("x", t, x.float(), x, standards={"x": name}, backward=True)


def test_judge_pair_references_and_helpers_more():
    from msprobe_ci.judge import FMA, accumulation_floor, accumulation_scale, judge_pair, judged_as

    o = torch.linspace(1, 2, 64, dtype=torch.float64)
    # the target's error against the oracle is weighed against the bench's own: both 3% off, either way
    t, b = (o * 1.03).bfloat16(), (o * 0.97).bfloat16()
    assert judge_pair("some_api", t, b, o).status == "pass"
    asked = []
    assert judge_pair("some_api", t, b, o, terms=lambda: asked.append(1) or torch.zeros(64)).status == "pass"
    assert asked  # the bench is off its floor: the error scale is asked for, and judged against the oracle
    asked.clear()
    near = (o * (1 + 2.0 ** -9)).bfloat16()
    assert judge_pair("some_api", near, o.bfloat16(), o, terms=lambda: asked.append(1) or torch.zeros(64)).status == \
        "pass" and not asked  # a plain pass against a bench at its floor needs no error scale
    # a gradient divided by a scale that is not a power of two: in float64
    g = torch.tensor([1.0, 3.0], dtype=torch.float64)
    assert judge_pair("x", g.bfloat16(), g.bfloat16(), g, backward=True, standards={"x": "ulp"}).metrics["max_ulp"] \
        == 0.0
    # judged_as: a float the target's dtype cannot hold, even if fp32 can
    x = torch.ones(3, dtype=torch.bfloat16)
    assert judged_as("add", [x, 1 + 2.0 ** -10], {}) == FMA and judged_as("add", [x.float(), 1 + 2.0 ** -10], {}) \
        == "add"
    # the accumulation floor: the contracted dimension of a batched matmul, None arguments, grouped GEMMs, sqrt
    a3, b3 = torch.ones(2, 5, 3), torch.ones(2, 3, 4)
    f = accumulation_floor("bmm", torch.bmm, [a3, b3], {})
    assert f.shape == (2, 5, 4) and float(f[0, 0, 0]) == pytest.approx(math.sqrt(3) * 4 * math.sqrt(3) * 2.0 ** -24)
    w = torch.ones(2, 3)
    assert accumulation_floor("linear", torch.nn.functional.linear, [torch.ones(1, 3), w, None], {}).shape == (1, 2)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    gm = accumulation_floor("_grouped_mm", torch._grouped_mm, [torch.ones(4, 8).bfloat16(), torch.ones(8, 6).bfloat16()],
                            {"offs": offs})
    assert gm is not None and gm.dtype == torch.float64 and gm.shape == (2, 4, 6)
    small = accumulation_floor("mm", torch.mm, [torch.full((1, 4), 0.01), torch.full((4, 1), 0.01)], {})
    assert float(small) == pytest.approx(math.sqrt(4e-8) * 4 * 2 * 2.0 ** -24)  # no floor of 1 under the sqrt
    # the accumulation scale keeps the call's other arguments, never its out or dtype
    y = torch.tensor([[1.0, -2.0], [3.0, -4.0]])
    s = accumulation_scale("sum", torch.sum, [y, 1], {"keepdim": True, "dtype": torch.float32,
                                                       "out": torch.empty(2, 1)})
    assert s.shape == (2, 1) and s.dtype == torch.float64 and s.flatten().tolist() == [3.0, 7.0]


def test_judge_rows_scale_allowance_and_budget():
    """The one per-API step: rows judged in order; a single-output linear reduction in units of its terms; a
    ULP failure judged again with the accumulation allowance (in the oracle's dtype unless told); the benchmark
    standard's error scale asked per row index."""
    from msprobe_ci.judge import judge_pair, judge_rows

    x = torch.full((256, 8), 1e-5, dtype=torch.float64)
    mean = x.mean(1)
    signs = torch.where(torch.arange(256) % 2 == 0, 1.0, -1.0).double()
    bad = (mean * (1 + 0.05 * signs)).float()
    rows = [("mean.0.output.0", bad, mean.float(), mean)]
    assert judge_rows("mean", rows)[0][1].status == "pass"  # no inputs: msprobe's absolute rule below 1
    got = judge_rows("mean", rows, inputs=(torch.mean, [x, 1], {}))
    assert got[0][0] == "mean.0.output.0" and got[0][1].status == "error"  # 5% of the terms
    assert judge_rows("mean", rows, inputs=(torch.mean, [x, 1], {}), backward=True)[0][1].standard == "benchmark"
    two = judge_rows("mean", rows * 2, inputs=(torch.mean, [x, 1], {}))  # not a single output: unscaled
    assert [r.status for _, r in two] == ["pass", "pass"]
    assert judge_rows("mean", rows, inputs=(torch.mean, ["not a tensor"], {}))[0][1].status == "pass"

    a = torch.tensor([[1e4, -1e4, 1.0]], dtype=torch.float64)
    w = torch.ones(3, 1, dtype=torch.float64)
    ref = a @ w  # 1, from terms of 1e4: a cancelling sum
    t = (ref + 100 * 2.0 ** -23).float()  # 100 ULP at the result's size, far inside the allowance
    mm = [("mm.0.output.0", t, ref.float(), ref)]
    assert judge_rows("mm", mm)[0][1].status == "error"
    allowed = judge_rows("mm", mm, inputs=(torch.mm, [a, w], {}))[0][1]
    assert allowed.status == "pass" and allowed.message.endswith("beyond the accumulation allowance of cancelling sums")
    assert judge_rows("mm", mm, inputs=(torch.mm, [a, w], {}), floor_dtype=torch.float32)[0][1].status == "pass"
    assert judge_rows("mm", mm, inputs=(torch.add, [a, w], {}))[0][1].status == "error"  # no contracted dim known
    assert judge_rows("mm", mm * 2, inputs=(torch.mm, [a, w], {}))[0][1].status == "error"  # several outputs
    far = [("mm.0.output.0", (ref * 1.01).float(), ref.float(), ref)]
    assert judge_rows("mm", far, inputs=(torch.mm, [a, w], {}))[0][1].status == "error"  # 1%: beyond it

    asked = []

    def budget(i):
        asked.append(i)
        return None

    g = torch.linspace(-3, 3, 64, dtype=torch.float64)
    ref = torch.nn.functional.gelu(g)
    noisy = [(f"gelu.0.output.{i}", (ref * (1 + 0.03 * (i + 1))).bfloat16(), ref.bfloat16(), ref) for i in range(2)]
    results = judge_rows("gelu", noisy, budget=budget)
    assert asked == [0, 1] and [r.standard for _, r in results] == ["benchmark", "benchmark"]
    assert [r.status for _, r in results] == [judge_pair("gelu", t, b, o).status for _, t, b, o in noisy]


def test_judge_rows_passes_overrides_and_references_through_both_judgements():
    from msprobe_ci.judge import judge_rows

    x = torch.full((256, 8), 1e-5, dtype=torch.float64)
    mean = x.mean(1)
    signs = torch.where(torch.arange(256) % 2 == 0, 1.0, -1.0).double()
    bad = (mean * (1 + 0.05 * signs)).float()
    same = judge_rows("mean", [("r", bad, bad, mean)], inputs=(torch.mean, [x, 1], {}))
    assert same[0][1].status == "error"  # judged against the oracle, not against an equally wrong bench
    g = torch.linspace(-3, 3, 64, dtype=torch.float64)
    rows = [("gelu.0.output.0", torch.nn.functional.gelu(g).float(), torch.nn.functional.gelu(g).float(),
             torch.nn.functional.gelu(g))]
    over = judge_rows("gelu", rows, standards={"gelu": "absolute_threshold"},
                      thresholds={"absolute_threshold": {"rtol": 0.5}})[0][1]
    assert over.standard == "absolute_threshold" and over.thresholds["rtol"] == 0.5

    a = torch.tensor([[1e4, -1e4, 1.0]], dtype=torch.float64)
    w = torch.ones(3, 1, dtype=torch.float64)
    ref = a @ w
    t = (ref + 100 * 2.0 ** -23).float()
    wrong_bench = [("mm.0.output.0", t, (ref * 1.01).float(), ref)]  # the retry's reference is the oracle
    assert judge_rows("mm", wrong_bench, inputs=(torch.mm, [a, w], {}))[0][1].status == "pass"
    loose = judge_rows("mm", [("mm.0.output.0", t, ref.float(), ref)], inputs=(torch.mm, [a, w], {}),
                       thresholds={"ulp": {"ulp_max_mean": 63}})[0][1]
    assert loose.status == "pass" and loose.thresholds["mean_ulp"] == 63  # overrides kept in the retry
    grad = judge_rows("mm", [("mm.0.output.0", t, ref.float(), ref)], backward=True, standards={"mm": "ulp"},
                      inputs=(torch.mm, [a, w], {}))[0][1]
    assert grad.standard == "ulp" and grad.status == "pass"  # a gradient whose standard the user chose: kept
    no_oracle = judge_rows("mm", [("mm.0.output.0", t, ref.float(), None)], inputs=(torch.mm, [a, w], {}))[0][1]
    assert no_oracle.standard == "ulp"  # the bench as reference; the allowance in float64

    # the allowance's dtype: the oracle's (float64 here) unless told; squares of 1e20 overflow float32 (an
    # infinite allowance) and fit float64 (a tight one: a 1% error stays an error)
    big = torch.tensor([[1e20, 1.0]], dtype=torch.float32)
    small = torch.tensor([[1e-20], [1.0]], dtype=torch.float32)
    two = big.double() @ small.double()
    off = [("mm.0.output.0", (two * 1.01).float(), two.float(), two)]
    assert judge_rows("mm", off, inputs=(torch.mm, [big, small], {}))[0][1].status == "error"
    assert judge_rows("mm", off, inputs=(torch.mm, [big, small], {}), floor_dtype=torch.float32)[0][1].status == "pass"
    off32 = [("mm.0.output.0", (two * 1.01).float(), two.float(), two.float())]  # an fp32 oracle: fp32 allowance
    assert judge_rows("mm", off32, inputs=(torch.mm, [big, small], {}))[0][1].status == "pass"


def test_ulp_standard_judges_in_slices_what_it_judges_whole(monkeypatch):
    """The ULP standard reads outputs in float64 slices (bounded memory): the metrics, status and message are
    those of the whole tensor, with a last short slice, NaN/inf positions, a per-element floor (of the target's
    shape; another shape is left out), NumPy inputs, and a broadcast reference (read whole)."""
    import torch

    import msprobe_ci.checkers.common as common
    import msprobe_ci.checkers.ulp as ulp

    torch.manual_seed(3)
    oracle = torch.randn(101, 99, dtype=torch.float64) * 4
    target = oracle.to(torch.bfloat16)
    target.view(-1)[::97] *= 1.03  # 104 elements far off, the first among them
    target.view(-1)[5000] = float("nan")
    oracle.view(-1)[7000] = float("inf")
    floor = torch.rand(101, 99, dtype=torch.float64) * 1e-3
    row = oracle[:1].clone()  # one row: broadcast against every target row
    cases = [(target, None, oracle), (target, None, oracle, floor), (target, oracle.float(), None),
             (target.float().numpy(), None, oracle.numpy(), floor.numpy()), (target, None, oracle, floor[:50]),
             (target, None, row), (target, None, row, floor)]
    results = []
    for args in cases:
        monkeypatch.setattr(common, "SLICE", 1 << 30)
        whole = ulp.UlpStandard("bf16")(*args)
        monkeypatch.setattr(common, "SLICE", 1000)  # 10 slices, the last one short
        sliced = ulp.UlpStandard("bf16")(*args)
        assert (sliced.status, sliced.message) == (whole.status, whole.message)
        for k in ("max_ulp", "large_ulp_ratio", "inf_nan_mismatches"):
            assert sliced.metrics[k] == whole.metrics[k], k
        assert sliced.metrics["mean_ulp"] == pytest.approx(whole.metrics["mean_ulp"], rel=1e-12)
        results.append(whole.metrics)
    assert results[0]["inf_nan_mismatches"] == 2.0 and results[0]["large_ulp_ratio"] > 0.005
    assert results[1]["mean_ulp"] < results[0]["mean_ulp"]  # the floor is applied
    assert results[4] == results[0]  # a floor of another shape is left out
    assert results[3]["max_ulp"] == results[1]["max_ulp"]
    expanded = row.expand_as(oracle).clone()  # the broadcast reference, read whole, as its expansion
    for got, args in ((results[5], (target, None, expanded)), (results[6], (target, None, expanded, floor))):
        want = ulp.UlpStandard("bf16")(*args).metrics
        assert got == dict(want, mean_ulp=pytest.approx(want["mean_ulp"], rel=1e-12))
    assert results[6]["mean_ulp"] < results[5]["mean_ulp"]


def test_absolute_standard_judges_in_slices_what_it_judges_whole(monkeypatch):
    """The absolute-threshold standard counts its ratios and takes its maxima over float64 slices: every metric,
    passing value, status and message is the whole tensor's (NaN/inf positions, small values, a short last slice,
    a broadcast reference read whole)."""
    import torch

    import msprobe_ci.checkers.common as common
    from msprobe_ci.checkers.absolute import AbsoluteThresholdStandard

    torch.manual_seed(5)
    oracle = torch.randn(97, 103, dtype=torch.float64)
    oracle.view(-1)[::50] *= 1e-9  # small values, judged by absolute error
    target = oracle.to(torch.bfloat16)
    target.view(-1)[::89] *= 1.05  # relative errors past bf16's rtol, some of them on small values
    target.view(-1)[350] = 0.01  # a small value with a large absolute error
    target.view(-1)[333] = float("nan")
    target.view(-1)[4444] = float("inf")
    oracle.view(-1)[4444] = float("inf")  # consistent
    oracle.view(-1)[5555] = float("-inf")  # inconsistent
    row = oracle[:1].clone()
    for args in ((target, None, oracle), (target, oracle.float(), None), (target, None, row)):
        monkeypatch.setattr(common, "SLICE", 1 << 30)
        whole = AbsoluteThresholdStandard("bf16")(*args)
        monkeypatch.setattr(common, "SLICE", 1000)  # 10 slices, the last one short
        sliced = AbsoluteThresholdStandard("bf16")(*args)
        assert (sliced.status, sliced.message, sliced.metrics, sliced.passing) == \
            (whole.status, whole.message, whole.metrics, whole.passing)
    monkeypatch.setattr(common, "SLICE", 1000)
    res = AbsoluteThresholdStandard("bf16")(target, None, oracle)
    assert res.status == "error" and 0 < res.metrics["rel_err_ratio"] < 0.02 and res.metrics["abs_err_ratio"] > 0
    assert res.metrics["inf_nan_err_ratio"] == pytest.approx(2 / 3)  # nan vs finite, -inf vs finite; inf vs inf ok


def test_ulp_of_float64_at_its_smallest_normal_numbers_takes_the_second_factor():
    """A float64 target's ULP at the bottom of its normal range is 2^-1074, a power no float64 factor holds: the
    standard scales by two (``_scaled(..., wide=True)``), and an error of one and of three such units reads 1 and
    3 ULP; every narrower dtype's ULP needs one factor (its smallest, fp16's 2^-24, at bf16's 2^-133)."""
    from msprobe_ci.checkers.ulp import UlpStandard

    ref = torch.tensor([2.0 ** -1022, 2.0 ** -1021, 1.0], dtype=torch.float64)
    step = torch.tensor([2.0 ** -1074, 3 * 2.0 ** -1073, 0.0], dtype=torch.float64)
    res = UlpStandard("fp64")(ref + step, None, ref)
    assert res.metrics["max_ulp"] == 3.0 and res.metrics["mean_ulp"] == pytest.approx(4 / 3)
    half = torch.tensor([2.0 ** -14, 1.0], dtype=torch.float64)  # fp16's smallest normal: ULP 2^-24
    res16 = UlpStandard("fp16")(half + torch.tensor([2.0 ** -24, 0.0], dtype=torch.float64), None, half)
    assert res16.metrics["max_ulp"] == 1.0


def test_ulp_powers_of_two_are_exact_as_ldexp_and_frexp():
    """The ULP standard scales errors by powers of two built from their exponent bits (exact on every device):
    ``x * 2**k`` is NumPy's ``ldexp`` bit for bit over the whole range the standard uses (an fp8 target's
    ``k = 2 - 1023`` to an fp64 target's ``52 + 1022``: subnormal results, results past 2^1023, overflow), and
    the exponent read from the bits is ``frexp``'s minus one for every normal number."""
    import hypothesis.strategies as st
    from hypothesis import given, settings

    from msprobe_ci.checkers.ulp import _exponent_field, _scaled

    finite = st.floats(min_value=0.0, allow_infinity=False, allow_nan=False, allow_subnormal=True)

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.tuples(finite, st.integers(-1021, 1074)), min_size=1, max_size=20))
    def scaled(pairs):
        x = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
        k = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        with np.errstate(over="ignore"):
            want = np.ldexp(x.numpy(), k.numpy().astype(np.int32))
        assert _scaled(x, k + 1023).numpy().tobytes() == want.tobytes()
        low = k <= 1023  # every dtype's exponents but float64's: one factor
        assert _scaled(x[low], k[low] + 1023, wide=False).numpy().tobytes() == want[low.numpy()].tobytes()

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.floats(allow_infinity=False, allow_nan=False, allow_subnormal=False).filter(bool),
                    min_size=1, max_size=20))
    def exponent(values):
        x = torch.tensor(values, dtype=torch.float64)
        assert (_exponent_field(x) - 1023).tolist() == (np.frexp(x.numpy())[1] - 1).tolist()

    scaled()
    exponent()
    edge = torch.tensor([0.0, -0.0, 5e-324, 2.2e-308], dtype=torch.float64)
    assert _exponent_field(edge).tolist() == [0] * 4  # zeros and subnormals: under every dtype's ulp_min_exp
    assert _exponent_field(torch.tensor([INF, -INF, NAN], dtype=torch.float64)).tolist() == [2047] * 3
    k = torch.tensor([1074, 1024, 1024, 0, -1021], dtype=torch.int64)
    x = torch.tensor([5e-324, 1.0, 0.5, 3.0, 2.0 ** 1000], dtype=torch.float64)
    assert _scaled(x, k + 1023).tolist() == [1.0, math.inf, 2.0 ** 1023, 3.0, 2.0 ** -21]


def test_row_facts_are_the_peaks_and_the_equality_of_one_transfer():
    """What a row judged on an accelerator reads before its standard runs, in one transfer (issue 51): the
    oracle's ``abs_peak`` and ``finite_peak`` and ``torch.equal(target, bench)``, each what its own function
    gives, for any values (NaN, infinities, subnormals, signed zeros), any floating dtype (FP8 included) and
    any shape (empty: not asked of the oracle; shapes or dtypes that differ: never equal)."""
    import hypothesis.strategies as st
    from hypothesis import given, settings

    from msprobe_ci.judge.peaks import abs_peak, finite_peak, row_facts

    values = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True, width=64)
    dtypes = st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])

    def same(a, b):
        return (math.isnan(a) and math.isnan(b)) or a == b

    @settings(max_examples=300, deadline=None)
    @given(st.lists(values, min_size=1, max_size=24), dtypes, st.integers(0, 3), st.booleans())
    def facts(xs, dtype, changed, other_dtype):
        o = torch.tensor(xs, dtype=torch.float64).to(dtype)
        t = o.clone()
        b = t.clone()
        if changed == 1:
            b[0] = 1.0 if not bool(b[0] == 1.0) else 2.0
        elif changed == 2 and other_dtype:
            b = b.to(torch.float64 if dtype != torch.float64 else torch.float32)
        elif changed == 3:
            b = b[:-1] if b.numel() > 1 else b.reshape(1, 1)
        peak, top, eq = row_facts(o, t, b)
        assert same(peak, abs_peak(o)) and same(top, finite_peak(o))
        assert eq == (t.shape == b.shape and t.dtype == b.dtype and torch.equal(t, b))

    facts()
    assert row_facts(torch.empty(0), torch.empty(0), torch.empty(0)) == (None, None, True)
    assert row_facts(None, None, None) == (None, None, None)
    assert row_facts(torch.tensor([1, 2]), None, None) == (None, None, None)  # an integer oracle: no peaks


def test_a_row_judged_on_the_device_paths_is_judged_as_on_the_cpus(monkeypatch):
    """``judge_pair`` where reads wait for the device (``DEVICE_PATHS``) takes the oracle's peaks and the bench
    equality from one transfer (``row_facts``) and gives the CPU paths' result, metric for metric: forward and
    backward rows, bit-identical or not, small scales, and an oracle past fp16's range, whose saturation moves its
    finite peak (the peak read before it no longer scales the gradient)."""
    from msprobe_ci import _perf
    from msprobe_ci.judge import judge_pair

    gen = torch.Generator().manual_seed(21)
    o = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    rows = [("linear", o.to(torch.bfloat16), o.to(torch.bfloat16), o, True),  # bit-identical to the bench
            ("linear", (o * 1.01).to(torch.bfloat16), o.to(torch.bfloat16), o, False),
            ("add", (o * 1e-3).to(torch.float16), (o * 1e-3).to(torch.float16), o * 1e-3, False),
            ("mul", (o * 1e-5 * 1.02).to(torch.bfloat16), (o * 1e-5).to(torch.bfloat16), o * 1e-5, True)]
    big = o.clone()
    big[0, :4] = 7e4  # past fp16's 65504: the oracle saturates to inf there, as the target's kernel
    t16 = big.to(torch.float16)
    b16 = t16.clone()
    b16[1:] = (big[1:] * 1.001).to(torch.float16)
    rows += [("mul", t16, b16, big, True), ("mul", t16, b16, big, False)]

    def results(paths: bool) -> list:
        monkeypatch.setattr(_perf, "DEVICE_PATHS", paths)
        return [(r.status, r.standard, r.metrics) for r in
                (judge_pair(api, t, b, oracle, backward) for api, t, b, oracle, backward in rows)]
    cpu, device = results(False), results(True)
    assert device == cpu
    assert [(s, std) for s, std, _ in cpu] == [("pass", "benchmark"), ("error", "ulp"), ("pass", "absolute_threshold"),
                                              ("error", "benchmark"), ("pass", "benchmark"),
                                              ("pass", "absolute_threshold")]
    assert "bench_at_floor" not in cpu[0][2]  # bit-identical: every ratio 1, nothing recomputed


def test_f64_and_slices_judge_on_the_targets_device(monkeypatch):
    """``f64`` converts exactly to float64 (complex128 for complex values) and keeps a tensor on its own device or
    moves it to the one asked; ``f64_slices`` brings the reference and the floor to the target's device and cuts
    slices of ``SLICE`` elements on the CPU and of ``DEVICE_SLICE`` elsewhere (the meta device stands in for an
    accelerator: shapes and devices, no values); a NumPy target is judged on the CPU."""
    import msprobe_ci.checkers.common as common
    from msprobe_ci.checkers.common import f64, f64_slices

    half = f64(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert (half.dtype, half.device.type, half.tolist()) == (torch.float64, "cpu", [1.5, -2.0])
    z = f64(torch.tensor([1 + 2j], dtype=torch.complex64).conj())
    assert z.dtype == torch.complex128 and z.tolist() == [1 - 2j]
    assert f64(np.array([1 + 1j])).dtype == torch.complex128 and f64(np.array([3], dtype=np.int64)).tolist() == [3.0]
    assert f64(7).dtype == torch.float64 and f64(7).shape == () and f64([True, False]).tolist() == [1.0, 0.0]
    on_meta = torch.ones(3, device="meta", dtype=torch.float16)
    assert f64(on_meta).device.type == "meta" and f64(on_meta).dtype == torch.float64
    assert f64(torch.ones(2), "meta").device.type == "meta" and f64(np.ones(2), "meta").device.type == "meta"
    assert f64(np.ones(2)).device.type == "cpu"
    monkeypatch.setattr(common, "SLICE", 1000)
    monkeypatch.setattr(common, "DEVICE_SLICE", 4000)
    cpu = torch.ones(10_000)
    meta = torch.ones(10_000, device="meta")
    assert [len(t) for t, _, _ in f64_slices(cpu, cpu)] == [1000] * 10
    assert [len(t) for t, _, _ in f64_slices(cpu.numpy(), cpu.numpy())] == [1000] * 10
    parts = list(f64_slices(meta, cpu, cpu.numpy()))
    assert [len(t) for t, _, _ in parts] == [4000, 4000, 2000]
    assert {x.device.type for part in parts for x in part} == {"meta"}
    assert all(x.dtype == torch.float64 for part in parts for x in part)
    whole = list(f64_slices(meta, cpu[:1], cpu))  # a broadcast reference: whole, on the target's device
    assert len(whole) == 1 and [x.device.type for x in whole[0]] == ["meta"] * 3
    assert whole[0][0].shape == (10_000,) and whole[0][1].shape == (1,)
    assert [f for _, _, f in f64_slices(cpu, cpu)] == [None] * 10
    assert [f for _, _, f in f64_slices(cpu, cpu, cpu[:5])] == [None] * 10  # a floor of another shape: left out
    assert list(f64_slices(meta, cpu[:1]))[0][2] is None


def test_elementwise_standards_on_edge_inputs():
    """The ULP standard refuses complex outputs (no unit in the last place) with one line; an fp64 target's
    error at the smallest normal magnitudes is counted in 2^-1074 units (a power of two no float64 holds whole);
    an empty target against a scalar reference passes with zero metrics in both elementwise standards; a target
    with no small value reports a passing small-value atol of 0."""
    from msprobe_ci.checkers import AbsoluteThresholdStandard, UlpStandard

    with pytest.raises(TypeError, match="^the ULP standard judges real values; a complex output has no unit in the "
                                        "last place$"):
        UlpStandard("fp32")(torch.tensor([1 + 1j]), None, torch.tensor([1.0]))
    tiny = torch.tensor([3 * 2.0 ** -1022, 2.0 ** -1022], dtype=torch.float64)
    off = tiny + torch.tensor([6 * 2.0 ** -1074, 0.0], dtype=torch.float64)
    res = UlpStandard("fp64")(off, None, tiny)
    assert res.metrics["max_ulp"] == 3.0  # 6 * 2^-1074 at 1.5 * 2^-1021, in units of 2^-1073
    assert res.metrics["mean_ulp"] == 1.5
    empty = torch.empty(0)
    for std in (UlpStandard("bf16"), AbsoluteThresholdStandard("bf16")):
        r = std(empty, None, torch.tensor(1.0))
        assert r.status == "pass" and set(r.metrics.values()) == {0.0}, r
    normal = AbsoluteThresholdStandard("fp32")(_t(1.0, -2.0, 3.0), None, _t(1.0, -2.0, 3.0000001))
    assert normal.passing["small_value_atol"] == 0.0 and 0 < normal.passing["rtol"] < 1e-7


def test_binary_standard_compares_in_the_outputs_own_dtype():
    """Bit-exact means in the output's own dtype: int64 indices beyond 2^53 that float64 would merge differ;
    NaN equals NaN; outputs of different dtypes are compared as values."""
    from msprobe_ci.checkers import BinaryStandard

    big = torch.tensor([2 ** 60, 2 ** 60 + 1, 7], dtype=torch.int64)
    other = torch.tensor([2 ** 60, 2 ** 60, 7], dtype=torch.int64)
    res = BinaryStandard()(big, other)
    assert (res.status, res.metrics["mismatch_rate"], res.message) == ("error", pytest.approx(1 / 3),
                                                                        "1 of 3 elements differ")
    assert BinaryStandard()(big, big.clone()).message == "bit-exact"
    f = _t(1.0, NAN, -0.0)
    assert BinaryStandard()(f, _t(1.0, NAN, 0.0)).status == "pass"  # NaN == NaN, -0.0 == 0.0 as values
    assert BinaryStandard()(f, _t(1.0, 2.0, 0.0)).metrics["mismatch_rate"] == pytest.approx(1 / 3)
    assert BinaryStandard()(torch.tensor([1, 2]), _t(1.0, 2.5)).message == "1 of 2 elements differ"
    assert BinaryStandard()(np.array([True, False]), [1.0, 0.0]).status == "pass"
    assert BinaryStandard()(_t(), _t()).metrics["mismatch_rate"] == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: run on a GPU machine")
def test_elementwise_standards_judge_on_the_device_as_on_the_cpu():
    """On a CUDA device the ULP, absolute-threshold, binary and benchmark standards judge where the tensors lie
    (no copy to the host): every status, message and metric is the CPU's (means to the last bits of a sum's
    order)."""
    from msprobe_ci.checkers import AbsoluteThresholdStandard, BenchmarkStandard, BinaryStandard, UlpStandard

    g = torch.Generator().manual_seed(9)
    oracle = torch.randn(300, 1001, generator=g, dtype=torch.float64)
    oracle.view(-1)[::70] *= 1e-9
    target = oracle.to(torch.bfloat16)
    target.view(-1)[::89] *= 1.05
    target.view(-1)[333] = float("nan")
    oracle.view(-1)[5555] = float("-inf")
    floor = torch.rand(300, 1001, generator=g, dtype=torch.float64) * 1e-3
    for std, args in ((UlpStandard("bf16"), (target, None, oracle)), (UlpStandard("bf16"), (target, None, oracle,
                                                                                            floor)),
                      (AbsoluteThresholdStandard("bf16"), (target, None, oracle)),
                      (BinaryStandard(), (target, target.clone())), (BinaryStandard(), (target, oracle)),
                      (BenchmarkStandard("bf16"), (target, oracle.to(torch.bfloat16), oracle)),
                      (BenchmarkStandard("bf16"), (target, oracle.to(torch.bfloat16), oracle, floor + 1e-3))):
        cpu = std(*args)
        # every tensor on the device; then the target alone there (an oracle that fell back to the CPU)
        for dev in (std(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)),
                    std(args[0].cuda(), *args[1:])):
            assert (dev.status, dev.message) == (cpu.status, cpu.message)
            assert dev.metrics == {k: pytest.approx(v, rel=1e-12) for k, v in cpu.metrics.items()}
            assert dev.passing == {k: pytest.approx(v, rel=1e-12) for k, v in cpu.passing.items()}
    # the standards that judge in NumPy read a device tensor on the host
    assert to_f64(target.cuda()).tolist() == to_f64(target).tolist()


def test_benchmark_standard_judges_in_row_slices_what_it_judges_whole(monkeypatch):
    """The benchmark standard reads its tensors in float64 slices of whole rows (the row floor sees each row
    whole): every status, message, ratio and metric is the whole tensor's (sums to the last bits of their order),
    with an error scale, small values, NaN/inf where the bench has them and where it has not, a 1-D and a 3-D
    output, rows wider than a slice; on another device (meta) the slices are of ``DEVICE_SLICE``."""
    import msprobe_ci.checkers.common as common
    from msprobe_ci.checkers import BenchmarkStandard
    from msprobe_ci.checkers.benchmark import _row_slices

    g = torch.Generator().manual_seed(4)
    oracle = torch.randn(37, 3, 61, generator=g, dtype=torch.float64)
    oracle.view(-1)[::13] *= 1e-7
    bench = oracle.to(torch.bfloat16)
    target = (oracle * (1 + 0.02 * (torch.rand(oracle.shape, generator=g, dtype=torch.float64) < 0.1))).to(
        torch.bfloat16)
    scale = torch.rand(oracle.shape, generator=g, dtype=torch.float64) + 1e-3
    target.view(-1)[40], bench.view(-1)[40] = float("nan"), float("nan")  # where the bench has it too
    odd = target.clone()
    odd.view(-1)[5000] = float("inf")  # where it has not
    cases = [(target, bench, oracle, None), (target, bench, oracle, scale), (odd, bench, oracle, scale),
             (target.reshape(-1), bench.reshape(-1), oracle.reshape(-1), scale.reshape(-1)),
             (target, bench, None, None)]
    for args in cases:
        monkeypatch.setattr(common, "SLICE", 1 << 30)
        whole = BenchmarkStandard("bf16", api="x")(*args[:3], scale=args[3])
        monkeypatch.setattr(common, "SLICE", 200)  # three rows of 61 a slice; the 1-D one: a row wider than it
        sliced = BenchmarkStandard("bf16", api="x")(*args[:3], scale=args[3])
        assert (sliced.status, sliced.message) == (whole.status, whole.message)
        assert sliced.metrics == {k: pytest.approx(v, rel=1e-13, abs=1e-300) for k, v in whole.metrics.items()}
        assert sliced.passing == {k: pytest.approx(v, rel=1e-13, abs=1e-300) for k, v in whole.passing.items()}
    assert whole.status == "error"  # the last case: against the bench itself, the 2% elements
    assert "inf/nan" in BenchmarkStandard("bf16")(odd, bench, oracle).message
    assert BenchmarkStandard("bf16")((oracle * 1.02).to(torch.bfloat16), bench, oracle).status == "error"
    monkeypatch.setattr(common, "SLICE", 200)
    monkeypatch.setattr(common, "DEVICE_SLICE", 600)
    x = torch.ones(37, 3, 61)
    assert [s[0].shape for s in _row_slices(x, None, device=x.device)][:2] == [(3, 61), (3, 61)]
    on_meta = torch.ones(37, 3, 61, device="meta")
    shapes = [s[0].shape for s in _row_slices(on_meta, on_meta, device=on_meta.device)]
    assert shapes[0] == (9, 61) and sum(sh[0] for sh in shapes) == 111
    assert [s[0].shape for s in _row_slices(torch.ones(500), device=x.device)] == [(1, 500)]
    assert [s[0].shape for s in _row_slices(torch.ones(3, 500), device=x.device)] == [(1, 500)] * 3  # wide rows
    assert [s[0].shape for s in _row_slices(torch.ones(300, 1), device=x.device)] == [(200, 1), (100, 1)]
    assert [s[0].shape for s in _row_slices(torch.tensor(2.0), device=x.device)] == [(1, 1)]


def test_benchmark_row_floor_is_each_rows_own_and_inputs_of_any_kind():
    """The max relative error's floor is each row's own RMS scale (a row of small terms is not floored by a row
    of large ones; a 3-D output's rows are its last dimension's); NumPy inputs are judged as tensors; an empty
    output passes with zero metrics."""
    from msprobe_ci.checkers import BenchmarkStandard
    from msprobe_ci.checkers.benchmark import MAX_SCALE

    std = BenchmarkStandard("bf16")
    oracle = torch.full((2, 3, 8), 1e-3, dtype=torch.float64)  # cancelled sums
    scale = torch.ones(2, 3, 8, dtype=torch.float64)
    scale[1, 2] = 1e-2  # one row of small terms...
    scale[1, 2, 0] = 1e-4  # ...one of them estimated far under its row
    t = oracle.clone()
    t[1, 2, 0] += 1e-6  # an error of the size of its row's terms
    res = std(t, oracle, oracle, scale=scale)
    row_rms = math.sqrt((7 * 1e-4 + 1e-8) / 8)
    assert res.metrics["target_max_rel_err"] == pytest.approx(1e-6 / (MAX_SCALE * 0.5 * row_rms), rel=1e-9)
    flat = std(t.reshape(6, 8), oracle.reshape(6, 8), oracle.reshape(6, 8), scale=scale.reshape(6, 8))
    assert flat.metrics == res.metrics  # the same rows
    as_numpy = std(t.numpy(), oracle.numpy(), oracle.numpy(), scale=scale.numpy())
    assert (as_numpy.status, as_numpy.metrics) == (res.status, res.metrics)
    empty = std(torch.empty(0, 4), torch.empty(0, 4), torch.empty(0, 4))
    assert empty.status == "pass" and {empty.metrics[f"target_{k}"] for k in ("max_rel_err", "rmse")} == {0.0}


def test_peaks_from_one_pass_equal_the_abs_copy_they_replace():
    """``abs_peak`` is ``x.abs().amax()`` (NaN propagates, -inf reads inf) and ``finite_peak`` the largest finite
    ``|x|`` (``nan_to_num(|x|, nan=0, posinf=0).amax()``), for every float dtype the judge sees, with NaN, ±inf,
    signed zeros, an empty tensor."""
    import math

    import hypothesis.strategies as st
    import torch
    from hypothesis import given, settings

    from msprobe_ci.judge import abs_peak, finite_peak

    specials = st.sampled_from([0.0, -0.0, 1.5, -2.25, 1e-30, -7e4, math.inf, -math.inf, math.nan])

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.one_of(specials, st.floats(-1e5, 1e5)), max_size=40),
           st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]))
    def check(values, dtype):
        x = torch.tensor(values, dtype=dtype)
        want = float(x.abs().amax()) if x.numel() else 0.0
        got = abs_peak(x)
        assert got == want or (math.isnan(got) and math.isnan(want))
        assert finite_peak(x) == (float(torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).amax()) if x.numel() else 0.0)
    check()


# ------------------------------------------------------------------------------------------------ quantization (FP8)
def test_quantization_standard_rules_at_their_edges():
    """checkers/quantization.py number by number (thresholds.yaml ``quantization``): a cast at its own amax scale
    passes with a ratio of exactly 1; each threshold fails just above it and passes at it; values exactly at the
    format's largest value are not saturated, values beyond it by more than half its spacing are; underflow counts
    non-zero inputs quantized to 0; all-zero input has nothing to judge."""
    from msprobe_ci.checkers import QuantizationStandard

    std = QuantizationStandard("fp8_e4m3")
    assert std.name == "quantization" and std.dtype == "fp8_e4m3"
    assert std.thresholds == {"quant_err_ratio": 2.0, "underflow_share": 0.05, "saturated_share": 0.001}
    assert QuantizationStandard(underflow_share=0.5).thresholds["underflow_share"] == 0.5
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = x / x.abs().max() * 448  # at its own amax scale: amax maps to e4m3's largest value
    ok = std(x.to(e4m3), x)
    assert ok.status == "pass" and ok.message.startswith("quantization pass: normwise error")
    m = ok.metrics
    assert m["quant_err_ratio"] == 1.0 and m["quant_err"] == m["ideal_quant_err"] > 0
    assert (m["underflow_share"], m["saturated_share"], m["amax"], m["amax_use"]) == (0.0, 0.0, 448.0, 1.0)
    assert m["dynamic_range"] == pytest.approx(math.log2(448 / float(x.abs()[x != 0].min())))
    assert ok.passing == {k: m[k] for k in ("quant_err_ratio", "underflow_share", "saturated_share")}
    assert ok.thresholds == std.thresholds
    # underflow: exactly n of 1000 non-zero inputs flushed to 0 (a 1e-6 is below e4m3's smallest subnormal, 2^-9)
    for n, status in ((50, "pass"), (51, "error")):
        v = torch.full((1000,), 100.0, dtype=torch.float64)
        v[:n] = 1e-6
        r = QuantizationStandard(quant_err_ratio=1e9)(v.to(e4m3), v)
        assert r.metrics["underflow_share"] == n / 1000 and r.status == status, (n, r.message)
        if status == "error":
            assert "underflow_share 0.051 > 0.05" in r.message and "its scale does not fit the tensor" in r.message
    zeros_in = torch.zeros(10, dtype=torch.float64)
    assert std(zeros_in.to(e4m3), zeros_in).metrics["underflow_share"] == 0.0
    # saturation: beyond 448 by more than half its spacing there (32 / 2 = 16); at 448 + 16 rounding still reaches 448
    for value, share in ((448.0, 0.0), (464.0, 0.0), (464.5, 0.5)):
        v = torch.tensor([1.0, value], dtype=torch.float64)
        r = QuantizationStandard(quant_err_ratio=1e9)(v.clamp(max=448).to(e4m3), v)
        assert r.metrics["saturated_share"] == share, value
        assert r.status == ("error" if share else "pass")
    # the ratio: a cast scaled 4x off its own amax loses 2 bits more than the ideal on small values
    far = std((x / 3e4).to(e4m3), x / 3e4)
    assert far.status == "error" and far.metrics["quant_err_ratio"] > 2 and "quant_err_ratio" in far.message
    r = QuantizationStandard(quant_err_ratio=far.metrics["quant_err_ratio"], underflow_share=1.0)(
        (x / 3e4).to(e4m3), x / 3e4)
    assert r.status == "pass"  # exactly at the threshold: a pass
    nothing = std(torch.zeros(8).to(e4m3), torch.zeros(8, dtype=torch.float64))
    assert nothing.status == "pass" and nothing.message == "nothing to quantize (all zero)" and nothing.passing == {}
    # non-finite inputs are left out of every share; the format's own e5m2
    inf_in = torch.tensor([INF, 1.0, 2.0], dtype=torch.float64)
    r = QuantizationStandard("fp8_e5m2")(inf_in.to(torch.float8_e5m2), inf_in)
    assert r.metrics["amax"] == 2.0 and r.metrics["saturated_share"] == 0.0


def _ulp_by_numpy(t: np.ndarray, r: np.ndarray, floor, bits: int, min_exp: int, large: float) -> dict:
    """msprobe's ULP error written plainly in NumPy, element by element of the definitions: the reference's
    exponent ``floor(log2|r|)`` (``frexp``'s minus one; 0 for an exact zero) raised to ``min_exp``, the error
    ``|t - r|`` (less ``|floor|``, never under 0) in units of ``2^(e - bits)``, over the positions where both
    sides are finite; a non-finite position is consistent where both are NaN or both the same infinity."""
    finite = np.isfinite(t) & np.isfinite(r)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(r != 0, np.frexp(np.where(finite, r, 1.0))[1] - 1, 0)
        err = np.abs(t - r)
        if floor is not None:
            err = np.maximum(err - np.abs(floor), 0.0)
        ulp = np.ldexp(np.where(finite, err, 0.0), (bits - np.maximum(e, min_exp)).astype(np.int32))
    consistent = finite | (np.isnan(t) & np.isnan(r)) | (t == r)
    n = int(finite.sum())
    return {"max_ulp": float(ulp.max()) if ulp.size else 0.0, "mean_ulp": float(ulp.sum()) / n if n else 0.0,
            "large_ulp_ratio": int((ulp > large).sum()) / n if n else 0.0,
            "inf_nan_mismatches": float((~consistent).sum())}


def _absolute_by_numpy(t: np.ndarray, r: np.ndarray, rtol: float, small: float, atol: float) -> tuple:
    """msprobe's absolute-threshold standard written plainly in NumPy: ``(metrics, passing)``."""
    finite = np.isfinite(t) & np.isfinite(r)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ae = np.abs(t - r)
        small_m = finite & (np.abs(r) <= small)
        normal = finite & ~small_m
        re = np.where(normal, ae / (np.abs(r) + np.finfo(np.float64).eps), 0.0)
    consistent = finite | (np.isnan(t) & np.isnan(r)) | (t == r)
    metrics = {"inf_nan_err_ratio": share(int((~consistent).sum()), int((~finite).sum())),
               "rel_err_ratio": share(int(((re > rtol) & normal).sum()), int(normal.sum())),
               "abs_err_ratio": share(int(((ae > atol) & small_m).sum()), int(small_m.sum()))}
    passing = {"rtol": float(re.max()) if re.size else 0.0,
               "small_value_atol": float(np.where(small_m, ae, 0.0).max()) if ae.size else 0.0}
    return metrics, passing


def test_the_elementwise_standards_are_their_definitions_written_in_numpy():
    """The ULP and absolute-threshold standards, built of few ATen ops (each a kernel launch on an accelerator),
    are their definitions written plainly in NumPy (:func:`_ulp_by_numpy`, :func:`_absolute_by_numpy`) for every
    dtype's thresholds, on values with zeros, subnormals, NaN, ±inf on either side, float64 magnitudes past every
    narrower dtype's range, and a floor: counts and maxima exact, means to the last bits of a sum's order."""
    import hypothesis.strategies as st
    from hypothesis import given, settings

    from msprobe_ci.checkers import AbsoluteThresholdStandard, UlpStandard

    special = st.sampled_from([0.0, -0.0, NAN, INF, -INF, 5e-324, 2.0 ** -1022, 1e300, -1e-300, 2.0 ** -126, 1.0])
    value = st.one_of(special, st.floats(allow_subnormal=True, width=64), st.floats(-4, 4, width=32))
    near = st.tuples(value, st.integers(-40, 40)).map(lambda p: (p[0] * (1 + p[1] * 2.0 ** -12), p[0]))
    pairs = st.lists(st.tuples(st.one_of(st.tuples(value, value), near), st.floats(0, 1e-3)), max_size=24)

    @settings(max_examples=400, deadline=None)
    @given(pairs, st.sampled_from(["fp16", "bf16", "fp32", "fp64", "fp8_e4m3", "fp8_e5m2"]), st.booleans())
    def same(rows, key, with_floor):
        t = np.array([p[0][0] for p in rows], dtype=np.float64)
        r = np.array([p[0][1] for p in rows], dtype=np.float64)
        f = np.array([p[1] for p in rows], dtype=np.float64) if with_floor else None
        ulp = UlpStandard(key)
        got = ulp(torch.from_numpy(t), None, torch.from_numpy(r), None if f is None else torch.from_numpy(f))
        want = _ulp_by_numpy(t, r, f, int(ulp.bits), int(ulp.min_exp), ulp.large)
        assert {k: v for k, v in got.metrics.items() if k != "mean_ulp"} == \
            {k: v for k, v in want.items() if k != "mean_ulp"}
        assert got.metrics["mean_ulp"] == pytest.approx(want["mean_ulp"], rel=1e-12, nan_ok=True)
        ab = AbsoluteThresholdStandard(key)
        got = ab(torch.from_numpy(t), None, torch.from_numpy(r))
        metrics, passing = _absolute_by_numpy(t, r, ab.rtol, ab.small, ab.atol)
        assert (got.metrics, got.passing) == (metrics, passing)

    same()


def test_the_elementwise_standards_launch_few_kernels_a_slice():
    """On an accelerator each ATen op a standard dispatches is a kernel launch, microseconds of host time however
    small the output (issue 51): the ULP standard judges one slice in at most 28 kernel-launching ops (43 before
    ``x - x == 0`` stood for ``isfinite`` and the exponent fields were folded), the absolute-threshold standard in
    at most 31 (47 before), the benchmark standard, which judges the target and the bench, in at most 62 (95
    before), views and metadata ops not counted; one slice's row comes back as it is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from msprobe_ci.checkers import AbsoluteThresholdStandard, BenchmarkStandard, UlpStandard

    free = {"detach", "view", "slice", "scalar_tensor", "alias", "select", "unsqueeze", "expand"}

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in free:
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(2)
    oracle = torch.randn(64, 128, generator=g, dtype=torch.float64)
    target = oracle.to(torch.bfloat16)
    bench = (oracle * 1.001).to(torch.bfloat16)
    for std, bound, args in ((UlpStandard("bf16"), 28, (target, None, oracle)),
                             (AbsoluteThresholdStandard("bf16"), 31, (target, None, oracle)),
                             (BenchmarkStandard("bf16"), 62, (target, bench, oracle))):
        with Launches() as seen:
            res = std(*args)
        assert res.status == "pass" and len(seen.ops) <= bound, (std.name, len(seen.ops), seen.ops)
        assert "cat" not in seen.ops and "stack" in seen.ops  # one stack a slice, no totals over a single one


def test_where_the_cpu_takes_a_devices_paths_it_slices_as_a_device(monkeypatch):
    """``MSPROBE_CI_DEVICE_PATHS`` makes the CPU count what an accelerator runs (``benchmarks/host_syncs.py``): the
    elementwise and benchmark standards then judge in slices of ``DEVICE_SLICE`` elements, as on a device (a
    100,000-element output is one slice, not two of ``SLICE``), with the same verdict."""
    from msprobe_ci import _perf
    from msprobe_ci.checkers import BenchmarkStandard, UlpStandard
    from msprobe_ci.checkers.benchmark import _row_slices
    from msprobe_ci.checkers.common import f64_slices

    oracle = torch.randn(100, 1000, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    target = oracle.to(torch.bfloat16)
    seen = {}
    for paths in (False, True):
        monkeypatch.setattr(_perf, "DEVICE_PATHS", paths)
        seen[paths] = (len(list(f64_slices(target, oracle))), len(list(_row_slices(target, oracle,
                                                                                   device=target.device))),
                       UlpStandard("bf16")(target, None, oracle).metrics["max_ulp"],
                       BenchmarkStandard("bf16")(target, oracle.to(torch.bfloat16), oracle).status)
    assert seen[False][:2] == (2, 2) and seen[True][:2] == (1, 1)
    assert seen[False][2:] == seen[True][2:]


@pytest.mark.parametrize("name", sorted(STANDARDS))
def test_a_shared_standard_hands_each_result_its_own_thresholds(name):
    """make_standard shares one instance per name, dtype, API and overrides (one is asked for every judged row):
    overrides make another, and a result whose thresholds a caller changes leaves the next result's alone."""
    dtype, same = (torch.float8_e4m3fn, "fp8_e4m3") if name == "quantization" else (torch.bfloat16, "bf16")
    std = make_standard(name, dtype, "linear")
    assert make_standard(name, same, "linear") is std
    assert make_standard(name, torch.float32, "linear") is not std
    src = torch.linspace(-2, 2, 64, dtype=torch.float64)
    t = src.to(dtype)

    def judge():
        if name == "quantization":
            return std(t, src.float())
        return std(t, t) if name == "dropout" else std(t, t, src * (1 + 1e-3))
    first = judge()
    before = dict(first.thresholds)
    first.thresholds.clear()
    second = judge()
    assert second.thresholds == before and second.thresholds is not first.thresholds
    if name == "benchmark":
        tight = make_standard(name, torch.bfloat16, "linear", max_rel_err=1.5)
        assert tight is not std and tight.ratios["max_rel_err"] == 1.5 != std.ratios["max_rel_err"]
