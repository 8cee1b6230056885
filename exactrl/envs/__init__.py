"""Environments for multi-turn episodes (tools, games) and the driver that runs them on the engine."""

from exactrl.envs.base import AsyncEnvironment, Environment, StepResult, Turn, resolve_env
from exactrl.envs.rollout import Episode, EpisodeBatch, EpisodeSettings, episode_metrics, run_episodes

__all__ = [
    "AsyncEnvironment",
    "Environment",
    "Episode",
    "EpisodeBatch",
    "EpisodeSettings",
    "StepResult",
    "Turn",
    "episode_metrics",
    "resolve_env",
    "run_episodes",
]
