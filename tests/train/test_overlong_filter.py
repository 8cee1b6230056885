"""DAPO's overlong filtering (algorithm.overlong_filter) in the trainer: a truncated rollout leaves the loss (and the
token-mean's divisor), and its tokens are still checked by exact mode's guard, on the device's gate as well as on the
host, so a difference there still fails closed with no update applied.

Rollouts are real: sampled by the engine from the tiny model the trainer then updates (their recorded logprobs are
the trainer's, bit for bit); which ones count as truncated is set by hand, the flag being all the trainer reads."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from exactrl.config import load_config
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model.loading import load_policy
from exactrl.train.loop import trainer_settings
from exactrl.train.optim import MasterAdamW
from exactrl.train.trainer import MismatchError, PolicyTrainer, Rollout

ROOT = Path(__file__).resolve().parents[2]
CUT = (1, 5)  # the rollouts marked truncated


@pytest.fixture(scope="module")
def sampled():
    torch.manual_seed(0)
    cfg = load_config(ROOT / "configs/quickstart.toml", ["sampling.temperature=1.0", "sampling.max_tokens=5"])
    model, _ = load_policy(preset_name="tiny", device="cpu", dtype="float32", exact=True, seed=0)
    engine = RolloutEngine(model, EngineConfig(block_size=16, max_model_len=64, cuda_graphs=False))
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    outs = engine.generate(
        prompts, SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=3), request_ids=[0, 1]
    )
    rollouts = []
    for o, p in zip(outs, prompts):
        for j, s in enumerate(o.samples):
            i = len(rollouts)
            rollouts.append(
                Rollout(
                    prompt_ids=p,
                    completion_ids=s.token_ids,
                    rollout_logprobs=s.rollout_logprobs,
                    truncated=i in CUT,
                    advantage=float(i % 3) - 1.0,  # varied: every rollout moves the loss
                    request_id=o.request_id,
                    sample_index=j,
                )
            )
    return cfg, model, rollouts


def _trainer(cfg, model, *, overlong_filter: bool = False) -> PolicyTrainer:
    m = copy.deepcopy(model)
    s = trainer_settings(
        dataclasses.replace(
            cfg, algorithm=dataclasses.replace(cfg.algorithm, overlong_filter=overlong_filter)
        )
    )
    return PolicyTrainer(m, s, MasterAdamW(m, lr=1e-3))


def test_truncated_rollouts_leave_the_loss_not_the_guard(sampled):
    cfg, model, rollouts = sampled
    b = _trainer(cfg, model, overlong_filter=True).prepare(rollouts)
    for i, r in enumerate(rollouts):
        n = len(r.completion_ids)
        assert bool(b.full_mask[i, :n].any()) == (i not in CUT), i  # the loss's mask
        assert bool(b.token_mask[i, :n].all()), i  # the guard's: every model token
    assert b.metrics["overlong/filtered_samples"] == len(CUT)
    off = _trainer(cfg, model).prepare(rollouts)
    assert bool(off.full_mask.eq(off.token_mask).all()) and "overlong/filtered_samples" not in off.metrics

    # The filtered step's loss is the step on the rollouts that were not cut (same per-token losses, same divisor);
    # without the filter it is another one (negative control).
    kept = [r for i, r in enumerate(rollouts) if i not in CUT]
    filtered = _trainer(cfg, model, overlong_filter=True).step(rollouts)
    alone = _trainer(cfg, model).step(kept)
    everything = _trainer(cfg, model).step(rollouts)
    assert math.isclose(filtered["pg_loss"], alone["pg_loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert not math.isclose(everything["pg_loss"], alone["pg_loss"], rel_tol=1e-3)
    # The guard compared every token, the filtered ones included.
    assert filtered["mismatch/num_tokens"] == sum(len(r.completion_ids) for r in rollouts)
    assert filtered["mismatch/num_mismatched_tokens"] == 0 and filtered["optimizer_steps"] == 1


@pytest.mark.parametrize("cut", [CUT, tuple(range(8))], ids=["some", "all"])
def test_a_difference_in_a_filtered_rollout_fails_closed(sampled, cut):
    """One recorded logprob one ulp off, in a rollout the filter keeps out of the loss: abort, weights untouched.
    (A gate on the loss mask would let the update through and find the difference only afterwards.) With every
    rollout cut there is no loss token at all, and the scoring pass checks instead."""
    cfg, model, rollouts = sampled
    bad = [dataclasses.replace(r, truncated=i in cut) for i, r in enumerate(rollouts)]
    lp = bad[cut[0]].rollout_logprobs.clone()
    lp[0] = torch.nextafter(lp[0], torch.tensor(0.0))
    bad[cut[0]] = dataclasses.replace(bad[cut[0]], rollout_logprobs=lp)
    tr = _trainer(cfg, model, overlong_filter=True)
    before = [p.detach().clone() for p in tr.model.parameters()]
    with pytest.raises(MismatchError):
        tr.step(bad)
    assert all(torch.equal(a, p) for a, p in zip(before, tr.model.parameters()))
    # The same batch with the true logprobs trains (so the abort above was the guard's, not the filter's).
    ok = [dataclasses.replace(r, truncated=i in cut) for i, r in enumerate(rollouts)]
    m = _trainer(cfg, model, overlong_filter=True).step(ok)
    assert m["mismatch/num_tokens"] == sum(len(r.completion_ids) for r in ok)
    assert m["mismatch/num_mismatched_tokens"] == 0


def test_fed_step_filters_the_same(sampled):
    """The tail overlap's accumulated step (groups fed as they finish): the same loss as the whole filtered step, the
    same count, every token checked."""
    cfg, model, rollouts = sampled
    whole = _trainer(cfg, model, overlong_filter=True).step(rollouts)
    tr = _trainer(cfg, model, overlong_filter=True)
    acc = tr.begin_accumulation()
    for piece in (rollouts[4:], rollouts[:4]):  # groups arrive in another order
        tr.accumulate(acc, piece)
    fed = tr.finish_accumulation(acc)
    assert fed["overlong/filtered_samples"] == whole["overlong/filtered_samples"] == len(CUT)
    assert math.isclose(fed["pg_loss"], whole["pg_loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert fed["mismatch/num_tokens"] == whole["mismatch/num_tokens"]
