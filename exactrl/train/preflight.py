"""The checks a run's config passes before anything loads, shared by `exactrl train` and `exactrl plan`.

`exactrl plan` answers "can I run this?", so it must refuse what `exactrl train` would refuse: the config's own
checks (`RunConfig.validate`), and the ones that need the world size or the model's shape (a mixture of experts is
read from the preset or the checkpoint's config.json, nothing is built), the modes' among them
(`exactrl.train.drivers.modes.choose_driver`). One function, called by both.

Keys that do nothing in the mode the config chose (`inert_keys`) follow one rule: a warning that names the key,
why it does nothing and what would make it act, printed when the run (or the plan) starts. Not a refusal: a config
kept for several modes (a GPU config smoke-tested on a CPU, partial rollouts switched off for a comparison) should
run unchanged, and the run it gives is the one asked for. A key whose value would make the run something other than
the config says (router losses on a dense model, tail overlap with a mixture of experts) is refused instead.

A resume into another mode says what the checkpoint held that the new mode does not use (`dropped_on_resume`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from exactrl.config import AlgorithmConfig, RunConfig
from exactrl.model.config import ModelConfig
from exactrl.model.hf import run_model_config as model_config
from exactrl.train.checkpoint import PARTIAL_FILE, POOLS_DIR
from exactrl.train.drivers.modes import DriverName, choose_driver
from exactrl.train.engine_split import check_shared_engine


def check_run_config(cfg: RunConfig, world_size: int, *, distributed: bool) -> DriverName:
    """Refuse (ValueError, ConfigError) a config `exactrl train` would refuse at `world_size` ranks, before anything
    loads; returns the step driver that runs it (`exactrl.train.drivers.modes.choose_driver`). distributed: under
    torchrun (any world size, one included)."""
    cfg.validate()
    return check_with_model(cfg, model_config(cfg), world_size, distributed=distributed)


def check_with_model(cfg: RunConfig, model: ModelConfig, world_size: int, *, distributed: bool) -> DriverName:
    """`check_run_config` of a validated config whose model shape has been read (`model`): the checks that need the
    world size or the shape; returns the step driver that runs it."""
    moe = model.is_moe
    check_shared_engine(cfg, world_size, distributed=distributed, model=model)
    driver = choose_driver(cfg, distributed=distributed, moe=moe)
    if cfg.algorithm.prompts_per_step < world_size:
        raise ValueError(
            f"algorithm.rollouts_per_step / group_size = {cfg.algorithm.prompts_per_step} prompts per step for "
            f"{world_size} ranks: every rank needs at least one prompt (a group stays on one rank)"
        )
    check_env_timeout(cfg, world_size)
    tr = cfg.train
    if (tr.moe_aux_loss_coef or tr.moe_z_loss_coef) and not moe:
        raise ValueError(
            f"train.moe_aux_loss_coef = {tr.moe_aux_loss_coef} and train.moe_z_loss_coef = {tr.moe_z_loss_coef}: "
            f"router losses need a mixture-of-experts model, and {cfg.model.preset or cfg.model.path} has no "
            "sparse layer; set both to 0"
        )
    return driver


def check_env_timeout(cfg: RunConfig, world_size: int) -> None:
    """Refuse an environment call that may outlast a collective's wait: with several ranks, the others wait for a
    rank's environment calls at their next collective (an engine split over ranks trades the verdicts of every turn
    round, exactrl/envs/rollout.py "Lockstep"), and a first call may take 2 x env.timeout_s. Past the process
    group's timeout the wait would fail the run with NCCL's or gloo's timeout instead of the environment's."""
    from exactrl.distributed.env import PROCESS_GROUP_TIMEOUT_S

    t = cfg.env.timeout_s
    several = world_size > 1 or cfg.distributed.generator_ranks > 0  # world_size may count the trainers alone
    if several and cfg.env.name is not None and 2 * t >= PROCESS_GROUP_TIMEOUT_S:
        raise ValueError(
            f"env.timeout_s = {t:g} under torchrun: a first environment call may take 2 x {t:g} s, and the "
            f"other ranks wait for it at most {PROCESS_GROUP_TIMEOUT_S:g} s (the process group's timeout); set "
            f"env.timeout_s below {PROCESS_GROUP_TIMEOUT_S / 2:g}"
        )


def _default(cls: type, name: str):
    return next(f for f in dataclasses.fields(cls) if f.name == name).default


def inert_keys(cfg: RunConfig, device: str) -> list[str]:
    """Keys set away from their default that do nothing in the mode the config chose, each as a sentence that
    names the key, says why, and what makes it act. device: the run's resolved device ("cpu", "cuda", ...)."""
    a, notes = cfg.algorithm, []
    if not a.partial_rollouts and a.partial_oversample != _default(AlgorithmConfig, "partial_oversample"):
        notes.append(
            f"algorithm.partial_oversample = {a.partial_oversample} does nothing: it sizes the extra groups of "
            "partial rollouts, and algorithm.partial_rollouts is false"
        )
    if a.max_off_policy_steps == 0 and a.off_policy_is_cap != _default(AlgorithmConfig, "off_policy_is_cap"):
        notes.append(
            f"algorithm.off_policy_is_cap = {a.off_policy_is_cap} does nothing: it caps the importance weight of "
            "off-policy steps, and algorithm.max_off_policy_steps = 0 trains on-policy"
        )
    if cfg.train.offload == "optimizer" and not device.startswith("cuda"):
        notes.append(
            f'train.offload = "optimizer" saves nothing on run.device = {device!r}: the optimizer state moves '
            "between two host buffers (device memory is what it frees, on CUDA)"
        )
    return notes


def dropped_on_resume(directory: Path, *, off_policy: bool, partial: bool) -> list[str]:
    """What a checkpoint holds for an asynchronous mode that the resumed run's mode does not take (after
    `--allow-config-change`): the batch sampled ahead (one-step-off, partial rollouts) and the groups in flight
    (partial rollouts), each as a sentence saying it is dropped."""
    from exactrl.train.offpolicy import PENDING_FILE
    from exactrl.train.offpolicy_dist import RANKS_DIR

    notes = []
    if not off_policy and ((directory / PENDING_FILE).is_file() or (directory / RANKS_DIR).is_dir()):
        notes.append(
            "resume: the checkpoint holds the batch sampled ahead for the next step (an off-policy run); this run "
            "is synchronous (algorithm.max_off_policy_steps = 0), so that batch is dropped and the next step "
            "samples its own from the checkpoint's weights"
        )
    # The one-process pool, or every rank's of a torchrun run.
    paths = [directory / PARTIAL_FILE, *sorted((directory / POOLS_DIR).glob(f"rank*/{PARTIAL_FILE}"))]
    if not partial:
        pool = [g for p in paths if p.is_file() for g in json.loads(p.read_text()).get("pool", [])]
        if pool:
            notes.append(
                f"resume: the checkpoint holds {len(pool)} prompt group(s) in flight (partial rollouts); this run "
                "has algorithm.partial_rollouts = false, so they are dropped (their prompts are not trained on)"
            )
    return notes
