"""How each rank's sampling metrics combine into the step's (`combine_episode_metrics`): a single-turn run's parts
carry only non-environment keys (dynamic sampling's, the same on every rank) and must pass through; a multi-turn
run's env/* keys combine as one process over every episode would log them."""

from __future__ import annotations

from exactrl.envs.rollout import combine_episode_metrics


def test_parts_without_environment_keys_pass_through():
    # DAPO's dynamic sampling under torchrun, single-turn: no env/episodes on any rank (this raised KeyError)
    parts = [{"dynamic_sampling/rounds": 2.0, "dynamic_sampling/kept_groups": 4.0}] * 2
    assert combine_episode_metrics(parts) == parts[0]
    assert combine_episode_metrics([{}, {}]) == {}


def test_episode_keys_combine_over_ranks():
    a = {"env/episodes": 2.0, "env/turns_mean": 1.5, "env/turns_max": 2.0, "env/calls": 3.0, "env/errors": 1.0,
         "env/error_share": 1 / 3, "dynamic_sampling/rounds": 1.0}  # fmt: skip
    b = {"env/episodes": 1.0, "env/turns_mean": 3.0, "env/turns_max": 3.0, "env/calls": 3.0, "env/errors": 0.0,
         "env/error_share": 0.0, "dynamic_sampling/rounds": 1.0}  # fmt: skip
    out = combine_episode_metrics([a, b])
    assert out["env/episodes"] == 3.0 and out["env/turns_max"] == 3.0 and out["env/calls"] == 6.0
    assert out["env/turns_mean"] == 2.0  # (1.5 * 2 + 3 * 1) / 3
    assert out["env/error_share"] == 1 / 6 and out["dynamic_sampling/rounds"] == 1.0
