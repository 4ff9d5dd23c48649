"""Stock transformers architectures outside the tuned set: benign bf16/fp16 runs pass, a fault is still named.

Each case failed for a cause that was not the model's: an fp64 oracle beyond the target dtype's range (GPT-Neo's
masked fp32 scores, where the target's correctly rounded result is -inf), fp16 subnormal data (ConvNeXt's 1e-6
layer scale), fp16 outputs below the normal range (a random-init MobileNetV2's 1e-26 logits), and masks filled
with each dtype's own ``finfo.min`` (GPT-J, CodeGen: an fp16 mask added to fp32 scores, -inf on the fp32 bench).
"""

import inspect
import os

import pytest
import torch

from msprobe_ci.backends import Backend
from msprobe_ci.capture.inject import Fault
from msprobe_ci.check import departure, judge, model_cases, run_side
from msprobe_ci.compare.verdict import unit_roundoff
from msprobe_ci.config import DumpConfig
from msprobe_ci.isolate import Isolator
from msprobe_ci.judge import JudgeSettings, saturate

transformers = pytest.importorskip("transformers")


def _ids(seed, n=16):
    return torch.randint(3, 256, (2, n), generator=torch.Generator().manual_seed(seed))


def _causal(kind, seed):
    torch.manual_seed(seed)
    if kind == "gpt_neo":
        cfg = transformers.GPTNeoConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                                        attention_types=[[["global", "local"], 1]], max_position_embeddings=64)
    elif kind == "gptj":
        cfg = transformers.GPTJConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64)
    else:
        cfg = transformers.CodeGenConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                         n_positions=64, n_ctx=64)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids(seed)
    return model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss


def _vision(kind, seed):
    torch.manual_seed(seed)
    if kind == "convnext":
        cfg = transformers.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=2)
    else:
        cfg = transformers.MobileNetV2Config(num_labels=2, depth_multiplier=0.35)
    model = transformers.AutoModelForImageClassification.from_config(cfg).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return model, ({"pixel_values": x, "labels": torch.tensor([0, 1])},), lambda o: o.loss


def _check(tmp_path, case, target_dtype, faults=(), isolate=True, kernel="device", level="mix", autocast=None):
    """The ``msprobe.check`` pipeline (fp32 bench, target isolated or not, forward+backward, at ``level``, the
    target under ``autocast`` when given): (report, model cases)."""
    model, inputs, loss_fn = case
    bench, target = Backend.from_options("cpu", "fp32"), Backend.from_options("cpu", target_dtype, autocast=autocast)
    cfg = DumpConfig(task="statistics", level=level)
    b = run_side(model, inputs, loss_fn, bench, cfg.with_overrides(dump_path=os.path.join(tmp_path, "bench")))
    t = run_side(model, inputs, loss_fn, target, cfg.with_overrides(dump_path=os.path.join(tmp_path, "target")),
                 faults=tuple(faults), isolator=Isolator(backward=True, bench_kernel=kernel) if isolate else None)
    cast_u = unit_roundoff(str(target.autocast if target.autocast is not None else target.dtype), str(bench.dtype))
    report, _, _ = judge(b.folder, t.folder, JudgeSettings(isolate=isolate, cast_roundoff=cast_u))
    return report, model_cases(b.outputs, t.outputs, None, cast_u, departure(report))


def _errors(report, cases):
    return [n.message for n in report.nodes if n.status == "error"] + \
        [c["message"] for c in cases if c["status"] == "error"]


def _clean(path, case, dtype, kernel="device"):
    """A benign run: no API, module or model-level testcase fails."""
    report, cases = _check(path, case, dtype, kernel=kernel)
    assert not _errors(report, cases), _errors(report, cases)[:3]


def _named(path, case, dtype, fault, kernel="device"):
    """A run with ``fault``: its call is the first divergence."""
    report, _ = _check(path, case, dtype, kernel=kernel, faults=[fault])
    expected = f"{fault.api}.{fault.call}.{fault.direction}"
    assert report.first_divergence is not None and report.first_divergence.name == expected, \
        report.first_divergence and report.first_divergence.message


