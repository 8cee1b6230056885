"""What a caller that runs the RL loop under conditions of its own puts in place of a run's parts, at build time.

`exactrl bench rl` runs `exactrl train`'s own step on a synthetic workload: its engine plans each sample's length,
its prompts are the workload's, and a timer wraps each stage. It gives these to `RLRun` as a `RunHooks` when it
constructs the run; the run builds its engine, its stages and its step driver (once) with them. `exactrl train`
passes none: the run's own parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from exactrl.config import EngineConfig
from exactrl.engine.engine import RolloutEngine
from exactrl.tasks import Example

# The run's engine from (the model it samples from, the [engine] section, the tokenizer): the evaluation's engine
# on the policy, and the step's on the engine's weight copy where the run keeps one (exactrl/train/loop.py).
EngineFactory = Callable[[Any, EngineConfig, Any], RolloutEngine]


class PromptSource(Protocol):
    """The step's prompts in place of the task's stream: what `RunStages.prompts` returns (the examples, their
    token ids, their indices in the step), for `count` prompts (None: prompts_per_step); shard=False: all of them
    on every rank (partial rollouts)."""

    def __call__(
        self, count: int | None = None, *, shard: bool = True
    ) -> tuple[list[Example], list[list[int]], list[int]]: ...


class StageWrapper(Protocol):
    """(a stage's name in `WRAPPED_STAGES`, the stage) -> what the step driver calls in its place."""

    def __call__(self, name: str, stage: Callable[..., Any]) -> Callable[..., Any]: ...


# The stages a `StageWrapper` is given, by owner: the step's phases on `RunStages` (exactrl/train/stages.py), the
# engine's weight sync on `Parallelism`, the send to the generators on a disaggregated trainer's `RemoteEngine`, and
# partial rollouts' generation (cut by count) on the driver's pool, which takes the place of "rollout" there.
WRAPPED_STAGES = {
    "stages": ("rollout", "rank_scores", "update"),
    "parallel": ("sync_weights",),
    "remote": ("push",),
    "pool": ("generate",),
}


@dataclass(frozen=True)
class RunHooks:
    """A run's parts from its caller (module docstring); each None: the run's own."""

    engine: EngineFactory | None = None
    prompts: PromptSource | None = None
    wrap_stage: StageWrapper | None = None

    def make_engine(self, model: Any, config: EngineConfig, tokenizer: Any) -> RolloutEngine:
        """The run's rollout engine on `model`: the caller's factory's, or a plain `RolloutEngine`."""
        make = self.engine or (lambda m, c, t: RolloutEngine(m, c, tokenizer=t))
        return make(model, config, tokenizer)

    def wrap(self, owners: dict[str, Any]) -> None:
        """Put the wrapper's stages in place on their owners (`WRAPPED_STAGES`' keys; a None owner has none), before
        the driver's first step."""
        if self.wrap_stage is None:
            return
        for key, names in WRAPPED_STAGES.items():
            owner = owners.get(key)
            if owner is None:
                continue
            for name in names:
                setattr(owner, name, self.wrap_stage(name, getattr(owner, name)))
