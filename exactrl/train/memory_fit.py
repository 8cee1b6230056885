"""What makes a memory plan fit, and the plan made and checked: the single settings that would make a refused
plan fit and their combination (`suggest`), the engine splits to try, the FSDP2 microbatch grown to the headroom,
`make_plan` (`exactrl plan`) and `check_before_loading` (`exactrl train`, before anything loads), and the printed
table. The plan's terms and phases are exactrl/train/memory.py's."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from exactrl.config import RunConfig, apply_overrides
from exactrl.train.engine_split import check_shared_engine
from exactrl.train.memory import (
    FSDP_MICROBATCH_CANDIDATES,
    GROW_HEADROOM,
    MemoryPlan,
    MemoryPlanError,
    _gib,
    count_tensors,
    engine_group_ranks,
    host_memory_bytes,
    is_sharded,
    microbatch_tokens,
    model_config,
    plan_memory,
)

# An FSDP2 trainer's fp8 copies quantized per use (train.fsdp_fp8_copies): memory bought with a quantization of every
# projection weight per forward, so the suggestion says the trade (`_trade`).
FP8_PER_USE = "train.fsdp_fp8_copies=per_use"


def _trade(sets: list[str], plan: MemoryPlan, fitted: MemoryPlan) -> str:
    """What a suggested setting costs besides memory, where its name does not say it."""
    if sets == [FP8_PER_USE]:
        return (
            f" to quantize per use: ~{_gib(plan.peak - fitted.peak)} GiB less a rank, one quantization of each "
            "weight per forward"
        )
    return ""


def _knobs(cfg: RunConfig, world_size: int, sharded: bool) -> list[tuple[str, list[str], int]]:
    """Single changes to try, as (what to tell the user, --set overrides, world size); `sharded` as the plan's."""
    tr = cfg.train
    out: list[tuple[str, list[str], int]] = []
    seq = cfg.task.max_prompt_tokens + cfg.sampling.max_tokens
    # The budget the trainer packs by: under FSDP2 a set train.fsdp_tokens_per_microbatch.
    sharded_set = sharded and tr.fsdp_tokens_per_microbatch is not None
    key = "train.fsdp_tokens_per_microbatch" if sharded_set else "train.max_tokens_per_microbatch"
    t = microbatch_tokens(cfg, world_size, sharded=sharded) // 2
    while t >= max(seq, 256):
        out.append((f"{key}={t}", [f"{key}={t}"], world_size))
        t //= 2
    if not tr.activation_checkpointing:
        out.append(
            ("train.activation_checkpointing=true", ["train.activation_checkpointing=true"], world_size)
        )
    if tr.cuda_graphs:
        out.append(("train.cuda_graphs=false", ["train.cuda_graphs=false"], world_size))
    if sharded and tr.fsdp_reduce == "minibatch":
        out.append(('train.fsdp_reduce="microbatch"', ["train.fsdp_reduce=microbatch"], world_size))
    if sharded and cfg.model.precision == "fp8" and tr.fsdp_fp8_copies == "kept":  # the whole model's copies
        out.append(('train.fsdp_fp8_copies="per_use"', [FP8_PER_USE], world_size))
    if cfg.model.dtype == "float32":
        out.append(("model.dtype=bfloat16", ["model.dtype=bfloat16"], world_size))
    if tr.offload == "none":
        out.append(('train.offload="optimizer"', ["train.offload=optimizer"], world_size))
    else:  # the device may hold the state where the host cannot pin it
        out.append(('train.offload="none"', ["train.offload=none"], world_size))
    from exactrl.train.phases import phases_overlap

    if not cfg.engine.release_memory and not phases_overlap(cfg):
        out.append(("engine.release_memory=true", ["engine.release_memory=true"], world_size))
    if cfg.engine.num_kv_blocks is None and cfg.engine.kv_memory_fraction > 0.1:
        out.append(("engine.kv_memory_fraction=0.1", ["engine.kv_memory_fraction=0.1"], world_size))
    if cfg.lora.rank == 0:
        sets = ["lora.rank=16"]
        if model_config(cfg).is_moe:  # routed experts take no adapters: the attention projections only
            sets.append('lora.target_modules=["q_proj","k_proj","v_proj","o_proj"]')
        out.append((" ".join(sets), sets, world_size))
    if sharded:
        out += [(" ".join(sets), sets, world_size) for sets in engine_splits(cfg, world_size)]
    for more in (2, 4, 8):
        if more > world_size:
            # A disaggregated run's --nproc counts its generator ranks too (the plan's world size is the trainers').
            job = more + cfg.distributed.generator_ranks
            out.append((f"--nproc {job} (FSDP2 shards of 1/{more})", [], more))
    return out