@pytest.mark.parametrize("name, build, dtype, fault, expected", [
    ("gpt_neo", lambda s: _causal("gpt_neo", s), "bf16", Fault("Functional.softmax", 1, "forward", "scale", 1.05),
     "Functional.softmax.1.forward"),
    ("convnext", lambda s: _vision("convnext", s), "fp16", Fault("Functional.conv2d", 2, "forward", "scale", 1.05),
     "Functional.conv2d.2.forward"),
    ("mobilenet_v2", lambda s: _vision("mobilenet_v2", s), "fp16",
     Fault("Functional.conv2d", 1, "forward", "scale", 1.05), "Functional.conv2d.1.forward"),
])
def test_isolated_gate_on_unseen_architectures(tmp_path, name, build, dtype, fault, expected):
    for seed in (0, 1):
        report, cases = _check(tmp_path / f"benign{seed}", build(seed), dtype)
        assert not _errors(report, cases), (name, seed, _errors(report, cases)[:3])
    report, _ = _check(tmp_path / "fault", build(0), dtype, faults=[fault])
    assert report.first_divergence is not None and report.first_divergence.name == expected, \
        report.first_divergence and report.first_divergence.message


@pytest.mark.parametrize("kind", ["gptj", "codegen"])
def test_drift_rule_masks_filled_with_each_dtypes_min(tmp_path, kind):
    # the fp16 target adds finfo(float16).min to fp32 scores; the fp32 bench adds finfo(float32).min and
    # overflows to -inf: both mean "masked", and a 5% softmax fault after them is still the first error
    report, cases = _check(tmp_path / "benign", _causal(kind, 0), "fp16", isolate=False)
    forward_errors = [n.message for n in report.nodes if n.status == "error" and ".forward" in n.name]
    assert not forward_errors, forward_errors[:3]
    report, _ = _check(tmp_path / "fault", _causal(kind, 0), "fp16", isolate=False,
                       faults=[Fault("Functional.softmax", 1, "forward", "scale", 1.05)])
    assert report.first_divergence is not None and report.first_divergence.name == "Functional.softmax.1.forward", \
        report.first_divergence and report.first_divergence.message


def test_oracle_beyond_the_dtype_range_rounds_to_inf():
    big = torch.finfo(torch.float32).max
    o = torch.tensor([2.0 * big, -1.5 * big, big, 1.0, float("nan")], dtype=torch.float64)
    s = saturate(o, torch.float32)
    assert s[0] == float("inf") and s[1] == float("-inf")
    assert s[2] == big and s[3] == 1.0 and torch.isnan(s[4])  # in range (and NaN): as it was
    within = torch.tensor([1.0, -2.0], dtype=torch.float64)
    assert saturate(within, torch.bfloat16) is within  # nothing beyond: no copy
    # fp16: 65520 is max + ulp/2 (ties to even: inf), 65519 rounds to the max
    assert saturate(torch.tensor([65520.0, 65519.0], dtype=torch.float64), torch.float16).tolist() == \
        [float("inf"), 65519.0]


def _t5(seed):
    torch.manual_seed(seed)
    cfg = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForSeq2SeqLM.from_config(cfg).eval()
    return model, ({"input_ids": _ids(seed), "labels": _ids(seed + 1, 8)},), lambda o: o.loss


def test_dtype_dependent_code_paths_are_not_compared_as_one_call(tmp_path):
    # T5 clamps fp16 activations only (torch.where(..., finfo(float16).max - 1000, finfo(float16).max)): the
    # target's Torch.where.1 is that clamp, the fp32 bench's is another call; their call sites differ, so the
    # clamp's scalar constants are not judged against the other call's
    report, cases = _check(tmp_path, _t5(0), "fp16")
    assert not _errors(report, cases), _errors(report, cases)[:3]


