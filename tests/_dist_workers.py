"""Rank programs the multi-rank tests spawn (torch.multiprocessing, gloo on CPU); importable by the children."""

import os

import torch
import torch.distributed as dist


class TPMLP(torch.nn.Module):
    """Megatron-style tensor-parallel MLP: column-parallel fc1 (a shard of the hidden units), row-parallel fc2,
    and an all_reduce of the partial outputs. Every rank holds its shard of the same full weights."""

    def __init__(self, rank, world, d=16, h=32):
        super().__init__()
        torch.manual_seed(0)
        full1, full2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d, bias=False)
        k = h // world
        self.fc1 = torch.nn.Linear(d, k)
        self.fc2 = torch.nn.Linear(k, d, bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(full1.weight[rank * k:(rank + 1) * k])
            self.fc1.bias.copy_(full1.bias[rank * k:(rank + 1) * k])
            self.fc2.weight.copy_(full2.weight[:, rank * k:(rank + 1) * k])
        self.async_op = False

    def forward(self, x):
        y = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        if self.async_op:
            dist.all_reduce(y, op=dist.ReduceOp.SUM, async_op=True).wait()
        else:
            dist.all_reduce(y)
        return y


def tp_mlp(rank, world, port, out, fault_rank, ranks, async_op):
    """Bench (fp32) and target (bf16, a 5% gelu fault on ``fault_rank``) dumps of the TP MLP on every rank."""
    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.capture.inject import Fault
    from msprobe_ci.config import DumpConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        for side, dtype in (("bench", torch.float32), ("target", torch.bfloat16)):
            m = TPMLP(rank, world).to(dtype)
            m.async_op = async_op
            faults = [Fault("Functional.gelu", 0, "forward", "scale", 1.05)] \
                if side == "target" and rank == fault_rank else []
            cap = CaptureSession(DumpConfig(dump_path=os.path.join(out, side), level="mix", rank=list(ranks)),
                                 faults=faults)
            cap.start(m)
            m(x.to(dtype)).float().pow(2).mean().backward()
            cap.stop()
            cap.close()
        dist.barrier()  # as msprobe_ci.check.ranks: no rank leaves (closing its gloo pairs) while a peer works
    finally:
        dist.destroy_process_group()


def tp_isolated(rank, world, port, out, op, fault):
    """A bf16 target of the TP MLP on every rank, every API and collective isolated; ``fault`` (a Fault or None)
    injected on the last rank. ``op``: ``all_reduce`` (the MLP's own) or ``reduce_scatter_tensor`` (its output
    reduce-scattered after it)."""
    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.config import DumpConfig
    from msprobe_ci.isolate import Isolator

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.randn(4 * world, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
        m = TPMLP(rank, world).bfloat16()
        cap = CaptureSession(DumpConfig(dump_path=out, level="mix"), isolator=Isolator(),
                             faults=[fault] if fault is not None and rank == world - 1 else [])
        cap.start(m)
        y = m(x)
        if op == "reduce_scatter_tensor":
            part = torch.empty(4, 16, dtype=y.dtype)
            dist.reduce_scatter_tensor(part, y.detach() * (rank + 1), op=dist.ReduceOp.SUM)
        cap.stop()
        cap.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


class Stage(torch.nn.Module):
    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(rank)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def pipeline(rank, world, port, out):
    """A 2-stage pipeline: rank 0 sends its activations to rank 1 (send/recv), captured with PrecisionDebugger."""
    from msprobe_ci import PrecisionDebugger

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        stage = Stage(rank)
        dbg = PrecisionDebugger(dump_path=out, level="mix")
        dbg.start(stage)
        with torch.no_grad():
            if rank == 0:
                dist.send(stage(torch.ones(2, 8)), dst=1)
            else:
                h = torch.zeros(2, 8)
                dist.recv(h, src=0)
                stage(h)
        dbg.stop()
        dist.barrier()  # as msprobe_ci.check.ranks: no rank leaves (closing its gloo pairs) while a peer works
    finally:
        dist.destroy_process_group()


def dtensor_mlp(rank, world, port, out):
    """A DTensor tensor-parallel MLP (parallelize_module: column-wise fc1, row-wise fc2 on a 1-D device mesh),
    forward and backward, captured with CaptureSession; ``world`` 1 is the unsplit bench."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.config import DumpConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        m = parallelize_module(m, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        cap = CaptureSession(DumpConfig(dump_path=out, level="mix"))
        cap.start(m)
        m(x).float().pow(2).mean().backward()
        cap.stop()
        cap.close()
        dist.barrier()  # as msprobe_ci.check.ranks: no rank leaves (closing its gloo pairs) while a peer works
    finally:
        dist.destroy_process_group()


def pipeline_training_step(rank, world, port, out):
    """One training step of the examples' pipeline model (PPModel) cut into ``world`` stages, the way a pipeline
    schedule runs it by hand: forward stage by stage (send/recv), the last stage's loss backward, each stage
    sending its input gradient back (send/recv) for the previous stage's backward; captured with
    PrecisionDebugger (mix). ``world`` 1 is the whole model."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from test_parallel import D, PPModel

    from msprobe_ci import PrecisionDebugger

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = PPModel(rank, world)
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(2))
        dbg = PrecisionDebugger(dump_path=out, level="mix")
        dbg.start(model)
        y = model(x)
        if rank == world - 1:
            y.float().pow(2).mean().backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, src=rank + 1)
            y.backward(grad)
        if rank > 0:
            dist.send(model.received.grad, dst=rank - 1)
        dbg.stop()
        dist.barrier()  # as msprobe_ci.check.ranks: no rank leaves (closing its gloo pairs) while a peer works
    finally:
        dist.destroy_process_group()


