"""Sharded training as people run it: FSDP2 (``fully_shard``) with a ``MixedPrecisionPolicy``, through
``msprobe.check_parallel`` on 2 CPU ranks (gloo), trained for 2 steps; collectives judged on their group's inputs."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from msprobe_ci.isolate.collectives import references

FSDP_TESTS = '''
import os
import sys

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.environ["MSPROBE_EXAMPLES"])
from test_parallel import adamw, build_llama_fsdp2 as llama, lm_loss  # noqa: E402

X = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def mlp(rank, world, dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(4)])
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in m:
        fully_shard(layer, mp_policy=policy)
    fully_shard(m, mp_policy=policy)
    return m


def fsdp1(rank, world, dtype):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(3)])
    policy = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32) if dtype is not None else None
    return FullyShardedDataParallel(m, device_id=torch.device("cpu"), mixed_precision=policy, use_orig_params=True)


def mse(o):
    return o.float().pow(2).mean()


def test_llama_clean(msprobe):
    msprobe.check_parallel(llama, {"input_ids": IDS, "labels": IDS}, world_size=2, loss_fn=lm_loss,
                           optimizer=adamw, steps=2)


def test_llama_reduce_scatter_fault(msprobe):
    msprobe.check_parallel(llama, {"input_ids": IDS, "labels": IDS}, world_size=2, loss_fn=lm_loss,
                           optimizer=adamw, steps=2, inject="rs.yaml")


def test_mlp_linear_fault(msprobe):
    msprobe.check_parallel(mlp, X, world_size=2, loss_fn=mse, optimizer=adamw, steps=2, inject="linear.yaml")


def test_fsdp1_clean(msprobe):
    msprobe.check_parallel(fsdp1, X, world_size=2, loss_fn=mse, optimizer=adamw, steps=2)


def test_mlp_bench_on_one_rank(msprobe):
    msprobe.check_parallel(mlp, X, world_size=2, bench_world_size=1, loss_fn=mse)
'''


def test_fsdp2_mixed_precision_training_is_judged_rank_by_rank(pytester, monkeypatch):
    """FSDP2 models built per side by build(rank, world_size, dtype) under a bf16 MixedPrecisionPolicy: a stock
    Llama trained 2 steps passes every step and rank; a 2% scale of rank 1's gradient shard in one
    reduce-scatter at step 1 is named at the collective, and a 2% fault on rank 1's linear at step 1 at that
    linear; FSDP1 under its MixedPrecision passes; a one-rank bench of the same sharded build merges and passes.
    The dumps record FSDP's collectives, the parameters' gradients as this rank's shards with their placement,
    and the module classes and paths unwrapped."""
    monkeypatch.setenv("MSPROBE_EXAMPLES", os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    pytester.makepyfile(test_fsdp2=FSDP_TESTS)
    pytester.makefile(".yaml", rs="faults:\n  - {api: Distributed.reduce_scatter_single, call: 1, perturb: scale, "
                                  "value: 1.02, step: 1, rank: 1}\n",
                      linear="faults:\n  - {api: Functional.linear, call: 2, perturb: scale, value: 1.02, step: 1, "
                             "rank: 1}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16")
    out = result.stdout.str()
    result.assert_outcomes(passed=3, failed=2)
    assert "msprobe: first divergence: step1 rank1 Distributed.reduce_scatter_single.1.forward: " in out, out
    # its reproduction: FSDP2's reduce-scatter re-run alone on a gloo group of 2, failing as the gate did
    rerun = re.search(r"reproduce this call alone, without the model \(--no-fault leaves an injected fault out\): "
                      r"python (\S+Distributed\.reduce_scatter_single\.1\.forward\.py)", out)
    assert rerun and "step1/rank1/repro/" in rerun.group(1).replace(os.sep, "/"), out
    for flags, rc in (((), 1), (("--no-fault",), 0)):
        proc = subprocess.run([sys.executable, rerun.group(1), *flags], capture_output=True, text=True, timeout=300)
        assert proc.returncode == rc and "on a gloo group of 2 process(es), judged on rank 1" in proc.stdout, \
            proc.stdout + proc.stderr
    assert "msprobe: first divergence: step1 rank1 Functional.linear.2.forward: " in out, out
    for rank in (0, 1):
        assert re.search(rf"test_llama_clean \[check 0 step1 rank{rank}\]: .*error 0, unmatched 0; first divergence: "
                         r"none; first overflow: none; verdict: pass", out), out
    page = (pytester.path / "msprobe-out" / "report.html").read_text(encoding="utf-8")  # steps x ranks per check
    assert "test_fsdp2.py::test_llama_reduce_scatter_fault &middot; check 0: 2 ranks x 2 steps, first divergence: " \
           "step1 rank1</h2>" in page
    check = pytester.path / "msprobe-out" / "test_fsdp2.py_test_llama_clean" / "check0"
    dump = json.loads((check / "target" / "step1" / "rank1" / "dump.json").read_text())["data"]
    assert any(n.startswith("Distributed.all_gather_single.") for n in dump)
    grads = next(v for k, v in dump.items() if k.endswith(".parameters_grad.0") and "q_proj" in k)
    rec = next(iter(grads.values()))[0]
    assert rec["placements"] == ["Shard(dim=0)"] and rec["shape"][0] * 2 == rec["global_shape"][0]
    assert rec["dtype"] == "torch.float32"  # reduced in fp32 by the policy
    assert not any("FSDP" in n for n in dump if n.startswith("Module."))
    fsdp1 = pytester.path / "msprobe-out" / "test_fsdp2.py_test_fsdp1_clean" / "check0" / "target" / "step1"
    names = list(json.loads((fsdp1 / "rank0" / "dump.json").read_text())["data"])
    # FSDP1's wrapper records nothing and leaves its attribute out of the names; its copy into the low-precision
    # shard (uninitialised before) is no overflow
    assert "Module.0.0.Linear.forward.0" in names and not any("_fsdp_wrapped_module" in n for n in names)
    iso = json.loads((check / "target" / "step1" / "rank0" / "isolation.json").read_text())["nodes"]
    judged = [v for k, v in iso.items() if k.startswith("Distributed.reduce_scatter_single.")]
    assert judged and all(v["status"] == "pass" and v["collective"]["world_size"] == 2 for v in judged)
    optimizer = [v for k, v in iso.items() if k.startswith("Tensor.addcdiv_.")]  # AdamW on the sharded weights
    assert optimizer and all(v["status"] == "pass" for v in optimizer)


COMPILED_TESTS = FSDP_TESTS + """

