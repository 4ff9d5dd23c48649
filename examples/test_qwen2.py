"""A Qwen2-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) under the msprobe gate."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def build_qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return Qwen2ForCausalLM(config).eval()


def test_qwen2_forward(msprobe, token_batch):
    msprobe.check(build_qwen2(), {"input_ids": token_batch})


def test_qwen2_forward_backward(msprobe, token_batch):
    msprobe.check(build_qwen2(), {"input_ids": token_batch, "labels": token_batch},
                  loss_fn=lambda out: out.loss)
