"""Loop gates on a stock transformers Llama (built from a config), bf16 target against an fp32 bench, one step<N>
folder per step judged with isolated verdicts: msprobe.check_training (three AdamW steps) and
msprobe.check_generate (prefill + four teacher-forced decode steps with the KV cache)."""

import json
import re

import pytest

pytest.importorskip("transformers")

TRAIN = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def batches():
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 128, (1, 8), generator=g)
                                                         for _ in range(3))]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def test_train(msprobe):
    r = msprobe.check_training(build(), batches(), lambda out: out.loss, adamw)
    assert len(r["losses"]["bench"]) == 3 and len(r["grads"]) == 3
    # bf16 AdamW steps: the lowest seen is 0.9896 (step 1, a gate_proj weight; below 0.99 it is a note, not a failure)
    assert all(g["cosine"] >= 0.98 for step in r["grads"] for g in step)


def test_train_with_a_faulty_silu_at_step_2(msprobe):
    msprobe.check_training(build(), batches(), lambda out: out.loss, adamw, inject="faults.yaml")


PROMPT = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))


def test_generate(msprobe):
    r = msprobe.check_generate(build().eval(), PROMPT, max_new_tokens=4)
    assert len(r["tokens"]) == 5 and len(r["target_picks"]) == 5
    agree = [t == p for t, p in zip(r["tokens"], r["target_picks"])]
    assert r["token_agreement"] == sum(agree) / 5  # the share of steps whose greedy picks agree, teacher-forced
    assert agree[0]  # the prefill's pick: a benign bf16 target agrees with the fp32 bench here


def test_generate_with_a_faulty_silu_at_decode_step_2(msprobe):
    msprobe.check_generate(build().eval(), PROMPT, max_new_tokens=4, inject="faults.yaml")
"""


@pytest.mark.parametrize("kernel,dtype", [("device", "bf16"), ("rounded", "bf16"), ("rounded", "fp32")])
def test_benign_loops_pass_and_a_step_2_fault_is_named(pytester, kernel, dtype):
    """Both loops, against the target's own kernel and against the correctly rounded bench; bf16 against fp32, and
    fp32 against fp32 (the same dtype: sources are context after step 0 even where the dtypes' roundoff is 0)."""
    pytester.makepyfile(test_train=TRAIN)
    value = 1.05 if dtype == "bf16" else 1.01
    pytester.makefile(".yaml", faults="faults:\n  - {api: Functional.silu, call: 0, perturb: scale, "
                                      f"value: {value}, step: 2}}\n")
    dtype_args = ["--msprobe-target-dtype=bf16"] if dtype == "bf16" else []
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *dtype_args,
                                           "--msprobe-junitxml=j.xml", f"--msprobe-bench-kernel={kernel}")
    result.assert_outcomes(passed=2, failed=2)
    junit = (pytester.path / "j.xml").read_text()
    for step in range(3):
        assert f"test_train.test_train check 0 step{step}" in junit
    result.stdout.fnmatch_lines(["*loss bench/target: step0 *, step1 *, step2 *"])
    result.stdout.fnmatch_lines(["*msprobe: first divergence at step 2: Functional.silu.0.forward*"])
    result.stdout.fnmatch_lines(["*msprobe: first divergence at step 2 (decode token 2): Functional.silu.0.forward*"])
    result.stdout.fnmatch_lines(["*token agreement (target's own greedy pick vs the bench's, teacher-forced): */5*"])
    results = [json.loads(p.read_text()) for p in
               (pytester.path / "msprobe-out" / "test_train.py_test_train").rglob("msprobe-result.json")]
    assert sorted(r["step"] for r in results) == [0, 1, 2]
    assert all(r["grads"] and {"cosine", "sign_agreement", "bench_norm", "target_norm"} <= set(r["grads"][0])
               for r in results)
    # report.html: per loop check its steps, the training checks' loss curves and gradient cosines plotted
    page = (pytester.path / "msprobe-out" / "report.html").read_text(encoding="utf-8")
    assert page.count(" check 0: training loop</h2>") == 2 and page.count(" check 0: generation, token agreement ") == 2

    def section(title):
        body = page.split(title, 1)[1].split("<h2", 1)[0]
        return body, [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for row in re.findall(r"<tr>(.*?)</tr>", body,
                                                                                          re.S)][1:]

    body, rows = section("test_train.py::test_train_with_a_faulty_silu_at_step_2 &middot; check 0: training loop")
    assert "<svg" in body and [r[0] for r in rows] == ["0", "1", "2"]
    assert [r[4] for r in rows] == ["pass", "pass", "fail"] and rows[2][5] == "Functional.silu.0.forward"
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and 0.9 < float(r[3].split()[0]) <= 1 for r in rows)
    body, rows = section("test_train.py::test_generate_with_a_faulty_silu_at_decode_step_2 &middot; check 0: "
                         "generation")
    assert [r[0] for r in rows] == ["0 (prefill)", "1", "2", "3", "4"] and all(r[1] in ("yes", "no") for r in rows)
    assert [r[2] for r in rows] == ["pass", "pass", "fail", "pass", "pass"]


