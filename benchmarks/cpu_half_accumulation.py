"""How far torch's CPU bf16/fp16 kernels that keep their sums in the tensor's own dtype land from the exact result.

LayerNorm backward: the CPU kernel keeps its per-thread weight- and bias-gradient sums in the tensor's own dtype
(aten/src/ATen/native/cpu/layer_norm_kernel.cpp), so the error of dgamma and dbeta grows with the number of rows
summed, where a kernel accumulating in fp32 stays at one rounding. Printed per dtype and row count: each gradient's
error over the dtype's unit roundoff times the random walk of its terms (sqrt(sum_rows term^2), the size of one
rounding per term), worst column and mean over columns; and the same for a kernel that sums in fp32 and rounds once.

Cross entropy (mean reduction): the CPU ``nll_loss`` keeps its cascade of partial sums in the tensor's dtype
(aten/src/ATen/native/LossNLL.cpp), where a GPU kernel accumulates in fp32. Printed per dtype and token count, over
``--draws`` random logit sets (vocabulary 256, logits N(0, 2)): the loss's relative error in units of the dtype's
unit roundoff (mean and worst), the share of draws beyond 2 units (the benchmark standard's mean/RMSE ratio 2
against a bench credited with one unit), and the same for log_softmax in the dtype followed by an fp32 sum.

The other kernels ``msprobe_ci.kernels.CPU_HALF_HELD`` names: the embedding backward (a token repeated ``n``
times: its gradient rows added one by one), the convolution backward, the max/avg pooling backward and col2im
(overlapping windows' gradients summed) and the batch norm in training mode. Printed
per dtype: the mean error over the output in units of one rounding of each element (``u * |exact|``), beside the
same for the exact result rounded once (about 0.36-0.43: a kernel that accumulates in fp32), and for the batch norm
the mean over the elements near their channel's mean (``|x| > 5 |x - mean|``), where a kernel that folds the mean
into its bias (``x * a + (b - mean * a)`` in the half dtype) is off by the size of its terms.

    python benchmarks/cpu_half_accumulation.py [--hidden 64] [--draws 200]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--draws", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _layer_norm(args.hidden)
    _cross_entropy(args.draws)
    _held_kernels()


def _units(got: torch.Tensor, exact: torch.Tensor, u: float, mask=None) -> float:
    """Mean of |got - exact| / (u |exact|) over the elements not within 1e-3 of the largest's zero."""
    keep = exact.abs() > exact.abs().max() * 1e-3
    if mask is not None:
        keep = keep & mask
    return float(((got.double() - exact).abs()[keep] / exact.abs()[keep]).mean()) / u