def engine_splits(cfg: RunConfig, world_size: int) -> list[list[str]]:
    """The engine splits to try at `world_size` torchrun ranks, as --set overrides: T = G, and for a mixture of
    experts E = G and T = E = G, for each G of 2, 4, 8 above the config's that divides the world size and that
    `exactrl train` would run (preflight's refusals: the model's shape, the modes a shared engine lacks)."""
    out: list[list[str]] = []
    # The engine is on the generators: splitting it saves a trainer nothing.
    if cfg.distributed.generator_ranks:
        return out
    for g in (2, 4, 8):
        if g <= engine_group_ranks(cfg) or world_size % g:
            continue
        for sets in split_overrides(cfg, g):
            try:
                check_shared_engine(apply_overrides(copy.deepcopy(cfg), sets), world_size, distributed=True)
            except ValueError:
                continue
            out.append(sets)
    return out


def split_overrides(cfg: RunConfig, g: int) -> list[list[str]]:
    """The --set overrides that split the engine over g ranks: T = g, and for a mixture of experts E = g and
    T = E = g (the other key back to 1 where the config set it: both above 1 must be equal)."""
    t, e = f"engine.tensor_parallel={g}", f"engine.expert_parallel={g}"
    only_t = [t] + (["engine.expert_parallel=1"] if cfg.engine.expert_parallel > 1 else [])
    only_e = [e] + (["engine.tensor_parallel=1"] if cfg.engine.tensor_parallel > 1 else [])
    return [only_t] + ([only_e, [t, e]] if model_config(cfg).is_moe else [])


def suggest(cfg: RunConfig, plan: MemoryPlan, counts: dict[str, int]) -> list[str]:
    """The single settings that make the plan fit, each with its peak; and when none but LoRA or more ranks does
    alone, the cumulative combination of the full fine-tune's memory settings on these ranks (16-bit weights, the
    release, checkpointing, offload, no training graphs, a smaller KV cache) that first fits."""
    if plan.fits:
        return []
    out = []
    device = plan.device
    same_counts = lambda sets: not any(s.startswith("lora.") for s in sets)  # noqa: E731
    for label, sets, n in _knobs(cfg, plan.world_size, plan.sharded):
        same_ranks = n == plan.world_size
        try:
            c2 = apply_overrides(copy.deepcopy(cfg), sets) if sets else cfg
            p2 = plan_memory(
                c2, world_size=n, gpu_memory=plan.gpu_memory, device=device,
                counts=counts if same_counts(sets) else None, host_memory=plan.host_memory,
                host_ranks=plan.host_ranks if same_ranks else None,
                sharded=plan.sharded if same_ranks else None,
            )  # fmt: skip
        except ValueError:
            continue  # a change the config refuses (e.g. a microbatch shorter than a sequence)
        if p2.fits:
            out.append(f"{label}{_trade(sets, plan, p2)} (peak {_gib(p2.peak)} GiB)")
    # Keep one microbatch size: the largest that fits.
    budgets = ("train.max_tokens_per_microbatch", "train.fsdp_tokens_per_microbatch")
    mb = [s for s in out if s.startswith(budgets)]
    out = mb[:1] + [s for s in out if not s.startswith(budgets)]
    # And one engine split: the narrowest that fits (fewest ranks per engine, fewest collectives).
    splits = [
        s for s in out if s.startswith("engine.tensor_parallel=") or s.startswith("engine.expert_parallel=")
    ]
    out = [s for s in out if s not in splits[1:]]
    # Only LoRA or more ranks fit alone: the full fine-tune on these ranks may still fit with several memory
    # settings together (the 8B on one GPU: 16-bit weights, optimizer offload, activation checkpointing).
    if all(s.startswith(("lora.", "--nproc")) for s in out):
        out += _together(cfg, plan, counts, plan.world_size)
    # Nothing on these ranks: the fewest more ranks at which the full fine-tune fits with the memory settings
    # (qwen3-30b-a3b at --nproc 2: --nproc 8 with the optimizer state offloaded).
    if not any(s.startswith("--nproc") for s in out) and not any(not s.startswith("lora.") for s in out):
        for more in (2, 4, 8):
            if more > plan.world_size:
                found = _together(cfg, plan, counts, more)
                if found:
                    out += [f"--nproc {more + cfg.distributed.generator_ranks} with {found[0]}"]
                    break
    return out


