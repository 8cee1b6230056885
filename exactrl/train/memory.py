"""The memory plan of a run: what each phase holds on one rank's device, predicted from the config alone.

`exactrl plan CONFIG` prints it, and `exactrl train` checks it before anything loads, so a run that cannot fit is
refused in a second, naming the settings that would make it fit, instead of running out of memory after minutes
of start-up. Nothing is loaded: the model is built on the `meta` device (shapes, no storage), LoRA adapters and the
PPO critic too, so the parameter counts are the ones the run will have, by the same code.

Phases, per rank, as the run lays memory out (docs/memory.md; exactrl/train/phases.py switches them):

- generation: the engine's weights (on one device the policy itself; under FSDP2 a full replica in the model dtype
  beside the trainer's 1/N shards), the KV cache, the prefill working set; and whatever stays resident: the fp32
  masters and AdamW moments (unless `train.offload = "optimizer"`), the persistent gradient buffers, the training
  CUDA-graph pool (one device, no mixture of experts) and the decode graphs' pool (CUDA), the reference model and
  the critic.
- training: the resident state, the gradients, one microbatch's activations (in the graph pool when training
  graphs are on), the LM head's logprob chunk and its backward's transients. With `engine.release_memory` (the
  default) the KV cache and the FSDP2 replica are not on the device; without it they are.
- optimizer: the resident state, the gradients, and the masters and moments on the device for the step (with
  offload, one group of them at a time: the step streams them through); the KV cache and replica as in training.
- checkpoint (a shared engine only, `engine.tensor_parallel` / `expert_parallel`): rank 0's whole copy of the
  engine's weights, gathered on its device for policy/, beside the resident state and its engine shard.

A shared engine's replica and KV cache are each rank's shard (`engine_shard_params`, `kv_bytes_per_token`).

A disaggregated run (`distributed.generator_ranks` > 0) has two plans: the trainers' (the phases above, FSDP2 over
the trainers, no KV cache) and a generator rank's (`plan_generator`: its engine shard, the KV cache its engine sizes
itself, the decode graphs, and a weight sync's receive buffers, in phases first_sync, generation and sync).

The KV cache is `kv_memory_fraction` of what the phases that hold it leave free (`engine.num_kv_blocks` when set),
and `exactrl train` allocates exactly the plan's blocks: the cache never crowds out a later phase.

The byte counts of weights, masters, moments and gradients are exact (a test counts the real tensors); the
activation term is a per-token count of the tensors autograd keeps for the backward, checked on the GPU
(benchmarks/gpu_session.sh, section plan-check).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from exactrl.config import RunConfig, apply_overrides, episode_token_limit

GiB = 1024**3
# Device memory outside torch's caching allocator: the CUDA context, cuBLAS and Triton workspaces. Measured as
# total - free right after the first kernel on an H100 (torch 2.11): about 0.5-0.6 GiB; 1 GiB leaves room.
CUDA_CONTEXT_BYTES = 1 * GiB
# Per-token fp32/int64 vectors of the loss (logprobs, old/ref logprobs, advantages, masks, ratios, positions).
LOSS_BYTES_PER_TOKEN = 64
CPU_KV_BUDGET = 2 * GiB  # exactrl.engine.runner.auto_num_blocks: the CPU's KV budget before the fraction
# Host memory the plan leaves to the process itself (interpreter, torch, the CUDA driver's host side, the
# tokenizer and data) and to the system, before pinned optimizer state is counted against the host's RAM.
HOST_RESERVE_BYTES = 8 * GiB


def pinned_bytes(nbytes: int) -> int:
    """Host memory an offload buffer of nbytes takes: exactly its bytes (exactrl/train/pinned.py registers
    ordinary host memory with the CUDA driver; torch's `pin_memory=True` would round each block up to the next
    power of two: a 2.49 GB embedding master would take 4 GiB)."""
    return max(0, nbytes)


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class MemoryPlanError(ValueError):
    """A phase of the run would not fit the device: raised before anything loads."""


@dataclass
class Phase:
    name: str
    terms: dict[str, int]  # what the phase holds, by name: bytes per rank

    @property
    def peak(self) -> int:
        return sum(self.terms.values())


@dataclass
class MemoryPlan:
    """Predicted peak bytes per rank of each phase, and the fit against `available` (None: no limit known)."""

    world_size: int
    # FSDP2 (any torchrun run, `exactrl train --nproc 1` included): fp32 shards as masters, an engine replica,
    # fp32 gradient shards, gathered layers; else one device without a process group.
    sharded: bool
    device: str
    available: int | None  # bytes of device memory per rank, the CUDA context taken off
    gpu_memory: int | None  # the device's memory as given (--gpu-memory) or read
    phases: list[Phase]
    counts: dict[str, int]  # parameter counts and shapes the terms came from
    suggestions: list[str] = field(default_factory=list)
    # train.offload = "optimizer": the masters and moments (under FSDP2 each rank's moment shards) wait in pinned
    # host memory between steps.
    host_pinned: int = 0  # bytes of host memory they take per rank
    host_memory: int | None = None  # the host's RAM as given or read (None: not checked)
    host_ranks: int = (
        1  # ranks that share that host (torchrun's processes on one node), each pinning host_pinned
    )
    # Where host_memory came from: "this machine" (read here: the refusal names --host-memory, which plans for
    # another host), "--host-memory" (given) or "not checked" (exactrl plan for another machine without it).
    host_memory_from: str = "this machine"
    # Which ranks of the job the plan is for, in words, where they are not all alike: a disaggregated run's trainer
    # ranks and generator ranks (`plan_generator`) each get a plan; "" for a colocated run's every rank.
    role: str = ""
    notes: list[str] = field(default_factory=list)  # lines the table ends with (a generator's KV cache)

    @property
    def host_available(self) -> int | None:
        return None if self.host_memory is None else self.host_memory - HOST_RESERVE_BYTES

    @property
    def host_fits(self) -> bool:
        return self.host_available is None or self.host_pinned * self.host_ranks <= self.host_available

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.phases)

    @property
    def worst(self) -> Phase:
        return max(self.phases, key=lambda p: p.peak)

    @property
    def device_fits(self) -> bool:
        return self.available is None or self.peak <= self.available

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def table(self) -> str:
        names = list(dict.fromkeys(k for p in self.phases for k in p.terms))
        w = max(len(n) for n in [*names, "peak"]) + 2
        head = f"{'bytes per rank (GiB)':<{w}}" + "".join(f"{p.name:>14}" for p in self.phases)
        lines = [head, "-" * len(head)]
        for n in names:
            cells = "".join(f"{_gib(p.terms[n]) if n in p.terms else '-':>14}" for p in self.phases)
            lines.append(f"{n:<{w}}{cells}")
        lines.append("-" * len(head))
        lines.append(f"{'peak':<{w}}" + "".join(f"{_gib(p.peak):>14}" for p in self.phases))
        if "tokens_per_microbatch" in self.counts:
            lines.append(f"training microbatch: {self.counts['tokens_per_microbatch']} tokens")
        if self.available is not None:
            verdict = "fits" if self.device_fits else f"DOES NOT FIT ({self.worst.name})"
            lines.append(
                f"available per rank: {_gib(self.available)} GiB ({_gib(self.gpu_memory or 0)} GiB device - "
                f"{_gib(CUDA_CONTEXT_BYTES)} GiB CUDA context): {verdict}"
            )
        if not self.device.startswith("cuda"):
            lines.append(
                f"run.device = {self.device!r}: each term is host memory of one rank (no device to fit, and "
                "`exactrl train` checks nothing on a CPU); --gpu-memory GB plans the run on a CUDA device instead"
            )
        if self.host_pinned:
            line = f"host memory, pinned optimizer state (train.offload): {_gib(self.host_pinned)} GiB"
            if self.sharded:
                line = (
                    f"host memory per rank, pinned AdamW moment shards (train.offload): {_gib(self.host_pinned)} "
                    f"GiB; {self.host_ranks} ranks on one host: {_gib(self.host_pinned * self.host_ranks)} GiB"
                )
            if self.host_available is not None:
                verdict = "fits" if self.host_fits else "DOES NOT FIT"
                line += (
                    f" of {_gib(self.host_available)} GiB ({_gib(self.host_memory or 0)} GiB RAM, "
                    f"{self._host_name()}, - {_gib(HOST_RESERVE_BYTES)} GiB for the process and the system): {verdict}"
                )
            else:
                line += "; not checked against a host's RAM (--host-memory GB checks it)"
            lines.append(line)
        lines += self.notes
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "role": self.role,
            "sharded": self.sharded,
            "device": self.device,
            "gpu_memory_bytes": self.gpu_memory,
            "available_bytes": self.available,
            "fits": self.fits,
            "host_pinned_bytes": self.host_pinned,
            "host_ranks": self.host_ranks,
            "host_memory_bytes": self.host_memory,
            "host_memory_from": self.host_memory_from,
            "host_fits": self.host_fits,
            "peak_bytes": self.peak,
            "peak_phase": self.worst.name,
            "phases": {p.name: {"peak_bytes": p.peak, **p.terms} for p in self.phases},
            "counts": self.counts,
            "suggestions": self.suggestions,
        }

    def _per_rank(self) -> str:
        if self.host_ranks == 1:
            return ""
        return (
            f"; {_gib(self.host_pinned)} GiB of moment shards per rank x {self.host_ranks} ranks on the host"
        )

    def _host_name(self) -> str:
        return "this machine's" if self.host_memory_from == "this machine" else "--host-memory"

    def refusal(self) -> str:
        p = self.worst
        top = sorted(p.terms.items(), key=lambda kv: -kv[1])[:4]
        what = ", ".join(f"{k} {_gib(v)} GiB" for k, v in top)
        msg = ""
        if not self.device_fits:
            where = f" at world size {self.world_size}{' (FSDP2)' if self.sharded else ''}"
            msg = (
                f"memory plan{f' ({self.role})' if self.role else ''}: the {p.name} phase needs {_gib(p.peak)} "
                f"GiB per rank ({p.peak} bytes; {what}), {_gib(self.available or 0)} GiB ({self.available} bytes) "
                f"are available{'' if self.role else where}."
            )
        if not self.host_fits:
            # The buffers are page-locked at their exact size (exactrl/train/pinned.py), not torch's power-of-two
            # pinned blocks: the text says what the count is.
            here = (
                " (this machine's RAM: `exactrl plan --host-memory GB` plans for another host)"
                if self.host_memory_from == "this machine"
                else ""
            )
            msg += (" " if msg else "memory plan: ") + (
                f'train.offload = "optimizer" keeps the masters and AdamW moments in pinned host memory: '
                f"{_gib(self.host_pinned * self.host_ranks)} GiB, one page-locked buffer of its exact size per "
                f"tensor{self._per_rank()}; {_gib(self.host_available or 0)} GiB of host memory are available "
                f"({_gib(self.host_memory or 0)} GiB RAM less {_gib(HOST_RESERVE_BYTES)} GiB for the process "
                f"and the system){here}."
            )
        if self.suggestions:
            msg += " Settings that would make it fit: " + "; ".join(self.suggestions) + "."
        else:
            msg += " No single setting tried makes it fit: a smaller model, or more memory per rank."
        return (
            msg
            + " (`exactrl plan CONFIG` prints the whole plan; train.check_memory = false skips this check.)"
        )


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


# -- the model's tensors, counted on the meta device ----------------------------------------------------------
def model_config(cfg: RunConfig):
    """The exactrl.model.ModelConfig of the run: the preset's shape, or the checkpoint's config.json."""
    from exactrl.model.config import preset
    from exactrl.model.hf import read_config

    if cfg.model.path is not None:
        return read_config(cfg.model.path)
    return preset(cfg.model.preset)


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def _meta_models(cfg: RunConfig):
    """The run's policy (LoRA applied) and critic (PPO; else None) on the meta device, by the run's own code."""
    from exactrl.model.lora import apply_lora_config
    from exactrl.model.qwen import CausalLM
    from exactrl.train.critic import ValueModel

    with torch.device("meta"):
        policy = CausalLM(model_config(cfg))
    critic = ValueModel.from_policy(policy) if cfg.algorithm.needs_critic else None
    if cfg.lora.rank > 0:
        lora_cfg = replace(cfg.lora, path=None)  # the adapter file's shapes are checked to match the section
        apply_lora_config(policy, lora_cfg, seed=cfg.run.seed)
    return policy, critic


def moment_shard_pinned_bytes(cfg: RunConfig, world_size: int) -> int:
    """FSDP2 with train.offload = "optimizer": the pinned host bytes of one rank's AdamW moments, two fp32 buffers
    per trained tensor's local shard (MasterAdamW.to_host), on the rank that holds the most: FSDP2 splits every
    parameter along dim 0 as torch.chunk does, so rank 0 holds ceil(rows / N) rows of each; each buffer is
    page-locked at its exact size (`pinned_bytes`)."""
    return sum(2 * pinned_bytes(n * 4) for shards in _local_shards(cfg, world_size) for n in shards)


_LOCAL_SHARDS: dict[tuple, list[list[int]]] = {}  # _local_shards by the model, LoRA, critic and ranks


def _local_shards(cfg: RunConfig, world_size: int) -> list[list[int]]:
    """Per optimizer (the policy's, the critic's), the element counts of rank 0's local shard of each trained
    tensor under FSDP2 (ceil(rows / N) rows: the rank that holds the most)."""
    # The suggestions re-plan a config a dozen times with other memory settings: the models' shapes are the same,
    # and building an 8B or 30B on the meta device each time took most of `exactrl plan`'s half a minute.
    key = (repr(cfg.model), repr(cfg.lora), cfg.algorithm.needs_critic, cfg.run.seed, world_size)
    if key in _LOCAL_SHARDS:
        return _LOCAL_SHARDS[key]
    policy, critic = _meta_models(cfg)
    out = []
    for model in (policy, critic):
        if model is None:
            continue
        shards = []
        for p in model.parameters():
            if p.requires_grad:
                rows = p.shape[0] if p.dim() else 1
                per_row = p.numel() // rows if rows else 0
                shards.append(-(-rows // world_size) * per_row)
        out.append(shards)
    _LOCAL_SHARDS[key] = out
    return out


def moment_shard_group_bytes(cfg: RunConfig, world_size: int) -> int:
    """FSDP2 with train.offload = "optimizer": the device bytes of the largest group of moment shards the
    streamed step brings in at once (MasterAdamW._sharded_update: groups of OFFLOAD_CHUNK_BYTES at 12 bytes an
    element, two fp32 moments each)."""
    from exactrl.train.optim import OFFLOAD_CHUNK_BYTES, offload_chunks

    return max(
        (
            8 * sum(shards[i] for i in g)
            for shards in _local_shards(cfg, world_size)
            for g in offload_chunks(shards, 12, OFFLOAD_CHUNK_BYTES)
        ),
        default=0,
    )


def count_tensors(cfg: RunConfig) -> dict[str, int]:
    """Parameter counts of the run's models, from meta-device modules built by the run's own code: the policy
    (all, trainable, frozen; with LoRA the adapters are the trainable part), the critic (PPO) and the largest
    decoder layer (what FSDP2 gathers at a time)."""
    from exactrl.train.optim import OFFLOAD_CHUNK_BYTES, offload_chunks

    policy, critic = _meta_models(cfg)
    params = list(policy.parameters())
    trainable = [p for p in params if p.requires_grad]
    # The offloaded step streams masters and moments (12 bytes per element) through the device in these groups.
    chunk = lambda ps: max(  # noqa: E731
        (
            sum(ps[i].numel() for i in g) * 12
            for g in offload_chunks([p.numel() for p in ps], 12, OFFLOAD_CHUNK_BYTES)
        ),
        default=0,
    )
    layer = max(_numel(lay.parameters()) for lay in policy.model.layers)
    # Offload's host buffers, one per fp32 tensor (MasterAdamW.to_host), page-locked at their exact size.
    pinned = lambda ps: sum(pinned_bytes(p.numel() * 4) for p in ps)  # noqa: E731
    out = {
        "policy_params": _numel(params),
        "policy_trainable": _numel(trainable),
        "policy_frozen": _numel(params) - _numel(trainable),
        "largest_layer_params": layer,
        "largest_param": max(p.numel() for p in params),
        "critic_params": 0,
        "critic_trainable": 0,
        "critic_head_fp32": 0,
        "offload_chunk_bytes": chunk(trainable),
        "offload_pinned_bytes_per_fp32_copy": pinned(trainable),
    }
    if critic is not None:
        cp = [p for n, p in critic.named_parameters() if n != "value_head"]
        out["critic_params"] = _numel(cp)
        out["critic_trainable"] = _numel(p for p in cp if p.requires_grad)
        out["critic_head_fp32"] = critic.value_head.numel()
        ctrain = [p for p in critic.parameters() if p.requires_grad]
        out["offload_chunk_bytes"] = max(out["offload_chunk_bytes"], chunk(ctrain))
        out["offload_pinned_bytes_per_fp32_copy"] += pinned(ctrain)
    return out


# -- activations -------------------------------------------------------------------------------------------
def activation_bytes_per_token(mcfg, dtype_bytes: int, layer: int) -> int:
    """Bytes per token that layer `layer`'s forward keeps for the backward (the exact kernels' saved tensors):
    the normed input and the residual of both norms, packed q|k|v, q and k after norm and RoPE, the attention
    output, its per-head log-sum-exp; the dense MLP's gate|up and silu product; or, in a sparse layer, the
    router's fp32 probabilities and top-k ids and weights, and per routed row the gate|up, the expert output
    and the row's token and slot indices (the Qwen2-MoE shared expert as a dense MLP of its width)."""
    d, b = mcfg.hidden_size, dtype_bytes
    q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
    attn = (4 * d + (q + 2 * kv) + q + kv + q) * b + 2 * 4 + mcfg.num_heads * 4
    if mcfg.qk_norm:
        attn += (mcfg.num_heads + mcfg.num_kv_heads) * 4  # the per-head rstd of the q/k norms
    if mcfg.is_moe_layer(layer):
        k, im = mcfg.num_experts_per_tok, mcfg.moe_intermediate_size
        mlp = mcfg.num_experts * 4 + k * (8 + 4) + k * ((2 * im + d) * b + 2 * 8)
        if mcfg.has_shared_expert:
            mlp += 3 * mcfg.shared_expert_intermediate_size * b + 2 * d * b
    else:
        mlp = 3 * mcfg.intermediate_size * b
    return attn + mlp


