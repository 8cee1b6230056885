"""Episodes cut by env.max_turns count as truncated, followed along the real seam (issue 55, item 8): a real
environment's episodes from the engine (exactrl.envs.rollout) -> `RLRun.episodes` (the trainer's Rollouts) -> the
step's `response_length/truncated_frac` and DAPO's overlong filter (`PolicyTrainer.prepare`).

The environment (tests/envs/sample_envs.py, `EndsOnEvenToken`) ends an episode after its first turn when the model's
first token is even, and otherwise answers every turn, so that env.max_turns = 2 cuts it: a step of both kinds,
told apart by what the episode holds (a cut episode received an observation, a finished one none), not by the flag
under test."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from exactrl.config import load_config
from exactrl.train.loop import RLRun, trainer_settings
from exactrl.train.optim import MasterAdamW
from exactrl.train.trainer import PolicyTrainer

ROOT = Path(__file__).resolve().parents[2]


def test_episodes_cut_by_max_turns_are_truncated_for_the_metric_and_the_overlong_filter(tmp_path):
    over = [
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "run.tensorboard=false",
        "run.report=false",
        "sft.steps=0",
        "task.num_eval=4",
        "task.eval_every=0",
        "algorithm.rollouts_per_step=16",
        "algorithm.group_size=4",
        "algorithm.overlong_filter=true",
        "sampling.temperature=1.0",
        "sampling.max_tokens=4",
        "env.name=sample_envs:EndsOnEvenToken",
        "env.isolation=thread",
        "env.max_turns=2",
        "env.max_episode_tokens=64",  # room for both turns: only max_turns cuts an episode here
    ]
    cfg = load_config(ROOT / "configs/quickstart.toml", over)
    run = RLRun(cfg, out=lambda *a: None)
    try:
        model = copy.deepcopy(run.model)
        run.stages.open_stream(cfg.run.seed)
        examples, ids, index = run.stages.prompts()
        sr = run.stages.episodes(0, examples, ids, index)
        metrics = run.stages.step_metrics({}, sr)
    finally:
        run.close()
    rollouts = sr.rollouts
    # Cut by max_turns: the episode went on past its first turn (an observation, masked out of the loss, follows it).
    cut = [r.loss_mask is not None and not all(r.loss_mask) for r in rollouts]
    assert len(rollouts) == 16 and 0 < sum(cut) < 16, cut  # both kinds in the step
    assert [r.truncated for r in rollouts] == cut
    assert sr.truncated == cut  # the whole step's (one process: this rank's)
    assert metrics["response_length/truncated_frac"] == sum(cut) / len(cut)
    # DAPO's overlong filter keeps the cut episodes out of the loss, not out of the guard.
    s = trainer_settings(
        dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, overlong_filter=True))
    )
    b = PolicyTrainer(model, s, MasterAdamW(model, lr=0.0)).prepare(rollouts)
    for i, r in enumerate(rollouts):
        n = len(r.completion_ids)
        assert bool(b.full_mask[i, :n].any()) == (not cut[i]), i
        assert int(b.token_mask[i, :n].sum()) == sum(r.loss_mask), i  # the model's tokens, checked
    assert b.metrics["overlong/filtered_samples"] == sum(cut)
