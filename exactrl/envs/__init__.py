"""Environments for multi-turn episodes (tools, games) and the driver that runs them on the engine."""

from exactrl.envs.base import (
    AsyncEnvironment,
    Demonstration,
    Environment,
    StepResult,
    Turn,
    env_factory,
    resolve_env,
)
from exactrl.envs.rollout import (
    EnvSetup,
    Episode,
    EpisodeBatch,
    EpisodeSettings,
    episode_metrics,
    run_episodes,
)

__all__ = [
    "AsyncEnvironment",
    "Demonstration",
    "EnvSetup",
    "Environment",
    "Episode",
    "EpisodeBatch",
    "EpisodeSettings",
    "StepResult",
    "Turn",
    "env_factory",
    "episode_metrics",
    "resolve_env",
    "run_episodes",
]
