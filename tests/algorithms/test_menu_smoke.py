"""Every advantage estimator and every policy loss of the menu trains a few steps on the CPU quickstart.

A representative subset, not the 63 pairs: pair i takes advantage i mod 9 and loss i mod 7, so every estimator and
every loss trains at least once (9 runs of 2 steps, about a second each on a CPU), plus the adaptive KL controller.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

from exactrl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSS_KINDS
from exactrl.config import apply_overrides, config_from_dict
from exactrl.train.loop import train

PLUGIN = "menu_smoke_reward"
# A deterministic reward in [0, 1] from the completion's text: varied within a group, so the estimators see signal.
PLUGIN_SOURCE = """
import hashlib


def hashed(completion, answer, example):
    return int(hashlib.sha256(completion.encode()).hexdigest()[:4], 16) / 0xFFFF
"""

BASE = {
    "run": {
        "name": "menu",
        "seed": 0,
        "device": "cpu",
        "exact": True,
        "tensorboard": False,
        "report": False,
        "progress": False,
    },
    "model": {"preset": "tiny", "dtype": "float32"},
    "engine": {"block_size": 16, "max_num_seqs": 256, "max_model_len": 64},
    "sampling": {"temperature": 1.0, "max_tokens": 4},
    "task": {
        "name": "arithmetic",
        "arithmetic_max_operand": 30,
        "arithmetic_ops": ["+", "-"],
        "arithmetic_num_terms": 2,
        "use_chat_template": False,
        "num_eval": 4,
        "eval_every": 0,
        "max_prompt_tokens": 16,
    },
    "reward": {"functions": [f"{PLUGIN}:hashed"]},
    "algorithm": {"group_size": 4, "rollouts_per_step": 8, "aggregation": "seq-mean-token-mean"},
    "train": {"steps": 2, "lr": 3e-4, "max_tokens_per_microbatch": 4096, "save_every": 0},
    "sft": {"steps": 0},
}

PAIRS = [(ADVANTAGE_ESTIMATORS[i % 9], POLICY_LOSS_KINDS[i % 7]) for i in range(9)]
# Options so each loss actually does its thing on 8 rollouts of 4 tokens (the defaults select 1 token in 5000).
LOSS_OPTIONS = {
    "clip_cov": ["algorithm.clip_cov_ratio=0.2", "algorithm.clip_cov_lb=-10.0", "algorithm.clip_cov_ub=10.0"],
    "kl_cov": ["algorithm.kl_cov_ratio=0.2"],
    "gspo": ["algorithm.eps_low=3e-4", "algorithm.eps_high=4e-4"],
    "gmpo": ["algorithm.eps_low=0.4", "algorithm.eps_high=0.4"],
}


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("plugin")
    (d / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    sys.path.insert(0, str(d))
    importlib.invalidate_caches()
    yield importlib.import_module(PLUGIN)
    sys.path.remove(str(d))
    sys.modules.pop(PLUGIN, None)


def _run(out_dir: Path, *overrides: str) -> tuple[dict, list[dict]]:
    cfg = apply_overrides(config_from_dict(BASE), [f"run.output_dir={out_dir}", *overrides])
    cfg.validate()
    summary = train(cfg, out=lambda *_: None)
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "phase" not in r and "loss" in r]
    return summary, steps


@pytest.mark.parametrize("advantage,loss", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_every_estimator_and_loss_trains(plugin, tmp_path: Path, advantage: str, loss: str) -> None:  # type: ignore[no-untyped-def]
    overrides = [
        f"algorithm.advantage={advantage}",
        f"algorithm.policy_loss={loss}",
        *LOSS_OPTIONS.get(loss, []),
    ]
    summary, steps = _run(tmp_path, *overrides)
    assert summary["rl_steps"] == 2 and len(steps) == 2
    # The run used the pair it was asked for (not the preset's), and every step updated with finite numbers.
    assert (summary["advantage"], summary["policy_loss"]) == (advantage, loss)
    assert summary["mismatched_tokens_total"] == 0
    for r in steps:
        assert math.isfinite(r["loss"]) and r["optimizer_steps"] >= 1 and r["nan_skipped"] == 0
        if advantage == "remax":  # the greedy baseline rollout ran and was counted
            assert "remax/baseline_reward_mean" in r
        if loss in ("clip_cov", "kl_cov"):
            assert r["cov_select_frac"] > 0


def test_adaptive_kl_controller_moves_the_coefficient(plugin, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    kl = ["algorithm.kl_coef=0.05", "algorithm.kl_controller=adaptive", "algorithm.kl_horizon=10"]
    _, steps = _run(tmp_path, *kl)
    coefs = [r["kl_coef"] for r in steps]
    assert coefs[0] == 0.05 and coefs[1] != 0.05  # step 1 trained with kl_coef; the controller moved it after
