"""A GPT-2-style decoder (LayerNorm, learned positions, fused qkv Conv1D, GELU) under the msprobe gate."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config).eval()


def test_gpt2_forward(msprobe, token_batch):
    msprobe.check(build_gpt2(), {"input_ids": token_batch})


def test_gpt2_forward_backward(msprobe, token_batch):
    msprobe.check(build_gpt2(), {"input_ids": token_batch, "labels": token_batch},
                  loss_fn=lambda out: out.loss)
