"""Observation tokens never enter the policy loss, followed along the real seam: episodes from the engine
(exactrl.envs.rollout) -> `RLRun.episodes` (the trainer's Rollouts, with GRPO advantages) -> the trainer's step
batch (`PolicyTrainer.prepare`: the loss mask) -> the loss and its gradient (one optimizer step).

Exact mode's guard compares only the model's tokens, so counting compared tokens cannot see an observation token
that slipped into the loss mask: this test changes what the observation positions would contribute if they were
in the loss (their recorded logprobs, the "old" logprobs of the PPO ratio) and asserts that the updated weights do
not change by a single bit; rewards vary within each group, so the gradient is not zero (a negative control shows
a changed advantage does change the weights)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from exactrl.config import load_config
from exactrl.train.loop import RLRun, trainer_settings
from exactrl.train.optim import MasterAdamW
from exactrl.train.trainer import PolicyTrainer, Rollout

ROOT = Path(__file__).resolve().parents[2]


def _episodes(tmp_path: Path, env: str = "sample_envs:VaryingReward", out=lambda *a: None):
    over = [
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "run.tensorboard=false",
        "run.report=false",
        "sft.steps=0",
        "task.num_eval=4",
        "task.eval_every=0",
        "algorithm.rollouts_per_step=8",
        "algorithm.group_size=4",
        "sampling.temperature=1.0",
        "sampling.max_tokens=4",
        f"env.name={env}",  # tests/envs/sample_envs.py, run in worker processes
        "env.max_turns=2",
        "env.max_episode_tokens=48",
        "train.lr=1e-3",
        "train.warmup_steps=0",
    ]
    cfg = load_config(ROOT / "configs/quickstart.toml", over)
    run = RLRun(cfg, out=out)
    try:
        base = copy.deepcopy(run.model)  # the sampling weights, before any update
        run.stages.open_stream(cfg.run.seed)
        examples, ids, index = run.stages.prompts()
        sr = run.stages.episodes(0, examples, ids, index)
    finally:
        run.close()
    return cfg, base, sr


def _step(cfg, base, rollouts: list[Rollout]) -> tuple[list[torch.Tensor], dict[str, float]]:
    model = copy.deepcopy(base)
    # The guard's device-side gate off ("warn"), so that the loss alone decides the update: with the gate on, an
    # observation token in the loss mask would also be compared (its recorded 0.0 against the trainer's logprob)
    # and every multi-turn update skipped, which the grad_norm check below would catch too.
    settings = dataclasses.replace(trainer_settings(cfg), on_mismatch="warn")
    trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=cfg.train.lr))
    m = trainer.step(rollouts)
    return [p.detach().clone() for p in model.parameters()], m


def test_observation_tokens_never_enter_the_policy_loss(tmp_path):
    cfg, base, sr = _episodes(tmp_path)
    rollouts = sr.rollouts
    assert len(rollouts) == 8 and sr.advantages.abs().sum() > 0  # rewards vary: the loss has a gradient
    masks = [torch.tensor(r.loss_mask, dtype=torch.bool) for r in rollouts]
    assert sum(int((~m).sum()) for m in masks) >= 5 * 4  # most episodes reached their observation
    # The trainer's step batch: the loss mask (and the guard's) is False at every observation token.
    trainer = PolicyTrainer(
        copy.deepcopy(base), trainer_settings(cfg), MasterAdamW(copy.deepcopy(base), lr=0.0)
    )
    b = trainer.prepare(rollouts)
    for i, m in enumerate(masks):
        n = len(m)
        assert torch.equal(b.full_mask[i, :n], m) and torch.equal(b.token_mask[i, :n], m)
        assert not b.full_mask[i, n:].any()
    # What an observation token would add to the loss, changed: its recorded ("old") logprob. Bit for bit the same
    # update, since no observation token is in the loss.
    w, metrics = _step(cfg, base, rollouts)
    assert metrics["grad_norm"] > 0 and metrics["mismatch/num_mismatched_tokens"] == 0
    perturbed = []
    for r, m in zip(rollouts, masks):
        lp = r.rollout_logprobs.clone()
        lp[~m] = -7.0  # was 0.0
        perturbed.append(dataclasses.replace(r, rollout_logprobs=lp))
    w2, _ = _step(cfg, base, perturbed)
    assert all(torch.equal(a, c) for a, c in zip(w, w2))
    # Negative control: the comparison sees a change of the loss (one episode's advantage).
    changed = [dataclasses.replace(r) for r in rollouts]
    changed[0].advantage += 0.5
    w3, _ = _step(cfg, base, changed)
    assert not all(torch.equal(a, c) for a, c in zip(w, w3))


def test_a_step_prints_its_first_environment_error_with_where_it_was_raised(tmp_path):
    """RLRun.episodes prints env_report's lines: the first error with the file and line in the environment that
    raised it, and the warning past env.max_error_share (every call fails here)."""
    lines: list[str] = []
    _, _, sr = _episodes(tmp_path, env="sample_envs:Parser", out=lines.append)
    assert sr.advantage_metrics["env/errors"] == 8 and sr.advantage_metrics["env/error_share"] == 1.0
    first = [x for x in lines if x.startswith("step 1: environment errors: 8 of 8 calls; first: episode")]
    assert len(first) == 1 and "JSONDecodeError" in first[0] and "sample_envs.py:" in first[0]
    assert any(x.startswith("step 1: WARNING: the environment failed on 100% of its calls") for x in lines)
