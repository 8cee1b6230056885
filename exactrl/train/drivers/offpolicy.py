"""One step off (algorithm.max_off_policy_steps = 1): train on the batch sampled by the previous version while the
next one is sampled.

The engine samples from its own weight copy (`BehaviourPolicy`; under torchrun the engine replica,
`ReplicaBehaviour`) in a worker thread while the trainer updates the policy; after the update the copy is refreshed
in place. Each batch is checked by the guard against the copy's training forward before the copy moves on, and the
verdict is acted on (run.on_mismatch) before any update uses the batch. Colocated, the guard's forward runs in the
worker after the generation. Disaggregated, the worker only waits for the generator's outputs (no kernels of its
own beside the update's) and the guard is deferred: after the update the replica's weights (the batch's sampling
weights) are copied into a guard copy, the replica is refreshed and sent to the generators, and the next step asks
them for its batch before it checks this one on the copy. The generators then never wait for the guard (on
2 x H200, qwen3-1.7b, the guard after the update cost the step its 3.3 s: the generator idled through it).
Why the bits are right: exactrl/train/offpolicy.py; under torchrun: exactrl/train/offpolicy_dist.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from exactrl.distributed.env import per_rank_metric
from exactrl.train.drivers.base import StepContext, Writer, end_of_step
from exactrl.train.offpolicy import (
    BehaviourBatch,
    BehaviourPolicy,
    GenerationWorker,
    check_batch,
    save_pending,
)
from exactrl.train.offpolicy_dist import (
    RankSample,
    ReplicaBehaviour,
    agree_guard,
    agreed,
    load_any_pending,
    save_rank_pending,
    step_staleness,
)
from exactrl.train.trainer import MismatchError


class OneStepOffDriver:
    """The off-policy step: the pending batch (sampled and checked ahead) is trained on while the worker samples
    the next one from the engine's copy. behaviour: that copy (the engine samples from its model);
    step_rollouts_cls: the loop's StepRollouts (a checkpoint's pending batch is rebuilt as one)."""

    # Whether the guard of a disaggregated run's batch may wait for the next step (after the generators were asked
    # for the next batch): not with partial rollouts, whose next generation depends on what the guard drops.
    defers_guard = True

    def __init__(self, ctx: StepContext, behaviour: BehaviourPolicy, step_rollouts_cls: type) -> None:
        self.ctx = ctx
        self.behaviour = behaviour
        self.step_rollouts_cls = step_rollouts_cls
        self.worker = GenerationWorker(ctx.device)
        # Disaggregated: the guard runs on the main thread, deferred to the next step where the driver allows it
        # (the docstring above says why).
        self.guard_in_worker = not ctx.weights.disaggregated
        self.defer_guard = ctx.weights.disaggregated and ctx.dist.distributed and self.defers_guard
        # The weights that sampled a deferred batch, while the replica moves on (made at the first deferral).
        self.guard_copy: BehaviourPolicy | None = None
        # The batch sampled and checked ahead, waiting for its step (None: the first step, after a resume).
        self.pending: BehaviourBatch | None = None

    # -- sampling a batch ------------------------------------------------------------------------------------------
    def batch(self, step: int) -> BehaviourBatch:
        """prompts -> rollout -> score for step `step`, sampled from the engine's copy, then the guard on the
        copy's training forward (before the copy is refreshed). On one process the generation worker runs it during
        the previous step's update (the caller does when nothing is pending: the first step, after a resume); under
        torchrun the worker runs `sample` alone and the main thread `gather` after it joined."""
        what = f"sampling step {step + 1}'s batch"
        return self.gather(step, agreed(self.ctx.dist, what, lambda: self.sample(step)))

    def sample(self, step: int, check: bool = True) -> RankSample:
        """This rank's share of step `step`'s batch: sampled, rewarded and (with `check`) checked by the guard,
        with no collective (under torchrun the generation worker runs it while the main thread's FSDP2 update
        issues its own collectives: `exactrl.train.offpolicy_dist`)."""
        ctx, stages = self.ctx, self.ctx.stages
        t0 = time.perf_counter()
        examples, prompt_ids, index = stages.prompts()
        ctx.phases.size(ctx.engine)  # the plan's KV size (kept in every phase: one step off never releases)
        greedy = None
        if ctx.cfg.algorithm.dynamic_sampling != "off":
            # one process (refused under torchrun): dropped groups never become pending
            scores = stages.dynamic_scores(step, examples, prompt_ids, index)
        elif ctx.cfg.env.name:  # multi-turn: this rank's episodes, rewarded by the environment
            scores = stages.rank_episodes(step, examples, prompt_ids, index)
        else:
            outs = stages.rollout(step, prompt_ids, index)
            if ctx.cfg.algorithm.resolved_advantage == "remax":
                greedy = stages.greedy_rewards(step, prompt_ids, index, examples)
            scores = stages.rank_scores(step, examples, prompt_ids, outs)
        gen_s = time.perf_counter() - t0
        sampled = RankSample(scores, greedy, self.behaviour.version, gen_s, {}, None, 0.0)
        return self.check(sampled) if check else sampled

    def check(self, s: RankSample, on: BehaviourPolicy | None = None) -> RankSample:
        """The guard on this rank's share: the training forward of `on` (the engine's copy by default; it must
        still hold the sampling weights) against the logprobs the engine recorded."""
        behaviour = self.behaviour if on is None else on
        if s.version != behaviour.version:
            raise RuntimeError(
                f"the guard would check a batch sampled by version {s.version} on a copy at version "
                f"{behaviour.version}"
            )
        t1 = time.perf_counter()
        s.guard, s.mismatch = check_batch(
            behaviour,
            s.scores.rollouts,
            self.ctx.trainer.s.temperature,
            self.ctx.trainer.s.max_tokens_per_microbatch,
        )
        s.guard_s = time.perf_counter() - t1
        return s

    def gather(self, step: int, s: RankSample, checked: bool = True) -> BehaviourBatch:
        """The step's view of every rank's `sample` (collectives, on the main thread): advantages over the step,
        ReMax's baseline, the guard's verdict agreed by every rank (not `checked`: left to `finish_guard`)."""
        ctx, stages = self.ctx, self.ctx.stages
        baseline = stages.gather_baseline(s.greedy) if s.greedy is not None else None
        sr = stages.step_scores(s.scores, baseline)
        versions = [torch.full((len(ro.completion_ids),), s.version, dtype=torch.int64) for ro in sr.rollouts]
        batch = BehaviourBatch(sr, s.version, versions, s.generate_s, ctx.state.model_tokens)
        if not checked:
            batch.unchecked = s
            return batch
        batch.guard, batch.mismatch = agree_guard(ctx.dist, s.guard, s.mismatch)
        batch.guard_s = s.guard_s
        return batch

    def defer(self) -> None:
        """The pending batch's guard waits: its sampling weights (the replica's, before the refresh) go into the
        guard copy."""
        if self.guard_copy is None:
            self.guard_copy = BehaviourPolicy(self.behaviour.model, self.behaviour.version)
        else:
            self.guard_copy.refresh_from(self.behaviour)

    def finish_guard(self, step: int, batch: BehaviourBatch) -> None:
        """A deferred batch's guard, on the guard copy (the weights that sampled it), agreed by every rank; its
        replay report written from that copy. Every rank at the same point (collectives)."""
        s, copy = batch.unchecked, self.guard_copy
        assert s is not None and copy is not None
        checked = agreed(self.ctx.dist, f"the guard of step {step + 1}'s batch", lambda: self.check(s, copy))
        batch.guard, batch.mismatch = agree_guard(self.ctx.dist, checked.guard, checked.mismatch)
        batch.guard_s = checked.guard_s
        batch.unchecked = None
        self.report(step, batch, model=copy.model)

    def joined(self) -> RankSample:
        """The worker's share once it joined, checked by the guard here when the worker did not (and the guard is
        not deferred)."""
        s = self.worker.result()
        return s if self.guard_in_worker or self.defer_guard else self.check(s)

    def report(self, step: int, batch: BehaviourBatch, model: Any = None) -> None:
        """A batch the guard refused: its replay report, written now, while the copy (or `model`, the guard copy)
        holds its sampling weights."""
        if batch.mismatch is not None:
            checked = batch.checked if batch.checked is not None else batch.sr.rollouts
            batch.report = self.ctx.stages.mismatch_report(step, checked, batch.mismatch, model=model)

    # -- the step ----------------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Train on the pending batch (sampled by the previous version) while the worker samples the next one from
        the engine's copy; then refresh the copy in place. The pending batch's guard verdict is acted on
        (run.on_mismatch) before any update uses it."""
        ctx, stages = self.ctx, self.ctx.stages
        step, t_step = ctx.state.step, time.perf_counter()
        stages.set_lr(step)
        if self.pending is None:  # nothing sampled ahead (the first step, a resume): sample it now
            self.pending = self.batch(step)
            self.report(step, self.pending)
        batch, self.pending = self.pending, None
        # Under torchrun the worker issues no collective (the main thread's update does): it samples alone and
        # the main thread gathers after it joined.
        sample_only = ctx.dist.distributed
        if step + 1 < ctx.cfg.train.steps:
            if sample_only:
                self.worker.start(lambda: self.sample(step + 1, check=self.guard_in_worker))
            else:
                self.worker.start(lambda: self.batch(step + 1))
        if batch.unchecked is not None:  # deferred: checked now, the generators already at the next batch
            self.finish_guard(step, batch)
        how = ctx.cfg.run.on_mismatch
        t_train = time.perf_counter()
        if batch.mismatch is not None and how != "warn":
            m = self.refuse(step, batch)
        else:
            m = stages.update(step, batch.sr.rollouts, off_policy_cap=ctx.cfg.algorithm.off_policy_is_cap)
        train_s = time.perf_counter() - t_train
        wait_s = 0.0
        if self.worker.busy:
            t_wait = time.perf_counter()
            if sample_only:  # every rank learns whether any rank's worker failed, then the step's view of it
                sampled = agreed(ctx.dist, f"the generation worker of step {step + 2}", self.joined)
                self.pending = self.gather(step + 1, sampled, checked=not self.defer_guard)
                if self.defer_guard:
                    self.defer()
            else:
                self.pending = self.worker.result()
            wait_s = time.perf_counter() - t_wait
            self.report(step + 1, self.pending)
        refresh_s = self.behaviour.refresh(step + 1)  # in place: the engine's graphs stay valid
        if isinstance(self.behaviour, ReplicaBehaviour):  # torchrun: that refresh was the weight sync
            m.update(self.behaviour.last_sync)
            # Disaggregated: the generators take the refreshed replica's bytes.
            m.update(ctx.weights.to_generators())
        else:  # one process: a no-op on one device (the stage set stays the same)
            m.update(ctx.weights.after_update())
        m.update(ctx.phases.metrics(ctx.engine))  # decode graph captures (the cache is never released here)
        ctx.state.step += 1
        ctx.state.model_tokens = batch.model_tokens  # with_advantages set it for the next batch meanwhile
        m.update(batch.guard)
        sr = batch.sr
        m = stages.step_metrics(m, sr)
        masks = [
            torch.ones(len(ro.completion_ids), dtype=torch.bool)
            if ro.loss_mask is None
            else torch.tensor(ro.loss_mask, dtype=torch.bool)
            for ro in sr.rollouts
        ]
        m.update(self.staleness(batch, step, masks))
        # The guard's forward on the copy (in the worker, overlapped, except for a batch sampled in the step).
        # Under torchrun: the slowest rank's (the step waits for it) and each rank's own (a collective).
        m.update(per_rank_metric(ctx.dist, "offpolicy/guard_s", batch.guard_s))
        # The trainer waiting for the next batch after its update.
        m.update(per_rank_metric(ctx.dist, "offpolicy/wait_s", wait_s))
        m["offpolicy/refresh_s"] = refresh_s
        # The generation's speed: partial rollouts sample other tokens than the batch holds (carried ones).
        sampled = m.get("offpolicy/partial/sampled_tokens", sum(sr.lengths))

        def peak_memory() -> dict[str, float]:  # this rank's (no collective here)
            if torch.device(ctx.device).type != "cuda":
                return {}
            return {"perf/gpu_memory_peak_gb": torch.cuda.max_memory_allocated(ctx.device) / 1e9}

        return end_of_step(
            ctx,
            m,
            sr,
            generate_s=batch.generate_s,
            train_s=train_s,
            started=t_step,
            tokens=sampled,
            peak_memory=peak_memory,
        )

    def staleness(self, batch: BehaviourBatch, step: int, masks: list[torch.Tensor]) -> dict[str, float]:
        """How many versions behind the trained policy the batch's tokens are (over every rank: a collective)."""
        return step_staleness(self.ctx.dist, batch, step, masks)

    def refuse(self, step: int, batch: BehaviourBatch) -> dict[str, float]:
        """The guard found a difference in the batch this step would train on: abort (raise, nothing applied) or
        skip the step (no update), with the replay report written when the batch was checked."""
        ctx = self.ctx
        err = batch.mismatch
        assert err is not None
        head = f"step {step + 1}: {err} (run.on_mismatch = '{ctx.cfg.run.on_mismatch}'); no optimizer step was applied"
        if ctx.cfg.run.on_mismatch == "skip_step":
            ctx.trainer.steps_done += 1  # as the trainer counts a step it skipped
            if batch.report is not None:
                ctx.out(
                    f"step {step + 1} skipped: {err}\n   replay it: exactrl parity --replay {batch.report}"
                )
            return {"mismatch/step_skipped": 1.0, "optimizer_steps": 0.0}
        self.worker.close()  # abort: the next batch is not needed
        ctx.stages.abort_notice(step, head, batch.report)
        raise MismatchError(head, err.sequences)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def restore(self, directory: Path) -> None:
        """The copy takes the checkpoint's weights and version; the batch the checkpoint sampled ahead becomes
        pending (at any world size: `load_any_pending`), so the resumed run trains on what the uninterrupted one
        would."""
        ctx = self.ctx
        step = ctx.state.step
        if isinstance(
            self.behaviour, ReplicaBehaviour
        ):  # the run's full sync after the load refreshed the replica
            self.behaviour.version = step
        else:
            self.behaviour.refresh(step, full=True)  # the copy was taken before the load
        self.pending, note = load_any_pending(directory, ctx.dist, self.step_rollouts_cls)
        if note is not None:
            ctx.out(f"off-policy resume at {ctx.dist.world_size} rank(s): {note}")
        self.restore_pool(directory)
        if self.pending is not None:
            ctx.out(
                f"off-policy resume: step {step + 1} trains on the batch the checkpoint holds (sampled by "
                f"version {self.pending.version}), as the uninterrupted run would"
            )
        elif step < ctx.cfg.train.steps:
            ctx.out(
                f"off-policy resume: the checkpoint holds no batch for step {step + 1} (the guard refused "
                "it, or the run had ended); it is sampled again from the checkpoint's weights (0 versions "
                "behind), so the run from here is not bitwise an uninterrupted one's"
            )

    def restore_pool(self, directory: Path) -> None:
        """What else the checkpoint holds for this driver (partial rollouts: the groups in flight)."""

    def checkpoint_writers(self) -> tuple[Writer | None, Writer | None]:
        """The batch sampled ahead travels with the checkpoint: each rank's share in a sharded one."""
        pending = self.pending
        if pending is not None and pending.unchecked is not None:
            # A checkpoint keeps checked batches only (a resumed run no longer has the weights that sampled it):
            # the deferred guard runs now, on every rank (the checkpoint is a collective too).
            self.finish_guard(self.ctx.state.step, pending)
        if pending is None:
            return None, None
        if self.ctx.dist.distributed:  # under torchrun the checkpoint is sharded
            rank, ws = self.ctx.dist.rank, self.ctx.dist.world_size
            return None, lambda d: save_rank_pending(d, pending, rank, ws)
        return lambda d: save_pending(d, pending), None

    def close(self) -> None:
        """Wait for a generation still running under a failed update."""
        self.worker.close()
