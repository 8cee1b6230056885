"""A run resolved once: the config validated, then turned into the facts everything downstream takes.

`resolve_run` runs on every rank, generators too, from the same inputs (the config and the launch's environment),
before anything loads: it validates the config (`RunConfig.validate`, the one validation of `exactrl train`), reads
the model's shape (the preset, or the checkpoint's config.json: one disk read), places the rank in the job
(`job_layout`), and chooses the step driver (`exactrl.train.drivers.modes.choose_driver`, whose refusals name the
key). What follows from the choice (off-policy or not, whether the phases overlap, whether training releases the
engine's memory) is asked of the `ResolvedRun`, never of the raw mode keys again.

    cfg (TOML + --set) -> resolve_run -> ResolvedRun(layout, model, driver, engine split, phases, trainer settings)
        -> RLRun (builds: model, engine, trainer, stages, driver) -> driver.step() per step
"""

from __future__ import annotations

from dataclasses import dataclass

from exactrl.config import RunConfig
from exactrl.distributed.env import init_from_env, under_torchrun
from exactrl.distributed.layout import Layout, split_layout
from exactrl.model.config import ModelConfig
from exactrl.model.hf import run_model_config
from exactrl.model.loading import resolve_device
from exactrl.train.drivers.modes import DriverName, choose_driver, off_policy, overlaps
from exactrl.train.memory import engine_group_ranks
from exactrl.train.preflight import check_with_model
from exactrl.train.trainer import TrainerSettings


@dataclass(frozen=True)
class ResolvedRun:
    """One run's config, validated, and what was resolved from it before anything loaded."""

    cfg: RunConfig  # validated
    layout: Layout  # this rank's place and role in the job (trainer or generator)
    model: ModelConfig  # the policy's shape, read once
    driver: DriverName  # the step driver that runs the config (`exactrl.train.drivers`)
    engine_group_ranks: (
        int  # the ranks that share one engine (engine.tensor_parallel / expert_parallel; 1: own)
    )

    @property
    def off_policy(self) -> bool:
        """The engine samples from its own weight copy while the trainer updates (one step off, partial)."""
        return off_policy(self.driver)

    @property
    def phases_overlap(self) -> bool:
        """The engine generates while the trainer trains: its memory is needed in both phases."""
        return overlaps(self.driver)

    @property
    def releases_memory(self) -> bool:
        """The switch to training frees the KV cache (and the replica under torchrun): exactrl/train/phases.py."""
        return bool(self.cfg.engine.release_memory) and not self.phases_overlap

    def trainer_settings(self, microbatch_tokens: int | None = None) -> TrainerSettings:
        """The trainer's settings (`trainer_settings`) with the run's microbatch budget (the memory plan's)."""
        return trainer_settings(self.cfg, microbatch_tokens)


def resolve_run(cfg: RunConfig, *, layout: Layout | None = None) -> ResolvedRun:
    """Validate `cfg` and resolve it (module docstring). Refuses (ValueError, ConfigError) by key what the run
    cannot take, on every rank the same way. layout: this rank's place when the caller made it already (None: made
    here, a collective under torchrun)."""
    cfg.validate()
    model = run_model_config(cfg)
    # The modes' refusals before the ranks split into trainers and generators: every rank, a generator too, refuses
    # the same way.
    driver = choose_driver(cfg, distributed=under_torchrun(), moe=model.is_moe)
    if layout is None:
        layout = job_layout(cfg)
    if layout.role != "generator":
        # A trainer's checks at its own world size (a disaggregated run's trainers: the trainers alone).
        d = layout.local
        driver = check_with_model(cfg, model, d.world_size, distributed=d.distributed)
    return ResolvedRun(
        cfg=cfg, layout=layout, model=model, driver=driver, engine_group_ranks=engine_group_ranks(cfg)
    )


def job_layout(cfg: RunConfig) -> Layout:
    """This rank's place in the job (every rank calls it: the process groups are made collectively): the
    colocated layout, or trainer / generator ranks, the generators' engines split over groups of
    engine.tensor_parallel / expert_parallel ranks."""
    return split_layout(
        init_from_env(resolve_device(cfg.run.device)),
        cfg.distributed.generator_ranks,
        engine_group_ranks(cfg),
    )


def trainer_settings(cfg: RunConfig, microbatch_tokens: int | None = None) -> TrainerSettings:
    """The trainer's view of the config: the [algorithm] section itself, and what it reads of [train], [run] and
    [sampling]; `microbatch_tokens` (the run's budget under FSDP2, exactrl.train.memory.microbatch_tokens) replaces
    train.max_tokens_per_microbatch."""
    tr = cfg.train
    return TrainerSettings(
        algorithm=cfg.algorithm,
        temperature=cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0,
        max_tokens_per_microbatch=microbatch_tokens or tr.max_tokens_per_microbatch,
        reduce_every_microbatch=tr.fsdp_reduce == "microbatch",
        cuda_graphs=tr.cuda_graphs,
        grad_clip=tr.grad_clip,
        moe_aux_loss_coef=tr.moe_aux_loss_coef,
        moe_z_loss_coef=tr.moe_z_loss_coef,
        exact=cfg.run.exact,
        on_mismatch=cfg.run.on_mismatch,
        norm_constant=float(cfg.sampling.max_tokens),
        seed=cfg.run.seed,
    )
