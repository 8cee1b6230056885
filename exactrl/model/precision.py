"""`model.precision` applied to a built model: which of a CausalLM's weights run the fp8 recipe of
`exactrl.ops.fp8` (every attention, MLP and expert projection; not the LM head, the embedding, the norms or the
router). Here, a level above the ops, because choosing the weights needs the model's modules.

Every holder of the weights quantizes the model-dtype weights it holds with the same function, so holders of the
same bits hold the same fp8 copy:
- one process: the policy itself (`use_fp8` at load; the optimizer re-quantizes after each step);
- under torchrun, the FSDP2 trainer (`follow_gathered`): a projection's fp8 copy is made from its all-gathered
  weight (the cast of the fp32 master shards to the model dtype), kept from one step to the next (the default) or
  made for each of its ops and freed after it (`train.fsdp_fp8_copies = "per_use"`);
- the engine replica (`register_fp8` once its parameters exist, `refresh_fp8` after each weight sync): from the
  weights the sync wrote, which are those same gathered bits;
- a generator rank holds each fp8 projection as its copy alone (`empty_fp8_only`: no model-dtype weight), which
  the sync sends (`fp8_sync_tensors`), or quantized on arrival from a model-dtype weight (`fp8_receive_weight`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from exactrl.model.layers import Linear, PackedLinear
from exactrl.model.moe import Experts, SparseMoeBlock
from exactrl.model.qwen import CausalLM
from exactrl.ops.fp8 import PRECISIONS, Fp8Ops, check_fp8_device, is_weightless, quantize_weight

Projection = tuple[nn.Module, str, list[int] | None]  # (module, weight attribute, packed parts)


def fp8_projections(model: CausalLM) -> list[Projection]:
    """Every weight that runs in fp8: attention, MLP and expert projections (not the LM head, the embedding, the
    norms, or the router and Qwen2-MoE's shared-expert gate, which route in the model dtype)."""
    keep = {id(getattr(model, "lm_head", None))}
    for mod in model.modules():
        if isinstance(mod, SparseMoeBlock):
            keep |= {id(mod.gate), id(getattr(mod, "shared_expert_gate", None))}
    out: list[Projection] = []
    for mod in model.modules():
        # An expert-parallel engine shard's stacks (exactrl/distributed/expert_parallel.py) are the same kind.
        if isinstance(mod, Experts) or getattr(mod, "routed_expert_stacks", False):
            gate_up = cast(torch.Tensor, mod.gate_up)
            inter = gate_up.shape[1] // 2
            out += [(mod, "gate_up", [inter, inter]), (mod, "down", None)]
        elif isinstance(mod, Linear) and id(mod) not in keep:
            out.append((mod, "weight", list(mod.parts.values()) if isinstance(mod, PackedLinear) else None))
    return out


def use_fp8(model: CausalLM, *, quantize: bool = True) -> Fp8Ops:
    """Switch `model` (a CausalLM) to fp8 projections: wrap its ops in `Fp8Ops` and register every projection
    (`fp8_projections`), quantized now (quantize=False: at first use, for weights whose values come later)."""
    check_fp8_device(model.device)
    ops = model.ops if isinstance(model.ops, Fp8Ops) else Fp8Ops(model.ops)
    for mod, name, parts in fp8_projections(model):
        ops.register(getattr(mod, name), parts, quantize=quantize)
    model.set_ops(ops)
    return ops


def apply_precision(model: CausalLM, precision: str, *, quantize: bool = True) -> CausalLM:
    """`model.precision` applied to a built model: "dtype" (every projection in the model dtype, as always) leaves
    it as it is; "fp8" switches its projections to fp8 (`use_fp8`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"model.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8":
        use_fp8(model, quantize=quantize)
    return model


def empty_fp8_only(model: CausalLM, device: torch.device | str, precision: str) -> CausalLM:
    """A model made as its structure (meta parameters, split or not) given memory on `device` (`to_empty`) and
    `precision` applied, for a holder whose weights all come from the weight sync (a generator rank). In fp8 it
    allocates no model-dtype weight for any fp8 projection (`fp8_projections`): each is held as its fp8 copy alone
    (values and scales, filled by the sync) and its weight is a placeholder of its shape and dtype over one NaN
    element (every stride 0, `is_weightless`): shape-reading code (LoRA, the sync's buckets) keeps working, the
    forward never reads it (Fp8Ops computes from the copy), and any write into it fails (torch refuses to write
    elements that share memory)."""
    if precision != "fp8":
        return apply_precision(model.to_empty(device=device), precision, quantize=False)
    held = [(mod, name, getattr(mod, name)) for mod, name, _ in fp8_projections(model)]
    for mod, name, _ in held:
        mod._parameters[name] = None  # `to_empty` skips it, and the parameter keeps its place in the module
    model = model.to_empty(device=device)
    nan: dict[torch.dtype, torch.Tensor] = {}
    for mod, name, w in held:
        one = nan.setdefault(w.dtype, torch.full((), float("nan"), dtype=w.dtype, device=device))
        mod._parameters[name] = nn.Parameter(one.expand(w.shape), requires_grad=False)
    return apply_precision(model, precision, quantize=False)


def fp8_receive_weight(
    model: nn.Module, params: Mapping[str, torch.Tensor], name: str, whole: torch.Tensor
) -> bool:
    """The weight sync sent `name` as its whole model-dtype weight (the first sync after a warm start: the sender's
    weights have no fp8 copy) to a model that holds this projection as its fp8 copy alone (`empty_fp8_only`):
    quantize it into the copy now, with the trainers' function (a tensor-parallel shard: its rows of the whole
    weight's copy, `fp8_rows_of_whole`; an expert shard: its own experts, each blocked alone). Returns False where
    `model` holds the weight itself (the caller copies it in)."""
    lm, ops = _fp8_ops(model)
    param = params[name]
    entry = ops.entry_of(param) if ops is not None else None
    if entry is None or not is_weightless(param):
        return False
    rows = fp8_rows_of_whole(model, name, whole)
    if rows is not None:
        entry.set(*rows)
    else:
        entry.quantize(lm.shard_full_weight(name, whole))
    return True


def _fp8_ops(model: nn.Module) -> tuple[Any, Fp8Ops | None]:
    # A ValueModel (the critic): its backbone's ops.
    lm = model if isinstance(model, CausalLM) else getattr(model, "backbone", model)
    ops = getattr(lm, "ops", None)
    return lm, ops if isinstance(ops, Fp8Ops) else None


def is_fp8(model: nn.Module) -> bool:
    """Whether `model` (a CausalLM, or a ValueModel around one) computes its projections in fp8."""
    return _fp8_ops(model)[1] is not None


def fp8_copy_memo(model: nn.Module, memo: dict[int, Any]) -> None:
    """For a structure-only deep copy of `model` taken with `memo` (the engine replica, whose weights come from
    the sync): the copy gets fp8 ops with no weight registered, instead of a copy of every fp8 buffer."""
    import copy

    lm, ops = _fp8_ops(model)
    if ops is not None:
        memo[id(ops)] = Fp8Ops(copy.deepcopy(ops.inner, memo))


def register_fp8(model: nn.Module) -> None:
    """Register `model`'s projections anew, as they are now (their parameters were replaced: the engine replica's
    own, given memory after the copy), each quantized at its first use or `refresh_fp8`. No-op if not fp8."""
    lm, ops = _fp8_ops(model)
    if ops is not None:
        ops.clear()
        use_fp8(lm, quantize=False)


def refresh_fp8(model: nn.Module) -> int:
    """After a weight sync wrote `model`'s weights in place: re-quantize now (not at the next forward, which may be
    a CUDA graph's replay) every fp8 copy whose weight was written since it was made. Returns how many."""
    lm, ops = _fp8_ops(model)
    if ops is None:
        return 0
    # (A copy held alone is never stale: its weight is never written; until the sync sends it, it is unfilled. A
    # per-use entry, an FSDP2 trainer's, keeps no copy to refresh.)
    stale = [
        e
        for e in ops.entries()
        if e.param._version != e.version and not is_weightless(e.param) and not e.per_use
    ]
    for entry in stale:
        entry.current()
    return len(stale)


def fp8_rows_of_whole(
    model: nn.Module, name: str, whole: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A tensor-parallel engine shard (exactrl/distributed/tensor_parallel.py) holds rows of a whole weight, and a
    slice need not start on a 128-row block of its projection: its fp8 copy is the rows of the *whole* weight's copy
    (quantized as the trainer quantizes it, then cut by the weight's own slicer), never its slice quantized alone.
    Returns (q, scale) for the weight `name` of `model` given its whole value, or None where the weight is not an
    fp8 projection the shard slices (it quantizes what it holds: the whole weight)."""
    lm, ops = _fp8_ops(model)
    slicer = getattr(lm, "shard_slicers", {}).get(name) if ops is not None else None
    # Not sliced here, or an expert stack (each expert is blocked on its own: its copy is the whole's).
    if slicer is None or whole.dim() != 2:
        return None
    module_name, attr = name.rsplit(".", 1)
    module = lm.get_submodule(module_name)
    param = getattr(module, attr)
    entry = ops.entry_of(param) if ops is not None else None
    if entry is None:
        return None
    # A packed projection is blocked part by part: the whole weight's parts (the split keeps the shard's own).
    parts = getattr(module, "whole_parts", None)
    q, scale = quantize_weight(whole.detach(), parts)
    return slicer(q), slicer(scale)


def set_fp8(model: nn.Module, param: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """`param`'s fp8 copy is (q, scale) (`fp8_rows_of_whole`), once `param` holds its new value."""
    _, ops = _fp8_ops(model)
    entry = ops.entry_of(param) if ops is not None else None
    if entry is None:
        raise RuntimeError("set_fp8: the parameter has no fp8 copy")
    entry.set(q, scale)


# What the weight sync sends of one weight (`fp8_sync_tensors`): the weight itself, or an fp8 projection's copy as
# its e4m3 values (sent as bytes) and its fp32 scales: 1 + 4 / 128 bytes a weight element instead of 2 (bf16).
SYNC_KINDS = ("weight", "fp8_values", "fp8_scales")


def fp8_sync_tensors(
    model: nn.Module | None, named: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, str, torch.Tensor]]:
    """The (name, kind, tensor)s a weight sync sends for `named`, `model`'s (name, tensor)s: an fp8 projection of
    `model` goes as its current fp8 copy (values, scales), every other tensor as it is. Every receiver then holds
    the sender's fp8 bits, which are what it would quantize from the same weights (`fp8_sync_targets`)."""
    _, ops = _fp8_ops(model) if model is not None else (None, None)
    out: list[tuple[str, str, torch.Tensor]] = []
    for name, t in named:
        entry = ops.entry_of(t) if ops is not None else None
        if entry is None:
            out.append((name, "weight", t))
            continue
        copy = entry.current()  # (a per-use entry's is a copy of its own: the entry's buffers are empty)
        out += [(name, "fp8_values", copy.q.view(torch.uint8)), (name, "fp8_scales", copy.scale)]
    return out


def fp8_sync_targets(
    model: nn.Module, params: Mapping[str, torch.Tensor], names: list[str], kinds: list[str]
) -> list[torch.Tensor]:
    """The receiver's side of `fp8_sync_tensors`: the tensor each sent one is received into, in order (an fp8
    copy's buffers themselves: its values as bytes)."""
    _, ops = _fp8_ops(model)
    out = []
    for name, kind in zip(names, kinds):
        p = params[name]
        if kind == "weight":
            out.append(p)
            continue
        entry = ops.entry_of(p) if ops is not None else None
        if entry is None:
            raise RuntimeError(f"the weight sync sent the fp8 copy of {name!r}, which has no fp8 copy here")
        out.append(entry.q.view(torch.uint8) if kind == "fp8_values" else entry.scale)
    return out


def fp8_sync_received(
    model: nn.Module, params: Mapping[str, torch.Tensor], names: list[str], kinds: list[str]
) -> None:
    """After `fp8_sync_targets`' tensors were filled: each fp8 copy received is the copy of its weight as it is."""
    _, ops = _fp8_ops(model)
    for name, kind in zip(names, kinds):
        if kind == "fp8_values" and ops is not None:
            entry = ops.entry_of(params[name])
            assert entry is not None  # fp8_sync_targets received into it
            entry.set(entry.q, entry.scale)


FSDP_FP8_COPIES = ("kept", "per_use")  # `train.fsdp_fp8_copies`


class _FollowGathered:
    """A forward pre-hook of one fp8 projection's module under FSDP2: the module's weight is then the gathered
    one (its decoder layer's FSDP2 hook ran first). Its fp8 entry is registered once, under that tensor (FSDP2
    keeps one object and re-fills its storage at every gather), in one of two modes (`train.fsdp_fp8_copies`):

    - kept (per_use False): the entry keeps its copy, with the shard as the source the optimizer steps, so a step
      marks it stale (`requantize_after_step`, and a sharded checkpoint's load `fp8_weights_changed`) and the next
      forward quantizes the new gather: one quantization of each weight a step (a frozen one's, a LoRA base's or
      a KL reference's, one a run), the whole model's copies held on every rank.
    - per_use: each op that reads the weight quantizes the gather of the moment into a copy of its own, freed
      when the op returns (`Fp8Weight.current`). No copy outlives its op (nothing to mark stale), and activation
      checkpointing's recomputed forward quantizes the re-gathered bits again: one quantization of each weight
      per forward. Not a release in a forward post-hook: the recomputation stops early, inside the layer's last
      projection, and its post-hook never runs."""

    def __init__(self, ops: Fp8Ops, weights: list[tuple[str, list[int] | None, nn.Parameter]], per_use: bool):
        self.ops = ops
        self.weights = weights  # (attribute, parts, the shard FSDP2 set on the module)
        self.per_use = per_use

    def __call__(self, module: nn.Module, args: Any) -> None:
        for name, parts, shard in self.weights:
            w = getattr(module, name)
            # Not gathered (a forward outside FSDP2's hooks): the ops would fall back to the model dtype.
            if w is shard:
                raise RuntimeError(f"fp8 under FSDP2: {type(module).__name__}.{name} was not gathered")
            if self.ops.entry_of(w) is None:
                self.ops.register(w, parts, source=shard, per_use=self.per_use, quantize=False)


def follow_gathered(model: nn.Module, copies: str = "kept") -> int:
    """Under FSDP2, after `fully_shard` (exactrl/distributed/parallelize.py): the registrations of the weights
    before sharding go (FSDP2 replaced those parameters; keeping them would keep whole weights alive), and each fp8
    projection quantizes its gathered weight (`_FollowGathered`), its copy kept or made per use (`copies`, one of
    `FSDP_FP8_COPIES`: `train.fsdp_fp8_copies`). Returns the projections followed."""
    if copies not in FSDP_FP8_COPIES:
        raise ValueError(f"train.fsdp_fp8_copies must be one of {FSDP_FP8_COPIES}, got {copies!r}")
    lm, ops = _fp8_ops(model)
    if ops is None:
        return 0
    ops.clear()
    by_module: dict[int, tuple[nn.Module, list[tuple[str, list[int] | None, nn.Parameter]]]] = {}
    for mod, name, parts in fp8_projections(lm):
        by_module.setdefault(id(mod), (mod, []))[1].append((name, parts, getattr(mod, name)))
    for mod, weights in by_module.values():
        mod.register_forward_pre_hook(_FollowGathered(ops, weights, per_use=copies == "per_use"))
    return sum(len(w) for _, w in by_module.values())


def fp8_weights_changed(model: nn.Module) -> None:
    """The shards of an FSDP2 model were written outside the optimizer (a sharded checkpoint's load): every kept
    fp8 copy is re-made from its next gather (a per-use entry keeps none)."""
    _, ops = _fp8_ops(model)
    if ops is not None:
        for entry in ops.entries():
            entry.version = -1
