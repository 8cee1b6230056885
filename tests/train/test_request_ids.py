"""Sampling keys never repeat within a run: each RL step's requests get ids no earlier step used, and the held-out
evaluations draw from noise of their own. (An audit found a loop whose request ids restarted every step: the
noise repeated, and a prompt seen again got the identical group of completions.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exactrl.config import load_config
from exactrl.engine.engine import RolloutEngine
from exactrl.train.loop import train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_sampling_keys_never_repeat_across_steps_or_with_evaluation(tmp_path, monkeypatch, one_thread):
    calls: list[tuple[int, list[int], int]] = []  # (seed, request ids, samples per request) of every generate
    real = RolloutEngine.generate

    def record(self, prompts, params, request_ids=None, progress=None):
        ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
        calls.append((params.seed, ids, params.n))
        return real(self, prompts, params, request_ids=request_ids, progress=progress)

    monkeypatch.setattr(RolloutEngine, "generate", record)
    cfg = load_config(
        ROOT / "configs" / "quickstart.toml",
        [
            f"run.output_dir={tmp_path / 'run'}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.report=false",
            "train.steps=3",
            "train.warmup_steps=0",
            "sft.steps=0",
            "algorithm.rollouts_per_step=8",
            "algorithm.group_size=4",
            "sampling.max_tokens=2",
            "task.num_eval=4",
            "task.eval_every=2",  # an evaluation between RL steps too
        ],
    )
    train(cfg, out=lambda *_: None)
    seed = cfg.run.seed
    rl = [c for c in calls if c[0] == seed]
    evals = [c for c in calls if c[0] != seed]
    assert len(rl) == 3 and len(evals) == 3  # before RL, after step 2, after RL

    def keys(cs):
        return [(s, rid, j) for s, ids, n in cs for rid in ids for j in range(n)]

    rl_keys = keys(rl)
    assert len(rl_keys) == 3 * 8 and len(set(rl_keys)) == len(rl_keys), (
        "a sampling key repeated across RL steps"
    )
    assert not set(keys(evals)) & set(rl_keys), "an evaluation reuses the noise of a training rollout"
