"""Loop gates on a Llama-style decoder: a short AdamW training run and a KV-cache generation, step by step.

Run with the main job's options (bf16 target vs fp32 bench): every training step and every decode step is judged
with isolated verdicts, and a failure names the first diverging step and API. Add ``--msprobe-monitor`` to also
watch activations, gradients and optimizer states for NaN/Inf and sudden jumps (monitor.png in the artifacts).
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def batches(n: int = 3) -> list[dict]:
    """``n`` language-modelling batches: input_ids and labels of shape (2, 16), int64."""
    g = torch.Generator().manual_seed(7)
    return [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 256, (2, 16), generator=g)
                                                         for _ in range(n))]


def test_llama_training_steps(msprobe):
    msprobe.check_training(build_llama(), batches(), lambda out: out.loss,
                           lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False))


def test_llama_generation_steps(msprobe, token_batch):
    msprobe.check_generate(build_llama().eval(), token_batch[:1, :8], max_new_tokens=4)


def test_llama_own_training_loop_monitored(msprobe):
    """No bench needed: the test's own loop under the training monitor."""
    model = build_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with msprobe.monitor(model, opt) as mon:
        for batch in batches(6):
            loss = model(**batch).loss
            loss.backward()
            mon.record_loss(loss)
            opt.step()
            opt.zero_grad()
    assert mon.report.steps == 6
