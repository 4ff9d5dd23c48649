"""Stock transformers architectures no gate table tunes to (OPT, BLOOM, Falcon, GPT-Neo, StableLM, Mixtral,
DistilBERT, ViT, Granite: its multipliers leave most unscaled fp16 gradients in fp16's subnormal range; and the
sets ``MORE`` and ``FURTHER``, :func:`_more` and :func:`_further`), isolated gate per bench kernel: benign bf16/fp16 runs against an fp32 bench, and the first four
faults ``gate_quality.py`` would pick for each run, each expected to be named exactly.

    python benchmarks/unseen_architectures.py [--models opt,bloom,...] [--kernels upcast,rounded,decomposed]
                                              [--dtypes bf16,fp16,amp-bf16,amp-fp16] [--anchor]
                                              [--level mix|L0] [--faults 4] [--seeds 7,8]

At ``--level L0`` every module is isolated whole and a fault is expected at the innermost module around its call
(as ``gate_quality.py --level L0``).

Prints one line per kernel, model, dtype and seed (``--seeds``, 7 and 8 by default): the API and module testcases failing in the benign run
(the first two), failing model-level testcases, and how many faults were named exactly.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate_quality as gq  # noqa: E402

warnings.filterwarnings("ignore")
MODELS = ("opt", "bloom", "falcon", "gpt_neo", "stablelm", "mixtral", "distilbert", "vit", "granite")
MORE = ("gptj", "deberta_v2", "modernbert", "mamba", "deepseek_v3", "gpt_oss", "recurrent_gemma", "convnext",
        "swin", "efficientnet", "wav2vec2")
FURTHER = ("gemma2", "qwen2_moe", "mamba2", "bitnet", "lfm2", "qwen3_next", "whisper", "clip", "mobilenet_v2",
           "fnet", "levit", "bart")


def ids(seed: int, n: int = 16) -> torch.Tensor:
    return torch.randint(3, 256, (2, n), generator=torch.Generator().manual_seed(seed))


def build(kind: str, seed: int):
    """``(model, inputs, loss_fn)`` of a stock config, 2 layers, hidden 64 (no weights downloaded)."""
    import transformers

    torch.manual_seed(seed)
    small = dict(vocab_size=256, max_position_embeddings=64)
    decoder = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if kind == "opt":
        cfg = transformers.OPTConfig(**decoder, **small, ffn_dim=128, word_embed_proj_dim=64)
    elif kind == "bloom":
        cfg = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=256)
    elif kind == "falcon":
        cfg = transformers.FalconConfig(**decoder, vocab_size=256)
    elif kind == "gpt_neo":
        cfg = transformers.GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, **small,
                                        attention_types=[[["global", "local"], 1]])
    elif kind == "stablelm":
        cfg = transformers.StableLmConfig(**decoder, **small, intermediate_size=128, num_key_value_heads=2)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**decoder, **small, intermediate_size=128, num_key_value_heads=2,
                                         num_local_experts=4, num_experts_per_tok=2)
    elif kind == "granite":  # muP-style multipliers: unscaled fp16 gradients mostly in fp16's subnormal range
        cfg = transformers.GraniteConfig(**decoder, **small, intermediate_size=128, num_key_value_heads=2,
                                         embedding_multiplier=12.0, residual_multiplier=0.22,
                                         attention_multiplier=0.0078125, logits_scaling=8.0)
    elif kind == "distilbert":
        cfg = transformers.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0,
                                            attention_dropout=0.0, **small)
        x = ids(seed)
        return transformers.DistilBertForMaskedLM(cfg).eval(), ({"input_ids": x, "labels": x},), lambda o: o.loss
    elif kind == "vit":
        cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                     image_size=32, patch_size=8, num_labels=3)
        px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        return (transformers.ViTForImageClassification(cfg).eval(),
                ({"pixel_values": px, "labels": torch.tensor([0, 2])},), lambda o: o.loss)
    elif kind in MORE:
        return _more(kind, seed)
    elif kind in FURTHER:
        return _further(kind, seed)
    else:
        raise SystemExit(f"unknown model {kind!r}; known: {', '.join(MODELS + MORE + FURTHER)}")
    cfg._attn_implementation = "eager"
    x = ids(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval(), ({"input_ids": x, "labels": x},), \
        lambda o: o.loss


def _images(seed: int, size: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _more(kind: str, seed: int):
    """Architectures with kernels the first nine lack: partial rotary (GPT-J), disentangled attention (DeBERTa-v2),
    unpadded global/local attention (ModernBERT), selective scan (Mamba), MLA + routed experts (DeepSeek-V3),
    attention sinks + clamped SwiGLU experts (gpt-oss), RG-LRU recurrence (RecurrentGemma), depthwise conv +
    channels-last LayerNorm (ConvNeXt), shifted windows (Swin), depthwise conv + BatchNorm + squeeze-excite
    (EfficientNet), a conv feature encoder + GroupNorm + CTC loss (wav2vec 2.0)."""
    import transformers as t

    small = dict(vocab_size=256, max_position_embeddings=64)
    decoder = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    x = ids(seed)
    lm = ({"input_ids": x, "labels": x},)
    if kind == "gptj":
        cfg = t.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=256, n_positions=64)
    elif kind == "deberta_v2":
        cfg = t.DebertaV2Config(**decoder, **small, intermediate_size=128, relative_attention=True,
                                pos_att_type=["p2c", "c2p"], position_buckets=8, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0)
        torch.manual_seed(seed)
        return t.DebertaV2ForMaskedLM(cfg).eval(), lm, lambda o: o.loss
    elif kind == "modernbert":
        cfg = t.ModernBertConfig(**decoder, **small, intermediate_size=128, global_attn_every_n_layers=2,
                                 local_attention=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, sep_token_id=2,
                                 cls_token_id=1)
        torch.manual_seed(seed)
        return t.ModernBertForMaskedLM(cfg).eval(), lm, lambda o: o.loss
    elif kind == "mamba":
        cfg = t.MambaConfig(hidden_size=64, num_hidden_layers=2, state_size=8, vocab_size=256, expand=2,
                            use_mambapy=False)
    elif kind == "deepseek_v3":
        cfg = t.DeepseekV3Config(**decoder, **small, intermediate_size=128, moe_intermediate_size=32,
                                 n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                 first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4)
    elif kind == "gpt_oss":
        cfg = t.GptOssConfig(**decoder, **small, intermediate_size=64, num_key_value_heads=2, head_dim=16,
                             num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"])
    elif kind == "recurrent_gemma":
        cfg = t.RecurrentGemmaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=1, intermediate_size=128, lru_width=64,
                                     attention_window_size=8, vocab_size=256, conv1d_width=4,
                                     block_types=["recurrent", "recurrent", "attention"])
    elif kind in ("convnext", "swin", "efficientnet"):
        torch.manual_seed(seed)
        if kind == "convnext":
            cfg = t.ConvNextConfig(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                   patch_size=4, image_size=32, num_labels=3)
            model = t.ConvNextForImageClassification(cfg)
        elif kind == "swin":
            cfg = t.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 1], num_heads=[2, 4],
                               window_size=4, num_labels=3)
            model = t.SwinForImageClassification(cfg)
        else:
            cfg = t.EfficientNetConfig(image_size=32, width_coefficient=0.25, depth_coefficient=0.25,
                                       hidden_dim=320, num_labels=3)
            model = t.EfficientNetForImageClassification(cfg)
        return model.eval(), ({"pixel_values": _images(seed), "labels": torch.tensor([0, 2])},), lambda o: o.loss
    else:  # wav2vec2
        torch.manual_seed(seed)
        cfg = t.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                               conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=16,
                               ctc_loss_reduction="mean", pad_token_id=0)
        audio = torch.randn(2, 800, generator=torch.Generator().manual_seed(seed))
        labels = torch.randint(1, 16, (2, 6), generator=torch.Generator().manual_seed(seed))
        return t.Wav2Vec2ForCTC(cfg).eval(), ({"input_values": audio, "labels": labels},), lambda o: o.loss
    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    return t.AutoModelForCausalLM.from_config(cfg).eval(), lm, lambda o: o.loss


def _further(kind: str, seed: int):
    """A third set: attention and final-logit soft-capping (Gemma 2), a shared expert behind a sigmoid gate
    (Qwen2-MoE), the chunked state-space scan (Mamba-2), ternary weights and 8-bit activations rounded inside the
    forward (BitNet), short gated convolutions (LFM2), gated delta-rule linear attention (Qwen3-Next), a conv1d
    audio encoder with cross-attention (Whisper), a contrastive loss over two towers (CLIP), ReLU6 inverted
    residuals (MobileNetV2), Fourier mixing in complex numbers (FNet), attention with BatchNorm and hardswish
    (LeViT), a denoising encoder-decoder (BART)."""
    import transformers as t

    small = dict(vocab_size=256, max_position_embeddings=64)
    decoder = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    x = ids(seed)
    lm = ({"input_ids": x, "labels": x},)
    torch.manual_seed(seed)
    labels = {"labels": torch.tensor([0, 2])}
    if kind == "gemma2":
        cfg = t.Gemma2Config(**decoder, **small, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                             sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    elif kind == "qwen2_moe":
        cfg = t.Qwen2MoeConfig(**decoder, **small, intermediate_size=128, num_key_value_heads=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                               num_experts_per_tok=2)
    elif kind == "mamba2":
        cfg = t.Mamba2Config(hidden_size=64, num_hidden_layers=2, state_size=8, vocab_size=256, expand=2,
                             num_heads=8, head_dim=16, n_groups=1, chunk_size=8)
    elif kind == "bitnet":
        cfg = t.BitNetConfig(**decoder, **small, intermediate_size=128, num_key_value_heads=2, bos_token_id=1,
                             eos_token_id=2)
    elif kind == "lfm2":
        cfg = t.Lfm2Config(**decoder, **small, intermediate_size=128, num_key_value_heads=2,
                           layer_types=["conv", "full_attention"])
    elif kind == "qwen3_next":
        cfg = t.Qwen3NextConfig(**decoder, **small, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                linear_value_head_dim=16, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                layer_types=["linear_attention", "full_attention"])
    elif kind == "whisper":
        cfg = t.WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                              max_source_positions=16, max_target_positions=32, vocab_size=256, pad_token_id=0,
                              decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)
        mel = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed))
        return (t.WhisperForConditionalGeneration(cfg).eval(), ({"input_features": mel, "labels": x},),
                lambda o: o.loss)
    elif kind == "clip":
        tower = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
        cfg = t.CLIPConfig(text_config=dict(**tower, vocab_size=256, max_position_embeddings=32),
                           vision_config=dict(**tower, image_size=32, patch_size=8), projection_dim=16)
        return (t.CLIPModel(cfg).eval(), ({"input_ids": x, "pixel_values": _images(seed), "return_loss": True},),
                lambda o: o.loss)
    elif kind == "mobilenet_v2":
        cfg = t.MobileNetV2Config(image_size=32, depth_multiplier=0.25, num_labels=3)
        return (t.MobileNetV2ForImageClassification(cfg).eval(), ({"pixel_values": _images(seed), **labels},),
                lambda o: o.loss)
    elif kind == "fnet":
        cfg = t.FNetConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128, **small,
                           use_tpu_fourier_optimizations=False)
        return t.FNetForMaskedLM(cfg).eval(), lm, lambda o: o.loss
    elif kind == "levit":
        cfg = t.LevitConfig(image_size=32, patch_size=16, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2],
                            depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=3)
        return (t.LevitForImageClassification(cfg).eval(), ({"pixel_values": _images(seed), **labels},),
                lambda o: o.loss)
    else:  # bart
        cfg = t.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, **small)
        return t.BartForConditionalGeneration(cfg).eval(), lm, lambda o: o.loss
    cfg._attn_implementation = "eager"
    return t.AutoModelForCausalLM.from_config(cfg).eval(), lm, lambda o: o.loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--kernels", default="upcast,rounded,decomposed")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--anchor", action="store_true",
                    help="faults at the anchor's level (gate_quality.py --anchor: 1%% at bf16/fp16, 0.1%% at fp32)")
    ap.add_argument("--level", default="mix", choices=("mix", "L0"))
    ap.add_argument("--faults", type=int, default=4, help="faults per run (0: benign runs only)")
    ap.add_argument("--seeds", default="7,8", help="comma-separated seeds (the model's weights and inputs)")
    args = ap.parse_args()
    gq.LEVEL = args.level
    if args.anchor:
        gq.anchor_faults()
    torch.set_num_threads(1)
    for kernel in args.kernels.split(","):
        gq.ISOLATOR.update(bench_kernel=kernel)
        for kind in args.models.split(","):
            for dname in args.dtypes.split(","):
                bench_dtype, target_dtype, scales = gq.DTYPES[dname]
                for seed in [int(v) for v in args.seeds.split(",")]:
                    model, inputs, loss_fn = build(kind, seed)
                    report, cases, tdump, _, _ = gq._one(model, inputs, loss_fn, bench_dtype, target_dtype, ())
                    errors = [n.name for n in report.nodes if n.status == "error"]
                    bad = [c["name"] for c in cases if c["status"] == "error"]
                    exact = total = 0
                    misses = []
                    ref = tdump
                    if args.level == "L0" and args.faults:  # faults are picked from an API-level dump
                        ref = gq._one(model, inputs, loss_fn, bench_dtype, target_dtype, (), level="mix")[2]
                    picked = gq._pick_faults(ref.data, scales, seed, gq.NOISE[dname]) if args.faults else []
                    for node, fault in picked[:args.faults]:
                        if args.level == "L0":  # the innermost module around the faulty call
                            node = ref.construct.get(node)
                            if node is None:
                                continue
                        rep, _, _, _, unapplied = gq._one(model, inputs, loss_fn, bench_dtype, target_dtype,
                                                          (fault,))
                        if unapplied:
                            continue
                        total += 1
                        first = rep.first_divergence  # a failing CompareResult is falsy: compare it with None
                        if first is not None and first.name == node:
                            exact += 1
                        else:
                            floor = gq.under_floor(ref.data.get(node), fault)  # a kernel's own error
                            misses.append((node, first.name if first is not None else None)
                                          + (("under the dtype's floor",) if floor else ()))
                    print(f"{kernel:<10} {kind:<10} {dname} seed {seed}: benign errors {errors[:2]} {bad}  "
                          f"faults exact {exact}/{total} {misses[:2]}", flush=True)


if __name__ == "__main__":
    main()
