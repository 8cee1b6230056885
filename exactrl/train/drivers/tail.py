"""Tail overlap (algorithm.overlap = "tail"): train on a batch's finished groups while its tail still generates.

The synchronous step with its sample-and-update stage replaced: the engine generates the step's batch in a worker
thread and hands over each prompt's group as soon as its samples have finished; the group is scored and fed to the
trainer as microbatches (forward + backward, gradients accumulated) while the rest keeps generating; the one
optimizer step waits for the whole batch. Why this stays on-policy and exact, and what the host threads do:
exactrl/train/overlap.py (the group stream and the microbatch filler).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import torch

from exactrl.train.drivers.base import StepContext
from exactrl.train.drivers.sync import SyncDriver
from exactrl.train.logging import progress_bar
from exactrl.train.overlap import GIL_SWITCH_INTERVAL_S, GroupStream, MicrobatchFiller
from exactrl.train.trainer import MismatchError, Rollout


class TailDriver(SyncDriver):
    """The synchronous step with its sample-and-update stage overlapped: rollout, score and update of one step,
    the update fed group by group while the batch's tail generates."""

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.stream = GroupStream(ctx.device)

    def sample_and_update(
        self, step: int, examples: list[Any], prompt_ids: list[list[int]], index: list[int]
    ) -> tuple[Any, dict[str, float], float, float]:
        """(the step's StepRollouts, the trainer's metrics with the overlap's, generate seconds, train seconds).
        The StepRollouts are in prompt order, as the synchronous step's are."""
        ctx, cfg, stages = self.ctx, self.ctx.cfg, self.ctx.stages
        a = cfg.algorithm
        base = step * a.prompts_per_step
        request_ids = [base + i for i in index]
        slot = {rid: k for k, rid in enumerate(request_ids)}
        trainer = ctx.trainer
        trainer.kl_coef = ctx.kl_ctl.value  # as RLRun.update sets it
        bar = progress_bar(
            len(prompt_ids) * a.group_size, f"step {step + 1} generate + train", cfg.run.progress
        )
        filler = MicrobatchFiller(trainer.s.max_tokens_per_microbatch)
        groups: dict[int, Any] = {}  # prompt slot -> its scored group (StepRollouts of one group)
        refused = 0
        count = {"mb": 0, "mb_during": 0, "tok": 0, "tok_during": 0}
        times = {"score": 0.0, "train": 0.0}

        def feed(mb: list[Rollout]) -> None:
            during = self.stream.generating  # read before: the microbatch is queued while generation runs
            t0 = time.perf_counter()
            trainer.accumulate(acc, mb)
            times["train"] += time.perf_counter() - t0
            n = sum(len(r.completion_ids) for r in mb)
            count["mb"] += 1
            count["tok"] += n
            if during:
                count["mb_during"] += 1
                count["tok_during"] += n

        switch = sys.getswitchinterval()
        acc = trainer.begin_accumulation()
        try:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            self.stream.start(ctx.engine, prompt_ids, stages.sampling_params(), request_ids, bar.update)
            for out in self.stream:
                k = slot[out.request_id]
                if out.error is not None or len(out.samples) != a.group_size:
                    refused += 1  # as RLRun.score skips it: the others train
                    ctx.out(f"step {step + 1}: prompt skipped by the engine: {out.error}")
                    continue
                t0 = time.perf_counter()
                groups[k] = stages.score(step, [examples[k]], [prompt_ids[k]], [out])
                times["score"] += time.perf_counter() - t0
                for mb in filler.add(groups[k].rollouts):
                    feed(mb)
            t_generated = time.perf_counter()
            for mb in filler.flush():
                feed(mb)
            if not groups:
                raise RuntimeError(
                    f"step {step + 1}: the engine refused every prompt of the step; check engine.num_kv_blocks / "
                    "engine.max_model_len against the prompt lengths"
                )
            sr = self.assemble(groups, refused)
            t0 = time.perf_counter()
            try:
                m = trainer.finish_accumulation(acc)
            except MismatchError as err:  # abort: no update applied; the report names rollouts in feed order
                stages.mismatch_abort(step, dataclasses.replace(sr, rollouts=acc.rollouts), err)
                raise
            times["train"] += time.perf_counter() - t0
            t_end = time.perf_counter()
        except BaseException:
            self.stream.close()
            trainer.abandon_accumulation(acc)
            raise
        finally:
            sys.setswitchinterval(switch)
            bar.close()
        skipped = trainer.skipped_mismatch
        if skipped is not None:  # skip_step: the same evidence RLRun.update leaves
            where = stages.mismatch_report(step, acc.rollouts, skipped)
            if where is not None:
                ctx.out(f"step {step + 1} skipped: {skipped}\n   replay it: exactrl parity --replay {where}")
        m.update(
            {
                "overlap/microbatches": float(count["mb"]),
                "overlap/microbatches_during_generation": float(count["mb_during"]),
                "overlap/tokens_during_generation": float(count["tok_during"]),
                "overlap/share_during_generation": count["tok_during"] / max(1, count["tok"]),
                "perf/wait_s": self.stream.wait_s,  # the loop's thread waiting for the next finished group
                "perf/score_s": times["score"],
                # From the last finished sequence to the update applied: the training that did not overlap.
                "perf/train_after_generate_s": t_end - t_generated,
            }
        )
        return sr, m, self.stream.generate_s, times["train"]

    def assemble(self, groups: dict[int, Any], refused: int) -> Any:
        """The step's StepRollouts in prompt order, built by the loop's own `with_advantages` over the whole batch,
        as the synchronous step builds them. The advantages the groups were trained with must be those bits: an
        estimator that looked past its group would differ here (config refuses those; this says so if one slips)."""
        order = sorted(groups)
        parts = [groups[k] for k in order]
        rollouts = [ro for g in parts for ro in g.rollouts]
        trained = torch.tensor([ro.advantage for ro in rollouts], dtype=torch.float32)
        per_function = {fn: [v for g in parts for v in g.per_function[fn]] for fn in parts[0].per_function}
        sr = self.ctx.stages.with_advantages(
            rollouts,
            [ro.reward for ro in rollouts],
            per_function,
            sum(g.reward_errors for g in parts),
            [c for g in parts for c in g.completions],
            [x for g in parts for x in g.answers],
            None,
            refused=refused,
        )
        if not torch.equal(sr.advantages, trained):
            raise RuntimeError(
                f"algorithm.advantage {self.ctx.cfg.algorithm.resolved_advantage!r}: the advantages computed per group "
                'differ from the whole batch\'s; algorithm.overlap = "tail" needs an estimator local to each group'
            )
        for g in parts:
            for key, n in g.reward_failures.items():
                sr.reward_failures[key] = sr.reward_failures.get(key, 0) + n
        return sr
