"""Users' own training loops, dumped as a user dumps them and compared as a user compares them: stock transformers
models built from a config (no download), an AdamW loop of ``--steps`` steps with fresh batches, every step dumped by
``msprobe_ci.PrecisionDebugger`` (``start(model)`` before the forward, ``stop(); step()`` after the optimizer) on an
fp32 bench loop and on the target loop, then ``msprobe-ci compare -tp target -gp bench`` over all steps.

    python benchmarks/own_loops.py [--models gpt2,llama,bert,qwen2,t5] [--setups bf16:device:L0,fp16:upcast:L0]
                                   [--seeds 1] [--steps 3] [--fault API:CALL:DIRECTION:SCALE] [--pad]

Any model of ``unseen_architectures.py`` runs too (``--models gpt_oss,mamba,swin``), on its own kind of inputs.
A setup is ``target:bench kernel:level``; the target is ``bf16``/``fp16`` (the fp32 model under ``torch.autocast``;
fp16 with a ``GradScaler``) or ``model-bf16``/``model-fp16`` (the model cast). ``--accumulate 2`` runs two
micro-batches per step; ``--checkpointing`` turns on the model's non-reentrant activation checkpointing.
``--pad`` pads the second sequence of each text batch as a tokenizer does (``attention_mask``; a boolean mask
at SDPA). ``--compile`` compiles each decoder block (``Module.compile``) on both sides (GPT-2, Llama, Qwen2).
``--fault`` injects one scale fault into the target at step 1 (``PrecisionDebugger(inject=...)``), for each model
whose run has that call; the row then says which node the compare names first at step 1.

Prints one row per model and setup: the nodes per step, the steps with an error, the first divergence of each
failing step. A benign row must have no failing step; a fault row must name the faulty call (or at L0 the innermost
module around it) first at step 1 and fail at no other step.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
VOCAB = 256


def build(name: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0, embd_pdrop=0,
            attn_pdrop=0))
    if name in ("llama", "qwen2"):
        cls = transformers.LlamaConfig if name == "llama" else transformers.Qwen2Config
        cfg = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
        cfg._attn_implementation = "eager"
        return transformers.AutoModelForCausalLM.from_config(cfg)
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            hidden_dropout_prob=0, attention_probs_dropout_prob=0, max_position_embeddings=64))
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0))
    import unseen_architectures as ua

    if name in ua.MODELS + ua.MORE + ua.FURTHER:
        return ua.build(name, seed)[0]
    known = ", ".join(ua.MODELS + ua.MORE + ua.FURTHER)
    raise SystemExit(f"unknown model {name!r}: gpt2, llama, qwen2, bert, t5, {known}")


def batch(name: str, g: torch.Generator, pad: bool = False) -> dict:
    """A fresh batch of 2 x 24 tokens; ``pad``: the second sequence's last 8 are padding, as a tokenizer pads
    a batch (``attention_mask`` 0 there, labels -100), which transformers hands SDPA as a boolean mask."""
    import unseen_architectures as ua

    if name in ua.MODELS + ua.MORE + ua.FURTHER:  # its own inputs at a fresh seed (images, audio, CTC labels)
        with torch.random.fork_rng():  # building re-seeds the global generator: the loop's dropout keeps its own
            return ua.build(name, int(torch.randint(0, 2 ** 16, (1,), generator=g)))[1][0]
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        ids[1, 16:], mask[1, 16:] = 0, 0
    extra = {"attention_mask": mask} if pad else {}
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (2, 12), generator=g), **extra}
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), **extra}


def loop(folder: str, name: str, seed: int, target: str | None, kernel: str, level: str, steps: int,
         accumulate: int, checkpointing: bool, faults: list, compiled: bool = False, pad: bool = False) -> None:
    """One user's loop: ``target`` None is the fp32 bench loop."""
    from msprobe_ci import PrecisionDebugger

    model = build(name, seed).train()
    if compiled:
        blocks = getattr(getattr(model, "transformer", None), "h", None) or \
            getattr(getattr(model, "model", None), "layers", None)
        if blocks is None:
            raise SystemExit(f"--compile: {name} has no transformer.h or model.layers")
        for block in blocks:
            block.compile()
    if target in ("model-bf16", "model-fp16"):
        model = model.to(torch.bfloat16 if target == "model-bf16" else torch.float16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    autocast = target in ("bf16", "fp16")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if target == "fp16" else None
    debugger = PrecisionDebugger(dump_path=folder, level=level, bench_kernel=kernel, inject=faults)
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        debugger.start(model)
        for _ in range(accumulate):
            inputs = batch(name, g, pad)
            if target in ("model-bf16", "model-fp16"):  # images and audio in the model's dtype, as its user feeds it
                inputs = {k: v.to(model.dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                          for k, v in inputs.items()}
            with torch.autocast("cpu", dtype=torch.float16 if target == "fp16" else torch.bfloat16,
                                enabled=autocast):
                loss = model(**inputs).loss / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()


_LINE = re.compile(r"compare_result_step(\d+)_rank\d+_\d+\.csv: (\d+) nodes, pass \d+, warning \d+, error (\d+), "
                   r"unmatched \d+.*?; first divergence: (\S+)")


def compare(target: str, bench: str, out: str) -> list[tuple[int, int, int, str]]:
    """``msprobe-ci compare`` over every step: ``[(step, nodes, errors, first divergence)]``."""
    proc = subprocess.run([sys.executable, "-m", "msprobe_ci.cli", "compare", "-tp", target, "-gp", bench, "-o", out],
                          capture_output=True, text=True)
    rows = [(int(m[1]), int(m[2]), int(m[3]), m[4].rstrip(":")) for m in _LINE.finditer(proc.stdout)]
    if not rows:
        raise SystemExit(f"msprobe-ci compare printed no step:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return sorted(rows)


def main() -> None:
    import warnings

    from msprobe_ci.capture.inject import Fault

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,llama,bert,qwen2,t5")
    ap.add_argument("--setups", default="bf16:device:L0,fp16:upcast:L0,bf16:upcast:mix")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--fault", default=None)
    ap.add_argument("--pad", action="store_true", help="pad the second sequence of each text batch (attention_mask)")
    args = ap.parse_args()
    faults = []
    if args.fault:
        api, call, direction, scale = args.fault.split(":")
        faults = [Fault(api, int(call), direction, "scale", float(scale), step=1)]
    print(f"own loops: {args.steps} steps of AdamW, accumulate {args.accumulate}, checkpointing "
          f"{args.checkpointing}, compiled blocks {args.compile}, padded {args.pad}, fault {args.fault or 'none'}; "
          "compared by msprobe-ci compare")
    print(f"{'model':<7} {'setup':<22} {'seed':>4} {'nodes':>6} {'failing steps':>13}  first divergences")
    failing_rows = 0
    for setup in args.setups.split(","):
        target, kernel, level = setup.split(":")
        for name in args.models.split(","):
            for seed in range(args.seeds):
                with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for side, dtype, inject in (("bench", None, []), ("target", target, faults)):
                        loop(os.path.join(tmp, side), name, seed, dtype, kernel, level, args.steps,
                             args.accumulate, args.checkpointing, inject, args.compile, args.pad)
                    if faults and any("never applied" in str(w.message) for w in caught):
                        print(f"{name:<7} {setup:<22} {seed:>4}  (the fault's call does not run in this model)")
                        continue
                    rows = compare(os.path.join(tmp, "target"), os.path.join(tmp, "bench"), os.path.join(tmp, "out"))
                bad = [(s, first) for s, _, errors, first in rows if errors]
                failing_rows += bool(bad) if not faults else [s for s, _ in bad] != [1]
                print(f"{name:<7} {setup:<22} {seed:>4} {rows[0][1]:>6} {len(bad):>13}  "
                      + ("; ".join(f"step {s}: {first}" for s, first in bad) or "-"), flush=True)
    print(f"rows off their expectation: {failing_rows}")


if __name__ == "__main__":
    main()
