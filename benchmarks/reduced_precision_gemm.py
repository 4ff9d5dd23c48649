"""How far a half-precision GEMM is from its fp32-accumulated, once-rounded bench, with and without cuBLAS's
reduced-precision reduction (issue 51: the benign GPU run named GPT-2's tied LM head backward, K = 50,257).

The three GEMMs of GPT-2 small's LM head at 1 x 1024 tokens (logits: K = 768; the input gradient: K = 50,257; the
weight gradient: K = 1,024), on realistic operands (a cross-entropy gradient: softmax minus one-hot over the
tokens), each computed in the target dtype on the device with
``torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction`` on (PyTorch's default) and off, against
the float64 product; the ``upcast`` bench is the float32 product (TF32 off) rounded once to the target dtype.
Printed per GEMM: mean and max relative error of the target and of the bench, and their ratio (the benchmark
standard's mean ratio, which must stay <= 2).

    python benchmarks/reduced_precision_gemm.py [--device cuda] [--dtype bf16]
"""

from __future__ import annotations

import argparse

import torch


def _errors(value: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(mean, max) relative error of ``value`` against ``ref`` over the elements with |ref| above the dtype's
    small-value floor (the benchmark standard's mask: 1e-3 of the largest |ref|)."""
    ref = ref.double()
    err = (value.double() - ref).abs()
    mask = ref.abs() > 1e-3 * ref.abs().max()
    rel = err[mask] / ref.abs()[mask]
    return rel.mean().item(), rel.max().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gen = torch.Generator(args.device).manual_seed(3)
    n, d, v = args.tokens, 768, 50257
    w = (torch.randn(v, d, device=args.device, generator=gen) * 0.02).to(dt)
    x = torch.randn(n, d, device=args.device, generator=gen).to(dt)
    logits = torch.randn(n, v, device=args.device, generator=gen) * 0.5
    labels = torch.randint(0, v, (n,), device=args.device, generator=gen)
    g = torch.softmax(logits, -1)
    g[torch.arange(n), labels] -= 1
    g = (g / n).to(dt)
    gemms = {"logits x @ W^T (K=768)": (x, w.t()), "grad input g @ W (K=50257)": (g, w),
             "grad weight g^T @ x (K=1024)": (g.t(), x)}
    torch.backends.cuda.matmul.allow_tf32 = False
    flag = f"allow_{args.dtype}_reduced_precision_reduction"
    print(f"{args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}), "
          f"torch {torch.__version__}, {args.dtype}")
    print(f"{'GEMM':<30} {'reduced-precision reduction':<28} {'target mean/max rel err':>26} "
          f"{'upcast bench mean/max':>24} {'mean ratio':>10}")
    for name, (a, b) in gemms.items():
        ref = a.double() @ b.double()
        bench = (a.float() @ b.float()).to(dt)
        be = _errors(bench, ref)
        for on in (True, False):
            if args.device.startswith("cuda"):
                setattr(torch.backends.cuda.matmul, flag, on)
            target = a @ b
            te = _errors(target, ref)
            print(f"{name:<30} {'on (default)' if on else 'off':<28} {te[0]:12.3e} / {te[1]:10.3e} "
                  f"{be[0]:11.3e} / {be[1]:10.3e} {te[0] / be[0]:10.2f}", flush=True)
        setattr(torch.backends.cuda.matmul, flag, True)


if __name__ == "__main__":
    main()
