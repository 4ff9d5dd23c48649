"""The coverage figure on stock transformers configs: the share of floating-point work (output elements of
floating ATen ops, forward and backward) that ran inside a captured API, the uncaptured ops, and what counting it
costs (capture with and without coverage, interleaved, one thread).

    python benchmarks/coverage.py [--models mixtral,qwen2_moe,...,gpt2_small] [--dtypes bf16,fp32] [--isolate]
                                  [--rounds 3] [--threads 1] [--uncapture _grouped_mm]

Prints one line per model and dtype: the share, the uncaptured ops (op, pass, calls), the number of ATen calls
excluded as data movement, and the median capture time with coverage over without.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gate_quality as gq  # noqa: E402
import moe_gate  # noqa: E402
import unseen_architectures as ua  # noqa: E402

from msprobe_ci.capture import CaptureSession  # noqa: E402
from msprobe_ci.config import DumpConfig  # noqa: E402
from msprobe_ci.isolate import Isolator  # noqa: E402

warnings.filterwarnings("ignore")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _whisper(seed: int):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.WhisperConfig(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32,
                                     max_target_positions=32, pad_token_id=0, decoder_start_token_id=1)
    feats = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(seed))
    labels = torch.randint(2, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    return (transformers.WhisperForConditionalGeneration(cfg).eval(),
            ({"input_features": feats, "labels": labels},), lambda o: o.loss)


def _gpt2_small(seed: int):
    """Stock GPT-2 small (124M, its default config, no weights downloaded), 1x1024 tokens."""
    import transformers

    torch.manual_seed(seed)
    ids = torch.randint(0, 50257, (1, 1024), generator=torch.Generator().manual_seed(seed))
    return (transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval(), ({"input_ids": ids, "labels": ids},),
            lambda o: o.loss)


BUILDERS = {"mixtral": lambda s: moe_gate.build("mixtral", s), "qwen2_moe": lambda s: moe_gate.build("qwen2_moe", s),
            "llama": lambda s: gq.case("llama", s), "gpt2": lambda s: gq.case("gpt2", s),
            "bert": lambda s: gq.case("bert", s), "t5": lambda s: gq.case("t5", s),
            "vit": lambda s: ua.build("vit", s), "whisper": _whisper, "gpt2_small": _gpt2_small}
DEFAULT = "mixtral,qwen2_moe,llama,gpt2,bert,t5,vit,whisper"


def run(model, inputs, loss_fn, dtype, isolate: bool, coverage: bool) -> tuple[dict | None, float]:
    """One forward+backward under capture (mix, statistics); returns coverage.json and the seconds it took."""
    m = model.to(dtype)
    kw = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs[0].items()}
    folder = tempfile.mkdtemp(prefix="cov-")
    cap = CaptureSession(DumpConfig(task="statistics", level="mix", dump_path=folder), coverage=coverage,
                         isolator=Isolator(backward=True) if isolate else None)
    t0 = time.perf_counter()
    cap.start(m)
    loss_fn(m(**kw)).backward()
    cap.stop()
    elapsed = time.perf_counter() - t0
    found = glob.glob(os.path.join(folder, "**", "coverage.json"), recursive=True)
    if not found:
        return None, elapsed
    with open(found[0]) as fh:
        return json.load(fh), elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=DEFAULT, help=f"of {','.join(BUILDERS)}")
    ap.add_argument("--uncapture", default="", help="private compute names to leave out of the capture (as before "
                                                    "they were captured), e.g. _grouped_mm")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--isolate", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.uncapture:
        from msprobe_ci.capture import naming

        naming.COMPUTE_PRIVATE = naming.COMPUTE_PRIVATE - set(args.uncapture.split(","))
        naming._TABLE = None
    for name in args.models.split(","):
        for dname in args.dtypes.split(","):
            model, inputs, loss_fn = BUILDERS[name](7)
            cov, _ = run(model, inputs, loss_fn, DTYPES[dname], args.isolate, True)
            times: dict[bool, list] = {True: [], False: []}
            for _ in range(args.rounds):
                for on in (False, True):
                    times[on].append(run(model, inputs, loss_fn, DTYPES[dname], args.isolate, on)[1])
            ratio = statistics.median(times[True]) / statistics.median(times[False])
            unc = [(u["op"], u["pass"], u["calls"]) for u in cov["uncaptured"]]
            print(f"{name:<10} {dname}: coverage {100 * cov['share']:.2f}%  uncaptured {unc[:4]}  "
                  f"excluded {sum(cov['excluded'].values())} ATen calls  capture time with/without coverage "
                  f"{ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
