"""fp8 projections under FSDP2 (one gloo rank in this process, no torchrun): the trainer quantizes its gathered
weights, the engine replica quantizes the weights the sync wrote, and after every optimizer step both give bitwise
equal logprobs, equal to a one-process fp8 model holding the same weights. The negative control: a trainer whose
step does not mark its fp8 copies stale keeps the old ones, and its logprobs differ from the replica's.
(The multi-rank runs, colocated and with generator ranks: tests/distributed/test_disagg.py.)"""

from __future__ import annotations

import pytest
import torch

from exactrl.config import config_from_dict
from exactrl.distributed.parallelize import Parallelism
from exactrl.model.loading import load_policy
from exactrl.model.precision import apply_precision
from exactrl.ops import set_exact_environment
from exactrl.ops.fp8 import Fp8Ops
from exactrl.train.memory import plan_memory
from exactrl.train.optim import MasterAdamW
from exactrl.train.packing import PackedBatch, response_logprobs


def _batch(device) -> PackedBatch:
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 14, 6)]
    return PackedBatch.build(seqs, [4, 5, 3], device)


def _logprobs(model, pb: PackedBatch) -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(model, pb, 1.0)[0]


def _held(model) -> int:
    """Bytes of the fp8 copies `model` holds (values, scales and the CPU's float64 values)."""
    es = model.ops._weights.values()
    return sum(e.q.nbytes + e.scale.nbytes + (e.operand.nbytes if e.operand is not e.q else 0) for e in es)


def _run(ctx, steps: int, held: list[int] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Per step (after it): the trainer's, the replica's, a one-process fp8 model's (the replica's weights) and a
    one-process bf16 model's logprobs. held: gets the bytes of the trainer's and the replica's fp8 copies."""
    set_exact_environment(True)
    model, _ = load_policy(preset_name="tiny", dtype="bfloat16", seed=0, precision="fp8")
    par = Parallelism(ctx)
    replica = par.engine_model(model)
    par.parallelize(model)
    par.bind(model, replica)
    # tiny: 4 layers of qkv, o, gate_up and down
    assert isinstance(replica.ops, Fp8Ops) and replica.ops.num_weights == 4 * 4
    opt = MasterAdamW(model, lr=1e-2, dist=ctx)
    pb = _batch(model.device)
    out = []
    for _ in range(steps):
        lp, _, _ = response_logprobs(model, pb, 1.0)
        (-lp.float().mean()).backward()
        opt.clip_and_step(1.0)
        par.sync_weights()
        alone, _ = load_policy(preset_name="tiny", dtype="bfloat16", seed=0)
        alone.load_state_dict(replica.state_dict())
        bf16 = _logprobs(alone, pb)
        fp8 = _logprobs(apply_precision(alone, "fp8"), pb)
        out.append((_logprobs(model, pb), _logprobs(replica, pb), fp8, bf16))
    if held is not None:
        held += [_held(model), _held(replica)]
    return out


def test_fsdp_trainer_and_replica_quantize_the_same_weights(one_gloo_rank):
    held: list[int] = []
    for trainer, replica, alone, bf16 in _run(one_gloo_rank, 2, held):
        assert torch.equal(trainer, replica) and torch.equal(replica, alone)
        assert not torch.equal(replica, bf16)  # fp8 is on (the replica does not fall back to the model dtype)
    # The memory plan's figures of these two holders (an FSDP2 plan on the CPU) are what they hold.
    cfg = config_from_dict({"model": {"preset": "tiny", "dtype": "bfloat16", "precision": "fp8"}})
    terms = plan_memory(cfg, world_size=1, device="cpu", sharded=True).phase("generation").terms
    assert held == [terms["policy_fp8"], terms["engine_replica_fp8"]]


def test_a_step_that_leaves_the_trainers_fp8_stale_differs(one_gloo_rank, monkeypatch):
    """The negative control: the step's re-quantization (marking the gathered weights' copies stale) planted out."""
    from exactrl.train import optim

    monkeypatch.setattr(optim, "requantize_after_step", lambda *a, **k: None)
    (trainer, replica, alone, _), *_ = _run(one_gloo_rank, 1)
    assert torch.equal(replica, alone) and not torch.equal(trainer, replica)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