def _held_kernels() -> None:
    print("Other CPU half kernels, mean error in units of one rounding of each element (rounded once: the exact "
          "result rounded to the dtype)")
    print(f"{'dtype':<9} {'kernel':<40} {'CPU kernel':>10} {'rounded once':>13}")
    for dtype, u in UNIT.items():
        g = torch.Generator().manual_seed(0)
        rows = []
        for n in (16, 512):  # a token repeated n times: the embedding backward adds its rows in the half dtype
            grad = torch.randn(n, 64, generator=g).to(dtype)
            ids = torch.zeros(n, dtype=torch.long)
            got, exact = (torch.ops.aten.embedding_dense_backward(grad.to(d), ids, 4, -1, False)[0]
                          for d in (dtype, torch.float64))
            rows.append((f"embedding backward, {n} repeats", got, exact))
        x, w, gy = (torch.randn(*s, generator=g).to(dtype) for s in ((4, 8, 16, 16), (8, 8, 3, 3), (4, 8, 16, 16)))
        out = {}
        for d in (dtype, torch.float64):
            xx, ww = x.detach().to(d).requires_grad_(), w.detach().to(d).requires_grad_()
            F.conv2d(xx, ww, padding=1).backward(gy.to(d))
            out[d] = (xx.grad, ww.grad)
        rows += [("conv2d backward, input gradient", out[dtype][0], out[torch.float64][0]),
                 ("conv2d backward, weight gradient", out[dtype][1], out[torch.float64][1])]
        # overlapping windows: an input element's gradient is the sum over the windows it belongs to (for the max
        # pool, those it is the max of: judged over the elements that are, where the sum happens)
        xp = torch.randn(4, 8, 32, 32, generator=g).to(dtype)
        for label, fn, shape in (("max_pool2d k3 s1 backward, summed elems", lambda t: F.max_pool2d(t, 3, 1, 1),
                                  (4, 8, 32, 32)),
                                 ("avg_pool2d k3 s1 backward", lambda t: F.avg_pool2d(t, 3, 1, 1), (4, 8, 32, 32)),
                                 ("col2im (F.fold, unfold's backward)", None, (4, 72, 1024))):
            gy = torch.randn(*shape, generator=g).to(dtype)
            if fn is None:
                got, exact = (F.fold(gy.to(d), (32, 32), 3, padding=1) for d in (dtype, torch.float64))
            else:
                grads = []
                for d, gd in ((dtype, gy), (torch.float64, gy), (torch.float64, torch.ones(shape))):
                    xx = xp.detach().to(d).requires_grad_()
                    fn(xx).backward(gd.to(d))
                    grads.append(xx.grad)
                got, exact = grads[0], grads[1]
                if "max" in label:  # the elements that received two gradients or more
                    many = grads[2] > 1.5
                    got, exact = got[many], exact[many]
            rows.append((label, got, exact))
        xb = torch.relu(torch.randn(4, 8, 16, 16, generator=g) * 2 + 0.5).to(dtype)
        ones, zeros = torch.ones(8), torch.zeros(8)
        got, exact = (F.batch_norm(xb.to(d), None, None, ones.to(d), zeros.to(d), training=True)
                      for d in (dtype, torch.float64))
        rows.append(("batch_norm (training), all elements", got, exact))
        xd = xb.double()
        near = xd.abs() > 5 * (xd - xd.mean((0, 2, 3), keepdim=True)).abs()
        for label, got, exact in rows:
            print(f"{str(dtype).replace('torch.', ''):<9} {label:<40} {_units(got, exact, u):>10.2f} "
                  f"{_units(exact.to(dtype), exact, u):>13.2f}")
        got, exact = rows[-1][1], rows[-1][2]
        print(f"{str(dtype).replace('torch.', ''):<9} {'batch_norm (training), near the mean':<40} "
              f"{_units(got, exact, u, near):>10.2f} {_units(exact.to(dtype), exact, u, near):>13.2f}")


def _layer_norm(h: int) -> None:
    print("LayerNorm backward, errors in units of one rounding of the summed terms")
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


def _cross_entropy(draws: int, vocab: int = 256) -> None:
    print(f"cross entropy (mean), relative error of the loss in units of u, {draws} draws")
    print(f"{'dtype':<9} {'tokens':>6} {'cpu mean':>9} {'cpu worst':>10} {'cpu > 2u':>9} {'fp32-sum worst':>15}"
          f" {'fp32-sum > 2u':>14}")
    for dtype, u in UNIT.items():
        for tokens in (32, 512, 4096):
            g = torch.Generator().manual_seed(tokens)
            cpu, f32 = [], []
            for _ in range(draws):
                x = (torch.randn(tokens, vocab, generator=g) * 2).to(dtype)
                y = torch.randint(0, vocab, (tokens,), generator=g)
                exact = float(F.cross_entropy(x.double(), y))
                got = float(F.cross_entropy(x, y))
                summed = float(F.nll_loss(torch.log_softmax(x, -1).float(), y).to(dtype))
                cpu.append(abs(got - exact) / abs(exact) / u)
                f32.append(abs(summed - exact) / abs(exact) / u)
            c, f = torch.tensor(cpu), torch.tensor(f32)
            print(f"{str(dtype).replace('torch.', ''):<9} {tokens:>6} {float(c.mean()):>9.2f} {float(c.max()):>10.2f} "
                  f"{float((c > 2).double().mean()):>9.1%} {float(f.max()):>15.2f} {float((f > 2).double().mean()):>14.1%}")


if __name__ == "__main__":
    main()
