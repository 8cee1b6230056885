"""Partial rollouts that stay exact (algorithm.partial_rollouts, with max_off_policy_steps = k >= 2).

A step's generation should not wait for its longest completions. Each off-policy generation (the engine's weight
copy at version v, see offpolicy.py) keeps prompts_per_step + E groups in flight (E = partial_extra_groups) and
stops by a COUNT, never by the clock (so same-seed runs stay identical):

    stop after the first engine step at which >= prompts_per_step groups are complete (all their samples finished)
    and every group that is due (below) is complete.

The batch is prompts_per_step complete groups, due ones first, then oldest first. Everything else is carried to
the next generation: unfinished samples with their tokens, recorded logprobs and per-token versions, and complete
groups that did not fit the batch. The pool is topped up with new prompts to prompts_per_step + E again.

Why the bits are right:
- A carried sample is resumed by the engine's recompute path (engine/partial.py): prompt + its tokens are
  prefilled again under the copy's weights of the new generation. KV computed under an older version is never
  extended, so each token's recorded logprob is one version's forward over the sequence before it: the version
  it is tagged with.
- The guard scores, before the copy leaves version v (it is refreshed after the worker is joined), every token
  sampled in this generation, in the batch AND in the carried samples, through the training forward of the copy
  (`check_batch`), the older tokens of a sequence entering as context only. So every token of a batch was checked
  under the version that sampled it, before any update uses it. A difference is acted on with run.on_mismatch for
  the batch; a carried group holding one is dropped (unless "warn"), so no later update uses it either.
- The loss is decoupled PPO per token: each token's behaviour logprob is its own version's, whatever the versions
  of its neighbours.

Staleness bound: the batch for step s is trained by policy version s; a token sampled by version u is s - u
behind. A fresh token is at most 1 behind; a carried one grows by one per generation it waits. A group whose oldest
token would be more than k behind at the next step (s + 1 - oldest > k) is *due*: it is never cut, and the
generation runs until it is complete, and it goes into this batch. With k = 2 a sample is cut at most once. Why
finish and not drop-and-resample: a due group has already run a whole generation, so finishing it is the cheapest
way to its reward, and dropping it would bias the batch against long completions (the tail partial rollouts are
for). At most E groups are carried at any cut and E <= prompts_per_step, so the due groups always fit one batch.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from exactrl.distributed.env import DistContext
from exactrl.engine.engine import RequestOutput, RolloutEngine, Sample
from exactrl.engine.partial import CutRule, PartialSample, generate_until_cut
from exactrl.tasks import Example
from exactrl.train.checkpoint import PARTIAL_FILE
from exactrl.train.offpolicy import BehaviourBatch, BehaviourPolicy, check_batch
from exactrl.train.offpolicy_dist import RankSample, agree_guard
from exactrl.train.trainer import Rollout

if TYPE_CHECKING:
    from exactrl.train.drivers.base import StepContext


@dataclass
class CarriedSample:
    """One sample of a group: its tokens so far, their recorded logprobs and the version that sampled each."""

    sample_index: int
    max_tokens: int  # the limit of the whole completion
    completion_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)  # float32 values, exact as Python floats
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None: cut before it finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CarriedGroup:
    """A prompt and its group_size samples in flight across generations (samples empty until it first ran)."""

    request_id: int
    example: Example
    prompt_ids: list[int]
    samples: dict[int, CarriedSample] = field(default_factory=dict)
    refused: str | None = None  # the engine's reason when it refused a sample (the group is not trained)

    def oldest(self) -> int | None:
        """The oldest version among its tokens (None: no token yet)."""
        firsts = [s.versions[0] for s in self.samples.values() if s.versions]
        return min(firsts) if firsts else None

    def complete(self, n: int) -> bool:
        return (
            self.refused is None and len(self.samples) == n and all(s.finished for s in self.samples.values())
        )


@dataclass
class PartialShare(RankSample):
    """One rank's generation as `PartialRollouts.sample` leaves it (no collective yet): a `RankSample` with the
    per-token versions of its chosen samples, what the guard scored, and the generation's counts (this rank's)."""

    versions: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (request, sample) -> per token
    checked: list[Rollout] = field(default_factory=list)
    partial: dict[str, float] = field(default_factory=dict)


def merge_partial_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The generation's counts over every rank: sums, but the engine steps, which are the longest rank's (the ranks
    generate side by side; at one rank, its own)."""
    out: dict[str, float] = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        out[key] = float(max(vals) if key == "offpolicy/partial/engine_steps" else sum(vals))
    return out


