"""Expert parallel for the rollout engine (`engine.expert_parallel = E`): the E ranks of one engine each hold
num_experts / E of every sparse layer's routed experts (rank r: experts r * E/E .. contiguous), and a token's
output is bitwise the one-device engine's.

Why the bits cannot change (the MoE rules of DESIGN.md, applied across ranks):
- The router is replicated: every rank computes the same logits, top-k and weights from the same input.
- A token's expert computation runs whole on the rank that holds the expert, through the same `ops.moe_experts`
  on that rank's stack: the exact backends give a row its bits whatever other rows its expert received and
  wherever it sits (the op's contract), so computing only this rank's (token, rank) slots changes nothing. The op
  is asked for each slot alone, with routing weight 1.0 (k = 1): its combine then rounds `1.0 * o.float()` once
  to the model dtype, which is o itself (the guard's layer probe does the same, exactrl/train/layer_probe.py).
- Tokens to experts and back: the ranks of an engine hold the same tokens (the activations are replicated, or
  gathered whole by tensor parallel), so a rank picks its slots locally; an all-gather of the slot outputs (bytes)
  brings every slot's output to every rank.
- The combine is the exact backends' own, in fp32 in rank order (`combine_rank_order`: mul then add, each
  rounded, one cast), on the same [T, k, D] outputs. The Triton combine adds w0 * o0 to an accumulator of 0,
  which differs from w0 * o0 only in the sign of a zero (0 + -0 = +0), and torch.equal does not see that.

Two ways to compute a rank's slots, the same bits (a row's bits do not depend on the other rows of the call):
- static (the engine's static decode step, `exactrl.model.moe.static_decode_step`: its warm-up, its graph capture
  and its replays without graphs alike, and any call while a CUDA graph is being captured): every rank runs
  all T * k slots through its own stack, a slot of another rank's expert sent to this rank's expert of the same
  index within its block (`id % per`: the owners' rows are right, the others' are computed and never read). No
  data-dependent shape, no host synchronisation: the decode step fits a CUDA graph. The price is E times the
  expert rows, which a decode step (a few rows per expert, bound by reading the weights) hardly notices.
- by count (every other call: prefill, an eager decode): the rank picks its own slots (`nonzero`, a host
  synchronisation) and computes those alone, E times fewer rows. (A prefill chunk computed the static way would
  pay E times the expert rows where it is bound by compute.)

The all-gather moves T * k * D per rank (each rank's slots at their place in the buffer): simple and exact; an
all-to-all of variable counts would move a 1/E share. Not done: expert parallel in the trainer (FSDP2 shards the
stacks there), experts that E does not divide (refused by key).
"""

from __future__ import annotations

import torch
from torch import nn

from exactrl.distributed.tensor_parallel import EngineShardCausalLM, TensorParallelGroup, as_engine_shard
from exactrl.model.config import ModelConfig
from exactrl.model.moe import Experts, SparseMoeBlock, in_static_decode_step
from exactrl.model.qwen import CausalLM
from exactrl.ops import Ops
from exactrl.ops.moe_torch import combine_rank_order


class ExpertParallelExperts(nn.Module):
    """A sparse layer's routed experts split over the engine's ranks: this rank's `gate_up` [E/size, 2I, D] and
    `down` [E/size, D, I], experts first_expert .. first_expert + E/size - 1."""

    # fp8 (exactrl/model/precision.py): these stacks run the fp8 recipe as `Experts`' do. Each expert is blocked on
    # its own, so a rank's experts quantize to the whole stack's bits for them.
    routed_expert_stacks = True

    def __init__(self, experts: Experts, group: TensorParallelGroup):
        super().__init__()
        per = experts.num_experts // group.size
        self.first_expert, self.group = group.rank * per, group
        self.num_experts, self.intermediate_size = experts.num_experts, experts.intermediate_size
        span = slice(self.first_expert, self.first_expert + per)
        self.gate_up = nn.Parameter(experts.gate_up[span].detach().clone(), requires_grad=False)
        self.down = nn.Parameter(experts.down[span].detach().clone(), requires_grad=False)

    def forward(self, ops: Ops, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        per = self.gate_up.shape[0]
        flat = ids.reshape(-1)  # slot s = t * k + r
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or in_static_decode_step():
            # Every slot here; an owned one's local expert is id - first_expert = id % per (contiguous blocks).
            ones = torch.ones(T * k, 1, dtype=torch.float32, device=x.device)
            rows = x.unsqueeze(1).expand(T, k, x.shape[1]).reshape(T * k, x.shape[1])  # row s: token s // k
            mine = ops.moe_experts(rows, self.gate_up, self.down, ones, (flat % per)[:, None])
        else:
            local = flat - self.first_expert
            slots = ((local >= 0) & (local < per)).nonzero()[:, 0]
            mine = x.new_zeros(T * k, x.shape[1])
            if slots.numel():
                ones = torch.ones(slots.numel(), 1, dtype=torch.float32, device=x.device)
                mine[slots] = ops.moe_experts(
                    x[slots // k], self.gate_up, self.down, ones, local[slots, None]
                )
        every = torch.stack(self.group.gather(mine))  # [size, T * k, D]: each slot's output on its owner
        outs = every[flat // per, torch.arange(T * k, device=x.device)].view(T, k, x.shape[1])
        return combine_rank_order(outs, weights, x.dtype)


def check_expert_parallel(model: CausalLM, size: int) -> None:
    """Refuse, by key, what `shard_experts` does not do."""
    if size > 1 and not any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        raise ValueError(
            f"engine.expert_parallel = {size}: the model has no sparse (mixture-of-experts) layer; set it to 1"
        )
    check_expert_parallel_shape(model.config, size)


def check_expert_parallel_shape(cfg: ModelConfig, size: int) -> None:
    """`check_expert_parallel` from the model's config alone (nothing built: `exactrl plan`, the run's preflight).
    LoRA needs nothing of it: a mixture-of-experts model's adapters are on the attention projections only
    (`add_lora` refuses the MLP targets), which expert parallel leaves whole on every rank."""
    if size == 1:
        return
    key = f"engine.expert_parallel = {size}"
    if not any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        raise ValueError(f"{key}: the model has no sparse (mixture-of-experts) layer; set it to 1")
    if cfg.num_experts % size:
        raise ValueError(f"{key} does not divide the model's {cfg.num_experts} experts")


@torch.no_grad()
def shard_experts(model: CausalLM, group: TensorParallelGroup) -> EngineShardCausalLM | CausalLM:
    """Split every sparse layer's routed experts of the engine's own model over `group`, in place (the model may
    be split by tensor parallel already, over the same group). Returns the model."""
    check_expert_parallel(model, group.size)
    if group.size == 1:
        return model
    shard = as_engine_shard(model, group)
    per = model.config.num_experts // group.size
    lo = group.rank * per

    def take(full: torch.Tensor) -> torch.Tensor:
        return full[lo : lo + per].contiguous()

    for name, m in model.named_modules():
        if isinstance(m, SparseMoeBlock):
            m.experts = ExpertParallelExperts(m.experts, group)
            shard.shard_slicers[f"{name}.experts.gate_up"] = take
            shard.shard_slicers[f"{name}.experts.down"] = take
    # The static decode step computes every slot (module docstring): a CUDA graph holds it. (Picking the
    # rank's slots by count, as before, failed graph capture with "operation not permitted when stream is
    # capturing" on 2 x H200, 2026-11-28.)
    return shard
