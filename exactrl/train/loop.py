"""`exactrl train`: rollout (engine) -> rewards -> advantages -> train step -> repeat, colocated on one device.

The engine and the trainer hold the *same* model object: after each optimizer step the next `generate` samples
from the new weights with no file round trip. In exact mode the first minibatch of every step re-derives the
rollout logprobs through the training path and logs how many differ (`mismatch/num_mismatched_tokens`, which is 0).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import signal
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from exactrl.algorithms import KLController, advantage_metrics, compute_advantages, reward_metrics
from exactrl.algorithms.overlong import add_overlong_penalty, overlong_metrics
from exactrl.config import RunConfig, episode_token_limit
from exactrl.distributed.checkpoint import (
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from exactrl.distributed.env import init_from_env, rank_device, under_torchrun
from exactrl.distributed.layout import Layout, split_layout
from exactrl.distributed.parallelize import Parallelism
from exactrl.distributed.shared_engine import (
    SharedEngine,
    engine_group,
    split_engine_model,
)
from exactrl.distributed.tensor_parallel import TensorParallelGroup
from exactrl.engine.engine import EngineConfig, RequestOutput, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.envs.rollout import EnvSetup
from exactrl.model.files import writing
from exactrl.model.loading import load_policy, resolve_device
from exactrl.model.moe import has_experts
from exactrl.model.tokenizer import Tokenizer
from exactrl.ops import set_exact_environment
from exactrl.tasks import Example, RewardComputer, RewardResult, load_chat_template, make_task
from exactrl.tasks.prompts import PromptEncoder, PromptFilter
from exactrl.tasks.rewards import CORRECT_ABOVE
from exactrl.train.checkpoint import check_resumable, latest_checkpoint, load_checkpoint, save_checkpoint
from exactrl.train.critic import ValueModel
from exactrl.train.disagg import RemoteEngine, serve_generator
from exactrl.train.drivers.base import Stages, StepContext, StepDriver, StepState
from exactrl.train.drivers.disagg import WeightSync
from exactrl.train.drivers.modes import DriverName, choose_driver
from exactrl.train.drivers.offpolicy import OneStepOffDriver
from exactrl.train.drivers.partial import PartialDriver
from exactrl.train.drivers.sync import SyncDriver
from exactrl.train.drivers.tail import TailDriver
from exactrl.train.dynamic_sampling import DynamicSampler, request_id_base
from exactrl.train.logging import MetricsLogger, import_wandb, progress_bar, step_line
from exactrl.train.memory import check_before_loading, engine_group_ranks, microbatch_tokens, model_config
from exactrl.train.offpolicy import BehaviourPolicy
from exactrl.train.offpolicy_dist import ReplicaBehaviour
from exactrl.train.optim import MasterAdamW, lr_factor, set_lr
from exactrl.train.phases import MemoryPhases
from exactrl.train.preflight import check_run_config, dropped_on_resume
from exactrl.train.rundir import RunClock, RunDirPlan, check_run_dir
from exactrl.train.sft import (
    SFT_CHECKPOINTS,
    SFTCheckpointing,
    SFTResumePoint,
    run_sft,
    sft_resume_point,
    truncate_sft_log,
    write_sft_model,
)
from exactrl.train.trainer import MismatchError, PolicyTrainer, Rollout, TrainerSettings


def job_layout(cfg: RunConfig) -> Layout:
    """This rank's place in the job (every rank calls it: the process groups are made collectively): the
    colocated layout, or trainer / generator ranks, the generators' engines split over groups of
    engine.tensor_parallel / expert_parallel ranks."""
    return split_layout(
        init_from_env(resolve_device(cfg.run.device)),
        cfg.distributed.generator_ranks,
        engine_group_ranks(cfg),
    )


class _StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM sets the flag: the current step finishes, a checkpoint is written, the run exits
    cleanly. SIGTERM is what a cluster scheduler (Slurm, Kubernetes) and torchrun's agent send before they kill a
    job: treated like Ctrl-C, a preempted run keeps its work. A second signal gives up waiting."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.stop = False
        self.signal_name: str | None = None  # the signal that asked to stop ("SIGINT", "SIGTERM")
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        # Under torchrun a rank often gets one stop twice: from the scheduler or the terminal (which signal every
        # process of the job) and again from torchrun's agent, which passes every signal on to its ranks. A repeat
        # must not abort the checkpoint then; the agent's SIGKILL after its shutdown timeout is the hard stop.
        repeats_abort = not under_torchrun()

        def handler(signum, frame):
            if self.stop:  # a second signal: give up waiting (one process), or the same stop again (torchrun)
                if repeats_abort:
                    raise KeyboardInterrupt
                return
            self.stop = True
            self.signum = signum
            self.signal_name = signal.Signals(signum).name
            what = "Ctrl-C" if signum == signal.SIGINT else self.signal_name
            print(
                f"\n{what}: finishing this step, then writing a checkpoint ({what} again to abort)",
                flush=True,
            )

        for sig in self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: signals are not ours to take
                break
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def build_task(cfg: RunConfig):
    t = cfg.task
    if t.name == "arithmetic":
        return make_task(
            "arithmetic",
            max_operand=t.arithmetic_max_operand,
            ops=t.arithmetic_ops,
            num_terms=t.arithmetic_num_terms,
            seed=cfg.run.seed,
        )
    return make_task(
        t.name,
        path=t.path,
        eval_path=t.eval_path,
        prompt_field=t.prompt_field,
        answer_field=t.answer_field,
        num_eval=t.num_eval,
        seed=cfg.run.seed,
    )


def make_encoder(cfg: RunConfig, tok: Tokenizer) -> PromptEncoder:
    template = None
    if cfg.task.use_chat_template:
        template = tok.chat_template
        if template is None and cfg.model.path:
            template = load_chat_template(cfg.model.path)
    # The checkpoint's named special tokens (e.g. a Llama template's {{ bos_token }}), then the user's kwargs.
    kwargs = {**getattr(tok, "special_tokens", {}), **dict(cfg.task.chat_template_kwargs)}
    return PromptEncoder(tok, template, cfg.task.system_prompt, kwargs)


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


def env_setup(cfg: RunConfig, search_dirs: list[str] | None = None) -> EnvSetup:
    """The [env] section as the episode driver takes it (the environment resolved, its options checked)."""
    from exactrl.envs import EpisodeSettings, env_factory

    cls, make = env_factory(cfg.env.name, cfg.env.options, search_dirs)
    settings = EpisodeSettings(
        max_turns=cfg.env.max_turns,
        max_tokens_per_turn=cfg.sampling.max_tokens,
        max_episode_tokens=episode_token_limit(cfg),
        timeout_s=cfg.env.timeout_s,
        isolation=cfg.env.isolation,
        workers=cfg.env.workers,
        max_error_share=cfg.env.max_error_share,
    )
    return EnvSetup(cls, make, settings)


def evaluate(
    engine: RolloutEngine,
    tok: Tokenizer,
    encode: PromptEncoder,
    examples: list[Example],
    rewards: RewardComputer,
    *,
    samples: int = 1,
    temperature: float = 0.0,
    max_tokens: int = 64,
    seed: int = 0,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    env: EnvSetup | None = None,
) -> dict[str, float]:
    """Accuracy and pass@k over held-out examples. Accuracy: the share of samples the correctness function
    (`rewards.accuracy_fn`, reward.accuracy) scores above 0.5, over every sample of every example: with one greedy
    sample (the default) the greedy answers' accuracy; with k samples at T > 0 the mean over them (pass@1 estimated
    from k samples, steadier than the first sample's). Never the summed reward: a format bonus is not a correct
    answer. Without a correctness function the accuracy keys are left out (not reported, rather than invented);
    eval/reward (the summed reward) and eval/reward/<function> are always there.

    env: a multi-turn run's environment. A tool agent is measured with its tool: every example is an episode
    through the environment (tool calls answered, as in training), scored by the environment's reward, whose
    verdict (episode reward > 0.5) is the accuracy, and the episodes' metrics are logged under eval/env/...;
    `rewards` is not used then."""
    if not examples:
        return {}
    ids = [encode(ex) for ex in examples]
    params = SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        n=samples,
        seed=seed + 7_777_777,
        stop_token_ids=sorted(set(tok.stop_token_ids) | set(stop_token_ids or [])),
        stop=list(stop or []),
    )
    extra: dict[str, float] = {}
    if env is not None:
        from exactrl.envs.rollout import env_stop

        params.stop = env_stop(params.stop, env.cls)
        eb = env_episodes(engine, tok, examples, ids, env, params, list(range(len(ids))))
        # A prompt the engine refused (no episodes) scores 0 on every sample.
        flat = [g[j].reward if j < len(g) else 0.0 for g in eb.groups for j in range(samples)]
        r = torch.tensor(flat, dtype=torch.float32).view(len(examples), samples)
        extra = {f"eval/{k}": v for k, v in eb.metrics.items()}
        correct: torch.Tensor | None = r > CORRECT_ABOVE  # the environment's verdict
    else:
        outs = engine.generate(ids, params, request_ids=list(range(len(ids))))
        completions, answers, exs = [], [], []
        for ex, out in zip(examples, outs):
            for s in out.samples:
                completions.append(tok.decode(s.token_ids))
                answers.append(ex.answer)
                exs.append(ex)
        res = rewards(completions, answers, exs)
        r = torch.tensor(res.rewards, dtype=torch.float32).view(len(examples), samples)
        extra = {f"eval/reward/{k}": sum(v) / len(v) for k, v in res.per_function.items() if v}
        correct = None if res.correct is None else torch.tensor(res.correct).view(len(examples), samples)
    out = {"eval/reward": float(r.mean()), "eval/num_examples": float(len(examples)), **extra}
    if correct is not None:
        out["eval/accuracy"] = float(correct.float().mean())
        if samples > 1:
            out[f"eval/pass@{samples}"] = float(correct.any(1).float().mean())
            out["eval/mean_accuracy"] = float(correct.float().mean())
    return out


def train(
    cfg: RunConfig,
    resume: bool = False,
    out=print,
    *,
    overwrite: bool = False,
    allow_config_change: bool = False,
    run_dir: RunDirPlan | None = None,
) -> dict[str, Any]:
    """Run the whole job described by cfg; returns the summary written to summary.json.

    Nothing is written to cfg.run.output_dir before the model, data and rewards have loaded; a non-empty dir
    needs resume or overwrite (`rundir.check_run_dir`; `run_dir` is a plan the caller already checked).
    Relative paths (data, models, reward files, environment modules) are resolved from the working directory
    (`exactrl.config.check_path_anchors`).

    Under torchrun with distributed.generator_ranks = G > 0 the last G ranks only generate (`serve_generator`)
    and the others run this loop as the colocated run at their own world size would (exactrl/train/disagg.py)."""
    cfg.validate()
    check_modes_before_launch(cfg)
    layout = job_layout(cfg)
    if layout.role == "generator":  # multi-turn: the episodes run here, against this rank's environment
        return serve_generator(cfg, layout, env=env_setup(cfg) if cfg.env.name else None)
    run = RLRun(
        cfg,
        resume=resume,
        out=out,
        overwrite=overwrite,
        allow_config_change=allow_config_change,
        run_dir=run_dir,
        layout=layout,
    )
    try:
        return run.run()
    finally:
        run.close()


def check_modes_before_launch(cfg: RunConfig) -> None:
    """The modes' refusals (`choose_driver`) before the ranks split into trainers and generators: every rank, a
    generator too, refuses the same way."""
    choose_driver(cfg, distributed=under_torchrun(), moe=model_config(cfg).is_moe)


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


class RLRun:
    """One `exactrl train` job, cut into the stages of the algorithm:

    setup (here) -> warm_start (SFT, the held-out baseline) -> build_trainer (and the step driver) -> restore (on
    --resume) -> per step: `driver.step()` (prompts -> rollout -> score (rewards, advantages) -> update, in the
    driver's order: exactrl/train/drivers/) -> log -> checkpoint -> finish."""

    def __init__(
        self,
        cfg: RunConfig,
        resume: bool = False,
        out=print,
        *,
        overwrite: bool = False,
        allow_config_change: bool = False,
        run_dir: RunDirPlan | None = None,
        layout: Layout | None = None,
    ) -> None:
        self.clock = RunClock()
        cfg.validate()
        # Under torchrun: this rank's place in the run (world size 1 without it); rank 0 alone prints and writes.
        # A disaggregated run's trainer: its place among the trainers (the generators are not in its collectives).
        if layout is None:
            check_modes_before_launch(cfg)
            layout = job_layout(cfg)
        if layout.role == "generator":
            raise ValueError("RLRun runs on trainer ranks; a generator rank runs serve_generator")
        self.layout = layout
        self.dist = layout.local
        self.parallel = Parallelism(self.dist)
        # What `exactrl plan` and `train --nproc N` (before launching) refuse too: the checks that need the world
        # size or the model's shape, the modes' among them; and the step driver that runs this config.
        self.driver_name: DriverName = check_run_config(
            cfg, self.dist.world_size, distributed=self.dist.distributed
        )
        self.cfg, self.resume = cfg, resume
        # engine.tensor_parallel / expert_parallel: the ranks of each group share one engine split over them
        # (exactrl/distributed/shared_engine.py); None: every rank its own.
        self.engine_group: TensorParallelGroup | None = None
        e = cfg.engine
        # (A disaggregated run's engine is the generators': split over their groups, `split_layout`.)
        if engine_group_ranks(cfg) > 1 and not layout.disaggregated:
            self.engine_group = engine_group(
                self.dist.rank, self.dist.world_size, e.tensor_parallel, e.expert_parallel
            )
        self.out = out if self.dist.is_main else (lambda *a, **k: None)
        self.out_dir = Path(cfg.run.output_dir)
        self.rewards: RewardComputer | None = None
        # The output dir is checked now and changed only once everything has loaded (plan.commit below).
        self.plan = run_dir
        if self.plan is None and self.dist.is_main:  # rank 0 alone owns the run directory
            self.plan = check_run_dir(
                cfg, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change
            )
            for note in self.plan.notes:
                self.out(note)
        if cfg.run.wandb and self.dist.is_main:
            import_wandb()  # a missing package is said now, not after the model has loaded
        self.device = rank_device(self.dist, resolve_device(cfg.run.device))
        # Before anything loads: a run whose phases cannot fit the GPU is refused now, naming the knobs.
        # Planned as the run trains: FSDP2 whenever torchrun started it, one rank included (its sharded layout and
        # larger microbatch), not only at world size 2 or more.
        sharded = self.parallel.sharded
        memory_plan = check_before_loading(
            cfg, str(self.device), self.dist.world_size, out=self.out, sharded=sharded
        )
        self.memory_plan = memory_plan  # None on the CPU (`exactrl bench rl` records its phases' peaks)
        # The trainer's microbatch budget: under FSDP2 the plan's (train.fsdp_tokens_per_microbatch, or the largest
        # that fits), else train.max_tokens_per_microbatch.
        self.microbatch_tokens = (
            memory_plan.counts["tokens_per_microbatch"]
            if memory_plan is not None
            else microbatch_tokens(cfg, self.dist.world_size, sharded=sharded)
        )
        # The phase switches (KV cache and replica released while the trainer runs), with the plan's KV size on
        # a GPU: the cache is sized so that the phases holding it fit (exactrl/train/phases.py).
        kv_blocks = memory_plan.counts["kv_blocks"] if memory_plan is not None else None
        if kv_blocks is not None and self.engine_group is not None:
            # Each rank planned from its own device's memory; the ranks of one engine must hold the same cache.
            kv_blocks = self.engine_group.min(kv_blocks)
        self.phases = MemoryPhases(cfg, self.parallel, kv_blocks)
        self.exact = cfg.run.exact
        set_exact_environment(self.exact)
        torch.manual_seed(cfg.run.seed)
        if self.exact:
            # Deterministic backward kernels (e.g. the embedding gradient without atomics): same seed, same run.
            # Not torch's filling of every new tensor with NaN under that mode: exactrl's kernels write all of
            # each output, and the fill would be an extra full write of every activation in every step.
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = False

        self.model, self.tok = load_policy(
            preset_name=cfg.model.preset,
            path=cfg.model.path,
            device=self.device,
            dtype=cfg.model.dtype,
            exact=self.exact,
            fp32_lm_head=cfg.model.fp32_lm_head,
            seed=cfg.run.seed,
            tokenizer_path=cfg.model.tokenizer,
            init_draws=cfg.model.init_draws,
            precision=cfg.model.precision,
        )
        if cfg.model.precision == "fp8" and self.dist.distributed:
            raise ValueError(
                'model.precision = "fp8" runs on one process for now (the weight sync does not send fp8 weights '
                "and the FSDP2 trainer does not quantize): run without torchrun (--nproc 1 or none), or set "
                'model.precision = "dtype"'
            )
        if (cfg.train.moe_aux_loss_coef or cfg.train.moe_z_loss_coef) and not has_experts(self.model):
            # Said now, before the warm start and the run folder's commit (the trainer refuses it too, later).
            raise ValueError(
                f"train.moe_aux_loss_coef = {cfg.train.moe_aux_loss_coef} and train.moe_z_loss_coef = "
                f"{cfg.train.moe_z_loss_coef}: router losses need a mixture-of-experts model, and "
                f"{cfg.model.preset or cfg.model.path} has no sparse layer; set both to 0"
            )
        # An environment that cannot load (or refuses its env.options) is said now, not after the warm start.
        self.env: EnvSetup | None = None
        if cfg.env.name:
            self.env = env_setup(cfg)
        self.task = build_task(cfg)
        self.encode = make_encoder(cfg, self.tok)
        # Too-long prompts are skipped and named (file:line), with the key to change.
        self.prompt_filter = PromptFilter(
            cfg.task.max_prompt_tokens, cfg.engine.max_model_len, cfg.sampling.max_tokens, log=self.out
        )
        self.rewards = RewardComputer.from_config(cfg.reward, device=self.device)
        # The [engine] section's fields are a subset of the engine's own config: passed through by name. A
        # disaggregated trainer's engine is its generator (`generate` there, the weight replica here).
        self.remote: RemoteEngine | None = None
        if layout.disaggregated:
            self.remote = RemoteEngine(layout, EngineConfig(**asdict(cfg.engine)))
            self.engine: Any = self.remote
        else:
            self.engine = RolloutEngine(self.model, EngineConfig(**asdict(cfg.engine)), tokenizer=self.tok)
        self.weights = WeightSync(self.parallel, self.remote)
        self.ckpt_root = self.out_dir / "checkpoints"
        self._frozen_policy: Path | None = None  # this process's last policy/ of a frozen base (LoRA)
        self.resume_from = latest_checkpoint(self.ckpt_root) if resume else None
        # Without an RL checkpoint, SFT's own resume point: an unfinished SFT continues from its last checkpoint,
        # a finished one is not run again (its weights are sft/).
        self.sft_point = SFTResumePoint()
        if resume and self.resume_from is None and cfg.sft.steps > 0 and not cfg.sft.checkpoint:
            self.sft_point = sft_resume_point(self.out_dir)
        self.check_resume_point()
        sft_resuming = self.sft_point.finished is not None or self.sft_point.checkpoint is not None
        if resume and self.resume_from is None and not sft_resuming:
            self.out(f"no checkpoint under {self.ckpt_root}: starting from scratch")
        # Everything loaded and every checkpoint to resume from checked: now the run directory may change (old
        # files of --overwrite go, config.toml is written).
        if self.dist.is_main and self.plan is not None:
            self.plan.commit(cfg)
        self.dist.barrier()
        # With nothing to resume from the run starts over, and so does its metrics.jsonl.
        self.logger: MetricsLogger | _NoLogger = (
            MetricsLogger.from_config(cfg, resume=self.resume_from is not None or sft_resuming)
            if self.dist.is_main
            else _NoLogger()
        )
        if sft_resuming and isinstance(self.logger, MetricsLogger):
            # Keep the SFT records of the steps the resumed weights hold; the rest is logged again.
            keep = None if self.sft_point.finished is not None else self.sft_point.state.get("sft_step", 0)
            truncate_sft_log([self.logger.path, self.logger.samples_path], keep)
        self.eval_examples = self._eval_examples()
        self.ev_kw = dict(
            samples=cfg.task.eval_samples,
            temperature=cfg.task.eval_temperature,
            max_tokens=cfg.sampling.max_tokens,
            seed=cfg.run.seed,
            stop=cfg.sampling.stop,
            stop_token_ids=cfg.sampling.stop_token_ids,
            env=self.env,
        )
        self.summary: dict[str, Any] = {}
        self.totals = {
            "compared": 0,
            "mismatched": 0,
            "skipped_prompts": 0,
            "reward_errors": 0,
            "nan_steps": 0,
        }
        self.state = StepState()  # the step counter and what the step driver shares with the run
        self.consecutive_nan = 0
        self.stopped_early = False
        self.stopped_in_sft = False
        a = cfg.algorithm
        self.kl_ctl = KLController(a.kl_controller, a.kl_coef, target=a.kl_target, horizon=a.kl_horizon)
        self.stream: Any = None  # the task's training-example iterator, opened by run()
        self.flag: _StopFlag | None = None  # the signal flag, while run() runs
        # algorithm.max_off_policy_steps >= 1: the engine's weight copy (taken in build_trainer).
        self.behaviour: BehaviourPolicy | None = None
        self.driver: StepDriver | None = None  # made by build_trainer (`make_driver`)
        # algorithm.dynamic_sampling: groups without signal dropped, more prompts drawn (train/dynamic_sampling.py).
        self.dynamic: DynamicSampler | None = None
        if a.dynamic_sampling != "off":
            self.dynamic = DynamicSampler(
                a.dynamic_sampling,
                a.group_size,
                a.prompts_per_step,
                a.dynamic_sampling_max_rounds,
                self.dist,
                self.out,
            )

    @property
    def step(self) -> int:
        """Steps done (the next step's index)."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def step_model_tokens(self) -> int:
        """The last scored batch's sampled (model) tokens over every rank."""
        return self.state.model_tokens

    @step_model_tokens.setter
    def step_model_tokens(self, value: int) -> None:
        self.state.model_tokens = value

    @property
    def last_rollouts(self) -> Any:
        """The last step's StepRollouts."""
        return self.state.last_rollouts

    def check_resume_point(self) -> None:
        """Refuse, before the run directory changes, a resume whose checkpoint cannot load into this run:
        another model shape (a --allow-config-change of model.*), LoRA or critic that the checkpoint lacks or
        has, a truncated or corrupt file. The run's time so far comes from the checkpoint (RunClock)."""
        cfg = self.cfg
        if self.resume_from is not None:
            check_resumable(self.resume_from, self.model, critic=cfg.algorithm.needs_critic, lora=cfg.lora)
            sft_src = cfg.sft.checkpoint or (self.out_dir / "sft" if cfg.sft.steps > 0 else None)
            if cfg.algorithm.kl_coef > 0 and sft_src and not (Path(sft_src) / "config.json").is_file():
                raise ValueError(
                    f"cannot resume: the KL reference is the model after SFT, and {sft_src} holds none "
                    "(no config.json)"
                )
        elif self.sft_point.checkpoint is not None:
            self.sft_point.state = check_resumable(self.sft_point.checkpoint, self.model)
            self.clock.resume_from(self.sft_point.state.get("summary", {}))
        elif self.sft_point.finished is not None:
            self.clock.resume_from(self.sft_point.finished)

    def stop_requested(self) -> bool:
        """Whether a signal (Ctrl-C, SIGTERM) asked the run to stop, on any rank: a collective (every rank asks at
        the same point), so that every rank stops, and checkpoints, at the same step."""
        mine = self.flag is not None and self.flag.stop
        stop = self.dist.max(1.0 if mine else 0.0) > 0
        if stop:
            name = self.flag.signal_name if self.flag is not None and self.flag.signal_name else None
            self.summary["stopped_by"] = name or "a signal to another rank"
        return stop

    # -- setup stages ----------------------------------------------------------------------------------------
    def fits(self, ids: list[int]) -> bool:
        return self.prompt_filter.reason(ids) is None and self._room_for_a_turn(ids)

    def _room_for_a_turn(self, ids: list[int]) -> bool:
        """Multi-turn: an episode's prompt must leave room for at least one turn (always true otherwise)."""
        return not self.cfg.env.name or 0 < len(ids) < episode_token_limit(self.cfg)

    def _eval_examples(self) -> list[Example]:
        # Too-long held-out prompts are left out like too-long training prompts (the engine would reject them).
        all_eval = self.task.eval_examples(self.cfg.task.num_eval)
        kept = [ex for ex in all_eval if self.fits(self.encode(ex))]
        if len(kept) < len(all_eval):
            self.out(
                f"{len(all_eval) - len(kept)} held-out prompts are longer than task.max_prompt_tokens = "
                f"{self.cfg.task.max_prompt_tokens} tokens: left out of the evaluation"
            )
        return kept

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy, on rank 0 (the others have nothing to log; they wait at their next collective).
        Disaggregated: on trainer 0's generator, every trainer keeping its generator's rounds in step."""
        out: dict[str, float] = {}
        # A shared engine: the other ranks of rank 0's group join its one call (an empty share) at the round's end.
        shared = self.engine.round() if isinstance(self.engine, SharedEngine) else nullcontext()
        with self.weights.round(), shared:
            if self.dist.is_main:
                self.phases.size(self.engine)
                out = evaluate(
                    self.engine, self.tok, self.encode, self.eval_examples, self.rewards, **self.ev_kw
                )
        return out

    def warm_start(self) -> None:
        """SFT warm start and the held-out accuracy before RL (skipped on resume: the checkpoint holds the
        RL-trained weights, but the KL reference must still be the model RL started from)."""
        cfg, model = self.cfg, self.model
        sft_dir = self.out_dir / "sft"
        if self.resume_from is None:
            if cfg.sft.checkpoint:
                from exactrl.model.hf import load_model

                loaded = load_model(
                    cfg.sft.checkpoint, device=self.device, dtype=model.dtype, exact=self.exact
                )
                model.load_state_dict(loaded.state_dict())
            elif self.sft_point.finished is not None:
                # SFT finished in an earlier invocation that stopped before its first RL checkpoint.
                from exactrl.model.hf import load_model

                loaded = load_model(sft_dir, device=self.device, dtype=model.dtype, exact=self.exact)
                model.load_state_dict(loaded.state_dict())
                done = self.sft_point.finished
                # The run's time up to SFT's end, from the invocation that ran it (the summary splits SFT from RL).
                self.summary["sft_elapsed_s"] = float(done.get(self.clock.KEY, 0.0))
                if done.get("skipped_prompts"):
                    self.summary["sft_skipped_prompts_total"] = done["skipped_prompts"]
                self.out(
                    f"resume: SFT finished earlier ({done.get('steps_done')} steps): its weights from {sft_dir}"
                )
            elif cfg.sft.steps > 0:
                self.sft_warm_start(sft_dir)
                if self.stopped_in_sft:
                    return
            self.weights.push(list(model.named_parameters()))  # disaggregated: the generators' first weights
            before = self.evaluate()
            self.summary["accuracy_before_rl"] = before.get("eval/accuracy")
            self.logger.log({"step": 0, **before, "phase": "before_rl"})
            acc = before.get("eval/accuracy")
            unjudged = not cfg.env.name and self.rewards is not None and self.rewards.accuracy_fn is None
            acc_s = (
                f"{acc:.3f}" if acc is not None else "n/a (no correctness function)" if unjudged else "n/a"
            )
            self.out(f"held-out accuracy before RL: {acc_s} on {len(self.eval_examples)} examples")
        elif cfg.algorithm.kl_coef > 0 and (cfg.sft.checkpoint or cfg.sft.steps > 0):
            # Resuming: put the post-SFT weights in place before the reference copy is taken in build_trainer;
            # the checkpoint then overwrites the policy's weights.
            from exactrl.model.hf import load_model

            loaded = load_model(
                cfg.sft.checkpoint or sft_dir, device=self.device, dtype=model.dtype, exact=self.exact
            )
            model.load_state_dict(loaded.state_dict())

    def sft_warm_start(self, sft_dir: Path) -> None:
        """Run SFT (from its last checkpoint when resuming), checkpointing every sft.save_every steps and at a
        stop; write sft/ (the weights and how far SFT got). A finished SFT's checkpoints are removed."""
        cfg, model = self.cfg, self.model
        ck = SFTCheckpointing(
            root=self.out_dir / SFT_CHECKPOINTS,
            tokenizer=self.tok,
            every=cfg.sft.save_every,
            keep=cfg.train.keep_checkpoints,
            resume_from=self.sft_point.checkpoint,
            write=self.dist.is_main,
            barrier=self.dist.barrier,
            extra_state=lambda: {self.clock.KEY: self.clock.total_s()},
        )
        if ck.resume_from is None:
            self.out(f"SFT warm start: {cfg.sft.steps} steps of {cfg.sft.batch_size} examples")
        sft = run_sft(
            cfg,
            model,
            self.tok,
            self.encode,
            self.task,
            lambda r: self.logger.log({"step": 0, **r}),
            should_stop=self.stop_requested,
            out=self.out,
            demonstrate=self.demonstrations(),
            checkpoints=ck,
        )
        self.out(f"SFT done: loss {sft.last.get('sft/loss', float('nan')):.4f}")
        # The run's time so far (earlier invocations of a resumed SFT included) is SFT's: RL's minutes start here.
        sft_s = self.clock.total_s()
        self.summary["sft_elapsed_s"] = sft_s  # ends in _s: the tools that compare runs skip timings
        skipped = sft.filter.skipped if sft.filter is not None else 0
        if skipped:
            self.summary["sft_skipped_prompts_total"] = skipped
        if self.dist.is_main:
            extra = {"skipped_prompts": skipped, self.clock.KEY: sft_s}
            write_sft_model(
                model, self.tok, sft_dir, steps_done=sft.steps_done, steps=cfg.sft.steps, extra=extra
            )
            if not sft.stopped:  # sft/ holds the finished SFT: its resume points are of no more use
                shutil.rmtree(ck.root, ignore_errors=True)
        self.dist.barrier()
        if sft.stopped:
            self.stopped_in_sft = True
            self.summary["sft_steps_done"] = sft.steps_done
            self.out(
                f"stopped during SFT after step {sft.steps_done} of {cfg.sft.steps}: `--resume` continues SFT from "
                f"{sft.checkpoint}; the weights so far are also in {sft_dir}"
            )

    def demonstrations(self) -> Any:
        """Multi-turn: the environment's worked episodes for the SFT warm start (tool calls and their results,
        the results masked out of the loss), or None: single-turn, or an environment without `demonstration`,
        whose warm start learns the examples' answers (said in the log)."""
        if self.env is None:
            return None
        env = self.env.make()
        probe = self.task.eval_examples(1) or [next(copy.deepcopy(self.task).train_examples(seed=0))]
        if env.demonstration(probe[0]) is None:
            self.out(
                f"SFT: the environment {self.cfg.env.name!r} has no demonstration(): the warm start learns the "
                "examples' answers as single completions"
            )
            return None
        return env.demonstration

    def build_trainer(self) -> None:
        """The reference model (KL), the critic (PPO), the layout over the ranks, the optimizers and the
        policy trainer."""
        cfg, model = self.cfg, self.model
        a, tr = cfg.algorithm, cfg.train
        self.critic = self.critic_opt = None
        if a.needs_critic:  # before LoRA: the critic is a full fine-tune of the policy's copy
            self.critic = ValueModel.from_policy(model, init_from_policy=True, seed=cfg.run.seed)
        if cfg.lora.rank > 0:
            # After the warm start (which fine-tunes every weight): adapters on the frozen base, the only
            # trainable parameters; the engine samples through them with the same ops (unmerged). Under
            # torchrun they are attached before the engine replica is taken and the model sharded: FSDP2 shards
            # the frozen base with the adapters, and the weight sync moves the adapters alone.
            from exactrl.model.lora import apply_lora_config

            apply_lora_config(model, cfg.lora, seed=cfg.run.seed)
        ref_model = None
        if a.kl_coef > 0:
            from exactrl.model.lora import ReferenceView, has_lora

            # With LoRA the reference is the base with the adapters off: no second copy of the weights.
            ref_model = (
                ReferenceView(model) if has_lora(model) else copy.deepcopy(model).requires_grad_(False)
            )
        # The layout: on one device the engine samples from the policy itself; under torchrun from a replica
        # taken now (after the warm start), and the trainer's models are sharded.
        engine_model = self.parallel.engine_model(model)
        if self.engine_group is not None:  # each rank of a group keeps its slice of the replica
            e = cfg.engine
            engine_model = split_engine_model(
                engine_model, self.engine_group, e.tensor_parallel, e.expert_parallel
            )
        if a.max_off_policy_steps > 0:  # the engine samples from its own copy while the trainer updates
            # Under torchrun the engine replica is that copy (its version: the last weight sync).
            self.behaviour = (
                ReplicaBehaviour(engine_model, self.parallel)
                if self.parallel.sharded
                else BehaviourPolicy(model, version=0)
            )
            engine_model = self.behaviour.model
        if (
            tr.activation_checkpointing
        ):  # the trainer's models only: the engine and the reference run no backward
            from exactrl.distributed.parallelize import apply_activation_checkpointing

            apply_activation_checkpointing(model)
            if self.critic is not None:
                apply_activation_checkpointing(self.critic)
        self.parallel.parallelize(model)
        if ref_model is not None and isinstance(ref_model, torch.nn.Module):
            self.parallel.parallelize(ref_model, trainable=False)
        if self.critic is not None:
            self.parallel.parallelize(self.critic)
        self.parallel.bind(model, engine_model)
        if self.remote is not None:  # disaggregated: the replica is what the generators get, byte for byte
            self.remote.model = engine_model
            if (
                cfg.lora.rank > 0
            ):  # as the colocated replica's engine is built here, after the evaluation before RL
                self.weights.attach_lora()
        elif engine_model is not model:
            # The evaluation engine on the trainer's model goes first: its decode graphs and KV cache with it
            # (the runner and its graph state form a cycle, which dropping the engine would leave to the collector).
            old = self.engine.runner
            if old is not None:
                old.release_graphs()
                old.release_kv()
            self.engine = RolloutEngine(engine_model, EngineConfig(**asdict(cfg.engine)), tokenizer=self.tok)
            if self.engine_group is not None:
                self.engine = SharedEngine(self.engine, self.engine_group, env=self.env)
        opt_kw = dict(betas=tuple(tr.betas), weight_decay=tr.weight_decay, dist=self.dist, offload=tr.offload)
        if self.critic is not None:
            self.critic_opt = MasterAdamW(self.critic, lr=tr.critic_lr, **opt_kw)
        self.opt = MasterAdamW(model, lr=tr.lr, **opt_kw)
        settings = trainer_settings(cfg, self.microbatch_tokens)
        if a.rollout_correction and self.exact:
            import warnings

            warnings.warn(
                "algorithm.rollout_correction is set in exact mode, where rollout and trainer logprobs are "
                "bitwise equal: the correction is a no-op",
                stacklevel=1,
            )
        self.trainer = PolicyTrainer(
            model,
            settings,
            self.opt,
            ref_model=ref_model,
            critic=self.critic,
            critic_optimizer=self.critic_opt,
            dist=self.dist,
        )
        self.optimizers = {"policy": self.opt} | (
            {"critic": self.critic_opt} if self.critic_opt is not None else {}
        )
        self.driver = self.make_driver()

    def make_driver(self) -> StepDriver:
        """The step driver `check_run_config` chose, over this run's stages (`exactrl bench rl` makes it again
        after it swapped the engine, the prompts and timed stages)."""
        if self.driver is not None:
            self.driver.close()
        stages = Stages(
            set_lr=self.set_lr,
            prompts=self.prompts,
            sampling_params=self.sampling_params,
            rollout=self.rollout,
            score=self.score,
            rank_scores=self.rank_scores,
            step_scores=self.step_scores,
            dynamic_scores=self.dynamic_scores,
            episodes=self.episodes,
            rank_episodes=self.rank_episodes,
            greedy_baseline=self.greedy_baseline,
            greedy_rewards=self.greedy_rewards,
            gather_baseline=self.gather_baseline,
            with_advantages=self.with_advantages,
            update=self.update,
            step_metrics=self.step_metrics,
            mismatch_report=self.mismatch_report,
            mismatch_abort=self.mismatch_abort,
            abort_notice=self.abort_notice,
        )
        ctx = StepContext(
            cfg=self.cfg,
            state=self.state,
            stages=stages,
            dist=self.dist,
            device=self.device,
            engine=self.engine,
            phases=self.phases,
            weights=self.weights,
            trainer=self.trainer,
            kl_ctl=self.kl_ctl,
            out=self.out,
        )
        if self.driver_name == "tail":
            return TailDriver(ctx)
        if self.driver_name in ("one_step_off", "partial"):
            assert self.behaviour is not None
            cls = PartialDriver if self.driver_name == "partial" else OneStepOffDriver
            return cls(ctx, self.behaviour, StepRollouts)
        return SyncDriver(ctx)

    def restore(self) -> None:
        """Load the latest checkpoint on --resume: weights, optimizers, data position, totals."""
        if self.resume_from is None:
            return
        if self.parallel.sharded or is_sharded_checkpoint(self.resume_from):
            # A checkpoint of a torchrun run, at any world size (DCP reshards), or this run is one.
            state = load_sharded_checkpoint(
                self.resume_from,
                model=self.model,
                optimizers=self.optimizers,
                critic=self.critic,
                process_group=self.dist.group,
            )
            self.parallel.sync_weights(full=True)  # every weight: the replica was taken before the load
            self.weights.to_generators(full=True)
        else:
            state = load_checkpoint(
                self.resume_from, model=self.model, optimizers=self.optimizers, critic=self.critic
            )
            from exactrl.model.lora import has_lora, load_adapter

            if has_lora(self.model):  # in place: the optimizer's and the graphs' tensors stay
                load_adapter(self.model, self.resume_from / "adapter")
        self.step = state["step"]
        self.task.load_state_dict(state["task"])
        self.totals.update(state.get("totals", {}))
        self.summary.update(state.get("summary", {}))
        self.clock.resume_from(self.summary)
        if "kl_controller" in state:
            self.kl_ctl.load_state_dict(state["kl_controller"])
        self.trainer.steps_done = self.step
        self.logger.truncate_after(self.step)
        self.out(f"resumed from {self.resume_from} at step {self.step}")
        off_policy = self.driver_name in ("one_step_off", "partial")
        for note in dropped_on_resume(
            self.resume_from, off_policy=off_policy, partial=self.driver_name == "partial"
        ):
            self.out(note)
        self.driver.restore(self.resume_from)

    # -- the step's stages (a step driver calls them through its StepContext: exactrl/train/drivers/) --------
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
        cfg = self.cfg
        count = cfg.algorithm.prompts_per_step if count is None else count
        # Two passes over a finite training set with no prompt that fits means none ever will.
        max_skips_in_a_row = 2 * getattr(self.task, "num_train", 5_000) + 1
        examples, prompt_ids = [], []
        skipped_in_a_row = 0
        while len(examples) < count:
            ex = next(self.stream)
            ids = self.encode(ex)
            if not self.prompt_filter.admit(ex, ids) or not self._room_for_a_turn(ids):
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

        rs, metrics = self.dynamic.collect(step, (examples, prompt_ids, index), self.prompts, sample)
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
        sr.advantage_metrics.update(rs.metrics)
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
        sr.advantage_metrics.update(rs.metrics)  # turns, tool calls, environment errors and timeouts
        return sr

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
        from exactrl.guard.report import MismatchSequence, write_mismatch_report

        seqs = [
            MismatchSequence(
                request_id=rollouts[i].request_id,
                sample_index=rollouts[i].sample_index,
                prompt_ids=rollouts[i].prompt_ids,
                completion_ids=rollouts[i].completion_ids,
                rollout_logprobs=r_lp,
                trainer_logprobs=t_lp,
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
        self.trainer.s.kl_coef = self.kl_ctl.value
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

    def checkpoint(self) -> None:
        self.clock.stamp(self.summary)  # the run's time so far travels with the checkpoint
        state = {
            "task": self.task.state_dict(),
            "totals": self.totals,
            "summary": self.summary,
            "kl_controller": self.kl_ctl.state_dict(),
        }
        from exactrl.model.lora import has_lora, save_adapter

        # With LoRA policy/ is the frozen base, the same bytes at every step: after this process has written it
        # once, later checkpoints hard-link those files (`write_policy`) instead of writing the base again.
        lora = has_lora(self.model)
        frozen = self._frozen_policy if lora else None
        # LoRA: the adapters in PEFT's format next to the (frozen) base weights, from the engine's model (the
        # policy itself on one device, the gathered replica under torchrun).
        extra = (lambda d: save_adapter(self.engine.model, d / "adapter")) if lora else None
        # The driver's state between steps (off-policy: the batch sampled ahead, the partial rollouts in flight):
        # in the checkpoint's directory, or each rank's share of a sharded one.
        driver_extra, rank_extra = self.driver.checkpoint_writers()
        if driver_extra is not None:
            lora_extra = extra

            def extra(d: Path) -> None:
                if lora_extra is not None:
                    lora_extra(d)
                driver_extra(d)

        common = dict(
            tokenizer=self.tok,
            optimizers=self.optimizers,
            critic=self.critic,
            keep=self.cfg.train.keep_checkpoints,
            state=state,
            write_extra=extra,
            frozen_policy_from=frozen,
        )
        if self.parallel.sharded:
            path = save_sharded_checkpoint(
                self.dist,
                self.ckpt_root,
                self.step,
                model=self.model,
                engine_model=self.whole_engine_model(),
                write_rank_extra=rank_extra,
                **common,
            )
        else:
            path = save_checkpoint(self.ckpt_root, self.step, model=self.model, **common)
        self._frozen_policy = path / "policy" if lora else None

    # -- the run ---------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg, tr = self.cfg, self.cfg.train
        # One flag from the warm start to the last step: a signal anywhere stops at the next safe point.
        with _StopFlag() as self.flag:
            self.warm_start()
            if self.stopped_in_sft:
                return self.finish()
            self.build_trainer()
            self.restore()
            self.stream = self.task.train_examples(seed=cfg.run.seed)
            # A signal before this invocation's first RL step (during the warm start's evaluation, the trainer's
            # build): the run so far is checkpointed now (a restored checkpoint is that already).
            stop = self.step < tr.steps and self.stop_requested()
            if stop and self.resume_from is None:
                self.checkpoint()
            while self.step < tr.steps and not stop:
                m = self.driver.step()
                self.log_step(m)
                # Under torchrun every rank must stop (and checkpoint, a collective) at the same step.
                stop = self.stop_requested()
                at_end = self.step == tr.steps and tr.save_at_end
                if (tr.save_every and self.step % tr.save_every == 0) or at_end or stop:
                    self.checkpoint()
            if stop:
                self.stopped_early = self.step < tr.steps
                self.out(f"stopped at step {self.step}; resume with --resume")
        return self.finish()

    def log_step(self, m: dict[str, float]) -> None:
        """Count a skipped (non-finite) update, evaluate when due, log and print; stop after too many skips."""
        cfg = self.cfg
        step = self.step
        nan_skipped = m.get("nan_skipped", 0) > 0
        if nan_skipped:
            self.consecutive_nan += 1
            self.totals["nan_steps"] += 1
            self.out(
                f"step {step}: non-finite loss or gradient, update skipped ({self.consecutive_nan} in a row)"
            )
        else:
            self.consecutive_nan = 0
        if cfg.task.eval_every and step % cfg.task.eval_every == 0 and step < cfg.train.steps:
            m.update(self.evaluate())
        self.logger.log(m)
        every = cfg.run.log_samples_every
        if every and step % every == 0 and self.dist.is_main:
            sr, k = self.last_rollouts, cfg.run.log_samples_count
            self.logger.log_samples(
                step,
                [self.tok.decode(ro.prompt_ids) for ro in sr.rollouts[:k]],
                sr.completions[:k],
                [ro.reward for ro in sr.rollouts[:k]],
                sr.answers[:k],
            )
        if step % cfg.run.log_every == 0:
            self.out(step_line(m))
        tr = cfg.train
        if tr.max_nan_steps and self.consecutive_nan >= tr.max_nan_steps:
            raise RuntimeError(
                f"{self.consecutive_nan} consecutive steps had a non-finite loss or gradient; stopping "
                f"(train.max_nan_steps = {tr.max_nan_steps}). Lower train.lr or check the rewards."
            )

    def close(self) -> None:
        """Stop the reward workers (user reward functions run in processes of their own) and drop the engine's
        decode graphs."""
        if self.driver is not None:  # a generation still running under a failed update
            self.driver.close()
        self.weights.stop()  # disaggregated: the generator's loop ends (it would wait for the next round)
        if self.rewards is not None:
            self.rewards.close()
        runner = getattr(self.engine, "runner", None)
        if runner is not None:  # before the process group goes (`ModelRunner.release_graphs`)
            runner.release_graphs()

    def finish(self) -> dict[str, Any]:
        """The held-out accuracy after RL, summary.json, report.png and the summary lines."""
        after = self.evaluate() if not self.stopped_in_sft else {}
        self.logger.log({"step": self.step, **after, "phase": "after_rl"})
        self.logger.close()
        t = self.totals
        total_s = self.clock.total_s()
        self.summary.update(
            {
                "accuracy_after_rl": after.get("eval/accuracy"),
                "rl_steps": self.step,
                "minutes": total_s / 60.0,
                # After SFT (and the model's loading before it): RL steps, evaluations, checkpoints.
                "rl_elapsed_s": total_s - self.summary.get("sft_elapsed_s", 0.0),
                "mismatched_tokens_total": t["mismatched"],
                "compared_tokens_total": t["compared"],
                "skipped_prompts_total": t["skipped_prompts"],
                "reward_errors_total": t["reward_errors"],
                "nan_steps_total": t["nan_steps"],
                "mismatch_skipped_steps_total": t.get("mismatch_skipped_steps", 0),
                "exact": self.exact,
                "algorithm": self.cfg.algorithm.name,
                "advantage": self.cfg.algorithm.resolved_advantage,
                "policy_loss": self.cfg.algorithm.resolved_policy_loss,
                "stopped_early": self.stopped_early or self.stopped_in_sft,
                "skipped_records_total": getattr(self.task, "num_skipped", 0),
            }
        )
        if not self.summary["stopped_early"]:  # a resumed run that reached its end: the old stop is history
            self.summary.pop("stopped_by", None)
        if self.rewards is not None:
            self.summary["accuracy_function"] = (
                "environment" if self.cfg.env.name else self.rewards.accuracy_fn
            )
            failure = self.rewards.run_failure()
            if failure is not None:
                # Trained on zero rewards, or without the reward that says what is right, with an accuracy that
                # counts nothing: the run must not look like a success (exit status 3).
                self.summary["all_reward_calls_failed"] = self.rewards.all_calls_failed()
                self.summary["accuracy_function_failed"] = self.rewards.accuracy_failure() is not None
                self.summary["reward_failure"] = failure
        self.clock.stamp(self.summary)
        s = self.summary
        if s.get("accuracy_before_rl") is not None and s.get("accuracy_after_rl") is not None:
            s["accuracy_gain"] = s["accuracy_after_rl"] - s["accuracy_before_rl"]
        s["world_size"] = self.dist.world_size
        if self.dist.is_main:
            with writing(self.out_dir / "summary.json", "the run summary"):
                (self.out_dir / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
            try:
                from exactrl.report import draw_report

                draw_report(self.out_dir)
            except ImportError as err:  # matplotlib missing: the numbers are in metrics.jsonl anyway
                self.out(f"report.png not drawn ({err})")
        self.out(_summary_text(s, self.out_dir))
        self.dist.barrier()
        return s


class _NoLogger:
    """The logger of ranks other than 0: they compute the same global metrics and write nothing."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def trainer_settings(cfg: RunConfig, microbatch_tokens: int | None = None) -> TrainerSettings:
    """The trainer's view of the [algorithm], [train] and [sampling] sections; `microbatch_tokens` (the run's
    budget under FSDP2, exactrl.train.memory.microbatch_tokens) replaces train.max_tokens_per_microbatch."""
    a, tr = cfg.algorithm, cfg.train
    return TrainerSettings(
        algorithm=a.name,
        advantage=a.resolved_advantage,
        policy_loss=a.resolved_policy_loss,
        whiten_advantages=a.resolved_whiten_advantages,
        loss_options={k: v for k, v in a.policy_loss_kwargs().items() if k != "kind"},
        temperature=cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0,
        eps_low=a.eps_low,
        eps_high=a.eps_high,
        dual_clip=a.dual_clip,
        aggregation=a.aggregation,
        ppo_epochs=a.ppo_epochs,
        minibatches=a.minibatches_per_rollout,
        kl_coef=a.kl_coef,
        kl_kind=a.kl_kind,
        kl_in_reward=a.kl_in_reward,
        entropy_coef=a.entropy_coef,
        gamma=a.gamma,
        lam=a.lam,
        value_clip=a.value_clip,
        vf_coef=a.vf_coef,
        rollout_correction=a.rollout_correction,
        rollout_correction_threshold=a.rollout_correction_threshold,
        max_tokens_per_microbatch=microbatch_tokens or tr.max_tokens_per_microbatch,
        reduce_every_microbatch=tr.fsdp_reduce == "microbatch",
        cuda_graphs=tr.cuda_graphs,
        grad_clip=tr.grad_clip,
        moe_aux_loss_coef=tr.moe_aux_loss_coef,
        moe_z_loss_coef=tr.moe_z_loss_coef,
        overlong_filter=a.overlong_filter,
        exact=cfg.run.exact,
        on_mismatch=cfg.run.on_mismatch,
        norm_constant=float(cfg.sampling.max_tokens),
        seed=cfg.run.seed,
    )


def _summary_text(s: dict[str, Any], out_dir: Path) -> str:
    def pct(x):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"

    return (
        f"\n== {s['algorithm']} ({'exact' if s['exact'] else 'fast'} mode): {s['rl_steps']} RL steps in "
        f"{s['rl_elapsed_s'] / 60 if 'rl_elapsed_s' in s else s['minutes']:.1f} min"
        + (f" after {s['sft_elapsed_s'] / 60:.1f} min of SFT" if "sft_elapsed_s" in s else "")
        + "\n"
        f"   held-out accuracy {pct(s.get('accuracy_before_rl'))} -> {pct(s.get('accuracy_after_rl'))}"
        f"{_accuracy_source(s)}\n"
        f"   rollout vs trainer logprobs: {s['mismatched_tokens_total']} of {s['compared_tokens_total']} tokens differ\n"
        f"   outputs in {out_dir}/ (metrics.jsonl, report.png, checkpoints/, summary.json)"
        + (
            f"\n   !! {s['reward_failure']}. "
            + (
                "The policy was trained on zero rewards"
                if s.get("all_reward_calls_failed")
                else "The policy never got its correctness reward and accuracy counts nothing"
            )
            + ": exit status 3"
            if s.get("reward_failure")
            else ""
        )
    )


def _accuracy_source(s: dict[str, Any]) -> str:
    """What the accuracy counts, for the summary line (reward.accuracy)."""
    fn = s.get("accuracy_function")
    if "accuracy_function" not in s:  # a summary from before accuracy_function was recorded
        return ""
    if fn is None:
        return " (no correctness function: see reward.accuracy)"
    if fn == "environment":
        return " (episode reward > 0.5)"
    return f" ({fn} > 0.5)"