def test_compiled_clean(msprobe):
    msprobe.check_parallel(llama, {"input_ids": IDS, "labels": IDS}, world_size=2, loss_fn=lm_loss,
                           optimizer=adamw, steps=2)


def test_compiled_embedding_fault(msprobe):
    msprobe.check_parallel(llama, {"input_ids": IDS, "labels": IDS}, world_size=2, loss_fn=lm_loss,
                           optimizer=adamw, steps=2, inject="emb.yaml")


def test_compiled_block_fault(msprobe):
    msprobe.check_parallel(llama, {"input_ids": IDS, "labels": IDS}, world_size=2, loss_fn=lm_loss,
                           optimizer=adamw, steps=2, inject="linear.yaml")
"""


def test_a_compiled_fsdp2_target_is_judged_block_by_block_on_every_rank(pytester, monkeypatch):
    """``--msprobe-target-compile`` in ``check_parallel``: each rank compiles its FSDP2 Llama's blocks regionally;
    both sides at L0; each compiled block judged whole against its eager self on its rank, forward and backward,
    before FSDP's post-forward hook frees the unsharded weights its re-runs read (that order was a segfault under
    inductor). Clean: every step and rank passes; a 2% fault on rank 1's embedding at step 1 is named there; a
    fault inside a compiled block cannot be reached and fails as unapplied."""
    monkeypatch.setenv("MSPROBE_EXAMPLES", os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    pytester.makepyfile(test_fsdp2=COMPILED_TESTS)
    pytester.makefile(".yaml", emb="faults:\n  - {api: Functional.embedding, call: 0, perturb: scale, value: 1.02, "
                                   "step: 1, rank: 1}\n",
                      linear="faults:\n  - {api: Functional.linear, call: 2, perturb: scale, value: 1.02, step: 1, "
                             "rank: 1}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msprobe-target-dtype=bf16",
                                           "--msprobe-target-compile", "-k", "compiled")
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=2)
    assert "eagerly" not in out, out
    for step in (0, 1):
        for rank in (0, 1):
            assert re.search(rf"test_compiled_clean \[check 0 step{step} rank{rank}\]: .*vs cpu/bf16\+compile x2, "
                             r"statistics, L0\): .*error 0, unmatched 0; first divergence: none; .*verdict: pass",
                             out), out
    assert re.search(r"note: cpu/bf16\+compile: compiled with \w+ \(2 region\(s\)\)", out), out
    assert "msprobe: first divergence: step1 rank1 Module.model.embed_tokens.Embedding.forward.0: " in out, out
    assert "Functional.linear" in out and "torch.compile region" in out, out
    check = pytester.path / "msprobe-out" / "test_fsdp2.py_test_compiled_clean" / "check0"
    for rank in (0, 1):
        iso = json.loads((check / "target" / "step1" / f"rank{rank}" / "isolation.json").read_text())["nodes"]
        blocks = {k: v["status"] for k, v in iso.items() if "LlamaDecoderLayer" in k}
        assert blocks == {f"Module.model.layers.{i}.LlamaDecoderLayer.{d}.0": "pass"
                          for i in (0, 1) for d in ("forward", "backward")}, iso
        # the FSDP root holds sharded state: re-running it would gather it a rank-dependent number of times (a
        # fault on one rank asks for the budget's runs there only: the ranks hung)
        root = iso["Module.model.LlamaModel.forward.0"]
        assert root["status"] == "skip" and "sharded across ranks" in root["message"], root


def test_collective_references_reduce_in_rank_order():
    """The oracle, the rank-order bench and the error scale of a reduction, per reduce op and collective."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, -2.0, 1.0, 1e-3]])
    gathered = x.to(torch.bfloat16).reshape(-1)
    o, b, sc = references("all_reduce", "SUM", gathered, 2, 0, torch.bfloat16)
    assert torch.equal(o, x.to(torch.bfloat16).double().sum(0)) and b.dtype == torch.bfloat16
    assert torch.equal(b, (x.to(torch.bfloat16).double().sum(0)).to(torch.bfloat16))
    assert sc[1] == 0 and sc[0] > 0  # an exact cancellation has no rounding to allow
    o, b, sc = references("reduce_scatter_single", "AVG", gathered, 2, 1, torch.bfloat16)
    assert o.shape == (2,) and torch.allclose(o, x.to(torch.bfloat16).double().sum(0)[2:] / 2)
    o, b, _ = references("all_reduce", "MAX", gathered, 2, 0, torch.bfloat16)
    assert torch.equal(b.double(), o) and torch.equal(o, x.to(torch.bfloat16).double().amax(0))
    o, b, sc = references("all_gather_into_tensor", "SUM", gathered, 2, 0, torch.bfloat16)
    assert torch.equal(b, gathered) and not sc.any()
    with pytest.raises(ValueError):
        references("all_reduce", "BAND", gathered, 2, 0, torch.bfloat16)


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_is_never_copied_and_its_pointwise_updates_are_local(one_rank):
    """A fully_shard model handed to a side that does not own it is refused in one line (it cannot be copied);
    its module classes keep their own names; an optimizer's pointwise update of its sharded parameters is the op
    on the local shards, while a reduction over them is not."""
    from torch.distributed.fsdp import fully_shard

    from msprobe_ci.backends import Backend
    from msprobe_ci.capture.module_hooks import class_name
    from msprobe_ci.errors import MsprobeError
    from msprobe_ci.isolate.support import local_pointwise

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    fully_shard(m)
    with pytest.raises(MsprobeError, match=r"^the model is sharded by fully_shard, which cannot be copied for each "
                                           r"side: hand msprobe.check_parallel a build\(rank, world_size\)"):
        Backend.from_options("cpu", "bf16").prepare_model(m)
    owned = Backend.from_options("cpu", "bf16").prepare_model(m, owned=True)
    assert owned is m and m[0].weight.dtype == torch.bfloat16
    assert type(m).__name__ == "FSDPSequential" and class_name(m) == "Sequential" and class_name(m[0]) == "Linear"
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from msprobe_ci.capture.module_hooks import WRAPPERS, model_path

    wrapped = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(4, 4)))
    fully_shard(wrapped[0])
    paths = [p for p, _ in wrapped.named_modules()]
    assert class_name(wrapped[0]) in WRAPPERS  # FSDP's subclass of activation checkpointing's wrapper, unwrapped
    assert [model_path(p) for p in paths] == ["", "0", "0"] and "0._checkpoint_wrapped_module" in paths
    w, g = m[0].weight.detach(), m[0].weight.detach() * 2
    args, kwargs = local_pointwise("addcdiv_", (w, g, g), {"value": -0.1})
    assert all(type(a) is torch.Tensor for a in args) and args[0] is w._local_tensor
    assert local_pointwise("__mul__", (w, torch.tensor(2.0)), {}) is not None
    assert local_pointwise("sum", (w,), {}) is None  # a reduction over the sharded dim is not local
    assert local_pointwise("__mul__", (w, torch.ones(4)), {}) is None  # a plain tensor beside the shard


