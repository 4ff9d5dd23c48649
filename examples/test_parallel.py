"""Multi-rank examples (torch.distributed over gloo on CPU, 2 ranks): a Megatron-style tensor-parallel transformer
block (attention heads and MLP hidden units split over ranks: column-parallel then row-parallel linears, one
all_reduce each, Megatron's f/g so gradients are exact) and a pipeline of MLP blocks cut into stages (send/recv).
``build(rank, world)`` returns a rank's shard of the same full weights, so every world size computes the same
function, and a TP=2 or PP=2 target can be checked against the whole model on one rank. A Llama sharded with FSDP2
under a mixed-precision policy trains 2 steps, its ``build(rank, world, dtype)`` applying the side's dtype."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

D, HEADS, FFN = 32, 4, 64


def _full_weights():
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(*shape, generator=g) * 0.1 for name, shape in
            (("qkv", (3 * D, D)), ("proj", (D, D)), ("fc1", (FFN, D)), ("fc2", (D, FFN)))}


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward; the input gradient (a partial sum per rank) is all-reduced backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: the row-parallel partial outputs are all-reduced forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPBlock(torch.nn.Module):
    """Pre-norm attention + MLP; this rank holds HEADS/world heads and FFN/world hidden units (column-parallel qkv
    and fc1, row-parallel proj and fc2, Megatron's f/g around them, so gradients are exact too)."""

    def __init__(self, rank: int, world: int, group=None):
        super().__init__()
        w, h, f = _full_weights(), HEADS // world, FFN // world
        self.group = group
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
        g = self.group
        q, k, v = self.qkv(_CopyToTP.apply(self.ln1(x), g)).view(b, s, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + _ReduceFromTP.apply(self.proj(a.transpose(1, 2).reshape(b, s, -1)), g)
        m = self.fc2(F.gelu(self.fc1(_CopyToTP.apply(self.ln2(x), g))))
        return x + _ReduceFromTP.apply(m, g)


def build_tp_block(rank: int, world: int) -> torch.nn.Module:
    return TPBlock(rank, world)


class PPModel(torch.nn.Module):
    """An embedding, LAYERS MLP blocks and a head, cut into ``world`` pipeline stages: stage ``rank`` holds its
    share of the blocks (numbered from 0 on every stage, as Megatron numbers them), the first stage the embedding,
    the last the head; activations go stage to stage by send/recv. ``world == 1`` is the whole model."""

    LAYERS = 4

    def __init__(self, rank: int, world: int):
        super().__init__()
        per = self.LAYERS // world
        self.rank, self.world = rank, world
        self.embed = torch.nn.Linear(D, D) if rank == 0 else None
        self.layers = torch.nn.ModuleList(_block(i) for i in range(rank * per, (rank + 1) * per))
        self.head = torch.nn.Linear(D, D) if rank == world - 1 else None
        g = torch.Generator().manual_seed(7)
        weights = [torch.randn(D, D, generator=g) * 0.2 for _ in range(2)]
        with torch.no_grad():
            for lin, w in zip((self.embed, self.head), weights):
                if lin is not None:
                    lin.weight.copy_(w)
                    lin.bias.zero_()

    def forward(self, x):
        if self.rank == 0:
            h = self.embed(x)
        else:
            h = torch.empty_like(x)
            dist.recv(h, src=self.rank - 1)
            self.received = h.requires_grad_(torch.is_grad_enabled())  # a training loop sends its grad back
        for layer in self.layers:
            h = layer(h)
        if self.rank < self.world - 1:
            dist.send(h, dst=self.rank + 1)
            return h
        return self.head(h)


class MLPBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.fc1, self.fc2 = torch.nn.Linear(D, FFN), torch.nn.Linear(FFN, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _block(i: int) -> MLPBlock:
    """Block ``i`` of the whole model, with the same weights on whichever stage holds it."""
    torch.manual_seed(100 + i)
    return MLPBlock()


def build_pipeline(rank: int, world: int) -> torch.nn.Module:
    return PPModel(rank, world)


class TPPPModel(torch.nn.Module):
    """TP x PP: LAYERS tensor-parallel blocks cut into pipeline stages; ranks ordered tp fastest (Megatron's
    tp-dp-pp): stage = rank // tp, the stage's TP group its tp consecutive ranks. ``world == 1`` is the whole
    model; ``world == 4`` is TP=2 x PP=2."""

    LAYERS = 2

    def __init__(self, rank: int, world: int):
        super().__init__()
        tp = min(2, world)
        pp = world // tp
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]  # every rank, every group
        self.rank, self.tp, self.stage, self.pp = rank, tp, rank // tp, pp
        per = self.LAYERS // pp
        self.layers = torch.nn.ModuleList(TPBlock(rank % tp, tp, groups[self.stage]) for _ in range(per))

    def forward(self, x):
        if self.stage > 0:
            x = torch.empty_like(x)
            dist.recv(x, src=self.rank - self.tp)
        for layer in self.layers:
            x = layer(x)
        if self.stage < self.pp - 1:
            dist.send(x, dst=self.rank + self.tp)
        return x


def build_tp_pp(rank: int, world: int) -> torch.nn.Module:
    return TPPPModel(rank, world)


def build_ddp(rank: int, world: int) -> torch.nn.Module:
    """Data parallel: every rank the whole model (the one-stage pipeline model), wrapped in
    DistributedDataParallel (gradients averaged over ranks in backward by DDP's reducer)."""
    return torch.nn.parallel.DistributedDataParallel(PPModel(0, 1))


def _dtensor_tp(config_cls: str, model_cls: str, world: int) -> torch.nn.Module:
    """A stock transformers decoder (2 layers, from a config) split by DTensor tensor parallelism over ``world``
    ranks (torch.distributed.tensor.parallel: column-wise q/k/v/gate/up, row-wise o/down on a 1-D device mesh);
    ``world == 1`` is the unsplit model."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(vocab_size=128, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    mesh = init_device_mesh("cpu", (world,))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def build_llama_dtensor_tp(rank: int, world: int) -> torch.nn.Module:
    """A stock transformers Llama split by DTensor TP over ``world`` ranks (see :func:`_dtensor_tp`)."""
    return _dtensor_tp("LlamaConfig", "LlamaForCausalLM", world)


def build_qwen2_dtensor_tp(rank: int, world: int) -> torch.nn.Module:
    """A stock transformers Qwen2 split by DTensor TP over ``world`` ranks: its q/k/v projections have biases,
    zero-initialised, so each rank's column-parallel bias shard is equal on every rank (see :func:`_dtensor_tp`)."""
    return _dtensor_tp("Qwen2Config", "Qwen2ForCausalLM", world)


def llama_loss(out):
    return out.logits.float().pow(2).mean()


def loss(out):
    return out.float().pow(2).mean()


def test_tensor_parallel_block(msprobe):
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1))
    msprobe.check_parallel(build_tp_block, x, world_size=2, loss_fn=loss)