def test_a_fault_in_adamws_second_moment_is_named(pytester):
    """AdamW's second moment (``exp_avg_sq``, values about 1e-9 after one step) is judged at its own scale: a 5%
    fault in its update (``Tensor.addcmul_``, call 3) at step 1 is named there, in bf16 (it passed as "small
    values" under msprobe's absolute rule)."""
    pytester.makepyfile(test_train=TRAIN)
    pytester.makefile(".yaml", faults="faults:\n  - {api: Tensor.addcmul_, call: 3, perturb: scale, value: 1.05, "
                                      "step: 1}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16",
                                           "-k", "test_train_with")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at step 1: Tensor.addcmul_.3.forward*"])


SAMPLED = TRAIN.split("def test_train(")[0] + """
PROMPT = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))


def test_sampled(msprobe):
    r = msprobe.check_generate(build().eval(), PROMPT, max_new_tokens=6, token_range=[2, 3])
    assert len(r["tokens"]) == 7 and len(r["reports"]) == 2


def test_sampled_fault(msprobe):
    msprobe.check_generate(build().eval(), PROMPT, max_new_tokens=6, token_range=[2, 3], inject="faults.yaml")


def test_bad_range(msprobe):
    msprobe.check_generate(build().eval(), PROMPT, max_new_tokens=3, token_range=[2, 5])


def test_seq2seq(msprobe):
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=128, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    msprobe.check_generate(BartForConditionalGeneration(cfg).eval(), PROMPT, max_new_tokens=2)
"""


def test_token_range_captures_only_its_steps_and_still_names_the_faulty_step(pytester):
    pytester.makepyfile(test_gen=SAMPLED)
    pytester.makefile(".yaml", faults="faults:\n  - {api: Functional.silu, call: 0, perturb: scale, value: 1.05, "
                                      "step: 3}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at step 3 (decode token 3): Functional.silu.0.forward*"])
    # an encoder-decoder model would decode nothing the user runs (each token fed to its encoder): refused
    result.stdout.fnmatch_lines(["*check_generate: BartForConditionalGeneration is an encoder-decoder model; "
                                 "check_generate decodes a causal LM*"])
    result.stdout.fnmatch_lines(["*token_range: expected ?a, b? with 0 <= a <= b <= max_new_tokens (3), got ?2, 5?*"])
    result.stdout.fnmatch_lines(["*captured and judged steps 2..3 of 0..6*"])
    check = pytester.path / "msprobe-out" / "test_gen.py_test_sampled" / "check0"
    assert sorted(p.name for p in (check / "target").iterdir()) == ["step2", "step3"]


