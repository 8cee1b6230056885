"""FSDP2 with train.offload = "optimizer": the step streams the AdamW moment shards through the device a group at
a time (`MasterAdamW._sharded_update`), and every weight, moment and step count is the unstreamed, unoffloaded
step's, bit for bit, with clipping and a skipped (non-finite) step among the steps. One rank in this process
(gloo on the CPU; NCCL on a GPU, marked gpu); the multi-rank run is tests/distributed/test_offload_multirank.py.
Control: the same steps with one gradient changed by one ulp give other weights (the comparison can fail)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from exactrl.distributed.env import DistContext
from exactrl.distributed.parallelize import Parallelism
from exactrl.model import build_model, preset
from exactrl.train.optim import MasterAdamW

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def one_rank(request):
    device = request.param
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield device, DistContext(rank=0, world_size=1, backend=backend)
    dist.destroy_process_group()


def _grads(model, step: int, bump: bool) -> list[torch.Tensor]:
    """Trained-looking gradients: per parameter a different scale, large enough at step 1 for the clip to act;
    step 2's first gradient non-finite (the step is skipped on every shard)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i, p in enumerate(model.parameters()):
        x = torch.randn(p.shape, generator=g) * (1e-3 * (1 + i % 7)) * (50.0 if step == 1 else 1.0)
        if step == 2 and i == 0:
            x[0] = float("nan")
        if bump and step == 0 and i == 3:
            x.view(-1)[0] = torch.nextafter(x.view(-1)[0], torch.tensor(float("inf")))
        out.append(x)
    return out


def _run(device: str, ctx: DistContext, offload: str, chunk_bytes: int, bump: bool = False):
    model = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0).to(device)
    Parallelism(ctx).parallelize(model)
    opt = MasterAdamW(
        model, lr=1e-2, weight_decay=0.1, dist=ctx, offload=offload, offload_chunk_bytes=chunk_bytes
    )
    assert opt.sharded
    norms = []
    for step in range(4):
        for p, g in zip(model.parameters(), _grads(model, step, bump)):
            p.grad = torch.distributed.tensor.DTensor.from_local(g.to(device), p.device_mesh, p.placements)
        norms.append(float(opt.clip_and_step_async(1.0)))
    weights = [p.to_local().detach().cpu().clone() for p in model.parameters()]
    state = [opt.opt.state[m] for m in opt.master]
    moments = [st[k].detach().cpu().clone() for st in state for k in ("exp_avg", "exp_avg_sq")]
    steps = [float(st["step"]) for st in state]
    groups = len(opt._chunks)
    return weights, moments, steps, norms, groups, opt.on_host


@pytest.mark.parametrize("one_rank", DEVICES, indirect=True)
def test_streamed_offloaded_step_is_the_unoffloaded_step(one_rank):
    device, ctx = one_rank
    w0, m0, s0, n0, _, _ = _run(device, ctx, "none", 1 << 30)
    w1, m1, s1, n1, groups, on_host = _run(device, ctx, "optimizer", 1 << 16)  # 64 KiB groups: many of them
    assert groups > 3 and on_host
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert all(torch.equal(a, b) for a, b in zip(m0, m1))
    assert s0 == s1 and set(s1) == {3.0}  # every shard stepped once a step, the skipped step not counted
    assert n0[:2] == n1[:2] and n0[2] != n0[2] and n1[2] != n1[2]  # step 2 skipped (its norm is NaN) in both
    # Control: one gradient element one ulp apart at the first step: other weights.
    w2, *_ = _run(device, ctx, "optimizer", 1 << 16, bump=True)
    assert not all(torch.equal(a, b) for a, b in zip(w1, w2))