class PartialRollouts:
    """The groups in flight between generations (the pool) and the generation that cuts by count."""

    def __init__(self, k: int, prompts_per_step: int, extra_groups: int, group_size: int) -> None:
        if k < 2 or not 1 <= extra_groups <= prompts_per_step:
            raise ValueError(
                f"partial rollouts need max_off_policy_steps >= 2 and 1 <= extra groups <= prompts_per_step, got "
                f"k = {k}, {extra_groups} extra groups for {prompts_per_step} prompts per step"
            )
        self.k, self.per_step, self.extra, self.n = k, prompts_per_step, extra_groups, group_size
        self.pool: list[CarriedGroup] = []
        self.next_request_id = 0  # request ids key the sampling noise: unique over the run (every rank's)
        self.top_ups: list[int] | None = (
            None  # every rank's new prompts at the next generation (`agree_top_ups`)
        )

    # -- one generation ----------------------------------------------------------------------------------------
    def due(self, g: CarriedGroup, step: int) -> bool:
        """Whether the group must be trained at `step`: waiting one more step would put its oldest token more than
        k versions behind the policy that trains it."""
        oldest = g.oldest()
        return oldest is not None and step + 1 - oldest > self.k

    def agree_top_ups(self, dist: DistContext) -> None:
        """How many new prompts every rank's pool takes at its next generation (a collective under torchrun, on
        the main thread: the generation itself issues none). Every rank reads the same prompt stream; each takes
        its slice of it in rank order, so the ranks must know each other's top-ups. Without refusals every rank's
        is its share of prompts_per_step; a refused or guard-dropped group makes its rank's larger."""
        self.top_ups = dist.all_gather_object(max(0, self.per_step + self.extra - len(self.pool)))

    def batch(self, ctx: StepContext, behaviour: BehaviourPolicy, step: int) -> BehaviourBatch:
        """One process: prompts (top-up) -> generate until the cut -> score the chosen groups -> the guard on the
        tokens this generation sampled, for step `step`, from the engine's copy (`behaviour`) at its current
        version. Under torchrun the worker runs `sample` and the main thread `gather`."""
        if self.top_ups is None:
            self.agree_top_ups(ctx.dist)
        return self.gather(ctx, self.sample(ctx, behaviour, step), step)

    def sample(
        self, ctx: StepContext, behaviour: BehaviourPolicy, step: int, check: bool = True
    ) -> PartialShare:
        """This rank's generation for step `step`, with no collective: top-up, generation cut by this rank's
        count, its chosen groups rewarded, then (with `check`; else `check` later, before the copy moves on) the
        guard on every token it sampled (batch and carried), a carried group the guard refused dropped.
        `agree_top_ups` must have run since the last generation."""
        t0 = time.perf_counter()
        v = behaviour.version
        if self.top_ups is None:
            raise RuntimeError("partial rollouts: the ranks' top-ups were not agreed before this generation")
        tops, self.top_ups = self.top_ups, None
        rank = ctx.dist.rank if ctx.dist.distributed else 0
        total, offset = sum(tops), sum(tops[:rank])
        new: list[CarriedGroup] = []
        if total > 0:
            # Every rank reads the same `total` prompts; request ids count them in stream order (as one process
            # does), so a prompt's id, and with it its sampling noise, does not depend on which rank runs it.
            examples, prompt_ids, _ = ctx.stages.prompts(total, shard=False)
            mine = range(offset, offset + tops[rank])
            new = [CarriedGroup(self.next_request_id + i, examples[i], prompt_ids[i]) for i in mine]
            self.next_request_id += total
        before = {(g.request_id, i): len(s.completion_ids) for g in self.pool for i, s in g.samples.items()}
        stats = self.generate(ctx, step, v, new)
        chosen = self.choose(step)
        for g in chosen:
            for s in g.samples.values():
                if s.versions and step - s.versions[0] > self.k:  # cannot happen: `due` keeps the bound
                    raise RuntimeError(
                        f"partial rollouts: request {g.request_id} sample {s.sample_index} holds a token of version "
                        f"{s.versions[0]} for step {step + 1} (policy version {step}): more than "
                        f"max_off_policy_steps = {self.k} behind"
                    )
        outs = [
            RequestOutput(
                g.request_id,
                list(g.prompt_ids),
                [
                    Sample(
                        list(s.completion_ids),
                        torch.tensor(s.rollout_logprobs, dtype=torch.float32),
                        s.finish_reason or "length",
                    )
                    for _, s in sorted(g.samples.items())
                ],
            )
            for g in chosen
        ]
        scores = ctx.stages.rank_scores(
            step, [g.example for g in chosen], [g.prompt_ids for g in chosen], outs
        )
        gen_s = time.perf_counter() - t0
        versions = {(g.request_id, i): list(s.versions) for g in chosen for i, s in g.samples.items()}
        checks = self.sampled_now(chosen + self.pool, before)
        mixed = sum(len(set(s.versions)) > 1 for g in chosen for s in g.samples.values())
        # The guard's counts (mismatch/*) are this generation's tokens, in the batch and the carried samples; the
        # batch trained holds tokens of earlier generations too, checked when they were sampled. Both are logged,
        # so the step line can say how many of the trained batch's tokens were checked, and where.
        batch_tokens = sum(len(s.completion_ids) for g in chosen for s in g.samples.values())
        earlier = sum(
            min(before.get((g.request_id, i), 0), len(s.completion_ids))
            for g in chosen
            for i, s in g.samples.items()
        )
        partial = {
            "mismatch/batch_tokens": float(batch_tokens),
            "mismatch/batch_tokens_checked_earlier": float(earlier),
            "offpolicy/partial/sampled_tokens": float(sum(len(r.completion_ids) for r in checks)),
            **stats,
            "offpolicy/partial/mixed_version_samples": float(mixed),
        }
        share = PartialShare(scores, None, v, gen_s, {}, None, 0.0, versions, checks, partial)
        return self.check(ctx, behaviour, share) if check else share

    def check(self, ctx: StepContext, behaviour: BehaviourPolicy, share: PartialShare) -> PartialShare:
        """The guard on what this rank's generation sampled (the copy must still hold the sampling weights); a
        carried group it refused leaves the pool."""
        if share.version != behaviour.version:
            raise RuntimeError(
                f"partial rollouts: the guard would check a generation of version {share.version} on the copy at "
                f"version {behaviour.version}"
            )
        t1 = time.perf_counter()
        checks = share.checked
        guard, mismatch = check_batch(
            behaviour, checks, ctx.trainer.s.temperature, ctx.trainer.s.max_tokens_per_microbatch
        )
        share.guard_s = time.perf_counter() - t1
        share.guard, share.mismatch = guard, mismatch
        dropped = 0
        if mismatch is not None and ctx.cfg.run.on_mismatch != "warn":
            # No later update may use a carried token the guard refused: its group goes (this rank's pool; the
            # batch itself is refused on every rank, agreed in `gather`).
            bad = {checks[i].request_id for i, *_ in mismatch.sequences}
            dropped = sum(g.request_id in bad for g in self.pool)
            self.pool = [g for g in self.pool if g.request_id not in bad]
        share.partial.update(
            {
                "offpolicy/partial/carried_groups": float(len(self.pool)),
                "offpolicy/partial/carried_samples": float(
                    sum(not s.finished for g in self.pool for s in g.samples.values())
                ),
                "offpolicy/partial/guard_dropped_groups": float(dropped),
            }
        )
        return share

    def gather(self, ctx: StepContext, share: PartialShare, step: int) -> BehaviourBatch:
        """The step's view of every rank's `sample` (collectives, the main thread's): advantages over the step, the
        guard's verdict and the generation's counts over every rank; then the next generation's top-ups."""
        sr = ctx.stages.step_scores(share.scores, None)
        versions = [
            torch.tensor(
                share.versions[(cast(int, ro.request_id), cast(int, ro.sample_index))], dtype=torch.int64
            )
            for ro in sr.rollouts
        ]
        batch = BehaviourBatch(sr, share.version, versions, share.generate_s, ctx.state.model_tokens)
        batch.guard, batch.mismatch = agree_guard(ctx.dist, share.guard, share.mismatch)
        batch.guard_s = share.guard_s
        batch.checked = share.checked
        batch.partial = merge_partial_metrics(ctx.dist.all_gather_object(share.partial))
        self.agree_top_ups(ctx.dist)
        return batch

    def generate(
        self, ctx: StepContext, step: int, version: int, new: list[CarriedGroup]
    ) -> dict[str, float]:
        """Run the engine over the pool's unfinished samples (resumed, KV recomputed) and the new groups until the
        cut (`CutRule`: the engine's verb, run on the generator when disaggregated); every sample it returns is
        merged into the pool, its new tokens tagged `version`."""
        resumed = [
            PartialSample(
                g.request_id, s.sample_index, g.prompt_ids, s.completion_ids, s.rollout_logprobs, s.max_tokens
            )
            for g in self.pool
            for s in g.samples.values()
            if not s.finished
        ]
        due = [g.request_id for g in self.pool if self.due(g, step)]
        self.pool += new
        # Samples still to finish per group (a group not yet run: all n): the cut's count without a scan.
        left = {g.request_id: self.n - sum(s.finished for s in g.samples.values()) for g in self.pool}
        # A local engine's cut runs here (engine/partial.py); a disaggregated trainer's RemoteEngine sends it to its
        # generator, which runs the same function.
        local = isinstance(ctx.engine, RolloutEngine)
        until_cut = (
            functools.partial(generate_until_cut, ctx.engine) if local else ctx.engine.generate_until_cut
        )
        cut = until_cut(
            [g.prompt_ids for g in new],
            [g.request_id for g in new],
            ctx.stages.sampling_params(),
            resumed,
            CutRule(self.per_step, left, due),
        )
        by_id = {g.request_id: g for g in self.pool}
        for rid, err in cut.errors.items():
            by_id[rid].refused = err
        for ps in cut.samples:
            g = by_id[ps.request_id]
            old = g.samples.get(ps.sample_index)
            prev = old.completion_ids if old is not None else []
            # The engine only ever extends a sample: what the guard checked earlier must come back unchanged.
            if ps.completion_ids[: len(prev)] != prev or (
                old is not None and ps.rollout_logprobs[: len(prev)] != old.rollout_logprobs
            ):
                raise RuntimeError(
                    f"partial rollouts: request {ps.request_id} sample {ps.sample_index} came back from the engine "
                    "with other tokens or logprobs than it was resumed with"
                )
            grown = len(ps.completion_ids) - len(prev)
            g.samples[ps.sample_index] = CarriedSample(
                ps.sample_index,
                ps.max_tokens,
                list(ps.completion_ids),
                list(ps.rollout_logprobs),
                (old.versions if old is not None else []) + [version] * grown,
                ps.finish_reason,
            )
            if ps.finish_reason is not None and ps.finish_reason.startswith("error"):
                g.refused = ps.finish_reason
        return {
            "offpolicy/partial/new_groups": float(len(new)),
            "offpolicy/partial/resumed_samples": float(len(resumed)),
            # What resuming costs: the tokens prefilled again (prompt + generated so far) under the new weights.
            "offpolicy/partial/recomputed_tokens": float(
                sum(len(p.prompt_ids) + len(p.completion_ids) for p in resumed if p.completion_ids)
            ),
            "offpolicy/partial/due_groups": float(len(due)),
            "offpolicy/partial/engine_steps": float(cut.steps),
        }

    def choose(self, step: int) -> list[CarriedGroup]:
        """Take the batch out of the pool: prompts_per_step complete groups, due ones first, then the oldest, then
        by request id (a total order: the same pool gives the same batch). Refused groups leave the pool."""
        complete = [g for g in self.pool if g.complete(self.n)]

        def key(g: CarriedGroup) -> tuple[int, int, int]:
            oldest = g.oldest()
            return (0 if self.due(g, step) else 1, oldest if oldest is not None else 1 << 62, g.request_id)

        chosen = sorted(complete, key=key)[: self.per_step]
        taken = {g.request_id for g in chosen}
        late = [
            g.request_id
            for g in self.pool
            if self.due(g, step) and g.request_id not in taken and not g.refused
        ]
        if late:  # cannot happen: the cut waits for due groups, and at most E <= prompts_per_step are carried
            raise RuntimeError(f"partial rollouts: due groups {late} did not make step {step + 1}'s batch")
        self.pool = [g for g in self.pool if g.request_id not in taken and g.refused is None]
        if not chosen:
            raise RuntimeError(
                f"step {step + 1}: the engine refused every prompt in flight; check engine.num_kv_blocks / "
                "engine.max_model_len against the prompt lengths"
            )
        return sorted(chosen, key=lambda g: g.request_id)

    @staticmethod
    def sampled_now(groups: list[CarriedGroup], before: dict[tuple[int, int], int]) -> list[Rollout]:
        """The tokens this generation sampled, one check rollout per sample that grew: the earlier tokens are its
        prompt (context only, checked by the generation that sampled them), the new ones its completion."""
        out = []
        for g in groups:
            for i, s in sorted(g.samples.items()):
                j = before.get((g.request_id, i), 0)
                if len(s.completion_ids) <= j:
                    continue
                out.append(
                    Rollout(
                        prompt_ids=list(g.prompt_ids) + s.completion_ids[:j],
                        completion_ids=s.completion_ids[j:],
                        rollout_logprobs=torch.tensor(s.rollout_logprobs[j:], dtype=torch.float32),
                        request_id=g.request_id,
                        sample_index=i,
                    )
                )
        return out

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """The pool and the request-id counter, lossless JSON (Python floats round-trip float32 values exactly)."""
        d = {
            "next_request_id": self.next_request_id,
            "pool": [
                {
                    "request_id": g.request_id,
                    "example": asdict(g.example),
                    "prompt_ids": g.prompt_ids,
                    "samples": [asdict(s) for _, s in sorted(g.samples.items())],
                    "refused": g.refused,
                }
                for g in self.pool
            ],
        }
        (directory / PARTIAL_FILE).write_text(json.dumps(d) + "\n")

    def load(self, directory: Path) -> bool:
        """The pool a checkpoint holds; False (and an empty pool) when it holds none."""
        path = directory / PARTIAL_FILE
        self.pool = []
        if not path.is_file():
            return False
        d = json.loads(path.read_text())
        self.next_request_id = int(d["next_request_id"])
        for g in d["pool"]:
            samples = {s["sample_index"]: CarriedSample(**s) for s in g["samples"]}
            self.pool.append(
                CarriedGroup(g["request_id"], Example(**g["example"]), g["prompt_ids"], samples, g["refused"])
            )
        return True
