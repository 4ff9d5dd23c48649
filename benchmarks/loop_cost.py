"""Cost per step of the loop gates, measured side by side in one run on a stock transformers Llama (built from a
config, no download), one thread, bf16 target:

* training step (forward, backward, AdamW step): no capture; capture (mix, statistics); capture + isolated
  verdicts (what ``check_training`` runs on the target side); the training monitor alone (``TrainerMon``);
* decode step (one forward with the KV cache): no capture; capture; capture + isolation;
* forward: the free benchmark (capture + higher-precision and bit-noise reruns of every API) against no capture.

    python benchmarks/loop_cost.py [--layers 2] [--hidden 128] [--steps 6] [--rounds 3]

Prints the median ms per step of each mode and its ratio to the uncaptured step; modes are interleaved per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def build(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 4 // 2 * 2,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def train_steps(model, batches, *, capture=None, monitor=None) -> float:
    """Median ms per training step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    if monitor is not None:
        monitor.set_monitor(model, opt)
    times = []
    for ids in batches:
        t = time.perf_counter()
        if capture is not None:
            capture.start(model)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if monitor is not None:
            monitor.record_loss(loss)
        opt.step()
        opt.zero_grad()
        if capture is not None:
            capture.stop()
            capture.step()
        times.append(time.perf_counter() - t)
    if capture is not None:
        capture.close()
    if monitor is not None:
        monitor.close()
    return statistics.median(times) * 1e3


def decode_steps(model, prompt, n, *, capture=None) -> float:
    """Median ms per decode step (after the prefill)."""
    times, past, ids = [], None, prompt
    with torch.no_grad():
        for step in range(n + 1):
            t = time.perf_counter()
            if capture is not None:
                capture.start(model)
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            if capture is not None:
                capture.stop()
                capture.step()
            if step:
                times.append(time.perf_counter() - t)
            past, ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
    if capture is not None:
        capture.close()
    return statistics.median(times) * 1e3


def forward_ms(model, ids, capture=None) -> float:
    t = time.perf_counter()
    with torch.no_grad():
        if capture is not None:
            capture.start(model)
        model(input_ids=ids)
        if capture is not None:
            capture.stop()
            capture.close()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.free_benchmark import FreeBenchmark
    from msprobe_ci.isolate import Isolator
    from msprobe_ci.monitor import TrainerMon

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (2, 64), generator=g) for _ in range(args.steps)]
    prompt = batches[0][:1, :32]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        def cfg():
            return DumpConfig(dump_path=tempfile.mkdtemp(dir=tmp), level="mix", task="statistics")
        for _ in range(args.rounds):
            modes = {
                "train: no capture": lambda: train_steps(build(args.layers, args.hidden), batches),
                "train: capture": lambda: train_steps(build(args.layers, args.hidden), batches,
                                                      capture=CaptureSession(cfg())),
                "train: capture + isolation": lambda: train_steps(
                    build(args.layers, args.hidden), batches,
                    capture=CaptureSession(cfg(), isolator=Isolator(backward=True, bench_kernel="upcast"))),
                "train: monitor": lambda: train_steps(build(args.layers, args.hidden), batches,
                                                      monitor=TrainerMon(tempfile.mkdtemp(dir=tmp), plot=False)),
                "decode: no capture": lambda: decode_steps(build(args.layers, args.hidden).eval(), prompt,
                                                           args.steps),
                "decode: capture": lambda: decode_steps(build(args.layers, args.hidden).eval(), prompt, args.steps,
                                                        capture=CaptureSession(cfg())),
                "decode: capture + isolation": lambda: decode_steps(
                    build(args.layers, args.hidden).eval(), prompt, args.steps,
                    capture=CaptureSession(cfg(), isolator=Isolator(backward=False, bench_kernel="upcast"))),
                "forward: no capture": lambda: forward_ms(build(args.layers, args.hidden).eval(), batches[0]),
                "forward: free benchmark": lambda: forward_ms(
                    build(args.layers, args.hidden).eval(), batches[0],
                    CaptureSession(DumpConfig(dump_path=tempfile.mkdtemp(dir=tmp), level="L1", task="statistics"),
                                   free_bench=FreeBenchmark())),
            }
            for name, fn in modes.items():
                results.setdefault(name, []).append(fn())
    base = {k.split(":")[0]: statistics.median(v) for k, v in results.items() if k.endswith("no capture")}
    print(f"Llama bf16, {args.layers} layers, hidden {args.hidden}, batch 2x64 (decode: prompt 32), one thread, "
          f"{args.rounds} rounds; torch {torch.__version__}, {os.cpu_count()} cores")
    print(f"{'mode':<30} {'ms/step':>10} {'x no capture':>13}")
    for name, vals in results.items():
        med = statistics.median(vals)
        print(f"{name:<30} {med:>10.1f} {med / base[name.split(':')[0]]:>12.2f}x")


if __name__ == "__main__":
    main()
