"""`algorithm.advantage` / `algorithm.policy_loss` / `algorithm.name` as a preset: every shipped config keeps its
meaning, the new keys resolve and validate, and the config's loss options are what `policy_loss_terms` takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exactrl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSS_KINDS, policy_loss_terms
from exactrl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
PRESET = ["model.preset=tiny"]  # a config needs a model to validate

# What each algorithm.name meant before the two keys existed, read off the code of that time: the loop picked
# rloo_advantages for "rloo", grpo_advantages(scale="none") for "dr_grpo", GAE with a critic for "ppo" and
# grpo_advantages(scale=adv_scale) otherwise; the trainer's POLICY_KIND mapped "gspo" to the GSPO loss and every
# other name to PPO-clip. Written out here, independently of exactrl.config.ALGORITHM_PRESETS.
MEANT_BEFORE = {
    "grpo": ("grpo", "ppo_clip"),
    "dr_grpo": ("dr_grpo", "ppo_clip"),
    "rloo": ("rloo", "ppo_clip"),
    "gspo": ("grpo", "gspo"),
    "ppo": ("gae", "ppo_clip"),
}


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_means_what_it_meant(path: Path) -> None:
    a = load_config(path).algorithm
    assert (a.resolved_advantage, a.resolved_policy_loss) == MEANT_BEFORE[a.name]
    assert a.needs_critic == (a.name == "ppo")


@pytest.mark.parametrize("name", sorted(MEANT_BEFORE))
def test_every_preset_means_what_it_meant(name: str) -> None:
    a = load_config(None, [*PRESET, f"algorithm.name={name}"]).algorithm
    assert (a.resolved_advantage, a.resolved_policy_loss) == MEANT_BEFORE[name]
    assert a.resolved_whiten_advantages == (name == "ppo")


def test_the_keys_override_their_half_of_the_preset() -> None:
    a = load_config(None, [*PRESET, "algorithm.policy_loss=cispo"]).algorithm
    assert (a.resolved_advantage, a.resolved_policy_loss) == ("grpo", "cispo")
    a = load_config(None, [*PRESET, "algorithm.advantage=rloo", "algorithm.policy_loss=cispo"]).algorithm
    assert (a.resolved_advantage, a.resolved_policy_loss) == ("rloo", "cispo")
    a = load_config(None, [*PRESET, "algorithm.name=gspo", "algorithm.advantage=opo"]).algorithm
    assert (a.resolved_advantage, a.resolved_policy_loss) == ("opo", "gspo")
    a = load_config(None, [*PRESET, "algorithm.name=ppo", "algorithm.whiten_advantages=false"]).algorithm
    assert a.needs_critic and not a.resolved_whiten_advantages
    a = load_config(None, [*PRESET, "algorithm.advantage=gae"]).algorithm
    assert a.needs_critic and a.resolved_whiten_advantages


def test_the_config_offers_exactly_the_implemented_menu() -> None:
    from typing import get_args

    from exactrl.config import AdvantageName, PolicyLossName

    assert set(get_args(AdvantageName)) == set(ADVANTAGE_ESTIMATORS)
    assert set(get_args(PolicyLossName)) == set(POLICY_LOSS_KINDS)


@pytest.mark.parametrize("loss", POLICY_LOSS_KINDS)
def test_policy_loss_kwargs_are_accepted_by_the_loss(loss: str) -> None:
    a = load_config(None, [*PRESET, f"algorithm.policy_loss={loss}"]).algorithm
    kw = a.policy_loss_kwargs()
    assert kw["kind"] == loss
    lp = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    total, metrics = policy_loss_terms(lp, lp + 0.1, torch.randn(3, dtype=torch.float64), mask, **kw)
    assert torch.isfinite(total) and "cov_select_frac" in metrics


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["algorithm.policy_loss=geo_mean"], "algorithm.policy_loss"),
        (["algorithm.advantage=grpo_passk"], "algorithm.advantage"),
        (["algorithm.policy_loss=sapo", "algorithm.dual_clip=3.0"], "algorithm.dual_clip"),
        (
            ["algorithm.advantage=rloo", "algorithm.group_size=1", "algorithm.rollouts_per_step=4"],
            "algorithm.group_size",
        ),
        (["algorithm.advantage=reinforce_plus_plus", "algorithm.gamma=0.99"], "algorithm.gamma"),
        (["algorithm.kl_controller=adaptive"], "algorithm.kl_controller"),
        (
            ["algorithm.kl_controller=adaptive", "algorithm.kl_coef=0.1", "algorithm.kl_target=0"],
            "algorithm.kl_target",
        ),
        (["algorithm.kl_horizon=0"], "algorithm.kl_horizon"),
        (["algorithm.clip_cov_ratio=0"], "algorithm.clip_cov_ratio"),
        (["algorithm.clip_cov_lb=6.0"], "algorithm.clip_cov_lb"),
        (["algorithm.sapo_tau_neg=-1.0"], "algorithm.sapo_tau_neg"),
    ],
)
def test_bad_menu_settings_name_their_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [*PRESET, *overrides])
    assert err.value.key == key or key in str(err.value)
