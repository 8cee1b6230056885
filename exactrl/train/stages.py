"""The stages of one RL step, as one object the step drivers call (exactrl/train/drivers/).

`RLRun` (exactrl/train/loop.py) builds a run: the model, the engine, the task, the rewards, the trainer. `RunStages`
holds what a step needs of those and does the step's work: the step's prompts, the rollout, the rewards and
advantages (single-turn, multi-turn episodes, dynamic sampling's rounds, ReMax's greedy baseline), the update, the
step's metrics and, when the exactness guard trips, the replay report. A driver orders these calls (synchronous,
tail overlap, one step off, partial rollouts: the default's order is `SyncDriver.step`, exactrl/train/drivers/sync.py);
`exactrl bench rl` times them (exactrl/train/hooks.py).

    prompts -> rollout (or episodes) -> score (rank_scores -> step_scores -> with_advantages) -> update
        -> step_metrics
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from exactrl.algorithms import KLController, advantage_metrics, compute_advantages, reward_metrics
from exactrl.algorithms.overlong import add_overlong_penalty, overlong_metrics
from exactrl.config import RunConfig, episode_token_limit
from exactrl.distributed.env import DistContext
from exactrl.distributed.parallelize import Parallelism
from exactrl.distributed.shared_engine import SharedEngine
from exactrl.distributed.tensor_parallel import TensorParallelGroup
from exactrl.engine.engine import RequestOutput
from exactrl.engine.sampler import SamplingParams
from exactrl.envs.rollout import EnvSetup, combine_episode_metrics
from exactrl.tasks import Example, RewardComputer, RewardResult
from exactrl.tasks.prompts import PromptEncoder, PromptFilter
from exactrl.tasks.rewards import CORRECT_ABOVE
from exactrl.train.disagg import RemoteEngine
from exactrl.train.dynamic_sampling import DynamicSampler, request_id_base
from exactrl.train.hooks import PromptSource
from exactrl.train.logging import progress_bar
from exactrl.train.optim import MasterAdamW, lr_factor, set_lr
from exactrl.train.run_summary import add_step_totals
from exactrl.train.trainer import MismatchError, PolicyTrainer, Rollout


@dataclass
class StepState:
    """What the run and its driver share from step to step."""

    step: int = 0  # steps done (the next step's index)
    model_tokens: int = 0  # the last scored batch's sampled (model) tokens over every rank
    last_rollouts: Any = None  # the last step's StepRollouts (sample logging, `exactrl bench rl`)


@dataclass
class StepRollouts:
    """What one RL step sampled and scored: the rollouts (rewards and advantages set) and their metrics."""

    rollouts: list[Rollout]  # this rank's
    rewards: torch.Tensor  # [N] fp32, the whole step's (every rank's, in rank order)
    advantages: torch.Tensor  # [N] fp32, sequence-level, the whole step's
    per_function: dict[str, list[float]]
    reward_errors: int
    lengths: list[int]  # completion lengths of the whole step (every rank's)
    truncated: list[bool]
    advantage_metrics: dict[str, float]
    completions: list[str]  # this rank's, decoded (for sample logging)
    answers: list[str]
    # Single-turn: failed calls per reward function over the whole step, {"<fn>/errors": n, "<fn>/timeouts": n}.
    reward_failures: dict[str, int] = field(default_factory=dict)


@dataclass
class RankScores:
    """One rank's share of a step with its rewards, before anything is gathered over the ranks."""

    rollouts: list[Rollout]  # this rank's (rewards and advantages not set yet)
    rewards: RewardResult
    completions: list[str]
    answers: list[str]
    refused: int  # this rank's prompts the engine refused
    metrics: dict[str, float] = field(default_factory=dict)  # the step's, e.g. dynamic sampling's


def env_episodes(
    engine: Any,
    tok: Any,
    examples: list[Example],
    prompt_ids: list[list[int]],
    env: EnvSetup,
    params: SamplingParams,
    request_ids: list[int],
    progress: Any = None,
) -> Any:
    """`exactrl.envs.run_episodes` on this process's engine (with the run's environment workers, started once),
    or, disaggregated (a `RemoteEngine`), on this trainer's generator against its own instance of the
    environment, or, with a `SharedEngine`, in lockstep with the other ranks of its group (each calling its own
    prompts' environments): the same episodes every way."""
    if isinstance(engine, SharedEngine):
        return engine.run_episodes(examples, prompt_ids, params, request_ids, progress=progress)
    if isinstance(engine, RemoteEngine):
        eb = engine.run_episodes(examples, prompt_ids, params, request_ids)
        if progress is not None:
            progress(sum(len(g) for g in eb.groups))
        return eb
    from exactrl.envs import run_episodes

    return run_episodes(
        engine,
        tok,
        examples,
        prompt_ids,
        env.make,
        env.settings,
        params,
        request_ids=request_ids,
        progress=progress,
        pool=env.pool(),  # the environment's worker processes, started once for the run
    )


