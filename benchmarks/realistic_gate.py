"""The isolated gate on stock decoders and encoders at a realistic sequence length: 2 layers, hidden 256, 4 x 512
tokens whose last 112 positions are padding (labels -100 there, and masked by the ``attention_mask`` a tokenizer
returns: transformers hands SDPA a boolean mask for it; ``--no-mask`` leaves it out), forward+backward, a bf16 or fp16 model against an
fp32 bench on this CPU, statistics, mix; a benign run, or one with a scale fault.

    python benchmarks/realistic_gate.py [--model bert|llama|gpt2] [--dtype bf16|fp16] [--bench-kernel upcast]
                                        [--threads 2] [--fault API:CALL:DIRECTION:SCALE] [--no-mask]

Where the grids' 2 x 16 tokens repeat a token a few times, 2,048 positions repeat one token type and one padding
token each: what the CPU half embedding backward sums in its dtype (``kernels.IN_ORDER``), and 8 query blocks of
the CPU flash attention backward (``kernels.attention._block_sum_errors``). Llama: grouped-query attention,
RMSNorm, rotary embeddings. Prints the API testcases failing (the first five with their messages), the failing
model-level cases, the first divergence and the wall time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate_quality as gq  # noqa: E402

from msprobe_ci.capture.inject import Fault  # noqa: E402

warnings.filterwarnings("ignore")


def _model(name: str):
    """A stock config of ``name``, 2 layers, hidden 256, 512 positions, vocabulary 8,000 (no weights downloaded)."""
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=8000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
            hidden_dropout_prob=0, attention_probs_dropout_prob=0, max_position_embeddings=512)).eval()
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=8000, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=512)).eval()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=8000, n_embd=256, n_layer=2, n_head=4, n_positions=512, resid_pdrop=0, embd_pdrop=0,
        attn_pdrop=0)).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert", choices=("bert", "llama", "gpt2"))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--bench-kernel", default="upcast")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fault", default=None, help="API:CALL:DIRECTION:SCALE, e.g. Functional.linear:3:forward:1.01")
    ap.add_argument("--no-mask", action="store_true", help="no attention_mask: the padding attended to")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gq.ISOLATOR.update(bench_kernel=args.bench_kernel)
    torch.manual_seed(3)
    model = _model(args.model)
    ids = torch.randint(5, 8000, (4, 512), generator=torch.Generator().manual_seed(4))
    ids[:, 400:] = 0  # padding: the pad token (BERT's embedding row for it a padding_idx)
    labels = ids.clone()
    labels[:, 400:] = -100
    inputs = {"input_ids": ids, "labels": labels}
    if not args.no_mask:
        inputs["attention_mask"] = (ids != 0).long()
    faults = ()
    if args.fault:
        api, call, direction, scale = args.fault.split(":")
        faults = (Fault(api, int(call), direction, "scale", float(scale)),)
    bench_dtype, target_dtype, _ = gq.DTYPES[args.dtype]
    t0 = time.time()
    rep, cases, _, _, _ = gq._one(model, (inputs,), lambda o: o.loss, bench_dtype,
                                  target_dtype, faults)
    bad = [n for n in rep.nodes if n.status == "error" and not n.name.startswith("Module.")]
    first = rep.first_divergence
    print(f"{args.model} {args.dtype} vs fp32, {args.bench_kernel}, {'no mask' if args.no_mask else 'padding masked'}, fault {args.fault}: {len(bad)} API testcases failing; model "
          f"cases failing {[c['name'] for c in cases if c['status'] == 'error']}; first divergence "
          f"{first.name if first is not None else None}; {time.time() - t0:.0f} s")
    for n in bad[:5]:
        print("   ", n.message[:300])


if __name__ == "__main__":
    main()
