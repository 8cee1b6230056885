"""The synchronous step (the default): sample the whole batch, score it, then train on it.

prompts -> rollout (or a multi-turn environment's episodes, or dynamic sampling's rounds; ReMax adds a greedy
rollout) -> score -> update -> the engine's weights. In exact mode the guard is free: the first training forward
re-derives every rollout logprob, and a difference fails closed (run.on_mismatch) before the optimizer step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from exactrl.distributed.env import per_rank_metric
from exactrl.train.drivers.base import StepContext, Writer, end_of_step
from exactrl.train.trainer import MismatchError


class SyncDriver:
    """One synchronous step per `step()`; nothing is kept between steps."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def step(self) -> dict[str, float]:
        """prompts -> rollout -> score -> update; returns the step's metrics (state.step advanced by one)."""
        ctx, stages = self.ctx, self.ctx.stages
        step = ctx.state.step
        t_step = time.perf_counter()
        stages.set_lr(step)
        examples, prompt_ids, index = stages.prompts()
        # The plan's KV size, and the replica back if a step left it released.
        ctx.phases.to_generation(ctx.engine)
        sr, m, gen_s, train_s = self.sample_and_update(step, examples, prompt_ids, index)
        # The engine replica takes the new weights (under torchrun; rebuilt whole when it was released), and
        # disaggregated, the generators take the replica's.
        m.update(ctx.weights.after_update())
        m.update(ctx.phases.metrics(ctx.engine))
        if ctx.cfg.lora.rank > 0:  # what a separate engine would need after this step: the adapters alone
            from exactrl.model.lora import adapter_nbytes

            m["perf/weight_sync_bytes"] = float(adapter_nbytes(ctx.trainer.model))
        ctx.state.step += 1
        m = stages.step_metrics(m, sr)

        def peak_memory() -> dict[str, float]:
            if torch.device(ctx.device).type != "cuda":
                return {}
            # What the run holds at its worst (weights, KV cache, training): the maximum over the ranks, and each
            # rank's own under several (a collective every rank reaches here).
            peak = torch.cuda.max_memory_allocated(ctx.device) / 1e9
            return per_rank_metric(ctx.dist, "perf/gpu_memory_peak_gb", peak)

        return end_of_step(
            ctx,
            m,
            sr,
            generate_s=gen_s,
            train_s=train_s,
            started=t_step,
            tokens=sum(sr.lengths),
            peak_memory=peak_memory,
        )

    def sample_and_update(
        self, step: int, examples: list[Any], prompt_ids: list[list[int]], index: list[int]
    ) -> tuple[Any, dict[str, float], float, float]:
        """(the step's StepRollouts, the trainer's metrics, generate seconds, train seconds): the whole batch
        sampled and scored, then one trainer step on it."""
        ctx, stages = self.ctx, self.ctx.stages
        t_gen = time.perf_counter()
        if ctx.cfg.env.name:  # multi-turn: rollout and reward come from the episodes
            sr = stages.episodes(step, examples, prompt_ids, index)
            gen_s = time.perf_counter() - t_gen
        elif (
            ctx.cfg.algorithm.dynamic_sampling != "off"
        ):  # groups without signal dropped, more prompts sampled
            rs = stages.dynamic_scores(step, examples, prompt_ids, index)
            gen_s = time.perf_counter() - t_gen
            sr = stages.step_scores(rs, None)
        else:
            outs = stages.rollout(step, prompt_ids, index)
            gen_s = time.perf_counter() - t_gen
            baseline = None
            if ctx.cfg.algorithm.resolved_advantage == "remax":
                baseline = stages.greedy_baseline(step, prompt_ids, index, examples)
            sr = stages.score(step, examples, prompt_ids, outs, baseline)
        t_train = time.perf_counter()
        # The KV cache (and the replica) leave the device until the next generation.
        ctx.phases.to_training(ctx.engine)
        try:
            m = stages.update(step, sr.rollouts)
        except MismatchError as err:
            stages.mismatch_abort(step, sr, err)
            raise
        return sr, m, gen_s, time.perf_counter() - t_train

    def restore(self, directory: Path) -> None:
        """Nothing of its own in a checkpoint."""

    def checkpoint_writers(self) -> tuple[Writer | None, Writer | None]:
        return None, None

    def close(self) -> None:
        """Nothing runs between its steps."""