def test_precision_debugger_token_range_records_only_those_root_forward_calls(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from msprobe_ci import MsprobeError, PrecisionDebugger

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    counts = {}
    for name, token_range in (("all", None), ("sampled", [2, 3])):
        debugger = PrecisionDebugger(dump_path=str(tmp_path / name), level="mix", task="statistics")
        debugger.start(model, token_range=token_range)
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        debugger.stop()
        data = json.loads((tmp_path / name / "step0" / "rank" / "dump.json").read_text())["data"]
        counts[name] = data
    roots = [k for k in counts["sampled"] if k.startswith("Module.model.LlamaModel.forward.")]
    assert len([k for k in counts["all"] if k.startswith("Module.model.LlamaModel.forward.")]) == 6
    assert roots == ["Module.model.LlamaModel.forward.0", "Module.model.LlamaModel.forward.1"]
    # calls 2 and 3 are decode steps: one new token each
    assert counts["sampled"][roots[0]]["input_kwargs"]["input_ids"]["shape"] == [1, 1]
    with pytest.raises(MsprobeError, match="token_range"):
        PrecisionDebugger(dump_path=str(tmp_path / "bad")).start(model, token_range=[3, 1])


CHECKPOINTED = """
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build(reentrant):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return m


def batches():
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": i, "labels": i} for i in (torch.randint(0, 128, (2, 12), generator=g) for _ in range(2))]


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed(msprobe, reentrant):
    msprobe.check_training(build(reentrant), batches(), lambda o: o.loss,
                           lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False), target_autocast="bf16")
"""


def test_activation_checkpointing_reentrant_or_not_is_judged_forward_and_backward(pytester):
    """Gradient checkpointing as transformers enables it, reentrant (its segment's forward under no_grad,
    recomputed with grad in the backward) or not, in a bf16 AMP training loop: benign passes with every floating
    op captured, and a 2% fault on the backward of a linear of the recomputation (reentrant: the segment's only
    backward, before unseen: coverage 75.5% and such a fault could not fire) is named at step 1."""
    pytester.makepyfile(test_ckpt=CHECKPOINTED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "True")
    result.assert_outcomes(passed=1)
    cov = json.loads((pytester.path / "msprobe-out" / "test_ckpt.py_test_checkpointed_True" / "check0" / "target" /
                      "step1" / "rank" / "coverage.json").read_text())
    assert cov["share"] == 1.0, cov["uncaptured"]
    pytester.makefile(".yaml", faults="faults:\n  - {api: Functional.linear, call: 17, direction: backward, "
                                      "perturb: scale, value: 1.02, step: 1}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-inject=faults.yaml", "-k", "True")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at step 1: Functional.linear.17.backward (in Module."
                                 "model.layers.1.self_attn.v_proj.Linear.backward.1)*"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "False")
    result.assert_outcomes(passed=1)


def test_a_compiled_target_trains_and_decodes_through_the_gate(pytester):
    """``--msprobe-target-compile`` in ``msprobe.check_training``: the target's blocks compiled regionally, as
    ``msprobe.check`` compiles them, every step captured at L0 and each compiled region judged whole against its
    eager self, forward and backward: a benign bf16 run over three AdamW steps passes; a fault inside a compiled
    region cannot be reached and says so (it proves nothing); one outside the regions (the LM head's linear) is
    named at its step. The decode loop compiles the same way (its KV cache copied for each isolated layer call)."""
    pytester.makepyfile(test_train=TRAIN)
    run = ("-p", "no:cacheprovider", "--msprobe-target-compile", "--msprobe-target-dtype=bf16", "-rA")
    result = pytester.runpytest_subprocess(*run, "-k", "not faulty")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "*test_train [[]check 0 step0[]]: 13 nodes compared (cpu/model-dtype vs cpu/bf16+compile, statistics, L0): "
        "pass 13*", "*note: cpu/bf16+compile: compiled with * (1 region(s)); every step captured at L0*"])
    records = json.loads(next(pytester.path.glob("msprobe-out/*test_train/check0/target/step1/rank/isolation.json"))
                         .read_text())["nodes"]
    layer = {k: r["status"] for k, r in records.items() if ".layers.0.LlamaDecoderLayer." in k}
    assert layer == {"Module.model.layers.0.LlamaDecoderLayer.forward.0": "pass",
                     "Module.model.layers.0.LlamaDecoderLayer.backward.0": "pass"}, layer  # the region, judged whole
    result.stdout.fnmatch_lines([
        "*test_generate [[]check 0 step0[]]: 6 nodes compared (cpu/model-dtype vs cpu/bf16+compile, statistics, L0): "
        "pass 6*", "*note: token agreement * 5/5*", "*note: cpu/bf16+compile: compiled with * (1 region(s))*",
        "*test_generate [[]check 0 step4[]]: 6 nodes compared (*L0): pass 6*"])
    assert "compile (--msprobe-target-compile) is honoured" not in result.stdout.str()
    pytester.makefile(".yaml", inside="faults:\n  - {api: Functional.silu, perturb: scale, value: 1.5, step: 1}\n",
                      head="faults:\n  - {api: Functional.linear, perturb: scale, value: 1.05, step: 1}\n")
    result = pytester.runpytest_subprocess(*run, "--msprobe-inject=inside.yaml", "-k", "test_train and not faulty and not generate")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: inside.yaml: fault Functional.silu (forward) was never applied: it ran "
                                 "inside a torch.compile region*"])
    result = pytester.runpytest_subprocess(*run, "--msprobe-inject=head.yaml", "-k", "test_train and not faulty and not generate")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at step 1: Module.lm_head.Linear.forward.0 *"])
    result = pytester.runpytest_subprocess(*run, "--msprobe-inject=head.yaml", "-k", "test_generate and not faulty")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: first divergence at step 1 (decode token 1): "
                                 "Module.lm_head.Linear.forward.0 *"])
