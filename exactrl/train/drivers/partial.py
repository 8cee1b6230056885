"""Partial rollouts (algorithm.partial_rollouts, max_off_policy_steps = k >= 2): the one-step-off step whose
generation is cut by a count of finished groups, the unfinished samples carried to the next generation.

The step itself is one step off's (exactrl/train/drivers/offpolicy.py); what differs is how a batch is sampled
(the pool's generation, `PartialRollouts.batch`), what its staleness metrics say (a sequence may span versions),
and the pool of groups in flight, which travels with the checkpoint. Why the bits stay right:
exactrl/train/partial.py. One process only (refused under torchrun).
"""

from __future__ import annotations

from pathlib import Path

import torch

from exactrl.train.drivers.base import StepContext, Writer
from exactrl.train.drivers.offpolicy import OneStepOffDriver
from exactrl.train.offpolicy import BehaviourBatch, BehaviourPolicy, save_pending, staleness_metrics
from exactrl.train.partial import PartialRollouts


class PartialDriver(OneStepOffDriver):
    """One step off with the generation cut by count; `pool`: the groups in flight between generations."""

    def __init__(self, ctx: StepContext, behaviour: BehaviourPolicy, step_rollouts_cls: type) -> None:
        super().__init__(ctx, behaviour, step_rollouts_cls)
        a = ctx.cfg.algorithm
        self.pool = PartialRollouts(
            a.max_off_policy_steps, a.prompts_per_step, a.partial_extra_groups, a.group_size
        )

    def batch(self, step: int) -> BehaviourBatch:
        """Step `step`'s batch from the pool's generation, cut by count, checked by the guard (train/partial.py)."""
        self.ctx.phases.size(self.ctx.engine)  # the plan's KV size (it counts the groups in flight)
        return self.pool.batch(self.ctx, self.behaviour, step)

    def staleness(self, batch: BehaviourBatch, step: int, masks: list[torch.Tensor]) -> dict[str, float]:
        """Versions behind per token and per sequence's oldest token, and the generation's cut, carried and
        recomputed counts."""
        return {**staleness_metrics(batch, step, masks, mixed=True), **batch.partial}

    def restore_pool(self, directory: Path) -> None:
        """The groups in flight the checkpoint holds; without them, a fresh pool whose request ids start past every
        id the checkpoint's run can have used."""
        if not self.pool.load(directory):
            # Request ids key the sampling noise: start past every id the checkpoint's run can have used (at most
            # (step + 1) x the groups in flight), so no prompt reuses an earlier prompt's noise.
            a = self.ctx.cfg.algorithm
            self.pool.next_request_id = (self.ctx.state.step + 1) * (
                a.prompts_per_step + a.partial_extra_groups
            )
            self.ctx.out(
                "partial rollouts: the checkpoint holds no samples in flight; the run starts a fresh pool"
            )

    def checkpoint_writers(self) -> tuple[Writer | None, Writer | None]:
        """The batch sampled ahead (if any) and the pool travel with the checkpoint (one process: never sharded)."""
        pending, pool = self.pending, self.pool

        def write(d: Path) -> None:
            if pending is not None:
                save_pending(d, pending)
            pool.save(d)

        return write, None