def test_mean_of_small_values_is_judged_at_its_terms_scale(tmp_path):
    # Gemma2's RMSNorm means x^2 of activations ~3e-3 (values ~1e-5): msprobe's accumulative standard judges
    # values below 1 by absolute error (2^-11 in fp32) and passed a 5% fault; in units of mean(|x|) it fails
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                    vocab_size=256, max_position_embeddings=64, num_key_value_heads=2, head_dim=16)
    cfg._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    ids = _ids(0)
    case = (model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss)
    report, cases = _check(tmp_path / "benign", case, "bf16")
    assert not _errors(report, cases), _errors(report, cases)[:3]
    report, _ = _check(tmp_path / "fault", case, "bf16", faults=[Fault("Tensor.mean", 7, "forward", "scale", 1.05)])
    assert report.first_divergence is not None and report.first_divergence.name == "Tensor.mean.7.forward", \
        report.first_divergence and report.first_divergence.message


def test_moe_experts_against_an_fp64_bench_run_as_their_reference_and_say_so(tmp_path):
    """Mixtral's experts call torch._grouped_mm, which has no float64 kernel: the fp64 bench runs it as its float64
    reference decomposition (one matmul per group) instead of failing with a traceback, the report says so, and a
    benign fp32 target passes."""
    from msprobe_ci.check import evaluate

    torch.manual_seed(7)
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids(7)
    bench, target = Backend.from_options("cpu", "fp64"), Backend.from_options("cpu", "fp32")
    dc = DumpConfig(task="statistics", level="mix")
    b = run_side(model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss, bench,
                 dc.with_overrides(dump_path=os.path.join(tmp_path, "bench")))
    t = run_side(model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss, target,
                 dc.with_overrides(dump_path=os.path.join(tmp_path, "target")), isolator=Isolator(backward=True))
    assert t.notes == ()
    assert len(b.notes) == 1 and b.notes[0].startswith("cpu/fp64: torch._grouped_mm has no float64 kernel: it ran "
                                                       "in float64 as its reference decomposition"), b.notes
    cast_u = unit_roundoff("torch.float32", "torch.float64")
    outcome = evaluate(b, t, str(tmp_path / "out"), JudgeSettings(level="mix", cast_roundoff=cast_u))
    assert b.notes[0] in outcome.notes
    assert not [n.message for n in outcome.report.nodes if n.status == "error"]


def _falcon(seed):
    torch.manual_seed(seed)
    cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids(seed)
    return model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss


def test_multi_query_attention_against_an_upcast_bench(tmp_path):
    """Falcon's multi-query attention: the key gradient of ``Q @ K^T`` is summed over the heads the key was
    broadcast to, each head's GEMM rounded first (fp16: 2.05 times the once-rounded bench's mean relative error,
    a false fail). The upcast bench holds what the definition holds; a 1% fault on that gradient is still named."""
    _clean(tmp_path / "benign", _falcon(7), "fp16", kernel="upcast")
    _named(tmp_path / "fault", _falcon(7), "fp16",
           Fault("Tensor.__matmul__", 1, "backward", "scale", 1.01), kernel="upcast")


def _granite(seed):
    torch.manual_seed(seed)
    cfg = transformers.GraniteConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                                     max_position_embeddings=64, intermediate_size=128, num_key_value_heads=2,
                                     embedding_multiplier=12.0, residual_multiplier=0.22,
                                     attention_multiplier=0.0078125, logits_scaling=8.0)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids(seed)
    return model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss


def test_unscaled_fp16_gradients_in_the_subnormal_range(tmp_path):
    """Granite's multipliers leave most fp16 gradients without a loss scale below fp16's smallest normal (the
    premise, checked on the dump): every benign call still passes against a GPU-like (upcast) bench, and a 1% fault
    on an RMSNorm weight's product gradient there (max |grad| about 5e-6, some 80 subnormal steps) is named."""
    from msprobe_ci.dump import load_dump

    report, cases = _check(tmp_path / "benign", _granite(7), "fp16", kernel="upcast")
    assert not _errors(report, cases), _errors(report, cases)[:3]
    data = load_dump(str(tmp_path / "benign" / "target" / "step0" / "rank")).data
    maxima = [max(abs(float(o["Max"])), abs(float(o["Min"]))) for n, e in data.items() if n.endswith(".backward")
              for o in e.get("output") or [] if isinstance(o, dict) and o.get("dtype") == "torch.float16"]
    assert sum(m < torch.finfo(torch.float16).smallest_normal for m in maxima) > len(maxima) / 2
    report, _ = _check(tmp_path / "fault", _granite(7), "fp16", kernel="upcast",
                       faults=[Fault("Tensor.__mul__", 12, "backward", "scale", 1.01)])
    assert report.first_divergence is not None and \
        report.first_divergence.name == "Tensor.__mul__.12.backward", \
        report.first_divergence and report.first_divergence.message


