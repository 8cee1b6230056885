"""train.activation_checkpointing: the recomputed backward gives the very same loss, gradients and weights."""

from __future__ import annotations

import copy

import pytest
import torch

from exactrl.distributed.parallelize import apply_activation_checkpointing
from exactrl.model.loading import load_policy
from exactrl.train.optim import MasterAdamW
from exactrl.train.packing import PackedBatch, response_logprobs
from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings


def _rollouts(n: int = 6) -> list[Rollout]:
    g = torch.Generator().manual_seed(0)
    return [
        Rollout(
            torch.randint(0, 200, (3 + k,), generator=g).tolist(),
            torch.randint(0, 200, (2 + k % 4,), generator=g).tolist(),
            torch.zeros(2 + k % 4),
            advantage=1.0 if k % 2 else -1.0,
        )
        for k in range(n)
    ]


def _train_step(model) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    # Small microbatches: several forward/backward passes accumulate into one update.
    # Synthetic rollouts (no engine logprobs): "warn" lets the update through the exactness guard.
    settings = TrainerSettings(exact=True, max_tokens_per_microbatch=24, on_mismatch="warn")
    trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-2))
    m = trainer.step(_rollouts())
    return m, {n: p.detach().clone() for n, p in model.named_parameters()}


def _saved_tensors(model) -> int:
    """Tensors autograd keeps from one forward for the backward."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    rs = _rollouts()
    pb = PackedBatch.build(
        [r.prompt_ids + r.completion_ids for r in rs], [len(r.prompt_ids) for r in rs], "cpu"
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        response_logprobs(model, pb, 1.0)[0].sum()
    return count


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_activation_checkpointing_is_bitwise_exact(dtype):
    base, _ = load_policy(preset_name="tiny", device="cpu", dtype=dtype, seed=0)
    plain, ac = copy.deepcopy(base), copy.deepcopy(base)
    assert apply_activation_checkpointing(ac) == ac.config.num_layers
    assert apply_activation_checkpointing(ac) == 0  # applying twice wraps nothing more
    # It does something: the forward keeps far fewer tensors for the backward.
    assert _saved_tensors(ac) < _saved_tensors(plain) / 2
    m_plain, w_plain = _train_step(plain)
    m_ac, w_ac = _train_step(ac)
    assert m_plain["grad_norm"] > 0
    for k in ("loss", "grad_norm", "entropy"):
        assert m_ac[k] == m_plain[k], k
    for n in w_plain:
        assert torch.equal(w_ac[n], w_plain[n]), n
    # Negative control: the same comparison sees a 1% change of one weight of the model.
    other = copy.deepcopy(base)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight[0, 0] *= 1.01
    m_other, _ = _train_step(other)
    assert m_other["grad_norm"] != m_plain["grad_norm"]


def test_no_grad_forward_skips_the_checkpoint_and_copies_stay_apart():
    """The engine and the scoring passes run without grad: the wrapped layer runs once, as before. A deepcopy
    (the engine replica, the reference model) runs its own layers, not the original's."""
    model, _ = load_policy(preset_name="tiny", device="cpu", dtype="float32", seed=0)
    ref = copy.deepcopy(model)
    apply_activation_checkpointing(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert twin.model.layers[0].forward.__self__ is twin.model.layers[0]
    rs = _rollouts()
    pb = PackedBatch.build(
        [r.prompt_ids + r.completion_ids for r in rs], [len(r.prompt_ids) for r in rs], "cpu"
    )
    with torch.no_grad():
        assert torch.equal(response_logprobs(model, pb, 0.7)[0], response_logprobs(ref, pb, 0.7)[0])
