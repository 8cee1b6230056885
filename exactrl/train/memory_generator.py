"""The memory plan of a generator rank (disaggregated: distributed.generator_ranks > 0), beside the trainers' plan
(exactrl/train/memory.py, whose terms and phases it shares).

`exactrl plan` prints it and the generator ranks check it before anything loads (exactrl/train/disagg.py).
"""

from __future__ import annotations

import copy

import torch

from exactrl.config import RunConfig, apply_overrides
from exactrl.train.engine_split import check_shared_engine
from exactrl.train.memory import (
    CUDA_CONTEXT_BYTES,
    MemoryPlan,
    MemoryPlanError,
    Phase,
    _gib,
    _meta_models,
    count_tensors,
    decode_step_bytes,
    engine_gather_bytes,
    engine_group_ranks,
    engine_shard_params,
    engine_shard_sizes,
    fp8_copy_bytes,
    kv_bytes_per_token,
    kv_cache_blocks,
    kv_cache_bytes,
    model_config,
    prefill_working_set,
    rollout_tokens_needed,
)
from exactrl.train.memory_fit import split_overrides

# The last G ranks of the job run the rollout engine alone (exactrl/train/disagg.py): no trainer state, no phases
# to switch between. What one holds: its engine's weights (a 1/S shard on an engine split over S ranks; with LoRA the
# base's shard and the adapters; in fp8 the projections as their fp8 copies alone) from the start; the KV cache the engine sizes itself at its first generation (never
# released: a generator does nothing else); the decode graphs' pool and a generation's working set; and, in every
# weight sync, the receive buffer of `recv_weights` (one bucket of whole tensors at a time) and on a split engine the
# rank's slice of one weight, copied out of it.
_SYNC: dict[tuple, dict[str, int]] = {}  # sync_sizes by the model and LoRA


def sync_sizes(cfg: RunConfig) -> dict[str, int]:
    """Elements of the largest buffer a generator's `recv_weights` allocates: one bucket of whole tensors at a time
    (exactrl/distributed/layout.py `buckets`: consecutive tensors of one dtype up to BUCKET_BYTES, a larger one
    alone), in the order trainer 0 sends them. "full_bucket": a full sync's (the first: every weight, or with LoRA
    the base alone, the adapters being attached later; and the full one after they are); "step_bucket": a step's
    sync, which sends the trained tensors (every weight; with LoRA the adapters), and "step_largest" the largest
    of those."""
    from exactrl.distributed.layout import buckets
    from exactrl.model.hf import dtype_from_name

    key = (repr(cfg.model), repr(cfg.lora), cfg.run.seed)
    if key in _SYNC:
        return _SYNC[key]
    policy, _ = _meta_models(cfg)
    dtype = dtype_from_name(cfg.model.dtype)  # the generator's tensors, which the buckets are made of

    def largest_bucket(sent: list[torch.Tensor]) -> int:
        metas = [torch.empty(p.shape, dtype=dtype, device="meta") for p in sent]
        return max((sum(metas[i].numel() for i in idx) for idx in buckets(metas)), default=0)

    params = list(policy.parameters())
    trained = [p for p in params if p.requires_grad]
    full = largest_bucket(params)
    if cfg.lora.rank > 0:
        full = max(full, largest_bucket([p for p in params if not p.requires_grad]))
    out = {
        "full_bucket": full,
        "step_bucket": largest_bucket(trained),
        "step_largest": max((p.numel() for p in trained), default=0),
    }
    _SYNC[key] = out
    return out