def _resnet(seed):
    torch.manual_seed(seed)
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                    layer_type="basic", num_labels=4)
    model = transformers.ResNetForImageClassification(cfg).train()
    g = torch.Generator().manual_seed(seed + 5)
    x, labels = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
    return model, ({"pixel_values": x[:2], "labels": labels[:2]},), lambda o: o.loss


def test_a_max_pool_backward_sums_overlapping_windows_in_the_half_dtype(tmp_path):
    """A ResNet's stem max-pool (3x3, stride 2: overlapping windows) backward on the CPU adds the gradients of the
    windows an input is the max of in bf16 (benchmarks/cpu_half_accumulation.py: 1.3 roundings where one is 0.31):
    a benign run failed it against the upcast bench (max_rel_err ratio 19.7 > 10 where the sum cancels). Charged
    as the half sum it is, only where it sums: a 1% fault on it is still named."""
    for seed in (0, 1):
        _clean(tmp_path / f"benign{seed}", _resnet(seed), "bf16", kernel="upcast")
    _named(tmp_path / "fault", _resnet(0), "bf16",
           Fault("Functional.max_pool2d", 0, "backward", "scale", 1.01), kernel="upcast")


def _clip_text(seed):
    torch.manual_seed(seed)
    cfg = transformers.CLIPTextConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    model = transformers.CLIPTextModel(cfg).eval()
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(7))
    return model, ({"input_ids": ids},), lambda o: o.last_hidden_state.float().pow(2).mean()


def test_a_layer_norm_backward_adds_its_rows_into_a_half_buffer_one_by_one(tmp_path):
    """The CPU LayerNorm backward computes the input gradient in fp32 but adds the weight- and bias-gradient rows
    into a bf16/fp16 buffer one by one: each partial sum rounds at its own size (fp16 weight gradients of 1e-5 by
    the subnormal step). Charged the terms' rounding only, CLIP's final LayerNorm backward failed a benign fp16 run
    against the upcast bench (mean_rel_err ratio 5.8); charged as a kernel holding everything in fp16, a 1% bf16
    fault on it passed. Modelled as that sum, both come out right."""
    _clean(tmp_path / "benign", _clip_text(0), "fp16", kernel="upcast")
    _named(tmp_path / "fault", _clip_text(0), "bf16",
           Fault("Functional.layer_norm", 3, "backward", "scale", 1.01), kernel="upcast")


def _deberta(seed):
    torch.manual_seed(seed)
    cfg = transformers.DebertaV2Config(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=64, relative_attention=True,
                                       pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    model = transformers.DebertaV2ForMaskedLM(cfg).eval()
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(7))
    return model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss


def test_a_cross_entropy_sums_its_tokens_as_a_cascade_of_half_partial_sums(tmp_path):
    """The CPU half ``nll_loss`` adds its tokens' terms in runs of 16, one by one, into half-precision partial sums:
    each addition rounds at the size of the sum so far. DeBERTa's fp16 loss over 32 tokens, 2.6 roundings off,
    failed a benign run against the upcast bench when charged its terms' rounding only; charged the cascade, it
    passes, and a 2% fault on the bf16 loss is still named."""
    _clean(tmp_path / "benign", _deberta(0), "fp16", kernel="upcast")
    _named(tmp_path / "fault", _deberta(0), "bf16",
           Fault("Functional.cross_entropy", 0, "forward", "scale", 1.02), kernel="upcast")


