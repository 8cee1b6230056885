"""FSDP2's fp32 masters are cast layer by layer, each just before it is sharded: the whole model never stands in
fp32 on the device beside its bf16 replica (qwen3-30b-a3b: 122 GB of fp32 beside 61 GB of bf16 ran a 2 x H200
rank out of memory), and the masters are the bits `model.float()` gives."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.fsdp as fsdp

from exactrl.distributed.parallelize import Parallelism
from exactrl.model import build_model, preset


def test_masters_are_cast_a_layer_at_a_time_and_equal_model_float(one_gloo_rank, monkeypatch) -> None:
    model = build_model(preset("tiny"), dtype=torch.bfloat16, exact=True, seed=0)
    layers = list(model.model.layers)
    assert len(layers) > 1
    want = copy.deepcopy(model).float()
    seen: list[list[torch.dtype]] = []  # at each layer's sharding: every layer's parameter dtype
    real = fsdp.fully_shard

    def recording(module, *args, **kwargs):
        if any(module is layer for layer in layers):
            seen.append([next(layer.parameters()).dtype for layer in layers])
        return real(module, *args, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", recording)
    Parallelism(one_gloo_rank).parallelize(model)
    assert len(seen) == len(layers)
    for i, dtypes in enumerate(seen):  # layer i in fp32 when sharded; the layers after it still bf16
        assert dtypes[i] == torch.float32, (i, dtypes)
        assert all(d == torch.bfloat16 for d in dtypes[i + 1 :]), (i, dtypes)
    got = dict(model.named_parameters())
    for name, p in want.named_parameters():
        local = got[name].to_local()
        assert local.dtype == p.dtype == torch.float32 and torch.equal(local, p), name
    for (name, b), (_, w) in zip(model.named_buffers(), want.named_buffers()):
        assert b.dtype == w.dtype and torch.equal(b, w), name


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_the_replica_is_structure_until_the_policy_is_sharded_then_the_policys_bytes(
    one_gloo_rank, name
) -> None:
    # Under FSDP2 the engine replica is taken before the policy is sharded: as its structure alone (no second
    # whole copy beside the whole policy), given memory and filled from the shards once they exist.
    model = build_model(preset(name), dtype=torch.bfloat16, exact=True, seed=0)
    model.init_weights(seed=3, std=0.05)  # trained-looking: not the first init's values
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    par = Parallelism(one_gloo_rank)
    replica = par.engine_model(model)
    assert all(p.is_meta for p in replica.parameters())
    assert all(not b.is_meta for b in replica.buffers())
    par.parallelize(model)
    par.bind(model, replica)
    got = dict(replica.named_parameters())
    assert got.keys() == want.keys()
    for n, w in want.items():
        assert got[n].dtype == torch.bfloat16 and not got[n].requires_grad, n
        assert torch.equal(got[n], w), n
    for (n, b), (_, w) in zip(replica.named_buffers(), build_model(preset(name)).named_buffers()):
        assert torch.equal(b.float(), w.float()), n