def _loop_rank(rank: int, world: int, port: int, dtype, out: str, inject: str | None) -> None:
    """A user's own FSDP2 loop on one rank: 2 AdamW steps with gradient clipping, dumped by PrecisionDebugger."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from msprobe_ci import PrecisionDebugger

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(3)])
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in m:
            fully_shard(layer, mp_policy=policy)
        fully_shard(m, mp_policy=policy)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        dbg = PrecisionDebugger(dump_path=out, level="mix", inject=inject)
        for step in range(2):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))  # each rank its data
            dbg.start(m)
            m(x).float().pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            dbg.stop()
            dbg.step()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_users_own_fsdp2_loop_dumped_over_steps_names_a_faulty_reduce_scatter(tmp_path, capsys):
    """The loop users run under torchrun (FSDP2 with a bf16 policy, clip_grad_norm_ over DTensors, AdamW), dumped by
    PrecisionDebugger on every rank for 2 steps: against the same loop in fp32, msprobe-ci compare passes every
    step and rank; with rank 1's gradient shard scaled by 2% in one reduce-scatter at step 1 it names that
    collective, step and rank first."""
    import torch.multiprocessing as mp

    from msprobe_ci.cli import main

    (tmp_path / "rs.yaml").write_text("faults:\n  - {api: Distributed.reduce_scatter_single, call: 1, perturb: "
                                      "scale, value: 1.02, step: 1, rank: 1}\n")
    for name, dtype, inject in (("bench", None, None), ("target", torch.bfloat16, None),
                                ("faulty", torch.bfloat16, str(tmp_path / "rs.yaml"))):
        mp.spawn(_loop_rank, args=(2, _free_port(), dtype, str(tmp_path / name), inject), nprocs=2)
    capsys.readouterr()
    assert main(["compare", "-tp", str(tmp_path / "target"), "-gp", str(tmp_path / "bench"),
                 "-o", str(tmp_path / "c1")]) == 0
    clean = capsys.readouterr().out
    assert clean.count("error 0, unmatched 0") == 4 and "first divergence: none" in clean, clean
    assert main(["compare", "-tp", str(tmp_path / "faulty"), "-gp", str(tmp_path / "bench"),
                 "-o", str(tmp_path / "c2")]) == 1
    faulty = capsys.readouterr().out
    assert "first divergence: step1 rank1 Distributed.reduce_scatter_single.1.forward: " in faulty, faulty