def _mixtral(seed):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids(seed)
    return model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_an_moe_block_at_l0_is_budgeted_and_its_router_judged_in_its_dtype(tmp_path, dtype):
    """Mixtral at L0 (every module isolated whole), a bf16/fp16 target against the upcast bench. Its MoE block's
    float64 runs met ``torch._grouped_mm``, which has no float64 kernel: the budget's draws raised and the block
    was judged relative to its values alone (max relative error ratio 527 with no fault); they run its reference
    decomposition now (``kernels.Float64References``). Its router returns fp32 scores, ``softmax(logits.float())``
    of bf16 logits, judged as fp32 with a budget in bf16's units (RMSE ratio 3.37); a module of bf16 tensors is
    judged as bf16 now. Benign runs pass; a 2% fault on an expert GEMM is named at the experts module."""
    for seed in (7, 8):
        report, cases = _check(tmp_path / f"benign{seed}", _mixtral(seed), dtype, kernel="upcast", level="L0")
        assert not _errors(report, cases), (seed, _errors(report, cases)[:3])
    report, _ = _check(tmp_path / "fault", _mixtral(7), dtype, kernel="upcast", level="L0",
                       faults=[Fault("Torch._grouped_mm", 0, "forward", "scale", 1.02)])
    first = report.first_divergence
    assert first is not None and first.name == "Module.model.layers.0.mlp.experts.MixtralExperts.forward.0", \
        first and first.message


def _vit(seed):
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, num_labels=3)
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return (transformers.ViTForImageClassification(cfg).eval(),
            ({"pixel_values": px, "labels": torch.tensor([0, 2])},), lambda o: o.loss)


def test_small_gradients_of_a_module_under_autocast_are_judged_against_a_bench_of_its_dtype(tmp_path):
    """ViT at L0 under bf16 autocast against the upcast bench: the loss reads the classifier token only, so the
    input gradients of every other token are 250 times under their peak, small values judged by absolute error.
    The bench, the oracle rounded to fp32 (the gradients' dtype), held them exactly, and the target's bf16 casts
    put all 157 of the first layer's ``fc1`` in error (small-value error ratio 157 with no fault); rounded to the
    bf16 the module computed in, the bench errs there as any bf16 result does. Benign runs pass; a 2% fault on
    that GEMM's backward is named there."""
    for seed in (7, 8):
        report, cases = _check(tmp_path / f"benign{seed}", _vit(seed), "fp32", kernel="upcast", level="L0",
                               autocast="bf16")
        assert not _errors(report, cases), (seed, _errors(report, cases)[:3])
    report, _ = _check(tmp_path / "fault", _vit(7), "fp32", kernel="upcast", level="L0", autocast="bf16",
                       faults=[Fault("Functional.linear", 4, "backward", "scale", 1.02)])
    first = report.first_divergence
    assert first is not None and first.name == "Module.vit.layers.0.mlp.fc1.Linear.backward.0", \
        first and first.message


def _mixtral_loop(folder, autocast):
    """A user's own Mixtral training step (AdamW) under ``autocast`` (or none), dumped at L0 by PrecisionDebugger
    with the upcast bench kernel."""
    from _loops import debugged_loop

    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(11))
    debugged_loop(_mixtral(3)[0].train(), [{"input_ids": ids, "labels": ids}], folder, autocast, level="L0",
                  bench_kernel="upcast")


def test_a_routers_near_tie_in_a_users_amp_loop_is_taken_on_the_targets_side(tmp_path):
    """Mixtral in a user's own loop under bf16 autocast, dumped at L0: the second layer's router chose the same 2
    experts as the float64 oracle for one token, in the other order (two probabilities within a spread of each
    other). Its indices are compared as they are (binary standard), and with the oracle taking the target's
    choice but not its order the router failed (2 of 96 indices differing). The oracle takes the target's order
    of a near tie too now."""
    import json

    _mixtral_loop(tmp_path / "bench", False)
    _mixtral_loop(tmp_path / "target", True)
    report, _, _ = judge(str(tmp_path / "bench" / "step0" / "rank"), str(tmp_path / "target" / "step0" / "rank"),
                         JudgeSettings(isolate=True, cast_roundoff=unit_roundoff("torch.bfloat16", "torch.float32")))
    assert not [n.message for n in report.nodes if n.status == "error"]
    with open(tmp_path / "target" / "step0" / "rank" / "isolation.json", encoding="utf-8") as fh:
        node = json.load(fh)["nodes"]["Module.model.layers.1.mlp.gate.MixtralTopKRouter.forward.0"]
    assert node["status"] == "pass" and "oracle on the target's side of 2 kink inputs" in node["message"], node


