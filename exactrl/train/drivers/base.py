"""The step driver interface: one RL step, whatever overlaps what.

`RLRun` (exactrl/train/loop.py) sets a run up and then calls `driver.step()` once per step. A driver owns the
order of a step's generation, scoring, guard and update (synchronous, tail overlap, one step off, partial
rollouts) and whatever it keeps between steps (a batch sampled ahead, the groups in flight), which travels with
the checkpoint. The stages themselves (prompts, rollout, score, update, the replay reports, the step's metrics) are
a `RunStages` (exactrl/train/stages.py), handed to the driver in a `StepContext`: a driver sees those and nothing
else of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from exactrl.config import RunConfig
from exactrl.distributed.env import DistContext
from exactrl.train.stages import RunStages, StepState
from exactrl.train.trainer import PolicyTrainer

__all__ = ["StepContext", "StepDriver", "StepState", "Writer"]

if TYPE_CHECKING:
    from exactrl.algorithms import KLController
    from exactrl.train.drivers.disagg import WeightSync
    from exactrl.train.phases import MemoryPhases

# A checkpoint's extra writer: called with the checkpoint's directory (or, sharded, this rank's share of it).
Writer = Callable[[Path], None]


@dataclass
class StepContext:
    """What a step driver may use of the run."""

    cfg: RunConfig
    state: StepState
    stages: RunStages  # the step's work, typed (exactrl/train/stages.py)
    dist: DistContext
    device: torch.device
    engine: Any  # the RolloutEngine, or a disaggregated trainer's RemoteEngine
    phases: MemoryPhases  # the generation/training phase switches (KV cache, replica)
    weights: WeightSync  # the engine's (and the generators') weights after an update
    trainer: PolicyTrainer
    kl_ctl: KLController
    out: Callable[..., Any]


class StepDriver(Protocol):
    """One RL step per `step()`, and the state a checkpoint must keep between two steps."""

    def step(self) -> dict[str, float]:
        """Run step `state.step` (prompts -> rollout -> score -> update, in the driver's order); returns its
        metrics, `state.step` advanced by one."""
        ...

    def restore(self, directory: Path) -> None:
        """After the run's checkpoint at `directory` loaded (weights, `state.step`): the driver's own state."""
        ...

    def checkpoint_writers(self) -> tuple[Writer | None, Writer | None]:
        """The driver's state for the checkpoint being written now: (a writer of the checkpoint's directory, a
        writer of this rank's share of a sharded one); None where there is nothing to write."""
        ...

    def close(self) -> None:
        """Wait for work still running (a step failed under it)."""
        ...