def test_tensor_parallel_against_one_rank(msprobe):
    """TP=2 target against a TP=1 bench: the ranks' shards are merged back into one model (weights, activations and
    gradients), row-parallel partial sums stand for their all_reduce, and every node compares clean."""
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1))
    msprobe.check_parallel(build_tp_block, x, world_size=2, bench_world_size=1, loss_fn=loss)


def test_pipeline(msprobe):
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(2))
    msprobe.check_parallel(build_pipeline, x, world_size=2)


def test_pipeline_against_one_rank(msprobe):
    """A 2-stage pipeline against the whole model on one rank: stages are stitched back in order, the blocks
    renumbered (layers.0-1 of stage 1 are layers 2-3)."""
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(2))
    msprobe.check_parallel(build_pipeline, x, world_size=2, bench_world_size=1)


def test_tp_x_pp_against_one_rank(msprobe):
    """TP=2 x PP=2 on 4 ranks against one rank: each stage's TP pair merged, then the stages stitched."""
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(3))
    msprobe.check_parallel(build_tp_pp, x, world_size=4, bench_world_size=1, tp=(2, 1), pp=(2, 1))


def test_ddp_training_step(msprobe):
    """DistributedDataParallel on 2 ranks against one rank: forward, backward, DDP's bucketed gradient all_reduce
    (made a captured, isolated call on each side's copy: docs/multi-rank.md) and every parameter gradient."""
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(4))
    msprobe.check_parallel(build_ddp, x, world_size=2, bench_world_size=1, loss_fn=loss)


def test_llama_dtensor_tp_against_one_rank(msprobe):
    """A stock transformers Llama split by DTensor TP=2 against the unsplit model: DTensors are captured as local
    shards, the redistributions as Distributed.all_reduce (functional collectives), and the merge puts it back."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    msprobe.check_parallel(build_llama_dtensor_tp, ids, world_size=2, bench_world_size=1, loss_fn=llama_loss)


def test_qwen2_dtensor_tp_against_one_rank(msprobe):
    """A stock transformers Qwen2 (biased q/k/v) split by DTensor TP=2 against the unsplit model: the zero bias
    shards, equal on both ranks, are merged as shards (the bench's bias is twice as long), not kept as a replica."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    msprobe.check_parallel(build_qwen2_dtensor_tp, ids, world_size=2, bench_world_size=1, loss_fn=llama_loss)


def build_llama_fsdp2(rank: int, world: int, dtype) -> torch.nn.Module:
    """A stock transformers Llama sharded with FSDP2 (``fully_shard`` on each decoder layer and the root) under a
    mixed-precision policy: parameters all-gathered in ``dtype`` for compute (``None``: the model's fp32, the
    bench), gradients reduce-scattered in fp32. Taking ``dtype``, the build applies the side's dtype itself."""
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def lm_loss(out):
    return out.loss


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def test_llama_fsdp2_mixed_precision_training(msprobe):
    """Sharded training as people run it: FSDP2 with a bf16 MixedPrecisionPolicy on 2 ranks, 2 AdamW steps, every
    step and rank judged; FSDP's all-gathers and reduce-scatters judged as collectives on their group's inputs."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    msprobe.check_parallel(build_llama_fsdp2, {"input_ids": ids, "labels": ids}, world_size=2, loss_fn=lm_loss,
                           optimizer=adamw, steps=2)
