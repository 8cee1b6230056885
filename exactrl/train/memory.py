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
(`bash benchmarks/gpu.sh plan-check`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from exactrl.config import RunConfig, episode_token_limit
from exactrl.model.hf import run_model_config as model_config
from exactrl.train.drivers.modes import driver_of, off_policy

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
    fp8 = cfg.model.precision == "fp8"
    out["fp8_values"], out["fp8_scales"] = fp8_copy_elements(policy) if fp8 else (0, 0)
    out["fp8_op_values"], out["fp8_op_scales"] = fp8_copy_elements(policy, per_op=True) if fp8 else (0, 0)
    split = cfg.engine.tensor_parallel > 1 or cfg.engine.expert_parallel > 1
    out["fp8_shard_values"], out["fp8_shard_scales"] = (
        fp8_copy_elements(policy, engine_shard_sizes(cfg)) if fp8 and split else (0, 0)
    )
    return out


def fp8_copy_elements(
    model, shard: dict[str, tuple[int, int]] | None = None, per_op: bool = False
) -> tuple[int, int]:
    """(e4m3 values, fp32 scales) of one fp8 copy of `model`'s projections (`model.precision = "fp8"`), as
    `quantize_weight` stores them: every [..., N, K] projection weight with K padded to whole 128-blocks, one byte
    a value, and one scale per row and 128-block (each row holds its block's scale). shard: `engine_shard_sizes`,
    for the copy one rank of a split engine holds (its rows of each weight: every split keeps K whole). per_op:
    the largest copy one op quantizes for itself (an FSDP2 trainer's, `Fp8Weight.current`): one projection, or a
    layer's routed experts (gate_up and down)."""
    from exactrl.model.precision import fp8_projections
    from exactrl.ops.fp8 import BLOCK

    names = {id(p): n for n, p in model.named_parameters()}
    by_op: dict[int, tuple[int, int]] = {}  # a module's weights are quantized for its one op
    for mod, name, _ in fp8_projections(model):
        w = getattr(mod, name)
        *lead, n, k = w.shape
        rows, blocks = math.prod(lead) * n, -(-k // BLOCK)
        if shard is not None:
            whole, mine = shard[names[id(w)]]
            rows = rows * mine // whole
        values, scales = by_op.get(id(mod), (0, 0))
        by_op[id(mod)] = (values + rows * blocks * BLOCK, scales + rows * blocks)
    if per_op:
        return max(by_op.values(), default=(0, 0))
    return sum(v for v, _ in by_op.values()), sum(s for _, s in by_op.values())


def fp8_copy_bytes(c: dict[str, int], cuda: bool, shard: bool = False, per_op: bool = False) -> int:
    """Bytes of one holder's fp8 copy of the policy's projections (0 unless fp8): the e4m3 values and fp32 scales,
    and on the CPU the exact float64 copy of the values the CPU's GEMM reads (`Fp8Weight.operand`). shard: the
    copy of one rank of a split engine (engine.tensor_parallel / expert_parallel). per_op: the largest copy one op
    of an FSDP2 trainer quantizes for itself (`fp8_copy_elements`)."""
    key = "fp8_shard" if shard else "fp8_op" if per_op else "fp8"
    values, scales = c.get(f"{key}_values", 0), c.get(f"{key}_scales", 0)
    return values + 4 * scales + (0 if cuda else 8 * values)


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
    by_features: tuple[str, ...] = (
        ".o_proj.",
        ".mlp.gate_up_proj.",
        ".mlp.down_proj.",
        ".shared_expert.gate_up_proj.",
    )
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
    # fp8 (`model.precision`): every holder of the weights holds its own fp8 copy of the projections, whole (an
    # FSDP2 trainer, its KL reference and its critic keep the copies of their gathered weights from one step to the
    # next), except an FSDP2 model with train.fsdp_fp8_copies = "per_use": each of its ops quantizes its gathered
    # weights for itself, so one op's copy is alive at a time, during a forward (the training phase).
    fp8 = fp8_copy_bytes(c, cuda)
    fp8_per_use = bool(fp8) and sharded and tr.fsdp_fp8_copies == "per_use"
    if fp8_per_use:
        train_extra["fsdp_fp8_op_copy"] = fp8_copy_bytes(c, cuda, per_op=True)
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
        if fp8:  # the replica's copy stays when its weights are released (the sync re-quantizes in place)
            resident["engine_replica_fp8"] = fp8_copy_bytes(c, cuda, shard=group > 1)
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
    driver = driver_of(cfg)
    if off_policy(driver) and not sharded:
        # One step off: the engine samples from its own copy of the weights in the model dtype (the whole model,
        # a LoRA base included), held for the run. Generation then overlaps training; the plan's phases do not
        # model that overlap yet (docs/memory.md). Under torchrun the engine replica above is that copy.
        resident["behaviour_copy"] = c["policy_params"] * b
        if fp8:
            resident["behaviour_copy_fp8"] = fp8
    if trainer_only and driver == "one_step_off":
        # Disaggregated one step off: the guard of a batch runs on a copy of the weights that sampled it while the
        # replica moves on to the next version (exactrl/train/drivers/offpolicy.py).
        resident["guard_copy"] = c["policy_params"] * b
        if fp8:
            resident["guard_copy_fp8"] = fp8
    if a.kl_coef > 0 and cfg.lora.rank == 0:  # with LoRA the reference is the base with adapters off
        resident["reference_model"] = -(-c["policy_params"] * b // n)
        if fp8 and not fp8_per_use:
            resident["reference_fp8"] = fp8
    if fp8 and not fp8_per_use:
        resident["policy_fp8"] = fp8
        if c["critic_params"]:  # the critic is a copy of the policy: fp8 projections too
            resident["critic_fp8"] = fp8
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
        if fp8:  # each whole model's fp8 copy, quantized at load (dropped when it is sharded)
            copies = 1 + int("reference_whole" in setup) + int("critic_whole" in setup)
            setup["fp8_whole_copies"] = copies * fp8
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
