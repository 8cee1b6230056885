"""The trainer on a mixture of experts: router metrics and the router's auxiliary losses.

- the two losses against float64 references written out token by token (and the load-balancing loss against
  transformers' own function), padding tokens ignored;
- a GRPO step on tiny-moe with engine-sampled rollouts: with the losses on, no rollout logprob differs from the
  trainer's (a one-ulp nudge of a recorded logprob is the negative control) while the router's update differs
  from the one without them;
- the router metrics do not depend on how the step is cut into microbatches (routing is batch-invariant);
- activation checkpointing (the forward recomputed in the backward) gives the same update with the losses on;
- the seam: the collector records only while attached, the blocks' own outputs, once per forward.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model.config import preset
from exactrl.model.moe import SparseMoeBlock, collect_router_outputs
from exactrl.model.qwen import build_model
from exactrl.ops.moe_torch import route_topk
from exactrl.train.optim import MasterAdamW
from exactrl.train.router import load_balancing_loss, router_metrics, router_stats, router_z_loss_sum
from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings

ROUTER = "model.layers.1.mlp.gate.weight"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: spinning OpenMP threads slow tiny calls down
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------------------
# The losses against float64 references
# ----------------------------------------------------------------------------------------------------------


def _router_outputs(layers: int = 3, T: int = 13, E: int = 8, k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Trained-looking router logits: a few nats apart, some experts favoured, in bf16 as a bf16 model's are.
    bias = torch.randn(E, generator=g) * 1.5
    logits = [(torch.randn(T, E, generator=g) * 2 + bias).to(torch.bfloat16) for _ in range(layers)]
    ids = [route_topk(lg, k, True)[1] for lg in logits]
    mask = torch.ones(T)
    mask[-3:] = 0.0  # microbatch padding
    return logits, ids, mask


def _lb_reference(logits, ids, mask, E: int) -> float:
    """transformers' load-balancing loss, token by token in float64 over the real tokens of every layer."""
    k = ids[0].shape[1]
    chosen = [[0.0] * E for _ in range(k)]
    prob = [0.0] * E
    n = 0
    for lg, ix in zip(logits, ids):
        p = torch.softmax(lg.double(), dim=-1)
        for t in range(lg.shape[0]):
            if mask[t] == 0:
                continue
            n += 1
            for r in range(k):
                chosen[r][int(ix[t, r])] += 1.0
            for e in range(E):
                prob[e] += float(p[t, e])
    return E * sum(chosen[r][e] / n * prob[e] / n for r in range(k) for e in range(E))


def _z_reference(logits, mask) -> float:
    total = 0.0
    for lg in logits:
        for t in range(lg.shape[0]):
            if mask[t]:
                total += math.log(sum(math.exp(float(v)) for v in lg[t].double())) ** 2
    return total


def test_load_balancing_loss_matches_a_float64_reference_and_transformers():
    logits, ids, mask = _router_outputs()
    got = load_balancing_loss(logits, ids, mask, 8)
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(_lb_reference(logits, ids, mask, 8), rel=1e-6)
    # The padding rows count for nothing: the same loss without them.
    real = [lg[:-3] for lg in logits], [ix[:-3] for ix in ids]
    torch.testing.assert_close(got, load_balancing_loss(*real, torch.ones(10), 8), rtol=1e-6, atol=0)
    transformers = pytest.importorskip("transformers")
    lb = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func
    theirs = lb(tuple(lg.float() for lg in logits), num_experts=8, top_k=2, attention_mask=mask[None].long())
    torch.testing.assert_close(got, theirs.float(), rtol=1e-6, atol=0)


def test_router_z_loss_matches_a_float64_reference():
    logits, _, mask = _router_outputs(seed=1)
    got = router_z_loss_sum(logits, mask)
    assert float(got) == pytest.approx(_z_reference(logits, mask), rel=1e-6)
    assert float(router_z_loss_sum(logits, torch.zeros_like(mask))) == 0.0