def _together(cfg: RunConfig, plan: MemoryPlan, counts: dict[str, int], world_size: int) -> list[str]:
    """The memory settings (full fine-tune) that make the plan fit at `world_size` ranks (FSDP2 when it is not the
    plan's): the first single one that fits, else their cumulative combination that first fits; [] if none."""
    from exactrl.train.phases import phases_overlap

    same = world_size == plan.world_size
    kw: dict[str, Any] = dict(
        world_size=world_size, gpu_memory=plan.gpu_memory, device=plan.device, counts=counts,
        host_memory=plan.host_memory, host_ranks=plan.host_ranks if same else None,
        sharded=plan.sharded if same else None,
    )  # fmt: skip
    if not same:
        for label, single, n in _knobs(cfg, world_size, is_sharded(world_size)):
            if (
                n != world_size
                or not single
                or any(x.startswith(("lora.", "train.max_tokens", "train.fsdp")) for x in single)
            ):
                continue
            try:
                p2 = plan_memory(apply_overrides(copy.deepcopy(cfg), single), **kw)
                if p2.fits:
                    return [f"{label} (peak {_gib(p2.peak)} GiB)"]
            except ValueError:
                continue
    sets: list[str] = []
    for extra in (
        ["model.dtype=bfloat16"] if cfg.model.dtype == "float32" else [],
        ["engine.release_memory=true"] if not (cfg.engine.release_memory or phases_overlap(cfg)) else [],
        ["train.activation_checkpointing=true"] if not cfg.train.activation_checkpointing else [],
        ["train.offload=optimizer"] if cfg.train.offload == "none" else [],
        ["train.cuda_graphs=false"] if cfg.train.cuda_graphs else [],
        ["engine.kv_memory_fraction=0.1"] if cfg.engine.num_kv_blocks is None else [],
        # The widest engine split train runs at these ranks (each rank a 1/G shard of the engine's weights).
        (engine_splits(cfg, world_size) or [[]])[-1],
    ):
        if not extra:
            continue
        sets = sets + extra
        try:
            p2 = plan_memory(apply_overrides(copy.deepcopy(cfg), sets), **kw)
        except ValueError:
            continue
        if p2.fits:
            return [" ".join(sets) + f" together (peak {_gib(p2.peak)} GiB)"]
    return []


def _grown_microbatch(cfg: RunConfig, plan: MemoryPlan, counts: dict[str, int], **kw) -> MemoryPlan:
    """Under FSDP2 on a GPU with train.fsdp_tokens_per_microbatch unset and the memory phases on: the plan at the
    largest candidate microbatch that fits with GROW_HEADROOM to spare, or `plan` itself. Without the release the
    KV cache is sized from what training leaves, so a larger microbatch would buy its speed with preemptions: not
    tried (a disaggregated trainer has no cache: tried)."""
    from exactrl.train.phases import releases_memory

    tr = cfg.train
    if not plan.sharded or tr.fsdp_tokens_per_microbatch is not None or plan.gpu_memory is None:
        return plan
    # A disaggregated trainer holds no KV cache (its generators do): nothing to preempt, release or not.
    no_cache = releases_memory(cfg) or cfg.distributed.generator_ranks > 0
    if not plan.device.startswith("cuda") or not no_cache or not plan.fits:
        return plan
    for t in FSDP_MICROBATCH_CANDIDATES:
        if t <= tr.max_tokens_per_microbatch:
            continue
        c2 = apply_overrides(copy.deepcopy(cfg), [f"train.fsdp_tokens_per_microbatch={t}"])
        p2 = plan_memory(c2, counts=counts, sharded=plan.sharded, **kw)
        if p2.fits and p2.peak <= GROW_HEADROOM * (p2.available or 0):
            return p2
    return plan