def _gpt_oss(seed):
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64,
                                    layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids(seed)
    return model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss


def test_an_moe_routing_choice_within_a_rounding_skips_the_end_to_end_case_and_names_where(tmp_path):
    """gpt-oss in bf16 (seed 7) sends token 14 of 32 to another expert than the fp32 bench does: its router logits
    lie within a rounding of a tie. Every call judged on its own inputs passes, but that token's logits move by 41%
    and the logits' relative L2 error (7.4%) exceeds the end-to-end tolerance (16 u = 6.25%). The model-level case
    is then ``skip`` naming the first call whose indices' digest differs from the bench's: the ``topk`` at the mix
    level, the router module at L0 (whose statistics barely move); a fault on the router is still named."""
    for level, where in (("mix", "Torch.topk.0.forward"),
                         ("L0", "Module.model.layers.0.mlp.router.GptOssTopKRouter.forward.0")):
        report, cases = _check(tmp_path / f"benign-{level}", _gpt_oss(7), "bf16", kernel="upcast", level=level)
        assert not _errors(report, cases), (level, _errors(report, cases)[:3])
        logits = next(c for c in cases if c["name"] == "model.output.logits")
        assert logits["status"] == "skip" and logits["value"] > logits["threshold"], logits
        assert f"left the bench's at {where} (its integer outputs differ" in logits["message"], logits["message"]
    _named(tmp_path / "fault", _gpt_oss(7), "bf16", Fault("Functional.linear", 4, "forward", "scale", 1.02),
           kernel="upcast")


class _Polar(torch.nn.Module):
    """Magnitudes and angles learned through ``torch.polar``: the loss reads ``|c|`` only, so the angles' gradient
    is terms that cancel to 0, what is left being rounding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.fc(x)
        return torch.view_as_real(torch.polar(h[:, :32].abs() + 0.1, h[:, 32:]))


class _ComplexRope(torch.nn.Module):
    """The reference Llama's rotary embedding: queries viewed as complex numbers times ``polar(1, m * theta)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.o = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        b, t, _ = x.shape
        theta = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        cis = torch.polar(torch.ones(t, 8), torch.outer(torch.arange(t).float(), theta))
        q = torch.view_as_complex(self.q(x).float().reshape(b, t, 4, 8, 2))
        return self.o(torch.view_as_real(q * cis.view(1, t, 1, 8)).reshape(b, t, 64).type_as(x))


def test_complex_intermediates_are_budgeted_and_faults_on_them_named(tmp_path):
    """A complex result rounds on its real and imaginary parts (``kernels.perturb.jitter``): unjittered, the fp32
    ``polar`` backward above, whose angle gradient cancels to 0, was budgeted at zero and failed at max_rel_err
    ratio 1.6e4. Benign runs pass, 0.1% faults on the complex output and on its gradients are named (a fault
    perturbs a complex output too), and the reference Llama's complex rotary embedding passes in bf16."""
    def loss(o):
        return o.float().pow(2).mean()
    for seed in (0, 1):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
        _clean(tmp_path / f"polar{seed}", (_Polar(), (x,), loss), "fp32", kernel="upcast")
        rope = (_ComplexRope(), (torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(seed)),), loss)
        _clean(tmp_path / f"rope{seed}", rope, "bf16", kernel="upcast")
    for direction in ("forward", "backward"):
        _named(tmp_path / direction, (_Polar(), (x,), loss), "fp32",
               Fault("Torch.polar", 0, direction, "scale", 1.001), kernel="upcast")


GPT_OSS_SUITE = "import torch\nimport transformers\n\n\n" + "\n\n".join(
    inspect.getsource(f) for f in (_ids, _gpt_oss)) + """

def test_gpt_oss(msprobe):
    model, inputs, loss_fn = _gpt_oss(7)
    msprobe.check(model, *inputs, loss_fn=loss_fn)
"""


