"""How far torch's CPU bf16/fp16 LayerNorm backward lands from the exact gradient, as rows are summed.

The CPU kernel keeps its per-thread weight- and bias-gradient sums in the tensor's own dtype
(aten/src/ATen/native/cpu/layer_norm_kernel.cpp), so the error of dgamma and dbeta grows with the number of rows
summed, where a kernel accumulating in fp32 stays at one rounding. Printed per dtype and row count: each gradient's
error over the dtype's unit roundoff times the random walk of its terms (sqrt(sum_rows term^2), the size of one
rounding per term), worst column and mean over columns; and the same for a kernel that sums in fp32 and rounds once.

    python benchmarks/cpu_layernorm_backward.py [--hidden 64]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    h = args.hidden
    print(f"{'dtype':<9} {'rows':>6} {'dgamma worst':>13} {'dgamma mean':>12} {'dbeta worst':>12} {'dbeta mean':>11}"
          f" {'fp32-sum dbeta worst':>21}")
    for dtype, u in UNIT.items():
        for rows in (8, 32, 128, 512, 2048):
            g = torch.Generator().manual_seed(rows)
            x, dy = (torch.randn(rows, h, generator=g).to(dtype) for _ in range(2))
            w, b = (torch.randn(h, generator=g).to(dtype) for _ in range(2))

            def grads(dt):
                leaves = [t.detach().to(dt, copy=True).requires_grad_(True) for t in (x, w, b)]
                out = F.layer_norm(leaves[0], (h,), leaves[1], leaves[2])
                return torch.autograd.grad(out, leaves, dy.to(dt))
            got, exact = [[t.detach() for t in gs] for gs in (grads(dtype), grads(torch.float64))]
            xd = x.double()
            xhat = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5)
            walk_g = ((dy.double() * xhat) ** 2).sum(0).sqrt()
            walk_b = (dy.double() ** 2).sum(0).sqrt()
            eg = (got[1].double() - exact[1]).abs() / (u * walk_g)
            eb = (got[2].double() - exact[2]).abs() / (u * walk_b)
            fp32_sum = dy.float().sum(0).to(dtype).double()  # what an fp32-accumulating kernel gives
            ef = (fp32_sum - exact[2]).abs() / (u * walk_b)
            print(f"{str(dtype).replace('torch.', ''):<9} {rows:>6} {float(eg.max()):>13.2f} {float(eg.mean()):>12.2f} "
                  f"{float(eb.max()):>12.2f} {float(eb.mean()):>11.2f} {float(ef.max()):>21.2f}")


if __name__ == "__main__":
    main()