def _lm_head_bytes(mcfg, tokens: int, b: int, head_trained: bool, fp32_lm_head: bool) -> int:
    """The LM head's peak over the logprob op (exactrl/ops/triton/logprobs.py): the most logits the op keeps for
    the backward of a microbatch of up to `tokens` rows, or a chunk of them where it keeps none (the backward
    turns logits into their gradient in place), the fp32 hidden-state gradient, and the head weight's gradient
    before it is added into its buffer; an fp32 head also casts the weight and the hidden states."""
    from exactrl.ops.triton.logprobs import LOGPROB_CHUNK_ROWS, LOGPROB_KEEP_BYTES

    v, d = mcfg.vocab_size, mcfg.hidden_size
    hb = 4 if fp32_lm_head else b
    # The op keeps the logits of a call of up to LOGPROB_KEEP_BYTES // (v * hb) rows (`keeps_logits`), deciding
    # on the rows it gets (a microbatch's completion tokens, any number up to `tokens`): the worst case is the
    # most rows it would keep, or one chunk.
    rows = max(min(tokens, LOGPROB_KEEP_BYTES // (v * hb)), min(tokens, LOGPROB_CHUNK_ROWS))
    n = rows * v * hb + tokens * d * 4
    if head_trained:
        n += v * d * hb
    if fp32_lm_head:
        n += v * d * 4 + tokens * d * 4
    return n


def training_activations(cfg: RunConfig, mcfg, b: int, tokens: int, checkpointing: bool) -> dict[str, int]:
    """Activation terms of one training microbatch of `tokens` tokens."""
    per_layer = [activation_bytes_per_token(mcfg, b, i) for i in range(mcfg.num_layers)]
    d = mcfg.hidden_size
    if checkpointing:
        # Each layer keeps its two inputs (pending output and residual); one layer at a time is recomputed.
        kept = mcfg.num_layers * 2 * d * b * tokens + max(per_layer) * tokens
    else:
        kept = sum(per_layer) * tokens
    kept += 2 * d * b * tokens + LOSS_BYTES_PER_TOKEN * tokens  # the final norm's input and output, the loss
    head_trained = cfg.lora.rank == 0
    return {
        "activations": kept,
        # The backward of a layer: the gradients of its largest activations exist beside what is kept.
        "backward_working_set": max(per_layer) * tokens,
        "lm_head_logprobs": _lm_head_bytes(mcfg, tokens, b, head_trained, cfg.model.fp32_lm_head),
    }


# -- the engine -------------------------------------------------------------------------------------------
def kv_bytes_per_token(mcfg, b: int, tensor_parallel: int = 1) -> int:
    """As exactrl.engine.runner.kv_bytes_per_token: K and V of every layer, of the KV heads one rank caches
    (`kv_heads_per_rank`: num_kv_heads / T, or one when the model has fewer KV heads than T ranks)."""
    from exactrl.distributed.tensor_parallel import kv_heads_per_rank

    return mcfg.num_layers * 2 * kv_heads_per_rank(mcfg.num_kv_heads, tensor_parallel) * mcfg.head_dim * b


def engine_group_ranks(cfg: RunConfig) -> int:
    """G: the ranks that share one engine (engine.tensor_parallel / expert_parallel; 1: each rank its own)."""
    from exactrl.distributed.shared_engine import engine_group_size

    return engine_group_size(cfg.engine.tensor_parallel, cfg.engine.expert_parallel)


_SHARDS: dict[tuple, dict[str, tuple[int, int]]] = {}  # engine_shard_sizes by the model and the split


def engine_shard_params(cfg: RunConfig) -> int:
    """Elements of the weights one rank of a shared engine holds (`engine_shard_sizes`, summed)."""
    return sum(mine for _, mine in engine_shard_sizes(cfg).values())


def engine_shard_sizes(cfg: RunConfig) -> dict[str, tuple[int, int]]:
    """The weights one rank of a shared engine holds (exactrl/distributed/tensor_parallel.py and
    expert_parallel.py, what `shard_engine_model` and `shard_experts` keep), counted on the meta policy by
    parameter name: q/k/v its query heads and `kv_heads_per_rank` KV heads; o_proj, the dense MLP and a shared
    expert 1/T (gate/up by features, o_proj/down_proj by output rows); the embedding and an untied LM head
    ceil(V / T) rows each (the vocabulary padded to a multiple of T); the routed experts 1/E (whole under tensor
    parallel alone); norms, the router and the shared expert's gate whole. Every rank holds the same count.
    Returns, by parameter name, (the whole parameter's elements, the rank's)."""
    from exactrl.distributed.tensor_parallel import kv_heads_per_rank
    from exactrl.model.qwen import CausalLM

    t, e = cfg.engine.tensor_parallel, cfg.engine.expert_parallel
    key = (repr(cfg.model), t, e)
    if key in _SHARDS:
        return _SHARDS[key]
    mcfg = model_config(cfg)
    with torch.device("meta"):
        policy = CausalLM(mcfg)
    dh, nh, nkv = mcfg.head_dim, mcfg.num_heads, mcfg.num_kv_heads
    qkv_rows, qkv_rank_rows = (nh + 2 * nkv) * dh, (nh // t + 2 * kv_heads_per_rank(nkv, t)) * dh
    by_features = (".o_proj.", ".mlp.gate_up_proj.", ".mlp.down_proj.", ".shared_expert.gate_up_proj.")
    by_features += (".shared_expert.down_proj.",)
    sizes = {}
    for name, p in policy.named_parameters():
        n = p.numel()
        if ".qkv_proj." in name:
            n = n // qkv_rows * qkv_rank_rows
        elif any(k in name for k in by_features):
            n //= t
        elif name.endswith((".experts.gate_up", ".experts.down")):
            n //= e
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            n = -(-mcfg.vocab_size // t) * mcfg.hidden_size
        sizes[name] = (p.numel(), n)
    _SHARDS[key] = sizes
    return sizes


def engine_gather_bytes(cfg: RunConfig, mcfg, b: int) -> int:
    """The largest transient of a shared engine's collectives in one forward (0 at G = 1): tensor parallel's
    all-gathers build each rank's part and the whole in rank order (2x the whole: o_proj / down_proj's input and
    output of a prefill chunk, the embedding's [T, tokens, D] stack, the LM head's padded logits of a decode
    step); expert parallel's the slot outputs, [tokens * k, D] on each rank, gathered and stacked (2E + 2 of
    them)."""
    t, e = cfg.engine.tensor_parallel, cfg.engine.expert_parallel
    tokens = min(cfg.engine.max_num_batched_tokens, cfg.engine.prefill_chunk_size)
    d, out = mcfg.hidden_size, 0
    if t > 1:
        widths = [mcfg.num_heads * mcfg.head_dim, mcfg.intermediate_size]
        if mcfg.has_shared_expert:
            widths.append(mcfg.shared_expert_intermediate_size)
        vocab = -(-mcfg.vocab_size // t) * t
        out = max(
            2 * tokens * (max(widths) + d) * b,
            2 * t * tokens * d * b,
            2 * cfg.engine.max_num_seqs * vocab * b,
        )
    if e > 1:
        out = max(out, (2 * e + 2) * tokens * mcfg.num_experts_per_tok * d * b)
    return out


def rollout_tokens_needed(cfg: RunConfig, world_size: int, served: int | None = None) -> int:
    """A step's worst case on one rank, as `RolloutEngine` reserves it: each prompt once plus n completions,
    and one block per completion of slack (partial rollouts: every group in flight). served: the trainer ranks
    whose prompts the engine samples in one call (None: its own group's, `engine_group_ranks`; a generator engine:
    the trainers it serves)."""
    a, bs = cfg.algorithm, cfg.engine.block_size
    # Partial rollouts keep extra groups in flight beside the ones a step trains on (rank 0's pool is the largest);
    # a shared engine (G ranks) samples the union of its ranks' shares in one call.
    per_rank = (
        sum(a.partial_groups(0, world_size)) if a.partial_rollouts else -(-a.prompts_per_step // world_size)
    )
    prompts = per_rank * (engine_group_ranks(cfg) if served is None else served)
    n = a.group_size
    if cfg.env.name is not None:
        grow = min(episode_token_limit(cfg), cfg.engine.max_model_len)
    else:
        grow = min(cfg.sampling.max_tokens, cfg.engine.max_model_len)
    return prompts * (cfg.task.max_prompt_tokens + n * grow) + bs * n * prompts


def minibatch_may_split(cfg: RunConfig, world_size: int, tokens: int) -> bool:
    """Can a rank's share of a minibatch take more than one microbatch of `tokens`? (Its worst case: every
    sequence as long as the prompt and completion limits allow.)"""
    a = cfg.algorithm
    if cfg.env.name is not None:
        longest = min(episode_token_limit(cfg), cfg.engine.max_model_len)
    else:
        longest = min(cfg.task.max_prompt_tokens + cfg.sampling.max_tokens, cfg.engine.max_model_len)
    prompts = -(-a.prompts_per_step // world_size)
    sequences = -(-prompts * a.group_size // a.minibatches_per_rollout)
    return sequences * longest > tokens


def kv_cache_blocks(
    cfg: RunConfig,
    mcfg,
    b: int,
    world_size: int,
    free: int | None,
    *,
    fraction: float | None = None,
    served: int | None = None,
    engine_sized: bool = False,
) -> int:
    """The KV blocks of the run (the scratch block not included): `engine.num_kv_blocks`, else
    `kv_memory_fraction` of `free` (on a GPU: what the phases holding the cache leave free, the scratch block
    taken off; None: the engine's CPU budget, exactrl.engine.runner.auto_num_blocks), capped by a step's worst
    case. fraction: another fraction than engine.kv_memory_fraction (a generator's); served: as
    `rollout_tokens_needed`'s; engine_sized: the engine sizes the cache itself from `free` (`auto_num_blocks`,
    a generator rank's), with the scratch block beyond the fraction, where the plan hands the run its blocks."""
    bs = cfg.engine.block_size
    per_block = kv_bytes_per_token(mcfg, b, cfg.engine.tensor_parallel) * bs
    if cfg.engine.num_kv_blocks:
        return cfg.engine.num_kv_blocks
    fraction = cfg.engine.kv_memory_fraction if fraction is None else fraction
    need = -(-rollout_tokens_needed(cfg, world_size, served) // bs) + 1
    if free is None:
        budget = int(CPU_KV_BUDGET * fraction)
    else:
        budget = int(max(0, free) * fraction) - (0 if engine_sized else per_block)
    return max(2, min(need, budget // per_block))


def kv_cache_bytes(cfg: RunConfig, mcfg, b: int, blocks: int) -> int:
    """Device bytes of a KV cache of `blocks` blocks plus the scratch block (exactrl.engine.runner)."""
    return (blocks + 1) * kv_bytes_per_token(mcfg, b, cfg.engine.tensor_parallel) * cfg.engine.block_size


def prefill_working_set(cfg: RunConfig, mcfg, b: int) -> int:
    """The engine's eager forward working set: a prefill chunk's widest intermediates (one layer at a time)."""
    e = cfg.engine
    tokens = min(e.max_num_batched_tokens, e.prefill_chunk_size)
    q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
    width = max(
        2 * mcfg.intermediate_size + mcfg.intermediate_size,
        mcfg.num_experts_per_tok * 3 * max(mcfg.moe_intermediate_size, 1),
    )
    return tokens * (width + q + 2 * kv + 3 * mcfg.hidden_size) * b


def decode_step_bytes(cfg: RunConfig, mcfg) -> int:
    """A decode step's fp32 logits, sampling noise and int64 ids for every running sequence: on CUDA with
    engine.cuda_graphs they live in the decode graphs' pool, which the engine keeps between generations."""
    return cfg.engine.max_num_seqs * mcfg.vocab_size * (4 + 4 + 8)


def decode_working_set(cfg: RunConfig, mcfg, b: int, cuda: bool) -> int:
    """The engine's whole forward working set (prefill chunk, and a decode step's on CUDA)."""
    return prefill_working_set(cfg, mcfg, b) + (decode_step_bytes(cfg, mcfg) if cuda else 0)


# -- the plan ----------------------------------------------------------------------------------------------
def is_sharded(world_size: int, sharded: bool | None = None) -> bool:
    """Whether a run at `world_size` trains under FSDP2. sharded: what the run does (`Parallelism.sharded`: any
    process group, torchrun at one rank included); None: world size 2 or more, the only way to tell without
    knowing whether torchrun started it. More than one rank always shards."""
    if sharded is None:
        return world_size > 1
    if not sharded and world_size > 1:
        raise ValueError(f"sharded=False at world size {world_size}: more than one rank always runs FSDP2")
    return sharded


def plan_memory(
    cfg: RunConfig,
    *,
    world_size: int = 1,
    gpu_memory: int | None = None,
    device: str = "cuda",
    counts: dict[str, int] | None = None,
    host_memory: int | None = None,
    host_ranks: int | None = None,
    sharded: bool | None = None,
) -> MemoryPlan:
    """Each phase's predicted peak bytes on one rank of `world_size`. gpu_memory: the device's bytes (None: no
    fit check, and the KV cache sized as on the CPU). device: "cuda" or "cpu" (CUDA graphs and the Triton AdamW
    only exist on CUDA). host_ranks: the ranks that share one host's memory (default all: one node). sharded:
    FSDP2's layout (True under torchrun at any world size; None: world size 2 or more, `is_sharded`)."""
    from exactrl.model.hf import dtype_from_name
    from exactrl.train.phases import releases_memory

    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    mcfg = model_config(cfg)
    c = counts if counts is not None else count_tensors(cfg)
    b = torch.empty((), dtype=dtype_from_name(cfg.model.dtype)).element_size()
    n = world_size
    sharded = is_sharded(n, sharded)
    cuda = device.startswith("cuda")
    tr, a = cfg.train, cfg.algorithm
    offload = tr.offload == "optimizer"
    has_master = b != 4
    # engine.release_memory: the KV cache and (FSDP2) the engine replica leave the device for the training and
    # optimizer phases (exactrl/train/phases.py).
    release = releases_memory(cfg)
    # A disaggregated run's trainer (distributed.generator_ranks > 0): the engine runs on the generator ranks, so
    # this device holds no KV cache and no decode graphs; it keeps the replica it sends them (and at k >= 1 the
    # guard's forward on it, counted as an engine forward's working set).
    trainer_only = cfg.distributed.generator_ranks > 0
    # The ranks sharing this rank's engine (a disaggregated trainer holds a whole replica: the engine, split or
    # not, runs on the generators).
    group = 1 if trainer_only else engine_group_ranks(cfg)
    if group > 1 and not sharded:
        raise ValueError(f"an engine shared by {group} ranks needs torchrun ranks (FSDP2)")

    resident: dict[str, int] = {}  # held in every phase
    engine_held: dict[str, int] = {}  # the engine's: in generation, and in the others unless released
    opt_state: dict[str, int] = {}  # masters and moments: on the device only for the step when offloaded
    grads: dict[str, int] = {}
    train_extra: dict[str, int] = {}
    if not sharded:
        resident["policy_weights"] = c["policy_params"] * b
        if has_master:
            opt_state["policy_masters_fp32"] = c["policy_trainable"] * 4
        opt_state["policy_adamw_moments"] = 2 * c["policy_trainable"] * 4
        # The trainer's gradient buffers stay allocated (zeroed in place) so the graphs can add into them.
        resident["policy_grads"] = c["policy_trainable"] * b
    else:
        # Trainer shards: what trains in fp32 (the masters), what is frozen in the model dtype; a full replica for
        # the engine; gradients as fp32 shards between backward and step.
        # The replica's trained part is released for training (the sync refreshes it anyway); a frozen base
        # (LoRA) stays on the device in every phase.
        engine_held["engine_replica"] = c["policy_trainable"] * b
        frozen_held = c["policy_frozen"]
        if group > 1:  # a shared engine: this rank's shard (with LoRA: the base's shard frozen, the adapters)
            shard = engine_shard_params(cfg)
            frozen_held = shard if c["policy_frozen"] else 0
            engine_held["engine_replica"] = (c["policy_trainable"] if c["policy_frozen"] else shard) * b
        if frozen_held:
            resident["engine_replica_frozen"] = frozen_held * b
        resident["policy_shards"] = -(-(c["policy_trainable"] * 4 + c["policy_frozen"] * b) // n)
        opt_state["policy_adamw_moments"] = -(-2 * c["policy_trainable"] * 4 // n)
        grads["policy_grad_shards"] = -(-c["policy_trainable"] * 4 // n)
        # FSDP2 gathers a layer in the model dtype (and prefetches the next) and reduce-scatters its fp32 grads.
        train_extra["fsdp_unsharded_layers"] = c["largest_layer_params"] * (2 * b + 4)
        if tr.fsdp_reduce == "minibatch" and minibatch_may_split(
            cfg, n, microbatch_tokens(cfg, n, sharded=True)
        ):
            # Until a minibatch's last microbatch each rank accumulates every trained gradient unsharded, in fp32.
            train_extra["fsdp_accumulated_grads"] = (
                c["policy_trainable"] + c["critic_trainable"] + c["critic_head_fp32"]
            ) * 4
    if a.max_off_policy_steps > 0 and not sharded:
        # One step off: the engine samples from its own copy of the weights in the model dtype (the whole model,
        # a LoRA base included), held for the run. Generation then overlaps training; the plan's phases do not
        # model that overlap yet (docs/memory.md). Under torchrun the engine replica above is that copy.
        resident["behaviour_copy"] = c["policy_params"] * b
    if trainer_only and a.max_off_policy_steps > 0 and not a.partial_rollouts:
        # Disaggregated one step off: the guard of a batch runs on a copy of the weights that sampled it while the
        # replica moves on to the next version (exactrl/train/drivers/offpolicy.py).
        resident["guard_copy"] = c["policy_params"] * b
    if a.kl_coef > 0 and cfg.lora.rank == 0:  # with LoRA the reference is the base with adapters off
        resident["reference_model"] = -(-c["policy_params"] * b // n)
    if c["critic_params"]:
        frozen = c["critic_params"] - c["critic_trainable"]
        head = c["critic_head_fp32"] * 4
        if not sharded:
            resident["critic_weights"] = c["critic_params"] * b + head
            if has_master:
                # Every trained tensor gets a master copy, the fp32 value head too.
                opt_state["critic_masters_fp32"] = (c["critic_trainable"] + c["critic_head_fp32"]) * 4
            grads["critic_grads"] = c["critic_trainable"] * b + head
        else:
            resident["critic_shards"] = -(-(c["critic_trainable"] * 4 + frozen * b + head) // n)
            grads["critic_grad_shards"] = -(-(c["critic_trainable"] * 4 + head) // n)
        opt_state["critic_adamw_moments"] = -(-2 * (c["critic_trainable"] + c["critic_head_fp32"]) * 4 // n)

    tokens = microbatch_tokens(cfg, n, sharded=sharded)
    act = training_activations(cfg, mcfg, b, tokens, tr.activation_checkpointing)
    # As PolicyTrainer decides: graphs on CUDA, one device, no mixture of experts (its host-side expert counts
    # cannot be captured; those microbatches run eagerly and their activations are transient).
    graphs = tr.cuda_graphs and cuda and not sharded and not mcfg.is_moe
    if graphs:
        # Everything the captured microbatch allocates lives in the graphs' private pool, kept from the first
        # training step on, in the generation phase too: its activations, and the larger of what the LM head's
        # backward (its kept logits among it) and a layer's backward need beside them (the pool reuses what the
        # head's backward frees for the layers').
        resident["train_graph_pool"] = act["activations"] + max(
            act["backward_working_set"], act["lm_head_logprobs"]
        )
        act = {}
    decode = decode_step_bytes(cfg, mcfg) if cuda and not trainer_only else 0
    if cuda and cfg.engine.cuda_graphs and not trainer_only:
        # The decode graphs (and their pool) are kept between generations: in the training phase too.
        resident["decode_graph_pool"] = decode
        decode = 0
    held = {**resident, **({} if offload else opt_state)}
    gen_other = {**held, **engine_held}
    if not trainer_only:  # a trainer of a disaggregated run holds no engine: nothing to prefill, no cache
        gen_other["engine_working_set"] = prefill_working_set(cfg, mcfg, b) + decode
    if group > 1:
        gen_other["engine_gathers"] = engine_gather_bytes(cfg, mcfg, b)
    train_other = {**held, **({} if release else engine_held), **grads, **train_extra, **act}
    if offload and has_master and not sharded:
        # The offloaded step streams the masters and moments through the device a group at a time.
        step_other = {**resident, "optimizer_state_chunk": c["offload_chunk_bytes"], **grads}
        if not cuda:  # the CPU path's fp32 gradient copies, of one group
            step_other["master_grads_fp32"] = c["offload_chunk_bytes"] // 3
    elif offload and sharded:
        # FSDP2: the moment shards stream through the device a group at a time (the fp32 shards are the weights,
        # on the device in every phase).
        step_other = {**resident, "optimizer_state_chunk": moment_shard_group_bytes(cfg, n), **grads}
    else:
        step_other = {**resident, **opt_state, **grads}
        if has_master and not sharded and not cuda:
            # The CPU (torch AdamW) path gives the masters fp32 copies of the gradients; the Triton step reads them.
            step_other["master_grads_fp32"] = c["policy_trainable"] * 4
    if not release:
        step_other.update(engine_held)

    ckpt_other: list[dict[str, int]] = []
    if group > 1 and (tr.save_every > 0 or tr.save_at_end):
        # A shared engine holds slices: a checkpoint's policy/ (and a replay report) is written from a whole copy
        # in the model dtype that rank 0 gathers on its device (`Parallelism.whole_engine_model`), after the weight
        # sync gave the shard back, one full weight in flight.
        whole = {"whole_engine_rank0": c["policy_params"] * b, "gathered_weight": c["largest_param"] * b}
        ckpt_other.append({**held, **engine_held, **whole})

    # The KV cache: `kv_memory_fraction` of what the phases that hold it leave free. Released, only generation
    # holds it; kept, it must fit beside the training and optimizer phases too. The RL loop allocates exactly
    # this many blocks (exactrl/train/phases.py), so the plan is what the run does.
    available = None if gpu_memory is None else gpu_memory - CUDA_CONTEXT_BYTES
    free = None
    if available is not None and cuda:
        holding = [gen_other] if release else [gen_other, train_other, step_other, *ckpt_other]
        free = available - max(sum(t.values()) for t in holding)
    blocks = kv_cache_blocks(cfg, mcfg, b, n, free)
    kv = kv_cache_bytes(cfg, mcfg, b, blocks) if not trainer_only else 0
    cache = {} if trainer_only else {"kv_cache": kv}

    gen = Phase("generation", {**gen_other, **cache})
    train = Phase("training", {**train_other, **({} if release else cache)})
    step = Phase("optimizer", {**step_other, **({} if release else cache)})
    phases = [gen, train, step]
    if sharded:
        # Before FSDP2 shards anything each rank holds the policy whole in the model dtype (built or loaded on its
        # device), a KL reference's and a critic's whole copies when the run has them, and, as each layer is cast
        # to its fp32 masters just before it is sharded, one layer in fp32; the engine replica is structure alone
        # until the policy is sharded (`Parallelism.engine_model`). A run whose set-up does not fit would stop
        # before its first step: the plan says so before anything loads.
        setup = {
            "policy_whole": c["policy_params"] * b,
            "fsdp_cast_layer_fp32": c["largest_layer_params"] * 4,
        }
        if a.kl_coef > 0 and cfg.lora.rank == 0:
            setup["reference_whole"] = c["policy_params"] * b
        if c["critic_params"]:
            setup["critic_whole"] = c["critic_params"] * b + c["critic_head_fp32"] * 4
        phases.insert(0, Phase("setup", setup))
    for other in ckpt_other:
        phases.append(Phase("checkpoint", {**other, **({} if release else cache)}))
    counts_out = {
        **c,
        "dtype_bytes": b,
        "tokens_per_microbatch": tokens,
        "kv_bytes_per_token": kv_bytes_per_token(mcfg, b, cfg.engine.tensor_parallel),
        "engine_ranks": group,
        "engine_shard_params": engine_shard_params(cfg) if group > 1 else c["policy_params"],
        "rollout_tokens_needed": rollout_tokens_needed(cfg, n),
        "kv_blocks": blocks,
        "release_memory": int(release),
        "train_graphs": int(graphs),
    }
    # Offload: moments (two fp32 copies) and, for a 16-bit model, the fp32 masters, in pinned host buffers (pinned
    # only on CUDA); under FSDP2 each rank's moment shards only (the fp32 parameter shards stay on the device).
    host = 0
    if offload and cuda:
        if sharded:
            host = moment_shard_pinned_bytes(cfg, n)
        else:
            host = c["offload_pinned_bytes_per_fp32_copy"] * (3 if has_master else 2)
    return MemoryPlan(
        world_size=n,
        sharded=sharded,
        device=device,
        available=available,
        gpu_memory=gpu_memory,
        phases=phases,
        counts=counts_out,
        host_pinned=host,
        host_memory=host_memory,
        host_ranks=n if host_ranks is None else host_ranks,
    )


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
    from exactrl.train.preflight import check_shared_engine

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
            out.append(f"{label} (peak {_gib(p2.peak)} GiB)")
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
    kw = dict(
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


# The microbatch sizes FSDP2 runs try before the configured one (train.fsdp_tokens_per_microbatch unset), largest
# first: fewer FSDP2 microbatches, fewer rounds of per-layer collectives.
FSDP_MICROBATCH_CANDIDATES = (32768, 16384)
# A candidate is taken only with this much of the device to spare beyond its plan: an automatic choice stays inside
# the plan's accuracy (within 10% of measured peaks on the GPU, docs/memory.md), where a configured size may go to
# the limit.
GROW_HEADROOM = 0.9


def microbatch_tokens(cfg: RunConfig, world_size: int, *, sharded: bool | None = None) -> int:
    """The trainer's microbatch token budget at `world_size`: train.fsdp_tokens_per_microbatch when set and the
    run is sharded (FSDP2: `sharded`, None = world size 2 or more), else train.max_tokens_per_microbatch."""
    fsdp = cfg.train.fsdp_tokens_per_microbatch
    return (
        fsdp if is_sharded(world_size, sharded) and fsdp is not None else cfg.train.max_tokens_per_microbatch
    )


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
    kw = dict(
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


# -- a generator rank (disaggregated: distributed.generator_ranks > 0) --------------------------------------------
# The last G ranks of the job run the rollout engine alone (exactrl/train/disagg.py): no trainer state, no phases
# to switch between. What one holds: its engine's weights (a 1/S shard on an engine split over S ranks; with LoRA the
# base's shard and the adapters) from the start; the KV cache the engine sizes itself at its first generation (never
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
    weights = {"engine_weights": engine_shard_params(cfg) * b}
    lora = cfg.lora.rank > 0
    if lora:
        # The adapters, counted whole: a split engine's B keeps its projection's rows only (a little less).
        weights["lora_adapters"] = c["policy_trainable"] * b
    sync = sync_sizes(cfg)
    first = {"sync_bucket": sync["full_bucket"] * b}
    step = {"sync_bucket": sync["step_bucket"] * b}
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
    from exactrl.train.preflight import check_shared_engine

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


def gpu_memory_bytes(gb: float | None, flag: str = "--gpu-memory") -> int | None:
    """--gpu-memory GB (or `flag`'s, --host-memory) as bytes, counted in GiB (2**30 bytes) as torch reports
    memory: an "80 GB" H100 has 79.6 GiB in all, so `--gpu-memory 80` is a hair more than it has. The device must
    hold more than the CUDA context, the host more than what the plan leaves to the process and the system: less
    would be planned as a negative number of bytes available."""
    if gb is None:
        return None
    if not (isinstance(gb, (int, float)) and math.isfinite(gb) and gb > 0):
        raise ValueError(f"{flag} must be a positive number of GB, got {gb!r}")
    floor, what = (
        (HOST_RESERVE_BYTES, "left to the process and the system")
        if flag == "--host-memory"
        else (CUDA_CONTEXT_BYTES, "of CUDA context outside torch's allocator")
    )
    if gb * GiB <= floor:
        raise ValueError(
            f"{flag} {gb:g}: the plan counts {_gib(floor)} GiB {what}; give more than {floor / GiB:g} GB"
        )
    return int(gb * GiB)
