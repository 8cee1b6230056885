"""Partial rollouts (algorithm.partial_rollouts, max_off_policy_steps = k >= 2): the one-step-off step whose
generation is cut by a count of finished groups, the unfinished samples carried to the next generation.

The step itself is one step off's (exactrl/train/drivers/offpolicy.py); what differs is how a batch is sampled
(the pool's generation, `PartialRollouts.sample` and `gather`), what its staleness metrics say (a sequence may span
versions), and the pool of groups in flight, which travels with the checkpoint. Why the bits stay right:
exactrl/train/partial.py.

Under torchrun every rank keeps a pool of its own: its share of prompts_per_step (`DistContext.shard`) plus extra
groups sized from that share, cut by its own count. The cut is per rank, not global: the generation runs in the
worker thread, which issues no collective (exactrl/train/offpolicy_dist.py), so no rank may wait on another's count
mid-generation. Every rank then trains exactly its share of groups every step (as the synchronous run), and a rank's
generation depends on its own pool alone, which is what lets a disaggregated generator run each trainer's
generation as that trainer's colocated engine would. The result depends on the world size (which samples finish
first within a rank's pool), as the gradient reduction order already does. Each rank's pool is in the checkpoint
(`offpolicy_partial/rank<r>-of-<N>/`, beside one step off's pending shares); a resume at another world size starts
fresh pools (said in the log), their request ids past every id the checkpoint's run used.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from exactrl.distributed.env import DistContext
from exactrl.train.checkpoint import PARTIAL_FILE, POOLS_DIR
from exactrl.train.drivers.base import StepContext, Writer
from exactrl.train.drivers.offpolicy import OneStepOffDriver
from exactrl.train.offpolicy import BehaviourBatch, BehaviourPolicy, save_pending
from exactrl.train.offpolicy_dist import RankSample, save_rank_pending, step_staleness
from exactrl.train.partial import PartialRollouts

_RANK_NAME = re.compile(r"rank(\d+)-of-(\d+)")


class PartialDriver(OneStepOffDriver):
    """One step off with the generation cut by count; `pool`: this rank's groups in flight between generations."""

    defers_guard = False  # the next generation starts from the pool the guard may thin out

    def __init__(self, ctx: StepContext, behaviour: BehaviourPolicy, step_rollouts_cls: type) -> None:
        super().__init__(ctx, behaviour, step_rollouts_cls)
        a, d = ctx.cfg.algorithm, ctx.dist
        if a.prompts_per_step < d.world_size:
            raise ValueError(
                f"algorithm.partial_rollouts at {d.world_size} trainer ranks needs at least one prompt per rank and "
                f"step: algorithm.rollouts_per_step / group_size = {a.prompts_per_step}; raise rollouts_per_step"
            )
        share, extra = a.partial_groups(d.rank, d.world_size)
        self.pool = PartialRollouts(a.max_off_policy_steps, share, extra, a.group_size)

    def in_flight(self) -> int:
        """The groups in flight over every rank at a generation (request ids advance by at most this much)."""
        a, ws = self.ctx.cfg.algorithm, self.ctx.dist.world_size
        return sum(sum(a.partial_groups(r, ws)) for r in range(ws))

    def batch(self, step: int) -> BehaviourBatch:
        """Step `step`'s batch from the pool's generation, cut by count, checked by the guard (train/partial.py):
        sampled and gathered here (the first step, after a resume; one process: in the worker)."""
        if self.pool.top_ups is None:  # the first generation (a collective: the main thread's)
            self.pool.agree_top_ups(self.ctx.dist)
        return super().batch(step)

    def sample(self, step: int, check: bool = True) -> RankSample:
        """This rank's generation, cut by its own count, checked by the guard with `check` (no collective: under
        torchrun the worker runs it)."""
        self.ctx.phases.size(self.ctx.engine)  # the plan's KV size (it counts the groups in flight)
        return self.pool.sample(self.ctx, self.behaviour, step, check=check)

    def check(self, s: RankSample, on: BehaviourPolicy | None = None) -> RankSample:
        """The guard on this rank's generation, on the engine's copy; a carried group it refused leaves the
        pool."""
        if on is not None:
            raise ValueError("partial rollouts check on the engine's copy (the guard is not deferred)")
        return self.pool.check(self.ctx, self.behaviour, s)  # type: ignore[arg-type]

    def gather(self, step: int, s: RankSample, checked: bool = True) -> BehaviourBatch:
        """Every rank's generation as the step's batch (collectives, the main thread's); always checked here
        (`defers_guard` is off)."""
        if not checked:
            raise ValueError("partial rollouts do not defer the guard")
        return self.pool.gather(self.ctx, s, step)  # type: ignore[arg-type]

    def staleness(self, batch: BehaviourBatch, step: int, masks: list[torch.Tensor]) -> dict[str, float]:
        """Versions behind per token and per sequence's oldest token (over every rank), and the generation's cut,
        carried and recomputed counts."""
        return {**step_staleness(self.ctx.dist, batch, step, masks, mixed=True), **batch.partial}

    def restore_pool(self, directory: Path) -> None:
        """The groups in flight the checkpoint holds for this rank (saved at this world size); otherwise a fresh
        pool whose request ids start past every id the checkpoint's run can have used."""
        d = self.ctx.dist
        saved, next_id = pools_in(directory)
        if saved == d.world_size:
            here = (
                directory if saved == 1 and not (directory / POOLS_DIR).is_dir() else _rank_dir(directory, d)
            )
            self.pool.load(here)
            self.pool.agree_top_ups(d)  # the next generation may be the worker's (a pending batch came back)
            return
        if next_id is None:
            # Request ids key the sampling noise: start past every id the checkpoint's run can have used (at most
            # (step + 1) x the groups in flight), so no prompt reuses an earlier prompt's noise.
            next_id = (self.ctx.state.step + 1) * self.in_flight()
            why = "the checkpoint holds no samples in flight"
        else:
            why = (
                f"the checkpoint's samples in flight are {saved} rank(s)' pools, this run has {d.world_size}"
            )
        self.pool.pool, self.pool.next_request_id = [], next_id
        self.pool.agree_top_ups(d)
        self.ctx.out(
            f"partial rollouts: {why}; the run starts fresh pools (their prompts are not trained on)"
        )

    def checkpoint_writers(self) -> tuple[Writer | None, Writer | None]:
        """The batch sampled ahead (if any) and the pool travel with the checkpoint; under torchrun each rank's
        share of a sharded one."""
        pending, pool, d = self.pending, self.pool, self.ctx.dist
        if d.distributed:

            def write_rank(root: Path) -> None:
                if pending is not None:
                    save_rank_pending(root, pending, d.rank, d.world_size)
                here = _rank_dir(root, d)
                here.mkdir(parents=True, exist_ok=True)
                pool.save(here)

            return None, write_rank

        def write(root: Path) -> None:
            if pending is not None:
                save_pending(root, pending)
            pool.save(root)

        return write, None


def _rank_dir(root: Path, d: DistContext) -> Path:
    """This rank's pool in a sharded checkpoint (the one-process file's format)."""
    return root / POOLS_DIR / f"rank{d.rank}-of-{d.world_size}"


def pools_in(directory: Path) -> tuple[int | None, int | None]:
    """The world size whose pools a checkpoint holds (1: the one-process file; None: none) and the request id every
    one of them would draw next (the same on every rank)."""
    root = directory / POOLS_DIR
    if root.is_dir():
        files = [p / PARTIAL_FILE for p in root.iterdir() if _RANK_NAME.fullmatch(p.name)]
        worlds = {int(_RANK_NAME.fullmatch(f.parent.name).group(2)) for f in files}  # type: ignore[union-attr]
        if len(worlds) != 1 or len(files) != next(iter(worlds)) or not all(f.is_file() for f in files):
            raise ValueError(
                f"{root}: the ranks' partial-rollout pools are incomplete or of several world sizes"
            )
        ids = [json.loads(f.read_text())["next_request_id"] for f in files]
        return worlds.pop(), max(ids)
    path = directory / PARTIAL_FILE
    if path.is_file():
        return 1, json.loads(path.read_text())["next_request_id"]
    return None, None
