"""FSDP2 applied from outside the single-device model code, and the engine's weight replica.

`Parallelism` is what the RL loop asks about layout; the model, the trainer and the engine stay single-device
code. On one device without torchrun (`Parallelism(DistContext.single())`) the trainer and the engine share one
model and nothing here does anything. Under torchrun:

- Trainer: the policy (and the reference model, and the critic) are `fully_shard`ed per decoder layer and at the
  root, with trainable parameters kept in fp32 (the sharded parameters *are* the master weights; frozen ones,
  a LoRA base or the KL reference, stay in the model dtype) and
  `MixedPrecisionPolicy(param_dtype=<model dtype>, reduce_dtype=float32)`: the forward computes with the
  all-gathered parameters cast to the model dtype, gradients are reduce-scattered in fp32.
- Engine: one per rank (or one per group of `engine.tensor_parallel` / `engine.expert_parallel` ranks, each rank
  holding its slice of the weights: the sync copies that slice of each gathered weight,
  exactrl/distributed/shared_engine.py), on a full-weight replica in the model dtype, refreshed in place after
  every optimizer step from the shards (`sync_weights`: cast each shard to the model dtype, all-gather, copy into
  the replica's own tensors, so captured CUDA graphs stay valid). A cast is elementwise, so casting then gathering gives the
  bits FSDP's own cast-then-gather gives the trainer's forward: the engine samples with the very weights the
  trainer computes with (tests/distributed checks it with `torch.equal` on every rank).
"""

from __future__ import annotations

import copy
import time
import types

import torch
from torch import nn

from exactrl.distributed.env import DistContext
from exactrl.model.precision import (
    follow_gathered,
    fp8_copy_memo,
    fp8_rows_of_whole,
    refresh_fp8,
    register_fp8,
    set_fp8,
)
from exactrl.model.qwen import CausalLM