def fp8_projection_params(cfg: RunConfig) -> dict[str, int]:
    """model.precision = "fp8" (else zeros): "held", the elements of the fp8 projections' model-dtype weights one
    generator rank would hold (a split engine's rank: its rows of them), which it holds as their fp8 copies alone
    (`empty_fp8_only`); "matrix", the most elements one `quantize_weight` call works on when a model-dtype sync arrives
    (a whole projection; or a chunk of a stack's experts, `expert_chunk` of the rank's, one part of each padded to
    whole blocks at a time)."""
    from exactrl.model.precision import fp8_projections
    from exactrl.ops.fp8 import expert_chunk, part_working_elements

    if cfg.model.precision != "fp8":
        return {"held": 0, "matrix": 0}
    key = (
        "fp8_held",
        repr(cfg.model),
        repr(cfg.lora),
        cfg.engine.tensor_parallel,
        cfg.engine.expert_parallel,
    )
    if key not in _SYNC:
        policy, _ = _meta_models(cfg)
        names = {id(p): n for n, p in policy.named_parameters()}
        shard = engine_shard_sizes(cfg) if engine_group_ranks(cfg) > 1 else None
        weights = [(getattr(mod, name), parts) for mod, name, parts in fp8_projections(policy)]

        def held(w: torch.Tensor) -> int:
            return w.numel() if shard is None else shard[names[id(w)]][1]

        def at_once(w: torch.Tensor, parts: list[int] | None) -> int:
            matrix = w.shape[-2] * w.shape[-1]
            if w.dim() == 2:
                return matrix
            # A stack: the rank's experts (all of them, or its share under expert parallel), a chunk a call, into the
            # copy's own buffers; the working copies are of one part at a time, padded to whole blocks.
            return min(held(w) // matrix, expert_chunk(w.shape, parts)) * part_working_elements(
                w.shape, parts
            )

        _SYNC[key] = {
            "held": sum(held(w) for w, _ in weights),
            "matrix": max(at_once(w, parts) for w, parts in weights),
        }
    return _SYNC[key]


def fp8_sync_bytes(cfg: RunConfig) -> dict[str, int]:
    """model.precision = "fp8": bytes of the largest buffer a generator's `recv_weights` allocates in a sync the
    trainers' replica sends in fp8 (`fp8_sync_tensors`: a projection as its e4m3 values, as bytes, then its fp32
    scales, each a bucket of its own dtype; every other tensor as it is): "full" (every weight: a resumed run's
    first sync, the one after the adapters are attached) and "step" (a step's: the trained tensors; with LoRA the
    adapters, in the model dtype)."""
    from exactrl.distributed.layout import buckets
    from exactrl.model.hf import dtype_from_name
    from exactrl.model.precision import fp8_projections
    from exactrl.ops.fp8 import fp8_copy_shapes

    key = ("fp8_sync", repr(cfg.model), repr(cfg.lora), cfg.run.seed)
    if key in _SYNC:
        return _SYNC[key]
    policy, _ = _meta_models(cfg)
    dtype = dtype_from_name(cfg.model.dtype)
    fp8 = {id(getattr(mod, name)) for mod, name, _ in fp8_projections(policy)}

    def largest_bucket(params: list[torch.Tensor]) -> int:
        sent = []
        for p in params:
            if id(p) in fp8:
                values, scales = fp8_copy_shapes(p.shape)
                sent.append(torch.empty(values, dtype=torch.uint8, device="meta"))
                sent.append(torch.empty(scales, dtype=torch.float32, device="meta"))
            else:
                sent.append(torch.empty(p.shape, dtype=dtype, device="meta"))
        sizes = [t.numel() * t.element_size() for t in sent]
        return max((sum(sizes[i] for i in idx) for idx in buckets(sent)), default=0)

    params = list(policy.parameters())
    trained = [p for p in params if p.requires_grad]
    _SYNC[key] = {"full": largest_bucket(params), "step": largest_bucket(trained)}
    return _SYNC[key]


def sync_slice_params(cfg: RunConfig) -> int:
    """Elements of the largest slice a split engine's rank copies out of a whole weight it received
    (`shard_full_weight`: a contiguous copy of its rows or experts) before it goes into its own tensor; 0 at S = 1,
    where the whole tensor is copied in place."""
    if engine_group_ranks(cfg) == 1:
        return 0
    return max((mine for whole, mine in engine_shard_sizes(cfg).values() if mine != whole), default=0)


