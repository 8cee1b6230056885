"""Which ranks share one rollout engine (engine.tensor_parallel, engine.expert_parallel), and where `exactrl train`
refuses to split it: one check, used by the preflight (exactrl/train/preflight.py) and by the memory plan's
suggestions (exactrl/train/memory.py), which try the splits the run would take."""

from __future__ import annotations

from exactrl.config import RunConfig
from exactrl.distributed.shared_engine import check_engine_split
from exactrl.model.config import ModelConfig
from exactrl.model.hf import run_model_config as model_config


def check_shared_engine(
    cfg: RunConfig, world_size: int, *, distributed: bool, model: ModelConfig | None = None
) -> int:
    """Refuse, by key, an engine shared by several ranks (engine.tensor_parallel, engine.expert_parallel) where
    `exactrl train` does not run it (exactrl/distributed/shared_engine.py); returns the ranks that share an
    engine (1: each rank its own). model: the model's shape when already read (None: read now)."""
    e = cfg.engine
    size = check_engine_split(model or model_config(cfg), e.tensor_parallel, e.expert_parallel)
    if size == 1:
        return 1
    key = (
        f"engine.tensor_parallel = {e.tensor_parallel}"
        if e.tensor_parallel > 1
        else f"engine.expert_parallel = {e.expert_parallel}"
    )
    a = cfg.algorithm
    # > 0: the engine is split over generator ranks, the trainers hold none
    gens = cfg.distributed.generator_ranks
    refusals = [
        (not distributed, "needs torchrun ranks (`exactrl train --nproc N`), N a multiple of it"),
        (
            distributed and not gens and world_size % size != 0,
            f"does not divide the world size {world_size}: every engine needs {size} ranks of its own",
        ),
        (
            gens % size != 0,
            f"does not divide distributed.generator_ranks = {gens}: every engine needs {size} generator ranks of "
            "its own",
        ),
        (
            a.max_off_policy_steps > 0 and not gens,
            f"with algorithm.max_off_policy_steps = {a.max_off_policy_steps}: the next batch is sampled by a "
            "worker thread that issues no collective, and a shared engine's every forward is one (generator "
            "ranks run it: distributed.generator_ranks)",
        ),
    ]
    for bad, text in refusals:
        if bad:
            raise ValueError(f"{key} {text}")
    return size