class SPMLP(torch.nn.Module):
    """Megatron sequence parallelism around a TP MLP (forward): the sequence-sharded input is all-gathered
    (all_gather_single; all_gather_into_tensor before torch 2.13) before the column-parallel fc1, and the row-parallel
    fc2's partial sums are reduce-scattered (reduce_scatter_single / reduce_scatter_tensor) back to sequence shards;
    LayerNorm runs on the sequence shard."""

    def __init__(self, rank, world, d=16, h=32):
        super().__init__()
        torch.manual_seed(0)
        full1, full2 = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(h, d, bias=False)
        k = h // world
        self.world = world
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, k, bias=False)
        self.fc2 = torch.nn.Linear(k, d, bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(full1.weight[rank * k:(rank + 1) * k])
            self.fc2.weight.copy_(full2.weight[:, rank * k:(rank + 1) * k])

    def forward(self, x_shard):  # [seq / world, d]
        h = self.norm(x_shard)
        full = torch.empty(h.shape[0] * self.world, h.shape[1])
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, h.contiguous())
        y = self.fc2(torch.nn.functional.gelu(self.fc1(full)))
        out = torch.empty_like(x_shard)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, y)
        return x_shard + out


def sequence_parallel_mlp(rank, world, port, out):
    """Forward of SPMLP on ``world`` ranks (each its sequence shard of the same input), captured at mix."""
    from msprobe_ci.capture import CaptureSession
    from msprobe_ci.config import DumpConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        n = 8 // world
        m = SPMLP(rank, world)
        cap = CaptureSession(DumpConfig(dump_path=out, level="mix"))
        cap.start(m)
        with torch.no_grad():
            m(x[rank * n:(rank + 1) * n])
        cap.stop()
        cap.close()
        dist.barrier()  # as msprobe_ci.check.ranks: no rank leaves (closing its gloo pairs) while a peer works
    finally:
        dist.destroy_process_group()


def ddp_debugger(rank, world, port, out, record):
    """A user's own DDP loop dumped with PrecisionDebugger over two AdamW steps (each rank its own batch);
    ``record``: ``ddp_reduction=True``, which makes DDP's gradient all_reduce a recorded call."""
    from msprobe_ci import PrecisionDebugger

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dbg = PrecisionDebugger(dump_path=out, level="mix", ddp_reduction=record)
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(2):
            dbg.start(model)
            model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            dbg.stop()
            dbg.step()
        dist.barrier()  # as msprobe_ci.check.ranks: no rank leaves (closing its gloo pairs) while a peer works
    finally:
        dist.destroy_process_group()