def room_for_a_turn(cfg: RunConfig, ids: list[int]) -> bool:
    """Multi-turn: an episode's prompt must leave room for at least one turn (always true otherwise)."""
    return not cfg.env.name or 0 < len(ids) < episode_token_limit(cfg)


class RunStages:
    """The step's stages over one run's parts (`RLRun.__init__` makes it; `RLRun.build_trainer` gives it the
    trainer, its optimizers and the engine the step samples from). Every method is one
    stage a step driver calls; each says which are collectives (every rank calls them together)."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        state: StepState,
        dist: DistContext,
        parallel: Parallelism,
        out: Any,
        out_dir: Path,
        tok: Any,
        engine: Any,
        engine_group: TensorParallelGroup | None,
        env: EnvSetup | None,
        task: Any,
        encode: PromptEncoder,
        prompt_filter: PromptFilter,
        rewards: RewardComputer,
        dynamic: DynamicSampler | None,
        kl_ctl: KLController,
        totals: dict[str, int],
        logger: Any,
        prompt_source: PromptSource | None = None,
    ) -> None:
        self.cfg, self.state, self.dist, self.parallel = cfg, state, dist, parallel
        self.out, self.out_dir, self.ckpt_root = out, out_dir, out_dir / "checkpoints"
        self.tok, self.engine, self.engine_group, self.env = tok, engine, engine_group, env
        self.task, self.encode, self.prompt_filter, self.rewards = task, encode, prompt_filter, rewards
        self.dynamic, self.kl_ctl, self.totals, self.logger = dynamic, kl_ctl, totals, logger
        self.exact = cfg.run.exact
        self.stream: Any = None  # the task's training-example iterator (`open_stream`)
        self.trainer: PolicyTrainer | Any = None  # `RLRun.build_trainer`'s
        self.opt: MasterAdamW | Any = None
        self.critic_opt: MasterAdamW | None = None
        self.greedy_tokens = 0  # ReMax: the last greedy rollout's tokens
        # A caller's prompts in place of the task's (exactrl/train/hooks.py).
        self.prompt_source = prompt_source

    def open_stream(self, seed: int) -> None:
        """The task's training examples from its position now (a resumed run's, once restored)."""
        self.stream = self.task.train_examples(seed=seed)

    @property
    def step(self) -> int:
        """Steps done (the next step's index)."""
        return self.state.step

    @property
    def step_model_tokens(self) -> int:
        """The last scored batch's sampled (model) tokens over every rank."""
        return self.state.model_tokens

    @step_model_tokens.setter
    def step_model_tokens(self, value: int) -> None:
        self.state.model_tokens = value

    def room_for_a_turn(self, ids: list[int]) -> bool:
        return room_for_a_turn(self.cfg, ids)

    def set_lr(self, step: int) -> None:
        tr = self.cfg.train
        factor = lr_factor(step, warmup_steps=tr.warmup_steps, total_steps=tr.steps, schedule=tr.lr_schedule)
        set_lr(self.opt, tr.lr * factor)
        if self.critic_opt is not None:
            set_lr(self.critic_opt, tr.critic_lr * factor)

    def prompts(
        self, count: int | None = None, *, shard: bool = True
    ) -> tuple[list[Example], list[list[int]], list[int]]:
        """This rank's share of the step's prompts, with their indices in the step (which key the sampling
        noise, so a prompt gets the same completions at every world size). Every rank reads the same stream;
        too-long prompts are skipped and counted, not a crash. count: how many (default prompts_per_step; partial
        rollouts top their pool up); shard=False: all of them on every rank (partial rollouts take their slice)."""
        if self.prompt_source is not None:
            return self.prompt_source(count, shard=shard)
        cfg = self.cfg
        count = cfg.algorithm.prompts_per_step if count is None else count
        # Two passes over a finite training set with no prompt that fits means none ever will.
        max_skips_in_a_row = 2 * getattr(self.task, "num_train", 5_000) + 1
        examples: list[Example] = []
        prompt_ids: list[list[int]] = []
        skipped_in_a_row = 0
        while len(examples) < count:
            ex = next(self.stream)
            ids = self.encode(ex)
            if not self.prompt_filter.admit(ex, ids) or not self.room_for_a_turn(ids):
                self.totals["skipped_prompts"] += 1
                skipped_in_a_row += 1
                if skipped_in_a_row >= max_skips_in_a_row:  # e.g. every prompt is too long: never hang
                    raise ValueError(
                        f"{skipped_in_a_row} training prompts in a row are longer than task.max_prompt_tokens "
                        f"= {cfg.task.max_prompt_tokens} tokens: raise it (and engine.max_model_len), or check "
                        "task.prompt_field and the chat template"
                    )
                continue
            skipped_in_a_row = 0
            examples.append(ex)
            prompt_ids.append(ids)
        mine = list(self.dist.shard(len(examples)) if shard else range(len(examples)))
        return [examples[i] for i in mine], [prompt_ids[i] for i in mine], mine

    def sampling_params(self) -> SamplingParams:
        cfg = self.cfg
        sp = cfg.sampling
        return SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            max_tokens=sp.max_tokens,
            n=cfg.algorithm.group_size,
            seed=cfg.run.seed,
            stop=list(sp.stop),
            stop_token_ids=sorted(set(self.tok.stop_token_ids) | set(sp.stop_token_ids)),
        )

    def rollout(
        self, step: int, prompt_ids: list[list[int]], index: list[int], round_: int = 0
    ) -> list[RequestOutput]:
        """Sample group_size completions per prompt from the current weights. Request ids (the prompt's index
        in the step, offset by the step; a dynamic sampling round's above every round 0's) are unique across the
        run: they key the sampling noise."""
        n = self.cfg.algorithm.group_size
        base_id = request_id_base(step, round_, self.cfg.algorithm.prompts_per_step)
        bar = progress_bar(len(prompt_ids) * n, f"step {step + 1} generate", enabled=self.cfg.run.progress)
        outs = self.engine.generate(
            prompt_ids,
            self.sampling_params(),
            request_ids=[base_id + i for i in index],
            progress=bar.update,
        )
        bar.close()
        return outs

    def score(
        self,
        step: int,
        examples: list[Example],
        prompt_ids: list[list[int]],
        outs: list[RequestOutput],
        baseline: torch.Tensor | None = None,
    ) -> StepRollouts:
        """Rollouts with their rewards and sequence-level advantages; a prompt the engine refused is skipped.
        baseline: ReMax's greedy-rollout rewards, one per prompt of the whole step."""
        return self.step_scores(self.rank_scores(step, examples, prompt_ids, outs), baseline)

    def rank_scores(
        self, step: int, examples: list[Example], prompt_ids: list[list[int]], outs: list[RequestOutput]
    ) -> RankScores:
        """This rank's rollouts and their rewards, no collective: the off-policy worker thread runs it under
        torchrun, where collectives stay on the main thread (`exactrl.train.offpolicy_dist`)."""
        a = self.cfg.algorithm
        rollouts: list[Rollout] = []
        completions, answers, exs = [], [], []
        refused = 0
        for ex, ids, o in zip(examples, prompt_ids, outs):
            if o.error is not None or len(o.samples) != a.group_size:
                # The engine refused this prompt (e.g. it can never fit the KV cache): skip its group, count
                # it (over every rank, in with_advantages), and train on the others.
                refused += 1
                self.out(f"step {step + 1}: prompt skipped by the engine: {o.error}")
                continue
            for j, smp in enumerate(o.samples):
                rollouts.append(
                    Rollout(
                        prompt_ids=ids,
                        completion_ids=smp.token_ids,
                        rollout_logprobs=smp.rollout_logprobs,
                        truncated=smp.finish_reason == "length",
                        request_id=o.request_id,
                        sample_index=j,
                    )
                )
                completions.append(self.tok.decode(smp.token_ids))
                answers.append(ex.answer)
                exs.append(ex)
        if not rollouts:
            raise RuntimeError(
                f"step {step + 1}: the engine refused every prompt of "
                + ("rank " + str(self.dist.rank) + "'s share of " if self.dist.distributed else "")
                + f"the step ({outs[0].error if outs else 'no prompt'}); check engine.num_kv_blocks / "
                "engine.max_model_len against the prompt lengths"
            )
        res = self.rewards(completions, answers, exs)
        if self.cfg.reward.overlong_buffer_tokens:  # DAPO's soft overlong penalty (algorithms/overlong.py)
            r = self.cfg.reward
            lengths = [len(ro.completion_ids) for ro in rollouts]
            add_overlong_penalty(
                res, lengths, self.cfg.sampling.max_tokens, r.overlong_buffer_tokens, r.overlong_penalty
            )
        return RankScores(rollouts, res, completions, [str(x) for x in answers], refused)

    def dynamic_scores(
        self, step: int, examples: list[Example], prompt_ids: list[list[int]], index: list[int]
    ) -> RankScores:
        """algorithm.dynamic_sampling: this rank's share of the step's kept groups, sampled round by round from
        these prompts on (exactrl/train/dynamic_sampling.py); its metrics travel in `metrics`."""
        assert self.dynamic is not None

        def sample(round_: int, d: tuple[list[Example], list[list[int]], list[int]]) -> RankScores:
            if self.env is not None:  # multi-turn: a round of episodes
                return self.rank_episodes(step, *d, round_=round_)
            return self.rank_scores(step, d[0], d[1], self.rollout(step, d[1], d[2], round_))

        share, metrics = self.dynamic.collect(step, (examples, prompt_ids, index), self.prompts, sample)
        rs = cast(RankScores, share)  # the shares `sample` returns
        rs.metrics.update(metrics)
        return rs

    def step_scores(self, rs: RankScores, baseline: torch.Tensor | None) -> StepRollouts:
        """The step's advantages and reward failures from every rank's `rank_scores` (collectives)."""
        res = rs.rewards
        errors = sum(res.num_errors.values()) + sum(res.num_timeouts.values())
        sr = self.with_advantages(
            rs.rollouts,
            res.rewards,
            res.per_function,
            errors,
            rs.completions,
            rs.answers,
            baseline,
            refused=rs.refused,
        )
        # Per function, over every rank: a broken function is named in the metrics, not only summed.
        for part in self.dist.all_gather_object((res.num_errors, res.num_timeouts)):
            for kind, counts in zip(("errors", "timeouts"), part):
                for name, n in counts.items():
                    key = f"{name}/{kind}"
                    sr.reward_failures[key] = sr.reward_failures.get(key, 0) + n
        sr.advantage_metrics.update(self.sampling_metrics(rs.metrics))
        return sr

    def episodes(
        self, step: int, examples: list[Example], prompt_ids: list[list[int]], index: list[int]
    ) -> StepRollouts:
        """Multi-turn: group_size episodes per prompt against the configured environment, continuously batched
        in the engine (a turn resumes on the conversation's cached KV); the environment gives the reward. The
        trainer gets the engine's token ids, observations masked out of the loss. With dynamic sampling the
        episodes are sampled round by round (`dynamic_scores`); env/* metrics are then the first round's, the
        environment's errors and timeouts every round's."""
        if self.dynamic is not None:
            rs = self.dynamic_scores(step, examples, prompt_ids, index)
        else:
            rs = self.rank_episodes(step, examples, prompt_ids, index)
        res = rs.rewards
        errors = sum(res.num_errors.values()) + sum(res.num_timeouts.values())
        sr = self.with_advantages(
            rs.rollouts, res.rewards, {}, errors, rs.completions, rs.answers, None, refused=rs.refused
        )
        # turns, tool calls, environment errors and timeouts, over every rank's episodes
        sr.advantage_metrics.update(self.sampling_metrics(rs.metrics))
        return sr

    def sampling_metrics(self, mine: dict[str, float]) -> dict[str, float]:
        """The step's view of each rank's sampling metrics (a collective): env/* over every rank's episodes."""
        return combine_episode_metrics(self.dist.all_gather_object(mine))

    def rank_episodes(
        self,
        step: int,
        examples: list[Example],
        prompt_ids: list[list[int]],
        index: list[int],
        round_: int = 0,
    ) -> RankScores:
        """This rank's episodes of one round, no collective of the job's (an engine split over a group trades
        verdicts within the group, `SharedEngine.run_episodes`): rewards the environment's, the verdict (`correct`)
        reward > 0.5, the environment's failures as num_errors/num_timeouts, its metrics in `metrics`."""
        from exactrl.envs.rollout import env_report, env_stop

        cfg, a = self.cfg, self.cfg.algorithm
        assert self.env is not None
        params = self.sampling_params()
        params.stop = env_stop(params.stop, self.env.cls)
        base_id = request_id_base(step, round_, a.prompts_per_step)
        bar = progress_bar(
            len(prompt_ids) * a.group_size, f"step {step + 1} episodes", enabled=cfg.run.progress
        )
        eb = env_episodes(
            self.engine,
            self.tok,
            examples,
            prompt_ids,
            self.env,
            params,
            [base_id + i for i in index],
            progress=bar.update,
        )
        bar.close()
        for line in env_report(eb, self.env.settings):  # what failed, where in the environment's file
            self.out(f"step {step + 1}: {line}")
        rollouts: list[Rollout] = []
        rewards: list[float] = []
        completions, answers = [], []
        refused = 0
        for k, (ex, group, err) in enumerate(zip(examples, eb.groups, eb.errors)):
            if err is not None or len(group) != a.group_size:
                refused += 1
                self.out(f"step {step + 1}: prompt skipped by the engine: {err}")
                continue
            for j, e in enumerate(group):
                rollouts.append(
                    Rollout(
                        prompt_ids=e.prompt_ids,
                        completion_ids=e.completion_ids,
                        rollout_logprobs=e.rollout_logprobs,
                        truncated=e.finish_reason in ("max_turns", "max_tokens"),
                        request_id=base_id + index[k],
                        sample_index=j,
                        loss_mask=e.loss_mask,
                    )
                )
                rewards.append(e.reward)
                completions.append(self.tok.decode(e.completion_ids))
                answers.append(str(ex.answer))
        if not rollouts:
            raise RuntimeError(
                f"step {step + 1}: the engine refused every prompt of this share of the step "
                f"({eb.errors[0] if eb.errors else 'no prompt'})"
            )
        failures = {k: int(eb.metrics.get(f"env/{k}", 0)) for k in ("errors", "timeouts")}
        res = RewardResult(
            rewards,
            {},
            {"env": failures["errors"]},
            {"env": failures["timeouts"]},
            correct=[r > CORRECT_ABOVE for r in rewards],  # the environment's verdict
        )
        return RankScores(rollouts, res, completions, answers, refused, metrics=dict(eb.metrics))

    def with_advantages(
        self,
        rollouts: list[Rollout],
        rewards: list[float],
        per_function: dict[str, list[float]],
        errors: int,
        completions: list[str],
        answers: list[str],
        baseline: torch.Tensor | None,
        refused: int = 0,
    ) -> StepRollouts:
        """Sequence-level advantages over the whole step (every rank's rewards, in rank order), set on this
        rank's rollouts, with the step's statistics."""
        a = self.cfg.algorithm
        lens = [len(x.completion_ids) for x in rollouts]
        # The model's tokens per rollout (a multi-turn episode's observations are not its).
        model_tokens = [n if x.loss_mask is None else int(sum(x.loss_mask)) for n, x in zip(lens, rollouts)]
        parts = self.dist.all_gather_object(
            (rewards, per_function, errors, lens, [x.truncated for x in rollouts], refused, sum(model_tokens))
        )
        self.totals["skipped_prompts"] += sum(p[5] for p in parts)
        self.step_model_tokens = sum(p[6] for p in parts)
        r = torch.tensor([v for p in parts for v in p[0]], dtype=torch.float32)
        all_lengths = [n for p in parts for n in p[3]]
        adv_metrics: dict[str, float] = {}
        if a.needs_critic:  # token-level GAE in the trainer; these stay zero
            adv = torch.zeros_like(r)
        else:
            adv, adv_metrics = compute_advantages(
                a.resolved_advantage,
                r,
                a.group_size,
                lengths=torch.tensor(all_lengths, dtype=torch.float32),
                baseline_rewards=baseline,
                adv_scale=a.adv_scale,
                whiten=a.resolved_whiten_advantages,
            )
        start = sum(len(p[0]) for p in parts[: self.dist.rank])
        for ro, rew, ad in zip(rollouts, r[start:].tolist(), adv[start:].tolist()):
            ro.reward, ro.advantage = rew, ad
        per_function = {k: [v for p in parts for v in p[1][k]] for k in per_function}
        return StepRollouts(
            rollouts,
            r,
            adv,
            per_function,
            sum(p[2] for p in parts),
            all_lengths,
            [t for p in parts for t in p[4]],
            adv_metrics,
            completions,
            answers,
        )

    def greedy_baseline(
        self, step: int, prompt_ids: list[list[int]], index: list[int], examples
    ) -> torch.Tensor:
        """ReMax: one greedy completion per prompt through the same engine, scored by the same rewards; the
        rewards of every rank's prompts, in step order. Request ids are the step's own (greedy draws no noise)."""
        return self.gather_baseline(self.greedy_rewards(step, prompt_ids, index, examples))

    def gather_baseline(self, rewards: list[float]) -> torch.Tensor:
        """Every rank's greedy rewards (`greedy_rewards`), in step order (a collective)."""
        return torch.tensor([v for p in self.dist.all_gather_object(rewards) for v in p], dtype=torch.float32)

    def greedy_rewards(
        self, step: int, prompt_ids: list[list[int]], index: list[int], examples
    ) -> list[float]:
        """ReMax's greedy completions of this rank's prompts and their rewards, no collective."""
        import dataclasses

        params = dataclasses.replace(self.sampling_params(), temperature=0.0, top_p=1.0, top_k=0, n=1)
        base_id = step * self.cfg.algorithm.prompts_per_step
        outs = self.engine.generate(prompt_ids, params, request_ids=[base_id + i for i in index])
        texts = [self.tok.decode(o.samples[0].token_ids) if o.samples else "" for o in outs]
        res = self.rewards(texts, [ex.answer for ex in examples], list(examples))
        self.greedy_tokens = sum(len(o.samples[0].token_ids) for o in outs if o.samples)
        return res.rewards

    def mismatch_report(
        self, step: int, rollouts: list[Rollout], err: MismatchError, model: Any = None
    ) -> Path | None:
        """Write `mismatch-<step + 1>/` from every rank's offending sequences (a collective): what `exactrl parity
        --replay` needs. Returns its path on rank 0 (None on the others, or when no sequence was kept). model: the
        weights that sampled them when the engine's have moved on (a deferred guard's copy; None: the engine's)."""
        from exactrl.train.mismatch_report import MismatchSequence, write_mismatch_report

        seqs = [
            MismatchSequence(
                request_id=cast(int, rollouts[i].request_id),  # every sampled rollout carries its request
                sample_index=cast(int, rollouts[i].sample_index),
                prompt_ids=rollouts[i].prompt_ids,
                completion_ids=rollouts[i].completion_ids,
                rollout_logprobs=r_lp,
                trainer_logprobs=t_lp,
                rank=self.dist.rank if self.dist.distributed else None,
            )
            for i, _, r_lp, t_lp in err.sequences
        ]
        if self.parallel.replica_released and model is None:
            # Released for the training phase; no optimizer step applied the batch, so the shards still hold the
            # sampling weights the report needs (every rank is here: a collective).
            self.parallel.sync_weights()
        every = [s for part in self.dist.all_gather_object(seqs) for s in part]
        if not every:
            return None
        # Every rank (a shared engine's whole weights are gathered).
        whole = self.whole_engine_model() if model is None else model
        if not self.dist.is_main:
            return None
        sp = self.sampling_params()
        # No optimizer step touched the batch (abort or skip_step): the engine's weights are the sampling weights.
        return write_mismatch_report(
            self.out_dir,
            step + 1,
            cfg=self.cfg,
            model=whole,
            tokenizer=self.tok,
            sequences=every,
            sampling={
                "seed": sp.seed,
                "temperature": sp.temperature,
                "top_k": sp.top_k,
                "top_p": sp.top_p,
                "max_tokens": sp.max_tokens,
                "n": sp.n,
                "stop": list(sp.stop),
                "stop_token_ids": list(sp.stop_token_ids),
            },
        )

    def whole_engine_model(self) -> Any:
        """The engine's weights whole, for what rank 0 writes (a checkpoint's policy/, a replay report): its model,
        or with a shared engine (each rank a slice) a copy gathered on rank 0, a collective of every rank."""
        if self.engine_group is None:
            return self.engine.model
        return self.parallel.whole_engine_model()

    def mismatch_abort(self, step: int, sr: StepRollouts, err: MismatchError) -> None:
        """Exact mode found a difference and no update was applied: leave what is needed to replay it."""
        self.abort_notice(step, str(err), self.mismatch_report(step, sr.rollouts, err))

    def abort_notice(self, step: int, what: str, where: Path | None) -> None:
        """An aborted step's record and lines (rank 0): what differed, the replay report, the resume point."""
        if self.dist.is_main:
            self.logger.log({"step": step + 1, "mismatch/aborted": 1.0})
            self.logger.close()
            self.out(f"\n!! {what}\n   replay it: exactrl parity --replay {where}")
            self.out(
                f"   resume point: the last checkpoint under {self.ckpt_root} (nothing of step {step + 1} was applied)"
            )

    def update(
        self, step: int, rollouts: list[Rollout], off_policy_cap: float | None = None
    ) -> dict[str, float]:
        """One trainer step on the rollouts; the weights change in place, so the engine samples from them next.
        A step that run.on_mismatch = "skip_step" dropped leaves the replay report an abort leaves.
        off_policy_cap: a batch the off-policy guard checked (decoupled PPO, `PolicyTrainer.step`)."""
        bar = progress_bar(1, f"step {step + 1} train", enabled=self.cfg.run.progress)
        self.trainer.kl_coef = self.kl_ctl.value
        m = self.trainer.step(rollouts, off_policy_cap=off_policy_cap)
        bar.update(1)
        bar.close()
        skipped = self.trainer.skipped_mismatch
        if skipped is not None:  # as real a difference as an abort's: the run goes on, the evidence stays
            where = self.mismatch_report(step, rollouts, skipped)
            if where is not None:
                self.out(f"step {step + 1} skipped: {skipped}\n   replay it: exactrl parity --replay {where}")
        return m

    def step_metrics(self, m: dict[str, float], sr: StepRollouts) -> dict[str, float]:
        """The trainer's metrics plus rewards, advantages, lengths and the run's running totals."""
        from exactrl.algorithms import response_length_metrics

        a = self.cfg.algorithm
        r = sr.rewards
        lengths = torch.tensor(sr.lengths, dtype=torch.float32)
        per_fn = {k: torch.tensor(v, dtype=torch.float32) for k, v in sr.per_function.items()}
        m.update(reward_metrics(r, a.group_size, per_fn))
        if not a.needs_critic:  # GAE's token-level advantages are logged by the trainer
            m.update(advantage_metrics(sr.advantages[:, None], torch.ones(len(sr.advantages), 1)))
        m.update(response_length_metrics(lengths, torch.tensor(sr.truncated)))
        m.update(overlong_metrics(sr.per_function))
        # Accuracy is the correctness verdict, never the summed reward (a format bonus is not a right answer):
        # a multi-turn episode's is its environment's reward; a single-turn sample's is the correctness function's
        # score (reward.accuracy); without one it is not reported.
        acc_fn = self.rewards.accuracy_fn if self.rewards is not None else None
        if self.cfg.env.name:
            m["train/accuracy"] = float((r > CORRECT_ABOVE).float().mean())
        elif acc_fn is not None and acc_fn in per_fn:
            m["train/accuracy"] = float((per_fn[acc_fn] > CORRECT_ABOVE).float().mean())
        for key, n in sr.reward_failures.items():
            m[f"reward/{key}"] = float(n)
        self.totals["reward_errors"] += sr.reward_errors
        m["reward/errors"] = float(sr.reward_errors)
        m["prompts/skipped_total"] = float(self.totals["skipped_prompts"])
        if "mismatch/num_tokens" in m:
            self.totals["compared"] += int(m["mismatch/num_tokens"])
            self.totals["mismatched"] += int(m["mismatch/num_mismatched_tokens"])
        # Exact mode compares every completion token of the step (fast mode recomputes them all as well).
        m["mismatch/completion_tokens"] = float(self.step_model_tokens)
        add_step_totals(self.totals, sr.advantage_metrics)  # dynamic sampling's prompts and groups
        if m.get("mismatch/step_skipped"):
            self.totals["mismatch_skipped_steps"] = self.totals.get("mismatch_skipped_steps", 0) + 1
            self.out(
                f"step {self.step}: {int(m['mismatch/num_mismatched_tokens'])} rollout logprobs differ from the "
                "trainer's: the step's batch was dropped (run.on_mismatch = 'skip_step')"
            )
        elif self.exact and m.get("mismatch/num_mismatched_tokens", 0) > 0:
            self.out(
                f"warning: step {self.step}: {int(m['mismatch/num_mismatched_tokens'])} rollout logprobs differ "
                "from the trainer's; trained on anyway (run.on_mismatch = 'warn')"
            )
        return m
