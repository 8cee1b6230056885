"""Environments for multi-turn episodes (tools, games) and the driver that runs them on the engine.

The driver's names (`run_episodes`, `Episode`, ...) load on first use: an environment's module imports
`exactrl.envs` for `Environment` and `StepResult`, and a worker process that runs it (exactrl.envs.workers) then
imports neither torch nor the engine."""

from typing import Any

from exactrl.envs.base import (
    AsyncEnvironment,
    Demonstration,
    Environment,
    StepResult,
    Turn,
)
from exactrl.envs.registry import env_factory, resolve_env

_DRIVER = ("EnvSetup", "Episode", "EpisodeBatch", "EpisodeSettings", "episode_metrics", "run_episodes")


def __getattr__(name: str) -> Any:
    if name in _DRIVER:
        from exactrl.envs import rollout

        return getattr(rollout, name)
    raise AttributeError(f"module 'exactrl.envs' has no attribute {name!r}")


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
