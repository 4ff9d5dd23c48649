"""Which real CPU kernels differ from torch's own in the last bits: the measurement behind the ``decomposed`` bench
kernel (msprobe_ci.kernels).

For each candidate (another intra-op thread count, oneDNN off, PyTorch's Python decompositions, and the
``decomposed`` kernel itself: decompositions with oneDNN off) and each dtype, prints the share of output elements
that differ bit-wise from the default kernel, per op (forward, and the backward of the fused ones).

    python benchmarks/bench_kernels.py [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import warnings

import torch
import torch.nn.functional as F

from msprobe_ci import kernels

warnings.filterwarnings("ignore")


def _cases(dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    x, w, b = r(4, 64, 64), r(128, 64), r(128)
    q, k, v = r(2, 4, 32, 32), r(2, 4, 32, 32), r(2, 4, 32, 32)
    img, cw = r(4, 16, 16, 16), r(32, 16, 3, 3)
    gw, gb, up = r(64), r(64), r(4, 64, 64)
    labels = torch.randint(0, 64, (256,), generator=g)

    def grad(fn, *inputs):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        g_out = up.flatten()[:out.numel()].reshape(out.shape)  # the same incoming gradient every time
        return torch.cat([t.flatten() for t in torch.autograd.grad(out, leaves, g_out)])
    return {
        "linear": lambda: F.linear(x, w, b),
        "bmm": lambda: torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)),
        "softmax": lambda: F.softmax(x, -1),
        "layer_norm": lambda: F.layer_norm(x, (64,), gw, gb),
        "gelu": lambda: F.gelu(x),
        "silu": lambda: F.silu(x),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "conv2d": lambda: F.conv2d(img, cw, padding=1),
        "sum": lambda: x.sum(-1),
        "cross_entropy": lambda: F.cross_entropy(x.reshape(-1, 64), labels),
        "layer_norm backward": lambda: grad(lambda a, c, d: F.layer_norm(a, (64,), c, d), x, gw, gb),
        "softmax backward": lambda: grad(lambda a: F.softmax(a, -1), x),
        "sdpa backward": lambda: grad(lambda a, c, d: F.scaled_dot_product_attention(a, c, d), q, k, v),
    }


def _threads(n: int):
    @contextlib.contextmanager
    def ctx():
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(old)
    return ctx


@contextlib.contextmanager
def _onednn_off():
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2, help="the other intra-op thread count (default 2)")
    args = ap.parse_args()
    candidates = {f"{args.threads} threads": _threads(args.threads), "oneDNN off": _onednn_off,
                  "decompositions": kernels.Decomposed, "decomposed kernel": kernels.decomposed}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cases = _cases(dtype)
        with _threads(1)():
            base = {name: fn() for name, fn in cases.items()}
        print(f"{str(dtype).replace('torch.', '')}: share of elements that differ from torch's own kernel (1 thread)")
        print(f"  {'op':<22}" + "".join(f"{c:>20}" for c in candidates))
        for name, fn in cases.items():
            row = []
            for ctx in candidates.values():
                with _threads(1)() if "threads" not in str(ctx) else contextlib.nullcontext(), ctx():
                    out = fn()
                row.append(float((out != base[name]).float().mean()))
            print(f"  {name:<22}" + "".join(f"{v:>20.3f}" for v in row))


if __name__ == "__main__":
    main()