def test_the_skipped_end_to_end_case_reads_the_same_in_the_terminal_junit_and_report(pytester):
    """The routing departure above through the plugin, as a user meets it: the test passes (every call passes on
    its own inputs), and the logits' case is ``skip`` with the call where the runs parted in the terminal summary,
    the plugin's JUnit (``<skipped>``, never a pass) and report.html (the cell, and the reason written under the
    table), never ``pass`` in any of them."""
    import html
    import re
    import xml.etree.ElementTree as ET

    pytester.makepyfile(test_oss=GPT_OSS_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16",
                                           "--msprobe-bench-kernel=upcast", "--msprobe-junitxml=msprobe.xml")
    result.assert_outcomes(passed=1)
    where = "left the bench's at Torch.topk.0.forward"
    line = next(ln for ln in result.outlines if "model.output.logits:" in ln)
    assert "model.output.logits: skip (relative L2 error" in line and where in line, line
    cases = [c for c in ET.parse(pytester.path / "msprobe.xml").getroot().iter("testcase")
             if c.get("name") == "model.output.logits"]
    assert len(cases) == 1 and cases[0].find("failure") is None, [ET.tostring(c) for c in cases]
    assert where in cases[0].find("skipped").get("message")
    page = html.unescape((pytester.path / "msprobe-out" / "report.html").read_text(encoding="utf-8"))
    cell = re.search(r'<td>model\.output\.logits</td><td class="skip" title="([^"]*)">(\w+)</td>', page)
    assert cell is not None and cell.group(2) == "skip" and where in cell.group(1), cell
    assert re.search(r'<p class="skip">model\.output\.logits: [^<]*' + re.escape(where), page)  # read, not hovered


def test_a_cache_the_module_keeps_in_a_dict_stays_out_of_its_whole_module_re_runs(tmp_path):
    """LeViT's eval-mode attention caches its bias in a dict keyed by device. At L0 the fp64 re-run of an attention
    module stored its bias there, and the target's next forward read it: "expected scalar type Float but found
    BFloat16" from the user's own forward. A re-run gets a copy of such containers: the run passes, and the live
    model's caches hold only what its own (fp32 bench, bf16 target copies') forwards stored."""
    torch.manual_seed(7)
    cfg = transformers.LevitConfig(image_size=32, patch_size=16, hidden_sizes=[32, 48, 64],
                                   num_attention_heads=[1, 2, 2], depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=3)
    model = transformers.LevitForImageClassification(cfg).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    case = (model, ({"pixel_values": x, "labels": torch.tensor([0, 2])},), lambda o: o.loss)
    report, cases = _check(tmp_path / "benign", case, "bf16", kernel="upcast", level="L0")
    assert not _errors(report, cases), _errors(report, cases)[:3]
    assert all(not isinstance(v, torch.Tensor) or v.dtype == torch.float32
               for m in model.modules() for v in getattr(m, "attention_bias_cache", {}).values())


def test_a_router_whose_indices_alone_differ_is_judged_on_the_targets_side_of_its_top_k(tmp_path):
    """Qwen3-Next's router at L0 in bf16 (seed 7): one token's two candidate experts tie in the target's fp32
    probabilities (computed from bf16 logits) and the fp64 oracle picks the other. Only its integer indices differed,
    so no budget was drawn (only a floating row judged against its bench asks) and no kink was looked at: the
    benign router failed the binary standard. A failing module now draws its budget for the kinks; the router is
    judged on the target's side of its top-k, and the run is clean."""
    import json

    torch.manual_seed(7)
    cfg = transformers.Qwen3NextConfig(vocab_size=256, max_position_embeddings=64, hidden_size=64,
                                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                       num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                       moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                                       num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids(7)
    report, cases = _check(tmp_path, (model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss), "bf16",
                           kernel="upcast", level="L0")
    assert not _errors(report, cases), _errors(report, cases)[:3]
    with open(tmp_path / "target" / "step0" / "rank" / "isolation.json", encoding="utf-8") as fh:
        node = json.load(fh)["nodes"]["Module.model.layers.1.mlp.gate.Qwen3NextTopKRouter.forward.0"]
    assert node["status"] == "pass" and "oracle on the target's side of 2 kink inputs" in node["message"], node


def _recurrent_gemma(seed):
    torch.manual_seed(seed)
    cfg = transformers.RecurrentGemmaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                            num_key_value_heads=1, intermediate_size=128, lru_width=64,
                                            attention_window_size=8, vocab_size=256, conv1d_width=4,
                                            block_types=["recurrent", "recurrent", "attention"])
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids(seed)
    return model, ({"input_ids": ids, "labels": ids},), lambda o: o.loss


