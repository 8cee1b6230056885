"""`exactrl train`: `RLRun` builds the run (model, engine, task, rewards, trainer, step driver); `run()` calls
`driver.step()` once per step, logs and checkpoints. One RL step is the driver's `step()`: by default
`SyncDriver.step` (exactrl/train/drivers/sync.py), prompts -> rollout -> score (rewards, advantages) -> update ->
the engine's weights, each a stage of `RunStages` (exactrl/train/stages.py). On one device the engine and the
trainer hold the *same* model object: the next `generate` samples from the new weights with no file round trip.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch

from exactrl.algorithms import KLController
from exactrl.config import RunConfig
from exactrl.distributed.env import rank_device
from exactrl.distributed.parallelize import Parallelism
from exactrl.distributed.shared_engine import (
    SharedEngine,
    engine_group,
    split_engine_model,
)
from exactrl.distributed.shared_fs import (
    agree,
    agreed_checkpoint,
    check_shared_run_dir,
)
from exactrl.distributed.tensor_parallel import TensorParallelGroup
from exactrl.envs.rollout import EnvSetup
from exactrl.model.loading import load_policy, resolve_device
from exactrl.model.moe import has_experts
from exactrl.model.qwen import CausalLM
from exactrl.ops import set_exact_environment
from exactrl.tasks import Example, RewardComputer
from exactrl.tasks.prompts import PromptFilter
from exactrl.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from exactrl.train.critic import ValueModel
from exactrl.train.disagg import RemoteEngine, serve_generator
from exactrl.train.drivers.base import StepContext, StepDriver, Writer
from exactrl.train.drivers.build import build_driver
from exactrl.train.drivers.disagg import WeightSync
from exactrl.train.drivers.modes import DriverName
from exactrl.train.dynamic_sampling import DynamicSampler
from exactrl.train.finish import Finish
from exactrl.train.hooks import RunHooks
from exactrl.train.logging import MetricsLogger, NoLogger, import_wandb, step_line
from exactrl.train.memory import microbatch_tokens
from exactrl.train.memory_fit import check_before_loading
from exactrl.train.offpolicy import BehaviourPolicy
from exactrl.train.offpolicy_dist import ReplicaBehaviour
from exactrl.train.optim import MasterAdamW
from exactrl.train.parts import build_task, env_setup, evaluate, make_encoder
from exactrl.train.phases import MemoryPhases
from exactrl.train.preflight import dropped_on_resume
from exactrl.train.resolved import ResolvedRun, resolve_run
from exactrl.train.resolved import trainer_settings as trainer_settings  # importable from here as before
from exactrl.train.rundir import RunClock, RunDirPlan, check_run_dir
from exactrl.train.sft import (
    SFTResumePoint,
    sft_resume_point,
    truncate_sft_log,
)
from exactrl.train.sharded_checkpoint import (
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from exactrl.train.signals import StopFlag as _StopFlag
from exactrl.train.stages import RunStages, StepState, room_for_a_turn
from exactrl.train.stages import StepRollouts as StepRollouts  # importable from here as before
from exactrl.train.trainer import PolicyTrainer
from exactrl.train.warm_start import WarmStart


def train(
    run: ResolvedRun | RunConfig,
    resume: bool = False,
    out=print,
    *,
    overwrite: bool = False,
    allow_config_change: bool = False,
    run_dir: RunDirPlan | None = None,
) -> dict[str, Any]:
    """Run the whole job described by `run` (a config, or one resolved already); returns the summary written to
    summary.json.

    Nothing is written to cfg.run.output_dir before the model, data and rewards have loaded; a non-empty dir
    needs resume or overwrite (`rundir.check_run_dir`; `run_dir` is a plan the caller already checked).
    Relative paths (data, models, reward files, environment modules) are resolved from the working directory
    (`exactrl.config.check_path_anchors`).

    Under torchrun with distributed.generator_ranks = G > 0 the last G ranks only generate (`serve_generator`)
    and the others run this loop as the colocated run at their own world size would (exactrl/train/disagg.py)."""
    # Validated once, on every rank, before anything loads (a ResolvedRun: by the caller, `exactrl train`).
    resolved = run if isinstance(run, ResolvedRun) else resolve_run(run)
    cfg, layout = resolved.cfg, resolved.layout
    if layout.role == "generator":  # multi-turn: the episodes run here, against this rank's environment
        return serve_generator(cfg, layout, env=env_setup(cfg) if cfg.env.name else None)
    # Every trainer rank sees rank 0's run directory, or every one refuses (a run's own checkpoints need it; `bench
    # rl` builds an RLRun in a private folder per rank and writes none).
    check_shared_run_dir(layout.local, Path(cfg.run.output_dir))
    rl = RLRun(
        resolved,
        resume=resume,
        out=out,
        overwrite=overwrite,
        allow_config_change=allow_config_change,
        run_dir=run_dir,
    )
    try:
        return rl.run()
    finally:
        rl.close()


class RLRun(WarmStart, Finish):
    """One `exactrl train` job, built from its `ResolvedRun` (exactrl/train/resolved.py):

    setup (here) -> warm_start (SFT, the held-out baseline: warm_start.py) -> build_trainer (and the step driver)
    -> restore (on --resume) -> per step: `driver.step()` (the `RunStages` of stages.py: prompts -> rollout ->
    score (rewards, advantages) -> update, in the driver's order: exactrl/train/drivers/) -> log -> checkpoint ->
    finish (finish.py)."""

    def __init__(
        self,
        run: ResolvedRun | RunConfig,
        resume: bool = False,
        out=print,
        *,
        overwrite: bool = False,
        allow_config_change: bool = False,
        run_dir: RunDirPlan | None = None,
        hooks: RunHooks | None = None,
    ) -> None:
        self.clock = RunClock()
        # A caller's engine, prompts and stage wrapper in place of the run's own (`exactrl bench rl`'s): hooks.py.
        self.hooks = hooks or RunHooks()
        # The run resolved once (exactrl/train/resolved.py): a bare config is resolved here, as `train` does.
        resolved = run if isinstance(run, ResolvedRun) else resolve_run(run)
        self.resolved = resolved
        cfg, layout = resolved.cfg, resolved.layout
        # Under torchrun: this rank's place in the run (world size 1 without it); rank 0 alone prints and writes.
        # A disaggregated run's trainer: its place among the trainers (the generators are not in its collectives).
        if layout.role == "generator":
            raise ValueError("RLRun runs on trainer ranks; a generator rank runs serve_generator")
        self.layout = layout
        self.dist = layout.local
        self.parallel = Parallelism(self.dist, fp8_copies=cfg.train.fsdp_fp8_copies)
        # The step driver that runs this config, chosen once (with what `exactrl plan` refuses too).
        self.driver_name: DriverName = resolved.driver
        self.cfg, self.resume = cfg, resume
        # engine.tensor_parallel / expert_parallel: the ranks of each group share one engine split over them
        # (exactrl/distributed/shared_engine.py); None: every rank its own.
        self.engine_group: TensorParallelGroup | None = None
        e = cfg.engine
        # (A disaggregated run's engine is the generators': split over their groups, `split_layout`.)
        if resolved.engine_group_ranks > 1 and not layout.disaggregated:
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
        self.phases = MemoryPhases(resolved.releases_memory, self.parallel, kv_blocks)
        self.exact = cfg.run.exact
        set_exact_environment(self.exact)
        torch.manual_seed(cfg.run.seed)
        if self.exact:
            # Deterministic backward kernels (e.g. the embedding gradient without atomics): same seed, same run.
            # Not torch's filling of every new tensor with NaN under that mode: exactrl's kernels write all of
            # each output, and the fill would be an extra full write of every activation in every step.
            torch.use_deterministic_algorithms(True, warn_only=True)
            # (A module attribute torch sets at runtime; its stubs do not declare it.)
            torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]

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
            self.remote = RemoteEngine(layout, replace(cfg.engine))
            self.engine: Any = self.remote
        else:
            self.engine = self.hooks.make_engine(self.model, cfg.engine, self.tok)
        self.weights = WeightSync(self.parallel, self.remote)
        self.ckpt_root = self.out_dir / "checkpoints"
        self._frozen_policy: Path | None = None  # this process's last policy/ of a frozen base (LoRA)
        # Rank 0 chooses the checkpoint; every rank checks it sees it whole (exactrl/distributed/shared_fs.py).
        self.resume_from = (
            agreed_checkpoint(self.dist, lambda: latest_checkpoint(self.ckpt_root)) if resume else None
        )
        # Without an RL checkpoint, SFT's own resume point: an unfinished SFT continues from its last checkpoint,
        # a finished one is not run again (its weights are sft/).
        self.sft_point = SFTResumePoint()
        if resume and self.resume_from is None and cfg.sft.steps > 0 and not cfg.sft.checkpoint:
            self.sft_point = agree(self.dist, lambda: sft_resume_point(self.out_dir))
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
        self.logger: MetricsLogger | NoLogger = (
            MetricsLogger.from_config(cfg, resume=self.resume_from is not None or sft_resuming)
            if self.dist.is_main
            else NoLogger()
        )
        if sft_resuming and isinstance(self.logger, MetricsLogger):
            # Keep the SFT records of the steps the resumed weights hold; the rest is logged again.
            keep = None if self.sft_point.finished is not None else self.sft_point.state.get("sft_step", 0)
            truncate_sft_log([self.logger.path, self.logger.samples_path], keep)
        self.eval_examples = self._eval_examples()
        self.ev_kw: dict[str, Any] = dict(
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
        # The step's work, over the parts loaded above (the trainer joins in build_trainer): exactrl/train/stages.py.
        self.stages = RunStages(
            cfg=cfg,
            state=self.state,
            dist=self.dist,
            parallel=self.parallel,
            out=self.out,
            out_dir=self.out_dir,
            tok=self.tok,
            engine=self.engine,
            engine_group=self.engine_group,
            env=self.env,
            task=self.task,
            encode=self.encode,
            prompt_filter=self.prompt_filter,
            rewards=self.rewards,
            dynamic=self.dynamic,
            kl_ctl=self.kl_ctl,
            totals=self.totals,
            logger=self.logger,
            prompt_source=self.hooks.prompts,
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
        return self.prompt_filter.reason(ids) is None and room_for_a_turn(self.cfg, ids)

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
        assert self.rewards is not None  # loaded in __init__ (None only until then, for `close`)
        with self.weights.round(), shared:
            if self.dist.is_main:
                self.phases.size(self.engine)
                out = evaluate(
                    self.engine, self.tok, self.encode, self.eval_examples, self.rewards, **self.ev_kw
                )
        return out

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
        ref_model: CausalLM | None = None
        if a.kl_coef > 0:
            from exactrl.model.lora import ReferenceView, has_lora

            # With LoRA the reference is the base with the adapters off: no second copy of the weights. The view
            # answers the calls the trainer makes of a reference model (call, logprobs, device), hence the cast.
            ref_model = (
                cast(CausalLM, ReferenceView(model))
                if has_lora(model)
                else copy.deepcopy(model).requires_grad_(False)
            )
        # The layout: on one device the engine samples from the policy itself; under torchrun from a replica
        # taken now (after the warm start), and the trainer's models are sharded.
        engine_model = self.parallel.engine_model(model)
        if self.engine_group is not None:  # each rank of a group keeps its slice of the replica
            e = cfg.engine
            engine_model = split_engine_model(
                engine_model, self.engine_group, e.tensor_parallel, e.expert_parallel
            )
        if self.resolved.off_policy:  # the engine samples from its own copy while the trainer updates
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
            self.engine = self.hooks.make_engine(engine_model, cfg.engine, self.tok)
            if self.engine_group is not None:
                self.engine = SharedEngine(self.engine, self.engine_group, env=self.env)
        opt_kw = dict(betas=tuple(tr.betas), weight_decay=tr.weight_decay, dist=self.dist, offload=tr.offload)
        if self.critic is not None:
            self.critic_opt = MasterAdamW(self.critic, lr=tr.critic_lr, **opt_kw)
        self.opt = MasterAdamW(model, lr=tr.lr, **opt_kw)
        settings = self.resolved.trainer_settings(self.microbatch_tokens)
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
        self.stages.trainer, self.stages.opt, self.stages.critic_opt = self.trainer, self.opt, self.critic_opt
        # The step samples from the engine on the weight copy, if one was made.
        self.stages.engine = self.engine
        self.driver = self.make_driver()
        owners = {"stages": self.stages, "parallel": self.parallel, "remote": self.remote}
        self.hooks.wrap(owners | {"pool": getattr(self.driver, "pool", None)})

    def make_driver(self) -> StepDriver:
        """The step driver the run resolved to (`ResolvedRun.driver`), over this run's stages."""
        ctx = StepContext(
            cfg=self.cfg,
            state=self.state,
            stages=self.stages,
            dist=self.dist,
            device=self.device,
            engine=self.engine,
            phases=self.phases,
            weights=self.weights,
            trainer=self.trainer,
            kl_ctl=self.kl_ctl,
            out=self.out,
        )
        return build_driver(self.driver_name, ctx, self.behaviour)

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
        for note in dropped_on_resume(
            self.resume_from, off_policy=self.resolved.off_policy, partial=self.driver_name == "partial"
        ):
            self.out(note)
        assert self.driver is not None  # build_trainer made it
        self.driver.restore(self.resume_from)

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
        extra: Writer | None = (lambda d: save_adapter(self.engine.model, d / "adapter")) if lora else None

        # The driver's state between steps (off-policy: the batch sampled ahead, the partial rollouts in flight):
        # in the checkpoint's directory, or each rank's share of a sharded one.
        assert self.driver is not None  # build_trainer made it
        driver_extra, rank_extra = self.driver.checkpoint_writers()
        if driver_extra is not None:
            lora_extra = extra

            def both(d: Path) -> None:
                if lora_extra is not None:
                    lora_extra(d)
                driver_extra(d)

            extra = both

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
                engine_model=self.stages.whole_engine_model(),
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
            self.stages.open_stream(cfg.run.seed)
            # A signal before this invocation's first RL step (during the warm start's evaluation, the trainer's
            # build): the run so far is checkpointed now (a restored checkpoint is that already).
            stop = self.step < tr.steps and self.stop_requested()
            if stop and self.resume_from is None:
                self.checkpoint()
            assert self.driver is not None  # build_trainer made it
            while self.step < tr.steps and not stop:
                m = self.driver.step()  # one RL step (module docstring)
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