def _ranks_text(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def trainer_role(world_size: int, trainers: int) -> str:
    """A disaggregated run's trainer ranks, in words (`MemoryPlan.role`)."""
    return f"trainer {_ranks_text(0, trainers - 1)} of {world_size}, FSDP2 over {trainers} rank{'s' if trainers > 1 else ''}"


def generator_role(cfg: RunConfig, world_size: int) -> str:
    """A disaggregated run's generator ranks and their engines, in words (`MemoryPlan.role`)."""
    g, s = cfg.distributed.generator_ranks, engine_group_ranks(cfg)
    trainers, engines = world_size - g, g // s
    served = -(-trainers // engines)
    if s == 1:
        engine = "an engine each"
    else:
        e = cfg.engine
        keys = [f"engine.{k} = {v}" for k, v in (("tensor_parallel", e.tensor_parallel), ("expert_parallel",
                e.expert_parallel)) if v > 1]  # fmt: skip
        engine = f"{engines} engine{'s' if engines > 1 else ''} split over {s} ranks ({' and '.join(keys)})"
    return (
        f"generator {_ranks_text(trainers, world_size - 1)} of {world_size}, {engine}, serving "
        f"{'up to ' if trainers % engines else ''}{served} trainer{'s' if served > 1 else ''} each"
    )


def plan_generator(
    cfg: RunConfig,
    *,
    world_size: int,
    gpu_memory: int | None = None,
    device: str = "cuda",
    counts: dict[str, int] | None = None,
) -> MemoryPlan:
    """A generator rank's predicted peak bytes of a disaggregated run of `world_size` torchrun ranks (the last
    distributed.generator_ranks of them), in three phases: "first_sync" (the weights filled before any generation,
    one receive bucket at a time), "generation" and "sync" (a step's weight sync, the cache and the decode graphs
    kept). Its KV cache is what the engine allocates: engine.num_kv_blocks, else
    distributed.generator_kv_memory_fraction of the device memory free at its first generation (the weights held,
    the first sync's buffers cached by the allocator; `auto_num_blocks`), capped by its largest call: the prompts of
    the trainers it serves. gpu_memory, device, counts: as `plan_memory`'s."""
    from exactrl.distributed.layout import trainer_ranks
    from exactrl.model.hf import dtype_from_name

    g, s = cfg.distributed.generator_ranks, engine_group_ranks(cfg)
    if g <= 0:
        raise ValueError(
            "plan_generator: distributed.generator_ranks = 0 (colocated: plan_memory plans each rank)"
        )
    trainers = trainer_ranks(world_size, g, s)
    served = -(-trainers // (g // s))  # engine j serves trainers j, j + G/S, ...: the first engine the most
    mcfg = model_config(cfg)
    c = counts if counts is not None else count_tensors(cfg)
    b = torch.empty((), dtype=dtype_from_name(cfg.model.dtype)).element_size()
    cuda = device.startswith("cuda")
    # fp8: the projections' model-dtype weights are not held (`empty_fp8_only`), one element stands for them all.
    held = fp8_projection_params(cfg)["held"]
    weights = {"engine_weights": (engine_shard_params(cfg) - held) * b + (b if held else 0)}
    lora = cfg.lora.rank > 0
    if lora:
        # The adapters, counted whole: a split engine's B keeps its projection's rows only (a little less).
        weights["lora_adapters"] = c["policy_trainable"] * b
    # model.precision = "fp8": the fp8 copy it quantizes from the synced weights (a split engine: its shard's).
    fp8 = fp8_copy_bytes(c, cuda, shard=s > 1)
    if fp8:
        weights["engine_fp8"] = fp8
    sync = sync_sizes(cfg)
    first = {"sync_bucket": sync["full_bucket"] * b}
    step = {"sync_bucket": sync["step_bucket"] * b}
    if fp8:
        # The replica's syncs send fp8 copies (a step's, without LoRA; the first of a resumed run); the warm start's
        # sends model-dtype weights, and each fp8 projection among them is quantized into its copy out of the bucket
        # (`sync_put`), one `quantize_weight` call at a time (a whole projection, or a chunk of experts): its fp8
        # values and scales and `quantize_weight`'s fp32 working copies of a part (about three), at most 13 bytes
        # an element (an estimate, not measured).
        f8 = fp8_sync_bytes(cfg)
        first["sync_bucket"] = max(first["sync_bucket"], f8["full"])
        step["sync_bucket"] = f8["step"]
        first["fp8_whole_weight"] = 13 * fp8_projection_params(cfg)["matrix"]
    if s > 1:
        first["sync_slice"] = sync_slice_params(cfg) * b
        # With LoRA a step sends the adapters, whose slice is at most the largest of them.
        step["sync_slice"] = (sync["step_largest"] if lora else sync_slice_params(cfg)) * b
    resident = dict(weights)
    decode = decode_step_bytes(cfg, mcfg) if cuda else 0
    if cuda and cfg.engine.cuda_graphs:
        # captured at the first decode (up to the call's rows), kept between calls; a larger call starts the pool
        # again (one working set, the largest bucket's)
        resident["decode_graph_pool"] = decode
        decode = 0
    available = None if gpu_memory is None else gpu_memory - CUDA_CONTEXT_BYTES
    free = None
    if available is not None and cuda:
        # What `torch.cuda.mem_get_info` says at the first generation: the weights held, and the blocks the first
        # sync's buffers freed still reserved by the caching allocator. (A cache sized later, after the adapters
        # are attached or to grow for a larger call, sees less free: this is the most the engine allocates.)
        free = available - sum(weights.values()) - sum(first.values())
    fraction = cfg.distributed.generator_kv_memory_fraction
    blocks = kv_cache_blocks(
        cfg, mcfg, b, trainers, free, fraction=fraction, served=served, engine_sized=True
    )
    kv = kv_cache_bytes(cfg, mcfg, b, blocks)
    gen = {**resident, "kv_cache": kv, "engine_working_set": prefill_working_set(cfg, mcfg, b) + decode}
    if s > 1:
        gen["engine_gathers"] = engine_gather_bytes(cfg, mcfg, b)
    phases = [
        # Before any generation: no cache, no decode graphs yet (a full sync after the adapters are attached too:
        # attaching them drops the runner and its cache).
        Phase("first_sync", {**weights, **first}),
        Phase("generation", gen),
        # A step's sync, the cache and the graphs kept.
        Phase("sync", {**resident, "kv_cache": kv, **step}),
    ]
    counts_out = {
        "dtype_bytes": b,
        "engine_ranks": s,
        "engine_shard_params": engine_shard_params(cfg),
        "trainers_served": served,
        "sync_full_bucket_params": sync["full_bucket"],
        "sync_step_bucket_params": sync["step_bucket"],
        "kv_bytes_per_token": kv_bytes_per_token(mcfg, b, cfg.engine.tensor_parallel),
        "rollout_tokens_needed": rollout_tokens_needed(cfg, trainers, served),
        "kv_blocks": blocks,
    }
    how = (
        "engine.num_kv_blocks"
        if cfg.engine.num_kv_blocks
        else f"distributed.generator_kv_memory_fraction = {fraction:g} of "
        + (
            f"the {_gib(max(0, free))} GiB free at the first generation"
            if free is not None
            else "a CPU budget"
        )
        + f", capped by {counts_out['rollout_tokens_needed']} tokens of the largest call"
    )
    tokens = blocks * cfg.engine.block_size
    return MemoryPlan(
        world_size=world_size,
        sharded=False,
        device=device,
        available=available,
        gpu_memory=gpu_memory,
        phases=phases,
        counts=counts_out,
        host_memory_from="not checked",  # a generator pins nothing
        role=generator_role(cfg, world_size),
        notes=[f"generator KV cache: {blocks} blocks, {tokens} tokens ({how})"],
    )


def _generator_knobs(cfg: RunConfig, world_size: int) -> list[tuple[str, str, list[str], int]]:
    """Single changes to try on a generator rank, as (family, what to tell the user, --set overrides, world
    size): a wider engine split (on more generator ranks where it does not divide them), a smaller KV cache, fewer
    sequences per decode step, smaller prefill chunks, 16-bit weights, one more engine."""
    e, g = cfg.engine, cfg.distributed.generator_ranks
    s = engine_group_ranks(cfg)
    trainers = world_size - g
    out: list[tuple[str, str, list[str], int]] = []
    for s2 in (2, 4, 8):
        if s2 <= s:
            continue
        g2 = -(-g // s2) * s2
        for sets in split_overrides(cfg, s2):
            if g2 == g:
                out.append(("split", " ".join(sets), sets, world_size))
            else:
                more = [f"distributed.generator_ranks={g2}", *sets]
                out.append(("split", f"--nproc {trainers + g2} with {' '.join(more)}", more, trainers + g2))
    if e.num_kv_blocks:
        for n in (e.num_kv_blocks // 2, e.num_kv_blocks // 4):
            if n >= 2:
                out.append(("kv", f"engine.num_kv_blocks={n}", [f"engine.num_kv_blocks={n}"], world_size))
    else:
        for f in (0.7, 0.5, 0.3):
            if f < cfg.distributed.generator_kv_memory_fraction:
                sets = [f"distributed.generator_kv_memory_fraction={f}"]
                out.append(("kv", sets[0], sets, world_size))
    for n in (e.max_num_seqs // 2, e.max_num_seqs // 4):
        if n >= 1:
            out.append(("seqs", f"engine.max_num_seqs={n}", [f"engine.max_num_seqs={n}"], world_size))
    if e.prefill_chunk_size >= 512:
        n = e.prefill_chunk_size // 2
        out.append(
            ("prefill", f"engine.prefill_chunk_size={n}", [f"engine.prefill_chunk_size={n}"], world_size)
        )
    if cfg.model.dtype == "float32":
        out.append(("dtype", "model.dtype=bfloat16", ["model.dtype=bfloat16"], world_size))
    if g // s < trainers:  # one more engine: each serves fewer trainers, so its largest call needs less cache
        sets = [f"distributed.generator_ranks={g + s}"]
        out.append(("more", f"--nproc {world_size + s} with {sets[0]}", sets, world_size + s))
    return out


def suggest_generator(cfg: RunConfig, plan: MemoryPlan) -> list[str]:
    """The single settings that make a generator rank's plan fit, each with its peak (of each family the first
    that fits: the narrowest split, the largest cache, the most sequences); [] when it fits."""
    if plan.fits:
        return []
    out, seen = [], set()
    for family, label, sets, n in _generator_knobs(cfg, plan.world_size):
        if family in seen:
            continue
        try:
            c2 = apply_overrides(copy.deepcopy(cfg), sets)
            check_shared_engine(c2, n - c2.distributed.generator_ranks, distributed=True)
            p2 = plan_generator(c2, world_size=n, gpu_memory=plan.gpu_memory, device=plan.device)
        except ValueError:
            continue  # a change the config or the layout refuses (a split the model's shape does not take)
        if p2.fits:
            seen.add(family)
            out.append(f"{label} (peak {_gib(p2.peak)} GiB)")
    return out


def make_generator_plan(
    cfg: RunConfig, *, world_size: int, gpu_memory: int | None = None, device: str = "cuda"
) -> MemoryPlan:
    """`plan_generator` with the suggestions filled in when it does not fit."""
    plan = plan_generator(cfg, world_size=world_size, gpu_memory=gpu_memory, device=device)
    plan.suggestions = suggest_generator(cfg, plan)
    return plan


def check_generator_before_loading(
    cfg: RunConfig, device: str, world_size: int, out=print
) -> MemoryPlan | None:
    """`check_before_loading` for a generator rank (`serve_generator`, before it makes its model): on a CUDA
    device, its plan against the device's total memory; MemoryPlanError naming the phase and the settings that
    would fit (train.check_memory = false: returned unchecked). None on the CPU."""
    if not device.startswith("cuda"):
        return None
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    if not cfg.train.check_memory:
        return plan_generator(cfg, world_size=world_size, gpu_memory=total, device="cuda")
    plan = make_generator_plan(cfg, world_size=world_size, gpu_memory=total, device="cuda")
    if not plan.fits:
        raise MemoryPlanError(plan.refusal())
    out(
        f"memory plan ({plan.role}): peak {_gib(plan.peak)} GiB per rank ({plan.worst.name}) of "
        f"{_gib(plan.available or 0)} GiB; KV cache {plan.counts['kv_blocks']} blocks"
    )
    return plan
