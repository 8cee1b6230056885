"""Which step driver runs a config, and which modes compose: one function, `choose_driver`.

The modes are how a step orders its generation and its update (exactrl/train/drivers/): synchronous, tail overlap
(algorithm.overlap = "tail"), one step off (algorithm.max_off_policy_steps = 1) and partial rollouts
(algorithm.partial_rollouts, k >= 2), each under a layout (colocated, or disaggregated with
distributed.generator_ranks > 0) and with the sampling options that change a step's batch (dynamic sampling, a
multi-turn environment, ReMax's greedy baseline).

What the config alone can say (a key against another key: tail overlap with partial rollouts, partial rollouts with
k < 2, the tail's whole-batch options) is `RunConfig.validate`'s, so that a TOML file is refused by key wherever it
is loaded. This function is the rest: what also depends on the launch (torchrun, generator ranks) or on the model
(a mixture of experts). `exactrl plan`, `exactrl train` (before anything loads, on every rank, generators included)
and `RLRun` all call it through `exactrl.train.preflight.check_run_config` or directly.
"""

from __future__ import annotations

from typing import Literal

from exactrl.config import RunConfig

DriverName = Literal["sync", "tail", "one_step_off", "partial"]


def choose_driver(cfg: RunConfig, *, distributed: bool, moe: bool) -> DriverName:
    """The step driver for a validated config (`RunConfig.validate`), after refusing (ValueError) a combination of
    modes the run cannot take. distributed: under torchrun (any world size, one included); moe: the model has
    sparse layers."""
    a = cfg.algorithm
    _check_disaggregated(cfg)
    k = a.max_off_policy_steps
    if k:
        # One step off: the behaviour logprobs are exact only in exact mode. Under torchrun each rank's engine
        # replica is the behaviour copy (exactrl/train/offpolicy_dist.py). Multi-turn episodes run in the worker as
        # the batch does (the guard checks the model's tokens, observations masked).
        where = f"algorithm.max_off_policy_steps = {k}"
        if not cfg.run.exact:
            raise ValueError(
                f"{where} needs run.exact = true: the behaviour logprobs are exact only in exact mode"
            )
        if a.rollout_correction:
            raise ValueError(
                f"{where}: algorithm.rollout_correction is for fast mode's mismatch; leave it unset"
            )
    if a.partial_rollouts:
        # Under torchrun every rank keeps its own pool, cut by its own count (exactrl/train/drivers/partial.py).
        where = "algorithm.partial_rollouts = true"
        if cfg.env.name:
            raise ValueError(
                f"{where} is single-turn for now (env.name = {cfg.env.name!r}): a cut episode would have to resume "
                "mid-conversation; use algorithm.max_off_policy_steps = 1 without partial rollouts"
            )
        if a.resolved_advantage == "remax":
            raise ValueError(
                f"{where}: advantage 'remax' needs a greedy rollout of each prompt under the policy that samples "
                "it, and a partial rollout's prompt spans several versions; choose another advantage estimator"
            )
    if a.dynamic_sampling != "off" and distributed and k:
        # Under torchrun the next batch is sampled by a worker thread that issues no collective, and which groups
        # to keep is decided over every rank, a collective per round.
        raise ValueError(
            f"algorithm.dynamic_sampling = {a.dynamic_sampling!r} with algorithm.max_off_policy_steps = "
            f"{k} runs on one process only: under torchrun the next batch is sampled by a "
            "worker thread that issues no collective, and which groups to keep is decided over every rank; run "
            "it without --nproc, or synchronously (max_off_policy_steps = 0)"
        )
    if a.overlap == "tail":
        if distributed:
            raise ValueError('algorithm.overlap = "tail" runs on one process for now (not under torchrun)')
        if moe:
            raise ValueError(
                'algorithm.overlap = "tail" does not support a mixture-of-experts model: the router statistics are '
                "collected through the model object, which the engine runs at the same time"
            )
    return driver_of(cfg)


def driver_of(cfg: RunConfig) -> DriverName:
    """The step driver a validated config selects, without the refusals (`choose_driver`): the one place that reads
    the mode keys; what follows from the choice (`overlaps`, `off_policy`) is asked of its name."""
    a = cfg.algorithm
    if a.partial_rollouts:
        return "partial"
    if a.max_off_policy_steps:
        return "one_step_off"
    if a.overlap == "tail":
        return "tail"
    return "sync"


def off_policy(driver: DriverName) -> bool:
    """Whether the driver trains on a batch sampled by earlier weights (one step off, partial rollouts): the engine
    samples from its own weight copy, and the checkpoint keeps the batch sampled ahead."""
    return driver in ("one_step_off", "partial")


def overlaps(driver: DriverName) -> bool:
    """Whether the engine generates while the trainer trains (one step off, partial rollouts, the tail overlap):
    its memory is then needed in both phases and nothing is released."""
    return off_policy(driver) or driver == "tail"


def _check_disaggregated(cfg: RunConfig) -> None:
    """Refuse, by key, what the disaggregated layout does not run yet. One step off runs as under colocated torchrun
    (the replica is the behaviour copy and the guard's weights); the generator samples the next batch while the
    trainers train. Its other limits are its own (above). Dynamic sampling's extra rounds are more generate
    commands; LoRA's adapters are attached on the generators after the evaluation before RL (exactrl/train/disagg.py).
    Partial rollouts: the generator runs each trainer's generation cut by that trainer's count ("partial" commands);
    multi-turn episodes run on the generator against its own instance of the environment ("episodes" commands)."""
    g = cfg.distributed.generator_ranks
    if g == 0:
        return
    why = f"with distributed.generator_ranks = {g}"
    a = cfg.algorithm
    refusals = [
        (
            a.overlap != "none",
            "algorithm.overlap",
            f"= {a.overlap!r} is not supported (the generator overlaps)",
        ),
    ]
    for bad, key, text in refusals:
        if bad:
            raise ValueError(f"{key} {text} {why}")
