"""The sparse MLP of Qwen3-MoE and Qwen2-MoE: a router, routed experts and (Qwen2-MoE) a gated shared expert.

    logits = gate(x)                                   # [T, E], the invariant `linear`
    weights, ids = ops.moe_route(logits, k, norm)      # fp32 softmax top-k, ties to the lowest expert id
    out = ops.moe_experts(x, gate_up, down, weights, ids)
    out = out + sigmoid(shared_expert_gate(x)) * shared_expert(x)   # Qwen2-MoE only, as transformers adds it

The routed experts are stacked parameters (`gate_up` [E, 2I, D]: expert e's gate rows then its up rows; `down`
[E, D, I]) so that a backend can run them as one grouped GEMM; the state dict speaks the hub's per-expert names
(`mlp.experts.{e}.gate_proj.weight`, `.up_proj.weight`, `.down_proj.weight`), which is what transformers writes
and loads, whatever layout it keeps in memory. The engine and the trainer run this same module through the same
ops, so the trainer's router picks the experts the engine's did by itself: no routing replay.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from exactrl.model.config import ModelConfig
from exactrl.model.layers import MLP, Linear
from exactrl.ops import Ops

_PROJS = ("gate_proj", "up_proj", "down_proj")

# Whether this thread is running the engine's static decode step (warm-up, graph capture or a static replay):
# experts split over ranks then compute every slot on each rank, with no data-dependent shape
# (exactrl/distributed/expert_parallel.py). A thread-local: a one-step-off engine decodes in a worker thread.
_decode_state = threading.local()


@contextmanager
def static_decode_step() -> Iterator[None]:
    """The engine's static decode step runs inside this (`exactrl.engine.runner`): see `in_static_decode_step`."""
    before = getattr(_decode_state, "on", False)
    _decode_state.on = True
    try:
        yield
    finally:
        _decode_state.on = before


def in_static_decode_step() -> bool:
    """Whether the calling thread is inside `static_decode_step`."""
    return getattr(_decode_state, "on", False)