def make_plan(
    cfg: RunConfig,
    *,
    world_size: int = 1,
    gpu_memory: int | None = None,
    device: str = "cuda",
    host_memory: int | None = None,
    host_ranks: int | None = None,
    sharded: bool | None = None,
    host_memory_from: str = "this machine",
) -> MemoryPlan:
    """`plan_memory` with the suggestions filled in when it does not fit, and under FSDP2 the larger microbatch
    when it fits (`_grown_microbatch`). sharded: as `plan_memory`'s. host_memory_from: "this machine" or
    "--host-memory", said where the host check refuses."""
    counts = count_tensors(cfg)
    plan = plan_memory(
        cfg,
        world_size=world_size,
        gpu_memory=gpu_memory,
        device=device,
        counts=counts,
        host_memory=host_memory,
        host_ranks=host_ranks,
        sharded=sharded,
    )
    plan.suggestions = suggest(cfg, plan, counts)
    kw = dict(world_size=world_size, gpu_memory=gpu_memory, device=device, host_memory=host_memory)
    out = _grown_microbatch(cfg, plan, counts, host_ranks=host_ranks, **kw)
    out.host_memory_from = host_memory_from
    return out


def check_before_loading(
    cfg: RunConfig, device: str, world_size: int, out=print, *, sharded: bool | None = None
) -> MemoryPlan | None:
    """The check at the start of `exactrl train`: on a CUDA device, the plan against its total memory; a phase
    that cannot fit raises MemoryPlanError naming it and the settings to change (train.check_memory = false: the
    plan is returned unchecked). None on the CPU (no device limit to plan against). The run sizes its KV cache
    from the returned plan (`counts["kv_blocks"]`). sharded: the run's FSDP2 (`Parallelism.sharded`; None: world
    size 2 or more)."""
    if not device.startswith("cuda"):
        return None
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    host = host_memory_bytes()
    # The ranks of this node share its host memory (torchrun's LOCAL_WORLD_SIZE; one node when it is unset).
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    kw: dict[str, Any] = dict(
        world_size=world_size,
        gpu_memory=total,
        device="cuda",
        host_memory=host,
        host_ranks=local,
        sharded=sharded,
    )
    if not cfg.train.check_memory:
        return plan_memory(cfg, **kw)
    plan = make_plan(cfg, **kw)
    if not plan.fits:
        raise MemoryPlanError(plan.refusal())
    tokens = plan.counts["tokens_per_microbatch"]
    grown = (
        f", FSDP2 microbatches of {tokens} tokens" if tokens != cfg.train.max_tokens_per_microbatch else ""
    )
    out(
        f"memory plan: peak {_gib(plan.peak)} GiB per rank ({plan.worst.name}) of {_gib(plan.available or 0)} GiB"
        + grown
    )
    return plan


def print_plan(
    plan: MemoryPlan, out=print, generator: MemoryPlan | None = None, json_line: bool = True
) -> None:
    """The table, the verdict with the knobs, and (json_line) one JSON line; a disaggregated run's generator plan
    (`generator`) after the trainers', each under its ranks, and in the same JSON line."""
    out(plan.table())
    if not plan.fits:
        out(plan.refusal())
    line: dict[str, Any] = {"memory_plan": plan.to_json()}
    if generator is not None:
        out("")
        out(f"{generator.role}:")
        out(generator.table())
        if not generator.fits:
            out(generator.refusal())
        line["generator_memory_plan"] = generator.to_json()
    if json_line:
        out(json.dumps(line, separators=(",", ":")))