def test_whole_module_isolation_of_a_stateful_module_leaves_the_users_run_as_it_was(tmp_path):
    """RecurrentGemma's recurrent block keeps ``rg_lru.recurrent_states`` and ``conv1d_state`` as plain attributes
    and rebinds them in its forward. L0 isolation re-runs each module on copies of its state: a re-run before the
    target's forward left its float64 final state on the model (the target's forward started from it), and one
    after it started from the target's final state and freed that graph (the user's ``loss.backward()`` raised).
    Re-runs now start from the state the call began with and put every attribute back: the target's logits and
    loss are bit-identical with and without isolation, the benign bf16 run passes, and a fault is still named."""
    model, inputs, loss_fn = _recurrent_gemma(7)
    target = Backend.from_options("cpu", "bf16")
    cfg = DumpConfig(task="statistics", level="L0")
    plain = run_side(model, inputs, loss_fn, target, cfg.with_overrides(dump_path=os.path.join(tmp_path, "plain")))
    isolated = run_side(model, inputs, loss_fn, target, cfg.with_overrides(dump_path=os.path.join(tmp_path, "iso")),
                        isolator=Isolator(backward=True, bench_kernel="upcast"))
    outs = dict(isolated.final_outputs())
    for name, value in plain.final_outputs():
        assert torch.equal(outs[name], value), name
    report, cases = _check(tmp_path / "gate", (model, inputs, loss_fn), "bf16", kernel="upcast", level="L0")
    assert not _errors(report, cases), _errors(report, cases)[:3]
    assert any(n.name.startswith("Module.model.layers.0.temporal_block") and n.metrics.get("standard")
               for n in report.nodes)  # the stateful block itself was judged whole


def test_a_module_drawing_random_numbers_of_its_own_is_not_isolated_whole(tmp_path):
    """Swin's stochastic depth is a ``drop_path`` function calling ``torch.rand``, in no dropout module: isolated
    whole in training mode, each re-run drew another mask, and users' own bf16/fp16 loops at L0 failed a
    ``SwinLayer`` at 2 and 3 of 3 steps. A module whose oracle run draws from the generator is left to its
    submodules now, saying so; the blocks without stochastic depth (the first) are still judged whole."""
    torch.manual_seed(0)
    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 1], num_heads=[2, 4],
                                  window_size=4, num_labels=3, drop_path_rate=0.2)
    model = transformers.SwinForImageClassification(cfg).train()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    case = (model, ({"pixel_values": pixels, "labels": torch.tensor([0, 2])},), lambda o: o.loss)
    report, cases = _check(tmp_path, case, "bf16", kernel="upcast", level="L0")
    assert not _errors(report, cases), _errors(report, cases)[:3]
    import glob
    import json

    (path,) = glob.glob(os.path.join(tmp_path, "target", "**", "isolation.json"), recursive=True)
    with open(path, encoding="utf-8") as fh:
        records = json.load(fh)
    records = records["nodes"]
    later = "Module.swin.encoder.layers.0.blocks.1.SwinLayer.forward.0"
    assert "module not isolated: random (it draws from the generator)" in records[later]["message"], records[later]
    nodes = {n.name: n for n in report.nodes}
    assert not nodes[later].metrics.get("standard")  # judged by what is inside it
    first = nodes["Module.swin.encoder.layers.0.blocks.0.SwinLayer.forward.0"]  # drop path rate 0 there
    assert first.metrics.get("standard"), first.message