class Experts(nn.Module):
    """E routed experts as two stacked parameters; `state_dict()` names them per expert as HF does (views, no
    copy), `load_state_dict()` stacks them back."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)

    def forward(self, ops: Ops, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D], weights: [T, k] fp32, ids: [T, k] -> [T, D]: the routed experts through `ops.moe_experts`
        (an expert-parallel engine shard swaps this module, exactrl/distributed/expert_parallel.py)."""
        return ops.moe_experts(x, self.gate_up, self.down, weights, ids)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        d, i = self.gate_up.shape[2], self.intermediate_size
        return {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded (FSDP2 DTensor) stack gathered once, as a plain tensor; anything else as it is. Slicing the
    DTensor per expert would gather the whole stack again for every slice (3 * E all-gathers of the stack per
    layer); gathered once, the per-expert entries are views of one full tensor. Either way every rank must call
    `state_dict()` (a collective, as any full state dict of a sharded model is)."""
    # torch.distributed.tensor is looked up, not imported (about a second at start-up, sympy with it): no tensor is
    # a DTensor before that module is loaded, and a process that never shards never needs it.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.full_tensor() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def _split_experts(module: Experts, state_dict, prefix: str, local_metadata) -> None:
    gate_up = _full(state_dict.pop(f"{prefix}gate_up", None))
    down = _full(state_dict.pop(f"{prefix}down", None))
    i = module.intermediate_size
    for e in range(module.num_experts):
        if gate_up is not None:
            state_dict[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :i]
            state_dict[f"{prefix}{e}.up_proj.weight"] = gate_up[e, i:]
        if down is not None:
            state_dict[f"{prefix}{e}.down_proj.weight"] = down[e]


def _stack_experts(
    module: Experts, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
) -> None:
    names = {p: [f"{prefix}{e}.{p}.weight" for e in range(module.num_experts)] for p in _PROJS}
    every = [n for ns in names.values() for n in ns]
    present = [n for n in every if n in state_dict]
    if not present:
        return  # a state dict in exactrl's own stacked names, or nothing for this module: load as usual
    if len(present) < len(every):  # left for load_state_dict to report: the stacked entries stay missing
        missing_keys.extend(n for n in every if n not in state_dict)
        return
    shapes = module.hf_shapes()
    bad = [
        f"{n}: shape {tuple(state_dict[n].shape)}, the model needs {shapes[p]}"
        for p, ns in names.items()
        for n in ns
        if tuple(state_dict[n].shape) != shapes[p]
    ]
    if bad:
        errors.extend(bad)
        return
    pieces = {p: [state_dict.pop(n) for n in ns] for p, ns in names.items()}
    gate_up = [torch.cat((g, u), dim=0) for g, u in zip(pieces["gate_proj"], pieces["up_proj"])]
    state_dict[f"{prefix}gate_up"] = torch.stack(gate_up)
    state_dict[f"{prefix}down"] = torch.stack(pieces["down_proj"])


@dataclass
class RouterRecord:
    """What one sparse layer's router decided in one forward: the tensors the forward itself used.

    layer: the decoder layer index; logits: [T, E] in the model dtype (attached to the autograd graph when the
    forward ran with grad, so a loss on them trains the router); weights: [T, k] fp32; ids: [T, k] int64."""

    layer: int
    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor


class RouterCollector:
    """The router outputs of the forwards run while it is attached (`collect_router_outputs`), in call order.

    A seam between the model and whoever reads its routing (the trainer's router metrics and auxiliary losses,
    the guard's layer probe): an object the caller holds and attaches to the blocks of one model, never module-
    global state, so the engine sampling from the same model object (one device) records nothing."""

    def __init__(self, layers: dict[int, int]) -> None:
        self._layers = layers  # id(block) -> decoder layer index
        self.records: list[RouterRecord] = []

    def record(self, block: SparseMoeBlock, logits, weights, ids) -> None:
        self.records.append(RouterRecord(self._layers[id(block)], logits, weights, ids))


def _layer_index(name: str, ordinal: int) -> int:
    """The decoder layer of a block named `...layers.<i>.mlp` (the index in the checkpoint's names)."""
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return ordinal


@contextmanager
def collect_router_outputs(model: nn.Module) -> Iterator[RouterCollector]:
    """Attach a fresh RouterCollector to every SparseMoeBlock of `model` for the duration of the block (a dense
    model: it records nothing). Detach before a backward that recomputes the forward (activation checkpointing),
    or the recomputation would be recorded a second time."""
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
    collector = RouterCollector({id(m): _layer_index(n, k) for k, (n, m) in enumerate(blocks)})
    for n, m in blocks:
        if m.router_collector is not None:
            raise RuntimeError(f"{n}: a router collector is already attached (nested collect_router_outputs)")
    try:
        for _, m in blocks:
            m.router_collector = collector
        yield collector
    finally:
        for _, m in blocks:
            m.router_collector = None


def has_experts(model: nn.Module) -> bool:
    """Whether `model` has a sparse (mixture-of-experts) layer."""
    return any(isinstance(m, SparseMoeBlock) for m in model.modules())


class SparseMoeBlock(nn.Module):
    """Router `gate` ([E, D], HF `mlp.gate.weight`), routed `experts`, and for Qwen2-MoE the `shared_expert` (a
    dense MLP of shared_expert_intermediate_size) with its sigmoid `shared_expert_gate` ([1, D])."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.has_shared_expert:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1)
        # Set only inside `collect_router_outputs` (the trainer's training forward, the guard's probe).
        self.router_collector: RouterCollector | None = None

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D] in x.dtype."""
        logits = self.gate(ops, x)
        weights, ids = ops.moe_route(logits, self.top_k, self.norm_topk_prob)
        if self.router_collector is not None:
            self.router_collector.record(self, logits, weights, ids)
        out = self.experts(ops, x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:  # both or neither
            # transformers' order and dtypes: sigmoid of the gate in the model dtype, times the shared output,
            # added to the routed output (each product and sum rounded once to the model dtype). The sigmoid goes
            # through the ops: torch's CPU sigmoid rounds a tensor's tail differently from its body (DESIGN rule 9).
            shared = ops.sigmoid(self.shared_expert_gate(ops, x)) * self.shared_expert(ops, x)
            out = out + shared
        return out