def test_router_metrics_of_known_loads():
    # Layer 3: 4 tokens x top-2 = 8 picks, expert 0 takes 4 of them (mean 1 per expert: ratio 4); layer 5: even.
    ids_a = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 4]])
    ids_b = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    uniform = torch.zeros(4, 8)
    stats = router_stats([uniform, uniform], [ids_a, ids_b], torch.ones(4), 8)
    m = router_metrics(stats + stats, layers=[3, 5])  # summed over two microbatches: ratios unchanged
    assert m["moe/load_max_over_mean_worst"] == 4.0 and m["moe/load_worst_layer"] == 3.0
    assert m["moe/load_max_over_mean"] == (4.0 + 1.0) / 2
    assert m["moe/idle_experts"] == 3.0  # experts 5, 6, 7 of layer 3
    assert m["moe/router_entropy"] == pytest.approx(math.log(8), rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampled():
    """tiny-moe (fp32) and 8 rollouts the engine sampled from it, with their rollout logprobs."""
    model = build_model(preset("tiny-moe"), seed=0).requires_grad_(True)
    prompts = [[5, 17, 33, 2, 9], [40, 41, 42], [7, 7, 100, 250], [3, 1, 4, 1, 5, 9]]
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3)
    with torch.no_grad():
        outs = RolloutEngine(model, EngineConfig(max_model_len=64)).generate(prompts, params)
    rollouts = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        for j, smp in enumerate(o.samples):
            adv = 1.0 if (i + j) % 2 else -1.0
            rollouts.append(Rollout(p, smp.token_ids, smp.rollout_logprobs.float().cpu(), advantage=adv))
    return model, rollouts


def _step(model, rollouts, *, on_mismatch="abort", checkpointing=False, **settings):
    """A copy of `model` after one GRPO step on `rollouts`: (metrics, the copy's parameters by name)."""
    m = copy.deepcopy(model)
    if checkpointing:
        from exactrl.distributed.parallelize import apply_activation_checkpointing

        apply_activation_checkpointing(m)
    opt = MasterAdamW(m, lr=1e-3)
    trainer = PolicyTrainer(m, TrainerSettings(exact=True, on_mismatch=on_mismatch, **settings), opt)
    out = trainer.step(rollouts)
    return out, {n: p.detach().clone() for n, p in m.named_parameters()}


def test_router_losses_train_the_router_and_leave_every_logprob_exact(sampled):
    model, rollouts = sampled
    off, w_off = _step(model, rollouts)
    on, w_on = _step(model, rollouts, moe_aux_loss_coef=0.5, moe_z_loss_coef=0.01)
    for m in (off, on):
        assert m["mismatch/num_tokens"] == sum(len(r.completion_ids) for r in rollouts)
        assert m["mismatch/num_mismatched_tokens"] == 0 and m["optimizer_steps"] == 1.0
        assert 1.0 <= m["moe/load_max_over_mean"] <= 8.0 and 0 < m["moe/router_entropy"] <= math.log(8)
    # The same forward, so the same logged router values; the losses change only the update.
    assert on["moe/aux_loss"] == off["moe/aux_loss"] and 1.0 < off["moe/aux_loss"] < 16.0
    assert on["moe/z_loss"] == off["moe/z_loss"] > 0
    assert on["entropy"] == off["entropy"]
    assert not torch.equal(w_on[ROUTER], w_off[ROUTER])
    # The negative control of the premise: off twice is the same update, and a recorded logprob one ulp off is
    # caught with the losses on.
    assert torch.equal(_step(model, rollouts)[1][ROUTER], w_off[ROUTER])
    bad = copy.deepcopy(rollouts)
    bad[3].rollout_logprobs[1] = torch.nextafter(bad[3].rollout_logprobs[1], torch.tensor(0.0))
    caught, _ = _step(model, bad, on_mismatch="skip_step", moe_aux_loss_coef=0.5, moe_z_loss_coef=0.01)
    assert caught["mismatch/num_mismatched_tokens"] == 1 and caught["optimizer_steps"] == 0.0


def test_router_metrics_do_not_depend_on_the_microbatch_split(sampled):
    model, rollouts = sampled
    whole, _ = _step(model, rollouts, max_tokens_per_microbatch=4096)
    split, _ = _step(model, rollouts, max_tokens_per_microbatch=32)  # about three rollouts a microbatch
    # Padded microbatches (the CUDA-graph layout): spare tokens run through the routers but count nowhere.
    padded, _ = _step(model, rollouts, max_tokens_per_microbatch=32, pad_microbatches=True)
    for other in (split, padded):
        for key in ("moe/load_max_over_mean", "moe/load_max_over_mean_worst", "moe/idle_experts"):
            assert whole[key] == other[key], key  # the same tokens routed to the same experts, bit for bit
        assert other["moe/router_entropy"] == pytest.approx(whole["moe/router_entropy"], rel=1e-6)
        # The z-loss is a mean over the step's tokens: the split changes only its rounding.
        assert other["moe/z_loss"] == pytest.approx(whole["moe/z_loss"], rel=1e-5)
    assert split["moe/aux_loss"] != whole["moe/aux_loss"]  # per microbatch, as transformers computes it


