"""The step driver interface: one RL step, whatever overlaps what.

`RLRun` (exactrl/train/loop.py) sets a run up and then calls `driver.step()` once per step. A driver owns the
order of a step's generation, scoring, guard and update (synchronous, tail overlap, one step off, partial
rollouts) and whatever it keeps between steps (a batch sampled ahead, the groups in flight), which travels with
the checkpoint. The stages themselves (prompts, rollout, score, update, the replay reports, the step's metrics) are
the run's, handed to the driver in a `StepContext`: a driver sees those and nothing else of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from exactrl.config import RunConfig
from exactrl.distributed.env import DistContext
from exactrl.train.trainer import PolicyTrainer

if TYPE_CHECKING:
    from exactrl.algorithms import KLController
    from exactrl.train.drivers.disagg import WeightSync
    from exactrl.train.phases import MemoryPhases

# A checkpoint's extra writer: called with the checkpoint's directory (or, sharded, this rank's share of it).
Writer = Callable[[Path], None]


@dataclass
class StepState:
    """What the run and its driver share from step to step."""

    step: int = 0  # steps done (the next step's index)
    model_tokens: int = 0  # the last scored batch's sampled (model) tokens over every rank
    last_rollouts: Any = None  # the last step's StepRollouts (sample logging, `exactrl bench rl`)


@dataclass
class Stages:
    """The run's stages a driver calls (`RLRun`'s methods of the same names; tests and `exactrl bench rl` wrap
    them on the run before its driver is made)."""

    set_lr: Callable[[int], None]
    prompts: Callable[..., tuple[list[Any], list[list[int]], list[int]]]
    sampling_params: Callable[[], Any]
    rollout: Callable[..., list[Any]]  # (step, prompt_ids, index, round_=0) -> [RequestOutput]
    score: Callable[..., Any]  # (step, examples, prompt_ids, outs, baseline=None) -> StepRollouts
    rank_scores: Callable[..., Any]  # this rank's share, no collective -> RankScores
    step_scores: Callable[..., Any]  # (RankScores, baseline) -> StepRollouts (collectives)
    dynamic_scores: Callable[..., Any]  # algorithm.dynamic_sampling's rounds -> RankScores
    episodes: Callable[..., Any]  # multi-turn -> StepRollouts
    rank_episodes: Callable[..., Any]  # multi-turn, this rank's episodes, no collective -> RankScores
    greedy_baseline: Callable[..., torch.Tensor]  # ReMax, collectives
    greedy_rewards: Callable[..., list[float]]  # ReMax, this rank's, no collective
    gather_baseline: Callable[[list[float]], torch.Tensor]
    with_advantages: Callable[..., Any]
    update: Callable[..., dict[str, float]]  # (step, rollouts, off_policy_cap=None) -> the trainer's metrics
    step_metrics: Callable[[dict[str, float], Any], dict[str, float]]
    # (step, rollouts, MismatchError, model=None) -> the replay report's path
    mismatch_report: Callable[..., Any]
    # (step, StepRollouts, MismatchError): an abort's log lines and report
    mismatch_abort: Callable[..., None]
    abort_notice: Callable[[int, str, Any], None]  # (step, what, report path): an abort's log lines


@dataclass
class StepContext:
    """What a step driver may use of the run."""

    cfg: RunConfig
    state: StepState
    stages: Stages
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