def _checkpointed_forward(layer: nn.Module, *args, **kwargs):
    """A decoder layer's forward under `torch.utils.checkpoint` while grad is enabled, else the plain forward."""
    from torch.utils.checkpoint import checkpoint

    inner = type(layer).forward  # the class's forward (FSDP2's subclass inherits the layer's own)
    if torch.is_grad_enabled():
        return checkpoint(inner, layer, *args, use_reentrant=False, **kwargs)
    return inner(layer, *args, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wrap each decoder layer's forward of `model` (a CausalLM, or a ValueModel around one) in
    `torch.utils.checkpoint` (non-reentrant): while grad is enabled the layer saves only its inputs and runs again
    in the backward; without grad (the engine, reference and old-policy scoring) it runs as before. Applies before
    or after `fully_shard` (FSDP2 hooks the module call, this wraps the forward inside it; in the backward FSDP
    has gathered the layer's parameters before the recomputation reads them). The wrapper is a method bound to
    the layer, so a deepcopy of the model (the engine replica, the reference model) stays bound to its own
    layers. Returns the number of layers wrapped."""
    lm = model if isinstance(model, CausalLM) else model.backbone
    wrapped = 0
    for layer in lm.model.layers:
        if getattr(layer, "activation_checkpointing", False):
            continue
        # An instance attribute: nn.Module.__call__ (and FSDP's hooks around it) call it.
        layer.forward = types.MethodType(_checkpointed_forward, layer)
        layer.activation_checkpointing = True
        wrapped += 1
    return wrapped


class Parallelism:
    """The layout of one run's models over its ranks (see the module docstring)."""

    def __init__(self, ctx: DistContext, fp8_copies: str = "kept") -> None:
        self.ctx = ctx
        # fp8 (model.precision): the trainer's copies of its gathered weights, kept or per use (`follow_gathered`).
        self.fp8_copies = fp8_copies
        self.sharded = ctx.distributed
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._trained: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Memory phases: the replica's storages are freed while the trainer runs (`release_replica`) and come
        # back in the next `sync_weights`, which then gathers every weight.
        self._replica_bytes: list[tuple[torch.UntypedStorage, int]] = []
        self.replica_released = False
        self._engine: CausalLM | None = None  # the engine's model (`bind`)
        self.mesh = None
        if self.sharded:
            from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

            device_type = "cuda" if ctx.backend == "nccl" else "cpu"
            if ctx.group is None:
                self.mesh = init_device_mesh(device_type, (ctx.world_size,))
            else:  # the trainers of a disaggregated run: FSDP2 over their own group, the generators left out
                self.mesh = DeviceMesh.from_group(ctx.group, device_type)

    def engine_model(self, model: CausalLM) -> CausalLM:
        """The model the rollout engine samples from: the policy itself on one device; under FSDP a replica in
        the model dtype, taken before the policy is sharded as its structure alone (parameters on the meta
        device: no second whole copy of the weights on the device while the policy is still whole; an engine
        group may split it as it is). `bind` gives it memory once the policy is sharded and fills every weight
        from the shards (the weight sync's gather: bf16 -> fp32 master -> bf16 is the identity, so the bytes are
        the policy's)."""
        if not self.sharded:
            return model
        self._replica_device = model.device
        memo: dict[int, object] = {}
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        fp8_copy_memo(model, memo)  # fp8: the replica's own copies are made from its weights (`bind`)
        return copy.deepcopy(model, memo).requires_grad_(False)

    def parallelize(self, model: nn.Module, *, trainable: bool = True) -> None:
        """Shard `model` (a CausalLM or a ValueModel around one) in place; no-op on one device."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        lm = model if isinstance(model, CausalLM) else model.backbone
        compute_dtype = lm.dtype
        layers = list(lm.model.layers)
        every_trains = all(p.requires_grad for p in model.parameters())
        if every_trains:
            # The sharded fp32 parameters are the masters: cast a layer just before it is sharded (below), then
            # what lies outside the layers, so the full model never stands in fp32 on the device (qwen3-30b-a3b:
            # 122 GB beside its 61 GB bf16 replica ran a 2 x H200 rank out of memory, 2026-11-28).
            _float_outside(model, layers)
        else:
            # Frozen weights (a LoRA base, a KL reference) never step: they stay in the model dtype, half the
            # memory of fp32 shards, gathered as they are (the cast to the model dtype is then the identity, the
            # same bits the engine replica holds). Only what trains gets fp32 masters.
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        # cast_forward_inputs=False: the layers take fp32 inputs on purpose (the RoPE table is fp32 whatever the
        # model dtype, as on one device); FSDP's default would round them to the model dtype, and the trainer's
        # logprobs would then differ from the engine's (a bf16 model: every token).
        mp = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        for layer in layers:
            if every_trains:
                layer.float()
            fully_shard(layer, mesh=self.mesh, mp_policy=mp)
        if lm is not model:  # a ValueModel: its value head stays fp32, as on one device
            fully_shard(lm, mesh=self.mesh, mp_policy=mp)
            mp = MixedPrecisionPolicy(
                param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
            )
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        # fp8: each projection's copy is quantized from its gathered weight, the bits the replica gets.
        follow_gathered(model, self.fp8_copies)
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                # The loss is already divided by the global token (or sequence) count: sum, never average
                # (and a plain SUM, which gloo has, not a pre-multiplied one, which it lacks).
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        if not trainable:
            model.requires_grad_(False)

    def bind(self, trainer_model: CausalLM, engine_model: CausalLM) -> None:
        """Pair each trainer parameter with the engine replica's tensor of the same name."""
        if not self.sharded:
            return
        structure_only = any(p.is_meta for p in engine_model.parameters())
        if structure_only:  # `engine_model`'s replica: its memory now that the policy is sharded
            made: dict[int, nn.Parameter] = {}  # tied weights stay one parameter
            for m in engine_model.modules():  # the parameters alone (the buffers were copied whole)
                for key, t in m._parameters.items():
                    if t is not None and t.is_meta:
                        if id(t) not in made:
                            empty = torch.empty_like(t, device=self._replica_device)
                            made[id(t)] = nn.Parameter(empty, requires_grad=False)
                        m._parameters[key] = made[id(t)]
        register_fp8(engine_model)  # fp8: its projections as they are now, quantized from the synced weights
        mine = dict(engine_model.named_parameters())
        self._pairs = []
        self._trained = []
        self._names: dict[int, str] = {}
        self._engine = engine_model
        for name, p in trainer_model.named_parameters():
            if name not in mine:
                raise RuntimeError(f"engine replica has no parameter {name!r}")
            self._pairs.append((p, mine[name]))
            self._names[id(mine[name])] = name
            if p.requires_grad:
                self._trained.append((p, mine[name]))
        if structure_only:
            self.sync_weights(full=True)
        refresh_fp8(engine_model)

    @torch.no_grad()
    def whole_engine_model(self) -> CausalLM | None:
        """The engine's model with whole weights, for what rank 0 writes (a checkpoint's policy/, a mismatch
        report): the replica itself, or, when the replica is an engine shard (engine.tensor_parallel or
        expert_parallel: each rank holds a slice), a copy gathered from the trainer's shards now, on rank 0 (every
        rank calls it then: the gathers are collectives; None on the other ranks). Its bytes are the ones the
        weight sync gives a whole replica: the same cast, then all-gather."""
        from exactrl.distributed.tensor_parallel import EngineShardCausalLM

        shard = self._engine
        if not isinstance(shard, EngineShardCausalLM):
            return shard
        whole = None
        if self.ctx.is_main:
            with torch.device("meta"):
                whole = CausalLM(shard.config, ops=shard.ops, fp32_lm_head=shard.fp32_lm_head)
                if shard.lora_spec is not None:
                    # The adapters, whole (their values come with the gather below).
                    from exactrl.model.lora import add_lora

                    add_lora(whole, shard.lora_spec)
            whole = whole.to(dtype=shard.dtype).to_empty(device=shard.device).requires_grad_(False)
        mine = dict(whole.named_parameters()) if whole is not None else {}
        for p, e in self._pairs:
            gathered = p.detach().to(e.dtype).full_tensor()
            if whole is not None:
                mine[self._names[id(e)]].copy_(gathered)
        return whole

    def replica_weights(self, full: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The replica's tensors that `sync_weights(full)` refreshes, by name, in its order: what a
        disaggregated run's trainer 0 sends on to the generators after that sync."""
        return [(self._names[id(e)], e) for _, e in (self._pairs if full else self._trained)]

    def release_replica(self) -> int:
        """Free the engine replica's trained parameters' storage until the next `sync_weights` (the training
        phase: the engine does not run), which refreshes exactly those anyway: the release adds no gather. A
        frozen base (LoRA) stays: rebuilding it would cost a whole-model gather every step. The tensors keep their
        shapes and stay the engine model's parameters; only their storage is resized to 0, as FSDP2 frees its own
        unsharded parameters. Returns the bytes freed; 0 on one device (the engine samples from the trainer's
        model)."""
        if not self.sharded or self.replica_released:
            return 0
        seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for _, e in self._trained:
            st = e.untyped_storage()
            seen.setdefault(id(st), (st, st.nbytes()))  # tied weights share one storage
        self._replica_bytes = list(seen.values())
        for st, _ in self._replica_bytes:
            st.resize_(0)
        self.replica_released = True
        return sum(n for _, n in self._replica_bytes)

    def _restore_replica(self) -> None:
        for st, n in self._replica_bytes:
            st.resize_(n)  # new (uninitialised) memory: every byte is overwritten by the full gather
        self._replica_bytes = []
        self.replica_released = False

    @torch.no_grad()
    def sync_weights(self, full: bool = False) -> dict[str, float]:
        """Refresh the engine replica from the trainer's shards, in place; returns time and bytes moved. After
        an optimizer step only the trainable parameters move (the LoRA adapters, with LoRA: a frozen base never
        changes); `full` moves every weight (after loading a checkpoint). A released replica gets its storage
        back first; the gather then writes every byte of it."""
        if not self.sharded:
            return {}
        t0 = time.perf_counter()
        if self.replica_released:
            self._restore_replica()
        moved = 0
        e = None
        for p, e in self._pairs if full else self._trained:
            gathered = p.detach().to(e.dtype).full_tensor()
            # The engine's part of the full weight: all of it, or a tensor-parallel shard's slice (bytes either way).
            name = self._names[id(e)]
            e.copy_(self._engine.shard_full_weight(name, gathered))
            rows = fp8_rows_of_whole(self._engine, name, gathered)  # fp8, a tensor-parallel shard: its rows
            if rows is not None:
                set_fp8(self._engine, e, *rows)
            moved += gathered.numel() * gathered.element_size()
        # fp8: the replica quantizes the weights it was sent (the bits the trainer's forward quantizes), now: the
        # next forward may be a decode graph's replay.
        refresh_fp8(self._engine)
        if e is not None and e.is_cuda:
            torch.cuda.synchronize(e.device)
        return {"time/weight_sync_s": time.perf_counter() - t0, "weight_sync/bytes": float(moved)}


def _float_outside(model: nn.Module, layers: list[nn.Module]) -> None:
    """What `model.float()` does, for the parameters and buffers outside `layers` (each layer is cast on its own,
    just before FSDP2 shards it)."""
    inside = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in inside and p.is_floating_point():
                p.data = p.data.float()
        for key, b in m._buffers.items():
            if b is not None and id(b) not in inside and b.is_floating_point():
                m._buffers[key] = b.float()
