"""An RL update of a LoRA policy: PolicyTrainer.step on the engine's rollouts trains the adapters only (fp32
masters for them alone), the KL reference is the base through `ReferenceView`, and after the update the engine's
new rollouts still match the trainer bit for bit."""

import pytest
import torch
from lora_helpers import count_mismatched, lora_model, rollouts_and_scores, score

from exactrl.config import AlgorithmConfig
from exactrl.model.lora import ReferenceView, adapter_parameters, disable_adapters
from exactrl.train.optim import MasterAdamW
from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings

T = 0.7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rl_step_trains_only_adapters_and_parity_holds_after(dtype):
    model = lora_model(dtype)
    flat, scores = rollouts_and_scores(model, temperature=T, n=2)
    assert count_mismatched(flat, scores)[0] == 0
    rollouts = [
        Rollout(p, c, lp, reward=float(i % 2), advantage=1.0 if i % 2 else -1.0)
        for i, (p, c, lp) in enumerate(flat)
    ]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = [p.detach().clone() for p in adapter_parameters(model)]
    opt = MasterAdamW(model, lr=1e-2)
    assert {id(p) for p in opt.params} == {id(p) for p in adapter_parameters(model)}
    assert opt.has_master == (dtype != torch.float32)  # fp32 masters for the adapters alone
    ref = ReferenceView(model)
    with disable_adapters(model):
        base_lp = score(model, flat, T)
    trainer = PolicyTrainer(
        model,
        TrainerSettings(AlgorithmConfig(kl_coef=0.1), temperature=T, max_tokens_per_microbatch=64),
        opt,
        ref_model=ref,
    )
    metrics = trainer.step(rollouts)
    assert metrics["optimizer_steps"] == 1.0
    assert metrics["mismatch/num_tokens"] > 0
    assert metrics["mismatch/num_mismatched_tokens"] == 0.0  # the trainer's own check of the first minibatch
    assert metrics["kl_ref"] > 0  # the reference is the base, not the adapted policy
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    changed = [not torch.equal(a, p) for a, p in zip(adapters, adapter_parameters(model))]
    assert all(changed), "every A and B takes a step (B != 0, so A has a gradient too)"
    # The reference did not move: the base's logprobs are what they were before the step.
    with disable_adapters(model):
        assert all(torch.equal(a, b) for a, b in zip(base_lp, score(model, flat, T)))
    # The engine samples from the updated adapters and still matches the trainer.
    flat2, scores2 = rollouts_and_scores(model, temperature=T, n=2)
    bad, tot, _ = count_mismatched(flat2, scores2)
    assert bad == 0 and tot > 0
    assert [c for _, c, _ in flat2] != [c for _, c, _ in flat]
