"""Multi-rank examples (torch.distributed over gloo on CPU, 2 ranks): a Megatron-style tensor-parallel transformer
block (attention heads and MLP hidden units split over ranks: column-parallel then row-parallel linears, one
all_reduce each) and a 2-stage pipeline (send/recv). ``build(rank, world)`` returns a rank's shard of the same full
weights, so every world size computes the same function."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

D, HEADS, FFN = 32, 4, 64


def _full_weights():
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(*shape, generator=g) * 0.1 for name, shape in
            (("qkv", (3 * D, D)), ("proj", (D, D)), ("fc1", (FFN, D)), ("fc2", (D, FFN)))}


class TPBlock(torch.nn.Module):
    """Pre-norm attention + MLP; this rank holds HEADS/world heads and FFN/world hidden units."""

    def __init__(self, rank: int, world: int):
        super().__init__()
        w, h, f = _full_weights(), HEADS // world, FFN // world
        hd = D // HEADS
        rows = [torch.arange(part * D + rank * h * hd, part * D + (rank + 1) * h * hd) for part in range(3)]
        self.heads = h
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv = torch.nn.Linear(D, 3 * h * hd, bias=False)         # column-parallel
        self.proj = torch.nn.Linear(h * hd, D, bias=False)            # row-parallel
        self.fc1 = torch.nn.Linear(D, f, bias=False)                  # column-parallel
        self.fc2 = torch.nn.Linear(f, D, bias=False)                  # row-parallel
        with torch.no_grad():
            self.qkv.weight.copy_(w["qkv"][torch.cat(rows)])
            self.proj.weight.copy_(w["proj"][:, rank * h * hd:(rank + 1) * h * hd])
            self.fc1.weight.copy_(w["fc1"][rank * f:(rank + 1) * f])
            self.fc2.weight.copy_(w["fc2"][:, rank * f:(rank + 1) * f])

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        a = self.proj(a.transpose(1, 2).reshape(b, s, -1))
        dist.all_reduce(a)
        x = x + a
        m = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        dist.all_reduce(m)
        return x + m


def build_tp_block(rank: int, world: int) -> torch.nn.Module:
    return TPBlock(rank, world)


class PipelineStage(torch.nn.Module):
    """Stage 0 runs the first linear and sends its activations to stage 1, which receives and runs the second."""

    def __init__(self, rank: int):
        super().__init__()
        g = torch.Generator().manual_seed(rank)
        self.rank = rank
        self.fc = torch.nn.Linear(D, D)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(D, D, generator=g) * 0.1)
            self.fc.bias.copy_(torch.randn(D, generator=g) * 0.1)

    def forward(self, x):
        if self.rank == 0:
            h = torch.tanh(self.fc(x))
            dist.send(h.detach(), dst=1)
            return h
        h = torch.empty_like(x)
        dist.recv(h, src=0)
        return torch.tanh(self.fc(h))


def build_pipeline(rank: int, world: int) -> torch.nn.Module:
    return PipelineStage(rank)


def loss(out):
    return out.float().pow(2).mean()


def test_tensor_parallel_block(msprobe):
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1))
    msprobe.check_parallel(build_tp_block, x, world_size=2, loss_fn=loss)


def test_pipeline(msprobe):
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(2))
    msprobe.check_parallel(build_pipeline, x, world_size=2)
