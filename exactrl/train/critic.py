"""The PPO critic: a decoder of the policy's shape with a scalar value head, its own weights.

Position convention (the same as the logprobs'): the value of response token t is read at the position whose
logits produced token t, i.e. at the input row of token t-1. In a packed batch the value of `targets[j]` is
`values[j]`, so values, logprobs and `response_mask` line up row for row.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from exactrl.model.qwen import CausalLM
from exactrl.train.packing import PackedBatch


class ValueModel(nn.Module):
    """A `CausalLM` backbone (no LM head use) plus `value_head: [1, D]` read in fp32."""

    def __init__(self, backbone: CausalLM):
        super().__init__()
        self.backbone = backbone
        d = backbone.config.hidden_size
        self.value_head = nn.Parameter(torch.zeros(1, d, dtype=torch.float32, device=backbone.device))

    @staticmethod
    def from_policy(policy: CausalLM, init_from_policy: bool = True, seed: int = 0) -> ValueModel:
        """A critic with the policy's shape: a deep copy of its weights, or a fresh random init."""
        backbone = copy.deepcopy(policy)
        if not init_from_policy:
            backbone.init_weights(seed + 1)
        for p in backbone.parameters():
            p.requires_grad_(True)
        if backbone.lm_head is not None:  # the critic never uses the LM head: do not train or store it twice
            backbone.lm_head.weight.requires_grad_(False)
        return ValueModel(backbone)

    def forward(self, pb: PackedBatch) -> torch.Tensor:
        """Values of every target row of the packed batch: [T] fp32."""
        h = self.backbone(pb.input_ids, pb.batch.q_pos, pb.batch)
        return self.backbone.ops.linear(h.float(), self.value_head)[:, 0]