def test_router_losses_under_activation_checkpointing_give_the_same_update(sampled):
    model, rollouts = sampled
    kw = dict(moe_aux_loss_coef=0.5, moe_z_loss_coef=0.01)
    plain, w_plain = _step(model, rollouts, **kw)
    ckpt, w_ckpt = _step(model, rollouts, checkpointing=True, **kw)
    assert ckpt["moe/aux_loss"] == plain["moe/aux_loss"]
    for name, w in w_plain.items():
        assert torch.equal(w, w_ckpt[name]), name


def test_router_losses_on_a_dense_model_are_refused():
    model = build_model(preset("tiny"), seed=0)
    with pytest.raises(ValueError, match="train.moe_aux_loss_coef = 0.1 .* no sparse layer"):
        PolicyTrainer(model, TrainerSettings(moe_aux_loss_coef=0.1), MasterAdamW(model, lr=1e-3))


def test_the_collector_records_the_forward_router_outputs_only_while_attached(sampled):
    model, rollouts = sampled
    from exactrl.train.packing import PackedBatch

    r = rollouts[0]
    pb = PackedBatch.build([r.prompt_ids + r.completion_ids], [len(r.prompt_ids)])
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    with torch.no_grad(), collect_router_outputs(model) as rec:
        model(pb.input_ids, pb.batch.q_pos, pb.batch)
    assert [x.layer for x in rec.records] == [1, 2, 3]  # tiny-moe: layer 0 is dense
    assert all(b.router_collector is None for b in blocks.values())
    with torch.no_grad():
        model(pb.input_ids, pb.batch.q_pos, pb.batch)  # detached: nothing more recorded
    assert len(rec.records) == 3
    # The records are the block's own routing: the router applied to the block's input gives the same ids.
    seen = {}
    h = blocks["model.layers.2.mlp"].register_forward_hook(lambda m, a, o: seen.setdefault("x", a[1]))
    try:
        with torch.no_grad(), collect_router_outputs(model) as again:
            model(pb.input_ids, pb.batch.q_pos, pb.batch)
    finally:
        h.remove()
    b = blocks["model.layers.2.mlp"]
    logits = b.gate(model.ops, seen["x"])
    assert torch.equal(again.records[1].logits, logits)
    assert torch.equal(again.records[1].ids, route_topk(logits, b.top_k, b.norm_topk_prob)[1])
    with pytest.raises(RuntimeError, match="already attached"), collect_router_outputs(model):
        with collect_router_outputs(model):
            pass


# ----------------------------------------------------------------------------------------------------------
# The CPU recipe
# ----------------------------------------------------------------------------------------------------------


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_the_moe_recipe_is_the_quickstart_on_a_mixture_of_experts():
    """configs/quickstart-moe.toml loads and validates, names an MoE preset, runs in exact mode with the router
    losses off, and differs from configs/quickstart.toml (tuned by hand; its figures are the recipe's baseline)
    only where it says so: the run's name and folder and the model."""
    from pathlib import Path

    from exactrl.config import config_to_dict, load_config

    root = Path(__file__).resolve().parents[2] / "configs"
    moe, dense = load_config(root / "quickstart-moe.toml"), load_config(root / "quickstart.toml")
    moe.validate()
    cfg = preset(moe.model.preset)
    assert cfg.num_experts > cfg.num_experts_per_tok >= 1 and any(
        cfg.is_moe_layer(i) for i in range(cfg.num_layers)
    )
    assert moe.run.exact and moe.train.moe_aux_loss_coef == 0 and moe.train.moe_z_loss_coef == 0
    a, b = _flat(config_to_dict(moe)), _flat(config_to_dict(dense))
    assert {k for k in a if a[k] != b.get(k)} == {"run.name", "run.output_dir", "model.preset"}
    assert moe.run.output_dir == "runs/quickstart-moe"
