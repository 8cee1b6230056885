"""The step driver interface: one RL step, whatever overlaps what.

`RLRun` (exactrl/train/loop.py) sets a run up and then calls `driver.step()` once per step. A driver owns the
order of a step's generation, scoring, guard and update (synchronous, tail overlap, one step off, partial
rollouts) and whatever it keeps between steps (a batch sampled ahead, the groups in flight), which travels with
the checkpoint. The stages themselves (prompts, rollout, score, update, the replay reports, the step's metrics) are
a `RunStages` (exactrl/train/stages.py), handed to the driver in a `StepContext`: a driver sees those and nothing
else of the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from exactrl.config import RunConfig
from exactrl.distributed.env import DistContext
from exactrl.train.stages import RunStages, StepState
from exactrl.train.trainer import PolicyTrainer

__all__ = ["StepContext", "StepDriver", "StepState", "Writer", "end_of_step"]

if TYPE_CHECKING:
    from exactrl.algorithms import KLController
    from exactrl.train.drivers.disagg import WeightSync
    from exactrl.train.phases import MemoryPhases

# A checkpoint's extra writer: called with the checkpoint's directory (or, sharded, this rank's share of it).
Writer = Callable[[Path], object]  # its result is ignored


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


def end_of_step(
    ctx: StepContext,
    m: dict[str, float],
    sr: Any,
    *,
    generate_s: float,
    train_s: float,
    started: float,
    tokens: float,
    peak_memory: Callable[[], dict[str, float]],
) -> dict[str, float]:
    """The metrics every driver's step ends with, in this order: the step's seconds (generate, train, the whole
    step since `started`), the generation's speed over `tokens`, the device's memory peak (`peak_memory`, read after
    the step's seconds), the advantages' statistics and the KL controller's coefficient (updated from the step's
    KL unless the batch was dropped); then the step's number, and `sr` (the step's StepRollouts) kept as the
    last."""
    m["perf/generate_s"], m["perf/train_s"] = generate_s, train_s
    m["perf/step_s"] = time.perf_counter() - started
    m["perf/tokens_per_s"] = tokens / max(generate_s, 1e-9)
    m.update(peak_memory())
    m.update(sr.advantage_metrics)
    m["kl_coef"] = ctx.kl_ctl.value
    if "kl_ref" in m and not m.get("mismatch/step_skipped"):  # a dropped batch steers nothing
        ctx.kl_ctl.update(m["kl_ref"], len(sr.lengths))
    m["step"] = ctx.state.step
    ctx.state.last_rollouts = sr
    return m


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
