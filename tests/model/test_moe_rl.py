"""RL on the tiny MoE preset, a few steps on the CPU in exact mode, every rollout logprob bitwise equal to the
trainer's on every step (the guard compares them before each update): GRPO, whose updates move the router and the
experts (so later steps sample from changed routing); PPO with a critic (fast mode the negative control); and
multi-turn episodes of the guessing game with the router's auxiliary losses on."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exactrl.config import apply_overrides, config_from_dict
from exactrl.model.config import preset
from exactrl.model.qwen import build_model
from exactrl.train.loop import train

PLUGIN = "exactrl_test_moe_rewards"
PLUGIN_SOURCE = '''
import hashlib


def hashed(completion, answer, example):
    """A reward that varies within a group (a random tiny model never solves arithmetic): non-zero advantages."""
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4
'''

BASE = {
    "run": {
        "name": "moe",
        "seed": 0,
        "device": "cpu",
        "exact": True,
        "tensorboard": False,
        "report": False,
        "progress": False,
    },
    "model": {"preset": "tiny-moe", "dtype": "float32"},
    "engine": {"block_size": 16, "max_num_seqs": 64, "max_model_len": 64},
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
    "algorithm": {"name": "grpo", "group_size": 4, "rollouts_per_step": 8, "aggregation": "token-mean"},
    "train": {"steps": 3, "lr": 1e-3, "max_tokens_per_microbatch": 4096, "save_every": 3},
    "sft": {"steps": 0},
}


@pytest.fixture
def plugin(tmp_path):
    (tmp_path / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    yield
    sys.path.remove(str(tmp_path))
    sys.modules.pop(PLUGIN, None)


def test_grpo_on_tiny_moe_is_exact_every_step(tmp_path, plugin):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: spinning OpenMP threads slow tiny runs down
    try:
        cfg = apply_overrides(config_from_dict(BASE), [f"run.output_dir={tmp_path / 'run'}"])
        cfg.validate()
        summary = train(cfg, out=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    run = Path(summary.get("run_dir", tmp_path / "run"))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["mismatch/num_tokens"] > 0 and r["mismatch/num_mismatched_tokens"] == 0, r["step"]
    assert summary["mismatched_tokens_total"] == 0
    # The updates reached the router and the experts: the saved policy is not the initial model.
    root = run / "checkpoints"
    saved = load_file(str(root / (root / "latest").read_text().strip() / "policy" / "model.safetensors"))
    init = build_model(preset("tiny-moe", vocab_size=saved["model.embed_tokens.weight"].shape[0]), seed=0)
    start = init.state_dict()
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.2.mlp.experts.0.down_proj.weight"):
        assert not torch.equal(saved[name], start[name].float()), name


# ----------------------------------------------------------------------------------------------------------
# PPO with a critic, and multi-turn episodes, on tiny-moe
# ----------------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "model.preset=tiny-moe",
    "train.steps=2",
    "train.warmup_steps=0",
    "sft.steps=0",
    "algorithm.rollouts_per_step=8",
    "algorithm.group_size=4",
    "task.num_eval=4",
    "task.eval_every=0",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
    "sampling.temperature=0.9",
    "sampling.max_tokens=4",
]


def _run(tmp_path: Path, config: str, *extra: str) -> tuple[dict, list[dict]]:
    from exactrl.config import load_config

    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config(ROOT / "configs" / config, [*SHORT, f"run.output_dir={out}", *extra])
        summary = train(cfg, out=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return summary, rows


def test_ppo_with_a_critic_on_tiny_moe_is_exact(tmp_path, plugin):
    """PPO: the critic (a value head on its own copy of the MoE backbone) trains beside the policy; every
    rollout logprob equals the trainer's, and the router metrics are logged. Fast mode is the negative control."""
    summary, rows = _run(tmp_path, "quickstart-ppo.toml", f'reward.functions=["{PLUGIN}:hashed"]')
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["mismatch/num_tokens"] > 0 and r["mismatch/num_mismatched_tokens"] == 0, r["step"]
        assert r["critic/grad_norm"] > 0 and 1.0 <= r["moe/load_max_over_mean"] <= 8.0
    assert summary["mismatched_tokens_total"] == 0
    _, fast = _run(tmp_path / "fast", "quickstart-ppo.toml", f"reward.functions=[\"{PLUGIN}:hashed\"]",
                   "run.exact=false", "train.steps=1")  # fmt: skip
    assert fast[0]["mismatch/num_mismatched_tokens"] > 0


def test_multi_turn_episodes_on_tiny_moe_are_exact_with_the_router_losses_on(tmp_path):
    """The guessing game: observations prefilled on the cached conversation and masked out of the loss; every
    model token of every turn compared, none differs, with the load-balancing and z losses in the objective."""
    summary, rows = _run(
        tmp_path,
        "quickstart.toml",
        "env.name=guess",
        "env.max_turns=3",
        "env.max_episode_tokens=64",
        "train.moe_aux_loss_coef=0.01",
        "train.moe_z_loss_coef=0.001",
    )
    assert max(r["env/turns_mean"] for r in rows) > 1
    for r in rows:
        assert r["mismatch/num_tokens"] == r["mismatch/completion_tokens"] == 8 * r["env/model_tokens_mean"]
        assert r["mismatch/num_mismatched_tokens"] == 0
        assert r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0
    assert summary["mismatched_tokens_total"] == 0
